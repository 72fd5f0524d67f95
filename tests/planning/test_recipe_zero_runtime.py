"""A ZeRO-3 runtime's collectives as recipe keys (``zero_regather``, ``zero_grad_reduce``): text, refusals, and
the costs against :func:`shardplan.fit.plan_with_choices` with the same rules, by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shardplan.baselines import megatron
from shardplan.cli.commands import main
from shardplan.cost import build_tables
from shardplan.errors import ShardplanError
from shardplan.fit import plan_with_choices
from shardplan.machine import preset
from shardplan.models import get_model
from shardplan.recipe import Recipe, cost_recipe
from shardplan.spmd import plan_from_configs

SIZES = {"layers": 4, "d_model": 256, "heads": 8, "seq": 64, "vocab": 1024}
BATCH = 32
DS = "zero=3,mbs=1,recompute=full,overlap=none"  # 16 devices of data parallelism


def test_text_round_trip_and_defaults():
    r = Recipe.parse("zero=3,zero_regather=true,zero_grad_reduce=allreduce,recompute=full")
    assert r.zero_regather is True and r.zero_grad_reduce == "allreduce"
    assert str(r) == "zero=3,recompute=full,zero_regather=true,zero_grad_reduce=allreduce"
    assert Recipe.parse(str(r)) == r
    assert Recipe.parse("zero-grad-reduce=reduce-scatter,zero=3").zero_grad_reduce == "reduce_scatter"
    plain = Recipe.parse("zero=3")
    assert plain.zero_regather is False and plain.zero_grad_reduce == "reduce_scatter"
    assert Recipe.from_mapping({"zero": 3, "zero_regather": True}).zero_regather is True


@pytest.mark.parametrize("text, part", [("zero=3,zero_grad_reduce=broadcast", "zero_grad_reduce must be one of"),
                                        ("zero=3,zero_regather=maybe", "zero_regather must be true or false")])
def test_bad_values_are_one_line(text, part):
    with pytest.raises(ShardplanError, match=part) as e:
        Recipe.parse(text)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("text", ["zero=2,zero_grad_reduce=allreduce", "zero_regather=true,recompute=full"])
def test_below_zero3_is_refused(text):
    with pytest.raises(ShardplanError, match="not expressible: zero_regather / zero_grad_reduce"):
        cost_recipe("gpt", preset("a100", 16), text, batch=BATCH, sizes=SIZES)


def test_costs_equal_plan_with_choices_with_the_same_rules():
    machine = replace(preset("a100", 16), overlap_grad=False)
    tables = replace(build_tables(get_model("gpt", BATCH, **SIZES), replace(machine, memory_bytes=None), cutoff=1,
                                  orders="row-major", node_replicas=True), machine=machine)
    base = plan_from_configs(tables, megatron(tables, 16))  # tp 1: data parallelism over the 16 devices
    blocks = [op.name for op in tables.graph.operators if "/" in op.name]
    for keys, rules in (("", {}), (",zero_regather=true", {"zero3_regather": True}),
                        (",zero_grad_reduce=allreduce", {"zero3_grad_allreduce": True}),
                        (",zero_regather=true,zero_grad_reduce=allreduce",
                         {"zero3_regather": True, "zero3_grad_allreduce": True})):
        got = cost_recipe("gpt", machine, DS + keys, batch=BATCH, sizes=SIZES)
        hand = plan_with_choices(base, stage=3, recompute=blocks, micro_batches=2, **rules)
        assert got.step_time == pytest.approx(hand.cost, rel=1e-12)
        assert got.memory["peak_bytes"] == pytest.approx(hand.memory["peak_bytes"], rel=1e-12)


def test_regather_charges_one_more_gather_per_recomputing_weight():
    """Nothing overlapped: the re-gather costs time, neither compute nor memory; without recomputation there is
    no second forward and nothing is gathered again."""
    machine = preset("a100", 16)
    plain = cost_recipe("gpt", machine, DS, batch=BATCH, sizes=SIZES)
    again = cost_recipe("gpt", machine, DS + ",zero_regather=true", batch=BATCH, sizes=SIZES)
    assert again.step_time > plain.step_time
    assert again.breakdown["compute"] == plain.breakdown["compute"]
    assert again.memory["peak_bytes"] == plain.memory["peak_bytes"]
    # a recipe without recomputation gathers nothing again
    none = cost_recipe("gpt", machine, "zero=3,mbs=1,overlap=none", batch=BATCH, sizes=SIZES)
    none_again = cost_recipe("gpt", machine, "zero=3,mbs=1,overlap=none,zero_regather=true", batch=BATCH,
                             sizes=SIZES)
    assert none_again.step_time == none.step_time


def test_pipeline_recipe_takes_the_keys_too():
    machine = preset("a100", 16)
    base = "pp=2,zero=3,mbs=1,recompute=full,overlap=none"
    plain = cost_recipe("gpt", machine, base, batch=BATCH, sizes=SIZES)
    both = cost_recipe("gpt", machine, base + ",zero_regather=true,zero_grad_reduce=allreduce", batch=BATCH,
                       sizes=SIZES)
    assert both.step_time != plain.step_time
    assert both.stats["recipe"].endswith("zero_regather=true,zero_grad_reduce=allreduce")


def test_cli_takes_the_keys_and_refuses_them_below_zero3(capsys):
    model = ["--model", "gpt"] + [x for k, v in SIZES.items() for x in ("--set", f"{k}={v}")]
    args = ["recipe", *model, "-p", "16", "--machine", "a100", "--batch", "32", "--recipe"]
    assert main(args + [DS + ",zero_regather=true,zero_grad_reduce=allreduce"]) == 0
    assert "zero_regather=true,zero_grad_reduce=allreduce" in capsys.readouterr().out
    assert main(args + ["zero=1,zero_grad_reduce=allreduce"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "they need zero=3" in err
