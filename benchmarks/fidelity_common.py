"""Pieces shared by the fidelity benchmarks (``bench_fidelity.py`` for the published A100 runs,
``bench_fidelity_h100.py`` for the published H100 runs): ranking rows by throughput and comparing the
predicted order with the measured one.

The rank of a row is its place by TFLOP/s per GPU, highest first (1 = fastest). Kendall's tau between the
measured and the predicted values is (concordant − discordant pairs) / all pairs: 1 when the orders agree,
−1 when one is the other reversed; a tie in either list counts as neither.
"""

from __future__ import annotations

from typing import Any


def ranks(values: list[float]) -> list[int]:
    """Rank of each value, 1 = highest (ties broken by position, the earlier first)."""
    order = sorted(range(len(values)), key=lambda i: -values[i])
    out = [0] * len(values)
    for r, i in enumerate(order, 1):
        out[i] = r
    return out


def kendall_tau(measured: list[float], predicted: list[float]) -> float:
    """Kendall's tau between two equally long lists of at least two values (module docstring)."""
    n = len(measured)
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    conc = sum(1 for i, j in pairs if (measured[i] - measured[j]) * (predicted[i] - predicted[j]) > 0)
    disc = sum(1 for i, j in pairs if (measured[i] - measured[j]) * (predicted[i] - predicted[j]) < 0)
    return (conc - disc) / len(pairs)


def compare_ranks(rows: list[dict[str, Any]], measured_key: str = "measured_tflops_per_gpu",
                  predicted_key: str = "predicted_tflops_per_gpu") -> dict[str, Any]:
    """The measured and predicted rank order of ``rows`` (each a result with ``row``, ``status`` and, when
    costed, the throughputs ``measured_key`` and ``predicted_key``), Kendall's tau between them and whether the
    orders agree; when a row was not costed, which and why (``compared`` False). The two keys must count the
    same FLOPs for every row compared (one FLOP formula), or the order is not that of the step times."""
    missing = [r for r in rows if r.get("status") != "costed"]
    if missing:
        return {"rows": [r["row"] for r in rows], "compared": False,
                "reason": "not costed: " + "; ".join(f"{r['row']} ({r.get('status')})" for r in missing)}
    meas = [r[measured_key] for r in rows]
    pred = [r[predicted_key] for r in rows]
    mr, pr = ranks(meas), ranks(pred)
    return {"rows": [r["row"] for r in rows], "measured_rank": mr, "predicted_rank": pr,
            "same_order": mr == pr, "kendall_tau": kendall_tau(meas, pred), "compared": True}
