"""What every engine needs to run a searched pipeline plan: stages, their programs' parts, the issue order.

A :class:`~shardplan.pipeline.api.PipelineResult` fixes units (blocks) per
stage, each stage's sub-mesh (``devices`` consecutive devices from
``offset``), m and the schedule. An engine runs it as one program per stage
(chunk, for interleaved plans) on that stage's devices, exchanging the
tensors that cross each cut. This module holds the engine-neutral parts:

* :func:`stage_specs`: per stage (chunk) its units, operators, devices and
  device group; the chunk ``c`` of group ``d`` is stage ``c S + d`` (the
  search deals the S v chunks round-robin over the S groups).
* :func:`assign_nodes`: the program's nodes (JAX equations, FX nodes) to
  stages. Operator nodes go to their unit's stage; every other node (a
  reshape of a parameter, a constant mask) goes to the earliest stage that
  reads it (so parameters and constants are not shipped between stages),
  or, read by no node, to the stage of its latest input; it is an error when
  a node would run before one of its inputs.
* :func:`issue_order`: the order in which a single controller issues the
  m forward and m backward passes of every stage: each device group keeps
  exactly the order of the schedule (:func:`~shardplan.pipeline.schedule.simulate`'s
  per-group sequence: GPipe, 1F1B or interleaved 1F1B), and the groups are
  merged so that every pass comes after the passes it depends on (forward
  of micro-batch j on stage i after its forward on stage i - 1; backward on
  stage i after its forward there and its backward on stage i + 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Mapping, Sequence

from shardplan.errors import ShardplanError
from shardplan.pipeline.schedule import SCHEDULES, simulate
from shardplan.pipeline.stages import units_of

__all__ = ["StageSpec", "stage_specs", "ops_by_stage", "assign_nodes", "issue_order", "stage_plan"]


@dataclass(frozen=True)
class StageSpec:
    """Stage (chunk) ``index``: units [first, end) on devices [offset, offset + devices) of device group
    ``group``; ``chunk`` is its position among the group's chunks (0 without interleaving)."""

    index: int
    first: int
    end: int
    offset: int
    devices: int
    group: int
    chunk: int


def stage_specs(plan: Any) -> list[StageSpec]:
    """The stages of a :class:`~shardplan.pipeline.search.PipelinePlan` in pipeline order."""
    n = plan.num_stages
    groups = n // plan.chunks
    return [StageSpec(j, s.first, s.end, s.offset, s.devices, j % groups, j // groups)
            for j, s in enumerate(plan.stages)]


def ops_by_stage(graph: Any, specs: Sequence[StageSpec]) -> dict[str, int]:
    """Operator name -> stage index, by the units of ``graph`` (:func:`~shardplan.pipeline.stages.units_of`)."""
    units = units_of(graph)
    out: dict[str, int] = {}
    for spec in specs:
        for u in range(spec.first, spec.end):
            for i in units[u]:
                out[graph.operators[i].name] = spec.index
    if len(out) != len(graph.operators):
        raise ShardplanError(f"the stages cover {len(out)} of {len(graph.operators)} operators")
    return out


def assign_nodes(order: Sequence[Hashable], inputs: Mapping[Hashable, Sequence[Hashable]],
                 fixed: Mapping[Hashable, int], last: int,
                 outputs: Sequence[Hashable] = ()) -> dict[Hashable, int]:
    """Stage of every node of a program in topological ``order`` (see the module docstring).

    ``inputs[n]``: the nodes ``n`` reads (program arguments are not nodes); ``fixed``: operator nodes'
    stages; ``outputs``: nodes whose value the program returns (they run on ``last``, the last stage,
    unless fixed).
    """
    readers: dict[Hashable, list[Hashable]] = {n: [] for n in order}
    for n in order:
        for a in inputs.get(n, ()):
            if a in readers:
                readers[a].append(n)
    outs = set(outputs)
    stage: dict[Hashable, int] = {}
    for n in reversed(order):
        if n in fixed:
            stage[n] = int(fixed[n])
        elif any(r in stage for r in readers[n]):
            stage[n] = min(stage[r] for r in readers[n] if r in stage)
        elif n in outs:
            stage[n] = last
    for n in order:  # nodes whose result nothing placed reads: after their latest input
        if n not in stage:
            stage[n] = max((stage[a] for a in inputs.get(n, ()) if a in stage), default=0)
    for n in order:
        for a in inputs.get(n, ()):
            if a in stage and stage[a] > stage[n]:
                raise ShardplanError(f"node {n!r} (stage {stage[n]}) reads {a!r} from the later stage {stage[a]}: "
                                     "the stage cut is not between contiguous parts of the program")
    return stage


def issue_order(plan: Any, schedule: str | None = None) -> list[tuple[str, int, int]]:
    """``(kind, stage index, micro-batch)`` for every pass, kind "F" or "B", in an order a single
    controller can issue (see the module docstring). ``schedule`` overrides the plan's
    (e.g. "gpipe" for a 1F1B plan; interleaved plans keep theirs)."""
    schedule = schedule or plan.schedule
    if schedule not in SCHEDULES:
        raise ShardplanError(f"unknown pipeline schedule {schedule!r}; choose from {', '.join(SCHEDULES)}")
    v = plan.chunks
    if (v > 1) != (schedule == "interleaved"):
        raise ShardplanError(f"a plan with {v} chunk(s) per device group cannot run the {schedule!r} schedule")
    m = plan.micro_batches
    groups = plan.num_stages // v
    events = simulate(plan.stage_times(), plan.group_links(), m, schedule, v)
    queues: list[list[tuple[str, int, int]]] = [[] for _ in range(groups)]
    for e in events:
        if e.kind in ("forward", "backward"):
            queues[e.stage].append(("F" if e.kind == "forward" else "B", e.chunk * groups + e.stage, e.micro_batch))
    n = plan.num_stages
    done: set[tuple[str, int, int]] = set()

    def ready(kind: str, j: int, mb: int) -> bool:
        if kind == "F":
            return j == 0 or ("F", j - 1, mb) in done
        return ("F", j, mb) in done and (j == n - 1 or ("B", j + 1, mb) in done)

    out: list[tuple[str, int, int]] = []
    pos = [0] * groups
    while len(out) < 2 * m * n:
        moved = False
        for d in range(groups):
            while pos[d] < len(queues[d]) and ready(*queues[d][pos[d]]):
                out.append(queues[d][pos[d]])
                done.add(queues[d][pos[d]])
                pos[d] += 1
                moved = True
        if not moved:
            raise ShardplanError(f"schedule {schedule!r} cannot be issued (S={groups}, m={m}, v={v})")
    return out


def stage_plan(result: Any, index: int) -> Any:
    """The intra-stage :class:`~shardplan.spmd.SpmdPlan` of stage ``index`` at the plan's m.

    The search's stage cost carries it, except where a long run of identical
    blocks was costed by linear extension (``periodic``): its plan is then the
    shorter segment's, and the stage is solved directly here (same solver,
    same options, same m).
    """
    plan = result.plan
    st = plan.stages[index]
    m = plan.micro_batches
    want = {op.name for op in result.stages.subgraph(st.first, st.end, m).operators}
    detail = st.cost.detail
    if detail is not None and {op.name for op in detail.graph.operators} == want \
            and detail.machine.num_devices == st.devices:
        return detail
    return result.stages.solve_stage(st.first, st.end, st.devices, m).detail
