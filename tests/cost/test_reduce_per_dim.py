"""``Machine.reduce_per_dim``: a partial sum over several split dims charged as one all-reduce per split dim.

The compiled-HLO side (XLA's lowering, bytes equal) is tests/jax_engine/test_jax_reduce_per_dim.py; here the
charge itself: bytes and seconds of the forward partial sums, the gradient all-reduces and the statistics,
on one level and on two, against the PaSE model's one all-reduce among the product of the groups.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from shardplan import ops
from shardplan.cost.collectives import allreduce_time
from shardplan.cost.operator import operator_cost
from shardplan.errors import ShardplanError
from shardplan.ir import TensorRef
from shardplan.machine import Machine, preset

TOY = Machine(8, peak_flops=32e9, bandwidth=16e9, name="toy")
PASE = dataclasses.replace(TOY, reduce_per_dim=False)
W = 64 * 32 * 4  # the weight's bytes


def _mlp():
    return ops.einsum("fc", "bsk,kn->bsn", TensorRef("x", (8, 8, 64), needs_grad=False), ops.Param((64, 32)))


def _row(op, **splits) -> np.ndarray:
    return np.asarray([[splits.get(d, 1) for d in op.dim_names]])


def test_weight_gradient_over_two_split_dims():
    """b and s split 2 ways each: two all-reduces of 2 (2 W bytes), not one of 4 (1.5 W)."""
    op = _mlp()
    row = _row(op, b=2, s=2)
    per, one = operator_cost(op, row, TOY), operator_cost(op, row, PASE)
    assert per.comm_bytes[0] == 2 * W and one.comm_bytes[0] == 1.5 * W
    assert per.grad_allreduce[0] == pytest.approx(2 * allreduce_time(W, np.asarray([[2]]), TOY)[0], rel=1e-12)
    assert one.grad_allreduce[0] == pytest.approx(allreduce_time(W, np.asarray([[4]]), TOY)[0], rel=1e-12)
    assert per.forward_allreduce[0] == one.forward_allreduce[0] == 0.0


def test_one_split_dim_is_unchanged():
    """Only b split (4 ways), or b and an output dim: one reduced dim split, the same charge either way."""
    op = _mlp()
    for row in (_row(op, b=4), _row(op, b=2, n=4), _row(op, b=8)):
        assert operator_cost(op, row, TOY).comm_bytes[0] == operator_cost(op, row, PASE).comm_bytes[0]


def test_three_dims_and_mixed_sizes():
    op = _mlp()
    assert operator_cost(op, _row(op, b=2, s=4), TOY).comm_bytes[0] == W + 1.5 * W
    assert operator_cost(op, _row(op, b=2, s=4), PASE).comm_bytes[0] == 1.75 * W
    op3 = ops.einsum("fc", "bstk,kn->bstn", TensorRef("x", (4, 4, 4, 64), needs_grad=False), ops.Param((64, 32)))
    assert operator_cost(op3, _row(op3, b=2, s=2, t=2), TOY).comm_bytes[0] == 3 * W


def test_forward_contraction_and_statistics():
    """A forward product contracting two split dims, and batch-norm statistics over two split dims."""
    fwd = ops.einsum("p", "msk,skn->mn", TensorRef("x", (16, 8, 64), needs_grad=False), ops.Param((8, 64, 32)))
    out = 16 * 32 * 4
    c = operator_cost(fwd, _row(fwd, s=2, k=2), TOY)
    assert c.comm_bytes[0] == 2 * out
    assert c.forward_allreduce[0] == pytest.approx(2 * allreduce_time(out, np.asarray([[2]]), TOY)[0], rel=1e-12)
    bn = ops.batch_norm("bn", TensorRef("x", (8, 16, 8, 8)))
    # mean and variance of 16 channels (128 B), forward and backward, per split dim; gamma, beta (64 B each) too
    per = operator_cost(bn, _row(bn, b=2, h=2), TOY).comm_bytes[0]
    one = operator_cost(bn, _row(bn, b=2, h=2), PASE).comm_bytes[0]
    assert per == 2 * (2 * 128 + 64 + 64) and one == 1.5 * (2 * 128 + 64 + 64)


def test_two_levels_each_dim_on_its_own_level():
    """8 devices in nodes of 4; b (outermost) split across the nodes, s inside: one all-reduce across the
    nodes and one inside, each of the whole gradient."""
    m = dataclasses.replace(preset("a100", 8), node_size=4, dtype_bytes=4, grad_bucket_bytes=None,
                            overlap_grad=False)
    assert m.levels == (4, 2)
    op = _mlp()
    c = operator_cost(op, _row(op, b=2, s=2, n=2), m)
    tile = 64 * 16 * 4
    across, inside = np.asarray([[1], [2]]), np.asarray([[2], [1]])
    assert c.comm_bytes[0] == 2 * tile
    assert c.grad_allreduce[0] == pytest.approx(allreduce_time(tile, across, m)[0] + allreduce_time(tile, inside, m)[0],
                                                rel=1e-12)
    one = operator_cost(op, _row(op, b=2, s=2, n=2), dataclasses.replace(m, reduce_per_dim=False))
    assert one.grad_allreduce[0] == pytest.approx(allreduce_time(tile, np.asarray([[2], [2]]), m)[0], rel=1e-12)


def test_field_must_be_bool():
    with pytest.raises(ShardplanError, match="reduce_per_dim"):
        Machine(8, reduce_per_dim=1)
    assert preset("paper", 8).reduce_per_dim is False and preset("h100", 8).reduce_per_dim is True


@pytest.mark.parametrize("overlap", [False, True])
def test_the_memory_choices_charge_the_weight_sync_once_a_step(overlap):
    """The fit's choice rows take the weight's all-reduce(s) out of the operator's gradient all-reduce and
    charge them once a step: with the sync per split dim, nothing of it may stay in the per-micro-batch
    activation-gradient term (the input's gradient reduces over n, unsplit here, so that term is 0), and the
    ZeRO-0 row's weight sync is the per-dim syncs' sum over the micro-batches."""
    from shardplan.cost.memory import choice_table

    op = _mlp()
    row = _row(op, b=2, s=2)
    m = dataclasses.replace(TOY, grad_bucket_bytes=None, overlap_grad=overlap)
    table = choice_table(op, row, None, m, micro_batches=8, accumulate=8, stages=(0,), recompute=False,
                         prune=False)
    zero0 = table.stage == 0
    assert np.all(table.parts["grad_allreduce"][zero0] == 0.0)
    if not overlap:
        sync = 2 * allreduce_time(W, np.asarray([[2]]), m)[0]
        assert table.parts["weight_sync"][zero0] == pytest.approx(sync / 8, rel=1e-12)
