"""The fit search against the HiGHS ILP with a memory row, on zoo models at tight budgets.

Usage: python benchmarks/bench_fit_ilp.py
Writes benchmarks/results/fit_ilp.json: per case, the budget (a fraction of the unconstrained
optimum's peak), the fit search's cost, proof and time, the ILP's cost, status and time, and
whether they agree (1e-9 relative) where both proved optimality.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

from shardplan.cost import build_tables
from shardplan.fit import FitOptions, fit_problem, solve_fit
from shardplan.machine import preset
from shardplan.models import get_model
from shardplan.search.constrained import solve_memory
from shardplan.search.memory_ilp import solve_memory_ilp

CASES = [  # the ILP over expanded choices grows fast: these are the sizes it can finish
    ("gpt-1layer", dict(batch=8, layers=1, d_model=64, heads=2, seq=32, vocab=256), "a100", 4),
    ("gpt-1layer", dict(batch=8, layers=1, d_model=64, heads=2, seq=32, vocab=256), "a100", 8),
    ("gpt-2layer", dict(batch=8, layers=2, d_model=128, heads=2, seq=64, vocab=512), "a100", 4),
    ("gpt-tiny", dict(batch=16, layers=2, d_model=256, heads=4, seq=128, vocab=8192), "a100", 8),
]
FRACTIONS = (0.8, 0.5, 0.3)
OUT = Path(__file__).parent / "results" / "fit_ilp.json"


def main() -> None:
    rows = []
    for name, sizes, mname, p in CASES:
        model = "gpt" if name.startswith("gpt") else name
        sizes = dict(sizes)
        batch = sizes.pop("batch", None)
        g = get_model(model, batch=batch, **sizes)
        m = preset(mname, p)
        tables = replace(build_tables(g, replace(m, memory_bytes=None), orders="row-major"), machine=m)
        free = solve_fit(g, m, budget=1e15, tables=tables, options=FitOptions(micro_batches=(1,)))
        for frac in FRACTIONS:
            budget = frac * free.memory["peak_bytes"]
            mp, _ = fit_problem(tables, budget, 1, FitOptions(micro_batches=(1,)))
            row = {"model": name, "machine": mname, "p": p, "fraction": frac, "budget_bytes": budget,
                   "choices": sum(mp.num_choices), "vertices": mp.problem.num_vertices}
            try:
                t0 = time.perf_counter()
                s = solve_memory(mp, time_limit=120)
                row.update(fit_cost=s.cost, fit_optimal=s.optimal, fit_bound=s.bound, fit_nodes=s.stats["nodes"],
                           fit_dp_solves=s.stats["dp_solves"], fit_seconds=time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001 - recorded
                row["fit_error"] = str(e)
            try:
                t0 = time.perf_counter()
                i = solve_memory_ilp(mp, time_limit=60)
                row.update(ilp_cost=i.cost, ilp_optimal=i.optimal, ilp_status=i.stats["status"],
                           ilp_variables=i.stats["variables"], ilp_seconds=time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001 - recorded
                row["ilp_error"] = str(e)
            if row.get("fit_optimal") and row.get("ilp_optimal"):
                row["agree"] = abs(row["fit_cost"] - row["ilp_cost"]) <= 1e-9 * row["ilp_cost"]
            print(json.dumps(row), flush=True)
            rows.append(row)
            OUT.parent.mkdir(parents=True, exist_ok=True)
            OUT.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
