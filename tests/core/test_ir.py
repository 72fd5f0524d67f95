"""IR validation, operator constructors, configurations, and cost properties."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardplan import ops
from shardplan.configs import configurations, split_choices
from shardplan.cost import build_tables, operator_cost
from shardplan.errors import ShardplanError
from shardplan.ir import Graph, GraphBuilder, Operator, Tensor, TensorRef
from shardplan.machine import Machine, preset


def ref(shape, name="x", grad=True):
    return TensorRef(name, shape, needs_grad=grad)


# --------------------------------------------------------------------------- validation
def test_zero_extent_rejected():
    with pytest.raises(ShardplanError, match="extent"):
        ops.dense("fc", ref((0, 4)), 8)


def test_unknown_dimension_named():
    with pytest.raises(ShardplanError, match=r"unknown dimension 'z'"):
        Operator("bad", "custom", (("a", 4),), (Tensor("x", (4,), ("z",), "input"),),
                 Tensor("y", (4,), ("a",), "output"))


def test_axis_extent_must_match_dimension():
    with pytest.raises(ShardplanError, match=r"operator 'bad'.*extent 5"):
        Operator("bad", "custom", (("a", 4),), (Tensor("x", (5,), ("a",), "input"),),
                 Tensor("y", (4,), ("a",), "output"))


def test_shape_mismatch_on_edge():
    a = ops.elementwise("a", ref((4, 8)))
    bad = Operator("b", "custom", (("i", 4), ("j", 9)),
                   (Tensor("x", (4, 9), ("i", "j"), "input", src="a"),), Tensor("y", (4, 9), ("i", "j"), "output"))
    with pytest.raises(ShardplanError, match=r"shape mismatch on edge 'a' -> 'b'"):
        Graph("g", (a, bad), {"x": (4, 8)})


def test_cycle_rejected_with_path():
    def el(name, src):
        return Operator(name, "custom", (("i", 4),), (Tensor("x", (4,), ("i",), "input", src=src),),
                        Tensor("y", (4,), ("i",), "output"))

    with pytest.raises(ShardplanError, match=r"cycle: .*a.*b"):
        Graph("g", (el("a", "b"), el("b", "a")))


def test_unknown_producer_and_duplicate_names():
    op = Operator("a", "custom", (("i", 4),), (Tensor("x", (4,), ("i",), "input", src="nowhere"),),
                  Tensor("y", (4,), ("i",), "output"))
    with pytest.raises(ShardplanError, match="unknown 'nowhere'"):
        Graph("g", (op,))
    b = GraphBuilder("g")
    x = b.input("x", (4, 4))
    b.add(ops.elementwise("e", x))
    with pytest.raises(ShardplanError, match="two operators are named 'e'"):
        b.add(ops.elementwise("e", x))


def test_einsum_errors_are_clear():
    with pytest.raises(ShardplanError, match="extent"):
        ops.einsum("e", "ab,bc->ac", ref((2, 3)), ref((4, 5)))
    with pytest.raises(ShardplanError, match="'->'"):
        ops.einsum("e", "ab,bc", ref((2, 3)), ref((3, 5)))


def test_broadcast_mismatch():
    with pytest.raises(ShardplanError, match="do not broadcast"):
        ops.elementwise("e", ref((4, 3)), ref((4, 5)))


# --------------------------------------------------------------------------- constructors
def test_einsum_batched_dims_and_weights():
    op = ops.einsum("att", "bhsk,bhtk->bhst", ref((2, 4, 16, 8), "q"), ref((2, 4, 16, 8), "k"))
    assert op.dim_names == ("b", "h", "s", "t", "k")
    assert op.reduction_dims == ("k",)
    op = ops.einsum("proj", "bsd,dhk->bshk", ref((2, 16, 32)), ops.Param((32, 4, 8)))
    assert op.weights[0].shape == (32, 4, 8)
    assert op.grad_reduction_dims(op.weights[0]) == ("b", "s")


def test_conv_shapes_and_label():
    op = ops.conv2d("c1", ref((128, 3, 224, 224)), 64, 11, stride=4, padding=2)
    assert op.output.shape == (128, 64, 55, 55)
    assert op.label == "bchwnrs"
    assert op.reduction_dims == ("c", "r", "s")


def test_reshape_refinement_and_fixed_dims():
    op = ops.reshape("r", ref((2, 16, 32)), (2, 16, 4, 8))
    assert [e for _, e in op.dims] == [2, 16, 4, 8]
    assert op.fixed == frozenset({"i3"})  # the trailing sub-axis of the merged input axis
    op = ops.reshape("r2", ref((2, 12)), (6, 4))
    assert [e for _, e in op.dims] == [2, 3, 4]
    op = ops.reshape("r3", ref((6, 4)), (4, 6))  # no integer refinement: read whole
    assert op.points == 1
    with pytest.raises(ShardplanError, match="cannot reshape"):
        ops.reshape("r4", ref((6, 4)), (5, 5))


def test_split_concat_round_trip_shapes():
    pieces = ops.split("sp", ref((4, 10)), 1, [3, 7])
    assert [p.output.shape for p in pieces] == [(4, 3), (4, 7)]
    cat = ops.concat("cat", [p.out for p in pieces], 1)
    assert cat.output.shape == (4, 10)


def test_embedding_vocab_is_reduction():
    op = ops.embedding("emb", ref((64, 256), grad=False), 1000, 512)
    assert op.label == "bsdv"
    assert op.reduction_dims == ("v",)
    assert op.grad_tensors == (op.weights[0],)


def test_reduce_mean_and_layer_norm():
    op = ops.reduce_mean("m", ref((8, 4, 5)), axes=(1, 2))
    assert op.output.shape == (8,)
    assert len(op.reduction_dims) == 2
    ln = ops.layer_norm("ln", ref((8, 16, 32)))
    assert ln.norm_dims == ("d",)


# --------------------------------------------------------------------------- configurations
def test_split_choices_respect_cutoff_and_divisibility():
    assert split_choices(128, 64, 4) == [1, 2, 4, 8, 16, 32]
    assert split_choices(55, 64, 4) == [1, 5, 11]
    assert split_choices(3, 64, 4) == [1]
    assert split_choices(3, 64, 1) == [1, 3]
    assert split_choices(48, 64, 1, powers_of_two=True) == [1, 2, 4, 8, 16]


def test_configurations_product_bound_and_order():
    op = ops.dense("fc", ref((128, 512)), 256)
    c = configurations(op, 8)
    assert (c.prod(axis=1) <= 8).all()
    assert [tuple(r) for r in c] == sorted(tuple(r) for r in c)
    assert tuple(c[0]) == (1, 1, 1)
    # brute-force count: all triples of powers of two with product <= 8
    want = sum(1 for a in (1, 2, 4, 8) for b in (1, 2, 4, 8) for k in (1, 2, 4, 8) if a * b * k <= 8)
    assert len(c) == want
    d = configurations(op, 8, divides_p=True)
    assert (8 % d.prod(axis=1) == 0).all()


def test_fixed_dims_never_split():
    op = ops.flatten("f", ref((8, 16, 4, 4)))
    c = configurations(op, 8, cutoff=1)
    assert (c[:, 2:] == 1).all()


def test_machine_validation_and_presets():
    with pytest.raises(ShardplanError, match="num_devices must be at least 1, got 0"):
        Machine(0)
    with pytest.raises(ShardplanError, match="inter_bandwidth"):
        Machine(16, node_size=8)
    with pytest.raises(ShardplanError, match="unknown machine preset 'tpu'"):
        preset("tpu", 8)
    m = preset("h100", 16)
    assert m.hierarchical and m.dtype_bytes == 2
    assert preset("paper", 8).balance == pytest.approx(10e12 / 16e9)


# --------------------------------------------------------------------------- properties
dims = st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 32, 64])


@settings(max_examples=40, deadline=None)
@given(b=dims, n=dims, c=dims, p=st.sampled_from([1, 2, 4, 8, 16]))
def test_gemm_costs_finite_nonnegative_and_work_conserved(b, n, c, p):
    op = ops.dense("fc", ref((b, c)), n)
    cfg = configurations(op, p, cutoff=1)
    m = Machine(p)
    cost = operator_cost(op, cfg, m)
    for arr in (cost.compute, cost.forward_allreduce, cost.grad_allreduce, cost.halo, cost.stats, cost.total):
        assert np.all(np.isfinite(arr)) and np.all(arr >= 0)
    total_work = cost.compute * cfg.prod(axis=1)
    assert np.allclose(total_work, total_work[0], rtol=1e-12)


@settings(max_examples=25, deadline=None)
@given(b=st.sampled_from([4, 8, 16]), c=st.sampled_from([3, 8]), hw=st.sampled_from([8, 12, 16]),
       k=st.sampled_from([1, 3, 5]), stride=st.sampled_from([1, 2]), p=st.sampled_from([2, 4, 8]))
def test_conv_chain_costs_finite_nonnegative(b, c, hw, k, stride, p):
    g = GraphBuilder("cnn")
    x = g.input("x", (b, c, hw, hw))
    h = g.add(ops.conv2d("c1", x, 8, k, stride=stride, padding=k // 2))
    h = g.add(ops.pool2d("p1", h, 2))
    h = g.add(ops.conv2d("c2", h, 8, 3, padding=1))
    t = build_tables(g.build(), Machine(p), cutoff=1)
    for oc, cfg in zip(t.op_costs, t.configs):
        assert np.all(np.isfinite(oc.total)) and np.all(oc.total >= 0)
        work = oc.compute * cfg.prod(axis=1)
        assert np.allclose(work, work[0])
    for m in t.edge_costs:
        assert np.all(np.isfinite(m)) and np.all(m >= 0)


def test_edge_cost_zero_on_the_diagonal_of_identical_operators():
    b = GraphBuilder("g")
    x = b.input("x", (16, 32), needs_grad=True)
    h = b.add(ops.dense("fc1", x, 32))
    b.add(ops.elementwise("relu", h, letters="bn"))
    t = build_tables(b.build(), Machine(8), cutoff=1)
    # configs of fc1 are (b, n, c); relu's are (b, n). A relu config equal to fc1's (b, n) with c = 1 moves nothing.
    cu, cv = t.configs
    ou, ov = ([lay.flat_order() for lay in ls] for ls in t.layouts)
    m = t.edge_costs[0]
    for i, (row, o) in enumerate(zip(cu, ou)):
        if row[2] != 1:
            continue
        o_bn = [d for d in o if d != 2]
        j = [k for k, (r, o2) in enumerate(zip(cv, ov)) if tuple(r) == (row[0], row[1]) and list(o2) == o_bn]
        assert len(j) == 1 and m[i, j[0]] == 0.0
    assert math.isfinite(float(m.max()))
