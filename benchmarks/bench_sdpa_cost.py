"""PyTorch's ``scaled_dot_product_attention`` as the cost model charges it, against one GPU's measurement.

Each row of the ``attention`` section of ``benchmarks/gpu_measure.py``'s JSON (default
``benchmarks/results/gpu_measure_h100.json``: causal SDPA, bf16, head dim 128, forward and forward + backward
timed on one H100 80GB HBM3) is traced by :func:`shardplan.torch.trace` on the meta device, as the
frontend describes it now (the fused core, :func:`shardplan.ops.flash_attention`: the causal share of the
work, a fused backward of ``10 + 4 / K`` FLOPs per point) and as it described it before (one generic
attention, dims ``b h l s e f``, the whole domain charged and its backward as two more passes:
``shardplan.torch.frontend._sdpa_general``), and costed on one device of the machine (``--machine h100``,
nothing fitted): forward alone (no input gradient wanted) and forward + backward. Predicted / measured per
row; JSON under ``benchmarks/results/``.

Run: ``PYTHONPATH=. python benchmarks/bench_sdpa_cost.py [--measured FILE] [--machine h100]
[--out benchmarks/results/sdpa_cost.json]``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

SDPA = "aten.scaled_dot_product_attention.default"


def traced_core(b: int, h: int, kv: int, s: int, d: int, before: bool) -> Any:
    """The attention operator the frontend describes for causal SDPA of these shapes (``before``: the
    generic description it had), traced on the meta device."""
    import torch
    import torch.nn.functional as F

    from shardplan.torch.frontend import HANDLERS, _sdpa_general, trace

    class Core(torch.nn.Module):
        def forward(self, q: Any, k: Any, v: Any) -> Any:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=h != kv)

    q = torch.empty(b, h, s, d, device="meta", dtype=torch.bfloat16)
    k = torch.empty(b, kv, s, d, device="meta", dtype=torch.bfloat16)
    handlers = {**HANDLERS, SDPA: _sdpa_general} if before else None
    graph, _ = trace(Core(), (q, k, k), handlers=handlers)
    (op,) = graph.operators
    return op


def predicted(op: Any, machine: Any) -> tuple[float, float]:
    """(forward, forward + backward) seconds of ``op`` on one device: its compute with no input gradient
    wanted, and with every input's."""
    import numpy as np

    from shardplan.cost.operator import operator_cost

    one = np.ones((1, len(op.dims)), dtype=np.int64)

    def with_grads(flag: bool) -> Any:
        return dataclasses.replace(op, inputs=tuple(dataclasses.replace(t, needs_grad=flag) for t in op.inputs))

    return (float(operator_cost(with_grads(False), one, machine).compute[0]),
            float(operator_cost(with_grads(True), one, machine).compute[0]))


def rows_for(measured: dict[str, Any], machine: Any) -> list[dict[str, Any]]:
    rows = []
    for r in measured["attention"]:
        shape = (r["batch"], r["heads"], r["kv_heads"], r["seq"], r["head_dim"])
        row: dict[str, Any] = {"batch": shape[0], "heads": shape[1], "kv_heads": shape[2], "seq": shape[3],
                               "head_dim": shape[4], "measured_forward_s": r["forward_s"],
                               "measured_forward_backward_s": r["forward_backward_s"]}
        for tag, before in (("before", True), ("after", False)):
            f, fb = predicted(traced_core(*shape, before=before), machine)
            row[f"{tag}_forward_s"], row[f"{tag}_forward_backward_s"] = f, fb
            row[f"{tag}_forward_ratio"] = f / r["forward_s"]
            row[f"{tag}_forward_backward_ratio"] = fb / r["forward_backward_s"]
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| b | h | kv | s | measured fwd / fwd+bwd (ms) | before: predicted (ms), ratio | "
            "after: predicted (ms), ratio |\n|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        ms = lambda x: f"{1e3 * x:.2f}"  # noqa: E731
        lines.append(
            f"| {r['batch']} | {r['heads']} | {r['kv_heads']} | {r['seq']} | "
            f"{ms(r['measured_forward_s'])} / {ms(r['measured_forward_backward_s'])} | "
            f"{ms(r['before_forward_s'])} / {ms(r['before_forward_backward_s'])}, "
            f"{r['before_forward_ratio']:.2f} / {r['before_forward_backward_ratio']:.2f} | "
            f"{ms(r['after_forward_s'])} / {ms(r['after_forward_backward_s'])}, "
            f"{r['after_forward_ratio']:.2f} / {r['after_forward_backward_ratio']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.record import write_result
    from shardplan.machine import preset

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--measured", default="benchmarks/results/gpu_measure_h100.json")
    ap.add_argument("--machine", default="h100")
    ap.add_argument("--out", default="benchmarks/results/sdpa_cost.json")
    args = ap.parse_args(argv)
    measured = json.loads(Path(args.measured).read_text())
    machine = preset(args.machine, 1)
    rows = rows_for(measured, machine)
    print(table(rows))
    write_result("sdpa_cost", args.out, rows, machine=machine.name, measured_file=args.measured,
                 measured_device=measured.get("machine", {}).get("device"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
