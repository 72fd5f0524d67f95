"""Measure this host as p simulated JAX CPU devices: the numbers behind ``cpu.json``.

Run ``XLA_FLAGS=--xla_force_host_platform_device_count=8 python shardplan/machines/measure_cpu.py [OUT.json]``.
It is ``shardplan calibrate --engine jax`` (:mod:`shardplan.calibrate`, the one copy of the measurement code)
with the sizes ``cpu.json`` was measured at: float32 products of 1024 x 1024 matrices, 64 MiB per device for
the elementwise program and the largest all-reduce, the median of 10 timed loops. It prints the profile it measured (and
writes it to OUT.json when given); copy the values and sources into ``cpu.json``, whose description adds what
a calibration cannot know (the host's load, how the rates scale with p).
"""

from __future__ import annotations

import sys

from shardplan.calibrate import Sizes, measure_jax, to_profile

KiB, MiB = 1024, 1024**2
CPU_SIZES = Sizes(matmul_shapes=((1024, 1024, 1024),), elementwise_bytes=64 * MiB,
                  collective_bytes=(4, KiB, MiB, 64 * MiB), repeats=10)
"""The sizes of ``cpu.json``'s measurement (the all-reduce's latency from one float32 per device)."""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    text = to_profile(measure_jax(None, CPU_SIZES), name="cpu").to_json()
    if args:
        with open(args[0], "w", encoding="utf-8") as f:
            f.write(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
