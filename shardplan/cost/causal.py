"""The work of an operator under a causal mask (:class:`~shardplan.ir.Causal`), per layout.

Only the points with ``key <= query`` do work. For a sequence of ``S`` split ``c`` ways along the query
(the key whole), the busiest device's share of its tile's work is ``(S + 1) / 2S`` when the sequence is
balanced (``2c`` chunks, block i holding chunks i and 2c - 1 - i: every device the same) and
``(2S - S/c + 1) / 2S`` for contiguous blocks (the last block's queries see all keys before them).
:func:`block_work` counts the pairs exactly for any two splits; docs/cost-model.md, "Ring context
parallelism", derives both shares.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from shardplan.errors import ShardplanError
from shardplan.ir import Operator

__all__ = ["balanced_positions", "block_work", "causal_fractions", "device_work"]


def _blocks(extent: int, c: int, balanced: bool) -> list[list[tuple[int, int]]]:
    """The positions of each of ``c`` blocks of a sequence of ``extent``: intervals [lo, hi). Balanced (and
    ``2c`` dividing the extent): block i holds chunks i and 2c - 1 - i of 2c; else contiguous blocks."""
    if balanced and c > 1 and extent % (2 * c) == 0:
        h = extent // (2 * c)
        return [[(i * h, (i + 1) * h), ((2 * c - 1 - i) * h, (2 * c - i) * h)] for i in range(c)]
    n = extent // c
    return [[(i * n, (i + 1) * n)] for i in range(c)]


def _pairs(a: int, b: int, lo: int, hi: int) -> int:
    """#{(p, q): a <= p < b, lo <= q < hi, q <= p}: sum over p of min(max(p + 1 - lo, 0), hi - lo)."""
    n = hi - lo

    def prefix(x: int) -> int:  # the sum over 0 <= p < x
        m = x - lo
        if m <= 0:
            return 0
        if m <= n:
            return m * (m + 1) // 2
        return n * (n + 1) // 2 + (m - n) * n

    return prefix(b) - prefix(a)


@lru_cache(maxsize=1024)
def block_work(extent: int, cq: int, ck: int, balanced: bool) -> np.ndarray:
    """(cq, ck) float: the share of the points of (query block i) x (key block j) with key <= query, the
    sequence of ``extent`` split ``cq`` ways along the query and ``ck`` along the key (:func:`_blocks`)."""
    qs, ks = _blocks(extent, cq, balanced), _blocks(extent, ck, balanced)
    out = np.zeros((cq, ck))
    for i, qb in enumerate(qs):
        nq = sum(h - lo for lo, h in qb)
        for j, kb in enumerate(ks):
            nk = sum(h - lo for lo, h in kb)
            out[i, j] = sum(_pairs(a, b, lo, hi) for a, b in qb for lo, hi in kb) / (nq * nk)
    out.setflags(write=False)  # cached: shared by every caller
    return out


def causal_fractions(op: Operator, splits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per layout (rows of ``splits``, (K, n) total splits per dim): ``(total, step)``, the busiest device's
    share of its tile's work under ``op.causal`` (1 without a mask), and the busiest share of one ring
    block of another device's keys (the query split ``cq`` ways, the keys of the ring in ``cq`` blocks of the
    same arrangement: the largest off-diagonal entry of :func:`block_work`; 1 without a mask)."""
    splits = np.asarray(splits, dtype=np.int64)
    k = len(splits)
    total, step = np.ones(k), np.ones(k)
    mask = op.causal
    if mask is None:
        return total, step
    names = op.dim_names
    extent = op.extents[mask.query]
    iq, ik = names.index(mask.query), names.index(mask.key)
    for cq, ck in {(int(a), int(b)) for a, b in splits[:, [iq, ik]]}:
        rows = (splits[:, iq] == cq) & (splits[:, ik] == ck)
        total[rows] = block_work(extent, cq, ck, mask.balanced).max()
        ring = block_work(extent, cq, cq, mask.balanced)
        off = ring[~np.eye(cq, dtype=bool)]
        step[rows] = off.max() if len(off) else ring.max()
    return total, step


def balanced_positions(seq: int, ways: int, balanced: bool = True) -> np.ndarray:
    """(ways, seq / ways) int: the sequence positions device (rank) i holds, in the order it holds them. Balanced
    (``2 ways`` dividing ``seq``): chunks i and 2 ways - 1 - i of 2 ways; else the i-th contiguous block."""
    if seq % ways:
        raise ShardplanError(f"a sequence of {seq} does not split {ways} ways")
    if balanced and seq % (2 * ways) == 0:
        h = seq // (2 * ways)
        return np.stack([np.concatenate([np.arange(i * h, (i + 1) * h),
                                         np.arange((2 * ways - 1 - i) * h, (2 * ways - i) * h)])
                         for i in range(ways)])
    return np.arange(seq).reshape(ways, seq // ways)


def device_work(seq: int, ways: int, balanced: bool = True) -> np.ndarray:
    """(ways,) the (query, key) pairs with key <= query that each device's ring computes on."""
    pos = balanced_positions(seq, ways, balanced)
    return np.asarray([(pos[i][:, None] >= np.arange(seq)[None, :]).sum() for i in range(ways)])
