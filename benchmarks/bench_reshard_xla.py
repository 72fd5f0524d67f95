"""One redistribution, three figures: what each device lacks, the steps the export performs, what XLA sends.

"What each device lacks" (:func:`shardplan.cost.edge.edge_volumes`, PaSE's
definition, computed exactly) is a lower bound no XLA lowering reaches on
many pairs. The export therefore carries a redistribution out as a sequence
of sharding constraints, each of which XLA lowers to one collective
(:mod:`shardplan.cost.reshard`, :func:`shardplan.jax.shardings.reshard_chain`),
and the edge cost charges the bytes of those steps
(``edge_volumes(..., steps=True)``, what :func:`~shardplan.cost.edge.edge_cost`
uses). This benchmark takes random pairs of one-level layouts (every
configuration of an 8x4x4x64 f32 tensor on 8 devices whose product divides
8, every nesting order) and compiles ``jit(x -> 2x)`` on 8 simulated CPU
devices with the first as the input sharding and the second as the output
sharding twice: as one change (XLA's own resharder, what the export did
before) and through the export's steps. It compares the bytes each device
sends (:func:`shardplan.jax.hlo.parse_collectives`) with the model's charge
(the steps' bytes) and with the lack (forward; times 4 bytes). Also the two
corpus edges that were outside +-10 % (MNIST CNN, T5).

    PYTHONPATH=. python benchmarks/bench_reshard_xla.py [--pairs 200] [--seed 1]

writes ``benchmarks/results/reshard_xla.json``: every pair (layouts, the
byte counts, XLA's collectives both ways) and a summary (how many of the
stepwise programs send exactly the model's bytes, how many pairs the steps
reach the lack on, the ratios of XLA's own resharder to the lack).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPE = (8, 4, 4, 64)
P = 8

# (producer layout, consumer layout) of the corpus edges outside +-10 %, as (config, nesting order)
CORPUS_PAIRS = {
    "mnist_cnn: avg pool -> flatten (batch 4 x channels 2 -> rows 4, 2 replicas)": (((4, 1, 1, 2), (0, 3)),
                                                                                      ((1, 4, 1, 1), (1,))),
    "T5: position bias -> scores + bias (heads 4 x keys 2 -> batch 8)": (((1, 4, 1, 2), (1, 3)),
                                                                          ((8, 1, 1, 1), (0,))),
}


def layouts(dims: tuple[str, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Every (config, nesting order) of SHAPE on P devices with Π config | P and equal blocks."""
    out = []
    for c in itertools.product((1, 2, 4, 8), repeat=len(SHAPE)):
        prod = 1
        for k in c:
            prod *= k
        if P % prod or any(n % k for n, k in zip(SHAPE, c)):
            continue
        for order in itertools.permutations([j for j in range(len(c)) if c[j] > 1]):
            out.append((c, order))
    return out


def compiled(src: Any, dst: Any, chain: list[Any]) -> list[Any]:
    """The collectives (that send anything) of ``jit(x -> 2x)`` from ``src`` to ``dst`` through ``chain``."""
    import jax
    import jax.numpy as jnp

    from shardplan.jax.hlo import parse_collectives

    def f(x: Any) -> Any:
        for s in chain:
            x = jax.lax.with_sharding_constraint(x, s)
        return x * 2.0

    hlo = jax.jit(f, in_shardings=src, out_shardings=dst).lower(jax.ShapeDtypeStruct(SHAPE, jnp.float32))
    return [c for c in parse_collectives(hlo.compile().as_text()) if c.sent > 0]


def measure(u: Any, v: Any, lu: Any, lv: Any, devices: Any, memo: dict) -> dict[str, Any]:
    """The lack, the model's charge (the steps), XLA's bytes as one change and through the steps, for one pair."""
    from shardplan.cost.edge import edge_volumes
    from shardplan.jax.shardings import layout_sharding, reshard_chain
    from shardplan.layout import LayoutArrays

    la, lb = LayoutArrays.stack([lu]), LayoutArrays.stack([lv])
    lack, _ = edge_volumes(u, la, v, 0, lb, P)
    model, _ = edge_volumes(u, la, v, 0, lb, P, steps=True)
    dims = u.dim_names
    src, dst = layout_sharding(lu, dims, devices), layout_sharding(lv, dims, devices)
    chain = reshard_chain(src, dst, SHAPE, devices, memo) or []
    one, steps = compiled(src, dst, []), compiled(src, dst, chain)
    return {"lack_bytes": int(lack[0, 0]) * 4, "model_bytes": int(model[0, 0]) * 4, "steps": len(chain) + 1,
            "hlo_bytes": sum(c.sent for c in steps), "collectives": [[c.kind, c.group, c.sent] for c in steps],
            "hlo_one_change_bytes": sum(c.sent for c in one),
            "one_change_collectives": [[c.kind, c.group, c.sent] for c in one]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    import jax

    from shardplan import ops
    from shardplan.ir import GraphBuilder
    from shardplan.layout import Layout

    t0, r0 = time.time(), resource.getrusage(resource.RUSAGE_SELF)
    b = GraphBuilder("pair")
    x = b.input("x", SHAPE, needs_grad=True)
    u = ops.elementwise("u", x)
    v = ops.elementwise("v", b.add(u))
    dims = u.dim_names
    devices = jax.devices()[:P]
    rng = random.Random(args.seed)
    space = layouts(dims)
    rows = []
    memo: dict = {}
    for label, (a, c) in CORPUS_PAIRS.items():
        row = measure(u, v, Layout.flat(dims, a[0], P, a[1]), Layout.flat(dims, c[0], P, c[1]), devices, memo)
        rows.append({"pair": label, "producer": list(map(list, a)), "consumer": list(map(list, c)), **row})
    for _ in range(args.pairs):
        a, c = rng.sample(space, 2)
        row = measure(u, v, Layout.flat(dims, a[0], P, a[1]), Layout.flat(dims, c[0], P, c[1]), devices, memo)
        rows.append({"producer": list(map(list, a)), "consumer": list(map(list, c)), **row})
        print(f"{a} -> {c}: lack {row['lack_bytes']} B, model {row['model_bytes']} B, XLA in steps "
              f"{row['hlo_bytes']:.0f} B {row['collectives']}, as one change {row['hlo_one_change_bytes']:.0f} B",
              flush=True)
    rnd = [r for r in rows if "pair" not in r]

    def quantiles(key: str) -> dict[str, Any]:
        q = sorted(r[key] / r["lack_bytes"] for r in rnd if r["lack_bytes"])
        return {"median": q[len(q) // 2] if q else None, "max": max(q, default=None),
                "within_10_percent": sum(1 for x in q if 0.9 <= x <= 1.1)}

    patterns: dict[str, int] = {}
    for r in rnd:
        if r["hlo_one_change_bytes"] != r["lack_bytes"]:
            key = " + ".join(sorted({k for k, _, _ in r["one_change_collectives"]}))
            patterns[key] = patterns.get(key, 0) + 1
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    summary = {
        "pairs": len(rnd),
        "steps_equal_model": sum(1 for r in rnd if r["hlo_bytes"] == r["model_bytes"]),
        "model_equal_lack": sum(1 for r in rnd if r["model_bytes"] == r["lack_bytes"]),
        "one_change_equal_lack": sum(1 for r in rnd if r["hlo_one_change_bytes"] == r["lack_bytes"]),
        "one_change_equal_model": sum(1 for r in rnd if r["hlo_one_change_bytes"] == r["model_bytes"]),
        "steps_below_one_change": sum(1 for r in rnd if r["hlo_bytes"] < r["hlo_one_change_bytes"]),
        "steps_above_one_change": sum(1 for r in rnd if r["hlo_bytes"] > r["hlo_one_change_bytes"]),
        "model_over_lack": quantiles("model_bytes"), "one_change_over_lack": quantiles("hlo_one_change_bytes"),
        "one_change_patterns_where_not_lack": patterns,
        "wall_s": time.time() - t0, "cpu_s": (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime),
        "jax": jax.__version__,
    }
    print(json.dumps(summary, indent=1))
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "reshard_xla.json"), "w") as f:
        json.dump({"shape": SHAPE, "devices": P, "seed": args.seed, "summary": summary, "pairs": rows}, f, indent=1)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(HERE))
    main()
