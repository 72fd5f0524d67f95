"""The staged program on 8 simulated devices equals the unsharded one (loss and gradients)."""

from __future__ import annotations

import numpy as np
import pytest

import jax

from shardplan.errors import ShardplanError  # noqa: E402
from shardplan.pipeline.jax import pipeline_forward, stack_stages  # noqa: E402


def _layer(p, x):
    import jax.numpy as jnp

    return jnp.tanh(x @ p["w"] + p["b"]) + x


def _setup(layers: int, m: int, mb: int, d: int):
    rng = np.random.default_rng(0)
    params = [{"w": rng.normal(size=(d, d)).astype(np.float32) / np.sqrt(d),
               "b": rng.normal(size=(d,)).astype(np.float32) * 0.1} for _ in range(layers)]
    xs = rng.normal(size=(m, mb, d)).astype(np.float32)
    ys = rng.normal(size=(m, mb, d)).astype(np.float32)
    return params, xs, ys


@pytest.mark.parametrize("stages,data", [(4, 2), (8, 1)])
def test_pipeline_equals_unsharded(stages, data):
    import jax.numpy as jnp
    from jax.sharding import Mesh

    if len(jax.devices()) < 8:
        pytest.fail("conftest sets 8 simulated CPU devices; got fewer")
    params, xs, ys = _setup(8, 4, 4, 16)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(stages, data), ("stage", "data"))

    def loss_ref(ps):
        h = xs.reshape(-1, xs.shape[-1])
        for p in ps:
            h = _layer(p, h)
        return jnp.mean((h - ys.reshape(h.shape)) ** 2)

    def loss_pipe(stacked):
        out = pipeline_forward(_layer, stacked, xs, mesh, "stage", "data" if data > 1 else None)
        return jnp.mean((out - ys) ** 2)

    ref_l, ref_g = jax.value_and_grad(loss_ref)(params)
    stacked = stack_stages(params, stages)
    pipe_l, pipe_g = jax.jit(jax.value_and_grad(loss_pipe))(stacked)
    assert abs(float(pipe_l) - float(ref_l)) <= 1e-5 * abs(float(ref_l))
    want = stack_stages(ref_g, stages)
    for k in ("w", "b"):
        scale = float(np.abs(want[k]).max())
        assert float(np.abs(np.asarray(pipe_g[k]) - np.asarray(want[k])).max()) <= 1e-4 * scale


def test_uneven_stages_refused():
    params, _, _ = _setup(6, 1, 1, 4)
    with pytest.raises(ShardplanError, match="equal stages"):
        stack_stages(params, 4)
