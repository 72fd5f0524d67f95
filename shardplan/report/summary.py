"""The one report of a :class:`~shardplan.result.Plan`: what a practitioner reads in ten seconds first.

1. the plan in recipe words (``data 64 × tensor 8 × pipeline 16 (1f1b), ZeRO-1, recompute 40 of 120
   operators, 4 micro-batches``), by :func:`recipe_words`;
2. step time with its proven lower bound, memory per device against the budget;
3. the breakdown of the step time;
4. for pipelines, the stages and a picture of the device grid;
5. the layouts per module, identical blocks collapsed (:func:`module_rows`);
6. the per-operator table, on request.

Everything is read from the plan value alone, so a plan loaded from JSON renders the same.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

from shardplan.cost import BREAKDOWN
from shardplan.report.text import compress_names, render_strategy, scope_title
from shardplan.result import OperatorChoice, Plan, StagePlan
from shardplan.table import format_table
from shardplan.units import fmt_bytes, fmt_seconds

__all__ = ["render_report", "dims_text", "recipe_words", "module_rows", "render_plan", "split_text", "device_picture", "memory_lines", "as_plan"]

BREAKDOWN_LABELS = {**BREAKDOWN, "weight_sync": "weight-gradient sync (incl. ZeRO gathers)",
                    "recompute": "recomputed forward", "grad_accum": "weight gradients added over micro-batches",
                    "stage_work": "stages' work (m x slowest stage)",
                    "pipeline_fill": "pipeline fill, drain and transfers"}
"""Words for the breakdown's keys (:data:`shardplan.cost.BREAKDOWN`, the memory choices' and a pipeline's)."""


def as_plan(plan: Any) -> Plan:
    """A :class:`~shardplan.result.Plan` of ``plan``: itself, or the one-stage plan of a tables-backed
    per-operator plan (:func:`shardplan.planner.from_spmd`)."""
    if isinstance(plan, Plan):
        return plan
    from shardplan.planner import from_spmd

    return from_spmd(plan)

_COUNTER = re.compile(r"(\d+)")


def _names(choice: OperatorChoice) -> tuple[str, ...]:
    return choice.labels if len(choice.labels) == len(choice.layout.dims) else choice.layout.dims


def dims_text(choice: OperatorChoice) -> str:
    """``batch:16 seq:128 out:2304`` (label:extent per dimension; the names alone when extents are unknown)."""
    names = _names(choice)
    if len(choice.extents) != len(names):
        return " ".join(names)
    return " ".join(f"{n}:{e}" for n, e in zip(names, choice.extents))


def split_text(choice: OperatorChoice, extents: bool = False) -> str:
    """``batch/8 out/4`` (dimension / ways) for the split dimensions, ``batch:16/8`` with ``extents``;
    ``replicated`` when none is split; `` partial`` after a layout that defers its reductions to its edges."""
    names = _names(choice)
    ext = choice.extents if extents and len(choice.extents) == len(names) else None
    text = " ".join(f"{n}:{ext[i]}/{c}" if ext is not None else f"{n}/{c}"
                    for i, (n, c) in enumerate(zip(names, choice.layout.split)) if c > 1) or "replicated"
    return text + " partial" if choice.layout.partial else text


def _weighted_mode(pairs: Sequence[tuple[Any, float]]) -> tuple[Any, float]:
    """The value of largest total weight and its share of the total weight."""
    tot: dict[Any, float] = {}
    for v, w in pairs:
        tot[v] = tot.get(v, 0.0) + w
    best = max(tot, key=lambda v: tot[v])
    whole = sum(tot.values())
    return best, (tot[best] / whole if whole > 0 else 1.0)


def _degree_parts(pairs: Sequence[tuple[int, Any]]) -> tuple[list[str], float]:
    """``["data D", ("context C",) "tensor T", ("expert E")]`` over (stage devices, operator choice) pairs,
    and the share of the weights the data × context × tensor mode covers.

    Each term is the mode over operators weighted by their weights' elements; experts are left out of the
    dense mode (their own degree is the mode over the expert operators).
    """
    dense = [(d, c) for d, c in pairs if c.expert_degree == 1] or list(pairs)
    (data, context, tensor), share = _weighted_mode(
        [((d // (c.tensor_degree * c.context_degree), c.context_degree, c.tensor_degree), max(c.weight_elems, 1))
         for d, c in dense])
    parts = [f"data {data}"] + ([f"context {context}"] if context > 1 else []) + [f"tensor {tensor}"]
    experts = [(c.expert_degree, max(c.weight_elems, 1)) for _, c in pairs if c.expert_degree > 1]
    if experts:
        parts.append(f"expert {_weighted_mode(experts)[0]}")
    return parts, share


def recipe_words(plan: Plan) -> str:
    """The plan as practitioners write a configuration.

    Per stage and operator with trainable weights, the *tensor* degree is the product of the splits of the
    dimensions that index its weights (the weights are sharded that many ways), the *context* degree that of
    its sequence dimensions (:attr:`~shardplan.result.OperatorChoice.context_degree`) and the *data* degree
    the stage's devices over both (the weights' replicas that hold other samples); the words give the mode
    over operators weighted by
    their weights' elements, marked "mostly" when it covers less than 90 % of the weights. Likewise the
    ZeRO stage; recomputation counts operators.
    """
    ops = [(s, c) for s in plan.stages for c in s.operators.values()]
    weighted = [(s, c) for s, c in ops if c.weight_elems > 0] or ops
    parts, share = _degree_parts([(s.devices, c) for s, c in weighted])
    groups = plan.num_stages // plan.chunks
    if plan.num_stages > 1:
        parts.append(f"pipeline {groups}" + (f" × {plan.chunks} chunks" if plan.chunks > 1 else "")
                     + f" ({plan.schedule})")
    words = " × ".join(parts) + (" (mostly)" if share < 0.9 else "")
    partial = sum(c.layout.partial for _, c in ops)
    if partial:
        words += f", deferred reductions (sequence parallel) on {partial} operators"
    words += _overlap_words(plan)
    zero, zshare = _weighted_mode([(c.state_stage, max(c.weight_elems, 1)) for _, c in weighted])
    if zero:
        words += f", {'FSDP (ZeRO-3)' if zero == 3 else f'ZeRO-{zero}'}" + (" (mostly)" if zshare < 0.9 else "")
    elif zshare < 1.0:
        words += ", ZeRO on " + f"{100 * (1 - zshare):.0f}% of the weights"
    rec = sum(c.recompute for _, c in ops)
    words += (", recompute every operator" if rec == len(ops) and rec else
              f", recompute {rec} of {len(ops)} operators" if rec else ", no recomputation")
    fp8, off = sum(c.fp8 for _, c in ops), {k: sum(k in c.offload for _, c in ops)
                                             for k in ("optimizer", "parameters", "activations")}
    words += (f", FP8 on {fp8} products" if fp8 else "") + "".join(
        f", {k} offloaded on {n} of {len(ops)} operators" for k, n in off.items() if n)
    words += f", {plan.micro_batches} micro-batch{'es' if plan.micro_batches > 1 else ''}"
    if plan.batch is not None:
        words += f" of {plan.batch // plan.micro_batches}"
    return words


def _overlap_words(plan: Plan) -> str:
    """The overlapped tensor-parallel collectives, where the plan's tables offered them (``overlap_tp``)."""
    if not (plan.stats.get("table_options") or {}).get("overlap_tp"):
        return ""
    got = plan.stats.get("overlap_tp")
    if not isinstance(got, Mapping):
        return ", tensor-parallel collectives overlapped with their products"
    if not got.get("edges"):
        return ", no collective overlapped with a product"
    return (f", tensor-parallel collectives overlapped with their products on {int(got['edges'])} edges "
            f"({fmt_seconds(float(got['hidden_seconds']))} hidden)")


def _module(name: str) -> str:
    return name.rsplit("/", 1)[0] if "/" in name else name


def _pattern(module: str) -> str:
    return _COUNTER.sub("#", module)


def _describe(members: Sequence[OperatorChoice]) -> str:
    """The distinct splits of a module's operators: ``matmul b8 o4; add b8`` (replicated ones counted)."""
    seen: dict[tuple[str, str], int] = {}
    for c in members:
        key = (c.kind, split_text(c))
        seen[key] = seen.get(key, 0) + 1
    shown = [f"{k} {s}" for (k, s), _ in seen.items() if s != "replicated"]
    rep = sum(n for (_, s), n in seen.items() if s == "replicated")
    extra = []
    if any(c.state_stage for c in members):
        extra.append("ZeRO-" + "/".join(str(z) for z in sorted({c.state_stage for c in members if c.state_stage})))
    if any(c.recompute for c in members):
        extra.append("recompute")
    text = "; ".join(shown[:4]) + (f"; +{len(shown) - 4} more" if len(shown) > 4 else "")
    if rep:
        text += ("; " if text else "") + f"{rep} replicated"
    return text + (f" [{', '.join(extra)}]" if extra else "")


def module_rows(stage: StagePlan) -> list[tuple[str, str, str]]:
    """(modules, operators, layouts) rows: operators grouped by module (their name without its last part),
    and modules of the same name pattern (counters aside) whose operators are laid out alike collapsed into
    one row (``h/0–11/attn``)."""
    by_module: dict[str, list[OperatorChoice]] = {}
    for name, c in stage.operators.items():
        by_module.setdefault(_module(name), []).append(c)
    rows: dict[tuple[str, str], list[str]] = {}
    counts: dict[tuple[str, str], int] = {}
    for mod, members in by_module.items():
        key = (_pattern(mod), _describe(members))
        rows.setdefault(key, []).append(mod)
        counts[key] = len(members)
    return [(scope_title(mods) if len(mods) > 1 else mods[0], f"{counts[key]}" + (f" x{len(mods)}" if len(mods) > 1 else ""),
             key[1]) for key, mods in rows.items()]


def device_picture(plan: Plan, width: int = 64) -> str:
    """One line per stage: a bar over the columns of its devices (device d at column ⌊width·d/p⌋, every
    stage at least one column), then its devices and units."""
    p = plan.machine.num_devices
    lines = []
    for s in plan.stages:
        start = min(width - 1, width * s.offset // p)
        end = max(start + 1, -(-width * (s.offset + s.devices) // p))
        label = f"stage {s.index}: devices {s.offset}..{s.offset + s.devices - 1}"
        units = f"blocks {s.first}..{s.end - 1}" if s.end > s.first else "all"
        lines.append(f"  {' ' * start + '#' * (end - start):<{width}}  {label}, {units}")
    return "\n".join(lines)


def render_plan(plan: Any, *, operators: bool = False, compare: Plan | None = None, layouts: bool = True) -> str:
    """The text report of ``plan`` (module docstring); ``operators``: add the per-operator table; ``compare``:
    a second plan (a recipe) costed by the same model, to state the speedup against; ``layouts``: the layouts
    by module (on by default). A tables-backed
    per-operator plan is shown as its one-stage plan (:func:`as_plan`)."""
    plan = as_plan(plan)
    m = plan.machine
    out = [f"{plan.model} on {m.describe()}",
           f"Plan: {recipe_words(plan)}"]
    proof = ("proven optimal" if plan.optimal else
             f"lower bound {fmt_seconds(plan.lower_bound)}, gap {100 * (plan.gap or 0):.3g}%"
             if plan.lower_bound is not None else "no bound (a hand-made plan)")
    out.append(f"Step time: {fmt_seconds(plan.step_time)} ({proof}; {plan.solver}, "
               f"{fmt_seconds(float(plan.stats.get('plan_seconds', plan.stats.get('solve_seconds', 0.0)) or 0.0))})")
    # a part of the space the planner refused to search: the bound above covers only what was searched (an
    # interrupted part is stated by its bound and the interrupt's own line)
    out.extend(f"  not searched: {r}" for r in plan.stats.get("refused", ()) or () if "interrupted" not in r)
    mem = plan.memory
    budget = mem.get("budget_bytes")
    peak = float(mem["peak_bytes"])
    line = f"Memory per device: {fmt_bytes(peak)}"
    if budget is not None and budget != float("inf"):
        line += f" of {fmt_bytes(budget)} ({100 * peak / budget:.0f}%)"
        if peak > budget * (1 + 1e-9):
            line += " — DOES NOT FIT"
    else:
        line += " (no budget)"
    line += (f": weights, gradients and optimizer state {fmt_bytes(float(mem['weights_bytes']))}, "
             f"activations {fmt_bytes(float(mem['activations_bytes']))}")
    out.append(line)
    if compare is not None:
        speed = compare.step_time / plan.step_time if plan.step_time > 0 else float("nan")
        out.append(f"Against {compare.model if compare.solver == plan.solver else compare.solver}: "
                   f"{fmt_seconds(compare.step_time)}, {fmt_bytes(float(compare.memory['peak_bytes']))} per device "
                   f"({recipe_words(compare)}): this plan is {speed:.2f}x as fast")
    out.extend(memory_lines(plan))
    total = plan.breakdown.get("total", plan.step_time)
    rows = [(f"  {BREAKDOWN_LABELS.get(k, k.replace('_', ' '))}", fmt_seconds(v),
             f"{100 * v / total:.1f}%" if total > 0 else "-")
            for k, v in plan.breakdown.items() if k != "total" and v > 1e-9 * total]
    if rows:
        out.append("Breakdown:")
        out.append(format_table(rows, right=(1, 2), rule=False))
    if plan.num_stages > 1:
        out.append(f"Stages ({plan.schedule}, {plan.micro_batches} micro-batches):")
        srows = [(str(s.index), f"{s.first}..{s.end - 1}", f"{s.offset}..{s.offset + s.devices - 1}",
                  fmt_seconds(s.forward), fmt_seconds(s.backward), f"{s.in_flight:g}",
                  fmt_bytes(float(s.memory["peak_bytes"])), recipe_words_stage(s)) for s in plan.stages]
        out.append(format_table(srows, ("stage", "blocks", "devices", "fwd/mb", "bwd/mb", "in flight", "memory",
                                        "layout"), right=(3, 4, 5, 6)))
        out.append(device_picture(plan))
    for s in plan.stages if layouts else ():
        out.append(f"Layouts{f' of stage {s.index}' if plan.num_stages > 1 else ''} by module:")
        out.append(format_table(module_rows(s), ("modules", "ops", "layouts"), rule=False))
        if plan.num_stages > 3 and s.index == 1:
            out.append(f"  (stages 2..{plan.num_stages - 1}: --operators or the JSON lists them)")
            break
    if plan.conservative:
        out.append(f"Described conservatively ({len(plan.conservative)}; not split, operands gathered):")
        out.append(format_table([(c.target, c.module, c.reason if len(c.reason) <= 72 else c.reason[:71] + "…")
                                 for c in plan.conservative], ("operator", "module", "reason"), rule=False))
    if operators:
        orows = [(n, c.kind, dims_text(c), split_text(c, extents=True), str(c.state_stage), "yes" if c.recompute else "",
                  fmt_seconds(c.seconds), fmt_seconds(c.redistribution_seconds))
                 for s in plan.stages for n, c in s.operators.items()]
        out.append(format_table(orows, ("operator", "kind", "dims", "splits", "zero", "recompute", "own", "moving in"),
                                right=(6, 7)))
    return "\n".join(out)


def memory_lines(plan: Plan) -> list[str]:
    """What the memory search chose and proved: the peak model, the proof, micro-batches, which operators
    shard their state (by ZeRO stage) or recompute."""
    st = plan.stats
    mem = plan.memory
    out: list[str] = []
    names = [n for s in plan.stages for n in s.operators]
    if "peak_step" in mem:
        k = int(mem["peak_step"])
        out.append(f"  backward-peak model (gradient buffers allocated as the backward pass goes): the peak is at "
                   f"the backward step of {names[k]} (operator {k + 1} of {len(names)}); the additive sum "
                   f"(persistent gradient buffers) would be {fmt_bytes(float(mem['additive_peak_bytes']))}")
    elif st.get("grad_buffers") == "backward":
        out.append(f"  gradient buffers: {plan.micro_batches} micro-batches accumulate gradients in persistent "
                   "buffers, so the additive peak is exact (the backward-peak model applies to one micro-batch)")
    if not st.get("memory_choices"):
        return out
    if "nodes" in st:
        # the memory search's own proof (its solver's gap), not the plan's: a plan compared with an interrupted
        # pipeline search has its bound lowered by that search, not by this one
        gap = st.get("gap", plan.gap)
        proof = ("proven optimal under the budget" if gap is not None and gap <= 1e-9 else
                 f"NOT proven: gap {100 * (gap or 0.0):.3g}%")
        out.append(f"Memory search: {proof}; {st.get('nodes', 0)} branch-and-bound nodes, "
                   f"{st.get('dp_solves', 0)} DP solves")
        if "unconstrained_cost" in st:
            out.append(f"  unconstrained optimum (m={plan.micro_batches}): {fmt_seconds(st['unconstrained_cost'])}"
                       f" at {fmt_bytes(st['unconstrained_memory_bytes'])} per device")
    out.append(f"Micro-batches: {plan.micro_batches}")

    by_module: dict[str, list[str]] = {}
    for n in names:
        by_module.setdefault(_module(n), []).append(n)

    def listed(members: list[str]) -> str:
        """Whole modules by their name (counters collapsed), the other operators by theirs."""
        chosen = set(members)
        whole = [m for m, ops in by_module.items() if len(ops) > 1 and all(o in chosen for o in ops)]
        rest = [n for n in members if _module(n) not in set(whole)]
        parts = []
        if whole:
            parts.append(("modules " if len(whole) > 1 else "module ") + scope_title(whole))
        if rest:
            parts.append(scope_title(rest) if any("/" in n for n in rest) else compress_names(rest))
        return "; ".join(parts)

    for stage, members in sorted(plan.state_sharding.items()):
        out.append(f"  zero-{stage} state sharding ({len(members)} ops): {listed(members)}")
    rec = plan.recomputed
    if rec:
        out.append(f"  recompute ({len(rec)} ops): {listed(rec)}")
    if not plan.state_sharding and not rec:
        out.append("  no operator shards its state or recomputes")
    return out


def recipe_words_stage(stage: StagePlan) -> str:
    """A stage's data × context × tensor (× expert) degrees, as :func:`recipe_words` counts them for the plan."""
    ops = [c for c in stage.operators.values() if c.weight_elems > 0] or list(stage.operators.values())
    return " × ".join(_degree_parts([(stage.devices, c) for c in ops])[0])


def render_report(plan: Any, baselines: Mapping[str, Any] | None = None) -> str:
    """The one report (:func:`shardplan.report.summary.render_plan`) of a per-operator plan, then its
    Table II-style strategy table, how long the search took, and its speedups over ``baselines``."""
    out = [render_plan(plan, layouts=False), "", "Strategy:", render_strategy(plan)]
    if plan.solution is not None:
        built = f" (cost tables {fmt_seconds(plan.build_seconds)})" if plan.build_seconds is not None else ""
        out.append(f"Search: {plan.solution.solver}, {fmt_seconds(plan.solve_seconds)}{built}")
    if baselines:
        out.append("")
        rows = []
        for name, b in baselines.items():
            speed = f"{b.cost / plan.cost:.2f}x" if plan.cost > 0 else "-"
            rows.append((name, fmt_seconds(b.cost), speed))
        out.append(format_table(rows, ("baseline", "step time", "speedup of this plan"), right=(1, 2), rule=False))
    return "\n".join(out)
