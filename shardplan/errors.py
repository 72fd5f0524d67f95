"""The one error type for bad input."""

from __future__ import annotations


class ShardplanError(ValueError):
    """Raised for any input shardplan cannot accept.

    The message names the offending object (operator, tensor, vertex, file
    entry) and the problem, so a CLI can print it as one line.
    """
