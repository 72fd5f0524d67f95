"""The compute of a memory-bound operator inside a compiler-fused kernel (:attr:`~shardplan.ir.Operator.kernel_io`).

A compiler (XLA) fuses a chain of elementwise operators and reductions into one kernel that reads the
chain's external inputs from HBM once and writes its external outputs once; the values passed between the
chain's operators stay on chip (docs/cost-model.md, "Fused memory-bound chains"). The frontend says, per
operator, which operands its kernels load (``reads[i]`` times operand ``i``: 0 when produced or already loaded
in the same kernel) and whether its output is written (``write``); summed over a kernel's operators that is the
kernel's traffic. Per device, for a configuration with largest tiles ``|T|``:

* forward bytes: ``s (sum_i reads_i |T_i| + write |O|)``;
* backward bytes (the chain's backward is fused the same way: it reads the gradient of every output that
  left the chip and the external inputs it needs as residuals, and writes the gradient of every external
  input once): ``s (write |O| + sum_i back_i |T_i|)``, ``back_i`` the tiles of operand ``i`` the frontend
  charges to this operator (its gradient written, its value re-read; :class:`~shardplan.ir.KernelIO`);
* FLOPs as :func:`shardplan.cost.operator.operator_cost` counts them (``f prod_d E_d / c_d`` forward, once
  more per gradient produced backward);
* each direction a roofline ``max(FLOPs / achievable rate, bytes / HBM bandwidth)``.

An operator of an eager program (``kernel_io`` None) is charged as its own kernel instead, every operand read
and the output written on every pass (docs/cost-model.md, "Compute").
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from shardplan.ir import Operator
from shardplan.machine import Machine

__all__ = ["chain_bytes", "chain_compute", "hbm_elements"]


def chain_bytes(op: Operator, max_tile: Callable[..., np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) elements each device moves through HBM for ``op`` per configuration, (K,) each
    (module docstring); ``max_tile(tensor, core=...)``: the largest tile of a tensor per configuration."""
    io = op.kernel_io
    assert io is not None
    out = max_tile(op.output) * io.write
    forward = out.copy()
    backward = out.copy()
    for t, r, k in zip(op.inputs + op.weights, io.reads, io.back):
        if r > 0 or k > 0:
            tile = max_tile(t, core=False)
            forward = forward + r * tile
            backward = backward + k * tile
    if not op.grad_tensors:
        return forward, np.zeros_like(forward)
    return forward, backward


def chain_compute(op: Operator, flops: np.ndarray, machine: Machine, rate: float | None,
                  max_tile: Callable[..., np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(forward seconds, forward + backward seconds) per configuration of an operator inside a fused kernel;
    ``flops``: its forward FLOPs per device (K,), ``rate``: the bytes/s its kernels stream (None: no HBM
    term, the paper's model)."""
    fwd = flops / machine.achievable_flops
    bwd = len(op.grad_tensors) * fwd
    if rate is not None:
        f_bytes, b_bytes = chain_bytes(op, max_tile)
        nbytes = float(machine.dtype_bytes) / float(rate)
        fwd = np.maximum(fwd, f_bytes * nbytes)
        if op.grad_tensors:
            bwd = np.maximum(bwd, b_bytes * nbytes)
    return fwd, fwd + bwd


def hbm_elements(op: Operator) -> tuple[float, float]:
    """(forward, backward) elements ``op`` moves through HBM on one device holding all of it, as the cost model
    charges them: :func:`chain_bytes` inside a fused kernel; a fused attention's kernels
    (:func:`shardplan.cost.fused.fused_bytes`); otherwise its own kernel per pass, every operand read and the
    output written, once forward and once per gradient produced (a bias's gradient, a reduction of the
    output's gradient, reads that and writes the bias). What a plan's step moves, to set beside a compiler's
    own count (XLA's ``cost_analysis()["bytes accessed"]``)."""
    from shardplan.cost.fused import fused_bytes

    def whole(t, core: bool = True) -> np.ndarray:
        return np.asarray([float(t.size)])

    if op.kernel_io is not None:
        f, b = chain_bytes(op, whole)
    elif op.backward_flops is not None:
        f, b = fused_bytes(op, whole)
    else:
        moved = float(op.output.size + sum(t.size for t in op.inputs + op.weights))
        epi = [t for t in op.grad_tensors if any(t is e for e in op.epilogue_tensors)]
        rest = len(op.grad_tensors) - len(epi)
        return moved, rest * moved + sum(op.output.size + t.size for t in epi)
    return float(f[0]), float(b[0])
