"""Bytes each device sends per training step: the compiled XLA program vs the cost model.

For each example model (MLP, two-layer transformer, CNN) and each model of
the third-party corpus (``tests/jax_corpus.py``), and each strategy (the
optimal plan, data parallel with the batch split 8 ways, and for the
transformer example the Megatron-LM layout), the traced loss is compiled as planned
on 8 simulated CPU devices; the collectives of the compiled HLO give the
bytes each device really sends (:func:`shardplan.jax.hlo.hlo_bytes_per_device`),
the cost model gives its prediction (:func:`shardplan.jax.hlo.predicted_bytes`).

    PYTHONPATH=. python benchmarks/bench_hlo_vs_model.py

writes ``benchmarks/results/hlo_vs_model.json``: every ratio, the collectives
by kind, and for a ratio outside ±10 % every collective with its bytes and
the explanation in :data:`CAUSES` where one is known.
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


# Why the compiled bytes differ from the prediction by more than 10 % (model -> cause), from reading the HLO.
CAUSES = {
    "mnist_cnn": "XLA all-gathers the first Dense's kernel (1024x256, and a 256x256 block in the backward pass) "
                 "where the plan splits its contraction and charges a partial-sum all-reduce of the 8x256 "
                 "output: the constraints fix the layouts around the dot, not the algorithm the SPMD "
                 "partitioner picks inside it.",
    "scan_layers": "the stacked kernel (4x64x64) has one layout, its first consumer's (layer 0), but the unrolled "
                   "scan plans each layer's slice on its own: XLA all-gathers the other layers' slices (and their "
                   "gradients) into their planned layouts, a redistribution of a weight, which the model does not "
                   "charge (weights are not edges of the graph).",
    "lm_remat": "not verified; the likely cause is the tied embedding (nn.Embed used as lookup and as attend): "
                "one table, two consumers with different layouts, the same uncharged weight redistribution as "
                "scan_layers.",
    "FlaxGPT2LMHeadModel": "(data parallel) the collectives' bytes equal the model's operator bytes exactly; the "
                           "model's edge redistribution is not sent by XLA (not traced to a cause yet).",
}


def by_kind(collectives: Any) -> dict[str, int]:
    """How many collectives of each kind."""
    out: dict[str, int] = {}
    for c in collectives:
        out[c.kind] = out.get(c.kind, 0) + 1
    return out


def measure(plan: Any, info: Any, params: Any, batch: Any) -> dict[str, Any]:
    from shardplan.jax.hlo import hlo_bytes_per_device, parse_collectives, predicted_bytes
    from shardplan.jax.run import make_step

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
        "collective_list": [{"kind": c.kind, "group": c.group, "sent": c.sent, "hlo": c.line[:200]}
                            for c in parse_collectives(hlo) if c.sent > 0]
        if not 0.9 <= ratio <= 1.1 else [],
    }


def main() -> None:
    import jax

    from shardplan.baselines import baseline_plan
    from shardplan.cost import build_tables
    from shardplan.jax.lower import trace
    from shardplan.machine import Machine
    from shardplan.plan import solve_tables

    machine = Machine(**TOY)
    out: dict[str, Any] = {"machine": TOY, "devices": 8, "results": []}
    for name in ("jax_mlp", "jax_transformer", "jax_cnn"):
        mod = load_example(name)
        params, batch = mod.init_params(jax.random.PRNGKey(0)), mod.make_batch(jax.random.PRNGKey(1))
        graph, info = trace(mod.loss_fn, params, batch)
        tables = build_tables(graph, machine, cutoff=1, divides_p=True)
        plans = [solve_tables(tables), baseline_plan("data_parallel", tables)]
        if hasattr(mod, "megatron_plan"):
            plans.append(mod.megatron_plan(tables, info))
        for plan in plans:
            row = measure(plan, info, params, batch)
            row["model"] = name
            out["results"].append(row)
            print(f"{name:<16} {row['strategy']:<14} hlo {row['hlo_bytes']['total']:>12.0f} B  "
                  f"model {row['model_bytes']['total']:>12.0f} B  ratio {row['ratio_hlo_over_model']:.3f}  "
                  f"{row['collectives']}", flush=True)
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from jax_corpus import CORPUS

    for entry in CORPUS:
        try:
            loss_fn, params, batch = entry.build()
            graph, info = trace(loss_fn, params, batch)
        except Exception as e:  # a model that does not go in is a result too
            out["results"].append({"model": entry.name, "library": entry.library, "error": f"{type(e).__name__}: {e}"})
            print(f"{entry.name:<32} ERROR {type(e).__name__}: {e}", flush=True)
            continue
        tables = build_tables(graph, machine, cutoff=1, divides_p=True)
        for plan in (solve_tables(tables), baseline_plan("data_parallel", tables)):
            row = measure(plan, info, params, batch)
            row.update(model=entry.name, library=entry.library)
            if not 0.9 <= row["ratio_hlo_over_model"] <= 1.1:
                row["cause"] = CAUSES.get(entry.name, "not explained yet: see collective_list")
            out["results"].append(row)
            print(f"{entry.name:<32} {row['strategy']:<14} hlo {row['hlo_bytes']['total']:>12.0f} B  "
                  f"model {row['model_bytes']['total']:>12.0f} B  ratio {row['ratio_hlo_over_model']:.3f}  "
                  f"{row['collectives']}", flush=True)
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "hlo_vs_model.json"), "w") as f:
        json.dump(out, f, indent=1, default=float)


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
