"""Plan and run a 3-layer MLP classifier on 8 (simulated) devices.

    python examples/jax_mlp.py
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

BATCH, D_IN, HIDDEN, CLASSES = 64, 128, 256, 32


def init_params(key: jax.Array) -> dict:
    """Three dense layers with biases (fp32)."""
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "w1": jax.random.normal(k1, (D_IN, HIDDEN)) / D_IN**0.5, "b1": jnp.zeros(HIDDEN),
        "w2": jax.random.normal(k2, (HIDDEN, HIDDEN)) / HIDDEN**0.5, "b2": jnp.zeros(HIDDEN),
        "w3": jax.random.normal(k3, (HIDDEN, CLASSES)) / HIDDEN**0.5,
    }


def make_batch(key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Inputs and one-hot labels."""
    kx, ky = jax.random.split(key)
    x = jax.random.normal(kx, (BATCH, D_IN))
    y = jax.nn.one_hot(jax.random.randint(ky, (BATCH,), 0, CLASSES), CLASSES)
    return x, y


def loss_fn(params: dict, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Mean softmax cross-entropy of relu(relu(x W1 + b1) W2 + b2) W3."""
    x, y = batch
    with jax.named_scope("fc1"):
        h = jax.nn.relu(x @ params["w1"] + params["b1"])
    with jax.named_scope("fc2"):
        h = jax.nn.relu(h @ params["w2"] + params["b2"])
    with jax.named_scope("fc3"):
        logits = h @ params["w3"]
    with jax.named_scope("loss"):
        return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * y, axis=-1))


def main() -> None:
    from _common import run_example

    run_example(loss_fn, init_params, make_batch)


if __name__ == "__main__":
    main()
