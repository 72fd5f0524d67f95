"""Pipeline schedules (closed forms vs event simulation) and the exact stage search vs brute force."""

from __future__ import annotations

import random

import pytest

from shardplan.errors import ShardplanError
from shardplan.pipeline.schedule import StageTimes, bubble_fraction, in_flight, makespan, simulate, step_time
from shardplan.pipeline.search import (PipelineSpace, StageCost, brute_force_pipeline, evaluate_pipeline,
                                       search_pipeline, submesh_sizes)


@pytest.mark.parametrize("schedule,S,m,v", [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 4, 3, 1),
                                            ("interleaved", 4, 8, 2), ("interleaved", 2, 4, 3), ("1f1b", 1, 5, 1)])
def test_uniform_closed_form_equals_simulation(schedule, S, m, v):
    st = [StageTimes(1.0, 2.0)] * S
    assert step_time(st, [0.0] * (S - 1), m, schedule, v) == pytest.approx(
        makespan(simulate(st, [0.0] * (S - 1), m, schedule, v)), rel=1e-12)


def test_textbook_bubbles():
    st = [StageTimes(1.0, 2.0)] * 4
    # 1F1B: (m + S - 1) t ; interleaved: (m + (S - 1)/v) t
    assert step_time(st, [0.0] * 3, 8, "1f1b") == 11 * 3.0
    assert step_time(st, [0.0] * 3, 8, "interleaved", 2) == (8 + 3 / 2) * 3.0
    assert bubble_fraction(st, [0.0] * 3, 8, "1f1b") == pytest.approx(3 / 11)
    # GPipe with unbalanced f/b pays max f + max b per micro-batch, 1F1B max(f + b)
    un = [StageTimes(2.0, 1.0), StageTimes(1.0, 2.0)]
    assert step_time(un, [0.0], 4, "gpipe") == 6.0 + 3 * 4.0
    assert step_time(un, [0.0], 4, "1f1b") == 6.0 + 3 * 3.0
    # a slow link is one more machine in the flow line
    assert step_time([StageTimes(1.0, 1.0)] * 2, [5.0], 3, "1f1b") == 4.0 + 10.0 + 2 * 5.0


def test_in_flight():
    assert in_flight(4, 8, "1f1b") == [4, 3, 2, 1]
    assert in_flight(4, 2, "1f1b") == [2, 2, 2, 1]
    assert in_flight(3, 6, "gpipe") == [6, 6, 6]
    # Megatron's interleaved warm-up: 2 (S - d - 1) + (v - 1) S + 1 chunks of 1/v each
    assert in_flight(4, 8, "interleaved", 2) == [(6 + 4 + 1) / 2, (4 + 4 + 1) / 2, (2 + 4 + 1) / 2, 5 / 2]


def test_simulation_respects_dependencies():
    st = [StageTimes(1.0, 2.5), StageTimes(0.5, 1.0), StageTimes(2.0, 3.0)]
    ev = simulate(st, [0.25, 0.5], 4, "1f1b")
    end = {(e.stage, e.kind, e.micro_batch): e.end for e in ev if e.kind in ("forward", "backward")}
    start = {(e.stage, e.kind, e.micro_batch): e.start for e in ev if e.kind in ("forward", "backward")}
    for j in range(4):
        assert start[(1, "forward", j)] >= end[(0, "forward", j)] + 0.25
        assert start[(2, "backward", j)] >= end[(2, "forward", j)]
        assert start[(0, "backward", j)] >= end[(1, "backward", j)] + 0.25
    for s in range(3):  # no stage runs two things at once, no link direction carries two transfers at once
        fwd = sorted((e.start, e.end) for e in ev if e.kind == "send" and e.stage == s
                     and any(x.kind == "forward" and x.stage == s and x.end == e.start for x in ev))
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(fwd, fwd[1:]))
        bars = sorted((e.start, e.end) for e in ev if e.stage == s and e.kind in ("forward", "backward"))
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(bars, bars[1:]))


def test_bad_schedule():
    with pytest.raises(ShardplanError, match="schedule"):
        step_time([StageTimes(1, 1)], [], 2, "zigzag")
    with pytest.raises(ShardplanError, match="multiple of stages"):
        simulate([StageTimes(1, 1)] * 3, [0, 0], 4, "interleaved", 2)


def test_submesh_sizes():
    assert submesh_sizes(32, 8) == (1, 2, 4, 8, 16, 24, 32)
    assert submesh_sizes(4, None) == (1, 2, 4)


def _random_instance(seed: int, U: int, p: int, ns: int):
    rng = random.Random(seed)
    unit_w = [rng.uniform(0.5, 2.0) for _ in range(U)]
    unit_mem = [rng.uniform(1.0, 3.0) for _ in range(U)]
    cut_bytes = [rng.uniform(0.0, 0.3) for _ in range(U + 1)]
    eff = {q: rng.uniform(0.6, 1.0) for q in range(1, p + 1)}

    def stage_fn(a, b, q, m):
        w = sum(unit_w[a:b])
        t = w / (q * eff[q]) / m + 0.01 * (b - a)
        if q == 3:
            return None  # a stage that cannot be costed is skipped
        # per-device transfer bytes depend on the stage's own layout (here: its size and extent)
        recv = cut_bytes[a] / m / q * (1 + (b - a) % 2)
        grad = cut_bytes[b] / m / q * (1 + (a + q) % 3)
        return StageCost(t / 3, 2 * t / 3, sum(unit_mem[a:b]) / q, w / m / q, None, recv, grad)

    def link_fn(u, q, q2, m, inter):
        return cut_bytes[u] / m / min(q, q2) * (4.0 if inter else 1.0)

    return stage_fn, link_fn


@pytest.mark.parametrize("seed", range(6))
def test_search_equals_brute_force(seed):
    U, p, ns = 5, 8, 4
    stage_fn, link_fn = _random_instance(seed, U, p, ns)
    budget = [None, 6.0, 3.5][seed % 3]
    space = PipelineSpace(U, p, ns, micro_batches=(1, 2, 4, 8), budget=budget, uniform=seed == 5)
    want = brute_force_pipeline(space, stage_fn, link_fn)
    got = search_pipeline(space, stage_fn, link_fn, schedules=("1f1b",))
    assert got.step_time == pytest.approx(want.step_time, rel=1e-12)
    # the answer is a real pipeline whose cost re-evaluates to the same number
    again = evaluate_pipeline([(s.first, s.end, s.devices) for s in got.stages], got.micro_batches, space,
                              stage_fn, link_fn)
    assert again is not None and again.step_time == pytest.approx(got.step_time, rel=1e-12)
    if budget is not None:
        assert all(s.memory <= budget for s in got.stages)


def test_one_stage_is_the_single_program():
    stage_fn, link_fn = _random_instance(0, 4, 4, 4)
    space = PipelineSpace(4, 4, 4, micro_batches=(1,), max_stages=1)
    got = search_pipeline(space, stage_fn, link_fn)
    assert got.num_stages == 1 and got.step_time == stage_fn(0, 4, 4, 1).time


def test_nothing_fits():
    stage_fn, link_fn = _random_instance(0, 4, 4, 4)
    with pytest.raises(ShardplanError, match="no pipeline fits"):
        search_pipeline(PipelineSpace(4, 4, 4, budget=0.1), stage_fn, link_fn)


def _exchange(nbytes, inter):
    return (0.02 if inter else 0.005) + nbytes * (4.0 if inter else 1.0)


@pytest.mark.parametrize("seed", range(6))
def test_exact_transfers_search_equals_brute_force(seed):
    """Transfers from the stages' own per-device bytes: the activation's into the receiving stage, the
    gradient's into the sending one, each a different time per direction."""
    U, p, ns = 5, 8, 4
    stage_fn, link_fn = _random_instance(seed + 10, U, p, ns)
    budget = [None, 6.0, 3.5][seed % 3]
    space = PipelineSpace(U, p, ns, micro_batches=(1, 2, 4), budget=budget, uniform=seed == 5)
    want = brute_force_pipeline(space, stage_fn, link_fn, exchange=_exchange)
    got = search_pipeline(space, stage_fn, link_fn, schedules=("1f1b",), exchange=_exchange)
    assert got.step_time == pytest.approx(want.step_time, rel=1e-12)
    again = evaluate_pipeline([(s.first, s.end, s.devices) for s in got.stages], got.micro_batches, space,
                              stage_fn, link_fn, _exchange)
    assert again is not None and again.step_time == pytest.approx(got.step_time, rel=1e-12)
    for i in range(got.num_stages - 1):
        prev, nxt = got.stages[i], got.stages[i + 1]
        inter = nxt.offset % ns == 0
        assert got.links[i] == _exchange(nxt.cost.recv_bytes, inter)
        assert got.back_links[i] == _exchange(prev.cost.grad_bytes, inter)


def test_separate_gradient_links_in_closed_form_and_simulation():
    uni = [StageTimes(1.0, 2.0)] * 3
    # sum t + sum c + sum c' + (m - 1) max(t, c, c')
    assert step_time(uni, [0.5, 0.5], 6, "1f1b", back=[0.25, 0.25]) == 3 * 3.0 + 1.0 + 0.5 + 5 * 3.0
    assert step_time(uni, [0.5, 0.5], 6, "1f1b", back=[4.0, 0.25]) == 3 * 3.0 + 1.0 + 4.25 + 5 * 4.0
    # GPipe: the forward phase's links are the activations', the backward phase's the gradients'
    assert step_time(uni, [0.5, 0.5], 6, "gpipe", back=[2.5, 0.25]) == 9.0 + 1.0 + 2.75 + 5 * (1.0 + 2.5)
    # the simulation sends gradients over their own times: equal times reproduce the symmetric run,
    # faster gradients never make the step longer, and each gradient send takes its link's time
    sym = simulate(uni, [0.5, 0.5], 6, "1f1b")
    assert makespan(simulate(uni, [0.5, 0.5], 6, "1f1b", back=[0.5, 0.5])) == makespan(sym)
    fast = simulate(uni, [0.5, 0.5], 6, "1f1b", back=[0.25, 0.125])
    assert makespan(fast) <= makespan(sym)
    grads = [e for e in fast if e.kind == "send" and any(
        x.kind == "backward" and x.stage == e.stage and x.end == e.start for x in fast)]
    assert sorted({round(e.end - e.start, 12) for e in grads}) == [0.125, 0.25]
    with pytest.raises(ShardplanError, match="backward ones"):
        step_time(uni, [0.5, 0.5], 6, "1f1b", back=[0.25])


@pytest.mark.parametrize("S,m,f,b,w", [(4, 8, 1.0, 1.0, 1.0), (4, 8, 1.0, 2.0, 1.0), (4, 8, 1.0, 1.0, 2.0),
                                       (2, 5, 1.0, 1.0, 1.0), (4, 8, 2.0, 1.0, 0.5), (8, 16, 1.0, 1.0, 1.0),
                                       (4, 4, 1.0, 1.0, 1.0), (1, 3, 1.0, 1.0, 1.0)])
def test_zb_h1_closed_form_equals_simulation(S, m, f, b, w):
    from shardplan.pipeline.schedule import zb_h1_uniform

    st = [StageTimes(f, b + w, weight_grad=w)] * S
    sim = makespan(simulate(st, [0.0] * (S - 1), m, "zb-h1"))
    assert sim == pytest.approx(zb_h1_uniform(f, b + w, w, S, m), rel=1e-12)
    assert step_time(st, [0.0] * (S - 1), m, "zb-h1") == sim
    # the paper's bubble: (S - 1)(F + B - W) against 1F1B's (S - 1)(F + B + W) when W <= F, B
    if w <= min(f, b):
        assert sim == m * (f + b + w) + (S - 1) * (f + b - w)
    assert sim <= step_time(st, [0.0] * (S - 1), m, "1f1b")


def test_zb_h1_without_weight_gradients_is_1f1b_and_keeps_order():
    st = [StageTimes(1.0, 2.0), StageTimes(1.5, 2.5), StageTimes(1.0, 2.0)]
    assert step_time(st, [0.25, 0.5], 6, "zb-h1") == makespan(simulate(st, [0.25, 0.5], 6, "1f1b"))
    split = [StageTimes(x.forward, x.backward, weight_grad=x.backward / 3) for x in st]
    ev = simulate(split, [0.25, 0.5], 6, "zb-h1")
    done = {(e.stage, e.kind, e.micro_batch): e for e in ev if e.kind in ("backward", "weight")}
    for (s, kind, j), e in done.items():
        if kind == "weight":  # W after its own B, and takes the stage's weight-gradient time
            assert e.start >= done[(s, "backward", j)].end
            assert e.end - e.start == pytest.approx(split[s].weight_grad)
    assert in_flight(4, 8, "zb-h1") == [4, 4, 4, 4] and in_flight(4, 2, "zb-h1") == [2, 2, 2, 2]
    with pytest.raises(ShardplanError, match="weight-gradient time"):
        simulate([StageTimes(1.0, 1.0, weight_grad=2.0)], [], 2, "zb-h1")


def test_zb_h1_search_option():
    def stage_fn(a, b, q, m):
        t = (b - a) / q / m
        return StageCost(t / 3, 2 * t / 3, 1.0, 0.5, None, 0.0, 0.0, t / 3)

    space = PipelineSpace(8, 8, 4, micro_batches=(8,), budget=None, uniform=True, sizes=(2, 4))
    one = search_pipeline(space, stage_fn, lambda *a: 0.0, schedules=("1f1b",))
    zb = search_pipeline(space, stage_fn, lambda *a: 0.0, schedules=("1f1b", "zb-h1"))
    assert zb.schedule == "zb-h1" and zb.step_time < one.step_time
    again = evaluate_pipeline([(s.first, s.end, s.devices) for s in zb.stages], 8, space, stage_fn,
                              lambda *a: 0.0, schedule="zb-h1")
    assert again.step_time == zb.step_time
    # in flight: min(S, m) on every stage, so a budget that only 1F1B's last stages meet rules it out
    tight = PipelineSpace(8, 8, 4, micro_batches=(8,), budget=1.0 + 0.5 * 2.5, uniform=True, sizes=(2, 4))
    assert search_pipeline(tight, stage_fn, lambda *a: 0.0, schedules=("zb-h1",)).num_stages == 2


@pytest.mark.parametrize("seed", range(4))
def test_floor_pipelines_close_their_stage_counts(seed):
    """The floor's own pipeline of each stage count is real (no memory-constrained stand-in without fit_fn): at
    m = 1 it is that count's optimum, so no bound is queued at all; at m > 1 only bounds below its largest time
    are, and the answer is still brute force's."""
    U, p, ns = 5, 8, 4
    stage_fn, link_fn = _random_instance(seed + 20, U, p, ns)
    space = PipelineSpace(U, p, ns, micro_batches=(1,))
    one = search_pipeline(space, stage_fn, link_fn, schedules=("1f1b",), exchange=_exchange)
    assert one.stats["candidates"] == 0
    assert one.step_time == pytest.approx(brute_force_pipeline(space, stage_fn, link_fn, exchange=_exchange).step_time,
                                          rel=1e-12)
    space = PipelineSpace(U, p, ns, micro_batches=(2, 4), budget=[None, 6.0][seed % 2])
    got = search_pipeline(space, stage_fn, link_fn, schedules=("1f1b",), exchange=_exchange)
    want = brute_force_pipeline(space, stage_fn, link_fn, exchange=_exchange)
    assert got.step_time == pytest.approx(want.step_time, rel=1e-12)
