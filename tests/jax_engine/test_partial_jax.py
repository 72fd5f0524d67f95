"""Partial layouts run on JAX: Megatron-LM-style sequence parallelism of a residual MLP on 8 simulated devices.

The row-parallel products leave their outputs as partial sums and the column-parallel ones their inputs'
gradients; the norms, additions and the loss split the sequence. The step's loss and gradients equal the
unsharded ones, and the compiled program reduces the partial sums straight into the sequence-split layout (no
output constraint on a partial output: the consumer's sequence-split read is the only one).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from conftest import require_8_devices
from shardplan.configs import forward_deferrable, with_partial
from shardplan.cost import build_tables
from shardplan.jax.hlo import parse_collectives
from shardplan.jax.lower import trace
from shardplan.jax.run import make_step
from shardplan.jax.shardings import plan_shardings
from shardplan.layout import Layout
from shardplan.machine import Machine
from shardplan.spmd import plan_from_configs
from jax_compare import max_abs, max_abs_diff  # noqa: E402

pytestmark = pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out

DEVICES = require_8_devices()
TOY = Machine(8, peak_flops=32e9, bandwidth=16e9, name="toy")
B, S, D, F = 4, 32, 64, 256


def init(key):
    k1, k2, k3, k4 = jax.random.split(key, 4)
    return {"w1": jax.random.normal(k1, (D, F)) * D**-0.5, "w2": jax.random.normal(k2, (F, D)) * F**-0.5,
            "w3": jax.random.normal(k3, (D, F)) * D**-0.5, "w4": jax.random.normal(k4, (F, D)) * F**-0.5}


def loss_fn(p, batch):
    x, y = batch
    h = x
    for a, b in (("w1", "w2"), ("w3", "w4")):
        h = h + jnp.tanh(h @ p[a]) @ p[b]
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6)
    return jnp.mean((h - y) ** 2)


def _sp_layout(op):
    """Column-parallel products split their output features, row-parallel ones their input features, both
    partial where that defers a reduction (not the first product: the data needs no gradient); everything
    else splits the sequence."""
    names = op.dim_names
    if op.weights:  # the hidden dimension of extent F: the output of a column-parallel product, summed in a row one
        feat = next(a.dim for a in op.weights[0].axes if op.extents[a.dim] == F)
        col = feat not in op.reduction_dims
        cfg = tuple(8 if d == feat else 1 for d in names)
        return with_partial(op, [Layout.flat(names, cfg, 8)])[-1], col
    return Layout.flat(names, tuple(8 if d == "s" else 1 for d in names), 8), None


def test_sequence_parallel_plan_runs_as_unsharded_and_reduces_into_the_sequence_split():
    params = init(jax.random.PRNGKey(0))
    batch = (jax.random.normal(jax.random.PRNGKey(1), (B, S, D)), jax.random.normal(jax.random.PRNGKey(2), (B, S, D)))
    g, info = trace(loss_fn, params, batch)
    tables = build_tables(g, TOY, cutoff=1, orders="row-major", partial_sums=True)
    chosen = {op.name: _sp_layout(op) for op in g.operators}
    products = [n for n, (_, col) in chosen.items() if col is not None]
    assert sorted(col for n, (_, col) in chosen.items() if col is not None) == [False, False, True, True]
    # the row-parallel outputs are sums; the column-parallel ones carry the fused tanh, so only their inputs'
    # gradients are deferred
    assert [forward_deferrable(g.operators[g.index[n]]) for n in products] == [not chosen[n][1] for n in products]
    plan = plan_from_configs(tables, {n: lay for n, (lay, _) in chosen.items()})
    sh = plan_shardings(plan, info, DEVICES)
    row = [n for n in products if not chosen[n][1]]
    assert all(info.op_vars[n] not in sh.values for n in row)
    partial = [n for n in products if chosen[n][0].partial]
    assert len(partial) == 3
    assert len(sh.free_cotangents) == sum(len(info.reads[n]) for n in partial)

    step = make_step(plan, info, DEVICES)
    loss, grads = step(params, batch)
    ref_loss, ref_grads = jax.value_and_grad(loss_fn)(params, batch)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    for k in params:
        err = max_abs_diff(grads[k], ref_grads[k])
        assert err <= 1e-5 * max_abs(ref_grads[k]), k
    hlo = step.lower(params, batch).compile().as_text()
    # per layer: the partial output reduced into the sequence-split residual (forward), the gathers of the
    # sequence-split activation into the column-parallel product (forward, the second layer: the first reads
    # the data, replicated) and of the gradient into the row-parallel one (backward, both layers), the partial
    # input gradient reduced into the sequence-split producer (backward, the second layer). XLA's CPU SPMD
    # partitioner writes a reduce-scatter as an all-reduce and a slice (its GPU pipeline turns that pattern
    # into a reduce-scatter); the sequence-split tiles [B, S/8, D] show the slices.
    cs = parse_collectives(hlo)
    assert sorted(c.kind for c in cs) == ["all-gather"] * 3 + ["all-reduce"] * 3
    assert all(c.group == 8 for c in cs)
    assert all(c.nbytes == B * S * D * 4 for c in cs if c.kind == "all-gather")
    assert f"f32[{B},{S // 8},{D}]" in hlo
