"""PyTorch: an ``nn.Module`` in, a plan and a DTensor-sharded module out.

>>> import shardplan.torch as st                                    # doctest: +SKIP
>>> mesh = init_device_mesh("cpu", (8,))                            # doctest: +SKIP
>>> plan, pm = st.parallelize(model, (ids, labels), mesh)           # doctest: +SKIP
>>> loss = pm(ids, labels); loss.backward()                         # doctest: +SKIP
>>> print(st.report(plan))                                          # doctest: +SKIP

* :mod:`shardplan.torch.frontend`: ``torch.export`` → IR graph (handlers per ATen op);
* :mod:`shardplan.torch.layout`: configurations → DTensor placements on one mesh;
* :mod:`shardplan.torch.run`: the sharded module;
* :func:`pipeline` (:mod:`shardplan.torch.staged`): the searched pipeline on ``torch.distributed.pipelining``.

PyTorch is an optional dependency (``pip install -e '.[torch]'``): this
package imports it only when a function is called.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from shardplan.errors import ShardplanError
from shardplan.machine import Machine
from shardplan.spmd import SpmdPlan, solve
from shardplan.torch.frontend import HANDLERS, ShardplanWarning, TorchTrace, register, trace
from shardplan.torch.layout import (layout_groups, mesh_dims, mesh_factors, placement_names, plan_mesh_shape,
                                    tensor_placements)

__all__ = ["plan", "apply", "parallelize", "pipeline", "trace", "report", "HANDLERS", "register", "ShardplanWarning", "TorchTrace",
           "mesh_factors", "layout_groups", "plan_mesh_shape", "mesh_dims", "tensor_placements", "placement_names", "plan_placements"]


def plan_placements(plan: SpmdPlan, info: TorchTrace) -> dict[str, Any]:
    """Per operator the dimension each mesh axis splits and its output placements; per parameter its placements."""
    from shardplan.torch.run import plan_placements as _pp

    return _pp(plan, info, plan.machine.num_devices)


def _world(mesh: Any) -> int:
    if mesh is None:
        import torch.distributed as dist

        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return int(mesh.mesh.numel())


def _machine(mesh: Any, machine: Machine | None) -> Machine:
    """``machine``, checked against the mesh's size, or the mesh's own (:func:`shardplan.torch.device.mesh_machine`),
    charging the collectives the DTensor run sends (:func:`shardplan.torch.device.dtensor_machine`): a change of
    layout what each device lacks (not XLA's steps), a partial sum one all-reduce per split dim, an all-gathered
    attention's key/value gradients reduce-scattered home."""
    from shardplan.torch.device import dtensor_machine

    if mesh is None:
        if machine is None:
            raise ShardplanError("give the DeviceMesh the plan runs on (or machine=, e.g. preset('h100', 64))")
        return dtensor_machine(machine)
    p = _world(mesh)
    if machine is None:
        from shardplan.torch.device import mesh_machine

        machine = mesh_machine(mesh)
    if machine.num_devices != p:
        raise ShardplanError(f"machine has {machine.num_devices} devices but the mesh has {p}")
    return dtensor_machine(machine)


def plan(module: Any, example_inputs: Sequence[Any], mesh: Any = None, *, kwargs: Mapping[str, Any] | None = None,
         machine: Machine | None = None, **keywords: Any) -> Any:
    """The fastest plan of ``module(*example_inputs, **kwargs)`` (a loss) that fits: :func:`shardplan.planner.plan`
    with the same keywords (``budget``, ``fit``, ``stages``, ``micro_batches``, ...) on the module traced at
    every micro-batch size. ``machine`` defaults to the mesh's own (device name, mesh size, processes per
    node). Every rank calls it with the same module and inputs and finds the same plan (the search is
    deterministic), or loads one with ``Plan.from_json``; run it with :func:`apply`.

    What the PyTorch run can hold is what is searched: ZeRO stages 0 and 3 only
    (:data:`~shardplan.torch.run.TORCH_STAGES`), micro-batch counts that divide axis 0 of every tensor
    argument. Stages need every input to be a tensor with the batch on axis 0 and no ``kwargs``; otherwise
    one program is planned (the plan's statistics say why).
    """
    import dataclasses

    from shardplan.fit import FitOptions
    from shardplan.planner import plan as _plan
    from shardplan.torch.run import TORCH_STAGES
    from shardplan.torch.staged import Tracer

    machine = _machine(mesh, machine)
    counts = _counts(keywords.pop("micro_batches", None) or (1, 2, 4, 8), example_inputs, kwargs,
                     machine.num_devices) or (1,)
    if "fit_options" not in keywords:
        keywords["fit_options"] = FitOptions(stages=TORCH_STAGES, micro_batches=counts)
    keywords.setdefault("cutoff", 1)
    try:
        if kwargs:
            raise ShardplanError("keyword arguments")
        model: Any = Tracer(module, example_inputs)
        batch = model.batch
        _, info, old = model.traced(batch)
        weak = info.conservative_ops({v: k for k, v in old.items()})
    except ShardplanError:
        model, info = trace(module, example_inputs, kwargs)
        batch, weak = None, info.conservative_ops()
    return dataclasses.replace(_plan(model, machine, batch=batch, micro_batches=counts, **keywords), conservative=weak)


def apply(plan: Any, module: Any, example_inputs: Sequence[Any], mesh: Any = None, *,
          kwargs: Mapping[str, Any] | None = None, schedule: str | None = None, reduction: str = "mean") -> Any:
    """``plan`` (a :class:`shardplan.Plan`, computed here or loaded with ``Plan.from_json``) made runnable for
    ``module``: the sharded module (one program, on ``mesh``; its parameters by the model's own names, see
    :func:`parallelize`) or this rank's pipeline stages and schedule (on the default process group;
    ``schedule``: e.g. "gpipe" for a 1F1B plan; ``reduction``: the loss is a "mean" or a "sum").

    The module is traced again here and the plan's choices are checked against it: a plan made for
    another program, batch or device count is refused. A pipeline's stages run their layouts, FP8 products,
    activation offload, the ring and (stages of two processes) recomputation (:mod:`shardplan.torch.staged`),
    ZeRO-3 parameters (in host memory where offloaded), and ZeRO-1/2 optimizer state and gradient shards and
    offloaded optimizer state through ``pipe.optimizer(cls, **options)``; one whose stages keep parameters in host
    memory off ZeRO stage 3 is refused before anything is traced.
    """
    import dataclasses

    from shardplan.planner import spmd_of
    from shardplan.torch.run import parallel_module

    if plan.pipelined:
        from shardplan.torch.staged import Tracer, build_pipeline, check_stage_choices, plan_layout

        layout, stage_layouts = plan_layout(plan)
        check_stage_choices(layout["choices"], max(s.devices for s in plan.stages))
        several = max(s.devices for s in plan.stages) > 1
        return build_pipeline(None, layout, stage_layouts if several else None, Tracer(module, example_inputs),
                              module, schedule, reduction)
    p = _world(mesh)
    if p != plan.machine.num_devices:
        raise ShardplanError(f"the plan is for {plan.machine.num_devices} devices, the mesh has {p}")
    graph, info = trace(module, example_inputs, kwargs)
    if set(plan.operators) != {op.name for op in graph.operators}:  # planned on the unit-scoped names
        from shardplan.torch.staged import scoped_trace

        _, _, old = scoped_trace(module, tuple(example_inputs))
        stage = plan.stages[0]
        renamed = dataclasses.replace(stage, operators={old.get(n, n): c for n, c in stage.operators.items()})
        plan = dataclasses.replace(plan, stages=(renamed,), detail=None)
    sp = spmd_of(plan, graph)
    return parallel_module(module, example_inputs, kwargs, info, sp, mesh)


def _counts(counts: Sequence[int], args: Sequence[Any], kwargs: Mapping[str, Any] | None, p: int) -> tuple[int, ...]:
    """The micro-batch counts k the PyTorch run can hold: k = 1, and those for which axis 0 of every tensor
    argument divides into k micro-batches each divisible by p, so that every planned split of the batch
    (a divisor of p) divides a micro-batch (:func:`shardplan.torch.run.check_same_program`)."""
    return tuple(int(k) for k in counts if int(k) == 1 or _splits_batch(args, kwargs, int(k) * p))


def _splits_batch(args: Sequence[Any], kwargs: Mapping[str, Any] | None, k: int) -> bool:
    """Whether ``k`` micro-batches split every tensor argument along axis 0 (k = 1 always does)."""
    import torch
    from torch.utils import _pytree as pytree

    leaves = pytree.tree_leaves((tuple(args), dict(kwargs or {})))
    return k == 1 or all(x.dim() > 0 and x.shape[0] % k == 0 for x in leaves if isinstance(x, torch.Tensor))


def parallelize(module: Any, example_inputs: Sequence[Any], mesh: Any, *, kwargs: Mapping[str, Any] | None = None,
                machine: Machine | None = None, cutoff: int = 1, budget: float | None = None, fit: Any = None,
                **solve_opts: Any) -> tuple[SpmdPlan, Any]:
    """Plan ``module(*example_inputs, **kwargs)`` on the devices of ``mesh`` and return ``(plan, sharded module)``.

    ``mesh`` is a :class:`torch.distributed.device_mesh.DeviceMesh` over all
    devices (any shape: its devices are re-laid as one mesh of prime-factor
    axes, see :mod:`shardplan.torch.layout`). Every rank calls this with the
    same module (same parameter values) and inputs; tracing and solving are
    deterministic, so every rank finds the same plan. ``machine`` defaults to
    the mesh's own (:func:`shardplan.torch.device.mesh_machine`); ``solve_opts`` go to
    :func:`shardplan.spmd.solve` (only configurations whose device count
    divides p are kept, as a mesh needs).

    With ``budget`` (bytes per device) or ``fit`` (:class:`shardplan.fit.FitOptions`;
    the budget is then the machine's memory) the plan is the fastest whose
    peak memory fits (:func:`shardplan.fit.solve_fit`, ``solve_opts`` going
    to it), and the module runs its memory choices
    (:class:`~shardplan.torch.run.RunChoices`): recomputed operators under
    ``torch.utils.checkpoint``, k micro-batches by gradient accumulation in
    ``pm.step(*inputs)`` (every tensor argument is split along axis 0; the
    loss must be a mean over the batch), and ZeRO stage 3 as parameters
    sharded over their data-parallel group, gathered on use and gathered
    again in the backward pass (the optimizer state, created like the
    parameter, is sharded with it). ZeRO stages 1 and 2 are not offered to
    the search (:data:`~shardplan.torch.run.TORCH_STAGES`): ``fit.stages`` is
    cut to stages 0 and 3, and ``fit.micro_batches`` to the counts that divide
    axis 0 of every tensor argument. A count whose micro-batch some planned
    split does not divide raises :class:`~shardplan.errors.ShardplanError`
    when the module is built (the fit model does not check it).

    The module returned runs the forward pass on DTensors laid out as planned
    (call it as the module; DTensor outputs come back as full tensors). Its
    parameters and buffers carry ``module``'s own names (``named_parameters()``,
    ``state_dict()``, ``load_state_dict()`` of full tensors or DTensors), the
    parameters as DTensors; ``named_dparameters()`` lists every name of a tied one.
    """
    from shardplan.torch.run import parallel_module

    machine = _machine(mesh, machine)
    graph, info = trace(module, example_inputs, kwargs)
    if solve_opts.get("divides_p", True) is not True:
        raise ShardplanError("parallelize needs divides_p=True: a DeviceMesh cannot leave devices idle")
    solve_opts["divides_p"] = True
    if budget is not None or fit is not None:
        from dataclasses import replace

        from shardplan.fit import FitOptions, solve_fit
        from shardplan.torch.run import TORCH_STAGES

        options = fit or FitOptions()
        counts = _counts(options.micro_batches, example_inputs, kwargs, machine.num_devices)
        if not counts:
            raise ShardplanError(f"no micro-batch count of {tuple(options.micro_batches)} leaves axis 0 of every "
                                 f"tensor argument divisible by the {machine.num_devices} devices (micro-batches "
                                 "split every tensor argument along axis 0, and each micro-batch is split as planned)")
        options = replace(options, stages=tuple(s for s in options.stages if s in TORCH_STAGES),
                          micro_batches=counts)
        plan = solve_fit(graph, machine, budget=budget, options=options, cutoff=cutoff, **solve_opts)
    else:
        plan = solve(graph, machine, cutoff=cutoff, **solve_opts)
    return plan, parallel_module(module, example_inputs, kwargs, info, plan, mesh)


def pipeline(module: Any, example_inputs: Sequence[Any], machine: Machine | None = None, **options: Any) -> Any:
    """Search the pipeline of ``module(*example_inputs)`` (a loss) over this process group and build this
    rank's stages and ``torch.distributed.pipelining`` schedule: :func:`shardplan.torch.staged.pipeline`.

    ``pipe = st.pipeline(model, (ids, labels)); loss = pipe.step(ids, labels)``.
    """
    from shardplan.torch.staged import pipeline as _pipeline

    return _pipeline(module, example_inputs, machine, **options)


def report(plan: Any, info: TorchTrace | None = None, operators: bool = True) -> str:
    """The one report (:func:`shardplan.report.summary.render_plan`) of a plan (a :class:`shardplan.Plan` or
    the :class:`~shardplan.spmd.SpmdPlan` :func:`parallelize` returns), with the per-operator table unless
    ``operators=False``, the mesh the module runs on, and the operators described conservatively (not
    split: their operands gathered): the plan's own list, or, with ``info``, the trace's."""
    import dataclasses

    from shardplan.report.summary import as_plan, render_plan

    p = as_plan(plan)
    if info is not None and not p.conservative:
        p = dataclasses.replace(p, conservative=info.conservative_ops())
    lines = [render_plan(p, operators=operators)]
    if not p.pipelined:
        shape = plan_mesh_shape(list(p.layouts.values()), p.machine.num_devices)
        lines.append(f"DeviceMesh: {'x'.join(map(str, shape))} (prime-factor axes; each operator's splits take "
                     "them in order)")
    return "\n".join(lines)
