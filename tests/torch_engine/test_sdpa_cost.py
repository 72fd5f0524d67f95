"""``aten.scaled_dot_product_attention`` traced from PyTorch is the fused core of the model zoo
(:func:`shardplan.ops.flash_attention`): the same FLOPs, fused backward, saved bytes and memory for the same
shapes (grouped-query attention included), the causal mask taken from ``is_causal`` or from a constant mask
that keeps exactly key <= query, and its keys and values on the context-parallel ring where that pays."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardplan import ops
from shardplan.configs import configurations
from shardplan.cost import build_tables
from shardplan.cost.causal import block_work
from shardplan.cost.memory import operator_memory
from shardplan.cost.operator import PARTS, operator_cost
from shardplan.cost.ring import ring_mask
from shardplan.ir import TensorRef
from shardplan.machine import Machine
from shardplan.search import solve_dp
from shardplan.torch.frontend import trace
from shardplan.torch.ring import is_causal_mask

HBM_MACHINE = Machine(8, peak_flops=1e12, bandwidth=1e9, latency=1e-6, dtype_bytes=2, hbm_bandwidth=1e11)
FLOP_MACHINE = Machine(1, peak_flops=1e12, bandwidth=1e9, latency=0.0, dtype_bytes=2)


class Core(nn.Module):
    """The attention of the inputs q, k, v, each scaled by a parameter first (so that their gradients are
    wanted). ``mask``: "causal" (``is_causal``), "tril" (a constant boolean lower triangle), "additive"
    (0 / -inf), "random" (a constant mask that is not causal) or None."""

    def __init__(self, mask: str | None, gqa: bool = False) -> None:
        super().__init__()
        self.mask, self.gqa = mask, gqa
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = q * self.w[0], k * self.w[1], v * self.w[2]
        n = q.shape[2]
        kw = {"enable_gqa": self.gqa}
        if self.mask == "causal":
            kw["is_causal"] = True
        elif self.mask == "tril":
            kw["attn_mask"] = torch.ones(n, n, dtype=torch.bool).tril()
        elif self.mask == "additive":
            kw["attn_mask"] = torch.zeros(n, n).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1),
                                                            float("-inf"))
        elif self.mask == "random":
            kw["attn_mask"] = torch.arange(n * n).reshape(n, n) % 3 != 1
        return F.scaled_dot_product_attention(q, k, v, **kw)


def traced_core(mask: str | None, B: int = 2, H: int = 4, G: int = 4, S: int = 16, K: int = 8):
    x = (torch.randn(B, H, S, K), torch.randn(B, G, S, K), torch.randn(B, G, S, K))
    graph, _ = trace(Core(mask, gqa=G != H), x)
    (op,) = [op for op in graph.operators if op.kind == "attn_flash"]
    return op


def zoo_core(causal: bool, B: int = 2, H: int = 4, G: int = 4, S: int = 16, K: int = 8):
    """The zoo's fused core for the same shapes: grouped-query attention as the zoo writes it, query heads
    ``r`` per K/V head ``h`` on their own axis of q (which the zoo may split; the traced query head axis is
    the merged (h, r), so ``r`` is fixed there: DTensor splits an axis in contiguous blocks only)."""
    k, v = TensorRef("k", (B, G, S, K)), TensorRef("v", (B, G, S, K))
    if G == H:
        return ops.flash_attention("attn", TensorRef("q", (B, H, S, K)), k, v, "bhsk", "bhtk", causal=causal,
                                   dealt=causal)
    q = TensorRef("q", (B, G, H // G, S, K))
    op = ops.flash_attention("attn", q, k, v, "bhrsk", "bhtk", causal=causal, dealt=causal)
    return replace(op, fixed=op.fixed | {"r"})


@pytest.mark.parametrize("mask, G", [(None, 4), ("causal", 4), ("causal", 2), ("tril", 1), ("additive", 4)])
def test_the_traced_core_costs_exactly_the_zoos_fused_attention(mask, G):
    """Every part of the operator's cost and its memory, for every configuration on 8 devices of a machine
    with an HBM bandwidth (both rooflines matter), equal the zoo operator's for the same shapes."""
    got, want = traced_core(mask, G=G), zoo_core(mask is not None, G=G)
    assert got.kind == want.kind == "attn_flash" and got.dim_names == want.dim_names
    assert got.extents == want.extents and got.fixed == want.fixed and got.causal == want.causal
    assert (got.flops_per_point, got.backward_flops, got.saved) == (want.flops_per_point, want.backward_flops,
                                                                    want.saved)
    rows = configurations(want, 8, cutoff=1)
    assert len(rows) >= 7 and rows.max() == 8  # batch, heads and queries split, up to all 8 ways
    a, b = operator_cost(got, rows, HBM_MACHINE), operator_cost(want, rows, HBM_MACHINE)
    for part in [*PARTS, "comm_bytes"]:
        if hasattr(a, part):
            np.testing.assert_array_equal(getattr(a, part), getattr(b, part), err_msg=part)
    for x, y in zip(operator_memory(got, rows, HBM_MACHINE), operator_memory(want, rows, HBM_MACHINE)):
        np.testing.assert_array_equal(x, y)


def test_grouped_query_heads_split_with_their_key_value_heads():
    """Four query heads over two K/V heads: the head dim counts K/V heads (split at most 2 ways), the query
    head axis is the merged (h, r) with r fixed, and the keys are read per K/V head, not whole."""
    op = traced_core("causal", G=2)
    assert op.extents["h"] == 2 and op.extents["r"] == 2 and "r" in op.fixed
    q, k = op.inputs[0], op.inputs[1]
    assert q.shape == (2, 4, 16, 8) and q.axes[1].dim == "h" and q.axes[1].inner == ("r",)
    assert k.shape == (2, 2, 16, 8) and k.axes[1].dim == "h"


def test_causal_work_is_the_masked_share_and_a_general_mask_pays_it_all():
    """On one device with no HBM bound the causal core costs (S + 1) / 2S of the unmasked one, forward and
    backward; a constant mask that is not causal is charged the whole domain."""
    one = np.ones((1, 5), dtype=np.int64)
    full = operator_cost(traced_core(None), one, FLOP_MACHINE).compute[0]
    causal = operator_cost(traced_core("causal"), one, FLOP_MACHINE).compute[0]
    assert causal / full == pytest.approx(17 / 32, rel=1e-12) == block_work(16, 1, 1, True).max()
    points = 2 * 4 * 16 * 16 * 8
    assert full == pytest.approx((4 + 5 / 8 + 10 + 4 / 8) * points / FLOP_MACHINE.achievable_flops, rel=1e-12)
    general = traced_core("random")
    assert general.causal is None and general.kind == "attn_flash"
    assert operator_cost(general, one, FLOP_MACHINE).compute[0] == full


def test_a_constant_causal_mask_is_recognised_and_others_are_not():
    for mask in ("tril", "additive"):
        assert traced_core(mask).causal is not None, mask
    n = 6
    tril = torch.ones(n, n, dtype=torch.bool).tril()
    assert is_causal_mask(tril[None, None].expand(2, 1, n, n), n, n)
    assert not is_causal_mask(tril.T, n, n) and not is_causal_mask(tril[:, :5], n, 5)
    assert not is_causal_mask(torch.zeros(n, n).masked_fill(~tril, -1.0), n, n)  # -1 keeps the point
    assert is_causal_mask(torch.zeros(n, n).masked_fill(~tril, torch.finfo(torch.float32).min), n, n)


class Attn(nn.Module):
    """One head of width K over a long sequence: q, k, v projections, causal SDPA, an output projection."""

    def __init__(self, K: int) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(K, K, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (f(x).unsqueeze(1) for f in (self.q, self.k, self.v))
        return self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).squeeze(1)).sum()


@pytest.mark.parametrize("S, bandwidth, latency, pays", [(1024, 1e8, 1e-6, True), (8, 1e11, 1e-3, False)])
def test_the_search_takes_the_ring_for_the_traced_core_only_where_it_pays(S, bandwidth, latency, pays):
    """As for the zoo's core (tests/cost/test_flash_cost.py): a long sequence on slow links over 4 devices
    puts keys and values on the ring (cheaper than gathering them); a short one on fast links with a
    large latency does not."""
    graph, _ = trace(Attn(16), (torch.randn(1, S, 16),))
    m = Machine(4, peak_flops=1e9, bandwidth=bandwidth, latency=latency, dtype_bytes=4)
    auto = build_tables(graph, m, cutoff=1, orders="row-major", context="auto")
    plain = build_tables(graph, m, cutoff=1, orders="row-major")
    a, p = solve_dp(auto.to_problem()), solve_dp(plain.to_problem())
    i = next(j for j, op in enumerate(graph.operators) if op.kind == "attn_flash")
    if pays:
        assert a.cost < p.cost * (1 - 1e-3)
        lay = auto.arrays[i].take([a.assignment[i]])
        assert ring_mask(graph.operators[i], lay)[0].tolist() == [[False, True, True]]
    else:
        assert a.cost == pytest.approx(p.cost, rel=1e-9)


def test_values_of_another_width_stay_one_generic_attention():
    """The fused core reads keys and values of one shape; values 6 wide beside keys 8 wide are the generic
    attention (dims b h l s e f, the whole domain charged, its backward as generic passes)."""
    x = (torch.randn(2, 4, 16, 8), torch.randn(2, 4, 16, 8), torch.randn(2, 4, 16, 6))
    graph, _ = trace(Core("causal"), x)
    (op,) = [op for op in graph.operators if op.kind == "attention"]
    assert op.extents == {"b": 2, "h": 4, "l": 16, "s": 16, "e": 8, "f": 6}
    assert op.backward_flops is None and op.causal is None


def test_a_mask_without_values_is_not_taken_for_causal():
    """On the meta device a constant mask has no values: the core is charged the whole domain."""
    n = 8
    assert not is_causal_mask(torch.ones(n, n, dtype=torch.bool, device="meta").tril(), n, n)

    class Meta(nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            keep = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)

    q = torch.empty(1, 2, n, 4, device="meta")
    graph, _ = trace(Meta(), (q, q, q))
    (op,) = [op for op in graph.operators if op.kind == "attn_flash"]
    assert op.causal is None
