"""The memory-constrained search against brute force and the ILP with a memory row."""

from __future__ import annotations

import numpy as np
import pytest

from randgraphs import random_problem
from shardplan.errors import ShardplanError
from shardplan.search import solve_dp
from shardplan.search.constrained import MemoryProblem, solve_memory, solve_memory_bruteforce

pytestmark = pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out


def memory_problem(seed: int, tight: float) -> MemoryProblem:
    """A random problem with 1-3 choices per configuration, integer memory, and a budget
    ``tight`` of the way from the least memory to the unconstrained optimum's memory."""
    p = random_problem(seed, n_max=7, k_max=4)
    rng = np.random.default_rng(1000 + seed)
    base, cost, mem = [], [], []
    for v, k in enumerate(p.sizes):
        reps = rng.integers(1, 4, size=k)
        b = np.repeat(np.arange(k), reps)
        base.append(b)
        c = p.vertex_cost[v][b] + np.where(np.arange(len(b)) % 2 == 1, rng.integers(0, 3, len(b)), 0)
        cost.append(c.astype(float))
        mem.append(rng.integers(0, 10, size=len(b)).astype(float))
    loose = MemoryProblem(p, tuple(base), tuple(cost), tuple(mem), budget=1e9, fixed=3.0)
    top = loose.evaluate(solve_memory(loose).assignment)[1]
    least = loose.least_memory()
    budget = float(np.floor(least + tight * (top - least)))
    return MemoryProblem(p, tuple(base), tuple(cost), tuple(mem), budget=budget, fixed=3.0)


@pytest.mark.parametrize("mode", [{}, {"separable": 0, "frontier": 0}, {"separable": 0, "frontier": 0, "mix": False},
                                  {"fix_iters": -1, "separable": 2, "frontier": 0},
                                  {"fix_iters": -1, "separable": 0, "frontier": 10**6}])
@pytest.mark.parametrize("seed", range(60))
def test_memory_search_matches_bruteforce(seed, mode):
    tight = (0.0, 0.3, 0.7, 0.95)[seed % 4]
    mp = memory_problem(seed, tight)
    ref = solve_memory_bruteforce(mp)
    sol = solve_memory(mp, **mode)
    f, m = mp.evaluate(sol.assignment)
    assert sol.optimal and m <= mp.budget
    assert f == pytest.approx(ref.cost, abs=1e-9)
    assert sol.cost == f and sol.bound == pytest.approx(f)
    assert sol.stats["memory_bytes"] == m


def test_memory_search_with_one_choice_per_config_is_dp_when_budget_is_loose():
    p = random_problem(7, n_max=8, k_max=5)
    mem = [np.arange(k, dtype=float) for k in p.sizes]
    mp = MemoryProblem.from_problem(p, mem, budget=1e12)
    sol = solve_memory(mp)
    assert sol.optimal and sol.stats["nodes"] == 1 and sol.stats["dp_solves"] == 1
    assert sol.cost == pytest.approx(solve_dp(p).cost)


def test_tight_budget_where_unconstrained_optimum_does_not_fit():
    # Two vertices, edge rewards equal choices; the cheap plan uses the big memory.
    from shardplan.search.problem import Problem

    p = Problem(names=("a", "b"), configs=(((1,), (2,)), ((1,), (2,))), vertex_cost=(np.array([0.0, 5.0]),
                np.array([0.0, 5.0])), edges=((0, 1),), edge_cost=(np.array([[0.0, 3.0], [3.0, 0.0]]),))
    mp = MemoryProblem.from_problem(p, [np.array([10.0, 1.0]), np.array([10.0, 1.0])], budget=11.0)
    sol = solve_memory(mp)
    # (0,0) costs 0 but needs 20; (0,1) and (1,0) cost 8 with 11; (1,1) costs 10 with 2.
    assert sol.optimal and sol.cost == 8.0 and sol.stats["memory_bytes"] == 11.0
    assert sol.stats["unconstrained_cost"] == 0.0 and sol.stats["unconstrained_memory_bytes"] == 20.0


def test_infeasible_budget_names_least_memory():
    mp = memory_problem(3, 0.0)
    least = mp.least_memory()
    bad = MemoryProblem(mp.problem, mp.base, mp.cost, mp.memory, budget=least - 1, fixed=mp.fixed)
    with pytest.raises(ShardplanError, match=f"least memory any plan needs is .*\\({least:.0f} bytes\\)"):
        solve_memory(bad)


@pytest.mark.parametrize("seed", [3, 4])
def test_stopped_search_reports_bound_and_gap(seed):
    mp = memory_problem(seed, 0.5)
    ref = solve_memory_bruteforce(mp)
    sol = solve_memory(mp, max_nodes=1, separable=0, frontier=0, mix=False)
    f, m = mp.evaluate(sol.assignment)
    assert not sol.optimal and sol.stats["status"] == "stopped at the node limit 1"
    assert m <= mp.budget and f > ref.cost and sol.bound < ref.cost
    assert sol.stats["gap"] == pytest.approx((f - sol.bound) / f)


@pytest.mark.parametrize("seed", range(0, 40, 3))
def test_memory_ilp_agrees(seed):
    from shardplan.search.memory_ilp import solve_memory_ilp

    mp = memory_problem(seed, (0.2, 0.6, 0.9)[seed % 3])
    ilp = solve_memory_ilp(mp, time_limit=30)
    sol = solve_memory(mp)
    assert ilp.optimal and ilp.stats["memory_bytes"] <= mp.budget
    assert ilp.cost == pytest.approx(sol.cost, abs=1e-7)


def test_bad_memory_problem_input():
    p = random_problem(2, n_max=3, k_max=3)
    with pytest.raises(ShardplanError, match="finite and >= 0"):
        MemoryProblem.from_problem(p, [np.full(k, -1.0) for k in p.sizes], budget=10)
    with pytest.raises(ShardplanError, match="budget"):
        MemoryProblem.from_problem(p, [np.zeros(k) for k in p.sizes], budget=float("nan"))


def test_separable_root_is_solved_without_branching():
    # brute force enumerates at most 10**6 assignments, so every component here has at most that many
    for seed in range(20):
        mp = memory_problem(seed, 0.5)
        ref = solve_memory_bruteforce(mp)
        sol = solve_memory(mp, fix_iters=-1, max_nodes=1, separable=10**6)
        assert sol.optimal and sol.cost == pytest.approx(ref.cost, abs=1e-9), seed
        assert sol.stats["nodes"] == 1


def identical_chain(n: int, budget: float) -> MemoryProblem:
    """n identical vertices in a chain, two configurations each, edges that cost 0 between equal ones and 1
    otherwise; each configuration has a fast big choice and a slow small one (recompute-like):
    config 0: (cost 0, 10 B) or (1, 4 B); config 1: (0.5, 6 B) or (2, 1 B)."""
    from shardplan.search.problem import Problem

    edge = np.array([[0.0, 1.0], [1.0, 0.0]])
    p = Problem(names=tuple(f"v{i}" for i in range(n)), configs=tuple(((0,), (1,)) for _ in range(n)),
                vertex_cost=tuple(np.zeros(2) for _ in range(n)), edges=tuple((i, i + 1) for i in range(n - 1)),
                edge_cost=tuple(edge for _ in range(n - 1)))
    base = tuple(np.array([0, 0, 1, 1]) for _ in range(n))
    cost = tuple(np.array([0.0, 1.0, 0.5, 2.0]) for _ in range(n))
    mem = tuple(np.array([10.0, 4.0, 6.0, 1.0]) for _ in range(n))
    return MemoryProblem(p, base, cost, mem, budget=budget)


@pytest.mark.parametrize("n,budget", [(6, 41.0), (8, 61.0), (10, 47.0), (9, 29.0)])
def test_identical_chain_against_bruteforce(n, budget):
    # (plain branch-and-bound, separable=0, does not finish n = 12 in a minute: each branch on one block
    # leaves the dual bound of the others unchanged)
    mp = identical_chain(n, budget)
    ref = solve_memory_bruteforce(mp, max_combinations=4**10)
    for mode in ({}, {"fix_iters": 20}):
        sol = solve_memory(mp, **mode)
        assert sol.optimal and sol.cost == pytest.approx(ref.cost, abs=1e-12), mode


def test_mix_finds_the_knapsack_optimum_of_identical_blocks_at_the_root():
    # 40 blocks whose config 1 is dominated (3 s more, same memory, and a change of config costs an edge):
    # the optimum keeps config 0 and takes the slow small choice (1 s, saves 6 B) in ceil((400 - 251) / 6)
    # = 25 blocks: 25 s at 250 B; the dual bound is 149 / 6 s. No brute force at this size.
    mp = identical_chain(40, 251.0)
    mp = MemoryProblem(mp.problem, mp.base, tuple(np.array([0.0, 1.0, 3.0, 4.0]) for _ in mp.cost),
                       tuple(np.array([10.0, 4.0, 10.0, 4.0]) for _ in mp.memory), budget=251.0)
    plain = solve_memory(mp, max_nodes=1, separable=0, frontier=0, mix=False)
    mixed = solve_memory(mp, max_nodes=1, separable=0, frontier=0)
    assert mixed.cost == 25.0 and mixed.stats["memory_bytes"] == 250.0
    assert plain.cost > mixed.cost
    # every memory step is a multiple of 6 B over the least 160 B, so M <= 251 means M <= 250: the dual
    # bound at lam = 1/6 s/B becomes 150 / 6 = 25 s, the optimum, proven at the root
    assert mixed.optimal and mixed.bound == 25.0 and mixed.stats["nodes"] == 1


def test_lattice_budget():
    from shardplan.search.constrained import _lattice_budget

    mp = identical_chain(5, 37.0)  # memory 10, 4, 6, 1 per block: steps of 1 B, nothing to tighten
    full = [np.ones(4, dtype=bool)] * 5
    assert _lattice_budget(mp, full) == 37.0
    only = [np.array([True, True, False, False])] * 5  # 10 or 4: least 20, steps of 6 -> 20 + 6 * 2 = 32
    assert _lattice_budget(mp, only) == 32.0
    frac = MemoryProblem(mp.problem, mp.base, mp.cost, tuple(np.array([0.75, 0.25, 0.5, 0.0]) for _ in range(5)),
                         budget=1.2, fixed=0.1)  # steps of 0.25 over 0.1: 1.1
    assert _lattice_budget(frac, full) == pytest.approx(1.1) and _lattice_budget(frac, full) >= 1.1


def test_frontier_program_solves_identical_chains():
    # the front program alone (no fixing, no knapsack of separable parts), against brute force and, on 40
    # blocks, against the optimum worked out in test_mix_finds_the_knapsack_optimum_of_identical_blocks_at_the_root
    mp = identical_chain(10, 47.0)
    ref = solve_memory_bruteforce(mp, max_combinations=4**10)
    sol = solve_memory(mp, fix_iters=-1, separable=0, frontier=10**6, mix=False)
    assert sol.optimal and sol.cost == pytest.approx(ref.cost, abs=1e-12) and sol.stats["frontier_nodes"] == 1
    big = identical_chain(40, 251.0)
    big = MemoryProblem(big.problem, big.base, tuple(np.array([0.0, 1.0, 3.0, 4.0]) for _ in big.cost),
                        tuple(np.array([10.0, 4.0, 10.0, 4.0]) for _ in big.memory), budget=251.0)
    sol = solve_memory(big, fix_iters=-1, separable=0, frontier=10**6, mix=False, max_nodes=1)
    assert sol.optimal and sol.cost == 25.0 and sol.stats["memory_bytes"] == 250.0


def test_frontier_program_gives_up_above_its_state_limit():
    from shardplan.search.constrained import _Ctx, _frontier_dp

    mp = memory_problem(5, 0.5)
    ctx = _Ctx(mp, lambda p: solve_dp(p), 1e-9)
    allowed = [np.ones(k, dtype=bool) for k in mp.num_choices]
    done, value = _frontier_dp(ctx, allowed, np.inf, 0.0, max_states=1)
    assert not done and np.isnan(value) and ctx.best is None
    done, value = _frontier_dp(ctx, allowed, np.inf, 0.0, max_states=10**6)
    assert done and value == pytest.approx(solve_memory_bruteforce(mp).cost, abs=1e-9)


def linked_memory_problem(seed: int, n: int = 13, layouts: int = 0) -> MemoryProblem:
    """A path of ``n`` vertices with skip edges, 2-3 configurations each with 1-2 choices, and a budget
    midway between the least memory and the unconstrained optimum's. With ``layouts`` > 0 each configuration
    has one of that many layouts, edges (i, i + 2) are added, and an edge's cost depends on the two layouts only (repeated rows and
    columns, as in DNN problems where a row depends on how the producer lays out its output)."""
    from shardplan.search.problem import Problem

    rng = np.random.default_rng(seed)
    edges = [(i, i + 1) for i in range(n - 1)] + [(i, i + 3) for i in range(0, n - 3, 4)]
    ks = [int(rng.integers(2, 4)) for _ in range(n)]
    if layouts:
        edges += [(i, i + 2) for i in range(n - 2)]
        lay = [rng.integers(0, layouts, size=k) for k in ks]
        mats = [rng.integers(0, 4, size=(layouts, layouts))[np.ix_(lay[s], lay[d])].astype(float) for s, d in edges]
    else:
        mats = [rng.integers(0, 4, size=(ks[s], ks[d])).astype(float) for s, d in edges]
    p = Problem(names=tuple(f"v{i}" for i in range(n)), configs=tuple(tuple((c,) for c in range(k)) for k in ks),
                vertex_cost=tuple(np.zeros(k) for k in ks), edges=tuple(edges), edge_cost=tuple(mats))
    base = tuple(np.repeat(np.arange(k), rng.integers(1, 3, size=k)) for k in ks)
    cost = tuple(rng.integers(0, 6, size=len(b)).astype(float) for b in base)
    mem = tuple(rng.integers(0, 8, size=len(b)).astype(float) for b in base)
    loose = MemoryProblem(p, base, cost, mem, budget=1e9)
    top = loose.evaluate(solve_memory(loose).assignment)[1]
    least = loose.least_memory()
    return MemoryProblem(p, base, cost, mem, budget=float(np.floor((least + top) / 2)))


@pytest.mark.parametrize("seed", range(12))
def test_mix_of_linked_points_is_the_best_plan_of_their_choices(seed):
    # the points differ in the configuration of every vertex of a path, so their differing vertices form one
    # group with 2^13 assignments (over the knapsack's limit): the front program mixes them. Its plan must be
    # a real plan within the budget and the best one of the points' union, by brute force over that union.
    from shardplan.search.constrained import _Ctx, _mix, _Point

    mp = linked_memory_problem(seed)
    rng = np.random.default_rng(500 + seed)
    n = mp.problem.num_vertices
    pts = []
    for _ in range(4):
        ch = tuple(int(rng.integers(0, len(b))) for b in mp.base)
        pts.append(_Point(*mp.evaluate(ch), ch))
    plus, minus = pts[0], pts[1]
    # force the two bracketing points apart in configuration at every vertex
    ch = list(minus.choices)
    for v in range(n):
        if mp.base[v][ch[v]] == mp.base[v][plus.choices[v]]:
            ch[v] = int(np.flatnonzero(mp.base[v] != mp.base[v][plus.choices[v]])[0])
    minus = _Point(*mp.evaluate(ch), tuple(ch))
    allowed = [np.ones(len(b), dtype=bool) for b in mp.base]
    lam = float(rng.uniform(0.0, 1.0))
    for points, ref_pts in (([], [plus, minus]), (pts[2:], [plus, minus, *pts[2:]])):
        union = [np.zeros(len(b), dtype=bool) for b in mp.base]
        for pt in ref_pts:
            for v, j in enumerate(pt.choices):
                union[v][j] = True
        restricted = MemoryProblem(mp.problem, tuple(b[u] for b, u in zip(mp.base, union)),
                                   tuple(c[u] for c, u in zip(mp.cost, union)),
                                   tuple(m[u] for m, u in zip(mp.memory, union)), mp.budget)
        try:
            ref = solve_memory_bruteforce(restricted, max_combinations=4**n).cost
        except ShardplanError:  # nothing in the union fits
            ref = np.inf
        ctx = _Ctx(mp, lambda p: solve_dp(p), 1e-9)
        _mix(ctx, allowed, points, plus, minus, lam)
        if ctx.best is None:
            assert ref == np.inf
            continue
        f, m = mp.evaluate(ctx.best.choices)
        assert m <= mp.budget and f == ctx.best.f and m == ctx.best.m
        assert all(union[v][j] for v, j in enumerate(ctx.best.choices))
        assert f == pytest.approx(ref, abs=1e-9)
        off = _Ctx(mp, lambda p: solve_dp(p), 1e-9, mix_states=0)  # the knapsack of groups gives up here
        _mix(off, allowed, points, plus, minus, lam)
        assert off.best is None


@pytest.mark.parametrize("seed", range(40))
def test_frontier_program_with_repeated_layouts_matches_bruteforce(seed):
    # the front program compares points whose frontier configurations differ only in layouts the edges to
    # come cannot tell apart (one state per class): exact against brute force, with and without fixing
    mp = linked_memory_problem(seed, n=7, layouts=2 + seed % 2)
    ref = solve_memory_bruteforce(mp)
    for mode in ({"fix_iters": -1, "separable": 0, "frontier": 10**6, "mix": False},
                 {"separable": 0, "frontier": 10**6}):
        sol = solve_memory(mp, **mode)
        assert sol.optimal and sol.cost == pytest.approx(ref.cost, abs=1e-9), mode
        assert mp.evaluate(sol.assignment)[1] <= mp.budget


def test_frontier_classes_merge_configurations_with_equal_edges_to_come():
    from shardplan.search.constrained import _frontier_classes, _frontier_plan
    from shardplan.search.problem import Problem

    # a -> b -> c, a -> c; a's rows to b are equal for configs 0 and 1, its rows to c differ for 1 and 2
    ab = np.array([[1.0, 2.0], [1.0, 2.0], [0.0, 5.0]])
    ac = np.array([[0.0, 1.0], [3.0, 1.0], [3.0, 1.0]])
    bc = np.array([[0.0, 1.0], [0.0, 1.0]])
    p = Problem(names=("a", "b", "c"), configs=(((0,), (1,), (2,)), ((0,), (1,)), ((0,), (1,))),
                vertex_cost=(np.zeros(3), np.zeros(2), np.zeros(2)), edges=((0, 1), (0, 2), (1, 2)),
                edge_cost=(ab, ac, bc))
    cfgs = [np.arange(3), np.arange(2), np.arange(2)]
    classes = _frontier_classes(p, cfgs, _frontier_plan(p))
    (of_a, n_a), = classes[0]  # after a: edges to b and c remain; all three rows differ
    assert n_a == 3
    (of_a, n_a), (of_b, n_b) = classes[1]  # after b: only a -> c remains (0 | 1 = 2); b's rows to c are equal
    assert n_a == 2 and of_a[1] == of_a[2] != of_a[0] and n_b == 1
    assert classes[2] == []


def test_frontier_program_alone_matches_bruteforce_on_repeated_layouts():
    # without pruning (no cutoff, lam 0) the program's states alone decide what is compared: a class that
    # merged configurations with different edges to come would lose the optimum (2 of these 200 when one
    # remaining edge is ignored)
    from shardplan.search.constrained import _Ctx, _frontier_dp

    for seed in range(200):
        mp = linked_memory_problem(seed, n=7, layouts=2 + seed % 2)
        ref = solve_memory_bruteforce(mp)
        ctx = _Ctx(mp, lambda p: solve_dp(p), 1e-9)
        done, value = _frontier_dp(ctx, [np.ones(len(b), dtype=bool) for b in mp.base], np.inf, 0.0, 10**6)
        assert done and value == pytest.approx(ref.cost, abs=1e-9), seed
        assert ctx.best is not None and ctx.best.f == value and ctx.best.m <= mp.budget


@pytest.mark.parametrize("seed", range(40))
def test_frontier_program_prunes_by_completion_bounds_exactly(seed):
    # the backward program's least completion is the exact Lagrangian minimum (brute force), and with a cutoff
    # just above the optimum and any lam >= 0 the pruned program still finds the optimum, and nothing below it
    from shardplan.search.constrained import (_Ctx, _completion_bounds, _frontier_classes, _frontier_dp,
                                              _frontier_plan)

    mp = linked_memory_problem(seed, n=7, layouts=(0, 2, 3)[seed % 3])
    ref = solve_memory_bruteforce(mp)
    rng = np.random.default_rng(900 + seed)
    lam = float(rng.choice([0.0, rng.uniform(0.0, 2.0)]))
    p = mp.problem
    allowed = [rng.random(len(b)) < 0.8 for b in mp.base]
    for ok in allowed:
        ok[rng.integers(0, len(ok))] = True
    idx = [np.flatnonzero(ok) for ok in allowed]
    cfgs = [np.unique(b[i]) for b, i in zip(mp.base, idx)]
    plan = _frontier_plan(p)
    nbr: dict = {}
    for e, (s, d) in enumerate(p.edges):
        nbr.setdefault(max(s, d), []).append((min(s, d), e, s < d))
    start, _ = _completion_bounds(mp, idx, cfgs, plan, _frontier_classes(p, cfgs, plan), nbr, lam)
    sub = MemoryProblem(p, tuple(b[i] for b, i in zip(mp.base, idx)), tuple(c[i] for c, i in zip(mp.cost, idx)),
                        tuple(m[i] for m, i in zip(mp.memory, idx)), budget=1e12, fixed=mp.fixed)
    lag = MemoryProblem(p, sub.base, tuple(c + lam * m for c, m in zip(sub.cost, sub.memory)), sub.memory, 1e12)
    assert start == pytest.approx(solve_memory_bruteforce(lag).cost, abs=1e-9)
    full = [np.ones(len(b), dtype=bool) for b in mp.base]
    ctx = _Ctx(mp, lambda q: solve_dp(q), 1e-9)
    done, value = _frontier_dp(ctx, full, ref.cost + 1e-6, lam, 10**6)
    assert done and value == pytest.approx(ref.cost, abs=1e-9)
    assert ctx.best is not None and ctx.best.m <= mp.budget
    none = _Ctx(mp, lambda q: solve_dp(q), 1e-9)
    done, value = _frontier_dp(none, full, ref.cost - 1e-6, lam, 10**6)
    assert done and value == np.inf and none.best is None


def test_row_classes_group_exactly_equal_rows():
    """Rows share a class iff they are equal (inf entries included); the fallback path agrees."""
    from shardplan.search.constrained import _row_classes

    rng = np.random.default_rng(3)
    base = rng.integers(0, 3, size=(7, 5)).astype(float)
    base[2, 1] = np.inf
    rows = base[rng.integers(0, 7, size=60)]
    inv = _row_classes(rows)
    for i in range(len(rows)):
        for j in range(len(rows)):
            assert (inv[i] == inv[j]) == bool(np.array_equal(rows[i], rows[j]))
    # a NaN defeats the check (NaN != NaN): the rows are then classed by np.unique(axis=0)
    odd = rows.copy()
    odd[0, 0] = np.nan
    inv2 = _row_classes(odd)
    assert inv2.shape == (len(rows),) and inv2.max() + 1 == len(np.unique(odd, axis=0))
    assert _row_classes(np.zeros((4, 0))).tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("seed", range(0, 60, 3))
def test_stored_lagrangian_points_change_nothing(seed):
    """The full search after a root-only one on the same store (as solve_fit runs each micro-batch count) gives
    the same plan, cost, bound and status as the full search alone, and takes the root's points from the store."""
    mp = memory_problem(seed, (0.0, 0.3, 0.7, 0.95)[seed % 4])
    alone = solve_memory(mp)
    solved: dict = {}
    root = solve_memory(mp, max_nodes=1, fix_iters=-1, solved=solved)
    stored = len(solved)
    again = solve_memory(mp, solved=solved)
    assert (again.assignment, again.cost, again.bound, again.optimal) == (alone.assignment, alone.cost, alone.bound,
                                                                         alone.optimal)
    per_solve = ("dp_solves", "dp_reused", "dp_seconds", "work_parts")  # the work's total is compared, not its split
    assert {k: v for k, v in again.stats.items() if k not in per_solve} == \
        {k: v for k, v in alone.stats.items() if k not in per_solve}
    a, b = again.stats["work_parts"], alone.stats["work_parts"]
    assert a["dp"] + a["dp_stored"] == pytest.approx(b["dp"] + b["dp_stored"], rel=1e-12) and a["dp_stored"] > 0
    assert root.stats["dp_solves"] == stored >= 1
    assert again.stats["dp_reused"] > alone.stats["dp_reused"]
    assert again.stats["dp_solves"] + again.stats["dp_reused"] == alone.stats["dp_solves"] + alone.stats["dp_reused"]


def _fix_case(mp: MemoryProblem, lam: float, cutoff: float, screen: bool) -> list[np.ndarray]:
    from shardplan.search.constrained import _Ctx, _fix

    allowed = [np.ones(len(b), dtype=bool) for b in mp.base]
    return _fix(_Ctx(mp, solve_dp, 1e-9), allowed, lam, cutoff, 5, screen=screen)


def test_screened_fixing_keeps_every_choice_of_a_plan_below_the_cutoff():
    """Reduced-cost fixing with the plain-forest screen before its TRW-S sweeps (and without it) keeps every
    choice that some feasible assignment below the cutoff uses (brute force over all assignments), and the
    screen does drop configurations on these instances (else this test could not fail)."""
    from shardplan.search.bounds import BoundState, _forest_pass
    from shardplan.search.constrained import _lagrangian_problem, enumerate_choices

    screened = 0
    for seed in range(24):
        mp = identical_chain(7, 35.0 + seed) if seed % 3 == 0 else memory_problem(seed, (0.3, 0.7, 0.95)[seed % 3])
        digits, f = enumerate_choices(mp.problem, mp.base, mp.cost, max_combinations=10**7)
        mem = np.full(len(f), mp.fixed)
        for v, dv in enumerate(digits):
            mem += mp.memory[v][dv]
        feasible = mem <= mp.budget
        opt = float(f[feasible].min())
        for lam in (0.0, 0.05, 0.3):
            for cutoff in (opt * 1.001 + 1e-3, opt + 2.0, opt * 0.999 - 1e-3):
                below = feasible & (f < cutoff)
                for screen in (True, False):
                    out = _fix_case(mp, lam, cutoff, screen)
                    for v, dv in enumerate(digits):
                        assert out[v][np.unique(dv[below])].all(), (seed, lam, cutoff, screen, v)
                sub, _, _ = _lagrangian_problem(mp, lam, [np.ones(len(b), dtype=bool) for b in mp.base])
                lbs0, _, _ = _forest_pass(BoundState.from_problem(sub))
                screened += sum(int((x - lam * mp.budget >= cutoff).sum()) for x in lbs0)
    assert screened > 0


def _frontier_reference(mp: MemoryProblem, allowed, cutoff: float, lam: float):
    """The front program as first written: every (point, choice) candidate formed with its frontier columns,
    all sorted by (state, memory, cost), then the Pareto scan, the band and the completion test. Returns
    (value, choices) of the best plan within the budget, (inf, None) when none is below the cutoff."""
    from shardplan.search.constrained import _completion_bounds, _frontier_classes, _frontier_plan

    p = mp.problem
    n = p.num_vertices
    idx = [np.flatnonzero(ok) for ok in allowed]
    cfgs = [np.unique(mp.base[v][i]) for v, i in enumerate(idx)]
    plan = _frontier_plan(p)
    classes = _frontier_classes(p, cfgs, plan)
    nbr: dict = {}
    for e, (s, d) in enumerate(p.edges):
        nbr.setdefault(max(s, d), []).append((min(s, d), e, s < d))
    start, rest = _completion_bounds(mp, idx, cfgs, plan, classes, nbr, lam)
    lmin = start + lam * mp.fixed
    reach = cutoff + lam * mp.budget
    reach += 1e-9 * max(abs(reach), abs(lmin), 1e-300)
    least_m = np.array([float(mp.memory[v][i].min()) for v, i in enumerate(idx)])
    least_c = np.array([float(mp.cost[v][i].min()) for v, i in enumerate(idx)])
    rest_m = np.concatenate([np.cumsum(least_m[::-1])[::-1], [0.0]])
    rest_c = np.concatenate([np.cumsum(least_c[::-1])[::-1], [0.0]])
    band = cutoff + lam * mp.budget - lmin + 1e-9 * max(abs(cutoff), abs(lmin), 1e-300)
    cols, F, M = np.zeros((1, 0), dtype=np.int64), np.array([0.0]), np.array([mp.fixed])
    back = []
    for v in range(n):
        front, after = plan[v]
        pos = {u: k for k, u in enumerate(front)}
        j = idx[v]
        jc = np.searchsorted(cfgs[v], mp.base[v][j])
        P, J = len(F), len(j)
        add = np.broadcast_to(mp.cost[v][j], (P, J)).copy()
        for u, e, v_is_dst in nbr.get(v, ()):
            cu = cfgs[u][cols[:, pos[u]]]
            mat = p.edge_cost[e]
            add += mat[np.ix_(cu, mp.base[v][j])] if v_is_dst else mat[np.ix_(mp.base[v][j], cu)].T
        nf, nm = (F[:, None] + add).ravel(), (M[:, None] + mp.memory[v][j][None, :]).ravel()
        parent, choice = np.repeat(np.arange(P), J), np.tile(np.arange(J), P)
        newcols = cols[parent][:, [pos[u] for u in after if u != v]]
        if v in after:
            newcols = np.concatenate([newcols, jc[choice][:, None]], axis=1)
        sel = np.flatnonzero((nm + rest_m[v + 1] <= mp.budget) & (nf + rest_c[v + 1] < cutoff))
        if not len(sel):
            return np.inf, None
        nf, nm, parent, choice, newcols = nf[sel], nm[sel], parent[sel], choice[sel], newcols[sel]
        key = np.zeros(len(nf), dtype=np.int64)
        for k, (of, count) in enumerate(classes[v]):
            key = key * count + of[newcols[:, k]]
        lag = nf + lam * nm
        order = np.lexsort((nf, nm, key))
        keep = []
        best_f: dict = {}
        best_lag = {int(s): float(lag[key == s].min()) for s in np.unique(key)}
        for i in order:
            s = int(key[i])
            pareto = s not in best_f or nf[i] < best_f[s]
            best_f[s] = min(best_f.get(s, np.inf), nf[i])
            if pareto and lag[i] - best_lag[s] < band and lag[i] + rest[v][s] < reach:
                keep.append(i)
        order = np.array(keep, dtype=np.int64)
        cols, F, M = newcols[order], nf[order], nm[order]
        back.append((parent[order], choice[order]))
    ok = np.flatnonzero(M <= mp.budget)
    if not len(ok):
        return np.inf, None
    at = int(ok[np.argmin(F[ok])])
    chosen = np.zeros(n, dtype=np.int64)
    for v in range(n - 1, -1, -1):
        parent, choice = back[v]
        chosen[v] = idx[v][choice[at]]
        at = int(parent[at])
    return mp.evaluate(chosen)[0], tuple(int(x) for x in chosen)


@pytest.mark.parametrize("seed", range(30))
def test_frontier_program_keeps_what_the_sort_of_every_candidate_keeps(seed):
    # the point tests run before the sort (constrained._frontier_dp): the plan, its cost and its choices (the
    # tie-break included) equal those of the straightforward program that sorts every candidate first
    from shardplan.search.constrained import _Ctx, _frontier_dp

    mp = linked_memory_problem(seed, n=9, layouts=(0, 2, 3)[seed % 3])
    ref = solve_memory_bruteforce(mp)
    rng = np.random.default_rng(500 + seed)
    allowed = [rng.random(len(b)) < 0.85 for b in mp.base]
    for ok in allowed:
        ok[rng.integers(0, len(ok))] = True
    for lam in (0.0, float(rng.uniform(0.0, 2.0))):
        for cutoff in (np.inf, ref.cost + 0.5, ref.cost + 3.0):
            want = _frontier_reference(mp, allowed, cutoff, lam)
            ctx = _Ctx(mp, lambda q: solve_dp(q), 1e-9)
            done, value = _frontier_dp(ctx, allowed, cutoff, lam, 10**6)
            assert done and value == want[0]
            assert (ctx.best.choices if ctx.best is not None else None) == want[1]
