"""One redistribution, two answers: the cost model's edge volume vs the bytes XLA's compiled reshard sends.

The edge cost (:func:`shardplan.cost.edge.edge_volumes`) charges, per
device, what it lacks of the tile its consumer needs, the maximum over
devices (PaSE's definition, computed exactly). XLA's SPMD partitioner
reshards with its own sequence of collectives (all-gather, all-to-all,
collective-permute; "involuntary full rematerialization" when it finds no
better way: all-gather the whole tensor, then slice). This benchmark takes
random pairs of one-level layouts (every configuration of an 8x4x4x64 f32
tensor on 8 devices whose product divides 8, every nesting order), compiles
``jit(x -> 2x)`` with the first as the input sharding and the second as the
output sharding on 8 simulated CPU devices, and compares the bytes each
device sends (:func:`shardplan.jax.hlo.hlo_bytes_per_device`) with the edge
volume of the same pair (forward; times 4 bytes). Also the two corpus edges
outside +-10 % (MNIST CNN, T5; benchmarks/results/hlo_vs_model.json).

    PYTHONPATH=. python benchmarks/bench_reshard_xla.py [--pairs 200] [--seed 1]

writes ``benchmarks/results/reshard_xla.json``: every pair (layouts, both
byte counts, XLA's collectives) and a summary (how many equal, the ratio
quantiles, the collective patterns of the pairs where they differ).
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


def measure(u: Any, v: Any, lu: Any, lv: Any, devices: Any) -> dict[str, Any]:
    """Edge volume (bytes) and XLA's bytes for one pair of layouts."""
    import jax
    import jax.numpy as jnp

    from shardplan.cost.edge import edge_volumes
    from shardplan.jax.hlo import parse_collectives
    from shardplan.jax.shardings import layout_sharding
    from shardplan.layout import LayoutArrays

    fwd, _ = edge_volumes(u, LayoutArrays.stack([lu]), v, 0, LayoutArrays.stack([lv]), P)
    dims = u.dim_names
    f = jax.jit(lambda x: x * 2.0, in_shardings=layout_sharding(lu, dims, devices),
                out_shardings=layout_sharding(lv, dims, devices))
    hlo = f.lower(jax.ShapeDtypeStruct(SHAPE, jnp.float32)).compile().as_text()
    cs = [c for c in parse_collectives(hlo) if c.sent > 0]
    return {"model_bytes": int(fwd[0, 0]) * 4, "hlo_bytes": sum(c.sent for c in cs),
            "collectives": [[c.kind, c.group, c.sent] for c in cs]}


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
    for label, (a, c) in CORPUS_PAIRS.items():
        row = measure(u, v, Layout.flat(dims, a[0], P, a[1]), Layout.flat(dims, c[0], P, c[1]), devices)
        rows.append({"pair": label, "producer": list(map(list, a)), "consumer": list(map(list, c)), **row})
    for _ in range(args.pairs):
        a, c = rng.sample(space, 2)
        row = measure(u, v, Layout.flat(dims, a[0], P, a[1]), Layout.flat(dims, c[0], P, c[1]), devices)
        rows.append({"producer": list(map(list, a)), "consumer": list(map(list, c)), **row})
        print(f"{a} -> {c}: model {row['model_bytes']} B, XLA {row['hlo_bytes']:.0f} B {row['collectives']}",
              flush=True)
    rnd = [r for r in rows if "pair" not in r]
    ratios = sorted(r["hlo_bytes"] / r["model_bytes"] for r in rnd if r["model_bytes"])
    patterns: dict[str, int] = {}
    for r in rnd:
        if r["hlo_bytes"] != r["model_bytes"]:
            key = " + ".join(sorted({k for k, _, _ in r["collectives"]}))
            patterns[key] = patterns.get(key, 0) + 1
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    summary = {
        "pairs": len(rnd), "equal": sum(1 for r in rnd if r["hlo_bytes"] == r["model_bytes"]),
        "xla_below_model": sum(1 for r in rnd if r["hlo_bytes"] < r["model_bytes"]),
        "within_10_percent": sum(1 for q in ratios if 0.9 <= q <= 1.1),
        "ratio_median": ratios[len(ratios) // 2] if ratios else None, "ratio_max": max(ratios, default=None),
        "patterns_where_different": patterns,
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
