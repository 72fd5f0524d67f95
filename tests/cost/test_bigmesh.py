"""Meshes of any size: regular tiles on every device are costed without per-device arrays, with the same numbers.

The tables built with the block-pattern path (memory as one column per layout, edges decided from the
layouts' patterns) are compared, exactly, with the per-device computation (every device's tile and mask)
on several models and machines up to 4,096 devices; the canonical coarse-block lemma behind the edge test
is checked against every device on random power-of-two layouts; the 4,096-device cap stays only where
per-device tiles are built.
"""

from __future__ import annotations

import numpy as np
import pytest

from shardplan import preset
from shardplan.cost import build_tables
from shardplan.cost.budget import pattern_edge, uniform_operator
from shardplan.cost.edge import _coarse_keys, _pattern_match, edge_cost, weight_edge_cost
from shardplan.cost.memory import operator_memory
from shardplan.cost.operator import operator_cost
from shardplan.cost.tiles import all_active
from shardplan.errors import ShardplanError
from shardplan.layout import LayoutArrays, pattern_blocks
from shardplan.models import get_model

SMALL = {"layers": 2}

CASES = [
    ("llama3-8b", SMALL, "h100", 1024),
    ("gpt", {"layers": 2, "d_model": 512, "heads": 8, "seq": 256, "vocab": 4096, "batch": 64}, "h100", 256),
    ("transformer", {}, "paper", 64),
    ("alexnet", {}, "paper", 32),
    ("inception_v3", {}, "paper", 16),
    ("alexnet", {}, "h100", 64),
]


def _tables(model, sizes, machine, p, **kw):
    return build_tables(get_model(model, **sizes), preset(machine, p), memory_limit_bytes=1 << 40, **kw)


@pytest.mark.parametrize("model,sizes,machine,p", CASES)
def test_tables_equal_the_per_device_computation(model, sizes, machine, p):
    """Every distinct operator's memory, costs and every distinct edge's matrix, exactly as per device."""
    tab = _tables(model, sizes, machine, p)
    g, m = tab.graph, tab.machine
    ops = g.operators
    seen: set[int] = set()
    columns = 0
    for i, op in enumerate(ops):
        arr = tab.arrays[i]
        if id(arr) in seen:
            continue
        seen.add(id(arr))
        w0, a0 = operator_memory(op, arr, m, per_device=True)
        w1, a1 = tab.memory[i]
        assert w1.shape[1] in (1, p)
        columns += w1.shape[1] == 1
        assert w1.shape[1] == 1 or not uniform_operator(op, arr)  # what the build's estimate assumes
        assert np.array_equal(np.broadcast_to(w1, w0.shape), w0) and np.array_equal(np.broadcast_to(a1, a0.shape), a0)
        ref = operator_cost(op, arr, m)
        assert np.array_equal(ref.total, tab.op_costs[i].total)
    assert columns >= 1
    done: set[int] = set()
    patterned = 0
    for e, mat in zip(g.edges, tab.edge_costs):
        if id(mat) in done:
            continue
        done.add(id(mat))
        u, v, lu, lv = ops[e.src], ops[e.dst], tab.arrays[e.src], tab.arrays[e.dst]
        patterned += pattern_edge(u, lu, v, e.slot, lv)
        assert np.array_equal(edge_cost(u, lu, v, e.slot, lv, m, analytic=False), mat), (u.name, v.name)
    assert patterned >= 1
    for w, mat in zip(g.weight_edges, tab.weight_edge_costs):
        ref = weight_edge_cost(ops[w.src], w.src_weight, tab.arrays[w.src], ops[w.dst], w.dst_weight,
                               tab.arrays[w.dst], m, analytic=False)[0]
        assert np.array_equal(ref, mat)


def test_partial_layouts_equal_the_per_device_computation():
    """With deferred reductions offered (edges that reduce partial sums), the same matrices both ways."""
    tab = _tables("gpt", {"layers": 1, "d_model": 256, "heads": 4, "seq": 128, "vocab": 1024, "batch": 16}, "h100",
                  64, partial_sums=True)
    ops = tab.graph.operators
    for e, mat in zip(tab.graph.edges, tab.edge_costs):
        ref = edge_cost(ops[e.src], tab.arrays[e.src], ops[e.dst], e.slot, tab.arrays[e.dst], tab.machine,
                        analytic=False)
        assert np.array_equal(ref, mat)


def test_idle_devices_keep_the_per_device_path():
    """Layouts that leave devices idle (not dividing p) are costed per device, as before, with the same numbers."""
    tab = _tables("alexnet", {}, "paper", 12, divides_p=False)
    ops = tab.graph.operators
    assert not all(all_active(a).all() for a in tab.arrays)
    assert any(w.shape[1] == 12 for w, _ in tab.memory)
    for e, mat in zip(tab.graph.edges, tab.edge_costs):
        ref = edge_cost(ops[e.src], tab.arrays[e.src], ops[e.dst], e.slot, tab.arrays[e.dst], tab.machine,
                        analytic=False)
        assert np.array_equal(ref, mat)


def _random_patterns(rng, levels, n):
    """n random block patterns (split, per-level splits, per-level strides) of power-of-two splits that divide
    each level, with strides of a row-major grid inside the level (the split times a power-of-two stride
    fits the level)."""
    rows = []
    for _ in range(n):
        cs, ss = [], []
        for s in levels:
            c = 1 << int(rng.integers(0, int(np.log2(s)) + 1))
            stride = 1 << int(rng.integers(0, int(np.log2(s // c)) + 1))
            cs.append(c)
            ss.append(stride if c > 1 else 1)
        rows.append([int(np.prod(cs)), *cs, *ss])
    return np.asarray(rows, dtype=np.int64)


@pytest.mark.parametrize("levels", [(8,), (2, 4), (4, 8), (2, 2, 4), (8, 16)])
def test_pattern_match_is_the_every_device_test(levels):
    """The canonical coarse blocks decide, for every pair of patterns, exactly whether every device's coarse
    block agrees: checked against every device's block index (x // k per pattern)."""
    rng = np.random.default_rng(sum(levels))
    pu, pv = _random_patterns(rng, levels, 40), _random_patterns(rng, levels, 40)
    n_lv = len(levels)
    got = _pattern_match(pu, pv, n_lv)
    xu, xv = pattern_blocks(pu[:, 1:], levels), pattern_blocks(pv[:, 1:], levels)  # (P, p)
    cu, cv = pu[:, 0], pv[:, 0]
    m = np.minimum(cu[:, None], cv[None, :])
    want = ((xu[:, None, :] // (cu[:, None] // m)[..., None]) == (xv[None, :, :] // (cv[None, :] // m)[..., None]))
    assert np.array_equal(got, want.all(axis=-1))
    assert got.any() and not got.all()


def test_coarse_keys_name_the_coarse_block_function():
    """Equal keys iff equal coarse-block vectors over the devices, for every coarsening of random patterns."""
    levels = (4, 8)
    rng = np.random.default_rng(7)
    pats = _random_patterns(rng, levels, 60)
    x = pattern_blocks(pats[:, 1:], levels)
    for m in (1, 2, 4, 8):
        rows = np.nonzero(pats[:, 0] >= m)[0]
        keys = _coarse_keys(pats[rows], m, len(levels))
        coarse = x[rows] // (pats[rows, 0] // m)[:, None]
        same_key = (keys[:, None, :] == keys[None, :, :]).all(axis=-1)
        same_fn = (coarse[:, None, :] == coarse[None, :, :]).all(axis=-1)
        assert np.array_equal(same_key, same_fn)


def test_per_device_tiles_are_refused_past_the_cap_with_why():
    """Convolutions (windowed tiles) on 8,192 devices: refused in one line that names the irregular tiles."""
    with pytest.raises(ShardplanError, match=r"8192 devices: .*not the same on every device.*at most 4096 devices"):
        build_tables(get_model("alexnet"), preset("h100", 8192), memory_limit_bytes=1 << 40)


def test_all_active_reads_the_level_sizes():
    """all_active equals 'every device is active' of the per-device mask."""
    levels = (4, 6)
    ls = np.array([[[1, 2], [2, 2], [4, 1], [3, 1]], [[3, 2], [2, 1], [1, 6], [4, 1]]], dtype=np.int64)  # (L, K, n)
    st = np.ones_like(ls)
    st[:, :, 0] = ls[:, :, 1]
    lay = LayoutArrays(levels, ls, st)
    assert np.array_equal(all_active(lay), lay.active().all(axis=1))
