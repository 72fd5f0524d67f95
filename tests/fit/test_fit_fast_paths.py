"""The one program's shortcuts against the code paths they replace: the same numbers and the same plans.

Each shortcut skips work whose result is known (a value met before, an idempotent step); the previous path
is kept here as the reference (``_lattice_budget_plain``: the per-vertex loop of before) or put back by
monkeypatching (``fit._per_table`` as a plain comprehension, ``bounds.forest_value`` as the two-pass
pass's value)."""

from __future__ import annotations

from fractions import Fraction
from math import floor, gcd

import numpy as np
import pytest

from shardplan import fit
from shardplan.cost import build_tables
from shardplan.fit import FitOptions, fit_problem, solve_fit
from shardplan.machine import Machine
from shardplan.search import bounds, constrained
from shardplan.search.constrained import MemoryProblem, _lattice_budget
from shardplan.search.problem import Problem

B = 1e9  # bytes/s
F = 1e12  # FLOP/s


def _lattice_budget_plain(mp: MemoryProblem, allowed) -> float:
    """The lattice budget as computed before: every vertex's steps folded into the gcd, one by one."""
    budget = mp.budget
    least = Fraction(mp.fixed)
    num, den = 0, 1
    seen: dict = {}
    for m, ok in zip(mp.memory, allowed):
        key = (id(m), np.packbits(ok).tobytes())
        if key not in seen:
            vals = np.unique(m[ok])
            lo = Fraction(float(vals[0]))
            seen[key] = (lo, [Fraction(float(x)) - lo for x in vals[1:]])
        lo, diffs = seen[key]
        least += lo
        for d in diffs:
            a, b = d.numerator, d.denominator
            num, den = gcd(num * b, a * den), den * b
            g = gcd(num, den)
            num, den = num // g, den // g
        if num and Fraction(num, den) < Fraction(budget) / 10**15:
            return budget
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


def _chain(rows: list[np.ndarray], budget: float, fixed: float) -> MemoryProblem:
    n = len(rows)
    p = Problem(names=tuple(f"v{i}" for i in range(n)), configs=tuple(((0,),) for _ in range(n)),
                vertex_cost=tuple(np.zeros(1) for _ in range(n)), edges=tuple((i, i + 1) for i in range(n - 1)),
                edge_cost=tuple(np.zeros((1, 1)) for _ in range(n - 1)))
    base = tuple(np.zeros(len(r), dtype=np.int64) for r in rows)
    return MemoryProblem(p, base, tuple(np.zeros(len(r)) for r in rows), tuple(rows), budget=budget, fixed=fixed)


@pytest.mark.parametrize("seed", range(12))
def test_lattice_budget_is_the_per_vertex_loop_bit_for_bit(seed):
    """Shared rows (identical operators) and their own rows, allowed subsets, steps on a lattice and off it,
    and budgets below, within and far above the least memory: the same float as the loop of before."""
    rng = np.random.default_rng(seed)
    unit = float(rng.choice([1.0, 0.25, 3.0 / 7.0, 1e-3, 2.0**-40]))
    distinct = [unit * rng.integers(0, 50, size=int(rng.integers(1, 6))).astype(float) for _ in range(4)]
    if seed % 3 == 0:
        distinct.append(rng.uniform(0.0, 10.0, size=3))  # off the lattice: steps of no common size
    rows = [distinct[int(rng.integers(len(distinct)))] for _ in range(int(rng.integers(1, 30)))]
    least = sum(float(r.min()) for r in rows)
    for budget in (least * 0.5 + 0.1, least + unit * 7.5 + 0.3, least * 3 + 11.0, 1e18):
        mp = _chain(rows, budget, fixed=float(rng.uniform(0, 2)))
        masks = [np.ones(len(r), dtype=bool) for r in rows]
        assert _lattice_budget(mp, masks) == _lattice_budget_plain(mp, masks)
        cut = {id(r): rng.random(len(r)) < 0.6 for r in distinct}  # identical vertices, identical subsets
        masks = [cut[id(r)] if cut[id(r)].any() else np.ones(len(r), dtype=bool) for r in rows]
        assert _lattice_budget(mp, masks) == _lattice_budget_plain(mp, masks)
        masks = [rng.random(len(r)) < 0.7 for r in rows]  # every vertex its own subset
        masks = [k if k.any() else np.ones(len(k), dtype=bool) for k in masks]
        assert _lattice_budget(mp, masks) == _lattice_budget_plain(mp, masks)


def _same_plan(a, b) -> None:
    assert a.cost == b.cost and a.assignment == b.assignment
    assert a.solution.bound == b.solution.bound and a.solution.optimal == b.solution.optimal
    assert a.memory_choices.micro_batches == b.memory_choices.micro_batches
    assert a.memory_choices.choices == b.memory_choices.choices
    assert a.solution.stats["per_micro_batches"] == b.solution.stats["per_micro_batches"] or all(
        (x["micro_batches"], x.get("cost"), x.get("bound")) == (y["micro_batches"], y.get("cost"), y.get("bound"))
        for x, y in zip(a.solution.stats["per_micro_batches"], b.solution.stats["per_micro_batches"]))


def _cases():
    from shardplan.models import get_model

    yield get_model("gpt", batch=8, layers=1, d_model=64, heads=2, seq=32, vocab=256), 4, (1, 2, 4, 8)
    yield get_model("gpt", batch=16, layers=3, d_model=128, heads=4, seq=32, vocab=512), 8, (1, 2, 4)
    yield get_model("gpt", batch=8, layers=2, d_model=64, heads=2, seq=64, vocab=256), 16, (1, 2, 8)


@pytest.mark.parametrize("case", range(3))
def test_the_one_program_gives_the_plan_of_the_previous_code_path(case, monkeypatch):
    """Several small models, meshes and budgets: the plan (layouts and memory choices), step time, bound and
    proof equal those of the previous code path (every table's values computed per operator, the lattice
    budget by the per-vertex loop, the count bounds' forest value from the two-pass forest bounds)."""
    g, p, counts = list(_cases())[case]
    m = Machine(p, peak_flops=F, bandwidth=100 * B, latency=1e-6, memory_bytes=1e12)
    tables = build_tables(g, m, orders="row-major")
    free = solve_fit(g, m, tables=tables, options=FitOptions(micro_batches=(1,)))
    opts = FitOptions(micro_batches=counts)
    for frac in (0.9, 0.5, 0.3):
        budget = frac * free.memory["peak_bytes"]
        try:
            fast = solve_fit(g, m, budget=budget, tables=tables, options=opts)
        except Exception as e:  # noqa: BLE001 - the previous path must fail the same way
            with monkeypatch.context() as mpatch:
                mpatch.setattr(fit, "_per_table", lambda cts, f: [f(t) for t in cts])
                mpatch.setattr(constrained, "_lattice_budget", _lattice_budget_plain)
                mpatch.setattr(bounds, "forest_value", lambda h, res, forest: bounds.forest_bounds(h, res, forest)[2])
                with pytest.raises(type(e), match="no plan"):
                    solve_fit(g, m, budget=budget, tables=tables, options=opts)
            continue
        with monkeypatch.context() as mpatch:
            mpatch.setattr(fit, "_per_table", lambda cts, f: [f(t) for t in cts])
            mpatch.setattr(constrained, "_lattice_budget", _lattice_budget_plain)
            mpatch.setattr(bounds, "forest_value", lambda h, res, forest: bounds.forest_bounds(h, res, forest)[2])
            slow = solve_fit(g, m, budget=budget, tables=tables, options=opts)
        _same_plan(fast, slow)


def test_fit_problem_is_the_per_operator_pruning():
    """The additive problem's choices per vertex are those kept by pruning each operator's table alone."""
    from shardplan.models import get_model

    g = get_model("gpt", batch=16, layers=3, d_model=128, heads=4, seq=32, vocab=512)
    m = Machine(8, peak_flops=F, bandwidth=100 * B, latency=1e-6, memory_bytes=1e12)
    tables = build_tables(g, m, orders="row-major")
    opts = FitOptions()
    cache: dict = {}
    full = fit._choice_tables(tables, 2, opts, cache, peak=False)
    least = opts.reserve_bytes + float(sum(t.bytes.min() for t in full))
    budget = least * 1.3
    mp, cts = fit_problem(tables, budget, 2, opts, cache)
    for t, got, base, sec, mem in zip(full, cts, mp.base, mp.cost, mp.memory):
        keep = np.flatnonzero(t.bytes + (least - t.bytes.min()) <= budget)
        assert np.array_equal(got.base, t.base[keep]) and np.array_equal(base, t.base[keep])
        assert sec.tobytes() == t.seconds[keep].tobytes() and mem.tobytes() == t.bytes[keep].tobytes()
    assert len({id(x) for x in mp.memory}) < len(mp.memory)  # identical layers still share their rows
