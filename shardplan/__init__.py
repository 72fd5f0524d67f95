"""shardplan: exact search for the fastest way to split a DNN training step.

>>> from shardplan import solve, preset                     # doctest: +SKIP
>>> from shardplan.models import get_model                  # doctest: +SKIP
>>> plan = solve(get_model("alexnet"), preset("paper", 32))  # doctest: +SKIP
"""

from shardplan import ops
from shardplan.errors import ShardplanError
from shardplan.ir import Graph, GraphBuilder
from shardplan.machine import Machine, preset
from shardplan.plan import Plan, solve

__all__ = ["ShardplanError", "solve", "Plan", "Machine", "preset", "Graph", "GraphBuilder", "ops"]


def __getattr__(name: str) -> str:
    """``shardplan.__version__``: the installed distribution's version, read from its metadata on first use."""
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("shardplan")
        except PackageNotFoundError:
            return "unknown (not installed)"
    raise AttributeError(f"module 'shardplan' has no attribute {name!r}")
