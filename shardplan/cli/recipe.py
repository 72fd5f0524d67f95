"""``shardplan recipe``: a configuration written as practitioners write it, costed by the search's model.

It calls :func:`shardplan.recipe.cost_recipe` and prints the recipe's report (step time, memory per device,
breakdown, layouts: :func:`shardplan.report.summary.render_plan`); ``--json`` writes its plan.
"""

from __future__ import annotations

import argparse
from typing import Any

from shardplan.cli.options import add_machine, int_option, machine_of, parse_sizes, write_text

__all__ = ["add_parser", "cmd_recipe", "add_recipe_option", "recipe_of"]

RECIPE_HELP = ("a configuration as practitioners write it, e.g. 'tp=8,pp=2,mbs=4,recompute=full' (keys tp, sp, cp, "
               "pp, vp, first_stage_layers, last_stage_layers, embedding_as_layer, loss_as_layer, dp, zero/fsdp, "
               "hsdp, ep, mbs, gbs, recompute, dtype, overlap), or a JSON / key = value file holding one")


def add_recipe_option(p: argparse.ArgumentParser, required: bool) -> None:
    """The ``--recipe`` option (text or file)."""
    p.add_argument("--recipe", required=required, help=RECIPE_HELP)


def recipe_of(text: str) -> Any:
    """The :class:`~shardplan.recipe.Recipe` of ``--recipe`` (a file's when it names one)."""
    from shardplan.recipe import Recipe

    return Recipe.load(text)


def cmd_recipe(args: argparse.Namespace) -> int:
    from shardplan.recipe import cost_recipe
    from shardplan.report.summary import render_plan

    recipe = recipe_of(args.recipe)
    machine = machine_of(args, args.procs)
    plan = cost_recipe(args.model, machine, recipe, batch=args.batch, sizes=parse_sizes(args.set) or None)
    print(f"Recipe: {recipe}")
    print(render_plan(plan, operators=args.operators))
    if args.json:
        write_text(args.json, plan.to_json() + "\n")
        print(f"json: {args.json}")
    return 0


def add_parser(sub: Any) -> None:
    """Register the ``recipe`` subcommand."""
    from shardplan.checks import MAX_EXTENT

    p = sub.add_parser("recipe", help="cost a configuration written as practitioners write it (tp=8,pp=2,...) "
                                      "with the search's model")
    p.add_argument("--model", required=True, help="zoo model name (see `shardplan models`)")
    p.add_argument("--batch", type=int_option(1, MAX_EXTENT), help="global batch (default: the recipe's gbs, else "
                                                                    "the model's)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="model size, e.g. --set layers=12")
    p.add_argument("-p", "--procs", type=int_option(1), required=True, help="number of devices")
    add_machine(p)
    add_recipe_option(p, required=True)
    p.add_argument("--operators", action="store_true", help="add the per-operator table to the report")
    p.add_argument("--json", help="write the recipe's plan as JSON here (shardplan.Plan.from_json loads it)")
    p.set_defaults(func=cmd_recipe)
