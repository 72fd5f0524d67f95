"""FP8 matrix products and host offload in the PyTorch run (a fit plan's precision and offload choices).

**FP8.** An operator the plan runs in FP8 (:attr:`shardplan.result.OperatorChoice.fp8`, offered by
:func:`shardplan.cost.memory.fp8_product` to products that contract an input with a trainable weight) has
its product's operands cast to ``float8_e4m3fn`` with one scale per tensor, and the gradient of its output
cast to ``float8_e5m2`` in the backward pass (Transformer Engine's hybrid recipe: E4M3 forward, E5M2 for
gradients). A cast of ``x`` with the format's largest value ``M`` (448 for E4M3, 57344 for E5M2) is

    s = M / amax(|x|),    x_8 = fp8(x * s),    x ~ x_8 / s,

the amax taken over the **whole** tensor: a DTensor's ``amax`` reduces over its shards (an all-reduce of
the maximum), so every rank scales by the scale the unsharded program uses and each element is rounded
exactly as there. That is *current* scaling (this cast's own amax; TE's ``Float8CurrentScaling``), the
default. *Delayed* scaling (TE's ``DelayedScaling``, its default recipe and what the cost model charges) is
:class:`DelayedScaling`, state the module holds across steps: ``s = M / max(h)`` from the tensor's amax
history ``h`` of earlier steps (1 while it is empty, TE's initial scale), the cast saturating at ``M``, and
each cast's amax recorded; at the start of the next step (:meth:`DelayedScaling.commit`) every history
takes one entry, the largest amax its tensor's casts saw in the step (over its micro-batches), the oldest
dropped (as :mod:`shardplan.jax.fp8`). CPUs have no FP8 product: the run quantises and dequantises each operand
(:func:`fp8_cast`: the values an FP8 product reads) and multiplies in the working precision, FP32 in the
tests, which is what an FP8 tensor core computes with its FP32 accumulator up to the order of the sums.
The gradient through a cast is the identity (straight-through), as with a real FP8 product, whose
backward products read the same FP8 operands (the saved ``x_8`` and ``W_8``) and the E5M2 output gradient.

Which operands: the tensors of the product that index a dimension the operator contracts with its weight
(:func:`fp8_operands`): the input and the weight of a dense layer, never its bias.

**Host offload.** An operator whose activations live in host memory
(:attr:`~shardplan.result.OperatorChoice.offload` holds ``activations``) runs under
``torch.autograd.graph.saved_tensors_hooks`` (:class:`HostOffload`): every tensor autograd saves for its
backward pass is copied to host memory when saved (pinned, asynchronously, from a GPU; on a CPU a copy to
a separate tensor) and copied back to the device when the backward pass reads it. Optimizer state in host
memory (``optimizer``; ZeRO-Offload) is :class:`HostOptimizer`: the parameters' host copies, the gradients
copied there, the optimizer step run on the host, the new values copied back.
"""

from __future__ import annotations

from typing import Any, Iterable

from shardplan.ir import Operator

__all__ = ["fp8_operands", "fp8_cast", "fp8_grad", "DelayedScaling", "HostOffload", "HostOptimizer", "E4M3_MAX",
           "E5M2_MAX", "AMAX_HISTORY"]

E4M3_MAX = 448.0
"""The largest finite ``float8_e4m3fn`` (OCP 8-bit floating point specification, 2023: S.1111.110 = 1.75 x 2^8)."""
E5M2_MAX = 57344.0
"""The largest finite ``float8_e5m2`` (same specification: S.11110.11 = 1.75 x 2^15)."""
AMAX_HISTORY = 1024
"""Amax history length of delayed scaling: Transformer Engine's default ``amax_history_len``
(``transformer_engine.common.recipe.DelayedScaling``), the scale from the history's max (``amax_compute_algo="max"``,
margin 0)."""


class DelayedScaling:
    """Delayed scaling's state (module docstring): per tensor key an amax history, newest first, and the amaxes
    recorded since the last :meth:`commit`.

    ``scale(key, M)``: ``M / max(history)`` (1 for a key with no history yet or an all-zero one);
    ``record(key, amax)``: this step's amax of a cast; ``commit()``: every recorded key's history shifted by
    one with the largest amax recorded for it as the newest entry (called by the runner when a step starts)."""

    def __init__(self, length: int = AMAX_HISTORY) -> None:
        if int(length) < 1:
            from shardplan.errors import ShardplanError

            raise ShardplanError(f"an amax history holds at least one step, got length {length}")
        self.length = int(length)
        self.history: dict[str, Any] = {}
        self.pending: dict[str, float] = {}

    def scale(self, key: str, largest: float) -> float:
        h = self.history.get(key)
        amax = float(h.max()) if h is not None else 0.0
        return largest / amax if amax > 0.0 else 1.0

    def record(self, key: str, amax: float) -> None:
        self.pending[key] = max(self.pending.get(key, 0.0), float(amax))

    def commit(self) -> None:
        import torch

        for key, amax in self.pending.items():
            h = self.history.get(key)
            h = torch.zeros(self.length, dtype=torch.float64) if h is None else torch.roll(h, 1)
            h[0] = amax
            self.history[key] = h
        self.pending = {}


def fp8_operands(op: Operator) -> frozenset[str]:
    """Names of the tensors of ``op`` an FP8 product reads in FP8: its inputs and trainable weights that index a
    dimension the operator sums over and some trainable weight indexes (the contraction with the weight; a
    bias indexes none)."""
    red = set(op.reduction_dims) & set().union(*(w.dims for w in op.weights if w.needs_grad))
    return frozenset(t.name for t in (*op.inputs, *(w for w in op.weights if w.needs_grad)) if red & t.dims)


def _amax(x: Any) -> float:
    """max |x| over the whole tensor (a DTensor's over all its shards)."""
    from torch.distributed.tensor import DTensor

    m = x.detach().abs().amax()
    return float(m.full_tensor() if isinstance(m, DTensor) else m)


def _quantise(x: Any, fmt: Any, largest: float, scaling: DelayedScaling | None = None, key: str = "") -> Any:
    """``x`` rounded to ``fmt`` and scaled back (no gradient): with the per-tensor scale ``largest / amax(|x|)``
    (current scaling), or with ``scaling``'s delayed scale of ``key`` (saturating; the amax recorded)."""
    amax = _amax(x)
    if scaling is not None:
        scaling.record(key, amax)
        s = scaling.scale(key, largest)
        return ((x.detach() * s).clamp(-largest, largest).to(fmt).to(x.dtype)) / s
    if amax == 0.0:
        return x.detach()
    s = largest / amax
    return ((x.detach() * s).to(fmt).to(x.dtype)) / s


def fp8_cast(x: Any, scaling: DelayedScaling | None = None, key: str = "") -> Any:
    """``x`` as an FP8 product reads it: E4M3 with the per-tensor scale (current, or ``scaling``'s for ``key``:
    module docstring); the gradient passes through unchanged. A DTensor stays a DTensor with the same
    placements."""
    import torch

    q = _quantise(x, torch.float8_e4m3fn, E4M3_MAX, scaling, key)
    return x + (q - x).detach() if x.requires_grad else q


def _grad_function(scaling: DelayedScaling | None, key: str) -> Any:
    import torch

    class _Fp8Grad(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:
            return x.view_as(x)

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            return _quantise(g, torch.float8_e5m2, E5M2_MAX, scaling, key)

    return _Fp8Grad


def fp8_grad(y: Any, scaling: DelayedScaling | None = None, key: str = "") -> Any:
    """``y`` unchanged; in the backward pass its gradient is cast to E5M2 with the per-tensor scale of the whole
    gradient (current, or ``scaling``'s for ``key``: module docstring), as an FP8 product's backward products
    read it."""
    if not getattr(y, "requires_grad", False):
        return y
    return _grad_function(scaling, key).apply(y)


def _to(t: Any, device: Any) -> Any:
    """A copy of ``t`` (a DTensor: of its local shard, rewrapped alike) on ``device``; pinned host memory and a
    non-blocking copy when it leaves a GPU."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        local = _to(t._local_tensor, device)
        return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                  stride=t.stride())
    pin = torch.device(device).type == "cpu" and t.device.type == "cuda"
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device, pin_memory=pin)
    return out.copy_(t.detach(), non_blocking=pin)


class HostOffload:
    """Saved-tensor hooks that keep what autograd saves in host memory: ``pack`` copies a tensor to the host
    (:func:`_to`) and records where it came from, ``unpack`` copies it back. ``saved_bytes`` counts the bytes
    moved to the host (the offloaded activations of the run), ``tensors`` how many tensors."""

    def __init__(self, host: str = "cpu") -> None:
        self.host = host
        self.saved_bytes = 0
        self.tensors = 0

    def pack(self, t: Any) -> Any:
        import torch

        if not isinstance(t, torch.Tensor) or not t.numel():
            return t
        self.saved_bytes += t.numel() * t.element_size()
        self.tensors += 1
        return (t.device, _to(t, self.host))

    def unpack(self, packed: Any) -> Any:
        if not isinstance(packed, tuple):
            return packed
        device, t = packed
        return t if t.device == device else _to(t, device)

    def hooks(self) -> Any:
        """The context manager that installs the hooks."""
        import torch

        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class HostOptimizer:
    """A ``torch.optim`` optimizer whose parameters and state live in host memory (ZeRO-Offload's optimizer
    step on the CPU): ``HostOptimizer(params, torch.optim.AdamW, lr=...)``.

    Each parameter (a DTensor: its local shard) has a host copy the inner optimizer owns, so its state
    (Adam's moments) is created there. :meth:`step` copies each gradient to its host copy, steps on the host
    and copies the new values back into the device parameters; :meth:`zero_grad` clears the device gradients.
    On a CPU the host copies are separate tensors, so the device parameters change only through the copy back.
    ``device_params``: parameters whose state stays on the device, stepped there by the same optimizer class
    (``device``; None when there are none). ``homes``: ``id(parameter) -> host tensor`` for parameters that live
    in host memory themselves (ZeRO-Infinity's ``offload_param``): the host tensor is their host copy, and the
    step leaves their device memory alone (the run brings them in when it uses them).
    """

    def __init__(self, params: Iterable[Any], optimizer: Any, host: str = "cpu", device_params: Iterable[Any] = (),
                 homes: Any = None, **options: Any) -> None:
        import torch

        self.homes = dict(homes or {})
        self.params = [p for p in params if p.requires_grad]
        self.host_params = [torch.nn.Parameter(self.homes[id(p)]) if id(p) in self.homes else self._host(p, host)
                            for p in self.params]
        self.inner = optimizer(self.host_params, **options)
        kept = [p for p in device_params if p.requires_grad]
        self.device = optimizer(kept, **options) if kept else None

    @staticmethod
    def _host(p: Any, host: str) -> Any:
        import torch

        local = p.detach().to_local() if hasattr(p, "to_local") else p.detach()
        return torch.nn.Parameter(_to(local, host))

    def step(self) -> None:
        import torch

        with torch.no_grad():
            for p, h in zip(self.params, self.host_params):
                if p.grad is None:
                    h.grad = None
                    continue
                g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                h.grad = _to(g, h.device)
            self.inner.step()
            for p, h in zip(self.params, self.host_params):
                if id(p) in self.homes:  # lives in host memory: the step updated it there
                    continue
                local = p.to_local() if hasattr(p, "to_local") else p
                local.copy_(h, non_blocking=True)
        if self.device is not None:
            self.device.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        self.inner.zero_grad(set_to_none)
        if self.device is not None:
            self.device.zero_grad(set_to_none)

    def state_bytes(self) -> int:
        """Bytes of the optimizer state, all of it in host memory."""
        import torch

        return sum(v.numel() * v.element_size() for s in self.inner.state.values() for v in s.values()
                   if isinstance(v, torch.Tensor))
