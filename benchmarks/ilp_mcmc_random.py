"""Time the ILP and MCMC solvers on two random ~200-vertex problems.

* ``dense``: a path with random skip edges, every cost matrix uniform random
  (a spin glass; the hardest case for the LP relaxation).
* ``layered``: a DNN-like chain with residual skips; each vertex's 56
  configurations are all splits (2^i, 2^j, 2^k) with i + j + k <= 5 (p = 32);
  vertex cost = compute / parallelism + random per-dimension penalties for
  splitting (so vertices disagree on their favourite split); edge cost = tensor size x (1 - overlap of the two splits).

Run:  PYTHONPATH=. python benchmarks/ilp_mcmc_random.py [time_limit_seconds]
"""

from __future__ import annotations

import itertools
import sys
import time

import numpy as np

from shardplan.search.ilp import solve_ilp
from shardplan.search.mcmc import solve_mcmc
from shardplan.search.problem import Problem


def dense_problem(n: int = 200, k_max: int = 50, seed: int = 1) -> Problem:
    rng = np.random.default_rng(seed)
    ks = [int(rng.integers(k_max // 2, k_max + 1)) for _ in range(n)]
    edges = [(v - 1, v) for v in range(1, n)] + [(int(rng.integers(max(0, v - 8), v - 1)), v) for v in range(2, n)]
    return Problem(
        names=tuple(f"v{i}" for i in range(n)),
        configs=tuple(tuple((j,) for j in range(k)) for k in ks),
        vertex_cost=tuple(rng.random(k) * 5 for k in ks),
        edges=tuple(edges),
        edge_cost=tuple(rng.random((ks[u], ks[v])) * 2 for u, v in edges),
    )


def layered_problem(n: int = 200, log_p: int = 5, seed: int = 0) -> Problem:
    rng = np.random.default_rng(seed)
    configs = tuple((2**i, 2**j, 2**k) for i, j, k in itertools.product(range(log_p + 1), repeat=3) if i + j + k <= log_p)
    c = np.array(configs, dtype=float)  # K x 3
    par = c.prod(axis=1)
    # overlap[a, b] = prod_d min(c_ad, c_bd) / max(c_ad, c_bd): 1 when the splits agree
    overlap = (np.minimum(c[:, None, :], c[None, :, :]) / np.maximum(c[:, None, :], c[None, :, :])).prod(axis=2)
    vcost, edges, ecost = [], [], []
    for v in range(n):
        flops = rng.uniform(1, 10)
        w = rng.uniform(0, 4, size=3)  # per-dimension penalty of splitting (all-reduce, halo, ...)
        split = (c - 1) / c  # 0 when a dimension is not split
        vcost.append(flops / par + (split * w).sum(axis=1) * 2 / np.sqrt(par))
        for u in [v - 1] + ([v - 3] if v % 3 == 0 and v >= 3 else []):
            if u >= 0:
                edges.append((u, v))
                ecost.append(rng.uniform(0.2, 2.0) * (1.0 - overlap))
    return Problem(
        names=tuple(f"v{i}" for i in range(n)),
        configs=tuple(configs for _ in range(n)),
        vertex_cost=tuple(vcost),
        edges=tuple(edges),
        edge_cost=tuple(np.clip(m, 0, None) for m in ecost),
    )


def main(time_limit: float) -> None:
    for name, problem in (("layered", layered_problem()), ("dense", dense_problem())):
        print(f"{name}: {problem.num_vertices} vertices, {len(problem.edges)} edges, K = {min(problem.sizes)}..{max(problem.sizes)}")
        inits = {"cheapest-own": None, "data-parallel": [0] * problem.num_vertices}
        if name == "layered":  # configuration 0 is (1, 1, 1); data parallel is (32, 1, 1)
            inits["data-parallel"] = [problem.configs[0].index((32, 1, 1))] * problem.num_vertices
        for (iname, init), seed in itertools.product(inits.items(), (0, 1)):
            t = time.perf_counter()
            m = solve_mcmc(problem, init=init, seed=seed)
            st = m.stats
            print(f"  mcmc {iname} seed {seed}: cost {m.cost:.4f}  {time.perf_counter() - t:.2f} s  proposals {st['proposals']}"
                  f"  accepted {st['accepted']}  to-best {st['iterations_to_best']}  stop {st['stop']}")
        t = time.perf_counter()
        s = solve_ilp(problem, time_limit=time_limit)
        st = s.stats
        print(f"  ilp: cost {s.cost:.4f}  optimal {s.optimal}  bound {s.bound}  gap {st['gap']:.3g}  {time.perf_counter() - t:.2f} s"
              f"  vars {st['variables']}  rows {st['constraints']}  nnz {st['nonzeros']}  status {st['status']}")


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 120.0)
