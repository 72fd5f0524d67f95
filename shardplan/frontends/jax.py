"""JAX frontend: a jitted function becomes a shardplan :class:`~shardplan.ir.Graph`.

The function is traced once with :func:`jax.make_jaxpr`. Nested calls
(``jit``/``pjit``, ``closed_call``, ``remat``) are inlined; the bodies of
``custom_jvp_call``/``custom_vjp_call`` are read for the graph but the call
itself is kept whole for evaluation, so its custom derivative still applies.
The result is a flat program (:class:`FlatEqn` list, variables numbered
globally) from which two things are derived:

* the graph: one operator per equation that does work or moves data
  (``dot_general`` → einsum, ``conv_general_dilated`` → convolution,
  reductions, windowed reductions, elementwise ops, reshape, concatenation,
  slices); a jaxpr variable maps to a *value* (:class:`_Val`): the output of
  an operator, a graph input, a parameter, or a constant;
* the evaluation order, used by the export to re-run the program with
  sharding constraints on the variables that hold operator outputs
  (:func:`evaluate`).

Views. ``broadcast_in_dim``, ``transpose``, ``squeeze``, a reshape that only
adds or drops axes of extent 1, ``convert_element_type``, ``copy`` and
``stop_gradient`` create no operator: the value keeps its base (the producing
operator, input or parameter) and records, per base axis, which axis of the
view it became. A consumer then indexes the base directly: base axis ``i``
gets the consumer's access map of view axis ``to_view[i]``, or no dimension
when the axis is broadcast (base extent 1). A view that a consumer cannot
read this way (a reshape that merges axes of a transposed value) is first
materialised as a copy operator.

Fusion. An elementwise equation whose only non-constant operand is the
unviewed output of an operator that has no other consumer is absorbed into
that operator: the vertex keeps the producer's iteration domain and its work
per point grows by ``f · |out| / |domain|`` (f = FLOPs per output element of
the elementwise op). The operator's output variable moves to the
elementwise result, so the export constrains the fused value.

Parameters. The pytree leaves of the arguments in ``params_argnums`` are
parameters: an operator that reads one gets it as a *weight* tensor (a
``dot_general`` with a parameter operand is an einsum with a weight). A
parameter read by several operators (weight tying, or reused through a
broadcast) is a weight of each: every consumer pays its own gradient
synchronisation, which over-counts the real (single, summed) gradient
reduction by the number of extra consumers; the parameter's layout in the
export is the one its first consumer asks for (:attr:`TraceInfo.leaf_uses`
keeps them in order). A parameter reshaped in a way that merges or splits
axes is a weight of the reshaped shape, and its leaf is then not mapped to
any operator (left replicated by the export). Every other leaf is a graph
input (data, labels). Constants (literals, ``iota``, values that depend on
no argument) are free and replicated: they are not tensors of any operator.

An unsupported primitive raises :class:`~shardplan.errors.ShardplanError`
naming it and the source line of the equation.
"""

from __future__ import annotations

import dataclasses
import math
import string
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from shardplan import ops
from shardplan.errors import ShardplanError
from shardplan.ir import AxisMap, Graph, Operator, Tensor, TensorRef

__all__ = ["trace", "TraceInfo", "FlatEqn", "Const", "evaluate", "ELEMENTWISE_FLOPS"]


# FLOPs per output element of each elementwise primitive (1 unless stated).
ELEMENTWISE_FLOPS: Mapping[str, float] = {
    **{name: 1.0 for name in (
        "add", "sub", "mul", "div", "rem", "max", "min", "neg", "abs", "sign", "floor", "ceil", "round",
        "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "rsqrt", "sqrt", "cbrt", "square",
        "integer_pow", "pow", "sin", "cos", "tan", "atan2", "erf", "erfc", "erf_inv", "is_finite",
        "select_n", "clamp", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "xor", "nextafter",
        "add_any", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh",
    )},
}

_IDENTITY = frozenset({"convert_element_type", "copy", "copy_p", "stop_gradient", "reduce_precision",
                       "sharding_constraint", "optimization_barrier"})
_INLINE = frozenset({"pjit", "jit", "closed_call", "core_call", "remat", "checkpoint", "custom_lin"})
_CUSTOM = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})
_REDUCE = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
                     "argmax", "argmin"})
_WINDOW = frozenset({"reduce_window_sum", "reduce_window_max", "reduce_window_min"})


# ---------------------------------------------------------------------------
# the flat program
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Const:
    """A constant operand (a literal or a closed-over array)."""

    value: Any


Atom = int | Const


@dataclass(frozen=True, eq=False)
class FlatEqn:
    """One equation of the inlined program.

    Attributes:
        primitive: the JAX primitive.
        params: its parameters.
        invars: operand variable ids (or :class:`Const`).
        outvars: result variable ids (global numbering).
        out_shapes, out_dtypes: of the results.
        where: source location ("file:line (function)") for messages.
        scope: name scope (jax.named_scope / enclosing jit names).
        run: evaluated by :func:`evaluate` (False inside a custom_jvp/vjp body).
        graph: read when building the graph (False for the custom call itself).
        passthrough: for a custom call, the body's result atoms (one per outvar).
    """

    primitive: Any
    params: Mapping[str, Any]
    invars: tuple[Atom, ...]
    outvars: tuple[int, ...]
    out_shapes: tuple[tuple[int, ...], ...]
    out_dtypes: tuple[Any, ...]
    where: str
    scope: str
    run: bool = True
    graph: bool = True
    passthrough: tuple[Atom, ...] = ()

    @property
    def name(self) -> str:
        return self.primitive.name


@dataclass(frozen=True, eq=False)
class TraceInfo:
    """What the export needs besides the graph.

    Attributes:
        eqns: the flat program.
        invars: variable id of every argument leaf (flattened in argument order).
        outvars: the program's results.
        in_tree: pytree structure of the argument tuple.
        out_tree: pytree structure of the function's result.
        leaf_names: readable name per argument leaf (``params['w1']``).
        leaf_shapes: shape per argument leaf.
        param_leaves: indices of the leaves that are parameters.
        op_vars: operator name -> id of the variable holding its output at
            evaluation time (absent when that value only exists inside a
            custom_jvp/vjp body).
        leaf_uses: leaf index -> consumers in graph order, each
            ``(operator name, per leaf axis the dimension indexing it or None)``.
    """

    eqns: tuple[FlatEqn, ...]
    invars: tuple[int, ...]
    outvars: tuple[Atom, ...]
    in_tree: Any
    out_tree: Any
    leaf_names: tuple[str, ...]
    leaf_shapes: tuple[tuple[int, ...], ...]
    param_leaves: frozenset[int]
    op_vars: Mapping[str, int]
    leaf_uses: Mapping[int, tuple[tuple[str, tuple[str | None, ...]], ...]]


def _where(eqn: Any) -> str:
    try:
        from jax._src import source_info_util

        return source_info_util.summarize(eqn.source_info)
    except Exception:  # pragma: no cover - private API moved
        return "<unknown location>"


def _scope(eqn: Any) -> str:
    try:
        return str(eqn.source_info.name_stack)
    except Exception:  # pragma: no cover
        return ""


def _join(*parts: str) -> str:
    return "/".join(p for p in parts if p)


class _Flattener:
    """Inlines nested jaxprs into one list of :class:`FlatEqn` with global variable ids."""

    def __init__(self) -> None:
        self.eqns: list[FlatEqn] = []
        self.next_id = 0

    def fresh(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def run(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Atom], scope: str, run: bool,
            where: str = "") -> list[Atom]:
        """Append ``jaxpr``'s equations; ``where`` is the enclosing call's location (used when an inner one has none)."""
        from jax.extend.core import Literal

        env: dict[Any, Atom] = {}
        for v, c in zip(jaxpr.constvars, consts):
            env[v] = Const(c)
        for v, a in zip(jaxpr.invars, args):
            env[v] = a

        def read(v: Any) -> Atom:
            return Const(v.val) if isinstance(v, Literal) else env[v]

        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            ins = tuple(read(v) for v in eqn.invars)
            sc = _join(scope, _scope(eqn))
            loc = _where(eqn).strip() or where
            if name in _INLINE:
                sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
                inner, cs = (sub.jaxpr, sub.consts) if hasattr(sub, "consts") else (sub, ())
                sub_scope = _join(sc, str(eqn.params.get("name", "")))
                outs = self.run(inner, cs, ins, sub_scope, run, loc)
                for v, a in zip(eqn.outvars, outs):
                    env[v] = a
                continue
            outs_ids = tuple(self.fresh() for _ in eqn.outvars)
            shapes = tuple(tuple(int(s) for s in v.aval.shape) for v in eqn.outvars)
            dtypes = tuple(v.aval.dtype for v in eqn.outvars)
            if name in _CUSTOM:
                sub = eqn.params.get("call_jaxpr", eqn.params.get("fun_jaxpr"))
                inner, cs = (sub.jaxpr, sub.consts) if hasattr(sub, "consts") else (sub, ())
                body = self.run(inner, cs, ins, sc, False, loc)
                self.eqns.append(FlatEqn(eqn.primitive, dict(eqn.params), ins, outs_ids, shapes, dtypes,
                                         loc, sc, run=run, graph=False, passthrough=tuple(body)))
            else:
                self.eqns.append(FlatEqn(eqn.primitive, dict(eqn.params), ins, outs_ids, shapes, dtypes,
                                         loc, sc, run=run, graph=True))
            for v, i in zip(eqn.outvars, outs_ids):
                env[v] = i
        return [read(v) for v in jaxpr.outvars]


# ---------------------------------------------------------------------------
# values and the graph builder
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class _Val:
    """What a variable holds, as a (possibly viewed) base.

    kind: "op" (key = operator name), "input" (key = graph input name),
    "param" (key = leaf index; ``exact`` False when reshaped so that the
    base is no longer the leaf), or "const".
    ``to_view[i]``: the view axis that base axis i became (None: a dropped
    unit axis).
    """

    kind: str
    key: Any
    base_shape: tuple[int, ...]
    shape: tuple[int, ...]
    to_view: tuple[int | None, ...]
    needs_grad: bool = False
    exact: bool = True

    @property
    def is_identity(self) -> bool:
        return self.shape == self.base_shape and self.to_view == tuple(range(len(self.shape)))

    def retarget(self, shape: Sequence[int], mapping: Callable[[int], int | None]) -> "_Val":
        """The same base seen through one more view: old view axis v becomes ``mapping(v)``."""
        tv = tuple(None if v is None else mapping(v) for v in self.to_view)
        return dataclasses.replace(self, shape=tuple(int(s) for s in shape), to_view=tv)


def _base(kind: str, key: Any, shape: Sequence[int], needs_grad: bool, exact: bool = True) -> _Val:
    shape = tuple(int(s) for s in shape)
    return _Val(kind, key, shape, shape, tuple(range(len(shape))), needs_grad, exact)


_CONST = _Val("const", None, (), (), ())


def _is_float(dtype: Any) -> bool:
    import numpy as np

    try:
        return bool(np.issubdtype(np.dtype(dtype), np.inexact))
    except TypeError:
        return "float" in str(dtype)


def _letters(n: int, avoid: str = "") -> list[str]:
    pool = [c for c in string.ascii_lowercase if c not in avoid]
    if n > len(pool):
        return [f"d{i}" for i in range(n)]
    return pool[:n]


class _GraphPass:
    """Builds operators from the flat program (one method per primitive family)."""

    def __init__(self, flat: Sequence[FlatEqn], leaf_vals: Mapping[int, _Val], input_leaf: Mapping[str, int],
                 outvars: Sequence[Atom]):
        self.ops: dict[str, Operator] = {}  # insertion order = graph order
        self.env: dict[int, _Val] = {}
        self.op_var: dict[str, int] = {}  # the variable holding the operator's output now (fusion moves it)
        self.identity_vars: dict[str, list[int]] = {}  # every variable that held it with its own shape
        self.view_src: dict[int, Atom] = {}  # a view's variable -> the variable it views
        self.leaf_uses: dict[int, list[tuple[str, tuple[str | None, ...]]]] = {}
        self.inputs: dict[str, tuple[int, ...]] = {}
        self.input_leaf = dict(input_leaf)
        self.alias, self.uses = _count_uses(flat, outvars)
        for var, val in leaf_vals.items():
            self.env[var] = val
            if val.kind == "input":
                self.inputs[val.key] = val.base_shape

    def resolve(self, a: Atom) -> Atom:
        """The graph-view variable behind ``a`` (a custom call's result is its body's result)."""
        return self.alias.get(a, a) if isinstance(a, int) else a

    def sole_chain(self, a: Atom, target: int | None) -> bool:
        """True when ``a`` is ``target`` or a chain of views of it, each variable with one consumer."""
        while isinstance(a, int):
            if self.uses.get(a, 0) != 1:
                return False
            if a == target:
                return True
            a = self.resolve(self.view_src.get(a, -1))
        return False

    def set_view(self, eqn: FlatEqn, v: _Val) -> None:
        self.env[eqn.outvars[0]] = v
        self.view_src[eqn.outvars[0]] = self.resolve(eqn.invars[0])

    def unique(self, base: str) -> str:
        base = base or "op"
        taken = lambda n: n in self.ops or n in self.inputs  # noqa: E731
        if not taken(base):
            return base
        i = 2
        while taken(f"{base}_{i}"):
            i += 1
        return f"{base}_{i}"

    # -- reading values ---------------------------------------------------
    def val(self, a: Atom) -> _Val:
        return _CONST if isinstance(a, Const) else self.env[a]

    def tensor(self, v: _Val, name: str, view_axes: Sequence[AxisMap | str | None]) -> Tensor | None:
        """The tensor an operator reads for value ``v``, given the access of each *view* axis."""
        if v.kind == "const":
            return None
        axes: list[AxisMap] = []
        for i, t in enumerate(v.to_view):
            a = view_axes[t] if t is not None else None
            if t is None or v.base_shape[i] != v.shape[t]:
                a = None
            axes.append(a if isinstance(a, AxisMap) else AxisMap(a))
        if v.kind == "param":
            return Tensor(name, v.base_shape, tuple(axes), "weight", needs_grad=v.needs_grad)
        return Tensor(name, v.base_shape, tuple(axes), "input", needs_grad=v.needs_grad, src=v.key)

    def operands(self, vals: Sequence[_Val], accesses: Sequence[Sequence[AxisMap | str | None]],
                 ) -> tuple[list[Tensor], list[Tensor], list[tuple[int, _Val]]]:
        """(inputs, weights, param uses) for the non-constant operands."""
        ins, ws, uses = [], [], []
        for v, acc in zip(vals, accesses):
            if v.kind == "param":
                t = self.tensor(v, f"w{len(ws)}", acc)
                ws.append(t)
                uses.append((len(ins) + len(ws) - 1, v))
            elif v.kind != "const":
                t = self.tensor(v, f"x{len(ins)}", acc)
                ins.append(t)
        return ins, ws, uses

    # -- adding operators -------------------------------------------------
    def add(self, eqn: FlatEqn, kind: str, dims: Sequence[tuple[str, int]], vals: Sequence[_Val],
            accesses: Sequence[Sequence[AxisMap | str | None]], out_axes: Sequence[AxisMap | str | None],
            flops: float, out_index: int = 0, **extra: Any) -> _Val:
        ins, ws, _ = self.operands(vals, accesses)
        out_shape = eqn.out_shapes[out_index]
        name = self.unique(_join(eqn.scope, eqn.name).replace(" ", ""))
        dims = list(dims) or [("u", 1)]
        op = Operator(name, kind, tuple(dims), tuple(ins), Tensor("y", out_shape, tuple(out_axes), "output"),
                      tuple(ws), flops_per_point=flops, **extra)
        return self.register(op, eqn.outvars[out_index], eqn.out_dtypes[out_index], vals, ws)

    def register(self, op: Operator, var: int, dtype: Any, vals: Sequence[_Val] = (), ws: Sequence[Tensor] = (),
                 ) -> _Val:
        self.ops[op.name] = op
        self.op_var[op.name] = var
        self.identity_vars[op.name] = [var]
        for t in op.inputs:
            if t.src in self.inputs:
                self._record_leaf(self.input_leaf[t.src], op, t)
        params = [v for v in vals if v.kind == "param"]
        for v, t in zip(params, ws):
            if v.exact:
                self._record_leaf(v.key, op, t)
        grad = _is_float(dtype) and (any(t.needs_grad for t in op.inputs) or any(t.needs_grad for t in op.weights))
        v = _base("op", op.name, op.output.shape, grad)
        self.env[var] = v
        return v

    def _record_leaf(self, leaf: int, op: Operator, t: Tensor) -> None:
        dims = tuple(a.dim if a.is_plain else None for a in t.axes)
        self.leaf_uses.setdefault(leaf, []).append((op.name, dims))

    def materialize(self, v: _Val, eqn: FlatEqn) -> _Val:
        """A view turned into a copy operator (transpose / broadcast), so that it has a base of its own shape."""
        if v.is_identity or v.kind == "const":
            return v
        letters = _letters(len(v.shape))
        name = self.unique(_join(eqn.scope, "copy"))
        t = self.tensor(v, "x0", letters)
        assert t is not None
        ins, ws = ((t,), ()) if t.role == "input" else ((), (t,))
        op = Operator(name, "copy", tuple(zip(letters, v.shape)), ins, Tensor("y", v.shape, tuple(letters), "output"),
                      ws, flops_per_point=0.0)
        self.ops[name] = op
        if v.kind == "param" and v.exact:
            self._record_leaf(v.key, op, t)
        elif v.kind == "input":
            self._record_leaf(self.input_leaf[v.key], op, t)
        nv = _base("op", name, v.shape, v.needs_grad)
        return nv

    # -- the dispatch -----------------------------------------------------
    def run(self, flat: Sequence[FlatEqn]) -> None:
        for eqn in flat:
            if not eqn.graph:
                for o, a in zip(eqn.outvars, eqn.passthrough):
                    self.env[o] = self.val(a)
                continue
            vals = [self.val(a) for a in eqn.invars]
            name = eqn.name
            if all(v.kind == "const" for v in vals):
                for o in eqn.outvars:
                    self.env[o] = _CONST
                continue
            handler = _HANDLERS.get(name)
            if handler is None and name in ELEMENTWISE_FLOPS:
                handler = _elementwise
            if handler is None:
                raise ShardplanError(
                    f"jax frontend: unsupported primitive {name!r} at {eqn.where} "
                    f"(scope {eqn.scope or '-'}, operands {[tuple(v.shape) for v in vals]}); "
                    "supported: dot_general, conv_general_dilated, elementwise ops, reductions, "
                    "reduce_window_*, broadcast_in_dim, reshape, transpose, squeeze, concatenate, slice, "
                    "dynamic_slice, split, nested jit/custom_jvp/custom_vjp"
                )
            handler(self, eqn, vals)


def _count_uses(flat: Sequence[FlatEqn], outvars: Sequence[Atom]) -> tuple[dict[int, int], dict[int, int]]:
    """(alias, uses): a custom call's result -> its body's result; consumers of every graph-view variable."""
    alias: dict[int, int] = {}
    for e in flat:
        if not e.graph:
            for o, a in zip(e.outvars, e.passthrough):
                if isinstance(a, int):
                    alias[o] = alias.get(a, a)
    uses: dict[int, int] = {}

    def use(a: Atom) -> None:
        if isinstance(a, int):
            a = alias.get(a, a)
            uses[a] = uses.get(a, 0) + 1

    for e in flat:
        if e.graph:
            for a in e.invars:
                use(a)
    for a in outvars:
        use(a)
    return alias, uses


# ---------------------------------------------------------------------------
# handlers: one per primitive family
# ---------------------------------------------------------------------------
def _elementwise(g: _GraphPass, eqn: FlatEqn, vals: list[_Val]) -> None:
    """n-ary elementwise op: dims = output axes; fused into a sole producer when possible."""
    out_shape = eqn.out_shapes[0]
    flops = ELEMENTWISE_FLOPS.get(eqn.name, 1.0)
    live = [(a, v) for a, v in zip(eqn.invars, vals) if v.kind != "const"]
    if len(live) == 1:
        a, v = live[0]
        a = g.resolve(a)
        if v.kind == "op" and _unit_view(v) and v.shape == out_shape and g.sole_chain(a, g.op_var.get(v.key)):
            op = g.ops[v.key]
            fused = dataclasses.replace(op, flops_per_point=op.flops_per_point + flops * math.prod(out_shape) / op.points)
            g.ops[op.name] = fused
            g.op_var[op.name] = eqn.outvars[0]
            if v.is_identity:
                g.identity_vars[op.name].append(eqn.outvars[0])
            g.env[eqn.outvars[0]] = dataclasses.replace(v, needs_grad=v.needs_grad and _is_float(eqn.out_dtypes[0]))
            return
    letters = _letters(len(out_shape))
    accesses = []
    for v in vals:
        acc = [letters[j] if (len(v.shape) == len(out_shape) and v.shape[j] == out_shape[j]) else None
               for j in range(len(v.shape))]
        accesses.append(acc)
    g.add(eqn, eqn.name, tuple(zip(letters, out_shape)), vals, accesses, letters, flops)


def _unit_view(v: _Val) -> bool:
    """True when the view only adds or drops extent-1 axes (no broadcast, no permutation)."""
    if math.prod(v.shape) != math.prod(v.base_shape):
        return False
    order = [t for i, t in enumerate(v.to_view) if v.base_shape[i] != 1]
    return order == sorted(order) and all(t is not None for t in order)


def _identity(g: _GraphPass, eqn: FlatEqn, vals: list[_Val]) -> None:
    for o, a, v, dt in zip(eqn.outvars, eqn.invars, vals, eqn.out_dtypes):
        grad = v.needs_grad and _is_float(dt) and eqn.name != "stop_gradient"
        g.env[o] = dataclasses.replace(v, needs_grad=grad)
        g.view_src[o] = g.resolve(a)


def _broadcast_in_dim(g: _GraphPass, eqn: FlatEqn, vals: list[_Val]) -> None:
    bd = eqn.params["broadcast_dimensions"]
    g.set_view(eqn, vals[0].retarget(eqn.out_shapes[0], lambda v: bd[v]))


def _transpose(g: _GraphPass, eqn: FlatEqn, vals: list[_Val]) -> None:
    perm = eqn.params["permutation"]
    inv = {p: j for j, p in enumerate(perm)}
    g.set_view(eqn, vals[0].retarget(eqn.out_shapes[0], lambda v: inv[v]))


def _squeeze(g: _GraphPass, eqn: FlatEqn, vals: list[_Val]) -> None:
    v = vals[0]
    drop = {d % len(v.shape) for d in eqn.params["dimensions"]}
    keep = [i for i in range(len(v.shape)) if i not in drop]
    pos = {old: new for new, old in enumerate(keep)}
    g.set_view(eqn, v.retarget(eqn.out_shapes[0], lambda a: pos.get(a)))


def _unit_reshape_map(old: Sequence[int], new: Sequence[int]) -> dict[int, int] | None:
    """If ``new`` only adds or drops extent-1 axes of ``old``: old axis -> new axis (non-unit axes)."""
    oi = [i for i, s in enumerate(old) if s != 1]
    ni = [i for i, s in enumerate(new) if s != 1]
    if [old[i] for i in oi] != [new[i] for i in ni]:
        return None
    return dict(zip(oi, ni))


def _reshape(g: _GraphPass, eqn: FlatEqn, vals: list[_Val]) -> None:
    v = vals[0]
    new = eqn.out_shapes[0]
    if eqn.params.get("dimensions") is not None:
        raise ShardplanError(f"jax frontend: reshape with dimensions= at {eqn.where} is not supported")
    m = _unit_reshape_map(v.shape, new)
    if m is not None:
        g.set_view(eqn, v.retarget(new, lambda a: m.get(a)))
        return
    if v.kind == "param":
        # the reshaped parameter is a weight of its new shape; its leaf is no longer mapped
        g.env[eqn.outvars[0]] = _base("param", v.key, new, v.needs_grad, exact=False)
        return
    base = g.materialize(v, eqn)
    ref = TensorRef(base.key, base.shape, is_input=base.kind == "input", needs_grad=base.needs_grad)
    op = ops.reshape(g.unique(_join(eqn.scope, "reshape")), ref, new)
    g.register(op, eqn.outvars[0], eqn.out_dtypes[0])


def _dot_general(g: _GraphPass, eqn: FlatEqn, vals: list[_Val]) -> None:
    """``dot_general`` as the einsum ``batch,lhs-free,rhs-free`` ← sum over contracting dims."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    ls, rs = vals[0].shape, vals[1].shape
    n_b, n_c = len(lb), len(lc)
    lf = [i for i in range(len(ls)) if i not in lc and i not in lb]
    rf = [i for i in range(len(rs)) if i not in rc and i not in rb]
    letters = _letters(n_b + len(lf) + len(rf) + n_c)
    bl, ll, rl, cl = (letters[:n_b], letters[n_b:n_b + len(lf)], letters[n_b + len(lf):n_b + len(lf) + len(rf)],
                      letters[n_b + len(lf) + len(rf):])
    la: list[str | None] = [None] * len(ls)
    ra: list[str | None] = [None] * len(rs)
    dims: list[tuple[str, int]] = []
    for k, (i, j) in enumerate(zip(lb, rb)):
        la[i], ra[j] = bl[k], bl[k]
        dims.append((bl[k], max(ls[i], rs[j])))
    for k, i in enumerate(lf):
        la[i] = ll[k]
        dims.append((ll[k], ls[i]))
    for k, j in enumerate(rf):
        ra[j] = rl[k]
        dims.append((rl[k], rs[j]))
    for k, (i, j) in enumerate(zip(lc, rc)):
        la[i], ra[j] = cl[k], cl[k]
        dims.append((cl[k], max(ls[i], rs[j])))
    g.add(eqn, "einsum", dims, vals, [la, ra], bl + ll + rl, 2.0)


def _conv(g: _GraphPass, eqn: FlatEqn, vals: list[_Val]) -> None:
    """``conv_general_dilated`` (any layout, groups 1, no input dilation) as a convolution domain.

    ``y[b, n, o_1..o_k] = sum_{c, r_1..r_k} x[b, c, s_i*o_i + d_i*r_i - lo_i] w[n, c, r_1..r_k]``;
    dims ``b c o_1..o_k n r_1..r_k`` (``bchwnrs`` in 2-D, as ops.conv2d).
    """
    p = eqn.params
    if any(d != 1 for d in p["lhs_dilation"]) or p["feature_group_count"] != 1 or p["batch_group_count"] != 1:
        raise ShardplanError(
            f"jax frontend: conv_general_dilated at {eqn.where} uses lhs_dilation {p['lhs_dilation']}, "
            f"feature_group_count {p['feature_group_count']}, batch_group_count {p['batch_group_count']}; "
            "only 1, 1, 1 are supported"
        )
    dn = p["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    x, w = vals
    out = eqn.out_shapes[0]
    k = len(lhs_spec) - 2
    if k > 3:
        raise ShardplanError(f"jax frontend: {k}-d convolution at {eqn.where} is not supported")
    sp, win = list("hwz"[:k]), list("rst"[:k])
    dims = [("b", out[out_spec[0]]), ("c", x.shape[lhs_spec[1]])]
    dims += [(sp[i], out[out_spec[2 + i]]) for i in range(k)]
    dims += [("n", out[out_spec[1]])]
    dims += [(win[i], w.shape[rhs_spec[2 + i]]) for i in range(k)]
    xa: list[AxisMap | str | None] = [None] * len(x.shape)
    xa[lhs_spec[0]], xa[lhs_spec[1]] = "b", "c"
    for i in range(k):
        lo = p["padding"][i][0]
        xa[lhs_spec[2 + i]] = AxisMap(sp[i], win[i], int(p["window_strides"][i]), int(p["rhs_dilation"][i]), -int(lo))
    wa: list[AxisMap | str | None] = [None] * len(w.shape)
    wa[rhs_spec[0]], wa[rhs_spec[1]] = "n", "c"
    for i in range(k):
        wa[rhs_spec[2 + i]] = win[i]
    oa: list[str] = [""] * len(out)
    oa[out_spec[0]], oa[out_spec[1]] = "b", "n"
    for i in range(k):
        oa[out_spec[2 + i]] = sp[i]
    g.add(eqn, "conv", dims, vals, [xa, wa], oa, 2.0)


def _reduce(g: _GraphPass, eqn: FlatEqn, vals: list[_Val]) -> None:
    """Reduction over ``axes``: those dims index no output axis, so they are reduction dims."""
    v = vals[0]
    axes = {a % max(1, len(v.shape)) for a in eqn.params["axes"]}
    letters = _letters(len(v.shape))
    out_axes = [letters[i] for i in range(len(v.shape)) if i not in axes]
    g.add(eqn, eqn.name, tuple(zip(letters, v.shape)), vals[:1], [letters], out_axes, 1.0)


def _reduce_window(g: _GraphPass, eqn: FlatEqn, vals: list[_Val]) -> None:
    """Pooling: ``y[.., o, ..] = op_r x[.., s*o + d*r - lo, ..]`` on every windowed axis."""
    p = eqn.params
    if any(d != 1 for d in p["base_dilation"]):
        raise ShardplanError(f"jax frontend: {eqn.name} at {eqn.where} with base_dilation is not supported")
    v = vals[0]
    out = eqn.out_shapes[0]
    letters = _letters(len(out), avoid="rst")
    dims = list(zip(letters, out))
    acc: list[AxisMap | str] = []
    for i, (kw, st, (lo, hi), dl) in enumerate(zip(p["window_dimensions"], p["window_strides"], p["padding"],
                                                    p["window_dilation"])):
        if kw == 1 and st == 1 and lo == 0 and hi == 0:
            acc.append(letters[i])
            continue
        wn = f"r{i}"
        dims.append((wn, int(kw)))
        acc.append(AxisMap(letters[i], wn, int(st), int(dl), -int(lo)))
    g.add(eqn, "pool", dims, vals[:1], [acc], letters, 1.0)


def _partial(dim: str, offset: int, stride: int) -> AxisMap | None:
    """Access ``stride * dim + offset`` of an input axis whose extent differs from ``dim``'s.

    The IR requires a *plain* input axis (offset 0, stride 1) to have its
    dimension's extent, so a part read from index 0 (a slice from the start,
    the first operand of a concatenation) cannot be written exactly; it is
    read whole instead (no dimension): exact when the axis is not split,
    an over-estimate of the redistribution when it is.
    """
    if offset == 0 and stride == 1:
        return None
    return AxisMap(dim, stride=stride, offset=offset)


def _concatenate(g: _GraphPass, eqn: FlatEqn, vals: list[_Val]) -> None:
    """Operand k is read at ``index - start_k`` along the concatenated axis."""
    ax = eqn.params["dimension"]
    out = eqn.out_shapes[0]
    letters = _letters(len(out))
    accesses, start = [], 0
    for v in vals:
        acc: list[AxisMap | str | None] = [letters[i] for i in range(len(out))]
        acc[ax] = _partial(letters[ax], -start, 1)
        accesses.append(acc)
        start += v.shape[ax]
    g.add(eqn, "concat", tuple(zip(letters, out)), vals, accesses, letters, 0.0)


def _slice(g: _GraphPass, eqn: FlatEqn, vals: list[_Val]) -> None:
    """``y[i] = x[start + stride * i]`` per axis."""
    p = eqn.params
    out = eqn.out_shapes[0]
    strides = p.get("strides") or (1,) * len(out)
    letters = _letters(len(out))
    acc = [letters[i] if (st == 0 and s == 1 and out[i] == vals[0].shape[i]) else _partial(letters[i], int(st), int(s))
           for i, (st, s) in enumerate(zip(p["start_indices"], strides))]
    g.add(eqn, "slice", tuple(zip(letters, out)), vals[:1], [acc], letters, 0.0)


def _dynamic_slice(g: _GraphPass, eqn: FlatEqn, vals: list[_Val]) -> None:
    """A slice at a run-time offset: a cut axis is read whole (its position is unknown)."""
    v = vals[0]
    out = eqn.out_shapes[0]
    letters = _letters(len(out))
    acc = [letters[i] if out[i] == v.shape[i] else None for i in range(len(out))]
    g.add(eqn, "dynamic_slice", tuple(zip(letters, out)), vals[:1], [acc], letters, 0.0)


def _split(g: _GraphPass, eqn: FlatEqn, vals: list[_Val]) -> None:
    """``lax.split``: one slice operator per piece."""
    ax = eqn.params["axis"]
    start = 0
    for k, out in enumerate(eqn.out_shapes):
        letters = _letters(len(out))
        acc: list[AxisMap | str | None] = [letters[i] for i in range(len(out))]
        acc[ax] = _partial(letters[ax], start, 1)
        g.add(eqn, "slice", tuple(zip(letters, out)), vals[:1], [acc], letters, 0.0, out_index=k)
        start += out[ax]


def _constant(g: _GraphPass, eqn: FlatEqn, vals: list[_Val]) -> None:
    for o in eqn.outvars:
        g.env[o] = _CONST


_HANDLERS: dict[str, Callable[[_GraphPass, FlatEqn, list[_Val]], None]] = {
    "dot_general": _dot_general,
    "conv_general_dilated": _conv,
    "broadcast_in_dim": _broadcast_in_dim,
    "transpose": _transpose,
    "squeeze": _squeeze,
    "reshape": _reshape,
    "concatenate": _concatenate,
    "slice": _slice,
    "dynamic_slice": _dynamic_slice,
    "split": _split,
    "iota": _constant,
    **{n: _identity for n in _IDENTITY},
    **{n: _reduce for n in _REDUCE},
    **{n: _reduce_window for n in _WINDOW},
}


# ---------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------
def trace(fn: Callable[..., Any], *example_args: Any, params_argnums: Sequence[int] = (0,),
          name: str | None = None) -> tuple[Graph, TraceInfo]:
    """Trace ``fn(*example_args)`` into a graph and the information the export needs.

    Parameters:
        fn: a JAX-traceable function (typically a loss ``fn(params, batch) -> scalar``).
        example_args: arguments of the right shapes and dtypes (arrays or
            ``jax.ShapeDtypeStruct`` leaves).
        params_argnums: which arguments hold parameters; their leaves become
            operator weights, the other arguments' leaves graph inputs.
        name: graph name (default: the function's name).

    Returns:
        ``(graph, info)``; ``info.op_vars`` maps each operator to the jaxpr
        variable holding its output, ``info.leaf_uses`` each leaf to its consumers.
    """
    import jax

    closed = jax.make_jaxpr(fn)(*example_args)
    leaves_with_path, in_tree = jax.tree_util.tree_flatten_with_path(tuple(example_args))
    out_tree = jax.tree_util.tree_structure(jax.eval_shape(fn, *example_args))
    pset = {int(a) for a in params_argnums}
    names, shapes, param_leaves = [], [], set()
    for i, (path, leaf) in enumerate(leaves_with_path):
        argnum = path[0].idx  # type: ignore[attr-defined]
        rest = jax.tree_util.keystr(path[1:])
        names.append(f"arg{argnum}{rest}")
        shapes.append(tuple(int(s) for s in jax.numpy.shape(leaf)))
        if argnum in pset:
            param_leaves.add(i)
    flat = _Flattener()
    in_ids = [flat.fresh() for _ in names]
    outs = flat.run(closed.jaxpr, closed.consts, in_ids, "", run=True)

    leaf_vals: dict[int, _Val] = {}
    input_leaf: dict[str, int] = {}
    for i, (var, nm, shp) in enumerate(zip(in_ids, names, shapes)):
        leaf = leaves_with_path[i][1]
        if i in param_leaves:
            leaf_vals[var] = _base("param", i, shp, _is_float(_dtype(leaf)))
        else:
            leaf_vals[var] = _base("input", nm, shp, False)
            input_leaf[nm] = i
    gp = _GraphPass(flat.eqns, leaf_vals, input_leaf, outs)
    gp.run(flat.eqns)
    if not gp.ops:
        raise ShardplanError("jax frontend: the function does no work on its arguments (no operators)")
    used_inputs = {t.src for op in gp.ops.values() for t in op.inputs}
    graph_inputs = {k: v for k, v in gp.inputs.items() if k in used_inputs}
    graph = Graph(name or getattr(fn, "__name__", "jax"), tuple(gp.ops.values()), graph_inputs)
    op_vars = _op_run_vars(gp.identity_vars, gp.alias, _run_vars(flat.eqns, in_ids))
    info = TraceInfo(tuple(flat.eqns), tuple(in_ids), tuple(outs), in_tree, out_tree, tuple(names), tuple(shapes),
                     frozenset(param_leaves), op_vars,
                     {k: tuple(v) for k, v in gp.leaf_uses.items()})
    return graph, info


def _dtype(leaf: Any) -> Any:
    import numpy as np

    return getattr(leaf, "dtype", None) or np.result_type(leaf)


def _op_run_vars(identity_vars: Mapping[str, Sequence[int]], alias: Mapping[int, int], run_vars: set[int],
                 ) -> dict[str, int]:
    """Operator -> the first variable that exists at evaluation time and holds its output (skipped if none).

    A variable inside a custom_jvp/vjp body stands for the call's result when it is the body's result.
    """
    outer: dict[int, int] = {}
    for o, a in sorted(alias.items()):
        if o in run_vars:
            outer.setdefault(a, o)
    out = {}
    for name, vars_ in identity_vars.items():
        for var in vars_:
            if var in run_vars or var in outer:
                out[name] = var if var in run_vars else outer[var]
                break
    return out


def _run_vars(flat: Sequence[FlatEqn], in_ids: Sequence[int]) -> set[int]:
    """Variables that exist when the program is evaluated (not only inside a custom call's body)."""
    out = set(in_ids)
    for e in flat:
        if e.run:
            out.update(e.outvars)
    return out


def evaluate(info: TraceInfo, leaves: Sequence[Any], constrain: Mapping[int, Callable[[Any], Any]] | None = None,
             ) -> list[Any]:
    """Run the flat program on argument leaves; ``constrain[var]`` is applied to that variable when produced.

    Mirrors ``jax.core.eval_jaxpr``: each equation is bound with its
    primitive's bind parameters; custom_jvp/vjp calls are bound whole.
    """
    constrain = constrain or {}
    env: dict[int, Any] = {}
    for var, x in zip(info.invars, leaves):
        env[var] = constrain[var](x) if var in constrain else x

    def read(a: Atom) -> Any:
        return a.value if isinstance(a, Const) else env[a]

    for e in info.eqns:
        if not e.run:
            continue
        params = e.primitive.get_bind_params(e.params)
        if isinstance(params, tuple):  # older JAX: (subfuns, params)
            subfuns, params = params
            ans = e.primitive.bind(*subfuns, *[read(a) for a in e.invars], **params)
        else:
            ans = e.primitive.bind(*[read(a) for a in e.invars], **params)
        outs = ans if e.primitive.multiple_results else [ans]
        for var, x in zip(e.outvars, outs):
            env[var] = constrain[var](x) if var in constrain else x
    return [read(a) for a in info.outvars]
