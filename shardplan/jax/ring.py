"""Ring attention on JAX: context parallelism with ``jax.shard_map`` and ``jax.lax.ppermute``.

The sequence is split ``c`` ways over one mesh axis. Each device keeps its queries and starts with its own
keys and values; at each of ``c`` steps it multiplies its queries with the block it holds, folds the result
into a running (max, sum, output) triple (the online softmax of Milakov and Gimelshein 2018, as
FlashAttention uses it), and passes the block to the next device of the ring (``ppermute``), so that after
``c`` steps every device has seen every block once. The backward pass (a ``jax.custom_vjp``) keeps only
FlashAttention's residuals (the blocks, the output, the log-sum-exp) and runs the ring again, each block
travelling with its gradient accumulators, which make one last hop home: the ring's backward of
docs/cost-model.md, "Ring context parallelism".

Causal load balancing (``balanced``): the sequence is dealt out in ``2c`` chunks, device i holding chunks i
and 2c - 1 - i (:func:`balanced_positions`), so every device does the same share of the masked work
(:func:`shardplan.cost.causal.block_work` counts it; :func:`device_work` counts what this runner computes).
Without it, device i holds the i-th contiguous block and the last device does almost twice the average.

The all-gather's balance (:func:`gather_apply`, Llama 3's all-gather with the queries dealt): the keys and
values gathered as planned, the queries dealt into the balanced order by the same two half-block
``ppermute`` as the ring's deal, the output dealt back; its backward is autodiff's (the transposes: the
output's gradient dealt in, the queries' dealt back; keys and values that arrive split along the sequence
are gathered inside, and their gradients reduce-scattered home by the all-gather's transpose).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from shardplan.cost.causal import balanced_positions, device_work
from shardplan.errors import ShardplanError

__all__ = ["attention_reference", "balanced_positions", "device_work", "gather_apply", "ring_apply",
           "ring_attention", "ring_attention_sharded"]

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
    from jax.sharding import PartitionSpec as P

    ways = mesh.shape[axis]
    spec = P(None, axis, None, None)
    return jax.shard_map(lambda a, b, c: _ring_local(a, b, c, axis, ways, positions), mesh=mesh,
                         in_specs=(spec, spec, spec), out_specs=spec)(q, k, v)


def _ring_local(ql: Any, kl: Any, vl: Any, axis: Any, ways: int, positions: np.ndarray | None) -> Any:
    """One device's ring (inside ``shard_map``): its queries ``ql`` against every block of keys and values,
    the blocks passed on by ``ppermute`` over ``axis`` (module docstring). Fewer K/V heads than query heads
    (grouped-query attention): each K/V head serves ``N / K`` consecutive query heads (JAX's grouping), repeated
    on the device at each step, so the ring passes the blocks unrepeated.

    A ``jax.custom_vjp``: the forward keeps what FlashAttention keeps (the device's q, k, v blocks, the output
    and the per-row log-sum-exp), not every step's blocks and probabilities as autodiff of the loop would; the
    backward runs the ring again, each key/value block travelling with its gradient accumulators, which make
    one last hop home (:func:`_ring_backward`)."""
    import jax

    @jax.custom_vjp
    def ring(q: Any, k: Any, v: Any) -> Any:
        return _ring_forward(q, k, v, axis, ways, positions)[0]

    def fwd(q: Any, k: Any, v: Any) -> tuple[Any, tuple[Any, ...]]:
        out, lse = _ring_forward(q, k, v, axis, ways, positions)
        return out, (q, k, v, out, lse)

    def bwd(res: tuple[Any, ...], dout: Any) -> tuple[Any, Any, Any]:
        return _ring_backward(*res, dout, axis, ways, positions)

    ring.defvjp(fwd, bwd)
    return ring(ql, kl, vl)


def _ring_steps(axis: Any, ways: int, positions: np.ndarray | None) -> tuple[Any, Any, list[tuple[int, int]]]:
    """(the position table, this device's index, the ring's permutation i -> i + 1)."""
    import jax
    import jax.numpy as jnp

    table = jnp.asarray(positions if positions is not None else np.zeros((ways, 1), dtype=np.int64))
    return table, jax.lax.axis_index(axis), [(i, (i + 1) % ways) for i in range(ways)]


def _ring_forward(ql: Any, kl: Any, vl: Any, axis: Any, ways: int, positions: np.ndarray | None
                  ) -> tuple[Any, Any]:
    """The ring's forward: the output (batch, seq, heads, dim) and the log-sum-exp of each query row's scores
    (batch, heads, seq), by the online softmax over the ``ways`` blocks."""
    import jax
    import jax.numpy as jnp

    causal = positions is not None
    table, me, ring = _ring_steps(axis, ways, positions)
    mine = table[me]
    scale = 1.0 / np.sqrt(ql.shape[-1])
    group = ql.shape[2] // kl.shape[2]
    b, n, h, d = ql.shape
    m = jnp.full((b, h, n), NEG, ql.dtype)
    den = jnp.zeros((b, h, n), ql.dtype)
    acc = jnp.zeros((b, h, n, d), ql.dtype)
    for step in range(ways):
        src = (me - step) % ways  # the device whose block this is
        kk, vv = (jnp.repeat(x, group, axis=2) if group > 1 else x for x in (kl, vl))
        s = jnp.einsum("bshd,bthd->bhst", ql, kk) * scale
        if causal:
            keep = mine[:, None] >= table[src][None, :]
            s = jnp.where(keep, s, NEG)
        new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - new[..., None])
        if causal:
            p = jnp.where(keep, p, 0.0)
        fix = jnp.exp(m - new)
        den = den * fix + p.sum(axis=-1)
        acc = acc * fix[..., None] + jnp.einsum("bhst,bthd->bhsd", p, vv)
        m = new
        if step + 1 < ways:
            kl, vl = jax.lax.ppermute((kl, vl), axis, ring)
    return jnp.transpose(acc / den[..., None], (0, 2, 1, 3)), m + jnp.log(den)


def _ring_backward(ql: Any, kl: Any, vl: Any, out: Any, lse: Any, dout: Any, axis: Any, ways: int,
                   positions: np.ndarray | None) -> tuple[Any, Any, Any]:
    """The ring's backward (FlashAttention's, block by block): with ``P = exp(S - lse)`` recomputed per block,
    ``dV += P^T dO``, ``dS = P (dO V^T - rowsum(dO * O))``, ``dQ += dS K``, ``dK += dS^T Q`` (the scale on
    both); each key/value block travels on with its ``dK``, ``dV`` accumulators, and after the last step the
    accumulators make one more hop, to the device that owns the block."""
    import jax
    import jax.numpy as jnp

    causal = positions is not None
    table, me, ring = _ring_steps(axis, ways, positions)
    mine = table[me]
    scale = 1.0 / np.sqrt(ql.shape[-1])
    b, n, h, d = ql.shape
    kh = kl.shape[2]
    group = h // kh
    delta = jnp.sum(dout * out, axis=-1).transpose(0, 2, 1)  # (b, h, n)
    dq = jnp.zeros_like(ql)
    dk, dv = jnp.zeros_like(kl), jnp.zeros_like(vl)
    for step in range(ways):
        src = (me - step) % ways
        kk, vv = (jnp.repeat(x, group, axis=2) if group > 1 else x for x in (kl, vl))
        s = jnp.einsum("bshd,bthd->bhst", ql, kk) * scale
        p = jnp.exp(s - lse[..., None])
        if causal:
            p = jnp.where(mine[:, None] >= table[src][None, :], p, 0.0)
        dvv = jnp.einsum("bhst,bshd->bthd", p, dout)
        dp = jnp.einsum("bshd,bthd->bhst", dout, vv)
        ds = p * (dp - delta[..., None]) * scale
        dq = dq + jnp.einsum("bhst,bthd->bshd", ds, kk)
        dkk = jnp.einsum("bhst,bshd->bthd", ds, ql)
        if group > 1:  # the repeated heads' gradients summed into their K/V head
            dkk = dkk.reshape(b, -1, kh, group, d).sum(axis=3)
            dvv = dvv.reshape(b, -1, kh, group, d).sum(axis=3)
        dk, dv = dk + dkk, dv + dvv
        if step + 1 < ways:  # one exchange of the block and its accumulators (a stack: no merging with the forward's)
            kl, vl, dk, dv = jax.lax.ppermute(jnp.stack((kl, vl, dk, dv)), axis, ring)
    dk, dv = jax.lax.ppermute((dk, dv), axis, ring)  # the block of device me + 1: home
    return dq, dk, dv


def _deal(x: Any, axis: Any, ways: int, inverse: bool) -> Any:
    """Inside ``shard_map``: device i's contiguous block (chunks 2i, 2i + 1 of 2 ``ways``, sequence on axis 1)
    dealt into the balanced order (chunks i, 2 ways - 1 - i: :func:`balanced_positions`), or back
    (``inverse``). Each device holds one even and one odd chunk either way, and the even chunks (and the odd
    ones) sit on distinct devices in both orders, so the deal is two ``ppermute``: one moves every even
    chunk, one every odd chunk (a permutation each; its transpose, the reverse permutation, is the
    gradient's way back)."""
    import jax
    import jax.numpy as jnp

    me = jax.lax.axis_index(axis)
    h = x.shape[1] // 2
    first, second = x[:, :h], x[:, h:]
    # balanced device i holds its even chunk in slot 0 when i is even, in slot 1 when i is odd
    even_home = [(i if i % 2 == 0 else 2 * ways - 1 - i) // 2 for i in range(ways)]  # contiguous rank of it
    odd_home = [(2 * ways - 1 - i if i % 2 == 0 else i) // 2 for i in range(ways)]
    flip = me % 2 == 1
    if inverse:
        even, odd = jnp.where(flip, second, first), jnp.where(flip, first, second)
        even = jax.lax.ppermute(even, axis, [(i, even_home[i]) for i in range(ways)])
        odd = jax.lax.ppermute(odd, axis, [(i, odd_home[i]) for i in range(ways)])
        return jnp.concatenate([even, odd], axis=1)
    even = jax.lax.ppermute(first, axis, [(even_home[i], i) for i in range(ways)])
    odd = jax.lax.ppermute(second, axis, [(odd_home[i], i) for i in range(ways)])
    return jnp.concatenate([jnp.where(flip, odd, even), jnp.where(flip, even, odd)], axis=1)


def ring_apply(q: Any, k: Any, v: Any, mesh: Any, q_spec: Any, kv_spec: Any, axis: str | tuple[str, ...],
               causal: bool, balanced: bool = True) -> Any:
    """``jax.nn.dot_product_attention(q, k, v, is_causal=causal)`` of (batch, seq, heads, dim) arrays laid out
    as a plan runs them: queries by ``q_spec``, keys and values by ``kv_spec`` (PartitionSpecs over ``mesh``),
    both splitting the sequence over mesh axis ``axis`` (or a tuple of axes, major first, the ring over their
    devices in row-major order) in contiguous blocks; the output laid out as the
    queries. Each device runs the ring over ``axis`` (:func:`_ring_local`) on its block of batch, heads and
    sequence. Causal with ``balanced`` (and blocks of even length): the blocks of ``q``, ``k`` and ``v`` are first
    dealt into the load-balanced order (:func:`_deal`) and the output dealt back, so every device does the
    same masked work, the :class:`~shardplan.ir.Causal` work the cost model charges; else the contiguous
    positions."""
    import jax

    ways = math.prod(mesh.shape[a] for a in ((axis,) if isinstance(axis, str) else axis))
    seq = q.shape[1]
    deal = causal and balanced and seq % (2 * ways) == 0
    pos = balanced_positions(seq, ways, deal) if causal else None

    def local(ql: Any, kl: Any, vl: Any) -> Any:
        if deal:
            ql, kl, vl = (_deal(x, axis, ways, False) for x in (ql, kl, vl))
        out = _ring_local(ql, kl, vl, axis, ways, pos)
        return _deal(out, axis, ways, True) if deal else out

    return jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec)(q, k, v)


def gather_apply(q: Any, k: Any, v: Any, mesh: Any, q_spec: Any, kv_spec: Any, axis: str | tuple[str, ...],
                 scatter: tuple[bool, bool] = (False, False)) -> Any:
    """Causal ``jax.nn.dot_product_attention(q, k, v, is_causal=True)`` of (batch, seq, heads, dim) arrays laid
    out as a plan runs them with the keys gathered: queries by ``q_spec``, the sequence split in contiguous
    blocks over mesh axis ``axis`` (or a tuple of axes, major first), keys and values by ``kv_spec``, whose
    sequence is whole; the output laid out as the queries. Inside ``shard_map`` each device's query block
    (of even length) is dealt into the balanced order (:func:`_deal`: chunks i and 2g - 1 - i of 2g), its
    rows attend to every key under the mask of their positions (:func:`balanced_positions`), and the output
    is dealt back: every device does the same masked work (the balanced core the cost model charges, plus
    :func:`shardplan.cost.ring.gathered_deal`'s exchanges). Backward by autodiff: the deal's transposes move
    the output's gradient in and the queries' back. ``scatter``: per key and value, whether it arrives split
    along the sequence over ``axis`` like the queries (as its producer leaves it,
    :func:`shardplan.cost.ring.gathered_scatters`) and is gathered inside by ``jax.lax.all_gather``, whose
    transpose reduce-scatters its gradient (each device keeps its own block's sum:
    :func:`shardplan.cost.ring.gathered_reduction`); otherwise it arrives whole (gathered by the plan's
    layouts) and its gradient, a partial sum over the device's queries, is all-reduced over ``axis`` by
    ``shard_map``'s transpose."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec

    ways = math.prod(mesh.shape[a] for a in ((axis,) if isinstance(axis, str) else axis))
    seq = q.shape[1]
    if seq % (2 * ways) or (len(kv_spec) > 1 and kv_spec[1] is not None):
        raise ShardplanError(f"a sequence of {seq} in blocks of odd length over {ways} devices, or keys not gathered")
    table = jnp.asarray(balanced_positions(seq, ways, True))
    split = PartitionSpec(*[axis if d == 1 else kv_spec[d] if d < len(kv_spec) else None for d in range(4)])
    specs = tuple(split if s else kv_spec for s in scatter)

    def local(ql: Any, kl: Any, vl: Any) -> Any:
        kl, vl = (jax.lax.all_gather(x, axis, axis=1, tiled=True) if s else x for x, s in zip((kl, vl), scatter))
        rows = table[jax.lax.axis_index(axis)]
        keep = rows[:, None] >= jnp.arange(kl.shape[1])[None, :]
        out = jax.nn.dot_product_attention(_deal(ql, axis, ways, False), kl, vl, mask=keep[None, None])
        return _deal(out, axis, ways, True)

    return jax.shard_map(local, mesh=mesh, in_specs=(q_spec, *specs), out_specs=q_spec)(q, k, v)
