"""PyTorch frontend and layout, in one process (the distributed runs are in test_torch_dist.py)."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest

import torch
from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from shardplan import ops  # noqa: E402
from shardplan.errors import ShardplanError  # noqa: E402
from shardplan.ir import TensorRef  # noqa: E402
from shardplan.machine import Machine  # noqa: E402
from shardplan.spmd import solve  # noqa: E402
from shardplan.torch import ShardplanWarning, mesh_dims, mesh_factors, tensor_placements, trace  # noqa: E402


class _Lin(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 32)

    def forward(self, x):
        return self.fc(x).sum()


def test_import_shardplan_does_not_load_torch():
    code = "import sys, shardplan, shardplan.torch; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_linear_is_the_einsum_description_with_weight_and_bias():
    g, info = trace(_Lin(), (torch.ones(8, 16),))
    op = g["fc/linear"]
    ref = ops.einsum("ref", "ac,nc->an", TensorRef("x", (8, 16), is_input=True, needs_grad=False), ops.Param((32, 16)))
    assert op.dims == ref.dims == (("a", 8), ("n", 32), ("c", 16))
    assert op.reduction_dims == ("c",)
    assert [w.name for w in op.weights] == ["w1", "bias"]
    assert [a.dim for a in op.weights[0].axes] == ["n", "c"] and [a.dim for a in op.weights[1].axes] == ["n"]
    assert info.param_uses == {"fc.weight": (("fc/linear", "w1"),), "fc.bias": (("fc/linear", "bias"),)}
    assert info.operands["fc/linear"] == (((0,), "x0"), ((1,), "w1"), ((2,), "bias"))
    assert [o.kind for o in g.operators] == ["linear", "sum"]
    # the bias is added to the product's result: outside the contraction, its gradient a reduction of dY
    assert [t.name for t in op.epilogue_tensors] == ["bias"] and op.passes == 2.0  # forward + dW (x: no grad)


def test_grouped_convolution_splits_only_the_batch():
    conv = nn.Conv2d(8, 16, 3, stride=2, padding=1, groups=4, bias=False)
    g, _ = trace(conv, (torch.ones(2, 8, 16, 16),))
    (op,) = g.operators
    assert op.extents == {"b": 2, "g": 4, "c": 2, "h": 8, "w": 8, "n": 4, "r": 3, "s": 3}
    assert set(op.reduction_dims) == {"c", "r", "s"}
    assert op.fixed == frozenset({"g", "c", "h", "w", "n", "r", "s"})
    x = op.inputs[0]
    assert x.axes[1].dim == "g" and x.axes[1].inner == ("c",)
    assert x.axes[2].window == "r" and x.axes[2].stride == 2 and x.axes[2].offset == -1


def test_attention_norm_and_constants():
    class Attn(nn.Module):
        def forward(self, q, k, v):
            pos = torch.arange(q.shape[2]).float()  # a constant: no operator
            return F.scaled_dot_product_attention(q + pos[:, None], k, v, is_causal=True)

    q = torch.ones(2, 4, 8, 16)
    g, info = trace(Attn(), (q, q, q))
    kinds = [op.kind for op in g.operators]
    assert kinds == ["add", "attn_flash"]  # the fused kernel (shardplan.ops.flash_attention)
    att = g.operators[1]
    assert att.extents == {"b": 2, "h": 4, "s": 8, "k": 16, "t": 8}
    assert att.norm_dims == ("t",) and att.fixed == frozenset({"t", "k"})
    assert att.reduction_dims == ("t",)
    assert att.flops_per_point == pytest.approx(4 + 5 / 16) and att.backward_flops == pytest.approx(10 + 4 / 16)
    assert att.causal is not None and (att.causal.query, att.causal.key) == ("s", "t")
    assert len(info.const_nodes) >= 1


def test_parameters_are_weights_and_buffers_are_constants():
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    g, info = trace(m, (torch.ones(8, 4),))
    bn = g.operators[1]
    assert bn.kind == "batch_norm" and bn.norm_dims == ("a",)
    assert sorted(t.name for t in bn.weights) == ["w1", "w2"]  # gamma and beta; running stats are buffers
    assert set(info.param_uses) == {"0.weight", "0.bias", "1.weight", "1.bias"}


class _Inner(nn.Module):
    """An operator no handler describes (``logcumsumexp``), in a module named ``inner``."""

    def forward(self, h):
        return torch.logcumsumexp(h, dim=-1)


class _WithUnsupported(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.inner = nn.Linear(8, 8), _Inner()

    def forward(self, x):
        return self.inner(self.fc(x)).sum()


def test_unsupported_operator_is_conservative_and_named():
    with pytest.warns(ShardplanWarning, match=r"aten\.logcumsumexp\.default in module 'inner'"):
        g, info = trace(_WithUnsupported(), (torch.ones(4, 8),))
    op = g["inner/logcumsumexp"]
    assert op.fixed == frozenset(op.dim_names)
    assert all(a.dim is None for a in op.inputs[0].axes)
    assert info.conservative == {"inner/logcumsumexp": "aten.logcumsumexp.default"}
    plan = solve(g, Machine(4), cutoff=1)  # the rest of the model is still planned
    assert plan.configs["inner/logcumsumexp"] == (1, 1)


def test_plan_json_and_report_list_the_conservative_operators():
    import shardplan.torch as st
    from shardplan import Plan
    from shardplan.result import ConservativeOp

    with pytest.warns(ShardplanWarning):
        p = st.plan(_WithUnsupported(), (torch.ones(8, 8),), machine=Machine(4), fit=False, stages=False)
    (c,) = p.conservative
    assert c == ConservativeOp(c.operator, "aten.logcumsumexp.default", "inner", "no handler registered")
    assert c.operator in p.operators and p.operators[c.operator].kind.startswith("conservative:")
    q = Plan.from_json(p.to_json())
    assert q.conservative == p.conservative and q == p
    text = st.report(p)
    assert "Described conservatively (1; not split, operands gathered):" in text
    line = next(x for x in text.splitlines() if "aten.logcumsumexp.default" in x)
    assert "inner" in line and "no handler registered" in line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        clean = st.plan(_Lin(), (torch.ones(8, 16),), machine=Machine(4), fit=False, stages=False)
    assert clean.conservative == () and "Described conservatively" not in st.report(clean)
    assert Plan.from_json(clean.to_json()).conservative == ()


def test_a_handler_can_be_registered():
    from shardplan.torch.frontend import HANDLERS, _elementwise

    class M(nn.Module):
        def forward(self, x):
            return torch.logcumsumexp(x, dim=-1).sum()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g, info = trace(M(), (torch.ones(4, 8),), handlers={**HANDLERS, "aten.logcumsumexp.default": _elementwise})
    assert g.operators[0].kind == "logcumsumexp" and not info.conservative


def test_export_failure_is_one_line_error():
    class Bad(nn.Module):
        def forward(self, x):
            if x.sum() > 0:  # data-dependent control flow
                return x.sum()
            return x.mean()

    with pytest.raises(ShardplanError, match="torch.export could not capture"):
        trace(Bad(), (torch.ones(3),))


# -- layout --------------------------------------------------------------------
def test_mesh_is_the_prime_factors():
    assert mesh_factors(8) == (2, 2, 2)
    assert mesh_factors(12) == (2, 2, 3)
    assert mesh_factors(1) == (1,)


def _flat(config, p, order=(0, 1, 2)):
    from shardplan.layout import Layout

    return Layout.flat(("b", "n", "c"), config, p, order)


def test_mesh_is_cut_only_where_a_layout_needs_it():
    from shardplan.torch import plan_mesh_shape

    assert plan_mesh_shape([_flat((8, 1, 1), 8)], 8) == (8,)
    assert plan_mesh_shape([_flat((4, 1, 1), 8), _flat((4, 2, 1), 8, (1, 0, 2))], 8) == (2, 4)
    assert plan_mesh_shape([_flat((2, 2, 2), 8), _flat((8, 1, 1), 8)], 8) == (2, 2, 2)
    assert plan_mesh_shape([_flat((2, 1, 1), 12), _flat((3, 1, 1), 12)], 12) == (2, 2, 3)


def test_mesh_axes_follow_replicas_then_the_nesting_order():
    assert mesh_dims(_flat((2, 2, 1), 8), (2, 2, 2)) == (None, "b", "n")
    assert mesh_dims(_flat((2, 4, 1), 8, (1, 0, 2)), (2, 2, 2)) == ("n", "n", "b")
    assert mesh_dims(_flat((2, 2, 3), 12), (2, 2, 3)) == ("b", "n", "c")
    with pytest.raises(ShardplanError, match="consecutive axes"):
        mesh_dims(_flat((3, 2, 1), 12), (2, 2, 3))


def test_two_level_layout_takes_the_node_axes_first():
    from shardplan.layout import Layout
    from shardplan.torch import layout_groups

    # 2 nodes x 4 devices: b split 2 across nodes and 2 inside, n split 2 inside
    lay = Layout(("b", "n", "c"), (4, 2), ((2, 2, 1), (2, 1, 1)), ((1, 0), (0,)))
    assert layout_groups(lay) == [("b", 2), ("n", 2), ("b", 2)]
    assert mesh_dims(lay, (2, 2, 2)) == ("b", "n", "b")


def test_placements_shard_indexed_axes_and_replicate_reductions():
    from torch.distributed.tensor import Replicate, Shard

    op = ops.einsum("mm", "bc,cn->bn", TensorRef("x", (8, 16)), ops.Param((16, 32)))
    axes = ("b", "c", "c")  # b split 2, c split 4
    assert tensor_placements(op.inputs[0], axes) == (Shard(0), Shard(1), Shard(1))
    assert tensor_placements(op.weights[0], axes) == (Replicate(), Shard(0), Shard(0))
    assert tensor_placements(op.output, axes) == (Shard(0), Replicate(), Replicate())


def test_every_listed_operator_family_has_a_description():
    import torch_cases

    model, batch = torch_cases.make_ops_zoo()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShardplanWarning)
        g, info = trace(model, batch)
    kinds = {op.kind for op in g.operators}
    assert {"linear", "slice", "bmm", "baddbmm", "softmax", "einsum", "matmul", "concat", "layer_norm",
            "index_select", "mean", "cross_entropy", "transpose"} <= kinds
    bmm = next(op for op in g.operators if op.kind == "bmm")
    assert bmm.dims == (("b", 8), ("m", 8), ("n", 8), ("k", 16)) and bmm.reduction_dims == ("k",)
    mm = next(op for op in g.operators if op.kind == "matmul")
    assert [w.name for w in mm.weights] == ["w1"] and info.param_uses["mix"] == ((mm.name, "w1"),)
    sel = next(op for op in g.operators if op.kind == "index_select")
    assert sel.inputs[0].axes[1].dim is None  # the indexed axis is read whole
    assert sel.inputs[1].name == "idx" and sel.inputs[1].axes[0].dim == sel.output.axes[1].dim


def test_dimensions_carry_readable_labels():
    g, _ = trace(_Lin(), (torch.ones(8, 16),))
    assert g["fc/linear"].dims_text == "batch:8 out:32 in:16"
    assert g.operators[1].dims_text == "batch:8 out:32"  # the sum keeps its operand's names

    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.fc = nn.Linear(4, 6)

        def forward(self, ids):
            h = self.fc(self.emb(ids).reshape(-1, 4))  # batch and sequence flattened, then split back
            return h.reshape(ids.shape[0], ids.shape[1], 6).sum()

    g, _ = trace(Flat(), (torch.zeros(3, 5, dtype=torch.long),))
    texts = [op.dims_text for op in g.operators]
    assert texts[0] == "batch:3 seq:5 embed:4 vocab:10"
    assert "batch*seq:15 out:6 in:4" in texts and "batch:3 seq:5 out:6" in texts
    from shardplan.baselines import batch_dim

    fc = next(op for op in g.operators if op.kind == "linear")
    assert fc.dim_label(batch_dim(fc)) == "batch*seq"  # data parallelism splits the flattened batch
