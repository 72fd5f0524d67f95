"""What PyTorch's autograd keeps for the backward pass of a traced program (:attr:`shardplan.ir.Operator.saved`).

The activations a training step holds at the start of its backward pass are the tensors autograd saved during
the forward pass: for each recorded operation, what its derivative formula reads (``derivatives.yaml``): a
product keeps its operands, ``tanh`` and ``exp`` their results, a layer norm its input and per-row
statistics, an addition or a reshape nothing. A tensor is memory through its *storage*: a view (reshape,
transpose, slice, a split's parts, ``expand``) shares the storage of its base, so keeping a view keeps the
whole base, and a storage kept by several operations is held once.

The description follows that exactly, per FX node of the exported program (:func:`kept_by_node`):

* which of the node's operands and results its backward keeps, and the bytes of the new tensors it keeps
  (a layer norm's mean and rstd, the log-softmax inside a cross-entropy), found by running the node's ATen
  operator once on ``meta`` tensors of the traced shapes, strides, dtypes and ``requires_grad`` under
  :func:`torch.autograd.graph.saved_tensors_hooks` (no data, no kernel: the operator's autograd formula
  records what it saves); where the accelerator runs another kernel than the meta device's decomposition,
  the accelerator's (CUDA's) saving is stated instead (:data:`DEVICE_RULES`): ``dropout`` keeps a one-byte
  mask (``native_dropout``), ``rms_norm`` its input and a float32 rstd per row (``_fused_rms_norm``), and
  ``scaled_dot_product_attention`` (the fused kernels) keeps q, k, v, its mask and what its handler states
  of its own (:attr:`~shardplan.ir.Operator.saved` of its operator: output and log-sum-exp);
* which storage each result lives in: an operand's (a view, an in-place update, a no-op cast) or a new one
  of the result's bytes.

Then (:func:`saved_tiles`) every kept storage is held once and charged to the operator that made it (an
identity node's copy, a ``.float()`` or a ``.contiguous()``, belongs to the operator whose value it copies);
one no operator made (a user input kept by an embedding, a constant mask or rotary table) is split equally
over the operators that keep it (every layer's share of a rotary table the same, so repeated layers stay
alike); parameters are not activations and are left out. An operator's ``saved`` is
its charge in output tiles of the model's precision (the dtype of most of its floating parameters): a
float32 copy of a bfloat16 output is 2 tiles, a boolean mask 1/2. The sum of ``saved`` times the output
bytes over the operators is then the bytes autograd holds, which :func:`measure` checks by running the
program on real tensors.
"""

from __future__ import annotations

import math
import operator as _pyop
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["DEVICE_RULES", "Measured", "NodeKeeps", "eager_saved_bytes", "kept_by_node", "measure", "reference_bytes",
           "saved_tiles"]


@dataclass(frozen=True)
class NodeKeeps:
    """What autograd keeps when one FX node runs, and where its results live.

    Attributes:
        operands: names of the operand nodes whose storage the backward keeps.
        results: indices of the node's results it keeps (0 for a single tensor).
        own_bytes: bytes of the new tensors it keeps besides its operands and results.
        alias: per result, the operand node whose storage it shares (a view), or None (a new storage).
        result_bytes: per result, the bytes of its storage.
    """

    operands: tuple[str, ...]
    results: tuple[int, ...]
    own_bytes: float
    alias: tuple[str | None, ...]
    result_bytes: tuple[float, ...]


def _tensors(x: Any) -> list[Any]:
    """The tensors of a result (a tensor, or a tuple/list of tensors and Nones), by position."""
    import torch

    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t if isinstance(t, torch.Tensor) else None for t in x]
    return []


def _storage(t: Any) -> int:
    return int(t.untyped_storage()._cdata)


def _meta_like(val: Any, grad: bool, fresh: bool) -> Any:
    """A meta tensor with ``val``'s shape, strides and dtype; ``grad``: it requires a gradient (a non-leaf when
    ``fresh``, for in-place operators, which autograd refuses on a leaf)."""
    import torch

    t = torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=val.dtype, device="meta")
    if grad and (val.dtype.is_floating_point or val.dtype.is_complex):
        t.requires_grad_(True)
        if fresh:
            t = t.clone()
    return t


def _probe(fn: Callable[..., Any], args: Any, kwargs: Mapping[str, Any], operands: Mapping[int, str]) -> NodeKeeps:
    """Run ``fn(*args, **kwargs)`` on meta tensors under saved-tensor hooks; ``operands``: storage id of each
    meta operand -> its node name."""
    import torch

    packed: list[Any] = []

    def pack(t: Any) -> Any:
        packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args, **kwargs)
    outs = _tensors(out)
    out_ids = {(_storage(t)): i for i, t in reversed(list(enumerate(outs))) if t is not None}
    keep_in: dict[str, None] = {}
    keep_out: dict[int, None] = {}
    own: dict[int, float] = {}
    for t in packed:
        s = _storage(t)
        if s in operands:
            keep_in[operands[s]] = None
        elif s in out_ids:
            keep_out[out_ids[s]] = None
        else:
            own[s] = float(t.untyped_storage().nbytes())
    alias = tuple(operands.get(_storage(t)) if t is not None else None for t in outs)
    nbytes = tuple(float(t.untyped_storage().nbytes()) if t is not None else 0.0 for t in outs)
    return NodeKeeps(tuple(keep_in), tuple(keep_out), sum(own.values()), alias, nbytes)


# ---------------------------------------------------------------------------------------------------------------
# the accelerator's kernels where the meta device decomposes differently
# ---------------------------------------------------------------------------------------------------------------

Rule = Callable[[Any, Sequence[Any], Mapping[str, bool], Any, int], NodeKeeps]


def _rows(shape: Sequence[int], normalized: int) -> int:
    return math.prod(shape[:len(shape) - normalized])


def _result_bytes(node: Any) -> tuple[float, ...]:
    return tuple(float(t.numel() * t.element_size()) if t is not None else 0.0
                 for t in _tensors(node.meta.get("val")))


def _grad_operands(node: Any, grads: Mapping[str, bool], positions: Sequence[int]) -> tuple[str, ...]:
    """The operand nodes at ``positions`` of ``node.args`` (those that are nodes), when any operand needs a
    gradient (autograd records nothing otherwise)."""
    import torch

    nodes = [node.args[i] for i in positions if i < len(node.args) and isinstance(node.args[i], torch.fx.Node)]
    if not any(grads.get(n.name, False) for n in node.all_input_nodes):
        return ()
    return tuple(dict.fromkeys(n.name for n in nodes))


def _dropout_rule(node: Any, args: Sequence[Any], grads: Mapping[str, bool], op: Any, ref_bytes: int) -> NodeKeeps:
    """``dropout(x, p, train)`` as CUDA runs it, ``native_dropout``: a new result and a one-byte mask per element
    kept (the CPU's ``x * noise`` keeps the noise in ``x``'s dtype instead). Inactive (``p = 0`` or eval) it is
    ``x`` itself. Source: PyTorch's ``aten/src/ATen/native/Dropout.cpp`` (``is_fused_kernel_acceptable``: a
    CUDA input with 0 < p < 1 runs ``native_dropout``, whose derivative formula keeps its boolean mask)."""
    x = node.args[0]
    p = float(args[1]) if len(args) > 1 else 0.5
    train = bool(args[2]) if len(args) > 2 else True
    if not (train and p > 0.0):
        return NodeKeeps((), (), 0.0, (x.name,), _result_bytes(node))
    grad = grads.get(x.name, False)
    return NodeKeeps((), (), float(x.meta["val"].numel()) if grad else 0.0, (None,), _result_bytes(node))


def _rms_norm_rule(node: Any, args: Sequence[Any], grads: Mapping[str, bool], op: Any, ref_bytes: int) -> NodeKeeps:
    """``rms_norm(x, shape, w, eps)`` as CUDA runs it, ``_fused_rms_norm``: keeps ``x``, ``w`` and a float32
    rstd per normalised row. Source: PyTorch's ``aten/src/ATen/native/layer_norm.cpp`` (``rms_norm`` calls the
    fused kernel on CUDA) and ``derivatives.yaml`` (``_fused_rms_norm`` keeps input, rstd, weight); not
    measured here (Hugging Face's models write their RMSNorm out, which is probed)."""
    kept = _grad_operands(node, grads, (0, 2))
    rows = _rows(tuple(node.args[0].meta["val"].shape), len(args[1]))
    return NodeKeeps(kept, (), 4.0 * rows if kept else 0.0, (None,), _result_bytes(node))


def _sdpa_rule(node: Any, args: Sequence[Any], grads: Mapping[str, bool], op: Any, ref_bytes: int) -> NodeKeeps:
    """``scaled_dot_product_attention(q, k, v, mask)`` as the fused kernels run it (FlashAttention, memory-efficient,
    cuDNN): keeps q, k, v, the mask, and of its own what its operator ``op`` states (``op.saved`` output
    tiles of ``ref_bytes``-byte elements: output and log-sum-exp), never the probabilities (the meta device
    runs the math decomposition, which keeps them). A mask the operator describes as causal
    (:attr:`~shardplan.ir.Operator.causal`: ``is_causal``, or a constant mask that keeps key <= query) runs
    as ``is_causal``: nothing of it is kept. A boolean mask is first made an additive one in q's dtype
    (``convert_boolean_attn_mask``, every backend): that new tensor of the mask's shape is kept, not the mask.
    Sources: PyTorch's ``aten/src/ATen/native/transformers/attention.cpp``; on the H100 (PyTorch 2.11, GPT-2
    124M, ``benchmarks/results/torch_memory_device.json``) the flash kernel kept q, k, v, its output and a
    float32 log-sum-exp per query row, and no probabilities."""
    import torch

    kept = _grad_operands(node, grads, (0, 1, 2, 3))
    res = _result_bytes(node)
    if not kept:
        return NodeKeeps((), (), 0.0, (None,), res)
    own = float(op.saved) * math.prod(op.output.shape) * ref_bytes if op is not None else res[0]
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    val = getattr(mask, "meta", {}).get("val")
    if isinstance(mask, torch.fx.Node) and op is not None and op.causal is not None and not grads.get(mask.name):
        kept = tuple(n for n in kept if n != mask.name)
    elif val is not None and val.dtype == torch.bool:
        kept = tuple(n for n in kept if n != mask.name)
        own += float(val.numel() * node.args[0].meta["val"].element_size())
    if own >= res[0]:  # the output among what it keeps: charged once, with every other keeper of it
        return NodeKeeps(kept, (0,), own - res[0], (None,), res)
    return NodeKeeps(kept, (), own, (None,), res)


DEVICE_RULES: Mapping[str, Rule] = {
    "aten.dropout.default": _dropout_rule,
    "aten.rms_norm.default": _rms_norm_rule,
    "aten.scaled_dot_product_attention.default": _sdpa_rule,
}


def _fallback(node: Any, grads: Mapping[str, bool]) -> NodeKeeps:
    """An operator that cannot run on meta tensors: every tensor operand and result kept (a bound from above),
    its results new storages; a region run without gradients (``torch.no_grad()``, captured as
    ``wrap_with_set_grad_enabled(False, ...)``) keeps nothing."""
    import torch

    ins = tuple(dict.fromkeys(n.name for n in node.all_input_nodes
                              if isinstance(n.meta.get("val"), torch.Tensor)))
    no_grad = str(node.target).endswith("wrap_with_set_grad_enabled") and node.args and node.args[0] is False
    if no_grad or not any(grads.get(n, False) for n in ins):
        return NodeKeeps((), (), 0.0, tuple(None for _ in _result_bytes(node)), _result_bytes(node))
    res = _result_bytes(node)
    return NodeKeeps(ins, tuple(range(len(res))), 0.0, tuple(None for _ in res), res)


def _meta_args(node: Any, grads: Mapping[str, bool], inplace: bool) -> tuple[Any, Any, dict[int, str]]:
    """``node``'s arguments with a meta tensor for each tensor operand (one per operand node; a device made the
    meta device), and the storage id of each -> its node name."""
    import torch

    metas: dict[str, Any] = {}
    operands: dict[int, str] = {}

    def meta(a: Any) -> Any:
        if isinstance(a, torch.device):  # a cast or a new tensor "to the device": to the meta device
            return torch.device("meta")
        if not isinstance(a, torch.fx.Node):
            return a
        v = a.meta.get("val")
        if not isinstance(v, torch.Tensor):
            return v
        if a.name not in metas:
            metas[a.name] = _meta_like(v, grads.get(a.name, False), inplace)
            operands[_storage(metas[a.name])] = a.name
        return metas[a.name]

    return torch.fx.node.map_aggregate(node.args, meta), torch.fx.node.map_aggregate(node.kwargs, meta), operands


def kept_by_node(graph: Any, grads: Mapping[str, bool], ops: Mapping[str, Any] | None = None,
                 ref_bytes: int = 4) -> dict[str, NodeKeeps]:
    """:class:`NodeKeeps` of every ``call_function`` node of the FX ``graph`` that reads a node.

    ``grads``: node name -> whether its value needs a gradient (parameters that train, values computed from
    them); ``ops``: node name -> the operator its handler described (read by the :data:`DEVICE_RULES` that need
    it: what the attention states it keeps of its own, in output tiles of ``ref_bytes``-byte elements).
    ``getitem`` nodes are the part of their tuple (no entry).
    """
    import torch

    ops = ops or {}
    out: dict[str, NodeKeeps] = {}
    for node in graph.nodes:
        if node.op != "call_function" or node.target is _pyop.getitem or not node.all_input_nodes:
            continue
        if not _tensors(node.meta.get("val")):
            continue
        target = str(node.target)
        if target in DEVICE_RULES:
            args = torch.fx.node.map_aggregate(node.args, lambda a: a.meta.get("val") if isinstance(a, torch.fx.Node)
                                               else a)
            out[node.name] = DEVICE_RULES[target](node, args, grads, ops.get(node.name), ref_bytes)
            continue
        if not isinstance(node.target, torch._ops.OpOverload):
            out[node.name] = _fallback(node, grads)
            continue
        inplace = node.target._schema.name.endswith("_")
        try:
            args, kwargs, operands = _meta_args(node, grads, inplace)
            out[node.name] = _probe(node.target, args, kwargs, operands)
        except Exception:  # noqa: BLE001  (no meta kernel, or one that refuses these arguments)
            out[node.name] = _fallback(node, grads)
    return out


def eager_saved_bytes(module: Any, args: Sequence[Any]) -> float:
    """Bytes of the distinct storages autograd saves when ``module(*args)`` runs eagerly, parameters left out
    (each storage once, under ``torch.autograd.graph.saved_tensors_hooks``): what a traced program's charge is
    held against."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    kept: dict[int, float] = {}

    def pack(t: Any) -> Any:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            kept[s.data_ptr()] = float(s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = module(*args)
    del loss
    return sum(kept.values())


def reference_bytes(module: Any) -> int:
    """Bytes per element of the model's precision: the dtype holding most of its floating parameters (4 when it
    has none)."""
    count: dict[int, int] = {}
    for p in module.parameters():
        if p.dtype.is_floating_point:
            count[p.element_size()] = count.get(p.element_size(), 0) + p.numel()
    return max(count, key=lambda k: count[k]) if count else 4


def _storages(graph: Any, keeps: Mapping[str, NodeKeeps]) -> dict[tuple[str, int], tuple[tuple[str, int], float]]:
    """(node, result index) -> (the node and result index that made its storage, that storage's bytes)."""
    import torch

    where: dict[tuple[str, int], tuple[str, float]] = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is _pyop.getitem and isinstance(node.args[0], torch.fx.Node):
            src = (node.args[0].name, int(node.args[1]))
            if src in where:
                if where[src][0] == src:  # a new tensor of a tuple result: its getitem's operator made it
                    where[src] = ((node.name, 0), where[src][1])
                where[(node.name, 0)] = where[src]
                continue
        k = keeps.get(node.name)
        vals = _tensors(node.meta.get("val"))
        for i, t in enumerate(vals):
            if t is None:
                continue
            if k is not None and i < len(k.alias) and k.alias[i] is not None and (k.alias[i], 0) in where:
                where[(node.name, i)] = where[(k.alias[i], 0)]
            elif k is not None and i < len(k.result_bytes):
                where[(node.name, i)] = ((node.name, i), k.result_bytes[i])
            else:
                where[(node.name, i)] = ((node.name, i), float(t.numel() * t.element_size()))
    return where


def _own_to(node: Any, own_bytes: float, mine: str | None, charge_to: Callable[[str], str | None],
            out_elements: Mapping[str, int], ref_bytes: int) -> str | None:
    """The operator charged with the new tensors ``node`` keeps of its own: its operator, unless they outgrow its
    output and an operand is larger than that output (a reduction: the log-softmax a cross-entropy keeps has
    its logits' shape), then the operator of its largest operand, so that the charge splits as that tensor
    does."""
    import torch

    if not own_bytes or mine is None or own_bytes <= out_elements.get(mine, 0) * ref_bytes:
        return mine
    sizes = [(v.numel(), n.name) for n in node.all_input_nodes
             if isinstance(v := n.meta.get("val"), torch.Tensor) and charge_to(n.name) is not None]
    if not sizes or max(sizes)[0] <= out_elements.get(mine, 0):
        return mine
    return charge_to(max(sizes)[1])


def _share(keepers: Mapping[Any, tuple[float, dict[str, None]]], charged: dict[str, float]) -> float:
    """Add to ``charged`` each storage's bytes split equally over the operators that keep it; the bytes no operator
    keeps are returned."""
    lost = 0.0
    for nbytes, ops_ in keepers.values():
        if not ops_:
            lost += nbytes
        for op in ops_:
            charged[op] = charged.get(op, 0.0) + nbytes / len(ops_)
    return lost


def saved_tiles(graph: Any, keeps: Mapping[str, NodeKeeps], charge_to: Callable[[str], str | None],
                params: frozenset[str], out_elements: Mapping[str, int], ref_bytes: int) -> dict[str, float]:
    """Per operator, what autograd keeps of it in output tiles of ``ref_bytes``-byte elements.

    ``charge_to``: node name -> the operator its value belongs to (None: a user input, constant or parameter);
    ``params``: the parameter placeholders (never charged); ``out_elements``: operator -> elements of its
    output. Every kept storage counts once, charged to the operator that made it, else split equally over the
    operators that keep it (a rotary table read by every layer: each layer's share the same); the new tensors
    a node keeps of its own are its operator's (:func:`_own_to`).
    """
    where = _storages(graph, keeps)
    charged: dict[str, float] = {}
    made: set[tuple[str, int]] = set()
    keepers: dict[tuple[str, int], tuple[float, dict[str, None]]] = {}
    for node in graph.nodes:
        k = keeps.get(node.name)
        if k is None:
            continue
        mine = charge_to(node.name)
        held = [where[(n, 0)] for n in k.operands if (n, 0) in where]
        held += [where[(node.name, i)] for i in k.results if (node.name, i) in where]
        for maker, nbytes in held:
            if maker[0] in params:
                continue
            owner = charge_to(maker[0])
            if owner is not None:
                if maker not in made:
                    made.add(maker)
                    charged[owner] = charged.get(owner, 0.0) + nbytes
                continue
            ops_ = keepers.setdefault(maker, (nbytes, {}))[1]
            if mine is not None:
                ops_[mine] = None
        to = _own_to(node, k.own_bytes, mine, charge_to, out_elements, ref_bytes)
        if to is not None:
            charged[to] = charged.get(to, 0.0) + k.own_bytes
    _share(keepers, charged)
    return {op: charged.get(op, 0.0) / (n * ref_bytes) for op, n in out_elements.items()}


# ---------------------------------------------------------------------------------------------------------------
# the measurement: the program run on real tensors
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Measured:
    """What autograd kept when the traced program ran on real tensors.

    Attributes:
        total_bytes: bytes of the distinct storages saved for the backward pass, parameters left out.
        by_operator: those bytes charged as :func:`saved_tiles` charges them (the storage's maker, else the
            operators that kept it in equal parts), in bytes.
        uncharged_bytes: kept storages that no operator made or kept (0 when the charge is complete).
        tensors: (node that saved it, shape, dtype, bytes) of every kept storage, first save.
    """

    total_bytes: float
    by_operator: Mapping[str, float]
    uncharged_bytes: float
    tensors: tuple[tuple[str, tuple[int, ...], str, float], ...]


def measure(program: Any, module: Any, args: Sequence[Any], kwargs: Mapping[str, Any] | None,
            charge_to: Callable[[str], str | None], out_elements: Mapping[str, int], ref_bytes: int) -> Measured:
    """Run ``program`` (the :class:`torch.export.ExportedProgram` of ``module``) on ``args`` node by node and
    record, with :func:`torch.autograd.graph.saved_tensors_hooks`, every tensor autograd saves: its storage
    (data pointer), counted once, the node running when it was saved, and the node whose result first had
    that storage (every result is held until the end so that no storage is freed and its address reused).
    ``charge_to``, ``out_elements`` and ``ref_bytes`` as in :func:`saved_tiles`, which charges the same way."""
    import torch

    gm = program.module()
    params = {p.untyped_storage().data_ptr() for p in list(module.parameters()) + list(gm.parameters())}
    maker: dict[int, str] = {}
    kept: dict[int, tuple[str, tuple[int, ...], str, float]] = {}
    savers: dict[int, dict[str, None]] = {}
    held: list[Any] = []
    running = [""]

    def note(name: str, value: Any) -> None:
        if isinstance(value, (list, tuple)):  # a tuple result's tensors are made by the getitems that take them
            return
        for t in _tensors(value):
            if t is not None and not torch._C._functorch.is_batchedtensor(t) and t.device.type != "meta":
                maker.setdefault(t.untyped_storage().data_ptr(), name)

    class Run(torch.fx.Interpreter):
        def run_node(self, n: Any) -> Any:
            running[0] = n.name
            value = super().run_node(n)
            held.append(value)
            note(n.name, value)
            return value

    def pack(t: Any) -> Any:
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr not in params:
            if ptr not in kept:
                kept[ptr] = (running[0], tuple(t.shape), str(t.dtype).removeprefix("torch."), float(s.nbytes()))
            savers.setdefault(ptr, {})[running[0]] = None
        return t

    flat = list(args) + list((kwargs or {}).values())
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        Run(gm).run(*flat)
    by_op: dict[str, float] = {}
    own: dict[str, float] = {}  # bytes of the tensors made inside a node (no node's result) it kept
    keepers: dict[int, tuple[float, dict[str, None]]] = {}
    for ptr, (saver, _, _, nbytes) in kept.items():
        m = maker.get(ptr)
        if m is None:
            own[saver] = own.get(saver, 0.0) + nbytes
        elif charge_to(m) is not None:
            by_op[charge_to(m)] = by_op.get(charge_to(m), 0.0) + nbytes
        else:
            keepers[ptr] = (nbytes, {op: None for n in savers[ptr] if (op := charge_to(n)) is not None})
    lost = _share(keepers, by_op)
    nodes = {n.name: n for n in gm.graph.nodes}
    for saver, nbytes in own.items():
        to = _own_to(nodes[saver], nbytes, charge_to(saver), charge_to, out_elements, ref_bytes)
        if to is None:
            lost += nbytes
        else:
            by_op[to] = by_op.get(to, 0.0) + nbytes
    return Measured(sum(v[3] for v in kept.values()), by_op, lost, tuple(kept.values()))
