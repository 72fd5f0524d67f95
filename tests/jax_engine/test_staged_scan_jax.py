"""The JAX stage runner reduces a ZeRO 0/1 weight's gradient once a step when a scanned model reads its stacked
weights by the layer index (``w[i]`` inside ``lax.scan`` over ``jnp.arange(L)``: a ``dynamic_slice`` at a traced
start along the layer axis, which the runner's unrolled scan keeps traced). Where the slice cuts only axes the
weight's tile leaves unsplit it is local (each device's block of the slice is the slice of its block,
``shardplan.jax.local_reads.local_view``), so the products read it per device with the start carried to them
(docs/jax.md, "What the stage programs send for a weight"). Counted in the compiled HLO as in
``test_staged_views_jax.py``; the gradients equal the unsharded program's."""

from __future__ import annotations

import types

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from conftest import require_8_devices
from test_pipeline_jax import D, T, V, _toy
import test_staged_defer_jax

DEVICES = require_8_devices()
L, B, M = 2, 128, 4  # layers, batch, micro-batches: 2 stages of 4 devices, each leaf replicated over its stage


def _params(seed: int = 0):
    r = np.random.default_rng(seed)

    def n(*s):
        return jnp.asarray(r.normal(size=s).astype(np.float32) / np.sqrt(s[-2]))

    return {"embed": n(V, D), "head": n(D, V), "g": jnp.asarray(1 + 0.1 * r.normal(size=(L, D)), jnp.float32),
            "w1": n(L, D, 4 * D), "w2": n(L, 4 * D, D)}


def _tokens():
    r = np.random.default_rng(1)
    return jnp.asarray(r.integers(0, V, (B, T))), jnp.asarray(r.integers(0, V, (B, T)))


def _scanned_loss(p, batch):
    """An embedding, ``lax.scan`` over the layer indices of an RMS-normed MLP whose stacked weights are read as
    ``p[...][i]``, a head and cross-entropy."""
    ids, y = batch
    h = p["embed"][ids]

    def layer(h, i):
        z = h * p["g"][i] / jnp.sqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6)
        return h + jnp.tanh(z @ p["w1"][i]) @ p["w2"][i], None

    h, _ = jax.lax.scan(layer, h, jnp.arange(L))
    lp = jax.nn.log_softmax(h @ p["head"])
    return -jnp.mean(jnp.take_along_axis(lp, y[..., None], -1))


@pytest.mark.parametrize("traced, deferred, backward, once", [
    # the runner before: the stacked weights' gradients (one layer's slice of g, w1, w2: 16 + 1024 + 1024 floats)
    # all-reduced by each micro-batch's backward, 4 x 2 x 2064 + 1024 = 17536 floats a step
    pytest.param(False, [1, 1], [2064, 2064], [512, 512], marks=pytest.mark.slow),
    # traced slices read per device: nothing per micro-batch, each stage's 4 leaves once a step, 9280 floats
    (True, [4, 4], [0, 0], [4640, 4640]),
])
def test_a_scanned_model_sends_each_gradient_once_a_step(monkeypatch, traced, deferred, backward, once):
    """The scanned model on 2 stages of 4 data-parallel devices, m = 4: with the traced ``dynamic_slice`` a view,
    every leaf of both stages is deferred and no backward program sends anything; the step's reduction programs
    all-reduce each stage's whole stacked leaves (the tables charge the stacked weight once a step: its reader, the
    ``dynamic_slice`` operator, reads it whole). The gradients equal the unsharded program's either way."""
    import shardplan.jax.staged as staged

    if not traced:
        monkeypatch.setattr(staged, "_RUNTIME_VIEWS", frozenset())
    monkeypatch.setattr(test_staged_defer_jax, "ROWS", B // M)
    params, batch = _params(), _tokens()
    step = staged.pipeline(_scanned_loss, params, batch, machine=_toy(), sizes=(4,), micro_batches=(M,))
    assert [(s.offset, s.devices) for s in step.plan.stages] == [(0, 4), (4, 4)]
    assert [len(st.defer) for st in step.stages] == deferred and [len(st.params) for st in step.stages] == [4, 4]
    sent, reduced, others = test_staged_defer_jax._sent(step, params, batch)
    assert (sent, reduced, others) == (backward, once, [[]] * 2), (sent, reduced, others)
    assert M * sum(sent) + sum(reduced) == (9280 if traced else 17536)
    test_staged_defer_jax._assert_equal_to_unsharded(step, params, batch, _scanned_loss)


MESH = types.SimpleNamespace(shape={"t": 2})


@pytest.mark.parametrize("shape, tile, sizes, want", [
    # the layer axis cut, unsplit; the split axis taken whole: the block's slice has the block's shape
    ((4, 16, 8), [(), ("t",), ()], (1, 16, 8), ((1, 16, 8), [(), ("t",), ()], (1, 8, 8))),
    ((4, 16, 8), [(), (), ()], (1, 16, 8), ((1, 16, 8), [(), (), ()], (1, 16, 8))),
    # a cut of the split axis is not local
    ((4, 16, 8), [("t",), (), ()], (1, 16, 8), None),
    ((4, 16, 8), [(), ("t",), ()], (1, 8, 8), None),
])
def test_which_traced_slices_of_a_tiled_weight_are_local(shape, tile, sizes, want):
    """``local_view`` of a ``dynamic_slice`` (its starts run-time operands): local when it cuts only unsplit axes;
    the view of a block then slices the block at the same starts (applied to a block of arange at start 2 on the
    layer axis: the block's layer 2)."""
    from shardplan.jax.local_reads import View, apply_views, local_view

    view = View("dynamic_slice", jax.lax.dynamic_slice_p, {"slice_sizes": sizes}, len(shape))
    got = local_view(view, shape, tile, MESH)
    if want is None:
        assert got is None
        return
    vshape, vtile, local = got
    assert (vshape, vtile) == want[:2]
    bshape = tuple(n // (2 if t else 1) for n, t in zip(shape, tile))
    block = jnp.arange(int(np.prod(bshape)), dtype=jnp.float32).reshape(bshape)
    starts = [jnp.int32(2)] + [jnp.int32(0)] * (len(shape) - 1)
    out = apply_views(block, [local], starts)
    assert out.shape == want[2]
    np.testing.assert_array_equal(np.asarray(out), np.asarray(block[2:3]))
