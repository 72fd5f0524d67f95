"""The zoo's ``attention=`` option: FlashAttention's one operator for the Llama family and the MoE models (the
default), the unfused core for GPT (its default, Megatron-LM 2021 ran no fused attention); their FLOPs against the
published formulas, the command line's ``--set attention=...``, and the pipeline search's lower bound."""

from __future__ import annotations

from fractions import Fraction

import pytest

from shardplan.cli import main
from shardplan.errors import ShardplanError
from shardplan.machine import preset
from shardplan.models import MODELS, NAMED, get_model
from shardplan.models.flops import config_of, graph_flops, is_matmul, model_flops
from shardplan.pipeline.stages import ModelStages

FLASH_BLOCK = ["ln1", "q", "k", "v", "rope_q", "rope_k", "attention", "out", "add1",
               "ln2", "gate", "up", "swiglu", "down", "add2"]


def test_llama_is_flash_by_default_with_one_core_operator():
    g = get_model("llama3-tiny")
    assert len(g) == 2 * 15 + 4
    assert [op.name for op in g][1:16] == [f"L1/{n}" for n in FLASH_BLOCK]
    a = g["L1/attention"]
    # llama3-tiny: batch 8, seq 128, 8 query heads in 2 key/value groups of 4, head width 32
    assert a.kind == "attn_flash" and a.extents == {"b": 8, "s": 128, "h": 2, "r": 4, "k": 32, "t": 128}
    assert [t.src for t in a.inputs] == ["L1/rope_q", "L1/rope_k", "L1/v"] and a.output.shape == (8, 128, 2, 4, 32)
    assert a.fixed == {"t", "k"} and a.saved == 1 + 2 / 32 and a.causal is None
    assert a.flops_per_point == 4 + 5 / 32 and a.backward_flops == 10 + 4 / 32
    assert g["L1/out"].inputs[0].src == "L1/attention"
    assert not any(op.kind in ("attn_scores", "attn_context") for op in g)
    assert not any("t" in op.output.dims and "s" in op.output.dims for op in g)  # no (s, t) tensor anywhere


def test_the_option_on_every_family():
    unfused = get_model("llama3-tiny", attention="unfused")
    assert len(unfused) == 2 * 16 + 4 and unfused["L1/scores"].kind == "attn_scores"
    for name in ("mixtral-tiny", "deepseek-tiny"):
        g = get_model(name)
        assert sum(op.kind == "attn_flash" for op in g) == config_of(name).layers
        assert not any(op.kind == "attn_flash" for op in get_model(name, attention="unfused"))
    # GPT and Megatron rows stay unfused unless asked
    for name in ["gpt", "transformer", *(n for n in NAMED if n.startswith(("gpt3", "megatron")))]:
        g = get_model(name, 1, layers=1) if name != "transformer" else get_model(name, 1, layers=1)
        assert not any(op.kind == "attn_flash" for op in g), name
    g = get_model("gpt", 2, layers=1, attention="flash")
    assert g["L1/attention"].extents == {"b": 2, "s": 2048, "h": 16, "k": 128, "t": 2048}
    assert get_model("megatron-1.7b", 1, layers=1, attention="flash", kernels="megatron")["L1/attention"]
    with pytest.raises(ShardplanError, match="attention='fast' is not one of flash, unfused") as e:
        get_model("llama3-tiny", attention="fast")
    assert "\n" not in str(e.value)
    assert config_of("llama3-8b").attention == "flash" and config_of("gpt3-175b").attention == "unfused"
    assert config_of("llama3-8b", attention="unfused").sizes()["attention"] == "unfused"
    assert "attention" not in config_of("llama3-8b").sizes() and "moe" in MODELS


def test_the_command_line_sets_the_option(capsys):
    args = ["ops", "--model", "llama3-8b", "--batch", "2", "--set", "layers=1", "--set", "seq=64", "-p", "8"]
    assert main(args) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()[2:] if line.strip()]
    assert names == ["embed"] + [f"L1/{n}" for n in FLASH_BLOCK] + ["ln_f", "fc", "softmax"]
    assert main(args + ["--set", "attention=unfused"]) == 0
    assert "L1/scores" in capsys.readouterr().out
    assert main(args + ["--set", "attention=fast"]) == 2
    err = capsys.readouterr().err.strip()
    assert "attention='fast' is not one of flash, unfused" in err and "\n" not in err


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("name", ["llama3-tiny", "mixtral-tiny", "deepseek-tiny"])
def test_flash_flops_are_the_formula_plus_the_recomputed_scores(name, recompute):
    """The published formulas count a product's backward as two products of its size (3x the forward, 4x with
    recomputation). FlashAttention's backward recomputes q k^T: five products to the forward's two, so the
    graph counts 2 B s^2 (H k) more per layer, besides the softmax's 5 FLOPs per score forward (and again when
    recomputed) and 4 backward, exactly."""
    b = 3
    g = get_model(name, b)
    cfg = config_of(name)
    heads, s, layers = cfg.heads, cfg.seq, cfg.layers
    qk = heads * (cfg.kd if hasattr(cfg, "kd") else cfg.head_dim)
    fwd = 2 if recompute else 1
    extra = layers * (2 * b * s * s * qk + (5 * fwd + 4) * b * heads * s * s)
    mm = [op for op in g if is_matmul(op)]
    assert graph_flops(g, mm, recompute=recompute) == model_flops(name, b, recompute=recompute) + extra
    # the unfused graph's core: its products 3x (4x) and the softmax fused into the scores, 5 per score per pass
    u = get_model(name, b, attention="unfused")
    softmax = (4 if recompute else 3) * layers * 5 * b * heads * s * s
    mm_u = [op for op in u if is_matmul(op)]
    assert graph_flops(u, mm_u, recompute=recompute) == model_flops(name, b, recompute=recompute) + softmax
    core = [op for op in g if op.kind == "attn_flash"]
    assert graph_flops(g, core) == layers * Fraction(14 * b * s * s * qk + 9 * b * heads * s * s)


def _core(batch: int, causal: bool):
    """One block of q, k, v (elementwise) and the fused core, at 4096 tokens: the core bound by its FLOPs."""
    from shardplan import ops
    from shardplan.ir import GraphBuilder

    b = GraphBuilder("core")
    x = b.input("x", (batch, 4096, 1, 128), needs_grad=True)
    q = b.add(ops.elementwise("L1/q", x, letters="bshk"))
    k = b.add(ops.elementwise("L1/k", x, letters="bthk"))
    v = b.add(ops.elementwise("L1/v", x, letters="bthk"))
    b.add(ops.flash_attention("L1/attention", q, k, v, "bshk", "bthk", causal=causal))
    return b.build()


@pytest.mark.parametrize("causal", [False, True])
def test_the_pipeline_lower_bound_holds_for_the_fused_and_masked_core(causal):
    """ModelStages.device_seconds, the pipeline search's proven lower bound, counts the fused backward's own
    FLOPs (2.5x the forward's products, not one pass per gradient: 3x) and, under a causal mask, the unmasked
    points only: on one device it is the cost itself, never above it."""
    st = ModelStages(lambda n: _core(n, causal), 1, preset("h100", 8), {"cutoff": 1})
    got = st.stage_cost(0, 1, 1, 1)
    cost = got.forward + got.backward
    assert cost * (1 - 1e-9) <= st.device_seconds(1) <= cost * (1 + 1e-12)
