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

Machine profiles are JSON files (``shardplan/machines/*.json``, one per
device; copy one to describe another machine): every field of
:class:`Machine` but ``num_devices`` and ``name`` as ``{"value": v,
"source": "where v comes from"}``, plus ``name``, ``description`` and the
``device_kinds`` the device reports (``jax.Device.device_kind``,
``torch.cuda.get_device_name()``), and optionally ``measurements`` (any JSON
object: the raw tables a calibration measured, ``shardplan calibrate``;
carried, never read as constants). A field added since files were first
written (:data:`OPTIONAL_FIELDS`: ``fp8_efficiency``, ``overlap_dgrad``, ``grad_accum_bytes``,
``comm_contention``) may be absent from an older file: it reads as None (``overlap_dgrad``: False,
``grad_accum_bytes`` and ``comm_contention``: 0). The presets are read
from these files;
:func:`detect_machine` picks the profile whose device kinds hold the one
reported.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any

from shardplan.checks import integer, real
from shardplan.errors import ShardplanError

__all__ = ["Machine", "PRESETS", "preset", "DTYPE_BYTES", "Profile", "read_profile", "load_machine_file",
           "machine_to_file", "profile_names", "load_profile", "detect_machine", "normalise_kind"]

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
        fp8_flops: dense FP8 tensor-core FLOP/s of one device (reached at ``fp8_efficiency``);
            None: the device has no FP8 matrix products (the fit search offers none).
        fp8_efficiency: fraction of ``fp8_flops`` a full-wave FP8 matrix product reaches, under the same tile,
            wave and alignment utilisation as a 16-bit one (:meth:`fp8_machine`); None: ``flops_efficiency``,
            the 16-bit products' fraction. Set only with ``fp8_flops``.
        host_bandwidth: bytes/s one device moves to or from host memory, per direction (the achievable
            rate of its PCIe or C2C link); None: no host offload is offered.
        host_latency: seconds per host transfer (one copy call).
        host_memory_bytes: host memory of one node, shared by its ``node_size`` devices (all p devices on
            a one-level machine); None: no host memory to offload to.
        cpu_adam_rate: parameters per second the CPUs of one node update with Adam (the optimizer step of
            ZeRO-Offload), shared by the node's devices; None: no optimizer offload is offered.
        sm_count: streaming multiprocessors of one device, the processors a matrix product's output tiles
            are spread over in waves; None (with ``gemm_tiles``): no tile or wave quantisation, every matrix
            product runs at ``flops_efficiency`` (the paper's model, CPUs).
        gemm_tiles: the output tiles (rows, columns) the matrix-product library chooses among, each reaching
            ``flops_efficiency`` over a full wave (:func:`shardplan.cost.operator.gemm_utilisation`); set
            together with ``sm_count``.
        gemm_align: elements every dimension of a matrix product (its rows, columns and contraction) must be
            a multiple of for the library's fast kernels (16-byte aligned operands: 8 two-byte elements);
            a product with a dimension that is not runs at ``gemm_unaligned_efficiency`` of the rate
            (:func:`shardplan.cost.operator.pass_utilisation`). None (with ``gemm_unaligned_efficiency``): no
            such penalty.
        gemm_unaligned_efficiency: the rate of an unaligned product over an aligned one of the same shape
            class; set together with ``gemm_align``.
        attention_efficiency: fraction of ``peak_flops`` a fused attention kernel (FlashAttention, forward and
            backward) reaches on its FLOPs (:mod:`shardplan.cost.fused`); None: ``flops_efficiency``.
        convert_bandwidth: bytes/s of HBM a memory-bound kernel streams that converts between element sizes
            (loads 16-bit values and computes or stores them in fp32, or back): an operator whose tensors have
            different element sizes (a cast, :attr:`~shardplan.ir.Tensor.elem_factor`), and the fused optimizer
            step on elements narrower than 4 bytes (it updates in fp32); None: ``hbm_bandwidth``
            (:attr:`convert_rate`).
        stepwise_redistribution: a change of layout between two operators is charged as the steps XLA's
            SPMD partitioner lowers to one collective each (slice, all-to-all, all-gather,
            collective-permute: :mod:`shardplan.cost.reshard`), the steps the JAX export then performs, where
            they apply (one level, at most 64 devices); False: what each device lacks, the PaSE paper's
            model.
        reduce_per_dim: partial sums over several split dims (an operator's reduction dims forward, the dims a
            gradient sums over backward, the normalised dims' statistics) are reduced as one all-reduce of the
            whole tile per split dim, each among that dim's group, as XLA's SPMD partitioner lowers them
            (measured on compiled HLO, docs/jax.md, "Partial sums over several split dims") and as the
            PyTorch run reduces them (one dim at a time, measured: docs/torch.md); False: one
            all-reduce among the product of the groups, the PaSE paper's model.
        scatter_gathered_grads: the keys' and values' gradients of a causal attention whose keys are
            all-gathered (context parallelism) go home by a reduce-scatter to a producer that scatters them
            over the query sequence's group, whether or not the runner deals the queries (DTensor's
            ``Partial -> Shard`` redistribution, measured: docs/torch.md), and those of a fused attention
            that is not causal (an encoder's) over every device that sums them; and so does any other
            activation's gradient summed over split dims, into a producer whose tiles scatter the consumer's
            tile over the summing devices (the same redistribution, measured: :mod:`shardplan.cost.grad_home`);
            False: only where dealt, the contiguous and the unmasked attention's all-reduced, and every other
            activation's gradient all-reduced at its consumer (XLA's GSPMD, :mod:`shardplan.cost.ring`).
        overlap_dgrad: the collective that reduces the gradient of a product's input (a column-parallel
            linear's all-reduce, or its reduce-scatter under sequence parallelism) runs beside the product's
            own weight-gradient pass, started once the input gradient is computed (Megatron-LM's asynchronous
            tensor-parallel all-reduce, on by default from 2022, and its sequence-parallel backward;
            Transformer Engine's linear layers): exposed ``max(C - t_wgrad, φ C)`` (``comm_contention``)
            (:func:`shardplan.cost.operator.operator_cost`, :func:`shardplan.cost.edge.overlap_budgets`).
            False (default): charged in full.
        grad_accum_bytes: HBM bytes per weight-gradient element that adding one more micro-batch's weight
            gradient into the step's gradient moves outside the weight-gradient product, charged for every
            micro-batch of a step but the first at ``hbm_bandwidth``
            (:func:`shardplan.cost.operator.grad_accumulation_seconds`). 0 (default): the product accumulates
            into its output (Megatron-LM's gradient-accumulation fusion, Transformer Engine's linear layers).
            PyTorch autograd's in-place ``.grad += g`` (the first micro-batch's gradient is taken, not added):
            two reads and one write of ``dtype_bytes`` elements, ``3 * dtype_bytes`` (a recipe's
            ``grad_accum=autograd``).
        comm_contention: the fraction φ of a device's compute that a running collective takes from a product
            it overlaps (NCCL runs a collective as one thread block per channel, each holding a streaming
            multiprocessor for the collective's whole duration: channels / SMs). A collective of C seconds
            beside a product of W seconds adds ``max(C - W, φ C)`` to the product's W rather than
            ``max(C - W, 0)`` (:func:`shardplan.cost.contention.exposed_beside`; docs/cost-model.md,
            "Contention"). 0 (default): an overlapped collective costs the product nothing.
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
    fp8_flops: float | None = None
    fp8_efficiency: float | None = None
    host_bandwidth: float | None = None
    host_latency: float = 0.0
    host_memory_bytes: float | None = None
    cpu_adam_rate: float | None = None
    sm_count: int | None = None
    gemm_tiles: tuple[tuple[int, int], ...] | None = None
    gemm_align: int | None = None
    gemm_unaligned_efficiency: float | None = None
    attention_efficiency: float | None = None
    convert_bandwidth: float | None = None
    stepwise_redistribution: bool = True
    reduce_per_dim: bool = True
    scatter_gathered_grads: bool = False
    overlap_dgrad: bool = False
    grad_accum_bytes: float = 0.0
    comm_contention: float = 0.0

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
        if not isinstance(self.stepwise_redistribution, bool):
            raise ShardplanError("machine: stepwise_redistribution must be True or False, got "
                                 f"{self.stepwise_redistribution!r}")
        if not isinstance(self.reduce_per_dim, bool):
            raise ShardplanError(f"machine: reduce_per_dim must be True or False, got {self.reduce_per_dim!r}")
        if not isinstance(self.scatter_gathered_grads, bool):
            raise ShardplanError(f"machine: scatter_gathered_grads must be True or False, got "
                                 f"{self.scatter_gathered_grads!r}")
        if not isinstance(self.overlap_dgrad, bool):
            raise ShardplanError(f"machine: overlap_dgrad must be True or False, got {self.overlap_dgrad!r}")
        if self.overlap_dgrad and self.scatter_gathered_grads:
            raise ShardplanError("machine: overlap_dgrad with scatter_gathered_grads is not costed (DTensor's "
                                 "reduce-scatter home of an activation gradient is not overlapped)")
        put("grad_accum_bytes", real("machine: grad_accum_bytes", self.grad_accum_bytes, minimum=0.0, unit="B"))
        put("comm_contention", real("machine: comm_contention", self.comm_contention, minimum=0.0))
        if self.comm_contention >= 1.0:
            raise ShardplanError(f"machine: comm_contention must be below 1 (a fraction of the device's compute), "
                                 f"got {self.comm_contention!r}")
        for name, unit in (("fp8_flops", "FLOP/s"), ("host_bandwidth", "B/s"), ("host_memory_bytes", "B"),
                           ("cpu_adam_rate", "parameters/s")):
            if getattr(self, name) is not None:
                put(name, real(f"machine: {name}", getattr(self, name), positive=True, unit=unit))
        put("host_latency", real("machine: host_latency", self.host_latency, minimum=0.0, unit="s"))
        if self.fp8_efficiency is not None:
            if self.fp8_flops is None:
                raise ShardplanError("machine: fp8_efficiency needs fp8_flops (the FP8 peak it is a fraction of)")
            put("fp8_efficiency", real("machine: fp8_efficiency", self.fp8_efficiency, positive=True, maximum=1.0))
        if (self.sm_count is None) != (self.gemm_tiles is None):
            raise ShardplanError("machine: sm_count and gemm_tiles are given together (or neither)")
        if self.sm_count is not None:
            put("sm_count", integer("machine: sm_count", self.sm_count, minimum=1))
            tiles = self.gemm_tiles
            if isinstance(tiles, (str, bytes)) or not isinstance(tiles, (list, tuple)) or not tiles or not all(
                    isinstance(t, (list, tuple)) and len(t) == 2 for t in tiles):
                raise ShardplanError(f"machine: gemm_tiles must be a non-empty list of [rows, columns] pairs, "
                                     f"got {tiles!r}")
            put("gemm_tiles", tuple((integer("machine: gemm_tiles rows", r, minimum=1),
                                     integer("machine: gemm_tiles columns", c, minimum=1)) for r, c in tiles))
        if (self.gemm_align is None) != (self.gemm_unaligned_efficiency is None):
            raise ShardplanError("machine: gemm_align and gemm_unaligned_efficiency are given together (or neither)")
        if self.gemm_align is not None:
            put("gemm_align", integer("machine: gemm_align", self.gemm_align, minimum=1))
            put("gemm_unaligned_efficiency", real("machine: gemm_unaligned_efficiency", self.gemm_unaligned_efficiency,
                                                  positive=True, maximum=1.0))
        if self.attention_efficiency is not None:
            put("attention_efficiency", real("machine: attention_efficiency", self.attention_efficiency,
                                             positive=True, maximum=1.0))
        if self.convert_bandwidth is not None:
            put("convert_bandwidth", real("machine: convert_bandwidth", self.convert_bandwidth, positive=True,
                                          unit="B/s"))
            if self.hbm_bandwidth is not None and self.convert_bandwidth > self.hbm_bandwidth:
                raise ShardplanError(f"machine: convert_bandwidth ({self.convert_bandwidth:.4g} B/s) exceeds "
                                     f"hbm_bandwidth ({self.hbm_bandwidth:.4g} B/s): a converting kernel streams "
                                     "through the same memory")

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
    def node_devices(self) -> int:
        """Devices sharing one node's host (its memory, CPUs): ``node_size``, or p on a one-level machine."""
        return int(self.node_size) if self.node_size is not None else self.num_devices

    @property
    def tiled(self) -> bool:
        """True when matrix products are quantised into output tiles over ``sm_count`` processors."""
        return self.sm_count is not None

    @property
    def shaped_gemms(self) -> bool:
        """True when a matrix product's rate depends on its shape: tiles and waves (:attr:`tiled`) or alignment
        (``gemm_align``)."""
        return self.tiled or self.gemm_align is not None

    @property
    def achievable_flops(self) -> float:
        """FLOP/s a kernel reaches: peak times :attr:`flops_efficiency`."""
        return self.peak_flops * self.flops_efficiency

    @property
    def fp8_achievable_flops(self) -> float | None:
        """FLOP/s a full-wave FP8 matrix product reaches: ``fp8_flops`` times ``fp8_efficiency`` (else
        :attr:`flops_efficiency`); None without FP8 products."""
        return None if self.fp8_flops is None else self.fp8_machine().achievable_flops

    def fp8_machine(self) -> Machine:
        """The machine an FP8 matrix product is costed on: ``peak_flops`` = ``fp8_flops`` and
        ``flops_efficiency`` = ``fp8_efficiency`` (else the 16-bit ``flops_efficiency``), every other constant
        (links, HBM, tiles, alignment) this machine's. A product's time t = FLOPs / (fp8_flops * efficiency * u),
        u its tile, wave and alignment utilisation (:func:`shardplan.cost.operator.pass_utilisation`). Only FP8
        products are costed on it (:func:`shardplan.cost.memory.fp8_product`); their casts are charged apart
        (:func:`shardplan.cost.memory.fp8_scaling_seconds`)."""
        if self.fp8_flops is None:
            raise ShardplanError(f"machine {self.name!r} has no FP8 matrix products (no fp8_flops)")
        eff = self.flops_efficiency if self.fp8_efficiency is None else self.fp8_efficiency
        return replace(self, peak_flops=self.fp8_flops, flops_efficiency=eff)

    @property
    def attention_flops(self) -> float:
        """FLOP/s a fused attention kernel reaches: peak times ``attention_efficiency`` (else
        :attr:`flops_efficiency`)."""
        eff = self.flops_efficiency if self.attention_efficiency is None else self.attention_efficiency
        return self.peak_flops * eff

    @property
    def convert_rate(self) -> float | None:
        """Bytes/s of a memory-bound kernel that converts between element sizes: ``convert_bandwidth``, else
        ``hbm_bandwidth``; None without an HBM bandwidth (the paper's model charges no memory-bound work)."""
        if self.hbm_bandwidth is None or self.convert_bandwidth is None:
            return self.hbm_bandwidth
        return self.convert_bandwidth

    def link(self, inter: bool) -> tuple[float, float]:
        """(bandwidth, latency) of the level: inside a node or across nodes."""
        if inter and self.hierarchical:
            lat = self.latency if self.inter_latency is None else self.inter_latency
            return float(self.inter_bandwidth), float(lat)  # type: ignore[arg-type]
        return float(self.bandwidth), float(self.latency)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], num_devices: int) -> Machine:
        """The machine of the profile file at ``path`` with ``num_devices`` devices (:func:`load_machine_file`)."""
        return load_machine_file(path, num_devices)

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


# The fields a profile file states (every Machine field but the device count and the label).
PROFILE_FIELDS = tuple(f.name for f in fields(Machine) if f.name not in ("num_devices", "name"))
_TOP_KEYS = ("name", "description", "device_kinds", "measurements")
# Fields added after profile files were first written: a file without one reads it as None with this source.
OPTIONAL_FIELDS = MappingProxyType({
    "fp8_efficiency": "absent from the file (written before the field existed): FP8 products at flops_efficiency",
    "overlap_dgrad": "absent from the file (written before the field existed): input-gradient collectives not "
                     "overlapped",
    "grad_accum_bytes": "absent from the file (written before the field existed): weight gradients accumulated "
                        "inside their products (nothing charged)",
    "comm_contention": "absent from the file (written before the field existed): an overlapped collective costs "
                       "the product beside it nothing",
})
# The value an absent optional field reads as (None where not listed).
OPTIONAL_VALUES = MappingProxyType({"overlap_dgrad": False, "grad_accum_bytes": 0.0, "comm_contention": 0.0})
UNRECORDED = "not recorded: written from a Machine value by shardplan.machine.machine_to_file"

# preset name -> its profile file in shardplan/machines
PRESETS = {
    "paper": "paper.json",
    "1080ti": "1080ti.json",
    "2080ti": "2080ti.json",
    "a100": "a100-sxm-80gb.json",
    "h100": "h100-sxm.json",
    "h200": "h200-sxm.json",
}

# Words a device kind may or may not carry: "NVIDIA GeForce GTX 1080 Ti" is "GTX 1080 Ti".
_VENDOR_WORDS = frozenset({"nvidia", "geforce", "tesla"})


@dataclass(frozen=True)
class Profile:
    """One profile file: a machine's constants, each with its source, and the device kinds it describes.

    ``values`` and ``sources`` hold every name of :data:`PROFILE_FIELDS`; ``values`` are checked by
    building a one-device :class:`Machine` from them. ``measurements``: the raw data behind the values
    (a JSON object, e.g. a calibration's per-shape table), or None.
    """

    name: str
    description: str
    device_kinds: tuple[str, ...]
    values: Mapping[str, Any] = field(hash=False)
    sources: Mapping[str, str] = field(hash=False)
    measurements: Mapping[str, Any] | None = field(default=None, hash=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", MappingProxyType(dict(self.values)))
        object.__setattr__(self, "sources", MappingProxyType(dict(self.sources)))

    def machine(self, num_devices: int, name: str | None = None, node_size: int | None = None) -> Machine:
        """The machine with ``num_devices`` devices; ``name`` and ``node_size`` replace the profile's."""
        values = dict(self.values)
        if node_size is not None:
            values["node_size"] = node_size
        return Machine(num_devices, name=self.name if name is None else name, **values)

    @staticmethod
    def of(machine: Machine, sources: Mapping[str, str] | None = None, device_kinds: Iterable[str] = (),
           description: str = "", measurements: Mapping[str, Any] | None = None) -> Profile:
        """``machine``'s constants as a profile; a field missing from ``sources`` gets :data:`UNRECORDED`."""
        sources = dict(sources or {})
        unknown = sorted(set(sources) - set(PROFILE_FIELDS))
        if unknown:
            raise ShardplanError(f"machine profile: unknown field {unknown[0]!r} in sources; fields are "
                                 f"{', '.join(PROFILE_FIELDS)}")
        return Profile(machine.name, description, tuple(device_kinds),
                       {k: getattr(machine, k) for k in PROFILE_FIELDS},
                       {k: sources.get(k, UNRECORDED) for k in PROFILE_FIELDS}, measurements)

    def to_json(self) -> str:
        """The profile as the text of a profile file (floats written exactly: reading it back gives equal values)."""
        doc: dict[str, Any] = {"name": self.name, "description": self.description,
                               "device_kinds": list(self.device_kinds)}
        for k in PROFILE_FIELDS:
            doc[k] = {"value": self.values[k], "source": self.sources[k]}
        if self.measurements is not None:
            doc["measurements"] = dict(self.measurements)
        return json.dumps(doc, indent=2) + "\n"


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    for k in keys:
        if keys.count(k) > 1:
            raise ShardplanError(f"key {k!r} appears twice")
    return dict(pairs)


def parse_profile(text: str, where: str = "machine profile") -> Profile:
    """The profile in ``text`` (a profile file's contents); ``where`` starts every error message.

    Refused in one line: text that is not JSON, a key twice, an unknown top-level key or field, a
    missing field (but one of :data:`OPTIONAL_FIELDS`, read as None or its :data:`OPTIONAL_VALUES` entry), an entry that is not
    ``{"value": ..., "source": "..."}``, an empty source, and values :class:`Machine` refuses (a string
    where a number belongs, a negative bandwidth, ...).
    """
    try:
        doc = json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as e:
        raise ShardplanError(f"{where}: not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except ShardplanError as e:
        raise ShardplanError(f"{where}: {e}") from None
    if not isinstance(doc, dict):
        raise ShardplanError(f"{where}: must be a JSON object, got {type(doc).__name__}")
    unknown = [k for k in doc if k not in PROFILE_FIELDS and k not in _TOP_KEYS]
    if unknown:
        raise ShardplanError(f"{where}: unknown field {unknown[0]!r}; fields are {', '.join(_TOP_KEYS)}, "
                             f"{', '.join(PROFILE_FIELDS)}")
    name = doc.get("name")
    if not isinstance(name, str) or not name:
        raise ShardplanError(f"{where}: 'name' must be a non-empty string, got {name!r}")
    description = doc.get("description", "")
    if not isinstance(description, str):
        raise ShardplanError(f"{where}: 'description' must be a string, got {description!r}")
    kinds = doc.get("device_kinds", [])
    if not isinstance(kinds, list) or not all(isinstance(k, str) and normalise_kind(k) for k in kinds):
        raise ShardplanError(f"{where}: 'device_kinds' must be a list of device names, got {kinds!r}")
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for k in PROFILE_FIELDS:
        if k not in doc and k in OPTIONAL_FIELDS:
            values[k], sources[k] = OPTIONAL_VALUES.get(k), OPTIONAL_FIELDS[k]
            continue
        if k not in doc:
            raise ShardplanError(f"{where}: missing field {k!r} (every field needs "
                                 f'{{"value": ..., "source": "..."}}; the value may be null where Machine allows None)')
        entry = doc[k]
        if not isinstance(entry, dict) or set(entry) != {"value", "source"}:
            have = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
            raise ShardplanError(f'{where}: field {k!r} must be {{"value": ..., "source": "..."}}, got {have}')
        if not isinstance(entry["source"], str) or not entry["source"].strip():
            raise ShardplanError(f"{where}: field {k!r} needs a source (a non-empty string), got {entry['source']!r}")
        values[k], sources[k] = entry["value"], entry["source"]
    measurements = doc.get("measurements")
    if measurements is not None and not isinstance(measurements, dict):
        raise ShardplanError(f"{where}: 'measurements' must be a JSON object, got {type(measurements).__name__}")
    profile = Profile(name, description, tuple(kinds), values, sources, measurements)
    try:
        profile.machine(1)
    except ShardplanError as e:
        raise ShardplanError(f"{where}: {e}") from None
    return profile


def read_profile(path: str | os.PathLike[str]) -> Profile:
    """The profile in the file at ``path`` (:func:`parse_profile`)."""
    where = f"machine file {os.fspath(path)}"
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ShardplanError(f"{where}: cannot be read ({getattr(e, 'strerror', None) or e})") from None
    return parse_profile(text, where)


def load_machine_file(path: str | os.PathLike[str], p: int) -> Machine:
    """The machine of the profile file at ``path`` with ``p`` devices."""
    return read_profile(path).machine(p)


def machine_to_file(machine: Machine, path: str | os.PathLike[str], sources: Mapping[str, str] | None = None,
                    device_kinds: Iterable[str] = (), description: str = "",
                    measurements: Mapping[str, Any] | None = None) -> None:
    """Write ``machine`` as a profile file that :func:`load_machine_file` reads back equal (but for
    ``num_devices``, which a file does not hold). ``sources``: field -> where its value comes from
    (default :data:`UNRECORDED`); ``measurements``: raw data kept in the file under that key."""
    text = Profile.of(machine, sources, device_kinds, description, measurements).to_json()
    from shardplan.files import write_text

    write_text(str(path), text)


def _profile_text(file_name: str) -> str:
    from importlib.resources import files

    return files("shardplan").joinpath("machines", file_name).read_text(encoding="utf-8")


def profile_names() -> tuple[str, ...]:
    """The profile files shipped with shardplan (``shardplan/machines/*.json``), sorted."""
    from importlib.resources import files

    return tuple(sorted(e.name for e in files("shardplan").joinpath("machines").iterdir() if e.name.endswith(".json")))


def load_profile(file_name: str) -> Profile:
    """The shipped profile ``file_name`` (one of :func:`profile_names`)."""
    if file_name not in profile_names():
        raise ShardplanError(f"no shipped machine profile {file_name!r}; choose from {', '.join(profile_names())}")
    return parse_profile(_profile_text(file_name), f"machine profile {file_name}")


def preset(name: str, p: int) -> Machine:
    """A named machine with p devices: one of :data:`PRESETS`, read from its profile file."""
    try:
        file_name = PRESETS[name]
    except KeyError:
        raise ShardplanError(f"unknown machine preset {name!r}; choose from {', '.join(sorted(PRESETS))}") from None
    return load_profile(file_name).machine(p)


def normalise_kind(kind: str) -> str:
    """A device kind reduced to what tells devices apart: lower case, letters and digits only, without
    the vendor words NVIDIA, GeForce and Tesla ("NVIDIA A100-SXM4-80GB" -> "a100sxm480gb")."""
    words = re.findall(r"[a-z0-9]+", kind.lower())
    return "".join(w for w in words if w not in _VENDOR_WORDS)


def match_profile(device_kind: str, profiles: Iterable[tuple[str, Profile]]) -> tuple[str, Profile] | None:
    """The (file name, profile) whose device kinds hold ``device_kind`` once both are normalised
    (:func:`normalise_kind`), or None. Equality, not a prefix: "NVIDIA H100 PCIe" does not match an
    SXM profile. Two profiles claiming the kind are an error."""
    want = normalise_kind(device_kind)
    hits = [(n, pr) for n, pr in profiles if want in {normalise_kind(k) for k in pr.device_kinds}]
    if len(hits) > 1:
        raise ShardplanError(f"device kind {device_kind!r} is claimed by several machine profiles: "
                             f"{', '.join(n for n, _ in hits)}")
    return hits[0] if hits else None


def infer_node_size(profile: Profile, num_devices: int, processes: int, node_size: int | None) -> int | None:
    """Devices per node: ``node_size`` when given; else one level when the profile has no link across
    nodes; else ``d = num_devices / processes`` when d > 1 (JAX's multi-host form: one process per
    host, holding that host's devices); else (one process holding every device, or one process per
    device as torchrun starts them) the profile's node size, a node of its vendor's 8-GPU board."""
    if node_size is not None:
        if profile.values["inter_bandwidth"] is None:
            raise ShardplanError(f"machine profile {profile.name!r} has no link across nodes (inter_bandwidth), "
                                 f"so node_size={node_size!r} cannot be used; pass machine=Machine.from_file(...) with such a link")
        return integer("detect_machine: node_size", node_size, minimum=1)
    if profile.values["inter_bandwidth"] is None:
        return profile.values["node_size"]
    if processes > 1 and num_devices % processes == 0 and num_devices // processes > 1:
        return num_devices // processes
    return profile.values["node_size"]


def detect_machine(device_kind: str, num_devices: int, *, processes: int = 1,
                   node_size: int | None = None) -> Machine:
    """The machine of ``num_devices`` devices of ``device_kind`` (``jax.Device.device_kind``,
    ``torch.cuda.get_device_name()``, ``"cpu"``), from the shipped profile that lists the kind.

    ``processes``: how many processes hold the devices; nodes are inferred from them by
    :func:`infer_node_size` unless ``node_size`` is given. The machine's name says what was
    detected, e.g. ``"h100 (detected: NVIDIA H100 80GB HBM3)"``. A kind no profile lists is an
    error naming what to pass instead.
    """
    if not isinstance(device_kind, str) or not normalise_kind(device_kind):
        raise ShardplanError(f"detect_machine: device_kind must name a device, got {device_kind!r}")
    p = integer("detect_machine: num_devices", num_devices, minimum=1)
    procs = integer("detect_machine: processes", processes, minimum=1)
    names = profile_names()
    hit = match_profile(device_kind, ((n, load_profile(n)) for n in names))
    if hit is None:
        raise ShardplanError(
            f"no machine profile for device kind {device_kind!r} (profiles: {', '.join(names)}); pass "
            f"machine=preset('h100', {p}) or another preset ({', '.join(PRESETS)}), or "
            f"machine=Machine.from_file('my-device.json', {p}) with a copy of a profile in shardplan/machines")
    file_name, profile = hit
    ns = infer_node_size(profile, p, procs, node_size)
    try:
        return profile.machine(p, name=f"{profile.name} (detected: {device_kind})", node_size=ns)
    except ShardplanError as e:
        raise ShardplanError(f"detect_machine: {p} devices of {device_kind!r} ({file_name}, nodes of {ns}): {e}; "
                             f"pass node_size=") from None
