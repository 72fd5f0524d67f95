"""FP8 products and host offload: GPT-3 13B and Llama 3 8B on 8 H100, with and without each choice.

Usage: python benchmarks/bench_precision_offload.py [model ...]   (models: the keys of ROWS; default all)
Writes benchmarks/results/precision_offload.json (one entry per model, merged with what is there).

Every plan is the fit search's (mixed-precision state: fp32 master weights and Adam moments, 16 bytes per
parameter; micro-batches 1, 2, 4, 8; 60 s per micro-batch count) at the 80 GiB budget and at a tight one,
with neither choice, FP8 only, offload only (optimizer, parameters, activations), and both.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from shardplan.cost import build_tables
from shardplan.errors import ShardplanError
from shardplan.fit import FitOptions, solve_fit
from shardplan.machine import preset
from shardplan.models import get_model, model_spec
from shardplan.planner import from_spmd
from shardplan.report.summary import recipe_words

ROWS = {"gpt3-13b": 24.0, "llama3-8b": 16.0}  # model -> the tight budget (GiB)
CHOICES = {"none": {}, "fp8": {"fp8": True}, "offload": {"offload": ("optimizer", "parameters", "activations")},
           "fp8+offload": {"fp8": True, "offload": ("optimizer", "parameters", "activations")}}
OUT = Path(__file__).parent / "results" / "precision_offload.json"


def run(name: str, tight: float) -> dict:
    g = get_model(name)
    m = preset("h100", 8)
    tables = replace(build_tables(g, replace(m, memory_bytes=None), cutoff=1), machine=m)
    rows = []
    for gib in (80.0, tight):
        for label, extra in CHOICES.items():
            opts = FitOptions(micro_batches=(1, 2, 4, 8), master_weights=True, time_limit=60.0, **extra)
            t0 = time.perf_counter()
            try:
                p = solve_fit(g, m, budget=gib * 2**30, tables=tables, options=opts)
            except ShardplanError as e:
                rows.append({"budget_gib": gib, "choices": label, "error": str(e)})
                continue
            bd = p.memory_choices.breakdown(tables, p.assignment)
            rows.append({"budget_gib": gib, "choices": label, "step_seconds": p.cost,
                         "peak_bytes": p.memory["peak_bytes"], "host_bytes": p.memory.get("host_bytes", 0.0),
                         "optimal": bool(p.solution.optimal), "solve_seconds": time.perf_counter() - t0,
                         "offload_seconds": bd.get("offload", 0.0), "fp8_scaling_seconds": bd.get("fp8_scaling", 0.0),
                         "compute_seconds": bd["compute"], "recompute_seconds": bd["recompute"],
                         "plan": recipe_words(from_spmd(p))})
            print(json.dumps(rows[-1]), flush=True)
    return {"model": name, "batch": model_spec(name).batch, "machine": "h100 x 8", "rows": rows}


def main(argv: list[str]) -> None:
    names = argv or list(ROWS)
    out = json.loads(OUT.read_text()) if OUT.exists() else {}
    for name in names:
        out[name] = run(name, ROWS[name])
        OUT.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
