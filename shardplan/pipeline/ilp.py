"""The pipeline problem as a mixed-integer program: an independent check of the exact search.

For one micro-batch count m and one stage count S, a pipeline is a path in a
layered DAG: node ``(u, o, r)`` is "units from u, devices from o, r stages
left"; an arc is a stage, units [a, b) on the q devices from o, from ``(a, o,
r)`` to ``(b, o + q, r - 1)``, present when its sub-mesh is placeable and
its plan fits the budget with its in-flight micro-batches (1F1B: ``min(r,
m)``, stage S - r of S; ZB-H1: S on every stage), the memory-constrained
optimum (``fit_fn``) standing in where the time-optimal plan does not fit.
Binary ``x_e`` per arc, one unit of flow from ``(0, 0, S)`` to ``(U, p,
0)``. An arc's cost ``h_e`` is its seconds plus the exact transfers it is
charged (``exchange``: the activation into it when a > 0, the gradient of
its output when r > 1, as the search charges them); ``g_e`` is the largest
of the three. Then, with continuous M, W, Y::

    1F1B:   min  sum_e h_e x_e + (m - 1) M
    ZB-H1:  min  sum_e h_e x_e + (m - 1) M - (S - 1)(W + Y)     (S <= m)
    s.t.    M >= g_e x_e,   W <= w_e + H (1 - x_e),   Y <= y_e + H (1 - x_e)

(w_e the stage's weight-gradient seconds, y_e = min(w_e, f_e, b_e), H the
largest w_e): M is the largest stage or transfer time and W, Y the least W
and min(W, F, B) over the stages taken, exactly the closed forms of
:mod:`shardplan.pipeline.schedule`. HiGHS (``scipy.optimize.milp``) solves
each (m, S); the least over them is the optimum over every cut and sub-mesh
sequence, nothing shared with the search's DP, bounds or laziness (every
stage is costed eagerly).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from shardplan.errors import ShardplanError
from shardplan.pipeline.search import (ExchangeFn, FitFn, PipelineSpace, StageFn, _exchanged, _placeable,
                                       evaluate_pipeline)

__all__ = ["PipelineILPResult", "solve_pipeline_ilp"]


@dataclass(frozen=True)
class PipelineILPResult:
    """The least step over the (m, S) programs solved, its stages ``(first, end, devices)`` and m; ``proven``:
    every program was solved to optimality (none stopped by the time limit)."""

    step_time: float
    segments: tuple[tuple[int, int, int], ...]
    micro_batches: int
    proven: bool


def _arcs(space: PipelineSpace, n: int, m: int, schedule: str, stage_fn: StageFn, exchange: ExchangeFn,
          fit_fn: FitFn | None, cache: dict) -> list[tuple]:
    """Every stage arc (a, b, o, q, r, h, g, w, y) of the layered DAG for n stages at m."""
    U, p = space.num_units, space.num_devices
    ns = p if space.node_size is None or space.node_size >= p else space.node_size
    budget = math.inf if space.budget is None else space.budget
    sizes = [p // n] if space.uniform else list(space.allowed_sizes())
    out = []
    for r in range(n, 0, -1):
        k = float(n if schedule == "zb-h1" else min(r, m))
        for a in range(U):
            for b in range(a + 1, U + 1):
                if U - b < r - 1 or (r == 1 and b != U) or (r == n and a != 0):
                    continue
                for o in range(p):
                    for q in sizes:
                        if not _placeable(o, q, p, ns) or (r == 1 and o + q != p) or (r == n and o != 0):
                            continue
                        if p - (o + q) < (r - 1) * min(sizes):
                            continue
                        key = (a, b, q, k)
                        if key not in cache:
                            c = stage_fn(a, b, q, m)
                            if c is not None and c.memory(k) > budget:
                                c = fit_fn(a, b, q, m, int(k), budget) if fit_fn is not None else None
                                c = c if c is not None and c.memory(k) <= budget else None
                            cache[key] = c
                        c = cache[key]
                        if c is None:
                            continue
                        fin = _exchanged(exchange, c.recv_bytes, o % ns == 0) if a > 0 else 0.0
                        gout = _exchanged(exchange, c.grad_bytes, (o + q) % ns == 0) if r > 1 else 0.0
                        w = c.weight_grad
                        out.append((a, b, o, q, r, c.time + fin + gout, max(c.time, fin, gout), w,
                                    min(w, c.forward, c.backward - w)))
    return out


def _solve_one(space: PipelineSpace, n: int, m: int, schedule: str, arcs: list[tuple], time_limit: float):
    """The (m, S) program: (objective, chosen arcs, optimal?) or None when infeasible."""
    from scipy import sparse
    from scipy.optimize import Bounds, LinearConstraint, milp

    U, p = space.num_units, space.num_devices
    E = len(arcs)
    zb = schedule == "zb-h1"
    nv = E + (3 if zb else 1)  # x_e, M, [W, Y]
    iM, iW, iY = E, E + 1, E + 2
    c = np.zeros(nv)
    c[:E] = [e[5] for e in arcs]
    c[iM] = m - 1
    if zb:
        c[iW] = c[iY] = -(n - 1)
    rows, lo, hi = [], [], []

    def row(coefs: dict[int, float], lb: float, ub: float) -> None:
        rows.append(coefs)
        lo.append(lb)
        hi.append(ub)

    nodes: dict[tuple[int, int, int], dict[int, float]] = {}
    for i, (a, b, o, q, r, *_rest) in enumerate(arcs):
        nodes.setdefault((a, o, r), {})[i] = -1.0  # leaves
        nodes.setdefault((b, o + q, r - 1), {})[i] = 1.0  # enters
    for node, coefs in nodes.items():
        if node == (0, 0, n):
            row(coefs, -1.0, -1.0)
        elif node == (U, p, 0):
            row(coefs, 1.0, 1.0)
        else:
            row(coefs, 0.0, 0.0)
    big = max([e[7] for e in arcs] + [0.0])
    for i, e in enumerate(arcs):
        row({iM: 1.0, i: -e[6]}, 0.0, math.inf)  # M >= g_e x_e
        if zb:
            row({iW: 1.0, i: big}, -math.inf, e[7] + big)  # W <= w_e + H (1 - x_e)
            row({iY: 1.0, i: big}, -math.inf, e[8] + big)
    if (0, 0, n) not in nodes or (U, p, 0) not in nodes:
        return None
    ij = [(j, i, v) for j, coefs in enumerate(rows) for i, v in coefs.items()]
    a_mat = sparse.csr_array(([v for *_, v in ij], ([j for j, *_ in ij], [i for _, i, _ in ij])),
                             shape=(len(rows), nv))
    integrality = np.zeros(nv)
    integrality[:E] = 1
    upper = np.full(nv, np.inf)
    upper[:E] = 1.0
    if zb:
        upper[iW] = upper[iY] = big
    res = milp(c, constraints=LinearConstraint(a_mat, lo, hi), integrality=integrality,
               bounds=Bounds(np.zeros(nv), upper), options={"time_limit": time_limit, "mip_rel_gap": 1e-12})
    if res.x is None:
        return None
    chosen = sorted((arcs[i] for i in range(E) if res.x[i] > 0.5), key=lambda e: -e[4])
    return float(res.fun), chosen, res.status == 0


def solve_pipeline_ilp(space: PipelineSpace, stage_fn: StageFn, exchange: ExchangeFn, schedule: str = "1f1b",
                       fit_fn: FitFn | None = None, time_limit: float = 60.0,
                       stage_counts: Sequence[int] | None = None) -> PipelineILPResult:
    """The optimum over every cut, sub-mesh sequence, m and stage count (``stage_counts``, default all; ZB-H1:
    S <= m) under ``schedule`` (1f1b or zb-h1), one MILP per (m, S) (module docstring). The step is re-evaluated
    by :func:`~shardplan.pipeline.search.evaluate_pipeline` on the stages chosen. Raises when nothing fits."""
    if schedule not in ("1f1b", "zb-h1"):
        raise ShardplanError(f"solve_pipeline_ilp: schedule {schedule!r} is not 1f1b or zb-h1")
    U, p = space.num_units, space.num_devices
    s_max = min(space.max_stages or U, U, p)
    best: PipelineILPResult | None = None
    proven = True
    for m in sorted(set(space.micro_batches)):
        cache: dict = {}
        for n in (stage_counts or range(1, s_max + 1)):
            if n > s_max or (schedule == "zb-h1" and n > m):
                continue
            if space.uniform and (p % n or p // n not in space.allowed_sizes()):
                continue
            arcs = _arcs(space, n, m, schedule, stage_fn, exchange, fit_fn, cache)
            got = _solve_one(space, n, m, schedule, arcs, time_limit) if arcs else None
            if got is None:
                continue
            _, chosen, optimal = got
            proven = proven and optimal
            segs = tuple((e[0], e[1], e[3]) for e in chosen)
            plan = evaluate_pipeline(segs, m, space, stage_fn, lambda *a: 0.0, exchange, schedule=schedule,
                                     fit_fn=fit_fn)
            if plan is not None and (best is None or plan.step_time < best.step_time):
                best = PipelineILPResult(plan.step_time, segs, m, proven)
    if best is None:
        raise ShardplanError("solve_pipeline_ilp: no pipeline fits")
    return PipelineILPResult(best.step_time, best.segments, best.micro_batches, proven)
