"""Predicted against measured on one GPU: matrix products by shape, and whole training steps.

The measurements are ``benchmarks/gpu_measure.py``'s JSON (default ``benchmarks/results/gpu_measure_h100.json``,
measured on one NVIDIA H100 80GB HBM3; its ``machine`` entry says where and when). Nothing here is fitted to
them: the machine is a profile file as given (``--machine h100`` by default, or ``--machine-file``).

* ``gemm``: every timed pass of every ``nn.Linear`` layer shape (forward ``X W^T``, input gradient, weight
  gradient) against the cost model's time for that pass: ``2 M N K / (peak * efficiency * u)`` with u the tile
  and wave utilisation of its output (:func:`shardplan.cost.operator.gemm_utilisation`), or the bytes it
  moves over the HBM bandwidth where that is longer (the roofline the model charges);
* ``steps``: the same Hugging Face models as were timed (built from their configs on the meta device, traced
  by :func:`shardplan.torch.plan` on one device of the machine, layouts only; a tied head tied again after
  ``to_empty``, which gives every module its own tensor) against the measured step
  (forward + backward and the fused AdamW step; each part's ratio too, the step's also against its profiled
  kernels alone), split by kind of work: the model's
  seconds of matrix-product operators, attention and everything else beside the profiled CUDA kernels of
  each kind; the predicted peak memory (state + saved activations + the largest transient of a backward
  step, :func:`shardplan.cost.memory.transient_bytes`) beside the measured peak allocated;
* ``jax_rows``: the flax language models of ``gpu_jax_models.py`` as XLA compiled and ran them (forward +
  backward) against :func:`shardplan.jax.plan` of the same loss on one device less its optimizer step, and XLA's memory analysis
  (arguments + temporaries) against the predicted peak (``memory_ratio``), and like for like against it less the
  optimizer state the measured program does not hold (``value_and_grad`` only: parameters in, gradients out),
  under the additive and the backward-peak model (``memory_ratio_without_optimizer_state``,
  ``backward_peak_ratio_without_optimizer_state``); the HBM bytes the model charges the step (matrix products,
  fused memory-bound chains) against XLA's own, counted from the GPU's optimised HLO text where ``--hlo-dir`` has it
  (:func:`hlo_hbm_bytes`; ``benchmarks/results/xla_h200/``: the three steps compiled by jax 0.11.2 for an H200,
  the same Hopper architecture and XLA as the H100 run).

Run: ``PYTHONPATH=. python benchmarks/bench_gpu_step.py [--measured FILE] [--machine h100 | --machine-file F]
[--hlo-dir benchmarks/results/xla_h200] [--jax-only] [--out benchmarks/results/gpu_step.json]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

GEMM_KINDS = frozenset({"linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "einsum", "dot"})
ATTENTION_KINDS = frozenset({"attention", "attn_flash", "flash_attention"})


def pass_seconds(tokens: int, n: int, k: int, machine: Any) -> dict[str, float]:
    """The model's seconds for the three products of ``nn.Linear(k, n)`` on ``tokens`` rows (``ops.dense`` on one
    device), each a roofline of its FLOPs at ``achievable_flops * u`` (u of its output tile grid and alignment:
    :func:`shardplan.cost.operator.pass_utilisation`) and its bytes (two operands, one result)."""
    import numpy as np

    from shardplan import ops
    from shardplan.cost.operator import pass_utilisation
    from shardplan.ir import TensorRef

    op = ops.dense("fc", TensorRef("x", (tokens, k), needs_grad=True), n)
    u = pass_utilisation(op, np.ones((1, len(op.dims)), dtype=np.int64), machine)[:, 0]
    grads = {t.role: float(x) for t, x in zip(op.grad_tensors, u[1:])}
    flops = 2.0 * tokens * n * k
    moved = (tokens * k + n * k + tokens * n) * machine.dtype_bytes
    out = {}
    for name, ui in (("forward", float(u[0])), ("input_grad", grads["input"]), ("weight_grad", grads["weight"])):
        t = flops / (machine.achievable_flops * ui)
        out[name] = max(t, moved / machine.hbm_bandwidth) if machine.hbm_bandwidth is not None else t
    return out


def gemm_rows(measured: dict[str, Any], machine: Any) -> list[dict[str, Any]]:
    rows = []
    for r in measured["gemm"]["layers"]:
        pred = pass_seconds(r["tokens"], r["n"], r["k"], machine)
        for p in ("forward", "input_grad", "weight_grad"):
            rows.append({"layer": r["layer"], "pass": p, "tokens": r["tokens"], "n": r["n"], "k": r["k"],
                         "measured_s": r[f"{p}_s"], "predicted_s": pred[p], "ratio": pred[p] / r[f"{p}_s"]})
    return rows


class _Loss:
    """``model(input_ids=ids, labels=ids).loss`` as a module (what the measurement timed)."""

    @staticmethod
    def wrap(model: Any) -> Any:
        import torch

        class Loss(torch.nn.Module):
            def __init__(self, m: Any) -> None:
                super().__init__()
                self.m = m

            def forward(self, ids: Any) -> Any:
                return self.m(input_ids=ids, labels=ids).loss
        return Loss(model)


def kind_of(op: Any) -> str:
    if op.kind in ATTENTION_KINDS:
        return "attention"
    if op.kind in GEMM_KINDS:
        return "gemm"
    return "other"


def predict_step(row: dict[str, Any], machine: Any) -> dict[str, Any]:
    """The model's plan of ``row``'s model on one device: step seconds by kind of work, and peak memory."""
    import torch

    from benchmarks.gpu_measure import build_model
    from shardplan.torch import plan

    with torch.device("meta"):
        model = build_model(row["family"], row["config"], row["seq"])
    model = model.to_empty(device="cpu").to(torch.bfloat16)  # uninitialised: only shapes are traced
    if hasattr(model, "tie_weights"):  # to_empty gives every module its own tensor: tie the head to the embedding again
        model.tie_weights()
    ids = torch.zeros((row["batch"], row["seq"]), dtype=torch.long)
    t0 = time.process_time()
    p = plan(_Loss.wrap(model), (ids,), machine=machine, fit=False, stages=False)
    seconds = time.process_time() - t0
    sp = p.spmd
    by_kind = {"gemm": 0.0, "attention": 0.0, "other": 0.0}
    for op, cost, k in zip(sp.tables.graph.operators, sp.tables.op_costs, sp.assignment):
        by_kind[kind_of(op)] += float(cost.compute[k])
    return {"predicted_s": p.step_time, "predicted_optimizer_s": float(p.breakdown.get("optimizer", 0.0)),
            "predicted_by_kind_s": by_kind, "predicted_peak_bytes": p.memory["peak_bytes"],
            "predicted_weights_bytes": p.memory["weights_bytes"],
            "predicted_activations_bytes": p.memory["activations_bytes"],
            "predicted_transient_bytes": p.memory.get("transient_bytes", 0.0), "operators": len(sp.tables.graph.operators),
            "plan_cpu_seconds": seconds}


def step_rows(measured: dict[str, Any], machine: Any) -> list[dict[str, Any]]:
    rows = []
    for r in measured["steps"]:
        if "forward_backward_s" not in r:
            rows.append({"model": r["model"], "skipped": r.get("error", "not measured")})
            continue
        pred = predict_step(r, machine)
        kernels = r.get("kernels_s", {})
        row = {"model": r["model"], "params": r["params"], "batch": r["batch"], "seq": r["seq"],
               "measured_forward_backward_s": r["forward_backward_s"], "measured_optimizer_s": r["optimizer_s"],
               "ratio": pred["predicted_s"] / (r["forward_backward_s"] + r["optimizer_s"]),
               "forward_backward_ratio": (pred["predicted_s"] - pred["predicted_optimizer_s"]) / r["forward_backward_s"],
               "optimizer_ratio": pred["predicted_optimizer_s"] / r["optimizer_s"], **pred,
               "measured_kernels_s": {k: v for k, v in kernels.items() if k != "top_kernels"},
               "measured_peak_allocated_bytes": r.get("peak_allocated_bytes")}
        if kernels.get("optimizer"):  # the profiled fused AdamW kernels (and zero_grad's foreach fill) alone
            row["optimizer_kernels_ratio"] = pred["predicted_optimizer_s"] / kernels["optimizer"]
        if r.get("peak_allocated_bytes"):
            row["memory_ratio"] = pred["predicted_peak_bytes"] / r["peak_allocated_bytes"]
        rows.append(row)
        print(f"{r['model']:20s} measured {(r['forward_backward_s'] + r['optimizer_s']) * 1e3:7.1f} ms  predicted "
              f"{pred['predicted_s'] * 1e3:7.1f} ms  ratio {row['ratio']:.2f} (fwd+bwd "
              f"{row['forward_backward_ratio']:.2f}, AdamW {row['optimizer_ratio']:.2f})  "
              f"(gemm {pred['predicted_by_kind_s']['gemm'] * 1e3:.1f} / {kernels.get('gemm', 0) * 1e3:.1f} ms, "
              f"attention {pred['predicted_by_kind_s']['attention'] * 1e3:.1f} / {kernels.get('attention', 0) * 1e3:.1f},"
              f" other {pred['predicted_by_kind_s']['other'] * 1e3:.1f} / {kernels.get('other', 0) * 1e3:.1f})",
              flush=True)
    return rows


def predict_jax_step(name: str, machine: Any) -> dict[str, Any]:
    """The model's plan of the flax model ``name`` (``gpu_jax_models.py``) on one device, traced from its
    parameters' shapes: step seconds and peak memory (one micro-batch, no stages)."""
    import jax

    from benchmarks.gpu_jax_models import build
    from shardplan.jax import plan

    from shardplan.fit import FitOptions

    loss_fn, params, batch = build(name, abstract=True)
    t0 = time.process_time()
    p = plan(loss_fn, params, batch, devices=jax.devices()[:1], machine=machine, stages=False, micro_batches=(1,))
    seconds = time.process_time() - t0
    back = plan(loss_fn, params, batch, devices=jax.devices()[:1], machine=machine, stages=False, micro_batches=(1,),
                fit_options=FitOptions(micro_batches=(1,), grad_buffers="backward")).memory
    # the optimizer's words: the state (value, gradient, o words per element at stage 0) less value and gradient
    opt_state = p.memory["weights_bytes"] - 2.0 * p.memory["gradients_bytes"]
    sp = p.spmd
    by_kind = {"gemm": 0.0, "attention": 0.0, "other": 0.0}
    for op, cost, k in zip(sp.tables.graph.operators, sp.tables.op_costs, sp.assignment):
        by_kind[kind_of(op)] += float(cost.compute[k])
    return {"predicted_s": p.step_time, "predicted_optimizer_s": float(p.breakdown.get("optimizer", 0.0)),
            "predicted_by_kind_s": by_kind, **step_hbm_bytes(sp.tables.graph, machine.dtype_bytes),
            "predicted_peak_bytes": p.memory["peak_bytes"],
            "predicted_activations_bytes": p.memory["activations_bytes"], "predicted_optimizer_state_bytes": opt_state,
            "predicted_backward_peak_bytes": back["peak_bytes"], "recomputed": len(p.recomputed),
            "plan_cpu_seconds": seconds}


def step_hbm_bytes(graph: Any, dtype_bytes: int) -> dict[str, Any]:
    """The HBM bytes of a one-device step (forward + backward, no optimizer) as the cost model charges them
    (:func:`shardplan.cost.chain.hbm_elements` of every operator), split into matrix products, the fused
    chains (operators with a :class:`~shardplan.ir.KernelIO`) and the rest; and the same step charged one
    kernel per operator (what the model charged before it knew XLA's fusion)."""
    import dataclasses

    from shardplan.cost.chain import hbm_elements

    parts = {"gemm": 0.0, "fused_chains": 0.0, "other": 0.0}
    eager = 0.0
    for op in graph.operators:
        f, b = hbm_elements(op)
        key = "fused_chains" if op.kernel_io is not None else "gemm" if kind_of(op) == "gemm" else "other"
        parts[key] += (f + b) * dtype_bytes
        eager += sum(hbm_elements(dataclasses.replace(op, kernel_io=None))) * dtype_bytes
    return {"predicted_hbm_bytes": sum(parts.values()), "predicted_hbm_bytes_by_kind": parts,
            "predicted_hbm_bytes_one_kernel_per_operator": eager}


def hlo_hbm_bytes(hlo_text: str) -> dict[str, float]:
    """HBM bytes of an optimised XLA program by kind of kernel of its entry computation: each instruction's
    operands and results (parameters, constants, bitcasts, tuples and their elements move nothing; a cuBLAS
    call's ``s8`` workspace is left out), what XLA's cost analysis calls "bytes accessed" (its own count
    leaves the custom calls out; over fusions the two agree to 1e-5 on the CPU programs of
    tests/jax_engine/test_xla_fusion.py's model and exactly on the GPU's). Keys: the matrix products
    (``cublas``: cuBLAS custom calls, or plain dot and convolution instructions; ``triton_gemm``: Triton
    GEMM fusions), the memory-bound kernels (``loop``,
    ``input`` (reductions), ``triton``: Triton normalisation fusions, on the CPU its library's reductions),
    ``other`` opcodes, the sums ``products``,
    ``memory_bound`` and ``total``. A fusion reading part of an operand (a slice of a concatenated projection)
    is counted with the whole operand, as XLA counts it."""
    import math
    import re

    sizes = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
             "s8": 1, "u8": 1, "pred": 1, "f8e4m3fn": 1, "f8e5m2": 1}
    shape = re.compile(r"\b(" + "|".join(sizes) + r")\[([0-9,]*)\]")

    def nbytes(text: str, workspace: bool = True) -> float:
        return float(sum(sizes[t] * math.prod(int(x) for x in dims.split(",") if x)
                         for t, dims in shape.findall(text) if workspace or t != "s8"))

    entry = hlo_text[hlo_text.index("\nENTRY"):].split("\n")[1:]
    known: dict[str, float] = {}
    out = {"cublas": 0.0, "triton_gemm": 0.0, "loop": 0.0, "input": 0.0, "triton": 0.0, "other": 0.0}
    for line in entry:
        m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*)$", line)
        if not m:
            continue
        name, typ, opcode, rest = m.groups()
        known[name] = nbytes(typ, workspace=opcode != "custom-call")
        if opcode in ("parameter", "constant", "bitcast", "tuple", "get-tuple-element"):
            continue
        moved = known[name] + sum(known.get(a, 0.0) for a in dict.fromkeys(re.findall(r"%([\w.\-]+)",
                                                                                      rest.split("), ")[0])))
        if opcode == "custom-call":
            key = "cublas" if "cublas" in rest else "other"
        elif opcode in ("dot", "convolution"):  # a product left to the backend's library (the CPU's)
            key = "cublas"
        elif opcode == "fusion":
            kind = re.search(r'"kind":"([^"]*)"', rest)
            key = ("triton_gemm" if "gemm" in kind.group(1) else "triton") if kind else \
                "input" if "kind=kInput" in rest else "loop"
        else:
            key = "other"
        out[key] += moved
    out["products"] = out["cublas"] + out["triton_gemm"]
    out["memory_bound"] = out["loop"] + out["input"] + out["triton"]
    out["total"] = out["products"] + out["memory_bound"] + out["other"]
    return out


def hlo_text(folder: str, model: str) -> str | None:
    """The optimised HLO text of ``model``'s step in ``folder`` (``hlo_<model>.txt``, or gzipped ``.txt.gz``)."""
    import gzip

    path = Path(folder) / f"hlo_{model}.txt"
    if path.exists():
        return path.read_text()
    if path.with_suffix(".txt.gz").exists():
        return gzip.decompress(path.with_suffix(".txt.gz").read_bytes()).decode()
    return None


def hlo_measured(folder: str, model: str) -> dict[str, Any] | None:
    """The device, step seconds and XLA cost analysis of ``model`` in the measurement that wrote the HLO
    (``gpu_measure*.json`` in ``folder``, section ``jax_steps``)."""
    for path in sorted(Path(folder).glob("gpu_measure*.json")):
        data = json.loads(path.read_text())
        for r in data.get("jax_steps", []):
            if r.get("model") == model and "forward_backward_s" in r:
                return {"file": str(path), "device": r.get("device"), "jax": r.get("jax"),
                        "forward_backward_s": r["forward_backward_s"], "xla_cost": r.get("xla_cost", {}),
                        "xla_memory": r.get("xla_memory")}
    return None


def jax_step_rows(measured: dict[str, Any], machine: Any, hlo_dir: str | None = None) -> list[dict[str, Any]]:
    """One row per flax step measured: predicted against measured seconds, and the model's HBM bytes against
    XLA's (``bytes accessed`` of the GPU's cost analysis where the measurement recorded it; the optimised HLO
    text ``hlo_<model>.txt[.gz]`` in ``hlo_dir``, where given, counted by :func:`hlo_hbm_bytes`, with the
    measurement of the run that compiled it, :func:`hlo_measured`)."""
    rows = []
    for r in measured.get("jax_steps", []):
        if "forward_backward_s" not in r:
            rows.append({"model": r["model"], "skipped": r.get("error", "not measured")})
            continue
        pred = predict_jax_step(r["model"], machine)
        row = {"model": r["model"], "shape": r["shape"], "params": r["params"],
               "measured_forward_backward_s": r["forward_backward_s"], **pred,
               "ratio": (pred["predicted_s"] - pred["predicted_optimizer_s"]) / r["forward_backward_s"],
               "xla_memory": r.get("xla_memory")}
        accessed = (r.get("xla_cost") or {}).get("bytes accessed")
        if accessed:  # XLA's own count: its fusions (Triton GEMMs included), not the cuBLAS calls
            row["xla_bytes_accessed"] = accessed
        text = hlo_text(hlo_dir, r["model"]) if hlo_dir else None
        if text is not None:
            row["xla_hbm_bytes_by_kind"] = hlo_hbm_bytes(text)
            other = hlo_measured(hlo_dir, r["model"])  # the run that compiled it (another GPU, maybe)
            if other:
                row["hlo_measured"] = other
                row.setdefault("xla_bytes_accessed", other.get("xla_cost", {}).get("bytes accessed"))
            xla = row["xla_hbm_bytes_by_kind"]
            kinds = pred["predicted_hbm_bytes_by_kind"]
            row["hbm_bytes_ratios_hlo"] = {
                "total": pred["predicted_hbm_bytes"] / xla["total"],
                "products": kinds["gemm"] / xla["products"],
                "memory_bound": (kinds["fused_chains"] + kinds["other"]) / xla["memory_bound"],
                "memory_bound_one_kernel_per_operator": (pred["predicted_hbm_bytes_one_kernel_per_operator"]
                                                         - kinds["gemm"]) / xla["memory_bound"]}
        mem = r.get("xla_memory") or {}
        if mem:
            row["xla_bytes"] = mem.get("argument_size_in_bytes", 0) + mem.get("temp_size_in_bytes", 0)
            row["memory_ratio"] = pred["predicted_peak_bytes"] / row["xla_bytes"]
            # like for like: the measured program is value_and_grad alone, so it holds no optimizer state
            row["memory_ratio_without_optimizer_state"] = ((pred["predicted_peak_bytes"]
                                                            - pred["predicted_optimizer_state_bytes"]) / row["xla_bytes"])
            row["backward_peak_ratio_without_optimizer_state"] = ((pred["predicted_backward_peak_bytes"]
                                                                   - pred["predicted_optimizer_state_bytes"])
                                                                  / row["xla_bytes"])
        rows.append(row)
        print(f"{r['model']:20s} measured {r['forward_backward_s'] * 1e3:7.1f} ms  predicted "
              f"{(pred['predicted_s'] - pred['predicted_optimizer_s']) * 1e3:7.1f} ms (no optimizer step) "
              f"ratio {row['ratio']:.2f}", flush=True)
        if "xla_hbm_bytes_by_kind" in row:
            xla, kinds = row["xla_hbm_bytes_by_kind"], pred["predicted_hbm_bytes_by_kind"]
            print(f"{'':20s} HBM GB model / XLA: products {kinds['gemm'] / 1e9:.1f} / {xla['products'] / 1e9:.1f}, "
                  f"memory-bound {(kinds['fused_chains'] + kinds['other']) / 1e9:.1f} / {xla['memory_bound'] / 1e9:.1f}"
                  f" (one kernel per operator: "
                  f"{(pred['predicted_hbm_bytes_one_kernel_per_operator'] - kinds['gemm']) / 1e9:.1f})", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    from benchmarks.record import write_result
    from shardplan.machine import load_machine_file, preset

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--measured", default="benchmarks/results/gpu_measure_h100.json")
    ap.add_argument("--machine", default="h100", help="machine preset (default h100)")
    ap.add_argument("--machine-file", help="a machine file instead of the preset")
    ap.add_argument("--out", default="benchmarks/results/gpu_step.json")
    ap.add_argument("--hlo-dir", help="a folder with the GPU's optimised HLO text of the flax steps (hlo_<model>.txt)")
    ap.add_argument("--jax-only", action="store_true", help="only the flax steps (the gemm and torch rows not re-run)")
    args = ap.parse_args(argv)
    measured = json.loads(Path(args.measured).read_text())
    machine = load_machine_file(args.machine_file, 1) if args.machine_file else preset(args.machine, 1)
    if args.jax_only:
        jax_steps = jax_step_rows(measured, machine, args.hlo_dir)
        previous = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {}
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=False).stdout.strip()
        previous.update({"jax_rows": jax_steps, "jax_rows_commit": commit, "jax_measured_file": args.measured})
        Path(args.out).write_text(json.dumps(previous, indent=1) + "\n")
        return 0
    gemm = gemm_rows(measured, machine)
    ratios = [g["ratio"] for g in gemm]
    print(f"gemm passes: {len(gemm)}, predicted / measured median {statistics.median(ratios):.2f}, "
          f"range {min(ratios):.2f}-{max(ratios):.2f}, within 10 %: {sum(abs(x - 1) <= 0.1 for x in ratios)}")
    steps = step_rows(measured, machine)
    jax_steps = jax_step_rows(measured, machine, args.hlo_dir)
    write_result("gpu_step", args.out, steps, machine=machine.name, measured_file=args.measured, jax_rows=jax_steps,
                 measured_on=measured["machine"], gemm=gemm,
                 gemm_summary={"passes": len(gemm), "median_ratio": statistics.median(ratios),
                               "min_ratio": min(ratios), "max_ratio": max(ratios),
                               "within_10_percent": sum(abs(x - 1) <= 0.1 for x in ratios)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
