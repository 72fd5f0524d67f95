"""The pipeline search on a model: :func:`pipeline_solve`."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from shardplan.errors import ShardplanError
from shardplan.ir import Graph
from shardplan.machine import Machine
from shardplan.pipeline.floors import UnitFloors
from shardplan.pipeline.progress import Progress
from shardplan.pipeline.schedule import StageTimes, simulate, step_time
from shardplan.pipeline.search import (SEED_EVALUATIONS, PipelinePlan, PipelineSpace, _uniform_seeds,
                                       search_pipeline)
from shardplan.pipeline.stages import ModelStages
from shardplan.search.constrained import WORK_LIMIT

__all__ = ["PipelineResult", "pipeline_solve", "pipeline_seeds", "seed_model"]


@dataclass(frozen=True, eq=False)
class PipelineResult:
    """A pipeline plan on a model, with what is needed to show it."""

    plan: PipelinePlan
    stages: ModelStages
    machine: Machine
    seconds: float
    floors: UnitFloors | None = None  # the solve-free stage bounds the search used (a seeds' answer hands them on)

    @property
    def step_time(self) -> float:
        return self.plan.step_time

    def unit_names(self) -> list[str]:
        return self.stages.unit_names()

    def simulated_step_time(self) -> float:
        """Length of the event-level schedule (equals :attr:`step_time` for uniform stages), each interleaved
        chunk running its own seconds."""
        chunks = None
        if self.plan.chunks > 1:
            chunks = [StageTimes(s.cost.forward, s.cost.backward) for s in self.plan.stages]
        ev = simulate(self.plan.stage_times(), self.plan.group_links(), self.plan.micro_batches, self.plan.schedule,
                      self.plan.chunks, back=self.plan.group_links(back=True), chunk_times=chunks)
        return max(e.end for e in ev)

    def gpipe_step_time(self) -> float | None:
        """The same stages and m under GPipe (for comparison; None for interleaved plans)."""
        if self.plan.chunks > 1:
            return None
        return step_time(self.plan.stage_times(), self.plan.group_links(), self.plan.micro_batches, "gpipe",
                         back=self.plan.group_links(back=True))

    def flops_per_device(self, graph_flops: float) -> float:
        """Achieved FLOP/s per device for a step of ``graph_flops`` (forward + backward) total FLOPs."""
        return graph_flops / self.plan.step_time / self.machine.num_devices


def _checked(batch: Any, micro_batches: Any, max_stages: Any, budget: Any, sizes: Any, interleave: Any,
             fit_rtol: Any, fit_time_limit: Any, fit_work_limit: Any
             ) -> tuple[int, tuple[int, ...], int | None, float | None, Any]:
    """The arguments of :func:`pipeline_solve` that are numbers, checked (one-line :class:`ShardplanError`)."""
    from shardplan.checks import MAX_EXTENT, integer, real

    batch = integer("pipeline_solve: batch", batch, 1, MAX_EXTENT)
    ms = tuple(integer("pipeline_solve: micro-batch count", m, 1) for m in micro_batches)
    if max_stages is not None:
        max_stages = integer("pipeline_solve: max_stages", max_stages, 1)
    if budget is not None and budget != float("inf"):
        budget = real("pipeline_solve: budget", budget, positive=True, unit="B")
    if sizes is not None:
        sizes = tuple(integer("pipeline_solve: sub-mesh size", q, 1) for q in sizes)
        if not sizes:
            raise ShardplanError("pipeline_solve: sizes must name at least one sub-mesh size")
    for v in interleave:
        integer("pipeline_solve: interleave chunk count", v, 1)
    real("pipeline_solve: fit_rtol", fit_rtol, 0.0, 1.0)
    if not fit_rtol < 1.0:
        raise ShardplanError(f"pipeline_solve: fit_rtol must be in [0, 1), got {fit_rtol!r}")
    if fit_time_limit is not None:
        real("pipeline_solve: fit_time_limit", fit_time_limit, positive=True, unit="s")
    real("pipeline_solve: fit_work_limit", fit_work_limit, minimum=0.0)
    return batch, ms, max_stages, budget, sizes


def _with_refused(bound: float | None, stages: ModelStages) -> float | None:
    """``bound`` (a proven bound of the space the search covered) made a bound of the whole space: the least of it
    and :meth:`ModelStages.refused_floor` when some stage was refused."""
    floor = stages.refused_floor()
    if floor is None or bound is None:
        return bound
    return min(bound, floor)


def _model_and_space(build: Callable[[int], Graph], batch: int, machine: Machine, micro_batches: Sequence[int],
                     max_stages: int | None, uniform: bool, interleave: Sequence[int], budget: float | None,
                     periodic: bool, sizes: Sequence[int] | None, memory_choices: bool, fit_rtol: float,
                     fit_time_limit: float | None, fit_work_limit: float, solve_options: dict[str, Any],
                     model: ModelStages | None
                     ) -> tuple[ModelStages, PipelineSpace, list[int]]:
    """The checked arguments' stage costs (``model`` when given: a :func:`pipeline_seeds` answer's, its caches
    kept) and space, and the micro-batch counts that divide the batch."""
    batch, micro_batches, max_stages, budget, sizes = _checked(batch, micro_batches, max_stages, budget, sizes,
                                                               interleave, fit_rtol, fit_time_limit,
                                                               fit_work_limit)
    ms = [m for m in micro_batches if batch % m == 0]
    if not ms:
        raise ShardplanError(f"no micro-batch count in {list(micro_batches)} divides the batch of {batch}")
    if model is None:
        model = ModelStages(build, batch, machine, dict(solve_options), periodic=periodic, fit_rtol=fit_rtol,
                            fit_time_limit=fit_time_limit, fit_work_limit=fit_work_limit,
                            memory_choices=memory_choices)
    elif (model.batch, model.machine, model.memory_choices, model.solve_options, model.periodic, model.fit_rtol,
          model.fit_time_limit, model.fit_work_limit) != (batch, machine, memory_choices, dict(solve_options),
                                                          periodic, fit_rtol, fit_time_limit, fit_work_limit):
        raise ShardplanError("pipeline_solve: the model= given was built for another batch, machine or options")
    space = PipelineSpace(model.num_units, machine.num_devices, machine.node_size, tuple(ms),
                          machine.memory_bytes if budget is None else budget, max_stages, uniform, tuple(interleave),
                          sizes)
    return model, space, ms


def schedules_for(machine: Machine, schedules: Sequence[str]) -> tuple[str, ...]:
    """The schedules of ``schedules`` the cost model can cost on ``machine``: without ZB-H1 where the machine
    hides each product's input-gradient collective behind its weight-gradient pass
    (:attr:`~shardplan.machine.Machine.overlap_dgrad`): ZB-H1 runs that pass later, so the stage tables' backward
    would be optimistic by up to that collective per product and micro-batch (docs/cost-model.md, "Input
    gradients beside the weight gradient"). Refuses a list left empty."""
    kept = tuple(s for s in schedules if not (machine.overlap_dgrad and s == "zb-h1"))
    if not kept:
        raise ShardplanError("pipeline: zb-h1 defers the weight-gradient pass, which overlap_dgrad hides the input "
                             "gradient's collective behind; give another schedule or a machine without overlap_dgrad")
    return kept


def pipeline_seeds(build: Callable[[int], Graph], batch: int, machine: Machine, *,
                   micro_batches: Sequence[int] = (1, 2, 4, 8), max_stages: int | None = None,
                   schedules: Sequence[str] = ("1f1b", "interleaved"), budget: float | None = None,
                   periodic: bool = True, sizes: Sequence[int] | None = None, memory_choices: bool = False,
                   fit_rtol: float = 1e-9, fit_time_limit: float | None = None, fit_work_limit: float = WORK_LIMIT,
                   seeds: int = SEED_EVALUATIONS,
                   progress: Progress | None = None, model: ModelStages | None = None,
                   **solve_options: Any) -> PipelineResult | None:
    """The best of the uniform pipelines :func:`pipeline_solve`'s search costs first (its seeds: up to ``seeds`` of
    them, equal sub-meshes with the units dealt evenly, 1F1B or ZB-H1, :func:`~shardplan.pipeline.search.search_pipeline`),
    alone: a real plan of the pipeline space, found without a search, or None when none fits. Its step is an upper
    bound of the pipeline optimum (its ``lower_bound`` is None: nothing is proven). The answer's ``stages`` keep
    every stage they costed: given to :func:`pipeline_solve` as ``model=``, its search costs the same seeds again
    from that cache. The planner calls this before the one-program search, to prune it with the step found
    (:func:`shardplan.fit.solve_fit`'s ``incumbent``). Arguments as :func:`pipeline_solve`'s; ``progress`` hears
    each seed (a tick) and each better seed's step (shown as the line's best, :meth:`Progress.hear`; not the plans,
    which the search finds again). Ctrl-C (a :class:`KeyboardInterrupt`) returns
    the best seed so far (``plan.stats["interrupted"]`` True), or propagates before any. ``model``: a
    :class:`~shardplan.pipeline.stages.ModelStages` built on the same arguments (:func:`seed_model`), whose
    graphs and caches the seeds take (the planner computes the step floors on it before the seeds, so that an
    interrupt in the seeds needs no graph built after it)."""
    t0 = time.perf_counter()
    stages, space, ms = _model_and_space(build, batch, machine, micro_batches, max_stages, False, (), budget,
                                         periodic, sizes, memory_choices, fit_rtol, fit_time_limit, fit_work_limit,
                                         solve_options, model)
    tracker = progress if progress is not None else Progress()
    if stages.work_budget is None:
        stages.work_budget = tracker.budget  # (the planning call's work budget, if any, charged by the stages)
    tracker.part("uniform pipelines, before the one program")
    stats: dict[str, Any] = {}
    seen: list[PipelinePlan] = []  # each plan better than the ones before (the last is the best)
    floors = UnitFloors(stages)

    def heard(plan: PipelinePlan) -> None:
        seen.append(plan)
        tracker.hear(plan.step_time)  # shown on the progress line; the search later finds it again

    try:
        got = _uniform_seeds(space, stages.stage_cost, stages.link_time, stages.exchange_time,
                             stages.fit_cost if memory_choices else None, floors.segment,
                             schedules_for(machine, schedules),
                             ms, seeds, stats, tracker.tick, heard, chunking_lower=floors.chunking_lower)
    except KeyboardInterrupt:
        if not seen:
            raise
        got, stats["interrupted"] = {seen[-1].micro_batches: seen[-1]}, True
    if not got:
        return None
    best = min(got.values(), key=lambda t: (t.step_time, -t.micro_batches))
    plan = replace(best, stats={**best.stats, **stats, "seed_steps": {str(m): t.step_time for m, t in got.items()}},
                   lower_bound=None)
    return PipelineResult(plan, stages, machine, time.perf_counter() - t0, floors)


def seed_model(build: Callable[[int], Graph], batch: int, machine: Machine, *, memory_choices: bool = False,
               periodic: bool = True, fit_rtol: float = 1e-9, fit_time_limit: float | None = None,
               fit_work_limit: float = WORK_LIMIT,
               **solve_options: Any) -> ModelStages:
    """The stage costs :func:`pipeline_seeds` and :func:`pipeline_solve` would build on these arguments (their
    ``model=``), built here so that a caller can compute solve-free bounds on its graphs first (nothing is
    solved). Keyword arguments other than these, as :func:`pipeline_solve`'s, are the intra-stage options."""
    return ModelStages(build, batch, machine, dict(solve_options), periodic=periodic, fit_rtol=fit_rtol,
                       fit_time_limit=fit_time_limit, fit_work_limit=fit_work_limit,
                       memory_choices=memory_choices)


def pipeline_solve(build: Callable[[int], Graph], batch: int, machine: Machine, *,
                   micro_batches: Sequence[int] = (1, 2, 4, 8), max_stages: int | None = None, uniform: bool = False,
                   interleave: Sequence[int] = (), schedules: Sequence[str] = ("1f1b", "interleaved"),
                   budget: float | None = None, periodic: bool = True, sizes: Sequence[int] | None = None,
                   memory_choices: bool = False, fallback: Callable[[Any], Any] | None = None,
                   fit_rtol: float = 1e-9, fit_time_limit: float | None = None, fit_work_limit: float = WORK_LIMIT,
                   progress: Progress | None = None,
                   one_program_lower: float | None = None, refused: Callable[[str], None] | None = None,
                   seeds: int = SEED_EVALUATIONS, model: ModelStages | None = None, floors: UnitFloors | None = None,
                   **solve_options: Any) -> PipelineResult | None:
    """The optimal pipeline (stages, sub-meshes, m, schedule) of the model ``build(batch)`` on ``machine``.

    ``budget`` defaults to the machine's memory per device; micro-batch counts that do not divide
    ``batch`` are skipped. ``memory_choices``: a stage whose time-optimal plan does not fit with its
    in-flight micro-batches may shard state (ZeRO/FSDP) and recompute (:meth:`ModelStages.fit_cost`), solved
    only for the stages the search's relaxation needs (:mod:`shardplan.pipeline.search`); each such solve is
    proven to a relative ``fit_rtol`` (1e-9: exact; a larger one makes the plan within that factor of the
    optimum) unless its work budget ``fit_work_limit`` (:attr:`shardplan.fit.FitOptions.work_limit`: counted, so
    the same on any machine) or, when given, ``fit_time_limit`` seconds stop it (``plan.stats["fit_unproven"]``
    counts those); the
    plan's ``lower_bound`` and ``gap`` state what the solves proved for the whole pipeline. Interleaved device
    groups and ZB-H1 stages take the same choices (:meth:`ModelStages.group_fit_cost`, :meth:`ModelStages.fit_cost`).
    ``fallback``: instead, such a stage takes the fixed rule ``fallback(tables) -> configs`` (e.g. Megatron's
    layouts, :func:`shardplan.baselines.megatron`, on tables with ``node_replicas``) when that fits: a
    heuristic, fast stand-in for the memory-constrained optimum, so the search covers the rule's pipelines
    but is exact only over "time-optimal stage, else the rule's". ``progress``
    (:class:`~shardplan.pipeline.progress.Progress`) hears where the search stands; Ctrl-C (a
    :class:`KeyboardInterrupt`) returns the best plan so far with its proven gap (:func:`search_pipeline`). A
    ``progress`` that already holds an incumbent (a plan found outside the pipeline space, told by
    :meth:`Progress.improved`) prunes the search with it; None is returned when no pipeline beats it, and
    ``progress.bound`` is then the proven lower bound of the pipeline space. ``one_program_lower``: the
    one-program search's proven bound at one micro-batch (:func:`search_pipeline`). ``seeds``: how many uniform
    pipelines are costed before the search as its first incumbents (0: none; :func:`search_pipeline`). ``model``:
    the stage costs of a :func:`pipeline_seeds` answer on the same arguments (``stages``), whose cached stages the
    search takes instead of costing them again, and ``floors`` its solve-free stage bounds (``floors``, on the same
    ``model``), which it takes instead of computing them again.

    A stage whose cost tables the cost model refuses on its sub-mesh (per-device tiles past its cap,
    :class:`~shardplan.errors.PerDeviceLimitError`; the ``max_devices`` option lowers the cap) is left out of
    the search rather than ending it: ``plan.stats["sizes_not_searched"]`` lists those sub-mesh sizes,
    ``stats["sizes_not_searched_why"]`` says why in one line (``refused(line)`` hears it too, also when no
    plan is returned), and the plan's ``lower_bound`` (or ``progress.bound``) stays a proven bound of the
    whole space: at most the step floor of the micro-batch counts at which a stage was refused
    (:meth:`ModelStages.refused_floor`, docs/pipeline.md, *Sub-mesh sizes the cost model refuses*).
    Other keyword arguments go to each intra-stage :func:`shardplan.solve`.
    """
    t0 = time.perf_counter()
    stages, space, ms = _model_and_space(build, batch, machine, micro_batches, max_stages, uniform, interleave,
                                         budget, periodic, sizes, memory_choices, fit_rtol, fit_time_limit, fit_work_limit,
                                         solve_options, model)
    if progress is not None and stages.work_budget is None:
        stages.work_budget = progress.budget  # (the planning call's work budget, if any, charged by the stages)
    if floors is None:
        floors = UnitFloors(stages)
    elif floors.stages is not stages:
        raise ShardplanError("pipeline_solve: the floors= given were computed on another model=")
    if progress is not None:
        # before anything is solved, the step's compute over every device bounds every part (an interrupt from
        # here on states it)
        progress.space_bound = min(stages.step_floor(m) for m in ms)
    fit_fn = stages.fit_cost if memory_choices else None
    group_fit_fn = stages.group_fit_cost if memory_choices else None
    if fallback is not None:
        if memory_choices:
            raise ShardplanError("pipeline_solve: give memory_choices or a fallback rule, not both")
        rule = ModelStages(build, batch, machine, {**solve_options, "node_replicas": True}, periodic=periodic,
                           strategy=fallback)

        def fit_fn(a: int, b: int, q: int, m: int, k: int, limit: float):
            c = rule.stage_cost(a, b, q, m)
            return c if c is not None and c.memory(k) <= limit else None

        def group_fit_fn(chunks: tuple[tuple[int, int], ...], q: int, m: int, k: float, limit: float):
            cs = [rule.stage_cost(a, b, q, m) for a, b in chunks]
            if any(c is None for c in cs):
                return None
            fits = sum(c.weight_bytes for c in cs) + k * sum(c.activation_bytes for c in cs) <= limit  # type: ignore
            return tuple(cs) if fits else None

    try:
        plan = search_pipeline(space, stages.stage_cost, stages.link_time, schedules_for(machine, schedules),
                               exchange=stages.exchange_time,
                               fit_fn=fit_fn, group_fit_fn=group_fit_fn, progress=progress,
                               one_program_lower=one_program_lower if memory_choices else None,
                               release=stages.release, step_floor=stages.step_floor,
                               stage_lower=floors.segment, seeds=seeds,
                               forward_floor=stages.forward_floor, unit_forward=floors.forward_units,
                               chunking_lower=floors.chunking_lower)
    except KeyboardInterrupt:
        if progress is not None:
            progress.space_bound = _with_refused(progress.space_bound, stages)
        if refused is not None and stages.refused:
            refused(stages.refused_line())  # type: ignore[arg-type]
        raise
    except ShardplanError as e:
        if type(e) is ShardplanError and stages.refused:
            raise ShardplanError(f"{e}; {stages.refused_line()}") from e
        raise
    if refused is not None and stages.refused:
        refused(stages.refused_line())  # type: ignore[arg-type]
    if plan is None:
        if progress is not None:
            progress.bound = _with_refused(progress.bound, stages)
        return None
    if stages.refused:
        # the stages the cost model refused are left out of the search: the pipelines that hold one are bounded
        # by the step floor (docs/pipeline.md, *Sub-mesh sizes the cost model refuses*)
        plan = replace(plan, lower_bound=_with_refused(plan.lower_bound, stages))
        plan.stats["sizes_not_searched"] = sorted(stages.refused)
        plan.stats["sizes_not_searched_why"] = stages.refused_line()
        plan.stats["refused_floor"] = stages.refused_floor()
    plan.stats["intra_stage_solves"] = stages.solves
    if memory_choices:
        plan.stats["fit_unproven"] = stages.fit_unproven
        plan.stats["fit_reused"] = stages.fit_reused
        plan.stats["fit_rtol"] = fit_rtol
    return PipelineResult(plan, stages, machine, time.perf_counter() - t0, floors)
