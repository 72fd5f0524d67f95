"""A pipeline plan whose stages carry FP8 products, recomputation and activation offload runs them on JAX (8 simulated
devices, :mod:`shardplan.jax.staged`): loss and gradients equal the unsharded program with the same FP8 products,
each micro-batch scaled by its own amax."""

from __future__ import annotations

import pytest

import jax
import jax.numpy as jnp

from conftest import require_8_devices
from jax_compare import max_abs, max_abs_diff
from staged_cases import B, D, model, scoped, searched_plan, with_choices

pytestmark = pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out

DEVICES = require_8_devices()
EDITS = {"L0/dot_general": {"fp8": True, "offload": ("activations",)}, "L1/dot_general": {"fp8": True},
         "L2/dot_general": {"recompute": True}, "L3/dot_general": {"fp8": True, "offload": ("activations",)}}


@pytest.fixture(scope="module")
def searched():
    """Four scoped layers, the pipeline search's plan on sub-meshes of 4: two stages of two layers, m = 2."""
    params, batch = model()
    return params, batch, searched_plan(params, batch)


def assert_equal(got, want):
    (loss, grads), (loss0, grads0) = got, want
    assert abs(float(loss) - float(loss0)) <= 1e-5 * abs(float(loss0))
    top = max(max_abs(g) for g in jax.tree.leaves(grads0))
    err = max(max_abs_diff(a, b) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads0)))
    assert err <= 1e-4 * top


def stage_args(step, st, params, batch):
    """Stage ``st``'s arguments for micro-batch 0 (its inputs from the previous stage: zeros of their shape)."""
    leaves = jax.tree.leaves((params, batch))
    rows = B // step.plan.micro_batches
    p = tuple(jax.device_put(leaves[i], st.leaf_put[i]) for i in st.params)
    d = tuple(jax.device_put(leaves[i][:rows], st.leaf_put[i]) for i in st.data)
    fi = tuple(jax.device_put(jnp.zeros((rows, D)), st.in_sh[v]) for v in st.fin)
    return p, fi, d


def test_stages_run_fp8_recomputation_and_activation_offload(searched):
    """Stage 0: both products FP8, the first offloading its activations; stage 1: the first product recomputed,
    the second FP8 and offloading. The step equals the unsharded program with the same FP8 products run on the two
    micro-batches; the products are FP8 (the float32 loss is far off), the offloaded values go to host memory and
    the recomputed product's values are not kept."""
    import shardplan.jax as sj
    from jax._src.ad_checkpoint import saved_residuals

    params, batch, plan = searched
    run = sj.apply(with_choices(plan, EDITS), scoped, params, batch, DEVICES)
    step = run.step
    assert [len(st.replace) for st in step.stages] == [2, 1] and all(st.remat for st in step.stages)
    want = jax.jit(jax.value_and_grad(step.reference()))(params, batch)
    got = step(params, batch)
    assert_equal(got, want)
    loss32 = float(scoped(params, batch))
    assert abs(float(want[0]) - loss32) > 1e-4 * abs(loss32)
    hosts = []
    for st in step.stages:
        p, fi, d = stage_args(step, st, params, batch)
        text = str(jax.make_jaxpr(lambda p, fi, d: st.forward(p, fi, (), d, {})[0])(p, fi, d))
        hosts.append(text.count("MemorySpace.Host"))
        assert ("float8_e4m3fn" in text) == bool(st.replace)
    assert hosts[0] > 0 and hosts[1] > 0
    # stage 1 keeps fewer values with its first product recomputed than the same stage planned without choices
    plain = sj.apply(with_choices(plan, {}), scoped, params, batch, DEVICES).step
    kept = []
    for s in (step.stages[1], plain.stages[1]):
        p, fi, d = stage_args(step, s, params, batch)
        res = saved_residuals(lambda p_, fi_: s.body(p_, fi_, (), d, {}), p, fi)
        kept.append(sum(1 for _, why in res if not why.startswith("from the argument")))
    assert plain.stages[1].remat is False and kept[0] < kept[1]
    assert_equal(plain(params, batch), jax.jit(jax.value_and_grad(plain.reference()))(params, batch))


def test_stages_run_delayed_scaling_over_two_steps(searched):
    """The staged step with the FP8 amax histories (delayed scaling): every micro-batch of a step scales from the
    same histories, the step shifts in the largest amax of its micro-batches; two steps equal the unsharded
    program run so, loss, gradients and histories, and the histories live on their stage's devices."""
    import numpy as np

    import shardplan.jax as sj
    from shardplan.jax.fp8 import init_history, roll_history

    params, batch, plan = searched
    step = sj.apply(with_choices(plan, EDITS), scoped, params, batch, DEVICES).step
    assert step.fp8_names == ("L0/dot_general", "L1/dot_general", "L3/dot_general")
    h = step.init_history(8)
    assert [set(h[n].sharding.device_set) for n in step.fp8_names] == \
        [set(DEVICES[:4])] * 2 + [set(DEVICES[4:])]
    h0 = init_history(step.fp8_names, 8)
    parts = [jax.jit(jax.value_and_grad(step.reference(micro=j), argnums=(0, 2))) for j in range(2)]
    for t in range(2):
        loss, grads, h = step(params, batch, h)
        grads = jax.tree.map(np.asarray, grads)  # off the stages' devices
        (l0, (g0, a0)), (l1, (g1, a1)) = (f(params, batch, h0) for f in parts)
        assert_equal((loss, grads), (l0 + l1, jax.tree.map(jnp.add, g0, g1)))
        h0 = roll_history(h0, jax.tree.map(jnp.maximum, a0, a1))
        for n in step.fp8_names:
            np.testing.assert_allclose(np.asarray(h[n]), np.asarray(h0[n]), rtol=1e-6)
        if t == 0:  # scale 1 from the empty history: not current scaling's step
            assert abs(float(loss) - float(step(params, batch)[0])) > 1e-5 * abs(float(loss))
        params = jax.tree.map(lambda a, g: jnp.asarray(np.asarray(a) - 0.5 * g), params, grads)
