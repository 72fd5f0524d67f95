"""One call from a JAX loss function to a planned, sharded training step.

>>> import shardplan.jax as sj                                   # doctest: +SKIP
>>> plan, step = sj.parallelize(loss_fn, params, batch)          # doctest: +SKIP
>>> loss, grads = step(params, batch)                            # doctest: +SKIP
>>> print(sj.report(plan))                                       # doctest: +SKIP

JAX is an optional dependency: this module imports it on use.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from shardplan.errors import ShardplanError
from shardplan.export.jax import make_step, plan_shardings
from shardplan.frontends.jax import TraceInfo, trace
from shardplan.machine import Machine
from shardplan.plan import Plan, solve

__all__ = ["parallelize", "trace", "make_step", "plan_shardings", "report", "TraceInfo"]


def parallelize(loss_fn: Callable[..., Any], params: Any, batch: Any, devices: Sequence[Any] | None = None,
                machine: Machine | None = None, cutoff: int = 1, **solve_opts: Any,
                ) -> tuple[Plan, Callable[[Any, Any], tuple[Any, Any]]]:
    """Plan ``loss_fn(params, batch)`` on ``devices`` and return ``(plan, step)``.

    ``step(params, batch) -> (loss, grads)`` is ``jax.value_and_grad`` of the
    function re-run with the planned sharding constraints, jitted with the
    planned input shardings. ``machine`` defaults to the reference machine
    (10 TFLOP/s, 16 GB/s) with ``len(devices)`` devices; ``solve_opts`` go to
    :func:`shardplan.plan.solve` (``divides_p`` defaults to True, since only
    configurations whose device count divides p can be expressed as a mesh).
    """
    import jax

    devices = list(devices) if devices is not None else list(jax.devices())
    p = len(devices)
    if machine is None:
        machine = Machine(p, name=f"{p} x {devices[0].platform}")
    elif machine.num_devices != p:
        raise ShardplanError(f"machine has {machine.num_devices} devices but {p} devices were given")
    graph, info = trace(loss_fn, params, batch, params_argnums=(0,))
    solve_opts.setdefault("divides_p", True)
    plan = solve(graph, machine, cutoff=cutoff, **solve_opts)
    return plan, make_step(plan, info, devices)


def report(plan: Plan) -> str:
    """A readable per-operator table: splits, predicted cost, and the breakdown of the step."""
    from shardplan.report import format_table
    from shardplan.units import fmt_seconds

    lines = [f"{plan.graph.name}: {len(plan.graph)} operators on {plan.machine.num_devices} devices, "
             f"predicted {fmt_seconds(plan.cost)} per step"]
    rows = []
    for row in plan.operators():
        splits = " ".join(f"{d}{c}" for d, c in zip(row["dims"], row["config"]) if c > 1) or "replicated"
        rows.append((row["name"], row["kind"], splits, fmt_seconds(row["cost_seconds"])))
    lines.extend("  " + line for line in format_table(rows, right=(3,)).splitlines())
    parts = ", ".join(f"{k} {fmt_seconds(v)}" for k, v in plan.breakdown.items() if v and k != "total")
    lines.append(f"  breakdown: {parts}")
    return "\n".join(lines)
