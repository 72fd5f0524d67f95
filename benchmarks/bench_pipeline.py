"""Pipeline stages searched vs Megatron-LM's recipe under the same cost model (JSON).

Cases: Megatron-LM's published configurations (Narayanan et al., SC'21, Table 1; tensor
parallel 8 inside a node) on the ``a100`` preset, GPT-3 175B on 1,024 ``h100``, and a small case
(GPT 1.3B on 64 a100) that finishes quickly. For each: the recipe (its stage count, layers split
evenly with the embedding on the first stage and the head on the last, Megatron-LM's intra-stage
layouts exactly: heads / FFN hidden / vocabulary split 8 ways inside the node, batch over the nodes,
norms and adds replicated over the 8 (the tables' ``node_replicas`` layouts), ``m`` = batch /
data-parallel width, i.e. micro-batches of 1 sequence per replica, 1F1B) costed by the same model,
and the search's optimum over the space given (uniform sub-meshes of the listed sizes, the listed
micro-batch counts, 1F1B, interleaved v=2 and ZB-H1; a stage (an interleaved device group) whose
time-optimal plan does not fit its in-flight micro-batches takes its memory-constrained optimum,
ZeRO/FSDP and recomputation, solved lazily and each proven to the relative ``FIT_RTOL`` (1e-9: exact;
the row's ``lower_bound_seconds`` and ``gap`` state what was proven for the whole space: 1F1B and ZB-H1
over every cut, interleaved over its chunkings, each family's in ``family_lower_bounds``; the bound over every
interleaved chunking, ``interleaved_any_chunking_bound``, says what that family's restriction can lose; ``periodic_certified`` / ``periodic_fallbacks`` count the stage costs taken by
certificate and those solved directly; GPT-3 175B /
1,024 h100 in about 55 s end to end on a 2-core machine); with ``--fallback`` it takes Megatron's
layouts when they fit instead, a heuristic; each row's ``search.memory`` says which), both with exact
stage-to-stage transfers, with
step time, model TFLOP/s per GPU (forward + backward FLOPs, no recomputation), memory per stage,
solve time (wall and CPU: the machine is shared) and peak RSS.

Run: ``PYTHONPATH=. python benchmarks/bench_pipeline.py --cases small [--out benchmarks/results/pipeline.json]``
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

from shardplan.baselines import megatron
from shardplan.machine import preset
from shardplan.models import get_model
from shardplan.pipeline import pipeline_solve
from shardplan.pipeline.search import PipelineSpace, evaluate_pipeline
from shardplan.pipeline.stages import ModelStages

CASES = {
    # name: (machine, p, batch, (layers, d_model, heads), recipe stages, search stage counts, search m)
    "small": ("a100", 64, 64, (24, 2048, 16), 2, (1, 2, 4, 8), (8, 16, 32)),
    "megatron-39b": ("a100", 512, 1536, (48, 8192, 64), 2, (2, 4), (48,)),
    "megatron-76b": ("a100", 1024, 1792, (60, 10240, 80), 4, (4, 8), (56, 112)),
    "megatron-146b": ("a100", 1536, 2304, (80, 12288, 96), 8, (8, 16, 32), (96, 192)),
    "gpt3-175b-h100": ("h100", 1024, 1536, (96, 12288, 96), 16, (8, 16, 32), (96, 192)),
}


def _build(layers: int, d: int, heads: int):
    vocab = 51200 if d != 2048 else 50304
    return lambda b: get_model("gpt", b, layers=layers, d_model=d, heads=heads, seq=2048, vocab=vocab)


def _model_flops(graph) -> float:
    return float(sum(op.flops_per_point * op.points * (1 + len(op.grad_tensors)) for op in graph.operators))


def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _stages_line(plan, names) -> str:
    return "; ".join(f"[{names[s.first]}..{names[s.end - 1]}] on {s.devices} devs" for s in plan.stages)


FIT_RTOL = 1e-9  # each memory-constrained stage proven optimal (the pipeline's gap is at most about 1e-9)


def run_case(name: str, solve_opts: dict, recipe_only: bool = False, fallback: bool = False,
             fit_rtol: float = FIT_RTOL) -> dict:
    mname, p, batch, (layers, d, heads), rec_s, search_s, search_m = CASES[name]
    machine = preset(mname, p)
    build = _build(layers, d, heads)
    flops = _model_flops(build(batch))
    row: dict = {"case": name, "machine": mname, "devices": p, "batch": batch, "layers": layers, "d_model": d,
                 "heads": heads, "model_flops_per_step": flops}

    # Megatron's recipe under the same model
    t0, c0 = time.perf_counter(), _cpu()
    q = p // rec_s
    dp = q // 8
    m = batch // dp
    rec = ModelStages(build, batch, machine, {**solve_opts, "node_replicas": True}, periodic=True,
                      strategy=lambda t: megatron(t, max(1, t.machine.num_devices // 8)))
    U = rec.num_units
    per = layers // rec_s
    bounds = [0] + [1 + per * i for i in range(1, rec_s)] + [U]
    segs = [(bounds[i], bounds[i + 1], q) for i in range(rec_s)]
    space = PipelineSpace(U, p, machine.node_size, (m,), machine.memory_bytes)
    rp = evaluate_pipeline(segs, m, space, rec.stage_cost, rec.link_time, rec.exchange_time)
    if rp is None:  # over budget: cost it without the budget to report by how much
        rp = evaluate_pipeline(segs, m, PipelineSpace(U, p, machine.node_size, (m,), None), rec.stage_cost,
                               rec.link_time, rec.exchange_time)
        row["recipe_fits"] = False
    else:
        row["recipe_fits"] = True
    row["recipe"] = {"stages": rec_s, "devices_per_stage": q, "tensor_parallel": 8, "data_parallel": dp,
                     "micro_batches": m, "step_seconds": rp.step_time,
                     "tflops_per_gpu": flops / rp.step_time / p / 1e12,
                     "memory_per_stage_gib": [s.memory / 2**30 for s in rp.stages],
                     "seconds": time.perf_counter() - t0, "cpu_seconds": _cpu() - c0}
    print(f"{name}: recipe {rp.step_time:.3f} s/step, {row['recipe']['tflops_per_gpu']:.0f} TFLOP/s/GPU "
          f"({row['recipe']['seconds']:.0f} s)", flush=True)

    if recipe_only:
        return row
    # the search
    t0, c0 = time.perf_counter(), _cpu()
    sizes = tuple(sorted({p // s for s in search_s if p % s == 0}))
    memory = ({"fallback": lambda t: megatron(t, max(1, t.machine.num_devices // 8))} if fallback else
              {"memory_choices": True, "fit_rtol": fit_rtol, "fit_time_limit": 600.0})
    res = pipeline_solve(build, batch, machine, micro_batches=search_m, uniform=True, interleave=(2,),
                         sizes=sizes, schedules=("1f1b", "interleaved", "zb-h1"), **memory, **solve_opts)
    plan = res.plan
    names = res.unit_names()
    row["search"] = {"stages": plan.num_stages // plan.chunks, "schedule": plan.schedule, "chunks": plan.chunks,
                     "micro_batches": plan.micro_batches, "stage_map": _stages_line(plan, names),
                     "layouts": sorted({_layouts(s.cost.detail) for s in plan.stages}),
                     "memory": "fallback: Megatron's layouts where the time-optimal stage does not fit" if fallback
                     else f"memory_choices: exact per-stage ZeRO/FSDP/recompute optimum, fit_rtol {fit_rtol:g}",
                     "stages_on_fallback": sum(getattr(s.cost.detail, "name", "") == "recipe" for s in plan.stages),
                     "stages_with_memory_choices": sum(getattr(s.cost.detail, "memory_choices", None) is not None
                                                       for s in plan.stages),
                     "memory_choice_lines": sorted({_choices(s.cost.detail) for s in plan.stages
                                                    if getattr(s.cost.detail, "memory_choices", None) is not None}),
                     "fit_evaluations": plan.stats.get("fit_evaluations", 0),
                     "group_fit_evaluations": plan.stats.get("group_fit_evaluations", 0),
                     "zb_fit_candidates": plan.stats.get("zb_fit_candidates", 0),
                     "fit_unproven": plan.stats.get("fit_unproven", 0),
                     "lower_bound_seconds": plan.lower_bound, "gap": plan.gap,
                     "family_lower_bounds": plan.stats.get("family_lower_bounds", {}),
                     "zb_pruned": plan.stats.get("zb_pruned", 0),
                     "zb_boxes": plan.stats.get("zb_boxes", 0),
                     "interleaved_any_chunking_bound": plan.stats.get("interleaved_any_chunking_bound"),
                     "interleaved_pruned": plan.stats.get("interleaved_pruned", 0),
                     "periodic_certified": res.stages.periodic_certified,
                     "periodic_fallbacks": res.stages.periodic_fallbacks,
                     "bound_pass_seconds": plan.stats.get("bound_pass_seconds", 0.0),
                     "lazy_rounds": plan.stats.get("lazy_rounds", 0),
                     "step_seconds": plan.step_time, "simulated_step_seconds": res.simulated_step_time(),
                     "tflops_per_gpu": flops / plan.step_time / p / 1e12,
                     "memory_per_stage_gib": [s.memory / 2**30 for s in plan.stages],
                     "space": {"sub_mesh_sizes": sizes, "micro_batches": search_m, "uniform": True,
                               "interleave": [2]},
                     "intra_stage_solves": plan.stats.get("intra_stage_solves"),
                     "bottleneck_candidates": plan.stats.get("candidates"),
                     "seconds": time.perf_counter() - t0, "cpu_seconds": _cpu() - c0}
    row["peak_rss_gb"] = _rss_gb()
    print(f"{name}: search {plan.step_time:.3f} s/step (lower bound {plan.lower_bound:.6g}, gap {plan.gap:.2g}), "
          f"{row['search']['tflops_per_gpu']:.0f} TFLOP/s/GPU, "
          f"{row['search']['stage_map']}, m={plan.micro_batches} {plan.schedule} "
          f"({row['search']['seconds']:.0f} s, RSS {row['peak_rss_gb']:.2f} GB)", flush=True)
    return row


def _choices(plan) -> str:
    mc = plan.memory_choices
    names = [op.name.split("/")[-1] for op in plan.graph.operators]
    summ = mc.summary(names)
    parts = [f"{k}: {','.join(sorted(set(v)))}" for k, v in summ["state_sharding"].items()]
    if summ["recompute"]:
        parts.append(f"recompute: {','.join(sorted(set(summ['recompute'])))}")
    return "; ".join(parts) or "none"


def _layouts(plan) -> str:
    from shardplan.report.pipeline import _layout

    return _layout(plan)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="small", help=f"comma-separated, from {', '.join(CASES)}")
    ap.add_argument("--out", default="benchmarks/results/pipeline.json")
    ap.add_argument("--fallback", action="store_true",
                    help="stages that do not fit take Megatron's layouts (a heuristic), not their ZeRO/FSDP/recompute "
                         "optimum")
    ap.add_argument("--fit-rtol", type=float, default=FIT_RTOL,
                    help=f"relative tolerance of each memory-constrained stage solve (default {FIT_RTOL:g})")
    args = ap.parse_args(argv)
    opts = {"cutoff": 1, "orders": "row-major"}
    out = Path(args.out)
    rows = json.loads(out.read_text())["rows"] if out.exists() else []
    for name in args.cases.split(","):
        if name not in CASES:
            print(f"unknown case {name!r}; choose from {', '.join(CASES)}", file=sys.stderr)
            return 2
        row = run_case(name, opts, fallback=args.fallback, fit_rtol=args.fit_rtol)
        rows = [r for r in rows if r["case"] != name] + [row]
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"note": "seconds measured on a shared 2-core machine", "rows": rows},
                                  indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
