"""Attention calls recognised in a jaxpr, so that each is one fused attention operator.

Neither ``jax.nn.dot_product_attention`` (its XLA implementation) nor flax's ``dot_product_attention``
leaves a call of its own in the jaxpr: their equations (the products, the scale, the mask, the softmax,
the transposes) are inlined where they are called. :func:`match` finds them, exactly: at an equation that
can open a call (:data:`STARTS`) it reads the operands the call would have from the next few equations,
traces the reference function on those operands' shapes and dtypes, and checks that the next equations
are that jaxpr, equation by equation (primitive, parameters, literals, and which variable each operand
is), the values computed in between read by nothing else. The references (:func:`_reference`):

* ``jax.nn.dot_product_attention(q, k, v, is_causal=c)``, ``c`` False or True, on 4-D ``(B, T, N, H)``
  operands or 3-D ``(T, N, H)`` ones (no batch axis; what ``flax.nnx.MultiHeadAttention`` calls without a
  mask or dropout);
* ``jax.nn.dot_product_attention(q, k, v, mask=m)`` on 4-D operands (``nnx.MultiHeadAttention`` with a
  mask);
* flax's ``flax.linen.dot_product_attention(q, k, v)`` and ``(q, k, v, mask=m)`` (``nn.SelfAttention``,
  ``nn.MultiHeadDotProductAttention``) on 4-D or 3-D operands, float32 only; nnx's own weights path (a dropout
  rate or ``module`` given) has the same equations without a mask (with one it first converts the mask to
  the compute dtype, which no reference does).

A call with a mask is recognised only where the mask is causal: its value is computed from constants alone
(a constant of the jaxpr, or iota and shape arithmetic such as ``nn.make_causal_mask``; ``constant``, the
caller's evaluator, says which) and it is the lower triangle (``T = S``, every query ``t`` keeps keys
``s <= t``, in every batch and head it broadcasts over); it then stands for ``is_causal=True``. Any other
mask (padding from an input, a band, a non-triangular constant), a bias, sequence lengths, a window, a
scale of its own, dropout, an explicit precision or dtype has other equations or another mask and stays
what it is (products and a softmax). A causal call whose queries and keys differ in length is left too
(its mask is not :class:`~shardplan.ir.Causal`'s).

The run binds a match as ``jax.nn.dot_product_attention(q, k, v, is_causal=c)`` (:data:`ATTENTION`), or
as the ring (:mod:`shardplan.jax.ring`) where the plan chose it. For flax's calls that is another
program with the same value: flax divides the queries by ``sqrt(H)`` before ``q kᵀ`` where JAX scales the
products, and masks with ``finfo.min`` where JAX uses ``-0.7 finfo.max`` (both weights are exactly 0
after the softmax, each row keeping its diagonal). In float32 the two agree to rounding; in bfloat16 or
float16 flax's softmax runs in the input dtype (or, with ``force_fp32_for_softmax``, returns float32)
where JAX's runs in float32 and returns the input dtype, so those are not matched.

``implementation="cudnn"`` is not traceable without a GPU (JAX raises "cuDNN is not detected" at trace
time); on a GPU it is a ``custom_vjp_call`` around the ``dot_product_attention_fwd`` primitive, which the
lowering has no rule for.

A match becomes one equation of :data:`ATTENTION` (:mod:`shardplan.jax.flatten`; 3-D operands get a batch
axis of 1 around it): the lowering describes it as :func:`shardplan.ops.flash_attention`
(:mod:`shardplan.jax.lower`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

__all__ = ["ATTENTION", "STARTS", "AttentionPrimitive", "Match", "match"]

# the primitives a recognised call opens with: jax's 4-D call (the queries reshaped into K/V-head groups),
# jax's 3-D call (the operands given a batch axis), flax's (sqrt(H) for the queries' scale)
STARTS = frozenset({"reshape", "broadcast_in_dim", "sqrt"})


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
    """A recognised call: ``length`` equations from the matched one, its operands and result (jaxpr vars);
    ``batched`` False: 3-D operands ``(T, N, H)``; ``source``: which reference matched (``"jax"``,
    ``"jax_mask"``, ``"flax"``, ``"flax_mask"``)."""

    length: int
    is_causal: bool
    q: Any
    k: Any
    v: Any
    out: Any
    batched: bool = True
    source: str = "jax"


Aval = tuple[tuple[int, ...], str]


@functools.lru_cache(maxsize=128)
def _reference(source: str, avals: tuple[Aval, ...], causal: bool) -> Any:
    """The jaxpr of reference ``source`` (module docstring) on operands of shapes/dtypes ``avals``
    (``q, k, v`` and, for the masked ones, the mask), or None where the reference refuses them."""
    import jax

    args = [jax.ShapeDtypeStruct(s, d) for s, d in avals]
    if source.startswith("flax"):
        try:
            from flax.linen import dot_product_attention as flax_attention
        except ImportError:  # flax absent: no program calls it
            return None

    def fn(a: Any, b: Any, c: Any, *m: Any) -> Any:
        if source == "jax":
            return jax.nn.dot_product_attention(a, b, c, is_causal=causal)
        if source == "jax_mask":
            return jax.nn.dot_product_attention(a, b, c, mask=m[0])
        return flax_attention(a, b, c, mask=m[0] if m else None)

    try:
        return jax.make_jaxpr(fn)(*args).jaxpr
    except Exception:  # noqa: BLE001  (shapes the reference refuses: no attention)
        return None


def _aval(v: Any) -> Aval:
    return tuple(int(s) for s in v.aval.shape), str(v.aval.dtype)


def _candidates(eqns: Sequence[Any], i: int, literal: type) -> list[tuple[str, tuple[Any, ...], bool]]:
    """The references that could open at ``eqns[i]``, each with a first guess of its operands
    (``q, k, v[, mask]``, jaxpr vars; ``v`` guessed as ``k``, corrected by :func:`_operands`) and ``is_causal``."""
    e, n = eqns[i], len(eqns)

    def at(j: int, prim: str) -> Any:
        return eqns[j] if j < n and eqns[j].primitive.name == prim else None

    def var(x: Any) -> bool:
        return not isinstance(x, literal)

    out: list[tuple[str, tuple[Any, ...], bool]] = []
    name = e.primitive.name
    if name == "reshape" and var(e.invars[0]) and len(e.invars[0].aval.shape) == 4:
        q = e.invars[0]
        for j in (i + 1, i + 2):
            d = at(j, "dot_general")
            if d is not None and d.invars[0] is e.outvars[0] and var(d.invars[1]):
                k = d.invars[1]
                if j == i + 1:
                    out += [("jax", (q, k, k), False), ("jax", (q, k, k), True)]
                elif at(i + 1, "broadcast_in_dim") is not None and var(eqns[i + 1].invars[0]):
                    out.append(("jax_mask", (q, k, k, eqns[i + 1].invars[0]), True))
    elif name == "broadcast_in_dim":
        three = [at(j, "broadcast_in_dim") for j in (i, i + 1, i + 2)]
        if all(b is not None and var(b.invars[0]) and len(b.invars[0].aval.shape) == 3
               and len(b.outvars[0].aval.shape) == 4 for b in three) and at(i + 3, "reshape") is not None:
            qkv = tuple(b.invars[0] for b in three)
            out += [("jax", qkv, False), ("jax", qkv, True)]
    elif name == "sqrt" and isinstance(e.invars[0], literal):
        div, d = at(i + 2, "div"), at(i + 3, "dot_general")
        if div is not None and d is not None and d.invars[0] is div.outvars[0] and var(div.invars[0]) \
                and var(d.invars[1]):
            q, k = div.invars[0], d.invars[1]
            out.append(("flax", (q, k, k), False))
            w = eqns[i + 4] if i + 4 < n else None
            if w is not None and w.primitive.name in ("jit", "pjit") and w.invars and var(w.invars[0]):
                out.append(("flax_mask", (q, k, k, w.invars[0]), True))
    return out


def _first_uses(ref: Any, eqns: Sequence[Any], i: int, literal: type) -> tuple[Any, ...] | None:
    """The variables of ``eqns[i:]`` where ``ref``'s operands are first read (same equation offset and
    operand position), or None."""
    found: list[Any] = []
    for rv in ref.invars:
        hit = next(((j, p) for j, r in enumerate(ref.eqns) for p, x in enumerate(r.invars) if x is rv), None)
        if hit is None or i + hit[0] >= len(eqns) or hit[1] >= len(eqns[i + hit[0]].invars):
            return None
        x = eqns[i + hit[0]].invars[hit[1]]
        if isinstance(x, literal):
            return None
        found.append(x)
    return tuple(found)


def _operands(source: str, guess: tuple[Any, ...], causal: bool, eqns: Sequence[Any], i: int,
              literal: type) -> tuple[Any, tuple[Any, ...]] | None:
    """The reference jaxpr and the operands it is traced on: the guess's shapes, then those of the
    variables the candidate equations read where the reference reads its operands, until they agree."""
    ops = guess
    for _ in range(3):
        ref = _reference(source, tuple(_aval(x) for x in ops), causal)
        if ref is None:
            return None
        seen = _first_uses(ref, eqns, i, literal)
        if seen is None:
            return None
        if [_aval(x) for x in seen] == [_aval(x) for x in ops]:
            return ref, seen
        ops = seen
    return None


def _is_lower_triangle(mask: Any, t: int, s: int) -> bool:
    """Whether every ``(T, S)`` slice of ``mask`` (nonzero: kept) is the lower triangle, ``T = S``."""
    import numpy as np

    m = np.asarray(mask)
    if t != s or m.ndim < 2 or tuple(m.shape[-2:]) != (t, s):
        return False
    return bool(np.array_equal(m != 0, np.broadcast_to(np.tril(np.ones((t, s), dtype=bool)), m.shape)))


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


def _bound_agrees(q: Any, k: Any, v: Any, out: Any) -> bool:
    """Whether ``jax.nn.dot_product_attention(q, k, v)`` takes these operands and gives ``out``'s shape and
    dtype, all float32 (flax's calls: module docstring)."""
    import jax

    if any(str(x.aval.dtype) != "float32" for x in (q, k, v, out)):
        return False
    try:
        r = jax.eval_shape(jax.nn.dot_product_attention, *(jax.ShapeDtypeStruct(*_aval(x)) for x in (q, k, v)))
    except Exception:  # noqa: BLE001  (flax's shapes that JAX's function refuses, e.g. a value depth of its own)
        return False
    return _aval(out) == (tuple(int(s) for s in r.shape), str(r.dtype))


def match(eqns: Sequence[Any], i: int, outvars: Sequence[Any],
          constant: Callable[[Any], Any] = lambda v: None) -> Match | None:
    """The attention call whose equations start at ``eqns[i]`` (module docstring), or None. ``outvars``: the
    enclosing jaxpr's results (a value in between that is one of them, or read after the call, is no match).
    ``constant(var)``: the value of a jaxpr variable if the program computes it from constants alone, else
    None (a mask's only way to be recognised)."""
    from jax.extend.core import Literal

    if eqns[i].primitive.name not in STARTS:
        return None
    for source, guess, causal in _candidates(eqns, i, Literal):
        found = _operands(source, guess, causal, eqns, i, Literal)
        if found is None:
            continue
        ref, _ = found
        compared = _compare(ref, eqns, i, Literal)
        if compared is None:
            continue
        env, n = compared
        inner = {o for a in eqns[i:i + n - 1] for o in a.outvars}
        later = {v for a in eqns[i + n:] for v in a.invars if not isinstance(v, Literal)}
        if inner & (later | {v for v in outvars if not isinstance(v, Literal)}):
            continue
        q, k, v = (env[x] for x in ref.invars[:3])
        out = eqns[i + n - 1].outvars[0]
        t, s = q.aval.shape[-3], k.aval.shape[-3]
        if causal and t != s:
            continue
        if source.startswith("flax") and not _bound_agrees(q, k, v, out):
            continue
        if source.endswith("mask"):
            value = constant(env[ref.invars[3]])
            if value is None or not _is_lower_triangle(value, int(t), int(s)):
                continue
        return Match(n, causal, q, k, v, out, len(q.aval.shape) == 4, source)
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
