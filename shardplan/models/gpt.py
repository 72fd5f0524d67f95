"""A GPT-style decoder-only language model with pre-layer-norm blocks, and its published sizes.

Per layer ``L{i}``: ln1, q, k, v, scores (causal softmax fused), context,
out, add1, ln2, ffn1 (GELU fused), ffn2, add2: 12 vertices.

``kernels="megatron"`` builds the layer as Megatron-LM ran it in 2021-22
(its ``ParallelTransformerLayer``, the runs of SC'21 and Korthikanti et al.),
one vertex per kernel that moves a tensor through memory: one query-key-value
product ``qkv`` (its ``query_key_value`` linear), the attention core
as four kernels (scores, softmax, dropout, context; see
:func:`shardplan.models._blocks.attention`), ``gelu`` after ffn1 (Megatron's
fused bias-GELU, a kernel of its own reading and writing the (b, s, 4h)
tensor; kind ``ffn`` so tensor parallelism splits it as ffn1), and add1/add2
as the fused bias-dropout-add (keeping the 1-byte dropout mask beside its
output: ``saved`` 1.5). 13 vertices per layer. Each memory-bound kernel (and the
fp32 cross-entropy) moves what its source moves (:data:`~shardplan.models._blocks.MEGATRON_IO`;
docs/cost-model.md, "Megatron-LM's memory-bound kernels"). Around them:
``embed`` (dims ``bsdv``), ``ln_f``, the vocabulary projection ``fc``
(``bsvd``; weight tying with the embedding is not modelled: the two are
separate tensors) and ``softmax`` (cross-entropy). Learned position
embeddings (an add of a (seq, d) table) and biases are left out.

The "1.3b" setting is GPT-3 XL: 24 layers, d_model 2048, 16 heads, sequence
2048, d_ff = 4 d_model. Its vocabulary is padded from 50,257 to 50,304
(= 128 * 393) as Megatron-LM does, so the vocabulary can be split 2, 4, ..., 128
ways (50,257 = 29 * 1733 has almost no useful divisors).

Named sizes (:data:`GPT3`, :data:`MEGATRON`): the eight models of the GPT-3
paper (Brown et al. 2020, Table 2.1) and the ten of Megatron-LM's scaling
study (Narayanan et al., SC'21, Table 1), as :class:`GPTConfig` values; the
registry (:mod:`shardplan.models`) builds them by name, e.g.
``get_model("gpt3-175b", 8, layers=4)``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from shardplan import ops
from shardplan.errors import ShardplanError
from shardplan.ir import Graph, GraphBuilder, TensorRef
from shardplan.models._blocks import MEGATRON_IO
from shardplan.models._blocks import attention as attention_block
from shardplan.models._blocks import check_attention, check_stack, decoder_start
from shardplan.models.transformer import ffn

__all__ = ["gpt", "KERNELS", "GPT_SIZES", "GPTConfig", "GPT3", "GPT3_PARAMS", "GPT3_VOCAB", "MEGATRON", "MEGATRON_PARAMS",
           "padded_vocab", "gpt_published_params"]

KERNELS = ("fused", "megatron")
"""The kernel sets :func:`gpt` builds a layer from (module docstring): ``fused`` (the default: softmax in the
scores product, GELU in ffn1) or ``megatron`` (Megatron-LM's kernels of 2021-22)."""

# GPT-3's vocabulary: the GPT-2 byte-level BPE of 50,257 tokens (Brown et al. 2020, §2.1: "the same model and
# architecture as GPT-2"; Radford et al. 2019, §2.2).
GPT3_VOCAB = 50257


def padded_vocab(vocab: int, multiple: int = 128) -> int:
    """``vocab`` rounded up to a multiple of ``multiple``: Megatron-LM's ``--make-vocab-size-divisible-by``
    (default 128). 50,257 -> 50,304 = 128 * 393."""
    if vocab < 1 or multiple < 1:
        raise ShardplanError(f"padded_vocab: vocab={vocab} and multiple={multiple} must be positive")
    return -(-vocab // multiple) * multiple


@dataclass(frozen=True)
class GPTConfig:
    """The sizes of a GPT model: ``layers`` blocks of width ``d_model`` with ``heads`` heads of
    d_model/heads, feed-forward width ``d_ff`` (None: 4 d_model), context ``seq``, vocabulary ``vocab``."""

    layers: int
    d_model: int
    heads: int
    seq: int
    vocab: int
    d_ff: int | None = None
    kernels: str = "fused"
    attention: str = "unfused"

    def __post_init__(self) -> None:
        check_attention("GPTConfig", self.attention)
        for key in ("layers", "d_model", "heads", "seq", "vocab"):
            if getattr(self, key) < 1:
                raise ShardplanError(f"GPTConfig: {key}={getattr(self, key)} must be positive")
        if self.d_model % self.heads:
            raise ShardplanError(f"GPTConfig: heads={self.heads} must divide d_model={self.d_model}")
        if self.d_ff is not None and self.d_ff < 1:
            raise ShardplanError(f"GPTConfig: d_ff={self.d_ff} must be positive")
        if self.kernels not in KERNELS:
            raise ShardplanError(f"GPTConfig: kernels={self.kernels!r} is not one of {', '.join(KERNELS)}")

    @property
    def ffn(self) -> int:
        """The feed-forward width: ``d_ff``, or 4 d_model when it is None."""
        return 4 * self.d_model if self.d_ff is None else self.d_ff

    def sizes(self) -> dict[str, int]:
        """The keyword sizes of :func:`gpt` (``d_ff`` only when it is set, ``kernels`` only when not fused,
        ``attention`` only when not unfused)."""
        out: dict = {"layers": self.layers, "d_model": self.d_model, "heads": self.heads, "seq": self.seq,
                     "vocab": self.vocab}
        if self.d_ff is not None:
            out["d_ff"] = self.d_ff
        if self.attention != "unfused":
            out["attention"] = self.attention
        return out if self.kernels == "fused" else {**out, "kernels": self.kernels}

    def params(self) -> int:
        """Weights of the graph :func:`gpt` builds: l (12 h^2 + 4 h) + 2 V h + 2 h with d_ff = 4h
        (q, k, v, out: 4 h^2; the MLP 2 h d_ff; two layer norms' gain and bias: 4 h; untied embedding and
        vocabulary projection; the final layer norm). No biases, no position table."""
        h = self.d_model
        return self.layers * (4 * h * h + 2 * h * self.ffn + 4 * h) + 2 * self.vocab * h + 2 * h


def gpt_published_params(cfg: GPTConfig) -> int:
    """Parameters as the papers count them: P = 12 l h^2 (1 + 13/(12 h) + (V + s)/(12 l h))
    (Narayanan et al., SC'21, §5.1), i.e. per layer 12 h^2 weights and 13 h biases and layer-norm
    parameters, one embedding table tied with the output layer (V h) and learned positions (s h).
    Assumes d_ff = 4 d_model (refused otherwise)."""
    if cfg.ffn != 4 * cfg.d_model:
        raise ShardplanError(f"gpt_published_params: the formula assumes d_ff = 4 d_model, got d_ff={cfg.ffn}")
    h, l = cfg.d_model, cfg.layers
    return 12 * l * h * h + 13 * l * h + (cfg.vocab + cfg.seq) * h


_GPT3_V = padded_vocab(GPT3_VOCAB)  # 50,304: padded as Megatron-LM does (module docstring)

# Brown et al. 2020 ("Language Models are Few-Shot Learners"), Table 2.1: n_layers, d_model, n_heads (d_head =
# d_model / n_heads); n_ctx = 2048 (§2.1). Two rows of the table are not self-consistent and are read as follows:
# GPT-3 XL prints 24 heads of d_head 128 with d_model 2048 (24 * 128 = 3072); 16 heads of 128 keeps d_head and
# d_model (and the 1.3B count). GPT-3 13B prints d_model 5140 with 40 heads of 128 (40 * 128 = 5120, and 5140 is
# not a multiple of 40); d_model 5120 is taken (12.85e9 parameters by the formula below against the table's 13.0B).
GPT3: dict[str, GPTConfig] = {
    "gpt3-125m": GPTConfig(12, 768, 12, 2048, _GPT3_V),     # GPT-3 Small, d_head 64
    "gpt3-350m": GPTConfig(24, 1024, 16, 2048, _GPT3_V),    # GPT-3 Medium, d_head 64
    "gpt3-760m": GPTConfig(24, 1536, 16, 2048, _GPT3_V),    # GPT-3 Large, d_head 96
    "gpt3-1.3b": GPTConfig(24, 2048, 16, 2048, _GPT3_V),    # GPT-3 XL, d_head 128 (table: 24 heads, see above)
    "gpt3-2.7b": GPTConfig(32, 2560, 32, 2048, _GPT3_V),    # d_head 80
    "gpt3-6.7b": GPTConfig(32, 4096, 32, 2048, _GPT3_V),    # d_head 128
    "gpt3-13b": GPTConfig(40, 5120, 40, 2048, _GPT3_V),     # d_head 128 (table: d_model 5140, see above)
    "gpt3-175b": GPTConfig(96, 12288, 96, 2048, _GPT3_V),   # "GPT-3", d_head 128
}

# Brown et al. 2020, Table 2.1, column n_params.
GPT3_PARAMS: dict[str, float] = {
    "gpt3-125m": 125e6, "gpt3-350m": 350e6, "gpt3-760m": 760e6, "gpt3-1.3b": 1.3e9, "gpt3-2.7b": 2.7e9,
    "gpt3-6.7b": 6.7e9, "gpt3-13b": 13.0e9, "gpt3-175b": 175.0e9,
}

# Narayanan et al., SC'21 ("Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"),
# Table 1: layers, hidden, heads; sequence 2048 and vocabulary 51,200 for every row (§5.1).
MEGATRON: dict[str, GPTConfig] = {
    "megatron-1.7b": GPTConfig(24, 2304, 24, 2048, 51200),
    "megatron-3.6b": GPTConfig(30, 3072, 32, 2048, 51200),
    "megatron-7.5b": GPTConfig(36, 4096, 32, 2048, 51200),
    "megatron-18.4b": GPTConfig(40, 6144, 48, 2048, 51200),
    "megatron-39.1b": GPTConfig(48, 8192, 64, 2048, 51200),
    "megatron-76.1b": GPTConfig(60, 10240, 80, 2048, 51200),
    "megatron-145.6b": GPTConfig(80, 12288, 96, 2048, 51200),
    "megatron-310.1b": GPTConfig(96, 16384, 128, 2048, 51200),
    "megatron-529.6b": GPTConfig(105, 20480, 128, 2048, 51200),
    "megatron-1t": GPTConfig(128, 25600, 160, 2048, 51200),
}

# Narayanan et al., SC'21, Table 1, column "Number of parameters (billion)".
MEGATRON_PARAMS: dict[str, float] = {
    "megatron-1.7b": 1.7e9, "megatron-3.6b": 3.6e9, "megatron-7.5b": 7.5e9, "megatron-18.4b": 18.4e9,
    "megatron-39.1b": 39.1e9, "megatron-76.1b": 76.1e9, "megatron-145.6b": 145.6e9, "megatron-310.1b": 310.1e9,
    "megatron-529.6b": 529.6e9, "megatron-1t": 1008.0e9,
}

GPT_SIZES: dict[str, dict[str, int]] = {
    "tiny": {"layers": 2, "d_model": 256, "heads": 4, "seq": 128, "vocab": 8192},
    "125m": GPT3["gpt3-125m"].sizes(),
    "1.3b": GPT3["gpt3-1.3b"].sizes(),
}


def _megatron_mlp(b: GraphBuilder, prefix: str, x: TensorRef, d_ff: int) -> TensorRef:
    """ffn1, Megatron-LM's fused bias-GELU as a kernel of its own (8 FLOPs per element: the tanh
    approximation), ffn2."""
    d = x.shape[-1]
    h = b.add(ops.einsum(f"{prefix}/ffn1", "bsd,de->bse", x, ops.Param((d, d_ff)), kind="ffn"))
    h = b.add(dataclasses.replace(ops.elementwise(f"{prefix}/gelu", h, flops_per_point=8.0, kind="ffn", letters="bse"),
                                  kernel_io=MEGATRON_IO["gelu"]))
    return b.add(ops.einsum(f"{prefix}/ffn2", "bse,ed->bsd", h, ops.Param((d_ff, d)), kind="ffn"))


def gpt(batch: int = 64, layers: int = 24, d_model: int = 2048, heads: int = 16, seq: int = 2048,
        vocab: int = 50304, d_ff: int | None = None, kernels: str = "fused", attention: str = "unfused",
        name: str = "gpt") -> Graph:
    """Decoder-only Transformer; defaults are the "1.3b" setting (d_ff defaults to 4 d_model); ``kernels``:
    one of :data:`KERNELS` (module docstring). ``attention="flash"``: the attention core as one
    FlashAttention operator (:func:`shardplan.ops.flash_attention`) whatever ``kernels`` says; the default
    ``"unfused"`` keeps it as ``kernels`` writes it (Megatron-LM in 2021-22 ran no fused attention)."""
    check_stack(name, layers, d_model, heads)
    check_attention(name, attention)
    if kernels not in KERNELS:
        raise ShardplanError(f"model {name!r}: kernels={kernels!r} is not one of {', '.join(KERNELS)}")
    d_ff = 4 * d_model if d_ff is None else d_ff
    meg = kernels == "megatron"
    saved = 1.5 if meg else 1.0  # the bias-dropout-add's mask beside its output

    def io(op, kernel: str):  # Megatron-LM's kernels move what MEGATRON_IO says; the fused model's, one pass each
        return dataclasses.replace(op, kernel_io=MEGATRON_IO[kernel]) if meg else op

    b, labels, x = decoder_start(name, batch, seq, vocab, d_model)
    for i in range(1, layers + 1):
        p = f"L{i}"
        h = b.add(io(ops.layer_norm(f"{p}/ln1", x), "layer_norm"))
        a = attention_block(b, p, h, h, heads, core="flash" if attention == "flash" else kernels)
        x = b.add(io(dataclasses.replace(ops.elementwise(f"{p}/add1", x, a, kind="add", letters="bsd"), saved=saved),
                     "bias_dropout_add"))
        h = b.add(io(ops.layer_norm(f"{p}/ln2", x), "layer_norm"))
        m = _megatron_mlp(b, p, h, d_ff) if meg else ffn(b, p, h, d_ff)
        x = b.add(io(dataclasses.replace(ops.elementwise(f"{p}/add2", x, m, kind="add", letters="bsd"), saved=saved),
                     "bias_dropout_add"))
    x = b.add(io(ops.layer_norm("ln_f", x), "layer_norm"))
    h = b.add(ops.dense("fc", x, vocab, letters="bsvd"))
    b.add(io(ops.softmax_cross_entropy("softmax", h, labels, letters="bsv"), "cross_entropy"))
    return b.build()
