"""Configurations: how many ways each iteration dimension is split.

For an operator with dims (d_1..d_n) of extents (E_1..E_n) and p devices,
the valid configurations are the tuples c with

    prod_i c_i <= p,   c_i | E_i,   E_i / c_i >= cutoff  (or c_i = 1),

and c_i = 1 for dimensions the operator marks fixed. ``powers_of_two``
keeps only c_i in {1, 2, 4, ...}; ``divides_p`` keeps only configurations
whose product divides p (those a device mesh over all p devices can
express, see the JAX export). The order is deterministic: lexicographic in
(c_1, ..., c_n).
"""

from __future__ import annotations

import numpy as np

from shardplan.errors import ShardplanError
from shardplan.ir import Operator

__all__ = ["split_choices", "configurations", "dimension_orders", "ORDER_MODES"]


def split_choices(extent: int, p: int, cutoff: int, powers_of_two: bool = False) -> list[int]:
    """Split factors allowed for one dimension: divisors c of ``extent``, c <= p, extent/c >= cutoff."""
    out = [1]
    for c in range(2, min(extent, p) + 1):
        if extent % c or extent // c < cutoff:
            continue
        if powers_of_two and c & (c - 1):
            continue
        out.append(c)
    return out


def configurations(op: Operator, p: int, cutoff: int = 4, powers_of_two: bool = False,
                   divides_p: bool = False) -> np.ndarray:
    """All valid configurations of ``op`` on ``p`` devices, as an int64 array (K, n_dims).

    The all-ones configuration is always valid, so K >= 1.
    """
    if p < 1:
        raise ShardplanError(f"number of devices must be >= 1, got {p}")
    if cutoff < 1:
        raise ShardplanError(f"cutoff must be >= 1, got {cutoff}")
    table = np.ones((1, 0), dtype=np.int64)
    prods = np.ones(1, dtype=np.int64)
    for d, e in op.dims:
        choices = [1] if d in op.fixed else split_choices(e, p, cutoff, powers_of_two)
        ch = np.asarray(choices, dtype=np.int64)
        new_prod = (prods[:, None] * ch[None, :]).ravel()
        keep = new_prod <= p
        rows = np.repeat(table, len(ch), axis=0)
        cols = np.tile(ch, len(table))
        table = np.concatenate([rows, cols[:, None]], axis=1)[keep]
        prods = new_prod[keep]
    if divides_p:
        keep = p % prods == 0
        table, prods = table[keep], prods[keep]
    return table


ORDER_MODES = ("row-major", "all")


def dimension_orders(configs: np.ndarray, mode: str = "all", max_permuted: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """Expand configurations with the nesting order of their device grid.

    A configuration's split factors fix the tile shapes; *which* device
    gets which tile depends on how the grid's dimensions are nested in the
    device numbering (as a device mesh may list its axes in any order).
    Only the order of the split dims (c_d > 1) matters. Modes:

    * ``"row-major"``: the operator's own dimension order only (K' = K);
    * ``"all"``: every order of the split dims when there are at most
      ``max_permuted`` of them, else the own order and its reverse.

    Returns ``(configs', orders)``, both (K', n): ``orders[k]`` lists the
    dims from most to least significant. Rows of one configuration are
    adjacent and start with its own order, so the first row of a split
    tuple is always the row-major one.
    """
    from itertools import permutations

    if mode not in ORDER_MODES:
        raise ShardplanError(f"unknown order mode {mode!r}; choose from {', '.join(ORDER_MODES)}")
    configs = np.asarray(configs, dtype=np.int64)
    k, n = configs.shape
    ident = np.arange(n, dtype=np.int64)
    if mode == "row-major" or n < 2:
        return configs, np.broadcast_to(ident, (k, n)).copy()
    rows, orders = [], []
    for c in configs:
        split = [j for j in range(n) if c[j] > 1]
        rest = [j for j in range(n) if c[j] == 1]
        if len(split) <= max_permuted:
            perms = list(permutations(split))
        else:
            perms = [tuple(split), tuple(reversed(split))]
        for perm in perms:
            rows.append(c)
            orders.append(list(perm) + rest)
    return np.asarray(rows, dtype=np.int64).reshape(-1, n), np.asarray(orders, dtype=np.int64).reshape(-1, n)
