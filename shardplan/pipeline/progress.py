"""Progress of a long search: what phase, how many parts of how many, the incumbent and the proven bound.

A :class:`Progress` is told by the search where it is (:meth:`Progress.part`, :meth:`Progress.finished`,
:meth:`Progress.improved`) and ticked from its inner loops (:meth:`Progress.tick`); every ``interval`` seconds
a tick hands one line to ``report`` (the command line writes it to stderr, rewritten in place on a terminal:
:func:`terminal_writer`). ``on_tick`` is called at every tick with the number of ticks so far: a test that
raises :class:`KeyboardInterrupt` from it after N ticks interrupts the search deterministically, as Ctrl-C
does at a random point. The search itself catches the interrupt and returns the best plan so far with its
proven gap (``docs/pipeline.md``, *Progress and interruption*).

A :class:`~shardplan.search.work.WorkBudget` (defined with its units in :mod:`shardplan.search.work`, where
the fit search, below this package, charges it too; re-exported here) counts the work of a whole planning call in work units charged from sizes the input
fixes (the fit searches' own ``stats["work"]``, the pipeline DPs' states, the graphs built, the solve-free
floors and the stage tables; never a clock). Once the units charged reach its limit, the next charge or tick
raises :class:`WorkLimitReached`, a :class:`KeyboardInterrupt`, so every search stops by the path Ctrl-C
takes, at the same point on an idle and a busy machine (``docs/pipeline.md``, *A work budget for the whole
call*).
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any, Callable, TextIO

from shardplan.search.work import (CHOICE_ROW_WORK, CHOICE_TABLE_WORK, FLOOR_OP_WORK, FLOOR_UNIT_WORK, GRAPH_OP_WORK,
                                   PLAN_WORK_LIMIT, STATE_WORK, TABLE_ITEM_WORK, TABLE_LAYOUT_WORK, TABLE_OP_WORK,
                                   WorkBudget, WorkLimitReached, choice_work, table_work)

__all__ = ["Progress", "WorkBudget", "WorkLimitReached", "terminal_writer", "format_seconds", "INTERVAL",
           "PLAN_WORK_LIMIT", "STATE_WORK", "GRAPH_OP_WORK", "FLOOR_OP_WORK", "FLOOR_UNIT_WORK", "TABLE_OP_WORK",
           "TABLE_LAYOUT_WORK", "TABLE_ITEM_WORK", "CHOICE_TABLE_WORK", "CHOICE_ROW_WORK", "table_work",
           "choice_work"]

INTERVAL = 2.0
"""Seconds between two progress lines by default (the first comes one interval after the start)."""


def format_seconds(x: float) -> str:
    """Seconds for a progress line: 4 significant digits, or "-" when unknown (infinite)."""
    return f"{x:.4g} s" if math.isfinite(x) else "-"


class Progress:
    """Where a search stands, reported every ``interval`` seconds of wall time (default :data:`INTERVAL`; module
    docstring).

    Attributes:
        phase: what is being searched now (e.g. ``"zb-h1 m=8"``).
        done, total: parts of the search finished, of how many.
        incumbent, plan: the best plan's step so far (inf: none yet) and the plan.
        heard: the best step of plans found by a phase whose plans this search does not prune with (the uniform
            pipelines costed before the one program, which the planner returns if nothing beats them): shown as
            the line's "best" where it is below the incumbent, never used to prune (inf: none).
        bound: the least proven lower bound over the finished parts (inf: none finished).
        space_bound: the proven lower bound of the whole space as the search states it (the finished parts' bounds
            and each unfinished part's step floor or family bound), kept current while it runs and final when it
            returns or is interrupted; None: not stated yet.
        ticks: ticks so far.
        budget: the planning call's :class:`WorkBudget` (None: no work counted), charged by :meth:`tick`'s
            ``work`` and checked at every tick.
    """

    def __init__(self, report: Callable[[str], None] | None = None, interval: float | None = None,
                 on_tick: Callable[[int], None] | None = None, clock: Callable[[], float] = time.perf_counter,
                 budget: WorkBudget | None = None):
        self.report, self.on_tick, self.clock, self.budget = report, on_tick, clock, budget
        self.interval = float(INTERVAL if interval is None else interval)
        self.phase, self.detail = "", ""
        self.done, self.total = 0, 0
        self.incumbent = math.inf
        self.plan: Any = None
        self.heard = math.inf
        self.bound = math.inf
        self.space_bound: float | None = None
        self.ticks = 0
        self.started = clock()
        self._last = self.started  # a search shorter than one interval prints nothing

    def part(self, phase: str, detail: str = "") -> None:
        """A new part of the search starts."""
        self.phase, self.detail = phase, detail
        self.tick()

    def finished(self, lower: float) -> None:
        """The current part is done; ``lower`` is the bound it proved of its own optimum."""
        self.done += 1
        self.bound = min(self.bound, lower)
        self.tick()

    def improved(self, step: float, plan: Any = None) -> None:
        """A real plan (``plan``, of this step time) found: the new incumbent if better. It is kept
        (``self.plan``) so that an interrupted search can return it."""
        if step < self.incumbent:
            self.incumbent, self.plan = step, plan

    def hear(self, step: float) -> None:
        """A plan of ``step`` seconds found outside the incumbent (:attr:`heard`): the line shows it, nothing
        prunes with it."""
        self.heard = min(self.heard, step)

    def tick(self, detail: str | None = None, work: float = 0.0, kind: str = "pipeline_dp") -> None:
        """One step of an inner loop: charges ``work`` units of ``kind`` to the budget (which raises
        :class:`WorkLimitReached` once it is spent) and reports a line when ``interval`` seconds have passed
        since the last."""
        self.ticks += 1
        if self.budget is not None:
            self.budget.charge(work, kind)
        if detail is not None:
            self.detail = detail
        if self.on_tick is not None:
            self.on_tick(self.ticks)
        if self.report is not None:
            now = self.clock()
            if now - self._last >= self.interval:
                self._last = now
                self.report(self.line())

    def line(self) -> str:
        """The progress line: phase, parts done, incumbent, bound over the finished parts, the proven bound of the
        whole space where the search states one, the work units charged (and the limit) where a budget counts
        them, seconds so far."""
        what = f"{self.phase} {self.detail}".strip()
        bound = format_seconds(self.bound) if self.done else "-"
        space = "" if self.space_bound is None else f" | proven bound {format_seconds(self.space_bound)}"
        work = ""
        if self.budget is not None:
            limit = "" if math.isinf(self.budget.limit) else f" of {self.budget.limit:.3g}"
            work = f" | work {self.budget.used:.3g}{limit}"
        best = min(self.incumbent, self.heard)
        return (f"  {what} | {self.done}/{self.total} parts done | best {format_seconds(best)} | "
                f"bound of finished parts {bound}{space}{work} | {self.clock() - self.started:.0f} s")


def terminal_writer(stream: TextIO | None = None) -> tuple[Callable[[str], None], Callable[[], None]]:
    """(write a progress line, end the progress display) on ``stream`` (default stderr): on a terminal each line
    overwrites the previous one (carriage return, erase to the end of the line), elsewhere one line each."""
    out = sys.stderr if stream is None else stream
    tty = bool(getattr(out, "isatty", lambda: False)())
    shown = [False]

    def write(line: str) -> None:
        if tty:
            out.write("\r\x1b[K" + line)
            shown[0] = True
        else:
            out.write(line + "\n")
        out.flush()

    def end() -> None:
        if shown[0]:
            out.write("\r\x1b[K")
            out.flush()
            shown[0] = False

    return write, end
