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

from shardplan.search.pairs import Pairs, identical_rows, incident_pairs, merge_pairs
from shardplan.search.problem import Problem

__all__ = ["Reduction", "make_reduction", "reduce_problem", "identity_reduction"]

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


def make_reduction(problem: Problem, keep: list[np.ndarray], unary: list[np.ndarray],
                   pairs: Pairs, stats: dict) -> Reduction:
    """The reduction of ``problem`` to configurations ``keep[v]``, with the given costs and merged pairs."""
    configs = tuple(tuple(problem.configs[v][int(i)] for i in keep[v]) for v in range(problem.num_vertices))
    keys = sorted(pairs)
    reduced = Problem(
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
    """Collapse identical and drop dominated configurations to a fixed point (exact)."""
    rng = np.random.default_rng(seed)
    pairs = merge_pairs(problem)
    n = problem.num_vertices
    inc = incident_pairs(n, pairs)
    keep = [np.arange(k) for k in problem.sizes]
    unary = [np.array(c) for c in problem.vertex_cost]
    dirty = set(range(n))
    passes = 0
    while dirty and passes < max_passes:
        passes += 1
        todo, dirty = sorted(dirty), set()
        for v in todo:
            blocks = [pairs[key] if key[0] == v else pairs[key].T for key in inc[v]]
            pos = _collapse(unary[v], blocks, rng)
            if dominance and len(pos) > 1:
                sub = _undominated(unary[v][pos], [_distinct_columns(b[pos], rng) for b in blocks])
                pos = pos[sub]
            if len(pos) == len(keep[v]):
                continue
            keep[v] = keep[v][pos]
            unary[v] = unary[v][pos]
            for key in inc[v]:
                pairs[key] = pairs[key][pos, :] if key[0] == v else pairs[key][:, pos]
                dirty.add(key[1] if key[0] == v else key[0])
    stats = {
        "configs_before": int(sum(problem.sizes)),
        "configs_after": int(sum(len(k) for k in keep)),
        "passes": passes,
        "fixed_point": not dirty,
    }
    return make_reduction(problem, keep, unary, pairs, stats)
