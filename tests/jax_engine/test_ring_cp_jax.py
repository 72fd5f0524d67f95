"""Ring attention on 8 simulated devices (:mod:`shardplan.jax.ring`): ``shard_map`` + ``ppermute``, online
softmax, causal with load-balanced chunks; loss and gradients equal to the unsharded attention, and the work
each device does is what the cost model charges (:func:`shardplan.cost.causal.block_work`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import require_8_devices
from shardplan.cost.causal import block_work
from shardplan.jax.ring import (attention_reference, balanced_positions, device_work, ring_attention,
                                ring_attention_sharded)

pytestmark = pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out

DEVICES = require_8_devices()
B, S, H, D = 2, 64, 2, 8


def _inputs(seed: int = 0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    q, k, v, w = (jax.random.normal(x, (B, S, H, D), jnp.float32) for x in ks)
    return q, k, v, w


@pytest.mark.parametrize("causal, balanced", [(True, True), (True, False), (False, False)])
def test_ring_attention_equals_the_unsharded_loss_and_gradients(causal, balanced):
    mesh = jax.sharding.Mesh(np.asarray(DEVICES), ("cp",))
    q, k, v, w = _inputs()

    def loss(fn, q, k, v):
        return jnp.sum(jnp.tanh(fn(q, k, v)) * w)

    ring = jax.jit(jax.value_and_grad(lambda *a: loss(
        lambda q, k, v: ring_attention(q, k, v, mesh, "cp", causal, balanced), *a), argnums=(0, 1, 2)))
    ref = jax.jit(jax.value_and_grad(lambda *a: loss(
        lambda q, k, v: attention_reference(q, k, v, causal), *a), argnums=(0, 1, 2)))
    (l1, g1), (l0, g0) = ring(q, k, v), ref(q, k, v)
    assert float(l1) == pytest.approx(float(l0), rel=1e-5, abs=1e-5)
    for a, b in zip(g1, g0):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)



@pytest.mark.parametrize("causal", [True, False])
def test_the_compiled_ring_passes_blocks_point_to_point_and_gathers_nothing(causal):
    """On inputs already in the devices' order and split over them, the step (forward and backward) moves the
    keys and values by collective-permutes only: 7 forward steps and their transposes backward."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.sharding.Mesh(np.asarray(DEVICES), ("cp",))
    q, k, v, w = _inputs()
    pos = balanced_positions(S, 8) if causal else None
    split = NamedSharding(mesh, P(None, "cp", None, None))
    args = [jax.device_put(x, split) for x in (q, k, v, w)]
    step = jax.jit(jax.value_and_grad(lambda q, k, v, w: jnp.sum(
        ring_attention_sharded(q, k, v, mesh, "cp", pos) * w), argnums=(0, 1, 2)))
    hlo = step.lower(*args).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo
    assert hlo.count("collective-permute-start") + hlo.count("collective-permute(") >= 7


def test_balanced_chunks_give_every_device_the_same_causal_work_as_the_model_charges():
    pos = balanced_positions(S, 8)
    assert sorted(pos.reshape(-1).tolist()) == list(range(S))
    assert pos[0].tolist() == [0, 1, 2, 3, 60, 61, 62, 63]  # chunks 0 and 15 of 16
    even = device_work(S, 8, True)
    assert (even == even[0]).all() and even.sum() == S * (S + 1) // 2
    tile = (S // 8) * S  # a device's queries against every key
    assert even[0] / tile == pytest.approx(block_work(S, 8, 1, True).max(), rel=1e-12)
    skew = device_work(S, 8, False)
    assert skew.max() / tile == pytest.approx(block_work(S, 8, 1, False).max(), rel=1e-12)
    assert skew.max() > 1.8 * even[0]  # the last contiguous block does almost twice the balanced share


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_the_ring_sends_what_the_model_charges_and_keeps_no_block(kv_heads):
    """The compiled step's exchanges are the model's ring (docs/cost-model.md, "Ring context parallelism"):
    forward g - 1 steps of the key and value blocks, backward g - 1 steps of the blocks with their two
    accumulators and one last hop of the accumulators home, in block units 2(g - 1) + 4(g - 1) + 2. Nothing of
    the forward's exchanges is reused by the backward, so no other device's block is kept: the compiled
    program's temporaries stay below one device's share of the gathered keys and values per saved step."""
    from jax.sharding import Mesh

    from shardplan.jax.hlo import parse_collectives

    g = 8
    mesh = Mesh(np.asarray(DEVICES), ("s",))
    q = jnp.ones((1, 128, 2, 8))
    kv = jnp.ones((1, 128, kv_heads, 8))
    f = jax.jit(jax.grad(lambda q, k, v: jnp.sum(ring_attention_sharded(q, k, v, mesh, "s", balanced_positions(
        128, g)) ** 2), argnums=(0, 1, 2)))
    c = f.lower(q, kv, kv).compile()
    sent = sum(x.sent for x in parse_collectives(c.as_text(), g) if x.kind == "collective-permute")
    block = 128 // g * kv_heads * 8 * 4  # one device's block of keys, fp32
    assert sent == (2 * (g - 1) + 4 * (g - 1) + 2) * block
    # autodiff of the forward loop itself (what the runner did before its custom backward) keeps every step's
    # blocks and probabilities: at least twice the temporaries
    from shardplan.jax.ring import _ring_forward

    def autodiff(q, k, v):
        spec = jax.sharding.PartitionSpec(None, "s", None, None)
        return jax.shard_map(lambda a, b, c: _ring_forward(a, b, c, "s", g, balanced_positions(128, g))[0],
                             mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)(q, k, v)

    old = jax.jit(jax.grad(lambda q, k, v: jnp.sum(autodiff(q, k, v) ** 2), argnums=(0, 1, 2)))
    kept = old.lower(q, kv, kv).compile().memory_analysis().temp_size_in_bytes
    assert 2 * c.memory_analysis().temp_size_in_bytes < kept
