"""The exact search on mixture-of-experts graphs: expert parallelism where it pays, not where it does not, and
the dynamic program against brute force, the breadth-first reference and the ILP."""

from __future__ import annotations

import functools

import pytest

from shardplan.cost import build_tables
from shardplan.layout import Layout
from shardplan.machine import Machine, preset
from shardplan.models import get_model
from shardplan.search import solve_dp, solve_ilp
from shardplan.search.reference import solve_bfs_dp, solve_bruteforce
from shardplan.spmd import plan_from_configs, solve

EXPERTS = ("L1/moe/expert_in", "L1/moe/expert_act", "L1/moe/expert_down")
TOKENS = ("L1/moe/router", "L1/moe/gate", "L1/moe/dispatch", "L1/moe/combine")


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b), 1e-30)


def _batch_only(plan, levels):
    """Every operator split over its batch on every level (pure data parallelism), costed in ``plan``'s tables."""
    lays = {}
    for op in plan.graph:
        names = op.dim_names
        j = names.index("b")
        splits = tuple(tuple(s if i == j else 1 for i in range(len(names))) for s in levels)
        lays[op.name] = Layout(names, levels, splits, tuple(((j,) if s > 1 else ()) for s in levels))
    return plan_from_configs(plan.tables, lays, name="data-parallel")


@functools.cache
def _big_experts():
    # 64 experts of 1024 x 4096 (0.8 GB of expert weights in bf16) for 64 x 128 tokens on 64 H100s (8 nodes)
    g = get_model("moe", 64, layers=1, experts=64, d_model=1024, d_expert=4096, heads=8, kv_heads=8, seq=128)
    return solve(g, preset("h100", 64), cutoff=1)


def test_the_search_splits_large_experts_over_many_devices():
    plan = _big_experts()
    # the experts' expert dimension over all 64 devices (each holds one expert), the tokens over the batch:
    # expert parallelism with its two all-to-alls
    for name in EXPERTS:
        lay = plan.layout(name)
        assert lay.split[lay.dims.index("e")] == 64, (name, lay.describe())
    for name in TOKENS:
        lay = plan.layout(name)
        assert lay.split[lay.dims.index("b")] == 64, (name, lay.describe())
    assert plan.breakdown["redistribution"] > 0
    # and it beats data parallelism, which all-reduces every expert's gradient across the 8 nodes
    dp = _batch_only(plan, (8, 8))
    assert plan.cost < 0.5 * dp.cost
    assert dp.breakdown["redistribution"] == 0.0


def test_the_search_keeps_tiny_experts_data_parallel():
    # 16 experts of 64 x 16 for 256 x 128 tokens on 16 H100s: the all-to-all would move far more than the
    # experts' gradients weigh
    g = get_model("moe", 256, layers=1, experts=16, d_model=64, d_expert=16, heads=8, kv_heads=8, seq=128)
    plan = solve(g, preset("h100", 16), cutoff=1)
    for name in EXPERTS + TOKENS:
        lay = plan.layout(name)
        assert lay.split[lay.dims.index("e")] == 1 and lay.split[lay.dims.index("b")] == 16, (name, lay.describe())
    assert plan.breakdown["redistribution"] == 0.0
    assert _close(plan.cost, _batch_only(plan, (8, 2)).cost)


def _layer(d_expert: int):
    """The routed layer of a one-block tiny model, alone (4 sequences of 8 tokens, 4 experts)."""
    full = get_model("moe", 4, layers=1, experts=4, d_model=16, d_expert=d_expert, seq=8, heads=2, kv_heads=2)
    return full.derive([op for op in full if op.name.startswith("L1/moe/")])


# machines where the experts' weights are cheap or dear to synchronise against the tokens' all-to-all
MACHINES = {"slow-link": Machine(2, 1e9, 1e8, latency=1e-6), "fast-link": Machine(2, 1e12, 1e11, latency=1e-5)}


@pytest.mark.parametrize("machine", list(MACHINES))
@pytest.mark.parametrize("d_expert", [4, 512])
def test_dp_equals_brute_force_on_the_routed_layer(machine, d_expert):
    tables = build_tables(_layer(d_expert), MACHINES[machine], cutoff=1, orders="all")
    problem = tables.to_problem()
    best = solve_bruteforce(problem)
    dp = solve_dp(problem)
    assert _close(dp.cost, best.cost)
    assert _close(problem.evaluate(dp.assignment), best.cost)


def test_brute_force_splits_the_experts_where_the_model_says_it_pays():
    tables = build_tables(_layer(512), MACHINES["slow-link"], cutoff=1, orders="all")
    best = solve_bruteforce(tables.to_problem())
    g = tables.graph
    for name in ("L1/moe/expert_in", "L1/moe/expert_down"):
        lay = tables.layouts[g.index[name]][best.assignment[g.index[name]]]
        assert lay.split[lay.dims.index("e")] == 2, (name, lay.describe())
    small = build_tables(_layer(4), MACHINES["slow-link"], cutoff=1, orders="all")
    opt = solve_bruteforce(small.to_problem())
    for name in ("L1/moe/expert_in", "L1/moe/expert_down"):
        lay = small.layouts[g.index[name]][opt.assignment[g.index[name]]]
        assert lay.split[lay.dims.index("e")] == 1, (name, lay.describe())


@pytest.mark.parametrize("d_expert", [4, 512])
def test_dp_equals_the_references_on_two_nodes(d_expert):
    m = Machine(8, 1e12, 1e10, latency=1e-6, node_size=4, inter_bandwidth=1e9, inter_latency=1e-5)
    tables = build_tables(_layer(d_expert), m, cutoff=1)
    problem = tables.to_problem()
    ref = solve_bfs_dp(problem).cost
    assert _close(solve_dp(problem).cost, ref)
    assert _close(solve_ilp(problem).cost, ref)


def test_dp_equals_the_ilp_on_a_whole_block():
    g = get_model("moe", 4, layers=1, experts=4, d_model=16, d_expert=64, seq=8, heads=2, kv_heads=2)
    problem = build_tables(g, Machine(4, 1e12, 1e10, latency=1e-6), cutoff=1).to_problem()
    assert _close(solve_dp(problem).cost, solve_ilp(problem).cost)
