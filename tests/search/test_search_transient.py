"""Transient bytes of a backward step (held at that step only) in the peak search: by hand, against brute force
and against the peak ILP (HiGHS), for the backward-peak model and for the additive model with transients."""

from __future__ import annotations

import numpy as np
import pytest

from randgraphs import random_problem
from shardplan.errors import ShardplanError
from shardplan.search.constrained import solve_memory
from shardplan.search.memory_ilp import solve_peak_ilp
from shardplan.search.peak import PeakProblem, backward_profile, solve_peak_bruteforce
from shardplan.search.problem import Problem
from tests.search.test_search_peak import solved_against_bruteforce


def test_transient_profile_by_hand():
    rest, saved, grad = np.array([1.0, 2.0, 3.0]), np.array([10.0, 20.0, 30.0]), np.array([100.0, 200.0, 300.0])
    tr = np.array([1000.0, 0.0, 7000.0])
    prof = backward_profile(rest, saved, grad, fixed=5.0, transient=tr)
    # each step adds its own transient only: k = 0 (+1000), k = 1 (+0), k = 2 (+7000)
    assert prof.tolist() == [5 + 6 + 10 + 600 + 1000, 5 + 6 + 30 + 500, 5 + 6 + 60 + 300 + 7000]
    one = Problem(names=("a", "b", "c"), configs=(((1,),),) * 3, vertex_cost=(np.zeros(1),) * 3, edges=(),
                  edge_cost=())
    col = lambda x: tuple(np.array([float(y)]) for y in x)  # noqa: E731
    pp = PeakProblem(one, (np.zeros(1, dtype=int),) * 3, (np.zeros(1),) * 3, col(rest), col(saved), col(grad),
                     budget=1e9, fixed=5.0, transient=col(tr))
    assert pp.profile((0, 0, 0)).tolist() == prof.tolist()
    assert [5 + sum(float(c[0]) for c in pp.contribution(k)) for k in range(3)] == prof.tolist()
    assert pp.least_peak() == prof.max() == 5 + 6 + 60 + 300 + 7000
    # the additive bound counts every transient; the surrogate at w weighs transient_v by w_v
    assert pp.additive().evaluate((0, 0, 0))[1] == 5 + 6 + 60 + 600 + 8000
    w = np.array([0.25, 0.25, 0.5])
    assert pp.surrogate(w).evaluate((0, 0, 0))[1] == pytest.approx(float(np.dot(w, prof)))
    with pytest.raises(ShardplanError, match="transient"):
        PeakProblem(one, (np.zeros(1, dtype=int),) * 3, (np.zeros(1),) * 3, col(rest), col(saved), col(grad),
                    budget=1e9, transient=col([1.0, -1.0, 0.0]))


def transient_problem(seed: int, tight: float, additive: bool) -> PeakProblem:
    """A random problem with integer rest / saved / grad / transient bytes (``additive``: saved and grad zero,
    the additive model with transients) and a budget ``tight`` of the way from the least peak to the
    unconstrained optimum's."""
    p = random_problem(seed, n_max=6, k_max=4)
    rng = np.random.default_rng(3000 + seed)
    base, cost, rest, saved, grad, tr = [], [], [], [], [], []
    for v, k in enumerate(p.sizes):
        reps = rng.integers(1, 3, size=k)
        b = np.repeat(np.arange(k), reps)
        base.append(b)
        cost.append((p.vertex_cost[v][b] + np.where(np.arange(len(b)) % 2 == 1, rng.integers(0, 3, len(b)), 0))
                    .astype(float))
        rest.append(rng.integers(0, 10 if additive else 4, size=len(b)).astype(float))
        zero = np.zeros(len(b))
        saved.append(zero if additive else rng.integers(0, 10, size=len(b)).astype(float))
        grad.append(zero if additive else rng.integers(0, 10, size=len(b)).astype(float))
        tr.append(rng.integers(0, 30, size=len(b)).astype(float))  # large beside the rest: it decides the peak
    parts = (tuple(base), tuple(cost), tuple(rest), tuple(saved), tuple(grad))
    loose = PeakProblem(p, *parts, budget=1e9, fixed=3.0, transient=tuple(tr))
    top = loose.evaluate(solve_memory(loose.additive()).assignment)[1]
    least = loose.least_peak()
    return PeakProblem(p, *parts, budget=float(np.floor(least + tight * (top - least))), fixed=3.0,
                       transient=tuple(tr))


@pytest.mark.parametrize("seed", range(12))
def test_transient_search_matches_bruteforce_and_ilp(seed):
    pp = transient_problem(seed, (0.0, 0.3, 0.6, 0.9)[seed % 4], additive=seed % 2 == 1)
    solved = solved_against_bruteforce(pp)
    if solved is None:
        return
    _, ref = solved
    ilp = solve_peak_ilp(pp, time_limit=30)
    assert ilp.optimal and ilp.cost == pytest.approx(ref.cost, abs=1e-7)


def test_transients_bind_on_some_instances():
    """A plan that fits without the transients but not with them: the instances exercise the term."""
    binds = 0
    for seed in range(12):
        pp = transient_problem(seed, 0.3, additive=seed % 2 == 1)
        plain = PeakProblem(pp.problem, pp.base, pp.cost, pp.rest, pp.saved, pp.grad, pp.budget, pp.fixed)
        try:
            with_t = solve_peak_bruteforce(pp).cost
        except ShardplanError:
            with_t = np.inf
        binds += with_t > solve_peak_bruteforce(plain).cost + 1e-9
    assert binds >= 3
