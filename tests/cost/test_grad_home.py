"""Activation gradients home by reduce-scatter on DTensor's machine (shardplan.cost.grad_home).

An activation's gradient summed over split dims is an all-reduce on the operator; with
``Machine.scatter_gathered_grads`` (shardplan.torch's machine) the tables charge it on the input's edge: a
reduce-scatter where the producer's tiles scatter the consumer's tile over the summing group (DTensor's
``Partial -> Shard``), the same all-reduce elsewhere. Expected numbers are written from the collective formulas
of shardplan.cost.collectives; the tables on the XLA machines (flag off) are the same as without the rule.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from shardplan import ops
from shardplan.cost import build_tables
from shardplan.cost.collectives import allreduce_time, reduce_scatter_time
from shardplan.cost.grad_home import (home_bytes, home_pairs, home_reduction, home_scatters, home_steps, scatter_steps,
                                      step_charges, unfed_slots)
from shardplan.cost.operator import operator_cost
from shardplan.cost.ring import ring_operator_cost
from shardplan.ir import GraphBuilder
from shardplan.layout import Layout, LayoutArrays
from shardplan.machine import Machine

from randgraphs import exact_solvers_agree

XLA = Machine(4, peak_flops=1e12, bandwidth=1e9, latency=1e-6, dtype_bytes=4, name="toy")
TORCH = replace(XLA, scatter_gathered_grads=True)
TORCH_STEPS = replace(TORCH, reduce_per_dim=True)  # as shardplan.torch.device.dtensor_machine sets it
B, C, N = 64, 32, 16


def _graph(x_grad: bool = False):
    """x -> tanh (elementwise, dims b c) -> dense (dims b n c): the dense's gradient of the tanh's output sums
    over n."""
    g = GraphBuilder("home")
    x = g.input("x", (B, C), needs_grad=x_grad)
    h = g.add(ops.elementwise("act", x, kind="tanh"))
    g.add(ops.dense("fc", h, N))
    return g.build()


def _flat(op, split, p=4):
    return Layout.flat(op.dim_names, split, p)


def _tables(graph, machine, **kw):
    act, fc = graph.operators
    cands = {"act": [_flat(act, (1, 1)), _flat(act, (4, 1)), _flat(act, (1, 4)), _flat(act, (2, 2))],
             "fc": [_flat(fc, (1, 1, 1)), _flat(fc, (1, 4, 1)), _flat(fc, (4, 1, 1))]}
    return build_tables(graph, machine, candidates=lambda op: cands[op.name], **kw)


def test_the_producer_scattering_the_tile_gets_its_gradient_by_reduce_scatter():
    graph = _graph()
    on, off = _tables(graph, TORCH), _tables(graph, XLA)
    n = B * C * 4.0  # the dense's whole input tile, float32, on each of the 4 devices that split n
    ar = float(allreduce_time(n, [[4]], TORCH)[0])
    rs = float(reduce_scatter_time(n, [[4]], TORCH)[0])
    # the dense at (1,4,1): features out split 4 ways, the input's gradient a partial sum over them
    assert off.op_costs[1].grad_allreduce[1] == pytest.approx(ar, rel=1e-12)
    assert on.op_costs[1].grad_allreduce[1] == pytest.approx(0.0, abs=1e-15)
    assert on.op_costs[1].grad_allreduce[[0, 2]].tolist() == off.op_costs[1].grad_allreduce[[0, 2]].tolist()
    assert on.op_costs[0].total.tolist() == off.op_costs[0].total.tolist()
    diff = on.edge_costs[0] - off.edge_costs[0]
    # producer replicated: the all-reduce, now on the edge; producer split 4 ways along b or c (or 2 x 2):
    # each device's block of the tile is 1/4 and distinct, so the reduce-scatter, and nothing moves back
    assert diff[:, 1] == pytest.approx([ar, rs, rs, rs], rel=1e-12)
    assert (diff[:, [0, 2]] == 0).all()
    assert rs < ar


def test_the_rule_is_off_on_the_xla_machines():
    graph = _graph()
    act, fc = graph.operators
    lv = LayoutArrays.stack([_flat(fc, (1, 4, 1))])
    assert not home_pairs(fc, lv, XLA).any()
    assert home_pairs(fc, lv, TORCH).tolist() == [[True]]
    lu = LayoutArrays.stack([_flat(act, (4, 1))])
    assert (home_reduction(act, lu, fc, 0, lv, XLA, home_pairs(fc, lv, XLA)) == 0).all()


def test_a_graph_input_keeps_its_reduction_on_the_operator():
    g = GraphBuilder("unfed")
    x = g.input("x", (B, C), needs_grad=True)
    g.add(ops.dense("fc", x, N))
    graph = g.build()
    assert unfed_slots(graph) == [frozenset({0})]
    on, off = (build_tables(graph, m, candidates=lambda op: [_flat(op, (1, 4, 1))]) for m in (TORCH, XLA))
    assert on.op_costs[0].grad_allreduce.tolist() == off.op_costs[0].grad_allreduce.tolist()
    assert on.op_costs[0].grad_allreduce[0] > 0


def test_a_partial_layout_is_left_to_the_deferred_reduction():
    graph = _graph()
    _, fc = graph.operators
    lv = LayoutArrays.stack([_flat(fc, (1, 4, 1)), _flat(fc, (1, 4, 1)).with_partial()])
    assert home_pairs(fc, lv, TORCH)[:, 0].tolist() == [True, False]


def test_two_summed_dims_are_reduce_scattered_one_at_a_time_outer_level_first():
    m = Machine(4, peak_flops=1e12, bandwidth=4e9, latency=1e-6, node_size=2, inter_bandwidth=1e9,
                inter_latency=5e-6, dtype_bytes=4, scatter_gathered_grads=True)
    g = GraphBuilder("two")
    p = g.input("p", (C, N), needs_grad=False)
    h = g.add(ops.elementwise("act", p, kind="tanh"))
    x = g.input("x", (8, 4, C))
    g.add(ops.einsum("mm", "asc,cn->asn", x, h))
    graph = g.build()
    _, mm = graph.operators
    dims = mm.dim_names
    inner = tuple(2 if d == "s" else 1 for d in dims)  # s inside the node
    outer = tuple(2 if d == "a" else 1 for d in dims)  # a over the nodes
    lv = LayoutArrays.stack([Layout(dims, (2, 2), (inner, outer), ((dims.index("s"),), (dims.index("a"),)))])
    n = C * N * 4.0
    got = float(scatter_steps(mm, 1, lv, np.asarray([n]), m)[0])
    # the run's order: a's mesh axis (the nodes) first, on the whole tile, then s on the half it left
    want = float(reduce_scatter_time(n, [[1], [2]], m)[0] + reduce_scatter_time(n / 2, [[2], [1]], m)[0])
    assert got == pytest.approx(want, rel=1e-12)
    other = float(reduce_scatter_time(n, [[2], [1]], m)[0] + reduce_scatter_time(n / 2, [[1], [2]], m)[0])
    assert got != pytest.approx(other, rel=1e-6)  # the order matters across levels


def test_the_fit_search_charges_the_operator_as_the_tables_do():
    graph = _graph()
    tables = _tables(graph, TORCH)
    for i, op in enumerate(graph.operators):
        got = ring_operator_cost(op, tables.arrays[i], TORCH, "allgather", unfed=unfed_slots(graph)[i])
        assert got.grad_allreduce.tolist() == pytest.approx(tables.op_costs[i].grad_allreduce.tolist(), abs=1e-15)


def test_the_exact_solvers_agree_with_the_rule_and_take_the_reduce_scatter_where_it_pays():
    graph = _graph()
    tables = _tables(graph, TORCH)
    dp = exact_solvers_agree(tables.to_problem())
    act, fc = graph.operators
    lu = tables.arrays[0].take([dp.assignment[0]])
    lv = tables.arrays[1].take([dp.assignment[1]])
    if home_pairs(fc, lv, TORCH)[0, 0]:  # where the search splits the features out, the producer scatters
        assert home_scatters(act, lu, fc, 0, lv, TORCH)[0, 0]


def test_the_fit_searchs_micro_batch_costs_leave_the_moved_all_reduce_to_the_edge():
    from shardplan.cost.memory import latency_scaled
    from shardplan.fit import _scaled

    graph = _graph()
    tables = _tables(graph, TORCH)
    _, fc = graph.operators
    got = _scaled(fc, tables.arrays[1], tables, 4)
    plain = operator_cost(fc, tables.arrays[1], latency_scaled(TORCH, 4))
    assert got is not None and plain.grad_allreduce[1] > 0
    assert got.grad_allreduce[1] == pytest.approx(0.0, abs=1e-15)  # on the edge, as the tables charge it
    assert got.grad_allreduce[[0, 2]].tolist() == plain.grad_allreduce[[0, 2]].tolist()
    assert _scaled(fc, tables.arrays[1], _tables(graph, XLA), 4) is None  # XLA's machine: as before


def test_the_attentions_gathered_keys_stay_with_the_ring_rule():
    from shardplan.cost.ring import gathered_home, ring_charged, ring_mask

    g = GraphBuilder("attn")
    x = g.input("x", (2, 16, 2, 8))
    q, k, v = (g.add(ops.elementwise(n, x, kind="tanh")) for n in ("q", "k", "v"))
    g.add(ops.flash_attention("attn", q, k, v, "bshk", "bthk"))
    graph = g.build()
    att = graph.operators[-1]
    lay = LayoutArrays.stack([_flat(att, tuple(4 if d == "s" else 1 for d in att.dim_names))])
    compute = operator_cost(att, lay, TORCH).compute
    mask, _ = ring_mask(att, lay)
    assert mask[0].tolist() == [False, True, True] and gathered_home(att, lay, TORCH, compute)[0]
    handled = ring_charged(att, lay, TORCH, "allgather", compute)
    assert handled[0].tolist() == [False, True, True]
    # the keys and values: the ring's rule (cost.ring.gathered_reduction); the queries' gradient sums over no
    # split dim (the key sequence is whole): nothing for this rule either
    assert not home_pairs(att, lay, TORCH, handled=handled).any()
    assert home_pairs(att, lay, TORCH)[0].tolist() == [False, True, True]  # what it would take without the ring's
    assert ring_charged(att, lay, TORCH, "ring", compute)[0].tolist() == [False, True, True]


def _product_graph():
    """p (C, N) -> tanh (dims b s: C, N) -> einsum asc,cn->asn (dims a s n c): the product's gradient of the
    tanh's output sums over a and s (its grad_reduction_dims, in that order: bit 0 a, bit 1 s)."""
    g = GraphBuilder("partial")
    p = g.input("p", (C, N), needs_grad=False)
    h = g.add(ops.elementwise("act", p, kind="tanh"))
    x = g.input("x", (8, 4, C))
    g.add(ops.einsum("mm", "asc,cn->asn", x, h))
    return g.build()


def _act_flat(act, c_rows, n_cols):
    return Layout.flat(act.dim_names, (c_rows, n_cols), 4)


def test_a_producer_splitting_along_one_summed_dims_group_only_gets_the_runs_steps():
    graph = _product_graph()
    act, mm = graph.operators
    assert mm.grad_reduction_dims(mm.inputs[1]) == ("a", "s")
    # a 2 ways (devices q // 2), s 2 ways (q % 2); the tanh split 2 ways after its replicas (q % 2): its tile
    # is the same along a's group and different along s's
    lv = LayoutArrays.stack([_flat(mm, tuple(2 if d in "as" else 1 for d in mm.dim_names))])
    lu = LayoutArrays.stack([_act_flat(act, 1, 1), _act_flat(act, 1, 2), _act_flat(act, 2, 1), _act_flat(act, 1, 4),
                             _act_flat(act, 2, 2)])
    assert home_steps(act, lu, mm, 1, lv, TORCH_STEPS)[:, 0].tolist() == [0, 2, 2, 3, 3]
    assert home_scatters(act, lu, mm, 1, lv, TORCH_STEPS)[:, 0].tolist() == [False, False, False, True, True]
    pairs = home_pairs(mm, lv, TORCH_STEPS)
    n = C * N * 4.0
    got = home_reduction(act, lu, mm, 1, lv, TORCH_STEPS, pairs)[:, 0]
    ar = 2 * float(allreduce_time(n, [[2]], TORCH_STEPS)[0])  # one per summed dim, the whole tile each
    # the run's order (a, the outer mesh axis, first): an all-reduce among a's 2 of the whole tile (the tanh is
    # replicated there), then a reduce-scatter among s's 2 of it into the tanh's halves
    mixed = float(allreduce_time(n, [[2]], TORCH_STEPS)[0] + reduce_scatter_time(n, [[2]], TORCH_STEPS)[0])
    rs = float(reduce_scatter_time(n, [[2]], TORCH_STEPS)[0] + reduce_scatter_time(n / 2, [[2]], TORCH_STEPS)[0])
    assert got == pytest.approx([ar, mixed, mixed, rs, rs], rel=1e-12)
    assert ar > mixed > rs
    # bytes: 2 (g-1)/g n per all-reduce, (g-1)/g n per reduce-scatter
    assert home_bytes(act, lu, mm, 1, lv, TORCH_STEPS, pairs)[:, 0].tolist() == [2 * n, 1.5 * n, 1.5 * n, 0.75 * n,
                                                                                 0.75 * n]


def test_a_producer_split_along_the_outer_summed_dim_is_reduce_scattered_first():
    m = Machine(4, peak_flops=1e12, bandwidth=4e9, latency=1e-6, node_size=2, inter_bandwidth=1e9,
                inter_latency=5e-6, dtype_bytes=4, scatter_gathered_grads=True, reduce_per_dim=True)
    graph = _product_graph()
    act, mm = graph.operators
    dims = mm.dim_names
    inner = tuple(2 if d == "s" else 1 for d in dims)  # s inside the node
    outer = tuple(2 if d == "a" else 1 for d in dims)  # a over the nodes
    lv = LayoutArrays.stack([Layout(dims, (2, 2), (inner, outer), ((dims.index("s"),), (dims.index("a"),)))])
    # the tanh split 2 ways along its second dim (N) over the nodes, replicated inside them; and inside them,
    # replicated over the nodes
    over = Layout(act.dim_names, (2, 2), ((1, 1), (1, 2)), ((), (1,)))
    inside = Layout(act.dim_names, (2, 2), ((1, 2), (1, 1)), ((1,), ()))
    lu = LayoutArrays.stack([over, inside])
    assert home_steps(act, lu, mm, 1, lv, m)[:, 0].tolist() == [1, 2]
    pairs = home_pairs(mm, lv, m)
    got = home_reduction(act, lu, mm, 1, lv, m, pairs)[:, 0]
    n = C * N * 4.0
    nodes, node = [[1], [2]], [[2], [1]]
    # over the nodes: reduce-scatter among the nodes first (a is the outer mesh axis), then the all-reduce of
    # the half inside the node; inside: the all-reduce of the whole tile over the nodes, then the reduce-scatter
    first = float(reduce_scatter_time(n, nodes, m)[0] + allreduce_time(n / 2, node, m)[0])
    second = float(allreduce_time(n, nodes, m)[0] + reduce_scatter_time(n, node, m)[0])
    assert got.tolist() == pytest.approx([first, second], rel=1e-12)
    assert home_bytes(act, lu, mm, 1, lv, m, pairs)[:, 0].tolist() == [n, 1.5 * n]
    secs, sent = step_charges(mm, 1, lv, np.asarray([n]), np.asarray([1]), m)
    assert (float(secs[0]), float(sent[0])) == (pytest.approx(first, rel=1e-12), n)


def test_a_producer_split_any_other_way_keeps_the_all_reduce():
    graph = _product_graph()
    act, mm = graph.operators
    lv = LayoutArrays.stack([_flat(mm, tuple(4 if d == "a" else 1 for d in mm.dim_names))])
    # a 4 ways: the tanh split 2 ways is the same on pairs of a's devices and different between pairs
    lu = LayoutArrays.stack([_act_flat(act, 1, 2), _act_flat(act, 1, 4), _act_flat(act, 1, 1)])
    assert home_steps(act, lu, mm, 1, lv, TORCH_STEPS)[:, 0].tolist() == [-1, 1, 0]
    pairs = home_pairs(mm, lv, TORCH_STEPS)
    n = C * N * 4.0
    ar = float(allreduce_time(n, [[4]], TORCH_STEPS)[0])
    assert home_reduction(act, lu, mm, 1, lv, TORCH_STEPS, pairs)[[0, 2], 0].tolist() == [ar, ar]  # upper bound
    assert home_bytes(act, lu, mm, 1, lv, TORCH_STEPS, pairs)[:, 0].tolist() == [1.5 * n, 0.75 * n, 1.5 * n]


def _product_tables(machine):
    graph = _product_graph()
    act, mm = graph.operators
    cands = {"act": [_act_flat(act, 1, 1), _act_flat(act, 1, 2), _act_flat(act, 2, 1), _act_flat(act, 1, 4),
                     _act_flat(act, 2, 2), _act_flat(act, 4, 1)],
             "mm": [_flat(mm, tuple(2 if d in "as" else 1 for d in mm.dim_names)),
                    _flat(mm, tuple(4 if d == "a" else 1 for d in mm.dim_names)),
                    _flat(mm, tuple(2 if d in "an" else 1 for d in mm.dim_names)),
                    _flat(mm, tuple(4 if d == "n" else 1 for d in mm.dim_names)),
                    _flat(mm, (1, 1, 1, 1))]}
    return graph, build_tables(graph, machine, candidates=lambda op: cands[op.name])


def test_the_operators_bytes_follow_its_seconds_to_the_edge():
    from shardplan.cost import plan_home_bytes

    graph, on = _product_tables(TORCH_STEPS)
    _, off = _product_tables(replace(TORCH_STEPS, scatter_gathered_grads=False))
    act, mm = graph.operators
    n = C * N * 4.0
    # the product at (a 2, s 2), (a 4), (a 2, n 2): the tanh's gradient's all-reduces (2 n bytes, 1.5 n, and
    # n / 2 of its half tile) off the operator; nothing where it sums over no split dim
    assert (off.op_costs[1].comm_bytes - on.op_costs[1].comm_bytes).tolist() == [2 * n, 1.5 * n, 0.5 * n, 0.0, 0.0]
    assert on.op_costs[0].comm_bytes.tolist() == off.op_costs[0].comm_bytes.tolist()
    for a in range(len(on.arrays[0])):
        for b in range(len(on.arrays[1])):
            lu, lv = on.arrays[0].take([a]), on.arrays[1].take([b])
            pairs = home_pairs(mm, lv, TORCH_STEPS)
            edge = float(home_bytes(act, lu, mm, 1, lv, TORCH_STEPS, pairs)[0, 0])
            assert plan_home_bytes(on, [a, b]) == edge and plan_home_bytes(off, [a, b]) == 0.0
            moved = float(off.op_costs[1].comm_bytes[b] - on.op_costs[1].comm_bytes[b])
            if not home_steps(act, lu, mm, 1, lv, TORCH_STEPS)[0, 0] > 0:  # nothing split along the summed dims
                assert edge == moved, (a, b)  # the same all-reduces, reported where they are timed
            else:
                assert edge < moved, (a, b)


def test_the_exact_solvers_agree_with_the_partial_scatters():
    for machine in (TORCH_STEPS, replace(TORCH_STEPS, latency=1e-5)):
        graph, tables = _product_tables(machine)
        exact_solvers_agree(tables.to_problem())
        act, mm = graph.operators
        lu, lv = tables.arrays[0], tables.arrays[1]
        steps = home_steps(act, lu, mm, 1, lv, machine)
        assert ((steps > 0) & ~home_scatters(act, lu, mm, 1, lv, machine)).any()  # partial scatters are offered
