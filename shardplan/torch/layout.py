"""A plan becomes DTensor placements on one DeviceMesh.

One mesh for every operator. DTensor runs an operation on one mesh, but a
plan gives every operator its own grid: ``(b=2, n=4)`` for one matmul,
``(b=8)`` for the next. All of them are expressed on a single mesh over all
p devices whose axes are cut wherever some configuration needs a cut
(:func:`plan_mesh_shape`; at most the prime factors of p: p = 8 gives
``(2, 2, 2)`` when a plan uses three two-way groups, ``(2, 4)`` for
``(r=2, b=4)`` and ``(n=2, b=4)`` plans, ``(8,)`` for pure data
parallelism), axes named ``m0 m1 ..``. A configuration with nesting order
``d_1 .. d_k`` (most significant first) and ``r = p / Π c`` replicas takes
consecutive mesh axes from the left: first the axes whose sizes multiply to
r (the replica axes, as in the cost model, whose devices ``0 .. Π c - 1`` are
the first replica), then the axes multiplying to ``c_{d_1}``, and so on. A
dimension split over several mesh axes is ``Shard(i)`` on each of them, in
mesh order, which DTensor lays out row-major: device ``q`` then holds exactly
the tile :mod:`shardplan.cost.tiles` gives it. Between two operators whose
grids differ, the value is redistributed (``DTensor.redistribute``), which
is the redistribution the cost model charges on the edge.

When p has distinct prime factors a configuration may need a group of
axes that is not consecutive (p = 12 = 2·2·3 and a split of 3 followed by
one of 2 under a replica factor of 2); :func:`mesh_dims` then raises
:class:`~shardplan.errors.ShardplanError`. Any configuration on a power of two
is expressible.

Multi-level machines. A plan's :class:`~shardplan.layout.Layout` splits
dims per machine level; its groups are read level by level, outer first
(:func:`layout_groups`), so a dim split across nodes and inside them takes
two mesh axes, the node one major, exactly as the Layout numbers devices.

Placements of one tensor of an operator: on a mesh axis that belongs to
dimension d, ``Shard(i)`` when tensor axis i is indexed plainly by d (or d
leads a merged axis), else ``Replicate()``; replica axes are ``Replicate()``.
So an output is replicated over its operator's reduction splits (the
partial sums are all-reduced, as the cost model charges), and an operand that
a split dimension does not index is replicated over it. Axes read through an
offset or window (a concatenation's second input, a convolution's rows) are
replicated, since a DTensor shard cannot express a halo or a partial cover.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from shardplan.errors import ShardplanError
from shardplan.ir import Tensor

__all__ = ["mesh_factors", "plan_mesh_shape", "mesh_dims", "tensor_placements", "placement_names"]


def mesh_factors(p: int) -> tuple[int, ...]:
    """Prime factors of ``p`` in ascending order (the mesh shape); ``(1,)`` for one device."""
    if p < 1:
        raise ShardplanError(f"a mesh needs at least one device, got {p}")
    out, n, f = [], p, 2
    while f * f <= n:
        while n % f == 0:
            out.append(f)
            n //= f
        f += 1
    if n > 1:
        out.append(n)
    return tuple(out) or (1,)


def layout_groups(layout: Any) -> list[tuple[str | None, int]]:
    """The mesh groups of a :class:`~shardplan.layout.Layout`, major first: (dim or None for replicas, size).

    Per machine level, outer first: the level's replica factor, then its split
    dims in nesting order (the order of :meth:`Layout.mesh_shape`); groups of
    size 1 are left out. A dim split on two levels appears twice, the outer
    level first, as the Layout numbers devices.
    """
    out: list[tuple[str | None, int]] = []
    for lvl in reversed(range(len(layout.levels))):
        if layout.replicas[lvl] > 1:
            out.append((None, int(layout.replicas[lvl])))
        out.extend((layout.dims[j], int(layout.splits[lvl][j])) for j in layout.orders[lvl])
    return out


def _boundaries(layout: Any) -> list[int]:
    """Device counts at which the layout's groups end."""
    if layout.active_devices != layout.num_devices:
        raise ShardplanError(f"layout {layout.describe()} leaves devices idle; a DeviceMesh over all devices "
                             "cannot express it")
    out, acc = [1], 1
    for _, size in layout_groups(layout):
        acc *= size
        out.append(acc)
    return out


def plan_mesh_shape(layouts: Sequence[Any], p: int) -> tuple[int, ...]:
    """The coarsest mesh that expresses every layout: its axes end at every group boundary used.

    Fewer mesh axes mean fewer sequential collectives per redistribution and
    a far cheaper DTensor sharding propagation (its strategies are expanded
    over every mesh axis). When the boundaries do not form a divisor chain
    (only possible when p has distinct prime factors) the prime factors are used.
    """
    cuts = {1, p}
    for lay in layouts:
        cuts.update(_boundaries(lay))
    chain = sorted(cuts)
    if any(b % a for a, b in zip(chain, chain[1:])):
        return mesh_factors(p)
    shape = tuple(b // a for a, b in zip(chain, chain[1:]))
    return shape or (1,)


def mesh_dims(layout: Any, factors: Sequence[int], name: str = "") -> tuple[str | None, ...]:
    """Per axis of the mesh ``factors``, the dimension of the layout it splits (None: a replica axis)."""
    p = math.prod(factors)
    if layout.num_devices != p:
        raise ShardplanError(f"operator {name!r}: layout for {layout.num_devices} devices on a mesh of {p}")
    out: list[str | None] = []
    k = 0
    for d, size in layout_groups(layout):
        prod = 1
        while prod < size:
            if k >= len(factors):
                raise ShardplanError(f"operator {name!r}: internal: mesh {tuple(factors)} exhausted")
            prod *= factors[k]
            out.append(d)
            k += 1
        if prod != size:
            raise ShardplanError(
                f"operator {name!r}: split {d or 'replica'}={size} does not fall on consecutive axes of the "
                f"mesh {tuple(factors)}; use a power-of-two device count")
    out.extend([None] * (len(factors) - k))
    return tuple(out)


def _axis_of(tensor: Tensor, dim: str) -> int | None:
    for i, a in enumerate(tensor.axes):
        if a.dim == dim and (a.is_plain or a.inner):
            return i
    return None


def tensor_placements(tensor: Tensor, axes_dims: Sequence[str | None], rank: int | None = None) -> tuple[Any, ...]:
    """DTensor placements of ``tensor`` given the dimension each mesh axis splits.

    ``rank`` is the torch tensor's rank; when it differs from the
    description's the tensor is replicated.
    """
    from torch.distributed.tensor import Replicate, Shard

    out = []
    for d in axes_dims:
        i = None if d is None or (rank is not None and rank != len(tensor.axes)) else _axis_of(tensor, d)
        out.append(Replicate() if i is None else Shard(i))
    return tuple(out)


def placement_names(placements: Sequence[Any]) -> str:
    """``"S(0) R S(1)"`` for a placement tuple."""
    names = []
    for pl in placements:
        if pl.is_shard():
            names.append(f"S({pl.dim})")
        elif pl.is_partial():
            names.append("P")
        else:
            names.append("R")
    return " ".join(names)
