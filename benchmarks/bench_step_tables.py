"""CPU seconds to build the cost tables with and without the stepwise redistribution volumes.

The steps of a redistribution (:mod:`shardplan.cost.reshard`) are charged where
``Machine.stepwise_redistribution`` is on (the JAX path). This benchmark builds
:func:`shardplan.cost.build_tables` (``cutoff=1``, as ``shardplan.jax.plan``) on
8 devices, one level, for

* the JAX corpus's Flax GPT-2 and Llama (``tests/jax_corpus.py``) on the toy
  machine of the corpus tests (32 GFLOP/s, 16 GB/s);
* the PyTorch ``hf_llama`` case (``tests/torch_cases.py``, traced with
  ``shardplan.torch.trace``) on the toy machine of the torch tests with the
  steps on (``shardplan.torch`` itself plans with them off: DTensor's
  redistribute is not XLA's steps);

each with the steps off (what each device lacks) and on, ``--repeat`` times
(the minimum is the figure), and writes
``benchmarks/results/step_tables_<label>.json`` (CPU seconds, user + sys, of
this process; the one-minute load average before and after). Run it on the
tree that ``PYTHONPATH`` names; ``--label`` names the result (e.g. ``before``
with ``PYTHONPATH`` on a checkout before a change):

    PYTHONPATH=. python benchmarks/bench_step_tables.py [--label after] [--repeat 3] [--no-torch]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _timed(build: Callable[[], Any], repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        c0 = _cpu()
        build()
        out.append(round(_cpu() - c0, 3))
    return out


def _jax_graphs() -> dict[str, Any]:
    from jax_corpus import hf_gpt2, hf_llama

    from shardplan.jax.staged import Tracer, batch_size

    graphs = {}
    for name, make in (("flax_gpt2", hf_gpt2), ("flax_llama", hf_llama)):
        loss_fn, params, batch = make()
        tracer = Tracer(loss_fn, params, batch)
        graphs[name] = tracer(batch_size(tracer.full_info))
    return graphs


def _torch_graph() -> Any:
    import torch
    import torch_cases as tc

    from shardplan.torch import trace

    torch.manual_seed(0)
    model, batch = tc.make_hf_llama()
    return trace(model, batch)[0], tc.toy_machine(8)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", default="after")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-torch", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

    from shardplan.cost import build_tables
    from shardplan.machine import Machine

    load0 = os.getloadavg()[0]
    toy = Machine(8, peak_flops=32e9, bandwidth=16e9, name="toy")
    cases = [(name, g, toy) for name, g in _jax_graphs().items()]
    if not args.no_torch:
        g, m = _torch_graph()
        cases.append(("torch_hf_llama", g, m))
    rows = {}
    for name, graph, machine in cases:
        row: dict[str, Any] = {"operators": len(graph)}
        for steps in (False, True):
            m = dataclasses.replace(machine, stepwise_redistribution=steps)
            row["steps_cpu_s" if steps else "lack_cpu_s"] = _timed(lambda: build_tables(graph, m, cutoff=1),
                                                                   args.repeat)
        row["ratio_of_minima"] = round(min(row["steps_cpu_s"]) / min(row["lack_cpu_s"]), 2)
        rows[name] = row
        print(name, row, flush=True)
    tree = os.path.dirname(os.path.dirname(os.path.abspath(sys.modules["shardplan"].__file__)))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=tree).stdout.strip()
    out = {"label": args.label, "commit": commit, "tree": tree,
           "devices": 8, "cutoff": 1, "load_1min_before": load0, "load_1min_after": os.getloadavg()[0],
           "cpu_count": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "models": rows}
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", f"step_tables_{args.label}.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
