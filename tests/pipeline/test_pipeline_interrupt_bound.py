"""A real bound whenever the search stops early (docs/pipeline.md, *A bound whenever the search stops*): the one
program's work floor bounds every one-program plan the memory search can cost, and ``shardplan.plan`` interrupted
anywhere (the seeds, the one program's memory search, the pipeline search) states a bound above 0 and at most
the optimum the finished search proves."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shardplan.fit import FitOptions, solve_fit
from shardplan.machine import preset
from shardplan.models import get_model
from shardplan.pipeline.stages import ModelStages, graph_device_seconds
from shardplan.planner import _one_program_floor, _pipeline_floor, plan

SMALL = dict(sizes={"layers": 2}, batch=8, micro_batches=(1, 2), stages=True)
# a budget that forces ZeRO or recomputation on some count, and slow links so pipelines compete
TIGHT = dict(sizes={"layers": 2, "d_model": 64}, batch=8, micro_batches=(1, 2, 4), stages=True, budget=2**27)


def test_graph_device_seconds_is_the_stages_device_seconds():
    """The pure function over a graph's operators is what the stage model sums over its units."""
    m = preset("h100", 8)
    stages = ModelStages(lambda b: get_model("gpt", b, layers=2), 8, m)
    for count in (1, 2, 8):
        g, units, _ = stages.graph(count)
        assert stages.device_seconds(count) == graph_device_seconds(g, m)
        assert stages.device_seconds(count, 1, 3) == graph_device_seconds(g, m, [i for u in (1, 2) for i in units[u]])
        assert stages.device_seconds(count, forward=True) == graph_device_seconds(g, m, forward=True)


@pytest.mark.parametrize("budget_gib, fp8", [(None, False), (0.06, False), (0.06, True)])
def test_one_program_floor_bounds_every_count_and_memory_choice(budget_gib, fp8):
    """Each micro-batch count's memory-constrained optimum (ZeRO stages and recomputation taken where the budget
    forces them; FP8 offered on the h100) is at least the one program's work floor, which is positive; with FP8
    offered the floor is at the faster rate, so below the plain one."""
    m = preset("h100", 8)
    g = get_model("gpt", 16, layers=2, d_model=256)
    budget = m.memory_bytes if budget_gib is None else budget_gib * 2**30
    opts = FitOptions(micro_batches=(1,), fp8=fp8)
    floor = _one_program_floor(g, m, opts)
    assert floor > 0
    if fp8:
        assert floor < _one_program_floor(g, m, None)
    took = set()
    for count in (1, 2, 4, 8):
        sp = solve_fit(g, m, budget=budget, options=replace(opts, micro_batches=(count,)), cutoff=1)
        assert sp.cost >= floor * (1 - 1e-12)
        mc = sp.memory_choices
        took |= {("zero", mc.stage(i) > 0) for i in range(len(g.operators))}
        took |= {("recompute", mc.recompute(i)) for i in range(len(g.operators))}
        took |= {("fp8", mc.fp8(i)) for i in range(len(g.operators))}
    if budget_gib is not None:  # the tight budget does make the optimum take memory choices
        assert ("zero", True) in took or ("recompute", True) in took
    if fp8:
        assert ("fp8", True) in took


def test_pipeline_floor_is_the_least_step_floor():
    m = preset("a100", 4)
    build = lambda b: get_model("gpt", b, layers=2)  # noqa: E731
    stages = ModelStages(build, 8, m)
    got = _pipeline_floor(None, build, 8, m, (1, 2, 3, 4))  # 3 does not divide 8: skipped
    assert got == min(stages.step_floor(c) for c in (1, 2, 4)) and got > 0
    assert _pipeline_floor(stages, build, 8, m, (2, 4)) == min(stages.step_floor(c) for c in (2, 4))


def _interrupts(monkeypatch, machine, kw, every=1):
    """The plans ``plan("gpt", machine, **kw)`` returns with the exact solver raising KeyboardInterrupt at its k-th
    call, for every ``every``-th k until one runs to the end (None where the interrupt propagated: no plan yet)."""
    import shardplan.search.dp as dp

    real = dp.solve_dp
    out = []
    k = 1
    while True:
        calls = [0]

        def counted(*a, _k=k, **kw2):
            calls[0] += 1
            if calls[0] == _k:
                raise KeyboardInterrupt
            return real(*a, **kw2)

        monkeypatch.setattr(dp, "solve_dp", counted)
        try:
            got = plan("gpt", machine, **kw)
        except KeyboardInterrupt:
            got = None
        out.append(got)
        if calls[0] < k:  # the search ended before the k-th call: nothing was interrupted
            return out
        k += every


@pytest.mark.parametrize("case", ["small", "tight"])
def test_an_interrupt_anywhere_states_a_positive_bound_below_the_optimum(monkeypatch, case):
    """The planner interrupted at every exact solve (the first ones before any plan: the interrupt propagates):
    every plan returned states a bound above 0 (the step floor of the pipelines, the one program's work floor, or
    what the searches proved) and at most the optimum, which the finished search proves (gap <= 1e-9)."""
    if case == "small":
        machine, kw, every = preset("a100", 4), SMALL, 1
    else:
        machine, kw, every = replace(preset("a100", 4), inter_bandwidth=1e9), TIGHT, 6
    got = _interrupts(monkeypatch, machine, kw, every)
    # the last run made fewer exact solves than its k: nothing interrupted it, so it is the finished search (the
    # same calls as plan("gpt", machine, **kw) without the counter; not run a second time)
    full = got[-1]
    assert full is not None and not full.stats["interrupted"]
    assert full.gap is not None and full.gap <= 1e-9 * (1 + 1e-6)  # the search's tolerance, up to rounding
    assert got[0] is None  # at once: no plan yet
    plans = [p for p in got if p is not None]
    assert len(plans) >= 2
    for p in plans:
        assert p.step_time >= full.step_time * (1 - 1e-9)
        assert 0.0 < p.lower_bound <= full.step_time * (1 + 1e-12), (p.lower_bound, full.step_time, p.stats["refused"])
    # the early stops are interrupted plans whose bound comes from the floors alone
    assert any(p.stats["interrupted"] for p in plans)
