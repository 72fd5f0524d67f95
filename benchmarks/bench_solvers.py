"""Solve times of the exact DP, the ILP (HiGHS) and MCMC on the zoo at p = 8 and 64.

Writes benchmarks/results/solvers.json. The ILP runs under a time limit
(default 120 s); where it stops, its status, best cost and gap are recorded.
MCMC starts from the expert strategy, as the paper ran FlexFlow.

    PYTHONPATH=. python benchmarks/bench_solvers.py [--procs 8,64] [--models ...] [--ilp-limit 120]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from shardplan.baselines import baseline_plan
from shardplan.cost import build_tables
from shardplan.machine import preset
from shardplan.models import model_spec
from shardplan.search import solve_dp, solve_ilp, solve_mcmc


def ilp_size(problem) -> int:
    """Variables of the ILP's local-polytope formulation: one per configuration and per edge pair."""
    return sum(problem.sizes) + sum(m.size for m in problem.edge_cost)


def run(models: list[str], procs: list[int], ilp_limit: float, ilp_max_vars: int, out: Path) -> dict:
    rows = []
    for name in models:
        spec = model_spec(name)
        g = spec.build()
        for p in procs:
            t0 = time.perf_counter()
            tables = build_tables(g, preset("paper", p), cutoff=spec.cutoff)
            build = time.perf_counter() - t0
            problem = tables.to_problem()
            dp = solve_dp(problem)
            row = {"model": name, "p": p, "vertices": problem.num_vertices, "configurations": sum(problem.sizes),
                   "orders": tables.options["orders"], "build_seconds": build,
                   "dp": {"seconds": dp.solve_seconds, "cost": dp.cost}}
            expert = baseline_plan(spec.expert, tables)
            mc = solve_mcmc(problem, init=list(expert.assignment), seed=0)
            row["mcmc"] = {"seconds": mc.solve_seconds, "cost": mc.cost, "gap_vs_dp": mc.cost / dp.cost - 1,
                           "proposals": mc.stats.get("proposals")}
            n_vars = ilp_size(problem)
            try:
                if n_vars > ilp_max_vars:
                    raise RuntimeError(f"skipped: {n_vars:.3g} ILP variables > {ilp_max_vars:.3g} (memory)")
                il = solve_ilp(problem, time_limit=ilp_limit)
                row["ilp"] = {"seconds": il.solve_seconds, "cost": il.cost, "optimal": il.optimal,
                              "bound": il.bound, "agrees_with_dp": abs(il.cost - dp.cost) <= 1e-6 * dp.cost,
                              "variables": il.stats.get("variables")}
            except Exception as e:  # noqa: BLE001 - a stopped ILP with no feasible point is a result here
                row["ilp"] = {"seconds": ilp_limit, "error": str(e)}
            rows.append(row)
            out.write_text(json.dumps({"ilp_time_limit": ilp_limit, "rows": rows, "partial": True}, indent=1) + "\n")
            print(f"{name:13s} p={p:3d} K={row['configurations']:6d} DP {dp.solve_seconds:8.3f} s  "
                  f"MCMC {mc.solve_seconds:7.3f} s (+{row['mcmc']['gap_vs_dp']:.1%})  ILP "
                  + (f"{row['ilp']['seconds']:7.2f} s optimal={row['ilp'].get('optimal')} "
                     f"agrees={row['ilp'].get('agrees_with_dp')}" if "error" not in row["ilp"] else row["ilp"]["error"]),
                  flush=True)
    return {"host": platform.node(), "python": platform.python_version(), "ilp_time_limit": ilp_limit, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="alexnet,rnnlm,inception_v3,resnet101,transformer")
    ap.add_argument("--procs", default="8,64")
    ap.add_argument("--ilp-limit", type=float, default=120.0)
    ap.add_argument("--ilp-max-vars", type=float, default=1e7, help="skip the ILP above this many variables")
    ap.add_argument("--out", default="benchmarks/results/solvers.json")
    a = ap.parse_args()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    res = run(a.models.split(","), [int(x) for x in a.procs.split(",")], a.ilp_limit, int(a.ilp_max_vars), out)
    out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
