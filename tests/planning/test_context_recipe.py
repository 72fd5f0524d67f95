"""Context parallelism as a recipe (``cp``): Llama 3's all-gather context parallelism mapped to layouts of the
search's space, costed by the same model, and named in the plan's words."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from shardplan.errors import ShardplanError
from shardplan.machine import preset
from shardplan.recipe import cost_recipe, sequence_dim
from shardplan.models import get_model
from shardplan.report.summary import recipe_words, recipe_words_stage

SIZES = {"layers": 2, "seq": 4096}


def _cost(text: str, p: int = 32, seq: int | None = None, **machine):
    return cost_recipe("llama3-8b", dataclasses.replace(preset("h100", p), **machine), text, batch=8,
                       sizes=SIZES if seq is None else {**SIZES, "seq": seq})


def test_every_operator_splits_its_sequence_and_attention_gathers_the_keys():
    plan = _cost("tp=8,cp=2")
    ops = plan.operators
    for name, c in ops.items():
        split = dict(zip(c.layout.dims, c.layout.split))
        if name.endswith("/attention"):  # the FlashAttention core (scores and context unfused)
            assert split["s"] == 2 and split["t"] == 1  # queries split, keys and values whole: gathered
        elif "t" in split:
            assert split["t"] == 2  # the key/value projections compute their part of the sequence
        elif "s" in split:
            assert split["s"] == 2
    # the all-gather of keys and values is the only redistribution, and only with cp
    assert plan.breakdown["redistribution"] > 0 and _cost("tp=8").breakdown["redistribution"] == 0
    assert recipe_words(plan).startswith("data 2 × context 2 × tensor 8,")


def test_context_parallelism_trades_activation_memory_for_collectives():
    """With one all-reduce among the data x context group (Megatron's data-parallel group with context), more
    context parallelism is the same compute and more communication. Reduced as XLA compiles it (one
    all-reduce of the whole gradient per split dim), data 2 x context 2 synchronises the weights twice where
    data 4 and context 4 do it once each: its weight sync is the dearest of the three."""
    one = {"reduce_per_dim": False}
    base, cp2, cp4 = _cost("tp=8", **one), _cost("tp=8,cp=2", **one), _cost("tp=8,cp=4", **one)
    assert base.memory["peak_bytes"] > cp2.memory["peak_bytes"] > cp4.memory["peak_bytes"]
    assert base.step_time < cp2.step_time < cp4.step_time  # same compute, more communication
    xla = [_cost(t).breakdown["weight_sync"] for t in ("tp=8", "tp=8,cp=2", "tp=8,cp=4")]
    assert xla[0] == base.breakdown["weight_sync"] and xla[2] == cp4.breakdown["weight_sync"]
    assert xla[1] > max(xla[0], xla[2], cp2.breakdown["weight_sync"])


def test_with_pipeline_stages_and_interleaving():
    plan = _cost("tp=8,cp=2,pp=2")
    assert recipe_words(plan).startswith("data 1 × context 2 × tensor 8 × pipeline 2 (1f1b)")
    # each stage's column of the report names the same degrees as the plan's line
    assert [recipe_words_stage(s) for s in plan.stages] == ["data 1 × context 2 × tensor 8"] * 2


def test_sequence_dim():
    g = get_model("llama3-tiny", 2)
    assert sequence_dim(g["L1/attention"]) == "s" and sequence_dim(g["L1/k"]) == "t"
    assert sequence_dim(g["embed"]) == "s"


@pytest.mark.parametrize("text, part", [("tp=8,cp=3", "does not divide"), ("tp=8,cp=2,dp=4", "not the 32 devices"),
                                        ("tp=8,cp=2,ep=2", "context and expert")])
def test_bad_context_degrees_are_one_line(text, part):
    with pytest.raises(ShardplanError, match=part) as e:
        _cost(text)
    assert "\n" not in str(e.value)


def test_llama3_70b_published_recipe_is_costed():
    """NVIDIA's Llama 3 70B recipe: tensor 4 x pipeline 4 x context 2 with 5 chunks per stage, on 64 H100."""
    plan = cost_recipe("llama3-70b", preset("h100", 64), "tp=4,pp=4,cp=2,vp=5,mbs=1,gbs=64,recompute=full")
    assert recipe_words(plan).startswith("data 2 × context 2 × tensor 4 × pipeline 4 × 5 chunks (interleaved)")
    assert plan.memory["peak_bytes"] < 80 * 2**30


# -- the ring (cp_algo=ring) -----------------------------------------------------------------------------------
def test_cp_algo_parses_prints_and_refuses_without_a_context_group():
    from shardplan.recipe import Recipe

    r = Recipe.parse("tp=8,cp=2,cp_algo=ring")
    assert r.cp_algo == "ring" and str(r) == "tp=8,cp=2,cp_algo=ring" and Recipe.parse(str(r)) == r
    assert str(Recipe.parse("tp=8,cp=2,cp_algo=all-gather")) == "tp=8,cp=2"  # the default
    assert Recipe.from_mapping({"context_algorithm": "ring", "cp": 2}).cp_algo == "ring"
    with pytest.raises(ShardplanError, match="cp_algo must be one of allgather, ring"):
        Recipe.parse("tp=8,cp=2,cp_algo=p2p")
    with pytest.raises(ShardplanError, match="needs a context group"):
        _cost("tp=8,cp_algo=ring")


@pytest.mark.parametrize("pp", [1, 2])
def test_the_ring_recipe_has_the_same_layouts_and_compute_and_moves_the_keys_around_the_ring(pp):
    """cp_algo=ring changes no layout and no compute: the keys' and values' gathers and their gradients'
    all-reduces become the ring's exposed steps. With the sequence long enough for the products to hide
    the blocks (8192 over 2: FlashAttention's core has no memory-bound softmax to hide them behind, and at
    4096 the ring loses with pp=2), the ring is cheaper here; each attention product's edge charges exactly
    what :func:`shardplan.cost.ring.ring_choices` says for its two layouts."""
    gather, ring = _cost(f"tp=8,cp=2,pp={pp}", seq=8192), _cost(f"tp=8,cp=2,cp_algo=ring,pp={pp}", seq=8192)
    assert ring.step_time < gather.step_time
    for name, c in gather.operators.items():
        assert ring.operators[name].layout == c.layout
    if pp == 1:
        assert ring.breakdown["compute"] == gather.breakdown["compute"]
        assert ring.breakdown["grad_allreduce"] < gather.breakdown["grad_allreduce"]


def test_the_ring_recipe_edges_are_the_ring_by_hand():
    """The edge rope_k -> attention of the recipe's tables: the ring's cost from the two layouts."""
    from dataclasses import replace

    from shardplan.cost import build_tables
    from shardplan.cost.ring import ring_choices
    from shardplan.recipe import megatron_layouts, table_options

    m = preset("h100", 32)
    g = get_model("llama3-8b", 8, **{**SIZES, "layers": 1})
    t = build_tables(g, m, **table_options(m, 8, 4, cp=2, cp_algo="ring"))
    plan = megatron_layouts(t, 4, 8, cp=2)
    (e, mat), = [(e, mat) for e, mat in zip(g.edges, t.edge_costs)
                 if g.operators[e.src].name == "L1/rope_k" and g.operators[e.dst].name == "L1/attention"]
    i, j = (t.layouts[x].index(plan[g.operators[x].name]) for x in (e.src, e.dst))
    want = ring_choices(g.operators[e.src], t.arrays[e.src].take([i]), g.operators[e.dst], e.slot,
                        t.arrays[e.dst].take([j]), m, t.op_costs[e.dst].compute[[j]])[0, 0]
    assert np.isfinite(want) and mat[i, j] == want


def test_causal_attention_marks_the_core_and_the_ring_recipe_runs_on_the_70b():
    from shardplan.recipe import causal_attention

    g = causal_attention(get_model("llama3-tiny", 2))
    masked = {op.name for op in g.operators if op.causal is not None}
    assert masked == {op.name for op in g.operators if op.kind == "attn_flash"} and masked
    text = "tp=4,pp=4,cp=2,vp=5,mbs=1,gbs=64,recompute=full"
    gather = cost_recipe("llama3-70b", preset("h100", 64), text)
    ring = cost_recipe("llama3-70b", preset("h100", 64), text + ",cp_algo=ring")
    assert recipe_words(ring).startswith("data 2 × context 2 × tensor 4 × pipeline 4 × 5 chunks (interleaved)")
    assert ring.memory["peak_bytes"] == gather.memory["peak_bytes"]
    assert ring.step_time < gather.step_time
