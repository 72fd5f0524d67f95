"""An integer linear program for a :class:`Problem`, solved by HiGHS.

This is an independent exact solver, used to cross-check the dynamic
program: its default path shares no code with it beyond :class:`Problem`,
:class:`Solution` and the error types. The edge merging and the
reparametrisation below are written here again on purpose (the DP side's
are in :mod:`shardplan.search.pairs`), so that a bug there cannot hide in
both solvers at once. Only ``prune=True`` uses the DP side's bound pruning
(imported when asked for); the cross-checks use the default.

Formulation (the *local-polytope* or *marginal* linearisation)
-----------------------------------------------------------------
Binary ``x[v,k]`` says vertex ``v`` takes configuration ``k``; for every
(merged) edge ``e = (u, v)`` with cost matrix ``M_e`` a continuous
``y[e,a,b] >= 0`` stands for the product ``x[u,a] * x[v,b]``::

    minimise    sum_v sum_k c_v[k] x[v,k]  +  sum_e sum_(a,b) M_e[a,b] y[e,a,b]
    subject to  sum_k x[v,k]      = 1        for every vertex v
                sum_b y[e,a,b]    = x[u,a]   for every edge e = (u,v), a < K_u
                sum_a y[e,a,b]    = x[v,b]   for every edge e = (u,v), b < K_v
                x binary, y >= 0.

With ``x`` integral the two marginal constraints leave exactly one feasible
``y[e]``, the point mass at ``(x_u, x_v)``, so the program is exact. It has
``K_u + K_v`` rows per edge instead of the ``3 K_u K_v`` rows of the textbook
``y <= x_u, y <= x_v, y >= x_u + x_v - 1`` linearisation, and its LP
relaxation is the local polytope of the pairwise graphical model, which is
at least as tight (and is exact on trees).

Preprocessing
-------------
* Parallel edges between the same pair are merged (matrices summed after
  orienting them all from the lower to the higher vertex index).
* Every matrix is *reparametrised* exactly as ``M[a,b] = r[a] + c[b] + R[a,b]``
  with ``r = min_b M[a,b]``, ``c[b] = min_a (M[a,b] - r[a])`` and ``R >= 0``;
  ``r`` and ``c`` move into the vertex costs of the two ends. This leaves the
  objective of every assignment and the LP relaxation unchanged. When
  ``max R <= 1e-12 * max |M|`` (an all-zero matrix, an edge to a vertex with
  one configuration, or any ``r[a] + c[b]`` matrix) the edge is dropped. A
  dropped residual is non-negative, so the program's optimum stays a valid
  lower bound on the true optimum.

The reported ``cost`` is always ``problem.evaluate(assignment)``, with the
assignment read off ``x`` by an argmax per vertex; the LP objective is only
used for the bound and gap.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from shardplan.errors import ShardplanError, TableMemoryError
from shardplan.search.problem import Problem, Solution, certify

if TYPE_CHECKING:
    import scipy.sparse as sp

__all__ = ["solve_ilp"]

_DROP_RTOL = 1e-12  # an edge whose residual is below this times max|M| is dropped
_OPTIMAL_RTOL = 1e-9  # a gap below this (relative) counts as proved optimal


@dataclass(frozen=True)
class _ProgramData:
    """The program's data after merging and reparametrising edges.

    Attributes:
        vertex_cost: per vertex, the cost vector with folded edge terms added.
        edges: kept (u, v) pairs with u < v.
        residual: per kept edge, its residual matrix R (K_u x K_v, >= 0).
        dropped: number of merged edges dropped as r[a] + c[b].
        merged: number of distinct vertex pairs joined by at least one edge.
    """

    vertex_cost: tuple[np.ndarray, ...]
    edges: tuple[tuple[int, int], ...]
    residual: tuple[np.ndarray, ...]
    dropped: int
    merged: int


def _summed_edges(problem: Problem) -> dict[tuple[int, int], np.ndarray]:
    """Per unordered vertex pair {u, v} (u < v), the sum of its edges' matrices, indexed [a_u, a_v]."""
    total: dict[tuple[int, int], np.ndarray] = {}
    for (s, d), m in zip(problem.edges, problem.edge_cost):
        u, v = min(s, d), max(s, d)
        total[(u, v)] = total.get((u, v), 0.0) + (m if s == u else m.T)
    return total


def _separable_split(m: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(r, c, R)`` with ``m[a,b] = r[a] + c[b] + R[a,b]``, ``r[a] = min_b m[a,b]``, ``c[b] = min_a (m[a,b] - r[a])``.

    Then ``R >= 0`` and every row and every column of ``R`` contains a zero.
    """
    r = m.min(axis=1)
    c = (m - r[:, None]).min(axis=0)
    return r, c, m - r[:, None] - c[None, :]


def program_data(problem: Problem) -> _ProgramData:
    """Merge parallel edges and fold their separable parts into vertex costs."""
    vcost = [np.array(c, dtype=np.float64) for c in problem.vertex_cost]
    edges: list[tuple[int, int]] = []
    residual: list[np.ndarray] = []
    dropped = 0
    merged = _summed_edges(problem)
    for (u, v), mat in merged.items():
        r, c, res = _separable_split(mat)
        vcost[u] += r
        vcost[v] += c
        scale = float(np.abs(mat).max()) if mat.size else 0.0
        if res.size == 0 or float(res.max()) <= _DROP_RTOL * scale:
            dropped += 1
            continue
        edges.append((u, v))
        residual.append(res)
    return _ProgramData(tuple(vcost), tuple(edges), tuple(residual), dropped, len(merged))


def _segment_local(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For segments of the given lengths: (segment id, offset in segment, start) per item.

    ``start[i]`` is the first flat position of segment ``i`` (an exclusive cumsum).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    start = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1], out=start[1:])
    seg = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    local = np.arange(int(lengths.sum()), dtype=np.int64) - start[seg]
    return seg, local, start


def build_program(reduced: _ProgramData) -> tuple[np.ndarray, sp.csr_matrix, np.ndarray, np.ndarray, int]:
    """Assemble the local-polytope program as arrays.

    Returns ``(c, A, b, integrality, num_x)``: minimise ``c @ z`` subject to
    ``A @ z == b``, ``z >= 0``, ``z[:num_x]`` binary. Variables are ordered as
    all ``x[v,k]`` (vertex by vertex) followed by all ``y[e,a,b]`` (edge by
    edge, row-major in ``(a, b)``). Rows are the ``n`` one-hot rows, then per
    edge its ``K_u`` row marginals followed by its ``K_v`` column marginals.
    """
    import scipy.sparse as sp  # heavy: only when a program is built

    n = len(reduced.vertex_cost)
    kx = np.array([len(c) for c in reduced.vertex_cost], dtype=np.int64)
    num_x = int(kx.sum())
    xv, xk, xoff = _segment_local(kx)

    eu = np.array([u for u, _ in reduced.edges], dtype=np.int64)
    ev = np.array([v for _, v in reduced.edges], dtype=np.int64)
    ku, kv = kx[eu], kx[ev]
    ye, ylocal, yoff = _segment_local(ku * kv)
    num_y = len(ye)
    ya, yb = ylocal // kv[ye], ylocal % kv[ye]
    # Row offsets: one-hot rows first, then K_u + K_v marginal rows per edge.
    _, _, roff = _segment_local(ku + kv)
    roff = roff + n

    # One-hot rows: +1 on x[v, k].
    rows = [xv]
    cols = [np.arange(num_x, dtype=np.int64)]
    vals = [np.ones(num_x)]
    # Row marginals of edge e: +1 on y[e,a,b] in row roff[e] + a ...
    rows.append(roff[ye] + ya)
    cols.append(num_x + np.arange(num_y, dtype=np.int64))
    vals.append(np.ones(num_y))
    # ... and -1 on x[u,a] in the same row.
    se, sa, _ = _segment_local(ku)
    rows.append(roff[se] + sa)
    cols.append(xoff[eu[se]] + sa)
    vals.append(-np.ones(len(se)))
    # Column marginals: +1 on y[e,a,b] in row roff[e] + K_u + b, -1 on x[v,b].
    rows.append(roff[ye] + ku[ye] + yb)
    cols.append(num_x + np.arange(num_y, dtype=np.int64))
    vals.append(np.ones(num_y))
    de, db, _ = _segment_local(kv)
    rows.append(roff[de] + ku[de] + db)
    cols.append(xoff[ev[de]] + db)
    vals.append(-np.ones(len(de)))

    num_rows = n + int((ku + kv).sum())
    a_mat = sp.coo_matrix(
        (np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
        shape=(num_rows, num_x + num_y),
    ).tocsr()
    b = np.zeros(num_rows)
    b[:n] = 1.0
    c = np.concatenate([*reduced.vertex_cost, *(r.ravel() for r in reduced.residual), np.zeros(0)])
    integrality = np.zeros(num_x + num_y)
    integrality[:num_x] = 1.0
    return c, a_mat, b, integrality, num_x


def _round_assignment(z: np.ndarray, sizes: tuple[int, ...]) -> tuple[int, ...]:
    """Read the assignment off ``x`` by an argmax per vertex."""
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    return tuple(int(np.argmax(z[s : s + k])) for s, k in zip(starts, sizes))


_MAX_ROUNDS = 3  # HiGHS solves at most this many times, each in the unit of the previous answer
_SCALE_SLACK = 2.0**-6  # solve again when the answer is below this fraction of the cost unit
# HiGHS's presolve takes time quadratic in a row's length and does not stop at the time limit (a vertex of
# 10,000 configurations: 8 s; 100,000: many minutes); longer rows are solved without it.
_PRESOLVE_MAX_ROW = 2048
_POLL_SECONDS = 0.1  # how often the waiting thread checks for an interrupt (Ctrl-C) while HiGHS runs
# HiGHS may overrun its time limit (it checks it between steps); past limit + max(these), the wait gives up.
_GRACE_SECONDS = 2.0
_GRACE_FRACTION = 0.25
# The program as we build it takes about 100 bytes per nonzero (COO triplets, their concatenation, CSR);
# HiGHS's MIP presolve dominates the rest and has no simple formula. Measured peaks of whole solves to
# optimality (zoo problems of 3,000 to 826,000 nonzeros: 1.0 to 5.9 KB per nonzero, 7 to 846 MB) lie under
# this envelope, 256 MiB + 1.5 KiB per nonzero (tests/test_memory_guards.py re-measures one); a long branch
# and bound keeps growing its node queue, which only the time limit bounds.
_BYTES_PER_NONZERO = 1536
_BASE_BYTES = 256 << 20


def _default_limit() -> int:
    from shardplan.search.dp import default_memory_limit  # the same default as the DP (a plain function)

    return default_memory_limit()


def program_size(data: _ProgramData) -> dict[str, int]:
    """Variables, rows, nonzeros of the program and an estimate of the bytes solving it takes."""
    kx = np.array([len(c) for c in data.vertex_cost], dtype=np.int64)
    ky = np.array([r.size for r in data.residual], dtype=np.int64)
    kr = np.array([sum(r.shape) for r in data.residual], dtype=np.int64)
    variables = int(kx.sum() + ky.sum())
    nonzeros = int(kx.sum() + 2 * ky.sum() + kr.sum())
    rows = int(len(kx) + kr.sum())
    est = _BASE_BYTES + _BYTES_PER_NONZERO * nonzeros
    return {"variables": variables, "rows": rows, "nonzeros": nonzeros, "estimate_bytes": int(est)}


def _cost_scale(problem: Problem, data: _ProgramData) -> float:
    """A unit for the program's costs: the cost of a good feasible assignment.

    HiGHS's tolerances are absolute (1e-7 on reduced costs and feasibility,
    1e-6 on integrality): on costs of 1e-8 s every configuration looks equally
    good and the program's "optimum" is arbitrary. Dividing every cost by a
    unit near the optimum makes the tolerances relative to it, and makes the
    program HiGHS sees the same (to rounding) whatever unit the problem is
    written in, so it takes the same path and breaks ties the same way. The
    unit is the cost of the assignment that takes each vertex's cheapest
    configuration after the edges' separable parts are folded in;
    :func:`solve_ilp` solves again in the unit of the answer if that one is
    much smaller.
    """
    greedy = [int(np.argmin(c)) for c in data.vertex_cost]
    u = problem.evaluate(greedy)
    if u > 0:
        return u
    top = max([float(np.max(np.abs(c))) for c in data.vertex_cost if c.size] + [0.0])
    return top if top > 0 else 1.0


def solve_ilp(problem: Problem, time_limit: float = 60.0, mip_rel_gap: float = 0.0, *,
              prune: bool = False, memory_limit_bytes: int | None = None) -> Solution:
    """Minimise F exactly with a mixed-integer program (HiGHS via ``scipy.optimize.milp``).

    Parameters:
        problem: the problem to solve.
        time_limit: seconds HiGHS may spend (model building not included).
        mip_rel_gap: stop once ``(cost - bound) / cost`` is at most this;
            0 asks for a proof of optimality (the absolute gap is also set to 0).
        prune: first drop every configuration whose lower bound exceeds an
            incumbent's cost (:func:`shardplan.search.bounds.bound_prune`, with
            :func:`shardplan.search.dp.solve_small` for its sub-problems) and
            solve the smaller program. Exact: every optimal assignment
            survives, so the pruned optimum (and any dual bound of it) is the
            original's. Off by default so that the ILP stays an independent
            check of the DP (the pruning is the DP's own code).

    Returns:
        A :class:`Solution` with ``solver="ilp"``, ``cost = problem.evaluate(assignment)``,
        ``optimal`` True only when the relative gap between that cost and the
        dual bound is below 1e-9, ``bound`` the dual bound capped at the cost
        (set to the cost when optimal; ``None`` if HiGHS gave none),
        ``solve_seconds`` including model building, and ``stats`` with ``variables``, ``constraints``,
        ``status`` (HiGHS's message), ``gap`` and the edge counts after
        merging (``edges_merged``) and dropping (``edges_kept``).

        memory_limit_bytes: refuse (:class:`TableMemoryError`) a program whose estimated solve
            (:func:`program_size`) needs more; default a quarter of the available memory.

    HiGHS solves the program in a cost unit near the answer (see :func:`_cost_scale`), and
    the answer is checked by :func:`~shardplan.search.problem.certify` (``stats["certificate"]``).

    Raises:
        ShardplanError: if the time limit ran out before any feasible point.
        TableMemoryError: if the program is estimated to need more than ``memory_limit_bytes``.
    """
    if time_limit <= 0:
        raise ShardplanError(f"time_limit must be positive, got {time_limit!r}")
    if mip_rel_gap < 0:
        raise ShardplanError(f"mip_rel_gap must be >= 0, got {mip_rel_gap!r}")
    if problem.num_vertices == 0:
        stats = {"variables": 0, "constraints": 0, "status": "empty problem", "gap": 0.0}
        return Solution(0.0, (), 0.0, "ilp", True, 0.0, stats)
    from scipy.optimize import Bounds, LinearConstraint, milp  # heavy: only when solving (not timed)

    start = time.perf_counter()

    red = None
    if prune:  # the DP side's code, on request only (see the module doc)
        from shardplan.search.bounds import bound_prune
        from shardplan.search.dp import solve_small

        red, bstats = bound_prune(problem, exact_solver=solve_small)
        bstats.pop("incumbent", None)
        original, problem = problem, red.problem
    reduced = program_data(problem)
    size = program_size(reduced)
    limit = _default_limit() if memory_limit_bytes is None else int(memory_limit_bytes)
    if size["estimate_bytes"] > limit:
        from shardplan.units import fmt_bytes

        raise TableMemoryError(
            f"ILP: a program of {size['variables']:,} variables and {size['nonzeros']:,} nonzeros needs about "
            f"{fmt_bytes(size['estimate_bytes'])} (the program and HiGHS's presolve), over the memory limit "
            f"of {fmt_bytes(limit)}; use the DP (--solver dp) or raise --table-memory")
    c, a_mat, b, integrality, num_x = build_program(reduced)
    scale = _cost_scale(problem, reduced)
    longest = int(np.diff(a_mat.tocsr().indptr).max()) if a_mat.shape[0] else 0
    options = {"time_limit": float(time_limit), "mip_rel_gap": float(mip_rel_gap), "mip_abs_gap": 0.0,
               "presolve": longest <= _PRESOLVE_MAX_ROW}
    rounds = []
    while True:
        left = float(time_limit) - (time.perf_counter() - start)
        if left <= 0 and not rounds:
            raise ShardplanError(f"ILP: building the program took the whole time limit of {time_limit:g} s "
                                 f"({c.size:,} variables); raise --time-limit or use the DP (--solver dp)")
        if left <= 0:
            break
        res = _interruptible(lambda: _milp(milp, c / scale, LinearConstraint(a_mat, b, b), integrality,
                                           Bounds(0.0, np.where(integrality > 0, 1.0, np.inf)),
                                           {**options, "time_limit": max(1e-3, left)}),
                             left + max(_GRACE_SECONDS, _GRACE_FRACTION * left),
                             f"ILP: HiGHS did not stop at its time limit of {time_limit:g} s ({c.size:,} "
                             "variables); use the DP (--solver dp)")
        rounds.append(scale)
        if res.get("x") is None or len(rounds) >= _MAX_ROUNDS:
            break
        found = problem.evaluate(_round_assignment(np.asarray(res["x"]), problem.sizes))
        if found == 0.0 or found >= scale * _SCALE_SLACK:
            break
        scale = found  # the answer is far below the unit: solve again in its own unit
    dual = res.get("mip_dual_bound")
    res = {**res, "mip_dual_bound": None if dual is None else float(dual) * scale}
    elapsed = time.perf_counter() - start
    stats = {
        "variables": int(c.size),
        "binaries": num_x,
        "constraints": int(a_mat.shape[0]),
        "nonzeros": int(a_mat.nnz),
        "edges_merged": reduced.merged,
        "edges_kept": len(reduced.edges),
        "memory_estimate_bytes": size["estimate_bytes"],
        "cost_scale": scale,
        "scales_tried": rounds,
    }
    stats["nodes"] = res.get("mip_node_count")
    sol = solution_from_result(problem, res, time_limit, elapsed, stats)
    dual = res["mip_dual_bound"]
    if red is None:
        return certify(problem, sol, dual)
    assignment = red.lift(sol.assignment)
    cost = original.evaluate(assignment)
    stats = {**sol.stats, "bounds": bstats}
    bound = cost if sol.optimal else (None if sol.bound is None else min(sol.bound, cost))
    return certify(original, Solution(cost, assignment, time.perf_counter() - start, "ilp", sol.optimal, bound,
                                      stats), dual)


def _milp(milp: Any, c: np.ndarray, constraints: Any, integrality: np.ndarray, bounds: Any,
          options: dict[str, Any]) -> Any:
    with warnings.catch_warnings():
        # mip_abs_gap is passed to HiGHS verbatim; scipy warns that it does not know it.
        warnings.filterwarnings("ignore", message="Unrecognized options", category=RuntimeWarning)
        return milp(c=c, constraints=constraints, integrality=integrality, bounds=bounds, options=options)


def _interruptible(run: Callable[[], Any], deadline: float, late: str) -> Any:
    """``run()`` in a worker thread while this one waits, so that Ctrl-C (KeyboardInterrupt, delivered to the
    main thread only between Python instructions, never inside HiGHS's C code) stops the wait at once, and a
    run still going after ``deadline`` seconds is given up (:class:`ShardplanError` ``late``): HiGHS checks
    its time limit only between its steps. An abandoned run goes on in its thread until it stops."""
    out: dict[str, Any] = {}

    def work() -> None:
        try:
            out["result"] = run()
        except BaseException as e:  # handed to the waiting thread, raised there
            out["error"] = e

    worker = threading.Thread(target=work, name="shardplan-highs", daemon=True)
    worker.start()
    end = time.perf_counter() + deadline
    while worker.is_alive():
        if time.perf_counter() > end:
            raise ShardplanError(late)
        worker.join(_POLL_SECONDS)
    if "error" in out:
        raise out["error"]
    return out["result"]


def solution_from_result(problem: Problem, res: Mapping, time_limit: float, elapsed: float, stats: dict) -> Solution:
    """Turn HiGHS's result into a :class:`Solution` (pure; separate so it can be tested).

    ``res`` needs ``x``, ``status`` (scipy's: 0 optimal, 1 limit reached),
    ``message`` and optionally ``mip_dual_bound``. The assignment is the
    argmax of ``x`` per vertex, the cost ``problem.evaluate`` of it; the gap is
    ``(cost - bound) / cost`` with ``bound = min(dual bound, cost)``.
    """
    stats = dict(stats)
    stats["status"] = str(res["message"])
    if res.get("x") is None:
        why = "the time limit was too short" if res["status"] == 1 else "HiGHS failed"
        raise ShardplanError(
            f"ILP found no feasible assignment within time_limit={time_limit!r} s "
            f"(HiGHS: {res['message']}); {why}"
        )
    assignment = _round_assignment(np.asarray(res["x"]), problem.sizes)
    cost = problem.evaluate(assignment)
    dual = res.get("mip_dual_bound")
    bound = None if dual is None or not np.isfinite(dual) else min(float(dual), cost)
    if bound is None:
        gap = float("inf")
    else:
        gap = (cost - bound) / abs(cost) if cost != 0 else (0.0 if bound >= cost else float("inf"))
    stats["gap"] = gap
    optimal = res["status"] == 0 and gap <= _OPTIMAL_RTOL
    if optimal:
        bound = cost
    return Solution(
        cost=cost,
        assignment=assignment,
        solve_seconds=elapsed,
        solver="ilp",
        optimal=bool(optimal),
        bound=bound,
        stats=stats,
    )
