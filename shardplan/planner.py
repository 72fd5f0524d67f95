"""The one planning call: :func:`plan` answers "the fastest plan for this model on this cluster that fits".

It searches, for a zoo model, a hand-built graph or a builder of graphs:

* the per-operator layouts of one SPMD program over every device (the exact
  dynamic program, :func:`shardplan.spmd.solve`), with the memory choices
  (ZeRO stage per operator, recomputation per operator, micro-batches) under
  the per-device memory budget (:func:`shardplan.fit.solve_fit`) unless
  ``fit=False``;
* pipelines (stage cuts, sub-meshes, micro-batch count, schedule) whose every
  stage is such an optimum on its own sub-mesh
  (:func:`shardplan.pipeline.api.pipeline_solve`), when the model has repeated
  blocks and the machine more than one node (``stages="auto"``), always
  (``stages=True``, which needs a builder) or never (``stages=False``);

and returns the faster of the two as one :class:`~shardplan.result.Plan`.
Its lower bound is the smaller of the two searches' bounds, so its gap is
proven over the union of both spaces. The JAX and PyTorch entries
(:func:`shardplan.jax.plan`, :func:`shardplan.torch.plan`) trace the program
and call this with the same keywords.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Sequence

from shardplan.errors import PerDeviceLimitError, ShardplanError
from shardplan.ir import Graph
from shardplan.machine import Machine
from shardplan.pipeline.progress import PLAN_WORK_LIMIT, WorkBudget, WorkLimitReached
from shardplan.result import NO_PIPELINE, OperatorChoice, Plan, StagePlan

__all__ = ["plan", "micro_batch_counts", "from_spmd", "from_pipeline", "spmd_of", "pipeline_of", "group_memory"]

STAGES = ("auto", True, False)


TABLE_OPTIONS = ("cutoff", "powers_of_two", "divides_p", "orders", "node_replicas", "optimizer_factor",
                 "partial_sums", "overlap_tp", "context")
"""The cost-table options a plan records, so the tables can be rebuilt where it runs (:func:`spmd_of`)."""


def table_options(tables: Any) -> dict[str, Any]:
    """How ``tables`` were built (``orders`` resolved: "auto" recorded as what it chose)."""
    return {k: tables.options[k] for k in TABLE_OPTIONS if k in tables.options}


def choices_of(sp: Any) -> dict[str, OperatorChoice]:
    """Per operator of a tables-backed plan its :class:`OperatorChoice`: layout, memory choices (the program's
    own recomputation where the plan has none), the dimensions of the weights it owns (a reader of another
    operator's parameter holds no state of it), labels and extents, its own seconds and its redistribution's,
    and whether a causal attention is run dealt with its keys gathered (:func:`shardplan.cost.ring.deals_gathered`)."""
    from shardplan.cost.ring import deals_gathered

    g = sp.graph
    mc = sp.memory_choices
    rows = sp.operators()
    out = {}
    for i, (op, row) in enumerate(zip(g.operators, rows)):
        lay = sp.tables.layouts[i][sp.assignment[i]]
        own = [w for w in op.weights if w.needs_grad and w.owner is None]
        ext = op.extents
        out[op.name] = OperatorChoice(
            op.kind, lay, mc.stage(i) if mc is not None else 0,
            mc.recompute(i) if mc is not None else op.name in g.recomputed,
            tuple(d for d, _ in op.dims if any(d in w.dims for w in own)), int(sum(w.size for w in own)),
            tuple(op.dim_label(d) for d in lay.dims), tuple(int(ext[d]) for d in lay.dims),
            float(row["cost_seconds"]), float(row["redistribution_in_seconds"]),
            mc.fp8(i) if mc is not None else False, mc.offload(i) if mc is not None else (),
            op.kind == "attn_flash" and deals_gathered(op, lay, sp.machine))
    return out


def from_spmd(sp: Any, *, model: str | None = None, batch: int | None = None,
              stats: dict[str, Any] | None = None) -> Plan:
    """The :class:`Plan` of one tables-backed per-operator plan (:class:`shardplan.spmd.SpmdPlan`, with or
    without memory choices): one stage over every device.

    Per micro-batch, the stage's forward seconds are the plan's forward parts over ``m`` and its backward the
    rest (:func:`shardplan.pipeline.stages.forward_backward`). The lower bound is the solver's proven bound,
    the cost itself when the solver proved it optimal, and None for a hand-made plan (a baseline).
    """
    from shardplan.pipeline.stages import _forward_backward as forward_backward

    g = sp.graph
    mc = sp.memory_choices
    m = mc.micro_batches if mc is not None else 1
    ops = choices_of(sp)
    mem = {k: float(v) for k, v in sp.memory.items()}
    if mc is None and sp.machine.memory_bytes:
        mem["budget_bytes"] = float(sp.machine.memory_bytes)
    fwd, _, wgrad = forward_backward(sp)
    stage = StagePlan(0, 0, 0, 0, sp.machine.num_devices, ops, fwd / m, (sp.cost - fwd) / m, wgrad / m, 1.0,
                      {k: mem[k] for k in ("peak_bytes", "weights_bytes", "activations_bytes")})
    sol = sp.solution
    lower = None
    if sol is not None:
        lower = float(sol.bound) if sol.bound is not None else (sp.cost if sol.optimal else None)
    st: dict[str, Any] = {"solve_seconds": sp.solve_seconds, "build_seconds": sp.build_seconds,
                          "memory_choices": mc is not None, "table_options": table_options(sp.tables)}
    if mc is not None:
        st["memory_rules"] = memory_rules(mc)
    if sp.tables.options.get("overlap_tp"):
        from shardplan.cost import overlap_hidden

        st["overlap_tp"] = overlap_hidden(sp.tables, sp.assignment)
    if sol is not None:
        st.update(sol.stats)
    st.update(stats or {})
    return Plan(model or g.name, sp.machine, (stage,), m, NO_PIPELINE, sp.cost, sp.breakdown, mem, lower,
                sp.name, st, 1, batch, detail=sp)


def memory_rules(mc: Any) -> dict[str, Any]:
    """What, beside each operator's choices, a plan's memory choices (:class:`shardplan.fit.MemoryChoices`) were
    costed with, so :func:`spmd_of` rebuilds the same step time and memory: the precision rules, the
    backward-peak model, the reserved bytes, the host budget per device (None: none, as JSON writes infinity),
    the FP8 and offload parts offered (the breakdown and memory list them, zero where no operator took
    them), and the FP8 rules of the runtime (which inputs an FP8 product saves, weights stored in FP8, the
    scaling)."""
    r = mc.rules
    return {"master_weights": r.master_weights, "zero3_regather": r.zero3_regather,
            "zero3_grad_allreduce": r.zero3_grad_allreduce, "backward_peak": bool(mc.backward),
            "reserve_bytes": float(mc.reserve_bytes),
            "host_budget_bytes": float(mc.host_budget_bytes) if math.isfinite(mc.host_budget_bytes) else None,
            "fp8_offered": r.fp8, "offload_offered": list(r.offload), "fp8_saved_inputs": r.fp8_saved_inputs,
            "fp8_params": r.fp8_params, "fp8_scaling": r.fp8_scaling}


def from_pipeline(result: Any, *, model: str | None = None, stats: dict[str, Any] | None = None) -> Plan:
    """The :class:`Plan` of a pipeline search's answer (:class:`shardplan.pipeline.api.PipelineResult`).

    Every stage carries its intra-stage per-operator plan at the plan's micro-batch size
    (:func:`shardplan.pipeline.execute.stage_plan`: the search's own, or solved now where a long run of
    identical blocks was costed by linear extension). The breakdown: ``stage_work``, m times the slowest
    device group's forward + backward per micro-batch, and ``pipeline_fill``, the rest of the step
    (fill and drain, transfers between stages).
    """
    from shardplan.pipeline.execute import stage_plan

    pp = result.plan
    groups = pp.num_stages // pp.chunks
    stages, plans = [], []
    for j, s in enumerate(pp.stages):
        shared = _shared_stage_choices(result, j)
        if shared is None:
            plans.append(stage_plan(result, j))
            ops = choices_of(plans[-1])
        else:
            plans.append(shared[0])
            ops = shared[1]
        mem = {"peak_bytes": s.memory, "weights_bytes": s.cost.weight_bytes,
               "activations_bytes": s.in_flight * s.cost.activation_bytes}
        stages.append(StagePlan(j, s.first, s.end, s.offset, s.devices, ops, s.cost.forward, s.cost.backward,
                                s.cost.weight_grad, s.in_flight, mem))
    work = pp.micro_batches * max(t.total for t in pp.stage_times())
    breakdown = {"stage_work": work, "pipeline_fill": pp.step_time - work, "total": pp.step_time}
    if pp.chunks > 1:
        memory: dict[str, float] = dict(group_memory(pp))
    else:
        peak = max(stages, key=lambda st: st.memory["peak_bytes"])
        memory = {**peak.memory, "peak_stage": peak.index}
    memory["budget_bytes"] = float(pp.budget) if pp.budget is not None else float("inf")
    st = {"solve_seconds": result.seconds, "groups": groups, **pp.stats, "links": list(pp.links),
          "back_links": None if pp.back_links is None else list(pp.back_links),
          "memory_choices": any(getattr(s.cost.detail, "memory_choices", None) is not None for s in pp.stages),
          **_stage_rules(plans),
          "table_options": {k: v for k, v in result.stages.solve_options.items() if k in TABLE_OPTIONS},
          **(stats or {})}
    return Plan(model or result.stages.graph(1)[0].name, result.machine, tuple(stages), pp.micro_batches,
                pp.schedule, pp.step_time, breakdown, memory, pp.lower_bound, "pipeline", st, pp.chunks,
                result.stages.batch, detail=result)


def _shared_stage_choices(result: Any, index: int) -> tuple[Any, dict[str, OperatorChoice]] | None:
    """Stage ``index``'s per-operator choices from the plan its cost carries when that plan is a shared solve of an
    identical segment elsewhere (the same units' signatures and neighbours, sub-mesh size and m:
    :meth:`~shardplan.pipeline.stages.ModelStages.stage_cost` shares one solve among them), renamed by position:
    (that plan, the choices), with no solve. None when the plan covers other operators (a cut of a run costed by
    extension) or another sub-mesh size: :func:`~shardplan.pipeline.execute.stage_plan` solves the stage then.
    Identical descriptions position by position (:func:`~shardplan.cost.operator_key`) are the same problem,
    which the deterministic solver answers with the same plan, so the choices are those a solve of this stage
    would give."""
    from shardplan.cost import operator_key

    st = result.plan.stages[index]
    detail = st.cost.detail
    if detail is None or getattr(detail, "graph", None) is None or detail.machine.num_devices != st.devices:
        return None
    mine = result.stages.subgraph(st.first, st.end, result.plan.micro_batches).operators
    theirs = detail.graph.operators
    def same(a: Any, b: Any) -> bool:
        return (operator_key(a) == operator_key(b) and a.name not in detail.graph.recomputed
                and b.name not in detail.graph.recomputed
                and [w.owner is None for w in a.weights] == [w.owner is None for w in b.weights])

    if len(mine) != len(theirs) or not all(same(a, b) for a, b in zip(mine, theirs)):
        return None
    got = choices_of(detail)
    return detail, {a.name: got[b.name] for a, b in zip(mine, theirs)}


def _stage_rules(plans: Sequence[Any]) -> dict[str, Any]:
    """Of a pipeline's stage plans: those that carry memory choices (``memory_choice_stages``; the others are
    time-optimal stage plans, costed without them) and the rules of the first (``memory_rules``: every stage is
    costed under the same rules); nothing when none does."""
    which = [j for j, sp in enumerate(plans) if getattr(sp, "memory_choices", None) is not None]
    if not which:
        return {}
    return {"memory_choice_stages": which, "memory_rules": memory_rules(plans[which[0]].memory_choices)}


def group_memory(pp: Any) -> dict[str, float]:
    """Per-device memory of an interleaved pipeline (a :class:`~shardplan.pipeline.search.PipelinePlan`), by device
    group: group d holds its v chunks at once, ``sum_j weights_j + k_d sum_j activations_j`` with k_d its
    in-flight share (each chunk's ``in_flight``; the interleaved schedule's memory model, as the search's budget
    check); the largest group's bytes and parts (``peak_group``: its index)."""
    groups = pp.num_stages // pp.chunks
    best: dict[str, float] = {}
    for d in range(groups):
        mine = pp.stages[d::groups]
        weights = sum(s.cost.weight_bytes for s in mine)
        acts = mine[0].in_flight * sum(s.cost.activation_bytes for s in mine)
        if not best or weights + acts > best["peak_bytes"]:
            best = {"peak_bytes": weights + acts, "weights_bytes": weights, "activations_bytes": acts,
                    "peak_group": d}
    return best


def _resolve(model: Any, batch: int | None, sizes: dict[str, Any] | None
             ) -> tuple[Graph, Callable[[int], Graph] | None, int | None, int, str]:
    """(graph at the global batch, builder of the graph at any batch or None, batch, cutoff, name)."""
    sizes = dict(sizes or {})
    if isinstance(model, str):
        from shardplan.models import model_spec

        spec = model_spec(model)
        b = spec.batch if batch is None else batch

        def build(x: int) -> Graph:
            return spec.build(x, **sizes)

        return build(b), build, b, spec.cutoff, spec.name
    if sizes:
        raise ShardplanError("plan: sizes= applies to a zoo model given by name")
    if isinstance(model, Graph):
        return model, None, batch, 1, model.name
    if callable(model):
        if batch is None:
            raise ShardplanError("plan: a model given as a builder build(batch) -> Graph needs batch=")
        g = model(batch)
        if not isinstance(g, Graph):
            raise ShardplanError(f"plan: the builder returned {type(g).__name__}, not a shardplan Graph")
        return g, model, batch, 1, g.name
    raise ShardplanError(f"plan: model must be a zoo name, a shardplan Graph or a builder build(batch) -> Graph, "
                         f"got {type(model).__name__}")


def _wants_stages(stages: Any, graph: Graph, build: Any, machine: Machine,
                  fit_options: Any = None) -> tuple[bool, str]:
    """Whether to search pipelines, and why (for the plan's statistics).

    The pipeline search's stages offer ZeRO stages and recomputation only: with FP8, host offload or
    mixed-precision master weights asked for, its stand-in stage costs would be neither lower bounds (FP8 is
    faster) nor counted in the same memory, so such a plan is one program (``stages=True`` is refused)."""
    from shardplan.pipeline.stages import units_of

    if stages is False:
        return False, "stages=False"
    extra = [w for w, on in (("FP8", getattr(fit_options, "fp8", False)),
                             ("host offload", bool(getattr(fit_options, "offload", ()))),
                             ("master weights", getattr(fit_options, "master_weights", False))) if on]
    if extra:
        if stages is True:
            raise ShardplanError(f"plan: the pipeline search does not offer {', '.join(extra)}: plan one program "
                                 "(stages=False) with them, or stages without them")
        return False, f"{', '.join(extra)} asked for (the pipeline search does not offer them)"
    if build is None:
        if stages is True:
            raise ShardplanError("plan: searching stages needs the model at every micro-batch size: give a zoo "
                                 "name or a builder build(batch) -> Graph, not one graph")
        return False, "one graph given (no builder at other micro-batch sizes)"
    if stages is True:
        return True, "stages=True"
    if len(units_of(graph)) < 2:
        return False, "the model has no repeated blocks"
    if not machine.hierarchical or machine.num_devices <= int(machine.node_size or machine.num_devices):
        return False, "one node"
    return True, "repeated blocks on more than one node"


def micro_batch_counts(given: Sequence[int] | None, batch: int | None) -> tuple[int, ...]:
    """The micro-batch counts searched: each given one a positive integer dividing ``batch`` (a count that does
    not, or one above the batch, makes no micro-batch of whole samples); none given, every count that divides
    it (micro-batches of one sample and up, in increasing order: the whole space, docs/pipeline.md *At
    scale*), or 1, 2, 4, 8 when the batch is not known."""
    from shardplan.checks import integer

    if given is None:
        if batch is None:
            return (1, 2, 4, 8)
        low = [m for m in range(1, math.isqrt(batch) + 1) if batch % m == 0]
        return tuple(sorted(set(low) | {batch // m for m in low}))
    if isinstance(given, (str, bytes)) or not isinstance(given, Sequence) or not given:
        raise ShardplanError(f"plan: micro_batches must be a non-empty sequence of integers, got {given!r}")
    ms = tuple(integer("plan: micro-batch count", m, 1) for m in given)
    bad = [m for m in ms if batch is not None and batch % m]
    if bad:
        raise ShardplanError(f"plan: {bad[0]} micro-batches do not split the batch of {batch} evenly "
                             "(each count must be one that divides the batch)")
    return ms


def plan(model: Any, machine: Machine | None = None, *, batch: int | None = None,
         sizes: dict[str, Any] | None = None, budget: float | None = None, fit: bool = True,
         stages: Any = "auto", micro_batches: Sequence[int] | None = None,
         schedules: Sequence[str] = ("1f1b", "zb-h1"), interleave: Sequence[int] = (),
         max_stages: int | None = None, fit_options: Any = None, cutoff: int | None = None, orders: str = "auto",
         solver: str = "dp", partial_sums: bool = False, log: Callable[[str], None] | None = None,
         progress: Any = None, overlap_tp: bool = False, context: str = "allgather",
         work_limit: float | None = PLAN_WORK_LIMIT, recipe: Plan | None = None) -> Plan:
    """The fastest plan of ``model`` on ``machine`` that fits in each device's memory.

    Args:
        model: a zoo name (``"gpt"``, with ``sizes`` overriding its defaults), a :class:`~shardplan.ir.Graph`,
            or a builder ``build(batch) -> Graph`` (then ``batch`` is required; stages need a builder).
        machine: the cluster (:func:`shardplan.machine.preset`, or a machine file).
        batch: the global batch (default: the zoo model's).
        budget: bytes per device (default: the machine's memory; with neither, memory is not constrained).
        fit: search the memory choices under the budget (default); False: layouts only, memory reported.
        stages: ``"auto"`` (pipelines when the model has repeated blocks on more than one node), True, False.
        micro_batches: counts searched (default every count that divides the batch: :func:`micro_batch_counts`).
        schedules, interleave, max_stages: the pipeline space (:func:`shardplan.pipeline.api.pipeline_solve`).
        fit_options: :class:`shardplan.fit.FitOptions` (its micro-batch counts default to ``micro_batches``).
        log: called with one line as each search starts and ends (the command line writes them to stderr).
        progress: the pipeline search's progress: a :class:`~shardplan.pipeline.progress.Progress`, or a callable
            given a line (phase, parts done, incumbent, bound) every 2 s. Ctrl-C (a :class:`KeyboardInterrupt`)
            during the pipeline search returns the best plan found so far, its lower bound the least of the one
            program's, the finished parts' and each unfinished part's family bound (docs/pipeline.md) and
            ``stats["interrupted"]`` True.
        cutoff, orders, solver: the per-operator search (:func:`shardplan.spmd.solve`); ``cutoff`` defaults to
            the zoo model's recommended one, else 1.
        partial_sums: also offer every layout that defers a split reduction to its consumers (reduce-scatter
            into a split layout, all-reduce into a replicated one: Megatron-LM's sequence parallelism is such a
            plan), in every search; about twice the layouts of a transformer, so off by default.
        overlap_tp: also let each product hide the collective of one of its edges behind its compute, in chunks
            (Megatron-LM's ``--tp-comm-overlap``, torchtitan's asynchronous tensor parallelism); implies
            ``partial_sums`` (:func:`shardplan.cost.build_tables`).
        context: how attention's products receive the keys and values their layouts share: ``allgather`` (the
            default), ``ring`` or ``auto`` (the cheaper per edge: :mod:`shardplan.cost.ring`), in every search.
        work_limit: the work budget of the whole call in work units
            (:data:`~shardplan.pipeline.progress.PLAN_WORK_LIMIT` by default, about a CPU microsecond each on the
            reference machine; None or 0: none, the search runs to its end). Work is counted from sizes the input
            fixes (the searches' solves, the pipeline DPs' states, graphs, tables, floors), never read from a
            clock, so where it stops the search, and the plan, step and bound returned, are the same on any
            machine at any load. Spent, the search stops as on Ctrl-C: the best plan so far, its proven bound
            and gap, ``stats["stopped_at_work_limit"]`` True (docs/pipeline.md, *A work budget for the whole
            call*).
        recipe: a configuration the answer must not be worse than: the plan :func:`shardplan.recipe.cost_recipe`
            made of it on this model, batch and machine. Costed by the same model, it is the search's first
            incumbent when it fits the budget:
            both searches need only beat its step, and the answer is the best of the searched plans and the
            recipe's (the searched plan on a tie), so its step is at most the recipe's. The lower bound is the
            least of the searches' bounds and the recipe's step (a bound of the spaces searched and the recipe
            together, which need not be in them: docs/recipes.md, *The recipe as the search's incumbent*).

    Raises:
        ShardplanError: bad input, no plan in the space fits (the message names the least memory needed), or
            the work budget was spent before any plan was found.
    """
    from dataclasses import replace

    from shardplan.checks import MAX_EXTENT, integer, real

    if machine is None:
        raise ShardplanError("plan: give a machine, e.g. preset('h100', 64) (shardplan.jax.plan and "
                             "shardplan.torch.plan detect it from the devices they run on)")
    if not isinstance(machine, Machine):
        raise ShardplanError(f"plan: machine must be a shardplan Machine, got {type(machine).__name__}")
    if stages not in STAGES:
        raise ShardplanError(f"plan: stages must be 'auto', True or False, got {stages!r}")
    if not isinstance(fit, bool):
        raise ShardplanError(f"plan: fit must be True or False, got {fit!r}")
    if not isinstance(partial_sums, bool):
        raise ShardplanError(f"plan: partial_sums must be True or False, got {partial_sums!r}")
    if not isinstance(overlap_tp, bool):
        raise ShardplanError(f"plan: overlap_tp must be True or False, got {overlap_tp!r}")
    from shardplan.cost.ring import CONTEXT_ALGORITHMS

    if context not in CONTEXT_ALGORITHMS:
        raise ShardplanError(f"plan: context must be one of {', '.join(CONTEXT_ALGORITHMS)}, got {context!r}")
    tables_extra: dict[str, Any] = {"overlap_tp": True} if overlap_tp else {}
    if context != "allgather":
        tables_extra["context"] = context
    if batch is not None:
        batch = integer("plan: batch", batch, 1, MAX_EXTENT)
    if work_limit is not None:
        work_limit = real("plan: work_limit", work_limit, minimum=0.0)
    work = WorkBudget(work_limit)
    work_phases: dict[str, float] = {}  # the work units charged when each phase ended (seeds, one program)
    graph, build, batch, default_cutoff, name = _resolve(model, batch, sizes)
    cutoff = default_cutoff if cutoff is None else integer("plan: cutoff", cutoff, 1, MAX_EXTENT)
    if budget is not None:
        budget = real("plan: budget", budget, positive=True, unit="B")
    if max_stages is not None:
        max_stages = integer("plan: max_stages", max_stages, 1)
    ms = micro_batch_counts(micro_batches, batch)
    limit = budget if budget is not None else machine.memory_bytes
    constrained = fit and limit is not None
    against, against_why = _recipe_incumbent(recipe, machine, batch, limit if constrained else None)
    outside = against.step_time if against is not None else None  # the recipe's step: the first incumbent
    searched, why = _wants_stages(stages, graph, build, machine, fit_options if constrained else None)

    t0 = time.perf_counter()
    say = log if log is not None else (lambda line: None)

    def stop_word() -> str:
        """How the search was stopped, for the log lines."""
        return "stopped at the work limit" if work.stopped else "interrupted"

    def spent(e: BaseException) -> ShardplanError | None:
        """The error that a work budget spent before any plan was known becomes (None: a Ctrl-C)."""
        if not isinstance(e, WorkLimitReached):
            return None
        return ShardplanError(f"plan: the work limit of {work.limit:.3g} units was spent before any plan was "
                              "found; give a larger work_limit (--work-limit), or None for no limit")

    candidates: list[Plan] = []
    refusals: list[str] = []
    one_lower: float | None = None  # the one program's proven bound with one micro-batch, for the pipeline search
    # the pipeline search's options (its stage costs, solved once: the seeds' are kept for the search)
    pipe_options: dict[str, Any] = dict(max_stages=max_stages, schedules=tuple(schedules),
                                        budget=limit if constrained else float("inf"), memory_choices=constrained,
                                        cutoff=cutoff, orders=orders,
                                        **({"partial_sums": True} if partial_sums else {}), **tables_extra)
    if fit_options is not None:  # the stage solves search under the same limits as the one program
        pipe_options.update(fit_work_limit=fit_options.work_limit, fit_time_limit=fit_options.time_limit)
    seed = None  # the best uniform pipeline, costed before the one program: its step prunes the one program
    seed_stopped = False  # Ctrl-C while the seeds were costed (the best so far is kept; nothing else is searched)
    # what an interrupted part with no plan stated of its space (the pipeline search's bound; with a recipe and a
    # budget spent in the seeds, the one program's work floor)
    unproven: list[float] = []
    one_none_better: float | None = None  # the one program proved no plan of its own beats the seed: its bound
    # solve-free bounds of both spaces, for whatever part of the search an interrupt leaves unfinished (the one
    # program's over all its micro-batch counts; the pipelines' step floor on the stage model the seeds and the
    # pipeline search then share), computed before anything is searched: an interrupt (Ctrl-C, a time limit)
    # then needs no graph built and nothing solved for its bound (docs/pipeline.md, *A bound whenever the
    # search stops*)
    one_floor = _one_program_floor(graph, machine, fit_options) if constrained else 0.0
    pipe_floors: list[float] = []
    stage_model = None  # the seeds' and the pipeline search's stage costs, built before the seeds

    def pipe_floor() -> float:
        """The step floor of every pipeline at every micro-batch count searched (docs/pipeline.md, *A bound
        whenever the search stops*)."""
        if not pipe_floors:
            assert build is not None and batch is not None
            pipe_floors.append(_pipeline_floor(stage_model, build, batch, machine, ms))
        return pipe_floors[0]

    if searched and constrained:
        from shardplan.pipeline.api import pipeline_seeds, seed_model
        from shardplan.pipeline.progress import Progress

        assert build is not None and batch is not None
        stage_model = seed_model(build, batch, machine, memory_choices=True, cutoff=cutoff, orders=orders,
                                 **({"partial_sums": True} if partial_sums else {}), **tables_extra)
        stage_model.work_budget = work
        progress = progress if isinstance(progress, Progress) else Progress(progress)
        progress.budget = work
        say(f"planning {name} on {machine.num_devices} devices: uniform pipelines first ({why})")
        try:
            pipe_floor()
            seed = pipeline_seeds(build, batch, machine, micro_batches=ms, progress=progress,  # type: ignore[arg-type]
                                  model=stage_model, **pipe_options)
        except ShardplanError as e:
            if type(e) not in (ShardplanError, PerDeviceLimitError):
                raise
            say(f"  uniform pipelines: none costed: {e}")
        except WorkLimitReached as e:
            if against is None:
                raise spent(e) from None  # (before any seed: no plan)
            # the recipe is the answer: the one program not searched (its work floor), the pipelines below
            seed_stopped = True
            unproven.append(one_floor)
        if seed is not None:
            seed_stopped = bool(seed.plan.stats.get("interrupted"))
            say(f"  uniform pipelines: {seed.step_time:.6g} s per step ({seed.plan.num_stages} stages, "
                f"m={seed.plan.micro_batches}, {seed.plan.schedule}; {time.perf_counter() - t0:.1f} s, "
                f"{work.used:.3g} work units)" + (f", {stop_word()}" if seed_stopped else ""))
        work_phases["seeds"] = work.used
    one_skipped = seed_stopped
    if not seed_stopped:  # (interrupted already: the seed found so far is the answer, nothing proven)
        say(f"planning {name} on {machine.num_devices} devices: one program"
            + (" with memory choices" if constrained else "")
            + (f", to beat {seed.step_time:.6g} s" if seed is not None else ""))
    if seed_stopped:
        pass
    elif constrained:
        from shardplan.fit import FitOptions, solve_fit

        opts = fit_options if fit_options is not None else FitOptions(micro_batches=ms)
        try:
            beat = min((x for x in (seed.step_time if seed is not None else None, outside) if x is not None),
                       default=None)
            one = solve_fit(graph, machine, budget=limit, options=opts, cutoff=cutoff, orders=orders,
                            partial_sums=partial_sums, incumbent=beat, work_budget=work, **tables_extra)
            if one.solution.stats.get("beats_incumbent", True):
                got = from_spmd(one, model=name, batch=batch)
                if got.lower_bound is not None and got.lower_bound < one_floor:
                    # an interrupted memory search states 0 for the counts it had not rooted: every one-program plan
                    # is at least the work floor too, so the larger of the two is proven (docs/pipeline.md)
                    gap = (got.step_time - one_floor) / got.step_time if got.step_time > 0 else 0.0
                    got = replace(got, lower_bound=one_floor,
                                  stats={**got.stats, "gap": max(gap, 0.0), "work_floor": one_floor})
                candidates.append(got)
            else:
                # every plan of the one program is at least its bound, itself at least (about) the seed's step:
                # the pipelines answer; the bound stays in the plan's (docs/memory.md, *An incumbent from outside*)
                one_none_better = max(float(one.solution.bound), one_floor)
                stopped = one.solution.stats.get("interrupted")
                say(f"  one program: no plan below {beat:.6g} s (bound {one_none_better:.6g} s; "
                    f"{time.perf_counter() - t0:.1f} s, {work.used:.3g} work units)"
                    + (f", {stop_word()}" if stopped else ""))
            if fit_options is None:
                one_lower = _one_micro_batch_bound(one)
            seed_stopped = bool(one.solution.stats.get("interrupted")) and one_none_better is not None
        except ShardplanError as e:
            if type(e) not in (ShardplanError, PerDeviceLimitError):
                raise
            refusals.append(f"one program: {e}")
        except KeyboardInterrupt as e:
            if seed is None and against is None:
                raise spent(e) or e
            # Ctrl-C in the one program's memory search before it had a plan: the seed is the answer, the one
            # program bounded by its work floor (the pipelines' floor is the seed's bound below)
            seed_stopped = True
            one_none_better = one_floor
            refusals.append("one program: interrupted before its memory search had a plan")
    else:
        from shardplan.spmd import solve

        candidates.append(from_spmd(solve(graph, machine, cutoff=cutoff, orders=orders, solver=solver,
                                          partial_sums=partial_sums, **tables_extra), model=name, batch=batch))
    interrupted = seed_stopped or bool(candidates and candidates[0].stats.get("interrupted"))
    if candidates:
        say(f"  one program: {candidates[0].step_time:.6g} s per step ({time.perf_counter() - t0:.1f} s, "
            f"{work.used:.3g} work units)" + (f", {stop_word()}" if interrupted else ""))
    if not one_skipped:
        work_phases["one_program"] = work.used
    if interrupted or not searched:
        work.close()  # nothing is searched from here: building the answer is charged, never stopped

    def seed_plan(lower: float | None) -> Plan:
        """The seed as the pipeline candidate, with the bound stated of the pipeline space (None: unknown)."""
        assert seed is not None
        return from_pipeline(replace(seed, plan=replace(seed.plan, lower_bound=lower)), model=name)

    if interrupted and searched and seed is not None:
        # Ctrl-C in the seeds, or in a one-program search that had not beaten the seed: the seed is the answer,
        # and the pipelines are bounded by their step floor alone
        searched = False
        if one_none_better is None and not any(p.solver != "pipeline" for p in candidates):
            unproven.append(one_floor)  # the one program not searched (Ctrl-C in the seeds): its work floor
        candidates.append(seed_plan(pipe_floor()))
        refusals.append("pipelines: interrupted before the pipeline search, the best uniform pipeline kept")
    elif interrupted and searched:
        # Ctrl-C inside the one program's memory search: the pipelines are not searched, bounded by their step floor
        searched = False
        unproven.append(pipe_floor())  # the pipelines not searched: their step floor
        refusals.append("pipelines: interrupted in the uniform pipelines before any plan, not searched" if one_skipped
                        else "pipelines: interrupted in the one program's memory search, not searched")
    # (step, lower bound) of a pipeline slower than one program; step None: none beat it (search pruned by it)
    lost_pipeline: tuple[float | None, float | None] | None = None
    not_searched: list[str] = []  # the sub-mesh sizes the pipeline search left out, and why (one line)
    if searched:
        from shardplan.pipeline.api import pipeline_solve
        from shardplan.pipeline.progress import Progress

        tracker = progress if isinstance(progress, Progress) else Progress(progress)
        tracker.budget = work
        tracker.space_bound = None
        if candidates or outside is not None:
            tracker.improved(min([p.step_time for p in candidates] + ([outside] if outside is not None else [])))

        def heard(line: str) -> None:
            not_searched.append(line)
            say(f"  pipelines: {line}")

        t1 = time.perf_counter()
        say(f"pipelines ({why}): micro-batch counts {', '.join(map(str, ms))}, schedules {', '.join(schedules)}")
        assert build is not None and batch is not None
        try:
            res = pipeline_solve(build, batch, machine, micro_batches=ms, interleave=tuple(interleave),
                                 progress=tracker, one_program_lower=one_lower, refused=heard,
                                 model=seed.stages if seed is not None else stage_model,
                                 floors=seed.floors if seed is not None else None, **pipe_options)
            work.close()  # the search is over: the answer's stage plans are charged, never stopped
            if res is None:
                # no pipeline beats the one program (the search's incumbent from the start): what its parts proved
                lost_pipeline = (None, tracker.bound)
                say(f"  pipelines: none faster than one program, proven bound {tracker.bound:.6g} s "
                    f"({time.perf_counter() - t1:.1f} s)")
            elif candidates and res.plan.step_time >= candidates[0].step_time / (1 + 1e-9):
                # the one program wins (ties included): its bound and step are all the pipeline adds, and its
                # stage plans (re-solved where a run of blocks was costed by extension) are not built
                lost_pipeline = (res.plan.step_time, res.plan.lower_bound)
            else:
                candidates.append(from_pipeline(res, model=name))
            if res is not None:
                interrupted = bool(res.plan.stats.get("interrupted"))
                say(f"  pipelines: {res.plan.step_time:.6g} s per step ({time.perf_counter() - t1:.1f} s)"
                    + (f", {stop_word()}" if interrupted else ""))
        except ShardplanError as e:
            if type(e) not in (ShardplanError, PerDeviceLimitError):
                raise
            refusals.append(f"pipelines: {e}")
            say(f"  pipelines: not searched: {e}")
            if seed is not None and not candidates:
                # the one program proved none of its plans beats the seed: the seed, nothing proven of the pipelines
                candidates.append(seed_plan(None))
        except KeyboardInterrupt as e:
            work.close()
            interrupted = True
            if seed is not None and not candidates:
                # before the search had found the seed again: the seed, and the bound the search stated
                candidates.append(seed_plan(tracker.space_bound if tracker.space_bound is not None else pipe_floor()))
                refusals.append("pipelines: interrupted before the search had a plan, the best uniform pipeline kept")
                say(f"  pipelines: {stop_word()} ({time.perf_counter() - t1:.1f} s), the best uniform pipeline kept")
            elif not candidates and against is None:
                raise spent(e) or e
            else:
                # no pipeline found before the interrupt: the one program, and what the search proved of the
                # pipelines (its finished parts' bounds and the unfinished parts' family bounds; the step floor
                # before it started)
                unproven.append(tracker.space_bound if tracker.space_bound is not None else pipe_floor())
                refusals.append("pipelines: interrupted before a pipeline was found")
                say(f"  pipelines: {stop_word()} before a pipeline was found ({time.perf_counter() - t1:.1f} s)")
    if against is not None:
        # last, so that a searched plan wins a tie; its step bounds the recipe's own part of the answer's space
        candidates.append(against)
        unproven.append(against.step_time)
    if not candidates:
        raise ShardplanError("no plan fits: " + "; ".join(refusals))
    least = min(p.step_time for p in candidates)
    # on a tie (relative 1e-9: rounding) the one program wins, the simpler plan to run
    best = next(p for p in candidates if p.step_time <= least * (1 + 1e-9))
    # an interrupted search that returned a plan states its space's bound in that plan's lower bound
    bounds = [p.lower_bound for p in candidates if p is not against] + unproven
    if lost_pipeline is not None:
        bounds.append(lost_pipeline[1])
    if one_none_better is not None:
        bounds.append(one_none_better)
    lower = None if any(b is None for b in bounds) else min(bounds)  # type: ignore[type-var]
    stats = dict(best.stats)
    stats.update(plan_seconds=time.perf_counter() - t0, stages_searched=searched, stages_reason=why,
                 interrupted=interrupted, **work.summary(), work_phases=work_phases,
                 compared={**{("recipe" if p is against else "pipeline" if p.solver == "pipeline"
                               else "one program"): p.step_time for p in candidates},
                           **({"pipeline": lost_pipeline[0]} if lost_pipeline is not None
                              and lost_pipeline[0] is not None else {})},
                 refused=refusals,
                 **({"seed_step": seed.step_time} if seed is not None else {}),
                 **({"recipe_step": outside, "recipe_answered": best is against} if against is not None else {}),
                 **({"recipe_not_incumbent": against_why} if against_why is not None else {}),
                 # the one program proved none of its plans beats the seed: its proven bound
                 **({"one_program_none_better": one_none_better} if one_none_better is not None else {}),
                 **({"pipeline_sizes_not_searched": not_searched[0]} if not_searched else {}),
                 # no pipeline beat the one program: the pipeline space's proven bound (the search had no step)
                 **({"pipeline_lower_bound": lost_pipeline[1]} if lost_pipeline is not None
                    and lost_pipeline[0] is None else {}))
    return replace(best, lower_bound=lower, stats=stats)



def _recipe_incumbent(recipe: Plan | None, machine: Machine, batch: int | None,
                      limit: float | None) -> tuple[Plan | None, str | None]:
    """``recipe`` (a plan :func:`shardplan.recipe.cost_recipe` made) as the search's incumbent, and None; or None
    and why it is not one: it does not fit ``limit`` (a plan of no memory-constrained space), or it was costed on
    a machine other than ``machine`` (its ``overlap`` or ``grad_accum`` key, or a plan made for another machine:
    not the same model). (None, None) when no recipe is given."""
    if recipe is None:
        return None, None
    if not isinstance(recipe, Plan):
        raise ShardplanError(f"plan: recipe must be the Plan shardplan.recipe.cost_recipe made of it, got "
                             f"{type(recipe).__name__}")
    if batch is not None and recipe.batch is not None and recipe.batch != batch:
        raise ShardplanError(f"plan: the recipe's plan is for a batch of {recipe.batch}, not {batch}")
    if recipe.machine != machine:
        return None, "the recipe is costed on another machine setting (its overlap or grad_accum key), not the search's"
    if limit is not None and float(recipe.memory["peak_bytes"]) > limit:
        return None, (f"the recipe needs {recipe.memory['peak_bytes'] / 2**30:.3g} GiB per device, over the budget "
                      f"of {limit / 2**30:.3g} GiB")
    return recipe, None


def _one_program_floor(graph: Graph, machine: Machine, fit_options: Any = None) -> float:
    """A proven lower bound of every one-program plan of ``graph`` on ``machine`` the memory search can cost, at
    every micro-batch count and memory choice: the step's work over every device,
    :func:`~shardplan.pipeline.stages.graph_device_seconds` / p (with FP8 offered, at the faster of the FP8 and
    the plain achievable rate, ``fp8_flops * fp8_efficiency`` and ``peak_flops * flops_efficiency``:
    :func:`_faster_of_fp8`). Each choice of an operator costs its whole-batch compute (micro-batches scale only
    the latencies) plus nonnegative terms (collectives, recomputation, ZeRO's gathers, the optimizer step, offload),
    and that compute is at least the operator's device-seconds over p (docs/pipeline.md, *A bound whenever the
    search stops*)."""
    from shardplan.pipeline.stages import graph_device_seconds

    fast = machine
    if getattr(fit_options, "fp8", False) and machine.fp8_flops is not None:
        fast = _faster_of_fp8(machine)
    return graph_device_seconds(graph, fast) / machine.num_devices


def _faster_of_fp8(machine: Machine) -> Machine:
    """``machine`` with a peak and an achievable rate each at least its own and its FP8 products'
    (:meth:`~shardplan.machine.Machine.fp8_machine`): the FP8 machine itself, or ``machine``, when one is at least
    as fast in both; else the larger peak P and efficiency R / P, R the larger achievable rate, raised to the
    next float until P times it rounds to at least R."""
    from dataclasses import replace

    fp8 = machine.fp8_machine()
    if fp8.peak_flops >= machine.peak_flops and fp8.achievable_flops >= machine.achievable_flops:
        return fp8
    if machine.achievable_flops >= fp8.achievable_flops and machine.peak_flops >= fp8.peak_flops:
        return machine
    top = max(machine.peak_flops, fp8.peak_flops)
    rate = max(machine.achievable_flops, fp8.achievable_flops)
    eff = min(1.0, rate / top)
    while top * eff < rate:  # at most a few steps (top * 1.0 = top >= rate ends it)
        eff = math.nextafter(eff, math.inf)
    return replace(machine, peak_flops=top, flops_efficiency=eff)


def _pipeline_floor(stages: Any, build: Callable[[int], Graph], batch: int, machine: Machine,
                    ms: Sequence[int]) -> float:
    """The least step floor over the micro-batch counts ``ms`` dividing ``batch``
    (:meth:`~shardplan.pipeline.stages.ModelStages.step_floor`: every pipeline at m takes at least
    m D(batch/m) / p), on ``stages`` (a :class:`~shardplan.pipeline.stages.ModelStages` whose graphs are then
    cached for the search) or, None, on the graphs built here."""
    from shardplan.pipeline.stages import ModelStages

    model = stages if stages is not None else ModelStages(build, batch, machine)
    return min((model.step_floor(m) for m in ms if batch % m == 0), default=0.0)  # (none divides: nothing searched)


def _one_micro_batch_bound(sp: Any) -> float | None:
    """The proven lower bound the memory-constrained one-program search (:func:`shardplan.fit.solve_fit`) states
    of its optimum with one micro-batch (its bound when solved, its root bound when pruned), or None. That
    problem is the pipeline search's whole model as one stage on every device at m = 1 (same graph, tables,
    budget and memory choices), so the pipeline search need not solve it again (docs/pipeline.md)."""
    for x in (sp.solution.stats or {}).get("per_micro_batches", ()):
        if int(x.get("micro_batches", 0)) == 1:
            got = x.get("bound", x.get("lower_bound"))
            return float(got) if isinstance(got, (int, float)) and math.isfinite(got) else None
    return None


def _rebuild(graph: Graph, machine: Machine, choices: dict[str, OperatorChoice], micro_batches: int,
             memory_choices: bool, options: dict[str, Any], budget: float | None, name: str,
             rules: dict[str, Any] | None = None, accumulate: int = 1) -> Any:
    """The tables-backed plan of ``graph`` on ``machine`` with the given per-operator choices: layouts, and with
    ``memory_choices`` each operator's ZeRO stage, recomputation, FP8 and offload under the recorded ``rules``
    (:func:`memory_rules`; a plan written before they were recorded: the defaults); ``accumulate``: the graph is
    one micro-batch of a step of that many (a pipeline stage, :func:`shardplan.fit.plan_with_choices`)."""
    from dataclasses import replace

    from shardplan.cost import build_tables
    from shardplan.spmd import plan_from_configs

    names = [op.name for op in graph.operators]
    missing = [n for n in names if n not in choices]
    extra = sorted(set(choices) - set(names))
    if missing or extra:
        what = (f"has no choice for operator {missing[0]!r}" if missing else f"names operator {extra[0]!r}, which "
                "the program does not have")
        raise ShardplanError(f"the plan does not match this program: it {what} (was it planned for another "
                             "model, batch or version of the code?)")
    tables = replace(build_tables(graph, replace(machine, memory_bytes=None), **options), machine=machine)
    sp = plan_from_configs(tables, {n: choices[n].layout for n in names}, name=name)
    if memory_choices:
        from shardplan.cost.memory import ChoiceRules
        from shardplan.fit import plan_with_choices

        r = dict(rules or {})
        host = r.get("host_budget_bytes")
        offer = ChoiceRules(bool(r.get("fp8_offered", False)), tuple(r.get("offload_offered") or ()),
                            fp8_saved_inputs=bool(r.get("fp8_saved_inputs", True)),
                            fp8_params=bool(r.get("fp8_params", False)),
                            fp8_scaling=str(r.get("fp8_scaling", "delayed")))
        sp = plan_with_choices(sp, stage={n: choices[n].state_stage for n in names},
                               recompute=[n for n in names if choices[n].recompute], micro_batches=micro_batches,
                               budget=budget, name=name, fp8=[n for n in names if choices[n].fp8],
                               offload={n: choices[n].offload for n in names if choices[n].offload},
                               master_weights=bool(r.get("master_weights", False)),
                               zero3_regather=bool(r.get("zero3_regather", False)),
                               zero3_grad_allreduce=bool(r.get("zero3_grad_allreduce", False)),
                               grad_buffers="backward" if r.get("backward_peak") else "persistent",
                               reserve_bytes=float(r.get("reserve_bytes") or 0.0),
                               host_budget_bytes=None if host is None or not math.isfinite(host) else float(host),
                               offer=offer, accumulate=accumulate)
    return sp


def spmd_of(plan_: Plan, graph: Graph) -> Any:
    """The tables-backed per-operator plan of a one-stage ``plan_`` on ``graph`` (the program traced where it
    runs): the plan's own when it was computed here on this graph, else rebuilt from its choices and checked
    to predict the same step time (so a plan made for another program is refused, not run)."""
    if plan_.num_stages != 1:
        raise ShardplanError(f"the plan has {plan_.num_stages} pipeline stages; run it as a pipeline")
    sp = plan_.spmd
    if sp is not None and [op.name for op in sp.graph.operators] == [op.name for op in graph.operators]:
        return sp
    budget = plan_.memory.get("budget_bytes")
    sp = _rebuild(graph, plan_.machine, dict(plan_.stages[0].operators), plan_.micro_batches,
                  bool(plan_.stats.get("memory_choices")), dict(plan_.stats.get("table_options") or {}),
                  None if budget is None else float(budget), plan_.solver, plan_.stats.get("memory_rules"))
    if abs(sp.cost - plan_.step_time) > 1e-6 * max(abs(plan_.step_time), 1e-30):
        raise ShardplanError(f"the plan predicts {plan_.step_time:.6g} s per step but its choices cost "
                             f"{sp.cost:.6g} s on this program: it was planned for another program or machine")
    return sp


def pipeline_of(plan_: Plan, build: Callable[[int], Graph]) -> Any:
    """The pipeline search's answer (:class:`~shardplan.pipeline.api.PipelineResult`) that ``plan_`` holds, or,
    for a plan loaded from JSON, rebuilt from its stages on the model ``build`` makes: each stage's operators
    laid out as the plan says on its sub-mesh, the stage times, links and schedule as planned."""
    from dataclasses import replace

    from shardplan.pipeline.api import PipelineResult
    from shardplan.pipeline.search import PipelinePlan, Stage, StageCost
    from shardplan.pipeline.stages import ModelStages

    if plan_.detail is not None and isinstance(plan_.detail, PipelineResult):
        return plan_.detail
    if plan_.schedule == NO_PIPELINE:
        raise ShardplanError("the plan is one program, not a pipeline; run it with its engine's one-program step")
    if plan_.batch is None:
        raise ShardplanError("the plan does not record its batch; it cannot be rebuilt as a pipeline")
    options = dict(plan_.stats.get("table_options") or {})
    model = ModelStages(build, plan_.batch, plan_.machine, options)
    m = plan_.micro_batches
    budget = plan_.memory.get("budget_bytes")
    stages = []
    with_choices = set(plan_.stats.get("memory_choice_stages") or ())
    for j, s in enumerate(plan_.stages):
        machine = replace(plan_.machine, num_devices=s.devices)
        # the stage's layouts and memory choices (each micro-batch one step of m); its times and bytes are the plan's
        sp = _rebuild(model.subgraph(s.first, s.end, m), machine, dict(s.operators), 1,
                      j in with_choices, options, None if budget is None else float(budget),
                      plan_.solver, plan_.stats.get("memory_rules"), accumulate=m)
        act = float(s.memory["activations_bytes"]) / s.in_flight if s.in_flight else 0.0
        cost = StageCost(s.forward, s.backward, float(s.memory["weights_bytes"]), act, sp, weight_grad=s.weight_grad)
        stages.append(Stage(s.first, s.end, s.offset, s.devices, cost, s.in_flight))
    links = tuple(plan_.stats.get("links") or (0.0,) * (len(stages) - 1))
    back = plan_.stats.get("back_links")
    pp = PipelinePlan(tuple(stages), m, plan_.schedule, plan_.chunks, links, plan_.step_time,
                      None if budget is None else float(budget), dict(plan_.stats),
                      None if back is None else tuple(back), plan_.lower_bound)
    return PipelineResult(pp, model, plan_.machine, 0.0)
