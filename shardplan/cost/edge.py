"""t_x(u, c_u, v, c_v): redistribution cost of one edge, for every pair of configurations.

For an edge u -> v carrying tensor T, let A_u(q) be the box of T that device
q holds after u (u's output tile, replicated over u's dims that do not
index T) and A_v(q) the box v needs there (its core input tile; halos are
part of v's own cost). Under the shared row-major device numbering:

    forward  = max_q |A_v(q)| - |A_v(q) ∩ A_u(q)|
    backward = max_q |A_u(q) ∩ R| - |A_u(q) ∩ A_v(q)|     (if T needs a gradient)

with R the part of T that v reads at all (all of T, except for a slice or
a piece of a split: the gradient of the rest of u's tile comes from u's
other consumers, not over this edge; see :func:`_clip_to_read`)

in elements; times bytes per element over the link bandwidth (+ alpha per
direction that moves anything). The intersection is exact: boxes
intersect axis by axis. This is the paper's definition, computed exactly
instead of the reference prototype's shortcut (zero overlap whenever v
uses more devices than u). Layouts may span several machine levels
(:mod:`shardplan.layout`): the device numbering is the machine's, shared by
both operators. Which links an exchange uses is decided per level from the
same exact volumes: what a device misses from everything its node (its
level-l group) holds must cross the next level's links (:func:`edge_cost`).

Fast path: when every axis of both layouts is cut into equal blocks and,
axis by axis, one split divides the other (nested blocks), a device's
overlap is either the smaller block on every axis or nothing. The edge
then needs only, per pair of configurations, whether *every* device has
the matching block: one 64-bit mask per device word and axis, ANDed
across axes. A concatenation piece (an offset axis) is in that case where
the consumer's blocks along the joined dim tile the piece, or one block
holds all of it: a device then holds one block of the piece, split
accordingly, or nothing (:func:`_piece_blocks`). Pairs outside these cases
(uneven blocks, pieces cut unevenly, splits that do not nest) take the
general path: the pairwise box intersection over (K_u, K_v, p), in chunks,
one axis at a time. Both give the same numbers where both apply (tested).

Deferred reductions (:attr:`shardplan.layout.Layout.partial`; the math in
docs/cost-model.md). When u's layout leaves its output as partial sums over
its reduction group G (g devices, ``g_l`` per level, each holding u's whole
output tile of n bytes), the edge charges the reduction v's layout needs,
forward, the cheaper of

* all-reduce among G, then the ordinary redistribution from u's tile:
  ``AR(n, G) + fwd``;
* reduce-scatter among G, when v's tiles *scatter* u's tile over G (every
  device's tile of T under v lies inside its tile under u and is 1/h of it,
  h > 1 dividing g, and each group holds h different tiles, each on g/h of
  its devices: :func:`scatters`), then the all-gather of each tile among its
  g/h devices: ``RS(n, G) + AG(n / h, S)`` (``AG = 0`` when h = g).

The gradient of an all-reduce of partial sums is the output gradient on
every member (nothing more than the ordinary backward redistribution into
u's tile, which is charged as for any edge); the gradient of a
reduce-scatter is an all-gather of the gradient tiles into u's tile, which
is that same backward redistribution (v's tiles of the gradient to u's
whole tile): the backward term is unchanged. Mirror image, backward: when
v's layout leaves the gradient of its input ``slot`` as partial sums over
that input's gradient group G_v, the edge charges ``AR(n_v, G_v) + bwd``, or
``RS(n_v, G_v) + AG(n_v / h, S)`` where u's tiles scatter v's over G_v. A partial output read
by several consumers is reduced on each edge (each consumer reduces its own
copy), an upper bound of sharing one reduction.

Overlapped tensor-parallel collectives (``build_tables(..., overlap_tp=True)``; the math in
docs/cost-model.md). A contraction (a GEMM) may lend its compute to one edge: the collective on that edge is
cut into g chunks that run while the GEMM computes the chunks before them, which exposes
``max(C - G (g-1)/g, 0)`` of a collective of C seconds beside a GEMM pass of G seconds
(:func:`overlap_budgets` gives ``G (g-1)/g`` per layout; :func:`edge_cost` takes it as ``hide``). Which edge
a GEMM lends to depends on its own layout and on the graph only, so every edge cost stays a function of its
two layouts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from shardplan.configs import deferred_inputs, forward_deferrable
from shardplan.cost.reshard import MAX_BITS, canonical_pairs, canonical_volume, pattern_bits
from shardplan.cost.collectives import allgather_time, allreduce_time, outer_level, p2p_time, reduce_scatter_time
from shardplan.cost.contention import exposed_beside
from shardplan.cost.tiles import (MAX_DEVICES, all_active, as_layouts, box_volumes, check_per_device, stored_weight,
                                  tensor_boxes)
from shardplan.errors import ShardplanError
from shardplan.ir import Operator
from shardplan.layout import LayoutArrays, pattern_blocks, unique_rows
from shardplan.machine import Machine

__all__ = ["edge_volumes", "edge_cost", "overlap_budgets", "chunk_extras", "chunk_dims", "exposed", "NO_CLAIM",
           "deferred_reductions", "scatters", "sender_level", "group_union", "EdgeMemo", "EDGE_MEMO_BYTES",
           "step_volumes", "weight_edge_cost", "weight_sync", "weight_views", "pattern_applies"]

_CHUNK_ELEMS = 1 << 22
EDGE_MEMO_BYTES = 16 << 20  # fast-path summaries kept across the edges of one build (at most)


def _overlap(lu: np.ndarray, hu: np.ndarray, lv: np.ndarray, hv: np.ndarray, dtype=np.int64) -> np.ndarray:
    """Points in the intersection of every u box with every v box: (Ku, Kv, p), of ``dtype``.

    Inputs are per-axis bounds of shape (A, K, p); the product over axes is
    accumulated axis by axis (contiguous, no trailing small-axis reductions).
    ``dtype`` must hold the largest box volume (the product never exceeds it).
    """
    out = None
    for a in range(lu.shape[0]):
        ov = np.minimum(hu[a][:, None, :], hv[a][None, :, :])
        ov -= np.maximum(lu[a][:, None, :], lv[a][None, :, :])
        np.maximum(ov, 0, out=ov)
        if out is None:
            out = ov.astype(dtype, copy=False)
        else:
            out *= ov
    if out is None:  # scalar tensors: one point, held wherever the device is active
        out = np.ones((lu.shape[1], lv.shape[1], lu.shape[2]), dtype=dtype)
    return out


def _general(bu: np.ndarray, bv: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exact moved volumes from boxes (K_u, p, A, 2) and (K_v, p, A, 2): forward and backward (K_u, K_v)."""
    have = box_volumes(bu)
    need = box_volumes(bv)
    lu, hu = (np.ascontiguousarray(bu[..., i].transpose(2, 0, 1)).astype(np.int32) for i in (0, 1))
    lv, hv = (np.ascontiguousarray(bv[..., i].transpose(2, 0, 1)).astype(np.int32) for i in (0, 1))
    n_u, n_v, p = len(bu), len(bv), bu.shape[1]
    fwd = np.empty((n_u, n_v), dtype=np.int64)
    bwd = np.empty((n_u, n_v), dtype=np.int64)
    # every intersection is at most the smaller box: int32 arithmetic when every box fits
    small = max(int(have.max(initial=0)), int(need.max(initial=0))) < 2**31
    dtype = np.int32 if small else np.int64
    if small:
        have, need = have.astype(np.int32), need.astype(np.int32)
    step = max(1, _CHUNK_ELEMS // max(1, n_v * p))
    for s in range(0, n_u, step):
        sl = slice(s, s + step)
        inter = _overlap(lu[:, sl], hu[:, sl], lv, hv, dtype)  # (c, Kv, p)
        fwd[sl] = (need[None] - inter).max(axis=-1)
        bwd[sl] = (have[sl, None] - inter).max(axis=-1)
    return fwd, bwd


def _general_pairs(bu: np.ndarray, bv: np.ndarray, iu: np.ndarray, iv: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exact moved volumes for the listed pairs (iu[n], iv[n]) only: forward and backward (n,)."""
    have = box_volumes(bu)
    need = box_volumes(bv)
    p, n_ax = bu.shape[1], bu.shape[2]
    fwd = np.empty(len(iu), dtype=np.int64)
    bwd = np.empty(len(iu), dtype=np.int64)
    step = max(1, _CHUNK_ELEMS // max(1, p * max(1, n_ax)))
    for s in range(0, len(iu), step):
        a, b = iu[s:s + step], iv[s:s + step]
        lo = np.maximum(bu[a, ..., 0], bv[b, ..., 0])
        hi = np.minimum(bu[a, ..., 1], bv[b, ..., 1])
        inter = np.prod(np.maximum(hi - lo, 0), axis=-1)  # (c, p)
        fwd[s:s + step] = (need[b] - inter).max(axis=-1)
        bwd[s:s + step] = (have[a] - inter).max(axis=-1)
    return fwd, bwd


def _clip_to_read(bu: np.ndarray, bv: np.ndarray) -> np.ndarray:
    """Producer boxes (K_u, p, A, 2) cut to R, the box of T the consumer reads at all (its boxes' hull).

    Backward, the consumer sends the producer the gradient of the part of T it
    read; the producer's gradient on the rest of its tile comes from its other
    consumers (the other pieces of a split, of a slice) or is zero, not over
    this edge. So the backward volume is ``|A_u(q) ∩ R| - |A_u(q) ∩ A_v(q)|``;
    forward, ``A_v(q) ⊆ R`` and nothing changes. For a consumer that reads
    all of T, R is T.
    """
    if bv.shape[2] == 0:
        return bu
    live = box_volumes(bv) > 0  # (K_v, p): idle devices hold empty boxes
    if not live.any():
        return bu
    lo = bv[..., 0][live].min(axis=0)  # (A,)
    hi = bv[..., 1][live].max(axis=0)
    out = bu.copy()
    out[..., 0] = np.clip(bu[..., 0], lo, hi)
    out[..., 1] = np.clip(bu[..., 1], lo, hi)
    out[..., 1] = np.maximum(out[..., 1], out[..., 0])
    return out


def _piece_blocks(ext: int, size: int, offset: int, c: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """An offset axis ``index = x + offset`` (a concatenation piece) of ``size`` over a dim of extent ``ext``
    split ``c`` ways (per layout or pattern): (even, split of the piece, shift, block length), each like ``c``.

    Device block x covers ``[x b + offset, (x + 1) b + offset)`` with ``b = ext / c``, clipped to
    ``[0, size)`` (:func:`~shardplan.cost.tiles.tensor_boxes`). With ``o = -offset`` the piece is
    ``[o, o + size)`` of the dim. When ``b`` divides ``o`` and ``size``, device block x is block
    ``y = x - o / b`` of the piece cut into ``size / b`` equal blocks if ``0 <= y < size / b``, and
    nothing otherwise; when the piece lies inside one block ``x0 = o // b`` (unsplit, for instance), the
    devices of block x0 hold all of it (``y = x - x0 = 0`` of a split of 1) and the others nothing.
    Even: one of the two holds and the dim covers the whole piece (so the consumer's tiles read all of
    it, and the backward region R of the module docstring is the tensor); the other values are
    meaningless where not even.
    """
    whole = offset <= 0 and ext + offset >= size
    o = -offset
    b = np.maximum(ext // c, 1)
    aligned = (ext % c == 0) & (o % b == 0) & (size % b == 0)
    within = o // b == (o + size - 1) // b
    even = (aligned | within) & whole
    split = np.where(aligned, size // b, 1)
    shift = -(o // b)
    length = np.where(aligned, b, size)
    return even, split, shift, length


def _axis_blocks(op: Operator, tensor, lay: LayoutArrays, patterns: bool = True):
    """Per axis: block pattern and block length per layout, and which layouts are even.

    Returns (splits (A, K), patterns (A, K, 2L), lengths (A, K), regular (K,),
    blocked_by (A,), pieces (A,)): ``blocked_by[a]`` is the index of the dim whose split and
    pattern axis a has, or -1 where it is one block (unindexed, or a windowed
    partial piece). An axis is regular when its core tile on every device is the block
    ``x_d(q)`` (the device's tile coordinate along the axis's dim, which the
    pattern fixes: see :meth:`~shardplan.layout.LayoutArrays.patterns`) of
    equal length (see :mod:`shardplan.cost.tiles`). ``pieces[a]`` is the offset of an
    offset axis (a concatenation piece, a slice; None for the others): its
    devices hold block ``x_d(q) + shift`` of the piece split (:func:`_piece_blocks`),
    or nothing; ``lengths`` then holds the piece's block length. ``patterns=False`` leaves the
    patterns of blocked axes at 1 (for callers that take them per dim instead).
    """
    configs = lay.splits
    k = len(configs)
    names = op.dim_names
    ext = op.extents
    n_lv = len(lay.levels)
    n_ax = len(tensor.axes)
    splits = np.ones((n_ax, k), dtype=np.int64)
    pats = np.ones((n_ax, k, 2 * n_lv), dtype=np.int64)
    lengths = np.zeros((n_ax, k), dtype=np.int64)
    regular = np.ones(k, dtype=bool)
    blocked_by = [-1] * n_ax
    pieces: list[int | None] = [None] * n_ax
    for a, (am, size) in enumerate(zip(tensor.axes, tensor.shape)):
        if am.dim is None:
            lengths[a] = size
            continue
        j = names.index(am.dim)
        c = configs[:, j]
        splits[a] = c
        if patterns:
            pats[a] = lay.patterns(j)
        blocked_by[a] = j
        if am.inner or am.is_plain:
            lengths[a] = size // c
        elif (am.window is not None or am.stride != 1) and not am.partial:
            lengths[a] = size // c
            regular &= size % c == 0
        elif am.window is None and am.stride == 1:  # offset or partial access (concat piece, slice)
            even, _, _, lengths[a] = _piece_blocks(ext[am.dim], size, am.offset, c)
            regular &= even
            pieces[a] = am.offset
        else:  # a windowed partial piece: regular only where unsplit and read whole
            whole = am.offset <= 0 and ext[am.dim] + am.offset >= size
            lengths[a] = size
            splits[a] = 1
            pats[a] = 1
            blocked_by[a] = -1
            regular &= (c == 1) & whole
    return splits, pats, lengths, regular, blocked_by, pieces


@dataclass(frozen=True, eq=False)
class _Side:
    """One end of an edge (a tensor under K layouts), summarised for the fast path.

    Per tensor axis a: the distinct block patterns ``pats[a]`` (P_a, 1 + 2L)
    (split, then the per-level pattern), each layout's pattern ``pinv[a]``
    (K,) and every device's block under each pattern ``blocks[a]`` (P_a, p).
    Layouts with the same pattern on every axis and the same level products
    (hence the same active devices) form one group: ``groups`` (G, A) their
    pattern indices, ``first`` (G,) a layout of each, ``inv`` (K,) each
    layout's group, ``act`` (G, W) the group's active devices as bit words.
    ``lengths``/``len_inv``: the distinct per-axis block lengths and each
    layout's; ``vol`` (K,) the block volume; ``regular`` (K,) whether every
    axis is cut into equal blocks (see :func:`_axis_blocks`). ``block_keys[a]``: what fixes
    ``blocks[a]`` given the machine's levels (the pattern rows, and a piece's shifts), as bytes.
    """

    pats: tuple[np.ndarray, ...]
    pinv: tuple[np.ndarray, ...]
    blocks: tuple[np.ndarray, ...]
    groups: np.ndarray
    first: np.ndarray
    inv: np.ndarray
    act: np.ndarray
    lengths: np.ndarray
    len_inv: np.ndarray
    vol: np.ndarray
    regular: np.ndarray
    block_keys: tuple[tuple, ...] = ()


@dataclass
class EdgeMemo:
    """Fast-path summaries (:class:`_Side`) kept across the edges of one build, up to ``limit_bytes``.

    A side depends on the layouts, the operator's dims and the tensor's
    shape and access maps only, so a producer feeding several consumers is
    summarised once. Entries hold their layouts, so an ``id`` is never reused
    while its entry lives; past ``limit_bytes`` of device-block arrays new
    sides are computed but not kept (the build's memory estimate counts the
    limit, :mod:`shardplan.cost.budget`).
    """

    limit_bytes: int = EDGE_MEMO_BYTES
    used_bytes: int = 0
    entries: dict = field(default_factory=dict)
    dims: dict = field(default_factory=dict)  # (id(layouts), dim) -> (layouts, _dim_patterns(...))
    unions: dict = field(default_factory=dict)  # (id(layouts), level) -> (layouts, group_union(...)): small
    masks: dict = field(default_factory=dict)  # (block keys of both sides, words) -> _pattern_masks(...)
    steps: dict = field(default_factory=dict)  # canonical pairs' volumes (:mod:`shardplan.cost.reshard`): small
    step_volumes: dict = field(default_factory=dict)  # (canonical_pairs row, n) -> canonical_volume: small
    step_edges: dict = field(default_factory=dict)  # (both sides' labelings, caps, n) -> step_volumes' tables: small
    pattern_sides: dict = field(default_factory=dict)  # as ``entries``, for :func:`_pattern_side` (None kept too)
    pattern_dims: dict = field(default_factory=dict)  # (id(layouts), dim) -> (layouts, (rows, inv)): one dim's patterns
    pattern_matches: dict = field(default_factory=dict)  # both pattern tables' bytes -> _pattern_match(...)

    def union(self, lay: LayoutArrays, level: int) -> tuple[LayoutArrays, np.ndarray]:
        """:func:`group_union` of ``lay``, computed once per build (so its sides are memoised too)."""
        hit = self.unions.get((id(lay), level))
        if hit is None or hit[0] is not lay:
            hit = (lay, group_union(lay, level))
            self.unions[(id(lay), level)] = hit
        return hit[1]

    def get(self, key: tuple, lay: LayoutArrays) -> "_Side | None":
        hit = self.entries.get(key)
        return hit[1] if hit is not None and hit[0] is lay else None

    def put(self, key: tuple, lay: LayoutArrays, side: "_Side", extra: int = 0) -> None:
        """Keep ``side`` if there is room; ``extra``: bytes of its own block arrays (a dim's are counted once
        per dim, a piece axis's shifted ones here)."""
        if self.room(side.act.nbytes + side.inv.nbytes + side.first.nbytes + extra):
            self.entries[key] = (lay, side)

    def room(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more may be kept; if so they are counted as kept."""
        if self.used_bytes + nbytes > self.limit_bytes:
            return False
        self.used_bytes += nbytes
        return True


def _side(op: Operator, tensor, lay: LayoutArrays, words: int, memo: EdgeMemo | None) -> _Side:
    """The :class:`_Side` of ``tensor`` (read or written by ``op``) under ``lay``, from ``memo`` when there."""
    key = (id(lay), op.dims, tensor.shape, tensor.axes)
    if memo is not None:
        hit = memo.get(key, lay)
        if hit is not None:
            return hit
    splits, pats, lengths, regular, blocked_by, pieces = _axis_blocks(op, tensor, lay, patterns=False)
    n_ax = len(tensor.axes)
    p_rows, p_inv, p_blocks, p_keys = [], [], [], []
    inside = []  # per piece axis: which devices hold a block of the piece (P, p), each layout's pattern (K,)
    extra = 0
    for a in range(n_ax):
        shifted = None
        if blocked_by[a] >= 0:  # the dim's patterns: the same for every tensor the dim blocks
            rows, inv, blocks = _dim_patterns(lay, blocked_by[a], memo)
            if pieces[a] is not None:  # the block of the piece each device holds (-> its split), if any
                am, size = tensor.axes[a], tensor.shape[a]
                _, split, shift, _ = _piece_blocks(op.extents[am.dim], size, pieces[a], rows[:, 0])
                blocks = blocks + shift[:, None]
                inside.append(((blocks >= 0) & (blocks < split[:, None]), inv))  # (P, p), (K,)
                rows = np.concatenate([split[:, None], rows[:, 1:]], axis=1)
                extra += blocks.nbytes
                shifted = shift.tobytes()
        else:  # one block
            rows = np.concatenate([splits[a][:1, None], pats[a][:1]], axis=1)
            inv = np.zeros(len(lay), dtype=np.int64)
            blocks = pattern_blocks(rows[:, 1:], lay.levels)
        p_rows.append(rows)
        p_inv.append(inv)
        p_blocks.append(blocks)
        p_keys.append((rows.shape, rows.tobytes(), shifted))
    prods = lay.level_splits.prod(axis=2)  # (L, K): fixes the active devices
    key_rows = np.concatenate([np.asarray(p_inv, dtype=np.int64).reshape(n_ax, len(lay)), prods], axis=0).T
    groups, first, inv = unique_rows(key_rows)
    act = lay.take(first).active()
    for held, pat in inside:  # a device outside the piece's blocks holds nothing of the tensor
        act &= held[pat[first]]
    act = _pack(act, words)
    uniq_len, _, len_inv = unique_rows(lengths.T)
    out = _Side(tuple(p_rows), tuple(p_inv), tuple(p_blocks), groups[:, :n_ax], first, inv, act, uniq_len, len_inv,
                np.prod(lengths, axis=0), regular, tuple(p_keys))
    if memo is not None:
        memo.put(key, lay, out, extra)
    return out


def _dim_patterns(lay: LayoutArrays, j: int, memo: EdgeMemo | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distinct (split, pattern) rows of dim j (P, 1 + 2L), each layout's row (K,), and the blocks (P, p)."""
    if memo is not None:
        hit = memo.dims.get((id(lay), j))
        if hit is not None and hit[0] is lay:
            return hit[1]
    rows, _, inv = unique_rows(np.concatenate([lay.splits[:, j][:, None], lay.patterns(j)], axis=1))
    out = (rows, inv, pattern_blocks(rows[:, 1:], lay.levels))
    if memo is not None and memo.room(out[2].nbytes + inv.nbytes):
        memo.dims[(id(lay), j)] = (lay, out)
    return out


def _pattern_masks(su: _Side, sv: _Side, a: int, words: int,
                   memo: EdgeMemo | None = None) -> tuple[np.ndarray, np.ndarray]:
    """For axis a: match bit-masks (Pu, Pv, words) uint64 and nesting flags (Pu, Pv) of every pattern pair.

    Device q holds block ``x(q)`` of the pattern. With nested splits, block i
    of the coarser layout contains block j of the finer one iff ``i == j // ratio``.
    They depend on the two sides' block keys only (the same dims' patterns recur on many edges), so
    ``memo`` keeps them per pair of keys.
    """
    key = (su.block_keys[a], sv.block_keys[a], words) if memo is not None else None
    if key is not None and key in memo.masks:
        return memo.masks[key]
    out = _match_masks(su, sv, a, words)
    if key is not None and memo.room(out[0].nbytes + out[1].nbytes):
        memo.masks[key] = out
    return out


def _match_masks(su: _Side, sv: _Side, a: int, words: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_pattern_masks`, computed."""
    pu, pv = su.pats[a], sv.pats[a]
    small = np.int16 if int(max(pu[:, 0].max(), pv[:, 0].max())) < 2**15 else np.int64
    bu = su.blocks[a].astype(small)  # (Pu, p)
    bv = sv.blocks[a].astype(small)
    c1, c2 = pu[:, 0][:, None], pv[:, 0][None, :]
    nested = (c1 % c2 == 0) | (c2 % c1 == 0)
    # nested blocks match iff both map to the same block of the coarser split
    cmin = np.minimum(c1, c2)
    ku = (c1 // cmin).astype(small)
    kv = (c2 // cmin).astype(small)
    match = (bu[:, None, :] // ku[..., None]) == (bv[None, :, :] // kv[..., None])
    return _pack(match, words), nested


def _pack(bits: np.ndarray, words: int) -> np.ndarray:
    """Pack a boolean last axis (length <= 64 * words) into uint64 words."""
    pad = words * 64 - bits.shape[-1]
    if pad:
        bits = np.concatenate([bits, np.zeros(bits.shape[:-1] + (pad,), dtype=bool)], axis=-1)
    packed = np.packbits(bits, axis=-1, bitorder="little")
    return packed.view(np.uint64).reshape(bits.shape[:-1] + (words,))


def _covers(sub: np.ndarray, sup: np.ndarray) -> np.ndarray:
    """Whether every bit of ``sub`` is set in ``sup`` (packed uint64 last axes, broadcast): bool without it."""
    return ~(sub & ~sup).any(axis=-1)


@dataclass(frozen=True, eq=False)
class _PatternSide:
    """One end of an edge whose tiles are the same on every device, summarised without any per-device array.

    Per tensor axis a: the distinct (split, pattern) rows ``pats[a]`` (P_a, 1 + 2L) of the dim that blocks
    it (one row of 1s for an unblocked axis), each layout's row ``pinv[a]`` (K,); layouts with the same row
    on every axis form one group (``groups`` (G, A), ``inv`` (K,)); ``lengths``/``len_inv``/``vol`` as in
    :class:`_Side`.
    """

    pats: tuple[np.ndarray, ...]
    pinv: tuple[np.ndarray, ...]
    groups: np.ndarray
    inv: np.ndarray
    lengths: np.ndarray
    len_inv: np.ndarray
    vol: np.ndarray


def _is_power_of_two(x: np.ndarray) -> np.ndarray:
    return (x > 0) & (x & (x - 1) == 0)


def _pattern_blocked(op: Operator, tensor, lay: LayoutArrays) -> tuple[np.ndarray, list[int]] | None:
    """The block lengths (A, K) and blocking dims (A,) of ``tensor`` under ``lay`` (:func:`_axis_blocks`) where
    the block-pattern test applies (:func:`_pattern_side`), else None."""
    _, _, lengths, regular, blocked_by, pieces = _axis_blocks(op, tensor, lay, patterns=False)
    if not regular.all() or any(x is not None for x in pieces) or not all_active(lay).all():
        return None
    for j in blocked_by:
        if j >= 0 and not _is_power_of_two(lay.level_splits[:, :, j]).all():
            return None
    return lengths, blocked_by


def pattern_applies(op: Operator, tensor, lay: LayoutArrays) -> bool:
    """Whether :func:`_pattern_side` of ``tensor`` under ``lay`` is not None, without building it."""
    return _pattern_blocked(op, tensor, lay) is not None


def _pattern_dim(lay: LayoutArrays, j: int, memo: EdgeMemo | None) -> tuple[np.ndarray, np.ndarray]:
    """Distinct (split, pattern) rows of dim j (P, 1 + 2L) and each layout's row (K,); from ``memo`` when there
    (every tensor the dim blocks has them)."""
    if memo is not None:
        hit = memo.pattern_dims.get((id(lay), j))
        if hit is not None and hit[0] is lay:
            return hit[1]
    rows, _, inv = unique_rows(np.concatenate([lay.splits[:, j][:, None], lay.patterns(j)], axis=1))
    if memo is not None and memo.room(rows.nbytes + inv.nbytes):
        memo.pattern_dims[(id(lay), j)] = (lay, (rows, inv))
    return rows, inv


def _pattern_side(op: Operator, tensor, lay: LayoutArrays, memo: EdgeMemo | None = None) -> _PatternSide | None:
    """The :class:`_PatternSide` of ``tensor`` under ``lay``, or None where the block-pattern test does not
    apply: some tile irregular or a concatenation piece (:func:`_axis_blocks`), some device idle
    (:func:`~shardplan.cost.tiles.all_active`), or a per-level split of a blocking dim that is not a power
    of two (then a coarse block need not be a digit of the levels: :func:`_coarse_keys`). ``memo``: kept
    across the edges of a build, as :func:`_side` (the same key: layouts, the operator's dims, the tensor's
    shape and access maps)."""
    key = (id(lay), op.dims, tensor.shape, tensor.axes)
    if memo is not None:
        hit = memo.pattern_sides.get(key)
        if hit is not None and hit[0] is lay:
            return hit[1]
    out = _build_pattern_side(op, tensor, lay, memo)
    if memo is not None:
        size = 0 if out is None else sum(x.nbytes for x in (*out.pinv, out.groups, out.inv, out.lengths,
                                                             out.len_inv, out.vol))
        if memo.room(size):
            memo.pattern_sides[key] = (lay, out)
    return out


def _build_pattern_side(op: Operator, tensor, lay: LayoutArrays, memo: EdgeMemo | None) -> _PatternSide | None:
    """:func:`_pattern_side`, computed (the dims' pattern rows from ``memo`` when there)."""
    blocked = _pattern_blocked(op, tensor, lay)
    if blocked is None:
        return None
    lengths, blocked_by = blocked
    n_ax, k = len(tensor.axes), len(lay)
    rows_all, invs = [], []
    for a in range(n_ax):
        if blocked_by[a] >= 0:
            rows, inv = _pattern_dim(lay, blocked_by[a], memo)
        else:
            rows = np.ones((1, 1 + 2 * len(lay.levels)), dtype=np.int64)
            inv = np.zeros(k, dtype=np.int64)
        rows_all.append(rows)
        invs.append(inv)
    groups, _, inv = unique_rows(np.asarray(invs, dtype=np.int64).reshape(n_ax, k).T) if n_ax else \
        (np.zeros((1, 0), dtype=np.int64), None, np.zeros(k, dtype=np.int64))
    uniq_len, _, len_inv = unique_rows(lengths.T)
    return _PatternSide(tuple(rows_all), tuple(invs), groups, inv, uniq_len, len_inv, np.prod(lengths, axis=0))


def _coarse_keys(rows: np.ndarray, m: int, n_lv: int) -> np.ndarray:
    """Canonical form of every pattern's block index coarsened to ``m`` blocks: (P, 2L) int64.

    A pattern of total split c = Π_l c_l (per-level splits c_l, strides σ_l) gives device q the block
    ``x(q) = Σ_l d_l(q) Π_{l' < l} c_l'`` with ``d_l(q) = (i_l(q) // σ_l) mod c_l`` (:mod:`shardplan.layout`).
    Its coarse block among m (m dividing c) is ``X(q) = x(q) // k``, k = c / m. With every c_l a power of
    two, k peels whole levels from the inside and a power-of-two share t of one level:
    ``X(q) = Σ_l D_l(q) Π_{l' < l} c'_l'`` with ``D_l = (i_l // σ'_l) mod c'_l``, where ``c'_l = 1`` on the
    peeled levels, ``c'_l = c_l / t``, ``σ'_l = σ_l t`` on the cut one and the rest unchanged (since
    ``(a mod (t r)) // t = (a // t) mod r``). The row ``(c'_l, σ'_l or 0 where c'_l = 1)`` per level is
    canonical: two patterns give the same X on every device (all active) iff their rows are equal
    (docs/cost-model.md, "Meshes of any size").
    """
    c = rows[:, 1:1 + n_lv].astype(np.int64)
    sig = rows[:, 1 + n_lv:].astype(np.int64)
    k = rows[:, 0] // m
    out_c = np.empty_like(c)
    out_s = np.empty_like(sig)
    for lvl in range(n_lv):
        t = np.minimum(k, c[:, lvl])  # both powers of two: one divides the other
        out_c[:, lvl] = c[:, lvl] // t
        out_s[:, lvl] = np.where(out_c[:, lvl] > 1, sig[:, lvl] * t, 0)
        k = k // t
    return np.concatenate([out_c, out_s], axis=1)


def _pattern_match(pu: np.ndarray, pv: np.ndarray, n_lv: int) -> np.ndarray:
    """(Pu, Pv) bool: whether every device's block under pattern pu nests in (or contains) its block under pv,
    i.e. both coarsened to ``m = min(c_u, c_v)`` blocks agree on every device (:func:`_coarse_keys`)."""
    cu, cv = pu[:, 0], pv[:, 0]
    out = np.zeros((len(pu), len(pv)), dtype=bool)
    ms = np.unique(np.minimum(cu[:, None], cv[None, :]))
    for m in ms.tolist():
        iu = np.nonzero(cu >= m)[0]
        iv = np.nonzero(cv >= m)[0]
        ku, kv = _coarse_keys(pu[iu], m, n_lv), _coarse_keys(pv[iv], m, n_lv)
        _, _, ids = unique_rows(np.concatenate([ku, kv], axis=0))
        same = ids[: len(iu), None] == ids[None, len(iu):]
        at_m = np.minimum(cu[iu][:, None], cv[iv][None, :]) == m
        sub = out[np.ix_(iu, iv)]
        sub[at_m] = same[at_m]
        out[np.ix_(iu, iv)] = sub
    return out


def _pattern_match_memo(pu: np.ndarray, pv: np.ndarray, n_lv: int, memo: EdgeMemo | None) -> np.ndarray:
    """:func:`_pattern_match`, from ``memo`` when the same two pattern tables met before (the same dims'
    patterns recur on many edges)."""
    if memo is None:
        return _pattern_match(pu, pv, n_lv)
    key = (pu.shape, pu.tobytes(), pv.shape, pv.tobytes(), n_lv)
    hit = memo.pattern_matches.get(key)
    if hit is None:
        hit = _pattern_match(pu, pv, n_lv)
        if memo.room(hit.nbytes + pu.nbytes + pv.nbytes):
            memo.pattern_matches[key] = hit
    return hit


def _pattern_ok(su: _PatternSide, sv: _PatternSide, n_lv: int, memo: EdgeMemo | None = None) -> np.ndarray:
    """(G_u, G_v) bool per pair of groups: whether every device's block nests on every axis
    (:func:`_pattern_match` per axis; ``memo`` keeps each pair of pattern tables' match across a build)."""
    ok = np.ones((len(su.groups), len(sv.groups)), dtype=bool)
    for a in range(len(su.pats)):
        match = _pattern_match_memo(su.pats[a], sv.pats[a], n_lv, memo)  # (Pu, Pv)
        if match.all():  # this axis nests under every pair of patterns (an unsplit axis on both sides, say)
            continue
        if match.shape[0] == 1:  # one pattern on u's side: a row for every u group
            ok &= match[0].take(sv.groups[:, a])[None, :]
        elif match.shape[1] == 1:
            ok &= match[:, 0].take(su.groups[:, a])[:, None]
        else:
            ok &= match.take(su.groups[:, a], axis=0).take(sv.groups[:, a], axis=1)
    return ok


def _expand(x: np.ndarray, iu: np.ndarray, iv: np.ndarray) -> np.ndarray:
    """``x[iu][:, iv]``: a matrix over distinct rows of two sides to every pair of layouts."""
    return x.take(iu, axis=0).take(iv, axis=1)


def _pattern_fast(su: _PatternSide, sv: _PatternSide, n_lv: int,
                  memo: EdgeMemo | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Moved volumes (K_u, K_v), forward and backward, of two :class:`_PatternSide` ends: the block-mask test of
    :func:`_fast` with every device active on both sides, where each axis's test "every device's blocks
    nest" is :func:`_pattern_match` on the two patterns (no device enumerated; :func:`_pattern_ok`)."""
    ok = _expand(_pattern_ok(su, sv, n_lv, memo), su.inv, sv.inv)
    ov_small = np.minimum(su.lengths[:, None, :], sv.lengths[None, :, :]).prod(axis=-1)
    overlap = _expand(ov_small, su.len_inv, sv.len_inv)
    fwd = np.where(ok, sv.vol[None, :] - overlap, sv.vol[None, :])
    bwd = np.where(ok, su.vol[:, None] - overlap, su.vol[:, None])
    return fwd, bwd


def _pattern_seconds(u: Operator, lu: LayoutArrays, v: Operator, slot: int, lv: LayoutArrays, machine: Machine,
                     memo: EdgeMemo | None) -> np.ndarray | None:
    """:func:`edge_cost` (K_u, K_v) on one level, without the steps, where block patterns decide the edge
    (:func:`_pattern_side` of both ends), the same floats; None where that path does not apply.

    A pair's volumes are ``vol_v - overlap`` and ``vol_u - overlap`` where its blocks nest
    (:func:`_pattern_ok`), else ``vol_v`` and ``vol_u`` (:func:`_pattern_fast`), and the volumes and
    overlap depend on the two ends' block lengths alone. So the nested cost ``T(f) + T(b)`` (``T`` the
    point-to-point time, the sum rounded as :func:`edge_cost` rounds it) is computed once per pair of
    distinct block lengths, the apart one as the sum of a vector over v's lengths and one over u's, and
    each pair of layouts takes one of the two.
    """
    su = _pattern_side(u, u.output, lu, memo)
    sv = _pattern_side(v, v.inputs[slot], lv, memo) if su is not None else None
    if su is None or sv is None:
        return None
    t_in = v.inputs[slot]
    nb = float(machine.dtype_bytes)
    vol_u = su.lengths.prod(axis=1)  # per distinct length row: the same integers as su.vol
    vol_v = sv.lengths.prod(axis=1)
    ov = np.minimum(su.lengths[:, None, :], sv.lengths[None, :, :]).prod(axis=-1)  # (Lu, Lv)

    def seconds(fwd: np.ndarray, bwd: np.ndarray) -> np.ndarray:  # edge_volumes' scaling, then edge_cost's
        f = fwd * t_in.elem_factor
        b = bwd * t_in.elem_factor if t_in.needs_grad else np.zeros_like(bwd)
        return p2p_time(f * nb, machine, 0) + p2p_time(b * nb, machine, 0)

    ok_g = _pattern_ok(su, sv, len(lu.levels), memo)
    nested = _expand(seconds(vol_v[None, :] - ov, vol_u[:, None] - ov), su.len_inv, sv.len_inv)
    if ok_g.all():
        return nested
    # apart: T(f) depends on v's lengths alone and T(b) on u's, so each entry is the sum of two vectors'
    # entries (the same two floats, added in the same order as ``seconds`` adds them)
    t_f = p2p_time((vol_v * t_in.elem_factor) * nb, machine, 0).take(sv.len_inv)
    back = vol_u * t_in.elem_factor if t_in.needs_grad else np.zeros_like(vol_u)
    t_b = p2p_time(back * nb, machine, 0).take(su.len_inv)
    out = np.add(t_f[None, :], t_b[:, None])
    np.copyto(out, nested, where=_expand(ok_g, su.inv, sv.inv))
    return out


def _fast(u: Operator, lu: LayoutArrays, v: Operator, t_in, lv: LayoutArrays, p: int,
          memo: EdgeMemo | None = None):
    """Moved volumes via block-match masks; returns (fwd, bwd, exact) with ``exact`` False where not applicable.

    Whether every device finds its block depends on a layout only through
    its block pattern on each axis of the tensor and its active devices, so
    the device masks are combined once per distinct (pattern tuple) of each
    side and broadcast to the layouts that share it. The forward test, every
    device active for v holds its block after u, is a "for all devices" of an
    AND over axes, so it splits into one test per axis:
    ``act_v ⊆ act_u ∧ Π_a (act_v ⊆ match_a)``, each depending on one axis's
    pattern pair and the active sets only (the backward test likewise with
    the roles of u and v swapped). Per axis the tests are computed for each
    distinct (pattern, active set) of one side against each pattern of the
    other, and combined per pair of layouts with booleans, never holding a
    device mask per pair of layouts.
    """
    words = (p + 63) // 64
    su = _side(u, u.output, lu, words, memo)
    sv = _side(v, t_in, lv, words, memo)
    gu, gv = su.groups, sv.groups
    act_u, id_u = np.unique(su.act, axis=0, return_inverse=True)  # distinct active sets (Au, W), (Gu,)
    act_v, id_v = np.unique(sv.act, axis=0, return_inverse=True)
    id_u, id_v = id_u.reshape(-1), id_v.reshape(-1)
    # per distinct active set of u, one row at a time (no (Au, Av, W) temporary)
    fwd_g = np.stack([_covers(act_v, x) for x in act_u]).take(id_u, axis=0).take(id_v, axis=1)  # (Gu, Gv)
    bwd_g = np.stack([_covers(x, act_v) for x in act_u]).take(id_u, axis=0).take(id_v, axis=1)
    nested_all = np.ones((len(gu), len(gv)), dtype=bool)
    for a in range(len(t_in.axes)):
        masks, nests = _pattern_masks(su, sv, a, words, memo)  # (Pu, Pv, W), (Pu, Pv)
        # forward: each u pattern against each distinct (v pattern, v active set)
        kv, _, kv_inv = unique_rows(np.stack([gv[:, a], id_v], axis=1))
        ok = _covers(act_v[kv[:, 1]][None, :, :], masks[:, kv[:, 0]])  # (Pu, KV)
        fwd_g &= ok.take(gu[:, a], axis=0).take(kv_inv, axis=1)
        # backward: each distinct (u pattern, u active set) against each v pattern
        ku, _, ku_inv = unique_rows(np.stack([gu[:, a], id_u], axis=1))
        ok = _covers(act_u[ku[:, 1]][:, None, :], masks[ku[:, 0]])  # (KU, Pv)
        bwd_g &= ok.take(ku_inv, axis=0).take(gv[:, a], axis=1)
        nested_all &= nests.take(gu[:, a], axis=0).take(gv[:, a], axis=1)

    def expand(x: np.ndarray) -> np.ndarray:  # (Gu, Gv) -> (Ku, Kv)
        return x.take(su.inv, axis=0).take(sv.inv, axis=1)

    fwd_ok = expand(fwd_g)
    bwd_ok = expand(bwd_g)
    exact = expand(nested_all)
    exact &= su.regular[:, None]
    exact &= sv.regular[None, :]
    # the overlap of nested equal blocks depends on the block lengths only: per distinct length pair
    ov_small = np.minimum(su.lengths[:, None, :], sv.lengths[None, :, :]).prod(axis=-1)
    overlap = ov_small.take(su.len_inv, axis=0).take(sv.len_inv, axis=1)
    fwd = np.where(fwd_ok, sv.vol[None, :] - overlap, sv.vol[None, :])
    bwd = np.where(bwd_ok, su.vol[:, None] - overlap, su.vol[:, None])
    return fwd, bwd, exact


def _bit_labelings(op: Operator, tensor, lay: LayoutArrays) -> tuple[list, np.ndarray, np.ndarray]:
    """The tensor's bit labeling (:mod:`shardplan.cost.reshard`) under each layout of ``lay`` (one level, p a
    power of two): (distinct labelings, each layout's (K,), which layouts have one (K,) bool).

    A layout has one when every device holds a tile (:func:`~shardplan.cost.tiles.all_active`) and every
    axis of the tensor is unsplit, or plain (or merged with its inner dims unsplit) and cut by a power of
    two that divides its extent: the tensor axes a JAX sharding splits (:mod:`shardplan.jax.shardings`).
    """
    k = len(lay)
    ok = all_active(lay).copy()
    names = op.dim_names
    cols = []
    for am, size in zip(tensor.axes, tensor.shape):
        if am.dim is None:
            cols.append(np.zeros((k, 2), dtype=np.int64))
            continue
        j = names.index(am.dim)
        pat = lay.patterns(j)  # (K, 2): split, stride
        c = pat[:, 0]
        split = c > 1
        plain = am.is_plain or (bool(am.inner) and am.window is None)
        if am.inner:
            for d in am.inner:
                plain = plain & (lay.splits[:, names.index(d)] == 1)
        ok &= ~split | (plain & _is_power_of_two(c) & (size % np.maximum(c, 1) == 0))
        cols.append(np.where(split[:, None], pat, 0))
    key = np.concatenate(cols, axis=1) if cols else np.zeros((k, 0), dtype=np.int64)
    rows, _, inv = unique_rows(key)
    labels = [tuple(pattern_bits(r[2 * a], r[2 * a + 1]) if r[2 * a] > 1 else () for a in range(len(cols)))
              for r in rows]
    return labels, inv, ok


def _unique_rows_hashed(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(x, axis=0, return_inverse=True)`` for an (N, r) int64 array, exactly, faster: the rows grouped
    by one 64-bit mix of their entries (wrapping arithmetic), every row then compared with its group's first;
    on a collision (rows that differ, one mix) the sort of whole rows."""
    mix = np.zeros(len(x), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for c in x.T.astype(np.uint64):
            mix = (mix ^ c) * np.uint64(0x100000001B3) + np.uint64(0x9E3779B97F4A7C15)
    _, first, inv = np.unique(mix, return_index=True, return_inverse=True)
    inv = inv.reshape(-1)
    rows = x[first]
    if not (rows[inv] == x).all():
        rows, inv = np.unique(x, axis=0, return_inverse=True)
        inv = inv.reshape(-1)
    return rows, inv


def step_volumes(u: Operator, lu: LayoutArrays, v: Operator, slot: int, lv: LayoutArrays, p: int,
                 memo: EdgeMemo | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Elements each device sends when the redistribution runs as the steps of
    :func:`shardplan.cost.reshard.reshard_steps` (forward: u's labeling to v's; backward: v's to u's), and
    where that applies: (fwd, bwd, ok), each (K_u, K_v); None where it applies nowhere.

    It applies on one level of p = 2^n devices, n <= :data:`~shardplan.cost.reshard.MAX_BITS`, to the pairs of
    layouts that both give the tensor a bit labeling (:func:`_bit_labelings`). Volumes before the tensor's
    ``elem_factor`` and ``needs_grad`` (as :func:`edge_volumes` returns them after). Every pair of distinct
    labelings is reduced to its canonical form at once (:func:`~shardplan.cost.reshard.canonical_pairs`), and
    :func:`~shardplan.cost.reshard.canonical_volume` runs once per canonical form per ``memo``; an edge whose
    labelings, caps and size an earlier edge had reuses its tables.
    """
    return _tensor_steps(u, lu, v, v.inputs[slot], lv, p, memo)


def _tensor_steps(u: Operator, lu: LayoutArrays, v: Operator, t_in, lv: LayoutArrays, p: int,
                  memo: EdgeMemo | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """:func:`step_volumes` of u's output into ``t_in``, a tensor of ``v``'s dims read as v's layouts lay it
    out (one of v's inputs, or the operand of a slice as the export reads it: :func:`_through_operand`)."""
    n = p.bit_length() - 1
    if len(lu.levels) != 1 or p != 1 << n or n > MAX_BITS or n == 0:
        return None
    if tuple(u.output.shape) != tuple(t_in.shape):
        return None
    lab_u, inv_u, ok_u = _bit_labelings(u, u.output, lu)
    lab_v, inv_v, ok_v = _bit_labelings(v, t_in, lv)
    if not ok_u.any() or not ok_v.any():
        return None
    caps = tuple(min((int(x) & -int(x)).bit_length() - 1, n) for x in t_in.shape)
    total = int(np.prod(np.asarray(t_in.shape, dtype=np.int64)))
    cache = memo.steps if memo is not None else {}
    volumes = memo.step_volumes if memo is not None else {}
    edges = memo.step_edges if memo is not None else {}

    def table(src: list, dst: list) -> np.ndarray:  # (len(src), len(dst)) elements sent from src[i] to dst[j]
        code, dropped = canonical_pairs(src, dst, caps, n)
        if not caps:  # a scalar: one labeling, nothing to send
            return np.zeros(dropped.shape, dtype=np.int64)
        rows, inv = _unique_rows_hashed(code.reshape(-1, len(caps)))
        vol = np.zeros(len(rows))
        for g, row in enumerate(rows.tolist()):
            key = (tuple(row), n)
            got = volumes.get(key)
            if got is None:
                got = volumes[key] = canonical_volume(row, n, cache)
            vol[g] = got
        return np.rint(vol[inv].reshape(dropped.shape) * np.ldexp(1.0, -dropped) * total).astype(np.int64)

    need_u = np.unique(inv_u[ok_u])
    need_v = np.unique(inv_v[ok_v])
    su = [lab_u[i] for i in need_u.tolist()]
    sv = [lab_v[j] for j in need_v.tolist()]
    ekey = (tuple(su), tuple(sv), caps, n, total)
    hit = edges.get(ekey)
    if hit is None:
        hit = edges[ekey] = (table(su, sv), table(sv, su).T)
    fwd_d = np.zeros((len(lab_u), len(lab_v)), dtype=np.int64)
    bwd_d = np.zeros((len(lab_u), len(lab_v)), dtype=np.int64)
    fwd_d[np.ix_(need_u, need_v)] = hit[0]
    bwd_d[np.ix_(need_u, need_v)] = hit[1]
    ok = ok_u[:, None] & ok_v[None, :]
    return fwd_d.take(inv_u, axis=0).take(inv_v, axis=1), bwd_d.take(inv_u, axis=0).take(inv_v, axis=1), ok


def _cut_axes(v: Operator, slot: int) -> tuple[int, ...]:
    """The axes of the activation input ``slot`` that ``v``, a static slice, cuts (a stride-1 offset axis read
    in part); () for every other operator and input."""
    if v.kind != "slice":
        return ()
    t = v.inputs[slot]
    ext = v.extents
    return tuple(a for a, (am, size) in enumerate(zip(t.axes, t.shape))
                 if am.dim is not None and am.partial and am.stride == 1 and am.window is None and not am.inner
                 and ext[am.dim] != size)


def _through_operand(u: Operator, lu: LayoutArrays, v: Operator, slot: int, lv: LayoutArrays, p: int,
                     cut: tuple[int, ...], fwd: np.ndarray, bwd: np.ndarray,
                     memo: EdgeMemo | None) -> tuple[np.ndarray, np.ndarray]:
    """The volumes of an edge into a static slice of an activation as the JAX export moves it, in two hops:
    (K_u, K_v) each, before ``elem_factor`` and ``needs_grad``.

    The export reads the slice's operand T (extent E on a cut axis) split as the slice's result is: v's
    split c of the cut dim (extent n) blocks T's whole axis, device block x holding ``[x E/c, (x+1) E/c)``
    (:func:`shardplan.jax.lower._window_dim`). Forward, T moves from u's layout to that one (hop 1: the
    redistribution steps between the two bit labelings, or the lack of the whole operand where they do not apply), then
    each device takes its window block ``[offset + x n/c, offset + (x+1) n/c)`` from the operand blocks (hop 2,
    XLA's halo exchange: what it lacks of its window block). Backward, the window's gradient is padded into
    the operand blocks (hop 2 reversed) and the whole operand's gradient, zeros outside the window included,
    goes back to u's layout (hop 1 reversed, not cut to the window). Where u's layout holds T as the read does
    (the same split of the cut axis), hop 1 is free and hop 2 is the lack of :func:`edge_volumes` itself.
    Applies where every cut dim's split divides both n and E (the blocks a JAX sharding gives); the other
    layouts of v keep ``fwd``, ``bwd``. Used where the edge charges the export's steps (``steps``); the lack
    stays the PaSE definition (docs/cost-model.md, "Slices of an activation")."""
    from shardplan.ir import AxisMap, Tensor

    t_in = v.inputs[slot]
    ext = v.extents
    bv = tensor_boxes(v, t_in, lv, p, core=True)
    live = (bv[..., 1] > bv[..., 0]).all(axis=-1)  # (K_v, p): idle devices hold empty boxes
    bop = bv.copy()
    ok = np.ones(len(lv), dtype=bool)
    names = v.dim_names
    for a in cut:
        am, size, n = t_in.axes[a], int(t_in.shape[a]), int(ext[t_in.axes[a].dim])
        c = lv.splits[:, names.index(am.dim)]
        ok &= (size % c == 0) & (n % c == 0)
        for i in (0, 1):
            bop[..., a, i] = np.where(live, (bv[..., a, i] - am.offset) * size // n, 0)
    if not ok.any():
        return fwd, bwd
    bu = tensor_boxes(u, u.output, lu, p, core=True)
    f1, b1 = _general(bu, bop)  # hop 1, the whole operand both ways
    t_op = Tensor(t_in.name, t_in.shape, tuple(AxisMap(am.dim) if a in cut else am
                                                for a, am in enumerate(t_in.axes)), "input")
    st = _tensor_steps(u, lu, v, t_op, lv, p, memo)
    if st is not None:
        f1 = np.where(st[2], st[0], f1)
        b1 = np.where(st[2], st[1], b1)
    idx = np.arange(len(lv))
    f2, b2 = _general_pairs(_clip_to_read(bop, bv), bv, idx, idx)  # hop 2, in v's layout alone
    return (np.where(ok[None, :], f1 + f2[None, :], fwd),
            np.where(ok[None, :], b1 + b2[None, :], bwd))


def edge_volumes(u: Operator, cu, v: Operator, slot: int, cv, p: int,
                 ou: np.ndarray | None = None, ov: np.ndarray | None = None,
                 fast: bool = True, levels: tuple[int, ...] | None = None,
                 memo: EdgeMemo | None = None, analytic: bool = True,
                 max_devices: int = MAX_DEVICES, steps: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Elements moved per device (max over devices): forward and backward, each (K_u, K_v).

    ``cu``/``cv``: :class:`~shardplan.layout.LayoutArrays` of the two
    operators (same levels), or configuration rows with optional nesting
    orders ``ou``/``ov`` (laid out on ``levels``, default one level of p).
    ``fast=False`` forces the general path everywhere (for testing).
    ``memo``: an :class:`EdgeMemo` kept across the edges of one build.
    ``analytic`` (default): where both ends' tiles are the same on every device (:func:`_pattern_side`),
    decide the fast path's test from the layouts' block patterns alone, with no per-device array
    (:func:`_pattern_fast`); False: the per-device masks everywhere (for testing; the same numbers).
    ``max_devices``: the per-device path is refused past this many devices (:func:`check_per_device`).
    ``steps``: where :func:`step_volumes` applies, the bytes of the steps the JAX export performs instead of
    what each device lacks (what :func:`edge_cost` charges); default the lack, the definition above.
    """
    t_in = v.inputs[slot]
    lu = as_layouts(cu, p, ou, levels)
    lv = as_layouts(cv, p, ov, levels)
    if lu.levels != lv.levels:
        raise ShardplanError(f"edge {u.name!r} -> {v.name!r}: layouts on different machine levels "
                             f"{lu.levels} and {lv.levels}")
    sides = None
    if fast and analytic:
        sides = (_pattern_side(u, u.output, lu, memo), _pattern_side(v, t_in, lv, memo))
    if sides is not None and sides[0] is not None and sides[1] is not None:
        fwd, bwd = _pattern_fast(sides[0], sides[1], len(lu.levels), memo)
        exact = np.ones((len(lu), len(lv)), dtype=bool)
    elif fast:
        check_per_device(p, f"the tiles of the edge {u.name!r} -> {v.name!r} (uneven blocks, pieces, idle devices "
                            "or splits that are not powers of two)", max_devices)
        fwd, bwd, exact = _fast(u, lu, v, t_in, lv, p, memo)
    else:
        fwd = bwd = None
        exact = np.zeros((len(lu), len(lv)), dtype=bool)
    if fwd is None or not exact.all():
        bv = tensor_boxes(v, t_in, lv, p, core=True)
        bu = _clip_to_read(tensor_boxes(u, u.output, lu, p, core=True), bv)
        if fwd is None:
            fwd, bwd = _general(bu, bv)
        else:
            # whole columns (consumer configurations no pair of which the fast path covers) in one
            # contiguous sweep, the scattered rest pair by pair
            cols = np.nonzero(~exact.any(axis=0))[0]
            if len(cols):
                fwd[:, cols], bwd[:, cols] = _general(bu, bv[cols])
                exact[:, cols] = True
            iu, iv = np.nonzero(~exact)
            if len(iu):
                fwd[iu, iv], bwd[iu, iv] = _general_pairs(bu, bv, iu, iv)
    if steps:
        st = step_volumes(u, lu, v, slot, lv, p, memo)
        if st is not None:
            fwd = np.where(st[2], st[0], fwd)
            bwd = np.where(st[2], st[1], bwd)
    cut = _cut_axes(v, slot) if steps else ()
    if cut:
        fwd, bwd = _through_operand(u, lu, v, slot, lv, p, cut, fwd, bwd, memo)
    f = fwd * t_in.elem_factor
    b = bwd * t_in.elem_factor if t_in.needs_grad else np.zeros_like(bwd)
    return f, b


def sender_level(lay: LayoutArrays) -> np.ndarray:
    """(K,) the outermost level each layout splits (0 if none): the links an exchange *from* it may need.

    An upper bound of the level :func:`edge_cost` charges: a device never
    fetches from farther than the outermost level the sending layout splits,
    since every group of devices on that level holds a whole copy.
    """
    return outer_level(lay.level_splits.prod(axis=2))


def group_union(lay: LayoutArrays, level: int) -> tuple[LayoutArrays, np.ndarray]:
    """Layouts whose every device holds what its whole level-``level`` group holds under ``lay``.

    The group of device q on level l is the devices that share q's
    positions on levels > l (its node for l = 0). They hold every
    combination of the inner coordinates ``x_{l',d}``, l' <= l, so
    (:mod:`shardplan.layout`) their boxes tile the coarse block
    ``Σ_{l' > l} x_{l',d} Π_{l < l'' < l'} c_{l'',d}`` of split
    ``Π_{l' > l} c_{l',d}`` on every dim: the layout with the splits of
    levels <= l set to 1 (outer levels unchanged) gives every device
    exactly that union. Returns the distinct such layouts and each input
    layout's row (K,).
    """
    ls = lay.level_splits.copy()
    st = lay.level_strides.copy()
    ls[: level + 1] = 1
    st[: level + 1] = 1
    k = len(lay)
    key = np.concatenate([ls.transpose(1, 0, 2).reshape(k, -1), st.transpose(1, 0, 2).reshape(k, -1)], axis=1)
    _, first, inv = unique_rows(key)
    return LayoutArrays(lay.levels, ls[:, first].copy(), st[:, first].copy()), inv


def edge_cost(u: Operator, cu, v: Operator, slot: int, cv, machine: Machine,
              ou: np.ndarray | None = None, ov: np.ndarray | None = None,
              volumes: tuple[np.ndarray, np.ndarray] | None = None, memo: EdgeMemo | None = None,
              hide: tuple[np.ndarray, np.ndarray] | None = None, analytic: bool = True,
              max_devices: int = MAX_DEVICES,
              extra: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """Seconds to redistribute the tensor of edge u -> v (input ``slot``), forward + backward: (K_u, K_v).

    Volumes are exact per device (:func:`edge_volumes`): the forward tensor
    moves from u's layout to v's, the gradient back. On a machine of L
    levels, let ``V_{-1}`` be the elements a device misses (the exact
    volume) and ``V_l`` those it misses from everything its level-l group
    holds (:func:`group_union`; ``V_{L-1} = 0``): ``V_l`` elements must
    come over level-(l+1) links, from outside the group, and at most
    ``V_{-1}`` over the node's own links. Links of different levels run
    at the same time (NVLink inside the node, the NIC across nodes), so
    each direction costs

        max_{l = 0 .. L-1, V_{l-1} > 0}  V_{l-1} · bytes / B_l + α_l       (0 if V_{-1} = 0).

    An exchange whose every device finds what it misses inside its node
    (``V_0 = 0``) is thereby charged at the node's links, whatever the
    sender's layout spans; one that must cross nodes pays the inter-node
    link for the part that crosses. On one level this is ``V / B + α``. ``max_devices``: as
    :func:`edge_volumes`'. ``hide``: the two ends' lent budgets (:func:`overlap_budgets`) and ``extra`` what
    chunking costs each end (:func:`chunk_extras`), both (producer's (2, K_u), consumer's (2, K_v)): the edge is
    then charged what :func:`exposed` leaves of its collectives.
    """
    p = machine.num_devices
    lu = as_layouts(cu, p, ou, machine.levels)
    lv = as_layouts(cv, p, ov, machine.levels)
    if volumes is None and hide is None and analytic and len(machine.levels) == 1 \
            and not machine.stepwise_redistribution and lu.partial is None and lv.partial is None:
        got = _pattern_seconds(u, lu, v, slot, lv, machine, memo)
        if got is not None:
            return got
    f, b = edge_volumes(u, lu, v, slot, lv, p, memo=memo, analytic=analytic,
                        max_devices=max_devices, steps=machine.stepwise_redistribution) if volumes is None else volumes
    nbytes = float(machine.dtype_bytes)
    memo = EdgeMemo() if memo is None else memo
    fwd_t = p2p_time(f * nbytes, machine, 0)
    bwd_t = p2p_time(b * nbytes, machine, 0)
    more_f, more_b = bool(f.any()), bool(b.any())
    for lvl in range(len(machine.levels) - 1):
        if more_f:  # forward: what v's devices miss from the union of u's tiles in their group
            gu, inv = memo.union(lu, lvl)
            vol = edge_volumes(u, gu, v, slot, lv, p, memo=memo, analytic=analytic, max_devices=max_devices)[0]  # (unions, K_v)
            fwd_t = np.maximum(fwd_t, p2p_time(vol * nbytes, machine, lvl + 1).take(inv, axis=0))
            more_f = bool(vol.any())
        if more_b:  # backward: what u's devices miss from the union of v's gradient tiles in their group
            gv, inv = memo.union(lv, lvl)
            vol = edge_volumes(u, lu, v, slot, gv, p, memo=memo, analytic=analytic, max_devices=max_devices)[1]  # (K_u, unions)
            bwd_t = np.maximum(bwd_t, p2p_time(vol * nbytes, machine, lvl + 1).take(inv, axis=1))
            more_b = bool(vol.any())
    if lu.partial is not None or lv.partial is not None:
        fwd_t, bwd_t = deferred_reductions(u, lu, v, slot, lv, machine, fwd_t, bwd_t)
    if hide is not None:
        eu, ev = (None, None) if extra is None else extra
        return exposed(fwd_t, bwd_t, hide[0], hide[1], machine.comm_contention, eu, ev)
    return fwd_t + bwd_t


NO_CLAIM = -1.0
"""A budget entry of :func:`overlap_budgets` where the operator lends its compute to no edge on that side."""


def exposed(fwd_t: np.ndarray, bwd_t: np.ndarray, hu: np.ndarray, hv: np.ndarray,
            share: float = 0.0, eu: np.ndarray | None = None, ev: np.ndarray | None = None) -> np.ndarray:
    """Seconds (K_u, K_v) of an edge whose collectives run beside a GEMM, per direction (rows: forward,
    backward) the least of

        C                              (nothing cut into chunks)
        max(C - H_s, φ C) + E_s        (the collective beside side s's chunked GEMM)

    over the sides s that lend to this edge: H_s the producer's budget ``hu`` (2, K_u) or the consumer's ``hv``
    (2, K_v) (:data:`NO_CLAIM` where a side lends nothing here), E_s what the chunks cost that GEMM, ``eu`` /
    ``ev`` (same shapes, 0 if not given: :func:`chunk_extras`), φ = ``share`` (the collective's share of the
    device while it runs: :mod:`shardplan.cost.contention`). With E = 0 this is ``max(C - H, φ C)`` with H the
    larger budget. One GEMM hides a direction's collective, never the two ends' together: each budget is lent
    to exactly one edge (:func:`overlap_budgets`), so no compute is counted twice; and a runtime chunks a product
    only where that pays (the least above)."""
    out = np.zeros(np.broadcast_shapes(np.shape(fwd_t), np.shape(bwd_t)), dtype=np.float64)
    for row, t in enumerate((fwd_t, bwd_t)):
        best = np.broadcast_to(np.asarray(t, dtype=np.float64), out.shape)
        for h, e in ((hu[row][:, None], None if eu is None else eu[row][:, None]),
                     (hv[row][None, :], None if ev is None else ev[row][None, :])):
            cand = exposed_beside(t, np.maximum(h, 0.0), share) + (0.0 if e is None else e)
            best = np.minimum(best, np.where(h >= 0.0, cand, np.inf))
        out += best
    return out


def overlap_budgets(op: Operator, lay: LayoutArrays, compute: np.ndarray, machine: Machine,
                    single_consumer: bool, input_slot: int | None,
                    chunked: bool = True,
                    extras: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """What each layout of ``op`` lends to an overlapped collective: ``(as producer (2, K), as consumer (2, K))``,
    seconds per direction (rows: forward, backward), :data:`NO_CLAIM` where it lends nothing on that side.

    A contraction (``op.reduction_dims`` non-empty) lends its compute to exactly one edge, chosen by its
    layout alone (and the graph's shape, fixed):

    * to its one consumer edge (``single_consumer``: the graph has exactly one edge out of ``op``) when the
      layout leaves its output as partial sums (:attr:`~shardplan.layout.Layout.partial`, a forward-deferrable
      operator, a split reduction): the reduction on that edge is cut into g chunks (g: the reduction
      group's size), each reduced while the GEMM computes the next; backward, the gradient's gather into the
      tile, chunk by chunk, beside the backward products;
    * otherwise to its one input edge (``input_slot``: the slot of the only edge into ``op``, None where the
      graph has none or several) when g > 1 devices hold the same input tile (the dims the input does not
      index are split g ways): the gather into that tile is cut into g chunks, each consumed as it arrives;
      backward, the reduction of the input's gradient.

    A pass of G seconds hides ``G (g - 1) / g`` of a collective (the first chunk of the GEMM, or the last one,
    has nothing to overlap: docs/cost-model.md). Forward G is the forward pass; backward G the backward
    passes less what the weight-gradient synchronisation already overlaps (``machine.overlap_grad``) and what
    the operator's own input-gradient all-reduce already hides (``machine.overlap_dgrad``), so no second claim
    is made on the same seconds; those are taken without contention (the seconds the collectives run beside
    the passes, :mod:`shardplan.cost.contention`), so contention never lends an edge more.

    ``chunked=False`` (tables without ``overlap_tp``, on a machine with ``overlap_dgrad``): nothing is cut
    into chunks; a product lends only its weight-gradient pass W, backward, to its one input edge where g > 1
    devices share the input tile and the layout is partial (it leaves the input gradient's sum to the edge;
    otherwise the operator reduces it itself, beside the same W, :func:`~shardplan.cost.operator.operator_cost`):
    the reduction (all-reduce, or reduce-scatter under sequence parallelism) of the input's gradient runs beside
    it, as Megatron-LM's column-parallel linear runs it, and the edge is charged ``max(C - W, φ C)``.

    Each pass is taken as its share of ``compute``: as :func:`~shardplan.cost.operator.operator_cost` costs the
    passes one by one (each product at its own tile and wave utilisation), else equal passes. ``extras``: what the
    chunks cost (:func:`chunk_extras`, computed when not given).
    """
    from dataclasses import replace

    from shardplan.cost.operator import operator_cost

    k = len(lay.splits)
    none = np.full((2, k), NO_CLAIM)
    if not op.reduction_dims:
        return none, none.copy()
    names = op.dim_names
    passes = op.passes
    compute = np.asarray(compute, dtype=np.float64)
    n_w = sum(1 for t in op.grad_tensors if t.role == "weight")
    if not chunked and (not machine.overlap_dgrad or input_slot is None or not n_w):
        return none, none.copy()
    # the passes' seconds do not depend on contention; the synchronisation's overlapped length below is taken without
    mine = operator_cost(op, lay, replace(machine, comm_contention=0.0))
    each = mine.pass_seconds
    fwd_share, w_share = np.full(k, 1.0 / passes), np.full(k, n_w / passes)
    if each is not None:
        total = each.sum(axis=0)
        w_rows = [1 + i for i, t in enumerate(op.grad_tensors) if t.role == "weight"]
        ok = total > 0
        fwd_share = np.where(ok, each[0] / np.where(ok, total, 1.0), fwd_share)
        w_share = np.where(ok, each[w_rows].sum(axis=0) / np.where(ok, total, 1.0), w_share)
    fwd = compute * fwd_share
    bwd = compute - fwd
    if (machine.overlap_grad or machine.overlap_dgrad) and passes > 1:  # backward seconds already hiding
        plain = operator_cost(op, lay, replace(machine, overlap_grad=False, overlap_dgrad=False))
        # the seconds of the backward those collectives occupy: their overlapped length, which contention does not
        # shorten (it slows the product beside them instead), so taken without it (``mine``)
        bwd = np.maximum(bwd - (plain.grad_allreduce - mine.grad_allreduce), 0.0)
    if not chunked:
        cons = none.copy()
        read = {a.dim for a in op.inputs[input_slot].axes if a.dim is not None}
        shared = [j for j, d in enumerate(names) if d not in read]
        g_in = lay.group_sizes(shared).prod(axis=0) if shared else np.ones(k, dtype=np.int64)
        wgrad = np.minimum(compute * w_share, bwd)
        # only a partial layout leaves the reduction to the edge; otherwise the operator's own all-reduce has
        # already taken min(C, W) of the same pass (operator_cost), which must not be lent a second time
        cons[1] = np.where((g_in > 1) & lay.deferred, wgrad, NO_CLAIM)
        return none, cons
    (produces, g_out), (takes, g_in) = _lends(op, lay, single_consumer, input_slot)
    ep, ec = chunk_extras(op, lay, machine, single_consumer, input_slot) if extras is None else extras
    prod = np.where(produces[None, :], np.stack([fwd + ep[0], bwd + ep[1]]) * ((g_out - 1) / g_out)[None, :],
                    NO_CLAIM)
    cons = np.where(takes[None, :], np.stack([fwd + ec[0], bwd + ec[1]]) * ((g_in - 1) / g_in)[None, :], NO_CLAIM)
    return prod, cons


def _lends(op: Operator, lay: LayoutArrays, single_consumer: bool,
           input_slot: int | None) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Which layouts of the contraction ``op`` lend their passes to an overlapped collective, and over how many
    chunks: ``((produces, g_out), (takes, g_in))``, (K,) each: to the consumer edge (the reduction of its
    partial sums over g_out) or to the input edge (the gather of its input tile among g_in devices); never
    both (:func:`overlap_budgets`)."""
    names = op.dim_names
    k = len(lay.splits)
    g_out = lay.group_sizes([names.index(d) for d in op.reduction_dims]).prod(axis=0)
    produces = np.zeros(k, dtype=bool)
    if single_consumer and lay.partial is not None and forward_deferrable(op):
        produces = lay.partial & (g_out > 1)
    g_in = np.ones(k, dtype=np.int64)
    if input_slot is not None:
        read = {a.dim for a in op.inputs[input_slot].axes if a.dim is not None}
        shared = [j for j, d in enumerate(names) if d not in read]
        if shared:
            g_in = lay.group_sizes(shared).prod(axis=0)
    takes = ~produces & (g_in > 1)
    return (produces, g_out), (takes, g_in)


def chunk_dims(op: Operator, slot: int | None) -> list[int]:
    """The dims (indices into ``op.dims``) along which an overlapped collective cuts the product ``op``: those
    its output shares with the activation operand (input ``slot``; the first input for the reduction of its
    output) and with no other operand: a linear layer's tokens, the rows of its forward and input-gradient
    products and the sum of its weight-gradient product."""
    if not op.inputs:
        return []
    epilogue = {t.name for t in op.epilogue_tensors}
    a = op.inputs[0 if slot is None else slot]
    others = [t for t in op.inputs + op.weights if t is not a and t.name not in epilogue]
    return [i for i, d in enumerate(op.dim_names)
            if d in op.output.dims and d in a.dims and not any(d in t.dims for t in others)]


def chunk_extras(op: Operator, lay: LayoutArrays, machine: Machine, single_consumer: bool,
                 input_slot: int | None) -> tuple[np.ndarray, np.ndarray]:
    """What cutting a lending product into chunks costs it: ``(as producer (2, K), as consumer (2, K))`` seconds
    (rows: forward, backward passes), 0 where the layout does not lend on that side (:func:`overlap_budgets`).

    The g chunks are g calls, each quantised into tiles and waves on its own
    (:func:`shardplan.cost.operator.chunk_seconds`, along :func:`chunk_dims`); the weight-gradient product
    sums over the cut and is one call. :func:`exposed` charges it to the edge that takes the budget, and only
    where chunking pays."""
    from shardplan.cost.operator import chunk_seconds

    k = len(lay.splits)
    out = []
    for (lends, g), slot in zip(_lends(op, lay, single_consumer, input_slot), (None, input_slot)):
        extra = np.zeros((2, k))
        if op.reduction_dims and machine.shaped_gemms and lends.any():
            d = chunk_seconds(op, lay.splits, machine, chunk_dims(op, slot), g)
            extra = np.where(lends[None, :], np.stack([d[0], d[1:].sum(axis=0)]), 0.0)
        out.append(extra)
    return out[0], out[1]


def deferred_reductions(u: Operator, lu: LayoutArrays, v: Operator, slot: int, lv: LayoutArrays, machine: Machine,
                        fwd_t: np.ndarray, bwd_t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Forward and backward seconds (K_u, K_v) of an edge with the reductions that partial layouts defer to it
    (module docstring): ``fwd_t`` / ``bwd_t`` are the ordinary redistributions of the two directions."""
    p = machine.num_devices
    nbytes = float(machine.dtype_bytes)
    t_in = v.inputs[slot]
    fwd_t, bwd_t = np.array(fwd_t, dtype=np.float64), np.array(bwd_t, dtype=np.float64)
    if lu.partial is not None and forward_deferrable(u):
        gl = lu.group_sizes([u.dim_names.index(d) for d in u.reduction_dims])
        rows = np.nonzero(lu.partial & (gl.prod(axis=0) > 1))[0]
        if len(rows):
            gl = gl[:, rows]
            bu = tensor_boxes(u, u.output, lu.take(rows), p, core=True)
            n = box_volumes(bu).max(axis=1) * u.output.elem_factor * nbytes
            sub = scatters(bu, tensor_boxes(v, t_in, lv, p, core=True), gl.prod(axis=0), machine.levels)
            fwd_t[rows] = np.minimum(allreduce_time(n, gl, machine)[:, None] + fwd_t[rows],
                                     _reduce_scatter_gather(n, gl, sub, machine))
    if lv.partial is not None and t_in.needs_grad and slot in deferred_inputs(v):
        gl = lv.group_sizes([v.dim_names.index(d) for d in v.grad_reduction_dims(t_in)])
        cols = np.nonzero(lv.partial & (gl.prod(axis=0) > 1))[0]
        if len(cols):
            gl = gl[:, cols]
            bv = tensor_boxes(v, t_in, lv.take(cols), p, core=True)
            n = box_volumes(bv).max(axis=1) * t_in.elem_factor * nbytes
            bu = _clip_to_read(tensor_boxes(u, u.output, lu, p, core=True), bv)
            sub = scatters(bv, bu, gl.prod(axis=0), machine.levels)
            bwd_t[:, cols] = np.minimum(allreduce_time(n, gl, machine)[None, :] + bwd_t[:, cols],
                                        _reduce_scatter_gather(n, gl, sub, machine).T)
    return fwd_t, bwd_t


def scatters(big: np.ndarray, small: np.ndarray, g: np.ndarray, levels: tuple[int, ...] | None = None) -> np.ndarray:
    """How a reduce-scatter among the groups of ``big`` delivers ``small``: the all-gather group that must
    follow it, per level, for every pair: (K_b, K_s, L) int, all 0 where it cannot.

    ``big`` (K_b, p, A, 2): boxes of a tensor held as partial sums, each layout's devices in groups of
    ``g`` (K_b,) holding the same box; ``small`` (K_s, p, A, 2): boxes of the same tensor wanted after the
    reduction; ``levels``: the machine's level sizes (default one level of p). A pair qualifies when, on every
    device, the small box lies inside the big one and is 1/h of it for some h > 1 dividing g (all boxes of a
    layout of equal volume), the big boxes are p / g different ones (each held by one group), and every
    (big, small) pair of boxes is held by exactly g / h devices: each group then holds h different small
    boxes (blocks of one regular split, equal or disjoint), which tile its big box, each on g / h devices.
    A reduce-scatter among the g devices (ranked so that the g / h devices of a small box get its g / h
    pieces) followed by an all-gather among those g / h devices leaves every device its small box; the
    all-gather group's size per level is read off the devices sharing device 0's pair (all 1 when h = g:
    nothing to gather).
    """
    k_b, k_s = len(big), len(small)
    levels = (big.shape[1],) if levels is None else tuple(int(x) for x in levels)
    if k_b == 0 or k_s == 0 or big.shape[2] == 0:
        return np.zeros((k_b, k_s, len(levels)), dtype=np.int64)
    # many layouts give a tensor the same boxes (they differ in dims that do not index it): once per distinct
    # (boxes, group size) of the big side and distinct boxes of the small side
    fb, ib = _dedupe(np.concatenate([big.reshape(k_b, -1), np.asarray(g, dtype=np.int64)[:, None]], axis=1))
    fs, is_ = _dedupe(small.reshape(k_s, -1))
    if len(fb) < k_b or len(fs) < k_s:
        return _scatters(big[fb], small[fs], np.asarray(g)[fb], levels).take(ib, axis=0).take(is_, axis=1)
    return _scatters(big, small, g, levels)


def _dedupe(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The first of every distinct row of a wide integer array (K, m), and each row's: ``(first (U,), inverse (K,))``."""
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    seen: dict[bytes, int] = {}
    inv = np.asarray([seen.setdefault(r.tobytes(), len(seen)) for r in rows], dtype=np.int64)
    first = np.zeros(len(seen), dtype=np.int64)
    first[inv[::-1]] = np.arange(len(rows) - 1, -1, -1)
    return first, inv


def _distinct(codes: np.ndarray) -> np.ndarray:
    """Distinct values in every row of an integer array (R, p): (R,)."""
    srt = np.sort(codes, axis=1)
    return 1 + (srt[:, 1:] != srt[:, :-1]).sum(axis=1)


def _scatters(big: np.ndarray, small: np.ndarray, g: np.ndarray, levels: tuple[int, ...]) -> np.ndarray:
    """:func:`scatters` on distinct boxes."""
    k_b, k_s = len(big), len(small)
    n_lv = len(levels)
    out = np.zeros((k_b, k_s, n_lv), dtype=np.int64)
    p = big.shape[1]
    q = np.arange(p, dtype=np.int64)
    base = np.cumprod((1,) + levels[:-1])
    pos = [(q // base[lvl]) % levels[lvl] for lvl in range(n_lv)]
    g = np.asarray(g, dtype=np.int64)
    vb, vs = box_volumes(big), box_volumes(small)
    even_b = (vb == vb[:, :1]).all(axis=1) & (vb[:, 0] > 0)
    even_s = (vs == vs[:, :1]).all(axis=1) & (vs[:, 0] > 0)
    h = np.where(even_s[None, :], vb[:, :1] // np.maximum(vs[None, :, 0], 1), 0)  # (K_b, K_s)
    cand = (even_b[:, None] & even_s[None, :] & (h > 1) & (h * vs[None, :, 0] == vb[:, :1])
            & (g[:, None] % np.maximum(h, 1) == 0))
    radix = np.maximum(big[..., 1].max(axis=(0, 1)), small[..., 1].max(axis=(0, 1))) + 1  # (A,)
    weights = np.concatenate([np.cumprod(radix[::-1])[::-1][1:], [1]]).astype(np.int64)
    code_s = small[..., 0].astype(np.int64) @ weights  # (K_s, p): a box of a regular split is named by its corner
    span_s = int(code_s.max()) + 1
    for i in np.nonzero(cand.any(axis=1))[0]:
        js = np.nonzero(cand[i])[0]
        inside = ((small[js, ..., 0] >= big[i, None, ..., 0]) & (small[js, ..., 1] <= big[i, None, ..., 1]))
        js = js[inside.all(axis=(1, 2))]
        if not len(js):
            continue
        code_b = big[i, :, :, 0].astype(np.int64) @ weights
        if _distinct(code_b[None, :])[0] * int(g[i]) != p:
            continue
        if (int(code_b.max()) + 1) * span_s >= 1 << 62:  # too wide for one int64 code: compact the big side first
            code_b = np.unique(code_b, return_inverse=True)[1].reshape(-1).astype(np.int64)
        pair = code_b[None, :] * span_s + code_s[js]  # (J, p)
        run = g[i] // h[i, js]  # devices per (big, small) pair
        srt = np.sort(pair, axis=1)
        new = srt[:, 1:] != srt[:, :-1]
        even = (new == (np.arange(1, p)[None, :] % run[:, None] == 0)).all(axis=1)  # every run exactly `run` long
        mine = pair == pair[:, :1]  # device 0's all-gather group
        sizes = np.stack([_distinct(np.where(mine, pos[lvl][None, :], -1)) - (~mine).any(axis=1)
                          for lvl in range(n_lv)], axis=1)  # (J, L)
        good = even & (sizes.prod(axis=1) == run)
        out[i, js[good]] = sizes[good]
    return out


def _reduce_scatter_gather(n: np.ndarray, gl: np.ndarray, sub: np.ndarray, machine: Machine) -> np.ndarray:
    """Seconds (R, K) of a reduce-scatter of ``n`` bytes (R,) among groups ``gl`` (L, R) followed by the
    all-gather of ``sub`` (R, K, L, from :func:`scatters`) on the 1/h of the buffer each small box is; inf
    where ``sub`` is 0."""
    r, k, n_lv = sub.shape
    ok = sub[..., 0] > 0
    sizes = np.where(ok[..., None], sub, 1)
    rs = reduce_scatter_time(n, gl, machine)
    share = (np.asarray(n, dtype=np.float64) / gl.prod(axis=0))[:, None] * sizes.prod(axis=2)  # n / h
    ag = allgather_time(share.reshape(-1), sizes.reshape(r * k, n_lv).T, machine).reshape(r, k)
    return np.where(ok, rs[:, None] + ag, np.inf)


def scatter_fit(u: Operator, lu: LayoutArrays, v: Operator, slot: int, sub: LayoutArrays, gs: np.ndarray,
                machine: Machine) -> np.ndarray:
    """(K_v', K_u) bool: u's output tiles scatter v's input tile ``slot`` over the ring group of ``gs`` devices,
    a distinct ``1/g`` block on each (:func:`scatters` with ``h = g``)."""
    p = machine.num_devices
    bv = tensor_boxes(v, v.inputs[slot], sub, p, core=True)
    bu = tensor_boxes(u, u.output, lu, p, core=True)
    fit = scatters(bv, bu, gs, machine.levels)  # (K_v', K_u, L): all 1 where each device holds a distinct 1/g
    return (fit[..., 0] > 0) & (fit.prod(axis=2) == 1)


def weight_views(u: Operator, wu: int, v: Operator, wv: int) -> tuple[Operator, Operator]:
    """The parameter of a weight edge as an ordinary edge: ``u`` writing it, ``v`` reading it (input 0).

    Both keep their iteration domains, so a layout places the parameter's tiles exactly as the reader's
    weight access places them. The parameter is held whole along every axis the owner reads through an
    offset, a window, a stride or a piece (a slice, a split's piece: :func:`~shardplan.cost.tiles.stored_axis`), as the run
    stores it; the reader keeps its access, so an offset axis reads exactly the block it slices, and the
    edge moves that block forward and its gradient back (:func:`_clip_to_read`; docs/cost-model.md,
    "Shared parameters").
    """
    from shardplan.ir import Tensor

    tu, tv = u.weights[wu], v.weights[wv]
    if tu.shape != tv.shape:
        raise ShardplanError(f"operator {v.name!r}: shared weight {tv.name!r} of shape {tv.shape} read as "
                             f"{u.name!r}'s {tu.name!r} of shape {tu.shape}")
    src_axes = stored_weight(tu).axes
    src = Operator(u.name, "parameter", u.dims, inputs=(),
                   output=Tensor("w", tu.shape, src_axes, "output", elem_factor=tu.elem_factor))
    dst = Operator(v.name, "parameter", v.dims,
                   inputs=(Tensor("w", tv.shape, tv.axes, "input", needs_grad=tv.needs_grad, src=u.name,
                                  elem_factor=tv.elem_factor),),
                   output=Tensor("y", (1,), (None,), "output"))
    return src, dst


def weight_sync(op: Operator, w: int, configs, machine: Machine) -> tuple[np.ndarray, np.ndarray]:
    """What owning weight ``w`` adds to ``op``'s cost when the readers' gradients are summed before one
    synchronisation (``machine.sum_shared_grads``): (seconds, bytes sent per device), each (K,).

    The operator costed with the weight as its own parameter and with it owned elsewhere: the
    difference is its gradient synchronisation as :mod:`shardplan.cost.operator` charges it (with the
    machine's buckets and overlap), not a copy of that formula.
    """
    from dataclasses import replace

    from shardplan.cost.operator import operator_cost

    def with_owner(owner):
        return replace(op, weights=tuple(replace(t, owner=owner) if i == w else t for i, t in enumerate(op.weights)))

    summing = replace(machine, sum_shared_grads=True)
    own = operator_cost(with_owner(None), configs, summing)
    lent = operator_cost(with_owner(("owner", "w")), configs, summing)  # any owner: synchronised there
    return np.maximum(own.total - lent.total, 0.0), np.maximum(own.comm_bytes - lent.comm_bytes, 0.0)


def weight_edge_cost(u: Operator, wu: int, cu, v: Operator, wv: int, cv, machine: Machine,
                     memo: EdgeMemo | None = None, analytic: bool = True,
                     max_devices: int = MAX_DEVICES) -> tuple[np.ndarray, np.ndarray]:
    """Seconds and bytes sent per device of a weight edge: ``v`` reads the parameter ``u`` owns; each (K_u, K_v).

    The parameter is kept once, in the owner's layout (its state is held there). Reader v under
    layout b needs it in its own layout. If the two layouts agree (every device holds the same tile
    of it under both: :func:`edge_volumes` moves nothing either way), nothing moves; otherwise the
    parameter moves from u's layout to v's forward and v's gradient, synchronised in v's layout,
    moves back (the redistribution of an edge u -> v carrying the parameter, :func:`edge_cost`).

    The synchronisation of v's gradient: by default (XLA) every reader synchronises its own in its
    own layout, charged on the reader's vertex; nothing more here. With ``machine.sum_shared_grads``
    the readers' gradients are summed on the device and synchronised once, in u's layout (``S_u``,
    charged on u, no reader charged on its vertex): where the layouts agree, v's partial gradient is
    added to u's and costs nothing more but ``max(0, S_v(b) - S_u(a))`` (u's layout needs no
    synchronisation of the sum that v's needs: a replicated grid); where they differ, v's gradient
    is synchronised in v's layout before it is sent, ``S_v(b)``, what owning it would cost v
    (:func:`weight_sync`).

    Every term depends on the two layouts only, so the objective stays a sum of vertex and edge terms
    and every exact solver stays exact for it.
    """
    p = machine.num_devices
    lu = as_layouts(cu, p, None, machine.levels).without_partial()  # a parameter is never a partial sum
    lv = as_layouts(cv, p, None, machine.levels).without_partial()
    src, dst = weight_views(u, wu, v, wv)
    f, b = edge_volumes(src, lu, dst, 0, lv, p, memo=memo, analytic=analytic, max_devices=max_devices,
                        steps=machine.stepwise_redistribution)
    moved = edge_cost(src, lu, dst, 0, lv, machine, volumes=(f, b), memo=memo, analytic=analytic,
                      max_devices=max_devices)
    agree = (f == 0) & (b == 0)
    nbytes = float(machine.dtype_bytes)
    if not machine.sum_shared_grads:
        return np.where(agree, 0.0, moved), np.where(agree, 0.0, (f + b) * nbytes)
    su, bu = weight_sync(u, wu, lu, machine)
    sv, bv = weight_sync(v, wv, lv, machine)
    secs = np.where(agree, np.maximum(sv[None, :] - su[:, None], 0.0), moved + sv[None, :])
    sent = np.where(agree, np.maximum(bv[None, :] - bu[:, None], 0.0), (f + b) * nbytes + bv[None, :])
    return secs, sent
