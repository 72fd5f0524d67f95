"""FlashAttention as one operator (:func:`shardplan.ops.flash_attention`): its FLOPs, HBM bytes and memory by hand,
the layouts it allows, its keys and values on the context-parallel ring, and the exact search over graphs that
hold it (DP = brute force = ILP)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from randgraphs import exact_solvers_agree, random_attention_graph

from shardplan import ops
from shardplan.configs import layouts
from shardplan.cost import build_tables
from shardplan.cost.collectives import allreduce_time, outer_level
from shardplan.cost.fused import fused_bytes
from shardplan.cost.memory import operator_memory
from shardplan.cost.operator import operator_cost
from shardplan.cost.ring import (
    moved_reduction,
    ring_choices,
    ring_exposed,
    ring_inputs,
    ring_mask,
)
from shardplan.errors import ShardplanError
from shardplan.ir import Causal, GraphBuilder
from shardplan.layout import Layout, LayoutArrays
from shardplan.machine import Machine
from shardplan.search import solve_dp

PEAK, HBM, DT = 1e12, 1e11, 4  # FLOP/s, HBM bytes/s and bytes per element of the test machine


def machine(p: int = 4, hbm: float | None = HBM, peak: float = PEAK, **kw) -> Machine:
    return Machine(p, peak_flops=peak, bandwidth=kw.pop("bandwidth", 1e9), latency=kw.pop("latency", 1e-6),
                   dtype_bytes=DT, hbm_bandwidth=hbm, **kw)


def flash_graph(B: int = 2, S: int = 64, H: int = 4, K: int = 16, causal: bool = False, out: bool = False):
    """q, k, v from elementwise operators (dims b s h k / b t h k), the fused core, optionally an output
    projection."""
    b = GraphBuilder("flash")
    x = b.input("x", (B, S, H, K), needs_grad=True)
    q = b.add(ops.elementwise("q", x, letters="bshk"))
    k = b.add(ops.elementwise("k", x, letters="bthk"))
    v = b.add(ops.elementwise("v", x, letters="bthk"))
    a = b.add(ops.flash_attention("attn", q, k, v, "bshk", "bthk", causal=causal))
    if out:
        b.add(ops.einsum("out", "bshk,hkd->bsd", a, ops.Param((H, K, 8))))
    return b.build()


def flat(op, p: int = 4, **splits: int) -> Layout:
    return Layout.flat(op.dim_names, tuple(splits.get(d, 1) for d in op.dim_names), p)


# -- the description ------------------------------------------------------------------------------------------
def test_the_operator_describes_both_products_and_the_fused_backward():
    op = flash_graph()["attn"]
    assert op.kind == "attn_flash" and op.dim_names == ("b", "s", "h", "k", "t")
    assert [t.name for t in op.inputs] == ["q", "k", "v"] and op.output.shape == (2, 64, 4, 16)
    assert op.reduction_dims == ("t",) and op.fixed == {"t", "k"} and op.norm_dims == ("t",)
    assert op.flops_per_point == 4 + 5 / 16 and op.backward_flops == 10 + 4 / 16
    assert op.saved == 1 + 2 / 16 and op.causal is None
    assert op.passes == 1 + (10 + 4 / 16) / (4 + 5 / 16)  # the backward is 2.5x the forward's products
    assert flash_graph(causal=True)["attn"].causal == Causal("s", "t", True)


@pytest.mark.parametrize("query, key, match", [
    ("bshk", "bshk", "in the query only"),
    ("bshk", "bthz", "must end in the features"),
    ("bsh", "bthk", "must name the axes"),
])
def test_bad_letters_are_one_line(query, key, match):
    g = flash_graph()
    q, k = g["q"].out, g["k"].out
    with pytest.raises(ShardplanError, match=match) as e:
        ops.flash_attention("a", q, k, k, query, key)
    assert "\n" not in str(e.value)


def test_backward_flops_must_be_finite_beside_a_forward():
    op = flash_graph()["attn"]
    for bad in (-1.0, float("inf")):
        with pytest.raises(ShardplanError, match="backward_flops must be a finite number"):
            replace(op, backward_flops=bad)
    with pytest.raises(ShardplanError, match="beside a positive flops_per_point"):
        replace(op, flops_per_point=0.0)


def test_its_layouts_split_batch_heads_and_queries_only():
    op = flash_graph()["attn"]
    lays = layouts(op, (8,), cutoff=1)
    split = {d for lay in lays for d, c in zip(lay.dims, lay.split) if c > 1}
    assert split == {"b", "s", "h"}


# -- compute, bytes and memory by hand ---------------------------------------------------------------------------
def test_compute_by_hand_bytes_bound_and_flops_bound():
    g = flash_graph(B=2, S=64, H=4, K=16)
    op, m = g["attn"], machine()
    rows = np.asarray([[1, 1, 1, 1, 1], [2, 1, 2, 1, 1], [1, 4, 1, 1, 1]])
    cost = operator_cost(op, rows, m)
    pts = np.asarray([2 * 64 * 4 * 16 * 64, 64 * 2 * 16 * 64, 2 * 16 * 4 * 16 * 64], dtype=float)
    qt = np.asarray([2 * 64 * 4 * 16, 64 * 2 * 16, 2 * 16 * 4 * 16], dtype=float)  # q (and o) tile
    kt = np.asarray([2 * 64 * 4 * 16, 64 * 2 * 16, 2 * 64 * 4 * 16], dtype=float)  # k and v tiles (t whole)
    fwd_bytes = (qt + 2 * kt + (1 + 2 / 16) * qt) * DT          # q, k, v read; o and lse written
    bwd_bytes = fwd_bytes + qt * DT + (qt + 2 * kt) * DT        # and dO read, dq, dk, dv written
    fwd = np.maximum((4 + 5 / 16) * pts / PEAK, fwd_bytes / HBM)
    bwd = np.maximum((10 + 4 / 16) * pts / PEAK, bwd_bytes / HBM)
    assert cost.compute == pytest.approx(fwd + bwd, rel=1e-12)
    assert (fwd_bytes / HBM > (4 + 5 / 16) * pts / PEAK).tolist() == [False, False, True]  # both regimes
    f, b = fused_bytes(op, lambda t, core=True: np.asarray(
        [np.prod([e // c for (d, e), c in zip(op.dims, r) if any(d == a.dim for a in t.axes)]) for r in rows]))
    assert f * DT == pytest.approx(fwd_bytes) and b * DT == pytest.approx(bwd_bytes)
    # a long sequence is bound by its FLOPs: 4 + 5/K forward and 10 + 4/K backward per point
    big = flash_graph(B=1, S=4096, H=1, K=128)["attn"]
    c = operator_cost(big, np.ones((1, 5), dtype=np.int64), machine(p=1))
    pts = 4096 * 4096 * 128
    assert c.compute[0] == pytest.approx(((4 + 5 / 128) + (10 + 4 / 128)) * pts / PEAK, rel=1e-12)
    # no bandwidth (the paper's model): FLOPs alone
    assert operator_cost(op, rows, machine(hbm=None)).compute == pytest.approx(
        ((4 + 5 / 16) + (10 + 4 / 16)) * np.asarray([2 * 64 * 4 * 16 * 64, 64 * 2 * 16 * 64,
                                                      2 * 16 * 4 * 16 * 64]) / PEAK, rel=1e-12)


def test_causal_mask_halves_the_work_on_the_busiest_device():
    S = 4096
    op = flash_graph(B=1, S=S, H=1, K=128, causal=True)["attn"]
    m = machine(p=2)
    full = ((4 + 5 / 128) + (10 + 4 / 128)) * S * S * 128 / PEAK
    got = operator_cost(op, np.asarray([[1, 1, 1, 1, 1], [1, 2, 1, 1, 1]]), m).compute
    # balanced chunks: every device S (S + 1) / 2 / S^2 of its tile; unsplit the same share
    assert got == pytest.approx([full * (S + 1) / (2 * S), full / 2 * (S + 1) / (2 * S)], rel=1e-12)
    contiguous = replace(op, causal=Causal("s", "t", balanced=False))
    got = operator_cost(contiguous, np.asarray([[1, 2, 1, 1, 1]]), m).compute[0]
    assert got == pytest.approx(full / 2 * (2 * S - S / 2 + 1) / (2 * S), rel=1e-12)  # the last half's share


def test_memory_keeps_the_output_and_the_log_sum_exp_only():
    g = flash_graph(B=2, S=64, H=4, K=16)
    op, m = g["attn"], machine()
    w, act = operator_memory(op, np.asarray([[1, 1, 1, 1, 1], [2, 2, 1, 1, 1]]), m)
    assert w.ravel().tolist() == [0.0, 0.0]
    assert act.ravel().tolist() == [2 * 64 * 4 * 16 * (1 + 2 / 16) * DT, 1 * 32 * 4 * 16 * (1 + 2 / 16) * DT]


def test_llama_memory_drops_exactly_the_scores_and_probabilities():
    """The whole model's activations, unsplit: the unfused core keeps the (b, h, r, s, t) probabilities and the
    context; the fused one its output and the log-sum-exp rows. Nothing else differs."""
    from shardplan.models import get_model

    m = machine(p=1)
    acts = {}
    for attention in ("flash", "unfused"):
        g = get_model("llama3-tiny", 2, attention=attention)
        acts[attention] = sum(float(operator_memory(op, np.ones((1, len(op.dims)), dtype=np.int64), m)[1].sum())
                              for op in g)
    b, s, heads, kd, layers = 2, 128, 8, 32, 2
    o = b * s * heads * kd
    scores = b * heads * s * s
    assert acts["unfused"] - acts["flash"] == pytest.approx(layers * (scores + o - (1 + 2 / kd) * o) * DT, rel=1e-12)


def test_query_split_all_reduces_the_key_and_value_gradients():
    """All-gather context parallelism: queries split 4 ways, keys and values whole on every device; their
    gradients sum over the query split (an all-reduce of each, on the operator unless the ring takes it)."""
    op, m = flash_graph()["attn"], machine()
    cost = operator_cost(op, np.asarray([[1, 4, 1, 1, 1]]), m)
    kv = 2 * 64 * 4 * 16 * DT
    want = 2 * allreduce_time(np.asarray([kv]), np.asarray([[4]]), m)
    assert cost.grad_allreduce == pytest.approx(want, rel=1e-12)
    assert cost.forward_allreduce.tolist() == [0.0] and cost.stats.tolist() == [0.0]


# -- context parallelism: keys and values on one ring --------------------------------------------------------------
def test_keys_and_values_are_ring_inputs_together():
    op = flash_graph()["attn"]
    lays = LayoutArrays.stack([flat(op, s=4), flat(op, b=2, h=2), flat(op, s=2, h=2)])
    mask, g = ring_mask(op, lays)
    assert mask.tolist() == [[False, True, True], [False, False, False], [False, True, True]]
    assert g.tolist() == [4, 1, 2]
    assert ring_inputs(op, lays)[0].tolist() == [1, -1, 1]
    m = machine()
    both = moved_reduction(op, lays, m)
    per = [moved_reduction(op, lays, m, (j,)) for j in (1, 2)]
    assert both == pytest.approx(per[0] + per[1]) and per[0] == pytest.approx(per[1])
    assert moved_reduction(op, lays, m, (0,)).tolist() == [0.0, 0.0, 0.0]
    # three activations that are not multiplied together (a scatter's operand, indices and updates): no ring
    assert not ring_mask(replace(op, flops_per_point=1.0, backward_flops=None), lays)[0].any()


def test_each_ring_edge_hides_behind_its_share_of_the_core():
    """The ring on the edges k -> attn and v -> attn: each moves its own blocks, and overlaps the half of the
    core's compute that its bytes are of the two inputs' (k and v alike): ring_exposed by hand."""
    g = flash_graph(B=1, S=256, H=2, K=16)
    m = machine(bandwidth=1e8)
    op = g["attn"]
    lv = LayoutArrays.stack([flat(op, s=4)])
    comp = operator_cost(op, lv, m).compute
    for name, slot in (("k", 1), ("v", 2)):
        u = g[name]
        lu = LayoutArrays.stack([flat(u, t=4)])
        got = ring_choices(u, lu, op, slot, lv, m, comp)[0, 0]
        block = 256 * 2 * 16 * DT / 4
        fwd_pass = comp / op.passes
        share = 1 / 4 / 2  # one of 4 blocks of the pass, half of it (k's bytes of k's and v's)
        f, b = ring_exposed(np.asarray([block]), np.asarray([4]), outer_level(lv.group_sizes([1])),
                            fwd_pass * share, (comp - fwd_pass) * share, m)
        assert got == pytest.approx((f + b)[0], rel=1e-12) and np.isfinite(got)


@pytest.mark.parametrize("S, bandwidth, latency, pays", [(1024, 1e8, 1e-6, True), (8, 1e11, 1e-3, False)])
def test_the_search_takes_the_ring_only_where_it_pays(S, bandwidth, latency, pays):
    g = flash_graph(B=1, S=S, H=1, K=16)
    m = machine(p=4, bandwidth=bandwidth, latency=latency, hbm=None, peak=1e9)
    auto = build_tables(g, m, cutoff=1, orders="row-major", context="auto")
    plain = build_tables(g, m, cutoff=1, orders="row-major")
    a, p = solve_dp(auto.to_problem()), solve_dp(plain.to_problem())
    if pays:
        assert a.cost < p.cost * (1 - 1e-3)
        j = a.assignment[g.index["attn"]]
        assert ring_mask(g["attn"], auto.arrays[g.index["attn"]].take([j]))[0].tolist() == [[False, True, True]]
    else:
        assert a.cost == pytest.approx(p.cost, rel=1e-9)


# -- exactness -------------------------------------------------------------------------------------------------------
def _random_flash(seed: int):
    """The fused core masked or not, balanced or not (:func:`randgraphs.random_attention_graph`)."""
    return random_attention_graph(seed, lambda rng: {"causal": bool(rng.random() < 0.5),
                                                     "balanced": bool(rng.random() < 0.5)})


@pytest.mark.parametrize("seed", range(6))
def test_dp_bruteforce_and_ilp_agree_on_graphs_with_the_fused_core(seed):
    g, m = _random_flash(seed)
    for context, partial in (("allgather", False), ("auto", False), ("auto", True)):
        # partial: the keys' and values' gradients may be left as partial sums to their edges (reduce-scatter)
        t = build_tables(g, m, cutoff=1, orders="row-major", context=context, partial_sums=partial)
        exact_solvers_agree(t.to_problem())


def test_some_random_instances_take_the_ring_at_their_optimum():
    """The instances above are not all alike: on some the ring over keys and values lowers the optimum."""
    lower = 0
    for seed in range(6):
        g, m = _random_flash(seed)
        auto = solve_dp(build_tables(g, m, cutoff=1, orders="row-major", context="auto").to_problem()).cost
        plain = solve_dp(build_tables(g, m, cutoff=1, orders="row-major").to_problem()).cost
        assert auto <= plain * (1 + 1e-12)
        lower += int(auto < plain * (1 - 1e-9))
    assert 1 <= lower < 6


def _dealt_graph(S: int, dealt: bool):
    b = GraphBuilder("dealt")
    x = b.input("x", (1, S, 2, 16), needs_grad=True)
    q = b.add(ops.elementwise("q", x, letters="bshk"))
    k = b.add(ops.elementwise("k", x, letters="bthk"))
    v = b.add(ops.elementwise("v", x, letters="bthk"))
    b.add(ops.flash_attention("attn", q, k, v, "bshk", "bthk", causal=True, dealt=dealt))
    return b.build()


@pytest.mark.parametrize("S, dealt_charged", [(256, True), (260, False)])
def test_the_runners_deal_is_charged_to_the_ring_edges(S, dealt_charged):
    """A causal attention whose runner deals the contiguous blocks into the balanced order (``dealt``): the edge
    of the keys pays q, k and the output dealt (forward) and their gradients (backward), the edge of the values
    v and its gradient; each deal is two half-block point-to-points. Not where 2g does not divide the sequence
    (the runner does not deal there), and never for a loader-balanced mask."""
    m = machine(bandwidth=1e8, latency=1e-6)
    diffs = {}
    for dealt in (False, True):
        g = _dealt_graph(S, dealt)
        op = g["attn"]
        assert op.causal == Causal("s", "t", True, dealt)
        lv = LayoutArrays.stack([flat(op, s=4)])
        comp = operator_cost(op, lv, m).compute
        for name, slot in (("k", 1), ("v", 2)):
            lu = LayoutArrays.stack([flat(g[name], t=4)])
            diffs.setdefault(name, []).append(ring_choices(g[name], lu, op, slot, lv, m, comp)[0, 0])
    block = S * 2 * 16 * DT / 4  # q's, k's, v's and the output's block on each of the 4 devices
    deal = 2 * (block / 2 / 1e8 + 1e-6)
    k_extra, v_extra = (6 * deal, 2 * deal) if dealt_charged else (0.0, 0.0)
    assert diffs["k"][1] - diffs["k"][0] == pytest.approx(k_extra, rel=1e-12, abs=1e-15)
    assert diffs["v"][1] - diffs["v"][0] == pytest.approx(v_extra, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("context", ["allgather", "auto"])
def test_a_dealt_attention_pays_contiguous_work_when_its_keys_are_gathered_and_the_deal_costs_more(context):
    """With the keys gathered the runners deal the queries only where the deal costs less than the contiguous
    blocks' extra work; on slow links it costs more, the queries stay in contiguous blocks, and the edge of the
    keys pays the busiest device's extra work (the core costed with ``balanced=False`` less the balanced core),
    in tables built with either context; the values' edge and a loader-balanced mask pay none."""
    from dataclasses import replace as dc_replace

    from shardplan.cost.ring import deals_gathered, gather_deals, gathered_deal, gathered_imbalance

    m = machine(bandwidth=1e8, latency=1e-6)
    g = _dealt_graph(256, True)
    op = g["attn"]
    lv = LayoutArrays.stack([flat(op, s=4), flat(op, b=1), flat(op, h=2)])
    bal = operator_cost(op, lv, m).compute
    contiguous = operator_cost(dc_replace(op, causal=dc_replace(op.causal, balanced=False)), lv, m).compute
    extra = gathered_imbalance(op, 1, lv, m, bal)
    assert extra[0] == pytest.approx(contiguous[0] - bal[0]) and extra[0] > 0.3 * bal[0]
    assert extra[1:].tolist() == [0.0, 0.0]  # the sequence not split: nothing to balance
    assert not gathered_imbalance(op, 2, lv, m, bal).any()
    assert gathered_deal(op, 1, lv, m)[0] > extra[0] and not gather_deals(op, 1, lv, m, bal).any()
    assert not deals_gathered(op, flat(op, s=4), m)
    plain = _dealt_graph(256, False)
    assert not gathered_imbalance(plain["attn"], 1, lv, m, bal).any()
    t_dealt = build_tables(g, m, context=context)
    t_plain = build_tables(plain, m, context=context)
    names = [o.name for o in g.operators]
    e = next(i for i, x in enumerate(g.edges) if names[x.src] == "k")
    ks = [lay for lay in t_dealt.layouts[names.index("attn")]]
    row = next(i for i, lay in enumerate(ks) if lay.splits == flat(op, s=4).splits)
    diff = t_dealt.edge_costs[e][:, row] - t_plain.edge_costs[e][:, row]
    if context == "allgather":
        assert diff == pytest.approx(np.full_like(diff, contiguous[0] - bal[0]))
    else:  # the cheaper of the all-gather with the extra work and the ring with the deal, per producer layout
        assert (diff >= -1e-15).all() and (diff <= contiguous[0] - bal[0] + 1e-15).all()


@pytest.mark.parametrize("S, dealt", [(256, True), (260, False)])
def test_a_dealt_attention_with_its_keys_gathered_pays_the_deal_and_no_imbalance_where_the_deal_is_cheaper(S, dealt):
    """On fast links the balanced all-gather pays: the edge of the keys is charged the queries dealt in and the
    output back (forward), the output's gradient in and the queries' gradient back (backward), each two
    half-block point-to-points, 4 deal_time(q block), and none of the contiguous blocks' extra work; the
    values' edge nothing beyond its gather. Both edges also carry their input's gradient reduction, which the
    operator no longer charges (:func:`gathered_reduction`, the reduce-scatter where the producer scatters).
    Where 2g does not divide the sequence nothing is dealt (and the core is charged contiguous already)."""
    from shardplan.cost.ring import (deals_gathered, gathered_charge, gathered_deal, gathered_imbalance,
                                     gathered_moved, gathered_reduction)

    m = machine(bandwidth=1e12, latency=1e-7, peak=1e10)
    g, plain = _dealt_graph(S, True), _dealt_graph(S, False)
    op = g["attn"]
    lv = LayoutArrays.stack([flat(op, s=4), flat(op, h=2)])
    bal = operator_cost(op, lv, m).compute
    block = S * 2 * 16 * DT / 4  # a device's query (and output) block
    deal = 4 * 2 * (block / 2 / 1e12 + 1e-7)
    charged = gathered_charge(op, 1, lv, m, bal)
    if dealt:
        assert gathered_deal(op, 1, lv, m)[0] == pytest.approx(deal, rel=1e-12)
        assert 0 < deal < gathered_imbalance(op, 1, lv, m, bal)[0]
        assert charged.tolist() == pytest.approx([deal, 0.0], rel=1e-12)
    else:
        assert not gathered_deal(op, 1, lv, m).any() and not charged.any()
    assert deals_gathered(op, flat(op, s=4), m) == dealt and not deals_gathered(op, flat(op, h=2), m)
    assert not gathered_charge(op, 2, lv, m, bal).any()
    t_dealt, t_plain = build_tables(g, m), build_tables(plain, m)
    names = [o.name for o in g.operators]
    row = next(i for i, lay in enumerate(t_dealt.layouts[names.index("attn")]) if lay.splits == flat(op, s=4).splits)
    ia = names.index("attn")
    moved = gathered_moved(op, lv, m, bal)
    assert (moved[0] > 0) == dealt and moved[1] == 0.0
    assert t_dealt.op_costs[ia].grad_allreduce[row] == pytest.approx(
        t_plain.op_costs[ia].grad_allreduce[row] - moved[0], rel=1e-12, abs=1e-18)
    for src, slot, extra in (("k", 1, charged[0]), ("v", 2, 0.0)):
        e = next(i for i, x in enumerate(g.edges) if names[x.src] == src)
        diff = t_dealt.edge_costs[e][:, row] - t_plain.edge_costs[e][:, row]
        red = gathered_reduction(g[src], LayoutArrays.stack(list(t_dealt.layouts[names.index(src)])), op, slot,
                                 LayoutArrays.stack([flat(op, s=4)]), m, bal[:1])[:, 0]
        assert (red > 0).all() == dealt and (red == 0).all() != dealt
        assert diff == pytest.approx(extra + red, rel=1e-12, abs=1e-18), src


def test_the_search_takes_the_balanced_all_gather_over_the_ring_where_the_deal_makes_it_cheaper():
    """``context="auto"`` on one attention (sequence 1,024, one head, 4 devices, 10 GB/s links of 1 us): the
    optimum splits the queries 4 ways and gathers the keys, the deal charged in place of the contiguous
    blocks' extra work; charged that extra work instead (as before the all-gather dealt), the same tables'
    optimum passes the keys round the ring, at a higher step time."""
    from dataclasses import replace as dc_replace

    from shardplan.cost.ring import (deals_gathered, gathered_charge, gathered_deal, gathered_dealt,
                                     gathered_imbalance, gathered_reduction, moved_reduction)

    m = Machine(4, peak_flops=1e12, bandwidth=1e10, latency=1e-6, dtype_bytes=DT, hbm_bandwidth=HBM)
    b = GraphBuilder("dealt")
    x = b.input("x", (1, 1024, 1, 16), needs_grad=True)
    q, k, v = (b.add(ops.elementwise(n, x, letters=a)) for n, a in (("q", "bshk"), ("k", "bthk"), ("v", "bthk")))
    b.add(ops.flash_attention("attn", q, k, v, "bshk", "bthk", causal=True, dealt=True))
    g = b.build()
    t = build_tables(g, m, cutoff=1, context="auto")
    names = [o.name for o in g.operators]
    ia, ik = names.index("attn"), names.index("k")
    e = next(i for i, x in enumerate(g.edges) if names[x.src] == "k")
    lv = LayoutArrays.stack(list(t.layouts[ia]))
    lk = LayoutArrays.stack(list(t.layouts[ik]))
    comp = t.op_costs[ia].compute
    ring = ring_choices(g["k"], lk, g["attn"], 1, lv, m, comp)
    sol = solve_dp(t.to_problem())
    kk, ka = sol.assignment[ik], sol.assignment[ia]
    lay = t.layouts[ia][ka]
    assert lay.splits[0][g["attn"].dim_names.index("s")] == 4 and deals_gathered(g["attn"], lay, m)
    held = t.edge_costs[e][kk, ka]
    deal = gathered_deal(g["attn"], 1, lv, m)[ka]
    extra = gathered_imbalance(g["attn"], 1, lv, m, comp)[ka]
    assert gathered_charge(g["attn"], 1, lv, m, comp)[ka] == deal < extra
    assert held < ring[kk, ka]  # the all-gather (with the deal), not the ring
    # before: the extra work in place of the deal, and each input's gradient all-reduced (not reduce-scattered)
    dealt = gathered_dealt(g["attn"], lv, m, comp)
    edges = list(t.edge_costs)
    for src, slot in (("k", 1), ("v", 2)):
        j = next(i for i, x in enumerate(g.edges) if names[x.src] == src)
        ls = LayoutArrays.stack(list(t.layouts[names.index(src)]))
        back = np.where(dealt, moved_reduction(g["attn"], lv, m, (slot,)), 0.0)[None, :] \
            - gathered_reduction(g[src], ls, g["attn"], slot, lv, m, comp)
        if slot == 1:
            back = back + (gathered_imbalance(g["attn"], 1, lv, m, comp) - gathered_charge(g["attn"], 1, lv, m, comp))
        r = ring_choices(g[src], ls, g["attn"], slot, lv, m, comp)
        edges[j] = np.where(t.edge_costs[j] < r, np.minimum(t.edge_costs[j] + back, r), t.edge_costs[j])
    old = edges[e]
    before = solve_dp(dc_replace(t, edge_costs=tuple(edges)).to_problem())
    kb, ab = before.assignment[ik], before.assignment[ia]
    assert np.isfinite(ring[kb, ab]) and old[kb, ab] == ring[kb, ab]  # the ring
    assert sol.cost < before.cost


def test_the_operator_cost_of_a_dealt_attention_leaves_its_keys_gradient_to_the_edges_alike_everywhere():
    """What the tables charge a dealt attention under the all-gather (the keys' and values' gradient all-reduce
    taken off on the dealt rows: :func:`gathered_moved`) is what :func:`ring_operator_cost` gives the fit's
    micro-batch costs, row by row; an attention not dealt keeps its all-reduce."""
    from shardplan.cost.ring import gathered_dealt, gathered_moved, ring_operator_cost

    m = machine(bandwidth=1e12, latency=1e-7, peak=1e10)
    g = _dealt_graph(256, True)
    t = build_tables(g, m)
    names = [o.name for o in g.operators]
    ia = names.index("attn")
    lv = LayoutArrays.stack(list(t.layouts[ia]))
    full = operator_cost(g["attn"], lv, m)
    dealt = gathered_dealt(g["attn"], lv, m, full.compute)
    assert dealt.any() and not dealt.all()
    moved = gathered_moved(g["attn"], lv, m, full.compute)
    assert ((moved > 0) == (dealt & (full.grad_allreduce > 0))).all()
    assert t.op_costs[ia].grad_allreduce == pytest.approx(full.grad_allreduce - moved, rel=1e-12, abs=1e-18)
    assert ring_operator_cost(g["attn"], lv, m, "allgather").grad_allreduce == pytest.approx(
        t.op_costs[ia].grad_allreduce, rel=1e-12, abs=1e-18)
    plain = _dealt_graph(256, False)["attn"]
    assert ring_operator_cost(plain, lv, m, "allgather").grad_allreduce.tolist() == \
        operator_cost(plain, lv, m).grad_allreduce.tolist()
