"""The exact DP against brute force and the breadth-first reference on random problems."""

from __future__ import annotations

import numpy as np
import pytest

from randgraphs import random_problem
from shardplan.errors import ShardplanError, TableMemoryError
from shardplan.search import ORDERINGS, SOLVERS, Problem, solve_bfs_dp, solve_bruteforce, solve_dp
from shardplan.search.ordering import dependent_sets, generateseq
from shardplan.search.reduce import reduce_problem

pytestmark = pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out

SEEDS = range(300)


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))


@pytest.mark.parametrize("seed", SEEDS)
def test_dp_matches_bruteforce(seed: int) -> None:
    p = random_problem(seed)
    ref = solve_bruteforce(p)
    assert close(solve_bfs_dp(p).cost, ref.cost)
    for name in ORDERINGS:
        for prune, bounds in ((True, True), (False, True), (True, False), (False, False)):
            s = solve_dp(p, ordering=name, prune=prune, bounds=bounds)
            assert close(s.cost, ref.cost), (name, prune, bounds)
            assert close(s.stats["dp_value"], ref.cost), (name, prune, bounds)
            assert s.cost == p.evaluate(s.assignment)
            assert len(s.assignment) == p.num_vertices
            assert s.optimal and s.solver == "dp"


@pytest.mark.parametrize("seed", range(40))
def test_larger_graphs_orderings_agree(seed: int) -> None:
    p = random_problem(1000 + seed, n_max=16, k_max=4)
    costs = {name: solve_dp(p, ordering=name).cost for name in ORDERINGS}
    costs["unpruned"] = solve_dp(p, prune=False).cost
    costs["unbounded"] = solve_dp(p, bounds=False).cost
    costs["plain"] = solve_dp(p, prune=False, bounds=False).cost
    costs["bfs-dp"] = solve_bfs_dp(p).cost
    first = next(iter(costs.values()))
    assert all(close(c, first) for c in costs.values()), costs


@pytest.mark.parametrize("seed", range(60))
def test_reduction_keeps_optimum(seed: int) -> None:
    p = random_problem(2000 + seed)
    red = reduce_problem(p)
    assert close(solve_bruteforce(red.problem).cost, solve_bruteforce(p).cost)
    for v, k in enumerate(red.keep):
        assert len(k) >= 1 and np.all(np.diff(k) > 0) and k[-1] < p.sizes[v]


def test_dominance_removes_dominated_and_keeps_one_of_ties() -> None:
    # a (config 0) dominated by b (config 1); configs 2 and 3 identical: keep 2 only
    p = Problem(names=("a", "b"), configs=(((1,), (2,), (3,), (4,)), ((1,), (2,))),
                vertex_cost=(np.array([2.0, 1.0, 5.0, 5.0]), np.array([0.0, 0.0])),
                edges=((0, 1),), edge_cost=(np.array([[3.0, 3.0], [1.0, 3.0], [0.0, 0.5], [0.0, 0.5]]),))
    red = reduce_problem(p)
    assert list(red.keep[0]) == [1, 2]
    assert close(solve_dp(p).cost, solve_bruteforce(p).cost)


def test_stats_and_solvers_registry() -> None:
    p = random_problem(7, n_max=10)
    s = SOLVERS["dp"](p, ordering="generateseq")
    for key in ("ordering", "max_dependent_set", "total_table_entries", "largest_table", "num_vertices", "pruning"):
        assert key in s.stats
    assert s.stats["ordering"] == "generateseq"
    assert close(SOLVERS["bruteforce"](p).cost, s.cost)
    assert close(SOLVERS["bfs-dp"](p).cost, s.cost)
    assert close(solve_dp(p, ordering=generateseq).cost, s.cost)


def test_progress_callback() -> None:
    p = random_problem(3, n_max=8)
    seen = []
    solve_dp(p, progress=lambda done, total: seen.append((done, total)))
    assert seen[-1] == (p.num_vertices, p.num_vertices)


def test_orderings_are_permutations_and_generateseq_dependent_sets() -> None:
    for seed in range(50):
        p = random_problem(seed, n_max=12)
        for name, fn in ORDERINGS.items():
            assert sorted(fn(p)) == list(range(p.num_vertices)), name
    # a star: GENERATESEQ eliminates the leaves first (|d| = 1) and the centre last
    n = 6
    star = Problem(names=tuple(f"v{i}" for i in range(n)), configs=tuple(((1,), (2,)) for _ in range(n)),
                   vertex_cost=tuple(np.zeros(2) for _ in range(n)), edges=tuple((0, i) for i in range(1, n)),
                   edge_cost=tuple(np.ones((2, 2)) for _ in range(1, n)))
    order = generateseq(star)
    assert order[-2:] in ([0, 5], [5, 0]) or order[-1] == 0
    assert max(len(d) for d in dependent_sets(star, order)) == 1


def test_memory_guard() -> None:
    p = random_problem(11, n_max=8, shape="complete")
    with pytest.raises(TableMemoryError, match="memory limit"):
        solve_dp(p, memory_limit_bytes=16, prune=False)
    with pytest.raises(TableMemoryError, match="memory limit"):
        solve_bfs_dp(p, memory_limit_bytes=16)
    assert issubclass(TableMemoryError, ShardplanError)


def test_bruteforce_limit_and_unknown_ordering() -> None:
    p = random_problem(5, n_max=8)
    with pytest.raises(ShardplanError, match="combinations"):
        solve_bruteforce(p, max_combinations=1)
    with pytest.raises(ShardplanError, match="unknown ordering"):
        solve_dp(p, ordering="nope")


def test_empty_problem() -> None:
    p = Problem(names=(), configs=(), vertex_cost=(), edges=(), edge_cost=())
    assert solve_dp(p).cost == 0.0
    assert solve_bruteforce(p).cost == 0.0
    assert solve_bfs_dp(p).cost == 0.0


@pytest.mark.parametrize("shape", ["path", "tree", "disconnected"])
def test_forests_need_dependent_sets_of_one(shape: str) -> None:
    """On a forest GENERATESEQ and min-fill eliminate leaves: every table has at most one dependent vertex."""
    for seed in range(10):
        p = random_problem(seed, n_max=12, shape=shape)
        for name in ("generateseq", "min-fill"):
            s = solve_dp(p, ordering=name, prune=False, bounds=False)
            assert s.stats["max_dependent_set"] <= 1, (seed, name)
            assert close(s.cost, solve_bfs_dp(p).cost)


@pytest.mark.parametrize("seed", range(20))
def test_derived_problems_are_what_the_checked_constructor_makes(seed: int) -> None:
    """The reductions build their problems unchecked (Problem.derived); checking them again changes nothing:
    the same normal-form values and the very same arrays."""
    from shardplan.search.dp import _fold_fixed

    p = random_problem(3000 + seed)
    for q in (reduce_problem(p).problem, _fold_fixed(reduce_problem(p).problem)):
        checked = Problem(names=q.names, configs=q.configs, vertex_cost=q.vertex_cost, edges=q.edges,
                          edge_cost=q.edge_cost, dims=q.dims)
        assert checked.names == q.names and checked.configs == q.configs and checked.edges == q.edges
        assert checked.dims == q.dims and checked.index == q.index
        assert all(a is b for a, b in zip(checked.vertex_cost, q.vertex_cost))
        assert all(a is b for a, b in zip(checked.edge_cost, q.edge_cost))
