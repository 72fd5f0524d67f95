"""A parameter read by several operators (tied embedding / LM head) is synchronised and stored once.

Hand-computed on a tiny tied model: ids (4, 2) -> embedding table W (V=8, D=4) -> LM head
``y[b,s,v] = sum_d x[b,s,d] W[v,d]`` reading the same W. Machine: 2 devices, 1 GB/s, alpha = 0,
fp32. Data parallel (batch split 2): W's gradient (32 elements, 128 bytes) is all-reduced once,
2 (g-1)/g * 128 B / 1 GB/s = 128 ns, charged half to each of the two readers; the head's x gradient
sums over v (not split): no all-reduce. Memory: W, its gradient and Adam's two moments,
4 * 128 B = 512 B per device, once (half to each reader).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from shardplan import ops
from shardplan.baselines import data_parallel
from shardplan.cost import build_tables, operator_cost
from shardplan.cost.memory import operator_memory
from shardplan.errors import ShardplanError
from shardplan.ir import GraphBuilder, Tensor
from shardplan.machine import Machine
from shardplan.plan import plan_from_configs

M = Machine(2, peak_flops=1e12, bandwidth=1e9)
V, D = 8, 4
SYNC = 2 * (2 - 1) / 2 * V * D * 4 / 1e9  # one all-reduce of W's gradient among 2 devices


def tied_graph(tied: bool = True):
    b = GraphBuilder("tied")
    ids = b.input("ids", (4, 2))
    x = ops.embedding("emb", ids, V, D).out
    head = ops.einsum("head", "bsd,vd->bsv", x, ops.Param((V, D)))
    emb = ops.embedding("emb", ids, V, D)
    if tied:
        head = dataclasses.replace(head, weights=tuple(dataclasses.replace(w, shared=2) for w in head.weights))
        emb = dataclasses.replace(emb, weights=tuple(dataclasses.replace(w, shared=2) for w in emb.weights))
    b.add(emb)
    b.add(head)
    return b.build()


def _dp_plan(graph):
    tables = build_tables(graph, M, cutoff=1)
    return plan_from_configs(tables, data_parallel(tables))


def _cfg(op, **split):
    return np.asarray([[split.get(d, 1) for d in op.dim_names]])


def test_each_reader_pays_its_share_of_the_gradient_sync():
    for op in tied_graph().operators:
        assert operator_cost(op, _cfg(op, b=2), M).grad_allreduce[0] == pytest.approx(SYNC / 2, abs=1e-18)
    for op in tied_graph(tied=False).operators:
        assert operator_cost(op, _cfg(op, b=2), M).grad_allreduce[0] == pytest.approx(SYNC, abs=1e-18)


def test_readers_that_disagree_pay_the_mean():
    """The documented approximation: the embedding splits the features (its table gradient needs no
    all-reduce), the head is data parallel (it needs one): charged the mean, SYNC / 2."""
    g = tied_graph()
    emb, head = g["emb"], g["head"]
    t = operator_cost(emb, _cfg(emb, d=2), M).grad_allreduce[0] + operator_cost(head, _cfg(head, b=2), M).grad_allreduce[0]
    assert t == pytest.approx(SYNC / 2, abs=1e-18)


def test_plan_counts_one_reduction_and_one_copy_of_the_state():
    tied, untied = _dp_plan(tied_graph()), _dp_plan(tied_graph(tied=False))
    assert tied.breakdown["grad_allreduce"] == pytest.approx(SYNC)
    assert untied.breakdown["grad_allreduce"] == pytest.approx(2 * SYNC)  # the over-count this fixes
    assert tied.memory["weights_bytes"] == pytest.approx(V * D * 4 * (2 + 2))
    assert untied.memory["weights_bytes"] == pytest.approx(2 * V * D * 4 * (2 + 2))
    # the objective is still a sum of vertex and edge terms: the plan's cost is the operators' plus the edges'
    parts = sum(sum(r["parts"].values()) + r["redistribution_in_seconds"] for r in tied.operators())
    assert tied.cost == pytest.approx(parts)


def test_each_reader_holds_its_share_of_the_state():
    head = tied_graph()["head"]
    w, _ = operator_memory(head, _cfg(head), M)
    assert w.max() == V * D * 4 * 4 / 2
    w, _ = operator_memory(tied_graph(tied=False)["head"], _cfg(head), M)
    assert w.max() == V * D * 4 * 4


def test_only_a_weight_is_shared():
    with pytest.raises(ShardplanError, match="only a weight"):
        Tensor("x", (2,), ("a",), "input", shared=2)
    with pytest.raises(ShardplanError, match="shared=0"):
        Tensor("w", (2,), ("a",), "weight", shared=0)


def test_jax_tied_embedding_is_shared_by_its_readers():
    import jax
    import jax.numpy as jnp

    from shardplan.jax import trace

    def loss(p, ids):
        x = p["emb"][ids]  # gather: the first reader
        return jnp.sum(x @ p["emb"].T + p["b"])

    params = {"emb": jnp.ones((V, D)), "b": jnp.zeros((V,))}
    g, _ = trace(loss, params, jnp.zeros((4, 2), jnp.int32))
    readers = [(op, w) for op in g.operators for w in op.weights if w.shape == (V, D)]
    assert [op.kind for op, _ in readers] == ["gather", "einsum"]
    assert [w.shared for _, w in readers] == [2, 2]
    assert all(w.shared == 1 for op in g.operators for w in op.weights if w.shape == (V,))
    del jax


def test_torch_tied_embedding_is_shared_by_its_readers():
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
    assert [w.shared for _, w in readers] == [2, 2]
