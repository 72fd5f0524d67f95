"""The error types: one for bad input, and its subclass for a table over the memory limit."""

from __future__ import annotations


class ShardplanError(ValueError):
    """Raised for any input shardplan cannot accept.

    The message names the offending object (operator, tensor, vertex, file
    entry) and the problem, so a CLI can print it as one line.
    """


class TableMemoryError(ShardplanError):
    """An exact search refused to build a table larger than its memory limit.

    Raised by the memory guards before any allocation: the cost-table build,
    the DP's and the breadth-first DP's tables, the ILP's program; callers that can live without that solver's answer
    (benchmarks, bound pruning's sub-solves) catch this class.
    """
