"""shardplan: the fastest way to split a DNN training step across devices, found exactly.

>>> import shardplan                                                            # doctest: +SKIP
>>> p = shardplan.plan("gpt", shardplan.preset("h100", 64), sizes={"layers": 8})  # doctest: +SKIP
>>> print(shardplan.render(p))                                                  # doctest: +SKIP

:func:`plan` is the one planning call (layouts, memory choices and pipeline stages searched together) and
:class:`Plan` the one value every path returns; :func:`solve` is the per-operator search of one program
underneath it (a :class:`~shardplan.spmd.SpmdPlan`).
"""

from typing import Any

from shardplan import ops
from shardplan.errors import ShardplanError
from shardplan.ir import Graph, GraphBuilder
from shardplan.machine import Machine, detect_machine, preset
from shardplan.planner import plan
from shardplan.result import Plan
from shardplan.spmd import SpmdPlan, solve

__all__ = ["plan", "Plan", "render", "ShardplanError", "solve", "SpmdPlan", "Machine", "preset", "detect_machine",
           "Graph", "GraphBuilder", "ops"]


def render(plan: Any, operators: bool = False) -> str:
    """The one text report of a plan (:func:`shardplan.report.summary.render_plan`)."""
    from shardplan.report.summary import render_plan

    return render_plan(plan, operators=operators)


def __getattr__(name: str) -> str:
    """``shardplan.__version__``: the installed distribution's version, read from its metadata on first use."""
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("shardplan")
        except PackageNotFoundError:
            return "unknown (not installed)"
    raise AttributeError(f"module 'shardplan' has no attribute {name!r}")
