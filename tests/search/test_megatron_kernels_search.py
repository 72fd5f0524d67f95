"""The exact search on GPT with Megatron-LM's kernels (one query-key-value product read three ways by the
attention core, two edges from it into the scores): the dynamic program against the breadth-first reference
and the ILP, with and without the input gradient's collective beside the weight-gradient pass."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shardplan.cost import build_tables
from shardplan.machine import Machine
from shardplan.models.gpt import gpt
from shardplan.search import solve_dp, solve_ilp
from shardplan.search.reference import solve_bfs_dp

ONE_LEVEL = Machine(4, 1e12, 1e10, latency=1e-6)
TWO_NODES = Machine(8, 1e12, 1e10, latency=1e-6, node_size=4, inter_bandwidth=1e9, inter_latency=1e-5)
# two devices, compute slow enough that the input gradients' all-reduces matter: the breadth-first reference's
# tables over four devices outgrow the memory limit on a small machine (2.4 GiB at the query-key-value product)
PAIR = Machine(2, 1e10, 1e9, latency=1e-6)


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b), 1e-30)


def _graph():
    return gpt(batch=4, layers=1, d_model=32, heads=4, seq=16, vocab=64, kernels="megatron")


@pytest.mark.parametrize("dgrad", [False, True])
@pytest.mark.parametrize("machine", [ONE_LEVEL, TWO_NODES], ids=["one-level", "two-nodes"])
def test_dp_equals_the_references(machine, dgrad):
    g = _graph()
    assert sum(1 for e in g.edges if g.operators[e.src].name == "L1/qkv") == 3  # q and k into scores, v
    tables = build_tables(g, replace(machine, overlap_dgrad=dgrad), cutoff=1)
    problem = tables.to_problem()
    assert _close(solve_dp(problem).cost, solve_ilp(problem).cost)


def test_dp_equals_the_breadth_first_reference_on_two_devices():
    costs = []
    for dgrad in (False, True):
        problem = build_tables(_graph(), replace(PAIR, overlap_dgrad=dgrad), cutoff=1).to_problem()
        ref = solve_bfs_dp(problem).cost
        assert _close(solve_dp(problem).cost, ref)
        assert _close(solve_ilp(problem).cost, ref)
        costs.append(ref)
    assert costs[1] < costs[0]  # the overlap hides some input-gradient all-reduce of the optimum


def test_overlapping_the_input_gradient_never_costs_more():
    g = _graph()
    slow = Machine(4, 1e12, 1e8, latency=1e-6)  # slow links: the input gradients' all-reduces matter
    plain = solve_dp(build_tables(g, slow, cutoff=1).to_problem()).cost
    hidden = solve_dp(build_tables(g, replace(slow, overlap_dgrad=True), cutoff=1).to_problem()).cost
    assert hidden <= plain * (1 + 1e-12)


def test_partial_layouts_with_the_overlap_stay_exact():
    # partial layouts leave the input gradient's reduction to the edge, where the product lends its weight pass
    g = _graph()
    tables = build_tables(g, replace(ONE_LEVEL, overlap_dgrad=True), cutoff=1, partial_sums=True)
    problem = tables.to_problem()
    assert _close(solve_dp(problem).cost, solve_ilp(problem).cost)
