"""``shardplan.plan(..., recipe=)``: a recipe's costed plan is the search's first incumbent, so the answer is never
slower than the recipe, whatever the work budget; its bound stays the search's own (with the recipe's step)."""

from __future__ import annotations

import pytest

from shardplan.errors import ShardplanError
from shardplan.machine import preset
from shardplan.models import get_model
from shardplan.planner import _one_program_floor, plan
from shardplan.recipe import cost_recipe

MODEL = "llama3-tiny"  # 8 sequences; one node of 8 h100: one program with memory choices, no stages


def test_a_budget_spent_before_any_plan_answers_the_recipe_with_the_search_floor():
    machine = preset("h100", 8)
    with pytest.raises(ShardplanError, match="spent before any plan"):
        plan(MODEL, machine, work_limit=1e5)
    rec = cost_recipe(MODEL, machine, "zero=3")
    assert rec.memory["peak_bytes"] <= machine.memory_bytes
    got = plan(MODEL, machine, work_limit=1e5, recipe=rec)
    assert got.solver == "recipe" and got.step_time == rec.step_time
    assert got.stats["recipe_answered"] is True and got.stats["stopped_at_work_limit"] is True
    # nothing of the one program was proven but its work floor: the bound is that floor, below the recipe's step
    floor = _one_program_floor(get_model(MODEL, 8), machine)
    assert got.lower_bound == min(floor, rec.step_time) == floor
    assert got.gap == pytest.approx((rec.step_time - floor) / rec.step_time, rel=1e-12)


def test_a_finished_search_answers_its_own_plan_when_faster_than_the_recipe():
    machine = preset("h100", 8)
    plain = plan(MODEL, machine, work_limit=None)
    rec = cost_recipe(MODEL, machine, "zero=3")
    assert plain.step_time < rec.step_time
    got = plan(MODEL, machine, work_limit=None, recipe=rec)
    assert got.solver == plain.solver == "fit" and got.step_time == plain.step_time
    assert got.lower_bound == pytest.approx(plain.lower_bound, rel=1e-12)
    assert got.stats["recipe_answered"] is False and got.stats["recipe_step"] == rec.step_time
    assert got.stats["compared"] == {"one program": plain.step_time, "recipe": rec.step_time}


def test_a_recipe_that_does_not_fit_is_no_incumbent_and_a_plan_for_another_batch_is_refused():
    machine = preset("h100", 8)
    rec = cost_recipe(MODEL, machine, "tp=1")
    budget = rec.memory["peak_bytes"] / 2  # the zero=3 recipe fits in it: the search has plans
    assert cost_recipe(MODEL, machine, "zero=3").memory["peak_bytes"] <= budget
    got = plan(MODEL, machine, budget=budget, work_limit=None, recipe=rec)
    assert "recipe_step" not in got.stats and "over the budget" in got.stats["recipe_not_incumbent"]
    assert got.solver == "fit" and got.memory["peak_bytes"] <= budget
    with pytest.raises(ShardplanError, match="batch of 8, not 16"):
        plan(MODEL, machine, batch=16, recipe=rec)


def test_a_recipe_on_another_runtime_is_no_incumbent():
    """A recipe whose ``grad_accum`` (or ``overlap``) key costs it on another machine setting is not the same model as
    the search's: it is left out, and the answer is the search's own."""
    machine = preset("h100", 8)
    rec = cost_recipe(MODEL, machine, "zero=3,mbs=1,grad_accum=autograd")
    assert rec.machine.grad_accum_bytes == 6.0 != machine.grad_accum_bytes
    got = plan(MODEL, machine, work_limit=None, recipe=rec)
    assert "recipe_step" not in got.stats and "grad_accum" in got.stats["recipe_not_incumbent"]
    assert got.solver == "fit"


def test_a_budget_spent_in_the_uniform_pipelines_answers_the_recipe_with_both_floors():
    from shardplan.models import model_spec
    from shardplan.planner import _pipeline_floor, micro_batch_counts

    machine = preset("h100", 16)  # two nodes: the uniform pipelines are costed first
    with pytest.raises(ShardplanError, match="spent before any plan"):
        plan(MODEL, machine, work_limit=1e4)
    rec = cost_recipe(MODEL, machine, "tp=2")
    got = plan(MODEL, machine, work_limit=1e4, recipe=rec)
    assert got.solver == "recipe" and got.step_time == rec.step_time and got.stats["recipe_answered"] is True
    assert got.stats["stopped_at_work_limit"] is True and got.stats["stages_searched"] is False
    assert "pipelines: interrupted in the uniform pipelines before any plan, not searched" in got.stats["refused"]
    build = model_spec(MODEL).build
    floors = (_one_program_floor(get_model(MODEL, 8), machine),
              _pipeline_floor(None, build, 8, machine, micro_batch_counts(None, 8)))
    assert got.lower_bound == pytest.approx(min(*floors, rec.step_time), rel=1e-12)
    assert got.lower_bound < rec.step_time


def test_the_command_hands_its_recipe_to_the_search(capsys):
    """``shardplan plan --recipe``: a budget spent before any plan answers the recipe (exit 0), as the API does,
    where the same command without ``--recipe`` is the one-line error."""
    from shardplan.cli import main

    base = ["plan", "--model", MODEL, "-p", "8", "--machine", "h100", "--work-limit", "1e5"]
    assert main(base) == 2
    capsys.readouterr()
    assert main([*base, "--recipe", "zero=3"]) == 0
    out = capsys.readouterr().out
    assert "Recipe compared: zero=3" in out


def test_the_command_searches_on_the_recipes_runtime(capsys):
    """``shardplan plan --recipe`` with a runtime key (``grad_accum=autograd``): the API leaves such a recipe out
    (above); the command searches on the recipe's runtime instead, so the recipe is the incumbent and a budget spent
    before any plan answers it (exit 0)."""
    from shardplan.cli import main

    base = ["plan", "--model", MODEL, "-p", "8", "--machine", "h100", "--work-limit", "1e5"]
    assert main([*base, "--recipe", "zero=3,mbs=1,grad_accum=autograd"]) == 0
    out = capsys.readouterr()
    assert "searching on the recipe's runtime" in out.err and "grad_accum_bytes=6" in out.err
    assert "Recipe compared: zero=3" in out.out
