"""The paper's five models on 64 devices: the faster table build and search give the same bits.

The edge matrices of the build (block-pattern sides and matches shared across edges, the one-level cost
taken per pair of distinct block lengths) are compared bit for bit with each edge costed alone from its
volumes, the computation before those shortcuts; the search's answer (assignment, cost, the bound
pruning's survivors, rounds and bounds) is pinned to the values computed on commit d5ea085, before the
search's shortcuts (the restricted incumbent solved over its vertices with a choice among others); and
the DP's cheap step for a vertex no factor touches is compared with the general step on every search.
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np
import pytest

from shardplan.cost import build_tables
from shardplan.cost.edge import EdgeMemo, _pattern_fast, _pattern_side, edge_cost, edge_volumes
from shardplan.machine import preset
from shardplan.models import MODELS
from shardplan.search import dp
from shardplan.search.dp import solve_dp

# model -> (sha256 of the assignment as int64 bytes, plan cost, configurations before and after the bound
# pruning, its rounds, its upper and lower bound): commit d5ea085
PINNED = {
    "alexnet": ("b48d024ccf8b6e7f4319a89beb9ebceb234f69620bec04c30c7d43fc5c474b12", 0.0017559258536,
                1801, 16, 2, 0.0017559258535999997, 0.0017559258536000001),
    "inception_v3": ("401f23cad2b81b480b700b2e6efe06a9810107fd57ff5c17812db9aa5f9f1512", 0.020934374925599995,
                     15389, 361, 3, 0.0209343749256, 0.0209343749256),
    "resnet101": ("d7f2ff1a40f51c40cc9d939389de1740e292dcc5fba9439a1763b1486bca5e68", 0.025257799317599975,
                  39573, 4021, 3, 0.025273799317599984, 0.02507347059380698),
    "rnnlm": ("a52453f0df4d42539ee7754fdeff9e190580bd108228831b2a6c1a5343bce665", 0.056226619596800004,
              2862, 4, 2, 0.05622661959680001, 0.05622661959680001),
    "transformer": ("91ccc1206f3e4c95ced5747bed9f194b295e1abcd3ea353eee1a089420e9322e", 0.03181385044480003,
                    58403, 196, 2, 0.03181385044480004, 0.03181385044480002),
}


@functools.lru_cache(maxsize=None)
def _tables(name: str):
    spec = MODELS[name]
    return build_tables(spec.build(), preset("paper", 64), cutoff=spec.cutoff)


@pytest.mark.parametrize("name", sorted(PINNED))
def test_edges_equal_each_edge_costed_alone(name):
    t = _tables(name)
    ops, machine = t.graph.operators, t.machine
    assert not machine.stepwise_redistribution and len(machine.levels) == 1  # the one-level shortcut applies
    for e, got in zip(t.graph.edges, t.edge_costs):
        u, v = ops[e.src], ops[e.dst]
        lu, lv = t.arrays[e.src], t.arrays[e.dst]
        vols = edge_volumes(u, lu, v, e.slot, lv, machine.num_devices)  # no memo: every side built anew
        want = edge_cost(u, lu, v, e.slot, lv, machine, volumes=vols)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes(), f"{u.name} -> {v.name}"


@pytest.mark.parametrize("name", ["inception_v3", "resnet101"])
def test_shared_pattern_sides_give_the_same_volumes(name):
    # one memo across every edge, as the build keeps it, against sides built per edge
    t = _tables(name)
    ops = t.graph.operators
    memo = EdgeMemo()
    n_pattern = 0
    for e in t.graph.edges:
        u, v = ops[e.src], ops[e.dst]
        lu, lv = t.arrays[e.src], t.arrays[e.dst]
        shared = (_pattern_side(u, u.output, lu, memo), _pattern_side(v, v.inputs[e.slot], lv, memo))
        alone = (_pattern_side(u, u.output, lu), _pattern_side(v, v.inputs[e.slot], lv))
        assert (shared[0] is None) == (alone[0] is None) and (shared[1] is None) == (alone[1] is None)
        if shared[0] is None or shared[1] is None:
            continue
        n_pattern += 1
        for a, b in zip(_pattern_fast(*shared, 1, memo), _pattern_fast(*alone, 1)):
            assert np.array_equal(a, b) and a.dtype == b.dtype
    assert n_pattern > 50
    assert memo.pattern_matches and memo.pattern_sides


@pytest.mark.parametrize("name", sorted(PINNED))
def test_search_answer_pinned(name):
    digest, cost, before, after, rounds, ub, lb = PINNED[name]
    sol = solve_dp(_tables(name).to_problem())
    b = sol.stats["bounds"]
    assert sol.optimal
    assert hashlib.sha256(np.asarray(sol.assignment, dtype=np.int64).tobytes()).hexdigest() == digest
    assert sol.cost == pytest.approx(cost, rel=1e-12, abs=0)
    assert (b["configs_before"], b["configs_after"], b["rounds"]) == (before, after, rounds)
    assert b["upper_bound"] == pytest.approx(ub, rel=1e-12, abs=0)
    assert b["lower_bound"] == pytest.approx(lb, rel=1e-12, abs=0)


@pytest.mark.parametrize("name", ["inception_v3", "resnet101"])
def test_factor_free_step_is_the_general_step(name, monkeypatch):
    problem = _tables(name).to_problem()
    fast = solve_dp(problem)

    def general(v, factors, unary, limit, label, stats, rng, kept=0):
        return dp._eliminate(v, factors, unary, limit, label, stats, rng, kept=kept)

    monkeypatch.setattr(dp, "_eliminate_alone", general)
    slow = solve_dp(problem)
    assert fast.assignment == slow.assignment and fast.cost == slow.cost
    drop = ("seconds", "history")
    for key in ("total_table_entries", "largest_table", "max_dependent_set", "kept_bytes", "memo", "dp_value",
                "memory_estimate_bytes", "pruning"):
        assert fast.stats[key] == slow.stats[key], key
    assert {k: v for k, v in fast.stats["bounds"].items() if k not in drop} == \
        {k: v for k, v in slow.stats["bounds"].items() if k not in drop}
