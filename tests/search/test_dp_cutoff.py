"""The exact DP with a cutoff (an incumbent from outside: docs/search.md, *An incumbent from outside*): below the
cutoff the answer is the one without it, bit for bit; at or above it the DP may answer a proven bound instead,
which lies between the cutoff and the optimum. The one-program memory search passes the best plan known as that
cutoff: the same plan and bound wherever it beats the incumbent."""

from __future__ import annotations

import numpy as np
import pytest

from randgraphs import random_problem
from shardplan.fit import FitOptions, solve_fit
from shardplan.machine import preset
from shardplan.models import get_model
from shardplan.search import solve_bruteforce, solve_dp


@pytest.mark.parametrize("seed", range(60))
def test_cutoff_below_the_optimum_is_the_plain_answer_and_above_it_a_proven_bound(seed):
    p = random_problem(seed, n_max=8, k_max=5)
    plain = solve_dp(p)
    opt = solve_bruteforce(p).cost
    assert plain.cost == pytest.approx(opt, rel=1e-9, abs=1e-12)
    # a cutoff above the optimum: no round's bound reaches it, the answer is the plain one bit for bit
    for above in (opt * 1.5 + 1.0, opt + 1e-6 * (1 + abs(opt))):
        got = solve_dp(p, cutoff=above)
        assert not got.stats.get("cut_off") and got.optimal
        assert got.cost == plain.cost and got.assignment == plain.assignment and got.bound == plain.bound
    # a cutoff at or below the optimum: either the plain answer, or a proven bound in [cutoff, optimum] with a real
    # assignment of the cost it states
    for below in (opt, opt * 0.999, opt * 0.5, 0.0):
        got = solve_dp(p, cutoff=below)
        if got.stats.get("cut_off"):
            assert not got.optimal
            assert below <= got.bound <= opt * (1 + 1e-12) + 1e-15
            assert got.cost == pytest.approx(p.evaluate(got.assignment), rel=1e-12) and got.cost >= opt * (1 - 1e-12)
        else:
            assert got.cost == plain.cost and got.assignment == plain.assignment


def test_a_cutoff_far_below_cuts_at_the_first_round():
    """With the cutoff 0 every problem's first forest bound reaches it: one round of bound pruning, no elimination."""
    cut = 0
    for seed in range(40):
        p = random_problem(seed, n_max=8, k_max=5)
        got = solve_dp(p, cutoff=-1.0)
        cut += bool(got.stats.get("cut_off"))
        if got.stats.get("cut_off"):
            assert got.stats["bounds"]["rounds"] == 1 and "dp_seconds" not in got.stats
    assert cut == 40


def test_cutoff_without_bounds_is_ignored():
    p = random_problem(3, n_max=8, k_max=5)
    a, b = solve_dp(p, bounds=False), solve_dp(p, bounds=False, cutoff=-1.0)
    assert a.cost == b.cost and a.assignment == b.assignment and b.optimal


@pytest.fixture(scope="module")
def gpt_fit():
    """GPT (2 layers) on 8 H100 under a budget that needs ZeRO or recomputation at some micro-batch counts, and the
    memory search's answer there without an incumbent: one search for every ratio below (it was made once per
    ratio, the same call each time; nothing in it depends on the graph object's history)."""
    m = preset("h100", 8)
    g = get_model("gpt", 16, layers=2, d_model=256)
    opts = FitOptions(micro_batches=(1, 2, 4, 8))
    budget = 0.06 * 2**30  # ZeRO or recomputation needed at some counts
    return g, m, opts, budget, solve_fit(g, m, budget=budget, options=opts, cutoff=1)


@pytest.mark.parametrize("ratio", [1.5, 1.001, 0.999, 0.97])
def test_memory_search_with_the_cutoff_same_plan_and_bound(gpt_fit, ratio):
    """solve_fit with an incumbent from outside, its Lagrangian solves cut off (the default) and not (an exact solver
    given, which the cutoff never reaches): where the optimum beats the incumbent the same plan, cost and bound;
    where it does not, both prove it (status and a bound at least the incumbent within 1e-9)."""
    import shardplan.search.dp as dp

    g, m, opts, budget, opt = gpt_fit
    inc = opt.cost * ratio
    seen = []
    real = dp.solve_dp

    def watched(p, **kw):
        got = real(p, **kw)
        seen.append(bool(got.stats.get("cut_off")))
        return got

    dp.solve_dp = watched
    try:
        cut = solve_fit(g, m, budget=budget, options=opts, cutoff=1, incumbent=inc)
    finally:
        dp.solve_dp = real
    plain = solve_fit(g, m, budget=budget, options=opts, cutoff=1, incumbent=inc, dp=lambda p: real(p))
    a, b = cut.solution, plain.solution
    assert a.stats["beats_incumbent"] == b.stats["beats_incumbent"] == (ratio > 1)
    assert a.stats["status"] == b.stats["status"]
    if ratio > 1:
        assert a.cost == b.cost and a.bound == b.bound and a.assignment == b.assignment
        assert a.cost == pytest.approx(opt.cost, rel=1e-12)  # summed in another order: equal to the last bits or so
        assert a.stats["micro_batches"] == b.stats["micro_batches"]
    else:
        assert min(a.bound, b.bound) >= inc * (1 - 1e-9)
    # (which counts reach a root, and so a cut-off solve, depends on timing: the solve-free count bound is tried
    # only while its forest pass is cheap against a root; tests above check the cut-off solves themselves)
    assert np.isfinite(a.bound)
