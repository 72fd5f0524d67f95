"""ZeRO-3's gathers in the choice table: the recomputed forward's own gather (``ChoiceRules.zero3_regather``)
and the ring's latency counted per step, against hand derivations."""

from __future__ import annotations

import numpy as np
import pytest

from shardplan import ops
from shardplan.cost.memory import ChoiceRules, choice_table
from shardplan.errors import ShardplanError
from shardplan.ir import TensorRef
from shardplan.machine import Machine

B = 1e9  # bytes/s
F = 1e12  # FLOP/s
W = 2048.0  # the dense operator's weight: 32 x 16 fp32


def dense_op():
    return ops.dense("fc", TensorRef("x", (64, 32), needs_grad=True), 16)


def row(table, stage, recompute):
    j = np.flatnonzero((table.stage == stage) & (table.recompute == recompute))
    assert len(j) == 1
    return int(j[0])


def sync(machine, rules=ChoiceRules(), micro_batches=1):
    t = choice_table(dense_op(), np.array([[4, 1, 1]]), np.array([[0, 1, 2]]), machine,
                     micro_batches=micro_batches, prune=False, rules=rules)
    return {(s, r): float(t.parts["weight_sync"][row(t, s, r)]) for s in (3,) for r in (False, True)}


def test_regather_adds_one_gather_to_recomputing_choices_only():
    m = Machine(4, peak_flops=F, bandwidth=B, latency=1e-6, overlap_grad=False)
    x = 0.75 * W / B + 3 * 1e-6  # one ring pass among 4: 3 steps
    plain = sync(m)
    # forward gather, backward gather, reduce-scatter, whether or not the operator recomputes
    assert plain[(3, False)] == pytest.approx(3 * x)
    assert plain[(3, True)] == pytest.approx(3 * x)
    again = sync(m, ChoiceRules(zero3_regather=True))
    assert again[(3, False)] == pytest.approx(3 * x)
    assert again[(3, True)] == pytest.approx(4 * x)
    # per micro-batch, like the other stage-3 gathers
    assert sync(m, ChoiceRules(zero3_regather=True), micro_batches=2)[(3, True)] == pytest.approx(8 * x)


def test_regather_overlaps_as_the_forward_gather_does():
    m = Machine(4, peak_flops=F, bandwidth=B, latency=1e-6, overlap_grad=True)
    x = 0.75 * W / B + 3 * 1e-6
    f = 2 * 16 * 16 * 32 / F  # the operator's forward on its tile (batch 16 of 64)
    # backward (2 f) hides behind the backward gather + reduce-scatter, the forward (f) behind the forward gather
    plain = sync(m)
    assert plain[(3, True)] == pytest.approx((2 * x - 2 * f) + (x - f))
    again = sync(m, ChoiceRules(zero3_regather=True))
    assert again[(3, True)] == pytest.approx((2 * x - 2 * f) + 2 * (x - f))
    assert again[(3, False)] == pytest.approx(plain[(3, False)])


def test_regather_across_nodes_pays_every_ring_step():
    # 8 devices, nodes of 4 (1 us per step, 1 GB/s), 2 nodes (10 us per step, 0.5 GB/s per device): the batch
    # split 8 ways spans both levels; a gather of W: 3/4 W / 1 GB/s + 1/2 (W / 4) / 0.5 GB/s, and 7 ring steps,
    # 6 inside the nodes and 1 across (NCCL: nsteps 7, nInterSteps 1)
    m = Machine(8, peak_flops=F, bandwidth=B, latency=1e-6, node_size=4, inter_bandwidth=0.5 * B,
                inter_latency=1e-5, overlap_grad=False)
    t = choice_table(dense_op(), np.array([[8, 1, 1]]), np.array([[0, 1, 2]]), m, prune=False,
                     rules=ChoiceRules(zero3_regather=True))
    x = 0.75 * W / B + 0.5 * (W / 4) / (0.5 * B) + 6 * 1e-6 + 1 * 1e-5
    assert float(t.parts["weight_sync"][row(t, 3, True)]) == pytest.approx(4 * x)
    assert float(t.parts["weight_sync"][row(t, 3, False)]) == pytest.approx(3 * x)


def test_regather_must_be_a_bool():
    with pytest.raises(ShardplanError, match="zero3_regather must be True or False"):
        ChoiceRules(zero3_regather=1)


def test_grad_allreduce_replaces_the_reduce_scatter_by_an_all_reduce():
    # DeepSpeed v0.3's ZeRO-3 with reduce_scatter false: the gradient all-reduced over the group of 4 (NCCL's
    # cheaper of ring, 2 x 3/4 W / B + 6 steps, and tree, 2 W / B + 2 ceil(log2 4) steps); the gathers unchanged
    m = Machine(4, peak_flops=F, bandwidth=B, latency=1e-6, overlap_grad=False)
    x = 0.75 * W / B + 3 * 1e-6
    ar = min(1.5 * W / B + 6 * 1e-6, 2 * W / B + 4 * 1e-6)
    got = sync(m, ChoiceRules(zero3_grad_allreduce=True))
    assert got[(3, False)] == pytest.approx(2 * x + ar)
    both = sync(m, ChoiceRules(zero3_regather=True, zero3_grad_allreduce=True), micro_batches=2)
    assert both[(3, True)] == pytest.approx(2 * (3 * x + ar))


def test_grad_allreduce_overlaps_as_the_reduce_scatter_does():
    m = Machine(4, peak_flops=F, bandwidth=1e7, latency=1e-6, overlap_grad=True)  # slow links: nothing hides all
    x = 0.75 * W / 1e7 + 3 * 1e-6
    ring, tree = 1.5 * W / 1e7 + 6 * 1e-6, 2 * W / 1e7 + 4 * 1e-6
    f = 2 * 16 * 16 * 32 / F
    got = sync(m, ChoiceRules(zero3_grad_allreduce=True))
    assert got[(3, False)] == pytest.approx((x + min(ring, tree) - 2 * f) + (x - f))


def test_grad_allreduce_must_be_a_bool():
    with pytest.raises(ShardplanError, match="zero3_grad_allreduce must be True or False"):
        ChoiceRules(zero3_grad_allreduce="yes")


def test_overlap_never_charges_the_activation_gradients_more():
    """On a tiled machine a product's passes differ (tile and wave quantisation), so the backward operator_cost
    overlaps with is not compute (passes - 1) / passes; the activation gradients' all-reduce must still be the
    same with and without the weights' overlap, and overlapping must never cost more, whatever the
    accumulation (a pipeline stage's micro-batch charges the weights' all-reduce 1/accumulate)."""
    from dataclasses import replace

    from shardplan.machine import preset

    # GPT-3's first feed-forward product at one sequence per device: batch over 4 (data), output over 8 (tensor,
    # column-parallel: its input's gradient is all-reduced); the weights' all-reduce outlasts the backward
    op = ops.dense("fc", TensorRef("x", (4, 2048, 12288), needs_grad=True), 49152)
    on = preset("a100", 32)
    off = replace(on, overlap_grad=False)
    names = op.dim_names  # b, s, n (output), c (contracted)
    split = tuple(4 if d == "b" else 8 if d == "n" else 1 for d in names)
    for acc in (1, 24):
        t_on = choice_table(op, np.array([split]), None, on, prune=False, accumulate=acc)
        t_off = choice_table(op, np.array([split]), None, off, prune=False, accumulate=acc)
        assert np.allclose(t_on.parts["grad_allreduce"], t_off.parts["grad_allreduce"], rtol=1e-12)
        assert np.all(t_on.seconds <= t_off.seconds + 1e-15)
