"""Independent check of the exact DP on real models: the ILP (HiGHS) finds the same optimum."""

from __future__ import annotations

import pytest

from shardplan.cost import build_tables
from shardplan.machine import preset
from shardplan.models import model_spec
from shardplan.search import solve_dp, solve_ilp, solve_mcmc


@pytest.mark.parametrize("name,sizes", [("alexnet", {}), ("inception_v3", {"batch": 8})])
def test_ilp_and_dp_agree_on_zoo_models_at_p8(name, sizes):
    spec = model_spec(name)
    problem = build_tables(spec.build(**sizes), preset("paper", 8), cutoff=spec.cutoff).to_problem()
    dp = solve_dp(problem)
    ilp = solve_ilp(problem, time_limit=120)
    assert ilp.optimal
    assert ilp.cost == pytest.approx(dp.cost, rel=1e-6)
    assert problem.evaluate(dp.assignment) == pytest.approx(dp.cost, rel=1e-12)
    mc = solve_mcmc(problem, seed=1, max_proposals=20_000)
    assert mc.cost >= dp.cost * (1 - 1e-9)
