"""Calibration: micro-benchmarks on the devices this process sees, turned into a machine profile.

:func:`calibrate` times programs through JAX or PyTorch and :func:`to_profile` turns the timings into a
:class:`~shardplan.machine.Profile` (``shardplan calibrate`` writes it as a machine file). With p devices
every program runs on all p at once, so a rate is what one device gets while the others work too (p
simulated CPU devices share the host's cores).

**Timing** (:func:`amortised_seconds`). One call followed by a synchronisation measures the launch and
the dispatch of the library as much as the program, so every program is called n times back to back
with one synchronisation at the end: t = T_n / n. PyTorch on a GPU brackets the n calls with CUDA events
(the GPU's own clock); on the CPU, and through JAX, the clock is ``time.perf_counter`` and the loop ends by
waiting for the last result (``block_until_ready``: a device runs its programs in order; JAX on CPU waits
for every result, whose programs may run side by side). After a warm-up call (compilation, autotuning),
a one-call probe t_1 and a loop of n_1 = ceil(T / t_1) calls give n = ceil(T n_1 / T_{n_1}), both within
[1, ``max_calls``], so that a loop lasts about T = ``min_loop_seconds`` (20 ms); the time kept is the
median over ``repeats`` loops of n calls. The processes of a collective take the largest n any of them
chose, so that all make the same calls.

**Constants** (rates per device):

* matrix products over :attr:`Sizes.layer_shapes` (the products of transformer layers, see
  :func:`layer_shapes`) and :attr:`Sizes.matmul_shapes` (squares), on random normal data: rate =
  2 M N K / t. ``peak_flops`` = the best rate measured (a measured peak, not the vendor's);
  ``flops_efficiency`` = median over the layer products of rate / (u * peak_flops), where u is the
  tile and wave utilisation the cost model applies to the same product
  (:func:`shardplan.cost.operator.gemm_utilisation`; u = 1 without ``sm_count``), so that the model's
  rate peak * efficiency * u meets the median layer product; without layer shapes the median is over all
  products. Capped at 1;
* ``sm_count``: the device's multiprocessors as its library reports them
  (``torch.cuda.get_device_properties().multi_processor_count``, JAX's ``Device.core_count`` on GPUs),
  with ``gemm_tiles`` (which the machine needs beside it) from NVIDIA's documentation, not measured;
* ``hbm_bandwidth`` = 2 b / t of the elementwise ``x * 2`` on b bytes per device (b read, b written);
* ``fp8_flops`` (PyTorch, CUDA, compute capability 8.9 or later): the best rate 2 M N K / t of
  ``torch._scaled_mm`` on E4M3 operands (per-tensor scales, bf16 output, the operands cast before the timed
  calls) over :attr:`Sizes.fp8_shapes`; ``fp8_efficiency`` = the median over those products of
  rate / (u * fp8_flops), u as for ``flops_efficiency`` (:func:`fp8_efficiency`). Capped at 1;
* ``host_bandwidth`` and ``host_latency`` (PyTorch, CUDA): ``copy_(non_blocking=True)`` between pinned
  host memory and the device over :attr:`Sizes.host_bytes`; per direction B = b_large / t_large and
  alpha = max(0, t_small - b_small / B); ``host_bandwidth`` = the slower direction's B,
  ``host_latency`` = the larger alpha; ``host_memory_bytes`` = the host's physical memory (sysconf);
* **all-reduce** (``psum`` under ``jax.shard_map``; ``torch.distributed.all_reduce`` on gloo, or NCCL
  on GPUs) of b bytes per device over :attr:`Sizes.collective_bytes`: the bus bandwidth of the ring
  all-reduce, 2 (p - 1) / p * b / t (:func:`shardplan.cost.collectives.ring_allreduce` solved for B),
  taken at the largest size as ``bandwidth``; ``latency`` alpha from the smallest size:
  (t_small - 2 (p - 1) / p * b_small / B - t_dispatch) / (2 (p - 1)), where t_dispatch is the time per
  call of the elementwise program on the same bytes (the call's own overhead), floored at 0.

**Attention**: causal scaled dot-product attention
(``torch.nn.functional.scaled_dot_product_attention``, ``jax.nn.dot_product_attention``) forward and
forward + backward at :attr:`Sizes.attention_shapes` (batch b, heads h, sequence s, head dim d): the rows
under ``measurements`` give rates at forward FLOPs 2 b h s^2 d (the two products' 4 b h s^2 d, half of the
scores kept), forward + backward 3.5 times that (the backward's five products). ``attention_efficiency`` =
the median over the shapes of the cost model's FLOPs of the fused core (:attr:`AttentionPoint.model_flops`)
/ the forward + backward time / the best product rate: the fraction of ``peak_flops`` the fused kernel
reaches (:mod:`shardplan.cost.fused`).

One device (or one PyTorch process, no process group) runs no collective: ``bandwidth`` and ``latency``
are then not measured and the file says so; so does every constant a run cannot measure (CUDA-only
sections on a CPU). A section that fails on the device (out of memory, a kernel missing) keeps its error
under ``measurements`` and the calibration goes on.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Generic, TypeVar

from shardplan.errors import ShardplanError

__all__ = ["DTYPES", "ENGINES", "FULL", "GEMM_TILES", "HOST", "QUICK", "AttentionPoint", "Calibration",
           "CollectivePoint", "Fp8Point", "HostPoint", "MatmulPoint", "Section", "Sizes", "Timing",
           "amortised_seconds", "calibrate", "calls_for", "cpu_model", "fp8_efficiency", "layer_shapes",
           "measure_jax", "measure_torch", "to_profile", "wall_loop"]

ENGINES = ("jax", "torch")
DTYPES = {"fp32": 4, "bf16": 2, "fp16": 2}
KiB, MiB, GiB = 1024, 1024**2, 1024**3
GEMM_TILES = ((256, 128), (128, 256), (128, 128))
"""The output tiles written beside a measured ``sm_count`` (not measured): NVIDIA Deep Learning Performance
documentation, Matrix Multiplication Background User's Guide, "Dimension Quantization Effects" (256 x 128 in
its example; 128 x 256 and 128 x 128 among cuBLAS's other tiles), as in the H100 and A100 profiles."""
FP8_CAPABILITY = (8, 9)  # the first CUDA compute capability with FP8 tensor cores (Ada, Hopper)

T = TypeVar("T")
Loop = Callable[[Callable[[], Any], int], float]
"""``loop(call, n)``: seconds of n back-to-back calls of ``call`` ending with one synchronisation."""


def layer_shapes(tokens: int, widths: tuple[int, ...]) -> tuple[tuple[str, int, int, int], ...]:
    """(label, M, N, K) of the matrix products of transformer layers of model width d in ``widths`` on
    ``tokens`` rows: the four linear maps qkv (d -> 3d), out (d -> d), up (d -> 4d), down (4d -> d), each
    in the three passes of ``nn.Linear`` (in -> out): forward (tokens, out, in), input gradient (tokens,
    in, out), weight gradient (out, in, tokens); a shape met twice is kept once, under its first label."""
    seen: dict[tuple[int, int, int], str] = {}
    for d in widths:
        maps = (("qkv", d, 3 * d), ("out", d, d), ("up", d, 4 * d), ("down", 4 * d, d))
        for pass_, shape in (("forward", lambda i, o: (tokens, o, i)), ("input grad", lambda i, o: (tokens, i, o)),
                             ("weight grad", lambda i, o: (o, i, tokens))):
            for name, i, o in maps:
                seen.setdefault(shape(i, o), f"d={d} {name} {pass_}")
    return tuple((label, m, n, k) for (m, n, k), label in seen.items())


@dataclass(frozen=True)
class Sizes:
    """What is timed, and how long: products (M, N, K) (``layer_shapes`` labelled, from
    :func:`layer_shapes`), elementwise bytes per device, all-reduce bytes per device, attention shapes
    (batch, heads, sequence, head dim), host-copy bytes, FP8 products; every time the median of
    ``repeats`` loops of calls lasting about ``min_loop_seconds``, at most ``max_calls`` calls a loop."""

    matmul_shapes: tuple[tuple[int, int, int], ...]
    elementwise_bytes: int
    collective_bytes: tuple[int, ...]
    repeats: int
    layer_shapes: tuple[tuple[str, int, int, int], ...] = ()
    attention_shapes: tuple[tuple[int, int, int, int], ...] = ()
    host_bytes: tuple[int, ...] = ()
    fp8_shapes: tuple[tuple[int, int, int], ...] = ()
    min_loop_seconds: float = 0.02
    max_calls: int = 1000


FULL = Sizes(matmul_shapes=((1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192)),
             elementwise_bytes=256 * MiB, collective_bytes=tuple(KiB * 4**i for i in range(9)), repeats=10,
             layer_shapes=layer_shapes(8192, (2048, 4096, 8192)),
             attention_shapes=((8, 32, 1024, 128), (4, 32, 2048, 128), (2, 32, 4096, 128), (1, 32, 8192, 128)),
             host_bytes=(64 * KiB, MiB, 16 * MiB, 256 * MiB, GiB),
             fp8_shapes=((4096, 4096, 4096), (8192, 8192, 8192), (8192, 32768, 8192), (8192, 8192, 32768)))
"""Accelerators: the layers of 2K-8K-wide transformers on 8192 tokens, squares 1K-8K, 256 MiB (beyond any
L2), all-reduce 1 KiB .. 64 MiB, attention on 8192 tokens of 32 heads of 128, host copies 64 KiB .. 1 GiB."""
HOST = Sizes(matmul_shapes=((256, 256, 256), (512, 512, 512), (1024, 1024, 1024)), elementwise_bytes=64 * MiB,
             collective_bytes=tuple(KiB * 4**i for i in range(9)), repeats=5,
             layer_shapes=layer_shapes(1024, (256, 512)), attention_shapes=((1, 8, 512, 128), (1, 8, 1024, 128)),
             min_loop_seconds=0.05, max_calls=100)
"""CPU devices: the same programs at sizes a CPU runs in a few minutes."""
QUICK = Sizes(matmul_shapes=((64, 64, 64),), elementwise_bytes=MiB,
              collective_bytes=(KiB, 16 * KiB, 256 * KiB), repeats=3, layer_shapes=layer_shapes(64, (32,)),
              attention_shapes=((1, 2, 32, 16),), host_bytes=(64 * KiB, MiB), fp8_shapes=((64, 64, 64),),
              min_loop_seconds=0.002, max_calls=20)
"""Seconds on any device, for tests: rates dominated by dispatch, not for planning."""


# ----------------------------------------------------------------------------------------------- what is measured
@dataclass(frozen=True)
class MatmulPoint:
    """One product: shape, seconds per call, FLOP/s per device (2 M N K / t); ``layer`` labels a transformer
    layer's product (empty for the squares), ``calls`` the calls per timed loop."""

    m: int
    n: int
    k: int
    seconds: float
    layer: str = ""
    calls: int = 1

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k

    @property
    def rate(self) -> float:
        return self.flops / self.seconds


@dataclass(frozen=True)
class CollectivePoint:
    """One all-reduce: bytes per device, seconds per call, bus bytes/s 2 (p - 1) / p * b / t."""

    bytes: int
    seconds: float
    devices: int

    @property
    def bus_bandwidth(self) -> float:
        p = self.devices
        return 2.0 * (p - 1) / p * self.bytes / self.seconds


@dataclass(frozen=True)
class AttentionPoint:
    """Causal attention of (batch, heads, seq, head_dim): forward and forward + backward seconds per call;
    FLOPs forward 2 b h s^2 d (causal half of 4 b h s^2 d), forward + backward 3.5 times that."""

    batch: int
    heads: int
    seq: int
    head_dim: int
    forward_seconds: float
    forward_backward_seconds: float
    implementation: str

    @property
    def forward_flops(self) -> float:
        return 2.0 * self.batch * self.heads * self.seq**2 * self.head_dim

    @property
    def forward_rate(self) -> float:
        return self.forward_flops / self.forward_seconds

    @property
    def forward_backward_rate(self) -> float:
        return 3.5 * self.forward_flops / self.forward_backward_seconds

    @property
    def model_flops(self) -> float:
        """The cost model's forward + backward FLOPs of this causal attention as the fused core
        (:func:`shardplan.ops.flash_attention`): ``(4 + 5/d) + (10 + 4/d)`` per unmasked (query, key,
        feature) point, b h s (s + 1) / 2 d points."""
        from shardplan.ops import flash_attention
        from shardplan.ir import TensorRef

        b, h, s, d = self.batch, self.heads, self.seq, self.head_dim
        x = TensorRef("x", (b, s, h, d), needs_grad=True)
        op = flash_attention("attention", x, x, x, "bshk", "bthk", causal=True)
        return (op.flops_per_point + float(op.backward_flops or 0.0)) * b * h * s * (s + 1) / 2.0 * d


@dataclass(frozen=True)
class HostPoint:
    """One pinned host <-> device copy size: seconds per copy each way."""

    bytes: int
    to_device_seconds: float
    to_host_seconds: float


@dataclass(frozen=True)
class Fp8Point:
    """One FP8 product (E4M3 x E4M3 -> bf16): shape, seconds per call, FLOP/s 2 M N K / t."""

    m: int
    n: int
    k: int
    seconds: float

    @property
    def rate(self) -> float:
        return 2.0 * self.m * self.n * self.k / self.seconds


@dataclass(frozen=True)
class Section(Generic[T]):
    """The rows of one optional program, or why there are none: ``skipped`` (not measured on this device,
    e.g. no CUDA) or ``error`` (it failed; the exception as ``repr``)."""

    rows: tuple[T, ...] = ()
    skipped: str = ""
    error: str = ""

    @property
    def why_not(self) -> str:
        """Empty when rows were measured, else the reason in words."""
        if self.rows:
            return ""
        return f"it failed: {self.error}" if self.error else (self.skipped or "nothing asked")


@dataclass(frozen=True)
class Contention:
    """One product timed alone and beside back-to-back all-reduces (:func:`_torch_contention`): seconds per
    product, the product's shape, and whether the all-reduces outlasted the products beside them (else the
    slowdown is a lower bound)."""

    m: int
    n: int
    k: int
    alone_seconds: float
    beside_seconds: float
    collective_bytes: int
    outlasted: bool

    @property
    def share(self) -> float:
        """φ = 1 - alone / beside (docs/cost-model.md, "Contention": a product beside a collective runs at
        1 - φ of its rate), clipped to [0, 0.95]."""
        return min(max(1.0 - self.alone_seconds / self.beside_seconds, 0.0), 0.95)


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
    timing: str = "per call, timed by the wall clock"
    sm_count: int | None = None
    sm_source: str = "no multiprocessor count reported"
    attention: Section[AttentionPoint] = Section(skipped="not timed")
    host_copies: Section[HostPoint] = Section(skipped="not timed")
    fp8: Section[Fp8Point] = Section(skipped="not timed")
    host_memory_bytes: float | None = None
    contention: Contention | None = None


# ----------------------------------------------------------------------------------------------- timing
@dataclass(frozen=True)
class Timing:
    """Seconds per call (median over ``repeats`` loops of ``calls`` back-to-back calls)."""

    seconds: float
    calls: int
    repeats: int


def calls_for(seconds: float, calls: int, min_seconds: float, max_calls: int) -> int:
    """Calls that make a loop last ``min_seconds`` when ``calls`` calls took ``seconds``:
    ceil(min_seconds * calls / seconds), within [1, max_calls]."""
    if seconds <= 0:
        return max_calls
    return max(1, min(max_calls, math.ceil(min_seconds * calls / seconds)))


def amortised_seconds(call: Callable[[], Any], loop: Loop, repeats: int, min_seconds: float, max_calls: int,
                      agree: Callable[[int], int] = lambda n: n) -> Timing:
    """Seconds per call of ``call`` (module docstring): one warm-up call, a one-call probe, a loop of
    n_1 calls, then ``repeats`` loops of n; ``agree`` maps each chosen count to the one every process of a
    collective uses (their maximum), so that all make the same calls."""
    loop(call, 1)
    n1 = agree(calls_for(loop(call, 1), 1, min_seconds, max_calls))
    n = agree(calls_for(loop(call, n1), n1, min_seconds, max_calls)) if n1 > 1 else 1
    times = [loop(call, n) / n for _ in range(repeats)]
    return Timing(statistics.median(times), n, repeats)


def wall_loop(finish: Callable[[Any], Any] = lambda out: None, keep_all: bool = False,
              clock: Callable[[], float] = time.perf_counter) -> Loop:
    """A :data:`Loop` timed by ``clock`` around n calls and ``finish(last result)`` (or ``finish`` of the
    list of all results when ``keep_all``)."""
    def loop(call: Callable[[], Any], n: int) -> float:
        outs: list[Any] = []
        out = None
        t0 = clock()
        for _ in range(n):
            out = call()
            if keep_all:
                outs.append(out)
        finish(outs if keep_all else out)
        return clock() - t0
    return loop


def cuda_event_loop() -> Loop:
    """A :data:`Loop` timed by CUDA events recorded on the current stream before and after the n calls."""
    import torch

    def loop(call: Callable[[], Any], n: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3  # milliseconds
    return loop


def _guard(section: Callable[[], tuple[T, ...]], cleanup: Callable[[], None] = lambda: None) -> Section[T]:
    """Run one optional program; its exception becomes the section's ``error`` (kept in the file)."""
    try:
        rows = tuple(section())
        return Section(rows) if rows else Section(skipped="no shapes or sizes asked for it")
    except Exception as exc:  # noqa: BLE001 (a failing optional section must not lose the rest of the calibration)
        return Section(error=repr(exc)[:500])
    finally:
        cleanup()


# ----------------------------------------------------------------------------------------------- helpers
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


def _host_memory() -> float | None:
    """The host's physical memory in bytes as the OS reports it (sysconf), or None where it reports none."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


def _now() -> str:
    return f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC"


def _check(engine: str, dtype: str, devices: int | None) -> None:
    if engine not in ENGINES:
        raise ShardplanError(f"calibrate: engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if dtype not in DTYPES:
        raise ShardplanError(f"calibrate: dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if devices is not None and (not isinstance(devices, int) or isinstance(devices, bool) or devices < 1):
        raise ShardplanError(f"calibrate: devices must be a positive integer, got {devices!r}")


def _timing_words(sizes: Sizes, clock: str) -> str:
    """How every time was taken, for the sources."""
    return (f"per call: the median of {sizes.repeats} loops of n back-to-back calls (n for a loop of about "
            f"{sizes.min_loop_seconds * 1e3:g} ms, at most {sizes.max_calls}) after a warm-up call, timed by {clock}")


def _products(sizes: Sizes) -> tuple[tuple[str, int, int, int], ...]:
    """The layer products, then the squares (label empty)."""
    return sizes.layer_shapes + tuple(("", m, n, k) for m, n, k in sizes.matmul_shapes)


# ----------------------------------------------------------------------------------------------- JAX
def measure_jax(devices: int | None = None, sizes: Sizes | None = None, dtype: str = "fp32") -> Calibration:
    """Time the programs on the first ``devices`` JAX devices (default: all), all at once; ``sizes``
    default :data:`FULL` on GPUs and TPUs, :data:`HOST` on CPUs."""
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
    cpu = devs[0].platform == "cpu"
    sizes = sizes or (HOST if cpu else FULL)
    dt = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}[dtype]
    mesh = Mesh(np.array(devs), ("d",))
    split = NamedSharding(mesh, P("d"))
    keys = iter(jax.random.split(jax.random.key(0), 64 + len(_products(sizes)) + 4 * len(sizes.attention_shapes)))

    draw = jax.jit(lambda key, shape: jax.random.normal(key, (p, *shape), dt), static_argnums=1,
                   out_shardings=split)

    rng = np.random.default_rng(0)

    def normal(shape: tuple[int, ...]) -> Any:  # (p, *shape), one slice per device, drawn where it lives
        if cpu:  # host memory is the devices': numpy's draw needs no compilation per shape
            return jax.device_put(rng.standard_normal((p, *shape), np.float32).astype(dt), split)
        return draw(next(keys), shape)

    def zeros(shape: tuple[int, ...]) -> Any:
        return jax.device_put(np.zeros((p, *shape), dt), split)

    loop = wall_loop(jax.block_until_ready, keep_all=cpu)  # CPU programs may run side by side: wait for all

    def time_it(f: Callable[..., Any], *xs: Any) -> Timing:
        return amortised_seconds(lambda: f(*xs), loop, sizes.repeats, sizes.min_loop_seconds, sizes.max_calls)

    bmm = jax.jit(jnp.matmul, out_shardings=split)
    matmuls = []
    for label, m, n, k in _products(sizes):
        a, b = normal((m, k)), normal((k, n))
        t = time_it(bmm, a, b)
        matmuls.append(MatmulPoint(m, n, k, t.seconds, label, t.calls))
        del a, b
    scale = jax.jit(lambda v: v * 2, out_shardings=split)
    x = normal((sizes.elementwise_bytes // DTYPES[dtype],))
    t_elem = time_it(scale, x).seconds
    del x
    attention = _guard(lambda: _jax_attention(sizes, mesh, normal, time_it, ("xla",) if cpu else ("cudnn", "xla")))
    collectives: list[CollectivePoint] = []
    dispatch = 0.0
    if p > 1:
        psum = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "d"), mesh=mesh, in_specs=P("d"), out_specs=P("d")))
        for b in sizes.collective_bytes:
            v = zeros((max(1, b // DTYPES[dtype]),))
            collectives.append(CollectivePoint(b, time_it(psum, v).seconds, p))
        small = zeros((max(1, sizes.collective_bytes[0] // DTYPES[dtype]),))
        dispatch = time_it(scale, small).seconds
    stats = devs[0].memory_stats() if hasattr(devs[0], "memory_stats") else None
    limit = (stats or {}).get("bytes_limit")
    cores = getattr(devs[0], "core_count", None) if devs[0].platform == "gpu" else None
    sm_source = (f"jax Device.core_count of {devs[0].device_kind}" if isinstance(cores, int) and cores > 0 else
                 f"JAX reports no multiprocessor count for {devs[0].platform} devices")
    not_torch = Section(skipped="timed through PyTorch only, --engine torch")
    return Calibration("jax", p, devs[0].device_kind, dtype, _now(),
                       _host({"jax": jax.__version__, "jaxlib": getattr(jax.lib, "__version__", jax.__version__),
                              "numpy": np.__version__, "backend": jax.default_backend()}),
                       tuple(matmuls), sizes.elementwise_bytes, t_elem, tuple(collectives),
                       "jax psum under jax.shard_map", dispatch, float(limit) if limit else None,
                       "" if p > 1 else "one device: no collective to time",
                       timing=_timing_words(sizes, "time.perf_counter, blocking on "
                                            + ("every result" if cpu else "the last result")),
                       sm_count=cores if isinstance(cores, int) and cores > 0 else None, sm_source=sm_source,
                       attention=attention, host_copies=not_torch, fp8=not_torch)


def _jax_attention(sizes: Sizes, mesh: Any, normal: Callable[[tuple[int, ...]], Any],
                   time_it: Callable[..., Timing], impls: tuple[str, ...]) -> tuple[AttentionPoint, ...]:
    """Causal ``jax.nn.dot_product_attention`` per device (``shard_map`` over the devices' batches), forward
    and forward + backward (``jax.vjp``), by the first of ``impls`` that runs (GPUs: cuDNN's kernel, else
    XLA's; a refusal is kept in the row)."""
    import jax
    from jax.sharding import PartitionSpec as P

    spec = P("d")

    def programs(impl: str) -> tuple[Any, Any]:
        def attend(q: Any, k: Any, v: Any) -> Any:
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)

        def fwd(q: Any, k: Any, v: Any) -> Any:
            return attend(q[0], k[0], v[0])[None]

        def fwd_bwd(q: Any, k: Any, v: Any, g: Any) -> Any:
            _, pullback = jax.vjp(attend, q[0], k[0], v[0])
            return tuple(x[None] for x in pullback(g[0]))
        return (jax.jit(jax.shard_map(fwd, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)),
                jax.jit(jax.shard_map(fwd_bwd, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec,) * 3)))

    rows = []
    for b, h, s, d in sizes.attention_shapes:
        q, k, v, g = (normal((b, s, h, d)) for _ in range(4))  # JAX's layout: batch, sequence, heads, head dim
        refused = ""
        for impl in impls:
            try:
                fwd, fwd_bwd = programs(impl)
                tf, tb = time_it(fwd, q, k, v), time_it(fwd_bwd, q, k, v, g)
                break
            except Exception as exc:  # cuDNN refuses some shapes and dtypes: XLA's kernel then
                if impl == impls[-1]:
                    raise
                refused += f" ({impl} refused: {exc!r:.200})"
        rows.append(AttentionPoint(b, h, s, d, tf.seconds, tb.seconds,
                                   f"jax.nn.dot_product_attention {impl}{refused}"))
    return tuple(rows)


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


@dataclass(frozen=True)
class _TorchCompute:
    matmuls: tuple[MatmulPoint, ...]
    elementwise_seconds: float
    dispatch_seconds: float
    attention: Section[AttentionPoint]
    host_copies: Section[HostPoint]
    fp8: Section[Fp8Point]
    timing: str


def _torch_compute(sizes: Sizes, dtype: str, device: Any) -> _TorchCompute:
    """Every program of one process on its device (one GPU, else the CPU)."""
    import torch

    cuda = device.type == "cuda"
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    loop = cuda_event_loop() if cuda else wall_loop()

    def time_it(f: Callable[[], Any]) -> Timing:
        return amortised_seconds(f, loop, sizes.repeats, sizes.min_loop_seconds, sizes.max_calls)

    def free() -> None:
        if cuda:
            torch.cuda.empty_cache()

    points = []
    with torch.no_grad():
        for label, m, n, k in _products(sizes):
            a, b = torch.randn((m, k), dtype=dt, device=device), torch.randn((k, n), dtype=dt, device=device)
            t = time_it(lambda a=a, b=b: a @ b)
            points.append(MatmulPoint(m, n, k, t.seconds, label, t.calls))
        x = torch.randn(sizes.elementwise_bytes // DTYPES[dtype], dtype=dt, device=device)
        t_elem = time_it(lambda: x * 2).seconds
        small = torch.zeros(max(1, sizes.collective_bytes[0] // DTYPES[dtype]), dtype=dt, device=device)
        dispatch = time_it(lambda: small * 2).seconds
    free()
    attention = _guard(lambda: _torch_attention(sizes, dt, device, time_it), free)
    no_cuda = "no CUDA device: CPU only"
    if not cuda:
        host, fp8 = Section(skipped=no_cuda), Section(skipped=no_cuda)
    else:
        host = _guard(lambda: _torch_host(sizes, device, time_it), free)
        cap = torch.cuda.get_device_capability(device)
        if cap < FP8_CAPABILITY or not hasattr(torch, "float8_e4m3fn") or not hasattr(torch, "_scaled_mm"):
            fp8 = Section(skipped=f"compute capability {cap[0]}.{cap[1]} or this torch has no FP8 products "
                                  f"(torch._scaled_mm on float8_e4m3fn, capability 8.9+)")
        else:
            fp8 = _guard(lambda: _torch_fp8(sizes, device, time_it), free)
    timing = _timing_words(sizes, "CUDA events on the current stream" if cuda else "time.perf_counter")
    return _TorchCompute(tuple(points), t_elem, dispatch, attention, host, fp8, timing)


def _torch_attention(sizes: Sizes, dt: Any, device: Any,
                     time_it: Callable[[Callable[[], Any]], Timing]) -> tuple[AttentionPoint, ...]:
    """Causal ``scaled_dot_product_attention`` (the backend PyTorch picks), forward under ``no_grad`` and
    forward + the gradients of q, k, v (``torch.autograd.grad``)."""
    import torch
    import torch.nn.functional as F

    rows = []
    for b, h, s, d in sizes.attention_shapes:
        q, k, v = (torch.randn((b, h, s, d), dtype=dt, device=device, requires_grad=True) for _ in range(3))
        g = torch.randn((b, h, s, d), dtype=dt, device=device)

        def fwd(q: Any = q, k: Any = k, v: Any = v) -> Any:
            with torch.no_grad():
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def fwd_bwd(q: Any = q, k: Any = k, v: Any = v, g: Any = g) -> Any:
            return torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), g)
        tf, tb = time_it(fwd), time_it(fwd_bwd)
        rows.append(AttentionPoint(b, h, s, d, tf.seconds, tb.seconds,
                                   "torch.nn.functional.scaled_dot_product_attention"))
    return tuple(rows)


def _torch_host(sizes: Sizes, device: Any, time_it: Callable[[Callable[[], Any]], Timing]) -> tuple[HostPoint, ...]:
    """``copy_(non_blocking=True)`` between pinned host memory and the device, each direction."""
    import torch

    rows = []
    for nbytes in sizes.host_bytes:
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        up = time_it(lambda dev=dev, host=host: dev.copy_(host, non_blocking=True))
        down = time_it(lambda dev=dev, host=host: host.copy_(dev, non_blocking=True))
        torch.cuda.synchronize(device)
        rows.append(HostPoint(nbytes, up.seconds, down.seconds))
    return tuple(rows)


def _torch_fp8(sizes: Sizes, device: Any, time_it: Callable[[Callable[[], Any]], Timing]) -> tuple[Fp8Point, ...]:
    """``torch._scaled_mm`` of an E4M3 M x K (row-major) by an E4M3 K x N (column-major, as cuBLASLt
    wants it), per-tensor float32 scales of 1, bf16 output."""
    import torch

    rows = []
    one = torch.ones((), dtype=torch.float32, device=device)
    for m, n, k in sizes.fp8_shapes:
        a = torch.randn((m, k), device=device).to(torch.float8_e4m3fn)
        b = torch.randn((n, k), device=device).to(torch.float8_e4m3fn).t()
        t = time_it(lambda a=a, b=b: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
        rows.append(Fp8Point(m, n, k, t.seconds))
    return tuple(rows)


def free_port() -> int:
    """A TCP port on 127.0.0.1 free at the time of the call (the rendezvous of the process group)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torch_rank(rank: int, world: int, port: int, sizes: Sizes, dtype: str, out: Any) -> None:
    """One process of the group: time every all-reduce size (all ranks agree on the calls per loop, their
    maximum); rank 0 puts (bytes, seconds) pairs on ``out``."""
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

        def agree(n: int) -> int:
            c = torch.tensor([n], dtype=torch.int64, device=device)
            dist.all_reduce(c, op=dist.ReduceOp.MAX)
            return int(c.item())
        loop = wall_loop(lambda _: _torch_sync(device))
        got = []
        for b in sizes.collective_bytes:
            v = torch.zeros(max(1, b // DTYPES[dtype]), dtype=dt, device=device)
            dist.barrier()
            t = amortised_seconds(lambda v=v: dist.all_reduce(v), loop, sizes.repeats, sizes.min_loop_seconds,
                                  sizes.max_calls, agree)
            got.append((b, t.seconds))
        contention = _torch_contention(device, dt, sizes, got[-1], agree)
        if rank == 0:
            out.put((backend, got, contention))
    finally:
        dist.destroy_process_group()


def _torch_contention(device: Any, dt: Any, sizes: Sizes, largest: tuple[int, float],
                       agree: Callable[[int], int]) -> Contention:
    """The share of the device a running all-reduce takes from a product beside it, on every rank of the group.

    The largest product of ``sizes`` is timed alone (a loop of about ``min_loop_seconds``), then the same loop
    while back-to-back asynchronous all-reduces of the largest size (``largest``: its bytes and seconds) run on
    the collective's own stream or thread, as many as cover twice the loop's time alone (all ranks issue the
    maximum); a loop that ends after its all-reduces is not counted and the next one issues twice as many (at
    most ``2 * repeats`` loops). Each time is the median of ``repeats`` loops, seconds per product;
    ``outlasted`` says whether the median is over loops that ran beside the all-reduces throughout (else over
    the others: a lower bound on the slowdown)."""
    import torch
    import torch.distributed as dist

    m, n, k = max(sizes.matmul_shapes, key=lambda s: s[0] * s[1] * s[2])
    a = torch.randn(m, k, dtype=dt, device=device)
    b = torch.randn(k, n, dtype=dt, device=device)

    def products(calls: int) -> float:
        """Seconds per product of ``calls`` back-to-back products (the products' stream only)."""
        t0 = time.perf_counter()
        for _ in range(calls):
            torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        return (time.perf_counter() - t0) / calls

    products(1)
    first = products(1)
    calls = calls_for(first, 1, sizes.min_loop_seconds, sizes.max_calls)
    alone = statistics.median(products(calls) for _ in range(sizes.repeats))
    nbytes, each = largest
    v = torch.zeros(max(1, nbytes // a.element_size()), dtype=dt, device=device)
    cap = 10_000
    count = agree(min(max(1, math.ceil(2.0 * alone * calls / max(each, 1e-9))), cap))
    beside, covered = [], []
    for _ in range(2 * sizes.repeats):  # loops the all-reduces did not outlast are retried with twice as many
        dist.barrier()
        handles = [dist.all_reduce(v, async_op=True) for _ in range(count)]
        seconds = products(calls)
        still_running = not all(h.is_completed() for h in handles)
        for h in handles:
            h.wait()
        _torch_sync(device)
        (covered if still_running else beside).append(seconds)
        if not still_running:
            count = min(2 * count, cap)
        count = agree(count)  # every rank issues as many all-reduces as the one that needs most
        if agree(int(len(covered) < sizes.repeats)) == 0:  # the ranks stop together, once each has its loops
            break
    outlasted = bool(covered)
    return Contention(m, n, k, alone, statistics.median(covered or beside), nbytes, outlasted)


def _torch_collectives(world: int, sizes: Sizes, dtype: str) -> tuple[str, tuple[CollectivePoint, ...],
                                                                      Contention]:
    """``world`` processes (spawned) in one gloo / NCCL group timing all-reduce and its contention with a
    product (:func:`_torch_contention`); the times of rank 0."""
    import multiprocessing as mp
    import queue

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_torch_rank, args=(r, world, port, sizes, dtype, out)) for r in range(world)]
    for proc in procs:
        proc.start()
    try:
        backend, got, contention = out.get(timeout=600)
    except queue.Empty:  # a rank failed; its error is on stderr
        raise ShardplanError(f"calibrate: the {world} torch.distributed processes did not report all-reduce times "
                             f"(see their errors above)") from None
    finally:
        for proc in procs:
            proc.join(60)
            if proc.is_alive():
                proc.terminate()
    return backend, tuple(CollectivePoint(b, t, world) for b, t in got), contention


def measure_torch(devices: int = 1, sizes: Sizes | None = None, dtype: str = "fp32") -> Calibration:
    """Time the programs in this process (one GPU, else the CPU; ``sizes`` default :data:`FULL` on a GPU,
    :data:`HOST` on the CPU), and all-reduce in ``devices`` spawned processes (gloo on CPU, NCCL on
    GPUs); with 1 process no group and no collective."""
    _check("torch", dtype, devices)
    import torch

    device, kind = _torch_device()
    cuda = device.type == "cuda"
    sizes = sizes or (FULL if cuda else HOST)
    got = _torch_compute(sizes, dtype, device)
    memory = float(torch.cuda.get_device_properties(device).total_memory) if cuda else None
    sm = int(torch.cuda.get_device_properties(device).multi_processor_count) if cuda else None
    backend, collectives, note = "", (), "one process, no process group: no collective to time"
    contention = None
    if devices > 1:
        backend, collectives, contention = _torch_collectives(devices, sizes, dtype)
        note = ""
    return Calibration("torch", devices, kind, dtype, _now(),
                       _host({"torch": torch.__version__, "device": str(device),
                              "torch_threads": str(torch.get_num_threads())}),
                       got.matmuls, sizes.elementwise_bytes, got.elementwise_seconds, collectives,
                       f"torch.distributed.all_reduce on {backend}" if backend else "", got.dispatch_seconds,
                       memory, note, timing=got.timing, sm_count=sm,
                       sm_source=(f"torch.cuda.get_device_properties({device.index}).multi_processor_count of {kind}"
                                  if cuda else "no CUDA device: CPU only"),
                       attention=got.attention, host_copies=got.host_copies, fp8=got.fp8,
                       host_memory_bytes=_host_memory() if got.host_copies.rows else None, contention=contention)


def calibrate(engine: str, devices: int | None = None, quick: bool = False, dtype: str = "fp32") -> Calibration:
    """Measure this machine through ``engine`` (``"jax"``: all JAX devices unless ``devices``; ``"torch"``:
    ``devices`` processes, default 1); ``quick``: :data:`QUICK` sizes (seconds), else :data:`FULL` on
    accelerators and :data:`HOST` on CPUs."""
    _check(engine, dtype, devices)
    sizes = QUICK if quick else None
    if engine == "jax":
        return measure_jax(devices, sizes, dtype)
    return measure_torch(1 if devices is None else devices, sizes, dtype)


# ----------------------------------------------------------------------------------------------- the profile
def utilisation(points: tuple[MatmulPoint, ...] | tuple[Fp8Point, ...], sm_count: int | None) -> tuple[float, ...]:
    """The cost model's tile and wave utilisation u of every product (1 without ``sm_count``)."""
    if sm_count is None:
        return tuple(1.0 for _ in points)
    from shardplan.cost.operator import gemm_utilisation
    from shardplan.machine import Machine

    tiled = Machine(1, sm_count=sm_count, gemm_tiles=GEMM_TILES)
    return tuple(float(gemm_utilisation(1.0, pt.m, pt.n, tiled)) for pt in points)


def efficiency(cal: Calibration) -> tuple[float, tuple[MatmulPoint, ...]]:
    """``flops_efficiency`` (module docstring) and the products it is the median over."""
    best = max(pt.rate for pt in cal.matmuls)
    layers = tuple(pt for pt in cal.matmuls if pt.layer) or cal.matmuls
    u = utilisation(layers, cal.sm_count)
    return min(1.0, statistics.median(pt.rate / (ui * best) for pt, ui in zip(layers, u))), layers


def fp8_efficiency(cal: Calibration) -> float | None:
    """``fp8_efficiency``: the median over the FP8 products of rate / (u * best FP8 rate), u each product's tile
    and wave utilisation (:func:`utilisation`), capped at 1; None when no FP8 product was timed."""
    rows = cal.fp8.rows
    if not rows:
        return None
    best = max(r.rate for r in rows)
    u = utilisation(rows, cal.sm_count)
    return min(1.0, statistics.median(r.rate / (ui * best) for r, ui in zip(rows, u)))


def latency_of(cal: Calibration, bandwidth: float) -> float:
    """alpha = (t_small - 2 (p - 1) / p * b_small / B - t_dispatch) / (2 (p - 1)), floored at 0 (module docstring)."""
    p = cal.devices
    small = min(cal.collectives, key=lambda c: c.bytes)
    beyond = small.seconds - 2.0 * (p - 1) / p * small.bytes / bandwidth - cal.dispatch_seconds
    return max(beyond, 0.0) / (2 * (p - 1))


def host_link(rows: tuple[HostPoint, ...]) -> tuple[float, float]:
    """(host_bandwidth, host_latency) of the copies (module docstring): the slower direction's b / t at the
    largest size, the larger max(0, t_small - b_small / B) of the two directions."""
    small, large = min(rows, key=lambda r: r.bytes), max(rows, key=lambda r: r.bytes)
    up, down = large.bytes / large.to_device_seconds, large.bytes / large.to_host_seconds
    alpha = max(small.to_device_seconds - small.bytes / up, small.to_host_seconds - small.bytes / down, 0.0)
    return min(up, down), alpha


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
    timed = cal.timing
    best = max(cal.matmuls, key=lambda pt: pt.rate)
    eff, over = efficiency(cal)
    together = f"all {p} devices at once" if p > 1 else "one device"
    if cal.engine == "torch" and p > 1:
        together = "one process alone (the all-reduce runs in separate processes)"
    hbm = 2.0 * cal.elementwise_bytes / cal.elementwise_seconds
    what = (f"the median over the {len(over)} transformer-layer products (forward, input and weight gradients of "
            f"qkv, out, up, down)" if any(pt.layer for pt in cal.matmuls)
            else f"the median over all {len(over)} products (no transformer-layer shapes timed)")
    per_u = (f" of rate / (u * best), u the cost model's tile and wave utilisation of each product at the measured "
             f"sm_count {cal.sm_count} and gemm_tiles" if cal.sm_count else " of rate / best")
    src = {
        "peak_flops": f"{by}: the best {cal.dtype} matmul rate over {len(cal.matmuls)} products on random data, "
                      f"{together}, {timed}: {best.m}x{best.k} @ {best.k}x{best.n}"
                      f"{' (' + best.layer + ')' if best.layer else ''}, 2*M*N*K / t = {_g(best.rate)} FLOP/s per "
                      f"device (a measured peak, not the vendor's; the per-product table is under 'measurements')",
        "flops_efficiency": f"{by}: {what}{per_u}: {_g(eff)} (capped at 1); the best rate is {_g(best.rate)} FLOP/s",
        "hbm_bandwidth": f"{by}: elementwise x * 2 on {fmt_bytes(cal.elementwise_bytes)} per device, {together}, "
                         f"{timed}: 2 * b / t = {_g(hbm)} B/s per device (b read, b written)",
        "dtype_bytes": f"{said}: the dtype every program was timed in ({cal.dtype})",
        "node_size": f"{said}: one host, one level (not measured across hosts)",
        "inter_bandwidth": f"{said}: one host, no link across nodes (not measured)",
        "inter_latency": f"{said}: one level (not measured)",
        "pod_nodes": f"{said}: one level (not measured)", "pod_bandwidth": f"{said}: one level (not measured)",
        "pod_latency": f"{said}: one level (not measured)",
        "convert_bandwidth": f"{said}: not measured (no converting kernel is timed): casts and the optimizer step "
                             "at hbm_bandwidth (edit the file to add it)",
    }
    if cal.memory_bytes:
        src["memory_bytes"] = f"{said}: the device's memory as its library reports it ({fmt_bytes(cal.memory_bytes)})"
    else:
        src["memory_bytes"] = (f"{said}: not measured: no per-device limit reported (CPU devices share the host's "
                               f"RAM); pass budget=")
    if cal.collectives:
        top = max(cal.collectives, key=lambda c: c.bytes)
        bandwidth = top.bus_bandwidth
        latency = latency_of(cal, bandwidth)
        small = min(cal.collectives, key=lambda c: c.bytes)
        src["bandwidth"] = (f"{by}: {cal.collective_library}, all-reduce of {fmt_bytes(top.bytes)} per device over "
                            f"{p} devices, {timed}: bus bandwidth 2*(p-1)/p * b / t = {_g(bandwidth)} B/s (the ring "
                            f"model's B; the per-size table is under 'measurements')")
        src["latency"] = (f"{by}: all-reduce of {fmt_bytes(small.bytes)} took {_g(small.seconds)} s per call, its "
                          f"bandwidth term {_g(2 * (p - 1) / p * small.bytes / bandwidth)} s and an elementwise "
                          f"program of the same size {_g(cal.dispatch_seconds)} s per call; the rest over the "
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
    src["stepwise_redistribution"] = (f"{said}: not measured: shardplan's default, a change of layout charged as "
                                      "the one-collective steps XLA lowers it to (see Machine's docstring)")
    src["reduce_per_dim"] = (f"{said}: not measured: shardplan's default, a partial sum over several split dims "
                             "charged as one all-reduce per dim, as XLA lowers it and the PyTorch run reduces it "
                             "(see Machine's docstring)")
    src["scatter_gathered_grads"] = (f"{said}: not measured: shardplan's default, off (XLA's GSPMD); shardplan.torch "
                                     "sets it for DTensor (see Machine's docstring)")
    src["overlap_dgrad"] = (f"{said}: not measured: shardplan's default, off (an input-gradient collective charged "
                            "in full); a recipe's overlap=dgrad sets it (see Machine's docstring)")
    src["grad_accum_bytes"] = (f"{said}: not measured: shardplan's default, 0 (weight gradients accumulated inside "
                               "their products); a recipe's grad_accum=autograd sets 3 x dtype_bytes (see Machine's "
                               "docstring)")
    contention = 0.0
    if cal.contention is not None:
        c = cal.contention
        contention = round(c.share, 3)
        short = "" if c.outlasted else " (the all-reduces never outlasted a loop: a lower bound)"
        src["comm_contention"] = (
            f"{by}: a {c.m}x{c.k} @ {c.k}x{c.n} product {_g(c.alone_seconds)} s alone and {_g(c.beside_seconds)} s "
            f"beside back-to-back all-reduces of {fmt_bytes(c.collective_bytes)} ({cal.collective_library}), "
            f"median of loops, all {p} devices at once: 1 - alone / beside = "
            f"{_g(1.0 - c.alone_seconds / c.beside_seconds)}{short}, clipped to [0, 0.95] (docs/cost-model.md, "
            f"'Contention')")
    else:
        why = "one device: no collective beside a product" if p == 1 else f"not timed through {cal.engine}"
        src["comm_contention"] = (f"{said}: not measured ({why}): "
                                  "shardplan's default, 0 (an overlapped collective costs the product beside it "
                                  "nothing); NCCL's channels / SMs where known (the a100 and h100 profiles, "
                                  "docs/cost-model.md, 'Contention')")
    fp8 = max((r.rate for r in cal.fp8.rows), default=None)
    if cal.fp8.rows:
        top8 = max(cal.fp8.rows, key=lambda r: r.rate)
        src["fp8_flops"] = (f"{by}: the best torch._scaled_mm rate (E4M3 x E4M3, per-tensor scales, bf16 output) over "
                            f"{len(cal.fp8.rows)} products on random data, {timed}: {top8.m}x{top8.k} @ "
                            f"{top8.k}x{top8.n}, 2*M*N*K / t = {_g(fp8)} FLOP/s (a measured peak like peak_flops; "
                            f"the table is under 'measurements')")
        fp8_eff = fp8_efficiency(cal)
        per_u8 = (f"rate / (u * fp8_flops), u the cost model's tile and wave utilisation of each product at the "
                  f"measured sm_count {cal.sm_count} and gemm_tiles" if cal.sm_count else "rate / fp8_flops")
        src["fp8_efficiency"] = (f"{by}: the median over the {len(cal.fp8.rows)} torch._scaled_mm products of "
                                 f"{per_u8}: {_g(fp8_eff or 0.0)} (capped at 1; the operands were cast before the "
                                 f"timed calls: the FP8 casts are charged apart, at hbm_bandwidth)")
    else:
        fp8_eff = None
        src["fp8_flops"] = f"{said}: not measured ({cal.fp8.why_not}): no FP8 products offered (edit the file to add)"
        src["fp8_efficiency"] = f"{said}: not measured ({cal.fp8.why_not}): no FP8 products"
    host_bw: float | None = None
    host_alpha = 0.0
    if cal.host_copies.rows:
        host_bw, host_alpha = host_link(cal.host_copies.rows)
        rows = cal.host_copies.rows
        lo, hi = min(r.bytes for r in rows), max(r.bytes for r in rows)
        src["host_bandwidth"] = (f"{by}: pinned host <-> device copy_(non_blocking=True) of {fmt_bytes(hi)}, "
                                 f"{timed}: b / t of the slower direction, {_g(host_bw)} B/s (the table, "
                                 f"{fmt_bytes(lo)} .. {fmt_bytes(hi)} both ways, is under 'measurements')")
        src["host_latency"] = (f"{by}: the {fmt_bytes(lo)} copy's time beyond b / host_bandwidth, the larger of the "
                               f"two directions (floored at 0): {_g(host_alpha)} s per copy")
    else:
        why = cal.host_copies.why_not
        src["host_bandwidth"] = f"{said}: not measured ({why}): no host offload offered (edit the file to add it)"
        src["host_latency"] = f"{said}: not measured ({why}); 0"
    host_memory = cal.host_memory_bytes if host_bw is not None else None
    if host_memory:
        src["host_memory_bytes"] = (f"{said}: the host's physical memory as the OS reports it (sysconf), "
                                    f"{fmt_bytes(host_memory)}, shared by the devices of this one-level machine")
    else:
        src["host_memory_bytes"] = f"{said}: not measured (no host copies timed): no host offload offered"
    src["cpu_adam_rate"] = f"{said}: not measured: no optimizer offload offered (edit the file to add it)"
    if cal.sm_count:
        tiles = ", ".join(f"{r} x {c}" for r, c in GEMM_TILES)
        src["sm_count"] = f"{by}: {cal.sm_source} = {cal.sm_count}"
        src["gemm_tiles"] = (f"{said}: not measured: NVIDIA Deep Learning Performance documentation, Matrix "
                             f"Multiplication Background User's Guide, 'Dimension Quantization Effects': the "
                             f"library computes a product's output in tiles, one per multiprocessor at a time, "
                             f"choosing among tile shapes ({tiles}); written beside the measured sm_count")
    else:
        for k in ("sm_count", "gemm_tiles"):
            src[k] = (f"{said}: not measured ({cal.sm_source}): no tile or wave quantisation of matrix products "
                      f"(edit the file to add the device's multiprocessor count and its library's output tiles)")
    attention_eff: float | None = None
    if cal.attention.rows:
        effs = [r.model_flops / r.forward_backward_seconds / best.rate for r in cal.attention.rows]
        attention_eff = min(1.0, statistics.median(effs))
        src["attention_efficiency"] = (f"{by}: causal attention forward + backward ({cal.attention.rows[0].implementation}) "
                                       f"at {len(effs)} shapes, the cost model's FLOPs of the fused core / time / the "
                                       f"best product rate: median {_g(attention_eff)} (range {_g(min(effs))} .. "
                                       f"{_g(max(effs))}; the table is under 'measurements')")
    else:
        src["attention_efficiency"] = (f"{said}: not measured ({cal.attention.why_not}): fused attention at "
                                       f"flops_efficiency")
    for k in ("gemm_align", "gemm_unaligned_efficiency"):
        src[k] = (f"{said}: not measured: no penalty for product dimensions that are not multiples of the "
                  f"library's alignment (edit the file to add one)")
    label = name or f"calibrated-{cal.engine}-{cal.device_kind}"
    machine = Machine(1, peak_flops=best.rate, bandwidth=bandwidth, latency=latency, dtype_bytes=DTYPES[cal.dtype],
                      memory_bytes=cal.memory_bytes, name=label, hbm_bandwidth=hbm, flops_efficiency=eff,
                      grad_bucket_bytes=bucket, overlap_grad=overlap, sum_shared_grads=shared, fp8_flops=fp8,
                      fp8_efficiency=fp8_eff, host_bandwidth=host_bw, host_latency=host_alpha,
                      host_memory_bytes=host_memory,
                      sm_count=cal.sm_count or None, gemm_tiles=GEMM_TILES if cal.sm_count else None,
                      attention_efficiency=attention_eff, comm_contention=contention)
    host = ", ".join(f"{k} {v}" for k, v in cal.host)
    description = (f"Measured by shardplan calibrate --engine {cal.engine} on {cal.date}: {p} x {cal.device_kind} "
                   f"({cal.dtype}); host: {host}. Rates are per device with {together}; every time is {timed}. "
                   + (f"Collectives: {cal.collectives_note}." if cal.collectives_note
                      else f"Collectives: {cal.collective_library}.")
                   + " Causal attention gives attention_efficiency; its table is under 'measurements'.")
    return Profile.of(machine, src, (cal.device_kind,), description, measurements(cal))


def _section(sec: Section[Any], rows: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {**extra, "rows": rows}
    if sec.error:
        out["error"] = sec.error
    elif not sec.rows:
        out["not_measured"] = sec.skipped
    return out


def measurements(cal: Calibration) -> dict[str, Any]:
    """The raw tables of ``cal`` (kept in the machine file under ``"measurements"``)."""
    eff, _ = efficiency(cal)
    achievable = max(pt.rate for pt in cal.matmuls) * eff
    u = utilisation(cal.matmuls, cal.sm_count)
    return {
        "engine": cal.engine, "devices": cal.devices, "device_kind": cal.device_kind, "dtype": cal.dtype,
        "date": cal.date, "host": dict(cal.host), "timing": cal.timing,
        "sm_count": {"value": cal.sm_count, "source": cal.sm_source},
        "matmul": [{"m": pt.m, "n": pt.n, "k": pt.k, "layer": pt.layer, "calls_per_loop": pt.calls,
                    "seconds": pt.seconds, "flops_per_second": pt.rate, "utilisation": ui}
                   for pt, ui in zip(cal.matmuls, u)],
        "elementwise": {"bytes_per_device": cal.elementwise_bytes, "seconds": cal.elementwise_seconds,
                        "bytes_per_second": 2.0 * cal.elementwise_bytes / cal.elementwise_seconds},
        "all_reduce": {"library": cal.collective_library, "note": cal.collectives_note,
                       "dispatch_seconds": cal.dispatch_seconds,
                       "sizes": [{"bytes_per_device": c.bytes, "seconds": c.seconds,
                                  "bus_bytes_per_second": c.bus_bandwidth} for c in cal.collectives]},
        "contention": ({"m": cal.contention.m, "n": cal.contention.n, "k": cal.contention.k,
                        "product_seconds_alone": cal.contention.alone_seconds,
                        "product_seconds_beside_all_reduce": cal.contention.beside_seconds,
                        "all_reduce_bytes": cal.contention.collective_bytes,
                        "all_reduces_outlasted_the_products": cal.contention.outlasted,
                        "share": cal.contention.share}
                       if cal.contention is not None else {"skipped": "no collective beside a product was timed"}),
        "attention": _section(
            cal.attention,
            [{"batch": r.batch, "heads": r.heads, "seq": r.seq, "head_dim": r.head_dim, "causal": True,
              "implementation": r.implementation, "forward_seconds": r.forward_seconds,
              "forward_backward_seconds": r.forward_backward_seconds, "forward_flops_per_second": r.forward_rate,
              "forward_backward_flops_per_second": r.forward_backward_rate,
              "forward_over_achievable": r.forward_rate / achievable,
              "forward_backward_over_achievable": r.forward_backward_rate / achievable} for r in cal.attention.rows],
            flops="forward 2*b*h*s^2*d (causal: half of 4*b*h*s^2*d), forward + backward 3.5 times that",
            model="attention_efficiency is the median of the cost model's fused-core FLOPs / time / the best "
                  "product rate (shardplan/cost/fused.py); *_over_achievable is the measured rate over "
                  "peak_flops * flops_efficiency"),
        "host_copies": _section(
            cal.host_copies,
            [{"bytes": r.bytes, "host_to_device_seconds": r.to_device_seconds,
              "device_to_host_seconds": r.to_host_seconds,
              "host_to_device_bytes_per_second": r.bytes / r.to_device_seconds,
              "device_to_host_bytes_per_second": r.bytes / r.to_host_seconds} for r in cal.host_copies.rows],
            memory="pinned host memory, copy_(non_blocking=True)"),
        "fp8": _section(
            cal.fp8, [{"m": r.m, "n": r.n, "k": r.k, "seconds": r.seconds, "flops_per_second": r.rate}
                      for r in cal.fp8.rows],
            program="torch._scaled_mm, E4M3 x E4M3 -> bf16, per-tensor scales 1"),
    }
