"""Sub-mesh sizes the cost model refuses (per-device tiles past its cap) are left out of the pipeline search, said
in one line, and the plan's lower bound stays a bound of the whole space: on a small GPT with the cap lowered to
4 devices (the size 6, whose tiles need per-device arrays, is refused), against the uncapped search and brute
force."""

from __future__ import annotations

import dataclasses
import functools

import pytest

from shardplan import preset
from shardplan.cost import build_tables
from shardplan.errors import PerDeviceLimitError
from shardplan.models import get_model
from shardplan.pipeline import PipelineSpace
from shardplan.pipeline.api import pipeline_solve
from shardplan.pipeline.progress import Progress
from shardplan.pipeline.search import brute_force_pipeline

MS = (1, 2)
BATCH = 12


def _build(b: int):
    return get_model("gpt", b, layers=2, d_model=48, heads=3, seq=12, vocab=96)


def _machine():
    return dataclasses.replace(preset("a100", 6), node_size=2)  # sub-meshes 1, 2, 4 and 6 (3 nodes: not 2^k)


@functools.cache
def _solved(cap: int | None, sizes: tuple[int, ...] | None = None):
    lines: list[str] = []
    opts = {} if cap is None else {"max_devices": cap}
    res = pipeline_solve(_build, BATCH, _machine(), micro_batches=MS, sizes=sizes, refused=lines.append, **opts)
    return res, lines


@functools.cache
def _brute():
    """The 1F1B optimum over every cut, sub-mesh sequence and m of the whole space, uncapped."""
    res, _ = _solved(None)
    st = res.stages
    space = PipelineSpace(st.num_units, 6, 2, MS, res.machine.memory_bytes)
    return brute_force_pipeline(space, st.stage_cost, st.link_time, exchange=st.exchange_time)


def test_the_cap_is_a_parameter_of_the_build():
    g = _build(BATCH)
    with pytest.raises(PerDeviceLimitError, match="at most 4 devices"):
        build_tables(g, _machine(), max_devices=4)
    assert len(build_tables(g, _machine(), max_devices=6).edge_costs) == len(g.edges)


def test_a_refused_size_is_left_out_and_said_in_one_line():
    capped, lines = _solved(4)
    stats = capped.plan.stats
    assert stats["sizes_not_searched"] == [6]
    why = stats["sizes_not_searched_why"]
    assert lines == [why] and "\n" not in why
    assert why.startswith("1 sub-mesh size (6) not searched") and "at most 4 devices" in why
    assert all(s.devices != 6 for s in capped.plan.stages)
    # the searched space is the space without size 6: the same optimum as the search told to skip it
    restricted, none = _solved(None, (1, 2, 4))
    assert none == [] and "sizes_not_searched" not in restricted.plan.stats
    assert capped.step_time == pytest.approx(restricted.step_time, rel=1e-12)
    # uncapped, nothing is refused and the optimum is the brute force's (here it uses all 6 devices)
    full, nothing = _solved(None)
    assert nothing == [] and "sizes_not_searched" not in full.plan.stats
    brute = _brute()
    assert full.step_time == pytest.approx(brute.step_time, rel=1e-9)
    assert [s.devices for s in brute.stages] == [6] and capped.step_time > brute.step_time * 1.01


def test_the_bound_covers_the_sizes_left_out():
    capped, _ = _solved(4)
    restricted, _ = _solved(None, (1, 2, 4))
    brute = _brute()
    # the restricted space's own bound is not a bound of the whole space (its optimum needs 6 devices) ...
    assert restricted.plan.lower_bound > brute.step_time
    # ... the capped search's is: the step floor of the counts at which a stage was refused joins it
    floor = capped.plan.stats["refused_floor"]
    assert floor == min(capped.stages.step_floor(m) for m in MS)
    assert capped.plan.lower_bound == min(restricted.plan.lower_bound, floor)
    assert 0 < capped.plan.lower_bound <= brute.step_time


def test_an_interrupt_states_a_bound_of_the_whole_space():
    """Ctrl-C (a KeyboardInterrupt from the progress callback at its n-th tick, n = 1, 9, 17, ...) before any plan
    (the bound goes to the caller) and after a refusal (the best plan so far): either way a bound of the whole
    space."""
    optimum = _brute().step_time
    before = after = False
    for n in range(1, 400, 8):
        def stop(ticks: int, _n: int = n) -> None:
            if ticks >= _n:
                raise KeyboardInterrupt

        progress = Progress(on_tick=stop)
        try:
            res = pipeline_solve(_build, BATCH, _machine(), micro_batches=MS, max_devices=4, progress=progress)
        except KeyboardInterrupt:
            before = True
            assert progress.space_bound is not None and 0 < progress.space_bound <= optimum
            continue
        if not res.plan.stats.get("interrupted"):
            break  # past the last tick: the search finished
        assert res.step_time >= res.plan.lower_bound and 0 < res.plan.lower_bound <= optimum
        after = after or res.plan.stats.get("sizes_not_searched") == [6]
    assert before and after


def test_memory_constrained_stages_and_every_schedule_under_the_cap():
    """With memory choices (a budget half the time-optimal plan's peak) and ZB-H1 and interleaved 1F1B searched too,
    the capped search answers what the search without size 6 answers, and its bound is below the uncapped
    optimum."""
    free, _ = _solved(None)
    budget = 0.5 * max(s.memory for s in free.plan.stages)
    opts = dict(micro_batches=MS, interleave=(2,), schedules=("1f1b", "interleaved", "zb-h1"), memory_choices=True,
                budget=budget)
    full = pipeline_solve(_build, BATCH, _machine(), **opts)
    capped = pipeline_solve(_build, BATCH, _machine(), max_devices=4, **opts)
    restricted = pipeline_solve(_build, BATCH, _machine(), sizes=(1, 2, 4), **opts)
    assert capped.plan.stats["fit_evaluations"] > 0 and capped.plan.stats["sizes_not_searched"] == [6]
    assert capped.step_time == pytest.approx(restricted.step_time, rel=1e-12)
    assert capped.plan.schedule == restricted.plan.schedule
    assert capped.plan.lower_bound <= full.step_time <= capped.step_time
