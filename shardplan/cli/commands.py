"""The ``shardplan`` command line.

Every bad input ends as one line on stderr and exit status 2 (never a
traceback); results go to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from typing import Any, Sequence

from shardplan.cli.options import (MEMORY_OPTION_RANGE, Parser, UsageError, VersionAction, add_machine, add_model,
                                   add_progress, cutoff_of, graph_of, int_list, int_option, machine_of,
                                   micro_batch_counts, parse_procs, parse_sizes, plot_path, progress, real_option,
                                   write_file, write_json, write_text)
from shardplan.errors import ShardplanError

__all__ = ["main"]


# Solver options of `solve` and the solvers they apply to; giving one to another solver is an error.
SOLVER_OPTIONS = {
    "ordering": ("--ordering", ("dp",)),
    "table_memory": ("--table-memory", ("dp", "bfs-dp", "ilp")),  # with --model it also limits the build
    "time_limit": ("--time-limit", ("ilp",)),
    "seed": ("--seed", ("mcmc",)),
}
# Options of `solve` that describe a model (and its machine); a problem file already has its costs.
MODEL_OPTIONS = {
    "batch": "--batch", "set": "--set", "cutoff": "--cutoff", "orders": "--orders", "all_divisors": "--all-divisors",
    "procs": "-p/--procs", "machine": "--machine", "flops": "--flops", "bandwidth": "--bandwidth",
    "latency": "--latency", "dtype": "--dtype", "no_baselines": "--no-baselines", "dot": "--dot",
    "memory": "--memory", "fit": "--fit",
}


# Options of `solve` that only the memory search (--memory/--fit) reads.
FIT_OPTIONS = {"zero": "--zero", "micro_batches": "--micro-batches", "reserve": "--reserve",
               "grad_buffers": "--grad-buffers", "no_recompute": "--no-recompute", "work_limit": "--work-limit"}


def _check_applicable(args: argparse.Namespace) -> None:
    """Refuse options that would be silently ignored: model options with --problem, another solver's options,
    the memory search's options without --memory/--fit."""
    if not args.fit and args.memory is None:
        given = [flag for key, flag in FIT_OPTIONS.items() if getattr(args, key) not in (None, False)]
        if given:
            raise ShardplanError(f"{given[0]} does not apply without --memory GiB or --fit (it is an option of "
                                 "the memory search)")
    if args.problem is not None:
        given = [flag for key, flag in MODEL_OPTIONS.items() if getattr(args, key, None) not in (None, False)]
        if given:
            raise ShardplanError(f"{given[0]} does not apply to --problem (a problem file already holds its costs); "
                                 "it needs --model")
    for key, (flag, solvers) in SOLVER_OPTIONS.items():
        if key == "table_memory" and args.model is not None:
            continue
        if key == "time_limit" and args.model is not None and (args.fit or args.memory is not None):
            continue  # the fit search's wall-clock limit (per micro-batch count), when asked for
        if getattr(args, key) is not None and args.solver not in solvers:
            also = "; or to the fit search, with --fit/--memory" if key == "time_limit" else ""
            raise ShardplanError(f"{flag} does not apply to --solver {args.solver} (only to {', '.join(solvers)}{also})")


def _solver_opts(args: argparse.Namespace) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    if args.solver in ("dp",):
        if args.ordering is not None:
            opts["ordering"] = args.ordering
        opts["progress"] = progress("eliminating vertices", args.progress)
    if args.solver in ("dp", "bfs-dp", "ilp") and args.table_memory is not None:
        opts["memory_limit_bytes"] = int(args.table_memory)
    if args.solver == "ilp":
        opts["time_limit"] = 60.0 if args.time_limit is None else args.time_limit
    if args.solver == "mcmc":
        opts["seed"] = 0 if args.seed is None else args.seed
    return opts


# --------------------------------------------------------------------------- commands
def cmd_models(args: argparse.Namespace) -> int:
    from shardplan.models import models_table

    print(models_table())
    return 0


def cmd_ops(args: argparse.Namespace) -> int:
    from shardplan.baselines import batch_dim, nearest_valid
    from shardplan.configs import configurations, dimension_orders, layouts
    from shardplan.cost import operator_cost
    from shardplan.table import format_table
    from shardplan.units import fmt_seconds

    spec, g = graph_of(args)
    m = machine_of(args, args.procs)
    cutoff = cutoff_of(args, spec)
    print(f"{g.name}: {len(g.operators)} operators, {len(g.edges)} edges; p = {m.num_devices}, cutoff {cutoff}")
    hier = len(m.levels) > 1
    rows = []
    for op in g.operators:
        c = configurations(op, m.num_devices, cutoff, divides_p=not args.all_divisors)
        c2 = dimension_orders(c, "all")[0] if not hier else layouts(op, m.levels, cutoff)
        b = batch_dim(op)
        dp = nearest_valid(op, c, {b: m.num_devices} if b else {})
        t = operator_cost(op, [dp], m).total[0]
        rows.append((op.name, op.kind, op.label, "x".join(str(e) for _, e in op.dims), str(len(c)), str(len(c2)),
                     fmt_seconds(float(t))))
    print(format_table(rows, ("operator", "kind", "dims", "extents", "configs",
                              "layouts" if hier else "with orders", "data-parallel t_l"), right=(), rule=False))
    return 0


def _solve_model(args: argparse.Namespace) -> int:
    from shardplan.baselines import baseline_plans
    from shardplan.cost import build_tables
    from shardplan.spmd import solve_tables
    from shardplan.report import plan_to_dot, plan_to_json, render_report

    spec, g = graph_of(args)
    m = machine_of(args, args.procs)
    t0 = time.perf_counter()
    fit = args.memory is not None or args.fit
    opts = _fit_options(args, args.batch if args.batch is not None else spec.batch) if fit else None
    if args.memory is not None:
        m = replace(m, memory_bytes=args.memory * 2**30)
    # A fit search offers sharded state, so it must not drop configurations by their unsharded footprint.
    tables = build_tables(g, replace(m, memory_bytes=None) if fit else m, cutoff=cutoff_of(args, spec),
                          orders=args.orders or "auto", divides_p=not args.all_divisors,
                          progress=progress("building cost tables", args.progress),
                          memory_limit_bytes=None if args.table_memory is None else int(args.table_memory))
    tables = replace(tables, machine=m)
    build = time.perf_counter() - t0
    if args.memory is not None or args.fit:
        plan = replace(_solve_fit(args, g, m, tables, opts), build_seconds=build)
    else:
        plan = solve_tables(tables, solver=args.solver, build_seconds=build, **_solver_opts(args))
    baselines = {} if args.no_baselines else baseline_plans(tables, spec.expert)
    print(render_report(plan, baselines))
    if args.json:
        from shardplan.planner import from_spmd

        # the one plan format (Plan.from_json loads it), with the baselines' costs beside it
        doc = from_spmd(plan, model=spec.name).to_dict()
        doc["baselines"] = plan_to_json(plan, baselines).get("baselines", {})
        write_json(args.json, doc)
    if args.dot:
        write_text(args.dot, plan_to_dot(plan))
    return 0


def _fit_options(args: argparse.Namespace, batch: int):
    """The memory search's options (checked before any table is built)."""
    from shardplan.fit import FitOptions

    if args.solver != "dp":
        raise ShardplanError(f"--memory/--fit search with the exact DP; --solver {args.solver} cannot be combined")
    zero = "0,1,2,3" if args.zero is None else args.zero
    return FitOptions(stages=int_list(zero, "--zero", 0) or (0,), recompute=not args.no_recompute,
                      micro_batches=micro_batch_counts(args.micro_batches, batch),
                      time_limit=args.time_limit,
                      **({} if args.work_limit is None else {"work_limit": args.work_limit}),
                      reserve_bytes=(args.reserve or 0.0) * 2**30, grad_buffers=args.grad_buffers or "persistent")


def _solve_fit(args: argparse.Namespace, g, m, tables, opts):
    from shardplan.fit import solve_fit

    if m.memory_bytes is None:
        raise ShardplanError(f"machine {m.name!r} has no memory size: give --memory GiB")
    return solve_fit(g, m, budget=m.memory_bytes, options=opts, tables=tables,
                     ordering=args.ordering or "min-table")


def _solve_problem(args: argparse.Namespace) -> int:
    from shardplan.search import SOLVERS, load_problem, solution_to_dict
    from shardplan.units import fmt_seconds

    problem = load_problem(args.problem)
    sol = SOLVERS[args.solver](problem, **_solver_opts(args))
    out = solution_to_dict(problem, sol)
    print(f"{args.problem}: {problem.num_vertices} vertices, {len(problem.edges)} edges; solver {sol.solver}")
    print(f"cost {out['cost']:.9g}  ({_optimality(sol)}), solved in {fmt_seconds(sol.solve_seconds)}")
    if args.json:
        write_json(args.json, out)
    else:
        print(json.dumps(out["configs"]))
    return 0


def _optimality(sol) -> str:
    """How far the answer is proven: the checks of :func:`shardplan.search.problem.certify`, in words."""
    cert = sol.stats.get("certificate") or {}
    if sol.optimal:
        if cert.get("rel_gap") is not None:
            return (f"optimal: cost and the solver's value of the optimum agree to relative "
                    f"{cert['rel_gap']:.2g} <= {cert['rtol']:g}; no single change improves it")
        return "optimal"
    if cert.get("failed"):
        return f"NOT proven optimal: {cert['failed']}"
    return "not proven optimal"


def cmd_solve(args: argparse.Namespace) -> int:
    if (args.model is None) == (args.problem is None):
        raise ShardplanError("solve needs exactly one of --model NAME or --problem FILE")
    _check_applicable(args)
    if args.model is not None:
        if args.procs is None:
            raise ShardplanError("solve --model needs -p/--procs (number of devices)")
        return _solve_model(args)
    return _solve_problem(args)


def cmd_export_problem(args: argparse.Namespace) -> int:
    from shardplan.cost import build_tables
    from shardplan.search import problem_to_dict

    spec, g = graph_of(args)
    m = machine_of(args, args.procs)
    tables = build_tables(g, m, cutoff=cutoff_of(args, spec), orders=args.orders or "auto",
                          divides_p=not args.all_divisors,
                          progress=progress("building cost tables", args.progress),
                          memory_limit_bytes=None if args.table_memory is None else int(args.table_memory))
    problem = tables.to_problem()
    write_text(args.output, json.dumps(problem_to_dict(problem)))
    print(f"wrote {args.output}: {problem.num_vertices} vertices, {len(problem.edges)} edges, "
          f"{sum(problem.sizes)} configurations")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from shardplan.bench import run_table1

    models = [s.strip() for s in args.models.split(",") if s.strip()]
    if not models:
        raise ShardplanError(f"--models expects a comma-separated list of model names, got {args.models!r}")
    if args.no_bfs and args.bfs_memory is not None:
        raise ShardplanError("--bfs-memory does not apply with --no-bfs")
    result = run_table1(models, parse_procs(args.procs), machine=args.machine, orders=args.orders,
                        bfs=not args.no_bfs,
                        bfs_memory=2e9 if args.bfs_memory is None else args.bfs_memory, log=sys.stderr)
    print(result["table"])
    if args.out:
        write_json(args.out, result)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from shardplan.bench import run_compare

    machines = args.machine_list or ["paper"]
    result = run_compare(args.model, parse_procs(args.procs), machines, batch=args.batch, sizes=parse_sizes(args.set),
                         cutoff=args.cutoff, orders=args.orders, mcmc_seed=args.seed, log=sys.stderr,
                         fit=args.fit, memory=None if args.memory is None else args.memory * 2**30)
    print(result["table"])
    if args.json:
        write_json(args.json, result)
    if args.plot:
        from shardplan.report import plot_speedups

        write_file(args.plot, lambda name: plot_speedups(result["points"], name, result["title"]))
        print(f"plot: {args.plot}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from shardplan.cost import ORDERS
    from shardplan.machine import PRESETS
    from shardplan.search import SOLVERS
    from shardplan.search.ordering import ORDERINGS

    memory = real_option(*MEMORY_OPTION_RANGE, unit="B")
    ap = Parser(prog="shardplan", description="Exact search for the fastest way to split a DNN training step "
                                               "across devices (PaSE), with reports and problem files.")
    ap.add_argument("--version", action=VersionAction)
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("models", help="list the model zoo")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("ops", help="list a model's operators, dimensions and configuration counts")
    add_model(p, orders=False)
    p.add_argument("-p", "--procs", type=int_option(1), default=8, help="number of devices (default 8)")
    add_machine(p)
    p.set_defaults(func=cmd_ops)

    p = sub.add_parser("solve", help="find the optimal strategy of a model or a problem file")
    add_model(p, required=False)
    p.add_argument("--problem", help="a shardplan-problem/1 JSON file instead of a model")
    p.add_argument("-p", "--procs", type=int_option(1), help="number of devices")
    add_machine(p)
    p.add_argument("--solver", default="dp", choices=tuple(SOLVERS))
    p.add_argument("--ordering", choices=tuple(ORDERINGS), help="DP vertex order (default min-table)")
    p.add_argument("--table-memory", type=memory,
                   help="memory limit in bytes for building the cost tables and for the DP, BFS-DP and ILP "
                        "(default 1/4 of the available memory)")
    p.add_argument("--time-limit", type=real_option(positive=True, maximum=1e7, unit="s"),
                   help="ILP time limit, seconds (default 60); with --fit/--memory, a wall-clock limit per "
                        "micro-batch count of the fit search (default: none; with it the answer depends on the "
                        "machine's speed and load): stopped early, the plan comes with its proven bound and gap")
    p.add_argument("--work-limit", type=real_option(0.0, 1e18),
                   help="with --fit/--memory: work units per micro-batch count of the fit search (default 6e7, "
                        "about a minute of one idle core; counted, not timed, so the answer is the same on any "
                        "machine and load): stopped early, the plan comes with its proven bound and gap")
    p.add_argument("--seed", type=int_option(0, 2**63 - 1), help="MCMC seed (default 0)")
    p.add_argument("--no-baselines", action="store_true", default=None, help="skip the baseline comparison")
    p.add_argument("--json", help="write the plan as JSON here")
    p.add_argument("--dot", help="write the plan as Graphviz DOT here")
    p.add_argument("--memory", type=real_option(positive=True, maximum=2.0**40, unit="GiB"), metavar="GiB",
                   help="memory per device: search the fastest plan whose peak fits (overrides the preset's)")
    p.add_argument("--fit", action="store_true", help="search the fastest plan that fits the preset's memory")
    p.add_argument("--zero", help="ZeRO stages offered with --memory/--fit (default 0,1,2,3)")
    p.add_argument("--micro-batches", help="micro-batch counts searched with --memory/--fit, each dividing the "
                                           "batch (default: those of 1,2,4,8 that divide it)")
    p.add_argument("--no-recompute", action="store_true", help="do not offer activation recomputation")
    p.add_argument("--reserve", type=real_option(0.0, 2.0**40, unit="GiB"), metavar="GiB",
                   help="memory per device kept free for transients (default 0)")
    p.add_argument("--grad-buffers", choices=("persistent", "backward"),
                   help="with --memory/--fit: 'persistent' (default) counts every weight gradient and every saved "
                        "activation at once (DDP / Megatron gradient buffers); 'backward' takes the peak over the "
                        "backward pass's steps, gradients appearing as saved activations are freed (XLA), for one "
                        "micro-batch")
    add_progress(p)
    p.set_defaults(func=cmd_solve)

    p = sub.add_parser("export-problem", help="write a model's cost tables as a problem file")
    add_model(p)
    p.add_argument("-p", "--procs", type=int_option(1), required=True, help="number of devices")
    p.add_argument("-o", "--output", required=True, help="output JSON path")
    add_machine(p)
    p.add_argument("--table-memory", type=memory,
                   help="memory limit in bytes for building the cost tables (default 1/4 of the available memory)")
    add_progress(p)
    p.set_defaults(func=cmd_export_problem)

    p = sub.add_parser("bench", help="the paper's Table I: solve time per model and device count")
    p.add_argument("--models", default="alexnet,inception_v3,rnnlm,transformer,resnet101")
    p.add_argument("--procs", default="4,8,16,32,64")
    p.add_argument("--machine", default="paper", choices=tuple(PRESETS))
    p.add_argument("--orders", default="auto", choices=ORDERS)
    p.add_argument("--no-bfs", action="store_true", help="skip the breadth-first-order DP column")
    p.add_argument("--bfs-memory", type=memory, help="table memory limit of the BFS DP, bytes (default 2e9)")
    p.add_argument("--out", help="write JSON here")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("compare", help="data parallel vs expert vs MCMC vs DP across device counts, with a plot")
    from shardplan.checks import MAX_EXTENT

    p.add_argument("--model", required=True)
    p.add_argument("--procs", default="4,8,16,32,64")
    p.add_argument("--machine", dest="machine_list", action="append", choices=tuple(PRESETS),
                   help="machine preset (repeat to compare; default paper)")
    p.add_argument("--batch", type=int_option(1, MAX_EXTENT))
    p.add_argument("--set", action="append", metavar="KEY=VALUE")
    p.add_argument("--cutoff", type=int_option(1, MAX_EXTENT))
    p.add_argument("--orders", default="auto", choices=ORDERS)
    p.add_argument("--seed", type=int_option(0, 2**63 - 1), default=0, help="MCMC seed")
    p.add_argument("--json", help="write JSON here")
    p.add_argument("--plot", type=plot_path, help="write a plot here (.png, .pdf, .svg, ...)")
    p.add_argument("--fit", action="store_true", help="add the fastest plan within the preset's memory")
    p.add_argument("--memory", type=real_option(positive=True, maximum=2.0**40, unit="GiB"), metavar="GiB",
                   help="add the fastest plan within this memory per device")
    p.set_defaults(func=cmd_compare)

    from shardplan.cli.calibrate import add_parser as add_calibrate
    from shardplan.cli.pipeline import add_parser as add_pipeline
    from shardplan.cli.plan import add_parser as add_plan
    from shardplan.cli.recipe import add_parser as add_recipe

    add_plan(sub)
    add_pipeline(sub)
    add_recipe(sub)
    add_calibrate(sub)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        args.from_process_start = argv is None  # the command line itself: its clock started with the process
        if not getattr(args, "func", None):
            parser.print_help()
            return 0
        return args.func(args)
    except UsageError as e:
        print(f"{e.prog}: error: {_one_line(str(e))}", file=sys.stderr)
        return 2
    except ShardplanError as e:
        print(f"shardplan: error: {_one_line(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("shardplan: interrupted", file=sys.stderr)
        return 130
    except MemoryError:
        print("shardplan: out of memory (try fewer devices, a larger --cutoff or --orders row-major)",
              file=sys.stderr)
        return 1
    except BrokenPipeError:  # output piped into `head` and closed early
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _one_line(message: str) -> str:
    """``message`` on one line (a message quoting user text could hold a newline)."""
    return " ".join(message.split())


if __name__ == "__main__":
    sys.exit(main())
