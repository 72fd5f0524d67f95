"""JAX: from a loss function to a planned, sharded training step.

>>> import shardplan.jax as sj                                   # doctest: +SKIP
>>> plan, step = sj.parallelize(loss_fn, params, batch)          # doctest: +SKIP
>>> loss, grads = step(params, batch)                            # doctest: +SKIP
>>> print(sj.report(plan))                                       # doctest: +SKIP

In your own training loop (e.g. with optax; ``partial`` is ``functools.partial``)::

    p = sj.planned(loss_fn, params, batch)
    params = jax.device_put(params, p.param_shardings)
    batch = jax.device_put(batch, p.batch_shardings)
    opt_state = jax.jit(opt.init)(params)           # follows the parameters' shardings

    @partial(jax.jit, out_shardings=(p.param_shardings, None, None))   # new params as planned
    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(p.loss_fn)(params, batch)   # the planned constraints
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

The package: :mod:`~shardplan.jax.flatten` (the jaxpr as one flat program),
:mod:`~shardplan.jax.lower` (the program as a shardplan graph),
:mod:`~shardplan.jax.shardings` (a plan as NamedShardings),
:mod:`~shardplan.jax.run` (the program re-run with the plan's constraints, the step),
:mod:`~shardplan.jax.hlo` (what the compiled program really sends),
:mod:`~shardplan.jax.memory` (a fit plan's memory choices in the step), with
:mod:`~shardplan.jax.fp8` (FP8 products) and :mod:`~shardplan.jax.offload` (host offload);
:func:`pipeline` (:mod:`shardplan.jax.staged`): the searched pipeline, one jitted program per stage.
JAX is an optional dependency: it is imported on use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from shardplan.errors import ShardplanError
from shardplan.jax.lower import TraceInfo, supported_primitives, trace
from shardplan.jax.run import constrained_fn, make_step, ring_hooks
from shardplan.jax.shardings import devices_and_machine, plan_shardings
from shardplan.machine import Machine
from shardplan.spmd import SpmdPlan, solve

__all__ = ["plan", "apply", "parallelize", "planned", "pipeline", "Planned", "trace", "make_step", "plan_shardings",
           "report", "TraceInfo", "supported_primitives"]


def check_loss(loss_fn: Callable[..., Any], params: Any, batch: Any, has_aux: bool = False) -> None:
    """Refuse, at planning time, a loss the step cannot differentiate: ``loss_fn(params, batch)`` (its first
    value with ``has_aux``) must be a real scalar and every parameter leaf a floating-point array
    (``jax.value_and_grad`` fails on anything else, but only when the step first runs)."""
    import jax
    import jax.numpy as jnp

    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        dtype = jnp.result_type(leaf)
        if not jnp.issubdtype(dtype, jnp.inexact) or jnp.issubdtype(dtype, jnp.complexfloating):
            raise ShardplanError(f"parameter {jax.tree_util.keystr(path) or 'params'} has dtype {dtype} "
                                 f"(shape {tuple(jnp.shape(leaf))}): parameters must be real floating-point arrays "
                                 "(gradients are taken with respect to every parameter)")
    out = jax.eval_shape(loss_fn, params, batch)
    if has_aux:
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise ShardplanError("has_aux=True: the loss function must return (loss, aux)")
        out = out[0]
    shape, dtype = getattr(out, "shape", None), getattr(out, "dtype", None)
    if shape != () or dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        what = f"shape {shape} and dtype {dtype}" if shape is not None else f"a {type(out).__name__}"
        raise ShardplanError(f"the loss must be a real floating-point scalar (shape ()), got {what}"
                             + ("" if has_aux else "; a loss returning (loss, aux) needs has_aux=True"))


@dataclass(frozen=True, eq=False)
class Planned:
    """A plan for ``loss_fn(params, batch)`` and everything needed to run it.

    Attributes:
        plan: the solved plan.
        info: what tracing found (the flat program, leaves, reads).
        devices: the devices of the mesh.
        param_shardings: a pytree of NamedSharding matching ``params``.
        batch_shardings: a pytree of NamedSharding matching ``batch``.
        loss_fn: ``loss_fn(params, batch)`` re-run with the planned sharding
            constraints (on every operator's output and on what each operator
            reads), to call inside your own ``jax.jit``.
        step: ``jax.jit`` of ``value_and_grad(loss_fn)`` with the planned input shardings.
        fit: for a plan with memory choices (ZeRO stages, recomputation,
            micro-batches), its :class:`~shardplan.jax.memory.FitStep`: then
            ``step`` is the fit step, ``param_shardings`` hold stage-3 parameters
            in shards, and ``fit.train_step(optimizer, params)`` runs a whole
            update with the optimizer state sharded (None for a plain plan).
        pipeline: for a pipelined plan, its staged step (one jitted program per
            stage on its sub-mesh); ``step`` is that, and the shardings and the
            constrained loss are None (each stage has its own).
    """

    plan: SpmdPlan
    info: TraceInfo
    devices: tuple[Any, ...]
    param_shardings: Any
    batch_shardings: Any
    loss_fn: Callable[..., Any]
    step: Callable[..., Any]
    fit: Any = None
    pipeline: Any = None


def plan(loss_fn: Callable[..., Any], params: Any, batch: Any, devices: Sequence[Any] | None = None,
         machine: Machine | None = None, **keywords: Any) -> Any:
    """The fastest plan of ``loss_fn(params, batch)`` on ``devices`` that fits: :func:`shardplan.planner.plan`
    with the same keywords (``budget``, ``fit``, ``stages``, ``micro_batches``, ...) on the loss traced at
    every micro-batch size (the batch leaves' leading axis is the batch). ``machine`` defaults to the
    devices' own (:func:`~shardplan.jax.shardings.devices_and_machine`). Run it with :func:`apply`.

    The loss must be a mean over the batch when the plan uses micro-batches or stages (each micro-batch's
    gradient is scaled by 1/m). The plan lists the primitives described conservatively
    (:attr:`shardplan.Plan.conservative`; :mod:`shardplan.jax.lower`).
    """
    import dataclasses

    from shardplan.jax.staged import Tracer, batch_size
    from shardplan.planner import plan as _plan

    devices, machine = devices_and_machine(devices, machine)
    check_loss(loss_fn, params, batch)
    tracer = Tracer(loss_fn, params, batch)
    keywords.setdefault("cutoff", 1)
    found = _plan(tracer, machine, batch=batch_size(tracer.full_info), **keywords)
    return dataclasses.replace(found, conservative=tracer.full_info.conservative)


def apply(plan: Any, loss_fn: Callable[..., Any], params: Any, batch: Any, devices: Sequence[Any] | None = None,
          has_aux: bool = False, reduction: str = "mean") -> Planned:
    """``plan`` (a :class:`shardplan.Plan`, computed here or loaded with ``Plan.from_json``) made runnable for
    ``loss_fn(params, batch)`` on ``devices``: the shardings, the constrained loss and the step for one
    program; for a pipeline, the staged step (``reduction``: the loss is a "mean" or a "sum" over the batch).

    The program is traced again here and the plan's choices are checked against it: a plan made for
    another program, batch or machine size is refused. A pipeline's stages run their layouts,
    recomputation, FP8 products and activation offload (:mod:`shardplan.jax.staged`); their ZeRO stages and
    offloaded optimizer state or parameters are held by the staged training step
    (``Planned.step.train_step(optimizer, params)``, :class:`~shardplan.jax.staged.StagedTrain`).
    """
    import jax

    from shardplan.jax.staged import Tracer, build_staged, scoped_trace
    from shardplan.planner import pipeline_of, spmd_of

    devs = list(devices) if devices is not None else list(jax.devices())
    if len(devs) != plan.machine.num_devices:
        raise ShardplanError(f"the plan is for {plan.machine.num_devices} devices, {len(devs)} were given")
    if plan.pipelined:
        tracer = Tracer(loss_fn, params, batch)
        step = build_staged(pipeline_of(plan, tracer), tracer, devs, reduction=reduction)
        _check_stage_choices(plan, step)
        return Planned(plan, step.info, tuple(devs), None, None, None, step, None, step)
    graph, info = trace(loss_fn, params, batch, params_argnums=(0,))
    if set(plan.operators) != {op.name for op in graph.operators}:  # planned by plan(): the scoped names
        graph, info = scoped_trace(loss_fn, params, batch)
    return _runnable(spmd_of(plan, graph), loss_fn, params, batch, info, devs, has_aux)


def _check_stage_choices(plan: Any, step: Any) -> None:
    """Every stage of ``step`` runs the recomputation, FP8 products, offload and ZeRO stages ``plan`` gives its
    operators (a stage rebuilt without its memory choices would run without them: refused)."""
    from shardplan.jax.staged import stage_choices

    def held(name: str, stage: int, parts: Any) -> tuple | None:
        kept = tuple(sorted(set(parts) - {"activations"}))
        return (name, int(stage), kept) if stage or kept else None

    for j, (s, st) in enumerate(zip(plan.stages, step.stages)):
        own = st.plan.graph.recomputed
        want = ({n for n, c in s.operators.items() if c.recompute} - own,
                {n for n, c in s.operators.items() if c.fp8},
                {n for n, c in s.operators.items() if "activations" in c.offload and not c.recompute},
                {held(n, c.state_stage, c.offload) for n, c in s.operators.items()} - {None})
        recs, offl = stage_choices(st.plan)
        mc = st.plan.memory_choices
        ops = list(enumerate(st.plan.graph.operators))
        fp8 = set() if mc is None else {op.name for i, op in ops if mc.fp8(i)}
        state = set() if mc is None else {held(op.name, mc.stage(i), mc.offload(i)) for i, op in ops} - {None}
        if (set(recs), fp8, set(offl), state) != want:
            raise ShardplanError(f"stage {j}'s plan does not carry the recomputation, FP8 products, offload or ZeRO "
                                 "stages its "
                                 "operators are given (a plan edited after the search still holds the search's "
                                 "answer: drop its detail; a loaded one lists the stage in "
                                 "stats['memory_choice_stages'])")


def _runnable(sp: SpmdPlan, loss_fn: Callable[..., Any], params: Any, batch: Any, info: TraceInfo,
              devices: Sequence[Any], has_aux: bool) -> Planned:
    """A tables-backed per-operator plan ``sp`` of the traced program as a :class:`Planned`."""
    import jax

    if sp.memory_choices is not None:
        from shardplan.jax.memory import fit_step

        fs = fit_step(sp, loss_fn, params, batch, devices, has_aux=has_aux, info=info)
        return Planned(sp, info, tuple(devices), fs.param_shardings, fs.batch_shardings, fs.loss_fn, fs.step, fs)
    sh = plan_shardings(sp, info, devices)
    tree = jax.tree_util.tree_unflatten(info.in_tree, list(sh.leaves))
    fn = constrained_fn(info, sh, ring_hooks(sp, info, devices))
    return Planned(sp, info, tuple(devices), tree[0], tree[1], fn,
                   make_step(sp, info, devices, has_aux=has_aux))


def planned(loss_fn: Callable[..., Any], params: Any, batch: Any, devices: Sequence[Any] | None = None,
            machine: Machine | None = None, cutoff: int = 1, has_aux: bool = False, budget: float | None = None,
            fit: Any = None, **solve_opts: Any) -> Planned:
    """Trace ``loss_fn(params, batch)``, plan it on ``devices`` and return a :class:`Planned`.

    With ``budget`` (bytes per device) or ``fit`` (:class:`shardplan.fit.FitOptions`;
    the budget is then the machine's memory) the plan is the fastest that fits
    (:func:`shardplan.fit.solve_fit`), run with its memory choices
    (:mod:`shardplan.jax.memory`; the loss must be a mean over the batch when
    the plan uses micro-batches).

    ``machine`` defaults to the devices' own
    (:func:`~shardplan.jax.shardings.devices_and_machine`); ``solve_opts`` go to :func:`shardplan.spmd.solve`
    (``divides_p`` defaults to True: only configurations whose device count
    divides p can be expressed as a mesh). ``has_aux``: ``loss_fn`` returns
    ``(loss, aux)``, as in ``jax.value_and_grad``.
    """
    devices, machine = devices_and_machine(devices, machine)
    check_loss(loss_fn, params, batch, has_aux)
    graph, info = trace(loss_fn, params, batch, params_argnums=(0,))
    solve_opts.setdefault("divides_p", True)
    if budget is not None or fit is not None:
        from shardplan.fit import FitOptions, solve_fit

        sp = solve_fit(graph, machine, budget=budget, options=fit or FitOptions(), cutoff=cutoff, **solve_opts)
    else:
        sp = solve(graph, machine, cutoff=cutoff, **solve_opts)
    return _runnable(sp, loss_fn, params, batch, info, devices, has_aux)


def parallelize(loss_fn: Callable[..., Any], params: Any, batch: Any, devices: Sequence[Any] | None = None,
                machine: Machine | None = None, cutoff: int = 1, has_aux: bool = False, budget: float | None = None,
                fit: Any = None, **solve_opts: Any) -> tuple[SpmdPlan, Callable[[Any, Any], Any]]:
    """Plan ``loss_fn(params, batch)`` on ``devices`` and return ``(plan, step)``.

    ``step(params, batch) -> (loss, grads)`` (``((loss, aux), grads)`` with
    ``has_aux``) is ``jax.value_and_grad`` of the function re-run with the
    planned sharding constraints, jitted with the planned input shardings.
    See :func:`planned` for the arguments.
    """
    pl = planned(loss_fn, params, batch, devices, machine, cutoff, has_aux, budget, fit, **solve_opts)
    return pl.plan, pl.step


def pipeline(loss_fn: Callable[..., Any], params: Any, batch: Any, devices: Sequence[Any] | None = None,
             machine: Machine | None = None, **options: Any) -> Any:
    """Search the pipeline of ``loss_fn(params, batch)`` on ``devices`` and return it runnable:
    :func:`shardplan.jax.staged.pipeline` (``loss, grads = step(params, batch)``)."""
    from shardplan.jax.staged import pipeline as _pipeline

    return _pipeline(loss_fn, params, batch, devices, machine, **options)


def report(plan: Any, operators: bool = True, info: TraceInfo | None = None) -> str:
    """The one report (:func:`shardplan.report.summary.render_plan`) of a plan (a :class:`shardplan.Plan`, the
    per-operator plan of a :class:`Planned`, or ``Planned`` itself), with the per-operator table unless
    ``operators=False``, and the primitives described conservatively (not split: their operands gathered):
    the plan's own list, or the trace's (``Planned``'s, or ``info``)."""
    import dataclasses

    from shardplan.report.summary import as_plan, render_plan

    if isinstance(plan, Planned):
        plan, info = plan.plan, info or plan.info
    p = as_plan(plan)
    if info is not None and not p.conservative:
        p = dataclasses.replace(p, conservative=info.conservative)
    return render_plan(p, operators=operators)
