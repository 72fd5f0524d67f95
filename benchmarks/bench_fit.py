"""Plans that fit: the issue's three rows (zoo gpt on a100/h100 presets, 80 GiB), unconstrained vs. fit.

Usage: python benchmarks/bench_fit.py [row ...]   (rows: the keys of ROWS; default all)
Writes benchmarks/results/fit.json (one entry per row, merged with what is there).

Rows ending in ``-backward`` use the backward-peak memory model (``FitOptions.grad_buffers =
"backward"``, :mod:`shardplan.fit`); it differs from the additive one only with one micro-batch, so
the ``-m1`` rows search one micro-batch only, under either model, to compare them.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

from shardplan.fit import FitOptions, solve_fit
from shardplan.machine import preset
from shardplan.models import get_model, model_spec
from shardplan.spmd import SpmdPlan
from shardplan.search.dp import solve_dp
from shardplan.units import fmt_bytes, fmt_seconds

ROWS = {
    "gpt1.7b": dict(machine="a100", p=32, batch=512, sizes=dict(layers=24, d_model=2304, seq=2048)),
    "llama8b": dict(machine="h100", p=64, batch=64, sizes=dict(layers=32, d_model=4096, seq=8192, vocab=128256)),
    # 96 identical layers: each Lagrangian DP reduces one layer and reuses it (the DP's memo); bound pruning
    # is off for it: on these Lagrangian problems it drops under 10% of the configurations and costs more
    # CPU than the DP it saves (9.4 s vs 4.2 s per solve, measured at lambda = 0 and 2e-12 s/B)
    # cutoff 4 (solve_fit's default): proven; at the model's cutoff 1 the dual's bracketing points differ in
    # adjacent vertices of every layer (one group spanning the model): the mixing solves their union by the front
    # program (2.0262 s, 0.026 % above the bound; the knapsack of groups gave 2 %), but 900 s do not close the gap:
    # branching on one vertex of 96 identical layers hardly moves the bound, and fixing by TRW-S bounds leaves
    # ~50-140 configurations per vertex (exact min-marginals would drop most of them: 8 of 9 sampled exceed the cutoff)
    "gpt3-175b": dict(machine="h100", p=256, batch=None, sizes=dict(layers=96, d_model=12288, heads=96),
                      dp=dict(bounds=False), time_limit=900.0, cutoff=4),
    "gpt3-175b-cutoff1": dict(machine="h100", p=256, batch=None, sizes=dict(layers=96, d_model=12288, heads=96),
                              dp=dict(bounds=False), time_limit=900.0),
}
for _name in ("gpt1.7b", "llama8b", "gpt3-175b"):  # the backward-peak model beside the additive rows
    ROWS[f"{_name}-backward"] = dict(ROWS[_name], fit=dict(grad_buffers="backward"))
# the same with twice the time (the first stopped at 900 s wall on the loaded machine, gap 1.1e-5)
ROWS["gpt3-175b-backward-1800s"] = dict(ROWS["gpt3-175b-backward"], time_limit=1800.0)
for _name in ("gpt1.7b", "llama8b"):
    ROWS[f"{_name}-m1"] = dict(ROWS[_name], fit=dict(micro_batches=(1,)))
    ROWS[f"{_name}-m1-backward"] = dict(ROWS[_name], fit=dict(micro_batches=(1,), grad_buffers="backward"))
OUT = Path(__file__).parent / "results" / "fit.json"


def run(name: str, time_limit: float = 120.0) -> dict:
    row = ROWS[name]
    g = get_model("gpt", batch=row["batch"], **row["sizes"])
    m = preset(row["machine"], row["p"])
    # the model's recommended cutoff (1 for gpt), as `shardplan solve gpt --fit` uses: solve_fit's own default
    # is build_tables' 4 (the paper's CNN setting), which would drop layouts the CLI searches
    cutoff = row.get("cutoff", model_spec("gpt").cutoff)
    t0, c0 = time.perf_counter(), time.process_time()
    time_limit = row.get("time_limit", time_limit)
    plan = solve_fit(g, m, options=FitOptions(time_limit=time_limit, **row.get("fit", {})), cutoff=cutoff,
                     **row.get("dp", {}))
    total, cpu = time.perf_counter() - t0, time.process_time() - c0
    tables = plan.tables
    problem = tables.to_problem()
    free = solve_dp(problem)
    unconstrained = SpmdPlan(tables, free.assignment, free, "dp")
    mem = plan.memory
    sol = plan.solution
    names = [op.name for op in g.operators]
    res = {
        "row": name, "model": "gpt", "batch": row["batch"], "sizes": row["sizes"], "machine": m.name,
        "devices": m.num_devices, "budget_bytes": m.memory_bytes, "cutoff": cutoff,
        "configurations": int(sum(problem.sizes)),
        "unconstrained": {"cost_seconds": unconstrained.cost, "peak_bytes": unconstrained.memory["peak_bytes"],
                          "weights_bytes": unconstrained.memory["weights_bytes"],
                          "activations_bytes": unconstrained.memory["activations_bytes"]},
        "fit_options": {k: list(v) if isinstance(v, tuple) else v for k, v in row.get("fit", {}).items()},
        "fit": {"cost_seconds": plan.cost, "peak_bytes": mem["peak_bytes"], "weights_bytes": mem["weights_bytes"],
                "additive_peak_bytes": mem.get("additive_peak_bytes", mem["peak_bytes"]),
                "peak_operator": names[mem["peak_step"]] if "peak_step" in mem else None,
                "activations_bytes": mem["activations_bytes"], "micro_batches": mem["micro_batches"],
                "optimal": sol.optimal, "bound_seconds": sol.bound, "gap": sol.stats["gap"],
                "choices": plan.memory_choices.summary(names),
                "per_micro_batches": sol.stats["per_micro_batches"], "breakdown": plan.breakdown},
        "build_seconds": plan.build_seconds, "search_seconds": sol.solve_seconds, "total_seconds": total,
        "cpu_seconds": cpu, "time_limit_per_count": time_limit, "dp_options": row.get("dp", {}),
        "dp_solves": sol.stats.get("dp_solves"), "nodes": sol.stats.get("nodes"),
        "separable_nodes": sol.stats.get("separable_nodes"),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    print(f"{name}: unconstrained {fmt_seconds(unconstrained.cost)} at {fmt_bytes(unconstrained.memory['peak_bytes'])}; "
          f"fit {fmt_seconds(plan.cost)} at {fmt_bytes(mem['peak_bytes'])} (m={mem['micro_batches']}, "
          f"optimal={sol.optimal}, gap={sol.stats['gap']:.2e}); build {plan.build_seconds:.1f} s, "
          f"search {sol.solve_seconds:.1f} s", flush=True)
    return res


def main(argv: list[str]) -> None:
    names = argv or list(ROWS)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(OUT.read_text()) if OUT.exists() else {}
    for n in names:
        data[n] = run(n)
        OUT.write_text(json.dumps(data, indent=1, default=float))


if __name__ == "__main__":
    main(sys.argv[1:])
