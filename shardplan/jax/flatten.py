"""A traced JAX function as one flat program: nested calls inlined, variables numbered globally.

:func:`flatten` reads the jaxpr of ``jax.make_jaxpr`` and writes one
:class:`FlatEqn` per primitive application, in program order:

* ``jit``/``pjit``/``closed_call``/``custom_lin`` are inlined (their bodies
  become ordinary equations);
* ``remat2`` (``jax.checkpoint``, ``nn.remat``) is inlined *for planning* but
  kept *for execution*: its body's equations carry the call's id in
  ``parent``, and the call itself is one equation (``graph=False``) that
  :func:`shardplan.jax.run.evaluate` re-runs under ``jax.checkpoint`` with
  the same policy, so the step still rematerialises;
* ``custom_jvp_call``/``custom_vjp_call`` bodies are read for the graph but
  never evaluated (``parent=None``): the call is bound whole so its custom
  derivative applies;
* ``scan`` (``lax.scan``, ``nn.scan`` over layers, ``fori_loop`` with static
  bounds) is unrolled: the body is inlined once per iteration, the
  per-iteration slices of the scanned operands are static slices, the
  stacked results a concatenation. Each equation of an iteration carries a
  tie key (``FlatEqn.ties``), the same in every iteration: the lowering ties
  the operators an equation makes in all iterations to one configuration
  (:attr:`shardplan.ir.Graph.ties`), so a stacked parameter, which has one
  layout, is read by every iteration in that layout. The step runs the
  unrolled program, so every iteration's constraints hold. The cost is a
  longer compilation for long scans.

A call of ``jax.nn.dot_product_attention`` or of flax's ``dot_product_attention`` (inlined into a dozen
primitives) becomes one equation of :data:`shardplan.jax.attention.ATTENTION`
(:func:`shardplan.jax.attention.match`), bound as ``jax.nn.dot_product_attention``; 3-D operands
``(T, N, H)`` are given a batch axis of 1 before it and lose it after. A call's mask is recognised as causal
only from its value, which :meth:`_Flattener.constant` computes where no argument of the program reaches
it (the mask's equations stay in the program, read by nothing).

Everything else (``cond``, ``while``, the primitives) stays one equation.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from shardplan.jax import attention

__all__ = ["Const", "Atom", "FlatEqn", "Program", "flatten", "join_scope"]

_INLINE = frozenset({"pjit", "jit", "closed_call", "core_call", "custom_lin"})
_REMAT = frozenset({"remat2", "remat", "checkpoint"})
_CUSTOM = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})

TOP = -1  # parent of the equations evaluated at the top level

# a mask is evaluated (to see whether it is causal) only up to this many elements per value and this many
# equations: 2**26 booleans is a 8192 x 8192 mask, 64 MiB (first principles: one byte a boolean)
MASK_ELEMENTS = 2 ** 26
MASK_EQUATIONS = 256


class _NotConstant(Exception):
    """Raised inside :meth:`_Flattener.constant` where a value is not computed from constants alone."""


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
        scope: name scope (jax.named_scope / flax module path / enclosing jit names).
        parent: ``TOP`` when evaluated at the top level, the ``call_id`` of the
            enclosing remat call when evaluated inside it, None when never
            evaluated (inside a custom_jvp/vjp body).
        graph: read when building the graph (False for kept calls).
        passthrough: for a kept call, the body's result atoms (one per outvar).
        call_id: for a kept remat call, the id its body equations carry as ``parent``.
        body_in: for a kept remat call, the body's input variables (one per operand).
        ties: for an equation of an unrolled ``scan`` iteration, ``(scan id, position in the
            iteration)`` per enclosing scan: the same key in every iteration of that scan.
    """

    primitive: Any
    params: Mapping[str, Any]
    invars: tuple[Atom, ...]
    outvars: tuple[int, ...]
    out_shapes: tuple[tuple[int, ...], ...]
    out_dtypes: tuple[Any, ...]
    where: str
    scope: str
    parent: int | None = TOP
    graph: bool = True
    passthrough: tuple[Atom, ...] = ()
    call_id: int | None = None
    body_in: tuple[int, ...] = ()
    ties: tuple[tuple[int, int], ...] = ()

    @property
    def name(self) -> str:
        return self.primitive.name


@dataclass(frozen=True, eq=False)
class Program:
    """The flat program: equations in order, argument variables, results."""

    eqns: tuple[FlatEqn, ...]
    invars: tuple[int, ...]
    outvars: tuple[Atom, ...]


def _where(eqn: Any) -> str:
    # no public API formats an equation's source location; source_info_util.summarize is
    # what jax's own error messages use
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


def join_scope(*parts: str) -> str:
    return "/".join(p for p in parts if p)


def _closed(sub: Any) -> tuple[Any, Sequence[Any]]:
    return (sub.jaxpr, sub.consts) if hasattr(sub, "consts") else (sub, ())


class _Flattener:
    """Inlines nested jaxprs into one list of :class:`FlatEqn` with global variable ids."""

    def __init__(self) -> None:
        self.eqns: list[FlatEqn] = []
        self.next_id = 0
        self.next_call = 0
        self.next_scan = 0
        self.made: dict[int, tuple[int, int]] = {}  # variable id -> (index of its equation, result position)
        self.alias: dict[int, Atom] = {}  # a kept remat call's body input -> the call's operand

    def constant(self, atom: Atom) -> Any:
        """The value of ``atom`` if the equations so far compute it from constants alone (no argument of the
        program reaches it; kept calls read through to their bodies), else None; None too past
        :data:`MASK_ELEMENTS` elements or :data:`MASK_EQUATIONS` equations."""
        import math

        import jax
        import numpy as np

        memo: dict[int, Any] = {}
        budget = [MASK_EQUATIONS]

        def value(a: Atom) -> Any:
            if isinstance(a, Const):
                return a.value
            if a in memo:
                return memo[a]
            if a in self.alias:
                r = value(self.alias[a])
            elif a not in self.made:  # an argument of the program
                raise _NotConstant
            else:
                k, pos = self.made[a]
                e = self.eqns[k]
                if not e.graph:
                    if pos >= len(e.passthrough):
                        raise _NotConstant
                    r = value(e.passthrough[pos])
                else:
                    budget[0] -= 1
                    if budget[0] < 0 or any(math.prod(s) > MASK_ELEMENTS for s in e.out_shapes):
                        raise _NotConstant
                    args = [value(x) for x in e.invars]
                    params = e.primitive.get_bind_params(e.params)
                    if isinstance(params, tuple):  # (subfuns, params)
                        ans = e.primitive.bind(*params[0], *args, **params[1])
                    else:
                        ans = e.primitive.bind(*args, **params)
                    r = (ans if e.primitive.multiple_results else [ans])[pos]
            memo[a] = r
            return r

        try:
            with jax.ensure_compile_time_eval():
                return np.asarray(value(atom))
        except _NotConstant:
            return None
        except Exception:  # noqa: BLE001  (a primitive that does not evaluate outside a trace: not a constant)
            return None

    def fresh(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def run(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Atom], scope: str, parent: int | None,
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

        eqns = list(jaxpr.eqns)
        i = 0
        while i < len(eqns):
            eqn = eqns[i]
            i += 1
            name = eqn.primitive.name
            ins = tuple(read(v) for v in eqn.invars)
            sc = join_scope(scope, _scope(eqn))
            loc = _where(eqn).strip() or where
            m = attention.match(eqns, i - 1, jaxpr.outvars, lambda v: self.constant(read(v))) \
                if name in attention.STARTS else None
            if m is not None:  # an attention call: one equation (shardplan.jax.attention)
                i += m.length - 1
                env[m.out] = self.attention(m, [read(v) for v in (m.q, m.k, m.v)], sc, parent, loc)
                continue
            if name in _INLINE:
                inner, cs = _closed(eqn.params.get("jaxpr", eqn.params.get("call_jaxpr")))
                outs = self.run(inner, cs, ins, join_scope(sc, str(eqn.params.get("name", ""))), parent, loc)
            elif name == "scan":
                outs = self.scan(eqn, ins, sc, parent, loc)
            elif name in _REMAT:
                outs = self.remat(eqn, ins, sc, parent, loc)
            else:
                outs = self.emit(eqn, ins, sc, parent, loc)
            for v, a in zip(eqn.outvars, outs):
                env[v] = a
        return [read(v) for v in jaxpr.outvars]

    def attention(self, m: attention.Match, ins: list[Atom], scope: str, parent: int | None, where: str) -> Atom:
        """Append the :data:`~shardplan.jax.attention.ATTENTION` equation of match ``m`` on operands ``ins``;
        3-D operands get a leading batch axis of 1 (``lax.expand_dims``) and the result loses it
        (``lax.squeeze``). Returns the result."""
        import jax

        def sub(fn: Any, a: Atom, shape: tuple[int, ...], dtype: Any) -> Atom:
            return self._sub(fn, [a], [jax.ShapeDtypeStruct(shape, dtype)], scope, parent, where)[0]

        shape = tuple(int(x) for x in m.out.aval.shape)
        if not m.batched:
            ins = [sub(lambda a: jax.lax.expand_dims(a, (0,)), a, tuple(int(x) for x in v.aval.shape), v.aval.dtype)
                   for a, v in zip(ins, (m.q, m.k, m.v))]
        out = self.fresh()
        self.made[out] = (len(self.eqns), 0)
        self.eqns.append(FlatEqn(attention.ATTENTION, {"is_causal": m.is_causal}, tuple(ins), (out,),
                                 (shape if m.batched else (1, *shape),), (m.out.aval.dtype,), where, scope,
                                 parent=parent))
        return out if m.batched else sub(lambda a: jax.lax.squeeze(a, (0,)), out, (1, *shape), m.out.aval.dtype)

    def _append(self, eqn: Any, ins: tuple[Atom, ...], scope: str, parent: int | None, where: str,
                **extra: Any) -> tuple[int, ...]:
        outs = tuple(self.fresh() for _ in eqn.outvars)
        shapes = tuple(tuple(int(s) for s in v.aval.shape) for v in eqn.outvars)
        dtypes = tuple(v.aval.dtype for v in eqn.outvars)
        for pos, o in enumerate(outs):
            self.made[o] = (len(self.eqns), pos)
        self.eqns.append(FlatEqn(eqn.primitive, dict(eqn.params), ins, outs, shapes, dtypes, where, scope,
                                 parent=parent, **extra))
        return outs

    def emit(self, eqn: Any, ins: tuple[Atom, ...], scope: str, parent: int | None, where: str) -> list[Atom]:
        if eqn.primitive.name in _CUSTOM:
            inner, cs = _closed(eqn.params.get("call_jaxpr", eqn.params.get("fun_jaxpr")))
            body = self.run(inner, cs, ins, scope, None, where)
            return list(self._append(eqn, ins, scope, parent, where, graph=False, passthrough=tuple(body)))
        return list(self._append(eqn, ins, scope, parent, where))

    def remat(self, eqn: Any, ins: tuple[Atom, ...], scope: str, parent: int | None, where: str) -> list[Atom]:
        """The call first (so the graph pass meets its inputs), then its body, evaluated inside it."""
        inner, cs = _closed(eqn.params["jaxpr"])
        call_id = self.next_call
        self.next_call += 1
        body_in = tuple(self.fresh() for _ in ins)
        self.alias.update(zip(body_in, ins))
        k = len(self.eqns)
        outs = self._append(eqn, ins, scope, parent, where, graph=False, call_id=call_id, body_in=body_in)
        body = self.run(inner, cs, body_in, scope, call_id if parent is not None else None, where)
        self.eqns[k] = dataclasses.replace(self.eqns[k], passthrough=tuple(body))
        return list(outs)

    def _sub(self, fn: Any, args: Sequence[Atom], avals: Sequence[Any], scope: str, parent: int | None,
             where: str) -> list[Atom]:
        """Inline the jaxpr of ``fn(*args)`` (a slice or a stack written with public lax calls)."""
        import jax

        closed = jax.make_jaxpr(fn)(*avals)
        return self.run(closed.jaxpr, closed.consts, list(args), scope, parent, where)

    def scan(self, eqn: Any, ins: tuple[Atom, ...], scope: str, parent: int | None, where: str) -> list[Atom]:
        """Unroll ``scan``: ``carry, y_i = body(consts, carry, x_i)`` for i in order; ys stacked on axis 0."""
        import jax

        p = eqn.params
        n_c, n_k, length = int(p["num_consts"]), int(p["num_carry"]), int(p["length"])
        inner, cs = _closed(p["jaxpr"])
        consts, carry, xs = list(ins[:n_c]), list(ins[n_c:n_c + n_k]), list(ins[n_c + n_k:])
        x_avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars[n_c + n_k:]]
        ys: list[list[Atom]] = []
        order = range(length - 1, -1, -1) if p.get("reverse") else range(length)
        scan_id = self.next_scan
        self.next_scan += 1
        for i in order:
            sc = join_scope(scope, f"scan{i}")
            start = len(self.eqns)
            x_i = [self._sub(lambda a, i=i: jax.lax.index_in_dim(a, i, 0, keepdims=False), [x], [av], sc, parent,
                             where)[0] for x, av in zip(xs, x_avals)]
            outs = self.run(inner, cs, consts + carry + x_i, sc, parent, where)
            carry, y = outs[:n_k], outs[n_k:]
            ys.append(y)
            for j in range(start, len(self.eqns)):  # iteration i's j-th equation is every iteration's j-th
                e = self.eqns[j]
                self.eqns[j] = dataclasses.replace(e, ties=e.ties + ((scan_id, j - start),))
        if p.get("reverse"):
            ys.reverse()
        stacked: list[Atom] = []
        for j, v in enumerate(eqn.outvars[n_k:]):
            per = [y[j] for y in ys]
            av = jax.ShapeDtypeStruct(v.aval.shape[1:], v.aval.dtype)
            stacked.append(self._sub(lambda *a: jax.numpy.stack(a), per, [av] * length, scope, parent, where)[0])
        return carry + stacked


def flatten(closed_jaxpr: Any, num_args: int) -> Program:
    """The flat program of a closed jaxpr whose ``num_args`` arguments get variables ``0 .. num_args-1``."""
    f = _Flattener()
    in_ids = tuple(f.fresh() for _ in range(num_args))
    outs = f.run(closed_jaxpr.jaxpr, closed_jaxpr.consts, in_ids, "", TOP)
    return Program(tuple(f.eqns), in_ids, tuple(outs))
