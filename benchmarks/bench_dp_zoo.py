"""Solve times of the exact DP (with bound pruning) on the zoo models.

Each case (model, p) runs in its own subprocess: build the cost tables on the
paper machine (``shardplan.machine.preset("paper", p)``, the model's cutoff),
then ``solve_dp`` once timed, then once more under tracemalloc for the
solver's peak traced memory. Recorded per case: build seconds, DP seconds (wall
and CPU: the machine is shared, CPU seconds are the steadier figure) and
per phase (bounds, reduce, order, elimination), cost, max |D|, total table
entries, largest table, configurations before/after bound pruning and after
dominance, the bounds (UB, LB), peak traced memory of the solve and the
subprocess's peak RSS (which includes building the tables).

Run:  PYTHONPATH=. python benchmarks/bench_dp_zoo.py [--models a,b] [--procs 4,8] [--orders auto]
Writes benchmarks/results/dp_zoo.json (merging with cases already there).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

MODELS = ("alexnet", "inception_v3", "resnet101", "rnnlm", "transformer")
PROCS = (4, 8, 16, 32, 64)
OUT = Path(__file__).parent / "results" / "dp_zoo.json"


def run_case(model: str, p: int, orders: str, plain: bool) -> dict:
    from shardplan.cost import build_tables
    from shardplan.machine import preset
    from shardplan.models import model_spec
    from shardplan.search import solve_dp

    spec = model_spec(model)
    t0, c0 = time.perf_counter(), time.process_time()
    problem = build_tables(spec.build(None), preset("paper", p), cutoff=spec.cutoff, orders=orders).to_problem()
    build, build_cpu = time.perf_counter() - t0, time.process_time() - c0
    t0, c0 = time.perf_counter(), time.process_time()
    sol = solve_dp(problem)
    dp, dp_cpu = time.perf_counter() - t0, time.process_time() - c0
    st = sol.stats
    b = st["bounds"]
    tracemalloc.start()
    solve_dp(problem)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    row = {
        "model": model, "p": p, "orders": orders,
        "vertices": problem.num_vertices, "edges": len(problem.edges), "max_k": max(problem.sizes),
        "build_s": round(build, 3), "dp_s": round(dp, 4),
        "build_cpu_s": round(build_cpu, 3), "dp_cpu_s": round(dp_cpu, 4),
        "bounds_s": round(b["seconds"], 4), "reduce_s": round(st["reduce_seconds"] - b["seconds"], 4),
        "order_s": round(st["order_seconds"], 4), "eliminate_s": round(st["dp_seconds"], 4),
        "cost": sol.cost, "upper_bound": b["upper_bound"], "lower_bound": b["lower_bound"],
        "bound_rounds": b["rounds"],
        "configs": b["configs_before"], "configs_after_bounds": b["configs_after"],
        "configs_after_dominance": st["pruning"]["configs_after"],
        "max_dependent_set": st["max_dependent_set"], "total_table_entries": st["total_table_entries"],
        "largest_table": st["largest_table"],
        "solve_peak_traced_mb": round(peak / 2**20, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    if plain:
        t0 = time.perf_counter()
        ref = solve_dp(problem, bounds=False)
        row["plain_dp_s"] = round(time.perf_counter() - t0, 3)
        row["plain_cost"] = ref.cost
        row["plain_total_table_entries"] = ref.stats["total_table_entries"]
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--procs", default=",".join(map(str, PROCS)))
    ap.add_argument("--orders", default="auto", choices=("auto", "all", "row-major"))
    ap.add_argument("--plain", action="store_true", help="also time the DP without bounds (slow at large p)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per case (build included)")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--case", nargs=2, metavar=("MODEL", "P"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.case:
        print(json.dumps(run_case(args.case[0], int(args.case[1]), args.orders, args.plain)))
        return 0
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.exists() else {"cases": []}
    data["machine"] = {"python": platform.python_version(), "platform": platform.platform()}
    for model in [m.strip() for m in args.models.split(",") if m.strip()]:
        for p in [int(x) for x in args.procs.split(",")]:
            cmd = [sys.executable, __file__, "--case", model, str(p), "--orders", args.orders]
            if args.plain:
                cmd.append("--plain")
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
                row = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else \
                    {"model": model, "p": p, "orders": args.orders, "error": r.stderr.strip()[-500:]}
            except subprocess.TimeoutExpired:
                row = {"model": model, "p": p, "orders": args.orders, "error": f"timeout {args.timeout} s"}
            data["cases"] = [c for c in data["cases"]
                             if (c["model"], c["p"], c.get("orders")) != (model, p, args.orders)] + [row]
            print(json.dumps(row), flush=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
