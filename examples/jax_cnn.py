"""Plan and run a small CNN (NCHW convolutions, max pooling, a dense head) on 8 devices.

    python examples/jax_cnn.py
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

BATCH, CHANNELS, SIZE, CLASSES = 16, 3, 32, 10


def init_params(key: jax.Array) -> dict:
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "conv1": jax.random.normal(k1, (32, CHANNELS, 3, 3)) * (CHANNELS * 9) ** -0.5,
        "bias1": jnp.zeros(32),
        "conv2": jax.random.normal(k2, (64, 32, 3, 3)) * (32 * 9) ** -0.5,
        "dense": jax.random.normal(k3, (64 * 8 * 8, CLASSES)) * (64 * 64) ** -0.5,
    }


def make_batch(key: jax.Array) -> tuple[jax.Array, jax.Array]:
    kx, ky = jax.random.split(key)
    x = jax.random.normal(kx, (BATCH, CHANNELS, SIZE, SIZE))
    y = jax.nn.one_hot(jax.random.randint(ky, (BATCH,), 0, CLASSES), CLASSES)
    return x, y


def conv(x: jax.Array, w: jax.Array) -> jax.Array:
    return jax.lax.conv_general_dilated(x, w, (1, 1), ((1, 1), (1, 1)), dimension_numbers=("NCHW", "OIHW", "NCHW"))


def max_pool(x: jax.Array) -> jax.Array:
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")


def loss_fn(params: dict, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    x, y = batch
    with jax.named_scope("conv1"):
        h = max_pool(jax.nn.relu(conv(x, params["conv1"]) + params["bias1"][None, :, None, None]))
    with jax.named_scope("conv2"):
        h = max_pool(jax.nn.relu(conv(h, params["conv2"])))
    with jax.named_scope("head"):
        logits = h.reshape(h.shape[0], -1) @ params["dense"]
        return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * y, axis=-1))


def main() -> None:
    from _common import run_example

    run_example(loss_fn, init_params, make_batch)


if __name__ == "__main__":
    main()
