"""Tied vertices (one choice for a group): the contracted problem's optimum is the tied problem's."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from shardplan.errors import ShardplanError
from shardplan.search import Problem, solve_dp
from shardplan.search.tie import check_ties, tie, untie


def _chain_problem(seed: int, n: int = 6, k: int = 3) -> Problem:
    """A path with a few chords; every vertex has the same k configurations, so any grouping can be tied."""
    rng = np.random.default_rng(seed)
    edges = [(i, i + 1) for i in range(n - 1)] + [(0, n - 1), (1, 4), (2, 4)]
    return Problem(tuple(f"v{i}" for i in range(n)), tuple(tuple((j,) for j in range(k)) for _ in range(n)),
                   tuple(rng.uniform(0, 10, k) for _ in range(n)), tuple(edges),
                   tuple(rng.uniform(0, 10, (k, k)) for _ in edges))


def _tied_bruteforce(p: Problem, groups: list[tuple[int, ...]]) -> float:
    """min F over the assignments where every group's members take one choice."""
    lead = {v: g[0] for g in groups for v in g}
    free = [v for v in range(p.num_vertices) if lead.get(v, v) == v]
    best = float("inf")
    for choice in itertools.product(*(range(p.sizes[v]) for v in free)):
        at = dict(zip(free, choice))
        best = min(best, p.evaluate([at[lead.get(v, v)] for v in range(p.num_vertices)]))
    return best


@pytest.mark.parametrize("seed", range(20))
def test_tied_optimum_equals_bruteforce_over_tied_assignments(seed: int) -> None:
    p = _chain_problem(seed)
    groups = [(0, 2, 4), (1, 5)]  # an edge inside a group (1-5 via none, 2-4 by a chord) and between groups
    tp, rep = tie(p, groups)
    assert tp.num_vertices == 3
    sol = untie(solve_dp(tp), rep)
    a = sol.assignment
    assert a[0] == a[2] == a[4] and a[1] == a[5]
    assert abs(p.evaluate(a) - sol.cost) <= 1e-9 * sol.cost
    assert abs(sol.cost - _tied_bruteforce(p, groups)) <= 1e-9 * sol.cost


def test_ties_are_checked() -> None:
    names = ("a", "b", "c")
    assert check_ties(names, [("a", "c")]) == ((0, 2),)
    with pytest.raises(ShardplanError, match="unknown operator"):
        check_ties(names, [("a", "z")])
    with pytest.raises(ShardplanError, match="two tie groups"):
        check_ties(names, [("a", "b"), ("b", "c")])
    with pytest.raises(ShardplanError, match="at least two"):
        check_ties(names, [("a",)])
    p = Problem(("a", "b"), (((1,), (2,)), ((1,),)), (np.zeros(2), np.zeros(1)), (), ())
    with pytest.raises(ShardplanError, match="different configurations"):
        tie(p, [(0, 1)])


def test_graph_ties_solve_as_one_variable_and_refuse_different_operators() -> None:
    import dataclasses

    from shardplan import ops
    from shardplan.ir import GraphBuilder
    from shardplan.machine import Machine
    from shardplan.spmd import solve

    b = GraphBuilder("t")
    x = b.input("x", (64, 32))
    h1 = b.add(ops.dense("l1", x, 32))
    h2 = b.add(ops.dense("l2", h1, 32))
    b.add(ops.dense("l3", h2, 16))
    g = b.build()
    m = Machine(4, peak_flops=32e9, bandwidth=16e9)
    tied = dataclasses.replace(g, ties=(("l1", "l2"),))
    plan = solve(tied, m, cutoff=1)
    assert plan.layouts["l1"] == plan.layouts["l2"]
    assert plan.cost >= solve(g, m, cutoff=1).cost - 1e-15  # a tie only restricts
    with pytest.raises(ShardplanError, match="different dimensions"):
        dataclasses.replace(g, ties=(("l1", "l3"),))
