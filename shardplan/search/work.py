"""Work units of a whole planning call: the budget that stops it, counted from sizes the input fixes.

A :class:`WorkBudget` counts the work of one :func:`shardplan.plan` call in work units charged from sizes the
input fixes (the fit searches' own ``stats["work"]``, :mod:`shardplan.search.constrained`; the pipeline DPs'
states, the graphs built, the solve-free floors and the stage tables; never a clock). Once the units charged
reach its limit, the next charge raises :class:`WorkLimitReached`, a :class:`KeyboardInterrupt`, so every search
stops by the path Ctrl-C takes, at the same point on an idle and a busy machine (``docs/pipeline.md``, *A work
budget for the whole call*). It lives with the solvers so that the fit search, below the pipeline search, can
charge it.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

__all__ = ["WorkBudget", "WorkLimitReached", "PLAN_WORK_LIMIT", "table_work", "choice_work"]


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
