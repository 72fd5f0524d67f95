"""The default joint search (stages x micro-batches x schedules x memory choices) at scale, end to end from the
command line (JSON).

Each row runs ``shardplan plan --model M -p P --machine h100 --json ...`` with the command's defaults (nothing
hand-picked) in its own process and records its wall time and peak resident memory (``os.wait4``'s
``ru_maxrss``: that process alone), its CPU seconds (``ru_utime + ru_stime``: on a shared machine the wall time
says more about the load than about the search), the plan in one line (the report's ``Plan:`` line, stages,
micro-batches, schedule), its predicted step time, proven lower bound and gap. A row still running after its limit gets
SIGINT (Ctrl-C): the command then prints the best plan found so far with the bound the search proved (its finished
parts, each unfinished part's step floor or family bound; ``docs/pipeline.md``, *Progress and interruption*); the
row records ``interrupted`` and that plan, or, if nothing came back within ``--grace`` seconds more, ``timeout``.
The last progress line the command wrote (stderr) is kept. Targets (on this 2-core machine): GPT-3 175B on 1,024
h100 under 60 s and 4 GB; Llama 3 405B
on 16,384 h100 (batch 2,048 sequences of 8,192 tokens) under 120 s and 4 GB, and no slower than Llama 3's
published configuration (Dubey et al. 2024, Table 4: tensor 8, pipeline 16, data 128, micro-batch size 1; the
first and last stage one block fewer, §3.3.2) costed by the same model (``shardplan recipe``).

Growth: over the rows, the exponent b of ``y ~ a p^b`` fitted by least squares on log-log (wall seconds, CPU
seconds and peak resident memory against the device count p) is printed and stored (``growth``), and a plot of
the three against p is written next to the JSON (same name, ``.png``; matplotlib's Agg backend). Rows stopped at
their limit measure the limit, not the search: the fit says so (``rows_at_limit``).

The command's default stop is its work budget (``--work-limit``, counted from the problem's sizes:
docs/pipeline.md, *A work budget for the whole call*), so a row's plan, step and bound do not depend on the
load; each row records the units charged (``work_used``), the limit, whether it stopped there
(``stopped_at_work_limit``) and a digest of its per-operator choices (``plan_digest``). ``--busy`` runs a busy loop
(``python -c "while 1: pass"``) beside each row's command for its whole run (the row records ``busy``), to show
the same answer under load; ``--append`` keeps the rows already in ``--out`` and adds these after them.

``--sweep`` runs the default command along three axes instead (GPT-3 175B's shape, batch 1,536): the device count
(64 to 16,384), the layer count (24 to 192 on 1,024 devices) and the width (``d_model`` 4,096 to 16,384 with
``d_model / 128`` heads and ``4 d_model`` feed-forward, on 1,024 devices); per axis the growth exponents of CPU
seconds, peak memory and work units, and a plot of the three panels with each row's gap
(``scale_pipeline_sweep.json`` / ``.png``). The default budget bounds every row's work, so along an axis where
the rows stop at the budget the CPU exponent measures the budget, not the search: the rows say which stopped
(``stopped_at_work_limit``) and what bound and gap they proved.

Run: ``PYTHONPATH=. python benchmarks/bench_scale_pipeline.py [--rows gpt3-p64,...] [--out
benchmarks/results/scale_pipeline.json] [--busy] [--append] [--label TEXT]``, or ``... --sweep [--axes
devices,layers,width] [--out benchmarks/results/scale_pipeline_sweep.json]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.record import write_result

ROWS: dict[str, dict[str, Any]] = {
    "gpt3-p64": {"model": "gpt3-175b", "p": 64, "limit": 150.0},
    "gpt3-p256": {"model": "gpt3-175b", "p": 256, "limit": 150.0},
    "gpt3-p1024": {"model": "gpt3-175b", "p": 1024, "limit": 400.0, "target_seconds": 60.0,
                   "target_bytes": 4e9},
    "llama3-405b-p16384": {"model": "llama3-405b", "p": 16384, "limit": 600.0, "target_seconds": 120.0,
                           "target_bytes": 4e9,
                           # Dubey et al. 2024, Table 4 (16,384 GPUs: TP 8, CP 1, PP 16, DP 128, 16M tokens per
                           # batch) and §3.3.2 (one block fewer on the first and the last stage: 126 = 7 + 14 x 8 + 7)
                           "recipe": "tp=8,pp=16,mbs=1,gbs=2048,first_stage_layers=7,last_stage_layers=7"},
}


SWEEP_BASE = {"model": "gpt3-175b", "p": 1024, "limit": 900.0}
SWEEP: dict[str, tuple[str, list[int]]] = {
    "devices": ("devices", [64, 256, 1024, 4096, 16384]),
    "layers": ("layers", [24, 48, 96, 192]),
    "width": ("d_model", [4096, 8192, 12288, 16384]),
}


def sweep_rows(axes: list[str]) -> list[tuple[str, str, int, dict[str, Any], tuple[str, ...]]]:
    """(row name, axis, x, spec, extra options) of each sweep row; GPT-3 175B's own shape on 1,024 devices is one
    point of every axis and is run once (named ``base``)."""
    out = []
    for axis in axes:
        _, xs = SWEEP[axis]
        for x in xs:
            spec, extra = dict(SWEEP_BASE), ()
            if axis == "devices":
                spec["p"] = x
            elif axis == "layers":
                extra = ("--set", f"layers={x}")
            else:
                extra = ("--set", f"d_model={x}", "--set", f"heads={x // 128}", "--set", f"d_ff={4 * x}")
            base = spec["p"] == 1024 and (axis == "devices" or x == {"layers": 96, "width": 12288}[axis])
            out.append(("base" if base else f"{axis}-{x}", axis, x, spec, () if base else extra))
    return out


def run_sweep(axes: list[str], grace: float, out: str) -> int:
    """Run :func:`sweep_rows` (each distinct row once), fit each axis, write the JSON and the plot."""
    load_at_start = os.getloadavg()
    done: dict[str, dict[str, Any]] = {}
    rows = []
    for name, axis, x, spec, extra in sweep_rows(axes):
        if name not in done:
            load = os.getloadavg()
            row = run_row(name, spec, grace, None, extra)
            row["load_average_before"], row["load_average_after"] = load, os.getloadavg()
            done[name] = row
            print(json.dumps({k: v for k, v in row.items() if k not in ("log", "work_phases")}), flush=True)
        rows.append({**done[name], "axis": axis, "x": x})
    fits = {}
    for axis in axes:
        pts = [r for r in rows if r["axis"] == axis and r.get("status") == "ok"]
        xs = [float(r["x"]) for r in pts]
        fits[axis] = {"x": SWEEP[axis][0], "values": [r["x"] for r in pts],
                      "cpu_seconds_exponent": growth_exponent(xs, [r.get("cpu_seconds") for r in pts]),
                      "peak_rss_exponent": growth_exponent(xs, [float(r["peak_rss_bytes"]) for r in pts]),
                      "work_used_exponent": growth_exponent(xs, [r.get("work_used") for r in pts]),
                      "rows_at_work_limit": [r["x"] for r in pts if r.get("stopped_at_work_limit")]}
        f = fits[axis]
        print(f"{axis}: CPU ~ x^{_fmt(f['cpu_seconds_exponent'])}, peak RSS ~ x^{_fmt(f['peak_rss_exponent'])}, "
              f"work ~ x^{_fmt(f['work_used_exponent'])}; stopped at the work limit at {f['rows_at_work_limit']}")
    write_result("bench_scale_pipeline --sweep", out, rows, load_average_at_start=load_at_start,
                 load_average_at_end=os.getloadavg(), growth=fits)
    png = str(Path(out).with_suffix(".png"))
    plot_sweep(rows, fits, png)
    print(f"wrote {png}")
    return 0


def plot_sweep(rows: list[dict[str, Any]], fits: dict[str, Any], path: str) -> None:
    """One column per axis: CPU seconds and peak RSS (log-log) above, the proven gap below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    fig, axs = plt.subplots(2, len(fits), figsize=(4.2 * len(fits), 5.6), squeeze=False, sharex="col",
                            gridspec_kw={"height_ratios": [2, 1]})
    for col, (axis, f) in enumerate(fits.items()):
        pts = [r for r in rows if r["axis"] == axis and r.get("status") == "ok"]
        xs = [r["x"] for r in pts]
        top, low = axs[0][col], axs[1][col]
        top.loglog(xs, [r["cpu_seconds"] for r in pts], "s-", label=f"CPU s (b={_fmt(f['cpu_seconds_exponent'])})")
        top.loglog(xs, [r["peak_rss_bytes"] / 2**20 for r in pts], "^--",
                   label=f"peak RSS MiB (b={_fmt(f['peak_rss_exponent'])})")
        top.legend(fontsize=7, loc="center left")
        low.semilogx(xs, [100 * (r.get("gap") or 0.0) for r in pts], "o-", color="tab:red")
        low.set_ylabel("proven gap (%)")
        low.set_ylim(bottom=0)
        low.set_xlabel(f["x"] + (" (h100)" if axis == "devices" else ", 1,024 h100"))
        low.xaxis.set_major_formatter(ScalarFormatter())
        low.xaxis.set_minor_formatter(NullFormatter())
        low.set_xticks(xs)
        low.tick_params(axis="x", labelsize=7)
    fig.suptitle("shardplan plan, default search (work budget 3e7; every row stopped at it), GPT-3 175B's shape",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of the running process ``pid`` so far (Linux ``/proc``; 0 where it cannot be read)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _run(cmd: list[str], limit: float, grace: float, cpu_limit: float | None = None) -> dict[str, Any]:
    """Run ``cmd``; SIGINT after ``limit`` s (``cpu_limit``: once it has used that many CPU seconds instead, for a
    shared machine whose load makes wall seconds say little), SIGKILL after ``grace`` s more. Wall time, peak RSS,
    outputs."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        # SIGINT back to its default in the child (a job started in the background inherits it ignored, and
        # Python then installs no KeyboardInterrupt handler)
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        status = "ok"
        deadline = t0 + limit
        rusage = None
        while rusage is None:
            pid, code, ru = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                rusage = ru
                proc.returncode = os.waitstatus_to_exitcode(code)
                break
            now = time.perf_counter()
            over = (now > deadline if cpu_limit is None or status != "ok"
                    else _cpu_seconds(proc.pid) >= cpu_limit)
            if over:
                if status == "ok":
                    proc.send_signal(signal.SIGINT)
                    status, deadline = "interrupted", now + grace
                else:
                    proc.kill()
                    status, deadline = "timeout", now + 3600
            time.sleep(0.2)
        seconds = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    return {"status": status, "returncode": proc.returncode, "seconds": seconds,
            "cpu_seconds": rusage.ru_utime + rusage.ru_stime,
            "peak_rss_bytes": rusage.ru_maxrss * 1024, "stdout": stdout, "stderr": stderr}


def _plan_line(stdout: str) -> str | None:
    return next((x.strip() for x in stdout.splitlines() if x.startswith("Plan:")), None)


def run_row(name: str, spec: dict[str, Any], grace: float, cpu_limit: float | None = None,
            extra: tuple[str, ...] = ()) -> dict[str, Any]:
    exe = [sys.executable, "-c", "import sys; from shardplan.cli import main; sys.exit(main())"]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.json"
        cmd = [*exe, "plan", "--model", spec["model"], "-p", str(spec["p"]), "--machine", "h100",
               "--json", str(path), *extra]
        got = _run(cmd, spec["limit"], grace, cpu_limit)
        plan = json.loads(path.read_text()) if path.exists() else None
    lines = [x.strip() for x in got["stderr"].replace("\r", "\n").splitlines() if x.strip()]
    row: dict[str, Any] = {
        "row": name, "model": spec["model"], "devices": spec["p"], "machine": "h100",
        "command": " ".join(["shardplan plan --model {} -p {} --machine h100".format(spec["model"], spec["p"]),
                             *extra]),
        "limit_seconds": spec["limit"] if cpu_limit is None else None, "limit_cpu_seconds": cpu_limit, "status": got["status"] if plan is not None or got["status"] != "ok"
        else f"failed (exit {got['returncode']})",
        "seconds": round(got["seconds"], 2), "cpu_seconds": round(got["cpu_seconds"], 2),
        "peak_rss_bytes": got["peak_rss_bytes"],
        "last_progress": next((x for x in reversed(lines) if "parts done" in x), None),
        "log": [x for x in lines if "parts done" not in x],
    }
    for key in ("target_seconds", "target_bytes"):
        if key in spec:
            row[key] = spec[key]
    if "target_seconds" in spec:
        row["meets_targets"] = (got["status"] == "ok" and plan is not None and got["seconds"] < spec["target_seconds"]
                                and got["peak_rss_bytes"] < spec["target_bytes"])
    if plan is not None:
        stages = plan["stages"]
        row.update({
            "plan": _plan_line(got["stdout"]),
            "stages": len(stages), "devices_per_stage": [s["devices"][1] for s in stages],
            "micro_batches": plan["micro_batches"], "schedule": plan["schedule"], "chunks": plan.get("chunks", 1),
            "step_time_seconds": plan["step_time_seconds"], "lower_bound_seconds": plan["lower_bound_seconds"],
            "gap": (None if plan["lower_bound_seconds"] is None else
                    max(0.0, 1 - plan["lower_bound_seconds"] / plan["step_time_seconds"])),
            "interrupted": bool((plan.get("stats") or {}).get("interrupted")),
            "work_limit": (plan.get("stats") or {}).get("work_limit"),
            "work_used": (plan.get("stats") or {}).get("work_used"),
            "work_phases": (plan.get("stats") or {}).get("work_phases"),
            "stopped_at_work_limit": bool((plan.get("stats") or {}).get("stopped_at_work_limit")),
            "plan_digest": plan_digest(plan),
        })
    if "recipe" in spec:
        rec = _run([*exe, "recipe", "--model", spec["model"], "-p", str(spec["p"]), "--machine", "h100",
                    "--recipe", spec["recipe"]], spec["limit"], grace)
        step = next((x for x in rec["stdout"].splitlines() if x.startswith("Step time:")), None)
        row["recipe"] = {"text": spec["recipe"], "status": rec["status"], "returncode": rec["returncode"],
                         "seconds": round(rec["seconds"], 2), "step_time_line": step,
                         "error": rec["stderr"].strip().splitlines()[-1] if rec["returncode"] else None}
    return row


def plan_digest(plan: dict[str, Any]) -> str:
    """16 hex digits of the plan's stages, micro-batches, schedule and every operator's choices (its JSON's
    ``stages``, sorted): equal digests, the same plan."""
    what = json.dumps([plan["stages"], plan["micro_batches"], plan["schedule"], plan.get("chunks", 1)],
                      sort_keys=True)
    return hashlib.sha256(what.encode()).hexdigest()[:16]


def growth_exponent(xs: list[float], ys: list[float | None]) -> float | None:
    """b of ``y ~ a x^b`` by least squares on (log x, log y); None with fewer than two distinct positive points."""
    import math

    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y is not None and y > 0]
    if len({x for x, _ in pts}) < 2:
        return None
    mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sxx


def growth(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The fitted exponents of wall seconds, CPU seconds and peak memory against the device count, over the rows
    that ran (each row one model; GPT-3 and Llama 3 mixed, so a summary, not a law)."""
    ran = [r for r in rows if r.get("seconds") is not None]
    p = [float(r["devices"]) for r in ran]
    return {"devices": [int(x) for x in p],
            "seconds_exponent": growth_exponent(p, [float(r["seconds"]) for r in ran]),
            "cpu_seconds_exponent": growth_exponent(p, [r.get("cpu_seconds") for r in ran]),
            "peak_rss_exponent": growth_exponent(p, [float(r["peak_rss_bytes"]) for r in ran]),
            "rows_at_limit": [r["row"] for r in ran if r.get("status") != "ok"]}


def plot(rows: list[dict[str, Any]], fit: dict[str, Any], path: str) -> None:
    """Wall and CPU seconds (left axis) and peak resident memory (right axis) against the device count, log-log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in rows if r.get("seconds") is not None]
    p = [r["devices"] for r in ran]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.loglog(p, [r["seconds"] for r in ran], "o-", label=f"wall s (b={_fmt(fit['seconds_exponent'])})")
    ax.loglog(p, [r.get("cpu_seconds") or float("nan") for r in ran], "s-", label=f"CPU s (b={_fmt(fit['cpu_seconds_exponent'])})")
    for r in ran:
        if r.get("status") != "ok":
            ax.annotate("stopped", (r["devices"], r["seconds"]), textcoords="offset points", xytext=(4, 6),
                        fontsize=7)
    ax.set_xlabel("devices (h100)")
    ax.set_ylabel("seconds")
    ax2 = ax.twinx()
    ax2.set_yscale("log")
    ax2.plot(p, [r["peak_rss_bytes"] / 2**30 for r in ran], "^--", color="tab:green",
             label=f"peak RSS GiB (b={_fmt(fit['peak_rss_exponent'])})")
    ax2.set_ylabel("peak resident memory (GiB)")
    lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    labels = ax.get_legend_handles_labels()[1] + ax2.get_legend_handles_labels()[1]
    ax.legend(lines, labels, fontsize=8, loc="upper left")
    ax.set_title("shardplan plan, default search: " + ", ".join(f"{r['model']} p={r['devices']}" for r in ran),
                 fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    ap.add_argument("--grace", type=float, default=60.0, help="seconds after SIGINT before SIGKILL")
    ap.add_argument("--out", default="benchmarks/results/scale_pipeline.json")
    ap.add_argument("--cpu-limit", type=float, default=None,
                    help="SIGINT each row once it has used this many CPU seconds (instead of its wall limit)")
    ap.add_argument("--extra", default="", help="more options for every row's command, e.g. '--micro-batches 1,2,3'")
    ap.add_argument("--label", default=None, help="a note kept in each row (e.g. which tree the command ran)")
    ap.add_argument("--busy", action="store_true",
                    help="run a busy loop (python -c 'while 1: pass') beside each row's command")
    ap.add_argument("--append", action="store_true", help="keep the rows already in --out and add these after them")
    ap.add_argument("--sweep", action="store_true", help="the device / layer / width sweep instead of --rows")
    ap.add_argument("--axes", default=",".join(SWEEP), help=f"with --sweep: comma-separated, of {', '.join(SWEEP)}")
    args = ap.parse_args(argv)
    if args.sweep:
        out = args.out if args.out != "benchmarks/results/scale_pipeline.json" else \
            "benchmarks/results/scale_pipeline_sweep.json"
        return run_sweep([a.strip() for a in args.axes.split(",") if a.strip()], args.grace, out)
    kept = []
    if args.append and Path(args.out).exists():
        kept = json.loads(Path(args.out).read_text()).get("rows", [])
    load_at_start = os.getloadavg()  # the machine is shared: timings depend on the load
    rows = []
    for name in [r.strip() for r in args.rows.split(",") if r.strip()]:
        if name not in ROWS:
            raise SystemExit(f"unknown row {name!r}; rows: {', '.join(ROWS)}")
        load = os.getloadavg()
        loop = subprocess.Popen([sys.executable, "-c", "while 1: pass"]) if args.busy else None
        try:
            row = run_row(name, ROWS[name], args.grace, args.cpu_limit, tuple(args.extra.split()))
        finally:
            if loop is not None:
                loop.kill()
                loop.wait()
        row["load_average_before"], row["load_average_after"] = load, os.getloadavg()
        row["busy"] = args.busy
        if args.label:
            row["label"] = args.label
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "log"}), flush=True)
    fit = growth(rows)
    print("growth exponents (y ~ p^b): wall {}, CPU {}, peak RSS {}{}".format(
        _fmt(fit["seconds_exponent"]), _fmt(fit["cpu_seconds_exponent"]), _fmt(fit["peak_rss_exponent"]),
        f" (rows stopped at their limit: {', '.join(fit['rows_at_limit'])})" if fit["rows_at_limit"] else ""))
    write_result("bench_scale_pipeline", args.out, kept + rows, load_average_at_start=load_at_start,
                 load_average_at_end=os.getloadavg(), growth=fit)
    if len(rows) > 1:
        png = str(Path(args.out).with_suffix(".png"))
        plot(rows, fit, png)
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
