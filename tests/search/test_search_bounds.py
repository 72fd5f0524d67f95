"""Bound pruning (shardplan.search.bounds) is exact: valid bounds, every optimum survives."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from randgraphs import random_problem
from shardplan.search import Problem, solve_bruteforce, solve_dp
from shardplan.search.bounds import BoundState, _forest_pass, bound_prune, trws
from shardplan.search.dp import solve_small


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))


def all_costs(p: Problem) -> tuple[list[tuple[int, ...]], np.ndarray]:
    assigns = list(itertools.product(*(range(k) for k in p.sizes)))
    return assigns, np.array([p.evaluate(a) for a in assigns])


def tie_problem(seed: int) -> Problem:
    """Small integer costs: many ties, so many optimal assignments."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 7))
    edges = [(i, j) for i in range(n) for j in range(i + 1, n) if rng.random() < 0.6] or [(0, 1)]
    ks = [int(rng.integers(1, 5)) for _ in range(n)]
    return Problem(names=tuple(f"v{i}" for i in range(n)), configs=tuple(tuple((j,) for j in range(k)) for k in ks),
                   vertex_cost=tuple(rng.integers(0, 3, size=k).astype(float) for k in ks), edges=tuple(edges),
                   edge_cost=tuple(rng.integers(0, 3, size=(ks[s], ks[d])).astype(float) for s, d in edges))


@pytest.mark.parametrize("seed", range(120))
def test_bounds_are_valid_min_marginal_lower_bounds(seed: int) -> None:
    p = random_problem(3000 + seed, n_max=7, k_max=4) if seed % 2 else tie_problem(seed)
    assigns, costs = all_costs(p)
    st = BoundState.from_problem(p)
    for iters in (0, 1, 4):
        if iters:
            trws(st, list(range(p.num_vertices)), iters)
        lbs, a, val = _forest_pass(st, exact_weights=bool(iters % 2))
        assert val <= costs.min() + 1e-9 * max(1.0, costs.min())
        for v in range(p.num_vertices):
            for k in range(p.sizes[v]):
                best = min(c for x, c in zip(assigns, costs) if x[v] == k)
                assert lbs[v][k] <= best + 1e-9 * max(1.0, best), (iters, v, k)


@pytest.mark.parametrize("seed", range(120))
def test_bound_pruning_keeps_every_optimum(seed: int) -> None:
    p = random_problem(4000 + seed, n_max=7, k_max=4) if seed % 2 else tie_problem(seed)
    assigns, costs = all_costs(p)
    red, stats = bound_prune(p, exact_solver=solve_small)
    opt = costs.min()
    assert close(solve_bruteforce(red.problem).cost, opt)
    kept = [set(int(x) for x in k) for k in red.keep]
    for x, c in zip(assigns, costs):
        if c <= opt:  # every optimal assignment survives, not just one
            assert all(x[v] in kept[v] for v in range(p.num_vertices)), x
    assert stats["lower_bound"] <= opt + 1e-9 * max(1.0, opt) and stats["upper_bound"] >= opt - 1e-9 * max(1.0, opt)
    assert stats["configs_after"] == sum(red.problem.sizes) <= stats["configs_before"] == sum(p.sizes)
    assert close(p.evaluate(stats["incumbent"]), stats["upper_bound"])
    s = solve_dp(p)
    assert close(s.cost, opt) and s.stats["bounds"]["enabled"]


@pytest.mark.parametrize("seed", range(30))
def test_bounded_dp_on_larger_graphs(seed: int) -> None:
    p = random_problem(5000 + seed, n_max=24, k_max=6)
    plain = solve_dp(p, prune=False, bounds=False)
    for prune in (True, False):
        s = solve_dp(p, prune=prune, bounds=True)
        assert close(s.cost, plain.cost)


def test_bounded_dp_on_a_real_model() -> None:
    from shardplan.cost import build_tables
    from shardplan.machine import preset
    from shardplan.models import model_spec

    for name, p in (("alexnet", 8), ("inception_v3", 4)):
        spec = model_spec(name)
        problem = build_tables(spec.build(None), preset("paper", p), cutoff=spec.cutoff).to_problem()
        plain = solve_dp(problem, bounds=False)
        bounded = solve_dp(problem, bounds=True)
        assert bounded.cost == pytest.approx(plain.cost, rel=1e-12, abs=0.0), name
        b = bounded.stats["bounds"]
        assert b["configs_after"] <= b["configs_before"] == sum(problem.sizes)
        assert b["lower_bound"] <= bounded.cost * (1 + 1e-9) and b["upper_bound"] >= bounded.cost * (1 - 1e-9)


def _trws_every_message(st: BoundState, order: list[int], iters: int) -> None:
    """TRW-S as written in the paper: every message recomputed on every sweep (the reference for trws's skips)."""
    n = st.n
    nbrs: list[list[int]] = [[] for _ in range(n)]
    for u, w in st.pairs:
        nbrs[u].append(w)
        nbrs[w].append(u)
    if st.msg is None:
        st.msg = {}
        for u, w in st.pairs:
            st.msg[(u, w)], st.msg[(w, u)] = np.zeros(len(st.unary[w])), np.zeros(len(st.unary[u]))
    pos = {v: i for i, v in enumerate(order)}
    gamma = []
    for v in range(n):
        before = sum(1 for w in nbrs[v] if pos[w] < pos[v])
        gamma.append(1.0 / max(1, before, len(nbrs[v]) - before))
    for _ in range(iters):
        for seq, later in ((order, True), (order[::-1], False)):
            for s in seq:
                out = [t for t in nbrs[s] if (pos[t] > pos[s]) == later]
                if not out:
                    continue
                hat = st.unary[s].copy()
                for u in nbrs[s]:
                    hat += st.msg[(u, s)]
                hat *= gamma[s]
                for t in out:
                    mat = st.pairs[(s, t)] if (s, t) in st.pairs else st.pairs[(t, s)].T
                    m = ((hat - st.msg[(t, s)])[:, None] + mat).min(axis=0)
                    st.msg[(s, t)] = m - m.min()


@pytest.mark.parametrize("seed", range(40))
def test_trws_skips_change_no_message(seed: int) -> None:
    """trws skips messages into one-configuration vertices that already hold [0]: the messages equal, bit for bit,
    those of recomputing every message, also after a restriction leaves stale messages into such vertices."""
    p = random_problem(5000 + seed, n_max=9, k_max=4)
    fast, ref = BoundState.from_problem(p), BoundState.from_problem(p)
    order = list(range(p.num_vertices))
    trws(fast, order, 2)
    _trws_every_message(ref, order, 2)
    assert fast.msg.keys() == ref.msg.keys() and all(np.array_equal(fast.msg[k], ref.msg[k]) for k in ref.msg)
    keep = [np.arange(1) if v % 2 == 0 else np.arange(k) for v, k in enumerate(p.sizes)]  # stale messages now
    fast.restrict(keep)
    ref.restrict(keep)
    trws(fast, order, 2)
    _trws_every_message(ref, order, 2)
    assert all(np.array_equal(fast.msg[k], ref.msg[k]) for k in ref.msg)


def _chain_of_blocks(seed: int, blocks: int) -> Problem:
    """Identical blocks of three vertices in a chain (shared cost vectors and matrices, as identical layers)."""
    rng = np.random.default_rng(seed)
    ks = [int(x) for x in rng.integers(2, 6, size=3)]
    unary = [rng.integers(0, 4, size=k).astype(float) for k in ks]
    inner = [rng.integers(0, 4, size=(ks[a], ks[b])).astype(float) for a, b in ((0, 1), (0, 2), (1, 2))]
    link = rng.integers(0, 4, size=(ks[2], ks[0])).astype(float)
    edges, mats = [], []
    for i in range(blocks):
        o = 3 * i
        edges += [(o, o + 1), (o, o + 2), (o + 1, o + 2)]
        mats += inner
        if i:
            edges.append((o - 1, o))
            mats.append(link)
    return Problem(names=tuple(f"v{i}" for i in range(3 * blocks)),
                   configs=tuple(tuple((j,) for j in range(ks[v % 3])) for v in range(3 * blocks)),
                   vertex_cost=tuple(unary[v % 3] for v in range(3 * blocks)), edges=tuple(edges),
                   edge_cost=tuple(mats))


@pytest.mark.parametrize("seed", range(20))
def test_repeated_messages_are_computed_once_and_change_nothing(seed: int, monkeypatch) -> None:
    """Identical blocks repeat min-plus messages: the forest pass and TRW-S compute each distinct one once
    (bounds._MinPlusMemo), and the bounds and messages equal, bit for bit, those of computing every message
    (a copy of the problem whose matrices are all distinct arrays, where nothing can repeat)."""
    import shardplan.search.bounds as bounds

    p = _chain_of_blocks(seed, 6)
    own = Problem(p.names, p.configs, tuple(c.copy() for c in p.vertex_cost), p.edges,
                  tuple(m.copy() for m in p.edge_cost))
    hits = []

    class Counting(bounds._MinPlusMemo):
        def __call__(self, vec, mat):
            out = super().__call__(vec, mat)
            hits.append(self.hits)
            return out

    monkeypatch.setattr(bounds, "_MinPlusMemo", Counting)
    monkeypatch.setattr(bounds, "_MEMO_MIN", 0)  # these matrices are small: memoise them all
    shared, alone = BoundState.from_problem(p), BoundState.from_problem(own)
    for exact in (False, True):
        a, b = _forest_pass(shared, exact), _forest_pass(alone, exact)
        assert all(np.array_equal(x, y) for x, y in zip(a[0], b[0]))
        assert np.array_equal(a[1], b[1]) and a[2] == b[2]
    order = list(range(p.num_vertices))
    trws(shared, order, 2)
    _trws_every_message(alone, order, 2)
    assert shared.msg.keys() == alone.msg.keys()
    assert all(np.array_equal(shared.msg[k], alone.msg[k]) for k in alone.msg)
    a, b = _forest_pass(shared, True), _forest_pass(alone, True)
    assert all(np.array_equal(x, y) for x, y in zip(a[0], b[0])) and a[2] == b[2]
    assert max(hits) > 0  # some message did repeat (else this test would not exercise the memo)
