"""A product's input-gradient collective beside its own weight-gradient pass (``Machine.overlap_dgrad``).

Megatron-LM's column-parallel linear (2022 on) starts the all-reduce of its input's gradient, then computes its
weight's gradient; under sequence parallelism the same with a reduce-scatter. A collective of C seconds beside a
weight-gradient pass of W seconds is exposed ``max(C - W, 0)``; with the weight synchronisation overlapped too,
that sync overlaps only the ``backward - min(C, W)`` seconds left. The expected numbers are written from the
collective formulas and the roofline by hand (docs/cost-model.md, "Input gradients beside the weight gradient").
"""

from __future__ import annotations

import json
from dataclasses import fields, replace
from pathlib import Path

import numpy as np
import pytest

from shardplan import ops
from shardplan.configs import flat_layouts
from shardplan.cost import build_tables, edge_cost
from shardplan.cost.collectives import allreduce_time, p2p_time, reduce_scatter_time
from shardplan.cost.edge import NO_CLAIM, overlap_budgets
from shardplan.cost.operator import operator_cost
from shardplan.errors import ShardplanError
from shardplan.ir import GraphBuilder, TensorRef
from shardplan.layout import Layout, LayoutArrays
from shardplan.machine import OPTIONAL_FIELDS, Machine, parse_profile, preset
from shardplan.pipeline.stages import weight_sync
from shardplan.search import solve_dp

from randgraphs import exact_solvers_agree, random_product_graph

B, S, D, E = 2, 16, 32, 64  # x[b, s, d] @ W[d, e]: dims b, s, e, d


def machine(p: int, peak: float, **kw) -> Machine:
    """A hand machine: a plain roofline (no shaped products, no HBM term), so every pass costs the same."""
    return Machine(p, peak_flops=peak, bandwidth=1e9, latency=0.0, dtype_bytes=4, **kw)


def column_product():
    return ops.einsum("fc", "bsd,de->bse", TensorRef("x", (B, S, D), needs_grad=True), ops.Param((D, E)))


def one(op, config, p: int, partial: bool = False) -> LayoutArrays:
    return LayoutArrays.stack([Layout.flat(op.dim_names, config, p).with_partial(partial)])


# -- one product, by hand ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("peak, c_above_w", [(1e12, True), (1e8, False)])
def test_column_parallel_input_gradient_is_charged_beyond_the_weight_pass(peak, c_above_w):
    """e split 4: each device computes a quarter of the output, its input gradient is a partial sum over the 4
    devices, all-reduced (C, the flag-off charge); the weight-gradient pass is W = 2 B S D E / 4 / peak."""
    fc = column_product()
    assert fc.dim_names == ("b", "s", "e", "d")
    lay = one(fc, (1, 1, 4, 1), 4)
    off = operator_cost(fc, lay, machine(4, peak))
    on = operator_cost(fc, lay, machine(4, peak, overlap_dgrad=True))
    W = 2 * B * S * D * E / 4 / peak
    C = allreduce_time(B * S * D * 4, [[4]], machine(4, peak))[0]
    assert off.compute[0] == pytest.approx(3 * W, rel=1e-12)
    assert off.grad_allreduce[0] == pytest.approx(C, rel=1e-12)  # no data split: no weight sync
    assert on.grad_allreduce[0] == pytest.approx(max(C - W, 0.0), rel=1e-12, abs=1e-18)
    assert (C > W) == c_above_w
    if c_above_w:
        assert on.grad_allreduce[0] == pytest.approx(C - W, rel=1e-12)
    else:
        assert on.grad_allreduce[0] == 0.0
    # everything else is untouched
    for name in ("compute", "forward_allreduce", "halo", "stats", "optimizer"):
        assert np.array_equal(getattr(on, name), getattr(off, name)), name


@pytest.mark.parametrize("peak", [1e8, 1.3e10, 1e12])
def test_with_the_weight_sync_overlapped_it_has_only_the_backward_left_after_the_input_gradient(peak):
    """b split 2 and e split 2: the input gradient all-reduced over e (C), the weight gradient over b (S).
    With overlap_grad alone the sync overlaps the backward passes 2W: ``C + max(S - 2W, 0)``; with both flags
    ``max(C - W, 0) + max(S - (2W - min(C, W)), 0)``."""
    fc = column_product()
    lay = one(fc, (2, 1, 2, 1), 4)
    m = machine(4, peak)
    W = 2 * B * S * D * E / 4 / peak
    C = allreduce_time(B / 2 * S * D * 4, [[2]], m)[0]
    Sy = allreduce_time(D * E / 2 * 4, [[2]], m)[0]
    grad_only = operator_cost(fc, lay, replace(m, overlap_grad=True)).grad_allreduce[0]
    both = operator_cost(fc, lay, replace(m, overlap_grad=True, overlap_dgrad=True)).grad_allreduce[0]
    assert grad_only == pytest.approx(C + max(Sy - 2 * W, 0.0), rel=1e-12)
    want = max(C - W, 0.0) + max(Sy - (2 * W - min(C, W)), 0.0)
    assert both == pytest.approx(want, rel=1e-12, abs=1e-18)
    if peak == 1.3e10:  # the case that tells the rules apart: the sync is exposed only because the input took W
        assert Sy < 2 * W < Sy + min(C, W) and C < W
        assert both == pytest.approx(Sy - 2 * W + C, rel=1e-12) and both < grad_only


def test_an_operator_without_a_weight_is_unchanged():
    """The attention scores (two activations, no weight) have no weight-gradient pass to hide behind: every
    layout costs the same with the flag, and lends nothing to its edges."""
    q = TensorRef("q", (2, 4, 16, 8), needs_grad=True)
    k = TensorRef("k", (2, 4, 16, 8), needs_grad=True)
    scores = ops.einsum("scores", "bhsk,bhtk->bhst", q, k)
    m = machine(4, 1e12)
    lays, arr = flat_layouts(scores, 4, cutoff=4)
    off = operator_cost(scores, arr, m)
    on = operator_cost(scores, arr, replace(m, overlap_dgrad=True))
    assert (off.grad_allreduce > 0).any()  # some layouts do reduce an input gradient
    for f in fields(off):
        assert np.array_equal(getattr(off, f.name), getattr(on, f.name)), f.name
    part = LayoutArrays.stack([lay.with_partial() for lay in lays])
    for single, slot in ((True, 0), (False, None)):
        prod, cons = overlap_budgets(scores, part, on.compute, replace(m, overlap_dgrad=True), single, slot,
                                     chunked=False)
        assert (prod == NO_CLAIM).all() and (cons == NO_CLAIM).all()


# -- the edge, where a partial layout leaves the reduction to it ----------------------------------------------------
def _act_fc(peak: float):
    b = GraphBuilder("pair")
    x = b.input("x", (64, 32), needs_grad=True)
    a = b.add(ops.elementwise("act", x))  # dims b, s
    b.add(ops.dense("fc", a, 16))  # dims b, n, c
    return b.build()


@pytest.mark.parametrize("peak", [1e9, 1e11])
def test_a_partial_column_parallel_product_lends_its_weight_pass_to_its_input_edge(peak):
    """act (4,1) -> fc (1,4,1) partial: forward every device gathers the 3/4 of x it misses; backward x's
    gradient, partial over the 4 devices of n, is reduce-scattered into act's quarters (C) beside fc's weight
    pass W = 2 * 64 * 32 * 16 / 4 / peak: the edge costs ``gather + max(C - W, 0)``; the vertices are the
    same with and without the flag (the partial layout left nothing to reduce)."""
    g = _act_fc(peak)
    act, fc = g.operators
    lay = {"act": (Layout.flat(act.dim_names, (4, 1), 4),),
           "fc": (Layout.flat(fc.dim_names, (1, 4, 1), 4).with_partial(),)}
    m = machine(4, peak)
    off = build_tables(g, m, candidates=lambda op: lay[op.name])
    on = build_tables(g, replace(m, overlap_dgrad=True), candidates=lambda op: lay[op.name])
    n = 64 * 32 * 4
    gather = float(p2p_time(3 / 4 * n, m))
    C = reduce_scatter_time(n, [[4]], m)[0]
    W = 2 * 64 * 32 * 16 / 4 / peak
    assert off.edge_costs[0][0, 0] == pytest.approx(gather + C, rel=1e-12)
    assert on.edge_costs[0][0, 0] == pytest.approx(gather + max(C - W, 0.0), rel=1e-12)
    assert (C > W) == (peak == 1e11)
    for a, b in zip(off.op_costs, on.op_costs):
        assert np.array_equal(a.total, b.total)


def test_a_product_that_reduces_its_input_gradient_itself_lends_nothing_to_its_edge():
    """act (1,4) -> fc (2,2,1), not partial: fc all-reduces x's gradient over n itself and hides min(C, W) of
    it; the edge's backward (half of x's rows sent to act's column owners) must not hide behind the same W a
    second time. The partial copy of the same layout lends W to the edge instead (and the vertex keeps C)."""
    peak = 1e11  # W far below the collectives: any second claim on W shows
    g = _act_fc(peak)
    act, fc = g.operators
    m = machine(4, peak)
    W = 2 * 64 * 32 * 16 / 4 / peak
    costs = {}
    for partial in (False, True):
        lay = {"act": (Layout.flat(act.dim_names, (1, 4), 4),),
               "fc": (Layout.flat(fc.dim_names, (2, 2, 1), 4).with_partial(partial),)}
        off = build_tables(g, m, candidates=lambda op: lay[op.name])
        on = build_tables(g, replace(m, overlap_dgrad=True), candidates=lambda op: lay[op.name])
        vertex = off.op_costs[1].grad_allreduce[0] - on.op_costs[1].grad_allreduce[0]
        edge = off.edge_costs[0][0, 0] - on.edge_costs[0][0, 0]
        assert vertex + edge == pytest.approx(W, rel=1e-9)  # W hides exactly once
        costs[partial] = (vertex, edge)
        _, cons = overlap_budgets(fc, on.arrays[1], on.op_costs[1].compute, on.machine, True, 0, chunked=False)
        assert (cons[1, 0] == NO_CLAIM) == (not partial)
        assert cons[0, 0] == NO_CLAIM
    assert costs[False][1] == 0.0 and costs[True][0] == 0.0


# -- exactness: the DP, brute force and the ILP agree with the flag ---------------------------------------------------
@pytest.mark.parametrize("seed", range(6))
def test_dp_bruteforce_and_ilp_agree_with_the_flag_and_it_never_raises_the_optimum(seed):
    rng = np.random.default_rng(100 + seed)
    g = random_product_graph(seed)
    m = Machine(4, peak_flops=float(rng.choice([1e6, 1e7, 1e8])), bandwidth=1e8,
                latency=float(rng.choice([0.0, 1e-6, 1e-4])), dtype_bytes=4, overlap_grad=bool(seed % 2))
    plain = build_tables(g, m, cutoff=2, orders="row-major", partial_sums=True)
    t = build_tables(g, replace(m, overlap_dgrad=True), cutoff=2, orders="row-major", partial_sums=True)
    assert any((b < a * (1 - 1e-9)).any() for a, b in zip(plain.edge_costs, t.edge_costs))  # budgets used
    assert any((b.total < a.total * (1 - 1e-9)).any() for a, b in zip(plain.op_costs, t.op_costs))
    for a, b in zip(plain.edge_costs, t.edge_costs):
        assert (b <= a * (1 + 1e-12)).all()
    dp = exact_solvers_agree(t.to_problem())
    assert dp.cost <= solve_dp(plain.to_problem()).cost * (1 + 1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_no_weight_pass_hides_more_than_itself(seed):
    """Soundness on every layout pair of every edge of a random graph: what the flag takes off a product and off
    its input edge together is at most the product's weight-gradient pass (compute / 3, equal passes); an edge
    into an operator without a weight is unchanged."""
    g = random_product_graph(seed)
    m = Machine(4, peak_flops=1e8, bandwidth=1e8, latency=1e-6, dtype_bytes=4)
    plain = build_tables(g, m, cutoff=2, orders="row-major", partial_sums=True)
    t = build_tables(g, replace(m, overlap_dgrad=True), cutoff=2, orders="row-major", partial_sums=True)
    checked = 0
    for e, a, b in zip(g.edges, plain.edge_costs, t.edge_costs):
        v = e.dst
        if not g.operators[v].weights:  # only a product with a weight lends, only to its input edge
            assert np.array_equal(a, b)
            continue
        W = t.op_costs[v].compute / 3
        vertex = plain.op_costs[v].grad_allreduce - t.op_costs[v].grad_allreduce
        taken = (a - b) + vertex[None, :]
        assert (taken <= W[None, :] * (1 + 1e-9) + 1e-18).all(), g.operators[v].name
        checked += int((a - b > 0).any())
    assert checked > 0


# -- a recipe -------------------------------------------------------------------------------------------------------
SIZES = dict(batch=8, layers=2, d_model=256, heads=4, seq=128, vocab=1024)


def _recipe_pair(sp: bool):
    from shardplan.models.gpt import gpt
    from shardplan.recipe import cost_recipe

    g = gpt(**SIZES, kernels="megatron")
    m = preset("a100", 4)
    sp_text = ",sp=true" if sp else ""
    return (g, m, cost_recipe(g, m, f"tp=4{sp_text},overlap=none"),
            cost_recipe(g, m, f"tp=4{sp_text},overlap=dgrad"))


def test_a_tensor_parallel_recipe_saves_exactly_the_hidden_input_gradient_seconds():
    """tp=4 without sequence parallelism: every column-parallel product (the fused query-key-value product,
    the first feed-forward product, the head) all-reduces its input's gradient itself; the recipe with
    overlap=dgrad is cheaper by the sum of min(C, W) over them: C the flag-off charge (no data parallelism, so
    no weight sync), W the weight pass (the product's compute less its compute with the weights frozen)."""
    g, m, none, dgrad = _recipe_pair(sp=False)
    plan_t = none.detail
    hidden, products = 0.0, set()
    for i, op in enumerate(g.operators):
        k = plan_t.assignment[i]
        arr = plan_t.tables.arrays[i].take([k])
        if not any(w.needs_grad for w in op.weights):
            continue
        frozen = replace(op, weights=tuple(replace(w, needs_grad=False) for w in op.weights))
        C = operator_cost(op, arr, m).grad_allreduce[0]
        W = operator_cost(op, arr, m).compute[0] - operator_cost(frozen, arr, m).compute[0]
        if C > 0:
            products.add(op.name.split("/")[-1])
        hidden += min(C, W)
    assert {"qkv", "ffn1"} <= products
    saved = none.breakdown["grad_allreduce"] - dgrad.breakdown["grad_allreduce"]
    assert saved > 0 and saved == pytest.approx(hidden, rel=1e-9)
    assert none.step_time - dgrad.step_time == pytest.approx(saved, rel=1e-9)
    for part in ("compute", "forward_allreduce", "redistribution", "stats", "optimizer"):
        assert none.breakdown[part] == pytest.approx(dgrad.breakdown[part], rel=1e-12), part


def test_a_sequence_parallel_recipe_hides_the_reduce_scatters_on_the_edges():
    """tp=4, sp=true: the column-parallel products are partial, their input gradients reduce-scattered on the
    edges from the sequence-split norms; with overlap=dgrad each such edge's backward is charged
    max(C - W, 0), W the product's weight-gradient pass (its compute less that of the same product with frozen
    weights): the redistribution falls by their sum."""
    g, m, none, dgrad = _recipe_pair(sp=True)
    assert dgrad.step_time < none.step_time
    assert none.breakdown["grad_allreduce"] == dgrad.breakdown["grad_allreduce"]
    plan_t = dgrad.detail
    tables, a = plan_t.tables, plan_t.assignment
    hidden, lenders = 0.0, 0
    for e in g.edges:
        v = g.operators[e.dst]
        lv = tables.arrays[e.dst].take([a[e.dst]])
        lu = tables.arrays[e.src].take([a[e.src]])
        if not (lv.deferred[0] and any(w.needs_grad for w in v.weights) and v.reduction_dims):
            continue
        if sum(1 for x in g.edges if x.dst == e.dst) != 1:
            continue
        u = g.operators[e.src]
        mm = replace(m, overlap_dgrad=False)
        full = edge_cost(u, lu, v, e.slot, lv, mm)[0, 0]
        no_bwd = edge_cost(u, lu, v, e.slot, lv, mm,
                           hide=(np.full((2, 1), NO_CLAIM), np.array([[NO_CLAIM], [np.inf]])))[0, 0]
        frozen = replace(v, weights=tuple(replace(w, needs_grad=False) for w in v.weights))
        W = operator_cost(v, lv, m).compute[0] - operator_cost(frozen, lv, m).compute[0]  # the weight-gradient pass
        hidden += min(full - no_bwd, W)
        lenders += 1
    assert lenders >= 2 * SIZES["layers"]  # qkv and ffn1 of every layer
    saved = none.breakdown["redistribution"] - dgrad.breakdown["redistribution"]
    assert saved == pytest.approx(hidden, rel=1e-9)
    assert none.step_time - dgrad.step_time == pytest.approx(saved, rel=1e-9)


# -- the machine field ----------------------------------------------------------------------------------------------
def test_a_profile_without_the_field_reads_it_off():
    path = Path(__file__).resolve().parents[2] / "shardplan" / "machines" / "a100-sxm-80gb.json"
    doc = json.loads(path.read_text())
    assert doc["overlap_dgrad"]["value"] is False
    del doc["overlap_dgrad"]
    prof = parse_profile(json.dumps(doc))
    assert prof.values["overlap_dgrad"] is False
    assert prof.sources["overlap_dgrad"] == OPTIONAL_FIELDS["overlap_dgrad"]
    assert prof.machine(4).overlap_dgrad is False


def test_the_flag_is_checked():
    with pytest.raises(ShardplanError, match="overlap_dgrad with scatter_gathered_grads"):
        Machine(4, overlap_dgrad=True, scatter_gathered_grads=True)
    with pytest.raises(ShardplanError, match="overlap_dgrad must be True or False"):
        Machine(4, overlap_dgrad="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("overlap_grad", [False, True])
def test_a_pipeline_stage_amortises_the_same_weight_sync_with_the_flag(overlap_grad):
    """The once-per-step weight sync a pipeline charges 1/m per micro-batch is the flag-off one: the seconds the
    input gradient hides belong to the micro-batch, not to the weights."""
    fc = column_product()
    _, arr = flat_layouts(fc, 4, cutoff=4)
    m = machine(4, 1.3e10, overlap_grad=overlap_grad)
    off = weight_sync(fc, arr, None, m)
    on = weight_sync(fc, arr, None, replace(m, overlap_dgrad=True))
    assert (off > 0).any() and np.array_equal(off, on)
