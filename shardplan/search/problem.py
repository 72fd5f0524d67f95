"""The solver-level problem: a graph of choices with costs, nothing about DNNs.

Every search algorithm in :mod:`shardplan.search` works on this form. A
model is lowered to it by :mod:`shardplan.cost` (vertex = operator, choice =
configuration, vertex cost = t_l, edge cost = t_x); a user may also write it
directly (problem files) to solve costs measured elsewhere.

The objective of an assignment ``a`` (one choice index per vertex) is

    F(a) = sum_v vertex_cost[v][a[v]] + sum_(u,v) edge_cost[(u,v)][a[u], a[v]]

Edges are directed only in that the matrix is indexed ``[src choice, dst
choice]``; several edges between the same pair are allowed and add up. The
graph may be disconnected.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from shardplan.errors import ShardplanError

__all__ = ["Problem", "Solution"]


def _as_cost_vector(name: str, cost: Sequence[float] | np.ndarray, k: int) -> np.ndarray:
    arr = np.asarray(cost, dtype=np.float64)
    if arr.shape != (k,):
        raise ShardplanError(f"vertex {name!r}: cost has shape {arr.shape}, expected ({k},) (one per config)")
    if not np.all(np.isfinite(arr)):
        raise ShardplanError(f"vertex {name!r}: cost contains NaN or infinity")
    if np.any(arr < 0):
        raise ShardplanError(f"vertex {name!r}: cost contains a negative value ({arr.min()!r})")
    return arr


@dataclass(frozen=True, eq=False)
class Problem:
    """Vertices with configurations and costs; edges with cost matrices.

    Attributes:
        names: vertex names, unique.
        configs: per vertex, its configurations (tuples of ints); only their
            number matters to the solvers, the tuples are carried for reports.
        vertex_cost: per vertex, a float64 array of shape (K_v,), finite, >= 0.
        edges: (src index, dst index) pairs, src != dst.
        edge_cost: per edge, a float64 array of shape (K_src, K_dst), finite, >= 0.
        dims: optional per-vertex dimension names (for reports), or None.
    """

    names: tuple[str, ...]
    configs: tuple[tuple[tuple[int, ...], ...], ...]
    vertex_cost: tuple[np.ndarray, ...]
    edges: tuple[tuple[int, int], ...]
    edge_cost: tuple[np.ndarray, ...]
    dims: tuple[tuple[str, ...], ...] | None = None
    index: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        names = tuple(self.names)
        if len(set(names)) != len(names):
            seen: set[str] = set()
            dup = next(n for n in names if n in seen or seen.add(n))  # type: ignore[func-returns-value]
            raise ShardplanError(f"duplicate vertex name {dup!r}")
        if len(self.configs) != len(names) or len(self.vertex_cost) != len(names):
            raise ShardplanError("names, configs and vertex_cost must have one entry per vertex")
        # vertices / edges that share one object (identical operators costed once) are checked once
        conv: dict[int, tuple] = {}
        for cs in self.configs:
            if id(cs) not in conv:
                conv[id(cs)] = tuple(tuple(int(x) for x in c) for c in cs)
        configs = tuple(conv[id(cs)] for cs in self.configs)
        costs = []
        checked: dict[tuple[int, int], np.ndarray] = {}
        for name, cs, cost in zip(names, configs, self.vertex_cost):
            if len(cs) == 0:
                raise ShardplanError(f"vertex {name!r} has no configurations")
            key = (id(cost), len(cs))
            if key not in checked:
                checked[key] = _as_cost_vector(name, cost, len(cs))
            costs.append(checked[key])
        if len(self.edges) != len(self.edge_cost):
            raise ShardplanError("edges and edge_cost must have one entry per edge")
        edges = []
        ecosts = []
        checked_edges: dict[int, np.ndarray] = {}  # keeps the checked arrays alive so ids stay unique
        n = len(names)
        for (s, d), m in zip(self.edges, self.edge_cost):
            s, d = int(s), int(d)
            if not (0 <= s < n and 0 <= d < n):
                raise ShardplanError(f"edge ({s}, {d}) refers to a vertex index outside 0..{n - 1}")
            if s == d:
                raise ShardplanError(f"edge from {names[s]!r} to itself")
            arr = np.asarray(m, dtype=np.float64)
            want = (len(configs[s]), len(configs[d]))
            if arr.shape != want:
                raise ShardplanError(
                    f"edge {names[s]!r} -> {names[d]!r}: cost matrix has shape {arr.shape}, expected {want}"
                )
            if id(arr) not in checked_edges:
                if not np.all(np.isfinite(arr)):
                    raise ShardplanError(f"edge {names[s]!r} -> {names[d]!r}: cost contains NaN or infinity")
                if np.any(arr < 0):
                    raise ShardplanError(f"edge {names[s]!r} -> {names[d]!r}: cost contains a negative value")
                checked_edges[id(arr)] = arr
            edges.append((s, d))
            ecosts.append(arr)
        object.__setattr__(self, "names", names)
        object.__setattr__(self, "configs", configs)
        object.__setattr__(self, "vertex_cost", tuple(costs))
        object.__setattr__(self, "edges", tuple(edges))
        object.__setattr__(self, "edge_cost", tuple(ecosts))
        if self.dims is not None:
            object.__setattr__(self, "dims", tuple(tuple(d) for d in self.dims))
        object.__setattr__(self, "index", {nm: i for i, nm in enumerate(names)})

    @property
    def num_vertices(self) -> int:
        return len(self.names)

    @property
    def sizes(self) -> tuple[int, ...]:
        """K_v, the number of configurations of each vertex."""
        return tuple(len(c) for c in self.configs)

    def evaluate(self, assignment: Sequence[int]) -> float:
        """F(assignment): the sum of the chosen vertex and edge costs."""
        a = [int(x) for x in assignment]
        if len(a) != self.num_vertices:
            raise ShardplanError(f"assignment has {len(a)} entries, problem has {self.num_vertices} vertices")
        for v, (k, kv) in enumerate(zip(a, self.sizes)):
            if not 0 <= k < kv:
                raise ShardplanError(f"assignment of {self.names[v]!r} is {k}, outside 0..{kv - 1}")
        total = sum(float(c[k]) for c, k in zip(self.vertex_cost, a))
        total += sum(float(m[a[s], a[d]]) for (s, d), m in zip(self.edges, self.edge_cost))
        return total


@dataclass(frozen=True)
class Solution:
    """A solver's answer on a :class:`Problem`.

    Attributes:
        cost: F of the assignment (or, for a stopped exact solver, the best
            found; see ``optimal`` and ``bound``).
        assignment: chosen configuration index per vertex, in problem order.
        solve_seconds: wall time of the search.
        solver: which solver produced it ("dp", "bruteforce", "bfs-dp", "ilp", "mcmc").
        optimal: True when the solver proved the cost minimal.
        bound: a proven lower bound on the optimum (== cost when optimal).
        stats: solver statistics (ordering, max dependent-set size, table sizes, ...).
    """

    cost: float
    assignment: tuple[int, ...]
    solve_seconds: float
    solver: str
    optimal: bool = True
    bound: float | None = None
    stats: dict = field(default_factory=dict)
