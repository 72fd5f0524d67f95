"""The exact pipeline search against an independent solver: one MILP (HiGHS) per micro-batch and stage count."""

from __future__ import annotations

import pytest

from shardplan.errors import ShardplanError
from shardplan.pipeline.ilp import solve_pipeline_ilp
from shardplan.pipeline.search import PipelineSpace, evaluate_pipeline, search_pipeline
from test_pipeline_family import _brute_zb, _instance

pytestmark = pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out


def _exchange(nbytes, inter):
    return (0.02 if inter else 0.005) + nbytes * (4.0 if inter else 1.0)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_search_equals_ilp(seed, schedule):
    """Larger than brute force covers comfortably (U = 8 units, 16 devices on nodes of 8, three m): exact
    transfers, memory budgets that force memory-constrained stages, uniform and mixed sub-meshes (a script run
of 30 seeds at U = 8 and 10 at U = 10 agreed on every one, both schedules). Seed 0: no budget, uniform;
1: a budget, mixed; 2: a tighter budget, uniform; 3: no budget, mixed sub-meshes (40 % of the file's CPU
seconds, kept: the one unbudgeted search over mixed sizes)."""
    U, p = 8, 16
    stage_fn, fit_fn, link_fn = _instance(seed + 200, U, p)
    budget = [None, 6.0, 3.5][seed % 3]
    space = PipelineSpace(U, p, 8, micro_batches=(4, 8, 16), budget=budget, uniform=seed % 2 == 0)
    ilp = solve_pipeline_ilp(space, stage_fn, _exchange, schedule, fit_fn=fit_fn)
    assert ilp.proven
    got = search_pipeline(space, stage_fn, link_fn, (schedule,), exchange=_exchange, fit_fn=fit_fn)
    assert got.step_time == pytest.approx(ilp.step_time, rel=1e-9)
    assert got.lower_bound <= ilp.step_time * (1 + 1e-9)
    # the MILP's own stages re-evaluate to its value
    again = evaluate_pipeline(list(ilp.segments), ilp.micro_batches, space, stage_fn, link_fn, _exchange,
                              schedule=schedule, fit_fn=fit_fn)
    assert again.step_time == ilp.step_time


@pytest.mark.parametrize("seed", range(3))
def test_ilp_equals_brute_force(seed):
    """The MILP itself against every cut and tiling (ZB-H1, S <= m)."""
    U, p = 6, 8
    stage_fn, fit_fn, link_fn = _instance(seed + 300, U, p)
    space = PipelineSpace(U, p, 4, micro_batches=(2, 4), budget=[None, 4.0, 2.5][seed], uniform=False)
    want = min(_brute_zb(space, stage_fn, link_fn, fit_fn, _exchange).values())
    assert solve_pipeline_ilp(space, stage_fn, _exchange, "zb-h1", fit_fn=fit_fn).step_time == pytest.approx(
        want, rel=1e-9)


def test_ilp_bad_input():
    stage_fn, fit_fn, _ = _instance(0, 4, 4)
    with pytest.raises(ShardplanError, match="not 1f1b or zb-h1"):
        solve_pipeline_ilp(PipelineSpace(4, 4, 4), stage_fn, _exchange, "gpipe")
    with pytest.raises(ShardplanError, match="no pipeline fits"):
        solve_pipeline_ilp(PipelineSpace(4, 4, 4, budget=1e-3), stage_fn, _exchange)
