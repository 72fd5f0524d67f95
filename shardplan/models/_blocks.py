"""Small composites shared by the model builders (no cost code: only operator constructors).

ReLU is never a vertex of its own: it is fused into the operator before it
(a convolution without batch norm, a batch norm, a residual add, the first
feed-forward product). Its work (one FLOP per element) is negligible next
to the layer it follows and it moves no data, so a separate vertex would
only enlarge the search.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from shardplan import ops
from shardplan.errors import ShardplanError
from shardplan.ir import GraphBuilder, KernelIO, Operator, TensorRef

__all__ = ["conv_bn", "attention", "check_stack", "rms_norm", "ATTENTION_CORES", "ATTENTIONS", "check_attention",
           "MEGATRON_IO"]

MEGATRON_IO = {
    # HBM traffic of Megatron-LM's memory-bound kernels of 2021-22, per pass, in tiles of the operand (2-byte
    # elements; KernelIO: forward = sum_i reads_i |T_i| + write |O|, backward = write |O| + sum_i back_i |T_i|).
    # Read off the kernels (megatron/model/*.py, megatron/fused_kernels, megatron/mpu/cross_entropy.py at the
    # SC'21 commit 6985e58); docs/cost-model.md, "Megatron-LM's memory-bound kernels".
    # scaled_upper_triang_masked_softmax: x read, y written; backward dy and y read, dx written (in place)
    "softmax": KernelIO(reads=(1.0,), back=(2.0,), write=1.0),
    # torch.nn.Dropout on the probabilities: x read, y and the 1-byte mask written; backward dy and mask read,
    # dx written
    "dropout": KernelIO(reads=(1.0,), back=(1.0,), write=1.5),
    # bias_gelu (jit): the product's output (and the bias) read, y written; bias_gelu_back: dy and the input
    # read, dx written, then read again for the bias's gradient (its sum over tokens)
    "gelu": KernelIO(reads=(1.0,), back=(3.0,), write=1.0),
    # bias_dropout_add_fused_train: the branch (and its bias) and the residual read, y and the mask written;
    # backward dy and the mask read, the branch's gradient written and read again for its bias's sum; the
    # residual's gradient is dy itself, added to the other gradient of the residual stream where it forks:
    # both read, the sum written (3 tiles, on the residual operand)
    "bias_dropout_add": KernelIO(reads=(1.0, 1.0), back=(3.0, 2.0), write=1.5),
    # fused layer norm (apex's kernels, megatron/fused_kernels): x, gamma, beta read, y written; backward: the
    # input-gradient kernel and the partial gamma/beta kernel each read dy and x (dy twice, x twice), dx written
    "layer_norm": KernelIO(reads=(1.0, 1.0, 1.0), back=(4.0, 1.0, 1.0), write=1.0),
    # vocab_parallel_cross_entropy(output.float()): the fp16 logits cast to fp32 (read 1, write 2 tiles), max
    # (2), subtract in place (4), exp in place (4), sum (2), divide in place (4): 19 tiles; the int64 labels
    # read once (4); the per-token loss written. Backward: the saved softmax scaled in place (4), the fp32
    # gradient cast back to fp16 (read 2, write 1): 7 tiles
    "cross_entropy": KernelIO(reads=(19.0, 4.0), back=(7.0, 0.0), write=1.0),
}
"""How Megatron-LM's memory-bound kernels (``kernels="megatron"``) move data through HBM, per operator kind:
:class:`~shardplan.ir.KernelIO` counts read off the kernels (comments above)."""

ATTENTION_CORES = ("fused", "megatron", "flash")
"""How :func:`attention` writes its core (softmax(q k^T) v): ``fused``, the softmax inside the scores
product; ``megatron``, the four kernels Megatron-LM ran in 2021-22; ``flash``, one FlashAttention operator
(:func:`shardplan.ops.flash_attention`) (:func:`attention`)."""

ATTENTIONS = ("flash", "unfused")
"""The zoo's ``attention=`` model option: the core as one FlashAttention operator (no (s, t) tensor written
or kept, the scores recomputed in the backward) or unfused (scores and context products with the (s, t)
probabilities between them in memory, kept for the backward). docs/models.md, "Attention"."""


def check_attention(model: str, attention: str) -> None:
    """Refuse an ``attention=`` option that is not one of :data:`ATTENTIONS`."""
    if attention not in ATTENTIONS:
        raise ShardplanError(f"model {model!r}: attention={attention!r} is not one of {', '.join(ATTENTIONS)}")


def check_stack(model: str, layers: int, d_model: int | None = None, heads: int | None = None) -> None:
    """Refuse sizes that make no model: ``layers`` < 1, ``heads`` not a positive divisor of ``d_model``."""
    if layers < 1:
        raise ShardplanError(f"model {model!r}: layers={layers} makes no model; it needs at least 1 layer")
    if heads is not None and d_model is not None and (heads < 1 or d_model % heads):
        raise ShardplanError(f"model {model!r}: heads={heads} must be a positive divisor of d_model={d_model}")


def conv_bn(b: GraphBuilder, name: str, x: TensorRef, out_channels: int, kernel: int | Sequence[int],
            stride: int | Sequence[int] = 1, padding: int | Sequence[int] = 0,
            bn_name: str | None = None) -> TensorRef:
    """Convolution ``name`` followed by batch norm (+ fused ReLU) ``bn_name`` (default ``name + "_bn"``)."""
    h = b.add(ops.conv2d(name, x, out_channels, kernel, stride, padding))
    return b.add(ops.batch_norm(bn_name or f"{name}_bn", h))


def attention(b: GraphBuilder, prefix: str, x: TensorRef, memory: TensorRef, heads: int,
              tag: str = "", core: str = "fused") -> TensorRef:
    """Multi-head attention of queries from ``x`` (b, s, d) over keys/values from ``memory`` (b, t, d).

    Six vertices, all einsums over (b, s, h, k) so that heads are a
    splittable dimension: ``{tag}q``, ``{tag}k``, ``{tag}v`` projections
    (dims ``bshkd``), ``{tag}scores`` = softmax over t of q.k (dims
    ``bhstk``; the softmax is fused: its max and sum are normalisation
    statistics over ``t``, and its 5 FLOPs per score are added to the
    contraction's work), ``{tag}context`` (dims ``bshkt``) and the output
    projection ``{tag}out`` (dims ``bsdhk``). Returns the output (b, s, d).
    Masking (causal self-attention) changes neither the work counted nor
    the data moved, so it is not represented.

    ``core="megatron"``: the core as Megatron-LM's ``ParallelAttention``
    (2021-22, before FlashAttention) ran it, four kernels, each reading and
    writing the (b, h, s, t) tensor in memory: ``{tag}scores`` (``baddbmm``
    of q and k^T with the 1/sqrt(k) scale folded in: a plain product),
    ``{tag}softmax`` (the fused scale-mask-softmax kernel:
    5 FLOPs per score, max and sum as statistics over ``t``),
    ``{tag}dropout`` (``torch.nn.Dropout`` on the probabilities: its output
    and a 1-byte mask kept, ``saved`` 1.5 two-byte tiles) and
    ``{tag}context`` (``bmm`` with v). ``core="flash"``: one vertex ``{tag}attention`` in place of scores and
    context (:func:`shardplan.ops.flash_attention`, dims ``bshkt``), five vertices in all. The softmax and the dropout carry the
    kind ``attn_scores`` (they make the probabilities the scores product
    starts), so that selective recomputation (Korthikanti et al. 2022:
    exactly these four kernels) finds the whole core by its kinds
    ``attn_scores`` and ``attn_context``. Activations kept per layer: Korthikanti
    et al.'s ``5 a s / h`` term is 5 b h s t bytes at 2-byte elements (softmax
    output, mask, dropout output); the scores' output, which the softmax's
    backward does not read, is counted too (``saved`` 1, 7 b h s t bytes in
    all) because the memory model charges a recomputing operator the inputs its
    producer does not keep, even where the producer recomputes as well
    (:func:`shardplan.cost.memory.recompute_keep_bytes`): ``saved`` 0 would
    charge the softmax the whole scores tensor under every recomputation, which
    keeps nothing of the core. The over-count is without recomputation only.
    """
    d = x.shape[-1]
    if heads < 1 or d % heads:
        raise ShardplanError(f"{prefix}: heads={heads} must be a positive divisor of d_model={d}")
    if core not in ATTENTION_CORES:
        raise ShardplanError(f"{prefix}: attention core {core!r} is not one of {', '.join(ATTENTION_CORES)}")
    kd = d // heads
    p = f"{prefix}/{tag}"
    w = (d, heads, kd)
    if core == "megatron" and x is memory:
        return _megatron_attention(b, p, x, heads)
    q = b.add(ops.einsum(f"{p}q", "bsd,dhk->bshk", x, ops.Param(w), kind="attn_proj"))
    k = b.add(ops.einsum(f"{p}k", "btd,dhk->bthk", memory, ops.Param(w), kind="attn_proj"))
    v = b.add(ops.einsum(f"{p}v", "btd,dhk->bthk", memory, ops.Param(w), kind="attn_proj"))
    if core == "flash":
        ctx = b.add(ops.flash_attention(f"{p}attention", q, k, v, "bshk", "bthk"))
        return b.add(ops.einsum(f"{p}out", "bshk,hkd->bsd", ctx, ops.Param((heads, kd, d)), kind="attn_out"))
    scores = ops.einsum(f"{p}scores", "bshk,bthk->bhst", q, k, kind="attn_scores")
    if core == "megatron":
        s = b.add(scores)
        s = b.add(dataclasses.replace(ops.softmax(f"{p}softmax", s, letters="bhst"), kind="attn_scores"))
        s = b.add(dataclasses.replace(ops.elementwise(f"{p}dropout", s, kind="attn_scores", letters="bhst"),
                                      saved=1.5))
    else:
        scores = dataclasses.replace(scores, norm_dims=("t",), norm_stats=2, flops_per_point=2.0 + 5.0 / kd)
        s = b.add(scores)
    ctx = b.add(ops.einsum(f"{p}context", "bhst,bthk->bshk", s, v, kind="attn_context"))
    return b.add(ops.einsum(f"{p}out", "bshk,hkd->bsd", ctx, ops.Param((heads, kd, d)), kind="attn_out"))


def _megatron_attention(b: GraphBuilder, p: str, x: TensorRef, heads: int) -> TensorRef:
    """Self-attention as Megatron-LM's ``ParallelAttention`` (2021-22) runs it: one fused query-key-value
    product ``{p}qkv`` (its ``query_key_value`` column-parallel linear, weight (d, 3, h, k)), the four kernels
    of the core (:func:`attention`) and the output projection.

    Megatron-LM cuts the product's output into q, k and v by views (``split_tensor_along_last_dim``); here the
    scores read q and k, the context v, straight from it: index ``c + 0``, ``c + 1`` and ``c + 2`` of its (3)
    axis, ``c`` a dimension of extent 1. One product, so the gradient of its input is one tensor, reduced
    once over the tensor-parallel group (three separate products each reduce their own), and its output is
    kept once for the backward (3 s b h / t elements per layer, what the three products kept)."""
    d = x.shape[-1]
    kd = d // heads
    qkv = b.add(ops.einsum(f"{p}qkv", "bsd,dchk->bschk", x, ops.Param((d, 3, heads, kd)), kind="attn_proj"))

    def reads(op: Operator, index: dict[int, int]) -> Operator:  # input slot -> the index of the (3) axis it reads
        ins = list(op.inputs)
        for slot, at in index.items():
            t = ins[slot]
            ins[slot] = dataclasses.replace(t, axes=tuple(dataclasses.replace(a, offset=at, partial=True)
                                                         if a.dim == "c" else a for a in t.axes))
        return dataclasses.replace(op, inputs=tuple(ins), dims=tuple((n, 1 if n == "c" else e) for n, e in op.dims))

    s = b.add(reads(ops.einsum(f"{p}scores", "bschk,btchk->bhst", qkv, qkv, kind="attn_scores"), {0: 0, 1: 1}))
    s = b.add(dataclasses.replace(ops.softmax(f"{p}softmax", s, letters="bhst"), kind="attn_scores",
                                  kernel_io=MEGATRON_IO["softmax"]))
    s = b.add(dataclasses.replace(ops.elementwise(f"{p}dropout", s, kind="attn_scores", letters="bhst"),
                                  saved=1.5, kernel_io=MEGATRON_IO["dropout"]))
    ctx = b.add(reads(ops.einsum(f"{p}context", "bhst,btchk->bshk", s, qkv, kind="attn_context"), {1: 2}))
    return b.add(ops.einsum(f"{p}out", "bshk,hkd->bsd", ctx, ops.Param((heads, kd, d)), kind="attn_out"))


def rms_norm(name: str, x: TensorRef) -> Operator:
    """RMS normalisation over the last axis ``d`` with a gain (Zhang and Sennrich 2019):
    ``y = x / sqrt(mean_d(x^2) + eps) * g``.

    The layer-norm description (:func:`shardplan.ops.layer_norm`) with what
    differs: one statistic per row (the mean square; a split of ``d``
    all-reduces 1 value per row, not 2), the gain only (no bias), and 4
    FLOPs per element (square, sum, scale by the reciprocal root, gain)
    instead of 8.
    """
    ln = ops.layer_norm(name, x)
    return dataclasses.replace(ln, kind="rms_norm", weights=ln.weights[:1], norm_stats=1, flops_per_point=4.0)


def decoder_start(name: str, batch: int, seq: int, vocab: int, d_model: int) -> tuple[GraphBuilder, TensorRef, TensorRef]:
    """A decoder's builder, its ``labels`` input (batch, seq) and the token embedding ``embed`` of its ``tokens``
    input: x[b, s, :] = E[tokens[b, s], :], a (vocab, d_model) table."""
    b = GraphBuilder(name)
    ids = b.input("tokens", (batch, seq))
    labels = b.input("labels", (batch, seq))
    return b, labels, b.add(ops.embedding("embed", ids, vocab, d_model))
