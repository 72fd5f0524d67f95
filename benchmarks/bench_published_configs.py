"""Published training configurations as recipes, against the default search, under one cost model.

Per case: the configuration as a recipe (:func:`shardplan.recipe.cost_recipe`: its predicted step time and peak
memory per device, and whether that fits the machine's memory), then the default planning call on the same model,
batch and machine (:func:`shardplan.plan` with nothing but ``batch=`` and ``sizes=``: its default work budget
``work_limit=3e7``): its plan in one line (:func:`shardplan.report.summary.recipe_words`), step time, proven lower
bound and gap, whether it stopped at the work limit, and plan ÷ recipe (below 1: the search's plan is faster).
Then the same call with the recipe's costed plan as its first incumbent (``plan(..., recipe=...)``; where the
published recipe does not fit 80 GiB, the same recipe with ``recompute=full``, which does: an incumbent must
fit): its answer is never slower than that recipe.

Both sides use the same cost model and the same options: every tensor in the machine's element size (no
``precision``), the machine's own overlap setting, ``runtime=shardplan``, no sequence parallelism (the default search
offers no deferred reductions: ``partial_sums=False``). The recipes keep what the sources state of the parallel
layout (tensor, context, pipeline, data, interleaving, expert degrees, the uneven end stages) and of memory only
what the source states (ZeRO stage, recomputation); they are not tuned to fit.

Each case runs in a forked child (:func:`benchmarks.limits.call_limited`) which records its own CPU seconds
(user + system, ``resource.getrusage``), wall seconds and peak RSS, the recipe's and the search's apart. The
machine this runs on has 2 cores shared with other jobs: CPU seconds are the steadier figure; the load average is
recorded before and after. The search's answer does not depend on the load (its budget counts work, not time).

Run:  PYTHONPATH=. python benchmarks/bench_published_configs.py [--cases NAME,...] [--jobs N] [--limit S]
Writes benchmarks/results/published_configs.json: the cases run replace their rows there, the others are kept,
and the run (cases, commit, load, wall) is added to its ``runs``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.limits import call_limited  # noqa: E402

OUT = Path(__file__).parent / "results" / "published_configs.json"

LLAMA3 = "Dubey et al. 2024, 'The Llama 3 Herd of Models', arXiv 2407.21783, Table 4 and §3.3.2"
NEMO = ("NVIDIA NeMo 24.07 performance summary, Llama 3 70B on 64 H100 (benchmarks/bench_fidelity_h100.py row "
        "nemo2407-llama3-70b-64: TP 4, PP 4, CP 2, VP 5, GBS 128, MBS 1, seq 8192)")
DEEPSEEK = ("DeepSeek-V3-like MoE (docs/models.md; DeepSeek-AI 2024 §4.2 batch of 15,360 sequences of 4,096) on "
            "1,024 H100 with PP 4 and EP 64: the recipe of tests/planning/test_moe_recipe.py "
            "(test_deepseek_v3_on_1024_h100_with_pipeline_4_and_expert_64) and docs/recipes.md")


@dataclass(frozen=True)
class Case:
    """One published configuration: the zoo model with ``sizes`` (``seq`` the tokens per sequence), ``devices``
    H100, the global ``batch`` in sequences, the ``recipe`` text and where it comes from; ``notes`` say what
    the recipe assumes where the source is silent."""

    name: str
    model: str
    devices: int
    batch: int
    seq: int
    recipe: str
    source: str
    sizes: tuple[tuple[str, Any], ...] = ()
    notes: tuple[str, ...] = ()
    fitting: str | None = None  # the recipe with recomputation added, when the published one does not fit

    @property
    def incumbent(self) -> str:
        """The recipe given to ``plan(recipe=)``: the published one, or its fitting variant (an incumbent must
        fit the budget)."""
        return self.fitting or self.recipe


LLAMA3_NOTES = ("first and last stage one block short (7 + 14 x 8 + 7 = 126 blocks, §3.3.2)",
                "FSDP as the paper describes it (optimizer state and gradients sharded, weights gathered once per "
                "step): zero=2",
                "micro-batch of 1 sequence (not stated); no recomputation (not stated); 1F1B (the paper's "
                "interleaving factor is not stated); no sequence parallelism (not stated)",
                "BF16 everything (no fp32 master weights: the same element size as the search's)")

CASES: tuple[Case, ...] = (
    Case("llama3-405b-8k-8192", "llama3-405b", 8192, 2048, 8192,
         "tp=8,pp=16,mbs=1,gbs=2048,first_stage_layers=7,last_stage_layers=7,zero=2",
         f"{LLAMA3}: 8,192 GPUs, TP 8, PP 16, DP 64, 16M tokens per step", (), LLAMA3_NOTES,
         "tp=8,pp=16,mbs=1,gbs=2048,first_stage_layers=7,last_stage_layers=7,zero=2,recompute=full"),
    Case("llama3-405b-128k-16384", "llama3-405b", 16384, 128, 131072,
         "tp=8,cp=16,pp=16,mbs=1,gbs=128,first_stage_layers=7,last_stage_layers=7,zero=2",
         f"{LLAMA3}: 16,384 GPUs at 131,072 tokens, TP 8, CP 16, PP 16, DP 8, 16M tokens per step",
         (("seq", 131072),), LLAMA3_NOTES + ("all-gather context parallelism (cp_algo=allgather, §3.3.2)",),
         "tp=8,cp=16,pp=16,mbs=1,gbs=128,first_stage_layers=7,last_stage_layers=7,zero=2,recompute=full"),
    Case("llama3-70b-64", "llama3-70b", 64, 128, 8192,
         "tp=4,cp=2,pp=4,vp=5,mbs=1,gbs=128,zero=1",
         NEMO, (), ("the distributed optimizer: zero=1; BF16 everything, no sequence parallelism, no TP "
                    "communication overlap, no FP8 (the published run has them; the default search offers none)",)),
    Case("deepseek-v3-1024", "deepseek-v3", 1024, 15360, 4096,
         "pp=4,ep=64,zero=1,first_stage_layers=13,recompute=full",
         DEEPSEEK, (), ("61 blocks: 13 on the first stage (with the embedding), 16 on each other",)),
)


def _usage() -> tuple[float, float]:
    """(CPU seconds of this process, user + system; its peak RSS in bytes)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_maxrss * 1024.0


def run_case(case: Case) -> dict[str, Any]:
    """In this (child) process: the recipe costed, the default planning call, then the call with the recipe (or
    its fitting variant) as its incumbent: one row of the table."""
    from shardplan.errors import ShardplanError
    from shardplan.machine import preset
    from shardplan.planner import plan
    from shardplan.recipe import cost_recipe
    from shardplan.report.summary import recipe_words

    sizes = dict(case.sizes) or None
    machine = preset("h100", case.devices)
    budget = float(machine.memory_bytes)
    c0, _ = _usage()
    t0 = time.perf_counter()
    rec = cost_recipe(case.model, machine, case.recipe, batch=case.batch, sizes=sizes)
    c1, rss1 = _usage()
    t1 = time.perf_counter()
    try:
        got: Any = plan(case.model, machine, batch=case.batch, sizes=sizes)
    except ShardplanError as e:
        got = str(e)
    c2, rss2 = _usage()
    t2 = time.perf_counter()
    fit = rec if case.fitting is None else cost_recipe(case.model, machine, case.fitting, batch=case.batch,
                                                          sizes=sizes)
    c3, _ = _usage()
    t3 = time.perf_counter()
    with_recipe = plan(case.model, machine, batch=case.batch, sizes=sizes, recipe=fit)
    c4, rss4 = _usage()
    t4 = time.perf_counter()
    return {"recipe_step_seconds": rec.step_time,
            "recipe_peak_bytes": float(rec.memory["peak_bytes"]),
            "recipe_fits": float(rec.memory["peak_bytes"]) <= budget,
            "recipe_micro_batches": rec.micro_batches, "recipe_schedule": rec.schedule,
            "recipe_words": recipe_words(rec),
            "recipe_cpu_seconds": c1 - c0, "recipe_wall_seconds": t1 - t0,
            "plan": _plan_row(got, rec, budget, c2 - c1, t2 - t1),
            "incumbent_recipe": case.incumbent,
            "incumbent_step_seconds": fit.step_time, "incumbent_peak_bytes": float(fit.memory["peak_bytes"]),
            "incumbent_fits": float(fit.memory["peak_bytes"]) <= budget,
            "plan_with_recipe": _plan_row(with_recipe, fit, budget, c4 - c3, t4 - t3),
            "peak_rss_bytes_after_recipe": rss1, "peak_rss_bytes_after_plan": rss2, "peak_rss_bytes": rss4,
            "budget_bytes": budget}


def _plan_row(got: Any, rec: Any, budget: float, cpu: float, wall: float) -> dict[str, Any]:
    """A planning call's answer (or its error's message), against ``rec``: the plan's step over the recipe's."""
    from shardplan.report.summary import recipe_words

    if isinstance(got, str):
        return {"error": got, "cpu_seconds": cpu, "wall_seconds": wall}
    st = got.stats
    lower = got.lower_bound
    return {
        "plan_words": recipe_words(got),
        "plan_step_seconds": got.step_time,
        "plan_lower_bound_seconds": lower,
        "plan_gap": None if lower is None else (got.step_time - lower) / got.step_time,
        "plan_peak_bytes": float(got.memory["peak_bytes"]),
        "plan_fits": float(got.memory["peak_bytes"]) <= budget,
        "plan_stages": got.num_stages, "plan_micro_batches": got.micro_batches, "plan_schedule": got.schedule,
        "plan_solver": got.solver,
        "stopped_at_work_limit": bool(st.get("stopped_at_work_limit")),
        "work_used": st.get("work_used"), "work_limit": st.get("work_limit"),
        "compared": st.get("compared"), "refused": st.get("refused"),
        "recipe_answered": st.get("recipe_answered"), "recipe_not_incumbent": st.get("recipe_not_incumbent"),
        "cpu_seconds": cpu, "wall_seconds": wall,
        "plan_over_recipe": got.step_time / rec.step_time,
    }


def row(case: Case, limit: float) -> dict[str, Any]:
    """The case's row: its inputs, and the child's result (or why there is none)."""
    status, got, wall = call_limited(run_case, (case,), limit)
    out: dict[str, Any] = {**asdict(case), "sizes": dict(case.sizes), "status": status, "child_wall_seconds": wall}
    if status == "ok":
        out.update(got)
    else:
        out["error"] = got
    return out


def _line(r: dict[str, Any]) -> str:
    if r["status"] != "ok":
        return f"{r['name']}: {r['status']} {r.get('error')}"
    gib = 2.0**30

    def part(p: dict[str, Any]) -> str:
        if "error" in p:
            return f"error ({p['error']}), CPU {p['cpu_seconds']:.0f} s"
        gap = p["plan_gap"]
        return (f"{p['plan_step_seconds']:.4g} s ({p['plan_words']}), bound {p['plan_lower_bound_seconds']:.4g}, "
                f"gap {'-' if gap is None else f'{100 * gap:.1f} %'}, work limit {p['stopped_at_work_limit']}, "
                f"x{p['plan_over_recipe']:.3f} of the recipe, CPU {p['cpu_seconds']:.0f} s")

    return (f"{r['name']}: recipe {r['recipe_step_seconds']:.4g} s, {r['recipe_peak_bytes'] / gib:.1f} GiB"
            f" ({'fits' if r['recipe_fits'] else 'DOES NOT FIT'}); plan: {part(r['plan'])}; incumbent "
            f"{r['incumbent_step_seconds']:.4g} s ({r['incumbent_peak_bytes'] / gib:.1f} GiB); plan(recipe=): "
            f"{part(r['plan_with_recipe'])}; wall {r['child_wall_seconds']:.0f} s, RSS "
            f"{r['peak_rss_bytes'] / gib:.1f} GiB")


def _commit() -> str | None:
    """The short commit of the tree the bench runs on (None outside a git checkout)."""
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _merged(out: Path, rows: list[dict[str, Any]], run: dict[str, Any]) -> dict[str, Any]:
    """The results file with ``rows`` written over the rows of the same cases (the others kept, in the order of
    :data:`CASES`) and ``run`` (which cases, commit, load, wall) added to its runs; a new file when there is none
    or it holds no runs."""
    old: dict[str, Any] = {}
    if out.exists():
        old = json.loads(out.read_text())
    if "runs" not in old:
        old = {}
    by_name = {r["name"]: r for r in old.get("cases", [])}
    by_name.update({r["name"]: r for r in rows})
    cases = [by_name[c.name] for c in CASES if c.name in by_name]
    return {"benchmark": "published_configs", "machine_preset": "h100", "cpu_count": os.cpu_count(),
            "platform": platform.platform(), "python": platform.python_version(),
            # plan(recipe=)'s answer against the recipe it was given, in every case
            "search_with_recipe_never_worse": all(r["status"] == "ok" and "error" not in r["plan_with_recipe"]
                                                  and r["plan_with_recipe"]["plan_over_recipe"] <= 1 + 1e-9
                                                  for r in cases),
            "runs": [*old.get("runs", []), run], **({"note": old["note"]} if "note" in old else {}),
            "cases": cases}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", help="comma-separated case names (default: all)")
    ap.add_argument("--jobs", type=int, default=1, help="cases run at once, each in its own child (default 1)")
    ap.add_argument("--limit", type=float, default=3600.0, help="wall seconds per case before it is skipped")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    names = [c.name for c in CASES]
    wanted = names if not args.cases else [s.strip() for s in args.cases.split(",") if s.strip()]
    bad = [n for n in wanted if n not in names]
    if bad:
        ap.error(f"unknown case {bad[0]!r}; cases: {', '.join(names)}")
    cases = [c for c in CASES if c.name in wanted]
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        rows = list(pool.map(lambda c: row(c, args.limit), cases))
    for r in rows:
        print(_line(r), flush=True)
    run = {"cases": [r["name"] for r in rows], "commit": _commit(), "jobs": args.jobs,
           "load_average_before": load0, "load_average_after": os.getloadavg(),
           "wall_seconds": time.perf_counter() - t0}
    doc = _merged(Path(args.out), rows, run)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
