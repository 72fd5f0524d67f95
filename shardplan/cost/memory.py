"""Memory per device of a strategy.

For each operator and configuration, per device q (bytes):

    weights:     sum_W |W tile(q)| * (1 + 1 + m)    (value, gradient, m words of optimizer state)
    activations: |output tile(q)|                   (kept for the backward pass)

(m = 2 for Adam, 0 for plain SGD.) A strategy's memory on device q is the
sum over operators of their chosen configuration's row, and the strategy
needs the maximum over devices. This ranks nothing; it is a constraint.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from shardplan.cost.tiles import box_volumes, device_grid, tensor_boxes
from shardplan.ir import Operator
from shardplan.machine import Machine

__all__ = ["operator_memory", "strategy_memory", "ChoiceTable", "choice_table", "WeightGroups", "weight_groups", "latency_scaled", "STAGES"]


def operator_memory(op: Operator, configs: np.ndarray, machine: Machine, optimizer_factor: float = 2.0,
                    orders: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(weight bytes, activation bytes) per configuration and device: two (K, p) arrays."""
    p = machine.num_devices
    nbytes = machine.dtype_bytes
    k = len(configs)
    grid = device_grid(np.asarray(configs, dtype=np.int64), p, orders)
    w = np.zeros((k, p))
    for t in op.weights:
        w += box_volumes(tensor_boxes(op, t, configs, p, grid=grid)) * t.elem_factor * nbytes * (2.0 + optimizer_factor)
    act = box_volumes(tensor_boxes(op, op.output, configs, p, grid=grid)).astype(np.float64) * nbytes
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
    """

    base: np.ndarray
    stage: np.ndarray
    recompute: np.ndarray
    parts: dict[str, np.ndarray]
    state_bytes: np.ndarray
    activation_bytes: np.ndarray

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
                           self.activation_bytes[keep])


def latency_scaled(machine: Machine, factor: float) -> Machine:
    """The machine with every latency multiplied by ``factor``.

    k messages of n/k bytes cost, in the alpha-beta model, what one message of
    n bytes costs with k times the latency: this is how micro-batches are costed.
    """
    inter = None if machine.inter_latency is None else machine.inter_latency * factor
    return replace(machine, latency=machine.latency * factor, inter_latency=inter)


@dataclass(frozen=True, eq=False)
class WeightGroups:
    """What the choices of one operator need that does not depend on the micro-batch count.

    Attributes (arrays over configurations): ``state`` value bytes of the
    weights per device; ``act`` output tile bytes; ``group`` the devices the
    state is sharded over (largest over the operator's weights); ``weights``
    per trainable weight (gradient tile bytes, reduction group g, whether it
    crosses nodes, g times the replica factor, whether that crosses nodes).
    """

    state: np.ndarray
    act: np.ndarray
    group: np.ndarray
    weights: tuple[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray], ...]


def weight_groups(op: Operator, configs: np.ndarray, orders: np.ndarray, machine: Machine) -> WeightGroups:
    from shardplan.cost.collectives import group_crosses_nodes
    from shardplan.cost.operator import tile_volume

    configs = np.asarray(configs, dtype=np.int64)
    k = len(configs)
    p = machine.num_devices
    nbytes = float(machine.dtype_bytes)
    grid = coords, active = device_grid(configs, p, orders)
    replicas = p // configs.prod(axis=1)
    spans = bool(machine.hierarchical and p > (machine.node_size or p))
    state = np.zeros(k)
    for t in op.weights:
        state += tile_volume(op, t, configs, p, grid=grid) * nbytes
    group = np.ones(k)
    rows = []
    for t in op.weights:
        if not t.needs_grad:
            continue
        idx = [op.dim_names.index(d) for d in op.grad_reduction_dims(t)]
        g = np.prod(configs[:, idx], axis=1) if idx else np.ones(k, dtype=np.int64)
        vol = tile_volume(op, t, configs, p, core=False, grid=grid) * nbytes
        inter = group_crosses_nodes(configs, coords, active, idx, machine)
        big = g * replicas
        rows.append((vol, g, inter, big, inter | ((replicas > 1) & spans)))
        group = np.maximum(group, big)  # weights of one operator share their data-parallel group
    act = tile_volume(op, op.output, configs, p, grid=grid) * nbytes
    return WeightGroups(state, act, group, tuple(rows))


def choice_table(op: Operator, configs: np.ndarray, orders: np.ndarray, machine: Machine, micro_batches: int = 1,
                 stages: Sequence[int] = STAGES, recompute: bool = True,
                 optimizer_factor: float = 2.0, prune: bool = True, groups: WeightGroups | None = None,
                 op_cost=None, in_flight: int = 1) -> ChoiceTable:
    """Every (configuration, stage, recompute) choice of ``op`` with ``micro_batches`` micro-batches.

    See :mod:`shardplan.fit` for the model. Choices that another choice of the
    same configuration beats in both time and memory are dropped (exact for
    the memory-constrained optimum) unless ``prune`` is False. ``groups``
    (:func:`weight_groups`) and ``op_cost`` (the operator's cost on the machine
    with its latency scaled by ``micro_batches``) may be passed to save their
    computation. ``in_flight``: micro-batches whose saved activations are live
    at once (1 here; a pipeline stage under 1F1B holds up to S - i of them).
    """
    from shardplan.cost.collectives import allgather_time, allreduce_time
    from shardplan.cost.operator import operator_cost

    configs = np.asarray(configs, dtype=np.int64)
    k = len(configs)
    m = int(micro_batches)
    mm = latency_scaled(machine, m) if m > 1 else machine
    oc = operator_cost(op, configs, mm, orders) if op_cost is None else op_cost
    wg = weight_groups(op, configs, orders, machine) if groups is None else groups
    state, group = wg.state, wg.group
    sync0, rs, ag, wgrad_m = np.zeros(k), np.zeros(k), np.zeros(k), np.zeros(k)
    weights = wg.weights
    for vol, g, inter, big, inter_big in weights:
        sync0 += allreduce_time(vol, g, machine, inter)
        wgrad_m += allreduce_time(vol, g, mm, inter)
        rs += allgather_time(vol, g, machine, inter)
        ag += allgather_time(vol, big, machine, inter_big)
    act_grad = np.maximum(oc.grad_allreduce - wgrad_m, 0.0)
    act = wg.act / m * int(in_flight)

    has_grad = bool(op.grad_tensors)
    fwd = (oc.compute / (1 + len(op.grad_tensors)) + oc.forward_allreduce
           + (oc.stats / 2 + oc.halo / 2 + oc.recurrence / 2 if has_grad else oc.stats + oc.halo + oc.recurrence))
    o = float(optimizer_factor)
    stage_list = [s for s in stages if s in STAGES] if weights else [0]
    if 0 not in stage_list:
        stage_list = [0] + stage_list
    rows = []
    for s in stage_list:
        if s == 0:
            sync, mem = sync0, state * (2 + o)
        elif s == 1:
            sync, mem = rs + ag, state * (2 + o / group)
        elif s == 2:
            sync, mem = m * rs + ag, state * (1 + (1 + o) / group)
        else:
            sync, mem = m * (rs + 2 * ag), state * (2 + o) / group
        for r in ([False, True] if recompute else [False]):
            rows.append((s, r, sync, mem, np.zeros(k) if r else act, fwd if r else np.zeros(k)))
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
    )
    return table.take(_undominated(table.base, table.seconds, table.bytes)) if prune else table


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
