"""The exact dynamic program (PaSE recurrence (4)) as min-sum variable elimination.

Recurrence
----------
For an ordering v(1..n), the table of step i is indexed by configurations φ
of the dependent set D(i):

    RV(i, φ) = min_{c ∈ C(v(i))}  t_l(v(i), c)
                                  + Σ_{w ∈ N(v(i)) ∩ V>i} M_(v(i),w)[c, φ(w)]
                                  + Σ_{j ∈ S(i)} RV(j, φ ∪ {v(i): c} restricted to D(j))

In variable-elimination form every live table is a *factor* over a scope of
not-yet-eliminated vertices: initially one factor per adjacent pair (the
merged edge matrices) and the vertex costs; eliminating v sums all factors
whose scope contains v (exactly the edge matrices to later neighbours and the
tables RV(j) of the components S(i), whose dependent sets contain v), takes
the minimum over v's configurations and leaves one new factor RV(i) over
D(i) = (union of those scopes) − {v}. A factor with empty scope is a scalar:
the optimum of a finished connected component. The argmin over v, indexed
like RV(i), is kept; back-substitution from the last eliminated vertex reads
every vertex's choice given the choices of its dependent set.

Less work than the plain recurrence
-----------------------------------
0. Bound pruning (:mod:`shardplan.search.bounds`, ``bounds=True``): a
   configuration whose lower bound (forest min-marginals after TRW-S
   reparametrisation) exceeds the cost of a feasible assignment is in no
   optimal assignment and is dropped. On the zoo models the relaxation is
   tight and usually about one configuration per vertex survives.
1. Reductions before the DP (:mod:`shardplan.search.reduce`): identical
   configurations collapsed, dominated ones dropped, to a fixed point.
2. Class compression. A factor only distinguishes configurations of a scope
   vertex w up to its *classes*: ``maps[w][config] -> axis index``, where two
   configurations sharing an index have identical slices. Edge matrices in
   DNN problems have few distinct rows (a row depends only on how the
   producer lays out its output tensor), so an axis is the number of distinct
   layouts, not the number of configurations. When v is eliminated, each
   vertex w of D(i) ∪ {v} is indexed by its *joint* class over the factors
   being combined (configurations equal in every one of them share it); for
   v itself the vertex cost is folded in before the minimum, so of each joint
   class only the cheapest configuration can win. The new table is indexed by
   joint classes, and its identical slices are merged again afterwards.
3. Chunked minimum. The sum over D(i) ∪ {v} is never held at once: v's
   classes are processed in chunks, each reduced by min/argmin into the
   running result, so memory is O(|table over D(i)| + chunk).

All three keep the optimum exact; the returned assignment is in original
configuration indices and its cost is recomputed with :meth:`Problem.evaluate`.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from shardplan.errors import ShardplanError, TableMemoryError
from shardplan.search.bounds import RTOL, bound_prune
from shardplan.search.memo import ArrayLedger, DigestCache, EliminationMemo, MemoEntry, digest
from shardplan.search.ordering import ORDERINGS, Ordering
from shardplan.search.pairs import identical_rows, merge_pairs, view_key
from shardplan.search.problem import Problem, Solution, certify
from shardplan.search.reduce import Reduction, identity_reduction, orbits, reduce_problem, symmetric_reduction

__all__ = ["solve_dp", "solve_small", "default_memory_limit", "resolve_ordering"]

# Entries of the float64 work buffer of one chunk of the minimum.
_CHUNK_ENTRIES = 1 << 21
# Tables at most this large get their identical slices merged after each step.
_COMPRESS_MAX = 1 << 24


def default_memory_limit() -> int:
    """A quarter of the currently available physical memory, in bytes."""
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")) // 4
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 2 << 30


def resolve_ordering(ordering: str | Ordering) -> tuple[str, Ordering]:
    """Name and function of an ordering given by registry name or as a callable."""
    if callable(ordering):
        return getattr(ordering, "__name__", "custom"), ordering
    if ordering not in ORDERINGS:
        raise ShardplanError(f"unknown ordering {ordering!r}; known: {', '.join(sorted(ORDERINGS))}")
    return ordering, ORDERINGS[ordering]


@dataclass
class _Factor:
    """A table over a scope; ``table[maps[0][c0], maps[1][c1], ...]`` is its value at (c0, c1, ...)."""

    scope: tuple[int, ...]
    maps: tuple[np.ndarray, ...]
    table: np.ndarray
    sig: tuple[bytes, ...] | None = None  # digests of table and maps, once computed (memo key)

    def arrays(self) -> tuple[np.ndarray, ...]:
        return (self.table,) + self.maps

    def signature(self) -> tuple[bytes, ...]:
        """Digests of the table and the class maps (:func:`shardplan.search.memo.digest`), cached."""
        if self.sig is None:
            self.sig = (digest(self.table),) + tuple(digest(m) for m in self.maps)
        return self.sig


@dataclass
class _Step:
    """What back-substitution needs from one elimination: v's best config given D's classes."""

    v: int
    dep: tuple[int, ...]
    maps: tuple[np.ndarray, ...]
    arg: np.ndarray

    def arrays(self) -> tuple[np.ndarray, ...]:
        return (self.arg,) + self.maps


def _slice_classes(table: np.ndarray, ax: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Classes of identical slices of ``table`` along axis ``ax``.

    Returns ``(inv, kept)``: slice i equals slice ``kept[inv[i]]``
    (:func:`~shardplan.search.pairs.identical_rows` on the flattened slices).
    """
    n = table.shape[ax]
    rep = identical_rows([np.moveaxis(table, ax, 0).reshape(n, -1)], rng)
    kept, inv = np.unique(rep, return_inverse=True)
    return inv.reshape(-1), kept


def _compress(f: _Factor, rng: np.random.Generator) -> _Factor:
    """Merge identical slices along every axis of ``f.table`` (maps follow)."""
    table, maps = f.table, list(f.maps)
    for ax in range(table.ndim):
        if table.shape[ax] <= 1:
            continue
        inv, kept = _slice_classes(table, ax, rng)
        if len(kept) < table.shape[ax]:
            table = np.take(table, kept, axis=ax)
            maps[ax] = inv[maps[ax]]
    return _Factor(f.scope, tuple(maps), table if table.flags.c_contiguous else table.copy())


def _joint_classes(cols: list[np.ndarray], sizes: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Joint classes of per-factor class maps of one vertex.

    Returns ``inv`` (config -> joint class) and ``reps`` of shape (n_classes,
    len(cols)): the per-factor class index of each joint class.
    """
    if len(cols) == 1:
        return cols[0], np.arange(sizes[0])[:, None]
    if float(np.prod([float(s) for s in sizes])) < 2.0**62:
        code = np.ravel_multi_index(tuple(cols), tuple(sizes))
        uniq, inv = np.unique(code, return_inverse=True)
        reps = np.stack(np.unravel_index(uniq, tuple(sizes)), axis=1)
    else:  # pragma: no cover - needs very many factors on one vertex
        reps, inv = np.unique(np.stack(cols, axis=1), axis=0, return_inverse=True)
    return inv.reshape(-1), reps


def _aligned(f: _Factor, targets: list[int], col: dict[int, int], reps: dict[int, np.ndarray],
             v: int, vsel: np.ndarray | slice) -> np.ndarray:
    """f's table re-indexed by joint classes, axes in ``targets`` order, v restricted to ``vsel``.

    The result broadcasts against the full (D..., chunk of v) work buffer:
    axes of ``targets`` not in f's scope have length 1.
    """
    t = f.table
    for ax, w in enumerate(f.scope):
        idx = reps[w][:, col[w]]
        if w == v:
            idx = idx[vsel]
        if not (len(idx) == t.shape[ax] and np.array_equal(idx, np.arange(len(idx)))):
            t = np.take(t, idx, axis=ax)
    pos = {w: i for i, w in enumerate(targets)}
    perm = sorted(range(len(f.scope)), key=lambda ax: pos[f.scope[ax]])
    t = np.transpose(t, perm)
    shape = [1] * len(targets)
    for ax in perm:
        shape[pos[f.scope[ax]]] = t.shape[perm.index(ax)]
    return t.reshape(shape)


def step_bytes(dsize: int, chunk: int) -> int:
    """Upper bound of the bytes one elimination allocates, for a table over D of ``dsize`` class
    combinations whose minimum over v is taken ``chunk`` classes of v at a time.

    In units of 8 bytes per D entry: the work buffer and up to two re-indexed
    copies of a factor added to it (3 chunk); the running minimum and argmin,
    the chunk's minimum, argmin and their merge (7); the argmin mapped to
    configurations, then narrowed (2); and merging identical slices of the new
    table (its moved copy, the sorted copy and the representatives: 3); plus
    bool masks, and 1 MiB for the per-vertex vectors and numpy's slack.
    """
    return 8 * dsize * (3 * chunk + 12) + 2 * dsize + (1 << 20)


def _eliminate(v: int, factors: list[_Factor], unary: np.ndarray, limit: int, name: str,
               stats: dict, rng: np.random.Generator, kept: int = 0) -> tuple[_Factor, _Step]:
    """Eliminate v: min over v of unary + Σ factors; returns RV over D and the argmin step.

    ``kept``: bytes already held (live tables, earlier argmin tables); the step
    is refused when ``kept`` plus its own :func:`step_bytes` exceeds ``limit``.
    """
    dep = tuple(sorted({w for f in factors for w in f.scope} - {v}))
    targets = list(dep) + [v]
    col: dict[int, int] = {}
    cols: dict[int, list[np.ndarray]] = {w: [] for w in targets}
    sizes: dict[int, list[int]] = {w: [] for w in targets}
    per_factor_col: list[dict[int, int]] = []
    for f in factors:
        fc = {}
        for ax, w in enumerate(f.scope):
            fc[w] = len(cols[w])
            cols[w].append(f.maps[ax])
            sizes[w].append(f.table.shape[ax])
        per_factor_col.append(fc)
    inv: dict[int, np.ndarray] = {}
    reps: dict[int, np.ndarray] = {}
    for w in targets:
        if cols[w]:
            inv[w], reps[w] = _joint_classes(cols[w], sizes[w])
        else:  # v with no factor: a single class
            inv[w], reps[w] = np.zeros(len(unary), dtype=np.int64), np.zeros((1, 0), dtype=np.int64)
    # v: cheapest configuration of each joint class
    order = np.lexsort((np.arange(len(unary)), unary, inv[v]))
    first = np.ones(len(order), dtype=bool)
    first[1:] = inv[v][order[1:]] != inv[v][order[:-1]]
    best_cfg = order[first]
    uv = unary[best_cfg]
    nv = len(best_cfg)
    dshape = tuple(int(reps[w].shape[0]) for w in dep)
    dsize = int(np.prod(dshape, dtype=np.float64)) if dep else 1
    entries = float(dsize) * nv
    chunk = int(max(1, min(nv, _CHUNK_ENTRIES // max(1, dsize))))
    need = kept + step_bytes(dsize, chunk)
    if need > limit:
        from shardplan.units import fmt_bytes

        raise TableMemoryError(
            f"vertex {name!r}: dependent set of size {len(dep)}, table of {entries:.3g} entries "
            f"({dsize} x {nv} classes) needs about {fmt_bytes(need)} with the {fmt_bytes(kept)} of tables kept "
            f"from earlier steps, over the memory limit of {fmt_bytes(limit)}"
        )
    stats["memory_estimate_bytes"] = max(stats.get("memory_estimate_bytes", 0), need)
    stats["total_table_entries"] += entries
    stats["largest_table"] = max(stats["largest_table"], entries)
    stats["max_dependent_set"] = max(stats["max_dependent_set"], len(dep))

    best = np.full(dshape, np.inf)
    arg = np.zeros(dshape, dtype=np.int64)
    buf = np.empty(dshape + (chunk,))
    for g0 in range(0, nv, chunk):
        g1 = min(nv, g0 + chunk)
        work = buf[..., : g1 - g0]
        work[...] = uv[g0:g1]
        for f, fc in zip(factors, per_factor_col):
            for w, c in fc.items():
                col[w] = c
            work += _aligned(f, targets, col, reps, v, slice(g0, g1))
        a = np.argmin(work, axis=-1)
        m = np.take_along_axis(work, a[..., None], axis=-1)[..., 0]
        if g0 == 0:
            best, arg = m, a
        else:
            better = m < best
            best = np.where(better, m, best)
            arg = np.where(better, a + g0, arg)
    kv = len(unary)
    arg_cfg = best_cfg[arg].astype(np.min_scalar_type(max(kv - 1, 0)))
    new = _Factor(dep, tuple(inv[w] for w in dep), best)
    if 0 < best.size <= _COMPRESS_MAX:
        new = _compress(new, rng)
    step = _Step(v, dep, tuple(inv[w] for w in dep), arg_cfg)
    return new, step


def _eliminate_alone(v: int, factors: list[_Factor], unary: np.ndarray, limit: int, name: str, stats: dict,
                     rng: np.random.Generator, kept: int = 0) -> tuple[_Factor, _Step]:
    """:func:`_eliminate` of a vertex no factor touches (``factors`` empty): its cheapest configuration, the
    first of equal ones (what the general step's stable sort and its one-class minimum give), as the same
    factor, step and stats without its class machinery."""
    need = kept + step_bytes(1, 1)
    if factors or need > limit or not np.isfinite(unary).all():  # the refusal, a non-finite cost: the general step
        return _eliminate(v, factors, unary, limit, name, stats, rng, kept=kept)
    k = int(np.argmin(unary))
    stats["memory_estimate_bytes"] = max(stats.get("memory_estimate_bytes", 0), need)
    stats["total_table_entries"] += 1.0
    stats["largest_table"] = max(stats["largest_table"], 1.0)
    stats["max_dependent_set"] = max(stats["max_dependent_set"], 0)
    arg = np.array(k).astype(np.min_scalar_type(max(len(unary) - 1, 0)))
    return _Factor((), (), np.array(unary[k], dtype=np.float64)), _Step(v, (), (), arg)


def _repeated_unaries(p: Problem, dcache: DigestCache) -> list[bool]:
    """Per vertex: does another vertex have an equal cost vector (a candidate for a repeated elimination)?"""
    keys = [dcache(c) for c in p.vertex_cost]
    count: dict[bytes, int] = {}
    for k in keys:
        count[k] = count.get(k, 0) + 1
    return [count[k] > 1 for k in keys]


def _eliminate_memo(v: int, factors: list[_Factor], unary: np.ndarray, limit: int, name: str, stats: dict,
                    rng: np.random.Generator, held: ArrayLedger,
                    memo: EliminationMemo | None, dcache: DigestCache | None = None) -> tuple[_Factor, _Step]:
    """:func:`_eliminate`, reusing an equal earlier elimination from ``memo`` when there is one.

    The factors are put in a canonical order (by scope pattern and digests)
    before the sum, so equal eliminations are keyed and computed alike. When
    the step does not fit the limit with what the memo holds, the memo is
    emptied and the step tried again: the memo never causes a refusal.
    """
    eliminate = _eliminate if factors else _eliminate_alone  # nothing to combine: the same results, cheaper
    if memo is None:
        return eliminate(v, factors, unary, limit, name, stats, rng, kept=held.total)
    dep = tuple(sorted({w for f in factors for w in f.scope} - {v}))
    pos = {w: i for i, w in enumerate(dep + (v,))}
    sigs = [(tuple(pos[w] for w in f.scope),) + f.signature() for f in factors]
    order = sorted(range(len(factors)), key=lambda j: sigs[j])
    factors = [factors[j] for j in order]
    key = ((dcache or digest)(unary),) + tuple(sigs[j] for j in order)
    inputs = (unary,) + tuple(a for f in factors for a in f.arrays())
    hit = memo.get(key, inputs)
    if hit is not None:
        return (_Factor(dep, hit.table_maps, hit.table, sig=hit.sig),
                _Step(v, dep, hit.step_maps, hit.arg))
    try:
        new, step = eliminate(v, factors, unary, limit, name, stats, rng, kept=held.total)
    except TableMemoryError:
        if held.total == 0 or not len(memo):
            raise
        memo.clear()
        new, step = eliminate(v, factors, unary, limit, name, stats, rng, kept=held.total)
    memo.put(key, MemoEntry(inputs=inputs, table=new.table, table_maps=new.maps, step_maps=step.maps,
                            arg=step.arg, sig=new.signature()))
    return new, step


def _initial_factors(p: Problem, rng: np.random.Generator) -> list[_Factor]:
    """One compressed factor per (merged) edge of ``p``.

    Edges that share one matrix (identical operator pairs) share the
    compressed table and maps too: the compression is done once.
    """
    out = []
    done: dict[tuple, tuple[np.ndarray, _Factor]] = {}
    for scope, table in merge_pairs(p).items():
        key = view_key(table)
        got = done.get(key)  # the same memory in the same layout: the same matrix
        if got is None:
            f = _Factor(scope, (np.arange(table.shape[0]), np.arange(table.shape[1])), np.ascontiguousarray(table))
            c = _compress(f, rng)
            c.signature()  # digested once, shared by every copy below
            got = (table, c)
            done[key] = got  # holds ``table``: while it lives, no other memory has its address
        c = got[1]
        out.append(_Factor(scope, c.maps, c.table, sig=c.sig))
    return out


def _fold_fixed(p: Problem) -> Problem:
    """Fold every edge at a vertex with one configuration into the other end's vertex cost (exact).

    Such an edge's cost depends on the other end only (or is a constant,
    added to the lower end), so it needs no factor: the elimination graph
    loses those edges and |D| counts only real choices.
    """
    sizes = p.sizes
    if all(k > 1 for k in sizes) or not p.edges:
        return p
    unary = [c.copy() for c in p.vertex_cost]
    edges, costs = [], []
    for (s, d), m in zip(p.edges, p.edge_cost):
        if sizes[s] == 1:
            unary[d] += m[0, :]
        elif sizes[d] == 1:
            unary[s] += m[:, 0]
        else:
            edges.append((s, d))
            costs.append(m)
    return Problem.derived(names=p.names, configs=p.configs, vertex_cost=tuple(unary), edges=tuple(edges),
                           edge_cost=tuple(costs), dims=p.dims)


def solve_small(problem: Problem, memory_limit_bytes: int) -> tuple[int, ...]:
    """An optimal assignment by the DP with reductions and without bound pruning.

    The exact sub-solver that :func:`~shardplan.search.bounds.bound_prune`
    runs on its small restricted problems; raises :class:`TableMemoryError`
    above ``memory_limit_bytes``.
    """
    return solve_dp(problem, prune=True, bounds=False, memory_limit_bytes=memory_limit_bytes).assignment


def solve_dp(
    problem: Problem,
    ordering: str | Ordering = "min-table",
    memory_limit_bytes: int | None = None,
    prune: bool = True,
    progress: Callable[[int, int], None] | None = None,
    *,
    bounds: bool = True,
    memo: bool = True,
    cutoff: float | None = None,
) -> Solution:
    """Exact minimum of F by recurrence (4) (variable elimination).

    Parameters:
        problem: the problem to solve.
        ordering: a name in :data:`ORDERINGS` or a function problem -> vertex order;
            it is applied to the reduced problem.
        memory_limit_bytes: refuse (:class:`TableMemoryError`) before building a table
            that would need more; default a quarter of available RAM.
        prune: apply the exact reductions (collapse, dominance) first.
        progress: called as progress(done, total) after each elimination.
        bounds: first drop every configuration whose lower bound exceeds the
            cost of a feasible assignment (:mod:`shardplan.search.bounds`;
            exact: every optimal assignment survives).
        memo: compute each distinct elimination once (:mod:`shardplan.search.memo`;
            exact: a stored result is reused only when its inputs are equal
            element by element). Only vertices whose cost vector occurs more
            than once (identical operators) are memoised.
        cutoff: a value the caller needs the optimum only when it is below (an incumbent from outside). With
            ``bounds``, the bound pruning stops at the first round whose proven lower bound reaches it, and
            the answer is that bound, not the optimum: ``optimal`` False, ``bound`` the lower bound (at least
            the cutoff), ``stats["cut_off"]`` True, ``cost`` and ``assignment`` the pruning's best assignment
            (a real one, no better than the bound). When the optimum is below the cutoff no round's bound
            reaches it, so the answer is the one without a cutoff, bit for bit (docs/search.md, *An incumbent
            from outside*).

    Returns:
        A :class:`Solution` with ``optimal=True``, the assignment in original
        configuration indices, and stats (ordering, max_dependent_set,
        total_table_entries, largest_table, num_vertices, pruning, timings).
    """
    t0 = time.perf_counter()
    memo_enabled = memo
    limit = default_memory_limit() if memory_limit_bytes is None else int(memory_limit_bytes)
    oname, ofun = resolve_ordering(ordering)
    bstats: dict = {"enabled": False}
    # identical operators (equal costs and configurations) keep equal configuration sets, so that equal
    # layers stay equal for the memo (exact: each set only grows, see reduce.symmetric_reduction)
    orb = orbits(problem) if memo else None  # computed once: the pruning and both restrictions below use it
    symmetric = orb is not None and problem.num_vertices > len(set(orb))

    def sym(r: Reduction) -> Reduction:
        return symmetric_reduction(problem, r.keep, r.stats, orbit_ids=orb) if symmetric else r

    if bounds and problem.num_vertices > 0:
        base, bstats = bound_prune(problem, exact_solver=solve_small, symmetric=symmetric,
                                   orbit_ids=orb if symmetric else None,
                                   cutoff=np.inf if cutoff is None else float(cutoff))
        if bstats["cut_off"]:
            # no assignment is below the cutoff: the proven bound is the answer (the pruning's incumbent with it)
            got = tuple(int(x) for x in bstats["incumbent"])
            low = float(bstats["lower_bound"])
            stats = {"cut_off": True, "cutoff": float(cutoff),  # type: ignore[arg-type]
                     "bounds": {**{k: v for k, v in bstats.items() if k != "incumbent"}, "enabled": True},
                     "reduce_seconds": time.perf_counter() - t0}
            return Solution(cost=problem.evaluate(got), assignment=got, solve_seconds=time.perf_counter() - t0,
                            solver="dp", optimal=False, bound=low - RTOL * abs(low), stats=stats)
        bstats = {**{k: v for k, v in bstats.items() if k != "incumbent"}, "enabled": True}
        base = sym(base)
        if symmetric:
            bstats["configs_after_symmetric"] = int(sum(len(k) for k in base.keep))
        red: Reduction = sym(base.then(reduce_problem(base.problem) if prune else identity_reduction(base.problem)))
    else:
        red = sym(reduce_problem(problem) if prune else identity_reduction(problem))
    t1 = time.perf_counter()
    p = _fold_fixed(red.problem)
    n = p.num_vertices
    order = [int(v) for v in ofun(p)]
    if sorted(order) != list(range(n)):
        raise ShardplanError(f"ordering {oname!r} did not return a permutation of the {n} vertices")
    t2 = time.perf_counter()

    rng = np.random.default_rng(0)  # only for hashing slices; results do not depend on it
    live: dict[int, _Factor] = {}
    touching: list[set[int]] = [set() for _ in range(n)]
    for fid, f in enumerate(_initial_factors(p, rng)):
        live[fid] = f
        for w in f.scope:
            touching[w].add(fid)
    next_id = len(live)
    stats: dict = {"total_table_entries": 0.0, "largest_table": 0.0, "max_dependent_set": 0}
    steps: list[_Step] = []
    value = 0.0
    held = ArrayLedger()  # every array held: live factors, argmin tables kept for back-substitution, memo
    for f in live.values():
        held.add(f.arrays())
    memo = EliminationMemo(limit // 4, held) if memo_enabled else None
    dcache = DigestCache()
    repeated = _repeated_unaries(p, dcache) if memo is not None else [False] * n
    for i, v in enumerate(order):
        factors = [live[j] for j in sorted(touching[v])]
        new, step = _eliminate_memo(v, factors, p.vertex_cost[v], limit, p.names[v], stats, rng, held,
                                    memo if repeated[v] else None, dcache)
        for f in factors:
            held.remove(f.arrays())
        for j in sorted(touching[v]):
            for w in live[j].scope:
                touching[w].discard(j)
            del live[j]
        held.add(step.arrays())
        if new.scope:
            held.add(new.arrays())
            live[next_id] = new
            for w in new.scope:
                touching[w].add(next_id)
            next_id += 1
        else:
            value += float(new.table)
        steps.append(step)
        if progress is not None:
            progress(i + 1, n)
    if memo is not None:
        stats["memo"] = {"hits": memo.hits, "misses": memo.misses, "false_matches": memo.false_matches}
        memo.clear()
    kept_ledger = ArrayLedger()
    for st in steps:
        kept_ledger.add(st.arrays())
    kept_bytes = kept_ledger.total

    assign = np.zeros(n, dtype=np.int64)
    for st in reversed(steps):
        idx = tuple(int(m[assign[w]]) for m, w in zip(st.maps, st.dep))
        assign[st.v] = int(st.arg[idx])
    t3 = time.perf_counter()
    original = red.lift(assign)
    cost = problem.evaluate(original)
    stats.update(
        kept_bytes=kept_bytes,
        ordering=oname,
        num_vertices=n,
        dp_value=value,
        pruning={**red.stats, "enabled": bool(prune)},
        bounds=bstats,
        reduce_seconds=t1 - t0,
        order_seconds=t2 - t1,
        dp_seconds=t3 - t2,
    )
    sol = Solution(cost=cost, assignment=original, solve_seconds=time.perf_counter() - t0,
                   solver="dp", optimal=True, bound=cost, stats=stats)
    return certify(problem, sol, value)
