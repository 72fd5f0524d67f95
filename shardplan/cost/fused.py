"""The compute of an operator whose backward is one fused kernel (:attr:`~shardplan.ir.Operator.backward_flops`).

FlashAttention (:func:`shardplan.ops.flash_attention`) is the case: forward and backward each run as one
kernel that keeps the (s, t) scores in on-chip memory. Per device, for a configuration with tile extents
``E_d / c_d`` (docs/cost-model.md, "Fused attention"):

* FLOPs: forward ``f * prod_d E_d / c_d``, backward ``f_b * prod_d E_d / c_d`` (``f`` =
  ``flops_per_point``, ``f_b`` = ``backward_flops``), both times the busiest device's share under a causal
  mask (:func:`shardplan.cost.causal.causal_fractions`: the kernel skips the masked blocks), at the machine's
  fused-attention rate (:attr:`~shardplan.machine.Machine.attention_flops`: ``attention_efficiency`` of the
  peak, else ``flops_efficiency``; the kernel is not one product: no tile-quantisation factor);
* HBM bytes: forward, the inputs read and what is saved written (``saved`` output tiles: the output and the
  log-sum-exp rows); backward, the inputs, the saved tiles and the output's gradient read, the inputs'
  gradients written. For attention: q, k, v, o, lse forward; q, k, v, o, lse, dO, dq, dk, dv backward. No
  other tensor (the scores, the probabilities, their gradients) is counted;
* each pass is a roofline: ``max(FLOPs / rate, bytes / HBM bandwidth)`` (FLOPs alone without a bandwidth).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from shardplan.cost.causal import causal_fractions
from shardplan.ir import Operator
from shardplan.machine import Machine

__all__ = ["fused_compute", "fused_bytes"]


def fused_bytes(op: Operator, max_tile: Callable[..., np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) elements each device moves through HBM per configuration, (K,) each (module
    docstring); ``max_tile(tensor, core=...)``: the largest tile of a tensor per configuration."""
    inputs = sum(max_tile(t, core=False) for t in op.inputs + op.weights)
    out = max_tile(op.output)
    saved = float(op.saved) * out
    forward = inputs + saved
    if not op.grad_tensors:
        return forward, np.zeros_like(forward)
    grads = sum(max_tile(t, core=False) for t in op.grad_tensors)
    return forward, inputs + saved + out + grads


def fused_compute(op: Operator, configs: np.ndarray, machine: Machine,
                  max_tile: Callable[..., np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(forward seconds, forward + backward seconds) per configuration (rows of total splits, (K, n)) of an
    operator with a fused backward (module docstring)."""
    assert op.backward_flops is not None
    configs = np.asarray(configs, dtype=np.int64)
    ext = np.asarray([e for _, e in op.dims], dtype=np.float64)
    points = np.prod(ext[None, :] / configs, axis=1)
    if op.causal is not None:
        points = points * causal_fractions(op, configs)[0]
    rate = machine.attention_flops
    fwd = op.flops_per_point * points / rate
    bwd = op.backward_flops * points / rate if op.grad_tensors else np.zeros_like(fwd)
    if machine.hbm_bandwidth is not None:
        nbytes = float(machine.dtype_bytes) / machine.hbm_bandwidth
        f_bytes, b_bytes = fused_bytes(op, max_tile)
        fwd = np.maximum(fwd, f_bytes * nbytes)
        if op.grad_tensors:
            bwd = np.maximum(bwd, b_bytes * nbytes)
    return fwd, fwd + bwd
