"""``shardplan pipeline``: the stage search on a zoo model, its report, JSON and timeline picture."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from shardplan.cli.options import (add_machine, add_model, cutoff_of, int_list, int_option, machine_of,
                                   micro_batch_counts, parse_sizes, real_option, write_file, write_text)
from shardplan.errors import ShardplanError

__all__ = ["add_parser", "cmd_pipeline"]


def cmd_pipeline(args: argparse.Namespace) -> int:
    from shardplan.models import model_spec
    from shardplan.pipeline.api import pipeline_solve
    from shardplan.pipeline.progress import Progress, terminal_writer
    from shardplan.planner import from_pipeline
    from shardplan.report.pipeline import draw_timeline, render_pipeline

    spec = model_spec(args.model)
    sizes = parse_sizes(args.set)
    batch = args.batch if args.batch is not None else spec.batch
    machine = machine_of(args, args.procs)
    opts: dict[str, Any] = {"cutoff": cutoff_of(args, spec), "orders": args.orders or "auto"}
    budget = None if args.memory is None else args.memory * 1024**3
    if not args.fit_rtol < 1.0:
        raise ShardplanError(f"--fit-rtol must be in [0, 1), got {args.fit_rtol!r}")
    if args.timeline and not args.timeline.lower().endswith((".png", ".svg")):
        raise ShardplanError(f"--timeline must end in .png or .svg, got {args.timeline!r}")
    write, end = terminal_writer()
    result = pipeline_solve(lambda b: spec.build(b, **sizes), batch, machine,
                            micro_batches=micro_batch_counts(args.micro_batches, batch),
                            max_stages=args.max_stages, uniform=args.uniform,
                            interleave=int_list(args.interleave, "--interleave"), budget=budget,
                            sizes=int_list(args.sizes, "--sizes") or None,
                            schedules=("1f1b", "interleaved") + (("zb-h1",) if args.zero_bubble else ()),
                            memory_choices=args.memory_choices, fit_rtol=args.fit_rtol,
                            fit_time_limit=args.fit_time_limit, fit_work_limit=args.fit_work_limit,
                            progress=Progress(write), **opts)
    end()
    if result.plan.stats.get("interrupted"):
        print("interrupted: the best plan found so far, with the bound the search proved (finished parts, and the "
              "unfinished parts' floors)", file=sys.stderr)
    print(render_pipeline(result))
    if args.json:
        write_text(args.json, from_pipeline(result).to_json() + "\n")
        print(f"json: {args.json}")
    if args.timeline:
        write_file(args.timeline, lambda name: draw_timeline(result, name))
        print(f"timeline: {args.timeline}")
    return 0


def add_parser(sub: Any) -> None:
    """Register the ``pipeline`` subcommand on the CLI's subparsers."""
    from shardplan.search.constrained import WORK_LIMIT

    p = sub.add_parser("pipeline", help="search pipeline stages x sub-meshes x micro-batches x schedule")
    add_model(p)
    p.add_argument("-p", "--procs", type=int_option(1), required=True, help="number of devices")
    add_machine(p)
    p.add_argument("--micro-batches", help="micro-batch counts searched, each dividing the batch (default: those of "
                                             "1,2,4,8 that divide it)")
    p.add_argument("--max-stages", type=int_option(1), help="largest number of stages (default: one per block)")
    p.add_argument("--uniform", action="store_true", help="only stages of equal sub-mesh size")
    p.add_argument("--interleave", help="chunk counts v to try with interleaved 1F1B, e.g. 2,4")
    p.add_argument("--zero-bubble", action="store_true",
                   help="also try ZB-H1 (backward split into input- and weight-gradient passes)")
    p.add_argument("--memory-choices", action=argparse.BooleanOptionalAction, default=True,
                   help="a stage (interleaved: a device group) whose time-optimal plan does not fit takes its "
                        "memory-constrained optimum, sharding state (ZeRO/FSDP) or recomputing (default: on; "
                        "--no-memory-choices: such a stage is infeasible)")
    p.add_argument("--fit-rtol", type=real_option(0.0, 1.0), default=1e-9,
                   help="relative tolerance of each memory-constrained stage solve (default 1e-9: exact; the plan's "
                        "lower bound and gap say what was proven)")
    p.add_argument("--fit-work-limit", type=real_option(0.0, 1e18), default=WORK_LIMIT,
                   help=f"work units per memory-constrained stage solve (default {WORK_LIMIT:g}, about a minute "
                        "of one idle core; counted, not timed, so the answer is the same on any machine and load; "
                        "a stopped solve is counted and widens the gap)")
    p.add_argument("--fit-time-limit", type=real_option(positive=True, maximum=1e7, unit="s"), default=None,
                   help="also stop each memory-constrained stage solve after this many seconds of wall time "
                        "(default: none; with it the answer depends on the machine's speed and load)")
    p.add_argument("--sizes", help="sub-mesh sizes allowed (default: powers of two in a node, whole nodes)")
    p.add_argument("--memory", type=real_option(positive=True, maximum=2.0**40, unit="GiB"), metavar="GiB",
                   help="memory budget per device, GiB (default: the machine's)")
    p.add_argument("--json", help="write the pipeline plan as JSON here")
    p.add_argument("--timeline", help="draw the schedule's timeline here (.png or .svg)")
    p.set_defaults(func=cmd_pipeline)
