"""Repeated structure: the DP's memo of equal eliminations, cut-vertex orderings, orbit-symmetric reductions.

Every test compares against a solver that knows nothing of the repetition
(brute force, the ILP, the DP with ``memo=False``), on chains of identical
blocks as a Transformer's layers lower to.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from randgraphs import random_problem
from shardplan.search import Problem, solve_bfs_dp, solve_bruteforce, solve_dp, solve_ilp
from shardplan.search.bounds import bound_prune
from shardplan.search.dp import solve_small
from shardplan.search.memo import ArrayLedger, EliminationMemo, MemoEntry, digest
from shardplan.search.ordering import adjacency, articulation_points, min_table, order_work
from shardplan.search.reduce import orbits, reduce_problem, symmetric_reduction


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))


def block_chain(layers: int, seed: int, k: int = 3, copies: bool = False) -> Problem:
    """head -> layers x [a, b, c, d] -> tail; inside a layer a->b, a->c, b->d, c->d (a cycle), d -> next a.

    Every layer uses the same cost arrays (``copies``: equal arrays, not the
    same objects, so only the digests can tell). Cut vertices: each layer's
    a and d.
    """
    rng = np.random.default_rng(seed)
    kk = [int(x) for x in rng.integers(2, k + 1, size=4)]
    unary = [rng.integers(0, 5, size=kk[i]).astype(float) for i in range(4)]
    inner = {(0, 1): rng.random((kk[0], kk[1])), (0, 2): rng.random((kk[0], kk[2])),
             (1, 3): rng.integers(0, 3, size=(kk[1], kk[3])).astype(float), (2, 3): rng.random((kk[2], kk[3]))}
    link = rng.random((kk[3], kk[0]))
    names, configs, costs, edges, ecost = ["head"], [((0,), (1,))], [rng.random(2)], [], []
    head_link = rng.random((2, kk[0]))
    prev = 0
    for layer in range(layers):
        base = len(names)
        for i in range(4):
            names.append(f"L{layer}/{'abcd'[i]}")
            configs.append(tuple((j,) for j in range(kk[i])))
            costs.append(unary[i].copy() if copies else unary[i])
        for (s, d), m in inner.items():
            edges.append((base + s, base + d))
            ecost.append(m.copy() if copies else m)
        edges.append((prev, base))
        ecost.append(head_link if layer == 0 else (link.copy() if copies else link))
        prev = base + 3
    names.append("tail")
    configs.append(((0,), (1,), (2,)))
    costs.append(rng.random(3))
    edges.append((prev, len(names) - 1))
    ecost.append(rng.random((kk[3], 3)))
    return Problem(names=tuple(names), configs=tuple(configs), vertex_cost=tuple(costs), edges=tuple(edges),
                   edge_cost=tuple(ecost))


@pytest.mark.parametrize("seed", range(12))
def test_memo_on_a_chain_of_identical_blocks_is_exact_and_reuses(seed: int) -> None:
    p = block_chain(3 + seed % 2 + 2 * (seed % 3 == 1), seed, k=2 + seed % 2, copies=bool(seed % 2))
    ref = (solve_bruteforce(p) if np.prod([float(k) for k in p.sizes]) <= 2**17 else solve_bfs_dp(p)).cost
    for bounds, prune in ((False, False), (True, True), (False, True)):
        s = solve_dp(p, bounds=bounds, prune=prune)
        plain = solve_dp(p, bounds=bounds, prune=prune, memo=False)
        assert close(s.cost, ref) and close(plain.cost, ref), (bounds, prune)
        assert s.optimal and s.cost == p.evaluate(s.assignment)
        assert "memo" not in plain.stats
    s = solve_dp(p, bounds=False, prune=False)
    assert s.stats["memo"]["false_matches"] == 0
    cut = articulation_points(adjacency(p))
    order = min_table(p)
    if all(v in cut for v in order[len(order) - len(cut):]):  # the layers are reduced first: repeats
        assert s.stats["memo"]["hits"] > 0


@pytest.mark.parametrize("seed", range(3))
def test_memo_agrees_with_the_ilp_on_longer_chains(seed: int) -> None:
    p = block_chain(8, 100 + seed, k=4)
    ilp = solve_ilp(p, time_limit=30)
    assert ilp.optimal
    s = solve_dp(p, bounds=False, prune=False)
    assert close(s.cost, ilp.cost)
    # 8 identical layers, each reduced to a table over its cut vertices a and d: the interior
    # eliminations (b and c) of every layer after the first are repeats
    assert s.stats["memo"]["hits"] >= 2 * (8 - 1)


def test_memo_never_reuses_a_result_for_different_inputs() -> None:
    """A key that matches (as a forged digest collision would) with unequal inputs is a miss, not a hit."""
    ledger = ArrayLedger()
    memo = EliminationMemo(1 << 20, ledger)
    a, b = np.array([1.0, 2.0]), np.array([1.0, 3.0])
    entry = MemoEntry(inputs=(a,), table=np.zeros(1), table_maps=(), step_maps=(), arg=np.zeros(1, dtype=np.int64))
    memo.put(("k",), entry)
    assert ledger.total == sum(x.nbytes for x in entry.arrays())
    assert memo.get(("k",), (b,)) is None and memo.false_matches == 1
    assert memo.get(("k",), (a.copy(),)) is entry and memo.hits == 1
    memo.clear()
    assert ledger.total == 0 and len(memo) == 0


def test_memo_budget_drops_oldest_and_ledger_counts_shared_arrays_once() -> None:
    ledger = ArrayLedger()
    shared = np.zeros(1000)
    memo = EliminationMemo(3 * shared.nbytes, ledger)
    for i in range(3):
        memo.put((i,), MemoEntry(inputs=(shared,), table=np.zeros(10), table_maps=(), step_maps=(),
                                 arg=np.zeros(10, dtype=np.int64)))
    # each entry counts ``shared`` in its own budget, the ledger holds it once
    assert len(memo) == 2
    assert ledger.total == shared.nbytes + 2 * (80 + 80)
    assert memo.get((0,), (shared,)) is None and memo.get((2,), (shared,)) is not None


def test_digest_sees_dtype_shape_and_contents() -> None:
    x = np.arange(6, dtype=np.float64)
    assert digest(x) == digest(x.copy())
    assert digest(x) != digest(x.reshape(2, 3)) != digest(x.astype(np.float32))
    assert digest(x.reshape(2, 3).T) == digest(np.ascontiguousarray(x.reshape(2, 3).T))
    y = x.copy()
    y[5] = 5.5
    assert digest(x) != digest(y)


def _brute_cut_vertices(adj: list[set[int]]) -> set[int]:
    def components(skip: int) -> int:
        seen, count = {skip}, 0
        for r in range(len(adj)):
            if r in seen:
                continue
            count += 1
            stack = [r]
            seen.add(r)
            while stack:
                v = stack.pop()
                for w in adj[v] - seen:
                    seen.add(w)
                    stack.append(w)
        return count

    base = components(-1)
    return {v for v in range(len(adj)) if components(v) > base - (1 if not adj[v] else 0)}


@pytest.mark.parametrize("seed", range(40))
def test_articulation_points_match_removal(seed: int) -> None:
    p = random_problem(seed, n_max=12)
    adj = adjacency(p)
    assert articulation_points(adj) == _brute_cut_vertices(adj)


def test_min_table_reduces_each_layer_before_its_cut_vertices() -> None:
    p = block_chain(6, 0)
    cut = articulation_points(adjacency(p))
    assert {p.names[v] for v in cut} == {f"L{i}/{c}" for i in range(6) for c in "ad"}
    order = min_table(p)
    interior = [i for i, v in enumerate(order) if v not in cut]
    assert max(interior) < min(i for i, v in enumerate(order) if v in cut)
    assert order_work(p, order)[0] <= 3 ** 3


@pytest.mark.parametrize("seed", range(20))
def test_symmetric_reduction_keeps_the_optimum(seed: int) -> None:
    """Whatever restriction keeps an optimum, its orbit-union does, and equal parts share arrays."""
    p = block_chain(3, seed, k=2, copies=bool(seed % 2))
    opt = solve_bruteforce(p)
    rng = np.random.default_rng(seed)
    keep = [np.union1d([a], rng.choice(k, size=int(rng.integers(1, k + 1)), replace=False))
            for a, k in zip(opt.assignment, p.sizes)]
    red = symmetric_reduction(p, keep, {})
    orb = orbits(p)
    for v, w in itertools.combinations(range(p.num_vertices), 2):
        if orb[v] == orb[w]:
            assert np.array_equal(red.keep[v], red.keep[w])
            assert red.problem.vertex_cost[v] is red.problem.vertex_cost[w]
    for v, k in enumerate(keep):
        assert set(k) <= set(red.keep[v])
    sub = solve_bruteforce(red.problem)
    assert close(sub.cost, opt.cost)
    assert close(p.evaluate(red.lift(sub.assignment)), opt.cost)


@pytest.mark.parametrize("seed", range(10))
def test_symmetric_bounds_and_cached_reduction_keep_the_optimum(seed: int) -> None:
    p = block_chain(4, 50 + seed, k=2)
    ref = solve_bruteforce(p).cost
    red, _ = bound_prune(p, exact_solver=solve_small, symmetric=True)
    orb = orbits(p)
    for v, w in itertools.combinations(range(p.num_vertices), 2):
        if orb[v] == orb[w]:
            assert np.array_equal(red.keep[v], red.keep[w])
    assert close(solve_bruteforce(red.problem).cost, ref)
    r2 = reduce_problem(p)  # shared cost arrays: the per-vertex cache is used
    assert close(solve_bruteforce(r2.problem).cost, ref)
    assert r2.stats["configs_after"] == reduce_problem(block_chain(4, 50 + seed, k=2, copies=True)).stats["configs_after"]


def test_zoo_gpt_layers_memo_equals_plain_dp() -> None:
    """Four identical GPT layers on 8 H100s: the memoised DP finds the plain DP's optimum and reuses steps."""
    from shardplan.cost import build_tables
    from shardplan.machine import preset
    from shardplan.models import model_spec

    ms = model_spec("gpt")
    g = ms.build(layers=4, d_model=256, heads=4, seq=128, vocab=8192, batch=8)
    p = build_tables(g, preset("h100", 8), cutoff=ms.cutoff).to_problem()
    fast = solve_dp(p, bounds=False)
    plain = solve_dp(p, bounds=False, memo=False)
    assert fast.cost == pytest.approx(plain.cost, rel=1e-12)
    assert fast.stats["memo"]["hits"] > fast.stats["memo"]["misses"]
    assert solve_dp(p).cost == pytest.approx(plain.cost, rel=1e-12)
