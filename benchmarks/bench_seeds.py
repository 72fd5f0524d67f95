"""What the planner's seed phase costs, and how far a time-limited plan command gets (JSON; docs/pipeline.md,
*The seed phase's cost*).

Three kinds of rows, each run in a child process on each source tree given in turn (``--tree``, default this one;
give the main checkout's path too to measure the code before a change with the same script, on the same load):

- ``floors``: the CPU seconds of the solve-free unit bounds (:class:`~shardplan.pipeline.floors.UnitFloors`) on
  every (sub-mesh size, micro-batch count) pair the uniform seeds consider for the model on p H100 (the
  planner's stage options: memory choices, the zoo model's cutoff, automatic orders), computed eagerly as the
  seeds did before their lazy order; and a digest of every floor (the same digest: the same floats).
- ``seeds``: the planner's seed phase (its ``pipeline_seeds`` call, run to its end without a time limit, the
  command stopped there): CPU and wall seconds, seeds costed, the best seed, the (size, count) floors computed.
- ``step_floor``: the planner's step floor before the seeds (``_pipeline_floor`` on a fresh stage model: a graph
  per micro-batch count and the whole model's device-seconds at each): CPU seconds of the graphs, of the floors on
  them, and the floor itself (the same float: the same floor).
- ``command``: ``shardplan plan --model M -p P --machine h100 --time-limit T``: its CPU seconds (user + system),
  wall seconds, the wall second of its first seed and the last seed it reached (from its progress lines on
  stderr), and its step and bound lines.

The load average is recorded at the start and the end of each row (the machine is shared; wall seconds, and so
how far a time-limited command gets, depend on it; CPU seconds much less). Run: ``PYTHONPATH=. python
benchmarks/bench_seeds.py [--tree /work/main .] [--commands gpt3-175b:1024:60 llama3-405b:16384:120]
[--floors gpt3-175b:1024] [--seeds gpt3-175b:1024 llama3-405b:16384] [--step-floor gpt3-175b:1024]
[--out benchmarks/results/seeds.json] [--keep]`` (``--keep``: the rows already in ``--out`` stay, these are added).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.record import write_result

_FLOORS = """
import hashlib, json, sys, time
from functools import partial
import numpy as np
from shardplan.machine import preset
from shardplan.models import get_model, model_spec
from shardplan.pipeline.api import seed_model
from shardplan.pipeline.floors import UnitFloors
from shardplan.pipeline.search import PipelineSpace
from shardplan.planner import micro_batch_counts
import shardplan
name, p = sys.argv[1], int(sys.argv[2])
spec = model_spec(name)
machine = preset("h100", p)
model = seed_model(partial(get_model, name), spec.batch, machine, memory_choices=True, cutoff=spec.cutoff,
                   orders="auto")
ms = micro_batch_counts(None, spec.batch)
for m in ms:
    model.graph(m)  # (the planner builds every graph before the seeds, for its step floor)
U = model.num_units
sizes = set(PipelineSpace(U, p, machine.levels[0] if len(machine.levels) > 1 else p).allowed_sizes())
qs = [p // n for n in range(2, min(U, p) + 1) if p % n == 0 and p // n in sizes]
floors = UnitFloors(model)
t0 = time.process_time()
digest = hashlib.sha256()
for m in ms:
    for q in qs:
        digest.update(np.asarray(floors.unit(q, m), dtype=np.float64).tobytes())
print(json.dumps({"cpu_seconds": time.process_time() - t0, "pairs": len(ms) * len(qs), "sizes": qs,
                  "micro_batches": list(ms), "units": U, "digest": digest.hexdigest()[:16],
                  "source": shardplan.__file__}))
"""

# the planner's seed phase alone, to its end (no time limit): CPU seconds around its own pipeline_seeds call
_SEEDS = """
import json, sys, time
import shardplan
import shardplan.pipeline.api as api
from shardplan.cli.commands import main
real = api.pipeline_seeds
class Done(BaseException):
    pass
def timed(*a, **k):
    t0, w0 = time.process_time(), time.perf_counter()
    got = real(*a, **k)
    plan = got.plan
    print(json.dumps({"seed_phase_cpu_seconds": time.process_time() - t0,
                      "seed_phase_wall_seconds": time.perf_counter() - w0,
                      "seeds_costed": plan.stats.get("seeds_costed"), "seed_step": plan.step_time,
                      "seed_stages": plan.num_stages, "seed_micro_batches": plan.micro_batches,
                      "floor_pairs_computed": len(got.floors._pre), "source": shardplan.__file__}))
    raise Done()
api.pipeline_seeds = timed
try:
    main(["plan", "--model", sys.argv[1], "-p", sys.argv[2], "--machine", "h100"])
except Done:
    pass
"""


# the planner's step floor: its graphs (one per micro-batch count), then m D(batch/m) / p at each
_STEP_FLOOR = """
import json, sys, time
import shardplan
from shardplan.machine import preset
from shardplan.models import model_spec
from shardplan.pipeline.stages import ModelStages
from shardplan.planner import micro_batch_counts
spec = model_spec(sys.argv[1])
machine = preset("h100", int(sys.argv[2]))
ms = micro_batch_counts(None, spec.batch)
model = ModelStages(spec.build, spec.batch, machine)
t0 = time.process_time()
for m in ms:
    model.graph(m)
t1 = time.process_time()
floor = min(model.step_floor(m) for m in ms)
forward = [model.forward_floor(m) for m in ms]
t2 = time.process_time()
print(json.dumps({"graphs_cpu_seconds": t1 - t0, "floors_cpu_seconds": t2 - t1, "micro_batch_counts": len(ms),
                  "step_floor": floor, "forward_floors_sum": sum(forward), "source": shardplan.__file__}))
"""


def _script_row(kind: str, script: str, tree: str, name: str, p: int) -> dict:
    """One row of ``kind``: ``script`` run on ``tree``'s shardplan in a fresh interpreter (its last line, JSON)."""
    load0 = os.getloadavg()
    out = subprocess.run([sys.executable, "-c", script, name, str(p)], env=_env(tree), cwd=tree,
                         capture_output=True, text=True, check=True).stdout
    return {"kind": kind, "tree": tree, "model": name, "devices": p, **json.loads(out.splitlines()[-1]),
            "load_average_at_start": load0, "load_average_at_end": os.getloadavg()}


def step_floor_row(tree: str, name: str, p: int) -> dict:
    return _script_row("step_floor", _STEP_FLOOR, tree, name, p)


def seeds_row(tree: str, name: str, p: int) -> dict:
    return _script_row("seeds", _SEEDS, tree, name, p)


def _child_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _env(tree: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": tree}


def floors_row(tree: str, name: str, p: int) -> dict:
    load0 = os.getloadavg()
    out = subprocess.run([sys.executable, "-c", _FLOORS, name, str(p)], env=_env(tree), cwd=tree,
                         capture_output=True, text=True, check=True).stdout
    return {"kind": "floors", "tree": tree, "model": name, "devices": p, **json.loads(out.splitlines()[-1]),
            "load_average_at_start": load0, "load_average_at_end": os.getloadavg()}


def command_row(tree: str, name: str, p: int, limit: int) -> dict:
    exe = str(Path(sys.executable).with_name("shardplan"))
    cmd = [exe, "plan", "--model", name, "-p", str(p), "--machine", "h100", "--time-limit", str(limit)]
    load0, cpu0, t0 = os.getloadavg(), _child_cpu(), time.perf_counter()
    done = subprocess.run(cmd, env=_env(tree), cwd=tree, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - t0, _child_cpu() - cpu0
    lines = [x for x in re.split(r"[\r\n]", done.stderr) if x.strip()]
    seeds = [(int(mt.group(1)), float(mt.group(2))) for x in lines
             if (mt := re.search(r"seed (\d+)/\d+:.*\| (\d+) s\s*$", x))]
    out = done.stdout.splitlines()
    return {"kind": "command", "tree": tree, "command": " ".join(["shardplan", *cmd[1:]]), "returncode": done.returncode,
            "cpu_seconds": cpu, "wall_seconds": wall, "first_seed_wall_s": seeds[0][1] if seeds else None,
            "last_seed_reached": max((k for k, _ in seeds), default=0),
            "progress_tail": lines[-4:], "plan_lines": out[1:3],
            "load_average_at_start": load0, "load_average_at_end": os.getloadavg()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", nargs="+", default=[os.getcwd()],
                    help="the source trees measured, in turn (PYTHONPATH of the children)")
    ap.add_argument("--floors", nargs="*", default=["gpt3-175b:1024"], help="model:devices")
    ap.add_argument("--seeds", nargs="*", default=["gpt3-175b:1024", "llama3-405b:16384"],
                    help="model:devices, the planner's seed phase run to its end")
    ap.add_argument("--commands", nargs="*", default=["gpt3-175b:1024:60", "llama3-405b:16384:120"],
                    help="model:devices:time-limit")
    ap.add_argument("--step-floor", nargs="*", default=["gpt3-175b:1024", "llama3-405b:16384"],
                    help="model:devices, the planner's step floor before the seeds")
    ap.add_argument("--out", default="benchmarks/results/seeds.json")
    ap.add_argument("--keep", action="store_true", help="keep the rows already in --out (and its trees)")
    args = ap.parse_args()
    rows: list[dict] = []
    trees = list(args.tree)
    if args.keep and Path(args.out).exists():
        old = json.loads(Path(args.out).read_text())
        rows = list(old["rows"])
        trees = [*old.get("trees", []), *(t for t in trees if t not in old.get("trees", []))]
    for tree in args.tree:
        for spec in args.floors:
            name, p = spec.split(":")
            rows.append(floors_row(tree, name, int(p)))
            print(rows[-1], flush=True)
        for spec in args.step_floor:
            name, p = spec.split(":")
            rows.append(step_floor_row(tree, name, int(p)))
            print(rows[-1], flush=True)
        for spec in args.seeds:
            name, p = spec.split(":")
            rows.append(seeds_row(tree, name, int(p)))
            print(rows[-1], flush=True)
        for spec in args.commands:
            name, p, limit = spec.split(":")
            rows.append(command_row(tree, name, int(p), int(limit)))
            print(rows[-1], flush=True)
    write_result("bench_seeds", args.out, rows, trees=trees,
                 digest_note="floors rows: sha256 of every unit floor's float64 bytes, (m, q) in order")


if __name__ == "__main__":
    main()
