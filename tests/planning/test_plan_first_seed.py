"""A first seed that fits (docs/pipeline.md, *A first seed that fits*): when the uniform pipelines' first candidate
is dropped for memory (fewer than 8 stages: it takes no memory-constrained stage) and no seed is known, the best
candidate with the most stages, whose stages take their memory-constrained optimum, is costed next, out of turn.

The miniature of DeepSeek-V3 on 1,024 H100 under the default budget: Llama 3 (tiny sizes, 8 blocks) on 16 h100
under 12 MiB per device, where no uniform pipeline of 2 or 4 stages fits time-optimally. In the estimate's order
the uniform pipelines of 2 and 4 stages come first and are dropped one after the other; a budget of 1e6 units was
spent among them before any plan (the call raised the budget error). Now the fourth costing is the 8-stage
pipeline, which fits: the call answers it, with its proven bound.
"""

from __future__ import annotations

import pytest

from shardplan.machine import preset
from shardplan.pipeline.search import PipelineSpace, evaluate_pipeline
from shardplan.planner import plan

MACHINE = preset("h100", 16)
BUDGET = 0.012 * 2**30  # bytes per device: no time-optimal stage of a 2- or 4-stage uniform pipeline fits
TINY = dict(sizes={"layers": 8}, batch=16, budget=BUDGET)


@pytest.fixture(scope="module")
def first():
    """The call under a budget that ends among the uniform pipelines."""
    return plan("llama3-tiny", MACHINE, work_limit=1e6, **TINY)


def test_a_budget_spent_among_dropped_seeds_still_answers_the_first_seed_that_fits(first):
    assert first.stats["stopped_at_work_limit"] and first.stats["interrupted"]
    assert first.solver == "pipeline" and first.num_stages == 8 and first.micro_batches == 16
    assert {s.devices for s in first.stages} == {2}
    assert first.stats["seed_out_of_turn"] == {"stages": 8, "micro_batches": 16, "step": first.step_time}
    assert float(first.memory["peak_bytes"]) <= BUDGET
    assert all(float(s.memory["peak_bytes"]) <= BUDGET for s in first.stages)


def test_the_first_seed_is_the_uniform_pipeline_costed_again_and_its_bound_is_proven(first):
    """The answer is a real uniform pipeline (the same step when its stages are costed again), and its lower bound
    is no more than the step of a plan found with more work (a proven bound of the whole space)."""
    res = first.detail
    segs = [(s.first, s.end, s.devices) for s in res.plan.stages]
    stages = res.stages
    space = PipelineSpace(stages.num_units, 16, 8, (16,), BUDGET)
    again = evaluate_pipeline(segs, 16, space, stages.stage_cost, stages.link_time, stages.exchange_time,
                              first.schedule, fit_fn=stages.fit_cost)
    assert again is not None and again.step_time == pytest.approx(first.step_time, rel=1e-12)
    assert 0 < first.lower_bound <= first.step_time
    assert first.gap == pytest.approx((first.step_time - first.lower_bound) / first.step_time)
    more = plan("llama3-tiny", MACHINE, work_limit=6e6, **TINY)
    assert more.step_time < first.step_time and first.lower_bound <= more.step_time
    assert more.lower_bound == pytest.approx(first.lower_bound, rel=1e-12)


def test_no_seed_out_of_turn_when_the_first_candidate_fits():
    """With the memory of the h100 the first candidate fits: the order is the estimate's, nothing out of turn."""
    got = plan("llama3-tiny", MACHINE, sizes={"layers": 8}, batch=16, work_limit=1e6)
    assert "seed_out_of_turn" not in got.stats
