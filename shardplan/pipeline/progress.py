"""Progress of a long search: what phase, how many parts of how many, the incumbent and the proven bound.

A :class:`Progress` is told by the search where it is (:meth:`Progress.part`, :meth:`Progress.finished`,
:meth:`Progress.improved`) and ticked from its inner loops (:meth:`Progress.tick`); every ``interval`` seconds
a tick hands one line to ``report`` (the command line writes it to stderr, rewritten in place on a terminal:
:func:`terminal_writer`). ``on_tick`` is called at every tick with the number of ticks so far: a test that
raises :class:`KeyboardInterrupt` from it after N ticks interrupts the search deterministically, as Ctrl-C
does at a random point. The search itself catches the interrupt and returns the best plan so far with its
proven gap (``docs/pipeline.md``, *Progress and interruption*).

A :class:`WorkBudget` counts the work of a whole planning call in work units charged from sizes the input
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
from typing import Any, Callable, Sequence, TextIO

__all__ = ["Progress", "WorkBudget", "WorkLimitReached", "terminal_writer", "format_seconds", "INTERVAL",
           "PLAN_WORK_LIMIT"]

INTERVAL = 2.0
"""Seconds between two progress lines by default (the first comes one interval after the start)."""


PLAN_WORK_LIMIT = 3.0e7
"""The default work budget of one :func:`shardplan.plan` call, in work units (about a CPU microsecond each on the
reference 2-core machine: docs/pipeline.md, *A work budget for the whole call*, states the calibration)."""


# Work units of the parts of a planning call that are not a fit search (whose solves charge their own
# ``stats["work"]``, shardplan/search/constrained.py), per item the code loops on; fitted to CPU microseconds on
# the reference 2-core machine (docs/pipeline.md, *A work budget for the whole call*).
TABLE_OP_WORK = 9700.0  # per distinct operator of a cost table built, not in its cache (layouts enumerated, costed)
TABLE_LAYOUT_WORK = 73.0  # per layout of such an operator
TABLE_ITEM_WORK = 100.0  # per operator and edge of a cost table built (cached ones included)
CHOICE_TABLE_WORK = 1700.0  # per distinct choice table of a count (identical operators share one)
CHOICE_ROW_WORK = 2.3  # per row of such a table (layout x ZeRO stage x recomputation)
GRAPH_OP_WORK = 95.0  # per operator of a graph built at a micro-batch size (the IR's validation included)
FLOOR_OP_WORK = 2000.0  # per operator floor of a (sub-mesh size, count) pair's unit bounds (layouts costed)
FLOOR_UNIT_WORK = 5.0  # per unit of such a pair (its device-seconds bound and prefix sum)
STATE_WORK = 16.0  # per state of a pipeline DP, with the search's own work around its DPs (charged every 2^14 states)


def table_work(tables: Any, seen: dict[int, Any] | None = None) -> float:
    """The work units charged for building ``tables`` (a :class:`~shardplan.cost.CostTables`): per operator and
    edge, and per distinct operator (identical operators share their layout arrays) and its layouts, those
    whose arrays are not in ``seen`` (the arrays of earlier builds on the same cost-table cache by identity,
    held there so that no identity is reused; updated here), or all of them with no ``seen``."""
    seen = {} if seen is None else seen
    fresh = {id(a): a for a in tables.arrays if id(a) not in seen}
    seen.update(fresh)
    return (TABLE_OP_WORK * len(fresh) + TABLE_LAYOUT_WORK * sum(len(a) for a in fresh.values())
            + TABLE_ITEM_WORK * (len(tables.layouts) + len(tables.edge_costs)))


def choice_work(tables: Sequence[Any]) -> float:
    """The work units charged for a count's choice tables (identical operators share one: each distinct table
    and its rows)."""
    distinct = {id(t): t for t in tables}
    return CHOICE_TABLE_WORK * len(distinct) + CHOICE_ROW_WORK * sum(len(t.base) for t in distinct.values())


class WorkLimitReached(KeyboardInterrupt):
    """The planning call's work budget is spent: raised once, where a Ctrl-C would land, so every search stops by
    the interrupt's path with its best plan and proven bound."""


class WorkBudget:
    """Work units charged to one planning call, and its limit (``inf``: none; the count is still kept).

    Attributes:
        limit: the units after which the call stops.
        used: the units charged so far.
        parts: the units by kind (``"fit"``, ``"tables"``, ``"graphs"``, ``"floors"``, ``"pipeline_dp"``, ...).
        stopped: True once :class:`WorkLimitReached` was raised (it is raised once: what runs after it, the
            answer's construction, is charged but never stopped).
        closed: True once the caller said the search is over (:meth:`close`): charges are counted, never stopped.
    """

    def __init__(self, limit: float | None = None) -> None:
        self.limit = math.inf if limit is None or limit == 0 else float(limit)
        self.used = 0.0
        self.parts: dict[str, float] = {}
        self.stopped = False
        self.closed = False

    def left(self) -> float:
        """Units left before the limit (0 once spent; ``inf`` with no limit)."""
        return max(self.limit - self.used, 0.0)

    def charge(self, units: float, kind: str) -> None:
        """Add ``units`` of ``kind``, then :meth:`check`."""
        units = float(units)
        self.used += units
        self.parts[kind] = self.parts.get(kind, 0.0) + units
        self.check()

    def close(self) -> None:
        """The search is over: later charges (the answer's construction) are counted, never stopped."""
        self.closed = True

    def check(self) -> None:
        """Raise :class:`WorkLimitReached` if the units charged reach the limit (once, and not once closed)."""
        if not self.stopped and not self.closed and self.used >= self.limit:
            self.stopped = True
            raise WorkLimitReached

    def summary(self) -> dict[str, object]:
        """The plan's statistics of the budget: limit (None: none), units used, by kind, and whether it stopped."""
        return {"work_limit": None if math.isinf(self.limit) else self.limit, "work_used": self.used,
                "work_parts": dict(self.parts), "stopped_at_work_limit": self.stopped}


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
        return (f"  {what} | {self.done}/{self.total} parts done | best {format_seconds(self.incumbent)} | "
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
