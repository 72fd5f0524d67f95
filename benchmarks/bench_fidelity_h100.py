"""Fidelity on H100: published H100 training runs costed as published through :func:`shardplan.recipe.cost_recipe`.

Sources (each row's ``source`` names its table, version and address):

* NVIDIA NeMo, performance summary of the NeMo 24.07 container, DGX-H100, FP8 pre-training (GPT-3 175B on 128 and
  512 GPUs, Llama 2 7B / 70B, Llama 3 8B / 70B): the table of the NeMo Framework user guide, read from its source
  ``docs/source/performance/performance_summary.md`` of NVIDIA/NeMo at commit 070a0bb;
* NVIDIA Megatron-Bridge, performance summary archive, DGX-H100 rows of the 25.11 and 26.02 NeMo containers (FP8:
  Llama 3 8B / 70B, Llama 3.1 405B), read from ``docs/performance-summary-archive.md`` of
  NVIDIA-NeMo/Megatron-Bridge at commit 0a25f91 (the page https://docs.nvidia.com/nemo/megatron-bridge/latest/
  performance-summary-archive.html); the DGX-H100 rows of these summaries are all FP8, no BF16 dense row exists;
* Dubey et al. 2024, "The Llama 3 Herd of Models" (arXiv 2407.21783), Table 4: Llama 3 405B in BF16 on 8,192 and
  16,384 H100 (the same numbers on P. Balaji's SC'24 slide).

Measured step: global tokens / (tokens per second per GPU × GPUs) where tokens/s/GPU is published (the NVIDIA
rows); for Llama 3 (only TFLOP/s per GPU published) the zoo's model FLOPs (:func:`shardplan.models.flops.model_flops`,
no recomputation, the whole s × s score matrix counted) over GPUs × TFLOP/s; the reading with causal attention
counted at half (``measured_seconds_causal_flops``) is recorded beside it. The publisher's FLOPs per step are
published TFLOP/s × GPUs × measured step (NVIDIA's definition of model TFLOP/s), recorded with their ratio to the
zoo's formula; predicted TFLOP/s per GPU uses the publisher's FLOPs, so predicted ÷ published TFLOP/s is the inverse
of the step ratio.

Each row is costed on ``preset("h100", GPUs)`` unmodified (no machine constant is tuned here), its attention core
under a balanced causal mask (:func:`shardplan.recipe.causal_attention`: Megatron-LM, Transformer Engine and Llama 3
train causal language models), with what the sources leave open and how it was filled in ``assumptions``. A recipe
the grammar refuses is recorded with its refusal (``published_recipe``, ``refusal``) and costed in the nearest exact
form only when the difference is stated. Rank orders within each experiment (one model at two GPU counts or two
batches; three configurations of Llama 3 70B on 64 GPUs) are compared with the published order by TFLOP/s per GPU
(:mod:`benchmarks.fidelity_common`). A row still running after ``--row-limit`` seconds (default 180) is recorded as
skipped. Every row records its step by term (``terms``: :func:`step_terms` of the recipe, or of its layouts as one
program on a stage's GPUs when it is a pipeline), so the terms' shares compare between hidden sizes; a Llama row with
tensor parallelism also the seconds its separate k / v and up products spend on their input's collectives
(``terms["sibling_collectives"]``: what one fused linear_qkv / linear_fc1 would not repeat).
docs/fidelity.md ("H100: published runs") states, per row, what the model does not explain.

Run: ``PYTHONPATH=. python benchmarks/bench_fidelity_h100.py [--rows l3-405b-8192,nemo2407] [--out
benchmarks/results/fidelity_h100.json] [--plot benchmarks/results/fidelity_h100.png]``
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks import fidelity_common
from benchmarks.fidelity_common import compare_ranks
from benchmarks.limits import call_limited

NEMO_2407 = ("NeMo 24.07 container, DGX-H100, FP8 pre-training table: https://github.com/NVIDIA/NeMo/blob/"
             "070a0bb168d405d653b9734c0017cf5078e77c0d/docs/source/performance/performance_summary.md")
MB_ARCHIVE = ("https://docs.nvidia.com/nemo/megatron-bridge/latest/performance-summary-archive.html (source: "
              "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md at 0a25f911b2ed)")
MB_2511 = f"Megatron-Bridge performance summary, 25.11 NeMo container, System DGX-H100, FP8-CS: {MB_ARCHIVE}"
MB_2602 = f"Megatron-Bridge performance summary, 26.02 NeMo container, DGX-H100 row, FP8: {MB_ARCHIVE}"
LLAMA3_PAPER = ("Dubey et al. 2024, 'The Llama 3 Herd of Models', arXiv 2407.21783 (v3), Table 4 (scaling "
                "configurations of Llama 3 405B pre-training); the same GPUs, TP, CP, PP, tokens per batch and TFLOP/s "
                "on P. Balaji's SC'24 slide as transcribed at https://glennklockwood.com/garden/llama-3.1")

# What every NVIDIA row ran, from the Megatron-Bridge performance recipes (scripts/performance/configs/llama/*,
# src/megatron/bridge/recipes/llama/h100/llama3.py) and NeMo's llama/gpt pre-training recipes of the same time.
NV_COMMON = (
    "distributed optimizer (use_distributed_optimizer=True: ZeRO-1, zero=1), overlap_grad_reduce=True "
    "(overlap=grad_reduce); overlap_param_gather=True has no counterpart at zero=1 (the recipe grammar refuses "
    "overlap=param_gather below ZeRO-3): the model charges the distributed optimizer's all-gather of the "
    "updated weights in full, not hidden behind the next step's forward",
    "fp32 main parameters, gradients and Adam moments (optimizer main_params_dtype / exp_avg_dtype float32): "
    "the 16 bytes of weight state per parameter of precision=mixed (fp8 implies it)",
    "Transformer Engine layers with its fused attention (flash), causal mask (causal_attention, balanced over "
    "the context group as Megatron-LM's load-balanced CP splits the sequence in 2·cp chunks)",
    "no activation recomputation unless the row says so (recipes' recompute_granularity None)",
    "runtime=megatron_te: the saved activations Megatron-Core with Transformer Engine keeps (TE linears keep the "
    "FP8 copy of their input's local shard, once per fused linear; nothing keeps the row-parallel outputs or the "
    "pre-RoPE q / k) and FP8 only in the blocks (the output layer is Megatron-Core's ColumnParallelLinear): "
    "docs/memory.md, \"Published H100 recipes' memory\"; without a context group the attention's q, k and v are "
    "Megatron-Core's one linear_qkv (megatron/core/transformer/attention.py at 338af51: [sq, b, ng, (np/ng + 2) hn]; "
    "shardplan.recipe.fused_gqa_qkv), with one the zoo's three products (docs/fidelity.md, \"Megatron-Core's fused "
    "linear_qkv\")",
)
SP_NOTE = ("tensor parallelism > 1: sequence_parallel=True and TP communication overlap (tp_comm_overlap with "
           "userbuffers, bulk and pipelined overlaps of the all-gathers / reduce-scatters) as in NeMo's and "
           "Megatron-Bridge's recipes: sp=true, overlap=tp_comm")
FP8_NOTE = ("precision=fp8: Transformer Engine runs every linear layer's three products in FP8 (E4M3 forward, E5M2 "
            "gradients); the model charges them at fp8_flops (1,979 TFLOP/s) × the profile's fp8_efficiency "
            "(0.65, the median of torch._scaled_mm over 4 shapes measured on the same H100, after the tile and wave "
            "utilisation; the bf16 products' flops_efficiency is 0.69) and the casts and transposes of the row's "
            "scaling (fp8_scaling: delayed, or current with its amax pass over each operand before the cast); "
            "attention stays bf16 in both (TE's FP8 dot-product attention off by default)")
FP8_DELAYED_NOTE = ("NeMo 24.07's FP8 recipe: delayed scaling (fp8_hybrid, fp8_amax_history_len 1024, "
                    "fp8_amax_compute_algo max) and no FP8 parameters (no fp8_params key in the launcher's model "
                    "configuration or its H100 FP8 example scripts): fp8_scaling=delayed, weights in bf16 beside TE's "
                    "FP8 cache. NeMo-Framework-Launcher tag 24.07 (8325688d8345), launcher_scripts/conf/training/"
                    "{llama/*.yaml, gpt3/175b.yaml}, examples/training/{llama,gpt}/h100/*_fp8*.sh")
FP8_CS_NOTE = ("Megatron-Bridge's FP8 recipe on H100 (fp8_cs, the only FP8 workload configuration for H100 in "
               "v0.2.0 (25.11, tag commit 7af9601c9da7) and v0.3.0 (26.02, 21b02e0cfb2f)): "
               "scripts/performance/utils/helpers.py (v0.3.0: utils/precision.py) get_precision_config('fp8_cs') = "
               "src/megatron/bridge/training/mixed_precision.py bf16_with_fp8_current_scaling_mixed() (fp8 hybrid, "
               "fp8_recipe tensorwise, fp8_param_gather True) with first_last_layers_bf16 False: "
               "fp8_scaling=current (each operand's amax read before its cast), fp8_params=true (the blocks' "
               "linear weights stored in FP8 with their transpose, no bf16 copy; the distributed optimizer's "
               "gather of the updated weights in FP8; the fp32 master shard cast to FP8 in the optimizer step)")
MB_FP8_KEYS = ",fp8_params=true,fp8_scaling=current"
TE_DGRAD_NOTE = (
    "Transformer Engine's column-parallel linears (Linear and LayerNormLinear, parallel_mode 'column': "
    "Megatron-Core's linear_qkv and linear_fc1) start the reduction of their input gradient asynchronously "
    "(allreduce, or reduce_scatter_along_first_dim under sequence parallelism, async_op=True) right after the "
    "dgrad GEMM, compute the wgrad GEMM meanwhile and wait at the end of backward: "
    "transformer_engine/pytorch/module/{linear,layernorm_linear}.py _Linear.backward / _LayerNormLinear.backward "
    "in TE 7d576ed (1.8.0.dev, NeMo 24.07), release_v2.9 (Megatron-Bridge v0.2.0, 25.11) and 5671fd3 "
    "(Megatron-Bridge v0.3.0, 26.02); with userbuffers (tp_comm_overlap) the reduce-scatter runs in the "
    "userbuffers' bulk or pipelined overlap instead. Without overlap=tp_comm: overlap=...+dgrad "
    "(Machine.overlap_dgrad, the collective charged max(C - W, 0) beside the weight-gradient pass W); with "
    "overlap=tp_comm the recipes keep theirs (adding dgrad there changes no row's step: "
    "docs/fidelity.md, \"Transformer Engine's input-gradient overlap\")")
CP_NOTE = ("context parallelism: Megatron-Core's p2p ring (cp_algo=ring). NeMo of the 24.07 container pins "
           "Megatron-LM 338af51 (2024-07-23, before core_v0.8.0; NVIDIA/NeMo Dockerfile.ci at r2.0.0rc1), whose "
           "TEDotProductAttention hands Transformer Engine only cp_group, cp_global_ranks and cp_stream, i.e. TE's "
           "ring attention (megatron/core/transformer/custom_layers/transformer_engine.py); cp_comm_type (p2p, "
           "all_gather, a2a) first appears in core_v0.10.0 with p2p the default, and neither Megatron-Bridge's Llama "
           "recipes nor its performance scripts set it (v0.2.0)")
CAUSAL_FLOPS = ("model TFLOP/s: NVIDIA's published value is kept as the publisher's FLOPs (published TFLOP/s × GPUs "
                "× measured step); its ratio to the zoo's formula (whole s × s scores, no recomputation) is "
                "recorded (publisher_over_zoo_flops)")


MB2511_8B_SOURCE = (
    "the 25.11 container's recipe, read from Megatron-Bridge v0.2.0 (tag commit 7af9601c9da7, 2025-11-26), "
    "scripts/performance/configs/llama3/workload_base_configs.py: LLAMA3_8B_H100_FP8_CS_BASE_CONFIG = TP 1, PP 1, "
    "context_parallel_size=1, recompute_num_layers=5 (helpers.set_recompute_overrides: recompute_granularity full, "
    "recompute_method block: recompute=5), no use_megatron_fsdp, so the recipe's distributed optimizer with "
    "overlap_grad_reduce and overlap_param_gather (src/megatron/bridge/recipes/llama/llama3.py: zero=1, "
    "overlap=grad_reduce); set on the r0.2.0 branch by 8aed9a229 (2025-11-21), which replaced use_megatron_fsdp=True. "
    "The performance table (first published 97ad8cc6f, 2025-12-04) gives FSDP = 1 (edited to 8 by cfeddcd94, "
    "2026-03-21) and GA 16: the variants are that reading (zero=3 with its gathers overlapped) without and with the "
    "5 recomputed blocks")


@dataclass(frozen=True)
class Row:
    """One published H100 run: the zoo model and its sizes, GPUs, the recipe costed, the published throughput."""

    name: str
    experiment: str
    source: str
    model: str
    gpus: int
    recipe: str
    gbs: int
    seq: int
    tokens_per_sec_per_gpu: float | None
    tflops_per_gpu: float
    sizes: tuple[tuple[str, Any], ...] = ()
    assumptions: tuple[str, ...] = ()
    published_recipe: str | None = None  # the recipe as published when the grammar refuses it (costed: ``recipe``)
    variants: tuple[str, ...] = ()  # other readings of the same run, costed beside it (not ranked)
    precision: str = "fp8"


LLAMA2_7B = (("kv_heads", 32), ("d_ff", 11008), ("vocab", 32000), ("seq", 4096))  # Touvron et al. 2023, Table 1
LLAMA2_70B = (("vocab", 32000), ("seq", 4096))  # 80 layers, 8192, 64 heads, 8 KV heads, 28,672: llama3-70b's sizes


def _nv(recipe: str, tp: int, fp8_cs: bool = False) -> tuple[str, tuple[str, ...]]:
    """An NVIDIA recipe with the common keys (ZeRO-1, overlapped gradient reduction, FP8) and its notes; a context
    group (``cp=N``) runs Megatron-Core's p2p ring (``cp_algo=ring``, :data:`CP_NOTE`). ``fp8_cs``: Megatron-Bridge's
    FP8 recipe (current scaling, FP8 parameters: :data:`MB_FP8_KEYS`, :data:`FP8_CS_NOTE`), else NeMo 24.07's
    (delayed scaling, bf16 parameters: :data:`FP8_DELAYED_NOTE`)."""
    tp_keys = ",sp=true" if tp > 1 else ""
    overlap = "grad_reduce+tp_comm" if tp > 1 else "grad_reduce"
    ring = re.search(r"(^|,)cp=\d+", recipe) is not None
    if ring:
        recipe = re.sub(r"((?:^|,)cp=\d+)", r"\1,cp_algo=ring", recipe, count=1)
    fp8 = (FP8_NOTE, FP8_CS_NOTE if fp8_cs else FP8_DELAYED_NOTE)
    notes = NV_COMMON + ((SP_NOTE, TE_DGRAD_NOTE) if tp > 1 else ()) + ((CP_NOTE,) if ring else ()) + fp8 + (CAUSAL_FLOPS,)
    keys = MB_FP8_KEYS if fp8_cs else ""
    return f"{recipe}{tp_keys},zero=1,overlap={overlap},precision=fp8{keys},runtime=megatron_te", notes


def rows() -> list[Row]:
    """Every published H100 row (sources in the module docstring; each row's ``source`` names its table)."""
    out: list[Row] = []
    # NeMo 24.07, DGX-H100, FP8 (model, GPUs, GBS, MBS, seq, TP, PP, CP, VP, tokens/s/GPU, TFLOP/s/GPU)
    for name, model, sizes, gpus, gbs, mbs, seq, tp, pp, cp, vp, tok, tfl in (
            ("nemo2407-gpt3-175b-128", "gpt3-175b", (("attention", "flash"),), 128, 256, 1, 2048, 4, 8, 1, 6, 726, 782),
            ("nemo2407-gpt3-175b-512", "gpt3-175b", (("attention", "flash"),), 512, 2048, 2, 2048, 4, 8, 1, 6, 782, 842),
            ("nemo2407-llama2-7b-8", "llama3-8b", LLAMA2_7B, 8, 128, 1, 4096, 1, 1, 1, 1, 16847, 776),
            ("nemo2407-llama2-70b-64", "llama3-70b", LLAMA2_70B, 64, 128, 1, 4096, 4, 4, 1, 20, 1707, 759),
            ("nemo2407-llama3-8b-8", "llama3-8b", (), 8, 128, 1, 8192, 1, 1, 2, 1, 12036, 697),
            ("nemo2407-llama3-70b-64", "llama3-70b", (), 64, 128, 1, 8192, 4, 4, 2, 5, 1533, 738)):
        base = (f"tp={tp}" + (f",cp={cp}" if cp > 1 else "") + (f",pp={pp}" if pp > 1 else "")
                + (f",vp={vp}" if vp > 1 else "") + f",mbs={mbs},gbs={gbs}")
        rec, notes = _nv(base, tp)
        extra: tuple[str, ...] = ()
        if model == "gpt3-175b":
            extra = ("GPT-3 175B as the zoo builds it (96 layers, 12,288 wide, 96 heads, 4h GELU MLP, biases, "
                     "vocabulary 50,304) with the fused attention core (attention=flash)",)
        elif "llama2" in name:
            extra = ("Llama 2 sizes (Touvron et al. 2023: 7B 32 layers × 4096, 32 heads, no grouped-query "
                     "attention, SwiGLU 11,008; 70B 80 × 8192, 64 heads / 8 KV heads, 28,672), vocabulary 32,000, "
                     "sequence 4,096, built by the zoo's Llama builder with these sizes",)
        out.append(Row(name, "nemo-24.07", f"{NEMO_2407}, row {name.split('-', 1)[1]}", model, gpus, rec, gbs, seq,
                       tok, tfl, sizes, notes + extra))
    # Megatron-Bridge 25.11 and 26.02, DGX-H100, FP8
    rec, notes = _nv("tp=1,mbs=1,gbs=128,recompute=5", 1, fp8_cs=True)
    fsdp, _ = _nv("tp=1,zero=3,mbs=1,gbs=128", 1, fp8_cs=True)
    fsdp = fsdp.replace(",zero=1", "").replace("overlap=grad_reduce", "overlap=grad_reduce+param_gather")
    out.append(Row("mb2511-llama3-8b-8", "megatron-bridge", f"{MB_2511}, LLAMA3_8B, 8 GPUs", "llama3-8b", 8, rec, 128,
                   8192, 14451, 744, (),
                   (MB2511_8B_SOURCE,) + notes, variants=(fsdp, fsdp + ",recompute=5")))
    for name, src, gbs, tok, tfl in (("mb2511-llama3-70b-64", MB_2511, 128, 1602, 719),
                                     ("mb2602-llama3-70b-64", MB_2602, 256, 1621, 728)):
        rec, notes = _nv(f"tp=4,pp=8,vp=5,mbs=1,gbs={gbs}", 4, fp8_cs=True)
        out.append(Row(name, "megatron-bridge", f"{src}, LLAMA3_70B, 64 GPUs", "llama3-70b", 64, rec, gbs, 8192,
                       tok, tfl, (), notes))
    for name, src, gbs, tok, tfl in (("mb2511-llama31-405b-1024", MB_2511, 512, 292, 737),
                                     ("mb2602-llama31-405b-1024", MB_2602, 1536, 311, 784)):
        rec, notes = _nv(f"tp=8,cp=2,pp=8,vp=8,embedding_as_layer=true,loss_as_layer=true,mbs=1,gbs={gbs}", 8,
                         fp8_cs=True)
        nearest = (f"tp=8,cp=2,cp_algo=ring,pp=8,mbs=1,gbs={gbs},first_stage_layers=15,last_stage_layers=15,zero=1,"
                   f"overlap=grad_reduce+dgrad,precision=fp8{MB_FP8_KEYS},runtime=megatron_te")
        out.append(Row(name, "megatron-bridge", f"{src}, LLAMA3.1_405B, 1024 GPUs", "llama3-405b", 1024, rec, gbs,
                       8192, tok, tfl, (),
                       ("TP 8 × CP 2 × PP 8 × VP 8 as published, with Megatron-Bridge's 405B pipeline split "
                        "(account_for_embedding_in_pipeline_split and account_for_loss_in_pipeline_split: "
                        "embedding_as_layer=true, loss_as_layer=true): 126 blocks + embedding + loss = 128 layers, "
                        "64 chunks of 2, the first chunk the embedding and block 1, the last block 126 and the "
                        "head with the loss; the chunks are unequal, so the interleaved step is the event "
                        "simulation over each chunk's own seconds (the closed form is recorded beside it). The "
                        "norms' sequence is split 8 ways over the tensor group inside the node and 2 ways over "
                        "the context group across nodes (sequence parallelism with context parallelism); the "
                        "nearest form costed before this was expressible (no interleaving, 15 + 6 × 16 + 15 "
                        "blocks, no sequence parallelism, no TP overlap) is the variant, its input-gradient "
                        "all-reduces beside the weight-gradient passes as Transformer Engine runs them without "
                        "userbuffers (overlap=grad_reduce+dgrad)",)
                       + notes, variants=(nearest,)))
    # Llama 3, Table 4: BF16, 16M tokens per step
    meta = ("BF16 (Table 4's MFU is BF16) with fp32 master weights and Adam state: precision=mixed",
            "FSDP as the paper describes it (§3.3.2): optimizer states and gradients sharded over the data-parallel "
            "group, the weights not resharded after the forward (gathered once per step): ZeRO-2, zero=2, "
            "gradient reduction overlapped with the backward (overlap=grad_reduce); the paper's unsharded "
            "all-gather is then the ZeRO step's weight gather",
            "micro-batch size not stated: 1 sequence (mbs=1); batch size per DP replica (Table 4: 32 at 8,192 GPUs, "
            "16 at 16,384) = micro-batches per step",
            "the paper's interleaved schedule with tunable N: its chunk count v is not stated, so the row is 1F1B "
            "without interleaving with the first and last stage one block short (first_stage_layers=7, "
            "last_stage_layers=7: 7 + 14 × 8 + 7 = 126), as the paper states; variants: the same short end stages as "
            "Megatron-Core's split with the embedding and the loss counted as a layer each, interleaved at v = 4 and "
            "8, with and without sequence parallelism",
            "activation recomputation not stated: none (the paper's memory-balancing is the short end stages); "
            "variant with full recomputation beside it",
            "TP without sequence parallelism stated (Table 4 names TP only); no TP communication overlap stated",
            "the tensor-parallel implementation is not named (the paper names no Megatron-LM or Transformer "
            "Engine): each input gradient's all-reduce charged in full; variant: beside the weight-gradient pass "
            "as Megatron-LM (2022) and Transformer Engine run it (overlap=grad_reduce+dgrad, TE_DGRAD_NOTE)",
            "all-gather context parallelism (cp_algo=allgather, §3.3.2), causal attention load-balanced over 2·cp "
            "chunks (causal_attention)",
            "measured step = model FLOPs (zoo formula, no recomputation, whole s × s scores) / (GPUs × TFLOP/s); the "
            "paper does not state its FLOP formula; measured_seconds_causal_flops counts causal attention at half")
    for name, gpus, cp, gbs, seq, tfl in (("l3-405b-8192", 8192, 1, 2048, 8192, 430),
                                          ("l3-405b-16384", 16384, 1, 2048, 8192, 400),
                                          ("l3-405b-16384-cp16", 16384, 16, 128, 131072, 380)):
        rec = (f"tp=8" + (f",cp={cp}" if cp > 1 else "") + f",pp=16,mbs=1,gbs={gbs},first_stage_layers=7,"
               f"last_stage_layers=7,zero=2,overlap=grad_reduce,precision=mixed")
        out.append(Row(name, "llama3-table4", f"{LLAMA3_PAPER}, {gpus} GPUs, TP 8 CP {cp} PP 16", "llama3-405b", gpus,
                       rec, gbs, seq, None, tfl, (("seq", seq),) if seq != 8192 else (), meta,
                       variants=(rec + ",recompute=full", rec.replace("overlap=grad_reduce", "overlap=grad_reduce+dgrad"))
                       + _table4_interleaved(cp, gbs), precision="bf16"))
    return out


def _table4_interleaved(cp: int, gbs: int) -> tuple[str, ...]:
    """Readings of Llama 3's interleaved schedule the paper leaves open (variants, not ranked): its "one
    Transformer layer fewer on the first and the last stage" is Megatron-Core's split with the embedding and the
    loss counted as a layer each (126 + 2 = 128 layers, 8 per stage: embedding_as_layer, loss_as_layer), at
    v = 4 and 8 chunks per stage (v not stated), with and without sequence parallelism (not stated)."""
    base = "tp=8{sp}" + (f",cp={cp}" if cp > 1 else "") + ",pp=16,vp={vp},embedding_as_layer=true,loss_as_layer=true"
    tail = f",mbs=1,gbs={gbs},zero=2,overlap=grad_reduce,precision=mixed"
    return tuple(base.format(sp=sp, vp=vp) + tail for vp in (4, 8) for sp in ("", ",sp=true"))


def _builder(model: str, sizes: dict[str, Any]) -> Any:
    """``build(batch) -> Graph``: the zoo model with ``sizes`` and its attention core under a causal mask."""
    from shardplan.models import get_model
    from shardplan.recipe import causal_attention

    def build(batch: int) -> Any:
        return causal_attention(get_model(model, batch, **sizes))

    return build


def attention_flops(model: str, batch: int, sizes: dict[str, Any]) -> int:
    """The attention scores' and values' share of :func:`model_flops` (no recomputation): 3 (forward and the two
    backward products) × 4 B s² · (query width) per layer (docs/models.md, "Training FLOPs")."""
    from shardplan.models.flops import config_of

    cfg = config_of(model, **sizes)
    return 3 * 4 * batch * cfg.seq * cfg.seq * cfg.d_model * cfg.layers


def measured(row: Row) -> dict[str, Any]:
    """The measured step and the FLOPs behind the published TFLOP/s (module docstring)."""
    from shardplan.models.flops import model_flops

    sizes = dict(row.sizes)
    zoo = model_flops(row.model, row.gbs, **sizes)
    if row.tokens_per_sec_per_gpu is not None:
        step = row.gbs * row.seq / (row.tokens_per_sec_per_gpu * row.gpus)
        publisher = row.tflops_per_gpu * 1e12 * row.gpus * step
        return {"measured_seconds": step, "publisher_flops_per_step": publisher, "zoo_flops_per_step": zoo,
                "publisher_over_zoo_flops": publisher / zoo, "measured_tflops_per_gpu": row.tflops_per_gpu,
                "measured_zoo_tflops_per_gpu": zoo / step / row.gpus / 1e12}
    causal = zoo - attention_flops(row.model, row.gbs, sizes) // 2
    return {"measured_seconds": zoo / (row.gpus * row.tflops_per_gpu * 1e12), "publisher_flops_per_step": zoo,
            "zoo_flops_per_step": zoo, "publisher_over_zoo_flops": 1.0,
            "measured_seconds_causal_flops": causal / (row.gpus * row.tflops_per_gpu * 1e12),
            "measured_tflops_per_gpu": row.tflops_per_gpu, "measured_zoo_tflops_per_gpu": row.tflops_per_gpu}


ELEMENTWISE_TERMS = {"rms_norm": "norms", "layer_norm": "norms", "rope": "rotary", "ffn": "swiglu_gelu",
                     "add": "residual_adds", "softmax_xent": "cross_entropy", "embedding": "embedding"}
"""The memory-bound operators' terms by kind (compute of an operator that is not a matrix product)."""
PART_TERMS = {"fp8_scaling": "fp8_casts", "grad_allreduce": "grad_reduce", "forward_allreduce": "tp_collectives"}
"""The other parts of an operator's seconds (:data:`shardplan.cost.BREAKDOWN`) under the term they are reported as;
a part not named keeps its name (``optimizer``, ``weight_sync``, ``recompute``, ...)."""


def step_terms(plan: Any) -> dict[str, float]:
    """Seconds of one SPMD program's step (a :class:`~shardplan.spmd.SpmdPlan` with memory choices) by term:
    its products' compute in FP8 (``gemm_fp8``) and in the machine's precision (``gemm_bf16``: the output layer),
    the fused attention core (``attention``), the memory-bound operators by kind (:data:`ELEMENTWISE_TERMS`; any
    other kind ``other_elementwise``), each other part of the operators' seconds (:data:`PART_TERMS`: FP8 casts,
    the gradient all-reduces of a split sequence or batch, tensor-parallel collectives, the optimizer step, the
    weights' synchronisation) and the edges' ``redistribution``. The terms add up to the plan's step time."""
    from shardplan.cost.memory import fp8_product

    mc, tables = plan.memory_choices, plan.tables
    out: dict[str, float] = {}
    for i, op in enumerate(plan.graph.operators):
        for part, val in mc.parts(i).items():
            if part != "compute":
                key = PART_TERMS.get(part, part)
            elif fp8_product(op):
                key = "gemm_fp8" if mc.fp8(i) else "gemm_bf16"
            elif op.kind.startswith("attn"):
                key = "attention"
            else:
                key = ELEMENTWISE_TERMS.get(op.kind, "other_elementwise")
            out[key] = out.get(key, 0.0) + float(val)
    out["redistribution"] = float(sum(m[plan.assignment[s], plan.assignment[d]] for s, d, m in tables.all_edges()))
    return {k: v for k, v in out.items() if v}


SIBLING_PRODUCTS = {"k": "q", "v": "q", "up": "gate"}
"""The zoo Llama's products that read the same input as another product of their block (name: that product's
name): Megatron-Core with Transformer Engine runs each group as one fused linear (``linear_qkv``, ``linear_fc1``)."""


def sibling_collectives(plan: Any) -> dict[str, float]:
    """Seconds of one SPMD program's step spent on the input side of the zoo Llama's products listed in
    :data:`SIBLING_PRODUCTS` (k and v beside q, up beside gate): the redistribution on the edges into them (the
    all-gather forward and the reduce-scatter backward of sequence parallelism) and their operators' own
    forward and input-gradient all-reduces (tensor parallelism without sequence parallelism). A fused linear
    reduces its input's gradient once where the separate products reduce it once each, so these seconds are
    what the separate products charge beyond one fused linear of equal compute when that linear hides no more
    of its one collective than q (gate) hides of its own: ``{"k_v": ..., "up": ...}``."""
    g, t, mc = plan.graph, plan.tables, plan.memory_choices
    out = {"k_v": 0.0, "up": 0.0}

    def group(i: int) -> str | None:
        op = g.operators[i]
        leaf = op.name.rsplit("/", 1)[-1]
        if leaf not in SIBLING_PRODUCTS or op.kind not in ("attn_proj", "ffn"):
            return None
        return "up" if leaf == "up" else "k_v"

    for s, d, m in t.all_edges():
        if group(d) is not None:
            out[group(d)] += float(m[plan.assignment[s], plan.assignment[d]])
    for i in range(len(g.operators)):
        if group(i) is not None:
            p = mc.parts(i)
            out[group(i)] += float(p.get("grad_allreduce", 0.0)) + float(p.get("forward_allreduce", 0.0))
    return out


PIPELINE_KEYS = re.compile(r"(?:^|,)(?:pp|vp|first_stage_layers|last_stage_layers|embedding_as_layer|loss_as_layer)=[^,]*")


def one_program(recipe: str) -> tuple[str, int]:
    """``recipe`` without its pipeline (the keys of :data:`PIPELINE_KEYS` removed) and its pp: the same layouts,
    micro-batches and memory choices as one program of every layer on a stage's devices (GPUs / pp)."""
    from shardplan.recipe import Recipe

    return PIPELINE_KEYS.sub("", recipe).lstrip(","), Recipe.parse(recipe).pp


def terms(row: Row) -> dict[str, Any]:
    """The step of ``row``'s recipe by term (:func:`step_terms`): the recipe itself when it is one program, else
    :func:`one_program` on GPUs / pp (every block at a stage's layouts: the terms' shares of a stage's work, the
    pipeline's fill and its unequal ends left out). ``share``: each term over their sum. A Llama row with
    tensor parallelism records :func:`sibling_collectives` too (``sibling_collectives``: seconds and share)."""
    from shardplan.machine import preset
    from shardplan.recipe import Recipe, cost_recipe

    text, pp = one_program(row.recipe)
    plan = cost_recipe(_builder(row.model, dict(row.sizes)), preset("h100", row.gpus // pp), text)
    sec = step_terms(plan.detail)
    total = sum(sec.values())
    out = {"program": text, "gpus": row.gpus // pp, "seconds": sec, "total": total,
           "share": {k: v / total for k, v in sec.items()}}
    if Recipe.parse(text).tp > 1 and row.model.startswith("llama"):
        sib = sibling_collectives(plan.detail)
        out["sibling_collectives"] = {"seconds": sib, "share": {k: v / total for k, v in sib.items()}}
    return out


def cost_row(row: Row) -> dict[str, Any]:
    """The row costed through :func:`cost_recipe` (or its refusal), with the wall and CPU seconds it took."""
    from shardplan.errors import ShardplanError
    from shardplan.machine import preset
    from shardplan.recipe import cost_recipe

    t0, c0 = time.perf_counter(), time.process_time()
    m = measured(row)
    out: dict[str, Any] = {"row": row.name, "experiment": row.experiment, "source": row.source, "model": row.model,
                           "sizes": dict(row.sizes), "gpus": row.gpus, "gbs": row.gbs, "seq": row.seq,
                           "precision": row.precision, "recipe": row.recipe, "assumptions": list(row.assumptions),
                           "published_tokens_per_sec_per_gpu": row.tokens_per_sec_per_gpu,
                           "published_tflops_per_gpu": row.tflops_per_gpu, **m}
    build = _builder(row.model, dict(row.sizes))
    if row.published_recipe is not None:
        out["published_recipe"] = row.published_recipe
        try:
            cost_recipe(build, preset("h100", row.gpus), row.published_recipe)
            out["refusal"] = None
        except ShardplanError as e:
            out["refusal"] = str(e)
    try:
        plan = cost_recipe(build, preset("h100", row.gpus), row.recipe)
    except ShardplanError as e:
        msg = str(e)
        out.update(status="not expressible" if "not expressible" in msg else "refused", reason=msg,
                   seconds=time.perf_counter() - t0, cpu_seconds=time.process_time() - c0)
        return out
    pred = plan.step_time
    flops = m["publisher_flops_per_step"]
    variants = {}
    for rec in row.variants:
        v = cost_recipe(build, preset("h100", row.gpus), rec)
        variants[rec] = {"predicted_seconds": v.step_time, "ratio": v.step_time / m["measured_seconds"],
                         "predicted_tflops_per_gpu": flops / v.step_time / row.gpus / 1e12,
                         "peak_memory_gib": float(v.memory["peak_bytes"]) / 2**30,
                         "fits": float(v.memory["peak_bytes"]) <= float(v.memory["budget_bytes"])}
    if variants:
        out["variants"] = variants
    out["terms"] = terms(row)
    out.update(status="costed", predicted_seconds=pred, ratio=pred / m["measured_seconds"],
               predicted_tflops_per_gpu=flops / pred / row.gpus / 1e12,
               predicted_zoo_tflops_per_gpu=m["zoo_flops_per_step"] / pred / row.gpus / 1e12,
               micro_batches=plan.micro_batches,
               schedule=plan.schedule, chunks=plan.chunks, breakdown=dict(plan.breakdown),
               peak_memory_gib=float(plan.memory["peak_bytes"]) / 2**30,
               fits=float(plan.memory["peak_bytes"]) <= float(plan.memory["budget_bytes"]),
               seconds=time.perf_counter() - t0, cpu_seconds=time.process_time() - c0)
    return out


def run_row(row: Row, limit: float) -> dict[str, Any]:
    """:func:`cost_row` in a child process, stopped after ``limit`` seconds (then recorded as skipped)."""
    status, got, seconds = call_limited(cost_row, (row,), limit)
    if status == "error":
        return {"row": row.name, "experiment": row.experiment, "status": "error", "reason": got, "seconds": seconds}
    if status == "timeout":
        return {"row": row.name, "experiment": row.experiment, "source": row.source, "gpus": row.gpus,
                "recipe": row.recipe, "status": "skipped",
                "reason": f"costing did not finish within {limit:.0f} s on this machine", "seconds": seconds}
    return got


EXPERIMENTS = {  # name: the rows ranked together (one model, one publisher)
    "nemo-24.07 gpt3-175b: 128 vs 512 GPUs": ("nemo2407-gpt3-175b-128", "nemo2407-gpt3-175b-512"),
    "llama3-70b on 64 H100, FP8: 24.07 (TP4 PP4 CP2 VP5), 25.11 (TP4 PP8 VP5, GBS 128), 26.02 (GBS 256)": (
        "nemo2407-llama3-70b-64", "mb2511-llama3-70b-64", "mb2602-llama3-70b-64"),
    "llama3-8b on 8 H100, FP8: 24.07 (CP 2) vs 25.11 (CP 1, 5 blocks recomputed)": ("nemo2407-llama3-8b-8",
                                                                                   "mb2511-llama3-8b-8"),
    "llama3.1-405b on 1,024 H100: GBS 512 (25.11) vs 1536 (26.02)": ("mb2511-llama31-405b-1024",
                                                                     "mb2602-llama31-405b-1024"),
    "llama3 Table 4: 8,192 GPUs, 16,384 GPUs, 16,384 GPUs at 128K (CP 16)": ("l3-405b-8192", "l3-405b-16384",
                                                                           "l3-405b-16384-cp16"),
}


def rank_orders(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per experiment (:data:`EXPERIMENTS`): measured and predicted rank and Kendall's tau, by the zoo's model
    FLOPs per second per GPU (one formula for every row: NVIDIA's model FLOPs changed between its releases, 24.07
    counting the whole s × s scores and 25.11 on causal attention at half, so its published TFLOP/s do not order
    two releases' runs of one model as their step times do)."""
    by_name = {r["row"]: r for r in results}
    return {name: compare_ranks([by_name[n] for n in names], "measured_zoo_tflops_per_gpu",
                                "predicted_zoo_tflops_per_gpu")
            for name, names in EXPERIMENTS.items() if all(n in by_name for n in names)}


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Predicted against measured step time, log-log, one marker per experiment, y = x dashed, the ±10 % band."""
    marks = {"nemo-24.07": ("o", "NeMo 24.07 (FP8)"), "megatron-bridge": ("s", "Megatron-Bridge 25.11 / 26.02 (FP8)"),
             "llama3-table4": ("D", "Llama 3 Table 4 (BF16)")}
    fidelity_common.plot(results, path, marks, "predicted step time (s), shardplan h100 preset",
                         "Published H100 runs costed as published (cost_recipe)", band=True)


def main(argv: list[str] | None = None) -> int:
    header = {"sources": [NEMO_2407, MB_ARCHIVE, LLAMA3_PAPER],
              "machine": "shardplan.machine.preset('h100', GPUs), unmodified",
              "note": "seconds: wall and CPU seconds of costing the row on a shared 2-core machine; measured step = "
                      "global tokens / (tokens/s/GPU × GPUs), or (Llama 3) model FLOPs / (GPUs × TFLOP/s)"}
    return fidelity_common.run_main(argv, __doc__, rows(), run_row, header, rank_orders, plot,
                                    "benchmarks/results/fidelity_h100.json", "benchmarks/results/fidelity_h100.png",
                                    "nemo-24.07, megatron-bridge, llama3-table4", name_width=26)


if __name__ == "__main__":
    sys.exit(main())
