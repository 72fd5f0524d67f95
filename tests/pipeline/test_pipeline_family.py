"""The proven lower bounds over the whole ZB-H1 and interleaved spaces (every cut), against brute force."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from shardplan import preset
from shardplan.models import get_model
from shardplan.pipeline import ModelStages, PipelineSpace
from shardplan.pipeline.search import (StageCost, _interleaved_family_bound, _interleaved_plan, _placeable,
                                       _unit_seconds, _zb_family_bound, brute_force_pipeline, evaluate_pipeline,
                                       interleaved_chunkings, search_pipeline)


def _instance(seed: int, U: int, p: int, eff_low: float = 0.6, with_lower: bool = False):
    """Superadditive stage costs (unit work over the sub-mesh plus a convex term in the extent) with a random
    F / B / W split per stage, a slower memory-constrained optimum (fit_fn) and per-cut links; ``with_lower``:
    also a per-unit lower bound below each unit's share of every stage (a random fraction of its work term)."""
    rng = random.Random(seed)
    unit_w = [rng.uniform(0.5, 2.0) for _ in range(U)]
    unit_mem = [rng.uniform(1.0, 3.0) for _ in range(U)]
    cut = [rng.uniform(0.0, 0.05) for _ in range(U + 1)]
    eff = {q: rng.uniform(eff_low, 1.0) for q in range(1, p + 1)}
    frac = [rng.uniform(0.3, 1.0) for _ in range(U)] if with_lower else []

    def stage_fn(a, b, q, m):
        t = sum(unit_w[a:b]) / (q * eff[q]) / m + 0.02 * (b - a) ** 2 / m
        r = random.Random(hash((seed, a, b, q)))
        f, w = r.uniform(0.1, 0.5), r.uniform(0.0, 0.5)
        return StageCost(f * t, (1 - f) * t, sum(unit_mem[a:b]) / q, sum(unit_w[a:b]) / m / q, None, 0.0, 0.0,
                         w * (1 - f) * t)

    def fit_fn(a, b, q, m, k, budget):
        c = stage_fn(a, b, q, m)
        if c.memory(k) > 3 * budget:
            return None
        s = 1.0 + 0.3 * (c.memory(k) / budget - 1.0)
        return dataclasses.replace(c, forward=c.forward * s, backward=c.backward * s, weight_grad=c.weight_grad * s,
                                   weight_bytes=min(c.weight_bytes, budget / 2),
                                   activation_bytes=min(c.activation_bytes, budget / (2 * k)))

    def link_fn(u, q, q2, m, inter):
        return cut[u] / m * (3.0 if inter else 1.0)

    def lower(a, b, q, m):
        return sum(frac[u] * unit_w[u] for u in range(a, b)) / (q * eff[q]) / m

    return (stage_fn, fit_fn, link_fn, lower) if with_lower else (stage_fn, fit_fn, link_fn)


def _tilings(space: PipelineSpace, n: int):
    """Every sequence of n placeable sub-mesh sizes tiling the machine (the uniform flag honoured)."""
    p = space.num_devices
    ns = p if space.node_size is None or space.node_size >= p else space.node_size
    for qs in itertools.product(space.allowed_sizes(), repeat=n):
        if sum(qs) != p or (space.uniform and len(set(qs)) > 1):
            continue
        offs = [sum(qs[:i]) for i in range(n)]
        if all(_placeable(o, q, p, ns) for o, q in zip(offs, qs)):
            yield qs


def _zb_pipelines(space, stage_fn, link_fn, fit_fn, exchange=None):
    """Every ZB-H1 pipeline of the space (S <= m, every cut and tiling) that fits, as (m, S, plan)."""
    U = space.num_units
    for m in space.micro_batches:
        for n in range(1, min(U, space.num_devices, m) + 1):
            for cuts in itertools.combinations(range(1, U), n - 1):
                b = (0, *cuts, U)
                for qs in _tilings(space, n):
                    segs = [(b[i], b[i + 1], qs[i]) for i in range(n)]
                    plan = evaluate_pipeline(segs, m, space, stage_fn, link_fn, exchange, schedule="zb-h1",
                                             fit_fn=fit_fn)
                    if plan is not None:
                        yield m, n, plan


def _brute_zb(space, stage_fn, link_fn, fit_fn, exchange=None):
    """Per (m, S), S <= m (ZB-H1's space): the least ZB-H1 step over every cut and every tiling."""
    out: dict = {}
    for m, n, plan in _zb_pipelines(space, stage_fn, link_fn, fit_fn, exchange):
        out[(m, n)] = min(out.get((m, n), float("inf")), plan.step_time)
    return out


def _brute_interleaved(space, stage_fn, link_fn, v, chunkings=None):
    """Per (m, S): the least interleaved step over every chunking into S v contiguous chunks (``chunkings(U, S
    v)``: only those), uniform sub-meshes, the chunks' time-optimal plans (candidates whose groups do not fit are
    out of the space without group_fit_fn)."""
    from shardplan.pipeline.schedule import in_flight

    U, p = space.num_units, space.num_devices
    out = {}
    for m in space.micro_batches:
        for n in range(2, p + 1):
            q = p // n
            if p % n or q not in space.allowed_sizes() or m % n or U < n * v:
                continue
            k = in_flight(n, m, "interleaved", v)
            every = [tuple((b[j], b[j + 1]) for j in range(n * v))
                     for b in ((0, *cuts, U) for cuts in itertools.combinations(range(1, U), n * v - 1))]
            for chunks in (every if chunkings is None else chunkings(U, n * v)):
                costs = [stage_fn(a, e, q, m) for a, e in chunks]
                if space.budget is not None and any(
                        sum(costs[j].weight_bytes for j in range(d, n * v, n))
                        + k[d] * sum(costs[j].activation_bytes for j in range(d, n * v, n)) > space.budget
                        for d in range(n)):
                    continue
                t = _interleaved_plan(costs, chunks, n, q, m, v, space, link_fn, None).step_time
                out[(m, n)] = min(out.get((m, n), float("inf")), t)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_family_bounds_vs_brute_force(seed):
    """The bounds over every cut (superadditivity) are below brute force; the search is exact over all three
    families: its ZB-H1 and interleaved family bounds are at most those families' brute-force optima and its
    answer is the least of the three."""
    U, p = 6, 8
    stage_fn, fit_fn, link_fn = _instance(seed, U, p)
    budget = [None, 4.0, 2.5][seed % 3]
    uniform = seed % 2 == 0
    space = PipelineSpace(U, p, 4, micro_batches=(2, 4, 8), budget=budget, uniform=uniform, interleave=(2,))
    zb = _brute_zb(space, stage_fn, link_fn, fit_fn)
    every = _brute_interleaved(space, stage_fn, link_fn, 2)
    inter = _brute_interleaved(space, stage_fn, link_fn, 2, interleaved_chunkings)
    for m in space.micro_batches:
        units = {q: _unit_seconds(space, stage_fn, m, q) for q in space.allowed_sizes()}
        for n in range(1, min(U, p) + 1):
            qs = [q for q in space.allowed_sizes() if not uniform or q * n == p]
            if (m, n) in zb:
                # bound <= the least step over every cut of this stage count (and not vacuous: within 2x)
                lb = _zb_family_bound({q: units[q] for q in qs}, p, n, m)
                assert lb <= zb[(m, n)] and lb > 0.3 * zb[(m, n)]
            if (m, n) in every:
                lb = _interleaved_family_bound(units[p // n], n, m, 2)
                assert lb <= every[(m, n)] and lb > 0.3 * every[(m, n)]
                assert every[(m, n)] <= inter.get((m, n), float("inf"))
    got = search_pipeline(space, stage_fn, link_fn, ("1f1b", "interleaved", "zb-h1"), fit_fn=fit_fn)
    fam = got.stats["family_lower_bounds"]
    one = brute_force_pipeline(space, stage_fn, link_fn, fit_fn=fit_fn).step_time
    want = min([one, *zb.values(), *inter.values()])
    assert got.step_time == pytest.approx(want, rel=1e-12)
    assert fam["1f1b"] <= one * (1 + 1e-12)
    assert fam["zb-h1"] <= min(zb.values()) * (1 + 1e-12)
    if inter:
        assert fam["interleaved"] <= min(inter.values()) * (1 + 1e-12)
    assert got.lower_bound == min(min(fam.values()), got.step_time)
    assert got.lower_bound <= want * (1 + 1e-12) and got.gap < 1e-9
    assert got.gap == pytest.approx((got.step_time - got.lower_bound) / got.step_time)


@pytest.mark.parametrize("seed", range(12))
def test_zb_h1_search_equals_brute_force(seed):
    """ZB-H1 alone, exact over every cut, sub-mesh sequence and m (S <= m), with memory-constrained stages solved
    lazily and, on odd seeds, exact transfers from the stages' own bytes; every plan's W, F and B differ."""
    U, p = 7, 8
    stage_fn, fit_fn, link_fn = _instance(seed + 100, U, p)
    exchange = (lambda nbytes, inter: (0.02 if inter else 0.005) + nbytes * (4.0 if inter else 1.0)) \
        if seed % 2 else None
    budget = [None, 4.0, 2.5][seed % 3]
    space = PipelineSpace(U, p, 4, micro_batches=(2, 4, 8), budget=budget, uniform=seed % 4 == 0)
    want = min(_brute_zb(space, stage_fn, link_fn, fit_fn, exchange).values())
    got = search_pipeline(space, stage_fn, link_fn, ("zb-h1",), fit_fn=fit_fn, exchange=exchange)
    assert got.schedule == "zb-h1" and got.micro_batches >= got.num_stages
    assert got.step_time == pytest.approx(want, rel=1e-12)
    assert got.lower_bound <= want * (1 + 1e-12) and got.gap < 1e-9
    again = evaluate_pipeline([(s.first, s.end, s.devices) for s in got.stages], got.micro_batches, space, stage_fn,
                              link_fn, exchange, schedule="zb-h1", fit_fn=fit_fn)
    assert again.step_time == pytest.approx(got.step_time, rel=1e-12)
    if fit_fn is not None and budget is not None:
        assert got.stats["zb_boxes"] > 0


def test_interleaved_chunkings():
    assert interleaved_chunkings(10, 4) == [((0, 2), (2, 5), (5, 8), (8, 10)), ((0, 3), (3, 5), (5, 7), (7, 10))]
    assert interleaved_chunkings(6, 4) == [((0, 2), (2, 3), (3, 4), (4, 6))]  # the two layouts agree
    assert interleaved_chunkings(5, 4) == [((0, 1), (1, 2), (2, 4), (4, 5))]
    assert interleaved_chunkings(3, 4) == []


def test_family_bounds_prune():
    """With many micro-batches the ZB-H1 and interleaved families of most stage counts have bounds past the
    best plan: they are not enumerated, and the answer is the same as without pruning (the lower bound says why)."""
    stage_fn, fit_fn, link_fn = _instance(3, 8, 8)
    space = PipelineSpace(8, 8, 4, micro_batches=(16,), budget=None, uniform=True, interleave=(2,))
    got = search_pipeline(space, stage_fn, link_fn, ("1f1b", "interleaved", "zb-h1"))
    assert got.stats.get("zb_pruned", 0) + got.stats.get("interleaved_pruned", 0) > 0
    assert got.lower_bound <= got.step_time


def test_stage_seconds_are_superadditive_on_a_real_model():
    """The family bounds rest on a stage's least seconds being at least the sum of its units' (restricting an
    optimum to a piece is a plan of the piece; dropped edges cost >= 0): checked on a small GPT, every segment."""
    machine = dataclasses.replace(preset("a100", 4), node_size=2, inter_bandwidth=1e9)
    st = ModelStages(lambda b: get_model("gpt", b, layers=3, d_model=64, heads=2, seq=16, vocab=256), 8, machine,
                     {"cutoff": 1})
    U = st.num_units
    for q in (1, 2, 4):
        for m in (1, 2):
            unit = [st.stage_cost(u, u + 1, q, m) for u in range(U)]
            for a in range(U):
                for b in range(a + 1, U + 1):
                    c = st.stage_cost(a, b, q, m)
                    if c is not None and all(x is not None for x in unit[a:b]):
                        assert c.proven >= sum(x.proven for x in unit[a:b]) * (1 - 1e-9)


def test_zb_h1_search_when_a_fit_is_below_its_stand_in():
    """A fit_fn that answers below the time-optimal stage breaks the callbacks' contract (a memory-constrained
    optimum only adds cost). When the search sees such an answer it drops the stand-ins and the family bounds and
    searches every stage count again eagerly: here it sees one, and the answer equals brute force."""
    U, p = 6, 8
    stage_fn, fit_fn, link_fn = _instance(7, U, p)

    def faster(a, b, q, m, k, budget):
        c = fit_fn(a, b, q, m, k, budget)
        return None if c is None else dataclasses.replace(c, forward=c.forward * 0.5, backward=c.backward * 0.5,
                                                          weight_grad=c.weight_grad * 0.5)

    space = PipelineSpace(U, p, 4, micro_batches=(4,), budget=2.5)
    want = min(_brute_zb(space, stage_fn, link_fn, faster).values())
    got = search_pipeline(space, stage_fn, link_fn, ("zb-h1",), fit_fn=faster)
    assert got.stats.get("lazy_abandoned")
    assert got.step_time == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_one_f_one_b_family_bound_vs_brute_force(seed):
    """1F1B's bound from the unit seconds alone (one stage, or the least unit sum plus (m - 1) t_lo) is at most
    the brute-force 1F1B optimum at each m over every cut and tiling, with and without node granules, and not
    vacuous."""
    from shardplan.pipeline.search import _one_f_one_b_family_bound

    U, p = 6, 8
    stage_fn, fit_fn, link_fn = _instance(seed + 40, U, p)
    budget = [None, 4.0, 2.5][seed % 3]
    for m in (1, 2, 4, 8):
        space = PipelineSpace(U, p, 4, micro_batches=(m,), budget=budget, uniform=seed % 2 == 1)
        want = brute_force_pipeline(space, stage_fn, link_fn, fit_fn=fit_fn).step_time
        units = {q: _unit_seconds(space, stage_fn, m, q) for q in space.allowed_sizes()}
        for granule in (1, 4):
            lb = _one_f_one_b_family_bound(units, p, m, granule)
            assert 0.3 * want < lb <= want * (1 + 1e-12)
        got = search_pipeline(space, stage_fn, link_fn, ("1f1b",), fit_fn=fit_fn)
        assert got.step_time == pytest.approx(want, rel=1e-12)


def test_one_f_one_b_closed_by_its_family_bound():
    """With ZB-H1 searched first at the same m (its unit seconds at hand), a 1F1B part whose family bound reaches
    the best plan is closed without its DP; the answer is brute force's best of the two families."""
    stage_fn, _, link_fn = _instance(1, 6, 8)
    space = PipelineSpace(6, 8, 4, micro_batches=(2, 4, 8, 16), budget=None)
    got = search_pipeline(space, stage_fn, link_fn, ("1f1b", "zb-h1"))
    assert got.stats.get("one_f_one_b_closed_by_units", 0) > 0
    zb = min(_brute_zb(space, stage_fn, link_fn, None).values())
    one = brute_force_pipeline(space, stage_fn, link_fn).step_time
    assert got.step_time == pytest.approx(min(zb, one), rel=1e-12)
    assert set(got.stats["one_f_one_b_family_bounds"]) == {"2", "4", "8", "16"}  # by m, as JSON keys
    for m, fam in got.stats["one_f_one_b_family_bounds"].items():
        want = brute_force_pipeline(PipelineSpace(6, 8, 4, micro_batches=(int(m),)), stage_fn, link_fn).step_time
        assert fam <= want * (1 + 1e-12)


def test_step_floor_bounds_every_stage_and_the_pipeline_on_a_real_model():
    """ModelStages.step_floor: every stage's seconds on q devices are at least its device-seconds floor over q
    (its passes' FLOPs at the achievable rate or its plain tensors' bytes at the HBM bandwidth), so every
    pipeline's step is at least m x the model's floor over p devices; checked on every segment of a small GPT
    (with and without an HBM bandwidth) and on the searched optimum."""
    from shardplan.pipeline.api import pipeline_solve

    def build(b):
        return get_model("gpt", b, layers=3, d_model=64, heads=2, seq=16, vocab=256)

    base = dataclasses.replace(preset("a100", 4), node_size=2, inter_bandwidth=1e9)
    for machine in (base, dataclasses.replace(base, hbm_bandwidth=None)):
        st = ModelStages(build, 8, machine, {"cutoff": 1})
        U = st.num_units
        flops_only = ModelStages(build, 8, dataclasses.replace(machine, hbm_bandwidth=None), {"cutoff": 1})
        for q in (1, 2, 4):
            for m in (1, 2):
                for a in range(U):
                    for b in range(a + 1, U + 1):
                        c = st.stage_cost(a, b, q, m)
                        floor = st.device_seconds(m, a, b) / q
                        if c is not None:
                            assert c.time >= floor * (1 - 1e-12) > 0
                            assert floor >= flops_only.device_seconds(m, a, b) / q
        for m in (1, 2, 4):
            res = pipeline_solve(build, 8, machine, micro_batches=(m,), schedules=("1f1b", "zb-h1"))
            assert res.step_time >= st.step_floor(m) * (1 - 1e-12)
            assert st.step_floor(m) == pytest.approx(m * st.device_seconds(m) / 4, rel=1e-12)
    # where memory bandwidth binds (the small model's elementwise operators), the roofline raises the floor
    assert ModelStages(build, 8, base, {}).step_floor(1) > ModelStages(
        build, 8, dataclasses.replace(base, hbm_bandwidth=None), {}).step_floor(1)
