"""An activation's gradient on its way home: reduce-scattered into a producer that scatters it.

An operator's gradient of an activation input ``X`` is a partial sum over the split dims that do not index
``X`` (its group ``G``, ``g`` devices each holding the same tile of ``X``, ``n`` bytes);
:func:`shardplan.cost.operator.operator_cost` charges the all-reduce among ``G`` (one per split dim with
``Machine.reduce_per_dim``), after which each device's tile is whole and the edge's backward redistribution
takes it to the producer's tile. Where the producer's layout scatters the consumer's tile over ``G`` (each of
the ``g`` devices holds a distinct ``1/g`` block of it, :func:`shardplan.cost.edge.scatters` with ``h = g``),
DTensor does not all-reduce: the backward of the operand's redistribution is ``Partial -> Shard`` on those
mesh axes, a reduce-scatter straight into the producer's blocks, ``(g - 1)/g · n`` bytes sent per device
where the all-reduce sends twice that (measured: tests/torch_engine/test_dtensor_reductions.py, ``act2s``).

With ``Machine.scatter_gathered_grads`` (set by :func:`shardplan.torch.device.dtensor_machine`, off in every
shipped profile, so the JAX path's charges are unchanged) the tables charge that per producer layout, as
:mod:`shardplan.cost.ring` does for the all-gathered attention's keys: the all-reduce comes off the operator
(:func:`home_moved`) and goes on the edge of the input (:func:`home_reduction`), which charges the
reduce-scatter where the producer scatters the tile over ``G`` (:func:`home_scatters`) and the same
all-reduce elsewhere. Every other pair of layouts is charged as before.

Where the gradient sums over two split dims or more, the PyTorch run reduces it one dim at a time, each
dim's mesh axes into the producer's placements (:func:`shardplan.torch.run.reduce_steps`), in mesh order
(outer level first, and inside a level the split nested outermost first): so the reduce-scatter is charged
as those steps, ``Σ_i RS(n / Π_{j < i} g_j, G_i)`` (:func:`scatter_steps`), the same bytes as one
reduce-scatter among ``G`` and one latency term per dim's ring instead of one for ``G``'s. Which inputs it
leaves to the ring machinery, and where: :func:`home_pairs`. The math and the measurements are in
docs/cost-model.md, "Activation gradients home by reduce-scatter".
"""

from __future__ import annotations

from typing import AbstractSet, Sequence

import numpy as np

from shardplan.cost.collectives import allreduce_time, reduce_scatter_time
from shardplan.ir import Graph, Operator
from shardplan.layout import LayoutArrays
from shardplan.machine import Machine

__all__ = ["unfed_slots", "home_pairs", "home_moved", "home_scatters", "scatter_steps", "home_reduction"]


def unfed_slots(graph: Graph) -> list[frozenset[int]]:
    """Per operator, the slots of its activation inputs that no edge of ``graph`` feeds (a graph input: a
    pipeline stage's tensor from an earlier stage): their gradients have no producer layout here, so the
    operator keeps their reduction (:func:`home_pairs`)."""
    fed: list[set[int]] = [set() for _ in graph.operators]
    for e in graph.edges:
        fed[e.dst].add(e.slot)
    return [frozenset(j for j in range(len(op.inputs)) if j not in fed[i]) for i, op in enumerate(graph.operators)]


def home_pairs(v: Operator, lv: LayoutArrays, machine: Machine, unfed: AbstractSet[int] = frozenset(),
               handled: np.ndarray | None = None) -> np.ndarray:
    """(K, inputs) bool: the (layout, input slot) pairs whose gradient reduction the tables charge on the
    input's edge (:func:`home_reduction`) instead of on ``v``: with ``machine.scatter_gathered_grads``, an
    activation input that needs a gradient, summed over dims split ``g > 1`` ways, at a layout that does not
    defer it (:attr:`~shardplan.layout.Layout.partial` leaves it to the edge already), fed by an edge (not in
    ``unfed``), and not among ``handled`` (K, inputs): the ring inputs :mod:`shardplan.cost.ring` already
    charges on their edges. An input whose gradient is summed into a shared parameter's first
    (``Tensor.owner`` with ``machine.sum_shared_grads``) is left as :func:`~shardplan.cost.operator.operator_cost`
    leaves it."""
    out = np.zeros((len(lv), len(v.inputs)), dtype=bool)
    if not machine.scatter_gathered_grads:
        return out
    for j, t in enumerate(v.inputs):
        if not t.needs_grad or t.role == "weight" or j in unfed or (t.owner is not None and machine.sum_shared_grads):
            continue
        dims = v.grad_reduction_dims(t)
        if not dims:
            continue
        g = lv.group_sizes([v.dim_names.index(d) for d in dims]).prod(axis=0)
        out[:, j] = (g > 1) & ~lv.deferred
    if handled is not None:
        out &= ~np.asarray(handled, dtype=bool)
    return out


def _grad_bytes(v: Operator, slot: int, sub: LayoutArrays, machine: Machine) -> np.ndarray:
    """(K,) bytes of the busiest device's gradient tile of input ``slot``, as operator_cost sizes it."""
    from shardplan.cost.operator import tile_volume

    return tile_volume(v, v.inputs[slot], sub.splits, machine.num_devices, core=False) * float(machine.dtype_bytes)


def _allreduces(v: Operator, slot: int, sub: LayoutArrays, machine: Machine) -> np.ndarray:
    """(K,) seconds of the all-reduces :func:`~shardplan.cost.operator.operator_cost` charges for input
    ``slot``'s gradient at ``sub`` (one per split dim with ``machine.reduce_per_dim``)."""
    from shardplan.cost.operator import _reduce_groups

    nbytes = _grad_bytes(v, slot, sub, machine)
    out = np.zeros(len(sub))
    for _, gl in _reduce_groups(v, sub, v.grad_reduction_dims(v.inputs[slot]), machine.reduce_per_dim):
        out = out + allreduce_time(nbytes, gl, machine)
    return out


def home_moved(v: Operator, lv: LayoutArrays, machine: Machine, pairs: np.ndarray) -> np.ndarray:
    """(K,) seconds of ``v``'s activation-gradient all-reduces at the ``pairs`` of :func:`home_pairs`: what
    the tables take off the operator and charge on the inputs' edges (:func:`home_reduction`)."""
    out = np.zeros(len(lv))
    for j in range(len(v.inputs)):
        rows = np.nonzero(pairs[:, j])[0]
        if len(rows):
            out[rows] += _allreduces(v, j, lv.take(rows), machine)
    return out


def home_scatters(u: Operator, lu: LayoutArrays, v: Operator, slot: int, lv: LayoutArrays,
                  machine: Machine) -> np.ndarray:
    """(K_u, K_v) bool: where u's output tiles scatter v's tile of input ``slot`` over the group that sums its
    gradient, a distinct ``1/g`` block on each of its ``g > 1`` devices (:func:`shardplan.cost.edge.scatters`
    with ``h = g``, as the ring's :func:`~shardplan.cost.edge.scatter_fit`): the reduce-scatter then leaves
    every device its block of u's tile and nothing more moves backward."""
    from shardplan.cost.edge import scatter_fit

    out = np.zeros((len(lu), len(lv)), dtype=bool)
    dims = v.grad_reduction_dims(v.inputs[slot])
    if not dims:
        return out
    g = lv.group_sizes([v.dim_names.index(d) for d in dims]).prod(axis=0)
    cols = np.nonzero(g > 1)[0]
    if len(cols):
        out[:, cols] = scatter_fit(u, lu, v, slot, lv.take(cols), g[cols], machine).T
    return out


def _mesh_order(lay: LayoutArrays, idx: Sequence[int]) -> np.ndarray:
    """(K, D) the dims ``idx`` (positions into it) in mesh order per layout: the outermost level that splits
    each first, and inside it the dim nested outermost (largest stride); dims not split last."""
    splits = lay.level_splits[:, :, list(idx)]  # (L, K, D)
    strides = lay.level_strides[:, :, list(idx)]
    n_lv = splits.shape[0]
    used = splits > 1
    outer = np.where(used.any(axis=0), n_lv - 1 - np.argmax(used[::-1], axis=0), -1)  # (K, D)
    stride = np.take_along_axis(strides, np.maximum(outer, 0)[None], axis=0)[0]
    key = (outer + 1) * (int(strides.max(initial=1)) + 1) + np.where(outer >= 0, stride, 0)
    return np.argsort(-key, axis=1, kind="stable")


def scatter_steps(v: Operator, slot: int, sub: LayoutArrays, nbytes: np.ndarray, machine: Machine) -> np.ndarray:
    """(K,) seconds of the reduce-scatter of input ``slot``'s gradient (``nbytes`` per device) home, as the
    PyTorch run sends it: one among the whole group where one split dim sums it (or without
    ``machine.reduce_per_dim``), else one per split dim in mesh order (:func:`_mesh_order`), each of what the
    ones before left: ``Σ_i RS(n / Π_{j < i} g_j, G_i)``."""
    idx = [v.dim_names.index(d) for d in v.grad_reduction_dims(v.inputs[slot])]
    n = np.asarray(nbytes, dtype=np.float64)
    if not machine.reduce_per_dim or int((sub.splits[:, idx] > 1).sum(axis=1).max(initial=0)) < 2:
        return reduce_scatter_time(n, sub.group_sizes(idx), machine)
    order = _mesh_order(sub, idx)
    splits = sub.level_splits[:, :, idx]  # (L, K, D)
    out = np.zeros(len(sub))
    for i in range(len(idx)):
        gl = np.take_along_axis(splits, order[None, :, i:i + 1], axis=2)[..., 0]  # (L, K)
        out = out + reduce_scatter_time(n, gl, machine)
        n = n / gl.prod(axis=0)
    return out


def home_reduction(u: Operator, lu: LayoutArrays, v: Operator, slot: int, lv: LayoutArrays, machine: Machine,
                   pairs: np.ndarray) -> np.ndarray:
    """(K_u, K_v) seconds of the gradient of v's input ``slot`` on its way home to u at the ``pairs`` of
    :func:`home_pairs` (0 elsewhere: the operator or the ring machinery charges it): the reduce-scatter
    (:func:`scatter_steps`) where :func:`home_scatters`, the all-reduce :func:`home_moved` took off the
    operator elsewhere."""
    out = np.zeros((len(lu), len(lv)))
    cols = np.nonzero(pairs[:, slot])[0] if slot < pairs.shape[1] else np.zeros(0, dtype=np.int64)
    if not len(cols):
        return out
    sub = lv.take(cols)
    ar = _allreduces(v, slot, sub, machine)
    rs = scatter_steps(v, slot, sub, _grad_bytes(v, slot, sub, machine), machine)
    fit = home_scatters(u, lu, v, slot, sub, machine)
    out[:, cols] = np.where(fit, rs[None, :], ar[None, :])
    return out
