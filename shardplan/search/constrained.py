"""Exact minimum cost under a memory budget: Lagrangian relaxation closed by branch-and-bound.

The problem
-----------
A :class:`MemoryProblem` is a :class:`~shardplan.search.problem.Problem`
(vertices, configurations, edge matrices) whose vertices have *choices*:
choice ``j`` of vertex ``v`` uses configuration ``base[v][j]`` (which decides
the edge costs), costs ``cost[v][j]`` seconds on its own and keeps
``memory[v][j]`` bytes per device. Several choices may share a configuration
(the same layout with state sharding, recomputation, ...: they differ only
in their own time and memory). With ``a`` one choice per vertex::

    F(a) = sum_v cost[v][a_v] + sum_(u,v) M_uv[base(a_u), base(a_v)]     (seconds)
    M(a) = fixed + sum_v memory[v][a_v]                                   (bytes per device)

    minimise F(a)  subject to  M(a) <= B.

The memory model behind ``memory`` (what is live at the peak) belongs to
whoever builds the problem; :mod:`shardplan.cost.memory` states the one used
for DNN plans. Here only additivity matters.

The algorithm
-------------
*Lagrangian dual.* For λ >= 0, ``g(λ) = min_a F(a) + λ (M(a) - B)`` is a lower
bound on the constrained optimum (for a feasible ``a`` the added term is
<= 0). Its inner minimum is an ordinary unconstrained problem with vertex
costs ``min_{j: base j = k} cost[v][j] + λ memory[v][j]`` on the *same*
edges, solved exactly by :func:`~shardplan.search.dp.solve_dp`: the choices
never enlarge the DP's tables. g is concave and piecewise linear; it is
maximised by the hull (Dinkelbach-style) iteration: keep an infeasible point
``a+`` and a feasible one ``a-`` (at first the unconstrained optimum, and the
Lagrangian optimum of the first of the multipliers ``λ0 4^k`` that fits, the
infeasible ones before it replacing ``a+``; if none of 8 fits, the cheapest
least-memory assignment), set ``λ = (F(a-) - F(a+)) / (M(a+) - M(a-))`` (the
slope between them), solve; if the new point lies on the line through them,
both are Lagrangian optima at λ, so λ maximises g; otherwise it replaces
``a+`` or ``a-`` by feasibility. Each step is one DP solve, every λ tried
gives a bound ``g(λ)``, and every feasible point seen is a candidate plan.

*Branch-and-bound* closes the duality gap (with the closures below). A node restricts each vertex to a
subset of its choices; its bound is its own Lagrangian dual (valid for every
assignment of the subset). A node is closed when its unconstrained optimum
fits (then that is the node's exact optimum), when its least memory exceeds
B, or when its bound reaches the incumbent. Otherwise it branches on the
vertex where ``a+`` and ``a-`` differ most in memory, with ``m* = memory of
a+ there``: one child keeps the choices using less than ``m*``, the other the
rest. Both are non-empty and smaller, so the search is finite; nodes are
taken best bound first. The global lower bound is the least bound of the open
nodes (the incumbent when none is left): when the search stops at its work
or node limit (counted, so at the same place on any machine; a wall-clock
limit only when the caller asks for one), the answer carries that bound and
the gap; with no open node it is the proven optimum.

*Incumbents by mixing.* When a node's dual ends with an infeasible ``a+``
and a feasible ``a-`` (both Lagrangian optima at the final λ), the best
plan that takes each vertex's choice from one of the two is found exactly
(:func:`_mix`): the vertices where they differ fall into connected groups
that are independent of each other, so this is a small knapsack. On a chain
of identical blocks the duality gap is mostly integrality (``a+`` and ``a-``
differ in the same vertex of every block), and this plan lies within about
one block's step of the bound (GPT-3 175B: from 0.3 % to 0.003 %). When the
differing vertices are adjacent (one group spanning the model: GPT-3 175B at
cutoff 1, where the two points differ in 961 of 1,156 vertices), the same
restricted problem is solved by the frontier program below (at most the
points' few choices per vertex): there from 2 % above the bound to 0.03 %.

*Lattice budget.* Within a node, every assignment's memory is the least
memory plus an integer multiple of q, the greatest common divisor of the
allowed choices' memory steps (exact rationals); the bounds use the largest
such value within B instead of B (:func:`_lattice_budget`). After fixing
leaves only, say, one layer's recomputation as the memory step, this adds
lam times the slack the integrality forces, which is the gap left.

*Separable nodes* are solved, not branched (:func:`_separable`): when the
vertices whose allowed choices use more than one configuration form small
connected groups, F and M are sums over independent items (each group's
assignments, each other vertex's choices) and the node's optimum is an exact
multiple-choice knapsack over Pareto fronts. Reduced-cost fixing (below)
makes nodes separable as the incumbent approaches the bound.

*Frontier program.* A node whose allowed configurations are few (after
fixing) is solved exactly by :func:`_frontier_dp`: vertices in index order,
a state per configuration of the vertices added so far that still have
neighbours to come, and per state the Pareto front of (F, M); points whose
Lagrangian value exceeds the best of their state by more than the gap
between the cutoff and the node's Lagrangian minimum are dropped (no
completion can make them better than the cutoff within the budget). This
is the knapsack the dual relaxes, solved with the edges: on GPT-3 175B it
finds and proves the optimum once fixing has left a few configurations per
vertex, where branching on single vertices of 96 identical layers would
not finish (each branch leaves the other layers' bound unchanged).

Exactness rests on the DP being exact on each Lagrangian problem; costs and
memory are compared with a relative tolerance of ``rtol`` (1e-9) only to
decide ties.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from shardplan.errors import ShardplanError
from shardplan.search.bounds import uf_find
from shardplan.search.problem import Problem, Solution

__all__ = ["MemoryProblem", "solve_memory", "solve_memory_bruteforce", "infeasible_message", "enumerate_choices",
           "cheapest_within", "relaxed_bound", "problem_entries", "solve_work", "pruning_work", "forest_work", "WORK_LIMIT"]

# The search's work, counted instead of timed, so that where a budget stops it (and so the plan, step and bound
# it returns) is the same on an idle and a busy machine. A work unit is about a microsecond of one core of the
# 2-core development machine: each weight is CPU microseconds per item, fitted there to whole fit searches
# (GPT-3 175B on 64 and on 1,024 h100, Llama 3 405B on 16,384) and to random problems of 5-135 vertices;
# docs/memory.md, "Work, not seconds", has the measurements. Every charge is a weight times a size its loops
# run over, which the input fixes: a Lagrangian (DP) solve per entry of its problem's edge matrices (and
# configurations) and per vertex (the elimination and the rest), plus what its bound pruning swept and passed
# (the sizes it reports: TRW-S sweeps per entry and vertex, forest passes with messages per entry and vertex,
# plain ones as a forest pass); a reduced-cost fixing likewise (its screening pass, sweeps and final pass); a
# frontier program per vertex and per (point, choice) candidate its steps form; a plain forest pass of the
# solve-free bounds per entry and per vertex.
DP_WORK = 1.5e-3  # per edge-matrix entry (and configuration) of a Lagrangian problem, per exact solve
DP_VERTEX_WORK = 50.0  # per vertex, per exact solve
SWEEP_WORK = 3.5e-3  # per entry of a state's matrices (and configurations), per TRW-S sweep
SWEEP_VERTEX_WORK = 4.0  # per vertex, per TRW-S sweep
PASS_WORK = 3e-3  # per entry of a state's matrices (and configurations), per forest pass with messages
PASS_VERTEX_WORK = 40.0  # per vertex, per forest pass with messages
FRONTIER_WORK = 0.1  # per (point, choice) candidate of a frontier program step
FRONTIER_VERTEX_WORK = 100.0  # per vertex of the problem, per frontier program (its plan, classes and steps)
FOREST_WORK = 2e-5  # per edge-matrix entry (and configuration) of a plain forest pass (relaxed_bound)
FOREST_VERTEX_WORK = 60.0  # per vertex, per forest pass
WORK_LIMIT = 60e6  # the default budget per micro-batch count: about what the former 60 s limit did when idle


def problem_entries(p: Problem) -> int:
    """The entries of ``p``'s edge matrices plus its configurations: the size a DP solve or forest pass
    sweeps, the measure (with its vertices) its work is charged by (deterministic)."""
    return int(sum(m.size for m in p.edge_cost) + sum(len(c) for c in p.configs))


def solve_work(p: Problem) -> float:
    """The work units one exact (Lagrangian) solve of ``p`` is charged before its bound pruning (whose sizes
    the solve reports: :func:`pruning_work`)."""
    return DP_WORK * problem_entries(p) + DP_VERTEX_WORK * p.num_vertices


def pruning_work(sizes: dict) -> float:
    """The work units of what a bound pruning (or a fixing) swept and passed: ``sizes`` as
    :func:`~shardplan.search.bounds.bound_prune` reports them (``stats["sizes"]``); 0 for none."""
    return (SWEEP_WORK * sizes.get("swept_entries", 0) + SWEEP_VERTEX_WORK * sizes.get("swept_vertices", 0)
            + PASS_WORK * sizes.get("passed_entries", 0) + PASS_VERTEX_WORK * sizes.get("passed_vertices", 0)
            + FOREST_WORK * sizes.get("plain_entries", 0) + FOREST_VERTEX_WORK * sizes.get("plain_vertices", 0))


def forest_work(p: Problem) -> float:
    """The work units one forest pass of ``p`` (:func:`relaxed_bound`) is charged."""
    return FOREST_WORK * problem_entries(p) + FOREST_VERTEX_WORK * p.num_vertices


@dataclass(frozen=True, eq=False)
class MemoryProblem:
    """A problem with per-choice cost and memory and a memory budget (see the module docstring).

    Attributes:
        problem: configurations and edge costs (its vertex costs are not used).
        base: per vertex, the configuration index of each choice, int array (J_v,).
        cost: per vertex, each choice's own seconds, float array (J_v,), finite, >= 0.
        memory: per vertex, each choice's bytes per device, float array (J_v,), finite, >= 0.
        budget: B, bytes per device.
        fixed: bytes per device every plan needs besides the per-vertex terms.
        labels: optional per vertex, a short description of each choice (for reports).
    """

    problem: Problem
    base: tuple[np.ndarray, ...]
    cost: tuple[np.ndarray, ...]
    memory: tuple[np.ndarray, ...]
    budget: float
    fixed: float = 0.0
    labels: tuple[tuple[str, ...], ...] | None = None

    def __post_init__(self) -> None:
        p = self.problem
        n = p.num_vertices
        if not (len(self.base) == len(self.cost) == len(self.memory) == n):
            raise ShardplanError("memory problem: base, cost and memory need one entry per vertex")
        if not np.isfinite(self.budget) or self.budget < 0:
            raise ShardplanError(f"memory budget must be a finite number of bytes >= 0, got {self.budget!r}")
        base, cost, mem = [], [], []
        sizes = p.sizes
        for v in range(n):
            b = np.asarray(self.base[v], dtype=np.int64)
            c = np.asarray(self.cost[v], dtype=np.float64)
            m = np.asarray(self.memory[v], dtype=np.float64)
            name = p.names[v]
            if b.ndim != 1 or len(b) == 0 or c.shape != b.shape or m.shape != b.shape:
                raise ShardplanError(f"vertex {name!r}: base, cost and memory must be equal-length non-empty vectors")
            if b.min() < 0 or b.max() >= sizes[v]:
                raise ShardplanError(f"vertex {name!r}: a choice refers to a configuration outside 0..{sizes[v] - 1}")
            if not (np.all(np.isfinite(c)) and np.all(np.isfinite(m))) or c.min() < 0 or m.min() < 0:
                raise ShardplanError(f"vertex {name!r}: choice costs and memory must be finite and >= 0")
            base.append(b)
            cost.append(c)
            mem.append(m)
        object.__setattr__(self, "base", tuple(base))
        object.__setattr__(self, "cost", tuple(cost))
        object.__setattr__(self, "memory", tuple(mem))
        object.__setattr__(self, "budget", float(self.budget))
        object.__setattr__(self, "fixed", float(self.fixed))

    @classmethod
    def from_problem(cls, problem: Problem, memory: Sequence[Sequence[float]], budget: float,
                     fixed: float = 0.0) -> "MemoryProblem":
        """One choice per configuration, costing the problem's vertex cost and ``memory[v][k]`` bytes."""
        return cls(problem, tuple(np.arange(k) for k in problem.sizes), problem.vertex_cost,
                   tuple(np.asarray(m, dtype=np.float64) for m in memory), budget, fixed)

    @property
    def num_choices(self) -> tuple[int, ...]:
        return tuple(len(b) for b in self.base)

    def evaluate(self, choices: Sequence[int]) -> tuple[float, float]:
        """(F, M) of a choice assignment."""
        a = [int(x) for x in choices]
        if len(a) != self.problem.num_vertices:
            raise ShardplanError(f"assignment has {len(a)} entries, problem has {self.problem.num_vertices} vertices")
        for v, j in enumerate(a):
            if not 0 <= j < len(self.base[v]):
                raise ShardplanError(f"choice of {self.problem.names[v]!r} is {j}, outside 0..{len(self.base[v]) - 1}")
        configs = [int(self.base[v][j]) for v, j in enumerate(a)]
        f = float(sum(float(m[configs[s], configs[d]]) for (s, d), m in zip(self.problem.edges, self.problem.edge_cost)))
        f += float(sum(float(self.cost[v][j]) for v, j in enumerate(a)))
        mem = self.fixed + float(sum(float(self.memory[v][j]) for v, j in enumerate(a)))
        return f, mem

    def least_memory(self, allowed: Sequence[np.ndarray] | None = None) -> float:
        """min_a M(a) (over the allowed choices): the vertices' least memory add up."""
        if allowed is None:
            return self.fixed + float(sum(float(m.min()) for m in self.memory))
        return self.fixed + float(sum(float(m[ok].min()) for m, ok in zip(self.memory, allowed)))

    def expanded(self) -> Problem:
        """The plain problem over choices (edge matrices repeated per choice): for the ILP and brute force."""
        p = self.problem
        return Problem(names=p.names,
                       configs=tuple(tuple((int(b), j) for j, b in enumerate(bs)) for bs in self.base),
                       vertex_cost=self.cost, edges=p.edges,
                       edge_cost=tuple(m[np.ix_(self.base[s], self.base[d])] for (s, d), m in zip(p.edges, p.edge_cost)))


def infeasible_message(least: float, budget: float) -> str:
    from shardplan.units import fmt_bytes

    return (f"no plan fits in {fmt_bytes(budget)} per device: the least memory any plan needs is "
            f"{fmt_bytes(least)} ({least:.0f} bytes)")


@dataclass
class _Point:
    f: float
    m: float
    choices: tuple[int, ...]
    # the work units the Lagrangian solve that gave it was charged (0 for a point not from such a solve): a point
    # taken from the store is charged again, so the budget counts the search's solves, stored or not, and stops
    # it where the search without the store stops
    work: float = field(default=0.0, compare=False)


@dataclass
class _Ctx:
    mp: MemoryProblem
    dp: Callable[[Problem], Solution]
    rtol: float
    solves: int = 0
    best: _Point | None = None
    dp_seconds: float = 0.0
    mix: bool = True
    mix_states: int = 20_000  # the front program's limits when mixing (see _mix); 0: knapsack of groups only
    mix_points: int = 1_000_000
    # the frontier program gives up past these (done False: an incumbent not offered or a node branched instead,
    # never a wrong answer): the search's work budget (``work`` past ``work_limit``, in work units:
    # :data:`DP_WORK`, :data:`FRONTIER_WORK` and the like), a wall-clock deadline only when the caller set a
    # time limit, and its back-pointers' bytes (16 per point kept per vertex: on 2,020 vertices at up to
    # mix_points each they would reach 32 GB)
    work_limit: float = float("inf")
    deadline: float = float("inf")
    frontier_bytes: int = 1 << 29
    work: float = 0.0  # work units spent: Lagrangian solves, fixings and frontier candidates (deterministic)
    # the same, per kind: "dp" (Lagrangian solves), "dp_stored" (points taken from the store, charged what their
    # solve was), "fix", "frontier"
    parts: dict = field(default_factory=lambda: {"dp": 0.0, "dp_stored": 0.0, "fix": 0.0, "frontier": 0.0})
    frontier_candidates: int = 0
    trail: list = field(default_factory=list)  # the points of the current node's dual
    # (lam, allowed choices packed as bits) -> the point its Lagrangian solve gave (solve_memory's ``solved``:
    # the full search of a micro-batch count repeats the dual of its root-only search); the DP is
    # deterministic, so a stored point is the one the solve would give
    solved: dict = field(default_factory=dict)
    reused: int = 0
    # the exact solver with a cutoff (solve_dp's ``cutoff``): it may answer a proven bound at least the cutoff
    # instead of the optimum; None: every solve is exact (a solver given by the caller)
    cut_dp: Callable[[Problem, float], Solution] | None = None
    cut_solves: int = 0  # Lagrangian solves answered by their bound alone

    def charge(self, kind: str, units: float) -> None:
        self.work += units
        self.parts[kind] += units

    def offer(self, pt: _Point) -> None:
        if pt.m <= self.mp.budget and (self.best is None or pt.f < self.best.f):
            self.best = pt


def _lagrangian_problem(mp: MemoryProblem, lam: float, allowed: Sequence[np.ndarray]
                        ) -> tuple[Problem, list[np.ndarray], list[np.ndarray]]:
    """The unconstrained problem of F + lam * M over the allowed choices, on their configurations.

    Returns (problem, keeps, picks): ``keeps[v]`` the configuration indices
    kept (the problem's configuration i is ``keeps[v][i]``) and ``picks[v][i]``
    the choice of least ``cost + lam * memory`` (ties: least memory) among
    the allowed ones using it.
    """
    p = mp.problem
    keeps, picks, unary = [], [], []
    full = True
    sizes = p.sizes
    # identical operators share their base, cost and memory arrays (mp holds them, so ids stay unique): with
    # equal allowed choices their rows are the same computation, done once and shared
    done: dict[tuple, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    for v in range(p.num_vertices):
        key = (id(mp.base[v]), id(mp.cost[v]), id(mp.memory[v]), allowed[v].tobytes())
        row = done.get(key)
        if row is None:
            idx = np.flatnonzero(allowed[v])
            val = mp.cost[v][idx] + lam * mp.memory[v][idx] if lam > 0 else mp.cost[v][idx]
            order = np.lexsort((mp.memory[v][idx], val, mp.base[v][idx]))
            b = mp.base[v][idx][order]
            first = np.ones(len(b), dtype=bool)
            first[1:] = b[1:] != b[:-1]
            row = done[key] = (b[first], idx[order][first], val[order][first])
        keeps.append(row[0])
        picks.append(row[1])
        unary.append(row[2])
        full &= len(keeps[-1]) == sizes[v]
    if full:
        edge_cost, configs = p.edge_cost, p.configs
    else:
        # equal restrictions of a shared matrix (identical layers) are made once and shared, which keeps
        # them recognisably equal for the DP (and the memory to one copy); p holds the matrices, so ids stay unique
        sub: dict[tuple, np.ndarray] = {}
        cfg: dict[tuple, tuple] = {}
        kb = [k.tobytes() for k in keeps]
        for (s, d), m in zip(p.edges, p.edge_cost):
            if (id(m), kb[s], kb[d]) not in sub:
                sub[(id(m), kb[s], kb[d])] = m[np.ix_(keeps[s], keeps[d])]
        for v, ks in enumerate(keeps):
            if (id(p.configs[v]), kb[v]) not in cfg:
                cfg[(id(p.configs[v]), kb[v])] = tuple(p.configs[v][int(k)] for k in ks)
        edge_cost = tuple(sub[(id(m), kb[s], kb[d])] for (s, d), m in zip(p.edges, p.edge_cost))
        configs = tuple(cfg[(id(p.configs[v]), kb[v])] for v in range(p.num_vertices))
    return _derived(p, configs, tuple(unary), edge_cost), keeps, picks


def _derived(p: Problem, configs: tuple, vertex_cost: tuple[np.ndarray, ...], edge_cost: tuple[np.ndarray, ...]
             ) -> Problem:
    """``p`` with new vertex costs and (sub-)configurations, without re-validating its edge matrices.

    Only for values built here: vertex costs are cost + lam * memory with
    all three >= 0 and finite, edge matrices are slices of ``p``'s validated
    ones; re-checking every matrix on every solve costs as much as a DP solve
    on large models.
    """
    out = object.__new__(Problem)
    for name, val in (("names", p.names), ("configs", configs), ("vertex_cost", vertex_cost), ("edges", p.edges),
                      ("edge_cost", edge_cost), ("dims", p.dims), ("index", p.index)):
        object.__setattr__(out, name, val)
    return out


def _lagrangian(ctx: _Ctx, lam: float, allowed: Sequence[np.ndarray]) -> _Point:
    """Exact argmin over the allowed choices of F + lam * M (ties: least memory)."""
    got = _lagrangian_or_bound(ctx, lam, allowed, np.inf)
    assert isinstance(got, _Point)
    return got


def _lagrangian_or_bound(ctx: _Ctx, lam: float, allowed: Sequence[np.ndarray], cutoff: float) -> _Point | float:
    """:func:`_lagrangian`, or, when its problem's optimum (F + lam (M - fixed) over the allowed choices) is proven
    at least ``cutoff`` by the exact solver's own bound before it solves (``ctx.cut_dp``), that proven bound (a
    float): the caller needs the point only below the cutoff. A point solved before is taken as it is; a bound is
    not stored (a later call with another cutoff may need the point)."""
    mp = ctx.mp
    key = (float(lam), np.packbits(np.concatenate(allowed)).tobytes())  # lengths are fixed by mp
    pt = ctx.solved.get(key)
    if pt is not None:
        ctx.reused += 1
        ctx.charge("dp_stored", pt.work)
    else:
        sub, keeps, picks = _lagrangian_problem(mp, lam, allowed)
        t0 = time.perf_counter()
        sol = ctx.cut_dp(sub, cutoff) if ctx.cut_dp is not None and np.isfinite(cutoff) else ctx.dp(sub)
        ctx.dp_seconds += time.perf_counter() - t0
        # what the solve's bound pruning swept is a size of its (deterministic) run, charged with the solve's own
        charge = solve_work(sub) + pruning_work((sol.stats.get("bounds") or {}).get("sizes", {}))
        ctx.charge("dp", charge)
        ctx.solves += 1
        if sol.stats.get("cut_off"):
            ctx.cut_solves += 1
            return float(sol.bound)  # type: ignore[arg-type]
        choices = tuple(int(pk[a]) for pk, a in zip(picks, sol.assignment))
        f, m = mp.evaluate(choices)
        pt = ctx.solved[key] = _Point(f, m, choices, charge)
    ctx.offer(pt)
    ctx.trail.append(pt)
    return pt


@dataclass
class _Node:
    allowed: list[np.ndarray]
    bound: float  # the parent's bound until evaluated
    depth: int = 0


@dataclass
class _Eval:
    bound: float
    closed: bool
    plus: _Point | None = None
    minus: _Point | None = None
    lam: float = 0.0
    iterations: int = 0
    budget: float = np.inf  # the lattice budget the bound used (see _lattice_budget)


def _lattice_budget(mp: MemoryProblem, allowed: Sequence[np.ndarray]) -> float:
    """The largest memory any allowed assignment can have within the budget, on the lattice its values lie on.

    With m0 = fixed + sum_v min_j m_v(j) (the least memory) and q the greatest
    common divisor of every difference m_v(j) - min_j m_v(j) (exact rational
    arithmetic on the float values), every allowed assignment's memory is
    m0 + k q for an integer k >= 0, so M <= B holds exactly when
    M <= B' = m0 + q floor((B - m0) / q). The dual bound with B' in place of B
    is valid for the node and larger by lam (B - B'): where the remaining
    choices move memory in steps of one layer's activations, this is what
    closes the knapsack gap of identical layers. Returns B (no tightening)
    when q is 0 or negligible, and a float rounded up (never below the exact B').
    """
    from fractions import Fraction
    from math import floor, gcd

    budget = mp.budget
    least = Fraction(mp.fixed)
    num, den = 0, 1  # q = num / den
    # a vertex whose (row, allowed choices) was met before adds its least value again but no new step: the
    # gcd already divides its differences (gcd is idempotent), and q, so the femto test, is unchanged
    seen: dict[tuple[int, bytes], list] = {}  # key -> [least value, times met]
    for m, ok in zip(mp.memory, allowed):
        key = (id(m), np.packbits(ok).tobytes())
        if key in seen:
            seen[key][1] += 1
            continue
        vals = np.unique(m[ok])
        lo = Fraction(float(vals[0]))
        seen[key] = [lo, 1]
        for d in (Fraction(float(x)) - lo for x in vals[1:]):
            # gcd(num/den, a/b) = gcd(num b, a den) / (den b)
            a, b = d.numerator, d.denominator
            num, den = gcd(num * b, a * den), den * b
            g = gcd(num, den)
            num, den = num // g, den // g
        if num and Fraction(num, den) < Fraction(budget) / 10**15:  # steps below a femto-budget: no gain
            return budget
    least += sum((lo * times for lo, times in seen.values()), Fraction(0))  # exact: the order does not matter
    if num == 0:
        return budget
    q = Fraction(num, den)
    rest = Fraction(budget) - least
    if rest < 0:
        return budget
    tight = least + q * floor(rest / q)
    out = float(tight)
    if Fraction(out) < tight:
        out = float(np.nextafter(out, np.inf))
    return min(out, budget)


def _dual(ctx: _Ctx, allowed: Sequence[np.ndarray], cutoff: float, max_iters: int, probes: int = 8) -> _Eval:
    """Lagrangian dual of a node by the hull iteration (see the module docstring)."""
    mp = ctx.mp
    B = mp.budget
    if not all(ok.any() for ok in allowed) or mp.least_memory(allowed) > B:
        return _Eval(np.inf, True)
    tight = _lattice_budget(mp, allowed)  # bounds use it: every allowed M <= B is <= tight
    ctx.trail = []
    # the unconstrained optimum's own problem is F: a bound of it at least the cutoff closes the node (every
    # allowed assignment, feasible or not, costs that much), without the rest of its solve
    got = _lagrangian_or_bound(ctx, 0.0, allowed, cutoff)
    if not isinstance(got, _Point):
        return _Eval(got, True)
    plus = got
    if plus.m <= B:
        return _Eval(plus.f, True, None, plus)
    bound = plus.f
    if bound >= cutoff:
        return _Eval(bound, True)
    # A feasible bracket: the Lagrangian optimum at growing multipliers (each infeasible one is a closer
    # infeasible bracket and a bound), else the cheapest least-memory assignment. The least-memory problem
    # itself is avoided when possible: its many ties (every layout of an FSDP operator holds 1/p of the
    # state) make it the hardest DP of all.
    minus = None
    lam = plus.f / plus.m / 16 if plus.f > 0 else 1.0 / plus.m
    for _ in range(probes):
        # a probe's value bounds the node by value + lam (fixed - tight): one at least the cutoff closes it
        got = _lagrangian_or_bound(ctx, lam, allowed, cutoff - lam * (mp.fixed - tight))
        if not isinstance(got, _Point):
            return _Eval(max(bound, got + lam * (mp.fixed - tight)), True)
        pt = got
        bound = max(bound, pt.f + lam * (pt.m - tight))
        if pt.m <= B:
            minus = pt
            break
        plus = pt
        if bound >= cutoff:
            return _Eval(bound, True)
        lam *= 4
    if minus is None:
        least = [ok & (m <= m[ok].min()) for m, ok in zip(mp.memory, allowed)]
        minus = _lagrangian(ctx, 0.0, least)
    lam, it = 0.0, 0
    while it < max_iters:
        it += 1
        lam = (minus.f - plus.f) / (plus.m - minus.m)
        if lam <= 0:  # minus is as cheap as the unconstrained optimum (a tie): it is optimal
            bound = max(bound, minus.f)
            break
        pt = _lagrangian(ctx, lam, allowed)
        value = pt.f + lam * pt.m
        bound = max(bound, value - lam * tight)
        line = plus.f + lam * plus.m
        if bound >= cutoff or value >= line - ctx.rtol * max(abs(line), 1e-300):
            break
        if pt.m > B:
            plus = pt
        else:
            minus = pt
    if ctx.mix and plus.m > B:
        _mix(ctx, allowed, ctx.trail, plus, minus, max(lam, 0.0))
    bound = min(bound, minus.f) if minus.m <= B else bound
    return _Eval(bound, minus.m <= B and bound >= minus.f, plus, minus, lam, it, tight)


def relaxed_bound(mp: MemoryProblem, lam: float, allowed: Sequence[np.ndarray] | None = None,
                  lattice: float | None = None) -> float:
    """A lower bound of ``min F subject to M <= B`` (over the allowed choices) without an exact solve.

    For every feasible ``a`` and ``lam >= 0``, ``F(a) >= F(a) + lam (M(a) - B') >= L* + lam (fixed - B')``,
    where ``L*`` is the least ``F + lam sum_v memory_v`` (the Lagrangian problem of
    :func:`_lagrangian_problem`) and ``B'`` the lattice budget (:func:`_lattice_budget`, every allowed
    ``M <= B`` is ``<= B'``). ``L*`` is bounded below by the plain forest bound of that problem
    (:mod:`shardplan.search.bounds`: one pass, no messages), whose computed value is within a few ulps per
    vertex of the true one; the result is lowered by ``1e-9`` relative against that rounding. Infinite when
    no allowed assignment fits. The cost is one forest pass instead of a DP solve (GPT-3 175B on 1,024
    h100: 0.3 s against 1 s per Lagrangian solve), which is what lets :func:`shardplan.fit.solve_fit` close a
    micro-batch count whose bound reaches the best plan already known without solving its root.
    ``lattice``: ``_lattice_budget(mp, allowed)`` when the caller has it (it does not depend on ``lam``).
    """
    from shardplan.search.bounds import BoundState, _forest_pass

    allowed = [np.ones(k, dtype=bool) for k in mp.num_choices] if allowed is None else list(allowed)
    lam = float(lam)
    if not lam >= 0:
        raise ShardplanError(f"relaxed_bound: the multiplier must be >= 0, got {lam!r}")
    if not all(ok.any() for ok in allowed) or mp.least_memory(allowed) > mp.budget:
        return float("inf")
    tight = mp.budget if lam == 0 else _lattice_budget(mp, allowed) if lattice is None else min(lattice, mp.budget)
    sub, _, _ = _lagrangian_problem(mp, lam, allowed)
    low = _forest_pass(BoundState.from_problem(sub), value_only=True)  # the relaxed minimum alone
    value = float(low) + lam * (mp.fixed - tight)
    return value - 1e-9 * abs(value)


def _fix(ctx: _Ctx, allowed: Sequence[np.ndarray], lam: float, cutoff: float, iters: int,
         budget: float | None = None, screen: bool = True) -> list[np.ndarray]:
    """Reduced-cost fixing: drop the allowed choices that cannot lead below ``cutoff``.

    For a feasible x using choice j of v (configuration k):
    ``F(x) >= L(x) - lam B >= minmarg_L(v, k) - u_v[k] + (cost_j + lam memory_j) - lam B``,
    where u_v[k] is the least Lagrangian vertex cost of k and minmarg_L the
    min-marginal of the Lagrangian problem, bounded below by the forest bound
    after TRW-S (:mod:`shardplan.search.bounds`). Choices whose bound reaches
    the cutoff are dropped (exact: no assignment below the cutoff uses them).
    ``budget`` (default B) may be the node's lattice budget (:func:`_lattice_budget`),
    which every feasible x of the node also respects.

    ``screen`` (default): first the plain forest bound (no messages, one pass)
    drops every configuration k with ``minmarg(v, k) - lam B >= cutoff`` (each of
    its choices then has a bound at least that), keeping the union over each
    class of identical vertices (more is kept: still exact); the TRW-S sweeps
    and the final forest bound then run on the configurations left, as
    :func:`~shardplan.search.bounds.bound_prune` does between its rounds. A
    bound of the restricted problem holds for every assignment of the kept
    configurations, and every assignment below the cutoff keeps only kept
    configurations, so each drop stays exact; the sweeps cost the square of the
    configurations left per edge instead of all of them.
    """
    from shardplan.search.bounds import BoundState, _forest_pass, state_entries, trws
    from shardplan.search.reduce import orbits, sorted_union

    mp = ctx.mp
    budget = mp.budget if budget is None else min(budget, mp.budget)
    sub, keeps, _ = _lagrangian_problem(mp, lam, allowed)
    unary = [c.copy() for c in sub.vertex_cost]
    st = BoundState.from_problem(sub)
    kept = [np.arange(len(k)) for k in keeps]  # positions of sub's configurations left in st
    if screen and iters and st.pairs and cutoff < np.inf:  # (a cutoff of inf or nan drops nothing)
        ctx.charge("fix", pruning_work({"plain_entries": state_entries(st), "plain_vertices": st.n}))
        lbs0, _, _ = _forest_pass(st)
        pos = [np.flatnonzero(x - lam * budget < cutoff) for x in lbs0]
        if any(len(x) == 0 for x in pos):  # a vertex with nothing below the cutoff: the node has no such plan
            return [np.zeros(len(ok), dtype=bool) for ok in allowed]
        orb = orbits(sub)
        union: dict[int, np.ndarray] = {}
        for v, x in enumerate(pos):
            union[orb[v]] = sorted_union(union[orb[v]], x) if orb[v] in union else x
        pos = [union[orb[v]] for v in range(st.n)]
        if sum(len(x) for x in pos) < sum(len(x) for x in kept):
            st.restrict(pos, orb)
            kept = pos
    swept = iters if st.pairs else 0
    ctx.charge("fix", pruning_work({"swept_entries": swept * state_entries(st), "swept_vertices": swept * st.n,
                                    "passed_entries": state_entries(st), "passed_vertices": st.n}))
    if swept:
        trws(st, list(range(st.n)), iters)
    lbs, _, _ = _forest_pass(st, True)
    out = []
    sizes = mp.problem.sizes
    for v in range(sub.num_vertices):
        full = np.full(len(keeps[v]), np.inf)  # configurations screened out: no choice of theirs survives
        full[kept[v]] = lbs[v] - unary[v][kept[v]]
        pos = np.full(sizes[v], -1, dtype=np.int64)
        pos[keeps[v]] = np.arange(len(keeps[v]))
        idx = np.flatnonzero(allowed[v])
        i = pos[mp.base[v][idx]]
        lb = full[i] + mp.cost[v][idx] + lam * mp.memory[v][idx] - lam * budget
        new = np.array(allowed[v], dtype=bool)
        new[idx[lb >= cutoff]] = False
        out.append(new)
    return out


def _front_merge(front_m: np.ndarray, front_c: np.ndarray, opt_m: np.ndarray, opt_c: np.ndarray,
                 cap_m: float, cap_c: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Pareto front of {front point + option}: memory <= cap_m, cost < cap_c; with back-pointers.

    Returns (memory, cost, index into the front, index into the options), sorted
    by memory ascending with cost strictly decreasing (each kept point is the
    cheapest at its memory and cheaper than every point using less).
    """
    m = (front_m[:, None] + opt_m[None, :]).ravel()
    c = (front_c[:, None] + opt_c[None, :]).ravel()
    ok = np.flatnonzero((m <= cap_m) & (c < cap_c))
    order = ok[np.lexsort((c[ok], m[ok]))]
    cs = c[order]
    run = np.minimum.accumulate(cs)
    keep = np.ones(len(order), dtype=bool)
    keep[1:] = cs[1:] < run[:-1]
    order = order[keep]
    return m[order], c[order], order // len(opt_m), order % len(opt_m)


@dataclass
class _Item:
    """A part of a separable node: its vertices and, per option, their choices, cost and memory."""

    vertices: tuple[int, ...]
    choices: np.ndarray  # (options, len(vertices)) choice indices
    cost: np.ndarray
    memory: np.ndarray


def _component_item(mp: MemoryProblem, comp: list[int], allowed: Sequence[np.ndarray], config: np.ndarray,
                    incident: dict[int, list[int]], max_options: int) -> _Item | None:
    """Every assignment of ``comp``'s allowed choices, with its cost (own and incident edges) and memory.

    ``config[u]`` is the configuration of every vertex outside the multi-configuration set
    (the only one its allowed choices use), so each edge leaving ``comp`` has a known far end.
    Returns None when the assignments number more than ``max_options``.
    """
    p = mp.problem
    idx = [np.flatnonzero(allowed[v]) for v in comp]
    total = 1
    for i in idx:
        total *= len(i)
        if total > max_options:
            return None
    digits = np.unravel_index(np.arange(total), [len(i) for i in idx])
    pos = {v: k for k, v in enumerate(comp)}
    ch = [i[d] for i, d in zip(idx, digits)]
    cost = np.zeros(total)
    mem = np.zeros(total)
    for k, v in enumerate(comp):
        cost += mp.cost[v][ch[k]]
        mem += mp.memory[v][ch[k]]
    seen: set[int] = set()
    for v in comp:
        for e in incident.get(v, ()):
            if e in seen:
                continue
            seen.add(e)
            s, d = p.edges[e]
            mat = p.edge_cost[e]
            rs = mp.base[s][ch[pos[s]]] if s in pos else np.full(total, config[s])
            cd = mp.base[d][ch[pos[d]]] if d in pos else np.full(total, config[d])
            cost += mat[rs, cd]
    return _Item(tuple(comp), np.stack(ch, axis=1), cost, mem)


def _separable(ctx: "_Ctx", allowed: Sequence[np.ndarray], cutoff: float, max_options: int = 4096,
               max_front: int = 200_000) -> tuple[bool, float]:
    """Exact optimum over ``allowed`` when it decomposes into small independent parts (else gives up).

    Let V* be the vertices whose allowed choices use more than one
    configuration. Every edge with both ends outside V* costs a constant; the
    connected components of V* (edges with both ends in V*) interact with the
    rest only through edges whose far end has one configuration. So F and M
    are sums over *items*: each component (all its allowed assignments
    enumerated, with the edges incident to it) and each other vertex with
    several allowed choices (they differ in own cost and memory only), plus a
    constant. The minimum of a sum of items under a memory cap is an exact
    multiple-choice knapsack, solved by merging Pareto fronts (memory up,
    cost strictly down) item by item, dropping points over the budget (with
    the least memory of the items still to come) or not below ``cutoff``
    (with their least cost). The optimum, if below the cutoff, is offered to
    the incumbent.

    Returns (done, value): done is False when a component has more than
    ``max_options`` assignments or a front more than ``max_front`` points (nothing is proven);
    otherwise value is the optimum over ``allowed`` (inf when none is below the cutoff or fits).
    """
    mp = ctx.mp
    p = mp.problem
    n = p.num_vertices
    if not all(ok.any() for ok in allowed):
        return True, np.inf
    multi = np.zeros(n, dtype=bool)
    config = np.full(n, -1, dtype=np.int64)
    for v in range(n):
        b = mp.base[v][allowed[v]]
        if (b != b[0]).any():
            multi[v] = True
        else:
            config[v] = b[0]
    incident: dict[int, list[int]] = {}
    parent = list(range(n))

    const_c = 0.0
    for e, (s, d) in enumerate(p.edges):
        if multi[s] or multi[d]:
            for v in (s, d):
                if multi[v]:
                    incident.setdefault(v, []).append(e)
            if multi[s] and multi[d]:
                parent[uf_find(parent, s)] = uf_find(parent, d)
        else:
            const_c += float(p.edge_cost[e][config[s], config[d]])
    comps: dict[int, list[int]] = {}
    items: list[_Item] = []
    const_m = mp.fixed
    chosen = np.zeros(n, dtype=np.int64)
    for v in range(n):
        if multi[v]:
            comps.setdefault(uf_find(parent, v), []).append(v)
            continue
        j = np.flatnonzero(allowed[v])
        if len(j) == 1:
            chosen[v] = j[0]
            const_c += float(mp.cost[v][j[0]])
            const_m += float(mp.memory[v][j[0]])
        else:
            items.append(_Item((v,), j[:, None], mp.cost[v][j], mp.memory[v][j]))
    for comp in comps.values():
        item = _component_item(mp, comp, allowed, config, incident, max_options)
        if item is None:
            return False, np.nan
        items.append(item)
    # each item's own Pareto front (memory up, cost strictly down) before merging
    for k, it in enumerate(items):
        m, c, _, j = _front_merge(np.zeros(1), np.zeros(1), it.memory, it.cost, np.inf, np.inf)
        items[k] = _Item(it.vertices, it.choices[j], c, m)
    least_m = np.array([it.memory.min() for it in items]) if items else np.zeros(0)
    least_c = np.array([it.cost.min() for it in items]) if items else np.zeros(0)
    rest_m = np.concatenate([np.cumsum(least_m[::-1])[::-1], [0.0]])
    rest_c = np.concatenate([np.cumsum(least_c[::-1])[::-1], [0.0]])
    front_m, front_c = np.array([const_m]), np.array([const_c])
    back: list[tuple[np.ndarray, np.ndarray]] = []
    for k, it in enumerate(items):
        front_m, front_c, fi, oi = _front_merge(front_m, front_c, it.memory, it.cost,
                                                mp.budget - rest_m[k + 1], cutoff - rest_c[k + 1])
        if len(front_m) == 0:
            return True, np.inf
        if len(front_m) > max_front:
            return False, np.nan
        back.append((fi, oi))
    best = int(np.argmin(front_c))
    value = float(front_c[best])
    at = best
    for k in range(len(items) - 1, -1, -1):
        fi, oi = back[k]
        chosen[list(items[k].vertices)] = items[k].choices[oi[at]]
        at = int(fi[at])
    f, m = mp.evaluate(chosen)
    if m > mp.budget:  # the front's sums and the evaluation round differently: prove nothing
        return False, np.nan
    ctx.offer(_Point(f, m, tuple(int(x) for x in chosen)))
    return True, f


def _mix(ctx: _Ctx, allowed: Sequence[np.ndarray], points: Sequence[_Point], plus: _Point, minus: _Point,
         lam: float = 0.0) -> None:
    """Offer the best plan made of the dual's points' choices (each vertex the choice of one of them).

    First over every point the node's dual solved (each multiplier's optimum
    uses other memory-saving steps: their union can fill the budget more
    finely), and if that set does not split into small parts, over the two
    bracketing points alone.

    Where the points differ, connected groups of differing vertices are
    independent items (two options each when they differ in configuration
    only at separated places, e.g. one per identical layer), and the best
    combination under the budget is the exact knapsack of :func:`_separable`
    over that restricted set: a feasible plan near the dual bound when the
    gap is the integrality of many small identical steps.

    When the differing vertices connect into large groups (the bracketing
    points differ in adjacent vertices of every layer, so one group spans the
    model), the same restricted set is solved by the front program
    (:func:`_frontier_dp`, at most ``ctx.mix_states`` frontier states): first
    the two bracketing points' union (at most two choices per vertex), then,
    below the plan that found, every point's. Either way the result is an
    evaluated assignment of allowed choices within the budget, so the
    incumbent stays a real plan; nothing is proven from it.
    """
    unions = []
    for group in ([*points, plus, minus], [plus, minus]):
        union = [np.zeros(len(ok), dtype=bool) for ok in allowed]
        for pt in group:
            for v, j in enumerate(pt.choices):
                union[v][j] = True
        unions.append(union)
    if _separable(ctx, unions[0], np.inf)[0]:
        return
    if ctx.mix_states <= 0:
        _separable(ctx, unions[1], np.inf)
        return
    if not _separable(ctx, unions[1], np.inf)[0]:
        _frontier_dp(ctx, unions[1], np.inf, lam, ctx.mix_states, ctx.mix_points)
    if any(a.sum() > b.sum() for a, b in zip(*unions)):
        cutoff = ctx.best.f - ctx.rtol * abs(ctx.best.f) if ctx.best is not None else np.inf
        _frontier_dp(ctx, unions[0], cutoff, lam, ctx.mix_states, ctx.mix_points)


def _frontier_plan(p: Problem) -> list[tuple[list[int], list[int]]]:
    """Per vertex (in index order): the frontier before adding it, and the frontier after (vertices kept).

    The frontier after step i holds the vertices <= i with a neighbour > i.
    """
    n = p.num_vertices
    last = list(range(n))  # the largest neighbour index (or itself)
    for s, d in p.edges:
        last[s] = max(last[s], d)
        last[d] = max(last[d], s)
    out, front = [], []
    for v in range(n):
        after = [u for u in front + [v] if last[u] > v]
        out.append((front, after))
        front = after
    return out


def _row_classes(a: np.ndarray) -> np.ndarray:
    """Class index per row of ``a`` such that rows in one class are identical (exact).

    Rows are grouped by a random projection (the finite entries and the
    pattern of infinite ones); the grouping is then checked entry by entry
    against each group's first row, and on any mismatch (a collision, NaN)
    the rows are classed by ``np.unique(axis=0)`` instead. Equal rows that
    happen to project differently only split a class, which costs states,
    never exactness. Much faster than sorting the rows as byte strings.
    """
    if a.shape[0] == 0 or a.shape[1] == 0:
        return np.zeros(a.shape[0], dtype=np.int64)
    rng = np.random.default_rng(0x5EED)
    r1, r2 = rng.standard_normal(a.shape[1]), rng.standard_normal(a.shape[1])
    fin = np.isfinite(a)
    h = np.where(fin, a, 0.0) @ r1 + (~fin) @ r2
    _, first, inv = np.unique(h, return_index=True, return_inverse=True)
    inv = np.asarray(inv, dtype=np.int64).ravel()
    if np.array_equal(a, a[first[inv]]):
        return inv
    _, inv = np.unique(a, axis=0, return_inverse=True)
    return np.asarray(inv, dtype=np.int64).ravel()


def _frontier_classes(p: Problem, cfgs: Sequence[np.ndarray], plan: list[tuple[list[int], list[int]]]
                      ) -> list[list[tuple[np.ndarray, int]]]:
    """Per step, per vertex of the frontier after it: (class of each of its allowed configurations, count).

    After adding vertex v, a frontier vertex u still meets only its edges to
    neighbours w > v. Two allowed configurations of u whose slices of every
    such edge matrix (over w's allowed configurations) are identical give
    every completion the same cost, so points that differ only there are
    compared as one state (:func:`_frontier_dp`). Edge matrices of DNN
    problems have few distinct rows (a row depends only on how the producer
    lays out its output), so there are far fewer classes than configurations.
    """
    adj: dict[int, list[tuple[int, int, bool]]] = {}  # u -> (neighbour w, edge, u is the edge's src)
    for e, (s, d) in enumerate(p.edges):
        adj.setdefault(s, []).append((d, e, True))
        adj.setdefault(d, []).append((s, e, False))
    # the classes depend only on the remaining edges' matrices and the allowed configurations at both ends:
    # identical layers (shared matrices, equal restrictions) are classed once
    cache: dict[tuple[int, tuple[int, ...]], tuple[np.ndarray, int]] = {}
    shared: dict[tuple, tuple[np.ndarray, int]] = {}
    cfg_key = [c.tobytes() for c in cfgs]
    out = []
    for v, (_, after) in enumerate(plan):
        step = []
        for u in after:
            rem = [(w, e, src) for w, e, src in adj.get(u, ()) if w > v]
            key = (u, tuple(e for _, e, _ in rem))
            if key not in cache:
                same = (cfg_key[u], tuple((id(p.edge_cost[e]), src, cfg_key[w]) for w, e, src in rem))
                if same not in shared:
                    slices = [p.edge_cost[e][np.ix_(cfgs[u], cfgs[w])] if src
                              else p.edge_cost[e][np.ix_(cfgs[w], cfgs[u])].T for w, e, src in rem]
                    inv = _row_classes(np.concatenate(slices, axis=1))
                    shared[same] = (inv, int(inv.max()) + 1)
                cache[key] = shared[same]
            step.append(cache[key])
        out.append(step)
    return out


def _completion_bounds(mp: MemoryProblem, idx: Sequence[np.ndarray], cfgs: Sequence[np.ndarray],
                       plan: list[tuple[list[int], list[int]]], classes: list[list[tuple[np.ndarray, int]]],
                       nbr: dict[int, list[tuple[int, int, bool]]], lam: float) -> tuple[float, list[np.ndarray]]:
    """Least Lagrangian cost of completing each frontier state, by the front program run backwards.

    ``h[v][s]`` (s the state after adding v, flattened like the forward keys)
    is the minimum over the allowed choices of the vertices w > v of
    ``sum_w (cost + lam memory)`` plus every edge with an end after v,
    given the frontier's classes s (the vertices before v meet the rest only
    through the frontier). With ``h[n-1] = 0``::

        h[v-1][s] = min_c  u_v(c) + sum_(u in front, u ~ v) E_uv[s_u, c] + h[v][s'(s, c)]

    where u_v(c) is the least ``cost + lam memory`` of v's allowed choices of
    configuration c and s' keeps each frontier vertex's coarser class (its
    class before v already fixes its edges after v) and adds v's. Returns
    ``(h[-1], h)``: h[-1] is the least ``F + lam M - lam fixed`` over the allowed
    choices. A point of the forward program with Lagrangian value ``L`` in
    state s completes to at least ``L + h[v][s]``.
    """
    p = mp.problem
    n = p.num_vertices
    h: list[np.ndarray] = [np.zeros(1)] * n
    nxt = np.zeros(1)  # h[n-1]: the frontier after the last vertex is empty
    for v in range(n - 1, -1, -1):
        h[v] = nxt
        front, after = plan[v]
        prev = classes[v - 1] if v else []
        counts = [c for _, c in prev]
        grid = np.indices(counts).reshape(len(counts), -1) if counts else np.zeros((0, 1), dtype=np.int64)
        reps = [np.unique(of, return_index=True)[1] for of, _ in prev]  # a configuration of each class
        j = idx[v]
        val = mp.cost[v][j] + lam * mp.memory[v][j]
        loc = np.searchsorted(cfgs[v], mp.base[v][j])
        unary = np.full(len(cfgs[v]), np.inf)
        np.minimum.at(unary, loc, val)
        total = np.broadcast_to(unary, (grid.shape[1], len(unary))).copy()
        pos = {u: k for k, u in enumerate(front)}
        for u, e, v_is_dst in nbr.get(v, ()):
            cu = cfgs[u][reps[pos[u]][grid[pos[u]]]]
            mat = p.edge_cost[e]
            total += mat[np.ix_(cu, cfgs[v])] if v_is_dst else mat[np.ix_(cfgs[v], cu)].T
        key = np.zeros((grid.shape[1], len(unary)), dtype=np.int64)
        for (of, count), u in zip(classes[v], after):
            if u == v:
                part = of[None, :]
            else:
                part = of[reps[pos[u]][grid[pos[u]]]][:, None]
            key = key * count + part
        nxt = (total + nxt[key]).min(axis=1)
    return float(nxt[0]), h


def _frontier_dp(ctx: "_Ctx", allowed: Sequence[np.ndarray], cutoff: float, lam: float,
                 max_states: int = 20_000, max_points: int = 1_000_000) -> tuple[bool, float]:
    """Exact optimum over ``allowed`` by a dynamic program over the vertex order with (time, memory) fronts.

    Vertices are added in index order; the *frontier* after adding v is the
    set of added vertices with a neighbour not yet added, and a *state* is one
    configuration per frontier vertex (choices of one configuration differ
    only in their own cost and memory), up to the classes of
    :func:`_frontier_classes`: configurations whose edges to the vertices
    still to come are identical are one state, since every completion costs
    the same with either. For each state the program keeps the
    Pareto front of (F, M) over the added vertices (F counts their own costs
    and the edges among them), so at the end (empty frontier) the best front
    point within the budget is the node's optimum. Points are dropped when
    (a) M plus the least memory of the vertices to come exceeds B, (b) F plus
    their least own cost reaches ``cutoff``, or (c) their Lagrangian value
    ``F + lam M`` exceeds the least of their state by ``cutoff + lam B - lmin``
    or more, where ``lmin`` is the least ``F + lam M`` over the node: for any
    completion c, the two points' totals differ by exactly that much, and the
    other's total is at least ``lmin``, so this point's total with c has
    ``F + lam M >= cutoff + lam B`` and cannot be both within the budget and
    below the cutoff. Gives up (done False) when a frontier has more than
    ``max_states`` configuration combinations or the points (or four times as
    many candidates in one step) exceed ``max_points``, its back-pointers ``ctx.frontier_bytes``, or the
    search's work passes ``ctx.work_limit`` (each step charges its candidates, :data:`FRONTIER_WORK` each:
    deterministic, so where it gives up is the same on any machine) or a wall-clock ``ctx.deadline`` the
    caller asked for; states are counted in classes.
    """
    mp = ctx.mp
    p = mp.problem
    n = p.num_vertices
    if not all(ok.any() for ok in allowed):
        return True, np.inf
    ctx.charge("frontier", FRONTIER_VERTEX_WORK * n)
    idx = [np.flatnonzero(ok) for ok in allowed]
    cfgs = [np.unique(mp.base[v][i]) for v, i in enumerate(idx)]
    plan = _frontier_plan(p)
    classes = _frontier_classes(p, cfgs, plan)
    for (_, after), cls in zip(plan, classes):
        size = 1
        for u, (_, count) in zip(after, cls):
            size *= count
            if size > max_states:
                return False, np.nan
    nbr: dict[int, list[tuple[int, int, bool]]] = {}  # v -> (earlier neighbour u, edge, v is the edge's dst)
    for e, (s, d) in enumerate(p.edges):
        if s < d:
            nbr.setdefault(d, []).append((s, e, True))
        else:
            nbr.setdefault(s, []).append((d, e, False))
    lam = max(lam, 0.0)
    start, rest = _completion_bounds(mp, idx, cfgs, plan, classes, nbr, lam)
    lmin = start + lam * mp.fixed
    # a point of Lagrangian value L in state s completes to at least L + rest[v][s]; a plan below the cutoff
    # within the budget has F + lam M < cutoff + lam B, so points reaching that are dropped (with a margin
    # of 1e-9 relative, for rounding: dropping fewer is always exact)
    reach = cutoff + lam * mp.budget
    reach += 1e-9 * max(abs(reach), abs(lmin), 1e-300)
    least_m = np.array([float(mp.memory[v][i].min()) for v, i in enumerate(idx)])
    least_c = np.array([float(mp.cost[v][i].min()) for v, i in enumerate(idx)])
    rest_m = np.concatenate([np.cumsum(least_m[::-1])[::-1], [0.0]])
    rest_c = np.concatenate([np.cumsum(least_c[::-1])[::-1], [0.0]])
    band = cutoff + lam * mp.budget - lmin
    band += 1e-9 * max(abs(cutoff), abs(lmin), 1e-300)
    # points: configuration columns of the frontier (local indices into cfgs), F, M; back-pointers per step
    cols = np.zeros((1, 0), dtype=np.int64)
    F = np.array([0.0])
    M = np.array([mp.fixed])
    back: list[tuple[np.ndarray, np.ndarray]] = []
    held = 0
    for v in range(n):
        front, after = plan[v]
        pos = {u: k for k, u in enumerate(front)}
        j = idx[v]
        jc = np.searchsorted(cfgs[v], mp.base[v][j])  # local config of each allowed choice
        P, J = len(F), len(j)
        if P * J > 4 * max_points:
            return False, np.nan
        ctx.charge("frontier", FRONTIER_WORK * (P * J))
        ctx.frontier_candidates += P * J
        add = np.broadcast_to(mp.cost[v][j], (P, J)).copy()
        for u, e, v_is_dst in nbr.get(v, ()):
            cu = cfgs[u][cols[:, pos[u]]]
            mat = p.edge_cost[e]
            add += mat[np.ix_(cu, mp.base[v][j])] if v_is_dst else mat[np.ix_(mp.base[v][j], cu)].T
        nf = F[:, None] + add
        nm = M[:, None] + mp.memory[v][j][None, :]
        # state key (mixed radix over the frontier's configuration counts): the kept frontier vertices'
        # part comes from the parent point, the new vertex's from the choice, so it is a sum of the two
        keep_cols = [pos[u] for u in after if u != v]
        part_p = np.zeros(P, dtype=np.int64)
        part_c = np.zeros(J, dtype=np.int64)
        for (of, count), u in zip(classes[v], after):
            part_p *= count
            part_c *= count
            if u == v:
                part_c += of[jc]
            else:
                part_p += of[cols[:, pos[u]]]
        key = part_p[:, None] + part_c[None, :]
        lag = nf + lam * nm
        # the tests on a point alone (budget, cost, and the completion bound of its state) before the sort;
        # they drop with a point every point it dominates in its state, so the sort keeps what it kept
        ok = ((nm + rest_m[v + 1] <= mp.budget) & (nf + rest_c[v + 1] < cutoff)
              & (lag + rest[v][key] < reach))
        sel = np.flatnonzero(ok.ravel())
        if not len(sel):
            return True, np.inf
        parent, choice = sel // J, sel % J
        nf, nm, key, lag = nf.ravel()[sel], nm.ravel()[sel], key.ravel()[sel], lag.ravel()[sel]
        # per state: Pareto and band
        order = np.lexsort((nf, nm, key))
        key_s, f_s, lag_s = key[order], nf[order], lag[order]
        start = np.ones(len(order), dtype=bool)
        start[1:] = key_s[1:] != key_s[:-1]
        grp = np.cumsum(start) - 1
        # segmented running minimum of F in memory order: exact via integer ranks of F
        rank = np.empty(len(order), dtype=np.int64)
        rank[np.argsort(f_s, kind="stable")] = np.arange(len(order))
        code = (grp[-1] - grp) * len(order) + rank  # earlier states get larger codes
        prev = np.concatenate([[np.iinfo(np.int64).max], np.minimum.accumulate(code)[:-1]])
        pareto = start | (code < prev)
        best_lag = np.minimum.reduceat(lag_s, np.flatnonzero(start))[grp]
        keep = pareto & (lag_s - best_lag < band)
        order = order[keep]
        newcols = cols[parent[order]][:, keep_cols]
        if v in after:
            newcols = np.concatenate([newcols, jc[choice[order]][:, None]], axis=1)
        if len(order) > max_points:
            return False, np.nan
        cols, F, M = newcols, nf[order], nm[order]
        back.append((parent[order], choice[order]))
        held += back[-1][0].nbytes + back[-1][1].nbytes
        if held > ctx.frontier_bytes or ctx.work > ctx.work_limit or time.perf_counter() > ctx.deadline:
            return False, np.nan
    ok = np.flatnonzero(M <= mp.budget)
    if not len(ok):
        return True, np.inf
    at = int(ok[np.argmin(F[ok])])
    chosen = np.zeros(n, dtype=np.int64)
    for v in range(n - 1, -1, -1):
        parent, choice = back[v]
        chosen[v] = idx[v][choice[at]]
        at = int(parent[at])
    f, m = mp.evaluate(chosen)
    if m > mp.budget:
        return False, np.nan
    ctx.offer(_Point(f, m, tuple(int(x) for x in chosen)))
    return True, f


def _branch(mp: MemoryProblem, node: _Node, ev: _Eval) -> list[_Node]:
    plus, minus = ev.plus, ev.minus
    assert plus is not None and minus is not None
    diff = [mp.memory[v][plus.choices[v]] - mp.memory[v][minus.choices[v]] for v in range(len(plus.choices))]
    v = int(np.argmax(diff))
    if diff[v] <= 0:  # cannot happen: M(plus) > B >= M(minus)
        raise AssertionError("branching found no vertex where the infeasible point uses more memory")
    cut = mp.memory[v][plus.choices[v]]
    low = node.allowed[v] & (mp.memory[v] < cut)
    high = node.allowed[v] & (mp.memory[v] >= cut)
    out = []
    for mask in (low, high):
        allowed = list(node.allowed)
        allowed[v] = mask
        out.append(_Node(allowed, ev.bound, node.depth + 1))
    return out


def solve_memory(mp: MemoryProblem, *, work_limit: float = WORK_LIMIT, time_limit: float | None = None,
                 max_nodes: int = 100_000, rtol: float = 1e-9,
                 max_dual_iters: int = 60, upper: float = np.inf, fix_iters: int = 5,
                 separable: int = 4096, frontier: int = 100_000, mix: bool = True, dp: Callable[[Problem], Solution] | None = None,
                 solved: dict | None = None, **dp_options: Any) -> Solution:
    """Minimum F subject to M <= budget (see the module docstring), exact unless stopped.

    Parameters:
        mp: the problem.
        work_limit: work units (:data:`WORK_LIMIT`; each Lagrangian solve charged :func:`solve_work`, each
            frontier program per vertex and candidate, :data:`FRONTIER_WORK`) after which the branch-and-bound stops, checked between
            nodes (the first node always runs), and the frontier program gives up (the answer then carries
            its bound and gap). Work is counted, not timed: the same call stops at the same place on any
            machine and load, so it returns the same plan and bound.
        time_limit: None (default): no wall clock. Seconds, when the caller asks for one: the search also
            stops at that wall-clock deadline, like the work limit; where it stops then depends on the
            machine's speed and load.
        max_nodes: branch-and-bound nodes after which it stops.
        rtol: relative tolerance for ties (a node is pruned when its bound is
            within ``rtol`` of the incumbent).
        max_dual_iters: hull iterations per node.
        upper: a cost known to be reachable otherwise (e.g. by another
            micro-batch count): nodes that cannot go below it are pruned, so the
            answer is optimal only if it is below ``upper`` (``stats["beats_upper"]``).
        fix_iters: TRW-S sweeps of the reduced-cost fixing at each branching node
            (see :func:`_fix`); -1 turns fixing off.
        separable: a node whose allowed choices split into independent parts of at
            most this many assignments each is solved exactly by a knapsack over
            them (:func:`_separable`) instead of being branched; 0 turns that off.
        frontier: a node whose frontier states (see :func:`_frontier_dp`) number at most
            this many is solved exactly by the (time, memory) front program; 0 turns that off.
        mix: after each node's dual, offer the best plan mixing its dual's points
            (:func:`_mix`: a knapsack of the groups where they differ, else the front
            program over their choices; a heuristic for the incumbent, exactness does not rest on it).
        dp: the exact unconstrained solver (default :func:`~shardplan.search.dp.solve_dp`
            with ``dp_options``).
        solved: a dict (empty at first) shared between calls on the same ``mp`` with the same solver: each
            Lagrangian solve's point is stored under its multiplier and allowed choices, and a later call
            (e.g. the full search after a root-only one) takes it from there instead of solving again
            (exact: the solver is deterministic, so it is the point the solve would give).

    Returns:
        A :class:`Solution` whose ``assignment`` holds *choice* indices, ``cost``
        = F, ``optimal`` True when proven, ``bound`` the proven lower bound, and
        stats: ``memory_bytes`` (M of the answer), ``budget_bytes``, ``least_memory_bytes``,
        ``unconstrained_cost`` (the optimum without the budget, a lower bound),
        ``unconstrained_memory_bytes``, ``gap`` (relative), ``nodes``, ``dp_solves``, ``lambda``
        (the root's multiplier, seconds per byte), ``found`` (False when ``upper`` closed every node
        before a feasible point was seen: the answer is then the least-memory plan), ``status``,
        ``interrupted``, ``work`` (the work units charged) and ``work_parts`` (the same by kind: ``dp``,
        ``dp_stored``, ``fix``, ``frontier``).

    A :class:`KeyboardInterrupt` (Ctrl-C) stops the search like its work limit once a feasible plan is
    known: the node being worked on goes back to the open list with its bound, so the answer's ``bound``
    (the least open bound) stays proven and ``stats["interrupted"]`` is True; before any feasible plan it
    propagates.

    Raises:
        ShardplanError: when no assignment fits: the message names the least
            memory any assignment needs.
    """
    from shardplan.checks import real

    work_limit = real("solve_memory: work_limit", work_limit, minimum=0.0)
    if time_limit is not None:
        time_limit = real("solve_memory: time_limit", time_limit, positive=True, unit="s")
    t0 = time.perf_counter()
    if dp is None:
        from shardplan.search.dp import solve_dp

        def dp(p: Problem) -> Solution:
            return solve_dp(p, **dp_options)

        def cut_dp(p: Problem, cutoff: float) -> Solution:
            return solve_dp(p, cutoff=cutoff, **dp_options)
    else:
        cut_dp = None  # type: ignore[assignment]
    least = mp.least_memory()
    if least > mp.budget:
        raise ShardplanError(infeasible_message(least, mp.budget))
    ctx = _Ctx(mp, dp, rtol, mix=mix, work_limit=work_limit,
               deadline=np.inf if time_limit is None else t0 + time_limit, cut_dp=cut_dp)
    if solved is not None:
        ctx.solved = solved
    root = _Node([np.ones(k, dtype=bool) for k in mp.num_choices], -np.inf)
    heap: list[tuple[float, int, _Node]] = [(root.bound, 0, root)]
    counter, nodes = 1, 0
    root_stats: dict[str, Any] = {}
    stopped = ""
    def incumbent() -> float:
        return min(ctx.best.f if ctx.best is not None else np.inf, upper)

    fixed = closed_separable = closed_frontier = 0
    interrupted = False
    while heap:
        bound, _, node = heap[0]
        inc = incumbent()
        if bound >= inc - rtol * abs(inc):
            heap.clear()  # best-first: every open node is as bad
            break
        if nodes >= max_nodes:
            stopped = f"node limit {max_nodes}"
            break
        if nodes and ctx.work >= work_limit:
            stopped = f"work limit {work_limit:g}"
            break
        if nodes and time.perf_counter() > ctx.deadline:
            stopped = f"time limit {time_limit:g} s"
            break
        heapq.heappop(heap)
        nodes += 1
        try:
            ev = _dual(ctx, node.allowed, inc - rtol * abs(inc) if np.isfinite(inc) else np.inf, max_dual_iters)
            if not root_stats:
                root_stats = {"root_bound": ev.bound, "lambda": ev.lam, "root_dual_iterations": ev.iterations}
                if ev.plus is not None:
                    root_stats.update(unconstrained_cost=ev.plus.f, unconstrained_memory_bytes=ev.plus.m)
                elif ev.minus is not None:
                    root_stats.update(unconstrained_cost=ev.minus.f, unconstrained_memory_bytes=ev.minus.m)
            inc = incumbent()
            if ev.closed or ev.bound >= inc - rtol * abs(inc):
                continue
            allowed = node.allowed
            if fix_iters >= 0:
                allowed = _fix(ctx, node.allowed, ev.lam, inc - rtol * abs(inc), fix_iters, ev.budget)
                if not all(ok.any() for ok in allowed):
                    continue
            if separable > 0 and _separable(ctx, allowed, inc - rtol * abs(inc), separable)[0]:
                closed_separable += 1  # solved exactly: its best (if below the incumbent) was offered
                continue
            if frontier > 0 and _frontier_dp(ctx, allowed, inc - rtol * abs(inc), ev.lam, frontier)[0]:
                closed_frontier += 1  # likewise
                continue
            if fix_iters >= 0:
                dropped = sum(int(a.sum()) for a in node.allowed) - sum(int(a.sum()) for a in allowed)
                if dropped:
                    fixed += dropped
                    heapq.heappush(heap, (max(ev.bound, node.bound), counter, _Node(allowed, ev.bound, node.depth)))
                    counter += 1
                    continue
            for child in _branch(mp, node, ev):
                heapq.heappush(heap, (max(ev.bound, node.bound), counter, child))
                counter += 1
        except KeyboardInterrupt:
            if ctx.best is None:
                raise
            # the node is unresolved: back on the open list with the bound it had, which stays proven
            heapq.heappush(heap, (bound, counter, node))
            stopped, interrupted = "interrupt", True
            break
    best = ctx.best
    found = best is not None
    if best is None:  # ``upper`` pruned every node before a feasible point was seen: any plan fits as the answer
        least_choice = tuple(int(np.argmin(m)) for m in mp.memory)
        best = _Point(*mp.evaluate(least_choice), least_choice)
    lower = max(min([best.f, upper] + [b for b, _, _ in heap]), 0.0)  # F is a sum of times: never below 0
    optimal = not heap and best.f <= upper
    if optimal:
        lower = best.f
    gap = 0.0 if optimal else ((best.f - lower) / abs(best.f) if best.f else float(lower < best.f))
    stats = {"memory_bytes": best.m, "budget_bytes": mp.budget, "least_memory_bytes": least,
             **root_stats, "gap": gap, "nodes": nodes, "open_nodes": len(heap), "dp_solves": ctx.solves, "dp_cut_off": ctx.cut_solves,
             "dp_reused": ctx.reused, "dp_seconds": ctx.dp_seconds, "work": ctx.work,
             "work_parts": dict(ctx.parts),
             "frontier_candidates": ctx.frontier_candidates, "fixed_choices": fixed, "separable_nodes": closed_separable, "frontier_nodes": closed_frontier, "beats_upper": best.f < upper, "found": found, "interrupted": interrupted, "status": ("optimal" if optimal else f"stopped at the {stopped}" if stopped
                        else "proven: nothing below upper")}
    return Solution(cost=best.f, assignment=best.choices, solve_seconds=time.perf_counter() - t0,
                    solver="memory-bb", optimal=optimal, bound=float(lower), stats=stats)


def enumerate_choices(problem: Problem, base: Sequence[np.ndarray], cost: Sequence[np.ndarray],
                      max_combinations: int = 10**6) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """Every choice assignment (``digits[v][i]``: vertex v's choice in assignment i) and its seconds
    ``F`` (own costs plus edges on the choices' configurations); refuses above ``max_combinations``."""
    sizes = tuple(len(c) for c in cost)
    total = int(np.prod([float(k) for k in sizes])) if sizes else 1
    if total > max_combinations:
        raise ShardplanError(f"brute force needs {total} combinations, over the limit of {max_combinations}")
    digits = np.unravel_index(np.arange(total), sizes) if sizes else ()
    f = np.zeros(total)
    for v in range(len(sizes)):
        f += cost[v][digits[v]]
    for (s, d), mat in zip(problem.edges, problem.edge_cost):
        f += mat[base[s][digits[s]], base[d][digits[d]]]
    return tuple(digits), f


def cheapest_within(digits: tuple[np.ndarray, ...], f: np.ndarray, mem: np.ndarray, budget: float) -> tuple[int, ...]:
    """The assignment of least F among those with memory within ``budget`` (one-line error if none)."""
    ok = mem <= budget
    if not ok.any():
        raise ShardplanError(infeasible_message(float(mem.min()), budget))
    j = int(np.flatnonzero(ok)[np.argmin(f[ok])])
    return tuple(int(x[j]) for x in digits)


def solve_memory_bruteforce(mp: MemoryProblem, max_combinations: int = 10**6) -> Solution:
    """Reference: every choice assignment enumerated (refuses above ``max_combinations``)."""
    t0 = time.perf_counter()
    digits, f = enumerate_choices(mp.problem, mp.base, mp.cost, max_combinations)
    m = np.full(len(f), mp.fixed)
    for v, dv in enumerate(digits):
        m += mp.memory[v][dv]
    choices = cheapest_within(digits, f, m, mp.budget)
    cost, mem = mp.evaluate(choices)
    return Solution(cost=cost, assignment=choices, solve_seconds=time.perf_counter() - t0, solver="bruteforce",
                    optimal=True, bound=cost, stats={"memory_bytes": mem, "combinations": len(f)})
