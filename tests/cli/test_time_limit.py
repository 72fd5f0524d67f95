"""``shardplan plan --time-limit``: the search stops after the given wall time exactly as on Ctrl-C."""

from __future__ import annotations

import dataclasses
import signal

import pytest

from shardplan.cli import main
from shardplan.machine import preset

ARGV = ["plan", "--model", "gpt", "--set", "layers=2", "-p", "8", "--machine", "h100"]


@pytest.fixture
def quick_plan():
    """A real plan of the command's model (layouts only, so it is quick), marked as an interrupted search's."""
    from shardplan.planner import plan

    p = plan("gpt", preset("h100", 8), sizes={"layers": 2}, fit=False, stages=False)
    return dataclasses.replace(p, stats={**p.stats, "interrupted": True})


def _searching_until_interrupted(result):
    """A stand-in for the planner that searches until a KeyboardInterrupt, then returns ``result`` (the best plan
    found so far, as the real search does) or, with ``result`` None, lets the interrupt through (no plan yet)."""

    def search(*args, **kwargs):
        try:
            while True:
                pass
        except KeyboardInterrupt:
            if result is None:
                raise
            return result

    return search


def test_time_limit_stops_the_search_and_prints_its_best_plan(monkeypatch, capsys, quick_plan):
    import shardplan.planner

    before = signal.getsignal(signal.SIGALRM)
    monkeypatch.setattr(shardplan.planner, "plan", _searching_until_interrupted(quick_plan))
    assert main([*ARGV, "--time-limit", "0.05"]) == 0
    out, err = capsys.readouterr()
    assert "time limit of 0.05 s reached: the search stopped as on Ctrl-C" in err.splitlines()
    assert "Step time:" in out
    # the timer is disarmed and the previous handler is back
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) is before


def test_time_limit_before_any_plan_exits_130(monkeypatch, capsys):
    import shardplan.planner

    monkeypatch.setattr(shardplan.planner, "plan", _searching_until_interrupted(None))
    assert main([*ARGV, "--time-limit", "0.05"]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "time limit reached before any plan was found"
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_a_search_within_its_limit_is_the_full_search(capsys):
    before = signal.getsignal(signal.SIGALRM)
    assert main([*ARGV, "--no-fit", "--stages", "off", "--time-limit", "600"]) == 0
    out, err = capsys.readouterr()
    assert "time limit" not in err and "proven optimal" in out
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) is before


@pytest.mark.parametrize("value", ["0", "-1", "nan", "soon"])
def test_time_limit_refuses_what_is_not_a_positive_number(value, capsys):
    assert main([*ARGV, "--time-limit", value]) == 2
    err = capsys.readouterr().err
    assert "--time-limit" in err and len(err.strip().splitlines()) == 1


def test_the_limit_counts_from_the_process_start_on_the_command_line(monkeypatch, capsys, quick_plan):
    """Run as the command (no argv given), the limit counts from the process's start: a process older than the
    limit stops the search at once, before it has a plan (its imports and the model's graph count against the
    limit; called with arguments, as above, the same limit lets the search run)."""
    import sys

    import shardplan.cli.plan as cli_plan
    import shardplan.planner

    monkeypatch.setattr(shardplan.planner, "plan", _searching_until_interrupted(quick_plan))
    monkeypatch.setattr(cli_plan, "_process_age", lambda: 1e6)
    monkeypatch.setattr(sys, "argv", ["shardplan", *ARGV, "--time-limit", "600"])
    assert main() == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "time limit reached before any plan was found"
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_the_search_stops_a_reserve_before_the_limit():
    from shardplan.cli.plan import TIME_LIMIT_RESERVE_CAP, search_deadline

    assert search_deadline(60.0, 2.0) == pytest.approx(52.0)  # a tenth kept for the answer
    assert search_deadline(0.05, 0.0) == pytest.approx(0.045)
    assert search_deadline(1000.0, 0.0) == pytest.approx(1000.0 - TIME_LIMIT_RESERVE_CAP)
    assert search_deadline(60.0, 59.0) == 1e-6  # already spent: at once
    assert search_deadline(60.0, 600.0) == 1e-6


def test_the_time_limit_is_a_process_age_on_linux():
    import os
    import time

    from shardplan.cli.plan import _process_age

    age = _process_age()
    if os.path.exists("/proc/self/stat"):
        assert 0.0 < age < time.monotonic()  # started after the boot; python's own start-up took some time
    else:
        assert age == 0.0


# where the alarm lands on `plan --model gpt --set layers=2 -p 16 --micro-batches 1,2,4` (41 ticks in all): at
# the third tick the uniform seeds have one seed, at the fifth the one program is done and the pipeline search
# starts, at the 25th a ZB-H1 box of m = 2 is being searched
@pytest.mark.parametrize("alarm_at", [3, 5, 25])
def test_after_the_alarm_nothing_is_searched_built_or_bounded(alarm_at, monkeypatch, capsys):
    """The alarm raised at a given tick of a real search (as the timer would raise it there): from then on no
    tick (no search step), no graph built, no device-seconds bound computed and no solve but those of the
    answer's own stage plans (the reserve's work); the answer is printed with a proven bound."""
    import shardplan.fit
    import shardplan.pipeline.execute as execute
    import shardplan.pipeline.stages as stages
    from shardplan.pipeline.progress import Progress

    fired: list[bool] = []
    after: dict[str, int] = {"ticks": 0, "graphs": 0, "device_seconds": 0, "solves": 0}
    answer: list[bool] = []  # inside the answer's stage plans

    tick = Progress.tick

    def ticking(self, detail=None):
        if fired:
            after["ticks"] += 1
        tick(self, detail)
        if self.ticks == alarm_at and not fired:
            fired.append(True)
            signal.raise_signal(signal.SIGALRM)  # the timer's signal, here: the handler interrupts the search

    def counted(name, fn, only_outside_answer=False):
        def call(*args, **kwargs):
            if fired and not (only_outside_answer and answer):
                after[name] += 1
            return fn(*args, **kwargs)
        return call

    stage_plan = execute.stage_plan

    def answer_plan(*args, **kwargs):
        answer.append(True)
        try:
            return stage_plan(*args, **kwargs)
        finally:
            answer.pop()

    monkeypatch.setattr(Progress, "tick", ticking)
    monkeypatch.setattr(stages, "units_of", counted("graphs", stages.units_of))
    monkeypatch.setattr(stages, "graph_device_seconds", counted("device_seconds", stages.graph_device_seconds))
    monkeypatch.setattr(stages.ModelStages, "_cost_of_graph",
                        counted("solves", stages.ModelStages._cost_of_graph, only_outside_answer=True))
    monkeypatch.setattr(shardplan.fit, "solve_fit", counted("solves", shardplan.fit.solve_fit, True))
    monkeypatch.setattr(execute, "stage_plan", answer_plan)
    argv = ["plan", "--model", "gpt", "--set", "layers=2", "-p", "16", "--machine", "h100",
            "--micro-batches", "1,2,4", "--time-limit", "600"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert fired and "time limit of 600 s reached: the search stopped as on Ctrl-C" in err.splitlines()
    assert after == {"ticks": 0, "graphs": 0, "device_seconds": 0, "solves": 0}
    assert "lower bound" in out and "lower bound 0 s" not in out
