"""A Markov-chain Monte Carlo search in the manner of FlexFlow.

FlexFlow (Jia, Zaharia, Aiken, "Beyond Data and Model Parallelism for Deep
Neural Networks", SysML 2019) searches strategies with the Metropolis-Hastings
algorithm: from the current strategy ``S`` it proposes ``S*`` that differs in
the configuration of one random operator and accepts it with probability

    P(accept) = min(1, exp(-beta * (F(S*) - F(S)))).

The proposal (uniform random vertex, uniform random *other* configuration)
is symmetric, so the chain samples ``exp(-beta F)``; the best strategy seen
is returned. FlexFlow fixes ``beta`` in absolute time units (its simulator's
``search_alpha``); here it is set relative to the starting point,

    beta = m / (temperature * F(init)),

where ``m`` is the number of vertices with more than one configuration:
``temperature`` is the worsening, as a fraction of the mean per-vertex share
``F(init) / m`` of the initial cost, that is accepted with probability
``1/e``. Scaling by the per-vertex share (not by ``F(init)`` itself) keeps a
single move's acceptance independent of the graph's size. The default 0.1
was the best of {0, 0.01, 0.02, 0.04, 0.1, 0.2} on one random 200-vertex
problem with K = 25..50, two seeds (0.04 to 0.1 about equal; 0.2 wanders);
``temperature=0`` gives a greedy descent (only moves with ``delta <= 0``).

Each proposal costs O(deg(v)): ``delta = c_v[new] - c_v[old] + sum over
incident edges (M[new, a_o] - M[old, a_o])``, with parallel edges merged and
every matrix pre-oriented so that rows are the moving vertex's configuration.

Stopping. The PaSE paper ran FlexFlow until 250,000 proposals or until no
improvement for half of the elapsed search time. Wall time is not
reproducible, so the rule is applied to proposal counts instead: stop after
proposal ``i`` when ``i - i_best > i_best`` (the proposals since the last
improvement exceed those before it), but never before ``min_proposals``.
An optional ``time_limit`` (checked every few thousand proposals) also
stops the search; with it the result may depend on the machine's speed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import numpy as np

from shardplan.errors import ShardplanError
from shardplan.search.pairs import merge_pairs
from shardplan.search.problem import Problem, Solution

__all__ = ["solve_mcmc"]

DEFAULT_TEMPERATURE = 0.1
_CHUNK = 8192  # random numbers drawn per batch; also the time_limit check period
_IMPROVE_RTOL = 1e-12  # an improvement must beat the best by this times F(init)

Neighbours = list[list[tuple[int, list[list[float]]]]]


def oriented_neighbours(problem: Problem) -> Neighbours:
    """Per vertex ``v``, a list of ``(other, rows)`` with ``rows[k_v][k_other]``.

    Parallel edges (either direction) between the same pair are summed, so
    every neighbour appears once. Matrices become nested Python lists of
    floats, which index faster than numpy arrays in a scalar loop.
    """
    nbrs: Neighbours = [[] for _ in range(problem.num_vertices)]
    for (u, v), mat in merge_pairs(problem).items():
        nbrs[u].append((v, mat.tolist()))
        nbrs[v].append((u, mat.T.tolist()))
    return nbrs


def default_init(problem: Problem) -> tuple[int, ...]:
    """Each vertex's cheapest own configuration (edges ignored)."""
    return tuple(int(np.argmin(c)) for c in problem.vertex_cost)


def solve_mcmc(
    problem: Problem,
    init: Sequence[int] | None = None,
    seed: int = 0,
    max_proposals: int = 250_000,
    time_limit: float | None = None,
    temperature: float | None = None,
    min_proposals: int | None = None,
) -> Solution:
    """Metropolis search from ``init``; returns the best assignment seen.

    Parameters:
        problem: the problem.
        init: starting assignment (e.g. data parallelism or an expert
            strategy); default :func:`default_init`.
        seed: seed of the ``numpy.random.Generator``; same seed, same result
            (unless ``time_limit`` stops the run).
        max_proposals: hard cap on proposals (FlexFlow in the PaSE paper: 250,000).
        time_limit: optional wall-clock cap in seconds.
        temperature: worsening accepted with probability 1/e, as a fraction
            of ``F(init) / m`` (``m`` = vertices with K > 1);
            ``beta = m / (temperature * F(init))``. Default 0.1; 0 is greedy.
        min_proposals: no stop by the no-improvement rule before this many
            proposals; default ``max(1000, 20 * number of vertices with K > 1)``.

    Returns:
        A :class:`Solution` with ``solver="mcmc"``, ``optimal=False``,
        ``bound=None``, ``cost = problem.evaluate(best assignment)`` and stats
        ``proposals``, ``accepted``, ``iterations_to_best`` (proposal index of
        the last improvement, 0 if none), ``beta``, ``temperature``,
        ``init_cost``, ``stop`` (the reason).
    """
    start = time.perf_counter()
    temperature = DEFAULT_TEMPERATURE if temperature is None else float(temperature)
    if temperature < 0 or not math.isfinite(temperature):
        raise ShardplanError(f"temperature must be finite and >= 0, got {temperature!r}")
    if max_proposals < 0:
        raise ShardplanError(f"max_proposals must be >= 0, got {max_proposals!r}")
    a = list(default_init(problem) if init is None else (int(k) for k in init))
    init_cost = problem.evaluate(a)  # also validates init
    sizes = problem.sizes
    movable = [v for v in range(problem.num_vertices) if sizes[v] > 1]
    if min_proposals is None:
        min_proposals = max(1000, 20 * len(movable))
    beta = math.inf if temperature == 0 or init_cost == 0 else len(movable) / (temperature * init_cost)
    stats = {"beta": beta, "temperature": temperature, "init_cost": init_cost}
    if not movable or init_cost == 0 or max_proposals == 0:
        # Nothing to move, or F(init) = 0 is already minimal (costs are >= 0).
        stats.update(proposals=0, accepted=0, iterations_to_best=0, stop="trivial")
        return Solution(init_cost, tuple(a), time.perf_counter() - start, "mcmc", False, None, stats)

    best, proposals, accepted, i_best, stop = _metropolis(
        a,
        movable,
        [c.tolist() for c in problem.vertex_cost],
        oriented_neighbours(problem),
        list(sizes),
        init_cost,
        beta,
        np.random.default_rng(seed),
        max_proposals,
        min_proposals,
        None if time_limit is None else start + float(time_limit),
    )
    stats.update(proposals=proposals, accepted=accepted, iterations_to_best=i_best, stop=stop)
    cost = problem.evaluate(best)
    return Solution(cost, tuple(best), time.perf_counter() - start, "mcmc", False, None, stats)


def _metropolis(
    a: list[int],
    movable: list[int],
    vcost: list[list[float]],
    nbrs: Neighbours,
    sizes: list[int],
    init_cost: float,
    beta: float,
    rng: np.random.Generator,
    max_proposals: int,
    min_proposals: int,
    deadline: float | None,
) -> tuple[list[int], int, int, int, str]:
    """The chain itself; mutates ``a``. Returns (best, proposals, accepted, i_best, stop reason).

    The best assignment is copied lazily: only when an accepted move leaves
    a state that equals the best cost, so a run of improving moves costs no copies.
    """
    cur = best_cost = init_cost
    tol = _IMPROVE_RTOL * init_cost
    best: list[int] = list(a)
    at_best = True
    i_best = 0
    accepted = 0
    stop_at = min(max(min_proposals, 0), max_proposals)  # stop after proposal stop_at
    i = 0
    exp = math.exp
    nm = len(movable)
    while True:
        vs = rng.integers(0, nm, size=_CHUNK).tolist()
        us = rng.random(_CHUNK).tolist()
        rs = rng.random(_CHUNK).tolist()
        for j in range(_CHUNK):
            i += 1
            v = movable[vs[j]]
            old = a[v]
            new = int(us[j] * (sizes[v] - 1))
            if new >= old:
                new += 1
            cv = vcost[v]
            delta = cv[new] - cv[old]
            for o, rows in nbrs[v]:
                ao = a[o]
                delta += rows[new][ao] - rows[old][ao]
            if delta <= 0.0 or rs[j] < exp(-beta * delta):
                accepted += 1
                cur += delta
                if cur < best_cost - tol:
                    best_cost = cur
                    at_best = True
                    i_best = i
                    stop_at = min(max(min_proposals, 2 * i + 1), max_proposals)
                elif at_best:
                    best = list(a)
                    at_best = False
                a[v] = new
            if i >= stop_at:
                if at_best:
                    best = list(a)
                return best, i, accepted, i_best, ("max_proposals" if i >= max_proposals else "no_improvement")
        if deadline is not None and time.perf_counter() >= deadline:
            if at_best:
                best = list(a)
            return best, i, accepted, i_best, "time_limit"
