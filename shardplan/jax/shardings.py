"""A plan becomes JAX shardings: one per operator output, per operator read, per argument leaf.

Layout of one operator. A configuration ``c`` (one split factor per
iteration dimension) is a device grid: device ``q < Π c`` has the row-major
coordinates ``unravel(q, c)``, the numbering of :mod:`shardplan.cost.tiles`.
It is expressed as a :class:`jax.sharding.Mesh` over *all* p devices of
shape ``(p / Π c, c_d for every split d)`` with axis names ``("_rep", d...)``:
the leading replica axis makes devices ``0 .. Π c - 1`` the first replica,
with exactly the coordinates the cost model uses (the other replicas repeat
the same work; the cost model leaves those devices idle, so the predicted
time and bytes per device are the same). This needs ``Π c | p``; otherwise
:class:`~shardplan.errors.ShardplanError` names the operator — solve with
``divides_p=True`` to keep only expressible configurations.

A tensor axis indexed by a split dimension d (plainly, or as the leading
dimension of a merged axis) is sharded over mesh axis d: coordinate i holds
the block ``[i E/c_d, (i+1) E/c_d)``, as in the cost model. Every other mesh
axis replicates it; in particular the output of an operator whose reduction
dimensions are split is replicated over them, so XLA all-reduces the partial
sums, as the cost model charges.

Reads. Each operand an operator's equation reads gets the sharding of the
operator's input tensor under its configuration (the consumer side of the
edge), so that :mod:`shardplan.jax.run` can constrain both sides.

Partial layouts (:attr:`shardplan.layout.Layout.partial`). An operator that
leaves its output as partial sums gets no output constraint (it is left out
of :attr:`PlanShardings.values`): its consumers' read constraints are the
only ones on the value, so XLA reduces the partial sums into each consumer's
layout (a reduce-scatter into a split one, an all-reduce into a replicated
one), as :mod:`shardplan.cost.edge` charges. An operator that leaves its
inputs' gradients as partial sums has its reads constrained forward only
(:attr:`PlanShardings.free_cotangents`): the gradient is reduced into the
producer's layout, which the producer's output constraint pins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from shardplan.errors import ShardplanError
from shardplan.jax.lower import TraceInfo
from shardplan.ir import Operator, Tensor

__all__ = ["REPLICA_AXIS", "config_mesh", "tensor_spec", "operator_sharding", "layout_mesh", "layout_sharding",
           "PlanShardings", "plan_shardings", "check_expressible", "replicated", "sharding_bits", "reshard_chain"]

REPLICA_AXIS = "_rep"


def check_expressible(op: Operator, config: Sequence[int], p: int) -> None:
    """Raise unless ``Π config`` divides ``p`` (a mesh over all p devices can express it)."""
    n = math.prod(int(c) for c in config)
    if p % n:
        dims = ", ".join(f"{d}={c}" for d, c in zip(op.dim_names, config))
        raise ShardplanError(
            f"operator {op.name!r}: configuration ({dims}) uses {n} devices, which does not divide p={p}; "
            "a JAX mesh cannot express it (solve with divides_p=True)"
        )


def config_mesh(op: Operator, config: Sequence[int], devices: Sequence[Any],
                order: Sequence[int] | None = None) -> Any:
    """The mesh ``(p / Π c, c_d for split d)`` named ``("_rep", d...)`` over ``devices`` in order.

    ``order`` (dimension indices, most significant first) is the grid nesting
    of the configuration (see :func:`shardplan.cost.tiles.grid_strides`); the
    split dims become mesh axes in that order. Default: the operator's own order.
    """
    from jax.sharding import Mesh

    p = len(devices)
    check_expressible(op, config, p)
    idx = range(len(op.dim_names)) if order is None else [int(j) for j in order]
    split = [(op.dim_names[j], int(config[j])) for j in idx if int(config[j]) > 1]
    shape = (p // math.prod(c for _, c in split),) + tuple(c for _, c in split)
    arr = np.empty(len(devices), dtype=object)
    arr[:] = list(devices)
    return Mesh(arr.reshape(shape), (REPLICA_AXIS,) + tuple(d for d, _ in split))


def _axis_dims(tensor: Tensor) -> list[str | None]:
    """Per axis, the dimension that blocks it: a plain axis's dim or a merged axis's leading dim."""
    out: list[str | None] = []
    for a in tensor.axes:
        out.append(a.dim if a.dim is not None and (a.is_plain or a.inner) else None)
    return out


def tensor_spec(axis_dims: Sequence[str | None], op: Operator, config: Sequence[int]) -> Any:
    """PartitionSpec: axis i sharded over mesh axis ``axis_dims[i]`` when that dimension is split."""
    from jax.sharding import PartitionSpec

    split = {d for d, c in zip(op.dim_names, config) if int(c) > 1}
    used: set[str] = set()
    spec: list[str | None] = []
    for d in axis_dims:
        if d is not None and d in split and d not in used:
            spec.append(d)
            used.add(d)
        else:
            spec.append(None)
    return PartitionSpec(*spec)


def operator_sharding(op: Operator, config: Sequence[int], devices: Sequence[Any],
                      order: Sequence[int] | None = None) -> Any:
    """The NamedSharding of ``op``'s output under ``config`` (grid nested as ``order``)."""
    from jax.sharding import NamedSharding

    return NamedSharding(config_mesh(op, config, devices, order), tensor_spec(_axis_dims(op.output), op, config))


def layout_mesh(layout: Any, devices: Sequence[Any]) -> Any:
    """The :class:`jax.sharding.Mesh` of a :class:`~shardplan.layout.Layout` over ``devices`` in order
    (shape and axis names from :meth:`~shardplan.layout.Layout.mesh_shape` / ``mesh_axes``)."""
    from jax.sharding import Mesh

    if len(devices) != layout.num_devices:
        raise ShardplanError(f"layout is for {layout.num_devices} devices, got {len(devices)}")
    arr = np.empty(len(devices), dtype=object)
    arr[:] = list(devices)
    return Mesh(arr.reshape(layout.mesh_shape()), layout.mesh_axes())


def layout_sharding(layout: Any, axis_dims: Sequence[str | None], devices: Sequence[Any]) -> Any:
    """NamedSharding of a tensor whose axes are blocked by ``axis_dims`` under ``layout``."""
    from jax.sharding import NamedSharding, PartitionSpec

    return NamedSharding(layout_mesh(layout, devices), PartitionSpec(*layout.partition_spec(axis_dims)))


def replicated(devices: Sequence[Any]) -> Any:
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    arr = np.empty(len(devices), dtype=object)
    arr[:] = list(devices)
    return NamedSharding(Mesh(arr, (REPLICA_AXIS,)), PartitionSpec())


def sharding_bits(sharding: Any, ndim: int, devices: Sequence[Any]) -> tuple[tuple[int, ...], ...] | None:
    """The bit labeling (:mod:`shardplan.cost.reshard`) of a NamedSharding over ``devices`` in order: per
    array axis, the device-index bits of its block index, major first; None unless the mesh lists exactly
    ``devices`` in order and every mesh axis has a power-of-two size. A mesh is row-major over the devices,
    so its last axis holds the lowest bits."""
    mesh = sharding.mesh
    if list(mesh.devices.flat) != list(devices):
        return None
    bits: dict[str, tuple[int, ...]] = {}
    pos = 0
    for name in reversed(mesh.axis_names):
        size = int(mesh.shape[name])
        k = size.bit_length() - 1
        if size != 1 << k:
            return None
        bits[name] = tuple(range(pos + k - 1, pos - 1, -1))
        pos += k
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    out = []
    for entry in spec[:ndim]:
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        out.append(tuple(b for nm in names for b in bits[nm]))
    return tuple(out)


def reshard_chain(source: Any, target: Any, shape: Sequence[int], devices: Sequence[Any],
                  memo: dict | None = None) -> list[Any] | None:
    """The intermediate shardings of the redistribution from ``source`` to ``target`` of an array of
    ``shape`` as the steps of :func:`shardplan.cost.reshard.reshard_steps` (each lowered by XLA to one
    collective, the bytes :func:`shardplan.cost.edge.step_volumes` charges), the target excluded; None where
    it does not apply (devices not 2^n with 1 <= n <= MAX_BITS, a labeling not of bits, a split that does not
    divide its axis) or where the change is a single step (the target constraint alone does it)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from shardplan.cost.reshard import MAX_BITS, reshard_steps

    p = len(devices)
    n = p.bit_length() - 1
    if p != 1 << n or not 1 <= n <= MAX_BITS:
        return None
    src = sharding_bits(source, len(shape), devices)
    dst = sharding_bits(target, len(shape), devices)
    if src is None or dst is None or src == dst:
        return None
    caps = tuple(min((int(x) & -int(x)).bit_length() - 1 if x else 0, n) for x in shape)
    if any(len(a) > c or len(b) > c for a, b, c in zip(src, dst, caps)):
        return None
    steps = reshard_steps(src, dst, caps, n, memo)
    if len(steps) <= 1:
        return None
    arr = np.empty(p, dtype=object)
    arr[:] = list(devices)
    names = tuple(f"_bit{b}" for b in range(n - 1, -1, -1))
    mesh = Mesh(arr.reshape((2,) * n), names)
    return [NamedSharding(mesh, PartitionSpec(*[tuple(f"_bit{b}" for b in seq) if seq else None for seq in st.after]))
            for st in steps[:-1]]


@dataclass(frozen=True)
class PlanShardings:
    """Shardings of a plan for one traced function.

    Attributes:
        values: jaxpr variable id -> NamedSharding of the operator output it holds.
        by_operator: operator name -> NamedSharding of its output.
        leaves: one NamedSharding per argument leaf (first consumer's layout, or replicated).
        reads: (equation index, operand slot) -> NamedSharding its operator reads that operand in.
        free_cotangents: the reads of operators with a partial layout: constrained forward only.
        sources: (equation index, operand slot) -> the sharding the operand has before the read (its producer's
            output sharding, or its argument leaf's), where known: the start of the read's redistribution.
        steps: whether reads redistribute in the steps the cost model charges (:func:`reshard_chain`; the
            plan's machine has one level, as :func:`shardplan.cost.edge.step_volumes` requires, and charges
            them: ``Machine.stepwise_redistribution``).
    """

    values: Mapping[int, Any]
    by_operator: Mapping[str, Any]
    leaves: tuple[Any, ...]
    reads: Mapping[tuple[int, int], Any]
    free_cotangents: frozenset[tuple[int, int]] = frozenset()
    sources: Mapping[tuple[int, int], Any] | None = None
    steps: bool = False


def devices_and_machine(devices: Sequence[Any] | None, machine: Any) -> tuple[list[Any], Any]:
    """The devices to run on (default: all of ``jax.devices()``) and the machine to plan for.

    ``machine`` None: the machine detected from the devices
    (:func:`shardplan.machine.detect_machine` on their ``device_kind``, or their platform when
    the kind is empty; one device per JAX device; the processes are those holding the devices);
    devices of different kinds are an error. Otherwise its device count must equal the number of
    devices.
    """
    import jax

    from shardplan.machine import detect_machine

    devs = list(devices) if devices is not None else list(jax.devices())
    p = len(devs)
    if not p:
        raise ShardplanError("no devices to plan for")
    if machine is None:
        kinds = sorted({d.device_kind or d.platform for d in devs})
        if len(kinds) > 1:
            raise ShardplanError(f"devices of different kinds ({', '.join(map(repr, kinds))}): pass machine= "
                                 f"(e.g. machine=Machine.from_file('my-cluster.json', {p}))")
        processes = len({d.process_index for d in devs})
        return devs, detect_machine(kinds[0], p, processes=processes)
    if machine.num_devices != p:
        raise ShardplanError(f"machine has {machine.num_devices} devices but {p} devices were given")
    return devs, machine


def plan_shardings(plan: Any, info: TraceInfo, devices: Sequence[Any]) -> PlanShardings:
    """Every operator's output sharding and every argument leaf's sharding under ``plan``."""
    g = plan.graph
    p = len(devices)
    if plan.machine.num_devices != p:
        raise ShardplanError(f"plan is for {plan.machine.num_devices} devices, got {p} devices")
    configs = plan.configs
    for op in g.operators:
        check_expressible(op, configs[op.name], p)
    lays = plan.layouts
    by_op = {op.name: layout_sharding(lays[op.name], _axis_dims(op.output), devices) for op in g.operators}
    from shardplan.configs import forward_deferrable

    partial_out = {op.name for op in g.operators if lays[op.name].partial and forward_deferrable(op)}
    values = {info.op_vars[name]: s for name, s in by_op.items() if name in info.op_vars and name not in partial_out}
    reads = {(k, slot): layout_sharding(lays[name], dims, devices)
             for name, rs in info.reads.items() if name in g.index for k, slot, dims in rs}
    free = frozenset((k, slot) for name, rs in info.reads.items() if name in g.index and lays[name].partial
                     for k, slot, _ in rs)
    leaves = []
    for i in range(len(info.leaf_names)):
        uses = info.leaf_uses.get(i, ())
        if not uses:
            leaves.append(replicated(devices))
            continue
        name, dims = uses[0]
        leaves.append(layout_sharding(lays[name], dims, devices))
    prog = info.program
    arg = {var: i for i, var in enumerate(prog.invars)}
    sources = {}
    for k, slot in reads:
        var = prog.eqns[k].invars[slot]
        if isinstance(var, int) and var in values:
            sources[(k, slot)] = values[var]
        elif isinstance(var, int) and var in arg:
            sources[(k, slot)] = leaves[arg[var]]
    return PlanShardings(values, by_op, tuple(leaves), reads, free, sources,
                         len(plan.machine.levels) == 1 and plan.machine.stepwise_redistribution)
