"""The staged program on 8 simulated devices equals the unsharded one (loss and gradients)."""

from __future__ import annotations

import numpy as np
import pytest

import jax

from conftest import require_8_devices  # noqa: E402
from shardplan.errors import ShardplanError  # noqa: E402
from shardplan.jax.staged import pipeline_forward, stack_stages  # noqa: E402
from jax_compare import max_abs, max_abs_diff  # noqa: E402

pytestmark = pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out


def _layer(p, x):
    import jax.numpy as jnp

    return jnp.tanh(x @ p["w"] + p["b"]) + x


def _setup(layers: int, m: int, mb: int, d: int):
    rng = np.random.default_rng(0)
    params = [{"w": rng.normal(size=(d, d)).astype(np.float32) / np.sqrt(d),
               "b": rng.normal(size=(d,)).astype(np.float32) * 0.1} for _ in range(layers)]
    xs = rng.normal(size=(m, mb, d)).astype(np.float32)
    ys = rng.normal(size=(m, mb, d)).astype(np.float32)
    return params, xs, ys


@pytest.mark.parametrize("stages,data", [(4, 2), (8, 1)])
def test_pipeline_equals_unsharded(stages, data):
    import jax.numpy as jnp
    from jax.sharding import Mesh

    if len(jax.devices()) < 8:
        pytest.fail("conftest sets 8 simulated CPU devices; got fewer")
    params, xs, ys = _setup(8, 4, 4, 16)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(stages, data), ("stage", "data"))

    def loss_ref(ps):
        h = xs.reshape(-1, xs.shape[-1])
        for p in ps:
            h = _layer(p, h)
        return jnp.mean((h - ys.reshape(h.shape)) ** 2)

    def loss_pipe(stacked):
        out = pipeline_forward(_layer, stacked, xs, mesh, "stage", "data" if data > 1 else None)
        return jnp.mean((out - ys) ** 2)

    ref_l, ref_g = jax.value_and_grad(loss_ref)(params)
    stacked = stack_stages(params, stages)
    pipe_l, pipe_g = jax.jit(jax.value_and_grad(loss_pipe))(stacked)
    assert abs(float(pipe_l) - float(ref_l)) <= 1e-5 * abs(float(ref_l))
    want = stack_stages(ref_g, stages)
    for k in ("w", "b"):
        scale = float(np.abs(want[k]).max())
        assert float(np.abs(np.asarray(pipe_g[k]) - np.asarray(want[k])).max()) <= 1e-4 * scale


def test_uneven_stages_refused():
    params, _, _ = _setup(6, 1, 1, 4)
    with pytest.raises(ShardplanError, match="equal stages"):
        stack_stages(params, 4)


# ---------------------------------------------------------------------------
# the searched plan drives the execution (shardplan.jax.staged.pipeline)
# ---------------------------------------------------------------------------
V, D, L, B, T = 32, 16, 4, 16, 4


def _gpt_params(seed: int = 0, tied: bool = False):
    import jax.numpy as jnp

    r = np.random.default_rng(seed)

    def n(*s):
        return jnp.asarray(r.normal(size=s).astype(np.float32) / np.sqrt(s[0]))

    head = {} if tied else {"head": n(D, V)}
    return {"embed": n(V, D), **head,
            "blocks": [{"w1": n(D, 2 * D), "w2": n(2 * D, D), "g": jnp.asarray(1 + 0.1 * r.normal(size=D),
                                                                              dtype=jnp.float32)}
                       for _ in range(L)]}


def _gpt_loss(p, batch):
    """A tiny pre-norm residual language model: embedding, L blocks (RMS norm, MLP), head, cross-entropy."""
    import jax.numpy as jnp

    ids, y = batch
    with jax.named_scope("embed"):
        h = p["embed"][ids]
    for i, blk in enumerate(p["blocks"]):
        with jax.named_scope(f"L{i}"):
            z = h * blk["g"] / jnp.sqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6)
            h = h + jnp.tanh(z @ blk["w1"]) @ blk["w2"]
    with jax.named_scope("head"):
        lp = jax.nn.log_softmax(h @ (p["head"] if "head" in p else p["embed"].T))
        return -jnp.mean(jnp.take_along_axis(lp, y[..., None], -1))


def _tokens():
    import jax.numpy as jnp

    r = np.random.default_rng(1)
    return jnp.asarray(r.integers(0, V, (B, T))), jnp.asarray(r.integers(0, V, (B, T)))


def _toy(p: int = 8):
    from shardplan.machine import Machine

    return Machine(p, peak_flops=32e9, bandwidth=16e9, latency=0.0, name="toy")


def _assert_equal_to_unsharded(step, loss_fn, params, batch):
    import jax.numpy as jnp

    loss, grads = step(params, batch)
    ref_l, ref_g = jax.value_and_grad(loss_fn)(params, batch)
    assert abs(float(loss) - float(ref_l)) <= 1e-5 * abs(float(ref_l))
    got, want = jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref_g)
    assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(ref_g)
    scale = max(max_abs(w) for w in want)
    assert max(max_abs_diff(g, w) for g, w in zip(got, want)) <= 1e-4 * scale


def _assert_stage_layouts(step):
    """Each stage's parameters and batch leaves live on its sub-mesh, laid out as its intra-stage plan's first
    reader asks; some are split."""
    from shardplan.jax.shardings import layout_sharding

    devices = list(step.devices)
    split = 0
    for st in step.stages:
        s = st.spec
        want = set(devices[s.offset:s.offset + s.devices])
        names = {op.name for op in st.plan.graph.operators}
        for i in st.params + st.data:
            sh = st.leaf_sh[i]
            uses = [(n, d) for n, d in step.info.leaf_uses.get(i, ()) if n in names]
            if uses:
                assert sh == layout_sharding(st.plan.layouts[uses[0][0]], uses[0][1], sh.mesh.devices.flat)
            assert set(sh.device_set) == want
            split += any(ax is not None for ax in sh.spec)
    assert split > 0, "the toy machine makes splitting pay: some leaf must be split inside its stage"


def test_searched_1f1b_plan_runs_non_uniform_stages():
    """Sub-meshes of 2 devices: 4 stages over 6 units (embedding, 4 blocks, head), so stages differ."""
    from shardplan.jax.staged import pipeline

    require_8_devices()
    params, batch = _gpt_params(), _tokens()
    step = pipeline(_gpt_loss, params, batch, machine=_toy(), sizes=(2,), micro_batches=(4,))
    plan = step.plan
    assert step.result.unit_names() == ["embed", "L0", "L1", "L2", "L3", "head"]
    assert plan.schedule == "1f1b" and plan.micro_batches == 4 and plan.num_stages == 4
    assert len({s.end - s.first for s in plan.stages}) > 1, "the stages should not all hold as many units"
    assert [(s.offset, s.devices) for s in plan.stages] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    _assert_stage_layouts(step)
    _assert_equal_to_unsharded(step, _gpt_loss, params, batch)
    with pytest.raises(ShardplanError, match="micro-batches of"):
        step(params, (batch[0][:8], batch[1][:8]))


def test_issue_order_is_the_schedules_per_stage_order():
    """GPipe's order, and a head tied to the embedding (one parameter read in the first and the last stage)."""
    from shardplan.jax.staged import pipeline
    from shardplan.pipeline.schedule import _order

    require_8_devices()
    params, batch = _gpt_params(tied=True), _tokens()
    step = pipeline(_gpt_loss, params, batch, machine=_toy(), sizes=(4,), micro_batches=(4,), schedule="gpipe")
    n = step.plan.num_stages
    assert n == 2
    for s in range(n):
        mine = [(k, j) for k, i, j in step.order() if i == s]
        assert mine == [(k, j) for k, j, _ in _order(s, n, 4, "gpipe", 1)]
    embed = len(jax.tree_util.tree_leaves(params["blocks"]))  # leaves in key order: blocks, then embed
    assert [embed in st.params for st in step.stages] == [True, True]
    _assert_equal_to_unsharded(step, _gpt_loss, params, batch)


def test_searched_interleaved_plan_runs():
    from shardplan.jax.staged import pipeline

    require_8_devices()
    params, batch = _gpt_params(), _tokens()
    step = pipeline(_gpt_loss, params, batch, machine=_toy(), sizes=(4,), interleave=(2,),
                    schedules=("interleaved",), micro_batches=(2,))
    plan = step.plan
    assert plan.schedule == "interleaved" and plan.chunks == 2 and plan.num_stages == 4
    assert [s.offset for s in plan.stages] == [0, 4, 0, 4]  # chunk c of group d is stage c S + d
    _assert_stage_layouts(step)
    _assert_equal_to_unsharded(step, _gpt_loss, params, batch)


def test_searched_zb_h1_plan_runs():
    """ZB-H1 (searched alone): its passes issued in ZB-H1's per-stage order of forwards and backwards (each
    backward whole: XLA's vjp computes the input and the weight gradients together)."""
    from shardplan.jax.staged import pipeline
    from shardplan.pipeline.schedule import _order

    require_8_devices()
    params, batch = _gpt_params(), _tokens()
    step = pipeline(_gpt_loss, params, batch, machine=_toy(), sizes=(2,), schedules=("zb-h1",), micro_batches=(4,))
    plan = step.plan
    assert plan.schedule == "zb-h1" and plan.micro_batches >= plan.num_stages >= 2
    n = plan.num_stages
    for s in range(n):
        mine = [(k, j) for k, i, j in step.order() if i == s]
        assert mine == [(k, j) for k, j, _ in _order(s, n, plan.micro_batches, "zb-h1", 1) if k != "W"]
    _assert_equal_to_unsharded(step, _gpt_loss, params, batch)


def test_flax_model_units_are_its_submodules():
    import flax.linen as nn
    import jax.numpy as jnp

    from shardplan.jax.staged import pipeline

    require_8_devices()

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x + nn.Dense(x.shape[-1])(jnp.tanh(nn.Dense(2 * x.shape[-1])(x)))

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(16, name="embed")(x)
            for i in range(3):
                x = Block(name=f"L{i}")(x)
            return nn.Dense(4, name="head")(x)

    model = Model()
    r = np.random.default_rng(2)
    batch = (jnp.asarray(r.normal(size=(16, 8)), dtype=jnp.float32), jnp.asarray(r.normal(size=(16, 4)),
                                                                                   dtype=jnp.float32))
    params = model.init(jax.random.PRNGKey(0), batch[0])

    def loss_fn(p, b):
        return jnp.mean((model.apply(p, b[0]) - b[1]) ** 2)

    step = pipeline(loss_fn, params, batch, machine=_toy(), sizes=(4,), micro_batches=(2,))
    assert step.result.unit_names()[:4] == ["embed", "L0", "L1", "L2"]
    assert step.plan.num_stages == 2
    _assert_equal_to_unsharded(step, loss_fn, params, batch)


def test_bad_pipeline_requests_refused():
    from shardplan.jax.staged import pipeline

    require_8_devices()
    params, batch = _gpt_params(), _tokens()
    with pytest.raises(ShardplanError, match="reduction"):
        pipeline(_gpt_loss, params, batch, machine=_toy(), sizes=(4,), micro_batches=(2,), reduction="max")
    with pytest.raises(ShardplanError, match="cannot run"):
        pipeline(_gpt_loss, params, batch, machine=_toy(), sizes=(4,), micro_batches=(2,), schedule="interleaved")
