"""PyTorch end to end: plan, shard with DTensor, run on 4 gloo processes (CPU), compare with one process.

One process group for the whole module: the fixture spawns 4 workers once
(tests/torch_cases.py) that run every model and report the differences.
"""

from __future__ import annotations

import pytest

import torch  # noqa: F401
import transformers  # noqa: F401

import torch_cases  # noqa: E402  (tests/ is on sys.path, see conftest.py)

pytestmark = pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out

WORLD = 4
MODELS = ["mlp", "llama_block", "cnn", "hf_gpt2", "hf_llama", "unsupported", "ops_zoo"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("torch_dist") / "results.json"
    return torch_cases.run_distributed(MODELS, WORLD, str(out))


@pytest.mark.parametrize("name", MODELS)
def test_sharded_loss_and_grads_equal_single_process(results, name):
    r = results[name]
    assert "error" not in r, r.get("error")
    assert r["rel_loss"] <= 1e-5, (r["loss"], r["loss0"])
    assert r["rel_grad"] <= 1e-4, (r["grad_err"], r["grad_scale"])
    assert r["missing"] == []


@pytest.mark.parametrize("name", MODELS)
def test_layouts_are_the_planned_tiles(results, name):
    """Parameters hold the cost model's tiles on every rank; gradients come back laid out like them."""
    r = results[name]
    assert "error" not in r, r.get("error")
    assert r["tiles_ok"]
    assert r["grad_layouts_ok"]
    assert r["split_ops"] > 0, "the toy machine makes splitting pay: some operator must be split"


def test_only_the_unsupported_operator_is_conservative(results):
    for name in MODELS:
        if name != "unsupported":
            assert results[name]["warnings"] == [], name
    (w,) = results["unsupported"]["warnings"]
    assert "aten.logcumsumexp.default" in w and "'scan'" in w
