"""A GPT-style decoder-only language model with pre-layer-norm blocks.

Per layer ``L{i}``: ln1, q, k, v, scores (causal softmax fused), context,
out, add1, ln2, ffn1 (GELU fused), ffn2, add2: 12 vertices. Around them:
``embed`` (dims ``bsdv``), ``ln_f``, the vocabulary projection ``fc``
(``bsvd``; weight tying with the embedding is not modelled: the two are
separate tensors) and ``softmax`` (cross-entropy). Learned position
embeddings (an add of a (seq, d) table) are left out.

The "1.3b" setting is GPT-3 XL: 24 layers, d_model 2048, 16 heads, sequence
2048, d_ff = 4 d_model. Its vocabulary is padded from 50,257 to 50,304
(= 128 * 393) as Megatron-LM does, so the vocabulary can be split 2, 4, ..., 128
ways (50,257 = 29 * 1733 has almost no useful divisors).
"""

from __future__ import annotations

from shardplan import ops
from shardplan.ir import Graph, GraphBuilder
from shardplan.models._blocks import attention, check_stack
from shardplan.models.transformer import ffn

__all__ = ["gpt", "GPT_SIZES"]

GPT_SIZES: dict[str, dict[str, int]] = {
    "tiny": {"layers": 2, "d_model": 256, "heads": 4, "seq": 128, "vocab": 8192},
    "125m": {"layers": 12, "d_model": 768, "heads": 12, "seq": 2048, "vocab": 50304},
    "1.3b": {"layers": 24, "d_model": 2048, "heads": 16, "seq": 2048, "vocab": 50304},
}


def gpt(batch: int = 64, layers: int = 24, d_model: int = 2048, heads: int = 16, seq: int = 2048,
        vocab: int = 50304, d_ff: int | None = None, name: str = "gpt") -> Graph:
    """Decoder-only Transformer; defaults are the "1.3b" setting (d_ff defaults to 4 d_model)."""
    check_stack(name, layers, d_model, heads)
    d_ff = 4 * d_model if d_ff is None else d_ff
    b = GraphBuilder(name)
    ids = b.input("tokens", (batch, seq))
    labels = b.input("labels", (batch, seq))
    x = b.add(ops.embedding("embed", ids, vocab, d_model))
    for i in range(1, layers + 1):
        p = f"L{i}"
        h = b.add(ops.layer_norm(f"{p}/ln1", x))
        x = b.add(ops.elementwise(f"{p}/add1", x, attention(b, p, h, h, heads), kind="add", letters="bsd"))
        h = b.add(ops.layer_norm(f"{p}/ln2", x))
        x = b.add(ops.elementwise(f"{p}/add2", x, ffn(b, p, h, d_ff), kind="add", letters="bsd"))
    x = b.add(ops.layer_norm("ln_f", x))
    h = b.add(ops.dense("fc", x, vocab, letters="bsvd"))
    b.add(ops.softmax_cross_entropy("softmax", h, labels, letters="bsv"))
    return b.build()
