"""Pipeline plans searched vs Megatron-LM's recipes as published, under the same cost model (JSON).

Rows: Megatron-LM's pipelined runs of Narayanan et al., SC'21, Table 1 (39.1B, 76.1B, 145.6B on the ``a100``
preset; source ``/work/shared/data/published-a100.md``), GPT-3 175B on 1,024 ``h100`` (no published run), and a
small case (GPT 1.3B on 64 a100) that finishes quickly. For each row:

* **measured**: the published step time, ``F / (GPUs × TFLOP/s per GPU)`` with the paper's F (recomputation
  included, :func:`shardplan.models.flops.megatron_flops`);
* **recipe predicted**: the recipe as it ran (tp, pp, vp, mbs, gbs, ``recompute=full``; the SC'21 rows'
  ``overlap=none``, Megatron-LM's local DDP reducing the gradients after the pipeline's flush, and
  ``grad_accum=autograd``, the fp16 gradients their code added micro-batch by micro-batch) costed through
  :func:`shardplan.recipe.cost_recipe`, and predicted / measured;
* **plan predicted**: the search's optimum under the constraints the recipe ran with: the recipe's runtime
  (:func:`shardplan.recipe.recipe_machine`: its overlaps and gradient accumulation), the same devices, the
  same global batch, the same memory per device (the preset's), the same full model (sequence 2048, vocabulary
  51200); the space: uniform sub-meshes of the listed stage counts, the listed micro-batch counts plus the
  recipe's ``gbs / (dp · mbs)``, 1F1B, interleaved (2 chunks and the recipe's) and ZB-H1; a stage whose
  time-optimal plan does not fit its in-flight micro-batches takes its memory-constrained optimum (ZeRO/FSDP
  and recomputation, each proven to the relative ``FIT_RTOL``; ``lower_bound_seconds`` and ``gap`` state what
  was proven for the whole space); with ``--fallback`` Megatron's layouts when they fit instead (a heuristic);
* **plan / recipe speedup** = recipe predicted / plan predicted, both by the same model: what the model says
  the search gains, not a measurement.

Model TFLOP/s per GPU counts forward + backward FLOPs without recomputation. Each row's search runs in a child
process; one still running after ``--row-limit`` seconds (default 180) is stopped and the row recorded as
skipped with the reason (its measured and recipe columns kept). ``recipe.without_recompute`` costs the same
recipe with ``recompute=none``: how much of the speedup is recomputation alone.

Run: ``PYTHONPATH=. python benchmarks/bench_pipeline.py --rows small,megatron-39b [--out
benchmarks/results/pipeline.json]`` (``--cases`` is the older name of ``--rows``).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.limits import call_limited
from shardplan.baselines import megatron
from shardplan.machine import preset
from shardplan.models import get_model
from shardplan.pipeline import pipeline_solve
from shardplan.recipe import Recipe, cost_recipe, recipe_machine

SOURCE = "/work/shared/data/published-a100.md"
SEQ = 2048  # every case (SC'21 Table 1 header in the source)


@dataclass(frozen=True)
class Case:
    """One row: the model, the machine, the recipe as run (or assumed) and the search's space.

    ``recipe``: the configuration costed through :func:`shardplan.recipe.cost_recipe` (Megatron-LM's layouts,
    its micro-batch size, recomputation and interleaving). ``measured_tflops``: the published TFLOP/s per GPU
    (None where the recipe never ran); the measured step time is ``F / (GPUs × TFLOP/s)`` with the paper's
    F (recomputation included, :func:`shardplan.models.flops.megatron_flops`). The search runs on the same
    devices, the same global batch, the same memory per device and the same full model; its micro-batch
    counts hold the recipe's ``gbs / (dp · mbs)`` and its interleaving the recipe's chunk count.
    """

    machine: str
    devices: int
    batch: int
    layers: int
    d_model: int
    heads: int
    recipe: str
    search_stages: tuple[int, ...]
    search_m: tuple[int, ...]
    measured_tflops: float | None
    source: str


T1 = "SC'21 Table 1 (Narayanan et al., arXiv 2104.04473)"
CASES = {
    "small": Case("a100", 64, 64, 24, 2048, 16, "tp=8,pp=2,mbs=1,gbs=64", (1, 2, 4, 8), (8, 16, 32), None,
                  "no published run: a small case that finishes quickly (the recipe is assumed: Megatron's "
                  "layouts, micro-batches of 1 sequence, no recomputation)"),
    "megatron-39b": Case("a100", 512, 1536, 48, 8192, 64, "tp=8,pp=2,mbs=4,gbs=1536,recompute=full,overlap=none,grad_accum=autograd", (2, 4),
                         (12, 48), 138.0, f"{T1}, 39.1B row"),
    "megatron-76b": Case("a100", 1024, 1792, 60, 10240, 80, "tp=8,pp=4,vp=3,mbs=2,gbs=1792,recompute=full,overlap=none,grad_accum=autograd",
                         (4, 8), (28, 56, 112), 140.0, f"{T1}, 76.1B row (5 layers per virtual stage: vp = 60/4/5)"),
    "megatron-146b": Case("a100", 1536, 2304, 80, 12288, 96, "tp=8,pp=8,vp=2,mbs=2,gbs=2304,recompute=full,overlap=none,grad_accum=autograd",
                          (8, 16, 32), (48, 96, 192), 148.0,
                          f"{T1}, 145.6B row (5 layers per virtual stage: vp = 80/8/5)"),
    "gpt3-175b-h100": Case("h100", 1024, 1536, 96, 12288, 96, "tp=8,pp=16,mbs=1,gbs=1536,recompute=full",
                           (8, 16, 32), (96, 192), None,
                           "no published run on h100: Megatron's SC'21 Table 2 configuration family (TP 8, MBS 1, "
                           "full recomputation) assumed on 1,024 h100"),
}


def _vocab(d: int) -> int:
    return 51200 if d != 2048 else 50304


def _build(case: "Case"):
    """The row's GPT at batch b. A row with a published run has Megatron-LM's kernels as it ran them
    (``kernels="megatron"``, as bench_fidelity's rows): the recipe and the plan are costed on the program that
    was measured."""
    vocab = _vocab(case.d_model)
    kernels = "megatron" if case.measured_tflops is not None else "fused"
    return lambda b: get_model("gpt", b, layers=case.layers, d_model=case.d_model, heads=case.heads, seq=SEQ,
                               vocab=vocab, kernels=kernels)


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


def measured_seconds(case: Case) -> float | None:
    """The published step time: the paper's F (recomputation included) / (GPUs × TFLOP/s per GPU)."""
    from shardplan.models.flops import megatron_flops

    if case.measured_tflops is None:
        return None
    f = float(megatron_flops(case.batch, SEQ, case.layers, case.d_model, _vocab(case.d_model), recompute=True))
    return f / (case.devices * case.measured_tflops * 1e12)


def recipe_row(case: Case, flops: float) -> dict[str, Any]:
    """The recipe as published, costed by :func:`cost_recipe` on the same machine and model as the search."""
    t0, c0 = time.perf_counter(), _cpu()
    rec = Recipe.parse(case.recipe)
    machine = preset(case.machine, case.devices)
    plan = cost_recipe(_build(case), machine, rec, batch=case.batch)
    peak = float(plan.memory["peak_bytes"])
    dp = case.devices // (rec.tp * rec.pp)
    bare = None
    if rec.recompute != "none":  # the same recipe without recomputation: what recomputing costs, by the model
        other = cost_recipe(_build(case), machine, replace(rec, recompute="none"),
                            batch=case.batch)
        bare = {"step_seconds": other.step_time, "peak_memory_gib": float(other.memory["peak_bytes"]) / 2**30,
                "fits": float(other.memory["peak_bytes"]) <= float(other.memory["budget_bytes"])}
    return {"recipe": case.recipe, "stages": rec.pp, "chunks": rec.vp, "tensor_parallel": rec.tp,
            "data_parallel": dp, "micro_batch_size": rec.mbs, "micro_batches": plan.micro_batches,
            "schedule": plan.schedule, "recompute": rec.recompute, "step_seconds": plan.step_time,
            "tflops_per_gpu": flops / plan.step_time / case.devices / 1e12,
            "peak_memory_gib": peak / 2**30, "fits": peak <= float(plan.memory["budget_bytes"]),
            "breakdown": dict(plan.breakdown), "without_recompute": bare,
            "seconds": time.perf_counter() - t0, "cpu_seconds": _cpu() - c0}


def search_row(case: Case, solve_opts: dict, fallback: bool, fit_rtol: float, flops: float) -> dict[str, Any]:
    """The search's optimum under the recipe's constraints: same devices, global batch, memory per device
    (the preset's) and model; the space holds the recipe's micro-batch count and chunk count."""
    t0, c0 = time.perf_counter(), _cpu()
    p = case.devices
    rec = Recipe.parse(case.recipe)
    machine = recipe_machine(rec, preset(case.machine, p))  # the recipe's runtime: the plan is searched on it too
    m_recipe = case.batch // (p // (rec.tp * rec.pp) * rec.mbs)
    ms = tuple(sorted({*case.search_m, m_recipe}))
    chunks = tuple(sorted({2, *([rec.vp] if rec.vp > 1 else [])}))
    sizes = tuple(sorted({p // s for s in case.search_stages if p % s == 0}))
    memory = ({"fallback": lambda t: megatron(t, max(1, t.machine.num_devices // 8))} if fallback else
              {"memory_choices": True, "fit_rtol": fit_rtol, "fit_time_limit": 600.0})
    res = pipeline_solve(_build(case), case.batch, machine, micro_batches=ms,
                         uniform=True, interleave=chunks, sizes=sizes, schedules=("1f1b", "interleaved", "zb-h1"),
                         **memory, **solve_opts)
    plan = res.plan
    names = res.unit_names()
    return {"stages": plan.num_stages // plan.chunks, "schedule": plan.schedule, "chunks": plan.chunks,
            "micro_batches": plan.micro_batches, "stage_map": _stages_line(plan, names),
            "layouts": sorted({_layouts(s.cost.detail) for s in plan.stages}),
            "memory": "fallback: Megatron's layouts where the time-optimal stage does not fit" if fallback
            else f"memory_choices: exact per-stage ZeRO/FSDP/recompute optimum, fit_rtol {fit_rtol:g}",
            "budget_gib": machine.memory_bytes / 2**30 if machine.memory_bytes else None,
            "stages_with_memory_choices": sum(getattr(s.cost.detail, "memory_choices", None) is not None
                                              for s in plan.stages),
            "memory_choice_lines": sorted({_choices(s.cost.detail) for s in plan.stages
                                           if getattr(s.cost.detail, "memory_choices", None) is not None}),
            "fit_unproven": plan.stats.get("fit_unproven", 0),
            "lower_bound_seconds": plan.lower_bound, "gap": plan.gap,
            "family_lower_bounds": plan.stats.get("family_lower_bounds", {}),
            "step_seconds": plan.step_time, "simulated_step_seconds": res.simulated_step_time(),
            "tflops_per_gpu": flops / plan.step_time / p / 1e12,
            "memory_per_stage_gib": [s.memory / 2**30 for s in plan.stages],
            "space": {"sub_mesh_sizes": sizes, "micro_batches": ms, "uniform": True, "interleave": chunks,
                      "schedules": ["1f1b", "interleaved", "zb-h1"]},
            "seconds": time.perf_counter() - t0, "cpu_seconds": _cpu() - c0}


def recipe_part(name: str) -> dict:
    """A row's measured and recipe columns (seconds to compute): measured (where published), the recipe
    predicted and predicted / measured."""
    case = CASES[name]
    flops = _model_flops(_build(case)(case.batch))
    measured = measured_seconds(case)
    row: dict = {"case": name, "source": case.source, "machine": case.machine, "devices": case.devices,
                 "batch": case.batch, "layers": case.layers, "d_model": case.d_model, "heads": case.heads,
                 "seq": SEQ, "vocab": _vocab(case.d_model), "model_flops_per_step": flops,
                 "measured_seconds": measured, "measured_tflops_per_gpu_paper_flops": case.measured_tflops}
    row["recipe"] = recipe_row(case, flops)
    pred = row["recipe"]["step_seconds"]
    row["recipe_over_measured"] = pred / measured if measured else None
    print(f"{name}: measured {_s(measured)}; recipe {case.recipe} predicted {pred:.3f} s"
          + (f" ({pred / measured:.3f} x measured)" if measured else "")
          + f", fits: {row['recipe']['fits']} ({row['recipe']['seconds']:.0f} s)", flush=True)
    return row


def search_part(name: str, solve_opts: dict, fallback: bool = False, fit_rtol: float = FIT_RTOL) -> dict:
    """A row's search columns: the plan found and the peak RSS of the search."""
    case = CASES[name]
    flops = _model_flops(_build(case)(case.batch))
    return {"search": search_row(case, solve_opts, fallback, fit_rtol, flops), "peak_rss_gb": _rss_gb()}


def run_case(name: str, solve_opts: dict, recipe_only: bool = False, fallback: bool = False,
             fit_rtol: float = FIT_RTOL, limit: float | None = None) -> dict:
    """One row: measured (where published), the recipe predicted (and predicted / measured), the plan found,
    and the plan's speedup over the recipe (recipe step / plan step, both under the same model). The search
    runs in a child process when ``limit`` is given; one still running after ``limit`` seconds is stopped and
    the row keeps its measured and recipe columns, with ``status`` "skipped" and the reason."""
    row = recipe_part(name)
    row["status"] = "done"
    if recipe_only:
        return row
    kwargs = {"solve_opts": solve_opts, "fallback": fallback, "fit_rtol": fit_rtol}
    got = search_part(name, **kwargs) if limit is None else run_limited(name, kwargs, limit)
    if "search" not in got:
        row.update(got)
        return row
    row.update(got)
    pred, found = row["recipe"]["step_seconds"], row["search"]["step_seconds"]
    row["plan_speedup_over_recipe"] = pred / found
    print(f"{name}: plan {found:.3f} s/step (gap {row['search']['gap']:.2g}), {row['search']['stage_map']}, "
          f"m={row['search']['micro_batches']} {row['search']['schedule']}: {pred / found:.3f}x the recipe's speed "
          f"under the same model ({row['search']['seconds']:.0f} s, RSS {row['peak_rss_gb']:.2f} GB)", flush=True)
    return row


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.3f} s"


def run_limited(name: str, kwargs: dict, limit: float) -> dict:
    """:func:`search_part` in a child process, stopped after ``limit`` seconds and then recorded as skipped."""
    status, got, seconds = call_limited(lambda: search_part(name, **kwargs), (), limit)
    if status == "error":
        return {"status": "error", "reason": f"search: {got}"}
    if status == "timeout":
        return {"status": "skipped", "reason": f"search not run to the end: it did not finish within the row limit "
                                               f"of {limit:.0f} s on this machine (2 cores shared with other work)",
                "search_seconds_before_stop": seconds}
    return got


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
    ap.add_argument("--rows", "--cases", dest="rows", default="small",
                    help=f"comma-separated, from {', '.join(CASES)} (--cases: the older name)")
    ap.add_argument("--out", default="benchmarks/results/pipeline.json")
    ap.add_argument("--fallback", action="store_true",
                    help="stages that do not fit take Megatron's layouts (a heuristic), not their ZeRO/FSDP/recompute "
                         "optimum")
    ap.add_argument("--fit-rtol", type=float, default=FIT_RTOL,
                    help=f"relative tolerance of each memory-constrained stage solve (default {FIT_RTOL:g})")
    ap.add_argument("--recipe-only", action="store_true", help="cost the recipes only, no search")
    ap.add_argument("--row-limit", type=float, default=180.0,
                    help="seconds a row's search may run before it is stopped and the row recorded as skipped, "
                         "its measured and recipe columns kept (default 180)")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.rows.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"unknown row {unknown[0]!r}; choose from {', '.join(CASES)}", file=sys.stderr)
        return 2
    opts = {"cutoff": 1, "orders": "row-major"}
    kwargs = {"solve_opts": opts, "recipe_only": args.recipe_only, "fallback": args.fallback,
              "fit_rtol": args.fit_rtol, "limit": args.row_limit}
    out = Path(args.out)
    rows = json.loads(out.read_text())["rows"] if out.exists() else []
    for name in names:
        row = run_case(name, **kwargs)
        if row["status"] != "done":
            print(f"{name}: {row['status']}: {row['reason']}", file=sys.stderr)
        rows = [r for r in rows if r["case"] != name] + [row]
        rows.sort(key=lambda r: list(CASES).index(r["case"]) if r["case"] in CASES else len(CASES))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"note": NOTE, "rows": rows}, indent=2) + "\n")
    return 0


NOTE = ("seconds measured on a shared 2-core machine; measured step times from " + SOURCE + " (F / (GPUs x "
        "TFLOP/s per GPU), the paper's F with recomputation); recipe predicted by shardplan.recipe.cost_recipe; "
        "plan_speedup_over_recipe = recipe predicted / plan predicted, both under the same cost model")


if __name__ == "__main__":
    sys.exit(main())
