"""Plan and run a two-layer transformer (attention + feed-forward + layer norm per layer) on 8 devices.

    python examples/jax_transformer.py
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

BATCH, SEQ, HEADS, HEAD_DIM, FFN, LAYERS = 16, 32, 8, 16, 512, 2
D_MODEL = HEADS * HEAD_DIM

# Megatron-LM layout: which axis of each weight is split over the devices.
MEGATRON_WEIGHT_AXES = {"wq": 1, "wk": 1, "wv": 1, "wo": 0, "w1": 1, "w2": 0}


def init_params(key: jax.Array) -> list[dict]:
    """Per layer: Q/K/V (D, H, Dh), output (H, Dh, D), FFN (D, F), (F, D), two layer norms."""
    layers = []
    for k in jax.random.split(key, LAYERS):
        kq, kk, kv, ko, k1, k2 = jax.random.split(k, 6)
        s = D_MODEL**-0.5
        layers.append({
            "wq": jax.random.normal(kq, (D_MODEL, HEADS, HEAD_DIM)) * s,
            "wk": jax.random.normal(kk, (D_MODEL, HEADS, HEAD_DIM)) * s,
            "wv": jax.random.normal(kv, (D_MODEL, HEADS, HEAD_DIM)) * s,
            "wo": jax.random.normal(ko, (HEADS, HEAD_DIM, D_MODEL)) * s,
            "w1": jax.random.normal(k1, (D_MODEL, FFN)) * s,
            "w2": jax.random.normal(k2, (FFN, D_MODEL)) * FFN**-0.5,
            "ln1_g": jnp.ones(D_MODEL), "ln1_b": jnp.zeros(D_MODEL),
            "ln2_g": jnp.ones(D_MODEL), "ln2_b": jnp.zeros(D_MODEL),
        })
    return layers


def make_batch(key: jax.Array) -> tuple[jax.Array, jax.Array]:
    kx, ky = jax.random.split(key)
    return jax.random.normal(kx, (BATCH, SEQ, D_MODEL)), jax.random.normal(ky, (BATCH, SEQ, D_MODEL))


def layer_norm(x: jax.Array, g: jax.Array, b: jax.Array) -> jax.Array:
    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mu), axis=-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + 1e-5) * g + b


def block(p: dict, x: jax.Array) -> jax.Array:
    """Pre-norm block: x + attn(ln1(x)); then + ffn(ln2(.))."""
    with jax.named_scope("attn"):
        h = layer_norm(x, p["ln1_g"], p["ln1_b"])
        q = jnp.einsum("bsd,dhk->bshk", h, p["wq"])
        k = jnp.einsum("bsd,dhk->bshk", h, p["wk"])
        v = jnp.einsum("bsd,dhk->bshk", h, p["wv"])
        scores = jnp.einsum("bshk,bthk->bhst", q, k) * HEAD_DIM**-0.5
        att = jax.nn.softmax(scores, axis=-1)
        o = jnp.einsum("bhst,bthk->bshk", att, v)
        x = x + jnp.einsum("bshk,hkd->bsd", o, p["wo"])
    with jax.named_scope("ffn"):
        h = layer_norm(x, p["ln2_g"], p["ln2_b"])
        x = x + jax.nn.gelu(h @ p["w1"]) @ p["w2"]
    return x


def loss_fn(params: list[dict], batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Mean squared error of the stack's output against a target."""
    x, target = batch
    for i, p in enumerate(params):
        with jax.named_scope(f"layer{i}"):
            x = block(p, x)
    return jnp.mean(jnp.square(x - target))


def megatron_plan(tables: Any, info: Any, p: int = 8) -> Any:
    """Megatron-LM: Q/K/V and FFN-in split on their output (heads / hidden), output and FFN-out on their input.

    An operator that reads a weight named in ``MEGATRON_WEIGHT_AXES`` splits the dimension indexing that
    weight axis p ways; the attention core splits its head dimension (the one of extent HEADS), the FFN
    activation its hidden dimension (extent FFN); everything else (layer norms, residuals, loss) is replicated.
    """
    from shardplan.spmd import plan_from_configs

    split_of: dict[str, str] = {}
    for leaf, uses in info.leaf_uses.items():
        key = info.leaf_names[leaf].rsplit("[", 1)[-1].strip("']")
        axis = MEGATRON_WEIGHT_AXES.get(key)
        if axis is None:
            continue
        for op_name, dims in uses:
            if dims[axis] is not None:
                split_of[op_name] = dims[axis]
    cfg = {}
    for op in tables.graph.operators:
        c = [1] * len(op.dims)
        if op.name in split_of:
            c[op.dim_names.index(split_of[op.name])] = p
        elif not op.weights:
            want = HEADS if "attn" in op.name else FFN if "ffn" in op.name else None
            dims = [d for d, e in op.dims if e == want]
            if dims:
                c[op.dim_names.index(dims[0])] = p
        cfg[op.name] = c
    return plan_from_configs(tables, cfg, "megatron")


def main() -> None:
    from _common import run_example

    run_example(loss_fn, init_params, make_batch)


if __name__ == "__main__":
    main()
