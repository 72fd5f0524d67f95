"""Memory guards: each guarded phase's estimate against its measured peak.

Every case runs in a fresh process (tests/memprobe.py): the kernel's
peak-RSS counter is reset just before the phase, so ``measured`` is what the
phase itself allocated at its worst moment. The estimate is what the guard
compares with the memory limit before allocating; it must be at least the
measured peak. Writes benchmarks/results/memory_guards.json.

    python -m benchmarks.memory_guards [--quick]
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import memprobe  # noqa: E402

BUILD = '''
from shardplan.models import get_model
from shardplan.machine import preset
from shardplan.cost import build_tables
g, m = get_model("{model}"), preset("{machine}", {p})
'''
BUILD_PHASE = ("build_tables(g, m, cutoff={cutoff}, divides_p={divides}, orders='{orders}', "
               "memory_limit_bytes=10**12).options")
GRAPHS = '''
from shardplan.search import solve_dp, solve_bfs_dp
from randgraphs import complete, spider

p = {make}
'''
ILP = '''
import scipy.optimize
from shardplan.cost import build_tables
from shardplan.machine import preset
from shardplan.models import get_model
from shardplan.search import solve_ilp
p = build_tables(get_model("{model}"), preset("paper", {p}), cutoff={cutoff}).to_problem()
'''


def cases(quick: bool) -> list[tuple[str, str, str, str]]:
    """(phase, case, setup, phase expression returning [estimate, ...] or stats)."""
    out = []
    builds = [("rnnlm", "h100", 32, 1, True, "all"), ("alexnet", "paper", 64, 1, True, "all"),
              ("alexnet", "paper", 128, 4, False, "row-major")]
    for model, machine, p, cutoff, divides, orders in builds[: 1 if quick else None]:
        kw = dict(model=model, machine=machine, p=p, cutoff=cutoff, divides=divides, orders=orders)
        name = f"{model} {machine} p={p} cutoff {cutoff} orders {orders}" + ("" if divides else " all-divisors")
        out.append(("cost-table build", name, BUILD.format(**kw), BUILD_PHASE.format(**kw)))
    dps = [(8, 8), (9, 6)] + ([] if quick else [(9, 8)])
    for n, k in dps:
        out.append(("dp", f"complete graph {n} vertices x {k} configurations (no pruning)",
                    GRAPHS.format(make=f"complete({n}, {k})"),
                    "solve_dp(p, prune=False, bounds=False, memory_limit_bytes=10**12).stats"))
    for legs in [19] + ([] if quick else [22]):
        out.append(("bfs-dp", f"spider: {legs} legs of 2, 2 configurations",
                    GRAPHS.format(make=f"spider({legs}, 2)"),
                    "solve_bfs_dp(p, memory_limit_bytes=10**12).stats"))
    ilps = [("alexnet", 4, 4), ("rnnlm", 8, 1)] + ([] if quick else [("alexnet", 16, 4), ("alexnet", 32, 4)])
    for model, p, cutoff in ilps:
        out.append(("ilp", f"{model} paper p={p}", ILP.format(model=model, p=p, cutoff=cutoff),
                    "solve_ilp(p, memory_limit_bytes=10**12).stats"))
    return out


def main() -> None:
    quick = "--quick" in sys.argv
    rows = []
    for phase, name, setup, expr in cases(quick):
        t0 = time.perf_counter()
        r = memprobe.measure(setup, expr, timeout=1200)
        if r["error"]:
            raise SystemExit(f"{phase} {name}: {r['error']}")
        res = r["result"]
        est = res["memory_estimate_bytes"]
        row = {"phase": phase, "case": name, "estimate_bytes": int(est), "measured_peak_bytes": int(r["used"]),
               "ratio_measured_to_estimate": r["used"] / est, "seconds": time.perf_counter() - t0}
        rows.append(row)
        print(f"{phase:16s} {name:58s} estimate {est / 2**20:9.1f} MiB  measured {r['used'] / 2**20:9.1f} MiB  "
              f"({row['ratio_measured_to_estimate']:.2f})", flush=True)
        if r["used"] > est:
            print(f"  ESTIMATE BELOW MEASURED PEAK for {phase} {name}", flush=True)
    out = {"host": platform.node(), "python": platform.python_version(), "quick": quick, "rows": rows}
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "memory_guards.json")
    with open(path, "w") as fh:
        json.dump(out, fh, indent=2)
        fh.write("\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
