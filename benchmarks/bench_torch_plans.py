"""PyTorch models traced with torch.export and solved for 8 devices: operators, solve times, plans.

The models are those of tests/torch_cases.py (tiny sizes) plus a Llama-style
block at a realistic width (d=4096, 32 heads, SwiGLU 11008, batch 8 x 2048
tokens), on the toy machine of the tests (32 GFLOP/s, 16 GB/s: splitting
pays even for tiny models) and on the h100 preset (8 devices). Tracing and
solving need no process group, and the plan is the one every rank of
``shardplan.torch.parallelize`` computes.

    PYTHONPATH=.:tests python benchmarks/bench_torch_plans.py

writes ``benchmarks/results/torch_plans.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))


def _plan_rows(plan: Any) -> list[dict[str, Any]]:
    from shardplan.torch import mesh_dims, plan_mesh_shape

    shape = plan_mesh_shape(list(plan.layouts.values()), plan.machine.num_devices)
    out = []
    for row in plan.operators():
        op = plan.graph[row["name"]]
        out.append({"name": row["name"], "kind": row["kind"],
                    "splits": {d: c for d, c in zip(row["dims"], row["config"]) if c > 1},
                    "mesh_axes": list(mesh_dims(plan.layout(op.name), shape, op.name))})
    return out


def main() -> None:
    import torch

    import torch_cases as tc
    from shardplan.machine import preset
    from shardplan.spmd import solve
    from shardplan.errors import ShardplanError
    from shardplan.torch import ShardplanWarning, report, trace
    from shardplan.torch.device import dtensor_machine

    results: dict[str, Any] = {}
    cases = dict(tc.CASES)

    def big_block() -> tuple[Any, tuple]:
        with torch.device("meta"):
            model = tc.LlamaBlock(d=4096, heads=32, ffn=11008, vocab=32000)
        ids = torch.zeros(8, 2048, dtype=torch.long, device="meta")
        return model, (ids, ids.clone())

    cases["llama_block_4096"] = big_block
    machines = {name: dtensor_machine(m)  # as shardplan.torch plans: the collectives DTensor sends, not XLA's
                for name, m in (("toy", tc.toy_machine(8)), ("h100", preset("h100", 8)))}
    for name, make in cases.items():
        torch.manual_seed(0)
        try:
            model, batch = make()
            t0 = time.perf_counter()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                graph, info = trace(model, batch)
        except (ShardplanError, ImportError) as e:  # recorded, not hidden: a model this environment cannot build
            # or torch.export cannot capture (tests/torch_hf5 runs those in the transformers-5 environment)
            results[name] = {"error": str(e).splitlines()[0]}
            print(name, results[name], flush=True)
            continue
        trace_s = time.perf_counter() - t0
        entry: dict[str, Any] = {"operators": len(graph), "trace_seconds": trace_s,
                                 "conservative": sorted(set(info.conservative.values())),
                                 "warnings": [str(w.message) for w in caught if issubclass(w.category, ShardplanWarning)]}
        for mname, machine in machines.items():
            plan = solve(graph, machine, cutoff=1)
            entry[mname] = {"build_seconds": plan.build_seconds, "solve_seconds": plan.solve_seconds,
                            "cost_seconds": plan.cost, "breakdown": plan.breakdown,
                            "split_operators": sum(1 for c in plan.configs.values() if max(c) > 1)}
            if name.startswith("llama_block"):
                entry[mname]["plan"] = _plan_rows(plan)
                print(report(plan, info))
        results[name] = entry
        print(name, {k: v for k, v in entry.items() if k not in ("toy", "h100")},
              {m: {k: entry[m][k] for k in ("build_seconds", "solve_seconds", "cost_seconds", "split_operators")}
               for m in machines})
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "torch_plans.json"), "w") as f:
        json.dump(results, f, indent=1, default=float)


if __name__ == "__main__":
    main()
