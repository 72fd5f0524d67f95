"""solve_fit with an incumbent from outside its space (a pipeline's step): it prunes, it never changes the answer."""

from __future__ import annotations

import pytest

from shardplan.cost import build_tables
from shardplan.errors import ShardplanError
from shardplan.fit import FitOptions, solve_fit
from shardplan.machine import Machine

B = 1e9  # bytes/s
F = 1e12  # FLOP/s
COUNTS = (1, 2, 4, 8)


@pytest.fixture(scope="module")
def case():
    """A one-layer GPT on 4 devices, its tables, and the free plan's peak (the budgets are fractions of it)."""
    from shardplan.models import get_model

    g = get_model("gpt", batch=8, layers=1, d_model=64, heads=2, seq=32, vocab=256)
    m = Machine(4, peak_flops=F, bandwidth=100 * B, latency=1e-6, memory_bytes=1e12)
    tables = build_tables(g, m, orders="row-major")
    free = solve_fit(g, m, tables=tables, options=FitOptions(micro_batches=(1,)))
    return g, m, tables, free.memory["peak_bytes"]


@pytest.mark.parametrize("frac", [0.5, 0.8])
@pytest.mark.parametrize("above", [1.0 + 1e-6, 1.3])
def test_an_incumbent_above_the_optimum_changes_nothing(case, frac, above):
    """Above the optimum the incumbent prunes only what cannot beat it: plan, choices, cost, bound and proof
    are those of the search without it (the reference)."""
    g, m, tables, peak = case
    opts = FitOptions(micro_batches=COUNTS)
    ref = solve_fit(g, m, budget=frac * peak, tables=tables, options=opts)
    got = solve_fit(g, m, budget=frac * peak, tables=tables, options=opts, incumbent=above * ref.cost)
    assert ref.solution.optimal and got.solution.optimal
    assert got.cost == ref.cost and got.assignment == ref.assignment
    assert got.memory_choices.choices == ref.memory_choices.choices
    assert got.memory_choices.micro_batches == ref.memory_choices.micro_batches
    assert got.solution.bound == ref.solution.bound
    assert got.solution.stats["beats_incumbent"] and got.solution.stats["status"] == "optimal"
    assert got.solution.stats["incumbent"] == above * ref.cost


@pytest.mark.parametrize("frac", [0.5, 0.8])
@pytest.mark.parametrize("below", [0.5, 0.97, 1.0])
def test_an_incumbent_at_or_below_the_optimum_gives_none_better_with_a_sound_bound(case, frac, below):
    """At or below the optimum nothing beats the incumbent: the answer says so, its bound is a proven lower
    bound of the optimum (at most the reference's cost, at least the incumbent within 1e-9: every count is
    closed against it), and the plan it returns is a real one within the budget, no cheaper than the optimum."""
    g, m, tables, peak = case
    budget = frac * peak
    opts = FitOptions(micro_batches=COUNTS)
    ref = solve_fit(g, m, budget=budget, tables=tables, options=opts)
    inc = below * ref.cost
    got = solve_fit(g, m, budget=budget, tables=tables, options=opts, incumbent=inc)
    st = got.solution.stats
    assert not st["beats_incumbent"]
    # (at the optimum itself the search may see an optimal plan, a tie: then it is proven optimal, as it is)
    assert st["status"] == "no plan below the incumbent" or (below == 1.0 and st["status"] == "optimal")
    assert inc * (1 - 1e-9) <= got.solution.bound <= ref.cost * (1 + 1e-12)
    assert got.cost >= ref.cost * (1 - 1e-12) and got.memory["peak_bytes"] <= budget
    assert len(st["per_micro_batches"]) == len(COUNTS)
    # every count's own bound is sound too: at most its own optimum, solved alone
    for row in st["per_micro_batches"]:
        if row.get("status") == "infeasible":
            continue
        alone = solve_fit(g, m, budget=budget, tables=tables, options=FitOptions(micro_batches=(row["micro_batches"],)))
        own = row.get("bound", row.get("lower_bound"))
        assert own is not None and own <= alone.cost * (1 + 1e-12)


def test_the_incumbent_is_checked(case):
    g, m, tables, peak = case
    with pytest.raises(ShardplanError, match="incumbent"):
        solve_fit(g, m, budget=peak, tables=tables, options=FitOptions(micro_batches=(1,)), incumbent=-1.0)
