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
