"""Recipes: text round trip, refusals, and cost_recipe against the pieces it is made of, costed by hand."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from shardplan.baselines import megatron
from shardplan.cli.commands import main
from shardplan.cost import build_tables
from shardplan.errors import ShardplanError
from shardplan.fit import plan_with_choices
from shardplan.machine import preset
from shardplan.models import get_model
from shardplan.pipeline.search import PipelineSpace, evaluate_pipeline
from shardplan.pipeline.stages import ModelStages
from shardplan.spmd import plan_from_configs
from shardplan.recipe import Recipe, cost_recipe, megatron_layouts, recompute_names
from shardplan.result import Plan

SIZES = {"layers": 4, "d_model": 256, "heads": 8, "seq": 64, "vocab": 1024}
BATCH = 32


def build(b: int):
    return get_model("gpt", b, **SIZES)


def tables_of(machine, batch: int = BATCH):
    """Megatron-LM's tables as the brief states them: node_replicas for the norms, every split allowed."""
    t = build_tables(build(batch), replace(machine, memory_bytes=None), cutoff=1, orders="row-major",
                     node_replicas=True)
    return replace(t, machine=machine)


# -- text ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["tp=8,pp=4,vp=5,mbs=2,recompute=full", "tp=2,dp=4,zero=3,gbs=64",
                                  "tp=8,sp=true,cp=2,pp=2,recompute=selective",
                                  "pp=4,first_stage_layers=3,last_stage_layers=5,recompute=2",
                                  "tp=4,zero=1,dtype=bf16,overlap=grad_reduce+param_gather", "overlap=none"])
def test_text_round_trip(text):
    r = Recipe.parse(text)
    assert str(r) == text
    assert Recipe.parse(str(r)) == r


def test_aliases_and_normal_form():
    r = Recipe.parse(" tp = 8 , fsdp , mbs=2, overlap=param_gather+grad_reduce, RECOMPUTE=Full ")
    assert (r.tp, r.zero, r.mbs, r.recompute) == (8, 3, 2, "full")
    assert r.overlap == ("grad_reduce", "param_gather")
    assert str(r) == "tp=8,zero=3,mbs=2,recompute=full,overlap=grad_reduce+param_gather"
    assert Recipe.parse("sp").sp is True
    assert Recipe.parse("recompute=3").recompute == 3
    assert Recipe.parse(str(Recipe())) == Recipe()


def test_files(tmp_path):
    j = tmp_path / "r.json"
    j.write_text(json.dumps({"tp": 8, "pp": 2, "mbs": 4, "recompute": "full", "overlap": ["grad_reduce"]}))
    t = tmp_path / "r.toml"
    t.write_text("[recipe]\n# Megatron run\ntp = 8\npp = 2\nmbs = 4\nrecompute = \"full\"\n"
                 "overlap = [\"grad_reduce\"]\n")
    want = Recipe(tp=8, pp=2, mbs=4, recompute="full", overlap=("grad_reduce",))
    assert Recipe.from_file(j) == want == Recipe.from_file(t) == Recipe.load(str(t))
    bad = tmp_path / "bad.toml"
    bad.write_text("tp = 8\ntp = 4\n")
    with pytest.raises(ShardplanError, match="twice"):
        Recipe.from_file(bad)


@pytest.mark.parametrize("text, part", [("", "empty"), ("tp=0", "tp"), ("tp=x", "tp"), ("foo=1", "unknown key"),
                                        ("recompute=partial", "recompute"), ("zero=4", "zero"), ("tp", "key=value"),
                                        ("sp=maybe", "sp"), ("overlap=everything", "overlap"), ("dtype=int4", "dtype"),
                                        ("tp=2,tp=4", "twice"), ("recompute=0", "recompute")])
def test_bad_text_is_one_line(text, part):
    with pytest.raises(ShardplanError, match=part) as e:
        Recipe.parse(text)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("text, part", [("tp=1,sp=true", "sequence parallelism"), ("cp=2,ep=2", "context and expert"),
                                        ("ep=2", "expert parallelism"), ("zero=3,hsdp=8", "hybrid sharding"),
                                        ("dtype=fp8", "fp8"), ("dtype=fp32", "dtype fp32"),
                                        ("tp=8,overlap=tp_comm", "tp_comm"),
                                        ("zero=1,overlap=param_gather", "param_gather"),
                                        ("zero=3,overlap=grad_reduce", "FSDP"), ("vp=2", "vp"),
                                        ("first_stage_layers=1", "pp >= 2")])
def test_not_expressible_is_refused_by_name(text, part):
    with pytest.raises(ShardplanError, match=part) as e:
        cost_recipe("gpt", preset("a100", 16), text, batch=BATCH, sizes=SIZES)
    assert "not expressible" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("text, part", [("tp=3", "does not divide"), ("tp=8,dp=4", "not the 16 devices"),
                                        ("tp=2,mbs=3", "multiple of dp"), ("tp=8,gbs=64", "given differently"),
                                        ("tp=16", "cannot split h=8"), ("tp=2,pp=8", "do not split evenly")])
def test_bad_degrees(text, part):
    with pytest.raises(ShardplanError, match=part):
        cost_recipe("gpt", preset("a100", 16), text, batch=BATCH, sizes=SIZES)


# -- one program -----------------------------------------------------------------------------------------
def test_tp_dp_recipe_equals_megatron_with_choices_by_hand():
    machine = preset("a100", 16)
    got = cost_recipe("gpt", machine, "tp=8,zero=1,mbs=2,recompute=full", batch=BATCH, sizes=SIZES)
    tables = tables_of(machine)
    base = plan_from_configs(tables, megatron(tables, 2))  # dp 2 × tp 8 = the node
    blocks = [op.name for op in tables.graph.operators if "/" in op.name]
    hand = plan_with_choices(base, stage=1, recompute=blocks, micro_batches=BATCH // (2 * 2))
    assert got.step_time == pytest.approx(hand.cost, rel=1e-12)
    assert got.memory["peak_bytes"] == pytest.approx(hand.memory["peak_bytes"], rel=1e-12)
    assert got.micro_batches == 8 and got.solver == "recipe" and got.lower_bound is None
    lay = {op.name: tables.layouts[i][base.assignment[i]] for i, op in enumerate(tables.graph.operators)}
    assert got.layouts == lay
    assert sorted(got.recomputed) == sorted(blocks)
    assert {c.state_stage for c in got.operators.values() if c.weight_elems} == {1}
    assert Plan.from_json(got.to_json()).step_time == got.step_time


def test_tensor_group_inside_a_node_holds_the_norms_rows():
    """tp 2 on nodes of 8: the tensor pairs lie inside a node and the norms (replicated over each pair) read the
    same batch rows as the tensor-parallel operators: no redistribution, as in Megatron-LM."""
    machine = preset("a100", 16)
    got = cost_recipe("gpt", machine, "tp=2,mbs=1", batch=BATCH, sizes=SIZES)
    assert got.breakdown["redistribution"] == 0.0
    q = got.operators["L1/q"].layout
    assert q.splits[0][q.dims.index("h")] == 2 and q.split[q.dims.index("b")] == 8
    assert got.operators["L1/ln1"].tensor_degree == 1


def test_megatron_layouts_equal_the_baseline_on_a_node():
    machine = preset("a100", 16)
    tables = tables_of(machine)
    ours = megatron_layouts(tables, 2, 8)
    base = plan_from_configs(tables, megatron(tables, 2))
    assert all(ours[op.name] == tables.layouts[i][base.assignment[i]] for i, op in enumerate(tables.graph.operators))


def test_recompute_policies():
    g = build(4)
    blocks = [op.name for op in g.operators if "/" in op.name]
    assert recompute_names(g, "none") == []
    assert recompute_names(g, "full") == blocks
    assert recompute_names(g, "selective") == [n for n in blocks if n.endswith(("/scores", "/context"))]
    assert recompute_names(g, 1) == [n for n in blocks if n.startswith("L1/")]


# -- pipelines -------------------------------------------------------------------------------------------
def _machinery(machine, dp: int, m: int, choices=None):
    stages = ModelStages(build, BATCH, replace(machine, memory_bytes=None),
                         {"cutoff": 1, "orders": "row-major", "node_replicas": True},
                         strategy=lambda t: megatron(t, dp), choices=choices)
    return stages, PipelineSpace(stages.num_units, machine.num_devices, machine.node_size, (m,), None)


def test_pp_recipe_equals_the_pipeline_machinery():
    """Without memory choices the recipe's stages (costed through the choices path) equal the strategy-only
    stages bench_pipeline costs; with them, the machinery's own evaluation of the same stages."""
    machine = preset("a100", 16)
    got = cost_recipe("gpt", machine, "tp=8,pp=2,mbs=2", batch=BATCH, sizes=SIZES)
    stages, space = _machinery(machine, 1, 16)
    segs = [(0, 3, 8), (3, 6, 8)]  # 4 blocks: embedding + 2 blocks, 2 blocks + head
    want = evaluate_pipeline(segs, 16, space, stages.stage_cost, stages.link_time, stages.exchange_time)
    assert got.step_time == pytest.approx(want.step_time, rel=1e-9)
    assert [(s.first, s.end, s.offset, s.devices) for s in got.stages] == [(0, 3, 0, 8), (3, 6, 8, 8)]

    rec = cost_recipe("gpt", machine, "tp=8,pp=2,mbs=2,zero=1,recompute=full", batch=BATCH, sizes=SIZES)

    def choices(plan, mb):
        return plan_with_choices(plan, stage=1, recompute=[o.name for o in plan.graph.operators if "/" in o.name],
                                 micro_batches=1, accumulate=mb)

    stages, space = _machinery(machine, 1, 16, choices)
    want = evaluate_pipeline(segs, 16, space, stages.stage_cost, stages.link_time, stages.exchange_time)
    assert rec.step_time == pytest.approx(want.step_time, rel=1e-12)
    assert rec.step_time > got.step_time  # recomputation and ZeRO-1's gather only add time
    assert rec.memory["peak_bytes"] < got.memory["peak_bytes"]
    assert rec.schedule == "1f1b" and rec.micro_batches == 16 and rec.solver == "recipe"


def test_interleaved_and_uneven_stages():
    machine = preset("a100", 16)
    sizes = {**SIZES, "layers": 8}
    got = cost_recipe("gpt", machine, "tp=8,pp=2,vp=2,mbs=2", batch=BATCH, sizes=sizes)
    assert (got.schedule, got.chunks, got.num_stages) == ("interleaved", 2, 4)
    assert [(s.first, s.end, s.offset) for s in got.stages] == [(0, 3, 0), (3, 5, 8), (5, 7, 0), (7, 10, 8)]
    plain = cost_recipe("gpt", machine, "tp=8,pp=2,mbs=2", batch=BATCH, sizes=sizes)
    assert got.step_time != plain.step_time
    uneven = cost_recipe("gpt", machine, "tp=8,pp=2,first_stage_layers=3,mbs=2", batch=BATCH, sizes=sizes)
    assert [(s.first, s.end) for s in uneven.stages] == [(0, 4), (4, 10)]
    with pytest.raises(ShardplanError, match="multiple of the 2 device groups"):
        cost_recipe("gpt", machine, "tp=8,pp=2,vp=2,mbs=32", batch=BATCH, sizes=sizes)


# -- command line ----------------------------------------------------------------------------------------
MODEL = ["--model", "gpt"] + [x for k, v in SIZES.items() for x in ("--set", f"{k}={v}")]


def test_cli_recipe(capsys, tmp_path):
    out = tmp_path / "r.json"
    assert main(["recipe", *MODEL, "-p", "16", "--machine", "a100", "--batch", "32",
                 "--recipe", "tp=8,pp=2,mbs=2,recompute=full", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Recipe: tp=8,pp=2,mbs=2,recompute=full" in text and "Step time" in text and "Breakdown" in text
    assert Plan.from_json(out.read_text()).solver == "recipe"


@pytest.mark.parametrize("recipe", ["tp=1,sp=true", "tp=0", "tp=8,bogus=1", "tp=3"])
def test_cli_bad_recipe_one_line_exit_2(capsys, recipe):
    for cmd in ("recipe", "plan"):
        assert main([cmd, *MODEL, "-p", "16", "--machine", "a100", "--batch", "32", "--recipe", recipe]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("shardplan: error: ")


def test_cli_plan_compares_with_the_recipe(capsys):
    assert main(["plan", *MODEL, "-p", "8", "--machine", "a100", "--recipe", "tp=4,mbs=4,gbs=16"]) == 0
    text = capsys.readouterr().out
    assert "Against recipe:" in text and "as fast" in text and "tp=4,mbs=4,gbs=16" in text


def test_interleaved_memory_is_the_device_groups():
    """Each device group holds its v chunks: the plan's peak is a group's, not one chunk's."""
    machine = preset("a100", 16)
    got = cost_recipe("gpt", machine, "tp=8,pp=2,vp=2,mbs=2", batch=BATCH, sizes={**SIZES, "layers": 8})
    pp = got.detail.plan
    groups = [sum(s.cost.weight_bytes for s in pp.stages[d::2])
              + pp.stages[d].in_flight * sum(s.cost.activation_bytes for s in pp.stages[d::2]) for d in range(2)]
    assert got.memory["peak_bytes"] == pytest.approx(max(groups), rel=1e-12)
    assert got.memory["peak_bytes"] > max(s.memory["peak_bytes"] for s in got.stages)
