"""t_l(v, c): the cost of one operator under each of its configurations.

Everything is derived from the operator's description (iteration domain +
access maps); nothing here branches on the operator's kind. Per device, for
configuration c (arrays over the K configurations):

* compute: ``f * prod_d E_d / c_d`` FLOPs forward (f = work per point; under a causal mask,
  :attr:`~shardplan.ir.Operator.causal`, times the busiest device's share of its tile that the mask
  keeps, :func:`shardplan.cost.causal.causal_fractions`), and
  the same again for every tensor whose gradient the backward pass
  produces (input gradient and weight gradient of a GEMM: 2x). Each pass
  is a roofline: ``max(FLOPs / (peak * efficiency), bytes / HBM bandwidth)``
  where bytes = the tiles the pass reads and writes (inputs with halos,
  weights, output) on one device; without an HBM bandwidth (the paper's
  model) it is FLOPs / peak. Elementwise, normalisation and softmax
  operators are thereby bound by memory bandwidth on a GPU. On a machine
  with streaming multiprocessors (``machine.sm_count`` and the output tiles
  ``machine.gemm_tiles``), a pass that is a matrix product runs at
  ``efficiency * u`` instead, u its tile and wave utilisation
  (:func:`gemm_utilisation`, per pass and layout: the forward product and
  each gradient's product have their own output shape), times
  ``machine.gemm_unaligned_efficiency`` where a dimension of the product is
  not a multiple of ``machine.gemm_align`` (:func:`pass_utilisation`). An operator with a fused backward
  (:attr:`~shardplan.ir.Operator.backward_flops`: FlashAttention) is one kernel each way instead,
  :func:`shardplan.cost.fused.fused_compute`; a memory-bound operator a compiler fused with its neighbours
  (:attr:`~shardplan.ir.Operator.kernel_io`) moves only what its kernel loads and stores,
  :func:`shardplan.cost.chain.chain_compute`;
* forward partial sums: with G = reduction dims (index no output axis) and
  g = prod_{d in G} c_d > 1, the output tile is all-reduced among g devices;
  with ``machine.reduce_per_dim`` (XLA's lowering, measured: docs/jax.md,
  "Partial sums over several split dims") as one all-reduce of the whole tile
  per split d in G, among c_d devices: ``Σ_{d in G} 2 (c_d - 1)/c_d · n`` bytes
  instead of ``2 (g - 1)/g · n``. The same holds for every sum below (gradients,
  statistics);
* backward: the gradient of a tensor X sums over the dims that do not index
  X; if they are split (g_X > 1), X's gradient tile is all-reduced among g_X
  devices (data-parallel weight synchronisation is the case X = weight,
  split batch);
* deferred reductions: under a partial layout (:attr:`shardplan.layout.Layout.partial`)
  the operator charges neither the forward all-reduce (when its output is
  linear in the sum, :func:`shardplan.configs.forward_deferrable`) nor the
  all-reduce of its activation inputs' gradients: each is left as partial
  sums and reduced on the edge, as the other end's layout needs
  (:func:`shardplan.cost.edge.edge_cost`). Weight gradients are not deferred;
* weight-gradient synchronisation as DDP/FSDP run it (machine options
  ``grad_bucket_bytes``, ``overlap_grad``; the GPU presets turn both on,
  the paper's presets off): gradients are fused into buckets of B bytes,
  and a weight's gradient tile of n < B bytes is charged ``n / B`` of the
  all-reduce of a full bucket (so the latency is paid once per bucket, and
  a bucket's tensors together cost exactly one bucket all-reduce; a tensor
  of n >= B bytes is its own bucket). With overlap, the synchronisation runs
  during the backward pass: the operator is charged
  ``max(0, sync - its own backward compute)`` on top of its compute.
  Approximations, so that the objective stays a sum of vertex and edge
  terms and the search stays exact for it: buckets are taken as full, each
  tensor is charged at its own group's rates, and a gradient's sync
  overlaps its own operator's backward compute (in a real step it overlaps
  the backward of the operators before it, which this per-operator max
  neither credits nor checks). Activation gradients are on the critical
  path and are not overlapped, except with ``overlap_dgrad`` (Megatron-LM's
  asynchronous tensor-parallel all-reduce): an input's gradient all-reduce
  of C seconds runs beside the operator's weight-gradient pass of W seconds
  and is charged ``max(C - W, φ C)`` (φ: ``machine.comm_contention``, :mod:`shardplan.cost.contention`);
  the weight synchronisation then overlaps only the backward seconds left
  (:func:`input_gradient_hidden`);
* shared parameters: a parameter read by several operators (a tied
  embedding and LM head) has one copy and one state, in the layout of the
  reader that owns it. As XLA compiles it, every reader's gradient is
  synchronised in that reader's layout and the results added (one
  all-reduce per reader): each reader is charged its own synchronisation
  here. With ``machine.sum_shared_grads`` (PyTorch accumulating ``.grad``)
  the readers' gradients are summed first and synchronised once: a reader
  with an owner (``Tensor.owner``) is charged none here. Moving the
  parameter between the readers' layouts (and what the sum-first rule
  charges when they differ) depends on both layouts: the weight edge from
  the owner (:func:`shardplan.cost.edge.weight_edge_cost`);
* halo: a windowed access on a split dim reads the elements of the tile it
  needs that are outside the tile it owns (``|need| - |need ∩ core|``) from
  neighbours, forward, and returns their gradient backward;
* statistics: splitting a dim the operator normalises over (softmax,
  batch/layer norm) all-reduces ``norm_stats`` values per point of the
  output tile without those dims, forward and backward;
* recurrence: the one hand-written term, for operators whose domain holds a
  sequential recurrence (:func:`recurrence_cost`);
* optimizer step: once per step each device updates the tile it holds of every
  trainable weight the operator owns (``Tensor.owner`` None), an elementwise
  pass bound by memory bandwidth: ``elements * step_bytes / HBM bandwidth``
  (:func:`optimizer_step_seconds`; ``step_bytes`` per element from the
  precision rules, :func:`optimizer_step_bytes`; nothing
  without an HBM bandwidth, the paper's model). ZeRO's sharded updates are the
  memory choices' (:func:`shardplan.cost.memory.choice_table`).

Every collective runs among the devices of a group that the layout spreads
over the machine's levels (``g_l`` per level), with the hierarchical NCCL
formulas of :mod:`shardplan.cost.collectives`; neighbour exchanges (halo,
stage hand-off) use the links of the outermost level that splits a dim the
exchange runs along (the windowed dims, the layer dim): the neighbours
differ only in those coordinates, so with them split inside the node only,
every neighbour is inside the node.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from shardplan.configs import forward_deferrable
from shardplan.cost.collectives import allgather_time, allreduce_time, outer_level, p2p_time
from shardplan.cost.causal import causal_fractions
from shardplan.cost.chain import chain_compute
from shardplan.cost.contention import exposed_beside, hidden_beside
from shardplan.cost.fused import fused_compute
from shardplan.cost.tiles import as_layouts, box_volumes, lazy_grid, regular_tile_lengths, tensor_boxes
from shardplan.layout import LayoutArrays, flat_layout_arrays, unique_rows
from shardplan.ir import Operator
from shardplan.machine import Machine

__all__ = ["PARTS", "OpCost", "operator_cost", "recurrence_cost", "tile_volume", "distinct_splits", "gemm_utilisation",
           "gemm_passes", "pass_utilisation", "chunk_seconds", "optimizer_elements", "optimizer_step_seconds",
           "optimizer_step_bytes", "optimizer_step_rate", "grad_accumulation_seconds", "converts"]


PARTS: dict[str, str] = {
    "compute": "compute",
    "grad_allreduce": "gradient all-reduce",
    "forward_allreduce": "forward partial-sum all-reduce",
    "halo": "halo exchange",
    "stats": "normalisation statistics",
    "recurrence": "recurrence (pipeline, hidden-state gathers)",
    "optimizer": "optimizer step",
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
    optimizer: np.ndarray
    comm_bytes: np.ndarray  # bytes each device sends inside the operator (fwd + bwd), for checking
    pass_seconds: np.ndarray | None = None  # (passes, K): each pass's compute where costed pass by pass, else None

    @cached_property
    def communication(self) -> np.ndarray:
        """Seconds of every part but compute and the optimizer step."""
        return sum((getattr(self, name) for name in PARTS if name not in ("compute", "optimizer")),
                   np.zeros_like(self.compute))

    @cached_property
    def total(self) -> np.ndarray:
        """Seconds per configuration, all parts (computed once: identical operators share this array)."""
        return self.compute + self.communication + self.optimizer

    def parts(self, k: int) -> dict[str, float]:
        """The breakdown of configuration k: {part: seconds}, the keys of :data:`PARTS` in order."""
        return {name: float(getattr(self, name)[k]) for name in PARTS}


def tile_volume(op: Operator, tensor, configs, p: int, core: bool = True,
                orders: np.ndarray | None = None) -> np.ndarray:
    """Largest per-device tile of ``tensor`` (elements), per configuration: (K,).

    Irregular tiles (windows, offsets) are measured once per distinct total
    split of the dims they read (:func:`distinct_splits`).
    """
    lay = as_layouts(configs, p, orders)
    lengths = regular_tile_lengths(op, tensor, lay.splits)
    if lengths is not None:  # every active device holds the same tile
        return lengths.prod(axis=1) * tensor.elem_factor
    rows, inv = distinct_splits(op, tensor, lay.splits)
    canon = flat_layout_arrays(rows, p)
    vol = box_volumes(tensor_boxes(op, tensor, canon, p, core=core)).max(axis=1)
    return vol[inv] * tensor.elem_factor


def distinct_splits(op: Operator, tensor, configs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct total splits of the dims ``tensor``'s boxes read, and which one each layout has.

    A quantity taken as the maximum over devices of a function of a
    device's tile (its volume, its halo) depends on a layout only through
    the total split c_d of the dims the tile's box reads (the dim of each
    axis and its window dim; see :mod:`shardplan.cost.tiles`): the active
    devices of any layout (on any number of levels, in any nesting) hold
    every coordinate tuple ``x ∈ Π_d [0, c_d)``, each at least once, and
    idle devices hold nothing. So it can be computed once per distinct row
    of those splits (the other dims set to 1) on the one-level row-major
    layout of that row: returns ``(rows (U, n), inverse (K,))``.
    """
    read = set()
    for am in tensor.axes:
        if am.dim is not None:
            read.add(am.dim)
        if am.window is not None:
            read.add(am.window)
    keep = np.asarray([d in read for d in op.dim_names], dtype=bool)
    reduced = np.where(keep[None, :], np.asarray(configs, dtype=np.int64), 1)
    if not keep.any():
        return reduced[:1], np.zeros(len(reduced), dtype=np.int64)
    rows, _, inv = unique_rows(reduced)
    return rows, inv


class _CanonicalBoxes:
    """One operator's per-device boxes on the canonical layouts of :func:`distinct_splits`, each built once.

    ``boxes(t, core)``: the boxes (U, p, A, 2) of tensor t on the distinct
    split rows, and each layout's row (K,); ``max_tile(t, core)``: the
    largest tile of t per layout (K,), elements (what :func:`tile_volume` gives).
    """

    def __init__(self, op: Operator, configs: np.ndarray, p: int) -> None:
        self.op, self.configs, self.p = op, configs, p
        self._rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._boxes: dict[tuple[int, bool], np.ndarray] = {}
        self._grids: dict[int, tuple] = {}

    def boxes(self, t, core: bool) -> tuple[np.ndarray, np.ndarray]:
        if id(t) not in self._rows:
            self._rows[id(t)] = distinct_splits(self.op, t, self.configs)
        rows, inv = self._rows[id(t)]
        if (id(t), core) not in self._boxes:
            if id(t) not in self._grids:  # the canonical layouts, shared by the owned and the read tiles
                lay = flat_layout_arrays(rows, self.p)
                self._grids[id(t)] = (lay, lazy_grid(lay))
            lay, lazy = self._grids[id(t)]
            self._boxes[(id(t), core)] = tensor_boxes(self.op, t, lay, self.p, core=core, lazy=lazy)
        return self._boxes[(id(t), core)], inv

    def max_tile(self, t, core: bool = True) -> np.ndarray:
        lengths = regular_tile_lengths(self.op, t, self.configs)
        if lengths is not None:  # every active device holds the same tile
            return lengths.prod(axis=1) * t.elem_factor
        b, inv = self.boxes(t, core)
        return box_volumes(b).max(axis=1)[inv] * t.elem_factor


def gemm_utilisation(batch: np.ndarray | float, rows: np.ndarray | float, cols: np.ndarray | float,
                     machine: Machine) -> np.ndarray:
    """Tile and wave utilisation u of matrix products on ``machine`` (arrays broadcast together).

    A product of ``batch`` independent (rows x cols) outputs is computed in
    output tiles of ``tm x tn``, one per streaming multiprocessor at a time,
    ``S = machine.sm_count`` at once (NVIDIA, Matrix Multiplication
    Background User's Guide, "Dimension Quantization Effects")::

        tiles = batch * ceil(rows / tm) * ceil(cols / tn)      (tile quantisation)
        waves = ceil(tiles / S)                                (wave quantisation)
        u     = batch * rows * cols / (waves * S * tm * tn)

    i.e. the share of the multiprocessors' tile slots in the waves run that
    hold useful output. The library takes the tile of ``machine.gemm_tiles``
    (each reaching the full-wave rate) with the highest u. u is 1 on a
    machine without multiprocessors (``machine.sm_count`` None). Examples
    (108 SMs, tiles 256 x 128, 128 x 256, 128 x 128): 1792 x 1792 is 7 x 14 =
    98 tiles of 256 x 128, one wave, u = 98/108; 2048 x 2048 is 128 of them
    (two waves) or 256 of 128 x 128 (three waves), u = 256/324.
    """
    batch, rows, cols = (np.asarray(x, dtype=np.float64) for x in (batch, rows, cols))
    if not machine.tiled:
        return np.ones(np.broadcast(batch, rows, cols).shape)
    s = float(machine.sm_count)  # type: ignore[arg-type]
    useful = batch * rows * cols
    best = np.zeros(np.broadcast(batch, rows, cols).shape)
    for tm, tn in machine.gemm_tiles:  # type: ignore[union-attr]
        tiles = batch * np.ceil(rows / tm) * np.ceil(cols / tn)
        best = np.maximum(best, useful / (np.ceil(tiles / s) * s * tm * tn))
    return best


def gemm_passes(op: Operator) -> list[tuple[list[int], list[int], list[int]] | None]:
    """Per pass of ``op`` (forward, then one per tensor of ``op.grad_tensors``): the dims (indices into
    ``op.dims``) of its product's batch, rows and columns, or None where the pass is no matrix product.

    A pass writes tensor Y (the output forward, a gradient backward) from two operands A, B (forward: the
    inputs and weights; the gradient of X: the output's gradient and the operand other than X). Its batch
    dims index Y, A and B; its rows index Y and A only, its columns Y and B only (a dim indexing Y alone
    counts as batch). It is a matrix product when the operator has exactly two operands, dims it sums
    over, no windowed or strided access (convolutions keep the plain roofline) and no recurrence, and
    both the rows and the columns are non-empty (a matrix-vector product is bound by memory).
    """
    epilogue = {t.name for t in op.epilogue_tensors}
    operands = tuple(t for t in op.inputs + op.weights if t.name not in epilogue)
    plain = all(a.window is None and a.stride == 1 for t in op.tensors for a in t.axes)
    passes = 1 + len(op.grad_tensors)
    if len(operands) != 2 or not op.reduction_dims or not plain or op.recurrence is not None:
        return [None] * passes
    names = op.dim_names
    out: list[tuple[list[int], list[int], list[int]] | None] = []
    for y, a, b in [(op.output, *operands)] + [(t, op.output, next(o for o in operands if o is not t))
                                                 for t in op.grad_tensors]:
        if y.name in epilogue and y is not op.output:  # a bias's gradient: a reduction, no product
            out.append(None)
            continue
        batch = [i for i, d in enumerate(names) if d in y.dims and (d in a.dims) == (d in b.dims)]
        rows = [i for i, d in enumerate(names) if d in y.dims and d in a.dims and d not in b.dims]
        cols = [i for i, d in enumerate(names) if d in y.dims and d in b.dims and d not in a.dims]
        out.append((batch, rows, cols) if rows and cols else None)
    return out


def pass_utilisation(op: Operator, configs: np.ndarray, machine: Machine,
                     chunk: tuple[Sequence[int], np.ndarray] | None = None) -> np.ndarray:
    """u of every pass of ``op`` under every configuration: (passes, K), 1 where a pass is no matrix product
    (:func:`gemm_passes`) or the machine has neither multiprocessors nor an alignment rule. A device's product
    has the extents of its tile, ``ceil(E_d / c_d)`` per dim (:func:`gemm_utilisation`).

    ``chunk = (dims, g)``: the product cut into ``g`` (K,) calls along ``dims`` (indices into ``op.dims``), as an
    overlapped collective cuts it (:func:`shardplan.cost.edge.chunk_seconds`): in each pass the group of
    ``(batch, rows, cols)`` holding those dims has ``ceil(extent / g)`` instead; a pass that sums over them (the
    weight gradient of a product chunked along its tokens) is one call, unchanged.

    On a machine with ``gemm_align`` = a, a pass whose rows, columns or contraction (each the product of its
    dims' local extents) is not a multiple of a runs at ``gemm_unaligned_efficiency`` of its rate: u is
    multiplied by it (an unpadded vocabulary of 50,257 makes all three products of a language-model head
    unaligned).
    """
    configs = np.asarray(configs, dtype=np.int64)
    specs = gemm_passes(op)
    out = np.ones((len(specs), len(configs)))
    aligned = machine.gemm_align is not None
    if not machine.tiled and not aligned:
        return out
    ext = np.asarray([e for _, e in op.dims], dtype=np.int64)
    local = -(-ext[None, :] // configs)  # ceil(E_d / c_d)
    for i, spec in enumerate(specs):
        if spec is None:
            continue
        batch, rows, cols = (local[:, idx].prod(axis=1) for idx in spec)
        if chunk is not None:
            cut = next((j for j, idx in enumerate((spec[1], spec[2], spec[0])) if set(chunk[0]) & set(idx)), None)
            if cut is not None:
                g = np.asarray(chunk[1], dtype=np.int64)
                rows, cols, batch = [-(-x // g) if j == cut else x for j, x in enumerate((rows, cols, batch))]
        if machine.tiled:
            out[i] = gemm_utilisation(batch, rows, cols, machine)
        if aligned:
            used = set().union(*spec)
            contraction = local[:, [d for d in range(len(ext)) if d not in used]].prod(axis=1)
            a = int(machine.gemm_align)  # type: ignore[arg-type]
            off = (rows % a != 0) | (cols % a != 0) | (contraction % a != 0)
            out[i] = np.where(off, out[i] * float(machine.gemm_unaligned_efficiency), out[i])  # type: ignore[arg-type]
    return out


def chunk_seconds(op: Operator, configs: np.ndarray, machine: Machine, dims: Sequence[int],
                  g: np.ndarray) -> np.ndarray:
    """Seconds (passes, K) each pass of ``op`` takes more when cut into ``g`` (K,) calls along ``dims``
    (:func:`pass_utilisation`'s ``chunk``): with f the pass's FLOPs on a device and R the achievable rate,

        extra = f / (R u_chunk) - f / (R u)          (at least 0)

    u and u_chunk the tile and wave utilisation of the whole product and of one chunk (each chunk is its own
    call with its own waves). 0 on a machine whose products' rate does not depend on their shape, for a pass
    that is no matrix product, and for one that sums over ``dims`` (one call). The products are taken as bound
    by compute (their memory traffic does not change with the cut). Floored at 0: the tile model can find a
    chunk's shape quantised better than the whole's, and a runtime would then run the whole at the chunk's
    tile (its g calls are never faster than the product they split)."""
    configs = np.asarray(configs, dtype=np.int64)
    passes = 1 + len(op.grad_tensors)
    if not machine.shaped_gemms or not len(dims):
        return np.zeros((passes, len(configs)))
    ext = np.asarray([e for _, e in op.dims], dtype=np.float64)
    flops = op.flops_per_point * np.prod(ext[None, :] / configs, axis=1)
    if op.causal is not None:
        flops = flops * causal_fractions(op, configs)[0]
    u = pass_utilisation(op, configs, machine)
    uc = pass_utilisation(op, configs, machine, chunk=(dims, g))
    return np.maximum(flops[None, :] / machine.achievable_flops * (1.0 / uc - 1.0 / u), 0.0)


def _group(op: Operator, lay: LayoutArrays, dims) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Total group size (K,), group size per level (L, K) and the dims' indices."""
    idx = [op.dim_names.index(d) for d in dims]
    per_level = lay.group_sizes(idx)
    return per_level.prod(axis=0), per_level, idx


def _reduce_groups(op: Operator, lay: LayoutArrays, dims, per_dim: bool) -> list[tuple[np.ndarray, np.ndarray]]:
    """The all-reduces that reduce partial sums over ``dims``: (total size (K,), size per level (L, K)) each.

    ``per_dim`` (``Machine.reduce_per_dim``): one per dim of ``dims``, among that dim's group, each of the
    whole tile (XLA's lowering: docs/jax.md, "Partial sums over several split dims"); a dim left unsplit
    gives a group of 1, which sends nothing. Else one among the product of the groups (the PaSE model).
    """
    if not per_dim or len(dims) < 2:
        g, gl, _ = _group(op, lay, dims)
        return [(g, gl)]
    return [(g, gl) for g, gl, _ in (_group(op, lay, [d]) for d in dims)]


def _ar_sent(nbytes: np.ndarray, g: np.ndarray) -> np.ndarray:
    """Bytes one device sends in a ring all-reduce: 2 (g-1)/g n."""
    return np.where(g > 1, 2.0 * (g - 1) / g * nbytes, 0.0)


def optimizer_step_bytes(optimizer_factor: float, dtype_bytes: int, master_weights: bool = False) -> float:
    """HBM bytes per parameter element that one optimizer step reads and writes on the device.

    The step is one fused elementwise pass (apex's and DeepSpeed's ``FusedAdam``, PyTorch's ``fused=True``
    Adam): each operand read once, each result written once; ``o = optimizer_factor`` words of state per
    element (2 for Adam's two moments, 1 for momentum SGD, 0 for plain SGD), ``s = dtype_bytes``:

    * weights that are their own master copy (no ``master_weights``, or ``s >= 4``): read the weight, its
      gradient and the o state words, write the weight and the state, all in ``s`` bytes:
      ``(3 + 2 o) s`` (Adam in fp32: 28; in bf16 without a master copy: 14);
    * ``master_weights`` (mixed precision as Megatron-LM and DeepSpeed keep it, :class:`~shardplan.cost.memory.ChoiceRules`):
      read the fp32 master weight (4), the ``s``-byte gradient and the fp32 state (4 o); write the master
      weight (4), the state (4 o) and the ``s``-byte copy the next step computes with:
      ``8 + 8 o + 2 s`` (Adam at s = 2: 28).

    Not counted: passes a framework adds around the update (the loss-scale unscale and overflow check, the
    gradient norm for clipping, zeroing the gradient buffer, an fp32 gradient buffer instead of an
    ``s``-byte one): Megatron-LM's fp16 step of 2021 moves about 50 bytes per element in all
    (docs/cost-model.md, "Optimizer step").
    """
    o, s = float(optimizer_factor), float(dtype_bytes)
    if master_weights and s < 4:
        return 8.0 + 8.0 * o + 2.0 * s
    return (3.0 + 2.0 * o) * s


def optimizer_elements(op: Operator, configs, p: int, orders: np.ndarray | None = None) -> np.ndarray:
    """Parameter elements the busiest device updates in ``op``'s optimizer step, per layout: (K,).

    The largest tile of every trainable weight ``op`` owns (``needs_grad``, ``Tensor.owner`` None: a
    parameter shared by several readers is updated once, by its owner), in elements (``elem_factor``
    included). Without state sharding every device holding a tile updates all of it.
    """
    lay = as_layouts(configs, p, orders)
    out = np.zeros(len(lay))
    for t in op.weights:
        if t.needs_grad and t.owner is None:
            out = out + tile_volume(op, t, lay, p)
    return out


def optimizer_step_rate(machine: Machine) -> float | None:
    """Bytes/s the fused optimizer update streams: on elements narrower than 4 bytes it loads them, updates in
    fp32 and stores them narrow again (PyTorch's fused Adam computes in the parameter's "opmath" type, fp32;
    apex's and Megatron-LM's keep fp32 master weights beside a 16-bit copy), a converting kernel:
    :attr:`~shardplan.machine.Machine.convert_rate`; on 4-byte elements ``hbm_bandwidth``."""
    return machine.convert_rate if machine.dtype_bytes < 4 else machine.hbm_bandwidth


def optimizer_step_seconds(elements: np.ndarray, machine: Machine, step_bytes: float) -> np.ndarray:
    """Seconds of the optimizer step of ``elements`` parameter elements on one device: an elementwise update
    that reads and writes ``step_bytes`` HBM bytes per element (:func:`optimizer_step_bytes`)
    and does a few FLOPs per byte, so bound by memory bandwidth (first principles; Adam's ~10 FLOP per element
    against 28 bytes is far below an A100's or H100's ridge of ~150 FLOP/byte):
    ``elements * step_bytes / rate``, the rate of :func:`optimizer_step_rate`. Zero without an HBM bandwidth
    (the paper's model, which charges no memory-bound work)."""
    elements = np.asarray(elements, dtype=np.float64)
    rate = optimizer_step_rate(machine)
    if rate is None:
        return np.zeros(elements.shape)
    return elements * float(step_bytes) / float(rate)


def grad_accumulation_seconds(elements: np.ndarray, machine: Machine) -> np.ndarray:
    """Seconds of adding one micro-batch's weight gradient of ``elements`` elements into the step's gradient
    on one device, outside the weight-gradient product: ``elements * grad_accum_bytes / hbm_bandwidth``
    (:attr:`~shardplan.machine.Machine.grad_accum_bytes`; an elementwise pass, memory-bound by first
    principles). A step of M micro-batches runs it M - 1 times (the first micro-batch's gradient is taken as it
    is); zero where the product accumulates into its output (``grad_accum_bytes`` 0) or without an HBM
    bandwidth."""
    elements = np.asarray(elements, dtype=np.float64)
    if not machine.grad_accum_bytes or machine.hbm_bandwidth is None:
        return np.zeros(elements.shape)
    return elements * float(machine.grad_accum_bytes) / float(machine.hbm_bandwidth)


def converts(op: Operator) -> bool:
    """Whether ``op`` writes its output in another element size than every input it reads
    (:attr:`~shardplan.ir.Tensor.elem_factor`): a kernel that converts between precisions (a cast), charged at
    the machine's :attr:`~shardplan.machine.Machine.convert_rate`. An operator with one input of the output's
    size (a float32 loss beside its integer labels) does not convert; weights are left out (their factor also
    counts elements stored per point: an LSTM's four gates and two matrices, :func:`shardplan.ops.lstm`)."""
    return bool(op.inputs) and all(t.elem_factor != op.output.elem_factor for t in op.inputs)


def operator_cost(op: Operator, configs, machine: Machine, orders: np.ndarray | None = None,
                  step_bytes: float | None = None) -> OpCost:
    """t_l for every layout of ``op`` (see the module docstring for the derivation).

    ``configs``: :class:`~shardplan.layout.LayoutArrays`, or configuration rows
    (K, n) with optional nesting ``orders`` (laid out on the machine's levels
    as the flat device numbering, :meth:`~shardplan.layout.Layout.from_flat`).
    ``step_bytes``: HBM bytes per parameter element of the optimizer step (default
    :func:`optimizer_step_bytes` of Adam in the machine's element size).
    """
    p = machine.num_devices
    lay = as_layouts(configs, p, orders, machine.levels)
    configs = lay.splits
    k = len(configs)
    ext = np.asarray([e for _, e in op.dims], dtype=np.float64)
    nbytes = float(machine.dtype_bytes)
    zeros = np.zeros(k)
    canon = _CanonicalBoxes(op, configs, p)
    max_tile = canon.max_tile

    # compute: a roofline per pass (forward, and one backward product per gradient produced)
    out_vol = max_tile(op.output)
    passes = 1 + len(op.grad_tensors)
    flops = op.flops_per_point * np.prod(ext[None, :] / configs, axis=1)
    if op.causal is not None:  # the busiest device's share of its tile under the mask (cost/ring.py)
        flops = flops * causal_fractions(op, configs)[0]
    t_pass = flops / machine.achievable_flops
    if machine.shaped_gemms:  # each pass's product at its own tile, wave and alignment utilisation
        t_passes = flops[None, :] / (machine.achievable_flops * pass_utilisation(op, configs, machine))
    if machine.hbm_bandwidth is not None:
        moved = out_vol + sum(max_tile(t, core=False) for t in op.inputs + op.weights)
        rate = float(machine.convert_rate if converts(op) else machine.hbm_bandwidth)  # type: ignore[arg-type]
        t_pass = np.maximum(t_pass, moved * nbytes / rate)
        if machine.shaped_gemms:
            t_passes = np.maximum(t_passes, moved[None, :] * nbytes / rate)
    epilogue = [i for i, t in enumerate(op.grad_tensors) if any(t is e for e in op.epilogue_tensors)]
    pass_times = None  # (passes, K) seconds of each pass where the passes are costed one by one
    if op.backward_flops is not None:  # forward and backward each one fused kernel (cost/fused.py)
        t_pass, compute = fused_compute(op, configs, machine, max_tile)
    elif op.kernel_io is not None:  # a memory-bound operator inside a compiler-fused kernel (cost/chain.py)
        rate = None if machine.hbm_bandwidth is None else machine.convert_rate if converts(op) else machine.hbm_bandwidth
        t_pass, compute = chain_compute(op, flops, machine, rate, max_tile)
    elif machine.shaped_gemms or epilogue:
        if not machine.shaped_gemms:
            t_passes = np.broadcast_to(t_pass, (passes, k)).copy()
        kept = np.asarray([d not in op.reduction_dims for d in op.dim_names])
        out_points = np.prod(ext[None, kept] / configs[:, kept], axis=1)
        for i in epilogue:  # the output's gradient reduced to a bias's: one add per output point, read dY write dB
            t = op.grad_tensors[i]
            t_red = out_points / machine.achievable_flops
            if machine.hbm_bandwidth is not None:
                t_red = np.maximum(t_red, (out_vol + max_tile(t, core=False)) * nbytes / machine.hbm_bandwidth)
            t_passes[1 + i] = t_red
        t_pass, compute, pass_times = t_passes[0], t_passes.sum(axis=0), t_passes
    else:
        compute = passes * t_pass
        pass_times = np.broadcast_to(t_pass, (passes, k))

    # forward partial sums (a partial layout leaves them to its edges)
    deferred = lay.deferred
    per_dim = machine.reduce_per_dim
    keep = ~deferred if forward_deferrable(op) else np.ones(k, dtype=bool)
    fwd_ar, sent = zeros.copy(), zeros.copy()
    for g, gl in _reduce_groups(op, lay, op.reduction_dims, per_dim):
        fwd_ar = fwd_ar + np.where(keep, allreduce_time(out_vol * nbytes, gl, machine), 0.0)
        sent = sent + np.where(keep, _ar_sent(out_vol * nbytes, g), 0.0)

    # backward gradient all-reduces: activations' on the critical path, weights' as the framework syncs them
    grad_ar = zeros.copy()
    weight_sync = zeros.copy()
    bucket = machine.grad_bucket_bytes
    for t in op.grad_tensors:
        if t.owner is not None and machine.sum_shared_grads:  # summed into the owner's gradient first
            continue
        vol = max_tile(t, core=False)
        for g, gl in _reduce_groups(op, lay, op.grad_reduction_dims(t), per_dim):
            if t.role == "weight" and bucket is not None:
                # the tensor's share of a full bucket's all-reduce; a tensor larger than a bucket is its own
                share = np.minimum(vol * nbytes / bucket, 1.0)
                n_sync = np.maximum(vol * nbytes, bucket)
                weight_sync = weight_sync + share * allreduce_time(n_sync, gl, machine)
            elif t.role == "weight":
                weight_sync = weight_sync + allreduce_time(vol * nbytes, gl, machine)
            else:  # an activation's gradient: a partial layout leaves it to the edge from its producer
                grad_ar = grad_ar + np.where(deferred, 0.0, allreduce_time(vol * nbytes, gl, machine))
                g = np.where(deferred, 1, g)
            sent = sent + _ar_sent(vol * nbytes, g)
    # the input's gradient reduced beside the weight-gradient pass (Machine.overlap_dgrad): max(C - t_wgrad, φ C)
    hidden = input_gradient_hidden(op, grad_ar, pass_times, machine)
    grad_ar = grad_ar - hidden
    if machine.overlap_grad:
        backward = compute - t_pass - hidden
        grad_ar = grad_ar + exposed_beside(weight_sync, backward, machine.comm_contention)
    else:
        grad_ar = grad_ar + weight_sync

    # halo exchange of windowed inputs
    halo = zeros.copy()
    for t in op.inputs:
        if not any(a.window is not None or a.stride != 1 for a in t.axes):
            continue
        # the rows a device reads but does not own lie along the windowed axes; every device of its node
        # holds the same blocks of the other dims, so the neighbours are inside the node unless a dim of a
        # windowed axis is split on an outer level: the outermost level that splits one
        window_dims = {d for a in t.axes if a.window is not None or a.stride != 1 for d in (a.dim, a.window) if d}
        neighbour_level = outer_level(lay.group_sizes([j for j, d in enumerate(op.dim_names) if d in window_dims]))
        # a maximum over devices: once per distinct split of the dims the tile reads (see distinct_splits)
        need, inv = canon.boxes(t, core=False)
        core, _ = canon.boxes(t, core=True)
        # read but not owned: |need| - |need ∩ core| (a strided window's reads can be shifted off the owned rows)
        both = np.minimum(need[..., 1], core[..., 1]) - np.maximum(need[..., 0], core[..., 0])  # per axis
        both = np.maximum(both, 0, out=both).prod(axis=-1)  # |need ∩ core| (an empty range counts 0)
        extra = (box_volumes(need) - both).max(axis=1)[inv] * t.elem_factor * nbytes
        times = 2 if t.needs_grad else 1
        halo = halo + times * p2p_time(extra, machine, neighbour_level)
        sent = sent + times * extra

    # statistics of normalised dims
    stats = zeros.copy()
    if op.norm_dims:
        idx = [op.dim_names.index(d) for d in op.norm_dims]
        norm_ext = np.prod(ext[idx][None, :] / configs[:, idx], axis=1)
        vol = out_vol / norm_ext * op.norm_stats * nbytes
        passes = 2 if op.grad_tensors else 1
        for g, gl in _reduce_groups(op, lay, op.norm_dims, per_dim):
            stats = stats + passes * allreduce_time(vol, gl, machine)
            sent = sent + passes * _ar_sent(vol, g)

    rec = zeros.copy()
    if op.recurrence is not None:
        rec, rec_bytes = recurrence_cost(op, lay, machine)
        sent = sent + rec_bytes

    if step_bytes is None:
        step_bytes = optimizer_step_bytes(2.0, machine.dtype_bytes)
    opt = optimizer_step_seconds(optimizer_elements(op, lay, p), machine, step_bytes)

    return OpCost(compute, fwd_ar, grad_ar, halo, stats, rec, opt, sent, pass_times)


def wgrad_seconds(op: Operator, pass_times: np.ndarray) -> np.ndarray:
    """Seconds (K,) of the passes that compute ``op``'s weight gradients (rows ``1 + i`` of ``pass_times`` for
    every gradient ``i`` of a weight)."""
    rows = [1 + i for i, t in enumerate(op.grad_tensors) if t.role == "weight"]
    return pass_times[rows].sum(axis=0) if rows else np.zeros(pass_times.shape[1])


def input_gradient_hidden(op: Operator, act_ar: np.ndarray, pass_times: np.ndarray | None,
                          machine: Machine) -> np.ndarray:
    """Seconds (K,) of the activation-gradient all-reduce ``act_ar`` that run beside ``op``'s weight-gradient
    pass (:attr:`~shardplan.machine.Machine.overlap_dgrad`): ``min(t_wgrad, (1 - φ) act_ar)``, φ the
    collective's share of the device (:attr:`~shardplan.machine.Machine.comm_contention`,
    :mod:`shardplan.cost.contention`).

    Megatron-LM's column-parallel linear computes the input's gradient first, starts its all-reduce and
    computes the weight's gradient meanwhile (``LinearWithGradAccumulationAndAsyncCommunication``); the step
    waits for the later of the two, so the all-reduce costs ``max(C - t_wgrad, φ C)`` beyond the passes. Zero
    without the flag, for an operator without a weight gradient, and where the passes are not costed one by
    one (a fused or compiler-chained kernel)."""
    if not machine.overlap_dgrad or pass_times is None:
        return np.zeros_like(act_ar)
    return hidden_beside(act_ar, wgrad_seconds(op, pass_times), machine.comm_contention)


def recurrence_cost(op: Operator, lay: LayoutArrays, machine: Machine) -> tuple[np.ndarray, np.ndarray]:
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
    configs = lay.splits
    names = op.dim_names
    ext = op.extents
    c = {d: configs[:, names.index(d)].astype(np.float64) for d in (r.layer, r.time, r.state, r.batch)}
    L, S, E, B = (float(ext[d]) for d in (r.layer, r.time, r.state, r.batch))
    nbytes = float(machine.dtype_bytes)
    total = configs.prod(axis=1).astype(np.float64)
    work = op.flops_per_point * op.points * (1 + len(op.grad_tensors))
    extra_compute = (work / (total / c[r.time]) * (S + c[r.layer] - 1) / S - work / total) / machine.peak_flops
    neighbour_level = outer_level(lay.group_sizes([names.index(r.layer)]))  # stages along the layer dim

    handoff = np.where(c[r.layer] > 1, 2.0 * (c[r.layer] - 1) / c[r.layer] * (B / c[r.batch]) * S * (E / c[r.state])
                       * nbytes, 0.0)
    handoff_t = p2p_time(handoff, machine, neighbour_level)

    steps = S * L / c[r.layer]
    ag_bytes = (B / c[r.batch]) * E * nbytes
    gather_t = 2.0 * steps * allgather_time(ag_bytes, lay.group_sizes([names.index(r.state)]), machine)
    gather_b = np.where(c[r.state] > 1, 2.0 * steps * (c[r.state] - 1) / c[r.state] * ag_bytes, 0.0)
    return extra_compute + handoff_t + gather_t, handoff + gather_b
