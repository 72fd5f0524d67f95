"""Operators as iteration domains with tensor access maps, and the graph.

An operator is described once, in the polyhedral style (iteration domain and affine accesses of its tensors):

* an ordered set of named *iteration dimensions* with extents, e.g. a GEMM
  ``{b:128, m:512, n:2048, k:512}``; the iteration domain is their product;
* the *tensors* it touches (inputs, weights, one output), each with one
  :class:`AxisMap` per tensor axis saying which iteration point reads or
  writes which index along that axis;
* the work per iteration point (2 FLOPs for a multiply-add) and which
  tensors need gradients in the backward pass.

Everything else is derived. The *reduction dimensions* of the operator are
the dimensions that index no axis of the output; the reduction dimensions of
the gradient of a tensor X are the dimensions that index no axis of X (the
backward pass reuses the same domain with X in the role of the output).

An axis map is affine with one optional window term (convolution, pooling):

    index = stride * dim + dilation * window + offset      (clipped to the axis)

A plain axis is ``AxisMap("n")``; a convolution input row is
``AxisMap("h", window="r", stride=s, offset=-pad)``; the part of a
concatenation's output that comes from its second input is
``AxisMap("c", offset=-c1, partial=True)`` on that input (``partial``:
the tensor covers only part of the dimension's range, indices outside the
input's extent are not read). A *merged* axis (reshape, flatten) lists trailing
dimensions in ``inner``: ``index = ((dim * E_inner1) + inner1) * E_inner2 + ...``;
only the leading dimension of a merged axis may be split, so every
per-device tile stays a box. An axis indexed by no dimension (a broadcast
axis of extent 1, or a tensor read whole) has ``dim=None``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Sequence

from shardplan.checks import MAX_EXTENT, MAX_VOLUME
from shardplan.errors import ShardplanError

if TYPE_CHECKING:
    import networkx as nx

__all__ = [
    "AxisMap",
    "Tensor",
    "Recurrence",
    "Causal",
    "KernelIO",
    "Operator",
    "TensorRef",
    "EdgeRef",
    "WeightEdge",
    "Graph",
    "GraphBuilder",
    "unique_name",
    "renamed",
]


@dataclass(frozen=True)
class AxisMap:
    """How one tensor axis is indexed by the iteration domain.

    ``index = stride * dim + dilation * window + offset`` for an affine axis;
    for a merged axis (``inner`` non-empty) the index is the row-major ravel
    of ``(dim, *inner)``. ``dim=None`` means the axis is not indexed by the
    domain (it is read whole, or is a broadcast axis of extent 1).
    """

    dim: str | None
    window: str | None = None
    stride: int = 1
    dilation: int = 1
    offset: int = 0
    inner: tuple[str, ...] = ()
    partial: bool = False

    def __post_init__(self) -> None:
        if self.stride < 1 or self.dilation < 1:
            raise ShardplanError(f"axis map {self}: stride and dilation must be >= 1")
        if self.dim is None and (self.window or self.inner):
            raise ShardplanError(f"axis map {self}: a window or merged axis needs a leading dimension")
        if self.inner and (self.window or self.stride != 1 or self.offset != 0):
            raise ShardplanError(f"axis map {self}: a merged axis cannot also be strided, windowed or offset")
        object.__setattr__(self, "inner", tuple(self.inner))

    @property
    def dims(self) -> tuple[str, ...]:
        """Every iteration dimension this axis depends on."""
        out: list[str] = []
        if self.dim is not None:
            out.append(self.dim)
        if self.window is not None:
            out.append(self.window)
        out.extend(self.inner)
        return tuple(out)

    @property
    def is_plain(self) -> bool:
        """True when the axis is exactly one dimension, unstrided and unshifted."""
        return (self.dim is not None and not self.window and not self.inner and self.stride == 1
                and self.offset == 0 and not self.partial)

    def index_range(self, extents: Mapping[str, int]) -> tuple[int, int]:
        """[lo, hi) of the indices the whole domain touches, before clipping."""
        if self.dim is None:
            return (0, 1)
        if self.inner:
            size = extents[self.dim]
            for d in self.inner:
                size *= extents[d]
            return (0, size)
        hi = self.stride * (extents[self.dim] - 1) + self.offset + 1
        if self.window is not None:
            hi += self.dilation * (extents[self.window] - 1)
        return (self.offset, hi)


def _am(a: AxisMap | str | None) -> AxisMap:
    return a if isinstance(a, AxisMap) else AxisMap(a)


@dataclass(frozen=True)
class Tensor:
    """A tensor an operator touches: its shape, its axis maps and its role.

    Attributes:
        name: role inside the operator ("x", "w", "y", ...).
        shape: extent of every axis.
        axes: one :class:`AxisMap` per axis.
        role: "input", "weight" or "output".
        needs_grad: whether the backward pass produces a gradient for it
            (inputs coming from other operators and trainable weights; not
            integer ids or labels).
        src: for an input, the name of the producing operator (None for a
            graph input such as the images or the labels).
        elem_factor: elements per indexed point; 1 for ordinary tensors, e.g. 8
            for an LSTM weight that stores 4 gates x 2 matrices per (l, d, e).
        owner: for a weight whose parameter several operators read (a tied
            embedding read again by the LM head), on every reader but one:
            ``(operator, weight name)`` of the reader that owns the parameter.
            A parameter has one copy and one optimizer state, held in its
            owner's layout (a reader with an owner holds no state), and the
            graph links every reader to its owner by a *weight edge*
            (:attr:`Graph.weight_edges`) whose cost is zero when the two lay
            the parameter out alike and otherwise moves the parameter to the
            reader's layout and its gradient back
            (:func:`shardplan.cost.edge.weight_edge_cost`). Each reader
            synchronises its own gradient, as XLA compiles it, unless
            ``Machine.sum_shared_grads`` (then the owner synchronises the sum).
    """

    name: str
    shape: tuple[int, ...]
    axes: tuple[AxisMap, ...]
    role: str
    needs_grad: bool = True
    src: str | None = None
    elem_factor: int = 1
    owner: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "axes", tuple(_am(a) for a in self.axes))
        if self.role not in ("input", "weight", "output"):
            raise ShardplanError(f"tensor {self.name!r}: role must be input, weight or output, not {self.role!r}")
        if len(self.shape) != len(self.axes):
            raise ShardplanError(
                f"tensor {self.name!r}: shape {self.shape} has {len(self.shape)} axes but {len(self.axes)} axis maps"
            )
        if any(s <= 0 for s in self.shape):
            raise ShardplanError(f"tensor {self.name!r}: shape {self.shape} has a zero or negative extent")
        if self.owner is not None:
            owner = tuple(self.owner)
            if self.role != "weight":
                raise ShardplanError(f"tensor {self.name!r}: owner={owner}; only a weight reads another "
                                     "operator's parameter")
            if len(owner) != 2 or not all(isinstance(x, str) and x for x in owner):
                raise ShardplanError(f"tensor {self.name!r}: owner={owner} must be (operator name, weight name)")
            object.__setattr__(self, "owner", (owner[0], owner[1]))

    @property
    def dims(self) -> frozenset[str]:
        """Iteration dimensions that index some axis of this tensor."""
        return frozenset(d for a in self.axes for d in a.dims)

    @property
    def size(self) -> int:
        """Number of elements."""
        n = self.elem_factor
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class Recurrence:
    """Marks an operator whose domain holds a sequential recurrence (an LSTM).

    The layer and time dimensions are not data-parallel: splitting ``layer``
    makes a pipeline of stages that hand hidden states to each other, and
    splitting ``time`` makes chunks that must run one after another. These
    dimensions are therefore excluded from the derived reduction dimensions;
    their cost is the one hand-written term of the cost model
    (:func:`shardplan.cost.operator.recurrence_cost`). ``state`` is the
    hidden-state dimension the recurrent product contracts over.
    """

    layer: str
    time: str
    state: str
    batch: str


@dataclass(frozen=True)
class Causal:
    """A causal (lower-triangular) mask over two dimensions of equal extent: only the iteration points with
    ``key <= query`` do work (causal self-attention's scores and context products).

    ``balanced``: a sequence split ``c`` ways is dealt out in ``2c`` chunks, block ``i`` holding chunks ``i``
    and ``2c - 1 - i`` (the load balancing of Megatron-LM's and Llama 3's context parallelism), so every block
    does the same work; False: contiguous blocks, the last one doing the most. The cost model charges the
    busiest device's share (:func:`shardplan.cost.causal.causal_fractions`; docs/cost-model.md, "Ring context
    parallelism").

    ``dealt``: the blocks arrive contiguous and the runner deals them into the balanced order at the attention
    itself (shardplan's JAX and PyTorch runners, which cannot reorder the user's data loader), so the ring also
    pays the deal's point-to-point transfers (:func:`shardplan.cost.ring.deal_time`); False: the loader
    delivers the balanced order (Megatron-LM's), nothing to charge."""

    query: str
    key: str
    balanced: bool = True
    dealt: bool = False


@dataclass(frozen=True)
class KernelIO:
    """How an operator inside a compiler-fused kernel touches HBM (:attr:`Operator.kernel_io`; a frontend that
    traced a compiled program sets it: the JAX frontend, after XLA's fusion rules, :mod:`shardplan.jax.fusion`).

    Per operand (the inputs, then the weights, in order):

    * ``reads``: how many times the operator's forward kernels load it from HBM: 0 when it never leaves the
      chip there (produced by an operator of the same kernel, or loaded by another operator of it), 2 when
      the operator is duplicated into two kernels that each load it;
    * ``back``: how many tiles of it the backward kernels move on this operator's account: its gradient
      written (1, once per tensor however many fused operators read it: the partial gradients are summed
      on chip), plus its value re-read where the backward needs forward values (1); 0 where another
      operator carries it.

    ``write``: the output tiles written to HBM (0: every consumer is in its kernel; 1: the root of a kernel);
    the backward kernels read its gradient back as many.

    Counts are in tiles of the model's element size (:attr:`~shardplan.ir.Tensor.elem_factor`): a frontend
    that knows a value is wider in the kernel's memory (a float32 loss over bfloat16 logits) multiplies its
    counts (2). The charging rule is :mod:`shardplan.cost.chain`'s (docs/cost-model.md, "Fused memory-bound
    chains").
    """

    reads: tuple[float, ...]
    back: tuple[float, ...]
    write: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "reads", tuple(float(r) for r in self.reads))
        object.__setattr__(self, "back", tuple(float(r) for r in self.back))
        object.__setattr__(self, "write", float(self.write))
        if len(self.back) != len(self.reads):
            raise ShardplanError(f"kernel reads {self.reads} and back {self.back} differ in length")
        if any(not (r >= 0 and math.isfinite(r)) for r in self.reads + self.back + (self.write,)):
            raise ShardplanError(f"kernel reads {self.reads}, back {self.back} and write {self.write} must be "
                                 "finite counts >= 0")


@dataclass(frozen=True, eq=False)
class Operator:
    """One vertex of the graph: an iteration domain with its tensor accesses.

    Attributes:
        name: unique name in the graph.
        kind: what made it ("einsum", "conv2d", ...): for display only; the
            cost model never branches on it.
        dims: ordered (dimension name, extent) pairs; the order is the order
            of configuration tuples and of the device numbering.
        inputs: tensors read that come from other operators or graph inputs.
        weights: trainable parameters.
        output: the one tensor written.
        flops_per_point: work per iteration point of the forward pass.
        norm_dims: dimensions reduced *inside* the operator while the output
            keeps them (softmax, normalisation): splitting them all-reduces
            ``norm_stats`` statistics per point of the tile without them.
        norm_stats: statistics per normalised row (2 for mean and variance).
        recurrence: set for a recurrent operator (see :class:`Recurrence`).
        fixed: dimensions that may not be split (inner dims of a merged axis).
        dim_labels: optional (dimension, readable name) pairs for reports,
            e.g. ``(("b", "batch"), ("x", "out"), ("y", "in"))`` on a traced
            dense layer: the tensor axis a dimension comes from, as a user
            knows it. The dimension names stay the identifiers (short,
            unique, what configurations are indexed by); labels are display
            only and need not be unique. Dimensions without a label show
            their name.
        causal: a :class:`Causal` mask (None: every point of the domain does work).
        backward_flops: work per point of the backward pass when it runs as one fused kernel that produces
            every gradient at once (FlashAttention's, :func:`shardplan.ops.flash_attention`: it recomputes
            the scores from the saved per-row log-sum-exp, so its backward is 2.5x its forward's products).
            None (the default): one pass of the forward's work per tensor whose gradient is produced (a
            product's gradient is a product of the same size). A fused backward reads every tensor of the
            operator, what it saved and the output's gradient, and writes the gradients, in one kernel
            (:mod:`shardplan.cost.fused`).
        saved: what the backward pass keeps of the operator, in output tiles
            (1: its output, the default). A frontend that knows which values
            the backward rules read sets it: 0 when no backward rule reads the
            output (an addition feeding a reshape), 2 when a fused elementwise
            tail keeps one more value of the output's size (a relu's input).
        transient: what the operator's backward step holds at once besides the saved values and the
            weights' persistent gradient buffers, and frees when it ends: per tensor of the operator
            (output, then inputs, then weights, in order) the number of its tiles, in that tensor's
            element size. A frontend that knows its runtime sets it: PyTorch's eager autograd holds the
            output's incoming gradient (1) while it writes a fresh gradient of every input and weight
            that needs one (1 each; a weight's is then added into its ``.grad``), and a composite's own
            intermediate gradients (a cross-entropy's gradient of its log-probabilities: one more tile
            of its logits). Empty (the default): nothing stated (a compiled program whose buffers the
            compiler assigns by liveness), charged nothing. :func:`shardplan.cost.memory.transient_bytes`.
        kernel_io: None (the default) when the operator runs as a kernel of its own, as eager PyTorch runs
            it; a :class:`KernelIO` when a compiler fuses it with its neighbours (a memory-bound operator of
            an XLA program): which operands it loads from HBM and whether it writes its output there.
    """

    name: str
    kind: str
    dims: tuple[tuple[str, int], ...]
    inputs: tuple[Tensor, ...]
    output: Tensor
    weights: tuple[Tensor, ...] = ()
    flops_per_point: float = 2.0
    norm_dims: tuple[str, ...] = ()
    norm_stats: int = 2
    recurrence: Recurrence | None = None
    fixed: frozenset[str] = frozenset()
    dim_labels: tuple[tuple[str, str], ...] = ()
    saved: float = 1.0
    causal: Causal | None = None
    backward_flops: float | None = None
    transient: tuple[float, ...] = ()
    kernel_io: KernelIO | None = None

    def __post_init__(self) -> None:
        labels = self.dim_labels.items() if isinstance(self.dim_labels, Mapping) else self.dim_labels
        object.__setattr__(self, "dim_labels", tuple((str(d), str(n)) for d, n in labels))
        dims = tuple((str(d), int(e)) for d, e in self.dims)
        object.__setattr__(self, "dims", dims)
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "weights", tuple(self.weights))
        object.__setattr__(self, "norm_dims", tuple(self.norm_dims))
        object.__setattr__(self, "fixed", frozenset(self.fixed))
        object.__setattr__(self, "transient", tuple(float(x) for x in self.transient))
        self._validate()

    # -- validation -----------------------------------------------------
    def _fail(self, msg: str) -> None:
        raise ShardplanError(f"operator {self.name!r} ({self.kind}): {msg}")

    def _validate(self) -> None:
        if not (self.saved >= 0 and math.isfinite(self.saved)):
            self._fail(f"saved must be a finite number of output tiles >= 0, got {self.saved!r}")
        if self.transient and (len(self.transient) != 1 + len(self.inputs) + len(self.weights)
                               or not all(x >= 0 and math.isfinite(x) for x in self.transient)):
            self._fail(f"transient needs one finite number of tiles >= 0 per tensor (output, inputs, weights: "
                       f"{1 + len(self.inputs) + len(self.weights)}), got {self.transient!r}")
        if not self.name:
            raise ShardplanError("an operator needs a non-empty name")
        if self.backward_flops is not None and not (self.backward_flops >= 0 and math.isfinite(self.backward_flops)
                                                    and self.flops_per_point > 0):
            self._fail(f"backward_flops must be a finite number >= 0 beside a positive flops_per_point, got "
                       f"{self.backward_flops!r} (forward {self.flops_per_point!r})")
        if self.kernel_io is not None and len(self.kernel_io.reads) != len(self.inputs) + len(self.weights):
            self._fail(f"kernel_io has {len(self.kernel_io.reads)} read counts for "
                       f"{len(self.inputs) + len(self.weights)} operands")
        names = [d for d, _ in self.dims]
        if len(set(names)) != len(names):
            self._fail(f"duplicate dimension names in {names}")
        for d, e in self.dims:
            if e <= 0:
                self._fail(f"dimension {d!r} has extent {e}; extents must be positive")
            if e > MAX_EXTENT:
                self._fail(f"dimension {d!r} has extent {e}, more than the cost model supports ({MAX_EXTENT})")
        if self.output.role != "output":
            self._fail("the output tensor must have role 'output'")
        ext = self.extents
        seen: set[str] = set()
        for t in self.tensors:
            if t.name in seen:
                self._fail(f"two tensors are named {t.name!r}")
            seen.add(t.name)
            if math.prod(t.shape) > MAX_VOLUME:
                self._fail(f"tensor {t.name!r} of shape {tuple(t.shape)} has {math.prod(t.shape):.3g} elements, more "
                           f"than the cost model supports ({MAX_VOLUME:.3g}: its sizes would overflow int64)")
            for i, (a, size) in enumerate(zip(t.axes, t.shape)):
                for d in a.dims:
                    if d not in ext:
                        self._fail(f"tensor {t.name!r} axis {i} uses unknown dimension {d!r} (dims: {names})")
                lo, hi = a.index_range(ext)
                if a.dim is None:
                    continue
                if a.inner and hi != size:
                    self._fail(f"tensor {t.name!r} axis {i}: merged dims {a.dims} cover {hi} indices, axis has {size}")
                if a.is_plain and ext[a.dim] != size:
                    self._fail(
                        f"tensor {t.name!r} axis {i} has extent {size} but dimension {a.dim!r} has extent {ext[a.dim]}"
                    )
                if not a.is_plain and (hi <= 0 or lo >= size):
                    self._fail(f"tensor {t.name!r} axis {i}: the access never falls inside the axis (0..{size})")
        for t in self.output.axes:
            if t.window is not None or t.offset != 0 or t.stride != 1:
                self._fail("output axes must be plain or merged (no window, stride or offset)")
        for d in self.norm_dims:
            if d not in ext:
                self._fail(f"normalised dimension {d!r} is not a dimension")
        for d in self.fixed:
            if d not in ext:
                self._fail(f"fixed dimension {d!r} is not a dimension")
        for d, _ in self.dim_labels:
            if d not in ext:
                self._fail(f"labelled dimension {d!r} is not a dimension")
        if self.causal is not None:
            c = self.causal
            if not isinstance(c, Causal) or c.query not in ext or c.key not in ext or c.query == c.key:
                self._fail(f"causal mask {c!r} must be a Causal over two different dimensions (dims: {names})")
            if ext[c.query] != ext[c.key]:
                self._fail(f"causal mask over {c.query!r} ({ext[c.query]}) and {c.key!r} ({ext[c.key]}): "
                           f"the extents differ")
        if self.recurrence is not None:
            for d in (self.recurrence.layer, self.recurrence.time, self.recurrence.state, self.recurrence.batch):
                if d not in ext:
                    self._fail(f"recurrence dimension {d!r} is not a dimension")
        for t in self.weights:
            if t.role != "weight":
                self._fail(f"weight {t.name!r} must have role 'weight'")
        for t in self.inputs:
            if t.role != "input":
                self._fail(f"input {t.name!r} must have role 'input'")

    # -- derived ----------------------------------------------------------
    @cached_property
    def dim_names(self) -> tuple[str, ...]:
        return tuple(d for d, _ in self.dims)

    @property
    def extents(self) -> dict[str, int]:
        return dict(self.dims)

    @cached_property
    def label(self) -> str:
        """The dimension letters, e.g. "bchwnrs" (names joined when longer)."""
        names = self.dim_names
        return "".join(names) if all(len(n) == 1 for n in names) else ",".join(names)

    def dim_label(self, d: str) -> str:
        """The readable name of dimension ``d`` (its label, else the name itself)."""
        return dict(self.dim_labels).get(d, d)

    @property
    def dims_text(self) -> str:
        """The dimensions for a report: ``"batch:16 seq:128 out:2304 in:768"`` when labelled
        (:attr:`dim_labels`), else the letters (:attr:`label`, Table II style)."""
        if not self.dim_labels:
            return self.label
        return " ".join(f"{self.dim_label(d)}:{e}" for d, e in self.dims)

    @property
    def tensors(self) -> tuple[Tensor, ...]:
        return self.inputs + self.weights + (self.output,)

    @property
    def points(self) -> int:
        """Size of the iteration domain."""
        n = 1
        for _, e in self.dims:
            n *= e
        return n

    def _pipeline_dims(self) -> frozenset[str]:
        r = self.recurrence
        return frozenset() if r is None else frozenset((r.layer, r.time))

    @property
    def reduction_dims(self) -> tuple[str, ...]:
        """Dimensions that index no axis of the output (summed over)."""
        out = self.output.dims | self._pipeline_dims()
        return tuple(d for d in self.dim_names if d not in out)

    def grad_reduction_dims(self, tensor: Tensor) -> tuple[str, ...]:
        """Dimensions the gradient of ``tensor`` sums over: those not indexing it."""
        keep = tensor.dims | self._pipeline_dims()
        return tuple(d for d in self.dim_names if d not in keep)

    @property
    def grad_tensors(self) -> tuple[Tensor, ...]:
        """Inputs and weights whose gradient the backward pass computes."""
        return tuple(t for t in self.inputs + self.weights if t.needs_grad)

    @property
    def epilogue_tensors(self) -> tuple[Tensor, ...]:
        """Operands outside the contraction: in an operator that sums over dims and reads three or more
        operands, those that index no summed dim and only dims of the output, when exactly two operands
        remain (a bias added to a matrix product: ``addmm``, ``linear`` with a bias). They act on the
        contraction's result (the product kernel's epilogue), so the product is of the other two; the
        gradient of one is the output's gradient reduced over the dims it does not index (a bias's: the sum
        over the rows), a memory-bound pass, not a product (docs/cost-model.md, "Compute"). None for an
        operator with a fused backward (:attr:`backward_flops`: FlashAttention's queries index no summed dim
        and are an operand of both its products)."""
        operands = self.inputs + self.weights
        summed = set(self.reduction_dims)
        if len(operands) < 3 or not summed or self.backward_flops is not None:
            return ()
        out = self.output.dims
        epi = tuple(t for t in operands if not (t.dims & summed) and t.dims <= out)
        return epi if len(operands) - len(epi) == 2 else ()

    @property
    def passes(self) -> float:
        """The work of a training step of the operator in units of its forward's: ``1 + G`` for G tensors
        whose gradient is produced (one pass of the forward's work each; an :attr:`epilogue_tensors` gradient,
        a reduction of the output's gradient, counts none), ``1 + backward_flops / flops_per_point`` for a
        fused backward (:attr:`backward_flops`; 1 when no gradient is produced). The cost model's forward
        share of an operator's compute is about ``1 / passes``."""
        if self.backward_flops is None:
            return 1.0 + len(self.grad_tensors) - sum(1 for t in self.epilogue_tensors if t.needs_grad)
        return 1.0 + (self.backward_flops / self.flops_per_point if self.grad_tensors else 0.0)

    @property
    def out(self) -> "TensorRef":
        """A reference to this operator's output, to feed other operators."""
        return TensorRef(self.name, self.output.shape)

    def __repr__(self) -> str:
        dims = ", ".join(f"{d}:{e}" for d, e in self.dims)
        return f"Operator({self.name!r}, {self.kind}, {{{dims}}})"


@dataclass(frozen=True)
class TensorRef:
    """A value flowing in the graph: the producing operator (or graph input) and its shape."""

    name: str
    shape: tuple[int, ...]
    is_input: bool = False
    needs_grad: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))


@dataclass(frozen=True)
class EdgeRef:
    """An edge: operator ``src`` produces the tensor that is input ``slot`` of ``dst``."""

    src: int
    dst: int
    slot: int


@dataclass(frozen=True)
class WeightEdge:
    """A weight edge: operator ``dst`` reads the parameter that ``src`` owns (:attr:`Tensor.owner`).

    ``src_weight`` / ``dst_weight``: the parameter's position in ``src.weights`` / ``dst.weights``.
    """

    src: int
    dst: int
    src_weight: int
    dst_weight: int


@dataclass(frozen=True, eq=False)
class Graph:
    """A validated DAG of operators.

    Edges are derived from the operators' inputs (``Tensor.src``); graph
    inputs (data, labels) are not vertices. Validation: unique names, known
    producers, matching shapes along every edge, no cycles.

    ``ties``: groups of operators that must take one configuration (the
    copies of an operator in the iterations of an unrolled ``scan``: the
    stacked parameter they read has one layout). Members have the same
    dimensions and extents; the search treats a group as one variable
    (:mod:`shardplan.search.tie`).

    ``weight_edges``: one :class:`WeightEdge` per weight that reads a
    parameter another operator owns (:attr:`Tensor.owner`), from the owner
    to the reader; derived, not data flow (no ordering, not in ``edges``).
    A reader whose owner is not in the graph (a pipeline stage's slice of
    it) owns its own copy: the graph holds it with ``owner`` cleared.

    ``recomputed``: operators the program itself recomputes in the backward
    pass whatever the plan says (the body of a user's ``jax.checkpoint`` /
    ``nn.remat`` without a saving policy): they keep no activation and run
    their forward twice (:func:`shardplan.cost.memory.choice_table` offers
    them only recomputing choices).
    """

    name: str
    operators: tuple[Operator, ...]
    graph_inputs: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    ties: tuple[tuple[str, ...], ...] = ()
    recomputed: frozenset[str] = frozenset()
    edges: tuple[EdgeRef, ...] = field(init=False)
    weight_edges: tuple[WeightEdge, ...] = field(init=False)
    index: Mapping[str, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        ops = tuple(self.operators)
        object.__setattr__(self, "operators", ops)
        object.__setattr__(self, "graph_inputs", dict(self.graph_inputs))
        if not ops:
            raise ShardplanError(f"graph {self.name!r} has no operators")
        index: dict[str, int] = {}
        for i, op in enumerate(ops):
            if op.name in index:
                raise ShardplanError(f"graph {self.name!r}: two operators are named {op.name!r}")
            if op.name in self.graph_inputs:
                raise ShardplanError(f"graph {self.name!r}: {op.name!r} is both an operator and a graph input")
            index[op.name] = i
        edges = []
        for j, op in enumerate(ops):
            for slot, t in enumerate(op.inputs):
                if t.src is None:
                    continue
                if t.src in self.graph_inputs:
                    want = tuple(self.graph_inputs[t.src])
                    if want != t.shape:
                        raise ShardplanError(
                            f"operator {op.name!r} input {t.name!r} has shape {t.shape}, "
                            f"graph input {t.src!r} has shape {want}"
                        )
                    continue
                if t.src not in index:
                    raise ShardplanError(f"operator {op.name!r} input {t.name!r} comes from unknown {t.src!r}")
                src = ops[index[t.src]]
                if src.output.shape != t.shape:
                    raise ShardplanError(
                        f"shape mismatch on edge {src.name!r} -> {op.name!r}: produces {src.output.shape}, "
                        f"input {t.name!r} expects {t.shape}"
                    )
                edges.append(EdgeRef(index[t.src], j, slot))
        object.__setattr__(self, "edges", tuple(edges))
        object.__setattr__(self, "index", index)
        self._weight_edges()
        object.__setattr__(self, "recomputed", frozenset(str(n) for n in self.recomputed))
        unknown = sorted(self.recomputed - set(index))
        if unknown:
            raise ShardplanError(f"graph {self.name!r}: recomputed operator {unknown[0]!r} is not in the graph")
        self._check_ties()
        order = _kahn(len(ops), self.edges)
        if len(order) < len(ops):
            cycle = _find_cycle(len(ops), self.edges, set(order))
            path = " -> ".join(ops[i].name for i in cycle) + f" -> {ops[cycle[0]].name}"
            raise ShardplanError(f"graph {self.name!r} has a cycle: {path}")

    def _weight_edges(self) -> None:
        """Derive :attr:`weight_edges`; clear the owner of a reader whose owner is not in the graph."""
        import dataclasses

        ops = list(self.operators)
        for i, op in enumerate(ops):
            if any(w.owner is not None and w.owner[0] not in self.index for w in op.weights):
                ops[i] = dataclasses.replace(op, weights=tuple(
                    dataclasses.replace(w, owner=None) if w.owner is not None and w.owner[0] not in self.index
                    else w for w in op.weights))
        object.__setattr__(self, "operators", tuple(ops))
        out = []
        for j, op in enumerate(ops):
            for wj, w in enumerate(op.weights):
                if w.owner is None:
                    continue
                oname, wname = w.owner
                i = self.index[oname]
                if i == j:
                    raise ShardplanError(f"graph {self.name!r}: weight {w.name!r} of {op.name!r} names its own "
                                         "operator as owner")
                names = [t.name for t in ops[i].weights]
                if wname not in names:
                    raise ShardplanError(f"graph {self.name!r}: weight {w.name!r} of {op.name!r} is owned by "
                                         f"{oname!r}'s weight {wname!r}, which {oname!r} does not have ({names})")
                wi = names.index(wname)
                t = ops[i].weights[wi]
                if t.owner is not None:
                    raise ShardplanError(f"graph {self.name!r}: {oname!r}'s weight {wname!r} owns {op.name!r}'s "
                                         f"{w.name!r} but has an owner itself ({t.owner})")
                if (t.shape, t.elem_factor) != (w.shape, w.elem_factor):
                    raise ShardplanError(f"graph {self.name!r}: {op.name!r} reads {oname!r}'s weight {wname!r} "
                                         f"as shape {w.shape}; it has shape {t.shape}")
                out.append(WeightEdge(i, j, wi, wj))
        object.__setattr__(self, "weight_edges", tuple(out))

    def _check_ties(self) -> None:
        """Tie groups name known operators of one description (dims and extents), each in at most one group."""
        ties = tuple(tuple(str(n) for n in grp) for grp in self.ties)
        object.__setattr__(self, "ties", ties)
        for grp in check_ties([op.name for op in self.operators], ties):
            first = self.operators[grp[0]]
            for i in grp[1:]:
                op = self.operators[i]
                if op.dims != first.dims or op.fixed != first.fixed:
                    raise ShardplanError(f"graph {self.name!r}: tied operators {first.name!r} and {op.name!r} "
                                         f"have different dimensions ({first.label} / {op.label})")

    def derive(self, operators: Iterable[Operator], name: str | None = None,
               graph_inputs: Mapping[str, Sequence[int]] | None = None) -> Graph:
        """A graph of ``operators``, operators of this graph by name (their inputs possibly rewired), with
        every other field of this graph restricted to them: the tie groups' members among them (a group left
        with one member is dropped), the recomputed operators among them. ``graph_inputs``: by default every
        tensor an operator reads from outside ``operators`` (an earlier stage's output becomes an input).
        ``name``: by default this graph's. Weight owners outside ``operators`` are cleared (see the class
        docstring). :meth:`renamed` renames; the two are the only ways the package derives a graph from
        another, so that no field is dropped on the way."""
        ops = tuple(operators)
        names = {op.name for op in ops}
        unknown = sorted(names - set(self.index))
        if unknown:
            raise ShardplanError(f"graph {self.name!r} has no operator {unknown[0]!r} to derive a graph from")
        if graph_inputs is None:
            graph_inputs = {t.src: t.shape for op in ops for t in op.inputs
                            if t.src is not None and t.src not in names}
        kept = (tuple(n for n in grp if n in names) for grp in self.ties)
        return Graph(self.name if name is None else name, ops, {k: tuple(v) for k, v in graph_inputs.items()},
                     ties=tuple(grp for grp in kept if len(grp) > 1),
                     recomputed=self.recomputed & names)

    def renamed(self, mapping: Mapping[str, str], name: str | None = None) -> Graph:
        """This graph with operators and graph inputs renamed by ``mapping`` (names not in it kept) in every
        field: operator names, the producers their inputs name, weight owners (:func:`renamed`), graph inputs,
        tie groups, recomputed operators. ``name``: by default this graph's."""
        def new(n: str) -> str:
            return mapping.get(n, n)

        return Graph(self.name if name is None else name, tuple(renamed(op, mapping) for op in self.operators),
                     {new(k): v for k, v in self.graph_inputs.items()},
                     ties=tuple(tuple(new(n) for n in grp) for grp in self.ties),
                     recomputed=frozenset(new(n) for n in self.recomputed))

    def to_networkx(self) -> nx.MultiDiGraph:
        """The operator graph as a networkx MultiDiGraph (nodes are operator names)."""
        import networkx as nx

        g = nx.MultiDiGraph(name=self.name)
        for op in self.operators:
            g.add_node(op.name, kind=op.kind)
        for e in self.edges:
            g.add_edge(self.operators[e.src].name, self.operators[e.dst].name, slot=e.slot)
        return g

    def __getitem__(self, name: str) -> Operator:
        try:
            return self.operators[self.index[name]]
        except KeyError:
            raise ShardplanError(f"graph {self.name!r} has no operator {name!r}") from None

    def __len__(self) -> int:
        return len(self.operators)

    def __iter__(self):
        return iter(self.operators)

    def topological_order(self) -> list[int]:
        """Operator indices in topological order, the smallest ready index first (lexicographic)."""
        return _kahn(len(self.operators), self.edges)


def _kahn(n: int, edges: Sequence[EdgeRef]) -> list[int]:
    """Kahn's algorithm over vertices 0..n-1, always taking the smallest ready vertex.

    Returns the vertices it could order: all n exactly when the graph is acyclic.
    """
    import heapq

    indeg = [0] * n
    succ: list[list[int]] = [[] for _ in range(n)]
    for e in edges:
        indeg[e.dst] += 1
        succ[e.src].append(e.dst)
    ready = [i for i in range(n) if indeg[i] == 0]
    heapq.heapify(ready)
    out: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        out.append(i)
        for j in succ[i]:
            indeg[j] -= 1
            if indeg[j] == 0:
                heapq.heappush(ready, j)
    return out


def _find_cycle(n: int, edges: Sequence[EdgeRef], ordered: set[int]) -> list[int]:
    """A directed cycle among the vertices Kahn's algorithm could not order, in edge direction.

    Every such vertex has a predecessor that is also unordered, so walking
    predecessors from any of them must revisit a vertex: the walk from that
    vertex back to itself, reversed, is a cycle.
    """
    pred: dict[int, int] = {}
    for e in edges:
        if e.dst not in ordered and e.src not in ordered:
            pred.setdefault(e.dst, e.src)
    v = min(pred)
    seen: dict[int, int] = {}
    walk: list[int] = []
    while v not in seen:
        seen[v] = len(walk)
        walk.append(v)
        v = pred[v]
    return walk[seen[v]:][::-1]


def renamed(op: Operator, ren: Mapping[str, str]) -> Operator:
    """``op`` with its own name, its inputs' producers and its weights' owners renamed by ``ren``
    (names not in ``ren`` kept)."""
    import dataclasses

    return dataclasses.replace(
        op, name=ren.get(op.name, op.name),
        inputs=tuple(dataclasses.replace(t, src=ren.get(t.src, t.src)) if t.src is not None else t
                     for t in op.inputs),
        weights=tuple(dataclasses.replace(t, owner=(ren.get(t.owner[0], t.owner[0]), t.owner[1]))
                      if t.owner is not None else t for t in op.weights))


def unique_name(base: str, taken: Callable[[str], bool]) -> str:
    """``base`` if not ``taken``, else the first free one of ``base_2``, ``base_3``, ..."""
    base = base or "op"
    if not taken(base):
        return base
    i = 2
    while taken(f"{base}_{i}"):
        i += 1
    return f"{base}_{i}"


class GraphBuilder:
    """Collects operators in order and builds a validated :class:`Graph`.

    >>> b = GraphBuilder("mlp")
    >>> x = b.input("x", (64, 784))
    >>> h = b.add(ops.dense("fc1", x, 512))            # doctest: +SKIP
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._ops: list[Operator] = []
        self._names: set[str] = set()
        self._inputs: dict[str, tuple[int, ...]] = {}

    def input(self, name: str, shape: Sequence[int], needs_grad: bool = False) -> TensorRef:
        """Declare a graph input (data, labels, token ids)."""
        if name in self._names or name in self._inputs:
            raise ShardplanError(f"graph {self.name!r}: name {name!r} is already used")
        shape = tuple(int(s) for s in shape)
        if any(s <= 0 for s in shape):
            raise ShardplanError(f"graph input {name!r} has a zero or negative extent in {shape}")
        if any(s > MAX_EXTENT for s in shape):
            raise ShardplanError(f"graph input {name!r}: shape {shape} has an extent above {MAX_EXTENT}, "
                                 "more than the cost model supports")
        self._inputs[name] = shape
        return TensorRef(name, shape, is_input=True, needs_grad=needs_grad)

    def unique(self, base: str) -> str:
        """``base`` if unused, else ``base_2``, ``base_3``, ... (see :func:`unique_name`)."""
        return unique_name(base, lambda n: n in self._names or n in self._inputs)

    def add(self, op: Operator) -> TensorRef:
        """Append an operator; returns a reference to its output."""
        if op.name in self._names or op.name in self._inputs:
            raise ShardplanError(f"graph {self.name!r}: two operators are named {op.name!r}")
        self._names.add(op.name)
        self._ops.append(op)
        return op.out

    def extend(self, ops: Iterable[Operator]) -> list[TensorRef]:
        return [self.add(op) for op in ops]

    def build(self) -> Graph:
        return Graph(self.name, tuple(self._ops), dict(self._inputs))


def check_ties(names: Sequence[str], groups: Sequence[Sequence[str]]) -> tuple[tuple[int, ...], ...]:
    """Tie groups as operator indices into ``names``; every name known, no operator in two groups, at least
    two members each."""
    index = {n: i for i, n in enumerate(names)}
    seen: dict[int, int] = {}
    out = []
    for gi, grp in enumerate(groups):
        members = []
        for n in grp:
            if n not in index:
                raise ShardplanError(f"tie group {gi}: unknown operator {n!r}")
            i = index[n]
            if i in seen:
                raise ShardplanError(f"operator {n!r} is in two tie groups ({seen[i]} and {gi})")
            seen[i] = gi
            members.append(i)
        if len(members) < 2:
            raise ShardplanError(f"tie group {gi} has {len(members)} member(s); a tie needs at least two")
        out.append(tuple(members))
    return tuple(out)
