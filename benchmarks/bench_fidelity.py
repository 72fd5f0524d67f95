"""Fidelity: every published A100 measurement costed as published through :func:`shardplan.recipe.cost_recipe`.

Source of every measured number: ``/work/shared/data/published-a100.md`` (the rows below cite its tables):

* Narayanan et al., SC'21 (arXiv 2104.04473), Table 1: ten GPT runs, full recomputation, measured step time
  = F / (GPUs × TFLOP/s per GPU) with the paper's F (:func:`shardplan.models.flops.megatron_flops`);
* the same paper's Table 2 (GPT-3 175B, global batch 1536): ZeRO-3 without model parallelism, and TP 8 × PP 12;
* its Figure 13 (162.2B, 64 GPUs, TP × PP = 64, MBS 1, global batch 128; read off the plot, about ±5 %);
* Korthikanti et al. 2022 (arXiv 2205.05198): four models, iteration time with full recomputation, and with
  sequence parallelism + selective recomputation (``sp=true``: partial layouts, see docs/recipes.md).

Each row is costed on ``preset("a100", GPUs)`` exactly as published (no machine constant is tuned here) and
records predicted and measured step time, their ratio, the predicted and measured TFLOP/s per GPU (the
paper's F over the step), the recipe, what the transcription leaves open and how it was filled
(``assumptions``: each SC'21 row as its public run script ran it, Megatron-LM's kernels, padded vocabulary
and local DDP, Table 2's ZeRO-3 with DeepSpeed v0.3.16's collectives, fp16 with fp32 master weights and
optimizer state: ``precision=mixed``, which also decides the optimizer step's bytes), and the seconds costing
took. A row still running after ``--row-limit`` seconds (default
180) is recorded as skipped with the time it had run (each row runs in a child process). Within each
experiment (Table 2, Figure 13, full vs selective) the predicted rank order is compared with the measured one
(by TFLOP/s per GPU, higher first). A row may carry variants, other readings of the same run (Table 2's ZeRO-3
with FSDP's collectives, or with nothing overlapped), costed beside it under ``variants`` and not ranked; docs/fidelity.md says per row
what the model does not explain.

Run: ``PYTHONPATH=. python benchmarks/bench_fidelity.py [--rows t1-1.7b,f13-pp8] [--out
benchmarks/results/fidelity.json] [--plot benchmarks/results/fidelity.png]``
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks import fidelity_common
from benchmarks.fidelity_common import compare_ranks
from benchmarks.limits import call_limited

SOURCE = "/work/shared/data/published-a100.md"
SEQ, VOCAB = 2048, 51200  # all rows (source: published-a100.md, SC'21 Table 1 and Korthikanti et al. headers)
GPT2_BPE = 50257  # the tokenizer of the SC'21 scripts (CONFIG.sh: --vocab-file / --merge-file, GPT-2 BPE)


def megatron_vocab(tp: int, divisible_by: int = 128) -> int:
    """The vocabulary Megatron-LM trains with at tensor-parallel degree ``tp``: GPT-2's 50,257 tokens padded
    to a multiple of ``--make-vocab-size-divisible-by`` (128) × tp (megatron/tokenizer/tokenizer.py,
    ``_vocab_size_with_padding``, at the SC'21 commit 6985e58): 50,304 at tp 1, 50,432 at 2, 50,688 at 4,
    51,200 at 8 and 16, 53,248 at 32. The measured step keeps the paper's F with V = 51,200."""
    m = divisible_by * tp
    return -(-GPT2_BPE // m) * m



@dataclass(frozen=True)
class Row:
    """One published run: the model (layers, hidden, heads), GPUs, the recipe as published, the measurement."""

    name: str
    experiment: str
    source: str
    layers: int
    hidden: int
    heads: int
    gpus: int
    recipe: str
    measured_seconds: float | None
    measured_tflops: float | None
    assumptions: tuple[str, ...] = ()
    variants: tuple[str, ...] = ()  # other readings of the same run, costed beside it (not ranked)
    kernels: str = "fused"
    vocab: int = VOCAB  # the vocabulary the run computed with (the paper's F always uses VOCAB)


def _flops(row: Row, gbs: int) -> float:
    from shardplan.models.flops import megatron_flops

    return float(megatron_flops(gbs, SEQ, row.layers, row.hidden, VOCAB, recompute=True))


def _gbs(recipe: str) -> int:
    return int(dict(p.split("=") for p in recipe.split(",") if "=" in p)["gbs"])


MEGATRON_KERNELS = ("kernels=megatron: each layer's kernels as Megatron-LM ran them in 2021-22 (megatron/model/"
                    "transformer.py, ParallelAttention and ParallelMLP before FlashAttention): one fused "
                    "query-key-value product (query_key_value, one input gradient to reduce), the attention core as "
                    "baddbmm, fused scale-mask-softmax, dropout and bmm, each reading and writing the b·a·s² "
                    "tensor; bias-GELU and bias-dropout-add as kernels of their own (shardplan.models.gpt)")

ASYNC_DGRAD = ("overlap=dgrad: Megatron-LM of 2022 (the sequence-parallel code, merged April 2022, commit cfd2e21607; "
               "megatron/mpu/layers.py, LinearWithGradAccumulationAndAsyncCommunication) all-reduces a column-parallel "
               "linear's input gradient asynchronously beside its weight-gradient product "
               "(--async-tensor-model-parallel-allreduce, on unless --no-async-tensor-model-parallel-allreduce), and "
               "with --sequence-parallel reduce-scatters it beside that product; the SC'21 code (6985e58) had "
               "neither (the flag came in September 2021, opt-in, 16c90445e7). Data parallelism is 1: nothing else "
               "overlaps")

VOCAB_NOTE = ("vocabulary as run: GPT-2's 50,257 tokens padded by Megatron-LM to a multiple of 128 × TP "
              "(megatron_vocab); the measured step keeps the paper's F with 51,200")

LOCAL_DDP = ("overlap=none: Megatron-LM's DDP of the SC'21 commit (--DDP-impl local, the scripts' setting from "
             "39.1B on: examples/sc21/run_table_1.sh at 6985e58) all-reduces the gradient buffer after the whole "
             "forward-backward (megatron/training.py, train_step: allreduce_gradients() after "
             "forward_backward_func), never overlapped with the backward")

TORCH_DDP = ("overlap=grad_reduce: PyTorch's DistributedDataParallel (--DDP-impl torch, the script's setting for 1.7B, "
             "3.6B, 7.5B and 18.4B: examples/sc21/run_table_1.sh at 6985e58, DDP=torch), which all-reduces 25 MiB "
             "buckets of gradients during the backward (the a100 profile's grad_bucket_bytes)")

AUTOGRAD_ACCUM = ("grad_accum=autograd: the SC'21 code (6985e58) keeps each weight's fp16 gradient in .grad (local DDP "
                  "without --use-contiguous-buffers-in-ddp, the scripts' setting; or PyTorch DDP under no_sync, "
                  "megatron/schedules.py) and zeroes it with set_to_none (megatron/optimizer/optimizer.py), so "
                  "autograd's AccumulateGrad adds every micro-batch's gradient after the first in place: 6 bytes "
                  "per parameter and micro-batch (Machine.grad_accum_bytes); the fused accumulation into the "
                  "weight-gradient product came in February 2022, with fp32 gradient accumulation only")

FUSED_ACCUM = ("grad_accum (not given, the profile's 0): the 2022 code (cfd2e21607) fuses the fp32 gradient "
               "accumulation into the weight-gradient product (--gradient-accumulation-fusion, default on, kept only "
               "with --accumulate-allreduce-grads-in-fp32, which bf16 sets); the transcription does not give the "
               "precision: bf16 assumed (MT-NLG's 530B trained in bf16); an fp16 run without fp32 accumulation adds "
               "its fp16 main_grad buffer's 6 bytes per parameter and micro-batch (about 5 % at one 2,048-token "
               "sequence per micro-batch)")

MIXED = ",precision=mixed"
MIXED_NOTE = ("precision=mixed: fp16 with fp32 master weights and Adam state (published-a100.md: 'fp16', "
              "'mixed-precision Adam'; Megatron-LM's --fp16, DeepSpeed's fp16 ZeRO): 16 bytes of state per parameter "
              "and the optimizer step's 28 HBM bytes per parameter the device updates")

T1 = "SC'21 Table 1"
T1_ROWS = [  # (params B, heads, hidden, layers, TP, PP, GPUs, gbs, MBS, layers per virtual stage, TFLOP/s per GPU)
    ("1.7b", 24, 2304, 24, 1, 1, 32, 512, 16, None, 137),
    ("3.6b", 32, 3072, 30, 2, 1, 64, 512, 16, None, 138),
    ("7.5b", 32, 4096, 36, 4, 1, 128, 512, 16, None, 142),
    ("18.4b", 48, 6144, 40, 8, 1, 256, 1024, 8, None, 135),
    ("39.1b", 64, 8192, 48, 8, 2, 512, 1536, 4, None, 138),
    ("76.1b", 80, 10240, 60, 8, 4, 1024, 1792, 2, 5, 140),
    ("145.6b", 96, 12288, 80, 8, 8, 1536, 2304, 2, 5, 148),
    ("310.1b", 128, 16384, 96, 8, 16, 1920, 2160, 1, 3, 155),
    ("529.6b", 128, 20480, 105, 8, 35, 2520, 2520, 1, 1, 163),
    ("1008b", 160, 25600, 128, 8, 64, 3072, 3072, 1, None, 163),
]


def rows() -> list[Row]:
    """Every published row (source: published-a100.md; section named in each row's ``source``)."""
    out: list[Row] = []
    for size, heads, hidden, layers, tp, pp, gpus, gbs, mbs, per_vs, tflops in T1_ROWS:
        vp = layers // pp // per_vs if per_vs else 1
        torch_ddp = pp == 1  # run_table_1.sh: DDP=torch for the four rows without a pipeline, local for the rest
        rec = (f"tp={tp},pp={pp}" + (f",vp={vp}" if vp > 1 else "") + f",mbs={mbs},gbs={gbs},recompute=full"
               + (",overlap=grad_reduce" if torch_ddp else ",overlap=none") + ",grad_accum=autograd")
        out.append(Row(f"t1-{size}", "table1", f"{T1}, {size}", layers, hidden, heads, gpus, rec, None, tflops,
                       (MEGATRON_KERNELS, VOCAB_NOTE, TORCH_DDP if torch_ddp else LOCAL_DDP, AUTOGRAD_ACCUM),
                       kernels="megatron",
                       vocab=megatron_vocab(tp)))
    t2 = "SC'21 Table 2 (GPT-3 175B, global batch 1536)"
    zero_note = ("recompute=full: not stated for Table 2 in the transcription; assumed as in Table 1",)
    ds_notes = (
        "overlap=grad_reduce+param_gather: DeepSpeed's ZeRO-3 as of the paper (v0.3.16, April 2021, "
        "deepspeed/runtime/zero/constants.py: overlap_comm defaults to true at stage 3; stage3.py: a module's "
        "parameters are prefetched while the module before it computes, stage3_prefetch_bucket_size 5e7 "
        "elements; a gradient's reduction launched on a side stream when the next gradient arrives)",
        "gathers per parameter tensor in fp16 (v0.3.16 partition_parameters.py: one all_gather per parameter; "
        "tensors under stage3_param_persistence_threshold = 1e5 "
        "elements stay whole): every GPT weight matrix is its own collective, as the model charges it",
        "zero_regather=true: the recomputed forward gathers again (v0.3.16 stage3.py: the pre-forward module hook "
        "fetches on every forward call; stage3_max_reuse_distance 1e9 elements keeps a weight to its backward only "
        "when fewer elements are used in between, at 175B only a layer's last matrix, which the model gathers again "
        "too: an over-count of a third of one pass)",
        "zero_grad_reduce=allreduce: v0.3.16's reduce_scatter defaults to false (zero/constants.py "
        "ZERO_OPTIMIZATION_REDUCE_SCATTER_DEFAULT), and then stage3.py's average_tensor / buffered_reduce_fallback "
        "all-reduce the gradient bucket; DeepSpeed's own Megatron ZeRO-3 example of April 2021 "
        "(DeepSpeedExamples Megatron-LM-v1.1.5-ZeRO3, ds_zero_stage_3_config.json) does not set it (its "
        "--zero-reduce-scatter flag is parsed by Megatron's arguments.py and read nowhere)",
        "variants (not ranked): FSDP's collectives (one gather shared by the recomputed forward and the backward, "
        "reduce-scatter), and v0.3.16's with nothing overlapped")
    for gpus, mbs, tflops in ((384, 4, 144), (768, 2, 88), (1536, 1, 44)):
        base = f"zero=3,mbs={mbs},gbs=1536,recompute=full"
        ds = ",zero_regather=true,zero_grad_reduce=allreduce"
        out.append(Row(f"t2-zero3-{gpus}", "table2", f"{t2}, ZeRO-3 without model parallelism, {gpus} GPUs",
                       96, 12288, 96, gpus, base + ",overlap=grad_reduce+param_gather" + ds, None, tflops,
                       zero_note + ds_notes + (MEGATRON_KERNELS, VOCAB_NOTE),
                       (base + ",overlap=grad_reduce+param_gather", base + ",overlap=none" + ds), kernels="megatron",
                       vocab=megatron_vocab(1)))
    for gpus, tflops in ((384, 153), (768, 149), (1536, 141)):
        out.append(Row(f"t2-ptd-{gpus}", "table2", f"{t2}, TP 8 × PP 12, {gpus} GPUs", 96, 12288, 96, gpus,
                       "tp=8,pp=12,mbs=1,gbs=1536,recompute=full,overlap=none,grad_accum=autograd", None, tflops,
                       zero_note + ("TP 8 × PP 12 inferred by the transcription (model-parallel size 96)",
                                    "schedule: 1F1B without interleaving (not stated)", MEGATRON_KERNELS,
                                    VOCAB_NOTE, LOCAL_DDP, AUTOGRAD_ACCUM),
                       kernels="megatron", vocab=megatron_vocab(8)))
    f13 = "SC'21 Figure 13 (162.2B, 64 GPUs, read off the plot, ±5 %)"
    for pp, tflops in ((2, 75), (4, 125), (8, 165), (16, 145), (32, 100)):
        out.append(Row(f"f13-pp{pp}", "figure13", f"{f13}, PP {pp} / TP {64 // pp}", 32, 20480, 128, 64,
                       f"tp={64 // pp},pp={pp},mbs=1,gbs=128,recompute=full,grad_accum=autograd", None, tflops,
                       ("Megatron-LM examples/academic_paper_scripts/sc21/run_figure_13.sh: MBS 1, global batch 32 "
                        "or 128 (the transcription's 128 costed), --activations-checkpoint-method uniform (full "
                        "recomputation), DDP local, 8 nodes; 1F1B without interleaving (no virtual stages given)",
                        "sequence 2048 (CONFIG.sh)", MEGATRON_KERNELS, VOCAB_NOTE, AUTOGRAD_ACCUM), kernels="megatron",
                       vocab=megatron_vocab(64 // pp)))
    k = "Korthikanti et al. 2022"
    for size, heads, hidden, layers, tp, pp, gpus, gbs, mbs, full, sel in (
            ("22b", 64, 6144, 48, 8, 1, 8, 4, 4, 1.42, 1.10),
            ("175b", 96, 12288, 96, 8, 8, 64, 64, 1, 18.13, 13.75),
            ("530b", 128, 20480, 105, 8, 35, 280, 280, 1, 49.05, 37.83),
            ("1t", 160, 25600, 128, 8, 64, 512, 512, 1, 94.42, 71.49)):
        base = f"tp={tp},pp={pp},mbs={mbs},gbs={gbs}"
        note = (("schedule: 1F1B without interleaving (not stated in the transcription)",) if pp > 1 else ()) + (
            MEGATRON_KERNELS,)
        note += (ASYNC_DGRAD, FUSED_ACCUM)
        out.append(Row(f"k-{size}-full", "korthikanti", f"{k}, {size}, full recomputation", layers, hidden, heads,
                       gpus, base + ",recompute=full,overlap=dgrad", full, None, note, kernels="megatron",
                       vocab=megatron_vocab(tp)))
        out.append(Row(f"k-{size}-sp-selective", "korthikanti", f"{k}, {size}, SP + selective recomputation", layers,
                       hidden, heads, gpus,
                       f"tp={tp},sp=true,pp={pp},mbs={mbs},gbs={gbs},recompute=selective,overlap=dgrad",
                       sel, None, note, kernels="megatron", vocab=megatron_vocab(tp)))
    return [replace(r, recipe=r.recipe + MIXED, variants=tuple(v + MIXED for v in r.variants),
                    assumptions=r.assumptions + (MIXED_NOTE,)) for r in out]


def cost_row(row: Row) -> dict[str, Any]:
    """The row costed through :func:`cost_recipe` (or its refusal), with the seconds it took."""
    from shardplan.errors import ShardplanError
    from shardplan.machine import preset
    from shardplan.recipe import cost_recipe

    gbs = _gbs(row.recipe)
    flops = _flops(row, gbs)
    measured = (row.measured_seconds if row.measured_seconds is not None
                else flops / (row.gpus * row.measured_tflops * 1e12))
    out: dict[str, Any] = {"row": row.name, "experiment": row.experiment, "source": row.source,
                           "model": {"layers": row.layers, "hidden": row.hidden, "heads": row.heads, "seq": SEQ,
                                     "vocab": row.vocab, "kernels": row.kernels},
                           "gpus": row.gpus, "recipe": row.recipe, "assumptions": list(row.assumptions),
                           "paper_flops_per_step": flops, "measured_seconds": measured,
                           "measured_tflops_per_gpu": flops / measured / row.gpus / 1e12}
    t0 = time.perf_counter()
    sizes: dict[str, Any] = {"layers": row.layers, "d_model": row.hidden, "heads": row.heads, "seq": SEQ,
                             "vocab": row.vocab}
    if row.kernels != "fused":
        sizes["kernels"] = row.kernels
    try:
        plan = cost_recipe("gpt", preset("a100", row.gpus), row.recipe, sizes=sizes)
    except ShardplanError as e:
        msg = str(e)
        out.update(status="not expressible" if "not expressible" in msg else "refused", reason=msg,
                   seconds=time.perf_counter() - t0)
        return out
    pred = plan.step_time
    variants = {}
    for rec in row.variants:
        t = cost_recipe("gpt", preset("a100", row.gpus), rec, sizes=sizes).step_time
        variants[rec] = {"predicted_seconds": t, "ratio": t / measured,
                         "predicted_tflops_per_gpu": flops / t / row.gpus / 1e12}
    if variants:
        out["variants"] = variants
    out.update(status="costed", predicted_seconds=pred, ratio=pred / measured,
               predicted_tflops_per_gpu=flops / pred / row.gpus / 1e12, micro_batches=plan.micro_batches,
               schedule=plan.schedule, chunks=plan.chunks, breakdown=dict(plan.breakdown),
               peak_memory_gib=float(plan.memory["peak_bytes"]) / 2**30,
               fits=float(plan.memory["peak_bytes"]) <= float(plan.memory["budget_bytes"]),
               seconds=time.perf_counter() - t0)
    return out


def run_row(row: Row, limit: float) -> dict[str, Any]:
    """:func:`cost_row` in a child process, stopped after ``limit`` seconds (then recorded as skipped)."""
    status, got, seconds = call_limited(cost_row, (row,), limit)
    if status == "error":
        return {"row": row.name, "status": "error", "reason": got, "seconds": seconds}
    if status == "timeout":
        return {"row": row.name, "experiment": row.experiment, "source": row.source, "gpus": row.gpus,
                "recipe": row.recipe, "status": "skipped",
                "reason": f"costing did not finish within {limit:.0f} s on this machine", "seconds": seconds}
    got.setdefault("seconds", seconds)
    return got


def rank_orders(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per experiment (Table 2, Figure 13, full vs selective): measured and predicted rank by TFLOP/s per GPU,
    Kendall's tau between them, and whether the orders agree; an experiment with a row not costed says so."""
    out: dict[str, Any] = {}
    groups = {"table2": [r for r in results if r.get("experiment") == "table2"],
              "figure13": [r for r in results if r.get("experiment") == "figure13"]}
    for size in ("22b", "175b", "530b", "1t"):
        groups[f"korthikanti-{size}: full vs SP+selective"] = [
            r for r in results if r.get("row", "").startswith(f"k-{size}-")]
    for name, rs in groups.items():
        if len(rs) < 2:
            continue
        out[name] = compare_ranks(rs)
    return out


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Predicted vs measured step time, log-log, one marker per experiment, y = x dashed."""
    marks = {"table1": ("o", "SC'21 Table 1"), "table2": ("s", "SC'21 Table 2"), "figure13": ("^", "SC'21 Figure 13"),
             "korthikanti": ("D", "Korthikanti et al. (full recompute)")}
    fidelity_common.plot(results, path, marks, "predicted step time (s), shardplan a100 preset",
                         "Published A100 runs costed as published (cost_recipe)")


def main(argv: list[str] | None = None) -> int:
    header = {"source": SOURCE, "machine": "shardplan.machine.preset('a100', GPUs), unmodified",
              "note": "seconds measured on a shared 2-core machine; measured step time of SC'21 rows = paper's F / "
                      "(GPUs × TFLOP/s per GPU)"}
    return fidelity_common.run_main(argv, __doc__, rows(), run_row, header, rank_orders, plot,
                                    "benchmarks/results/fidelity.json", "benchmarks/results/fidelity.png",
                                    "table1, table2, figure13, korthikanti", name_width=24)


if __name__ == "__main__":
    sys.exit(main())
