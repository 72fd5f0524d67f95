"""PyTorch frontend: an ``nn.Module`` becomes a shardplan :class:`~shardplan.ir.Graph`.

Capture. The module is captured with :func:`torch.export.export` (non-strict,
the default), which gives the *training IR*: one FX graph of ATen operators
before decomposition (``aten.linear``, ``aten.scaled_dot_product_attention``,
``aten.layer_norm`` stay whole), with parameters, buffers and user inputs as
placeholders. That graph, not the joint forward/backward graph, is planned:
the cost model derives the backward pass of every operator from its forward
description (as for JAX and the model zoo), and the same graph is what
:mod:`shardplan.torch.run` executes on DTensors, so every planned operator
is one node the executor can lay out. The joint graph would double the
vertices the search sees without adding information the description lacks.

Values. Each FX node maps to a value (:class:`Val`): the output of an
operator, a user input, a parameter, or a *constant*. A node whose tensor
operands are all constants (buffers, ``arange``, HF's causal-mask and
rotary-embedding computations, anything that depends on no parameter and no
user input) is a constant: free and replicated, it is not a tensor of any
operator. Identity-like nodes (``alias``, ``contiguous``, ``clone``,
``to.dtype`` to the same element size, ``detach``, eval-mode dropout) create no operator.

Precision. A tensor of a wider floating dtype than the model's precision (the dtype of most of its
floating parameters: :func:`shardplan.torch.saved.reference_bytes`) holds ``itemsize / reference`` elements of
the model's precision per point (:attr:`~shardplan.ir.Tensor.elem_factor`): a float32 value in a bfloat16
model (Hugging Face's RMSNorm and loss upcast) is charged 4 bytes wherever the cost model counts its bytes
(the HBM roofline of every operator that reads or writes it, the collectives that move it). A cast between
floating dtypes of different sizes (``.float()``, ``.to(dtype)``) is an elementwise operator (kind ``cast``):
eager PyTorch runs it as a kernel that reads the source and writes the copy, and its backward casts the
gradient back. A narrower tensor (a bfloat16 value in a float32 model) is charged at the model's element
size (an upper bound: the factor is a whole number).

Operators. Every other node is one operator, built by the handler registered
for its ATen target (:data:`HANDLERS`, see :func:`register`) from the
:mod:`shardplan.ops` constructors. A parameter operand becomes a *weight*
tensor of the operator (trainable when ``requires_grad``); a buffer is a
constant. A parameter read by several operators (tied embeddings) is a weight
of each; its first reader owns it (its layout at run time is the one that
reader asks for) and the others name the owner (:attr:`~shardplan.ir.Tensor.owner`:
one copy of its state in all, and a weight edge that moves it where the
readers' layouts differ).

Names. An operator is named ``module path/node`` (``layers.0.fc/linear``);
its dimensions carry readable labels (``batch``, ``seq``, ``in``, ``out``,
``heads``: :func:`shardplan.labels.label_graph`), axis 0 of every user
input being the batch.

Dimensions that DTensor cannot execute split are marked *fixed*
(:attr:`~shardplan.ir.Operator.fixed`), so every plan found can run:
convolution and pooling windows and spatial axes (a halo exchange), the
head-feature, key and value dimensions of attention (the plan reads the keys
whole; a plan made with ``context="ring"`` runs them round the ring instead:
:mod:`shardplan.torch.ring`),
the inner dims of merged axes.

Unsupported operators. A node without a handler, or whose handler refuses
its arguments, is described *conservatively*: its iteration space is its
output's axes, all fixed, every operand read whole (so it runs replicated
and every edge into it pays for gathering its inputs), and a
:class:`ShardplanWarning` names the ATen operator and the module path it came
from. The rest of the model is still planned.
"""

from __future__ import annotations

import dataclasses
import math
import operator as _pyop
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from shardplan import ops
from shardplan.errors import ShardplanError
from shardplan.ir import AxisMap, Graph, Operator, Tensor, TensorRef
from shardplan.labels import input_axis_labels, label_graph

__all__ = ["ShardplanWarning", "Val", "TorchTrace", "trace", "HANDLERS", "register", "ELEMENTWISE",
           "IDENTITY", "ArgPath"]

PARAM = "\x00param:"
CONST = "\x00const:"

ArgPath = tuple  # (arg index,) or (arg index, list index) or ("kw", name)


class ShardplanWarning(UserWarning):
    """An operator was described conservatively (unsplittable), or a layout could not be honoured."""


@dataclass(frozen=True)
class Val:
    """What an FX node holds.

    kind: "op" (key = operator name), "input" (key = graph input name),
    "param" (key = parameter target, e.g. ``layers.0.fc.weight``), "const",
    "multi" (a tuple result, ``items`` per element) or "none".
    ``shape`` is the torch shape; ``needs_grad`` whether a gradient flows.
    """

    kind: str
    key: str | None = None
    shape: tuple[int, ...] = ()
    needs_grad: bool = False
    items: tuple["Val", ...] = ()
    source: Any = None  # for "multi" from split: (source Val, arg path, axis, starts)


CONST_VAL = Val("const")
NONE_VAL = Val("none")


@dataclass(frozen=True, eq=False)
class TorchTrace:
    """What the executor needs besides the graph.

    Attributes:
        program: the :class:`torch.export.ExportedProgram`.
        node_op: FX node name -> operator name (nodes that are operators).
        operands: operator name -> ((arg path, tensor name), ...): which
            argument of the node is which input/weight tensor of the operator.
        param_uses: parameter target -> ((operator, tensor name), ...) in graph order.
        input_uses: user-input placeholder name -> ((operator, tensor name), ...).
        const_nodes: FX nodes that are constants (run replicated, unplanned).
        conservative: operator name -> ATen target, for operators described conservatively.
        module_paths: operator name -> module path it came from.
        reasons: operator name -> why it was described conservatively (for those in ``conservative``).
        value_ops: FX node name -> the operator whose output its value is (the node's own operator, or, for
            an identity node such as a cast or a copy, the operator it passes on); what the activation
            memory of a node's tensor is charged to (:mod:`shardplan.torch.saved`).
    """

    program: Any
    node_op: Mapping[str, str]
    operands: Mapping[str, tuple[tuple[ArgPath, str], ...]]
    param_uses: Mapping[str, tuple[tuple[str, str], ...]]
    input_uses: Mapping[str, tuple[tuple[str, str], ...]]
    const_nodes: frozenset[str]
    conservative: Mapping[str, str]
    module_paths: Mapping[str, str]
    reasons: Mapping[str, str] = dataclasses.field(default_factory=dict)
    value_ops: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def conservative_ops(self, names: Mapping[str, str] | None = None) -> tuple[Any, ...]:
        """The operators described conservatively as the plan lists them
        (:class:`shardplan.result.ConservativeOp`, program order); ``names`` renames operators (traced name ->
        name in the plan)."""
        from shardplan.result import ConservativeOp

        names = names or {}
        return tuple(ConservativeOp(names.get(n, n), t, self.module_paths.get(n, "<top>"), self.reasons.get(n, ""))
                     for n, t in self.conservative.items())


Handler = Callable[["_Ctx", Any, list], None]
HANDLERS: dict[str, Handler] = {}


def register(*targets: str) -> Callable[[Handler], Handler]:
    """Decorator: ``handler(ctx, node, vals)`` describes the ATen ops named ``targets``.

    Names are ``str(node.target)``, e.g. ``"aten.linear.default"``. A handler
    calls :meth:`_Ctx.emit` with an operator built from :mod:`shardplan.ops`.
    """

    def deco(fn: Handler) -> Handler:
        for t in targets:
            HANDLERS[t] = fn
        return fn

    return deco


# FLOPs per output element of elementwise ATen ops (overload-free name).
ELEMENTWISE: Mapping[str, float] = {
    **{n: 1.0 for n in (
        "add", "sub", "mul", "div", "neg", "abs", "pow", "rsqrt", "sqrt", "exp", "log", "log1p", "expm1",
        "tanh", "sigmoid", "relu", "relu_", "maximum", "minimum", "clamp", "clamp_min", "clamp_max", "where",
        "masked_fill", "eq", "ne", "lt", "le", "gt", "ge", "logical_not", "logical_and", "logical_or",
        "reciprocal", "sin", "cos", "erf", "square", "floor", "ceil", "round", "sign", "rsub", "add_", "mul_",
        "div_", "sub_", "hardtanh", "leaky_relu", "exp2", "bitwise_not", "bitwise_and", "__and__", "__or__",
        "silu_", "gelu_", "hardswish", "hardsigmoid", "softplus", "elu", "mish",
        "floor_divide", "remainder", "fmod", "bitwise_or", "bitwise_xor", "greater", "less", "greater_equal",
        "less_equal", "logical_xor",
    )},
    "silu": 4.0, "gelu": 8.0, "dropout": 2.0, "native_dropout": 2.0, "feature_dropout": 2.0,
}
IDENTITY = frozenset({
    "aten.alias.default", "aten.contiguous.default", "aten.clone.default", "aten.to.dtype",
    "aten.to.dtype_layout", "aten.to.device", "aten.to.other", "aten.type_as.default", "aten.detach.default",
    "aten.lift_fresh_copy.default", "aten._to_copy.default", "aten.float.default",
})
_NO_GRAD = frozenset({"aten.detach.default"})
_SKIP = frozenset({"aten._assert_tensor_metadata.default", "aten._assert_scalar.default",
                   "aten.sym_constrain_range_for_size.default"})


def _empty(node: Any, vals: list, target: str) -> bool:
    """Whether ``node`` computes nothing: its result has a zero extent (it holds nothing), or it reads an operand
    with one (outside a concatenation, which skips it: a sum over an empty axis is a constant), so it is free."""
    if 0 in (_shape(node) or (1,)):
        return True
    if target in ("aten.cat.default", "aten.concat.default"):
        return False
    return any(isinstance(v, Val) and v.kind != "const" and 0 in (v.shape or (1,)) for v in vals)


def _shape(node: Any) -> tuple[int, ...] | None:
    v = node.meta.get("val") if hasattr(node, "meta") else None
    if v is None or not hasattr(v, "shape"):
        return None
    return tuple(int(s) for s in v.shape)


def _is_float(node: Any) -> bool:
    v = node.meta.get("val")
    return v is not None and hasattr(v, "dtype") and (v.dtype.is_floating_point or v.dtype.is_complex)


def _factor(node: Any, ref_bytes: int, default: int = 1) -> int:
    """Elements of ``ref_bytes`` bytes per element of ``node``'s floating tensor value (at least 1); ``default``
    where ``node`` is not an FX node with one tensor value (a tuple's part, a list, a scalar)."""
    v = node.meta.get("val") if hasattr(node, "meta") else None
    if v is None or not hasattr(v, "dtype") or not hasattr(v, "element_size"):
        return default
    if not (v.dtype.is_floating_point or v.dtype.is_complex):
        return 1
    return max(1, int(v.element_size()) // max(1, int(ref_bytes)))


def _widened(t: Tensor, factor: int) -> Tensor:
    return t if factor == 1 else dataclasses.replace(t, elem_factor=t.elem_factor * factor)


def _arg_at(node: Any, path: ArgPath) -> Any:
    """The argument of ``node`` at ``path`` ((i,), (i, j) or ("kw", name)); None where there is none."""
    try:
        if not path:
            return None
        if path[0] == "kw":
            return node.kwargs[path[1]]
        a = node.args[path[0]]
        return a[path[1]] if len(path) > 1 else a
    except (IndexError, KeyError, TypeError):
        return None


def _casts(node: Any, vals: list) -> bool:
    """Whether ``node`` (an identity-like ATen op) copies a live floating tensor into a floating dtype of another
    element size: a kernel in eager PyTorch, not a view."""
    src = node.args[0] if node.args else None
    if not (_live(vals[0] if vals else None) and hasattr(src, "meta")):
        return False
    a, b = src.meta.get("val"), node.meta.get("val")
    if not all(hasattr(x, "dtype") and hasattr(x, "element_size") for x in (a, b)):
        return False
    return a.dtype.is_floating_point and b.dtype.is_floating_point and a.element_size() != b.element_size()


CASTS = frozenset({"aten.to.dtype", "aten.to.dtype_layout", "aten._to_copy.default", "aten.type_as.default",
                   "aten.to.other", "aten.float.default"})


def _cast(ctx: _Ctx, node: Any, vals: list) -> None:
    """``y = x.to(dtype)`` between floating dtypes of different sizes: an elementwise copy (reads x, writes y;
    its backward casts the gradient back), each tensor at its own element size."""
    x = vals[0]
    out = _shape(node) or x.shape
    op = ops.elementwise(ctx.name_for(node), ctx.ref(x), kind="cast", letters=_letters(len(out)))
    ctx.emit(node, op, [((0,), x, "x0")])


def module_path(node: Any) -> str:
    """The module path an FX node came from (``layers.0.attn``), or ``<top>``."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "<top>"
    path = list(stack.values())[-1][0]
    return path or "<top>"


def _clean(name: str) -> str:
    return name.replace("L['self'].", "").replace("L__self__.", "").replace("L['fn'].", "")


class _Ctx:
    """The state of one trace: values per node, operators, and the executor's side tables."""

    def __init__(self, node_vals: dict[str, Val]) -> None:
        self.env = node_vals
        self.ops: dict[str, Operator] = {}
        self.node_op: dict[str, str] = {}
        self.operands: dict[str, tuple[tuple[ArgPath, str], ...]] = {}
        self.param_uses: dict[str, list[tuple[str, str]]] = {}
        self.input_uses: dict[str, list[tuple[str, str]]] = {}
        self.conservative: dict[str, str] = {}
        self.reasons: dict[str, str] = {}
        self.paths: dict[str, str] = {}
        self.inputs: dict[str, tuple[int, ...]] = {}
        self.ref_bytes = 0  # bytes per element of the model's precision (0: every tensor one element per point)

    # -- references -------------------------------------------------------
    def ref(self, v: Val, shape: Sequence[int] | None = None) -> TensorRef:
        """A TensorRef for ``v`` (params and constants carry a marker, rewritten by :meth:`emit`)."""
        shp = tuple(shape) if shape is not None else v.shape
        if v.kind == "param":
            return TensorRef(PARAM + str(v.key), shp, needs_grad=v.needs_grad)
        if v.kind in ("op", "input"):
            return TensorRef(str(v.key), shp, is_input=v.kind == "input", needs_grad=v.needs_grad)
        return TensorRef(CONST + "c", shp, needs_grad=False)

    def name_for(self, node: Any) -> str:
        base = _clean(module_path(node))
        base = "" if base == "<top>" else base + "/"
        name = base + node.name
        if name not in self.ops and name not in self.inputs:
            return name
        i = 2
        while f"{name}_{i}" in self.ops or f"{name}_{i}" in self.inputs:
            i += 1
        return f"{name}_{i}"

    # -- adding operators -------------------------------------------------
    def emit(self, node: Any, op: Operator, operands: Sequence[tuple[ArgPath, Val, str]],
             out: Val | None = None, kind: str | None = None) -> Val:
        """Register ``op`` for ``node``.

        ``operands``: (arg path, value, tensor name in ``op``) for every
        tensor operand; a parameter's tensor becomes a weight, a constant's
        is dropped. A weight the constructor made itself (an einsum
        :class:`~shardplan.ops.Param`, an embedding table) is listed with its
        weight name and the parameter value.
        """
        by_name = {tname: (path, v) for path, v, tname in operands}
        inputs: list[Tensor] = []
        weights: list[Tensor] = [w for w in op.weights if w.name in by_name and by_name[w.name][1].kind == "param"]
        for t in op.inputs:
            if t.src is not None and t.src.startswith(PARAM):
                weights.append(Tensor(t.name, t.shape, t.axes, "weight", needs_grad=t.needs_grad))
            elif t.src is not None and t.src.startswith(CONST):
                by_name.pop(t.name, None)
            else:
                inputs.append(t)
        kept = {t.name for t in inputs} | {w.name for w in weights}
        by_name = {k: pv for k, pv in by_name.items() if k in kept}
        dims = op.dims or (("u", 1),)
        if self.ref_bytes:
            out_f = _factor(node, self.ref_bytes)

            def widen(t: Tensor) -> Tensor:  # an operand's factor from its FX node, else the output's
                path = by_name[t.name][0] if t.name in by_name else None
                return _widened(t, out_f if path is None else _factor(_arg_at(node, path), self.ref_bytes, out_f))
            inputs, weights = [widen(t) for t in inputs], [widen(t) for t in weights]
            op = dataclasses.replace(op, output=_widened(op.output, out_f))
        op = dataclasses.replace(op, kind=kind or op.kind, inputs=tuple(inputs), weights=tuple(weights), dims=dims)
        self.ops[op.name] = op
        self.node_op[node.name] = op.name
        self.paths[op.name] = module_path(node)
        self.operands[op.name] = tuple((path, tname) for tname, (path, _) in by_name.items())
        for tname, (_, v) in by_name.items():
            if v.kind == "param":
                self.param_uses.setdefault(str(v.key), []).append((op.name, tname))
            elif v.kind == "input":
                self.input_uses.setdefault(str(v.key), []).append((op.name, tname))
        grad = _is_float(node) and (any(t.needs_grad for t in op.inputs) or any(t.needs_grad for t in op.weights))
        val = out or Val("op", op.name, _shape(node) or (), grad)
        self.env[node.name] = val
        return val

    def share_weights(self) -> None:
        """Give every parameter read by several operators one owner: its first reader (whose layout it
        takes at run time); every other reader of it in the same shape names the owner
        (:attr:`~shardplan.ir.Tensor.owner`)."""
        for uses in self.param_uses.values():
            uses = [(op, tname) for op, tname in uses if op in self.ops]
            if len({op for op, _ in uses}) < 2:
                continue
            oname, otname = uses[0]
            shape = next(w.shape for w in self.ops[oname].weights if w.name == otname)
            for name, tname in uses[1:]:
                op = self.ops[name]
                if name == oname or next(w.shape for w in op.weights if w.name == tname) != shape:
                    continue
                self.ops[name] = dataclasses.replace(op, weights=tuple(
                    dataclasses.replace(w, owner=(oname, otname)) if w.name == tname else w for w in op.weights))

    def undo(self, node: Any) -> None:
        """Forget the operator made for ``node`` (its handler described it wrongly)."""
        name = self.node_op.pop(node.name, None)
        if name is None:
            return
        self.ops.pop(name, None)
        self.operands.pop(name, None)
        self.paths.pop(name, None)
        for uses in (self.param_uses, self.input_uses):
            for k in list(uses):
                uses[k] = [u for u in uses[k] if u[0] != name]
                if not uses[k]:
                    del uses[k]

    def conservative_op(self, node: Any, vals: list, reason: str) -> None:
        """Describe ``node`` as unsplittable: domain = output axes (all fixed), operands read whole."""
        target = str(node.target)
        shape = _shape(node)
        meta = node.meta.get("val")
        if shape is None and isinstance(meta, (list, tuple)) and node.target is not _pyop.getitem:
            # a tuple result: each getitem of it becomes a conservative operator over these operands
            items = tuple(Val("op", None, tuple(int(s) for s in m.shape) if hasattr(m, "shape") else (), True)
                          for m in meta)
            self.env[node.name] = Val("multi", node.name, (), True, items, ("whole", tuple(vals), target, reason))
            return
        name = self.name_for(node)
        warnings.warn(f"torch frontend: {target} in module {module_path(node)!r} ({reason}): described "
                      "conservatively (not split, operands gathered)", ShardplanWarning, stacklevel=3)
        if shape is None:
            raise ShardplanError(f"torch frontend: unsupported operator {target} in module {module_path(node)!r} "
                                 f"returns no single tensor ({reason})")
        letters = _letters(len(shape))
        operands = []
        tensors = []
        for path, v in _tensor_args(node, vals):
            if v.kind in ("op", "input", "param"):
                tname = f"x{len(tensors)}"
                role_in = v.kind != "param"
                t = Tensor(tname, v.shape, tuple(AxisMap(None) for _ in v.shape), "input" if role_in else "weight",
                           needs_grad=v.needs_grad, src=str(v.key) if role_in else None)
                tensors.append(t)
                operands.append((path, v, tname))
        dims = tuple(zip(letters, shape)) or (("u", 1),)
        out = Tensor("y", shape, tuple(letters), "output")
        op = Operator(name, "conservative:" + target.replace("aten.", ""), dims,
                      tuple(t for t in tensors if t.role == "input"), out,
                      tuple(t for t in tensors if t.role == "weight"), flops_per_point=1.0,
                      fixed=frozenset(d for d, _ in dims))
        self.emit(node, op, operands)
        self.conservative[name] = target
        self.reasons[name] = reason


def _letters(n: int, avoid: str = "") -> str:
    pool = [c for c in "abcdefghijklmnopqrstuvwxyz" if c not in avoid]
    if n > len(pool):
        raise ShardplanError(f"torch frontend: a tensor of rank {n} has too many axes to name")
    return "".join(pool[:n])


def _tensor_args(node: Any, vals: list) -> list[tuple[ArgPath, Val]]:
    """(arg path, value) of every tensor operand of ``node`` (lists of tensors included)."""
    out: list[tuple[ArgPath, Val]] = []
    for i, v in enumerate(vals):
        if isinstance(v, Val) and v.kind not in ("none", "multi"):
            out.append(((i,), v))
        elif isinstance(v, (list, tuple)):
            for j, x in enumerate(v):
                if isinstance(x, Val) and x.kind not in ("none", "multi"):
                    out.append(((i, j), x))
    return out


def _live(v: Any) -> bool:
    return isinstance(v, Val) and v.kind in ("op", "input", "param")


# ---------------------------------------------------------------------------
# handlers
# ---------------------------------------------------------------------------

def _einsum_operands(ctx: Any, values: Any) -> tuple[list[Any], list[tuple[Any, Any, str]]]:
    """An einsum's operand references and ``(argument path, value, role)`` in order: a parameter is a weight
    ``w{k}`` (trainable when it needs a gradient), anything else an input ``x{k}`` produced upstream."""
    refs: list[Any] = []
    operands: list[tuple[Any, Any, str]] = []
    for k, (v, path) in enumerate(values):
        if v.kind == "param":
            refs.append(ops.Param(v.shape, name=f"w{k}", trainable=v.needs_grad))
            operands.append((path, v, f"w{k}"))
        else:
            refs.append(ctx.ref(v))
            operands.append((path, v, f"x{k}"))
    return refs, operands

def _operand_einsum(ctx: _Ctx, node: Any, name: str, eq: str, vals: Sequence[Val], paths: Sequence[ArgPath],
                    kind: str, bias: tuple[ArgPath, Any] | None = None) -> None:
    """An einsum over operands that are activations or parameters (+ a bias over the last output axis).

    The bias is described as a weight indexed by the last output letter; its
    gradient then counts as reduced over every other dimension (an
    over-estimate of one vector's all-reduce when a contracted dim is split).
    """
    refs, operands = _einsum_operands(ctx, zip(vals, paths))
    op = ops.einsum(name, eq, *refs, kind=kind)
    if bias is not None and _live(bias[1]) and len(bias[1].shape) == 1:
        last = eq.split("->")[1][-1]
        b = bias[1]
        op = dataclasses.replace(op, inputs=op.inputs + (Tensor("bias", b.shape, (last,), "input",
                                                                needs_grad=b.needs_grad, src=ctx.ref(b).name),))
        operands.append((bias[0], b, "bias"))
    ctx.emit(node, op, operands)


@register("aten.linear.default")
def _linear(ctx: _Ctx, node: Any, vals: list) -> None:
    """``y[..., n] = sum_c x[..., c] W[n, c]`` (+ a bias over ``n``: a weight outside the contraction,
    :attr:`~shardplan.ir.Operator.epilogue_tensors`)."""
    x, w = vals[0], vals[1]
    lead = _letters(len(x.shape) - 1, "nc")
    _operand_einsum(ctx, node, ctx.name_for(node), f"{lead}c,nc->{lead}n", [x, w], [(0,), (1,)], "linear",
                    bias=((2,), _at(vals, 2)))


@register("aten.addmm.default")
def _addmm(ctx: _Ctx, node: Any, vals: list) -> None:
    """``beta * bias + x @ W`` (HF GPT-2's Conv1D): the product ``mk,kn->mn``."""
    _operand_einsum(ctx, node, ctx.name_for(node), "mk,kn->mn", [vals[1], vals[2]], [(1,), (2,)], "addmm",
                    bias=((0,), vals[0]))


@register("aten.mm.default")
def _mm(ctx: _Ctx, node: Any, vals: list) -> None:
    _operand_einsum(ctx, node, ctx.name_for(node), "mk,kn->mn", vals[:2], [(0,), (1,)], "mm")


@register("aten.bmm.default")
def _bmm(ctx: _Ctx, node: Any, vals: list) -> None:
    _operand_einsum(ctx, node, ctx.name_for(node), "bmk,bkn->bmn", vals[:2], [(0,), (1,)], "bmm")


@register("aten.baddbmm.default")
def _baddbmm(ctx: _Ctx, node: Any, vals: list) -> None:
    """``beta * c + alpha * a @ b``: the batched product (the added term is elementwise, folded in)."""
    _operand_einsum(ctx, node, ctx.name_for(node), "bmk,bkn->bmn", vals[1:3], [(1,), (2,)], "baddbmm")


@register("aten.matmul.default")
def _matmul(ctx: _Ctx, node: Any, vals: list) -> None:
    """``torch.matmul`` with broadcast batch dims; 1-D operands are read as a row / column."""
    a, b = vals[0], vals[1]
    if len(a.shape) < 2 or len(b.shape) < 2:
        raise ShardplanError("1-D matmul operands")
    out = _shape(node) or ()
    nb = len(out) - 2
    batch = _letters(nb, "mkn")
    ta = batch[nb - (len(a.shape) - 2):] + "mk"
    tb = batch[nb - (len(b.shape) - 2):] + "kn"
    for t, v in ((ta, a), (tb, b)):
        for ch, n in zip(t[:-2], v.shape[:-2]):
            if n != out[batch.index(ch)]:
                raise ShardplanError("broadcast batch dims in matmul")
    _operand_einsum(ctx, node, ctx.name_for(node), f"{ta},{tb}->{batch}mn", [a, b], [(0,), (1,)], "matmul")


@register("aten.einsum.default")
def _einsum(ctx: _Ctx, node: Any, vals: list) -> None:
    eq = str(node.args[0]).replace(" ", "")
    operands = vals[1]
    if "->" not in eq or "." in eq:
        raise ShardplanError(f"einsum equation {eq!r} (implicit output or ellipsis)")
    _operand_einsum(ctx, node, ctx.name_for(node), eq, list(operands), [(1, j) for j in range(len(operands))],
                    "einsum")


def _conv_args(node: Any) -> tuple[list[int], list[int], list[int], int, bool]:
    a = list(node.args) + [None] * 9
    t = str(node.target)
    if t.startswith("aten.convolution"):
        stride, pad, dil, transposed, groups = a[3], a[4], a[5], bool(a[6]), int(a[8])
    else:
        stride, pad, dil, groups, transposed = a[3], a[4], a[5], a[6], False
    k = len(_shape(node.args[1]) or ()) - 2
    norm = lambda v, d: [int(x) for x in v] * (k if len(v) == 1 else 1) if v is not None else [d] * k  # noqa: E731
    if isinstance(pad, str):
        raise ShardplanError(f"padding={pad!r}")
    return norm(stride, 1), norm(pad, 0), norm(dil, 1), int(groups or 1), transposed


@register("aten.conv1d.default", "aten.conv2d.default", "aten.conv3d.default", "aten.convolution.default")
def _conv(ctx: _Ctx, node: Any, vals: list) -> None:
    """Convolution with groups g: ``y[b, (g,n), o] = sum_{c, r} x[b, (g,c), s*o + d*r - pad] W[(g,n), c, r]``.

    Dims ``b g c o.. n r..`` (``bchwnrs`` when g = 1); the channel axes are
    merged (g, c) / (g, n). Only the batch is splittable: DTensor's
    convolution (``torch.distributed.tensor._tp_conv``) runs with replicated
    weights and a halo exchange only in special cases, so every other
    dimension is fixed. The bias is a weight over the output channels.
    """
    stride, pad, dil, groups, transposed = _conv_args(node)
    if transposed:
        raise ShardplanError("transposed convolution")
    x, w = vals[0], vals[1]
    out = _shape(node) or ()
    k = len(out) - 2
    if k > 3:
        raise ShardplanError(f"{k}-d convolution")
    sp, win = list("hwz"[:k]), list("rst"[:k])
    cin = x.shape[1] // groups
    nout = out[1] // groups
    dims = [("b", out[0])] + ([("g", groups)] if groups > 1 else []) + [("c", cin)]
    dims += [(sp[i], out[2 + i]) for i in range(k)] + [("n", nout)] + [(win[i], w.shape[2 + i]) for i in range(k)]
    grp = lambda d: AxisMap("g", inner=(d,)) if groups > 1 else AxisMap(d)  # noqa: E731
    xa = [AxisMap("b"), grp("c")] + [AxisMap(sp[i], win[i], stride[i], dil[i], -pad[i]) for i in range(k)]
    wa = [grp("n"), AxisMap("c")] + [AxisMap(win[i]) for i in range(k)]
    oa = [AxisMap("b"), grp("n")] + [AxisMap(sp[i]) for i in range(k)]
    name = ctx.name_for(node)
    xt = Tensor("x", x.shape, tuple(xa), "input", needs_grad=x.needs_grad, src=ctx.ref(x).name)
    wt = Tensor("w", w.shape, tuple(wa), "input", needs_grad=w.needs_grad, src=ctx.ref(w).name)
    fixed = {d for d, _ in dims if d != "b"}
    ts, operands = [xt, wt], [((0,), x, "x"), ((1,), w, "w")]
    bias = _at(vals, 2)
    if _live(bias):
        ts.append(Tensor("bias", bias.shape, (grp("n"),), "input", needs_grad=bias.needs_grad, src=ctx.ref(bias).name))
        operands.append(((2,), bias, "bias"))
    op = Operator(name, "conv", tuple(dims), tuple(ts), Tensor("y", out, tuple(oa), "output"), flops_per_point=2.0,
                  fixed=frozenset(fixed))
    ctx.emit(node, op, operands)


@register("aten.max_pool2d.default", "aten.avg_pool2d.default", "aten.max_pool1d.default",
          "aten.avg_pool1d.default", "aten.adaptive_avg_pool2d.default", "aten.adaptive_avg_pool1d.default",
          "aten.max_pool2d_with_indices.default")
def _pool(ctx: _Ctx, node: Any, vals: list) -> None:
    """Pooling: spatial axes read whole (fixed dims), batch and channel split freely."""
    x = vals[0]
    out = _shape(node)
    if out is None:
        raise ShardplanError("pooling with indices")
    letters = _letters(len(out))
    acc = [AxisMap(letters[i]) if (i < 2 or x.shape[i] == out[i]) else AxisMap(None) for i in range(len(out))]
    fixed = frozenset(letters[i] for i in range(2, len(out)))
    op = Operator(ctx.name_for(node), "pool", tuple(zip(letters, out)),
                  (Tensor("x", x.shape, tuple(acc), "input", needs_grad=x.needs_grad, src=ctx.ref(x).name),),
                  Tensor("y", out, tuple(letters), "output"),
                  flops_per_point=float(math.prod(x.shape) / max(1, math.prod(out))), fixed=fixed)
    ctx.emit(node, op, [((0,), x, "x")])


@register("aten.embedding.default")
def _embedding(ctx: _Ctx, node: Any, vals: list) -> None:
    """``y[.., d] = W[ids[..], d]`` (ops.embedding: the vocabulary is a reduction dim)."""
    w, ids = vals[0], vals[1]
    if w.kind != "param" or len(w.shape) != 2:
        raise ShardplanError("embedding table that is not a 2-D parameter")
    op = ops.embedding(ctx.name_for(node), ctx.ref(ids), w.shape[0], w.shape[1])
    op = dataclasses.replace(op, weights=tuple(dataclasses.replace(t, needs_grad=w.needs_grad) for t in op.weights))
    ctx.emit(node, op, [((0,), w, "table"), ((1,), ids, "ids")])


def _norm(ctx: _Ctx, node: Any, x: Val, n_norm: int, kind: str, params: Sequence[tuple[ArgPath, Val]],
          flops: float, stats: int = 2) -> None:
    """Normalise over the last ``n_norm`` axes, affine parameters over those axes."""
    letters = _letters(len(x.shape))
    nd = letters[len(letters) - n_norm:]
    xt = Tensor("x", x.shape, tuple(letters), "input", needs_grad=x.needs_grad, src=ctx.ref(x).name)
    ws, operands = [], [((0,), x, "x")]
    for k, (path, v) in enumerate(params):
        if _live(v):
            ws.append(Tensor(f"w{k}", v.shape, tuple(nd[len(nd) - len(v.shape):]), "input", needs_grad=v.needs_grad,
                             src=ctx.ref(v).name))
            operands.append((path, v, f"w{k}"))
    op = Operator(ctx.name_for(node), kind, tuple(zip(letters, x.shape)), (xt, *ws),
                  Tensor("y", x.shape, tuple(letters), "output"), flops_per_point=flops, norm_dims=tuple(nd),
                  norm_stats=stats)
    ctx.emit(node, op, operands)


@register("aten.layer_norm.default")
def _layer_norm(ctx: _Ctx, node: Any, vals: list) -> None:
    n = len(node.args[1])
    _norm(ctx, node, vals[0], n, "layer_norm", [((2,), _at(vals, 2)), ((3,), _at(vals, 3))], 8.0)


@register("aten.rms_norm.default")
def _rms_norm(ctx: _Ctx, node: Any, vals: list) -> None:
    n = len(node.args[1])
    _norm(ctx, node, vals[0], n, "rms_norm", [((2,), _at(vals, 2))], 5.0, stats=1)


def _at(vals: list, i: int) -> Any:
    return vals[i] if i < len(vals) else NONE_VAL


@register("aten.batch_norm.default")
def _batch_norm(ctx: _Ctx, node: Any, vals: list) -> None:
    """Batch norm: statistics over every axis but the channel (axis 1) in training mode; affine over channels.

    The running statistics are buffers (constants): updated in place, not planned.
    """
    x = vals[0]
    training = bool(node.args[5]) if len(node.args) > 5 else True
    letters = _letters(len(x.shape))
    norm = tuple(ch for i, ch in enumerate(letters) if i != 1) if training else ()
    xt = Tensor("x", x.shape, tuple(letters), "input", needs_grad=x.needs_grad, src=ctx.ref(x).name)
    ws, operands = [], [((0,), x, "x")]
    for k in (1, 2):
        v = _at(vals, k)
        if _live(v):
            ws.append(Tensor(f"w{k}", v.shape, (letters[1],), "input", needs_grad=v.needs_grad, src=ctx.ref(v).name))
            operands.append(((k,), v, f"w{k}"))
    op = Operator(ctx.name_for(node), "batch_norm", tuple(zip(letters, x.shape)), (xt, *ws),
                  Tensor("y", x.shape, tuple(letters), "output"), flops_per_point=8.0, norm_dims=norm, norm_stats=2)
    ctx.emit(node, op, operands)


@register("aten.softmax.int", "aten._softmax.default", "aten.log_softmax.int", "aten._log_softmax.default")
def _softmax(ctx: _Ctx, node: Any, vals: list) -> None:
    """Softmax over ``dim``: that axis is normalised over (max and sum)."""
    x = vals[0]
    rank = len(x.shape)
    dim = int(node.args[1]) % rank
    letters = _letters(rank)
    op = ops.softmax(ctx.name_for(node), ctx.ref(x), letters=letters)
    op = dataclasses.replace(op, norm_dims=(letters[dim],))
    ctx.emit(node, op, [((0,), x, "x")], kind="log_softmax" if "log" in str(node.target) else "softmax")


@register("aten.cross_entropy_loss.default", "aten.nll_loss.default", "aten.nll_loss_nd.default")
def _cross_entropy(ctx: _Ctx, node: Any, vals: list) -> None:
    """Cross-entropy / NLL over the class axis (axis 1; labels have the other axes).

    The class dim indexes no output axis (the gathered target logit) and is
    normalised over; with reduction "mean"/"sum" every dim is a reduction.
    """
    logits, labels = vals[0], vals[1]
    if _live(_at(vals, 2)):
        raise ShardplanError("class weights")
    red = int(node.args[3]) if len(node.args) > 3 else 1
    rank = len(logits.shape)
    letters = _letters(rank)
    cls = letters[1] if rank > 1 else letters[0]
    lab_axes = tuple(ch for ch in letters if ch != cls)
    lt = Tensor("logits", logits.shape, tuple(letters), "input", needs_grad=logits.needs_grad, src=ctx.ref(logits).name)
    yt = Tensor("labels", labels.shape, lab_axes, "input", needs_grad=False, src=ctx.ref(labels).name)
    out = _shape(node) or ()
    oa = lab_axes if red == 0 else tuple(AxisMap(None) for _ in out)
    # the backward step holds the loss's gradient, and of the logits' size and dtype: nll_loss's gradient of the
    # log-probabilities and log_softmax's of the logits (aten's cross_entropy_loss is the two; nll_loss alone: one)
    composite = "cross_entropy_loss" in str(node.target)
    op = Operator(ctx.name_for(node), "cross_entropy", tuple(zip(letters, logits.shape)), (lt, yt),
                  Tensor("loss", out, oa, "output"), flops_per_point=5.0, norm_dims=(cls,), norm_stats=2,
                  transient=(1.0, 2.0 if composite else 1.0, 0.0) if logits.needs_grad else ())
    ctx.emit(node, op, [((0,), logits, "logits"), ((1,), labels, "labels")])


def _sdpa_arg(node: Any, i: int, name: str, default: Any) -> Any:
    """Argument ``i`` (keyword ``name``) of an ATen call node, ``default`` when absent."""
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def _const_value(node: Any) -> Any:
    """The tensor a constant FX node computes, or None where it cannot be had at trace time.

    Every node before it in graph order that reads no placeholder runs, as the run runs the constants
    (a mask built from ``arange`` and comparisons, Hugging Face's causal mask under ``torch.export``, is
    one: its ``vmap`` levels are opened and closed by nodes of their own, which run too). A failure gives
    None, and vmap levels left open by it are closed."""
    import operator

    import torch

    if not isinstance(node, torch.fx.Node):
        return None
    env: dict[Any, Any] = {}
    read = lambda a: env[a] if isinstance(a, torch.fx.Node) else a  # noqa: E731
    depth = 0
    try:
        for n in node.graph.nodes:
            if n.op not in ("get_attr", "call_function") or any(a not in env for a in n.all_input_nodes):
                if n is node:
                    return None
                continue
            if n.op == "get_attr":  # a copy: an in-place node must not change the program's constant
                v = operator.attrgetter(n.target)(node.graph.owning_module)
                env[n] = v.clone() if isinstance(v, torch.Tensor) else v
            else:
                env[n] = n.target(*torch.fx.node.map_aggregate(n.args, read),
                                  **torch.fx.node.map_aggregate(n.kwargs, read))
                name = getattr(n.target, "__name__", "")
                depth += (name == "_vmap_increment_nesting") - (name == "_vmap_decrement_nesting")
            if n is node:
                out = env[n]
                return out if isinstance(out, torch.Tensor) else None
        return None
    except Exception:  # noqa: BLE001  (any failure: the mask stays a general one)
        return None
    finally:
        for _ in range(max(depth, 0)):
            torch._C._functorch._vmap_decrement_nesting()


def _const_causal(mask_node: Any, lq: int, s: int) -> bool:
    """:func:`shardplan.torch.ring.is_causal_mask` of a constant mask node's value (:func:`_const_value`),
    kept in the node's ``meta`` so that the layers that read one mask evaluate it once."""
    from shardplan.torch.ring import is_causal_mask

    meta = getattr(mask_node, "meta", None)
    if meta is None:
        return False
    key = ("shardplan_causal", lq, s)
    if key not in meta:
        try:
            meta[key] = is_causal_mask(_const_value(mask_node), lq, s)
        except Exception:  # noqa: BLE001  (a value that cannot be compared: the mask stays a general one)
            meta[key] = False
    return bool(meta[key])


@register("aten.scaled_dot_product_attention.default")
def _sdpa(ctx: _Ctx, node: Any, vals: list) -> None:
    """``softmax(q k^T * scale + mask) v`` as the fused kernel PyTorch runs (FlashAttention, memory-efficient
    or cuDNN attention: the scores never reach HBM), described by :func:`shardplan.ops.flash_attention`.

    ``q`` is ``(b, H, l, e)``, ``k``, ``v`` are ``(b, G, s, e)``; the dims are flash attention's ``b h s k`` +
    ``t``: batch, heads, queries ``s``, features ``k``, keys ``t`` (the key sequence and the features fixed:
    a device computes whole softmax rows; keys and values split along the sequence by their producers
    reach it gathered, or by the ring: :mod:`shardplan.cost.ring`). Grouped-query attention (``G < H``,
    ``enable_gqa``): ``h`` counts the K/V heads and a fixed ``r = H / G`` the query heads of each, the query
    head axis the merged ``(h, r)`` (query head ``i`` reads K/V head ``i // r``, PyTorch's order), so a split
    of the heads splits the K/V heads with their queries. K/V heads expanded before the call (Hugging
    Face's ``repeat_kv``) are ``G = H``: the kernel reads them so.

    The mask: ``is_causal`` (queries and keys of one length), or a constant mask whose value at trace time
    keeps exactly key <= query (Hugging Face builds one under ``torch.export``), is
    :class:`~shardplan.ir.Causal`: the kernel skips the masked blocks. Any other mask is charged the whole
    domain: a constant one is free, a computed one is a fourth input read per query row (no gradient);
    the kernels that take a mask do the full work. Keys and values of another shape (``e`` != the value
    width) are one generic attention (:func:`_sdpa_general`).
    """
    q, k, v = vals[0], vals[1], vals[2]
    mask = _at(vals, 3)
    b, h, lq, e = q.shape
    kv, s = k.shape[1], k.shape[2]
    if tuple(k.shape) != tuple(v.shape) or h % kv or k.shape[0] != b:
        return _sdpa_general(ctx, node, vals)
    causal = bool(_sdpa_arg(node, 5, "is_causal", False)) and lq == s
    live = _live(mask)
    if not live and isinstance(mask, Val) and mask.kind == "const" and not causal:
        causal = _const_causal(_sdpa_arg(node, 3, "attn_mask", None), lq, s)
    r = h // kv
    qref = ctx.ref(q)
    query = "bhrsk" if r > 1 else "bhsk"
    fake = TensorRef(qref.name, (b, kv, r, lq, e) if r > 1 else (b, h, lq, e), qref.is_input, qref.needs_grad)
    op = ops.flash_attention(ctx.name_for(node), fake, ctx.ref(k), ctx.ref(v), query, "bhtk", causal=causal,
                             dealt=True)
    heads = AxisMap("h", inner=("r",)) if r > 1 else AxisMap("h")
    four = (AxisMap("b"), heads, AxisMap("s"), AxisMap("k"))
    ts = [dataclasses.replace(op.inputs[0], shape=(b, h, lq, e), axes=four), *op.inputs[1:]]
    operands = [((0,), q, "q"), ((1,), k, "k"), ((2,), v, "v")]
    if live:
        full = (b, h, lq, s)
        ms = (1,) * (4 - len(mask.shape)) + tuple(mask.shape)
        axes = [(heads if i == 1 else AxisMap(ch)) if n == full[i] and n != 1 else AxisMap(None)
                for i, (ch, n) in enumerate(zip("bhst", ms))]
        ts.append(Tensor("mask", mask.shape, tuple(axes[4 - len(mask.shape):]), "input", needs_grad=False,
                         src=ctx.ref(mask).name))
        operands.append(((3,), mask, "mask"))
    out = dataclasses.replace(op.output, shape=(b, h, lq, e), axes=four)
    fixed = op.fixed | ({"r"} if r > 1 else set())
    ctx.emit(node, dataclasses.replace(op, inputs=tuple(ts), output=out, fixed=frozenset(fixed)), operands)


def _sdpa_general(ctx: _Ctx, node: Any, vals: list) -> None:
    """Attention ``y[b,h,l,f] = sum_s softmax_s(sum_e q[b,h,l,e] k[b,h,s,e]) v[b,h,s,f]`` whose values have
    another width than the keys (or K/V heads that do not group the query heads evenly).

    One vertex with dims ``b h l s e f``; work 2(E + F) per (b,h,l,s), i.e.
    ``2(E+F)/(E F)`` per point. ``s`` (keys) is normalised over. ``e``, ``s``
    and ``f`` are fixed: the run computes attention on each device's tiles of
    batch, heads and queries, the keys whole (``shardplan.torch.run._sdpa``).
    With fewer K/V heads the K/V head axis is read whole.
    """
    q, k, v = vals[0], vals[1], vals[2]
    mask = _at(vals, 3)
    b, h, lq, e = q.shape
    s, f = k.shape[2], v.shape[3]
    dims = (("b", b), ("h", h), ("l", lq), ("s", s), ("e", e), ("f", f))
    kv_h = lambda t: AxisMap("h") if t.shape[1] == h else AxisMap(None)  # noqa: E731
    name = ctx.name_for(node)
    ts = [Tensor("q", q.shape, ("b", "h", "l", "e"), "input", needs_grad=q.needs_grad, src=ctx.ref(q).name),
          Tensor("k", k.shape, ("b", kv_h(k), "s", "e"), "input", needs_grad=k.needs_grad, src=ctx.ref(k).name),
          Tensor("v", v.shape, ("b", kv_h(v), "s", "f"), "input", needs_grad=v.needs_grad, src=ctx.ref(v).name)]
    operands = [((0,), q, "q"), ((1,), k, "k"), ((2,), v, "v")]
    if _live(mask):
        full = (b, h, lq, s)
        ms = (1,) * (4 - len(mask.shape)) + tuple(mask.shape)
        axes = [AxisMap(ch) if n == full[i] and n != 1 else AxisMap(None) for i, (ch, n) in enumerate(zip("bhls", ms))]
        ts.append(Tensor("mask", mask.shape, tuple(axes[4 - len(mask.shape):]), "input", needs_grad=False,
                         src=ctx.ref(mask).name))
        operands.append(((3,), mask, "mask"))
    op = Operator(name, "attention", dims, tuple(ts), Tensor("y", (b, h, lq, f), ("b", "h", "l", "f"), "output"),
                  flops_per_point=2.0 * (e + f) / (e * f), norm_dims=("s",), norm_stats=2,
                  fixed=frozenset({"s", "e", "f"}))
    ctx.emit(node, op, operands)


def _elementwise(ctx: _Ctx, node: Any, vals: list) -> None:
    """n-ary elementwise with broadcasting (ops.elementwise); scalars are free."""
    out = _shape(node)
    if out is None:
        raise ShardplanError("no tensor output")
    tensors = [(p, v) for p, v in _tensor_args(node, vals) if _live(v) or v.kind == "const"]
    live = [(p, v) for p, v in tensors if _live(v)]
    name = ctx.name_for(node)
    short = str(node.target).replace("aten.", "").split(".")[0]
    flops = ELEMENTWISE.get(short, 1.0)
    refs = [ctx.ref(v) for _, v in live]
    if not refs:
        raise ShardplanError("no live operand")
    op = ops.elementwise(name, *refs, flops_per_point=flops, kind=short, letters=_letters(len(out)))
    if op.output.shape != out:  # a constant operand broadcasts the output further
        op = ops.elementwise(name, *refs, ctx.ref(CONST_VAL, out), flops_per_point=flops, kind=short,
                             letters=_letters(len(out)))
    ctx.emit(node, op, [(p, v, f"x{k}") for k, (p, v) in enumerate(live)])


@register("aten.expand.default", "aten.expand_as.default", "aten.broadcast_to.default")
def _expand(ctx: _Ctx, node: Any, vals: list) -> None:
    _elementwise(ctx, node, vals[:1])


@register("aten.view.default", "aten.reshape.default", "aten._unsafe_view.default", "aten.flatten.using_ints",
          "aten.unflatten.int", "aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default",
          "aten.unsqueeze.default", "aten.view_as.default", "aten.reshape_as.default")
def _reshape(ctx: _Ctx, node: Any, vals: list) -> None:
    """Row-major reshape (ops.reshape: the common refinement of both shapes)."""
    x = vals[0]
    out = _shape(node)
    op = ops.reshape(ctx.name_for(node), ctx.ref(x), out)
    ctx.emit(node, op, [((0,), x, "x")])


@register("aten.permute.default", "aten.transpose.int", "aten.t.default", "aten.swapaxes.default",
          "aten.movedim.int", "aten.numpy_T.default")
def _transpose(ctx: _Ctx, node: Any, vals: list) -> None:
    x = vals[0]
    rank = len(x.shape)
    t = str(node.target)
    if t.startswith("aten.permute"):
        perm = [int(p) % rank for p in node.args[1]]
    elif t.startswith(("aten.t.", "aten.numpy_T")):
        perm = list(range(rank))[::-1]
    elif t.startswith("aten.movedim"):
        src, dst = int(node.args[1]) % rank, int(node.args[2]) % rank
        perm = [i for i in range(rank) if i != src]
        perm.insert(dst, src)
    else:
        a, b = int(node.args[1]) % rank, int(node.args[2]) % rank
        perm = list(range(rank))
        perm[a], perm[b] = perm[b], perm[a]
    op = ops.transpose(ctx.name_for(node), ctx.ref(x), perm)
    ctx.emit(node, op, [((0,), x, "x")])


@register("aten.cat.default", "aten.concat.default")
def _cat(ctx: _Ctx, node: Any, vals: list) -> None:
    """``y = cat(x_0, .., x_k; axis)``: part k is read at ``index - start_k`` along the axis (ops.concat).

    A part with no elements (the empty past of a KV cache, often a legacy
    1-D ``(0,)`` tensor whatever the axis) contributes nothing and is left
    out; a concatenation with one part left is that part itself (no
    operator), and one with none left is an empty constant.
    """
    out = _shape(node) or ()
    parts_paths = [((0, j), v) for j, v in enumerate(vals[0]) if isinstance(v, Val) and math.prod(v.shape) > 0]
    if not parts_paths or not out:
        ctx.env[node.name] = Val("const", None, out)
        return
    if len(parts_paths) == 1 and parts_paths[0][1].shape == out:
        v = parts_paths[0][1]
        ctx.env[node.name] = v if _live(v) else Val("const", None, out)
        return
    axis = int(node.args[1]) if len(node.args) > 1 else int(node.kwargs.get("dim", 0))
    axis %= len(out)
    op = ops.concat(ctx.name_for(node), [ctx.ref(v) for _, v in parts_paths], axis)
    ctx.emit(node, op, [(p, v, f"x{k}") for k, (p, v) in enumerate(parts_paths)])


def _whole(op: Operator, tensor: str, axes: Sequence[int]) -> Operator:
    """``op`` with axes ``axes`` of its tensor ``tensor`` read whole and the output dims they indexed fixed.

    For operators whose output element reads a data-dependent or cumulative
    range of an axis (a sort, a scan, an indexed lookup): that axis cannot
    be split, every other one still can.
    """
    t = next(x for x in op.inputs if x.name == tensor)
    gone = {t.axes[a].dim for a in axes if t.axes[a].dim is not None}
    new = dataclasses.replace(t, axes=tuple(AxisMap(None) if i in axes else ax for i, ax in enumerate(t.axes)))
    return dataclasses.replace(op, inputs=tuple(new if x.name == tensor else x for x in op.inputs),
                               fixed=frozenset(op.fixed) | frozenset(gone))


def _broadcast(shapes: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    """The shape index tensors broadcast to (NumPy rules)."""
    import torch

    if not shapes:
        raise ShardplanError("indexing without an index tensor")
    return tuple(int(s) for s in torch.broadcast_shapes(*shapes))


def _axis_arg(node: Any, pos: int, rank: int, default: int = -1) -> int:
    """The ``dim`` argument of ``node`` (positional ``pos`` or keyword), made non-negative."""
    a = node.args[pos] if len(node.args) > pos else node.kwargs.get("dim", default)
    return int(default if a is None else a) % max(rank, 1)


@register("aten.cumsum.default", "aten.cumprod.default")
def _scan(ctx: _Ctx, node: Any, vals: list) -> None:
    """``y[.., i, ..] = sum_{j <= i} x[.., j, ..]`` along ``dim``: that axis is read whole and fixed."""
    x = vals[0]
    out = _shape(node)
    if out is None or out != x.shape:
        raise ShardplanError("scan with a tuple result")
    axis = _axis_arg(node, 1, len(x.shape))
    op = ops.elementwise(ctx.name_for(node), ctx.ref(x), kind=str(node.target).split(".")[1],
                         letters=_letters(len(out)))
    ctx.emit(node, _whole(op, "x0", [axis] if out else []), [((0,), x, "x0")])


def _rows(ctx: _Ctx, name: str, x: Val, out: tuple[int, ...], axis: int, kind: str) -> Operator:
    """An operator over ``out`` (the shape of ``x`` but along ``axis``) reading ``x`` with ``axis`` whole."""
    letters = _letters(len(out))
    acc = [AxisMap(c) if i != axis else AxisMap(None) for i, c in enumerate(letters)]
    op = Operator(name, kind, tuple(zip(letters, out)) or (("u", 1),),
                  (Tensor("x", x.shape, tuple(acc), "input", needs_grad=x.needs_grad, src=ctx.ref(x).name),),
                  Tensor("y", out, tuple(letters), "output"), flops_per_point=1.0)
    return dataclasses.replace(op, fixed=frozenset({letters[axis]}) if out else frozenset())


@register("aten.sort.default", "aten.sort.stable", "aten.topk.default", "aten.max.dim", "aten.min.dim",
          "aten.kthvalue.default", "aten.median.dim")
def _select_along(ctx: _Ctx, node: Any, vals: list) -> None:
    """Values and indices of a selection along ``dim`` (sort, top-k, max): each output reads that axis whole.

    A tuple result: each ``getitem`` becomes one operator (values or
    indices) over its own shape, the selection axis fixed, the others free.
    """
    x = vals[0]
    t = str(node.target)
    pos = 2 if t.startswith(("aten.topk", "aten.kthvalue")) else 1
    if t == "aten.sort.stable":
        axis = int(node.kwargs.get("dim", -1)) % len(x.shape)
    else:
        axis = _axis_arg(node, pos, len(x.shape))
    shapes = [tuple(int(s) for s in m.shape) for m in node.meta["val"]]
    kind = t.split(".")[1]

    def build(c: _Ctx, n: Any, i: int) -> None:
        out = shapes[i]
        keep = len(out) == len(x.shape)
        op = _rows(c, c.name_for(n), x, out if keep else out[:axis] + (1,) + out[axis:], axis, kind)
        if not keep:  # the selection axis is dropped (max.dim without keepdim)
            letters = [d for d, _ in op.dims]
            op = dataclasses.replace(op, output=Tensor("y", out, tuple(ch for j, ch in enumerate(letters)
                                                                        if j != axis), "output"))
        c.emit(n, op, [((), x, "x")])
        c.operands[c.node_op[n.name]] = ()

    items = tuple(Val("op", None, s, x.needs_grad and i == 0) for i, s in enumerate(shapes))
    ctx.env[node.name] = Val("multi", node.name, (), x.needs_grad, items, ("each", build))


@register("aten.histc.default")
def _histogram(ctx: _Ctx, node: Any, vals: list) -> None:
    """Counts of values in bins: every bin reads the whole input (all axes whole, the bins fixed)."""
    x = vals[0]
    out = _shape(node)
    op = ops.elementwise(ctx.name_for(node), ctx.ref(CONST_VAL, out), kind="histogram", letters=_letters(len(out)))
    xt = Tensor("x", x.shape, tuple(AxisMap(None) for _ in x.shape), "input", needs_grad=False, src=ctx.ref(x).name)
    op = dataclasses.replace(op, inputs=(xt,), fixed=frozenset(d for d, _ in op.dims))
    ctx.emit(node, op, [((0,), x, "x")])


@register("aten.one_hot.default")
def _one_hot(ctx: _Ctx, node: Any, vals: list) -> None:
    """``y[.., c] = (x[..] == c)``: a new last axis over the classes, every axis splittable."""
    x = vals[0]
    out = _shape(node)
    letters = _letters(len(out))
    op = ops.elementwise(ctx.name_for(node), ctx.ref(CONST_VAL, out), kind="one_hot", letters=letters)
    xt = Tensor("x", x.shape, tuple(letters[:-1]), "input", needs_grad=False, src=ctx.ref(x).name)
    ctx.emit(node, dataclasses.replace(op, inputs=(xt,)), [((0,), x, "x")])


@register("aten.new_zeros.default", "aten.new_ones.default", "aten.new_empty.default", "aten.new_full.default",
          "aten.zeros_like.default", "aten.ones_like.default", "aten.empty_like.default", "aten.full_like.default")
def _fresh(ctx: _Ctx, node: Any, vals: list) -> None:
    """A new tensor whose values do not depend on the operand's (only its shape and dtype): a constant."""
    ctx.env[node.name] = Val("const", None, _shape(node) or ())


@register("aten.index.Tensor")
def _index(ctx: _Ctx, node: Any, vals: list) -> None:
    """Advanced indexing ``y = x[.., idx_1, .., idx_k, ..]`` by integer tensors (``None`` keeps an axis).

    The indexed axes of ``x`` are read whole (the positions are data); the
    index tensors broadcast to one shape that replaces them in the output
    (in place when they are adjacent, in front otherwise). Every output
    dimension stays splittable: a device reads its slice of the indices and
    the kept axes, and the indexed axes whole.
    """
    x, idx = vals[0], list(vals[1])
    out = _shape(node)
    at = [i for i, v in enumerate(idx) if v is not None and not (isinstance(v, Val) and v.kind == "none")]
    metas = [a.meta.get("val") if hasattr(a, "meta") else None for a in node.args[1]]
    if any(metas[i] is None or metas[i].dtype.is_floating_point or str(metas[i].dtype) == "torch.bool" for i in at):
        raise ShardplanError("indexing by a boolean mask")
    bshape = _broadcast([tuple(metas[i].shape) for i in at])
    adjacent = at == list(range(at[0], at[-1] + 1))
    lead = at[0] if adjacent else 0
    kept = [i for i in range(len(x.shape)) if i not in at]
    letters = _letters(len(out))
    bl = letters[lead:lead + len(bshape)]
    rest = [ch for j, ch in enumerate(letters) if not lead <= j < lead + len(bshape)]
    xa = [AxisMap(None)] * len(x.shape)
    for i, ch in zip(kept, rest):
        xa[i] = AxisMap(ch)
    ts = [Tensor("x", x.shape, tuple(xa), "input", needs_grad=x.needs_grad, src=ctx.ref(x).name)]
    operands = [((0,), x, "x")]
    for i in at:
        v, shp = idx[i], tuple(metas[i].shape)
        if not _live(v):
            continue
        ax = [AxisMap(bl[len(bl) - len(shp) + j]) if n == bshape[len(bshape) - len(shp) + j] and n != 1 else
              AxisMap(None) for j, n in enumerate(shp)]
        ts.append(Tensor(f"i{i}", shp, tuple(ax), "input", needs_grad=False, src=ctx.ref(v).name))
        operands.append(((1, i), v, f"i{i}"))
    op = Operator(ctx.name_for(node), "index", tuple(zip(letters, out)) or (("u", 1),), tuple(ts),
                  Tensor("y", out, tuple(letters), "output"), flops_per_point=0.0)
    ctx.emit(node, op, operands)


@register("aten.gather.default", "aten.take_along_dim.default")
def _gather_dim(ctx: _Ctx, node: Any, vals: list) -> None:
    """``y[.., i, ..] = x[.., idx[.., i, ..], ..]`` along ``dim``: that axis of ``x`` read whole and fixed; the
    other axes of ``x`` follow the output where their extents agree (read whole where ``x`` is larger)."""
    x, idx = vals[0], vals[2]
    out = _shape(node)
    axis = _axis_arg(node, 1, len(x.shape))
    letters = _letters(len(out))
    xa = [AxisMap(c) if i != axis and x.shape[i] == out[i] else AxisMap(None) for i, c in enumerate(letters)]
    ts = [Tensor("x", x.shape, tuple(xa), "input", needs_grad=x.needs_grad, src=ctx.ref(x).name)]
    operands = [((0,), x, "x")]
    if _live(idx):
        ts.append(Tensor("idx", idx.shape, tuple(letters), "input", needs_grad=False, src=ctx.ref(idx).name))
        operands.append(((2,), idx, "idx"))
    op = Operator(ctx.name_for(node), "gather", tuple(zip(letters, out)), tuple(ts),
                  Tensor("y", out, tuple(letters), "output"), flops_per_point=0.0,
                  fixed=frozenset(ch for i, ch in enumerate(letters) if xa[i].dim is None))
    ctx.emit(node, op, operands)


def _inplace(ctx: _Ctx, node: Any, vals: list, describe: Handler, reads_dst: bool, lays_dst: bool = False) -> None:
    """An in-place ATen op ``x.op_(..)`` described as its functional form ``op(x, ..)``.

    The destination is not an operand the run lays out (it is written where
    it lies) unless ``lays_dst`` (the run computes the functional form on the
    planned tiles of ``x``); later readers of it read this operator's result.
    """
    dst = vals[0]
    args = vals if reads_dst else [NONE_VAL] + list(vals[1:])
    try:
        describe(ctx, node, args)
    except ShardplanError as e:
        if "no live operand" not in str(e):
            raise
        ctx.env[node.name] = Val("const", None, _shape(node) or ())
    made = ctx.node_op.get(node.name)
    if made is not None and not lays_dst:
        ctx.operands[made] = tuple((p, t) for p, t in ctx.operands[made] if p != (0,))
    src = node.args[0]
    if isinstance(dst, Val) and dst.shape == (_shape(node) or ()) and hasattr(src, "name"):
        ctx.env[src.name] = ctx.env[node.name]


def _copy(ctx: _Ctx, node: Any, vals: list) -> None:
    """``dst.copy_(src)`` / ``dst.fill_(v)``: the source broadcast to the destination's shape."""
    _elementwise(ctx, node, vals)


for _n in ("copy_", "fill_", "zero_"):
    for _ov in ("default", "Tensor", "Scalar"):
        HANDLERS[f"aten.{_n}.{_ov}"] = lambda c, n, v: _inplace(c, n, v, _copy, reads_dst=False)


def _index_put(ctx: _Ctx, node: Any, vals: list) -> None:
    """``x[idx_1, .., idx_k] = v`` (``+=`` with accumulate): the output is ``x``'s shape; ``v``'s index axes
    are source dims (several may land on one element: reduction dims), the indexed axes of the output
    fixed (the positions are data), the others split freely."""
    x, idx, v = vals[0], list(vals[1]), vals[2]
    out = _shape(node)
    metas = [a.meta.get("val") if hasattr(a, "meta") else None for a in node.args[1]]
    at = [i for i, m in enumerate(metas) if m is not None]
    if any(metas[i].dtype.is_floating_point or str(metas[i].dtype) == "torch.bool" for i in at):
        raise ShardplanError("index_put by a boolean mask")
    if at != list(range(at[0], at[-1] + 1)):
        raise ShardplanError("index_put with non-adjacent index tensors")
    bshape = _broadcast([tuple(metas[i].shape) for i in at])
    letters = _letters(len(out))
    src = _letters(len(bshape), letters)
    dims = list(zip(letters, out)) + list(zip(src, bshape))
    kept = [i for i in range(len(out)) if i not in at]
    vfull = [letters[i] for i in kept[:at[0]]] + list(src) + [letters[i] for i in kept[at[0]:]]
    vs = tuple(v.shape) if isinstance(v, Val) else ()
    va = [AxisMap(ch) if n == dict(dims)[ch] and n != 1 else AxisMap(None)
          for ch, n in zip(vfull[len(vfull) - len(vs):], vs)]
    ts = [Tensor("x", x.shape, tuple(letters), "input", needs_grad=x.needs_grad, src=ctx.ref(x).name)]
    operands = [((0,), x, "x")]
    if _live(v):
        ts.append(Tensor("v", vs, tuple(va), "input", needs_grad=v.needs_grad, src=ctx.ref(v).name))
        operands.append(((2,), v, "v"))
    for i in at:
        shp = tuple(metas[i].shape)
        if _live(idx[i]):
            ax = [AxisMap(src[len(src) - len(shp) + j]) if n == bshape[len(bshape) - len(shp) + j] and n != 1
                  else AxisMap(None) for j, n in enumerate(shp)]
            ts.append(Tensor(f"i{i}", shp, tuple(ax), "input", needs_grad=False, src=ctx.ref(idx[i]).name))
            operands.append(((1, i), idx[i], f"i{i}"))
    op = Operator(ctx.name_for(node), "index_put", tuple(dims), tuple(ts), Tensor("y", out, tuple(letters), "output"),
                  flops_per_point=0.0, fixed=frozenset([letters[i] for i in at] + list(src)))
    ctx.emit(node, op, operands)


HANDLERS["aten.index_put.default"] = _index_put
HANDLERS["aten.index_put_.default"] = lambda c, n, v: _inplace(c, n, v, _index_put, reads_dst=True, lays_dst=True)


@register("transformers.grouped_mm_fallback.default", "aten._grouped_mm.default")
def _grouped_mm(ctx: _Ctx, node: Any, vals: list) -> None:
    """Per-expert products over tokens sorted by expert: ``y[s, n] = sum_k x[s, k] W[e(s), k, n]``.

    ``e(s)`` is the expert whose range of ``offs`` (cumulative token counts)
    holds token ``s``: data. Written as ``sk,ekn->sn`` with the expert dim
    ``e`` a fixed reduction dim (every device reads every expert's weights
    and ``offs`` whole); tokens ``s``, the contraction ``k`` and the output
    features ``n`` split freely. Work ``2 S K N`` (each token meets one
    expert): 2 / E per point of the ``S K N E`` domain.
    """
    x, w = vals[0], vals[1]
    offs, opath = (vals[2], (2,)) if len(vals) > 2 else (ctx.env.get(getattr(node.kwargs.get("offs"), "name", ""),
                                                                     NONE_VAL), ("kw", "offs"))
    if len(x.shape) != 2 or len(w.shape) != 3:
        raise ShardplanError(f"grouped matmul of {x.shape} by {w.shape} (2-D tokens by 3-D experts only)")
    name = ctx.name_for(node)
    refs, operands = _einsum_operands(ctx, ((x, (0,)), (w, (1,))))
    op = ops.einsum(name, "sk,ekn->sn", *refs, flops_per_point=2.0 / w.shape[0], kind="grouped_mm")
    if _live(offs):
        op = dataclasses.replace(op, inputs=op.inputs + (Tensor("offs", offs.shape, ("e",), "input", needs_grad=False,
                                                                src=ctx.ref(offs).name),))
        operands.append((opath, offs, "offs"))
    ctx.emit(node, dataclasses.replace(op, fixed=frozenset(op.fixed) | {"e"}), operands)


@register("aten.split.Tensor", "aten.split_with_sizes.default", "aten.chunk.default", "aten.unbind.int",
          "aten.split.default")
def _split(ctx: _Ctx, node: Any, vals: list) -> None:
    """A tuple result: each ``getitem`` of it becomes a slice of the source (see :func:`_getitem`)."""
    x = vals[0]
    metas = node.meta.get("val")
    shapes = [tuple(int(s) for s in m.shape) for m in metas]
    t = str(node.target)
    if t.startswith("aten.unbind"):
        axis = int(node.args[1]) % len(x.shape) if len(node.args) > 1 else 0
        sizes, squeeze = [1] * len(shapes), True
    else:
        axis = int(node.args[2]) % len(x.shape) if len(node.args) > 2 else 0
        sizes, squeeze = [s[axis] for s in shapes], False
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    items = tuple(Val("op", None, s, x.needs_grad) for s in shapes)
    ctx.env[node.name] = Val("multi", node.name, (), x.needs_grad, items, (x, axis, tuple(starts), tuple(sizes), squeeze))


def _getitem(ctx: _Ctx, node: Any, vals: list) -> None:
    src = vals[0]
    i = int(node.args[1])
    if src.kind != "multi":
        raise ShardplanError("getitem of a non-tuple value")
    if src.source is None:
        ctx.env[node.name] = src.items[i]
        return
    if src.source[0] == "each":
        src.source[1](ctx, node, i)
        return
    if src.source[0] == "whole":
        _, vals0, target, reason = src.source
        ctx.conservative_op(node, list(vals0), f"{target}: {reason}")
        ctx.operands[ctx.node_op[node.name]] = ()
        return
    x, axis, starts, sizes, squeeze = src.source
    name = ctx.name_for(node)
    op = ops.slice_axis(name, ctx.ref(x), axis, starts[i], sizes[i])
    if squeeze:
        out = _shape(node) or ()
        keep = tuple(a for j, a in enumerate(op.output.axes) if j != axis)
        op = dataclasses.replace(op, output=Tensor("y", out, keep, "output"))
    # the executor reads the split's input through the split node: no direct operand
    ctx.emit(node, op, [((), x, "x")], kind="slice")
    ops_name = ctx.node_op[node.name]
    ctx.operands[ops_name] = ()


@register("aten.slice.Tensor")
def _slice(ctx: _Ctx, node: Any, vals: list) -> None:
    x = vals[0]
    out = _shape(node)
    rank = len(x.shape)
    a = list(node.args) + [None] * 5
    axis = int(a[1] or 0) % rank
    start = int(a[2] or 0)
    if start < 0:
        start += x.shape[axis]
    step = int(a[4] or 1)
    if step != 1:
        raise ShardplanError(f"slice with step {step}")
    start = max(0, min(start, x.shape[axis]))
    if out[axis] == x.shape[axis]:
        ctx.env[node.name] = dataclasses.replace(x)  # a full slice is the value itself
        return
    op = ops.slice_axis(ctx.name_for(node), ctx.ref(x), axis, start, out[axis])
    ctx.emit(node, op, [((0,), x, "x")])


@register("aten.select.int")
def _select(ctx: _Ctx, node: Any, vals: list) -> None:
    """``x.select(dim, i)``: the selected axis is read at one index (whole, in the description)."""
    x = vals[0]
    axis = int(node.args[1]) % len(x.shape)
    out = _shape(node)
    letters = _letters(len(out))
    acc = list(letters)
    acc.insert(axis, None)
    op = Operator(ctx.name_for(node), "select", tuple(zip(letters, out)) or (("u", 1),),
                  (Tensor("x", x.shape, tuple(AxisMap(c) for c in acc), "input", needs_grad=x.needs_grad,
                          src=ctx.ref(x).name),),
                  Tensor("y", out, tuple(letters), "output"), flops_per_point=0.0)
    ctx.emit(node, op, [((0,), x, "x")])


@register("aten.index_select.default")
def _index_select(ctx: _Ctx, node: Any, vals: list) -> None:
    """``y = x.index_select(dim, idx)``: the indexed axis is read whole; idx's axis is the output's."""
    x, idx = vals[0], vals[2]
    axis = int(node.args[1]) % len(x.shape)
    out = _shape(node)
    letters = _letters(len(out))
    xa = [AxisMap(c) if i != axis else AxisMap(None) for i, c in enumerate(letters)]
    ts = [Tensor("x", x.shape, tuple(xa), "input", needs_grad=x.needs_grad, src=ctx.ref(x).name)]
    operands = [((0,), x, "x")]
    if _live(idx):
        ts.append(Tensor("idx", idx.shape, (letters[axis],), "input", needs_grad=False, src=ctx.ref(idx).name))
        operands.append(((2,), idx, "idx"))
    op = Operator(ctx.name_for(node), "index_select", tuple(zip(letters, out)), tuple(ts),
                  Tensor("y", out, tuple(letters), "output"), flops_per_point=0.0)
    ctx.emit(node, op, operands)


@register("aten.sum.dim_IntList", "aten.mean.dim", "aten.sum.default", "aten.mean.default", "aten.amax.default",
          "aten.amin.default", "aten.max.default", "aten.min.default", "aten.prod.default", "aten.var.correction",
          "aten.std.correction", "aten.logsumexp.default")
def _reduce(ctx: _Ctx, node: Any, vals: list) -> None:
    """Reduction over ``dim`` (all axes when absent): those dims index no output axis."""
    x = vals[0]
    rank = len(x.shape)
    dims = node.args[1] if len(node.args) > 1 and isinstance(node.args[1], (list, tuple, int)) else None
    dims = node.kwargs.get("dim", dims)
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        axes = list(range(rank))
    else:
        axes = [int(d) % rank for d in ([dims] if isinstance(dims, int) else dims)]
    keep = bool(node.args[2]) if len(node.args) > 2 and isinstance(node.args[2], bool) else bool(
        node.kwargs.get("keepdim", False))
    op = ops.reduce_mean(ctx.name_for(node), ctx.ref(x), axes, keepdims=keep)
    out = _shape(node) or ()
    if op.output.shape != out:
        op = dataclasses.replace(op, output=Tensor("y", out, tuple(AxisMap(None) for _ in out), "output"))
    ctx.emit(node, op, [((0,), x, "x")], kind=str(node.target).replace("aten.", "").split(".")[0])


@register("aten.pad.default", "aten.constant_pad_nd.default")
def _pad(ctx: _Ctx, node: Any, vals: list) -> None:
    """Constant padding: output index ``o`` reads input ``o - lo`` (a partial axis)."""
    x = vals[0]
    pads = [int(p) for p in node.args[1]]
    mode = node.args[2] if len(node.args) > 2 and isinstance(node.args[2], str) else "constant"
    if mode != "constant":
        raise ShardplanError(f"padding mode {mode!r}")
    out = _shape(node)
    rank = len(out)
    letters = _letters(rank)
    acc: list[AxisMap] = [AxisMap(c) for c in letters]
    for k in range(len(pads) // 2):
        ax = rank - 1 - k
        lo, hi = pads[2 * k], pads[2 * k + 1]
        if lo or hi:
            if lo < 0 or hi < 0:
                raise ShardplanError("negative padding")
            acc[ax] = AxisMap(letters[ax], offset=-lo, partial=True)
    op = Operator(ctx.name_for(node), "pad", tuple(zip(letters, out)),
                  (Tensor("x", x.shape, tuple(acc), "input", needs_grad=x.needs_grad, src=ctx.ref(x).name),),
                  Tensor("y", out, tuple(letters), "output"), flops_per_point=0.0)
    ctx.emit(node, op, [((0,), x, "x")])


@register("aten.triu.default", "aten.tril.default", "aten.triu_.default", "aten.tril_.default")
def _triangle(ctx: _Ctx, node: Any, vals: list) -> None:
    """``triu``/``tril``: elementwise, but which elements are kept depends on the row and column indices, so
    the last two dimensions are read whole (fixed); the leading ones stay splittable."""
    if str(node.target).endswith("_.default"):
        _inplace(ctx, node, vals, _elementwise, reads_dst=True)
    else:
        _elementwise(ctx, node, vals)
    made = ctx.node_op.get(node.name)
    if made is not None:
        op = ctx.ops[made]
        ctx.ops[made] = dataclasses.replace(op, fixed=op.fixed | {d for d, _ in op.dims[-2:]})


# every elementwise op, by overload
for _n in ELEMENTWISE:
    for _ov in ("default", "Tensor", "Scalar", "self", "ScalarOther", "Tensor_Scalar", "Tensor_Tensor", "Scalar_Tensor",
                "int", "float"):
        HANDLERS.setdefault(f"aten.{_n}.{_ov}", _elementwise)
HANDLERS["aten.gelu.default"] = _elementwise
for _n in [n for n in ELEMENTWISE if not n.endswith("_")] + ["relu", "silu", "gelu"]:
    for _ov in ("default", "Tensor", "Scalar", "Tensor_Scalar", "Tensor_Tensor"):
        HANDLERS[f"aten.{_n}_.{_ov}"] = lambda c, n, v: _inplace(c, n, v, _elementwise, reads_dst=True)


# ---------------------------------------------------------------------------
# the trace
# ---------------------------------------------------------------------------
def _map_args(args: Any, env: Mapping[str, Val]) -> Any:
    """Replace FX nodes in (nested) args by their values; other leaves stay as they are."""
    import torch.fx

    if isinstance(args, torch.fx.Node):
        return env.get(args.name, CONST_VAL)
    if isinstance(args, (list, tuple)):
        return type(args)(_map_args(a, env) for a in args)
    return args


def _any_live(vals: Any) -> bool:
    if isinstance(vals, Val):
        return vals.kind in ("op", "input", "param", "multi")
    if isinstance(vals, (list, tuple)):
        return any(_any_live(v) for v in vals)
    return False


def trace(module: Any, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None, name: str | None = None,
          handlers: Mapping[str, Handler] | None = None) -> tuple[Graph, TorchTrace]:
    """Capture ``module(*args, **kwargs)`` with :func:`torch.export.export` and describe it.

    Returns ``(graph, info)``. ``handlers`` replaces the default registry
    :data:`HANDLERS` (pass ``{**HANDLERS, "aten.foo.default": my_handler}``
    to add one). Unsupported operators are described conservatively with a
    :class:`ShardplanWarning`.
    """
    import torch
    from torch.export.graph_signature import InputKind

    table = HANDLERS if handlers is None else handlers
    try:
        ep = torch.export.export(module, tuple(args), dict(kwargs or {}))
    except Exception as e:  # torch.export's own errors are long; keep the first line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ShardplanError(f"torch frontend: torch.export could not capture the module: {first}") from e
    from shardplan.torch.saved import reference_bytes

    env: dict[str, Val] = {}
    ctx = _Ctx(env)
    ctx.ref_bytes = reference_bytes(module)
    params = dict(module.named_parameters(remove_duplicate=False))
    canonical: dict[int, str] = {}
    for spec in ep.graph_signature.input_specs:
        pname = spec.arg.name if hasattr(spec.arg, "name") else None
        if pname is None:
            continue
        node = next(n for n in ep.graph.nodes if n.name == pname)
        shape = _shape(node) or ()
        if spec.kind == InputKind.PARAMETER:
            src = params.get(spec.target)
            trainable = bool(src.requires_grad) if src is not None else True
            # tied parameters (one tensor, several names) are exported once per name: one key for all
            key = canonical.setdefault(id(src), spec.target) if src is not None else spec.target
            env[pname] = Val("param", key, shape, trainable and _is_float(node))
        elif spec.kind == InputKind.USER_INPUT:
            env[pname] = Val("input", pname, shape, False)
            ctx.inputs[pname] = shape
        else:  # buffers, constant tensors, tokens
            env[pname] = Val("const", None, shape)
    const_nodes: set[str] = set()
    for node in ep.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "get_attr":
            env[node.name] = Val("const", None, _shape(node) or ())
            const_nodes.add(node.name)
            continue
        vals = list(_map_args(tuple(node.args), env))
        target = str(node.target)
        if target in _SKIP:
            env[node.name] = NONE_VAL
            continue
        if not _any_live(vals) and not _any_live(list(_map_args(tuple(node.kwargs.values()), env))):
            env[node.name] = Val("const", None, _shape(node) or ())
            const_nodes.add(node.name)
            continue
        if _empty(node, vals, target):
            env[node.name] = Val("const", None, _shape(node) or ())
            const_nodes.add(node.name)
            continue
        if node.target is _pyop.getitem:
            try:
                _getitem(ctx, node, vals)
            except ShardplanError as e:
                ctx.conservative_op(node, vals, str(e))
            continue
        if target in CASTS and _casts(node, vals):
            try:
                _cast(ctx, node, vals)
            except (ShardplanError, IndexError, KeyError, TypeError, ValueError) as e:
                ctx.undo(node)
                ctx.conservative_op(node, vals, f"{type(e).__name__}: {e}")
            continue
        if target in IDENTITY or (target.startswith("aten.dropout") and not _dropout_active(node)):
            v = vals[0]
            env[node.name] = dataclasses.replace(v, needs_grad=v.needs_grad and target not in _NO_GRAD
                                                 and _is_float(node))
            continue
        handler = table.get(target)
        if handler is None and target.startswith("aten.dropout"):
            handler = _elementwise
        if handler is None:
            ctx.conservative_op(node, vals, "no handler registered")
            continue
        try:
            handler(ctx, node, vals)
        except (ShardplanError, IndexError, KeyError, TypeError, ValueError) as e:
            ctx.undo(node)
            ctx.conservative_op(node, vals, f"{type(e).__name__}: {e}")
            continue
        want = _shape(node)
        made = ctx.node_op.get(node.name)
        if made is not None and want is not None and tuple(ctx.ops[made].output.shape) != want:
            got = ctx.ops[made].output.shape
            ctx.undo(node)
            ctx.conservative_op(node, vals, f"handler described output {got}, torch gives {want}")
    if not ctx.ops:
        raise ShardplanError("torch frontend: the module does no work on its inputs and parameters (no operators)")
    ctx.share_weights()
    _describe_saved(ctx, ep, module)
    ctx.ops = {n: _with_transient(op) for n, op in ctx.ops.items()}
    used = {t.src for op in ctx.ops.values() for t in op.inputs}
    int_inputs = {n.name for n in ep.graph.nodes if n.op == "placeholder" and n.name in ctx.inputs and not _is_float(n)}
    labelled = label_graph(list(ctx.ops.values()), {k: input_axis_labels(v, True, k in int_inputs)
                                                   for k, v in ctx.inputs.items()})
    graph = Graph(name or type(module).__name__, tuple(labelled), {k: v for k, v in ctx.inputs.items() if k in used})
    info = TorchTrace(ep, dict(ctx.node_op), dict(ctx.operands), {k: tuple(v) for k, v in ctx.param_uses.items()},
                      {k: tuple(v) for k, v in ctx.input_uses.items()}, frozenset(const_nodes),
                      dict(ctx.conservative), dict(ctx.paths), dict(ctx.reasons), _value_ops(ctx))
    return graph, info


def _value_ops(ctx: _Ctx) -> dict[str, str]:
    """Node name -> the operator its value belongs to: the operator made for it, or, for an identity node (a
    cast, a copy), the operator whose value it is; user inputs, parameters and constants have none."""
    out = {k: str(v.key) for k, v in ctx.env.items() if isinstance(v, Val) and v.kind == "op" and v.key in ctx.ops}
    return {**out, **{k: v for k, v in ctx.node_op.items() if v in ctx.ops}}


def _describe_saved(ctx: _Ctx, ep: Any, module: Any) -> None:
    """Set every operator's :attr:`~shardplan.ir.Operator.saved` to what autograd keeps of it
    (:mod:`shardplan.torch.saved`); the attention's handler states what the fused kernel keeps of its own."""
    from shardplan.torch import saved as sv

    ref = sv.reference_bytes(module)
    grads = {k: v.needs_grad for k, v in ctx.env.items() if isinstance(v, Val)}
    elems = {n: max(1, math.prod(op.output.shape)) for n, op in ctx.ops.items()}
    keeps = sv.kept_by_node(ep.graph, grads, {node: ctx.ops[op] for node, op in ctx.node_op.items()}, ref)
    params = frozenset(k for k, v in ctx.env.items() if isinstance(v, Val) and v.kind == "param")
    tiles = sv.saved_tiles(ep.graph, keeps, _value_ops(ctx).get, params, elems, ref)
    ctx.ops = {n: dataclasses.replace(op, saved=tiles[n]) for n, op in ctx.ops.items()}


def _with_transient(op: Operator) -> Operator:
    """``op`` with :attr:`~shardplan.ir.Operator.transient` as eager autograd holds it at its backward step,
    where its handler stated none: the incoming gradient of its output, and a fresh gradient of every input
    and weight that needs one (a weight's then added into its ``.grad``); nothing without a backward."""
    if op.transient or not op.grad_tensors:
        return op
    counts = (1.0, *(1.0 if t.needs_grad else 0.0 for t in op.inputs), *(1.0 if t.needs_grad else 0.0 for t in op.weights))
    return dataclasses.replace(op, transient=counts)


def _dropout_active(node: Any) -> bool:
    """aten.dropout(x, p, train): active unless p == 0 or not training."""
    a = list(node.args) + [None, None, None]
    p, train = a[1], a[2]
    return bool(train) and float(p or 0.0) > 0.0
