"""``shardplan calibrate``: measure the machine this runs on and write its machine profile.

It calls :func:`shardplan.calibrate.calibrate` (matrix products of transformer layers and squares, an
elementwise program, all-reduce over message sizes, causal attention, and on CUDA through PyTorch pinned
host copies and FP8 products; every program timed over back-to-back calls) and
:func:`shardplan.calibrate.to_profile`; the profile goes to ``--out`` (written atomically;
:func:`shardplan.machine.load_machine_file` reads it back), else to stdout. A summary of the measured
constants, and of what was not measured and why, goes to stderr.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

from shardplan.cli.options import int_option, write_text

__all__ = ["add_parser", "cmd_calibrate", "summary"]


def summary(cal: Any, machine: Any) -> list[str]:
    """The lines printed after a calibration: the machine, then attention, host copies and FP8 (measured
    ranges, or why not)."""
    from shardplan.units import fmt_bytes, fmt_rate, fmt_seconds

    lines = [f"calibrated {cal.devices} x {cal.device_kind} through {cal.engine}: {machine.describe()}, "
             f"latency {fmt_seconds(machine.latency)}" + (f" ({cal.collectives_note})" if cal.collectives_note else "")]
    layers = [pt.rate for pt in cal.matmuls if pt.layer]
    if layers:
        lines.append(f"  matmul: transformer-layer products {fmt_rate(min(layers), 'FLOP/s')} .. "
                     f"{fmt_rate(max(layers), 'FLOP/s')} (median {fmt_rate(statistics.median(layers), 'FLOP/s')}), "
                     f"{machine.sm_count or 'no'} multiprocessors")
    rows = cal.attention.rows
    if rows:
        f, b = [r.forward_rate for r in rows], [r.forward_backward_rate for r in rows]
        lines.append(f"  attention (causal, {cal.dtype}): forward {fmt_rate(min(f), 'FLOP/s')} .. "
                     f"{fmt_rate(max(f), 'FLOP/s')}, forward+backward {fmt_rate(min(b), 'FLOP/s')} .. "
                     f"{fmt_rate(max(b), 'FLOP/s')} ({rows[-1].implementation})")
    else:
        lines.append(f"  attention: not measured ({cal.attention.why_not})")
    if machine.host_bandwidth is not None:
        lines.append(f"  host copies (pinned, {fmt_bytes(cal.host_copies.rows[0].bytes)} .. "
                     f"{fmt_bytes(cal.host_copies.rows[-1].bytes)}): {fmt_rate(machine.host_bandwidth, 'B/s')}, "
                     f"latency {fmt_seconds(machine.host_latency)}")
    else:
        lines.append(f"  host copies: not measured ({cal.host_copies.why_not})")
    if machine.fp8_flops is not None:
        eff = "" if machine.fp8_efficiency is None else f", {machine.fp8_efficiency:.0%} achievable (fp8_efficiency)"
        lines.append(f"  fp8 (torch._scaled_mm E4M3): {fmt_rate(machine.fp8_flops, 'FLOP/s')}{eff}")
    else:
        lines.append(f"  fp8: not measured ({cal.fp8.why_not})")
    return lines


def cmd_calibrate(args: argparse.Namespace) -> int:
    from shardplan.calibrate import calibrate, to_profile

    cal = calibrate(args.engine, devices=args.devices, quick=args.quick, dtype=args.dtype)
    profile = to_profile(cal, name=args.name)
    text = profile.to_json()
    for line in summary(cal, profile.machine(cal.devices)):
        print(line, file=sys.stderr)
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
                                         "latency, attention, host copies, FP8) and write a machine file")
    p.add_argument("--engine", required=True, choices=ENGINES, help="library that runs the micro-benchmarks")
    p.add_argument("--devices", type=int_option(1, 4096),
                   help="devices to measure on: jax, the first N devices (default all it sees); torch, N processes "
                        "in one gloo/NCCL group for the all-reduce (default 1: no collective)")
    p.add_argument("--out", help="write the machine file here (default: stdout)")
    p.add_argument("--quick", action="store_true", help="small sizes: runs in seconds, rates less exact")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32", help="element type timed (default fp32)")
    p.add_argument("--name", help="the profile's name (default calibrated-ENGINE-DEVICEKIND)")
    p.set_defaults(func=cmd_calibrate)
