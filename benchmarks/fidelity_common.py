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


def plot(results: list[dict[str, Any]], path: Any, marks: dict[str, tuple[str, str]], ylabel: str, title: str,
         band: bool = False) -> None:
    """Predicted against measured step time, log-log, one marker per experiment (``marks``: experiment ->
    (marker, legend label)), each row annotated, y = x dashed; ``band``: the ±10 % band shaded under it."""
    from pathlib import Path

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 5.6))
    done = [r for r in results if r.get("status") == "costed"]
    for exp, (mk, label) in marks.items():
        rs = [r for r in done if r["experiment"] == exp]
        if rs:
            ax.scatter([r["measured_seconds"] for r in rs], [r["predicted_seconds"] for r in rs], marker=mk,
                       label=label)
            for r in rs:
                ax.annotate(r["row"], (r["measured_seconds"], r["predicted_seconds"]), fontsize=6,
                            xytext=(3, 3), textcoords="offset points")
    if done:
        lo = min(min(r["measured_seconds"], r["predicted_seconds"]) for r in done) / 1.5
        hi = max(max(r["measured_seconds"], r["predicted_seconds"]) for r in done) * 1.5
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="predicted = measured")
        if band:
            ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="0.9", label="±10 %",
                            zorder=0)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured step time (s)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_main(argv: list[str] | None, doc: str, every: list[Any], run_row: Any, header: dict[str, Any],
             rank_orders: Any, plot_rows: Any, out_default: str, plot_default: str, experiments: str,
             name_width: int = 24) -> int:
    """The command line both fidelity benchmarks share: ``--rows`` (names or experiments), ``--row-limit``,
    ``--out`` (rows merged into what is there, the file rewritten after each row with ``header``, the rows in
    ``every``'s order and their ``rank_orders``), ``--plot`` (``plot_rows(results, path)``), ``--list``."""
    import argparse
    import json
    import sys
    from pathlib import Path

    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--rows", help=f"comma-separated row names or experiments ({experiments}); default: all")
    ap.add_argument("--row-limit", type=float, default=180.0, help="seconds per row before it is skipped")
    ap.add_argument("--out", default=out_default)
    ap.add_argument("--plot", default=plot_default)
    ap.add_argument("--list", action="store_true", help="list the rows and exit")
    args = ap.parse_args(argv)
    if args.list:
        for r in every:
            print(f"{r.name:{name_width}s} {r.gpus:6d} GPUs  {r.recipe}")
        return 0
    chosen = every
    if args.rows:
        want = {w.strip() for w in args.rows.split(",") if w.strip()}
        unknown = want - {r.name for r in every} - {r.experiment for r in every}
        if unknown:
            print(f"unknown rows {sorted(unknown)}; --list shows them", file=sys.stderr)
            return 2
        chosen = [r for r in every if r.name in want or r.experiment in want]
    out = Path(args.out)
    old = {r["row"]: r for r in json.loads(out.read_text())["rows"]} if out.exists() else {}
    for row in chosen:
        res = run_row(row, args.row_limit)
        old[row.name] = res
        ratio = f"ratio {res['ratio']:.3f}" if "ratio" in res else res.get("reason", "")
        cpu = f", {res['cpu_seconds']:.1f} s CPU" if "cpu_seconds" in res else ""
        print(f"{row.name}: {res['status']} {ratio} ({res.get('seconds', 0.0):.1f} s{cpu})", flush=True)
        results = [old[r.name] for r in every if r.name in old]
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({**header, "rows": results, "rank_orders": rank_orders(results)}, indent=1) + "\n")
    plot_rows([old[r.name] for r in every if r.name in old], Path(args.plot))
    return 0
