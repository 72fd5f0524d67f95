"""GPT with Megatron-LM's kernels of 2021-22 (``kernels="megatron"``): the vertices, what they keep, what
selective recomputation picks, how tensor parallelism splits them, and their hand-derived memory-bound cost."""

from __future__ import annotations

import numpy as np
import pytest

from shardplan.cost import operator_cost
from shardplan.errors import ShardplanError
from shardplan.machine import preset
from shardplan.models import get_model
from shardplan.models.flops import config_of
from shardplan.models.gpt import GPTConfig, gpt
from shardplan.recipe import model_dim, recompute_names

SIZES = dict(batch=2, layers=2, d_model=256, heads=4, seq=128, vocab=1024)
LAYER_FUSED = ["ln1", "q", "k", "v", "scores", "context", "out", "add1", "ln2", "ffn1", "ffn2", "add2"]
LAYER_MEGATRON = ["ln1", "qkv", "scores", "softmax", "dropout", "context", "out", "add1", "ln2", "ffn1",
                  "gelu", "ffn2", "add2"]


def layer(g, i=1):
    return [op for op in g.operators if op.name.startswith(f"L{i}/")]


def test_default_is_the_fused_model_unchanged():
    g = gpt(**SIZES)
    assert [op.name.split("/")[1] for op in layer(g)] == LAYER_FUSED
    def key(op):
        return (op.name, op.kind, op.dims, op.flops_per_point, op.norm_dims, op.saved, [t.src for t in op.inputs])

    assert [key(op) for op in gpt(**SIZES, kernels="fused").operators] == [key(op) for op in g.operators]
    scores = next(op for op in layer(g) if op.name.endswith("/scores"))
    assert scores.norm_dims == ("t",) and scores.flops_per_point == 2.0 + 5.0 / 64  # softmax fused, d_head 64


def test_megatron_layer_has_one_vertex_per_kernel():
    g = gpt(**SIZES, kernels="megatron")
    ops = {op.name.split("/")[1]: op for op in layer(g)}
    assert list(ops) == LAYER_MEGATRON
    assert len(g) == len(gpt(**SIZES)) + SIZES["layers"]  # + softmax, dropout, gelu; q, k, v one product
    # the scores product is a plain product (the softmax is its own kernel)
    assert ops["scores"].flops_per_point == 2.0 and ops["scores"].norm_dims == () and ops["scores"].saved == 1.0
    assert ops["softmax"].norm_dims == ("t",) and ops["softmax"].dim_names == ("b", "h", "s", "t")
    assert ops["dropout"].saved == 1.5 and ops["dropout"].inputs[0].src == ops["softmax"].name
    assert ops["context"].inputs[0].src == ops["dropout"].name
    assert ops["gelu"].inputs[0].src == ops["ffn1"].name and ops["ffn2"].inputs[0].src == ops["gelu"].name
    assert ops["add1"].saved == ops["add2"].saved == 1.5  # bias-dropout-add keeps its mask
    # the weights are the fused model's: the same parameter count
    assert sum(w.size for op in g.operators for w in op.weights) == \
        sum(w.size for op in gpt(**SIZES).operators for w in op.weights)


def test_core_keeps_korthikanti_five_bytes_per_score_and_the_scores():
    # Korthikanti et al. 2022, Table 2: softmax output 2 b a s^2, dropout mask b a s^2, dropout output 2 b a s^2;
    # the scores' output (2 b a s^2) is counted as well, so that recomputation keeps nothing of the core
    g = gpt(**SIZES, kernels="megatron")
    core = {op.name.split("/")[1]: op for op in layer(g)}
    b, a, s = SIZES["batch"], SIZES["heads"], SIZES["seq"]
    kept = sum(core[n].saved * core[n].output.size for n in ("softmax", "dropout")) * 2  # 2-byte elements
    assert kept == 5 * b * a * s * s
    assert core["scores"].saved * core["scores"].output.size * 2 == 2 * b * a * s * s


def test_recomputing_the_core_keeps_none_of_it():
    # under full or selective recomputation each recomputed kernel keeps the inputs no producer keeps: none
    from shardplan.cost.memory import unsaved_inputs

    g = gpt(**SIZES, kernels="megatron")
    ops = {op.name: op for op in g.operators}
    for op in layer(g):
        if op.name.split("/")[1] in ("softmax", "dropout", "context", "gelu", "ffn2", "ln2"):
            shares = unsaved_inputs(op, [ops[t.src].saved for t in op.inputs])
            assert all(x == 0.0 for x in shares), op.name


def test_selective_recomputation_picks_the_four_kernels_of_the_core():
    g = gpt(**SIZES, kernels="megatron")
    want = [f"L{i}/{n}" for i in (1, 2) for n in ("scores", "softmax", "dropout", "context")]
    assert recompute_names(g, "selective") == want


def test_tensor_parallelism_splits_the_new_kernels_as_megatron_does():
    ops = {op.name.split("/")[1]: op for op in layer(gpt(**SIZES, kernels="megatron"))}
    assert model_dim(ops["softmax"]) == model_dim(ops["dropout"]) == "h"  # heads, as the scores
    assert model_dim(ops["gelu"]) == "e"  # the hidden 4h, as ffn1
    assert model_dim(ops["add1"]) is None


def test_softmax_and_dropout_are_memory_bound_on_a100():
    # one layer, batch 2, 4 heads, 128 x 128 scores: 131,072 scores of 2 bytes. The softmax reads x and writes y
    # forward (2 tiles), reads dy and y and writes dx backward (3); the dropout writes its 1-byte mask besides
    # (2.5 tiles forward), reads dy and the mask and writes dx backward (2.5)
    g = gpt(**SIZES, kernels="megatron")
    ops = {op.name.split("/")[1]: op for op in layer(g)}
    m = preset("a100", 1)
    n = 2 * 4 * 128 * 128
    one = np.ones((1, 4), dtype=np.int64)
    tile = n * 2 / m.hbm_bandwidth
    assert operator_cost(ops["softmax"], one, m).compute[0] == pytest.approx((2 + 3) * tile)
    assert operator_cost(ops["dropout"], one, m).compute[0] == pytest.approx((2.5 + 2.5) * tile)


def test_the_other_megatron_kernels_move_what_their_sources_do():
    # in tiles of the (b, s, d) or (b, s, 4d) tensor, forward + backward (shardplan.models._blocks.MEGATRON_IO):
    # bias-GELU 2 + 4 (dy and x read, dx written and read again for the bias's sum), bias-dropout-add 3.5 + 6.5
    # (branch and residual read, y and mask written; dy and mask read, the branch's gradient written and read
    # again, the residual stream's two gradients summed where it forks), layer norm 2 + 5 (apex's two backward
    # kernels each read dy and x), the weights' tiles aside; the fp32 cross-entropy 19 + 7 tiles of the logits
    g = gpt(**SIZES, kernels="megatron")
    ops = {op.name.split("/")[1]: op for op in layer(g)}
    ops["loss"] = g["softmax"]
    m = preset("a100", 1)
    b, s, d, v = SIZES["batch"], SIZES["seq"], SIZES["d_model"], SIZES["vocab"]
    rate = m.hbm_bandwidth

    def seconds(name):
        op = ops[name]
        return operator_cost(op, np.ones((1, len(op.dims)), dtype=np.int64), m).compute[0]

    t = b * s * d * 2 / rate
    assert seconds("gelu") == pytest.approx((2 + 4) * 4 * t)
    assert seconds("add1") == pytest.approx((3.5 + 6.5) * t)
    weights = 2 * d * 2 / rate  # gamma and beta, read forward, their gradients written backward
    assert seconds("ln1") == pytest.approx((2 + 5) * t + 2 * weights)
    logits = b * s * v * 2 / rate
    labels = b * s * 2 / rate  # the per-token loss written, the int64 labels read (4 two-byte units) forward
    assert seconds("loss") == pytest.approx(19 * logits + 4 * labels + labels + labels + 7 * logits)
    fused = {op.name: op for op in gpt(**SIZES).operators}  # the default model keeps one pass per tensor
    assert all(op.kernel_io is None for op in fused.values())


def test_kernels_reach_the_registry_and_the_config():
    g = get_model("gpt", 2, layers=1, d_model=256, heads=4, seq=128, vocab=1024, kernels="megatron")
    assert [op.name.split("/")[1] for op in layer(g)] == LAYER_MEGATRON
    cfg = config_of("gpt", kernels="megatron")
    assert cfg.kernels == "megatron" and cfg.sizes()["kernels"] == "megatron"
    assert "kernels" not in GPTConfig(2, 256, 4, 128, 1024).sizes()
    with pytest.raises(ShardplanError, match="kernels"):
        gpt(**SIZES, kernels="flash")
    with pytest.raises(ShardplanError, match="kernels"):
        GPTConfig(2, 256, 4, 128, 1024, kernels="flash")


def test_megatron_query_key_value_is_one_product_read_three_ways():
    # Megatron-LM's query_key_value: one column-parallel linear; the scores read q (index 0) and k (index 1) of its
    # (3) axis, the context v (index 2), each through a dimension c of extent 1
    g = gpt(**SIZES, kernels="megatron")
    ops = {op.name.split("/")[1]: op for op in layer(g)}
    qkv = ops["qkv"]
    d, h = SIZES["d_model"], SIZES["heads"]
    assert qkv.weights[0].shape == (d, 3, h, d // h) and qkv.extents["c"] == 3
    reads = [(t.src, next(a.offset for a in t.axes if a.dim == "c"))
             for n in ("scores", "context") for t in ops[n].inputs if t.src == qkv.name]
    assert reads == [(qkv.name, 0), (qkv.name, 1), (qkv.name, 2)]
    assert ops["scores"].extents["c"] == ops["context"].extents["c"] == 1
    fused = {op.name.split("/")[1]: op for op in layer(gpt(**SIZES))}

    def work(op):
        return op.flops_per_point * float(np.prod(list(op.extents.values())))

    b, s = SIZES["batch"], SIZES["seq"]
    assert work(ops["scores"]) == 2.0 * b * h * s * s * (d // h)  # q.k^T, the softmax a kernel of its own
    assert work(ops["context"]) == work(fused["context"])
    assert work(qkv) == sum(work(fused[n]) for n in "qkv")


def test_fused_query_key_value_reduces_its_input_gradient_once():
    # under tensor parallelism (heads split 4 ways) the separate products each all-reduce the gradient of the
    # norm's output; the fused one once, for the same work
    from shardplan.cost import operator_cost

    m = preset("a100", 4)
    split = {"h": 4}
    fused = {op.name.split("/")[1]: op for op in layer(gpt(**SIZES))}
    meg = {op.name.split("/")[1]: op for op in layer(gpt(**SIZES, kernels="megatron"))}

    def row(op):
        return np.array([[split.get(n, 1) for n in op.dim_names]], dtype=np.int64)

    three = sum(operator_cost(fused[n], row(fused[n]), m).grad_allreduce[0] for n in "qkv")
    one = operator_cost(meg["qkv"], row(meg["qkv"]), m).grad_allreduce[0]
    assert one > 0 and three == pytest.approx(3 * one)
