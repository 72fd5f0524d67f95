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
  ``backward_peak_ratio_without_optimizer_state``).

Run: ``PYTHONPATH=. python benchmarks/bench_gpu_step.py [--measured FILE] [--machine h100 | --machine-file F]
[--out benchmarks/results/gpu_step.json]``
"""

from __future__ import annotations

import argparse
import json
import statistics
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
    return {"predicted_s": p.step_time, "predicted_optimizer_s": float(p.breakdown.get("optimizer", 0.0)),
            "predicted_peak_bytes": p.memory["peak_bytes"],
            "predicted_activations_bytes": p.memory["activations_bytes"], "predicted_optimizer_state_bytes": opt_state,
            "predicted_backward_peak_bytes": back["peak_bytes"], "recomputed": len(p.recomputed),
            "plan_cpu_seconds": seconds}


def jax_step_rows(measured: dict[str, Any], machine: Any) -> list[dict[str, Any]]:
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
    return rows


def main(argv: list[str] | None = None) -> int:
    from benchmarks.record import write_result
    from shardplan.machine import load_machine_file, preset

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--measured", default="benchmarks/results/gpu_measure_h100.json")
    ap.add_argument("--machine", default="h100", help="machine preset (default h100)")
    ap.add_argument("--machine-file", help="a machine file instead of the preset")
    ap.add_argument("--out", default="benchmarks/results/gpu_step.json")
    args = ap.parse_args(argv)
    measured = json.loads(Path(args.measured).read_text())
    machine = load_machine_file(args.machine_file, 1) if args.machine_file else preset(args.machine, 1)
    gemm = gemm_rows(measured, machine)
    ratios = [g["ratio"] for g in gemm]
    print(f"gemm passes: {len(gemm)}, predicted / measured median {statistics.median(ratios):.2f}, "
          f"range {min(ratios):.2f}-{max(ratios):.2f}, within 10 %: {sum(abs(x - 1) <= 0.1 for x in ratios)}")
    steps = step_rows(measured, machine)
    jax_steps = jax_step_rows(measured, machine)
    write_result("gpu_step", args.out, steps, machine=machine.name, measured_file=args.measured, jax_rows=jax_steps,
                 measured_on=measured["machine"], gemm=gemm,
                 gemm_summary={"passes": len(gemm), "median_ratio": statistics.median(ratios),
                               "min_ratio": min(ratios), "max_ratio": max(ratios),
                               "within_10_percent": sum(abs(x - 1) <= 0.1 for x in ratios)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
