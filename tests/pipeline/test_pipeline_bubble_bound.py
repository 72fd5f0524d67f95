"""The part bounds that count the pipeline's fill and drain (docs/pipeline.md, *Bubble bounds*): the capped
min-sum cut DP against enumeration, the 1F1B and ZB-H1 bounds below every family optimum at every (S, m) of
random instances, at least the old family bounds and strictly above them somewhere, and the search with them
still brute force's optimum."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

from shardplan.pipeline import PipelineSpace, search
from shardplan.pipeline.search import (_bubble_bound, _capped_sum_cut, _capped_sum_cuts, _minmax_cuts,
                                       _one_f_one_b_family_bound, _zb_bubble_counts, brute_force_pipeline,
                                       evaluate_pipeline, search_pipeline)
from tests.pipeline.test_pipeline_family import _brute_zb, _instance, _tilings

SIZES = (1, 2, 4, 8)


def _enumerate_capped(weights, limits, cap, p, counts=None):
    """The least sum of run weights over every cut into runs (``counts``: only into that many) on sizes summing
    to p whose every run is within cap."""
    U = len(next(iter(weights.values())))
    best = math.inf
    for n in range(1, U + 1) if counts is None else counts:
        for cuts in itertools.combinations(range(1, U), n - 1):
            b = (0, *cuts, U)
            for qs in itertools.product(list(weights), repeat=n):
                if sum(qs) != p:
                    continue
                runs = [(b[i], b[i + 1], qs[i]) for i in range(n)]
                if any(sum(limits[q][a:e]) > cap for a, e, q in runs):
                    continue
                best = min(best, sum(sum(weights[q][a:e]) for a, e, q in runs))
    return best


@pytest.mark.parametrize("seed", range(8))
def test_capped_sum_cut_equals_enumeration(seed, monkeypatch):
    """g = 1: the DP's value is the enumerated least sum within the cap; g = 4 (whole nodes): at most it."""
    rng = np.random.default_rng(seed)
    U, p = 5, 8
    weights = {q: rng.uniform(0.1, 2.0, U) for q in SIZES}
    limits = {q: rng.uniform(0.5, 3.0, U) / q for q in SIZES}
    for cap in (0.4, 0.8, 1.5, math.inf):
        want = _enumerate_capped(weights, limits, cap, p)
        got = _capped_sum_cut(weights, limits, cap, p)
        assert got == pytest.approx(want, rel=1e-12) if math.isfinite(want) else got == math.inf
        assert _capped_sum_cut(weights, limits, cap, p, granule=4) <= got * (1 + 1e-12)
        per = _capped_sum_cuts(weights, limits, cap, p, range(1, U + 1))
        node = _capped_sum_cuts(weights, limits, cap, p, range(1, U + 1), granule=4)
        for n in range(1, U + 1):
            want_n = _enumerate_capped(weights, limits, cap, p, (n,))
            assert per[n] == pytest.approx(want_n, rel=1e-12) if math.isfinite(want_n) else per[n] == math.inf
            assert node[n] <= per[n] * (1 + 1e-12)
        assert min(per.values()) == got
    # fewer granules than p / g (the DP's cap on its width): coarser, a relaxation, never above the exact value
    monkeypatch.setattr(search, "CUT_GRANULES", 2)
    for cap in (0.8, 1.5, math.inf):
        exact = _enumerate_capped(weights, limits, cap, p)
        assert _capped_sum_cut(weights, limits, cap, p) <= exact * (1 + 1e-12)
        coarse = _capped_sum_cuts(weights, limits, cap, p, range(1, U + 1))
        for n in range(1, U + 1):
            assert coarse[n] <= _enumerate_capped(weights, limits, cap, p, (n,)) * (1 + 1e-12)


def _pipelines(space, stage_fn, link_fn, fit_fn, schedule):
    """Every pipeline of ``schedule`` in the space (ZB-H1: S <= m) that fits, as (m, S, plan)."""
    U = space.num_units
    for m in space.micro_batches:
        top = min(U, space.num_devices, m if schedule == "zb-h1" else U)
        for n in range(1, top + 1):
            for cuts in itertools.combinations(range(1, U), n - 1):
                b = (0, *cuts, U)
                for qs in _tilings(space, n):
                    segs = [(b[i], b[i + 1], qs[i]) for i in range(n)]
                    plan = evaluate_pipeline(segs, m, space, stage_fn, link_fn, schedule=schedule, fit_fn=fit_fn)
                    if plan is not None:
                        yield m, n, plan


def _forward_units(seed: int, U: int):
    """Per m, each unit's forward floor in :func:`_instance`: a stage's forward is at least 0.1 of its seconds,
    which are at least its units' work over q (efficiency <= 1), so 0.1 unit_w / m over q bounds it."""
    rng = random.Random(seed)
    unit_w = [rng.uniform(0.5, 2.0) for _ in range(U)]
    return lambda m: [0.1 * w / m for w in unit_w]


def _check_bubble_bounds(seed: int) -> int:
    """At every m and every stage count S, the 1F1B and ZB-H1 bubble bounds (the part's, and ZB-H1's per count),
    for incumbents below, at and above the optimum, are at most min(incumbent, the family's exact optimum at
    (S, m)); what the search states with them (the larger of them and the old family bound, each against the
    incumbent) is at least the old bound. Returns in how many cases a bubble bound is strictly above the old
    one."""
    U, p = 5, 8
    stage_fn, fit_fn, link_fn, lower = _instance(seed, U, p, eff_low=0.3, with_lower=True)
    space = PipelineSpace(U, p, 4, micro_batches=(2, 4, 8), budget=[None, 4.0][seed % 2])
    forward = _forward_units(seed, U)
    ns = space.node_size
    raised = 0
    for schedule in ("1f1b", "zb-h1"):
        exact: dict[tuple[int, int], float] = {}
        for m, n, plan in _pipelines(space, stage_fn, link_fn, fit_fn, schedule):
            exact[(m, n)] = min(exact.get((m, n), math.inf), plan.step_time)
        if schedule == "zb-h1":
            assert exact == pytest.approx(_brute_zb(space, stage_fn, link_fn, fit_fn))
        for m in space.micro_batches:
            units = {q: [lower(u, u + 1, q, m) for u in range(U)] for q in space.allowed_sizes()}
            opt = min((v for (mm, _), v in exact.items() if mm == m), default=math.inf)
            if not math.isfinite(opt):
                continue
            if schedule == "zb-h1":
                cuts = _minmax_cuts(units, p, range(1, min(U, m) + 1), granule=ns)
                old = min(m * v for v in cuts.values())
            else:
                old = _one_f_one_b_family_bound(units, p, m, ns)
            if schedule == "zb-h1":
                counts = range(1, min(U, m) + 1)
                b0 = _minmax_cuts(units, p, counts, granule=ns)
                for inc in (0.8 * opt, opt, 1.3 * opt, 3 * opt, math.inf):
                    per = _zb_bubble_counts(units, forward(m), p, m, inc, counts, ns, b0)
                    for n in counts:
                        stated = max(min(m * b0[n], inc), per[n])  # what the search takes for count n
                        assert stated <= min(inc, exact.get((m, n), math.inf)) * (1 + 1e-12), (m, n, inc)
                        raised += per[n] > min(m * b0[n], inc) * (1 + 1e-9)
            for inc in (0.8 * opt, opt, 1.3 * opt, 3 * opt, math.inf):
                new = _bubble_bound(units, forward(m) if schedule == "zb-h1" else None, p, m, inc, schedule, ns)
                for (mm, n), v in exact.items():
                    if mm == m:
                        assert new <= min(inc, v) * (1 + 1e-12), (schedule, m, n, inc)
                stated = max(min(old, inc), new)
                assert stated >= min(old, inc)
                assert stated <= min(inc, opt) * (1 + 1e-12)
                raised += new > min(old, inc) * (1 + 1e-9)
    return raised


@pytest.mark.parametrize("seed", range(8))
def test_bubble_bounds_below_every_family_optimum(seed):
    """:func:`_check_bubble_bounds` on random instances, with and without a memory budget."""
    _check_bubble_bounds(seed)


def test_bubble_bounds_strictly_tighter_somewhere():
    """Over the same instances the bubble bounds rise above the old family bounds in many cases (each family)."""
    assert sum(_check_bubble_bounds(seed) for seed in range(4)) >= 4


@pytest.mark.parametrize("seed", range(6))
def test_search_with_bubble_bounds_equals_brute_force(seed):
    """1F1B alone (no incumbent: the bound over every cut), with ZB-H1, and ZB-H1 alone with the bubble bounds
    (``unit_forward``): brute force's optimum, a stated bound at most it; with the optimum as the incumbent from
    outside, no plan and a bound within 1e-9 of it."""
    from shardplan.pipeline.progress import Progress

    U, p = 6, 8
    stage_fn, fit_fn, link_fn, lower = _instance(seed, U, p, eff_low=0.3, with_lower=True)
    space = PipelineSpace(U, p, 4, micro_batches=(2, 4, 8), budget=[None, 4.0, 2.5][seed % 3],
                          uniform=seed % 4 == 3)
    zb = _brute_zb(space, stage_fn, link_fn, fit_fn)
    one = brute_force_pipeline(space, stage_fn, link_fn, fit_fn=fit_fn).step_time
    for schedules in (("zb-h1",), ("1f1b",), ("1f1b", "zb-h1")):
        want = min(v for (m, n), v in zb.items() if n > 1 or schedules == ("zb-h1",)) if "zb-h1" in schedules \
            else math.inf
        if "1f1b" in schedules:
            want = min(want, one)
        kw = dict(schedules=schedules, fit_fn=fit_fn, stage_lower=lower, seeds=0, unit_forward=_forward_units(seed, U))
        got = search_pipeline(space, stage_fn, link_fn, **kw)
        assert got.step_time == pytest.approx(want, rel=1e-9)
        assert got.lower_bound <= want * (1 + 1e-9)
        progress = Progress()
        progress.improved(want)
        assert search_pipeline(space, stage_fn, link_fn, progress=progress, **kw) is None
        assert progress.bound == pytest.approx(want, rel=1e-9)

