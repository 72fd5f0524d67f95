"""A one-layer attention written with ``jax.nn.dot_product_attention`` (grouped-query, causal), shared by
test_jax_attention.py (its description) and test_ring_plan_jax.py (its planned ring run)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from shardplan.machine import Machine

TOY = Machine(8, peak_flops=32e9, bandwidth=16e9, name="toy")  # slow compute, fast links: splitting pays
B, S, D, N, K = 1, 128, 32, 4, 2  # batch, sequence, width, query heads, key/value heads
H = D // N


def attention_loss(params, batch, causal: bool = True, reduce: bool = True, **kw):
    """q, k, v projections, ``jax.nn.dot_product_attention``, an output projection and a tanh; the loss a
    weighted sum (``reduce=False``: the layer's output)."""
    x, w = batch
    b, s, _ = x.shape
    q = (x @ params["q"]).reshape(b, s, N, H)
    k, v = ((x @ params[n]).reshape(b, s, K, H) for n in ("k", "v"))
    y = jnp.tanh(jax.nn.dot_product_attention(q, k, v, is_causal=causal, **kw).reshape(b, s, D) @ params["o"])
    return jnp.sum(y * w) if reduce else y


def inputs(seq: int = S):
    ks = jax.random.split(jax.random.PRNGKey(0), 6)
    params = {"q": jax.random.normal(ks[0], (D, D)) / 6, "k": jax.random.normal(ks[1], (D, K * H)) / 6,
              "v": jax.random.normal(ks[2], (D, K * H)) / 6, "o": jax.random.normal(ks[3], (D, D)) / 6}
    return params, (jax.random.normal(ks[4], (B, seq, D)), jax.random.normal(ks[5], (B, seq, D)))
