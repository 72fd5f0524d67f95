"""Bytes each device sends per training step: the compiled XLA program vs the cost model.

For each example model (MLP, two-layer transformer, CNN) and each model of
the third-party corpus (``tests/jax_corpus.py``), and each strategy (the
optimal plan, data parallel with the batch split 8 ways, and for the
transformer example the Megatron-LM layout), the traced loss is compiled as planned
on 8 simulated CPU devices; the collectives of the compiled HLO give the
bytes each device really sends (:func:`shardplan.jax.hlo.hlo_bytes_per_device`),
the cost model gives its prediction (:func:`shardplan.jax.hlo.predicted_bytes`).

    PYTHONPATH=. python benchmarks/bench_hlo_vs_model.py [--only NAME ...]

(``--only``: those models alone, printed, no JSON written.)

writes ``benchmarks/results/hlo_vs_model.json``: every ratio, the collectives
by kind, and for a ratio outside ±10 % every collective with its bytes and
the explanation in :data:`CAUSES` (every such ratio has one; a new one is
reported as "not explained yet"); known gaps inside ±10 % are in :data:`NOTES`.
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
    "FlaxBloomForCausalLM": (
        "(Read when this row was outside +-10 %; it is now 155655 B compiled against 151495 B charged, 1.027, and "
        "this text no longer fires.) 151046 B charged, 173638 B compiled (+22592 B). (a) +16384 B: the MLP weight gradients (dense_h_to_4h and "
        "dense_4h_to_h of both layers, each 8192 B per device) are partial sums over 4 devices (batch 2 x sequence "
        "2); the model charges one all-reduce over the 4 (2 x 3/4 x 8192 = 12288 B each), XLA reduces over the "
        "batch pair then over the sequence pair, two all-reduces of 2 (16384 B each: all-reduce.71 and .72, "
        "replica groups {0,4} then {0,2}). (b) +3072 B: the tied embedding's weight edge (lookup: the table split "
        "over the hidden axis 4 ways; LM head: over the vocabulary 2 ways): the model charges what each device "
        "lacks, 4096 B; XLA replicates the table ('Involuntary full rematerialization': all-gather of the whole "
        "64x32 table, 6144 B) and gathers the gradient back (1024 B). (c) +1344 B: the backward of the edges "
        "into the embedding LayerNorm (gather -> sub, reduce_sum -> sub/square): 2 all-to-alls of 1536 B and 2 "
        "all-gathers of 192 B where the model charges 2112 B. 1792 B (1 %) not attributed. (a) is XLA's "
        "lowering of a dot whose contracting dimensions are split on two mesh axes; the model's single "
        "all-reduce over the product group is the cheaper algorithm, not reachable from the export's sharding "
        "constraints."
    ),
}

# Known gaps inside +-10 % (model -> cause), from reading the HLO.
NOTES = {
    "mnist_cnn": "the edge into the flatten after the second avg pool (batch 4 x channels 2 -> rows 4) was 1.16: "
                 "the model charged what each device lacks (7168 B forward), XLA's resharder sent 18432 B. The "
                 "export now redistributes in the steps the model charges (shardplan.cost.reshard: two "
                 "all-to-alls of 2 and an all-gather, 8192 B forward), compiled to exactly those bytes "
                 "(benchmarks/results/reshard_xla.json, the pair alone): 1.159 -> 1.056. The rest not re-read.",
    "FlaxT5ForConditionalGeneration": "the position bias (heads 4 x keys 2 -> batch 8) was replicated whole by "
                 "XLA ('involuntary full rematerialization'): 1.52. In the export's steps (an all-to-all of 4 and "
                 "one of 2, the bytes the model now charges) it is 0.979.",
    "lm_remat": "the tied embedding (nn.Embed used as lookup and as attend): one table, its leaf in the lookup's "
                "layout; the optimal plan lays it out differently for attend, and the weight edge between the two "
                "readers charges the move (cost/edge.py weight_edge_cost). What remains was not re-examined in "
                "the HLO; the earlier reading saw the nn.remat blocks re-send their forward all-gathers when "
                "recomputed in the backward pass.",
    "FlaxRegNetForImageClassification": "the grouped 3x3 convolutions of the bottlenecks: XLA's SPMD partitioner "
                "partitions no grouped convolution (split along the batch, the groups or the image, it all-gathers "
                "the operands and computes it whole); the frontend now describes one with every dimension fixed "
                "(shardplan/jax/lower.py), so the model charges those all-gathers as edges: 3.274 -> 1.019 on the "
                "solved plan, 2.047 -> 1.000 with data parallel.",
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
    import argparse

    import jax

    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", default=None, help="model names (examples or corpus); nothing written")
    args = ap.parse_args()
    only = set(args.only) if args.only else None

    from shardplan.baselines import baseline_plan
    from shardplan.cost import build_tables
    from shardplan.jax.lower import trace
    from shardplan.machine import Machine
    from shardplan.spmd import solve_tables

    machine = Machine(**TOY)
    out: dict[str, Any] = {"machine": TOY, "devices": 8, "results": []}
    for name in ("jax_mlp", "jax_transformer", "jax_cnn"):
        if only is not None and name not in only:
            continue
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
            if not 0.9 <= row["ratio_hlo_over_model"] <= 1.1:
                row["cause"] = CAUSES.get(name, "not explained yet: see collective_list")
            out["results"].append(row)
            print(f"{name:<16} {row['strategy']:<14} hlo {row['hlo_bytes']['total']:>12.0f} B  "
                  f"model {row['model_bytes']['total']:>12.0f} B  ratio {row['ratio_hlo_over_model']:.3f}  "
                  f"{row['collectives']}", flush=True)
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from jax_corpus import CORPUS

    for entry in CORPUS:
        if only is not None and entry.name not in only:
            continue
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
            elif entry.name in NOTES and row["strategy"] != "data_parallel":
                row["note"] = NOTES[entry.name]
            out["results"].append(row)
            print(f"{entry.name:<32} {row['strategy']:<14} hlo {row['hlo_bytes']['total']:>12.0f} B  "
                  f"model {row['model_bytes']['total']:>12.0f} B  ratio {row['ratio_hlo_over_model']:.3f}  "
                  f"{row['collectives']}", flush=True)
    if only is not None:
        return
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "hlo_vs_model.json"), "w") as f:
        json.dump(out, f, indent=1, default=float)


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
