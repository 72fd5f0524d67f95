"""Ctrl-C in the memory search: the best plan so far comes back with a bound that stays proven.

The interrupt is delivered deterministically: the exact solver given to the search raises
:class:`KeyboardInterrupt` at its k-th call, for every k up to the number of calls a full search makes.
"""
from __future__ import annotations

import pytest

from shardplan.cost import build_tables
from shardplan.fit import FitOptions, fit_problem, solve_fit
from shardplan.machine import Machine
from shardplan.search.constrained import solve_memory
from shardplan.search.dp import solve_dp
from shardplan.search.memory_ilp import solve_memory_ilp

F, B = 1e12, 1e10


def _tiny_gpt():
    from shardplan.models import get_model

    return get_model("gpt", batch=8, layers=1, d_model=64, heads=2, seq=32, vocab=256)


class _Counted:
    """The exact DP, raising KeyboardInterrupt at call ``at`` (never when ``at`` is None)."""

    def __init__(self, at: int | None):
        self.at, self.calls = at, 0

    def __call__(self, p):
        self.calls += 1
        if self.at is not None and self.calls == self.at:
            raise KeyboardInterrupt
        return solve_dp(p)


def _setup(frac: float):
    g = _tiny_gpt()
    m = Machine(4, peak_flops=F, bandwidth=B, latency=1e-6, memory_bytes=1e12)
    tables = build_tables(g, m, orders="row-major")
    free = solve_fit(g, m, tables=tables, options=FitOptions(micro_batches=(1,)))
    return g, m, tables, frac * free.memory["peak_bytes"]


@pytest.mark.parametrize("frac", [0.5, 0.7])
def test_solve_memory_interrupted_returns_incumbent_with_a_proven_bound(frac):
    _, _, tables, budget = _setup(frac)
    mp, _ = fit_problem(tables, budget, 1)
    exact = solve_memory_ilp(mp, time_limit=60)  # an independent exact solver
    assert exact.optimal
    full = _Counted(None)
    done = solve_memory(mp, dp=full)
    assert done.cost == pytest.approx(exact.cost, rel=1e-9) and not done.stats["interrupted"]
    returned = raised = 0
    for k in range(1, full.calls + 1):
        try:
            sol = solve_memory(mp, dp=_Counted(k))
        except KeyboardInterrupt:
            raised += 1
            continue
        returned += 1
        assert sol.stats["interrupted"] and sol.stats["status"] == "stopped at the interrupt"
        assert sol.stats["memory_bytes"] <= budget * (1 + 1e-12)
        assert sol.cost >= exact.cost * (1 - 1e-9)
        assert sol.bound <= exact.cost * (1 + 1e-9)
        assert not sol.optimal or sol.cost == pytest.approx(exact.cost, rel=1e-9)
    assert raised >= 1  # the first solve has no plan to return: the interrupt goes on
    assert returned >= 1, "no interrupt landed after a plan was known: the test checks nothing"


def test_solve_fit_interrupted_returns_best_plan_with_a_proven_bound():
    g, m, tables, budget = _setup(0.6)
    opts = FitOptions(micro_batches=(1, 2, 4))
    full = _Counted(None)
    best = solve_fit(g, m, budget=budget, tables=tables, options=opts, dp=full)
    assert best.solution.optimal and not best.solution.stats["interrupted"]
    returned = 0
    for k in range(1, full.calls + 1):
        try:
            plan = solve_fit(g, m, budget=budget, tables=tables, options=opts, dp=_Counted(k))
        except KeyboardInterrupt:
            continue
        returned += 1
        st = plan.solution.stats
        assert st["interrupted"]
        assert plan.memory["peak_bytes"] <= budget * (1 + 1e-12)
        assert plan.cost >= best.cost * (1 - 1e-9)
        assert plan.solution.bound <= best.cost * (1 + 1e-9)
        assert st["gap"] == pytest.approx(0.0 if plan.solution.optimal else
                                          (plan.cost - plan.solution.bound) / plan.cost)
    assert returned >= 1, "no interrupt landed after a plan was known: the test checks nothing"
