"""Per-device tiles: which box of each tensor every device holds or needs.

Devices are numbered over a configuration's grid in row-major order: for a
configuration c = (c_1..c_n) with n = prod(c) devices, the grid is
replicated floor(p / n) times (as a device mesh with a leading replica
axis): device q has grid coordinates ``unravel(q mod n, c)``, and the
p mod n devices past the last replica are idle and hold nothing. The same
numbering is used for every operator, so the tiles of a producer and a
consumer can be intersected exactly. A configuration may carry an *order*
of its dimensions (which is the most significant in the numbering), as a
device mesh may nest its axes either way; without one, the operator's own
dimension order is used.

Along a dimension d split c_d ways, coordinate i owns the block
``[i*E_d/c_d, (i+1)*E_d/c_d)`` (c_d divides E_d). A tensor axis maps these
blocks through its :class:`~shardplan.ir.AxisMap`:

* plain / offset axis: ``[lo + offset, hi + offset)`` clipped to the axis;
* merged axis (dim, inner...): the leading block times the inner size;
* windowed axis ``stride*h + dil*r + offset``: the *needed* range is
  ``[stride*h_lo + dil*r_lo + offset, stride*(h_hi-1) + dil*(r_hi-1) + offset + 1)``
  (clipped), the *core* (owned) range is the proportional share
  ``[floor(h_lo*S/E_h), floor(h_hi*S/E_h))`` of the axis of extent S; the
  difference is the halo;
* unindexed axis: the whole axis (replicated).

A tensor that does not use a split dimension is thereby replicated over it.
Boxes are arrays of shape (K, p, n_axes, 2) holding [lo, hi) per axis.
"""

from __future__ import annotations

import numpy as np

from shardplan.ir import Operator, Tensor

__all__ = ["grid_strides", "device_grid", "active_devices", "tensor_boxes", "box_volumes"]


def grid_strides(configs: np.ndarray, orders: np.ndarray | None = None) -> np.ndarray:
    """Device-index stride of every dimension: (K, n).

    Without ``orders`` the grid is row-major in the operator's dimension
    order. ``orders[k]`` is a permutation listing the dims from the most to
    the least significant (the nesting of a device mesh's axes): the stride
    of dim ``orders[k, i]`` is the product of the splits of ``orders[k, i+1:]``.
    """
    configs = np.asarray(configs, dtype=np.int64)
    k, n = configs.shape
    if orders is None:
        orders = np.broadcast_to(np.arange(n), (k, n))
    ordered = np.take_along_axis(configs, orders, axis=1)
    s = np.ones_like(ordered)
    if n > 1:
        s[:, :-1] = np.cumprod(ordered[:, :0:-1], axis=1)[:, ::-1]
    strides = np.empty_like(s)
    np.put_along_axis(strides, np.asarray(orders), s, axis=1)
    return strides


def device_grid(configs: np.ndarray, p: int, orders: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Grid coordinates (K, p, n) of every device under every configuration, and the active mask (K, p)."""
    configs = np.asarray(configs, dtype=np.int64)
    k, n = configs.shape
    if n == 0:
        return np.zeros((k, p, 0), dtype=np.int64), np.broadcast_to(np.arange(p) < 1, (k, p)).copy()
    strides = grid_strides(configs, orders)
    q = np.arange(p, dtype=np.int64)
    # (q // stride) % c == ((q % n) // stride) % c because stride * c divides n = prod(c)
    coords = (q[None, :, None] // strides[:, None, :]) % configs[:, None, :]
    return coords, active_devices(configs, p)


def active_devices(configs: np.ndarray, p: int) -> np.ndarray:
    """(K, p) mask of devices that hold a tile: floor(p / prod(c)) replicas of the grid."""
    n = np.asarray(configs, dtype=np.int64).prod(axis=1)
    return np.arange(p, dtype=np.int64)[None, :] < ((p // n) * n)[:, None]


def _block(op: Operator, configs: np.ndarray, coords: np.ndarray, dim: str) -> tuple[np.ndarray, np.ndarray]:
    j = op.dim_names.index(dim)
    ext = op.extents[dim]
    c = configs[:, j][:, None]
    i = coords[:, :, j]
    size = ext // c
    return i * size, (i + 1) * size


def tensor_boxes(op: Operator, tensor: Tensor, configs: np.ndarray, p: int, core: bool = True,
                 orders: np.ndarray | None = None,
                 grid: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """[lo, hi) per axis of ``tensor`` on every device: int64 array (K, p, n_axes, 2).

    ``core=True`` gives the owned tile (what a layout holds; halos excluded);
    ``core=False`` the tile the operator reads (halos included). Idle
    devices get empty boxes [0, 0). ``grid``: the result of
    :func:`device_grid` for these configurations, when the caller has it.
    """
    configs = np.asarray(configs, dtype=np.int64)
    coords, active = device_grid(configs, p, orders) if grid is None else grid
    k = configs.shape[0]
    ext = op.extents
    out = np.zeros((k, p, len(tensor.axes), 2), dtype=np.int64)
    for a, (am, size) in enumerate(zip(tensor.axes, tensor.shape)):
        if am.dim is None:
            lo = np.zeros((k, p), dtype=np.int64)
            hi = np.full((k, p), size, dtype=np.int64)
        elif am.inner:
            unit = 1
            for d in am.inner:
                unit *= ext[d]
            blo, bhi = _block(op, configs, coords, am.dim)
            lo, hi = blo * unit, bhi * unit
        else:
            xl, xh = _block(op, configs, coords, am.dim)
            windowed = am.window is not None or am.stride != 1
            if core and windowed:
                e = ext[am.dim]
                lo, hi = (xl * size) // e, (xh * size) // e
            else:
                if am.window is not None:
                    rl, rh = _block(op, configs, coords, am.window)
                else:
                    rl, rh = np.zeros_like(xl), np.ones_like(xh)
                lo = am.stride * xl + am.dilation * rl + am.offset
                hi = am.stride * (xh - 1) + am.dilation * (rh - 1) + am.offset + 1
            lo = np.clip(lo, 0, size)
            hi = np.clip(hi, 0, size)
            hi = np.maximum(hi, lo)
        out[:, :, a, 0] = np.where(active, lo, 0)
        out[:, :, a, 1] = np.where(active, hi, 0)
    return out


def box_volumes(boxes: np.ndarray) -> np.ndarray:
    """Number of points in each box: (..., n_axes, 2) -> (...)."""
    return np.prod(boxes[..., 1] - boxes[..., 0], axis=-1)
