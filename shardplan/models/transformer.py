"""Encoder-decoder Transformer (Vaswani et al. 2017) with post-layer-norm blocks.

Attention is six einsum vertices over (b, s, h, k) (see
:func:`shardplan.models._blocks.attention`) so heads are a splittable
dimension; the feed-forward block is two einsums ``ffn1`` (dims ``bsed``,
ReLU fused) and ``ffn2`` (dims ``bsde``) with ``e`` the hidden width.
Per encoder layer ``enc{i}``: q, k, v, scores, context, out, add1, ln1,
ffn1, ffn2, add2, ln2 (12 vertices); per decoder layer ``dec{i}``: the same
with ``self_`` attention, then ``cross_`` attention whose keys and values
come from the encoder output (shared by every decoder layer), add/ln, and
the feed-forward block (20 vertices). Around them: ``src_embed``,
``tgt_embed`` (dims ``bsdv``), the vocabulary projection ``fc`` (dims
``bsvd``) and ``softmax`` (cross-entropy). Positional encodings
(sinusoidal, no parameters, an elementwise add) are left out.

Small setting (default): d_model 512, 8 heads, d_ff 2048, vocab 50,000,
sequence 256, 6 + 6 layers; "big": 1024 / 16 / 4096.
"""

from __future__ import annotations

from shardplan import ops
from shardplan.ir import Graph, GraphBuilder, TensorRef
from shardplan.models._blocks import attention, check_stack

__all__ = ["transformer", "transformer_big", "ffn"]


def ffn(b: GraphBuilder, prefix: str, x: TensorRef, d_ff: int) -> TensorRef:
    """Two einsums ``{prefix}/ffn1`` (b,s,d)->(b,s,e) (activation fused) and ``{prefix}/ffn2`` back to d."""
    d = x.shape[-1]
    h = b.add(ops.einsum(f"{prefix}/ffn1", "bsd,de->bse", x, ops.Param((d, d_ff)), kind="ffn"))
    return b.add(ops.einsum(f"{prefix}/ffn2", "bse,ed->bsd", h, ops.Param((d_ff, d)), kind="ffn"))


def _add_ln(b: GraphBuilder, prefix: str, i: int, x: TensorRef, y: TensorRef) -> TensorRef:
    s = b.add(ops.elementwise(f"{prefix}/add{i}", x, y, kind="add", letters="bsd"))
    return b.add(ops.layer_norm(f"{prefix}/ln{i}", s))


def transformer(batch: int = 64, seq: int = 256, vocab: int = 50_000, d_model: int = 512, heads: int = 8,
                d_ff: int = 2048, layers: int = 6, name: str = "transformer") -> Graph:
    """Encoder-decoder Transformer with ``layers`` encoder and ``layers`` decoder layers."""
    check_stack(name, layers, d_model, heads)
    b = GraphBuilder(name)
    src = b.input("src_tokens", (batch, seq))
    tgt = b.input("tgt_tokens", (batch, seq))
    labels = b.input("labels", (batch, seq))
    x = b.add(ops.embedding("src_embed", src, vocab, d_model))
    for i in range(1, layers + 1):
        p = f"enc{i}"
        x = _add_ln(b, p, 1, x, attention(b, p, x, x, heads))
        x = _add_ln(b, p, 2, x, ffn(b, p, x, d_ff))
    memory = x
    y = b.add(ops.embedding("tgt_embed", tgt, vocab, d_model))
    for i in range(1, layers + 1):
        p = f"dec{i}"
        y = _add_ln(b, p, 1, y, attention(b, p, y, y, heads, tag="self_"))
        y = _add_ln(b, p, 2, y, attention(b, p, y, memory, heads, tag="cross_"))
        y = _add_ln(b, p, 3, y, ffn(b, p, y, d_ff))
    h = b.add(ops.dense("fc", y, vocab, letters="bsvd"))
    b.add(ops.softmax_cross_entropy("softmax", h, labels, letters="bsv"))
    return b.build()


def transformer_big(batch: int = 64, seq: int = 256, vocab: int = 50_000, layers: int = 6) -> Graph:
    """The "big" setting: d_model 1024, 16 heads, d_ff 4096."""
    return transformer(batch, seq, vocab, 1024, 16, 4096, layers, name="transformer_big")
