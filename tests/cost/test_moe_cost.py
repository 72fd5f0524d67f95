"""Expert parallelism in the cost model: the token-split -> expert-split redistribution is the all-to-all.

The dispatched tokens T[b, e, c, d] leave ``dispatch`` split over the batch (each device its sequences, all
experts) and enter the experts split over ``e`` (each device its experts, all sequences). In a group of g
devices a device keeps 1/g of its tile and sends the other (g-1)/g: the all-to-all's volume, n (g-1)/g for a
tile of n bytes. The machine's formula for it (shardplan/cost/collectives.py, ``p2p_time``: an exchange of n
bytes per device costs n / B + α on a level's links, links of different levels at the same time) is what the
tables must charge, once forward (the tokens) and once backward (their gradient).
"""

from __future__ import annotations

import pytest

from shardplan.cost import build_tables
from shardplan.cost.collectives import p2p_time
from shardplan.layout import Layout
from shardplan.machine import Machine
from shardplan.models import get_model
from shardplan.spmd import plan_from_configs

B0, B1, A0, A1 = 100e9, 10e9, 3e-6, 20e-6  # bytes/s and seconds inside a node and per device across nodes


def _split(op, levels, per_level):
    """A layout of ``op`` splitting, on level l, the dims of ``per_level[l]`` (dim -> ways, most significant
    first)."""
    names = op.dim_names
    splits = tuple(tuple(per_level[lv].get(d, 1) for d in names) for lv in range(len(levels)))
    orders = tuple(tuple(names.index(d) for d in per_level[lv]) for lv in range(len(levels)))
    return Layout(names, levels, splits, orders)


def _ep_plan(g, machine, levels, tokens, experts):
    """Every operator of the routed layer: ``tokens`` (the batch split) except the experts (``experts``)."""
    tables = build_tables(g, machine, cutoff=1, orders="all")
    lays = {}
    for op in g:
        want = _split(op, levels, experts if op.kind == "expert" else tokens)
        assert want in tables.layouts[g.index[op.name]], op.name  # the plan is in the search's space
        lays[op.name] = want
    return tables, plan_from_configs(tables, lays, name="expert-parallel")


def _edge(plan, u, v):
    g, t = plan.graph, plan.tables
    (k,) = [k for k, e in enumerate(g.edges) if g.operators[e.src].name == u and g.operators[e.dst].name == v]
    e = g.edges[k]
    return float(t.edge_costs[k][plan.assignment[e.src], plan.assignment[e.dst]])


def _moe_layer_only(batch, experts):
    """The routed layer of one block of the tiny model, alone (its input a graph input)."""
    full = get_model("moe", batch, layers=1, experts=experts)
    names = [op.name for op in full if op.name.startswith("L1/moe/")]
    return full.derive([full[n] for n in names])


def test_one_level_all_to_all_has_the_exact_volume():
    m = Machine(8, 1e12, B0, latency=A0, dtype_bytes=2)
    g = _moe_layer_only(8, 8)
    _, plan = _ep_plan(g, m, (8,), [{"b": 8}], [{"e": 8}])
    b, e, c, d = g["L1/moe/dispatch"].output.shape
    assert (b, e, c, d) == (8, 8, 10, 64)
    tile = b * e * c * d // 8                    # elements of T a device holds: 5120
    sent = tile * 7 // 8 * 2                     # bytes it sends in the all-to-all: 4480 elements of 2 bytes
    assert sent == 8960
    one_way = float(p2p_time(sent, m))
    assert one_way == pytest.approx(sent / B0 + A0, rel=1e-15)
    # forward tokens and backward gradients, on the way in and, mirrored, on the way out
    assert _edge(plan, "L1/moe/dispatch", "L1/moe/expert_in") == pytest.approx(2 * one_way, rel=1e-12)
    assert _edge(plan, "L1/moe/expert_down", "L1/moe/combine") == pytest.approx(2 * one_way, rel=1e-12)
    # nothing else moves between the layer's operators: the router, gate, dispatch, combine share the batch
    # split, and the experts' activation and down projection their input's expert split
    assert plan.breakdown["redistribution"] == pytest.approx(4 * one_way, rel=1e-12)


def test_two_level_all_to_all_crosses_the_nodes_for_what_the_node_lacks():
    m = Machine(16, 1e12, B0, latency=A0, dtype_bytes=2, node_size=8, inter_bandwidth=B1, inter_latency=A1)
    g = _moe_layer_only(16, 16)
    levels = (8, 2)
    # tokens: the batch 8 ways in the node and 2 across; experts: 8 ways in the node and 2 across
    _, plan = _ep_plan(g, m, levels, [{"b": 8}, {"b": 2}], [{"e": 8}, {"e": 2}])
    b, e, c, d = g["L1/moe/dispatch"].output.shape
    assert (b, e, c, d) == (16, 16, 5, 64)
    tile = b * e * c * d // 16                   # 5120 elements per device
    # a device keeps 1/16 of its tile; of what it needs (its experts over all 16 sequences) its node holds the
    # 8 sequences of its own node: the other half comes over the network
    inside = tile * 15 // 16 * 2                 # bytes received in all (over the node's links at most)
    across = tile // 2 * 2                       # bytes that must cross nodes
    one_way = max(float(p2p_time(inside, m, 0)), float(p2p_time(across, m, 1)))
    assert one_way == pytest.approx(max(inside / B0 + A0, across / B1 + A1), rel=1e-15)
    assert one_way == pytest.approx(across / B1 + A1, rel=1e-15)  # the network is the bottleneck here
    assert _edge(plan, "L1/moe/dispatch", "L1/moe/expert_in") == pytest.approx(2 * one_way, rel=1e-12)
    assert _edge(plan, "L1/moe/expert_down", "L1/moe/combine") == pytest.approx(2 * one_way, rel=1e-12)
    # the experts inside the node only (the nodes split the batch): the all-to-all never leaves the node
    _, intra = _ep_plan(g, m, levels, [{"b": 8}, {"b": 2}], [{"e": 8}, {"b": 2}])
    assert _edge(intra, "L1/moe/dispatch", "L1/moe/expert_in") == pytest.approx(
        2 * float(p2p_time(tile * 7 // 8 * 2, m, 0)), rel=1e-12)


def test_expert_split_weights_need_no_gradient_reduction():
    m = Machine(8, 1e12, B0, latency=A0, dtype_bytes=2)
    g = _moe_layer_only(8, 8)
    _, ep = _ep_plan(g, m, (8,), [{"b": 8}], [{"e": 8}])
    _, dp = _ep_plan(g, m, (8,), [{"b": 8}], [{"b": 8}])
    ops = {row["name"]: row["parts"] for row in ep.operators()}
    dops = {row["name"]: row["parts"] for row in dp.operators()}
    for name in ("L1/moe/expert_in", "L1/moe/expert_down"):
        # expert parallel: each device holds its experts' weights whole; their gradients are its own
        assert ops[name]["grad_allreduce"] == 0.0 and ops[name]["forward_allreduce"] == 0.0, name
        # data parallel: every device holds every expert and all-reduces every expert's gradient
        assert dops[name]["grad_allreduce"] > 0.0, name
    assert dp.breakdown["redistribution"] == 0.0  # and no all-to-all
    assert ep.breakdown["redistribution"] > 0.0
