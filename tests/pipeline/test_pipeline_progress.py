"""Progress lines, Ctrl-C (a KeyboardInterrupt raised after N ticks, deterministically) returning the best plan
so far with its proven gap, and the stage DP's memo shared across stage counts."""

from __future__ import annotations

import io
import math

import pytest

from shardplan.pipeline.progress import Progress, terminal_writer
from shardplan.pipeline.search import PipelineSpace, _stage_dp, evaluate_pipeline, search_pipeline

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


@pytest.mark.parametrize("after", [1, 30, 104, 300, 1000, 1141])
def test_interrupt_returns_best_so_far_with_its_gap(after):
    stage_fn, link_fn = _random_instance(5, 6, 8, 4)
    space = _space(budget=6.0)
    full = search_pipeline(space, stage_fn, link_fn, schedules=("1f1b", "zb-h1"), exchange=_exchange)
    progress = Progress(on_tick=_interrupt_after(after))
    try:
        got = search_pipeline(space, stage_fn, link_fn, schedules=("1f1b", "zb-h1"), exchange=_exchange,
                              progress=progress)
    except KeyboardInterrupt:
        assert progress.plan is None and after <= 103  # no plan yet: the interrupt goes on to the caller
        return
    if got.stats["interrupted"]:
        # a real plan (its stages re-evaluate to its step), no better than the optimum, nothing proven beyond
        # the finished parts: the bound is 0 and the gap 1
        assert got.step_time >= full.step_time * (1 - 1e-12)
        again = evaluate_pipeline([(s.first, s.end, s.devices) for s in got.stages], got.micro_batches, space,
                                  stage_fn, link_fn, _exchange, got.schedule)
        assert again is not None and again.step_time == pytest.approx(got.step_time, rel=1e-12)
        if got.stats["parts_done"] < got.stats["parts_total"]:
            assert got.lower_bound == 0.0 and got.gap == 1.0
        else:  # interrupted as the last part ended: everything was proven
            assert got.lower_bound == full.lower_bound and got.step_time == full.step_time
    else:
        assert got.step_time == full.step_time and got.lower_bound == full.lower_bound


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
    # is unfinished and nothing of it is proven
    cut = search_pipeline(space, stage_fn, link_fn, schedules=("1f1b", "zb-h1"), exchange=_exchange,
                          progress=Progress(on_tick=_interrupt_after(counted.ticks)))
    assert cut.stats["interrupted"] is True and cut.step_time == full.step_time
    assert cut.lower_bound == full.lower_bound
    cut = search_pipeline(space, stage_fn, link_fn, schedules=("1f1b", "zb-h1"), exchange=_exchange,
                          progress=Progress(on_tick=_interrupt_after(counted.ticks - 1)))
    assert cut.stats["interrupted"] is True and cut.lower_bound == 0.0
    assert cut.stats["parts_done"] == cut.stats["parts_total"] - 1


def test_plan_interrupted_in_the_pipeline_search():
    from shardplan import preset
    from shardplan.planner import plan

    machine = preset("a100", 16)
    full = plan("gpt", machine, sizes={"layers": 4}, micro_batches=(1, 2))
    got = plan("gpt", machine, sizes={"layers": 4}, micro_batches=(1, 2),
               progress=Progress(on_tick=_interrupt_after(2)))
    assert got.stats["interrupted"] is True and full.stats["interrupted"] is False
    assert got.step_time >= full.step_time * (1 - 1e-12)
    assert got.lower_bound == 0.0  # the pipeline space was not searched to the end: nothing proven of it


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
