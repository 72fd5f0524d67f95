"""Collectives as NCCL runs them, in the alpha-beta model, vectorised over layouts.

A collective runs among the devices of a group; a :class:`~shardplan.layout.Layout`
says how the group spans the machine's levels: ``g_l`` members per level
(``g_0`` devices inside a node, ``g_1`` nodes, ...; see
:meth:`~shardplan.layout.Layout.group_sizes`). Level l has per-device
bandwidth ``B_l`` and latency ``α_l`` (:attr:`~shardplan.machine.Machine.level_links`).
``n`` is the buffer in bytes (the full result for all-gather, the full input
for reduce-scatter).

One level (``g`` members, ``B``, ``α``):

* ring all-reduce:                 2 (g-1)/g · n / B + 2 (g-1) α
* tree all-reduce (double binary): 2 n / B + 2 ⌈log2 g⌉ α
* ring all-gather / reduce-scatter:  (g-1)/g · n / B + (g-1) α
* point-to-point of n bytes:         n / B + α            (0 when n = 0)

The ring's bandwidth terms are the "bus bandwidth" factors of nccl-tests
(``PERFORMANCE.md``: all-reduce busBw = algBw · 2(n-1)/n, all-gather and
reduce-scatter (n-1)/n): a device sends and receives that many bytes. A
ring's latency grows like g, a tree's like log g, so for small messages
(per-tensor synchronisation of small weights, statistics) the tree wins and
for large ones the ring does: NCCL's tuner estimates each algorithm's time
and picks the fastest per call; we take the minimum of the two formulas
(``algorithm="auto"``; "ring" or "tree" force one). With α = 0 the ring is
never slower, so the reference model (bandwidth only) is reproduced exactly.

Several levels (hierarchical, as NCCL does across nodes): with
``m_l = n / Π_{l' < l} g_{l'}`` the part of the buffer one device carries on
level l,

* all-reduce = reduce-scatter inside the node (level 0), all-reduce across
  nodes on ``n / g_0`` bytes, all-gather inside the node; recursively for
  more levels. A reduce-scatter plus an all-gather on level l cost exactly a
  ring all-reduce there, so
  ``T_hier = Σ_l [2 (g_l-1)/g_l · m_l / B_l + 2 (g_l-1) α_l]``,
  except that the outermost level used (the plain all-reduce in the middle)
  may be a tree; the whole collective may also run as one NCCL tree
  (chain in the node, tree across nodes): ``2 n / min_l B_l + 2 Σ_l ⌈log2 g_l⌉ α_l``;
  all-reduce = the smaller of the two.
* all-gather (result n) = all-gather across the outer levels first, then
  inside: ``Σ_l [(g_l-1)/g_l · m_l / B_l + (g_l-1) α_l]``; reduce-scatter is
  its mirror image and costs the same.

A group that does not fill a node (``g_0`` smaller than the node) still
moves only ``m_l = n / g_0`` per device across nodes: the node's other
devices belong to other groups that run the same collective at the same
time, each over its own network interface (``B_1`` is bandwidth *per
device*, e.g. one 400 Gb/s NIC per H100). Levels with ``g_l = 1`` cost
nothing.
"""

from __future__ import annotations


import numpy as np

from shardplan.errors import ShardplanError
from shardplan.machine import Machine

__all__ = ["ALGORITHMS", "ring_allreduce", "tree_allreduce", "allreduce_time", "allgather_time",
           "reduce_scatter_time", "p2p_time", "level_arrays", "outer_level"]

ALGORITHMS = ("auto", "ring", "tree")


def _f(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def ring_allreduce(nbytes, g, bandwidth: float, latency: float) -> np.ndarray:
    """One level, ring: ``2 (g-1)/g · n / B + 2 (g-1) α`` (0 when g = 1)."""
    g = _f(g)
    t = 2.0 * (g - 1.0) / g * _f(nbytes) / bandwidth + 2.0 * (g - 1.0) * latency
    return np.where(g > 1, t, 0.0)


def tree_allreduce(nbytes, g, bandwidth: float, latency: float) -> np.ndarray:
    """One level, double binary tree: ``2 n / B + 2 ⌈log2 g⌉ α`` (0 when g = 1)."""
    g = _f(g)
    t = 2.0 * _f(nbytes) / bandwidth + 2.0 * np.ceil(np.log2(np.maximum(g, 1.0))) * latency
    return np.where(g > 1, t, 0.0)


def _gather_level(nbytes, g, bandwidth: float, latency: float) -> np.ndarray:
    g = _f(g)
    t = (g - 1.0) / g * _f(nbytes) / bandwidth + (g - 1.0) * latency
    return np.where(g > 1, t, 0.0)


def level_arrays(groups, machine: Machine) -> np.ndarray:
    """Group sizes as a float (L, K) array matching the machine's levels (a 1-D array = one level)."""
    g = _f(groups)
    if g.ndim < 2:
        g = g.reshape(1, -1) if g.ndim == 1 else g.reshape(1, 1)
    n_lv = len(machine.levels)
    if g.shape[0] != n_lv:
        raise ShardplanError(f"collective: group sizes for {g.shape[0]} levels, the machine has {n_lv} "
                             f"({machine.levels})")
    return g


def allreduce_time(nbytes, groups, machine: Machine, algorithm: str = "auto") -> np.ndarray:
    """All-reduce of ``nbytes`` in groups spanning the levels as ``groups`` (L, K) says; seconds (K,)."""
    if algorithm not in ALGORITHMS:
        raise ShardplanError(f"unknown collective algorithm {algorithm!r}; choose from {', '.join(ALGORITHMS)}")
    g = level_arrays(groups, machine)
    n = _f(nbytes) * np.ones(g.shape[1])
    links = machine.level_links
    if len(links) == 1 and algorithm == "auto":
        # one level: the hierarchical sum is that level's min(ring, tree) and the whole-machine tree is the
        # level's tree (the same floating-point operations: 0 + x and a factor of 2 are exact), so
        # min(hier, whole_tree) below is this
        bw, lat = links[0]
        g0 = g[0]
        return np.where(g0 > 1, np.minimum(ring_allreduce(n, g0, bw, lat), tree_allreduce(n, g0, bw, lat)), 0.0)
    used = g > 1
    # outermost level with a group of more than one member, per row (-1: nothing to do)
    top = np.where(used.any(axis=0), g.shape[0] - 1 - np.argmax(used[::-1], axis=0), -1)
    hier = np.zeros_like(n)
    m = n.copy()
    for lvl, (bw, lat) in enumerate(links):
        ring = ring_allreduce(m, g[lvl], bw, lat)
        if algorithm == "ring":
            step = ring
        else:
            tree = tree_allreduce(m, g[lvl], bw, lat)
            step = np.where(top == lvl, np.minimum(ring, tree) if algorithm == "auto" else tree, ring)
        hier += step
        m = m / g[lvl]
    if algorithm == "ring":
        return hier
    bw_min = np.full_like(n, np.inf)
    lat_sum = np.zeros_like(n)
    for lvl, (bw, lat) in enumerate(links):
        bw_min = np.where(used[lvl], np.minimum(bw_min, bw), bw_min)
        lat_sum += np.where(used[lvl], np.ceil(np.log2(np.maximum(g[lvl], 1.0))) * lat, 0.0)
    whole_tree = np.where(top >= 0, 2.0 * n / bw_min + 2.0 * lat_sum, 0.0)
    if algorithm == "tree":
        return whole_tree
    return np.minimum(hier, whole_tree)


def allgather_time(nbytes, groups, machine: Machine) -> np.ndarray:
    """Ring all-gather whose full result is ``nbytes``, hierarchically over the levels; seconds (K,)."""
    g = level_arrays(groups, machine)
    m = _f(nbytes) * np.ones(g.shape[1])
    out = np.zeros_like(m)
    for lvl, (bw, lat) in enumerate(machine.level_links):
        out += _gather_level(m, g[lvl], bw, lat)
        m = m / g[lvl]
    return out


reduce_scatter_time = allgather_time


def p2p_time(nbytes, machine: Machine, level=0) -> np.ndarray:
    """Point-to-point of ``nbytes`` per device over the links of ``level`` (array or scalar)."""
    nbytes = _f(nbytes)
    links = machine.level_links
    if len(links) == 1:
        bw, lat = links[0]
        return np.where(nbytes > 0, nbytes / bw + lat, 0.0)
    lvl = np.minimum(np.asarray(level, dtype=np.int64), len(links) - 1)
    bw = np.asarray([b for b, _ in links])[lvl]
    lat = np.asarray([a for _, a in links])[lvl]
    return np.where(nbytes > 0, nbytes / bw + lat, 0.0)


def outer_level(level_products: np.ndarray) -> np.ndarray:
    """(K,) the outermost level whose grid has more than one tile (0 if none): the links a neighbour
    exchange among a layout's tiles must cross. ``level_products``: (L, K)."""
    used = np.asarray(level_products) > 1
    n_lv = used.shape[0]
    return np.where(used.any(axis=0), n_lv - 1 - np.argmax(used[::-1], axis=0), 0)

