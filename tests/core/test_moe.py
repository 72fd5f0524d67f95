"""The mixture-of-experts zoo: its operators, weights against the published counts, and FLOPs counted exactly."""

from __future__ import annotations

from fractions import Fraction

import pytest

from shardplan import ShardplanError
from shardplan.models import get_model
from shardplan.models.flops import config_of, graph_flops, is_matmul, model_flops, moe_flops
from shardplan.models.moe import MOE, MoEConfig, capacity


def _weights(g) -> int:
    return sum(t.size for op in g for t in op.weights if t.owner is None)


def test_the_routed_layer_is_einsums_over_a_splittable_expert_dimension():
    g = get_model("mixtral-tiny", 3)
    cfg = config_of("mixtral-tiny")
    c = cfg.capacity
    assert c == 10  # ceil(1.25 * 32 tokens * top-2 / 8 experts)
    p = "L1/moe/"
    assert dict(g[p + "router"].dims) == {"b": 3, "s": 32, "e": 8, "d": 64}
    assert dict(g[p + "gate"].dims) == {"b": 3, "s": 32, "e": 8, "c": c}
    assert g[p + "gate"].norm_dims == ("e",) and g[p + "gate"].fixed == {"s"}
    disp = g[p + "dispatch"]
    assert disp.dim_names == ("b", "e", "c", "d", "s") and disp.reduction_dims == ("s",)
    assert [(t.name, t.needs_grad) for t in disp.inputs] == [("mask", False), ("x1", True)]
    for name in ("expert_in", "expert_down"):
        op = g[p + name]
        w = op.weights[0]
        assert op.kind == "expert" and w.axes[0].dim == "e" and w.shape[0] == 8
        # the experts' weights have no batch, token or slot axis: splitting e splits them, nothing to reduce
        assert set(op.reduction_dims) <= {"d", "f"}
    assert g[p + "expert_in"].weights[0].shape == (8, 64, 2, 128)  # gate and up stacked
    assert g[p + "expert_act"].inputs[0].axes[3].dim is None and g[p + "expert_act"].output.shape == (3, 8, c, 128)
    comb = g[p + "combine"]
    assert comb.output.shape == (3, 32, 64) and set(comb.reduction_dims) == {"e", "c"}
    assert all(t.needs_grad for t in comb.inputs)  # the gate weights carry the router's gradient
    # the dispatched tokens [b, e, c, d] flow dispatch -> experts -> combine
    assert [op.name for op in g if any(t.src == p + "dispatch" for t in op.inputs)] == [p + "expert_in"]
    assert comb.inputs[0].src == p + "expert_down" and comb.inputs[1].src == p + "gate"


def test_weights_equal_the_config_and_the_published_counts():
    for name, cfg in MOE.items():
        g = get_model(name, 1)
        assert _weights(g) == cfg.params(), name
    # Mixtral 8x7B: 46.7B weights, 12.9B active per token (Jiang et al. 2024, §2)
    mix = MOE["mixtral-8x7b"]
    assert round(mix.params() / 1e9, 1) == 46.7 and round(mix.active_params() / 1e9, 1) == 12.9
    # DeepSeek-V3: 671B / 37B published; with MLA described as 128 full heads of 128 the attention holds
    # 4 * 7168 * 16384 weights per layer instead of MLA's 187M: 61 * (470M - 187M) = 17.3B more
    ds = MOE["deepseek-v3"]
    mla = 7168 * 1536 + 1536 * 128 * 192 + 7168 * (512 + 64) + 512 * 128 * 256 + 128 * 128 * 7168
    extra = ds.layers * (4 * 7168 * 16384 - mla)
    assert abs((ds.params() - extra) / 671e9 - 1) < 0.005
    assert abs((ds.active_params() - extra) / 37e9 - 1) < 0.03
    dsg = get_model("deepseek-tiny", 2)
    assert "L1/gate" in dsg.index and "L1/moe/router" not in dsg.index  # the first dense_layers are dense
    assert "L2/moe/shared/down" in dsg.index and "L2/moe/sum" in dsg.index


def _factored(cfg: MoEConfig, b: int, recompute: bool) -> int:
    """The module docstring's formula written out term by term."""
    s, h, l, ld, e, c, fe = cfg.seq, cfg.d_model, cfg.layers, cfg.dense_layers, cfg.experts, cfg.capacity, \
        cfg.d_expert
    hk, gk = cfg.heads * cfg.kd, cfg.kv_heads * cfg.kd
    a = 2 * b * s * (2 * h * hk + 2 * h * gk) + 4 * b * s * s * hk
    fw, bw = (2, 2) if recompute else (1, 2)
    per_dense = (fw + bw) * (a + 6 * b * s * h * cfg.d_ff)
    disp = 2 * b * s * e * c * h
    per_moe = (fw + bw) * (a + 2 * b * s * h * e + 6 * b * e * c * h * fe + disp + 6 * b * s * h * cfg.shared * fe) \
        + (fw + 1) * disp
    return ld * per_dense + (l - ld) * per_moe + 6 * b * s * h * cfg.vocab


@pytest.mark.parametrize("name", ["mixtral-tiny", "deepseek-tiny"])
@pytest.mark.parametrize("recompute", [False, True])
def test_moe_formula_equals_the_graphs_matrix_products(name, recompute):
    b = 3
    g = get_model(name, b, attention="unfused")  # the formula's products one by one (FlashAttention's: tests/models)
    cfg = config_of(name)
    mm = [op for op in g if is_matmul(op)]
    routed = cfg.layers - cfg.dense_layers
    # per routed layer: q k v scores context out, router, dispatch, expert in/down, combine, shared gate/up/down
    assert len(mm) == cfg.dense_layers * 9 + routed * (11 + 3 * bool(cfg.shared)) + 1
    softmax = sum((Fraction(op.flops_per_point) - 2) * op.points * ((2 if recompute else 1) + len(op.grad_tensors))
                  for op in g if op.kind == "attn_scores")
    assert softmax == (4 if recompute else 3) * cfg.layers * 5 * b * cfg.heads * cfg.seq ** 2
    got = graph_flops(g, mm, recompute=recompute) - softmax
    assert got == model_flops(name, b, recompute=recompute) == moe_flops(cfg, b, recompute=recompute)
    assert got == _factored(cfg, b, recompute)


def test_moe_flop_figures():
    # one sequence, no recomputation; the experts at capacity dominate
    cfg = MOE["mixtral-8x7b"]
    f = model_flops("mixtral-8x7b", 1)
    assert f == _factored(cfg, 1, False)
    s, h = cfg.seq, cfg.d_model
    experts = cfg.layers * 3 * 6 * cfg.experts * cfg.capacity * h * cfg.d_expert
    assert experts == 32 * 3 * 6 * 8 * 1280 * 4096 * 14336 and 0.74 < experts / f < 0.75
    # at capacity factor 1 the experts' products are exactly top-k dense MLPs per token: 6 s k h f_e x 3
    one = MoEConfig(**{**cfg.sizes(), "capacity_factor": 1.0})
    assert one.capacity == s * cfg.top_k // cfg.experts
    assert 6 * one.experts * one.capacity * h * one.d_expert == 6 * s * cfg.top_k * h * cfg.d_expert
    # the sequence changes the capacity
    assert moe_flops(cfg, 2, seq=1024) == _factored(MoEConfig(**{**cfg.sizes(), "seq": 1024}), 2, False)


def test_capacity_and_bad_sizes():
    assert capacity(4096, 256, 8, 1.25) == 160 and capacity(32, 8, 2, 1.0) == 8 and capacity(4, 2, 2, 9.0) == 4
    for bad in (0.0, -1, float("inf"), "x", True):
        with pytest.raises(ShardplanError, match="capacity_factor"):
            capacity(32, 8, 2, bad)
    with pytest.raises(ShardplanError, match="capacity_factor"):
        get_model("moe", 2, capacity_factor="high")
    assert get_model("moe", 2, capacity_factor=1)["L1/moe/gate"].extents["c"] == 8
    with pytest.raises(ShardplanError, match="top_k=9 is more than the 8 experts"):
        get_model("moe", 2, top_k=9)
    with pytest.raises(ShardplanError, match="dense_layers=3 is more than the 2 layers"):
        get_model("moe", 2, dense_layers=3)
    with pytest.raises(ShardplanError, match="kv_heads=3"):
        get_model("moe", 2, kv_heads=3)
