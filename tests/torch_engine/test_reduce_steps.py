"""The run's partial-sum reductions, one process: :func:`shardplan.torch.run.reduce_steps` (one redistribution
per reduced dimension) and :func:`shardplan.torch.run.flat_groups` (the mesh axes flattened per dimension), and
the PyTorch path's machine (:func:`shardplan.torch.device.dtensor_machine`). What the 4-process run sends with
them: ``test_dtensor_reductions.py``."""

from __future__ import annotations

import dataclasses

import pytest

from torch.distributed.tensor import Partial, Replicate, Shard

from shardplan.errors import ShardplanError
from shardplan.machine import Machine, preset
from shardplan.torch.device import dtensor_machine
from shardplan.torch.run import flat_groups, reduce_steps

P, R = Partial(), Replicate()


def test_one_reduced_dimension_is_one_redistribution():
    assert reduce_steps((P, P), (R, R), ("k", "k")) == [(R, R)]  # a dim over both axes: one step
    assert reduce_steps((P, Shard(0)), (R, Shard(0)), ("k", "b")) == [(R, Shard(0))]
    assert reduce_steps((Shard(0), R), (R, R), ("b", None)) == [(R, R)]  # nothing partial: one step


def test_several_reduced_dimensions_are_reduced_one_at_a_time_in_mesh_order():
    assert reduce_steps((P, P), (R, R), ("b", "s")) == [(R, P), (R, R)]
    # a dim over two axes, then another; a kept shard and a replica axis untouched until the last step
    src, dst = (R, P, P, Shard(1), P), (R, R, R, Shard(1), Shard(0))
    assert reduce_steps(src, dst, (None, "b", "b", "n", "s")) == [(R, R, R, Shard(1), P), dst]
    # an axis that stays partial (a deferred reduction) is no step of its own
    assert reduce_steps((P, P, P), (R, P, R), ("b", "k", "s")) == [(R, P, P), (R, P, R)]


def test_flat_groups_are_the_axes_of_each_dimension_split_over_several():
    rows = [("k", "k", None), (None, "b", "b"), ("b", "s", None), ("k", "k", "n"), ("n", "n", "n")]
    assert flat_groups(rows) == [(0, 1), (1, 2), (0, 1, 2)]
    assert flat_groups([("b",), (None,)]) == []


def test_the_torch_path_charges_what_dtensor_sends():
    m = dtensor_machine(dataclasses.replace(preset("h100", 8), reduce_per_dim=False))
    assert (m.stepwise_redistribution, m.reduce_per_dim, m.scatter_gathered_grads) == (False, True, True)
    assert preset("h100", 8).scatter_gathered_grads is False and preset("paper", 8).scatter_gathered_grads is False
    with pytest.raises(ShardplanError, match="scatter_gathered_grads"):
        Machine(4, scatter_gathered_grads=1)


def _encoder(causal: bool):
    """k and v projections (elementwise over b t k, the keys' sequence split 4 ways) into a fused attention."""
    from shardplan import ops
    from shardplan.ir import GraphBuilder

    g = GraphBuilder("enc")
    xq = g.input("xq", (2, 16, 8), needs_grad=True)
    xk = g.input("xk", (2, 16, 8), needs_grad=True)
    q = g.add(ops.elementwise("q", xq, letters="bsk"))
    k = g.add(ops.elementwise("k", xk, letters="btk"))
    v = g.add(ops.elementwise("v", xk, letters="btk"))
    g.add(ops.flash_attention("attn", q, k, v, "bsk", "btk", causal=causal, dealt=True))
    return g.build()


def test_summed_dims_are_the_split_dims_an_operand_does_not_read():
    from shardplan.torch.run import summed_dims

    graph = _encoder(False)
    attn = graph["attn"]
    q, k = attn.inputs[0], attn.inputs[1]
    assert summed_dims(k, ("s", "b")) == ("s",)  # the keys' gradient sums over the split queries
    assert summed_dims(q, ("s", "b", None)) == ()  # the queries read both
    assert summed_dims(k, ("s", "s", None)) == ("s",)  # one dim over two axes: one
    mm = _matmul()
    assert summed_dims(mm.inputs[1], ("b", "s", "n")) == ("b", "s")  # (k, n) sums over batch and sequence


def _matmul():
    from shardplan import ops
    from shardplan.ir import GraphBuilder

    g = GraphBuilder("mm")
    x = g.input("x", (8, 4, 16), needs_grad=False)
    h = g.input("h", (16, 12), needs_grad=True)
    g.add(ops.einsum("mm", "bsk,kn->bsn", x, h))
    return g.build()["mm"]


@pytest.mark.parametrize("causal", [False, True])
def test_the_scatter_rule_covers_the_unmasked_attention_on_dtensors_machine_only(causal):
    import numpy as np

    from shardplan.cost import build_tables
    from shardplan.cost.collectives import allreduce_time, reduce_scatter_time
    from shardplan.cost.operator import operator_cost
    from shardplan.cost.ring import gathered_applies, gathered_home, gathered_reduction, scatters_undealt
    from shardplan.layout import Layout, LayoutArrays

    graph = _encoder(causal)
    attn, k = graph["attn"], graph["k"]
    xla = Machine(4, peak_flops=32e12, bandwidth=16e9, latency=0.0, name="fast")
    torch_ = dtensor_machine(xla)
    assert scatters_undealt(attn, torch_) and not scatters_undealt(attn, xla)
    assert gathered_applies(attn, torch_) and gathered_applies(attn, xla) is causal  # XLA: the dealt causal only
    la = Layout.flat(attn.dim_names, tuple(4 if d == "s" else 1 for d in attn.dim_names), 4)
    lv = LayoutArrays.stack([la])
    lu = LayoutArrays.stack([Layout.flat(k.dim_names, tuple(4 if d == "t" else 1 for d in k.dim_names), 4)])
    compute = operator_cost(attn, lv, torch_).compute
    assert bool(gathered_home(attn, lv, torch_, compute)[0])
    assert bool(gathered_home(attn, lv, xla, compute)[0]) is False  # fast devices: XLA's runner deals neither
    nbytes = 2 * 16 * 8 * 4.0  # the gathered keys' gradient tile, float32
    rs = float(reduce_scatter_time(nbytes, np.array([[4]]), torch_)[0])
    assert float(gathered_reduction(k, lu, attn, 1, lv, torch_, compute)[0, 0]) == pytest.approx(rs, rel=1e-12)
    assert rs * 16e9 == pytest.approx(0.75 * nbytes, rel=1e-12)  # bytes: one reduce-scatter among 4
    # the tables: on the torch machine the attention's row carries no all-reduce of the keys' and values'
    # gradients (their edges carry the reduce-scatters); on XLA's it keeps both
    ar = float(allreduce_time(nbytes, np.array([[4]]), xla)[0])
    i = [op.name for op in graph.operators].index("attn")
    grad = {}
    for name, m in (("torch", torch_), ("xla", xla)):
        t = build_tables(graph, m, cutoff=4)
        (row,) = [j for j, lay in enumerate(t.layouts[i]) if lay == la]
        grad[name] = float(t.op_costs[i].grad_allreduce[row])
    assert grad["xla"] - grad["torch"] == pytest.approx(2 * ar, rel=1e-9)
