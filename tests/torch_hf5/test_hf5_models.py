"""The Hugging Face models on the transformers release PyTorch users install today (5.x), called as documented,
every operator described: plan on 4 gloo processes (three of the models on 8), run, compare with one process.

Runs only in the second test environment (``.venv-hf5``, ``pip install -e '.[hf5]'``; ``make test`` runs it
after the main suite, ``make test-hf5`` alone): transformers 5 has no Flax models, which the JAX tests of
the main environment need (``tests/conftest.py`` collects this folder there only). Each model is built by
``transformers`` from a tiny config (no weights: 2 layers, hidden 32, vocabulary 64, batch 8 x 8 tokens) and
called as ``model(input_ids=ids, labels=labels).loss`` with the library's defaults, the KV cache included.
The decoders GPT-2, Llama (grouped-query attention), Mistral, Qwen2, Gemma 2 (eager attention, sliding
window 4), Phi, GPT-NeoX, Falcon and BLOOM (eager attention), OPT, the encoder-decoder T5 and the masked
LM RoBERTa (position ids from the padding mask by ``cumsum`` and ``gather``), and the mixtures of experts
Mixtral and Qwen2-MoE, which dispatch tokens to experts by sorting in 5.x (their 4.x forward loops over the
experts that were hit, which ``torch.export`` cannot capture; OPT's 4.x forward draws a random layer-drop
decision in training mode). The main environment keeps GPT-2 on transformers 4.57.6
(``tests/torch_engine/test_hf_models.py``). ``python tests/torch_cases.py 8 hf_mixtral`` runs one and
prints its plan.

torchvision's and timm's image classifiers run in the same launch, as their authors wrote them at tiny
sizes (this environment has torchvision 0.28.0 and timm 1.0.29; see :func:`torch_cases.enter_torchvision`
for how torchvision is imported beside the CPU torch): torchvision ``mobilenet_v3_small`` at a quarter of
its width (hardswish, hardsigmoid squeeze-and-excitation gates, depthwise convolutions, batch norm: DTensor
has no ``hardswish_backward`` rule, so the run must not hand it that operator), timm
``vit_tiny_patch16_224`` on 32 x 32 images in 8 x 8 patches with 2 blocks of width 48, timm
``convnext_atto`` with one block per stage (7 x 7 depthwise convolutions, channel-last layer norm, layer
scale). Each is built by its library's own constructor (no weights), trained one step on 16 random 32 x 32
images: ``cross_entropy(model(x), y)``.
"""

from __future__ import annotations

from importlib.metadata import version

import pytest
import torch_cases  # noqa: E402  (tests/ is on sys.path, see conftest.py)
import transformers

pytestmark = pytest.mark.slow

HF_MODELS = ["hf_gpt2_cache", "hf_llama_cache", "hf_mistral", "hf_qwen2", "hf_gemma2", "hf_phi", "hf_gpt_neox",
             "hf_falcon", "hf_bloom", "hf_opt", "hf_t5", "hf_roberta", "hf_mixtral", "hf_qwen2_moe"]
MODELS = HF_MODELS + ["tv_mobilenet_v3", "timm_vit", "timm_convnext"]
# operators each model's training step is described with on transformers 5.24.0 and torch 2.13.0 (every ATen
# call on an activation or a parameter; masks, position ids and the other constants are not operators)
OPERATORS = {"hf_gpt2_cache": 86, "hf_llama_cache": 119, "hf_mistral": 119, "hf_qwen2": 119, "hf_gemma2": 172,
             "hf_phi": 102, "hf_gpt_neox": 84, "hf_falcon": 88, "hf_bloom": 83, "hf_opt": 59, "hf_t5": 125,
             "hf_roberta": 62, "hf_mixtral": 173, "hf_qwen2_moe": 187}
# Most models run on 4 processes; three run on 8 (a mesh of three prime factors) in a second launch: Llama,
# Mixtral, and MobileNetV3, whose plan splits every operator on 8 (not on 4). Eight
# gloo processes on CI's two cores take about ten times four's CPU per step (GPT-2 with its cache: 32.2 s
# against 2.8 s), so the rest are checked on 4.
WORLD = 4
WIDE = ["hf_llama_cache", "hf_mixtral", "tv_mobilenet_v3"]
WIDE_WORLD = 8


def test_this_environment_has_transformers_5():
    assert transformers.__version__ == "5.24.0"


def test_this_environment_has_the_pinned_vision_libraries():
    assert (version("torchvision"), version("timm")) == ("0.28.0", "1.0.29")
    assert type(torch_cases.torchvision_models().mobilenet_v3_small()).__module__ == "torchvision.models.mobilenetv3"


@pytest.mark.parametrize("name", HF_MODELS)
def test_models_are_built_with_the_kv_cache_on(name):
    """The models run as the library builds them: no ``use_cache=False`` (the cache update is part of the step)."""
    model, _ = torch_cases.CASES[name]()
    assert model.model.config.use_cache is True


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every model's run: those of ``WIDE`` on ``WIDE_WORLD`` processes, the others on ``WORLD``."""
    folder = tmp_path_factory.mktemp("hf5_models")
    narrow = [n for n in MODELS if n not in WIDE]
    out = torch_cases.run_distributed(narrow, WORLD, str(folder / "narrow.json"))
    out.update(torch_cases.run_distributed(WIDE, WIDE_WORLD, str(folder / "wide.json")))
    return out


def test_the_wide_launch_runs_on_eight_processes(results):
    """The models of the second launch ran on 8 processes and their plans split an operator over all 8."""
    for name in WIDE:
        assert (results[name]["world"], results[name]["widest"]) == (WIDE_WORLD, WIDE_WORLD)


@pytest.mark.parametrize("name", MODELS)
def test_sharded_loss_and_grads_equal_single_process(results, name):
    torch_cases.assert_runs_as_unsharded(results[name])


@pytest.mark.parametrize("name", MODELS)
def test_no_operator_is_described_conservatively(results, name):
    torch_cases.assert_nothing_conservative(results[name])


@pytest.mark.parametrize("name", HF_MODELS)
def test_every_operator_is_in_the_plan(results, name):
    """The whole step is described: the operator count of each model is the one measured when it was added
    (an operator lost to a constant or an identity would change it)."""
    assert "error" not in results[name], results[name].get("error")
    assert results[name]["operators"] == OPERATORS[name]


def test_every_operator_of_mobilenet_is_split(results):
    """The plan on the toy machine splits every operator of MobileNetV3 (its hardswishes included, whose
    backward DTensor has no rule for), and the run still matches one process (above)."""
    r = results["tv_mobilenet_v3"]
    assert r["split_ops"] == r["operators"] == 158
