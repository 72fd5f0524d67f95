"""How many bytes building the cost tables needs, known before anything big is allocated.

Where an operator's tiles are regular and every device works
(:func:`~shardplan.cost.tiles.uniform_tiles`), the build holds no per-device
array: its costs are vectors over the K layouts, its memory tables one
column (16 K bytes), and an edge between two such ends
(:func:`~shardplan.cost.edge._pattern_side`) is decided from block patterns,
about 28 int64-sized (K_u, K_v) arrays at its worst point, beside the pattern
summaries the edges share (at most ``EDGE_MEMO_BYTES``, as on the per-device path). Otherwise the build
works on per-device arrays: for an operator with K configurations
on p devices, the device grid is a (K, p, n_dims) int64 array and every tile
a (K, p, n_axes, 2) int64 array; for an edge, the fast path tests device bit-masks
per axis and per pattern and the general path intersects boxes
in chunks. What the build *keeps* grows with it: per operator the (K, p)
memory tables (weights, activations: 16 K p bytes) and the cost vectors, per
edge its (K_u, K_v) float64 matrix. So the peak of the whole build is

    max over phases i of ( kept before i + peak of phase i ) ,

with phases in build order: every distinct operator's memory tables and
costs, every distinct edge (plus, during the edges, the fast-path summaries
they share, at most ``EDGE_MEMO_BYTES``). The per-phase peaks below are upper bounds
read off the code of :mod:`shardplan.cost.tiles`, :mod:`~shardplan.cost.memory`,
:mod:`~shardplan.cost.operator` and :mod:`~shardplan.cost.edge` (each counts
the arrays alive at once at the worst point, plus numpy's temporaries), and
are checked against measured peak RSS in tests/test_memory_guards.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Mapping, Sequence

import numpy as np

from shardplan.cost.edge import EDGE_MEMO_BYTES, weight_views
from shardplan.cost.tiles import MAX_DEVICES, check_per_device
from shardplan.ir import Graph, Operator
from shardplan.layout import unique_rows

__all__ = ["BuildEstimate", "estimate_build", "operator_phase_bytes", "edge_phase_bytes", "uniform_operator",
           "pattern_edge", "pattern_edge_bytes"]

# The general edge path works on chunks of about 2^22 (pair, device[, axis]) entries (edge._CHUNK_ELEMS):
# int32 bounds and their temporaries, an int64 product and an int64 difference per entry.
CHUNK_ENTRIES = 1 << 22
CHUNK_BYTES_PER_ENTRY = 48
PARTS_BOUND = range(12)  # per-configuration cost vectors an OpCost keeps (at most)
_SMALL = 1 << 20  # small arrays (configurations, orders, per-configuration vectors) and allocator slack


@dataclass(frozen=True)
class BuildEstimate:
    """Upper bound of the build's peak bytes and where it is reached.

    Attributes:
        peak_bytes: max over phases of kept + phase peak.
        phase: the phase at the peak ("memory of conv1", "costs of fc1", "edge conv2 -> pool2").
        operator: the operator of that phase (the consumer for an edge).
        configurations: its configuration count (K_u x K_v for an edge, as "K_u x K_v").
        kept_bytes: bytes the finished tables hold at the end of the build.
    """

    peak_bytes: int
    phase: str
    operator: str
    configurations: str
    kept_bytes: int


def _axes(op: Operator) -> int:
    return max([len(t.axes) for t in op.tensors] + [1])


def uniform_operator(op: Operator, lay) -> bool:
    """Whether every tensor of ``op`` has the same tile on every device under every layout of ``lay``
    (:func:`~shardplan.cost.tiles.uniform_tiles`): its phase then holds no per-device array."""
    from shardplan.cost.tiles import all_active, regular_tile_lengths

    if not all_active(lay).all():
        return False
    return all(regular_tile_lengths(op, t, lay.splits) is not None for t in op.tensors)


def pattern_edge(u: Operator, lu, v: Operator, slot: int, lv, sides: dict | None = None) -> bool:
    """Whether the edge u -> v (input ``slot``) is decided from block patterns, with no per-device array
    (:func:`~shardplan.cost.edge._pattern_side` applies to both ends). ``sides``: a dict the caller keeps
    while it holds ``lu`` and ``lv``, in which each end's answer is kept (edges share their ends)."""
    from shardplan.cost.edge import pattern_applies

    if lu.partial is not None or lv.partial is not None:  # deferred reductions are costed on per-device boxes
        return False

    def applies(op: Operator, t, lay) -> bool:
        if sides is None:
            return pattern_applies(op, t, lay)
        key = (id(lay), op.dims, t.shape, t.axes)
        if key not in sides:
            sides[key] = pattern_applies(op, t, lay)
        return sides[key]

    return applies(u, u.output, lu) and applies(v, v.inputs[slot], lv)


def pattern_edge_bytes(ku: int, kv: int, n_axes: int, n_levels: int) -> int:
    """Peak bytes of an edge decided from block patterns (:func:`pattern_edge`): per axis the pattern rows and
    the (P_u, P_v) match (P at most K) with its int64 temporaries, then about 28 int64-sized (K_u, K_v) arrays
    alive at once (the match expanded to every pair, overlaps, the two volumes, their seconds per level and
    maxima, the deferred and exposed terms)."""
    pairs = ku * kv
    return pairs * 8 * 28 + 8 * (ku + kv) * (2 * n_levels + 2) * max(n_axes, 1) + _SMALL


def operator_phase_bytes(op: Operator, k: int, p: int) -> int:
    """Peak bytes of :func:`operator_memory` or :func:`operator_cost` for one operator (the larger).

    Alive at the worst point, in units of one (K, p) int64 array (8 K p bytes):
    the device grid (n, and n more while its modulo is taken), two tiles of
    the widest tensor (2 x 2A: halo exchange keeps the needed and the owned
    tile) with their volumes (A), up to 12 per-axis temporaries of
    :func:`tensor_boxes` and of the node-crossing test, and the accumulated
    results; plus the (K, p) bool activity mask.
    """
    n, a = len(op.dims), _axes(op)
    return 8 * k * p * (2 * n + 5 * a + 16) + k * p + _SMALL


def edge_phase_bytes(u: Operator, ku: int, v: Operator, kv: int, p: int,
                     patterns: tuple[int, int] | None = None) -> int:
    """Peak bytes of :func:`edge_cost` for an edge with K_u x K_v configuration pairs.

    Fast path: per axis the pattern match (P_u, P_v, p) built from int64 block
    indices (``patterns`` = (P_u, P_v), at most (K_u, K_v)), the per-axis
    tests of each pattern of one end against each (pattern, active set) of the
    other, (P_u, K_v, W) and (K_u, P_v, W) uint64 words with W = ceil(p / 64)
    and two temporaries each, and about twelve (K_u, K_v) int64 arrays
    (overlaps, flags, volumes, times; the boolean tests are smaller). General
    path: both ends' tiles with their int64 and int32 copies and temporaries,
    and one chunk.
    """
    words = (p + 63) // 64
    pairs = ku * kv
    pu, pv = patterns if patterns is not None else (ku, kv)
    fast = (pu * kv + ku * pv) * words * 8 * 3 + pu * pv * p * 26 + pairs * 8 * 12
    au, av = len(u.output.axes), max(len(t.axes) for t in v.inputs)
    nu, nv = len(u.dims), len(v.dims)
    # tiles of both ends (with the grid and temporaries of the one being built), then their int32 copies
    tiles = 8 * p * (ku * (3 * au + 2 * nu + 14) + kv * (3 * av + 2 * nv + 14))
    chunk = min(pairs * p * max(au, av, 1), max(CHUNK_ENTRIES, kv * p)) * CHUNK_BYTES_PER_ENTRY
    # + the cost matrices of edge_cost: on several levels the per-level volumes and maxima of both directions
    return fast + tiles + chunk + pairs * 8 * 10 + _SMALL


def _patterns(op: Operator, tensor, arr) -> int:
    """The largest number of distinct block patterns (split and per-level stride pattern) over the tensor's axes."""
    from shardplan.cost.edge import _axis_blocks

    if not len(arr):
        return 0
    splits, pats, _, _, _, _ = _axis_blocks(op, tensor, arr)
    best = 1
    for ax in range(splits.shape[0]):
        rows = np.concatenate([splits[ax][:, None], pats[ax]], axis=1)
        best = max(best, len(unique_rows(rows)[0]))
    return best


def estimate_build(graph: Graph, keys: Sequence[Hashable], arrays: Mapping[Hashable, object], p: int,
                   count_patterns: bool = True, max_devices: int = MAX_DEVICES) -> BuildEstimate:
    """Upper bound of the peak bytes of :func:`~shardplan.cost.build_tables` for these candidate layouts.

    ``keys[i]``: operator i's key (identical operators share one, and the
    build costs them once); ``arrays[key]``: that key's candidate layouts
    (:class:`~shardplan.layout.LayoutArrays`), as the build will cost them
    (before any are dropped for device memory, so the bound holds either way).
    Identical edges (same keys at both ends, same input slot) are costed once.
    ``count_patterns=False`` takes every layout as its own block pattern
    (P = K in :func:`edge_phase_bytes`): a looser bound that needs no pass
    over the layouts. An edge that would need per-device tiles on more than ``max_devices`` devices is refused
    here (:func:`~shardplan.cost.tiles.check_per_device`), before anything is built.
    """
    ops = graph.operators
    first: dict[Hashable, int] = {}
    for i, key in enumerate(keys):
        first.setdefault(key, i)
    ks = {key: len(arrays[key]) for key in first}
    kept = 0
    best = (0, "", "", "")
    for key, i in first.items():  # per distinct operator: memory tables (two (K, p) float64) and cost vectors
        op = ops[i]
        per = 1 if uniform_operator(op, arrays[key]) else p  # one column where every device holds the same
        need = kept + operator_phase_bytes(op, ks[key], per)
        best = max(best, (need, f"costs of {op.name}", op.name, str(ks[key])))
        kept += 16 * ks[key] * per + 8 * len(PARTS_BOUND) * ks[key]
    out_patterns: dict[Hashable, int] = {}
    sides: dict[tuple, bool] = {}  # pattern_edge's answer per end (``arrays`` holds every layouts object)
    seen: set[tuple] = set()
    for e in graph.edges:
        ku_key, kv_key = keys[e.src], keys[e.dst]
        if (ku_key, kv_key, e.slot) in seen:
            continue
        seen.add((ku_key, kv_key, e.slot))
        u, v = ops[e.src], ops[e.dst]
        ku, kv = ks[ku_key], ks[kv_key]
        if pattern_edge(u, arrays[ku_key], v, e.slot, arrays[kv_key], sides):
            n_lv = len(arrays[ku_key].levels)
            # + the pattern summaries the edges share (edge.EdgeMemo, at most EDGE_MEMO_BYTES)
            need = kept + EDGE_MEMO_BYTES + pattern_edge_bytes(ku, kv, len(v.inputs[e.slot].axes), n_lv)
            best = max(best, (need, f"edge {u.name} -> {v.name}", v.name, f"{ku} x {kv}"))
            kept += 8 * ku * kv
            continue
        # the edge will be costed per device (edge.edge_volumes refuses that past the cap): say so now
        check_per_device(p, f"the tiles of the edge {u.name!r} -> {v.name!r} (uneven blocks, pieces, idle devices, "
                            "partial sums or splits that are not powers of two)", max_devices)
        if not count_patterns:
            out_patterns[ku_key], pv = ku, kv
        else:
            if ku_key not in out_patterns:
                out_patterns[ku_key] = _patterns(u, u.output, arrays[ku_key])
            pv = _patterns(v, v.inputs[e.slot], arrays[kv_key])
        # + the fast-path summaries the edges share (edge.EdgeMemo, at most EDGE_MEMO_BYTES)
        need = kept + EDGE_MEMO_BYTES + edge_phase_bytes(u, ku, v, kv, p, (out_patterns[ku_key], pv))
        best = max(best, (need, f"edge {u.name} -> {v.name}", v.name, f"{ku} x {kv}"))
        kept += 8 * ku * kv
    for w in graph.weight_edges:  # a weight edge is an edge carrying the parameter (its patterns at most K)
        u, v = weight_views(ops[w.src], w.src_weight, ops[w.dst], w.dst_weight)
        ku, kv = ks[keys[w.src]], ks[keys[w.dst]]
        lu, lv = arrays[keys[w.src]].without_partial(), arrays[keys[w.dst]].without_partial()
        if pattern_edge(u, lu, v, 0, lv):
            need = kept + EDGE_MEMO_BYTES + pattern_edge_bytes(ku, kv, len(v.inputs[0].axes), len(lu.levels))
        else:
            check_per_device(p, f"the tiles of the shared weight {u.name!r} -> {v.name!r}", max_devices)
            need = kept + EDGE_MEMO_BYTES + edge_phase_bytes(u, ku, v, kv, p)
        best = max(best, (need, f"weight edge {u.name} -> {v.name}", v.name, f"{ku} x {kv}"))
        kept += 8 * ku * kv
    return BuildEstimate(int(best[0]), best[1], best[2], best[3], int(kept))
