"""A parameter read by several operators (tied embedding / LM head) is synchronised and stored once.

Hand-computed on a tiny tied model: ids (4, 2) -> embedding table W (V=8, D=4) -> LM head
``y[b,s,v] = sum_d x[b,s,d] W[v,d]`` reading the same W. Machine: 2 devices, 1 GB/s, alpha = 0,
fp32. Data parallel (batch split 2): W's gradient (32 elements, 128 bytes) is all-reduced once,
2 (g-1)/g * 128 B / 1 GB/s = 128 ns; the head's x gradient sums over v (not split): no all-reduce.
Memory: W, its gradient and Adam's two moments, 4 * 128 B = 512 B per device, once.
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
    x = b.add(ops.embedding("emb", ids, V, D))
    head = ops.einsum("head", "bsd,vd->bsv", x, ops.Param((V, D)))
    if tied:
        head = dataclasses.replace(head, weights=tuple(dataclasses.replace(w, grad_owner="emb")
                                                       for w in head.weights))
    b.add(head)
    return b.build()


def _dp_plan(graph):
    tables = build_tables(graph, M, cutoff=1)
    return plan_from_configs(tables, data_parallel(tables))


def test_the_owner_alone_pays_the_gradient_sync():
    g = tied_graph()
    dp = {"b": 2}
    for op in g.operators:
        cfg = np.asarray([[dp.get(d, 1) for d in op.dim_names]])
        sync = operator_cost(op, cfg, M).grad_allreduce[0]
        assert sync == pytest.approx(SYNC if op.name == "emb" else 0.0, abs=1e-18)


def test_plan_counts_one_reduction_and_one_copy_of_the_state():
    tied, untied = _dp_plan(tied_graph()), _dp_plan(tied_graph(tied=False))
    assert tied.breakdown["grad_allreduce"] == pytest.approx(SYNC)
    assert untied.breakdown["grad_allreduce"] == pytest.approx(2 * SYNC)  # the over-count this fixes
    assert tied.memory["weights_bytes"] == pytest.approx(V * D * 4 * (2 + 2))
    assert untied.memory["weights_bytes"] == pytest.approx(2 * V * D * 4 * (2 + 2))
    # the objective is still a sum of vertex and edge terms: the plan's cost is the operators' plus the edges'
    parts = sum(sum(r["parts"].values()) + r["redistribution_in_seconds"] for r in tied.operators())
    assert tied.cost == pytest.approx(parts)


def test_non_owner_holds_no_state():
    head = tied_graph()["head"]
    w, _ = operator_memory(head, np.asarray([[1] * len(head.dims)]), M)
    assert w.max() == 0.0
    own = dataclasses.replace(head, weights=tuple(dataclasses.replace(t, grad_owner=None) for t in head.weights))
    w, _ = operator_memory(own, np.asarray([[1] * len(own.dims)]), M)
    assert w.max() == V * D * 4 * 4


def test_only_a_weight_names_an_owner_and_never_itself():
    with pytest.raises(ShardplanError, match="only a weight"):
        Tensor("x", (2,), ("a",), "input", grad_owner="emb")
    head = tied_graph()["head"]
    with pytest.raises(ShardplanError, match="own operator"):
        dataclasses.replace(head, name="emb")


def test_jax_tied_embedding_names_its_owner():
    import jax
    import jax.numpy as jnp

    from shardplan.jax import trace

    def loss(p, ids):
        x = p["emb"][ids]  # gather: the first reader
        return jnp.sum(x @ p["emb"].T + p["b"])

    params = {"emb": jnp.ones((V, D)), "b": jnp.zeros((V,))}
    g, _ = trace(loss, params, jnp.zeros((4, 2), jnp.int32))
    readers = [(op, w) for op in g.operators for w in op.weights if w.shape == (V, D)]
    assert len(readers) == 2
    (first, w0), (second, w1) = readers
    assert first.kind == "gather" and w0.grad_owner is None
    assert w1.grad_owner == first.name
    assert all(w.grad_owner is None for op in g.operators for w in op.weights if w.shape == (V,))
    del jax


def test_torch_tied_embedding_names_its_owner():
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
    assert readers[0][1].grad_owner is None and readers[1][1].grad_owner == readers[0][0].name
