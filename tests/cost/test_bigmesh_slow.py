"""Meshes of any size, at size: Llama 3 405B's tables on 4,096 devices equal the per-device computation, and on
16,384 they are built with no per-device array within the build's memory estimate (tens of seconds)."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from shardplan import preset
from shardplan.cost import build_tables
from shardplan.cost.budget import estimate_build
from shardplan.cost.edge import _pattern_side, edge_cost
from shardplan.cost.memory import operator_memory
from shardplan.cost.tiles import MAX_DEVICES
from shardplan.models import get_model

pytestmark = pytest.mark.slow


def test_llama3_405b_on_4096_devices_equals_the_per_device_computation():
    g = get_model("llama3-405b", layers=2)
    m = preset("h100", 4096)
    tab = build_tables(g, m, memory_limit_bytes=1 << 40)
    ops = g.operators
    for i, op in enumerate(ops):
        w0, a0 = operator_memory(op, tab.arrays[i], m, per_device=True)
        w1, a1 = tab.memory[i]
        assert w1.shape == (len(tab.arrays[i]), 1)
        assert np.array_equal(np.broadcast_to(w1, w0.shape), w0) and np.array_equal(np.broadcast_to(a1, a0.shape), a0)
    done: set[int] = set()
    for e, mat in zip(g.edges, tab.edge_costs):
        if id(mat) not in done:
            done.add(id(mat))
            ref = edge_cost(ops[e.src], tab.arrays[e.src], ops[e.dst], e.slot, tab.arrays[e.dst], m, analytic=False)
            assert np.array_equal(ref, mat)


def test_llama3_405b_on_16384_devices_builds_without_per_device_arrays():
    """Llama 3 405B (two blocks) on 16,384 h100: every operator and edge on the pattern path, memory one column
    per layout, and the build's estimate bounds what it allocates (tracemalloc)."""
    g = get_model("llama3-405b", layers=2)
    m = preset("h100", 16384)
    assert m.num_devices > MAX_DEVICES
    tracemalloc.start()
    tab = build_tables(g, m)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert all(w.shape[1] == 1 and a.shape[1] == 1 for w, a in tab.memory)
    assert peak <= tab.options["memory_estimate_bytes"], (peak, tab.options["memory_estimate_bytes"])
    ops = g.operators
    assert all(_pattern_side(ops[e.src], ops[e.src].output, tab.arrays[e.src]) is not None for e in g.edges)
    keys = list(range(len(ops)))
    est = estimate_build(g, keys, dict(enumerate(tab.arrays)), m.num_devices)
    assert est.peak_bytes < 1 << 30
