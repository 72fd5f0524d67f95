"""Exact reductions of a :class:`Problem` before the dynamic program.

Let the signature of configuration a of vertex v be the concatenation of its
rows in every (merged) edge matrix incident to v, oriented with v as the row:

    sig_v(a) = ( M_(v,w)[a, :]  for w in N(v) ).

Collapse. If sig_v(a) = sig_v(b) then a and b interact with the rest of the
graph identically, so only the one with the smaller vertex cost (smaller index
on ties) can be needed: in any assignment using the other, switching to it
does not increase F.

Dominance. If vertex_cost[b] <= vertex_cost[a] and sig_v(b) <= sig_v(a)
elementwise (b != a), switching a -> b in any assignment does not increase F,
so a can be dropped. After collapse all signatures of a vertex are distinct,
so dominance is a strict partial order and every dominated configuration is
dominated by a kept one: dropping all dominated configurations at once is
safe. Dropping configurations of v removes rows/columns of its neighbours'
matrices, which can create new dominance there; we iterate to a fixed point.

Both keep at least one optimal assignment, so the optimum of the reduced
problem equals the optimum of the original; :meth:`Reduction.lift` maps a
reduced assignment back to original configuration indices.

Also: parallel and antiparallel edges are summed into one matrix per
unordered pair {u, v} (u < v, indexed [config u, config v];
:func:`shardplan.search.pairs.merge_pairs`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from shardplan.search.memo import DigestCache
from shardplan.search.pairs import Pairs, identical_rows, incident_pairs, merge_pairs, view_key
from shardplan.search.problem import Problem

__all__ = ["Reduction", "make_reduction", "reduce_problem", "identity_reduction", "orbits", "symmetric_reduction",
           "sorted_union"]

# Most (dominator, dominated) pairs tried per vertex in the dominance test.
_PAIR_BUDGET = 4 * 10**6
# Most candidate dominators (the cheapest by unary + row sums) tried per vertex.
_MAX_DOMINATORS = 64


@dataclass(frozen=True)
class Reduction:
    """A reduced problem and the way back.

    Attributes:
        problem: the reduced problem (same vertices and names; one edge per
            adjacent pair, src < dst; fewer configurations).
        keep: per vertex, ``keep[v][i]`` is the original index of reduced config i.
        stats: configuration counts before/after and the number of passes.
    """

    problem: Problem
    keep: tuple[np.ndarray, ...]
    stats: dict = field(default_factory=dict)

    def lift(self, assignment: Sequence[int]) -> tuple[int, ...]:
        """Map a reduced assignment to original configuration indices."""
        return tuple(int(k[a]) for k, a in zip(self.keep, assignment))

    def then(self, second: "Reduction") -> "Reduction":
        """The reduction that applies this one and then ``second`` (a reduction of ``self.problem``)."""
        keep = tuple(k1[k2] for k1, k2 in zip(self.keep, second.keep))
        return Reduction(second.problem, keep, dict(second.stats))



def sorted_union(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The sorted distinct values of ``a`` and ``b`` (what ``np.union1d`` gives, without its check for
    masked arrays, whose first use imports ``numpy.ma``: ~15-30 ms of a short run)."""
    c = np.concatenate((np.ravel(a), np.ravel(b)))
    c.sort()
    if len(c) < 2:
        return c
    return c[np.concatenate(([True], c[1:] != c[:-1]))]

def make_reduction(problem: Problem, keep: list[np.ndarray], unary: list[np.ndarray],
                   pairs: Pairs, stats: dict) -> Reduction:
    """The reduction of ``problem`` to configurations ``keep[v]``, with the given costs and merged pairs."""
    shared: dict[tuple, tuple] = {}  # vertices with the same configurations, kept alike, share one tuple
    configs_list = []
    for v in range(problem.num_vertices):
        ck = (id(problem.configs[v]), np.asarray(keep[v]).tobytes())
        if ck not in shared:
            shared[ck] = tuple(problem.configs[v][int(i)] for i in keep[v])
        configs_list.append(shared[ck])
    configs = tuple(configs_list)
    keys = sorted(pairs)
    reduced = Problem.derived(
        names=problem.names,
        configs=configs,
        vertex_cost=tuple(unary),
        edges=tuple(keys),
        edge_cost=tuple(pairs[k] for k in keys),
        dims=problem.dims,
    )
    return Reduction(reduced, tuple(np.asarray(k, dtype=np.int64) for k in keep), stats)


def identity_reduction(problem: Problem) -> Reduction:
    """Only merge parallel edges; keep every configuration."""
    keep = [np.arange(k) for k in problem.sizes]
    k = sum(problem.sizes)
    return make_reduction(problem, keep, list(problem.vertex_cost), merge_pairs(problem),
                  {"configs_before": k, "configs_after": k, "passes": 0})


def _collapse(unary: np.ndarray, blocks: list[np.ndarray], rng: np.random.Generator) -> np.ndarray:
    """Positions to keep after collapsing identical signatures (cheapest, then lowest position)."""
    if not blocks:
        return np.array([int(np.argmin(unary))])  # isolated vertex: only the cheapest matters
    rep = identical_rows(blocks, rng, priority=unary)
    return np.flatnonzero(rep == np.arange(len(rep)))


def _single(blocks: list[np.ndarray], rng: np.random.Generator) -> np.ndarray:
    """:func:`_collapse` of a vertex with one configuration: it stays. Draws what :func:`_collapse` would
    (its projection vectors), so that the random stream, and with it every later hash, is unchanged."""
    for b in blocks:
        rng.standard_normal(b.shape[1])
    return np.zeros(1, dtype=np.int64)


def _distinct_columns(block: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``block`` without exactly repeated columns (they add nothing to a dominance test)."""
    if block.shape[1] <= 1:
        return block
    rep = identical_rows([block.T], rng)
    return block[:, rep == np.arange(len(rep))]


def _undominated(unary: np.ndarray, blocks: list[np.ndarray]) -> np.ndarray:
    """Positions of configurations not dominated by another.

    b dominates a iff unary[b] <= unary[a] and sig(b) <= sig(a) elementwise, and
    either some entry is strictly smaller or (all equal and) b comes first: a
    strict partial order, so every dropped configuration has a kept dominator.
    Candidate pairs are filtered column block by column block, so the work is
    dominated by the first few columns once most pairs fail. When all pairs
    would exceed the budget only the cheapest candidates (by unary + row
    sums) are tried as dominators; dropping fewer is still exact.
    """
    k = unary.shape[0]
    if k <= 1:
        return np.arange(k)
    sig = np.concatenate([unary[:, None]] + blocks, axis=1)
    length = sig.shape[1]
    cand = np.argsort(sig.sum(axis=1), kind="stable")[: max(8, min(k, _MAX_DOMINATORS, _PAIR_BUDGET // k))]
    b_idx, a_idx = np.nonzero(unary[cand][:, None] <= unary[None, :])
    b_idx = cand[b_idx]
    alive = b_idx != a_idx
    b_idx, a_idx = b_idx[alive], a_idx[alive]
    step = 8
    for start in range(1, length, step):
        if len(b_idx) == 0:
            break
        ok = np.all(sig[b_idx, start:start + step] <= sig[a_idx, start:start + step], axis=1)
        b_idx, a_idx = b_idx[ok], a_idx[ok]
        step = min(4 * step, 256)
    if len(b_idx) == 0:
        return np.arange(k)
    strict = np.any(sig[b_idx] < sig[a_idx], axis=1) | (b_idx < a_idx)
    dominated = np.zeros(k, dtype=bool)
    dominated[a_idx[strict]] = True
    return np.flatnonzero(~dominated)


def reduce_problem(problem: Problem, dominance: bool = True, max_passes: int = 50, seed: int = 0) -> Reduction:
    """Collapse identical and drop dominated configurations to a fixed point (exact).

    When cost vectors repeat (equal vectors: :func:`orbits`), the result for a vertex is
    cached under the digests of its cost vector and incident matrices
    (:func:`shardplan.search.memo.digest`) and reused only when those inputs
    are equal element by element, so equal vertices are reduced once; and a
    shared matrix restricted alike at several edges is restricted once.
    """
    rng = np.random.default_rng(seed)
    pairs = merge_pairs(problem)
    n = problem.num_vertices
    inc = incident_pairs(n, pairs)
    keep = [np.arange(k) for k in problem.sizes]
    unary = [np.array(c) for c in problem.vertex_cost]
    dirty = set(range(n))
    passes = 0
    # a vertex's result depends only on its cost vector and its incident matrices (as a multiset: the
    # order of the blocks changes neither test), so equal ones -- identical layers -- are reduced once
    repeated = len(set(orbits(problem))) < n
    seen: dict[tuple, tuple[tuple[np.ndarray, ...], np.ndarray]] = {}  # key -> (inputs, kept positions)
    restricted: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}  # equal restrictions of a shared matrix, once
    dcache = DigestCache()
    while dirty and passes < max_passes:
        passes += 1
        todo, dirty = sorted(dirty), set()
        for v in todo:
            blocks = [pairs[key] if key[0] == v else pairs[key].T for key in inc[v]]
            ck, ins = None, ()
            if repeated:
                dig = sorted(((dcache(b), i) for i, b in enumerate(blocks)), key=lambda x: x[0])
                ck = (dcache(unary[v]),) + tuple(d for d, _ in dig)
                ins = (unary[v],) + tuple(blocks[i] for _, i in dig)
            hit = seen.get(ck) if ck is not None else None
            if hit is not None and _all_equal(hit[0], ins):
                pos = hit[1]
            else:
                pos = _collapse(unary[v], blocks, rng) if len(unary[v]) > 1 else _single(blocks, rng)
                if dominance and len(pos) > 1:
                    sub = _undominated(unary[v][pos], [_distinct_columns(b[pos], rng) for b in blocks])
                    pos = pos[sub]
                if ck is not None:
                    seen[ck] = (ins, pos)
            if len(pos) == len(keep[v]):
                continue
            keep[v] = keep[v][pos]
            unary[v] = unary[v][pos]
            for key in inc[v]:
                m, rows = pairs[key], key[0] == v
                rk = (view_key(m), rows, pos.tobytes()) if repeated else None
                got = restricted.get(rk) if rk is not None else None
                if got is not None and got[0] is m:  # the same source array: the same restriction
                    pairs[key] = got[1]
                else:
                    pairs[key] = m[pos, :] if rows else m[:, pos]
                    if rk is not None:
                        restricted[rk] = (m, pairs[key])  # the source is held, so its address stays its own
                dirty.add(key[1] if key[0] == v else key[0])
    stats = {
        "configs_before": int(sum(problem.sizes)),
        "configs_after": int(sum(len(k) for k in keep)),
        "passes": passes,
        "fixed_point": not dirty,
    }
    return make_reduction(problem, keep, unary, pairs, stats)


def _all_equal(a: tuple[np.ndarray, ...], b: tuple[np.ndarray, ...]) -> bool:
    return len(a) == len(b) and all(x is y or (x.shape == y.shape and np.array_equal(x, y)) for x, y in zip(a, b))


def orbits(problem: Problem) -> list[int]:
    """Per vertex, an orbit index: vertices with equal cost vectors and equal configurations share one.

    Orbit members are interchangeable as far as their own choices go (the same
    configurations at the same costs), e.g. the same operator in 96 identical
    layers; :func:`symmetric_reduction` gives them one set of configurations.
    """
    by_configs: dict[int, int] = {}
    canon: dict[tuple, int] = {}
    dcache = DigestCache()
    out = []
    for cs, c in zip(problem.configs, problem.vertex_cost):
        if id(cs) not in by_configs:
            by_configs[id(cs)] = canon.setdefault(("configs", cs), len(canon))
        out.append(canon.setdefault((by_configs[id(cs)], dcache(c)), len(canon)))
    ids = {o: i for i, o in enumerate(dict.fromkeys(out))}
    return [ids[o] for o in out]


def symmetric_reduction(problem: Problem, keep: Sequence[np.ndarray], stats: dict,
                        orbit_ids: Sequence[int] | None = None) -> Reduction:
    """``problem`` restricted to, per vertex, the union of ``keep`` over its orbit (:func:`orbits`).

    Exact whenever ``keep`` is: a superset (per vertex) of a restriction that
    contains an optimal assignment contains it too, and restricting never
    lowers the optimum. Orbit members then get equal cost vectors, and two
    edges with equal matrices between equal orbits get equal restricted
    matrices; both are built once and shared (the same arrays), so equal
    parts of the reduced problem stay recognisably equal for the DP's memo
    and are validated once. ``orbit_ids``, when given, is ``orbits(problem)`` already computed.
    """
    orb = list(orbit_ids) if orbit_ids is not None else orbits(problem)
    union: dict[int, np.ndarray] = {}
    for v, k in enumerate(keep):
        union[orb[v]] = sorted_union(union[orb[v]], k) if orb[v] in union else np.asarray(k, dtype=np.int64)
    unary_of: dict[int, np.ndarray] = {}
    configs_of: dict[int, tuple] = {}
    for v in range(problem.num_vertices):
        o = orb[v]
        if o not in unary_of:
            unary_of[o] = np.ascontiguousarray(problem.vertex_cost[v][union[o]])
            configs_of[o] = tuple(problem.configs[v][int(i)] for i in union[o])
    cache: dict[tuple, np.ndarray] = {}
    pairs: Pairs = {}
    for (u, w), m in merge_pairs(problem).items():
        ck = (view_key(m), orb[u], orb[w])
        if ck not in cache:
            cache[ck] = np.ascontiguousarray(m[np.ix_(union[orb[u]], union[orb[w]])])
        pairs[(u, w)] = cache[ck]
    keys = sorted(pairs)
    reduced = Problem.derived(
        names=problem.names,
        configs=tuple(configs_of[o] for o in orb),
        vertex_cost=tuple(unary_of[o] for o in orb),
        edges=tuple(keys),
        edge_cost=tuple(pairs[k] for k in keys),
        dims=problem.dims,
    )
    st = {**stats, "configs_after": int(sum(len(union[o]) for o in orb)), "orbits": len(union)}
    return Reduction(reduced, tuple(union[o] for o in orb), st)
