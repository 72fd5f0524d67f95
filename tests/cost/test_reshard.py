"""The step search of a redistribution (shardplan.cost.reshard) and the edge volumes that charge it."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from shardplan import ops
from shardplan.cost.edge import edge_cost, edge_volumes, step_volumes
from shardplan.cost.reshard import (canonical_pairs, canonical_volume, pattern_bits, reshard_steps, reshard_volume,
                                    steps_volume)
from shardplan.errors import ShardplanError
from shardplan.ir import GraphBuilder
from shardplan.layout import Layout, LayoutArrays
from shardplan.machine import Machine

SHAPE = (8, 4, 4, 64)


def _pair():
    b = GraphBuilder("pair")
    x = b.input("x", SHAPE, needs_grad=True)
    u = ops.elementwise("u", x)
    v = ops.elementwise("v", b.add(u))
    return u, v


def _layouts(dims):
    out = []
    for c in itertools.product((1, 2, 4, 8), repeat=len(SHAPE)):
        if 8 % int(np.prod(c)) or any(n % k for n, k in zip(SHAPE, c)):
            continue
        for order in itertools.permutations([j for j in range(len(c)) if c[j] > 1]):
            out.append(Layout.flat(dims, c, 8, order))
    return LayoutArrays.stack(out)


def _apply(lab, st):
    """Check that step ``st`` is one of the four kinds applied to ``lab`` legally; return its result."""
    after = st.after
    used = {x for s in lab for x in s}
    assert st.used == sum(len(s) for s in lab)
    if st.kind == "slice":  # only appends unused bits
        for a, b in zip(lab, after):
            assert b[:len(a)] == a and not set(b[len(a):]) & used
    elif st.kind == "all-gather":  # drops trailing bits
        assert sum(len(a) - len(b) for a, b in zip(lab, after)) == st.bits
        assert all(a[:len(b)] == b for a, b in zip(lab, after))
    elif st.kind == "all-to-all":  # trailing bits of sources appended to destinations
        assert {x for s in after for x in s} == used
        assert sum(max(len(b) - len(a), 0) for a, b in zip(lab, after)) == st.bits
    else:
        assert st.kind == "collective-permute" and [len(s) for s in lab] == [len(s) for s in after]
    return after


def test_pattern_bits():
    assert pattern_bits(4, 2) == (2, 1)
    assert pattern_bits(2, 1) == (0,)
    assert pattern_bits(1, 8) == ()


def test_known_steps():
    # one bit from axis 0 to axis 1: one all-to-all of 2, half the tile
    st = reshard_steps(((2,), ()), ((), (2,)), (3, 3), 3)
    assert [(s.kind, s.bits) for s in st] == [("all-to-all", 1)]
    assert steps_volume(st) == 0.5 * 0.5
    # the same split on another bit: a permute of the whole tile (all-gather then slice would send as much, but
    # the search takes the fewer steps)
    st = reshard_steps(((2,), ()), ((1,), ()), (3, 3), 3)
    assert steps_volume(st) == 0.5
    # three bits of one axis to three axes: the all-to-all of all three goes in steps (XLA cannot in one)
    st = reshard_steps(((2, 1, 0), (), ()), ((2,), (1,), (0,)), (3, 3, 3), 3)
    assert [s.kind for s in st] == ["all-to-all", "all-to-all"]
    assert steps_volume(st) == pytest.approx(1 / 8 * 0.5 + 1 / 8 * 0.5)


def test_steps_are_legal_reach_the_target_and_never_beat_the_lack():
    u, v = _pair()
    lay = _layouts(u.dim_names)
    lack_f, lack_b = edge_volumes(u, lay, v, 0, lay, 8)
    f, b = edge_volumes(u, lay, v, 0, lay, 8, steps=True)
    assert (f >= lack_f).all() and (b >= lack_b).all()
    assert (np.diag(f) == 0).all() and (f == lack_f).mean() > 0.4  # the steps reach the lack on nearly half the pairs
    st = step_volumes(u, lay, v, 0, lay, 8)
    assert st is not None and st[2].all()
    n = int(np.prod(SHAPE))
    rng = np.random.default_rng(0)
    for i, j in rng.integers(0, len(lay), size=(60, 2)).tolist():
        src = tuple(pattern_bits(*lay.patterns(d)[i]) for d in range(4))
        dst = tuple(pattern_bits(*lay.patterns(d)[j]) for d in range(4))
        steps = reshard_steps(src, dst, (3, 2, 2, 3), 3)
        cur = src
        for s in steps:
            cur = _apply(cur, s)
        assert cur == dst
        assert f[i, j] == round(steps_volume(steps) * n)
        assert b[i, j] == round(steps_volume(reshard_steps(dst, src, (3, 2, 2, 3), 3)) * n)


def test_edge_cost_charges_the_steps_on_one_level_only():
    u, v = _pair()
    a = LayoutArrays.stack([Layout.flat(u.dim_names, (4, 1, 1, 2), 8, (0, 3))])
    c = LayoutArrays.stack([Layout.flat(u.dim_names, (1, 4, 1, 1), 8, (1,))])
    lack, _ = edge_volumes(u, a, v, 0, c, 8)
    steps, _ = edge_volumes(u, a, v, 0, c, 8, steps=True)
    assert (int(lack[0, 0]), int(steps[0, 0])) == (1792, 2048)  # the MNIST CNN's edge: 7168 B and 8192 B in f32
    m = Machine(num_devices=8, peak_flops=1e12, bandwidth=1e9, latency=0.0, dtype_bytes=4)
    t = edge_cost(u, a, v, 0, c, m)[0, 0]
    _, back = edge_volumes(u, a, v, 0, c, 8, steps=True)
    assert t == pytest.approx((2048 + float(back[0, 0])) * 4 / 1e9)
    # two levels: the steps do not apply (the lack is charged)
    assert step_volumes(u, LayoutArrays.stack([Layout.from_flat(u.dim_names, (4, 1, 1, 2), (4, 2), (0, 3))]), v, 0,
                        LayoutArrays.stack([Layout.from_flat(u.dim_names, (1, 4, 1, 1), (4, 2), (1,))]), 8) is None


def _labelings(n, caps):
    """Every bit labeling on 2^n devices of a tensor whose axis a may carry ``caps[a]`` bits."""
    r = len(caps)
    out = []
    for where in itertools.product(range(r + 1), repeat=n):  # device bit -> axis (r: none, replicated)
        axes = [[x for x in range(n) if where[x] == a] for a in range(r)]
        if any(len(ax) > c for ax, c in zip(axes, caps)):
            continue
        out.extend(itertools.product(*[list(itertools.permutations(ax)) for ax in axes]))
    return out


EXHAUSTIVE = [(n, caps) for n in (1, 2, 3) for r in (1, 2, 3)
              for caps in {(n,) * r, (1,) + (n,) * (r - 1), (n,) * (r - 1) + (min(2, n),), (0,) + (n,) * (r - 1)}]


@pytest.mark.parametrize("n,caps", EXHAUSTIVE)
def test_volume_equals_the_searched_steps_on_every_pair(n, caps):
    """2, 4 and 8 devices, tensors of rank 1-3 (some axes capped): for every ordered pair of labelings, the
    canonical volume (one pair at a time, and a whole table at once as the edge costs take it) is exactly the
    volume of the steps the search returns."""
    labs = _labelings(n, caps)
    ref, fast, rows = {}, {}, {}
    code, dropped = canonical_pairs(labs, labs, caps, n)
    for i, a in enumerate(labs):
        for j, b in enumerate(labs):
            want = steps_volume(reshard_steps(a, b, caps, n, ref))
            assert reshard_volume(a, b, caps, n, fast) == want, (a, b)
            got = canonical_volume(code[i, j].tolist(), n, rows) * 2.0 ** -int(dropped[i, j])
            assert got == want, (a, b)
            assert (want == 0) == all(y[:len(x)] == x for x, y in zip(a, b))  # nothing sent: every axis a prefix


def test_volume_on_larger_machines_and_ranks():
    """16 to 64 devices, rank 4 and 5, random pairs: the same equality (and the canonical form shared by pairs
    that differ only in bits and axes both sides agree on)."""
    rng = np.random.default_rng(1)
    for n, caps in [(4, (4, 2, 1, 4)), (5, (3, 5, 2, 1, 5)), (6, (6, 3, 6, 2))]:
        labs = _labelings(n, caps)
        pick = [labs[i] for i in rng.choice(len(labs), size=40, replace=False)]
        ref, fast = {}, {}
        code, dropped = canonical_pairs(pick, pick, caps, n)
        rows = {}
        for i, a in enumerate(pick):
            for j, b in enumerate(pick):
                want = steps_volume(reshard_steps(a, b, caps, n, ref))
                assert reshard_volume(a, b, caps, n, fast) == want, (a, b)
                assert canonical_volume(code[i, j].tolist(), n, rows) * 2.0 ** -int(dropped[i, j]) == want
    # a settled axis (equal on both sides) leaves the other axes' steps as they were, at half the tile
    a, b = ((2,), (), (1, 0)), ((), (2,), (1, 0))
    assert reshard_volume(a, b, (3, 3, 3), 3) == reshard_volume(((2,), ()), ((), (2,)), (3, 3), 3) * 0.25
    big, d_big = canonical_pairs([a], [b], (3, 3, 3), 3)
    small, d_small = canonical_pairs([((2,), ())], [((), (2,))], (3, 3), 3)
    assert big[0, 0].tolist() == small[0, 0].tolist() + [-1] and (int(d_big[0, 0]), int(d_small[0, 0])) == (2, 0)
    with pytest.raises(ShardplanError):
        reshard_volume(((0,),), ((0,), ()), (1, 1), 1)


def test_rows_grouped_as_numpy_groups_them():
    from shardplan.cost.edge import _unique_rows_hashed

    x = np.random.default_rng(2).integers(-1, 3, size=(5000, 4)) << 37
    rows, inv = _unique_rows_hashed(x)
    want, _ = np.unique(x, axis=0, return_inverse=True)
    assert (rows[inv] == x).all() and len(rows) == len(want)
