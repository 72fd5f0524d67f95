"""Overlapped tensor-parallel collectives (``build_tables(..., overlap_tp=True)``).

A contraction lends its compute to one edge, chosen by its own layout: the partial-sum producer to its one
consumer's reduction, otherwise a product whose input tile is shared by g > 1 devices to its one input's
gather. A collective of C seconds beside a pass of G seconds cut into g chunks exposes ``max(C - G (g-1)/g, 0)``.
The expected numbers are written from the collective formulas and the roofline by hand.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from shardplan import ops
from shardplan.cost import build_tables, edge_cost
from shardplan.cost.collectives import allreduce_time, p2p_time, reduce_scatter_time
from shardplan.cost.edge import NO_CLAIM, exposed, overlap_budgets
from shardplan.cost.operator import operator_cost
from shardplan.ir import GraphBuilder, TensorRef
from shardplan.layout import Layout, LayoutArrays
from shardplan.machine import Machine, preset
from shardplan.models import get_model
from shardplan.recipe import megatron_layout
from shardplan.search import solve_dp, solve_ilp

from randgraphs import exact_solvers_agree, random_product_graph

PEAK = 1e9  # FLOP/s: slow enough that a product's pass and its collective are of the same order


def machine(p: int, latency: float = 0.0, peak: float = PEAK) -> Machine:
    return Machine(p, peak_flops=peak, bandwidth=1e9, latency=latency, dtype_bytes=4)


def x_ref(shape):
    return TensorRef("x", tuple(shape), needs_grad=True)


def flat(op, config, p, partial=False):
    return Layout.flat(op.dim_names, config, p).with_partial(partial)


def _fc_act(rows: int = 64):
    b = GraphBuilder("pair")
    x = b.input("x", (rows, 32), needs_grad=True)
    y = b.add(ops.dense("fc", x, 16))  # dims b, n, c: y[b, n] = sum_c x[b, c] W[c, n]
    b.add(ops.elementwise("act", y))  # dims b, n
    return b.build()


# -- one GEMM pair, by hand ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("peak", [PEAK, 1e8, 1e12])
def test_row_parallel_product_hides_its_reduce_scatter_and_the_gathered_gradient(peak):
    """fc (1,1,4) partial -> act (4,1): forward a reduce-scatter of fc's 64x16 output among 4, backward each
    device gathers the 3/4 of the output gradient it misses. fc's pass is G = 2 * 64 * 16 * 32 / 4 / peak
    (3 passes: forward, input and weight gradients), so forward G * 3/4 of the reduce-scatter is hidden,
    backward 2G * 3/4 of the gather."""
    m = machine(4, peak=peak)
    g = _fc_act()
    fc, act = g.operators
    lu = LayoutArrays.stack([flat(fc, (1, 1, 4), 4, partial=True)])
    lv = LayoutArrays.stack([flat(act, (4, 1), 4)])
    oc = operator_cost(fc, lu, m)
    G = 2 * 64 * 16 * 32 / 4 / peak
    assert oc.compute[0] == pytest.approx(3 * G, rel=1e-12)
    n = 64 * 16 * 4
    rs = reduce_scatter_time(n, [[4]], m)[0]
    gather = float(p2p_time(3 / 4 * n, m))
    want = max(rs - 0.75 * G, 0.0) + max(gather - 0.75 * 2 * G, 0.0)
    prod, cons = overlap_budgets(fc, lu, oc.compute, m, single_consumer=True, input_slot=0)
    assert prod[:, 0].tolist() == pytest.approx([0.75 * G, 1.5 * G], rel=1e-12)
    assert cons[:, 0].tolist() == [NO_CLAIM, NO_CLAIM]  # lent to the output edge, not also to the input
    plain = edge_cost(fc, lu, act, 0, lv, m)
    assert plain[0, 0] == pytest.approx(rs + gather, rel=1e-12)
    hv = overlap_budgets(act, lv, operator_cost(act, lv, m).compute, m, True, 0)[1]
    assert hv.tolist() == [[NO_CLAIM], [NO_CLAIM]]  # not a contraction: nothing to lend
    assert edge_cost(fc, lu, act, 0, lv, m, hide=(prod, hv))[0, 0] == pytest.approx(want, rel=1e-12)
    t = build_tables(g, m, candidates=lambda op: (flat(fc, (1, 1, 4), 4, True),) if op.name == "fc"
                     else (flat(act, (4, 1), 4),), overlap_tp=True)
    assert t.edge_costs[0][0, 0] == pytest.approx(want, rel=1e-12)
    assert t.options["overlap_tp"] and t.options["partial_sums"]
    if peak == 1e8:
        assert want == 0.0  # slow products hide everything
    if peak == 1e12:
        assert want == pytest.approx(rs + gather - 0.75 * 3 * G, rel=1e-12)  # fast ones little


@pytest.mark.parametrize("latency", [0.0, 1e-6])
def test_column_parallel_product_hides_the_gather_of_its_input_and_its_gradient_reduce_scatter(latency):
    """act (4,1) -> fc (1,4,1) partial for x's gradient: forward every device gathers the 3/4 of x it misses,
    backward x's gradient partial over the n group is reduce-scattered into act's quarters; fc's input tile
    is shared by the 4 devices of its n split, so its passes hide 3/4 of themselves."""
    m = machine(4, latency)
    b = GraphBuilder("pair")
    x = b.input("x", (64, 32), needs_grad=True)
    a = b.add(ops.elementwise("act", x))
    b.add(ops.dense("fc", a, 16))
    g = b.build()
    act, fc = g.operators
    lay = {"act": (flat(act, (4, 1), 4),), "fc": (flat(fc, (1, 4, 1), 4, partial=True),)}
    plain = build_tables(g, m, candidates=lambda op: lay[op.name])
    t = build_tables(g, m, candidates=lambda op: lay[op.name], overlap_tp=True)
    n = 64 * 32 * 4
    gather = float(p2p_time(3 / 4 * n, m))
    rs = reduce_scatter_time(n, [[4]], m)[0]
    G = 2 * 64 * 32 * 16 / 4 / PEAK
    assert plain.edge_costs[0][0, 0] == pytest.approx(gather + rs, rel=1e-12)
    want = max(gather - 0.75 * G, 0.0) + max(rs - 0.75 * 2 * G, 0.0)
    assert want < gather + rs
    assert t.edge_costs[0][0, 0] == pytest.approx(want, rel=1e-12)
    assert t.op_costs[1].total[0] == plain.op_costs[1].total[0]  # the vertex is untouched


def test_the_weight_syncs_overlap_is_not_lent_twice():
    """With the machine's gradient overlap the weight-gradient all-reduce already hides behind the backward
    passes: only what is left of them is lent."""
    m = replace(machine(8), overlap_grad=True)
    fc = ops.dense("fc", x_ref((64, 32)), 16)
    lay = LayoutArrays.stack([flat(fc, (2, 1, 4), 8, partial=True)])  # batch split 2: W's gradient synced
    oc = operator_cost(fc, lay, m)
    off = operator_cost(fc, lay, replace(m, overlap_grad=False))
    taken = off.grad_allreduce[0] - oc.grad_allreduce[0]
    assert taken > 0
    prod, _ = overlap_budgets(fc, lay, oc.compute, m, True, None)
    G = oc.compute[0] / 3
    assert prod[:, 0].tolist() == pytest.approx([0.75 * G, 0.75 * (2 * G - taken)], rel=1e-12)


# -- soundness: no compute is lent to two edges -------------------------------------------------------------------
def test_an_output_read_twice_or_a_product_of_two_inputs_lends_nothing_there():
    m = machine(4)
    fc = ops.dense("fc", x_ref((64, 32)), 16)
    lays = LayoutArrays.stack([flat(fc, (1, 1, 4), 4, True), flat(fc, (1, 4, 1), 4, True), flat(fc, (4, 1, 1), 4)])
    c = operator_cost(fc, lays, m).compute
    prod, cons = overlap_budgets(fc, lays, c, m, single_consumer=False, input_slot=None)
    assert (prod == NO_CLAIM).all() and (cons == NO_CLAIM).all()
    prod, cons = overlap_budgets(fc, lays, c, m, single_consumer=True, input_slot=0)
    # (1,1,4) partial lends as producer only; (1,4,1): its input tile on 4 devices, lends as consumer only;
    # (4,1,1): nothing shared, nothing partial
    assert (prod[:, 0] > 0).all() and (cons[:, 0] == NO_CLAIM).all()
    assert (prod[:, 1] == NO_CLAIM).all() and (cons[:, 1] > 0).all()
    assert (prod[:, 2] == NO_CLAIM).all() and (cons[:, 2] == NO_CLAIM).all()


def test_exposed_takes_one_gemm_per_direction_never_the_sum():
    f = np.array([[3.0, 3.0]])
    b = np.array([[1.0, 1.0]])
    hu = np.array([[2.0], [NO_CLAIM]])
    hv = np.array([[NO_CLAIM, 2.5], [0.5, 5.0]])
    assert exposed(f, b, hu, hv).tolist() == [[1.0 + 0.5, 0.5 + 0.0]]


def test_every_lent_budget_is_used_by_exactly_one_edge_of_a_gpt():
    """On a GPT with every layout of every operator: each operator lends on at most one side per layout, and
    the side it lends on has exactly one edge."""
    from shardplan.cost import _lending_shape

    m = preset("a100", 8)
    g = get_model("gpt", 1, **{"layers": 1, "d_model": 256, "heads": 8, "vocab": 1024, "seq": 128})
    t = build_tables(g, m, cutoff=1, orders="row-major", overlap_tp=True)
    single, slots = _lending_shape(g)
    lent = 0
    for i, op in enumerate(g.operators):
        prod, cons = overlap_budgets(op, t.arrays[i], t.op_costs[i].compute, m, single[i], slots[i])
        both = (prod[0] != NO_CLAIM) & (cons[0] != NO_CLAIM)
        assert not both.any()
        if (prod[0] != NO_CLAIM).any():
            assert sum(e.src == i for e in g.edges) == 1
        if (cons[0] != NO_CLAIM).any():
            assert sum(e.dst == i for e in g.edges) == 1
        lent += int((prod[0] != NO_CLAIM).any() or (cons[0] != NO_CLAIM).any())
    assert lent >= 6  # q, k, v, attention output, both feed-forward products


def test_overlap_never_raises_an_edge_and_leaves_vertices_alone():
    m = preset("a100", 8)
    g = get_model("gpt", 2, **{"layers": 1, "d_model": 256, "heads": 8, "vocab": 1024, "seq": 256})
    a = build_tables(g, m, cutoff=1, orders="row-major", partial_sums=True)
    b = build_tables(g, m, cutoff=1, orders="row-major", overlap_tp=True)
    assert all(la == lb for la, lb in zip(a.layouts, b.layouts))
    assert all(np.array_equal(x.total, y.total) for x, y in zip(a.op_costs, b.op_costs))
    lower = 0
    for x, y in zip(a.edge_costs, b.edge_costs):
        assert (y <= x * (1 + 1e-12)).all()
        lower += int((y < x * (1 - 1e-9)).any())
    assert lower > 0


# -- Megatron-LM's sequence parallelism, overlapped -------------------------------------------------------------
BIG = {"layers": 2, "d_model": 1024, "heads": 16, "vocab": 4096, "seq": 2048}


def _tp_sp_tables(graph, m, tp, overlap):
    levels = tuple(m.levels)

    def candidates(op):
        a, b = megatron_layout(op, levels, 1, tp), megatron_layout(op, levels, 1, tp, sp=True)
        return (a,) if a == b else (a, b)

    return build_tables(graph, replace(m, memory_bytes=None), cutoff=1, candidates=candidates, overlap_tp=overlap)


def test_overlapped_sequence_parallelism_hides_each_gather_and_reduce_scatter_behind_its_product():
    """Every sequence-parallel edge that meets a product on one side: its forward and backward collectives are
    exposed max(C - G 7/8, φ C) with G that product's pass and φ the a100 profile's contention; the embedding
    (read by two operators) lends nothing. On the plain roofline (no tiles: chunking costs the products nothing;
    what it costs is tested below)."""
    m = replace(preset("a100", 8), sm_count=None, gemm_tiles=None)
    g = get_model("gpt", 4, **BIG)
    plain = _tp_sp_tables(g, m, 8, False)
    ov = _tp_sp_tables(g, m, 8, True)
    sp = [len(lays) - 1 for lays in ov.layouts]
    names = [op.name for op in g.operators]
    n = 4 * 2048 * 1024 * m.dtype_bytes
    hidden = 0
    for e, a, b in zip(g.edges, plain.edge_costs, ov.edge_costs):
        u, v = g.operators[e.src], g.operators[e.dst]
        c = a[sp[e.src], sp[e.dst]]
        if c == 0.0:
            assert b[sp[e.src], sp[e.dst]] == 0.0
            continue
        if u.kind == "embedding":
            assert b[sp[e.src], sp[e.dst]] == c, (names[e.src], names[e.dst])
            continue
        gemm, i = (u, e.src) if u.reduction_dims and ov.layouts[e.src][sp[e.src]].partial \
            and u.kind != "attn_proj" else (v, e.dst)
        G = ov.op_costs[i].compute[sp[i]] / 3
        gather = float(p2p_time(7 / 8 * n, m))
        red = min(reduce_scatter_time(n, [[8]], m)[0], allreduce_time(n, [[8]], m)[0])
        fwd, bwd = (red, gather) if gemm is u else (gather, red)
        assert c == pytest.approx(fwd + bwd, rel=1e-12)
        phi = m.comm_contention  # the collective's share of the device beside the product
        want = max(fwd - 7 / 8 * G, phi * fwd) + max(bwd - 7 / 8 * 2 * G, phi * bwd)
        assert b[sp[e.src], sp[e.dst]] == pytest.approx(want, rel=1e-12), (names[e.src], names[e.dst])
        hidden += 1
    # per layer (2): the two reduce-scatters, the gathers into q, k, v and the first feed-forward product; the head
    assert hidden == 2 * (2 + 3 + 1) + 1
    p0, p1 = plain.to_problem(), ov.to_problem()
    assert p1.evaluate(sp) < p0.evaluate(sp)


@pytest.mark.parametrize("tiled", [False, True])
def test_the_search_takes_the_overlap_where_it_pays_and_the_dp_matches_the_ilp(tiled):
    """On the plain roofline the overlap pays; with the a100's tiles and waves the chunks of these small products
    (d_model 1024 over 8 devices: 128 columns each) cost more than they hide, and the search does not take it."""
    m = preset("a100", 8) if tiled else replace(preset("a100", 8), sm_count=None, gemm_tiles=None)
    g = get_model("gpt", 4, **{**BIG, "layers": 1})
    costs = {}
    for ov in (False, True):
        t = build_tables(g, m, cutoff=1, orders="row-major", partial_sums=True, overlap_tp=ov)
        problem = t.to_problem()
        sol = solve_dp(problem)
        costs[ov] = sol.cost
        if ov:
            ilp = solve_ilp(problem, time_limit=120)
            assert ilp.optimal and ilp.cost == pytest.approx(sol.cost, rel=1e-6)
    if tiled:
        assert costs[True] == costs[False]
    else:
        assert costs[True] < costs[False]


# -- exactness: brute force and the ILP agree with the DP ------------------------------------------------------------
@pytest.mark.parametrize("seed", range(8))
def test_dp_bruteforce_and_ilp_agree_with_overlapped_edges(seed):
    rng = np.random.default_rng(seed)
    g = random_product_graph(seed)
    m = Machine(4, peak_flops=float(rng.choice([1e6, 1e7, 1e8])), bandwidth=1e8,
                latency=float(rng.choice([0.0, 1e-6, 1e-4])), dtype_bytes=4)
    plain = build_tables(g, m, cutoff=2, orders="row-major", partial_sums=True)
    t = build_tables(g, m, cutoff=2, orders="row-major", overlap_tp=True)
    assert any((b < a * (1 - 1e-9)).any() for a, b in zip(plain.edge_costs, t.edge_costs))
    problem = t.to_problem()
    dp = exact_solvers_agree(problem)
    assert dp.cost <= solve_dp(plain.to_problem()).cost * (1 + 1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_dp_bruteforce_and_ilp_agree_with_chunks_quantised_into_waves(seed):
    """The chunks' own tiles and waves (a machine of 2 multiprocessors and 2 x 2 tiles, so the 8 x 8 products'
    chunks quantise differently from the whole): every edge still a function of its two layouts, never above
    the plain one, and DP = brute force = ILP."""
    rng = np.random.default_rng(100 + seed)
    g = random_product_graph(seed)
    m = Machine(4, peak_flops=float(rng.choice([1e6, 1e7, 1e8])), bandwidth=1e8,
                latency=float(rng.choice([0.0, 1e-6])), dtype_bytes=4, sm_count=2, gemm_tiles=((2, 2),))
    plain = build_tables(g, m, cutoff=2, orders="row-major", partial_sums=True)
    t = build_tables(g, m, cutoff=2, orders="row-major", overlap_tp=True)
    assert all((b <= a * (1 + 1e-12)).all() for a, b in zip(plain.edge_costs, t.edge_costs))
    dp = exact_solvers_agree(t.to_problem())
    assert dp.cost <= solve_dp(plain.to_problem()).cost * (1 + 1e-12)


def test_chunked_products_pay_their_own_tiles_and_waves():
    """A column-parallel product over 4 devices, cut into 4 chunks along its 512 rows (tokens), on 4
    multiprocessors with 128 x 128 tiles. By hand, per device (x[512, 64] times W[64, 1024 / 4]):

    * forward y[512, 256]: whole 4 x 2 = 8 tiles, 2 full waves, u = 1; a chunk y[128, 256]: 2 tiles in one wave
      of 4 slots, u = 1/2: the pass takes f/R more (f = 2 * 512 * 64 * 256 FLOPs, R the achievable rate);
    * input gradient dx[512, 64] (sums over the 256 columns): whole 4 tiles of 128 x 128 holding 128 x 64 each,
      one wave, u = 1/2; a chunk 1 tile, u = 1/8: 6 f/R more;
    * weight gradient dW[64, 256] sums over the rows: one call, nothing more.

    The budget the product lends is (pass + chunks' cost) * 3/4; the edge takes the cheaper of the collective
    whole and beside the chunks."""
    from shardplan.cost.edge import chunk_dims, chunk_extras

    m = Machine(4, peak_flops=1e9, bandwidth=1e9, dtype_bytes=4, sm_count=4, gemm_tiles=((128, 128),))
    b = GraphBuilder("col")
    x = b.input("x", (512, 64), needs_grad=True)
    b.add(ops.dense("fc", x, 1024))  # y[b, n] = sum_c x[b, c] W[c, n]
    fc = b.build().operators[0]
    lay = LayoutArrays.stack([flat(fc, (1, 4, 1), 4)])
    assert [fc.dim_names[i] for i in chunk_dims(fc, 0)] == ["b"]
    f = 2 * 512 * 64 * 256 / m.achievable_flops
    prod, cons = chunk_extras(fc, lay, m, single_consumer=False, input_slot=0)
    assert prod.tolist() == [[0.0], [0.0]]
    assert cons[:, 0] == pytest.approx([f, 6 * f], rel=1e-12)
    oc = operator_cost(fc, lay, m)
    _, hv = overlap_budgets(fc, lay, oc.compute, m, single_consumer=False, input_slot=0)
    fwd = f / 1.0  # u = 1
    # input gradient at u = 1/2; weight gradient dW[64, 256]: 1 x 2 tiles in one wave of 4, u = 1/4
    bwd = f / 0.5 + f / 0.25
    assert oc.compute[0] == pytest.approx(fwd + bwd, rel=1e-12)
    assert hv[:, 0] == pytest.approx([(fwd + f) * 3 / 4, (bwd + 6 * f) * 3 / 4], rel=1e-12)
    # the edge: a gather of C seconds beside the chunks, or whole
    no = np.full((2, 1), NO_CLAIM)
    for c in (0.1 * f, 10 * f):
        got = exposed(np.array([[c]]), np.array([[c]]), no, hv, 0.0, np.zeros((2, 1)), cons)
        want = min(c, max(c - hv[0, 0], 0.0) + f) + min(c, max(c - hv[1, 0], 0.0) + 6 * f)
        assert got[0, 0] == pytest.approx(want, rel=1e-12)
    assert exposed(np.array([[0.1 * f]]), np.array([[0.1 * f]]), no, hv, 0.0, np.zeros((2, 1)), cons)[0, 0] \
        == pytest.approx(0.2 * f)  # a small collective: chunking would cost more than it hides
    # a machine without multiprocessors: chunks cost nothing
    flat_m = replace(m, sm_count=None, gemm_tiles=None)
    assert np.array_equal(chunk_extras(fc, lay, flat_m, False, 0)[1], np.zeros((2, 1)))


def test_overlap_tp_must_be_a_bool():
    from shardplan.errors import ShardplanError

    with pytest.raises(ShardplanError, match="overlap_tp must be True or False"):
        build_tables(_fc_act(), machine(4), overlap_tp="yes")


@pytest.mark.parametrize("sizes, latency, pays", [(BIG, None, True),
                                                   ({"layers": 2, "d_model": 256, "heads": 8, "vocab": 1024,
                                                     "seq": 16}, 1e-4, False)])
def test_the_search_takes_overlapped_sequence_parallelism_only_where_it_pays(sizes, latency, pays):
    """Each operator may take its TP or its SP layout, with overlap: large activations hide their collectives
    behind large products and the search takes SP; tiny ones on a high-latency link have products of
    microseconds that hide next to nothing of a 100 us latency, and the search keeps the norms and additions
    replicated (no sequence split). It still defers the products' all-reduces to their edges (partial
    layouts into replicated neighbours: the same all-reduce, now beside the product), which gains those
    microseconds and no more."""
    m = replace(preset("a100", 8), sm_count=None, gemm_tiles=None)  # the plain roofline: products by size
    if latency is not None:
        m = replace(m, latency=latency)
    g = get_model("gpt", 4, **sizes)
    t = _tp_sp_tables(g, m, 8, True)
    problem = t.to_problem()
    sol = solve_dp(problem)
    chosen = [t.layouts[i][k] for i, k in enumerate(sol.assignment)]
    tp = [0] * len(t.layouts)
    if pays:
        assert any(lay.partial for lay in chosen)
        assert sol.cost < problem.evaluate(tp)
        assert sol.cost < solve_dp(_tp_sp_tables(g, m, 8, False).to_problem()).cost
    else:
        seq = [k for op, k in zip(g.operators, sol.assignment) if op.kind in ("layer_norm", "add")]
        assert seq and all(k == 0 for k in seq)
        assert problem.evaluate(tp) * (1 - 1e-3) < sol.cost <= problem.evaluate(tp)
