"""The work budget of a whole ``shardplan.plan`` call (docs/pipeline.md, *A work budget for the whole call*).

Work is counted from sizes the input fixes, never read from a clock: with every clock of ``time`` patched to run
100 times fast or to jump 1,000 s at each reading, a budgeted call stops at the same point with the same plan,
step, bound and units. A budget smaller than the search stops it as Ctrl-C does, with a bound at most the
optimum the unbudgeted search proves; the default budget leaves small cases as they were; bad limits are one
error (one line and exit 2 on the command line).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest

from shardplan.cli import main
from shardplan.errors import ShardplanError
from shardplan.machine import preset
from shardplan.pipeline.progress import PLAN_WORK_LIMIT, WorkBudget, WorkLimitReached
from shardplan.planner import plan
from tests.fit.test_fit_work_limit import _patch_clocks  # every clock of ``time`` made fast

# a GPT of two blocks on four a100 with slow links across nodes: seeds, one program and pipeline parts all run
MACHINE = replace(preset("a100", 4), inter_bandwidth=1e9)
SMALL = dict(sizes={"layers": 2}, batch=8, micro_batches=(1, 2), stages=True)


def _answer(p) -> tuple:
    """What must not depend on the machine: the plan (stages, every operator's choices), step, bound, units."""
    return (p.stages, p.micro_batches, p.schedule, p.step_time, p.lower_bound, p.stats["work_used"],
            p.stats["stopped_at_work_limit"], p.stats["interrupted"], p.stats["work_parts"])


@pytest.fixture(scope="module")
def full():
    """The unbudgeted search of SMALL: proven optimal, and the units it charges."""
    got = plan("gpt", MACHINE, work_limit=None, **SMALL)
    assert got.gap is not None and got.gap <= 1e-9
    assert got.stats["stopped_at_work_limit"] is False and got.stats["work_limit"] is None
    assert got.stats["work_used"] > 0 and got.stats["work_parts"]["fit"] > 0
    return got


def test_the_budget_raises_once_and_never_once_closed():
    b = WorkBudget(10.0)
    b.charge(4.0, "a")
    assert b.left() == 6.0 and not b.stopped
    with pytest.raises(WorkLimitReached):
        b.charge(6.0, "b")
    assert issubclass(WorkLimitReached, KeyboardInterrupt)  # every interrupt handler of the search takes it
    b.charge(5.0, "a")  # raised once: the answer's construction after it is charged, not stopped
    assert b.used == 15.0 and b.parts == {"a": 9.0, "b": 6.0} and b.stopped and b.left() == 0.0
    c = WorkBudget(1.0)
    c.close()
    c.charge(5.0, "a")
    assert not c.stopped
    for none in (None, 0, 0.0):
        assert WorkBudget(none).limit == float("inf")
    # a tick charges its work, and the progress line shows the units and the limit
    from shardplan.pipeline.progress import Progress

    tracker = Progress(budget=WorkBudget(100.0))
    tracker.tick(work=40.0)
    assert tracker.budget.parts == {"pipeline_dp": 40.0} and "| work 40 of 100 |" in tracker.line()
    with pytest.raises(WorkLimitReached):
        tracker.tick(work=60.0)


@functools.cache
def _budgeted(limit: float):
    """``plan("gpt", MACHINE, work_limit=limit, **SMALL)`` with the real clocks, run once per limit."""
    return plan("gpt", MACHINE, work_limit=limit, **SMALL)


@pytest.mark.parametrize("share", [0.3, 0.6])
@pytest.mark.parametrize("how", ["100x", "jump"])
def test_the_same_answer_under_any_clock(monkeypatch, full, share, how):
    """A budget that stops the search part-way: the same plan, step, bound and units with every clock fast or
    jumping as with the real one (nothing in the search reads a clock to decide anything)."""
    limit = share * full.stats["work_used"]
    real = _budgeted(limit)  # with the real clocks, once per limit (both clocks compare with it)
    assert real.stats["stopped_at_work_limit"] and real.stats["interrupted"]
    _patch_clocks(monkeypatch, how)
    assert _answer(plan("gpt", MACHINE, work_limit=limit, **SMALL)) == _answer(real)


def test_a_small_budget_stops_early_with_a_bound_below_the_optimum(full):
    """Budgets from a few percent of the full search's units up: each either refuses (spent before any plan) or
    returns a real plan no faster than the optimum whose stated bound is positive and at most the optimum; the
    gap is stated, and the budget stopped it. A budget above the whole search's units is the full search."""
    total = full.stats["work_used"]
    stopped = 0
    for share in (0.02, 0.1, 0.25, 0.4, 0.55, 0.7, 0.85, 0.95):
        try:
            got = plan("gpt", MACHINE, work_limit=share * total, **SMALL)
        except ShardplanError as e:
            assert "work limit" in str(e) and "before any plan" in str(e)
            continue
        assert got.step_time >= full.step_time * (1 - 1e-9)
        assert got.lower_bound is not None and 0.0 < got.lower_bound <= full.step_time * (1 + 1e-12)
        assert got.gap is not None and 0.0 <= got.gap < 1.0
        if got.stats["stopped_at_work_limit"]:
            stopped += 1
            assert got.stats["interrupted"] and got.stats["work_limit"] == share * total
            assert got.stats["work_used"] >= share * total
    assert stopped >= 3
    again = plan("gpt", MACHINE, work_limit=1.01 * total, **SMALL)
    assert not again.stats["stopped_at_work_limit"]
    assert _answer(again)[:6] == _answer(full)[:6]


def test_the_default_budget_leaves_small_cases_unchanged(full):
    """The default budget is far above what small searches charge: the same plan, step and bound as without one,
    proven optimal, and nothing stopped."""
    got = plan("gpt", MACHINE, **SMALL)
    assert got.stats["work_limit"] == PLAN_WORK_LIMIT and not got.stats["stopped_at_work_limit"]
    assert _answer(got)[:6] == _answer(full)[:6]
    zero = plan("gpt", MACHINE, work_limit=0, **SMALL)  # 0: no limit, as None
    assert zero.stats["work_limit"] is None and _answer(zero)[:6] == _answer(full)[:6]
    # one program only (no stages): the same under the default budget as without one
    one = dict(sizes={"layers": 2}, batch=8, micro_batches=(1, 2), stages=False)
    a, b = plan("gpt", MACHINE, **one), plan("gpt", MACHINE, work_limit=None, **one)
    assert (a.step_time, a.lower_bound, a.stages) == (b.step_time, b.lower_bound, b.stages)
    assert a.stats["work_used"] == b.stats["work_used"] > 0


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), "many", True])
def test_bad_work_limits_are_one_error(bad):
    with pytest.raises(ShardplanError, match="work_limit"):
        plan("gpt", MACHINE, work_limit=bad, **SMALL)


def test_a_budget_spent_before_any_plan_is_one_error(capsys):
    with pytest.raises(ShardplanError, match="spent before any plan was found"):
        plan("gpt", MACHINE, work_limit=1.0, **SMALL)
    argv = ["plan", "--model", "gpt", "--set", "layers=2", "-p", "8", "--machine", "h100", "--work-limit", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) >= 1 and "spent before any plan was found" in err[-1]


@pytest.mark.parametrize("value", ["-1", "abc", "nan", "inf", "1e400", ""])
def test_bad_work_limit_options_are_one_line_and_exit_2(value, capsys):
    argv = ["plan", "--model", "gpt", "--set", "layers=2", "-p", "8", "--machine", "h100", "--work-limit", value]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and "--work-limit" in err


def test_the_command_passes_its_work_limit_and_says_where_it_stopped(monkeypatch, capsys):
    """``--work-limit none`` is no limit, a number is passed on, the default is the planner's; a plan stopped by
    the budget is printed with the line that says so (not "interrupted")."""
    import shardplan.planner

    seen = []
    quick = plan("gpt", preset("h100", 8), sizes={"layers": 2}, fit=False, stages=False)

    def fake(*args, **kwargs):
        seen.append(kwargs["work_limit"])
        stopped = kwargs["work_limit"] == 5e6
        return replace(quick, stats={**quick.stats, "interrupted": stopped, "stopped_at_work_limit": stopped})

    monkeypatch.setattr(shardplan.planner, "plan", fake)
    base = ["plan", "--model", "gpt", "--set", "layers=2", "-p", "8", "--machine", "h100"]
    assert main(base) == 0 and main([*base, "--work-limit", "none"]) == 0
    capsys.readouterr()
    assert main([*base, "--work-limit", "5e6"]) == 0
    out, err = capsys.readouterr()
    assert seen == [PLAN_WORK_LIMIT, None, 5e6]
    assert "work limit of 5e+06 units reached: the search stopped as on Ctrl-C" in err
    assert "stopped at the work limit: the best plan found so far" in err and "Step time:" in out


def test_a_budget_spent_inside_a_stage_solve_of_the_uniform_pipelines_is_the_budget_error():
    """The budget runs out inside a stage's memory search of the uniform pipelines (two nodes of h100, no plan
    yet): the stage hands the spent budget on as such, so the call ends in the one-line budget error, not in a
    bare interrupt as if the user had pressed Ctrl-C."""
    with pytest.raises(ShardplanError, match="spent before any plan was found"):
        plan("llama3-tiny", preset("h100", 16), batch=16, work_limit=3e5)
