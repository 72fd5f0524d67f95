"""Uniform seeds (shardplan.pipeline.search._uniform_seeds): real plans of the space costed before the parts, which
change neither the optimum nor the proven bound, only the incumbent the parts start from and their order."""

from __future__ import annotations

import math

import pytest

from shardplan.pipeline import PipelineSpace
from shardplan.pipeline.progress import Progress
from shardplan.pipeline.search import (_uniform_seeds, brute_force_pipeline, evaluate_pipeline,
                                       interleaved_chunkings, search_pipeline)
from tests.pipeline.test_pipeline_family import _brute_zb
from tests.pipeline.test_pipeline_family import _instance as _family_instance

KW = dict(schedules=("1f1b", "zb-h1"))


def _instance(seed: int, U: int, p: int):
    return _family_instance(seed, U, p, eff_low=0.3, with_lower=True)


@pytest.mark.parametrize("seed", range(8))
def test_search_with_seeds_equals_brute_force_and_the_search_without(seed):
    """With seeds (the default) and without: brute force's optimum over 1F1B and ZB-H1, a proven bound at most
    it, and a gap about 0; the seeds' best is a real uniform pipeline whose step :func:`evaluate_pipeline`
    gives again, at least the optimum; and with the optimum as an incumbent from outside nothing is claimed."""
    U, p = 6, 8
    stage_fn, fit_fn, link_fn, lower = _instance(seed, U, p)
    budget = [None, 4.0, 2.5][seed % 3]
    space = PipelineSpace(U, p, 4, micro_batches=(1, 2, 4, 8), budget=budget, uniform=seed % 4 == 3)
    want = min([brute_force_pipeline(space, stage_fn, link_fn, fit_fn=fit_fn).step_time,
                *_brute_zb(space, stage_fn, link_fn, fit_fn).values()])
    got = search_pipeline(space, stage_fn, link_fn, fit_fn=fit_fn, stage_lower=lower, **KW)
    plain = search_pipeline(space, stage_fn, link_fn, fit_fn=fit_fn, stage_lower=lower, seeds=0, **KW)
    assert got.step_time == pytest.approx(want, rel=1e-12) and plain.step_time == pytest.approx(want, rel=1e-12)
    assert got.lower_bound <= want * (1 + 1e-12) and got.gap < 1e-9
    assert got.stats["seeds_costed"] > 0 and "seeds_costed" not in plain.stats
    seeds = _uniform_seeds(space, stage_fn, link_fn, None, fit_fn, lower, KW["schedules"], (1, 2, 4, 8), 16, {},
                           lambda *_: None)
    for m, plan in seeds.items():
        segs = [(s.first, s.end, s.devices) for s in plan.stages]
        assert plan.micro_batches == m and len({q for *_, q in segs}) == 1
        again = evaluate_pipeline(segs, m, space, stage_fn, link_fn, schedule=plan.schedule, fit_fn=fit_fn)
        assert again is not None and again.step_time == pytest.approx(plan.step_time, rel=1e-12)
        assert plan.step_time >= want * (1 - 1e-12)
    tight = Progress()
    tight.improved(want)
    assert search_pipeline(space, stage_fn, link_fn, fit_fn=fit_fn, stage_lower=lower, progress=tight, **KW) is None
    assert want * (1 - 1e-9) <= tight.bound <= want * (1 + 1e-12)


def test_seeds_are_the_best_uniform_pipelines_within_the_limit():
    """With a limit above the candidates' count every uniform pipeline of both chunkings is costed (or skipped
    by a bound that reaches the best costed; memory-constrained stages from 8 stages on): the least seed equals
    the least of them costed by hand."""
    U, p = 6, 8
    stage_fn, fit_fn, link_fn, lower = _instance(10, U, p)
    space = PipelineSpace(U, p, 4, micro_batches=(1, 2, 4, 8), budget=3.0)
    for fit_stages in (2, 4, 8):
        stats: dict = {}
        seeds = _uniform_seeds(space, stage_fn, link_fn, None, fit_fn, lower, KW["schedules"], (1, 2, 4, 8),
                               10 ** 6, stats, lambda *_: None, fit_stages=fit_stages)
        by_hand = math.inf
        for m in (1, 2, 4, 8):
            for n in (2, 4):
                for ch in interleaved_chunkings(U, n):
                    plan = evaluate_pipeline([(a, b, p // n) for a, b in ch], m, space, stage_fn, link_fn,
                                             schedule="zb-h1" if n <= m else "1f1b",
                                             fit_fn=fit_fn if n >= fit_stages else None)
                    if plan is not None:
                        by_hand = min(by_hand, plan.step_time)
        assert min(s.step_time for s in seeds.values()) == pytest.approx(by_hand, rel=1e-12)
        assert 0 < stats["seeds_costed"]
        if fit_stages == 2:
            with_fits = by_hand
    assert with_fits < by_hand  # memory-constrained stages make a better seed here


def test_seed_count_first_and_interrupt_returns_a_seed():
    """The count whose seed is best is the first part searched, and an interrupt at the first part's first tick
    returns the best seed with a bound at most the optimum."""
    U, p = 6, 8
    stage_fn, fit_fn, link_fn, lower = _instance(2, U, p)
    space = PipelineSpace(U, p, 4, micro_batches=(1, 2, 4, 8), budget=4.0)
    want = search_pipeline(space, stage_fn, link_fn, fit_fn=fit_fn, stage_lower=lower, seeds=0, **KW).step_time
    seeds = _uniform_seeds(space, stage_fn, link_fn, None, fit_fn, lower, KW["schedules"], (1, 2, 4, 8), 16, {},
                           lambda *_: None)
    first = min(seeds, key=lambda m: (seeds[m].step_time, -m))
    parts: list[str] = []

    class Stop(Progress):
        def part(self, phase: str, detail: str = "") -> None:
            parts.append(phase)
            if len(parts) == 2:
                raise KeyboardInterrupt
            super().part(phase, detail)

    got = search_pipeline(space, stage_fn, link_fn, fit_fn=fit_fn, stage_lower=lower, progress=Stop(), **KW)
    assert parts[1].endswith(f"m={first}")
    assert got.stats["interrupted"] and got.step_time == pytest.approx(min(s.step_time for s in seeds.values()))
    assert got.lower_bound <= want * (1 + 1e-12)
