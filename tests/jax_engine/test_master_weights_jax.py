"""Mixed precision with fp32 master weights on JAX (8 simulated devices): a bfloat16 program whose parameters and
optimizer state the step holds in float32, sharded as planned; the step casts them to bfloat16 inside, so the
gradients come back float32, and the sharded step equals the unsharded program run with the same rule."""

from __future__ import annotations

import math

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from conftest import require_8_devices
from shardplan.cost import build_tables
from shardplan.fit import plan_with_choices
from shardplan.jax.lower import trace
from shardplan.jax.memory import fit_step
from shardplan.jax.run import compute_cast, master_copy, plan_master_weights
from shardplan.machine import Machine
from shardplan.spmd import plan_from_configs
from jax_compare import max_abs, max_abs_diff  # noqa: E402
from test_jax_memory import model  # noqa: E402  (the same MLP and batch)

DEVICES = require_8_devices()
TOY = Machine(8, peak_flops=32e9, bandwidth=16e9, name="toy")
B, D, H, C = 32, 16, 64, 8
BF16 = jnp.bfloat16
# bfloat16's unit roundoff (8 significand bits, 7 stored): a rounding moves a value by at most U of its magnitude,
# and two values of one binade are a multiple of 2 U of its top apart
U = 2.0**-8


def loss_fn(params, batch):
    """A 2-layer tanh MLP in the parameters' dtype; the squared error reduced in float32 (as mixed-precision
    losses are)."""
    x, y = batch
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    out = h @ params["w2"]
    return jnp.mean((out - y).astype(jnp.float32) ** 2)


def reference(params32, batch):
    """The unsharded program with the same rule, written out: the float32 masters cast to bfloat16, the loss
    differentiated w.r.t. the masters (one device, no plan)."""
    return jax.value_and_grad(lambda p, b: loss_fn(jax.tree.map(lambda w: w.astype(BF16), p), b))(params32, batch)


@pytest.fixture(scope="module")
def setup():
    """The bfloat16 MLP (parameters and data), its float32 masters, its trace and a plan splitting the batch 2
    ways and the hidden features 4 ways (the second product contracts over the split features: a sum of partial
    products), with ZeRO stage 3 on every weight and master weights."""
    params32, batch32 = model()
    params = jax.tree.map(lambda w: w.astype(BF16), params32)
    batch = tuple(x.astype(BF16) for x in batch32)
    graph, info = trace(loss_fn, params, batch)
    tables = build_tables(graph, TOY, cutoff=1)
    layouts = {"dot_general": (2, 4, 1), "add": (2, 4), "dot_general_2": (2, 1, 4), "sub": (2, 1),
               "reduce_sum": (2, 1)}
    tp = plan_from_configs(tables, layouts, name="tp")
    return master_copy(params), params, batch, info, tp


def assert_close_to_reference(got, want):
    """Loss and gradients equal within bfloat16 rounding: 4 U of the loss and of the largest gradient, two
    bfloat16 spacings at its magnitude. The two programs round the same exact values in different orders: the
    sharded one also rounds each device's partial sum of the second product's 4-way split contraction and each
    weight's partial gradient over the batch halves before summing them over the devices, so a result lands at
    most a spacing or two from the unsharded one's. Measured: 0.41 U (gradients) and 9e-4 U (loss)."""
    (loss, grads), (loss0, grads0) = got, want
    assert abs(float(loss) - float(loss0)) <= 4 * U * abs(float(loss0))
    top = max(max_abs(g) for g in jax.tree.leaves(grads0))
    err = max(max_abs_diff(a, b) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads0)))
    assert err <= 4 * U * top


def test_master_copy_widens_16_bit_floats_only():
    tree = {"a": jnp.ones(3, BF16), "b": jnp.ones(2, jnp.float16), "c": jnp.ones(2, jnp.float32),
            "i": jnp.arange(3), "k": jnp.ones(1, jnp.float8_e4m3fn)}
    got = {k: v.dtype for k, v in master_copy(tree).items()}
    assert got == {"a": jnp.float32, "b": jnp.float32, "c": jnp.float32, "i": jnp.arange(3).dtype,
                   "k": jnp.float32}
    # exact: every bfloat16 value is a float32 value, and the cast back gives the same bits
    x = jax.random.normal(jax.random.PRNGKey(1), (64,)).astype(BF16)
    np.testing.assert_array_equal(np.asarray(master_copy(x).astype(BF16)), np.asarray(x))


def test_cast_transposes_to_the_compute_gradient_widened():
    """``compute_cast``: the gradient w.r.t. the float32 master is the program's bfloat16 gradient at the rounded
    weight, widened exactly (the cast's transpose)."""
    w32 = jax.random.normal(jax.random.PRNGKey(2), (8,))
    f = lambda p: jnp.sum(jnp.sin(p["w"]) * p["w"])  # noqa: E731
    g32 = jax.grad(compute_cast(f, {"w": BF16}))({"w": w32})["w"]
    g16 = jax.grad(f)({"w": w32.astype(BF16)})["w"]
    assert g32.dtype == jnp.float32 and g16.dtype == BF16
    np.testing.assert_array_equal(np.asarray(g32), np.asarray(g16.astype(jnp.float32)))


def test_sharded_master_step_equals_the_unsharded_program_with_the_rule(setup):
    params32, params, batch, info, tp = setup
    fp = plan_with_choices(tp, 3, master_weights=True)
    assert plan_master_weights(fp) and not plan_master_weights(tp)
    fs = fit_step(fp, loss_fn, params, batch, DEVICES, info=info)  # follows the plan's rule
    assert fs.master_weights
    loss, grads = fs.step(params32, batch)
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
    want = jax.jit(reference)(params32, batch)
    assert_close_to_reference((loss, grads), want)
    # the program on the copy is the bfloat16 program: the same plan run without the rule on the bfloat16
    # parameters gives the same loss and the same gradients, bit for bit, before widening
    loss16, grads16 = fit_step(fp, loss_fn, params, batch, DEVICES, info=info, master_weights=False).step(params, batch)
    assert float(loss16) == float(loss)
    for g, g16 in zip(jax.tree.leaves(grads), jax.tree.leaves(grads16)):
        assert g16.dtype == BF16
        np.testing.assert_array_equal(np.asarray(g), np.asarray(g16).astype(np.float32))
    # stage 3: the float32 gradients come back in the weights' shards (8 pieces of every weight)
    for k in ("w1", "w2"):
        assert math.prod(grads[k].sharding.shard_shape(grads[k].shape)) == math.prod(params[k].shape) // 8
    # the program ran in bfloat16: every gradient is a bfloat16 value widened (the float32 program's are not)
    _, g32 = jax.value_and_grad(loss_fn)(params32, tuple(x.astype(jnp.float32) for x in batch))
    on_grid = lambda g: np.asarray(g).astype(BF16).astype(np.float32) == np.asarray(g)  # noqa: E731
    assert all(on_grid(g).all() for g in jax.tree.leaves(grads))
    assert not on_grid(g32["w1"]).all()
    # the masters are read by their casts to bfloat16 alone: the stage-3 gathers, the products and the
    # reductions of the gradients all work on the copy (XLA's CPU backend then widens every bfloat16 collective
    # to float32, the program without the rule's too, so its compiled collectives cannot show the width)
    jaxpr = jax.make_jaxpr(fs.step)(params32, batch).jaxpr
    inner = jaxpr.eqns[0].params["jaxpr"].jaxpr if len(jaxpr.eqns) == 1 else jaxpr
    masters = {id(v) for v in inner.invars[: len(params)]}
    readers = [(e.primitive.name, e.params.get("new_dtype")) for e in inner.eqns
               if any(id(v) in masters for v in e.invars)]
    assert readers == [("convert_element_type", BF16)] * len(params)


@pytest.mark.parametrize("master", [True, False])
def test_train_step_keeps_float32_masters_and_state_sharded_as_planned(setup, master):
    """Adam through optax on the ZeRO-3 plan: with the rule the parameters and both moments the step keeps are
    float32 in their planned shards, and one step equals the unsharded update of the masters; without it (the
    same plan, ``master_weights=False``) they are bfloat16: what the engine did before the rule ran."""
    import optax

    params32, params, batch, info, tp = setup
    fp = plan_with_choices(tp, 3, master_weights=True)
    fs = fit_step(fp, loss_fn, params, batch, DEVICES, info=info, master_weights=master)
    assert fs.master_weights == master
    opt = optax.adam(1e-2)
    p0, s0 = fs.init(opt, params)
    dtype = jnp.float32 if master else BF16
    train = fs.train_step(opt, p0, donate=False)
    new, state, loss = train(p0, s0, batch)
    for k in params:
        n = math.prod(params[k].shape)
        for held in (p0[k], new[k], state[0].mu[k], state[0].nu[k]):
            assert held.dtype == dtype
            assert math.prod(held.sharding.shard_shape(held.shape)) == (n // 8 if n % 8 == 0 else n)
        assert p0[k].sharding.is_equivalent_to(fs.param_shardings[k], p0[k].ndim)
    if master:  # the update of the float32 masters by the step's own float32 gradients, Adam in float32
        _, g = fs.step(p0, batch)
        ref = optax.apply_updates(params32, opt.update(g, opt.init(params32), params32)[0])
        for k in params:
            assert max_abs_diff(new[k], ref[k]) <= 1e-6 * max_abs(ref[k])
        # the masters keep what bfloat16 cannot: a step of 1e-2 leaves most weights between two bfloat16 values
        w = np.asarray(new["w1"])
        assert np.mean(w != w.astype(BF16).astype(np.float32)) > 0.9


def test_planned_with_the_rule_and_a_loaded_plan_follow_it():
    """``sj.plan`` with ``FitOptions(master_weights=True)``: its JSON records the rule
    (``stats["memory_rules"]``), and ``sj.apply`` on the loaded plan holds float32 masters and returns float32
    gradients equal to the unsharded program with the rule."""
    import shardplan.jax as sj
    from shardplan.fit import FitOptions
    from shardplan.result import Plan

    params32, batch32 = model()
    params = jax.tree.map(lambda w: w.astype(BF16), params32)
    batch = tuple(x.astype(BF16) for x in batch32)
    machine = Machine(8, peak_flops=32e9, bandwidth=16e9, name="toy-mem", memory_bytes=1e9)
    p = sj.plan(loss_fn, params, batch, DEVICES, machine=machine, stages=False,
                fit_options=FitOptions(micro_batches=(1,), master_weights=True))
    q = Plan.from_json(p.to_json())
    assert q.stats["memory_rules"]["master_weights"] is True
    run = sj.apply(q, loss_fn, params, batch, DEVICES)
    assert run.fit is not None and run.fit.master_weights
    loss, grads = run.step(master_copy(params), batch)
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
    assert_close_to_reference((loss, grads), jax.jit(reference)(master_copy(params), batch))


def test_fp8_and_optimizer_offload_run_on_the_compute_copy(setup):
    """FP8 products (delayed scaling) and the optimizer state in host memory under the rule: ``fp8_step`` on the
    masters equals the same plan without the rule on the bfloat16 parameters, bit for bit (histories too), and
    the offloading train step keeps float32 parameters on the device and float32 Adam moments in host memory."""
    import optax

    from shardplan.jax.offload import HOST

    params32, params, batch, info, _ = setup
    machine = Machine(8, peak_flops=32e9, bandwidth=16e9, name="toy-fp8-host", fp8_flops=64e9, hbm_bandwidth=1e11,
                      host_bandwidth=4e9, host_memory_bytes=1e10, cpu_adam_rate=1e9)
    layouts = {"dot_general": (2, 4, 1), "add": (2, 4), "dot_general_2": (2, 1, 4), "sub": (2, 1),
               "reduce_sum": (2, 1)}
    tp = plan_from_configs(build_tables(trace(loss_fn, params, batch)[0], machine, cutoff=1), layouts)
    fp = plan_with_choices(tp, 1, fp8=True, offload=("optimizer",), master_weights=True)
    fs = fit_step(fp, loss_fn, params, batch, DEVICES, info=info)
    plain = fit_step(fp, loss_fn, params, batch, DEVICES, info=info, master_weights=False)
    assert fs.master_weights and fs.fp8_names and fs.offloads
    h = fs.init_history()
    loss, grads, h1 = fs.fp8_step(params32, batch, h)
    loss16, grads16, h16 = plain.fp8_step(params, batch, h)
    assert float(loss) == float(loss16)
    for g, g16 in zip(jax.tree.leaves(grads), jax.tree.leaves(grads16)):
        assert g.dtype == jnp.float32 and g16.dtype == BF16
        np.testing.assert_array_equal(np.asarray(g), np.asarray(g16).astype(np.float32))
    for a, b in zip(jax.tree.leaves(h1), jax.tree.leaves(h16)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    opt = optax.adam(1e-2)
    p0, s0 = fs.init(opt, params)
    new, state, _ = fs.train_step(opt, params)(p0, s0, batch)
    for k in params:
        assert new[k].dtype == jnp.float32 and new[k].sharding.memory_kind != HOST
        mu = state.opt_state[0].mu[k]
        assert mu.dtype == jnp.float32 and mu.sharding.memory_kind == HOST
