"""PyTorch through the one planning call: ``st.plan`` -> ``Plan.to_json`` -> ``Plan.from_json`` -> ``st.apply``.

4 gloo processes (CPU). Rank 0 plans Hugging Face GPT-2 as its authors wrote it with a memory budget and
writes the plan as JSON; every rank loads that JSON and runs it: the sharded module has the model's own
parameter names, AdamW with two groups by name steps on it, and loss and gradients equal the unsharded
model's. A pipeline plan, searched on rank 0 and loaded from its JSON on every rank, runs on
``torch.distributed.pipelining`` with the unsharded loss and gradients. With no machine given, the plan
names the machine detected from the mesh.

A plan is made once and shipped as JSON, as a user plans once for a job: the checks read rank 0's plan and
every rank's run. Every rank planning for itself (the library's contract that all find the same plan) is
what ``st.parallelize`` does in the other gloo files (tests/torch_engine/test_torch_names.py and others).
"""

from __future__ import annotations

from typing import Any

import pytest

import torch

import torch_cases  # noqa: E402  (tests/ is on sys.path, see conftest.py)

pytestmark = pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out

WORLD = 4
CASES = ["one_program", "pipeline", "detected"]


def _grads_close(got: dict[str, Any], ref: torch.nn.Module) -> float:
    want = {n: p.grad for n, p in ref.named_parameters()}
    worst = 0.0
    for n, g in got.items():
        g = g.full_tensor() if hasattr(g, "full_tensor") else g
        worst = max(worst, float((g - want[n]).abs().max()) / max(float(want[n].abs().max()), 1e-12))
    return worst


def run_one_program(world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    import shardplan.torch as st

    torch.manual_seed(0)
    model, batch = torch_cases.make_hf_gpt2()
    mesh = init_device_mesh("cpu", (world,))
    machine = torch_cases.toy_machine(world)

    def make() -> tuple[Any, Any]:
        free = st.plan(torch_cases._clone(model), batch, mesh, machine=machine, fit=False)
        budget = 0.6 * free.memory["peak_bytes"]
        p = st.plan(torch_cases._clone(model), batch, mesh, machine=machine, budget=budget, stages=False)
        return p, (p, budget)

    q, made = torch_cases.planned_on_rank_0(make)
    pm = st.apply(q, torch_cases._clone(model), batch, mesh)
    ref = torch_cases._clone(model)
    loss0 = ref(*batch)
    loss0.backward()
    loss = pm.step(*batch) if q.micro_batches > 1 else pm(*batch)
    if q.micro_batches == 1:
        loss.backward()
    named = list(pm.named_parameters())
    groups = [{"params": [t for n, t in named if not n.endswith("bias")], "weight_decay": 0.1},
              {"params": [t for n, t in named if n.endswith("bias")], "weight_decay": 0.0}]
    torch.optim.AdamW(groups, lr=1e-3).step()
    p, budget = made if made is not None else (None, None)  # rank 0's plan (the results read are rank 0's)
    return {"fits": p is not None and p.memory["peak_bytes"] <= budget, "same": q == p, "names": [n for n, _ in named],
            "names0": [n for n, _ in model.named_parameters()], "rel_loss": abs(float(loss) - float(loss0)) /
            abs(float(loss0)), "rel_grad": _grads_close({n: t.grad for n, t in named}, ref),
            "choices": bool(q.state_sharding or q.recomputed or q.micro_batches > 1)}


def run_pipeline(world: int) -> dict[str, Any]:
    import shardplan.torch as st
    from shardplan.pipeline.api import pipeline_solve
    from shardplan.planner import from_pipeline
    from shardplan.torch.staged import Tracer

    from torch_pipeline_cases import make_hf_gpt2  # the GPT-2 the pipeline executor is tested on

    torch.manual_seed(0)
    model, batch = make_hf_gpt2()

    def make() -> tuple[Any, None]:
        tracer = Tracer(torch_cases._clone(model), batch)
        result = pipeline_solve(tracer, tracer.batch, torch_cases.toy_machine(world), micro_batches=(4,), sizes=(1,),
                                cutoff=1, divides_p=True)
        return from_pipeline(result), None

    q, _ = torch_cases.planned_on_rank_0(make)
    pipe = st.apply(q, torch_cases._clone(model), batch)
    ref = torch_cases._clone(model)
    loss0 = ref(*batch)
    loss0.backward()
    loss = pipe.step(*batch)
    worst = torch.tensor(_grads_close(pipe.named_grads(), ref))
    torch.distributed.all_reduce(worst, op=torch.distributed.ReduceOp.MAX)
    return {"stages": q.num_stages, "rel_loss": abs(float(loss) - float(loss0)) / abs(float(loss0)),
            "rel_grad": float(worst)}


def run_detected(world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    import shardplan.torch as st

    model, batch = torch_cases.make_mlp()
    p = st.plan(model, batch, init_device_mesh("cpu", (world,)), stages=False)
    return {"machine": p.machine.name, "devices": p.machine.num_devices}


def run_one(name: str, world: int) -> dict[str, Any]:
    return {"one_program": run_one_program, "pipeline": run_pipeline, "detected": run_detected}[name](world)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("torch_plan") / "results.json"
    return torch_cases.run_distributed(CASES, WORLD, str(out), run_one=run_one)


def _ok(results: dict, name: str) -> dict:
    r = results[name]
    assert "error" not in r, r.get("error")
    return r


def test_a_plan_from_json_runs_under_its_budget_with_the_models_names(results):
    r = _ok(results, "one_program")
    assert r["fits"] and r["same"] and r["choices"]
    assert r["names"] == r["names0"]
    assert r["rel_loss"] <= 1e-5 and r["rel_grad"] <= 1e-4


def test_a_pipeline_from_json_runs_with_the_unsharded_numerics(results):
    r = _ok(results, "pipeline")
    assert r["stages"] == WORLD
    assert r["rel_loss"] <= 1e-5 and r["rel_grad"] <= 1e-4


def test_planning_with_no_machine_names_the_detected_one(results):
    r = _ok(results, "detected")
    assert r["machine"].startswith("cpu (detected: cpu)") and r["devices"] == WORLD
