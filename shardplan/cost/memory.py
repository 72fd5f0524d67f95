"""Memory per device of a strategy.

For each operator and configuration, per device q (bytes):

    weights:     sum_W |W tile(q)| * (1 + 1 + m)    (value, gradient, m words of optimizer state;
                                                     W whole along an axis its owner reads through a piece)
                 (a parameter read by several operators is charged once, to
                 its owner, in the owner's layout: ``Tensor.owner``)
    activations: saved * |output tile(q)|           (kept for the backward pass; ``Operator.saved``
                                                     output tiles: 1 unless the frontend knows better)
    recomputing: sum_i share_i * |input_i tile(q)|   (instead of the activations: the inputs it recomputes
                                                     from that no producer keeps, :func:`recompute_keep_bytes`)
    transient:   sum_t n_t * |t tile(q)|             (held only during the operator's own backward step:
                                                     ``Operator.transient``, :func:`transient_bytes`)

(m = 2 for Adam, 0 for plain SGD.) A strategy's memory on device q is the
sum over operators of their chosen configuration's row plus the largest
transient of the operators (the step at which it is held adds it to what is
live), and the strategy needs the maximum over devices. This ranks nothing; it is a constraint.

The memory-saving choices of the fit search (:func:`choice_table`) add ZeRO
state sharding, recomputation, FP8 matrix products and host offload
(:class:`ChoiceRules`); their model is in ``docs/memory.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from shardplan.cost.contention import exposed_beside
from shardplan.cost.tiles import as_layouts, stored_weight, tile_volumes, uniform_tiles
from shardplan.ir import Operator
from shardplan.machine import Machine

__all__ = ["operator_memory", "strategy_memory", "transient_bytes", "ChoiceTable", "choice_table", "WeightGroups", "weight_groups", "latency_scaled", "STAGES",
           "recompute_keep_bytes", "unsaved_inputs", "ChoiceRules", "OFFLOADS", "OFFLOAD_BITS", "fp8_product",
           "fp8_scaling_seconds", "offload_names", "te_saved", "NO_READ_KINDS", "OUTPUT_FREE_KINDS", "FP8_SCALINGS",
           "fp8_extra_bytes"]


def operator_memory(op: Operator, configs, machine: Machine, optimizer_factor: float = 2.0,
                    orders: np.ndarray | None = None, per_device: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(weight bytes, activation bytes) per layout and device: two (K, p) arrays, or two (K, 1) arrays when
    every device holds the same (every tile regular and no device idle: :func:`~shardplan.cost.tiles.uniform_tiles`;
    a column that broadcasts over the devices, with the same sums and maxima).

    ``configs``: :class:`~shardplan.layout.LayoutArrays` or configuration rows (with optional ``orders``);
    ``per_device``: always (K, p) (the per-device computation, for checking the columns against it).
    """
    p = machine.num_devices
    nbytes = machine.dtype_bytes
    lay = as_layouts(configs, p, orders, machine.levels)
    k = len(lay)
    stored = [stored_weight(t) for t in op.weights if t.owner is None]  # owned weights as their devices hold them
    if not per_device:
        vols = [uniform_tiles(op, t, lay) for t in (*stored, op.output)]
        if all(v is not None for v in vols):
            w = np.zeros((k, 1))
            for t, vol in zip(stored, vols):
                w += (vol * t.elem_factor * nbytes * (2.0 + optimizer_factor))[:, None]
            act = (vols[-1].astype(np.float64) * nbytes * op.saved)[:, None]
            return w, act
    w = np.zeros((k, p))
    for t in stored:
        w += tile_volumes(op, t, lay) * t.elem_factor * nbytes * (2.0 + optimizer_factor)
    act = tile_volumes(op, op.output, lay).astype(np.float64) * nbytes * op.saved
    return w, act


def transient_bytes(op: Operator, configs, machine: Machine, micro_batches: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(activation part, weight part) of the bytes ``op``'s backward step holds at once besides what is
    saved and the persistent gradient buffers, per layout (largest device): (K,) arrays.

        activation part = (n_out |output tile| + sum_i n_i |input_i tile|) * s / m
        weight part     = sum_W n_W |W tile| * s

    with n the tile counts of :attr:`~shardplan.ir.Operator.transient` (zeros when it is empty), tiles in
    elements of each tensor's own size (``elem_factor``), ``s`` the machine's element size, and ``m``
    micro-batches (an activation tile is the micro-batch's; a weight's fresh gradient is the whole tile,
    gathered at ZeRO stage 3 before its reduce-scatter).
    """
    from shardplan.cost.operator import tile_volume

    p = machine.num_devices
    lay = as_layouts(configs, p, None, machine.levels)
    k = len(lay)
    act, wt = np.zeros(k), np.zeros(k)
    if not op.transient:
        return act, wt
    nbytes = float(machine.dtype_bytes)
    n_act = 1 + len(op.inputs)  # the output and the inputs come first
    for i, (n, t) in enumerate(zip(op.transient, (op.output, *op.inputs, *op.weights))):
        if n > 0.0:
            vol = tile_volume(op, t, lay, p).astype(np.float64) * nbytes * n
            if i < n_act:
                act += vol / float(micro_batches)
            else:
                wt += vol
    return act, wt


def strategy_memory(per_op: list[tuple[np.ndarray, np.ndarray]], assignment,
                    transients: Sequence[float] | None = None) -> dict[str, float]:
    """Peak bytes over devices of a strategy, and its weight / activation parts on that device.

    ``transients``: per operator, the bytes its backward step holds at once at the chosen layout
    (:func:`transient_bytes`, largest device); the peak adds the largest (``transient_bytes`` and
    ``transient_operator``, its index, in the answer; every saved activation is counted live, so this
    bounds every step of the backward pass)."""
    w = sum(m[0][a] for m, a in zip(per_op, assignment))
    act = sum(m[1][a] for m, a in zip(per_op, assignment))
    tot = w + act
    q = int(np.argmax(tot))
    out = {"peak_bytes": float(tot[q]), "weights_bytes": float(w[q]), "activations_bytes": float(act[q]),
           "device": q}
    if transients is not None and len(transients):
        v = int(np.argmax(transients))
        out.update(peak_bytes=out["peak_bytes"] + float(transients[v]), transient_bytes=float(transients[v]),
                   transient_operator=v)
    return out


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
            synchronisation and ZeRO gathers), ``recompute`` (the forward run again), ``optimizer`` (the
            device's optimizer step on the shard it owns, once per step; none with the optimizer offloaded).
        state_bytes: weights, gradients and optimizer state per device.
        activation_bytes: activations kept for the backward pass, per device.
        grad_bytes: the weight-gradient part of ``state_bytes`` (P at stages 0 and 1, P/G at
            stages 2 and 3: :mod:`shardplan.fit`); the rest (value and optimizer state) is
            :attr:`rest_bytes`. Zero when not given.
        fp8: whether the operator's products run in FP8 (False when not given).
        offload: what the choice keeps in host memory, a bit mask of :data:`OFFLOAD_BITS` (0 when not given).
        host_bytes: host memory per device the choice holds (zero when not given).
        transient_bytes: bytes held only during the operator's own backward step, on top of what is
            live there (:func:`transient_bytes`, both parts; zero when not given).
    """

    base: np.ndarray
    stage: np.ndarray
    recompute: np.ndarray
    parts: dict[str, np.ndarray]
    state_bytes: np.ndarray
    activation_bytes: np.ndarray
    grad_bytes: np.ndarray | None = None
    fp8: np.ndarray | None = None
    offload: np.ndarray | None = None
    host_bytes: np.ndarray | None = None
    transient_bytes: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(np.asarray(self.state_bytes))
        for name, dtype in (("grad_bytes", np.float64), ("fp8", bool), ("offload", np.int64),
                            ("host_bytes", np.float64), ("transient_bytes", np.float64)):
            if getattr(self, name) is None:
                object.__setattr__(self, name, np.zeros(n, dtype=dtype))

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
        if self.fp8[j]:
            out.append("fp8")
        out += [f"offload-{n}" for n in offload_names(int(self.offload[j]))]
        return "+".join(out) or "-"

    def take(self, keep: np.ndarray) -> "ChoiceTable":
        return ChoiceTable(self.base[keep], self.stage[keep], self.recompute[keep],
                           {k: v[keep] for k, v in self.parts.items()}, self.state_bytes[keep],
                           self.activation_bytes[keep], self.grad_bytes[keep], self.fp8[keep], self.offload[keep],
                           self.host_bytes[keep], self.transient_bytes[keep])


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
    ``act`` is ``Operator.saved`` output tiles. ``sync_groups``, per entry of ``weights``: the groups per level
    (L, K) its gradient's all-reduce runs among, as :func:`shardplan.cost.operator.operator_cost` charges it:
    its reduction group alone, or with ``machine.reduce_per_dim`` one group per split reduction dim (XLA's
    lowering), so that the weight syncs charged here are the ones the operator's cost holds.
    """

    state: np.ndarray
    act: np.ndarray
    group: np.ndarray
    weights: tuple[tuple[np.ndarray, np.ndarray, np.ndarray, float], ...]
    sync_groups: tuple[tuple[np.ndarray, ...], ...] = ()


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
        if t.owner is None:  # held whole along any axis its owner reads through a piece (stored_weight)
            state += tile_volume(op, stored_weight(t), lay, p) * nbytes
    group = np.ones(k)
    rows = []
    syncs = []
    for t in op.weights:
        if not t.needs_grad:
            continue
        dims = [op.dim_names.index(d) for d in op.grad_reduction_dims(t)]
        gl = lay.group_sizes(dims)
        vol = tile_volume(op, t, lay, p, core=False) * nbytes
        big = gl * reps
        rows.append((vol, gl, big, 0.0 if t.owner is not None and machine.sum_shared_grads else 1.0))
        syncs.append(tuple(lay.group_sizes([d]) for d in dims) if machine.reduce_per_dim and len(dims) > 1
                     else (gl,))
        group = np.maximum(group, big.prod(axis=0))  # weights of one operator share their data-parallel group
    # ``saved`` counts output tiles in the machine's element size (as :func:`operator_memory`): not ``elem_factor``
    act = tile_volume(op, op.output, lay, p) / float(op.output.elem_factor) * nbytes * op.saved
    return WeightGroups(state, act, group, tuple(rows), tuple(syncs))


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
            out += tile_volume(op, t, lay, p) * nbytes * share  # the tile's elements include elem_factor
    return out


def _bucketed(vol: np.ndarray, machine: Machine, collective) -> np.ndarray:
    """A weight's share of its bucket's collective, as :mod:`shardplan.cost.operator` charges it."""
    bucket = machine.grad_bucket_bytes
    if bucket is None:
        return collective(vol)
    return np.minimum(vol / bucket, 1.0) * collective(np.maximum(vol, bucket))


OFFLOADS = ("optimizer", "parameters", "activations")
"""What may live in host memory (:class:`ChoiceRules`): the optimizer state (ZeRO-Offload), the parameters
(with the optimizer state, at ZeRO stage 3: ZeRO-Infinity's ``offload_param``), the saved activations."""

OFFLOAD_BITS = {"optimizer": 1, "parameters": 2, "activations": 4}
"""Bit of each part of :data:`OFFLOADS` in :attr:`ChoiceTable.offload`."""

FP8_SCALINGS = ("delayed", "current")
"""How an FP8 cast finds its scale (:attr:`ChoiceRules.fp8_scaling`): from the amax history of earlier steps
(Transformer Engine's ``DelayedScaling``) or from the tensor's own amax, read before the cast (per-tensor current
scaling, TE's ``Float8CurrentScaling``, Megatron-Core's ``fp8_recipe=tensorwise``)."""


def offload_names(mask: int) -> tuple[str, ...]:
    """The parts of :data:`OFFLOADS` set in ``mask``."""
    return tuple(n for n in OFFLOADS if mask & OFFLOAD_BITS[n])


@dataclass(frozen=True)
class ChoiceRules:
    """Precision rules and the precision/offload choices offered beside layouts, stages and recomputation.

    Attributes:
        fp8: offer FP8 for every matrix product (:func:`fp8_product`) on a machine with ``fp8_flops``.
        offload: the parts of :data:`OFFLOADS` offered (on a machine with a host link and host memory;
            the optimizer part also needs ``cpu_adam_rate``).
        master_weights: mixed precision as Megatron-LM and DeepSpeed store it: besides the weights and
            gradients in the machine's element size, an fp32 master copy of every weight and fp32
            optimizer state (``optimizer_factor`` fp32 words): ``(4 + 4 o) / s`` words of ``s`` bytes per
            parameter instead of ``o`` (16 bytes per parameter for Adam at s = 2: ZeRO's 2 + 2 + 12).
            At s = 4 the weights are their own master copy: ``o`` words.
        zero3_regather: a recomputing operator at ZeRO stage 3 gathers its weights a third time, for the
            recomputed forward (DeepSpeed's ZeRO-3: its module pre-forward hook fetches the parameters on
            every forward call, the recomputed one included, and the reuse window
            ``stage3_max_reuse_distance``, 1e9 elements by default, keeps a weight from the recomputed forward
            to its backward only when fewer elements are used in between). False: the recomputed forward
            and the backward share one gather (an FSDP unit wrapping the checkpointed block; shardplan's own
            runtimes, whose checkpointed segment gathers inside the segment and the backward reuses it).
            Overlapped with the recomputed forward's compute exactly when the forward gather is.
        zero3_grad_allreduce: at ZeRO stage 3 each micro-batch's weight gradient is all-reduced over the
            data-parallel group (each device then keeps its shard) instead of reduce-scattered: DeepSpeed's
            ZeRO-3 with its ``reduce_scatter`` setting false, the default of v0.3.x
            (``ZERO_OPTIMIZATION_REDUCE_SCATTER_DEFAULT = False``; ``stage3.py``'s ``average_tensor`` and
            ``buffered_reduce_fallback`` then call ``dist.all_reduce`` on the gradient bucket), charged as a
            stage-0 gradient's all-reduce (the cheaper of NCCL's ring and tree: twice a reduce-scatter's ring
            bytes); overlapped with the backward exactly when the reduce-scatter would be.
            Memory as the reduce-scatter's (the full gradient of a bucket exists transiently in both).
        fp8_saved_inputs: an FP8 product keeps the FP8 copy of each of its input tiles itself (True: one
            copy per product at the product's input tile, shardplan's JAX runtime, whose FP8 product's custom
            VJP keeps its quantised operands: :mod:`shardplan.jax.fp8`). False: the producers' ``saved``
            already counts the copy (a graph rewritten by :func:`te_saved`: Transformer Engine keeps one FP8
            copy per input tensor, at the producer's tile); a product then adds only the copies of graph
            inputs.
        fp8_params: an FP8 product's weights are stored in FP8 only (Transformer Engine's ``fp8_model_init``,
            Megatron-Core's ``--fp8-param-gather``): no copy in the machine's element size beside the FP8
            data and its transpose (:func:`fp8_extra_bytes`' cache), the ZeRO gathers of the weights move
            one byte per element, and the optimizer step writes the FP8 copy (docs/memory.md, "FP8
            parameters and current scaling").
        fp8_scaling: :data:`FP8_SCALINGS`: ``delayed`` (each tensor's scale from the amax history of earlier
            steps) or ``current`` (per-tensor current scaling, TE's ``Float8CurrentScaling``: each tensor's
            amax read in a pass of its own before its cast; :func:`fp8_scaling_seconds`).
    """

    fp8: bool = False
    offload: tuple[str, ...] = ()
    master_weights: bool = False
    zero3_regather: bool = False
    zero3_grad_allreduce: bool = False
    fp8_saved_inputs: bool = True
    fp8_params: bool = False
    fp8_scaling: str = "delayed"

    def __post_init__(self) -> None:
        from shardplan.errors import ShardplanError

        for name in ("fp8", "master_weights", "zero3_regather", "zero3_grad_allreduce", "fp8_saved_inputs",
                     "fp8_params"):
            if not isinstance(getattr(self, name), bool):
                raise ShardplanError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.fp8_scaling not in FP8_SCALINGS:
            raise ShardplanError(f"fp8_scaling must be one of {', '.join(FP8_SCALINGS)}, got {self.fp8_scaling!r}")
        if self.fp8_params and self.offload:
            raise ShardplanError("fp8_params with host offload: the offloaded FP8 weights and their copies are not "
                                 "modelled")
        parts = tuple(self.offload)
        bad = [x for x in parts if x not in OFFLOADS]
        if bad:
            raise ShardplanError(f"offload {bad[0]!r} is not one of {', '.join(OFFLOADS)}")
        object.__setattr__(self, "offload", tuple(x for x in OFFLOADS if x in parts))

    def optimizer_words(self, optimizer_factor: float, dtype_bytes: int) -> float:
        """Words of ``dtype_bytes`` per parameter element held as optimizer state (master copy included)."""
        o = float(optimizer_factor)
        if not self.master_weights or dtype_bytes >= 4:
            return o
        return (4.0 + 4.0 * o) / float(dtype_bytes)

    def optimizer_step_bytes(self, optimizer_factor: float, dtype_bytes: int) -> float:
        """HBM bytes per parameter element of the device's optimizer step under these rules
        (:func:`shardplan.cost.operator.optimizer_step_bytes`)."""
        from shardplan.cost.operator import optimizer_step_bytes

        return optimizer_step_bytes(optimizer_factor, dtype_bytes, self.master_weights)

    def fp8_param_step_bytes(self, optimizer_factor: float, dtype_bytes: int) -> float:
        """HBM bytes per parameter element of the optimizer step of an FP8 product's weights under
        ``fp8_params``: :meth:`optimizer_step_bytes` with the copy the next step computes with written in one
        byte instead of ``s`` (the master shard cast to FP8: Megatron-Core's ``quantize_param_shard``), plus,
        under ``current`` scaling, a read of the fp32 master shard for its amax (4 bytes; the amax is then
        all-reduced over the data-parallel group, a scalar per tensor, not charged):

            step_bytes - s + 1 + 4 [current]

        Without ``fp8_params``: :meth:`optimizer_step_bytes` (the weight's amax is taken where it is cast, in
        :func:`fp8_scaling_seconds`)."""
        base = self.optimizer_step_bytes(optimizer_factor, dtype_bytes)
        if not self.fp8_params:
            return base
        return base - float(dtype_bytes) + 1.0 + (4.0 if self.fp8_scaling == "current" else 0.0)


def fp8_product(op: Operator) -> bool:
    """Whether ``op`` is a matrix product FP8 may run: it multiplies and adds (``flops_per_point`` >= 2)
    and contracts an input with a trainable weight (a dimension the output does not index indexes both).

    Read off the description: a dense layer, a projection or a convolution is one; attention's two
    products (no weight), an embedding (one FLOP per vocabulary entry, a gather), a norm or an
    elementwise operator is not."""
    if op.flops_per_point < 2.0 or op.recurrence is not None:
        return False
    red = set(op.reduction_dims)
    inputs = set().union(*(t.dims for t in op.inputs)) if op.inputs else set()
    return any(w.needs_grad and red & w.dims & inputs for w in op.weights)


NO_READ_KINDS = frozenset({"add", "rope"})
"""Operator kinds whose backward reads none of their inputs: a sum (the gradient passes through) and the rotary
embedding (a fixed rotation of its input: its backward rotates the gradient back)."""

OUTPUT_FREE_KINDS = frozenset({"add", "rope", "rms_norm", "layer_norm", "embedding", "ffn"})
"""Kinds of operators that are not matrix products whose own backward does not read their output: the two of
:data:`NO_READ_KINDS`, the norms (they read their input and its statistics), the embedding (it reads the
token ids) and the feed-forward elementwise operators (SwiGLU, GELU: they read their inputs). A matrix product
(:func:`fp8_product`) is judged by its readers instead (:func:`te_saved`)."""


def te_saved(graph, fp8: frozenset[str] = frozenset(), keep: frozenset[str] = frozenset(),
             element_bytes: int = 2):
    """``graph`` with each operator's ``saved`` set to what Megatron-Core with Transformer Engine layers keeps
    of its output for the backward pass (docs/memory.md, "Published H100 recipes' memory").

    ``fp8``: the names of the products that run in FP8 (Transformer Engine's layers keep the FP8 copy of their
    input instead of the input); ``keep``: operators whose ``saved`` stays as given (those that recompute,
    whose consumers' kept inputs it decides). With R the consumers that read the output in their backward
    (kind not in :data:`NO_READ_KINDS`, or recomputing) and F those of R in ``fp8``, an operator keeps, in
    tiles of its output at ``element_bytes`` bytes per element:

        saved' = max(saved - 1, 0)                         (statistics and masks kept beside the output)
                 + 1   if it is a matrix product and R is not empty (a fused epilogue, GPT's bias-GELU, reads
                            its pre-activation), or its kind is not in OUTPUT_FREE_KINDS (its own backward
                            may read its output: FlashAttention's reads it), or R - F is not empty
                 + 1 / element_bytes   if F is not empty   (one FP8 copy of the tile, TE's saved input)

    An operator without consumers (the loss) and one in ``keep`` are unchanged. Use with
    ``ChoiceRules(fp8_saved_inputs=False)``: the FP8 products then count no copy of their own.

    Raises:
        ShardplanError: an FP8 product in ``fp8`` that does not recompute reads an operator in ``keep``
            that does (its FP8 copy would be counted nowhere).
    """
    from shardplan.errors import ShardplanError
    from shardplan.ir import Graph

    consumers: dict[str, list] = {op.name: [] for op in graph.operators}
    for op in graph.operators:
        for t in op.inputs:
            if t.src in consumers:
                consumers[t.src].append(op)
    recomputed = set(keep) | set(graph.recomputed)
    copy = 1.0 / float(element_bytes)

    def new(op: Operator) -> Operator:
        users = consumers[op.name]
        readers = [c for c in users if c.name in recomputed or c.kind not in NO_READ_KINDS]
        fp8_readers = [c for c in readers if c.name in fp8 and c.name not in recomputed]
        if op.name in recomputed:
            if fp8_readers:
                raise ShardplanError(f"te_saved: FP8 product {fp8_readers[0].name!r} keeps its input's FP8 copy, "
                                     f"but its producer {op.name!r} recomputes (its copy would be counted nowhere)")
            return op
        if not users:
            return op
        product = fp8_product(op)
        bf16 = ((product and bool(readers)) or (not product and op.kind not in OUTPUT_FREE_KINDS)
                or len(readers) > len(fp8_readers))
        saved = max(float(op.saved) - 1.0, 0.0) + (1.0 if bf16 else 0.0) + (copy if fp8_readers else 0.0)
        return op if saved == op.saved else replace(op, saved=saved)

    return Graph(graph.name, tuple(new(op) for op in graph.operators), graph.graph_inputs, graph.ties,
                 graph.recomputed)


def fp8_scaling_seconds(op: Operator, lay, machine: Machine, weight_casts: float = 1.0, current: bool = False,
                        fp8_params: bool = False) -> np.ndarray:
    """Seconds per layout of the FP8 casts of one step of ``op``.

    Transformer Engine's delayed scaling takes each tensor's scale from the amax history of earlier
    steps, so quantising is one pass over the tensor (the amax of this cast is recorded in the same
    pass), and on Hopper, whose FP8 products take only the "TN" layout, the cast writes the FP8 copy and
    its transpose (TE's fused cast-transpose). Each operand tile of the products (every input, every
    weight, and the output gradient when the backward runs) is therefore read once in the machine's
    element size ``s`` and written twice in one byte. Current (per-tensor) scaling (``current``: TE's
    ``Float8CurrentScaling``) needs the tensor's own amax before the cast can scale it: one more read of the
    tensor in ``s`` bytes (a memory-bound pass; the amax reduction itself, a scalar per tensor, is not
    charged). Per element of an operand:

        c = s + 2 + s [current]
        seconds = (c (sum_i |X_i| + [backward] |dY|) + w sum_W |W|) / HBM bandwidth

    with the activations' tiles over the whole step (every micro-batch), and for the weights w =
    ``weight_casts`` c (cast ``weight_casts`` times a step; 1: cached in FP8 for the step's micro-batches,
    TE's ``is_first_microbatch``) or, with ``fp8_params`` (the weights stored in FP8 only:
    :attr:`ChoiceRules.fp8_params`), w = 2 ``weight_casts``: no cast, the FP8 data read and its transpose
    written once per gather (TE's ``post_all_gather_processing`` creates it where the GEMM takes only TN;
    the weight's amax is read from the master shard in the optimizer step,
    :meth:`ChoiceRules.fp8_param_step_bytes`). The scale update of delayed scaling (an amax-history reduction
    per tensor) is a few scalars: not charged. Without an HBM bandwidth (the paper's model) the casts cost
    nothing.
    """
    from shardplan.cost.operator import tile_volume

    p = machine.num_devices
    lay = as_layouts(lay, p, None, machine.levels)
    if machine.hbm_bandwidth is None:
        return np.zeros(len(lay))
    s = float(machine.dtype_bytes)
    per = s + 2.0 + (s if current else 0.0)
    acts = sum((tile_volume(op, t, lay, p, core=False) for t in op.inputs), np.zeros(len(lay)))
    if op.grad_tensors:
        acts = acts + tile_volume(op, op.output, lay, p)
    weights = sum((tile_volume(op, w, lay, p, core=False) for w in op.weights), np.zeros(len(lay)))
    w = float(weight_casts) * (2.0 if fp8_params else per)
    return (per * acts + w * weights) / float(machine.hbm_bandwidth)


def fp8_extra_bytes(op: Operator, lay, machine: Machine, saved_inputs: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(weight cache, saved input) bytes per layout an FP8 ``op`` holds beyond its BF16 self.

    Weight cache: the FP8 copy of every weight tile and its transpose, one byte each per element,
    kept for the step (TE's cached FP8 weights; at ZeRO stage 3 the gathered tile, an upper bound).
    Saved input: TE's linear layers keep the FP8 (transposed) copy of their input for the weight
    gradient, one byte per element of every input tile (a step's worth, as ``saved``). The producer's
    own output stays counted where it is (its own backward or another consumer may read it): an upper
    bound. With ``saved_inputs`` False (:attr:`ChoiceRules.fp8_saved_inputs`) only the inputs no
    operator produces (graph inputs) are counted here: the producers' ``saved`` holds the others' copies.
    """
    from shardplan.cost.operator import tile_volume

    p = machine.num_devices
    lay = as_layouts(lay, p, None, machine.levels)
    k = len(lay)
    cache = 2.0 * sum((tile_volume(op, w, lay, p) for w in op.weights if w.owner is None), np.zeros(k))
    mine = op.inputs if saved_inputs else tuple(t for t in op.inputs if t.src is None)
    saved = sum((tile_volume(op, t, lay, p) for t in mine), np.zeros(k)) if any(
        w.needs_grad for w in op.weights) else np.zeros(k)
    return cache, saved


def _offload_masks(rules: ChoiceRules, machine: Machine, stage: int, has_weights: bool,
                   has_act: bool) -> list[int]:
    """The offload masks offered at ``stage``: optimizer state at stages 1-3 (DeepSpeed offloads a ZeRO
    partition), parameters only with it at stage 3, activations anywhere (not with recomputation)."""
    if machine.host_bandwidth is None or machine.host_memory_bytes is None:
        return [0]
    opt = ("optimizer" in rules.offload and has_weights and stage >= 1 and machine.cpu_adam_rate is not None)
    param = opt and "parameters" in rules.offload and stage == 3
    act = "activations" in rules.offload and has_act
    masks = [0]
    if opt:
        masks.append(1)
        if param:
            masks.append(3)
    if act:
        masks += [mk | 4 for mk in list(masks)]
    return masks


def choice_table(op: Operator, configs, orders: np.ndarray | None, machine: Machine, micro_batches: int = 1,
                 stages: Sequence[int] = STAGES, recompute: bool = True,
                 optimizer_factor: float = 2.0, prune: bool = True, groups: WeightGroups | None = None,
                 op_cost=None, in_flight: float = 1, accumulate: int = 1,
                 forced_recompute: bool = False, recompute_keep: np.ndarray | None = None,
                 peak: bool = False, rules: ChoiceRules = ChoiceRules()) -> ChoiceTable:
    """Every (layout, stage, recompute, precision, offload) choice of ``op`` with ``micro_batches`` micro-batches.

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
    ``rules``: the precision rules and the FP8 / host-offload choices offered
    (:class:`ChoiceRules`; their costs in ``docs/memory.md``). With any offload
    offered a choice is dropped only when another is also no worse in host memory. The transient of
    the operator's backward step (:func:`transient_bytes`; the same for every choice of a layout) is in
    ``transient_bytes``; where any is held, a choice is dropped only when another is also no worse with
    it added (:func:`_undominated_peak`).
    """
    from shardplan.cost.collectives import allgather_time, allreduce_time
    from shardplan.cost.operator import (grad_accumulation_seconds, operator_cost, optimizer_elements,
                                         optimizer_step_seconds)

    lay = as_layouts(configs, machine.num_devices, orders, machine.levels)
    k = len(lay)
    m = int(micro_batches)
    mm = latency_scaled(machine, m) if m > 1 else machine
    oc = operator_cost(op, lay, mm) if op_cost is None else op_cost
    wg = weight_groups(op, lay, None, machine) if groups is None else groups
    state, group = wg.state, wg.group
    sync0, rs, ag, wgrad_m = np.zeros(k), np.zeros(k), np.zeros(k), np.zeros(k)
    ag8 = np.zeros(k)  # the weights' gathers in FP8 (ChoiceRules.fp8_params): one byte per element on the wire
    nbytes = float(machine.dtype_bytes)
    weights = wg.weights
    syncs = wg.sync_groups or tuple((gl,) for _vol, gl, _big, _part in weights)
    for (vol, gl, big, part), sync_groups in zip(weights, syncs):  # part: 0 for a gradient summed into its owner's
        for sg in sync_groups:  # the all-reduce(s) operator_cost charges the weight's gradient
            sync0 += part * _bucketed(vol, machine, lambda n: allreduce_time(n, sg, machine))
            wgrad_m += part * _bucketed(vol, mm, lambda n: allreduce_time(n, sg, mm))
        rs += part * _bucketed(vol, machine, lambda n: allgather_time(n, gl, machine))
        ag += part * _bucketed(vol, machine, lambda n: allgather_time(n, big, machine))
        if rules.fp8_params:  # a bucket of the same elements, each one byte (Megatron-Core's uint8 param buffer)
            ag8 += part * _bucketed(vol, machine, lambda n: allgather_time(n / nbytes, big, machine))
    overlap = bool(getattr(machine, "overlap_grad", False))
    keep = np.zeros(k) if recompute_keep is None else np.asarray(recompute_keep, dtype=np.float64) / m * float(in_flight)
    transient = sum(transient_bytes(op, lay, machine, m))
    has_grad = bool(op.grad_tensors)
    o = rules.optimizer_words(optimizer_factor, machine.dtype_bytes)
    # the optimizer step of the whole tile (stage 0); a ZeRO stage updates its 1/group shard
    owned = optimizer_elements(op, lay, machine.num_devices)  # the trainable elements of the tile, per layout
    step = optimizer_step_seconds(owned, machine, rules.optimizer_step_bytes(optimizer_factor, machine.dtype_bytes))
    stage_list = [s for s in stages if s in STAGES] if weights else [0]
    if 0 not in stage_list:
        stage_list = [0] + stage_list
    passes = op.passes  # the forward's share of the compute is 1 / passes
    once = 1.0 / int(accumulate)  # share of a once-per-step collective charged to one micro-batch
    # the weight gradients added up over the step's m * accumulate micro-batches outside their products, every
    # micro-batch but the first (Machine.grad_accum_bytes), this table's share; a ZeRO-2/3 device adds its shard
    accum = grad_accumulation_seconds(owned, machine) * (m * int(accumulate) - 1) * once
    charge_accum = bool(np.any(accum > 0))
    precisions: list[tuple[bool, object, np.ndarray, np.ndarray, np.ndarray]] = [
        (False, oc, np.zeros(k), np.zeros(k), np.zeros(k))]
    if rules.fp8 and machine.fp8_flops is not None and fp8_product(op):
        cache, saved_in = fp8_extra_bytes(op, lay, machine, rules.fp8_saved_inputs)
        precisions.append((True, operator_cost(op, lay, mm.fp8_machine()),
                           fp8_scaling_seconds(op, lay, machine, once, current=rules.fp8_scaling == "current",
                                               fp8_params=rules.fp8_params), cache, saved_in))
    # FP8 parameters (an FP8 choice under fp8_params): the weights' value is the FP8 data the cache holds, so the
    # s-byte value goes (a ZeRO-3 shard is kept in one byte), the gathers move one byte per element and the
    # optimizer step writes the FP8 copy (ChoiceRules.fp8_param_step_bytes)
    step8 = (optimizer_step_seconds(owned, machine, rules.fp8_param_step_bytes(optimizer_factor, machine.dtype_bytes))
             if rules.fp8_params else step)
    use_host = any(_offload_masks(rules, machine, s, bool(weights), True) != [0] for s in stage_list)
    bw = float(machine.host_bandwidth) if use_host else 1.0
    lat = float(machine.host_latency)
    share = float(machine.node_devices)  # devices sharing a node's CPUs and host memory
    contention = float(getattr(machine, "comm_contention", 0.0))  # a collective's share of the device (φ)

    def xfer(nbytes: np.ndarray, count) -> np.ndarray:
        """Seconds of ``count`` host copies moving ``nbytes`` in all (none when nothing moves)."""
        return np.where(nbytes > 0, nbytes / bw + count * lat, 0.0)

    # the activation gradients' all-reduce alone: operator_cost without the weights' overlap, less the weights'
    # all-reduce (the same formula). Subtracting charged(wgrad_m) from the overlapped total instead would leave
    # charged the difference between operator_cost's backward (its own quantised passes) and the
    # compute (passes - 1) / passes that charged() uses, wherever the weights' all-reduce outlasts the backward.
    plain_grad = (operator_cost(op, lay, replace(mm, overlap_grad=False)).grad_allreduce
                  if overlap and np.any(wgrad_m > 0) else None)
    rows = []
    for fp8, ocp, scale, cache, saved_in in precisions:
        params8 = fp8 and rules.fp8_params
        gather = ag8 if params8 else ag  # the ZeRO gathers of the weights
        backward = ocp.compute * (passes - 1) / passes  # what the weight-gradient syncs overlap
        forward = ocp.compute / passes

        def charged(sync: np.ndarray) -> np.ndarray:
            return exposed_beside(sync, backward, contention) if overlap else sync

        if plain_grad is None:
            act_grad = np.maximum(ocp.grad_allreduce - charged(wgrad_m), 0.0)
            own = None
        else:
            act_grad = np.maximum(plain_grad - wgrad_m, 0.0)
            own = ocp.grad_allreduce - act_grad  # the weights' all-reduce as operator_cost overlapped it
        step_saved = wg.act + saved_in  # bytes the backward keeps over the whole step (every micro-batch)
        act = step_saved / m * float(in_flight)
        fwd = (ocp.compute / passes + ocp.forward_allreduce
               + (ocp.stats / 2 + ocp.halo / 2 + ocp.recurrence / 2 if has_grad
                  else ocp.stats + ocp.halo + ocp.recurrence))
        fixed = {"compute": ocp.compute, "forward_allreduce": ocp.forward_allreduce, "grad_allreduce": act_grad,
                 "halo": ocp.halo, "stats": ocp.stats, "recurrence": ocp.recurrence}
        for s in stage_list:
            if s == 0:  # one micro-batch: exactly operator_cost's own overlap of the weights' all-reduce
                sync = (own if own is not None and m == 1 else charged(sync0)) * once
                mem, grad = state * (2 + o), state
            elif s == 1:
                sync, mem, grad = (charged(rs) + gather) * once, state * (2 + o / group), state
            elif s == 2:
                sync, mem, grad = charged(m * rs) + gather * once, state * (1 + (1 + o) / group), state / group
            else:  # gathers prefetched during the operator's own forward / backward when overlapping
                fwd_gather = exposed_beside(m * gather, forward, contention) if overlap else m * gather
                red = sync0 if rules.zero3_grad_allreduce else rs  # the gradient's collective per micro-batch
                sync, mem, grad = charged(m * (red + gather)) + fwd_gather, state * (2 + o) / group, state / group
            # the recomputed forward's own gather (ChoiceRules.zero3_regather), as exposed as the forward's
            regather = fwd_gather if s == 3 and rules.zero3_regather else np.zeros(k)
            mem = mem + cache
            if params8:  # the s-byte value: none beside the cache's FP8 data; at stage 3 its shard in one byte
                mem = mem - (state / group * (1.0 - 1.0 / nbytes) if s == 3 else state)
            shard = state / group if s else state  # the weight bytes this device updates
            opt_step = ((step8 if params8 else step) / (group if s else 1.0)) * once  # once a step, the shard
            for mask in _offload_masks(rules, machine, s, bool(weights), bool(np.any(step_saved > 0))):
                dev, host = mem, np.zeros(k)
                fetch = np.zeros(k)  # parameter bytes fetched before each pass (parameters offloaded)
                down = np.zeros(k)  # gradient bytes sent to the host in the backward pass
                after = np.zeros(k)  # the CPU step and what follows it, not overlapped
                moved = step_saved if mask & 4 else np.zeros(k)  # activations: down in forward, up in backward
                if mask & 1:
                    dev, host = dev - o * shard, host + o * shard + shard  # state, and the gradient received
                    down = shard * (m if s >= 2 else once)
                    after = after + shard / machine.dtype_bytes * share / float(machine.cpu_adam_rate) * once
                    if not mask & 2:
                        after = after + xfer(shard * once, once)  # the updated weights back to the device
                if mask & 2:
                    dev, host = dev - shard, host + shard
                    fetch = m * shard
                if mask & 4:
                    host = host + act
                exposed_f = np.maximum(np.maximum(xfer(fetch, m), xfer(moved, m)) - forward, 0.0)
                up_b = xfer(fetch, m) + xfer(moved, m)  # host -> device in the backward pass
                exposed_b = np.maximum(np.maximum(up_b, xfer(down, m if s >= 2 else once)) - backward, 0.0)
                t_off = exposed_f + exposed_b + after if mask else np.zeros(k)
                for r in ([True] if forced_recompute else [False, True] if recompute else [False]):
                    if r and mask & 4:
                        continue
                    # the optimizer state on the host: the CPU's step (in ``after``) replaces the device's
                    extra = {"optimizer": np.zeros(k) if mask & 1 else opt_step}
                    if charge_accum:  # with the optimizer on the host the gradient is summed there
                        extra["grad_accum"] = np.zeros(k) if mask & 1 else accum / (group if s >= 2 else 1.0)
                    rows.append((s, r, sync + regather if r else sync, dev,
                                 keep if r else (np.zeros(k) if mask & 4 else act),
                                 fwd if r else np.zeros(k), grad, fp8, scale, mask, t_off, host,
                                 {**fixed, **extra}))
    j = len(rows)
    base = np.tile(np.arange(k), j)
    parts = {name: np.concatenate([r[12][name] for r in rows]) for name in rows[0][12]}
    parts["weight_sync"] = np.concatenate([r[2] for r in rows])
    parts["recompute"] = np.concatenate([r[5] for r in rows])
    if len(precisions) > 1:
        parts["fp8_scaling"] = np.concatenate([r[8] for r in rows])
    if use_host:
        parts["offload"] = np.concatenate([r[10] for r in rows])
    table = ChoiceTable(
        base=base,
        stage=np.repeat([r[0] for r in rows], k).astype(np.int64),
        recompute=np.repeat([r[1] for r in rows], k).astype(bool),
        parts=parts,
        state_bytes=np.concatenate([r[3] for r in rows]),
        activation_bytes=np.concatenate([r[4] for r in rows]),
        grad_bytes=np.concatenate([r[6] for r in rows]),
        fp8=np.repeat([r[7] for r in rows], k).astype(bool),
        offload=np.repeat([r[9] for r in rows], k).astype(np.int64),
        host_bytes=np.concatenate([r[11] for r in rows]),
        transient_bytes=np.tile(transient, j),
    )
    if not prune:
        return table
    if peak or use_host or np.any(transient > 0):
        return table.take(_undominated_peak(table, j, k, host=use_host, peak=peak))
    return table.take(_undominated(table.base, table.seconds, table.bytes))


def _undominated_peak(table: ChoiceTable, rows: int, k: int, host: bool = False, peak: bool = True) -> np.ndarray:
    """Indices of the choices of an unpruned table (``rows`` blocks of ``k`` layouts) that no other
    choice of the same layout dominates.

    For the backward-peak model (``peak``) choice b dominates a when b's seconds, rest + saved,
    rest + gradient and rest + saved + gradient + transient are each <= a's (ties: the earlier row
    wins): every per-step constraint of :mod:`shardplan.fit`'s backward model charges an operator one
    of those three memories, so a plan using a can use b instead and be no slower and fit wherever it
    fit. For the additive model the memories are the one sum, and that sum + transient at the
    operator's own step. With ``host`` the host bytes must be <= too (the host budget is a second
    constraint).
    """
    rest, act, grad = table.rest_bytes, table.activation_bytes, table.grad_bytes
    crit = [table.seconds, rest + act + grad + table.transient_bytes]
    if peak:
        crit += [rest + act, rest + grad]
    elif np.any(table.transient_bytes > 0):
        crit.append(rest + act + grad)
    if host:
        crit.append(table.host_bytes)
    crit = np.stack(crit).reshape(len(crit), rows, k)
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
