"""The planner costs the uniform pipelines (the pipeline search's seeds) first and prunes the one program's memory
search with their step: the answer is the better of the two exact searches, as when each runs alone."""

from __future__ import annotations

import math

import pytest

from shardplan.errors import ShardplanError
from shardplan.fit import FitOptions, solve_fit
from shardplan.machine import preset
from shardplan.models import get_model
from shardplan.pipeline.api import pipeline_seeds, pipeline_solve
from shardplan.pipeline.progress import Progress
from shardplan.planner import plan

import planning_solves as solves
from planning_solves import gpt4_pipeline_on_slow_links, gpt4_plan_on_a100_16

pytestmark = pytest.mark.slow  # two pipeline searches on 16 devices (see pyproject.toml)

MS = solves.MICRO_BATCHES
KW = solves.PIPELINE_KW


def gpt(b: int):
    return get_model("gpt", b, layers=4)


def gpt6(b: int):
    # six blocks: on the slow links below the best uniform pipeline already beats every one-program plan
    return get_model("gpt", b, layers=6)


@pytest.fixture(scope="module")
def slow_links():
    # links across nodes slow enough that a pipeline beats one program (tests/planning/test_planner.py)
    return solves.slow_links()


@pytest.fixture(scope="module")
def six_blocks(slow_links):
    """plan() of six blocks on the slow links, uninterrupted: read by two tests (one search, not two)."""
    return plan("gpt", slow_links, sizes={"layers": 6}, batch=16, micro_batches=MS)


def test_seeds_then_the_search_on_their_stages_equal_the_search_alone(slow_links):
    """The seeds' best is a real pipeline no faster than the optimum; the search given their stage costs answers
    what it answers alone (step and proven bound), costing no stage the seeds costed again."""
    m = slow_links
    tracker = Progress()
    seed = pipeline_seeds(gpt, 16, m, progress=tracker, **KW)
    # the progress line shows the seeds' best as it goes; nothing is pruned with it (the incumbent stays unset)
    assert tracker.heard == seed.step_time and tracker.incumbent == math.inf
    assert f"best {seed.step_time:.4g} s" in tracker.line()
    alone = gpt4_pipeline_on_slow_links()  # pipeline_solve(gpt, 16, m, **KW), shared with test_planner.py
    solves = seed.stages.solves
    again = pipeline_solve(gpt, 16, m, model=seed.stages, floors=seed.floors, **KW)
    assert seed.plan.lower_bound is None and seed.step_time >= alone.plan.step_time * (1 - 1e-12)
    assert again.plan.step_time == alone.plan.step_time and again.plan.lower_bound == alone.plan.lower_bound
    # the seeds' stages are solved once: the search on them adds what the search alone adds after its seeds
    assert solves > 0 and again.stages.solves == alone.stages.solves and again.floors is seed.floors
    with pytest.raises(ShardplanError, match="model="):
        pipeline_solve(gpt, 32, m, model=seed.stages, **KW)


def test_the_plan_is_the_better_of_both_searches_and_its_bound_covers_both(slow_links, six_blocks):
    """plan() with the seeds first: the step is the least of the one program's optimum (solved without an
    incumbent) and the pipeline search's; where the one program proved none of its plans beats the seed, that
    bound lies between the seed's step and the one program's optimum; the plan's bound is at most the answer."""
    m, got = slow_links, six_blocks
    one = solve_fit(gpt6(16), m, budget=m.memory_bytes, options=FitOptions(micro_batches=MS), cutoff=1)
    pipe = pipeline_solve(gpt6, 16, m, **KW)
    assert got.step_time == pytest.approx(min(one.cost, pipe.plan.step_time), rel=1e-12)
    assert got.pipelined == (pipe.plan.step_time < one.cost)
    assert got.lower_bound <= got.step_time * (1 + 1e-12)
    seed = got.stats["seed_step"]
    assert seed >= pipe.plan.step_time * (1 - 1e-12)
    # here the seed beats the one program's optimum: its search stops at "none better" (the other case, the one
    # program winning, is tests/planning/test_planner.py's)
    bound = got.stats["one_program_none_better"]
    assert seed * (1 - 1e-9) <= bound <= one.cost * (1 + 1e-12)
    assert "one program" not in got.stats["compared"]


def test_ctrl_c_while_the_seeds_are_costed_returns_the_best_seed(monkeypatch):
    """Ctrl-C while the uniform pipelines are costed (the exact solver raises KeyboardInterrupt at its k-th call,
    the first k that leaves a plan): the best of them so far is the answer, marked interrupted, nothing else
    searched, so the bound is the step floor of the pipelines and the work floor of the one program, above 0 and
    never above the uninterrupted answer; before any, the interrupt propagates."""
    from tests.planning.test_planner import _first_interrupt_with_a_plan

    m = preset("a100", 16)
    full = gpt4_plan_on_a100_16()  # plan("gpt", m, sizes={"layers": 4}, batch=32), shared with test_planner.py
    first = []

    def run():
        try:
            return plan("gpt", m, sizes={"layers": 4}, batch=32)
        except KeyboardInterrupt:
            first.append(True)
            return None

    got = _first_interrupt_with_a_plan(monkeypatch, run)
    assert first  # the earliest interrupts came before any plan: they propagate
    assert got.stats["interrupted"] and got.pipelined and list(got.stats["compared"]) == ["pipeline"]
    assert "pipelines: interrupted before the pipeline search, the best uniform pipeline kept" in got.stats["refused"]
    assert got.step_time >= full.step_time * (1 - 1e-9) and 0.0 < got.lower_bound <= full.step_time * (1 + 1e-12)


def test_ctrl_c_in_the_search_before_it_finds_the_seed_again_returns_the_seed(slow_links, six_blocks):
    """Ctrl-C in the pipeline search's first tick (its own seeds, before it has a plan), where the one program
    proved none of its plans beats the seed: the seed is the answer, marked interrupted, and its bound, the
    least of the one program's and the one the search stated of its space, is at most the optimum."""
    from shardplan.pipeline.progress import Progress

    m, full = slow_links, six_blocks
    assert full.pipelined and "one_program_none_better" in full.stats and full.solver == "pipeline"
    tracker = Progress()

    def tick(n: int) -> None:
        if tracker.phase == "pipelines: uniform seeds":
            raise KeyboardInterrupt

    tracker.on_tick = tick
    got = plan("gpt", m, sizes={"layers": 6}, batch=16, micro_batches=MS, progress=tracker)
    assert got.stats["interrupted"] and got.pipelined and got.step_time == got.stats["seed_step"]
    assert got.stats["refused"] == ["pipelines: interrupted before the search had a plan, the best uniform pipeline kept"]
    assert got.step_time >= full.step_time * (1 - 1e-12) and got.lower_bound <= full.step_time * (1 + 1e-12)
