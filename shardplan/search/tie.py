"""Tied vertices: groups of vertices that must take the same choice, solved as one vertex.

A tie group ``G = {v_1, ..., v_m}`` (e.g. the copies of one operator in the
iterations of an unrolled ``scan``, whose stacked parameter has one layout)
restricts the assignments to those with ``a[v_1] = ... = a[v_m]``. Every
member must have the same configurations, in the same order.

:func:`tie` contracts each group to one vertex ``g`` (named after its first
member). With ``rep(v)`` the vertex that ``v`` becomes,

    c'_g(k)  = Σ_{v ∈ G} c_v(k) + Σ_{(u,w) ⊆ G} M_(u,w)[k, k]
    M'_(rep(u), rep(w)) = M_(u,w)            for every edge with rep(u) ≠ rep(w),

(an edge inside a group only ever sees equal choices at its two ends: its
diagonal joins the vertex cost; parallel edges between two contracted
vertices are kept, they add up). So for every tied assignment ``a`` and its
contraction ``a'``, ``F'(a') = F(a)``: a solver exact on the contracted
problem is exact for the tied problem, and :func:`untie` maps its answer
back (each member takes its group's choice).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from shardplan.errors import ShardplanError
from shardplan.ir import check_ties  # the names of tie groups are the graph's operators
from shardplan.search.problem import Problem, Solution

__all__ = ["tie", "untie", "check_ties"]


def tie(problem: Problem, groups: Sequence[Sequence[int]]) -> tuple[Problem, tuple[int, ...]]:
    """The contracted problem and ``rep`` (original vertex -> contracted vertex); see the module docstring."""
    n = problem.num_vertices
    leader = list(range(n))
    for grp in groups:
        first = int(grp[0])
        for v in grp:
            v = int(v)
            if problem.configs[v] != problem.configs[first]:
                raise ShardplanError(f"tied vertices {problem.names[first]!r} and {problem.names[v]!r} have "
                                     "different configurations")
            leader[v] = first
    keep = [v for v in range(n) if leader[v] == v]
    pos = {v: i for i, v in enumerate(keep)}
    rep = tuple(pos[leader[v]] for v in range(n))
    costs = [np.array(problem.vertex_cost[v], dtype=np.float64) for v in keep]
    for v in range(n):
        if leader[v] != v:
            costs[rep[v]] = costs[rep[v]] + problem.vertex_cost[v]
    edges: list[tuple[int, int]] = []
    ecosts: list[np.ndarray] = []
    for (s, d), m in zip(problem.edges, problem.edge_cost):
        if rep[s] == rep[d]:
            costs[rep[s]] = costs[rep[s]] + np.diagonal(m)
        else:
            edges.append((rep[s], rep[d]))
            ecosts.append(m)
    dims = None if problem.dims is None else tuple(problem.dims[v] for v in keep)
    return Problem(tuple(problem.names[v] for v in keep), tuple(problem.configs[v] for v in keep), tuple(costs),
                   tuple(edges), tuple(ecosts), dims), rep


def untie(solution: Solution, rep: Sequence[int]) -> Solution:
    """A contracted problem's solution as one of the original problem: vertex v takes ``assignment[rep[v]]``."""
    a = tuple(int(solution.assignment[r]) for r in rep)
    return Solution(cost=solution.cost, assignment=a, solve_seconds=solution.solve_seconds, solver=solution.solver,
                    optimal=solution.optimal, bound=solution.bound,
                    stats={**solution.stats, "tied_vertices": len(rep) - len(set(rep))})
