"""Cross-checks of the ILP and MCMC solvers against brute force on small random problems."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from shardplan.errors import ShardplanError
from shardplan.search.ilp import build_program, program_data, solve_ilp
from shardplan.search.mcmc import default_init, solve_mcmc
from shardplan.search.pairs import merge_pairs, reparametrise
from shardplan.search.problem import Problem
from shardplan.search.reference import solve_bruteforce

from randgraphs import random_problem

# ---------------------------------------------------------------- problems: tests/randgraphs.py


def large_problem(n: int, k: int, seed: int) -> Problem:
    """A path with random skip edges and dense random matrices: hard for the ILP."""
    rng = np.random.default_rng(seed)
    edges = [(v - 1, v) for v in range(1, n)] + [(int(rng.integers(0, v - 1)), v) for v in range(2, n)]
    return Problem(
        names=tuple(f"v{i}" for i in range(n)),
        configs=tuple(tuple((j,) for j in range(k)) for _ in range(n)),
        vertex_cost=tuple(rng.random(k) * 5 for _ in range(n)),
        edges=tuple(edges),
        edge_cost=tuple(rng.random((k, k)) * 2 for _ in edges),
    )


def brute_force(problem: Problem) -> float:
    """min F over all assignments, by enumeration."""
    return solve_bruteforce(problem).cost


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * max(1.0, abs(b))


SEEDS = range(120)


@pytest.fixture(scope="module")
def cases() -> list[tuple[Problem, float]]:
    return [(p, brute_force(p)) for p in (random_problem(s, n_max=7) for s in SEEDS)]


# ---------------------------------------------------------------- ILP


def test_ilp_equals_brute_force(cases):
    for seed, (problem, best) in zip(SEEDS, cases):
        sol = solve_ilp(problem)
        assert _close(sol.cost, best), (seed, sol.cost, best)
        assert sol.cost == problem.evaluate(sol.assignment)
        assert sol.optimal and sol.solver == "ilp"
        assert sol.bound == sol.cost
        assert sol.stats["gap"] <= 1e-9
        for key in ("variables", "constraints", "status", "gap"):
            assert key in sol.stats


def test_pruned_ilp_equals_brute_force(cases):
    for seed, (problem, best) in zip(SEEDS, cases):
        sol = solve_ilp(problem, prune=True)
        assert _close(sol.cost, best), (seed, sol.cost, best)
        assert sol.cost == problem.evaluate(sol.assignment)
        assert sol.optimal and sol.bound == sol.cost
        assert sol.stats["bounds"]["configs_after"] <= sol.stats["bounds"]["configs_before"]


def test_reparametrise_is_exact():
    rng = np.random.default_rng(3)
    m = rng.random((4, 6))
    r, c, res = reparametrise(m)
    np.testing.assert_allclose(r[:, None] + c[None, :] + res, m, rtol=0, atol=1e-15)
    assert res.min() >= 0
    assert np.all(res.min(axis=1) == 0) and np.all(res.min(axis=0) == 0)


@pytest.mark.parametrize("seed", range(6))
def test_ilp_program_data_keeps_every_cost(seed):
    """The ILP's own merging and reparametrisation leave F of every assignment unchanged."""
    p = random_problem(seed, n_max=5)
    data = program_data(p)
    assert all(r.min() >= 0 for r in data.residual)
    for a in itertools.product(*(range(k) for k in p.sizes)):
        folded = sum(c[k] for c, k in zip(data.vertex_cost, a))
        folded += sum(r[a[u], a[v]] for (u, v), r in zip(data.edges, data.residual))
        assert _close(folded, p.evaluate(a)), (seed, a)


def test_merge_orients_parallel_edges():
    p = Problem(
        names=("a", "b"),
        configs=(((1,), (2,)), ((1,), (2,), (3,))),
        vertex_cost=(np.zeros(2), np.zeros(3)),
        edges=((0, 1), (1, 0), (0, 1)),
        edge_cost=(np.arange(6.0).reshape(2, 3), np.ones((3, 2)) * 10, np.eye(2, 3)),
    )
    merged = merge_pairs(p)
    assert list(merged) == [(0, 1)]
    np.testing.assert_array_equal(merged[(0, 1)], np.arange(6.0).reshape(2, 3) + 10 + np.eye(2, 3))
    assert program_data(p).merged == 1
    assert solve_ilp(p).cost == brute_force(p)


def test_separable_and_zero_edges_are_dropped():
    rng = np.random.default_rng(0)
    ks = (3, 4, 2)
    p = Problem(
        names=("a", "b", "c"),
        configs=tuple(tuple((j,) for j in range(k)) for k in ks),
        vertex_cost=tuple(rng.random(k) for k in ks),
        edges=((0, 1), (1, 2), (2, 0)),
        edge_cost=(rng.random(3)[:, None] + rng.random(4)[None, :], np.zeros((4, 2)), rng.random((2, 3))),
    )
    reduced = program_data(p)
    assert reduced.merged == 3 and reduced.dropped == 2 and reduced.edges == ((0, 2),)
    sol = solve_ilp(p)
    assert _close(sol.cost, brute_force(p))
    assert sol.stats["edges_kept"] == 1


def test_program_shape_counts():
    p = random_problem(7, shape="path")
    reduced = program_data(p)
    c, a_mat, b, integrality, num_x = build_program(reduced)
    ks = p.sizes
    assert num_x == sum(ks)
    assert c.size == num_x + sum(ks[u] * ks[v] for u, v in reduced.edges)
    assert a_mat.shape == (len(ks) + sum(ks[u] + ks[v] for u, v in reduced.edges), c.size)
    assert integrality[:num_x].all() and not integrality[num_x:].any()
    assert (b[: len(ks)] == 1).all() and (b[len(ks) :] == 0).all()


def test_ilp_time_limit_path():
    """A tiny time limit either raises (no incumbent) or returns an unproved solution."""
    p = large_problem(40, 30, seed=1)
    try:
        sol = solve_ilp(p, time_limit=0.01)
    except ShardplanError as exc:
        assert "time limit" in str(exc)
    else:
        assert sol.cost == p.evaluate(sol.assignment)
        assert not sol.optimal
        assert sol.bound is None or sol.bound <= sol.cost
        assert sol.stats["gap"] > 0
        assert "time limit" in sol.stats["status"].lower()


def test_ilp_rejects_bad_options():
    p = random_problem(0)
    with pytest.raises(ShardplanError):
        solve_ilp(p, time_limit=0)
    with pytest.raises(ShardplanError):
        solve_ilp(p, mip_rel_gap=-1)


def test_single_config_vertices_and_empty_problem():
    p = Problem(names=("a", "b"), configs=(((1,),), ((1,),)), vertex_cost=([2.0], [3.0]), edges=((0, 1),), edge_cost=([[1.5]],))
    assert solve_ilp(p).cost == 6.5
    m = solve_mcmc(p)
    assert m.cost == 6.5 and m.stats["proposals"] == 0
    empty = Problem(names=(), configs=(), vertex_cost=(), edges=(), edge_cost=())
    assert solve_ilp(empty).cost == 0.0
    assert solve_mcmc(empty).cost == 0.0


# ---------------------------------------------------------------- MCMC


def test_mcmc_never_beats_the_optimum(cases):
    hits = 0
    for seed, (problem, best) in zip(SEEDS, cases):
        sol = solve_mcmc(problem, seed=seed)
        assert sol.cost >= best - 1e-9 * max(1.0, best), (seed, sol.cost, best)
        assert sol.cost == problem.evaluate(sol.assignment)
        assert not sol.optimal and sol.solver == "mcmc"
        for key in ("proposals", "accepted", "iterations_to_best"):
            assert key in sol.stats
        assert sol.stats["proposals"] <= 250_000
        hits += _close(sol.cost, best)
    # On spaces of at most 3000 assignments the chain usually finds the optimum
    # (about 113-115 of 120 with the defaults); a loose floor catches a broken chain.
    assert hits >= 0.85 * len(SEEDS), hits


def test_mcmc_is_reproducible():
    p = large_problem(30, 8, seed=2)
    a = solve_mcmc(p, seed=11)
    b = solve_mcmc(p, seed=11)
    assert a.assignment == b.assignment and a.cost == b.cost
    assert {k: a.stats[k] for k in ("proposals", "accepted", "iterations_to_best")} == {
        k: b.stats[k] for k in ("proposals", "accepted", "iterations_to_best")
    }


def test_mcmc_from_optimum_keeps_it(cases):
    for seed, (problem, best) in list(zip(SEEDS, cases))[:40]:
        opt = solve_ilp(problem)
        sol = solve_mcmc(problem, init=opt.assignment, seed=seed)
        assert _close(sol.cost, best)
        assert sol.stats["iterations_to_best"] == 0


def test_mcmc_improves_on_init_and_respects_caps():
    p = large_problem(50, 10, seed=4)
    init = default_init(p)
    sol = solve_mcmc(p, max_proposals=5000)
    assert sol.cost <= p.evaluate(init)
    assert sol.stats["proposals"] <= 5000
    greedy = solve_mcmc(p, temperature=0.0, max_proposals=5000)
    assert greedy.cost <= p.evaluate(init)
    timed = solve_mcmc(p, time_limit=0.0, max_proposals=10**9, min_proposals=10**9)
    assert timed.stats["stop"] == "time_limit"


def test_mcmc_stop_rule_is_in_proposals():
    """Stop after proposal i once i - i_best > i_best, but not before min_proposals."""
    p = large_problem(20, 5, seed=5)
    st = solve_mcmc(p, min_proposals=100).stats
    assert st["stop"] == "no_improvement"
    assert st["iterations_to_best"] > 50  # improved late enough that the rule, not the floor, stops it
    assert st["proposals"] == 2 * st["iterations_to_best"] + 1
    later = solve_mcmc(p, min_proposals=10 * st["proposals"]).stats  # same chain, a higher floor
    assert later["proposals"] >= 10 * st["proposals"]
    assert later["iterations_to_best"] >= st["iterations_to_best"]


def test_mcmc_rejects_bad_input():
    p = random_problem(1)
    with pytest.raises(ShardplanError):
        solve_mcmc(p, init=[0] * (p.num_vertices + 1))
    with pytest.raises(ShardplanError):
        solve_mcmc(p, temperature=-1.0)


def test_solution_from_result_limit_with_incumbent():
    """The time-limit-with-incumbent path, on a hand-made HiGHS result (not timing-dependent)."""
    from shardplan.search.ilp import solution_from_result

    p = random_problem(2, shape="path")
    best = brute_force(p)
    worst = max(p.evaluate(a) for a in itertools.product(*(range(k) for k in p.sizes)))
    worst_a = next(a for a in itertools.product(*(range(k) for k in p.sizes)) if p.evaluate(a) == worst)
    x = np.concatenate([np.eye(k)[a] for k, a in zip(p.sizes, worst_a)])
    res = {"x": x, "status": 1, "message": "Time limit reached", "mip_dual_bound": best / 2}
    sol = solution_from_result(p, res, 1.0, 0.5, {"variables": 1, "constraints": 1})
    assert sol.assignment == tuple(worst_a) and sol.cost == worst
    assert not sol.optimal and sol.bound == best / 2
    assert sol.stats["gap"] == pytest.approx((worst - best / 2) / worst)
    assert sol.stats["status"] == "Time limit reached"
    with pytest.raises(ShardplanError, match="time limit was too short"):
        solution_from_result(p, {"x": None, "status": 1, "message": "Time limit reached"}, 0.01, 0.0, {})
