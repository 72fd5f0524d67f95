"""FP8 matrix products in the JAX step: the products a plan runs in FP8, with per-tensor scaling.

A fit plan (:class:`shardplan.fit.MemoryChoices`) marks each matrix product
FP8 or not (``MemoryChoices.fp8``; the cost model's choice,
``docs/memory.md``, "FP8 products"). :func:`fp8_equations` finds the
product equation (``dot_general`` or ``conv_general_dilated``) of each
marked operator, and :func:`fp8_product` is what the step binds instead:

* forward: each operand ``X`` is quantised to E4M3 with its own scale,
  ``s_X = amax(X) / 448`` (448: the largest finite E4M3 value, OCP FP8
  specification), ``Q_X = saturate(X / s_X)`` cast to ``float8_e4m3fn``,
  and ``Y = s_X s_W (Q_X * Q_W)`` with the product accumulated in float32
  (``preferred_element_type``);
* backward: the output gradient is quantised to E5M2
  (``s_dY = amax(dY) / 57344``), Transformer Engine's HYBRID format, the
  rule the cost model states; ``dX = s_dY s_W (Q_dY *^T Q_W)`` and
  ``dW = s_X s_dY (Q_X *^T Q_dY)`` from the saved FP8 operands (the FP8 copy
  of the input that the cost model counts as saved).

The scale is *current* scaling: this step's amax of the tensor itself (a max
over the whole tensor: under sharding XLA's partitioner reduces the local
maxima over the devices, one scalar all-reduce per tensor). The cost model
charges Transformer Engine's *delayed* scaling (the scale from earlier steps'
amax history, so the cast is one pass); current scaling reads each operand
once more for its amax. Both scale a tensor by one number, so the values
each product multiplies are the same function of the global tensor under
any sharding: the sharded step equals the unsharded FP8 program
(:func:`reference_fn`) up to the order of the float32 sums.

XLA's CPU backend (JAX 0.9.2) has no FP8 dot: it converts both FP8 operands
to float32 and multiplies those (the compiled HLO shows ``f8e4m3fn`` /
``f8e5m2`` converts feeding an f32 ``dot``). The product of two FP8 values
is exact in float32, so the arithmetic is that of an FP8 product with f32
accumulation; only the speed is not.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from shardplan.errors import ShardplanError

__all__ = ["E4M3_MAX", "E5M2_MAX", "PRODUCTS", "quantize", "fp8_product", "fp8_equations", "reference_fn"]

E4M3_MAX = 448.0
"""Largest finite ``float8_e4m3fn`` value (OCP 8-bit floating point specification, E4M3: S.1111.110)."""

E5M2_MAX = 57344.0
"""Largest finite ``float8_e5m2`` value (OCP 8-bit floating point specification, E5M2: S.11110.11)."""

PRODUCTS = ("dot_general", "conv_general_dilated")
"""The primitives an FP8 operator's product is bound with."""


def quantize(x: Any, fmt: str) -> tuple[Any, Any]:
    """``(q, scale)``: ``x ≈ scale * q`` with ``q`` in ``fmt`` ("e4m3" or "e5m2") and
    ``scale = amax(|x|) / fmax`` (1 for an all-zero tensor), ``q = clip(x / scale, ±fmax)``.

    The clip saturates the rounding of the largest element (the FP8 casts of
    XLA turn an out-of-range value into NaN / inf, as the OCP "fn" format has
    no infinity)."""
    import jax.numpy as jnp

    dtype, fmax = (jnp.float8_e4m3fn, E4M3_MAX) if fmt == "e4m3" else (jnp.float8_e5m2, E5M2_MAX)
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf))
    scale = jnp.where(amax > 0, amax / fmax, 1.0).astype(jnp.float32)
    return jnp.clip(xf / scale, -fmax, fmax).astype(dtype), scale


def _labels(dn: Any, nx: int, nw: int) -> tuple[list[int], list[int], list[int]]:
    """Axis labels (ints) of ``dot_general``'s lhs, rhs and output for dimension numbers ``dn``."""
    (lc, rc), (lb, rb) = dn
    x = list(range(nx))
    w = [-1] * nw
    for a, b in zip(lc, rc):
        w[b] = x[a]
    for a, b in zip(lb, rb):
        w[b] = x[a]
    fresh = iter(range(nx, nx + nw))
    w = [next(fresh) if v < 0 else v for v in w]
    out = [x[a] for a in lb] + [x[a] for a in range(nx) if a not in lc and a not in lb] + \
          [w[b] for b in range(nw) if b not in rc and b not in rb]
    return x, w, out


def _contract(a: Any, la: Sequence[int], b: Any, lb: Sequence[int], out: Sequence[int]) -> Any:
    """``out[...] = sum a[la] b[lb]`` (every label of ``out`` in ``a`` or ``b``, every other label in both):
    one ``dot_general`` of the FP8 operands accumulated in float32, then transposed to ``out``'s order."""
    import jax
    import jax.numpy as jnp

    batch = [v for v in out if v in la and v in lb]
    contr = [v for v in la if v in lb and v not in out]
    dn = (([la.index(v) for v in contr], [lb.index(v) for v in contr]),
          ([la.index(v) for v in batch], [lb.index(v) for v in batch]))
    y = jax.lax.dot_general(a, b, dn, preferred_element_type=jnp.float32)
    order = batch + [v for v in la if v not in lb] + [v for v in lb if v not in la]
    return jnp.transpose(y, [order.index(v) for v in out])


def _fp8_custom(apply: Callable[[Any, Any], Any], grads: Callable[[Any, Any, Any], tuple[Any, Any]],
                out_dtype: Any, x_dtype: Any, w_dtype: Any) -> Callable[[Any, Any], Any]:
    """The FP8 product ``y = apply(q(x), q(w)) sx sw`` (E4M3 operands, module docstring) with the FP8 backward
    ``dx = grads_x sg sw``, ``dw = grads_w sx sg`` from ``grads(qx, qw, qg)`` on the E5M2 output gradient ``qg``;
    both products accumulate in float32. The result in ``out_dtype``, the operands' gradients in their dtypes."""
    import jax

    def fwd(x: Any, w: Any) -> tuple[Any, Any]:
        qx, sx = quantize(x, "e4m3")
        qw, sw = quantize(w, "e4m3")
        return (apply(qx, qw) * (sx * sw)).astype(out_dtype), (qx, sx, qw, sw)

    @jax.custom_vjp
    def prod(x: Any, w: Any) -> Any:
        return fwd(x, w)[0]

    def bwd(res: Any, g: Any) -> tuple[Any, Any]:
        qx, sx, qw, sw = res
        qg, sg = quantize(g, "e5m2")
        dx, dw = grads(qx, qw, qg)
        return (dx * (sg * sw)).astype(x_dtype), (dw * (sx * sg)).astype(w_dtype)

    prod.defvjp(fwd, bwd)
    return prod


def _fp8_dot(dn: Any, out_dtype: Any, x_dtype: Any, w_dtype: Any) -> Callable[[Any, Any], Any]:
    """``dot_general(x, w, dn)`` as an FP8 product (:func:`_fp8_custom`); the backward products contract the
    FP8 values directly (:func:`_contract`)."""
    import jax
    import jax.numpy as jnp

    def apply(qx: Any, qw: Any) -> Any:
        return jax.lax.dot_general(qx, qw, dn, preferred_element_type=jnp.float32)

    def grads(qx: Any, qw: Any, qg: Any) -> tuple[Any, Any]:
        lx, lw, lo = _labels(dn, qx.ndim, qw.ndim)
        return _contract(qg, lo, qw, lw, lx), _contract(qx, lx, qg, lo, lw)

    return _fp8_custom(apply, grads, out_dtype, x_dtype, w_dtype)


def _fp8_conv(params: Mapping[str, Any], out_dtype: Any, x_dtype: Any, w_dtype: Any) -> Callable[[Any, Any], Any]:
    """``conv_general_dilated(x, w, **params)`` as an FP8 product (:func:`_fp8_custom`). The backward
    convolutions are JAX's own transposes applied to the FP8 values (held in float32: a product of two FP8
    values is exact in float32, so the arithmetic is the same)."""
    import jax
    import jax.numpy as jnp

    kw = dict(params)
    kw["preferred_element_type"] = jnp.float32

    def conv(x: Any, w: Any) -> Any:
        return jax.lax.conv_general_dilated_p.bind(x, w, **kw)

    def grads(qx: Any, qw: Any, qg: Any) -> tuple[Any, Any]:
        _, vjp = jax.vjp(conv, qx.astype(jnp.float32), qw.astype(jnp.float32))
        return vjp(qg.astype(jnp.float32))

    return _fp8_custom(conv, grads, out_dtype, x_dtype, w_dtype)


def fp8_product(eqn: Any) -> Callable[[list[Any]], list[Any]]:
    """What the step binds instead of product equation ``eqn`` (a flat-program equation of a
    :data:`PRODUCTS` primitive): ``args -> [output]`` in FP8 (module docstring)."""
    if eqn.name not in PRODUCTS:
        raise ShardplanError(f"FP8 runs the products {', '.join(PRODUCTS)}, not {eqn.name}")
    import jax.numpy as jnp

    out_dtype = eqn.out_dtypes[0]
    conv_params = {k: v for k, v in eqn.params.items() if k != "preferred_element_type"}

    def run(args: list[Any]) -> list[Any]:
        x, w = args
        dtypes = (out_dtype, jnp.result_type(x), jnp.result_type(w))
        if eqn.name == "dot_general":
            return [_fp8_dot(eqn.params["dimension_numbers"], *dtypes)(x, w)]
        return [_fp8_conv(conv_params, *dtypes)(x, w)]

    return run


def fp8_equations(plan: Any, info: Any) -> dict[int, Callable[[list[Any]], list[Any]]]:
    """Equation index -> its FP8 product, for every operator the plan runs in FP8
    (``plan.memory_choices.fp8``); empty for a plan without memory choices.

    An operator's product is the one :data:`PRODUCTS` equation among the equations it reads through
    (``info.reads``); an FP8 operator with none, or with several, is refused."""
    mc = getattr(plan, "memory_choices", None)
    if mc is None:
        return {}
    eqns = info.program.eqns
    out = {}
    for i, op in enumerate(plan.graph.operators):
        if not mc.fp8(i):
            continue
        ks = sorted({k for k, _, _ in info.reads.get(op.name, ()) if eqns[k].name in PRODUCTS})
        if len(ks) != 1:
            raise ShardplanError(f"operator {op.name!r} runs in FP8 but reads through {len(ks)} product "
                                 f"equations ({', '.join(PRODUCTS)}), not one")
        if eqns[ks[0]].parent is None:  # inside a custom_jvp/vjp body: the call is bound whole, never this
            raise ShardplanError(f"operator {op.name!r} runs in FP8 but its product is inside a custom-derivative "
                                 "function, which the step binds whole")
        out[ks[0]] = fp8_product(eqns[ks[0]])
    return out


def reference_fn(plan: Any, info: Any) -> Callable[..., Any]:
    """The traced function unsharded, with the plan's FP8 products: what the sharded step must equal."""
    import jax

    from shardplan.jax.run import evaluate

    replace = fp8_equations(plan, info)

    def fn(*args: Any) -> Any:
        leaves, tree = jax.tree_util.tree_flatten(args)
        if tree != info.in_tree:
            raise ShardplanError(f"arguments have structure {tree}, the traced function had {info.in_tree}")
        return jax.tree_util.tree_unflatten(info.out_tree, evaluate(info, leaves, replace=replace))

    return fn
