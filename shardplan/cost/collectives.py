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
  (every latency term counts NCCL's ring steps; see below)
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

Several levels (levels ordered inside out, ``g_0`` devices of a node first): with
``m_l = n / Π_{l' < l} g_{l'}`` the part of the buffer one device carries on
level l, and ``P_l = Π_{l' >= l} g_{l'}`` (``P_L = 1``),

* bandwidth: ``Σ_l (g_l-1)/g_l · m_l / B_l`` for all-gather and reduce-scatter,
  twice that for the ring all-reduce (each level's links carry their share;
  the network's share is ``1/g_0`` of the buffer per device, one NIC each);
* latency, as NCCL's ring runs it: one ring through all ``P_0`` ranks, ``P_0 - 1``
  steps per pass (all-gather, reduce-scatter; two passes for all-reduce), every
  step paying its link's latency: ``P_l - P_{l+1}`` steps have level l as the
  outermost link they cross, so a pass costs ``Σ_l (P_l - P_{l+1}) α_l``. For 8 × 192
  GPUs that is 1,344 α_0 + 191 α_1, not 7 α_0 + 191 α_1: a chunk makes every hop
  of the ring before the collective is done, and 7 of each node's 8 hops are
  NVLink hops. Source: NCCL's tuning model (``src/graph/tuning.cc``,
  ``ncclTopoTuneModel``, NVIDIA/nccl v2.9 to 2.2x): for the ring,
  ``nsteps = nRanks - 1`` (all-gather, reduce-scatter) or ``2 (nRanks - 1)``
  (all-reduce), ``nInterSteps = nNodes - 1`` (or ``2 (nNodes - 1)``), latency
  ``baseLat + (nsteps - nInterSteps) · intraLat + nInterSteps · interLat``
  with the per-step ``hwLat`` of NVLink (or PCI) and of the network. Not
  modelled: NCCL's per-call ``baseLat`` (8.4 us for the ring's Simple protocol;
  3.6 to 10 us for LL / LL128) and its per-protocol step latencies (one
  ``α_l`` per level here; the machine files state which protocol's value
  theirs matches), and the floor NCCL puts under an intra-node step of a
  multi-node ring (``netOverhead``, 1 or 2 us, times 3 for Simple);
* all-reduce = the smaller of that ring and one NCCL tree over everything
  (chain in the node, tree across nodes): ``Σ_l [2 m_l / B_l + 2 ⌈log2 g_l⌉ α_l]``
  over the levels with ``g_l > 1``. The network carries the same ``1/g_0`` share
  per device as the ring's: NCCL's model gives the tree and the ring the same
  bus bandwidth, ``nChannels`` times one channel's, its channels spread over the
  node's NICs (``busBw = nChannels * bw``; the tree's algorithm bandwidth is half
  of it: 2 n of traffic). The tree's latency counts ``⌈log2 g_0⌉`` steps in the
  node where NCCL's model counts the chain's ``g_0 - 1`` (and ``floor(log2)``
  across nodes): the in-node part is optimistic by at most
  ``2 (g_0 - 1 - ⌈log2 g_0⌉) α_0``.

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
           "reduce_scatter_time", "p2p_time", "level_arrays", "outer_level", "ring_steps", "ring_latency"]

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


def _gather_bandwidth(nbytes, g, bandwidth: float) -> np.ndarray:
    g = _f(g)
    return np.where(g > 1, (g - 1.0) / g * _f(nbytes) / bandwidth, 0.0)


def ring_steps(groups) -> np.ndarray:
    """(L, K) steps of one ring pass over a group of ``groups`` (L, K) members per level, per level crossed.

    Ranks are ordered level by level (a node's devices next to each other), so with
    ``P_l = Π_{l' >= l} g_{l'}`` (``P_L = 1``) a ring of ``P_0`` ranks has ``P_0 - 1`` steps of which
    ``P_l - P_{l+1}`` cross level l as their outermost link: for 8 × 192 GPUs, 1,344 NVLink steps and
    191 network steps (NCCL's ``nsteps - nInterSteps`` and ``nInterSteps``).
    """
    g = _f(groups)
    p = np.cumprod(g[::-1], axis=0)[::-1]  # P_l
    nxt = np.concatenate([p[1:], np.ones((1,) + p.shape[1:])], axis=0)
    return p - nxt


def ring_latency(groups, latencies) -> np.ndarray:
    """(K,) seconds of latency of one ring pass: ``Σ_l (P_l - P_{l+1}) α_l`` (:func:`ring_steps`)."""
    steps = ring_steps(groups)
    return sum((steps[lvl] * float(a) for lvl, a in enumerate(latencies)), np.zeros(steps.shape[1:]))


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
        # one level: the ring below is the level's ring (P_0 - P_1 = g - 1 steps) and the whole-machine
        # tree is the level's tree, so min(ring, whole_tree) below is this
        bw, lat = links[0]
        g0 = g[0]
        return np.where(g0 > 1, np.minimum(ring_allreduce(n, g0, bw, lat), tree_allreduce(n, g0, bw, lat)), 0.0)
    used = g > 1
    lats = [lat for _, lat in links]
    # one NCCL ring over every member: the hierarchical bandwidth terms, 2 (P_0 - 1) latency steps
    ring = 2.0 * ring_latency(g, lats)
    m = n.copy()
    for lvl, (bw, _) in enumerate(links):
        ring = ring + 2.0 * _gather_bandwidth(m, g[lvl], bw)
        m = m / g[lvl]
    if algorithm == "ring":
        return ring
    # one NCCL tree: each used level moves 2 m_l per device over its links (the node's share of the
    # buffer split over its devices' links, as the ring's), ceil(log2 g_l) latencies each way
    whole_tree = np.zeros_like(n)
    m = n.copy()
    for lvl, (bw, lat) in enumerate(links):
        whole_tree += np.where(used[lvl], 2.0 * m / bw + 2.0 * np.ceil(np.log2(np.maximum(g[lvl], 1.0))) * lat,
                               0.0)
        m = m / g[lvl]
    if algorithm == "tree":
        return whole_tree
    return np.minimum(ring, whole_tree)


def allgather_time(nbytes, groups, machine: Machine) -> np.ndarray:
    """Ring all-gather whose full result is ``nbytes``: the levels' bandwidth terms plus the latency of
    all ``P_0 - 1`` ring steps (:func:`ring_latency`); seconds (K,)."""
    g = level_arrays(groups, machine)
    m = _f(nbytes) * np.ones(g.shape[1])
    links = machine.level_links
    out = ring_latency(g, [lat for _, lat in links])
    for lvl, (bw, _) in enumerate(links):
        out = out + _gather_bandwidth(m, g[lvl], bw)
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

