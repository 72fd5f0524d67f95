"""The seed phase's cheaper floors and its lazy candidate order (shardplan.pipeline.floors, _uniform_seeds): the unit
floors equal, float for float, the direct computation (layouts enumerated per operator, each operator costed on its
own for the vertex cost, the weight sync and the choice table); the device-seconds bound of a chunking is below
its exact one; and the seeds costed with that bound first are the same candidates, in the same order, with the
same plans, as with every exact estimate computed up front."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from shardplan.configs import layouts
from shardplan.cost import operator_cost
from shardplan.cost.memory import STAGES, choice_table
from shardplan.layout import LayoutArrays
from shardplan.machine import preset
from shardplan.models import get_model
from shardplan.pipeline import ModelStages, PipelineSpace
from shardplan.pipeline.floors import UnitFloors
from shardplan.pipeline.search import _uniform_seeds, interleaved_chunkings
from shardplan.pipeline.stages import weight_sync
from tests.pipeline.test_pipeline_family import _instance as _family_instance

SCHEDULES = ("1f1b", "zb-h1")


def _gpt(b: int):
    return get_model("gpt", b, layers=3, d_model=64, heads=4, seq=16, vocab=256)


def _reference_units(st: ModelStages, q: int, m: int) -> list[float]:
    """Per unit, the floor computed directly: max(device-seconds / q, the sum over the unit's operators of the
    least of (vertex cost less (1 - 1/m) of the weight sync) and of the unpruned choice table's seconds, over the
    layouts :func:`~shardplan.configs.layouts` enumerates for that operator), each operator costed on its own (on
    one level, the device-seconds alone); then the prefix sums' differences, as :meth:`UnitFloors.unit` states
    them."""
    g, units, _ = st.graph(m)
    machine = dataclasses.replace(st.machine, num_devices=q, memory_bytes=None)
    cutoff = st.solve_options.get("cutoff", 4)
    vals = []
    for u, idx in enumerate(units):
        d = st.device_seconds(m, u, u + 1) / q
        v = 0.0
        for i in idx if machine.hierarchical else ():
            op = g.operators[i]
            arr = LayoutArrays.stack(layouts(op, machine.levels, cutoff, False, True, "row-major"))
            least = float(np.min(operator_cost(op, arr, machine).total
                                 - (1.0 - 1.0 / m) * weight_sync(op, arr, None, machine)))
            rows = choice_table(op, arr, None, machine, 1, STAGES, True, prune=False, accumulate=m)
            v += min(least, float(rows.seconds.min()))
        vals.append(max(d, v))
    return list(np.diff(np.concatenate(([0.0], np.cumsum(vals)))))


@pytest.mark.parametrize("p", [32, 64])
def test_unit_floors_equal_the_direct_computation(p):
    """A 3-layer GPT on p H100 (nodes of 8, so two levels from 16 devices): every unit floor and every segment
    bound at several m and sub-mesh sizes equals the direct computation float for float; the per-configuration
    layout memo is shared across micro-batch sizes (fewer blocks than operator enumerations)."""
    st = ModelStages(_gpt, 32, preset("h100", p), {"cutoff": 1}, periodic=True, memory_choices=True)
    floors = UnitFloors(st)
    U = st.num_units
    for m in (1, 2, 4, 8):
        for q in (8, 16, p // 2, p):
            want = _reference_units(st, q, m)
            assert floors.unit(q, m) == want
            pre = np.concatenate(([0.0], np.cumsum(want)))
            for a in range(U):
                for b in range(a + 1, U + 1):
                    seg = floors.segment(a, b, q, m)
                    assert type(seg) is float
                    assert seg == float(floors._prefix(q, m)[b] - floors._prefix(q, m)[a])
            assert floors.segment(0, U, q, m) == pytest.approx(float(pre[U]), rel=1e-12)
    assert 0 < len(floors._blocks) and floors._arrays


@pytest.mark.parametrize("p", [32, 64])
def test_chunking_lower_below_the_exact_bound(p):
    """The device-seconds bound of every uniform chunking is at most its exact largest stage bound (as floats),
    and equal to it once the (q, m) prefix sums exist; a chunking that does not cover the units gets the exact
    maximum."""
    st = ModelStages(_gpt, 32, preset("h100", p), {"cutoff": 1}, periodic=True, memory_choices=True)
    floors, exact = UnitFloors(st), UnitFloors(st)
    U = st.num_units
    strict = 0
    for m in (1, 4, 8):
        for n in (2, 4):
            q = p // n
            for chunks in interleaved_chunkings(U, n):
                lo = floors.chunking_lower(chunks, q, m)
                t = max(exact.segment(a, b, q, m) for a, b in chunks)
                assert lo <= t
                strict += lo < t
    assert strict > 0
    floors.unit(p // 2, 4)
    chunks = interleaved_chunkings(U, 2)[0]
    assert floors.chunking_lower(chunks, p // 2, 4) == max(floors.segment(a, b, p // 2, 4) for a, b in chunks)
    assert floors.chunking_lower(((1, U - 1),), p // 4, 2) == floors.segment(1, U - 1, p // 4, 2)


def _costed(space, stage_fn, link_fn, fit_fn, lower, ms, limit, chunking_lower=None):
    """The seeds, the candidates costed (in order, as the progress ticks name them) and the stats."""
    ticks: list[str] = []
    found: list[float] = []
    stats: dict = {}
    seeds = _uniform_seeds(space, stage_fn, link_fn, None, fit_fn, lower, SCHEDULES, ms, limit, stats,
                           lambda s: ticks.append(s), lambda plan: found.append(plan.step_time),
                           chunking_lower=chunking_lower)
    return seeds, ticks, found, stats


def _same_seeds(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[m].step_time == b[m].step_time and a[m].schedule == b[m].schedule
        and [(s.first, s.end, s.devices) for s in a[m].stages] == [(s.first, s.end, s.devices) for s in b[m].stages]
        for m in a)


@pytest.mark.parametrize("seed", range(12))
def test_lazy_seeds_same_as_eager_on_random_instances(seed):
    """On random instances (the family tests'), with a lower bound of each chunking's estimate at a random fraction
    of the exact one (some equal to it): the same candidates costed in the same order, the same plans found in
    the same order, the same seeds; and no more exact estimates computed than eagerly."""
    U, p = 8, 16
    stage_fn, fit_fn, link_fn, lower = _family_instance(seed, U, p, eff_low=0.3, with_lower=True)
    space = PipelineSpace(U, p, 4, micro_batches=(1, 2, 4, 8), budget=[None, 4.0, 2.5][seed % 3])
    rng = random.Random(seed)
    calls = {"eager": 0, "lazy": 0}

    def counted(tag):
        def fn(a, b, q, m):
            calls[tag] += 1
            return lower(a, b, q, m)
        return fn

    shrink: dict = {}

    def bound(chunks, q, m):
        f = shrink.setdefault((tuple(chunks), q, m), rng.choice([1.0, 0.999, 0.9, 0.5, 0.0]))
        return max(lower(a, b, q, m) for a, b in chunks) * f

    for limit in (2, 5, 16):
        eager = _costed(space, stage_fn, link_fn, fit_fn, counted("eager"), (1, 2, 4, 8), limit)
        lazy = _costed(space, stage_fn, link_fn, fit_fn, counted("lazy"), (1, 2, 4, 8), limit, bound)
        assert lazy[1] == eager[1] and lazy[2] == eager[2] and lazy[3] == eager[3]
        assert _same_seeds(lazy[0], eager[0])
        assert eager[1]
    assert calls["lazy"] <= calls["eager"]


@pytest.mark.parametrize("limit", [3, 16])
def test_lazy_seeds_same_on_a_real_model(limit):
    """A 3-layer GPT on 32 H100 with memory choices: the seeds with the floors' device-seconds bound first are
    those of the exact estimates computed up front (same candidates in the same order, same plans), and fewer
    (q, m) floors are computed for them."""
    def model():
        return ModelStages(_gpt, 32, preset("h100", 32), {"cutoff": 1}, periodic=True, memory_choices=True)

    ms = (1, 2, 4, 8)
    space = PipelineSpace(model().num_units, 32, 8, ms, preset("h100", 32).memory_bytes, None, False, ())
    st, lazy_st = model(), model()
    floors, lazy_floors = UnitFloors(st), UnitFloors(lazy_st)
    eager = _costed(space, st.stage_cost, st.link_time, st.fit_cost, floors.segment, ms, limit)
    lazy = _costed(space, lazy_st.stage_cost, lazy_st.link_time, lazy_st.fit_cost, lazy_floors.segment, ms, limit,
                   lazy_floors.chunking_lower)
    assert eager[1] and lazy[1] == eager[1] and lazy[2] == eager[2] and lazy[3] == eager[3]
    assert _same_seeds(lazy[0], eager[0])
    assert len(lazy_floors._pre) <= len(floors._pre)
    for key in lazy_floors._pre:
        assert np.array_equal(lazy_floors._pre[key], floors._pre[key])
