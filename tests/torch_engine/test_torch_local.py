"""Every layout the frontend offers for an operator DTensor has no sharding strategy for runs, and gives the
unsharded loss and gradients (4 gloo processes).

An operator a library defines itself (transformers' ``grouped_mm_fallback``, a user's ``torch.library``
op) has no DTensor strategy; described by a handler, it runs on each device's tiles as planned
(:func:`shardplan.torch.run.local_placements`): here an elementwise one and a sum over the last axis, whose
split gives partial sums. DTensor (torch 2.13) has no strategy for the in-place ``triu_``/``hardswish_``
either; they run as their functional forms, as does ``index_put_`` (DTensor runs ``index_put`` on tiles
split along the axes it does not index, as the frontend describes it; the run lays the destination out as
planned, which the cost model charges, and gathers nothing). For each such operator of a small module,
every layout of the cost tables (each split and nesting on 4 devices, the other operators replicated) is
run once and compared with one process; the runs on tiles are counted.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch_cases  # noqa: E402  (tests/ is on sys.path, see conftest.py)
from torch import nn

from shardplan.torch import HANDLERS

pytestmark = pytest.mark.slow

WORLD = 4


@torch.library.custom_op("shardplan_test::softsign", mutates_args=())
def softsign(x: torch.Tensor) -> torch.Tensor:
    return x / (1.0 + x.abs())


@softsign.register_fake
def _(x):
    return torch.empty_like(x)


def _softsign_backward(ctx, g):
    (x,) = ctx.saved_tensors
    return g / (1.0 + x.abs()) ** 2


softsign.register_autograd(_softsign_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[0]))


@torch.library.custom_op("shardplan_test::rowsum", mutates_args=())
def rowsum(x: torch.Tensor, dim: list[int], keepdim: bool) -> torch.Tensor:
    return x.sum(dim, keepdim=keepdim)


@rowsum.register_fake
def _(x, dim, keepdim):
    return x.sum(dim, keepdim=keepdim)


def _rowsum_backward(ctx, g):
    return g.unsqueeze(-1).expand(ctx.shape), None, None


def _rowsum_context(ctx, inputs, output):
    ctx.shape = inputs[0].shape


rowsum.register_autograd(_rowsum_backward, setup_context=_rowsum_context)

# described as the ATen ops they compute
OWN = {"shardplan_test.softsign.default": HANDLERS["aten.tanh.default"],
       "shardplan_test.rowsum.default": HANDLERS["aten.sum.dim_IntList"]}


class NoRule(nn.Module):
    """Linear layers around the operators: the library's own softsign and sum over the last axis, an
    in-place hardswish, an in-place upper triangle of a (tokens x tokens) score matrix, an in-place
    ``index_put_`` writing two of its rows."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.kv = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.register_buffer("rows", torch.tensor([3, 1]))
        self.register_buffer("bias", torch.randn(8, 1, 4, 4, generator=torch.Generator().manual_seed(32)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.ops.shardplan_test.softsign(self.fc1(x))     # (8, 4, 16)
        r = torch.ops.shardplan_test.rowsum(h * h, [-1], False)  # (8, 4)
        h = nn.functional.hardswish(2.0 * h, inplace=True)
        s = torch.matmul(h, self.fc2(h).transpose(1, 2)).triu_()  # (8, 4, 4)
        s[:, self.rows] = 0.5 * s[:, :2]
        q = h.view(8, 4, 4, 4).transpose(1, 2)                   # (8, 4 heads, 4, 4)
        k, v = self.kv(x).view(8, 4, 2, 8).transpose(1, 2).chunk(2, dim=-1)  # 2 K/V heads
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        b = nn.functional.scaled_dot_product_attention(a, q, q, attn_mask=self.bias)
        return (s ** 2).mean() + (r ** 2).mean() + (b ** 2).mean()


# FX node names: the grouped-query causal attention and the one with an additive mask of batch x queries x keys
TARGETS = ["softsign", "rowsum", "hardswish_", "triu_", "index_put_", "scaled_dot_product_attention",
           "scaled_dot_product_attention_1"]
LOCAL = {"softsign", "rowsum"}  # without a DTensor strategy


def _case() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(31)
    return NoRule(), torch.randn(8, 4, 16, generator=torch.Generator().manual_seed(31))


def run_layouts(name: str, world: int) -> dict[str, Any]:
    """On this rank: every layout of the operator whose node is ``name``, each run against one process."""
    import numpy as np
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    from shardplan.cost import build_tables
    from shardplan.spmd import plan_from_configs
    from shardplan.torch import run, trace
    from shardplan.torch.run import parallel_module

    model, x = _case()
    ref = torch_cases._clone(model)
    loss0 = ref(x)
    loss0.backward()
    grads0 = {n: p.grad for n, p in ref.named_parameters()}
    graph, info = trace(model, (x,), handlers={**HANDLERS, **OWN})
    mesh = init_device_mesh("cpu", (world,))
    tables = build_tables(graph, torch_cases.toy_machine(world), cutoff=1)
    target = next(i for i, op in enumerate(graph.operators) if op.name == info.node_op[name])
    op = graph.operators[target]
    rows = []
    for layout in tables.layouts[target]:
        configs = {o.name: (1,) * len(o.dims) for o in graph.operators}
        configs[op.name] = layout
        pm = parallel_module(torch_cases._clone(model), (x,), None, info, plan_from_configs(tables, configs), mesh)
        real, calls = pm._local_call, [0]

        def counted(*a: Any, real: Any = real, calls: list = calls) -> Any:
            calls[0] += 1
            return real(*a)

        pm._local_call = counted
        put, moves = run._REWRITES["aten.index_put_.default"], [0]

        def watched(*a: Any, put: Any = put, moves: list = moves) -> Any:  # collectives inside the operator
            with CommDebugMode() as comm:
                out = put(*a)
            moves[0] += comm.get_total_counts()
            return out

        run._REWRITES["aten.index_put_.default"] = watched
        try:
            loss = pm(x)
        finally:
            run._REWRITES["aten.index_put_.default"] = put
        loss.backward()
        named = pm.named_dparameters()
        worst = max(float((named[n].grad.full_tensor() - g).abs().max() / g.abs().max()) for n, g in grads0.items())
        rows.append({"split": list(layout.split), "rel_loss": abs(float(loss) - float(loss0)) / abs(float(loss0)),
                     "rel_grad": worst, "local": calls[0], "moves": moves[0]})
    return {"rows": rows, "fixed": sorted(op.fixed), "dims": [d for d, _ in op.dims],
            "splits": sorted({tuple(int(c) for c in np.asarray(lay.split)) for lay in tables.layouts[target]})}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("local") / "results.json"
    return torch_cases.run_distributed(list(TARGETS), WORLD, str(out), run_layouts)


@pytest.mark.parametrize("name", list(TARGETS))
def test_every_offered_layout_runs_as_unsharded(results, name):
    r = results[name]
    assert "error" not in r, r.get("error")
    assert len(r["rows"]) > 1 and any(max(row["split"]) > 1 for row in r["rows"])
    for row in r["rows"]:
        assert row["rel_loss"] <= 1e-5 and row["rel_grad"] <= 1e-4, row
        assert row["local"] == len(LOCAL), row  # the library's two operators ran on tiles, nothing else did


def test_the_triangle_keeps_its_matrix_whole_and_splits_the_batch(results):
    r = results["triu_"]
    assert r["fixed"] == r["dims"][-2:]
    assert any(split[0] == 4 for split in r["splits"])


def test_the_sum_splits_its_reduced_axis_too(results):
    r = results["rowsum"]
    assert r["fixed"] == []
    assert {s for s in map(tuple, r["splits"]) if max(s) == 4} == {(4, 1, 1), (1, 4, 1), (1, 1, 4)}


def test_index_put_splits_its_kept_axes_and_moves_nothing(results):
    """``s[:, rows] = v``: the written axis and the index axis fixed, the batch and columns split; on every
    offered layout DTensor runs it on the planned tiles (its operands laid out by the run as the cost model
    charges), with no collective inside the operator."""
    r = results["index_put_"]
    dims = r["dims"]  # rows, written axis, columns, index
    assert r["fixed"] == sorted([dims[1], dims[3]])
    assert {s for s in map(tuple, r["splits"]) if max(s) == 4} == {(4, 1, 1, 1), (1, 1, 4, 1)}
    assert [row["moves"] for row in r["rows"]] == [0] * len(r["rows"])


@pytest.mark.parametrize("name, kv_heads", [("scaled_dot_product_attention", 2), ("scaled_dot_product_attention_1", 4)])
def test_attention_splits_batch_heads_and_queries(results, name, kv_heads):
    """The fused core's dims ``b h [r] s k t``: the keys, the features and (grouped-query attention, 4 query
    heads over 2 K/V heads) the query heads of one K/V head fixed. Each of batch and queries split 4 ways,
    the K/V heads as far as they go, and two of them 2 x 2, is offered and ran (above)."""
    r = results[name]
    dims = r["dims"]
    assert r["fixed"] == sorted(d for d in dims if d in ("r", "k", "t"))

    def split(**ways: int) -> tuple[int, ...]:
        return tuple(ways.get(d, 1) for d in dims)

    four = {s for s in map(tuple, r["splits"]) if max(s) == 4}
    assert four == {split(b=4), split(s=4)} | ({split(h=4)} if kv_heads == 4 else set())
    assert {split(b=2, h=2), split(b=2, s=2), split(h=2, s=2)} <= set(map(tuple, r["splits"]))
