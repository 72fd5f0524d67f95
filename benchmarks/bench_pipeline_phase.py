"""The pipeline phase of ``shardplan plan`` alone (JSON): the search after the one program, given the one program's
step and its proven bound at one micro-batch, as :func:`shardplan.planner.plan` hands them over.

``shardplan plan --model M -p P --machine h100`` first solves the one program (``shardplan.fit``, measured by
``bench_scale_pipeline.py`` end to end) and then the pipeline space with its defaults (every micro-batch count
that divides the batch, 1F1B and ZB-H1, memory choices). This benchmark times the second part in its own
process, with the one program's step and bound computed once per row and kept in ``--cache`` (they do not
depend on the pipeline search), so a change to the pipeline search is measured on its own: CPU seconds (the
machine is shared: wall seconds say more about the load), wall seconds, the process's peak resident memory, the
plan (stages, sizes, m, schedule) or "none beats the one program", the step, the proven bound of the pipeline
space and the gap, the intra-stage and memory-constrained solves and the stages the solve-free bounds left
unsolved (docs/pipeline.md, *Solve-free stage bounds*). A row past ``--limit`` CPU seconds gets SIGINT: the
search returns its best plan and the bound it proved, recorded as ``interrupted``. A thread reads the process's
resident set every second: ``memory_samples`` keeps one every ``--sample`` seconds (wall and CPU seconds, bytes,
where the search was), next to the most states a stage DP's memo held (``dp_memo_entries_max``;
docs/pipeline.md, *The memo's memory*).

Run: ``PYTHONPATH=. python benchmarks/bench_pipeline_phase.py [--rows gpt3-p1024] [--out
benchmarks/results/pipeline_phase.json]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.record import write_result

ROWS: dict[str, dict[str, Any]] = {
    "gpt3-p1024": {"model": "gpt3-175b", "p": 1024},
    "gpt3-p64": {"model": "gpt3-175b", "p": 64},
}


def one_program(model: str, p: int, cache: Path) -> dict[str, Any]:
    """The one program's step and its proven bound at one micro-batch (as the planner computes them), cached."""
    key = f"{model}-p{p}"
    got = json.loads(cache.read_text()) if cache.exists() else {}
    if key not in got:
        from shardplan import preset
        from shardplan.fit import FitOptions, solve_fit
        from shardplan.models import model_spec
        from shardplan.planner import _one_micro_batch_bound, from_spmd, micro_batch_counts

        spec = model_spec(model)
        machine = preset("h100", p)
        t0 = time.process_time()
        one = solve_fit(spec.build(spec.batch), machine, budget=machine.memory_bytes,
                        options=FitOptions(micro_batches=micro_batch_counts(None, spec.batch)), cutoff=spec.cutoff,
                        orders="auto")
        got[key] = {"step": from_spmd(one).step_time, "lower": _one_micro_batch_bound(one),
                    "cpu_seconds": time.process_time() - t0}
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(got, indent=1) + "\n")
    return got[key]


def resident_bytes() -> int:
    """This process's resident set now (Linux ``/proc``; 0 where it cannot be read)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def sample_memory(tracker: Any, every: float, out: list[dict[str, Any]], stop: threading.Event) -> None:
    """Read the resident set every second until ``stop``; append one sample every ``every`` seconds and one at
    each new peak (wall and CPU seconds since the start, bytes, the search's phase and detail)."""
    t0, c0 = time.perf_counter(), time.process_time()
    peak, last = 0, -math.inf
    while not stop.wait(1.0):
        now, rss = time.perf_counter() - t0, resident_bytes()
        if rss > peak or now - last >= every:
            if now - last >= every or rss > peak * 1.05:
                out.append({"seconds": round(now, 1), "cpu_seconds": round(time.process_time() - c0, 1),
                            "rss_bytes": rss, "where": f"{tracker.phase} {tracker.detail}".strip()})
                last = now
            peak = max(peak, rss)


def counts(given: str, batch: int) -> tuple[int, ...]:
    """The micro-batch counts of a row: ``default`` (the planner's), ``all`` (every divisor of the batch) or a
    comma-separated list."""
    from shardplan.planner import micro_batch_counts

    if given == "default":
        return micro_batch_counts(None, batch)
    if given == "all":
        return tuple(m for m in range(1, batch + 1) if batch % m == 0)
    return micro_batch_counts([int(x) for x in given.split(",")], batch)


def run_row(name: str, spec: dict[str, Any], cache: Path, limit: float, micro_batches: str = "default",
            seeds: int | None = None, sample: float = 10.0) -> dict[str, Any]:
    """The pipeline phase of one row in this process (run each row in its own process for its peak memory)."""
    from shardplan import preset
    from shardplan.models import model_spec
    from shardplan.pipeline.api import pipeline_solve
    from shardplan.pipeline.progress import Progress
    from shardplan.pipeline.search import SEED_EVALUATIONS

    one = one_program(spec["model"], spec["p"], cache)
    model = model_spec(spec["model"])
    machine = preset("h100", spec["p"])
    lines: list[str] = []
    tracker = Progress(lines.append)
    tracker.improved(one["step"])
    # Ctrl-C as a KeyboardInterrupt even when started in the background (which inherits SIGINT ignored)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # again every 5 CPU s: an interrupt that lands in a memory-constrained stage solve stops that solve only
    signal.setitimer(signal.ITIMER_PROF, limit, 5.0)  # SIGPROF after `limit` CPU seconds: stop the search there
    signal.signal(signal.SIGPROF, lambda *_: signal.raise_signal(signal.SIGINT))
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0, c0 = time.perf_counter(), time.process_time()
    status = "ok"
    ms = counts(micro_batches, model.batch)
    seeds = SEED_EVALUATIONS if seeds is None else seeds
    samples: list[dict[str, Any]] = []
    stop = threading.Event()
    threading.Thread(target=sample_memory, args=(tracker, sample, samples, stop), daemon=True).start()
    try:
        res = pipeline_solve(lambda b: model.build(b), model.batch, machine,
                             micro_batches=ms, schedules=("1f1b", "zb-h1"), seeds=seeds,
                             budget=machine.memory_bytes, memory_choices=True, cutoff=model.cutoff, orders="auto",
                             progress=tracker, one_program_lower=one["lower"])
    except KeyboardInterrupt:
        res, status = None, "interrupted (no pipeline found)"
    signal.setitimer(signal.ITIMER_PROF, 0)
    stop.set()
    row: dict[str, Any] = {
        "row": name, "model": spec["model"], "devices": spec["p"], "machine": "h100",
        "one_program_step_seconds": one["step"], "one_program_lower_m1": one["lower"],
        "cpu_seconds": round(time.process_time() - c0, 2), "seconds": round(time.perf_counter() - t0, 2),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_rss_before_bytes": rss0, "limit_cpu_seconds": limit, "last_progress": lines[-1] if lines else None,
        "micro_batches": list(ms), "seeds": seeds, "progress_lines": lines[-40:], "memory_samples": samples,
    }
    if res is None:
        row.update(status=status, plan=None, pipeline_space_lower_bound=tracker.bound
                   if status == "ok" else tracker.space_bound)
        if status == "ok":
            row["plan"] = "none beats the one program"
            row["gap_vs_one_program"] = max(0.0, 1 - tracker.bound / one["step"])
        return row
    p = res.plan
    st = p.stats
    row.update(status="interrupted" if st.get("interrupted") else "ok",
               plan=f"{p.num_stages} stages on {[s.devices for s in p.stages]}, units "
                    f"{[(s.first, s.end) for s in p.stages]}, m={p.micro_batches}, {p.schedule}",
               step_time_seconds=p.step_time, lower_bound_seconds=p.lower_bound, gap=p.gap,
               stats={k: st.get(k) for k in ("intra_stage_solves", "fit_evaluations", "stages_skipped_by_floor",
                                             "zb_boxes", "zb_dp_states", "dp_memo_entries_max", "candidates",
                                             "parts_closed_by_floor", "parts_done", "parts_total",
                                             "family_lower_bounds", "zb_dp_reused", "stand_ins_from_fewer",
                                             "fits_from_fewer")})
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="gpt3-p1024", help=f"comma-separated, of {', '.join(ROWS)}")
    ap.add_argument("--limit", type=float, default=600.0, help="CPU seconds before SIGINT")
    ap.add_argument("--cache", default="benchmarks/results/pipeline_phase_one_program.json")
    ap.add_argument("--out", default="benchmarks/results/pipeline_phase.json")
    ap.add_argument("--micro-batches", default="default",
                    help="default (the planner's), all (every divisor of the batch) or a comma-separated list")
    ap.add_argument("--seeds", type=int, default=None, help="uniform seeds costed first (default: the search's)")
    ap.add_argument("--sample", type=float, default=10.0, help="seconds between two memory samples kept")
    ap.add_argument("--label", default=None, help="a note kept in each row (e.g. which tree the search ran)")
    ap.add_argument("--row", help=argparse.SUPPRESS)  # one row, in this process (the child)
    args = ap.parse_args(argv)
    if args.row:
        print(json.dumps(run_row(args.row, ROWS[args.row], Path(args.cache), args.limit, args.micro_batches,
                                 args.seeds, args.sample)))
        return 0
    load_at_start = os.getloadavg()
    rows = []
    for name in [r.strip() for r in args.rows.split(",") if r.strip()]:
        if name not in ROWS:
            raise SystemExit(f"unknown row {name!r}; rows: {', '.join(ROWS)}")
        load = os.getloadavg()
        extra = ["--micro-batches", args.micro_batches, "--sample", str(args.sample)] + (
            [] if args.seeds is None else ["--seeds", str(args.seeds)])
        out = subprocess.run([sys.executable, __file__, "--row", name, "--cache", args.cache,
                              "--limit", str(args.limit), *extra], capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(f"row {name} failed: {out.stderr.strip().splitlines()[-1:]}")
        row = json.loads(out.stdout.strip().splitlines()[-1])
        row["load_average_before"], row["load_average_after"] = load, os.getloadavg()
        if args.label:
            row["label"] = args.label
        rows.append(row)
        print(json.dumps(row), flush=True)
    write_result("bench_pipeline_phase", args.out, rows, load_average_at_start=load_at_start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
