"""The H100 fidelity table (benchmarks/bench_fidelity_h100.py): every row's recipe is one the grammar reads and
that fits its GPU count, the measured steps follow from the published numbers, and rows cost through
``cost_recipe`` as the benchmark records them."""

from __future__ import annotations

from fractions import Fraction

import pytest

from benchmarks.bench_fidelity_h100 import (attention_flops, cost_row, measured, one_program, rank_orders, rows,
                                            step_terms)
from benchmarks.fidelity_common import compare_ranks, kendall_tau, ranks
from shardplan.models.flops import model_flops
from shardplan.recipe import Recipe

ROWS = {r.name: r for r in rows()}


def test_rows_are_unique_and_every_recipe_parses_and_fits_its_gpus():
    assert len(ROWS) == len(rows()) == 14
    for r in ROWS.values():
        for text in (r.recipe, *r.variants, *((r.published_recipe,) if r.published_recipe else ())):
            rec = Recipe.parse(text)
            assert rec.gbs == r.gbs, r.name
            mp = rec.tp * rec.cp * rec.pp
            assert r.gpus % mp == 0, r.name
            dp = r.gpus // mp
            assert r.gbs % (dp * rec.mbs) == 0, r.name  # whole micro-batches per step
        assert r.source and r.assumptions, r.name
        assert r.precision == ("bf16" if r.experiment == "llama3-table4" else "fp8")
        assert ("precision=fp8" in r.recipe) == (r.precision == "fp8")


def test_measured_step_is_global_tokens_over_published_throughput():
    r = ROWS["nemo2407-llama3-70b-64"]  # 128 sequences of 8,192 tokens, 1,533 tokens/s/GPU on 64 GPUs
    m = measured(r)
    assert m["measured_seconds"] == 128 * 8192 / (1533 * 64)
    assert m["publisher_flops_per_step"] == 738e12 * 64 * m["measured_seconds"]
    # NeMo 24.07's model FLOPs are the zoo's (whole s x s scores): the published TFLOP/s agree to 0.1 %
    for name in ("nemo2407-gpt3-175b-128", "nemo2407-llama2-7b-8", "nemo2407-llama3-8b-8", "nemo2407-llama3-70b-64"):
        assert abs(measured(ROWS[name])["publisher_over_zoo_flops"] - 1) < 1e-3, name


def test_megatron_bridge_counts_causal_attention_at_half():
    """Megatron-Bridge 25.11's model TFLOP/s for Llama 3 8B are the zoo's FLOPs less half the attention scores'
    and values' products (to 0.1 %): the FLOP definition changed between the NVIDIA releases."""
    r = ROWS["mb2511-llama3-8b-8"]
    zoo = model_flops("llama3-8b", 128)
    half = 1 - Fraction(attention_flops("llama3-8b", 128, {}), 2 * zoo)
    assert abs(measured(r)["publisher_over_zoo_flops"] / float(half) - 1) < 1e-3


def test_llama3_rows_take_the_step_from_model_flops():
    r = ROWS["l3-405b-8192"]  # Table 4: 8,192 GPUs at 430 TFLOP/s, 2,048 sequences of 8,192 tokens
    m = measured(r)
    assert m["measured_seconds"] == model_flops("llama3-405b", 2048) / (8192 * 430e12)
    causal = model_flops("llama3-405b", 2048) - attention_flops("llama3-405b", 2048, {}) // 2
    assert m["measured_seconds_causal_flops"] == causal / (8192 * 430e12)
    cp16 = measured(ROWS["l3-405b-16384-cp16"])  # 128 sequences of 131,072 tokens
    assert cp16["zoo_flops_per_step"] == model_flops("llama3-405b", 128, seq=131072)


def test_one_row_costs_as_recorded():
    out = cost_row(ROWS["nemo2407-llama2-70b-64"])
    assert out["status"] == "costed" and out["schedule"] == "interleaved" and out["chunks"] == 20
    assert out["ratio"] == out["predicted_seconds"] / out["measured_seconds"]
    assert out["predicted_tflops_per_gpu"] == pytest.approx(759 * out["measured_seconds"] / out["predicted_seconds"])
    assert out["micro_batches"] == 32  # 128 sequences over data-parallel 4, one per micro-batch


def test_llama31_405b_costs_as_published_with_the_nearest_form_beside_it():
    """Megatron-Bridge's 405B run as it ran (interleaved with the embedding and the loss counted as layers,
    sequence parallelism with context parallelism), the former nearest form as its variant."""
    out = cost_row(ROWS["mb2511-llama31-405b-1024"])
    assert "published_recipe" not in out and out["status"] == "costed"
    assert out["schedule"] == "interleaved" and out["chunks"] == 8 and out["micro_batches"] == 64
    assert "embedding_as_layer=true" in out["recipe"] and "sp=true" in out["recipe"]
    (nearest, v), = out["variants"].items()
    assert "vp=" not in nearest and v["predicted_seconds"] > out["predicted_seconds"]


def test_rank_helpers():
    assert ranks([1.0, 3.0, 2.0]) == [3, 1, 2]
    assert kendall_tau([1.0, 2.0, 3.0], [1.0, 2.0, 3.0]) == 1.0
    assert kendall_tau([1.0, 2.0, 3.0], [3.0, 2.0, 1.0]) == -1.0
    a = {"row": "a", "status": "costed", "m": 2.0, "p": 1.0}
    b = {"row": "b", "status": "costed", "m": 1.0, "p": 2.0}
    got = compare_ranks([a, b], "m", "p")
    assert got["measured_rank"] == [1, 2] and got["predicted_rank"] == [2, 1] and got["kendall_tau"] == -1.0
    assert compare_ranks([a, {"row": "c", "status": "refused"}])["compared"] is False


def test_rank_orders_need_every_row_of_an_experiment():
    done = [{"row": n, "status": "costed", "measured_zoo_tflops_per_gpu": t, "predicted_zoo_tflops_per_gpu": t}
            for n, t in (("nemo2407-gpt3-175b-128", 1.0), ("nemo2407-gpt3-175b-512", 2.0))]
    got = rank_orders(done)
    assert list(got) == ["nemo-24.07 gpt3-175b: 128 vs 512 GPUs"] and got[list(got)[0]]["same_order"]


def test_nvidia_context_groups_run_megatron_cores_ring():
    """Every NVIDIA row with a context group runs the p2p ring (Megatron-Core 0.8 of NeMo 24.07 had no other;
    cp_comm_type's default since 0.10 is p2p), the Llama 3 paper's all-gather stays all-gather."""
    for r in ROWS.values():
        for text in (r.recipe, *r.variants):
            rec = Recipe.parse(text)
            if rec.cp > 1:
                assert rec.cp_algo == ("allgather" if r.experiment == "llama3-table4" else "ring"), (r.name, text)


def test_megatron_bridge_25_11_llama3_8b_reads_its_release_source():
    """The 25.11 Llama 3 8B row is Megatron-Bridge v0.2.0's H100 FP8-CS recipe (CP 1, 5 blocks recomputed, the
    distributed optimizer); the published table's FSDP reading is kept as variants, without and with recompute."""
    r = ROWS["mb2511-llama3-8b-8"]
    rec = Recipe.parse(r.recipe)
    assert (rec.tp, rec.cp, rec.pp, rec.zero, rec.recompute) == (1, 1, 1, 1, 5)
    assert [Recipe.parse(v).zero for v in r.variants] == [3, 3]
    assert [Recipe.parse(v).recompute for v in r.variants] == ["none", 5]


def test_nvidia_fp8_recipes_as_their_sources_set_them():
    """NeMo 24.07 ran delayed scaling with bf16 weights (launcher 24.07); Megatron-Bridge 25.11 / 26.02's H100 FP8
    configuration is fp8_cs: current (tensorwise) scaling with fp8_param_gather, variants included."""
    for r in ROWS.values():
        for text in (r.recipe, *r.variants):
            rec = Recipe.parse(text)
            mb = r.experiment == "megatron-bridge"
            assert (rec.fp8_params, rec.fp8_scaling) == ((True, "current") if mb else (False, "delayed")), (r.name, text)


def test_one_program_drops_the_pipeline_only():
    text, pp = one_program(ROWS["mb2511-llama31-405b-1024"].recipe)
    assert pp == 8 and text == ("tp=8,cp=2,cp_algo=ring,mbs=1,gbs=512,sp=true,zero=1,overlap=grad_reduce+tp_comm,"
                                "precision=fp8,fp8_params=true,fp8_scaling=current,runtime=megatron_te")
    assert one_program(ROWS["nemo2407-llama2-7b-8"].recipe) == (ROWS["nemo2407-llama2-7b-8"].recipe, 1)


def test_step_terms_add_up_to_the_step_and_name_each_kind():
    """One program's terms (FP8 and bf16 products, attention, each memory-bound kind, casts, collectives,
    optimizer) add up to its predicted step; Llama 3 8B's products are FP8 but its output layer's (bf16)."""
    from benchmarks.bench_fidelity_h100 import _builder
    from shardplan.machine import preset
    from shardplan.recipe import cost_recipe

    r = ROWS["nemo2407-llama3-8b-8"]
    plan = cost_recipe(_builder(r.model, {}), preset("h100", 8), r.recipe)
    got = step_terms(plan.detail)
    assert sum(got.values()) == pytest.approx(plan.step_time, rel=1e-12)
    assert {"gemm_fp8", "gemm_bf16", "attention", "fp8_casts", "norms", "rotary", "swiglu_gelu", "residual_adds",
            "cross_entropy", "optimizer", "weight_sync"} <= set(got)
    assert "other_elementwise" not in got and "compute" not in got
    assert got["gemm_fp8"] > got["attention"] > got["gemm_bf16"] > got["cross_entropy"]


def test_llama3_8b_rows_of_two_releases_share_every_per_token_term():
    """The basis of docs/fidelity.md's finding on NeMo 24.07's Llama 3 8B: 24.07 (CP 2, 32 micro-batches of 4,096
    tokens per GPU) and 25.11 (CP 1, 16 of 8,192, 5 blocks recomputed) are charged the same products, attention
    and memory-bound operators per step; they differ by 25.11's recomputation, 24.07's ring and their FP8 recipes:
    delayed casts cost 4 bytes per element of every operand (A activation elements, W = 6.98e9 FP8 weights), 25.11's
    current scaling with FP8 parameters 6 per activation element and 2 per weight (its transpose), so
    25.11's casts = 1.5 · 24.07's - 4 W / HBM, less two of the three casts of each block's attention input X (6
    bytes per element): without a context group 25.11's q, k and v are Megatron-Core's one linear_qkv
    (runtime_graph), whose input is cast once; its products' FLOPs are the same, their seconds within 0.1 %.
    25.11's row fits its 80 GB with the weights in FP8 only."""
    from benchmarks.bench_fidelity_h100 import _builder
    from shardplan.machine import preset
    from shardplan.recipe import cost_recipe

    plans = {name: cost_recipe(_builder("llama3-8b", {}), preset("h100", 8), ROWS[name].recipe)
             for name in ("nemo2407-llama3-8b-8", "mb2511-llama3-8b-8")}
    old, new = (step_terms(plans[n].detail) for n in ("nemo2407-llama3-8b-8", "mb2511-llama3-8b-8"))
    for key in ("gemm_bf16", "attention", "swiglu_gelu", "residual_adds", "norms", "rotary", "cross_entropy"):
        assert old[key] == pytest.approx(new[key], rel=1e-6), key
    assert old["gemm_fp8"] == pytest.approx(new["gemm_fp8"], rel=1e-3)
    fp8_weights = 32 * 4096 * (2 * 4096 + 2 * 1024 + 3 * 14336)  # q, out; k, v; gate, up, down: per block
    attn_input = 16 * 8192 * 4096 * 32  # 16 sequences per GPU, 32 blocks
    hbm = preset("h100", 8).hbm_bandwidth
    assert new["fp8_casts"] == pytest.approx(1.5 * old["fp8_casts"] - 4 * fp8_weights / hbm
                                             - 2 * 6 * attn_input / hbm, rel=1e-9)
    assert "recompute" in new and "recompute" not in old
    assert old["redistribution"] > 0 and new.get("redistribution", 0.0) == 0.0
    assert plans["mb2511-llama3-8b-8"].memory["peak_bytes"] < 80e9
