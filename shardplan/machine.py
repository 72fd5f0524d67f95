"""The machine: devices, FLOP/s, links, latency, memory, element size.

A machine is one immutable value passed to every cost function; nothing is
cached anywhere else. Real clusters are hierarchical: ``node_size`` devices
share fast links (NVLink), nodes share a slower network (InfiniBand). A
collective whose group lies inside one node runs at ``bandwidth``; one that
crosses nodes runs at ``inter_bandwidth`` (the ring's bottleneck link).
Devices are numbered 0..p-1, node k holding devices k*node_size ...
(k+1)*node_size - 1.

Units: seconds, bytes, FLOP/s. The reference setting of the PaSE paper is
10 TFLOP/s and 16 GB/s, one level.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardplan.checks import integer, real
from shardplan.errors import ShardplanError

__all__ = ["Machine", "PRESETS", "preset", "DTYPE_BYTES"]

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp64": 8}

GiB = 1024**3


@dataclass(frozen=True)
class Machine:
    """An immutable description of p identical devices.

    Attributes:
        num_devices: p.
        peak_flops: FLOP/s of one device.
        bandwidth: bytes/s of a link inside a node (the only level when
            ``node_size`` is None).
        latency: alpha, seconds per message step inside a node (0 reproduces
            the reference model, which counts bandwidth only).
        dtype_bytes: bytes per tensor element (4 for fp32, 2 for bf16).
        memory_bytes: memory of one device, or None for unlimited.
        node_size: devices per node; None means one level.
        inter_bandwidth: bytes/s per device across nodes.
        inter_latency: alpha across nodes.
        name: a label for reports.
        pod_nodes: nodes per pod (a third level), or None.
        pod_bandwidth, pod_latency: bytes/s per device and alpha across pods.
        hbm_bandwidth: bytes/s of a device's memory (HBM); None: compute is FLOPs only (the paper's model).
        flops_efficiency: fraction of ``peak_flops`` a kernel achieves (1.0: the paper's model).
        grad_bucket_bytes: weight gradients are synchronised in fused buckets of this many bytes
            (PyTorch DDP's default bucket is 25 MiB); None: one all-reduce per tensor (the paper's model).
        overlap_grad: weight-gradient synchronisation overlaps the backward pass (DDP, FSDP);
            see :mod:`shardplan.cost.operator` for the exact form.
        sum_shared_grads: the gradients of a parameter read by several operators (a tied embedding)
            are summed on the device and the sum synchronised once, in the owner's layout (PyTorch
            accumulating ``.grad`` before DDP's all-reduce). False (default): every reader's gradient
            is synchronised in its own layout and the results added, as XLA's SPMD partitioner compiles
            it (one all-reduce per reader in the HLO, even when the readers agree on the layout).
    """

    num_devices: int
    peak_flops: float = 10e12
    bandwidth: float = 16e9
    latency: float = 0.0
    dtype_bytes: int = 4
    memory_bytes: float | None = None
    node_size: int | None = None
    inter_bandwidth: float | None = None
    inter_latency: float | None = None
    name: str = "custom"
    pod_nodes: int | None = None
    pod_bandwidth: float | None = None
    pod_latency: float | None = None
    hbm_bandwidth: float | None = None
    flops_efficiency: float = 1.0
    grad_bucket_bytes: float | None = None
    overlap_grad: bool = False
    sum_shared_grads: bool = False

    def __post_init__(self) -> None:
        def put(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        put("num_devices", integer("machine: num_devices", self.num_devices, minimum=1))
        put("peak_flops", real("machine: peak_flops", self.peak_flops, positive=True, unit="FLOP/s"))
        put("bandwidth", real("machine: bandwidth", self.bandwidth, positive=True, unit="B/s"))
        put("latency", real("machine: latency", self.latency, minimum=0.0, unit="s"))
        dtype_bytes = integer("machine: dtype_bytes", self.dtype_bytes)
        if dtype_bytes not in (1, 2, 4, 8):
            raise ShardplanError(f"machine: dtype_bytes must be 1, 2, 4 or 8, got {dtype_bytes!r}")
        put("dtype_bytes", dtype_bytes)
        if self.memory_bytes is not None:
            put("memory_bytes", real("machine: memory_bytes", self.memory_bytes, positive=True, unit="B"))
        if self.node_size is not None:
            put("node_size", integer("machine: node_size", self.node_size, minimum=1))
            if self.inter_bandwidth is None:
                raise ShardplanError("machine: a hierarchical machine (node_size set) needs a positive inter_bandwidth")
        if self.inter_bandwidth is not None:
            put("inter_bandwidth", real("machine: inter_bandwidth", self.inter_bandwidth, positive=True, unit="B/s"))
        if self.inter_latency is not None:
            put("inter_latency", real("machine: inter_latency", self.inter_latency, minimum=0.0, unit="s"))
        if not isinstance(self.name, str):
            raise ShardplanError(f"machine: name must be a string, got {self.name!r}")
        if self.hierarchical and self.num_devices % int(self.node_size):  # type: ignore[arg-type]
            raise ShardplanError(f"machine: {self.num_devices} devices do not fill whole nodes of {self.node_size}")
        if self.pod_nodes is not None:
            put("pod_nodes", integer("machine: pod_nodes", self.pod_nodes, minimum=1))
            if self.node_size is None:
                raise ShardplanError(f"machine: pod_nodes={self.pod_nodes!r} needs node_size")
            if self.pod_bandwidth is None:
                raise ShardplanError("machine: a machine with pods (pod_nodes set) needs a positive pod_bandwidth")
            per_pod = int(self.node_size) * self.pod_nodes
            if self.num_devices > per_pod and self.num_devices % per_pod:
                raise ShardplanError(f"machine: {self.num_devices} devices do not fill whole pods of {per_pod}")
        if self.pod_bandwidth is not None:
            put("pod_bandwidth", real("machine: pod_bandwidth", self.pod_bandwidth, positive=True, unit="B/s"))
        if self.pod_latency is not None:
            put("pod_latency", real("machine: pod_latency", self.pod_latency, minimum=0.0, unit="s"))
        if self.hbm_bandwidth is not None:
            put("hbm_bandwidth", real("machine: hbm_bandwidth", self.hbm_bandwidth, positive=True, unit="B/s"))
        if self.grad_bucket_bytes is not None:
            put("grad_bucket_bytes", real("machine: grad_bucket_bytes", self.grad_bucket_bytes, positive=True,
                                          unit="B"))
        efficiency = real("machine: flops_efficiency", self.flops_efficiency, positive=True, maximum=1.0)
        put("flops_efficiency", efficiency)
        if not isinstance(self.overlap_grad, bool):
            raise ShardplanError(f"machine: overlap_grad must be True or False, got {self.overlap_grad!r}")
        if not isinstance(self.sum_shared_grads, bool):
            raise ShardplanError(f"machine: sum_shared_grads must be True or False, got {self.sum_shared_grads!r}")

    @property
    def p(self) -> int:
        return self.num_devices

    @property
    def hierarchical(self) -> bool:
        """True when some groups of devices cross a node boundary."""
        return self.node_size is not None and self.node_size < self.num_devices

    @property
    def balance(self) -> float:
        """r = F / B: FLOPs one device does in the time one byte crosses a link (the paper's ratio)."""
        return self.peak_flops / self.bandwidth

    @property
    def levels(self) -> tuple[int, ...]:
        """Level sizes, innermost first (their product is p): ``(p,)`` on a one-level machine,
        ``(node_size, nodes)`` on two levels, ``(node_size, pod_nodes, pods)`` on three."""
        p = self.num_devices
        if not self.hierarchical:
            return (p,)
        ns = int(self.node_size)  # type: ignore[arg-type]
        nodes = p // ns
        if self.pod_nodes is not None and nodes > self.pod_nodes:
            return (ns, int(self.pod_nodes), nodes // int(self.pod_nodes))
        return (ns, nodes)

    @property
    def level_links(self) -> tuple[tuple[float, float], ...]:
        """(bandwidth bytes/s per device, latency s) of every level of :attr:`levels`, innermost first."""
        out = [(float(self.bandwidth), float(self.latency))]
        if len(self.levels) > 1:
            out.append(self.link(True))
        if len(self.levels) > 2:
            lat = self.pod_latency if self.pod_latency is not None else out[-1][1]
            out.append((float(self.pod_bandwidth), float(lat)))  # type: ignore[arg-type]
        return tuple(out)

    @property
    def achievable_flops(self) -> float:
        """FLOP/s a kernel reaches: peak times :attr:`flops_efficiency`."""
        return self.peak_flops * self.flops_efficiency

    def link(self, inter: bool) -> tuple[float, float]:
        """(bandwidth, latency) of the level: inside a node or across nodes."""
        if inter and self.hierarchical:
            lat = self.latency if self.inter_latency is None else self.inter_latency
            return float(self.inter_bandwidth), float(lat)  # type: ignore[arg-type]
        return float(self.bandwidth), float(self.latency)

    def describe(self) -> str:
        from shardplan.units import fmt_bytes, fmt_rate

        s = f"{self.name}: {self.num_devices} devices x {fmt_rate(self.peak_flops, 'FLOP/s')}"
        if self.flops_efficiency < 1:
            s += f" ({self.flops_efficiency:.0%} achievable)"
        if self.hbm_bandwidth is not None:
            s += f", HBM {fmt_rate(self.hbm_bandwidth, 'B/s')}"
        s += f", links {fmt_rate(self.bandwidth, 'B/s')}"
        if self.hierarchical:
            s += f" inside nodes of {self.node_size}, {fmt_rate(self.inter_bandwidth or 0, 'B/s')} across"
            if len(self.levels) > 2:
                s += f", {fmt_rate(self.pod_bandwidth or 0, 'B/s')} across pods of {self.pod_nodes} nodes"
        if self.memory_bytes:
            s += f", {fmt_bytes(self.memory_bytes)} per device"
        s += f", {self.dtype_bytes}-byte elements"
        return s


def _paper(p: int) -> Machine:
    return Machine(p, 10e12, 16e9, name="paper")


def _paper_1080ti(p: int) -> Machine:
    # Approximate: 11.3 TFLOP/s fp32; 8 GPUs per node over PCIe 3 x16 (~10 GB/s),
    # 56 Gb/s-class InfiniBand (~7 GB/s) across nodes.
    return Machine(p, 11.3e12, 10e9, node_size=8, inter_bandwidth=7e9, memory_bytes=11 * GiB, name="1080ti")


def _paper_2080ti(p: int) -> Machine:
    # Approximate: 13.4 TFLOP/s fp32 with a lower bandwidth-to-FLOP balance than the 1080 Ti nodes:
    # PCIe shared by more GPUs inside (~6 GB/s), a slower network across (~2.5 GB/s).
    return Machine(p, 13.4e12, 6e9, node_size=8, inter_bandwidth=2.5e9, memory_bytes=11 * GiB, name="2080ti")


DDP_BUCKET = 25 * 2**20  # PyTorch DistributedDataParallel's default bucket_cap_mb = 25
GPU_EFFICIENCY = 0.7  # assumption: large bf16 GEMMs reach about 70% of the dense peak on A100/H100


def _a100(p: int) -> Machine:
    # A100 SXM 80 GB (NVIDIA A100 datasheet): 312 TFLOP/s bf16 dense, HBM2e 2,039 GB/s;
    # NVLink3 600 GB/s total = 300 GB/s per direction per GPU; 8 x 200 Gb/s HDR IB per node = 25 GB/s
    # per GPU across nodes. Latencies: a few microseconds per NCCL step (nccl-tests small-message times).
    return Machine(p, 312e12, 300e9, latency=5e-6, dtype_bytes=2, memory_bytes=80 * GiB, node_size=8,
                   inter_bandwidth=25e9, inter_latency=10e-6, name="a100", hbm_bandwidth=2.039e12,
                   flops_efficiency=GPU_EFFICIENCY, grad_bucket_bytes=DDP_BUCKET, overlap_grad=True)


def _h100(p: int) -> Machine:
    # H100 SXM 80 GB (NVIDIA H100 datasheet): 989 TFLOP/s bf16 dense, HBM3 3.35 TB/s;
    # NVLink4 900 GB/s total = 450 GB/s per direction per GPU; 8 x 400 Gb/s NDR IB per node = 50 GB/s
    # per GPU across nodes.
    return Machine(p, 989e12, 450e9, latency=3e-6, dtype_bytes=2, memory_bytes=80 * GiB, node_size=8,
                   inter_bandwidth=50e9, inter_latency=8e-6, name="h100", hbm_bandwidth=3.35e12,
                   flops_efficiency=GPU_EFFICIENCY, grad_bucket_bytes=DDP_BUCKET, overlap_grad=True)


PRESETS = {
    "paper": _paper,
    "1080ti": _paper_1080ti,
    "2080ti": _paper_2080ti,
    "a100": _a100,
    "h100": _h100,
}


def preset(name: str, p: int) -> Machine:
    """A named machine with p devices: one of :data:`PRESETS`."""
    try:
        make = PRESETS[name]
    except KeyError:
        raise ShardplanError(f"unknown machine preset {name!r}; choose from {', '.join(sorted(PRESETS))}") from None
    return make(p)
