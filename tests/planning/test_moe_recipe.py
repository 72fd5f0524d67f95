"""Expert parallelism in recipes: ``ep=N`` is the expert-split layouts exactly, refused where there are no experts,
and never better than the search's optimum in the same space."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shardplan.cost import build_tables
from shardplan.errors import ShardplanError
from shardplan.fit import plan_with_choices
from shardplan.layout import Layout
from shardplan.machine import preset
from shardplan.models import get_model
from shardplan.recipe import cost_recipe, expert_dim, has_experts, megatron_layouts
from shardplan.spmd import plan_from_configs, solve_tables

BATCH = 32
EXPERT_OPS = ("L1/moe/expert_in", "L1/moe/expert_act", "L1/moe/expert_down")


def _tables(machine, name="mixtral-tiny"):
    g = get_model(name, BATCH)
    t = build_tables(g, replace(machine, memory_bytes=None), cutoff=1, orders="all", node_replicas=True)
    return replace(t, machine=machine)


def _lay(op, levels, per_level):
    names = op.dim_names
    return Layout(names, levels, tuple(tuple(per_level[lv].get(d, 1) for d in names) for lv in range(len(levels))),
                  tuple(tuple(names.index(d) for d in per_level[lv] if per_level[lv][d] > 1)
                        for lv in range(len(levels))))


def test_ep_splits_the_experts_inside_the_data_parallel_group():
    machine = preset("h100", 16)  # 2 nodes of 8
    assert machine.levels == (8, 2)
    got = cost_recipe("mixtral-tiny", machine, "ep=8", batch=BATCH)
    g = get_model("mixtral-tiny", BATCH)
    # dp = 16: the experts over the 8 devices of a node (one expert each) and the batch in halves across the two
    # nodes; every other operator (router, gate, dispatch, combine included) over the batch
    for op in g:
        want = (_lay(op, (8, 2), [{"e": 8}, {"b": 2}]) if op.kind == "expert"
                else _lay(op, (8, 2), [{"b": 8}, {"b": 2}]))
        assert got.operators[op.name].layout == want, op.name
    # the step is the one-program plan of those layouts with one micro-batch (gbs = dp), costed by hand
    tables = _tables(machine)
    hand = plan_with_choices(plan_from_configs(tables, {op.name: got.operators[op.name].layout for op in g}),
                             stage=0, recompute=[], micro_batches=1)
    assert got.step_time == pytest.approx(hand.cost, rel=1e-12)
    # what moves between operators is the two all-to-alls per routed layer, inside each node
    assert got.breakdown["redistribution"] > 0
    moving = {(g.operators[e.src].name, g.operators[e.dst].name) for k, e in enumerate(g.edges)
              if hand.tables.edge_costs[k][hand.assignment[e.src], hand.assignment[e.dst]] > 0}
    assert moving == {(f"L{i}/moe/dispatch", f"L{i}/moe/expert_in") for i in (1, 2)} | \
        {(f"L{i}/moe/expert_down", f"L{i}/moe/combine") for i in (1, 2)}


def test_ep_with_tensor_parallelism_splits_the_experts_hidden_width():
    machine = preset("h100", 16)
    got = cost_recipe("mixtral-tiny", machine, "tp=2,ep=4", batch=BATCH)
    # per level: tp (2, 1); dp (4, 2); ep (4, 1) from the inside of dp, the batch the rest (1, 2)
    for name in EXPERT_OPS:
        lay = got.operators[name].layout
        names = lay.dims
        assert lay.splits[0][names.index("e")] == 4 and lay.splits[0][names.index("f")] == 2, name
        assert lay.splits[1][names.index("b")] == 2 and lay.split[names.index("b")] == 2, name
        assert lay.orders[0] == (names.index("f"), names.index("e")), name  # tensor rank most significant
    assert got.operators["L1/q"].layout.split[got.operators["L1/q"].layout.dims.index("h")] == 2
    r = got.operators["L1/moe/router"].layout
    assert r.split[r.dims.index("b")] == 8 and r.copies == 2  # the router replicated over the tensor pair


def test_ep_matches_megatron_layouts_and_is_in_the_search_space():
    machine = preset("h100", 16)
    tables = _tables(machine)
    lays = megatron_layouts(tables, 16, 1, ep=8)  # raises when a layout is not a candidate of the full tables
    assert all(lays[op.name] in tables.layouts[i] for i, op in enumerate(tables.graph.operators))
    assert {op.name for op in tables.graph if expert_dim(op)} == {f"L{i}/moe/{n}" for i in (1, 2)
                                                                  for n in ("expert_in", "expert_act", "expert_down")}
    # the exact search over the same space is never worse than the recipe
    best = solve_tables(tables)
    recipe = plan_from_configs(tables, lays)
    assert best.cost <= recipe.cost * (1 + 1e-9)


def test_the_search_beats_or_equals_ep_recipes():
    machine = preset("h100", 16)
    tables = _tables(machine)
    best = solve_tables(tables).cost
    for text in ("ep=2", "ep=8", "ep=4,tp=2", "tp=2"):
        got = cost_recipe("mixtral-tiny", machine, text, batch=BATCH)
        assert best <= got.step_time * (1 + 1e-9), text


@pytest.mark.parametrize("model, text, part", [
    ("llama3-tiny", "ep=2", "has no experts"),
    ("mixtral-tiny", "ep=3", "does not divide the data-parallel degree dp=16"),
    ("mixtral-tiny", "tp=2,ep=16", "does not divide the data-parallel degree dp=8"),
    ("mixtral-tiny", "ep=16", "cannot split e=8 16 ways"),
])
def test_ep_refusals_are_one_line(model, text, part):
    machine = preset("h100", 16)
    with pytest.raises(ShardplanError, match=part) as e:
        cost_recipe(model, machine, text, batch=BATCH)
    assert "\n" not in str(e.value)
    assert has_experts(get_model(model, 2)) == (model != "llama3-tiny")


def test_ep_on_a_pipeline():
    machine = preset("h100", 16)
    got = cost_recipe("mixtral-tiny", machine, "pp=2,ep=4,mbs=1", batch=BATCH)
    assert got.num_stages == 2
    for st in got.stages:
        for name, c in st.operators.items():
            if c.kind == "expert":
                lay = c.layout
                assert lay.split[lay.dims.index("e")] == 4 and lay.split[lay.dims.index("b")] == 2, name


def test_deepseek_v3_on_1024_h100_with_pipeline_4_and_expert_64():
    machine = preset("h100", 1024)  # 128 nodes of 8
    got = cost_recipe("deepseek-v3", machine, "pp=4,ep=64,zero=1,first_stage_layers=13,recompute=full")
    assert got.num_stages == 4 and got.micro_batches == 15360 // 256
    assert got.memory["peak_bytes"] <= machine.memory_bytes
    st = got.stages[1]  # blocks 14..29 on devices 256..511: levels (8, 32), dp = 256 = (8, 32) per level
    lay = st.operators["L20/moe/expert_in"].layout
    names = lay.dims
    # ep = 64 from the inside of the data shares: 8 in the node and 8 nodes; the batch 4 ways across the nodes
    assert lay.levels == (8, 32)
    assert [r[names.index("e")] for r in lay.splits] == [8, 8] and [r[names.index("b")] for r in lay.splits] == [1, 4]
    disp = st.operators["L20/moe/dispatch"].layout
    assert disp.split[disp.dims.index("b")] == 256
    # the all-to-all into the experts, by hand: a device holds 1 of the micro-batch's 256 sequences and needs its 4
    # experts' slots of its expert group's 64 sequences, [64, 4, 160, 7168] in 2-byte elements; its node holds 8
    # of those 64 sequences, the other 56 cross the NIC (50 GB/s, 8 us); forward and backward alike
    need = 64 * 4 * 160 * 7168 * 2
    across = need * 56 // 64
    (bw, lat) = machine.level_links[1]
    assert st.operators["L20/moe/expert_in"].redistribution_seconds == pytest.approx(2 * (across / bw + lat),
                                                                                     rel=1e-12)


def test_recipe_words_name_the_expert_and_sequence_parallel_degrees():
    from shardplan.report.summary import recipe_words

    m = preset("h100", 16)
    words = recipe_words(cost_recipe("mixtral-tiny", m, "tp=2,ep=4"))
    assert words.startswith("data 8 × tensor 2 × expert 4,"), words
    words = recipe_words(cost_recipe("mixtral-tiny", m, "tp=2"))
    assert words.startswith("data 8 × tensor 2,") and "expert" not in words, words
    words = recipe_words(cost_recipe("gpt3-350m", m, "tp=8,sp=true", batch=16))
    assert words.startswith("data 2 × tensor 8, deferred reductions (sequence parallel) on "), words
    assert "deferred" not in recipe_words(cost_recipe("gpt3-350m", m, "tp=8", batch=16))
