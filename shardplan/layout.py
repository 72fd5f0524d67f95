"""The layout of one operator on a hierarchical machine: one small immutable value.

A machine is a mesh of *levels*, innermost first: ``levels = (s_0, s_1, ...)``
(devices in a node, nodes in the network, possibly nodes in a pod), with
``p = Π s_l`` devices numbered so that device ``q`` sits at position

    i_l(q) = (q // (s_0 ... s_{l-1})) mod s_l          on level l

(node k of a two-level machine holds devices ``k s_0 .. (k+1) s_0 - 1``). A
one-level machine (``levels = (p,)``) is the flat machine of the paper.

A :class:`Layout` says, for every iteration dimension d of an operator and
every level l, how many ways d is split on that level, ``c_{l,d}``, plus the
nesting of the split dims inside each level (``orders[l]``, most significant
first). On level l the Π_d c_{l,d} tiles form a row-major grid nested as
``orders[l]``; the ``r_l = s_l // Π_d c_{l,d}`` copies of that grid (the
level's *replica factor*) are the most significant part of the level's
position, and the ``s_l - r_l Π_d c_{l,d}`` positions past the last copy are
idle (only possible when the split product does not divide the level size).
So device q has, on level l with grid position ``j = i_l mod Π_d c_{l,d}``,

    x_{l,d}(q) = (j // σ_{l,d}) mod c_{l,d}    (σ: the row-major stride of d in orders[l])

and its tile coordinate along d combines the levels, the outer level the
more significant (a node-level split cuts the tensor into the coarse blocks,
the device level cuts each of those):

    x_d(q) = Σ_l x_{l,d}(q) · Π_{l' < l} c_{l',d},    total split c_d = Π_l c_{l,d}.

Along d, coordinate x owns the block ``[x E_d / c_d, (x+1) E_d / c_d)``.

What each consumer reads:

* the cost model: the device grid (:meth:`Layout.grid`, vectorised over many
  layouts by :class:`LayoutArrays`) for exact tiles and redistribution
  volumes, and :meth:`Layout.group_sizes` — how a collective over a set of
  dims spans the levels (``g_l = Π_{d in set} c_{l,d}``), which decides the
  links it uses;
* the JAX export: :meth:`Layout.mesh_shape` / :meth:`Layout.mesh_axes` (a mesh
  over all p devices, replica axis first inside each level, outer levels
  first) and :meth:`Layout.partition_spec` (plain tuples of mesh axis names:
  ``jax.sharding.PartitionSpec(*spec)`` is the JAX value; no jax import here);
* the report: :meth:`Layout.describe`.

Deferred reductions. ``Layout.partial`` marks a layout in which the operator
leaves its reductions to its edges: its output, when a reduction dim is
split, as *partial sums* over the devices of the reduction group (each holds
the full output tile, the group's tiles add up to the result), and the
gradient of each activation input, when a dim that does not index it is
split, as partial sums over that input's group. The consumer's layout decides
how they are reduced (reduce-scatter into a tile split over the group,
all-reduce into a replicated one: :mod:`shardplan.cost.edge`). The tiles
(grid, boxes, mesh) are those of the same layout without the flag.

On a one-level machine a layout is exactly a configuration tuple plus a
nesting order (``Layout.flat``), the space of the paper.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from shardplan.errors import ShardplanError

__all__ = ["Layout", "LayoutArrays", "LEVEL_NAMES", "level_names", "flat_layout_arrays", "pattern_blocks",
           "unique_rows"]

LEVEL_NAMES = ("device", "node", "pod", "cluster")
REPLICA_AXIS = "_rep"
_DIRECT_ENTRIES = 1 << 14  # block_index computes up to this many (layout, device) entries without deduplicating


def level_names(n_levels: int) -> tuple[str, ...]:
    """Names of the levels of an ``n_levels``-level machine, innermost first."""
    if n_levels <= len(LEVEL_NAMES):
        return LEVEL_NAMES[:n_levels]
    return LEVEL_NAMES + tuple(f"level{i}" for i in range(len(LEVEL_NAMES), n_levels))


def _row_major_strides(split: Sequence[int], order: Sequence[int], n: int) -> tuple[int, ...]:
    """Stride of every dim inside one level's grid (1 for dims not split there)."""
    st = [1] * n
    acc = 1
    for j in reversed(order):
        st[j] = acc
        acc *= split[j]
    return tuple(st)


@dataclass(frozen=True)
class Layout:
    """Splits of an operator's iteration dims per machine level, with the nesting inside each level.

    Attributes:
        dims: the operator's dimension names, in its order.
        levels: the machine's level sizes, innermost first (their product is p).
        splits: ``splits[l][d]``: ways dim d is split on level l.
        orders: ``orders[l]``: indices of the dims split on level l (those with
            ``splits[l][d] > 1``), most significant first.
        partial: the operator's reductions are deferred to its edges (see the module docstring).
    """

    dims: tuple[str, ...]
    levels: tuple[int, ...]
    splits: tuple[tuple[int, ...], ...]
    orders: tuple[tuple[int, ...], ...]
    partial: bool = False
    _strides: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        dims = tuple(str(d) for d in self.dims)
        levels = tuple(int(s) for s in self.levels)
        splits = tuple(tuple(int(c) for c in row) for row in self.splits)
        orders = tuple(tuple(int(j) for j in o) for o in self.orders)
        object.__setattr__(self, "dims", dims)
        object.__setattr__(self, "levels", levels)
        object.__setattr__(self, "splits", splits)
        object.__setattr__(self, "orders", orders)
        object.__setattr__(self, "partial", bool(self.partial))
        n = len(dims)
        if len(set(dims)) != n:
            raise ShardplanError(f"layout: dimension names {dims} are not unique")
        if not levels or any(s < 1 for s in levels):
            raise ShardplanError(f"layout: level sizes must be positive integers, got {levels}")
        if len(splits) != len(levels) or any(len(r) != n for r in splits):
            raise ShardplanError(f"layout: splits {splits} must have one row per level {levels} and one entry "
                                 f"per dimension {dims}")
        if len(orders) != len(levels):
            raise ShardplanError(f"layout: orders {orders} must have one entry per level {levels}")
        for lvl, (s, row, o) in enumerate(zip(levels, splits, orders)):
            if any(c < 1 for c in row):
                raise ShardplanError(f"layout: splits on level {lvl} must be >= 1, got {row} for dims {dims}")
            if math.prod(row) > s:
                raise ShardplanError(f"layout: level {lvl} has {s} positions but splits {row} for dims {dims} "
                                     f"need {math.prod(row)}")
            want = sorted(j for j in range(n) if row[j] > 1)
            if sorted(o) != want:
                raise ShardplanError(f"layout: order {o} on level {lvl} must list exactly the split dims {want} "
                                     f"(splits {row} for dims {dims})")
        object.__setattr__(self, "_strides", tuple(_row_major_strides(r, o, n) for r, o in zip(splits, orders)))

    # -- construction -------------------------------------------------------
    @classmethod
    def _unchecked(cls, dims: tuple[str, ...], levels: tuple[int, ...], splits: tuple[tuple[int, ...], ...],
                   orders: tuple[tuple[int, ...], ...], partial: bool = False) -> "Layout":
        """A layout from already-normalised values known to be valid (the enumerator's fast path)."""
        n = len(dims)
        return cls._with_strides(dims, levels, splits, orders,
                                 tuple(_row_major_strides(r, o, n) for r, o in zip(splits, orders)), partial)

    @classmethod
    def _with_strides(cls, dims: tuple[str, ...], levels: tuple[int, ...], splits: tuple[tuple[int, ...], ...],
                      orders: tuple[tuple[int, ...], ...], strides: tuple[tuple[int, ...], ...],
                      partial: bool = False) -> "Layout":
        """:meth:`_unchecked` with the per-level strides already known (from :class:`LayoutArrays`)."""
        lay = object.__new__(cls)
        d = lay.__dict__
        d["dims"], d["levels"], d["splits"], d["orders"], d["_strides"] = dims, levels, splits, orders, strides
        d["partial"] = bool(partial)
        return lay

    def with_partial(self, partial: bool = True) -> "Layout":
        """The same tiles with the reductions deferred to the edges (``partial``) or not."""
        return Layout._with_strides(self.dims, self.levels, self.splits, self.orders, self._strides, partial)

    @classmethod
    def flat(cls, dims: Sequence[str], config: Sequence[int], p: int, order: Sequence[int] | None = None) -> "Layout":
        """The one-level layout of a configuration tuple on p devices (``order``: all dims, most significant first)."""
        n = len(dims)
        order = range(n) if order is None else order
        return cls(tuple(dims), (int(p),), (tuple(int(c) for c in config),),
                   (tuple(int(j) for j in order if int(config[int(j)]) > 1),))

    @classmethod
    def from_flat(cls, dims: Sequence[str], config: Sequence[int], levels: Sequence[int],
                  order: Sequence[int] | None = None) -> "Layout":
        """The layout whose device grid equals the flat numbering of ``config`` on ``Π levels`` devices.

        The flat grid (row-major in ``order``, replicated ``p // Π c`` times
        with the replica most significant) is cut at the level boundaries;
        raises :class:`ShardplanError` when a boundary falls inside a dim's
        blocks in a way no level layout can express (e.g. a 3-way split on
        nodes of 8).
        """
        levels = tuple(int(s) for s in levels)
        p = math.prod(levels)
        flat = cls.flat(dims, config, p, order)
        if len(levels) == 1:
            return flat
        n = len(dims)
        order = list(range(n)) if order is None else [int(j) for j in order]
        split_order = [j for j in order if int(config[j]) > 1]
        rows = [[1] * n for _ in levels]
        ords: list[list[int]] = [[] for _ in levels]
        lvl, cap = 0, levels[0]
        for j in reversed(split_order):  # least significant first fills the inner level first
            rem = int(config[j])
            while rem > 1:
                while cap == 1 and lvl + 1 < len(levels):
                    lvl += 1
                    cap = levels[lvl]
                take = math.gcd(rem, cap)
                if take == 1:
                    raise ShardplanError(f"layout: configuration {tuple(config)} of dims {tuple(dims)} cannot be "
                                         f"laid out on levels {levels}")
                rows[lvl][j] *= take
                if j not in ords[lvl]:
                    ords[lvl].insert(0, j)
                rem //= take
                cap //= take
        out = cls(tuple(dims), levels, tuple(tuple(r) for r in rows), tuple(tuple(o) for o in ords))
        a, b = out.grid(), flat.grid()
        if not (np.array_equal(a[1], b[1]) and np.array_equal(a[0][a[1]], b[0][b[1]])):
            raise ShardplanError(f"layout: configuration {tuple(config)} of dims {tuple(dims)} (order {tuple(order)}) "
                                 f"cannot be laid out on levels {levels}")
        return out

    # -- derived values -----------------------------------------------------
    @property
    def num_devices(self) -> int:
        return math.prod(self.levels)

    @property
    def num_levels(self) -> int:
        return len(self.levels)

    @property
    def split(self) -> tuple[int, ...]:
        """Total split per dim: c_d = Π_l c_{l,d}."""
        return tuple(math.prod(row[j] for row in self.splits) for j in range(len(self.dims)))

    @property
    def level_products(self) -> tuple[int, ...]:
        """Tiles of the grid on each level: Π_d c_{l,d}."""
        return tuple(math.prod(r) for r in self.splits)

    @property
    def replicas(self) -> tuple[int, ...]:
        """Replica factor per level: the copies of the level's grid, ``s_l // Π_d c_{l,d}``."""
        return tuple(s // n for s, n in zip(self.levels, self.level_products))

    @property
    def tiles(self) -> int:
        """Distinct tiles: Π_d c_d."""
        return math.prod(self.split)

    @property
    def active_devices(self) -> int:
        """Devices holding a tile (the rest are idle): Π_l r_l Π_d c_{l,d}."""
        return math.prod(r * n for r, n in zip(self.replicas, self.level_products))

    @property
    def copies(self) -> int:
        """How many devices hold each tile: Π_l r_l (1 = no device repeats another's work)."""
        return math.prod(self.replicas)

    def strides(self, level: int) -> tuple[int, ...]:
        """Row-major stride of every dim inside level ``level``'s grid."""
        return self._strides[level]

    def grid(self) -> tuple[np.ndarray, np.ndarray]:
        """Tile coordinate of every device: ``(coords (p, n) int64, active (p,) bool)``; idle rows are 0."""
        arr = LayoutArrays.stack([self])
        coords, active = arr.grid()
        return coords[0], active[0]

    def blocks(self, extents: Sequence[int]) -> np.ndarray:
        """Per device and dim, the block ``[lo, hi)`` of the dim it works on: (p, n, 2); idle devices [0, 0)."""
        coords, active = self.grid()
        ext = np.asarray(extents, dtype=np.int64)
        size = ext // np.asarray(self.split, dtype=np.int64)
        out = np.stack([coords * size, (coords + 1) * size], axis=-1)
        out[~active] = 0
        return out

    def group_sizes(self, dims: Sequence[str | int]) -> tuple[int, ...]:
        """Size per level of a collective group over ``dims``: ``g_l = Π_{d in dims} c_{l,d}``.

        The group of a device is the devices of the same replica whose tile
        coordinates agree on every other dim; it has ``Π_l g_l`` members, ``g_0`` of
        them inside each node it touches, spread over ``g_1`` nodes, ...
        """
        idx = [self._index(d) for d in dims]
        return tuple(math.prod(row[j] for j in idx) for row in self.splits)

    def group_of(self, device: int, dims: Sequence[str | int]) -> tuple[int, ...]:
        """The devices (ascending) in ``device``'s collective group over ``dims`` (the device itself if idle)."""
        idx = set(self._index(d) for d in dims)
        p = self.num_devices
        if not 0 <= device < p:
            raise ShardplanError(f"layout: device {device} out of range 0..{p - 1}")
        coords, active = self.grid()
        if not active[device]:
            return (device,)
        rep = self._replica_ids()
        other = [j for j in range(len(self.dims)) if j not in idx]
        same = active & (rep == rep[device])
        for j in other:
            same &= coords[:, j] == coords[device, j]
        return tuple(int(q) for q in np.nonzero(same)[0])

    def _replica_ids(self) -> np.ndarray:
        q = np.arange(self.num_devices, dtype=np.int64)
        rid = np.zeros_like(q)
        base = 1
        for s, n in zip(self.levels, self.level_products):
            i = (q // base) % s
            rid = rid * (s // n + 1) + i // n
            base *= s
        return rid

    def _index(self, d: str | int) -> int:
        if isinstance(d, (int, np.integer)):
            if not 0 <= int(d) < len(self.dims):
                raise ShardplanError(f"layout: dimension index {d} out of range for dims {self.dims}")
            return int(d)
        try:
            return self.dims.index(d)
        except ValueError:
            raise ShardplanError(f"layout: no dimension {d!r} among {self.dims}") from None

    # -- mesh view ----------------------------------------------------------
    def _names(self) -> tuple[str, ...]:
        return level_names(len(self.levels))

    def _axis_name(self, dim: int | None, level: int) -> str:
        base = REPLICA_AXIS if dim is None else self.dims[dim]
        return base if len(self.levels) == 1 else f"{base}_{self._names()[level]}"

    def mesh_shape(self) -> tuple[int, ...]:
        """Shape of the device mesh over all p devices (row-major = device numbering); needs no idle devices."""
        if self.active_devices != self.num_devices:
            raise ShardplanError(f"layout {self.describe()}: {self.num_devices - self.active_devices} idle devices; "
                                 "a device mesh over all devices cannot express it")
        shape: list[int] = []
        for lvl in reversed(range(len(self.levels))):
            shape.append(self.replicas[lvl])
            shape.extend(self.splits[lvl][j] for j in self.orders[lvl])
        return tuple(shape)

    def mesh_axes(self) -> tuple[str, ...]:
        """Mesh axis names matching :meth:`mesh_shape`: per level (outer first) its replica axis, then its split
        dims in nesting order; ``"_rep"``/``dim`` on one level, ``"_rep_node"``/``"b_node"``/... on several."""
        out: list[str] = []
        for lvl in reversed(range(len(self.levels))):
            out.append(self._axis_name(None, lvl))
            out.extend(self._axis_name(j, lvl) for j in self.orders[lvl])
        return tuple(out)

    def dim_axes(self, dim: str | int) -> tuple[str, ...]:
        """Mesh axes that split ``dim``, major to minor (outer level first)."""
        j = self._index(dim)
        return tuple(self._axis_name(j, lvl) for lvl in reversed(range(len(self.levels))) if self.splits[lvl][j] > 1)

    def partition_spec(self, axis_dims: Sequence[str | None]) -> tuple[str | tuple[str, ...] | None, ...]:
        """A JAX-style PartitionSpec as a plain tuple: per tensor axis, the mesh axes that split it.

        ``axis_dims[i]`` is the dim that blocks tensor axis i (None: not
        blocked). Each entry is None (replicated), one axis name, or a tuple
        of names, major first; a dim shards at most one axis (the first).
        """
        used: set[str] = set()
        spec: list[str | tuple[str, ...] | None] = []
        for d in axis_dims:
            names = self.dim_axes(d) if d is not None else ()
            if not names or d in used:
                spec.append(None)
                continue
            used.add(d)  # type: ignore[arg-type]
            spec.append(names[0] if len(names) == 1 else names)
        return tuple(spec)

    def flat_order(self) -> tuple[int, ...]:
        """All dims, most significant first: split dims of the outer levels first, then unsplit dims."""
        seen: list[int] = []
        for lvl in reversed(range(len(self.levels))):
            seen.extend(j for j in self.orders[lvl] if j not in seen)
        return tuple(seen) + tuple(j for j in range(len(self.dims)) if j not in seen)

    def describe(self) -> str:
        """``(8,1,4)`` on one level; on several, the split dims with their split per level, outer first
        (``(b=16[2x8], h=4[4x1])``), and ``copies=n`` when n devices hold each tile; `` partial`` after a layout
        whose reductions are deferred to its edges."""
        if self.partial:
            return self.with_partial(False).describe() + " partial"
        if len(self.levels) == 1:
            return "(" + ",".join(str(c) for c in self.split) + ")"
        parts = []
        for j, d in enumerate(self.dims):
            per = [self.splits[lvl][j] for lvl in reversed(range(len(self.levels)))]
            if math.prod(per) == 1:
                continue
            parts.append(f"{d}={math.prod(per)}[" + "x".join(str(c) for c in per) + "]")
        if self.copies > 1:
            parts.append(f"copies={self.copies}")
        return "(" + ", ".join(parts) + ")" if parts else "(replicated)"


@dataclass(frozen=True, eq=False)
class LayoutArrays:
    """Many layouts of one operator as arrays, for vectorised cost code.

    Attributes:
        levels: level sizes (shared by all rows).
        level_splits: (L, K, n) splits per level.
        level_strides: (L, K, n) row-major strides inside each level's grid.
        partial: (K,) bool, the layouts whose reductions are deferred to the edges (None: none).
    """

    levels: tuple[int, ...]
    level_splits: np.ndarray
    level_strides: np.ndarray
    partial: np.ndarray | None = None

    @classmethod
    def stack(cls, layouts: Sequence[Layout]) -> "LayoutArrays":
        if not layouts:
            raise ShardplanError("layout arrays need at least one layout")
        levels = layouts[0].levels
        n = len(layouts[0].dims)
        if any(lay.levels != levels or len(lay.dims) != n for lay in layouts):
            raise ShardplanError("layout arrays: all layouts must have the same levels and dimensions")
        ls = np.asarray([lay.splits for lay in layouts], dtype=np.int64).reshape(len(layouts), len(levels), n)
        st = np.asarray([lay._strides for lay in layouts], dtype=np.int64).reshape(len(layouts), len(levels), n)
        part = np.asarray([lay.partial for lay in layouts], dtype=bool)
        return cls(levels, ls.transpose(1, 0, 2).copy(), st.transpose(1, 0, 2).copy(), part if part.any() else None)

    @property
    def p(self) -> int:
        return math.prod(self.levels)

    def __len__(self) -> int:
        return self.level_splits.shape[1]

    @property
    def splits(self) -> np.ndarray:
        """Total split per dim: (K, n), read-only (computed once per object: the arrays are its value)."""
        got = self.__dict__.get("_total_splits")
        if got is None:
            got = self.level_splits.prod(axis=0)
            got.flags.writeable = False
            self.__dict__["_total_splits"] = got
        return got

    @property
    def deferred(self) -> np.ndarray:
        """(K,) bool: the layouts whose reductions are deferred to the edges (:attr:`Layout.partial`)."""
        return np.zeros(len(self), dtype=bool) if self.partial is None else self.partial

    def without_partial(self) -> "LayoutArrays":
        """The same tiles with no reduction deferred."""
        return self if self.partial is None else LayoutArrays(self.levels, self.level_splits, self.level_strides)

    def take(self, rows: np.ndarray) -> "LayoutArrays":
        part = None if self.partial is None else self.partial[rows]
        return LayoutArrays(self.levels, self.level_splits[:, rows], self.level_strides[:, rows], part)

    def level_positions(self) -> np.ndarray:
        """(L, p): every device's position on every level."""
        q = np.arange(self.p, dtype=np.int64)
        base = np.cumprod((1,) + self.levels[:-1])
        return (q[None, :] // base[:, None]) % np.asarray(self.levels, dtype=np.int64)[:, None]

    def active(self) -> np.ndarray:
        """(K, p): devices that hold a tile."""
        if len(self.levels) == 1:  # device q's position is q: the first floor(p / prod) whole grids work
            p = self.levels[0]
            prod = self.level_splits[0].prod(axis=1)
            return np.arange(p, dtype=np.int64)[None, :] < ((p // prod) * prod)[:, None]
        pos = self.level_positions()
        prod = self.level_splits.prod(axis=2)  # (L, K)
        reps = np.asarray(self.levels, dtype=np.int64)[:, None] // prod
        return ((pos[:, None, :] < (reps * prod)[:, :, None])).all(axis=0)

    def block_index(self, j: int) -> np.ndarray:
        """(K, p): every device's tile coordinate along dim j (combined over levels; arbitrary where idle)."""
        pats = self.patterns(j)
        if len(pats) * self.p <= _DIRECT_ENTRIES:  # small: direct; large: once per distinct pattern
            return pattern_blocks(pats, self.levels)
        uniq, _, inv = unique_rows(pats)
        return pattern_blocks(uniq, self.levels)[inv]

    def patterns(self, j: int) -> np.ndarray:
        """(K, 2L): the (split, stride) per level that fixes dim j's block vector over devices."""
        return np.concatenate([self.level_splits[:, :, j].T, self.level_strides[:, :, j].T], axis=1)

    def grid(self) -> tuple[np.ndarray, np.ndarray]:
        """Coordinates (K, p, n) and active mask (K, p) (see the module docstring)."""
        k, n = len(self), self.level_splits.shape[2]
        coords = np.zeros((k, self.p, n), dtype=np.int64)
        for j in range(n):
            coords[:, :, j] = self.block_index(j)
        return coords, self.active()

    def group_sizes(self, idx: Sequence[int]) -> np.ndarray:
        """(L, K): size per level of the collective group over dims ``idx``."""
        idx = list(idx)
        if not idx:
            return np.ones((len(self.levels), len(self)), dtype=np.int64)
        return self.level_splits[:, :, idx].prod(axis=2)


def pattern_blocks(pats: np.ndarray, levels: Sequence[int]) -> np.ndarray:
    """Tile coordinate of every device for block patterns (P, 2L) (split and stride per level): (P, p).

    ``x(q) = Σ_l ((i_l(q) // σ_l) mod c_l) · Π_{l' < l} c_{l'}`` (see the module docstring).
    """
    levels = tuple(int(s) for s in levels)
    n_lv = len(levels)
    p = math.prod(levels)
    q = np.arange(p, dtype=np.int64)
    if n_lv == 1:  # i_0(q) = q
        return (q[None, :] // pats[:, 1:2]) % pats[:, 0:1]
    base = np.cumprod((1,) + levels[:-1])
    out = np.zeros((len(pats), p), dtype=np.int64)
    mult = np.ones(len(pats), dtype=np.int64)
    for lvl in range(n_lv):
        pos = (q // base[lvl]) % levels[lvl]
        c, s = pats[:, lvl], pats[:, n_lv + lvl]
        out += ((pos[None, :] // s[:, None]) % c[:, None]) * mult[:, None]
        mult = mult * c
    return out


def flat_layout_arrays(configs: np.ndarray, p: int, orders: np.ndarray | None = None) -> LayoutArrays:
    """One-level layout arrays straight from configuration rows (and optional full nesting orders)."""
    configs = np.asarray(configs, dtype=np.int64)
    k, n = configs.shape
    if orders is None:
        orders = np.broadcast_to(np.arange(n), (k, n))
    ordered = np.take_along_axis(configs, np.asarray(orders), axis=1)
    s = np.ones_like(ordered)
    if n > 1:
        s[:, :-1] = np.cumprod(ordered[:, :0:-1], axis=1)[:, ::-1]
    strides = np.empty_like(s)
    np.put_along_axis(strides, np.asarray(orders), s, axis=1)
    strides = np.where(configs > 1, strides, 1)  # canonical, as in Layout: an unsplit dim's stride is irrelevant
    return LayoutArrays((int(p),), configs[None].copy(), strides[None].copy())


def unique_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distinct rows of an integer (K, m) array: ``(uniq (U, m), first (U,), inverse (K,))``.

    The same values as ``np.unique(rows, axis=0, return_index=True,
    return_inverse=True)`` (rows in lexicographic order, ``first`` the first
    occurrence of each, ``rows == uniq[inverse]``), computed on one int64
    code per row: with ``lo_j``/``span_j`` the minimum and range of column j,
    ``code = Σ_j (x_j - lo_j) Π_{j' > j} span_j'`` is a mixed-radix number
    whose order is the rows' lexicographic order. Falls back to
    ``np.unique`` when the codes would not fit in 62 bits.
    """
    rows = np.asarray(rows, dtype=np.int64)
    k, m = rows.shape
    if k == 0 or m == 0:
        u, first, inv = np.unique(rows, axis=0, return_index=True, return_inverse=True)
        return u, first, inv.reshape(-1)
    lo = rows.min(axis=0)
    span = rows.max(axis=0) - lo + 1
    weights = [1] * m
    for j in range(m - 2, -1, -1):
        weights[j] = weights[j + 1] * int(span[j + 1])
    if weights[0] * int(span[0]) >= 1 << 62:
        u, first, inv = np.unique(rows, axis=0, return_index=True, return_inverse=True)
        return u, first, inv.reshape(-1)
    code = (rows - lo) @ np.asarray(weights, dtype=np.int64) if m > 1 else rows[:, 0] - lo[0]
    # what np.unique(code, return_index=True, return_inverse=True) computes, without its wrappers
    perm = code.argsort(kind="mergesort")  # stable: the first occurrence of each code comes first
    aux = code[perm]
    new = np.empty(k, dtype=bool)
    new[0] = True
    np.not_equal(aux[1:], aux[:-1], out=new[1:])
    first = perm[new]
    inv = np.empty(k, dtype=np.intp)
    inv[perm] = np.cumsum(new) - 1
    return rows[first], first, inv
