"""Ring attention on JAX: context parallelism with ``jax.shard_map`` and ``jax.lax.ppermute``.

The sequence is split ``c`` ways over one mesh axis. Each device keeps its queries and starts with its own
keys and values; at each of ``c`` steps it multiplies its queries with the block it holds, folds the result
into a running (max, sum, output) triple (the online softmax of Milakov and Gimelshein 2018, as
FlashAttention uses it), and passes the block to the next device of the ring (``ppermute``), so that after
``c`` steps every device has seen every block once. The backward pass is JAX's transpose of the same
program: the blocks travel the other way with their gradients (``ppermute``'s transpose is the reverse
permutation), which is the ring's backward of docs/cost-model.md, "Ring context parallelism".

Causal load balancing (``balanced``): the sequence is dealt out in ``2c`` chunks, device i holding chunks i
and 2c - 1 - i (:func:`balanced_positions`), so every device does the same share of the masked work
(:func:`shardplan.cost.causal.block_work` counts it; :func:`device_work` counts what this runner computes).
Without it, device i holds the i-th contiguous block and the last device does almost twice the average.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shardplan.cost.causal import balanced_positions, device_work

__all__ = ["attention_reference", "balanced_positions", "device_work", "ring_attention", "ring_attention_sharded"]

NEG = -1e30  # a score no softmax weight survives (finite, so that max and exp stay free of NaN)


def attention_reference(q: Any, k: Any, v: Any, causal: bool = True) -> Any:
    """softmax(q k^T / sqrt(d)) v over (batch, seq, heads, dim) arrays, unsharded, causal or not."""
    import jax
    import jax.numpy as jnp

    s = jnp.einsum("bshd,bthd->bhst", q, k) / np.sqrt(q.shape[-1])
    if causal:
        n = q.shape[1]
        s = jnp.where(jnp.arange(n)[:, None] >= jnp.arange(n)[None, :], s, NEG)
    return jnp.einsum("bhst,bthd->bshd", jax.nn.softmax(s, axis=-1), v)


def ring_attention(q: Any, k: Any, v: Any, mesh: Any, axis: str, causal: bool = True,
                   balanced: bool = True) -> Any:
    """Attention of (batch, seq, heads, dim) arrays with the sequence split over ``mesh``'s ``axis`` by the ring
    (module docstring); equal to :func:`attention_reference` up to rounding, values and gradients. The
    sequence is put in the devices' order (:func:`balanced_positions`) and back around
    :func:`ring_attention_sharded`."""
    ways = mesh.shape[axis]
    pos = balanced_positions(q.shape[1], ways, balanced and causal)
    order = pos.reshape(-1)
    out = ring_attention_sharded(q[:, order], k[:, order], v[:, order], mesh, axis, pos if causal else None)
    return out[:, np.argsort(order)]


def ring_attention_sharded(q: Any, k: Any, v: Any, mesh: Any, axis: str, positions: np.ndarray | None) -> Any:
    """The ring itself, on arrays whose sequence is already in the devices' order (device i's block is
    ``positions[i]``, what a data loader that balances the sequence delivers); ``positions`` None: no mask."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    ways = mesh.shape[axis]
    causal = positions is not None
    table = jnp.asarray(positions if causal else np.zeros((ways, 1), dtype=np.int64))
    scale = 1.0 / np.sqrt(q.shape[-1])
    ring = [(i, (i + 1) % ways) for i in range(ways)]

    def local(ql, kl, vl):
        me = jax.lax.axis_index(axis)
        mine = table[me]
        b, n, h, d = ql.shape
        m = jnp.full((b, h, n), NEG, ql.dtype)
        den = jnp.zeros((b, h, n), ql.dtype)
        acc = jnp.zeros((b, h, n, d), ql.dtype)
        for step in range(ways):
            src = (me - step) % ways  # the device whose block this is
            s = jnp.einsum("bshd,bthd->bhst", ql, kl) * scale
            if causal:
                keep = mine[:, None] >= table[src][None, :]
                s = jnp.where(keep, s, NEG)
            new = jnp.maximum(m, s.max(axis=-1))
            p = jnp.exp(s - new[..., None])
            if causal:
                p = jnp.where(keep, p, 0.0)
            fix = jnp.exp(m - new)
            den = den * fix + p.sum(axis=-1)
            acc = acc * fix[..., None] + jnp.einsum("bhst,bthd->bhsd", p, vl)
            m = new
            if step + 1 < ways:
                kl, vl = jax.lax.ppermute((kl, vl), axis, ring)
        return jnp.transpose(acc / den[..., None], (0, 2, 1, 3))

    spec = P(None, axis, None, None)
    return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)(q, k, v)
