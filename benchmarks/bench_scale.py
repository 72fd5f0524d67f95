"""Scale of the whole pipeline (layouts, cost tables, exact search) on hierarchical GPU clusters.

Each case runs in its own subprocess and does what ``shardplan solve``
does before printing: build the graph, the candidate layouts and cost
tables (identical operators and edges costed once), lower to the solver
problem and run the exact DP. Recorded per case: graph size; distinct
operators and edges costed; configurations per operator before pruning
(the full hierarchical space: every factorisation of every valid split
over the levels with each level nested in the operator's dim order, no cap
on split dims, partial replicas allowed; and the
paper's flat tuple x nesting-order space) and after (the candidate layouts
the search sees, and those left after the search's bound pruning), summed
over the distinct operators and as the largest; seconds to build the
tables, to lower them and to search; process CPU seconds; wall seconds of
the subprocess including imports; peak RSS; the predicted step time. For
the paper models also the command itself, ``shardplan plan --model M -p 64 --stages off --no-fit``
(baselines and report included), in fresh interpreters: its least CPU and
wall seconds over three runs, next to the CPU seconds of starting Python and
importing numpy alone.

The machine this runs on has 2 cores shared with other jobs: wall times
vary with the load; CPU seconds (user + system of the subprocess) are the
steadier figure.

Run:  PYTHONPATH=. python benchmarks/bench_scale.py [--cases gpt3-1024,llama3-8b-64] [--no-before]
Writes benchmarks/results/scale.json (merging with cases already there: ``--cases`` replaces only those rows;
``--cases paper64`` names the paper's five models at 64 devices). Each row records the 1-minute load
average as its case started (``load_avg_1m``).

How the per-operator search grows (``--sweep``): Llama-3-8B (the zoo's ``llama3-8b``) on h100
clusters, one axis varied at a time from the 1,024-device, 32-layer, d_model-4,096 point: device count
64 .. 16,384, layer count 2 .. 128, model width (d_model 1,024 .. 16,384, 128 features per head, 8
key/value heads when there are at least 8 heads, d_ff = 3.5 d_model). Each point in its own subprocess:
CPU and wall seconds of building the tables and of the search (``solve_dp``, bounds included), the
search's own peak (tracemalloc during ``solve_dp``), the subprocess's peak RSS, and the problem's size.
For each axis the growth exponent b of ``seconds ~ a x^b`` (least squares on log-log, over the points
that ran) is printed and stored, and one plot per axis is drawn.

Run:  PYTHONPATH=. python benchmarks/bench_scale.py --sweep [--axes devices,layers,width]
Writes benchmarks/results/scale_sweep.json and scale_sweep.png.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

OUT = Path(__file__).parent / "results" / "scale.json"
SWEEP_OUT = Path(__file__).parent / "results" / "scale_sweep.json"
SWEEP_PNG = Path(__file__).parent / "results" / "scale_sweep.png"
ROOT = Path(__file__).resolve().parent.parent

GPT3 = {"layers": 96, "d_model": 12288, "heads": 96, "seq": 2048, "vocab": 50304}
PAPER_MODELS = ("alexnet", "inception_v3", "rnnlm", "transformer", "resnet101")
LLAMA3_8B = {"layers": 32, "d_model": 4096, "heads": 32, "seq": 8192, "vocab": 128256, "d_ff": 14336}


def cases() -> dict[str, dict]:
    out: dict[str, dict] = {}
    for p in (8, 16, 32, 64, 128, 256, 512, 1024):
        out[f"gpt3-{p}"] = {"model": "gpt", "sizes": GPT3, "machine": "h100", "p": p}
    out["llama3-8b-64"] = {"model": "gpt", "sizes": LLAMA3_8B, "machine": "h100", "p": 64, "name": "llama3-8b-like"}
    out["gpt1.3b-64"] = {"model": "gpt", "sizes": {}, "machine": "h100", "p": 64}
    for m in PAPER_MODELS:
        out[f"{m}-64"] = {"model": m, "sizes": {}, "machine": "paper", "p": 64, "cli": True}
    out["llama3-8b-1024"] = {"model": "llama3-8b", "sizes": {}, "machine": "h100", "p": 1024, "cli": True}
    return out


def cli_run(spec: dict, repeats: int = 3) -> dict:
    """``shardplan plan --model M -p P --machine X --stages off --no-fit`` (the per-operator plan, report
    included) in a fresh interpreter: the least CPU seconds (user + system, interpreter start-up and imports
    included), wall seconds and peak RSS of ``repeats`` runs, and the CPU seconds of ``python -c "import numpy"``
    alone (the start-up floor)."""
    import os

    probe = ("import resource, subprocess, sys, time; w = time.perf_counter(); "
             "subprocess.run(sys.argv[1:], check=True, capture_output=True); w = time.perf_counter() - w; "
             "r = resource.getrusage(resource.RUSAGE_CHILDREN); "
             "print(r.ru_utime + r.ru_stime, w, r.ru_maxrss / 1024)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # cached bytecode, as installed

    def child(cmd: list[str]) -> tuple[float, float, float]:
        out = subprocess.run([sys.executable, "-c", probe, *cmd], check=True, capture_output=True, text=True,
                             env={**env, "PYTHONPATH": str(ROOT)})
        cpu, wall, rss = (float(x) for x in out.stdout.split())
        return cpu, wall, rss

    args = ["plan", "--model", spec["model"], "-p", str(spec["p"]), "--machine", spec["machine"],
            "--stages", "off", "--no-fit"]
    cmd = [sys.executable, "-m", "shardplan.cli", *args]
    child(cmd)  # once to warm the file cache and write bytecode
    runs = [child(cmd) for _ in range(repeats)]
    floor = min(child([sys.executable, "-c", "import numpy"])[0] for _ in range(repeats))
    return {"cli": "shardplan " + " ".join(args), "cli_cpu_s": round(min(r[0] for r in runs), 3),
            "cli_wall_s": round(min(r[1] for r in runs), 3), "cli_peak_rss_mb": round(max(r[2] for r in runs), 1),
            "python_numpy_startup_cpu_s": round(floor, 3), "cli_repeats": repeats}


def _before_counts(graph, machine, cutoff: int, distinct: list[int]) -> dict:
    from shardplan.configs import configurations, dimension_orders, layouts

    full, flat = [], []
    for i in distinct:
        op = graph.operators[i]
        full.append(len(layouts(op, machine.levels, cutoff, max_split_dims=None, max_level_dims=None,
                                partial_replicas=True)))
        flat.append(len(dimension_orders(configurations(op, machine.num_devices, cutoff, divides_p=True), "all")[0]))
    return {"configs_full_space_sum": sum(full), "configs_full_space_max": max(full),
            "configs_flat_orders_sum": sum(flat), "configs_flat_orders_max": max(flat)}


def run_case(name: str, spec: dict, before: bool) -> dict:
    w0 = time.perf_counter()
    from shardplan.cost import build_tables, operator_key
    from shardplan.machine import preset
    from shardplan.models import model_spec
    from shardplan.search import solve_dp

    ms = model_spec(spec["model"])
    g = ms.build(**spec["sizes"]) if spec["sizes"] else ms.build(None)
    m = preset(spec["machine"], spec["p"])
    t0, c0 = time.perf_counter(), time.process_time()
    tables = build_tables(g, m, cutoff=ms.cutoff)
    build, build_cpu = time.perf_counter() - t0, time.process_time() - c0
    t0 = time.perf_counter()
    problem = tables.to_problem()
    lower = time.perf_counter() - t0
    t0, c0 = time.perf_counter(), time.process_time()
    sol = solve_dp(problem)
    search, search_cpu = time.perf_counter() - t0, time.process_time() - c0
    seen: dict = {}
    for i, op in enumerate(g.operators):
        seen.setdefault(operator_key(op), i)
    distinct = list(seen.values())
    ks = [len(tables.layouts[i]) for i in distinct]
    usage = resource.getrusage(resource.RUSAGE_SELF)
    row = {
        "case": name, "model": spec.get("name", spec["model"]), "sizes": spec["sizes"], "machine": m.name,
        "p": m.num_devices, "levels": list(m.levels), "cutoff": ms.cutoff,
        "vertices": problem.num_vertices, "edges": len(problem.edges),
        "distinct_operators": tables.options["distinct_operators"], "distinct_edges": tables.options["distinct_edges"],
        "configs_candidates_sum": sum(ks), "configs_candidates_max": max(ks),
        "configs_after_bounds": sol.stats.get("bounds", {}).get("configs_after"),
        "build_s": round(build, 3), "lower_s": round(lower, 3), "search_s": round(search, 3),
        "build_cpu_s": round(build_cpu, 3), "search_cpu_s": round(search_cpu, 3),
        "end_to_end_s": round(time.perf_counter() - w0, 3),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 3),
        "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
        "step_seconds": sol.cost,
        "optimal": sol.optimal,
    }
    if before:
        t0 = time.perf_counter()
        row.update(_before_counts(g, m, ms.cutoff, distinct))
        row["before_count_s"] = round(time.perf_counter() - t0, 3)
    return row


def sweep_points() -> dict[str, list[dict]]:
    """The sweep's points per axis: ``{"x": value, "p": devices, "sizes": llama3-8b size overrides}``."""
    def width(d: int) -> dict:
        heads = d // 128
        return {"d_model": d, "heads": heads, "kv_heads": min(8, heads), "d_ff": d * 7 // 2}

    return {
        "devices": [{"x": p, "p": p, "sizes": {}} for p in (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)],
        "layers": [{"x": n, "p": 1024, "sizes": {"layers": n}} for n in (2, 4, 8, 16, 32, 64, 128)],
        "width": [{"x": d, "p": 1024, "sizes": width(d)} for d in (1024, 2048, 4096, 8192, 16384)],
    }


def run_point(p: int, sizes: dict) -> dict:
    """One sweep point in this process: build, then the search under tracemalloc (its own peak)."""
    import tracemalloc

    from shardplan.cost import build_tables
    from shardplan.machine import preset
    from shardplan.models import model_spec
    from shardplan.search import solve_dp

    ms = model_spec("llama3-8b")
    g = ms.build(None, **sizes)
    m = preset("h100", p)
    c0, w0 = time.process_time(), time.perf_counter()
    # the memory guard of the build is an estimate against what is free now; the sweep measures instead
    problem = build_tables(g, m, cutoff=ms.cutoff, memory_limit_bytes=1 << 40).to_problem()
    c1, w1 = time.process_time(), time.perf_counter()
    sol = solve_dp(problem)
    c2, w2 = time.process_time(), time.perf_counter()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    tracemalloc.start()
    solve_dp(problem)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"p": p, "sizes": sizes, "vertices": problem.num_vertices, "edges": len(problem.edges),
            "configs": int(sum(problem.sizes)), "configs_max": int(max(problem.sizes)),
            "build_cpu_s": round(c1 - c0, 3), "build_wall_s": round(w1 - w0, 3),
            "search_cpu_s": round(c2 - c1, 3), "search_wall_s": round(w2 - w1, 3),
            "search_peak_traced_mb": round(peak / 2**20, 1), "peak_rss_mb": round(rss, 1),
            "step_seconds": sol.cost, "optimal": sol.optimal}


def growth_exponent(xs: list[float], ys: list[float]) -> float | None:
    """b of y ~ a x^b by least squares on (log x, log y); None with fewer than two positive points."""
    import numpy as np

    pts = [(x, y) for x, y in zip(xs, ys) if x > 0 and y > 0]
    if len(pts) < 2:
        return None
    lx, ly = np.log([x for x, _ in pts]), np.log([y for _, y in pts])
    return float(np.polyfit(lx, ly, 1)[0])


def plot_sweep(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes = list(data["axes"])
    fig, panes = plt.subplots(1, len(axes), figsize=(5 * len(axes), 4), squeeze=False)
    labels = {"devices": "devices", "layers": "layers (1,024 devices)", "width": "d_model (1,024 devices)"}
    for ax, name in zip(panes[0], axes):
        rows = [r for r in data["axes"][name]["rows"] if "error" not in r]
        xs = [r["x"] for r in rows]
        fit = data["axes"][name]["exponents"]
        ax.loglog(xs, [r["search_cpu_s"] for r in rows], "o-", label=f"search CPU s (b={fit['search_cpu_s']:.2f})")
        ax.loglog(xs, [r["build_cpu_s"] for r in rows], "s--", label=f"tables CPU s (b={fit['build_cpu_s']:.2f})")
        ax.set_xlabel(labels[name])
        ax.set_ylabel("seconds")
        mem = ax.twinx()
        mem.loglog(xs, [r["search_peak_traced_mb"] for r in rows], "^:", color="tab:red",
                   label=f"search peak MB (b={fit['search_peak_traced_mb']:.2f})")
        mem.set_ylabel("MB")
        lines = ax.get_legend_handles_labels()
        more = mem.get_legend_handles_labels()
        ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=7, loc="upper left")
        refused = [r["x"] for r in data["axes"][name]["rows"] if "error" in r]
        if refused:
            ax.set_title(f"not costed: {', '.join(map(str, refused))}", fontsize=8)
    fig.suptitle("Per-operator search of Llama-3-8B on h100 (2-core machine, CPU seconds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_sweep(axes: list[str], timeout: float) -> dict:
    points = sweep_points()
    data = {"machine": {"platform": platform.platform(), "python": platform.python_version(),
                        "cpus": __import__("os").cpu_count()},
            "model": "llama3-8b", "machine_preset": "h100", "axes": {}}
    for name in axes:
        rows = []
        for pt in points[name]:
            cmd = [sys.executable, __file__, "--point", json.dumps({"p": pt["p"], "sizes": pt["sizes"]})]
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
                row = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else \
                    {"p": pt["p"], "sizes": pt["sizes"], "error": (r.stderr.strip().splitlines() or ["?"])[-1][-300:]}
            except subprocess.TimeoutExpired:
                row = {"p": pt["p"], "sizes": pt["sizes"], "error": f"timeout {timeout} s"}
            row = {"x": pt["x"], **row}
            rows.append(row)
            print(json.dumps({"axis": name, **row}), flush=True)
        ok = [r for r in rows if "error" not in r]
        exps = {k: growth_exponent([r["x"] for r in ok], [r[k] for r in ok])
                for k in ("search_cpu_s", "build_cpu_s", "search_peak_traced_mb", "peak_rss_mb")}
        data["axes"][name] = {"rows": rows, "exponents": exps}
        print(f"{name}: growth exponents (log-log least squares) " +
              ", ".join(f"{k} {v:.2f}" if v is not None else f"{k} -" for k, v in exps.items()), flush=True)
    return data



def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(cases()))
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--no-before", action="store_true", help="skip counting the unpruned spaces")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--cli-repeats", type=int, default=3, help="fresh runs of the command per case (least kept)")
    ap.add_argument("--sweep", action="store_true", help="the scaling sweep (scale_sweep.json and .png)")
    ap.add_argument("--axes", default="devices,layers,width", help="sweep axes to run")
    ap.add_argument("--point", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.point:
        pt = json.loads(args.point)
        print(json.dumps(run_point(pt["p"], pt["sizes"])))
        return
    if args.sweep:
        data = run_sweep([a for a in args.axes.split(",") if a], args.timeout)
        if SWEEP_OUT.exists():  # axes not run this time are kept
            old = json.loads(SWEEP_OUT.read_text())
            data["axes"] = {**old.get("axes", {}), **data["axes"]}
        SWEEP_OUT.parent.mkdir(parents=True, exist_ok=True)
        SWEEP_OUT.write_text(json.dumps(data, indent=1) + "\n")
        plot_sweep(data, SWEEP_PNG)
        return
    table = cases()
    if args.cases == "paper64":
        args.cases = ",".join(f"{m}-64" for m in PAPER_MODELS)
    if args.case:
        print(json.dumps(run_case(args.case, table[args.case], not args.no_before)))
        return
    old = json.loads(OUT.read_text()) if OUT.exists() else {}
    rows = {r["case"]: r for r in old.get("cases", [])}
    for name in args.cases.split(","):
        cmd = [sys.executable, __file__, "--case", name] + (["--no-before"] if args.no_before else [])
        load = round(__import__("os").getloadavg()[0], 2)  # the 1-minute load average as the case starts
        w0 = time.perf_counter()
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            if r.returncode:
                row = {"case": name, "error": r.stderr.strip()[-500:]}
            else:
                row = json.loads(r.stdout.strip().splitlines()[-1])
                row["subprocess_wall_s"] = round(time.perf_counter() - w0, 3)
                row["load_avg_1m"] = load
                if table[name].get("cli"):
                    row.update(cli_run(table[name], args.cli_repeats))
        except subprocess.TimeoutExpired:
            row = {"case": name, "error": f"timeout {args.timeout} s"}
        rows[name] = row
        print(json.dumps(row), flush=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    out = {"machine": {"platform": platform.platform(), "python": platform.python_version(),
                       "cpus": __import__("os").cpu_count()},
           "cases": sorted(rows.values(), key=lambda r: r["case"])}
    OUT.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
