"""Precision in the traced PyTorch program: tensors wider than the model's precision, and casts between them.

A bfloat16 model that upcasts (Hugging Face's RMSNorm and loss) runs float32 kernels and cast kernels in eager
PyTorch; the frontend charges each tensor at its own element size (``Tensor.elem_factor`` in elements of the model's
precision) and describes a cast between sizes as an elementwise operator. The expected seconds are the HBM
rooflines written out by hand.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardplan.cost import build_tables
from shardplan.machine import Machine
from shardplan.torch import trace


class _Norm(nn.Module):
    """Hugging Face's RMSNorm as Llama writes it, then a sum."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(16))

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (self.w * h.to(x.dtype)).sum()


def _factors(graph) -> dict[str, tuple[tuple[int, ...], int]]:
    return {op.name: (tuple(t.elem_factor for t in op.inputs + op.weights), op.output.elem_factor) for op in graph}


def test_a_bfloat16_model_charges_its_float32_values_at_four_bytes_and_casts_as_operators():
    g, info = trace(_Norm().to(torch.bfloat16), (torch.randn(8, 16, dtype=torch.bfloat16),))
    kinds = {op.name: op.kind for op in g}
    assert [kinds[n] for n in ("to", "to_1")] == ["cast", "cast"]
    f = _factors(g)
    assert f["to"] == ((1,), 2)  # reads bf16, writes fp32
    assert f["pow_1"] == ((2,), 2) and f["mean"] == ((2,), 2)
    assert f["to_1"] == ((2,), 1)  # back to bf16
    assert f["mul_1"] == ((1, 1), 1)  # the weight (bf16) times the bf16 copy
    assert set(info.node_op) >= {"to", "to_1"}


def test_a_float32_model_has_no_cast_operator_and_every_factor_one():
    g, _ = trace(_Norm(), (torch.randn(8, 16),))
    assert not any(op.kind == "cast" for op in g)
    assert {op.output.elem_factor for op in g} == {1}
    assert {t.elem_factor for op in g for t in op.inputs + op.weights} == {1}


class _Upcast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 32)

    def forward(self, x):
        return self.fc(x).float().exp().sum()


@pytest.mark.parametrize("dtype_bytes", [2, 4])
def test_the_cast_is_charged_its_read_and_its_write_forward_and_backward(dtype_bytes):
    """``.float()`` of a (64, 32) bfloat16 value: forward it reads 2 and writes 4 bytes per element; when the value
    needs a gradient the backward casts the gradient back (the same bytes again), when it does not (the RMSNorm's
    graph input) there is no backward. On a machine of ``dtype_bytes``-byte elements the factor (in the model's
    elements) scales with the machine's element."""
    m = Machine(1, peak_flops=1e15, bandwidth=1e9, hbm_bandwidth=1e12, dtype_bytes=dtype_bytes)
    for module, x, passes, n in ((_Upcast(), torch.randn(64, 16), 2, 64 * 32), (_Norm(), torch.randn(64, 16), 1, 64 * 16)):
        g, _ = trace(module.to(torch.bfloat16), (x.to(torch.bfloat16),))
        tables = build_tables(g, m)
        i = [op.kind for op in g].index("cast")
        assert tables.op_costs[i].compute[0] == pytest.approx(passes * (1 + 2) * n * dtype_bytes / 1e12, rel=1e-12)
