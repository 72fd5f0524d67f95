"""Measure this host as p simulated JAX CPU devices: the numbers behind ``cpu.json``.

Run ``XLA_FLAGS=--xla_force_host_platform_device_count=8 python shardplan/machines/measure_cpu.py``
and copy the printed rates and source lines into a copy of ``cpu.json``. Every rate is the best of
``repeats`` timed runs after one warm-up run (the best run is the one least disturbed by other
processes on the host). Host-wide rates, one program using the whole host:

* numpy / jax matmul FLOP/s = 2 n^3 / t for one n x n by n x n float32 product;
* copy bytes/s = b / t for numpy ``copyto`` of b bytes.

Per simulated device, all p devices working at once (what a plan on p simulated devices gets: the
devices share the host's cores and memory, so each gets about 1/p of the host-wide rates):

* matmul FLOP/s = 2 n^3 / t, every device multiplying its own n x n float32 matrices;
* memory bytes/s = 2 b / t, every device scaling its own b-byte array (b read, b written), the
  ``hbm_bandwidth`` of the compute roofline (:mod:`shardplan.cost.operator`);
* all-reduce bus bytes/s = 2 (p - 1) / p * b / t, a ``psum`` of b bytes on every device: the link
  bandwidth B of :func:`shardplan.cost.collectives.ring_allreduce`, solved from the measured time.
  No link exists between simulated devices; a collective is copies and sums in the host's memory;
* all-reduce latency = (t_psum - t_scale) / (2 (p - 1)) for one float32 per device: the time of a
  ``psum`` beyond that of an elementwise program of the same size (the call's dispatch), spread over
  the ring's 2 (p - 1) steps, the alpha of :func:`shardplan.cost.collectives.ring_allreduce`.
"""

from __future__ import annotations

import os
import platform
import time
from datetime import datetime, timezone
from typing import Callable


def best_seconds(run: Callable[[], object], repeats: int) -> float:
    """The shortest wall time of ``repeats`` calls of ``run`` after one untimed warm-up call."""
    run()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else ``platform.processor()``."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def host_rates(n: int, copy_mib: int, repeats: int) -> None:
    """Print the host-wide numpy matmul FLOP/s and copy bytes/s."""
    import numpy as np

    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    b = np.random.default_rng(1).standard_normal((n, n), dtype=np.float32)
    mm = 2.0 * n**3 / best_seconds(lambda: a @ b, repeats)
    src = np.ones(copy_mib * 2**20 // 4, dtype=np.float32)
    dst = np.empty_like(src)
    copy = src.nbytes / best_seconds(lambda: np.copyto(dst, src), repeats)
    print(f"host: numpy {np.__version__} float32 matmul {n}^3: {mm:.3g} FLOP/s; copyto {copy_mib} MiB: {copy:.3g} B/s")


def device_rates(n: int, mib: int, repeats: int) -> None:
    """Print jax's one-device dot FLOP/s and the per-device rates with all devices at once."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    devs = jax.devices()
    p = len(devs)
    dot = jax.jit(jnp.dot)
    x = jnp.ones((2 * n, 2 * n), jnp.float32)
    one = 2.0 * (2 * n) ** 3 / best_seconds(lambda: dot(x, x).block_until_ready(), repeats)
    print(f"jax {jax.__version__} XLA CPU, one device alone: float32 dot {2 * n}^3: {one:.3g} FLOP/s")
    mesh = Mesh(np.array(devs), ("d",))
    split = NamedSharding(mesh, P("d"))
    mats = jax.device_put(jnp.ones((p, n, n), jnp.float32), split)
    bmm = jax.jit(jnp.matmul, out_shardings=split)
    mm = 2.0 * n**3 / best_seconds(lambda: bmm(mats, mats).block_until_ready(), repeats)
    m = mib * 2**20 // 4
    vec = jax.device_put(jnp.ones((p * m,), jnp.float32), split)
    scale = jax.jit(lambda v: v * 2.0, out_shardings=split)
    mem = 2.0 * 4 * m / best_seconds(lambda: scale(vec).block_until_ready(), repeats)
    psum = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "d"), mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    bus = 2.0 * (p - 1) / p * 4 * m / best_seconds(lambda: psum(vec).block_until_ready(), repeats)
    tiny = jax.device_put(jnp.ones((p,), jnp.float32), split)
    t_sum = best_seconds(lambda: psum(tiny).block_until_ready(), 10 * repeats)
    t_scale = best_seconds(lambda: scale(tiny).block_until_ready(), 10 * repeats)
    alpha = max(t_sum - t_scale, 0.0) / (2 * (p - 1))
    print(f"per device, {p} devices at once: float32 matmul {n}^3: {mm:.3g} FLOP/s; "
          f"scale {mib} MiB: {mem:.3g} B/s; psum {mib} MiB: bus {bus:.3g} B/s; "
          f"psum of 4 bytes {t_sum:.3g} s, scale of 4 bytes {t_scale:.3g} s: latency {alpha:.3g} s")


def main(n: int = 1024, mib: int = 64, repeats: int = 10) -> None:
    print(f"date (UTC): {datetime.now(timezone.utc):%Y-%m-%d %H:%M}; host: {cpu_model()}, "
          f"{os.cpu_count()} logical CPUs, {platform.system()} {platform.release()}")
    host_rates(2 * n, 4 * mib, repeats)
    device_rates(n, mib, repeats)


if __name__ == "__main__":
    main()
