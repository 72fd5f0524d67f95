"""Partial layouts run on DTensor: Megatron-LM-style sequence parallelism of a residual MLP, 4 gloo processes.

The row-parallel linears leave their outputs ``Partial()``; the residual additions, layer norms and the loss
split the sequence, so the consumers' operand redistribution reduce-scatters the partial sums
(``Partial -> Shard``); the column-parallel linears gather the sequence-split activation. Loss and gradients
equal one process's; DTensor's communication counter sees the reduce-scatters.
"""

from __future__ import annotations

from typing import Any

import pytest

import torch
import torch.nn.functional as F
from torch import nn

import torch_cases  # noqa: E402  (tests/ is on sys.path, see conftest.py)

pytestmark = pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out

WORLD = 4
B, S, D, FF = 2, 8, 16, 32


class SPNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, FF, bias=False), nn.Linear(FF, D, bias=False)
        self.fc3, self.fc4 = nn.Linear(D, FF, bias=False), nn.Linear(FF, D, bias=False)
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x + self.fc2(torch.tanh(self.fc1(x))))
        h = self.ln2(h + self.fc4(torch.tanh(self.fc3(h))))
        return F.mse_loss(h, y)


def sp_layouts(graph: Any, p: int) -> dict[str, Any]:
    """Linears split the hidden dimension of extent FF (column-parallel: their output; row-parallel: their
    sum), partial where that defers a reduction; every other operator splits the sequence (its output's
    axis 1) when it has one."""
    from shardplan.configs import with_partial
    from shardplan.layout import Layout

    out = {}
    for op in graph.operators:
        names = op.dim_names
        want: dict[str, int] = {}
        linear = op.weights and any(op.extents[a.dim] == FF for a in op.weights[0].axes if a.dim)
        if linear:
            want[next(a.dim for a in op.weights[0].axes if a.dim and op.extents[a.dim] == FF)] = p
        elif len(op.output.axes) == 3 and op.output.axes[1].dim is not None:
            want[op.output.axes[1].dim] = p
        lay = Layout.flat(names, tuple(want.get(d, 1) for d in names), p)
        out[op.name] = with_partial(op, [lay])[-1] if linear else lay
    return out


def sp_reference() -> tuple[SPNet, tuple[Any, Any], SPNet, Any]:
    """The seeded model, its batch, and the unsharded copy after one forward and backward (with its loss)."""
    torch.manual_seed(0)
    model = SPNet()
    batch = (torch.randn(B, S, D), torch.randn(B, S, D))
    ref = torch_cases._clone(model)
    loss0 = ref(*batch)
    loss0.backward()
    return model, batch, ref, loss0


def run_sp(name: str, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    from shardplan.torch.frontend import trace
    from shardplan.torch.run import ParallelModule

    model, batch, ref, loss0 = sp_reference()
    graph, info = trace(torch_cases._clone(model), batch)
    layouts = sp_layouts(graph, world)
    mesh = init_device_mesh("cpu", (world,))
    counts = {}
    for partial in (True, False):
        lays = {n: lay.with_partial(lay.partial and partial) for n, lay in layouts.items()}
        pm = ParallelModule.create(torch_cases._clone(model), info, graph, lays, mesh)
        with CommDebugMode() as comm:
            loss = pm(*batch)
            loss.backward()
        counts[partial] = {str(k): int(v) for k, v in comm.get_comm_counts().items()}
        if partial:
            worst = 0.0
            for n, p_ in ref.named_parameters():
                g = dict(pm.named_dparameters())[n].grad.full_tensor()
                worst = max(worst, float((g - p_.grad).abs().max()) / max(float(p_.grad.abs().max()), 1e-12))
            rel_loss = abs(float(loss.detach()) - float(loss0.detach())) / abs(float(loss0.detach()))
    return {"rel_loss": rel_loss, "rel_grad": worst, "partial": sorted(n for n, lay in layouts.items() if lay.partial),
            "comm": counts[True], "comm_plain": counts[False]}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("torch_partial") / "results.json"
    return torch_cases.run_distributed(["sp"], WORLD, str(out), run_one=run_sp)


def test_sequence_parallel_runs_as_unsharded_with_reduce_scatters(results):
    r = results["sp"]
    assert "error" not in r, r.get("error")
    assert r["rel_loss"] <= 1e-5 and r["rel_grad"] <= 1e-4, r
    assert len(r["partial"]) == 3  # fc2, fc4 (partial outputs) and fc3 (partial input gradient); fc1 reads the data
    rs = [sum(v for k, v in c.items() if "reduce_scatter" in k) for c in (r["comm"], r["comm_plain"])]
    # the two partial outputs are reduce-scattered into the sequence-split residuals instead of all-reduced
    assert rs[0] == rs[1] + 2, (r["comm"], r["comm_plain"])
