"""A collective beside a product on the same device: what the overlap costs the product.

NCCL runs a collective as one CUDA thread block (CTA) per channel for the collective's whole duration (its
communicator options ``minCTAs`` / ``maxCTAs`` bound the CTAs it uses; its user guide's "Zero-CTA Optimization"
exists to take collectives off the SMs). The model takes each block to hold one streaming multiprocessor that a
product beside it cannot use (a large GEMM's thread blocks fill an SM's registers and shared memory, so the two
do not share one): a product that overlaps a collective runs on ``1 - φ`` of the device's compute while the
collective runs, φ = channels / SMs (:attr:`~shardplan.machine.Machine.comm_contention`). Memory-bandwidth
contention (the collective's own HBM traffic) and copy-engine transfers (host offload, which take no SM) are not
modelled.

With the product W seconds at full speed and the collective C seconds, both started together, let
W' = W / (1 - φ), the product slowed for its whole length. If C >= W' the collective outlasts the slowed
product and the pair takes C. Otherwise the product runs at 1 - φ for C seconds, loses φ C of progress, and
ends at W + φ C. Both cases are

    W + max(C - W, φ C)

(the branches meet at C = W', where C - W = φ C). φ = 0 gives the usual ``max(C - W, 0)``; a collective with
nothing beside it (W = 0) costs C whatever φ. The seconds hidden are ``C - max(C - W, φ C) = min(W, (1 - φ) C)``.
"""

from __future__ import annotations

import numpy as np


def exposed_beside(comm, compute, share: float) -> np.ndarray:
    """Seconds a collective of ``comm`` seconds adds to a product of ``compute`` seconds it runs beside, the
    collective taking a fraction ``share`` (φ) of the device's compute while it runs: ``max(C - W, φ C)``
    (module docstring). Element-wise; ``compute`` <= 0 charges the collective in full."""
    c = np.asarray(comm, dtype=np.float64)
    return np.maximum(c - np.asarray(compute, dtype=np.float64), share * c)


def hidden_beside(comm, compute, share: float) -> np.ndarray:
    """Seconds of a collective of ``comm`` seconds that a product of ``compute`` seconds hides under contention
    ``share``: ``C - max(C - W, φ C) = min(W, (1 - φ) C)`` (never negative)."""
    c = np.asarray(comm, dtype=np.float64)
    return np.maximum(np.minimum(np.asarray(compute, dtype=np.float64), (1.0 - share) * c), 0.0)
