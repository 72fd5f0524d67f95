"""Lowering: the flat program of a JAX function becomes a shardplan :class:`~shardplan.ir.Graph`.

A jaxpr variable maps to a *value* (:class:`_Val`): the output of an
operator, a graph input, a parameter, or a constant. One handler per
primitive family (registered with :func:`handles`) turns an equation into
an operator, a view or a constant. Operators are built with the
constructors of :mod:`shardplan.ops` on the *view* shapes the equation
sees, then each operand is re-expressed on its base (:meth:`_GraphPass.adopt`),
so a traced concatenation, gather or reshape has exactly the description
``ops.concat`` / ``ops.gather`` / ``ops.reshape`` give it.

Views. ``broadcast_in_dim``, ``transpose``, ``squeeze``, a reshape that only
adds or drops axes of extent 1, ``convert_element_type``, ``copy`` and
``stop_gradient`` create no operator: the value keeps its base and records,
per base axis, which axis of the view it became. A consumer then indexes
the base directly: base axis ``i`` gets the consumer's access map of view
axis ``to_view[i]``, or no dimension when the axis is broadcast. A view
that a consumer cannot read this way (a reshape that merges axes of a
transposed value) is first materialised as a copy operator.

Fusion. An elementwise equation whose only non-constant operand is the
unviewed output of an operator that has no other consumer is absorbed into
that operator: its work per point grows by ``f · |out| / |domain|``
(f = FLOPs per output element); the operator's output variable moves to
the elementwise result.

XLA's kernels. The program runs compiled by XLA, which fuses chains of memory-bound operators
(elementwise, reductions, copies) into kernels that keep the values passed inside on chip: every such
operator gets the :class:`~shardplan.ir.KernelIO` of :func:`shardplan.jax.fusion.xla_kernels`, and the cost
model charges it only the HBM traffic of its kernel (:mod:`shardplan.cost.chain`).

Parameters. The pytree leaves of the arguments in ``params_argnums`` are
parameters: an operator that reads one gets it as a *weight*. A parameter
read by several operators (tied weights) is a weight of each; its first
consumer owns it (its leaf's layout is the one that consumer asks for) and
every other reader names the owner (:attr:`~shardplan.ir.Tensor.owner`), so
the cost model charges one copy of its state, and a weight edge between
owner and reader moves the parameter when their layouts differ
(:func:`shardplan.cost.edge.weight_edge_cost`). A static slice of a parameter is one layer's weight when an
unrolled ``scan`` cuts it (its axes map to the leaf's), the leaf read through the slice's window when nothing else
reads the leaf, and else a slice operator reading the whole leaf through an offset, linked to its owner as a
``split`` piece is (docs/jax.md, "Slices of a parameter"). A parameter reshaped so that axes merge or split is a
weight of the new shape and its leaf is left replicated.

Constants (literals, ``iota``, anything computed from no argument, and
random numbers: the RNG primitives take a key that is data, but their
output is not a tensor any plan should move) are free and replicated: no
operator reads them as a tensor, so they have no edge cost.

Unsplittable work. ``sort``, ``top_k``, the cumulative reductions and
``rev`` are operators whose dimension along the sorted / scanned /
reversed axis is *fixed* (never split). ``cond`` and ``while`` (control
flow with data-dependent trip counts) are operators whose every dimension
is fixed and which read their operands whole: they run replicated.

Batch. The leading axis of every data argument is the batch axis; the
dimension of an operator that indexes a value carrying the batch axis is
named ``b`` (and nothing else is), so data parallelism on a traced graph
(:func:`shardplan.baselines.data_parallel`) splits the batch wherever it
flows.

Names. An operator is named after the equation's name scope (the flax
module path, ``jax.named_scope``, enclosing ``jit`` names) and primitive,
e.g. ``FlaxGPT2LMHeadModule/transformer/h/0/attn/c_attn/dot_general``; its
dimensions carry readable labels (``batch``, ``seq``, ``in``, ``out``,
``heads``, ...: :mod:`shardplan.labels`) that reports show with their
extents.

Conservative operators. A primitive with no handler, or whose handler
refuses its arguments (a convolution with ``batch_group_count`` > 1, a
reshape with ``dimensions=``), and the control flow above, are described
*conservatively*: one operator per result whose every dimension is fixed
and which reads its operands whole, so it runs replicated and its operands
are gathered. Each is listed in :attr:`TraceInfo.conservative`
(:class:`~shardplan.result.ConservativeOp`: operator, primitive, name-stack
path, reason; the plan and its report carry the list) and announced with a
:class:`ConservativeWarning`, since the plan around it may be weaker than
the model deserves.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from shardplan import ops
from shardplan.errors import ShardplanError
from shardplan.ir import AxisMap, Graph, KernelIO, Operator, Tensor, TensorRef, unique_name
from shardplan.jax.attention import ATTENTION
from shardplan.jax.flatten import TOP, Atom, Const, FlatEqn, Program, flatten, join_scope
from shardplan.jax.fusion import xla_kernels
from shardplan.labels import input_axis_labels, label_dims, output_axis_labels

__all__ = ["trace", "TraceInfo", "handles", "supported_primitives", "ELEMENTWISE_FLOPS", "ConservativeWarning"]


class ConservativeWarning(UserWarning):
    """A primitive was described conservatively (not split, operands gathered): see the module docstring."""


# FLOPs per output element of each elementwise primitive (1 unless stated).
ELEMENTWISE_FLOPS: Mapping[str, float] = {
    **{name: 1.0 for name in (
        "add", "sub", "mul", "div", "rem", "max", "min", "neg", "abs", "sign", "floor", "ceil", "round",
        "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "rsqrt", "sqrt", "cbrt", "square",
        "integer_pow", "pow", "sin", "cos", "tan", "atan2", "erf", "erfc", "erf_inv", "is_finite",
        "select_n", "clamp", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "xor", "nextafter",
        "add_any", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "lgamma", "digamma",
        "shift_left", "shift_right_logical", "shift_right_arithmetic", "population_count", "clz",
        "bitcast_convert_type", "real", "imag", "conj",
    )},
}

_IDENTITY = ("convert_element_type", "copy", "copy_p", "stop_gradient", "reduce_precision",
             "sharding_constraint", "optimization_barrier", "mesh_cast", "pvary")
_FREE = ("iota", "random_seed", "random_wrap", "random_unwrap", "random_bits", "random_split", "random_fold_in",
         "threefry2x32", "rng_bit_generator", "rng_uniform")
_REDUCE = ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor",
           "argmax", "argmin")
_WINDOW = ("reduce_window_sum", "reduce_window_max", "reduce_window_min")
_CUMULATIVE = ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")
_OPAQUE = ("cond", "while", "platform_index")

Handler = Callable[["_GraphPass", FlatEqn, list["_Val"]], None]
_HANDLERS: dict[str, Handler] = {}


def handles(*primitives: str) -> Callable[[Handler], Handler]:
    """Register a handler for the named primitives."""

    def reg(fn: Handler) -> Handler:
        for p in primitives:
            _HANDLERS[p] = fn
        return fn

    return reg


def supported_primitives() -> list[str]:
    """Every primitive the lowering understands (registered handlers and elementwise ops), sorted."""
    return sorted(set(_HANDLERS) | set(ELEMENTWISE_FLOPS))


@dataclass(frozen=True, eq=False)
class TraceInfo:
    """What the export needs besides the graph.

    Attributes:
        program: the flat program (:mod:`shardplan.jax.flatten`).
        in_tree: pytree structure of the argument tuple.
        out_tree: pytree structure of the function's result.
        leaf_names: readable name per argument leaf (``arg0['w1']``).
        leaf_shapes: shape per argument leaf.
        param_leaves: indices of the leaves that are parameters.
        op_vars: operator name -> id of the variable holding its output at
            evaluation time (absent when that value only exists inside a
            custom_jvp/vjp body).
        leaf_uses: leaf index -> consumers in graph order, each
            ``(operator name, per leaf axis the dimension indexing it or None)``.
        reads: operator name -> the operands its equation reads, each
            ``(equation index, operand slot, per axis of the operand the dimension blocking it or None)``.
        batch_leaves: indices of the data leaves whose axis 0 is the batch.
        conservative: the operators described conservatively (:class:`~shardplan.result.ConservativeOp`,
            program order; module = the equation's name-stack path); empty when every primitive was described.
    """

    program: Program
    in_tree: Any
    out_tree: Any
    leaf_names: tuple[str, ...]
    leaf_shapes: tuple[tuple[int, ...], ...]
    param_leaves: frozenset[int]
    op_vars: Mapping[str, int]
    leaf_uses: Mapping[int, tuple[tuple[str, tuple[str | None, ...]], ...]]
    reads: Mapping[str, tuple[tuple[int, int, tuple[str | None, ...]], ...]]
    batch_leaves: frozenset[int] = frozenset()
    conservative: tuple[Any, ...] = ()

    def renamed(self, mapping: Mapping[str, str]) -> "TraceInfo":
        """The same information with operators renamed (``mapping``: old name -> new name; others kept)."""
        r = lambda n: mapping.get(n, n)  # noqa: E731
        return dataclasses.replace(
            self, op_vars={r(k): v for k, v in self.op_vars.items()}, reads={r(k): v for k, v in self.reads.items()},
            leaf_uses={i: tuple((r(n), d) for n, d in uses) for i, uses in self.leaf_uses.items()},
            conservative=tuple(dataclasses.replace(c, operator=r(c.operator)) for c in self.conservative))


# ---------------------------------------------------------------------------
# values
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class _Val:
    """What a variable holds, as a (possibly viewed) base.

    kind: "op" (key = operator name), "input" (key = graph input name),
    "param" (key = leaf index), or "const".
    ``to_view[i]``: the view axis that base axis i became (None: a dropped unit axis).
    ``leaf_axes[i]`` (params): the leaf axis that base axis i is (None: a cut
    axis); ``leaf_axes`` None: the base is not an axis-wise part of the leaf.
    ``batch``: the base axis that carries the batch, if any.
    ``part`` (params): which static slice of the leaf the base is (None: the whole leaf).
    ``window`` (params): per base axis, ``(start, stride)`` where the view reads only
    ``base[start + stride * i]`` (a slice of the leaf, the leaf its base); None: the view reads what its shape says.
    """

    kind: str
    key: Any
    base_shape: tuple[int, ...]
    shape: tuple[int, ...]
    to_view: tuple[int | None, ...]
    needs_grad: bool = False
    leaf_axes: tuple[int | None, ...] | None = None
    batch: int | None = None
    part: Any = None
    window: tuple[tuple[int, int], ...] | None = None

    @property
    def is_identity(self) -> bool:
        return self.shape == self.base_shape and self.to_view == tuple(range(len(self.shape)))

    @property
    def view_batch(self) -> int | None:
        """The view axis carrying the batch (None when none, or when it was broadcast away)."""
        if self.batch is None:
            return None
        t = self.to_view[self.batch]
        return t if t is not None and self.shape[t] == self.base_shape[self.batch] else None

    def retarget(self, shape: Sequence[int], mapping: Callable[[int], int | None]) -> "_Val":
        """The same base seen through one more view: old view axis v becomes ``mapping(v)``."""
        tv = tuple(None if v is None else mapping(v) for v in self.to_view)
        return dataclasses.replace(self, shape=tuple(int(s) for s in shape), to_view=tv)


def _base(kind: str, key: Any, shape: Sequence[int], needs_grad: bool, leaf_axes: Any = None,
          batch: int | None = None) -> _Val:
    shape = tuple(int(s) for s in shape)
    return _Val(kind, key, shape, shape, tuple(range(len(shape))), needs_grad, leaf_axes, batch)


def _const(shape: Sequence[int]) -> _Val:
    return _base("const", None, shape, False)


def _is_float(dtype: Any) -> bool:
    """True for every floating or complex dtype, the extended floats too (bfloat16, the float8 formats):
    ``jnp.issubdtype`` knows them, NumPy's does not (``np.issubdtype(bfloat16, np.inexact)`` is False)."""
    import jax.numpy as jnp

    try:
        return bool(jnp.issubdtype(dtype, jnp.inexact))
    except TypeError:
        return "float" in str(dtype)


def _blocking_dim(a: AxisMap) -> str | None:
    """The dimension that blocks an axis: a plain axis's dim or a merged axis's leading dim."""
    return a.dim if a.dim is not None and (a.is_plain or a.inner) else None


def _window_dim(a: AxisMap) -> str | None:
    """The dimension that blocks an axis of an activation a static slice reads: as :func:`_blocking_dim`, and a
    cut axis (``index = start + i``, stride 1) by the slice's own dim, so that the operand is read split as the
    slice's result is (blocks of its whole extent over the same mesh axis) and XLA moves the window's halo, not
    the whole axis (docs/jax.md, "Slices of an activation")."""
    if a.dim is not None and a.partial and a.stride == 1 and a.window is None:
        return a.dim
    return _blocking_dim(a)


def _rename(op: Operator, mapping: Mapping[str, str]) -> Operator:
    """``op`` with its dimensions renamed (every access map, normalised and fixed dims follow)."""
    if not mapping:
        return op
    r = lambda d: mapping.get(d, d) if d is not None else None  # noqa: E731

    def axis(a: AxisMap) -> AxisMap:
        return dataclasses.replace(a, dim=r(a.dim), window=r(a.window), inner=tuple(r(d) for d in a.inner))

    def tensor(t: Tensor) -> Tensor:
        return dataclasses.replace(t, axes=tuple(axis(a) for a in t.axes))

    return dataclasses.replace(
        op, dims=tuple((r(d), e) for d, e in op.dims), inputs=tuple(tensor(t) for t in op.inputs),
        weights=tuple(tensor(t) for t in op.weights), output=tensor(op.output),
        norm_dims=tuple(r(d) for d in op.norm_dims), fixed=frozenset(r(d) for d in op.fixed),
        causal=None if op.causal is None else dataclasses.replace(op.causal, query=r(op.causal.query),
                                                                  key=r(op.causal.key)))


# ---------------------------------------------------------------------------
# the graph pass
# ---------------------------------------------------------------------------
class _GraphPass:
    """Builds operators from the flat program (one handler per primitive family)."""

    def __init__(self, program: Program, leaf_vals: Mapping[int, _Val], input_leaf: Mapping[str, int]):
        self.ops: dict[str, Operator] = {}  # insertion order = graph order
        self.env: dict[int, _Val] = {}
        self.op_var: dict[str, int] = {}  # the variable holding the operator's output now (fusion moves it)
        self.identity_vars: dict[str, list[int]] = {}  # every variable that held it with its own shape
        self.view_src: dict[int, Atom] = {}  # a view's variable -> the variable it views
        self.op_eqn: dict[str, int] = {}  # operator -> the equation that made it (scan ties)
        self.tails: dict[str, list[tuple[str, int]]] = {}  # operator -> fused elementwise (primitive, live slot)
        self.leaf_uses: dict[int, list[tuple[str, tuple[str | None, ...]]]] = {}
        self.reads: dict[str, list[tuple[int, int, tuple[str | None, ...]]]] = {}
        self.weight_keys: dict[str, list[tuple[Any, Any]]] = {}  # operator -> (leaf, part) of each of its weights
        self.weight_leaf_axes: dict[tuple[str, int], tuple | None] = {}  # (operator, weight index) -> leaf axes
        self.axis_labels: dict[str, tuple[str | None, ...]] = {}  # operator / graph input -> its axes' labels
        self.inputs: dict[str, tuple[int, ...]] = {}
        self.input_leaf = dict(input_leaf)
        self.conservative: dict[str, tuple[str, str, str]] = {}  # operator -> (primitive, name stack, reason)
        self.out_dtype: dict[str, Any] = {}  # operator -> the dtype of its output
        self.operand_dtypes: dict[str, tuple[list[Any], list[Any]]] = {}  # operator -> its inputs', weights' dtypes
        self.var_dtype: dict[int, Any] = {o: d for e in program.eqns for o, d in zip(e.outvars, e.out_dtypes)}
        self.alias, self.uses = _count_uses(program)
        self.layer_slices = _layer_slices(program)
        self.eqn_index = -1
        for var, val in leaf_vals.items():
            self.env[var] = val
            if val.kind == "input":
                self.inputs[val.key] = val.base_shape

    def resolve(self, a: Atom) -> Atom:
        """The graph-view variable behind ``a`` (a kept call's result is its body's result)."""
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

    def read_elsewhere(self, a: Atom) -> bool:
        """True when ``a``, or a variable it is a view of, has another consumer than the one reading ``a``."""
        a = self.resolve(a)
        while isinstance(a, int):
            if self.uses.get(a, 0) > 1:
                return True
            a = self.resolve(self.view_src[a]) if a in self.view_src else None
        return False

    def set_view(self, eqn: FlatEqn, v: _Val) -> None:
        self.env[eqn.outvars[0]] = v
        self.view_src[eqn.outvars[0]] = self.resolve(eqn.invars[0])

    def unique(self, base: str) -> str:
        return unique_name(base.replace(" ", ""), lambda n: n in self.ops or n in self.inputs)

    # -- reading values ---------------------------------------------------
    def val(self, a: Atom) -> _Val:
        if isinstance(a, Const):
            import numpy as np

            return _const(np.shape(a.value))
        if a not in self.env and a in self.alias:
            return self.val(self.alias[a])
        return self.env[a]

    def tensor(self, v: _Val, name: str, view_axes: Sequence[AxisMap | str | None]) -> Tensor | None:
        """The tensor an operator reads for value ``v``, given the access of each *view* axis."""
        if v.kind == "const":
            return None
        axes: list[AxisMap] = []
        for i, t in enumerate(v.to_view):
            a = view_axes[t] if t is not None else None
            a = a if isinstance(a, AxisMap) else AxisMap(a)
            if t is not None and v.base_shape[i] != v.shape[t]:
                start, stride = v.window[i] if v.window is not None else (0, 0)
                plain = stride and a.is_plain
                a = AxisMap(a.dim, stride=stride, offset=start, partial=True) if plain else AxisMap(None)
            elif t is None:
                a = AxisMap(None)
            axes.append(a)
        if v.kind == "param":
            return Tensor(name, v.base_shape, tuple(axes), "weight", needs_grad=v.needs_grad)
        return Tensor(name, v.base_shape, tuple(axes), "input", needs_grad=v.needs_grad, src=v.key)

    @staticmethod
    def ref(v: _Val, k: int) -> TensorRef:
        """A stand-in reference of the *view* shape, for an ops constructor (re-based by :meth:`adopt`)."""
        return TensorRef(f"_operand{k}", v.shape, needs_grad=v.needs_grad)

    # -- adding operators -------------------------------------------------
    def adopt(self, eqn: FlatEqn, op: Operator, vals: Sequence[_Val], out_index: int = 0,
              fixed: Sequence[str] = (), inserted_axis: int | None = None,
              hints: Mapping[str, str] | None = None, slots: Sequence[int] | None = None) -> _Val:
        """Register ``op``, built on ``self.ref`` stand-ins of ``vals`` (in order), with its operands re-based.

        Constants are dropped (free, replicated), parameters become weights,
        everything else inputs from their producing operator or graph input.
        The dimension indexing a batch-carrying operand axis is renamed ``b``;
        the operator is named after the equation's scope. ``inserted_axis``:
        the stand-ins have a unit axis there that the equation's operands lack.
        ``hints``: labels the handler gives some dimensions (:mod:`shardplan.labels`). ``slots``: the
        equation's operand index of each of ``vals`` (default their positions; a handler that leaves operands
        out says which it kept).
        """
        if len(op.inputs) != len(vals) or op.weights:
            raise AssertionError(f"{op.name}: an adopted operator reads exactly its stand-ins")
        ins: list[Tensor] = []
        ws: list[Tensor] = []
        reads: list[tuple[int, int, tuple[str | None, ...]]] = []
        wkeys: list[tuple[Any, Any]] = []
        tlabels: dict[str, tuple[str | None, ...]] = {}
        in_dtypes: list[Any] = []
        w_dtypes: list[Any] = []
        batch_dim = None
        for slot, (v, t) in enumerate(zip(vals, op.inputs)):
            if v.kind == "const":
                continue
            same_rank = len(t.axes) == len(v.shape)
            vb = v.view_batch
            if batch_dim is None and vb is not None and same_rank and t.axes[vb].is_plain:
                batch_dim = t.axes[vb].dim
            block = _window_dim if op.kind == "slice" and v.kind != "param" else _blocking_dim
            read = [block(a) for a in t.axes] if same_rank else [None] * len(v.shape)
            if inserted_axis is not None:
                del read[inserted_axis]
            reads.append((self.eqn_index, slot if slots is None else int(slots[slot]), tuple(read)))
            operand = eqn.invars[slot if slots is None else int(slots[slot])]
            dtype = self.var_dtype.get(self.resolve(operand)) if isinstance(operand, int) else None
            if v.kind == "param":
                ws.append(self.tensor(v, f"w{len(ws)}", t.axes))
                wkeys.append((v.key, v.part))
                w_dtypes.append(dtype)
            else:
                ins.append(self.tensor(v, f"x{len(ins)}", t.axes))
                in_dtypes.append(dtype)
                if v.key in self.axis_labels:
                    tlabels[ins[-1].name] = self.axis_labels[v.key]
        name = self.unique(join_scope(eqn.scope, eqn.name))
        self.weight_keys[name] = wkeys
        self.operand_dtypes[name] = (in_dtypes, w_dtypes)
        op = dataclasses.replace(op, name=name, inputs=tuple(ins), weights=tuple(ws),
                                 fixed=op.fixed | frozenset(fixed))
        mapping: dict[str, str] = {}
        if batch_dim is not None and batch_dim != "b":
            mapping = {batch_dim: "b"}
            if "b" in op.extents:
                mapping["b"] = ops.letters(1, avoid=op.dim_names + ("b",))[0]
        elif batch_dim is None and "b" in op.extents:
            mapping = {"b": ops.letters(1, avoid=op.dim_names + ("b",))[0]}
        op = _rename(op, mapping)
        hinted = {mapping.get(d, d): lab for d, lab in (hints or {}).items()}
        op = dataclasses.replace(op, dim_labels=label_dims(op, tlabels, hinted, "b" if batch_dim else None))
        reads = [(k, s, tuple(mapping.get(d, d) if d else None for d in dims)) for k, s, dims in reads]
        self.reads[name] = reads
        out_batch = None
        if batch_dim is not None:
            out_batch = next((i for i, a in enumerate(op.output.axes) if a.is_plain and a.dim == "b"), None)
        return self.register(op, eqn.outvars[out_index], eqn.out_dtypes[out_index], vals, out_batch)

    def share_weights(self) -> None:
        """Give every parameter read by several operators (the same (leaf, part)) one owner.

        The owner is the reader whose layout the leaf takes (its first consumer, :attr:`leaf_uses`), else
        the first reader made; every other reader of it in the same shape and axis order gets
        :attr:`~shardplan.ir.Tensor.owner` (a reader that sees it reshaped or permuted keeps its own).
        """
        readers: dict[tuple[Any, Any], list[tuple[str, int]]] = {}
        for name, keys in self.weight_keys.items():
            if name not in self.ops:
                continue
            for i, key in enumerate(keys):
                readers.setdefault(key, []).append((name, i))
        for key, rs in readers.items():
            if len({n for n, _ in rs}) < 2:
                continue
            first = [n for n, _ in self.leaf_uses.get(key[0], ())]
            rs = sorted(rs, key=lambda r: first.index(r[0]) if r[0] in first else len(first))
            oname, oi = rs[0]
            owner = self.ops[oname].weights[oi]
            for name, i in rs[1:]:
                op = self.ops[name]
                t = op.weights[i]
                if name == oname or t.shape != owner.shape or \
                        self.weight_leaf_axes.get((name, i)) != self.weight_leaf_axes.get((oname, oi)):
                    continue
                self.ops[name] = dataclasses.replace(op, weights=tuple(
                    dataclasses.replace(w, owner=(oname, owner.name)) if j == i else w
                    for j, w in enumerate(op.weights)))

    def register(self, op: Operator, var: int, dtype: Any, vals: Sequence[_Val] = (),
                 out_batch: int | None = None) -> _Val:
        self.ops[op.name] = op
        self.out_dtype[op.name] = dtype
        self.axis_labels[op.name] = output_axis_labels(op)
        self.op_eqn[op.name] = self.eqn_index
        self.op_var[op.name] = var
        self.identity_vars[op.name] = [var]
        for t in op.inputs:
            if t.src in self.inputs:
                self._record_leaf(self.input_leaf[t.src], op, t, None)
        params = [v for v in vals if v.kind == "param"]
        for i, (v, t) in enumerate(zip(params, op.weights)):
            self.weight_leaf_axes[(op.name, i)] = None if v.leaf_axes is None else tuple(v.leaf_axes)
            if v.leaf_axes is not None:
                self._record_leaf(v.key, op, t, v.leaf_axes)
        grad = _is_float(dtype) and any(t.needs_grad for t in op.inputs + op.weights)
        v = _base("op", op.name, op.output.shape, grad, batch=out_batch)
        self.env[var] = v
        return v

    def _record_leaf(self, leaf: int, op: Operator, t: Tensor, leaf_axes: Sequence[int | None] | None) -> None:
        dims = [a.dim if a.is_plain else None for a in t.axes]
        if leaf_axes is not None:
            full: list[str | None] = [None] * (max((a for a in leaf_axes if a is not None), default=-1) + 1)
            for d, la in zip(dims, leaf_axes):
                if la is not None:
                    full[la] = d
            dims = full
        self.leaf_uses.setdefault(leaf, []).append((op.name, tuple(dims)))

    def materialize(self, v: _Val, eqn: FlatEqn) -> _Val:
        """A view turned into a copy operator (transpose / broadcast), so that it has a base of its own shape."""
        if v.is_identity or v.kind == "const":
            return v
        letters = ops.letters(len(v.shape))
        name = self.unique(join_scope(eqn.scope, "copy"))
        t = self.tensor(v, "x0", letters)
        assert t is not None
        ins, ws = ((t,), ()) if t.role == "input" else ((), (t,))
        if ws:
            self.weight_keys[name] = [(v.key, v.part)]
            self.weight_leaf_axes[(name, 0)] = None if v.leaf_axes is None else tuple(v.leaf_axes)
        op = Operator(name, "copy", tuple(zip(letters, v.shape)), ins, Tensor("y", v.shape, tuple(letters), "output"),
                      ws, flops_per_point=0.0)
        base = self.axis_labels.get(v.key) if v.kind != "param" else None
        op = dataclasses.replace(op, dim_labels=label_dims(op, {"x0": base} if base else {}, {}, None))
        self.ops[name] = op
        self.axis_labels[name] = output_axis_labels(op)
        self.op_eqn[name] = self.eqn_index
        if v.kind == "param" and v.leaf_axes is not None:
            self._record_leaf(v.key, op, t, v.leaf_axes)
        elif v.kind == "input":
            self._record_leaf(self.input_leaf[v.key], op, t, None)
        return _base("op", name, v.shape, v.needs_grad, batch=v.view_batch)

    # -- the dispatch -----------------------------------------------------
    def run(self, program: Program) -> None:
        for k, eqn in enumerate(program.eqns):
            self.eqn_index = k
            if not eqn.graph:
                if eqn.call_id is not None:  # a kept remat call: its body reads the call's operands
                    for b, a in zip(eqn.body_in, eqn.invars):
                        self.env[b] = self.val(a)
                        self.view_src[b] = self.resolve(a)
                continue  # its results are its body's (self.alias)
            vals = [self.val(a) for a in eqn.invars]
            name = eqn.name
            if vals and all(v.kind == "const" for v in vals) or name in _FREE:
                for o, s in zip(eqn.outvars, eqn.out_shapes):
                    self.env[o] = _const(s)
                continue
            if _zero_extent(self, eqn, vals):
                continue
            handler = _HANDLERS.get(name)
            if handler is None and name in ELEMENTWISE_FLOPS:
                handler = _elementwise
            if handler is None:
                _conservative(self, eqn, vals, f"no handler for this primitive (at {eqn.where})")
                continue
            made = len(self.ops)
            try:
                handler(self, eqn, vals)
            except ShardplanError as e:
                if len(self.ops) != made or any(o in self.env for o in eqn.outvars):
                    raise  # the handler failed half-way: nothing sound to fall back on
                _conservative(self, eqn, vals, str(e).removeprefix("jax frontend: "))

    def conservative_ops(self) -> tuple[Any, ...]:
        """The operators described conservatively, as the plan lists them (program order)."""
        from shardplan.result import ConservativeOp

        return tuple(ConservativeOp(n, prim, scope or "<top>", reason)
                     for n, (prim, scope, reason) in self.conservative.items() if n in self.ops)


def _conservative(g: _GraphPass, eqn: FlatEqn, vals: list[_Val], reason: str) -> None:
    """One operator per result whose every dimension is fixed, reading every operand whole (it runs replicated,
    its operands gathered), recorded in ``g.conservative`` and announced with a :class:`ConservativeWarning`."""
    import warnings

    warnings.warn(f"jax frontend: primitive {eqn.name!r} in {eqn.scope or '<top>'!r} ({reason}): described "
                  "conservatively (not split, operands gathered)", ConservativeWarning, stacklevel=4)
    for k, out in enumerate(eqn.out_shapes):
        names = ops.letters(len(out)) or ["u"]
        ins = tuple(Tensor(f"x{j}", v.shape, (None,) * len(v.shape), "input", src="_") for j, v in enumerate(vals))
        op = Operator("_", eqn.name, tuple(zip(names, out or (1,))), ins,
                      Tensor("y", out, tuple(names[:len(out)]), "output"), flops_per_point=1.0,
                      fixed=frozenset(names))
        v = g.adopt(eqn, op, vals, out_index=k)
        g.conservative[v.key] = (eqn.name, eqn.scope, reason)


def _zero_extent(g: _GraphPass, eqn: FlatEqn, vals: list[_Val]) -> bool:
    """An equation that touches a tensor with a zero extent (an empty slice concatenated back, a zero-length
    sequence): such a tensor holds nothing, so it costs nothing to compute, store or move. A result with a zero
    extent, or one computed from an empty operand (a sum over an empty axis, a product contracting one), is a
    constant; a concatenation reads its non-empty operands only. Returns whether the equation was handled."""
    if any(0 in tuple(s) for s in eqn.out_shapes):
        for o, s in zip(eqn.outvars, eqn.out_shapes):
            g.env[o] = _const(s)
        return True
    kept = [k for k, v in enumerate(vals) if 0 not in v.shape]
    if len(kept) == len(vals):
        return False
    if eqn.name != "concatenate" or not kept:
        for o, s in zip(eqn.outvars, eqn.out_shapes):
            g.env[o] = _const(s)
        return True
    if len(kept) == 1:  # the one non-empty operand is the result
        v = vals[kept[0]]
        g.env[eqn.outvars[0]] = v
        g.view_src[eqn.outvars[0]] = g.resolve(eqn.invars[kept[0]])
        return True
    parts = [vals[k] for k in kept]
    g.adopt(eqn, ops.concat("_", [g.ref(v, j) for j, v in enumerate(parts)], eqn.params["dimension"]), parts,
            slots=kept)
    return True


# What JAX's linearisation keeps of a primitive (its residuals): nothing (linear, or no gradient at all), its
# operands (bilinear ones when another operand needs a gradient; log reads its input), its result (exp), or, for
# the other elementwise primitives, one value of its own size (the derivative: 1 - tanh^2, a relu mask, n x^(n-1)).
_READS_NOTHING = frozenset({
    "add", "sub", "neg", "add_any", "concatenate", "reshape", "copy", "copy_p", "transpose", "pad", "slice",
    "dynamic_slice", "dynamic_update_slice", "gather", "scatter-add", "scatter_add", "reduce_sum", "cumsum",
    "select_n", "broadcast_in_dim", "squeeze", "expand_dims", "convert_element_type", "reduce_precision", "rev",
    "reduce_window_sum", "conj", "real", "imag", "stop_gradient",
    "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "xor", "sign", "floor", "ceil", "round", "is_finite",
    "argmax", "argmin", "shift_left", "shift_right_logical", "shift_right_arithmetic", "population_count", "clz",
    "nextafter", "bitcast_convert_type"})
_READS_RESULT = frozenset({"exp", "exp2"})
_READS_INPUT = frozenset({"log", "log1p"})
_BILINEAR = frozenset({"dot_general", "conv_general_dilated", "mul"})
_TAIL_LINEAR = frozenset({"mul", "div"})  # by a constant: linear in the live operand (div: when it is the numerator)


def _nonlinear(program: Program, op: Operator, eqn: int | None, tails: Sequence[tuple[str, int]]) -> bool:
    """Whether ``op``'s backward reads forward values: its main primitive or a fused elementwise one is
    nonlinear (a product of two values, an exponential, a quotient by a value), as :func:`backward_saved`
    classifies them; a copy is linear."""
    main = "copy" if op.kind == "copy" or eqn is None or not 0 <= eqn < len(program.eqns) else program.eqns[eqn].name
    if main not in _READS_NOTHING:
        return True
    return any(not (t in _READS_NOTHING or (t in _TAIL_LINEAR and (t == "mul" or slot == 0))) for t, slot in tails)


def backward_saved(program: Program, operators: Mapping[str, Operator], op_eqn: Mapping[str, int],
                   tails: Mapping[str, Sequence[tuple[str, int]]],
                   recomputed: frozenset[str] = frozenset()) -> dict[str, float]:
    """Per operator, the output tiles JAX's backward pass keeps (:attr:`shardplan.ir.Operator.saved`).

    An operator's values are its main primitive's result ``r0`` and, after each
    fused elementwise primitive ``i`` (in ``tails``), ``r_i``; the last is its
    output; every one has the output's size. Kept, one output tile each:

    * its output when a consumer's main primitive reads it: bilinear
      primitives (``dot_general``, ``conv``, ``mul``) read an operand when
      another of their tensors needs a gradient; linear and
      non-differentiable ones (additions, reshapes, gathers, sums,
      comparisons) never; the others always;
    * per nonlinear elementwise primitive of the operator (main or fused),
      one value: its result (``exp``), its input (``log``), or else the
      derivative JAX computes in the forward pass (``1 - tanh^2``, a relu's
      mask, ``n x^(n-1)``); a product or quotient by a constant is linear;
    * a main primitive that is neither (a max reduction, a pool) reads its
      operands: the producers' outputs;
    * a fused attention (:data:`~shardplan.jax.attention.ATTENTION`) reads its operands and keeps its
      output and the per-row log-sum-exp: ``saved`` of :func:`shardplan.ops.flash_attention`.

    An operator the program recomputes (``recomputed``: inside a user's
    ``jax.checkpoint``) reads its operands whatever its primitive: the
    outputs it reads from operators outside are the checkpoint's residuals.
    Values that coincide are kept once, and nothing is kept where no
    gradient flows (every input constant, or every path from the output to
    the loss stopping the gradient, as a softmax's ``stop_gradient(max)``). A
    materialised view (``copy`` operator) keeps nothing.
    """
    def main(name: str) -> str:
        op = operators[name]
        k = op_eqn.get(name)
        if op.kind == "copy" or k is None or not 0 <= k < len(program.eqns):
            return "copy" if op.kind == "copy" else op.kind
        return program.eqns[k].name

    def grad(op: Operator) -> bool:
        return any(t.needs_grad for t in op.inputs + op.weights)

    def own(prim: str, i: int) -> Any:
        """The value elementwise primitive ``i`` (0: the main one) keeps: r_i, r_(i-1) or its derivative."""
        return i if prim in _READS_RESULT else i - 1 if prim in _READS_INPUT else ("derivative", i)

    readers: dict[str, list[tuple[str, bool]]] = {n: [] for n in operators}  # (consumer, carries a gradient)
    for op in operators.values():
        for t in op.inputs:
            if t.src in readers:
                readers[t.src].append((op.name, t.needs_grad))
    needed: dict[str, bool] = {}  # a gradient flows back into the operator's output (operators in graph order)
    for name in reversed(list(operators)):
        rs = readers[name]
        needed[name] = not rs or any(g and needed.get(c, True) for c, g in rs)
    kept: dict[str, set[Any]] = {n: set() for n in operators}
    for name, op in operators.items():
        # no gradient flows back through it: all its inputs are constant, or every path to the loss stops it
        if not grad(op) or not needed[name]:
            continue
        prim = main(name)
        if name in recomputed:
            for t in op.inputs:
                if t.src in operators and t.src not in recomputed:
                    kept[t.src].add(len(tails.get(t.src, ())))
            continue
        for i, (t, slot) in enumerate(tails.get(name, ()), start=1):
            if t in _READS_NOTHING or (t in _TAIL_LINEAR and (t == "mul" or slot == 0)):
                continue
            kept[name].add(own(t, i))
        if prim in _READS_NOTHING:
            continue
        if prim == ATTENTION.name:  # the fused kernel keeps its output and the rows' log-sum-exp (ops.flash_attention)
            kept[name].update((0, "lse"))
        elementwise = prim in ELEMENTWISE_FLOPS and prim not in _BILINEAR
        if elementwise and len(op.inputs) + len(op.weights) == 1 and prim not in _READS_INPUT:
            kept[name].add(own(prim, 0))
            continue
        tensors = op.inputs + op.weights
        for j, t in enumerate(op.inputs):
            if t.src not in operators:
                continue
            if prim in _BILINEAR and not any(u.needs_grad for k, u in enumerate(tensors) if k != j):
                continue
            kept[t.src].add(len(tails.get(t.src, ())))
    return {n: float(len(v)) + (operators[n].saved - 1.0 if "lse" in v else 0.0) - ("lse" in v)
            for n, v in kept.items()}


def user_recomputed(program: Program, op_eqn: Mapping[str, int], names: Any,
                    identity_vars: Mapping[str, Sequence[int]]) -> frozenset[str]:
    """Operators made inside a user's ``jax.checkpoint`` / ``nn.remat`` call that saves nothing of its body.

    Such a call (``remat2`` whose ``policy`` is None) keeps only its operands
    for the backward pass and re-runs its body there; a call with a saving
    policy keeps what the policy names, which the graph does not know, so its
    operators are left to the plan. An operator (of ``names``) is recomputed
    when any call enclosing its equation has no policy, unless its output
    (one of its ``identity_vars``) is a result of a call: the call's results
    are kept (the next block saves them as its operands).
    """
    calls: dict[int, tuple[bool, int | None]] = {}  # call id -> (saves nothing, enclosing call id)
    results: set[int] = set()
    for e in program.eqns:
        if e.call_id is not None:
            calls[e.call_id] = (e.params.get("policy") is None, e.parent)
            results.update(a for a in e.passthrough if isinstance(a, int))

    def inside(parent: int | None) -> bool:
        while parent is not None and parent in calls:
            bare, parent = calls[parent]
            if bare:
                return True
        return False

    return frozenset(n for n, k in op_eqn.items() if n in names and 0 <= k < len(program.eqns)
                     and inside(program.eqns[k].parent) and not results.intersection(identity_vars.get(n, ())))


def _count_uses(program: Program) -> tuple[dict[int, int], dict[int, int]]:
    """(alias, uses): a kept call's result -> its body's result; consumers of every graph-view variable."""
    alias: dict[int, int] = {}
    for e in program.eqns:
        if not e.graph:
            for o, a in zip(e.outvars, e.passthrough):
                if isinstance(a, int):
                    alias[o] = alias.get(a, a)
    uses: dict[int, int] = {}

    def use(a: Atom) -> None:
        if isinstance(a, int):
            a = alias.get(a, a)
            uses[a] = uses.get(a, 0) + 1

    for e in program.eqns:
        if e.graph:
            for a in e.invars:
                use(a)
        elif e.call_id is not None:
            for a in e.invars:
                use(a)
    for a in program.outvars:
        use(a)
    return alias, uses


def _layer_slices(program: Program) -> frozenset[tuple[int, int]]:
    """The tie keys of an unrolled ``scan``'s per-iteration slices of a scanned operand: static slices that the
    iterations tie (one position in every iteration) and that cut each iteration at another start (a slice of a
    loop-invariant operand cuts every iteration at the same one)."""
    starts: dict[tuple[int, int], set[tuple[int, ...]]] = {}
    for e in program.eqns:
        if e.name == "slice":
            for t in e.ties:
                starts.setdefault(t, set()).add(tuple(e.params["start_indices"]))
    return frozenset(t for t, s in starts.items() if len(s) > 1)


# ---------------------------------------------------------------------------
# handlers: one per primitive family
# ---------------------------------------------------------------------------
def _elementwise(g: _GraphPass, eqn: FlatEqn, vals: list[_Val]) -> None:
    """n-ary elementwise op (``ops.elementwise``); fused into a sole producer when possible."""
    out_shape = eqn.out_shapes[0]
    flops = ELEMENTWISE_FLOPS.get(eqn.name, 1.0)
    live = [(a, v) for a, v in zip(eqn.invars, vals) if v.kind != "const"]
    if len(live) == 1:
        a, v = live[0]
        slot = next(k for k, w in enumerate(vals) if w.kind != "const")
        a = g.resolve(a)
        if v.kind == "op" and _unit_view(v) and v.shape == out_shape and g.sole_chain(a, g.op_var.get(v.key)):
            op = g.ops[v.key]
            g.tails.setdefault(op.name, []).append((eqn.name, slot))
            fused = dataclasses.replace(op, flops_per_point=op.flops_per_point + flops * math.prod(out_shape) / op.points)
            g.ops[op.name] = fused
            g.op_var[op.name] = eqn.outvars[0]
            if v.is_identity:
                g.identity_vars[op.name].append(eqn.outvars[0])
            g.env[eqn.outvars[0]] = dataclasses.replace(v, needs_grad=v.needs_grad and _is_float(eqn.out_dtypes[0]))
            return
    refs = [g.ref(v, k) if len(v.shape) == len(out_shape) else TensorRef(f"_operand{k}", (1,) * len(out_shape))
            for k, v in enumerate(vals)]
    op = ops.elementwise("_", *refs, flops_per_point=flops, kind=eqn.name)
    g.adopt(eqn, op, vals)


def _unit_view(v: _Val) -> bool:
    """True when the view only adds or drops extent-1 axes (no broadcast, no permutation)."""
    if math.prod(v.shape) != math.prod(v.base_shape):
        return False
    order = [t for i, t in enumerate(v.to_view) if v.base_shape[i] != 1]
    return order == sorted(order) and all(t is not None for t in order)


@handles(*_IDENTITY)
def _identity(g: _GraphPass, eqn: FlatEqn, vals: list[_Val]) -> None:
    for o, a, v, dt, s in zip(eqn.outvars, eqn.invars, vals, eqn.out_dtypes, eqn.out_shapes):
        if tuple(s) != tuple(v.shape):  # a dtype change that changes the shape (bitcast): a new value
            g.env[o] = _const(s) if v.kind == "const" else g.materialize(v, eqn)
            continue
        grad = v.needs_grad and _is_float(dt) and eqn.name != "stop_gradient"
        g.env[o] = dataclasses.replace(v, needs_grad=grad)
        g.view_src[o] = g.resolve(a)


@handles("broadcast_in_dim")
def _broadcast_in_dim(g: _GraphPass, eqn: FlatEqn, vals: list[_Val]) -> None:
    bd = eqn.params["broadcast_dimensions"]
    g.set_view(eqn, vals[0].retarget(eqn.out_shapes[0], lambda v: bd[v]))


@handles("transpose")
def _transpose(g: _GraphPass, eqn: FlatEqn, vals: list[_Val]) -> None:
    perm = eqn.params["permutation"]
    inv = {p: j for j, p in enumerate(perm)}
    g.set_view(eqn, vals[0].retarget(eqn.out_shapes[0], lambda v: inv[v]))


@handles("squeeze")
def _squeeze(g: _GraphPass, eqn: FlatEqn, vals: list[_Val]) -> None:
    v = vals[0]
    drop = {d % len(v.shape) for d in eqn.params["dimensions"]}
    keep = [i for i in range(len(v.shape)) if i not in drop]
    pos = {old: new for new, old in enumerate(keep)}
    g.set_view(eqn, v.retarget(eqn.out_shapes[0], lambda a: pos.get(a)))


@handles("expand_dims")
def _expand_dims(g: _GraphPass, eqn: FlatEqn, vals: list[_Val]) -> None:
    _reshape(g, eqn, vals)


def _unit_reshape_map(old: Sequence[int], new: Sequence[int]) -> dict[int, int] | None:
    """If ``new`` only adds or drops extent-1 axes of ``old``: old axis -> new axis (non-unit axes)."""
    oi = [i for i, s in enumerate(old) if s != 1]
    ni = [i for i, s in enumerate(new) if s != 1]
    if [old[i] for i in oi] != [new[i] for i in ni]:
        return None
    return dict(zip(oi, ni))


@handles("reshape")
def _reshape(g: _GraphPass, eqn: FlatEqn, vals: list[_Val]) -> None:
    """``ops.reshape`` on the base (a reshape that only adds or drops unit axes is a view)."""
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
        g.env[eqn.outvars[0]] = dataclasses.replace(_base("param", v.key, new, v.needs_grad), part=v.part)
        return
    base = g.materialize(v, eqn)
    g.adopt(eqn, ops.reshape("_", g.ref(base, 0), new), [base])


@handles("dot_general")
def _dot_general(g: _GraphPass, eqn: FlatEqn, vals: list[_Val]) -> None:
    """``dot_general`` as ``ops.einsum`` ``batch,lhs-free,rhs-free`` ← sum over the contracting dims."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    ls, rs = vals[0].shape, vals[1].shape
    lf = [i for i in range(len(ls)) if i not in lc and i not in lb]
    rf = [i for i in range(len(rs)) if i not in rc and i not in rb]
    names = ops.letters(len(lb) + len(lf) + len(rf) + len(lc))
    it = iter(names)
    la: list[str] = [""] * len(ls)
    ra: list[str] = [""] * len(rs)
    out = []
    for i, j in zip(lb, rb):
        la[i] = ra[j] = next(it)
        out.append(la[i])
    for i in lf:
        la[i] = next(it)
        out.append(la[i])
    for j in rf:
        ra[j] = next(it)
        out.append(ra[j])
    for i, j in zip(lc, rc):
        la[i] = ra[j] = next(it)
    op = ops.einsum("_", f"{''.join(la)},{''.join(ra)}->{''.join(out)}", g.ref(vals[0], 0), g.ref(vals[1], 1))
    g.adopt(eqn, op, vals, hints=_dot_hints(vals, la, ra, lc, rf, lb))


def _dot_hints(vals: Sequence[_Val], la: Sequence[str], ra: Sequence[str], lc: Sequence[int], rf: Sequence[int],
               lb: Sequence[int]) -> dict[str, str]:
    """Labels a contraction fixes: with a parameter operand, contracted ``in`` and the parameter's free ``out``;
    between activations (attention), the batch dimensions are the ``heads`` (the data batch is relabelled)."""
    if vals[1].kind == "param" or vals[0].kind == "param":
        hints = {la[i]: "in" for i in lc}
        if vals[1].kind == "param":
            hints.update({ra[j]: "out" for j in rf})
        else:
            hints.update({la[i]: "out" for i in range(len(la)) if i not in lc and i not in lb})
        return hints
    return {la[i]: "heads" for i in lb}


@handles("conv_general_dilated")
def _conv(g: _GraphPass, eqn: FlatEqn, vals: list[_Val]) -> None:
    """``conv_general_dilated`` (any layout) as a convolution domain.

    ``y[b, (g, n), o_1..] = sum_{c, r_1..} x[b, (g, c), s_i*o_i + d_i*r_i - lo_i] w[(g, n), c, r_1..]``;
    dims ``b c o_1..o_k n r_1..r_k`` (``bchwnrs`` in 2-D, as ``ops.conv2d``), plus ``g`` for
    ``feature_group_count`` > 1 (grouped and depthwise convolutions: the channel axes are the merged
    ``(g, c)`` / ``(g, n)``, so only the group is split along them). A transposed convolution
    (``lhs_dilation`` > 1) reads its dilated spatial axes whole (the access is not affine).

    A grouped convolution is never split, along any dimension: XLA's SPMD partitioner (JAX 0.9.2) does
    not partition one. Given a batch-, group- or image-split operand it all-gathers the operand,
    computes the convolution whole on every device and still all-reduces the weight gradient
    (docs/jax.md, "Grouped convolutions"). Described as replicated, its edges charge exactly the
    all-gathers XLA sends and no all-reduce is left to charge, as XLA does with replicated operands.
    """
    p = eqn.params
    if p["batch_group_count"] != 1:
        raise ShardplanError(f"jax frontend: conv_general_dilated at {eqn.where} with batch_group_count "
                             f"{p['batch_group_count']} is not supported")
    dn = p["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    x, w = vals
    out = eqn.out_shapes[0]
    k = len(lhs_spec) - 2
    groups = int(p["feature_group_count"])
    if k > 3:
        raise ShardplanError(f"jax frontend: {k}-d convolution at {eqn.where} is not supported")
    sp, win = list("hwz"[:k]), list("rst"[:k])
    cg = x.shape[lhs_spec[1]] // groups
    ng = out[out_spec[1]] // groups
    dims = [("b", out[out_spec[0]]), ("c", cg)] + [(sp[i], out[out_spec[2 + i]]) for i in range(k)]
    dims += [("n", ng)] + [(win[i], w.shape[rhs_spec[2 + i]]) for i in range(k)]
    chan_x: AxisMap | str = "c"
    chan_y: AxisMap | str = "n"
    if groups > 1:
        dims.insert(1, ("g", groups))
        chan_x, chan_y = AxisMap("g", inner=("c",)), AxisMap("g", inner=("n",))
    xa: list[AxisMap | str | None] = [None] * len(x.shape)
    xa[lhs_spec[0]], xa[lhs_spec[1]] = "b", chan_x
    lhs_dil = p.get("lhs_dilation") or (1,) * k
    for i in range(k):
        if int(lhs_dil[i]) != 1:
            continue  # read whole
        lo = p["padding"][i][0]
        xa[lhs_spec[2 + i]] = AxisMap(sp[i], win[i], int(p["window_strides"][i]), int(p["rhs_dilation"][i]), -int(lo))
    wa: list[AxisMap | str | None] = [None] * len(w.shape)
    wa[rhs_spec[0]], wa[rhs_spec[1]] = chan_y, "c"
    for i in range(k):
        wa[rhs_spec[2 + i]] = win[i]
    oa: list[AxisMap | str] = [""] * len(out)
    oa[out_spec[0]], oa[out_spec[1]] = "b", chan_y
    for i in range(k):
        oa[out_spec[2 + i]] = sp[i]
    fixed = {d for d, _ in dims} if groups > 1 else set()  # XLA replicates a grouped convolution (docstring)
    op = Operator("_", "conv", tuple(dims), (Tensor("x0", x.shape, tuple(xa), "input", src="_"),
                                              Tensor("x1", w.shape, tuple(wa), "input", src="_")),
                  Tensor("y", out, tuple(oa), "output"), flops_per_point=2.0, fixed=frozenset(fixed))
    spatial = {1: ["length"], 2: ["height", "width"], 3: ["depth", "height", "width"]}[k]
    window = {1: ["kernel"], 2: ["kh", "kw"], 3: ["kd", "kh", "kw"]}[k]
    hints = {"b": "batch", "c": "in", "n": "out", "g": "groups", **dict(zip(sp, spatial)), **dict(zip(win, window))}
    g.adopt(eqn, op, vals, hints=hints)


@handles(*_REDUCE)
def _reduce(g: _GraphPass, eqn: FlatEqn, vals: list[_Val]) -> None:
    """Reduction over ``axes``: those dims index no output axis, so they are reduction dims."""
    v = vals[0]
    axes = {a % max(1, len(v.shape)) for a in eqn.params["axes"]}
    names = ops.letters(len(v.shape))
    out_axes = [names[i] for i in range(len(v.shape)) if i not in axes] or [None]
    op = Operator("_", eqn.name, tuple(zip(names, v.shape)) or (("u", 1),),
                  (Tensor("x0", v.shape, tuple(names), "input", src="_"),),
                  Tensor("y", eqn.out_shapes[0] or (1,), tuple(out_axes), "output"), flops_per_point=1.0)
    if not eqn.out_shapes[0]:
        op = dataclasses.replace(op, output=Tensor("y", (), (), "output"))
    g.adopt(eqn, op, vals[:1])


@handles(*_WINDOW)
def _reduce_window(g: _GraphPass, eqn: FlatEqn, vals: list[_Val]) -> None:
    """Pooling: ``y[.., o, ..] = op_r x[.., s*o + d*r - lo, ..]`` on every windowed axis."""
    p = eqn.params
    v = vals[0]
    out = eqn.out_shapes[0]
    names = ops.letters(len(out), avoid=[f"r{i}" for i in range(len(out))])
    dims = list(zip(names, out))
    acc: list[AxisMap | str | None] = []
    for i, (kw, st, (lo, hi), dl, bd) in enumerate(zip(p["window_dimensions"], p["window_strides"], p["padding"],
                                                        p["window_dilation"], p["base_dilation"])):
        if kw == 1 and st == 1 and lo == 0 and hi == 0 and bd == 1:
            acc.append(names[i])
            continue
        if bd != 1:
            acc.append(None)
            continue
        wn = f"r{i}"
        dims.append((wn, int(kw)))
        acc.append(AxisMap(names[i], wn, int(st), int(dl), -int(lo)))
    op = Operator("_", "pool", tuple(dims), (Tensor("x0", v.shape, tuple(acc), "input", src="_"),),
                  Tensor("y", out, tuple(names), "output"), flops_per_point=1.0)
    g.adopt(eqn, op, vals[:1], hints={d: "window" for d, _ in dims[len(out):]})


@handles("concatenate")
def _concatenate(g: _GraphPass, eqn: FlatEqn, vals: list[_Val]) -> None:
    """``ops.concat``: operand k is read at ``index - start_k`` along the concatenated axis."""
    g.adopt(eqn, ops.concat("_", [g.ref(v, k) for k, v in enumerate(vals)], eqn.params["dimension"]), vals)


@handles("stack")
def _stack(g: _GraphPass, eqn: FlatEqn, vals: list[_Val]) -> None:
    """``stack`` is ``ops.concat`` of the operands seen with a unit axis inserted at ``axis``."""
    ax = eqn.params["axis"]
    views = []
    for v in vals:
        shape = list(v.shape)
        shape.insert(ax, 1)
        views.append(v.retarget(shape, lambda a: a + 1 if a >= ax else a))
    g.adopt(eqn, ops.concat("_", [g.ref(v, k) for k, v in enumerate(views)], ax), views, inserted_axis=ax)


def _slice_op(eqn: FlatEqn, v: _Val, starts: Sequence[int], strides: Sequence[int], out: Sequence[int]) -> Operator:
    """``y[i] = x[start + stride * i]`` per axis (``ops.slice_axis`` when one axis is cut)."""
    cut = [i for i in range(len(out)) if (starts[i], strides[i], out[i]) != (0, 1, v.shape[i])]
    ref = TensorRef("_operand0", v.shape, needs_grad=v.needs_grad)
    if len(cut) == 1 and strides[cut[0]] == 1:
        return ops.slice_axis("_", ref, cut[0], int(starts[cut[0]]), int(out[cut[0]]))
    names = ops.letters(len(out))
    acc = [names[i] if i not in cut else AxisMap(names[i], stride=int(strides[i]), offset=int(starts[i]), partial=True)
           for i in range(len(out))]
    return Operator("_", "slice", tuple(zip(names, out)), (Tensor("x0", v.shape, tuple(acc), "input", src="_"),),
                    Tensor("y", tuple(out), tuple(names), "output"), flops_per_point=0.0)


@handles("slice")
def _slice(g: _GraphPass, eqn: FlatEqn, vals: list[_Val]) -> None:
    """A static slice. Of a stacked parameter by an unrolled ``scan`` (one layer per iteration, the iterations
    tied to one layout: :func:`_layer_slices`), a weight of the slice's shape; of a parameter read by nothing else, a view whose readers
    read the leaf through the slice's offsets and strides (the run holds the leaf, so its owner stores it whole
    along the cut axes); of a parameter read elsewhere too (``embed[:V2]`` of a table also read whole, a fused
    weight read as ``w[:, :d]``, ``w[:, d:]``), a slice operator reading the whole parameter through an offset, as
    a ``split`` piece is: one weight, owned by its first reader and linked to the others
    (:meth:`_GraphPass.share_weights`)."""
    p, v = eqn.params, vals[0]
    out = eqn.out_shapes[0]
    strides = p.get("strides") or (1,) * len(out)
    layer = any(t in g.layer_slices for t in eqn.ties)
    if v.kind == "param" and v.is_identity and v.leaf_axes is not None and \
            (layer or not g.read_elsewhere(eqn.invars[0])):
        part = (v.part, tuple(p["start_indices"]), tuple(out), tuple(strides))
        if layer:
            keep = tuple(la if out[i] == v.shape[i] else None for i, la in enumerate(v.leaf_axes))
            g.env[eqn.outvars[0]] = dataclasses.replace(_base("param", v.key, out, v.needs_grad, leaf_axes=keep),
                                                        part=part)
        else:  # its reader reads the leaf through the slice's window: the owner stores the leaf whole along it
            window = tuple((int(s), int(d)) for s, d in zip(p["start_indices"], strides))
            g.env[eqn.outvars[0]] = dataclasses.replace(v.retarget(out, lambda a: a), part=part, window=window)
        return
    g.adopt(eqn, _slice_op(eqn, v, p["start_indices"], strides, out), vals[:1])


@handles("split")
def _split(g: _GraphPass, eqn: FlatEqn, vals: list[_Val]) -> None:
    """``lax.split``: one slice operator per piece."""
    ax, v, start = eqn.params["axis"], vals[0], 0
    for k, out in enumerate(eqn.out_shapes):
        g.adopt(eqn, ops.slice_axis("_", g.ref(v, 0), ax, start, out[ax]), vals[:1], out_index=k)
        start += out[ax]


@handles("dynamic_slice")
def _dynamic_slice(g: _GraphPass, eqn: FlatEqn, vals: list[_Val]) -> None:
    """A slice at a run-time offset: a cut axis is read whole (its position is unknown)."""
    v = vals[0]
    out = eqn.out_shapes[0]
    names = ops.letters(len(out))
    acc = [names[i] if out[i] == v.shape[i] else None for i in range(len(out))]
    op = Operator("_", "dynamic_slice", tuple(zip(names, out)), (Tensor("x0", v.shape, tuple(acc), "input", src="_"),)
                  + _index_inputs(vals[1:]), Tensor("y", out, tuple(names), "output"), flops_per_point=0.0)
    g.adopt(eqn, op, vals)


def _index_inputs(vals: Sequence[_Val]) -> tuple[Tensor, ...]:
    """Stand-ins for scalar (or small) index operands, read whole."""
    return tuple(Tensor(f"i{k}", v.shape, (None,) * len(v.shape), "input", needs_grad=False, src="_")
                 for k, v in enumerate(vals))


@handles("dynamic_update_slice")
def _dynamic_update_slice(g: _GraphPass, eqn: FlatEqn, vals: list[_Val]) -> None:
    """``y = x`` with ``update`` written at a run-time offset: an update axis shorter than ``x``'s is read whole."""
    x, upd = vals[0], vals[1]
    out = eqn.out_shapes[0]
    names = ops.letters(len(out))
    ua = [names[i] if upd.shape[i] == out[i] else None for i in range(len(out))]
    op = Operator("_", "dynamic_update_slice", tuple(zip(names, out)),
                  (Tensor("x0", x.shape, tuple(names), "input", src="_"), Tensor("x1", upd.shape, tuple(ua), "input", src="_"))
                  + _index_inputs(vals[2:]), Tensor("y", out, tuple(names), "output"), flops_per_point=0.0)
    g.adopt(eqn, op, vals)


@handles("pad")
def _pad(g: _GraphPass, eqn: FlatEqn, vals: list[_Val]) -> None:
    """``y[i] = x[i - lo]`` per padded axis (interior padding: that axis is read whole); the pad value is free."""
    v = vals[0]
    out = eqn.out_shapes[0]
    names = ops.letters(len(out))
    acc: list[AxisMap | str | None] = []
    for i, (lo, hi, interior) in enumerate(eqn.params["padding_config"]):
        if (lo, hi, interior) == (0, 0, 0):
            acc.append(names[i])
        elif interior == 0 and -lo < v.shape[i] and out[i] - lo > 0:
            acc.append(AxisMap(names[i], offset=-int(lo), partial=True))
        else:
            acc.append(None)
    op = Operator("_", "pad", tuple(zip(names, out)), (Tensor("x0", v.shape, tuple(acc), "input", src="_"),
                                                        Tensor("x1", vals[1].shape, (None,) * len(vals[1].shape),
                                                               "input", src="_")),
                  Tensor("y", out, tuple(names), "output"), flops_per_point=0.0)
    g.adopt(eqn, op, vals[:2])


def _along(g: _GraphPass, eqn: FlatEqn, vals: list[_Val], axes: Sequence[int], kind: str, flops: float) -> None:
    """One operator per result: dims = the result's axes, operands of the result's shape read plainly,
    the dimensions of ``axes`` fixed (sorting, scanning or reversing along them cannot be split)."""
    for k, out in enumerate(eqn.out_shapes):
        names = ops.letters(len(out))
        ins = tuple(Tensor(f"x{j}", v.shape, tuple(names[i] if len(v.shape) == len(out) and v.shape[i] == out[i]
                                                   else None for i in range(len(v.shape))), "input", src="_")
                    for j, v in enumerate(vals))
        op = Operator("_", kind, tuple(zip(names, out)) or (("u", 1),), ins, Tensor("y", out, tuple(names), "output"),
                      flops_per_point=flops, fixed=frozenset(names[a % len(out)] for a in axes if out))
        g.adopt(eqn, op, vals, out_index=k)


@handles(*_CUMULATIVE)
def _cumulative(g: _GraphPass, eqn: FlatEqn, vals: list[_Val]) -> None:
    _along(g, eqn, vals, [eqn.params["axis"]], eqn.name, 1.0)


@handles("sort")
def _sort(g: _GraphPass, eqn: FlatEqn, vals: list[_Val]) -> None:
    n = eqn.out_shapes[0][eqn.params["dimension"]]
    _along(g, eqn, vals, [eqn.params["dimension"]], "sort", max(1.0, math.log2(max(n, 2))))


@handles("rev")
def _rev(g: _GraphPass, eqn: FlatEqn, vals: list[_Val]) -> None:
    _along(g, eqn, vals, eqn.params["dimensions"], "rev", 0.0)


@handles("tile")
def _tile(g: _GraphPass, eqn: FlatEqn, vals: list[_Val]) -> None:
    """``jnp.tile``: a repeated axis is read whole and its result dimension fixed (result index i reads
    ``i mod n``, not a block); the other axes map plainly."""
    _along(g, eqn, vals, [i for i, r in enumerate(eqn.params["reps"]) if int(r) != 1], "tile", 0.0)


@handles("top_k")
def _top_k(g: _GraphPass, eqn: FlatEqn, vals: list[_Val]) -> None:
    """``top_k`` along the last axis: that axis is read whole and its result dimension fixed."""
    _along(g, eqn, vals, [-1], "top_k", 1.0)


@handles(ATTENTION.name)
def _attention(g: _GraphPass, eqn: FlatEqn, vals: list[_Val]) -> None:
    """``jax.nn.dot_product_attention(q, k, v, is_causal=c)`` (:mod:`shardplan.jax.attention`) as the fused
    kernel :func:`shardplan.ops.flash_attention` describes: ``q`` is ``(B, T, N, H)``, ``k`` and ``v``
    ``(B, S, K, H)``; dims ``b s h k`` + ``t`` (batch, queries, heads, features; keys). Grouped-query attention
    (``K < N``): ``h`` counts the K/V heads and a fixed ``r = N / K`` the query heads of each, the query head
    axis the merged ``(h, r)`` (query head ``n`` reads K/V head ``n // r``, JAX's grouping). ``is_causal``
    is :class:`~shardplan.ir.Causal` (the flattener matches a causal call only where ``T = S``)."""
    q, k, v = vals
    b, t, n, hd = q.shape
    kv = k.shape[2]
    r = n // kv
    qref = g.ref(q, 0)
    fake = TensorRef(qref.name, (b, t, kv, r, hd) if r > 1 else tuple(q.shape), needs_grad=qref.needs_grad)
    op = ops.flash_attention("_", fake, g.ref(k, 1), g.ref(v, 2), "bshrk" if r > 1 else "bshk", "bthk",
                             causal=bool(eqn.params["is_causal"]), dealt=True)
    heads = AxisMap("h", inner=("r",)) if r > 1 else AxisMap("h")
    four = (AxisMap("b"), AxisMap("s"), heads, AxisMap("k"))
    ins = (dataclasses.replace(op.inputs[0], shape=tuple(q.shape), axes=four), *op.inputs[1:])
    out = dataclasses.replace(op.output, shape=tuple(q.shape), axes=four)
    g.adopt(eqn, dataclasses.replace(op, inputs=ins, output=out), vals, fixed=("r",) if r > 1 else ())


@handles(*_OPAQUE)
def _opaque(g: _GraphPass, eqn: FlatEqn, vals: list[_Val]) -> None:
    """Control flow (``cond``, ``while``): described conservatively (one replicated operator per result,
    reading its operands whole); its body is not looked into."""
    _conservative(g, eqn, vals, "control flow: its body is not described")


def _dn(dn: Any, field: str) -> tuple[int, ...]:
    return tuple(int(a) for a in getattr(dn, field, ()) or ())


@handles("gather")
def _gather(g: _GraphPass, eqn: FlatEqn, vals: list[_Val]) -> None:
    """``ops.gather``: an embedding lookup splits the vocabulary as a partial sum, the features for free."""
    dn = eqn.params["dimension_numbers"]
    op = ops.gather("_", g.ref(vals[0], 0), g.ref(vals[1], 1), eqn.out_shapes[0],
                    offset_dims=_dn(dn, "offset_dims"), collapsed_slice_dims=_dn(dn, "collapsed_slice_dims"),
                    start_index_map=_dn(dn, "start_index_map"), slice_sizes=tuple(eqn.params["slice_sizes"]),
                    operand_batching_dims=_dn(dn, "operand_batching_dims"),
                    start_indices_batching_dims=_dn(dn, "start_indices_batching_dims"))
    n_out = len(eqn.out_shapes[0])
    hints = {d: "vocab" for d in op.dim_names[n_out:]}
    if vals[0].kind == "param":
        hints.update({op.dim_names[a]: "embed" for a in _dn(dn, "offset_dims")})
    g.adopt(eqn, op, vals, hints=hints)


@handles("scatter", "scatter-add", "scatter_add", "scatter-mul", "scatter_mul", "scatter-min", "scatter_min",
         "scatter-max", "scatter_max")
def _scatter(g: _GraphPass, eqn: FlatEqn, vals: list[_Val]) -> None:
    """``ops.scatter`` (``.at[].set`` / ``.at[].add``)."""
    dn = eqn.params["dimension_numbers"]
    op = ops.scatter("_", g.ref(vals[0], 0), g.ref(vals[1], 1), g.ref(vals[2], 2),
                     update_window_dims=_dn(dn, "update_window_dims"),
                     inserted_window_dims=_dn(dn, "inserted_window_dims"),
                     scatter_dims_to_operand_dims=_dn(dn, "scatter_dims_to_operand_dims"),
                     operand_batching_dims=_dn(dn, "operand_batching_dims"),
                     scatter_indices_batching_dims=_dn(dn, "scatter_indices_batching_dims"), kind=eqn.name)
    g.adopt(eqn, op, vals[:3])


# ---------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------
def trace(fn: Callable[..., Any], *example_args: Any, params_argnums: Sequence[int] = (0,),
          name: str | None = None, batch_argnums: Sequence[int] | None = None) -> tuple[Graph, TraceInfo]:
    """Trace ``fn(*example_args)`` into a graph and the information the export needs.

    Parameters:
        fn: a JAX-traceable function (typically a loss ``fn(params, batch) -> scalar``).
        example_args: arguments of the right shapes and dtypes (arrays or
            ``jax.ShapeDtypeStruct`` leaves).
        params_argnums: which arguments hold parameters; their leaves become
            operator weights, the other arguments' leaves graph inputs.
        name: graph name (default: the function's name).
        batch_argnums: arguments whose leaves have the batch on axis 0
            (default: every non-parameter argument; leaves of rank 0 never).

    Returns:
        ``(graph, info)``.
    """
    import jax

    closed = jax.make_jaxpr(fn)(*example_args)
    leaves_with_path, in_tree = jax.tree_util.tree_flatten_with_path(tuple(example_args))
    out_tree = jax.tree_util.tree_structure(jax.eval_shape(fn, *example_args))
    pset = {int(a) for a in params_argnums}
    bset = {i for i in range(len(example_args)) if i not in pset} if batch_argnums is None else set(batch_argnums)
    names, shapes, param_leaves, batch_leaves = [], [], set(), set()
    for i, (path, leaf) in enumerate(leaves_with_path):
        argnum = path[0].idx  # type: ignore[attr-defined]
        names.append(f"arg{argnum}{jax.tree_util.keystr(path[1:])}")
        shapes.append(tuple(int(s) for s in jax.numpy.shape(leaf)))
        if argnum in pset:
            param_leaves.add(i)
        elif argnum in bset and shapes[-1]:
            batch_leaves.add(i)
    program = flatten(closed, len(names))
    leaf_vals: dict[int, _Val] = {}
    input_leaf: dict[str, int] = {}
    for i, (var, nm, shp) in enumerate(zip(program.invars, names, shapes)):
        leaf = leaves_with_path[i][1]
        if i in param_leaves:
            leaf_vals[var] = _base("param", i, shp, _is_float(_dtype(leaf)), leaf_axes=tuple(range(len(shp))))
        else:
            leaf_vals[var] = _base("input", nm, shp, False, batch=0 if i in batch_leaves else None)
            input_leaf[nm] = i
    gp = _GraphPass(program, leaf_vals, input_leaf)
    for nm, i in input_leaf.items():
        gp.axis_labels[nm] = input_axis_labels(shapes[i], i in batch_leaves,
                                               not _is_float(_dtype(leaves_with_path[i][1])))
    gp.run(program)
    gp.share_weights()
    if not gp.ops:
        raise ShardplanError("jax frontend: the function does no work on its arguments (no operators)")
    used_inputs = {t.src for op in gp.ops.values() for t in op.inputs}
    graph_inputs = {k: v for k, v in gp.inputs.items() if k in used_inputs}
    recomputed = user_recomputed(program, gp.op_eqn, gp.ops, gp.identity_vars)
    saved = backward_saved(program, gp.ops, gp.op_eqn, gp.tails, recomputed)
    gp.ops = {n: dataclasses.replace(op, saved=saved[n]) for n, op in gp.ops.items()}
    kernels = xla_kernels(gp.ops, [n for n, op in gp.ops.items() if n not in gp.conservative and (
        op.kind in ELEMENTWISE_FLOPS or op.kind in _REDUCE or op.kind == "copy")],
        [n for n in gp.ops if _nonlinear(program, gp.ops[n], gp.op_eqn.get(n), gp.tails.get(n, ()))])
    widths = _widths(gp.ops, gp.out_dtype, {nm: _dtype(leaves_with_path[i][1]) for nm, i in input_leaf.items()},
                     {n: [_dtype(leaves_with_path[leaf][1]) for leaf, _ in keys] for n, keys in gp.weight_keys.items()},
                     gp.operand_dtypes, [leaves_with_path[i][1] for i in sorted(param_leaves)])
    gp.ops = {n: dataclasses.replace(op, kernel_io=_widen(kernels[n], *widths[n])) if n in kernels else op
              for n, op in gp.ops.items()}
    graph = Graph(name or getattr(fn, "__name__", "jax"), tuple(gp.ops.values()), graph_inputs,
                  ties=scan_ties(program, gp.ops, gp.op_eqn), recomputed=recomputed)
    op_vars = _op_run_vars(gp.identity_vars, gp.alias, _run_vars(program))
    info = TraceInfo(program, in_tree, out_tree, tuple(names), tuple(shapes), frozenset(param_leaves), op_vars,
                     {k: tuple(v) for k, v in gp.leaf_uses.items()},
                     {k: tuple(v) for k, v in gp.reads.items()}, frozenset(batch_leaves), gp.conservative_ops())
    return graph, info


def _widths(operators: Mapping[str, Operator], out_dtype: Mapping[str, Any], input_dtype: Mapping[str, Any],
            weight_dtype: Mapping[str, Sequence[Any]], operand_dtypes: Mapping[str, tuple[Sequence[Any], Sequence[Any]]],
            params: Sequence[Any],
            ) -> dict[str, tuple[tuple[int, ...], int]]:
    """Per operator, the width of each operand (inputs, then weights) and of its output in HBM, in elements of
    the model's size, the rule the PyTorch frontend applies to :attr:`~shardplan.ir.Tensor.elem_factor`: a
    floating value of itemsize ``i`` in a model whose precision (the itemsize ``r`` of most of its floating
    parameters' elements) is narrower is ``max(1, i // r)`` wide (a float32 loss over bfloat16 logits: 2); a
    narrower or integer value, 1. A conversion is a view here; XLA fuses it into the kernel on its narrow side
    (a narrowing one into the producer, a widening one into the consumer), so a value between two kernels is
    stored in the narrower of its producer's and its consumer's dtypes (a parameter: of its leaf's and its
    reader's). ``weight_dtype``: per operator, its weights' leaves' dtypes; ``operand_dtypes``: the dtypes its
    equation sees its inputs and weights in. Only the fused kernels' traffic reads these widths
    (:func:`_widen`): the tensors keep ``elem_factor`` 1, so memory and collectives count as before."""
    import numpy as np

    sizes: dict[int, int] = {}
    for leaf in params:
        dt = _dtype(leaf)
        if _is_float(dt):
            sizes[np.dtype(dt).itemsize] = sizes.get(np.dtype(dt).itemsize, 0) + int(np.prod(np.shape(leaf)))
    if not sizes:
        return {n: ((1,) * (len(op.inputs) + len(op.weights)), 1) for n, op in operators.items()}
    ref = max(sizes, key=lambda k: (sizes[k], -k))

    def factor(dt: Any) -> int:
        return max(1, np.dtype(dt).itemsize // ref) if dt is not None and _is_float(dt) else 1

    wide = 2 ** 30
    seen: dict[str, list[int]] = {}  # operator -> the factor each consumer sees it in
    for name, op in operators.items():
        in_dt = list(operand_dtypes.get(name, ((), ()))[0]) + [None] * len(op.inputs)
        for t, d in zip(op.inputs, in_dt):
            seen.setdefault(t.src, []).append(factor(d) if d is not None else wide)
    made: dict[str, int] = {}  # operator -> the factor its output is stored in
    out: dict[str, tuple[tuple[int, ...], int]] = {}
    for name, op in operators.items():
        in_dt, w_dt = operand_dtypes.get(name, ((), ()))
        in_dt = list(in_dt) + [None] * (len(op.inputs) - len(in_dt))
        w_dt = list(w_dt) + [None] * (len(op.weights) - len(w_dt))
        ins = [min(made.get(t.src, factor(input_dtype.get(t.src))), factor(d) if d is not None else wide)
               for t, d in zip(op.inputs, in_dt)]
        leaf = list(weight_dtype.get(name, ())) + [None] * len(op.weights)
        ws = [min([factor(x) for x in (a, d) if x is not None] or [1]) for a, d in zip(leaf, w_dt)]
        f = factor(out_dtype[name]) if name in out_dtype else max(ins + ws, default=1)
        made[name] = min(f, max(seen.get(name, [f])))
        out[name] = (tuple(ins + ws), made[name])
    return out


def _widen(io: KernelIO, operands: Sequence[int], output: int) -> KernelIO:
    """``io`` with each count in elements of the model's size: times the operand's or the output's width."""
    return KernelIO(tuple(r * w for r, w in zip(io.reads, operands)), tuple(b * w for b, w in zip(io.back, operands)),
                    io.write * output)


def scan_ties(program: Program, operators: Mapping[str, Operator], op_eqn: Mapping[str, int],
              ) -> tuple[tuple[str, ...], ...]:
    """Tie groups of an unrolled ``scan``: the operators one body equation makes in every iteration.

    Operator ``o`` is the ``n``-th operator made by equation ``op_eqn[o]``; for every tie key
    ``t`` of that equation (one per enclosing scan, :attr:`FlatEqn.ties`), ``(t, n)`` names its
    copies in the other iterations. Groups are the connected components of "shares a key" (nested
    scans tie across both), split by description (kind, dimensions, fixed dimensions) so that
    only copies of one operator are tied; groups of one are dropped.
    """
    parent: dict[str, str] = {}

    def find(a: str) -> str:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    first: dict[tuple, str] = {}
    made: dict[int, int] = {}
    for name in operators:
        k = op_eqn.get(name)
        if k is None or k < 0 or not program.eqns[k].ties:
            continue
        n = made.get(k, 0)
        made[k] = n + 1
        parent[name] = name
        for t in program.eqns[k].ties:
            other = first.setdefault((t, n), name)
            ra, rb = find(name), find(other)
            if ra != rb:
                parent[ra] = rb
    groups: dict[tuple, list[str]] = {}
    for name in parent:  # graph order
        op = operators[name]
        groups.setdefault((find(name), op.kind, op.dims, op.fixed), []).append(name)
    return tuple(tuple(g) for g in groups.values() if len(g) > 1)


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


def _run_vars(program: Program) -> set[int]:
    """Variables that exist when the program is evaluated (not only inside a custom call's body)."""
    out = set(program.invars)
    for e in program.eqns:
        if e.parent is not None:
            out.update(e.outvars)
            out.update(e.body_in)
    return out
