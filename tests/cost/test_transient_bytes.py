"""Bytes of an operator's backward step (Operator.transient) per layout, by hand; saved bytes alike on both paths."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from shardplan import ops
from shardplan.cost.memory import choice_table, operator_memory, transient_bytes, weight_groups
from shardplan.errors import ShardplanError
from shardplan.ir import TensorRef
from shardplan.machine import preset


def _dense():
    """y[b, n] = sum_c x[b, c] w[c, n] (b 8, n 32, c 16); y float32 in a bf16 model (elem_factor 2)."""
    op = ops.dense("fc", TensorRef("x", (8, 16), needs_grad=True), 32)
    assert [d for d, _ in op.dims] == ["b", "n", "c"]
    return dataclasses.replace(op, transient=(1.0, 1.0, 1.0), output=dataclasses.replace(op.output, elem_factor=2),
                               saved=1.5)


CONFIGS = np.array([[1, 1, 1], [2, 2, 1], [1, 1, 4]])


def test_transient_bytes_by_hand():
    m = preset("h100", 4)  # 2-byte elements
    act, wt = transient_bytes(_dense(), CONFIGS, m)
    # replicated: y 8 x 32 fp32 (1024 B) + x 8 x 16 (256 B); w 16 x 32 (1024 B)
    # b and n split 2 x 2: y 4 x 16 fp32 (256 B) + x 4 x 16 (128 B); w 16 x 16 (512 B)
    # c split 4: y whole (partial sums, 1024 B) + x 8 x 4 (64 B); w 4 x 32 (256 B)
    assert act.tolist() == [1280.0, 384.0, 1088.0] and wt.tolist() == [1024.0, 512.0, 256.0]
    act2, wt2 = transient_bytes(_dense(), CONFIGS, m, micro_batches=2)  # a micro-batch's activations
    assert act2.tolist() == [640.0, 192.0, 544.0] and wt2.tolist() == wt.tolist()
    none = dataclasses.replace(_dense(), transient=())
    assert [x.tolist() for x in transient_bytes(none, CONFIGS, m)] == [[0.0] * 3, [0.0] * 3]


def test_choice_table_carries_the_transient():
    m = preset("h100", 4)
    op = _dense()
    ct = choice_table(op, CONFIGS, None, m, recompute=False, prune=False)
    assert ct.transient_bytes.tolist() == (np.tile([2304.0, 896.0, 1344.0], len(ct.base) // 3)).tolist()


def test_saved_bytes_agree_on_both_paths_for_a_wider_output():
    """``saved`` counts output tiles in the machine's element size, whatever the output's elem_factor."""
    m = preset("h100", 4)
    op = _dense()
    assert weight_groups(op, CONFIGS, None, m).act.tolist() == operator_memory(op, CONFIGS, m)[1].ravel().tolist() \
        == [1.5 * 256 * 2, 1.5 * 64 * 2, 1.5 * 256 * 2]


def test_bad_transient():
    with pytest.raises(ShardplanError, match="transient needs one finite number"):
        dataclasses.replace(_dense(), transient=(1.0, 1.0))
    with pytest.raises(ShardplanError, match="transient needs one finite number"):
        dataclasses.replace(_dense(), transient=(1.0, -1.0, 1.0))
