"""A loss traced in bfloat16 (or with float8 values) is differentiated like the same loss in float32: NumPy does
not count bfloat16 as a float, so a check written with it made every bf16 parameter gradient-free and the
backward pass of a bf16 model uncharged."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from shardplan.jax import trace


def _mlp(p, x):
    h = jnp.tanh(x @ p["w1"])
    return jnp.mean((h.astype(jnp.float32) @ p["w2"].astype(jnp.float32)) ** 2)


def _graph(dtype):
    s = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
    graph, _ = trace(_mlp, {"w1": s(16, 32), "w2": s(32, 8)}, s(4, 16))
    return graph


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_a_16_bit_loss_has_the_gradients_and_saved_tiles_of_the_float32_one(dtype):
    ref, low = _graph(jnp.float32), _graph(dtype)
    assert [o.name for o in low.operators] == [o.name for o in ref.operators]
    grads = lambda g: [(o.name, [t.needs_grad for t in o.inputs + o.weights]) for o in g.operators]  # noqa: E731
    assert grads(low) == grads(ref)
    assert [o.saved for o in low.operators] == [o.saved for o in ref.operators]
    assert any(t.needs_grad for o in low.operators for t in o.weights)  # the weights get gradients
    assert sum(o.saved for o in low.operators) > 0  # and the backward keeps tiles


def test_float8_values_count_as_floats():
    from shardplan.jax.lower import _is_float

    assert _is_float(jnp.bfloat16) and _is_float(jnp.float8_e4m3fn) and _is_float(jnp.float32)
    assert not _is_float(jnp.int32) and not _is_float(jnp.bool_)
