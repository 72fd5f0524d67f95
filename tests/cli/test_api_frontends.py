"""The frontends refuse what the step cannot run at planning time, and take zero-extent tensors as free.

A loss that is not a real scalar, or integer parameters, made ``jax.value_and_grad`` fail only when the
step first ran; an empty slice concatenated back (recurrentgemma makes a ``(8, 0, 128)`` tensor so) was
refused, in JAX and in PyTorch, though a tensor that holds nothing costs nothing to compute or move.
"""

from __future__ import annotations

import numpy as np
import pytest

from shardplan.errors import ShardplanError
from shardplan.machine import Machine

TOY = Machine(2, peak_flops=32e9, bandwidth=16e9, name="toy")


def _jax():
    import jax
    from conftest import require_8_devices

    return jax, require_8_devices()[:2]


def _mlp_loss(p, b):
    import jax.numpy as jnp

    return jnp.mean((b["x"] @ p["w"]) ** 2)


def _params_batch():
    import jax.numpy as jnp

    return {"w": jnp.ones((16, 16)) / 16}, {"x": jnp.arange(128.0).reshape(8, 16) / 128}


def test_jax_refuses_a_loss_that_is_not_a_scalar():
    jax, devices = _jax()
    import jax.numpy as jnp
    import shardplan.jax as sj

    params, batch = _params_batch()
    with pytest.raises(ShardplanError, match=r"the loss must be a real floating-point scalar \(shape \(\)\), "
                                             r"got shape \(8,\) and dtype float32"):
        sj.parallelize(lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2, axis=1), params, batch, devices=devices,
                       machine=TOY)
    with pytest.raises(ShardplanError, match=r"got shape \(\) and dtype int32"):
        sj.parallelize(lambda p, b: jnp.sum(b["x"] @ p["w"]).astype(jnp.int32), params, batch, devices=devices,
                       machine=TOY)
    with pytest.raises(ShardplanError, match=r"has_aux=True: the loss function must return \(loss, aux\)"):
        sj.parallelize(_mlp_loss, params, batch, devices=devices, machine=TOY, has_aux=True)
    with pytest.raises(ShardplanError, match=r"the loss must be a real floating-point scalar"):
        sj.plan(lambda p, b: (b["x"] @ p["w"]) ** 2, params, batch, devices=devices, machine=TOY)


def test_jax_refuses_integer_parameters():
    jax, devices = _jax()
    import jax.numpy as jnp
    import shardplan.jax as sj

    _, batch = _params_batch()
    params = {"w": jnp.ones((16, 16), jnp.int32)}
    with pytest.raises(ShardplanError, match=r"parameter \['w'\] has dtype int32 \(shape \(16, 16\)\): parameters "
                                             r"must be real floating-point arrays"):
        sj.parallelize(lambda p, b: jnp.mean(b["x"] @ p["w"].astype(jnp.float32)), params, batch, devices=devices,
                       machine=TOY)


def test_jax_refuses_no_devices():
    _jax()
    import shardplan.jax as sj

    params, batch = _params_batch()
    for entry in (sj.parallelize, sj.plan, sj.pipeline, sj.planned):
        with pytest.raises(ShardplanError, match="no devices to plan for"):
            entry(_mlp_loss, params, batch, devices=[])


def _zero_extent_loss(p, b):
    import jax.numpy as jnp

    h = (b["x"] @ p["w"])[:, None, :]  # (8, 1, 16)
    empty = h[:, :0, :]  # (8, 0, 16): an empty slice ...
    h = jnp.concatenate([h, empty * 2.0, h], axis=1)  # ... concatenated back
    return jnp.mean(h ** 2) + jnp.sum(empty)


@pytest.mark.slow
def test_jax_zero_extent_tensor_is_free_and_the_step_is_right():
    jax, devices = _jax()
    import shardplan.jax as sj
    from shardplan.jax.lower import trace

    params, batch = _params_batch()
    graph, _ = trace(_zero_extent_loss, params, batch, params_argnums=(0,))
    assert all(0 not in op.output.shape for op in graph.operators)
    plan, step = sj.parallelize(_zero_extent_loss, params, batch, devices=devices, machine=TOY)
    loss, grads = step(params, batch)
    want_loss, want_grads = jax.value_and_grad(_zero_extent_loss)(params, batch)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grads["w"]), np.asarray(want_grads["w"]), rtol=1e-5)


@pytest.mark.slow
def test_torch_zero_extent_tensor_is_free():
    import torch
    from shardplan.torch.frontend import trace

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(16, 16)

        def forward(self, x):
            h = self.fc(x)  # (8, 4, 16)
            empty = h[:, :0, :]  # (8, 0, 16)
            return (torch.cat([h, empty * 2.0], dim=1) ** 2).mean() + empty.sum()

    graph, _ = trace(Model(), (torch.ones(8, 4, 16),))
    assert all(0 not in op.output.shape for op in graph.operators)
    import shardplan

    plan = shardplan.plan(graph, TOY, fit=False)
    assert np.isfinite(plan.step_time) and plan.step_time > 0
