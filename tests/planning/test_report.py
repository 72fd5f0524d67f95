"""Reports: Table II-style grouping, breakdown, JSON and DOT exports."""

from __future__ import annotations

import json

import pytest

from shardplan.baselines import baseline_plans, data_parallel
from shardplan.cost import BREAKDOWN, build_tables
from shardplan.errors import ShardplanError
from shardplan.report import graph_to_dot, plan_to_dot
from shardplan.machine import preset
from shardplan.models import get_model
from shardplan.spmd import SpmdPlan, plan_from_configs, solve_tables
from shardplan.report import compress_names, group_operators, plan_to_json, render_report, render_strategy
from shardplan.report.text import scope_title

# the AlexNet strategy of the paper's Table II (p = 32); pools and flatten follow their producers
TABLE2_ALEXNET = {
    "conv1": (32, 1, 1, 1, 1, 1, 1), "pool1": (32, 1, 1, 1, 1, 1), "conv2": (32, 1, 1, 1, 1, 1, 1),
    "pool2": (32, 1, 1, 1, 1, 1), "conv3": (32, 1, 1, 1, 1, 1, 1), "conv4": (32, 1, 1, 1, 1, 1, 1),
    "conv5": (16, 2, 1, 1, 1, 1, 1), "pool5": (32, 1, 1, 1, 1, 1), "flatten": (32, 1, 1, 1),
    "fc1": (1, 4, 8), "fc2": (1, 8, 4), "fc3": (1, 4, 8), "softmax": (1, 4),
}


@pytest.fixture(scope="module")
def alexnet32():
    return build_tables(get_model("alexnet"), preset("paper", 32))


def test_compress_names():
    assert compress_names(["conv1", "conv2", "conv3", "conv4", "fc1", "fc3"]) == "conv1–4, fc1, fc3"
    assert compress_names(["A", "B", "C", "D"]) == "A–D"
    assert compress_names(["stem", "A", "B", "C", "D", "E"]) == "stem, A–E"
    assert compress_names(["fc1", "fc2"]) == "fc1, fc2"
    assert compress_names(["res2", "res3", "res4", "res5"]) == "res2–5"
    assert compress_names([]) == ""


def test_table2_alexnet_grouping(alexnet32):
    plan = plan_from_configs(alexnet32, TABLE2_ALEXNET, name="paper")
    rows = {(g.title, g.config) for g in group_operators(plan)}
    assert ("conv1–4", (32, 1, 1, 1, 1, 1, 1)) in rows
    assert ("conv5", (16, 2, 1, 1, 1, 1, 1)) in rows
    assert ("fc1, fc3", (1, 4, 8)) in rows
    assert ("fc2", (1, 8, 4)) in rows
    assert ("softmax", (1, 4)) in rows
    text = render_strategy(plan)
    assert "conv1–4" in text and "(1,4,8)" in text


def test_report_collapses_repeated_inception_modules():
    t = build_tables(get_model("inception_v3", batch=8), preset("paper", 2))
    plan = plan_from_configs(t, data_parallel(t), name="dp")
    groups = {g.kind: g for g in group_operators(plan)}
    conv = groups["conv2d"]
    assert conv.title == "modules stem, A–E" and conv.size == 94
    assert groups["concat"].title == "modules A–E" and groups["concat"].size == 15
    assert len(render_strategy(plan).splitlines()) == 2 + 8  # header, rule, 8 groups for 219 operators


def test_report_groups_transformer_layers():
    t = build_tables(get_model("transformer", batch=4, layers=3, seq=16, vocab=100), preset("paper", 2), cutoff=1)
    plan = plan_from_configs(t, data_parallel(t))
    titles = [g.title for g in group_operators(plan)]
    assert "enc1–3/ffn1; dec1–3/ffn1" in titles
    assert "modules enc, dec" in titles


def test_render_report_sections(alexnet32):
    plans = baseline_plans(alexnet32, "one_weird_trick")
    paper = plan_from_configs(alexnet32, TABLE2_ALEXNET, name="paper")
    text = render_report(paper, plans)
    assert "Step time:" in text and "Plan: data" in text
    assert "gradient all-reduce" in text and "redistribution between operators" in text
    assert "Memory per device" in text
    speed = plans["data_parallel"].cost / paper.cost
    assert f"{speed:.2f}x" in text
    assert "one_weird_trick" in text


def test_plan_to_json(alexnet32):
    plans = baseline_plans(alexnet32, "one_weird_trick")
    paper = plan_from_configs(alexnet32, TABLE2_ALEXNET, name="paper")
    d = plan_to_json(paper, plans)
    s = json.dumps(d)
    back = json.loads(s)
    assert back["baselines"]["data_parallel"]["speedup"] == pytest.approx(plans["data_parallel"].cost / paper.cost)
    assert back["groups"][0]["title"] == "conv1–4"
    assert back["cost_seconds"] == pytest.approx(paper.cost)


def test_dot_export(alexnet32):
    paper = plan_from_configs(alexnet32, TABLE2_ALEXNET, name="paper")
    dot = plan_to_dot(paper)
    assert dot.startswith('digraph "alexnet" {') and dot.rstrip().endswith("}")
    for op in paper.graph:
        assert f'"{op.name}" [label="{op.name}\\n' in dot
    assert '"conv4" -> "conv5" [label=' in dot  # (32,..) -> (16,2,..) redistributes
    assert '"conv3" -> "conv4";' in dot  # same data-parallel layout: nothing moves, plain edge
    g = graph_to_dot(paper.graph)
    assert g.count("->") == len(paper.graph.edges)


def test_plan_breakdown_is_fixed_at_construction(alexnet32):
    plan = plan_from_configs(alexnet32, TABLE2_ALEXNET, name="paper")
    bd = plan.breakdown
    assert bd == alexnet32.breakdown(plan.assignment) and list(bd) == [*BREAKDOWN, "total"]
    bd["total"] = 0.0  # a copy: the plan is unchanged
    assert plan.cost == alexnet32.breakdown(plan.assignment)["total"] > 0
    with pytest.raises(ShardplanError, match="assigns 2 configurations to 13 operators"):
        SpmdPlan(alexnet32, (0, 0))


def test_solve_tables_records_the_build_time_it_is_given(alexnet32):
    plan = solve_tables(alexnet32)
    assert plan.build_seconds is None and "cost tables" not in render_report(plan)
    timed = solve_tables(alexnet32, build_seconds=1.5)
    assert timed.build_seconds == 1.5 and "(cost tables 1.5 s)" in render_report(timed)
    assert timed.assignment == plan.assignment
    with pytest.raises(ShardplanError, match="unknown solver 'fast'"):
        solve_tables(alexnet32, solver="fast")


def test_render_report_text(alexnet32):
    plan = plan_from_configs(alexnet32, TABLE2_ALEXNET, name="paper")
    lines = render_report(plan).splitlines()
    table = lines.index("Strategy:")
    assert lines[table + 1].split() == ["layers", "kind", "dims", "configuration", "ops"]
    assert lines[table + 3].split() == ["conv1–4", "conv2d", "bchwnrs", "(32,1,1,1,1,1,1)", "4"]
    total = plan.breakdown["total"]
    labels = [BREAKDOWN[k] for k, v in plan.breakdown.items() if k != "total" and v > 1e-9 * total]
    start = lines.index("Breakdown:")
    assert [line[2:].split("  ")[0] for line in lines[start + 1:start + 1 + len(labels)]] == labels


def test_scope_titles_collapse_runs_inside_a_set():
    names = [f"m/L{i}/q" for i in list(range(1, 64)) + list(range(65, 97))]
    assert scope_title(names) == "m/L{1–63, 65–96}/q"


def test_memory_search_line_states_its_own_proof_not_the_plans():
    """A one-program plan whose bound was lowered by an interrupted pipeline search (bound 0) still reports its
    memory search as proven; the step-time line carries the plan's gap."""
    from dataclasses import replace

    from shardplan.planner import plan
    from shardplan.report.summary import render_plan

    p = plan("gpt", preset("h100", 8), sizes={"layers": 2}, batch=8, stages=False, budget=2 * 2**30)
    assert p.optimal and "Memory search: proven optimal under the budget" in render_plan(p)
    cut = replace(p, lower_bound=0.0)
    text = render_plan(cut)
    assert "Memory search: proven optimal under the budget" in text and "gap 100%" in text


def test_device_picture_places_each_stage_over_its_own_devices():
    """A staircase: stage i's bar covers the columns of devices offset .. offset + devices - 1."""
    from shardplan.recipe import cost_recipe
    from shardplan.report.summary import device_picture
    plan = cost_recipe("gpt3-125m", preset("h100", 32), "tp=4,pp=4,mbs=1,gbs=8", sizes={"layers": 4})
    lines = device_picture(plan, width=32).splitlines()
    assert len(lines) == 4
    for i, line in enumerate(lines):
        bar = line[2:34]
        assert bar == " " * (8 * i) + "#" * 8 + " " * (24 - 8 * i), line
        assert line[34:].strip().startswith(f"stage {i}: devices {8 * i}..{8 * i + 7}")
