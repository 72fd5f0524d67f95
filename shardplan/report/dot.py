"""Graphviz DOT of a graph or a plan (plain text; render with ``dot -Tsvg``).

Nodes are operators, labelled with the name and, for a plan, the dimension
letters and configuration; they are filled by operator kind (a fixed
palette, assigned in order of first appearance so that the output is
deterministic; a legend cluster lists the kinds). For a plan, edges that
need redistribution are drawn bold red and labelled with its predicted time.
"""

from __future__ import annotations

from shardplan.ir import Graph
from shardplan.spmd import SpmdPlan
from shardplan.units import fmt_seconds

__all__ = ["graph_to_dot", "plan_to_dot"]

_PALETTE = ("#a6cee3", "#b2df8a", "#fdbf6f", "#cab2d6", "#fb9a99", "#ffff99", "#1f78b4", "#33a02c",
            "#e31a1c", "#ff7f00", "#6a3d9a", "#b15928", "#8dd3c7", "#bebada", "#80b1d3", "#fccde5")


def _q(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _colours(graph: Graph) -> dict[str, str]:
    kinds: dict[str, str] = {}
    for op in graph.operators:
        if op.kind not in kinds:
            kinds[op.kind] = _PALETTE[len(kinds) % len(_PALETTE)]
    return kinds


def _dot(graph: Graph, labels: dict[str, str], edge_labels: dict[tuple[int, int, int], str], title: str) -> str:
    colours = _colours(graph)
    lines = [f"digraph {_q(graph.name)} {{", f"  label={_q(title)};", "  labelloc=t;", "  rankdir=TB;",
             '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
             '  edge [fontname="Helvetica", fontsize=8];']
    for op in graph.operators:
        lines.append(f"  {_q(op.name)} [label={_q(labels[op.name])}, fillcolor={_q(colours[op.kind])}, "
                     f"tooltip={_q(op.kind)}];")
    for e in graph.edges:
        u, v = graph.operators[e.src].name, graph.operators[e.dst].name
        lab = edge_labels.get((e.src, e.dst, e.slot))
        attrs = f" [label={_q(lab)}, penwidth=2.5, color=\"#d62728\"]" if lab else ""
        lines.append(f"  {_q(u)} -> {_q(v)}{attrs};")
    lines.append("  subgraph cluster_legend { label=\"kinds\"; fontsize=10;")
    for kind, col in colours.items():
        lines.append(f"    {_q('kind:' + kind)} [label={_q(kind)}, fillcolor={_q(col)}];")
    lines.append("  }")
    lines.append("}")
    return "\n".join(lines) + "\n"


def graph_to_dot(graph: Graph) -> str:
    """The operator graph: node label = name, kind and dims."""
    labels = {op.name: f"{op.name}\n{op.kind} {op.label}" for op in graph.operators}
    return _dot(graph, labels, {}, f"{graph.name}: {len(graph)} operators, {len(graph.edges)} edges")


def plan_to_dot(plan: SpmdPlan) -> str:
    """The plan: node label = name + dims + configuration; redistributing edges bold with their time."""
    g = plan.graph
    configs = plan.configs
    labels = {op.name: f"{op.name}\n{op.label} ({','.join(map(str, configs[op.name]))})" for op in g.operators}
    edge_labels = {}
    for e, m in zip(g.edges, plan.tables.edge_costs):
        t = float(m[plan.assignment[e.src], plan.assignment[e.dst]])
        if t > 0:
            edge_labels[(e.src, e.dst, e.slot)] = fmt_seconds(t)
    title = f"{g.name}: strategy {plan.name}, {fmt_seconds(plan.cost)} per step on {plan.machine.num_devices} devices"
    return _dot(g, labels, edge_labels, title)
