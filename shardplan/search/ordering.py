"""Vertex orderings for the elimination dynamic program.

An ordering is a function ``problem -> list[int]`` giving the order
v(1), ..., v(|V|) in which the dynamic program of :mod:`shardplan.search.dp`
eliminates vertices. Every ordering gives the exact optimum; only the work
changes. Eliminating v(i) builds a table over the configurations of its
dependent set D(i) (the not-yet-eliminated vertices adjacent to the connected
set X(i)), so the work of step i is

    W(i) = prod_{w in D(i) ∪ {v(i)}} K_w

and the whole run costs sum_i W(i). Keeping max |D(i)| (the induced width) or
sum_i W(i) small is the classic elimination-ordering problem (treewidth
heuristics; Bodlaender & Koster, "Treewidth computations I. Upper bounds",
2010). All orderings here work on the undirected simple graph underlying the
problem (parallel and antiparallel edges merged), disconnected graphs included,
and break ties by the smaller vertex index so they are deterministic.

Orderings
---------
generateseq
    GENERATESEQ of the PaSE paper (algorithm.md): minimum degree in the
    elimination graph, where a vertex's set d starts as its neighbours and the
    eliminated vertex's set is merged into each of its neighbours' sets.
    Theorem 2: the d of v(i) at its elimination is D(i).
min_table
    Greedy minimum work: pick the vertex whose current d ∪ {v} has the
    smallest product of configuration counts (W(i) above), then merge as in
    GENERATESEQ. Differs from generateseq when K varies across vertices.
    Two candidates are built: the plain greedy, and the same greedy with the
    articulation points (cut vertices) last; the second is returned when its
    total work is at most twice the plain one's and its largest table no
    larger -- or, when some vertices have equal cost vectors (repeated
    eliminations in it are then often computed once), at most max K times
    larger. A vertex that is
    not a cut vertex lies in exactly one biconnected component B, and all of
    its current neighbours stay inside B while no cut vertex has been
    eliminated; so the second order first reduces every component to one
    table over its cut vertices (for a chain of identical Transformer layers:
    the same layer-to-layer transfer table, layer after layer, which the DP's
    memo (:mod:`shardplan.search.memo`) computes once), then eliminates
    the cut vertices, from the leaves of the block-cut tree inwards.
min_fill
    Minimum fill-in: pick the vertex whose elimination adds the fewest new
    edges among its current neighbours; ties by smaller table.
bfs
    Breadth-first order from the smallest index of each component (the
    paper's naive comparison; gives large dependent sets on branchy graphs).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from typing import Callable

from shardplan.search.memo import digest
from shardplan.search.problem import Problem

__all__ = ["adjacency", "articulation_points", "order_work", "generateseq", "min_table", "min_fill", "bfs", "ORDERINGS", "Ordering", "dependent_sets"]

Ordering = Callable[[Problem], list]


def adjacency(problem: Problem) -> list[set[int]]:
    """Neighbour sets of the undirected simple graph underlying ``problem``."""
    adj: list[set[int]] = [set() for _ in range(problem.num_vertices)]
    for s, d in problem.edges:
        adj[s].add(d)
        adj[d].add(s)
    return adj


def _greedy_elimination(problem: Problem, score: Callable[[int, list[set[int]]], tuple],
                        reach: int = 1) -> list[int]:
    """Eliminate greedily by ``score(v, d)`` (smallest first, then index).

    ``d`` is the current elimination graph: on eliminating v, every w in d[v]
    gets d[w] = d[w] ∪ d[v] − {v, w}. Scores are cached in a heap; eliminating
    v changes d only at v's neighbours, so only the scores that can see them are
    recomputed: with ``reach`` 1 (the score of u depends on d[u] alone) those of
    the neighbours, with ``reach`` 2 (it also reads d[w] for w in d[u], as the
    fill-in does) those of the neighbours and their neighbours. The order is
    the one a full rescan would give, in O(|V| log |V|) heap operations.
    """
    d = adjacency(problem)
    remaining = set(range(problem.num_vertices))
    order: list[int] = []
    cur = {u: (score(u, d), u) for u in remaining}
    heap = list(cur.values())
    heapq.heapify(heap)
    while heap:
        key = heapq.heappop(heap)
        v = key[1]
        if v not in remaining or cur[v] != key:
            continue  # stale entry
        order.append(v)
        remaining.discard(v)
        touched = _eliminate(d, v)
        if reach >= 2:
            touched = touched.union(*(d[w] for w in touched))
        for w in touched:
            cur[w] = (score(w, d), w)
            heapq.heappush(heap, cur[w])
    return order


def _eliminate(d: list[set[int]], v: int) -> set[int]:
    """Remove v from the elimination graph ``d``, joining its neighbours; returns them."""
    nv = d[v]
    for w in nv:
        d[w] |= nv
        d[w].discard(w)
        d[w].discard(v)
    d[v] = set()
    return nv


def generateseq(problem: Problem) -> list[int]:
    """GENERATESEQ (PaSE, Alg. 1): repeatedly eliminate the vertex of minimum |v.d|."""
    return _greedy_elimination(problem, lambda v, d: (len(d[v]),))


def articulation_points(adj: list[set[int]]) -> set[int]:
    """Cut vertices of an undirected graph (Hopcroft-Tarjan low-link, iterative)."""
    n = len(adj)
    disc = [-1] * n
    low = [0] * n
    cut: set[int] = set()
    t = 0
    for root in range(n):
        if disc[root] >= 0:
            continue
        disc[root] = low[root] = t
        t += 1
        root_children = 0
        stack = [(root, -1, iter(sorted(adj[root])))]
        while stack:
            v, parent, it = stack[-1]
            w = next(it, None)
            if w is None:
                stack.pop()
                if parent >= 0:
                    low[parent] = min(low[parent], low[v])
                    if parent != root and low[v] >= disc[parent]:
                        cut.add(parent)
                continue
            if disc[w] < 0:
                disc[w] = low[w] = t
                t += 1
                if v == root:
                    root_children += 1
                stack.append((w, v, iter(sorted(adj[w]))))
            elif w != parent:
                low[v] = min(low[v], disc[w])
        if root_children > 1:
            cut.add(root)
    return cut


def order_work(problem: Problem, order: list[int]) -> tuple[float, float]:
    """(largest W(i), sum of W(i)) of an elimination order, W(i) = prod over D(i) ∪ {v(i)} of K_w."""
    sizes = problem.sizes
    ws = [math.prod(float(sizes[w]) for w in dset) * sizes[v]
          for v, dset in zip(order, dependent_sets(problem, order))]
    return (max(ws), sum(ws)) if ws else (0.0, 0.0)


def min_table(problem: Problem) -> list[int]:
    """Greedy smallest table: minimise log prod_{w in d(v) ∪ {v}} K_w, then |d(v)|.

    The greedy with the cut vertices last when its total work is at most
    twice the plain greedy's and its largest table no larger (max K times
    larger when cost vectors repeat), else the plain greedy (see the module doc).
    """
    logk = [math.log(k) for k in problem.sizes]

    def score(v: int, d: list[set[int]]) -> tuple:
        return (round(logk[v] + sum(logk[w] for w in d[v]), 9), len(d[v]))

    plain = _greedy_elimination(problem, score)
    cut = articulation_points(adjacency(problem))
    if not cut or len(cut) == problem.num_vertices:
        return plain

    def score_cuts_last(v: int, d: list[set[int]]) -> tuple:
        return (v in cut,) + score(v, d)

    blocks = _greedy_elimination(problem, score_cuts_last)
    (bmax, bsum), (pmax, psum) = order_work(problem, blocks), order_work(problem, plain)
    # with repeated cost vectors the DP's memo computes equal layers once, which this count does not see:
    # then the largest table may grow by one vertex's configurations
    repeats = len({digest(c) for c in problem.vertex_cost}) < problem.num_vertices
    slack = max(problem.sizes) if repeats else 1
    return blocks if bmax <= slack * pmax and bsum <= 2 * psum else plain


def min_fill(problem: Problem) -> list[int]:
    """Minimum fill-in: fewest non-adjacent pairs among d(v); ties by smaller table."""
    logk = [math.log(k) for k in problem.sizes]

    def score(v: int, d: list[set[int]]) -> tuple:
        nb = sorted(d[v])
        fill = sum(1 for i, a in enumerate(nb) for b in nb[i + 1 :] if b not in d[a])
        return (fill, round(logk[v] + sum(logk[w] for w in nb), 9))

    return _greedy_elimination(problem, score, reach=2)


def bfs(problem: Problem) -> list[int]:
    """Breadth-first order, each component from its smallest index, neighbours by index."""
    adj = adjacency(problem)
    seen = [False] * problem.num_vertices
    order: list[int] = []
    for root in range(problem.num_vertices):
        if seen[root]:
            continue
        seen[root] = True
        queue = deque([root])
        while queue:
            v = queue.popleft()
            order.append(v)
            for w in sorted(adj[v]):
                if not seen[w]:
                    seen[w] = True
                    queue.append(w)
    return order


def dependent_sets(problem: Problem, order: list[int]) -> list[frozenset[int]]:
    """D(i) for each position i of ``order`` (Theorem 2: the elimination-graph neighbours)."""
    d = adjacency(problem)
    out: list[frozenset[int]] = []
    for v in order:
        out.append(frozenset(_eliminate(d, v)))
    return out


ORDERINGS: dict[str, Ordering] = {
    "generateseq": generateseq,
    "min-table": min_table,
    "min-fill": min_fill,
    "bfs": bfs,
}
