"""Exact minimum cost under a backward-pass peak memory budget: surrogate relaxation and branch-and-bound.

The problem
-----------
A :class:`PeakProblem` is a :class:`~shardplan.search.constrained.MemoryProblem`
whose per-choice memory is split in four: ``rest`` (held throughout: weights,
optimizer state), ``saved`` (held from the forward pass until the vertex's
backward step consumes it), ``grad`` (produced at the vertex's backward
step and held from then on) and ``transient`` (held during the vertex's own
backward step only: the gradients it receives and writes). The backward pass
visits the vertices in reverse index order, so at the backward step of vertex
k (positions 0..n-1)::

    M_k(a) = fixed + sum_v rest_v(a_v) + sum_{v <= k} saved_v(a_v) + sum_{v >= k} grad_v(a_v) + transient_k(a_k)

and the plan must satisfy every one of these n constraints::

    minimise F(a)  subject to  M_k(a) <= B  for k = 0..n-1,

i.e. ``peak(a) = max_k M_k(a) <= B``. Each M_k is at most the additive
``fixed + sum_v (rest + saved + grad + transient)``, so the additive problem's
optimum is feasible here (an incumbent) and its value an upper bound. The
additive model with transients (every saved value and gradient live
throughout, ``saved = grad = 0`` and ``rest`` their sum) is the same problem:
``fixed + sum_v rest_v + max_k transient_k <= B`` is these n constraints.

The algorithm
-------------
*Surrogate relaxation.* For weights ``w_k >= 0`` summing to 1, the surrogate
constraint ``sum_k w_k M_k(a) <= B`` is implied by the n constraints (a convex
combination of numbers <= B is <= B), so ``v(w)``, the optimum under it alone, is a
lower bound of the true optimum. It is additive over vertices::

    sum_k w_k M_k(a) = fixed + sum_v [rest_v + S_v saved_v + P_v grad_v + w_v transient_v](a_v),
    S_v = sum_{k >= v} w_k,   P_v = sum_{k <= v} w_k,

an ordinary :class:`MemoryProblem`, solved exactly by
:func:`~shardplan.search.constrained.solve_memory` (whose proven bound is used,
so a stopped solve still gives a valid bound). If its plan satisfies every
M_k <= B it is feasible and, the solve being proven, optimal.

*The surrogate dual* ``max_w v(w)`` is solved by cutting planes on w: a plan
``a_t`` found at some w is feasible for the surrogate at every w' with
``sum_k w'_k (M_k(a_t) - B) <= 0``, and there ``v(w') <= F(a_t)``; so a w'
can give a bound above ``max_t F(a_t)`` only where every plan found so far is
surrogate-infeasible: ``sum_k w'_k (M_k(a_t) - B) > 0`` for all t. The next w
is the centre of that region found by a small LP (maximise the least margin
eps over the simplex); when eps <= 0 no w can improve the bound (the dual is
solved). The first w puts all weight on the position where the incumbent's
profile peaks (the last position without an incumbent).

*Branch-and-bound* closes the surrogate duality gap (a surrogate dual of an
integer program need not reach its optimum). A node restricts each vertex to a
subset of its choices; its bound is its own surrogate dual (starting from the
parent's last w). A node is closed when its surrogate plan is feasible and
proven (its exact optimum), when even the least memory of every vertex
violates some M_k (:meth:`PeakProblem.least_peak`), or when its bound reaches the
incumbent. Otherwise, with a the node's last surrogate plan and k* the
position of its peak, it branches on the vertex whose memory at k*
(``rest + [v <= k*] saved + [v >= k*] grad + [v = k*] transient``) can drop the most: one child
keeps the choices using less there than a does, the other the rest (when a
fits, from a stopped solve, and no vertex can drop: a's choice of some vertex
against the others). Both are non-empty and smaller, so the search is finite.
A child inherits the parent's surrogate plans that it still allows as cuts;
when they leave no weights, its dual cannot rise above the parent's bound and
it is branched at once on the last of them; nodes are taken best bound
first, and when it stops at its work or node limit (or a wall-clock limit the
caller asked for) the least open bound is the proven lower bound (the answer
carries it and the gap).
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from shardplan.errors import ShardplanError
from shardplan.search.constrained import WORK_LIMIT, MemoryProblem, solve_memory
from shardplan.search.problem import Problem, Solution

SURROGATE_SLACK = 1e-9  # relative: the surrogate budget's allowance for rounding (PeakProblem.surrogate)

__all__ = ["PeakProblem", "backward_profile", "solve_peak", "solve_peak_bruteforce", "surrogate_weights"]


def backward_profile(rest: np.ndarray, saved: np.ndarray, grad: np.ndarray, fixed: float = 0.0,
                     transient: np.ndarray | None = None) -> np.ndarray:
    """Memory at each backward step k (vertices in forward order 0..n-1, backward in reverse):

    ``fixed + sum_v rest_v + sum_{v <= k} saved_v + sum_{v >= k} grad_v + transient_k``;
    arrays of shape (n,) or (..., n) (a batch of plans on the last axis); no ``transient``: zeros.
    """
    rest, saved, grad = (np.asarray(x, dtype=np.float64) for x in (rest, saved, grad))
    suffix = np.flip(np.cumsum(np.flip(grad, -1), -1), -1)
    out = fixed + rest.sum(-1, keepdims=True) + np.cumsum(saved, -1) + suffix
    return out if transient is None else out + np.asarray(transient, dtype=np.float64)


def surrogate_weights(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(S, P) of position weights ``w``: S_v = sum_{k >= v} w_k (saved), P_v = sum_{k <= v} w_k (grad)."""
    w = np.asarray(w, dtype=np.float64)
    return np.flip(np.cumsum(np.flip(w))), np.cumsum(w)


@dataclass(frozen=True, eq=False)
class PeakProblem:
    """A memory problem whose peak is the largest of the backward steps' memories (module docstring).

    Attributes:
        problem: configurations and edge costs (its vertex costs are not used).
        base, cost: per vertex, each choice's configuration and own seconds (as in :class:`MemoryProblem`).
        rest, saved, grad: per vertex, each choice's bytes held throughout / until its backward step /
            from its backward step on; finite, >= 0.
        budget: B, bytes per device.
        fixed: bytes per device every plan needs besides the per-vertex terms.
        transient: per vertex, each choice's bytes held during its own backward step only; finite,
            >= 0 (empty, the default: zeros).
    """

    problem: Problem
    base: tuple[np.ndarray, ...]
    cost: tuple[np.ndarray, ...]
    rest: tuple[np.ndarray, ...]
    saved: tuple[np.ndarray, ...]
    grad: tuple[np.ndarray, ...]
    budget: float
    fixed: float = 0.0
    transient: tuple[np.ndarray, ...] = ()

    def __post_init__(self) -> None:
        n = self.problem.num_vertices
        if not len(self.transient):
            zeros: dict[int, np.ndarray] = {}  # one array per distinct base (identical layers keep sharing)
            object.__setattr__(self, "transient", tuple(zeros.setdefault(id(b), np.zeros(np.shape(b)))
                                                        for b in self.base))
        if not (len(self.rest) == len(self.saved) == len(self.grad) == len(self.transient) == n):
            raise ShardplanError("peak problem: rest, saved, grad and transient need one entry per vertex")
        parts = []
        for name, arrs in (("rest", self.rest), ("saved", self.saved), ("grad", self.grad),
                           ("transient", self.transient)):
            out = []
            for v, a in enumerate(arrs):
                a = np.asarray(a, dtype=np.float64)
                if a.shape != np.shape(self.base[v]):
                    raise ShardplanError(f"vertex {self.problem.names[v]!r}: {name} needs one entry per choice")
                if not np.all(np.isfinite(a)) or (a.size and a.min() < 0):
                    raise ShardplanError(f"vertex {self.problem.names[v]!r}: {name} must be finite and >= 0")
                out.append(a)
            parts.append(tuple(out))
        object.__setattr__(self, "rest", parts[0])
        object.__setattr__(self, "saved", parts[1])
        object.__setattr__(self, "grad", parts[2])
        object.__setattr__(self, "transient", parts[3])
        add = self.additive()  # validates base, cost and the budget
        object.__setattr__(self, "base", add.base)
        object.__setattr__(self, "cost", add.cost)
        object.__setattr__(self, "budget", add.budget)
        object.__setattr__(self, "fixed", add.fixed)

    @property
    def num_choices(self) -> tuple[int, ...]:
        return tuple(len(b) for b in self.base)

    def additive(self) -> MemoryProblem:
        """The additive model (every M_k bounded by rest + saved + grad + transient summed): its plans all fit
        here."""
        one = np.ones(len(self.rest))
        mem = _shared_sums(self.rest, self.saved, self.grad, self.transient, one, one, one)
        return MemoryProblem(self.problem, self.base, self.cost, mem, self.budget, self.fixed)

    def surrogate(self, w: np.ndarray) -> MemoryProblem:
        """The surrogate problem of position weights ``w`` (>= 0, summing to 1): additive, a relaxation.

        Its budget is B (1 + 1e-9): the weighted sums are rounded (a plan at M_k = B on the positions
        weighted may sum to B plus an ulp), and a looser budget keeps it a relaxation.
        """
        s, p = surrogate_weights(w)
        return MemoryProblem(self.problem, self.base, self.cost,
                             _shared_sums(self.rest, self.saved, self.grad, self.transient, s, p, np.asarray(w, dtype=np.float64)),
                             self.budget * (1 + SURROGATE_SLACK), self.fixed)

    def profile(self, choices: Sequence[int]) -> np.ndarray:
        """M_k of a choice assignment for every backward step k: shape (n,)."""
        a = [int(j) for j in choices]
        pick = [(r[j], s[j], g[j], t[j]) for r, s, g, t, j in zip(self.rest, self.saved, self.grad, self.transient, a)]
        if not pick:
            return np.zeros(0)
        rest, saved, grad, tr = (np.array(x) for x in zip(*pick))
        return backward_profile(rest, saved, grad, fixed=self.fixed, transient=tr)

    def evaluate(self, choices: Sequence[int]) -> tuple[float, float]:
        """(F, peak) of a choice assignment."""
        f, _ = self.additive().evaluate(choices)
        prof = self.profile(choices)
        return f, float(prof.max()) if len(prof) else self.fixed

    def contribution(self, k: int) -> list[np.ndarray]:
        """Per vertex, each choice's bytes in M_k: rest + [v <= k] saved + [v >= k] grad + [v = k] transient."""
        return [r + (s if v <= k else 0.0) + (g if v >= k else 0.0) + (t if v == k else 0.0)
                for v, (r, s, g, t) in enumerate(zip(self.rest, self.saved, self.grad, self.transient))]

    def least_peak(self, allowed: Sequence[np.ndarray] | None = None) -> float:
        """max_k of the least M_k over the allowed choices (a lower bound of every allowed plan's peak)."""
        if not self.rest:
            return self.fixed
        ok = allowed if allowed is not None else [np.ones(len(b), dtype=bool) for b in self.base]
        a = np.array([float((r + s)[m].min()) for r, s, m in zip(self.rest, self.saved, ok)])
        b = np.array([float((r + g)[m].min()) for r, g, m in zip(self.rest, self.grad, ok)])
        c = np.array([float((r + s + g + t)[m].min())
                      for r, s, g, t, m in zip(self.rest, self.saved, self.grad, self.transient, ok)])
        before = np.concatenate([[0.0], np.cumsum(a)[:-1]])
        after = np.concatenate([np.flip(np.cumsum(np.flip(b)))[1:], [0.0]])
        return float(self.fixed + (before + c + after).max())

    def restricted(self, allowed: Sequence[np.ndarray]) -> tuple["PeakProblem", list[np.ndarray]]:
        """The problem over the allowed choices only, and per vertex the original index of each kept choice."""
        idx = [np.flatnonzero(m) for m in allowed]
        cut = lambda arrs: tuple(x[i] for x, i in zip(arrs, idx))  # noqa: E731
        return PeakProblem(self.problem, cut(self.base), cut(self.cost), cut(self.rest), cut(self.saved),
                           cut(self.grad), self.budget, self.fixed, cut(self.transient)), idx


def _shared_sums(rest: Sequence[np.ndarray], saved: Sequence[np.ndarray], grad: Sequence[np.ndarray],
                 transient: Sequence[np.ndarray], s: np.ndarray, p: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, ...]:
    """rest_v + s_v saved_v + p_v grad_v + w_v transient_v per vertex, one array object per distinct
    (arrays, s_v, p_v, w_v).

    Identical layers keep one shared memory array where their weights agree, as the
    additive problem has them (the search's lattice and the DP's reuse of a layer key on that).
    """
    memo: dict[tuple, np.ndarray] = {}
    out = []
    for r, sv, g, t, a, b, c in zip(rest, saved, grad, transient, s, p, w):
        key = (id(r), id(sv), id(g), id(t), float(a), float(b), float(c))
        if key not in memo:
            memo[key] = r + float(a) * sv + float(b) * g + float(c) * t
        out.append(memo[key])
    return tuple(out)


def _next_weights(cuts: list[np.ndarray]) -> tuple[np.ndarray, float]:
    """The w of the simplex maximising min_t cuts[t] . w (the least margin eps), and eps.

    ``cuts[t]`` = (M(a_t) - B) / B per position: w with a positive margin makes every plan found
    so far surrogate-infeasible (module docstring).
    """
    from scipy.optimize import linprog

    g = np.array(cuts)
    t, n = g.shape
    # variables (w_0..w_{n-1}, eps): maximise eps s.t. eps - g_t . w <= 0, sum w = 1, w >= 0
    c = np.zeros(n + 1)
    c[-1] = -1.0
    a_ub = np.hstack([-g, np.ones((t, 1))])
    res = linprog(c, A_ub=a_ub, b_ub=np.zeros(t), A_eq=np.concatenate([np.ones(n), [0.0]])[None, :], b_eq=[1.0],
                  bounds=[(0, None)] * n + [(None, None)], method="highs")
    if res.status != 0 or res.x is None:  # pragma: no cover - the LP is always feasible and bounded
        return np.full(n, 1.0 / n), 0.0
    w = np.maximum(res.x[:n], 0.0)
    return w / w.sum(), float(res.x[-1])


@dataclass
class _Best:
    f: float
    choices: tuple[int, ...]
    peak: float


@dataclass
class _Budget:
    """The search's work budget (units of :data:`~shardplan.search.constrained.WORK_LIMIT`), what its
    surrogate solves used so far, and a wall-clock deadline (infinite unless the caller set a time limit)."""

    limit: float
    deadline: float
    used: float = 0.0

    def left(self) -> float:
        return max(self.limit - self.used, 0.0)

    def seconds_left(self) -> float | None:
        """For a surrogate solve: None without a deadline, else the seconds to it (at least a microsecond)."""
        return None if not np.isfinite(self.deadline) else max(self.deadline - time.perf_counter(), 1e-6)

    def spent(self) -> bool:
        return self.used >= self.limit or time.perf_counter() > self.deadline


@dataclass
class _NodeResult:
    bound: float
    closed: bool
    w: np.ndarray
    last: tuple[int, ...] | None = None  # the last surrogate plan (original choice indices), to branch on
    surrogate_solves: int = 0
    dp_solves: int = 0
    cuts: int = 0
    plans: list = field(default_factory=list)  # (choices, cut) of every surrogate plan of the node, for its children


def _surrogate_dual(pp: PeakProblem, allowed: list[np.ndarray], w0: np.ndarray, best: list[_Best | None],
                    upper: float, budget: _Budget, max_cuts: int, rtol: float, memory_options: dict,
                    inherited: Sequence[tuple[tuple[int, ...], np.ndarray]] = ()) -> _NodeResult:
    """The node's surrogate dual by cutting planes; offers every feasible plan found to ``best[0]``.

    ``inherited``: the parent's surrogate plans and their cuts; those the node still allows are cuts
    here too (a plan of the node that fits the surrogate at w bounds the node's v(w) by its cost). When
    they already leave no weights (the LP's margin <= 0), the node's dual cannot exceed their costs,
    which the parent's bound already reached: it is branched on the last of them without a solve.
    """
    sub, idx = pp.restricted(allowed)
    if sub.least_peak() > pp.budget:
        return _NodeResult(np.inf, True, w0)
    w = w0
    bound = -np.inf
    kept = [(c, g) for c, g in inherited if all(ok[j] for ok, j in zip(allowed, c))]
    cuts: list[np.ndarray] = [g for _, g in kept]
    res = _NodeResult(-np.inf, False, w0, plans=list(kept))
    if cuts:
        w, eps = _next_weights(cuts)
        if eps <= 1e-12:
            return _NodeResult(-np.inf, False, w0, kept[-1][0], plans=list(kept))

    def cutoff() -> float:
        inc = min(best[0].f if best[0] is not None else np.inf, upper)
        return inc - rtol * abs(inc) if np.isfinite(inc) else np.inf

    for _ in range(max_cuts):
        mp = sub.surrogate(w)
        if mp.least_memory() > mp.budget:  # nothing in the node satisfies even the surrogate constraint
            return _NodeResult(np.inf, True, w, None, res.surrogate_solves, res.dp_solves, len(cuts))
        sol = solve_memory(mp, work_limit=budget.left(), time_limit=budget.seconds_left(),
                           upper=min(best[0].f if best[0] is not None else np.inf, upper), **memory_options)
        budget.used += float(sol.stats.get("work", 0.0))
        res.surrogate_solves += 1
        res.dp_solves += int(sol.stats.get("dp_solves", 0))
        bound = max(bound, float(sol.bound if sol.bound is not None else -np.inf))
        choices = tuple(int(i[j]) for i, j in zip(idx, sol.assignment))
        prof = pp.profile(choices)
        peak = float(prof.max()) if len(prof) else pp.fixed
        if peak <= pp.budget:
            if best[0] is None or sol.cost < best[0].f:
                best[0] = _Best(sol.cost, choices, peak)
            if sol.optimal:  # the node's exact optimum (or nothing below the incumbent, then its bound says so)
                return _NodeResult(max(bound, sol.cost), True, w, None, res.surrogate_solves, res.dp_solves, len(cuts))
        res.last = choices
        res.plans.append((choices, (prof - pp.budget) / pp.budget))
        if bound >= cutoff() or budget.spent():
            break
        cuts.append(res.plans[-1][1])
        w_next, eps = _next_weights(cuts)
        if eps <= 1e-12:  # no weights make every plan found infeasible: the surrogate dual is solved
            break
        w = w_next
    return _NodeResult(bound, False, w, res.last, res.surrogate_solves, res.dp_solves, len(cuts), res.plans)


def _branch(pp: PeakProblem, allowed: list[np.ndarray], plan: tuple[int, ...]) -> list[list[np.ndarray]]:
    """Split on the vertex whose memory at the plan's peak step can drop the most (module docstring)."""
    k = int(np.argmax(pp.profile(plan)))
    contrib = pp.contribution(k)
    drop = [float(c[j] - c[ok].min()) for c, j, ok in zip(contrib, plan, allowed)]
    v = int(np.argmax(drop))
    if drop[v] > 0.0:
        low = allowed[v] & (contrib[v] < contrib[v][plan[v]])
    else:  # every vertex at its least M_k* (a plan that fits, from a stopped solve): split off its choice
        free = [u for u, ok in enumerate(allowed) if ok.sum() > 1]
        if not free:  # the node is this one plan, already offered
            return []
        v = free[0]
        low = allowed[v].copy()
        low[plan[v]] = False
    high = allowed[v] & ~low
    out = []
    for part in (low, high):
        child = list(allowed)
        child[v] = part
        out.append(child)
    return out


def solve_peak(pp: PeakProblem, *, work_limit: float = WORK_LIMIT, time_limit: float | None = None,
               max_nodes: int = 10_000, rtol: float = 1e-9,
               upper: float = np.inf, incumbent: Sequence[int] | None = None, max_cuts: int = 30,
               **memory_options: Any) -> Solution:
    """Minimum F subject to every backward step's memory M_k <= budget (module docstring), exact unless stopped.

    Parameters:
        pp: the problem.
        work_limit: work units (:data:`~shardplan.search.constrained.WORK_LIMIT`) after which the search
            stops, checked between nodes and between surrogate solves, each of which gets what is left (the
            answer then carries its bound and gap): counted, not timed, so the answer is the same on any
            machine and load.
        time_limit: None (default): no wall clock; seconds, when the caller asks for one (a stop that then
            depends on the machine's speed and load).
        max_nodes: branch-and-bound nodes after which it stops.
        rtol: relative tolerance for ties.
        upper: a cost known to be reachable otherwise: nodes that cannot go below it are pruned, so the
            answer is optimal only if it is below ``upper`` (``stats["beats_upper"]``).
        incumbent: a plan known to fit (choice indices), e.g. the additive model's optimum; when not
            given and the additive least memory fits, the additive problem's root plan is used.
        max_cuts: surrogate solves per node.
        memory_options: passed to :func:`~shardplan.search.constrained.solve_memory` (and by it to the DP).

    Returns:
        A :class:`Solution` over choice indices with ``optimal``, ``bound`` and stats: ``memory_bytes``
        (the plan's peak), ``peak_step`` (the vertex at whose backward step it occurs), ``budget_bytes``,
        ``gap``, ``nodes``, ``surrogate_solves``, ``dp_solves``, ``root_bound`` (the root's surrogate
        dual bound), ``status``.

    Raises:
        ShardplanError: no plan fits (the least peak of the choices exceeds the budget, or the search
            proved none fits), or none was found before the limits.
    """
    from shardplan.search.constrained import infeasible_message

    if int(max_cuts) < 1:
        raise ShardplanError(f"max_cuts must be a positive number of surrogate solves per node, got {max_cuts!r}")
    from shardplan.checks import real

    work_limit = real("solve_peak: work_limit", work_limit, minimum=0.0)
    if time_limit is not None:
        time_limit = real("solve_peak: time_limit", time_limit, positive=True, unit="s")
    t0 = time.perf_counter()
    budget = _Budget(work_limit, np.inf if time_limit is None else t0 + time_limit)
    n = pp.problem.num_vertices
    least = pp.least_peak()
    if least > pp.budget:
        raise ShardplanError(infeasible_message(least, pp.budget))
    best: list[_Best | None] = [None]
    if incumbent is not None:
        f, peak = pp.evaluate(incumbent)
        if peak > pp.budget:
            raise ShardplanError(f"the incumbent plan's peak {peak:.0f} B exceeds the budget {pp.budget:.0f} B")
        best[0] = _Best(f, tuple(int(j) for j in incumbent), peak)
    else:
        add = pp.additive()
        if add.least_memory() <= add.budget:
            root = solve_memory(add, max_nodes=1, fix_iters=-1, work_limit=work_limit, time_limit=time_limit,
                                **memory_options)
            best[0] = _Best(root.cost, tuple(root.assignment), pp.evaluate(root.assignment)[1])
    w0 = np.zeros(n)
    if n:
        w0[int(np.argmax(pp.profile(best[0].choices))) if best[0] is not None else n - 1] = 1.0
    root = [np.ones(k, dtype=bool) for k in pp.num_choices]
    heap: list[tuple[float, int, list[np.ndarray], np.ndarray, list]] = [(-np.inf, 0, root, w0, [])]
    counter = 1
    nodes = solves = dp_solves = cuts = 0
    root_bound = None
    stopped = ""

    def inc() -> float:
        return min(best[0].f if best[0] is not None else np.inf, upper)

    while heap:
        b, _, allowed, w, plans = heap[0]
        cut = inc()
        if b >= cut - rtol * abs(cut):
            heap.clear()
            break
        if nodes >= max_nodes:
            stopped = f"node limit {max_nodes}"
            break
        if nodes and budget.used >= work_limit:
            stopped = f"work limit {work_limit:g}"
            break
        if nodes and time.perf_counter() > budget.deadline:
            stopped = f"time limit {time_limit:g} s"
            break
        heapq.heappop(heap)
        nodes += 1
        r = _surrogate_dual(pp, allowed, w, best, upper, budget, max_cuts, rtol, memory_options, plans)
        solves += r.surrogate_solves
        dp_solves += r.dp_solves
        cuts += r.cuts
        if root_bound is None:
            root_bound = r.bound
        cut = inc()
        if r.closed or r.bound >= cut - rtol * abs(cut) or r.last is None:
            continue
        for child in _branch(pp, allowed, r.last):
            heapq.heappush(heap, (max(r.bound, b), counter, child, r.w, r.plans))
            counter += 1
    if best[0] is None:
        if heap:
            raise ShardplanError(f"no plan within the budget found before the {stopped}; "
                                 f"lower bound of the least peak {least:.0f} B")
        if np.isfinite(upper):
            raise ShardplanError(f"no plan fitting {pp.budget:.0f} B per device costs less than {upper!r} "
                                 "(proven by the search)")
        raise ShardplanError(f"no plan fits in {pp.budget:.0f} B per device under the backward-peak model "
                             "(proven by the search)")
    top = best[0]
    lower = min([top.f, upper] + [h[0] for h in heap])
    optimal = not heap and top.f <= upper
    if optimal:
        lower = top.f
    gap = 0.0 if optimal else ((top.f - lower) / abs(top.f) if top.f else float(lower < top.f))
    prof = pp.profile(top.choices)
    stats = {"memory_bytes": top.peak, "peak_step": int(np.argmax(prof)) if len(prof) else 0,
             "additive_memory_bytes": pp.additive().evaluate(top.choices)[1], "budget_bytes": pp.budget,
             "least_peak_bytes": least, "root_bound": root_bound, "gap": gap, "nodes": nodes,
             "open_nodes": len(heap), "surrogate_solves": solves, "cuts": cuts, "dp_solves": dp_solves,
             "work": budget.used,
             "beats_upper": top.f < upper,
             "status": ("optimal" if optimal else f"stopped at the {stopped}" if stopped
                        else "proven: nothing below upper")}
    return Solution(cost=top.f, assignment=top.choices, solve_seconds=time.perf_counter() - t0, solver="peak-bb",
                    optimal=optimal, bound=float(lower), stats=stats)


def solve_peak_bruteforce(pp: PeakProblem, max_combinations: int = 10**6) -> Solution:
    """Reference: every choice assignment enumerated with its backward profile (refuses above ``max_combinations``)."""
    from shardplan.search.constrained import cheapest_within, enumerate_choices

    t0 = time.perf_counter()
    digits, f = enumerate_choices(pp.problem, pp.base, pp.cost, max_combinations)
    if digits:
        parts = [np.stack([x[v][dv] for v, dv in enumerate(digits)], axis=-1)
                 for x in (pp.rest, pp.saved, pp.grad, pp.transient)]
        peak = backward_profile(*parts[:3], fixed=pp.fixed, transient=parts[3]).max(axis=-1)
    else:
        peak = np.full(len(f), pp.fixed)
    choices = cheapest_within(digits, f, peak, pp.budget)
    cost, pk = pp.evaluate(choices)
    return Solution(cost=cost, assignment=choices, solve_seconds=time.perf_counter() - t0, solver="bruteforce",
                    optimal=True, bound=cost, stats={"memory_bytes": pk, "combinations": len(f)})
