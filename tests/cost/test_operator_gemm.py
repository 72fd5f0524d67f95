"""Tile and wave quantisation of matrix products (NVIDIA, Matrix Multiplication Background User's Guide): hand
derivations on a 108-SM machine with 256 x 128 output tiles (the A100 profile's constants)."""

import dataclasses

import numpy as np
import pytest

from shardplan import ops
from shardplan.cost import operator_cost
from shardplan.cost.operator import gemm_passes, gemm_utilisation, pass_utilisation
from shardplan.errors import ShardplanError
from shardplan.ir import TensorRef
from shardplan.machine import Machine, load_profile, preset

A100_TILES = ((256, 128), (128, 256), (128, 128))
TILED = dict(peak_flops=100e12, bandwidth=100e9, hbm_bandwidth=1e12, flops_efficiency=0.5, dtype_bytes=2,
             sm_count=108, gemm_tiles=A100_TILES)
ONE_TILE = dict(TILED, gemm_tiles=((256, 128),))


def test_utilisation_of_one_tile():
    m = Machine(1, **ONE_TILE)
    # the guide's example: 1792 x 1792 = 7 x 14 tiles of 256 x 128 = 98 tiles, one wave of 108 slots
    assert gemm_utilisation(1, 1792, 1792, m) == pytest.approx(98 / 108)
    # 2048 x 2048: 8 x 16 = 128 tiles, two waves (216 slots)
    assert gemm_utilisation(1, 2048, 2048, m) == pytest.approx(128 / 216)
    # tile quantisation: 257 x 128 needs 2 x 1 tiles, one wave
    assert gemm_utilisation(1, 257, 128, m) == pytest.approx(257 * 128 / (108 * 256 * 128))
    # exactly one full wave: 6912 x 512 = 27 x 4 = 108 tiles
    assert gemm_utilisation(1, 6912, 512, m) == pytest.approx(1.0)
    # 128 x 27,648 is 1 x 216 tiles with half of each empty: two waves, u = 1/2; with the other orientation
    # offered, 1 x 108 tiles of 128 x 256: one full wave
    assert gemm_utilisation(1, 128, 27648, m) == pytest.approx(0.5)
    both = Machine(1, **dict(ONE_TILE, gemm_tiles=((256, 128), (128, 256))))
    assert gemm_utilisation(1, 128, 27648, both) == pytest.approx(1.0)
    # a batch: 384 products of 2048 x 2048 = 49,152 tiles, 456 waves (49,248 slots)
    assert gemm_utilisation(384, 2048, 2048, m) == pytest.approx(49152 / 49248)
    # vectorised: arrays broadcast
    got = gemm_utilisation(np.array([1, 1]), np.array([1792, 2048]), 1792, m)
    assert got.shape == (2,) and got[0] == pytest.approx(98 / 108)


def test_utilisation_with_the_a100_tiles():
    m = Machine(1, **TILED)
    # 1792 x 1792: 98 tiles of 256 x 128 in one wave, or 196 of 128 x 128 in two: the same share, 98/108
    assert gemm_utilisation(1, 1792, 1792, m) == pytest.approx(98 / 108)
    # 2048 x 2048: 128 of 256 x 128 (two waves, 128/216) or 256 of 128 x 128 (three waves, 256/324): the latter
    assert gemm_utilisation(1, 2048, 2048, m) == pytest.approx(256 / 324)
    # 2304 x 2304 (a 1.7B model's weight gradient): 162 tiles of 256 x 128 (u = 0.75) or 18 x 18 = 324 of
    # 128 x 128, three full waves
    assert gemm_utilisation(1, 2304, 2304, m) == pytest.approx(1.0)
    # 257 x 128: 3 tiles of 128 x 128 in one wave
    assert gemm_utilisation(1, 257, 128, m) == pytest.approx(257 * 128 / (108 * 128 * 128))
    # GPT-3 175B's projection at TP 8, micro-batch 1 (2048 x 1536): 96 tiles of 256 x 128 (one wave) or 192 of
    # 128 x 128 (two): 96/108 either way
    assert gemm_utilisation(1, 2048, 1536, m) == pytest.approx(96 / 108)
    # the 162B model's at TP 8 (2048 x 2560): 160 of 256 x 128 (two waves, 0.74) or 320 of 128 x 128 (three)
    assert gemm_utilisation(1, 2048, 2560, m) == pytest.approx(320 / 324)


def test_no_multiprocessors_means_no_quantisation():
    assert gemm_utilisation(1, 1792, 1792, preset("paper", 4)) == 1.0
    assert np.all(gemm_utilisation(np.arange(1, 4), 3, 5, load_profile("cpu.json").machine(8)) == 1.0)


def test_tile_constants_go_together():
    with pytest.raises(ShardplanError, match="together"):
        Machine(1, sm_count=108)
    with pytest.raises(ShardplanError, match="together"):
        Machine(1, gemm_tiles=((256, 128),))
    with pytest.raises(ShardplanError, match="sm_count"):
        Machine(1, sm_count=0, gemm_tiles=((256, 128),))
    with pytest.raises(ShardplanError, match="pairs"):
        Machine(1, sm_count=108, gemm_tiles=(256, 128))
    with pytest.raises(ShardplanError, match="gemm_tiles"):
        Machine(1, sm_count=108, gemm_tiles=((256, 0),))
    assert Machine(1, sm_count=108, gemm_tiles=[[256, 128]]).gemm_tiles == ((256, 128),)  # as a file gives it
    a100 = preset("a100", 8)
    assert (a100.sm_count, a100.gemm_tiles) == (108, A100_TILES)
    assert preset("h100", 8).sm_count == 132
    assert preset("paper", 8).sm_count is None and preset("paper", 8).gemm_tiles is None


def test_passes_name_batch_rows_and_columns():
    x = TensorRef("x", (4, 2048, 1024), needs_grad=True)
    ffn = ops.einsum("ffn1", "bsd,de->bse", x, ops.Param((1024, 4096)), kind="ffn")
    names = ffn.dim_names

    def letters(spec):
        return None if spec is None else tuple("".join(names[i] for i in part) for part in spec)

    # forward y[b,s,e]: rows b s, columns e; the input's gradient dx[b,s,d]: rows b s (dY), columns d (W);
    # the weight's gradient dW[d,e]: rows e (dY), columns d (x); no batch dims
    assert [letters(p) for p in gemm_passes(ffn)] == [("", "bs", "e"), ("", "bs", "d"), ("", "e", "d")]
    q, k = TensorRef("q", (4, 2048, 16, 64), needs_grad=True), TensorRef("k", (4, 2048, 16, 64), needs_grad=True)
    scores = ops.einsum("scores", "bshk,bthk->bhst", q, k)
    names = scores.dim_names
    assert [letters(p) for p in gemm_passes(scores)] == [("bh", "s", "t"), ("bh", "s", "k"), ("bh", "t", "k")]
    # not products: an elementwise add, a layer norm (three operands), a matrix-vector product
    add = ops.elementwise("add", x, x)
    assert gemm_passes(add) == [None, None, None]
    assert all(p is None for p in gemm_passes(ops.layer_norm("ln", x)))
    gemv = ops.einsum("gemv", "bsd,d->bs", x, ops.Param((1024,)))
    assert gemm_passes(gemv)[0] is None


def test_operator_cost_charges_each_pass_its_own_utilisation():
    # y[b,n] = x[b,c] W[c,n] with b = 2048, c = 2304, n = 2304 on one device: 2 * 2048 * 2304^2 FLOPs a pass;
    # one tile, 256 x 128
    x = TensorRef("x", (2048, 2304), needs_grad=True)
    op = ops.dense("fc", x, 2304)
    m = Machine(1, **ONE_TILE)
    flops = 2 * 2048 * 2304 * 2304
    # forward y (2048 x 2304): 8 x 18 = 144 tiles, 2 waves, u = 144/216; 18 x 8 of 128 x 256 the same
    # dx (2048 x 2304): the same; dW (2304 x 2304): 162 tiles, 2 waves, u = 162/216
    u = pass_utilisation(op, np.array([[1, 1, 1]]), m)[:, 0]
    assert u == pytest.approx([144 / 216, 144 / 216, 162 / 216])
    expect = flops / 50e12 * (216 / 144 + 216 / 144 + 216 / 162)
    moved = (2048 * 2304 * 2 + 2304 * 2304) * 2
    assert moved / 1e12 < flops / 50e12  # compute-bound
    assert operator_cost(op, np.array([[1, 1, 1]]), m).compute[0] == pytest.approx(expect)
    # the batch split 2 ways: each device's product is 1024 x 2304 (4 x 18 = 72 tiles, one wave, u = 72/108)
    # forward and dx; dW 2304 x 2304 as before with K halved
    m2 = Machine(2, **ONE_TILE)
    u2 = pass_utilisation(op, np.array([[2, 1, 1]]), m2)[:, 0]
    assert u2 == pytest.approx([72 / 108, 72 / 108, 162 / 216])
    c2 = operator_cost(op, np.array([[2, 1, 1]]), m2).compute[0]
    assert c2 == pytest.approx(flops / 2 / 50e12 * (108 / 72 + 108 / 72 + 216 / 162))


def test_machines_without_tiles_keep_the_roofline_exactly():
    x = TensorRef("x", (2048, 2304), needs_grad=True)
    op = ops.dense("fc", x, 2304)
    base = dict(TILED, sm_count=None, gemm_tiles=None)
    c = operator_cost(op, np.array([[1, 1, 1]]), Machine(1, **base)).compute[0]
    assert c == 3 * (2 * 2048 * 2304 * 2304 / 50e12)
    # an operator that is no product is costed alike with or without tiles
    add = ops.elementwise("add", x, x)
    tiled = operator_cost(add, np.array([[1, 1]]), Machine(1, **TILED)).compute[0]
    assert tiled == operator_cost(add, np.array([[1, 1]]), Machine(1, **base)).compute[0]


def _biased(needs_grad: bool = True):
    """y[b,n] = x[b,c] W[c,n] + bias[n] (b = 2048, c = n = 2304): ``addmm`` / ``linear`` with a bias."""
    from shardplan.ir import Tensor

    op = ops.dense("fc", TensorRef("x", (2048, 2304), needs_grad=True), 2304)
    n = op.output.axes[-1].dim
    bias = Tensor("bias", (2304,), (n,), "weight", needs_grad=needs_grad)
    return dataclasses.replace(op, weights=op.weights + (bias,))


def test_a_bias_is_outside_the_product_and_its_gradient_is_a_reduction():
    """The bias indexes no summed dim: the product is x by W (quantised as without the bias), and the bias's
    gradient pass is dY summed over the rows: max(2048 * 2304 adds / R, (|dY| + |dB|) * 2 B / HBM)."""
    op, plain = _biased(), ops.dense("fc", TensorRef("x", (2048, 2304), needs_grad=True), 2304)
    assert [t.name for t in op.epilogue_tensors] == ["bias"] and op.passes == 3.0
    assert gemm_passes(op) == gemm_passes(plain) + [None]
    m = Machine(1, **ONE_TILE)
    one = np.array([[1, 1, 1]])
    assert pass_utilisation(op, one, m)[:3, 0] == pytest.approx(pass_utilisation(plain, one, m)[:, 0])
    reduction = max(2048 * 2304 / 50e12, (2048 * 2304 + 2304) * 2 / 1e12)
    assert operator_cost(op, one, m).compute[0] == pytest.approx(operator_cost(plain, one, m).compute[0] + reduction)
    # the rows split 2 ways: each device reduces its half of dY into a whole bias gradient
    two = np.array([[2, 1, 1]])
    m2 = Machine(2, **ONE_TILE)
    half = max(1024 * 2304 / 50e12, (1024 * 2304 + 2304) * 2 / 1e12)
    assert operator_cost(op, two, m2).compute[0] == pytest.approx(operator_cost(plain, two, m2).compute[0] + half)
    # without tiles too (the roofline of three passes and the reduction)
    flat = Machine(1, **dict(TILED, sm_count=None, gemm_tiles=None))
    assert operator_cost(op, one, flat).compute[0] == pytest.approx(operator_cost(plain, one, flat).compute[0]
                                                                     + reduction)
    # a frozen bias: no pass for it; the product is still of x and W
    frozen = _biased(needs_grad=False)
    assert operator_cost(frozen, one, m).compute[0] == pytest.approx(operator_cost(plain, one, m).compute[0])


def test_the_model_flops_count_a_bias_gradient_as_one_add_per_output_point():
    from shardplan.models.flops import operator_flops

    op = _biased()
    assert operator_flops(op) == 2 * 2048 * 2304 * 2304 * 3 + 2048 * 2304


def test_no_epilogue_without_a_sum_with_two_operands_or_with_a_fused_backward():
    x = TensorRef("x", (8, 64, 32), needs_grad=True)
    assert ops.layer_norm("ln", x).epilogue_tensors == ()  # normalised dims are kept: nothing summed
    q = TensorRef("q", (2, 64, 4, 16), needs_grad=True)
    k = TensorRef("k", (2, 64, 4, 16), needs_grad=True)
    att = ops.flash_attention("att", q, k, k, "bshk", "bthk")
    assert att.epilogue_tensors == ()  # the queries index no summed dim but enter both products
    assert att.passes == 1 + att.backward_flops / att.flops_per_point
