"""Per-device tiles: which box of each tensor every device holds or needs.

Which device works on which tile is the operator's
:class:`~shardplan.layout.Layout` (splits per machine level and nesting; its
module docstring gives the numbering). On a one-level machine a
configuration c = (c_1..c_n) with n = prod(c) is a row-major grid
replicated floor(p / n) times (a device mesh with a leading replica axis):
device q has grid coordinates ``unravel(q mod n, c)`` in the configuration's
nesting order, and the p mod n devices past the last replica are idle and
hold nothing. The same numbering of devices is used for every operator, so
the tiles of a producer and a consumer can be intersected exactly.
Functions here take :class:`~shardplan.layout.LayoutArrays`, or plain
configuration rows (one level) with optional nesting orders.

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

Per-device arrays are needed only where devices differ in more than their
block index: irregular tiles (windows, offsets, pieces, uneven splits) and
layouts that leave devices idle. Where every tile is regular
(:func:`regular_tile_lengths`) and every device works (:func:`all_active`,
read off the level sizes and level products), every device holds a tile of
the same lengths, so volumes and memory are per layout (K,), not per device;
:mod:`shardplan.cost.edge` likewise decides the redistribution of such tiles
from the layouts' block patterns alone (docs/cost-model.md, "Meshes of any
size"). The functions here that do build per-device arrays refuse more than
:data:`MAX_DEVICES` devices (:func:`check_per_device`, raising
:class:`~shardplan.errors.PerDeviceLimitError`); a cost-table build checks its edges against its own
``max_devices`` option (default :data:`MAX_DEVICES`) before allocating anything, so a caller can lower the cap
to try the refusal on a small machine.
"""

from __future__ import annotations

import numpy as np

from shardplan.errors import PerDeviceLimitError
from shardplan.ir import Operator, Tensor
from shardplan.layout import Layout, LayoutArrays, flat_layout_arrays

__all__ = ["as_layouts", "grid_strides", "device_grid", "active_devices", "tensor_boxes", "lazy_grid", "box_volumes",
           "tile_volumes", "regular_tile_lengths", "all_active", "uniform_tiles", "MAX_DEVICES", "check_per_device"]

MAX_DEVICES = 4096
"""The most devices for which a tile per device and layout is built (irregular tiles, idle devices): a (K, p)
int64 array per axis is 8 K p bytes, 1.6 GB for K = 50,000 layouts on 4,096 devices."""


def check_per_device(p: int, what: str, cap: int = MAX_DEVICES) -> None:
    """Refuse (:class:`~shardplan.errors.PerDeviceLimitError`, a ShardplanError) building per-device arrays on
    more than ``cap`` devices (default :data:`MAX_DEVICES`; a build's ``max_devices`` option); ``what`` says which
    tiles need them."""
    if p > cap:
        raise PerDeviceLimitError(f"{p} devices: {what} are not the same on every device, and the cost model keeps "
                                  f"such tiles per device and layout, so it supports them on at most {cap} devices "
                                  "(regular tiles on every device have no such limit)")


def all_active(lay: LayoutArrays) -> np.ndarray:
    """(K,) bool: the layouts under which every device holds a tile (no idle device), without a per-device array.

    Device q is active iff its position on every level l is below ``r_l P_l``
    (``P_l`` the level's split product, ``r_l = s_l // P_l`` its copies:
    :mod:`shardplan.layout`), so every device is active iff ``P_l`` divides
    ``s_l`` on every level.
    """
    prods = lay.level_splits.prod(axis=2)  # (L, K)
    sizes = np.asarray(lay.levels, dtype=np.int64)[:, None]
    return (sizes % prods == 0).all(axis=0)


def uniform_tiles(op: Operator, tensor: Tensor, lay: LayoutArrays) -> np.ndarray | None:
    """Points of ``tensor`` on each device per layout, (K,), when every device holds a tile of the same
    volume (regular tiles and no idle device); None otherwise (then :func:`tile_volumes` builds (K, p))."""
    lengths = regular_tile_lengths(op, tensor, lay.splits)
    if lengths is None or not all_active(lay).all():
        return None
    return lengths.prod(axis=1)


def as_layouts(configs, p: int, orders: np.ndarray | None = None, levels: tuple[int, ...] | None = None) -> LayoutArrays:
    """Layouts as arrays: ``configs`` may already be :class:`LayoutArrays`; else configuration rows (K, n)
    with optional full nesting orders, one level of p devices, or cut at ``levels`` (see
    :meth:`shardplan.layout.Layout.from_flat`)."""
    if isinstance(configs, LayoutArrays):
        return configs
    configs = np.asarray(configs, dtype=np.int64)
    if levels is None or len(levels) == 1:
        return flat_layout_arrays(configs, p, orders)
    names = tuple(f"d{j}" for j in range(configs.shape[1]))
    rows = [Layout.from_flat(names, c, levels, None if orders is None else orders[i]) for i, c in enumerate(configs)]
    return LayoutArrays.stack(rows)


def grid_strides(configs: np.ndarray, orders: np.ndarray | None = None) -> np.ndarray:
    """Device-index stride of every dimension of one-level configurations: (K, n) (see :mod:`shardplan.layout`)."""
    configs = np.asarray(configs, dtype=np.int64)
    return flat_layout_arrays(configs, 1, orders).level_strides[0]


def device_grid(configs, p: int, orders: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Grid coordinates (K, p, n) of every device under every layout, and the active mask (K, p)."""
    check_per_device(p, "device grids")
    lay = as_layouts(configs, p, orders)
    if lay.level_splits.shape[2] == 0:
        k = len(lay)
        return np.zeros((k, p, 0), dtype=np.int64), np.broadcast_to(np.arange(p) < 1, (k, p)).copy()
    return lay.grid()


def active_devices(configs, p: int) -> np.ndarray:
    """(K, p) mask of devices that hold a tile."""
    check_per_device(p, "idle devices")
    return as_layouts(configs, p).active()


def _lazy_index(lay: LayoutArrays):
    """``index(j)``: every device's tile coordinate along dim j (K, p), computed once per dim on first use."""
    cache: dict[int, np.ndarray] = {}

    def index(j: int) -> np.ndarray:
        if j not in cache:
            cache[j] = lay.block_index(j)
        return cache[j]

    return index


def _block(op: Operator, configs: np.ndarray, index, dim: str) -> tuple[np.ndarray, np.ndarray]:
    """Block [lo, hi) of ``dim`` on every device: two (K, p) arrays; ``configs``: total splits (K, n);
    ``index(j)``: the devices' coordinates along dim j (K, p)."""
    j = op.dim_names.index(dim)
    ext = op.extents[dim]
    c = configs[:, j][:, None]
    i = index(j)
    size = ext // c
    return i * size, (i + 1) * size


def lazy_grid(lay: LayoutArrays):
    """``(index, active)`` for :func:`tensor_boxes`'s ``lazy``: ``index(j)`` computes the devices' tile
    coordinates along dim j (K, p) on first use and keeps them, ``active`` the (K, p) mask; share it between
    calls on the same layouts (a tensor's owned and read tiles, say)."""
    return _lazy_index(lay), lay.active()


def tensor_boxes(op: Operator, tensor: Tensor, configs, p: int, core: bool = True,
                 orders: np.ndarray | None = None,
                 grid: tuple[np.ndarray, np.ndarray] | None = None, lazy=None) -> np.ndarray:
    """[lo, hi) per axis of ``tensor`` on every device: int64 array (K, p, n_axes, 2).

    ``core=True`` gives the owned tile (what a layout holds; halos excluded);
    ``core=False`` the tile the operator reads (halos included). Idle
    devices get empty boxes [0, 0). ``grid``: the result of
    :func:`device_grid` for these configurations, when the caller has it;
    ``lazy``: a :func:`lazy_grid` of these layouts (``configs`` must be them).
    """
    check_per_device(p, f"the tiles of {tensor.name!r} of {op.name!r} (windows, offsets, pieces, uneven splits or "
                        "idle devices)")
    lay = as_layouts(configs, p, orders)
    configs = lay.splits
    if grid is not None:
        coords, active = grid
        index = lambda j: coords[:, :, j]  # noqa: E731
    elif lazy is not None:
        index, active = lazy
    else:  # only the dims the tensor reads
        active = lay.active()
        index = _lazy_index(lay)
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
            blo, bhi = _block(op, configs, index, am.dim)
            lo, hi = blo * unit, bhi * unit
        else:
            xl, xh = _block(op, configs, index, am.dim)
            windowed = am.window is not None or am.stride != 1
            if core and windowed:
                e = ext[am.dim]
                lo, hi = (xl * size) // e, (xh * size) // e
            else:
                if am.window is not None:
                    rl, rh = _block(op, configs, index, am.window)
                    lo = am.stride * xl + am.dilation * rl + am.offset
                    hi = am.stride * (xh - 1) + am.dilation * (rh - 1) + am.offset + 1
                else:  # the same with the window's block [0, 1)
                    lo = am.stride * xl + am.offset if am.stride != 1 else xl + am.offset
                    hi = am.stride * (xh - 1) + am.offset + 1 if am.stride != 1 else xh + am.offset
            # clipped to the axis (in place: lo and hi are new arrays here)
            np.minimum(np.maximum(lo, 0, out=lo), size, out=lo)
            np.maximum(np.minimum(hi, size, out=hi), lo, out=hi)
        np.copyto(out[:, :, a, 0], lo, where=active)  # idle devices keep the empty box [0, 0)
        np.copyto(out[:, :, a, 1], hi, where=active)
    return out


def stored_axis(a):
    """How the layout of the operator owning a parameter stores an axis it reads as ``a``: as read where the
    axis is plain or merged (or not indexed); whole (``AxisMap(None)``) where it reads it through an offset, a
    window, a stride or a piece, since a layout then places no block of the whole axis (the run keeps the
    parameter replicated along it: its leaf sharding names the dims of plain axes only)."""
    from shardplan.ir import AxisMap

    return a if a.dim is None or a.is_plain or a.inner else AxisMap(None)


def stored_weight(tensor: Tensor) -> Tensor:
    """``tensor`` (a weight its operator owns) as the owner's devices store it: every axis by
    :func:`stored_axis` (the same tensor where every axis is plain, merged or whole)."""
    from dataclasses import replace

    axes = tuple(stored_axis(a) for a in tensor.axes)
    return tensor if axes == tuple(tensor.axes) else replace(tensor, axes=axes)


def regular_tile_lengths(op: Operator, tensor: Tensor, splits: np.ndarray) -> np.ndarray | None:
    """Per layout, the tile length of every axis when every device's tile is the same size: (K, n_axes).

    True when each axis is unindexed (whole), merged (leading block times the
    inner size) or plain over a dim whose extent fits the axis; None otherwise
    (windows, offsets, partial pieces: use :func:`tensor_boxes`).
    """
    ext = op.extents
    names = op.dim_names
    out = np.empty((len(splits), len(tensor.axes)), dtype=np.int64)
    for a, (am, size) in enumerate(zip(tensor.axes, tensor.shape)):
        if am.dim is None:
            out[:, a] = size
        elif am.inner:
            unit = 1
            for d in am.inner:
                unit *= ext[d]
            out[:, a] = (ext[am.dim] // splits[:, names.index(am.dim)]) * unit
        elif am.is_plain and size >= ext[am.dim]:
            out[:, a] = ext[am.dim] // splits[:, names.index(am.dim)]
        else:
            return None
    return out


def tile_volumes(op: Operator, tensor: Tensor, lay: LayoutArrays, core: bool = True,
                 grid: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """Points of ``tensor`` on every device under every layout: (K, p) (0 on idle devices).

    Equal to ``box_volumes(tensor_boxes(...))``; the regular case (see
    :func:`regular_tile_lengths`) needs no per-device boxes, and with every
    device active (:func:`all_active`) it is a read-only broadcast view of
    the per-layout volumes.
    """
    lengths = regular_tile_lengths(op, tensor, lay.splits)
    if lengths is None:
        return box_volumes(tensor_boxes(op, tensor, lay, lay.p, core=core, grid=grid))
    vol = lengths.prod(axis=1)
    if grid is None and all_active(lay).all():  # the same on every device: a read-only view, no (K, p) array
        return np.broadcast_to(vol[:, None], (len(vol), lay.p))
    if grid is None:
        check_per_device(lay.p, f"the tiles of {tensor.name!r} of {op.name!r} under layouts with idle devices")
    active = lay.active() if grid is None else grid[1]
    return np.where(active, vol[:, None], 0)


def box_volumes(boxes: np.ndarray) -> np.ndarray:
    """Number of points in each box: (..., n_axes, 2) -> (...)."""
    return np.prod(boxes[..., 1] - boxes[..., 0], axis=-1)
