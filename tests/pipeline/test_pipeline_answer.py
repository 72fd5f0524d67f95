"""The Plan of a pipeline answer (shardplan.planner.from_pipeline): a stage whose cost carries a shared solve of an
identical segment elsewhere takes that solve's choices renamed by position, with no solve, and they are exactly
the choices a solve of the stage itself gives."""

from __future__ import annotations

import pytest

import shardplan.planner as planner
from shardplan import preset
from shardplan.models import get_model
from shardplan.pipeline.api import pipeline_solve


def _build(b):
    return get_model("gpt", b, layers=8, d_model=64, heads=4, seq=16, vocab=256)


@pytest.mark.parametrize("memory_choices", [False, True])
def test_shared_stage_choices_are_the_solved_ones(memory_choices, monkeypatch):
    res = pipeline_solve(_build, 32, preset("h100", 32), micro_batches=(4,), uniform=True,
                         memory_choices=memory_choices, schedules=("zb-h1",), cutoff=1)
    stages = res.plan.stages
    renamed = [j for j, st in enumerate(stages)
               if {op.name for op in st.cost.detail.graph.operators}
               != {op.name for op in res.stages.subgraph(st.first, st.end, res.plan.micro_batches).operators}]
    assert renamed  # some stage shares the solve of another position
    solves = []
    solve_stage = type(res.stages).solve_stage
    monkeypatch.setattr(type(res.stages), "solve_stage", lambda self, *a: solves.append(a) or solve_stage(self, *a))
    shared = planner.from_pipeline(res)
    assert solves == []  # no stage solved again
    monkeypatch.setattr(planner, "_shared_stage_choices", lambda result, index: None)
    solved = planner.from_pipeline(res)
    assert len(solves) == len(renamed)  # the path before: each renamed stage solved on its own
    assert shared.stages == solved.stages
    assert {k: v for k, v in shared.stats.items() if k != "solve_seconds"} == \
        {k: v for k, v in solved.stats.items() if k != "solve_seconds"}
