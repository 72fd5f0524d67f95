"""Context parallelism's two algorithms for an attention product: all-gather and the ring.

The math is in docs/cost-model.md, "Ring context parallelism"; in short:

* **Where the choice lives.** An operator that multiplies two activations and nothing else (no weights,
  a summed dimension: attention's scores ``q k^T`` and context ``p v``) has a *ring input* under a layout
  when the dims that do not index one input are split ``g > 1`` ways while those of the other input are
  not (:func:`ring_inputs`): ``g`` devices then need the same tile of that input (the keys, or the values),
  which context parallelism's producer (the key / value projection, sequence split) leaves scattered
  over them, ``1/g`` on each. *All-gather* (Llama 3's algorithm): the edge gathers it before the product
  (:func:`shardplan.cost.edge.edge_cost`, a point-to-point exchange of the ``(g - 1)/g`` a device
  misses), and the product's input gradient is all-reduced over the group. *Ring*: the ``g`` blocks are
  passed around the group, block ``k + 1`` moving while the product runs on block ``k``; backward, each
  block travels with its gradient accumulator.
* **Its cost.** With ``c`` the seconds of one block's transfer (:func:`ring_exposed`) and ``m`` the busiest
  device's product on one other device's block, the pass takes ``m_0 + (g - 1) max(m, c)`` (``m_0``: the
  device's own block, computed while the first transfer is in flight), of which the operator's compute is
  ``m_0 + (g - 1) m``: the ring adds ``(g - 1) max(c - m, 0)`` forward, and backward
  ``(g - 1) max(2 c - m_b, 0) + c`` (each step moves a block and its gradient accumulator, and the
  accumulators make one last hop home), where all-gather pays the edge's gather and the all-reduce of the
  input gradient. Both depend on the two layouts of the edge only, so the choice is an edge cost:
  :func:`context_edge` (``build_tables(..., context="allgather" | "ring" | "auto")``), and the
  all-reduce of the ring input's gradient moves from the operator to that edge (:func:`moved_reduction`)
  so that the two algorithms are compared on the same terms.
* **Causal work** (:mod:`shardplan.cost.causal`): under a causal mask one ring step's block is half of a
  full block on every device when the sequence is balanced, a full block on the busiest device when not.
* **Dealt at the attention** (:attr:`~shardplan.ir.Causal.dealt`): the runners receive contiguous blocks and
  deal them into the balanced order, the ring its q, k, v and output (:func:`deal_time` on its edges), the
  all-gather its queries and output only (:func:`gathered_deal`), where that costs less than the contiguous
  blocks' extra work (:func:`gathered_imbalance`); the all-gather's edge pays the cheaper
  (:func:`gathered_charge`), which the runners ask for at the chosen layout (:func:`deals_gathered`). There
  the keys' and values' gradients go home by a reduce-scatter where the producer scatters them over the query
  sequence's group (:func:`gathered_scatters`), else by the all-reduce: charged per producer layout on the edges
  (:func:`gathered_reduction`), the all-reduce taken off the operator (:func:`gathered_moved`). With
  ``Machine.scatter_gathered_grads`` (DTensor) the same holds for the contiguous (undealt) attention and for
  a fused attention that is not causal (:func:`scatters_undealt`, :func:`gathered_home`): its
  redistribution reduce-scatters them too. Every other activation's gradient on that machine:
  :mod:`shardplan.cost.grad_home`, which leaves the pairs charged here alone (:func:`ring_charged`).
"""

from __future__ import annotations

import numpy as np

from shardplan.cost.causal import causal_fractions
from shardplan.cost.collectives import allreduce_time, outer_level, p2p_time
from shardplan.cost.contention import exposed_beside
from shardplan.cost.edge import scatter_fit
from shardplan.cost.tiles import box_volumes, tensor_boxes
from shardplan.ir import Operator
from shardplan.layout import Layout, LayoutArrays
from shardplan.machine import Machine

__all__ = ["CONTEXT_ALGORITHMS", "ring_inputs", "ring_mask", "ring_exposed", "deal_time", "moved_reduction",
           "gathered_imbalance", "gathered_deal", "gather_deals", "gathered_charge", "deals_gathered", "gathered_dealt",
           "gathered_home", "gathered_moved", "scatters_undealt", "gathered_applies", "gathered_scatters",
           "gathered_reduction", "ring_charged", "context_edge", "ring_choices", "ring_operator_cost"]

CONTEXT_ALGORITHMS = ("allgather", "ring", "auto")
"""``build_tables(context=...)``: every ring input gathered (the default, today's model), passed around the
ring wherever the producer scatters it, or the cheaper of the two per edge."""


def ring_mask(op: Operator, lay: LayoutArrays) -> tuple[np.ndarray, np.ndarray]:
    """Per layout: which inputs are ring inputs, (K, inputs) bool, and the size of the group that shares them (K,).

    Only an operator of activations alone (two inputs, or more multiplied together: at least a multiply-add per
    point; no weights, a summed dim) has them: the inputs whose non-indexing dims are split ``g > 1`` ways while
    some other input's are not split, all of them with the same non-indexing dims (attention's scores: the keys; its context: the values; fused
    attention, :func:`shardplan.ops.flash_attention`: the keys and the values together)."""
    k, n = len(lay), len(op.inputs)
    mask, g = np.zeros((k, n), dtype=bool), np.ones(k, dtype=np.int64)
    if n < 2 or op.weights or not op.reduction_dims or (n > 2 and op.flops_per_point < 2.0):
        return mask, g
    names = op.dim_names
    shared, groups = [], []
    for t in op.inputs:
        read = {d for a in t.axes for d in a.dims}
        idx = tuple(j for j, d in enumerate(names) if d not in read)
        groups.append(idx)
        shared.append(lay.group_sizes(list(idx)).prod(axis=0) if idx else np.ones(k, dtype=np.int64))
    sizes = np.stack(shared, axis=1)  # (K, n)
    split = sizes > 1
    ids = np.asarray([groups.index(x) for x in groups])  # inputs with the same non-indexing dims share an id
    lo = np.where(split, ids[None, :], n).min(axis=1)
    hi = np.where(split, ids[None, :], -1).max(axis=1)
    ok = (~split).any(axis=1) & (lo == hi)  # one group of ring inputs beside an input read whole
    mask = split & ok[:, None]
    g = np.where(ok, np.where(split, sizes, 1).max(axis=1), 1)
    return mask, g


def ring_inputs(op: Operator, lay: LayoutArrays) -> tuple[np.ndarray, np.ndarray]:
    """Per layout: the slot of the (first) ring input (-1: none) and the size of the group that shares it (K,)
    (:func:`ring_mask`; a product of two activations has at most one ring input)."""
    mask, g = ring_mask(op, lay)
    slot = np.where(mask.any(axis=1), mask.argmax(axis=1), -1).astype(np.int64)
    return slot, g


def _group_dims(op: Operator, slot: int) -> list[int]:
    read = {d for a in op.inputs[slot].axes for d in a.dims}
    return [j for j, d in enumerate(op.dim_names) if d not in read]


def ring_exposed(block_bytes: np.ndarray, g: np.ndarray, level: np.ndarray, fwd_step: np.ndarray,
                 bwd_step: np.ndarray, machine: Machine, grad: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Seconds the ring adds to its product's compute, forward and backward (module docstring):
    ``(g - 1) max(c - m, φ c)`` and ``(g - 1) max(2c - m_b, 2 φ c) + c`` (φ: the transfers' share of the
    device, :mod:`shardplan.cost.contention`), with ``c`` one block's point-to-point
    over the links of ``level`` (the outermost level the group spans) and ``m``, ``m_b`` the busiest
    device's forward and backward seconds on one block (``fwd_step``, ``bwd_step``); 0 where ``g = 1``;
    backward 0 when the input needs no gradient (``grad=False``)."""
    g = np.asarray(g, dtype=np.float64)
    c = p2p_time(block_bytes, machine, level)
    phi = float(machine.comm_contention)  # the transfers' share of the device beside the block's product
    fwd = np.where(g > 1, (g - 1) * exposed_beside(c, fwd_step, phi), 0.0)
    bwd = np.where(g > 1, (g - 1) * exposed_beside(2.0 * c, bwd_step, phi) + c, 0.0) if grad else np.zeros_like(fwd)
    return fwd, bwd


def deal_time(block_bytes: np.ndarray, level: np.ndarray, machine: Machine) -> np.ndarray:
    """Seconds to deal one tensor's contiguous sequence blocks into the balanced order, or back
    (:attr:`~shardplan.ir.Causal.dealt`): a device holding chunks ``2i, 2i + 1`` of ``2g`` sends each to its
    balanced owner (chunk ``j`` to ``j`` or ``2g - 1 - j``), one ``ppermute`` of half its block per chunk
    parity, over the links of ``level``: ``2 p2p(block / 2)`` (the half that stays on device 0 is not
    discounted: every other device sends both)."""
    return 2.0 * p2p_time(np.asarray(block_bytes, dtype=np.float64) / 2.0, machine, level)


def moved_reduction(op: Operator, lay: LayoutArrays, machine: Machine,
                    slots: tuple[int, ...] | None = None) -> np.ndarray:
    """(K,) seconds: the all-reduce of the ring input's gradient that :func:`shardplan.cost.operator.operator_cost`
    charges the operator, which ``build_tables(context != "allgather")`` moves to the edge of that input (the
    ring replaces it; all-gather pays it there), summed as the operator sums it (one all-reduce per split dim
    with ``machine.reduce_per_dim``, :func:`shardplan.cost.operator._reduce_groups`): 0 where the layout has no ring input, the input needs no
    gradient, or the layout defers the reduction (:attr:`~shardplan.layout.Layout.partial`). ``slots``: only
    those inputs' (default: every ring input's)."""
    from shardplan.cost.operator import _reduce_groups

    mask, _ = ring_mask(op, lay)
    out = np.zeros(len(lay))
    for j in range(len(op.inputs)) if slots is None else slots:
        rows = np.nonzero(mask[:, j] & ~lay.deferred)[0]
        t = op.inputs[j] if j < len(op.inputs) else None
        if not len(rows) or t is None or not t.needs_grad:
            continue
        sub = lay.take(rows)
        nbytes, _ = _grad_bytes(op, j, sub, machine)
        for _, gl in _reduce_groups(op, sub, op.grad_reduction_dims(t), machine.reduce_per_dim):
            out[rows] += allreduce_time(nbytes, gl, machine)
    return out


def _grad_bytes(op: Operator, slot: int, sub: LayoutArrays, machine: Machine) -> tuple[np.ndarray, np.ndarray]:
    """(bytes of the busiest device's gradient tile of input ``slot``, (L, K) sizes of the group that sums it)."""
    t = op.inputs[slot]
    vol = box_volumes(tensor_boxes(op, t, sub, machine.num_devices, core=False)).max(axis=1) * t.elem_factor
    gl = sub.group_sizes([op.dim_names.index(d) for d in op.grad_reduction_dims(t)])
    return vol * float(machine.dtype_bytes), gl


def ring_choices(u: Operator, lu: LayoutArrays, v: Operator, slot: int, lv: LayoutArrays, machine: Machine,
                 compute: np.ndarray) -> np.ndarray:
    """(K_u, K_v) seconds of the ring on the edge u -> v (input ``slot``), forward + backward beyond v's
    compute (``compute``: v's :attr:`~shardplan.cost.operator.OpCost.compute`, (K_v,)); inf where v's layout
    has no ring on this slot or u's tiles do not scatter v's input tile over the ring group, one ``1/g`` block
    per device (:func:`shardplan.cost.edge.scatters` with ``h = g``). Where v has several ring inputs (fused
    attention's keys and values) each edge's transfer overlaps its share of v's compute in proportion to its
    input's bytes, so that the edges together are charged the exposed time of the blocks moving together."""
    p = machine.num_devices
    out = np.full((len(lu), len(lv)), np.inf)
    mask, g = ring_mask(v, lv)
    cols = np.nonzero(mask[:, slot])[0]
    if not len(cols):
        return out
    sub = lv.take(cols)
    t = v.inputs[slot]
    bv = tensor_boxes(v, t, sub, p, core=True)
    bu = tensor_boxes(u, u.output, lu, p, core=True)
    gs = g[cols]
    ok = scatter_fit(u, lu, v, slot, sub, gs, machine)
    nbytes = box_volumes(bv).max(axis=1) * t.elem_factor * float(machine.dtype_bytes)
    level = outer_level(sub.group_sizes(_group_dims(v, slot)))
    total, step = causal_fractions(v, sub.splits)
    passes = v.passes
    fwd_pass = np.asarray(compute, dtype=np.float64)[cols] / passes
    bwd_pass = np.asarray(compute, dtype=np.float64)[cols] - fwd_pass
    if mask[cols].sum(axis=1).max() > 1:  # this input's share of the blocks moving together (docstring)
        vols = np.stack([box_volumes(tensor_boxes(v, x, sub, p, core=True)).max(axis=1) * x.elem_factor
                         for x in v.inputs], axis=1)
        frac = vols[:, slot] / (vols * mask[cols]).sum(axis=1)
        fwd_pass, bwd_pass = fwd_pass * frac, bwd_pass * frac
    # one block's share of the pass: blocks along the mask's key dim, the busiest block over the busiest
    # device's tile; blocks along other dims, 1/g of the (masked) work each; both, the smaller (more exposed)
    seq = step / (gs * total)
    share = np.broadcast_to(1.0 / gs, (len(lu), len(cols))).copy()
    if v.causal is not None:
        lengths_u = bu[:, 0, :, 1] - bu[:, 0, :, 0]  # (K_u, A): boxes of one regular split, device 0's
        lengths_v = bv[:, 0, :, 1] - bv[:, 0, :, 0]
        key = np.asarray([v.causal.key in a.dims for a in t.axes])
        cut = lengths_u[:, None, :] < lengths_v[None, :, :]  # (K_u, K_v', A): axes the blocks cut
        along = (cut & key).any(axis=2)
        only = along & ~(cut & ~key).any(axis=2)
        share = np.where(only, seq[None, :], np.where(along, np.minimum(seq[None, :], share), share))
    out_f, out_b = [], []
    for row in range(len(lu)):
        f, b = ring_exposed(nbytes / gs, gs, level, fwd_pass * share[row], bwd_pass * share[row], machine,
                            t.needs_grad)
        out_f.append(f)
        out_b.append(b)
    ring = np.asarray(out_f) + np.asarray(out_b)  # (K_u, K_v')
    ring = ring + _deal_charge(v, slot, sub, mask[cols], gs, nbytes / gs, level, machine)[None, :]
    out[:, cols] = np.where(ok.T, ring, np.inf)
    return out


def _deal_charge(v: Operator, slot: int, sub: LayoutArrays, mask: np.ndarray, gs: np.ndarray,
                 block: np.ndarray, level: np.ndarray, machine: Machine) -> np.ndarray:
    """(K_v',) seconds of the runner's deal (:attr:`~shardplan.ir.Causal.dealt`) charged to the edge of ring
    input ``slot``: its own block dealt in (forward) and its gradient back (backward); the edge of the first
    ring input also carries the queries in and the output back (forward), the output's gradient in and the
    queries' back (backward). 0 unless the mask is dealt and balanced and ``2g`` divides the sequence (the
    runners deal only then, as :func:`~shardplan.cost.causal.causal_fractions` balances only then)."""
    mask_c = v.causal
    out = np.zeros(len(sub))
    if mask_c is None or not (mask_c.dealt and mask_c.balanced):
        return out
    rows = (v.extents[mask_c.query] % (2 * gs) == 0) & (gs > 1)
    if not rows.any():
        return out
    t, q = v.inputs[slot], v.inputs[0]
    own = deal_time(block, level, machine) * (1.0 + float(t.needs_grad))
    qbytes = box_volumes(tensor_boxes(v, q, sub, machine.num_devices, core=True)).max(axis=1) \
        * q.elem_factor * float(machine.dtype_bytes)
    backward = any(x.needs_grad for x in v.inputs)
    first = mask.argmax(axis=1) == slot
    extra = deal_time(qbytes, level, machine) * (2.0 + float(backward) + float(q.needs_grad))
    return np.where(rows, own + np.where(first, extra, 0.0), 0.0)


def gathered_imbalance(v: Operator, slot: int, lv: LayoutArrays, machine: Machine,
                       compute: np.ndarray) -> np.ndarray:
    """(K_v,) seconds a dealt causal attention (:attr:`~shardplan.ir.Causal.dealt`) costs beyond the balanced
    work its operator is charged when its keys are gathered and its queries stay in contiguous blocks: the
    busiest device does the last block's share (:func:`~shardplan.cost.causal.causal_fractions` with
    ``balanced=False``). On the rows where ``slot`` is the first ring input, the operator's compute at
    contiguous blocks less ``compute``; 0 elsewhere (:func:`gathered_charge` weighs it against the deal)."""
    from dataclasses import replace

    from shardplan.cost.operator import operator_cost

    mask, _ = ring_mask(v, lv)
    rows = mask.any(axis=1) & (mask.argmax(axis=1) == slot)
    c = v.causal
    if c is None or not (c.dealt and c.balanced) or not rows.any():
        return np.zeros(len(lv))
    contiguous = operator_cost(replace(v, causal=replace(c, balanced=False)), lv, machine).compute
    return np.where(rows, np.maximum(contiguous - np.asarray(compute, dtype=np.float64), 0.0), 0.0)


def gathered_deal(v: Operator, slot: int, lv: LayoutArrays, machine: Machine) -> np.ndarray:
    """(K_v,) seconds of the balanced all-gather's deal (docs/cost-model.md, "Dealt at the attention"): the
    queries' contiguous blocks dealt into the balanced order and the output dealt back (forward), the output's
    gradient dealt in and the queries' gradient back (backward, where the core has one; the queries' only
    where they need it), each :func:`deal_time` of the busiest device's query block over the links of the
    outermost level the query sequence's group spans: ``deal_time(q) (2 + [backward] + [q needs grad])``. The
    keys and values stay as the all-gather moves them (gathered, their gradients reduced as before). On the
    rows where ``slot`` is the first ring input, the mask is dealt and balanced, the sequence split ``g > 1``
    ways and ``2g`` divides it (where :func:`~shardplan.cost.causal.causal_fractions` balances); 0
    elsewhere."""
    mask, g = ring_mask(v, lv)
    c = v.causal
    out = np.zeros(len(lv))
    if c is None or not (c.dealt and c.balanced):
        return out
    rows = mask.any(axis=1) & (mask.argmax(axis=1) == slot) & (g > 1) & (v.extents[c.query] % (2 * g) == 0)
    if not rows.any():
        return out
    sub = lv.take(np.nonzero(rows)[0])
    q = v.inputs[0]
    qbytes = box_volumes(tensor_boxes(v, q, sub, machine.num_devices, core=True)).max(axis=1) \
        * q.elem_factor * float(machine.dtype_bytes)
    level = outer_level(sub.group_sizes(_group_dims(v, slot)))
    backward = any(x.needs_grad for x in v.inputs)
    out[rows] = deal_time(qbytes, level, machine) * (2.0 + float(backward) + float(q.needs_grad))
    return out


def gather_deals(v: Operator, slot: int, lv: LayoutArrays, machine: Machine, compute: np.ndarray) -> np.ndarray:
    """(K_v,) bool: where the runners deal a causal attention whose keys are gathered: the deal
    (:func:`gathered_deal`) is charged and costs less than the contiguous blocks' extra work
    (:func:`gathered_imbalance`). ``slot``: the first ring input's (the keys')."""
    deal = gathered_deal(v, slot, lv, machine)
    return (deal > 0) & (deal < gathered_imbalance(v, slot, lv, machine, compute))


def gathered_charge(v: Operator, slot: int, lv: LayoutArrays, machine: Machine, compute: np.ndarray) -> np.ndarray:
    """(K_v,) seconds the all-gather's edge of ring input ``slot`` pays beyond its gather for a dealt causal
    attention: what the runner does, the deal where :func:`gather_deals` (the cheaper), else the contiguous
    blocks' extra work: ``min(gathered_deal, gathered_imbalance)`` where the deal applies, the imbalance
    elsewhere (0 where neither: a mask not dealt, the sequence not split)."""
    deal = gathered_deal(v, slot, lv, machine)
    extra = gathered_imbalance(v, slot, lv, machine, compute)
    return np.where(deal > 0, np.minimum(deal, extra), extra)


def deals_gathered(op: Operator, layout: Layout, machine: Machine) -> bool:
    """Whether the runners deal the causal attention ``op`` under ``layout`` with its keys gathered:
    :func:`gather_deals` against the compute its cost tables charge it there
    (:func:`~shardplan.cost.operator.operator_cost`), so that the run is what the tables charge (the caller
    runs the ring instead where the tables charge the ring). A function of the operator, its layout and the
    machine alone, so that a plan read back from JSON, or a pipeline stage's, is run as it was costed."""
    from shardplan.cost.operator import operator_cost

    if op.causal is None or not op.causal.dealt:
        return False
    lv = LayoutArrays.stack([layout])
    mask, _ = ring_mask(op, lv)
    if not mask[0].any():
        return False
    compute = operator_cost(op, lv, machine).compute
    return bool(gather_deals(op, int(mask[0].argmax()), lv, machine, compute)[0])


def gathered_dealt(v: Operator, lv: LayoutArrays, machine: Machine, compute: np.ndarray) -> np.ndarray:
    """(K_v,) bool: the layouts at which the runners deal the causal attention ``v`` with its keys gathered
    (:func:`gather_deals` of the first ring input of each row)."""
    mask, _ = ring_mask(v, lv)
    out = np.zeros(len(lv), dtype=bool)
    if v.causal is None or not v.causal.dealt:
        return out
    for j in range(len(v.inputs)):
        if mask[:, j].any():
            out |= gather_deals(v, j, lv, machine, compute)
    return out


def scatters_undealt(v: Operator, machine: Machine) -> bool:
    """Whether the gradients of ``v``'s all-gathered ring inputs go home by the reduce-scatter wherever ``v``
    has a ring input, dealt or not: with ``machine.scatter_gathered_grads`` (DTensor's ``Partial -> Shard``
    redistribution of the gathered keys' gradients), for a causal attention whose runners deal it
    (:attr:`~shardplan.ir.Causal.dealt`) and for a fused attention that is not causal (an encoder's, a padding
    mask or none: its runner gathers the keys and values the same way, :func:`shardplan.ops.flash_attention`)."""
    if not machine.scatter_gathered_grads:
        return False
    return v.causal.dealt if v.causal is not None else v.kind == "attn_flash"


def gathered_applies(v: Operator, machine: Machine) -> bool:
    """Whether tables built with the all-gather charge ``v``'s ring inputs' gradients on their edges at some
    layouts (:func:`gathered_home`): ``v`` is a causal attention its runners may deal, or
    :func:`scatters_undealt`."""
    return (v.causal is not None and v.causal.dealt) or scatters_undealt(v, machine)


def gathered_home(v: Operator, lv: LayoutArrays, machine: Machine, compute: np.ndarray) -> np.ndarray:
    """(K_v,) bool: the layouts at which the gradients of the all-gathered ring inputs of the attention ``v``
    are charged on their edges (:func:`gathered_reduction`, a reduce-scatter to a producer that scatters
    them): where the runner deals a causal one (:func:`gathered_dealt`), and where :func:`scatters_undealt`
    (DTensor: its ``Partial -> Shard`` redistribution reduce-scatters them, dealt or not, causal or not)
    wherever it has a ring input."""
    dealt = gathered_dealt(v, lv, machine, compute)
    if not scatters_undealt(v, machine):
        return dealt
    mask, _ = ring_mask(v, lv)
    return dealt | mask.any(axis=1)


def gathered_moved(v: Operator, lv: LayoutArrays, machine: Machine, compute: np.ndarray) -> np.ndarray:
    """(K_v,) seconds of the ring inputs' gradient all-reduce that tables built with the all-gather move from a
    dealt attention (:func:`gathered_home`) to the edges of those inputs, which charge what the runner does
    instead (:func:`gathered_reduction`): :func:`moved_reduction` on those rows, 0 elsewhere."""
    dealt = gathered_home(v, lv, machine, compute)
    if not dealt.any():
        return np.zeros(len(lv))
    return np.where(dealt, moved_reduction(v, lv, machine), 0.0)


def gathered_scatters(u: Operator, lu: LayoutArrays, v: Operator, slot: int, lv: LayoutArrays,
                      machine: Machine) -> np.ndarray:
    """(K_u, K_v) bool: where the gradient of v's ring input ``slot`` (the keys, or the values) comes back to
    its producer ``u`` by one reduce-scatter over the query sequence's group: ``slot`` is a ring input of a
    causal ``v``, the group that sums its gradient splits the query sequence alone, and u's tiles scatter v's
    tile of it over that group, a distinct ``1/g`` block on each device
    (:func:`~shardplan.cost.edge.scatter_fit`, the ring's condition). The all-gather of the forward is then the transpose of that reduce-scatter. A fused attention
    that is not causal names no query sequence: where :func:`scatters_undealt` (DTensor, which reduce-scatters
    over every mesh axis the producer scatters), the group is every device that sums the gradient."""
    out = np.zeros((len(lu), len(lv)), dtype=bool)
    mask, g = ring_mask(v, lv)
    c = v.causal
    if (c is None and not scatters_undealt(v, machine)) or slot >= len(v.inputs):
        return out
    others = [] if c is None else [v.dim_names.index(d) for d in v.grad_reduction_dims(v.inputs[slot])
                                   if d != c.query]
    alone = lv.group_sizes(others).prod(axis=0) == 1 if others else np.ones(len(lv), dtype=bool)
    cols = np.nonzero(mask[:, slot] & alone & (g > 1))[0]
    if not len(cols):
        return out
    out[:, cols] = scatter_fit(u, lu, v, slot, lv.take(cols), g[cols], machine).T
    return out


def gathered_reduction(u: Operator, lu: LayoutArrays, v: Operator, slot: int, lv: LayoutArrays, machine: Machine,
                       compute: np.ndarray) -> np.ndarray:
    """(K_u, K_v) seconds of the gradient of ring input ``slot`` of a dealt attention (:func:`gathered_dealt`)
    on its way back to its producer ``u`` (the all-reduce :func:`gathered_moved` took off the operator): a
    reduce-scatter of the device's gradient tile over the query sequence's group where
    :func:`gathered_scatters` (each device keeps its own block's sum: Llama 3's all-gather; half the bytes of
    the all-reduce), else the all-reduce; 0 on the rows not charged here (:func:`gathered_home`)."""
    from shardplan.cost.collectives import reduce_scatter_time

    dealt = gathered_home(v, lv, machine, compute)
    out = np.zeros((len(lu), len(lv)))
    if not dealt.any():
        return out
    ar = np.where(dealt, moved_reduction(v, lv, machine, (slot,)), 0.0)
    rs = np.zeros(len(lv))
    rows = np.nonzero(ar > 0)[0]
    if len(rows):
        nbytes, gl = _grad_bytes(v, slot, lv.take(rows), machine)
        rs[rows] = reduce_scatter_time(nbytes, gl, machine)
    return np.where(gathered_scatters(u, lu, v, slot, lv, machine) & (ar > 0)[None, :], rs[None, :], ar[None, :])


def ring_charged(v: Operator, lv: LayoutArrays, machine: Machine, context: str, compute: np.ndarray) -> np.ndarray:
    """(K, inputs) bool: the (layout, input) pairs whose gradient reduction tables built with ``context`` charge
    on the input's edge here: every ring input with the ring or ``auto`` (:func:`moved_reduction`), the ring
    inputs at :func:`gathered_home`'s layouts with the all-gather where :func:`gathered_applies`
    (``compute``: v's compute, as :func:`gathered_home` takes it). The general rule for the rest
    (:func:`shardplan.cost.grad_home.home_pairs`) leaves them alone."""
    mask, _ = ring_mask(v, lv)
    if context != "allgather":
        return mask
    if not gathered_applies(v, machine):
        return np.zeros_like(mask)
    return mask & gathered_home(v, lv, machine, compute)[:, None]


def context_edge(u: Operator, lu: LayoutArrays, v: Operator, slot: int, lv: LayoutArrays, machine: Machine,
                 gathered: np.ndarray, moved: np.ndarray, compute: np.ndarray, algorithm: str) -> np.ndarray:
    """The edge u -> v's seconds (K_u, K_v) under ``algorithm`` (:data:`CONTEXT_ALGORITHMS`): ``gathered`` is
    :func:`~shardplan.cost.edge.edge_cost` (the all-gather), ``moved`` (K_v,) v's input-gradient all-reduce
    moved here (:func:`moved_reduction`, 0 for other slots), ``compute`` v's compute (K_v,); the all-gather also
    pays :func:`gathered_charge` (its deal, or the contiguous blocks' extra work). ``ring``: the
    ring wherever it applies, all-gather elsewhere; ``auto``: the cheaper of the two."""
    mask, _ = ring_mask(v, lv)
    if (mask.sum(axis=1) > 1).any():  # several ring inputs: this one's reduction only
        moved = moved_reduction(v, lv, machine, (slot,))
    dealt = gathered_home(v, lv, machine, compute)  # there the runner's reduction (:func:`gathered_reduction`)
    moved = np.where(mask[:, slot] & ~dealt, moved, 0.0) + gathered_charge(v, slot, lv, machine, compute)
    plain = np.asarray(gathered, dtype=np.float64) + moved[None, :]
    if dealt.any():
        plain = plain + gathered_reduction(u, lu, v, slot, lv, machine, compute)
    if algorithm == "allgather" or not mask[:, slot].any():
        return plain
    ring = ring_choices(u, lu, v, slot, lv, machine, compute)
    if algorithm == "ring":
        return np.where(np.isfinite(ring), ring, plain)
    return np.minimum(plain, ring)


def ring_operator_cost(op: Operator, lay: LayoutArrays, machine: Machine, context: str = "allgather",
                       decide: Machine | None = None, unfed: frozenset[int] = frozenset()):
    """:func:`~shardplan.cost.operator.operator_cost` of ``op`` as tables built with ``context`` charge it:
    with ``ring`` or ``auto``, less the all-reduce of the ring input's gradient (:func:`moved_reduction`),
    which the edge of that input charges instead; with ``allgather``, less it where the attention is dealt
    (:func:`gathered_moved`; ``decide``: the machine the tables decided the deal on, default ``machine``).
    With ``scatter_gathered_grads`` also less the activation-gradient all-reduces the tables charge on the
    inputs' edges (:func:`shardplan.cost.grad_home.home_moved`; ``unfed``: the input slots no edge feeds,
    :func:`shardplan.cost.grad_home.unfed_slots`)."""
    from dataclasses import replace

    from shardplan.cost.grad_home import home_moved, home_moved_bytes, home_pairs
    from shardplan.cost.operator import operator_cost

    cost = operator_cost(op, lay, machine)
    rules = decide or machine
    gathered = context == "allgather" and gathered_applies(op, rules)
    if not gathered and context == "allgather" and not rules.scatter_gathered_grads:
        return cost
    compute = cost.compute
    if decide is not None and (gathered or rules.scatter_gathered_grads):  # the deal as the tables decided it
        compute = operator_cost(op, lay, decide).compute
    if context == "allgather":
        if gathered:
            dealt = gathered_home(op, lay, rules, compute)
            cost = replace(cost, grad_allreduce=cost.grad_allreduce - np.where(dealt, moved_reduction(op, lay, machine),
                                                                               0.0))
    else:
        cost = replace(cost, grad_allreduce=cost.grad_allreduce - moved_reduction(op, lay, machine))
    if not rules.scatter_gathered_grads:
        return cost
    pairs = home_pairs(op, lay, rules, unfed, ring_charged(op, lay, rules, context, compute))
    return replace(cost, grad_allreduce=cost.grad_allreduce - home_moved(op, lay, machine, pairs),
                   comm_bytes=cost.comm_bytes - home_moved_bytes(op, lay, machine, pairs))
