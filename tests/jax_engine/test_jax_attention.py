"""``jax.nn.dot_product_attention`` in a traced program is one fused attention operator, described exactly as
:func:`shardplan.ops.flash_attention` describes it (:mod:`shardplan.jax.attention`), so tables built with
``context="ring"`` offer the ring for it; calls with a mask or a scale of their own stay products and a
softmax. Tracing and planning only (no compilation)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from jax_attention_cases import B, D, H, K, N, S, TOY, attention_loss, inputs
from shardplan import ops
from shardplan.ir import TensorRef
from shardplan.jax.lower import trace


def _attention_ops(graph):
    return [op for op in graph.operators if op.kind == "attn_flash"]


@pytest.mark.parametrize("causal", [True, False])
def test_the_traced_attention_is_the_zoo_operator(causal):
    params, batch = inputs()
    graph, info = trace(functools.partial(attention_loss, causal=causal), params, batch)
    (op,) = _attention_ops(graph)
    zoo = ops.flash_attention("attn", TensorRef("q", (B, S, K, N // K, H)), TensorRef("k", (B, S, K, H)),
                              TensorRef("v", (B, S, K, H)), "bshrk", "bthk", causal=causal,
                              dealt=True)  # the runners deal the sequence at the attention for the ring
    for field in ("kind", "dims", "flops_per_point", "backward_flops", "saved", "causal", "norm_dims", "norm_stats"):
        assert getattr(op, field) == getattr(zoo, field), field
    assert op.fixed == zoo.fixed | {"r"}  # the query heads are one axis (h, r): a split takes whole groups
    assert op.saved == 1.0 + 2.0 / H  # the output and one fp32 log-sum-exp per row of H two-byte features
    assert [t.src for t in op.inputs] == ["reshape", "reshape_2", "reshape_3"]  # q, k, v by their producers
    assert [str(a.dim) + "".join(a.inner) for a in op.inputs[0].axes] == ["b", "s", "hr", "k"]  # merged heads
    assert not info.conservative
    # no unfused product of q and k remains: the only einsums are the four projections
    assert sum(o.kind == "einsum" for o in graph.operators) == 4


def test_a_mask_or_another_scale_keeps_the_products():
    params, batch = inputs()
    mask = jnp.tril(jnp.ones((S, S), bool))[None, None]
    for kw in ({"mask": mask, "causal": False}, {"scale": 0.5}):
        graph, _ = trace(functools.partial(attention_loss, **kw), params, batch)
        assert not _attention_ops(graph) and sum(o.kind == "einsum" for o in graph.operators) == 6


def test_two_calls_in_a_row_are_two_operators():
    params, batch = inputs(32)

    def twice(p, b):
        x, w = b
        q = (x @ p["q"]).reshape(1, 32, N, H)
        y = jax.nn.dot_product_attention(q, q, q, is_causal=True)
        z = jax.nn.dot_product_attention(y, y, y)
        return jnp.sum(z.reshape(1, 32, D) * w)

    graph, _ = trace(twice, params, batch)
    a, b = _attention_ops(graph)
    assert (a.causal is not None, b.causal is None) == (True, True)
    assert [t.src for t in b.inputs] == [a.name] * 3


def test_the_ring_is_chosen_where_it_pays_and_run_where_the_tables_charge_it():
    """On the toy machine the ring plan splits the attention's queries 8 ways, below the gather plan's step time;
    the step runs the ring (one replaced equation, keys and values read split) for tables built with
    ``context="ring"`` or ``"auto"``, where the chosen layouts' edges hold the ring's seconds, and not for the
    all-gather's, whose step runs the balanced all-gather instead (one replaced equation, keys and values read
    split as their producers leave them and gathered inside, their gradients reduce-scattered:
    :func:`shardplan.jax.ring.gather_apply`), the deal charged below the contiguous blocks' extra work
    (:func:`shardplan.cost.ring.deals_gathered`)."""
    import shardplan.jax as sj
    from shardplan.cost.ring import deals_gathered
    from shardplan.jax.run import gather_scatters, ring_charged, ring_hooks
    from shardplan.planner import spmd_of

    params, batch = inputs()
    devices = jax.devices()[:8]
    graph, info = trace(attention_loss, params, batch)
    plans = {c: sj.plan(attention_loss, params, batch, devices, TOY, context=c) for c in ("ring", "auto", "allgather")}
    (name,) = [n for n, c in plans["ring"].operators.items() if c.kind == "attn_flash"]
    assert plans["ring"].operators[name].layout.split[1] == 8  # the query sequence split 8 ways
    assert plans["ring"].step_time == plans["auto"].step_time < plans["allgather"].step_time
    for context, plan in plans.items():
        sp = spmd_of(plan, graph)
        consume, replace = ring_hooks(sp, info, devices)
        assert (len(consume), len(replace)) == (2, 1), context  # keys and values read split either way
        assert ring_charged(sp, name) == (context != "allgather"), context
        if context == "allgather":  # gathered inside the step, their gradients reduce-scattered as charged
            assert gather_scatters(sp, name) == (True, True)
        assert deals_gathered(sp.graph[name], sp.layouts[name], sp.machine), context
