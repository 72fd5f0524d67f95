"""Memory per device of a strategy.

For each operator and configuration, per device q (bytes):

    weights:     sum_W |W tile(q)| * (1 + 1 + m)    (value, gradient, m words of optimizer state)
    activations: |output tile(q)|                   (kept for the backward pass)

(m = 2 for Adam, 0 for plain SGD.) A strategy's memory on device q is the
sum over operators of their chosen configuration's row, and the strategy
needs the maximum over devices. This ranks nothing; it is a constraint.
"""

from __future__ import annotations

import numpy as np

from shardplan.cost.tiles import as_layouts, tile_volumes
from shardplan.ir import Operator
from shardplan.machine import Machine

__all__ = ["operator_memory", "strategy_memory"]


def operator_memory(op: Operator, configs, machine: Machine, optimizer_factor: float = 2.0,
                    orders: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(weight bytes, activation bytes) per layout and device: two (K, p) arrays.

    ``configs``: :class:`~shardplan.layout.LayoutArrays` or configuration rows (with optional ``orders``).
    """
    p = machine.num_devices
    nbytes = machine.dtype_bytes
    lay = as_layouts(configs, p, orders, machine.levels)
    k = len(lay)
    w = np.zeros((k, p))
    for t in op.weights:
        w += tile_volumes(op, t, lay) * t.elem_factor * nbytes * (2.0 + optimizer_factor)
    act = tile_volumes(op, op.output, lay).astype(np.float64) * nbytes
    return w, act


def strategy_memory(per_op: list[tuple[np.ndarray, np.ndarray]], assignment) -> dict[str, float]:
    """Peak bytes over devices of a strategy, and its weight / activation parts on that device."""
    w = sum(m[0][a] for m, a in zip(per_op, assignment))
    act = sum(m[1][a] for m, a in zip(per_op, assignment))
    tot = w + act
    q = int(np.argmax(tot))
    return {"peak_bytes": float(tot[q]), "weights_bytes": float(w[q]), "activations_bytes": float(act[q]),
            "device": q}
