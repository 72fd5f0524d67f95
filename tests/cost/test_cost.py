"""Hand-computed checks of the derived cost model.

Every expected number below is worked out by hand from the operator's
shape, the configuration and the alpha-beta formulas (alpha = 0):
all-reduce of n bytes among g devices = 2 (g-1)/g * n / B.
"""

from __future__ import annotations

import numpy as np
import pytest

from shardplan import ops
from shardplan.cost import build_tables, edge_cost, edge_volumes, operator_cost
from shardplan.cost.memory import operator_memory
from shardplan.ir import GraphBuilder, TensorRef
from shardplan.machine import Machine

B = 1e9  # bytes/s
F = 1e12  # FLOP/s


def machine(p: int, **kw) -> Machine:
    return Machine(p, peak_flops=F, bandwidth=B, **kw)


def x_ref(shape, name="x", grad=True) -> TensorRef:
    return TensorRef(name, shape, needs_grad=grad)


def cost_of(op, config, m):
    return operator_cost(op, np.asarray([config]), m)


# --------------------------------------------------------------------------- GEMM
GEMM = ops.dense("fc", x_ref((128, 512)), 256)  # dims b, n, c; y[b,n] = x[b,c] W[c,n]


def test_gemm_dims_and_reductions():
    assert GEMM.dim_names == ("b", "n", "c")
    assert GEMM.reduction_dims == ("c",)
    x, w = GEMM.inputs[0], GEMM.weights[0]
    assert GEMM.grad_reduction_dims(x) == ("n",)
    assert GEMM.grad_reduction_dims(w) == ("b",)


def test_gemm_split_k_allreduces_output():
    c = cost_of(GEMM, (1, 1, 2), machine(8))
    out_bytes = 128 * 256 * 4
    assert c.forward_allreduce[0] == pytest.approx(2 * 1 / 2 * out_bytes / B)
    assert c.grad_allreduce[0] == 0.0
    assert c.comm_bytes[0] == pytest.approx(out_bytes)  # 2 (g-1)/g n with g = 2


def test_gemm_split_n_allreduces_input_gradient():
    c = cost_of(GEMM, (1, 4, 1), machine(8))
    x_bytes = 128 * 512 * 4
    assert c.forward_allreduce[0] == 0.0
    assert c.grad_allreduce[0] == pytest.approx(2 * 3 / 4 * x_bytes / B)


def test_gemm_split_batch_allreduces_weight_gradient():
    c = cost_of(GEMM, (8, 1, 1), machine(8))
    w_bytes = 512 * 256 * 4
    assert c.forward_allreduce[0] == 0.0
    assert c.grad_allreduce[0] == pytest.approx(2 * 7 / 8 * w_bytes / B)


def test_gemm_compute_forward_and_two_backward_products():
    c = cost_of(GEMM, (2, 2, 2), machine(8))
    assert c.compute[0] == pytest.approx(3 * 2 * 128 * 256 * 512 / 8 / F)


def test_gemm_first_layer_without_input_gradient():
    op = ops.dense("fc", x_ref((128, 512), grad=False), 256)
    c = cost_of(op, (1, 4, 1), machine(8))
    assert c.grad_allreduce[0] == 0.0  # nobody needs dx
    assert c.compute[0] == pytest.approx(2 * 2 * 128 * 256 * 512 / 4 / F)


def test_gemm_mixed_split_groups():
    # b=2, c=4: forward all-reduce of the [64, 256] output tile among 4; weight gradient tile [128, 256] among 2.
    c = cost_of(GEMM, (2, 1, 4), machine(8))
    assert c.forward_allreduce[0] == pytest.approx(2 * 3 / 4 * 64 * 256 * 4 / B)
    assert c.grad_allreduce[0] == pytest.approx(2 * 1 / 2 * 128 * 256 * 4 / B)


def test_latency_term():
    m = machine(8, latency=1e-6)
    c = cost_of(GEMM, (8, 1, 1), m)
    assert c.grad_allreduce[0] == pytest.approx(2 * 7 / 8 * 512 * 256 * 4 / B + 2 * 7 * 1e-6)


# --------------------------------------------------------------------------- convolution
CONV = ops.conv2d("conv", x_ref((8, 16, 32, 32)), 16, 3, stride=1, padding=1)


def test_data_parallel_conv_is_gradient_allreduce_only():
    c = cost_of(CONV, (4, 1, 1, 1, 1, 1, 1), machine(4))
    w_bytes = 16 * 16 * 3 * 3 * 4
    assert c.forward_allreduce[0] == 0.0
    assert c.halo[0] == 0.0
    assert c.stats[0] == 0.0
    assert c.grad_allreduce[0] == pytest.approx(2 * 3 / 4 * w_bytes / B)
    assert c.total[0] == pytest.approx(c.compute[0] + c.grad_allreduce[0])


def test_halo_of_split_3x3_convolution():
    # h split 4 ways: 8 output rows per device; an interior device reads rows 8i-1 .. 8i+8 (10 rows), owns 8.
    c = cost_of(CONV, (1, 1, 4, 1, 1, 1, 1), machine(4))
    halo_elems = 2 * 32 * 16 * 8  # 2 rows x width x channels x batch
    assert c.halo[0] == pytest.approx(2 * halo_elems * 4 / B)  # forward + gradient back
    # h is in every tensor but the weight: weight gradient all-reduced among 4
    assert c.grad_allreduce[0] == pytest.approx(2 * 3 / 4 * 16 * 16 * 9 * 4 / B)


def test_strided_conv_halo():
    op = ops.conv2d("c", x_ref((2, 3, 16, 16)), 4, 3, stride=2, padding=1)  # out 8x8
    # h split 2: block [0,4) reads rows -1..7 -> [0,8) after clipping, owns [0,8); block [4,8) reads 7..15, owns 8..16
    c = cost_of(op, (1, 1, 2, 1, 1, 1, 1), machine(2))
    assert c.halo[0] == pytest.approx(2 * (1 * 16 * 3 * 2) * 4 / B)


def test_pooling_without_padding_has_halo_when_windows_overlap():
    op = ops.pool2d("pool", x_ref((4, 8, 18, 18)), 3, 2)  # 3x3 windows, stride 2, no padding: out 8x8
    # h split 2: block [0,4) reads input rows 0..8 = [0,9) and owns [0,9); block [4,8) reads rows 8..16 = [8,17)
    # and owns [9,18): row 8 comes from its neighbour, 17 columns of it (windows read columns 0..16), 8 channels,
    # batch 4; forward, and its gradient back
    c = cost_of(op, (1, 1, 2, 1, 1, 1), machine(2))
    assert c.halo[0] == pytest.approx(2 * (1 * 17 * 8 * 4) * 4 / B)
    assert c.total[0] == pytest.approx(c.compute[0] + c.halo[0])
    # the batch split reads only its own rows: no halo
    c = cost_of(op, (2, 1, 1, 1, 1, 1), machine(2))
    assert c.halo[0] == 0.0 and c.total[0] == pytest.approx(c.compute[0])


# --------------------------------------------------------------------------- normalisation
def test_softmax_split_normalised_axis_allreduces_statistics():
    op = ops.softmax("sm", x_ref((64, 1000)))
    c = cost_of(op, (1, 4), machine(4))
    # 2 statistics per row, 64 rows, forward and backward
    assert c.stats[0] == pytest.approx(2 * (2 * 3 / 4 * 64 * 2 * 4 / B))
    c2 = cost_of(op, (4, 1), machine(4))
    assert c2.stats[0] == 0.0 and c2.grad_allreduce[0] == 0.0


def test_batch_norm_data_parallel_reduces_statistics_and_gamma():
    op = ops.batch_norm("bn", x_ref((32, 16, 8, 8)))
    c = cost_of(op, (4, 1, 1, 1), machine(4))
    assert c.stats[0] == pytest.approx(2 * (2 * 3 / 4 * 16 * 2 * 4 / B))
    assert c.grad_allreduce[0] == pytest.approx(2 * (2 * 3 / 4 * 16 * 4 / B))  # gamma and beta


# --------------------------------------------------------------------------- edges
def _chain(*builders):
    b = GraphBuilder("g")
    x = b.input("x", (64, 32), needs_grad=True)
    out = x
    for f in builders:
        out = b.add(f(out))
    return b.build()


def test_edge_identical_layouts_cost_nothing():
    g = _chain(lambda x: ops.elementwise("a", x), lambda x: ops.elementwise("b", x))
    m = machine(4)
    t = build_tables(g, m, cutoff=1)
    cu, cv = t.configs
    ou, ov = ([lay.flat_order() for lay in ls] for ls in t.layouts)
    cost = t.edge_costs[0]
    same = 0
    for i, (row, o1) in enumerate(zip(cu, ou)):
        for j, (col, o2) in enumerate(zip(cv, ov)):
            if tuple(row) == tuple(col) and tuple(o1) == tuple(o2):
                assert cost[i, j] == 0.0
                same += 1
    assert same == len(cu)


def test_grid_order_decides_which_device_gets_which_tile():
    # fc1 (1,4,8) leaves y[b, n] split 4 ways on n, n-block = q // 8 (n outer, c inner).
    # fc2 (1,8,4) reads x[b, c] split 4 ways on c: with c nested outside n (order c, n)
    # the c-block is q // 8 as well, so nothing moves; in row-major order (n outside c) it is q % 4.
    fc1 = ops.dense("fc1", x_ref((128, 4096)), 4096)
    fc2 = ops.dense("fc2", fc1.out, 4096)
    cu, ou = np.array([[1, 4, 8]]), np.array([[0, 1, 2]])
    cv = np.array([[1, 8, 4], [1, 8, 4]])
    ov = np.array([[0, 1, 2], [0, 2, 1]])
    f, b = edge_volumes(fc1, cu, fc2, 0, cv, 32, ou, ov)
    assert f[0, 1] == 0 and b[0, 1] == 0
    assert f[0, 0] == 128 * 1024  # device 1 needs c-block 1 (q % 4) and holds n-block 0 (q // 8): all of it moves


def test_edge_transpose_of_a_split():
    # producer holds x[64, 32] split 4 ways on axis 0; the consumer wants it split 4 ways on axis 1.
    a = ops.elementwise("a", x_ref((64, 32)))
    t = ops.transpose("t", a.out, (1, 0))  # dims = input axes (b, s)
    m = machine(4)
    f, b = edge_volumes(a, np.array([[4, 1]]), t, 0, np.array([[1, 4]]), 4)
    # need a [64, 8] tile, hold [16, 32]: the overlap is [16, 8]
    assert f[0, 0] == 64 * 8 - 16 * 8
    assert b[0, 0] == 16 * 32 - 16 * 8
    sec = edge_cost(a, np.array([[4, 1]]), t, 0, np.array([[1, 4]]), m)
    assert sec[0, 0] == pytest.approx(((64 * 8 - 16 * 8) + (16 * 32 - 16 * 8)) * 4 / B)
    # same split on the same axis: nothing moves
    f, b = edge_volumes(a, np.array([[4, 1]]), t, 0, np.array([[4, 1]]), 4)
    assert f[0, 0] == 0 and b[0, 0] == 0


def test_edge_from_replicated_to_split_and_back():
    a = ops.elementwise("a", x_ref((64, 32)))
    c = ops.elementwise("c", a.out)
    f, b = edge_volumes(a, np.array([[1, 1]]), c, 0, np.array([[4, 1]]), 4)
    # the unsplit layout is replicated on every device: each already holds the [16, 32] tile it needs
    assert f[0, 0] == 0
    # backward: every replica needs the whole gradient and has a quarter of it
    assert b[0, 0] == 64 * 32 - 16 * 32


def test_partial_replication_and_idle_devices():
    a = ops.elementwise("a", x_ref((64, 32)))
    c = ops.elementwise("c", a.out)
    # p = 6: a split 4 ways fits once (devices 4, 5 idle); c split 2 ways is replicated 3 times.
    f, b = edge_volumes(a, np.array([[4, 1]]), c, 0, np.array([[2, 1]]), 6)
    # device 4 (c's coordinate 0, needs rows 0..31) holds nothing under a
    assert f[0, 0] == 32 * 32
    # backward: a's device 1 needs gradient rows 16..31; c's device 1 (coordinate 1) holds rows 32..63
    assert b[0, 0] == 16 * 32


def test_edge_into_an_input_without_gradient_moves_nothing_backward():
    ids = ops.elementwise("ids", x_ref((64,)))  # stands for an operator producing integer labels
    loss = ops.softmax_cross_entropy("loss", x_ref((64, 10), "logits"), TensorRef("ids", (64,), needs_grad=False))
    f, b = edge_volumes(ids, np.array([[1]]), loss, 1, np.array([[4, 1]]), 4)
    assert f[0, 0] == 0  # replicated labels: every device already holds its rows
    f, b = edge_volumes(ids, np.array([[4]]), loss, 1, np.array([[1, 1]]), 4)
    assert f[0, 0] == 64 - 16 and b[0, 0] == 0  # forward gathers the labels; no gradient flows back


def test_reshape_edge_follows_leading_sub_axis():
    conv = ops.conv2d("conv", x_ref((8, 16, 4, 4)), 16, 3, padding=1)
    flat = ops.flatten("flat", conv.out)  # dims i0 (b), i1 (c), i2 (h), i3 (w); h, w fixed
    assert flat.fixed == frozenset({"i2", "i3"})
    cu = np.array([[1, 1, 1, 1, 4, 1, 1]])  # out-channels split 4 ways
    same = np.array([[1, 4, 1, 1]])  # flatten split on c: the leading sub-axis of the merged axis
    other = np.array([[4, 1, 1, 1]])  # flatten split on batch
    f, b = edge_volumes(conv, cu, flat, 0, same, 4)
    assert f[0, 0] == 0 and b[0, 0] == 0
    f, b = edge_volumes(conv, cu, flat, 0, other, 4)
    # need [2, 16, 4, 4], hold [8, 4, 4, 4]: overlap [2, 4, 4, 4]
    assert f[0, 0] == 2 * 16 * 16 - 2 * 4 * 16
    # and the merged output axis of flatten is split like its leading sub-axis
    fc = ops.dense("fc", flat.out, 10)  # dims b, n, c ; c = 256 merged (16 x 4 x 4)
    f, b = edge_volumes(flat, same, fc, 0, np.array([[1, 1, 4]]), 4)
    assert f[0, 0] == 0 and b[0, 0] == 0


def test_concat_edges_take_the_right_slice():
    a = ops.elementwise("a", x_ref((8, 16)))
    b_ = ops.elementwise("b", x_ref((8, 48)))
    cat = ops.concat("cat", [a.out, b_.out], axis=1)  # (8, 64)
    # concat split 4 ways on axis 1: blocks of 16 columns; block 0 is exactly a, blocks 1..3 are b.
    cv = np.array([[1, 4]])
    f, _ = edge_volumes(a, np.array([[1, 1]]), cat, 0, cv, 4)
    assert f[0, 0] == 0  # device 0 holds all of a and needs all of a; others need nothing of a
    f, _ = edge_volumes(b_, np.array([[1, 4]]), cat, 1, cv, 4)
    # b split 4 ways: blocks of 12 columns; device 1 needs b[:, 0:16], holds b[:, 12:24] -> 12 missing
    assert f[0, 0] == 8 * 16 - 8 * 4


# --------------------------------------------------------------------------- hierarchy and memory
def test_hierarchical_machine_uses_slow_link_across_nodes():
    m = Machine(16, peak_flops=F, bandwidth=100e9, node_size=8, inter_bandwidth=10e9)
    w_bytes = 512 * 256 * 4
    inside = cost_of(GEMM, (8, 1, 1), m).grad_allreduce[0]
    across = cost_of(GEMM, (16, 1, 1), m).grad_allreduce[0]
    assert inside == pytest.approx(2 * 7 / 8 * w_bytes / 100e9)
    # hierarchical (NCCL across nodes): reduce-scatter + all-gather inside each node (a ring all-reduce
    # among 8 on the whole buffer) and an all-reduce of the node's 1/8 share between the 2 nodes
    assert across == pytest.approx(2 * 7 / 8 * w_bytes / 100e9 + 2 * 1 / 2 * (w_bytes / 8) / 10e9)
    # b=2 (outer), c=8 (inner): the c groups are devices {0..7} and {8..15}: inside nodes;
    # the b groups {q, q+8} cross nodes. Output tile [64, 256]; weight tile [512/8, 256]; x tile not reduced.
    c = cost_of(GEMM, (2, 1, 8), m)
    assert c.forward_allreduce[0] == pytest.approx(2 * 7 / 8 * 64 * 256 * 4 / 100e9)
    assert c.grad_allreduce[0] == pytest.approx(2 * 1 / 2 * 64 * 256 * 4 / 10e9)


def test_halo_stays_inside_the_node_when_only_other_dims_span_nodes():
    from shardplan.layout import Layout, LayoutArrays

    m = Machine(4, peak_flops=F, bandwidth=100e9, node_size=2, inter_bandwidth=10e9)
    dims = CONV.dim_names  # b c h w n r s
    # h split 2 inside each node, b split 2 across the nodes: a device's halo row comes from its node partner
    # (same batch half, the other h half). 1 row x 32 columns x 16 channels x 4 images, forward and back.
    inside = LayoutArrays.stack([Layout(dims, (2, 2), ((1, 1, 2, 1, 1, 1, 1), (2, 1, 1, 1, 1, 1, 1)), ((2,), (0,)))])
    assert operator_cost(CONV, inside, m).halo[0] == pytest.approx(2 * (32 * 16 * 4) * 4 / 100e9)
    # h split across the nodes instead: the halo row comes from the other node
    across = LayoutArrays.stack([Layout(dims, (2, 2), ((2, 1, 1, 1, 1, 1, 1), (1, 1, 2, 1, 1, 1, 1)), ((0,), (2,)))])
    assert operator_cost(CONV, across, m).halo[0] == pytest.approx(2 * (32 * 16 * 4) * 4 / 10e9)


def test_memory_per_device():
    m = machine(4)
    w, act = operator_memory(GEMM, np.array([[1, 4, 1], [4, 1, 1]]), m, optimizer_factor=2.0)
    assert w[0].max() == pytest.approx(512 * 64 * 4 * 4)  # weight split on n; value, grad, 2 Adam words
    assert w[1].max() == pytest.approx(512 * 256 * 4 * 4)  # replicated
    assert act[1].max() == pytest.approx(32 * 256 * 4)


def test_lstm_recurrence_terms():
    op = ops.lstm("lstm", x_ref((64, 32, 128), grad=False), hidden=128, layers=2)
    m = machine(8)
    base = cost_of(op, (1, 1, 1, 1, 1), m)
    assert base.recurrence[0] == 0.0
    assert op.reduction_dims == ("d",)
    pipe = cost_of(op, (2, 1, 1, 1, 1), m)
    # wavefront of S + 1 steps instead of S, plus hidden states handed over forward and back
    work = 16 * op.points * 2 / F  # forward + weight gradient (no input gradient from a graph input)
    handoff = 2 * 1 / 2 * 64 * 32 * 128 * 4 / B
    assert pipe.recurrence[0] == pytest.approx(work / 2 * (33 / 32) - work / 2 + handoff)
    seq = cost_of(op, (1, 1, 2, 1, 1), m)
    assert seq.compute[0] + seq.recurrence[0] == pytest.approx(base.compute[0])  # time chunks do not help


@pytest.mark.parametrize("name,p,sizes", [
    ("alexnet", 6, {}), ("alexnet", 12, {"batch": 24}), ("inception_v3", 4, {"batch": 8}),
    ("transformer", 4, {"batch": 4, "layers": 1}), ("rnnlm", 8, {"batch": 8}),
])
def test_fast_edge_volumes_equal_general_intersection(name, p, sizes):
    """The block-match fast path and the box-intersection path agree on every edge and pair."""
    from shardplan.configs import configurations, dimension_orders
    from shardplan.models import model_spec

    spec = model_spec(name)
    g = spec.build(**sizes)
    cf = [dimension_orders(configurations(op, p, spec.cutoff), "all") for op in g.operators]
    for e in g.edges:
        u, v = g.operators[e.src], g.operators[e.dst]
        (cu, ou), (cv, ov) = cf[e.src], cf[e.dst]
        f1, b1 = edge_volumes(u, cu, v, e.slot, cv, p, ou, ov)
        f2, b2 = edge_volumes(u, cu, v, e.slot, cv, p, ou, ov, fast=False)
        assert np.array_equal(f1, f2) and np.array_equal(b1, b2), (u.name, v.name)


def test_configurations_that_cannot_fit_in_memory_are_dropped():
    from shardplan.errors import OperatorMemoryError

    b = GraphBuilder("big")
    x = b.input("x", (64, 8192), needs_grad=True)
    b.add(ops.dense("fc", x, 8192))  # 64M weights: 256 MiB fp32, x4 with gradient and Adam state = 1 GiB
    g = b.build()
    roomy = build_tables(g, Machine(8, peak_flops=F, bandwidth=B), cutoff=1)
    tight = build_tables(g, Machine(8, peak_flops=F, bandwidth=B, memory_bytes=300 * 2**20), cutoff=1)
    assert tight.options["dropped_for_memory"] > 0
    assert len(tight.configs[0]) < len(roomy.configs[0])
    # every survivor fits, and every configuration that fits survived
    w, act = tight.memory[0]
    assert ((w + act).max(axis=1) <= 300 * 2**20).all()
    w0, a0 = roomy.memory[0]
    assert int(((w0 + a0).max(axis=1) <= 300 * 2**20).sum()) == len(tight.configs[0])
    with pytest.raises(OperatorMemoryError, match=r"operator 'fc' needs at least .* per device"):
        build_tables(g, Machine(8, peak_flops=F, bandwidth=B, memory_bytes=2**20), cutoff=1)


def test_hierarchical_redistribution_stays_inside_a_node_when_the_sender_fits_in_one():
    m = Machine(16, peak_flops=F, bandwidth=100e9, node_size=8, inter_bandwidth=10e9)
    a = ops.elementwise("a", x_ref((64, 32)))
    c = ops.elementwise("c", a.out)
    # a split 8 ways on rows: replicated on both nodes; c split 16 ways on rows.
    f, b = edge_volumes(a, np.array([[8, 1]]), c, 0, np.array([[16, 1]]), 16)
    sec = edge_cost(a, np.array([[8, 1]]), c, 0, np.array([[16, 1]]), m)
    # forward: a node holds all of a, so what device q misses comes over NVLink; the gradient comes
    # from c's 16-device layout, spread over both nodes: inter-node.
    assert sec[0, 0] == pytest.approx(f[0, 0] * 4 / 100e9 + b[0, 0] * 4 / 10e9)
    assert f[0, 0] > 0 and b[0, 0] > 0


def _two_level_edge(a_splits, a_orders, c_splits, c_orders):
    """Seconds and volumes of a 4x4 elementwise edge a -> c on 2 nodes of 2 devices (100 B/s inside, 1 B/s across)."""
    from shardplan.layout import Layout, LayoutArrays

    m = Machine(4, peak_flops=F, bandwidth=100.0, node_size=2, inter_bandwidth=1.0)
    a = ops.elementwise("a", x_ref((4, 4)))
    c = ops.elementwise("c", a.out)
    la = LayoutArrays.stack([Layout(("i", "j"), (2, 2), a_splits, a_orders)])
    lc = LayoutArrays.stack([Layout(("i", "j"), (2, 2), c_splits, c_orders)])
    return edge_cost(a, la, c, 0, lc, m)[0, 0], edge_volumes(a, la, c, 0, lc, 4)


def test_redistribution_inside_nodes_uses_the_node_links_though_the_sender_spans_nodes():
    # a: rows split across the 2 nodes, columns split inside each node; c: rows across nodes, columns whole.
    # Device (position k in node n) holds a[2n:2n+2, 2k:2k+2] (4 elements) and needs c's c[2n:2n+2, :] (8):
    # it misses the other column half, which its node partner holds: 4 elements = 16 bytes over the node's
    # 100 B/s link. The gradient of a's tile lies inside c's tile: nothing moves back.
    sec, (f, b) = _two_level_edge(((1, 2), (2, 1)), ((1,), (0,)), ((1, 1), (2, 1)), ((), (0,)))
    assert (f[0, 0], b[0, 0]) == (4, 0)
    assert sec == pytest.approx(16 / 100)


def test_redistribution_that_crosses_nodes_pays_the_inter_node_link_for_what_crosses():
    # a: rows split inside the node, columns across nodes: device (k, n) holds a[2k:2k+2, 2n:2n+2];
    # the node n holds the column half 2n:2n+2. c as above: device (k, n) needs c[2n:2n+2, :].
    # Forward: a device with k != n misses all 8 elements (V_-1 = 8); of those, c[2n:2n+2, 2n:2n+2] is in its
    # node and c[2n:2n+2, other half] is not (V_0 = 4): max(8*4 B / 100 B/s, 4*4 B / 1 B/s) = 16 s.
    # Backward: c's device (k, n) holds the gradient of rows 2n:2n+2, all columns; a's device (k, n) needs
    # rows 2k:2k+2, columns 2n:2n+2: with k != n all 4 elements are missing (V_-1 = 4), and its node's c
    # tiles are rows 2n:2n+2 only (V_0 = 4): max(16 B / 100 B/s, 16 B / 1 B/s) = 16 s.
    sec, (f, b) = _two_level_edge(((2, 1), (1, 2)), ((0,), (1,)), ((1, 1), (2, 1)), ((), (0,)))
    assert (f[0, 0], b[0, 0]) == (8, 4)
    assert sec == pytest.approx(16.0 + 16.0)


# --------------------------------------------------------------------------- the breakdown's parts
def test_one_list_of_breakdown_parts():
    from dataclasses import fields

    from shardplan.cost import BREAKDOWN, PARTS, OpCost

    assert {f.name for f in fields(OpCost)} == {*PARTS, "comm_bytes", "pass_seconds"}
    c = cost_of(CONV, (1, 1, 4, 1, 1, 1, 1), machine(4))
    assert list(c.parts(0)) == list(PARTS)
    assert sum(c.parts(0).values()) == pytest.approx(c.total[0])
    assert list(BREAKDOWN) == [*PARTS, "redistribution"]


def test_a_slice_sends_back_only_the_gradient_of_what_it_read():
    """A consumer reading columns 32..63 of a (8, 96) tensor, both sides split over the batch: nothing moves;
    with the producer split over the columns 3 ways and the slice over the batch, the slice sends back
    only the gradient of its own columns that the producer's device lacks."""
    from shardplan.ir import TensorRef

    x = TensorRef("x", (8, 16), is_input=True)
    fc = ops.dense("fc", x, 96)  # dims b, n, c
    sl = ops.slice_axis("sl", TensorRef("fc", (8, 96), needs_grad=True), 1, 32, 32)
    f, b = edge_volumes(fc, np.array([[2, 1, 1]]), sl, 0, np.array([[2, 1]]), 2)
    assert (f[0, 0], b[0, 0]) == (0, 0)
    # producer: columns in 3 blocks of 32 on devices 0, 1, 2 (batch whole); the slice replicated
    f, b = edge_volumes(fc, np.array([[1, 3, 1]]), sl, 0, np.array([[1, 1]]), 3)
    # the slice is replicated on 3 devices, each reads all of columns 32..63: device 0 and 2 lack them
    assert f[0, 0] == 8 * 32
    # backward: device q's producer tile is columns [32q, 32q+32); the slice's gradient covers only 32..63,
    # which device 1 holds itself: devices 0 and 2 receive nothing for the columns outside the slice
    assert b[0, 0] == 0


@pytest.mark.parametrize("widths,levels", [
    ((16, 48), (4,)), ((3, 5, 24), (8,)), ((32, 64, 32, 128), (16,)), ((10, 6, 8), (12,)),
    ((64, 192, 128), (4, 4)), ((16, 16, 96), (2, 4)), ((40, 24), (2, 2, 2)),
])
def test_concat_pieces_fast_path_equals_general_intersection(widths, levels):
    """Concatenation pieces (offset axes) on the block-match fast path: every layout pair of every piece
    edge, partial replicas included, gives the box-intersection volumes; and the fast path does take the
    pairs where the concat splits the joined axis into blocks that line up with the piece."""
    from shardplan.configs import layouts
    from shardplan.cost.edge import _fast
    from shardplan.layout import LayoutArrays

    p = int(np.prod(levels))
    pieces = [ops.elementwise(f"a{i}", x_ref((8, w), name=f"x{i}")) for i, w in enumerate(widths)]
    cat = ops.concat("cat", [q.out for q in pieces], axis=1)
    lc = LayoutArrays.stack(layouts(cat, levels, cutoff=1, orders="all", partial_replicas=True))
    start, covered = 0, 0
    for i, q in enumerate(pieces):
        lq = LayoutArrays.stack(layouts(q, levels, cutoff=1, orders="all", partial_replicas=True))
        f1, b1 = edge_volumes(q, lq, cat, i, lc, p)
        f2, b2 = edge_volumes(q, lq, cat, i, lc, p, fast=False)
        assert np.array_equal(f1, f2) and np.array_equal(b1, b2), (widths, levels, i)
        # concat layouts whose blocks along the joined axis tile the piece (or hold it in one block)
        c = lc.splits[:, 1]
        blk = sum(widths) // c
        lined_up = (sum(widths) % c == 0) & (((start % blk == 0) & (widths[i] % blk == 0))
                                             | (start // blk == (start + widths[i] - 1) // blk))
        exact = _fast(q, lq, cat, cat.inputs[i], lc, p)[2]
        assert exact[:, lined_up & (c > 1)].any(axis=0).all()
        covered += int((lined_up & (c > 1)).sum())
        start += widths[i]
    assert covered
