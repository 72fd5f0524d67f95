"""Ring attention on PyTorch: context parallelism with ``torch.distributed`` point-to-point messages.

The sequence is split ``g`` ways over a process group. Each rank keeps its queries and starts with its own
keys and values; at each of ``g`` steps it multiplies its queries with the block it holds, folds the result
into a running (max, sum, output) triple (the online softmax of Milakov and Gimelshein 2018, as
FlashAttention uses it), and passes the block to the next rank of the ring (``isend`` / ``irecv``, posted
before the step's product so that the transfer runs beside it), so that after ``g`` steps every rank has
seen every block once (a block the causal mask hides from all of this rank's queries is passed on without
a product). The forward pass keeps the log-sum-exp ``L`` of every query row.

The backward pass (:class:`RingAttention`) is the ring again: with ``P = exp(S - L)`` recomputed per block
from the saved ``L``, ``D = rowsum(dO * O)``,

    dV_j += P^T dO,   dS = P * (dO V_j^T - D),   dQ += dS K_j * scale,   dK_j += dS^T Q * scale,

and each block travels with its gradient accumulators ``(dK_j, dV_j)``, which make one last hop home after
the ``g``-th step: the ring's backward of docs/cost-model.md, "Ring context parallelism". PyTorch's own
``torch.distributed.tensor.experimental.context_parallel`` routes only the CUDA attention kernels, so the
ring is written here, on any backend with point-to-point messages (gloo included).

Causal load balancing (``balanced``): the sequence is dealt out in ``2g`` chunks, rank i holding chunks i
and 2g - 1 - i (:func:`balanced_positions`), so every rank does the same share of the masked work
(:func:`shardplan.cost.causal.block_work` counts it; :func:`device_work` counts what this ring computes).
Without it, rank i holds the i-th contiguous block and the last rank does almost twice the average.

Tensors are ``(batch, heads, seq, dim)``, the layout of ``torch.nn.functional.scaled_dot_product_attention``
(:mod:`shardplan.jax.ring` takes JAX's ``(batch, seq, heads, dim)``); the interface is otherwise the same.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from shardplan.cost.causal import balanced_positions, device_work
from shardplan.errors import ShardplanError

__all__ = [
    "SDPA",
    "attention_reference",
    "balanced_positions",
    "deal",
    "deal_routes",
    "device_work",
    "gather_sdpa",
    "is_causal_mask",
    "ring_applies",
    "ring_attention_sharded",
    "ring_kv_placements",
    "ring_sdpa",
]  # and RingAttention (module __getattr__)

NEG = -1e30  # a score no softmax weight survives (finite, so that max and exp stay free of NaN)


def attention_reference(q: Any, k: Any, v: Any, causal: bool = True, scale: float | None = None) -> Any:
    """softmax(q k^T * scale) v over (batch, heads, seq, dim) tensors, unsharded, causal or not (written out,
    not PyTorch's kernel, so that the test compares the ring with the definition)."""
    import torch

    sc = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.einsum("bhsd,bhtd->bhst", q, k) * sc
    if causal:
        n = q.shape[2]
        keep = torch.arange(n)[:, None] >= torch.arange(k.shape[2])[None, :]
        s = s.masked_fill(~keep, NEG)
    return torch.einsum("bhst,bhtd->bhsd", torch.softmax(s, dim=-1), v)


def _peers(group: Any) -> tuple[int, int, int, int]:
    """(this rank's index in ``group``, the group's size, the global rank of the next and of the previous)."""
    import torch.distributed as dist

    me, g = dist.get_rank(group), dist.get_world_size(group)
    return me, g, dist.get_global_rank(group, (me + 1) % g), dist.get_global_rank(group, (me - 1) % g)


def _shift(buf: Any, nxt: int, prv: int, group: Any) -> tuple[Any, list]:
    """Post the send of ``buf`` to ``nxt`` and the receive of the same shape from ``prv``; (the receive buffer,
    the requests to wait on). One flat message per step (keys and values, or their gradients, together)."""
    import torch
    import torch.distributed as dist

    got = torch.empty_like(buf)
    ops = [dist.P2POp(dist.isend, buf, nxt, group), dist.P2POp(dist.irecv, got, prv, group)]
    return got, dist.batch_isend_irecv(ops)


def _wait(reqs: list) -> None:
    for r in reqs:
        r.wait()


def _pack(*ts: Any) -> Any:
    import torch

    return torch.cat([t.reshape(-1) for t in ts])


def _unpack(buf: Any, like: tuple[Any, ...]) -> list[Any]:
    out, at = [], 0
    for t in like:
        out.append(buf[at:at + t.numel()].view(t.shape))
        at += t.numel()
    return out


def _keep(positions: Any, me: int, src: int) -> Any:
    """(n_q, n_k) bool: key position <= query position between this rank's queries and block ``src``'s keys."""
    return positions[me][:, None] >= positions[src][None, :]


def _columns(bias: Any, src: int, n: int) -> Any:
    """The additive mask of block ``src``'s keys (contiguous blocks of ``n``): columns ``src n`` to
    ``(src + 1) n`` of ``bias`` (this rank's query rows, every key); 0 without one."""
    return 0.0 if bias is None else bias[..., src * n:(src + 1) * n]


@functools.cache
def _make_function() -> Any:
    import torch

    class RingAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, q: Any, k: Any, v: Any, group: Any, positions: Any, scale: float,
                    bias: Any = None) -> Any:
            me, g, nxt, prv = _peers(group)
            b, h, n, _ = q.shape
            m = q.new_full((b, h, n), NEG)
            den = q.new_zeros((b, h, n))
            acc = q.new_zeros((b, h, n, v.shape[-1]))
            kb, vb = k.contiguous(), v.contiguous()
            for step in range(g):
                src = (me - step) % g  # the rank whose block this is
                if step + 1 < g:
                    got, reqs = _shift(_pack(kb, vb), nxt, prv, group)
                keep = None if positions is None else _keep(positions, me, src)
                if keep is None or bool(keep.any()):  # a block the mask hides entirely adds nothing
                    s = torch.matmul(q, kb.transpose(-1, -2)) * scale + _columns(bias, src, kb.shape[2])
                    if keep is not None:
                        s = s.masked_fill(~keep, NEG)
                    new = torch.maximum(m, s.amax(dim=-1))
                    p = torch.exp(s - new.unsqueeze(-1))
                    if keep is not None:
                        p = p.masked_fill(~keep, 0.0)
                    fix = torch.exp(m - new)
                    den = den * fix + p.sum(dim=-1)
                    acc = acc * fix.unsqueeze(-1) + torch.matmul(p, vb)
                    m = new
                if step + 1 < g:
                    _wait(reqs)
                    kb, vb = _unpack(got, (kb, vb))
            out = acc / den.unsqueeze(-1)
            lse = m + torch.log(den)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.group, ctx.positions, ctx.scale, ctx.bias = group, positions, scale, bias
            return out

        @staticmethod
        def backward(ctx: Any, dout: Any) -> Any:
            q, k, v, out, lse = ctx.saved_tensors
            group, positions, scale = ctx.group, ctx.positions, ctx.scale
            me, g, nxt, prv = _peers(group)
            dout = dout.contiguous()
            delta = (dout * out).sum(dim=-1, keepdim=True)
            dq = torch.zeros_like(q)
            kb, vb = k.contiguous(), v.contiguous()
            dkb, dvb = torch.zeros_like(kb), torch.zeros_like(vb)
            for step in range(g):
                src = (me - step) % g
                if step + 1 < g:  # the next block travels while this one is worked on
                    got, reqs = _shift(_pack(kb, vb), nxt, prv, group)
                keep = None if positions is None else _keep(positions, me, src)
                if keep is None or bool(keep.any()):
                    s = torch.matmul(q, kb.transpose(-1, -2)) * scale + _columns(ctx.bias, src, kb.shape[2])
                    p = torch.exp(s - lse.unsqueeze(-1))
                    if keep is not None:
                        p = p.masked_fill(~keep, 0.0)
                    dvb = dvb + torch.matmul(p.transpose(-1, -2), dout)
                    ds = p * (torch.matmul(dout, vb.transpose(-1, -2)) - delta)
                    dq = dq + torch.matmul(ds, kb) * scale
                    dkb = dkb + torch.matmul(ds.transpose(-1, -2), q) * scale
                # the accumulators follow their block: to the next rank, and after the last step home
                acc, areqs = _shift(_pack(dkb, dvb), nxt, prv, group)
                _wait(areqs)
                dkb, dvb = _unpack(acc, (dkb, dvb))
                if step + 1 < g:
                    _wait(reqs)
                    kb, vb = _unpack(got, (kb, vb))
            return dq, dkb, dvb, None, None, None, None

    return RingAttention


def __getattr__(name: str) -> Any:
    """``RingAttention``: the ``torch.autograd.Function`` of the ring (module docstring), built when first asked
    for so that importing this module needs no torch: ``RingAttention.apply(q, k, v, group, positions, scale,
    bias)``, ``positions`` a (g, n) int64 tensor of the sequence positions each rank holds (None: no causal
    mask), ``bias`` None or an additive mask of this rank's query rows over every key (contiguous blocks)."""
    if name == "RingAttention":
        return _make_function()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def ring_attention_sharded(q: Any, k: Any, v: Any, group: Any = None, positions: np.ndarray | None = None,
                           scale: float | None = None, bias: Any = None) -> Any:
    """Attention of this rank's (batch, heads, n, dim) blocks, the sequence split over ``group`` (default: the
    world) by the ring (module docstring); rank i's block holds the positions ``positions[i]`` (what a data
    loader that balances the sequence delivers: :func:`balanced_positions`), None: no mask. Equal to the rows
    ``positions[i]`` of :func:`attention_reference` of the whole sequence, values and gradients (the key and
    value gradients are those of this rank's block). ``bias``: an additive mask (no gradient) of this rank's
    query rows over all ``g n`` keys, broadcastable to ``(batch, heads, n, g n)``, the blocks contiguous
    (``positions`` None); entries of -inf count as :data:`NEG`."""
    import torch
    import torch.distributed as dist

    group = group if group is not None else dist.group.WORLD
    g = dist.get_world_size(group)
    pos = None
    if positions is not None:
        pos = torch.as_tensor(np.asarray(positions), dtype=torch.int64, device=q.device)
        if tuple(pos.shape) != (g, q.shape[2]) or k.shape[2] != q.shape[2]:
            raise ShardplanError(f"positions of shape {tuple(pos.shape)} for {g} ranks of {q.shape[2]} queries "
                                 f"and {k.shape[2]} keys")
    sc = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if bias is not None:
        if pos is not None or bias.shape[-1] != g * k.shape[2]:
            raise ShardplanError(f"an additive mask of {bias.shape[-1]} keys beside a causal mask or for {g} "
                                 f"blocks of {k.shape[2]} keys")
        bias = bias.detach().to(q.dtype).clamp(min=NEG)
    return _make_function().apply(q, k, v, group, pos, sc, bias)


SDPA = "aten.scaled_dot_product_attention.default"


def is_causal_mask(mask: Any, lq: int, s: int) -> bool:
    """Whether ``mask`` (boolean: True keeps; additive: 0 keeps, -inf or the dtype's lowest value drops) keeps
    exactly the points key <= query of ``lq == s`` queries and keys, the same for every batch and head (its
    last two axes ``(lq, s)``): the mask Hugging Face builds for causal attention under ``torch.export``,
    which the causal kernel (``is_causal``) computes without reading it. A tensor without values (the meta
    device) is not known to be one."""
    import torch

    if (not isinstance(mask, torch.Tensor) or mask.is_meta or mask.dim() < 2 or tuple(mask.shape[-2:]) != (lq, s)
            or lq != s):
        return False
    keep = torch.ones(lq, s, dtype=torch.bool, device=mask.device).tril()
    if mask.dtype == torch.bool:
        got = mask
    elif mask.is_floating_point():
        low = torch.finfo(mask.dtype).min
        if not bool(((mask == 0) | (mask <= low) | torch.isneginf(mask)).all()):
            return False
        got = mask == 0
    else:
        return False
    return bool((got == keep).all())


def ring_applies(q_placements: Any, kv: Any) -> bool:
    """Whether the ring replaces a gather: some mesh axis splits the queries (``Shard(2)`` in ``q_placements``,
    as planned) and every key and value operand (``kv``, as its producer left it) is a DTensor split on each
    such axis, each rank of the ring's group holding its own part (the cost model's condition that the
    producer's tiles scatter the input over the ring's group, :func:`shardplan.cost.ring.ring_choices`; a
    part split otherwise than along the sequence is first laid out so, a redistribution inside the group).
    Keys already gathered by their producer's layout stay so: the ring would only add the gradient's
    gather."""
    from torch.distributed.tensor import DTensor, Shard

    axes = [i for i, pl in enumerate(q_placements) if pl == Shard(2)]
    return bool(axes) and all(isinstance(x, DTensor) and all(x.placements[i].is_shard() for i in axes) for x in kv)


def ring_kv_placements(q_placements: Any, kv_placements: Any) -> tuple[Any, ...]:
    """The placements the ring reads the keys and values in: as planned (``kv_placements``), except on the
    mesh axes that split the queries (``Shard(2)`` in ``q_placements``), where they stay split like the queries,
    one block per rank, as the key and value projections leave them under context parallelism (the
    all-gather of the planned placements is what the ring replaces)."""
    from torch.distributed.tensor import Shard

    return tuple(Shard(2) if qp == Shard(2) else kp for qp, kp in zip(q_placements, kv_placements))


def deal_routes(me: int, g: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Where rank ``me``'s two half blocks go and come from when a contiguous split of ``2g`` chunks (rank i
    holding chunks 2i, 2i + 1) is dealt into the balanced one (rank i holding i, 2g - 1 - i:
    :func:`balanced_positions`): (for each of its halves the (rank, slot) it goes to, for each of its new
    slots the (rank, half) it comes from)."""
    def home(c: int) -> tuple[int, int]:
        return (c, 0) if c < g else (2 * g - 1 - c, 1)

    sends = [home(2 * me + j) for j in (0, 1)]
    recvs = [(c // 2, c % 2) for c in (me, 2 * g - 1 - me)]
    return sends, recvs


def _exchange(x: Any, sends: list[tuple[int, int]], recvs: list[tuple[int, int]], group: Any) -> Any:
    """``x``'s two halves along the sequence (dim 2) sent to ``sends`` and this rank's new halves received from
    ``recvs`` ((group rank, slot) pairs; a message's tag is the slot it fills), concatenated."""
    import torch
    import torch.distributed as dist

    me = dist.get_rank(group)
    halves = list(x.chunk(2, dim=2))
    out: list[Any] = [None, None]
    ops = []
    for j, (dst, slot) in enumerate(sends):
        if dst == me:
            out[slot] = halves[j]
        else:
            ops.append(dist.P2POp(dist.isend, halves[j].contiguous(), dist.get_global_rank(group, dst), group,
                                  tag=slot))
    for slot, (src, _) in enumerate(recvs):
        if src != me:
            out[slot] = torch.empty_like(halves[0], memory_format=torch.contiguous_format)
            ops.append(dist.P2POp(dist.irecv, out[slot], dist.get_global_rank(group, src), group, tag=slot))
    if ops:
        _wait(dist.batch_isend_irecv(ops))
    return torch.cat(out, dim=2)


@functools.cache
def _deal_function() -> Any:
    import torch

    class Deal(torch.autograd.Function):
        """Contiguous blocks dealt into the balanced order (``inverse``: back); the gradient goes the other way."""

        @staticmethod
        def forward(ctx: Any, x: Any, group: Any, inverse: bool) -> Any:
            import torch.distributed as dist

            sends, recvs = deal_routes(dist.get_rank(group), dist.get_world_size(group))
            ctx.routes, ctx.group, ctx.inverse = (sends, recvs), group, inverse
            return _exchange(x, recvs, sends, group) if inverse else _exchange(x, sends, recvs, group)

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            sends, recvs = ctx.routes
            g = g.contiguous()
            return (_exchange(g, sends, recvs, ctx.group) if ctx.inverse else _exchange(g, recvs, sends, ctx.group),
                    None, None)

    return Deal


def deal(x: Any, group: Any, inverse: bool = False) -> Any:
    """Each rank's contiguous block of ``x`` (sequence on dim 2, of even length) dealt into the balanced order
    over ``group`` (:func:`deal_routes`), or back (``inverse``); differentiable."""
    return _deal_function().apply(x, group, inverse)


def ring_sdpa(q: Any, k: Any, v: Any, attn_mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False,
              scale: float | None = None, enable_gqa: bool = False, *, fallback: Any, balanced: bool = True) -> Any:
    """``scaled_dot_product_attention`` on DTensors by the ring where it applies, else ``fallback`` (the same
    arguments; :func:`shardplan.torch.run._sdpa`: keys gathered, each device's query tile).

    It applies when mesh axes split the queries (``Shard(2)`` of ``q``; several axes, of a mesh with named
    axes, form one ring over their flattened group, in DTensor's row-major order of the blocks), ``k`` and
    ``v`` have as
    many heads as ``q`` or fewer (grouped-query attention: the heads whole, or split so that each device's
    query heads read its own K/V heads, the frontend's merged head axis; each K/V head is repeated to its
    query heads on the device), the mask needs no gradient and there is no dropout: ``k`` and ``v`` are
    laid out like ``q`` (the sequence split on that axis: :func:`ring_kv_placements`), and each rank runs
    :func:`ring_attention_sharded` on its local blocks over that group.

    A mask that keeps exactly key <= query (:func:`is_causal_mask`: Hugging Face's, under ``torch.export``)
    runs as ``is_causal``. DTensor's ``Shard`` holds contiguous blocks, so a causal mask runs with the
    contiguous positions (``balanced=False``); the load-balanced order is a data order
    (:func:`balanced_positions`), which the ring function takes but this layout does not give: with
    ``balanced`` (and blocks of even length) a causal attention first deals the blocks into it (:func:`deal`:
    each rank sends its two half blocks of ``q``, ``k``, ``v`` to their balanced owners, and the output comes
    back the same way), so that every rank does the same masked work; else it runs the contiguous positions.
    Any other mask is added to each block's scores: this device's rows of it, every key (a DTensor mask is
    gathered first). Each operand's gradient is its own block's (nothing partial)."""
    import torch
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    whole = attn_mask
    if isinstance(attn_mask, DTensor):  # a constant the run replicated: every device holds all of it
        whole = attn_mask.to_local() if all(pl.is_replicate() for pl in attn_mask.placements) else None
    if attn_mask is not None and not is_causal and is_causal_mask(whole, q.shape[2], k.shape[2]):
        attn_mask, is_causal = None, True  # the constant mask of key <= query: the causal kernel's
    if not isinstance(q, DTensor) or not isinstance(k, DTensor) or not isinstance(v, DTensor):
        return fallback(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    mesh = q.device_mesh
    axes = [i for i, pl in enumerate(q.placements) if pl == Shard(2) and mesh.size(i) > 1]
    head_ways = math.prod(mesh.size(i) for i, pl in enumerate(q.placements) if pl == Shard(1))
    grouped = k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1]
    if (not axes or (len(axes) > 1 and mesh.mesh_dim_names is None) or dropout_p or k.shape[2] != q.shape[2]
            or (attn_mask is not None and attn_mask.requires_grad)
            or (grouped and (q.shape[1] % k.shape[1] or k.shape[1] % head_ways or k.shape[1] != v.shape[1]))
            or any(isinstance(pl, Shard) and pl.dim == 3 for pl in q.placements)):
        return fallback(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    import torch.distributed as dist

    group = _sequence_group(mesh, axes)
    if group is None:  # the group's ranks are not in the blocks' order
        return fallback(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    pl = tuple(q.placements)
    k, v = (t if tuple(t.placements) == pl else t.redistribute(mesh, pl) for t in (k, v))
    ql, kl, vl = (t.to_local(grad_placements=pl) for t in (q, k, v))
    if grouped:  # grouped-query attention: each of this device's K/V heads repeated to its query heads
        kl, vl = (t.repeat_interleave(ql.shape[1] // kl.shape[1], dim=1) for t in (kl, vl))
    g, n = dist.get_world_size(group), ql.shape[2]
    bias = None
    if attn_mask is not None:  # this device's batch, heads and query rows of the mask, every key
        m = attn_mask.full_tensor() if isinstance(attn_mask, DTensor) else attn_mask
        m = m.reshape((1,) * (4 - m.dim()) + tuple(m.shape))
        size, start = compute_local_shape_and_global_offset(q.shape, mesh, pl)
        m = m[tuple(slice(start[d], start[d] + size[d]) if m.shape[d] == q.shape[d] != 1 else slice(None)
                    for d in range(3))]
        bias = m if m.is_floating_point() else torch.zeros(m.shape, dtype=ql.dtype, device=ql.device).masked_fill(
            ~m, NEG)
        out = ring_attention_sharded(ql, kl, vl, group, None, scale, bias)
    elif is_causal and balanced and n % 2 == 0:
        sizes = (ql.shape[-1], kl.shape[-1], vl.shape[-1])
        ql, kl, vl = deal(torch.cat([ql, kl, vl], dim=-1), group).split(sizes, dim=-1)
        out = ring_attention_sharded(ql, kl, vl, group, balanced_positions(g * n, g), scale)
        out = deal(out, group, inverse=True)
    else:
        positions = np.arange(g * n).reshape(g, n) if is_causal else None
        out = ring_attention_sharded(ql, kl, vl, group, positions, scale)
    return DTensor.from_local(out, mesh, pl, run_check=False)


def _sequence_group(mesh: Any, axes: list[int]) -> Any:
    """The process group of the mesh axes ``axes`` (one axis, or several of a mesh with named axes, flattened),
    or None where its ranks are not in the order of this rank's block (DTensor's row-major order over the
    axes)."""
    import torch.distributed as dist

    ring = mesh if len(axes) == 1 else mesh[tuple(mesh.mesh_dim_names[i] for i in axes)]._flatten()
    group = ring.get_group(axes[0] if len(axes) == 1 else 0)
    coord = mesh.get_coordinate()
    index = 0
    for i in axes:
        index = index * mesh.size(i) + coord[i]
    return group if dist.get_rank(group) == index else None


def gather_sdpa(q: Any, k: Any, v: Any, attn_mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False,
                scale: float | None = None, enable_gqa: bool = False, *, fallback: Any) -> Any:
    """Causal ``scaled_dot_product_attention`` on DTensors with the keys gathered and the queries balanced
    (the all-gather's deal, docs/cost-model.md, "Dealt at the attention"), else ``fallback`` (the same
    arguments; :func:`shardplan.torch.run._sdpa`, which also runs the balanced attention).

    It applies to a causal attention without mask or dropout whose queries some mesh axes split along the
    sequence (``Shard(2)``; several, of a mesh with named axes, as one group in DTensor's row-major order),
    blocks of even length: each rank's query block is dealt into the balanced order (:func:`deal`: chunks
    i and 2g - 1 - i of 2g), ``fallback`` runs the attention of the two chunks on the keys and values as
    planned (gathered along the sequence), each chunk against the keys up to its last row (``chunks``),
    and the output is dealt back; the gradients retrace the deals (the output's gradient in, the queries'
    back), the keys' and values' are the partial sums of the gathered run."""
    from torch.distributed.tensor import DTensor, Shard

    if not (isinstance(q, DTensor) and is_causal and attn_mask is None and not dropout_p
            and k.shape[2] == q.shape[2]):
        return fallback(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    mesh = q.device_mesh
    axes = [i for i, pl in enumerate(q.placements) if pl == Shard(2) and mesh.size(i) > 1]
    local = q.to_local().shape[2] if axes else 0
    group = _sequence_group(mesh, axes) if axes and (len(axes) == 1 or mesh.mesh_dim_names is not None) else None
    if group is None or local % 2 or any(isinstance(pl, Shard) and pl.dim == 3 for pl in q.placements):
        return fallback(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    import torch.distributed as dist

    pl = tuple(q.placements)
    g, me, h = dist.get_world_size(group), dist.get_rank(group), local // 2
    dealt = DTensor.from_local(deal(q.to_local(grad_placements=pl), group), mesh, pl, run_check=False)
    out = fallback(dealt, k, v, None, 0.0, True, scale, enable_gqa, chunks=(me * h, (2 * g - 1 - me) * h))
    back = deal(out.to_local(grad_placements=tuple(out.placements)), group, inverse=True)
    return DTensor.from_local(back, mesh, tuple(out.placements), run_check=False)
