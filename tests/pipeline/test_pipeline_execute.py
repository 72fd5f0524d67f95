"""The engine-neutral parts of running a pipeline plan: node placement and the issue order."""

from __future__ import annotations

import pytest

from shardplan.errors import ShardplanError
from shardplan.pipeline.execute import assign_nodes, issue_order, stage_specs
from shardplan.pipeline.schedule import _order
from shardplan.pipeline.search import PipelinePlan, Stage, StageCost


def _plan(n: int, m: int, schedule: str = "1f1b", v: int = 1) -> PipelinePlan:
    groups = n // v
    cost = StageCost(1.0, 2.0, 0.0, 0.0)
    stages = tuple(Stage(j, j + 1, j % groups, 1, cost, 1.0) for j in range(n))
    return PipelinePlan(stages, m, schedule, v, (0.0,) * (n - 1), 0.0, None)


@pytest.mark.parametrize("n,m,schedule,v", [(4, 8, "1f1b", 1), (3, 2, "1f1b", 1), (4, 4, "gpipe", 1),
                                            (8, 4, "interleaved", 2), (6, 4, "interleaved", 3)])
def test_issue_order_keeps_each_groups_schedule_and_the_dependencies(n, m, schedule, v):
    plan = _plan(n, m, "interleaved" if v > 1 else "1f1b", v)
    order = issue_order(plan, schedule)
    assert len(order) == len(set(order)) == 2 * n * m
    groups = n // v
    for d in range(groups):
        mine = [(k, j, s // groups) for k, s, j in order if s % groups == d]
        assert mine == _order(d, groups, m, schedule, v)
    pos = {x: i for i, x in enumerate(order)}
    for s in range(n):
        for j in range(m):
            if s > 0:
                assert pos[("F", s - 1, j)] < pos[("F", s, j)]
            assert pos[("F", s, j)] < pos[("B", s, j)]
            if s < n - 1:
                assert pos[("B", s + 1, j)] < pos[("B", s, j)]


def test_issue_order_refuses_a_schedule_the_plan_cannot_run():
    with pytest.raises(ShardplanError, match="cannot run"):
        issue_order(_plan(4, 4), "interleaved")
    with pytest.raises(ShardplanError, match="cannot run"):
        issue_order(_plan(4, 4, "interleaved", 2), "1f1b")
    with pytest.raises(ShardplanError, match="unknown"):
        issue_order(_plan(2, 2), "zb")


def test_stage_specs_deal_chunks_round_robin():
    specs = stage_specs(_plan(6, 3, "interleaved", 2))
    assert [(s.group, s.chunk) for s in specs] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]


def test_assign_nodes_puts_free_nodes_next_to_their_first_reader():
    # a(op, 0) -> r(reshape of a parameter, free) -> b(op, 1); c (free, reads a) -> d(op, 2); e (free, unread)
    order = ["a", "r", "b", "c", "d", "e", "loss"]
    inputs = {"b": ["a", "r"], "c": ["a"], "d": ["c", "b"], "e": ["b"], "loss": ["d"]}
    got = assign_nodes(order, inputs, {"a": 0, "b": 1, "d": 2}, last=2, outputs=["loss"])
    assert got == {"a": 0, "r": 1, "b": 1, "c": 2, "d": 2, "e": 1, "loss": 2}


def test_assign_nodes_refuses_a_backward_edge():
    with pytest.raises(ShardplanError, match="later stage"):
        assign_nodes(["a", "b"], {"b": ["a"]}, {"a": 1, "b": 0}, last=1)


def test_stage_plan_is_the_stages_own_plan_even_when_costed_periodically():
    """A stage of 5 or more identical blocks is costed by linear extension (its cost's plan covers fewer
    blocks); stage_plan solves it directly, so every operator of the stage has a layout."""
    from shardplan.machine import Machine
    from shardplan.models import get_model
    from shardplan.pipeline import pipeline_solve
    from shardplan.pipeline.execute import stage_plan

    def build(b):
        return get_model("gpt", b, layers=12, d_model=64, heads=2, seq=16, vocab=256)

    r = pipeline_solve(build, 8, Machine(4, name="m"), micro_batches=(2,), sizes=(2,), cutoff=1)
    checked = 0
    for j, stage in enumerate(r.plan.stages):
        want = {op.name for op in r.stages.subgraph(stage.first, stage.end, 2).operators}
        got = stage_plan(r, j)
        assert {op.name for op in got.graph.operators} == want
        assert got.machine.num_devices == stage.devices
        checked += len(stage.cost.detail.graph.operators) < len(want)
    assert checked > 0, "some stage should have been costed by linear extension"
