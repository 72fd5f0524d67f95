"""Bytes each device sends per training step: the compiled XLA program vs the cost model.

For each example model (MLP, two-layer transformer, CNN) and each strategy
(the optimal plan, data parallel with the batch split 8 ways, and for the
transformer the Megatron-LM layout), the traced loss is compiled as planned
on 8 simulated CPU devices; the collectives of the compiled HLO give the
bytes each device really sends (:func:`shardplan.export.hlo.hlo_bytes_per_device`),
the cost model gives its prediction (:func:`shardplan.export.hlo.predicted_bytes`).

    PYTHONPATH=. python benchmarks/bench_hlo_vs_model.py

writes ``benchmarks/results/hlo_vs_model.json``.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import importlib.util  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# the machine of the examples: a low FLOP-to-byte balance, so that the optimum splits the toy models
TOY = dict(num_devices=8, peak_flops=32e9, bandwidth=16e9, name="toy")


def load_example(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "examples", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def data_parallel_plan(tables: Any, batch_size: int, p: int = 8) -> Any:
    """Split each operator's batch dimension p ways: the dim indexing axis 0 of its output, else of its first input."""
    from shardplan.plan import plan_from_configs

    cfg = {}
    for op in tables.graph.operators:
        c = [1] * len(op.dims)
        for t in (op.output,) + op.inputs:
            if t.shape and t.shape[0] == batch_size and t.axes[0].dim is not None:
                c[op.dim_names.index(t.axes[0].dim)] = p
                break
        cfg[op.name] = c
    return plan_from_configs(tables, cfg, "data-parallel")


def megatron_plan(tables: Any, info: Any, mod: Any, p: int = 8) -> Any:
    """Megatron-LM: Q/K/V and FFN-in split on their output (heads / hidden), output and FFN-out on their input.

    An operator that reads a weight named in ``mod.MEGATRON_WEIGHT_AXES`` splits the dimension indexing
    that weight axis p ways; the attention core splits its head dimension (the one of extent HEADS), the
    FFN activation its hidden dimension (extent FFN); everything else (layer norms, residuals, loss) is
    replicated.
    """
    from shardplan.plan import plan_from_configs

    split_of: dict[str, str] = {}
    for leaf, uses in info.leaf_uses.items():
        key = info.leaf_names[leaf].rsplit("[", 1)[-1].strip("']")
        axis = mod.MEGATRON_WEIGHT_AXES.get(key)
        if axis is None:
            continue
        for op_name, dims in uses:
            if dims[axis] is not None:
                split_of[op_name] = dims[axis]
    cfg = {}
    for op in tables.graph.operators:
        c = [1] * len(op.dims)
        if op.name in split_of:
            c[op.dim_names.index(split_of[op.name])] = p
        elif not op.weights:
            # the attention core keeps heads split, the FFN activation keeps its hidden units split
            want = mod.HEADS if "attn" in op.name else mod.FFN if "ffn" in op.name else None
            dims = [d for d, e in op.dims if e == want]
            if dims:
                c[op.dim_names.index(dims[0])] = p
        cfg[op.name] = c
    return plan_from_configs(tables, cfg, "megatron")


def measure(plan: Any, info: Any, params: Any, batch: Any) -> dict[str, Any]:
    from shardplan.export.hlo import by_kind, hlo_bytes_per_device, parse_collectives, predicted_bytes
    from shardplan.export.jax import make_step

    step = make_step(plan, info)
    loss, grads = step(params, batch)
    hlo = step.lower(params, batch).compile().as_text()
    got = hlo_bytes_per_device(hlo)
    want = predicted_bytes(plan)
    ratio = got["total"] / want["total"] if want["total"] else (1.0 if got["total"] == 0 else float("inf"))
    return {
        "strategy": plan.name,
        "hlo_bytes": got,
        "model_bytes": want,
        "ratio_hlo_over_model": ratio,
        "collectives": by_kind(parse_collectives(hlo)),
        "predicted_seconds": plan.cost,
        "loss": float(loss),
        "configs": {k: list(v) for k, v in plan.configs.items() if any(c > 1 for c in v)},
    }


def main() -> None:
    import jax

    from shardplan.cost import build_tables
    from shardplan.frontends.jax import trace
    from shardplan.machine import Machine
    from shardplan.plan import solve_tables

    machine = Machine(**TOY)
    out: dict[str, Any] = {"machine": TOY, "devices": 8, "results": []}
    for name in ("jax_mlp", "jax_transformer", "jax_cnn"):
        mod = load_example(name)
        params, batch = mod.init_params(jax.random.PRNGKey(0)), mod.make_batch(jax.random.PRNGKey(1))
        graph, info = trace(mod.loss_fn, params, batch)
        tables = build_tables(graph, machine, cutoff=1, divides_p=True)
        plans = [solve_tables(tables), data_parallel_plan(tables, mod.BATCH)]
        if hasattr(mod, "MEGATRON_WEIGHT_AXES"):
            plans.append(megatron_plan(tables, info, mod))
        for plan in plans:
            row = measure(plan, info, params, batch)
            row["model"] = name
            out["results"].append(row)
            print(f"{name:<16} {row['strategy']:<14} hlo {row['hlo_bytes']['total']:>12.0f} B  "
                  f"model {row['model_bytes']['total']:>12.0f} B  ratio {row['ratio_hlo_over_model']:.3f}  "
                  f"{row['collectives']}", flush=True)
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "hlo_vs_model.json"), "w") as f:
        json.dump(out, f, indent=1, default=float)


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
