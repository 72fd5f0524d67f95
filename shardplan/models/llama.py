"""Llama: a decoder-only language model with RMSNorm, grouped-query attention, rotary positions and SwiGLU.

Per layer ``L{i}`` (15 vertices; 16 with ``attention="unfused"``), pre-normalised as in Touvron et al. 2023
and Dubey et al. 2024:

* ``ln1`` RMSNorm (:func:`~shardplan.models._blocks.rms_norm`);
* grouped-query attention with ``heads`` query heads sharing ``kv_heads``
  key/value heads, head width k = d_model / heads. Query heads are two
  dimensions, ``h`` (the key/value group, ``kv_heads``) and ``r`` (queries
  per group, ``heads / kv_heads``), so the group a query head reads is an
  index, not a division, and every product is an einsum:
  ``q`` (``bsd,dhrk->bshrk``), ``k`` and ``v`` (``btd,dhk->bthk``),
  ``rope_q`` and ``rope_k`` (rotary position embedding, elementwise),
  ``attention``, the core as one FlashAttention operator
  (:func:`~shardplan.ops.flash_attention`, dims ``bshrkt``: no (s, t) tensor in memory, the scores
  recomputed in the backward), or with ``attention="unfused"``
  ``scores`` (``bshrk,bthk->bhrst``, causal softmax over ``t`` fused as in
  :func:`~shardplan.models._blocks.attention`: 5 FLOPs per score added to
  the contraction's 2 k), ``context`` (``bhrst,bthk->bshrk``) and ``out``
  (``bshrk,hrkd->bsd``); ``add1`` the residual;
* ``ln2`` RMSNorm; the SwiGLU MLP: ``gate`` and ``up`` (``bsd,de->bse``),
  ``swiglu`` = SiLU(gate) * up (elementwise over ``bse``), ``down``
  (``bse,ed->bsd``); ``add2`` the residual.

Around them: ``embed`` (dims ``bsdv``), the final RMSNorm ``ln_f``, the
untied output projection ``fc`` (``bsvd``) and ``softmax`` (cross-entropy).
The names follow :func:`~shardplan.models.gpt.gpt`, so pipeline stages see
the blocks ``L1 .. Ln`` as identical units.

Rotary embedding rotates each pair (i, i + k/2) of a head's features by a
position-dependent angle: ``x cos + rotate_half(x) sin``, 3 FLOPs per
element (2 multiplies, 1 add). The cos/sin tables are constants of
(position, feature), computed once, with no gradient; they are not
represented as tensors. A rotation pairs features from both halves of the
head, so ``k`` is not split in ``rope_q`` / ``rope_k`` (a fixed dimension).
SiLU(g) * u = g / (1 + exp(-g)) * u: 4 FLOPs per element (exp, add,
divide, multiply).

Named sizes (:data:`LLAMA3`): Llama 3 8B, 70B and 405B with the shapes of
Dubey et al. 2024 ("The Llama 3 Herd of Models"), Table 3, and a tiny size
for tests.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from shardplan import ops
from shardplan.errors import ShardplanError
from shardplan.ir import Graph, GraphBuilder, Operator, TensorRef
from shardplan.models._blocks import (
    check_attention,
    check_stack,
    decoder_start,
    rms_norm,
)

__all__ = ["llama", "LlamaConfig", "LLAMA3", "gqa_attention", "rope", "swiglu_mlp"]

ROPE_FLOPS = 3.0  # x cos + rotate_half(x) sin: 2 multiplies and 1 add per element
SWIGLU_FLOPS = 4.0  # g / (1 + exp(-g)) * u: exp, add, divide, multiply per element
SOFTMAX_FLOPS = 5.0  # max, subtract, exp, sum, divide per score (as the zoo's other attention)


@dataclass(frozen=True)
class LlamaConfig:
    """The sizes of a Llama model: ``layers`` blocks of width ``d_model``, ``heads`` query heads and
    ``kv_heads`` key/value heads of width d_model / heads, SwiGLU width ``d_ff``, vocabulary ``vocab``,
    context ``seq``."""

    layers: int
    d_model: int
    heads: int
    kv_heads: int
    d_ff: int
    vocab: int
    seq: int
    attention: str = "flash"

    def __post_init__(self) -> None:
        check_attention("LlamaConfig", self.attention)
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "attention":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ShardplanError(f"LlamaConfig: {f.name}={v!r} must be a positive integer")
        check_heads("LlamaConfig", self.d_model, self.heads, self.kv_heads)

    @property
    def head_dim(self) -> int:
        """k = d_model / heads."""
        return self.d_model // self.heads

    def sizes(self) -> dict[str, int | str]:
        """The keyword sizes of :func:`llama` (``attention`` only when it is not the default, flash)."""
        out = dataclasses.asdict(self)
        return out if self.attention != "flash" else {k: v for k, v in out.items() if k != "attention"}

    def params(self) -> int:
        """Weights of the model (and of the graph :func:`llama` builds), exactly:

        ``l (2 h^2 + 2 h g k + 3 h f + 2 h) + 2 V h + h``

        with h = d_model, g k the key/value width (kv_heads * head_dim), f = d_ff: per layer the query and
        output projections (h x h each), key and value (h x g k each), gate, up and down (h x f each) and two
        RMSNorm gains; the embedding and the untied output projection (V x h each) and the final norm's gain.
        """
        h, l, kv = self.d_model, self.layers, self.kv_heads * self.head_dim
        return l * (2 * h * h + 2 * h * kv + 3 * h * self.d_ff + 2 * h) + 2 * self.vocab * h + h


def check_heads(model: str, d_model: int, heads: int, kv_heads: int) -> None:
    """Refuse head counts that make no grouped-query attention: ``heads`` must divide ``d_model`` and
    ``kv_heads`` must divide ``heads``."""
    if heads < 1 or d_model % heads:
        raise ShardplanError(f"model {model!r}: heads={heads} must be a positive divisor of d_model={d_model}")
    if kv_heads < 1 or heads % kv_heads:
        raise ShardplanError(f"model {model!r}: kv_heads={kv_heads} must be a positive divisor of heads={heads}")


# Dubey et al. 2024, "The Llama 3 Herd of Models", Table 3: layers, model dimension, FFN dimension, attention
# heads, key/value heads. Vocabulary: Table 3 prints "128,000"; the released models' embedding has 128,256 rows
# (the 128K tokens of §3.1 plus 256 reserved special tokens: vocab_size in the published checkpoints' config).
# Sequence: 8,192 tokens, the pre-training length before the long-context stage (§3.4.1; 405B started at 4,096
# and doubled to 8,192; §3.4.2 then extends to 128K).
LLAMA3: dict[str, LlamaConfig] = {
    "llama3-8b": LlamaConfig(layers=32, d_model=4096, heads=32, kv_heads=8, d_ff=14336, vocab=128256, seq=8192),
    "llama3-70b": LlamaConfig(layers=80, d_model=8192, heads=64, kv_heads=8, d_ff=28672, vocab=128256, seq=8192),
    "llama3-405b": LlamaConfig(layers=126, d_model=16384, heads=128, kv_heads=8, d_ff=53248, vocab=128256,
                               seq=8192),
    # not published: a small size with the same structure (4 query heads per key/value head) for tests
    "llama3-tiny": LlamaConfig(layers=2, d_model=256, heads=8, kv_heads=2, d_ff=768, vocab=8192, seq=128),
}


def rope(name: str, x: TensorRef, letters: str) -> Operator:
    """Rotary position embedding of ``x`` (its last axis the head features ``k``): an elementwise operator of
    3 FLOPs per element whose ``k`` is not split (a rotation pairs features i and i + k/2)."""
    if letters[-1] != "k":
        raise ShardplanError(f"operator {name!r}: rope needs the head features last (letters ending in 'k'), "
                             f"got {letters!r}")
    op = ops.elementwise(name, x, flops_per_point=ROPE_FLOPS, kind="rope", letters=letters)
    return dataclasses.replace(op, fixed=frozenset({"k"}))


def gqa_attention(b: GraphBuilder, prefix: str, x: TensorRef, heads: int, kv_heads: int,
                  head_dim: int | None = None, attention: str = "flash") -> TensorRef:
    """Causal self-attention of ``x`` (b, s, d) with ``heads`` query heads in ``kv_heads`` groups, each group
    sharing one key/value head, and rotary positions on queries and keys (module docstring): vertices
    ``{prefix}/q, k, v, rope_q, rope_k, attention, out`` with ``attention="flash"`` (one FlashAttention
    operator, :func:`shardplan.ops.flash_attention`, dims ``bshrkt``), ``{prefix}/q, k, v, rope_q, rope_k,
    scores, context, out`` with ``"unfused"``. Heads are ``head_dim`` wide (default d / heads). Returns the
    output (b, s, d)."""
    d = x.shape[-1]
    check_heads(prefix, d, heads, kv_heads)
    g, r, kd = kv_heads, heads // kv_heads, head_dim or d // heads
    p = f"{prefix}/"
    q = b.add(ops.einsum(f"{p}q", "bsd,dhrk->bshrk", x, ops.Param((d, g, r, kd)), kind="attn_proj"))
    k = b.add(ops.einsum(f"{p}k", "btd,dhk->bthk", x, ops.Param((d, g, kd)), kind="attn_proj"))
    v = b.add(ops.einsum(f"{p}v", "btd,dhk->bthk", x, ops.Param((d, g, kd)), kind="attn_proj"))
    q = b.add(rope(f"{p}rope_q", q, "bshrk"))
    k = b.add(rope(f"{p}rope_k", k, "bthk"))
    if attention == "flash":
        ctx = b.add(ops.flash_attention(f"{p}attention", q, k, v, "bshrk", "bthk"))
        return b.add(ops.einsum(f"{p}out", "bshrk,hrkd->bsd", ctx, ops.Param((g, r, kd, d)), kind="attn_out"))
    check_attention(prefix, attention)
    scores = ops.einsum(f"{p}scores", "bshrk,bthk->bhrst", q, k, kind="attn_scores")
    s = b.add(dataclasses.replace(scores, norm_dims=("t",), norm_stats=2, flops_per_point=2.0 + SOFTMAX_FLOPS / kd))
    ctx = b.add(ops.einsum(f"{p}context", "bhrst,bthk->bshrk", s, v, kind="attn_context"))
    return b.add(ops.einsum(f"{p}out", "bshrk,hrkd->bsd", ctx, ops.Param((g, r, kd, d)), kind="attn_out"))


def swiglu_mlp(b: GraphBuilder, prefix: str, x: TensorRef, d_ff: int) -> TensorRef:
    """``down(SiLU(gate(x)) * up(x))``: vertices ``{prefix}/gate, up, swiglu, down``, the hidden dimension
    ``e`` of width ``d_ff``. The elementwise ``swiglu`` has kind "ffn" like the products around it (the
    Megatron-LM baseline splits a feed-forward operator's ``e``)."""
    d = x.shape[-1]
    gate = b.add(ops.einsum(f"{prefix}/gate", "bsd,de->bse", x, ops.Param((d, d_ff)), kind="ffn"))
    up = b.add(ops.einsum(f"{prefix}/up", "bsd,de->bse", x, ops.Param((d, d_ff)), kind="ffn"))
    act = b.add(ops.elementwise(f"{prefix}/swiglu", gate, up, flops_per_point=SWIGLU_FLOPS, kind="ffn",
                                letters="bse"))
    return b.add(ops.einsum(f"{prefix}/down", "bse,ed->bsd", act, ops.Param((d_ff, d)), kind="ffn"))


def llama(batch: int = 64, layers: int = 32, d_model: int = 4096, heads: int = 32, kv_heads: int = 8,
          d_ff: int = 14336, vocab: int = 128256, seq: int = 8192, attention: str = "flash",
          name: str = "llama") -> Graph:
    """Llama decoder (module docstring); the defaults are Llama 3 8B (:data:`LLAMA3`). ``attention``: the core
    as FlashAttention (``"flash"``, the default: the fused kernel today's stacks train Llama with, PyTorch's
    SDPA or Transformer Engine) or
    ``"unfused"`` (:data:`~shardplan.models._blocks.ATTENTIONS`)."""
    check_stack(name, layers)
    check_heads(name, d_model, heads, kv_heads)
    check_attention(name, attention)
    b, labels, x = decoder_start(name, batch, seq, vocab, d_model)
    for i in range(1, layers + 1):
        p = f"L{i}"
        h = b.add(rms_norm(f"{p}/ln1", x))
        x = b.add(ops.elementwise(f"{p}/add1", x, gqa_attention(b, p, h, heads, kv_heads, attention=attention),
                                  kind="add",
                                  letters="bsd"))
        h = b.add(rms_norm(f"{p}/ln2", x))
        x = b.add(ops.elementwise(f"{p}/add2", x, swiglu_mlp(b, p, h, d_ff), kind="add", letters="bsd"))
    x = b.add(rms_norm("ln_f", x))
    h = b.add(ops.dense("fc", x, vocab, letters="bsvd"))
    b.add(ops.softmax_cross_entropy("softmax", h, labels, letters="bsv"))
    return b.build()
