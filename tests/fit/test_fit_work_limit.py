"""The fit search stops by counted work, not by the clock: the same answer on an idle and a busy machine.

A busy machine is a slow clock's mirror image: the clocks the search could read are patched to run 100
times fast, or to jump 1,000 s at every reading (any wall-clock or CPU-time check in the search then fires
at its first look), and every answer must equal the one under the real clock. A small work budget stops a
search early with a proven bound, the same twice; an explicit wall-clock limit still stops it.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

from randgraphs import peak_problem, random_problem
from shardplan.cost import build_tables
from shardplan.errors import ShardplanError
from shardplan.fit import FitOptions, solve_fit
from shardplan.machine import Machine
from shardplan.search.constrained import (WORK_LIMIT, MemoryProblem, solve_memory, solve_memory_bruteforce,
                                          solve_work)
from shardplan.search.peak import solve_peak, solve_peak_bruteforce

F, B = 1e12, 1e10
CLOCKS = ("perf_counter", "monotonic", "process_time", "time")


def _patch_clocks(monkeypatch, how: str) -> None:
    """Every clock of the ``time`` module (the search modules call ``time.<clock>()``) made fast: ``"100x"``
    runs 100 times faster than the real one, ``"jump"`` advances 1,000 s at each reading."""
    for name in CLOCKS:
        real = getattr(time, name)
        if how == "100x":
            start = real()
            monkeypatch.setattr(time, name, lambda real=real, start=start: start + 100.0 * (real() - start))
        else:
            ticks = itertools.count()
            monkeypatch.setattr(time, name, lambda real=real, ticks=ticks: real() + 1000.0 * next(ticks))


def memory_problem(seed: int, tight: float) -> MemoryProblem:
    """A random problem with 1-3 choices per configuration and a budget ``tight`` of the way from the least
    memory to the unconstrained optimum's (as tests/fit/test_search_memory.py builds them)."""
    p = random_problem(seed, n_max=7, k_max=4)
    rng = np.random.default_rng(1000 + seed)
    base, cost, mem = [], [], []
    for v, k in enumerate(p.sizes):
        b = np.repeat(np.arange(k), rng.integers(1, 4, size=k))
        base.append(b)
        cost.append((p.vertex_cost[v][b] + np.where(np.arange(len(b)) % 2 == 1, rng.integers(0, 3, len(b)), 0))
                    .astype(float))
        mem.append(rng.integers(0, 10, size=len(b)).astype(float))
    loose = MemoryProblem(p, tuple(base), tuple(cost), tuple(mem), budget=1e9, fixed=3.0)
    top = loose.evaluate(solve_memory(loose).assignment)[1]
    least = loose.least_memory()
    return MemoryProblem(p, tuple(base), tuple(cost), tuple(mem), budget=float(np.floor(least + tight * (top - least))),
                         fixed=3.0)


# the branch-and-bound alone (no closures by knapsack or front program): searches of several nodes
PLAIN = {"separable": 0, "frontier": 0, "mix": False}


def _branched(count: int) -> list[MemoryProblem]:
    """The first ``count`` random problems whose plain search needs more than two nodes."""
    out = []
    for seed in range(200):
        mp = memory_problem(seed, 0.5)
        if solve_memory(mp, **PLAIN).stats["nodes"] > 2:
            out.append(mp)
            if len(out) == count:
                return out
    raise AssertionError("too few random problems branch")


def _answer(sol) -> tuple:
    return (sol.cost, tuple(sol.assignment), sol.bound, sol.optimal, sol.stats["status"], sol.stats["nodes"],
            sol.stats["work"])


def _tiny_gpt():
    from shardplan.models import get_model

    return get_model("gpt", batch=8, layers=2, d_model=64, heads=2, seq=32, vocab=256)


def _fit_setup(frac: float):
    g = _tiny_gpt()
    m = Machine(4, peak_flops=F, bandwidth=B, latency=1e-6, memory_bytes=1e12)
    tables = build_tables(g, m, orders="row-major")
    free = solve_fit(g, m, tables=tables, options=FitOptions(micro_batches=(1,)))
    return g, m, tables, frac * free.memory["peak_bytes"]


def _fit_answer(plan) -> tuple:
    s = plan.solution
    return (plan.cost, tuple(plan.assignment), tuple(plan.memory_choices.choices), plan.memory_choices.micro_batches,
            s.bound, s.optimal, s.stats["status"], s.stats["work"],
            tuple((d["micro_batches"], d["status"]) for d in s.stats["per_micro_batches"]))


@pytest.mark.parametrize("how", ["100x", "jump"])
def test_solve_memory_answers_the_same_with_a_fast_clock(monkeypatch, how):
    problems = _branched(3)
    for mode in (PLAIN, {}):
        want = [_answer(solve_memory(mp, **mode)) for mp in problems]
        with monkeypatch.context() as mpatch:
            _patch_clocks(mpatch, how)
            got = [_answer(solve_memory(mp, **mode)) for mp in problems]
        assert got == want
        assert all(a[3] for a in want)  # proven under the default budget


@pytest.mark.parametrize("how", ["100x", "jump"])
def test_solve_fit_answers_the_same_with_a_fast_clock(monkeypatch, how):
    g, m, tables, budget = _fit_setup(0.5)
    opts = FitOptions(micro_batches=(1, 2, 4, 8))  # several counts: the solve-free count bounds and their share
    want = _fit_answer(solve_fit(g, m, budget=budget, tables=tables, options=opts))
    with monkeypatch.context() as mpatch:
        _patch_clocks(mpatch, how)
        got = _fit_answer(solve_fit(g, m, budget=budget, tables=tables, options=opts))
    assert got == want and want[5]


def test_planner_answers_the_same_with_a_jumping_clock(monkeypatch):
    from shardplan.machine import preset
    from shardplan.planner import plan

    def run():
        p = plan("gpt", preset("h100", 8), sizes={"layers": 2}, batch=16, budget=6e8, stages=False)
        return p.to_json()

    want = run()
    with monkeypatch.context() as mpatch:
        _patch_clocks(mpatch, "jump")
        got = run()
    strip = ("seconds", "plan_seconds")

    import json

    def scrub(x):
        if isinstance(x, dict):
            return {k: scrub(v) for k, v in x.items() if not any(w in k for w in strip)}
        if isinstance(x, list):
            return [scrub(v) for v in x]
        return x

    assert scrub(json.loads(got)) == scrub(json.loads(want))


def test_a_small_work_budget_stops_with_a_sound_bound_the_same_twice():
    stopped = 0
    for mp in _branched(4):
        ref = solve_memory_bruteforce(mp)
        one_solve = solve_work(mp.problem)  # what one Lagrangian solve of the root is charged
        first = solve_memory(mp, work_limit=one_solve, **PLAIN)
        again = solve_memory(mp, work_limit=one_solve, **PLAIN)
        assert _answer(first) == _answer(again)
        f, mem = mp.evaluate(first.assignment)
        assert mem <= mp.budget and f == first.cost
        assert first.bound <= ref.cost * (1 + 1e-12) <= f * (1 + 1e-12)
        if not first.optimal:
            stopped += 1
            assert first.stats["status"] == f"stopped at the work limit {one_solve:g}"
            assert first.stats["nodes"] == 1 and first.stats["work"] >= one_solve
            assert first.stats["gap"] == pytest.approx((f - first.bound) / f)
    assert stopped >= 2


def test_work_is_the_sum_of_its_parts_and_fixing_is_charged():
    """Every charge goes to one kind: the Lagrangian solves (their bound pruning's sweeps and passes included),
    the points taken from the store, the reduced-cost fixing and the frontier programs; fixing is charged
    when it runs and not otherwise, and a search repeated with the first one's stored points charges them as
    stored, exactly what their solves were."""
    for mp in _branched(3):
        sol = solve_memory(mp, **PLAIN)
        parts = sol.stats["work_parts"]
        assert sum(parts.values()) == pytest.approx(sol.stats["work"], rel=1e-12)
        assert parts["fix"] > 0 and parts["dp"] > 0 and parts["dp_stored"] == 0 and parts["frontier"] == 0
        assert solve_memory(mp, fix_iters=-1, **PLAIN).stats["work_parts"]["fix"] == 0
        store: dict = {}
        root = solve_memory(mp, max_nodes=1, fix_iters=-1, solved=store, **PLAIN)
        again = solve_memory(mp, max_nodes=1, fix_iters=-1, solved=store, **PLAIN)
        assert again.stats["dp_solves"] == 0
        assert again.stats["work_parts"]["dp_stored"] == root.stats["work_parts"]["dp"] > 0
        assert again.stats["work"] == root.stats["work"]


def test_the_frontier_program_gives_up_at_the_work_budget():
    """The root's front program (the node closure) needs more work than one solve: within that budget it gives
    up (the node is branched, nothing proven from it), with a large one it closes the node."""
    for mp in _branched(3):
        big = solve_memory(mp, separable=0, mix=False)
        small = solve_memory(mp, separable=0, mix=False, work_limit=0.0)
        assert big.optimal and small.stats["nodes"] == 1
        assert small.bound <= big.cost * (1 + 1e-12)
        assert small.stats["frontier_nodes"] == 0
        assert _answer(small) == _answer(solve_memory(mp, separable=0, mix=False, work_limit=0.0))


def test_solve_fit_with_a_small_work_budget_is_sound_and_repeatable():
    g, m, tables, budget = _fit_setup(0.5)
    full = solve_fit(g, m, budget=budget, tables=tables, options=FitOptions(micro_batches=(1, 2)))
    assert full.solution.optimal
    opts = FitOptions(micro_batches=(1, 2), work_limit=0.0)
    first = solve_fit(g, m, budget=budget, tables=tables, options=opts)
    assert _fit_answer(first) == _fit_answer(solve_fit(g, m, budget=budget, tables=tables, options=opts))
    assert first.solution.bound <= full.cost * (1 + 1e-12) <= first.cost * (1 + 1e-12)
    assert first.memory["peak_bytes"] <= budget


def test_solve_peak_work_budget_and_fast_clock(monkeypatch):
    checked = stopped = 0
    for seed in range(40):
        pp = peak_problem(seed, 0.5)
        if pp.additive().least_memory() > pp.budget:
            continue  # no incumbent without a search: a stopped search may have no plan
        try:
            ref = solve_peak_bruteforce(pp)
        except ShardplanError:
            continue
        want = solve_peak(pp)
        with monkeypatch.context() as mpatch:
            _patch_clocks(mpatch, "jump")
            got = solve_peak(pp)
        assert (got.cost, got.assignment, got.bound, got.stats["status"]) == \
            (want.cost, want.assignment, want.bound, want.stats["status"])
        assert want.optimal and want.cost == pytest.approx(ref.cost, abs=1e-9)
        small = solve_peak(pp, work_limit=0.0, max_cuts=2)
        again = solve_peak(pp, work_limit=0.0, max_cuts=2)
        assert (small.cost, small.assignment, small.bound) == (again.cost, again.assignment, again.bound)
        assert small.bound <= ref.cost + 1e-9 <= small.cost + 1e-9
        stopped += not small.optimal
        if not small.optimal:
            assert small.stats["status"] == "stopped at the work limit 0"
        checked += 1
    assert checked >= 5 and stopped >= 1


def test_an_explicit_time_limit_still_stops_the_search(monkeypatch):
    problems = _branched(2)
    refs = [solve_memory_bruteforce(mp) for mp in problems]
    g, m, tables, budget = _fit_setup(0.5)
    with monkeypatch.context() as mpatch:
        _patch_clocks(mpatch, "jump")
        for mp, ref in zip(problems, refs):
            sol = solve_memory(mp, time_limit=60.0, **PLAIN)
            assert not sol.optimal and sol.stats["status"] == "stopped at the time limit 60 s"
            assert sol.stats["nodes"] == 1 and sol.bound <= ref.cost * (1 + 1e-12) <= sol.cost * (1 + 1e-12)
        timed = solve_fit(g, m, budget=budget, tables=tables,
                          options=FitOptions(micro_batches=(1,), time_limit=60.0))
    free = solve_fit(g, m, budget=budget, tables=tables, options=FitOptions(micro_batches=(1,)))
    assert free.solution.optimal
    assert timed.solution.bound <= free.cost * (1 + 1e-12) <= timed.cost * (1 + 1e-12)
    per = timed.solution.stats["per_micro_batches"]
    assert timed.solution.optimal or any("time limit" in str(d["status"]) for d in per)


def test_limits_are_checked():
    with pytest.raises(ShardplanError, match="work_limit must be at least 0"):
        FitOptions(work_limit=-1)
    with pytest.raises(ShardplanError, match="work_limit must be a finite number"):
        FitOptions(work_limit=float("nan"))
    with pytest.raises(ShardplanError, match="time_limit must be positive"):
        FitOptions(time_limit=0.0)
    with pytest.raises(ShardplanError, match="time_limit must be a number"):
        FitOptions(time_limit="60")
    assert FitOptions().time_limit is None and FitOptions().work_limit == WORK_LIMIT
    mp = memory_problem(3, 0.5)
    with pytest.raises(ShardplanError, match="work_limit must be at least 0"):
        solve_memory(mp, work_limit=-5)
    with pytest.raises(ShardplanError, match="time_limit must be positive"):
        solve_memory(mp, time_limit=-1.0)
    with pytest.raises(ShardplanError, match="work_limit must be at least 0"):
        solve_peak(peak_problem(3, 0.5), work_limit=-1)
    from shardplan.pipeline.api import pipeline_solve

    with pytest.raises(ShardplanError, match="fit_work_limit must be at least 0"):
        pipeline_solve(lambda b: _tiny_gpt(), 8, Machine(4, peak_flops=F, bandwidth=B, memory_bytes=1e12),
                       fit_work_limit=-1.0)
