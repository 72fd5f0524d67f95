"""Training FLOPs of the decoder language models, exactly: the published formulas and the graphs' own count.

Counting rules (Narayanan et al., SC'21, §5.1, whose formula this module
reproduces): only matrix products are counted, 2 FLOPs per multiply-add; a
product's backward pass computes two products of the forward's size (the
gradient of each operand), so one training step costs 3x the forward; with
full activation recomputation each transformer layer runs its forward
twice, 4x. The output (logit) layer is never recomputed (3x); the
embedding is a lookup (no product); normalisation, softmax, rotary
embedding, activations and residual adds are left out. Causal masking is
not subtracted (the whole s x s score matrix is counted, as the papers do).

With batch B, sequence s, layers l, width h, vocabulary V:

**GPT** (4h MLP, multi-head attention). Forward, per layer: q, k, v and
output projections 4 * 2Bsh^2 = 8Bsh^2; scores QK^T and the weighted sum
of values 2 * 2Bs^2h = 4Bs^2h; MLP 2 * 2Bsh(4h) = 16Bsh^2: in all
24Bsh^2 + 4Bs^2h. Logits 2BshV. Hence

* without recomputation: F = 72 B s l h^2 (1 + s/(6h) + V/(12 l h))
  = 72Bslh^2 + 12Bs^2lh + 6BshV;
* with full recomputation (the paper's equation):
  F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) = 96Bslh^2 + 16Bs^2lh + 6BshV.

**Llama** (H query heads, G key/value heads of width k = h/H, SwiGLU width
f). Forward, per layer: q and output projections 2 * 2Bsh^2; k and v
2 * 2Bsh(Gk) = 4Bsh^2 G/H; scores and values 4Bs^2h (queries are h wide
whatever G is); gate, up and down 3 * 2Bshf = 6Bshf: in all
4Bsh^2 (1 + G/H + 3f/(2h) + s/h). Logits 2BshV. Hence

* without recomputation: F = 12 B s l h^2 (1 + G/H + 3f/(2h) + s/h) + 6BshV;
* with full recomputation: F = 16 B s l h^2 (1 + G/H + 3f/(2h) + s/h) + 6BshV.

With G = H and a two-matrix MLP of width 4h (3f/(2h) -> f/h = 4) the Llama
expression is the GPT one: 12 (1 + 1 + 4 + s/h) = 72 (1 + s/(6h)).

**Mixture of experts** (:mod:`~shardplan.models.moe`: E experts of width
f_e, top-k, C slots per expert and sequence, n shared experts, the first
l_d layers dense of width f). Forward, per routed layer: the attention as
Llama's (query width Hk, key/value width Gk: 2Bs(2hHk + 2hGk) + 4Bs^2 Hk);
router 2BshE; dispatch (the one-hot einsum bsec,bsd->becd) 2BsECh; experts
at capacity 3 * 2BEChf_e; combine (becd,bsec->bsd) 2BsECh; shared experts
3 * 2Bsh(n f_e). The dispatch mask has no gradient, so the dispatch's
backward is one product (2x its forward in training, 3x with recomputation);
every other product 3x (4x). Hence, with A the attention's forward,

* F = l_d [3 A + 18 Bshf] + (l - l_d) [3 (A + 2BshE + 6BEChf_e + 2BsECh + 6Bshnf_e) + 2 * 2BsECh] + 6BshV

without recomputation, and with 4 and 3 in place of 3 and 2 with full
recomputation (:func:`moe_flops`). The experts dominate: at C = s k / E
(capacity factor 1) their 6BEChf_e is 6Bskhf_e, a top-k dense MLP's.

FlashAttention's core (the zoo's Llama and MoE default, :func:`~shardplan.ops.flash_attention`) recomputes
q k^T in its backward: the formulas above count model FLOPs (the papers' and MFU's convention) and stay as
they are, while the graph of such a model counts the recomputed product besides, 2Bs^2 (Hk) per layer
(its backward is 5 products of the forward's size, not 4).

All counts are Python integers (no rounding). :func:`graph_flops` counts a
graph the way the cost model does (:mod:`shardplan.cost.operator`:
``flops_per_point`` x points x (1 + tensors with gradients)), as an exact
fraction; tests/test_models_llama.py checks that the formulas equal the
zoo graphs' matrix products and accounts for every other FLOP of the graph.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from fractions import Fraction
from typing import Any, Iterable

from shardplan.errors import ShardplanError
from shardplan.ir import Graph, Operator
from shardplan.models.gpt import GPTConfig, gpt
from shardplan.models.llama import LlamaConfig, llama
from shardplan.models.moe import MoEConfig, moe

__all__ = ["model_flops", "megatron_flops", "moe_flops", "config_of", "decoder_flops", "operator_flops", "graph_flops",
           "is_matmul", "MATMUL_KINDS"]

MATMUL_KINDS = frozenset({"attn_proj", "attn_scores", "attn_context", "attn_flash", "attn_out", "ffn", "dense",
                          "router", "moe_dispatch", "expert", "moe_combine"})
"""Operator kinds of the zoo's matrix products (an operator of these kinds with a reduction dimension)."""


def megatron_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int, recompute: bool = True) -> int:
    """Narayanan et al., SC'21, §5.1: F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) with full recomputation,
    72 B s l h^2 (1 + s/(6h) + V/(12 l h)) without (module docstring), expanded to integers."""
    b, s, l, h, v = (_positive(n, x) for n, x in
                     (("batch", batch), ("seq", seq), ("layers", layers), ("hidden", hidden), ("vocab", vocab)))
    k = 4 if recompute else 3
    return k * (24 * b * s * l * h * h + 4 * b * s * s * l * h) + 6 * b * s * h * v


def decoder_flops(batch: int, seq: int, layers: int, d_model: int, q_width: int, kv_width: int,
                  mlp_weights: int, vocab: int, recompute: bool = False) -> int:
    """Training FLOPs of a decoder stack from its matrix products (module docstring's rules).

    Per layer forward: 2 B s (d q_width + 2 d kv_width + q_width d + mlp_weights) for the projections
    and the MLP (``mlp_weights``: its weight elements, 8 d^2 for GPT, 3 d f for SwiGLU), 4 B s^2 q_width
    for scores and values; logits 2 B s d V. Layers x (4 if ``recompute`` else 3), logits x 3.
    """
    b, s, l, d, q, kv, mlp, v = (_positive(n, x) for n, x in (
        ("batch", batch), ("seq", seq), ("layers", layers), ("d_model", d_model), ("q_width", q_width),
        ("kv_width", kv_width), ("mlp_weights", mlp_weights), ("vocab", vocab)))
    layer = 2 * b * s * (2 * d * q + 2 * d * kv + mlp) + 4 * b * s * s * q
    return (4 if recompute else 3) * l * layer + 3 * 2 * b * s * d * v


def moe_flops(cfg: MoEConfig, batch: int, seq: int | None = None, recompute: bool = False) -> int:
    """Training FLOPs of the mixture-of-experts decoder ``cfg`` (module docstring's formula), ``batch``
    sequences of ``seq`` tokens (default ``cfg.seq``; the capacity follows the sequence)."""
    b = _positive("batch", batch)
    if seq is not None:
        cfg = dataclasses.replace(cfg, seq=_positive("seq", seq))
    s, h, l, ld, f_e, e, c = cfg.seq, cfg.d_model, cfg.layers, cfg.dense_layers, cfg.d_expert, cfg.experts, \
        cfg.capacity
    q, kv = cfg.heads * cfg.kd, cfg.kv_heads * cfg.kd
    k = 4 if recompute else 3
    attn = 2 * b * s * (2 * h * q + 2 * h * kv) + 4 * b * s * s * q
    dense = attn + 3 * 2 * b * s * h * cfg.d_ff
    dispatch = 2 * b * s * e * c * h
    routed = (attn + 2 * b * s * h * e + 3 * 2 * b * e * c * h * f_e + dispatch
              + 3 * 2 * b * s * h * cfg.shared * f_e)
    return ld * k * dense + (l - ld) * (k * routed + (k - 1) * dispatch) + 3 * 2 * b * s * h * cfg.vocab


def config_of(name: str, **sizes: Any) -> GPTConfig | LlamaConfig | MoEConfig:
    """The configuration of registered model ``name`` (a GPT, Llama or MoE builder) with ``sizes`` overriding its
    defaults, e.g. ``config_of("llama3-8b", layers=4)``."""
    from shardplan.models import model_spec

    spec = model_spec(name)
    family = {gpt: GPTConfig, llama: LlamaConfig, moe: MoEConfig}.get(spec.builder)
    if family is None:
        raise ShardplanError(f"model {spec.name!r} has no FLOP formula; it is defined for the GPT, Llama and MoE "
                             "models")
    params = inspect.signature(spec.builder).parameters
    defaults = {k: p.default for k, p in params.items() if k not in ("batch", "name")}
    unknown = sorted(set(sizes) - set(defaults))
    if unknown:
        raise ShardplanError(f"model {spec.name!r} has no size {unknown[0]!r}; sizes: {', '.join(defaults)}")
    merged = {**defaults, **{k: v for k, v in spec.sizes.items() if k != "name"}, **sizes}
    return family(**merged)


def model_flops(model: str | GPTConfig | LlamaConfig | MoEConfig, batch: int, seq: int | None = None, *,
                recompute: bool = False, **sizes: Any) -> int:
    """FLOPs of one training step (forward and backward) of ``batch`` sequences of ``seq`` tokens (default:
    the model's), by the formulas of the module docstring: Megatron-LM's for GPT, its Llama counterpart
    (grouped-query attention, SwiGLU) for Llama. ``model``: a registered name (``"llama3-8b"``,
    ``"gpt3-175b"``, ``"megatron-39.1b"``, ``"gpt"``) or a configuration; ``sizes`` override its sizes.
    ``recompute``: full activation recomputation (every layer's forward twice)."""
    if isinstance(model, str):
        cfg = config_of(model, **sizes)
    elif isinstance(model, (GPTConfig, LlamaConfig, MoEConfig)):
        cfg = dataclasses.replace(model, **sizes) if sizes else model
    else:
        raise ShardplanError(f"model_flops: model must be a model name, GPTConfig, LlamaConfig or MoEConfig, got "
                             f"{model!r}")
    if isinstance(cfg, MoEConfig):
        return moe_flops(cfg, batch, seq, recompute)
    b = _positive("batch", batch)
    s = cfg.seq if seq is None else _positive("seq", seq)
    if isinstance(cfg, GPTConfig):
        h = cfg.d_model
        return decoder_flops(b, s, cfg.layers, h, h, h, 2 * h * cfg.ffn, cfg.vocab, recompute)
    h = cfg.d_model
    return decoder_flops(b, s, cfg.layers, h, h, cfg.kv_heads * cfg.head_dim, 3 * h * cfg.d_ff, cfg.vocab, recompute)


def operator_flops(op: Operator, forwards: int = 1) -> Fraction:
    """A training step's FLOPs of ``op`` as the cost model counts them, exactly: ``flops_per_point`` x points
    x (``forwards`` + tensors with gradients); ``forwards`` = 2 for a recomputed operator. The gradient of an
    operand outside the contraction (:attr:`~shardplan.ir.Operator.epilogue_tensors`, a bias) is one add per
    output point, not a product. A fused backward
    (:attr:`~shardplan.ir.Operator.backward_flops`, FlashAttention's) counts ``backward_flops`` x points in
    place of the gradients' passes. A causal mask is not subtracted (the whole domain, as the formulas)."""
    if op.backward_flops is not None:
        back = Fraction(op.backward_flops) * op.points if op.grad_tensors else Fraction(0)
        return Fraction(op.flops_per_point) * op.points * forwards + back
    epilogue = [t for t in op.epilogue_tensors if t.needs_grad]  # a bias's gradient: one add per output point
    out_points = math.prod(op.output.shape)
    return (Fraction(op.flops_per_point) * op.points * (forwards + len(op.grad_tensors) - len(epilogue))
            + out_points * len(epilogue))


def is_matmul(op: Operator) -> bool:
    """Whether ``op`` is one of the zoo's matrix products (:data:`MATMUL_KINDS` with a reduction dimension)."""
    return op.kind in MATMUL_KINDS and bool(op.reduction_dims)


def graph_flops(graph: Graph, ops: Iterable[Operator] | None = None, recompute: bool = False) -> Fraction:
    """Sum of :func:`operator_flops` over ``ops`` (default: every operator of ``graph``); with ``recompute``
    the operators of the blocks (names with a '/') run their forward twice."""
    chosen = graph.operators if ops is None else tuple(ops)
    return sum((operator_flops(op, 2 if recompute and "/" in op.name else 1) for op in chosen), Fraction(0))


def _positive(name: str, x: Any) -> int:
    from shardplan.checks import MAX_EXTENT, integer

    return integer(f"flops: {name}", x, 1, MAX_EXTENT)
