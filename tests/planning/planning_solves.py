"""Searches that more than one planning test file runs on the same problem, each run once per test process.

``test_planner.py`` and ``test_planner_seeds.py`` both compare with the pipeline search of GPT (4 blocks, batch 16)
on 16 A100 with slow links across nodes, and both with ``plan()`` of GPT (4 blocks, batch 32) on 16 A100: the
same call with the same arguments, deterministic, so one answer serves both (docs/testing.md, "Fifth round").
The answers are shared: a caller reads them and never hands their ``stages`` on (``model=``) to another search.
Imported by its bare name (tests/conftest.py puts this folder on ``sys.path``), so every file sees one cache.
"""

from __future__ import annotations

import functools
from dataclasses import replace

from shardplan.machine import Machine, preset
from shardplan.models import get_model

# the pipeline search's options in both files: two micro-batch counts, memory choices, both schedules
MICRO_BATCHES = (4, 8)
PIPELINE_KW = dict(micro_batches=MICRO_BATCHES, memory_choices=True, cutoff=1, schedules=("1f1b", "zb-h1"))


def gpt(b: int):
    """GPT with 4 blocks (the model's other sizes its defaults) at batch ``b``."""
    return get_model("gpt", b, layers=4)


def slow_links() -> Machine:
    """16 A100 (two nodes) with links across nodes slow enough that a pipeline beats one program; without tile
    quantisation (with it, a pipeline's micro-batches of one or two sequences per device fill the
    multiprocessors' waves worse than one program on one node does, and at this size the pipeline loses)."""
    return replace(preset("a100", 16), inter_bandwidth=1e9, sm_count=None, gemm_tiles=None)


@functools.cache
def gpt4_pipeline_on_slow_links():
    """``pipeline_solve(gpt, 16, slow_links(), **PIPELINE_KW)``: the pipeline search alone, without seeds."""
    from shardplan.pipeline.api import pipeline_solve

    return pipeline_solve(gpt, 16, slow_links(), **PIPELINE_KW)


@functools.cache
def gpt4_plan_on_a100_16():
    """``plan("gpt", preset("a100", 16), sizes={"layers": 4}, batch=32)``: uninterrupted, stages searched."""
    from shardplan.planner import plan

    return plan("gpt", preset("a100", 16), sizes={"layers": 4}, batch=32)
