"""The error types: one for bad input, and its subclasses for what does not fit in memory."""

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


class OperatorMemoryError(ShardplanError):
    """An operator needs more than the device's memory under every one of its configurations.

    Raised by the cost-table build's memory filter; callers that try several
    device counts (pipeline stages on sub-meshes) catch this class to drop a
    sub-mesh that is too small.
    """


class PerDeviceLimitError(ShardplanError):
    """The cost model would need per-device tiles (irregular tiles, idle devices) on more devices than its cap.

    Raised by :func:`shardplan.cost.tiles.check_per_device` before anything is allocated; callers that try
    several device counts (pipeline stages on sub-meshes) catch this class to leave that one count out of
    their space, and say so.
    """
