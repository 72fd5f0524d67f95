"""Solve times of the exact DP on synthetic problems shaped like the paper's models.

The problems come from a small stand-in cost model (not shardplan.cost): each
vertex is an operator with an iteration space (named dims, extents); a
configuration splits each dim by a divisor of its extent, with Π c_i <= p.
Vertex cost = compute / Π c + all-reduce of partial outputs (split reduction
dims) + weight-gradient all-reduce; edge cost = bytes each device lacks of the
tensor as the consumer needs it, forward and backward, with blocks aligned
(the intersection along a dim of splits a and b is extent / lcm(a, b)). Edge
rows therefore depend only on how the producer splits the tensor's dims, as
in real models.

Run:  PYTHONPATH=. python benchmarks/bench_dp_synthetic.py [--quick]
Writes benchmarks/results/dp_synthetic.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import resource
import sys
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardplan.search import Problem, solve_dp

from shardplan.search.reduce import reduce_problem

R_FLOP_PER_BYTE = 100.0
BYTES = 4


@dataclass(frozen=True)
class Op:
    """An operator: iteration dims, which dims index its input/output tensors and its weight."""

    name: str
    dims: tuple[str, ...]
    extents: tuple[int, ...]
    out: tuple[str, ...]
    inp: tuple[str, ...]
    weight: tuple[str, ...] = ()


def _divisors(n: int, p: int, cutoff: int) -> list[int]:
    return [d for d in range(1, min(n, p) + 1) if n % d == 0 and (d == 1 or n // d >= cutoff)]


def op_configs(op: Op, p: int, cutoff: int, max_configs: int | None = None) -> np.ndarray:
    """All (c_1..c_d) with c_i | extent_i, extent_i / c_i >= cutoff, Π c_i <= p (rows)."""
    choices = [_divisors(e, p, cutoff) for e in op.extents]
    out = []
    for c in itertools.product(*choices):
        if int(np.prod(c)) <= p:
            out.append(c)
    arr = np.array(out, dtype=np.int64)
    if max_configs is not None and len(arr) > max_configs:
        arr = arr[np.argsort(-arr.prod(axis=1), kind="stable")[:max_configs]]
    return arr


def _split(op: Op, cfg: np.ndarray, names: tuple[str, ...]) -> np.ndarray:
    return cfg[:, [op.dims.index(d) for d in names]] if names else np.ones((len(cfg), 0), dtype=np.int64)


def _prod(a: np.ndarray) -> np.ndarray:
    return a.prod(axis=1).astype(np.float64) if a.shape[1] else np.ones(len(a))


def vertex_cost(op: Op, cfg: np.ndarray) -> np.ndarray:
    flops = 6.0 * float(np.prod(op.extents))
    parts = _prod(cfg)
    red = [d for d in op.dims if d not in op.out]
    rsplit = _prod(_split(op, cfg, tuple(red)))
    out_elems = float(np.prod([op.extents[op.dims.index(d)] for d in op.out]))
    cost = flops / parts
    cost += R_FLOP_PER_BYTE * BYTES * out_elems / _prod(_split(op, cfg, op.out)) * 2 * (rsplit - 1) / rsplit
    if op.weight:
        w_elems = float(np.prod([op.extents[op.dims.index(d)] for d in op.weight]))
        nonw = tuple(d for d in op.dims if d not in op.weight)
        bsplit = _prod(_split(op, cfg, nonw))
        cost += R_FLOP_PER_BYTE * BYTES * w_elems / _prod(_split(op, cfg, op.weight)) * 2 * (bsplit - 1) / bsplit
    return cost


def edge_cost(u: Op, cu: np.ndarray, v: Op, cv: np.ndarray) -> np.ndarray:
    """Bytes (as FLOP) each device lacks, forward and backward; rows: u configs, cols: v configs."""
    a = _split(u, cu, u.out)
    b = _split(v, cv, v.inp)
    size = float(np.prod([u.extents[u.dims.index(d)] for d in u.out])) * BYTES
    pa, pb = _prod(a), _prod(b)
    lcm = np.ones((len(a), len(b)))
    for t in range(min(a.shape[1], b.shape[1])):
        lcm *= np.lcm(a[:, t][:, None], b[:, t][None, :])
    inter = size / lcm
    return R_FLOP_PER_BYTE * ((size / pb)[None, :] - inter + (size / pa)[:, None] - inter)


def build_problem(ops: list[Op], edges: list[tuple[int, int]], p: int, cutoff: int,
                  max_configs: int | None = None) -> Problem:
    cfgs = [op_configs(op, p, cutoff, max_configs) for op in ops]
    return Problem(
        names=tuple(op.name for op in ops),
        configs=tuple(tuple(tuple(int(x) for x in c) for c in cs) for cs in cfgs),
        vertex_cost=tuple(vertex_cost(op, cs) for op, cs in zip(ops, cfgs)),
        edges=tuple(edges),
        edge_cost=tuple(edge_cost(ops[s], cfgs[s], ops[d], cfgs[d]) for s, d in edges),
        dims=tuple(op.dims for op in ops),
    )


def _conv(name: str, b: int, c: int, hw: int, n: int, k: int) -> Op:
    return Op(name, ("b", "c", "h", "w", "n", "r", "s"), (b, c, hw, hw, n, k, k),
              out=("b", "n", "h", "w"), inp=("b", "c", "h", "w"), weight=("c", "n", "r", "s"))


def _elementwise(name: str, b: int, c: int, hw: int) -> Op:
    return Op(name, ("b", "c", "h", "w"), (b, c, hw, hw), out=("b", "c", "h", "w"), inp=("b", "c", "h", "w"))


def inception_like(p: int = 64, batch: int = 128, seed: int = 0) -> Problem:
    """~218 vertices: a conv stem, 11 modules of parallel conv branches joined by concat, FC."""
    rng = np.random.default_rng(seed)
    ops: list[Op] = []
    edges: list[tuple[int, int]] = []

    def add(op: Op, *preds: int) -> int:
        ops.append(op)
        i = len(ops) - 1
        edges.extend((q, i) for q in preds)
        return i

    hw, ch = 147, 32
    cur = add(_conv("stem0", batch, 3, 299 - 2, 32, 3))
    for j, (c_out, s) in enumerate([(32, 147), (64, 147), (64, 73), (80, 73), (192, 71), (192, 35)]):
        cur = add(_elementwise(f"stem{j}_relu", batch, ch, hw), cur)
        cur = add(_conv(f"stem{j + 1}", batch, ch, s, c_out, 3 if j % 2 else 1), cur)
        ch, hw = c_out, s
    # module plan: (count, spatial, channels, branch lengths, fan-out at the branch end)
    plan = [(3, 35, 288, [1, 2, 3, 2], False), (1, 17, 768, [1, 3, 2], False), (4, 17, 768, [1, 3, 5, 2], False),
            (1, 8, 1280, [2, 4, 2], False), (2, 8, 2048, [1, 3, 4, 2], True)]
    m = 0
    for count, hw, ch_out, branches, fan in plan:
        for _ in range(count):
            heads = []
            for bi, length in enumerate(branches):
                prev = cur
                for li in range(length):
                    last = li == length - 1
                    width = ch_out // len(branches) // 32 * 32 if last else int(rng.choice([64, 96, 128, 192, 384]))
                    k = 1 if li == 0 else int(rng.choice([1, 3]))
                    if last and fan and 0 < bi < 3:  # Inception-E: 1x3 and 3x1 side by side
                        heads.append(add(_conv(f"m{m}b{bi}c{li}x", batch, ch, hw, width, 3), prev))
                        heads.append(add(_conv(f"m{m}b{bi}c{li}y", batch, ch, hw, width, 3), prev))
                        prev = None
                        break
                    prev = add(_conv(f"m{m}b{bi}c{li}", batch, ch, hw, width, k), prev)
                    if not last:
                        prev = add(_elementwise(f"m{m}b{bi}r{li}", batch, width, hw), prev)
                if prev is not None:
                    heads.append(prev)
            cur = add(_elementwise(f"m{m}concat", batch, ch_out, hw), *heads)
            ch = ch_out
            m += 1
            if m == 7:  # auxiliary classifier after the fourth 17x17 module
                aux = add(_elementwise("aux_pool", batch, ch, 5), cur)
                aux = add(_conv("aux_conv0", batch, ch, 5, 128, 1), aux)
                aux = add(_conv("aux_conv1", batch, 128, 5, 768, 5), aux)
                add(Op("aux_fc", ("b", "n", "c"), (batch, 1000, 768), out=("b", "n"), inp=("b", "c"),
                       weight=("n", "c")), aux)
    cur = add(Op("pool", ("b", "c", "h", "w"), (batch, ch, 8, 8), out=("b", "c"), inp=("b", "c", "h", "w")), cur)
    fc = Op("fc", ("b", "n", "c"), (batch, 1000, ch), out=("b", "n"), inp=("b", "c"), weight=("n", "c"))
    cur = add(fc, cur)
    add(Op("softmax", ("b", "n"), (batch, 1000), out=("b", "n"), inp=("b", "n")), cur)
    return build_problem(ops, edges, p, cutoff=4)


def transformer_like(p: int = 64, layers: int = 6, batch: int = 64, seq: int = 256,
                     d_model: int = 1024, heads: int = 16, d_ff: int = 4096, vocab: int = 32000) -> Problem:
    """Encoder-decoder: embed, `layers` encoder (attn, ff), `layers` decoder (self, cross, ff), FC.

    The last encoder vertex feeds the cross-attention of every decoder layer.
    """
    ops: list[Op] = []
    edges: list[tuple[int, int]] = []

    def add(op: Op, *preds: int) -> int:
        ops.append(op)
        edges.extend((q, len(ops) - 1) for q in preds)
        return len(ops) - 1

    dk = d_model // heads

    def attn(name: str) -> Op:
        return Op(name, ("b", "s", "h", "c", "k"), (batch, seq, heads, d_model, dk),
                  out=("b", "s", "c"), inp=("b", "s", "c"), weight=("h", "c", "k"))

    def ff(name: str) -> Op:
        return Op(name, ("b", "s", "d", "e"), (batch, seq, d_model, d_ff),
                  out=("b", "s", "d"), inp=("b", "s", "d"), weight=("d", "e"))

    def embed(name: str) -> Op:
        return Op(name, ("b", "s", "d", "v"), (batch, seq, d_model, vocab),
                  out=("b", "s", "d"), inp=("b", "s", "v"), weight=("d", "v"))

    cur = add(embed("enc_embed"))
    for i in range(layers):
        cur = add(attn(f"enc{i}_attn"), cur)
        cur = add(ff(f"enc{i}_ff"), cur)
    enc_out = cur
    cur = add(embed("dec_embed"))
    for i in range(layers):
        cur = add(attn(f"dec{i}_self"), cur)
        cur = add(attn(f"dec{i}_cross"), cur, enc_out)
        cur = add(ff(f"dec{i}_ff"), cur)
    add(Op("fc", ("b", "s", "v", "d"), (batch, seq, vocab, d_model), out=("b", "s", "v"), inp=("b", "s", "d"),
           weight=("v", "d")), cur)
    return build_problem(ops, edges, p, cutoff=1)


def benchmark_problem(problem: Problem, orderings: tuple[str, ...] = ("min-table", "generateseq", "min-fill"),
                      repeat: int = 1, **solve_opts) -> dict:
    """Solve ``problem`` with each ordering; times, table statistics and memory."""
    sizes = problem.sizes
    t = time.perf_counter()
    red = reduce_problem(problem)
    reduce_s = time.perf_counter() - t
    out: dict = {
        "vertices": problem.num_vertices,
        "edges": len(problem.edges),
        "max_degree": max((sum(1 for e in problem.edges if v in e) for v in range(problem.num_vertices)), default=0),
        "K_max": max(sizes),
        "K_mean": float(np.mean(sizes)),
        "configs_after_reduction": red.stats["configs_after"],
        "configs_before_reduction": red.stats["configs_before"],
        "reduce_seconds": reduce_s,
        "runs": {},
    }
    costs = set()
    for name in orderings:
        sol = min((solve_dp(problem, ordering=name, **solve_opts) for _ in range(repeat)),
                  key=lambda s: s.solve_seconds)
        tracemalloc.start()  # a separate run: tracing allocations slows the solver down
        solve_dp(problem, ordering=name, **solve_opts)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        costs.add(round(sol.cost, 6))
        st = sol.stats
        out["runs"][name] = {
            "seconds": sol.solve_seconds,
            "reduce_seconds": st["reduce_seconds"],
            "order_seconds": st["order_seconds"],
            "dp_seconds": st["dp_seconds"],
            "cost": sol.cost,
            "max_dependent_set": st["max_dependent_set"],
            "total_table_entries": st["total_table_entries"],
            "largest_table": st["largest_table"],
            "peak_traced_mb": peak / 2**20,
            "maxrss_mb_so_far": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }
    out["orderings_agree"] = len(costs) == 1
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="p=8 only")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "dp_synthetic.json"))
    args = ap.parse_args(argv)
    ps = [8] if args.quick else [8, 32, 64]
    results = {"machine": {"python": sys.version.split()[0], "platform": platform.platform(),
                           "numpy": np.__version__}, "problems": {}}
    for p in ps:
        for label, make in (("inception_like", inception_like), ("transformer_like", transformer_like)):
            t = time.perf_counter()
            prob = make(p=p)
            build_s = time.perf_counter() - t
            key = f"{label}_p{p}"
            res = benchmark_problem(prob, repeat=2)
            res["build_seconds"] = build_s
            results["problems"][key] = res
            for o, r in res["runs"].items():
                print(f"{key:22s} {o:12s} K_max={res['K_max']:5d} kept={res['configs_after_reduction']:6d}/"
                      f"{res['configs_before_reduction']:6d} t={r['seconds']:7.3f}s (reduce {r['reduce_seconds']:.3f}) "
                      f"|D|max={r['max_dependent_set']} entries={r['total_table_entries']:.3g} "
                      f"largest={r['largest_table']:.3g} peak={r['peak_traced_mb']:.0f}MB", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
