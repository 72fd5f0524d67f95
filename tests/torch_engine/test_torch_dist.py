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
# Hugging Face GPT-2 and Llama: the same checks on the same plans in tests/torch_engine/test_torch_names.py
# (test_sharded_loss_and_grads_equal_single_process), whose launch plans them once for both files
MODELS = ["mlp", "llama_block", "cnn", "unsupported", "ops_zoo"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("torch_dist") / "results.json"
    return torch_cases.run_distributed(MODELS, WORLD, str(out))


@pytest.mark.parametrize("name", MODELS)
def test_sharded_loss_and_grads_equal_single_process(results, name):
    """Loss and gradients equal one process's; parameters hold the cost model's tiles on every rank and
    gradients come back laid out like them."""
    torch_cases.assert_runs_as_unsharded(results[name])


def test_only_the_unsupported_operator_is_conservative(results):
    for name in MODELS:
        if name != "unsupported":
            assert results[name]["warnings"] == [], name
    (w,) = results["unsupported"]["warnings"]
    assert "aten.logcumsumexp.default" in w and "'scan'" in w
