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
reduce-scatter among ``G`` and one latency term per dim's ring instead of one for ``G``'s. Where the producer
scatters over some of those dims only (its tile the same on every device of each other dim's group, and exactly
what the steps leave: :func:`home_steps`), each step is DTensor's ``Partial -> Shard`` or ``Partial -> Replicate``
on that dim's axes: a reduce-scatter over the dims where it splits, an all-reduce over the others, each of what
the steps before left (:func:`step_charges`). Which inputs it leaves to the ring machinery, and where:
:func:`home_pairs`. The bytes follow the seconds: :func:`home_moved_bytes` comes off the operator's
``comm_bytes`` with its seconds, and :func:`home_bytes` is what the edge sends (at a plan's layouts:
:func:`shardplan.cost.plan_home_bytes`). The math and the measurements are in docs/cost-model.md, "Activation
gradients home by reduce-scatter".
"""

from __future__ import annotations

from typing import AbstractSet, Sequence

import numpy as np

from shardplan.cost.collectives import allreduce_time, reduce_scatter_time
from shardplan.ir import Graph, Operator
from shardplan.layout import LayoutArrays
from shardplan.machine import Machine

__all__ = ["unfed_slots", "home_pairs", "home_moved", "home_moved_bytes", "home_scatters", "home_steps",
           "scatter_steps", "step_charges", "home_reduction", "home_bytes"]


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


def _allreduces(v: Operator, slot: int, sub: LayoutArrays, machine: Machine) -> tuple[np.ndarray, np.ndarray]:
    """(K,) seconds and (K,) bytes sent per device of the all-reduces
    :func:`~shardplan.cost.operator.operator_cost` charges for input ``slot``'s gradient at ``sub`` (one per
    split dim with ``machine.reduce_per_dim``; ``2 (g - 1)/g · n`` bytes each, as its ``comm_bytes``)."""
    from shardplan.cost.operator import _ar_sent, _reduce_groups

    nbytes = _grad_bytes(v, slot, sub, machine)
    secs, sent = np.zeros(len(sub)), np.zeros(len(sub))
    for g, gl in _reduce_groups(v, sub, v.grad_reduction_dims(v.inputs[slot]), machine.reduce_per_dim):
        secs = secs + allreduce_time(nbytes, gl, machine)
        sent = sent + _ar_sent(nbytes, g)
    return secs, sent


def _moved(v: Operator, lv: LayoutArrays, machine: Machine, pairs: np.ndarray, part: int) -> np.ndarray:
    """(K,) seconds (``part`` 0) or bytes (1) of the all-reduces of :func:`_allreduces` at ``pairs``."""
    out = np.zeros(len(lv))
    for j in range(len(v.inputs)):
        rows = np.nonzero(pairs[:, j])[0]
        if len(rows):
            out[rows] += _allreduces(v, j, lv.take(rows), machine)[part]
    return out


def home_moved(v: Operator, lv: LayoutArrays, machine: Machine, pairs: np.ndarray) -> np.ndarray:
    """(K,) seconds of ``v``'s activation-gradient all-reduces at the ``pairs`` of :func:`home_pairs`: what
    the tables take off the operator and charge on the inputs' edges (:func:`home_reduction`)."""
    return _moved(v, lv, machine, pairs, 0)


def home_moved_bytes(v: Operator, lv: LayoutArrays, machine: Machine, pairs: np.ndarray) -> np.ndarray:
    """(K,) bytes one device sends in the all-reduces :func:`home_moved` times: what comes off the operator's
    ``comm_bytes`` with those seconds (the edge reports what it sends instead: :func:`home_bytes`)."""
    return _moved(v, lv, machine, pairs, 1)


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


def _group_keys(lay: LayoutArrays, idx: Sequence[int]) -> np.ndarray:
    """(D, K, p): per dim ``idx[i]`` and layout, every device's group of that dim, named by the device with the
    dim's coordinate 0 (its number less the dim's part of it: ``Σ_l base_l · coord_l · stride_l``)."""
    pos = lay.level_positions()  # (L, p)
    base = np.cumprod((1,) + tuple(lay.levels[:-1])).astype(np.int64)  # (L,)
    q = np.arange(lay.p, dtype=np.int64)
    out = np.empty((len(idx), len(lay), lay.p), dtype=np.int64)
    for i, j in enumerate(idx):
        split, stride = lay.level_splits[:, :, j], lay.level_strides[:, :, j]  # (L, K)
        coord = (pos[:, None, :] // stride[:, :, None]) % split[:, :, None]  # (L, K, p)
        out[i] = q[None, :] - (base[:, None, None] * coord * stride[:, :, None]).sum(axis=0)
    return out


def home_steps(u: Operator, lu: LayoutArrays, v: Operator, slot: int, lv: LayoutArrays,
               machine: Machine) -> np.ndarray:
    """(K_u, K_v) int: per pair of layouts, the bits ``Σ 2^i`` of the dims ``i`` of v's
    :meth:`~shardplan.ir.Operator.grad_reduction_dims` (of input ``slot``) along whose group u's tiles split
    v's tile, where that says how the gradient goes home; -1 where it does not.

    Dim ``i``'s group of a device: the ``g_i`` devices that share its coordinates in every other dim of v and
    its replica (:func:`_group_keys`). A pair qualifies when every device is active under both,
    u's tile lies inside v's on every device, and along every dim's group u's tiles are either all the same
    (bit 0: DTensor's ``Replicate`` on those mesh axes) or all different (bit 1: ``Shard``), with
    ``|v's tile| = |u's tile| · Π_{bit i} g_i`` (what the steps leave is u's tile: nothing moves after them).
    A dim split 1 way gets bit 0."""
    from shardplan.cost.edge import _dedupe, _distinct
    from shardplan.cost.tiles import box_volumes, tensor_boxes

    idx = [v.dim_names.index(d) for d in v.grad_reduction_dims(v.inputs[slot])]
    out = np.full((len(lu), len(lv)), -1, dtype=np.int64)
    if not idx or not len(lu) or not len(lv):
        return out
    p = machine.num_devices
    bv = tensor_boxes(v, v.inputs[slot], lv, p, core=True)
    bu = tensor_boxes(u, u.output, lu, p, core=True)
    vol_u, vol_v = box_volumes(bu), box_volumes(bv)
    ok_u = lu.active().all(axis=1) & (vol_u == vol_u[:, :1]).all(axis=1) & (vol_u[:, 0] > 0)
    ok_v = lv.active().all(axis=1) & (vol_v == vol_v[:, :1]).all(axis=1) & (vol_v[:, 0] > 0)
    fu, iu = _dedupe(bu.reshape(len(lu), -1))
    # a box of a regular split is named by its corner; ranked over all of u's distinct rows (< U p)
    radix = np.maximum(bu[fu, ..., 1].max(axis=(0, 1)), 1) + 1  # (A,)
    if float(np.prod(radix.astype(np.float64))) < 2.0 ** 62:
        corner = bu[fu, :, :, 0] @ np.concatenate([np.cumprod(radix[::-1])[::-1][1:], [1]]).astype(np.int64)
    else:  # too wide for one int64 code: each row's boxes ranked on their own
        corner = np.stack([np.unique(bu[a].reshape(p, -1), axis=0, return_inverse=True)[1].reshape(-1) + a * p
                           for a in fu])
    code_u = np.unique(corner, return_inverse=True)[1].reshape(len(fu), p)
    span = int(code_u.max()) + 1
    keys = _group_keys(lv, idx)  # (D, K_v, p)
    fv, iv = _dedupe(np.concatenate([bv.reshape(len(lv), -1), keys.transpose(1, 0, 2).reshape(len(lv), -1)], axis=1))
    gs = lv.level_splits[:, :, idx].prod(axis=0)  # (K_v, D)
    for b_i, b in enumerate(fv):
        if not ok_v[b]:
            continue
        inside = ((bu[fu, ..., 0] >= bv[b, None, ..., 0]) & (bu[fu, ..., 1] <= bv[b, None, ..., 1])).all(axis=(1, 2))
        bits = np.zeros(len(fu), dtype=np.int64)
        good = inside & ok_u[fu]
        ratio = np.ones(len(fu), dtype=np.int64)
        for i in range(len(idx)):
            g = int(gs[b, i])
            if g == 1:
                continue
            pairs = _distinct(keys[i, b][None, :] * span + code_u)  # (U_u,): distinct (group, u tile) pairs
            vary = pairs == p
            good &= vary | (pairs == p // g)
            bits |= np.where(vary, 1 << i, 0)
            ratio *= np.where(vary, g, 1)
        good &= vol_u[fu, 0] * ratio == vol_v[b, 0]
        cols = np.nonzero(iv == b_i)[0]
        out[:, cols] = np.where(good, bits, -1)[iu][:, None]
    return out


def step_charges(v: Operator, slot: int, sub: LayoutArrays, nbytes: np.ndarray, bits: np.ndarray,
                 machine: Machine) -> tuple[np.ndarray, np.ndarray]:
    """(K,) seconds and (K,) bytes sent per device of input ``slot``'s gradient (``nbytes`` per device) going
    home one split dim at a time in mesh order (:func:`_mesh_order`, as the run's ``reduce_steps``), a
    reduce-scatter among dim ``i``'s group where bit ``i`` of ``bits`` (K,) is set (DTensor's ``Partial ->
    Shard``), an all-reduce elsewhere (``Partial -> Replicate``), each of what the steps before left:
    ``n_0 = n``, ``n_{k+1} = n_k / g_k`` after a reduce-scatter, ``n_k`` after an all-reduce;
    ``(g - 1)/g · n_k`` bytes for a reduce-scatter, twice that for an all-reduce."""
    idx = [v.dim_names.index(d) for d in v.grad_reduction_dims(v.inputs[slot])]
    n = np.asarray(nbytes, dtype=np.float64) * np.ones(len(sub))
    order = _mesh_order(sub, idx)
    splits = sub.level_splits[:, :, idx]  # (L, K, D)
    bits = np.asarray(bits, dtype=np.int64)
    secs, sent = np.zeros(len(sub)), np.zeros(len(sub))
    for i in range(len(idx)):
        gl = np.take_along_axis(splits, order[None, :, i:i + 1], axis=2)[..., 0]  # (L, K)
        g = gl.prod(axis=0)
        rs = ((bits >> order[:, i]) & 1).astype(bool)
        secs = secs + np.where(rs, reduce_scatter_time(n, gl, machine), allreduce_time(n, gl, machine))
        share = np.where(g > 1, (g - 1) / g * n, 0.0)
        sent = sent + np.where(rs, share, 2.0 * share)
        n = np.where(rs, n / g, n)
    return secs, sent


def _home_charges(u: Operator, lu: LayoutArrays, v: Operator, slot: int, lv: LayoutArrays, machine: Machine,
                  pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(K_u, K_v) seconds and bytes sent per device of :func:`home_reduction`."""
    secs, sent = np.zeros((len(lu), len(lv))), np.zeros((len(lu), len(lv)))
    cols = np.nonzero(pairs[:, slot])[0] if slot < pairs.shape[1] else np.zeros(0, dtype=np.int64)
    if not len(cols):
        return secs, sent
    sub = lv.take(cols)
    ar, ar_sent = _allreduces(v, slot, sub, machine)
    nbytes = _grad_bytes(v, slot, sub, machine)
    rs = scatter_steps(v, slot, sub, nbytes, machine)
    g = sub.group_sizes([v.dim_names.index(d) for d in v.grad_reduction_dims(v.inputs[slot])]).prod(axis=0)
    rs_sent = (g - 1) / g * nbytes  # the steps' bytes add up to one reduce-scatter's among the whole group
    fit = home_scatters(u, lu, v, slot, sub, machine)
    s = np.where(fit, rs[None, :], ar[None, :])
    b = np.where(fit, rs_sent[None, :], ar_sent[None, :])
    # the run's steps, one split dim each, where the producer splits along some only; with one split dim and no
    # replicas of v that is the reduce-scatter :func:`home_scatters` found (or the all-reduce), so not looked for
    idx = [v.dim_names.index(d) for d in v.grad_reduction_dims(v.inputs[slot])]
    look = ((sub.splits[:, idx] > 1).sum(axis=1) > 1) | (sub.splits.prod(axis=1) < machine.num_devices)
    look = np.nonzero(look & ~fit.all(axis=0))[0] if machine.reduce_per_dim else np.zeros(0, dtype=np.int64)
    if len(look):
        steps = np.where(fit[:, look], -1, home_steps(u, lu, v, slot, sub.take(look), machine))
        for bits in np.unique(steps[steps > 0]):
            st, sb = step_charges(v, slot, sub, nbytes, np.full(len(sub), bits), machine)
            s[:, look] = np.where(steps == bits, st[look][None, :], s[:, look])
            b[:, look] = np.where(steps == bits, sb[look][None, :], b[:, look])
    secs[:, cols], sent[:, cols] = s, b
    return secs, sent


def home_reduction(u: Operator, lu: LayoutArrays, v: Operator, slot: int, lv: LayoutArrays, machine: Machine,
                   pairs: np.ndarray) -> np.ndarray:
    """(K_u, K_v) seconds of the gradient of v's input ``slot`` on its way home to u at the ``pairs`` of
    :func:`home_pairs` (0 elsewhere: the operator or the ring machinery charges it): the reduce-scatter
    (:func:`scatter_steps`) where :func:`home_scatters`; where u splits the tile along some summed dims' groups
    only (:func:`home_steps`, with ``machine.reduce_per_dim``), the run's steps (:func:`step_charges`); the
    all-reduce :func:`home_moved` took off the operator elsewhere (an upper bound where the producer splits it
    in some other way)."""
    return _home_charges(u, lu, v, slot, lv, machine, pairs)[0]


def home_bytes(u: Operator, lu: LayoutArrays, v: Operator, slot: int, lv: LayoutArrays, machine: Machine,
               pairs: np.ndarray) -> np.ndarray:
    """(K_u, K_v) bytes one device sends in what :func:`home_reduction` times (the same cases)."""
    return _home_charges(u, lu, v, slot, lv, machine, pairs)[1]
