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
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

import shardplan
from shardplan.errors import ShardplanError

__all__ = ["main"]


# --------------------------------------------------------------------------- helpers
def _progress(label: str) -> Callable[[int, int], None] | None:
    """A stderr progress line for long steps (only on a terminal)."""
    if not sys.stderr.isatty():
        return None
    start = time.perf_counter()

    def show(i: int, n: int) -> None:
        if time.perf_counter() - start < 0.5 and i < n:
            return
        end = "\n" if i >= n else ""
        sys.stderr.write(f"\r{label} {i}/{n}{end}")
        sys.stderr.flush()

    return show


def _parse_sizes(items: Sequence[str] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items or ():
        if "=" not in item:
            raise ShardplanError(f"--set expects KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        try:
            out[k.strip()] = int(v)
        except ValueError:
            try:
                out[k.strip()] = float(v)
            except ValueError:
                out[k.strip()] = v
    return out


def _procs(text: str) -> list[int]:
    try:
        ps = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ShardplanError(f"--procs expects a comma-separated list of integers, got {text!r}") from None
    if not ps or any(p < 1 for p in ps):
        raise ShardplanError(f"--procs needs positive device counts, got {text!r}")
    return ps


def _machine(args: argparse.Namespace, p: int, preset_name: str | None = None):
    from shardplan.machine import DTYPE_BYTES, preset

    if p < 1:
        raise ShardplanError(f"number of devices must be at least 1, got {p}")
    m = preset(preset_name or args.machine, p)
    over: dict[str, Any] = {}
    if getattr(args, "flops", None) is not None:
        over["peak_flops"] = args.flops
    if getattr(args, "bandwidth", None) is not None:
        over["bandwidth"] = args.bandwidth
    if getattr(args, "latency", None) is not None:
        over["latency"] = args.latency
    if getattr(args, "dtype", None) is not None:
        over["dtype_bytes"] = DTYPE_BYTES[args.dtype]
    return replace(m, **over) if over else m


def _graph(args: argparse.Namespace):
    from shardplan.models import model_spec

    spec = model_spec(args.model)
    return spec, spec.build(args.batch, **_parse_sizes(args.set))


def _cutoff(args: argparse.Namespace, spec) -> int:
    return args.cutoff if args.cutoff is not None else spec.cutoff


def _write_json(path: str, data: Any) -> None:
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=2) + "\n")
    except OSError as e:
        raise ShardplanError(f"cannot write {path}: {e.strerror}") from None


def _solver_opts(args: argparse.Namespace) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    if args.solver in ("dp",):
        opts["ordering"] = args.ordering
        prog = _progress("eliminating vertices")
        if prog is not None:
            opts["progress"] = prog
        if args.table_memory is not None:
            opts["memory_limit_bytes"] = int(args.table_memory)
    if args.solver == "bfs-dp" and args.table_memory is not None:
        opts["memory_limit_bytes"] = int(args.table_memory)
    if args.solver == "ilp":
        opts["time_limit"] = args.time_limit
    if args.solver == "mcmc":
        opts["seed"] = args.seed
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
    from shardplan.report import format_table
    from shardplan.units import fmt_seconds

    spec, g = _graph(args)
    m = _machine(args, args.procs)
    cutoff = _cutoff(args, spec)
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
    from shardplan.plan import solve_tables
    from shardplan.report import plan_to_dot, plan_to_json, render_report

    spec, g = _graph(args)
    m = _machine(args, args.procs)
    t0 = time.perf_counter()
    tables = build_tables(g, m, cutoff=_cutoff(args, spec), orders=args.orders, divides_p=not args.all_divisors,
                          progress=_progress("costing edges"))
    build = time.perf_counter() - t0
    plan = solve_tables(tables, solver=args.solver, build_seconds=build, **_solver_opts(args))
    baselines = {} if args.no_baselines else baseline_plans(tables, spec.expert)
    print(render_report(plan, baselines))
    if args.json:
        _write_json(args.json, plan_to_json(plan, baselines))
    if args.dot:
        try:
            Path(args.dot).write_text(plan_to_dot(plan))
        except OSError as e:
            raise ShardplanError(f"cannot write {args.dot}: {e.strerror}") from None
    return 0


def _solve_problem(args: argparse.Namespace) -> int:
    from shardplan.search import SOLVERS, load_problem, solution_to_dict
    from shardplan.units import fmt_seconds

    problem = load_problem(args.problem)
    sol = SOLVERS[args.solver](problem, **_solver_opts(args))
    out = solution_to_dict(problem, sol)
    print(f"{args.problem}: {problem.num_vertices} vertices, {len(problem.edges)} edges; solver {sol.solver}")
    print(f"cost {out['cost']:.9g}  ({'optimal' if sol.optimal else 'not proven optimal'}), "
          f"solved in {fmt_seconds(sol.solve_seconds)}")
    if args.json:
        _write_json(args.json, out)
    else:
        print(json.dumps(out["configs"]))
    return 0


def cmd_solve(args: argparse.Namespace) -> int:
    if (args.model is None) == (args.problem is None):
        raise ShardplanError("solve needs exactly one of --model NAME or --problem FILE")
    if args.model is not None:
        if args.procs is None:
            raise ShardplanError("solve --model needs -p/--procs (number of devices)")
        return _solve_model(args)
    return _solve_problem(args)


def cmd_export_problem(args: argparse.Namespace) -> int:
    from shardplan.cost import build_tables
    from shardplan.search import save_problem

    spec, g = _graph(args)
    m = _machine(args, args.procs)
    tables = build_tables(g, m, cutoff=_cutoff(args, spec), orders=args.orders, divides_p=not args.all_divisors,
                          progress=_progress("costing edges"))
    problem = tables.to_problem()
    try:
        save_problem(problem, args.output)
    except OSError as e:
        raise ShardplanError(f"cannot write {args.output}: {e.strerror}") from None
    print(f"wrote {args.output}: {problem.num_vertices} vertices, {len(problem.edges)} edges, "
          f"{sum(problem.sizes)} configurations")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from shardplan.bench import run_table1

    models = [s.strip() for s in args.models.split(",") if s.strip()]
    result = run_table1(models, _procs(args.procs), machine=args.machine, orders=args.orders,
                        bfs=not args.no_bfs, bfs_memory=args.bfs_memory, log=sys.stderr)
    print(result["table"])
    if args.out:
        _write_json(args.out, result)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from shardplan.bench import run_compare

    machines = args.machine_list or ["paper"]
    result = run_compare(args.model, _procs(args.procs), machines, batch=args.batch, sizes=_parse_sizes(args.set),
                         cutoff=args.cutoff, orders=args.orders, mcmc_seed=args.seed, log=sys.stderr)
    print(result["table"])
    if args.json:
        _write_json(args.json, result)
    if args.plot:
        from shardplan.report import plot_speedups

        try:
            plot_speedups(result["points"], args.plot, result["title"])
        except OSError as e:
            raise ShardplanError(f"cannot write {args.plot}: {e.strerror}") from None
        print(f"plot: {args.plot}")
    return 0


# --------------------------------------------------------------------------- parser
class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line on stderr and exit status 2, like every other error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _add_machine(p: argparse.ArgumentParser) -> None:
    from shardplan.machine import DTYPE_BYTES, PRESETS

    p.add_argument("--machine", default="paper", choices=tuple(PRESETS),
                   help="machine preset (default paper: 10 TFLOP/s, 16 GB/s)")
    p.add_argument("--flops", type=float, help="override peak FLOP/s per device")
    p.add_argument("--bandwidth", type=float, help="override link bandwidth, bytes/s")
    p.add_argument("--latency", type=float, help="override link latency, seconds")
    p.add_argument("--dtype", choices=tuple(DTYPE_BYTES), help="element type")


def _add_model(p: argparse.ArgumentParser, required: bool = True) -> None:
    from shardplan.cost import ORDERS

    p.add_argument("--model", required=required, help="zoo model name (see `shardplan models`)")
    p.add_argument("--batch", type=int, help="batch size (default: the model's)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="model size, e.g. --set layers=12")
    p.add_argument("--cutoff", type=int, help="minimum points per part (default: the model's, 4 CNNs / 1 sequence)")
    p.add_argument("--orders", default="auto", choices=ORDERS,
                   help="device-grid nestings offered per configuration (default auto: all while small)")
    p.add_argument("--all-divisors", action="store_true",
                   help="also allow configurations whose device count does not divide p (idle devices)")


def build_parser() -> argparse.ArgumentParser:
    from shardplan.cost import ORDERS
    from shardplan.machine import PRESETS
    from shardplan.search import SOLVERS
    from shardplan.search.ordering import ORDERINGS

    ap = _Parser(prog="shardplan", description="Exact search for the fastest way to split a DNN training step "
                                               "across devices (PaSE), with reports and problem files.")
    ap.add_argument("--version", action="version", version=f"shardplan {shardplan.__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("models", help="list the model zoo")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("ops", help="list a model's operators, dimensions and configuration counts")
    _add_model(p)
    p.add_argument("-p", "--procs", type=int, default=8, help="number of devices (default 8)")
    _add_machine(p)
    p.set_defaults(func=cmd_ops)

    p = sub.add_parser("solve", help="find the optimal strategy of a model or a problem file")
    _add_model(p, required=False)
    p.add_argument("--problem", help="a shardplan-problem/1 JSON file instead of a model")
    p.add_argument("-p", "--procs", type=int, help="number of devices")
    _add_machine(p)
    p.add_argument("--solver", default="dp", choices=tuple(SOLVERS))
    p.add_argument("--ordering", default="min-table", choices=tuple(ORDERINGS), help="DP vertex order")
    p.add_argument("--table-memory", type=float, help="DP table memory limit in bytes (default 1/4 of RAM)")
    p.add_argument("--time-limit", type=float, default=60.0, help="ILP time limit, seconds (default 60)")
    p.add_argument("--seed", type=int, default=0, help="MCMC seed")
    p.add_argument("--no-baselines", action="store_true", help="skip the baseline comparison")
    p.add_argument("--json", help="write the plan as JSON here")
    p.add_argument("--dot", help="write the plan as Graphviz DOT here")
    p.set_defaults(func=cmd_solve)

    p = sub.add_parser("export-problem", help="write a model's cost tables as a problem file")
    _add_model(p)
    p.add_argument("-p", "--procs", type=int, required=True, help="number of devices")
    p.add_argument("-o", "--output", required=True, help="output JSON path")
    _add_machine(p)
    p.set_defaults(func=cmd_export_problem)

    p = sub.add_parser("bench", help="the paper's Table I: solve time per model and device count")
    p.add_argument("--models", default="alexnet,inception_v3,rnnlm,transformer,resnet101")
    p.add_argument("--procs", default="4,8,16,32,64")
    p.add_argument("--machine", default="paper", choices=tuple(PRESETS))
    p.add_argument("--orders", default="auto", choices=ORDERS)
    p.add_argument("--no-bfs", action="store_true", help="skip the breadth-first-order DP column")
    p.add_argument("--bfs-memory", type=float, default=2e9, help="table memory limit of the BFS DP, bytes")
    p.add_argument("--out", help="write JSON here")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("compare", help="data parallel vs expert vs MCMC vs DP across device counts, with a plot")
    p.add_argument("--model", required=True)
    p.add_argument("--procs", default="4,8,16,32,64")
    p.add_argument("--machine", dest="machine_list", action="append", choices=tuple(PRESETS),
                   help="machine preset (repeat to compare; default paper)")
    p.add_argument("--batch", type=int)
    p.add_argument("--set", action="append", metavar="KEY=VALUE")
    p.add_argument("--cutoff", type=int)
    p.add_argument("--orders", default="auto", choices=ORDERS)
    p.add_argument("--seed", type=int, default=0, help="MCMC seed")
    p.add_argument("--json", help="write JSON here")
    p.add_argument("--plot", help="write a PNG plot here")
    p.set_defaults(func=cmd_compare)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except ShardplanError as e:
        print(f"shardplan: error: {e}", file=sys.stderr)
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


if __name__ == "__main__":
    sys.exit(main())
