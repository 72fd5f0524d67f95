"""Partial sums over several split dims: XLA reduces them one split dim at a time, and the model charges that.

For each case an operator is laid out on 8 simulated devices (a mesh axis per split dim, the rest a replica
axis, as the export builds it), its forward product and both gradients (``jax.vjp``) are compiled with the
operands, the output and the gradients in that layout, and the bytes each device sends in the compiled HLO
are compared with the operator's charge (``OpCost.comm_bytes``). XLA (JAX 0.9.2) emits one all-reduce of the
whole tile per split reduced dim, among that dim's devices; ``Machine.reduce_per_dim`` charges exactly that,
and the PaSE model's one all-reduce among the product of the groups charges less whenever two or more
reduced dims are split (docs/jax.md, "Partial sums over several split dims").
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from conftest import require_8_devices
from shardplan import ops
from shardplan.cost.operator import operator_cost
from shardplan.ir import TensorRef
from shardplan.jax.hlo import parse_collectives
from shardplan.machine import Machine

pytestmark = pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out

DEVICES = require_8_devices()
TOY = Machine(8, peak_flops=32e9, bandwidth=16e9, name="toy")
PASE = dataclasses.replace(TOY, reduce_per_dim=False)

W_K, W_N = 64, 32  # the weight of the products below: 64 x 32 float32, 8192 B

# (name, equation, input shape, weight shape, splits, all-reduces XLA emits as (group, bytes), PaSE's charge)
CASES = [
    # the weight gradient sums over b and s: two all-reduces of 2 (BLOOM's MLP weights)
    ("wgrad b2 s2", "bsk,kn->bsn", (8, 8, W_K), (W_K, W_N), {"b": 2, "s": 2}, [(2, 8192), (2, 8192)], 12288),
    # one dim split 4: one all-reduce of 4, as the PaSE model charges
    ("wgrad b4", "bsk,kn->bsn", (8, 8, W_K), (W_K, W_N), {"b": 4}, [(4, 8192)], 12288),
    # the weight gradient's output split (n): the two all-reduces of its half tile
    ("wgrad b2 s2, dW split n2", "bsk,kn->bsn", (8, 8, W_K), (W_K, W_N), {"b": 2, "s": 2, "n": 2},
     [(2, 4096), (2, 4096), (2, 8 * 8 * W_K // 4 * 4)], 6144 + 4096),
    # three split dims: three all-reduces of 2
    ("wgrad b2 s2 t2", "bstk,kn->bstn", (4, 4, 4, W_K), (W_K, W_N), {"b": 2, "s": 2, "t": 2},
     [(2, 8192)] * 3, 14336),
    # a split dim of 2 and one of 4: an all-reduce of 2 and one of 4
    ("wgrad b2 s4", "bsk,kn->bsn", (8, 8, W_K), (W_K, W_N), {"b": 2, "s": 4}, [(2, 8192), (4, 8192)], 14336),
    # a forward product contracting two split dims: the output tile all-reduced twice
    ("forward s2 k2", "msk,skn->mn", (16, 8, W_K), (8, W_K, W_N), {"s": 2, "k": 2},
     [(2, 16 * W_N * 4), (2, 16 * W_N * 4)], 3072),
]


def _spec(letters: str, splits: dict[str, int]) -> PartitionSpec:
    return PartitionSpec(*(ch if ch in splits else None for ch in letters))


def _mesh(op, splits: dict[str, int]) -> Mesh:
    names = [d for d in op.dim_names if d in splits]
    shape = [8 // int(np.prod([splits[d] for d in names]))] + [splits[d] for d in names]
    return Mesh(np.asarray(DEVICES, dtype=object).reshape(shape), ("_rep", *names))


def _compiled(f, mesh: Mesh, in_specs, out_specs, shapes) -> list:
    ins = [NamedSharding(mesh, s) for s in in_specs]
    outs = tuple(NamedSharding(mesh, s) for s in out_specs)
    args = [jax.device_put(jnp.ones(s, jnp.float32), sh) for s, sh in zip(shapes, ins)]
    text = jax.jit(f, in_shardings=ins, out_shardings=outs).lower(*args).compile().as_text()
    return parse_collectives(text)


def _charge(op, splits: dict[str, int], machine: Machine) -> float:
    row = np.asarray([[splits.get(d, 1) for d in op.dim_names]])
    return float(operator_cost(op, row, machine).comm_bytes[0])


@pytest.mark.parametrize("name,eq,xs,ws,splits,want,pase", CASES, ids=[c[0] for c in CASES])
def test_product_compiled_bytes_equal_the_charge(name, eq, xs, ws, splits, want, pase):
    op = ops.einsum("p", eq, TensorRef("x", xs), ops.Param(ws))
    lhs, out = eq.split("->")
    xl, wl = lhs.split(",")

    def f(x, w, dy):
        y, vjp = jax.vjp(lambda a, b: jnp.einsum(eq, a, b), x, w)
        return (y, *vjp(dy))

    ys = tuple(dict(zip(xl + wl, xs + ws))[ch] for ch in out)
    mesh = _mesh(op, splits)
    specs = [_spec(xl, splits), _spec(wl, splits), _spec(out, splits)]
    got = _compiled(f, mesh, specs, [specs[2], specs[0], specs[1]], [xs, ws, ys])
    assert sorted((c.kind, c.group, c.nbytes) for c in got) == sorted(("all-reduce", g, float(n)) for g, n in want)
    sent = sum(c.sent for c in got)
    assert sent == sum(2 * (g - 1) / g * n for g, n in want)
    assert _charge(op, splits, TOY) == sent
    assert _charge(op, splits, PASE) == pase


@pytest.mark.parametrize("splits,want", [({"b": 2, "s": 2}, [2, 2]), ({"b": 2, "s": 2, "h": 2}, [2, 2, 2]),
                                         ({"b": 4, "s": 2}, [4, 2])], ids=["b2 s2", "b2 s2 h2", "b4 s2"])
def test_sum_compiled_bytes_equal_the_charge(splits, want):
    """A mean over every dim of a split tensor: one all-reduce of the 4-byte result per split dim."""
    shape = (8, 8, 4)
    op = ops.reduce_mean("m", TensorRef("x", shape), axes=(0, 1, 2))
    letters = "".join(op.dim_names)
    names = {"b": letters[0], "s": letters[1], "h": letters[2]}
    split = {names[k]: v for k, v in splits.items()}

    def f(x, dy):
        y, vjp = jax.vjp(jnp.mean, x)
        return (y, *vjp(dy))

    mesh = _mesh(op, split)
    got = _compiled(f, mesh, [_spec(letters, split), PartitionSpec()], [PartitionSpec(), _spec(letters, split)],
                    [shape, ()])
    assert sorted(c.group for c in got) == sorted(want) and all(c.kind == "all-reduce" and c.nbytes == 4 for c in got)
    sent = sum(c.sent for c in got)
    assert _charge(op, split, TOY) == sent == sum(2 * (g - 1) / g * 4 for g in want)
    assert _charge(op, split, PASE) == 2 * (np.prod(want) - 1) / np.prod(want) * 4
