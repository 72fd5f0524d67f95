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
from shardplan.ir import Operator, Tensor

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


def _boundaries(op: Operator, config: Sequence[int], order: Sequence[int], p: int) -> list[int]:
    """Device counts at which the configuration's groups (replicas, then splits in nesting order) end."""
    n = math.prod(int(c) for c in config)
    out, acc = [], p // n if n and p % n == 0 else 1
    out.append(acc)
    for j in order:
        c = int(config[int(j)])
        if c > 1:
            acc *= c
            out.append(acc)
    return out


def plan_mesh_shape(ops: Sequence[Operator], configs: Sequence[Sequence[int]], orders: Sequence[Sequence[int]],
                    p: int) -> tuple[int, ...]:
    """The coarsest mesh that expresses every configuration: its axes end at every group boundary used.

    Fewer mesh axes mean fewer sequential collectives per redistribution and
    a far cheaper DTensor sharding propagation (its strategies are expanded
    over every mesh axis). When the boundaries do not form a divisor chain
    (only possible when p has distinct prime factors) the prime factors are used.
    """
    cuts = {1, p}
    for op, c, o in zip(ops, configs, orders):
        cuts.update(_boundaries(op, c, o, p))
    chain = sorted(cuts)
    if any(b % a for a, b in zip(chain, chain[1:])):
        return mesh_factors(p)
    shape = tuple(b // a for a, b in zip(chain, chain[1:]))
    return shape or (1,)


def mesh_dims(op: Operator, config: Sequence[int], order: Sequence[int], factors: Sequence[int]) -> tuple[str | None, ...]:
    """Per mesh axis, the dimension of ``op`` it splits (None: a replica axis).

    ``order`` lists dimension indices, most significant first.
    """
    p = math.prod(factors)
    n = math.prod(int(c) for c in config)
    if p % n:
        raise ShardplanError(f"operator {op.name!r}: configuration {tuple(config)} uses {n} devices, "
                             f"which does not divide p={p}")
    groups: list[tuple[str | None, int]] = [(None, p // n)]
    groups += [(op.dim_names[int(j)], int(config[int(j)])) for j in order if int(config[int(j)]) > 1]
    out: list[str | None] = []
    k = 0
    for d, size in groups:
        prod = 1
        while prod < size:
            if k >= len(factors):
                raise ShardplanError(f"operator {op.name!r}: internal: mesh {tuple(factors)} exhausted")
            prod *= factors[k]
            out.append(d)
            k += 1
        if prod != size:
            raise ShardplanError(
                f"operator {op.name!r}: split {d or 'replica'}={size} does not fall on consecutive axes of the "
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
