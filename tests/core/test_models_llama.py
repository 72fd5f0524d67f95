"""The Llama family and the published GPT sizes in the zoo, their parameter counts and exact training FLOPs."""

from __future__ import annotations

import math
from fractions import Fraction

import networkx as nx
import numpy as np
import pytest

import shardplan
from shardplan.baselines import baseline_plans
from shardplan.cli import main
from shardplan.errors import ShardplanError
from shardplan.machine import preset
from shardplan.models import MODELS, NAMED, get_model, model_spec, models_table
from shardplan.models.flops import (config_of, graph_flops, is_matmul, megatron_flops, model_flops,
                                    operator_flops)
from shardplan.models.gpt import (GPT3, GPT3_PARAMS, GPT3_VOCAB, GPT_SIZES, MEGATRON, MEGATRON_PARAMS, GPTConfig,
                                  gpt_published_params, padded_vocab)
from shardplan.models.llama import LLAMA3, LlamaConfig
from shardplan.pipeline.stages import ModelStages, _longest_run

BLOCK = ["ln1", "q", "k", "v", "rope_q", "rope_k", "scores", "context", "out", "add1",
         "ln2", "gate", "up", "swiglu", "down", "add2"]


def _weights(g) -> int:
    return sum(math.prod(w.shape) * w.elem_factor for op in g for w in op.weights)


# ---------------------------------------------------------------------------------------------------------------
# the graphs
# ---------------------------------------------------------------------------------------------------------------
def test_llama_tiny_builds_with_its_blocks_in_order():
    g = get_model("llama3-tiny", attention="unfused")  # the core as two products (FlashAttention's: tests/models)
    assert g.name == "llama3-tiny" and len(g) == 2 * 16 + 4
    assert [op.name for op in g][:17] == ["embed"] + [f"L1/{n}" for n in BLOCK]
    assert [op.name for op in g][-3:] == ["ln_f", "fc", "softmax"]
    nxg = g.to_networkx()
    assert nx.is_weakly_connected(nxg) and [n for n in nxg if nxg.out_degree(n) == 0] == ["softmax"]
    # llama3-tiny: batch 8, seq 128, d 256, 8 query heads in 2 key/value groups of 4, head width 32, ffn 768
    assert g["L1/q"].extents == {"b": 8, "s": 128, "h": 2, "r": 4, "k": 32, "d": 256}
    assert g["L1/k"].output.shape == g["L1/v"].output.shape == (8, 128, 2, 32)
    assert g["L1/scores"].extents == {"b": 8, "h": 2, "r": 4, "s": 128, "t": 128, "k": 32}
    assert g["L1/scores"].norm_dims == ("t",) and g["L1/scores"].reduction_dims == ("k",)
    assert g["L1/out"].reduction_dims == ("h", "r", "k") and g["L1/out"].output.shape == (8, 128, 256)
    assert g["L1/gate"].extents == {"b": 8, "s": 128, "e": 768, "d": 256}
    assert g["L1/swiglu"].inputs[0].src == "L1/gate" and g["L1/swiglu"].inputs[1].src == "L1/up"
    assert g["L1/down"].inputs[0].src == "L1/swiglu"
    # the residuals read the block's input and the branch's output
    assert [t.src for t in g["L2/add1"].inputs] == ["L1/add2", "L2/out"]
    assert [t.src for t in g["L2/add2"].inputs] == ["L2/add1", "L2/down"]
    # rotary embedding: elementwise, 3 FLOPs per element, the head features not split
    for name, src in (("L1/rope_q", "L1/q"), ("L1/rope_k", "L1/k")):
        op = g[name]
        assert op.kind == "rope" and op.flops_per_point == 3.0 and op.fixed == {"k"} and op.inputs[0].src == src
    assert [t.src for t in g["L1/scores"].inputs] == ["L1/rope_q", "L1/rope_k"]
    # RMSNorm: a gain and no bias, one statistic per row
    for name in ("L1/ln1", "L2/ln2", "ln_f"):
        op = g[name]
        assert op.kind == "rms_norm" and [w.shape for w in op.weights] == [(256,)] and op.norm_stats == 1
    # untied head: the embedding table and the projection are two weights with no owner
    assert g["embed"].weights[0].shape == (8192, 256) and g["fc"].weights[0].shape == (256, 8192)
    assert not g.weight_edges


def test_llama_sizes_override_like_gpt():
    g = get_model("llama3-8b", 2, layers=1, seq=64)
    assert g.name == "llama3-8b" and len(g) == 15 + 4  # the FlashAttention core: one vertex
    assert g["L1/q"].extents == {"b": 2, "s": 64, "h": 8, "r": 4, "k": 128, "d": 4096}
    assert g["L1/up"].extents["e"] == 14336 and g["fc"].extents["v"] == 128256
    mha = get_model("llama3-tiny", kv_heads=8)  # one query per key/value head: multi-head attention
    assert mha["L1/q"].extents["h"] == 8 and mha["L1/q"].extents["r"] == 1
    assert model_spec("LLAMA3_8B") is model_spec("llama3-8b") is NAMED["llama3-8b"]
    assert model_spec("megatron-1T").name == "megatron-1t"


@pytest.mark.parametrize("sizes, match", [
    (dict(kv_heads=3), "kv_heads=3 must be a positive divisor of heads=8"),
    (dict(heads=6), "heads=6 must be a positive divisor of d_model=256"),
    (dict(layers=0), "must be at least 1"),
    (dict(depth=2), "no size 'depth'"),
])
def test_llama_refuses_sizes_that_make_no_model(sizes, match):
    with pytest.raises(ShardplanError, match=match):
        get_model("llama3-tiny", **sizes)


def test_llama_config_checks():
    with pytest.raises(ShardplanError, match="kv_heads=5 must be a positive divisor of heads=32"):
        LlamaConfig(32, 4096, 32, 5, 14336, 128256, 8192)
    with pytest.raises(ShardplanError, match="seq=0 must be a positive integer"):
        LlamaConfig(32, 4096, 32, 8, 14336, 128256, 0)
    assert LLAMA3["llama3-405b"].head_dim == 128 and LLAMA3["llama3-70b"].head_dim == 128


def test_cli_builds_named_sizes_with_set(capsys):
    code = main(["ops", "--model", "llama3-8b", "--batch", "2", "--set", "layers=1", "--set", "seq=64", "-p", "8",
                 "--set", "attention=unfused"])
    out = capsys.readouterr().out
    assert code == 0
    names = [line.split()[0] for line in out.splitlines()[2:] if line.strip()]
    assert names == ["embed"] + [f"L1/{n}" for n in BLOCK] + ["ln_f", "fc", "softmax"]
    assert main(["models"]) == 0
    listing = capsys.readouterr().out
    for name in ("llama3-8b", "llama3-405b", "gpt3-175b", "megatron-1t"):
        assert f"\n{name} " in listing


def test_named_sizes_stay_out_of_the_zoo_wide_tests():
    assert not set(NAMED) & set(MODELS)
    table = models_table()
    assert "llama3-70b" in table and table.index("named sizes") > table.index("gpt ")


# ---------------------------------------------------------------------------------------------------------------
# parameter counts
# ---------------------------------------------------------------------------------------------------------------
# The exact counts of Table 3's shapes (Dubey et al. 2024), as the formula of LlamaConfig.params gives them; they
# round to the sizes the released checkpoints are quoted at: 8.03e9, 70.6e9, 405.9e9.
LLAMA3_COUNTS = {"llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496, "llama3-405b": 405_853_388_800}


@pytest.mark.parametrize("name", sorted(LLAMA3_COUNTS))
def test_llama3_parameter_counts_full_size(name):
    g = get_model(name, 1)  # the full model: the graph is symbolic, so this is cheap
    assert _weights(g) == LLAMA3[name].params() == LLAMA3_COUNTS[name]
    assert len(g) == 15 * LLAMA3[name].layers + 4  # 16 per block with attention="unfused"


def test_llama3_counts_round_to_the_quoted_sizes():
    assert round(LLAMA3_COUNTS["llama3-8b"] / 1e7) == 803
    assert round(LLAMA3_COUNTS["llama3-70b"] / 1e8) == 706
    assert round(LLAMA3_COUNTS["llama3-405b"] / 1e8) == 4059


def test_llama_params_formula_by_hand_for_8b():
    # per layer: q, o 4096^2 each; k, v 4096 x 1024 each; gate, up, down 4096 x 14336 each; two gains
    layer = 2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    assert LLAMA3["llama3-8b"].params() == 32 * layer + 2 * 128256 * 4096 + 4096


def test_gpt_named_sizes_match_the_papers():
    assert padded_vocab(GPT3_VOCAB) == 50304 and padded_vocab(51200) == 51200
    # the zoo's existing settings are the GPT-3 rows, unchanged
    assert GPT_SIZES["125m"] == {"layers": 12, "d_model": 768, "heads": 12, "seq": 2048, "vocab": 50304}
    assert GPT_SIZES["1.3b"] == {"layers": 24, "d_model": 2048, "heads": 16, "seq": 2048, "vocab": 50304}
    # Megatron's Table 1 counts are its own formula (SC'21 §5.1), to the digit printed
    for name, cfg in MEGATRON.items():
        assert round(gpt_published_params(cfg) / 1e9, 1) == MEGATRON_PARAMS[name] / 1e9, name
    # GPT-3's, with the unpadded vocabulary, within 2 % (Medium 355.9M and 2.7B 2.65B are the farthest; 13B is
    # 12.85B with d_model 5120, see gpt.py)
    for name, cfg in GPT3.items():
        p = gpt_published_params(GPTConfig(cfg.layers, cfg.d_model, cfg.heads, cfg.seq, GPT3_VOCAB))
        assert abs(p / GPT3_PARAMS[name] - 1) < 0.02, (name, p)
    assert set(GPT3) == set(GPT3_PARAMS) and set(MEGATRON) == set(MEGATRON_PARAMS)


@pytest.mark.parametrize("name", ["gpt3-125m", "gpt3-175b", "megatron-1.7b", "megatron-1t"])
def test_gpt_named_graph_weights_equal_the_config(name):
    g = get_model(name, 1)
    cfg = config_of(name)
    assert g.name == name and _weights(g) == cfg.params()
    assert g["L1/ffn1"].extents["d"] == cfg.d_model and g["L1/q"].extents["h"] == cfg.heads
    assert len(g) == 12 * cfg.layers + 4


# ---------------------------------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------------------------------
def _megatron_factored(b, s, l, h, v, recompute):
    if recompute:
        return 96 * b * s * l * h * h * (1 + Fraction(s, 6 * h) + Fraction(v, 16 * l * h))
    return 72 * b * s * l * h * h * (1 + Fraction(s, 6 * h) + Fraction(v, 12 * l * h))


def _llama_factored(cfg: LlamaConfig, b, s, recompute):
    h, l = cfg.d_model, cfg.layers
    inner = 1 + Fraction(cfg.kv_heads, cfg.heads) + Fraction(3 * cfg.d_ff, 2 * h) + Fraction(s, h)
    return (16 if recompute else 12) * b * s * l * h * h * inner + 6 * b * s * h * cfg.vocab


@pytest.mark.parametrize("recompute", [False, True])
def test_gpt_flops_are_megatrons_formula(recompute):
    for name, cfg in {**GPT3, **MEGATRON}.items():
        for b in (1, 7):
            f = model_flops(name, b, recompute=recompute)
            assert f == megatron_flops(b, cfg.seq, cfg.layers, cfg.d_model, cfg.vocab, recompute), name
            assert f == _megatron_factored(b, cfg.seq, cfg.layers, cfg.d_model, cfg.vocab, recompute), name
    # recomputation adds one forward of the layers: 24Bslh^2 + 4Bs^2lh
    b, s, l, h, v = 3, 2048, 48, 8192, 51200
    assert (megatron_flops(b, s, l, h, v, True) - megatron_flops(b, s, l, h, v, False)
            == 24 * b * s * l * h * h + 4 * b * s * s * l * h)


def test_megatron_39b_step_time_from_the_paper():
    # SC'21, Table 1: 39.1B at global batch 1536 on 512 GPUs runs 138 TFLOP/s per GPU; the step is F / (GPUs x
    # throughput) = 14.45 s (shared/data/published-a100.md)
    f = model_flops("megatron-39.1b", 1536, recompute=True)
    assert round(f / (512 * 138e12), 2) == 14.45


@pytest.mark.parametrize("recompute", [False, True])
def test_llama_flops_formula(recompute):
    for name, cfg in LLAMA3.items():
        for b, s in ((1, None), (5, 4096)):
            seq = cfg.seq if s is None else s
            assert model_flops(name, b, s, recompute=recompute) == _llama_factored(cfg, b, seq, recompute), name
    # GQA and SwiGLU are the only differences: with one query per key/value head and the SwiGLU terms replaced by
    # a 4h two-matrix MLP's (3f/(2h) -> 4) the factored form is Megatron's
    cfg = LlamaConfig(4, 512, 8, 8, 2048, 1024, 256)
    gpt_like = (_llama_factored(cfg, 2, 256, recompute)
                - (16 if recompute else 12) * 2 * 256 * 4 * 512**2 * (Fraction(3 * 2048, 2 * 512) - 4))
    assert gpt_like == megatron_flops(2, 256, 4, 512, 1024, recompute)


def test_llama3_flop_figures():
    # one sequence of 8192 tokens, per training step (no recomputation): the reported figures
    assert model_flops("llama3-8b", 1) == 474_422_087_516_160
    assert model_flops("llama3-70b", 1) == 3_943_913_849_094_144
    assert model_flops("llama3-405b", 1) == 21_507_478_231_449_600
    # the familiar approximation: 6 x (weights of the products) per token plus the attention's 12 l s h
    for name, cfg in LLAMA3.items():
        h, l, s = cfg.d_model, cfg.layers, cfg.seq
        products = cfg.params() - cfg.vocab * h - (2 * l + 1) * h  # no embedding lookup, no norm gains
        assert model_flops(name, 1) == s * (6 * products + 12 * l * s * h)


def _scores_softmax(g, recompute):
    """The 5 FLOPs per score the zoo fuses into the scores product (5/k per point of the b.h.s.t.k domain)."""
    total = Fraction(0)
    for op in g:
        if op.kind == "attn_scores":
            passes = (2 if recompute else 1) + len(op.grad_tensors)
            total += (Fraction(op.flops_per_point) - 2) * op.points * passes
    return total


@pytest.mark.parametrize("recompute", [False, True])
def test_gpt_formula_equals_the_graphs_matrix_products(recompute):
    b, l, h, heads, s, v = 2, 3, 64, 4, 32, 512
    g = get_model("gpt", b, layers=l, d_model=h, heads=heads, seq=s, vocab=v)
    mm = [op for op in g if is_matmul(op)]
    assert len(mm) == 8 * l + 1  # q, k, v, scores, context, out, ffn1, ffn2 per layer; fc
    got = graph_flops(g, mm, recompute=recompute)
    # the formula leaves out the softmax, which the graph fuses into the scores: 5 B H s^2 per layer and pass
    # (3 passes, 4 with recomputation)
    softmax = (4 if recompute else 3) * l * 5 * b * heads * s * s
    assert _scores_softmax(g, recompute) == softmax
    assert got - softmax == megatron_flops(b, s, l, h, v, recompute) == model_flops("gpt", b, s, recompute=recompute,
                                                                                    layers=l, d_model=h, heads=heads,
                                                                                    vocab=v)


@pytest.mark.parametrize("recompute", [False, True])
def test_llama_formula_equals_the_graphs_matrix_products(recompute):
    b = 3
    g = get_model("llama3-tiny", b, attention="unfused")  # FlashAttention's count: tests/models
    cfg = config_of("llama3-tiny")
    l, h, s, f, heads, v = cfg.layers, cfg.d_model, cfg.seq, cfg.d_ff, cfg.heads, cfg.vocab
    kv = cfg.kv_heads * cfg.head_dim
    mm = [op for op in g if is_matmul(op)]
    assert len(mm) == 9 * l + 1  # q, k, v, scores, context, out, gate, up, down per layer; fc
    assert all(len(op.grad_tensors) == 2 for op in mm)  # every product: the forward and two gradients
    softmax = (4 if recompute else 3) * l * 5 * b * heads * s * s
    assert _scores_softmax(g, recompute) == softmax
    assert graph_flops(g, mm, recompute=recompute) - softmax == model_flops("llama3-tiny", b, recompute=recompute)
    # every other FLOP of the graph, which the formula leaves out, operator kind by operator kind (x passes: the
    # forward, its recomputation, one per tensor with a gradient)
    fwd = 2 if recompute else 1
    per_layer = (2 * 4 * b * s * h * (fwd + 2)      # ln1, ln2: RMSNorm 4 FLOPs/element; gradients of x and gain
                 + 3 * b * s * h * (fwd + 1)        # rope_q over the h-wide queries
                 + 3 * b * s * kv * (fwd + 1)       # rope_k over the key/value width
                 + 4 * b * s * f * (fwd + 2)        # swiglu: SiLU(gate) * up, gradients of both
                 + 2 * b * s * h * (fwd + 2))       # add1, add2
    outside = (b * s * h * 2                        # embed: one element per output, the table's gradient
               + 4 * b * s * h * 3                  # ln_f
               + 5 * b * s * v * 2)                 # softmax cross-entropy, the logits' gradient
    rest = [op for op in g if not is_matmul(op)]
    assert graph_flops(g, rest, recompute=recompute) == l * per_layer + outside
    assert graph_flops(g, recompute=recompute) == model_flops("llama3-tiny", b, recompute=recompute) + softmax + \
        l * per_layer + outside


def test_operator_flops_is_the_cost_models_count():
    g = get_model("llama3-tiny", 2)
    op = g["L1/gate"]
    assert operator_flops(op) == 2 * op.points * 3 and operator_flops(op, forwards=2) == 2 * op.points * 4
    assert op.points == 2 * 128 * 768 * 256


def test_flops_refuse_what_has_no_formula():
    with pytest.raises(ShardplanError, match="no FLOP formula"):
        model_flops("alexnet", 8)
    with pytest.raises(ShardplanError, match="no size 'depth'"):
        model_flops("llama3-8b", 1, depth=2)
    with pytest.raises(ShardplanError, match="batch must be at least 1"):
        model_flops("llama3-8b", 0)
    with pytest.raises(ShardplanError, match="model must be a model name"):
        model_flops(42, 1)
    assert model_flops(LLAMA3["llama3-8b"], 2, layers=4) == model_flops("llama3-8b", 2, layers=4)


# ---------------------------------------------------------------------------------------------------------------
# pipeline units and planning
# ---------------------------------------------------------------------------------------------------------------
def test_llama_blocks_are_repeated_units():
    build = lambda batch: get_model("llama3-tiny", batch, layers=6)  # noqa: E731
    st = ModelStages(build, 8, preset("h100", 8), {"cutoff": 1}, periodic=True)
    g, units, sigs = st.graph(1)
    assert st.unit_names() == ["embed", "L1", "L2", "L3", "L4", "L5", "L6", "ln_f,fc,softmax"]
    assert all(len(units[u]) == 15 for u in range(1, 7))
    # L2 .. L6 are one signature (L1 reads the embedding, not a block: as in the zoo's GPT), a chain the periodic
    # certificate covers
    assert len(set(sigs[2:7])) == 1 and len(set(sigs)) == 4
    assert _longest_run(sigs, 0, len(sigs)) == (2, 7) and st._chained(0, 8, 2, 7, 1)
    # the whole model on 2 devices: costed by the certified linear extension, equal to the direct solve
    got = st.stage_cost(0, 8, 2, 1)
    assert st.periodic_certified == 1 and st.periodic_fallbacks == 0
    direct = ModelStages(build, 8, preset("h100", 8), {"cutoff": 1}).stage_cost(0, 8, 2, 1)
    assert got.forward + got.backward == pytest.approx(direct.forward + direct.backward, rel=1e-9)


def test_solve_plans_llama_on_h100():
    plan = shardplan.solve(get_model("llama3-tiny"), preset("h100", 8))
    assert plan.solution.optimal and np.isfinite(plan.cost) and plan.cost > 0
    assert set(plan.configs) == {op.name for op in plan.graph}
    for name, base in baseline_plans(plan.tables, model_spec("llama3-tiny").expert).items():
        assert plan.cost <= base.cost * (1 + 1e-9), name
