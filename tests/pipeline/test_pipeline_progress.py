"""Progress lines, Ctrl-C (a KeyboardInterrupt raised after N ticks, deterministically) returning the best plan
so far with its proven gap, and the stage DP's memo shared across stage counts."""

from __future__ import annotations

import io
import math
import random

import pytest

from shardplan.pipeline.progress import Progress, terminal_writer
from shardplan.pipeline.search import (PipelineSpace, _stage_dp, brute_force_pipeline, evaluate_pipeline,
                                       search_pipeline)

from tests.pipeline.test_pipeline import _exchange, _random_instance


def _interrupt_after(n: int):
    def on_tick(ticks: int) -> None:
        if ticks >= n:
            raise KeyboardInterrupt
    return on_tick


def _space(budget=None):
    return PipelineSpace(6, 8, 4, micro_batches=(1, 2, 4, 8), budget=budget)


def test_progress_reports_every_part():
    stage_fn, link_fn = _random_instance(3, 6, 8, 4)
    lines: list[str] = []
    progress = Progress(lines.append, interval=0.0)
    got = search_pipeline(_space(), stage_fn, link_fn, schedules=("1f1b", "zb-h1"), exchange=_exchange,
                          progress=progress)
    assert got.stats["interrupted"] is False
    assert progress.total == 8 and progress.done == 8  # 4 micro-batch counts x 2 families
    assert got.stats["parts_done"] == got.stats["parts_total"] == 8
    assert progress.incumbent == pytest.approx(got.step_time, rel=1e-12)
    assert any("pipelines zb-h1 m=1" in x for x in lines) and any("pipelines 1f1b m=8" in x for x in lines)
    assert "8/8 parts done" in lines[-1]
    assert f"best {got.step_time:.4g} s" in lines[-1]
    # the proven bound of the whole space on every line once the search states it (here: 0 until a part ends,
    # with no step floor), the final one the answer's
    assert all("proven bound" in x for x in lines)
    assert f"proven bound {got.lower_bound:.4g} s" in lines[-1]


def test_progress_waits_for_its_interval():
    now = [0.0]
    lines: list[str] = []
    progress = Progress(lines.append, interval=2.0, clock=lambda: now[0])
    progress.total = 3
    progress.part("phase a")
    now[0] = 1.0
    progress.tick()
    assert not lines  # nothing within the first 2 s: a short search prints nothing
    now[0] = 2.5
    progress.tick()
    now[0] = 4.0
    progress.tick()
    assert len(lines) == 1 and "phase a | 0/3 parts done" in lines[0]  # the next line is due at 4.5
    now[0] = 4.5
    progress.finished(4.0)
    assert len(lines) == 2 and "1/3 parts done" in lines[1] and "bound of finished parts 4 s" in lines[1]


def test_a_heard_step_is_shown_not_pruned_with():
    progress = Progress()
    progress.hear(7.0)
    progress.hear(9.0)  # a worse one changes nothing
    assert progress.heard == 7.0 and progress.incumbent == math.inf and progress.plan is None
    assert "best 7 s" in progress.line()
    progress.improved(8.0, "plan")
    assert "best 7 s" in progress.line()  # the least of both is shown
    progress.improved(6.0, "better")
    assert "best 6 s" in progress.line() and progress.incumbent == 6.0


def _floor_of(seed: int, U: int, p: int):
    """The random instance's step floor: a stage's seconds are w / (q eff) / m + 0.01 (b - a) >= w / (q m) (eff <= 1,
    tests.pipeline.test_pipeline._random_instance), so every schedule's step, at least m t_max >= m sum_i q_i t_i / p,
    is at least sum_u w_u / p: the stand-in for ModelStages.step_floor (the same for every m)."""
    rng = random.Random(seed)
    unit_w = [rng.uniform(0.5, 2.0) for _ in range(U)]
    return lambda m: sum(unit_w) / p


@pytest.mark.parametrize("after", [1, 30, 104, 300, 1000, 1141])
def test_interrupt_returns_best_so_far_with_its_gap(after):
    stage_fn, link_fn = _random_instance(5, 6, 8, 4)
    space = _space(budget=6.0)
    floor = _floor_of(5, 6, 8)
    full = search_pipeline(space, stage_fn, link_fn, schedules=("1f1b", "zb-h1"), exchange=_exchange,
                           step_floor=floor)
    assert full.gap <= 1e-12  # every solve exact: the full search's step is the space's optimum
    progress = Progress(on_tick=_interrupt_after(after))
    try:
        got = search_pipeline(space, stage_fn, link_fn, schedules=("1f1b", "zb-h1"), exchange=_exchange,
                              progress=progress, step_floor=floor)
    except KeyboardInterrupt:
        assert progress.plan is None  # no plan yet: the interrupt goes on to the caller, with its bound stated
        assert floor(1) * (1 - 1e-12) <= progress.space_bound <= full.step_time * (1 + 1e-12)
        return
    if got.stats["interrupted"]:
        # a real plan (its stages re-evaluate to its step), no better than the optimum; the bound is proven (at
        # most the optimum) and at least the step floor, every unfinished part's bound
        assert got.step_time >= full.step_time * (1 - 1e-12)
        again = evaluate_pipeline([(s.first, s.end, s.devices) for s in got.stages], got.micro_batches, space,
                                  stage_fn, link_fn, _exchange, got.schedule)
        assert again is not None and again.step_time == pytest.approx(got.step_time, rel=1e-12)
        assert floor(1) * (1 - 1e-12) <= got.lower_bound <= full.step_time * (1 + 1e-12)
        assert 0.0 < got.gap < 1.0
        if got.stats["parts_done"] == got.stats["parts_total"]:  # interrupted as the last part ended
            assert got.lower_bound == full.lower_bound and got.step_time == full.step_time
    else:
        assert got.step_time == full.step_time and got.lower_bound == full.lower_bound


@pytest.mark.parametrize("seed", range(5))
def test_interrupted_bound_never_exceeds_brute_force(seed):
    """At every tick an interrupt states a bound at most the optimum that brute force finds over every cut,
    sub-mesh sequence and m (1F1B), and at least the step floor; without a floor, at least 0."""
    U, p, ns = 5, 8, 4
    stage_fn, link_fn = _random_instance(seed + 20, U, p, ns)
    space = PipelineSpace(U, p, ns, micro_batches=(1, 2, 4), budget=[None, 6.0][seed % 2])
    want = brute_force_pipeline(space, stage_fn, link_fn, exchange=_exchange).step_time
    floor = _floor_of(seed + 20, U, p)
    counted = Progress()
    search_pipeline(space, stage_fn, link_fn, schedules=("1f1b",), exchange=_exchange, progress=counted)
    seen = 0
    for after in range(1, counted.ticks + 1, max(1, counted.ticks // 40)):
        for step_floor in (floor, None):
            progress = Progress(on_tick=_interrupt_after(after))
            try:
                got = search_pipeline(space, stage_fn, link_fn, schedules=("1f1b",), exchange=_exchange,
                                      progress=progress, step_floor=step_floor)
                bound = got.lower_bound
                assert got.step_time >= want * (1 - 1e-12)
            except KeyboardInterrupt:
                bound = progress.space_bound
            assert bound <= want * (1 + 1e-12)
            if step_floor is not None:
                assert bound >= floor(1) * (1 - 1e-12)
                seen += bound > 0
    assert seen


def test_interrupt_late_enough_is_the_full_search():
    stage_fn, link_fn = _random_instance(5, 6, 8, 4)
    space = _space(budget=6.0)
    counted = Progress()
    full = search_pipeline(space, stage_fn, link_fn, schedules=("1f1b", "zb-h1"), exchange=_exchange,
                           progress=counted)
    got = search_pipeline(space, stage_fn, link_fn, schedules=("1f1b", "zb-h1"), exchange=_exchange,
                          progress=Progress(on_tick=_interrupt_after(counted.ticks + 1)))
    assert got.stats["interrupted"] is False and got.step_time == full.step_time
    # at the last tick (the last part's end) the interrupt finds every part proven; one before, the last part
    # is unfinished: its bound is what it proved before it ended (here its family bound from the unit seconds)
    cut = search_pipeline(space, stage_fn, link_fn, schedules=("1f1b", "zb-h1"), exchange=_exchange,
                          progress=Progress(on_tick=_interrupt_after(counted.ticks)))
    assert cut.stats["interrupted"] is True and cut.step_time == full.step_time
    assert cut.lower_bound == full.lower_bound
    cut = search_pipeline(space, stage_fn, link_fn, schedules=("1f1b", "zb-h1"), exchange=_exchange,
                          progress=Progress(on_tick=_interrupt_after(counted.ticks - 1)))
    assert cut.stats["interrupted"] is True and 0.0 <= cut.lower_bound <= full.step_time
    assert cut.stats["parts_done"] == cut.stats["parts_total"] - 1


def test_parts_best_first_and_closed_by_their_floor():
    """The micro-batch counts run in increasing order of their step floor (the larger count first among equals),
    each count's parts together; a part whose floor reaches the best step known is closed without a search."""
    stage_fn, link_fn = _random_instance(5, 6, 8, 4)
    space = _space()

    class Seen(Progress):
        def __init__(self) -> None:
            super().__init__()
            self.parts: list[str] = []

        def part(self, phase: str, detail: str = "") -> None:
            self.parts.append(phase)
            super().part(phase, detail)

    ties = Seen()
    full = search_pipeline(space, stage_fn, link_fn, schedules=("1f1b", "zb-h1"), exchange=_exchange,
                           progress=ties, step_floor=lambda m: 0.0)
    assert ties.parts == [f"pipelines {f} m={m}" for m in (8, 4, 2, 1) for f in ("zb-h1", "1f1b")]
    ranked = Seen()
    got = search_pipeline(space, stage_fn, link_fn, schedules=("1f1b", "zb-h1"), exchange=_exchange,
                          progress=ranked, step_floor=lambda m: {1: 0.03, 2: 0.01, 4: 0.04, 8: 0.02}[m])
    assert ranked.parts == [f"pipelines {f} m={m}" for m in (2, 8, 1, 4) for f in ("zb-h1", "1f1b")]
    close = Seen()  # floors within 1 % of the least are equal: the larger count first
    search_pipeline(space, stage_fn, link_fn, schedules=("1f1b", "zb-h1"), exchange=_exchange, progress=close,
                    step_floor=lambda m: {1: 0.01, 2: 0.01001, 4: 0.01009, 8: 0.0102}[m])
    assert close.parts == [f"pipelines {f} m={m}" for m in (4, 2, 1, 8) for f in ("zb-h1", "1f1b")]
    assert got.step_time == full.step_time  # the order changes nothing of the optimum
    # a floor at the optimum closes every part of its count unsearched
    best_m = full.micro_batches
    closed = search_pipeline(space, stage_fn, link_fn, schedules=("1f1b", "zb-h1"), exchange=_exchange,
                             step_floor=lambda m: 0.0 if m == best_m else full.step_time * 2)
    assert closed.step_time == full.step_time and closed.stats["parts_closed_by_floor"] == 6
    # with the one program's step (from outside) under every floor: nothing is searched, None, the floors proven
    outside = Progress()
    outside.improved(full.step_time / 4)
    assert search_pipeline(space, stage_fn, link_fn, schedules=("1f1b", "zb-h1"), exchange=_exchange,
                           progress=outside, step_floor=lambda m: full.step_time / 2) is None
    assert outside.done == outside.total == 8 and outside.bound == full.step_time / 4
    assert outside.space_bound == full.step_time / 4


@pytest.mark.parametrize("seed", range(4))
def test_shared_memo_equals_one_dp_per_stage_count(seed):
    """The stage DP's states do not depend on the stage count asked for: one memo for every count gives each
    count's own optimum."""
    stage_fn, _ = _random_instance(seed, 7, 16, 4)
    space = PipelineSpace(7, 16, 4)
    sizes = list(space.allowed_sizes())
    bound = [math.inf, 0.9, 0.6, 0.45][seed]

    def stage(a, b, o, q, r):
        c = stage_fn(a, b, q, 2)
        if c is None:
            return None
        return c.time if c.time <= bound else None

    shared: dict = {}
    for n in range(1, 8):
        alone = _stage_dp(space, n, sizes, stage, None, {}, "states")
        together = _stage_dp(space, n, sizes, stage, None, {}, "states", shared)
        assert (alone is None) == (together is None)
        if alone is not None:
            assert together[0] == alone[0]


def test_terminal_writer():
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    plain = io.StringIO()
    write, end = terminal_writer(plain)
    write("a")
    write("b")
    end()
    assert plain.getvalue() == "a\nb\n"
    tty = Tty()
    write, end = terminal_writer(tty)
    write("a")
    write("b")
    end()
    assert tty.getvalue() == "\r\x1b[Ka\r\x1b[Kb\r\x1b[K"


def test_default_micro_batch_counts_are_every_divisor_of_the_batch():
    """Not given, the micro-batch counts searched are every count that divides the batch, in increasing order
    (brute force over 1..batch), and 1, 2, 4, 8 when the batch is not known; given, they narrow it."""
    from shardplan.errors import ShardplanError
    from shardplan.planner import micro_batch_counts

    for batch in [1, 2, 7, 12, 64, 97, 360, 1536, 2048] + random.Random(0).sample(range(1, 5000), 20):
        assert micro_batch_counts(None, batch) == tuple(m for m in range(1, batch + 1) if batch % m == 0)
    assert len(micro_batch_counts(None, 1536)) == 20
    assert micro_batch_counts(None, None) == (1, 2, 4, 8)
    assert micro_batch_counts([96, 192], 1536) == (96, 192)
    with pytest.raises(ShardplanError, match="do not split"):
        micro_batch_counts([5], 1536)
