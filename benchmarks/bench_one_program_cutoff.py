"""The one program's memory search with an incumbent from outside, its Lagrangian solves given that incumbent as a
cutoff (the default) and not (an exact solver given instead, which never sees it), side by side (JSON).

This is the one-program phase of ``shardplan plan --model M -p P --machine h100``: ``solve_fit`` over every
micro-batch count dividing the batch, pruned by the best uniform pipeline's step (``--incumbent``; default the
6.08353 s seed of GPT-3 175B on 1,024 h100, docs/pipeline.md *The default command's minute*). Each variant runs in
its own process; the row records its CPU seconds (user + system: the machine is shared), wall seconds, peak
resident memory, the answer (cost, bound, status) and the DP solves, of which how many the cutoff answered by
their bound alone. Both must state the same status and the bound must reach the incumbent in both when no plan
beats it (docs/search.md, *An incumbent from outside*).

Run: ``PYTHONPATH=. python benchmarks/bench_one_program_cutoff.py [--model gpt3-175b -p 1024 --incumbent 6.08353]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from benchmarks.record import write_result

CHILD = r"""
import json, resource, sys, time
from shardplan.fit import FitOptions, solve_fit
from shardplan.machine import preset
from shardplan.models import model_spec
from shardplan.planner import micro_batch_counts
from shardplan.search import dp as dpm

model, p, incumbent, cut = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4] == "cut"
spec = model_spec(model)
machine = preset("h100", p)
graph = spec.build(spec.batch)
counts = micro_batch_counts(None, spec.batch)
real = dpm.solve_dp
seen = {"solves": 0, "cut_off": 0}

def watched(problem, **kw):
    got = real(problem, **kw)
    seen["solves"] += 1
    seen["cut_off"] += bool(got.stats.get("cut_off"))
    return got

dpm.solve_dp = watched
extra = {} if cut else {"dp": lambda problem: watched(problem)}
c0, t0 = time.process_time(), time.perf_counter()
sp = solve_fit(graph, machine, budget=machine.memory_bytes, options=FitOptions(micro_batches=counts),
               cutoff=spec.cutoff, incumbent=incumbent, **extra)
st = sp.solution.stats
print(json.dumps({"cpu_seconds": time.process_time() - c0, "seconds": time.perf_counter() - t0,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "cost": sp.cost, "bound": sp.solution.bound, "status": st["status"],
                  "beats_incumbent": st.get("beats_incumbent"), "dp_solves": seen["solves"],
                  "dp_cut_off": seen["cut_off"], "build_seconds": sp.build_seconds,
                  "per_micro_batches": [{k: v for k, v in x.items() if k in ("micro_batches", "status", "lower_bound",
                                                                             "bound", "cost")}
                                        for x in st["per_micro_batches"]]}))
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt3-175b")
    ap.add_argument("-p", type=int, default=1024)
    ap.add_argument("--incumbent", type=float, default=6.08353)
    ap.add_argument("--out", default="benchmarks/results/one_program_cutoff.json")
    args = ap.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for variant in ("cut", "plain"):
        load = os.getloadavg()
        proc = subprocess.run([sys.executable, "-c", CHILD, args.model, str(args.p), str(args.incumbent), variant],
                              capture_output=True, text=True, env={**os.environ})
        if proc.returncode:
            raise SystemExit(proc.stderr)
        row = {"variant": variant, "model": args.model, "devices": args.p, "incumbent": args.incumbent,
               **json.loads(proc.stdout.strip().splitlines()[-1]), "load_average_before": load,
               "load_average_after": os.getloadavg()}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "per_micro_batches"}), flush=True)
    cut, plain = rows
    assert cut["status"] == plain["status"], (cut["status"], plain["status"])
    write_result("bench_one_program_cutoff", args.out, rows, time=time.strftime("%Y-%m-%d %H:%M:%S"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
