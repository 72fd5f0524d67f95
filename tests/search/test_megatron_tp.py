"""Megatron-LM's tensor parallelism on a two-level machine: its layouts and one layer's communication by hand."""

from __future__ import annotations

import pytest

from shardplan.baselines import megatron
from shardplan.configs import layouts
from shardplan.cost import build_tables
from shardplan.layout import Layout
from shardplan.machine import Machine
from shardplan.models import get_model
from shardplan.pipeline.stages import weight_sync
from shardplan.spmd import plan_from_configs

B0, B1 = 100e9, 10e9  # bytes/s inside a node, per device across nodes
S, D, H = 16, 64, 8


def _machine() -> Machine:
    # 2 nodes of 8, no latency, no buckets, no HBM term: every collective is its bandwidth formula
    return Machine(16, 1e12, B0, dtype_bytes=2, node_size=8, inter_bandwidth=B1)


def _plan(node_replicas: bool = True):
    g = get_model("gpt", 2, layers=1, d_model=D, heads=H, seq=S, vocab=64)
    tables = build_tables(g, _machine(), cutoff=1, orders="row-major", node_replicas=node_replicas)
    return g, tables, plan_from_configs(tables, megatron(tables, 2), name="megatron")


def test_node_replicas_adds_layouts_replicated_inside_the_node():
    g = get_model("gpt", 2, layers=1, d_model=D, heads=H, seq=S, vocab=64)
    ln = next(op for op in g.operators if op.name == "L1/ln1")
    megatron_norm = Layout(ln.dim_names, (8, 2), ((1, 1, 1), (2, 1, 1)), ((), (0,)))
    without = layouts(ln, (8, 2), cutoff=1)
    with_ = layouts(ln, (8, 2), cutoff=1, node_replicas=True)
    assert megatron_norm not in without and megatron_norm in with_
    assert set(without) <= set(with_)
    # every added layout fills the node level only partly and every outer level completely
    for lay in set(with_) - set(without):
        assert lay.level_products[0] < 8 and lay.level_products[1:] == (2,)


def test_megatron_layouts_are_megatron_lm_s():
    g, tables, plan = _plan()
    lay = plan.layouts
    # column-parallel q/k/v and ffn1, row-parallel out and ffn2: the model dim on the device level
    for name, dim in (("L1/q", "h"), ("L1/k", "h"), ("L1/v", "h"), ("L1/out", "h"), ("L1/ffn1", "e"),
                      ("L1/ffn2", "e"), ("L1/scores", "h"), ("L1/context", "h"), ("fc", "v")):
        j = lay[name].dims.index(dim)
        assert lay[name].splits[0][j] == 8 and lay[name].splits[1][j] == 1, name
        assert lay[name].splits[1][lay[name].dims.index("b")] == 2, name
    # norms and adds: batch over the nodes, replicated over the tensor-parallel group
    for name in ("L1/ln1", "L1/add1", "L1/ln2", "L1/add2", "ln_f"):
        assert lay[name].splits == ((1, 1, 1), (2, 1, 1)), name
    # without the node-replicated layouts the rule falls back to configuration tuples
    _, _, old = _plan(node_replicas=False)
    assert old.breakdown["redistribution"] > 0


def test_one_layer_tensor_parallel_traffic_by_hand():
    """Per layer, batch 1 per replica: activations n = S D 2 bytes; a ring all-reduce over the 8 devices of a
    node moves 2 (7/8) n / B0. Megatron-LM: forward, one after the row-parallel ``out`` and one after ``ffn2``;
    backward, one on the input gradient of each column-parallel matmul: ``ffn1`` and the attention
    projections. Megatron-LM fuses Q, K and V into one matmul (one all-reduce); this graph has three
    projections, so 3 + 1 = 4. Nothing is redistributed between operators."""
    g, tables, plan = _plan()
    ar = 2 * 7 / 8 * (S * D * 2) / B0
    assert plan.breakdown["redistribution"] == 0.0
    fwd = bwd = 0.0
    for i, op in enumerate(g.operators):
        if not op.name.startswith("L1/"):
            continue
        parts = tables.op_costs[i].parts(plan.assignment[i])
        k = plan.assignment[i]
        sync = float(weight_sync(op, tables.arrays[i].take([k]), None, tables.machine)[0])
        fwd += parts["forward_allreduce"]
        bwd += parts["grad_allreduce"] - sync
        if op.name == "L1/q":
            # the weight gradient (D x D / 8 per device) all-reduced over the 2 nodes: 2 (1/2) w / B1
            assert sync == pytest.approx(D * D // 8 * 2 / B1)
    assert fwd == pytest.approx(2 * ar)
    assert bwd == pytest.approx(4 * ar)


def test_megatron_145b_shape_1536_devices_in_stages_of_192():
    """1,536 = 192 nodes of 8 is not a power of two: 8 stages of 24 whole nodes are valid sub-meshes, and on
    such a sub-mesh (levels 8 x 24) Megatron's layouts (batch over the 24 nodes) exist and move nothing."""
    from shardplan.pipeline.search import PipelineSpace, StageCost, search_pipeline, submesh_sizes

    sizes = submesh_sizes(1536, 8)
    assert {8, 96, 192, 768, 1536} <= set(sizes) and all(q % 8 == 0 for q in sizes if q >= 8)
    space = PipelineSpace(82, 1536, 8, micro_batches=(96,), uniform=True, sizes=(192,))
    plan = search_pipeline(space, lambda a, b, q, m: StageCost((b - a) / q, 2 * (b - a) / q, 0.0, 0.0),
                           lambda *a: 0.0, schedules=("1f1b",))
    assert plan.num_stages == 8 and [s.offset for s in plan.stages] == [192 * i for i in range(8)]
    sub = Machine(192, 1e12, B0, dtype_bytes=2, node_size=8, inter_bandwidth=B1)
    assert sub.levels == (8, 24)
    g = get_model("gpt", 24, layers=1, d_model=D, heads=H, seq=S, vocab=64)
    tables = build_tables(g, sub, cutoff=1, orders="row-major", node_replicas=True)
    plan = plan_from_configs(tables, megatron(tables, 24))
    assert all(isinstance(lay, Layout) for lay in megatron(tables, 24).values())
    assert plan.breakdown["redistribution"] == 0.0
