"""Calibration: micro-benchmarks on the devices this process sees, turned into a machine profile.

:func:`calibrate` times three kinds of programs through JAX or PyTorch and :func:`to_profile` turns the
timings into a :class:`~shardplan.machine.Profile` (``shardplan calibrate`` writes it as a machine file).
Every time is the best of ``repeats`` runs after one untimed warm-up run (:func:`best_seconds`: the run
least disturbed by other work on the host). With p devices every program runs on all p at once, so a
rate is what one device gets while the others work too (p simulated CPU devices share the host's cores).

* **matrix products** over :attr:`Sizes.matmul_shapes`: every device multiplies its own M x K by K x N
  matrices; rate = 2 M N K / t. ``peak_flops`` = the best rate measured (a measured peak, not the
  vendor's); ``flops_efficiency`` = the median rate over the large shapes (2 M N K at least 1/16 of the
  largest shape's) / the best;
* **elementwise** ``x * 2`` on b bytes per device: ``hbm_bandwidth`` = 2 b / t (b read, b written);
* **all-reduce** (``psum`` under ``jax.shard_map``; ``torch.distributed.all_reduce`` on gloo, or NCCL
  on GPUs) of b bytes per device over :attr:`Sizes.collective_bytes`: the bus bandwidth of the ring
  all-reduce, 2 (p - 1) / p * b / t (:func:`shardplan.cost.collectives.ring_allreduce` solved for B),
  taken at the largest size as ``bandwidth``; ``latency`` alpha from the smallest size:
  (t_small - 2 (p - 1) / p * b_small / B - t_dispatch) / (2 (p - 1)), where t_dispatch is the time of
  the elementwise program on the same bytes (the call's own overhead), floored at 0.

One device (or one PyTorch process, no process group) runs no collective: ``bandwidth`` and ``latency``
are then not measured and the file says so.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from shardplan.errors import ShardplanError

__all__ = ["DTYPES", "ENGINES", "FULL", "QUICK", "Calibration", "CollectivePoint", "MatmulPoint", "Sizes",
           "best_seconds", "calibrate", "cpu_model", "measure_jax", "measure_torch", "to_profile"]

ENGINES = ("jax", "torch")
DTYPES = {"fp32": 4, "bf16": 2, "fp16": 2}
KiB, MiB = 1024, 1024**2
LARGE_FRACTION = 1 / 16  # a shape is large when its 2MNK is at least this fraction of the largest shape's


@dataclass(frozen=True)
class Sizes:
    """What is timed: matmul shapes (M, N, K), the elementwise bytes per device, all-reduce bytes per device."""

    matmul_shapes: tuple[tuple[int, int, int], ...]
    elementwise_bytes: int
    collective_bytes: tuple[int, ...]
    repeats: int


def _shapes(squares: tuple[int, ...], big: int, small: int) -> tuple[tuple[int, int, int], ...]:
    """Square n x n x n products and the three skinny products with one dimension ``small``, the others ``big``."""
    return tuple((n, n, n) for n in squares) + ((big, big, small), (big, small, big), (small, big, big))


FULL = Sizes(_shapes((256, 512, 1024, 2048, 4096), 4096, 256), 128 * MiB,
             tuple(KiB * 4**i for i in range(9)), 5)  # all-reduce 1 KiB .. 64 MiB
QUICK = Sizes(_shapes((64, 128, 256), 256, 64), 4 * MiB, (KiB, 16 * KiB, 256 * KiB, MiB), 3)


@dataclass(frozen=True)
class MatmulPoint:
    """One product: shape, best seconds, FLOP/s per device (2 M N K / t)."""

    m: int
    n: int
    k: int
    seconds: float

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k

    @property
    def rate(self) -> float:
        return self.flops / self.seconds


@dataclass(frozen=True)
class CollectivePoint:
    """One all-reduce: bytes per device, best seconds, bus bytes/s 2 (p - 1) / p * b / t."""

    bytes: int
    seconds: float
    devices: int

    @property
    def bus_bandwidth(self) -> float:
        p = self.devices
        return 2.0 * (p - 1) / p * self.bytes / self.seconds


@dataclass(frozen=True)
class Calibration:
    """Everything one run measured, and where: the input of :func:`to_profile`."""

    engine: str
    devices: int
    device_kind: str
    dtype: str
    date: str
    host: tuple[tuple[str, str], ...]
    matmuls: tuple[MatmulPoint, ...]
    elementwise_bytes: int
    elementwise_seconds: float
    collectives: tuple[CollectivePoint, ...]
    collective_library: str
    dispatch_seconds: float
    memory_bytes: float | None
    collectives_note: str = ""


# ----------------------------------------------------------------------------------------------- timing helpers
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


def _host(libraries: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return (("platform", f"{platform.system()} {platform.release()} {platform.machine()}"), ("cpu", cpu_model()),
            ("logical_cpus", str(os.cpu_count())), ("python", platform.python_version()), *sorted(libraries.items()))


def _now() -> str:
    return f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC"


def _check(engine: str, dtype: str, devices: int | None) -> None:
    if engine not in ENGINES:
        raise ShardplanError(f"calibrate: engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if dtype not in DTYPES:
        raise ShardplanError(f"calibrate: dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if devices is not None and (not isinstance(devices, int) or isinstance(devices, bool) or devices < 1):
        raise ShardplanError(f"calibrate: devices must be a positive integer, got {devices!r}")


# ----------------------------------------------------------------------------------------------- JAX
def measure_jax(devices: int | None = None, sizes: Sizes = FULL, dtype: str = "fp32") -> Calibration:
    """Time the three programs on the first ``devices`` JAX devices (default: all), all at once."""
    _check("jax", dtype, devices)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    have = jax.devices()
    p = len(have) if devices is None else devices
    if p > len(have):
        raise ShardplanError(f"calibrate: {p} devices asked, JAX sees {len(have)} ({have[0].platform}); on CPU set "
                             f"XLA_FLAGS=--xla_force_host_platform_device_count={p}")
    devs = have[:p]
    dt = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}[dtype]
    mesh = Mesh(np.array(devs), ("d",))
    split = NamedSharding(mesh, P("d"))

    def on_all(shape: tuple[int, ...]) -> Any:
        return jax.device_put(jnp.ones((p, *shape), dt), split)

    def sync(f: Callable[..., Any], *xs: Any) -> Callable[[], Any]:
        return lambda: f(*xs).block_until_ready()

    bmm = jax.jit(jnp.matmul, out_shardings=split)
    matmuls = []
    for m, n, k in sizes.matmul_shapes:
        a, b = on_all((m, k)), on_all((k, n))
        matmuls.append(MatmulPoint(m, n, k, best_seconds(sync(bmm, a, b), sizes.repeats)))
        del a, b
    scale = jax.jit(lambda v: v * 2, out_shardings=split)
    x = on_all((sizes.elementwise_bytes // DTYPES[dtype],))
    t_elem = best_seconds(sync(scale, x), sizes.repeats)
    del x
    collectives: list[CollectivePoint] = []
    dispatch = 0.0
    if p > 1:
        psum = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "d"), mesh=mesh, in_specs=P("d"), out_specs=P("d")))
        for b in sizes.collective_bytes:
            v = on_all((max(1, b // DTYPES[dtype]),))
            collectives.append(CollectivePoint(b, best_seconds(sync(psum, v), sizes.repeats), p))
        small = on_all((max(1, sizes.collective_bytes[0] // DTYPES[dtype]),))
        dispatch = best_seconds(sync(scale, small), 10 * sizes.repeats)
    stats = devs[0].memory_stats() if hasattr(devs[0], "memory_stats") else None
    limit = (stats or {}).get("bytes_limit")
    return Calibration("jax", p, devs[0].device_kind, dtype, _now(),
                       _host({"jax": jax.__version__, "jaxlib": getattr(jax.lib, "__version__", jax.__version__),
                              "numpy": np.__version__, "backend": jax.default_backend()}),
                       tuple(matmuls), sizes.elementwise_bytes, t_elem, tuple(collectives),
                       "jax psum under jax.shard_map", dispatch, float(limit) if limit else None,
                       "" if p > 1 else "one device: no collective to time")


# ----------------------------------------------------------------------------------------------- PyTorch
def _torch_device() -> tuple[Any, str]:
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", 0), torch.cuda.get_device_name(0)
    return torch.device("cpu"), "cpu"


def _torch_sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _torch_compute(sizes: Sizes, dtype: str) -> tuple[tuple[MatmulPoint, ...], float, float, Any, str]:
    """Matmul points, elementwise seconds and the dispatch seconds of one process on its device."""
    import torch

    device, kind = _torch_device()
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]

    def timed(f: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            f()
            _torch_sync(device)
        return run

    points = []
    with torch.no_grad():
        for m, n, k in sizes.matmul_shapes:
            a, b = torch.ones((m, k), dtype=dt, device=device), torch.ones((k, n), dtype=dt, device=device)
            points.append(MatmulPoint(m, n, k, best_seconds(timed(lambda a=a, b=b: a @ b), sizes.repeats)))
        x = torch.ones(sizes.elementwise_bytes // DTYPES[dtype], dtype=dt, device=device)
        t_elem = best_seconds(timed(lambda: x * 2), sizes.repeats)
        small = torch.ones(max(1, sizes.collective_bytes[0] // DTYPES[dtype]), dtype=dt, device=device)
        dispatch = best_seconds(timed(lambda: small * 2), 10 * sizes.repeats)
    return tuple(points), t_elem, dispatch, device, kind


def free_port() -> int:
    """A TCP port on 127.0.0.1 free at the time of the call (the rendezvous of the process group)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torch_rank(rank: int, world: int, port: int, sizes: Sizes, dtype: str, out: Any) -> None:
    """One process of the group: time every all-reduce size; rank 0 puts (bytes, seconds) pairs on ``out``."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    backend = "nccl" if cuda else "gloo"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        got = []
        for b in sizes.collective_bytes:
            v = torch.ones(max(1, b // DTYPES[dtype]), dtype=dt, device=device)

            def run(v: Any = v) -> None:
                dist.all_reduce(v)
                _torch_sync(device)
            dist.barrier()
            got.append((b, best_seconds(run, sizes.repeats)))
        if rank == 0:
            out.put((backend, got))
    finally:
        dist.destroy_process_group()


def _torch_collectives(world: int, sizes: Sizes, dtype: str) -> tuple[str, tuple[CollectivePoint, ...]]:
    """``world`` processes (spawned) in one gloo / NCCL group timing all-reduce; the times of rank 0."""
    import multiprocessing as mp
    import queue

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_torch_rank, args=(r, world, port, sizes, dtype, out)) for r in range(world)]
    for proc in procs:
        proc.start()
    try:
        backend, got = out.get(timeout=600)
    except queue.Empty:  # a rank failed; its error is on stderr
        raise ShardplanError(f"calibrate: the {world} torch.distributed processes did not report all-reduce times "
                             f"(see their errors above)") from None
    finally:
        for proc in procs:
            proc.join(60)
            if proc.is_alive():
                proc.terminate()
    return backend, tuple(CollectivePoint(b, t, world) for b, t in got)


def measure_torch(devices: int = 1, sizes: Sizes = FULL, dtype: str = "fp32") -> Calibration:
    """Time matmuls and the elementwise program in this process (one GPU, else the CPU), and all-reduce in
    ``devices`` spawned processes (gloo on CPU, NCCL on GPUs); with 1 process no group and no collective."""
    _check("torch", dtype, devices)
    import torch

    points, t_elem, dispatch, device, kind = _torch_compute(sizes, dtype)
    memory = float(torch.cuda.get_device_properties(device).total_memory) if device.type == "cuda" else None
    backend, collectives, note = "", (), "one process, no process group: no collective to time"
    if devices > 1:
        backend, collectives = _torch_collectives(devices, sizes, dtype)
        note = ""
    return Calibration("torch", devices, kind, dtype, _now(),
                       _host({"torch": torch.__version__, "device": str(device),
                              "torch_threads": str(torch.get_num_threads())}),
                       points, sizes.elementwise_bytes, t_elem, collectives,
                       f"torch.distributed.all_reduce on {backend}" if backend else "", dispatch, memory, note)


def calibrate(engine: str, devices: int | None = None, quick: bool = False, dtype: str = "fp32") -> Calibration:
    """Measure this machine through ``engine`` (``"jax"``: all JAX devices unless ``devices``; ``"torch"``:
    ``devices`` processes, default 1); ``quick``: :data:`QUICK` sizes (seconds), else :data:`FULL`."""
    _check(engine, dtype, devices)
    sizes = QUICK if quick else FULL
    if engine == "jax":
        return measure_jax(devices, sizes, dtype)
    return measure_torch(1 if devices is None else devices, sizes, dtype)


# ----------------------------------------------------------------------------------------------- the profile
def large_shapes(points: tuple[MatmulPoint, ...]) -> tuple[MatmulPoint, ...]:
    """The points whose 2 M N K is at least :data:`LARGE_FRACTION` of the largest point's."""
    top = max(pt.flops for pt in points)
    return tuple(pt for pt in points if pt.flops >= LARGE_FRACTION * top)


def latency_of(cal: Calibration, bandwidth: float) -> float:
    """alpha = (t_small - 2 (p - 1) / p * b_small / B - t_dispatch) / (2 (p - 1)), floored at 0 (module docstring)."""
    p = cal.devices
    small = min(cal.collectives, key=lambda c: c.bytes)
    beyond = small.seconds - 2.0 * (p - 1) / p * small.bytes / bandwidth - cal.dispatch_seconds
    return max(beyond, 0.0) / (2 * (p - 1))


def _g(x: float) -> str:
    return f"{x:.3g}"


def to_profile(cal: Calibration, name: str | None = None) -> Any:
    """The machine profile of ``cal``: measured constants with their sources, the rest stated as not measured."""
    from shardplan.machine import Machine, Profile
    from shardplan.units import fmt_bytes

    if not cal.matmuls:
        raise ShardplanError("calibrate: no matrix product was timed")
    p, by = cal.devices, f"measured by shardplan calibrate on {cal.date}"
    said = f"shardplan calibrate on {cal.date}"
    best = max(cal.matmuls, key=lambda pt: pt.rate)
    large = large_shapes(cal.matmuls)
    median = statistics.median(pt.rate for pt in large)
    together = f"all {p} devices at once" if p > 1 else "one device"
    if cal.engine == "torch" and p > 1:
        together = "one process alone (the all-reduce runs in separate processes)"
    hbm = 2.0 * cal.elementwise_bytes / cal.elementwise_seconds
    src = {
        "peak_flops": f"{by}: the best {cal.dtype} matmul rate over {len(cal.matmuls)} shapes, {together}: "
                      f"{best.m}x{best.k} @ {best.k}x{best.n}, 2*M*N*K / t = {_g(best.rate)} FLOP/s per device "
                      f"(a measured peak, not the vendor's; the per-shape table is under 'measurements')",
        "flops_efficiency": f"{by}: the median rate over the {len(large)} large shapes (2*M*N*K at least 1/16 of the "
                            f"largest) {_g(median)} FLOP/s / the best {_g(best.rate)} FLOP/s",
        "hbm_bandwidth": f"{by}: elementwise x * 2 on {fmt_bytes(cal.elementwise_bytes)} per device, {together}: "
                         f"2 * b / t = {_g(hbm)} B/s per device (b read, b written)",
        "dtype_bytes": f"{said}: the dtype every program was timed in ({cal.dtype})",
        "node_size": f"{said}: one host, one level (not measured across hosts)",
        "inter_bandwidth": f"{said}: one host, no link across nodes (not measured)",
        "inter_latency": f"{said}: one level",
        "pod_nodes": f"{said}: one level", "pod_bandwidth": f"{said}: one level", "pod_latency": f"{said}: one level",
    }
    if cal.memory_bytes:
        src["memory_bytes"] = f"{said}: the device's memory as its library reports it ({fmt_bytes(cal.memory_bytes)})"
    else:
        src["memory_bytes"] = f"{said}: no per-device limit reported (CPU devices share the host's RAM); pass budget="
    if cal.collectives:
        top = max(cal.collectives, key=lambda c: c.bytes)
        bandwidth = top.bus_bandwidth
        latency = latency_of(cal, bandwidth)
        small = min(cal.collectives, key=lambda c: c.bytes)
        src["bandwidth"] = (f"{by}: {cal.collective_library}, all-reduce of {fmt_bytes(top.bytes)} per device over "
                            f"{p} devices: bus bandwidth 2*(p-1)/p * b / t = {_g(bandwidth)} B/s (the ring model's B; "
                            f"the per-size table is under 'measurements')")
        src["latency"] = (f"{by}: all-reduce of {fmt_bytes(small.bytes)} took {_g(small.seconds)} s, its bandwidth "
                          f"term {_g(2 * (p - 1) / p * small.bytes / bandwidth)} s and the dispatch of an "
                          f"elementwise program of the same size {_g(cal.dispatch_seconds)} s; the rest over the "
                          f"ring's 2*(p-1) steps: {_g(latency)} s per step (floored at 0)")
    else:
        bandwidth, latency = hbm, 0.0
        why = cal.collectives_note or "no collective timed"
        src["bandwidth"] = (f"{said}: not measured ({why}); set to the measured hbm_bandwidth so that the file loads: "
                            f"a plan on one device has no collective")
        src["latency"] = f"{said}: not measured ({why}); 0"
    if cal.engine == "torch":
        bucket, overlap, shared = 25 * MiB, True, False
        src["grad_bucket_bytes"] = f"{said}: not measured: PyTorch DDP's default bucket_cap_mb of 25 MiB"
        src["overlap_grad"] = f"{said}: not measured: DDP and FSDP overlap gradient reduction with the backward pass"
    else:
        bucket, overlap, shared = None, False, False
        src["grad_bucket_bytes"] = f"{said}: not measured: one all-reduce per weight gradient, as XLA compiles it"
        src["overlap_grad"] = f"{said}: not measured: gradient synchronisation added to the step, not overlapped"
    src["sum_shared_grads"] = (f"{said}: not measured: shardplan's default, each reader's gradient synchronised in "
                               f"its own layout (see Machine's docstring)")
    for k in ("fp8_flops", "host_bandwidth", "host_latency", "host_memory_bytes", "cpu_adam_rate"):
        src[k] = f"{said}: not measured: no FP8 products or host offload offered (edit the file to add them)"
    for k in ("sm_count", "gemm_tiles"):
        src[k] = (f"{said}: not measured: no tile or wave quantisation of matrix products (edit the file to add the "
                  f"device's multiprocessor count and its library's output tile)")
    for k in ("gemm_align", "gemm_unaligned_efficiency"):
        src[k] = (f"{said}: not measured: no penalty for product dimensions that are not multiples of the "
                  f"library's alignment (edit the file to add one)")
    label = name or f"calibrated-{cal.engine}-{cal.device_kind}"
    machine = Machine(1, peak_flops=best.rate, bandwidth=bandwidth, latency=latency, dtype_bytes=DTYPES[cal.dtype],
                      memory_bytes=cal.memory_bytes, name=label, hbm_bandwidth=hbm,
                      flops_efficiency=min(1.0, median / best.rate), grad_bucket_bytes=bucket, overlap_grad=overlap,
                      sum_shared_grads=shared)
    host = ", ".join(f"{k} {v}" for k, v in cal.host)
    description = (f"Measured by shardplan calibrate --engine {cal.engine} on {cal.date}: {p} x {cal.device_kind} "
                   f"({cal.dtype}); host: {host}. Rates are per device with {together}; every time is the best of "
                   f"several runs after a warm-up. " + (f"Collectives: {cal.collectives_note}." if cal.collectives_note
                                                        else f"Collectives: {cal.collective_library}."))
    return Profile.of(machine, src, (cal.device_kind,), description, measurements(cal))


def measurements(cal: Calibration) -> dict[str, Any]:
    """The raw tables of ``cal`` (kept in the machine file under ``"measurements"``)."""
    return {
        "engine": cal.engine, "devices": cal.devices, "device_kind": cal.device_kind, "dtype": cal.dtype,
        "date": cal.date, "host": dict(cal.host),
        "matmul": [{"m": pt.m, "n": pt.n, "k": pt.k, "seconds": pt.seconds, "flops_per_second": pt.rate}
                   for pt in cal.matmuls],
        "elementwise": {"bytes_per_device": cal.elementwise_bytes, "seconds": cal.elementwise_seconds,
                        "bytes_per_second": 2.0 * cal.elementwise_bytes / cal.elementwise_seconds},
        "all_reduce": {"library": cal.collective_library, "note": cal.collectives_note,
                       "dispatch_seconds": cal.dispatch_seconds,
                       "sizes": [{"bytes_per_device": c.bytes, "seconds": c.seconds,
                                  "bus_bytes_per_second": c.bus_bandwidth} for c in cal.collectives]},
    }
