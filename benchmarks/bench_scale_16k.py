"""The per-operator plan on the largest published meshes: Llama 3 405B on 8,192 and 16,384 h100, Llama 3 8B on 1,024.

Each case runs the command a user runs, in a fresh interpreter, end to end (model, layouts, cost tables,
the exact search with the memory choices, the report)::

    shardplan plan --model llama3-405b -p 16384 --machine h100 --stages off --json PLAN

(and the same with ``--no-fit``: the layouts alone, memory reported, not constrained) and records its CPU seconds (user + system of the child), wall seconds, peak RSS, the plan in one line
(the report's ``Plan:`` line), its predicted step time, memory per device, lower bound and gap. Beside it,
Llama 3's published configuration for the same run (Dubey et al. 2024, Table 4: 8K tokens, 16M tokens per
step = 2,048 sequences; tensor 8 x pipeline 16 x data 64 on 8,192 GPUs, data 128 on 16,384; one sequence
per micro-batch; the first and last stages one block short, 7 + 8 x 14 + 7 = 126 blocks) is costed by the
same model (:func:`shardplan.recipe.cost_recipe`): its step time and memory per device, as published and
with full recomputation (what makes it fit in 80 GiB under this model).

The machine this runs on has 2 cores shared with other jobs: wall times vary with the load (reported with
the load average); CPU seconds are the steadier figure. The memory search's time limit is wall-clock
(60 s per micro-batch count), so under heavy load it may stop with a gap, reported.

``--pipelines``: instead, the command's default (the one program, then the pipeline search over stage counts,
sub-meshes, micro-batch counts and schedules), sent SIGINT at ``--timeout`` wall seconds so that it answers with
its best plan so far and its proven gap; recorded as the case's ``pipelines`` row (its last progress lines in
``log``), the other rows kept.

``--time-limit S``: instead, the command's default with ``--time-limit S`` (the whole planner, the search stopped
as by Ctrl-C after S wall seconds), under ``/usr/bin/time -v`` (wall, user + system CPU, peak RSS), with the
code of ``--tree`` (default this checkout; e.g. another worktree, to measure main beside a branch), recorded as
the case's ``time_limit_S/LABEL`` row: the plan, step and memory lines, the bound and gap, the planner's log
(progress lines dropped), the load average before and after. ``--interrupt S``: the same without ``--time-limit``,
sent SIGINT after S wall seconds unless it has finished (row ``no_limit_sigint_S/LABEL``: ``sigint_sent`` says which).

Run:  PYTHONPATH=. python benchmarks/bench_scale_16k.py [--cases llama3-405b-16384,...] [--pipelines --timeout S]
      [--time-limit S | --interrupt S] [--tree PATH] [--label NAME]
Writes benchmarks/results/scale_16k.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OUT = Path(__file__).parent / "results" / "scale_16k.json"
ROOT = Path(__file__).resolve().parent.parent

PUBLISHED = "tp=8,pp=16,mbs=1,first_stage_layers=7,last_stage_layers=7"
CASES = {
    "llama3-405b-16384": {"model": "llama3-405b", "p": 16384, "recipe": PUBLISHED + ",dp=128"},
    "llama3-405b-8192": {"model": "llama3-405b", "p": 8192, "recipe": PUBLISHED + ",dp=64"},
    "llama3-8b-1024": {"model": "llama3-8b", "p": 1024, "recipe": None},
    "gpt3-175b-1024": {"model": "gpt3-175b", "p": 1024, "recipe": None},
}

_PROBE = """
import json, resource, signal, subprocess, sys, time
t = float(sys.argv[1])
w = time.perf_counter()
if sys.argv[2] == "--interrupt":  # SIGINT (Ctrl-C) at the limit: the command answers with its best plan so far
    child = subprocess.Popen(sys.argv[3:], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        got = child.communicate(timeout=t)
    except subprocess.TimeoutExpired:
        child.send_signal(signal.SIGINT)
        got = child.communicate()
    out = subprocess.CompletedProcess(child.args, child.returncode, got[0], got[1])
else:
    try:
        out = subprocess.run(sys.argv[2:], capture_output=True, text=True, timeout=t)
    except subprocess.TimeoutExpired as e:
        out = subprocess.CompletedProcess(e.cmd, 124, "", f"timed out after {t:g} s")
w = time.perf_counter() - w
r = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"rc": out.returncode, "cpu": r.ru_utime + r.ru_stime, "wall": w, "rss_mb": r.ru_maxrss / 1024,
                  "stdout": out.stdout, "stderr": out.stderr[-2000:]}))
"""


def _child(cmd: list[str], timeout: float, interrupt: bool = False) -> dict:
    """Run ``cmd`` under a probe interpreter: its return code (124 past ``timeout`` wall seconds; with
    ``interrupt``, SIGINT at ``timeout`` and the command's own answer), CPU and wall seconds, peak RSS, output."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", _PROBE, str(timeout), *(["--interrupt"] if interrupt else []), *cmd],
                         check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout)


def plan_case(spec: dict, fit: bool, timeout: float, stages: bool = False) -> dict:
    """``shardplan plan ... --stages off`` (``--no-fit`` unless ``fit``: layouts only, memory reported); with
    ``stages`` the command's default (the one program, then the pipeline search), interrupted by SIGINT at
    ``timeout`` wall seconds (the best plan found by then, with its proven gap)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.json"
        args = ["plan", "--model", spec["model"], "-p", str(spec["p"]), "--machine", "h100",
                *([] if stages else ["--stages", "off"]), *([] if fit else ["--no-fit"]), "--json", str(path)]
        load = os.getloadavg()[0]
        r = _child([sys.executable, "-m", "shardplan.cli", *args], timeout, interrupt=stages)
        row = {"cli": "shardplan " + " ".join(a for a in args[:-2]), "rc": r["rc"], "cpu_s": round(r["cpu"], 2),
               "wall_s": round(r["wall"], 2), "peak_rss_mb": round(r["rss_mb"], 1), "load_average_1m": round(load, 1),
               "load_average_1m_after": round(os.getloadavg()[0], 1)}
        if stages:
            row["log"] = [ln for ln in r["stderr"].splitlines() if ln.strip()][-12:]
        if r["rc"] != 0:
            row["error"] = r["stderr"].strip().splitlines()[-1:]
            return row
        plan = json.loads(path.read_text())
        lines = r["stdout"].splitlines()
        row["plan"] = next((ln[len("Plan: "):] for ln in lines if ln.startswith("Plan: ")), None)
        row["step_line"] = next((ln for ln in lines if ln.startswith("Step time: ")), None)
        row["memory_line"] = next((ln for ln in lines if ln.startswith("Memory per device: ")), None)
        row.update(_plan_numbers(plan))
    return row


def _plan_numbers(plan: dict) -> dict:
    mem = plan.get("memory", {})
    stats = plan.get("stats", {})
    out = {"step_time_s": plan.get("step_time_seconds"), "lower_bound_s": plan.get("lower_bound_seconds"),
           "gap": plan.get("gap"),
           "peak_bytes": mem.get("peak_bytes"), "budget_bytes": mem.get("budget_bytes")}
    if stats.get("stages_searched"):
        out.update(stages=[[*s.get("units", []), s.get("devices", [None, None])[1]] for s in plan.get("stages", [])],
                   micro_batches=plan.get("micro_batches"), schedule=plan.get("schedule"),
                   compared=stats.get("compared"), interrupted=stats.get("interrupted"),
                   pipeline_lower_bound_s=stats.get("pipeline_lower_bound"),
                   sizes_not_searched=stats.get("pipeline_sizes_not_searched"))
    return out


def timed_case(spec: dict, limit: float | None, tree: Path, timeout: float, interrupt: float | None = None) -> dict:
    """``shardplan plan --model M -p P --machine h100 --time-limit S`` with the code of ``tree``, under
    ``/usr/bin/time -v``: its resources, report lines and plan numbers (:func:`_plan_numbers`). ``limit`` None:
    without ``--time-limit``, sent SIGINT after ``interrupt`` wall seconds unless it has finished (the search's
    Ctrl-C path: the best plan so far and its proven bound)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.json"
        args = ["plan", "--model", spec["model"], "-p", str(spec["p"]), "--machine", "h100",
                *(["--time-limit", f"{limit:g}"] if limit is not None else [])]
        commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        load = os.getloadavg()
        child = subprocess.Popen(["/usr/bin/time", "-v", sys.executable, "-m", "shardplan.cli", *args, "--json",
                                  str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env={**os.environ, "PYTHONPATH": str(tree)}, cwd=tmp, start_new_session=True,
                                 # a background job inherits SIGINT ignored, which Python then keeps: restore it so
                                 # that the interrupt reaches the planner as a KeyboardInterrupt
                                 preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        sent = False
        try:
            stdout, stderr = child.communicate(timeout=interrupt if interrupt is not None else timeout)
        except subprocess.TimeoutExpired:
            if interrupt is None:
                child.kill()
                raise
            # GNU time ignores SIGINT while it waits: the signal reaches the planner, which answers as on Ctrl-C
            os.killpg(child.pid, signal.SIGINT)
            sent = True
            stdout, stderr = child.communicate(timeout=timeout)
        out = subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr)
        err = out.stderr.replace("\r", "\n").splitlines()

        def field(name: str) -> str:
            return next(ln.split(": ", 1)[1] for ln in err if ln.strip().startswith(name))

        wall = field("Elapsed (wall clock) time").split(":")
        row = {"cli": "shardplan " + " ".join(args), "tree": str(tree), "commit": commit + ("+dirty" if dirty else ""),
               "rc": out.returncode, **({"sigint_after_s": interrupt, "sigint_sent": sent} if limit is None else {}),
               "wall_s": round(sum(float(x) * 60 ** i for i, x in enumerate(reversed(wall))), 2),
               "cpu_s": round(float(field("User time")) + float(field("System time")), 2),
               "peak_rss_mb": round(int(field("Maximum resident set size")) / 1024, 1),
               "load_average_before": [round(x, 2) for x in load],
               "load_average_after": [round(x, 2) for x in os.getloadavg()],
               "log": [ln for ln in err if ln.strip() and " | " not in ln and not ln.startswith("\t")
                       and "Command being timed" not in ln],
               # where the search was when it stopped (the last progress line)
               "last_progress": next((ln.strip() for ln in reversed(err) if " | " in ln), None)}
        if out.returncode != 0:
            return row
        lines = out.stdout.splitlines()
        row["plan"] = next((ln[len("Plan: "):] for ln in lines if ln.startswith("Plan: ")), None)
        row["step_line"] = next((ln for ln in lines if ln.startswith("Step time: ")), None)
        row["memory_line"] = next((ln for ln in lines if ln.startswith("Memory per device: ")), None)
        plan = json.loads(path.read_text())
        row.update(_plan_numbers(plan))
        stats = plan.get("stats", {})
        row.update(seed_step_s=stats.get("seed_step"), one_program_none_better_s=stats.get("one_program_none_better"),
                   compared=stats.get("compared"), interrupted=stats.get("interrupted"))
    return row


def recipe_case(model: str, p: int, recipe: str, tree: Path = ROOT) -> dict:
    """The recipe costed in a fresh interpreter (as ``shardplan recipe`` does), its step time and memory."""
    code = ("import json, sys, resource, time; from shardplan.machine import preset; "
            "from shardplan.recipe import cost_recipe; c = time.process_time(); "
            "r = cost_recipe(sys.argv[1], preset('h100', int(sys.argv[2])), sys.argv[3]); "
            "print(json.dumps({'step_time_s': r.step_time, 'peak_bytes': r.memory['peak_bytes'], "
            "'cpu_s': time.process_time() - c}))")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", code, model, str(p), recipe], capture_output=True, text=True, env=env,
                         check=False)
    if out.returncode != 0:
        return {"recipe": recipe, "error": out.stderr.strip().splitlines()[-1:]}
    return {"recipe": recipe, **json.loads(out.stdout.strip().splitlines()[-1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--timeout", type=float, default=1800.0, help="wall seconds per command (default 1800)")
    ap.add_argument("--no-fit-only", action="store_true", help="only the layouts-only plans (no memory search)")
    ap.add_argument("--pipelines", action="store_true",
                    help="only the command's default plan (one program, then the pipeline search), SIGINT at --timeout")
    ap.add_argument("--time-limit", type=float, help="only the command with --time-limit S, under /usr/bin/time -v")
    ap.add_argument("--interrupt", type=float,
                    help="only the command without a limit, under /usr/bin/time -v, SIGINT after S wall seconds "
                         "unless it has finished (row no_limit_sigint_S/LABEL)")
    ap.add_argument("--tree", default=str(ROOT), help="the checkout whose code --time-limit runs (default this one)")
    ap.add_argument("--label", default="this", help="the name of the --time-limit row's code (e.g. main, branch)")
    args = ap.parse_args()
    whole = json.loads(OUT.read_text()) if OUT.exists() else {}  # other top-level entries are kept as they are
    rows = whole.get("cases", {})
    for name in args.cases.split(","):
        spec = CASES[name]
        t0 = time.perf_counter()
        if args.time_limit is not None or args.interrupt is not None:
            row = {**rows.get(name, {"case": name, "model": spec["model"], "p": spec["p"], "machine": "h100"})}
            got = timed_case(spec, args.time_limit, Path(args.tree).resolve(), args.timeout, args.interrupt)
            if spec["recipe"]:
                # the published configuration with full recomputation (what fits in 80 GiB under this model),
                # costed now by the code measured
                got["published_recompute_full"] = recipe_case(spec["model"], spec["p"], spec["recipe"]
                                                              + ",recompute=full", Path(args.tree).resolve())
                published = got["published_recompute_full"].get("step_time_s")
                if published and got.get("step_time_s"):
                    got["over_published_recompute_full"] = round(got["step_time_s"] / published, 4)
            key = (f"time_limit_{args.time_limit:g}" if args.time_limit is not None
                   else f"no_limit_sigint_{args.interrupt:g}")
            row[f"{key}/{args.label}"] = got
            rows[name] = row
            print(json.dumps(got, indent=1), flush=True)
            continue
        if args.pipelines:  # the earlier rows of the case are kept
            row = {**rows.get(name, {"case": name, "model": spec["model"], "p": spec["p"], "machine": "h100"}),
                   "pipelines": plan_case(spec, True, args.timeout, stages=True)}
        else:
            row = {"case": name, "model": spec["model"], "p": spec["p"], "machine": "h100",
                   "layouts_only": plan_case(spec, False, args.timeout)}
        if not args.no_fit_only and not args.pipelines:
            row["fit"] = plan_case(spec, True, args.timeout)
        if spec["recipe"]:
            row["published"] = recipe_case(spec["model"], spec["p"], spec["recipe"])
            row["published_recompute_full"] = recipe_case(spec["model"], spec["p"], spec["recipe"] + ",recompute=full")
            for key in ("layouts_only", "fit", "pipelines"):
                got = row.get(key, {}).get("step_time_s")
                if got is not None and "step_time_s" in row["published"]:
                    row[key]["over_published"] = round(got / row["published"]["step_time_s"], 4)
        row["bench_wall_s"] = round(time.perf_counter() - t0, 1)
        rows[name] = row
        print(json.dumps(row, indent=1), flush=True)
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps({**whole, "host": platform.node(), "python": platform.python_version(),
                               "cpus": os.cpu_count(), "cases": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
