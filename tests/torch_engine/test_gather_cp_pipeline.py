"""A pipeline plan whose stages run the balanced all-gather, read back from JSON, runs it on PyTorch.

Two causal attention layers (one head, a sequence of 64) planned as a pipeline of two stages of two devices on the
toy machine: each stage splits its attention's queries 2 ways and its tables charge the deal
(:func:`shardplan.cost.ring.deals_gathered`). The plan's JSON carries that (``OperatorChoice.dealt``), so a plan
loaded without its stage plans hands each stage its dealt attention (:func:`shardplan.torch.staged.plan_layout`);
on 4 gloo processes its stages deal their queries (``gather_sdpa``) and the step equals one process.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

import torch
import torch.nn.functional as F
from torch import nn

import torch_cases  # noqa: E402  (tests/ is on sys.path, see conftest.py)
import torch_pipeline_cases  # noqa: E402

WORLD = 4
B, S, D, H = 2, 64, 8, 1


class Attn(nn.Module):
    """q, k, v projections, causal SDPA over one head, an output projection and a tanh, residual."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (f(x).view(b, s, H, D // H).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, D)
        return x + torch.tanh(self.o(y))


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Attn() for _ in range(2))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return ((x - y) ** 2).mean()


def _case() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    return TwoLayers(), (torch.randn(B, S, D), torch.randn(B, S, D))


def _plan(model: nn.Module, batch: tuple) -> Any:
    from shardplan.pipeline.api import pipeline_solve
    from shardplan.planner import from_pipeline
    from shardplan.torch.staged import Tracer

    tracer = Tracer(model, batch)
    return from_pipeline(pipeline_solve(tracer, tracer.batch, torch_pipeline_cases.toy_machine(WORLD),
                                        micro_batches=(2,), sizes=(2,), uniform=True, schedules=("1f1b",), cutoff=1))


def test_a_pipeline_plan_read_back_from_json_keeps_its_dealt_attentions():
    """Each stage's attention is dealt where its stage plan's tables charge the deal; the flag survives
    ``to_json`` / ``from_json`` and reaches the stages' layouts (:func:`plan_layout`); a JSON without it (an
    older plan) reads as contiguous, and an operator not dealt writes no field."""
    from shardplan.cost.ring import deals_gathered
    from shardplan.pipeline.execute import stage_plan
    from shardplan.result import Plan
    from shardplan.torch.staged import plan_layout

    plan = _plan(*_case())
    assert plan.num_stages == 2
    attn = [[(n, c) for n, c in s.operators.items() if c.kind == "attn_flash"] for s in plan.stages]
    assert [len(a) for a in attn] == [1, 1]
    for j, ((name, c),) in enumerate(attn):
        sp = stage_plan(plan.detail, j)
        split = dict(zip(c.layout.dims, c.layout.split))
        assert split["s"] == 2 and split["t"] == 1, split
        assert c.dealt and deals_gathered(sp.graph[name], sp.layouts[name], sp.machine)
    text = plan.to_json()
    loaded = Plan.from_json(text)
    assert loaded == plan
    _, stages = plan_layout(loaded)
    assert [[e[2] for e in st] for st in stages] == [[c.dealt for c in s.operators.values()] for s in plan.stages]
    assert [sum(e[2] for e in st) for st in stages] == [1, 1]
    raw = json.loads(text)
    assert all(("dealt" in op) == (op["kind"] == "attn_flash") for s in raw["stages"] for op in s["operators"].values())
    for s in raw["stages"]:
        for op in s["operators"].values():
            op.pop("dealt", None)
    old = Plan.from_dict(raw)
    assert not any(c.dealt for s in old.stages for c in s.operators.values())


def _loaded_pipeline(world: int) -> dict[str, Any]:
    import shardplan.torch as st
    import shardplan.torch.ring as ring_module
    from shardplan.result import Plan

    model, batch = _case()
    ref = torch_cases._clone(model)
    loss0 = ref(*batch)
    loss0.backward()
    plan = Plan.from_json(_plan(torch_cases._clone(model), batch).to_json())
    calls: list[bool] = []
    inner = ring_module.deal
    ring_module.deal = lambda x, group, inverse=False: calls.append(inverse) or inner(x, group, inverse)
    try:
        pipe = st.apply(plan, model, batch)
        loss = pipe.step(*batch)
    finally:
        ring_module.deal = inner
    import torch.distributed as dist

    grads = {n: p.grad for n, p in ref.named_parameters()}
    worst = torch.zeros(())
    for target, g in pipe.named_grads().items():
        g = g.full_tensor() if hasattr(g, "full_tensor") else g
        worst = torch.maximum(worst, (g - grads[target]).abs().max())
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    scale = max(float(g.abs().max()) for g in grads.values())
    return {"rel_loss": abs(float(loss) - float(loss0)) / abs(float(loss0)), "rel_grad": float(worst) / scale,
            "forward_deals": torch_pipeline_cases._total(calls.count(False)),
            "inverse_deals": torch_pipeline_cases._total(calls.count(True)),
            "held": torch_pipeline_cases._total(len(pipe.named_grads())), "params": len(grads)}


def run_all(name: str, world: int) -> dict[str, Any]:
    return {"loaded_pipeline": _loaded_pipeline}[name](world)


@pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out
def test_a_pipeline_plan_loaded_from_json_deals_its_stages_attention_and_equals_one_process(tmp_path):
    """Each of the 4 ranks (2 stages of 2) deals its stage's queries in and the output back once per micro-batch
    (2 micro-batches): 8 forward deals and 8 inverse over the ranks; loss and gradients equal one process."""
    r = torch_cases.run_distributed(["loaded_pipeline"], WORLD, str(tmp_path / "results.json"),
                                    run_one=run_all)["loaded_pipeline"]
    assert "error" not in r, r.get("error")
    assert r["forward_deals"] == r["inverse_deals"] == 8, r
    assert r["rel_loss"] <= 1e-5 and r["rel_grad"] <= 1e-4, r
