"""t_x(u, c_u, v, c_v): redistribution cost of one edge, for every pair of configurations.

For an edge u -> v carrying tensor T, let A_u(q) be the box of T that device
q holds after u (u's output tile, replicated over u's dims that do not
index T) and A_v(q) the box v needs there (its core input tile; halos are
part of v's own cost). Under the shared row-major device numbering:

    forward  = max_q |A_v(q)| - |A_v(q) ∩ A_u(q)|
    backward = max_q |A_u(q)| - |A_u(q) ∩ A_v(q)|     (if T needs a gradient)

in elements; times bytes per element over the link bandwidth (+ alpha per
direction that moves anything). The intersection is exact: boxes
intersect axis by axis. This is the paper's definition, computed exactly
instead of the reference prototype's shortcut (zero overlap whenever v
uses more devices than u).

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

from shardplan.cost.collectives import p2p_time
from shardplan.cost.tiles import active_devices, box_volumes, grid_strides, tensor_boxes
from shardplan.ir import Operator
from shardplan.machine import Machine

__all__ = ["edge_volumes", "edge_cost"]

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


def _axis_blocks(op: Operator, tensor, configs: np.ndarray, orders: np.ndarray | None, p: int):
    """Per axis: split count, device stride and block length per configuration, and which are even.

    Returns (splits (A, K), strides (A, K), lengths (A, K), regular (K,)). An
    axis is regular when its core tile on every device is block
    ``(q // stride) % split`` of equal length (see :mod:`shardplan.cost.tiles`).
    """
    configs = np.asarray(configs, dtype=np.int64)
    k = len(configs)
    names = op.dim_names
    ext = op.extents
    st = grid_strides(configs, orders) if configs.shape[1] else np.ones((k, 0), dtype=np.int64)
    n_ax = len(tensor.axes)
    splits = np.ones((n_ax, k), dtype=np.int64)
    strides = np.ones((n_ax, k), dtype=np.int64)
    lengths = np.zeros((n_ax, k), dtype=np.int64)
    regular = np.ones(k, dtype=bool)
    for a, (am, size) in enumerate(zip(tensor.axes, tensor.shape)):
        if am.dim is None:
            lengths[a] = size
            continue
        j = names.index(am.dim)
        c = configs[:, j]
        splits[a], strides[a] = c, st[:, j]
        if am.inner or am.is_plain:
            lengths[a] = size // c
        elif (am.window is not None or am.stride != 1) and not am.partial:
            lengths[a] = size // c
            regular &= size % c == 0
        else:  # offset or partial access (concat piece, slice): regular only where unsplit and read whole
            whole = am.offset <= 0 and ext[am.dim] + am.offset >= size
            lengths[a] = size
            splits[a] = 1
            regular &= (c == 1) & whole
    return splits, strides, lengths, regular


def _pattern_masks(cu: np.ndarray, su: np.ndarray, cv: np.ndarray, sv: np.ndarray, p: int, words: int):
    """For one axis: match bit-masks and nesting flags for every distinct (split, stride) pattern pair.

    Device q holds block ``(q // s) % c``. With nested splits, block i of the
    coarser layout contains block j of the finer one iff ``i == j // ratio``.
    Returns (pattern index of u rows, of v rows, masks (Pu, Pv, words) uint64, nested (Pu, Pv)).
    """
    pu, iu = np.unique(np.stack([cu, su], axis=1), axis=0, return_inverse=True)
    pv, iv = np.unique(np.stack([cv, sv], axis=1), axis=0, return_inverse=True)
    q = np.arange(p, dtype=np.int64)
    bu = (q[None, :] // pu[:, 1:2]) % pu[:, 0:1]  # (Pu, p)
    bv = (q[None, :] // pv[:, 1:2]) % pv[:, 0:1]
    c1, c2 = pu[:, 0][:, None], pv[:, 0][None, :]
    nested = (c1 % c2 == 0) | (c2 % c1 == 0)
    ratio_uv = np.where(c2 % c1 == 0, c2 // c1, 1)  # u coarser: u block == v block // ratio
    ratio_vu = np.where(c1 % c2 == 0, c1 // c2, 1)  # v coarser: v block == u block // ratio
    u_coarse = (c2 % c1 == 0)[..., None]
    match = np.where(u_coarse, bu[:, None, :] == bv[None, :, :] // ratio_uv[..., None],
                     bv[None, :, :] == bu[:, None, :] // ratio_vu[..., None])
    return iu.ravel(), iv.ravel(), _pack(match, words), nested


def _pack(bits: np.ndarray, words: int) -> np.ndarray:
    """Pack a boolean last axis (length <= 64 * words) into uint64 words."""
    pad = words * 64 - bits.shape[-1]
    if pad:
        bits = np.concatenate([bits, np.zeros(bits.shape[:-1] + (pad,), dtype=bool)], axis=-1)
    packed = np.packbits(bits, axis=-1, bitorder="little")
    return packed.view(np.uint64).reshape(bits.shape[:-1] + (words,))


def _fast(u: Operator, cu: np.ndarray, v: Operator, t_in, cv: np.ndarray, p: int, ou, ov):
    """Moved volumes via block-match masks; returns (fwd, bwd, exact) with ``exact`` False where not applicable."""
    spu, stu, lenu, regu = _axis_blocks(u, u.output, cu, ou, p)
    spv, stv, lenv, regv = _axis_blocks(v, t_in, cv, ov, p)
    words = (p + 63) // 64
    act_u = _pack(active_devices(cu, p), words)  # (Ku, W)
    act_v = _pack(active_devices(cv, p), words)
    m = act_u[:, None, :] & act_v[None, :, :]  # (Ku, Kv, W)
    exact = regu[:, None] & regv[None, :]
    overlap = np.ones((len(cu), len(cv)), dtype=np.int64)
    for a in range(len(t_in.axes)):
        iu, iv, masks, nested = _pattern_masks(spu[a], stu[a], spv[a], stv[a], p, words)
        m &= masks[iu[:, None], iv[None, :]]
        exact &= nested[iu[:, None], iv[None, :]]
        overlap *= np.minimum(lenu[a][:, None], lenv[a][None, :])
    have = np.prod(lenu, axis=0)
    need = np.prod(lenv, axis=0)
    fwd_ok = (m == act_v[None, :, :]).all(axis=-1)
    bwd_ok = (m == act_u[:, None, :]).all(axis=-1)
    fwd = np.where(fwd_ok, need[None, :] - overlap, need[None, :])
    bwd = np.where(bwd_ok, have[:, None] - overlap, have[:, None])
    return fwd, bwd, exact


def edge_volumes(u: Operator, cu: np.ndarray, v: Operator, slot: int, cv: np.ndarray, p: int,
                 ou: np.ndarray | None = None, ov: np.ndarray | None = None,
                 fast: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Elements moved per device (max over devices): forward and backward, each (K_u, K_v).

    ``ou``/``ov``: optional dimension orders of the configurations (see
    :func:`~shardplan.cost.tiles.device_grid`). ``fast=False`` forces the
    general path everywhere (for testing).
    """
    t_in = v.inputs[slot]
    cu = np.asarray(cu, dtype=np.int64)
    cv = np.asarray(cv, dtype=np.int64)
    if fast:
        fwd, bwd, exact = _fast(u, cu, v, t_in, cv, p, ou, ov)
    else:
        fwd = bwd = None
        exact = np.zeros((len(cu), len(cv)), dtype=bool)
    if fwd is None or not exact.all():
        bu = tensor_boxes(u, u.output, cu, p, core=True, orders=ou)
        bv = tensor_boxes(v, t_in, cv, p, core=True, orders=ov)
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


def _replica_within_node(configs: np.ndarray, machine: Machine) -> np.ndarray:
    """Whether every node holds a whole replica of the layout: prod(c) divides the node size. (K,)."""
    n = np.asarray(configs, dtype=np.int64).prod(axis=1)
    return (int(machine.node_size) % n) == 0  # type: ignore[arg-type]


def edge_cost(u: Operator, cu: np.ndarray, v: Operator, slot: int, cv: np.ndarray, machine: Machine,
              ou: np.ndarray | None = None, ov: np.ndarray | None = None) -> np.ndarray:
    """Seconds to redistribute the tensor of edge u -> v (input ``slot``), forward + backward: (K_u, K_v).

    On a hierarchical machine a device fetches what it misses from inside
    its node when its node holds a whole replica of the sending layout
    (prod(c) divides the node size; the grid is replicated over the nodes):
    the forward tensor is sent by u's layout, the gradient by v's. Otherwise
    the transfer runs at the inter-node bandwidth.
    """
    p = machine.num_devices
    f, b = edge_volumes(u, cu, v, slot, cv, p, ou, ov)
    nbytes = float(machine.dtype_bytes)
    if machine.hierarchical:
        fwd_inter = np.broadcast_to(~_replica_within_node(cu, machine)[:, None], f.shape)
        bwd_inter = np.broadcast_to(~_replica_within_node(cv, machine)[None, :], f.shape)
    else:
        fwd_inter = bwd_inter = np.zeros(f.shape, dtype=bool)
    return p2p_time(f * nbytes, machine, fwd_inter) + p2p_time(b * nbytes, machine, bwd_inter)
