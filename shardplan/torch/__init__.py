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

__all__ = ["parallelize", "pipeline", "trace", "report", "HANDLERS", "register", "ShardplanWarning", "TorchTrace",
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
    the reference machine with ``mesh.size()`` devices; ``solve_opts`` go to
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

    p = _world(mesh)
    if machine is None:
        machine = Machine(p, name=f"{p} x {getattr(mesh, 'device_type', 'cpu')}")
    elif machine.num_devices != p:
        raise ShardplanError(f"machine has {machine.num_devices} devices but the mesh has {p}")
    graph, info = trace(module, example_inputs, kwargs)
    if solve_opts.get("divides_p", True) is not True:
        raise ShardplanError("parallelize needs divides_p=True: a DeviceMesh cannot leave devices idle")
    solve_opts["divides_p"] = True
    if budget is not None or fit is not None:
        from dataclasses import replace

        from shardplan.fit import FitOptions, solve_fit
        from shardplan.torch.run import TORCH_STAGES

        options = fit or FitOptions()
        counts = tuple(k for k in options.micro_batches if _splits_batch(example_inputs, kwargs, int(k)))
        if not counts:
            raise ShardplanError(f"no micro-batch count of {tuple(options.micro_batches)} divides axis 0 of every "
                                 "tensor argument (micro-batches split every tensor argument along axis 0)")
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


def report(plan: SpmdPlan, info: TorchTrace | None = None) -> str:
    """Per operator: splits, the mesh axis each split takes, predicted cost; and the step's breakdown.

    With ``info``, conservatively described operators are marked ``*``.
    """
    from shardplan.table import format_table
    from shardplan.units import fmt_seconds

    cons = set(info.conservative) if info is not None else set()
    shape = plan_mesh_shape(list(plan.layouts.values()), plan.machine.num_devices)
    lines = [f"{plan.graph.name}: {len(plan.graph)} operators on {plan.machine.num_devices} devices "
             f"(mesh {'x'.join(map(str, shape))}), predicted {fmt_seconds(plan.cost)} per step, "
             f"solved in {fmt_seconds(plan.solve_seconds)}"]
    rows = []
    for row in plan.operators():
        op = plan.graph[row["name"]]
        splits = " ".join(f"{d}{c}" for d, c in zip(row["dims"], row["config"]) if c > 1) or "replicated"
        axes = " ".join(d or "_" for d in mesh_dims(plan.layout(op.name), shape, op.name))
        mark = "*" if row["name"] in cons else ""
        rows.append((mark + row["name"], row["kind"], splits, f"[{axes}]", fmt_seconds(row["cost_seconds"])))
    lines.extend("  " + line for line in format_table(rows, right=(4,)).splitlines())
    parts = ", ".join(f"{k} {fmt_seconds(v)}" for k, v in plan.breakdown.items() if v and k != "total")
    lines.append(f"  breakdown: {parts}")
    if cons:
        lines.append("  * described conservatively: " + ", ".join(sorted(set(info.conservative.values()))))
    return "\n".join(lines)
