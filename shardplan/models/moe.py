"""Mixture-of-experts decoders: a Llama block whose MLP is a routed layer of experts (Mixtral, DeepSeek-V3 like).

The layer is GShard's (Lepikhin et al. 2021, §2.2 and Algorithm 1): tokens are
routed in *groups* (here one sequence: the group dimension is the batch ``b``,
each group of ``s`` tokens), every expert takes at most ``C`` tokens of a
group (its *capacity*), and dispatch and combine are dense contractions with
a one-hot tensor, so that every step is an einsum whose dimensions the search
may split. Per block ``L{i}`` (after the attention of
:mod:`shardplan.models.llama`), with E experts, top-k routing, expert width f:

* ``moe/router``: the logits ``bsd,de->bse`` (E outputs per token);
* ``moe/gate``: softmax over the experts, the top k, and each chosen
  (token, expert) pair's slot among the expert's C slots of the group (a
  running count over the group's tokens, dropped past C): the combine
  tensor ``G[b,s,e,c]`` (the gate weight at the token's slot, 0 elsewhere).
  Dims ``bsec``: ``e`` is normalised over (softmax and top-k statistics) and
  ``s`` is fixed (a slot depends on every earlier token of the group);
* ``moe/dispatch``: ``bsec,bsd->becd`` with the one-hot mask of G (no
  gradient flows into the mask): the tokens laid out per expert and slot;
* the experts, one batched product over ``e`` each: ``moe/expert_in``, the
  gate and up projections stacked (``becd,edgf->becgf``, weight [E, d, 2, f],
  g = 2, as grouped-GEMM implementations fuse them, so that the dispatched
  tokens are read by one operator), ``moe/expert_act`` SiLU(gate) * up over
  ``becf``, ``moe/expert_down`` ``becf,efd->becd`` (weight [E, f, d]);
* ``moe/combine``: ``becd,bsec->bsd`` with G (the gate weights, which carry
  the router's gradient);
* with shared experts (DeepSeek-V3): a SwiGLU MLP ``moe/shared/*`` of width
  ``shared * f`` on every token, and ``moe/sum`` adding it to the combine.

Expert parallelism is a plan of this space: ``dispatch`` with its batch
split and the experts with ``e`` split. The dispatched tensor [b, e, c, d]
then moves from a batch-split to an expert-split layout (and the experts'
output back before ``combine``): the cost model's exact redistribution
volume of that edge is the all-to-all's, (g-1)/g of each device's tile sent
in a group of g (tests/cost/test_moe_cost.py checks it by hand).

Capacity: ``C = ceil(capacity_factor · s · k / E)`` slots per expert and
group (GShard's expert capacity; 1.25 is the Switch Transformer's training
value, Fedus et al. 2022, §2.2). The experts compute at capacity (E · C
slots per group, whether filled or not), as a capacity-based implementation
does. Routing details that change neither the work counted nor the data
moved (auxiliary balancing losses, DeepSeek-V3's sigmoid scores, bias-based
balancing and node-limited routing) are not represented.

Named sizes (:data:`MOE`):

* ``mixtral-8x7b``: Jiang et al. 2024, "Mixtral of Experts", Table 1 (32
  layers, d 4096, 32 heads / 8 KV of width 128, expert width 14336, 8
  experts, top-2, vocabulary 32000); sequence 4096 (an assumption: the
  paper gives the 32k context it was trained to, not the pre-training
  sequence length);
* ``deepseek-v3``: DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", §4.2
  (61 layers, d 7168, 128 heads of width 128, the first 3 layers dense with
  width 18432, then 1 shared + 256 routed experts of width 2048, top-8,
  sequence 4K; vocabulary 129,280, the released config). Simplified:
  multi-head latent attention is described as ordinary multi-head attention
  of 128 heads of width 128 (MLA's low-rank projections of queries and of
  the compressed key/value, and its decoupled rotary key, are not; this
  overstates the attention's weights, about 0.47B per layer against
  MLA's 0.19B) and the multi-token-prediction module is left out;
* ``mixtral-tiny``, ``deepseek-tiny``: small sizes of the same structure for tests.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from shardplan import ops
from shardplan.errors import ShardplanError
from shardplan.ir import Graph, GraphBuilder, Operator, Tensor, TensorRef
from shardplan.models._blocks import (
    check_attention,
    check_stack,
    decoder_start,
    rms_norm,
)
from shardplan.models.llama import SWIGLU_FLOPS, check_heads, gqa_attention, swiglu_mlp

__all__ = ["moe", "MoEConfig", "MOE", "moe_layer", "capacity", "gate", "swiglu_pair", "GATE_LOGIT_FLOPS",
           "EXPERT_KINDS"]

GATE_LOGIT_FLOPS = 7.0
"""Work per router logit in ``gate``: softmax (max, subtract, exp, sum, divide: 5), the top-k selection
(1 comparison per logit and pass, counted once) and the running slot count (1)."""

EXPERT_KINDS = frozenset({"expert"})
"""Operator kind of the experts' batched products (and their activation): the operators that expert
parallelism splits over ``e``."""


def capacity(seq: int, experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert and group of ``seq`` tokens: ``ceil(capacity_factor · seq · top_k / experts)``, at
    most ``seq`` (an expert never takes a token twice)."""
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)) or not (
            capacity_factor > 0 and math.isfinite(capacity_factor)):
        raise ShardplanError(f"moe: capacity_factor={capacity_factor!r} must be a positive number")
    return max(1, min(seq, math.ceil(capacity_factor * seq * top_k / experts - 1e-9)))


def gate(name: str, logits: TensorRef, slots: int, top_k: int) -> Operator:
    """Top-k gating with capacity: the combine tensor ``G[b,s,e,c]`` from the logits ``[b,s,e]`` (module
    docstring). Dims ``bsec``; ``e`` normalised over (max and sum of the softmax: 2 statistics), ``s`` fixed.
    Work: :data:`GATE_LOGIT_FLOPS` per logit and 1 per point written, i.e. ``1 + 7 / C`` per point."""
    if len(logits.shape) != 3:
        raise ShardplanError(f"operator {name!r}: gate needs logits (batch, tokens, experts), got {logits.shape}")
    bsz, s, e = logits.shape
    if not 1 <= top_k <= e:
        raise ShardplanError(f"operator {name!r}: top_k={top_k} must be between 1 and the {e} experts")
    dims = (("b", bsz), ("s", s), ("e", e), ("c", slots))
    xin = Tensor("logits", logits.shape, ("b", "s", "e"), "input", needs_grad=logits.needs_grad, src=logits.name)
    out = Tensor("y", (bsz, s, e, slots), ("b", "s", "e", "c"), "output")
    return Operator(name, "moe_gate", dims, (xin,), out, flops_per_point=1.0 + GATE_LOGIT_FLOPS / slots,
                    norm_dims=("e",), norm_stats=2, fixed=frozenset({"s"}))


def swiglu_pair(name: str, gu: TensorRef) -> Operator:
    """``SiLU(gate) * up`` of the stacked pair ``gu[b,e,c,g,f]`` (g = 0 the gate, 1 the up projection): dims
    ``becf``, the pair axis read whole, :data:`~shardplan.models.llama.SWIGLU_FLOPS` per point."""
    bsz, e, c, two, f = gu.shape
    if two != 2:
        raise ShardplanError(f"operator {name!r}: the gate/up pair axis must have extent 2, got {gu.shape}")
    xin = Tensor("x", gu.shape, ("b", "e", "c", None, "f"), "input", needs_grad=gu.needs_grad, src=gu.name)
    out = Tensor("y", (bsz, e, c, f), ("b", "e", "c", "f"), "output")
    return Operator(name, "expert", (("b", bsz), ("e", e), ("c", c), ("f", f)), (xin,), out,
                    flops_per_point=SWIGLU_FLOPS)


def moe_layer(b: GraphBuilder, prefix: str, x: TensorRef, experts: int, top_k: int, d_expert: int,
              slots: int, shared: int = 0) -> TensorRef:
    """The routed layer of the module docstring on ``x`` (b, s, d): vertices ``{prefix}/router, gate,
    dispatch, expert_in, expert_act, expert_down, combine`` (and ``shared/*``, ``sum`` with
    ``shared`` shared experts). Returns the output (b, s, d)."""
    if experts < 1 or d_expert < 1 or slots < 1 or shared < 0:
        raise ShardplanError(f"{prefix}: experts={experts}, d_expert={d_expert}, capacity={slots} must be "
                             f">= 1 and shared={shared} >= 0")
    d = x.shape[-1]
    p = f"{prefix}/"
    logits = b.add(ops.einsum(f"{p}router", "bsd,de->bse", x, ops.Param((d, experts)), kind="router"))
    comb = b.add(gate(f"{p}gate", logits, slots, top_k))
    disp = ops.einsum(f"{p}dispatch", "bsec,bsd->becd", comb, x, kind="moe_dispatch")
    mask = dataclasses.replace(disp.inputs[0], name="mask", needs_grad=False)
    h = b.add(dataclasses.replace(disp, inputs=(mask, disp.inputs[1])))
    gu = b.add(ops.einsum(f"{p}expert_in", "becd,edgf->becgf", h, ops.Param((experts, d, 2, d_expert)),
                          kind="expert"))
    a = b.add(swiglu_pair(f"{p}expert_act", gu))
    y = b.add(ops.einsum(f"{p}expert_down", "becf,efd->becd", a, ops.Param((experts, d_expert, d)), kind="expert"))
    out = b.add(ops.einsum(f"{p}combine", "becd,bsec->bsd", y, comb, kind="moe_combine"))
    if shared:
        s = swiglu_mlp(b, f"{p}shared", x, shared * d_expert)
        out = b.add(ops.elementwise(f"{p}sum", out, s, kind="add", letters="bsd"))
    return out


@dataclass(frozen=True)
class MoEConfig:
    """The sizes of a mixture-of-experts decoder (module docstring): ``layers`` blocks of width ``d_model``,
    ``heads`` query heads and ``kv_heads`` key/value heads of width ``head_dim`` (0: d_model / heads); the
    first ``dense_layers`` blocks have a SwiGLU MLP of width ``d_ff``, the others ``experts`` routed experts
    of width ``d_expert`` (top ``top_k``) and ``shared`` shared ones; vocabulary ``vocab``, context ``seq``;
    ``capacity_factor`` sets the slots per expert (:func:`capacity`)."""

    layers: int
    d_model: int
    heads: int
    kv_heads: int
    d_ff: int
    experts: int
    top_k: int
    d_expert: int
    vocab: int
    seq: int
    shared: int = 0
    dense_layers: int = 0
    head_dim: int = 0
    capacity_factor: float = 1.25
    attention: str = "flash"

    def __post_init__(self) -> None:
        check_attention("MoEConfig", self.attention)
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "attention":
                continue
            if f.name == "capacity_factor":
                capacity(1, 1, 1, v)
                continue
            low = 0 if f.name in ("shared", "dense_layers", "head_dim") else 1
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ShardplanError(f"MoEConfig: {f.name}={v!r} must be an integer >= {low}")
        check_heads("MoEConfig", self.d_model, self.heads, self.kv_heads)
        if self.top_k > self.experts:
            raise ShardplanError(f"MoEConfig: top_k={self.top_k} is more than the {self.experts} experts")
        if self.dense_layers > self.layers:
            raise ShardplanError(f"MoEConfig: dense_layers={self.dense_layers} is more than the {self.layers} layers")

    @property
    def kd(self) -> int:
        """The head width: ``head_dim``, or d_model / heads when it is 0."""
        return self.head_dim or self.d_model // self.heads

    @property
    def capacity(self) -> int:
        """Slots per expert and sequence (:func:`capacity`)."""
        return capacity(self.seq, self.experts, self.top_k, self.capacity_factor)

    def sizes(self) -> dict[str, int | float | str]:
        """The keyword sizes of :func:`moe` (``attention`` only when it is not the default, flash)."""
        out = dataclasses.asdict(self)
        return out if self.attention != "flash" else {k: v for k, v in out.items() if k != "attention"}

    def params(self) -> int:
        """Weights of the graph :func:`moe` builds, exactly:

        ``l (2 h H k + 2 h G k + 2 h) + l_d 3 h f + (l - l_d)(h E + 3 E h f_e + 3 h n f_e) + 2 V h + h``

        with h = d_model, H k the query width, G k the key/value width, f = d_ff, l_d dense layers, E experts
        of width f_e, n shared experts: per layer q and out (h x Hk each), k and v (h x Gk each), two RMSNorm
        gains; a dense layer's gate, up and down; a routed layer's router (h x E), the experts' gate, up and
        down (E x h x f_e each) and the shared experts' (h x n f_e each); embedding and untied head (V x h
        each) and the final gain.
        """
        h, l, ld, k = self.d_model, self.layers, self.dense_layers, self.kd
        attn = 2 * h * self.heads * k + 2 * h * self.kv_heads * k + 2 * h
        routed = h * self.experts + 3 * self.experts * h * self.d_expert + 3 * h * self.shared * self.d_expert
        return l * attn + ld * 3 * h * self.d_ff + (l - ld) * routed + 2 * self.vocab * h + h

    def active_params(self) -> int:
        """Weights a token uses: :meth:`params` with ``top_k`` experts in place of all E (the router kept)."""
        return self.params() - (self.layers - self.dense_layers) * 3 * (self.experts - self.top_k) * self.d_model \
            * self.d_expert


# Mixtral: Jiang et al. 2024, "Mixtral of Experts", Table 1. DeepSeek-V3: DeepSeek-AI 2024, "DeepSeek-V3 Technical
# Report", §4.2 (and the released config.json for the dense layers' width 18432 and the vocabulary 129,280). The
# capacity factor 1.25 is an assumption of this zoo (Switch Transformer's training value), not the papers' (both
# route without a fixed capacity). Tiny sizes: not published, the same structure for tests.
MOE: dict[str, MoEConfig] = {
    "mixtral-8x7b": MoEConfig(layers=32, d_model=4096, heads=32, kv_heads=8, d_ff=14336, experts=8, top_k=2,
                              d_expert=14336, vocab=32000, seq=4096),
    "deepseek-v3": MoEConfig(layers=61, d_model=7168, heads=128, kv_heads=128, d_ff=18432, experts=256, top_k=8,
                             d_expert=2048, vocab=129280, seq=4096, shared=1, dense_layers=3, head_dim=128),
    "mixtral-tiny": MoEConfig(layers=2, d_model=64, heads=4, kv_heads=2, d_ff=128, experts=8, top_k=2,
                              d_expert=128, vocab=512, seq=32),
    "deepseek-tiny": MoEConfig(layers=3, d_model=64, heads=4, kv_heads=4, d_ff=256, experts=16, top_k=4,
                               d_expert=32, vocab=512, seq=32, shared=1, dense_layers=1, head_dim=16),
}


def moe(batch: int = 8, layers: int = 2, d_model: int = 64, heads: int = 4, kv_heads: int = 2, d_ff: int = 128,
        experts: int = 8, top_k: int = 2, d_expert: int = 128, vocab: int = 512, seq: int = 32, shared: int = 0,
        dense_layers: int = 0, head_dim: int = 0, capacity_factor: float = 1.25, attention: str = "flash",
        name: str = "moe") -> Graph:
    """Mixture-of-experts decoder (module docstring); the defaults are ``mixtral-tiny`` (:data:`MOE`).

    Per block ``L{i}``: ``ln1``, the grouped-query attention of :func:`~shardplan.models.llama.gqa_attention`
    (its core FlashAttention, or unfused with ``attention="unfused"``),
    ``add1``, ``ln2``, a SwiGLU MLP (the first ``dense_layers`` blocks) or :func:`moe_layer`, ``add2``;
    around them ``embed``, ``ln_f``, ``fc`` and ``softmax`` as in :func:`~shardplan.models.llama.llama`.
    """
    cfg = MoEConfig(layers=layers, d_model=d_model, heads=heads, kv_heads=kv_heads, d_ff=d_ff, experts=experts,
                    top_k=top_k, d_expert=d_expert, vocab=vocab, seq=seq, shared=shared,
                    dense_layers=dense_layers, head_dim=head_dim, capacity_factor=capacity_factor,
                    attention=attention)
    check_stack(name, layers)
    b, labels, x = decoder_start(name, batch, seq, vocab, d_model)
    for i in range(1, layers + 1):
        p = f"L{i}"
        h = b.add(rms_norm(f"{p}/ln1", x))
        x = b.add(ops.elementwise(f"{p}/add1", x, gqa_attention(b, p, h, heads, kv_heads, cfg.kd, attention),
                                  kind="add",
                                  letters="bsd"))
        h = b.add(rms_norm(f"{p}/ln2", x))
        if i <= dense_layers:
            y = swiglu_mlp(b, p, h, d_ff)
        else:
            y = moe_layer(b, f"{p}/moe", h, experts, top_k, d_expert, cfg.capacity, shared)
        x = b.add(ops.elementwise(f"{p}/add2", x, y, kind="add", letters="bsd"))
    x = b.add(rms_norm("ln_f", x))
    h = b.add(ops.dense("fc", x, vocab, letters="bsvd"))
    b.add(ops.softmax_cross_entropy("softmax", h, labels, letters="bsv"))
    return b.build()

