"""Run a traced module sharded as planned, on DTensors.

:class:`ParallelModule` holds the parameters as DTensors (each laid out as
its first reader's configuration asks) and runs the exported FX graph node
by node (:func:`torch.export.export`'s training IR, the graph the plan was
made for):

* a node that is an operator gets each operand redistributed to the
  placements its configuration gives that tensor, is dispatched on DTensors
  (DTensor's own sharding propagation does the local work and returns the
  output, possibly as partial sums), and its output is redistributed to the
  planned placements (a split reduction dimension is all-reduced here, or
  left partial under a partial layout: :class:`Layouts`);
* constants (buffers, masks, position ids) run on plain tensors and enter
  DTensor operations replicated (``implicit_replication``);
* an ATen operator DTensor has no sharding strategy for runs on each device's
  tiles, as planned and costed (:func:`local_placements`): its operands are
  already laid out as its layout gives them, the operator runs on their local
  shards, and its result is the planned tiles, a partial sum over the mesh
  axes that split a dimension the result does not index (each operand's
  gradient likewise). Only an operator the frontend described conservatively
  (no handler: it is planned replicated, its operands gathered) or a node that
  is no operator runs replicated there: operands gathered, the operator on
  every device, a replicated result (autograd flows through both conversions).
  ``aten.scaled_dot_product_attention`` runs on each device's tiles (batch,
  heads and queries split as planned, keys whole: :func:`_sdpa`), with
  PyTorch's own kernel; with a plan made with ``context="ring"``, the
  queries split on one mesh axis and the keys and values arriving split
  along the sequence on it (:func:`shardplan.torch.ring.ring_applies`), by
  the ring over that axis instead (:func:`shardplan.torch.ring.ring_sdpa`);
  a causal one whose tables charge the all-gather's deal
  (:attr:`RunChoices.dealt`) with its queries dealt into the balanced order
  (:func:`shardplan.torch.ring.gather_sdpa`).

A fit plan's FP8 products and host offload run as :mod:`shardplan.torch.precision`
says (:class:`RunChoices`): the operands of an FP8 product cast with whole-tensor
scales, saved activations copied to host memory by saved-tensor hooks, the
optimizer state of offloading operators stepped on the host
(:meth:`ParallelModule.optimizer`).

Gradients flow back through DTensor's autograd: the redistribution of a
value in the forward pass is undone on its gradient in the backward pass,
so the backward pass uses the forward layouts, as the cost model assumes.
A hook on every parameter redistributes its gradient to the parameter's own
placements, so ``param.grad`` is laid out like ``param`` and any
``torch.optim`` optimizer updates the shards in place.

Names: the parameters and buffers are registered in a tree of bare modules
with the original module's submodule paths (the parallel module stands for
its root), so ``named_parameters()``, ``state_dict()`` and
``load_state_dict()`` speak the model's names (``transformer.wte.weight``),
tied parameters and shared submodules included, exactly as the model lists
them.

A fit plan's memory choices (:func:`shardplan.fit.solve_fit`;
:class:`RunChoices`) run as follows:

* *recomputation*: consecutive nodes of recomputed operators (with the views
  and item accesses that follow them) form a :class:`Segment` run under
  ``torch.utils.checkpoint`` (non-reentrant): the backward pass keeps the
  segment's inputs only and runs its forward again, redistributions and all;
* *micro-batches*: the module is traced again at 1/k of the batch and runs
  with the same per-operator layouts; :meth:`ParallelModule.step` runs the k
  micro-batches (rows i, i + k, ... of every tensor argument) one after the
  other, each forward followed by the backward of ``loss_i / k``, so
  ``param.grad`` accumulates the mean's gradient and one micro-batch's
  activations are live at a time; a gradient summed over the tile's replicas
  stays partial over the k micro-batches and is all-reduced once after them
  (:meth:`ParallelModule.reduce_grads`: the one all-reduce a step the cost
  tables charge ZeRO-0);
* *ZeRO stage 3*: a parameter whose first reader is at stage 3 is held with
  its tile cut further over the mesh axes that replicate it
  (:func:`zero3_placements`), so its gradient (reduce-scattered by the
  redistribution's backward) and the optimizer state created like it are
  cut too. Its reader gathers it (the operand redistribution) and a
  saved-tensor hook keeps, instead of the gathered copy autograd would save,
  the sharded parameter, gathering it again when the backward pass needs it
  (the model's two gathers). A parameter read through a view node first is
  saved as autograd saves it. Stages 1 and 2 keep a whole tile of the
  parameter but shard its optimizer state, which an optimizer stepping on
  the parameters cannot do: :func:`run_choices` refuses them (and
  :func:`shardplan.torch.parallelize` never offers them).
"""

from __future__ import annotations

import math
import operator as _pyop
import weakref
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from shardplan.errors import ShardplanError
from shardplan.ir import Graph, Operator, Tensor
from shardplan.torch.frontend import _SKIP as _CHECKS
from shardplan.torch.frontend import TorchTrace
from shardplan.torch.layout import mesh_dims, mesh_factors, plan_mesh_shape, tensor_placements
from shardplan.torch.precision import (AMAX_HISTORY, DelayedScaling, HostOffload, HostOptimizer, _to, fp8_cast,
                                      fp8_grad, fp8_operands)
from shardplan.torch.ring import SDPA, gather_sdpa, ring_applies, ring_kv_placements, ring_sdpa

__all__ = ["ParallelModule", "factored_mesh", "reduce_steps", "flat_groups", "summed_dims", "plan_placements",
           "Layouts", "RunChoices", "run_choices", "zero3_placements", "recompute_segments", "micro_batch",
           "check_same_program", "Segment", "Program", "TORCH_STAGES", "parallel_module", "release_storage", "fetch_home"]


def factored_mesh(mesh: Any, shape: Sequence[int] | None = None) -> Any:
    """A DeviceMesh over the same devices as ``mesh`` (any shape) with the given shape (default: prime factors).

    Every rank must call it (it creates the process groups of each mesh axis).
    """
    from torch.distributed.device_mesh import DeviceMesh

    ranks = mesh.mesh.flatten()
    shape = tuple(shape) if shape is not None else mesh_factors(len(ranks))
    names = tuple(f"m{i}" for i in range(len(shape)))
    if tuple(mesh.mesh.shape) == shape and mesh.mesh_dim_names == names:
        return mesh
    return DeviceMesh(mesh.device_type, ranks.reshape(shape), mesh_dim_names=names)


class Layouts:
    """Per operator, which dimension each mesh axis splits; placements of its tensors on demand.

    An operator whose layout leaves its output as partial sums (:attr:`shardplan.layout.Layout.partial`) has
    ``Partial()`` output placements on the mesh axes that split its reduction dims: the consumer's operand
    redistribution reduces them into its own placements (``Partial -> Shard``: a reduce-scatter;
    ``Partial -> Replicate``: an all-reduce). Deferred input gradients need nothing here: the backward of the
    consumer's operand redistribution takes the gradient, partial over the consumer's split dims, straight
    to the producer's placements.
    """

    def __init__(self, graph: Graph, layouts: Mapping[str, Any], factors: Sequence[int]) -> None:
        from shardplan.configs import forward_deferrable

        self.graph = graph
        self.axes: dict[str, tuple[str | None, ...]] = {
            op.name: mesh_dims(layouts[op.name], factors, op.name) for op in graph.operators}
        self.partial: frozenset[str] = frozenset(
            op.name for op in graph.operators if layouts[op.name].partial and forward_deferrable(op))

    def tensor(self, op_name: str, tensor_name: str) -> Tensor:
        op = self.graph[op_name]
        for t in op.tensors:
            if t.name == tensor_name:
                return t
        raise ShardplanError(f"operator {op_name!r} has no tensor {tensor_name!r}")

    def placements(self, op_name: str, tensor_name: str, rank: int | None = None) -> tuple[Any, ...]:
        return tensor_placements(self.tensor(op_name, tensor_name), self.axes[op_name], rank)

    def output(self, op_name: str, rank: int | None = None) -> tuple[Any, ...]:
        op: Operator = self.graph[op_name]
        out = tensor_placements(op.output, self.axes[op_name], rank)
        if op_name not in self.partial:
            return out
        from torch.distributed.tensor import Partial

        red = set(op.reduction_dims)
        return tuple(Partial() if d in red else pl for d, pl in zip(self.axes[op_name], out))


def plan_placements(plan: Any, info: TorchTrace, p: int) -> dict[str, Any]:
    """Readable layout of a plan: per operator its mesh axes' dimensions and output placements, per parameter its placements."""
    from shardplan.torch.layout import placement_names

    shape = plan_mesh_shape(list(plan.layouts.values()), p)
    lay = Layouts(plan.graph, plan.layouts, shape)
    out: dict[str, Any] = {"mesh": shape, "operators": {}, "parameters": {}}
    for op in plan.graph.operators:
        out["operators"][op.name] = {"mesh_axes": lay.axes[op.name],
                                     "output": placement_names(lay.output(op.name))}
    for target, uses in info.param_uses.items():
        opn, tn = uses[0]
        out["parameters"][target] = placement_names(lay.placements(opn, tn))
    return out


def local_placements(lay: Layouts, op_name: str, args: list, kwargs: dict,
                     described: Sequence[Any]) -> tuple[dict[int, tuple[Any, ...]], tuple[Any, ...]] | None:
    """How ``op_name`` runs on each device's tiles when DTensor has no sharding strategy for it:
    (operand id -> its gradient's placements, the result's placements), or None when its tiles cannot say.

    Each mesh axis splits one dimension ``d`` of the operator's iteration space (or none). A device's tiles
    of the operands give its tile of the result when every DTensor operand is one the frontend described
    (``described``; a constant is whole on every device) and is laid out as planned, ``Shard``
    on each axis whose ``d`` it indexes (a tensor read through a window or an offset is replicated there, so
    its tile is not the device's part: None) and ``Replicate`` elsewhere. The result is ``Shard`` where it
    indexes ``d``, a partial sum (``Partial``) where ``d`` is a dimension it does not index (a split
    reduction: the frontend fixes any reduction that is not a sum), ``Replicate`` on the replica axes. An
    operand replicated on an axis that splits ``d`` receives, on each device, the gradient of that device's
    part only: ``Partial`` there, its own placements elsewhere.
    """
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    op = lay.graph[op_name]
    axes = lay.axes[op_name]
    grads: dict[int, tuple[Any, ...]] = {}
    flat: list[Any] = []
    _tree_map(flat.append, list(args) + list(kwargs.values()))
    ids = {id(x) for x in described}
    for x in flat:
        if not isinstance(x, DTensor):
            continue
        if id(x) not in ids and any(d is not None for d in axes):
            return None
        if len(x.placements) != len(axes) or any(pl.is_partial() for pl in x.placements):
            return None
        grads[id(x)] = tuple(Partial() if pl.is_replicate() and d is not None else pl
                             for pl, d in zip(x.placements, axes))
    for t in op.tensors:  # every described operand and the result: plain tiles where a mesh axis splits them
        want = tensor_placements(t, axes)
        for pl, d in zip(want, axes):
            if d is not None and pl.is_replicate() and any(d in (a.dim, a.window) or d in a.inner for a in t.axes):
                return None
    out_pl = tuple(Replicate() if d is None else (pl if pl.is_shard() else Partial())
                   for pl, d in zip(tensor_placements(op.output, axes), axes))
    if any(isinstance(pl, Shard) and pl.dim >= len(op.output.shape) for pl in out_pl):
        return None
    return grads, out_pl


def _get(args: list, kwargs: dict, path: tuple) -> Any:
    if path[0] == "kw":
        return kwargs[path[1]]
    v = args[path[0]]
    return v[path[1]] if len(path) > 1 else v


def _set(args: list, kwargs: dict, path: tuple, value: Any) -> None:
    if path[0] == "kw":
        kwargs[path[1]] = value
        return
    if len(path) > 1:
        seq = list(args[path[0]])
        seq[path[1]] = value
        args[path[0]] = seq
    else:
        args[path[0]] = value


def _tree_map(fn: Any, x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        return type(x)(_tree_map(fn, v) for v in x)
    if isinstance(x, dict):
        return {k: _tree_map(fn, v) for k, v in x.items()}
    return fn(x)


def reduce_steps(src: Sequence[Any], dst: Sequence[Any], axes_dims: Sequence[str | None]) -> list[tuple[Any, ...]]:
    """The placements a redistribution from ``src`` to ``dst`` passes through so that its partial sums are
    reduced one dimension at a time: per dimension (mesh axes ``axes_dims``, in mesh order) whose axes are
    ``Partial`` in ``src`` and not in ``dst``, the placements with those axes made ``dst``'s, then ``dst``
    itself. One dimension (or none) to reduce: ``[dst]``.

    DTensor reduces a ``Partial`` once per mesh axis, or once over several axes when they are consecutive in
    its transform list and a flattened mesh of exactly those axes exists (:func:`flat_groups`); one
    redistribution per dimension keeps a reduction over several dims (a weight's gradient over batch and
    sequence) from merging into one all-reduce among all their devices: one all-reduce per split dim, what
    the tables charge (``Machine.reduce_per_dim``).
    """
    src, dst = tuple(src), tuple(dst)
    dims = [d for i, d in enumerate(axes_dims) if src[i].is_partial() and not dst[i].is_partial()]
    order = list(dict.fromkeys(dims))
    if len(order) < 2:
        return [dst]
    out, cur = [], list(src)
    for d in order[:-1]:
        for i, a in enumerate(axes_dims):
            if a == d:
                cur[i] = dst[i]
        out.append(tuple(cur))
    return out + [dst]


def flat_groups(axes: Sequence[Sequence[str | None]]) -> list[tuple[int, ...]]:
    """The mesh axes of every dimension that some layout splits over several axes (``axes``: per operator,
    the dimension each mesh axis splits), once each, in first-seen order: the groups the run flattens so
    that DTensor reduces (and gathers) such a dimension in one collective among all its devices."""
    out: list[tuple[int, ...]] = []
    for row in axes:
        for d in dict.fromkeys(a for a in row if a is not None):
            group = tuple(i for i, a in enumerate(row) if a == d)
            if len(group) > 1 and group not in out:
                out.append(group)
    return out


def _reduce_redistribute(x: Any, mesh: Any, placements: Sequence[Any], axes_dims: Sequence[str | None]) -> Any:
    """:func:`_redistribute` reducing partial sums one dimension at a time (:func:`reduce_steps`)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(x, DTensor) or tuple(x.placements) == tuple(placements):
        return x
    for step in reduce_steps(x.placements, placements, axes_dims):
        if tuple(x.placements) != step:
            x = x.redistribute(mesh, step)
    return x


def summed_dims(t: Tensor, axes_dims: Sequence[str | None]) -> tuple[str, ...]:
    """The split dimensions an operator's gradient of its operand ``t`` is a partial sum over: those its mesh
    axes split (``axes_dims``) that ``t`` does not read, in mesh order (the operand's
    :meth:`~shardplan.ir.Operator.grad_reduction_dims` that the layout splits)."""
    read = {d for a in t.axes for d in a.dims}
    return tuple(dict.fromkeys(d for d in axes_dims if d is not None and d not in read))


def _grad_by_dim(y: Any, mesh: Any, home: Sequence[Any], axes_dims: Sequence[str | None]) -> Any:
    """``y`` (an operand as its consumer reads it, ``home`` the placements its producer left it in) with its
    gradient reduced one dimension at a time (:func:`reduce_steps`) before DTensor takes it home.

    The consumer's gradient of an activation is a partial sum over the split dims that do not index it;
    DTensor's backward of the operand's redistribution (or of the producer's operator) reduces it in one
    redistribution, which merges several dims into one all-reduce among all their devices wherever a
    flattened group of their axes exists (:func:`flat_groups`). A hook on an alias of ``y`` takes the gradient
    home itself, one step per dim (each dim's axes into ``home``'s placements there: an all-reduce, or a
    reduce-scatter where ``home`` is a shard; a partial ``home`` axis stays partial, as DTensor keeps it), on
    the module's mesh, whose flattened groups DTensor then finds; DTensor's own backward has nothing left to
    do. One collective per split dim among that dim's devices, what the tables charge
    (``Machine.reduce_per_dim``). The caller adds it only where the gradient sums over two split dims or more
    (:func:`summed_dims`)."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(y, DTensor) or not y.requires_grad:
        return y

    def hook(g: Any) -> Any:
        if not isinstance(g, DTensor):
            return g
        dst = tuple(Replicate() if h.is_partial() and not q.is_partial() else h for q, h in zip(g.placements, home))
        steps = reduce_steps(g.placements, dst, axes_dims)
        if len(steps) < 2:  # one dim (or none) to reduce: DTensor's one redistribution, as without the hook
            return g
        for step in steps:
            g = g.redistribute(mesh, step)
        return g

    z = y.view_as(y)
    z.register_hook(hook)
    return z


def _reduce_in(g: Any, mesh: Any, placements: Sequence[Any], axes_dims: Sequence[str | None], dtype: Any) -> Any:
    """:func:`_reduce_redistribute` of a master weight's float32 gradient ``g`` in the compute ``dtype`` (None: in
    its own): cast down, reduced, widened back. A gradient the cast's backward widened from ``dtype`` holds
    ``dtype`` values, so the cast down is exact and the reduction is the 16-bit program's, moving its bytes;
    a sum over micro-batches (:meth:`ParallelModule.reduce_grads`) is rounded to ``dtype`` once, before it."""
    if dtype is None or g.dtype == dtype:
        return _reduce_redistribute(g, mesh, placements, axes_dims)
    return _reduce_redistribute(g.to(dtype), mesh, placements, axes_dims).to(g.dtype)


def _redistribute(x: Any, mesh: Any, placements: Sequence[Any]) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(x, DTensor):
        if tuple(x.placements) == tuple(placements):
            return x
        return x.redistribute(mesh, placements)
    return x


def _sdpa(q: Any, k: Any, v: Any, attn_mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False,
          scale: float | None = None, enable_gqa: bool = False, *, chunks: Sequence[int] | None = None) -> Any:
    """Attention on each device's tiles, as the frontend describes it: each mesh axis splits the batch, the
    heads or the queries of ``q`` (or nothing); ``k``, ``v`` are split alike on batch and heads and whole
    along the keys.

    A device's output tile is then PyTorch's own attention of its tiles: of
    ``q``; of ``k``, ``v`` (with grouped-query attention and the heads split,
    the device's K/V heads, as the frontend's merged head axis gives them; where
    the query heads are split finer than the K/V heads, the whole K/V heads,
    repeated to the query heads and cut to the device's);
    of the mask, each of its axes cut as the dimension it broadcasts to. A
    causal attention with the queries split reads the keys up to its last row
    ``r0 + n`` under PyTorch's lower-right causal bias (``causal_lower_right``:
    row ``r0 + i`` keeps key ``j <= r0 + i``, PyTorch's top-left alignment of
    the whole; the fused kernels take it without a mask tensor and skip the
    masked blocks); beside an explicit mask (or where the bias cannot be made:
    :func:`_lower_right`), an explicit mask of the rows.
    ``chunks``: a causal attention whose queries' local rows are not the
    contiguous block at their offset but equal chunks starting at these
    sequence positions (the balanced order: :func:`shardplan.torch.ring.gather_sdpa`);
    each chunk reads the keys up to its last row, under the lower-right bias.
    Gradients: ``k`` and ``v`` are partial sums over the axes that split the
    queries (and the heads, where they were repeated).
    Operands laid out otherwise are first laid out so; under the plan nothing
    moves. DTensor would run the math kernel's matmuls and softmax one by one,
    each through its sharding propagation, which on a mesh of 3 axes takes
    minutes per layer.
    """
    import torch
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    dt = [t for t in (q, k, v, attn_mask) if isinstance(t, DTensor)]
    if not dt:
        return F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    mesh = dt[0].device_mesh
    rep = [Replicate()] * mesh.ndim
    q, k, v = (t if isinstance(t, DTensor) else DTensor.from_local(t, mesh, rep, run_check=False) for t in (q, k, v))
    heads, kv_heads = q.shape[1], k.shape[1]
    split = [pl.dim if isinstance(pl, Shard) and pl.dim < 3 else None for pl in q.placements]
    q_pl = [Shard(d) if d is not None else Replicate() for d in split]
    head_ways = math.prod(mesh.size(i) for i, d in enumerate(split) if d == 1)
    kv_split = kv_heads == heads or kv_heads % head_ways == 0  # each device's query heads read its own K/V heads
    kv_pl = [Shard(d) if d == 0 or d == 1 and kv_split else Replicate() for d in split]
    kv_grad = [pl if pl.is_shard() or d is None else Partial() for pl, d in zip(kv_pl, split)]
    q = q.redistribute(mesh, q_pl) if tuple(q.placements) != tuple(q_pl) else q
    k, v = (t.redistribute(mesh, kv_pl) if tuple(t.placements) != tuple(kv_pl) else t for t in (k, v))
    size, start = compute_local_shape_and_global_offset(q.shape, mesh, q_pl)
    ql = _dense_grad(q.to_local(grad_placements=q_pl))
    kl, vl = (_dense_grad(t.to_local(grad_placements=kv_grad)) for t in (k, v))
    if not kv_split:  # query heads split finer than the K/V heads: the K/V heads of this device's query heads
        g = heads // kv_heads
        kl, vl = (t.repeat_interleave(g, dim=1)[:, start[1]:start[1] + size[1]] for t in (kl, vl))
    mask = attn_mask
    if attn_mask is not None:
        full, lead = (q.shape[0], heads, q.shape[2], k.shape[2]), 4 - attn_mask.dim()
        cuts = [0 <= d - lead and attn_mask.shape[d - lead] == full[d] != 1 for d in range(3)]
        if isinstance(attn_mask, DTensor):
            m_pl = [Shard(d - lead) if d is not None and cuts[d] else Replicate() for d in split]
            m_grad = [pl if pl.is_shard() or d is None else Partial() for pl, d in zip(m_pl, split)]
            m = attn_mask.redistribute(mesh, m_pl) if tuple(attn_mask.placements) != tuple(m_pl) else attn_mask
            mask = m.to_local(grad_placements=m_grad)
        else:
            mask = attn_mask[tuple(slice(start[d], start[d] + size[d]) if cuts[d] else slice(None)
                                   for d in range(lead, 3))]
    gqa = enable_gqa and kl.shape[1] != ql.shape[1]
    if chunks is not None and is_causal and 2 in split and mask is None:  # the queries in chunks of their own
        n = size[2] // len(chunks)
        parts = []
        for j, c in enumerate(chunks):
            last = c + n
            bias = _lower_right(n, last)
            if bias is None:
                bias = torch.arange(last, device=ql.device) <= torch.arange(c, last, device=ql.device).unsqueeze(-1)
            parts.append(F.scaled_dot_product_attention(ql[:, :, j * n:(j + 1) * n], kl[:, :, :last], vl[:, :, :last],
                                                        bias, dropout_p, False, scale=scale, enable_gqa=gqa))
        return DTensor.from_local(_dense(torch.cat(parts, dim=2)), mesh, q_pl, run_check=False)
    last = start[2] + size[2]  # the keys after this device's last query are masked from all its rows
    bias = _lower_right(size[2], last) if is_causal and 2 in split and mask is None and last <= k.shape[2] else None
    if bias is not None:
        kl, vl = kl[:, :, :last], vl[:, :, :last]
        mask, is_causal = bias, False
    elif is_causal and 2 in split:
        rows = torch.arange(start[2], start[2] + size[2], device=ql.device).unsqueeze(-1)
        keep = torch.arange(k.shape[2], device=ql.device) <= rows
        mask = keep if mask is None else (mask & keep if mask.dtype == torch.bool else
                                          mask.masked_fill(keep.logical_not(), float("-inf")))
        is_causal = False
    y = F.scaled_dot_product_attention(ql, kl, vl, mask, dropout_p, is_causal, scale=scale,
                                       enable_gqa=enable_gqa and kl.shape[1] != ql.shape[1])
    return DTensor.from_local(_dense(y), mesh, q_pl, run_check=False)


def _lower_right(n: int, keys: int) -> Any:
    """PyTorch's lower-right causal bias of ``n`` queries over ``keys`` keys, or None where a dispatch mode
    that is active (``CommDebugMode``, say) will not let its tensor subclass be made (then the caller masks
    the rows explicitly)."""
    from torch.nn.attention.bias import causal_lower_right

    try:
        return causal_lower_right(n, keys)
    except RuntimeError:
        return None


def _as_causal(fn: Any) -> Any:
    """``fn`` (``scaled_dot_product_attention`` or its run here) called with ``is_causal`` and no mask, for an
    attention the frontend described causal: its flag was set, or its mask is a constant of the program that
    kept exactly key <= query at trace time (the constant depends on the shapes only, which the run checks:
    :func:`check_same_program`). The causal kernel then skips the masked blocks, as the cost model charges,
    where the mask would make it compute them all."""

    def call(q: Any, k: Any, v: Any, attn_mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False,
             scale: float | None = None, enable_gqa: bool = False) -> Any:
        return fn(q, k, v, None, dropout_p, True, scale, enable_gqa)

    return call


def _dense_grad(t: Any) -> Any:
    """``t``, its gradient made row-major (:func:`_dense`): the fused attention kernel returns gradients in its own memory
    order, and DTensor, which takes a local tensor's strides for the global ones, then plans a view of the
    gathered gradient that its local tensor cannot take."""
    if t.requires_grad:
        t.register_hook(_dense)
    return t


def _dense(t: Any) -> Any:
    """A copy of ``t`` with the row-major strides of its shape (``contiguous()`` keeps odd strides of its
    size-1 dims), unless it has them already."""
    import torch

    want = torch.empty(0).new_empty(t.shape).stride() if t.dim() else ()
    return t if t.stride() == want else t.clone(memory_format=torch.contiguous_format)


def _has_dtensor(x: Any) -> bool:
    from torch.distributed.tensor import DTensor

    if isinstance(x, DTensor):
        return True
    if isinstance(x, (list, tuple)):
        return any(_has_dtensor(v) for v in x)
    if isinstance(x, dict):
        return any(_has_dtensor(v) for v in x.values())
    return False


def _mean(x: Any, dim: Any = None, keepdim: bool = False, dtype: Any = None) -> Any:
    """``mean`` as ``sum / count``: on split dims DTensor then gives partial *sums*, whose gradients it supports."""
    import math as _m

    dims = list(range(x.dim())) if dim is None or (isinstance(dim, (list, tuple)) and not dim) else (
        [dim] if isinstance(dim, int) else list(dim))
    count = _m.prod(x.shape[d] for d in dims)
    s = x.sum(dims, keepdim=keepdim, dtype=dtype) if dims else x
    return s / count


def _rms_norm(x: Any, normalized_shape: Sequence[int], weight: Any = None, eps: float | None = None) -> Any:
    """``rms_norm`` where a mesh axis splits (or leaves partial) a normalised dim of ``x``: PyTorch's composite
    adds ``eps`` in place to the mean of squares, which DTensor refuses on the partial sum a split normalised
    dim leaves; here out of place, the mean as ``sum / count`` (:func:`_mean`; DTensor reduces the partial sum
    before the ``+ eps``: the statistics' all-reduce the tables charge). As the composite computes it: in
    float32 for a 16-bit input (its "opmath" type), ``x · rsqrt(mean(x²) + eps) · weight`` cast back once;
    ``eps`` None: that type's machine epsilon (bit-equal to PyTorch 2.13's on CPU, bfloat16 included).
    Otherwise PyTorch's own ``rms_norm``."""
    import torch
    from torch.distributed.tensor import DTensor, Shard

    first = x.dim() - len(normalized_shape)
    if not isinstance(x, DTensor) or not any(pl.is_partial() or isinstance(pl, Shard) and pl.dim >= first
                                             for pl in x.placements):
        return torch.ops.aten.rms_norm.default(x, normalized_shape, weight, eps)
    up = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    e = torch.finfo(up.dtype).eps if eps is None else eps
    y = up * torch.rsqrt(_mean(up * up, list(range(first, x.dim())), keepdim=True) + e)
    return (y * weight.to(up.dtype) if weight is not None else y).to(x.dtype)


def _xent_terms(fn: Any, x: Any, target: Any, weight: Any, reduction: int, ignore_index: int, *rest: Any) -> Any:
    """Mean cross-entropy / NLL as ``sum of per-example losses / count of non-ignored targets``.

    Same value as reduction "mean" (without class weights); on a split batch
    DTensor then all-reduces two partial sums instead of averaging averages.
    """
    if reduction != 1 or weight is not None:
        return fn(x, target, weight, reduction, ignore_index, *rest)
    per = fn(x, target, weight, 0, ignore_index, *rest)
    count = (target != ignore_index).sum()
    return per.sum() / count.to(per.dtype)


def _cross_entropy(x: Any, target: Any, weight: Any = None, reduction: int = 1, ignore_index: int = -100,
                   label_smoothing: float = 0.0) -> Any:
    import torch

    return _xent_terms(torch.ops.aten.cross_entropy_loss.default, x, target, weight, reduction, ignore_index,
                       label_smoothing)


def _nll(x: Any, target: Any, weight: Any = None, reduction: int = 1, ignore_index: int = -100) -> Any:
    import torch

    return _xent_terms(torch.ops.aten.nll_loss_nd.default, x, target, weight, reduction, ignore_index)


def _hardsigmoid(x: Any) -> Any:
    """``hardsigmoid(x) = clamp(x + 3, 0, 6) / 6``, from ops DTensor differentiates (it has no
    ``hardsigmoid_backward``)."""
    return (x + 3.0).clamp(0.0, 6.0) / 6.0


def _hardswish(x: Any) -> Any:
    """``hardswish(x) = x * clamp(x + 3, 0, 6) / 6`` (DTensor has no ``hardswish_backward``)."""
    return x * _hardsigmoid(x)


def _local(x: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return x.to_local() if isinstance(x, DTensor) else x


def _new_factory(name: str) -> Any:
    """``x.new_zeros(size)`` and the like: ``x`` gives only dtype and device, so its local shard is the
    prototype and the result is a plain (constant) tensor of the full size."""

    def call(x: Any, *args: Any, **kwargs: Any) -> Any:
        import torch

        return getattr(torch.ops.aten, name).default(_local(x), *args, **kwargs)

    return call


def _fill_tensor(x: Any, value: Any) -> Any:
    """``x.fill_(value)`` with a 0-d tensor value, as ``fill_`` with the scalar (DTensor has no strategy
    for the tensor overload)."""
    from torch.distributed.tensor import DTensor

    v = value.full_tensor() if isinstance(value, DTensor) else value
    return x.fill_(v.item())


def _grouped_mm_pairs(a: Any, b: Any) -> tuple[Any, Any, Any, Any, Any]:
    """On one mesh axis, the placements of tokens ``x`` and experts ``W`` a local grouped matmul runs on:
    (x, W, output, x's gradient, W's gradient). Tokens split: the output is split alike and ``W``'s
    gradient is a partial sum; output features split: ``x``'s gradient is partial; the contraction split:
    the output is partial. Anything else runs replicated on that axis."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    if a == Shard(0) and b.is_replicate():
        return a, b, Shard(0), a, Partial()
    if a.is_replicate() and b == Shard(2):
        return a, b, Shard(1), Partial(), b
    if a == Shard(1) and b == Shard(1):
        return a, b, Partial(), a, b
    return Replicate(), Replicate(), Replicate(), Replicate(), Replicate()


def _grouped_mm_local(x: Any, w: Any, offs: Any, *rest: Any, fn: Any = None) -> Any:
    """``y[s, n] = sum_k x[s, k] W[e(s), k, n]`` on each device's tiles (DTensor has no strategy for it).

    A device holding tokens ``[t0, t0 + m)`` (sorted by expert) runs the
    product with the offsets shifted to its slice, ``clamp(offs - t0, 0, m)``;
    the expert dim is never split.
    """
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(x, DTensor) and not isinstance(w, DTensor):
        return fn(x, w, offs, *rest)
    mesh = x.device_mesh if isinstance(x, DTensor) else w.device_mesh
    rep = [Replicate()] * mesh.ndim
    x, w = (t if isinstance(t, DTensor) else DTensor.from_local(t, mesh, rep, run_check=False) for t in (x, w))
    pairs = [_grouped_mm_pairs(a, b) for a, b in zip(x.placements, w.placements)]
    x = x.redistribute(mesh, [p[0] for p in pairs])
    w = w.redistribute(mesh, [p[1] for p in pairs])
    offs = offs.full_tensor() if isinstance(offs, DTensor) else offs
    size, start = compute_local_shape_and_global_offset(x.shape, mesh, x.placements)
    local_offs = (offs - start[0]).clamp(0, size[0]).to(offs.dtype)
    y = fn(x.to_local(grad_placements=[p[3] for p in pairs]), w.to_local(grad_placements=[p[4] for p in pairs]),
           local_offs, *rest)
    return DTensor.from_local(y, mesh, [p[2] for p in pairs], run_check=False)


def _grouped_mm(name: str) -> Any:
    def call(x: Any, w: Any, offs: Any = None, *rest: Any, **kwargs: Any) -> Any:
        import torch

        ns, op = name.split(".")
        base = getattr(getattr(torch.ops, ns), op).default
        return _grouped_mm_local(x, w, kwargs.pop("offs", offs), *rest,
                                 fn=lambda *a: base(*a[:2], offs=a[2], **kwargs) if ns == "aten" else base(*a, **kwargs))

    return call


def _cat(tensors: Sequence[Any], dim: int = 0) -> Any:
    """``cat`` without its parts that have no elements (a KV cache's empty past, a legacy ``(0,)``
    tensor whatever ``dim``): with one part left, that part (DTensor cannot concatenate a replicated
    empty 1-D tensor with a sharded one)."""
    import torch

    parts = [t for t in tensors if t.numel() > 0]
    if len(parts) == 1:
        return parts[0]
    return torch.ops.aten.cat.default(parts or list(tensors), dim)


def _index_put_values_dim(x_dim: int, x_rank: int, at: Sequence[int], b_rank: int, v_rank: int) -> int | None:
    """Which dimension of the values of ``x[indices] = values`` lies along the non-indexed dimension
    ``x_dim`` of ``x`` (None: values broadcast along it). ``at``: the indexed dims of ``x``, the index
    tensors broadcasting to ``b_rank`` dims. The values broadcast to ``x[indices]``'s shape: the index
    block in place of the indexed dims when they are adjacent, in front otherwise."""
    kept = [d for d in range(x_rank) if d not in at]
    if at == list(range(at[0], at[-1] + 1)):
        r = x_dim if x_dim < at[0] else x_dim - len(at) + b_rank
    else:
        r = b_rank + kept.index(x_dim)
    v = r - (x_rank - len(at) + b_rank - v_rank)
    return v if v >= 0 else None


def _index_put(x: Any, indices: Sequence[Any], values: Any, accumulate: bool = False) -> Any:
    """``y = x.index_put(indices, values)`` (``x[indices] = values`` on a copy) on each device's tiles.

    As planned, each mesh axis splits a dimension of ``x`` the indices do
    not index (or none) and the values alike, and the index tensors are
    whole: then each device's tile of ``y`` is ``index_put`` of its tiles
    of ``x`` and the values with the whole indices, and nothing moves.
    Anything else is first laid out so (the indexed dims and the index
    tensors replicated, the values split as ``x``). The gradient of the
    values is a partial sum over an axis that splits a dim they broadcast
    along. (DTensor has a forward rule, but its backward builds a plain
    zero tensor and fails.)
    """
    import torch
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    fn = torch.ops.aten.index_put.default
    dt = [t for t in [x, values, *indices] if isinstance(t, DTensor)]
    if not dt:
        return fn(x, list(indices), values, accumulate)
    mesh = dt[0].device_mesh
    rep = [Replicate()] * mesh.ndim
    x, values = (t if isinstance(t, DTensor) else DTensor.from_local(t, mesh, rep, run_check=False) for t in (x, values))
    at = [d for d, i in enumerate(indices) if i is not None]
    b_rank = len(torch.broadcast_shapes(*[tuple(indices[d].shape) for d in at]))
    x_pl, v_pl, v_grad = [], [], []  # per mesh axis: x's, the values' and their gradient's placements
    for pl in x.placements:
        d = pl.dim if isinstance(pl, Shard) else None
        vd = None if d is None or d in at else _index_put_values_dim(d, x.dim(), at, b_rank, values.dim())
        if d is None or d in at:
            row = (Replicate(), Replicate(), Replicate())
        elif vd is None or values.shape[vd] == 1:
            row = (pl, Replicate(), Partial())
        else:
            row = (pl, Shard(vd), Shard(vd))
        for out, p in zip((x_pl, v_pl, v_grad), row):
            out.append(p)
    x = x.redistribute(mesh, x_pl) if tuple(x.placements) != tuple(x_pl) else x
    values = values.redistribute(mesh, v_pl) if tuple(values.placements) != tuple(v_pl) else values
    whole = [i.redistribute(mesh, rep).to_local() if isinstance(i, DTensor) else i for i in indices]
    y = fn(x.to_local(grad_placements=x_pl), whole, values.to_local(grad_placements=v_grad), accumulate)
    return DTensor.from_local(y, mesh, x_pl, run_check=False)


def _functional(name: str, rewrite: Any = None) -> Any:
    """An in-place ``x.op_(...)`` as its functional form ``op(x, ...)`` (which DTensor runs, or the rewrite of
    it): DTensor has no strategy for the in-place op, or (``index_put_``) the run lays ``x`` out as planned
    first, and writing into that relaid copy would not reach ``x``; the run gives later readers of ``x``
    this result (:data:`_FUNCTIONAL`), as the frontend describes them."""

    def call(x: Any, *args: Any, **kwargs: Any) -> Any:
        import torch

        return (rewrite or getattr(torch.ops.aten, name).default)(x, *args, **kwargs)

    return call


_CONV = frozenset({"aten.conv1d.default", "aten.conv2d.default", "aten.conv3d.default", "aten.convolution.default"})

_REWRITES = {
    "aten.scaled_dot_product_attention.default": _sdpa,
    "aten.mean.dim": _mean,
    "aten.mean.default": lambda x, dtype=None: _mean(x, None, False, dtype),
    "aten.rms_norm.default": _rms_norm,
    "aten.cross_entropy_loss.default": _cross_entropy,
    "aten.nll_loss.default": _nll,
    "aten.nll_loss_nd.default": _nll,
    "aten.hardswish.default": _hardswish,
    "aten.hardsigmoid.default": _hardsigmoid,
    "aten.fill_.Tensor": _fill_tensor,
    "aten.index_put.default": _index_put,
    "aten.cat.default": _cat,
    "aten.concat.default": _cat,
    "transformers.grouped_mm_fallback.default": _grouped_mm("transformers.grouped_mm_fallback"),
    "aten._grouped_mm.default": _grouped_mm("aten._grouped_mm"),
    **{f"aten.{n}.default": _new_factory(n) for n in ("new_zeros", "new_ones", "new_empty", "new_full")},
    **(_FUNCTIONAL := {
        "aten.triu_.default": _functional("triu"),
        "aten.tril_.default": _functional("tril"),
        "aten.hardswish_.default": _functional("hardswish", _hardswish),
        "aten.hardsigmoid_.default": _functional("hardsigmoid", _hardsigmoid),
        "aten.index_put_.default": _functional("index_put", _index_put),
    }),
}


TORCH_STAGES = (0, 3)
"""The ZeRO stages this module runs: 0, and 3 (the parameter sharded over its data-parallel group,
gathered on use). Stages 1 and 2 shard the optimizer state (and gradients) of a parameter held whole
on its tile, which a ``torch.optim`` optimizer stepping on the parameters themselves cannot do, so a
plan for :func:`shardplan.torch.parallelize` is searched without them."""


@dataclass(frozen=True)
class RunChoices:
    """What a fit plan asks of the run besides its layouts.

    Attributes:
        micro_batches: k; the step runs k slices of the batch and accumulates their gradients.
        recompute: operators (by name) whose forward runs again in the backward pass.
        zero3: operators (by name) whose parameters are held sharded over their data-parallel group.
        fp8: operators whose matrix product runs in FP8 (:mod:`shardplan.torch.precision`).
        offload: operators whose saved activations live in host memory
            (:class:`~shardplan.torch.precision.HostOffload`).
        offload_optimizer: operators whose weights' optimizer state lives in host memory
            (:meth:`ParallelModule.optimizer` gives their parameters a
            :class:`~shardplan.torch.precision.HostOptimizer`).
        ring: attention whose queries are split runs the ring (:func:`shardplan.torch.ring.ring_sdpa`): the plan's
            tables were built with ``context="ring"``.
        dealt: causal attentions (by name) that, run with their keys gathered, first deal their queries into
            the balanced order (:func:`shardplan.torch.ring.gather_sdpa`): where the plan's tables charge the
            deal (:func:`shardplan.cost.ring.deals_gathered`).
        offload_params: operators whose ZeRO-3 weights live in host memory (ZeRO-Infinity's ``offload_param``):
            brought to the device for the forward pass and for each regather of the backward pass
            (:meth:`ParallelModule.offloaded_parameters`).
        zero2: operators whose parameters keep their whole tile but receive their gradient in shards: the
            gradient is reduce-scattered to the tile cut further over its replicas (:func:`zero3_placements`)
            instead of all-reduced, and accumulates there. Only a pipeline stage sets it
            (:class:`shardplan.torch.staged.ShardedStateOptimizer` steps such parameters through their master
            shards); :func:`run_choices` refuses ZeRO stage 2 for one program.
        master_weights: mixed precision with float32 master weights (the plan's precision rule
            :class:`shardplan.cost.memory.ChoiceRules` ``master_weights``): every 16-bit floating parameter is held
            (and stepped by the optimizer) in float32, and each pass reads its copy cast to the module's own
            dtype (:meth:`ParallelModule.compute_copy`); gradients are reduced in that dtype and kept in float32.
    """

    micro_batches: int = 1
    recompute: frozenset[str] = frozenset()
    zero3: frozenset[str] = frozenset()
    fp8: frozenset[str] = frozenset()
    offload: frozenset[str] = frozenset()
    ring: bool = False
    offload_optimizer: frozenset[str] = frozenset()
    offload_params: frozenset[str] = frozenset()
    dealt: frozenset[str] = frozenset()
    zero2: frozenset[str] = frozenset()
    master_weights: bool = False


def run_choices(plan: Any) -> RunChoices:
    """The :class:`RunChoices` of ``plan`` (none for a plan without memory choices).

    Raises:
        ShardplanError: the plan shards some operator's state at ZeRO stage 1 or 2 (see :data:`TORCH_STAGES`).
    """
    from shardplan.cost.ring import deals_gathered

    tables = getattr(plan, "tables", None)
    ring = tables is not None and tables.options.get("context") == "ring"
    names = [op.name for op in plan.graph.operators]
    dealt = frozenset(op.name for op in plan.graph.operators
                      if op.kind == "attn_flash" and deals_gathered(op, plan.layouts[op.name], plan.machine))
    mc = plan.memory_choices
    if mc is None:
        return RunChoices(ring=ring, dealt=dealt)
    bad = [n for i, n in enumerate(names) if mc.stage(i) not in TORCH_STAGES]
    if bad:
        raise ShardplanError(f"operator {bad[0]!r} shards its state at ZeRO stage {mc.stage(names.index(bad[0]))}; "
                             f"the PyTorch run holds stages {', '.join(map(str, TORCH_STAGES))} only")
    return RunChoices(int(mc.micro_batches), frozenset(n for i, n in enumerate(names) if mc.recompute(i)),
                      frozenset(n for i, n in enumerate(names) if mc.stage(i) == 3),
                      frozenset(n for i, n in enumerate(names) if mc.fp8(i)),
                      frozenset(n for i, n in enumerate(names) if "activations" in mc.offload(i)), ring,
                      frozenset(n for i, n in enumerate(names) if "optimizer" in mc.offload(i)),
                      frozenset(n for i, n in enumerate(names) if "parameters" in mc.offload(i)), dealt,
                      master_weights=bool(mc.rules.master_weights))


def zero3_placements(placements: Sequence[Any], shape: Sequence[int], mesh_shape: Sequence[int]) -> tuple[Any, ...]:
    """A parameter's tile placements further sharded over the mesh axes that replicate its tile.

    The tile is copied on every mesh axis with ``Replicate()``: its
    data-parallel group G is their product. Each such axis of size n > 1
    (largest first) becomes ``Shard(d)`` on the first tensor axis d whose
    local extent n divides, preferring axes no mesh axis splits yet, and
    accepting one already split only by earlier mesh axes (so the new split
    is the inner one, as DTensor nests splits of one axis in mesh order).
    An axis that divides no tensor axis stays ``Replicate()``: the state is
    then held G/n times smaller only by the other axes.
    """
    from torch.distributed.tensor import Shard

    out = list(placements)
    local = [int(x) for x in shape]
    last_axis: dict[int, int] = {}  # tensor axis -> the last mesh axis that splits it
    for i, pl in enumerate(placements):
        if pl.is_shard():
            local[pl.dim] //= int(mesh_shape[i])
            last_axis[pl.dim] = i
    free = sorted((i for i, pl in enumerate(placements) if pl.is_replicate() and int(mesh_shape[i]) > 1),
                  key=lambda i: -int(mesh_shape[i]))
    for i in free:
        n = int(mesh_shape[i])
        order = [d for d in range(len(local)) if d not in last_axis] + sorted(last_axis)
        for d in order:
            if local[d] % n == 0 and last_axis.get(d, -1) < i:
                out[i] = Shard(d)
                local[d] //= n
                last_axis[d] = i
                break
    return tuple(out)


@dataclass(frozen=True)
class Segment:
    """Consecutive FX nodes recomputed together: run under one ``torch.utils.checkpoint``.

    ``inputs``: names of the values from outside it that its nodes read (in
    first-read order); ``outputs``: names of its nodes read after it.
    """

    nodes: tuple[Any, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


def recompute_segments(nodes: Sequence[Any], node_op: Mapping[str, str], recompute: frozenset[str]) -> list[Any]:
    """The FX ``nodes`` in order with the recomputed ones grouped into :class:`Segment` s.

    A segment opens at a node of a recomputed operator and extends over the
    following nodes that belong to recomputed operators or to no operator
    (the views, item accesses and constants that follow an operator); a node
    of an operator that does not recompute, a ``get_attr``, a placeholder or
    the output closes it.
    """
    items: list[Any] = []
    run: list[Any] = []

    def close() -> None:
        if not run:
            return
        inside = {n.name for n in run}
        ins: dict[str, None] = {}
        for n in run:
            for a in n.all_input_nodes:
                if a.name not in inside:
                    ins.setdefault(a.name)
        outs = tuple(n.name for n in run if any(u.name not in inside for u in n.users))
        items.append(Segment(tuple(run), tuple(ins), outs))
        run.clear()

    for n in nodes:
        op = node_op.get(n.name)
        if n.op == "call_function" and (op in recompute if op is not None else bool(run)):
            run.append(n)
            continue
        close()
        items.append(n)
    close()
    return items


def micro_batch(args: Sequence[Any], kwargs: Mapping[str, Any], i: int, k: int) -> tuple[list, dict]:
    """Micro-batch ``i`` of ``k``: rows ``i, i + k, i + 2k, ...`` of every tensor argument (axis 0 is the batch).

    Raises:
        ShardplanError: a tensor argument without a first axis divisible by ``k``.
    """
    import torch

    def cut(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if x.dim() == 0 or x.shape[0] % k:
            raise ShardplanError(f"micro-batches split every tensor argument along axis 0; an argument of shape "
                                 f"{tuple(x.shape)} does not split into {k}")
        return x[i::k].contiguous()

    return [_tree_map(cut, a) for a in args], {n: _tree_map(cut, v) for n, v in kwargs.items()}


def check_same_program(graph: Graph, micro: Graph, layouts: Mapping[str, Any], k: int) -> None:
    """The module traced at 1/k of the batch must give the planned operators, each split dividing its extents.

    Raises:
        ShardplanError: another operator list, or a split that does not divide a micro-batch extent.
    """
    want = [(op.name, op.kind) for op in graph.operators]
    got = [(op.name, op.kind) for op in micro.operators]
    if want != got:
        diff = next((a, b) for a, b in zip(want + [None] * len(got), got + [None] * len(want)) if a != b)
        raise ShardplanError(f"the module traced at 1/{k} of the batch gives other operators than the planned one "
                             f"(first difference: planned {diff[0]}, micro-batch {diff[1]}); micro-batches need a "
                             "module whose program does not depend on the batch size")
    for op, mop in zip(graph.operators, micro.operators):
        split = layouts[op.name].split
        bad = [d for d, c in zip(op.dim_names, split) if mop.extents[d] % int(c)]
        if bad:
            raise ShardplanError(f"operator {op.name!r}: dimension {bad[0]} of the micro-batch ({mop.extents[bad[0]]}) "
                                 f"is not divisible by its split {split}; use fewer than {k} micro-batches")


@dataclass(frozen=True, eq=False)
class Program:
    """One traced program and how to run it: its trace, graph, layouts and nodes (recomputed ones in segments)."""

    info: TorchTrace
    graph: Graph
    layouts: Layouts
    items: tuple[Any, ...]


def program(info: TorchTrace, graph: Graph, layouts: Mapping[str, Any], factors: Sequence[int],
            recompute: frozenset[str] = frozenset()) -> Program:
    """The :class:`Program` of a trace, with ``recompute`` (operator names) grouped into segments."""
    nodes = list(info.program.graph_module.graph.nodes)
    return Program(info, graph, Layouts(graph, layouts, factors),
                   tuple(recompute_segments(nodes, info.node_op, recompute)))


@dataclass(frozen=True, eq=False)
class _Regather:
    """A saved gathered ZeRO-3 parameter, by reference: the sharded parameter, the gathered placements,
    the local view (size, stride, storage offset) and, for a DTensor, its placements, shape and stride."""

    param: Any
    placements: tuple[Any, ...]
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    spec: tuple[Any, ...] | None


class ParallelModule:
    """A module's forward pass, sharded as planned (constructed by :func:`shardplan.torch.parallelize`).

    Call it like the module: ``out = pm(*args, **kwargs)``; DTensor results
    come back as full tensors (differentiable), so ``out.backward()`` fills
    ``param.grad`` of the DTensor parameters. The parameters and buffers
    carry the original module's names: ``named_parameters()``,
    ``parameters()``, ``named_buffers()``, ``state_dict()`` and
    ``load_state_dict()`` are those of the module (tied parameters and shared
    submodules included, once where the module lists them once), with
    DTensor parameters; ``named_dparameters()`` lists every name of a tied
    parameter. :meth:`step` runs a forward and backward pass with a fit
    plan's memory choices (micro-batches, recomputation, ZeRO-3 parameters).
    Subclasses nothing heavy at import time: :meth:`create` builds the
    ``nn.Module`` subclass when torch is loaded.
    """

    @staticmethod
    def create(module: Any, info: TorchTrace, graph: Graph, layouts: Mapping[str, Any], mesh: Any,
               choices: RunChoices = RunChoices(), micro: tuple[TorchTrace, Graph] | None = None) -> Any:
        """``layouts``: operator name -> :class:`~shardplan.layout.Layout` (``plan.layouts``).

        ``choices``: a fit plan's :class:`RunChoices`; with k > 1 micro-batches
        ``micro`` is the module traced at 1/k of the batch (:func:`parallel_module` does this).
        """
        return _make_class()(module, info, graph, layouts, mesh, choices, micro)


def parallel_module(module: Any, example_inputs: Sequence[Any], kwargs: Mapping[str, Any] | None, info: TorchTrace,
                    plan: Any, mesh: Any) -> Any:
    """The :class:`ParallelModule` of ``plan`` (traced as ``info``) with its memory choices (:func:`run_choices`).

    With k > 1 micro-batches the module is traced again at micro-batch ``0``
    of the example inputs (:func:`micro_batch`) and must give the planned
    operators (:func:`check_same_program`); each operator runs there with its
    planned layout.
    """
    from shardplan.torch.frontend import trace

    choices = run_choices(plan)
    micro = None
    k = choices.micro_batches
    if k > 1:
        a, kw = micro_batch(example_inputs, dict(kwargs or {}), 0, k)
        mgraph, minfo = trace(module, a, kw)
        check_same_program(plan.graph, mgraph, plan.layouts, k)
        micro = (minfo, mgraph)
    return ParallelModule.create(module, info, plan.graph, plan.layouts, mesh, choices, micro)


def _offloaded(pack: Any, unpack: Any, host: HostOffload) -> tuple[Any, Any]:
    """Saved-tensor hooks ``pack``, ``unpack`` (ZeRO-3's regather) with host offload around them: what ``pack``
    leaves a tensor (anything but a regathered parameter) goes to the host, and comes back before ``unpack``."""
    import torch

    def pack2(t: Any) -> Any:
        out = pack(t)
        return host.pack(out) if isinstance(out, torch.Tensor) else out

    def unpack2(t: Any) -> Any:
        return unpack(host.unpack(t))
    return pack2, unpack2


def release_storage(t: Any) -> None:
    """Free the device memory of ``t``, a tensor living in host memory between its uses (its values stay in its
    home; the tensor keeps its shape, with no storage bytes, as FSDP frees its flat parameters)."""
    t.untyped_storage().resize_(0)


def fetch_home(t: Any, home: Any) -> None:
    """Bring ``t``'s values back from its ``home`` in host memory: a copy into fresh device memory (non-blocking
    from pinned memory)."""
    import torch

    storage = t.untyped_storage()
    if storage.nbytes() == 0:
        storage.resize_(home.numel() * home.element_size())
    with torch.no_grad():
        t.copy_(home, non_blocking=True)


def _make_class() -> Any:
    import functools

    import torch
    from torch import nn
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.export.graph_signature import InputKind

    class _ParallelModule(nn.Module):
        def __init__(self, module: Any, info: TorchTrace, graph: Graph, layouts: Mapping[str, Any],
                     mesh: Any, choices: RunChoices = RunChoices(),
                     micro: tuple[TorchTrace, Graph] | None = None) -> None:
            super().__init__()
            self.info = info
            self.graph = graph
            p = int(mesh.mesh.numel())
            shape = plan_mesh_shape([layouts[o.name] for o in graph.operators], p)
            self.mesh = factored_mesh(mesh, shape)
            factors = tuple(self.mesh.mesh.shape)
            self._flatten_groups(graph, layouts, factors)
            self.choices = choices
            self._full = program(info, graph, layouts, factors, choices.recompute)
            self.layouts = self._full.layouts
            if choices.micro_batches > 1 and micro is None:
                raise ShardplanError(f"{choices.micro_batches} micro-batches need the module traced at a micro-batch")
            self._micro = self._full if micro is None else program(
                micro[0], micro[1], {m.name: layouts[o.name] for o, m in zip(graph.operators, micro[1].operators)},
                factors, choices.recompute)
            self._zero3 = {t for op in choices.zero3 for t, uses in info.param_uses.items() if uses[0][0] == op}
            self._zero2 = {t for op in choices.zero2 for t, uses in info.param_uses.items() if uses[0][0] == op}
            self._sharded: set[int] = set()  # ids of the ZeRO-3 parameters
            # master weights: id(parameter) -> the dtype the module computes in; the live compute copies of the
            # ZeRO-3 parameters (gathered and regathered as the parameters are), by id
            self._compute: dict[int, Any] = {}
            self._sharded_copies: Any = weakref.WeakValueDictionary()
            self._homes: dict[int, tuple[Any, Any]] = {}  # id -> (parameter, its shard's home in host memory)
            self.host = HostOffload()  # the offloaded activations' hooks and their byte count
            # FP8 delayed scaling's state (Transformer Engine's default recipe, what the cost model charges); None:
            # current scaling (:meth:`current_scaling`)
            self.scaling: DelayedScaling | None = DelayedScaling() if choices.fp8 else None
            self._stepping = False
            self._accumulating = False  # a step's micro-batches run: ZeRO-0 and 1 gradients stay partial
            self.param_placements: dict[str, tuple[Any, ...]] = {}
            self._grad_axes: dict[str, Sequence[str | None]] = {}  # name -> its first reader's mesh axes' dims
            self._mirror(module)

        @property
        def micro_batches(self) -> int:
            """The plan's micro-batch count k (1 for a plan without memory choices)."""
            return self.choices.micro_batches

        def _mirror(self, module: Any) -> None:
            """Register the DTensor parameters and the buffers in a tree of modules named as ``module``'s.

            Every submodule path of ``module`` gets a bare ``nn.Module`` at the
            same path (this module stands for the root), holding at the same
            local names the DTensor parameter of each parameter and the buffer
            itself (persistent or not, as there). A tensor registered under
            several names (tied weights, a shared submodule) is one DTensor
            registered under the same names, so ``named_parameters()``,
            ``state_dict()`` and their duplicates follow ``module``'s exactly.
            """
            names: dict[int, list[str]] = {}
            for name, par in module.named_parameters(remove_duplicate=False):
                names.setdefault(id(par), []).append(name)
            made: dict[int, Any] = {}  # id(original parameter) -> its DTensor parameter
            shadows: dict[int, Any] = {id(module): self}  # id(original submodule) -> its mirror
            by_path: dict[str, Any] = {"": self}
            for path, sub in module.named_modules(remove_duplicate=False):
                if not path:
                    self._fill(sub, self, names, made)
                    continue
                parent, _, leaf = path.rpartition(".")
                shadow = shadows.get(id(sub))
                if shadow is None:  # first time this submodule is met; a shared one keeps its mirror
                    shadow = shadows[id(sub)] = nn.Module()
                    self._fill(sub, shadow, names, made)
                by_path[path] = shadow
                by_path[parent]._modules[leaf] = shadow

        def _fill(self, sub: Any, shadow: Any, names: Mapping[int, list[str]], made: dict[int, Any]) -> None:
            """Put ``sub``'s own parameters (as DTensors) and buffers into ``shadow`` under their local names."""
            for local, par in sub._parameters.items():
                if par is not None and id(par) not in made:
                    made[id(par)] = self._distribute(names[id(par)], par)
                shadow._parameters[local] = None if par is None else made[id(par)]
            for local, buf in sub._buffers.items():
                shadow._buffers[local] = buf
                if local in sub._non_persistent_buffers_set:
                    shadow._non_persistent_buffers_set.add(local)

        def _distribute(self, names: Sequence[str], src: Any) -> Any:
            """The DTensor parameter of ``src`` (known by ``names``), laid out as its first reader's
            configuration asks (replicated when no operator reads it)."""
            uses = next((self.info.param_uses[n] for n in names if n in self.info.param_uses), ())
            if uses:
                pl = self.layouts.placements(uses[0][0], uses[0][1], src.dim())
            else:
                pl = tuple(Replicate() for _ in range(self.mesh.ndim))
            zero3 = any(n in self._zero3 for n in names)
            tile = pl
            if zero3:
                pl = zero3_placements(pl, tuple(src.shape), tuple(self.mesh.mesh.shape))
            value = src.detach().clone()
            master = (self.choices.master_weights and value.is_floating_point() and value.element_size() < 4)
            if master:  # the float32 master copy (exact: every 16-bit float is a float32)
                value = value.float()
            dt = distribute_tensor(value, self.mesh, list(pl), src_data_rank=None)
            par = nn.Parameter(dt, requires_grad=src.requires_grad)
            if master:
                self._compute[id(par)] = src.dtype
            self.param_placements[names[0]] = pl
            if src.requires_grad:  # a ZeRO-2 parameter's gradient is reduce-scattered to its shard
                zero2 = any(n in self._zero2 for n in names)
                grad_pl = zero3_placements(pl, tuple(src.shape), tuple(self.mesh.mesh.shape)) if zero2 else pl
                axes = self.layouts.axes[uses[0][0]] if uses else (None,) * self.mesh.ndim
                self._grad_axes[names[0]] = axes
                par.register_hook(self._grad_hook(tuple(grad_pl), defer=not zero2 and not zero3, axes=axes,
                                                  dtype=src.dtype if master else None))
            if zero3:
                self._sharded.add(id(par))
                if uses and uses[0][0] in self.choices.offload_params and self._offloadable(names, tile, pl):
                    self._homes[id(par)] = (par, _to(par._local_tensor.detach(), "cpu"))
                    self._release(par)
            return par

        def _offloadable(self, names: Sequence[str], tile: Sequence[Any], shard: Sequence[Any]) -> bool:
            """Whether a ZeRO-3 parameter's shard can live in host memory between its uses: it is cut further than
            its tile (every reader gathers it, and autograd keeps the regathered reference, never the shard),
            and every node that reads it is an operator that does not recompute (a view of it, or a
            checkpointed segment, would keep or read the shard itself)."""
            if tuple(tile) == tuple(shard):
                return False
            ep = self.info.program
            phs = {s.arg.name for s in ep.graph_signature.input_specs
                   if s.kind == InputKind.PARAMETER and s.target in set(names)}
            for node in ep.graph.nodes:
                if node.op == "placeholder" and node.name in phs:
                    for user in node.users:
                        op = self.info.node_op.get(user.name)
                        if op is None or op in self.choices.recompute or user.name in self.info.const_nodes:
                            return False
            return True

        def _release(self, par: Any) -> None:
            """Free the device memory of an offloaded parameter's shard (its values stay in its home)."""
            release_storage(par._local_tensor)

        def _fetch(self, par: Any) -> None:
            """Bring an offloaded parameter's shard back from its home (a copy into fresh device memory)."""
            fetch_home(par._local_tensor, self._homes[id(par)][1])

        def offloaded_parameters(self) -> dict[str, Any]:
            """Parameter name -> the host tensor holding its shard between uses, for the parameters the plan
            keeps in host memory (:attr:`RunChoices.offload_params`; a parameter read through a view, one
            whose readers recompute, or one not cut further than its tile stays on the device). Between steps
            their device shards hold no memory: read their values here; :meth:`optimizer` steps them here."""
            ids = {id(p): n for n, p in self.named_parameters()}
            return {ids[k]: home for k, (_, home) in self._homes.items() if k in ids}

        def _flatten_groups(self, graph: Graph, layouts: Mapping[str, Any], factors: Sequence[int]) -> None:
            """Flatten the mesh axes of every dimension a layout splits over several axes (:func:`flat_groups`),
            so that DTensor reduces, scatters and gathers it in one collective among all its devices, as the
            tables charge. Every rank flattens the same groups in the same order (each makes process groups)."""
            names = self.mesh.mesh_dim_names
            rows = [mesh_dims(layouts[o.name], factors, o.name) for o in graph.operators]
            for group in flat_groups(rows):
                self.mesh[tuple(names[i] for i in group)]._flatten()

        def _grad_hook(self, placements: tuple[Any, ...], defer: bool = False,
                       axes: Sequence[str | None] = (), dtype: Any = None) -> Any:
            """A parameter's gradient hook: each backward pass's gradient redistributed to ``placements`` (the
            tile's; a ZeRO-2 or 3 parameter's shard: a reduce-scatter per micro-batch). With ``defer`` (a ZeRO-0
            or 1 parameter), while a step accumulates micro-batches (``_accumulating``), the partial sums over the
            axes that replicate the tile stay partial (no communication): :meth:`reduce_grads` reduces their
            sum once, after the step's last micro-batch. ``dtype``: a master weight's compute dtype, the one its
            gradient is reduced in (:func:`_reduce_in`)."""
            def hook(g: Any) -> Any:
                if not isinstance(g, DTensor):
                    return g
                target = tuple(placements)
                if defer and self._accumulating:
                    target = tuple(q if q.is_partial() and pl.is_replicate() else pl
                                   for q, pl in zip(g.placements, placements))
                return _reduce_in(g, self.mesh, target, axes or (None,) * len(target), dtype)
            return hook

        def compute_copy(self, par: Any) -> Any:
            """``par`` as the module's program reads it: under master weights (:attr:`RunChoices.master_weights`)
            its copy cast to the module's own dtype, whose backward (a cast back) brings the gradient to the
            float32 master; ``par`` itself otherwise. The cast is elementwise: the copy keeps ``par``'s
            placements, so a ZeRO-3 parameter's gathers move the compute dtype's bytes."""
            dtype = self._compute.get(id(par))
            if dtype is None:
                return par
            copy = par.to(dtype)
            if id(par) in self._sharded:
                self._sharded_copies[id(copy)] = copy
            return copy

        def reduce_grads(self, shards: Any = frozenset()) -> None:
            """Reduce the gradients a step left partial (:meth:`_grad_hook`: a ZeRO-0 or 1 parameter's, summed
            locally over the micro-batches): into the parameter's tile, an all-reduce over its replicas, or, for
            the parameters named in ``shards`` (a pipeline stage's ZeRO-1 parameters), into the tile cut
            further over its replicas (:func:`zero3_placements`, the master shard's placements), a
            reduce-scatter. One collective per parameter and step, what the cost tables charge ZeRO-0 and 1."""
            shape = tuple(self.mesh.mesh.shape)
            with torch.no_grad():
                for name, p in self.named_parameters():
                    g = p.grad
                    if not isinstance(g, DTensor) or not any(q.is_partial() for q in g.placements):
                        continue
                    tile = tuple(p.placements)
                    target = zero3_placements(tile, tuple(p.shape), shape) if name in shards else tile
                    p.grad = _reduce_in(g, self.mesh, target, self._grad_axes.get(name, (None,) * len(target)),
                                        self._compute.get(id(p)))

        def optimizer(self, cls: Any, **options: Any) -> Any:
            """``cls(self.parameters(), **options)`` (a ``torch.optim`` class), with the parameters of the
            operators whose optimizer state the plan keeps in host memory
            (:attr:`RunChoices.offload_optimizer`, by their first reader) stepped there: a
            :class:`~shardplan.torch.precision.HostOptimizer` when there are any."""
            named = list(self.named_parameters())
            host = self.host_state()
            homes = {k: home for k, (_, home) in self._homes.items()}
            if not any(n in host for n, _ in named):
                return cls([p for _, p in named], **options)
            return HostOptimizer([p for n, p in named if n in host], cls,
                                 device_params=[p for n, p in named if n not in host], homes=homes, **options)

        def host_state(self) -> frozenset[str]:
            """The parameters (by name) whose optimizer state lives in host memory: those whose first reader
            offloads it (:attr:`RunChoices.offload_optimizer`), and those that live there themselves
            (:meth:`offloaded_parameters`: stepped where they live)."""
            owners = self.choices.offload_optimizer
            host = {t for t, uses in self.info.param_uses.items() if uses and uses[0][0] in owners}
            return frozenset(host | {n for n, p in self.named_parameters() if id(p) in self._homes})

        def dparameter(self, target: str) -> Any:
            """The DTensor parameter for ``target`` (the original module's parameter name)."""
            return self.get_parameter(target)

        def named_dparameters(self) -> dict[str, Any]:
            """Original parameter name -> DTensor parameter, every name of a tied parameter included."""
            return dict(self.named_parameters(remove_duplicate=False))

        def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
            """Load a state dict keyed by the original module's names (as :meth:`state_dict` gives).

            A parameter's value may be a full ``torch.Tensor`` (every rank
            passes the same; each keeps its planned shard) or a DTensor (laid
            out again as planned: redistributed on this mesh, else gathered
            and split). Values are copied into the parameters, which keep
            their placements and gradient hooks; ``assign=True`` would replace
            them, so it is refused.
            """
            if assign:
                raise ShardplanError("load_state_dict(assign=True) would replace the planned DTensor parameters; "
                                     "load with assign=False (values are copied into them)")
            params = dict(self.named_parameters(remove_duplicate=False))
            placed = {k: self._placed(v, params[k]) if k in params and isinstance(v, torch.Tensor) else v
                      for k, v in state_dict.items()}
            return super().load_state_dict(placed, strict=strict)

        def _placed(self, value: Any, par: Any) -> Any:
            """``value`` as a DTensor with ``par``'s mesh and placements (unchanged when its shape differs,
            so that ``load_state_dict`` reports the mismatch)."""
            if tuple(value.shape) != tuple(par.shape):
                return value
            if isinstance(value, DTensor):
                if value.device_mesh == par.device_mesh:
                    return _redistribute(value.detach(), par.device_mesh, par.placements)
                value = value.full_tensor()
            return distribute_tensor(value.detach(), par.device_mesh, list(par.placements), src_data_rank=None)

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            """The module's outputs on the whole batch (recomputed operators under checkpoint).

            Raises:
                ShardplanError: the plan accumulates gradients over micro-batches and gradients are
                    being recorded (run :meth:`step`, or call under ``torch.no_grad()``).
            """
            if self.micro_batches > 1 and torch.is_grad_enabled():
                raise ShardplanError(f"this plan accumulates gradients over {self.micro_batches} micro-batches: "
                                     "call step(*inputs) for a forward and backward pass (or the module under "
                                     "torch.no_grad() for the outputs alone)")
            if not self._stepping and self.scaling is not None:  # a call is a step: the last one's amaxes go in
                self.scaling.commit()
            return self._run(self._full, args, kwargs)

        def delayed_scaling(self, length: int = AMAX_HISTORY) -> Any:
            """Run the FP8 products with delayed scaling (the default) from now on, with fresh amax histories of
            ``length`` steps (:class:`~shardplan.torch.precision.DelayedScaling`; each call of the module or of
            :meth:`step` is a step); returns the module."""
            self.scaling = DelayedScaling(length)
            return self

        def current_scaling(self) -> Any:
            """Run the FP8 products with current scaling from now on (each cast scaled by its own tensor's amax, no
            state); returns the module."""
            self.scaling = None
            return self

        def step(self, *args: Any, **kwargs: Any) -> Any:
            """One forward and backward pass of the batch as planned; the loss, detached.

            With k micro-batches (:func:`micro_batch`: batch rows i, i + k, ...)
            the module must return a scalar loss that is a mean of per-example
            terms over the batch (no statistic across the batch, such as a
            training BatchNorm's): the step's loss is (1/k) sum_i loss_i and each
            micro-batch adds the gradient of loss_i / k to ``param.grad``, so the
            gradients are those of the whole batch's mean. With one
            micro-batch it is ``loss = module(*args); loss.backward()``. A
            parameter's gradient that is a sum over its replicas (ZeRO-0) is
            summed locally over the micro-batches and all-reduced once, after the
            last (:meth:`reduce_grads`), as the cost tables charge it.
            """
            k = self.micro_batches
            total = None
            if self.scaling is not None:
                self.scaling.commit()
            self._accumulating = True
            try:
                for i in range(k):
                    a, kw = micro_batch(args, kwargs, i, k) if k > 1 else (list(args), dict(kwargs))
                    loss = self._run(self._micro, a, kw)
                    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                        raise ShardplanError("step needs a module that returns a scalar loss")
                    (loss / k if k > 1 else loss).backward()
                    total = loss.detach() if total is None else total + loss.detach()
            finally:
                self._accumulating = False
            self.reduce_grads()
            return total / k

        def _run(self, prog: Program, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
            """Run ``prog`` node by node on DTensors (recomputed segments under ``torch.utils.checkpoint``)."""
            from torch.utils import _pytree as pytree
            from torch.utils.checkpoint import checkpoint

            ep = prog.info.program
            flat, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
            if spec != ep.call_spec.in_spec:
                raise ShardplanError(f"arguments have structure {spec}, the traced module had {ep.call_spec.in_spec}")
            env: dict[str, Any] = {}
            user = iter(flat)
            buffers = dict(self.named_buffers(remove_duplicate=False))
            for par, _ in self._homes.values():  # offloaded shards: on the device for the forward pass
                self._fetch(par)
            for s in ep.graph_signature.input_specs:
                name = s.arg.name if hasattr(s.arg, "name") else None
                if s.kind == InputKind.PARAMETER:
                    env[name] = self.compute_copy(self.dparameter(s.target))
                elif s.kind == InputKind.BUFFER:
                    env[name] = buffers[s.target] if s.target in buffers else ep.state_dict[s.target]
                elif s.kind == InputKind.CONSTANT_TENSOR:
                    env[name] = ep.constants[s.target]
                elif s.kind == InputKind.USER_INPUT:
                    x = next(user)
                    if isinstance(x, torch.Tensor) and name is not None:
                        pl = self._input_placements(prog, name, x.dim())
                        if pl is not None and x.requires_grad:  # a pipeline stage's input: differentiable
                            x = DTensor.from_local(x, self.mesh, [Replicate()] * self.mesh.ndim,
                                                   run_check=False).redistribute(self.mesh, list(pl))
                        elif pl is not None:
                            x = distribute_tensor(x, self.mesh, list(pl), src_data_rank=None)
                    if name is not None:
                        env[name] = x
                else:
                    if name is not None:
                        env[name] = None
            result = None
            gm = ep.graph_module
            for item in prog.items:
                if isinstance(item, Segment):
                    outs = checkpoint(self._segment_fn(prog, item), *[env[n] for n in item.inputs],
                                      use_reentrant=False)
                    env.update(zip(item.outputs, outs))
                    continue
                node = item
                if node.op == "placeholder":
                    continue
                if node.op == "get_attr":
                    obj = gm
                    for part in str(node.target).split("."):
                        obj = getattr(obj, part)
                    env[node.name] = obj
                    continue
                if node.op == "output":
                    result = _tree_map(lambda a: env[a.name] if isinstance(a, torch.fx.Node) else a, node.args[0])
                    break
                env[node.name] = self._run_node(prog, node, env, regather=True)
            for par, _ in self._homes.values():  # ... and back in host memory until the backward regathers them
                self._release(par)
            outs = _tree_map(lambda x: x.full_tensor() if isinstance(x, DTensor) else x, list(result))
            return pytree.tree_unflatten(outs, ep.call_spec.out_spec)

        def _segment_fn(self, prog: Program, seg: Segment) -> Any:
            """``seg`` as a function of its inputs' values to its outputs' (what ``checkpoint`` runs twice)."""
            def run(*values: Any) -> tuple[Any, ...]:
                env = dict(zip(seg.inputs, values))
                for node in seg.nodes:
                    env[node.name] = self._run_node(prog, node, env, regather=False)
                return tuple(env[n] for n in seg.outputs)
            return run

        def _input_placements(self, prog: Program, name: str, rank: int) -> tuple[Any, ...] | None:
            uses = prog.info.input_uses.get(name, ())
            if not uses:
                return None
            return prog.layouts.placements(uses[0][0], uses[0][1], rank)

        def _run_node(self, prog: Program, node: Any, env: dict[str, Any], regather: bool) -> Any:
            """One FX node on DTensors; ``regather``: a ZeRO-3 parameter's gathered copy is not saved for
            the backward pass but gathered again there (inside a checkpointed segment nothing is saved)."""
            import contextlib

            info, lay = prog.info, prog.layouts
            read = lambda a: env[a.name] if isinstance(a, torch.fx.Node) else a  # noqa: E731
            args = [_tree_map(read, a) for a in node.args]
            kwargs = {k: _tree_map(read, v) for k, v in node.kwargs.items()}
            fn = node.target
            if str(fn) in _CHECKS:  # export's metadata checks: nothing to compute (and nothing to gather)
                return None
            if node.name in info.const_nodes or fn is _pyop.getitem:
                out = _REWRITES.get(str(fn), fn)(*args, **kwargs)
                if str(fn) in _FUNCTIONAL and isinstance(node.args[0], torch.fx.Node):
                    env[node.args[0].name] = out  # the in-place op's destination now holds its result
                return out
            op_name = info.node_op.get(node.name)
            gathered: list[tuple[Any, Any]] = []
            ring = (self.choices.ring and str(fn) == SDPA and op_name is not None and ring_applies(
                lay.placements(op_name, "q", 4), [_get(args, kwargs, path) for path, t in info.operands[op_name]
                                                  if t in ("k", "v")]))
            fp8 = fp8_operands(prog.graph[op_name]) if op_name in self.choices.fp8 else frozenset()
            if op_name is not None:
                inputs = {t.name for t in prog.graph[op_name].inputs}  # activations: their gradients, dim by dim
                for path, tname in info.operands.get(op_name, ()):
                    x = _get(args, kwargs, path)
                    if isinstance(x, DTensor):
                        want = lay.placements(op_name, tname, x.dim())
                        if ring and tname in ("k", "v"):
                            want = ring_kv_placements(lay.placements(op_name, "q", 4), want)
                        y = _redistribute(x, self.mesh, want)
                        t = lay.tensor(op_name, tname)
                        if tname in inputs and len(summed_dims(t, lay.axes[op_name])) > 1:
                            y = _grad_by_dim(y, self.mesh, x.placements, lay.axes[op_name])
                        _set(args, kwargs, path, y)
                        if (id(x) in self._sharded or id(x) in self._sharded_copies) and y is not x:
                            gathered.append((x, y))
                    if tname in fp8 and isinstance(x, torch.Tensor) and x.is_floating_point():
                        _set(args, kwargs, path, fp8_cast(_get(args, kwargs, path), self.scaling,
                                                          f"{op_name}:{tname}"))
            fn = _REWRITES.get(str(fn), fn)
            if ring:
                fn = functools.partial(ring_sdpa, fallback=fn)
            elif str(node.target) == SDPA and op_name in self.choices.dealt:
                fn = functools.partial(gather_sdpa, fallback=fn)
            if str(node.target) == SDPA and op_name is not None and prog.graph[op_name].causal is not None:
                fn = _as_causal(fn)
            if _has_dtensor(args) or _has_dtensor(kwargs):
                rep = lambda x: self._replicate(x) if isinstance(x, torch.Tensor) else x  # noqa: E731
                args = [_tree_map(rep, a) for a in args]
                kwargs = {k: _tree_map(rep, v) for k, v in kwargs.items()}
            offload = regather and op_name in self.choices.offload  # not inside a recomputed segment
            if gathered and regather:
                pack, unpack = self._regather_hooks(gathered)
                if offload:
                    pack, unpack = _offloaded(pack, unpack, self.host)
                hooks: Any = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
            else:
                hooks = self.host.hooks() if offload else contextlib.nullcontext()
            with hooks:
                try:
                    if str(fn) in _CONV and isinstance(args[0], DTensor):
                        out = self._batch_local_call(fn, args, kwargs)
                    else:
                        with implicit_replication():
                            out = fn(*args, **kwargs)
                except NotImplementedError as e:
                    if "sharding strategy" not in str(e) and "DTensor" not in str(e):
                        raise
                    local = None if op_name is None or op_name in info.conservative else local_placements(
                        lay, op_name, args, kwargs, [_get(args, kwargs, path) for path, _ in info.operands[op_name]])
                    out = (self._replicated_call(fn, args, kwargs) if local is None else
                           self._local_call(fn, args, kwargs, *local))
            if fp8:
                out = fp8_grad(out, self.scaling, f"{op_name}:dY")
            if op_name is not None and isinstance(out, DTensor):
                out = _reduce_redistribute(out, self.mesh, lay.output(op_name, out.dim()), lay.axes[op_name])
            if str(node.target) in _FUNCTIONAL and isinstance(node.args[0], torch.fx.Node):
                env[node.args[0].name] = out  # the in-place op's destination now holds its result
            return out

        def _regather_hooks(self, gathered: Sequence[tuple[Any, Any]]) -> tuple[Any, Any]:
            """Saved-tensor hooks that keep, instead of a gathered ZeRO-3 parameter (or a view of it),
            the sharded parameter and the view, and gather it again when the backward pass reads it."""
            by_ptr = {y._local_tensor.untyped_storage().data_ptr(): (x, tuple(y.placements)) for x, y in gathered
                      if y._local_tensor.numel()}

            def pack(t: Any) -> Any:
                local = t._local_tensor if isinstance(t, DTensor) else t
                if not isinstance(local, torch.Tensor) or not local.numel():
                    return t
                hit = by_ptr.get(local.untyped_storage().data_ptr())
                if hit is None:
                    return t
                spec = (tuple(t.placements), tuple(t.shape), tuple(t.stride())) if isinstance(t, DTensor) else None
                return _Regather(hit[0], hit[1], tuple(local.shape), tuple(local.stride()), local.storage_offset(),
                                 spec)

            def unpack(t: Any) -> Any:
                if not isinstance(t, _Regather):
                    return t
                home = id(t.param) in self._homes
                if home:
                    self._fetch(t.param)
                with torch.no_grad():
                    full = t.param.detach().redistribute(self.mesh, list(t.placements)).to_local()
                if home:  # the gathered copy is new memory: the shard goes back to the host
                    self._release(t.param)
                local = full.as_strided(t.size, t.stride, t.offset)
                if t.spec is None:
                    return local
                pl, shape, stride = t.spec
                return DTensor.from_local(local, self.mesh, list(pl), run_check=False, shape=shape, stride=stride)
            return pack, unpack

        def _batch_local_call(self, fn: Any, args: list, kwargs: dict) -> Any:
            """A convolution on a batch-split input: local convolution with replicated weights.

            DTensor's convolution handler fails when the batch is split over
            more than one mesh axis; this does the same computation directly.
            The weights' gradients are partial sums over the axes splitting the batch.
            """
            from torch.distributed.tensor import Partial

            x = args[0]
            if any(pl.is_shard() and pl.dim != 0 or pl.is_partial() for pl in x.placements):
                raise ShardplanError(f"{fn}: only a batch-split input can run locally, got {x.placements}")
            grad_pl = [Partial() if pl.is_shard() else Replicate() for pl in x.placements]
            local = [x.to_local()]
            for a in args[1:]:
                if isinstance(a, DTensor):
                    a = a.redistribute(self.mesh, [Replicate()] * self.mesh.ndim).to_local(grad_placements=grad_pl)
                local.append(a)
            out = fn(*local, **kwargs)
            return DTensor.from_local(out, self.mesh, list(x.placements), run_check=False)

        def _replicate(self, x: Any) -> Any:
            """A plain tensor (a constant) as a replicated DTensor, so that backward never mixes the two."""
            if isinstance(x, DTensor):
                return x
            return DTensor.from_local(x, self.mesh, [Replicate()] * self.mesh.ndim, run_check=False)

        def _local_call(self, fn: Any, args: list, kwargs: dict, grads: Mapping[int, tuple[Any, ...]],
                        out_pl: tuple[Any, ...]) -> Any:
            """An operator on each device's tiles (:func:`local_placements`): each DTensor operand's local shard,
            its gradient placed as ``grads`` says; the result's tiles as one DTensor laid out ``out_pl``."""
            def local(x: Any) -> Any:
                return x.to_local(grad_placements=list(grads[id(x)])) if isinstance(x, DTensor) else x
            out = fn(*[_tree_map(local, a) for a in args], **{k: _tree_map(local, v) for k, v in kwargs.items()})
            wrap = lambda x: DTensor.from_local(x, self.mesh, list(out_pl), run_check=False) \
                if isinstance(x, torch.Tensor) else x  # noqa: E731
            return _tree_map(wrap, out)

        def _replicated_call(self, fn: Any, args: list, kwargs: dict) -> Any:
            """Run an operator DTensor cannot shard: gather the operands, compute everywhere, wrap replicated."""
            full = lambda x: x.full_tensor() if isinstance(x, DTensor) else x  # noqa: E731
            out = fn(*[_tree_map(full, a) for a in args], **{k: _tree_map(full, v) for k, v in kwargs.items()})
            rep = [Replicate()] * self.mesh.ndim
            wrap = lambda x: DTensor.from_local(x, self.mesh, rep, run_check=False) \
                if isinstance(x, torch.Tensor) else x  # noqa: E731
            return _tree_map(wrap, out)

    return _ParallelModule
