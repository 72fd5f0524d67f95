"""Baseline strategies: valid plans on every model, the experts' rules, fallbacks."""

from __future__ import annotations

import numpy as np
import pytest

from shardplan.baselines import (BASELINES, baseline_plan, baseline_plans, batch_dim, data_parallel, gnmt, megatron,
                                 nearest_valid, one_weird_trick)
from shardplan.cost import build_tables
from shardplan.errors import ShardplanError
from shardplan.machine import preset
from shardplan.models import MODELS, get_model
from shardplan.spmd import plan_from_configs

SMALL = {  # small versions where the sizes are free, to keep the tables cheap
    "gpt": dict(batch=8, layers=2, d_model=128, heads=4, seq=64, vocab=1024),
    "transformer": dict(batch=8, layers=2, seq=32, vocab=1000),
    "transformer_big": dict(batch=8, layers=1, seq=32, vocab=1000),
    "rnnlm": dict(batch=8, seq=16, vocab=1000, hidden=256),
}


def tables_for(name: str, p: int, **kw):
    spec = MODELS[name]
    sizes = {**SMALL.get(name, {}), **kw}
    return build_tables(spec.build(**sizes), preset("paper", p), cutoff=spec.cutoff)


@pytest.mark.parametrize("name", list(MODELS))
def test_baselines_give_valid_plans_on_every_model(name):
    t = tables_for(name, 2 if len(MODELS[name].build()) > 200 else 4)
    plans = baseline_plans(t, MODELS[name].expert)
    assert set(plans) == {"data_parallel", MODELS[name].expert}
    for plan in plans.values():
        assert set(plan.configs) == {op.name for op in t.graph}
        assert np.isfinite(plan.cost) and plan.cost > 0
        for i, op in enumerate(t.graph.operators):  # every chosen configuration is a valid one
            assert t.index_of(i, plan.configs[op.name]) == plan.assignment[i]


def test_data_parallel_splits_only_the_batch():
    t = tables_for("alexnet", 8)
    conv, pool = (8, 1, 1, 1, 1, 1, 1), (8, 1, 1, 1, 1, 1)  # dims bchwnrs, bchwrs
    expected = {"conv1": conv, "pool1": pool, "conv2": conv, "pool2": pool, "conv3": conv, "conv4": conv,
                "conv5": conv, "pool5": pool,
                "flatten": (8, 1, 1, 1),  # dims i0..i3, i0 indexing the batch
                "fc1": (8, 1, 1), "fc2": (8, 1, 1), "fc3": (8, 1, 1),  # dims bnc
                "softmax": (8, 1)}  # dims bn
    assert data_parallel(t) == expected
    assert [batch_dim(op) for op in t.graph] == ["b"] * 8 + ["i0"] + ["b"] * 4


def test_data_parallel_conv_costs_only_compute_and_weight_allreduce():
    m = preset("paper", 8)
    t = build_tables(get_model("alexnet"), m)
    plan = plan_from_configs(t, data_parallel(t))
    i = t.graph.index["conv3"]
    op = t.graph["conv3"]
    parts = t.op_costs[i].parts(plan.assignment[i])
    assert parts["forward_allreduce"] == parts["halo"] == parts["stats"] == parts["recurrence"] == 0.0
    # compute: 2 FLOPs per point / 8 devices, forward + input gradient + weight gradient
    assert parts["compute"] == pytest.approx(3 * 2.0 * op.points / 8 / m.peak_flops)
    # ring all-reduce of the weight gradient (384 x 192 x 3 x 3 floats) among 8 devices
    wbytes = 384 * 192 * 3 * 3 * 4
    assert parts["grad_allreduce"] == pytest.approx(2 * 7 / 8 * wbytes / m.bandwidth)
    # and no redistribution anywhere in a data-parallel CNN
    assert plan.breakdown["redistribution"] == 0.0


def test_one_weird_trick_alexnet():
    t = tables_for("alexnet", 8)
    s = one_weird_trick(t)
    for n in ("conv1", "conv2", "conv3", "conv4", "conv5", "pool1", "pool5"):
        assert s[n][0] == 8 and all(c == 1 for c in s[n][1:])
    assert s["fc1"] == s["fc2"] == s["fc3"] == (1, 8, 1)
    assert s["softmax"] == (1, 8)


def test_one_weird_trick_fallback_when_classes_do_not_divide():
    t = tables_for("alexnet", 32)
    s = one_weird_trick(t)
    assert s["fc1"] == (1, 32, 1)
    assert s["fc3"] == (1, 8, 1)  # 1000 classes: the largest split <= 32 that divides both 1000 and p is 8
    assert s["softmax"] == (1, 8)
    spec = MODELS["alexnet"]
    t = build_tables(spec.build(), preset("paper", 32), cutoff=spec.cutoff, divides_p=False)
    s = one_weird_trick(t)
    assert s["fc3"] == (1, 25, 1)  # with idle devices allowed: 25 of the 32 devices
    assert s["softmax"] == (1, 25)


def test_nearest_valid():
    t = tables_for("alexnet", 32)
    i = t.graph.index["fc3"]
    op = t.graph["fc3"]
    assert nearest_valid(op, t.configs[i], {"n": 32}) == (1, 8, 1)  # 8 divides both 1000 and 32
    assert nearest_valid(op, t.configs[i], {"b": 32}) == (32, 1, 1)
    assert nearest_valid(op, t.configs[i], {"b": 4, "n": 8}) == (4, 8, 1)
    # batch 12 on 8 devices: 8 does not divide 12; the largest split dividing both is 4, or 6 with idle devices
    t12 = build_tables(get_model("alexnet", batch=12), preset("paper", 8), cutoff=1)
    assert data_parallel(t12)["conv1"][0] == 4
    t12 = build_tables(get_model("alexnet", batch=12), preset("paper", 8), cutoff=1, divides_p=False)
    assert data_parallel(t12)["conv1"][0] == 6


def test_megatron_splits_heads_hidden_and_vocabulary():
    t = tables_for("transformer", 8)
    for m in (1, 2, 4, 8):
        s = megatron(t, m)
        n = 8 // m
        g = t.graph
        assert dict(zip(g["enc1/q"].dim_names, s["enc1/q"]))["h"] == n
        assert dict(zip(g["enc1/q"].dim_names, s["enc1/q"]))["b"] == m
        assert dict(zip(g["dec1/ffn1"].dim_names, s["dec1/ffn1"]))["e"] == n
        assert dict(zip(g["dec1/ffn2"].dim_names, s["dec1/ffn2"]))["e"] == n
        assert dict(zip(g["fc"].dim_names, s["fc"]))["v"] == n
        assert dict(zip(g["src_embed"].dim_names, s["src_embed"]))["v"] == n
        assert s["enc1/ln1"] == (m, 1, 1)
    best = plan_from_configs(t, megatron(t)).cost
    assert best == pytest.approx(min(plan_from_configs(t, megatron(t, m)).cost for m in (1, 2, 4, 8)))


def test_gnmt_puts_layers_on_their_own_devices():
    t = tables_for("rnnlm", 4)
    s = gnmt(t)
    assert s["lstm"] == (2, 2, 1, 1, 1)
    assert s["embedding"] == (4, 1, 1, 1) and s["fc"] == (4, 1, 1, 1)


def test_baseline_plans_dispatch():
    t = tables_for("rnnlm", 2)
    plans = baseline_plans(t, MODELS["rnnlm"].expert)
    assert list(plans) == ["data_parallel", "gnmt"] and plans["gnmt"].name == "gnmt"
    assert list(baseline_plans(t)) == ["data_parallel"]
    assert set(BASELINES) == {"data_parallel", "one_weird_trick", "megatron", "gnmt"}
    with pytest.raises(ShardplanError, match="unknown baseline 'zero'"):
        baseline_plan("zero", t)
