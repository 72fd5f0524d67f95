"""A parameter read through static slices (``w[:a]``, ``w[:, a:b]``) and elsewhere too is one weight, as a
``jnp.split`` piece is (tests/jax_engine/test_shared_split_jax.py): a fused QKV weight read as ``w[:, :D]``,
``w[:, D:2D]``, ``w[:, 2D:]`` and an embedding table read whole by the lookup and through ``embed[:V2]`` by the
tied head (the rest is vocabulary padding). Each slice is an operator reading the whole parameter through an offset;
the first reader owns it, the others are linked to it by weight edges (docs/jax.md, "Slices of a parameter"). The
plan runs on 8 simulated devices with the loss and gradients of the unsharded program, and the compiled program's
collective bytes are the model's charge within 0.1 % (less one shared gather where XLA shares it). A slice that is
its parameter's only reader is read by its consumer through the slice's offset: the block it reads splits as the
slice's would, and the memory model stores the leaf whole along the cut axis, as the run holds it."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from shardplan.jax import trace  # noqa: E402
from tests.jax_engine.test_shared_split_jax import (B, CASES, DEVICES, TOY, D, T, V, V2,  # noqa: E402
                                                    _assert_equal_to_unsharded, _shared, compiled_against_model)

def loss_fn(p, batch):
    """One attention block with q, k, v the thirds of one fused weight (static slices), an MLP whose first weight
    is read through ``w1[:, :D]`` only (its other half padding), and a head tied to the embedding table's first
    V2 rows (a static slice of the table the lookup reads whole); cross-entropy."""
    ids, y = batch
    table = p["embed"][:V2]
    h = p["embed"][ids]
    w = p["wqkv"]
    q, k, v = w[:, :D], w[:, D:2 * D], w[:, 2 * D:]
    s = jnp.einsum("btd,bsd->bts", h @ q, h @ k) / np.sqrt(D)
    h = h + jax.nn.softmax(s, -1) @ (h @ v)
    h = jnp.tanh(h @ p["w1"][:, :D])
    lp = jax.nn.log_softmax(h @ table.T)
    return -jnp.mean(jnp.take_along_axis(lp, y[..., None], -1))


def _inputs():
    r = np.random.default_rng(0)
    params = {"embed": jnp.asarray(r.normal(size=(V, D)) / 8, jnp.float32),
              "wqkv": jnp.asarray(r.normal(size=(D, 3 * D)) / 8, jnp.float32),
              "w1": jnp.asarray(r.normal(size=(D, 2 * D)) / 8, jnp.float32)}
    batch = (jnp.asarray(r.integers(0, V2, size=(B, T))), jnp.asarray(r.integers(0, V2, size=(B, T))))
    return params, batch


def test_the_slices_are_weight_edges_and_the_plan_runs():
    """The graph links the fused weight's q slice to the k and v slices and the head's slice of the table to the
    embedding's gather, reads every shared parameter whole (one weight each, its memory counted once);
    ``w1[:, :D]``'s reader, its leaf's only one, reads the leaf through the slice's offset; ``shardplan.jax.plan``
    plans it and the planned step equals the unsharded program."""
    import shardplan.jax as sj

    params, batch = _inputs()
    g, _ = trace(loss_fn, params, batch)
    shared = _shared(g)
    assert sorted(len(r) for r in shared.values()) == [1, 2]
    offsets = sorted(tuple(a.offset for a in g.operators[g.index[n]].weights[0].axes)
                     for rs in shared.values() for n in rs)
    assert offsets == [(0, 0), (0, 64), (0, 128)]  # k, v at columns D, 2D; the gather reads the table whole
    owned = sorted(w.shape for op in g.operators for w in op.weights if w.owner is None)
    assert owned == [(D, 2 * D), (D, 3 * D), (V, D)]  # one weight per leaf
    plan = sj.plan(loss_fn, params, batch, devices=DEVICES, machine=TOY)
    run = sj.apply(plan, loss_fn, params, batch, devices=DEVICES)
    loss, grads = run.step(params, batch)
    _assert_equal_to_unsharded(loss, grads, params, batch, loss_fn)


# the plans compared: the same as the jnp.split test's (CASES)
@pytest.mark.parametrize("case, edge_bytes, shared", [
    ("solved", [0, 0, 0], 0),
    # k's gradient of the whole (64, 192) parameter, rows split in two, gathered to the replicated owner: the
    # export's steps (Machine.stepwise_redistribution), 64 x 96 floats; XLA sends exactly that
    ("one reader", [0, 24576, 0], 0),
    # each reader's edge charged the same gather; XLA adds k's and v's gradients (one layout) and gathers once: the
    # model's per-edge charge is an upper bound by exactly that one gather (HLO / model 0.877; 0.9996 without it)
    ("two readers", [0, 24576, 24576], 24576),
])
def test_compiled_bytes_against_the_model(case, edge_bytes, shared):
    """The weight edges' charges, the step against the unsharded program, and the compiled program's collective
    bytes within 0.1 % of the model's (less, in the two-reader plan, the one gather XLA shares)."""
    def fused(shared):  # the fused weight's owner and readers: the shared leaf read twice
        return sorted(shared.items(), key=lambda kv: len(kv[1]))[1]

    sent, got, want = compiled_against_model(loss_fn, *_inputs(), fused, CASES[case], case)
    assert sent == edge_bytes
    assert 0.999 <= got / (want - shared) <= 1.0


def test_a_parameter_read_only_through_a_slice_is_stored_whole():
    """``w1[:, :D]``, its leaf's only reader: the product reads the (64, 128) leaf through columns 0..63 (its
    ``out`` dim splits that block as it would the slice) and the memory model stores what the run holds, the whole
    leaf along the sliced axis: with ``out`` split 2 and ``in`` 4, each device's value is 16 x 128 floats, not
    16 x 32 (:func:`shardplan.cost.tiles.stored_weight`)."""
    from shardplan.cost.memory import operator_memory

    params, batch = _inputs()
    g, info = trace(loss_fn, params, batch)
    (op,) = [op for op in g.operators if any(w.shape == (D, 2 * D) for w in op.weights)]
    (w,) = op.weights
    assert w.owner is None and w.axes[1].offset == 0 and w.axes[1].partial and w.axes[0].is_plain
    layout = np.asarray([tuple({w.axes[0].dim: 4, w.axes[1].dim: 2}.get(d, 1) for d in op.dim_names)])
    weight_bytes, _ = operator_memory(op, layout, TOY, optimizer_factor=0.0)
    assert float(weight_bytes.max()) == 16 * 128 * TOY.dtype_bytes * 2  # value and gradient


def _scanned_loss(p, x):
    """A ``scan`` over a stacked weight whose body reads a loop-invariant fused weight through two slices."""
    def body(h, wl):
        w = p["wqk"]
        return jnp.tanh((h @ w[:, :D // 4]) * (h @ w[:, D // 4:])) @ wl, None

    h, _ = jax.lax.scan(body, x, p["stack"])
    return jnp.sum(h ** 2)


def test_slices_in_a_scan():
    """In an unrolled ``scan``, each iteration's slice of the stacked weight stays that layer's weight (the
    iterations cut it at different starts), while the body's slices of the loop-invariant fused weight are one
    weight, owned by the first iteration's first slice; the plan runs equal to the unsharded program."""
    import shardplan.jax as sj

    r = np.random.default_rng(1)
    d = D // 4
    params = {"wqk": jnp.asarray(r.normal(size=(d, 2 * d)) / 4, jnp.float32),
              "stack": jnp.asarray(r.normal(size=(3, d, d)) / 4, jnp.float32)}
    x = jnp.asarray(r.normal(size=(B, d)), jnp.float32)
    g, _ = trace(_scanned_loss, params, x)
    owned = sorted((op.name, w.shape) for op in g.operators for w in op.weights if w.owner is None)
    assert owned == [("scan0/dot_general_3", (1, d, d)), ("scan0/slice", (d, 2 * d)),
                     ("scan1/dot_general_3", (1, d, d)), ("scan2/dot_general_3", (1, d, d))]
    assert sorted(_shared(g).items()) == [("scan0/slice", ["scan0/slice_2", "scan1/slice", "scan1/slice_2",
                                                           "scan2/slice", "scan2/slice_2"])]
    plan = sj.plan(_scanned_loss, params, x, devices=DEVICES, machine=TOY)
    loss, grads = sj.apply(plan, _scanned_loss, params, x, devices=DEVICES).step(params, x)
    _assert_equal_to_unsharded(loss, grads, params, x, _scanned_loss)
