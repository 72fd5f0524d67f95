"""Megatron-Core / Transformer Engine saved activations (``runtime=megatron_te``): each operator's kept bytes
against a hand derivation (docs/memory.md, "Published H100 recipes' memory")."""

from __future__ import annotations

import pytest

from shardplan.cost.memory import te_saved
from shardplan.errors import ShardplanError
from shardplan.machine import preset
from shardplan.models import get_model
from shardplan.recipe import Recipe, cost_recipe, fp8_names, fused_gqa_qkv

B, S, H, HEADS, KV, F, V = 1, 32, 64, 4, 2, 128, 256  # per micro-batch: one sequence
HD = H // HEADS


def _llama(batch: int):
    return get_model("llama3-8b", batch, layers=1, d_model=H, heads=HEADS, kv_heads=KV, d_ff=F, vocab=V, seq=S)


def _acts(recipe: str) -> dict[str, float]:
    """Per operator: the activation bytes of its chosen row (one micro-batch) on 2 H100s."""
    plan = cost_recipe(_llama, preset("h100", 2), recipe)
    mc = plan.detail.memory_choices
    ops = plan.detail.tables.graph.operators
    return {op.name: float(mc.choice_tables[i].activation_bytes[mc.choices[i]]) for i, op in enumerate(ops)}


def test_llama_saved_fp8():
    g = te_saved(_llama(2), fp8=fp8_names(_llama(2)))
    saved = {op.name: op.saved for op in g.operators}
    lse = 4 / (2 * HD)  # FlashAttention's fp32 log-sum-exp per query and head, in tiles of its bf16 output
    assert saved == {"embed": 1.0, "L1/ln1": 0.5, "L1/q": 0.0, "L1/k": 0.0, "L1/v": 1.0, "L1/rope_q": 1.0,
                     "L1/rope_k": 1.0, "L1/attention": 1.0 + lse + 0.5, "L1/out": 0.0, "L1/add1": 1.0,
                     "L1/ln2": 0.5, "L1/gate": 1.0, "L1/up": 1.0, "L1/swiglu": 0.5, "L1/down": 0.0, "L1/add2": 1.0,
                     "ln_f": 1.0, "fc": 1.0, "softmax": 1.0}
    assert fp8_names(_llama(2)) == {"L1/q", "L1/k", "L1/v", "L1/out", "L1/gate", "L1/up", "L1/down"}


def test_llama_saved_bf16():
    saved = {op.name: op.saved for op in te_saved(_llama(2)).operators}
    assert saved["L1/ln1"] == saved["L1/ln2"] == saved["L1/swiglu"] == 1.0  # read by bf16 products
    assert saved["L1/q"] == saved["L1/k"] == saved["L1/out"] == saved["L1/down"] == 0.0  # read by rope / add only
    assert saved["L1/attention"] == 1.0 + 4 / (2 * HD)


def test_gpt_fused_gelu_keeps_its_pre_activation():
    g = get_model("gpt3-175b", 2, layers=1, d_model=64, heads=4, d_ff=256, vocab=128, seq=16, attention="flash")
    saved = {op.name: op.saved for op in te_saved(g, fp8_names(g)).operators}
    assert saved["L1/ffn1"] == 1.5  # bias-GELU's input in bf16 + the FP8 copy of its output for ffn2
    assert saved["L1/ffn2"] == saved["L1/out"] == 0.0
    assert saved["L1/q"] == saved["L1/k"] == saved["L1/v"] == 1.0  # FlashAttention reads them
    assert saved["L1/ln1"] == saved["L1/ln2"] == 0.5


def test_exact_bytes_tp2_sp_fp8():
    """tp=2 with sequence parallelism, FP8: the bytes each operator keeps for one micro-batch, by hand."""
    t, s2, s1 = 2, 2, 1  # tensor group; bytes of a bf16 and an FP8 element
    a = _acts("tp=2,sp=true,mbs=1,gbs=2,zero=1,precision=fp8,runtime=megatron_te")
    hand = {
        "L1/ln1": B * S // t * H * s1,  # TE keeps the FP8 copy of its local sequence shard (re-gathered backward)
        "L1/out": 0, "L1/down": 0,  # nothing reads them backward; no FP8 copy of their own
        "L1/qkv": B * S * KV // t * HD * s2,  # Megatron-Core's fused linear_qkv: only its v part is read backward
        "L1/rope_q": B * S * HEADS // t * HD * s2,
        "L1/rope_k": B * S * KV // t * HD * s2,
        "L1/attention": B * S * HEADS // t * HD * s2 + B * S * HEADS // t * 4 + B * S * HEADS // t * HD * s1,
        "L1/add1": B * S // t * H * s2, "L1/ln2": B * S // t * H * s1,
        "L1/gate": B * S * F // t * s2, "L1/up": B * S * F // t * s2, "L1/swiglu": B * S * F // t * s1,
        "L1/add2": B * S // t * H * s2, "ln_f": B * S // t * H * s2, "fc": B * S * V // t * s2,
    }
    assert {k: a[k] for k in hand} == {k: float(v) for k, v in hand.items()}
    b = _acts("tp=2,sp=true,mbs=1,gbs=2,zero=1,precision=fp8")  # shardplan's runtime: unchanged rule
    assert b["L1/q"] == B * S * HEADS // t * HD * s2 + B * S * H * s1  # its output and its own gathered FP8 input


def test_output_layer_stays_bf16():
    plan = cost_recipe(_llama, preset("h100", 2), "tp=2,sp=true,mbs=1,gbs=2,zero=1,precision=fp8,runtime=megatron_te")
    mc, ops = plan.detail.memory_choices, plan.detail.tables.graph.operators
    fp8 = {op.name for i, op in enumerate(ops) if mc.fp8(i)}
    assert fp8 == fp8_names(fused_gqa_qkv(_llama(2)))  # the block products, q, k and v as one linear_qkv
    fc = next(i for i, op in enumerate(ops) if op.name == "fc")
    w = V * H // 2  # the head's tile: vocabulary split over the tensor group
    assert float(mc.choice_tables[fc].state_bytes[mc.choices[fc]]) == w * (2 + 2 + 12)  # no FP8 weight cache (zero-1 over dp=1)


def test_selective_recompute_with_fp8_is_refused():
    with pytest.raises(ShardplanError, match="not expressible"):
        cost_recipe(_llama, preset("h100", 2), "tp=2,sp=true,mbs=1,gbs=2,precision=fp8,recompute=selective,"
                                               "runtime=megatron_te")


def test_full_recompute_leaves_blocks_as_given():
    g = _llama(2)
    kept = te_saved(g, fp8_names(g), keep=frozenset(op.name for op in g.operators if op.name.startswith("L1/")))
    assert all(op.saved == o.saved for op, o in zip(kept.operators, g.operators) if op.name.startswith("L1/"))
    cost_recipe(_llama, preset("h100", 2), "tp=2,sp=true,mbs=1,gbs=2,precision=fp8,recompute=full,"
                                           "runtime=megatron_te")


def test_recipe_text():
    r = Recipe.parse("tp=2,runtime=megatron-te")
    assert r.runtime == "megatron_te" and str(r) == "tp=2,runtime=megatron_te"
    with pytest.raises(ShardplanError, match="runtime"):
        Recipe.parse("tp=2,runtime=deepspeed")


def test_recompute_n_keeps_only_the_recomputed_blocks():
    from shardplan.recipe import recomputed_blocks, runtime_graph

    g = get_model("llama3-8b", 2, layers=4, d_model=H, heads=HEADS, kv_heads=KV, d_ff=F, vocab=V, seq=S)
    assert recomputed_blocks(g, Recipe.parse("recompute=1")) == {"L1"}
    assert recomputed_blocks(g, Recipe.parse("pp=2,recompute=1")) == {"L1", "L3"}  # the first block of each stage
    assert recomputed_blocks(g, Recipe.parse("pp=2,vp=2,recompute=1")) == {"L1", "L2", "L3", "L4"}
    r = runtime_graph(g, Recipe.parse("pp=2,recompute=1,precision=fp8,runtime=megatron_te"), 2)
    saved = {op.name: op.saved for op in r.operators}
    assert saved["L1/out"] == saved["L3/out"] == 1.0 and saved["L1/ln1"] == 1.0  # recomputing: as given
    assert saved["L2/out"] == saved["L4/out"] == 0.0 and saved["L2/ln1"] == 0.5
