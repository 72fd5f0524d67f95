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
both operators.

Fast path: when every axis of both layouts is cut into equal blocks and,
axis by axis, one split divides the other (nested blocks), a device's
overlap is either the smaller block on every axis or nothing. The edge
then needs only, per pair of configurations, whether *every* device has
the matching block: one 64-bit mask per device word and axis, ANDed
across axes. Pairs outside that case (uneven blocks, concatenation
pieces, splits that do not nest) take the general path: the pairwise
box intersection over (K_u, K_v, p), in chunks, one axis at a time. Both
give the same numbers where both apply (tested).
"""

from __future__ import annotations

import numpy as np

from shardplan.cost.collectives import outer_level, p2p_time
from shardplan.cost.tiles import as_layouts, box_volumes, tensor_boxes
from shardplan.errors import ShardplanError
from shardplan.ir import Operator
from shardplan.layout import LayoutArrays, pattern_blocks
from shardplan.machine import Machine

__all__ = ["edge_volumes", "edge_cost", "sender_level"]

_CHUNK_ELEMS = 1 << 22


def _overlap(lu: np.ndarray, hu: np.ndarray, lv: np.ndarray, hv: np.ndarray) -> np.ndarray:
    """Points in the intersection of every u box with every v box: (Ku, Kv, p).

    Inputs are per-axis bounds of shape (A, K, p); the product over axes is
    accumulated axis by axis (contiguous, no trailing small-axis reductions).
    """
    out = None
    for a in range(lu.shape[0]):
        ov = np.minimum(hu[a][:, None, :], hv[a][None, :, :])
        ov -= np.maximum(lu[a][:, None, :], lv[a][None, :, :])
        np.maximum(ov, 0, out=ov)
        if out is None:
            out = ov.astype(np.int64)
        else:
            out *= ov
    if out is None:  # scalar tensors: one point, held wherever the device is active
        out = np.ones((lu.shape[1], lv.shape[1], lu.shape[2]), dtype=np.int64)
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
    step = max(1, _CHUNK_ELEMS // max(1, n_v * p))
    for s in range(0, n_u, step):
        sl = slice(s, s + step)
        inter = _overlap(lu[:, sl], hu[:, sl], lv, hv)  # (c, Kv, p)
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


def _axis_blocks(op: Operator, tensor, lay: LayoutArrays):
    """Per axis: block pattern and block length per layout, and which layouts are even.

    Returns (splits (A, K), patterns (A, K, 2L), lengths (A, K), regular (K,)).
    An axis is regular when its core tile on every device is the block
    ``x_d(q)`` (the device's tile coordinate along the axis's dim, which the
    pattern fixes: see :meth:`~shardplan.layout.LayoutArrays.patterns`) of
    equal length (see :mod:`shardplan.cost.tiles`).
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
    for a, (am, size) in enumerate(zip(tensor.axes, tensor.shape)):
        if am.dim is None:
            lengths[a] = size
            continue
        j = names.index(am.dim)
        c = configs[:, j]
        splits[a], pats[a] = c, lay.patterns(j)
        if am.inner or am.is_plain:
            lengths[a] = size // c
        elif (am.window is not None or am.stride != 1) and not am.partial:
            lengths[a] = size // c
            regular &= size % c == 0
        else:  # offset or partial access (concat piece, slice): regular only where unsplit and read whole
            whole = am.offset <= 0 and ext[am.dim] + am.offset >= size
            lengths[a] = size
            splits[a] = 1
            pats[a] = 1
            regular &= (c == 1) & whole
    return splits, pats, lengths, regular


def _pattern_masks(cu: np.ndarray, pu_rows: np.ndarray, cv: np.ndarray, pv_rows: np.ndarray,
                   levels: tuple[int, ...], words: int):
    """For one axis: match bit-masks and nesting flags for every distinct block-pattern pair.

    Device q holds block ``x(q)`` of the pattern. With nested splits, block i
    of the coarser layout contains block j of the finer one iff ``i == j // ratio``.
    Returns (pattern index of u rows, of v rows, masks (Pu, Pv, words) uint64, nested (Pu, Pv)).
    """
    pu, iu = np.unique(np.concatenate([cu[:, None], pu_rows], axis=1), axis=0, return_inverse=True)
    pv, iv = np.unique(np.concatenate([cv[:, None], pv_rows], axis=1), axis=0, return_inverse=True)
    small = np.int16 if int(max(pu[:, 0].max(), pv[:, 0].max())) < 2**15 else np.int64
    bu = pattern_blocks(pu[:, 1:], levels).astype(small)  # (Pu, p)
    bv = pattern_blocks(pv[:, 1:], levels).astype(small)
    c1, c2 = pu[:, 0][:, None], pv[:, 0][None, :]
    nested = (c1 % c2 == 0) | (c2 % c1 == 0)
    # nested blocks match iff both map to the same block of the coarser split
    cmin = np.minimum(c1, c2)
    ku = (c1 // cmin).astype(small)
    kv = (c2 // cmin).astype(small)
    match = (bu[:, None, :] // ku[..., None]) == (bv[None, :, :] // kv[..., None])
    return iu.ravel(), iv.ravel(), _pack(match, words), nested


def _pack(bits: np.ndarray, words: int) -> np.ndarray:
    """Pack a boolean last axis (length <= 64 * words) into uint64 words."""
    pad = words * 64 - bits.shape[-1]
    if pad:
        bits = np.concatenate([bits, np.zeros(bits.shape[:-1] + (pad,), dtype=bool)], axis=-1)
    packed = np.packbits(bits, axis=-1, bitorder="little")
    return packed.view(np.uint64).reshape(bits.shape[:-1] + (words,))


def _fast(u: Operator, lu: LayoutArrays, v: Operator, t_in, lv: LayoutArrays, p: int):
    """Moved volumes via block-match masks; returns (fwd, bwd, exact) with ``exact`` False where not applicable.

    Whether every device finds its block depends on a layout only through
    its block pattern on each axis of the tensor and its active devices, so
    the device masks are combined once per distinct (pattern tuple) of each
    side and broadcast to the layouts that share it.
    """
    spu, pau, lenu, regu = _axis_blocks(u, u.output, lu)
    spv, pav, lenv, regv = _axis_blocks(v, t_in, lv)
    words = (p + 63) // 64
    n_ax = len(t_in.axes)
    ax_u, ax_v, masks, nests = [], [], [], []
    for a in range(n_ax):
        iu, iv, mk, nested = _pattern_masks(spu[a], pau[a], spv[a], pav[a], lu.levels, words)
        ax_u.append(iu)
        ax_v.append(iv)
        masks.append(mk)
        nests.append(nested)
    prod_u = lu.level_splits.prod(axis=2)  # (L, K): fixes the active devices
    prod_v = lv.level_splits.prod(axis=2)
    key_u = np.concatenate([np.asarray(ax_u, dtype=np.int64).reshape(n_ax, len(lu)), prod_u], axis=0).T
    key_v = np.concatenate([np.asarray(ax_v, dtype=np.int64).reshape(n_ax, len(lv)), prod_v], axis=0).T
    gu, first_u, inv_u = np.unique(key_u, axis=0, return_index=True, return_inverse=True)
    gv, first_v, inv_v = np.unique(key_v, axis=0, return_index=True, return_inverse=True)
    inv_u, inv_v = inv_u.ravel(), inv_v.ravel()
    act_u = _pack(lu.take(first_u).active(), words)  # (Gu, W)
    act_v = _pack(lv.take(first_v).active(), words)
    m = act_u[:, None, :] & act_v[None, :, :]  # (Gu, Gv, W)
    nested_all = np.ones((len(gu), len(gv)), dtype=bool)
    for a in range(n_ax):
        m &= masks[a][gu[:, a][:, None], gv[:, a][None, :]]
        nested_all &= nests[a][gu[:, a][:, None], gv[:, a][None, :]]
    def expand(x: np.ndarray) -> np.ndarray:  # (Gu, Gv) -> (Ku, Kv)
        return x.take(inv_u, axis=0).take(inv_v, axis=1)

    fwd_ok = expand((m == act_v[None, :, :]).all(axis=-1))
    bwd_ok = expand((m == act_u[:, None, :]).all(axis=-1))
    exact = expand(nested_all)
    exact &= regu[:, None]
    exact &= regv[None, :]
    # the overlap of nested equal blocks depends on the block lengths only: per distinct length pair
    lu_u, inv_lu = np.unique(lenu.T, axis=0, return_inverse=True)
    lv_u, inv_lv = np.unique(lenv.T, axis=0, return_inverse=True)
    ov_small = np.minimum(lu_u[:, None, :], lv_u[None, :, :]).prod(axis=-1)
    overlap = ov_small.take(inv_lu.ravel(), axis=0).take(inv_lv.ravel(), axis=1)
    have = np.prod(lenu, axis=0)
    need = np.prod(lenv, axis=0)
    fwd = np.where(fwd_ok, need[None, :] - overlap, need[None, :])
    bwd = np.where(bwd_ok, have[:, None] - overlap, have[:, None])
    return fwd, bwd, exact


def edge_volumes(u: Operator, cu, v: Operator, slot: int, cv, p: int,
                 ou: np.ndarray | None = None, ov: np.ndarray | None = None,
                 fast: bool = True, levels: tuple[int, ...] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Elements moved per device (max over devices): forward and backward, each (K_u, K_v).

    ``cu``/``cv``: :class:`~shardplan.layout.LayoutArrays` of the two
    operators (same levels), or configuration rows with optional nesting
    orders ``ou``/``ov`` (laid out on ``levels``, default one level of p).
    ``fast=False`` forces the general path everywhere (for testing).
    """
    t_in = v.inputs[slot]
    lu = as_layouts(cu, p, ou, levels)
    lv = as_layouts(cv, p, ov, levels)
    if lu.levels != lv.levels:
        raise ShardplanError(f"edge {u.name!r} -> {v.name!r}: layouts on different machine levels "
                             f"{lu.levels} and {lv.levels}")
    if fast:
        fwd, bwd, exact = _fast(u, lu, v, t_in, lv, p)
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
    f = fwd * t_in.elem_factor
    b = bwd * t_in.elem_factor if t_in.needs_grad else np.zeros_like(bwd)
    return f, b


def sender_level(lay: LayoutArrays) -> np.ndarray:
    """(K,) the level whose links a redistribution *from* each layout uses.

    A device fetches what it misses from inside its node when its node
    holds a whole copy of the sending layout (nothing split on the outer
    levels): level 0. Otherwise the outermost level the layout splits
    (every tile lives somewhere on it). On one level: 0.
    """
    return outer_level(lay.level_splits.prod(axis=2))


def edge_cost(u: Operator, cu, v: Operator, slot: int, cv, machine: Machine,
              ou: np.ndarray | None = None, ov: np.ndarray | None = None,
              volumes: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """Seconds to redistribute the tensor of edge u -> v (input ``slot``), forward + backward: (K_u, K_v).

    Volumes are exact per device (:func:`edge_volumes`); the forward tensor
    is sent from u's layout, the gradient from v's, each over the links of
    the sender's level (:func:`sender_level`): on a two-level machine inside
    the node when the node holds a whole copy of the sender's layout, else
    across nodes.
    """
    p = machine.num_devices
    lu = as_layouts(cu, p, ou, machine.levels)
    lv = as_layouts(cv, p, ov, machine.levels)
    f, b = edge_volumes(u, lu, v, slot, lv, p) if volumes is None else volumes
    nbytes = float(machine.dtype_bytes)
    fwd_lv = np.broadcast_to(sender_level(lu)[:, None], f.shape)
    bwd_lv = np.broadcast_to(sender_level(lv)[None, :], f.shape)
    return p2p_time(f * nbytes, machine, fwd_lv) + p2p_time(b * nbytes, machine, bwd_lv)
