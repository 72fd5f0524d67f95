"""FP8 products of a fit plan run on JAX (8 simulated devices): E4M3 operands, E5M2 output gradients, per-tensor
scales from the global amax; the sharded step equals the unsharded FP8 program, which differs from float32."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from conftest import require_8_devices
from shardplan.baselines import baseline_plan
from shardplan.cost import build_tables
from shardplan.errors import ShardplanError
from shardplan.fit import plan_with_choices
from shardplan.jax.fp8 import E4M3_MAX, E5M2_MAX, _fp8_dot, fp8_equations, fp8_product, quantize, reference_fn
from shardplan.jax.lower import trace
from shardplan.jax.memory import fit_step
from shardplan.machine import Machine
from shardplan.spmd import plan_from_configs
from jax_compare import max_abs, max_abs_diff  # noqa: E402

pytestmark = pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out

DEVICES = require_8_devices()
# the toy machine with an FP8 peak (twice its dense peak, as on H100) and an HBM bandwidth for the casts
FP8_TOY = Machine(8, peak_flops=32e9, bandwidth=16e9, name="toy-fp8", fp8_flops=64e9, hbm_bandwidth=1e11)
B, D, H, C = 32, 16, 64, 8


def loss_fn(params, batch):
    x, y = batch
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


def conv_loss(params, batch):
    x, y = batch
    h = jax.lax.conv_general_dilated(x, params["k"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jnp.mean((jnp.tanh(h).mean(axis=(1, 2)) @ params["w"] - y) ** 2)


def model():
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(0), 4)
    params = {"w1": jax.random.normal(k1, (D, H)) / D**0.5, "b1": jnp.zeros(H) + 0.1,
              "w2": jax.random.normal(k2, (H, C)) / H**0.5}
    return params, (jax.random.normal(k3, (B, D)), jax.random.normal(k4, (B, C)))


@pytest.fixture(scope="module")
def mlp():
    """The MLP, its trace, and a plan splitting the batch 2 ways and the hidden features 4 ways: the first
    product's weight is split over its output features, the second contracts over the split features."""
    params, batch = model()
    graph, info = trace(loss_fn, params, batch)
    tables = build_tables(graph, FP8_TOY, cutoff=1)
    layouts = {"dot_general": (2, 4, 1), "add": (2, 4), "dot_general_2": (2, 1, 4), "sub": (2, 1),
               "reduce_sum": (2, 1)}
    tp = plan_from_configs(tables, layouts, name="tp")
    fp = plan_with_choices(tp, fp8=True)
    return params, batch, graph, info, tp, fp, fit_step(fp, loss_fn, params, batch, DEVICES, info=info)


def assert_equal(got, want):
    (loss, grads), (loss0, grads0) = got, want
    assert abs(float(loss) - float(loss0)) <= 1e-5 * abs(float(loss0))
    top = max(max_abs(g) for g in jax.tree.leaves(grads0))
    err = max(max_abs_diff(a, b) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads0)))
    assert err <= 1e-4 * top


def test_quantize_scales_the_amax_to_the_format_maximum():
    x = jnp.array([[3.0, -1.5], [0.1, -3.0]])
    q, s = quantize(x, "e4m3")
    assert q.dtype == jnp.float8_e4m3fn and float(s) == pytest.approx(3.0 / E4M3_MAX)
    assert float(jnp.abs(q.astype(jnp.float32)).max()) == E4M3_MAX  # the largest element lands on 448
    # E4M3 keeps 3 mantissa bits: each element within half a unit in the last place, 2^-4 relative
    assert np.all(np.abs(np.asarray(q.astype(jnp.float32) * s) - np.asarray(x)) <= 2.0**-4 * np.abs(np.asarray(x)))
    g, sg = quantize(-2.0 * x, "e5m2")
    assert g.dtype == jnp.float8_e5m2 and float(jnp.abs(g.astype(jnp.float32)).max()) == E5M2_MAX
    z, sz = quantize(jnp.zeros((3,)), "e4m3")  # an all-zero tensor: scale 1, not 0/0
    assert float(sz) == 1.0 and not np.any(np.asarray(z.astype(jnp.float32)))


def test_fp8_product_gradients_are_its_transposes():
    """On values already on the FP8 grids with amax at each format's maximum (scale 1), the FP8 product and its
    backward are the float32 product's value and vector-Jacobian product: the dimension numbers of the two
    backward products (batch, contracting and free axes of a batched dot_general) are the transposes."""
    rng = np.random.default_rng(0)
    x = rng.integers(-8, 9, (2, 3, 5)).astype(np.float32)  # integers up to 16 are exact in E4M3
    w = rng.integers(-8, 9, (4, 2, 5)).astype(np.float32)
    g = rng.integers(-4, 5, (2, 3, 4)).astype(np.float32)  # and up to 8 in E5M2
    x[0, 0, 0], w[0, 0, 0], g[0, 0, 0] = E4M3_MAX, E4M3_MAX, E5M2_MAX
    dn = (((2,), (2,)), ((0,), (1,)))  # batch x0 = w1, contract x2 = w2; out (batch, x1, w0)
    ref = lambda a, b: jax.lax.dot_general(a, b, dn)  # noqa: E731
    y, vjp = jax.vjp(_fp8_dot(dn, jnp.float32, jnp.float32, jnp.float32), jnp.asarray(x), jnp.asarray(w))
    y0, vjp0 = jax.vjp(ref, jnp.asarray(x), jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y0))
    for a, b in zip(vjp(jnp.asarray(g)), vjp0(jnp.asarray(g))):
        assert a.shape == b.shape
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6 * max_abs(b))
    bf = jnp.bfloat16  # the result in the product's dtype, each gradient in its operand's
    yb, vjpb = jax.vjp(_fp8_dot(dn, bf, bf, jnp.float32), jnp.asarray(x, bf), jnp.asarray(w))
    assert yb.dtype == bf and [d.dtype for d in vjpb(jnp.asarray(g, bf))] == [bf, jnp.float32]


def test_sharded_fp8_step_equals_the_unsharded_fp8_program(mlp):
    params, batch, graph, info, tp, fp, fs = mlp
    assert [fp.memory_choices.fp8(i) for i in range(len(graph.operators))] == [True, False, True, False, False]
    got = fs.step(params, batch)
    want = jax.jit(jax.value_and_grad(reference_fn(fp, info)))(params, batch)
    assert_equal(got, want)
    # and FP8 is in effect: the float32 program's loss differs by far more than the tolerance
    loss32 = float(loss_fn(params, batch))
    assert abs(float(want[0]) - loss32) > 1e-3 * abs(loss32)


def test_compiled_step_casts_to_fp8_and_reduces_the_amax_over_the_devices(mlp):
    params, batch, graph, info, tp, fp, fs = mlp
    hlo = fs.step.lower(params, batch).compile().as_text()
    assert "f8e4m3fn[" in hlo and "f8e5m2[" in hlo  # forward operands E4M3, output gradients E5M2
    # the amax of a sharded tensor: local maxima all-reduced (forward and backward)
    amax = [ln for ln in hlo.splitlines() if " all-reduce(" in ln and "reduce_max" in ln]
    assert any("transpose(" not in ln for ln in amax) and any("transpose(" in ln for ln in amax)
    # the collectives move the machine's element size (the cost model's "no FP8 all-gather"): the operands are
    # redistributed by the read constraints before they are cast
    moves = [ln for ln in hlo.splitlines()
             if any(f" {c}(" in ln for c in ("all-gather", "all-reduce", "all-to-all", "collective-permute",
                                             "reduce-scatter"))]
    assert moves and not any("f8" in ln.split("=", 1)[1].split("(", 1)[0] for ln in moves)


def test_only_the_planned_products_run_fp8(mlp):
    params, batch, graph, info, tp, fp, fs = mlp
    one = plan_with_choices(tp, fp8=["dot_general_2"])
    eqs = fp8_equations(one, info)
    assert len(eqs) == 1
    (k,) = eqs
    assert info.program.eqns[k].name == "dot_general" and k in {r[0] for r in info.reads["dot_general_2"]}
    assert fp8_equations(plan_with_choices(tp), info) == {} and fp8_equations(tp, info) == {}
    jaxpr = str(jax.make_jaxpr(reference_fn(one, info))(params, batch))
    assert jaxpr.count("custom_vjp_call") == 1 and "float8_e4m3fn" in jaxpr
    add = next(e for e in info.program.eqns if e.name == "add")
    with pytest.raises(ShardplanError, match="not add"):
        fp8_product(add)


def test_fp8_convolution_step_equals_the_unsharded_fp8_program():
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(1), 4)
    params = {"k": jax.random.normal(k1, (3, 3, 3, 4)) / 3.0, "w": jax.random.normal(k2, (4, 2))}
    batch = (jax.random.normal(k3, (8, 6, 6, 3)), jax.random.normal(k4, (8, 2)))
    graph, info = trace(conv_loss, params, batch)
    fp = plan_with_choices(baseline_plan("data_parallel", build_tables(graph, FP8_TOY, cutoff=1)), fp8=True)
    conv = [op.name for i, op in enumerate(graph.operators) if fp.memory_choices.fp8(i)]
    assert any("conv" in n for n in conv)
    fs = fit_step(fp, conv_loss, params, batch, DEVICES, info=info)
    want = jax.jit(jax.value_and_grad(reference_fn(fp, info)))(params, batch)
    assert_equal(fs.step(params, batch), want)
    loss32 = float(conv_loss(params, batch))
    assert abs(float(want[0]) - loss32) > 1e-4 * abs(loss32)


def test_searched_plan_with_fp8_and_activation_offload_runs_through_planned():
    """The fit search's own plan on a machine with an FP8 peak and a host link, run through ``sj.planned``: it
    takes FP8 and activation offload on both products (the products halve, the casts and copies are cheaper),
    and the step equals the unsharded FP8 program."""
    import shardplan.jax as sj
    from shardplan.fit import FitOptions

    machine = Machine(8, peak_flops=32e9, bandwidth=16e9, name="toy-fp8-host", fp8_flops=64e9, hbm_bandwidth=1e11,
                      host_bandwidth=4e9, host_memory_bytes=1e10, cpu_adam_rate=1e9, memory_bytes=1e9)
    params, batch = model()
    p = sj.planned(loss_fn, params, batch, DEVICES, machine=machine,
                   fit=FitOptions(fp8=True, offload=("optimizer", "parameters", "activations")))
    mc = p.plan.memory_choices
    products = [i for i, op in enumerate(p.plan.graph.operators) if op.name.startswith("dot_general")]
    assert all(mc.fp8(i) and "activations" in mc.offload(i) for i in products)
    assert p.fit is not None and p.fit.offloads and p.fit.remat
    assert_equal(p.step(params, batch), jax.jit(jax.value_and_grad(reference_fn(p.plan, p.info)))(params, batch))


def test_fp8_with_micro_batches_scales_each_micro_batch_by_its_own_amax(mlp):
    """Two micro-batches, ZeRO-2, FP8 products that offload their activations and a recomputed addition: each
    micro-batch's products take their scales from that micro-batch (current scaling), so the step equals the mean
    of the unsharded FP8 program over the strided micro-batches, not the FP8 program of the whole batch."""
    machine = Machine(8, peak_flops=32e9, bandwidth=16e9, name="toy-fp8-host", fp8_flops=64e9, hbm_bandwidth=1e11,
                      host_bandwidth=4e9, host_memory_bytes=1e10, cpu_adam_rate=1e9)
    params, batch, graph, info = mlp[:4]
    dp = baseline_plan("data_parallel", build_tables(graph, machine, cutoff=1))
    fp = plan_with_choices(dp, 2, ["add"], 2, fp8=True, offload=("activations",))
    mc = fp.memory_choices
    assert [(mc.fp8(i), mc.offload(i), mc.recompute(i)) for i in range(3)] == [
        (True, ("activations",), False), (False, (), True), (True, ("activations",), False)]
    fs = fit_step(fp, loss_fn, params, batch, DEVICES, info=info)
    ref = reference_fn(fp, fs.micro_info)

    def micro_mean(p, b):
        return (ref(p, tuple(x[0::2] for x in b)) + ref(p, tuple(x[1::2] for x in b))) / 2

    got = fs.step(params, batch)
    assert_equal(got, jax.jit(jax.value_and_grad(micro_mean))(params, batch))
    whole = float(jax.jit(reference_fn(fp, info))(params, batch))
    assert abs(float(got[0]) - whole) > 1e-4 * abs(whole)


def test_a_loaded_plan_runs_its_fp8_products_and_offload():
    """``sj.plan``'s answer written to JSON and loaded again: ``sj.apply`` rebuilds it with its FP8 products and
    activation offload (same step time and memory), and the step equals the unsharded FP8 program."""
    import shardplan.jax as sj
    from shardplan.fit import FitOptions
    from shardplan.result import Plan

    machine = Machine(8, peak_flops=32e9, bandwidth=16e9, name="toy-fp8-host", fp8_flops=64e9, hbm_bandwidth=1e11,
                      host_bandwidth=4e9, host_memory_bytes=1e10, cpu_adam_rate=1e9, memory_bytes=1e9)
    params, batch = model()
    p = sj.plan(loss_fn, params, batch, DEVICES, machine=machine, stages=False,
                fit_options=FitOptions(micro_batches=(1,), fp8=True, offload=("activations",)))
    assert any(c.fp8 for c in p.operators.values()) and any(c.offload for c in p.operators.values())
    q = Plan.from_json(p.to_json())
    run = sj.apply(q, loss_fn, params, batch, DEVICES)
    assert run.plan is not p.spmd and run.plan.cost == pytest.approx(p.step_time, rel=1e-12)
    assert run.plan.memory["peak_bytes"] == pytest.approx(p.memory["peak_bytes"], rel=1e-12)
    mc = run.plan.memory_choices
    names = [op.name for op in run.plan.graph.operators]
    assert {n for i, n in enumerate(names) if mc.fp8(i)} == {n for n, c in p.operators.items() if c.fp8}
    assert {n: mc.offload(i) for i, n in enumerate(names) if mc.offload(i)} == \
        {n: c.offload for n, c in p.operators.items() if c.offload}
    assert run.fit is not None and run.fit.offloads
    assert_equal(run.step(params, batch), jax.jit(jax.value_and_grad(reference_fn(run.plan, run.info)))(params, batch))


def test_delayed_scaling_over_three_steps_equals_the_unsharded_program(mlp):
    """Delayed scaling (the cost model's recipe): ``fs.fp8_step`` scales each tensor from its amax history and
    returns the next history; three SGD steps on the sharded plan equal the unsharded FP8 program run with the same
    rule, loss, gradients and histories. The first step has an all-zero history (scale 1, Transformer Engine's
    initial scale), so it differs from current scaling; each history's newest entry is the tensor's amax."""
    from shardplan.jax.fp8 import init_history, roll_history

    params, batch, graph, info, tp, fp, fs = mlp
    assert fs.fp8_names == ("dot_general", "dot_general_2") and fs.fp8_step is not None
    h, h0 = fs.init_history(4), init_history(fs.fp8_names, 4)
    ref = jax.jit(jax.value_and_grad(reference_fn(fp, info, delayed=True), argnums=(0, 2)))
    p, p0 = params, params
    for t in range(3):
        loss, grads, h = fs.fp8_step(p, batch, h)
        loss0, (grads0, amax) = ref(p0, batch, h0)
        if t == 0:
            assert abs(float(loss0) - float(fs.step(params, batch)[0])) > 1e-4 * abs(float(loss0))
            assert float(amax["dot_general"][0, 0]) == float(jnp.abs(batch[0]).max())  # the input's amax
            assert float(amax["dot_general"][1, 0]) == float(jnp.abs(params["w1"]).max())  # the weight's
        h0 = roll_history(h0, amax)
        assert_equal((loss, grads), (loss0, grads0))
        for n in fs.fp8_names:
            np.testing.assert_allclose(np.asarray(h[n]), np.asarray(h0[n]), rtol=1e-6)
            assert np.count_nonzero(np.asarray(h[n])[:, t + 1:]) == 0  # one entry per step, newest first
        p = jax.tree.map(lambda a, g: a - 0.1 * g, p, grads)
        p0 = jax.tree.map(lambda a, g: a - 0.1 * g, p0, grads0)


def test_delayed_scaling_takes_one_history_entry_per_step_over_micro_batches(mlp):
    """Two micro-batches: both scale from the same history, and the step records the larger of their amaxes."""
    from shardplan.jax.fp8 import init_history, roll_history

    machine = Machine(8, peak_flops=32e9, bandwidth=16e9, name="toy-fp8-host", fp8_flops=64e9, hbm_bandwidth=1e11,
                      host_bandwidth=4e9, host_memory_bytes=1e10, cpu_adam_rate=1e9)
    params, batch, graph, info = mlp[:4]
    dp = baseline_plan("data_parallel", build_tables(graph, machine, cutoff=1))
    fp = plan_with_choices(dp, 2, ["add"], 2, fp8=True, offload=("activations",))
    fs = fit_step(fp, loss_fn, params, batch, DEVICES, info=info)
    h = init_history(fs.fp8_names, 4)
    h = {n: x.at[:, 1].set(jnp.array([4.0, 2.0, 1e-2])) for n, x in h.items()}  # an earlier step's amaxes
    ref = jax.value_and_grad(reference_fn(fp, fs.micro_info, delayed=True), argnums=(0, 2))
    parts = [ref(params, tuple(x[j::2] for x in batch), h) for j in (0, 1)]
    loss0 = (parts[0][0] + parts[1][0]) / 2
    grads0 = jax.tree.map(lambda a, b: (a + b) / 2, parts[0][1][0], parts[1][1][0])
    amax = jax.tree.map(jnp.maximum, parts[0][1][1], parts[1][1][1])
    loss, grads, h1 = fs.fp8_step(params, batch, h)
    assert_equal((loss, grads), (loss0, grads0))
    want = roll_history(h, amax)
    for n in fs.fp8_names:
        np.testing.assert_allclose(np.asarray(h1[n]), np.asarray(want[n]), rtol=1e-6)
    assert float(h1["dot_general"][0, 0]) == float(jnp.abs(batch[0]).max())  # the larger micro-batch amax


@pytest.mark.parametrize("offload", [False, True])
def test_train_step_carries_the_amax_histories(mlp, offload):
    """A plan with FP8 products trains with delayed scaling: ``init`` gives the optimizer's state and the empty
    histories (an ``Fp8TrainState``), and two steps of ``train_step`` (the offloading one too) equal two of
    ``fp8_step`` followed by the optimizer's update."""
    import optax

    from shardplan.jax.fp8 import Fp8TrainState

    params, batch, graph, info, tp, fp, fs = mlp
    if offload:
        machine = Machine(8, peak_flops=32e9, bandwidth=16e9, name="toy-fp8-host", fp8_flops=64e9,
                          hbm_bandwidth=1e11, host_bandwidth=4e9, host_memory_bytes=1e10, cpu_adam_rate=1e9)
        dp = baseline_plan("data_parallel", build_tables(graph, machine, cutoff=1))
        fs = fit_step(plan_with_choices(dp, fp8=True, offload=("activations",)), loss_fn, params, batch, DEVICES,
                      info=info)
        assert fs.offloads
    opt = optax.sgd(0.1)
    p, state = fs.init(opt, params)
    assert isinstance(state, Fp8TrainState) and set(state.history) == set(fs.fp8_names)
    train = fs.train_step(opt, params)
    q, h = params, fs.init_history()
    for _ in range(2):
        p, state, loss = train(p, state, batch)
        loss0, grads, h = fs.fp8_step(q, batch, h)
        q = jax.tree.map(lambda a, g: a - 0.1 * g, q, grads)
        assert abs(float(loss) - float(loss0)) <= 1e-6 * abs(float(loss0))
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(q)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    for n in fs.fp8_names:
        np.testing.assert_array_equal(np.asarray(state.history[n]), np.asarray(h[n]))
        assert float(state.history[n][0, 1]) > 0  # two steps recorded
