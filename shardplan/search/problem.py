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

__all__ = ["Problem", "Solution", "certify", "OPTIMALITY_RTOL"]

# An answer is reported optimal only when the solver's own value of the optimum (DP table value, ILP dual
# bound) agrees with the recomputed cost of its assignment to this relative tolerance.
OPTIMALITY_RTOL = 1e-9


def _valid_range(arr: np.ndarray) -> float | None:
    """``arr.max()`` when every entry of the non-empty float64 ``arr`` is finite and >= 0, else None.

    One pass for the minimum and one for the maximum: a NaN makes ``min >= 0`` false, -inf too, and +inf
    makes the maximum infinite; the caller finds which (for its message) only when the array is refused.
    """
    lo, hi = arr.min(), arr.max()
    return float(hi) if lo >= 0 and hi < np.inf else None


def _as_cost_vector(name: str, cost: Sequence[float] | np.ndarray, k: int) -> tuple[np.ndarray, float]:
    """The vertex's costs as a float64 vector and their maximum; refuses a wrong shape, NaN, inf, negatives."""
    arr = np.asarray(cost, dtype=np.float64)
    if arr.shape != (k,):
        raise ShardplanError(f"vertex {name!r}: cost has shape {arr.shape}, expected ({k},) (one per config)")
    top = _valid_range(arr)
    if top is None:
        if not np.all(np.isfinite(arr)):
            raise ShardplanError(f"vertex {name!r}: cost contains NaN or infinity")
        raise ShardplanError(f"vertex {name!r}: cost contains a negative value ({arr.min()!r})")
    return arr, top


def _check_no_overflow(names: Sequence[str], costs: Sequence[np.ndarray], edges: Sequence[tuple[int, int]],
                       ecosts: Sequence[np.ndarray], tops: dict[int, float] | None = None) -> None:
    """Refuse costs whose sums can overflow float64.

    Every assignment costs at most U = sum_v max_k c_v(k) + sum_e max c_e, and
    every partial sum a solver forms (a DP table entry, a bound, an ILP
    objective) is at most U too; so if U is finite no sum overflows to inf, and
    if it is not, some assignment's cost would print as ``inf``.
    """
    seen: dict[int, float] = {} if tops is None else tops  # by id: shared arrays are scanned once; ``tops``
    # holds the maxima the caller already has (of arrays it keeps alive)

    def top(a: np.ndarray) -> float:
        if id(a) not in seen:
            seen[id(a)] = float(a.max())
        return seen[id(a)]

    parts = [top(c) for c in costs] + [top(m) for m in ecosts if m.size]
    with np.errstate(over="ignore"):
        total = float(np.sum(np.array(parts, dtype=np.float64))) if parts else 0.0
    if not np.isfinite(total):
        big = int(np.argmax(parts))
        where = (f"vertex {names[big]!r}" if big < len(costs)
                 else f"edge {names[edges[big - len(costs)][0]]!r} -> {names[edges[big - len(costs)][1]]!r}")
        raise ShardplanError(f"costs too large: the largest possible total cost overflows float64 (the largest "
                             f"single cost is {parts[big]:.3g}, at {where}); rescale the costs to a smaller unit")


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
        tops: dict[int, float] = {}  # maxima of the checked arrays, by id (the arrays stay alive in costs/ecosts)
        for name, cs, cost in zip(names, configs, self.vertex_cost):
            if len(cs) == 0:
                raise ShardplanError(f"vertex {name!r} has no configurations")
            key = (id(cost), len(cs))
            if key not in checked:
                arr, top = _as_cost_vector(name, cost, len(cs))
                checked[key] = arr
                tops[id(arr)] = top
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
            arr = m if isinstance(m, np.ndarray) and m.dtype == np.float64 else np.asarray(m, dtype=np.float64)
            want = (len(configs[s]), len(configs[d]))
            if arr.shape != want:
                raise ShardplanError(
                    f"edge {names[s]!r} -> {names[d]!r}: cost matrix has shape {arr.shape}, expected {want}"
                )
            if id(arr) not in checked_edges:
                top = _valid_range(arr) if arr.size else 0.0
                if top is None:
                    if not np.all(np.isfinite(arr)):
                        raise ShardplanError(f"edge {names[s]!r} -> {names[d]!r}: cost contains NaN or infinity")
                    raise ShardplanError(f"edge {names[s]!r} -> {names[d]!r}: cost contains a negative value")
                checked_edges[id(arr)] = arr
                tops[id(arr)] = top
            edges.append((s, d))
            ecosts.append(arr)
        _check_no_overflow(names, costs, edges, ecosts, tops)
        object.__setattr__(self, "names", names)
        object.__setattr__(self, "configs", configs)
        object.__setattr__(self, "vertex_cost", tuple(costs))
        object.__setattr__(self, "edges", tuple(edges))
        object.__setattr__(self, "edge_cost", tuple(ecosts))
        if self.dims is not None:
            object.__setattr__(self, "dims", tuple(tuple(d) for d in self.dims))
        object.__setattr__(self, "index", {nm: i for i, nm in enumerate(names)})

    @classmethod
    def derived(cls, names: tuple[str, ...], configs: tuple[tuple[tuple[int, ...], ...], ...],
                vertex_cost: tuple[np.ndarray, ...], edges: tuple[tuple[int, int], ...],
                edge_cost: tuple[np.ndarray, ...], dims: tuple[tuple[str, ...], ...] | None = None) -> "Problem":
        """A problem made by the solvers from a checked one, without checking it again.

        For restrictions, merged edges and folded vertex costs of a :class:`Problem` that passed
        :meth:`__post_init__`: the values are already in its normal form (tuples of Python ints,
        float64 arrays of the right shapes, unique names), every entry is a sum of its finite,
        non-negative entries (finite: their total is), so the checks would pass and would change
        nothing; the arrays are kept as they are (shared arrays stay shared).
        """
        out = object.__new__(cls)
        for name, value in (("names", names), ("configs", configs), ("vertex_cost", tuple(vertex_cost)),
                            ("edges", tuple(edges)), ("edge_cost", tuple(edge_cost)), ("dims", dims),
                            ("index", {nm: i for i, nm in enumerate(names)})):
            object.__setattr__(out, name, value)
        return out

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


def _best_single_change(problem: Problem, a: Sequence[int]) -> tuple[float, int, int]:
    """The most negative change of F from moving one vertex to another configuration: (delta, vertex, config).

    delta_v(k) = c_v(k) - c_v(a_v) + sum over edges at v of M(.., k, ..) - M(.., a_v, ..),
    computed per vertex as a vector over its configurations; (0.0, -1, -1) when no move lowers F.
    """
    delta = [c - c[k] for c, k in zip(problem.vertex_cost, a)]
    for (s, d), m in zip(problem.edges, problem.edge_cost):
        here = m[a[s], a[d]]
        delta[s] = delta[s] + (m[:, a[d]] - here)
        delta[d] = delta[d] + (m[a[s], :] - here)
    best = (0.0, -1, -1)
    for v, dv in enumerate(delta):
        k = int(np.argmin(dv))
        if dv[k] < best[0]:
            best = (float(dv[k]), v, k)
    return best


def certify(problem: Problem, solution: Solution, value: float | None) -> Solution:
    """Check an answer its solver claims optimal; withdraw the claim (``optimal=False``) if a check fails.

    Three checks, recorded in ``stats["certificate"]``:

    1. ``cost`` is F(assignment), recomputed here;
    2. the solver's own value of the optimum (``value``: the DP's table minimum,
       the ILP's dual bound), when it has one, agrees with that cost:
       |cost - value| <= OPTIMALITY_RTOL * cost;
    3. no single vertex moving to another configuration lowers the cost by
       more than OPTIMALITY_RTOL * cost (every optimum passes; a solver
       misled by rounding or tolerances usually does not).

    A solution not claimed optimal is returned unchanged.
    """
    if not solution.optimal:
        return solution
    cost = problem.evaluate(solution.assignment)
    tol = OPTIMALITY_RTOL * abs(cost)
    cert: dict = {"rtol": OPTIMALITY_RTOL, "value": value}
    failed = []
    if not abs(cost - solution.cost) <= tol:
        failed.append(f"reported cost {solution.cost!r} is not F(assignment) = {cost!r}")
    if value is not None:
        gap = abs(cost - value) / abs(cost) if cost else (0.0 if value == 0 else float("inf"))
        cert["rel_gap"] = gap
        if not gap <= OPTIMALITY_RTOL:
            failed.append(f"the solver's value of the optimum {value!r} differs from the cost {cost!r} "
                          f"by {gap:.3g} (relative)")
    delta, v, k = _best_single_change(problem, solution.assignment) if problem.num_vertices else (0.0, -1, -1)
    cert["best_single_change"] = delta
    if delta < -tol:
        failed.append(f"moving {problem.names[v]!r} to configuration {k} lowers the cost by {-delta!r}")
    cert["passed"] = not failed
    if failed:
        cert["failed"] = "; ".join(failed)
    stats = {**solution.stats, "certificate": cert}
    return Solution(cost=cost, assignment=tuple(solution.assignment), solve_seconds=solution.solve_seconds,
                    solver=solution.solver, optimal=not failed, bound=solution.bound if not failed else None,
                    stats=stats)
