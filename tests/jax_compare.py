"""Comparisons of JAX results on the host, in numpy.

``jnp.max(jnp.abs(a - b))`` on two arrays runs three eager operators, each compiled for the shapes and
shardings of its operands (a sharded gradient and an unsharded one: a program per leaf). Read to the host
and compared in numpy, the same float32 differences and maxima are computed with nothing compiled
(tests/jax_engine/test_jax_corpus.py: about 1.5 CPU s per model, measured on GPT-2, T5, BLOOM, Griffin).
"""

from __future__ import annotations

from typing import Any

import numpy as np


def max_abs(x: Any) -> float:
    """max |x| over the entries of one array (0 for an empty one)."""
    a = np.asarray(x)
    return float(np.abs(a).max()) if a.size else 0.0


def max_abs_diff(a: Any, b: Any) -> float:
    """max |a - b| over the entries of two arrays of one shape, in the arrays' own dtype (0 for empty ones)."""
    x, y = np.asarray(a), np.asarray(b)
    if x.shape != y.shape:
        raise ValueError(f"shapes differ: {x.shape} and {y.shape}")
    return float(np.abs(x - y).max()) if x.size else 0.0
