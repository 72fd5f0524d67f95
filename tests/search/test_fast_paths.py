"""The faster table and search code gives the same numbers as the plain forms it replaced.

- Edges: the fast path tests "every device finds its block" one axis at a
  time (``act_v ⊆ act_u`` and ``act_v ⊆ match_a`` per axis); the plain form
  ANDs one device mask per pair of layouts over all axes and compares it with
  the active set. Both are run on whole models (one and two machine levels,
  one and several 64-bit device words, concatenation pieces, weight edges)
  and every edge matrix and the plan found must be equal.
- Layouts: the factorisation of a configuration over the levels recurses
  over the split dims only and drops rows over ``max_level_dims`` early; the
  plain form enumerates every divisor tuple per level in order and filters.
- Bounds: the forest pass splits a matrix shared by several edges once; the
  bounds must equal those of the same problem with every matrix its own copy.
  The min-plus products of the message passing are formed a block at a time
  and must equal the one-shot minimum bit for bit.
"""

from __future__ import annotations

import dataclasses
import math
from itertools import product

import numpy as np
import pytest

import shardplan.cost.edge as edge
from shardplan import GraphBuilder, ops
from shardplan.configs import _factorisations, layouts
from shardplan.cost import build_tables
from shardplan.machine import preset
from shardplan.models import get_model, model_spec
from shardplan.search import solve_dp
from shardplan.search.bounds import BoundState, _forest_pass, min_plus, trws
from shardplan.search.problem import Problem


def _fast_device_masks(u, lu, v, t_in, lv, p, memo=None):
    """The plain form of the edge fast path: one device mask per pair of groups, ANDed over the axes."""
    words = (p + 63) // 64
    su = edge._side(u, u.output, lu, words, memo)
    sv = edge._side(v, t_in, lv, words, memo)
    gu, gv = su.groups, sv.groups
    m = su.act[:, None, :] & sv.act[None, :, :]
    nested_all = np.ones((len(gu), len(gv)), dtype=bool)
    for a in range(len(t_in.axes)):
        masks, nests = edge._pattern_masks(su, sv, a, words, memo)
        m &= masks[gu[:, a][:, None], gv[:, a][None, :]]
        nested_all &= nests[gu[:, a][:, None], gv[:, a][None, :]]

    def expand(x):
        return x[su.inv][:, sv.inv]

    fwd_ok = expand((m == sv.act[None, :, :]).all(axis=-1))
    bwd_ok = expand((m == su.act[:, None, :]).all(axis=-1))
    exact = expand(nested_all) & su.regular[:, None] & sv.regular[None, :]
    overlap = np.minimum(su.lengths[:, None, :], sv.lengths[None, :, :]).prod(axis=-1)[su.len_inv][:, sv.len_inv]
    fwd = np.where(fwd_ok, sv.vol[None, :] - overlap, sv.vol[None, :])
    bwd = np.where(bwd_ok, su.vol[:, None] - overlap, su.vol[:, None])
    return fwd, bwd, exact


CASES = [
    ("alexnet", {}, "paper", 16),
    ("inception_v3", {}, "paper", 8),  # concatenation pieces
    ("transformer", {}, "paper", 8),
    ("rnnlm", {}, "paper", 8),
    ("gpt", {"layers": 2, "d_model": 256, "heads": 4, "seq": 128, "vocab": 512}, "h100", 16),  # two levels
    ("gpt", {"layers": 1, "d_model": 256, "heads": 8, "seq": 128, "vocab": 512}, "h100", 128),  # two words
    ("llama3-tiny", {"layers": 1}, "h100", 32),
]


@pytest.mark.parametrize("model,sizes,machine,p", CASES, ids=[f"{c[0]}-{c[3]}" for c in CASES])
def test_edge_fast_path_matches_device_masks(monkeypatch, model, sizes, machine, p):
    spec = model_spec(model)
    g = spec.build(None, **sizes) if sizes else spec.build(None)
    m = preset(machine, p)
    new = build_tables(g, m, cutoff=spec.cutoff)
    with monkeypatch.context() as mp:
        mp.setattr(edge, "_fast", _fast_device_masks)
        ref = build_tables(g, m, cutoff=spec.cutoff)
    assert len(new.edge_costs) == len(ref.edge_costs) > 0
    for a, b in zip(new.edge_costs, ref.edge_costs):
        assert a.shape == b.shape and np.array_equal(a, b)
    for a, b in zip(new.weight_edge_costs, ref.weight_edge_costs):
        assert np.array_equal(a, b)
    assert solve_dp(new.to_problem()).assignment == solve_dp(ref.to_problem()).assignment


def _tied_graph():
    """An embedding whose table the output projection reads (a weight edge)."""
    b = GraphBuilder("tied")
    ids = b.input("ids", (16, 32))
    emb = ops.embedding("emb", ids, 256, 64)
    head = ops.einsum("head", "bsd,vd->bsv", emb.out, ops.Param((256, 64)))
    head = dataclasses.replace(head, weights=tuple(dataclasses.replace(w, owner=("emb", "table"))
                                                   for w in head.weights))
    b.add(emb)
    b.add(head)
    return b.build()


@pytest.mark.parametrize("machine,p", [("h100", 16), ("paper", 128)])
def test_edge_fast_path_matches_device_masks_with_weight_edges(monkeypatch, machine, p):
    g = _tied_graph()
    assert g.weight_edges
    m = preset(machine, p)
    new = build_tables(g, m, cutoff=1, orders="row-major")
    with monkeypatch.context() as mp:
        mp.setattr(edge, "_fast", _fast_device_masks)
        ref = build_tables(g, m, cutoff=1, orders="row-major")
    assert len(new.weight_edge_costs) == 1
    for a, b in zip(new.weight_edge_costs + new.edge_costs, ref.weight_edge_costs + ref.edge_costs):
        assert np.array_equal(a, b)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _factorisations_plain(c, products, max_level_dims=None):
    """Every per-level row tuple, rows in lexicographic order of their divisor tuples, filtered afterwards."""
    if len(products) == 1:
        rows = [(tuple(c),)] if math.prod(c) == products[0] else []
    else:
        rows = []
        for row in product(*[_divisors(x) for x in c]):
            if math.prod(row) == products[0]:
                rest = tuple(x // e for x, e in zip(c, row))
                rows += [(row,) + tail for tail in _factorisations_plain(rest, products[1:])]
    if max_level_dims is not None:
        rows = [r for r in rows if all(sum(x > 1 for x in level) <= max_level_dims for level in r)]
    return rows


@pytest.mark.parametrize("c,products", [
    ((8, 1, 4, 2), (8, 8)), ((16, 4, 1), (8, 8)), ((2, 3, 4), (4, 6)), ((64, 2, 8, 1, 1), (8, 16, 8)),
    ((1, 1, 1), (1, 1)), ((12, 6, 1, 4), (8, 36)), ((6, 10), (4, 15)),
])
@pytest.mark.parametrize("cap", [None, 1, 2, 3])
def test_factorisations_match_plain_enumeration(c, products, cap):
    got = _factorisations(c, products, cap)
    assert got == _factorisations_plain(c, products, cap)
    assert len(set(got)) == len(got)


def test_layouts_of_a_model_are_unchanged_by_early_filtering():
    g = get_model("gpt", 8, layers=1, d_model=256, heads=8, seq=128, vocab=512)
    for op in g.operators[:8]:
        for levels in ((8, 8), (2, 4, 8)):
            late = layouts(op, levels, 1, max_level_dims=None)
            early = layouts(op, levels, 1, max_level_dims=2)
            assert early == tuple(x for x in late if all(sum(s > 1 for s in row) <= 2 for row in x.splits))


def _copied(p: Problem) -> Problem:
    return Problem(p.names, p.configs, p.vertex_cost, p.edges, tuple(m.copy() for m in p.edge_cost), p.dims)


@pytest.mark.parametrize("model,p", [("transformer", 8), ("gpt", 16)])
def test_forest_bounds_same_with_shared_matrices(model, p):
    spec = model_spec(model)
    g = spec.build(None, layers=2) if model == "gpt" else spec.build(None)
    prob = build_tables(g, preset("paper", p), cutoff=spec.cutoff).to_problem()
    shared = BoundState.from_problem(prob)
    own = BoundState.from_problem(_copied(prob))
    assert len({id(m) for m in shared.pairs.values()}) < len(shared.pairs)  # some matrices are shared
    for exact in (False, True):
        a, b = _forest_pass(shared, exact), _forest_pass(own, exact)
        assert all(np.array_equal(x, y) for x, y in zip(a[0], b[0]))
        assert np.array_equal(a[1], b[1]) and a[2] == b[2]
    order = list(range(shared.n))
    trws(shared, order, 2)
    trws(own, order, 2)
    a, b = _forest_pass(shared), _forest_pass(own)
    assert all(np.array_equal(x, y) for x, y in zip(a[0], b[0]))


@pytest.mark.parametrize("ka,kb", [(1, 1), (1, 700), (700, 1), (37, 1191), (300, 300), (3000, 20), (3, 0)])
def test_min_plus_is_the_one_shot_minimum(ka, kb):
    rng = np.random.default_rng(ka * 7919 + kb)
    m = rng.random((ka, kb)) * 10.0 ** rng.integers(-6, 6, size=(ka, kb))
    v = rng.random(ka)
    for mat in (m, np.ascontiguousarray(m.T).T, m[:, ::2]):  # C order, a transposed view, a strided view
        assert np.array_equal(min_plus(v, mat), (v[:, None] + mat).min(axis=0))


def _split_one_shot(m, col=None, row=None):
    """The plain form split_max replaced: the edge with its messages subtracted, split, and the largest residual."""
    if col is not None:
        m = m - col[None, :]
        m -= row[:, None]
    r = m.min(axis=1)
    e = m - r[:, None]
    c = e.min(axis=0)
    return r, c, float((e - c[None, :]).max())


@pytest.mark.parametrize("ka,kb", [(1, 1), (1, 700), (700, 1), (37, 1191), (300, 300), (3000, 20), (5, 9000)])
def test_split_max_is_the_one_shot_split(ka, kb):
    from shardplan.search.bounds import split_max

    rng = np.random.default_rng(ka * 31 + kb)
    m = rng.random((ka, kb)) * 10.0 ** rng.integers(-6, 6, size=(ka, kb))
    col = rng.standard_normal(kb) * 10.0 ** rng.integers(-3, 3, size=kb)
    row = rng.standard_normal(ka)
    for mat in (m, np.ascontiguousarray(m.T).T, m[:, ::2]):  # C order, a transposed view, a strided view
        c = col[: mat.shape[1]]
        for args in ((), (c, row)):
            want, got = _split_one_shot(mat, *args), split_max(mat, *args)
            assert np.array_equal(want[0], got[0]) and np.array_equal(want[1], got[1]) and want[2] == got[2]
