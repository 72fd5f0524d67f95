"""A mixture-of-experts layer written in JAX (GShard's capacity-based dispatch with one-hot einsums), planned by
``sj.plan`` on 8 simulated devices and run by ``sj.apply`` with the unsharded loss and gradients.

On a machine whose links are slow next to the experts' weights the plan splits the expert dimension of the
experts' products (expert parallelism): the tokens reach their experts by the redistributions the search
costs, and the run is the unsharded function's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from conftest import require_8_devices

from shardplan import Plan
from shardplan.machine import Machine
from jax_compare import max_abs, max_abs_diff  # noqa: E402

pytestmark = pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out

DEVICES = require_8_devices()
B, S, D, E, K, F = 8, 16, 32, 8, 2, 256   # sequences, tokens per sequence, width, experts, top-k, expert width
C = 4                                      # slots per expert and sequence: s k / E, so an unbalanced router drops
SLOW = Machine(8, peak_flops=32e9, bandwidth=1e9, name="toy-slow-links")


def moe_loss(params, batch):
    """Top-k routing with capacity C per expert and sequence (tokens past it are dropped), SwiGLU experts."""
    x, y = batch
    logits = jnp.einsum("bsd,de->bse", x, params["router"])
    probs = jax.nn.softmax(logits, axis=-1)
    top_p, top_i = jax.lax.top_k(probs, K)
    chosen = jax.nn.one_hot(top_i, E, dtype=x.dtype)                      # (B, S, K, E)
    flat = chosen.reshape(B, S * K, E)
    slot = (jnp.cumsum(flat, axis=1) - flat).reshape(B, S, K, E)          # each choice's slot in its expert
    # (B, S, K, E, C): 0 past capacity
    onehot = jax.nn.one_hot(slot.astype(jnp.int32), C, dtype=x.dtype) * chosen[..., None]
    dispatch = onehot.sum(2)                                              # (B, S, E, C)
    combine = (onehot * top_p[..., None, None]).sum(2)                    # the gate weights at the slots
    xe = jnp.einsum("bsec,bsd->becd", dispatch, x)                        # tokens per expert and slot
    h = jnp.einsum("becd,edgf->becgf", xe, params["w_in"])                # gate and up, stacked
    a = jax.nn.silu(h[..., 0, :]) * h[..., 1, :]
    ye = jnp.einsum("becf,efd->becd", a, params["w_out"])
    out = jnp.einsum("becd,bsec->bsd", ye, combine)
    return jnp.mean((out - y) ** 2)


def _inputs():
    ks = jax.random.split(jax.random.PRNGKey(0), 5)
    params = {"router": jax.random.normal(ks[0], (D, E)),
              "w_in": jax.random.normal(ks[1], (E, D, 2, F)) * 0.1,
              "w_out": jax.random.normal(ks[2], (E, F, D)) * 0.1}
    batch = (jax.random.normal(ks[3], (B, S, D)), jax.random.normal(ks[4], (B, S, D)))
    return params, batch


def test_capacity_drops_tokens_in_this_example():
    # the example exercises the capacity: some (token, expert) choices find their expert full
    params, (x, _) = _inputs()
    top_i = jax.lax.top_k(jax.nn.softmax(jnp.einsum("bsd,de->bse", x, params["router"]), -1), K)[1]
    per_expert = jax.nn.one_hot(top_i, E).sum((1, 2))                     # (B, E) choices per sequence and expert
    assert int(jnp.sum(jnp.maximum(per_expert - C, 0))) > 0


def test_an_expert_parallel_plan_runs_as_the_unsharded_layer():
    import shardplan.jax as sj

    params, batch = _inputs()
    p = sj.plan(moe_loss, params, batch, DEVICES, SLOW, fit=False, stages=False)
    graph, _ = sj.trace(moe_loss, params, batch)
    # the experts' products: the operators reading w_in and w_out; each splits its expert dimension 8 ways
    experts = [op for op in graph if op.weights and op.weights[0].shape in ((E, D, 2, F), (E, F, D))]
    assert len(experts) == 2
    for op in experts:
        lay = p.operators[op.name].layout
        e = op.weights[0].axes[0].dim
        assert lay.split[lay.dims.index(e)] == 8, (op.name, lay.describe())
    assert p.breakdown["redistribution"] > 0  # the tokens' all-to-alls
    q = Plan.from_json(p.to_json())
    run = sj.apply(q, moe_loss, params, batch, DEVICES)
    loss, grads = run.step(params, batch)
    ref_loss, ref_grads = jax.value_and_grad(moe_loss)(params, batch)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    for name in params:
        g, r = grads[name], ref_grads[name]
        assert max_abs_diff(g, r) <= 1e-5 * max_abs(r), name
    # the weights are laid out as planned: each device holds one expert's
    w_in = jax.device_put(params["w_in"], run.param_shardings["w_in"])
    assert {s.data.shape for s in w_in.addressable_shards} == {(1, D, 2, F)}
