"""A plan saved to JSON and loaded again rebuilds on its program with every choice it made: layouts, ZeRO
stages, recomputation, FP8 products and host offload, under the precision rules it was costed with; step time
and memory equal the plan's."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shardplan.cost import build_tables
from shardplan.errors import ShardplanError
from shardplan.fit import FitOptions, plan_with_choices
from shardplan.machine import preset
from shardplan.models import get_model
from shardplan.planner import choices_of, from_spmd, plan, spmd_of
from shardplan.recipe import cost_recipe
from shardplan.result import Plan
from shardplan.spmd import plan_from_configs

ALL = ("optimizer", "parameters", "activations")


def gpt(batch: int = 8):
    return get_model("gpt", batch, layers=1)


def assert_rebuilt(p: Plan) -> None:
    """Round trip through JSON, rebuild on the program, and compare everything the plan states."""
    q = Plan.from_json(p.to_json())
    assert q == p and q.detail is None
    sp = spmd_of(q, gpt(p.batch))
    assert sp.cost == pytest.approx(p.step_time, rel=1e-12)
    mem, parts = sp.memory, sp.breakdown
    for k, v in p.memory.items():
        assert mem[k] == pytest.approx(v, rel=1e-12), k
    assert set(parts) == set(p.breakdown)
    for k, v in p.breakdown.items():
        assert parts[k] == pytest.approx(v, rel=1e-12, abs=1e-18), k
    assert choices_of(sp) == dict(p.stages[0].operators)  # layouts, stages, recompute, fp8, offload, seconds
    again = from_spmd(sp, model=p.model, batch=p.batch)
    assert again.stages[0] == p.stages[0] and again.stats["memory_rules"] == p.stats["memory_rules"]


@pytest.fixture(scope="module")
def searched() -> Plan:
    """The fit search under a tight budget with mixed-precision state, FP8 and every offload offered: it picks
    FP8 products, optimizer and parameter offload at ZeRO-3 and activation offload."""
    opts = FitOptions(micro_batches=(1,), fp8=True, offload=ALL, master_weights=True)
    return plan("gpt", preset("h100", 8), sizes={"layers": 1}, batch=8, stages=False, fit_options=opts, budget=4e8)


def test_a_searched_plan_with_fp8_and_offload_rebuilds_exactly(searched):
    ops = searched.operators.values()
    assert any(c.fp8 for c in ops)
    assert {x for c in ops for x in c.offload} == set(ALL)
    assert searched.stats["memory_rules"]["master_weights"]
    assert_rebuilt(searched)


def test_the_backward_peak_a_reserve_and_parts_offered_but_not_taken_rebuild_exactly():
    """The backward-peak model with reserved bytes; offload offered but taken by no operator: the plan's
    breakdown and memory still list it (zero), and so does the rebuilt one."""
    opts = FitOptions(micro_batches=(1,), fp8=True, offload=("activations",), grad_buffers="backward",
                      reserve_bytes=1e7)
    p = plan("gpt", preset("h100", 8), sizes={"layers": 1}, batch=8, stages=False, fit_options=opts, budget=6e8)
    rules = p.stats["memory_rules"]
    assert rules["backward_peak"] and rules["reserve_bytes"] == 1e7 and "peak_step" in p.memory
    assert not any(c.offload for c in p.operators.values()) and p.breakdown["offload"] == 0.0
    assert p.memory["host_bytes"] == 0.0
    assert_rebuilt(p)


def test_the_rebuild_is_refused_without_the_recorded_choices(searched):
    """What the loaded plan's choices change: without them its step time is not its choices' (refused), and
    without the precision rules neither (the optimizer step of the operators whose state stays on the device
    moves 14 bytes per parameter instead of the master weights' 28: refused too)."""
    q = Plan.from_json(searched.to_json())
    plain = {n: replace(c, fp8=False, offload=()) for n, c in q.stages[0].operators.items()}
    stripped = replace(q, stages=(replace(q.stages[0], operators=plain),))
    with pytest.raises(ShardplanError, match="another program"):
        spmd_of(stripped, gpt())
    rules = {**q.stats["memory_rules"], "master_weights": False}
    with pytest.raises(ShardplanError, match="another program"):
        spmd_of(replace(q, stats={**q.stats, "memory_rules": rules}), gpt())


def test_an_offload_whose_copies_are_hidden_is_kept():
    """Activation offload whose copies the compute hides costs no time: the step time alone would not notice a
    rebuild without it, so the rebuilt plan's memory and choices are compared."""
    m = preset("h100", 8)
    tables = replace(build_tables(gpt(), replace(m, memory_bytes=None), cutoff=1), machine=m)
    dp = plan_from_configs(tables, {op.name: (8,) + (1,) * (len(op.dims) - 1) for op in gpt().operators})
    offloading = plan_with_choices(dp, offload={"softmax": ("activations",)})  # the loss's softmax: 4 KiB
    plain = plan_with_choices(dp)
    assert offloading.cost == plain.cost and offloading.memory["peak_bytes"] == plain.memory["peak_bytes"] - 4096
    p = from_spmd(offloading, model="gpt", batch=8)
    assert [n for n, c in p.operators.items() if c.offload] == ["softmax"]
    assert_rebuilt(p)


def test_a_recipe_with_fp8_master_weights_and_offload_rebuilds_exactly():
    p = cost_recipe("gpt", preset("h100", 8), "tp=2,dp=4,zero=3,precision=fp8,offload=optimizer+activations",
                    sizes={"layers": 1}, batch=8)
    assert any(c.fp8 for c in p.operators.values()) and p.stats["memory_rules"]["master_weights"]
    assert assert_rebuilt(p) is None


def test_a_recipe_with_fp8_parameters_and_current_scaling_rebuilds_exactly():
    """Weights stored in FP8 and current scaling's amax pass are the tables' rules: recorded with the plan, so
    the loaded plan costs the same (not the defaults' bytes and seconds)."""
    p = cost_recipe("gpt", preset("h100", 8), "tp=2,dp=4,zero=1,precision=fp8,fp8_params=true,"
                    "fp8_scaling=current", sizes={"layers": 1}, batch=8)
    rules = p.stats["memory_rules"]
    assert rules["fp8_params"] and rules["fp8_scaling"] == "current" and rules["fp8_saved_inputs"]
    assert assert_rebuilt(p) is None
    plain = cost_recipe("gpt", preset("h100", 8), "tp=2,dp=4,zero=1,precision=fp8", sizes={"layers": 1}, batch=8)
    assert plain.step_time != p.step_time and plain.memory["peak_bytes"] != p.memory["peak_bytes"]


def test_an_offload_an_operator_cannot_make_is_one_error():
    m = preset("h100", 8)
    tables = replace(build_tables(gpt(), replace(m, memory_bytes=None), cutoff=1), machine=m)
    dp = plan_from_configs(tables, {op.name: (8,) + (1,) * (len(op.dims) - 1) for op in gpt().operators})
    with pytest.raises(ShardplanError, match="cannot offload optimizer"):
        plan_with_choices(dp, stage=0, offload={"L1/q": ("optimizer",)})  # optimizer offload needs ZeRO 1-3
    with pytest.raises(ShardplanError, match="no operator"):
        plan_with_choices(dp, offload={"nope": ("activations",)})
    with pytest.raises(ShardplanError, match="not one of"):
        plan_with_choices(dp, offload={"L1/q": ("disk",)})


def test_a_pipelined_recipe_with_fp8_and_offload_rebuilds_its_stages_choices():
    """A pipeline's stages (here a recipe's: FP8, master weights, optimizer and activation offload, ZeRO-1) are
    rebuilt with their memory choices, each micro-batch one step of m: the plan made again from the rebuilt
    pipeline has every stage's operator choices, seconds included."""
    from shardplan.planner import from_pipeline, pipeline_of

    def build(batch: int):
        return get_model("gpt", batch, layers=4)

    p = cost_recipe("gpt", preset("h100", 16), "tp=2,pp=2,dp=4,zero=1,precision=fp8,offload=optimizer+activations",
                    sizes={"layers": 4}, batch=16)
    assert p.num_stages == 2 and all(any(c.fp8 for c in s.operators.values()) for s in p.stages)
    assert all(any(c.offload for c in s.operators.values()) for s in p.stages)
    q = Plan.from_json(p.to_json())
    again = from_pipeline(pipeline_of(q, build))
    assert again.step_time == p.step_time
    for s, t in zip(p.stages, again.stages):
        assert dict(t.operators) == dict(s.operators)


def test_a_plan_on_a_machine_without_host_memory_equals_itself_loaded():
    """No host memory: no host budget, recorded as None (JSON has no infinity), so the loaded plan is equal."""
    m = preset("paper", 4)
    p = plan("gpt", m, sizes={"layers": 1}, batch=8, stages=False, budget=1e10)
    assert p.stats["memory_rules"]["host_budget_bytes"] is None
    assert Plan.from_json(p.to_json()) == p
    assert_rebuilt(p)


def test_a_searched_pipeline_rebuilds_only_the_stages_that_took_memory_choices():
    """The plan records which stages carry memory choices, and the rebuilt pipeline gives each stage back exactly
    its own choices. Here both: with memory choices the time-optimal stage ranges over them, and ZeRO-3 (its
    gathers hidden under the compute at no contention, the optimizer step on the device's shard) is the fastest for
    the blocks' weights even where no budget binds (the second stage)."""
    from shardplan.pipeline.api import pipeline_solve
    from shardplan.planner import from_pipeline, pipeline_of

    def build(batch: int):
        return get_model("gpt", batch, layers=4)

    # without contention (comm_contention 0) a gather hidden under the compute costs nothing, so ZeRO-3 wins even
    # where no budget binds; with the a100 profile's 0.222 it exposes a share of each gather and need not
    free = replace(preset("a100", 16), comm_contention=0.0)
    p = from_pipeline(pipeline_solve(build, 32, free, micro_batches=(4,), sizes=(8,),
                                     memory_choices=True, cutoff=1, budget=2e9))
    which = p.stats.get("memory_choice_stages", [])
    assert p.num_stages == 2 and which == [0, 1]
    assert all(any(c.state_stage == 3 for c in s.operators.values()) for s in p.stages)
    again = from_pipeline(pipeline_of(Plan.from_json(p.to_json()), build))
    assert again.stats.get("memory_choice_stages", []) == which
    for s, t in zip(p.stages, again.stages):
        assert dict(t.operators) == dict(s.operators)
