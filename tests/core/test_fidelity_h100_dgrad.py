"""Transformer Engine's input-gradient overlap on the H100 rows (benchmarks/bench_fidelity_h100.py): which recipes
carry ``overlap=...+dgrad``, what it does beside ``tp_comm``, and the seconds the zoo Llama's separate k, v and up
products spend on their input's collectives (:func:`sibling_collectives`)."""

from __future__ import annotations

import pytest

from benchmarks.bench_fidelity_h100 import TE_DGRAD_NOTE, _builder, rows, sibling_collectives
from shardplan.machine import preset
from shardplan.recipe import Recipe, cost_recipe

ROWS = {r.name: r for r in rows()}
SMALL = {"layers": 2, "seq": 1024, "d_model": 1024, "heads": 8, "kv_heads": 4, "d_ff": 3584, "vocab": 8192}


def _overlap(text: str) -> frozenset[str]:
    return frozenset(Recipe.parse(text).overlap or ())


def test_te_recipes_with_tensor_parallelism_overlap_the_input_gradient_or_run_userbuffers():
    """Every megatron_te recipe (row or variant) with TP > 1 carries exactly one of tp_comm (userbuffers) and
    dgrad (TE's asynchronous reduction beside the weight-gradient GEMM), and its row names the source."""
    seen = 0
    for r in ROWS.values():
        for text in (r.recipe, *r.variants):
            rec = Recipe.parse(text)
            if rec.runtime != "megatron_te" or rec.tp == 1:
                continue
            seen += 1
            assert ("tp_comm" in _overlap(text)) != ("dgrad" in _overlap(text)), (r.name, text)
            assert TE_DGRAD_NOTE in r.assumptions, r.name
    assert seen == 10  # the 8 NVIDIA rows with TP > 1 (tp_comm) and the two 405B nearest forms (dgrad)
    nearest = [v for r in ROWS.values() for v in r.variants if "first_stage_layers=15" in v]
    assert len(nearest) == 2 and all("dgrad" in _overlap(v) for v in nearest)


def test_llama3_table4_keeps_its_all_reduces_with_the_overlap_as_a_variant():
    """The paper names no tensor-parallel implementation: the rows charge the input gradients' all-reduces in
    full, and one variant each reads them as Megatron-LM / Transformer Engine run them."""
    for name in ("l3-405b-8192", "l3-405b-16384", "l3-405b-16384-cp16"):
        r = ROWS[name]
        assert _overlap(r.recipe) == {"grad_reduce"}
        with_dgrad = [v for v in r.variants if "dgrad" in _overlap(v)]
        assert with_dgrad == [r.recipe.replace("overlap=grad_reduce", "overlap=grad_reduce+dgrad")]


@pytest.fixture(scope="module")
def small():
    return _builder("llama3-8b", SMALL), preset("h100", 4)


def test_dgrad_beside_tp_comm_changes_nothing_and_without_it_hides_part_of_the_all_reduces(small):
    """With sequence parallelism and tp_comm the input gradients' reduce-scatters are the edges' chunked overlap:
    adding dgrad leaves the step exactly as it was. Without sequence parallelism the all-reduce of each product's
    input gradient runs beside its weight-gradient pass: the step drops, by at most those all-reduces."""
    build, m = small
    base = "tp=4,mbs=1,gbs=4,zero=1,precision=fp8,runtime=megatron_te"
    tp_comm = cost_recipe(build, m, base + ",sp=true,overlap=grad_reduce+tp_comm")
    both = cost_recipe(build, m, base + ",sp=true,overlap=grad_reduce+tp_comm+dgrad")
    assert both.step_time == tp_comm.step_time
    plain = cost_recipe(build, m, base + ",overlap=grad_reduce")
    dgrad = cost_recipe(build, m, base + ",overlap=grad_reduce+dgrad")
    sib = sibling_collectives(plain.detail)
    assert dgrad.step_time < plain.step_time
    mc, g = plain.detail.memory_choices, plain.detail.graph
    act = sum(mc.parts(i).get("grad_allreduce", 0.0) for i, op in enumerate(g.operators)
              if op.kind in ("attn_proj", "ffn") and op.name.rsplit("/", 1)[-1] in ("qkv", "gate", "up"))
    assert plain.step_time - dgrad.step_time <= act * (1 + 1e-12)
    assert sib["k_v"] == 0 and sib["up"] > 0  # megatron_te fuses q, k and v (runtime_graph); gate and up stay two


def test_sibling_collectives_are_the_separate_products_repeated_reductions(small):
    """Without sequence parallelism k and v each all-reduce the gradient of the same (b, s, d) input as q, and up
    as gate: their seconds are exactly twice q's and once gate's input collectives (the zoo's graph as built:
    shardplan's runtime, which keeps the three products)."""
    build, m = small
    plan = cost_recipe(build, m, "tp=4,mbs=1,gbs=4,zero=1,overlap=grad_reduce,precision=fp8")
    mc, g = plan.detail.memory_choices, plan.detail.graph

    def own(leaf: str) -> float:
        return sum(mc.parts(i).get("grad_allreduce", 0.0) + mc.parts(i).get("forward_allreduce", 0.0)
                   for i, op in enumerate(g.operators) if op.name.rsplit("/", 1)[-1] == leaf)

    sib = sibling_collectives(plan.detail)
    assert own("q") > 0
    assert sib["k_v"] == pytest.approx(2 * own("q"), rel=1e-12)
    assert sib["up"] == pytest.approx(own("gate"), rel=1e-12)
