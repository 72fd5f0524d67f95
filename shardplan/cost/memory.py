"""Memory per device of a strategy.

For each operator and configuration, per device q (bytes):

    weights:     sum_W |W tile(q)| * (1 + 1 + m)    (value, gradient, m words of optimizer state)
                 (a parameter read by several operators is charged once, to
                 its owner, in the owner's layout: ``Tensor.owner``)
    activations: saved * |output tile(q)|           (kept for the backward pass; ``Operator.saved``
                                                     output tiles: 1 unless the frontend knows better)
    recomputing: sum_i share_i * |input_i tile(q)|   (instead of the activations: the inputs it recomputes
                                                     from that no producer keeps, :func:`recompute_keep_bytes`)

(m = 2 for Adam, 0 for plain SGD.) A strategy's memory on device q is the
sum over operators of their chosen configuration's row, and the strategy
needs the maximum over devices. This ranks nothing; it is a constraint.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from shardplan.cost.tiles import as_layouts, tile_volumes
from shardplan.ir import Operator
from shardplan.machine import Machine

__all__ = ["operator_memory", "strategy_memory", "ChoiceTable", "choice_table", "WeightGroups", "weight_groups", "latency_scaled", "STAGES",
           "recompute_keep_bytes", "unsaved_inputs"]


def operator_memory(op: Operator, configs, machine: Machine, optimizer_factor: float = 2.0,
                    orders: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(weight bytes, activation bytes) per layout and device: two (K, p) arrays.

    ``configs``: :class:`~shardplan.layout.LayoutArrays` or configuration rows (with optional ``orders``).
    """
    p = machine.num_devices
    nbytes = machine.dtype_bytes
    lay = as_layouts(configs, p, orders, machine.levels)
    k = len(lay)
    w = np.zeros((k, p))
    for t in op.weights:
        if t.owner is None:
            w += tile_volumes(op, t, lay) * t.elem_factor * nbytes * (2.0 + optimizer_factor)
    act = tile_volumes(op, op.output, lay).astype(np.float64) * nbytes * op.saved
    return w, act


def strategy_memory(per_op: list[tuple[np.ndarray, np.ndarray]], assignment) -> dict[str, float]:
    """Peak bytes over devices of a strategy, and its weight / activation parts on that device."""
    w = sum(m[0][a] for m, a in zip(per_op, assignment))
    act = sum(m[1][a] for m, a in zip(per_op, assignment))
    tot = w + act
    q = int(np.argmax(tot))
    return {"peak_bytes": float(tot[q]), "weights_bytes": float(w[q]), "activations_bytes": float(act[q]),
            "device": q}


# --------------------------------------------------------------------------------------------
# Memory-saving choices: state sharding (ZeRO / FSDP), recomputation, micro-batches.
# --------------------------------------------------------------------------------------------

STAGES = (0, 1, 2, 3)


@dataclass(frozen=True, eq=False)
class ChoiceTable:
    """An operator's choices: a configuration with a state-sharding stage and a recomputation flag.

    Attributes (arrays over the J choices):
        base: index of the configuration (row of the cost tables) the choice uses.
        stage: ZeRO stage 0..3 of the operator's weights (0 for an operator without weights).
        recompute: whether the operator's forward is recomputed in the backward pass.
        parts: seconds by kind: ``compute``, ``forward_allreduce``, ``grad_allreduce`` (activation
            gradients only), ``halo``, ``stats``, ``recurrence``, ``weight_sync`` (weight-gradient
            synchronisation and ZeRO gathers), ``recompute`` (the forward run again).
        state_bytes: weights, gradients and optimizer state per device.
        activation_bytes: activations kept for the backward pass, per device.
        grad_bytes: the weight-gradient part of ``state_bytes`` (P at stages 0 and 1, P/G at
            stages 2 and 3: :mod:`shardplan.fit`); the rest (value and optimizer state) is
            :attr:`rest_bytes`. Zero when not given.
    """

    base: np.ndarray
    stage: np.ndarray
    recompute: np.ndarray
    parts: dict[str, np.ndarray]
    state_bytes: np.ndarray
    activation_bytes: np.ndarray
    grad_bytes: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.grad_bytes is None:
            object.__setattr__(self, "grad_bytes", np.zeros_like(np.asarray(self.state_bytes, dtype=np.float64)))

    @property
    def rest_bytes(self) -> np.ndarray:
        """Weights and optimizer state: what persists whatever the backward pass has reached."""
        return self.state_bytes - self.grad_bytes

    @property
    def seconds(self) -> np.ndarray:
        return sum(self.parts.values())  # type: ignore[return-value]

    @property
    def bytes(self) -> np.ndarray:
        return self.state_bytes + self.activation_bytes

    def label(self, j: int) -> str:
        out = [f"zero-{int(self.stage[j])}"] if self.stage[j] else []
        if self.recompute[j]:
            out.append("recompute")
        return "+".join(out) or "-"

    def take(self, keep: np.ndarray) -> "ChoiceTable":
        return ChoiceTable(self.base[keep], self.stage[keep], self.recompute[keep],
                           {k: v[keep] for k, v in self.parts.items()}, self.state_bytes[keep],
                           self.activation_bytes[keep], self.grad_bytes[keep])


def latency_scaled(machine: Machine, factor: float) -> Machine:
    """The machine with every latency multiplied by ``factor``.

    k messages of n/k bytes cost, in the alpha-beta model, what one message of
    n bytes costs with k times the latency (for ring and tree alike, so also
    for the faster of the two): this is how micro-batches are costed.
    """
    def scaled(x: float | None) -> float | None:
        return None if x is None else x * factor

    return replace(machine, latency=machine.latency * factor, inter_latency=scaled(machine.inter_latency),
                   pod_latency=scaled(machine.pod_latency))


@dataclass(frozen=True, eq=False)
class WeightGroups:
    """What the choices of one operator need that does not depend on the micro-batch count.

    Attributes (arrays over layouts): ``state`` value bytes of the weights per
    device; ``act`` output tile bytes; ``group`` the devices the state is
    sharded over (largest over the operator's weights); ``weights``, per
    trainable weight: (gradient tile bytes, its reduction group per level
    (L, K), that group times the layout's replicas per level (L, K): the
    devices holding the same tile, and 1, or 0 for a parameter another
    operator owns whose gradient is summed into the owner's,
    ``machine.sum_shared_grads``). ``state`` counts a parameter only on its owner.
    ``act`` is ``Operator.saved`` output tiles.
    """

    state: np.ndarray
    act: np.ndarray
    group: np.ndarray
    weights: tuple[tuple[np.ndarray, np.ndarray, np.ndarray, float], ...]


def weight_groups(op: Operator, configs, orders: np.ndarray | None, machine: Machine) -> WeightGroups:
    """``configs``: :class:`~shardplan.layout.LayoutArrays` or configuration rows (with optional ``orders``)."""
    from shardplan.cost.operator import tile_volume

    p = machine.num_devices
    lay = as_layouts(configs, p, orders, machine.levels)
    k = len(lay)
    nbytes = float(machine.dtype_bytes)
    # replicas per level: a level's devices not used by the layout's split there hold copies
    reps = np.asarray(lay.levels, dtype=np.int64)[:, None] // lay.level_splits.prod(axis=2)
    state = np.zeros(k)
    for t in op.weights:  # a parameter read by several operators: its state and sync on its owner only
        if t.owner is None:
            state += tile_volume(op, t, lay, p) * nbytes
    group = np.ones(k)
    rows = []
    for t in op.weights:
        if not t.needs_grad:
            continue
        gl = lay.group_sizes([op.dim_names.index(d) for d in op.grad_reduction_dims(t)])
        vol = tile_volume(op, t, lay, p, core=False) * nbytes
        big = gl * reps
        rows.append((vol, gl, big, 0.0 if t.owner is not None and machine.sum_shared_grads else 1.0))
        group = np.maximum(group, big.prod(axis=0))  # weights of one operator share their data-parallel group
    act = tile_volume(op, op.output, lay, p) * nbytes * op.saved
    return WeightGroups(state, act, group, tuple(rows))


def unsaved_inputs(op: Operator, producers_saved: Sequence[float]) -> tuple[float, ...]:
    """Per input of ``op``: the share of it a recomputing ``op`` must keep that no producer keeps.

    ``producers_saved[i]``: :attr:`~shardplan.ir.Operator.saved` of the operator
    producing input i, or 1.0 where none must be counted (a graph input, held as
    an argument; a producer the program itself recomputes, whose own inputs are
    the block's residuals). The share is ``max(0, 1 - saved)``.
    """
    return tuple(max(0.0, 1.0 - float(s)) for s in producers_saved)


def recompute_keep_bytes(op: Operator, configs, machine: Machine, shares: Sequence[float]) -> np.ndarray:
    """Bytes per device (largest device) of the inputs a recomputing ``op`` keeps for its second forward.

    An operator that recomputes needs its inputs in the backward pass. Where the
    producer saves its output (``saved`` >= 1) that tile is already counted; where
    it saves less (an addition feeding a recomputed norm) the rest is charged to
    the recomputing choice: sum_i shares[i] * |input_i tile(q)|. This counts the
    input even when the producer recomputes too (then the backward rebuilds it
    from further back): an over-count by at most one tile per input, so the
    memory stays an upper bound and additive over operators.
    """
    from shardplan.cost.operator import tile_volume

    p = machine.num_devices
    lay = as_layouts(configs, p, None, machine.levels)
    out = np.zeros(len(lay))
    nbytes = float(machine.dtype_bytes)
    for t, share in zip(op.inputs, shares):
        if share > 0.0:
            out += tile_volume(op, t, lay, p) * t.elem_factor * nbytes * share
    return out


def _bucketed(vol: np.ndarray, machine: Machine, collective) -> np.ndarray:
    """A weight's share of its bucket's collective, as :mod:`shardplan.cost.operator` charges it."""
    bucket = machine.grad_bucket_bytes
    if bucket is None:
        return collective(vol)
    return np.minimum(vol / bucket, 1.0) * collective(np.maximum(vol, bucket))


def choice_table(op: Operator, configs, orders: np.ndarray | None, machine: Machine, micro_batches: int = 1,
                 stages: Sequence[int] = STAGES, recompute: bool = True,
                 optimizer_factor: float = 2.0, prune: bool = True, groups: WeightGroups | None = None,
                 op_cost=None, in_flight: float = 1, accumulate: int = 1,
                 forced_recompute: bool = False, recompute_keep: np.ndarray | None = None,
                 peak: bool = False) -> ChoiceTable:
    """Every (layout, stage, recompute) choice of ``op`` with ``micro_batches`` micro-batches.

    ``configs``: :class:`~shardplan.layout.LayoutArrays` or configuration rows
    (with optional ``orders``). See :mod:`shardplan.fit` for the model. Choices
    that another choice of the same layout beats in both time and memory are
    dropped (exact for the memory-constrained optimum) unless ``prune`` is
    False. ``groups`` (:func:`weight_groups`) and ``op_cost`` (the operator's
    cost on the machine with its latency scaled by ``micro_batches``) may be
    passed to save their computation. ``in_flight``: micro-batches whose saved
    activations are live at once (1 here; a pipeline stage under 1F1B holds up
    to S - i of them; fractional for interleaved chunks, whose in-flight count is in
    units of a device group's per-micro-batch activations). ``accumulate``: for a table of one micro-batch of a step
    that accumulates gradients over ``accumulate`` of them (a pipeline stage's
    cost per micro-batch), the collectives run once per step are charged
    1/accumulate: stage 0's all-reduce, stage 1's reduce-scatter and gather,
    stage 2's gather (its reduce-scatter runs after every micro-batch); stage 3
    gathers and reduce-scatters per micro-batch, so it is unchanged. With 1
    (the default) the table is the step's.
    ``forced_recompute``: the program recomputes the
    operator whatever the plan (inside a user's ``jax.checkpoint``:
    :attr:`shardplan.ir.Graph.recomputed`): only recomputing choices.
    ``recompute_keep``: per layout, the input bytes a recomputing choice keeps
    (:func:`recompute_keep_bytes`), live like saved activations; None: nothing.
    ``peak``: prune for the backward-peak model (``FitOptions.grad_buffers =
    "backward"``), where a choice's memory counts in three ways (rest + saved
    before its backward step, rest + gradient after it, all three at it): a
    choice is dropped only when another of the same layout is no slower and
    uses no more in each of the three (:func:`_undominated_peak`).
    """
    from shardplan.cost.collectives import allgather_time, allreduce_time
    from shardplan.cost.operator import operator_cost

    lay = as_layouts(configs, machine.num_devices, orders, machine.levels)
    k = len(lay)
    m = int(micro_batches)
    mm = latency_scaled(machine, m) if m > 1 else machine
    oc = operator_cost(op, lay, mm) if op_cost is None else op_cost
    wg = weight_groups(op, lay, None, machine) if groups is None else groups
    state, group = wg.state, wg.group
    sync0, rs, ag, wgrad_m = np.zeros(k), np.zeros(k), np.zeros(k), np.zeros(k)
    weights = wg.weights
    for vol, gl, big, part in weights:  # part: 0 for a gradient summed into its owner's
        sync0 += part * _bucketed(vol, machine, lambda n: allreduce_time(n, gl, machine))
        wgrad_m += part * _bucketed(vol, mm, lambda n: allreduce_time(n, gl, mm))
        rs += part * _bucketed(vol, machine, lambda n: allgather_time(n, gl, machine))
        ag += part * _bucketed(vol, machine, lambda n: allgather_time(n, big, machine))
    # what operator_cost charged for the weight gradients on top of compute (overlapped: beyond the backward)
    passes = 1 + len(op.grad_tensors)
    backward = oc.compute * (passes - 1) / passes
    overlap = bool(getattr(machine, "overlap_grad", False))

    def charged(sync: np.ndarray) -> np.ndarray:
        return np.maximum(sync - backward, 0.0) if overlap else sync

    act_grad = np.maximum(oc.grad_allreduce - charged(wgrad_m), 0.0)
    act = wg.act / m * float(in_flight)
    keep = np.zeros(k) if recompute_keep is None else np.asarray(recompute_keep, dtype=np.float64) / m * float(in_flight)

    has_grad = bool(op.grad_tensors)
    fwd = (oc.compute / (1 + len(op.grad_tensors)) + oc.forward_allreduce
           + (oc.stats / 2 + oc.halo / 2 + oc.recurrence / 2 if has_grad else oc.stats + oc.halo + oc.recurrence))
    o = float(optimizer_factor)
    stage_list = [s for s in stages if s in STAGES] if weights else [0]
    if 0 not in stage_list:
        stage_list = [0] + stage_list
    rows = []
    forward = oc.compute / passes
    once = 1.0 / int(accumulate)  # share of a once-per-step collective charged to one micro-batch
    for s in stage_list:
        if s == 0:
            sync, mem, grad = charged(sync0) * once, state * (2 + o), state
        elif s == 1:
            sync, mem, grad = (charged(rs) + ag) * once, state * (2 + o / group), state
        elif s == 2:
            sync, mem, grad = charged(m * rs) + ag * once, state * (1 + (1 + o) / group), state / group
        else:  # gathers prefetched during the operator's own forward / backward when overlapping
            fwd_gather = np.maximum(m * ag - forward, 0.0) if overlap else m * ag
            sync, mem, grad = charged(m * (rs + ag)) + fwd_gather, state * (2 + o) / group, state / group
        for r in ([True] if forced_recompute else [False, True] if recompute else [False]):
            rows.append((s, r, sync, mem, keep if r else act, fwd if r else np.zeros(k), grad))
    j = len(rows)
    base = np.tile(np.arange(k), j)
    table = ChoiceTable(
        base=base,
        stage=np.repeat([r[0] for r in rows], k).astype(np.int64),
        recompute=np.repeat([r[1] for r in rows], k).astype(bool),
        parts={"compute": np.tile(oc.compute, j), "forward_allreduce": np.tile(oc.forward_allreduce, j),
               "grad_allreduce": np.tile(act_grad, j), "halo": np.tile(oc.halo, j),
               "stats": np.tile(oc.stats, j), "recurrence": np.tile(oc.recurrence, j),
               "weight_sync": np.concatenate([r[2] for r in rows]),
               "recompute": np.concatenate([r[5] for r in rows])},
        state_bytes=np.concatenate([r[3] for r in rows]),
        activation_bytes=np.concatenate([r[4] for r in rows]),
        grad_bytes=np.concatenate([r[6] for r in rows]),
    )
    if not prune:
        return table
    if peak:
        return table.take(_undominated_peak(table, j, k))
    return table.take(_undominated(table.base, table.seconds, table.bytes))


def _undominated_peak(table: ChoiceTable, rows: int, k: int) -> np.ndarray:
    """Indices of the choices of an unpruned table (``rows`` blocks of ``k`` layouts) that no other
    choice of the same layout dominates for the backward-peak model.

    Choice b dominates a when b's seconds, rest + saved, rest + gradient and
    rest + saved + gradient are each <= a's (ties: the earlier row wins): every
    per-step constraint of :mod:`shardplan.fit`'s backward model charges an
    operator one of those three memories, so a plan using a can use b instead
    and be no slower and fit wherever it fit.
    """
    rest, act, grad = table.rest_bytes, table.activation_bytes, table.grad_bytes
    crit = np.stack([table.seconds, rest + act, rest + grad, rest + act + grad]).reshape(4, rows, k)
    le = np.all(crit[:, None, :, :] <= crit[:, :, None, :], axis=0)  # le[a, b]: b <= a everywhere
    eq = np.all(crit[:, None, :, :] == crit[:, :, None, :], axis=0)
    earlier = np.arange(rows)[None, :] < np.arange(rows)[:, None]  # b before a
    dom = le & (~eq | earlier[:, :, None])
    dom[np.arange(rows), np.arange(rows)] = False
    keep = ~dom.any(axis=1)  # (rows, k)
    return np.flatnonzero(keep.reshape(-1))


def _undominated(base: np.ndarray, seconds: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """Indices of the choices no other choice of the same configuration beats (<= both, < one; ties: first).

    In (configuration, seconds, bytes) order a choice survives when its bytes are below every earlier
    choice's of its configuration: a running minimum over bytes ranks, shifted per configuration so that
    earlier configurations never take part.
    """
    if len(base) == 0:
        return np.zeros(0, dtype=np.int64)
    order = np.lexsort((np.arange(len(base)), nbytes, seconds, base))
    rank = np.unique(nbytes, return_inverse=True)[1].reshape(-1)[order].astype(np.int64)
    b = base[order].astype(np.int64)
    key = rank + (int(b.max()) - b) * (len(base) + 1)
    prev = np.empty_like(key)
    prev[0] = np.iinfo(np.int64).max
    prev[1:] = np.minimum.accumulate(key)[:-1]
    first = np.ones(len(b), dtype=bool)
    first[1:] = b[1:] != b[:-1]
    keep = first | (key < prev)
    return np.sort(order[keep])
