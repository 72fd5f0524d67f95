"""What the commands share: progress lines, option types, the machine and model options, atomic output.

Every option value is checked where it is parsed, so a bad one is one line and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

from shardplan.errors import ShardplanError
from shardplan.files import write_file, write_text  # noqa: F401  (the commands' writers)

__all__ = ["progress", "UsageError", "Parser", "VersionAction", "int_option", "real_option", "plot_path",
           "parse_sizes", "parse_procs", "machine_of", "graph_of", "cutoff_of", "write_file", "write_text",
           "write_json",
           "add_machine", "add_model", "add_progress", "int_list",
           "micro_batch_counts"]

PROGRESS_EVERY_TTY = 0.5  # seconds between updates of the one rewritten line on a terminal
PROGRESS_EVERY_LOG = 5.0  # seconds between progress lines when stderr is a file or a pipe


def progress(label: str, every: float | None = None,
              stream: Any = None, clock: Callable[[], float] = time.perf_counter) -> Callable[[int, int], None]:
    """A progress reporter ``show(done, total)`` for long steps, writing to stderr.

    On a terminal one line is rewritten in place (every 0.5 s); elsewhere (a
    log file, a pipe, a batch job) a full line is written every
    ``PROGRESS_EVERY_LOG`` seconds, so a long build is never silent.
    ``every`` (the ``--progress SECONDS`` option) forces full lines at that
    interval. Nothing is written for a step that ends within the first
    interval; a step that showed progress ends with its final count.
    """
    out = stream if stream is not None else sys.stderr
    tty = every is None and out.isatty()
    interval = every if every is not None else (PROGRESS_EVERY_TTY if tty else PROGRESS_EVERY_LOG)
    start = clock()
    state = {"last": start, "shown": False}

    def show(i: int, n: int) -> None:
        now = clock()
        done = i >= n
        if done and not state["shown"]:
            return
        if not done and now - state["last"] < interval:
            return
        state["last"], state["shown"] = now, True
        if tty:
            out.write(f"\r{label} {i}/{n}" + ("\n" if done else ""))
        else:
            out.write(f"{label} {i}/{n} ({now - start:.0f} s)\n")
        out.flush()

    return show


# --------------------------------------------------------------------------- option values
# Plausible hardware: the bounds keep every cost finite and non-zero (a bandwidth of
# 1e-300 B/s makes costs overflow to inf, an infinite FLOP/s makes compute free).
FLOPS_RANGE = (1e3, 1e18)  # FLOP/s per device
BANDWIDTH_RANGE = (1e3, 1e15)  # bytes/s per link
LATENCY_RANGE = (0.0, 10.0)  # seconds per message step
MEMORY_OPTION_RANGE = (1.0, 2.0**62)  # bytes, for --table-memory / --bfs-memory


class UsageError(ShardplanError):
    """A command line argparse refused (unknown option, missing value, bad value); ``prog``: which command."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(message)
        self.prog = prog


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line and exit status 2 (from :func:`main`), like every other error,
    instead of the usage text and the message."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(self.prog, f"{message} (see '{self.prog} --help')")


def installed_version() -> str:
    """The installed distribution's version, from its metadata."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("shardplan")
    except PackageNotFoundError:
        return "unknown (not installed)"


class VersionAction(argparse.Action):
    """``--version``: prints the installed version, read from the package metadata only when asked
    (importing :mod:`importlib.metadata` costs every other command ~20 ms)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS,
                 default: str = argparse.SUPPRESS, help: str = "show program's version number and exit") -> None:
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None) -> NoReturn:
        parser._print_message(f"shardplan {installed_version()}\n", sys.stdout)
        parser.exit()


def int_option(minimum: int | None = None, maximum: int | None = None) -> Callable[[str], int]:
    """argparse type: an integer in [minimum, maximum]; the message names the option (argparse adds it)."""
    from shardplan.checks import integer

    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expects an integer, got {text!r}") from None
        try:
            return integer("", value, minimum, maximum)
        except ShardplanError as e:
            raise argparse.ArgumentTypeError(str(e).strip()) from None

    parse.__name__ = "integer"
    return parse


def real_option(minimum: float | None = None, maximum: float | None = None, positive: bool = False,
                 unit: str = "") -> Callable[[str], float]:
    """argparse type: a finite number in [minimum, maximum] (NaN, inf and overflowing literals refused)."""
    from shardplan.checks import real

    def parse(text: str) -> float:
        try:
            value = float(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expects a number, got {text!r}") from None
        try:
            return real("", value, minimum, maximum, positive=positive, unit=unit)
        except ShardplanError as e:
            raise argparse.ArgumentTypeError(str(e).strip()) from None

    parse.__name__ = "number"
    return parse


def plot_path(text: str) -> str:
    """argparse type for --plot: a file name whose suffix is an image format matplotlib writes."""
    from shardplan.report.plot import plot_formats

    suffix = Path(text).suffix.lower().lstrip(".")
    formats = plot_formats()
    if suffix not in formats:
        what = f"format {suffix!r}" if suffix else "no format suffix"
        raise argparse.ArgumentTypeError(f"{text!r} has {what}; use one of .{', .'.join(formats)}")
    return text


def parse_sizes(items: Sequence[str] | None) -> dict[str, Any]:
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


def parse_procs(text: str) -> list[int]:
    try:
        ps = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ShardplanError(f"--procs expects a comma-separated list of integers, got {text!r}") from None
    if not ps or any(p < 1 for p in ps):
        raise ShardplanError(f"--procs needs positive device counts, got {text!r}")
    return ps


def machine_of(args: argparse.Namespace, p: int, preset_name: str | None = None):
    from shardplan.machine import DTYPE_BYTES, preset

    if p < 1:
        raise ShardplanError(f"number of devices must be at least 1, got {p}")
    path = getattr(args, "machine_file", None)
    if path is not None:
        if getattr(args, "machine", None) is not None:
            raise ShardplanError("give --machine or --machine-file, not both")
        from shardplan.machine import load_machine_file

        m = load_machine_file(path, p)
    else:
        m = preset(preset_name or getattr(args, "machine", None) or "paper", p)
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


def graph_of(args: argparse.Namespace):
    from shardplan.models import model_spec

    spec = model_spec(args.model)
    return spec, spec.build(args.batch, **parse_sizes(args.set))


def cutoff_of(args: argparse.Namespace, spec) -> int:
    return args.cutoff if args.cutoff is not None else spec.cutoff


def write_json(path: str, data: Any) -> None:
    """``data`` as indented JSON at ``path``, written atomically (:func:`write_text`)."""
    write_text(path, json.dumps(data, indent=2) + "\n")


def int_list(text: str | None, flag: str, least: int = 1) -> tuple[int, ...]:
    """A comma-separated list of integers >= ``least`` (empty or None: no integers)."""
    if not text or not text.strip():
        return ()
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ShardplanError(f"{flag} expects a comma-separated list of integers, got {text!r}") from None
    if not out or min(out) < least:
        raise ShardplanError(f"{flag} needs integers >= {least}, got {text!r}")
    return out


DEFAULT_MICRO_BATCHES = (1, 2, 4, 8)


def micro_batch_counts(text: str | None, batch: int, flag: str = "--micro-batches") -> tuple[int, ...]:
    """The micro-batch counts of ``flag`` for a global ``batch``: each given one must divide the batch (a
    count that does not, or one above the batch, makes no micro-batch of whole samples); not given, those of
    1, 2, 4, 8 that divide it."""
    given = int_list(text, flag)
    if not given:
        return tuple(m for m in DEFAULT_MICRO_BATCHES if batch % m == 0)
    bad = [m for m in given if batch % m]
    if bad:
        raise ShardplanError(f"{flag}: {bad[0]} micro-batches do not split the batch of {batch} evenly "
                             "(each count must be one that divides the batch)")
    return given


def add_machine(p: argparse.ArgumentParser) -> None:
    from shardplan.machine import DTYPE_BYTES, PRESETS

    p.add_argument("--machine", default=None, choices=tuple(PRESETS),
                   help="machine preset (default paper: 10 TFLOP/s, 16 GB/s)")
    p.add_argument("--machine-file", metavar="JSON",
                   help="a machine profile file (every constant with its source; copy one of shardplan/machines/)")
    p.add_argument("--flops", type=real_option(*FLOPS_RANGE, unit="FLOP/s"),
                   help=f"override peak FLOP/s per device ({FLOPS_RANGE[0]:g} to {FLOPS_RANGE[1]:g})")
    p.add_argument("--bandwidth", type=real_option(*BANDWIDTH_RANGE, unit="B/s"),
                   help=f"override link bandwidth, bytes/s ({BANDWIDTH_RANGE[0]:g} to {BANDWIDTH_RANGE[1]:g})")
    p.add_argument("--latency", type=real_option(*LATENCY_RANGE, unit="s"),
                   help=f"override link latency, seconds ({LATENCY_RANGE[0]:g} to {LATENCY_RANGE[1]:g})")
    p.add_argument("--dtype", choices=tuple(DTYPE_BYTES), help="element type")


def add_model(p: argparse.ArgumentParser, required: bool = True, orders: bool = True) -> None:
    from shardplan.checks import MAX_EXTENT
    from shardplan.cost import ORDERS

    p.add_argument("--model", required=required, help="zoo model name (see `shardplan models`)")
    p.add_argument("--batch", type=int_option(1, MAX_EXTENT), help="batch size (default: the model's)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="model size, e.g. --set layers=12")
    p.add_argument("--cutoff", type=int_option(1, MAX_EXTENT),
                   help="minimum points per part (default: the model's, 4 CNNs / 1 sequence)")
    if orders:
        p.add_argument("--orders", default=None, choices=ORDERS,
                       help="device-grid nestings offered per configuration (default auto: all while small)")
    p.add_argument("--all-divisors", action="store_true", default=None,
                   help="also allow configurations whose device count does not divide p (idle devices)")


def add_progress(p: argparse.ArgumentParser) -> None:
    p.add_argument("--progress", type=real_option(0.0, 3600.0), metavar="SECONDS",
                   help="write a progress line to stderr every SECONDS during long steps (default: a line "
                        f"rewritten in place on a terminal, a line every {PROGRESS_EVERY_LOG:g} s otherwise)")


