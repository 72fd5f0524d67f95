"""The model zoo: every model builds and validates, with the paper's sizes and shapes."""

from __future__ import annotations

import math

import pytest

from shardplan.errors import ShardplanError
from shardplan.models import MODELS, get_model, model_spec, models_table

# (vertices, edges) at the default sizes
COUNTS = {
    "alexnet": (13, 12),
    "inception_v3": (219, 253),
    "resnet101": (245, 277),
    "resnet50": (126, 141),
    "densenet121": (306, 363),
    "rnnlm": (4, 3),
    "transformer": (196, 260),
    "transformer_big": (196, 260),
    "gpt": (292, 387),
    "moe": (40, 51),  # FlashAttention's core: one vertex and one edge fewer per layer than unfused
}


@pytest.mark.parametrize("name", list(MODELS))
def test_every_model_builds_with_expected_counts(name):
    g = get_model(name)
    assert (len(g), len(g.edges)) == COUNTS[name]
    assert g.name == name
    # a weakly connected DAG with one loss at the end
    nxg = g.to_networkx()
    import networkx as nx

    assert nx.is_weakly_connected(nxg)
    sinks = [n for n in nxg if nxg.out_degree(n) == 0]
    assert sinks == ["softmax"]


def test_registry_cutoffs_and_experts():
    for name in ("alexnet", "inception_v3", "resnet101", "densenet121"):
        assert MODELS[name].cutoff == 4 and MODELS[name].expert == "one_weird_trick"
    assert MODELS["rnnlm"].cutoff == 1 and MODELS["rnnlm"].expert == "gnmt"
    for name in ("transformer", "transformer_big", "gpt"):
        assert MODELS[name].cutoff == 1 and MODELS[name].expert == "megatron"


def test_alexnet_layers_and_shapes():
    g = get_model("alexnet")
    assert [op.name for op in g if op.kind == "conv2d"] == [f"conv{i}" for i in range(1, 6)]
    assert [op.name for op in g if op.kind == "dense"] == ["fc1", "fc2", "fc3"]
    assert g["fc1"].inputs[0].shape == (128, 9216)
    assert g["fc1"].label == "bnc" and g["conv1"].label == "bchwnrs" and g["softmax"].label == "bn"
    assert g["conv1"].output.shape == (128, 64, 55, 55)
    assert g["fc3"].output.shape == (128, 1000)


def test_inception_v3_modules_and_shapes():
    g = get_model("inception_v3")
    assert g["E2/concat"].output.shape == (128, 2048, 8, 8)
    assert g["D/concat"].output.shape == (128, 1280, 8, 8)
    assert g["B/concat"].output.shape == (128, 768, 17, 17)
    assert g["A3/concat"].output.shape == (128, 288, 35, 35)
    assert g["stem/pool2"].output.shape == (128, 192, 35, 35)
    assert g["fc"].inputs[0].shape == (128, 2048)
    kinds = [op.kind for op in g]
    assert kinds.count("conv2d") == 94 and kinds.count("batch_norm") == 94 and kinds.count("concat") == 15
    modules = {op.name.split("/")[0] for op in g if "/" in op.name}
    assert modules == {"stem", "A1", "A2", "A3", "B", "C1", "C2", "C3", "C4", "D", "E1", "E2"}
    # factorised convolutions of module C: 1x7 and 7x1 kernels
    assert g["C1/branch7x7_2"].extents["r"] == 1 and g["C1/branch7x7_2"].extents["s"] == 7
    assert g["C1/branch7x7_3"].extents["r"] == 7 and g["C1/branch7x7_3"].extents["s"] == 1


def test_resnet101_shapes():
    g = get_model("resnet101")
    assert g["res5.2/add"].output.shape == (128, 2048, 7, 7)
    assert g["fc"].inputs[0].shape == (128, 2048)
    assert sum(op.kind == "conv2d" for op in g) == 104  # 1 stem + 33 blocks x 3 + 4 projections
    assert sum(1 for op in g if op.name.endswith("/add")) == 33
    assert [n for n in (op.name for op in g) if n.endswith("/proj")] == [
        "res2.0/proj", "res3.0/proj", "res4.0/proj", "res5.0/proj"]


def test_densenet121_shapes_and_connectivity():
    g = get_model("densenet121")
    assert g["final_bn"].output.shape == (128, 1024, 7, 7)
    assert g["D1.6/concat"].output.shape == (128, 256, 56, 56)
    dense = get_model("densenet121", connectivity="dense")
    assert len(dense) == len(g)
    assert len(dense.edges) > 2 * len(g.edges)
    assert dense["D4.16/concat"].output.shape == g["D4.16/concat"].output.shape


def test_rnnlm_dims():
    g = get_model("rnnlm")
    assert [op.name for op in g] == ["embedding", "lstm", "fc", "softmax"]
    assert g["embedding"].label == "bsdv" and g["lstm"].label == "lbsde" and g["fc"].label == "bsvd"
    assert g["lstm"].extents == {"l": 2, "b": 64, "s": 256, "d": 2048, "e": 2048}
    assert g["fc"].extents["v"] == 100_000


def test_transformer_structure():
    g = get_model("transformer")
    assert g["enc1/q"].extents == {"b": 64, "s": 256, "h": 8, "k": 64, "d": 512}
    assert g["enc1/scores"].norm_dims == ("t",)
    assert g["dec6/ln3"].output.shape == (64, 256, 512)
    assert g["fc"].extents["v"] == 50_000
    # the encoder output feeds every decoder layer's cross-attention keys and values
    consumers = {g.operators[e.dst].name for e in g.edges if g.operators[e.src].name == "enc6/ln2"}
    for i in range(1, 7):
        assert {f"dec{i}/cross_k", f"dec{i}/cross_v"} <= consumers
    big = get_model("transformer_big")
    assert big["enc1/q"].extents["h"] == 16 and big["enc1/ffn1"].extents["e"] == 4096


def test_gpt_sizes():
    g = get_model("gpt")
    assert g["L24/ffn1"].extents == {"b": 64, "s": 2048, "e": 8192, "d": 2048}
    assert g["fc"].extents["v"] == 50304 and 50304 % 64 == 0
    weights = sum(math.prod(w.shape) * w.elem_factor for op in g for w in op.weights)
    assert 1.2e9 < weights < 1.6e9  # "1.3b" (embedding and projection untied)
    tiny = get_model("gpt", batch=4, layers=2, d_model=64, heads=4, seq=32, vocab=512)
    assert len(tiny) == 2 * 12 + 4


def test_get_model_errors_and_overrides():
    with pytest.raises(ShardplanError, match="known models: alexnet"):
        get_model("vgg16")
    with pytest.raises(ShardplanError, match="no size 'depth'"):
        get_model("alexnet", depth=3)
    assert get_model("alexnet", batch=32)["conv1"].extents["b"] == 32
    assert model_spec("Inception-v3").name == "inception_v3"


def test_models_table_lists_every_model():
    table = models_table()
    for name, (v, e) in COUNTS.items():
        line = next(l for l in table.splitlines() if l.startswith(name + " "))
        assert f" {v} " in line and f" {e} " in line
