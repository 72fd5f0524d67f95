"""Deferred reductions: partial layouts, their operator and edge costs, Megatron-LM's sequence parallelism.

A partial layout (``Layout.partial``) leaves the operator's split reductions as partial sums; the edge to each
consumer charges the reduction its layout needs (reduce-scatter into a tile split over the group, all-reduce
into a replicated one), and the mirror image backward. The expected numbers are written from the collective
formulas of shardplan.cost.collectives.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from shardplan import ops
from shardplan.configs import forward_deferrable, layouts, with_partial
from shardplan.cost import build_tables, edge_cost
from shardplan.cost.collectives import allgather_time, allreduce_time, p2p_time, reduce_scatter_time
from shardplan.cost.edge import scatters
from shardplan.cost.operator import operator_cost
from shardplan.ir import GraphBuilder, TensorRef
from shardplan.layout import Layout, LayoutArrays
from shardplan.machine import Machine, preset
from shardplan.models import get_model
from shardplan.recipe import megatron_layout
from shardplan.search import solve_dp, solve_ilp

from randgraphs import exact_solvers_agree
from shardplan.baselines import megatron
from shardplan.spmd import plan_from_configs


def machine(p: int, latency: float = 0.0, bandwidth: float = 1e9) -> Machine:
    return Machine(p, peak_flops=1e12, bandwidth=bandwidth, latency=latency, dtype_bytes=4)


def x_ref(shape, grad=True):
    return TensorRef("x", tuple(shape), needs_grad=grad)


def flat(op, config, p):
    return Layout.flat(op.dim_names, config, p)


# -- the layouts --------------------------------------------------------------------------------------------
def test_with_partial_adds_a_copy_of_each_layout_that_splits_a_deferrable_reduction():
    fc = ops.dense("fc", x_ref((64, 32)), 16)  # dims b, n, c: y[b, n] = sum_c x[b, c] W[c, n]
    lays = layouts(fc, (4,), cutoff=1)
    out = with_partial(fc, lays)
    assert out[:len(lays)] == lays
    extra = out[len(lays):]
    # c split: the output is a partial sum; n split: x's gradient is one
    assert {lay.with_partial(False) for lay in extra} == {lay for lay in lays if lay.split[1] > 1 or lay.split[2] > 1}
    assert all(lay.partial for lay in extra) and not any(lay.partial for lay in lays)
    assert flat(fc, (1, 1, 4), 4).with_partial().describe() == "(1,1,4) partial"
    arr = LayoutArrays.stack(out)
    assert arr.deferred.tolist() == [False] * len(lays) + [True] * len(extra)
    assert LayoutArrays.stack(lays).partial is None


def test_normalised_outputs_are_not_deferred_forward():
    sm = ops.softmax("sm", x_ref((8, 16)))
    assert not forward_deferrable(sm)
    assert forward_deferrable(ops.dense("fc", x_ref((64, 32)), 16))


# -- the operator ---------------------------------------------------------------------------------------------
def test_partial_operator_charges_no_forward_and_no_input_gradient_allreduce():
    m = machine(4)
    fc = ops.dense("fc", x_ref((64, 32)), 16)
    both = [flat(fc, (1, 1, 4), 4), flat(fc, (1, 4, 1), 4)]
    arr = LayoutArrays.stack(both + [lay.with_partial() for lay in both])
    c = operator_cost(fc, arr, m)
    n_out = 64 * 16 * 4  # the whole output tile on every device of the c group, bytes
    n_x = 64 * 32 * 4
    assert c.forward_allreduce.tolist() == pytest.approx([allreduce_time(n_out, [[4]], m)[0], 0.0, 0.0, 0.0])
    assert c.grad_allreduce[1] == pytest.approx(allreduce_time(n_x, [[4]], m)[0])
    assert c.grad_allreduce[3] == 0.0
    assert c.compute.tolist() == pytest.approx(np.tile(c.compute[:2], 2).tolist())


# -- the edge ---------------------------------------------------------------------------------------------------
def _pair(u, cu, v, cv, p, partial_u=False, partial_v=False):
    lu = LayoutArrays.stack([flat(u, c, p).with_partial(partial_u) for c in cu])
    lv = LayoutArrays.stack([flat(v, c, p).with_partial(partial_v) for c in cv])
    return lu, lv


@pytest.mark.parametrize("latency", [0.0, 1e-5])
def test_partial_output_is_reduce_scattered_into_a_split_consumer_and_all_reduced_into_a_replicated_one(latency):
    m = machine(4, latency)
    fc = ops.dense("fc", x_ref((64, 32)), 16)  # c split 4 ways: partial sums of y[64, 16]
    act = ops.elementwise("act", fc.out)  # dims (b, n)
    lu, lv = _pair(fc, [(1, 1, 4)], act, [(4, 1), (1, 4), (1, 1)], 4, partial_u=True)
    cost = edge_cost(fc, lu, act, 0, lv, m)
    n = 64 * 16 * 4
    rs = reduce_scatter_time(n, [[4]], m)[0]
    gather = float(p2p_time(3 / 4 * n, m))  # the gradient's way back: each device misses 3/4 of the output tile
    assert cost[0, 0] == pytest.approx(rs + gather)
    assert cost[0, 1] == pytest.approx(rs + gather)
    assert cost[0, 2] == pytest.approx(allreduce_time(n, [[4]], m)[0])
    # the same layouts without the flag: the operator all-reduces, the edge only slices (forward) and gathers back
    plain = edge_cost(fc, lu.without_partial(), act, 0, lv, m)
    assert plain[0].tolist() == pytest.approx([gather, gather, 0.0])


def test_a_scatter_that_leaves_devices_the_wrong_tiles_is_all_reduced_then_moved():
    m = machine(8)
    fc = ops.dense("fc", x_ref((64, 32)), 16)
    act = ops.elementwise("act", fc.out)
    # fc (2,1,4): the c group is 4 devices (q % 4 varies) holding rows of the same b-half; act (4,1) wants its
    # quarter of b on each: the group's 4 devices want 2 different quarters, not 4 distinct pieces of its tile
    lu, lv = _pair(fc, [(2, 1, 4)], act, [(4, 1), (8, 1)], 8, partial_u=True)
    bu = np.asarray([flat(fc, (2, 1, 4), 8).blocks((64, 16, 32))[:, :2]])
    ok = scatters(bu, np.asarray([flat(act, c, 8).blocks((64, 16)) for c in ((4, 1), (8, 1))]), np.asarray([4]))
    assert ok.tolist() == [[[0], [1]]]  # (8,1): a plain reduce-scatter, nothing to gather after it
    cost = edge_cost(fc, lu, act, 0, lv, m)
    plain = edge_cost(fc, lu.without_partial(), act, 0, lv, m)
    n = 32 * 16 * 4  # fc's output tile: half of b
    assert cost[0, 0] == pytest.approx(allreduce_time(n, [[4]], m)[0] + plain[0, 0])
    assert cost[0, 1] == pytest.approx(reduce_scatter_time(n, [[4]], m)[0] + float(p2p_time(3 / 4 * n, m)))


@pytest.mark.parametrize("latency", [0.0, 1e-6])
def test_a_tile_split_over_part_of_the_group_is_reduce_scattered_then_gathered(latency):
    """fc (1,1,8): 8 partial sums of the whole y; act (4,1) (2 copies) wants a quarter of it on each device,
    every quarter on 2 devices: a reduce-scatter among the 8 into eighths, then an all-gather of a quarter
    among each pair (the ring reduce-scatter and all-gather move 7/8 n + 1/8 n, the all-reduce 14/8 n)."""
    m = machine(8, latency)
    fc = ops.dense("fc", x_ref((64, 32)), 16)
    act = ops.elementwise("act", fc.out)
    lu, lv = _pair(fc, [(1, 1, 8)], act, [(4, 1)], 8, partial_u=True)
    bu = np.asarray([flat(fc, (1, 1, 8), 8).blocks((64, 16, 32))[:, :2]])
    sub = scatters(bu, np.asarray([flat(act, (4, 1), 8).blocks((64, 16))]), np.asarray([8]))
    assert sub.tolist() == [[[2]]]
    cost = edge_cost(fc, lu, act, 0, lv, m)
    n = 64 * 16 * 4
    forward = min(reduce_scatter_time(n, [[8]], m)[0] + float(allgather_time(n / 4, [[2]], m)[0]),
                  allreduce_time(n, [[8]], m)[0])
    assert cost[0, 0] == pytest.approx(forward + float(p2p_time(3 / 4 * n, m)))
    if latency == 0.0:
        assert forward == pytest.approx(n / 1e9)  # 7/8 n + 1/8 n over the link, against 14/8 n


def test_partial_input_gradient_is_reduce_scattered_into_the_producer():
    m = machine(4, 1e-6)
    act = ops.elementwise("act", x_ref((64, 32)))  # dims (b, c)
    fc = ops.dense("fc", act.out, 16)  # n split 4: x's gradient is a partial sum over n
    lu, lv = _pair(act, [(4, 1), (1, 1)], fc, [(1, 4, 1)], 4, partial_v=True)
    cost = edge_cost(act, lu, fc, 0, lv, m)
    n = 64 * 32 * 4
    gather = float(p2p_time(3 / 4 * n, m))  # forward: fc needs all of x, each device holds a quarter
    assert cost[0, 0] == pytest.approx(gather + reduce_scatter_time(n, [[4]], m)[0])
    assert cost[1, 0] == pytest.approx(allreduce_time(n, [[4]], m)[0])


def test_weight_edges_ignore_the_flag():
    """A parameter is never a partial sum: a weight edge costs the same whatever the owner's flag (the owner's
    batch split would otherwise read as a split reduction of the parameter's view)."""
    from shardplan.cost.edge import weight_edge_cost

    m = machine(4)
    op = ops.dense("a", x_ref((8, 16)), 16)  # dims b, n, c; W[c, n]
    reader = LayoutArrays.stack([flat(op, (1, 4, 1), 4), flat(op, (1, 1, 4), 4)])
    plain = LayoutArrays.stack([flat(op, (4, 1, 1), 4)])
    part = LayoutArrays.stack([flat(op, (4, 1, 1), 4).with_partial()])
    want = weight_edge_cost(op, 0, plain, op, 0, reader, m)[0]
    assert (want > 0).all()
    assert np.array_equal(weight_edge_cost(op, 0, part, op, 0, reader, m)[0], want)


# -- Megatron-LM's sequence parallelism ------------------------------------------------------------------------
SIZES = {"layers": 2, "d_model": 256, "heads": 8, "vocab": 1024}


def _tp_sp_tables(graph, m, tp):
    levels = tuple(m.levels)

    def candidates(op):
        a, b = megatron_layout(op, levels, 1, tp), megatron_layout(op, levels, 1, tp, sp=True)
        return (a,) if a == b else (a, b)

    return build_tables(graph, replace(m, memory_bytes=None), cutoff=1, candidates=candidates)


def _assignment(tables, sp: bool):
    return [len(lays) - 1 if sp else 0 for lays in tables.layouts]


def test_megatron_sp_costs_tp_minus_its_allreduces_plus_reduce_scatters_and_gathers():
    """Sequence parallelism on a 2-layer GPT, tensor parallel 8: per layer the forward all-reduces of the
    attention output and the second feed-forward product, and the backward all-reduces of the inputs of q, k, v
    and the first feed-forward product, become reduce-scatters into the sequence-split norms and additions; the
    gathers are the redistributions from those into the column-parallel products (forward) and back into the
    row-parallel ones (backward); the embedding (row-parallel over the vocabulary, read by ln1 and add1) and the
    head (column-parallel over it) likewise. The norms and additions compute an eighth of their rows. Each
    deferred reduction is the cheaper of the reduce-scatter and the all-reduce followed by the local slice (on
    a100's links at this size the tree all-reduce's 6 latencies beat the ring reduce-scatter's 7)."""
    m = preset("a100", 8)
    g = get_model("gpt", 2, seq=512, **SIZES)
    t = _tp_sp_tables(g, m, 8)
    tp, sp = _assignment(t, False), _assignment(t, True)
    # the TP layouts are the megatron expert baseline's
    assert list(plan_from_configs(t, megatron(t, 1)).assignment) == tp
    problem = t.to_problem()
    n = 2 * 512 * 256 * m.dtype_bytes  # the activation x[b, s, d]
    ar = allreduce_time(n, [[8]], m)[0]
    rs = reduce_scatter_time(n, [[8]], m)[0]
    gather = float(p2p_time(7 / 8 * n, m))
    red = min(rs, ar)
    names = [op.name for op in g.operators]
    rowpar = [i for i, op in enumerate(g.operators) if op.kind in ("attn_out", "embedding")
              or (op.kind == "ffn" and op.reduction_dims == ("e",))]
    colpar = [i for i, op in enumerate(g.operators) if op.kind == "attn_proj"
              or (op.kind == "ffn" and op.reduction_dims == ("d",)) or op.name == "fc"]
    assert len(rowpar) == 5 and len(colpar) == 9
    seq = [i for i, op in enumerate(g.operators) if op.kind in ("layer_norm", "add")]
    # the operators: the all-reduces leave; the norms' and additions' own costs as the tables give them
    for i in rowpar:
        assert t.op_costs[i].forward_allreduce[tp[i]] == pytest.approx(ar)
        assert t.op_costs[i].forward_allreduce[sp[i]] == 0.0
    for i in colpar:
        assert t.op_costs[i].grad_allreduce[tp[i]] - t.op_costs[i].grad_allreduce[sp[i]] == pytest.approx(ar)
    seq_delta = sum(t.op_costs[i].total[sp[i]] - t.op_costs[i].total[tp[i]] for i in seq)
    assert seq_delta < 0  # an eighth of the rows each
    # the edges: 5 row-parallel outputs feed 6 sequence-split readers (the embedding two), 9 column-parallel
    # products read sequence-split inputs; under TP every one of these edges is free
    n_rs = 0
    for (s, d, mat) in t.all_edges():
        assert mat[tp[s], tp[d]] == 0.0 or (s not in seq and d not in seq)
        if s in rowpar and d in seq:
            assert mat[sp[s], sp[d]] == pytest.approx(red + gather), (names[s], names[d])
            n_rs += 1
        elif s in seq and d in colpar:
            assert mat[sp[s], sp[d]] == pytest.approx(gather + red), (names[s], names[d])
            n_rs += 1
        elif s in seq or d in seq:
            assert mat[sp[s], sp[d]] == 0.0, (names[s], names[d])
    assert n_rs == 6 + 9
    expected = problem.evaluate(tp) - (5 + 9) * ar + 15 * (red + gather) + seq_delta
    assert problem.evaluate(sp) == pytest.approx(expected, rel=1e-12)


BIG = {"layers": 2, "d_model": 1024, "heads": 16, "vocab": 4096, "seq": 2048}


@pytest.mark.parametrize("sizes, latency, pays", [(BIG, None, True), ({**SIZES, "seq": 16}, 1e-4, False)])
def test_the_search_takes_sequence_parallelism_where_it_pays(sizes, latency, pays):
    """Each operator may take its TP or its SP layout: with large activations the exact search defers every
    row-parallel reduction (RS + gather move what a ring all-reduce moves with 8 latencies instead of 14, and
    the norms work on an eighth); with tiny ones on a high-latency link none (a ring reduce-scatter's 7
    latencies plus a gather's one exceed the tree all-reduce's 6)."""
    m = preset("a100", 8)
    if latency is not None:
        m = replace(m, latency=latency)
    g = get_model("gpt", 4, **sizes)
    t = _tp_sp_tables(g, m, 8)
    problem = t.to_problem()
    sol = solve_dp(problem)
    tp_cost, sp_cost = problem.evaluate(_assignment(t, False)), problem.evaluate(_assignment(t, True))
    assert sol.cost <= min(tp_cost, sp_cost) * (1 + 1e-12)
    chosen = [t.layouts[i][k] for i, k in enumerate(sol.assignment)]
    rowpar = [lay for op, lay in zip(g.operators, chosen) if op.kind == "attn_out"]
    if pays:
        assert sp_cost < tp_cost
        assert all(lay.partial for lay in rowpar)
    else:
        assert tp_cost < sp_cost
        assert not any(lay.partial for lay in chosen)
        assert sol.cost == pytest.approx(tp_cost, rel=1e-12)


def test_full_space_with_partial_layouts_never_worse_and_better_on_large_activations():
    m = preset("a100", 8)
    g = get_model("gpt", 4, **BIG)
    costs = {}
    for ps in (False, True):
        t = build_tables(g, m, cutoff=1, orders="row-major", partial_sums=ps)
        sol = solve_dp(t.to_problem())
        costs[ps] = sol.cost
        if ps:
            assert any(t.layouts[i][k].partial for i, k in enumerate(sol.assignment))
    assert costs[True] < costs[False]


# -- exactness: brute force and the ILP agree with the DP --------------------------------------------------------
def _random_graph(seed: int):
    """A small random graph of products, additions and norms over x[8, 8]."""
    rng = np.random.default_rng(seed)
    b = GraphBuilder(f"g{seed}")
    vals = [b.input("x", (8, 8), needs_grad=True)]
    vals.append(b.add(ops.dense("fc", vals[0], 8)))
    for i in range(int(rng.integers(2, 4))):
        kind = int(rng.integers(0, 3))
        a = vals[int(rng.integers(0, len(vals)))]
        if kind == 0:
            vals.append(b.add(ops.dense(f"fc{i}", a, 8)))
        elif kind == 1:
            c = vals[int(rng.integers(0, len(vals)))]
            vals.append(b.add(ops.elementwise(f"add{i}", a, c, kind="add")))
        else:
            vals.append(b.add(ops.layer_norm(f"ln{i}", a)))
    return b.build()


@pytest.mark.parametrize("seed", range(6))
def test_dp_bruteforce_and_ilp_agree_with_partial_layouts(seed):
    g = _random_graph(seed)
    m = machine(4, latency=float(np.random.default_rng(seed).choice([0.0, 1e-6, 1e-4])), bandwidth=1e8)
    t = build_tables(g, m, cutoff=2, orders="row-major", partial_sums=True)
    assert any(lay.partial for lays in t.layouts for lay in lays)
    problem = t.to_problem()
    dp = exact_solvers_agree(problem)
    assert problem.evaluate(dp.assignment) == pytest.approx(dp.cost, rel=1e-12)


# -- the plan value ---------------------------------------------------------------------------------------------
def test_a_plan_with_partial_layouts_round_trips_and_is_rebuilt_from_its_choices():
    from shardplan import Plan
    from shardplan.planner import from_spmd, spmd_of
    from shardplan.spmd import solve_tables

    m = preset("a100", 8)
    g = get_model("gpt", 4, **BIG)
    plan = from_spmd(solve_tables(build_tables(g, m, cutoff=1, orders="row-major", partial_sums=True)))
    assert any(c.layout.partial for c in plan.stages[0].operators.values())
    assert plan.stats["table_options"]["partial_sums"] is True
    q = Plan.from_json(plan.to_json())
    assert q == plan
    assert [c.layout for c in q.stages[0].operators.values()] == [c.layout for c in plan.stages[0].operators.values()]
    rebuilt = spmd_of(replace(q, detail=None), g)  # from the choices alone: the tables rebuilt with partial_sums
    assert rebuilt.cost == pytest.approx(plan.step_time, rel=1e-9)


def test_ilp_agrees_with_the_dp_on_a_gpt_whose_optimum_has_partial_layouts():
    m = preset("a100", 8)
    g = get_model("gpt", 4, **{**BIG, "layers": 1})
    tables = build_tables(g, m, cutoff=1, orders="row-major", partial_sums=True)
    problem = tables.to_problem()
    dp = solve_dp(problem)
    assert any(tables.layouts[i][k].partial for i, k in enumerate(dp.assignment))
    ilp = solve_ilp(problem, time_limit=120)
    assert ilp.optimal and ilp.cost == pytest.approx(dp.cost, rel=1e-6)
