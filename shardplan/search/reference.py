"""Reference solvers: simple, obviously correct, slow. Used to check :func:`solve_dp`.

solve_bruteforce
    Evaluates F on every assignment (Π_v K_v of them), in vectorised chunks.
solve_bfs_dp
    The paper's naive recurrence (2) over a breadth-first order:

        BV(i, φ) = min_{c ∈ C(v(i))}  HV(i, φ ∪ {v(i): c}) + BV(i−1, φ ∪ {v(i): c})

    with one running table BV indexed by the configurations of the frontier
    (vertices after i adjacent to some vertex up to i) and
    HV(i) = t_l(v(i)) + Σ_{edges from v(i) to later vertices} M. Each edge is
    added once, at its earlier endpoint; no pruning, no compression.
"""

from __future__ import annotations

import time

import numpy as np

from shardplan.errors import ShardplanError, TableMemoryError
from shardplan.search.dp import default_memory_limit
from shardplan.search.ordering import bfs
from shardplan.search.problem import Problem, Solution, certify

__all__ = ["solve_bruteforce", "solve_bfs_dp"]

_CHUNK = 1 << 16
# numpy's limit on array dimensions: brute force indexes one axis per vertex, the breadth-first DP's table one
# per frontier vertex.
MAX_DIMS = 64
_CHUNK_INDICES = 1 << 22  # brute force: at most this many configuration indices (int64) per chunk


def bfs_step_bytes(prev_entries: int, full_entries: int, k_v: int, kept_bytes: int) -> int:
    """Upper bound of the bytes the breadth-first DP holds while eliminating one vertex.

    With ``full`` = entries of the table over the frontier and v, and
    ``out = full / K_v``: the previous running table (8 prev), the sum HV + BV
    being built (two full float64 tables alive while one term is added),
    the argmin over v (int64, then narrowed to the kept dtype) and the new
    running table (8 out each), plus everything already kept for
    back-substitution (``kept_bytes``: the argmin tables of earlier steps).
    """
    out = full_entries // max(1, k_v)
    return kept_bytes + 8 * prev_entries + 16 * full_entries + (8 + 8 + _arg_itemsize(k_v)) * out


def _arg_itemsize(k: int) -> int:
    return int(np.dtype(np.min_scalar_type(max(k - 1, 0))).itemsize)


def solve_bruteforce(problem: Problem, max_combinations: int = 10**7) -> Solution:
    """Exact minimum of F by enumerating every assignment (refuses above ``max_combinations``)."""
    t0 = time.perf_counter()
    sizes = problem.sizes
    total = 1
    for k in sizes:
        total *= k
    if total > max_combinations:
        raise ShardplanError(
            f"brute force needs {total} combinations, over the limit of {max_combinations}"
        )
    if len(sizes) > MAX_DIMS:
        raise ShardplanError(f"brute force enumerates at most {MAX_DIMS} vertices (numpy's limit on array "
                             f"dimensions), the problem has {len(sizes)}; use --solver dp")
    best_cost, best_flat = np.inf, 0
    chunk = max(1, min(_CHUNK, _CHUNK_INDICES // max(1, len(sizes))))  # one int64 index per vertex and row
    for start in range(0, total, chunk):
        flat = np.arange(start, min(total, start + chunk))
        digits = np.unravel_index(flat, sizes) if sizes else ()
        cost = np.zeros(len(flat))
        for v, c in enumerate(problem.vertex_cost):
            cost += c[digits[v]]
        for (s, d), m in zip(problem.edges, problem.edge_cost):
            cost += m[digits[s], digits[d]]
        j = int(np.argmin(cost))
        if cost[j] < best_cost:
            best_cost, best_flat = float(cost[j]), int(flat[j])
    assign = tuple(int(x) for x in np.unravel_index(best_flat, sizes)) if sizes else ()
    sol = Solution(cost=problem.evaluate(assign), assignment=assign, solve_seconds=time.perf_counter() - t0,
                   solver="bruteforce", optimal=True, bound=None,
                   stats={"combinations": total, "num_vertices": problem.num_vertices})
    return certify(problem, sol, float(best_cost) if sizes else None)


def solve_bfs_dp(problem: Problem, memory_limit_bytes: int | None = None) -> Solution:
    """Exact minimum of F by the naive breadth-first recurrence (2)."""
    t0 = time.perf_counter()
    limit = default_memory_limit() if memory_limit_bytes is None else int(memory_limit_bytes)
    n = problem.num_vertices
    order = bfs(problem)
    pos = {v: i for i, v in enumerate(order)}
    sizes = problem.sizes
    later_edges: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(n)]
    for (s, d), m in zip(problem.edges, problem.edge_cost):
        if pos[s] < pos[d]:
            later_edges[s].append((d, m))
        else:
            later_edges[d].append((s, m.T))

    axes: list[int] = []  # vertices indexing the running table BV
    table = np.zeros(())
    history: list[tuple[int, list[int], np.ndarray]] = []
    max_frontier, largest = 0, 0
    kept = 0  # bytes of the argmin tables kept for back-substitution
    peak = 0  # the largest bfs_step_bytes over the steps

    def add_axis(w: int) -> None:
        nonlocal table
        if w not in axes and len(axes) == MAX_DIMS:
            raise ShardplanError(f"vertex {problem.names[v]!r}: the breadth-first DP's table would span more than "
                                 f"{MAX_DIMS} vertices (numpy's limit on array dimensions); use --solver dp")
        if w not in axes:
            axes.append(w)
            table = table[..., None]

    for v in order:
        add_axis(v)
        for w, _ in later_edges[v]:
            add_axis(w)
        full = 1
        for w in axes:
            full *= sizes[w]
        need = bfs_step_bytes(int(table.size), full, sizes[v], kept)
        if need > limit:
            from shardplan.units import fmt_bytes

            raise TableMemoryError(
                f"vertex {problem.names[v]!r}: the breadth-first DP needs about {fmt_bytes(need)} here (a table "
                f"over {len(axes)} vertices of {full:.4g} entries, plus {fmt_bytes(kept)} of argmin tables kept "
                f"from earlier steps), over the memory limit of {fmt_bytes(limit)}; raise the limit "
                f"(--table-memory) or use the DP (--solver dp)"
            )
        largest = max(largest, full)
        peak = max(peak, need)

        def along(w: int, vec: np.ndarray, at: list[int] = axes) -> np.ndarray:
            shape = [1] * len(at)
            shape[at.index(w)] = len(vec)
            return vec.reshape(shape)

        h = table + along(v, problem.vertex_cost[v])
        for w, m in later_edges[v]:
            shape = [1] * len(axes)
            iv, iw = axes.index(v), axes.index(w)
            shape[iv], shape[iw] = m.shape
            h = h + (m if iv < iw else m.T).reshape(shape)
        h = np.broadcast_to(h, tuple(sizes[w] for w in axes))
        iv = axes.index(v)
        arg = np.argmin(h, axis=iv).astype(np.min_scalar_type(max(sizes[v] - 1, 0)))
        table = np.min(h, axis=iv)
        kept += arg.nbytes
        axes.remove(v)
        history.append((v, list(axes), arg))
        max_frontier = max(max_frontier, len(axes))

    assign = [0] * n
    for v, ax, arg in reversed(history):
        assign[v] = int(arg[tuple(assign[w] for w in ax)])
    sol = Solution(cost=problem.evaluate(assign), assignment=tuple(assign),
                   solve_seconds=time.perf_counter() - t0, solver="bfs-dp", optimal=True, bound=None,
                   stats={"ordering": "bfs", "max_dependent_set": max_frontier, "largest_table": largest,
                          "num_vertices": n, "dp_value": float(table), "memory_estimate_bytes": peak,
                          "kept_bytes": kept})
    return certify(problem, sol, float(table))
