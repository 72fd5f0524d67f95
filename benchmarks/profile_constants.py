"""The machine constants a GPU measurement gives, derived the one way for every profile file.

Run on a ``gpu_measure.py`` file (and the profile whose datasheet peak, multiprocessors and tile shapes it is
read against)::

    PYTHONPATH=. python benchmarks/profile_constants.py --measured benchmarks/results/gpu_measure_h200.json \
        --machine h200

prints one line per constant, with the statistic it is (what the profile files' sources quote):

* ``flops_efficiency``: per product pass of the ``gemm`` section, ``2 t n k / (seconds * peak * u)`` with ``u``
  the pass's tile and wave utilisation under the profile (:func:`shardplan.cost.operator.pass_utilisation`):
  median and quartiles over the passes;
* ``hbm_bandwidth``: the mean rate of ``x * 2`` and ``x + y`` (bytes read and written per second);
  ``convert_bandwidth``: ``x.float()``'s;
* ``attention_efficiency``: per shape of the ``attention`` section, the fused kernel's model FLOPs forward +
  backward, ``(14 + 9 / K)`` per unmasked (query, key, feature) point (:func:`shardplan.ops.flash_attention`),
  over the time and the peak: median and quartiles;
* ``host_bandwidth``: pinned copies of the largest size, the mean of both directions; ``host_latency``: what a
  64 KiB and a 1 MiB copy take beyond their bytes at that rate;
* ``fp8_flops``: the rate of ``torch._scaled_mm`` over the shapes of the ``fp8`` section (best and median);
  ``fp8_efficiency``: per shape, ``2 m n k / (fp8 seconds * fp8_flops * u)`` with ``u`` the product's tile and wave
  utilisation under the profile, as ``flops_efficiency``: median and quartiles (and the bf16 product of the same
  shapes the same way against ``peak_flops``, to compare).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile) of ``xs`` (statistics.quantiles, inclusive method)."""
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


def gemm_efficiencies(measured: dict[str, Any], machine: Any) -> list[float]:
    """``2 t n k / (seconds * peak * u)`` of every measured product pass."""
    import numpy as np

    from shardplan import ops
    from shardplan.cost.operator import pass_utilisation
    from shardplan.ir import TensorRef

    out = []
    for r in measured["gemm"]["layers"]:
        op = ops.dense("fc", TensorRef("x", (r["tokens"], r["k"]), needs_grad=True), r["n"])
        u = pass_utilisation(op, np.ones((1, len(op.dims)), dtype=np.int64), machine)[:, 0]
        grads = {t.role: float(x) for t, x in zip(op.grad_tensors, u[1:])}
        flops = 2.0 * r["tokens"] * r["n"] * r["k"]
        for name, ui in (("forward", float(u[0])), ("input_grad", grads["input"]), ("weight_grad", grads["weight"])):
            out.append(flops / (r[f"{name}_s"] * machine.peak_flops * ui))
    return out


def fp8_efficiencies(measured: dict[str, Any], machine: Any) -> tuple[list[float], list[float]]:
    """Per shape of the ``fp8`` section: (``2 m n k / (fp8 seconds * fp8_flops * u)``, the bf16 product's
    ``2 m n k / (bf16 seconds * peak_flops * u)``), ``u`` the forward product's tile and wave utilisation."""
    import numpy as np

    from shardplan import ops
    from shardplan.cost.operator import pass_utilisation
    from shardplan.ir import TensorRef

    fp8, bf16 = [], []
    for r in measured["fp8"]:
        op = ops.dense("fc", TensorRef("x", (r["m"], r["k"]), needs_grad=True), r["n"])
        u = float(pass_utilisation(op, np.ones((1, len(op.dims)), dtype=np.int64), machine)[0, 0])
        flops = 2.0 * r["m"] * r["n"] * r["k"]
        fp8.append(flops / (r["fp8_s"] * machine.fp8_flops * u))
        bf16.append(flops / (r["bf16_s"] * machine.peak_flops * u))
    return fp8, bf16


def attention_efficiencies(measured: dict[str, Any], peak: float) -> list[float]:
    """The fused kernel's model FLOPs forward + backward over time and peak, per measured shape."""
    out = []
    for r in measured["attention"]:
        s, d = r["seq"], r["head_dim"]
        points = r["batch"] * r["heads"] * d * (s * (s + 1) / 2 if r.get("causal", True) else s * s)
        out.append((14.0 + 9.0 / d) * points / (r["forward_backward_s"] * peak))
    return out


def constants(measured: dict[str, Any], machine: Any) -> dict[str, Any]:
    """Every constant this file derives, with its statistic."""
    eff = gemm_efficiencies(measured, machine)
    rate = {r["op"]: r["bytes_per_second"] for r in measured["memory_bound"] if r.get("bytes_per_second")}
    att = attention_efficiencies(measured, machine.peak_flops)
    host = sorted(measured["host"], key=lambda r: r["bytes"])
    big = host[-1]
    bw = (big["host_to_device_bytes_per_second"] + big["device_to_host_bytes_per_second"]) / 2
    beyond = {r["bytes"]: r["host_to_device_s"] - r["bytes"] / bw for r in host if r["bytes"] <= 1 << 20}
    fp8 = [r["fp8_tflops"] * 1e12 for r in measured["fp8"] if r.get("fp8_tflops")]
    eff8, eff16 = fp8_efficiencies(measured, machine) if fp8 else ([], [])
    return {
        "device": measured["machine"].get("device"), "date": measured["machine"].get("date"),
        "flops_efficiency": {"quartiles": quartiles(eff), "passes": len(eff)},
        "hbm_bandwidth": statistics.mean([rate["x * 2"], rate["x + y"]]),
        "memory_bound_rates": rate,
        "convert_bandwidth": rate.get("x.float() (bf16 read, fp32 written)"),
        "attention_efficiency": {"quartiles": quartiles(att), "shapes": len(att), "min": min(att), "max": max(att)},
        "host_bandwidth": bw, "host_latency_beyond_bytes": beyond,
        "fp8_flops": {"best": max(fp8), "median": statistics.median(fp8)} if fp8 else None,
        "fp8_efficiency": {"quartiles": quartiles(eff8), "shapes": len(eff8), "min": min(eff8), "max": max(eff8),
                           "bf16_same_shapes": quartiles(eff16)} if fp8 else None,
        "memory_bytes": measured["machine"].get("memory_bytes"),
        "sm_count": measured["machine"].get("sm_count"),
    }


def main(argv: list[str] | None = None) -> int:
    from shardplan.machine import preset

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--measured", required=True, help="a gpu_measure.py file")
    ap.add_argument("--machine", default="h100", help="the profile read against (its peak, SMs, tiles)")
    args = ap.parse_args(argv)
    out = constants(json.loads(Path(args.measured).read_text()), preset(args.machine, 1))
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
