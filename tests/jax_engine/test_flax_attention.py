"""Flax's attention (``nn.SelfAttention``, ``nnx.MultiHeadAttention``) and 3-D ``jax.nn.dot_product_attention``
in a traced program are fused attention operators (:mod:`shardplan.jax.attention`), causal where the mask is
the lower triangle by value; any other mask, dropout or a bfloat16 softmax keeps the products and the
softmax. Tracing only (no compilation); the runs are in test_flax_attention_run.py."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax_attention_cases import NH, D, S, linen_lm, nnx_lm

from shardplan import ops
from shardplan.ir import TensorRef
from shardplan.jax.attention import _is_lower_triangle
from shardplan.jax.lower import trace

BUILD = {"linen": linen_lm, "nnx": nnx_lm}
MAKE_MASK = {"linen": (nn.make_attention_mask, nn.combine_masks, nn.make_causal_mask),
             "nnx": (nnx.make_attention_mask, nnx.combine_masks, nnx.make_causal_mask)}
EINSUMS = 13  # per LM: q, k, v, out and the MLP's two per block (2 blocks), the tied head: no attention product


def _traced(build, **kw):
    loss, params, batch = build(**kw)
    return trace(loss, params, batch)


def _attention(graph):
    return [op for op in graph.operators if op.kind == "attn_flash"]


def _count(graph, kind):
    return sum(op.kind == kind for op in graph.operators)


@pytest.mark.parametrize("lib", ["linen", "nnx"])
def test_the_causal_lm_has_two_fused_causal_attentions(lib):
    """Each block's attention is one operator as :func:`shardplan.ops.flash_attention` describes it, causal:
    no product of queries and keys, no softmax left (the one ``reduce_max`` is the loss's log-softmax)."""
    graph, info = _traced(BUILD[lib])
    attn = _attention(graph)
    assert len(attn) == 2 and not info.conservative
    zoo = ops.flash_attention("attn", TensorRef("q", (2, S, NH, D // NH)), TensorRef("k", (2, S, NH, D // NH)),
                              TensorRef("v", (2, S, NH, D // NH)), "bshk", "bthk", causal=True,
                              dealt=True)  # the runners deal the sequence at the attention for the ring
    for op in attn:
        for field in ("dims", "flops_per_point", "backward_flops", "causal", "norm_dims", "norm_stats", "fixed"):
            assert getattr(op, field) == getattr(zoo, field), field
    assert _count(graph, "einsum") == EINSUMS and _count(graph, "reduce_max") == 1


@pytest.mark.parametrize("lib", ["linen", "nnx"])
def test_masks_that_are_not_the_lower_triangle_keep_the_products(lib):
    """A padding mask read from the input, the causal mask combined with it, the upper triangle (computed
    from iota), the lower triangle with one entry flipped (a constant) and the strict lower triangle are no
    causal attention: two products and a softmax per block remain, and nothing is conservative. The exact
    lower triangle as a constant of the program is recognised."""
    attention_mask, combine, causal = MAKE_MASK[lib]
    flipped = np.tril(np.ones((S, S), bool))
    flipped[S - 1, 0] = False
    masks = {"padding": lambda ids: attention_mask(ids > 0, ids > 0),
             "causal and padding": lambda ids: combine(causal(ids), attention_mask(ids > 0, ids > 0)),
             "upper": lambda ids: jnp.broadcast_to(jnp.triu(jnp.ones((S, S), bool)), (ids.shape[0], 1, S, S)),
             "flipped": lambda ids: jnp.asarray(flipped)[None, None],
             "strict": lambda ids: jnp.asarray(np.tril(np.ones((S, S), bool), -1))[None, None]}
    for what, mask in masks.items():
        graph, info = _traced(BUILD[lib], mask=mask)
        assert not _attention(graph) and _count(graph, "einsum") == EINSUMS + 4 and not info.conservative, what
    graph, _ = _traced(BUILD[lib], mask=lambda ids: jnp.asarray(np.tril(np.ones((S, S), bool)))[None, None])
    assert [op.causal is not None for op in _attention(graph)] == [True, True]


def test_linen_without_a_mask_is_plain_attention_and_dropout_or_bfloat16_are_not_matched():
    """No mask: fused and not causal. Dropout that runs (``deterministic=False``) or a bfloat16 computation
    (whose softmax flax runs in bfloat16, JAX's in float32) stay products and a softmax; a dropout rate
    under ``deterministic=True`` adds no equation and is fused."""
    graph, _ = _traced(linen_lm, mask=lambda ids: None)
    assert [op.causal for op in _attention(graph)] == [None, None]
    for kw in ({"dropout_rate": 0.1, "deterministic": False}, {"dtype": jnp.bfloat16}):
        graph, info = _traced(linen_lm, **kw)
        assert not _attention(graph) and _count(graph, "einsum") == EINSUMS + 4 and not info.conservative, kw
    graph, _ = _traced(linen_lm, dropout_rate=0.1)
    assert len(_attention(graph)) == 2


def three_d_loss(params, batch, causal=True):
    """``jax.nn.dot_product_attention`` on ``(T, N, H)`` operands (no batch axis), between projections."""
    x, w = batch
    q, k, v = ((x @ params[n]).reshape(x.shape[0], NH, D // NH) for n in "qkv")
    y = jax.nn.dot_product_attention(q, k, v, is_causal=causal).reshape(x.shape[0], D) @ params["o"]
    return jnp.sum(jnp.tanh(y) * w)


def three_d_inputs(seq=128):
    ks = jax.random.split(jax.random.PRNGKey(0), 6)
    params = {n: jax.random.normal(kk, (D, D)) / 6 for n, kk in zip("qkvo", ks)}
    return params, (jax.random.normal(ks[4], (seq, D)), jax.random.normal(ks[5], (seq, D)))


@pytest.mark.parametrize("causal", [True, False])
def test_three_d_operands_are_attention_with_a_batch_of_one(causal):
    """The operands get a leading axis of 1, as ``jax.nn.dot_product_attention`` gives them itself.
    Traced with no batch argument (the unit axis is no data batch: not named ``b``); with the default (the leading axis of ``x``, here the sequence, is the
    data batch) the queries' sequence dimension is that batch ``b`` and the new axis another letter, the
    causal mask renamed with it."""
    graph, info = trace(lambda p, b: three_d_loss(p, b, causal), *three_d_inputs(S), batch_argnums=())
    (op,) = _attention(graph)
    assert op.dims[1:] == (("s", S), ("h", NH), ("k", D // NH), ("t", S)) and op.dims[0][1] == 1  # no data batch
    assert (op.causal is not None) == causal and _count(graph, "einsum") == 4 and not info.conservative
    graph, _ = trace(lambda p, b: three_d_loss(p, b, causal), *three_d_inputs(S))
    (op,) = _attention(graph)
    assert dict(op.dims)["b"] == S and op.dims[0][1] == 1
    assert op.causal is None or (op.causal.query, op.causal.key) == ("b", "t")


def test_the_lower_triangle_test():
    tri = np.tril(np.ones((4, 4)))
    assert _is_lower_triangle(tri, 4, 4) and _is_lower_triangle(np.broadcast_to(tri.astype(bool), (3, 2, 4, 4)), 4, 4)
    assert not _is_lower_triangle(tri.T, 4, 4) and not _is_lower_triangle(tri[:, :3], 4, 3)
    assert not _is_lower_triangle(np.ones((4, 1)), 4, 4) and not _is_lower_triangle(tri[None], 4, 5)
    two = np.stack([tri, tri])
    two[1, 3, 0] = 0
    assert not _is_lower_triangle(two, 4, 4)  # every slice, not only the first


def test_nnx_weights_path_is_matched_without_a_mask_only():
    """``nnx.dot_product_attention`` with a dropout rate (not running: ``deterministic=True``) takes nnx's own
    weights path: without a mask its equations are linen's (fused), with the causal mask it converts the mask
    to float first, which no reference does (products and softmax, not conservative)."""
    params, batch = three_d_inputs(S)

    def loss(p, b, mask):
        x = jnp.stack([b[0], b[1]])  # (2, S, D)
        q, k, v = ((x @ p[n]).reshape(2, S, NH, D // NH) for n in "qkv")
        m = jnp.asarray(np.tril(np.ones((S, S), bool)))[None, None] if mask else None
        return jnp.sum(nnx.dot_product_attention(q, k, v, mask=m, dropout_rate=0.1, deterministic=True))

    graph, _ = trace(lambda p, b: loss(p, b, False), params, batch)
    assert [op.causal for op in _attention(graph)] == [None]
    graph, info = trace(lambda p, b: loss(p, b, True), params, batch)
    assert not _attention(graph) and _count(graph, "einsum") == 5 and not info.conservative
