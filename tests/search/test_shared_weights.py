"""A parameter read by several operators (tied embedding / LM head): one copy, a weight edge.

Hand-computed on a tiny tied model: ids (4, 2) -> embedding table W (V=8, D=4) -> LM head
``y[b,s,v] = sum_d x[b,s,d] W[v,d]`` reading the same W; the lookup owns W, the head names it as its
owner. Machine: 2 devices, 1 GB/s, alpha = 0, fp32. Data parallel (batch split 2): W's gradient
(32 elements, 128 bytes) is all-reduced in 2 (g-1)/g * 128 B / 1 GB/s = 128 ns (SYNC): once per
reader as XLA compiles it (the default), once in all with ``sum_shared_grads`` (the head's partial
gradient added to the owner's on the device first); the weight edge costs 0 as the layouts agree.
Memory: W, its gradient and Adam's two moments, 4 * 128 B = 512 B per device, once (on the owner).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from shardplan import ops
from shardplan.baselines import data_parallel
from shardplan.cost import build_tables, operator_cost
from shardplan.cost.edge import weight_edge_cost
from shardplan.cost.memory import operator_memory
from shardplan.errors import ShardplanError
from shardplan.ir import Graph, GraphBuilder, Tensor, WeightEdge
from shardplan.machine import Machine
from shardplan.spmd import plan_from_configs
from shardplan.search import solve_bruteforce, solve_dp, solve_ilp

M = Machine(2, peak_flops=1e12, bandwidth=1e9, sum_shared_grads=True)  # gradients summed, then synchronised once
XLA = Machine(2, peak_flops=1e12, bandwidth=1e9)  # every reader synchronises its own gradient (the default)
V, D = 8, 4
SYNC = 2 * (2 - 1) / 2 * V * D * 4 / 1e9  # one all-reduce of W's gradient among 2 devices
HALF = V * D // 2 * 4 / 1e9  # half of W (16 elements) sent over the link


def tied_graph(tied: bool = True) -> Graph:
    b = GraphBuilder("tied")
    ids = b.input("ids", (4, 2))
    emb = ops.embedding("emb", ids, V, D)
    head = ops.einsum("head", "bsd,vd->bsv", emb.out, ops.Param((V, D)))
    if tied:
        head = dataclasses.replace(head, weights=tuple(dataclasses.replace(w, owner=("emb", "table"))
                                                       for w in head.weights))
    b.add(emb)
    b.add(head)
    return b.build()


def _cfg(op, **split):
    return np.asarray([[split.get(d, 1) for d in op.dim_names]])


def _plan(graph, emb: dict, head: dict, machine: Machine = M):
    tables = build_tables(graph, machine, cutoff=1)
    return plan_from_configs(tables, {"emb": [emb.get(d, 1) for d in graph["emb"].dim_names],
                                      "head": [head.get(d, 1) for d in graph["head"].dim_names]})


def test_the_owner_pays_the_sync_the_reader_nothing_on_its_own():
    g = tied_graph()
    assert g.weight_edges == (WeightEdge(0, 1, 0, 0),)
    assert operator_cost(g["emb"], _cfg(g["emb"], b=2), M).grad_allreduce[0] == pytest.approx(SYNC, abs=1e-18)
    assert operator_cost(g["head"], _cfg(g["head"], b=2), M).grad_allreduce[0] == 0.0
    untied = tied_graph(tied=False)
    assert operator_cost(untied["head"], _cfg(untied["head"], b=2), M).grad_allreduce[0] == pytest.approx(SYNC)


def test_readers_that_agree_sync_once_and_hold_one_copy():
    tied_t = build_tables(tied_graph(), M, cutoff=1)
    tied = plan_from_configs(tied_t, data_parallel(tied_t))
    untied_t = build_tables(tied_graph(tied=False), M, cutoff=1)
    untied = plan_from_configs(untied_t, data_parallel(untied_t))
    assert tied.breakdown["grad_allreduce"] == pytest.approx(SYNC)
    assert tied.breakdown["redistribution"] == 0.0
    assert untied.breakdown["grad_allreduce"] == pytest.approx(2 * SYNC)
    assert tied.memory["weights_bytes"] == pytest.approx(V * D * 4 * (2 + 2))
    assert untied.memory["weights_bytes"] == pytest.approx(2 * V * D * 4 * (2 + 2))
    parts = sum(sum(r["parts"].values()) + r["redistribution_in_seconds"] for r in tied.operators())
    assert tied.cost == pytest.approx(parts)


def test_readers_that_disagree_pay_the_move_and_the_readers_own_sync():
    """The lookup splits the features (W split by columns, no sync); the head is data parallel (W whole,
    partial gradients): the head gathers the half of W it lacks (16 elements) and all-reduces its gradient
    in its layout (SYNC); the owner's half is then in that sum, nothing moves back."""
    p = _plan(tied_graph(), {"d": 2}, {"b": 2})
    assert p.breakdown["grad_allreduce"] == 0.0
    assert p.breakdown["redistribution"] == pytest.approx(HALF + SYNC + HALF)  # + x: emb's output to the head
    row = {r["name"]: r for r in p.operators()}
    assert row["head"]["redistribution_in_seconds"] == pytest.approx(HALF + SYNC + HALF)


def test_weight_edge_matrix_by_hand():
    g = tied_graph()
    emb, head = g["emb"], g["head"]
    cu = np.asarray([[1, 1, 1, 1], [1, 1, 2, 1], [2, 1, 1, 1]])  # emb dims (b, s, d, v): whole, d split, b split
    cv = np.asarray([[2, 1, 1, 1], [1, 1, 1, 2], [1, 1, 2, 1]])  # head dims (b, s, v, d): b split, d split, v split
    secs, sent = weight_edge_cost(emb, 0, cu, head, 0, cv, M)
    want = np.asarray([
        [SYNC, HALF, HALF],         # owner whole, no sync: head DP needs the sum synchronised; split heads
                                    # send back the half of the gradient the owner lacks
        [HALF + SYNC, 0.0, HALF],   # owner split by d: head DP gathers; head by v: a quarter each way
        [0.0, HALF, HALF],          # owner DP (synchronises): head DP agrees
    ])
    np.testing.assert_allclose(secs, want, rtol=1e-12, atol=1e-20)
    assert sent[1, 0] == 16 * 4 + V * D * 4  # gathered half + the head's all-reduce (2 (g-1)/g * 128 B)
    assert sent[2, 0] == 0.0


def test_xla_rule_every_reader_synchronises_its_own_gradient():
    """Default machine (XLA's partitioning: one all-reduce per reader): agreeing readers pay SYNC each and
    the weight edge nothing; disagreeing ones pay their own syncs plus the move of W (and its gradient)."""
    g = tied_graph()
    assert operator_cost(g["head"], _cfg(g["head"], b=2), XLA).grad_allreduce[0] == pytest.approx(SYNC)
    agree = _plan(g, {"b": 2}, {"b": 2}, XLA)
    assert agree.breakdown["grad_allreduce"] == pytest.approx(2 * SYNC)
    assert agree.breakdown["redistribution"] == 0.0
    assert agree.memory["weights_bytes"] == pytest.approx(V * D * 4 * (2 + 2))  # one copy all the same
    differ = _plan(g, {"d": 2}, {"b": 2}, XLA)
    assert differ.breakdown["grad_allreduce"] == pytest.approx(SYNC)  # the head's; the lookup's needs none
    assert differ.breakdown["redistribution"] == pytest.approx(HALF + HALF)  # W's missing half + x
    emb, head = g["emb"], g["head"]
    cu = np.asarray([[1, 1, 1, 1], [1, 1, 2, 1], [2, 1, 1, 1]])
    cv = np.asarray([[2, 1, 1, 1], [1, 1, 1, 2], [1, 1, 2, 1]])
    secs, sent = weight_edge_cost(emb, 0, cu, head, 0, cv, XLA)
    np.testing.assert_allclose(secs, [[0.0, HALF, HALF], [HALF, 0.0, HALF], [0.0, HALF, HALF]], rtol=1e-12,
                               atol=1e-20)
    assert sent[1, 0] == 16 * 4 and sent[0, 0] == 0.0


def test_the_reader_holds_no_state():
    head = tied_graph()["head"]
    w, _ = operator_memory(head, _cfg(head), M)
    assert w.max() == 0.0
    w, _ = operator_memory(tied_graph(tied=False)["head"], _cfg(head), M)
    assert w.max() == V * D * 4 * 4


def test_owner_checks():
    with pytest.raises(ShardplanError, match="only a weight"):
        Tensor("x", (2,), ("a",), "input", owner=("emb", "table"))
    g = tied_graph()
    head = g["head"]

    def with_owner(owner):
        w = dataclasses.replace(head.weights[0], owner=owner)
        return dataclasses.replace(head, weights=(w,))

    with pytest.raises(ShardplanError, match="does not have"):
        Graph("g", (g["emb"], with_owner(("emb", "nope"))), dict(g.graph_inputs))
    with pytest.raises(ShardplanError, match="its own operator"):
        Graph("g", (g["emb"], with_owner(("head", "w"))), dict(g.graph_inputs))
    # a stage's slice without the owner: the reader owns its copy
    alone = Graph("g", (with_owner(("emb", "table")),), {"emb": (4, 2, D)})
    assert alone.weight_edges == () and alone["head"].weights[0].owner is None


def _random_tied_graph(seed: int) -> Graph:
    """A chain of 2-4 small matmuls x[b,i] W[i,o] (square W) where some read an earlier one's W."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 5))
    b = GraphBuilder(f"tied{seed}")
    x = b.input("x", (4, 4))
    made = []
    for i in range(n):
        op = ops.einsum(f"mm{i}", "bi,io->bo", x, ops.Param((4, 4)))
        if made and rng.random() < 0.7:
            owner = made[int(rng.integers(0, len(made)))]
            if owner.weights[0].owner is None:
                op = dataclasses.replace(op, weights=(dataclasses.replace(op.weights[0], owner=(owner.name, "w")),))
        made.append(op)
        x = b.add(op)
    return b.build()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("summed", [False, True])
def test_exact_solvers_agree_with_weight_edges(seed, summed):
    """DP, ILP and brute force find the same optimum of the tied objective; it is the tables' own total."""
    g = _random_tied_graph(seed)
    t = build_tables(g, Machine(4, peak_flops=1e12, bandwidth=1e9, sum_shared_grads=summed), cutoff=1,
                     orders="row-major")
    p = t.to_problem()
    assert len(p.edges) == len(g.edges) + len(g.weight_edges)
    ref = solve_bruteforce(p)
    dp = solve_dp(p)
    ilp = solve_ilp(p, time_limit=60)
    assert dp.cost == pytest.approx(ref.cost, rel=1e-9) and ilp.cost == pytest.approx(ref.cost, rel=1e-9)
    assert t.breakdown(dp.assignment)["total"] == pytest.approx(dp.cost, rel=1e-9)


def test_weight_edges_inside_a_tie_group():
    """Scan-tied readers of one parameter take one layout: the edge's diagonal (0) joins the vertex."""
    g0 = _random_tied_graph(3)
    g = Graph(g0.name, g0.operators, dict(g0.graph_inputs),
              ties=(tuple(op.name for op in g0.operators),))
    t = build_tables(g, Machine(4, peak_flops=1e12, bandwidth=1e9), cutoff=1, orders="row-major")
    from shardplan.search.tie import check_ties, tie

    p = t.to_problem()
    tied, rep = tie(p, check_ties(p.names, g.ties))
    best = min((t.breakdown([k] * len(g))["total"], k) for k in range(len(t.layouts[0])))
    assert solve_dp(tied).cost == pytest.approx(best[0], rel=1e-9)


def test_jax_tied_embedding_has_one_owner():
    import jax.numpy as jnp

    from shardplan.jax import trace

    def loss(p, ids):
        x = p["emb"][ids]  # gather: the first reader, the owner
        return jnp.sum(x @ p["emb"].T + p["b"])

    params = {"emb": jnp.ones((V, D)), "b": jnp.zeros((V,))}
    g, info = trace(loss, params, jnp.zeros((4, 2), jnp.int32))
    readers = [(op, w) for op in g.operators for w in op.weights if w.shape == (V, D)]
    assert [op.kind for op, _ in readers] == ["gather", "einsum"]
    (gather, gw), (_, hw) = readers
    assert gw.owner is None and hw.owner == (gather.name, gw.name)
    assert len(g.weight_edges) == 1
    assert all(w.owner is None for op in g.operators for w in op.weights if w.shape == (V,))
    leaf = next(i for i, n in enumerate(info.leaf_names) if "emb" in str(n))
    assert info.leaf_uses[leaf][0][0] == gather.name  # the leaf takes its owner's layout


def test_torch_tied_embedding_has_one_owner():
    import torch
    from torch import nn

    from shardplan.torch import trace

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(V, D)
            self.head = nn.Linear(D, V, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids):
            return self.head(self.emb(ids)).sum()

    g, _ = trace(Tied(), (torch.zeros(4, 2, dtype=torch.long),))
    readers = [(op, w) for op in g.operators for w in op.weights]
    assert len(readers) == 2
    (first, fw), (_, sw) = readers
    assert fw.owner is None and sw.owner == (first.name, fw.name)
    assert len(g.weight_edges) == 1
