"""The JAX stage runner reduces a ZeRO 0/1 weight's gradient once a step for every read the tiny GPT makes of its
weights (docs/jax.md, "What the stage programs send for a weight"): the blocks' matmuls and the head as before,
now also the embedding's gather, the RMS norms' scales and the tied embedding's transposed read. On 4 stages of 2
devices, m = 4, the gradients equal the unsharded program's; counted in the compiled HLO, no micro-batch's backward
program sends anything and each stage's one reduction program a step all-reduces its leaves' local tiles."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from conftest import require_8_devices
from test_pipeline_jax import _gpt_loss, _gpt_params, _tokens, _toy

DEVICES = require_8_devices()
M, ROWS = 4, 4  # micro-batches, rows of each (the batch of 16)
COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "collective-permute", "all-to-all")


def _gpt_step(tied: bool = False):
    from shardplan.jax.staged import pipeline

    params, batch = _gpt_params(tied=tied), _tokens()
    step = pipeline(_gpt_loss, params, batch, machine=_toy(), sizes=(2,), micro_batches=(M,))
    assert [(s.offset, s.devices) for s in step.plan.stages] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert step.plan.micro_batches == M
    return step, params, batch


def _all_reduced_floats(text: str) -> int:
    """The f32 elements the all-reduces of a compiled program's HLO text send (a combined all-reduce's tuple
    counted element by element)."""
    total = 0
    for shape in re.findall(r"= (\(.*?\)|\S+) all-reduce(?:-start)?\(", text):
        total += sum(math.prod(int(x) for x in dims.split(",") if x) for dims in re.findall(r"f32\[([\d,]*)\]", shape))
    return total


def _sent(step, params, batch):
    """Per stage, the f32 elements all-reduced by one micro-batch's backward program and by the step's reduction
    program (0 where the stage defers nothing), and the other collectives of the backward programs."""
    leaves = step._leaves(params, batch)
    values: dict[int, jax.Array] = {}
    backward, once, others = [], [], []
    for st in step.stages:
        p = tuple(jax.device_put(leaves[i], st.param_put[i]) for i in st.params)
        fi = tuple(jax.device_put(values[v], st.in_sh[v]) for v in st.fin)
        oi = tuple(jax.device_put(values[v], st.in_sh[v]) for v in st.oin)
        d = tuple(jax.device_put(leaves[i][:ROWS] if i in step.info.batch_leaves else leaves[i], st.leaf_put[i])
                  for i in st.data)
        fo, vjp, oo = st.forward(p, fi, oi, d, {})
        values.update(zip(st.fout + st.oout, fo + oo))
        ones = tuple(jnp.ones_like(x) for x in fo)
        text = st.backward.lower(vjp, ones).compile().as_text()
        backward.append(_all_reduced_floats(text))
        others.append(sorted({k for k in COLLECTIVES[1:] if re.search(rf" {k}(?:-start)?\(", text)}))
        if st.defer:
            gp = st.backward(vjp, ones)[0]
            keys = st.reducers["gradient"].keys
            once.append(_all_reduced_floats(st.reducers["gradient"].program.lower(
                tuple(gp[k] for k in keys)).compile().as_text()))
        else:
            once.append(0)
    return backward, once, others


def _assert_equal_to_unsharded(step, params, batch):
    loss, grads = step(params, batch)
    ref_l, ref_g = jax.value_and_grad(_gpt_loss)(params, batch)
    assert abs(float(loss) - float(ref_l)) <= 1e-6 * abs(float(ref_l))
    assert jax.tree.structure(grads) == jax.tree.structure(ref_g)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_g)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=2e-6 * float(jnp.abs(w).max()))


@pytest.mark.parametrize("reads, deferred, backward, once", [
    # nothing deferred: every leaf all-reduced by each micro-batch's backward, 4 x 5184 = 20736 floats a step
    ("none", [0, 0, 0, 0], [1552, 1040, 1040, 1552], [0, 0, 0, 0]),
    # the matmuls only (the runner before): the embedding (512) and the 4 scales (16 each) per micro-batch,
    # 4 x 576 + 4608 = 6912 floats a step
    ("matmuls", [2, 2, 2, 3], [528, 16, 16, 16], [1024, 1024, 1024, 1536]),
    # every read: nothing per micro-batch, 5184 floats once a step
    ("all", [4, 3, 3, 4], [0, 0, 0, 0], [1552, 1040, 1040, 1552]),
])
def test_the_tiny_gpt_sends_each_gradient_once_a_step(monkeypatch, reads, deferred, backward, once):
    """The tiny GPT (embedding, 4 blocks of RMS norm and MLP, head) on 4 stages of 2 data-parallel devices, m = 4:
    with the runner's per-device reads (the embedding's gather, the norms' scales) all 14 leaves are deferred, no
    backward program sends anything (no collective at all), and the step's reduction programs all-reduce 5184
    floats, each leaf once; with those reads refused (as before) 9 of 14 are deferred and 6912 floats are sent a
    step, with none deferred 20736. The gradients equal the unsharded program's in every case."""
    import shardplan.jax.local_reads as local_reads
    import shardplan.jax.staged as staged

    if reads != "all":
        monkeypatch.setattr(local_reads, "gather_island", lambda *a, **k: None)
        monkeypatch.setattr(local_reads, "scale_island", lambda *a, **k: None)
    if reads == "none":
        monkeypatch.setattr(staged, "_explicit_reduced", lambda sharding: None)
    step, params, batch = _gpt_step()
    assert [len(st.defer) for st in step.stages] == deferred and sum(len(st.params) for st in step.stages) == 14
    sent, reduced, others = _sent(step, params, batch)
    assert (sent, reduced, others) == (backward, once, [[]] * 4), (sent, reduced, others)
    assert M * sum(sent) + sum(reduced) == {"none": 20736, "matmuls": 6912, "all": 5184}[reads]
    _assert_equal_to_unsharded(step, params, batch)


def test_a_tied_embeddings_transposed_read_is_deferred():
    """The head tied to the embedding: the last stage reads its copy of the embedding through a transpose (a
    view) into the head's matmul. The transpose passes the Explicit leaf on and the matmul transposes it on
    Explicit axes: that copy is deferred too (14 of 14 stage leaves), no backward sends anything, and the
    gradients (the two copies' summed) equal the unsharded program's."""
    step, params, batch = _gpt_step(tied=True)
    embed = step.info.leaf_names.index("arg0['embed']")
    assert embed in step.stages[0].defer and embed in step.stages[3].defer
    assert [len(st.defer) for st in step.stages] == [len(st.params) for st in step.stages] == [4, 3, 3, 4]
    sent, reduced, others = _sent(step, params, batch)
    assert (sent, reduced, others) == ([0] * 4, [1552, 1040, 1040, 1552], [[]] * 4)
    _assert_equal_to_unsharded(step, params, batch)
