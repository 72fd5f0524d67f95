"""Compute as a GPU runs it (roofline) and weight-gradient synchronisation as DDP runs it: hand derivations."""

import numpy as np
import pytest

from shardplan import ops
from shardplan.cost import operator_cost
from shardplan.errors import ShardplanError
from shardplan.ir import TensorRef
from shardplan.machine import Machine, preset

ADD = ops.elementwise("add", TensorRef("x", (1024, 1024), needs_grad=True), TensorRef("y", (1024, 1024),
                                                                                      needs_grad=True))
GEMM = ops.dense("fc", TensorRef("x", (128, 512), needs_grad=True), 256)  # y[b,n] = x[b,c] W[c,n]
GPU = dict(peak_flops=100e12, bandwidth=100e9, hbm_bandwidth=1e12, flops_efficiency=0.5, dtype_bytes=2)


def cost(op, config, m):
    return operator_cost(op, np.asarray([config]), m)


def test_elementwise_is_bound_by_memory_bandwidth():
    m = Machine(4, **GPU)
    c = cost(ADD, (4, 1), m)
    # per device: 256 x 1024 points, 1 FLOP each; reads x, y and writes the output: 3 tiles of 2-byte elements
    flops = 256 * 1024
    moved = 3 * 256 * 1024 * 2
    per_pass = max(flops / 50e12, moved / 1e12)
    assert per_pass == moved / 1e12
    assert c.compute[0] == pytest.approx(3 * per_pass)  # forward + the gradients of x and y
    # without an HBM bandwidth: FLOPs at peak (the paper's model)
    flat = Machine(4, peak_flops=100e12, bandwidth=100e9, dtype_bytes=2)
    assert cost(ADD, (4, 1), flat).compute[0] == pytest.approx(3 * flops / 100e12)


def test_gemm_is_bound_by_achievable_flops():
    big = ops.dense("fc", TensorRef("x", (4096, 4096), needs_grad=True), 4096)
    m = Machine(1, **GPU)
    flops = 2 * 4096**3
    moved = 3 * 4096 * 4096 * 2
    assert flops / 50e12 > moved / 1e12
    assert cost(big, (1, 1, 1), m).compute[0] == pytest.approx(3 * flops / 50e12)


def test_weight_gradients_share_a_bucket_all_reduce():
    # batch split 8 ways: W (512 x 256, 2 bytes) = 262,144 bytes all-reduced among 8 devices
    m = Machine(8, peak_flops=100e12, bandwidth=100e9, latency=5e-6, dtype_bytes=2, grad_bucket_bytes=1e6)
    w = 512 * 256 * 2
    # a full 1 MB bucket: ring 2*7/8*1e6/1e11 + 14*5e-6 = 8.75e-5, tree 2e6/1e11 + 2*3*5e-6 = 5e-5: the tree
    bucket_ar = 2 * 1e6 / 100e9 + 2 * 3 * 5e-6
    assert cost(GEMM, (8, 1, 1), m).grad_allreduce[0] == pytest.approx(w / 1e6 * bucket_ar)
    # one all-reduce per tensor: ring 4.59e-6 + 7e-5, tree 5.24e-6 + 3e-5: the tree, latency paid in full
    own = 2 * w / 100e9 + 2 * 3 * 5e-6
    per_tensor = Machine(8, peak_flops=100e12, bandwidth=100e9, latency=5e-6, dtype_bytes=2)
    assert cost(GEMM, (8, 1, 1), per_tensor).grad_allreduce[0] == pytest.approx(own)
    # a tensor larger than the bucket is its own bucket
    small = Machine(8, peak_flops=100e12, bandwidth=100e9, latency=5e-6, dtype_bytes=2, grad_bucket_bytes=1e5)
    assert cost(GEMM, (8, 1, 1), small).grad_allreduce[0] == pytest.approx(own)


def test_weight_sync_overlaps_the_backward_pass():
    kw = dict(peak_flops=1e12, bandwidth=1e9, dtype_bytes=2)
    w = 512 * 256 * 2
    sync = 2 * 7 / 8 * w / 1e9
    backward = 2 * (2 * 16 * 256 * 512) / 1e12  # the gradients of x and W, batch tile 16
    no = cost(GEMM, (8, 1, 1), Machine(8, **kw))
    yes = cost(GEMM, (8, 1, 1), Machine(8, overlap_grad=True, **kw))
    assert no.grad_allreduce[0] == pytest.approx(sync)
    assert yes.grad_allreduce[0] == pytest.approx(max(0.0, sync - backward))
    assert yes.compute[0] == no.compute[0]
    # activation gradients are on the critical path: never hidden (n split: x's gradient is reduced over n)
    act = cost(GEMM, (1, 8, 1), Machine(8, overlap_grad=True, **kw))
    assert act.grad_allreduce[0] == pytest.approx(2 * 7 / 8 * (128 * 512 * 2) / 1e9)


def test_gpu_presets_state_their_figures():
    h = preset("h100", 16)
    assert h.levels == (8, 2) and h.hbm_bandwidth == 2.83e12 and h.overlap_grad  # measured on an H100
    assert h.achievable_flops == pytest.approx(0.69 * 989e12)
    assert (h.gemm_align, h.gemm_unaligned_efficiency) == (8, 0.2)
    assert preset("a100", 16).gemm_align is None
    assert preset("paper", 16).hbm_bandwidth is None and not preset("paper", 16).overlap_grad
    with pytest.raises(ShardplanError, match="do not fill whole nodes of 8"):
        Machine(12, node_size=8, inter_bandwidth=1e9)
    with pytest.raises(ShardplanError, match="flops_efficiency"):
        Machine(8, flops_efficiency=1.5)


def test_an_unaligned_product_runs_at_the_unaligned_rate():
    """GPT-2's head: 50,257 columns are no multiple of 8, so every pass of the product is slowed; 50,304 is not."""
    from shardplan.cost.operator import pass_utilisation

    base = dict(peak_flops=1e15, bandwidth=1e11, dtype_bytes=2, hbm_bandwidth=1e15)
    plain = Machine(1, **base)
    slow = Machine(1, gemm_align=8, gemm_unaligned_efficiency=0.2, **base)
    for vocab, factor in ((50257, 0.2), (50304, 1.0)):
        op = ops.dense("head", TensorRef("x", (4096, 768), needs_grad=True), vocab)
        assert pass_utilisation(op, np.asarray([(1, 1, 1)]), slow).ravel().tolist() == [factor] * 3
        assert cost(op, (1, 1, 1), slow).compute[0] == pytest.approx(cost(op, (1, 1, 1), plain).compute[0] / factor)
    # a device's tile decides: 4096 rows over 3 devices are tiles of 1366, no multiple of 8, in every pass
    op = ops.dense("fc", TensorRef("x", (4096, 1024), needs_grad=True), 1024)
    u = pass_utilisation(op, np.asarray([(1, 1, 1), (3, 1, 1)]), Machine(3, gemm_align=8, gemm_unaligned_efficiency=0.5,
                                                                         **base))
    assert u.tolist() == [[1.0, 0.5]] * 3
    with pytest.raises(ShardplanError, match="together"):
        Machine(1, gemm_align=8, **base)
