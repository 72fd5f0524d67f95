"""In one process: what a plan asks of the PyTorch run for the ring, FP8 and host offload (``run_choices``), the
FP8 casts and operands, the host-offload hooks, and the ring's positions and reference. The runs on 4 gloo
processes are in test_ring_fp8_offload_dist.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardplan.cost.causal import block_work
from shardplan.machine import Machine
from shardplan.torch.precision import HostOffload, fp8_cast, fp8_grad, fp8_operands
from shardplan.torch.ring import attention_reference, balanced_positions, deal_routes, device_work

B, S, D, H = 2, 8, 8, 2


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(D, D, bias=False) for _ in range(3))
        self.o = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (f(x).view(b, s, H, D // H).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return torch.tanh(self.o(y.transpose(1, 2).reshape(b, s, D))).sum()


@pytest.fixture(scope="module")
def traced():
    from shardplan.torch.frontend import trace

    torch.manual_seed(0)
    return trace(Attn(), (torch.randn(B, S, D),))


MACHINE = Machine(4, peak_flops=32e9, bandwidth=16e9, latency=0.0, name="toy", memory_bytes=1e9, fp8_flops=64e9,
                  host_bandwidth=8e9, host_memory_bytes=1e10, cpu_adam_rate=1e8)


def test_run_choices_take_the_ring_fp8_and_offload_from_the_plan(traced):
    from shardplan.fit import plan_with_choices
    from shardplan.planner import from_spmd, spmd_of
    from shardplan.result import Plan
    from shardplan.spmd import solve
    from shardplan.torch.run import run_choices

    graph, _ = traced
    assert not run_choices(solve(graph, MACHINE)).ring
    sp = solve(graph, MACHINE, context="ring")
    assert run_choices(sp).ring
    fit = plan_with_choices(sp, stage=3, fp8=True, offload=("optimizer", "activations"))
    ch = run_choices(fit)
    linears = {op.name for op in graph.operators if op.kind == "linear"}
    assert ch.fp8 == linears and ch.ring
    assert ch.offload and ch.offload <= {op.name for op in graph.operators}
    assert ch.offload_optimizer == linears  # the operators that own trainable weights
    # the Plan value holds them, and shardplan.torch.apply's spmd_of gives the run the same choices
    plan = from_spmd(fit)
    assert {n for n, c in plan.operators.items() if c.fp8} == linears
    assert {n for n, c in plan.operators.items() if "activations" in c.offload} == ch.offload
    assert run_choices(spmd_of(plan, graph)) == ch
    # and so does the plan written to JSON and loaded again: spmd_of rebuilds it with every FP8 and offload choice
    loaded = Plan.from_json(plan.to_json())
    rebuilt = spmd_of(loaded, graph)
    assert rebuilt is not fit and rebuilt.cost == pytest.approx(fit.cost, rel=1e-12)
    assert rebuilt.memory == pytest.approx(fit.memory, rel=1e-12) and run_choices(rebuilt) == ch
    # a plan loaded from JSON keeps the ring (its tables' options travel with it)
    assert run_choices(spmd_of(Plan.from_json(from_spmd(sp).to_json()), graph)).ring


def test_fp8_operands_are_the_contraction_with_the_weight(traced):
    graph, _ = traced
    ops = {op.name: op for op in graph.operators}
    assert fp8_operands(ops["o/linear_3"]) == {"x0", "w1"}  # input and weight; the bias stays
    assert any(t.name == "bias" for t in ops["o/linear_3"].weights)
    attn = next(op for op in graph.operators if op.kind == "attn_flash")
    assert fp8_operands(attn) == frozenset()


def test_fp8_cast_rounds_to_e4m3_with_the_whole_tensors_scale():
    x = torch.tensor([0.5, -3.0, 1e-3, 2.0 / 3.0], requires_grad=True)
    y = fp8_cast(x)
    s = 448.0 / 3.0
    assert float(y[1].detach()) == -3.0  # amax maps to 448, exactly representable
    want = (x.detach() * s).to(torch.float8_e4m3fn).to(torch.float32) / s
    assert torch.equal(y.detach(), want) and not torch.equal(want, x.detach())
    y.backward(torch.arange(4.0))
    assert torch.equal(x.grad, torch.arange(4.0))  # straight through


def test_fp8_grad_casts_the_gradient_to_e5m2():
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    g = torch.tensor([1.0, 0.3001])
    fp8_grad(x * 1.0).backward(g)
    s = 57344.0
    assert torch.equal(x.grad, (g * s).to(torch.float8_e5m2).to(torch.float32) / s) and not torch.equal(x.grad, g)


def test_host_offload_copies_saved_tensors_and_changes_no_gradient():
    torch.manual_seed(0)
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4)
    off = HostOffload()
    seen = []
    pack = off.pack
    off.pack = lambda t: seen.append(t) or pack(t)  # noqa: E731
    with off.hooks():
        loss = torch.tanh(x @ w).sum()
    loss.backward()
    g = w.grad.clone()
    w.grad = None
    torch.tanh(x @ w).sum().backward()
    assert torch.equal(g, w.grad)
    assert off.tensors == len(seen) >= 2 and off.saved_bytes == sum(t.numel() * 4 for t in seen)


def test_a_sequence_that_does_not_split_is_refused():
    from shardplan.errors import ShardplanError

    with pytest.raises(ShardplanError, match="does not split 3 ways"):
        balanced_positions(8, 3)


def test_balanced_positions_even_out_the_causal_work():
    for ways in (2, 4):
        pos = balanced_positions(32, ways)
        assert sorted(pos.ravel().tolist()) == list(range(32))
        work = device_work(32, ways)
        assert len(set(work.tolist())) == 1 and work.sum() == 32 * 33 // 2
        contiguous = device_work(32, ways, balanced=False)
        assert contiguous[-1] > contiguous[0] and contiguous.sum() == 32 * 33 // 2
        # the busiest device's share of its tile is the cost model's (shardplan.cost.causal.block_work)
        share = block_work(32, ways, 1, True).max()
        assert np.isclose(share, work.max() / (32 * 32 / ways))


def test_attention_reference_is_pytorchs_attention():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 8, 4) for _ in range(3))
    for causal in (True, False):
        assert torch.allclose(attention_reference(q, k, v, causal), F.scaled_dot_product_attention(
            q, k, v, is_causal=causal), atol=1e-6)


@pytest.mark.parametrize("g", [1, 2, 3, 4, 5])
def test_dealing_contiguous_halves_gives_the_balanced_positions(g):
    """Simulate every rank's sends (:func:`deal_routes`): the halves land where the balanced order puts them,
    and each receive names the half its sender sends to that slot."""
    n = 4
    pos = np.arange(g * n).reshape(g, n)
    halves = {(r, j): pos[r][j * n // 2:(j + 1) * n // 2] for r in range(g) for j in (0, 1)}
    landed = {}
    for r in range(g):
        sends, recvs = deal_routes(r, g)
        for j, dst in enumerate(sends):
            landed[dst] = halves[(r, j)]
        for slot, (src, half) in enumerate(recvs):
            assert deal_routes(src, g)[0][half] == (r, slot)
    got = np.stack([np.concatenate([landed[(r, 0)], landed[(r, 1)]]) for r in range(g)])
    assert np.array_equal(got, balanced_positions(g * n, g))


def test_a_pipelined_plan_with_fp8_or_offload_passes_the_stage_runners_check():
    """A recipe's pipeline with FP8 products (and one operator offloading its activations) is one the PyTorch stage
    runner holds: its run choices reach every stage (run on gloo: tests/torch_engine/test_torch_staged_choices.py)."""
    import dataclasses

    from shardplan.machine import preset
    from shardplan.recipe import cost_recipe
    from shardplan.torch.staged import check_stage_choices, plan_layout

    fp8 = cost_recipe("gpt", preset("h100", 8), "pp=2,tp=2,dp=2,mbs=2,fp8=true", batch=8)
    assert fp8.pipelined and all(any(c.fp8 for c in s.operators.values()) for s in fp8.stages)
    stage = fp8.stages[0]
    name, choice = next(iter(stage.operators.items()))
    offload = dataclasses.replace(fp8, stages=(dataclasses.replace(
        stage, operators={**stage.operators, name: dataclasses.replace(choice, offload=("activations",))}),)
        + fp8.stages[1:])
    layout, _ = plan_layout(offload)
    check_stage_choices(layout["choices"], 2)
    assert [[c[1] for c in ops] for ops in layout["choices"]] == [[c.fp8 for c in s.operators.values()]
                                                                  for s in fp8.stages]
    assert layout["choices"][0][0] == (name, choice.fp8, ("activations",), choice.recompute, 0)


def test_delayed_scaling_scales_from_the_history_of_earlier_steps():
    """Scale 1 before any history (Transformer Engine's initial scale), then ``M / max(history)``; a step's casts
    of one tensor leave one entry, their largest amax, newest first, the oldest dropped past the length; a cast
    beyond the delayed scale's range saturates at the format's largest value instead of overflowing."""
    from shardplan.errors import ShardplanError
    from shardplan.torch.precision import E4M3_MAX, DelayedScaling

    d = DelayedScaling(2)
    assert d.scale("a", E4M3_MAX) == 1.0
    x = torch.tensor([0.5, -3.0, 1000.0])
    q = fp8_cast(x, d, "a")  # scale 1: 1000 saturates to 448, -3 and 0.5 are on the E4M3 grid
    assert q.tolist() == [0.5, -3.0, E4M3_MAX]
    fp8_cast(torch.tensor([2.0]), d, "a")
    assert d.scale("a", E4M3_MAX) == 1.0 and d.pending == {"a": 1000.0}  # nothing committed yet
    d.commit()
    assert d.history["a"].tolist() == [1000.0, 0.0] and d.scale("a", E4M3_MAX) == E4M3_MAX / 1000.0
    for amax in (10.0, 20.0):
        fp8_cast(torch.tensor([amax]), d, "a")
        d.commit()
    assert d.history["a"].tolist() == [20.0, 10.0]  # 1000 dropped: a history of 2 steps
    d.commit()  # a step with no cast of "a" leaves its history alone
    assert d.history["a"].tolist() == [20.0, 10.0]
    g = torch.ones(3, requires_grad=True)
    fp8_grad(g * 2.0, d, "g").sum().backward()
    assert d.pending == {"g": 1.0} and g.grad.tolist() == [2.0, 2.0, 2.0]
    with pytest.raises(ShardplanError, match="at least one step"):
        DelayedScaling(0)
