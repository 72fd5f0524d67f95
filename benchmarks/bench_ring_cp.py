"""Context parallelism's two algorithms on the published long-context recipes: all-gather (Llama 3's) against
the ring (``cp_algo=ring``), costed by the same model, with and without a causal mask on the attention core.

Usage: python benchmarks/bench_ring_cp.py
Writes benchmarks/results/ring_cp.json.

* Llama 3 405B at 128K tokens on 16,384 H100: tensor 8 × context 16 × pipeline 16 × data 8 (Dubey et al. 2024,
  Table 4: batch size per data-parallel group 16, 16M tokens per step: 128 sequences, micro-batch 1; §3.3.2: one
  block fewer on the first and the last stage, 126 = 7 + 14 × 8 + 7), with full recomputation (the paper states
  none; without recomputation FlashAttention's core, the zoo's Llama default, needs 252 GiB per device and
  ``selective`` 248 GiB under this model, the unfused core 4,092 GiB);
* Llama 3 70B on 64 H100: NVIDIA's recipe, tensor 4 × pipeline 4 × context 2 with 5 interleaved chunks per
  stage, micro-batch 1, global batch 64, full recomputation, sequence 8192.

The search with the choice (``build_tables(context="auto")``, the DP) against the search without it (all-gather
only), on one Llama 3 8B block on 16 H100 (two nodes) at 2K, 32K and 128K tokens: the optimum, the layout of
the attention scores, and how many edges take the ring at the optimum.

``causal``: the attention core under a balanced causal mask (:func:`shardplan.recipe.causal_attention`). Each row
records the step time, the peak memory per device, the breakdown, and the CPU and wall seconds of the costing.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from shardplan.machine import preset
from shardplan.models import get_model
from shardplan.recipe import causal_attention, cost_recipe
from shardplan.report.summary import recipe_words

OUT = Path(__file__).parent / "results" / "ring_cp.json"

ROWS: dict[str, dict[str, Any]] = {
    "llama3-405b-128k-p16384": {
        "model": "llama3-405b", "p": 16384, "sizes": {"seq": 131072}, "batch": 128,
        "recipe": "tp=8,cp=16,pp=16,mbs=1,gbs=128,first_stage_layers=7,last_stage_layers=7,recompute=full"},
    "llama3-70b-p64": {
        "model": "llama3-70b", "p": 64, "sizes": {}, "batch": 64,
        "recipe": "tp=4,pp=4,cp=2,vp=5,mbs=1,gbs=64,recompute=full"},
}


def one(row: dict[str, Any], algo: str, causal: bool) -> dict[str, Any]:
    def build(batch: int):
        g = get_model(row["model"], batch, **row["sizes"])
        return causal_attention(g) if causal else g

    text = row["recipe"] + (",cp_algo=ring" if algo == "ring" else "")
    cpu, wall = time.process_time(), time.perf_counter()
    plan = cost_recipe(build, preset("h100", row["p"]), text, batch=row["batch"])
    return {"recipe": text, "cp_algo": algo, "causal": causal, "words": recipe_words(plan),
            "step_seconds": plan.step_time,
            "peak_gib": plan.memory["peak_bytes"] / 2**30, "breakdown": dict(plan.breakdown),
            "cpu_seconds": time.process_time() - cpu, "wall_seconds": time.perf_counter() - wall}


SEARCH = [(2048, 8), (32768, 1), (131072, 1)]  # (sequence, batch) of one Llama 3 8B block on 16 H100


def search(seq: int, batch: int) -> dict[str, Any]:
    from shardplan.cost import build_tables
    from shardplan.cost.ring import ring_choices
    from shardplan.search import solve_dp

    g = causal_attention(get_model("llama3-8b", batch, layers=1, seq=seq))
    m = preset("h100", 16)
    row: dict[str, Any] = {"seq": seq, "batch": batch}
    tables = {}
    for context in ("allgather", "auto"):
        cpu = time.process_time()
        t = build_tables(g, m, cutoff=1, orders="row-major", context=context)
        sol = solve_dp(t.to_problem())
        tables[context] = (t, sol)
        scores = next(i for i, op in enumerate(g.operators)  # the scores, or FlashAttention's one core operator
                      if op.name.endswith(("/scores", "/attention")))
        row[context] = {"step_seconds": sol.cost, "cpu_seconds": time.process_time() - cpu,
                        "scores_layout": t.layouts[scores][sol.assignment[scores]].describe()}
    t, sol = tables["auto"]
    used = 0
    for e, mat in zip(g.edges, t.edge_costs):  # the edges whose cost at the optimum is the ring's
        i, j = sol.assignment[e.src], sol.assignment[e.dst]
        ring = ring_choices(g.operators[e.src], t.arrays[e.src].take([i]), g.operators[e.dst], e.slot,
                            t.arrays[e.dst].take([j]), m, t.op_costs[e.dst].compute[[j]])[0, 0]
        used += int(np.isfinite(ring) and mat[i, j] == ring)
    row["auto"]["ring_edges"] = used
    return row


def main() -> None:
    out: dict[str, Any] = {"machine": "h100 preset", "load_average": os.getloadavg(), "rows": {}, "search": []}
    for seq, batch in SEARCH:
        row = search(seq, batch)
        out["search"].append(row)
        print(f"search llama3-8b block seq {seq:6d} batch {batch}: all-gather {row['allgather']['step_seconds']:.5f} s "
              f"{row['allgather']['scores_layout']}, with the ring {row['auto']['step_seconds']:.5f} s "
              f"{row['auto']['scores_layout']} ({row['auto']['ring_edges']} edges on the ring)")
    for name, row in ROWS.items():
        out["rows"][name] = [one(row, algo, causal) for causal in (False, True) for algo in ("allgather", "ring")]
        for r in out["rows"][name]:
            print(f"{name:26s} {r['cp_algo']:>9s} causal={r['causal']!s:5s} {r['step_seconds']:8.3f} s "
                  f"{r['peak_gib']:7.1f} GiB  (cpu {r['cpu_seconds']:.1f} s)")
    OUT.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
