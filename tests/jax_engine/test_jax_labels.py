"""Traced operators carry readable dimension labels; data parallelism splits the batch of the inputs."""

from __future__ import annotations

import pytest

import jax
import jax.numpy as jnp
import flax.linen as nn

from shardplan.baselines import batch_dim, data_parallel
from shardplan.cost import build_tables
from shardplan.errors import ShardplanError
from shardplan.ir import Operator, Tensor
from shardplan.jax import report, trace
from shardplan.labels import input_axis_labels, label_dims
from shardplan.machine import Machine
from shardplan.spmd import plan_from_configs
from shardplan.report import plan_to_json, render_strategy
from shardplan.report.text import scope_title

BATCH = 12  # no feature size is 12: a split of extent 12 is a batch split


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(24)(x))
        return nn.Dense(8)(x)


def _mlp_graph():
    x = jnp.ones((BATCH, 16))
    model = _MLP()
    params = model.init(jax.random.PRNGKey(0), x)["params"]

    def loss(p, x):
        scale = jnp.sum(p["Dense_1"]["kernel"] * 2.0)  # an operator that reads only a parameter
        return jnp.mean(model.apply({"params": p}, x)) * scale

    return trace(loss, params, x)[0]


def test_dense_dimensions_are_batch_out_in():
    g = _mlp_graph()
    dense = [op for op in g.operators if op.name.endswith("Dense_0/dot_general")]
    assert len(dense) == 1
    assert dense[0].dims_text == "batch:12 out:24 in:16"
    assert dense[0].name == "_MLP/Dense_0/dot_general"
    # the bias add and the relu fused into it keep the names of the dense output
    add = g["_MLP/Dense_0/add"]
    assert add.dims_text == "batch:12 out:24"


def test_data_parallel_splits_the_batch_whatever_its_letter():
    g = _mlp_graph()
    m = Machine(4, peak_flops=1e12, bandwidth=1e9)
    tables = build_tables(g, m, cutoff=1)
    dp = data_parallel(tables)
    seen_batch = 0
    for op in g.operators:
        split = dict(zip(op.dim_names, dp[op.name]))
        b = batch_dim(op)
        if b is None:  # the parameter-only operator runs replicated
            assert all(c == 1 for c in split.values()), op.name
            continue
        seen_batch += 1
        assert op.dim_label(b) == "batch" and op.extents[b] == BATCH
        assert split[b] == 4 and all(c == 1 for d, c in split.items() if d != b), op.name
    assert seen_batch >= 4
    assert any(batch_dim(op) is None for op in g.operators)
    plan = plan_from_configs(tables, dp, name="dp")
    text = render_strategy(plan)
    assert "batch:12 out:24 in:16" in text
    js = plan_to_json(plan)
    row = next(r for r in js["operators"] if r["name"] == "_MLP/Dense_0/dot_general")
    assert row["dim_labels"] == ["batch", "out", "in"] and row["dims_text"] == "batch:12 out:24 in:16"
    assert any(grp["dims"] == "batch:12 out:24 in:16" for grp in js["groups"])
    line = next(ln for ln in report(plan).splitlines() if "_MLP/Dense_0/dot_general" in ln)
    assert "batch:12 out:24 in:16" in line and "batch:12/4" in line


def test_convolution_and_attention_labels():
    x = jnp.ones((2, 8, 8, 3))
    conv = nn.Conv(4, (3, 3))
    p = conv.init(jax.random.PRNGKey(0), x)["params"]
    g, _ = trace(lambda p, x: jnp.sum(conv.apply({"params": p}, x)), p, x)
    op = next(o for o in g.operators if o.kind == "conv")
    assert op.dims_text == "batch:2 in:3 height:8 width:8 out:4 kh:3 kw:3"

    def attn(p, ids):
        h = p["emb"][ids]  # (batch, seq, embed)
        q = (h @ p["wq"]).reshape(ids.shape + (2, 4))  # heads 2 x head size 4
        s = jnp.einsum("bqhd,bkhd->bhqk", q, q)
        return jnp.sum(jax.nn.softmax(s))

    params = {"emb": jnp.ones((10, 8)), "wq": jnp.ones((8, 8))}
    g, _ = trace(attn, params, jnp.zeros((3, 5), jnp.int32))
    labels = [o.dims_text for o in g.operators]
    assert "batch:3 seq:5 embed:8 vocab:10" in labels  # the lookup
    assert "batch:3 seq:5 out:8 in:8" in labels  # the projection
    assert "batch:3 seq:5 out.0:2 out.1:4" in labels  # the split into heads
    scores = next(o for o in g.operators if o.kind == "einsum" and "heads" in o.dims_text)
    assert scores.dims_text == "batch:3 heads:2 seq:5 seq_2:5 out.1:4"


def test_label_rules_and_validation():
    assert input_axis_labels((4, 7), True, True) == ("batch", "seq")
    assert input_axis_labels((4, 7, 3), True, False) == ("batch", "d1", "d2")
    assert input_axis_labels((4,), False, False) == ("d0",)
    op = Operator("o", "add", (("a", 4), ("c", 6)), (Tensor("x0", (4, 6), ("a", "c"), "input", src="x"),),
                  Tensor("y", (4, 6), ("a", "c"), "output"))
    assert label_dims(op, {"x0": ("batch", "feat")}, {}, None) == {"a": "batch", "c": "feat"}
    assert label_dims(op, {}, {"c": "out"}, "a") == {"a": "batch", "c": "out"}
    assert label_dims(op, {}, {}, None) == {"a": "a", "c": "c"}  # nothing known: the letters
    assert op.dims_text == "ac"  # unlabelled operators keep the Table II letters
    with pytest.raises(ShardplanError, match="labelled dimension"):
        Operator("o", "add", (("a", 4),), (), Tensor("y", (4,), ("a",), "output"), dim_labels={"z": "batch"})


def test_scope_titles_collapse_layer_counters():
    names = ["M/h/0/attn/c_attn/dot_general", "M/h/1/attn/c_attn/dot_general", "M/h/2/attn/c_attn/dot_general"]
    assert scope_title(names) == "M/h/0–2/attn/c_attn/dot_general"
    assert scope_title(["M/h/0/split", "M/h/0/split_2", "M/h/1/split_3"]) == "M/h/0–1/split"
