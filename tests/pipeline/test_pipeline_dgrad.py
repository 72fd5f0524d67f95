"""Pipelines on a machine that hides each product's input-gradient collective behind its weight-gradient pass
(``Machine.overlap_dgrad``): ZB-H1 defers that pass, so it is not offered (the stage tables would be optimistic)."""

from __future__ import annotations

import dataclasses

import pytest

from shardplan.errors import ShardplanError
from shardplan.machine import Machine, preset
from shardplan.models import get_model
from shardplan.pipeline.api import pipeline_solve, schedules_for


def test_zb_h1_is_left_out_only_with_the_overlap():
    plain = Machine(4, name="m")
    hidden = dataclasses.replace(plain, overlap_dgrad=True)
    assert schedules_for(plain, ("1f1b", "zb-h1")) == ("1f1b", "zb-h1")
    assert schedules_for(hidden, ("1f1b", "zb-h1", "interleaved")) == ("1f1b", "interleaved")
    with pytest.raises(ShardplanError, match="zb-h1"):
        schedules_for(hidden, ("zb-h1",))


def test_a_pipeline_search_with_the_overlap_never_answers_zb_h1():
    def build(b):
        return get_model("gpt", b, layers=4, d_model=64, heads=2, seq=16, vocab=256, kernels="megatron")

    machine = dataclasses.replace(preset("a100", 8), overlap_dgrad=True)
    got = pipeline_solve(build, 8, machine, micro_batches=(2, 4), schedules=("1f1b", "zb-h1"), cutoff=1)
    assert got is not None and got.plan.schedule != "zb-h1"
    with pytest.raises(ShardplanError, match="zb-h1"):
        pipeline_solve(build, 8, machine, micro_batches=(2,), schedules=("zb-h1",), cutoff=1)
