"""A plan searched with overlapped tensor-parallel collectives (``overlap_tp=True``) runs on 4 gloo processes
with one process's loss and gradients.

The residual MLP of test_partial_torch (two column- then row-parallel pairs, layer norms, an MSE loss),
planned by ``st.plan`` on a machine of 100 MFLOP/s and 100 MB/s links: without the overlap the search keeps
the norms and additions whole and nothing partial; with it the products hide their gathers and
reduce-scatters and the optimum is Megatron-LM's sequence parallelism (three partial layouts, the additions
and norms split over the sequence), the hidden edges counted in the plan. The run is the plan's layouts on
DTensor (the overlap is a cost the search weighs; chunking the collective is the runtime's schedule), so
what must hold is that the plan it picks computes the same step, its partial sums reduce-scattered.
"""

from __future__ import annotations

from typing import Any

import pytest

import torch
import torch_cases  # noqa: E402  (tests/ is on sys.path, see conftest.py)

from test_partial_torch import sp_reference  # noqa: E402  (tests/torch_engine is on sys.path under pytest)

pytestmark = pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out

WORLD = 4


def run_overlap(name: str, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    import shardplan.torch as st
    from shardplan.machine import Machine

    model, batch, ref, loss0 = sp_reference()
    mesh = init_device_mesh("cpu", (world,))
    machine = Machine(world, peak_flops=1e8, bandwidth=1e8, name="slow")
    out: dict[str, Any] = {}
    for overlap in (False, True):
        plan = st.plan(torch_cases._clone(model), batch, mesh, machine=machine, fit=False, stages=False,
                       overlap_tp=overlap)
        layouts = {n: c.layout for n, c in plan.stages[0].operators.items()}
        row: dict[str, Any] = {
            "step": plan.step_time, "hidden": plan.stats.get("overlap_tp"),
            "partial": sorted(n for n, lay in layouts.items() if lay.partial),
            "sequence_split": sorted(n for n, lay in layouts.items()
                                     if n.split("/")[-1].startswith(("add", "layer_norm")) and lay.split[1] > 1)}
        if overlap:
            pm = st.apply(plan, torch_cases._clone(model), batch, mesh)
            with CommDebugMode() as comm:
                loss = pm(*batch)
                loss.backward()
            worst = 0.0
            named = dict(pm.named_dparameters())
            for n, p_ in ref.named_parameters():
                g = named[n].grad.full_tensor()
                worst = max(worst, float((g - p_.grad).abs().max()) / max(float(p_.grad.abs().max()), 1e-12))
            row.update(rel_loss=abs(float(loss.detach()) - float(loss0.detach())) / abs(float(loss0.detach())),
                       rel_grad=worst,
                       reduce_scatters=sum(int(v) for k, v in comm.get_comm_counts().items()
                                           if "reduce_scatter" in str(k)))
        out[f"overlap={overlap}"] = row
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("torch_overlap") / "results.json"
    return torch_cases.run_distributed(["overlap"], WORLD, str(out), run_one=run_overlap)


def test_the_plan_searched_with_overlap_is_sequence_parallel_and_runs_as_unsharded(results):
    r = results["overlap"]
    assert "error" not in r, r.get("error")
    plain, ov = r["overlap=False"], r["overlap=True"]
    assert plain["partial"] == [] and plain["hidden"] is None
    assert len(ov["partial"]) == 3 and ov["hidden"]["edges"] == 3 and ov["hidden"]["hidden_seconds"] > 0
    assert ov["step"] < plain["step"]
    assert len(ov["sequence_split"]) == 4  # both residual additions and both layer norms split the sequence
    assert ov["rel_loss"] <= 1e-5 and ov["rel_grad"] <= 1e-4, ov
    assert ov["reduce_scatters"] >= 2  # the two row-parallel outputs' partial sums, into the sequence split
