"""The published configurations' parallel structures are plans of the search's space, and the exact optimum over
that space is never slower than them under the same cost model.

One program of each structure at a small size on H100 nodes of 8, in the full tables the search solves
(every layout, every device order, the node replicas): Llama 3's tensor × context (all-gather) × data (NVIDIA's
70B recipe: tp 4 × cp 2; Llama 3 405B at 128K: tp 8 × cp 16), here tp 2 × cp 2 × data 2 on 8 and tp 2 × cp 4 ×
data 2 on 16; DeepSeek-V3's expert parallelism inside the data-parallel group (ep 64 of data 256), here ep 8 of
data 16 with deepseek-tiny. Each recipe layout is a candidate of the tables (``megatron_layouts`` raises
otherwise) and the DP's optimum costs at most the recipe's plan in those tables. (Pipelines: the recipe as the
search's incumbent, tests/planning/test_recipe_incumbent.py; the full-size rows,
benchmarks/results/published_configs.json.)
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from shardplan.cost import build_tables
from shardplan.machine import preset
from shardplan.models import get_model
from shardplan.recipe import megatron_layouts
from shardplan.spmd import plan_from_configs, solve_tables

CASES = {  # name: (model, devices, batch, sizes, dp (with the context group), tp, cp, ep)
    "tp2-cp2-dp2": ("llama3-tiny", 8, 8, {"layers": 1}, 4, 2, 2, 1),
    "tp2-cp4-dp2": ("llama3-tiny", 16, 8, {"layers": 1}, 8, 2, 4, 1),
    "ep8-dp16": ("deepseek-tiny", 16, 16, {"layers": 2}, 16, 1, 1, 8),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_recipe_is_a_plan_of_the_space_and_the_optimum_is_never_slower(name):
    model, p, batch, sizes, dp, tp, cp, ep = CASES[name]
    g = get_model(model, batch, **sizes)
    m = preset("h100", p)
    t = build_tables(g, replace(m, memory_bytes=None), cutoff=1, orders="all", node_replicas=True)
    lays = megatron_layouts(t, dp, tp, ep=ep, cp=cp)
    assert all(lays[op.name] in t.layouts[i] for i, op in enumerate(g.operators))
    split = {d for lay in lays.values() for d, s in zip(lay.dims, lay.split) if s > 1}
    if cp > 1:  # the recipe splits the sequence, the attention's queries among it
        assert "s" in split
    if ep > 1:
        assert "e" in split
    recipe = plan_from_configs(t, lays)
    best = solve_tables(t)
    assert best.cost <= recipe.cost * (1 + 1e-12)
    problem = t.to_problem()  # both costed by the one objective of the tables
    assert problem.evaluate(recipe.assignment) == pytest.approx(recipe.cost, rel=1e-12)
    assert problem.evaluate(best.assignment) == pytest.approx(best.cost, rel=1e-12)
