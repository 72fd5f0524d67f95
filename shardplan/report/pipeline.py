"""A pipeline plan's own details: the report's pipeline section, the JSON of the search's answer, and the
schedule's timeline as a picture."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shardplan.pipeline.schedule import bubble_fraction, simulate
from shardplan.units import fmt_seconds

if TYPE_CHECKING:
    from shardplan.pipeline.api import PipelineResult

__all__ = ["render_pipeline", "pipeline_to_json", "draw_timeline", "units_label"]


def units_label(names: list[str], first: int, end: int) -> str:
    """``L1..L12`` style label of units [first, end)."""
    if end - first == 1:
        return names[first]
    return f"{names[first]} .. {names[end - 1]} ({end - first} units)"


def _layout(plan) -> str:
    """One line: the intra-stage plan's most common configuration per operator kind."""
    if plan is None or not hasattr(plan, "operators"):
        return "-"
    seen: dict[str, str] = {}
    for row in plan.operators():
        if row["kind"] in seen:
            continue
        split = "".join(f"{d}{c}" for d, c in zip(row["dims"], row["config"]) if c > 1)
        seen[row["kind"]] = f"{row['kind']}:{split or 'rep'}"
    return " ".join(seen.values())


def render_pipeline(result: "PipelineResult") -> str:
    """The one report (:func:`~shardplan.report.summary.render_plan`) of a pipeline search's answer, then what
    only a pipeline has: the bounds per schedule, the same stages under GPipe, the bubble, the transfers
    and the search's counts."""
    from shardplan.planner import from_pipeline
    from shardplan.report.summary import render_plan

    plan = result.plan
    lines = [render_plan(from_pipeline(result)),
             f"Pipeline: {plan.num_stages // plan.chunks} stage(s), schedule {plan.schedule}"
             + (f" (v={plan.chunks} chunks per device group)" if plan.chunks > 1 else "")
             + f", {plan.micro_batches} micro-batch(es) of {result.stages.batch // plan.micro_batches}; event "
             f"simulation {fmt_seconds(result.simulated_step_time())}"]
    if plan.lower_bound is not None:
        fam = plan.stats.get("family_lower_bounds") or {}
        lines.append(f"  proven lower bound over the space searched: {fmt_seconds(plan.lower_bound)} "
                     f"(gap {plan.gap:.2g})"
                     + ("; per schedule: " + ", ".join(f"{k} {fmt_seconds(v)}" for k, v in fam.items()) if fam else ""))
        anyc = plan.stats.get("interleaved_any_chunking_bound")
        if anyc is not None:
            lines.append(f"  interleaved searched over even and Megatron-LM chunkings; over any chunking it is at least "
                         f"{fmt_seconds(anyc)}")
    gp = result.gpipe_step_time()
    if gp is not None:
        lines.append(f"  same stages under GPipe: {fmt_seconds(gp)}")
    times, links, back = plan.stage_times(), plan.group_links(), plan.group_links(back=True)
    lines.append(f"  bubble fraction: {bubble_fraction(times, links, plan.micro_batches, plan.schedule, plan.chunks, back):.1%}")
    if plan.links:
        lines.append("  transfer per micro-batch, activation: " + ", ".join(fmt_seconds(c) for c in plan.links))
        if plan.back_links is not None and plan.back_links != plan.links:
            lines.append("  transfer per micro-batch, gradient: " + ", ".join(fmt_seconds(c) for c in plan.back_links))
    st = plan.stats
    lines.append(f"  search: {st.get('intra_stage_solves', 0)} intra-stage solves, {st.get('candidates', 0)} "
                 f"bottleneck candidates, {st.get('dp_states', 0)} DP states, {fmt_seconds(result.seconds)} in all")
    fits = st.get("fit_evaluations", 0) + st.get("group_fit_evaluations", 0) + st.get("zb_fit_candidates", 0)
    if "fit_rtol" in st or fits:
        lines.append(f"  memory choices: {st.get('fit_evaluations', 0)} stage and {st.get('group_fit_evaluations', 0)} "
                     f"interleaved-group fits asked, each proven to {st.get('fit_rtol', 0):g}"
                     + (f", {st['fit_unproven']} stopped by the time limit" if st.get("fit_unproven") else ""))
    return "\n".join(lines)


def pipeline_to_json(result: "PipelineResult") -> dict[str, Any]:
    plan = result.plan
    names = result.unit_names()
    times, links, back = plan.stage_times(), plan.group_links(), plan.group_links(back=True)
    return {
        "schedule": plan.schedule,
        "chunks": plan.chunks,
        "micro_batches": plan.micro_batches,
        "step_seconds": plan.step_time,
        "lower_bound_seconds": plan.lower_bound,
        "gap": plan.gap,
        "family_lower_bounds": dict(plan.stats.get("family_lower_bounds") or {}),
        "interleaved_any_chunking_bound": plan.stats.get("interleaved_any_chunking_bound"),
        "simulated_step_seconds": result.simulated_step_time(),
        "gpipe_step_seconds": result.gpipe_step_time(),
        "bubble_fraction": bubble_fraction(times, links, plan.micro_batches, plan.schedule, plan.chunks, back),
        "budget_bytes": plan.budget,
        "links_seconds": list(plan.links),
        "gradient_links_seconds": list(plan.back_links if plan.back_links is not None else plan.links),
        "stages": [{"units": [names[u] for u in range(s.first, s.end)], "first_device": s.offset,
                    "devices": s.devices, "forward_seconds": s.cost.forward, "backward_seconds": s.cost.backward,
                    "weight_bytes": s.cost.weight_bytes, "activation_bytes_per_micro_batch": s.cost.activation_bytes,
                    "in_flight": s.in_flight, "memory_bytes": s.memory, "layouts": _layout(s.cost.detail)}
                   for s in plan.stages],
        "stats": {k: v for k, v in plan.stats.items() if isinstance(v, (int, float, str))},
        "seconds": result.seconds,
    }


COLOURS = {"forward": "#4C72B0", "backward": "#DD8452", "weight": "#C44E52", "send": "#55A868", "sync": "#8172B3"}


def draw_timeline(result: "PipelineResult", path: str) -> str:
    """Draw the schedule (one row per device group: forward, backward, transfers, idle as gaps) to ``path``
    (.png or .svg). Returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    plan = result.plan
    times, links, back = plan.stage_times(), plan.group_links(), plan.group_links(back=True)
    events = simulate(times, links, plan.micro_batches, plan.schedule, plan.chunks, back=back)
    n = len(times)
    end = max(e.end for e in events)
    fig, ax = plt.subplots(figsize=(12, 0.6 * n + 1.4))
    for e in events:
        row = n - 1 - e.stage
        if e.kind == "send":
            ax.barh(row - 0.3, e.end - e.start, left=e.start, height=0.12, color=COLOURS["send"])
            continue
        ax.barh(row, e.end - e.start, left=e.start, height=0.6, color=COLOURS[e.kind], edgecolor="white",
                linewidth=0.4)
        if e.kind not in ("sync",) and (e.end - e.start) > end / 60:
            ax.text((e.start + e.end) / 2, row, str(e.micro_batch + 1), ha="center", va="center", fontsize=6,
                    color="white")
    ax.set_yticks(range(n))
    ax.set_yticklabels([f"stage {n - 1 - r}" for r in range(n)])
    ax.set_xlim(0, end)
    ax.set_xlabel("seconds")
    bubble = bubble_fraction(times, links, plan.micro_batches, plan.schedule, plan.chunks, back)
    ax.set_title(f"{plan.schedule}" + (f" v={plan.chunks}" if plan.chunks > 1 else "")
                 + f", {n} stages, m={plan.micro_batches}, step {fmt_seconds(end)}, bubble {bubble:.0%}"
                 + " (gaps are idle)")
    fig.legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items()], loc="lower center", fontsize=7, ncol=4,
               frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path)
    plt.close(fig)
    return path
