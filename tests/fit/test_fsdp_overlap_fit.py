"""FSDP's overlap in the fit search: ZeRO-3's parameter gathers prefetched under the operator's forward and
backward passes, and the gradients' reduce-scatter under the backward (``Machine.overlap_grad``, the
runtimes' behaviour: DDP and FSDP launch each bucket's collective while the backward goes on).

Two dense layers on 4 devices, every operator data-parallel (its batch split 4 ways: the only layout offered,
so the memory choices alone decide), ZeRO stages 0-3 and recomputation offered. With the overlap and long
products the search takes ZeRO-3 where it costs nothing (the plan under the all-ZeRO-3 budget is the
unconstrained optimum); without the overlap, or with products too short to hide the gathers, the same budget
costs time. Every answer is brute force's (``_bruteforce`` of test_precision_offload: every combination of
the unpruned choices within the budget).
"""

from __future__ import annotations

import numpy as np
import pytest

from shardplan import ops
from shardplan.cost import build_tables
from shardplan.cost.memory import choice_table
from shardplan.fit import FitOptions, solve_fit
from shardplan.ir import Graph, GraphBuilder
from shardplan.layout import Layout
from shardplan.machine import Machine

from test_precision_offload import _bruteforce  # noqa: E402  (tests/fit is on sys.path when pytest runs it)

P = 4
OPTS = FitOptions(stages=(0, 1, 2, 3), micro_batches=(1,))


def two_layers(rows: int) -> Graph:
    """x[rows, 256] -> fc1 (256 -> 256) -> fc2 (256 -> 256); x needs no gradient, so fc1's backward is its
    weight gradient alone (one pass) and fc2's two passes."""
    b = GraphBuilder("two")
    x = b.input("x", (rows, 256), needs_grad=False)
    h = b.add(ops.dense("fc1", x, 256))
    b.add(ops.dense("fc2", h, 256))
    return b.build()


def machine(overlap: bool) -> Machine:
    return Machine(P, peak_flops=1e12, bandwidth=1e9, latency=1e-6, dtype_bytes=2, overlap_grad=overlap)


def data_parallel(op) -> list[Layout]:
    return [Layout.flat(op.dim_names, tuple(P if d == "b" else 1 for d in op.dim_names), P)]


def tables(rows: int, overlap: bool):
    g = two_layers(rows)
    return g, build_tables(g, machine(overlap), candidates=data_parallel)


def zero3_row(t, op_index: int) -> int:
    """The choice-table row of operator ``op_index`` at ZeRO-3 without recomputation."""
    op, lay = t.graph.operators[op_index], t.arrays[op_index]
    ct = choice_table(op, lay, None, t.machine, 1, OPTS.stages, OPTS.recompute, 2.0, prune=False, rules=OPTS.rules)
    j = np.flatnonzero((ct.stage == 3) & ~ct.recompute)
    assert len(j) == 1
    return ct, int(j[0])


def zero3_budget(t) -> float:
    """Bytes of the plan with every operator at ZeRO-3 and nothing recomputed (brute force's memory: the sum)."""
    return float(sum(ct.bytes[j] for ct, j in (zero3_row(t, i) for i in range(len(t.graph.operators)))))


@pytest.mark.parametrize("rows, overlap", [(4096, True), (4096, False), (1024, True)])
def test_the_exact_fit_matches_brute_force_with_and_without_the_overlap(rows, overlap):
    g, t = tables(rows, overlap)
    free = solve_fit(g, t.machine, budget=1e12, tables=t, options=OPTS)
    assert free.cost == pytest.approx(_bruteforce(t, OPTS, 1e12, np.inf), rel=1e-12)
    for frac in (0.8, 0.6):
        budget = frac * free.memory["peak_bytes"]
        want = _bruteforce(t, OPTS, budget, np.inf)
        plan = solve_fit(g, t.machine, budget=budget, tables=t, options=OPTS)
        assert plan.cost == pytest.approx(want, rel=1e-12) and plan.memory["peak_bytes"] <= budget


def test_zero3_gathers_hide_under_long_products_by_hand():
    """fc2 at 4096 rows: its forward (2 x 1024 x 256 x 256 FLOP = 134.2 us) and backward (268.4 us) hide the
    forward gather, the backward gather and the reduce-scatter (each a ring pass among 4: 3/4 x 128 KiB at
    1 GB/s + 3 us = 101.3 us), so its ZeRO-3 row exposes nothing; without the overlap it pays all three."""
    ring = 0.75 * 256 * 256 * 2 / 1e9 + 3 * 1e-6
    for overlap, exposed in ((True, 0.0), (False, 3 * ring)):
        g, t = tables(4096, overlap)
        ct, j = zero3_row(t, g.index["fc2"])
        assert ct.parts["weight_sync"][j] == pytest.approx(exposed, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("rows, overlap, free", [(4096, True, True), (4096, False, False), (1024, True, False)])
def test_the_search_takes_zero3_free_of_time_only_where_the_passes_hide_its_collectives(rows, overlap, free):
    """Under the all-ZeRO-3 budget: with the overlap and long products the answer shards both operators'
    state at no cost (the unconstrained optimum's step); without the overlap, or with products a quarter as
    long, meeting that budget costs time (recomputation or exposed gathers), and the search says so."""
    g, t = tables(rows, overlap)
    budget = zero3_budget(t)
    loose = solve_fit(g, t.machine, budget=1e12, tables=t, options=OPTS)
    tight = solve_fit(g, t.machine, budget=budget, tables=t, options=OPTS)
    assert tight.memory["peak_bytes"] <= budget
    assert tight.cost == pytest.approx(_bruteforce(t, OPTS, budget, np.inf), rel=1e-12)
    if free:
        assert tight.cost == pytest.approx(loose.cost, rel=1e-12)
        assert [tight.memory_choices.stage(i) for i in range(2)] == [3, 3]
        assert not any(tight.memory_choices.recompute(i) for i in range(2))
    else:
        assert tight.cost > loose.cost * (1 + 1e-6)
