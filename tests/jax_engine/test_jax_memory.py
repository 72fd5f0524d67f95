"""The JAX export of a fit plan's memory choices (ZeRO / FSDP, recomputation, micro-batches) on 8 CPU devices."""

from __future__ import annotations

import math

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from shardplan.baselines import baseline_plan
from shardplan.cost import build_tables
from shardplan.errors import ShardplanError
from shardplan.fit import plan_with_choices
from shardplan.jax.lower import trace
from shardplan.jax.memory import fit_step, shard_over_replicas
from shardplan.machine import Machine
from conftest import require_8_devices
from jax_compare import max_abs, max_abs_diff  # noqa: E402

pytestmark = pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out

DEVICES = require_8_devices()
TOY = Machine(8, peak_flops=32e9, bandwidth=16e9, name="toy")
B, D, H, C = 32, 16, 64, 8


def loss_fn(params, batch):
    """Mean squared error of a 2-layer tanh MLP with a normalisation between the layers."""
    x, y = batch
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    h = h / jnp.sqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-5)
    out = h @ params["w2"]
    return jnp.mean((out - y) ** 2)


def model():
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(0), 4)
    params = {"w1": jax.random.normal(k1, (D, H)) / D**0.5, "b1": jnp.zeros(H) + 0.1,
              "w2": jax.random.normal(k2, (H, C)) / H**0.5}
    batch = (jax.random.normal(k3, (B, D)), jax.random.normal(k4, (B, C)))
    return params, batch


@pytest.fixture(scope="module")
def setup():
    params, batch = model()
    graph, info = trace(loss_fn, params, batch)
    tables = build_tables(graph, TOY, cutoff=1)
    return params, batch, info, baseline_plan("data_parallel", tables)


def primitives(jaxpr) -> list:
    """Every equation of ``jaxpr`` and of the jaxprs in its parameters: (name, params)."""
    out = []
    for e in jaxpr.eqns:
        out.append((e.primitive.name, e.params))
        for v in e.params.values():
            for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    out.extend(primitives(inner))
    return out


def assert_matches_unsharded(fs, params, batch):
    loss0, grads0 = jax.value_and_grad(loss_fn)(params, batch)
    loss, grads = fs.step(params, batch)
    assert abs(float(loss) - float(loss0)) <= 1e-5 * abs(float(loss0))
    top = max(max_abs(g) for g in jax.tree.leaves(grads0))
    err = max(max_abs_diff(a, b) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads0)))
    assert err <= 1e-4 * top
    return grads


CASES = [  # (stage, recompute, micro-batches)
    (1, False, 1), (2, False, 1), (3, False, 1), (0, True, 1), (0, False, 4), (3, True, 2), (2, ["mul"], 2),
]


@pytest.mark.parametrize("stage,recompute,k", CASES)
def test_fit_step_matches_unsharded(setup, stage, recompute, k):
    params, batch, info, dp = setup
    names = [op.name for op in dp.graph.operators]
    rec = [n for n in names if any(n.endswith(r) for r in recompute)] if isinstance(recompute, list) else recompute
    fp = plan_with_choices(dp, stage, rec, k)
    fs = fit_step(fp, loss_fn, params, batch, DEVICES, info=info)
    grads = assert_matches_unsharded(fs, params, batch)
    prims = primitives(jax.make_jaxpr(fs.step)(params, batch).jaxpr)
    remats = [p for n, p in prims if n in ("remat2", "checkpoint", "remat")]
    assert bool(remats) == (bool(rec) or stage == 3)  # stage 3 gathers the weights again for the backward
    scans = [p["length"] for n, p in prims if n == "scan"]
    assert scans == ([k] if k > 1 else [])
    # data parallel: every weight is replicated on all 8 devices, so its sharded state is cut 8 ways
    for leaf in ("w1", "w2"):
        full = math.prod(params[leaf].shape)
        shard = math.prod(grads[leaf].sharding.shard_shape(grads[leaf].shape))
        assert shard == (full // 8 if stage >= 2 else full)
    compiled = fs.step.lower(params, batch).compile()
    assert ("while(" in compiled.as_text()) == (k > 1)  # the micro-batch loop survives compilation
    if rec is True:  # every operator recomputes: the backward pass keeps no activation, only the arguments
        from jax._src.ad_checkpoint import saved_residuals

        micro = tuple(x[: B // k] for x in batch)
        kept = [a for a, why in saved_residuals(fs.loss_fn, params, micro)
                if not why.startswith("from the argument") and jnp.issubdtype(a.dtype, jnp.inexact)]
        assert kept == []
    p_in = compiled.input_shardings[0][0]
    for leaf in ("w1", "w2"):
        shard = math.prod(p_in[leaf].shard_shape(params[leaf].shape))
        assert shard == math.prod(params[leaf].shape) // (8 if stage == 3 else 1)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_train_step_shards_the_optimizer_state(setup, stage):
    """Adam through optax: the same update as unsharded; state (stage >= 1) and parameters (3) in shards."""
    import optax

    params, batch, info, dp = setup
    fs = fit_step(plan_with_choices(dp, stage, False, 2), loss_fn, params, batch, DEVICES, info=info)
    opt = optax.adam(1e-2)
    p0, s0 = fs.init(opt, jax.tree.map(jnp.copy, params))
    train = fs.train_step(opt, params, donate=False)
    compiled = train.lower(p0, s0, batch).compile()
    new, state, loss = compiled(p0, s0, batch)
    grads = jax.grad(loss_fn)(params, batch)
    ref = optax.apply_updates(params, opt.update(grads, opt.init(params), params)[0])
    for k in params:
        assert max_abs_diff(new[k], ref[k]) <= 1e-5 * max_abs(ref[k])
        n = math.prod(params[k].shape)
        mu = state[0].mu[k]
        assert math.prod(mu.sharding.shard_shape(mu.shape)) == (n // 8 if stage >= 1 and n % 8 == 0 else n)
        assert math.prod(new[k].sharding.shard_shape(new[k].shape)) == (n // 8 if stage == 3 and n % 8 == 0 else n)
    mem = compiled.memory_analysis()
    state_bytes = 4 * sum(math.prod(v.shape) for v in params.values())  # one copy of the parameters
    data = 4 * sum(math.prod(x.shape) for x in batch) // 8
    expect = state_bytes * ((1 + 2 / 8) if stage in (1, 2) else 3 / 8 if stage == 3 else 3)
    assert mem.argument_size_in_bytes - data == pytest.approx(expect, abs=64)  # parameters + Adam's mu, nu (+ count)


def test_shard_over_replicas_uses_free_axes_that_divide():
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(DEVICES).reshape(2, 4), ("_rep", "n"))
    s, pieces = shard_over_replicas(NamedSharding(mesh, P(None, "n")), (6, 8))
    assert (s.spec, pieces) == (P("_rep", "n"), 2)
    s, pieces = shard_over_replicas(NamedSharding(mesh, P(None, "n")), (3, 8))  # 3 rows: 2 does not divide
    assert (s.spec, pieces) == (P(None, ("n", "_rep")), 2)
    s, pieces = shard_over_replicas(NamedSharding(mesh, P(None,)), (3,))
    assert pieces == 1


def test_micro_batches_that_do_not_divide_the_batch_are_refused(setup):
    params, batch, info, dp = setup
    with pytest.raises(ShardplanError, match="micro-batches do not divide"):
        fit_step(plan_with_choices(dp, 0, False, 3), loss_fn, params, batch, DEVICES, info=info)
    with pytest.raises(ShardplanError, match="not divisible by its split"):  # 32 / 8 = 4 rows, split 8 ways
        fit_step(plan_with_choices(dp, 0, False, 8), loss_fn, params, batch, DEVICES, info=info)


def test_planned_with_a_budget_runs_the_fit_plan():
    import shardplan.jax as sj

    params, batch = model()
    free = sj.planned(loss_fn, params, batch, devices=DEVICES, machine=TOY)
    peak = free.plan.memory["peak_bytes"]
    pl = sj.planned(loss_fn, params, batch, devices=DEVICES, machine=TOY, budget=0.5 * peak)
    assert pl.plan.memory_choices is not None and pl.plan.memory["peak_bytes"] <= 0.5 * peak
    assert pl.fit is not None
    text = sj.report(pl.plan)
    assert "Memory per device" in text and "% of" not in text and "Micro-batches" in text
    loss0, _ = jax.value_and_grad(loss_fn)(params, batch)
    loss, _ = pl.step(params, batch)
    assert abs(float(loss) - float(loss0)) <= 1e-5 * abs(float(loss0))


def test_predicted_memory_against_xla_on_a_tiny_mlp(setup):
    """The memory benchmark's comparison on the tiny MLP, data parallel, Adam (benchmarks/bench_memory_vs_xla.py).

    Tolerances: parameters + optimizer state are modelled exactly (the only slack is Adam's 4-byte step
    count). Saved activations: the lowering's ``Operator.saved`` counts what JAX's backward keeps, per row
    the tanh and its derivative 1 - tanh^2, the normalised h (64 each), the 8-wide derivative of the square,
    and the norm and its derivative (one each): 202 values against JAX's 203 (it also keeps the square of
    the norm for the quotient rule), so the ratio is 1 within 1 %. The compiled total is
    never below the model's: XLA also holds what the model leaves to the reserve (activation gradients,
    the all-reduce's result beside its operand, workspace), so the model is a lower bound.
    """
    from benchmarks.bench_memory_vs_xla import measure

    params, batch, info, dp = setup
    row = measure(plan_with_choices(dp, 0, False, 1, name="data_parallel"), loss_fn, params, batch, info)
    r = row["ratio_xla_over_model"]
    assert abs(row["xla_bytes"]["state"] - (row["model_bytes"]["weights"] + row["model_bytes"]["optimizer"])) <= 8
    assert abs(r["saved"] - 203 / 202) <= 0.01
    assert r["total"] >= 1.0
    # the backward-peak model (one micro-batch): a maximum over the backward steps, below the additive sum,
    # still below XLA's total (which keeps the all-reduce's result beside its operand)
    m = row["model_bytes"]
    assert m["backward_peak"] < m["total"] and m["backward_peak_operator"] in {op.name for op in dp.graph.operators}
    assert r["total_backward"] == pytest.approx(row["xla_bytes"]["total"] / m["backward_peak"])
    assert r["total_backward"] > r["total"] >= 1.0


def test_plan_with_choices_reports_and_refuses_bad_input(setup):
    import shardplan.jax as sj

    _, _, _, dp = setup
    fp = plan_with_choices(dp, {dp.graph.operators[0].name: 3}, [dp.graph.operators[1].name], 2)
    text = sj.report(fp)
    assert "no budget" in text and "zero-3 state sharding (1 ops)" in text and "recompute (1 ops)" in text
    assert fp.memory["micro_batches"] == 2
    with pytest.raises(ShardplanError, match="no operator 'nope'"):
        plan_with_choices(dp, {"nope": 1})
    with pytest.raises(ShardplanError, match="stage 5"):
        plan_with_choices(dp, 5)
    with pytest.raises(ShardplanError, match="micro-batch"):
        plan_with_choices(dp, 0, False, 0)


def remat_loss_fn(params, batch):
    """The MLP with its first layer under the user's own jax.checkpoint (saving nothing inside it)."""
    x, y = batch

    @jax.checkpoint
    def block(x):
        return jnp.tanh(jnp.tanh(x @ params["w1"] + params["b1"]) * 2.0)

    out = block(x) @ params["w2"]
    return jnp.mean((out - y) ** 2)


def test_user_checkpoint_marks_its_operators_recomputed(setup):
    """Operators inside a user's jax.checkpoint save nothing (except the block's result) and always recompute."""
    params, batch = model()
    graph, info = trace(remat_loss_fn, params, batch)
    plain, _ = trace(loss_fn, params, batch)
    assert not plain.recomputed
    inner = {op.name for op in graph.operators[:3]}
    assert graph.recomputed and graph.recomputed < inner  # the block's last operator makes its result: kept
    last = max(graph.index[n] for n in inner)
    assert graph.operators[last].name not in graph.recomputed
    tables = build_tables(graph, TOY, cutoff=1)
    dp = baseline_plan("data_parallel", tables)
    fit = plan_with_choices(dp, 0, False)
    mc = fit.memory_choices
    for name in graph.recomputed:
        i = graph.index[name]
        assert mc.recompute(i) and set(mc.choice_tables[i].recompute) == {True}
        assert mc.choice_tables[i].activation_bytes[mc.choices[i]] == 0.0
        assert mc.parts(i)["recompute"] > 0.0
    saved = sum(float(t.activation_bytes[j]) for t, j in zip(mc.choice_tables, mc.choices))
    want = sum(tables.memory[i][1][dp.assignment[i]].max() for i, op in enumerate(graph.operators)
               if op.name not in graph.recomputed)
    assert saved == pytest.approx(want)
    assert dp.memory["activations_bytes"] == pytest.approx(want)
    fs = fit_step(fit, remat_loss_fn, params, batch, info=info)
    assert not fs.remat  # the user's own checkpoint call recomputes; the step adds none

    def fed(params, batch):  # x W1 is read only by an addition, but inside the checkpoint: its residual
        x, y = batch
        block = jax.checkpoint(lambda h: jnp.tanh(h + params["b1"]) @ params["w2"])
        return jnp.mean((block(x @ params["w1"]) - y) ** 2)

    g2, _ = trace(fed, params, batch)
    assert g2.operators[0].saved == 1.0 and g2.operators[1].name in g2.recomputed
    loss, grads = fs.step(params, batch)
    ref_loss, ref_grads = jax.value_and_grad(remat_loss_fn)(params, batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for k in ref_grads:
        np.testing.assert_allclose(np.asarray(grads[k]), np.asarray(ref_grads[k]), rtol=1e-4, atol=1e-6)


def test_saved_counts_what_the_backward_rules_read():
    """Operator.saved of the traced MLP: per operator the values JAX's backward keeps, in output tiles.

    x W1 (read by nothing: the bias addition is linear) 0; + b1 then tanh: its output (read by the square
    and the division) and its derivative 1 - tanh^2: 2; the square h * h (read by a sum): 0; the sum with
    its sqrt: the norm (read by the division) and the sqrt's derivative: 2; the division (read by h W2,
    whose W2 needs a gradient): 1; h W2: 0; minus y then squared: the square's derivative: 1; the mean: 0.
    """
    params, batch = model()
    graph, _ = trace(loss_fn, params, batch)
    assert [op.saved for op in graph.operators] == [0.0, 2.0, 0.0, 2.0, 1.0, 0.0, 1.0, 0.0]

    def stopped(params, batch):
        x, y = batch
        h = x @ params["w1"]
        m = jax.lax.stop_gradient(jnp.max(h, axis=-1, keepdims=True))
        return jnp.mean((jnp.exp(h - m) @ params["w2"] - y) ** 2)

    g, _ = trace(stopped, params, batch)
    by_kind = {op.kind: op.saved for op in g.operators}
    # the max's only reader stops the gradient: its backward never runs, so nothing reads h for it
    assert by_kind["reduce_max"] == 0.0 and g.operators[0].saved == 0.0
    assert by_kind["sub"] == 1.0  # exp keeps its result, read by the product with w2 too: one value
