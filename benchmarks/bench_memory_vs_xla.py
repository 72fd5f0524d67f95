"""Memory per device of a training step: the compiled XLA program vs the memory model.

For each JAX example (MLP, transformer, CNN) and each model of the
third-party corpus (``tests/jax_corpus.py``), on 8 simulated CPU devices, and
for three plans (the optimal plan, data parallel, and data parallel with FSDP
(ZeRO-3) and every operator recomputing, with 2 micro-batches where the batch
allows), a whole Adam step (``optax.adam``, the model's 2 words of optimizer
state per weight) is compiled as the plan says (:mod:`shardplan.jax.memory`,
parameters and optimizer state donated) and XLA's
``compile().memory_analysis()`` is read:

* ``xla_state`` = argument bytes minus the batch: parameters and optimizer
  state as held between steps; the model's ``weights + optimizer`` part;
* ``xla_step`` = temp + output - alias: what exists during the step only
  (gradients, saved activations, anything gathered, workspace); the model's
  ``gradients + activations`` part;
* ``xla_total`` = argument + output - alias + temp, an upper bound of XLA's
  peak per device; the model's ``peak_bytes`` under both gradient-buffer
  options of :class:`shardplan.fit.FitOptions`: ``persistent`` (the additive
  S + G + A, ratio ``total``) and ``backward`` (the peak over the backward
  steps, gradients appearing as saved activations are freed: what XLA's own
  buffer assignment does; ratio ``total_backward``; the same as the additive
  with 2 micro-batches, whose gradients are accumulated).

    PYTHONPATH=. python benchmarks/bench_memory_vs_xla.py [model ...]

(naming models reruns only those, replacing their rows) writes ``benchmarks/results/memory_vs_xla.json`` with every ratio (XLA /
model) and, for a total ratio outside ±10 %, its cause (:func:`explain`,
from the parts measured). These are XLA's CPU backend figures: the CPU
compiler fuses and schedules differently from the GPU one (no
latency-hiding scheduler, other fusion decisions), so temporaries in
particular may differ on a GPU.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import importlib.util  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TOY = dict(num_devices=8, peak_flops=32e9, bandwidth=16e9, name="toy")
TOLERANCE = 0.10


def load_example(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "examples", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def predicted_parts(plan: Any) -> dict[str, float]:
    """The model's per-device bytes by part: weights, gradients, optimizer state, saved activations.

    Per operator with value bytes P per device of its weights, replica group G and stage s
    (:mod:`shardplan.fit`): weights P (P/G at s = 3), gradients P (P/G at s >= 2),
    optimizer state o P (o P / G at s >= 1).
    """
    from shardplan.cost.memory import weight_groups

    mc, tables = plan.memory_choices, plan.tables
    o = float(tables.options.get("optimizer_factor", 2.0))
    out = {"weights": 0.0, "gradients": 0.0, "optimizer": 0.0, "activations": 0.0}
    gathered = 0.0
    for i, (op, lay) in enumerate(zip(tables.graph.operators, tables.arrays)):
        k = plan.assignment[i]
        wg = weight_groups(op, lay, None, tables.machine)
        p, g, s = float(wg.state[k]), float(wg.group[k]), mc.stage(i)
        out["weights"] += p / g if s == 3 else p
        out["gradients"] += p / g if s >= 2 else p
        out["optimizer"] += o * p / g if s >= 1 else o * p
        out["activations"] += float(mc.choice_tables[i].activation_bytes[mc.choices[i]])
        gathered += p if s == 3 else 0.0
    out["total"] = sum(out.values())
    assert math.isclose(out["total"], plan.memory["peak_bytes"], rel_tol=1e-9)
    out["gathered_tiles"] = gathered  # not part of the total: the weight tiles a stage-3 plan gathers (once)
    return out


def backward_prediction(plan: Any) -> dict[str, Any]:
    """The backward-peak model's peak (``FitOptions.grad_buffers = "backward"``) and the operator it is at.

    With one micro-batch: the largest of the backward steps' memories
    (:meth:`shardplan.fit.MemoryChoices.backward_profile`); with more, gradients
    are accumulated in persistent buffers and it is the additive total.
    """
    mc = plan.memory_choices
    if mc.micro_batches != 1:
        return {"peak": float(plan.memory["peak_bytes"]), "step": None, "applies": False}
    prof = mc.backward_profile()
    k = int(prof.argmax())
    return {"peak": float(prof[k]), "step": plan.graph.operators[k].name, "applies": True}


def phase_estimates(m: dict[str, float]) -> dict[str, float]:
    """The backward pass's peak from the model's own parts, for two schedules (not the search's model).

    With S = weights + optimizer state, G = gradients, A = saved activations
    and F = the stage-3 tiles gathered: the backward pass frees saved
    activations as it produces gradients, so the peak is near its start (S +
    A) or its end (S + G plus what the gradient reduction holds). On a GPU
    XLA all-reduces in place (NCCL; ``CanShareBufferHint`` of XLA's GPU
    backend), so ``gpu`` = S + max(A, G); the CPU backend keeps operand and
    result of the combined all-reduce apart, so ``cpu`` = S + max(A, 2 G)
    (``gpu`` leaves out the gathered tile of the operator running, a stage-3
    plan's only addition on a GPU-like schedule),
    and for FSDP, whose gathers it hoists to the program's start and whose
    gradients it all-reduces whole and then slices, S + A + 3 F (every
    gathered tile, and the full gradients twice).
    """
    s, g, a, f = m["weights"] + m["optimizer"], m["gradients"], m["activations"], m["gathered_tiles"]
    return {"gpu": s + max(a, g), "cpu": s + a + 3 * f if f else s + max(a, 2 * g)}


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
                "s64": 8, "u64": 8, "f64": 8}
_SHAPE = re.compile(r"\b(pred|bf16|[suf]\d+)\[([\d,]*)\]")
_COLLECTIVE = re.compile(r"=\s*(.*?)\s(all-gather|all-reduce|reduce-scatter)(?:-start)?\(")


def collective_bytes(hlo_text: str) -> dict[str, int]:
    """Result bytes per device of every all-gather / all-reduce / reduce-scatter in the compiled HLO.

    Counted once per instruction (a collective inside the micro-batch loop's
    body counts once: per micro-batch).
    """
    out = {"all-gather": 0, "all-reduce": 0, "reduce-scatter": 0}
    for line in hlo_text.splitlines():
        m = _COLLECTIVE.search(line)
        if m:
            out[m.group(2)] += sum(_DTYPE_BYTES.get(dt, 4) * math.prod(int(x) for x in dims.split(",") if x)
                                   for dt, dims in _SHAPE.findall(m.group(1)))
    return out


def flat_loss(info: Any) -> Any:
    """The traced loss as the step evaluates it (the flat program: scans unrolled), without constraints."""
    import jax

    from shardplan.jax.run import evaluate

    def fn(*args: Any) -> Any:
        leaves = jax.tree_util.tree_leaves(args)
        return jax.tree_util.tree_unflatten(info.out_tree, evaluate(info, leaves))

    return fn


def saved_residual_bytes(fs: Any, loss_fn: Any, params: Any, batch: Any) -> float | None:
    """Per-device bytes of what JAX's backward pass keeps from the forward, for a data-parallel plan.

    JAX lists the residuals of the loss on one micro-batch
    (``jax._src.ad_checkpoint.saved_residuals``, what
    ``jax.ad_checkpoint.print_saved_residuals`` prints) of the program the step
    differentiates: the flat program (scans unrolled, :func:`flat_loss`) when
    no operator recomputes (its constraints change no residual, but JAX would
    list each constrained value again), the step's checkpointed loss
    otherwise. Under data parallelism every residual
    carries the batch split over the devices, so a device holds 1/p of their
    bytes. Residuals that are arguments (parameters, the batch) are kept anyway
    and left out. None for a plan that is not data parallel (its residuals'
    layouts are not known here).
    """
    import jax
    from jax._src.ad_checkpoint import saved_residuals

    if not plan_is_data_parallel(fs.plan):
        return None
    k = fs.micro_batches
    leaves, tree = jax.tree_util.tree_flatten(batch)
    n = len(jax.tree_util.tree_leaves(params))
    micro = jax.tree_util.tree_unflatten(tree, [x[: x.shape[0] // k] if n + j in fs.info.batch_leaves else x
                                                for j, x in enumerate(leaves)])
    res = saved_residuals(fs.loss_fn if fs.remat else flat_loss(fs.micro_info), params, micro)
    return sum(math.prod(a.shape) * a.dtype.itemsize for a, why in res
               if not why.startswith("from the argument")) / len(fs.devices)


def plan_is_data_parallel(plan: Any) -> bool:
    """Every operator splits its batch dimension over all devices and nothing else."""
    p = plan.machine.num_devices
    return all(dict(zip(op.dim_names, plan.config(op.name))).get("b", 1) == p for op in plan.graph.operators)


def measure(plan: Any, loss_fn: Any, params: Any, batch: Any, info: Any) -> dict[str, Any]:
    """Compile the plan's Adam step; XLA's memory figures against the model's."""
    import jax
    import jax.numpy as jnp
    import optax

    from shardplan.jax.memory import fit_step, states_summary

    fs = fit_step(plan, loss_fn, params, batch, info=info)
    opt = optax.adam(1e-3)
    p0, s0 = fs.init(opt, jax.tree.map(jnp.copy, params))
    b0 = jax.device_put(batch, fs.batch_shardings)
    compiled = fs.train_step(opt, params).lower(p0, s0, b0).compile()
    mem = compiled.memory_analysis()
    data = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(b0))
    arg, out, alias, temp = (int(mem.argument_size_in_bytes), int(mem.output_size_in_bytes),
                             int(mem.alias_size_in_bytes), int(mem.temp_size_in_bytes))
    xla = {"argument": arg, "output": out, "alias": alias, "temp": temp, "batch": data,
           "state": arg - data, "step": temp + out - alias, "total": arg + out - alias + temp}
    g = fs.step.lower(p0, b0).compile().memory_analysis()  # the gradient step alone: no optimizer update
    xla["grad_step_temp"] = int(g.temp_size_in_bytes)
    xla["grad_step_output"] = int(g.output_size_in_bytes)
    xla["optimizer_update_extra"] = xla["step"] - int(g.temp_size_in_bytes) - int(g.output_size_in_bytes)
    xla["saved_residuals"] = saved_residual_bytes(fs, loss_fn, params, batch)
    xla["collectives"] = collective_bytes(compiled.as_text())
    model = predicted_parts(plan)
    phases = phase_estimates(model)
    backward = backward_prediction(plan)
    model["backward_peak"] = backward["peak"]
    model["backward_peak_operator"] = backward["step"]
    # the backward peak on XLA's CPU backend: its combined gradient all-reduce keeps operand and result apart,
    # so after the backward pass the state and two gradient copies are live
    phases["cpu_backward"] = max(backward["peak"], model["weights"] + model["optimizer"] + 2 * model["gradients"])
    ratios = {"total": xla["total"] / model["total"],
              "total_backward": xla["total"] / backward["peak"],
              "cpu_backward": xla["total"] / phases["cpu_backward"],
              "cpu_phase": xla["total"] / phases["cpu"],
              "gathered": (xla["collectives"]["all-gather"] / model["gathered_tiles"]
                           if model["gathered_tiles"] else None),
              "state": xla["state"] / (model["weights"] + model["optimizer"]),
              "step": xla["step"] / max(model["gradients"] + model["activations"], 1.0),
              "grad_step": (xla["grad_step_temp"] + xla["grad_step_output"])
              / max(model["gradients"] + model["activations"], 1.0),
              "saved": (xla["saved_residuals"] / model["activations"] if model["activations"]
                        else xla["saved_residuals"] and float("inf"))
              if xla["saved_residuals"] is not None else None}
    mc = plan.memory_choices
    return {"strategy": plan.name, "micro_batches": mc.micro_batches,
            "recompute": sum(mc.recompute(i) for i in range(len(plan.graph))),
            "sharded_leaves": states_summary(fs.leaves, fs.info), "xla_bytes": xla, "model_bytes": model,
            "model_phase_estimates": phases,
            "ratio_xla_over_model": ratios, "within_10pct": abs(ratios["total"] - 1) <= TOLERANCE,
            "within_10pct_backward": abs(ratios["total_backward"] - 1) <= TOLERANCE}


FSDP_ON_CPU = (
    "FSDP on XLA's CPU backend (read from the compiled HLO): every stage-3 all-gather is scheduled at the start "
    "of the program (the CPU pipeline has no memory-bounded latency-hiding scheduler), so all gathered weights "
    "are live at once, and the weight gradients are all-reduced whole in one combined all-reduce and then sliced "
    "to their shards (no reduce-scatter is formed), so the full gradients, operand and result, are live too; a GPU "
    "schedule holds one operator's gathered tile at a time and reduce-scatters. What the CPU run can check "
    "matches the model: parameters and optimizer state sharded as planned (state ratio {state:.3f}), and the "
    "compiled all-gathers move {gathered:.3f}x the stage-3 tiles (the model's gather before the forward and again "
    "before the backward: 2); XLA's total is {cpu:.3f}x the CPU schedule's estimate S + A + 3F from the model's "
    "parts (S state, A saved activations, F the gathered tiles)")

# Why JAX's residual list differs from the model's saved activations, per model (read from
# jax._src.ad_checkpoint.saved_residuals of the flat program against Operator.saved; dtype sizes as listed).
SAVED_CAUSES = {
    "relu": "JAX's relu (a custom_jvp) lists, beside its output, a bool mask (1 byte per element) and a "
            "broadcast array of zeros of the activation's size that the model does not count (the model keeps "
            "the output and one derivative value of 4 bytes)",
    "jax_cnn": "max pooling: JAX keeps the pool's input for the select-and-scatter gradient and the relu "
               "masks/zero arrays (see relu)",
    "scan_layers": "the unrolled scan slices the stacked kernel per layer: JAX keeps the four slices (views of a "
                   "parameter, replicated on every device) as residuals, which the model counts as weights, not "
                   "activations; this list divides them by the device count like the activations",
    "FlaxLlamaForCausalLM": "JAX lists the silu (a jitted function) output three times, one buffer",
    "jax_transformer": "the tanh-form GELU: JAX keeps six values of the hidden size per layer (the product before "
                       "it, x^3's derivative, the tanh, 1 - tanh^2 and two products of the chain rule), the model "
                       "five (one per nonlinear primitive and the operands of the two products)",
}


def _saved_cause(row: dict[str, Any], saved: float) -> str:
    name = row["model"]
    if name in SAVED_CAUSES:
        return SAVED_CAUSES[name]
    if saved > 1 and ("mlp" in name.lower() or "cnn" in name.lower()):
        return SAVED_CAUSES["relu"]
    return ("the model counts what JAX's backward rules read (Operator.saved); JAX's list differs by values "
            "computed in the forward for the backward of fused or custom-derivative functions")


def explain(row: dict[str, Any]) -> str:
    """Why the total is off by more than 10 %, from the parts measured (empty when it is within)."""
    if row["within_10pct"]:
        return ""
    x, m, r = row["xla_bytes"], row["model_bytes"], row["ratio_xla_over_model"]
    ph = row["model_phase_estimates"]
    out = []
    if abs(r["state"] - 1) > 0.01:
        pieces = [s for s in row["sharded_leaves"] if s["pieces"] < s["group"]]
        if r["state"] < 1:
            why = ("a parameter read by several operators without one owner (a stacked kernel sliced per layer, "
                   "a reader that sees it reshaped) is counted by the model once per reader, each in its "
                   "reader's layout, while XLA holds the leaf once, in its first reader's layout (a tied "
                   "embedding has one owner, Tensor.owner, and is counted once)")
        else:
            why = (f"{len(pieces)} sharded leaves have no axis their replica group divides, so their state is "
                   "cut into fewer pieces than the model's G" if pieces else "XLA keeps state the model does not count "
                   "(Adam's step count, a few bytes)")
        out.append(f"parameters + optimizer state: XLA {x['state']} B vs model {m['weights'] + m['optimizer']:.0f} B "
                   f"({why})")
    if row["strategy"].startswith("dp+fsdp"):
        out.append(FSDP_ON_CPU.format(state=r["state"], gathered=r["gathered"] or 0.0, cpu=r["cpu_phase"]))
        if r["gathered"] is not None and abs(r["gathered"] - 2) > 0.05:
            out.append("the all-gathers exceed two per tile because a parameter read by k operators (a tied "
                       "embedding) is gathered for each reader while the model's tile counts 1/k of it per reader "
                       "(shared-weight counting: branch sharedw)")
    else:
        g, a = m["gradients"], m["activations"]
        head = (f"XLA total {x['total']} B vs the model's S + G + A {m['total']:.0f} B (S state, G gradients "
                f"{g:.0f} B, A saved {a:.0f} B): the backward pass frees saved activations as it produces gradients, "
                f"and the CPU backend's combined all-reduce keeps the gradients' operand and result apart, so "
                f"its peak is near S + max(A, 2G) = {ph['cpu']:.0f} B (XLA / that = {r['cpu_phase']:.3f}); a GPU "
                f"all-reduces in place (S + max(A, G) = {ph['gpu']:.0f} B, below the model's sum, which is the "
                "search's additive upper bound)")
        out.append(head)
        if abs(r["cpu_phase"] - 1) > TOLERANCE:
            if "cnn" in row["model"].lower():
                out.append("the rest is the CPU backend's convolution and pooling code: its compiled buffers "
                           "(jax_cnn's buffer assignment) hold activation-sized iota index arrays and a scatter for "
                           "the max-pool gradient and NCHW/NHWC transposes around every convolution, temporaries a "
                           "GPU's cuDNN kernels do not need")
            elif row["strategy"] == "optimal":
                out.append("this plan is not data parallel: its redistributions and activation collectives between "
                           "operators make full-size temporaries (gathered inputs, collective results) that the "
                           "model charges in time but leaves to the reserve in memory")
            else:
                out.append("the rest is activation gradients and forward intermediates neither saved nor freed yet, "
                           "which the model leaves to the reserve")
    saved = r.get("saved")
    if saved is not None and m["activations"] and abs(saved - 1) > TOLERANCE:
        out.append(f"saved activations: JAX's residual list is {saved:.2f}x the model's: {_saved_cause(row, saved)}")
    elif saved is not None and not m["activations"] and x["saved_residuals"]:
        out.append(f"every operator recomputes, yet JAX keeps {x['saved_residuals']:.0f} B of residuals per device "
                   "(values computed before the first operator, from constants such as rotary tables, belong to no "
                   "operator and are named saved)")
    if x["batch"] > TOLERANCE * m["total"]:
        out.append(f"the batch ({x['batch']} B per device) is an argument the model does not count")
    return "; ".join(out)


def explain_backward(row: dict[str, Any]) -> str:
    """Why the total is off by more than 10 % from the backward-peak model (empty when within)."""
    if row["within_10pct_backward"]:
        return ""
    x, m, r = row["xla_bytes"], row["model_bytes"], row["ratio_xla_over_model"]
    if row["micro_batches"] != 1:
        return ("2 micro-batches: gradients accumulate in persistent buffers, so the backward-peak model is the "
                "additive one (see cause)")
    out = []
    if row["strategy"].startswith("dp+fsdp"):
        out.append("FSDP on XLA's CPU backend gathers every stage-3 weight at the program's start and all-reduces "
                   "the full gradients before slicing them (see cause): neither is in a per-step model")
    elif r["cpu_backward"] <= 1 + TOLERANCE and r["total_backward"] > 1:
        out.append(f"XLA's CPU backend keeps the combined gradient all-reduce's operand and result apart: state + "
                   f"2 G = {row['model_phase_estimates']['cpu_backward']:.0f} B exceeds the backward peak "
                   f"{m['backward_peak']:.0f} B (XLA / that = {r['cpu_backward']:.3f}); a GPU all-reduces in place")
    else:
        out.append(f"XLA / max(backward peak, state + 2 G) = {r['cpu_backward']:.3f}")
        if "cnn" in row["model"].lower():
            out.append("the CPU backend's convolution and pooling temporaries (see cause)")
        elif row["strategy"] == "optimal":
            out.append("this plan is not data parallel: redistribution temporaries between operators (see cause)")
        else:
            out.append("activation gradients and forward intermediates live at the peak, left to the reserve")
    saved = r.get("saved")
    if saved is not None and m["activations"] and abs(saved - 1) > TOLERANCE:
        out.append(f"saved activations: JAX's residual list is {saved:.2f}x the model's")
    if abs(r["state"] - 1) > 0.01:
        out.append(f"state: XLA / model = {r['state']:.3f} (see cause)")
    if x["batch"] > TOLERANCE * m["backward_peak"]:
        out.append(f"the batch ({x['batch']} B per device) is an argument the model does not count")
    return "; ".join(out)


def plans_for(tables: Any, micro: int) -> list[Any]:
    from shardplan.baselines import baseline_plan
    from shardplan.errors import ShardplanError
    from shardplan.fit import plan_with_choices
    from shardplan.spmd import solve_tables

    opt = solve_tables(tables)
    dp = baseline_plan("data_parallel", tables)
    out = [plan_with_choices(opt, 0, False, 1, name="optimal"), plan_with_choices(dp, 0, False, 1, name="data_parallel")]
    try:
        out.append(plan_with_choices(dp, 3, True, micro, name=f"dp+fsdp+recompute(k={micro})"))
    except ShardplanError:  # pragma: no cover - plan_with_choices takes any k
        out.append(plan_with_choices(dp, 3, True, 1, name="dp+fsdp+recompute(k=1)"))
    return out


def run_model(name: str, library: str, loss_fn: Any, params: Any, batch: Any, machine: Any) -> list[dict[str, Any]]:
    from shardplan.cost import build_tables
    from shardplan.errors import ShardplanError
    from shardplan.jax.lower import trace

    graph, info = trace(loss_fn, params, batch)
    tables = build_tables(graph, machine, cutoff=1, divides_p=True)
    rows = []
    for plan in plans_for(tables, 2):
        t0 = time.perf_counter()
        try:
            row = measure(plan, loss_fn, params, batch, info)
        except ShardplanError as e:  # e.g. micro-batches that the batch does not allow: retry with one
            if plan.memory_choices.micro_batches == 1:
                raise
            from shardplan.fit import plan_with_choices

            base = plan_with_choices(plan, 3, True, 1, name="dp+fsdp+recompute(k=1)")
            row = measure(base, loss_fn, params, batch, info)
            row["note"] = f"2 micro-batches refused: {e}"
        row.update(model=name, library=library, seconds=time.perf_counter() - t0)
        row["cause"] = explain(row)
        row["cause_backward"] = explain_backward(row)
        rows.append(row)
        r = row["ratio_xla_over_model"]
        print(f"{name:<30} {row['strategy']:<26} model {row['model_bytes']['total']:>11.0f} B  xla {row['xla_bytes']['total']:>11.0f}"
              f" B  total {r['total']:.3f} backward {r['total_backward']:.3f}  state {r['state']:.3f}  step {r['step']:.3f} grad-step {r['grad_step']:.3f}  "
              f"saved {r['saved'] or 0:.3f}  cpu-phase {r['cpu_phase']:.3f}  gathered {r['gathered'] or 0:.3f}", flush=True)
    return rows


FINDINGS = (
    "Parameters and optimizer state (what persists between steps) are predicted exactly, ZeRO 1-3 shards "
    "included, except where one leaf has several readers (tied embeddings): the model counts a copy per reader "
    "in the reader's layout, XLA one leaf in its first reader's layout (shared-weight counting: branch sharedw).",
    "Saved activations: the JAX lowering sets Operator.saved from what JAX's backward rules read (nothing of an "
    "addition, a reshape or a sum; an operand of a product whose other operand needs a gradient; one value per "
    "nonlinear elementwise primitive), and a user's jax.checkpoint / nn.remat marks its operators recomputed "
    "(Graph.recomputed). Against JAX's residual list of the flat program the data-parallel ratios are near 1; "
    "the rest is JAX listing values the model does not count (relu's zero arrays and masks, a stacked kernel's "
    "per-layer slices, one buffer listed thrice).",
    "Totals: the model's S + G + A is an additive upper bound of a GPU-like backward pass (saved activations "
    "freed as gradients appear, gradients all-reduced in place). XLA's CPU backend holds a second gradient copy "
    "in its combined all-reduce, so its peak is S + max(A, 2G), which the model's own parts predict within a few "
    "percent for the data-parallel rows; CNNs add the CPU's pool-gradient scatter and convolution transposes.",
    "Backward-peak model (FitOptions.grad_buffers='backward': gradients appear as the backward pass frees saved "
    "activations, XLA's own discipline; total_backward): the searched (model-parallel) plans of jax_transformer and "
    "the transformers GPT-2, BERT, Llama, BART and T5 are 0.93-1.04 under it (0.79-0.89 under the additive sum), ViT "
    "1.18 and attention_lm 1.27. The data-parallel rows are 1.12-1.25 under it: the CPU backend's combined "
    "all-reduce keeps a second gradient copy at the end of the backward pass, which max(backward peak, S + 2G) "
    "(cpu_backward) predicts within 10 % in 13 of 16; a GPU all-reduces in place. FSDP rows: neither model (CPU "
    "schedule, below). Within 10 %: 12 of 48 additive, 8 of 48 backward peak, 21 of 48 cpu_backward.",
    "FSDP cannot be measured faithfully on the CPU backend (all gathers hoisted to the start, no reduce-scatter): "
    "its rows check the sharded state (exact) and the compiled all-gathers (exactly the model's two gathers of "
    "every stage-3 tile).",
)


def summarize(rows: list[dict[str, Any]], errors: int) -> dict[str, Any]:
    """Counts and the spread of each ratio over the runs."""
    def spread(key: str) -> dict[str, float] | None:
        vals = [r["ratio_xla_over_model"][key] for r in rows if r["ratio_xla_over_model"].get(key) not in (None, 0.0)]
        vals = [v for v in vals if v != float("inf")]
        return {"min": min(vals), "max": max(vals), "n": len(vals)} if vals else None

    return {"runs": len(rows), "errors": errors, "within_10pct": sum(r["within_10pct"] for r in rows),
            "within_10pct_backward": sum(r["within_10pct_backward"] for r in rows),
            "state_within_1pct": sum(abs(r["ratio_xla_over_model"]["state"] - 1) <= 0.01 for r in rows),
            "ratio_spread": {k: spread(k) for k in ("total", "total_backward", "cpu_backward", "state", "step",
                                                    "saved")},
            "findings": FINDINGS}


def main(only: set[str]) -> None:
    """Run every model (or those named in ``only``, replacing their rows in the existing JSON)."""
    import jax

    from shardplan.machine import Machine

    path = os.path.join(HERE, "results", "memory_vs_xla.json")
    machine = Machine(**TOY)
    out: dict[str, Any] = {
        "machine": TOY, "devices": 8, "backend": jax.devices()[0].platform, "optimizer": "optax.adam",
        "note": "XLA CPU backend figures (simulated devices); GPU fusion and scheduling differ, temporaries most",
        "results": []}
    if only and os.path.exists(path):
        with open(path) as f:
            out["results"] = [r for r in json.load(f)["results"] if r.get("model") not in only]
    for name in ("jax_mlp", "jax_transformer", "jax_cnn"):
        if only and name not in only:
            continue
        mod = load_example(name)
        params, batch = mod.init_params(jax.random.PRNGKey(0)), mod.make_batch(jax.random.PRNGKey(1))
        out["results"].extend(run_model(name, "examples", mod.loss_fn, params, batch, machine))
        write(out, path)
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from jax_corpus import CORPUS

    for entry in CORPUS:
        if only and entry.name not in only:
            continue
        try:
            loss_fn, params, batch = entry.build()
            out["results"].extend(run_model(entry.name, entry.library, loss_fn, params, batch, machine))
        except Exception as e:  # a model that does not go through is a result too
            out["results"].append({"model": entry.name, "library": entry.library, "error": f"{type(e).__name__}: {e}"})
            print(f"{entry.name:<30} ERROR {type(e).__name__}: {e}", flush=True)
        write(out, path)


def write(out: dict[str, Any], path: str) -> None:
    """The JSON with its summary (written after every model, so an interrupted run keeps what it measured)."""
    ok = [r for r in out["results"] if "xla_bytes" in r]
    out["summary"] = summarize(ok, len(out["results"]) - len(ok))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1, default=float)


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main(set(sys.argv[1:]))
