"""Host offload and mixed-precision state (FP32 master weights) in the exact fit search, against brute force, and
each offload taken where it pays and not where it does not.

The two dense layers of test_precision_offload on 2 devices, every ZeRO stage 0-3, recomputation, FP8 and every
offload offered, with and without master weights (``ChoiceRules.master_weights``: 16 bytes per parameter for
Adam), on a fast host link (5 GB/s) and a slow one (100 MB/s, a CPU Adam of 10 M parameters/s): the search's
answer is brute force's at budgets from loose to 8 % of the unconstrained peak. Under 30 % of the peak the fast
link moves a layer's saved activations to host memory under its compute, the slow one cannot and the search
recomputes instead; parameters (with the optimizer state) go to host memory only under a budget that needs
them, never under a loose one.
"""

from __future__ import annotations

import numpy as np
import pytest

from shardplan.cost import build_tables
from shardplan.fit import FitOptions, solve_fit
from shardplan.machine import Machine

from test_precision_offload import ALL, _bruteforce, _two_products  # noqa: E402  (tests/fit is on sys.path)

LINKS = {"fast": (5e9, 1e9), "slow": (1e8, 1e7)}  # host bytes/s per direction, CPU Adam parameters/s


def setup(link: str, master_weights: bool):
    host_bandwidth, adam = LINKS[link]
    mach = Machine(2, peak_flops=1e12, bandwidth=1e9, latency=1e-6, dtype_bytes=2, hbm_bandwidth=1e12,
                   fp8_flops=2e12, host_bandwidth=host_bandwidth, host_latency=1e-6, host_memory_bytes=1e12,
                   cpu_adam_rate=adam)
    g = _two_products()
    opts = FitOptions(stages=(0, 1, 2, 3), micro_batches=(1,), fp8=True, offload=ALL, master_weights=master_weights)
    tables = build_tables(g, mach, orders="row-major", cutoff=1)
    top = solve_fit(g, mach, budget=1e12, tables=tables, options=opts).memory["peak_bytes"]
    return g, mach, tables, opts, top


def choices(plan, n: int = 2):
    mc = plan.memory_choices
    return [(mc.stage(i), mc.recompute(i), mc.fp8(i), mc.offload(i)) for i in range(n)]


@pytest.mark.parametrize("link", list(LINKS))
@pytest.mark.parametrize("master_weights", [False, True])
@pytest.mark.parametrize("frac", [1.0, 0.3, 0.15, 0.08])
def test_fit_with_every_stage_master_weights_fp8_and_offload_matches_bruteforce(link, master_weights, frac):
    g, mach, tables, opts, top = setup(link, master_weights)
    want = _bruteforce(tables, opts, frac * top, np.inf)
    assert np.isfinite(want)
    plan = solve_fit(g, mach, budget=frac * top, tables=tables, options=opts)
    assert plan.cost == pytest.approx(want, rel=1e-9)
    assert plan.memory["peak_bytes"] <= frac * top * (1 + 1e-9)


def test_master_weights_cost_memory_the_search_pays_for():
    """The same budget in bytes: with 16 bytes of state per parameter instead of 2 + 2 + 8 the answer is never
    faster, and at the tight budget it is slower."""
    for frac in (1.0, 0.15):
        g, mach, tables, opts, top = setup("fast", False)
        plain = solve_fit(g, mach, budget=frac * top, tables=tables, options=opts)
        g, mach, tables, opts, _ = setup("fast", True)
        mixed = solve_fit(g, mach, budget=frac * top, tables=tables, options=opts)
        assert mixed.cost >= plain.cost * (1 - 1e-12)
    assert mixed.cost > plain.cost


@pytest.mark.parametrize("link, offloads", [("fast", True), ("slow", False)])
def test_activation_offload_is_taken_where_the_host_link_hides_it(link, offloads):
    g, mach, tables, opts, top = setup(link, False)
    plan = solve_fit(g, mach, budget=0.3 * top, tables=tables, options=opts)
    picked = choices(plan)
    moved = ["activations" in c[3] for c in picked]
    assert any(moved) == offloads, picked
    if offloads:  # the layer whose activations go to the host does not also recompute them
        assert all(not c[1] for c, m in zip(picked, moved) if m)
    else:  # the slow link's answer recomputes instead
        assert any(c[1] for c in picked), picked


@pytest.mark.parametrize("link", list(LINKS))
def test_parameters_go_to_the_host_only_under_a_budget_that_needs_them(link):
    g, mach, tables, opts, top = setup(link, False)
    loose = choices(solve_fit(g, mach, budget=top, tables=tables, options=opts))
    assert all(c[3] == () for c in loose), loose
    tight = choices(solve_fit(g, mach, budget=0.15 * top, tables=tables, options=opts))
    assert any("parameters" in c[3] and c[0] == 3 for c in tight), tight
