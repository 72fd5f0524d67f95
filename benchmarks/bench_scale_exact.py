"""Exactness of the fast GPT-3 search: the memoised DP against the plain DP and the ILP on fewer layers.

GPT-3 175B's layer (d 12288, 96 heads, sequence 2048, vocabulary 50304) on
the h100 preset, with 4, 6 or 8 layers instead of 96. For each case: the
default search (bound pruning symmetric over identical operators,
reductions with their per-vertex cache, the DP with its memo of equal
eliminations and the cut-vertices-last order) against

* the plain DP (``memo=False``: per-vertex bound pruning, no memo, no
  symmetric restriction; the search as it was before), and
* the ILP (HiGHS, on the bound-pruned problem) where it finishes in its
  time limit (small device counts: at p = 64 its edge variables alone
  number millions).

Recorded: optimum of each, their relative difference, CPU seconds of each,
memo hits and misses.

Run:  PYTHONPATH=. python benchmarks/bench_scale_exact.py
Writes benchmarks/results/scale_exact.json.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

OUT = Path(__file__).parent / "results" / "scale_exact.json"
LAYER = {"d_model": 12288, "heads": 96, "seq": 2048, "vocab": 50304}
CASES = [(4, 64, False), (6, 64, False), (8, 64, False), (4, 8, True), (8, 8, True), (4, 16, True)]


def _cpu() -> float:
    return time.process_time()


def run(layers: int, p: int, ilp: bool) -> dict:
    from shardplan.cost import build_tables
    from shardplan.machine import preset
    from shardplan.models import model_spec
    from shardplan.search import solve_dp, solve_ilp

    ms = model_spec("gpt")
    g = ms.build(layers=layers, **LAYER)
    problem = build_tables(g, preset("h100", p), cutoff=ms.cutoff).to_problem()
    c0 = _cpu()
    fast = solve_dp(problem)
    c1 = _cpu()
    plain = solve_dp(problem, memo=False)
    c2 = _cpu()
    row = {"layers": layers, "p": p, "vertices": problem.num_vertices, "configs": sum(problem.sizes),
           "fast_cost": fast.cost, "fast_optimal": fast.optimal, "fast_cpu_s": round(c1 - c0, 3),
           "memo": fast.stats.get("memo"),
           "plain_cost": plain.cost, "plain_optimal": plain.optimal, "plain_cpu_s": round(c2 - c1, 3),
           "rel_diff_plain": abs(fast.cost - plain.cost) / plain.cost}
    if ilp:
        s = solve_ilp(problem, time_limit=300, prune=True)
        row.update(ilp_cost=s.cost, ilp_optimal=s.optimal, ilp_cpu_s=round(_cpu() - c2, 3),
                   rel_diff_ilp=abs(fast.cost - s.cost) / s.cost)
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    rows = [run(*c) for c in CASES]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"machine": {"platform": platform.platform(), "python": platform.python_version()},
                               "layer": LAYER, "cases": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
