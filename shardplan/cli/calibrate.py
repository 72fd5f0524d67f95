"""``shardplan calibrate``: measure the machine this runs on and write its machine profile.

It calls :func:`shardplan.calibrate.calibrate` (matrix products, an elementwise program and all-reduce over
message sizes, through JAX or PyTorch) and :func:`shardplan.calibrate.to_profile`; the profile goes to
``--out`` (written atomically; :func:`shardplan.machine.load_machine_file` reads it back), else to stdout.
A summary of the measured constants goes to stderr.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from shardplan.cli.options import int_option, write_text

__all__ = ["add_parser", "cmd_calibrate"]


def cmd_calibrate(args: argparse.Namespace) -> int:
    from shardplan.calibrate import calibrate, to_profile

    cal = calibrate(args.engine, devices=args.devices, quick=args.quick, dtype=args.dtype)
    profile = to_profile(cal, name=args.name)
    text = profile.to_json()
    machine = profile.machine(cal.devices)
    print(f"calibrated {cal.devices} x {cal.device_kind} through {cal.engine}: {machine.describe()}, "
          f"latency {machine.latency:.3g} s" + (f" ({cal.collectives_note})" if cal.collectives_note else ""),
          file=sys.stderr)
    if args.out:
        write_text(args.out, text)
        print(f"machine file: {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def add_parser(sub: Any) -> None:
    """Register the ``calibrate`` subcommand."""
    from shardplan.calibrate import DTYPES, ENGINES

    p = sub.add_parser("calibrate", help="measure this machine (matmul FLOP/s, memory and all-reduce bandwidth, "
                                         "latency) and write a machine file")
    p.add_argument("--engine", required=True, choices=ENGINES, help="library that runs the micro-benchmarks")
    p.add_argument("--devices", type=int_option(1, 4096),
                   help="devices to measure on: jax, the first N devices (default all it sees); torch, N processes "
                        "in one gloo/NCCL group for the all-reduce (default 1: no collective)")
    p.add_argument("--out", help="write the machine file here (default: stdout)")
    p.add_argument("--quick", action="store_true", help="small sizes: runs in seconds, rates less exact")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32", help="element type timed (default fp32)")
    p.add_argument("--name", help="the profile's name (default calibrated-ENGINE-DEVICEKIND)")
    p.set_defaults(func=cmd_calibrate)
