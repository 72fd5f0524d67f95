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

Two scalings (the scale of each of the three tensors, ``X``, ``W`` and ``dY``):

* *delayed* (Transformer Engine's ``DelayedScaling``, its default recipe, and
  what the cost model charges: the cast is one pass, its amax recorded on the
  way): ``s = max(h) / fmax`` from the tensor's amax history ``h`` of earlier
  steps (``s = 1`` while the history is all zero: TE's initial scale), and
  the cast saturates what exceeds ``fmax s``. The history is state carried
  between steps (:func:`init_history`, one ``(3, n)`` array per FP8 operator:
  rows ``X``, ``W``, ``dY``, newest first, ``n`` = :data:`AMAX_HISTORY`): a
  step takes it as an argument and gives back this step's amaxes as its
  "gradient" (the product's custom VJP returns them for the history: the
  technique of flax's ``fp8_ops``), and :func:`roll_history` shifts them in.
  One entry per step: the largest amax the tensor's casts saw in the step, over
  its micro-batches (TE rolls the history at each autocast region, so per
  micro-batch; one per step makes the scales independent of the schedule's
  order of passes, and equal on every stage of a pipeline);
* *current* (TE's ``Float8CurrentScaling``, torchao's tensorwise default):
  ``s = amax(X) / fmax`` of this very tensor, a stateless step
  (``FitStep.step``), one more read of each operand for its amax.

Either way the amax is a max over the whole tensor (under sharding XLA's
partitioner reduces the local maxima over the devices, one scalar all-reduce
per tensor), and a tensor is scaled by one number, so the values each product
multiplies are the same function of the global tensor under any sharding: the
sharded step equals the unsharded FP8 program (:func:`reference_fn`) up to the
order of the float32 sums.

XLA's CPU backend (JAX 0.9.2) has no FP8 dot: it converts both FP8 operands
to float32 and multiplies those (the compiled HLO shows ``f8e4m3fn`` /
``f8e5m2`` converts feeding an f32 ``dot``). The product of two FP8 values
is exact in float32, so the arithmetic is that of an FP8 product with f32
accumulation; only the speed is not.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Sequence

from shardplan.errors import ShardplanError

__all__ = ["E4M3_MAX", "E5M2_MAX", "PRODUCTS", "AMAX_HISTORY", "Fp8TrainState", "quantize", "history_scale", "fp8_product",
           "fp8_equations", "fp8_operators", "init_history", "roll_history", "with_history", "reference_fn"]

E4M3_MAX = 448.0
"""Largest finite ``float8_e4m3fn`` value (OCP 8-bit floating point specification, E4M3: S.1111.110)."""

E5M2_MAX = 57344.0
"""Largest finite ``float8_e5m2`` value (OCP 8-bit floating point specification, E5M2: S.11110.11)."""

PRODUCTS = ("dot_general", "conv_general_dilated")
"""The primitives an FP8 operator's product is bound with."""

AMAX_HISTORY = 1024
"""Amax history length of delayed scaling: Transformer Engine's default ``amax_history_len``
(``transformer_engine.common.recipe.DelayedScaling``, TE 1.x and 2.x), the scale taken from the history's max
(its default ``amax_compute_algo="max"``, margin 0)."""


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


class Fp8TrainState(NamedTuple):
    """The state a training step of a plan with FP8 products carries
    (:meth:`shardplan.jax.memory.FitStep.train_step`): the optimizer's, and the amax histories of delayed scaling."""

    opt_state: Any
    history: Any


def history_scale(history: Any, fmt: str) -> Any:
    """The delayed scale of one tensor from its amax history (a vector, newest first): ``max(h) / fmax``, 1 while
    the history is all zero."""
    import jax.numpy as jnp

    amax = jnp.max(history)
    return jnp.where(amax > 0, amax / (E4M3_MAX if fmt == "e4m3" else E5M2_MAX), 1.0).astype(jnp.float32)


def _quantize_with(x: Any, fmt: str, scale: Any) -> tuple[Any, Any]:
    """``(q, amax)``: ``x`` cast to ``fmt`` with the given ``scale`` (saturating), and ``amax(|x|)``."""
    import jax.numpy as jnp

    dtype, fmax = (jnp.float8_e4m3fn, E4M3_MAX) if fmt == "e4m3" else (jnp.float8_e5m2, E5M2_MAX)
    xf = x.astype(jnp.float32)
    return jnp.clip(xf / scale, -fmax, fmax).astype(dtype), jnp.max(jnp.abs(xf))


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


def _fp8_delayed(apply: Callable[[Any, Any], Any], grads: Callable[[Any, Any, Any], tuple[Any, Any]],
                 out_dtype: Any, x_dtype: Any, w_dtype: Any) -> Callable[[Any, Any, Any], Any]:
    """:func:`_fp8_custom` with delayed scaling: ``prod(x, w, h)``, ``h`` the ``(3, n)`` amax history of ``x``, ``w``
    and the output gradient (module docstring); the "gradient" of ``h`` is this call's three amaxes in column 0
    (zeros elsewhere), what :func:`roll_history` takes."""
    import jax
    import jax.numpy as jnp

    def fwd(x: Any, w: Any, h: Any) -> tuple[Any, Any]:
        sx, sw = history_scale(h[0], "e4m3"), history_scale(h[1], "e4m3")
        qx, ax = _quantize_with(x, "e4m3", sx)
        qw, aw = _quantize_with(w, "e4m3", sw)
        return (apply(qx, qw) * (sx * sw)).astype(out_dtype), (qx, sx, qw, sw, ax, aw, h)

    @jax.custom_vjp
    def prod(x: Any, w: Any, h: Any) -> Any:
        return fwd(x, w, h)[0]

    def bwd(res: Any, g: Any) -> tuple[Any, Any, Any]:
        qx, sx, qw, sw, ax, aw, h = res
        sg = history_scale(h[2], "e5m2")
        qg, ag = _quantize_with(g, "e5m2", sg)
        dx, dw = grads(qx, qw, qg)
        dh = jnp.zeros_like(h).at[:, 0].set(jnp.stack([ax, aw, ag]).astype(h.dtype))
        return (dx * (sg * sw)).astype(x_dtype), (dw * (sx * sg)).astype(w_dtype), dh

    prod.defvjp(fwd, bwd)
    return prod


def _fp8_dot(dn: Any, out_dtype: Any, x_dtype: Any, w_dtype: Any, delayed: bool = False) -> Callable[..., Any]:
    """``dot_general(x, w, dn)`` as an FP8 product (:func:`_fp8_custom`; ``delayed``: :func:`_fp8_delayed`); the
    backward products contract the FP8 values directly (:func:`_contract`)."""
    import jax
    import jax.numpy as jnp

    def apply(qx: Any, qw: Any) -> Any:
        return jax.lax.dot_general(qx, qw, dn, preferred_element_type=jnp.float32)

    def grads(qx: Any, qw: Any, qg: Any) -> tuple[Any, Any]:
        lx, lw, lo = _labels(dn, qx.ndim, qw.ndim)
        return _contract(qg, lo, qw, lw, lx), _contract(qx, lx, qg, lo, lw)

    return (_fp8_delayed if delayed else _fp8_custom)(apply, grads, out_dtype, x_dtype, w_dtype)


def _fp8_conv(params: Mapping[str, Any], out_dtype: Any, x_dtype: Any, w_dtype: Any,
              delayed: bool = False) -> Callable[..., Any]:
    """``conv_general_dilated(x, w, **params)`` as an FP8 product (:func:`_fp8_custom`; ``delayed``:
    :func:`_fp8_delayed`). The backward
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

    return (_fp8_delayed if delayed else _fp8_custom)(conv, grads, out_dtype, x_dtype, w_dtype)


def fp8_product(eqn: Any) -> Callable[..., list[Any]]:
    """What the step binds instead of product equation ``eqn`` (a flat-program equation of a
    :data:`PRODUCTS` primitive): ``run(args, history=None) -> [output]`` in FP8 (module docstring): current
    scaling, or delayed scaling from ``history`` (the operator's ``(3, n)`` amax history)."""
    if eqn.name not in PRODUCTS:
        raise ShardplanError(f"FP8 runs the products {', '.join(PRODUCTS)}, not {eqn.name}")
    import jax.numpy as jnp

    out_dtype = eqn.out_dtypes[0]
    conv_params = {k: v for k, v in eqn.params.items() if k != "preferred_element_type"}

    def run(args: list[Any], history: Any = None) -> list[Any]:
        x, w = args
        dtypes = (out_dtype, jnp.result_type(x), jnp.result_type(w))
        delayed = history is not None
        if eqn.name == "dot_general":
            prod = _fp8_dot(eqn.params["dimension_numbers"], *dtypes, delayed=delayed)
        else:
            prod = _fp8_conv(conv_params, *dtypes, delayed=delayed)
        return [prod(x, w, history) if delayed else prod(x, w)]

    return run


def fp8_equations(plan: Any, info: Any) -> dict[int, Callable[..., list[Any]]]:
    """Equation index -> its FP8 product (:func:`fp8_product`), for every operator the plan runs in FP8
    (``plan.memory_choices.fp8``); empty for a plan without memory choices."""
    eqns = info.program.eqns
    return {k: fp8_product(eqns[k]) for k in fp8_operators(plan, info).values()}


def fp8_operators(plan: Any, info: Any) -> dict[str, int]:
    """Operator name -> the equation index of its product, for every operator the plan runs in FP8, in graph
    order; empty for a plan without memory choices.

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
        out[op.name] = ks[0]
    return out


def init_history(names: Any, length: int = AMAX_HISTORY) -> dict[str, Any]:
    """The amax histories before the first step: per FP8 operator (``names``, or a plan's
    :func:`fp8_operators`) a ``(3, length)`` float32 array of zeros (rows: input, weight, output gradient)."""
    import jax.numpy as jnp

    return {n: jnp.zeros((3, int(length)), jnp.float32) for n in names}


def roll_history(history: Mapping[str, Any], amaxes: Mapping[str, Any]) -> dict[str, Any]:
    """The histories after a step: each shifted by one (the oldest entry dropped) with the step's amaxes (column 0
    of ``amaxes``, the step's "gradient" of the history) as the newest."""
    import jax.numpy as jnp

    return {n: jnp.roll(h, 1, axis=1).at[:, 0].set(amaxes[n][:, 0]) for n, h in history.items()}


def with_history(replace: Mapping[int, Callable[..., list[Any]]], names: Mapping[str, int],
                 history: Mapping[str, Any] | None) -> dict[int, Callable[[list[Any]], list[Any]]]:
    """The ``replace`` hooks of :func:`shardplan.jax.run.evaluate` with each FP8 product bound to its operator's
    history (``names``: operator -> equation; ``history`` None: current scaling)."""
    if history is None:
        return dict(replace)
    by_eqn = {k: n for n, k in names.items()}
    return {k: (lambda f, h: (lambda args: f(args, h)))(f, history[by_eqn[k]]) if k in by_eqn else f
            for k, f in replace.items()}


def reference_fn(plan: Any, info: Any, delayed: bool = False) -> Callable[..., Any]:
    """The traced function unsharded, with the plan's FP8 products: what the sharded step must equal.
    ``delayed``: ``fn(*args, history)``, delayed scaling from the histories (:func:`init_history`); the gradient
    with respect to ``history`` is the amaxes :func:`roll_history` takes."""
    import jax

    from shardplan.jax.run import evaluate

    replace = fp8_equations(plan, info)
    names = fp8_operators(plan, info)

    def run(args: tuple, history: Any) -> Any:
        leaves, tree = jax.tree_util.tree_flatten(args)
        if tree != info.in_tree:
            raise ShardplanError(f"arguments have structure {tree}, the traced function had {info.in_tree}")
        out = evaluate(info, leaves, replace=with_history(replace, names, history))
        return jax.tree_util.tree_unflatten(info.out_tree, out)

    if delayed:
        return lambda *args: run(args[:-1], args[-1])
    return lambda *args: run(args, None)
