"""The memory-constrained problem as an integer program (HiGHS): an independent check.

The program is :mod:`shardplan.search.ilp`'s local-polytope formulation of
the *expanded* problem (one binary ``x[v,j]`` per choice, edge matrices
repeated per choice) with one more row::

    sum_v sum_j memory[v][j] x[v,j]  <=  B - fixed.

It shares nothing with the Lagrangian/branch-and-bound solver of
:mod:`shardplan.search.constrained` beyond :class:`MemoryProblem`.

:func:`solve_peak_ilp` is the same program for a
:class:`~shardplan.search.peak.PeakProblem` with one memory row per backward
step k instead::

    sum_v sum_j (rest[v][j] + [v <= k] saved[v][j] + [v >= k] grad[v][j]) x[v,j]  <=  B - fixed,

independent of the surrogate search of :mod:`shardplan.search.peak`.
"""

from __future__ import annotations

import time
import warnings

import numpy as np

from shardplan.errors import ShardplanError
from shardplan.search.constrained import MemoryProblem, infeasible_message
from shardplan.search.problem import Solution

__all__ = ["solve_memory_ilp", "solve_peak_ilp"]


def solve_memory_ilp(mp: MemoryProblem, time_limit: float = 60.0) -> Solution:
    """Minimise F subject to M <= budget with HiGHS (``scipy.optimize.milp``).

    Returns a :class:`Solution` over choice indices; ``optimal`` when HiGHS
    proved it (to its tolerances, relative to the objective scaled so that the
    least-memory plan costs 1); ``stats["memory_bytes"]``. Raises ShardplanError when HiGHS
    proves the budget infeasible (naming the least memory) or finds nothing
    in time.
    """
    least = mp.least_memory()
    if least > mp.budget:
        raise ShardplanError(infeasible_message(least, mp.budget))
    sol = solve_rows(mp, [np.concatenate(mp.memory)], time_limit)
    sol.stats["memory_bytes"] = mp.evaluate(sol.assignment)[1]
    return sol


def solve_peak_ilp(pp, time_limit: float = 60.0) -> Solution:
    """Minimise F subject to every backward step's memory M_k <= budget (one row per k) with HiGHS.

    ``pp``: a :class:`~shardplan.search.peak.PeakProblem`. Returns as :func:`solve_memory_ilp`, with
    ``stats["memory_bytes"]`` the plan's peak. Raises ShardplanError when HiGHS proves no plan fits or
    finds none in time.
    """
    n = pp.problem.num_vertices
    rows = [np.concatenate(pp.contribution(k)) for k in range(n)]
    mp = pp.additive()
    try:
        sol = solve_rows(mp, rows, time_limit)
    except ShardplanError:
        raise ShardplanError(f"peak ILP: no feasible assignment (HiGHS) within {time_limit:g} s or at all") from None
    sol.stats["memory_bytes"] = pp.evaluate(sol.assignment)[1]
    return sol


def solve_rows(mp: MemoryProblem, rows: list[np.ndarray], time_limit: float) -> Solution:
    """The local-polytope program of ``mp.expanded()`` with the rows ``row . x <= budget - fixed``
    (one entry per choice, vertices in order)."""
    import scipy.sparse as sp
    from scipy.optimize import Bounds, LinearConstraint, milp

    from shardplan.search.ilp import build_program, program_data

    t0 = time.perf_counter()
    problem = mp.expanded()
    c, a_mat, b, integrality, num_x = build_program(program_data(problem))
    # HiGHS's tolerances are absolute (~1e-7 .. 1e-6): step times of microseconds would all look equal.
    # The objective is scaled so that a feasible plan (least memory everywhere) costs 1.
    least_choice = tuple(int(np.argmin(m)) for m in mp.memory)
    scale_c = mp.evaluate(least_choice)[0] or 1.0
    c = c / scale_c
    mem_rows = np.zeros((len(rows), c.size))
    mem_rows[:, :num_x] = np.array(rows)
    scale = max(float(mem_rows.max()), 1.0)  # rows in units of the largest entry keep HiGHS well scaled
    constraints = [LinearConstraint(a_mat, b, b),
                   LinearConstraint(sp.csr_matrix(mem_rows / scale), -np.inf, (mp.budget - mp.fixed) / scale)]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Unrecognized options", category=RuntimeWarning)
        res = milp(c=c, constraints=constraints, integrality=integrality,
                   bounds=Bounds(0.0, np.where(integrality > 0, 1.0, np.inf)),
                   options={"time_limit": float(time_limit), "mip_rel_gap": 0.0, "mip_abs_gap": 0.0})
    if res.x is None:
        raise ShardplanError(f"memory ILP found no feasible assignment within {time_limit:g} s (HiGHS: {res.message})")
    starts = np.concatenate([[0], np.cumsum(mp.num_choices)[:-1]]).astype(np.int64)
    choices = tuple(int(np.argmax(res.x[s:s + k])) for s, k in zip(starts, mp.num_choices))
    cost, _ = mp.evaluate(choices)
    dual = getattr(res, "mip_dual_bound", None)
    optimal = res.status == 0
    bound = cost if optimal else (None if dual is None or not np.isfinite(dual) else min(float(dual) * scale_c, cost))
    return Solution(cost=cost, assignment=choices, solve_seconds=time.perf_counter() - t0, solver="memory-ilp",
                    optimal=bool(optimal), bound=bound,
                    stats={"status": str(res.message), "variables": int(c.size)})
