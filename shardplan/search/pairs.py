"""The working form shared by the DP-side solvers (DP, reductions, bounds, MCMC).

A :class:`Problem` may hold several edges between the same two vertices, in
either direction. Every solver here first merges them into one matrix per
unordered pair {u, v}, oriented with the lower index as the row:

    P_(u,v) = sum over edges (u, v) of M  +  sum over edges (v, u) of M^T,   u < v,

which leaves F of every assignment unchanged. This module also holds the two
other pieces those solvers share: the exact split of a matrix into a
separable part and a non-negative residual, and the grouping of identical
rows by a random projection.

The ILP (:mod:`shardplan.search.ilp`) deliberately uses none of this: it is
an independent cross-check of the DP.
"""

from __future__ import annotations

import numpy as np

from shardplan.search.problem import Problem

__all__ = ["Pairs", "merge_pairs", "incident_pairs", "reparametrise", "identical_rows", "view_key"]

Pairs = dict[tuple[int, int], np.ndarray]
"""One matrix per adjacent pair (u, v), u < v, indexed [config of u, config of v]."""


def merge_pairs(problem: Problem) -> Pairs:
    """Sum parallel and antiparallel edges: one matrix per pair (u, v), u < v, indexed [a_u, a_v].

    A pair joined by a single edge gets the problem's own matrix (or a
    transposed view of it), not a copy: callers must not modify the matrices
    in place.
    """
    pairs: Pairs = {}
    for (s, d), m in zip(problem.edges, problem.edge_cost):
        key, mat = ((s, d), m) if s < d else ((d, s), m.T)
        pairs[key] = pairs[key] + mat if key in pairs else mat
    return pairs


def view_key(a: np.ndarray) -> tuple:
    """The memory an array views: (data pointer, shape, strides, dtype).

    Two arrays with equal keys, alive at the same time, show the same numbers.
    A cache keyed by it must hold the array it keyed (so that no other array
    gets its address while the entry exists).
    """
    return (a.__array_interface__["data"][0], a.shape, a.strides, a.dtype.str)


def incident_pairs(num_vertices: int, pairs: Pairs) -> list[list[tuple[int, int]]]:
    """Per vertex, the keys of the pairs that contain it (in the order of ``pairs``)."""
    inc: list[list[tuple[int, int]]] = [[] for _ in range(num_vertices)]
    for key in pairs:
        inc[key[0]].append(key)
        inc[key[1]].append(key)
    return inc


def reparametrise(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split ``M`` exactly as ``M[a, b] = r[a] + c[b] + R[a, b]`` with ``R >= 0``.

    ``r[a] = min_b M[a, b]``, ``c[b] = min_a (M[a, b] - r[a])``; every row and
    every column of ``R`` then contains a zero. Moving r and c into the vertex
    costs of the two ends leaves F of every assignment unchanged.
    """
    r = matrix.min(axis=1)
    rest = matrix - r[:, None]
    c = rest.min(axis=0)
    rest -= c[None, :]
    return r, c, rest


def identical_rows(blocks: list[np.ndarray], rng: np.random.Generator,
                   priority: np.ndarray | None = None) -> np.ndarray:
    """For each row i of the side-by-side ``blocks``, a row ``rep[i]`` equal to it.

    The rows are those of ``np.hstack(blocks)`` (never built). They are grouped
    by a random projection and each is compared exactly with the first member
    of its group, ordered by ``priority`` (ascending, e.g. a cost) and then by
    index; a row equal to it gets that member as ``rep``, any other row
    (a projection collision) is its own. So ``rep[i] == i`` for the kept rows,
    a hash collision can only fail to merge two rows, never merge two
    different ones, and of a set of equal rows the one kept is the first by
    (priority, index) unless a collision intervenes.
    """
    n = blocks[0].shape[0]
    h = np.zeros(n)
    for b in blocks:
        h += b @ rng.standard_normal(b.shape[1])
    keys = (np.arange(n), h) if priority is None else (np.arange(n), priority, h)
    order = np.lexsort(keys)
    hs = h[order]
    new_group = np.ones(n, dtype=bool)
    new_group[1:] = hs[1:] != hs[:-1]
    if new_group.all():  # every projection distinct: every row is its own (what the exact check below gives)
        return np.arange(n, dtype=np.int64)
    first = order[np.flatnonzero(new_group)][np.cumsum(new_group) - 1]  # group's first, per sorted row
    same = np.ones(n, dtype=bool)
    for b in blocks:
        same &= np.all(b[order] == b[first], axis=1)
    rep = np.empty(n, dtype=np.int64)
    rep[order] = np.where(same, first, order)
    return rep
