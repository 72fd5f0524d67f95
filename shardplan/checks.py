"""Argument checks shared by the Python API and the command line.

Each check returns the value in its canonical Python type or raises
:class:`~shardplan.errors.ShardplanError` with a one-line message that
starts with ``where`` (a field such as ``machine: peak_flops`` or an option
such as ``--table-memory``), so the caller's name for the value is the one
the user sees. ``bool`` is never accepted as a number (``True`` is an
``int`` to Python, but ``Machine(num_devices=True)`` is not a machine).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from shardplan.errors import ShardplanError

__all__ = ["integer", "real", "MAX_EXTENT", "MAX_VOLUME"]

# The largest extent of one dimension (and batch size) the cost model accepts: tile
# corners, sizes and volumes are int64, and a product of a few extents must stay
# below 2^63; 2^40 (about 1.1e12) leaves that room and is far above any real size.
MAX_EXTENT = 2**40
# The most elements one tensor may hold: the cost model multiplies tile volumes (int64) by the element
# factor, the element size and the optimizer's copies; 2^52 (about 4.5e15, well above the attention scores
# of any real model) keeps those products below 2^63, where int64 would wrap around to a wrong, small size.
MAX_VOLUME = 2**52


def _show(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"


def integer(where: str, x: Any, minimum: int | None = None, maximum: int | None = None) -> int:
    """``x`` as an ``int`` in [minimum, maximum]: an ``int`` or numpy integer (not a bool, not 4.0)."""
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise ShardplanError(f"{where} must be an integer, got {_show(x)}")
    x = int(x)
    if minimum is not None and x < minimum:
        raise ShardplanError(f"{where} must be at least {minimum}, got {x}")
    if maximum is not None and x > maximum:
        raise ShardplanError(f"{where} must be at most {maximum}, got {_show(x)}")
    return x


def real(where: str, x: Any, minimum: float | None = None, maximum: float | None = None,
         positive: bool = False, unit: str = "") -> float:
    """``x`` as a finite ``float`` in [minimum, maximum] (and > 0 when ``positive``)."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise ShardplanError(f"{where} must be a number, got {_show(x)}")
    try:
        v = float(x)
    except OverflowError:
        raise ShardplanError(f"{where} is too large to be a floating-point number ({_show(x)})") from None
    suffix = f" {unit}" if unit else ""
    if not math.isfinite(v):
        raise ShardplanError(f"{where} must be a finite number, got {v!r}")
    if positive and not v > 0:
        raise ShardplanError(f"{where} must be positive, got {v!r}{suffix}")
    if minimum is not None and v < minimum:
        raise ShardplanError(f"{where} must be at least {minimum:g}{suffix}, got {v:g}{suffix}")
    if maximum is not None and v > maximum:
        raise ShardplanError(f"{where} must be at most {maximum:g}{suffix}, got {v:g}{suffix}")
    return v
