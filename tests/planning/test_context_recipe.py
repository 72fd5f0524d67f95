"""Context parallelism as a recipe (``cp``): Llama 3's all-gather context parallelism mapped to layouts of the
search's space, costed by the same model, and named in the plan's words."""

from __future__ import annotations

import pytest

from shardplan.errors import ShardplanError
from shardplan.machine import preset
from shardplan.recipe import cost_recipe, sequence_dim
from shardplan.models import get_model
from shardplan.report.summary import recipe_words

SIZES = {"layers": 2, "seq": 4096}


def _cost(text: str, p: int = 32):
    return cost_recipe("llama3-8b", preset("h100", p), text, batch=8, sizes=SIZES)


def test_every_operator_splits_its_sequence_and_attention_gathers_the_keys():
    plan = _cost("tp=8,cp=2")
    ops = plan.operators
    for name, c in ops.items():
        split = dict(zip(c.layout.dims, c.layout.split))
        if name.endswith("/scores") or name.endswith("/context"):
            assert split["s"] == 2 and split["t"] == 1  # queries split, keys and values whole: gathered
        elif "t" in split:
            assert split["t"] == 2  # the key/value projections compute their part of the sequence
        elif "s" in split:
            assert split["s"] == 2
    # the all-gather of keys and values is the only redistribution, and only with cp
    assert plan.breakdown["redistribution"] > 0 and _cost("tp=8").breakdown["redistribution"] == 0
    assert recipe_words(plan).startswith("data 2 × context 2 × tensor 8,")


def test_context_parallelism_trades_activation_memory_for_collectives():
    base, cp2, cp4 = _cost("tp=8"), _cost("tp=8,cp=2"), _cost("tp=8,cp=4")
    assert base.memory["peak_bytes"] > cp2.memory["peak_bytes"] > cp4.memory["peak_bytes"]
    assert base.step_time < cp2.step_time < cp4.step_time  # same compute, more communication


def test_with_pipeline_stages_and_interleaving():
    plan = _cost("tp=8,cp=2,pp=2")
    assert recipe_words(plan).startswith("data 1 × context 2 × tensor 8 × pipeline 2 (1f1b)")


def test_sequence_dim():
    g = get_model("llama3-tiny", 2)
    assert sequence_dim(g["L1/scores"]) == "s" and sequence_dim(g["L1/k"]) == "t"
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
