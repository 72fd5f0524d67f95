"""t_l(v, c): the cost of one operator under each of its configurations.

Everything is derived from the operator's description (iteration domain +
access maps); nothing here branches on the operator's kind. Per device, for
configuration c (arrays over the K configurations):

* compute: ``f * prod_d E_d / c_d`` FLOPs forward (f = work per point), and
  the same again for every tensor whose gradient the backward pass
  produces (input gradient and weight gradient of a GEMM: 2x), over peak
  FLOP/s;
* forward partial sums: with G = reduction dims (index no output axis) and
  g = prod_{d in G} c_d > 1, the output tile is all-reduced among g devices;
* backward: the gradient of a tensor X sums over the dims that do not index
  X; if they are split (g_X > 1), X's gradient tile is all-reduced among g_X
  devices (data-parallel weight synchronisation is the case X = weight,
  split batch);
* halo: a windowed access on a split dim reads the elements of the tile it
  needs that are outside the tile it owns (``|need| - |need ∩ core|``) from
  neighbours, forward, and returns their gradient backward;
* statistics: splitting a dim the operator normalises over (softmax,
  batch/layer norm) all-reduces ``norm_stats`` values per point of the
  output tile without those dims, forward and backward;
* recurrence: the one hand-written term, for operators whose domain holds a
  sequential recurrence (:func:`recurrence_cost`).

Groups crossing node boundaries use the inter-node link.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shardplan.cost.collectives import allgather_time, allreduce_time, group_crosses_nodes, p2p_time
from shardplan.cost.tiles import box_volumes, device_grid, tensor_boxes
from shardplan.ir import Operator
from shardplan.machine import Machine

__all__ = ["PARTS", "OpCost", "operator_cost", "recurrence_cost", "tile_volume"]


PARTS: dict[str, str] = {
    "compute": "compute",
    "grad_allreduce": "gradient all-reduce",
    "forward_allreduce": "forward partial-sum all-reduce",
    "halo": "halo exchange",
    "stats": "normalisation statistics",
    "recurrence": "recurrence (pipeline, hidden-state gathers)",
}
"""The parts of an operator's cost: :class:`OpCost` field -> what it is (the report's label).

Every consumer of the breakdown (:meth:`OpCost.parts`,
:meth:`shardplan.cost.CostTables.breakdown`, the report) reads this one list.
"""


@dataclass(frozen=True, eq=False)
class OpCost:
    """Seconds per configuration (arrays of shape (K,)), by kind of work: one field per key of :data:`PARTS`."""

    compute: np.ndarray
    forward_allreduce: np.ndarray
    grad_allreduce: np.ndarray
    halo: np.ndarray
    stats: np.ndarray
    recurrence: np.ndarray
    comm_bytes: np.ndarray  # bytes each device sends inside the operator (fwd + bwd), for checking

    @property
    def communication(self) -> np.ndarray:
        """Seconds of every part but compute."""
        return sum((getattr(self, name) for name in PARTS if name != "compute"), np.zeros_like(self.compute))

    @property
    def total(self) -> np.ndarray:
        return self.compute + self.communication

    def parts(self, k: int) -> dict[str, float]:
        """The breakdown of configuration k: {part: seconds}, the keys of :data:`PARTS` in order."""
        return {name: float(getattr(self, name)[k]) for name in PARTS}


def tile_volume(op: Operator, tensor, configs: np.ndarray, p: int, core: bool = True,
                orders: np.ndarray | None = None, grid: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """Largest per-device tile of ``tensor`` (elements), per configuration: (K,)."""
    vol = box_volumes(tensor_boxes(op, tensor, configs, p, core=core, orders=orders, grid=grid)).max(axis=1)
    return vol * tensor.elem_factor


def _group(op: Operator, configs: np.ndarray, dims) -> tuple[np.ndarray, list[int]]:
    idx = [op.dim_names.index(d) for d in dims]
    g = np.prod(configs[:, idx], axis=1) if idx else np.ones(len(configs), dtype=np.int64)
    return g, idx


def operator_cost(op: Operator, configs: np.ndarray, machine: Machine, orders: np.ndarray | None = None) -> OpCost:
    """t_l for every configuration of ``op`` (see the module docstring for the derivation).

    ``orders`` (optional, (K, n)): the dimension nesting of each configuration's device grid; it
    changes only which groups cross node boundaries.
    """
    configs = np.asarray(configs, dtype=np.int64)
    k = len(configs)
    p = machine.num_devices
    ext = np.asarray([e for _, e in op.dims], dtype=np.float64)
    grid = coords, active = device_grid(configs, p, orders)
    nbytes = float(machine.dtype_bytes)
    zeros = np.zeros(k)

    # compute
    fwd = op.flops_per_point * np.prod(ext[None, :] / configs, axis=1)
    compute = fwd * (1 + len(op.grad_tensors)) / machine.peak_flops

    # forward partial sums
    g, idx = _group(op, configs, op.reduction_dims)
    out_vol = tile_volume(op, op.output, configs, p, grid=grid)
    inter = group_crosses_nodes(configs, coords, active, idx, machine)
    fwd_ar = allreduce_time(out_vol * nbytes, g, machine, inter)
    sent = np.where(g > 1, 2.0 * (g - 1) / g * out_vol * nbytes, 0.0)

    # backward gradient all-reduces
    grad_ar = zeros.copy()
    for t in op.grad_tensors:
        g, idx = _group(op, configs, op.grad_reduction_dims(t))
        vol = tile_volume(op, t, configs, p, core=False, grid=grid)
        inter = group_crosses_nodes(configs, coords, active, idx, machine)
        grad_ar = grad_ar + allreduce_time(vol * nbytes, g, machine, inter)
        sent = sent + np.where(g > 1, 2.0 * (g - 1) / g * vol * nbytes, 0.0)

    # halo exchange of windowed inputs
    halo = zeros.copy()
    spans_nodes = machine.hierarchical & (configs.prod(axis=1) > (machine.node_size or p))
    for t in op.inputs:
        if not any(a.window is not None or a.stride != 1 for a in t.axes):
            continue
        need = tensor_boxes(op, t, configs, p, core=False, grid=grid)
        core = tensor_boxes(op, t, configs, p, core=True, grid=grid)
        # read but not owned: |need| - |need ∩ core| (a strided window's reads can be shifted off the owned rows)
        both = np.stack([np.maximum(need[..., 0], core[..., 0]), np.minimum(need[..., 1], core[..., 1])], axis=-1)
        both[..., 1] = np.maximum(both[..., 1], both[..., 0])
        extra = (box_volumes(need) - box_volumes(both)).max(axis=1) * t.elem_factor * nbytes
        times = 2 if t.needs_grad else 1
        halo = halo + times * p2p_time(extra, machine, spans_nodes)
        sent = sent + times * extra

    # statistics of normalised dims
    stats = zeros.copy()
    if op.norm_dims:
        g, idx = _group(op, configs, op.norm_dims)
        norm_ext = np.prod(ext[idx][None, :] / configs[:, idx], axis=1)
        vol = out_vol / norm_ext * op.norm_stats * nbytes
        inter = group_crosses_nodes(configs, coords, active, idx, machine)
        passes = 2 if op.grad_tensors else 1
        stats = passes * allreduce_time(vol, g, machine, inter)
        sent = sent + passes * np.where(g > 1, 2.0 * (g - 1) / g * vol, 0.0)

    rec = zeros.copy()
    if op.recurrence is not None:
        rec, rec_bytes = recurrence_cost(op, configs, machine, coords, active)
        sent = sent + rec_bytes

    return OpCost(compute, fwd_ar, grad_ar, halo, stats, rec, sent)


def recurrence_cost(op: Operator, configs: np.ndarray, machine: Machine, coords: np.ndarray,
                    active: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The hand-written part of a recurrent operator's cost (the only one).

    The polyhedral description cannot say that time steps depend on each
    other, so three terms are added to the derived ones. With L layers, S
    steps, batch B, hidden E, splits c_l, c_s, c_b, c_e:

    * pipeline and sequential time: the derived compute assumes the work
      divides by prod(c). Layers split c_l ways form a pipeline whose
      wavefront needs S + c_l - 1 steps instead of S; time chunks split c_s
      ways must run one after another, so they add no speed-up. The extra
      compute is ``W/(prod(c)/c_s) * (S + c_l - 1)/S - W/prod(c)``.
    * stage hand-off: every layer-stage boundary sends the hidden states
      ``(B/c_b) * S * (E/c_e)`` forward and their gradient backward:
      ``2 (c_l - 1)/c_l`` of that per device on average, as point-to-point.
    * split hidden state: the recurrent product h_{t-1} W_hh contracts over
      the full hidden vector, so with c_e > 1 every step all-gathers h
      among c_e devices: S * L/c_l steps of ``(B/c_b) * E`` bytes, forward and
      backward.

    Returns (seconds, bytes sent per device), arrays (K,).
    """
    r = op.recurrence
    assert r is not None
    names = op.dim_names
    ext = op.extents
    c = {d: configs[:, names.index(d)].astype(np.float64) for d in (r.layer, r.time, r.state, r.batch)}
    L, S, E, B = (float(ext[d]) for d in (r.layer, r.time, r.state, r.batch))
    nbytes = float(machine.dtype_bytes)
    total = configs.prod(axis=1).astype(np.float64)
    work = op.flops_per_point * op.points * (1 + len(op.grad_tensors))
    extra_compute = (work / (total / c[r.time]) * (S + c[r.layer] - 1) / S - work / total) / machine.peak_flops
    spans_nodes = np.asarray(machine.hierarchical & (total > (machine.node_size or machine.num_devices)))

    handoff = np.where(c[r.layer] > 1, 2.0 * (c[r.layer] - 1) / c[r.layer] * (B / c[r.batch]) * S * (E / c[r.state])
                       * nbytes, 0.0)
    handoff_t = p2p_time(handoff, machine, spans_nodes)

    steps = S * L / c[r.layer]
    ag_bytes = (B / c[r.batch]) * E * nbytes
    e_idx = [names.index(r.state)]
    inter = group_crosses_nodes(configs, coords, active, e_idx, machine)
    gather_t = 2.0 * steps * allgather_time(ag_bytes, c[r.state], machine, inter)
    gather_b = np.where(c[r.state] > 1, 2.0 * steps * (c[r.state] - 1) / c[r.state] * ag_bytes, 0.0)
    return extra_compute + handoff_t + gather_t, handoff + gather_b
