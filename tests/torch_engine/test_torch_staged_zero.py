"""A pipeline plan whose stages shard state (ZeRO-1, ZeRO-3) trains on PyTorch (4 gloo processes,
:meth:`shardplan.torch.staged.TorchPipeline.optimizer`): 2 stages of 2 processes, every block linear data parallel
(its weight replicated on the stage's 2 processes) at ZeRO-1, then at ZeRO-3; two Adam steps equal one process's,
with Adam's state of every linear in shards (half of it on each process of its stage), and at ZeRO-3 the
parameters too. In this process: what the stage runner refuses (offloaded state; ZeRO 2 over stages of several
processes) and accepts (ZeRO 1 and 3; any ZeRO stage in stages of one process, where the tile has no replicas)."""

from __future__ import annotations

from typing import Any

import pytest

import torch
from torch import nn

import torch_cases  # noqa: E402  (tests/ is on sys.path, see conftest.py)
import torch_pipeline_cases  # noqa: E402

pytestmark = pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out

WORLD = 4
B, D = 8, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for blk in self.layers:
            x = blk(x)
        return ((x - y) ** 2).mean()


def data_parallel(world: int, stage: int) -> Any:
    """The pipeline search's plan of :class:`Mlp` (2 stages of 2 processes, m = 2), every operator laid out data
    parallel (its first dimension of the micro-batch's rows split 2 ways) and every linear at ZeRO ``stage``, as
    loaded from JSON."""
    import dataclasses

    from shardplan.layout import Layout
    from shardplan.pipeline.api import pipeline_solve
    from shardplan.planner import from_pipeline
    from shardplan.torch.staged import Tracer

    torch.manual_seed(0)
    model, batch = Mlp(), (torch.randn(B, D), torch.randn(B, D))
    tracer = Tracer(model, batch)
    plan = from_pipeline(pipeline_solve(tracer, tracer.batch, torch_pipeline_cases.toy_machine(world),
                                        micro_batches=(2,), sizes=(2,), uniform=True, schedules=("1f1b",), cutoff=1))
    graph = tracer(B // 2)
    rows = {op.name: next(d for d in op.dim_names if op.extents[d] == B // 2) for op in graph.operators}

    def choice(name: str, c: Any) -> Any:
        lay = Layout.flat(c.layout.dims, tuple(2 if d == rows[name] else 1 for d in c.layout.dims), 2)
        return dataclasses.replace(c, layout=lay, state_stage=stage if "linear" in name else 0)

    stages = tuple(dataclasses.replace(s, operators={n: choice(n, c) for n, c in s.operators.items()})
                   for s in plan.stages)
    return dataclasses.replace(plan, stages=stages, detail=None), model, batch


def _train(world: int, stage: int) -> dict[str, Any]:
    import torch.distributed as dist

    import shardplan.torch as st
    from shardplan.torch.staged import ShardedStateOptimizer

    plan, model, batch = data_parallel(world, stage)
    ref = torch_cases._clone(model)
    pipe = st.apply(plan, model, batch)
    opt = pipe.optimizer(torch.optim.Adam, lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    rel_loss, param_err = 0.0, 0.0
    for _ in range(2):
        loss = pipe.step(*batch)
        opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        ref_loss = ref(*batch)
        ref_loss.backward()
        ref_opt.step()
        ref_loss = ref_loss.detach()
        rel_loss = max(rel_loss, abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)))
        named = dict(ref.named_parameters())
        for target, p in pipe.named_parameters().items():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            param_err = max(param_err, float((full.detach() - named[target].detach()).abs().max()))
    err = torch.tensor(param_err)
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    sharded = isinstance(opt, ShardedStateOptimizer)
    masters = opt.masters() if sharded else []
    # per parameter with sharded state: the elements of Adam's first moment this process holds, and the parameter's
    halves = [(opt.state[m]["exp_avg"].to_local().numel(), p.numel()) for p, m in masters]
    held = [p for h in pipe.modules for p in h.module.parameters()]
    moments = [(opt.state[p]["exp_avg"].to_local().numel(), p.numel()) for p in held if p in opt.state]
    return {"sharded_params": torch_pipeline_cases._total(sum(2 * p.to_local().numel() == p.numel() for p in held)),
            "sharded_moments": torch_pipeline_cases._total(sum(2 * a == n for a, n in moments)),
            "rel_loss": rel_loss, "param_err": float(err),
            "scale": max(float(p.detach().abs().max()) for p in ref.parameters()),
            "sharded": torch_pipeline_cases._total(int(sharded)),
            "masters": torch_pipeline_cases._total(len(masters)),
            "halves": torch_pipeline_cases._total(sum(2 * a == n for a, n in halves)),
            "params_held": torch_pipeline_cases._total(len(pipe.named_parameters()))}


CASES = {"zero1": lambda world: _train(world, 1), "zero3": lambda world: _train(world, 3)}


def run_case(name: str, world: int) -> dict[str, Any]:
    return CASES[name](world)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("torch_staged_zero") / "results.json"
    return torch_cases.run_distributed(list(CASES), WORLD, str(out), run_one=run_case)


def test_zero1_stages_train_like_one_process_with_the_state_in_shards(results):
    """Two Adam steps equal one process's (loss to 1e-5, weights to 1e-5 of the largest); every process holds its
    stage's 4 linear parameters (2 weights, 2 biases) with their Adam state in shards, half of each moment."""
    r = results["zero1"]
    assert "error" not in r, r.get("error")
    assert r["rel_loss"] <= 1e-5 and r["param_err"] <= 1e-5 * r["scale"], r
    assert r["sharded"] == WORLD and r["params_held"] == 2 * 8  # each stage's 4 parameters on each of its 2
    assert r["masters"] == WORLD * 4 and r["halves"] == WORLD * 4, r
    assert r["sharded_params"] == 0, r


def test_zero3_stages_train_like_one_process_with_parameters_in_shards(results):
    """The same plan at ZeRO-3: the stage's ParallelModule holds each linear parameter in shards (half on each
    process), gathered at each use; a plain Adam over them (no master shards) holds half of each moment; two
    Adam steps equal one process's."""
    r = results["zero3"]
    assert "error" not in r, r.get("error")
    assert r["rel_loss"] <= 1e-5 and r["param_err"] <= 1e-5 * r["scale"], r
    assert r["sharded"] == 0 and r["params_held"] == 2 * 8
    assert r["sharded_params"] == WORLD * 4 and r["sharded_moments"] == WORLD * 4, r


def test_what_the_stage_runner_holds_and_refuses():
    """Refused: optimizer state or parameters in host memory, ZeRO 2 over stages of several processes; accepted:
    ZeRO 1 and 3 in any stage, any ZeRO stage in a stage of one process."""
    from shardplan.errors import ShardplanError
    from shardplan.torch.staged import check_stage_choices

    def op(stage: int, offload: tuple = ()) -> list:
        return [[("layers.0/up/linear", False, offload, False, stage)]]

    for q in (1, 2):
        check_stage_choices(op(1), q)
    for q in (1, 2):
        check_stage_choices(op(3), q)
    check_stage_choices(op(2), 1)
    with pytest.raises(ShardplanError, match="has ZeRO stage 2 in a stage of 2 processes"):
        check_stage_choices(op(2), 2)
    for parts in (("optimizer",), ("parameters",)):
        with pytest.raises(ShardplanError, match=f"offloads its {parts[0]}"):
            check_stage_choices(op(3, parts), 1)
