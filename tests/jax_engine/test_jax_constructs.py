"""Constructs real JAX code uses: each is traced, planned, run sharded, and equals the unsharded step."""

from __future__ import annotations

import pytest

import jax
import jax.numpy as jnp

from conftest import require_8_devices  # noqa: E402
from shardplan import ops  # noqa: E402
from shardplan.ir import TensorRef  # noqa: E402
from shardplan.jax import parallelize, trace  # noqa: E402
from shardplan.machine import Machine  # noqa: E402
from jax_compare import max_abs, max_abs_diff  # noqa: E402

pytestmark = pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out

DEVICES = require_8_devices()
TOY = Machine(8, peak_flops=32e9, bandwidth=16e9, name="toy")
K = jax.random.PRNGKey(0)
P = {"w": jax.random.normal(K, (16, 16)) * 0.3, "emb": jax.random.normal(K, (32, 16)),
     "ws": jax.random.normal(K, (3, 16, 16)) * 0.3, "cw": jax.random.normal(K, (3, 3, 4, 8)) * 0.3,
     "dw": jax.random.normal(K, (3, 3, 1, 8)) * 0.3}
B = {"ids": jax.random.randint(K, (8, 4), 0, 32), "x": jax.random.normal(K, (8, 16)),
     "img": jax.random.normal(K, (8, 8, 8, 4)), "key": jax.random.PRNGKey(3)}


def embed(p, b):
    return jnp.sum(jnp.tanh(p["emb"][b["ids"]] @ p["w"]))


def int_label_xent(p, b):
    logits = b["x"] @ p["w"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), (b["ids"][:, 0] % 16)[:, None], axis=1))


def constants(p, b):
    h = jax.nn.one_hot(jnp.arange(8) % 4, 16) @ p["w"] + b["x"] @ p["w"]
    return jnp.sum(jnp.concatenate([jnp.zeros((8, 2)), h], 1) ** 2)


def remat(p, b):
    return jnp.sum(jax.checkpoint(lambda a: jnp.tanh(a @ p["w"]))(b["x"]) ** 2)


def scan_layers(p, b):
    h, ys = jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), jnp.sum(c)), b["x"], p["ws"])
    return jnp.sum(h ** 2) + jnp.sum(ys)


def cond(p, b):
    h = b["x"] @ p["w"]
    return jnp.sum(jax.lax.cond(jnp.sum(h) > 0, lambda a: a * 2, lambda a: a * 3, h) ** 2)


def cumsum(p, b):
    return jnp.sum(jnp.cumsum(b["x"] @ p["w"], axis=1) ** 2)


def scatter(p, b):
    return jnp.sum((b["x"] @ p["w"]).at[:, 0].add(1.0).at[:, 3].set(0.0) ** 2)


def pad_rev(p, b):
    return jnp.sum(jnp.flip(jnp.pad(b["x"] @ p["w"], ((0, 0), (1, 2))), 1) ** 2 * jnp.arange(19.0))


def tile(p, b):
    return jnp.sum(jnp.tile(b["x"] @ p["w"], (1, 2)) ** 2 * jnp.arange(32.0))


def top_k_sort_argmax(p, b):
    h = b["x"] @ p["w"]
    return jnp.sum(jax.lax.top_k(h, 3)[0]) + jnp.sum(jnp.sort(h, axis=1)[:, -1]) + jnp.sum(jnp.argmax(h, 1))


def dynamic_update_slice(p, b):
    return jnp.sum(jax.lax.dynamic_update_slice(b["x"] @ p["w"], jnp.ones((8, 2)), (0, 3)) ** 2)


def dropout(p, b):
    h = b["x"] @ p["w"]
    return jnp.sum(jnp.where(jax.random.bernoulli(b["key"], 0.8, h.shape), h / 0.8, 0.0) ** 2)


def convs(p, b):
    dn = ("NHWC", "HWIO", "NHWC")
    y = jax.lax.conv_general_dilated(b["img"], p["cw"], (1, 1), "SAME", dimension_numbers=dn)
    y = jax.lax.conv_general_dilated(y, p["dw"], (1, 1), "SAME", dimension_numbers=dn, feature_group_count=8)
    y = jax.lax.conv_transpose(y, p["cw"].transpose(0, 1, 3, 2), (2, 2), "SAME", dimension_numbers=dn)
    return jnp.sum(y ** 2)


def cholesky(p, b):
    """A primitive the frontend has no handler for (described conservatively)."""
    h = b["x"] @ p["w"]
    with jax.named_scope("block"):
        c = jax.lax.linalg.cholesky(h.T @ h / 8 + jnp.eye(16))
    return jnp.sum(jnp.tanh(h @ c) ** 2)


@pytest.mark.parametrize("fn", [embed, int_label_xent, constants, remat, scan_layers, cond, cumsum, scatter, pad_rev,
                                tile, top_k_sort_argmax, dynamic_update_slice, dropout, convs, cholesky],
                         ids=lambda f: f.__name__)
def test_sharded_step_equals_unsharded(fn):
    plan, step = parallelize(fn, P, B, devices=DEVICES, machine=TOY)
    loss, grads = step(P, B)
    loss0, grads0 = jax.value_and_grad(fn)(P, B)
    assert abs(float(loss) - float(loss0)) <= 1e-5 * abs(float(loss0))
    scale = max(max_abs(g) for g in jax.tree.leaves(grads0))
    for g, g0 in zip(jax.tree.leaves(grads), jax.tree.leaves(grads0)):
        assert max_abs_diff(g, g0) <= 1e-4 * scale
    assert any(c > 1 for cfg in plan.configs.values() for c in cfg)


# -- descriptions (no compilation) ----------------------------------------------------
def test_embedding_lookup_is_the_embedding_description():
    g, _ = trace(embed, P, B)
    look = next(op for op in g.operators if op.kind == "gather")
    ref = ops.embedding("ref", TensorRef("ids", (8, 4), is_input=True, needs_grad=False), vocab=32, dim=16)
    assert sorted(e for _, e in look.dims) == sorted(e for _, e in ref.dims)
    vocab = [d for d, e in look.dims if e == 32]
    assert look.reduction_dims == tuple(vocab)  # a vocabulary split is a partial sum
    assert look.weights[0].shape == (32, 16) and look.points * look.flops_per_point == 8 * 4 * 16
    assert look.grad_reduction_dims(look.weights[0]) == ("b", "s")  # the table's gradient sums over the batch


def test_traced_concat_is_ops_concat():
    g, _ = trace(lambda p, x: jnp.sum(jnp.concatenate([x @ p, jnp.tanh(x)], 1)), jnp.ones((16, 8)), jnp.ones((4, 16)))
    cat = next(op for op in g.operators if op.kind == "concat")
    ref = ops.concat("ref", [TensorRef("a", (4, 8)), TensorRef("c", (4, 16))], 1)
    assert [tuple((a.offset, a.partial) for a in t.axes) for t in cat.inputs] == \
        [tuple((a.offset, a.partial) for a in t.axes) for t in ref.inputs]


def test_sort_axis_is_fixed_and_constants_are_free():
    g, _ = trace(top_k_sort_argmax, P, B)
    srt = next(op for op in g.operators if op.kind == "sort")
    assert srt.fixed == {srt.output.axes[1].dim}
    g, _ = trace(constants, P, B)
    assert all(t.src is None or t.src in g.graph_inputs or t.src in g.index for op in g for t in op.inputs)
    assert sum(op.kind == "einsum" for op in g.operators) == 2  # one_hot(arange) @ w reads only the weight
    one_hot_dot = next(op for op in g.operators if op.kind == "einsum" and not op.inputs)
    assert len(one_hot_dot.weights) == 1


def test_tiled_axis_is_fixed_and_the_other_maps_plainly():
    g, _ = trace(tile, P, B)
    til = next(op for op in g.operators if op.kind == "tile")
    rows, cols = (a.dim for a in til.output.axes)
    assert til.fixed == {cols} and dict(til.dims)[cols] == 32
    assert [a.dim for a in til.inputs[0].axes] == [rows, None]


def test_remat_is_kept_and_scan_unrolled():
    _, info = trace(remat, P, B)
    assert [e.name for e in info.program.eqns if not e.graph] == ["remat2"]
    g, info = trace(scan_layers, P, B)
    assert sum(op.kind == "einsum" for op in g.operators) == 3
    assert all(e.name != "scan" for e in info.program.eqns)
    ws = [i for i, n in enumerate(info.leaf_names) if n.endswith("['ws']")][0]
    assert len(info.leaf_uses[ws]) == 3  # each layer's slice is a weight of that layer's operator


def test_scan_iterations_are_tied_to_one_configuration():
    """The copies of a scanned body's operators form one tie group each; the plan gives them one configuration."""
    from shardplan.spmd import solve

    g, _ = trace(scan_layers, P, B)
    dots = tuple(op.name for op in g.operators if op.kind == "einsum")
    assert dots in g.ties  # one group: the three iterations' matmuls, in iteration order
    assert all(len(grp) == 3 for grp in g.ties)
    plan = solve(g, TOY, cutoff=1)
    for grp in g.ties:
        assert len({plan.layouts[n] for n in grp}) == 1
    assert plan.solution.stats["tied_vertices"] == sum(len(grp) - 1 for grp in g.ties)


# -- conservative descriptions ---------------------------------------------------------
def test_an_undescribed_primitive_is_described_conservatively_and_listed():
    """No handler: one operator whose every dimension is fixed, reading its operands whole, listed with its
    name-stack path and why, and announced by a warning (the trace does not fail)."""
    from shardplan.jax.lower import ConservativeWarning

    with pytest.warns(ConservativeWarning, match=r"primitive 'cholesky' in 'block'"):
        g, info = trace(cholesky, P, B)
    [c] = info.conservative
    assert (c.operator, c.target, c.module) == ("block/cholesky", "cholesky", "block")
    assert c.reason.startswith("no handler for this primitive (at ") and "test_jax_constructs.py" in c.reason
    op = g[c.operator]
    assert op.kind == "cholesky" and op.fixed == set(op.dim_names) and [e for _, e in op.dims] == [16, 16]
    assert all(a.dim is None for t in op.inputs for a in t.axes)


def test_control_flow_and_refused_arguments_are_listed():
    """``cond`` (its body is not described) and a handler refusing its arguments (a convolution with
    batch_group_count 2) are conservative too; a fully described program lists nothing."""
    _, info = trace(cond, P, B)
    assert [(c.operator, c.target, c.module, c.reason) for c in info.conservative] == \
        [("cond", "cond", "<top>", "control flow: its body is not described")]

    def grouped(p, b):
        w = jnp.concatenate([p["cw"], p["cw"]], axis=2)  # 3x3, 8 in, 8 out
        y = jax.lax.conv_general_dilated(jnp.concatenate([b["img"], b["img"]], 3), w, (1, 1), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"), batch_group_count=2)
        return jnp.sum(y ** 2)

    _, info = trace(grouped, P, B)
    [c] = info.conservative
    assert c.target == "conv_general_dilated"
    assert c.reason.startswith("conv_general_dilated at ") and c.reason.endswith("with batch_group_count 2 is not "
                                                                                 "supported")
    assert trace(embed, P, B)[1].conservative == ()


def test_the_plan_its_json_and_its_report_list_them():
    import shardplan.jax as sj
    from shardplan import Plan

    b = {"x": B["x"]}  # sj.plan reads the batch from every data leaf's axis 0
    p = sj.plan(cholesky, P, b, DEVICES, TOY)
    assert [(c.operator, c.target, c.module) for c in p.conservative] == [("block.cholesky", "cholesky", "block")]
    assert p.conservative[0].operator in p.operators
    q = Plan.from_json(p.to_json())
    assert q.conservative == p.conservative and q.to_dict()["conservative"][0]["target"] == "cholesky"
    text = sj.report(q, operators=False)
    assert "Described conservatively (1; not split, operands gathered):" in text
    assert any(line.split()[:3] == ["cholesky", "block", "no"] for line in text.splitlines())
    run = sj.planned(cholesky, P, b, DEVICES, TOY)
    assert "Described conservatively (1;" in sj.report(run, operators=False)
    assert "Described conservatively" not in sj.report(sj.planned(embed, P, B, DEVICES, TOY), operators=False)
