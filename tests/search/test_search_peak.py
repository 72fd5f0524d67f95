"""The backward-peak memory search (surrogate relaxation + branch-and-bound) against brute force and the ILP."""

from __future__ import annotations

import numpy as np
import pytest

from randgraphs import peak_problem, random_problem
from shardplan.errors import ShardplanError
from shardplan.search.constrained import MemoryProblem, solve_memory
from shardplan.search.peak import (PeakProblem, backward_profile, solve_peak, solve_peak_bruteforce,
                                   surrogate_weights)

pytestmark = pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out


def test_profile_by_hand():
    # three operators in forward order; the backward visits 2, 1, 0
    rest, saved, grad = np.array([1.0, 2.0, 3.0]), np.array([10.0, 20.0, 30.0]), np.array([100.0, 200.0, 300.0])
    prof = backward_profile(rest, saved, grad, fixed=5.0)
    # k = 0: rest 6 + saved of 0 (10) + grads of 0, 1, 2 (600); k = 1: 6 + 30 + 500; k = 2: 6 + 60 + 300
    assert prof.tolist() == [5 + 6 + 10 + 600, 5 + 6 + 30 + 500, 5 + 6 + 60 + 300]
    s, p = surrogate_weights(np.array([0.2, 0.3, 0.5]))
    assert s.tolist() == pytest.approx([1.0, 0.8, 0.5]) and p.tolist() == pytest.approx([0.2, 0.5, 1.0])
    # the surrogate constraint is the weighted mean of the profile, per operator
    assert float((rest + s * saved + p * grad).sum() + 5) == pytest.approx(float(np.dot([0.2, 0.3, 0.5], prof)))
    # the ILP's rows (PeakProblem.contribution) are the same profile, built per step
    from shardplan.search.problem import Problem

    one = Problem(names=("a", "b", "c"), configs=(((1,),),) * 3, vertex_cost=(np.zeros(1),) * 3, edges=(),
                  edge_cost=())
    col = lambda x: tuple(np.array([float(y)]) for y in x)  # noqa: E731
    pp = PeakProblem(one, (np.zeros(1, dtype=int),) * 3, (np.zeros(1),) * 3, col(rest), col(saved), col(grad),
                     budget=1e9, fixed=5.0)
    assert [5 + sum(float(c[0]) for c in pp.contribution(k)) for k in range(3)] == prof.tolist()
    assert pp.profile((0, 0, 0)).tolist() == prof.tolist() and pp.least_peak() == prof.max() == 621


def solved_against_bruteforce(pp):
    """``(solve_peak's solution, brute force's)`` on ``pp``, the search's plan optimal, within the budget and of
    brute force's cost; None where brute force finds no plan that fits (the search then refuses too)."""
    try:
        ref = solve_peak_bruteforce(pp)
    except ShardplanError:
        with pytest.raises(ShardplanError):
            solve_peak(pp)
        return None
    sol = solve_peak(pp)
    f, peak = pp.evaluate(sol.assignment)
    assert sol.optimal and peak <= pp.budget
    assert f == pytest.approx(ref.cost, abs=1e-9)
    return sol, ref


@pytest.mark.parametrize("seed", range(80))
def test_peak_search_matches_bruteforce(seed):
    tight = (0.0, 0.2, 0.5, 0.8, 0.95)[seed % 5]
    pp = peak_problem(seed, tight)
    solved = solved_against_bruteforce(pp)
    if solved is None:
        return
    sol, ref = solved
    f, peak = pp.evaluate(sol.assignment)
    assert sol.cost == f and sol.bound == pytest.approx(f) and sol.stats["memory_bytes"] == peak
    assert sol.stats["root_bound"] <= ref.cost + 1e-9


def test_peak_differs_from_additive_on_tight_budgets():
    """The instances must exercise the case the task is about: plans that fit only under the peak model."""
    cheaper = 0
    for seed in range(80):
        pp = peak_problem(seed, (0.0, 0.2, 0.5, 0.8, 0.95)[seed % 5])
        add = pp.additive()
        try:
            ref = solve_peak_bruteforce(pp)
        except ShardplanError:
            continue
        if add.least_memory() > add.budget or solve_memory(add).cost > ref.cost + 1e-9:
            cheaper += 1
    assert cheaper >= 10


@pytest.mark.parametrize("seed", range(0, 60, 4))
def test_peak_ilp_agrees(seed):
    from shardplan.search.memory_ilp import solve_peak_ilp

    pp = peak_problem(seed, (0.2, 0.5, 0.8)[seed % 3])
    try:
        ref = solve_peak_bruteforce(pp)
    except ShardplanError:
        with pytest.raises(ShardplanError):
            solve_peak_ilp(pp, time_limit=30)
        return
    ilp = solve_peak_ilp(pp, time_limit=30)
    sol = solve_peak(pp)
    assert ilp.optimal and ilp.stats["memory_bytes"] <= pp.budget
    assert ilp.cost == pytest.approx(sol.cost, abs=1e-7) == pytest.approx(ref.cost, abs=1e-7)


def test_stopped_peak_search_reports_bound_and_gap():
    stopped = 0
    for seed in range(30):
        pp = peak_problem(seed, 0.5)
        try:
            ref = solve_peak_bruteforce(pp)
        except ShardplanError:
            continue
        try:
            sol = solve_peak(pp, max_nodes=1, max_cuts=1)
        except ShardplanError as e:  # no incumbent (the additive model fits nothing) and none found in one node
            assert "node limit 1" in str(e) and pp.additive().least_memory() > pp.budget
            continue
        f, peak = pp.evaluate(sol.assignment)
        assert peak <= pp.budget and sol.bound <= ref.cost + 1e-9 <= f + 1e-9
        if not sol.optimal:
            stopped += 1
            assert sol.stats["status"] == "stopped at the node limit 1"
            assert sol.stats["gap"] == pytest.approx((f - sol.bound) / f)
    assert stopped >= 3


def test_bad_peak_problem_input():
    p = random_problem(2, n_max=3, k_max=3)
    z = tuple(np.zeros(k) for k in p.sizes)
    base = tuple(np.arange(k) for k in p.sizes)
    with pytest.raises(ShardplanError, match="finite and >= 0"):
        PeakProblem(p, base, p.vertex_cost, z, tuple(np.full(k, -1.0) for k in p.sizes), z, budget=10)
    with pytest.raises(ShardplanError, match="one entry per choice"):
        PeakProblem(p, base, p.vertex_cost, z, z, tuple(np.zeros(k + 1) for k in p.sizes), budget=10)


def test_solve_memory_with_an_upper_below_every_plan():
    """solve_peak passes its incumbent as solve_memory's ``upper``; when that prunes the root before any plan
    fits, solve_memory answers a plan that fits, not optimal, with the bound ``upper`` (it asserted before)."""
    cases = 0
    for seed in range(40):
        pp = peak_problem(seed, 0.5)
        add = pp.additive()
        if add.least_memory() > add.budget:
            continue
        free = solve_memory(MemoryProblem(add.problem, add.base, add.cost, add.memory, 1e12, add.fixed))
        if free.cost <= 0 or free.stats["memory_bytes"] <= add.budget:
            continue  # the root's unconstrained plan must not fit, so that nothing is seen before pruning
        cases += 1
        sol = solve_memory(add, upper=0.5 * free.cost)
        f, m = add.evaluate(sol.assignment)
        assert m <= add.budget and not sol.optimal and sol.bound == 0.5 * free.cost
        assert sol.stats["status"] == "proven: nothing below upper" and not sol.stats["beats_upper"]
    assert cases >= 5


def test_branch_on_a_fitting_plan_splits_off_its_choice():
    """A plan that fits (from a stopped surrogate solve) at which no vertex's memory can drop: the node is split,
    not dropped (the cheaper plans in it must stay)."""
    from shardplan.search.peak import _branch
    from shardplan.search.problem import Problem

    p = Problem(names=("a", "b"), configs=(((1,), (2,)), ((1,), (2,))), vertex_cost=(np.array([0.0, 1.0]),) * 2,
                edges=(), edge_cost=())
    same = (np.array([1.0, 1.0]),) * 2
    pp = PeakProblem(p, (np.arange(2), np.arange(2)), p.vertex_cost, same, same, same, budget=100.0)
    allowed = [np.ones(2, dtype=bool), np.ones(2, dtype=bool)]
    kids = _branch(pp, allowed, (1, 1))
    assert [[k.tolist() for k in c] for c in kids] == [[[True, False], [True, True]], [[False, True], [True, True]]]
    assert _branch(pp, [np.array([False, True])] * 2, (1, 1)) == []  # the node is the plan itself
