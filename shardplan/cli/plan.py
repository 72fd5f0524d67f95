"""``shardplan plan``: the one planning command (layouts, memory choices and stages searched together).

It calls :func:`shardplan.planner.plan` with the options below (progress every 2 s on stderr, one line rewritten
in place on a terminal; Ctrl-C during the pipeline search prints the best plan so far) and prints the one report
(:func:`shardplan.report.summary.render_plan`); ``--json`` writes the plan that ``Plan.from_json`` loads.
``--recipe`` costs a configuration written as practitioners write it (:func:`shardplan.recipe.cost_recipe`,
before the search, so a recipe that is not expressible fails at once), hands it to the search as its first
incumbent (``plan(recipe=)``: the answer is never worse than it, and is the recipe itself when the search finds
nothing better within its budget) and the report states how the plan compares with it; the recipe's ``gbs`` is
the batch when ``--batch`` is not given. The search then runs on the recipe's runtime (its ``overlap`` and
``grad_accum`` keys, :func:`shardplan.recipe.recipe_machine`), so the plan and the recipe are costed alike.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

from shardplan.cli.options import (add_machine, add_model, int_list, int_option, machine_of, parse_sizes,
                                   real_option, write_text)
from shardplan.cli.recipe import add_recipe_option, recipe_of
from shardplan.errors import ShardplanError
from shardplan.pipeline.progress import PLAN_WORK_LIMIT

__all__ = ["add_parser", "cmd_plan"]

STAGE_CHOICES = {"auto": "auto", "on": True, "off": False}
SCHEDULE_NAMES = ("1f1b", "zb-h1", "interleaved")


def cmd_plan(args: argparse.Namespace) -> int:
    from shardplan.planner import plan
    from shardplan.report.summary import render_plan

    # the time limit counts from the process's start on the command line (imports, the model's graph and the
    # report's answer included), from this call when main() is called with arguments
    started = time.monotonic() - (_process_age() if getattr(args, "from_process_start", False) else 0.0)
    machine = machine_of(args, args.procs)
    budget = None if args.memory is None else args.memory * 2**30
    schedules = tuple(s.strip() for s in args.schedules.split(",") if s.strip())
    bad = [s for s in schedules if s not in SCHEDULE_NAMES]
    if bad or not schedules:
        raise ShardplanError(f"--schedules takes a comma-separated list of {', '.join(SCHEDULE_NAMES)}, "
                             f"got {args.schedules!r}")
    interleave = int_list(args.interleave, "--interleave", 2)
    if interleave and "interleaved" not in schedules:
        schedules += ("interleaved",)
    if not args.fit and (args.memory is not None):
        raise ShardplanError("--memory is the budget of the memory search; it does not apply with --no-fit")
    offload = tuple(s.strip() for s in (args.offload or "").split(",") if s.strip())
    if not args.fit and (args.fp8 or offload or args.master_weights):
        raise ShardplanError("--fp8, --offload and --master-weights are choices of the memory search; "
                             "they do not apply with --no-fit")
    batch, against = args.batch, None
    if args.recipe is not None:
        from shardplan.recipe import cost_recipe, recipe_machine

        recipe = recipe_of(args.recipe)
        batch = batch if batch is not None else recipe.gbs
        against = cost_recipe(args.model, machine, recipe, batch=batch, sizes=parse_sizes(args.set) or None)
        batch = against.batch
        if recipe_machine(recipe, machine) != machine:  # like for like: the search runs on the recipe's runtime
            machine = recipe_machine(recipe, machine)
            _log(f"searching on the recipe's runtime: overlap_grad={machine.overlap_grad}, "
                 f"overlap_dgrad={machine.overlap_dgrad}, grad_accum_bytes={machine.grad_accum_bytes:g}")
    from shardplan.pipeline.progress import terminal_writer

    write, end = terminal_writer()

    def log(line: str) -> None:
        end()
        _log(line)

    fit_options = None
    micro_batches = int_list(args.micro_batches, "--micro-batches") or None
    if args.fp8 or offload or args.master_weights:
        from shardplan.cost.memory import OFFLOADS
        from shardplan.fit import FitOptions
        from shardplan.models import model_spec
        from shardplan.planner import micro_batch_counts

        bad = [s for s in offload if s not in OFFLOADS]
        if bad:
            raise ShardplanError(f"--offload takes a comma-separated list of {', '.join(OFFLOADS)}, got {bad[0]!r}")
        ms = micro_batch_counts(micro_batches, batch if batch is not None else model_spec(args.model).batch)
        fit_options = FitOptions(micro_batches=ms, fp8=args.fp8, offload=offload, master_weights=args.master_weights)
    stopped: list[bool] = []  # set when the time limit, not Ctrl-C, stopped the search
    try:
        with _time_limit(args.time_limit, stopped, started):
            result = plan(args.model, machine, batch=batch, sizes=parse_sizes(args.set), budget=budget, fit=args.fit,
                      stages=STAGE_CHOICES[args.stages],
                      micro_batches=micro_batches, schedules=schedules, interleave=interleave,
                          max_stages=args.max_stages, cutoff=args.cutoff, orders=args.orders or "auto",
                          fit_options=fit_options, partial_sums=args.partial_sums, log=log, progress=write,
                          overlap_tp=args.overlap_tp, context=args.context, work_limit=args.work_limit,
                          recipe=against)
    except KeyboardInterrupt:
        end()
        _log(("time limit reached" if stopped else "interrupted") + " before any plan was found")
        return 130
    end()
    if result.stats.get("interrupted"):
        if result.stats.get("stopped_at_work_limit"):
            _log(f"work limit of {args.work_limit:.3g} units reached: the search stopped as on Ctrl-C, at the same "
                 "point on any machine and load (--work-limit none: no limit)")
        elif stopped:
            _log(f"time limit of {args.time_limit:g} s reached: the search stopped as on Ctrl-C")
        how = "stopped at the work limit" if result.stats.get("stopped_at_work_limit") else "interrupted"
        if any("interrupted in the one program" in r for r in result.stats.get("refused", ())):
            _log(f"{how} in the one program's memory search: its best plan so far, with the bound it proved; "
                 "the pipelines were not searched")
        else:
            _log(f"{how}: the best plan found so far, with the bound the search proved (finished parts, and the "
                 "unfinished parts' floors)")
    print(render_plan(result, operators=args.operators, compare=against))
    if against is not None:
        print(f"Recipe compared: {against.stats['recipe']} ({against.solver}, costed by the same model)")
    if args.json:
        write_text(args.json, result.to_json() + "\n")
        print(f"json: {args.json}")
    return 0


# the share of a time limit kept for the answer once the search stops (building its stages' plans: a stage costed
# by the certified extension is solved on its own then, docs/pipeline.md, *A bound whenever the search stops*),
# and its cap in seconds. Measured: GPT-3 175B on 64 h100, 3.8 CPU s for the 5 stage plans of the seed answer.
TIME_LIMIT_RESERVE = 0.1
TIME_LIMIT_RESERVE_CAP = 10.0


def work_limit_option(text: str) -> float | None:
    """argparse type of ``--work-limit``: ``none`` (no limit: None), else a finite number of work units >= 0 (0: no
    limit either, as :func:`shardplan.plan` takes it)."""
    if text.strip().lower() == "none":
        return None
    return real_option(0.0, 1e18, unit="")(text)


def search_deadline(seconds: float, elapsed: float) -> float:
    """Seconds from now at which a search under a wall limit of ``seconds`` (counted from a start ``elapsed``
    seconds ago) must stop so that the answer can still be built: ``seconds`` less what has elapsed less the
    reserve (``TIME_LIMIT_RESERVE`` of the limit, at most ``TIME_LIMIT_RESERVE_CAP``), and at least a
    microsecond (a limit already spent stops the search at once)."""
    reserve = min(TIME_LIMIT_RESERVE * seconds, TIME_LIMIT_RESERVE_CAP)
    return max(seconds - elapsed - reserve, 1e-6)


@contextlib.contextmanager
def _time_limit(seconds: float | None, stopped: list[bool], started: float | None = None) -> Iterator[None]:
    """Stop the search ``seconds`` of wall time after ``started`` (a :func:`time.monotonic` reading; default now)
    exactly as Ctrl-C does, a reserve early (:func:`search_deadline`): a timer (``SIGALRM``) raises
    :class:`KeyboardInterrupt` in the search, which returns the best plan found so far with the bound it proved
    (:func:`shardplan.planner.plan`). Appends True to ``stopped`` when it fires; the previous handler and timer
    are restored on exit. None: no limit."""
    if seconds is None:
        yield
        return

    def fire(signum: int, frame: Any) -> None:
        stopped.append(True)
        raise KeyboardInterrupt

    now = time.monotonic()
    previous = signal.signal(signal.SIGALRM, fire)
    try:
        signal.setitimer(signal.ITIMER_REAL, search_deadline(seconds, 0.0 if started is None else now - started))
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _process_age() -> float:
    """Seconds since this process started: its start time in /proc/self/stat (clock ticks after boot) against
    the boot clock; 0 where that is not available (not Linux)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, after the command's name
        return max(time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


def _log(line: str) -> None:
    """A search's progress line, on stderr (results go to stdout)."""
    print(line, file=sys.stderr, flush=True)


def add_parser(sub: Any) -> None:
    """Register the ``plan`` subcommand."""
    p = sub.add_parser("plan", help="the fastest plan that fits: layouts, memory choices and pipeline stages "
                                    "searched together")
    add_model(p)
    p.add_argument("-p", "--procs", type=int_option(1), required=True, help="number of devices")
    add_machine(p)
    p.add_argument("--memory", type=real_option(positive=True, maximum=2.0**40, unit="GiB"), metavar="GiB",
                   help="memory budget per device (default: the machine's)")
    p.add_argument("--fit", action=argparse.BooleanOptionalAction, default=True,
                   help="search ZeRO stages, recomputation and micro-batches under the budget (default: on; "
                        "--no-fit: layouts only, memory reported)")
    p.add_argument("--stages", choices=tuple(STAGE_CHOICES), default="auto",
                   help="pipeline stages: auto (default: when the model has repeated blocks on more than one "
                        "node), on, off")
    p.add_argument("--micro-batches", help="micro-batch counts searched (default: every count that divides the batch)")
    p.add_argument("--time-limit", type=real_option(positive=True, maximum=1e7, unit="s"), metavar="SECONDS",
                   help="end the command within this many seconds of wall time from its start: the search stops "
                        "early enough (a tenth of the limit, at most 10 s, is kept to build the answer) as "
                        "Ctrl-C does, with the best plan found so far, its proven lower bound and gap (default: "
                        "none: the search runs to its work budget, --work-limit, and its answer is the same on any "
                        "machine; with a time limit, where it stops depends on the machine's speed and load)")
    p.add_argument("--work-limit", type=work_limit_option, default=PLAN_WORK_LIMIT, metavar="UNITS",
                   help=f"the work budget of the whole search, in work units counted from the problem's sizes "
                        f"(about a CPU microsecond each on the reference machine; default {PLAN_WORK_LIMIT:.3g}): "
                        "spent, the search stops as Ctrl-C does, with the best plan so far and its proven bound "
                        "and gap, at the same point on any machine and load; 'none' or 0: no limit (the search "
                        "runs to its end, which can take hours at thousands of devices). With --time-limit, "
                        "whichever comes first")
    p.add_argument("--schedules", default="1f1b,zb-h1", help="pipeline schedules (default 1f1b,zb-h1)")
    p.add_argument("--interleave", help="chunk counts v >= 2 for interleaved 1F1B, e.g. 2,4")
    p.add_argument("--max-stages", type=int_option(1), help="largest number of stages (default: one per block)")
    p.add_argument("--partial-sums", action="store_true",
                   help="also offer layouts that defer a split reduction to its consumers (reduce-scatter / "
                        "all-reduce on the edge: Megatron-LM's sequence parallelism); about twice the layouts")
    p.add_argument("--overlap-tp", action="store_true",
                   help="let each matrix product hide one edge's collective behind its compute, in chunks "
                        "(Megatron-LM's --tp-comm-overlap, torchtitan's async TP); implies --partial-sums")
    p.add_argument("--context", choices=("allgather", "ring", "auto"), default="allgather",
                   help="how attention's products receive the keys and values their layouts share: gathered "
                        "(default), passed around a ring beside the products, or the cheaper per edge (auto)")
    p.add_argument("--fp8", action="store_true",
                   help="offer FP8 matrix products (machines with an FP8 peak; one program, not pipeline stages)")
    p.add_argument("--offload", metavar="PARTS",
                   help="parts that may live in host memory: optimizer, parameters, activations (comma-separated; "
                        "one program, not pipeline stages)")
    p.add_argument("--master-weights", action="store_true",
                   help="mixed-precision state: fp32 master weights and optimizer moments (16 bytes per parameter "
                        "with Adam)")
    p.add_argument("--operators", action="store_true", help="add the per-operator table to the report")
    p.add_argument("--json", help="write the plan as JSON here (shardplan.Plan.from_json loads it)")
    add_recipe_option(p, required=False)
    p.set_defaults(func=cmd_plan)
