"""The published-configurations benchmark's case table (benchmarks/bench_published_configs.py): every recipe is
one the grammar reads and shardplan can express on its machine, its degrees multiply to the GPU count, its
batch splits into whole micro-batches, and the stated batch and sequence are the ones the case builds."""

from __future__ import annotations

from benchmarks.bench_published_configs import CASES
from shardplan.machine import preset
from shardplan.models import model_spec
from shardplan.recipe import Recipe, refusal


def test_cases_are_the_four_published_configurations():
    assert [c.name for c in CASES] == ["llama3-405b-8k-8192", "llama3-405b-128k-16384", "llama3-70b-64",
                                       "deepseek-v3-1024"]
    assert [(c.model, c.devices, c.batch, c.seq) for c in CASES] == [
        ("llama3-405b", 8192, 2048, 8192), ("llama3-405b", 16384, 128, 131072), ("llama3-70b", 64, 128, 8192),
        ("deepseek-v3", 1024, 15360, 4096)]
    # 16M tokens per step at both of Llama 3 405B's sequence lengths
    assert CASES[0].batch * CASES[0].seq == CASES[1].batch * CASES[1].seq == 16 * 2**20


def test_every_recipe_parses_is_expressible_and_splits_its_gpus_and_batch():
    degrees = {}
    for c in CASES:
        rec = Recipe.parse(c.recipe)
        assert str(Recipe.parse(str(rec))) == str(rec)
        assert refusal(rec, preset("h100", c.devices)) is None, c.name
        assert rec.gbs in (None, c.batch), c.name
        mp = rec.tp * rec.cp * rec.pp
        assert c.devices % mp == 0, c.name
        dp = c.devices // mp
        assert c.batch % (dp * rec.mbs) == 0, c.name  # whole micro-batches per step
        if rec.ep > 1:
            assert dp % rec.ep == 0, c.name
        assert c.source, c.name
        # the stated sequence is what the case builds: the zoo's size, or the override the case passes
        assert dict(c.sizes).get("seq", model_spec(c.model).sizes["seq"]) == c.seq, c.name
        # the recipes keep the search's element size and options: nothing the default search does not offer
        assert rec.precision is None and rec.runtime == "shardplan" and not rec.sp and rec.overlap is None, c.name
        degrees[c.name] = (rec.tp, rec.cp, rec.pp, dp, rec.vp, rec.ep)
    assert degrees == {"llama3-405b-8k-8192": (8, 1, 16, 64, 1, 1), "llama3-405b-128k-16384": (8, 16, 16, 8, 1, 1),
                       "llama3-70b-64": (4, 2, 4, 2, 5, 1), "deepseek-v3-1024": (1, 1, 4, 256, 1, 64)}
