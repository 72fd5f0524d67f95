"""The all-gather's context parallelism balanced on 8 simulated devices (:func:`shardplan.jax.ring.gather_apply`):
the queries dealt into the balanced order, the keys and values gathered, the output dealt back; loss and
gradients equal to the unsharded causal attention, and the compiled step's exchanges are the gathered step's
plus the deal the cost model charges (:func:`shardplan.cost.ring.gathered_deal`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import require_8_devices
from shardplan.jax.ring import attention_reference, gather_apply
from jax_compare import max_abs, max_abs_diff  # noqa: E402

pytestmark = pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out

DEVICES = require_8_devices()
B, S, H, D = 2, 64, 4, 8


def _inputs(kv_heads: int):
    ks = jax.random.split(jax.random.PRNGKey(1), 4)
    q = jax.random.normal(ks[0], (B, S, H, D))
    k, v = (jax.random.normal(x, (B, S, kv_heads, D)) for x in ks[1:3])
    return q, k, v, jax.random.normal(ks[3], (B, S, H, D))


def _reference(q, k, v):
    group = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(x, group, axis=2) for x in (k, v))
    return attention_reference(q, k, v, True)


@pytest.mark.parametrize("shape, q_spec, kv_spec, axis, kv_heads, scatter", [
    ((8,), (None, "s", None, None), (None, None, None, None), "s", 4, (False, False)),
    ((8,), (None, "s", None, None), (None, None, None, None), "s", 4, (True, True)),
    ((8,), (None, "s", None, None), (None, None, None, None), "s", 1, (True, False)),
    ((2, 4), ("d", "s", None, None), ("d", None, None, None), "s", 2, (False, False)),   # batch and sequence split
    ((2, 4), (None, ("d", "s"), None, None), (None, None, None, None), ("d", "s"), 2, (False, False)),  # both axes
    ((2, 4), (None, ("d", "s"), None, None), (None, None, None, None), ("d", "s"), 2, (True, True)),
    ((2, 4), (None, "s", "d", None), (None, None, "d", None), "s", 2, (True, True)),   # heads and sequence split
])
def test_the_balanced_gather_equals_the_unsharded_loss_and_gradients(shape, q_spec, kv_spec, axis, kv_heads,
                                                                      scatter):
    """``scatter``: keys (and values) read split along the sequence like the queries, gathered inside, their
    gradients reduce-scattered."""
    from jax.sharding import Mesh, PartitionSpec as P

    mesh = Mesh(np.asarray(DEVICES).reshape(shape), ("s",) if len(shape) == 1 else ("d", "s"))
    q, k, v, w = _inputs(kv_heads)

    def loss(fn, q, k, v):
        return jnp.sum(jnp.tanh(fn(q, k, v)) * w)

    run = jax.jit(jax.value_and_grad(lambda *a: loss(
        lambda q, k, v: gather_apply(q, k, v, mesh, P(*q_spec), P(*kv_spec), axis, scatter), *a),
        argnums=(0, 1, 2)))
    ref = jax.jit(jax.value_and_grad(lambda *a: loss(_reference, *a), argnums=(0, 1, 2)))
    (l1, g1), (l0, g0) = run(q, k, v), ref(q, k, v)
    assert abs(float(l1) - float(l0)) <= 1e-5 * abs(float(l0))
    for a, b in zip(g1, g0):
        assert max_abs_diff(a, b) <= 1e-5 * max_abs(b)


def test_the_compiled_balanced_gather_sends_the_gathered_steps_collectives_and_the_charged_deal():
    """Forward and backward, on inputs split along the sequence as their producers leave them: the keys' and
    values' all-gathers and their gradients' all-reduce are those of the contiguous gathered step
    (``jax.nn.dot_product_attention`` under the same layouts); beyond them, eight collective-permutes of half a
    query block (q in, o out, dO in, dQ out, two halves each), the bytes
    :func:`shardplan.cost.ring.gathered_deal` charges (at 1 B/s and no latency, seconds are bytes)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from shardplan import ops
    from shardplan.cost.ring import gathered_deal
    from shardplan.ir import GraphBuilder
    from shardplan.jax.hlo import parse_collectives
    from shardplan.layout import Layout, LayoutArrays
    from shardplan.machine import Machine

    g, shape = 8, (2, 64, 2, 8)
    mesh = Mesh(np.asarray(DEVICES), ("s",))
    split, whole = NamedSharding(mesh, P(None, "s", None, None)), NamedSharding(mesh, P())
    args = [jax.device_put(jnp.ones(shape), split) for _ in range(4)]

    def gathered(attend):
        def loss(q, k, v, w):
            k, v = (jax.lax.with_sharding_constraint(x, whole) for x in (k, v))
            return jnp.sum(jnp.tanh(attend(jax.lax.with_sharding_constraint(q, split), k, v)) * w)
        hlo = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(*args).compile().as_text()
        return sorted((c.kind, c.nbytes, c.sent) for c in parse_collectives(hlo, g))

    dealt = gathered(lambda q, k, v: gather_apply(q, k, v, mesh, P(None, "s", None, None), P(), "s"))
    plain = gathered(lambda q, k, v: jax.lax.with_sharding_constraint(
        jax.nn.dot_product_attention(q, k, v, is_causal=True), split))
    permutes = [c for c in dealt if c[0] == "collective-permute"]
    assert [c for c in dealt if c[0] != "collective-permute"] == plain
    assert {c[0] for c in plain} == {"all-gather", "all-reduce"}
    block = shape[0] * shape[1] // g * shape[2] * shape[3] * 4  # a device's query block, fp32
    assert len(permutes) == 8 and all(c[1] == block // 2 for c in permutes)

    b = GraphBuilder("core")
    x = b.input("x", shape, needs_grad=True)
    q, k, v = (b.add(ops.elementwise(n, x, letters=a)) for n, a in (("q", "bshk"), ("k", "bthk"), ("v", "bthk")))
    b.add(ops.flash_attention("attn", q, k, v, "bshk", "bthk", causal=True, dealt=True))
    op = b.build()["attn"]
    lay = LayoutArrays.stack([Layout.flat(op.dim_names, tuple(g if d == "s" else 1 for d in op.dim_names), g)])
    unit = Machine(g, peak_flops=1e12, bandwidth=1.0, latency=0.0, dtype_bytes=4)
    assert gathered_deal(op, 1, lay, unit)[0] == sum(c[2] for c in permutes) == 4 * block


def test_the_compiled_balanced_gather_reduce_scatters_the_gradients_of_keys_its_producers_split():
    """Keys and values that arrive split along the sequence like the queries (``scatter``) are gathered inside
    the ``shard_map`` and their gradients come home by the all-gather's transpose: two all-gathers and two
    reduce-scatters of the whole key tile, no all-reduce but the loss's scalar; beside them the deal's eight half-block permutes. The
    reduce-scatters send what :func:`shardplan.cost.ring.gathered_reduction` charges the producer's edges (at
    1 B/s and no latency), half the bytes of the all-reduce :func:`shardplan.cost.ring.moved_reduction`
    charges where the producer does not split them (the all-reduce of the test above)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from shardplan import ops
    from shardplan.cost.operator import operator_cost
    from shardplan.cost.ring import gathered_reduction, gathered_scatters, moved_reduction
    from shardplan.ir import GraphBuilder
    from shardplan.jax.hlo import parse_collectives
    from shardplan.layout import Layout, LayoutArrays
    from shardplan.machine import Machine

    g, shape = 8, (2, 64, 2, 8)
    mesh = Mesh(np.asarray(DEVICES), ("s",))
    split = NamedSharding(mesh, P(None, "s", None, None))
    args = [jax.device_put(jnp.ones(shape), split) for _ in range(4)]

    def loss(q, k, v, w):
        out = gather_apply(q, k, v, mesh, P(None, "s", None, None), P(), "s", (True, True))
        return jnp.sum(jnp.tanh(out) * w)

    hlo = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(*args).compile().as_text()
    cs = parse_collectives(hlo, g)
    tile = int(np.prod(shape)) * 4  # the whole keys, fp32
    block = tile // g
    assert sorted((c.kind, c.nbytes) for c in cs if c.kind != "collective-permute") == \
        [("all-gather", tile)] * 2 + [("all-reduce", 4)] + [("reduce-scatter", tile)] * 2  # and the loss's sum
    assert sorted(c.nbytes for c in cs if c.kind == "collective-permute") == [block // 2] * 8
    sent = [c.sent for c in cs if c.kind == "reduce-scatter"]
    assert sent == [tile * (g - 1) // g] * 2

    b = GraphBuilder("core")
    x = b.input("x", shape, needs_grad=True)
    q, k, v = (b.add(ops.elementwise(n, x, letters=a)) for n, a in (("q", "bshk"), ("k", "bthk"), ("v", "bthk")))
    b.add(ops.flash_attention("attn", q, k, v, "bshk", "bthk", causal=True, dealt=True))
    gr = b.build()
    op = gr["attn"]
    lay = LayoutArrays.stack([Layout.flat(op.dim_names, tuple(g if d == "s" else 1 for d in op.dim_names), g)])
    lk = LayoutArrays.stack([Layout.flat(gr["k"].dim_names, tuple(g if d == "t" else 1 for d in gr["k"].dim_names),
                                         g), Layout.flat(gr["k"].dim_names, (1,) * len(gr["k"].dim_names), g)])
    unit = Machine(g, peak_flops=1.0, bandwidth=1.0, latency=0.0, dtype_bytes=4)  # slow compute: the deal pays
    compute = operator_cost(op, lay, unit).compute
    assert gathered_scatters(gr["k"], lk, op, 1, lay, unit)[:, 0].tolist() == [True, False]
    for slot in (1, 2):
        charged = gathered_reduction(gr["k"], lk, op, slot, lay, unit, compute)[:, 0]
        assert charged.tolist() == [sent[0], moved_reduction(op, lay, unit, (slot,))[0]]
        assert 2 * charged[0] == charged[1] == 2 * tile * (g - 1) / g


def test_the_planned_all_gather_deals_its_queries_and_runs_equal_to_the_unsharded_program():
    """The one-layer attention of jax_attention_cases planned with the all-gather (the default) on the toy
    machine: its queries' sequence split, the tables charge the deal (cheaper than the contiguous blocks' extra
    work), and ``sj.apply``'s step runs :func:`gather_apply` there: loss and gradients equal to the unsharded
    program; the compiled step gathers the keys and values and moves the queries' halves point to point."""
    import shardplan.jax as sj
    from jax_attention_cases import TOY, attention_loss, inputs
    from shardplan.cost.ring import deals_gathered
    from shardplan.jax.hlo import parse_collectives
    from shardplan.jax.run import gather_scatters, ring_charged, ring_hooks

    params, batch = inputs()
    plan = sj.plan(attention_loss, params, batch, DEVICES, TOY)
    run = sj.apply(plan, attention_loss, params, batch, DEVICES)
    (attn,) = [op for op in run.plan.graph.operators if op.kind == "attn_flash"]
    lay = run.plan.layouts[attn.name]
    cs = lay.splits[0][attn.dim_names.index("s")]
    assert cs > 1 and deals_gathered(attn, lay, run.plan.machine)
    assert not ring_charged(run.plan, attn.name)
    assert gather_scatters(run.plan, attn.name) == (True, True)  # the projections leave keys and values split
    consume, replace = ring_hooks(run.plan, run.info, DEVICES)
    assert (len(consume), len(replace)) == (2, 1)
    step = run.step.lower(params, batch).compile()
    loss, grads = step(params, batch)
    ref_loss, ref_grads = jax.value_and_grad(attention_loss)(params, batch)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    for name, r in ref_grads.items():
        assert max_abs_diff(grads[name], r) <= 1e-4 * max_abs(r), name
    hlo = step.as_text()
    assert "all-gather" in hlo
    q = batch[0].shape[0] * batch[0].shape[1] * attn.extents["h"] * attn.extents["r"] * attn.extents["k"] * 4
    ways = int(np.prod([n for d, n in zip(attn.dim_names, lay.splits[0]) if d != "t"]))
    half = q // ways // 2  # half of a device's query tile, fp32
    halves = [c for c in parse_collectives(hlo, 8) if c.kind == "collective-permute" and c.nbytes == half]
    assert len(halves) == 8
    # the keys' and values' gradients reduce-scattered over the query sequence's group, not all-reduced
    kv = batch[0].shape[0] * batch[0].shape[1] * attn.extents["h"] * attn.extents["k"] * 4 \
        // int(np.prod([n for d, n in zip(attn.dim_names, lay.splits[0]) if d not in ("s", "t", "r")]))
    kinds = [(c.kind, c.nbytes, c.sent) for c in parse_collectives(hlo, 8)]
    assert kinds.count(("reduce-scatter", kv, kv * (cs - 1) / cs)) == 2, (kv, kinds)
    assert ("all-reduce", kv, 2 * kv * (cs - 1) / cs) not in kinds, (kv, kinds)  # over the sequence's group


def test_pipeline_stages_run_their_balanced_all_gather():
    """Two attention layers, the pipeline search with the all-gather on sub-meshes of 4 (two stages, two
    micro-batches of one sequence of 128): each stage splits its attention's queries and heads 2 ways each, and
    its step runs the balanced all-gather (on the stage's prime-factor mesh); loss and gradients equal to the
    unsharded program."""
    from jax_attention_cases import check_two_layer_pipeline

    check_two_layer_pipeline(DEVICES, 2)
