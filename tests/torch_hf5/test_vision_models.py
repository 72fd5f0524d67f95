"""torchvision's and timm's image classifiers as their authors wrote them, at tiny sizes, every operator
described: plan on 8 gloo processes, run, compare with one process.

Runs in the second test environment (``.venv-hf5``, ``pip install -e '.[hf5]'``), which has torchvision 0.28.0
and timm 1.0.29; see :func:`torch_cases.enter_torchvision` for how torchvision is imported beside the CPU
torch. The models (torch_cases): torchvision ``mobilenet_v3_small`` at a quarter of its width (hardswish,
hardsigmoid squeeze-and-excitation gates, depthwise convolutions, batch norm: DTensor has no
``hardswish_backward`` rule, so the run must not hand it that operator), timm ``vit_tiny_patch16_224`` on
32 x 32 images in 8 x 8 patches with 2 blocks of width 48, timm ``convnext_atto`` with one block per stage
(7 x 7 depthwise convolutions, channel-last layer norm, layer scale). Each is built by its library's own
constructor (no weights), trained one step on 16 random 32 x 32 images: ``cross_entropy(model(x), y)``.
``python tests/torch_cases.py 8 tv_mobilenet_v3`` runs one and prints its plan.
"""

from __future__ import annotations

from importlib.metadata import version

import pytest
import torch_cases  # noqa: E402  (tests/ is on sys.path, see conftest.py)

pytestmark = pytest.mark.slow

MODELS = ["tv_mobilenet_v3", "timm_vit", "timm_convnext"]
WORLD = 8


def test_this_environment_has_the_pinned_vision_libraries():
    assert (version("torchvision"), version("timm")) == ("0.28.0", "1.0.29")
    assert type(torch_cases.torchvision_models().mobilenet_v3_small()).__module__ == "torchvision.models.mobilenetv3"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = tmp_path_factory.mktemp("vision_models") / "results.json"
    return torch_cases.run_distributed(MODELS, WORLD, str(path))


@pytest.mark.parametrize("name", MODELS)
def test_sharded_loss_and_grads_equal_single_process(results, name):
    torch_cases.assert_runs_as_unsharded(results[name])


@pytest.mark.parametrize("name", MODELS)
def test_no_operator_is_described_conservatively(results, name):
    torch_cases.assert_nothing_conservative(results[name])


def test_every_operator_of_mobilenet_is_split(results):
    """The plan on the toy machine splits every operator of MobileNetV3 (its hardswishes included, whose
    backward DTensor has no rule for), and the run still matches one process (above)."""
    r = results["tv_mobilenet_v3"]
    assert r["split_ops"] == r["operators"] == 158
