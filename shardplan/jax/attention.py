"""``jax.nn.dot_product_attention`` recognised in a jaxpr, so that it is one fused attention operator.

JAX's XLA implementation of ``jax.nn.dot_product_attention`` leaves no call of its own in the jaxpr: its
equations (the query reshaped into key/value-head groups, ``q k^T``, the scale, the causal mask, the
softmax, ``p v``, the transposes and the reshape back) are inlined where it is called. :func:`match`
finds them: at a ``reshape`` followed by a ``dot_general`` that reads it, it traces
``jax.nn.dot_product_attention(q, k, v, is_causal=c)`` on the operands' shapes and dtypes (``c`` False, then
True) and checks that the next equations are that jaxpr, equation by equation (primitive, parameters,
literals, and which variable each operand is), the values computed in between read by nothing else. A
call with a mask, a bias, sequence lengths, a window or a scale of its own has other equations and stays
what it is (products and a softmax). A causal call whose queries and keys differ in length is left too
(its mask is not :class:`~shardplan.ir.Causal`'s).

A match becomes one equation of :data:`ATTENTION` (:mod:`shardplan.jax.flatten`): the lowering describes
it as :func:`shardplan.ops.flash_attention` (:mod:`shardplan.jax.lower`), and the run binds it as
``jax.nn.dot_product_attention`` again, or runs the ring (:mod:`shardplan.jax.ring`) where the plan
chose it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

__all__ = ["ATTENTION", "AttentionPrimitive", "Match", "match"]


@dataclass(frozen=True)
class AttentionPrimitive:
    """The primitive of a recognised attention equation: bound as ``jax.nn.dot_product_attention``
    (parameter ``is_causal``), with the interface :func:`shardplan.jax.run.evaluate_eqns` binds primitives by."""

    name: str = "dot_product_attention"
    multiple_results: bool = False

    def get_bind_params(self, params: Mapping[str, Any]) -> dict[str, Any]:
        return dict(params)

    def bind(self, q: Any, k: Any, v: Any, *, is_causal: bool) -> Any:
        import jax

        return jax.nn.dot_product_attention(q, k, v, is_causal=is_causal)


ATTENTION = AttentionPrimitive()


@dataclass(frozen=True)
class Match:
    """A recognised call: ``length`` equations from the matched one, its operands and result (jaxpr vars)."""

    length: int
    is_causal: bool
    q: Any
    k: Any
    v: Any
    out: Any


@functools.lru_cache(maxsize=64)
def _reference(q: tuple[tuple[int, ...], str], k: tuple[tuple[int, ...], str], causal: bool) -> Any:
    """The jaxpr of ``jax.nn.dot_product_attention`` on queries of shape/dtype ``q`` and keys and values ``k``."""
    import jax

    qs, ks = jax.ShapeDtypeStruct(q[0], q[1]), jax.ShapeDtypeStruct(k[0], k[1])
    return jax.make_jaxpr(lambda a, b, c: jax.nn.dot_product_attention(a, b, c, is_causal=causal))(qs, ks, ks).jaxpr


def _same_param(a: Any, b: Any) -> bool:
    if hasattr(a, "eqns") or hasattr(a, "jaxpr"):  # a nested jaxpr: same text
        return str(a) == str(b)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001  (values that do not compare: by their text)
        return str(a) == str(b)


def _same_literal(a: Any, b: Any) -> bool:
    import numpy as np

    x, y = np.asarray(a.val), np.asarray(b.val)
    return x.dtype == y.dtype and x.shape == y.shape and bool(np.array_equal(x, y))


def match(eqns: Sequence[Any], i: int, outvars: Sequence[Any]) -> Match | None:
    """The attention call whose equations start at ``eqns[i]`` (module docstring), or None. ``outvars``: the
    enclosing jaxpr's results (a value in between that is one of them, or read after the call, is no match)."""
    from jax.extend.core import Literal

    e = eqns[i]
    if e.primitive.name != "reshape" or i + 1 >= len(eqns):
        return None
    d = eqns[i + 1]
    if d.primitive.name != "dot_general" or len(d.invars) != 2 or d.invars[0] is not e.outvars[0]:
        return None
    q, k = e.invars[0], d.invars[1]
    if isinstance(q, Literal) or isinstance(k, Literal) or len(q.aval.shape) != 4 or len(k.aval.shape) != 4:
        return None
    qk = ((tuple(int(s) for s in q.aval.shape), str(q.aval.dtype)), (tuple(int(s) for s in k.aval.shape),
                                                                     str(k.aval.dtype)))
    for causal in (False, True):
        if causal and qk[0][0][1] != qk[1][0][1]:
            continue
        try:
            ref = _reference(qk[0], qk[1], causal)
        except Exception:  # noqa: BLE001  (shapes jax.nn.dot_product_attention refuses: no attention)
            return None
        found = _compare(ref, eqns, i, Literal)
        if found is None:
            continue
        env, n = found
        inner = {o for a in eqns[i:i + n - 1] for o in a.outvars}
        later = {v for a in eqns[i + n:] for v in a.invars if not isinstance(v, Literal)}
        if inner & (later | {v for v in outvars if not isinstance(v, Literal)}):
            continue
        return Match(n, causal, q, k, env[ref.invars[2]], eqns[i + n - 1].outvars[0])
    return None


def _compare(ref: Any, eqns: Sequence[Any], i: int, literal: type) -> tuple[dict[Any, Any], int] | None:
    """The map of ``ref``'s variables to those of ``eqns[i:]`` if those equations are ``ref``'s, else None."""
    n = len(ref.eqns)
    if i + n > len(eqns) or len(ref.outvars) != 1:
        return None
    env: dict[Any, Any] = {}
    for r, a in zip(ref.eqns, eqns[i:i + n]):
        if r.primitive != a.primitive or len(r.invars) != len(a.invars) or len(r.outvars) != len(a.outvars) \
                or set(r.params) != set(a.params) or not all(_same_param(r.params[p], a.params[p]) for p in r.params):
            return None
        for rv, av in zip(r.invars, a.invars):
            if isinstance(rv, literal):
                if not isinstance(av, literal) or not _same_literal(rv, av):
                    return None
            elif isinstance(av, literal):
                return None
            elif rv in env:
                if env[rv] is not av:
                    return None
            elif rv in ref.invars:
                if rv.aval.shape != av.aval.shape or rv.aval.dtype != av.aval.dtype:
                    return None
                env[rv] = av
            else:
                return None
        for rv, av in zip(r.outvars, a.outvars):
            env[rv] = av
    if ref.outvars[0] is not ref.eqns[-1].outvars[0] or any(v not in env for v in ref.invars):
        return None
    return env, n
