"""A one-layer attention written with ``jax.nn.dot_product_attention`` (grouped-query, causal), shared by
test_jax_attention.py (its description) and test_ring_plan_jax.py (its planned ring run)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from shardplan.machine import Machine
from jax_compare import max_abs, max_abs_diff  # noqa: E402

TOY = Machine(8, peak_flops=32e9, bandwidth=16e9, name="toy")  # slow compute, fast links: splitting pays
B, S, D, N, K = 1, 128, 32, 4, 2  # batch, sequence, width, query heads, key/value heads
H = D // N


def attention_loss(params, batch, causal: bool = True, reduce: bool = True, **kw):
    """q, k, v projections, ``jax.nn.dot_product_attention``, an output projection and a tanh; the loss a
    weighted sum (``reduce=False``: the layer's output)."""
    x, w = batch
    b, s, _ = x.shape
    q = (x @ params["q"]).reshape(b, s, N, H)
    k, v = ((x @ params[n]).reshape(b, s, K, H) for n in ("k", "v"))
    y = jnp.tanh(jax.nn.dot_product_attention(q, k, v, is_causal=causal, **kw).reshape(b, s, D) @ params["o"])
    return jnp.sum(y * w) if reduce else y


def inputs(seq: int = S):
    ks = jax.random.split(jax.random.PRNGKey(0), 6)
    params = {"q": jax.random.normal(ks[0], (D, D)) / 6, "k": jax.random.normal(ks[1], (D, K * H)) / 6,
              "v": jax.random.normal(ks[2], (D, K * H)) / 6, "o": jax.random.normal(ks[3], (D, D)) / 6}
    return params, (jax.random.normal(ks[4], (B, seq, D)), jax.random.normal(ks[5], (B, seq, D)))


def check_two_layer_pipeline(devices, split: int, **options) -> None:
    """Two causal attention layers planned by the pipeline search on sub-meshes of 4 (two stages, two
    micro-batches of one sequence of 128) with ``options`` (e.g. ``context="ring"``): each stage splits its
    attention's queries ``split`` ways, its step replaces that attention with shardplan's own (ring or balanced
    all-gather, on the stage's prime-factor mesh), and loss and gradients equal the unsharded program."""
    import shardplan.jax as sj
    from shardplan.jax.staged import Tracer, batch_size
    from shardplan.pipeline.api import pipeline_solve
    from shardplan.planner import from_pipeline

    ks = jax.random.split(jax.random.PRNGKey(1), 2)
    params = {"layers": [inputs()[0], jax.tree.map(lambda w: w[::-1], inputs()[0])]}
    batch = (jax.random.normal(ks[0], (2, 128, 32)), jax.random.normal(ks[1], (2, 128, 32)))

    def two_layers(p, b):
        x, w = b
        for i, layer in enumerate(p["layers"]):
            with jax.named_scope(f"L{i}"):
                x = x + attention_loss(layer, (x, None), reduce=False)
        return jnp.mean(x * w)

    tracer = Tracer(two_layers, params, batch)
    plan = from_pipeline(pipeline_solve(tracer, batch_size(tracer.full_info), TOY, micro_batches=(2,), sizes=(4,),
                                        cutoff=1, **options))
    assert plan.num_stages == 2
    assert [[c.layout.split[1] for c in s.operators.values() if c.kind == "attn_flash"] for s in plan.stages] \
        == [[split], [split]]
    step = sj.apply(plan, two_layers, params, batch, devices).step
    assert [len(st.replace) for st in step.stages] == [1, 1]
    loss, grads = step(params, batch)
    ref_loss, ref_grads = jax.value_and_grad(two_layers)(params, batch)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    top = max(max_abs(r) for r in jax.tree.leaves(ref_grads))
    assert max(max_abs_diff(a, r) for a, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads))) \
        <= 1e-4 * top
