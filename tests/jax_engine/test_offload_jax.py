"""Host offload of a fit plan run on JAX (8 simulated devices): saved activations sent to ``pinned_host`` by the
checkpoint policy, optimizer state and parameters held in ``pinned_host`` between steps; the results equal the
same plan without offload. Also pinned: what XLA's CPU backend refuses (placements inside a compiled program)."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from conftest import require_8_devices
from shardplan.baselines import baseline_plan
from shardplan.cost import build_tables
from shardplan.errors import ShardplanError
from shardplan.fit import plan_with_choices
from shardplan.jax.lower import trace
from shardplan.jax.memory import fit_step
from shardplan.jax.offload import HOST, OffloadStep, host_memory_kind, leaf_offloads
from shardplan.machine import Machine
from jax_compare import max_abs  # noqa: E402

pytestmark = pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out

DEVICES = require_8_devices()
# the toy machine with a host link, host memory and a CPU optimizer step (so that offload is offered)
HOST_TOY = Machine(8, peak_flops=32e9, bandwidth=16e9, name="toy-host", host_bandwidth=4e9, host_memory_bytes=1e10,
                   cpu_adam_rate=1e9)
B, D, H, C = 32, 16, 64, 8


def loss_fn(params, batch):
    x, y = batch
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


@pytest.fixture(scope="module")
def setup():
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(0), 4)
    params = {"w1": jax.random.normal(k1, (D, H)) / D**0.5, "b1": jnp.zeros(H) + 0.1,
              "w2": jax.random.normal(k2, (H, C)) / H**0.5}
    batch = (jax.random.normal(k3, (B, D)), jax.random.normal(k4, (B, C)))
    graph, info = trace(loss_fn, params, batch)
    return params, batch, info, baseline_plan("data_parallel", build_tables(graph, HOST_TOY, cutoff=1))


def kept(fs, params, batch) -> list[str]:
    """The residuals the step's backward keeps, other than the arguments themselves, as avals."""
    from jax._src.ad_checkpoint import saved_residuals

    return [str(a) for a, why in saved_residuals(fs.loss_fn, params, batch) if not why.startswith("from the argument")]


def test_offloaded_activations_are_kept_in_host_memory(setup):
    params, batch, info, dp = setup
    fp = plan_with_choices(dp, offload=("activations",))
    offloading = [i for i in range(len(dp.graph.operators)) if fp.memory_choices.offload(i) == ("activations",)]
    assert offloading  # the elementwise operators whose outputs the backward reads
    fs = fit_step(fp, loss_fn, params, batch, DEVICES, info=info)
    host = kept(fs, params, batch)
    assert host and all("<host>" in a for a in host)  # every saved activation went to pinned_host
    jaxpr = str(jax.make_jaxpr(fs.step)(params, batch))
    assert jaxpr.count("MemorySpace.Host") == jaxpr.count("MemorySpace.Device") == len(host)
    plain = fit_step(plan_with_choices(dp), loss_fn, params, batch, DEVICES, info=info)
    assert not any("<host>" in a for a in kept(plain, params, batch)) and not plain.remat
    loss0, grads0 = jax.value_and_grad(loss_fn)(params, batch)
    loss, grads = fs.step(params, batch)
    assert abs(float(loss) - float(loss0)) <= 1e-5 * abs(float(loss0))
    for k in grads0:
        np.testing.assert_allclose(np.asarray(grads[k]), np.asarray(grads0[k]), atol=1e-4 * max(
            max_abs(g) for g in grads0.values()))
    # XLA's CPU backend lowers the copies as the identity (JAX lowers memory placement for TPU and GPU only)
    assert "annotate_device_placement" not in fs.step.lower(params, batch).as_text()


@pytest.mark.parametrize("stage,parts", [(1, ("optimizer",)), (3, ("optimizer", "parameters", "activations"))])
def test_offloaded_state_lives_in_host_memory_and_updates_as_on_device(setup, stage, parts):
    params, batch, info, dp = setup
    fp = plan_with_choices(dp, stage, offload=parts)
    want = tuple(p for p in parts if p != "activations")
    assert leaf_offloads(fp, info) == (want, want, want, (), ())  # b1, w1, w2; the batch leaves hold none
    opt = optax.adam(1e-2)
    fs = fit_step(fp, loss_fn, params, batch, DEVICES, info=info)
    step = fs.train_step(opt, params)  # the fit step's own training step: the offloading one
    assert isinstance(step, OffloadStep) and step.host_state == (True,) * 3
    assert step.host_params == (("parameters" in parts),) * 3
    plain = fit_step(plan_with_choices(dp, stage), loss_fn, params, batch, DEVICES, info=info)
    train = plain.train_step(opt, params, donate=False)
    assert not isinstance(train, OffloadStep)
    p, s = fs.init(opt, params)
    p0, s0 = plain.init(opt, params)
    for _ in range(2):
        p, s, loss = step(p, s, batch)
        p0, s0, loss0 = train(p0, s0, batch)
        assert float(loss) == pytest.approx(float(loss0), rel=1e-6)
    for a, b in zip(jax.tree.leaves((p, s)), jax.tree.leaves((p0, s0))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    params_on_host = "parameters" in parts
    assert all((x.sharding.memory_kind == HOST) == params_on_host for x in jax.tree.leaves(p))
    mu = s[0].mu  # Adam's moments: in host memory, in the shards of the plan's ZeRO stage
    for k, x in mu.items():
        assert x.sharding.memory_kind == HOST
        assert x.sharding.shard_shape(x.shape) == plain.state_shardings[k].shard_shape(x.shape)
    assert s[0].count.sharding.memory_kind == "device"  # the step count is not per-parameter state


def test_cpu_backend_refuses_memory_placement_inside_a_program():
    """Why the state is moved between programs (shardplan.jax.offload): a jit placing its result in host memory
    fails to compile on XLA's CPU backend, even for a sharding that tiles every device."""
    mesh = jax.sharding.Mesh(np.array(DEVICES).reshape(2, 4), ("a", "b"))
    s = NamedSharding(mesh, PartitionSpec("a", "b"))
    x = jax.device_put(jnp.arange(64.0).reshape(8, 8), s)
    assert jax.device_put(x, s.with_memory_kind(HOST)).sharding.memory_kind == HOST  # outside a program: copied
    with pytest.raises(Exception, match="annotate_device_placement"):
        jax.jit(lambda a: a * 2, out_shardings=s.with_memory_kind(HOST))(x)


def test_offload_needs_host_memory():
    assert host_memory_kind(DEVICES) == HOST

    class Mem:
        kind = "device"

    class Dev:
        def addressable_memories(self):
            return [Mem()]

        def __str__(self):
            return "dev0"

    with pytest.raises(ShardplanError, match="no pinned_host memory"):
        host_memory_kind([Dev()])


def test_a_pipeline_plan_edited_after_the_search_is_refused():
    """A pipelined plan given FP8 or offload after the search still holds the search's stage plans, which lack
    them: the JAX stage runner refuses it rather than run without them (dropped ``detail``, it rebuilds the stages
    with their choices: tests/jax_engine/test_staged_choices_jax.py)."""
    import dataclasses

    from staged_cases import scoped

    import shardplan.jax as sj
    from shardplan.jax.staged import Tracer, batch_size
    from shardplan.pipeline.api import pipeline_solve
    from shardplan.planner import from_pipeline

    ks = jax.random.split(jax.random.PRNGKey(2), 4)
    params = {"w": [jax.random.normal(k, (D, D)) / D**0.5 for k in ks[:2]]}
    batch = (jax.random.normal(ks[2], (B, D)), jax.random.normal(ks[3], (B, D)))
    tracer = Tracer(scoped, params, batch)
    plan = from_pipeline(pipeline_solve(tracer, batch_size(tracer.full_info), HOST_TOY, micro_batches=(2,),
                                        sizes=(4,), cutoff=1))
    assert plan.num_stages == 2
    for change in ({"fp8": True}, {"offload": ("activations",)}):
        stage = plan.stages[0]
        name, choice = next(iter(stage.operators.items()))
        ops = {**stage.operators, name: dataclasses.replace(choice, **change)}
        bad = dataclasses.replace(plan, stages=(dataclasses.replace(stage, operators=ops),) + plan.stages[1:])
        with pytest.raises(ShardplanError, match="does not carry"):
            sj.apply(bad, scoped, params, batch, DEVICES)
