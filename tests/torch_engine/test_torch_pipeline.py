"""PyTorch pipelining driven by the searched plan: 4 gloo processes (CPU) vs one process.

Cases: 4 stages of one process under 1F1B, GPipe, interleaved 1F1B (2 chunks per process) and ZB-H1 (on
Hugging Face GPT-2);
2 stages of 2 processes, each stage running its intra-stage layouts as DTensor placements; a head
tied to the embedding (a parameter of the first and the last stage, its gradients summed).

One process group for the module: the fixture spawns 4 workers once (tests/torch_pipeline_cases.py)
that run every case and report the differences and the plan they ran.
"""

from __future__ import annotations

import pytest

import torch  # noqa: F401

import torch_pipeline_cases  # noqa: E402  (tests/ is on sys.path, see conftest.py)

pytestmark = pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out

WORLD = 4
ALL = list(torch_pipeline_cases.CASES)
CASES = [c for c in ALL if c != "too_few_micro_batches"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("torch_pipeline") / "results.json"
    return torch_pipeline_cases.run_distributed(ALL, WORLD, str(out))


@pytest.mark.parametrize("name", CASES)
def test_pipelined_loss_and_grads_equal_single_process(results, name):
    r = results[name]
    assert "error" not in r, r.get("error")
    assert r["rel_loss"] <= 1e-5, (r["loss"], r["loss0"])
    assert r["rel_grad"] <= 1e-4, (r["grad_err"], r["grad_scale"])
    shared = {"tied": ["embed.weight"], "hf_gpt2": ["model.transformer.wte.weight"],
              "zb-h1": ["model.transformer.wte.weight"]}.get(name, [])
    # a tied embedding has a copy in the first and in the last stage
    assert r["params_held"] == r["params_total"] + len(shared), "every parameter is held by exactly one stage"
    assert r["shared"] == shared


@pytest.mark.parametrize("name", CASES)
def test_the_searched_plan_is_what_runs(results, name):
    r = results[name]
    assert "error" not in r, r.get("error")
    lay = r["layout"]
    # only the tied table's copy in the last stage lies outside that stage's units
    assert r["misplaced"] == (1 if name in ("tied", "hf_gpt2", "zb-h1") else 0), "a rank holds a parameter outside its stages"
    q = 2 if name == "dtensor" else 1
    assert all(d == q for *_, d in lay["stages"])
    want = {"1f1b": ("1f1b", 1, "Schedule1F1B"), "gpipe": ("1f1b", 1, "ScheduleGPipe"),
            "interleaved": ("interleaved", 2, "ScheduleInterleaved1F1B"), "dtensor": ("1f1b", 1, "Schedule1F1B"),
            "zb-h1": ("zb-h1", 1, "ScheduleInterleavedZeroBubble"),
            "tied": ("1f1b", 1, "Schedule1F1B"), "hf_gpt2": ("1f1b", 1, "Schedule1F1B")}[name]
    assert (lay["schedule"], lay["chunks"], r["schedule"]) == want
    groups = WORLD // q
    assert len(lay["stages"]) == groups * lay["chunks"]
    assert [s[2] for s in lay["stages"]] == [q * (j % groups) for j in range(len(lay["stages"]))]
    if name in ("gpipe", "interleaved", "zb-h1"):
        assert lay["micro_batches"] == 4


def test_stages_of_two_processes_run_their_layouts_as_dtensors(results):
    r = results["dtensor"]
    assert "error" not in r, r.get("error")
    assert r["dtensor_params"] == 2 * r["params_total"], "each of a stage's 2 processes holds DTensor parameters"
    assert r["split_params"] > 0, "the toy machine makes splitting pay: some parameter must be sharded"
    assert r["dtensor_params"] == 0 or results["1f1b"]["dtensor_params"] == 0


def test_values_are_carried_to_the_stages_that_read_them(results):
    """The labels enter stage 0 and reach the loss in the last stage; the embedding, read again after the
    last block, passes through the stages in between."""
    r = results["1f1b"]
    assert "error" not in r, r.get("error")
    carried = r["carried"]
    assert carried[0] == ["ids", "labels"]
    assert all("labels" in ins for ins in carried[1:])
    skip = r["layout"]["units"].index("mul,add_6")
    reader = next(j for j, (a, b, *_) in enumerate(r["layout"]["stages"]) if a <= skip < b)
    assert reader >= 2, "the skip connection should cross at least one stage"
    assert all("embedding" in carried[j] for j in range(1, reader + 1))
    assert all("embedding" not in carried[j] for j in range(reader + 1, len(carried)))


def test_a_1f1b_plan_with_fewer_micro_batches_than_stages_is_refused(results):
    err = results["too_few_micro_batches"].get("error", "")
    assert "ShardplanError" in err and "at least as many micro-batches as stages" in err
