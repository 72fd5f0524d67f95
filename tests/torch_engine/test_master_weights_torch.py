"""Mixed precision with fp32 master weights on 4 gloo processes, one launch for every case: a bfloat16 MLP whose plan
carries the precision rule ``master_weights``; the run holds its parameters (and the optimizer its state) in float32,
as planned, reads them through bfloat16 copies, and its loss and float32 gradients equal one process running the
same rule (the masters cast to bfloat16, differentiated w.r.t. the masters).

* ``tp_loaded``: the hidden features split 4 ways (column- then row-parallel: the second product's partial sums
  reduced), the plan written to JSON and loaded, run by ``st.apply``; then one Adam step;
* ``zero3``: the sequence split 4 ways, every weight at ZeRO-3 (gathered for use, its gradient reduce-scattered);
* ``micro``: the sequence split, 2 micro-batches (each gradient summed locally, reduced once after the step);
* ``without``: the ``tp_loaded`` plan made without the rule: parameters, gradients and Adam's state in bfloat16,
  the loss and the gradients those of ``tp_loaded`` exactly.
"""

from __future__ import annotations

from typing import Any

import pytest

import torch
from torch import nn

import torch_cases  # noqa: E402  (tests/ is on sys.path, see conftest.py)

pytestmark = pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out

WORLD = 4
B, S, D, FF = 2, 16, 8, 32
BF16 = torch.bfloat16
# bfloat16's unit roundoff (8 significand bits, 7 stored): a rounding moves a value by at most U of its magnitude,
# and two values of one binade are a multiple of 2 U of its top apart
U = 2.0**-8


class MLP(nn.Module):
    """Two linears with a tanh between, in the parameters' dtype; the squared error taken in float32."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, FF), nn.Linear(FF, D)

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (torch.tanh(self.fc2(torch.tanh(self.fc1(x)))).float() - w).pow(2).mean()


def _model() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    return MLP().to(BF16), (torch.randn(B, S, D).to(BF16), torch.randn(B, S, D))


def _reference(model: nn.Module, batch: tuple) -> tuple[float, dict[str, torch.Tensor]]:
    """One process with the same rule, written out: float32 masters of the bfloat16 parameters, cast to bfloat16
    for the forward pass; the loss and the masters' gradients."""
    from torch.func import functional_call

    masters = {n: p.detach().float().requires_grad_() for n, p in model.named_parameters()}
    loss = functional_call(model, {n: m.to(BF16) for n, m in masters.items()}, batch)
    loss.backward()
    return float(loss), {n: m.grad for n, m in masters.items()}


def _layouts(graph: Any, p: int, hidden: bool) -> dict[str, Any]:
    """Every operator splits ``p`` ways the dimension of extent FF where it has one (and ``hidden``), else its
    sequence (its first dimension of extent S)."""
    from shardplan.layout import Layout

    out = {}
    for op in graph.operators:
        pick = next((d for d in op.dim_names if op.extents[d] == FF and hidden), None) or next(
            d for d in op.dim_names if op.extents[d] == S)
        out[op.name] = Layout.flat(op.dim_names, tuple(p if d == pick else 1 for d in op.dim_names), p)
    return out


def _plan(world: int, hidden: bool, master: bool, **choices: Any) -> Any:
    """The MLP's plan with the layouts of :func:`_layouts` and the memory choices ``choices``, as a
    :class:`shardplan.result.Plan`."""
    from shardplan.cost import build_tables
    from shardplan.fit import plan_with_choices
    from shardplan.planner import from_spmd
    from shardplan.spmd import plan_from_configs
    from shardplan.torch.frontend import trace

    model, batch = _model()
    graph, _ = trace(torch_cases._clone(model), batch)
    tables = build_tables(graph, torch_cases.toy_machine(world), cutoff=1)
    fit = plan_with_choices(plan_from_configs(tables, _layouts(graph, world, hidden)), master_weights=master,
                            **choices)
    return from_spmd(fit)


def _run(name: str, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import shardplan.torch as st
    from shardplan.result import Plan

    hidden = name in ("tp_loaded", "without")
    choices = {"zero3": {"stage": 3}, "micro": {"micro_batches": 2}}.get(name, {})
    plan = _plan(world, hidden, name != "without", **choices)
    if name == "tp_loaded":
        plan = Plan.from_json(plan.to_json())
    model, batch = _model()
    loss0, grads0 = _reference(torch_cases._clone(model), batch)
    mesh = init_device_mesh("cpu", (world,))
    pm = st.apply(plan, torch_cases._clone(model), batch, mesh)
    loss = pm.step(*batch)
    named = pm.named_dparameters()
    top = max(float(g.abs().max()) for g in grads0.values())
    err = max(float((named[n].grad.full_tensor().float() - g).abs().max()) for n, g in grads0.items())
    bf16_grid = all(bool((named[n].grad.full_tensor().to(BF16).float() == named[n].grad.full_tensor().float()).all())
                    for n in grads0)
    out: dict[str, Any] = {
        "rule": plan.stats.get("memory_rules", {}).get("master_weights"), "master_weights": pm.choices.master_weights,
        "rel_loss": abs(float(loss) - loss0) / abs(loss0), "rel_grad": err / top, "grads_on_bf16_grid": bf16_grid,
        "param_dtypes": sorted({str(p.dtype) for p in named.values()}),
        "grad_dtypes": sorted({str(p.grad.dtype) for p in named.values()}),
        "as_planned": all(isinstance(p, DTensor) and tuple(p.placements) == tuple(pm.param_placements[n])
                          for n, p in pm.named_parameters()),
        "sharded": sorted(n for n, p in pm.named_parameters() if any(q.is_shard() for q in p.placements)),
        "loss": float(loss), "grads": {n: p.grad.full_tensor().float().tolist() for n, p in named.items()}}
    if name in ("tp_loaded", "without"):
        opt = pm.optimizer(torch.optim.Adam, lr=1e-2)
        # copies (a replicated DTensor's full_tensor is its local tensor, which the step updates in place)
        grads = {n: p.grad.full_tensor().float().clone() for n, p in pm.named_parameters()}
        start = {n: p.detach().full_tensor().float().clone() for n, p in pm.named_parameters()}
        opt.step()
        state = [(p, opt.state[p]) for p in pm.parameters()]
        out["state_dtypes"] = sorted({str(s[k].dtype) for _, s in state for k in ("exp_avg", "exp_avg_sq")})
        out["state_as_param"] = all(tuple(s["exp_avg"].placements) == tuple(p.placements) for p, s in state)
        # one process's Adam on float32 copies of the start, with the run's own gradients
        ref = {n: v.clone().requires_grad_() for n, v in start.items()}
        for n, v in ref.items():
            v.grad = grads[n]
        torch.optim.Adam(list(ref.values()), lr=1e-2).step()
        new = {n: p.detach().full_tensor() for n, p in pm.named_parameters()}
        out["update_err"] = max(float((new[n].float() - ref[n].detach()).abs().max()) for n in new)
        w = new["fc1.weight"].float()
        out["off_bf16_grid"] = float((w.to(BF16).float() != w).float().mean())
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("torch_master_weights") / "results.json"
    return torch_cases.run_distributed(["tp_loaded", "zero3", "micro", "without"], WORLD, str(out), run_one=_run)


def _ok(r: dict[str, Any]) -> None:
    assert "error" not in r, r.get("error")


@pytest.mark.parametrize("name", ["tp_loaded", "zero3", "micro"])
def test_master_weights_run_as_one_process_with_the_rule(results, name):
    """Loss and float32 gradients equal one process's within 4 U of the loss and of the largest gradient, two
    bfloat16 spacings at its magnitude (the run rounds a product's partial sums, or a weight's partial gradients,
    to bfloat16 before summing them over the devices, so a result lands a spacing or two from one process's;
    measured: 1.92 U, one spacing, in every case; the loss 0.02 U); parameters and gradients float32, the
    parameters placed as planned (ZeRO-3: sharded), and every gradient a bfloat16 value widened (the program ran
    in bfloat16)."""
    r = results[name]
    _ok(r)
    assert r["master_weights"] and r["rule"] is True, r
    assert r["rel_loss"] <= 4 * U and r["rel_grad"] <= 4 * U, r
    assert r["param_dtypes"] == ["torch.float32"] and r["grad_dtypes"] == ["torch.float32"], r
    assert r["as_planned"] and r["grads_on_bf16_grid"], r
    if name == "zero3":  # every weight and bias cut over the 4 processes
        assert r["sharded"] == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"], r
    if name == "tp_loaded":  # column- then row-parallel: fc2's bias stays whole
        assert r["sharded"] == ["fc1.bias", "fc1.weight", "fc2.weight"], r


def test_adam_steps_the_float32_masters_with_float32_state(results):
    r = results["tp_loaded"]
    _ok(r)
    assert r["state_dtypes"] == ["torch.float32"] and r["state_as_param"], r
    assert r["update_err"] <= 1e-6, r
    assert r["off_bf16_grid"] > 0.9, r  # the masters keep what bfloat16 cannot


def test_without_the_rule_parameters_gradients_and_state_stay_bfloat16(results):
    r = results["without"]
    _ok(r)
    assert not r["master_weights"] and r["rule"] is False, r
    assert r["param_dtypes"] == ["torch.bfloat16"] and r["grad_dtypes"] == ["torch.bfloat16"], r
    assert r["state_dtypes"] == ["torch.bfloat16"] and r["as_planned"], r
    assert r["off_bf16_grid"] == 0.0, r
    # the run with the rule reads the same bfloat16 values and reduces in bfloat16: the same loss and gradients,
    # bit for bit, widened
    m = results["tp_loaded"]
    _ok(m)
    assert m["loss"] == r["loss"] and m["grads"] == r["grads"]
