"""The one-program memory-constrained search at scale: a zoo model on h100, as the planner calls it.

Usage: python benchmarks/bench_fit_scale.py [--label NAME] [--model NAME] [--work-limit W] [--time-limit S]
       [--incumbent S] [--busy] [devices ...]
(default model gpt3-175b, at its zoo batch (1536), devices 64 1024; e.g. ``--model llama3-405b 16384``)

Each device count runs in a fresh process (so its peak RSS is its own) and calls
:func:`shardplan.fit.solve_fit` exactly as :func:`shardplan.planner.plan` does for
``shardplan plan --model gpt3-175b -p N --machine h100``: the machine's memory as
the budget, the planner's micro-batch counts, the zoo model's cutoff. It records
wall and CPU seconds (``time.process_time``: the machine is shared, so wall time
is noisy), peak RSS, the step time, the proven bound and the status. ``--label``
names the code measured (e.g. ``before``/``after``; run with ``PYTHONPATH`` at the
tree to measure, as an absolute path; without it the installed ``shardplan``); the commit
of the imported ``shardplan`` is recorded beside it.
``--incumbent S``: the step of a plan known outside the one program (the planner gives the best uniform
pipeline's, costed first), passed as ``solve_fit(incumbent=S)``; the row records it and whether the one program
beat it. ``--work-limit W``: the search's work budget per micro-batch count (default
``FitOptions``'), ``--time-limit S``: a wall-clock limit as well (default none: the answer is then the same on
any machine and load). ``--busy``: a busy loop (``python -c "while 1: pass"``) runs beside the child for its
whole run, to show the answer does not depend on the load (the row records ``busy``).
Writes benchmarks/results/fit_scale.json (entries keyed by label and device count, and the model
when it is not GPT-3 175B, merged with what is there).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

OUT = Path(__file__).parent / "results" / "fit_scale.json"

CHILD = r"""
import hashlib, json, resource, sys, time
from shardplan.fit import FitOptions, solve_fit
from shardplan.machine import preset
from shardplan.models import get_model, model_spec
from shardplan.planner import micro_batch_counts
p, name = int(sys.argv[1]), sys.argv[3]
limit = None if sys.argv[2] == "none" else float(sys.argv[2])
incumbent = None if sys.argv[4] == "none" else float(sys.argv[4])
work = FitOptions().work_limit if sys.argv[5] == "default" else float(sys.argv[5])
batch = model_spec(name).batch
g = get_model(name, batch)
m = preset("h100", p)
ms = micro_batch_counts(None, batch)
t0, c0 = time.perf_counter(), time.process_time()
one = solve_fit(g, m, budget=m.memory_bytes, options=FitOptions(micro_batches=ms, time_limit=limit, work_limit=work),
                cutoff=model_spec(name).cutoff, incumbent=incumbent)
wall, cpu = time.perf_counter() - t0, time.process_time() - c0
st = one.solution.stats
print(json.dumps({"model": name, "batch": batch, "devices": p, "micro_batch_counts": list(ms), "time_limit_seconds": limit, "work_limit": work,
                  "work": st.get("work"),
                  "wall_seconds": wall, "cpu_seconds": cpu,
                  "build_seconds": one.build_seconds, "solve_seconds": one.solve_seconds,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "step_seconds": one.cost, "lower_bound_seconds": one.solution.bound,
                  "optimal": bool(one.solution.optimal), "micro_batches": one.memory_choices.micro_batches,
                  # layouts and memory choices of the plan, to tell equal plans apart from equal step times
                  "plan_digest": hashlib.sha256(repr((tuple(int(x) for x in one.assignment),
                                                      tuple(int(x) for x in one.memory_choices.choices))).encode()
                                                ).hexdigest()[:16],
                  "status": st.get("status"), "gap": st.get("gap"), "nodes": st.get("nodes"),
                  "dp_solves": st.get("dp_solves"), "incumbent": incumbent, "beats_incumbent": st.get("beats_incumbent"),
                  "per_micro_batches": [{k: d.get(k) for k in ("micro_batches", "status", "cost", "bound",
                                                               "lower_bound", "nodes", "dp_solves", "seconds")}
                                        for d in st.get("per_micro_batches", [])],
                  "load_average": list(__import__("os").getloadavg())}))
"""


def commit_of_import() -> str:
    """The commit (and whether dirty) of the tree the child imports ``shardplan`` from."""
    code = "import shardplan, os; print(os.path.dirname(os.path.dirname(shardplan.__file__)))"
    root = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=tempfile.gettempdir()).stdout.strip()
    head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return head.stdout.strip() + ("+dirty" if dirty else "")


def main(argv: list[str]) -> None:
    label, limit, devices, model, incumbent, work, busy = "current", "none", [], "gpt3-175b", "none", "default", False
    it = iter(argv)
    for a in it:
        if a == "--label":
            label = next(it)
        elif a == "--model":
            model = next(it)
        elif a == "--time-limit":
            limit = str(float(next(it)))
        elif a == "--work-limit":
            work = str(float(next(it)))
        elif a == "--busy":
            busy = True
        elif a == "--incumbent":
            incumbent = str(float(next(it)))
        else:
            devices.append(int(a))
    devices = devices or [64, 1024]
    results = json.loads(OUT.read_text()) if OUT.exists() else {}
    commit = commit_of_import()
    for p in devices:
        # run outside any tree: ``-c`` puts the working directory first on the path, before PYTHONPATH
        loop = subprocess.Popen([sys.executable, "-c", "while 1: pass"]) if busy else None
        try:
            out = subprocess.run([sys.executable, "-c", CHILD, str(p), limit, model, incumbent, work],
                                 capture_output=True, text=True, env=os.environ.copy(), cwd=tempfile.gettempdir())
        finally:
            if loop is not None:
                loop.kill()
                loop.wait()
        if out.returncode != 0:
            raise SystemExit(out.stderr)
        row = {"label": label, "commit": commit, "busy": busy, **json.loads(out.stdout.strip().splitlines()[-1])}
        results[f"{label}/p{p}" if model == "gpt3-175b" else f"{label}/{model}/p{p}"] = row
        print(f"{label} {model} p={p}: {row['wall_seconds']:.1f} s wall, {row['cpu_seconds']:.1f} s CPU, "
              f"{row['peak_rss_bytes'] / 2**30:.2f} GiB, step {row['step_seconds']:.6g} s "
              f"bound {row['lower_bound_seconds']:.8g} s, digest {row['plan_digest']} ({row['status']}, m={row['micro_batches']}, busy {busy})", flush=True)
        OUT.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
