"""Megatron-Core's fused ``linear_qkv`` in the megatron_te runtime graph (:func:`shardplan.recipe.fused_gqa_qkv`):
one product with the three products' FLOPs and parameters, sliced by the rotary embeddings and the attention,
keeping exactly what the three kept, and reducing its input's gradient once where the three reduced it three times."""

from __future__ import annotations

import math

import pytest

import shardplan.recipe as recipe_module
from shardplan.machine import preset
from shardplan.models import get_model
from shardplan.models.flops import graph_flops
from shardplan.recipe import Recipe, cost_recipe, fused_gqa_qkv, runtime_graph

SIZES = {"layers": 2, "d_model": 256, "heads": 8, "kv_heads": 2, "d_ff": 512, "vocab": 1024, "seq": 128}
G, R, KD = 2, 4, 32  # key/value groups, query heads per group, head width


def _llama(batch: int):
    return get_model("llama3-8b", batch, **SIZES)


def _params(graph) -> int:
    return sum(math.prod(w.shape) * w.elem_factor for op in graph.operators for w in op.weights if w.owner is None)


def test_one_product_with_the_three_products_flops_and_parameters():
    g = _llama(2)
    f = fused_gqa_qkv(g)
    names = [op.name for op in f.operators]
    assert "L1/qkv" in names and not {"L1/q", "L1/k", "L1/v"} & set(names)
    assert len(f.operators) == len(g.operators) - 2 * SIZES["layers"]
    assert graph_flops(f) == graph_flops(g) and _params(f) == _params(g)
    ops = {op.name: op for op in f.operators}
    assert ops["L1/qkv"].weights[0].shape == (256, G, R + 2, KD)
    assert ops["L1/qkv"].output.shape == (2, 128, G, R + 2, KD)
    offsets = [(ops["L1/rope_q"].inputs[0].axes[3].dim, ops["L1/rope_q"].inputs[0].axes[3].offset),
               (ops["L1/rope_k"].inputs[0].axes[3].dim, ops["L1/rope_k"].inputs[0].axes[3].offset),
               (ops["L1/attention"].inputs[2].axes[3].dim, ops["L1/attention"].inputs[2].axes[3].offset)]
    assert offsets == [("r", 0), ("c", R), ("c", R + 1)]  # queries, then the key, then the value of each group
    assert all(ops["L1/attention"].inputs[i].src == s for i, s in enumerate(("L1/rope_q", "L1/rope_k", "L1/qkv")))
    assert ops["L1/rope_k"].output.shape == (2, 128, G, 1, KD)  # keys and values read through the same dims
    assert [a.dim for a in ops["L1/attention"].inputs[1].axes] == [a.dim for a in ops["L1/attention"].inputs[2].axes]


def test_a_graph_without_grouped_query_attention_is_returned_as_it_is():
    g = get_model("gpt3-125m", 2, layers=1, seq=128)  # GPT's attention: no rope_q / rope_k
    assert fused_gqa_qkv(g) is g


def test_runtime_graph_fuses_without_a_context_group_only():
    g = _llama(2)
    fused = runtime_graph(g, Recipe.parse("tp=2,precision=fp8,runtime=megatron_te"), 2)
    assert any(op.name == "L1/qkv" for op in fused.operators)
    kept = runtime_graph(g, Recipe.parse("tp=2,cp=2,precision=fp8,runtime=megatron_te"), 2)
    assert {"L1/q", "L1/k", "L1/v"} <= {op.name for op in kept.operators}
    assert runtime_graph(g, Recipe.parse("tp=2,precision=fp8"), 2) is g  # shardplan's runtime: the zoo's graph


RECIPES = ("tp=1,mbs=1,gbs=4", "tp=2,mbs=1,gbs=2", "tp=2,sp=true,mbs=1,gbs=2",
           "tp=2,sp=true,mbs=1,gbs=2,overlap=grad_reduce+tp_comm", "tp=2,mbs=1,gbs=2,recompute=full",
           "tp=2,mbs=1,gbs=2,recompute=1", "tp=2,sp=true,pp=2,mbs=1,gbs=4")


def _both(monkeypatch, text: str):
    full = text + ",zero=1,precision=fp8,runtime=megatron_te" + ("" if "overlap" in text else ",overlap=grad_reduce")
    rec = Recipe.parse(full)
    devices = rec.tp * rec.pp * (2 if rec.tp == 1 else 1)  # tp=1: two data-parallel replicas
    fused = cost_recipe(_llama, preset("h100", devices), full)
    with monkeypatch.context() as mp:
        mp.setattr(recipe_module, "fused_gqa_qkv", lambda graph: graph)
        separate = cost_recipe(_llama, preset("h100", devices), full)
    return separate, fused


@pytest.mark.parametrize("text", RECIPES)
def test_memory_is_what_the_three_products_kept(monkeypatch, text):
    separate, fused = _both(monkeypatch, text)
    assert fused.memory["peak_bytes"] == pytest.approx(separate.memory["peak_bytes"], rel=1e-12)
    assert fused.step_time < separate.step_time  # one product, one cast of the input, one reduction


def test_the_input_gradient_is_reduced_once(monkeypatch):
    """Tensor parallelism without sequence parallelism: each of q, k and v all-reduces the gradient of the same
    (b, s, d) input; the fused product all-reduces it once, for the seconds one of them took. Every operator
    but the products is charged as before."""
    separate, fused = _both(monkeypatch, "tp=2,mbs=1,gbs=2")

    def parts(plan) -> dict[str, dict[str, float]]:
        mc, ops = plan.detail.memory_choices, plan.detail.graph.operators
        return {op.name: mc.parts(i) for i, op in enumerate(ops)}

    ps, pf = parts(separate), parts(fused)
    reduce_q = ps["L1/q"]["grad_allreduce"]
    assert reduce_q > 0 and ps["L1/k"]["grad_allreduce"] == ps["L1/v"]["grad_allreduce"] == reduce_q
    assert pf["L1/qkv"]["grad_allreduce"] == pytest.approx(reduce_q, rel=1e-12)
    for name in ("L1/rope_q", "L1/rope_k", "L1/attention", "L1/out", "L1/gate", "L1/up", "L1/down"):
        assert pf[name] == ps[name], name
    assert pf["L1/qkv"]["weight_sync"] == pytest.approx(sum(ps[f"L1/{n}"]["weight_sync"] for n in "qkv"), rel=1e-12)
