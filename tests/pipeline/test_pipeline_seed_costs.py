"""The seed phase's cheaper pieces give the same floats and plans as the direct computations: the step floor's
device-seconds from per-unit-kind terms, and the pipeline search's seeds in their lazy order (docs/pipeline.md,
*The seed phase's cost*)."""

from __future__ import annotations

import math

import pytest

from shardplan.machine import preset
from shardplan.models import get_model
from shardplan.pipeline import ModelStages, PipelineSpace
from shardplan.pipeline.floors import UnitFloors
from shardplan.pipeline.search import search_pipeline
from shardplan.pipeline.stages import graph_device_seconds
from tests.pipeline.test_pipeline_family import _instance as _family_instance


def _gpt(b: int):
    return get_model("gpt", b, layers=4, d_model=64, heads=4, seq=16, vocab=256)


def _llama(b: int):
    return get_model("llama3-tiny", b, layers=3)


@pytest.mark.parametrize("build", [_gpt, _llama])
@pytest.mark.parametrize("p", [32, 64])
def test_device_seconds_from_unit_kinds_equal_the_direct_sum(build, p):
    """Whole model, every unit range and forward only, at several m: the per-kind terms give exactly the float of
    graph_device_seconds over the same operators (so the step and forward floors are unchanged)."""
    st = ModelStages(build, 32, preset("h100", p))
    for m in (1, 2, 4, 8, 16):
        g, units, sigs = st.graph(m)
        assert len(set(sigs)) < len(sigs)  # some kinds recur: the memo is used
        for forward in (False, True):
            whole = graph_device_seconds(g, st.machine, forward=forward)
            assert st.device_seconds(m, forward=forward) == whole
            for a in range(len(units)):
                for b in range(a + 1, len(units) + 1):
                    ops = [i for u in range(a, b) for i in units[u]]
                    assert st.device_seconds(m, a, b, forward) == graph_device_seconds(g, st.machine, ops, forward)
        assert st.step_floor(m) == m * graph_device_seconds(g, st.machine) / p
        assert st.forward_floor(m) == graph_device_seconds(g, st.machine, forward=True) / p


def _same_plan(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return (a.step_time == b.step_time and a.schedule == b.schedule and a.micro_batches == b.micro_batches
            and [(s.first, s.end, s.devices) for s in a.stages] == [(s.first, s.end, s.devices) for s in b.stages]
            and a.lower_bound == b.lower_bound)


_SAME_STATS = ("seeds_costed", "seed_steps", "parts_done", "parts_total", "family_lower_bounds")


@pytest.mark.parametrize("seed", range(10))
def test_search_with_lazy_seeds_same_as_eager_on_random_instances(seed):
    """search_pipeline given chunking_lower (a bound of each chunking's estimate at a random fraction of the exact
    one, some equal): the same plan, bound, seeds and parts as without it, at several seed limits."""
    import random

    U, p = 8, 16
    stage_fn, fit_fn, link_fn, lower = _family_instance(seed, U, p, eff_low=0.3, with_lower=True)
    space = PipelineSpace(U, p, 4, micro_batches=(1, 2, 4, 8), budget=[None, 4.0, 2.5][seed % 3])
    rng = random.Random(seed)
    shrink: dict = {}

    def bound(chunks, q, m):
        f = shrink.setdefault((tuple(chunks), q, m), rng.choice([1.0, 0.999, 0.9, 0.5, 0.0]))
        return max(lower(a, b, q, m) for a, b in chunks) * f

    for limit in (2, 5, 16):
        runs = []
        for chunking_lower in (None, bound):
            try:
                plan = search_pipeline(space, stage_fn, link_fn, ("1f1b", "zb-h1"), fit_fn=fit_fn,
                                       stage_lower=lower, seeds=limit, chunking_lower=chunking_lower)
            except Exception as e:  # noqa: BLE001 (the same error both ways)
                plan = type(e).__name__
            runs.append(plan)
        eager, lazy = runs
        if isinstance(eager, str):
            assert lazy == eager
            continue
        assert _same_plan(lazy, eager)
        for k in _SAME_STATS:
            assert lazy.stats.get(k) == eager.stats.get(k), k


@pytest.mark.slow
def test_pipeline_solve_lazy_seeds_on_a_real_model():
    """A 4-layer GPT on 32 H100 with memory choices: pipeline_solve (which now gives the search the floors'
    chunking_lower) finds the plan and bound of the eager seed order, with the same seeds, and computes no more
    (q, m) floors than the eager order does."""
    from shardplan.pipeline.api import pipeline_solve

    machine = preset("h100", 32)
    ms = (1, 2, 4, 8)

    def solve(lazy: bool):
        st = ModelStages(_gpt, 32, machine, {"cutoff": 1}, periodic=True, memory_choices=True)
        floors = UnitFloors(st)
        if not lazy:
            floors.chunking_lower = None  # type: ignore[method-assign]  (the eager order: no bound given)
        got = pipeline_solve(_gpt, 32, machine, micro_batches=ms, max_stages=8, schedules=("1f1b", "zb-h1"),
                             memory_choices=True, cutoff=1, model=st, floors=floors)
        return got, floors

    (eager, fe), (lazy, fl) = solve(False), solve(True)
    assert _same_plan(lazy.plan, eager.plan)
    assert math.isfinite(lazy.plan.step_time)
    for k in _SAME_STATS:
        assert lazy.plan.stats.get(k) == eager.plan.stats.get(k), k
    assert lazy.plan.stats.get("seeds_costed")
    assert len(fl._pre) <= len(fe._pre)
