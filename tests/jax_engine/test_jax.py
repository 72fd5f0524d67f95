"""JAX frontend, export and one-call API on 8 simulated CPU devices (see conftest.py)."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from shardplan import ops  # noqa: E402
from shardplan.cost import build_tables  # noqa: E402
from shardplan.errors import ShardplanError  # noqa: E402
from shardplan.jax.hlo import hlo_bytes_per_device, parse_collectives, predicted_bytes  # noqa: E402
from shardplan.jax.run import make_step  # noqa: E402
from shardplan.jax.shardings import plan_shardings  # noqa: E402
from shardplan.jax.lower import trace  # noqa: E402
from shardplan.ir import TensorRef  # noqa: E402
from shardplan.machine import Machine  # noqa: E402
from shardplan.spmd import plan_from_configs  # noqa: E402
from shardplan.baselines import baseline_plan  # noqa: E402
from conftest import require_8_devices  # noqa: E402

pytestmark = pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")
TOY = Machine(8, peak_flops=32e9, bandwidth=16e9, name="toy")

DEVICES = require_8_devices()


def _example(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rel_err(a, b) -> float:
    """max over the leaves of ||x - y|| / max(||y||, 1e-30) (2-norms of the flattened leaves), read to the host and
    computed in numpy in the leaves' own dtype: eager ``jnp`` compiles its operators for every sharded leaf
    (tests/jax_compare.py)."""
    def err(x, y) -> float:
        x, y = np.asarray(x), np.asarray(y)
        return float(np.linalg.norm(x - y)) / max(float(np.linalg.norm(y)), 1e-30)

    return max(jax.tree.leaves(jax.tree.map(err, a, b)))




# -- frontend ------------------------------------------------------------------
def test_dot_with_parameter_is_the_einsum_description():
    g, info = trace(lambda w, x: jnp.sum(x @ w["w"]), {"w": jnp.ones((16, 32))}, jnp.ones((8, 16)))
    op = g.operators[0]
    ref = ops.einsum("ref", "bx,xs->bs", TensorRef(op.inputs[0].src, (8, 16), is_input=True, needs_grad=False),
                     ops.Param((16, 32)))
    assert op.dims == ref.dims
    assert [a.dim for a in op.inputs[0].axes] == [a.dim for a in ref.inputs[0].axes]
    assert [a.dim for a in op.weights[0].axes] == [a.dim for a in ref.weights[0].axes]
    assert op.reduction_dims == ("x",)
    assert info.leaf_uses[0] == ((op.name, ("x", "s")),)


def test_elementwise_chains_are_fused_and_flops_added():
    def f(p, x):
        return jnp.sum(jnp.tanh(jnp.exp(x @ p) * 2.0))

    g, _ = trace(f, jnp.ones((16, 32)), jnp.ones((8, 16)))
    kinds = [op.kind for op in g.operators]
    assert kinds == ["einsum", "reduce_sum"]
    # exp, mul, tanh: 3 FLOPs per output element = 3 / 16 per point of the (8, 32, 16) domain
    assert g.operators[0].flops_per_point == pytest.approx(2.0 + 3.0 / 16)


def test_nested_jit_and_custom_jvp_are_inlined():
    @jax.jit
    def inner(x):
        return jax.nn.relu(x) + 1.0

    g, info = trace(lambda p, x: jnp.sum(inner(x @ p)), jnp.ones((4, 4)), jnp.ones((2, 4)))
    assert [op.kind for op in g.operators] == ["einsum", "reduce_sum"]
    assert set(info.op_vars) == {op.name for op in g.operators}


def test_conv_nhwc_and_pooling_domains():
    def f(w, x):
        y = jax.lax.conv_general_dilated(x, w, (2, 2), ((1, 1), (1, 1)), dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jnp.sum(jax.lax.reduce_window(y, 0.0, jax.lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID"))

    g, _ = trace(f, jnp.ones((3, 3, 4, 8)), jnp.ones((2, 16, 16, 4)))
    conv, pool = g.operators[0], g.operators[1]
    assert conv.extents == {"b": 2, "c": 4, "h": 8, "w": 8, "n": 8, "r": 3, "s": 3}
    assert set(conv.reduction_dims) == {"c", "r", "s"}
    assert conv.inputs[0].axes[1].window == "r" and conv.inputs[0].axes[1].stride == 2
    assert pool.kind == "pool" and len(pool.reduction_dims) == 2


# -- export --------------------------------------------------------------------
def test_configuration_not_dividing_p_is_refused():
    """A product of 6 on 8 devices has no mesh; divides_p=True keeps only expressible configurations."""
    g2, info2 = trace(lambda w, x: jnp.sum(x @ w), jnp.ones((48, 8)), jnp.ones((6, 48)))
    t2 = build_tables(g2, TOY, cutoff=1, divides_p=False)
    op = g2.operators[0]
    c = [1] * len(op.dims)
    c[op.dim_names.index("b")] = 6
    plan = plan_from_configs(t2, {op.name: c, g2.operators[1].name: [1] * len(g2.operators[1].dims)})
    with pytest.raises(ShardplanError, match=rf"operator '{op.name}'.*6 devices.*divides_p=True"):
        make_step(plan, info2)
    assert all(8 % int(np.prod(row)) == 0 for row in build_tables(g2, TOY, cutoff=1, divides_p=True).configs[0])


@pytest.mark.parametrize("name", ["jax_mlp", "jax_transformer", "jax_cnn"])
def test_parallelize_matches_unsharded(name):
    import shardplan.jax as sj

    mod = _example(name)
    params, batch = mod.init_params(jax.random.PRNGKey(0)), mod.make_batch(jax.random.PRNGKey(1))
    plan, step = sj.parallelize(mod.loss_fn, params, batch, machine=TOY)
    loss, grads = step(params, batch)
    loss0, grads0 = jax.value_and_grad(mod.loss_fn)(params, batch)
    assert abs(float(loss) - float(loss0)) <= 1e-5 * abs(float(loss0))
    assert _rel_err(grads, grads0) <= 1e-5
    assert any(np.prod(c) > 1 for c in plan.configs.values()), "the toy machine should make splitting pay"
    # gradients come back laid out like the planned parameters
    _, info = trace(mod.loss_fn, params, batch)
    sh = plan_shardings(plan, info, jax.devices()[:8])
    want = [s for i, s in enumerate(sh.leaves) if i in info.param_leaves]
    got = jax.tree.leaves(grads)
    assert all(x.sharding.is_equivalent_to(s, x.ndim) for x, s in zip(got, want))


def test_data_parallel_plan_is_compiled_as_planned():
    """Batch split 8 ways: per-device shapes are 1/8 of the batch, and the HLO bytes equal the model's."""
    mod = _example("jax_mlp")
    params, batch = mod.init_params(jax.random.PRNGKey(0)), mod.make_batch(jax.random.PRNGKey(1))
    g, info = trace(mod.loss_fn, params, batch)
    plan = baseline_plan("data_parallel", build_tables(g, TOY, cutoff=1, divides_p=True))
    step = make_step(plan, info)
    loss, grads = step(params, batch)
    assert _rel_err(grads, jax.grad(mod.loss_fn)(params, batch)) <= 1e-5
    hlo = step.lower(params, batch).compile().as_text()
    assert f"f32[{mod.BATCH // 8},{mod.HIDDEN}]" in hlo  # the hidden activations are batch-sharded
    kinds = {c.kind for c in parse_collectives(hlo)}
    assert kinds == {"all-reduce"}
    assert hlo_bytes_per_device(hlo)["total"] == pytest.approx(predicted_bytes(plan)["total"])


def test_megatron_transformer_layout():
    mod = _example("jax_transformer")
    params, batch = mod.init_params(jax.random.PRNGKey(0)), mod.make_batch(jax.random.PRNGKey(1))
    g, info = trace(mod.loss_fn, params, batch)
    tables = build_tables(g, TOY, cutoff=1, divides_p=True)

    plan = mod.megatron_plan(tables, info)
    step = make_step(plan, info)
    loss, grads = step(params, batch)
    assert _rel_err(grads, jax.grad(mod.loss_fn)(params, batch)) <= 1e-5
    assert grads[0]["wq"].sharding.spec[1] is not None and grads[0]["w2"].sharding.spec[0] is not None
    hlo = step.lower(params, batch).compile().as_text()
    # Q projection output per device: (16, 32, 8/8 heads, 16)
    assert "f32[16,32,1,16]" in hlo


# -- HLO parsing ----------------------------------------------------------------
def test_hlo_group_forms_and_ring_bytes():
    text = "\n".join([
        "HloModule m, num_partitions=8",
        "  %a = f32[16,32]{1,0} all-reduce(%x), replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add",
        "  %b = f32[64,8]{1,0} all-gather(%y), replica_groups=[4,2]<=[8], dimensions={0}",
        "  %c = f32[16]{0} reduce-scatter(%z), replica_groups=mesh['x'=2,'y'=4] {'y'}, dimensions={0}",
        "  %d = f32[8,8]{1,0} all-to-all(%w), replica_groups={}, dimensions={0}",
        "  %e = bf16[10]{0} collective-permute(%v), source_target_pairs={{0,1},{1,0}}",
        "  %f = (f32[4]{0}, f32[2]{0}) all-reduce(%p, %q), replica_groups=[1,8]<=[8], to_apply=%add",
        "  %g = f32[1024,256]{1,0} all-gather(%u), replica_groups=mesh['axis_0'=4,'axis_1'=2], "
        "device_ids=([2,4]T(1,0)) {'axis_0'}, dimensions={0}",
        # a Shardy sub-axis: the second factor 2 of axis_0 (size 4), as XLA prints it for some reshardings
        "  %h = f32[8,4]{1,0} all-to-all(%t), replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0':(2)2}, "
        "dimensions={0}",
    ])
    cs = parse_collectives(text)
    assert [c.group for c in cs] == [4, 2, 4, 8, 2, 8, 4, 2]
    sent = [c.sent for c in cs]
    assert sent[0] == pytest.approx(2 * 3 / 4 * 16 * 32 * 4)
    assert sent[1] == pytest.approx(1 / 2 * 64 * 8 * 4)
    assert sent[2] == pytest.approx(3 / 4 * 16 * 4 * 4)
    assert sent[3] == pytest.approx(7 / 8 * 64 * 4)
    assert sent[4] == pytest.approx(20)
    assert sent[5] == pytest.approx(2 * 7 / 8 * 24)
    assert sent[6] == pytest.approx(3 / 4 * 1024 * 256 * 4)
    assert sent[7] == pytest.approx(1 / 2 * 8 * 4 * 4)


# -- your own training loop ------------------------------------------------------
def test_planned_shardings_in_an_optax_training_step():
    """Shardings as pytrees of NamedSharding, the constrained loss inside the user's own jit, an optax state."""
    import optax
    import shardplan.jax as sj

    mod = _example("jax_mlp")
    params, batch = mod.init_params(jax.random.PRNGKey(0)), mod.make_batch(jax.random.PRNGKey(1))
    pl = sj.planned(mod.loss_fn, params, batch, devices=DEVICES, machine=TOY)
    assert jax.tree.structure(pl.param_shardings) == jax.tree.structure(params)
    assert jax.tree.structure(pl.batch_shardings) == jax.tree.structure(batch)
    opt = optax.sgd(0.1, momentum=0.9)

    def train_step(loss_fn, params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    sp, sb = jax.device_put(params, pl.param_shardings), jax.device_put(batch, pl.batch_shardings)
    state = jax.jit(opt.init)(sp)
    new, state, loss = jax.jit(lambda p, s, b: train_step(pl.loss_fn, p, s, b),
                               out_shardings=(pl.param_shardings, None, None))(sp, state, sb)
    ref, _, loss0 = jax.jit(lambda p, s, b: train_step(mod.loss_fn, p, s, b))(params, opt.init(params), batch)
    assert abs(float(loss) - float(loss0)) <= 1e-5 * abs(float(loss0))
    assert _rel_err(new, ref) <= 1e-5
    split = [k for k, s in pl.param_shardings.items() if any(a is not None for a in s.spec)]
    assert split, "the plan splits some parameter"
    for k in split:  # the updated parameters and the momentum keep the planned layout
        assert new[k].sharding.is_equivalent_to(pl.param_shardings[k], new[k].ndim)
        assert state[0].trace[k].sharding.is_equivalent_to(pl.param_shardings[k], new[k].ndim)


def test_has_aux_returns_the_aux_like_value_and_grad():
    import shardplan.jax as sj

    def f(p, x):
        loss = jnp.sum(jnp.tanh(x @ p["w"]) ** 2)
        return loss, {"twice": 2 * loss}

    p, x = {"w": jnp.ones((16, 32)) * 0.1}, jnp.ones((8, 16))
    _, step = sj.parallelize(f, p, x, devices=DEVICES, machine=TOY, has_aux=True)
    (loss, aux), grads = step(p, x)
    (loss0, aux0), grads0 = jax.value_and_grad(f, has_aux=True)(p, x)
    assert float(aux["twice"]) == pytest.approx(float(aux0["twice"]), rel=1e-6)
    assert float(loss) == pytest.approx(float(loss0), rel=1e-6)


def test_hierarchical_plan_runs_as_planned():
    """On 2 nodes of 4 devices the layouts span levels; their meshes give the same numbers as unsharded."""
    import shardplan.jax as sj

    two = Machine(8, peak_flops=32e9, bandwidth=16e9, node_size=4, inter_bandwidth=4e9, name="toy2")
    mod = _example("jax_mlp")
    params, batch = mod.init_params(jax.random.PRNGKey(0)), mod.make_batch(jax.random.PRNGKey(1))
    plan, step = sj.parallelize(mod.loss_fn, params, batch, machine=two)
    assert all(lay.levels == (4, 2) for lay in plan.layouts.values())
    assert any(lay.splits[1] != (1,) * len(lay.dims) for lay in plan.layouts.values()), "some split spans nodes"
    loss, grads = step(params, batch)
    loss0, grads0 = jax.value_and_grad(mod.loss_fn)(params, batch)
    assert abs(float(loss) - float(loss0)) <= 1e-5 * abs(float(loss0))
    assert _rel_err(grads, grads0) <= 1e-5
