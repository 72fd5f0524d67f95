"""Random solver-level problems for tests (fixed seeds, small enough for brute force).

``random_problem(seed)`` picks a shape (path, tree, DAG with skip connections,
diamond, near-complete, disconnected pieces; sometimes parallel edges) and
random costs that include ties, zeros and separable edge matrices, with K in
1..5 per vertex.
"""

from __future__ import annotations

import numpy as np

from shardplan.search.constrained import solve_memory
from shardplan.search.peak import PeakProblem
from shardplan.search.problem import Problem

SHAPES = ("path", "tree", "skipdag", "diamond", "complete", "disconnected")


def _edges(shape: str, n: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    if shape == "path":
        return [(i, i + 1) for i in range(n - 1)]
    if shape == "tree":
        return [(int(rng.integers(0, i)), i) for i in range(1, n)]
    if shape == "skipdag":
        e = [(i, i + 1) for i in range(n - 1)]
        for _ in range(max(1, n // 3)):
            a = int(rng.integers(0, n - 2)) if n > 2 else 0
            b = int(rng.integers(a + 2, n)) if a + 2 < n else a + 1
            if b < n and a != b:
                e.append((a, b))
        return e
    if shape == "diamond":
        e: list[tuple[int, int]] = []
        cur = 0
        nxt = 1
        while nxt + 2 < n:  # cur -> (a, b) -> join
            a, b, j = nxt, nxt + 1, nxt + 2
            e += [(cur, a), (cur, b), (a, j), (b, j)]
            cur, nxt = j, nxt + 3
        while nxt < n:
            e.append((cur, nxt))
            cur, nxt = nxt, nxt + 1
        return e
    if shape == "complete":
        return [(i, j) for i in range(n) for j in range(i + 1, n) if rng.random() < 0.8]
    if shape == "disconnected":
        cut = max(1, n // 2)
        e = [(int(rng.integers(0, i)), i) for i in range(1, cut)]
        e += [(i, i + 1) for i in range(cut, n - 1) if rng.random() < 0.7]
        return e
    raise ValueError(shape)


def _costs(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    kind = rng.integers(0, 5)
    if kind == 0:  # small integers: many ties and zeros
        return rng.integers(0, 4, size=shape).astype(float)
    if kind == 1:
        return rng.random(shape) * 10
    if kind == 2 and len(shape) == 2:  # separable r[a] + c[b]: the ILP folds such edges into the vertices
        return rng.random(shape[0])[:, None] + rng.random(shape[1])[None, :]
    if kind == 3:
        return np.zeros(shape)
    m = rng.random(shape)
    m[rng.random(shape) < 0.4] = 0.0
    return m


def random_problem(seed: int, n_max: int = 8, k_max: int = 5, shape: str | None = None) -> Problem:
    """A random problem with 1..n_max vertices and 1..k_max configurations each."""
    rng = np.random.default_rng(seed)
    shape = shape or SHAPES[seed % len(SHAPES)]
    n = int(rng.integers(1, n_max + 1))
    edges = _edges(shape, n, rng)
    if edges and rng.random() < 0.3:  # parallel and antiparallel edges
        s, d = edges[int(rng.integers(0, len(edges)))]
        edges.append((s, d) if rng.random() < 0.5 else (d, s))
    edges = [(s, d) if rng.random() < 0.7 else (d, s) for s, d in edges]
    ks = [int(rng.integers(1, k_max + 1)) for _ in range(n)]
    return Problem(
        names=tuple(f"v{i}" for i in range(n)),
        configs=tuple(tuple((j + 1,) for j in range(k)) for k in ks),
        vertex_cost=tuple(_costs(rng, (k,)) for k in ks),
        edges=tuple(edges),
        edge_cost=tuple(_costs(rng, (ks[s], ks[d])) for s, d in edges),
    )


def complete(n: int, k: int, seed: int = 0) -> Problem:
    """Every pair joined: eliminating the first vertex builds a table over all the others."""
    rng = np.random.default_rng(seed)
    edges = [(i, j) for i in range(n) for j in range(i + 1, n)]
    return Problem(tuple(f"v{i}" for i in range(n)), tuple(tuple((j,) for j in range(k)) for _ in range(n)),
                   tuple(rng.random(k) for _ in range(n)), tuple(edges), tuple(rng.random((k, k)) for _ in edges))


def spider(legs: int, length: int, k: int = 2, seed: int = 0) -> Problem:
    """A tree: one centre, ``legs`` paths of ``length`` vertices; breadth-first order keeps every leg open."""
    rng = np.random.default_rng(seed)
    n = 1 + legs * length
    edges = []
    for leg in range(legs):
        prev = 0
        for j in range(length):
            v = 1 + leg * length + j
            edges.append((prev, v))
            prev = v
    return Problem(tuple(f"v{i}" for i in range(n)), tuple(tuple((j,) for j in range(k)) for _ in range(n)),
                   tuple(rng.random(k) for _ in range(n)), tuple(edges), tuple(rng.random((k, k)) for _ in edges))


def exact_solvers_agree(problem: Problem):
    """Solve ``problem`` with the DP, brute force and the ILP (HiGHS), assert the three optima agree, and
    return the DP's solution."""
    import pytest

    from shardplan.search import solve_dp, solve_ilp
    from shardplan.search.reference import solve_bruteforce

    dp = solve_dp(problem)
    assert dp.cost == pytest.approx(solve_bruteforce(problem).cost, rel=1e-9)
    ilp = solve_ilp(problem, time_limit=60)
    assert ilp.optimal and ilp.cost == pytest.approx(dp.cost, rel=1e-6)
    return dp


def peak_problem(seed: int, tight: float) -> PeakProblem:
    """A random problem with 1-3 choices per configuration, integer rest / saved / grad bytes, and a budget
    ``tight`` of the way from a lower bound of the least peak to the unconstrained optimum's peak."""
    p = random_problem(seed, n_max=7, k_max=4)
    rng = np.random.default_rng(2000 + seed)
    base, cost, rest, saved, grad = [], [], [], [], []
    for v, k in enumerate(p.sizes):
        reps = rng.integers(1, 4, size=k)
        b = np.repeat(np.arange(k), reps)
        base.append(b)
        c = p.vertex_cost[v][b] + np.where(np.arange(len(b)) % 2 == 1, rng.integers(0, 3, len(b)), 0)
        cost.append(c.astype(float))
        rest.append(rng.integers(0, 4, size=len(b)).astype(float))
        saved.append(rng.integers(0, 10, size=len(b)).astype(float))
        grad.append(rng.integers(0, 10, size=len(b)).astype(float))
    loose = PeakProblem(p, tuple(base), tuple(cost), tuple(rest), tuple(saved), tuple(grad), budget=1e9, fixed=3.0)
    top = loose.evaluate(solve_memory(loose.additive()).assignment)[1]
    least = loose.least_peak()
    budget = float(np.floor(least + tight * (top - least)))
    return PeakProblem(p, tuple(base), tuple(cost), tuple(rest), tuple(saved), tuple(grad), budget=budget, fixed=3.0)


def random_attention_graph(seed: int, core, bandwidths=(1e7, 1e8), prefix: str = "f"):
    """(graph, machine): q, k and v each from an elementwise operator or a product with a weight, the fused
    attention core with the keyword arguments ``core(rng)`` draws, sometimes an output projection; a random
    4-device machine (link bandwidth one of ``bandwidths``) with or without HBM."""
    from shardplan import ops
    from shardplan.ir import GraphBuilder
    from shardplan.machine import Machine

    rng = np.random.default_rng(seed)
    S, H, K = 16, 2, 4
    b = GraphBuilder(f"{prefix}{seed}")
    x = b.input("x", (1, S, H, K), needs_grad=True)

    def proj(name, letters):
        if rng.random() < 0.5:
            return b.add(ops.einsum(name, f"{letters[:3]}c,ck->{letters}", x, ops.Param((K, K))))
        return b.add(ops.elementwise(name, x, letters=letters))

    q, k, v = proj("q", "bshk"), proj("k", "bthk"), proj("v", "bthk")
    a = b.add(ops.flash_attention("attn", q, k, v, "bshk", "bthk", **core(rng)))
    if rng.random() < 0.5:
        b.add(ops.einsum("out", "bshk,hkd->bsd", a, ops.Param((H, K, 4))))
    m = Machine(4, peak_flops=float(rng.choice([1e7, 1e8, 1e9])), bandwidth=float(rng.choice(list(bandwidths))),
                latency=float(rng.choice([0.0, 1e-6, 1e-5])), dtype_bytes=4,
                hbm_bandwidth=[None, 1e9][int(rng.integers(0, 2))])
    return b.build(), m


def random_product_graph(seed: int):
    """A small random graph of products (some outputs read twice), additions and norms over x[8, 8], ending in a
    product (the overlapped-collective tests: tests/cost/test_overlap_tp.py, test_overlap_dgrad.py, test_contention.py)."""
    from shardplan import ops
    from shardplan.ir import GraphBuilder

    rng = np.random.default_rng(seed)
    b = GraphBuilder(f"g{seed}")
    vals = [b.input("x", (8, 8), needs_grad=True)]
    vals.append(b.add(ops.dense("fc", vals[0], 8)))
    for i in range(int(rng.integers(1, 4))):
        kind = int(rng.integers(0, 4))
        a = vals[int(rng.integers(1, len(vals)))]
        if kind in (0, 3):
            vals.append(b.add(ops.dense(f"fc{i}", a, 8)))
        elif kind == 1:
            c = vals[int(rng.integers(0, len(vals)))]
            vals.append(b.add(ops.elementwise(f"add{i}", a, c, kind="add")))
        else:
            vals.append(b.add(ops.layer_norm(f"ln{i}", a)))
    b.add(ops.dense("out", vals[-1], 8))  # at least one product reads an edge
    return b.build()
