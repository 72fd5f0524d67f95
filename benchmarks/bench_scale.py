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
the paper models also the command itself, ``shardplan solve --model M -p 64``
(baselines and report included), in fresh interpreters: its least CPU and
wall seconds over three runs, next to the CPU seconds of starting Python and
importing numpy alone.

The machine this runs on has 2 cores shared with other jobs: wall times
vary with the load; CPU seconds (user + system of the subprocess) are the
steadier figure.

Run:  PYTHONPATH=. python benchmarks/bench_scale.py [--cases gpt3-1024,llama3-8b-64] [--no-before]
Writes benchmarks/results/scale.json (merging with cases already there).
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
ROOT = Path(__file__).resolve().parent.parent

GPT3 = {"layers": 96, "d_model": 12288, "heads": 96, "seq": 2048, "vocab": 50304}
LLAMA3_8B = {"layers": 32, "d_model": 4096, "heads": 32, "seq": 8192, "vocab": 128256, "d_ff": 14336}


def cases() -> dict[str, dict]:
    out: dict[str, dict] = {}
    for p in (8, 16, 32, 64, 128, 256, 512, 1024):
        out[f"gpt3-{p}"] = {"model": "gpt", "sizes": GPT3, "machine": "h100", "p": p}
    out["llama3-8b-64"] = {"model": "gpt", "sizes": LLAMA3_8B, "machine": "h100", "p": 64, "name": "llama3-8b-like"}
    out["gpt1.3b-64"] = {"model": "gpt", "sizes": {}, "machine": "h100", "p": 64}
    for m in ("alexnet", "inception_v3", "rnnlm", "transformer"):
        out[f"{m}-64"] = {"model": m, "sizes": {}, "machine": "paper", "p": 64, "cli": True}
    return out


def cli_run(spec: dict, repeats: int = 3) -> dict:
    """``shardplan solve --model M -p P`` (default paper machine, baselines and report included) in a fresh
    interpreter: the least CPU seconds (user + system, interpreter start-up and imports included) and wall
    seconds of ``repeats`` runs, and the CPU seconds of ``python -c "import numpy"`` alone (the start-up floor)."""
    import os

    def child(cmd: list[str]) -> tuple[float, float]:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        w0 = time.perf_counter()
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # cached bytecode, as installed
        subprocess.run(cmd, check=True, capture_output=True, env={**env, "PYTHONPATH": str(ROOT)})
        wall = time.perf_counter() - w0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, wall

    cmd = [sys.executable, "-m", "shardplan.cli", "solve", "--model", spec["model"], "-p", str(spec["p"]),
           "--machine", spec["machine"]]
    child(cmd)  # once to warm the file cache and write bytecode
    runs = [child(cmd) for _ in range(repeats)]
    floor = min(child([sys.executable, "-c", "import numpy"])[0] for _ in range(repeats))
    return {"cli_cpu_s": round(min(c for c, _ in runs), 3), "cli_wall_s": round(min(w for _, w in runs), 3),
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
    t0 = time.perf_counter()
    tables = build_tables(g, m, cutoff=ms.cutoff)
    build = time.perf_counter() - t0
    t0 = time.perf_counter()
    problem = tables.to_problem()
    lower = time.perf_counter() - t0
    t0 = time.perf_counter()
    sol = solve_dp(problem)
    search = time.perf_counter() - t0
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(cases()))
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--no-before", action="store_true", help="skip counting the unpruned spaces")
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args()
    table = cases()
    if args.case:
        print(json.dumps(run_case(args.case, table[args.case], not args.no_before)))
        return
    old = json.loads(OUT.read_text()) if OUT.exists() else {}
    rows = {r["case"]: r for r in old.get("cases", [])}
    for name in args.cases.split(","):
        cmd = [sys.executable, __file__, "--case", name] + (["--no-before"] if args.no_before else [])
        w0 = time.perf_counter()
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            if r.returncode:
                row = {"case": name, "error": r.stderr.strip()[-500:]}
            else:
                row = json.loads(r.stdout.strip().splitlines()[-1])
                row["subprocess_wall_s"] = round(time.perf_counter() - w0, 3)
                if table[name].get("cli"):
                    row.update(cli_run(table[name]))
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
