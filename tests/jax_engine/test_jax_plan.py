"""JAX through the one planning call: ``sj.plan`` -> ``Plan.to_json`` -> ``Plan.from_json`` -> ``sj.apply``.

On 8 simulated CPU devices: a plan under a memory budget and a pipeline plan, each loaded back from JSON,
run with the unsharded loss and gradients; with no machine given, the plan names the detected one.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from conftest import require_8_devices
from shardplan import Plan, ShardplanError
from shardplan.machine import Machine
from jax_compare import max_abs, max_abs_diff  # noqa: E402

pytestmark = pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out

DEVICES = require_8_devices()
TOY = Machine(8, peak_flops=32e9, bandwidth=16e9, name="toy")
TWO_NODES = Machine(8, peak_flops=32e9, bandwidth=16e9, node_size=4, inter_bandwidth=1e8, name="toy-2-nodes")


def _params(d: int = 64, layers: int = 4):
    ks = jax.random.split(jax.random.PRNGKey(0), layers + 1)
    return {"emb": jax.random.normal(ks[0], (32, d)) * 0.1,
            "layers": [{"w": jax.random.normal(k, (d, d)) * 0.1} for k in ks[1:]]}


def loss_fn(params, batch):
    x, y = batch
    h = params["emb"][x]
    for i, layer in enumerate(params["layers"]):
        with jax.named_scope(f"L{i}"):
            h = h + jnp.tanh(h @ layer["w"])
    return jnp.mean((h.sum(-1) - y) ** 2)


BATCH = (jnp.arange(64) % 32, jnp.linspace(0.0, 1.0, 64))


def _check_equal(step, params):
    loss, grads = step(params, BATCH)
    ref_loss, ref_grads = jax.value_and_grad(loss_fn)(params, BATCH)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    for g, r in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref_grads)):
        assert max_abs_diff(g, r) <= 1e-5 * max(max_abs(r), 1e-12)


def test_a_plan_under_a_budget_round_trips_and_runs():
    import shardplan.jax as sj

    params = _params()
    free = sj.plan(loss_fn, params, BATCH, DEVICES, TOY, fit=False)
    p = sj.plan(loss_fn, params, BATCH, DEVICES, TOY, budget=0.5 * free.memory["peak_bytes"])
    assert p.memory["peak_bytes"] <= 0.5 * free.memory["peak_bytes"] and p.optimal
    q = Plan.from_json(p.to_json())
    assert q == p
    run = sj.apply(q, loss_fn, params, BATCH, DEVICES)
    assert run.plan.cost == pytest.approx(p.step_time, rel=1e-9)
    _check_equal(run.step, params)
    assert "Plan: data" in sj.report(q)


def test_a_pipeline_plan_round_trips_and_runs():
    import shardplan.jax as sj
    from shardplan.jax.staged import Tracer, batch_size
    from shardplan.pipeline.api import pipeline_solve
    from shardplan.planner import from_pipeline

    params = _params()
    tracer = Tracer(loss_fn, params, BATCH)
    result = pipeline_solve(tracer, batch_size(tracer.full_info), TOY, micro_batches=(4,), sizes=(4,), cutoff=1)
    p = from_pipeline(result)
    assert p.num_stages == 2
    q = Plan.from_json(p.to_json())
    _check_equal(sj.apply(q, loss_fn, params, BATCH, DEVICES).step, params)


def test_a_plan_is_refused_on_another_program_or_device_count():
    import shardplan.jax as sj

    params = _params()
    q = Plan.from_json(sj.plan(loss_fn, params, BATCH, DEVICES, TOY, stages=False).to_json())
    with pytest.raises(ShardplanError, match="for 8 devices"):
        sj.apply(q, loss_fn, params, BATCH, DEVICES[:4])
    with pytest.raises(ShardplanError, match="does not match|another program"):
        sj.apply(q, loss_fn, _params(layers=3), BATCH, DEVICES)


def test_stages_are_searched_by_the_same_call_across_nodes():
    import shardplan.jax as sj

    p = sj.plan(loss_fn, _params(), BATCH, DEVICES, TWO_NODES, micro_batches=(2, 4))
    # the pipelines were searched: a pipeline plan compared, or (none beat the one program) what they proved
    assert p.stats["stages_searched"] and "one program" in p.stats["compared"]
    assert "pipeline" in p.stats["compared"] or p.stats["pipeline_lower_bound"] >= p.lower_bound


def test_planning_with_no_machine_names_the_detected_one():
    import shardplan.jax as sj

    p = sj.plan(loss_fn, _params(layers=2), BATCH, DEVICES, stages=False)
    assert p.machine.name.startswith("cpu (detected: cpu)")
    assert dataclasses.asdict(p.machine)["num_devices"] == 8


def one_hot_twice(params, batch):
    """A scope entered twice: ``jax.nn.one_hot`` (a jitted helper, its own name scope) before and after the blocks,
    the embedding tied to the output."""
    x, y = batch
    h = jax.nn.one_hot(x, 32) @ params["emb"]
    for i, layer in enumerate(params["layers"]):
        with jax.named_scope(f"L{i}"):
            h = h + jnp.tanh(h @ layer["w"])
    logits = h @ params["emb"].T
    return -jnp.mean(jnp.sum(jax.nn.one_hot(y, 32) * jax.nn.log_softmax(logits), -1))


def test_a_scope_entered_twice_is_split_into_its_contiguous_runs():
    """Each contiguous run of a repeated scope is its own unit (``_one_hot``, ``_one_hot#2``): planning with
    stages="auto" succeeds, and a 2-stage pipeline cut before the second run runs equal to unsharded."""
    import shardplan.jax as sj
    from shardplan.jax.staged import Tracer, _unit_names, batch_size
    from shardplan.pipeline.api import pipeline_solve
    from shardplan.pipeline.stages import unit_prefix, units_of
    from shardplan.planner import from_pipeline

    assert _unit_names(["h/a", "b", "L0/c", "h/d", "h/e", "L0/f", "h#2/g"]) == {
        "h/a": "h/a", "b": "b", "L0/c": "L0/c", "h/d": "h#3/d", "h/e": "h#3/e", "L0/f": "L0#2/f", "h#2/g": "h#2/g"}
    params = _params()
    batch = (jnp.arange(64) % 32, jnp.arange(64) * 7 % 32)
    tracer = Tracer(one_hot_twice, params, batch)
    g = tracer(64)
    heads = [unit_prefix(g.operators[u[0]].name) for u in units_of(g)]
    assert heads == ["_one_hot", None, "L0", "L1", "L2", "L3", None, "_one_hot#2", "log_softmax", None]
    p = sj.plan(one_hot_twice, params, batch, DEVICES, TOY)  # stages="auto" looks for blocks
    assert p.stats["stages_reason"] == "one node"
    result = pipeline_solve(tracer, batch_size(tracer.full_info), TOY, micro_batches=(4,), sizes=(4,), cutoff=1)
    q = Plan.from_json(from_pipeline(result).to_json())
    assert q.num_stages == 2 and any(n.startswith("_one_hot#2/") for n in q.stages[1].operators)
    loss, grads = sj.apply(q, one_hot_twice, params, batch, DEVICES).step(params, batch)
    ref_loss, ref_grads = jax.value_and_grad(one_hot_twice)(params, batch)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    for a, r in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref_grads)):
        assert max_abs_diff(a, r) <= 1e-5 * max(max_abs(r), 1e-12)
