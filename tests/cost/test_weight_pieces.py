"""Weight edges of a parameter read through pieces (``jnp.split`` of a fused weight, a tied table read through a
slice): the owner holds the parameter whole along every axis it reads through an offset, each reader needs exactly
the block it reads, and the edge moves that block forward and its gradient back. Checked against an independent
per-device enumeration of the index sets."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from shardplan.cost.edge import edge_volumes, weight_views
from shardplan.errors import ShardplanError
from shardplan.ir import AxisMap, Operator, Tensor

P = 8
SHAPE = (8, 24)  # a fused (D, 3 D) weight, D = 8


def _piece(name: str, start: int, size: int, owner: tuple[str, str] | None = None) -> Operator:
    """A slice operator reading columns ``[start, start + size)`` of the fused weight (``jnp.split`` traces to it)."""
    w = Tensor("w0", SHAPE, (AxisMap("x"), AxisMap("s", offset=start, partial=True)), "weight", owner=owner)
    y = Tensor("y", (SHAPE[0], size), ("x", "s"), "output")
    return Operator(name, "slice", (("x", SHAPE[0]), ("s", size)), (), y, (w,))


def _whole(name: str, owner: tuple[str, str] | None = None) -> Operator:
    """An operator reading the whole weight plainly (the embedding's gather of a tied table)."""
    w = Tensor("w0", SHAPE, ("r", "c"), "weight", owner=owner)
    y = Tensor("y", SHAPE, ("r", "c"), "output")
    return Operator(name, "copy", (("r", SHAPE[0]), ("c", SHAPE[1])), (), y, (w,))


def _blocks(config: tuple[int, ...], extents: tuple[int, ...], q: int) -> list[range]:
    """Device q's block of every dim: row-major device numbering over the dims, each dim cut evenly."""
    coords = np.unravel_index(q % int(np.prod(config)), config)
    return [range(int(x) * (e // c), (int(x) + 1) * (e // c)) for x, c, e in zip(coords, config, extents)]


def _indices(op: Operator, config: tuple[int, ...], q: int, stored: bool) -> set[tuple[int, int]]:
    """The weight's elements device q holds (``stored``: the owner's copy, whole along any axis not read plainly)
    or reads (the points of its block of the domain through the access map)."""
    t = op.weights[0]
    blk = dict(zip(op.dim_names, _blocks(config, tuple(e for _, e in op.dims), q)))
    per_axis = []
    for am, size in zip(t.axes, t.shape):
        if stored and not am.is_plain:
            per_axis.append(range(size))
        else:
            per_axis.append([i + am.offset for i in blk[am.dim]])
    return set(itertools.product(*per_axis))


def _brute(u, cu, v, cv) -> tuple[int, int]:
    have = [_indices(u, cu, q, True) for q in range(P)]
    need = [_indices(v, cv, q, False) for q in range(P)]
    read = set().union(*need)
    fwd = max(len(n - h) for h, n in zip(have, need))
    bwd = max(len((h & read) - n) for h, n in zip(have, need))
    return fwd, bwd


CONFIGS = [(1, 1), (8, 1), (1, 8), (2, 4), (4, 2)]


@pytest.mark.parametrize("readers", ["pieces", "tied"])
def test_a_weight_read_through_pieces_moves_exactly_the_block_read(readers):
    """Every pair of layouts: the edge's forward and backward volumes (the lack, ``steps=False``; the fast and the
    general path) equal the enumerated ones: what the reader's block lacks of the owner's copy, and the gradient of
    the part it read that the owner's copy holds and the reader's block does not."""
    if readers == "pieces":  # q owns the weight, k and v read their thirds of it
        u = _piece("q", 0, 8)
        vs = [_piece("k", 8, 8, ("q", "w0")), _piece("v", 16, 8, ("q", "w0"))]
    else:  # the head's piece owns the table (its first reader), the embedding reads it whole
        u = _piece("head", 0, 16)
        vs = [_whole("embed", ("head", "w0"))]
    for v in vs:
        src, dst = weight_views(u, 0, v, 0)
        cu = np.asarray(CONFIGS)
        cv = np.asarray([c for c in CONFIGS if all(e % x == 0 for e, x in zip(tuple(e for _, e in v.dims), c))])
        f, b = edge_volumes(src, cu, dst, 0, cv, P)
        fg, bg = edge_volumes(src, cu, dst, 0, cv, P, fast=False)
        want = np.asarray([[_brute(u, tuple(a), v, tuple(c)) for c in cv] for a in cu])
        np.testing.assert_array_equal(f, want[..., 0])
        np.testing.assert_array_equal(b, want[..., 1])
        np.testing.assert_array_equal((fg, bg), (f, b))


def test_the_block_by_hand():
    """q (owner, replicated) and k reading columns [8, 16): k with its rows split 8 ways lacks nothing forward and
    sends back the gradient of the 7/8 of its third it does not hold, 7 x 8 = 56 elements; the owner's rows split
    8 ways and k replicated: k lacks 7/8 of its third forward, nothing moves back."""
    u, v = _piece("q", 0, 8), _piece("k", 8, 8, ("q", "w0"))
    src, dst = weight_views(u, 0, v, 0)
    f, b = edge_volumes(src, np.asarray([(1, 1), (8, 1)]), dst, 0, np.asarray([(8, 1), (1, 1)]), P)
    np.testing.assert_array_equal(f, [[0, 0], [0, 56]])
    np.testing.assert_array_equal(b, [[56, 0], [0, 0]])


def test_readers_of_another_shape_are_refused():
    u, v = _piece("q", 0, 8), _whole("embed", ("q", "w0"))
    v = Operator(v.name, v.kind, (("r", 8), ("c", 16)), (), Tensor("y", (8, 16), ("r", "c"), "output"),
                 (Tensor("w0", (8, 16), ("r", "c"), "weight", owner=("q", "w0")),))
    with pytest.raises(ShardplanError, match="shape"):
        weight_views(u, 0, v, 0)


def test_the_owner_of_a_piece_stores_the_whole_parameter_along_the_piece_axis():
    """The memory of a weight owned through a piece is the parameter whole along the piece's axis and blocked along
    its plain axes, as the run holds it (value, gradient and optimizer state), on every device and in both paths of
    :func:`operator_memory` (per layout and per device), and in :func:`weight_groups`'s state."""
    from shardplan.cost.memory import operator_memory, weight_groups
    from shardplan.machine import Machine

    machine = Machine(P)
    owner = _piece("q", 0, 8)
    configs = np.asarray(CONFIGS)
    rows = SHAPE[0] // configs[:, 0]  # the plain axis blocked over x, the piece's axis whole
    want = rows * SHAPE[1] * machine.dtype_bytes
    for per_device in (False, True):
        w, _ = operator_memory(owner, configs, machine, optimizer_factor=2.0, per_device=per_device)
        assert np.array_equal(w.max(axis=1), want * 4.0)
        assert np.array_equal(w.min(axis=1), want * 4.0)
    assert np.array_equal(weight_groups(owner, configs, None, machine).state, want)
    # a reader through a piece holds no state of the parameter; an unowned copy of it, read plainly, the same bytes
    assert not operator_memory(_piece("k", 8, 8, ("q", "w0")), configs, machine)[0].any()
    assert np.array_equal(operator_memory(_whole("e"), np.asarray([(c[0], 1) for c in CONFIGS]), machine)[0][:, 0],
                          want * 4.0)
