"""What the pipeline search takes from outside its space: an incumbent (the one-program plan's step) and the one
program's proven bound at one micro-batch; and m = 1, where the floor alone decides."""

from __future__ import annotations

import dataclasses
import random

import pytest

from shardplan.pipeline.progress import Progress
from shardplan.pipeline.search import PipelineSpace, StageCost, brute_force_pipeline, search_pipeline


def _instance(seed: int, U: int, p: int):
    rng = random.Random(seed)
    unit = [rng.uniform(0.5, 2.0) for _ in range(U)]
    mem = [rng.uniform(1.0, 3.0) for _ in range(U)]
    eff = {q: rng.uniform(0.6, 1.0) for q in range(1, p + 1)}

    def stage_fn(a, b, q, m):
        w = sum(unit[a:b])
        t = w / (q * eff[q]) / m + 0.01 * (b - a)
        return StageCost(t / 3, 2 * t / 3, sum(mem[a:b]) / q, w / m / q, None, 0.02 / q, 0.03 / q, t / 3)

    calls: list[tuple] = []

    def fit_fn(a, b, q, m, k, budget):
        """Slower by the memory excess, fits the budget (monotone in the extent, never below the plain stage)."""
        calls.append((a, b, q, m, k))
        c = stage_fn(a, b, q, m)
        s = 1.0 + 0.3 * max(0.0, c.memory(k) / budget - 1.0)
        return dataclasses.replace(c, forward=c.forward * s, backward=c.backward * s,
                                   weight_bytes=min(c.weight_bytes, budget / 2),
                                   activation_bytes=min(c.activation_bytes, budget / (2 * k)))

    return stage_fn, fit_fn, calls


def _exchange(nbytes, inter):
    return (0.02 if inter else 0.005) + nbytes * (4.0 if inter else 1.0)


@pytest.mark.parametrize("seed", range(6))
def test_m1_with_stand_ins_equals_brute_force(seed):
    """At m = 1 the floor's stand-ins are solved until its pipeline is real: brute force's optimum, and the part's
    bound is the optimum (every solve exact)."""
    U, p, ns = 5, 8, 4
    stage_fn, fit_fn, _ = _instance(seed, U, p)
    budget = [1.5, 2.5, 4.0][seed % 3]
    space = PipelineSpace(U, p, ns, micro_batches=(1,), budget=budget)
    want = brute_force_pipeline(space, stage_fn, lambda *a: 0.0, exchange=_exchange, fit_fn=fit_fn)
    got = search_pipeline(space, stage_fn, lambda *a: 0.0, schedules=("1f1b",), exchange=_exchange, fit_fn=fit_fn)
    assert got.step_time == pytest.approx(want.step_time, rel=1e-12)
    assert got.lower_bound == pytest.approx(got.step_time, rel=1e-9)
    assert got.stats["candidates"] == 0  # no bottleneck bound is enumerated at m = 1


@pytest.mark.parametrize("seed", range(6))
def test_outside_incumbent_prunes_and_bounds(seed):
    """An incumbent held by the progress before the search: above the optimum, the same answer; below it, None,
    with ``progress.bound`` a proven lower bound of the pipeline optimum (at most it, at most the incumbent)."""
    U, p, ns = 5, 8, 4
    stage_fn, fit_fn, _ = _instance(seed, U, p)
    space = PipelineSpace(U, p, ns, micro_batches=(1, 2, 4), budget=2.5)
    kw = dict(schedules=("1f1b", "zb-h1"), exchange=_exchange, fit_fn=fit_fn)
    free = search_pipeline(space, stage_fn, lambda *a: 0.0, **kw)
    above = Progress()
    above.improved(free.step_time * 1.05)
    got = search_pipeline(space, stage_fn, lambda *a: 0.0, progress=above, **kw)
    assert got is not None and got.step_time == pytest.approx(free.step_time, rel=1e-12)
    below = Progress()
    below.improved(free.step_time * 0.97)
    assert search_pipeline(space, stage_fn, lambda *a: 0.0, progress=below, **kw) is None
    assert below.bound <= free.step_time * (1 + 1e-12) and below.bound <= free.step_time * 0.97 * (1 + 1e-12)
    assert below.bound >= free.step_time * 0.97 * (1 - 1e-9)  # every solve exact: the incumbent is proven


@pytest.mark.parametrize("seed", range(4))
def test_one_program_bound_spares_the_whole_model_solve(seed):
    """With the one program's step as the incumbent and its proven bound at m = 1 as the whole-model stage's
    stand-in, m = 1 never solves that stage again; the pipelines found are brute force's where they win."""
    U, p, ns = 5, 8, 4
    stage_fn, fit_fn, calls = _instance(seed, U, p)
    space = PipelineSpace(U, p, ns, micro_batches=(1,), budget=[1.2, 1.6][seed % 2])
    whole = fit_fn(0, U, p, 1, 1, space.budget)
    calls.clear()
    assert stage_fn(0, U, p, 1).memory(1) > space.budget  # the whole model needs its memory choices
    prog = Progress()
    prog.improved(whole.time)
    got = search_pipeline(space, stage_fn, lambda *a: 0.0, schedules=("1f1b",), exchange=_exchange, fit_fn=fit_fn,
                          progress=prog, one_program_lower=whole.time)
    assert (0, U, p, 1, 1) not in calls
    want = brute_force_pipeline(space, stage_fn, lambda *a: 0.0, exchange=_exchange, fit_fn=fit_fn)
    if want.step_time < whole.time * (1 - 1e-9):
        assert got is not None and got.step_time == pytest.approx(want.step_time, rel=1e-12)
    else:
        assert got is None and prog.bound >= want.step_time * (1 - 1e-9)


def test_whole_model_stage_at_m1_is_the_one_program():
    """The pipeline search's whole model as one stage on every device at m = 1 (k = 1) under a budget is the
    one-program memory-constrained problem with one micro-batch: the same optimum, and the bound the planner
    hands over (:func:`shardplan.planner._one_micro_batch_bound`) is a proven lower bound of that stage."""
    from shardplan.fit import FitOptions, solve_fit
    from shardplan.machine import preset
    from shardplan.models import model_spec
    from shardplan.pipeline.stages import ModelStages
    from shardplan.planner import _one_micro_batch_bound

    spec = model_spec("gpt")

    def build(b):
        return spec.build(b, layers=4)

    budget = 2.0 * 2**30
    machine = dataclasses.replace(preset("a100", 16), memory_bytes=budget)
    stages = ModelStages(build, spec.batch, machine, {"cutoff": spec.cutoff}, periodic=True, memory_choices=True)
    U = stages.num_units
    assert stages.stage_cost(0, U, 16, 1).memory(1) > budget  # the time-optimal plan does not fit
    stage = stages.fit_cost(0, U, 16, 1, 1, budget)
    one = solve_fit(build(spec.batch), machine, budget=budget, options=FitOptions(micro_batches=(1, 2)),
                    cutoff=spec.cutoff)
    per = {x["micro_batches"]: x for x in one.solution.stats["per_micro_batches"]}
    alone = solve_fit(build(spec.batch), machine, budget=budget, options=FitOptions(micro_batches=(1,)),
                      cutoff=spec.cutoff)
    assert stage.time == pytest.approx(alone.solution.cost, rel=1e-12)
    lower = _one_micro_batch_bound(one)
    assert lower is not None and lower <= stage.time * (1 + 1e-12)
    assert 1 in per


def test_stage_caches_released_after_each_micro_batch_count(monkeypatch):
    """pipeline_solve releases the stage costs of each micro-batch count once its parts are done: afterwards the
    model's stage caches are empty, and the plan is the one found with every cache kept."""
    import shardplan.pipeline.api as api
    from shardplan.machine import preset
    from shardplan.models import model_spec
    from shardplan.pipeline.api import pipeline_solve

    spec = model_spec("gpt")

    def build(b):
        return spec.build(b, layers=4)

    machine = preset("a100", 16)
    got = pipeline_solve(build, 16, machine, micro_batches=(1, 2, 4), schedules=("1f1b", "zb-h1"))
    assert not got.stages._cache and not got.stages._tables and not got.stages._cuts
    kept = api.search_pipeline
    monkeypatch.setattr(api, "search_pipeline", lambda *a, **k: kept(*a, **{**k, "release": None}))
    again = pipeline_solve(build, 16, machine, micro_batches=(1, 2, 4), schedules=("1f1b", "zb-h1"))
    assert again.stages._cache  # kept: the release is what emptied them
    assert got.plan.step_time == again.plan.step_time
    assert [(s.first, s.end, s.devices) for s in got.plan.stages] == [(s.first, s.end, s.devices)
                                                                        for s in again.plan.stages]


def test_ctrl_c_inside_a_stage_memory_search_stops_the_pipeline_search(monkeypatch):
    """The fit search returns its best plan on Ctrl-C (marked interrupted); inside a pipeline stage that would
    stop only that stage's solve, so the stage passes the interrupt on: one Ctrl-C stops the pipeline search."""
    import shardplan.fit
    from shardplan.machine import preset
    from shardplan.models import model_spec
    from shardplan.pipeline.stages import ModelStages

    spec = model_spec("gpt")

    def build(b):
        return spec.build(b, layers=4)

    budget = 2.0 * 2**30
    machine = dataclasses.replace(preset("a100", 16), memory_bytes=budget)
    real = shardplan.fit.solve_fit

    def interrupted(*args, **kwargs):
        got = real(*args, **kwargs)
        got.solution.stats["interrupted"] = True  # as a Ctrl-C that landed after the solve had a plan leaves it
        return got

    def stages():
        return ModelStages(build, spec.batch, machine, {"cutoff": spec.cutoff}, periodic=True, memory_choices=True)

    U = stages().num_units
    assert stages().fit_cost(0, U, 16, 1, 1, budget) is not None
    monkeypatch.setattr(shardplan.fit, "solve_fit", interrupted)
    with pytest.raises(KeyboardInterrupt):
        stages().fit_cost(0, U, 16, 1, 1, budget)
