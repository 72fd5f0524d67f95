"""Solvers on shapes at and past their limits: refused in one line, or solved within time.

Brute force indexes one numpy axis per vertex and the breadth-first DP one per frontier vertex, and numpy has
64; the DP's bound computation on a star of many leaves must be linear in the degree; the ILP must keep its
time limit on a vertex of very many configurations (HiGHS's presolve is quadratic in a row's length) and
stop on Ctrl-C.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from shardplan.errors import ShardplanError
from shardplan.search import SOLVERS
from shardplan.search.problem import Problem


def star(leaves: int, k_center: int = 2, k_leaf: int = 2, seed: int = 0) -> Problem:
    rng = np.random.default_rng(seed)
    sizes = [k_center] + [k_leaf] * leaves
    return Problem(tuple(["c"] + [f"l{i}" for i in range(leaves)]),
                   tuple(tuple((j,) for j in range(k)) for k in sizes),
                   tuple(rng.random(k) for k in sizes),
                   tuple((0, i + 1) for i in range(leaves)),
                   tuple(rng.random((k_center, k_leaf)) for _ in range(leaves)))


def path(n: int, k: int = 1) -> Problem:
    return Problem(tuple(f"v{i}" for i in range(n)), tuple(tuple((j,) for j in range(k)) for _ in range(n)),
                   tuple(np.arange(k, dtype=float) for _ in range(n)), tuple((i, i + 1) for i in range(n - 1)),
                   tuple(np.ones((k, k)) for _ in range(n - 1)))


def one_big_vertex(k: int) -> Problem:
    rng = np.random.default_rng(1)
    return Problem(("a", "b"), (tuple((j,) for j in range(k)), ((0,),)), (rng.random(k) + 1.0, np.ones(1)),
                   ((0, 1),), (rng.random((k, 1)),))


def test_bruteforce_at_and_past_numpys_dimension_limit():
    assert SOLVERS["bruteforce"](path(64)).cost == 63.0
    with pytest.raises(ShardplanError, match=r"brute force enumerates at most 64 vertices .* has 65"):
        SOLVERS["bruteforce"](path(65))


@pytest.mark.parametrize("k", [1, 2])
def test_bfs_dp_on_a_vertex_with_64_neighbours_is_refused(k):
    with pytest.raises(ShardplanError, match=r"vertex 'c': the breadth-first DP's table would span more than 64"):
        SOLVERS["bfs-dp"](star(64, k, k))
    if k == 1:  # with one configuration each, a table over 63 vertices is one entry
        sol = SOLVERS["bfs-dp"](star(62, k, k))
        assert sol.cost == pytest.approx(SOLVERS["dp"](star(62, k, k)).cost, rel=1e-12)


def test_dp_on_a_star_of_many_one_configuration_leaves_is_fast():
    problem = star(6000, 2, 1)
    t0 = time.process_time()
    sol = SOLVERS["dp"](problem)
    # CPU seconds, not wall (other work on the machine does not count): quadratic in the degree before, about
    # a minute here; well under a second now
    assert time.process_time() - t0 < 10.0
    best = min(problem.evaluate((c,) + (0,) * 6000) for c in range(2))
    assert sol.optimal and sol.cost == pytest.approx(best, rel=1e-12)


def test_dp_on_a_star_with_choices_at_the_leaves_is_exact():
    problem = star(3000, 3, 2, seed=4)
    sol = SOLVERS["dp"](problem)
    # the exact optimum of a star: per centre configuration, each leaf's best answer to it
    best = min(problem.vertex_cost[0][c] + sum(float((problem.vertex_cost[i + 1] + m[c]).min())
                                                for i, m in enumerate(problem.edge_cost)) for c in range(3))
    assert sol.optimal and sol.cost == pytest.approx(best, rel=1e-12)


def test_ilp_keeps_its_time_limit_on_a_vertex_of_many_configurations():
    problem = one_big_vertex(30000)
    t0 = time.perf_counter()
    try:
        sol = SOLVERS["ilp"](problem, time_limit=2.0)
    except ShardplanError as e:  # HiGHS overran its limit: given up, in one line
        assert str(e).startswith("ILP: HiGHS did not stop at its time limit of 2 s")
    else:
        assert sol.cost >= min(problem.evaluate((j, 0)) for j in range(30000)) * (1 - 1e-12)
    assert time.perf_counter() - t0 < 8.0  # HiGHS's presolve alone took about a minute before


def test_ilp_stops_on_ctrl_c(monkeypatch):
    """KeyboardInterrupt reaches the caller at once, while HiGHS is still inside its C code."""
    import shardplan.search.ilp as ilp

    # a presolve of many seconds that ignores the time limit
    monkeypatch.setattr(ilp, "_PRESOLVE_MAX_ROW", 10**9, raising=False)
    problem = one_big_vertex(8000)
    timer = threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT))
    t0 = time.perf_counter()
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            SOLVERS["ilp"](problem, time_limit=60.0)
    finally:
        timer.cancel()
    assert time.perf_counter() - t0 < 3.0
