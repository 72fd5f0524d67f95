"""A redistribution run in the export's steps: XLA sends exactly the bytes the edge cost charges, forward and
backward, on 8 simulated CPU devices (see conftest.py); the values are unchanged."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from shardplan import ops  # noqa: E402
from shardplan.cost.edge import edge_volumes  # noqa: E402
from shardplan.ir import GraphBuilder  # noqa: E402
from shardplan.jax.hlo import parse_collectives  # noqa: E402
from shardplan.jax.run import constrain_read  # noqa: E402
from shardplan.jax.shardings import layout_sharding, reshard_chain, sharding_bits  # noqa: E402
from shardplan.layout import Layout, LayoutArrays  # noqa: E402
from conftest import require_8_devices  # noqa: E402

SHAPE = (8, 4, 4, 64)

# (producer config, nesting order) -> (consumer config, order): the MNIST CNN's and T5's edges that were outside
# +-10 %, one bit to three axes, and a same-split change of bits (a permute)
PAIRS = [
    (((4, 1, 1, 2), (0, 3)), ((1, 4, 1, 1), (1,))),
    (((1, 4, 1, 2), (1, 3)), ((8, 1, 1, 1), (0,))),
    (((8, 1, 1, 1), (0,)), ((2, 2, 2, 1), (0, 1, 2))),
    (((2, 1, 1, 4), (0, 3)), ((1, 1, 1, 8), (3,))),
]


@pytest.fixture(scope="module")
def pair():
    b = GraphBuilder("pair")
    x = b.input("x", SHAPE, needs_grad=True)
    u = ops.elementwise("u", x)
    v = ops.elementwise("v", b.add(u))
    return u, v


def _sent(hlo: str) -> float:
    return sum(c.sent for c in parse_collectives(hlo) if c.sent > 0)


@pytest.mark.parametrize("src,dst", PAIRS)
def test_steps_send_what_the_edge_cost_charges(pair, src, dst):
    require_8_devices()
    u, v = pair
    devices = jax.devices()[:8]
    lu, lv = Layout.flat(u.dim_names, src[0], 8, src[1]), Layout.flat(u.dim_names, dst[0], 8, dst[1])
    f, b = edge_volumes(u, LayoutArrays.stack([lu]), v, 0, LayoutArrays.stack([lv]), 8, steps=True)
    s_in, s_out = layout_sharding(lu, u.dim_names, devices), layout_sharding(lv, u.dim_names, devices)
    assert sharding_bits(s_in, 4, devices) is not None
    hook = constrain_read(s_in, s_out, devices)

    def fwd(x):
        return hook(jax.lax.with_sharding_constraint(x, s_in)) * 2.0

    shape = jax.ShapeDtypeStruct(SHAPE, jnp.float32)
    hlo = jax.jit(fwd, in_shardings=s_in, out_shardings=s_out).lower(shape).compile().as_text()
    assert _sent(hlo) == float(f[0, 0]) * 4

    def loss(x):  # forward and backward: the cotangent goes back in the reverse steps
        return jnp.sum(jax.lax.with_sharding_constraint(hook(x), s_out) ** 2)

    grad = jax.jit(jax.grad(loss), in_shardings=s_in, out_shardings=s_in)
    hlo = grad.lower(shape).compile().as_text()
    # forward steps + backward steps; the loss's own all-reduce of one scalar is not a redistribution
    assert _sent(hlo) - sum(c.sent for c in parse_collectives(hlo) if c.kind == "all-reduce") \
        == float(f[0, 0] + b[0, 0]) * 4
    x = jnp.arange(np.prod(SHAPE), dtype=jnp.float32).reshape(SHAPE) / 1e4
    np.testing.assert_allclose(np.asarray(grad(x)), np.asarray(2 * x), rtol=1e-6)


def test_no_chain_for_one_step_or_equal_shardings(pair):
    require_8_devices()
    u, _ = pair
    devices = jax.devices()[:8]
    a = layout_sharding(Layout.flat(u.dim_names, (2, 1, 1, 1), 8, (0,)), u.dim_names, devices)
    c = layout_sharding(Layout.flat(u.dim_names, (1, 2, 1, 1), 8, (1,)), u.dim_names, devices)
    assert reshard_chain(a, a, SHAPE, devices) is None
    assert reshard_chain(a, c, SHAPE, devices) is None  # one all-to-all: the target constraint alone
    d = layout_sharding(Layout.flat(u.dim_names, (4, 1, 1, 2), 8, (0, 3)), u.dim_names, devices)
    e = layout_sharding(Layout.flat(u.dim_names, (1, 4, 1, 1), 8, (1,)), u.dim_names, devices)
    assert len(reshard_chain(d, e, SHAPE, devices)) == 2
