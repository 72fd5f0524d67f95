"""ZB-H1's box bound with the forward floor (docs/pipeline.md, *ZB-H1's boxes*): below every pipeline's own step
on random instances, the search with it equal to brute force and never solving more boxes, a case where it
closes a stage count the old bound left open, and the forward floor below every stage's forward on a real model."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import pytest

from shardplan import preset
from shardplan.models import get_model
from shardplan.pipeline import ModelStages, PipelineSpace
from shardplan.pipeline.search import (StageCost, _zb_box_bound, _zb_terms, brute_force_pipeline, evaluate_pipeline,
                                       search_pipeline)
from tests.pipeline.test_pipeline_family import _brute_zb, _instance, _zb_pipelines


def _phi_star(space, stage_fn, link_fn, fit_fn) -> dict[int, float]:
    """Per m, the least over every ZB-H1 pipeline of its largest stage forward: the tightest valid forward floor."""
    out: dict[int, float] = {}
    for m, _, plan in _zb_pipelines(space, stage_fn, link_fn, fit_fn):
        big = max(s.cost.forward for s in plan.stages)
        out[m] = min(out.get(m, float("inf")), big)
    return out


def _own_terms(plan):
    """(sum of stage and transfer seconds, M, W, Y) of a plan, as the ZB-H1 closed form takes them."""
    total = sum(s.cost.time for s in plan.stages) + sum(plan.links) + sum(plan.back_links or plan.links)
    big = max([s.cost.time for s in plan.stages] + list(plan.links) + list(plan.back_links or ()))
    w = min(_zb_terms(s.cost)[0] for s in plan.stages)
    y = min(_zb_terms(s.cost)[1] for s in plan.stages)
    return total, big, w, y


@pytest.mark.parametrize("seed", range(6))
def test_box_bound_below_every_pipeline(seed):
    """For every ZB-H1 pipeline of a random instance, the bound of the tightest box holding it (its own sum, M,
    W and Y) with the tightest valid forward floor is at most its step, and so is the bound of looser boxes; in a
    box not yet split on W or Y the forward floor raises the bound above phi = 0's for some pipeline."""
    U, p = 5, 8
    stage_fn, fit_fn, link_fn = _instance(seed, U, p)
    space = PipelineSpace(U, p, 4, micro_batches=(2, 4, 8), budget=[None, 4.0][seed % 2])
    phi = _phi_star(space, stage_fn, link_fn, fit_fn)
    raised = 0
    rng = random.Random(seed)
    for m, n, plan in _zb_pipelines(space, stage_fn, link_fn, fit_fn):
        total, big, w, y = _own_terms(plan)
        step = plan.step_time
        own = _zb_box_bound(total, big, w, y, m, n, phi[m])
        assert own <= step * (1 + 1e-12)
        loose = _zb_box_bound(total * rng.uniform(0.5, 1), big * rng.uniform(0.5, 1), w * rng.uniform(1, 2),
                              y * rng.uniform(1, 2), m, n, phi[m] * rng.uniform(0, 1))
        assert loose <= step * (1 + 1e-12)
        open_w = _zb_box_bound(total, big, math.inf, math.inf, m, n, phi[m])  # a box not yet split on W or Y
        assert open_w <= step * (1 + 1e-12)
        raised += open_w > _zb_box_bound(total, big, math.inf, math.inf, m, n) * (1 + 1e-9)
    assert raised > 0


@pytest.mark.parametrize("seed", range(6))
def test_search_with_forward_floor_equals_brute_force(seed):
    """ZB-H1 (and with 1F1B) with the forward floor: brute force's optimum, a proven bound at most it, and never
    more boxes than without it (the bound only rises; each box's split is the same)."""
    U, p = 6, 8
    stage_fn, fit_fn, link_fn, lower = _instance(seed, U, p, eff_low=0.3, with_lower=True)
    space = PipelineSpace(U, p, 4, micro_batches=(2, 4, 8), budget=[None, 4.0, 2.5][seed % 3],
                          uniform=seed % 4 == 3)
    zb = _brute_zb(space, stage_fn, link_fn, fit_fn)
    phi = _phi_star(space, stage_fn, link_fn, fit_fn)
    for schedules in (("zb-h1",), ("1f1b", "zb-h1")):
        want = min(v for (m, n), v in zb.items() if n > 1 or schedules == ("zb-h1",))
        if "1f1b" in schedules:
            want = min(want, brute_force_pipeline(space, stage_fn, link_fn, fit_fn=fit_fn).step_time)
        kw = dict(schedules=schedules, fit_fn=fit_fn, stage_lower=lower, seeds=0)
        plain = search_pipeline(space, stage_fn, link_fn, **kw)
        got = search_pipeline(space, stage_fn, link_fn, forward_floor=lambda m: phi[m], **kw)
        assert got.step_time == pytest.approx(want, rel=1e-12) and plain.step_time == pytest.approx(want, rel=1e-12)
        assert got.lower_bound <= want * (1 + 1e-12) and got.gap < 1e-9
        assert got.stats.get("zb_boxes", 0) <= plain.stats.get("zb_boxes", 0)


def test_forward_floor_closes_a_stage_count():
    """Uniform stages whose forward is most of their time: the old bound leaves the many-stage count's first
    children open (their lower bound, m M - (n - 1) stays below the incumbent), the forward floor's bound (the
    ZB-H1 bubble (n - 1) f) closes them: fewer boxes, the same optimum as brute force."""
    U, p = 6, 8

    def stage_fn(a, b, q, m):
        t = (b - a) / q / m * (1.0 + 0.1 * (b - a))
        return StageCost(0.6 * t, 0.4 * t, 0.0, 0.0, None, 0.0, 0.0, 0.1 * t)

    def link_fn(u, q, q2, m, inter):
        return 0.0

    space = PipelineSpace(U, p, 4, micro_batches=(6,), budget=None)
    phi = _phi_star(space, stage_fn, link_fn, None)
    want = min(_brute_zb(space, stage_fn, link_fn, None).values())
    plain = search_pipeline(space, stage_fn, link_fn, schedules=("zb-h1",), seeds=0)
    got = search_pipeline(space, stage_fn, link_fn, schedules=("zb-h1",), seeds=0, forward_floor=lambda m: phi[m])
    assert got.step_time == pytest.approx(want, rel=1e-12) and plain.step_time == pytest.approx(want, rel=1e-12)
    assert got.stats["zb_boxes"] < plain.stats["zb_boxes"]


def test_forward_floor_below_every_stage_forward_on_a_real_model():
    """ModelStages.forward_floor: every segment's forward seconds on q devices (time-optimal and memory-
    constrained) are at least its forward device-seconds over q (below its device-seconds: the backward's passes
    are left out); so the largest forward of any tiling is at least the model's over p."""
    def build(b):
        return get_model("gpt", b, layers=2, d_model=64, heads=4, seq=16, vocab=256)

    machine = dataclasses.replace(preset("a100", 8), node_size=4)
    st = ModelStages(build, 16, machine, {"cutoff": 1}, periodic=True, memory_choices=True)
    U = st.num_units
    for m in (1, 4):
        assert st.forward_floor(m) == pytest.approx(st.device_seconds(m, forward=True) / 8, rel=1e-12)
        assert 0 < st.device_seconds(m, forward=True) < st.device_seconds(m) / 2
        for q in (4, 8):
            for a in range(U):
                for b in range(a + 1, U + 1):
                    c = st.stage_cost(a, b, q, m)
                    if c is None:
                        continue
                    floor = st.device_seconds(m, a, b, forward=True) / q
                    assert c.forward >= floor * (1 - 1e-9) > 0
                    if b - a <= 2 and q == 4:
                        fit = st.fit_cost(a, b, q, m, 2, c.memory(2) * 0.8)
                        assert fit is None or fit.forward >= floor * (1 - 1e-9)


@pytest.mark.parametrize("seed", range(4))
def test_dp_answer_revalued_exactly(seed):
    """``_zb_dp(..., only=segs)`` gives a DP answer's own value bit for bit (with exact transfers and with links),
    and None once one of its stages is not allowed (a bound below its slowest stage)."""
    from shardplan.pipeline.search import _StagePool, _zb_dp

    U, p = 6, 8
    stage_fn, fit_fn, link_fn, lower = _instance(seed, U, p, eff_low=0.3, with_lower=True)
    space = PipelineSpace(U, p, 4, micro_batches=(4,), budget=[None, 4.0][seed % 2])
    for exchange in (None, lambda nbytes, inter: 0.01 + (nbytes or 0.0) * (2.0 if inter else 1.0)):
        for n in (2, 3, 4):
            pool = _StagePool(stage_fn, fit_fn, 4, space.budget or math.inf, {}, stage_lower=lower)
            got = _zb_dp(pool, space, n, None, link_fn, exchange, math.inf, 0.0, 0.0, {})
            assert got is not None
            again = _zb_dp(pool, space, n, None, link_fn, exchange, math.inf, 0.0, 0.0, {}, only=got[1])
            assert again == got
            slowest = max(pool.get(a, b, q, float(n)).time for a, b, _, q in got[1])
            assert _zb_dp(pool, space, n, None, link_fn, exchange, slowest * 0.999, 0.0, 0.0, {},
                          only=got[1]) is None


def test_kept_dp_answers_are_reused_and_the_optimum_is_brute_forces():
    """With memory-constrained stages solved lazily, a box whose DP was asked before (the part above a relaxed
    optimum's max, a box back after its stand-ins were solved) takes the kept answer when it is still allowed at
    the same value; the optimum stays brute force's."""
    reused = 0
    for seed in (2, 5, 7, 8):
        U, p = 6, 8
        stage_fn, fit_fn, link_fn, lower = _instance(seed, U, p, eff_low=0.3, with_lower=True)
        space = PipelineSpace(U, p, 4, micro_batches=(2, 4, 8), budget=[None, 4.0, 2.5][seed % 3])
        want = min(_brute_zb(space, stage_fn, link_fn, fit_fn).values())
        got = search_pipeline(space, stage_fn, link_fn, schedules=("zb-h1",), fit_fn=fit_fn, stage_lower=lower,
                              seeds=0)
        assert got.step_time == pytest.approx(want, rel=1e-12) and got.lower_bound <= want * (1 + 1e-12)
        reused += got.stats.get("zb_dp_reused", 0)
    assert reused > 0


@pytest.mark.parametrize("seed", range(4))
def test_stand_ins_from_fewer_in_flight(seed):
    """A stand-in of a stage with k in flight takes the largest proven seconds of its solves with fewer (at most
    its own optimum: that is nondecreasing in k), and no stand-in where nothing fit fewer (nothing fits k); the
    ZB-H1 search with them (stage counts share one pool at m) is still brute force's."""
    from shardplan.pipeline.search import _PENDING, _StagePool

    U, p = 6, 8
    stage_fn, fit_fn, link_fn, lower = _instance(seed, U, p, eff_low=0.3, with_lower=True)
    budget = 2.5
    pool = _StagePool(stage_fn, fit_fn, 8, budget, {}, stage_lower=lower)
    raised = nones = 0
    for a, b in itertools.combinations(range(U + 1), 2):
        for q in (1, 2, 4):
            if pool.get(a, b, q, 2.0) is None or pool.plain(a, b, q).memory(2.0) <= budget:
                continue
            pool.resolve((a, b, q, 2.0))
            low = pool.get(a, b, q, 2.0)
            for k in (3.0, 5.0):
                c = pool.get(a, b, q, k)
                truth = fit_fn(a, b, q, 8, int(k), budget)
                if low is None:
                    assert c is None and truth is None
                    nones += 1
                    continue
                assert c.detail is _PENDING and low.proven * (1 - 1e-12) <= c.time
                assert truth is None or c.time <= truth.time * (1 + 1e-12)  # None: a relaxation, still below
                raised += c.time > pool.plain(a, b, q).time * (1 + 1e-9)
    assert raised > 0 or nones > 0
    space = PipelineSpace(U, p, 4, micro_batches=(4, 8), budget=budget)
    want = min(_brute_zb(space, stage_fn, link_fn, fit_fn).values())
    got = search_pipeline(space, stage_fn, link_fn, schedules=("zb-h1",), fit_fn=fit_fn, stage_lower=lower, seeds=0)
    assert got.step_time == pytest.approx(want, rel=1e-12) and got.lower_bound <= want * (1 + 1e-12)
