"""Solve-free stage bounds (shardplan.pipeline.floors) and the search that prunes with them: every bound below the
stage it bounds on a real model, and on random instances the same answer as brute force and as the search
without them, with a proven bound that stays below the optimum."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import pytest

from shardplan import preset
from shardplan.models import get_model
from shardplan.pipeline import ModelStages, PipelineSpace
from shardplan.pipeline.floors import UnitFloors
from shardplan.pipeline.progress import Progress
from shardplan.pipeline.search import brute_force_pipeline, search_pipeline
from tests.pipeline.test_pipeline_family import _brute_zb
from tests.pipeline.test_pipeline_family import _instance as _family_instance


def _instance(seed: int, U: int, p: int):
    """The family tests' random instances (efficiencies from 0.3) with a per-unit lower bound."""
    return _family_instance(seed, U, p, eff_low=0.3, with_lower=True)


@pytest.mark.parametrize("seed", range(8))
def test_search_with_stage_bounds_equals_brute_force(seed):
    """1F1B and ZB-H1 with the solve-free bounds: brute force's optimum, the same as without them, fewer stage
    solves, and a proven bound at most the optimum (every solve exact: gap about 0); with the optimum's own
    step as an incumbent from outside (the bounds' cap at its tightest), nothing better is claimed and the
    stated bound still holds."""
    U, p = 6, 8
    stage_fn, fit_fn, link_fn, lower = _instance(seed, U, p)
    budget = [None, 4.0, 2.5][seed % 3]
    space = PipelineSpace(U, p, 4, micro_batches=(1, 2, 4, 8), budget=budget, uniform=seed % 4 == 3)
    want = min([brute_force_pipeline(space, stage_fn, link_fn, fit_fn=fit_fn).step_time,
                *_brute_zb(space, stage_fn, link_fn, fit_fn).values()])
    calls = {True: 0, False: 0}

    def counted(use: bool):
        def fn(a, b, q, m):
            calls[use] += 1
            return stage_fn(a, b, q, m)
        return fn

    kw = dict(schedules=("1f1b", "zb-h1"), fit_fn=fit_fn)
    plain = search_pipeline(space, counted(False), link_fn, **kw)
    got = search_pipeline(space, counted(True), link_fn, stage_lower=lower, **kw)
    assert got.step_time == pytest.approx(want, rel=1e-12) and plain.step_time == pytest.approx(want, rel=1e-12)
    assert got.lower_bound <= want * (1 + 1e-12) and got.gap < 1e-9
    assert calls[True] <= calls[False]
    tight = Progress()
    tight.improved(want)
    assert search_pipeline(space, stage_fn, link_fn, stage_lower=lower, progress=tight, **kw) is None
    assert want * (1 - 1e-9) <= tight.bound <= want * (1 + 1e-12)
    loose = Progress()
    loose.improved(want * 1.02)
    again = search_pipeline(space, stage_fn, link_fn, stage_lower=lower, progress=loose, **kw)
    assert again is not None and again.step_time == pytest.approx(want, rel=1e-12)


def test_stage_bounds_skip_solves():
    """A size on which every unit is slow (its bound over best / m) is never solved once an incumbent is known."""
    U, p = 6, 8
    stage_fn, fit_fn, link_fn, lower = _instance(3, U, p)
    slow = {q: 50.0 if q == 2 else 1.0 for q in range(1, p + 1)}
    asked: list[int] = []

    def stage(a, b, q, m):
        asked.append(q)
        c = stage_fn(a, b, q, m)
        return dataclasses.replace(c, forward=c.forward * slow[q], backward=c.backward * slow[q],
                                   weight_grad=c.weight_grad * slow[q])

    space = PipelineSpace(U, p, 4, micro_batches=(2, 4), budget=None)
    free = search_pipeline(space, stage, link_fn, ("1f1b", "zb-h1"))
    assert 2 in asked
    asked.clear()
    known = Progress()
    known.improved(free.step_time * 1.01)  # an incumbent from outside: the cap best / m holds from the start
    got = search_pipeline(space, stage, link_fn, ("1f1b", "zb-h1"), progress=known,
                          stage_lower=lambda a, b, q, m: lower(a, b, q, m) * slow[q])
    assert 2 not in asked and got.stats["stages_skipped_by_floor"] > 0
    assert got.step_time == pytest.approx(free.step_time, rel=1e-12)


MACHINE = dataclasses.replace(preset("a100", 16), node_size=4)


def test_unit_floors_bound_every_stage_on_a_real_model():
    """On a small GPT on nodes of 4: every segment's solve-free bound is at most its time-optimal and its
    memory-constrained seconds on every size, and the cheapest-layout part is above the device-seconds one
    somewhere (it is what prunes a size whose layouts cannot use its devices)."""
    def build(b):
        return get_model("gpt", b, layers=2, d_model=64, heads=4, seq=16, vocab=256)

    st = ModelStages(build, 16, MACHINE, {"cutoff": 1}, periodic=True, memory_choices=True)
    floors = UnitFloors(st)
    U = st.num_units
    above = 0
    for m in (1, 4):
        for q in (2, 8, 12):
            for a in range(U):
                for b in range(a + 1, U + 1):
                    c = st.stage_cost(a, b, q, m)
                    if c is None:
                        continue
                    lb = floors.segment(a, b, q, m)
                    pre = floors._prefix(q, m)
                    assert type(lb) is float and lb == float(pre[b] - pre[a])  # the prefix sums' difference
                    assert lb == pytest.approx(sum(floors.unit(q, m)[a:b]), rel=1e-12, abs=1e-15)
                    assert 0.0 <= lb <= c.time * (1 + 1e-9)
                    assert st.device_seconds(m, a, b) / q <= lb * (1 + 1e-9)
                    above += lb > st.device_seconds(m, a, b) / q * (1 + 1e-6)
                    if b - a <= 2 and q == 12:
                        budget = c.memory(2) * 0.8
                        fit = st.fit_cost(a, b, q, m, 2, budget)
                        assert fit is None or lb <= fit.time * (1 + 1e-9)
    assert above > 0


@pytest.mark.parametrize("seed", range(8))
def test_stage_dp_with_floors_same_values_and_choices(seed):
    """The stage DP (exactly n stages, and every count over classes) with a floor per stage asked first gives the
    same value and the same stages as without, ties included, asking for no more stages; a floor over the
    stages' own limit ends the extent scan as the stage itself would."""
    from shardplan.pipeline.search import _BREAK, _stage_dp
    from tests.pipeline.test_pipeline_memo import _values

    U, p, m = 6, 8, [1, 2, 3, 5][seed % 4]
    space = PipelineSpace(U, p, 4)
    sizes = list(space.allowed_sizes())
    value, between = _values(seed, U, p, m)
    rng = random.Random(seed)
    frac = {(a, b, q): rng.uniform(0.0, 1.0) for a in range(U) for b in range(a + 1, U + 1) for q in sizes}
    limit = [math.inf, 2.0, 1.0][seed % 3]
    asked = {True: 0, False: 0}

    def stage_of(use: bool):
        def stage(a, b, o, q, r):
            asked[use] += 1
            v = value(a, b, o, q, r)
            return _BREAK if v is not None and v > limit and value(a, b, 0, q, 1) is not None else v
        return stage

    def floor(a, b, q):
        # below every value of the stage (the values add nonnegative terms to the work over the size)
        lo = min((v for v in (value(a, b, o, q, r) for o in range(p) for r in range(1, m + 2)) if v is not None),
                 default=0.0) * frac[(a, b, q)]
        return _BREAK if lo > limit and value(a, b, 0, q, 1) is not None and min(
            (v for v in (value(a, b, o, q, r) for o in range(p) for r in range(1, m + 2)) if v is not None),
            default=0.0) > limit else lo

    for link in (None, between):
        for n, classes in [(k, None) for k in range(1, 4)] + [(0, m)]:
            want = _stage_dp(space, n, sizes, stage_of(False), link, {}, "s", classes=classes)
            got = _stage_dp(space, n, sizes, stage_of(True), link, {}, "s", classes=classes, floor=floor)
            assert got == want
    assert asked[True] <= asked[False]


def test_zb_dp_unreachable_states_same_answer():
    """ZB-H1's stage DP leaving out the states whose units need more device-seconds than their devices give under
    the limit min(hi, cap) answers the same value and stages as without, for every stage count and limit on
    random instances, and does leave some out."""
    from shardplan.pipeline.search import _StagePool, _zb_dp

    U, p, m = 6, 8, 8
    left_out = 0
    for seed, n in itertools.product(range(6), (1, 2, 3, 4)):
        stage_fn, fit_fn, link_fn, lower = _instance(seed, U, p)
        space = PipelineSpace(U, p, 4, micro_batches=(m,), budget=[None, 4.0, 2.5][seed % 3])
        budget = math.inf if space.budget is None else space.budget
        for scale in (0.3, 0.6, 1.0, 3.0):
            hi = scale * stage_fn(0, U, p, m).time
            got = {}
            for prune in (False, True):
                pool = _StagePool(stage_fn, fit_fn, m, budget, {}, stage_lower=lower)
                stats: dict = {}
                got[prune] = _zb_dp(pool, space, n, None, link_fn, None, hi, 0.0, 0.0, stats,
                                    cap=hi * 0.9, prune_states=prune)
                if prune:
                    left_out += stats.get("dp_states_unreachable", 0)
            assert got[True] == got[False]
    assert left_out > 0


def test_layout_memo_gives_the_enumerated_layouts():
    """The unit bounds' layouts memo (keyed by dim names and configurations) returns, for every operator of a small
    GPT at several micro-batch sizes and sub-mesh sizes, the arrays of the layouts enumerated directly, and is hit
    across micro-batch sizes (operators whose batch dim admits the same splits); the bounds equal those computed
    with the memo emptied before every operator."""
    import numpy as np

    from shardplan.configs import layouts
    from shardplan.layout import LayoutArrays

    def build(b):
        return get_model("gpt", b, layers=2, d_model=64, heads=4, seq=16, vocab=256)

    st = ModelStages(build, 32, MACHINE, {"cutoff": 1}, periodic=True, memory_choices=True)
    floors, fresh = UnitFloors(st), UnitFloors(st)
    calls = 0
    for m in (1, 2, 4, 8):
        g, _, _ = st.graph(m)
        for q in (8, 12, 16):
            levels = dataclasses.replace(MACHINE, num_devices=q).levels
            for op in g.operators:
                got = floors._arrays_of(op, levels, 1, False, True, "row-major", False)
                calls += 1
                want = LayoutArrays.stack(layouts(op, levels, 1, False, True, "row-major"))
                assert np.array_equal(got.level_splits, want.level_splits)
                assert np.array_equal(got.level_strides, want.level_strides)
            for u in range(st.num_units):
                fresh._arrays.clear()
                assert floors.segment(u, u + 1, q, m) == fresh.segment(u, u + 1, q, m)
    assert len(floors._arrays) < calls / 2


@pytest.mark.parametrize("seed", range(4))
def test_memory_aware_bound_below_the_memory_constrained_optimum(seed):
    """The Lagrangian stage bound (UnitFloors.memory_segment) on random segments, sizes, m, in-flight counts and
    budgets of a small GPT on nodes of 4: at least the plain bound, at most the exact memory-constrained optimum
    (fit_cost, proven to 1e-9) wherever something fits, and above the plain bound on some of them (where the
    time-optimal stage does not fit)."""
    def build(b):
        return get_model("gpt", b, layers=3, d_model=64, heads=4, seq=16, vocab=256)

    st = ModelStages(build, 16, MACHINE, {"cutoff": 1}, periodic=True, memory_choices=True)
    floors = UnitFloors(st)
    U = st.num_units
    rng = random.Random(seed)
    checked = lifted = 0
    for _ in range(12):
        a = rng.randrange(U)
        b = rng.randrange(a + 1, U + 1)
        q, m, k = rng.choice((4, 8, 12)), rng.choice((1, 2, 4)), rng.choice((1, 2, 4, 8))
        free = st.stage_cost(a, b, q, m)
        if free is None:
            continue
        budget = free.memory(k) * rng.uniform(0.3, 1.1)
        plain = floors.segment(a, b, q, m)
        got = floors.memory_segment(a, b, q, m, k, budget)
        assert got >= plain
        fit = st.fit_cost(a, b, q, m, k, budget)
        if fit is not None:
            checked += 1
            assert got <= fit.time * (1 + 1e-9)
            lifted += got > plain * (1 + 1e-6)
    assert checked >= 6 and lifted > 0


def test_unit_floors_bound_every_stage_where_gradients_go_home_by_reduce_scatter():
    """On DTensor's machine (``scatter_gathered_grads``) the tables move an activation gradient's all-reduce from its
    consumer to the input's edge, where a reduce-scatter may replace it: the bounds then stay at most every stage's
    time-optimal seconds (an operator costed alone would charge the all-reduce its edge no longer sends)."""
    def build(b):
        return get_model("gpt", b, layers=2, d_model=64, heads=4, seq=16, vocab=256)

    machine = dataclasses.replace(MACHINE, scatter_gathered_grads=True)
    st = ModelStages(build, 16, machine, {"cutoff": 1}, periodic=True, memory_choices=True)
    floors = UnitFloors(st)
    U = st.num_units
    for m in (1, 4):
        for q in (8, 12):
            for a in range(U):
                for b in range(a + 1, U + 1):
                    c = st.stage_cost(a, b, q, m)
                    if c is not None:
                        assert floors.segment(a, b, q, m) <= c.time * (1 + 1e-9)
