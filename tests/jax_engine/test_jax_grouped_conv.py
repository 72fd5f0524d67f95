"""Grouped convolutions on JAX: described replicated, because XLA's SPMD partitioner partitions none.

XLA (JAX 0.9.2) all-gathers a grouped convolution's split operands and computes it whole on every
device, whichever axis (batch, groups, image) the operands are split along. The frontend describes
such a convolution with every dimension fixed, so a plan keeps it replicated and its edges charge the
all-gathers XLA sends: the compiled program's bytes equal the model's with data parallelism and with the
solved plan, and the step equals the unsharded one.
"""

from __future__ import annotations

import pytest

import jax
import jax.numpy as jnp

from conftest import require_8_devices  # noqa: E402
from shardplan.baselines import baseline_plan  # noqa: E402
from shardplan.cost import build_tables  # noqa: E402
from shardplan.jax import trace  # noqa: E402
from shardplan.jax.hlo import hlo_bytes_per_device, predicted_bytes  # noqa: E402
from shardplan.jax.run import make_step  # noqa: E402
from shardplan.machine import Machine  # noqa: E402
from shardplan.spmd import solve_tables  # noqa: E402
from jax_compare import max_abs, max_abs_diff  # noqa: E402

pytestmark = pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out

DEVICES = require_8_devices()
TOY = Machine(8, peak_flops=32e9, bandwidth=16e9, name="toy")
DN = ("NHWC", "HWIO", "NHWC")
K = jax.random.split(jax.random.PRNGKey(0), 5)
P = {"pw": jax.random.normal(K[0], (1, 1, 16, 16)) * 0.3, "gw": jax.random.normal(K[1], (3, 3, 8, 16)) * 0.3,
     "dw": jax.random.normal(K[2], (16, 10)) * 0.3}
X = jax.random.normal(K[3], (8, 8, 8, 16))


def net(p, x):
    """A 1x1 convolution, a grouped 3x3 convolution (2 groups, stride 2, RegNet's bottleneck), a dense head."""
    y = jax.nn.relu(jax.lax.conv_general_dilated(x, p["pw"], (1, 1), "SAME", dimension_numbers=DN))
    y = jax.nn.relu(jax.lax.conv_general_dilated(y, p["gw"], (2, 2), ((1, 1), (1, 1)), dimension_numbers=DN,
                                                 feature_group_count=2))
    return jnp.sum(jnp.tanh(y.mean((1, 2)) @ p["dw"]) ** 2)


def test_grouped_convolution_is_described_replicated():
    g, _ = trace(net, P, X)
    convs = [op for op in g.operators if op.kind == "conv"]
    assert len(convs) == 2
    plain, grouped = convs
    assert plain.fixed == frozenset()
    assert "g" in dict(grouped.dims) and grouped.fixed == frozenset(d for d, _ in grouped.dims)


@pytest.mark.parametrize("strategy", ["data_parallel", "solved"])
def test_compiled_bytes_equal_the_model(strategy):
    graph, info = trace(net, P, X)
    tables = build_tables(graph, TOY, cutoff=1, divides_p=True)
    plan = baseline_plan("data_parallel", tables) if strategy == "data_parallel" else solve_tables(tables)
    assert any(c > 1 for c in plan.configs[next(op.name for op in graph.operators if op.kind == "conv")])
    step = make_step(plan, info, DEVICES)
    loss, grads = step(P, X)
    loss0, grads0 = jax.value_and_grad(net)(P, X)
    assert abs(float(loss) - float(loss0)) <= 1e-5 * abs(float(loss0))
    scale = max(max_abs(g) for g in jax.tree.leaves(grads0))
    for g, g0 in zip(jax.tree.leaves(grads), jax.tree.leaves(grads0)):
        assert max_abs_diff(g, g0) <= 1e-4 * scale
    got = hlo_bytes_per_device(step.lower(P, X).compile().as_text())["total"]
    want = predicted_bytes(plan)["total"]
    if strategy == "data_parallel":
        assert got == want == 28672 + 7168 + 4 * (16 * 16 + 16 * 10 + 1) * 2 * 7 / 8  # x, dy gathered; pw, dw, loss all-reduced
    else:
        # the grouped convolution's input gathered (28672 B) as the model charges; the scalar loss, a sum split
        # over 2 x 2 devices, all-reduced in two steps of 2 (8 B), as the model charges (Machine.reduce_per_dim)
        assert got == want
