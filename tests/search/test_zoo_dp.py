"""The exact DP on the model zoo: never worse than the baselines, and the paper's qualitative findings.

Differences from the paper's Table II (p = 32), and why (see also the notes
in the tests below):

* AlexNet: the DP finds the paper's FC alternation (1,4,8) -> (1,8,4) ->
  (1,4,8) with no redistribution between the FC layers (configurations
  carry a device-grid nesting order, so the second layer's devices line up
  with the first's). It keeps conv1-2 data parallel, not conv1-4: conv3-5
  go to (16,1,1,1,2,1,1) / (16,2,1,1,1,1,1), which in this model trade a
  smaller weight-gradient all-reduce for a little redistribution (the
  exact per-device intersection; the reference prototype's edge shortcut
  charges such changes more). It never costs more than the Table II
  strategy, which lies in its search space.
* RNNLM: the paper splits the embedding over the vocabulary (1,1,1,32). In
  this cost model a vocabulary split makes the one-hot contraction's output
  a partial sum that must be all-reduced (64 x 256 x 2048 floats), while a
  split of the embedding width d leaves each device a column slice of the
  table and moves nothing; the DP prefers the latter. The projection is
  split over the vocabulary, as in the paper.
"""

from __future__ import annotations

import functools

import pytest

from shardplan.machine import preset
from shardplan.models import MODELS
from shardplan.spmd import plan_from_configs, solve
from shardplan.baselines import baseline_plans

# the AlexNet strategy of the paper's Table II (p = 32); pools and flatten follow their producers
TABLE2_ALEXNET = {
    "conv1": (32, 1, 1, 1, 1, 1, 1), "pool1": (32, 1, 1, 1, 1, 1), "conv2": (32, 1, 1, 1, 1, 1, 1),
    "pool2": (32, 1, 1, 1, 1, 1), "conv3": (32, 1, 1, 1, 1, 1, 1), "conv4": (32, 1, 1, 1, 1, 1, 1),
    "conv5": (16, 2, 1, 1, 1, 1, 1), "pool5": (32, 1, 1, 1, 1, 1), "flatten": (32, 1, 1, 1),
    "fc1": (1, 4, 8), "fc2": (1, 8, 4), "fc3": (1, 4, 8), "softmax": (1, 4),
}


@functools.lru_cache(maxsize=None)
def _solved(name: str, p: int):
    spec = MODELS[name]
    g = spec.build(**({"batch": 8, "layers": 2, "d_model": 256, "heads": 4, "seq": 128, "vocab": 8192}
                      if name == "gpt" else {}))
    return solve(g, preset("paper", p), cutoff=spec.cutoff)


@pytest.mark.parametrize("name", list(MODELS))
def test_dp_no_worse_than_baselines(name):
    plan = _solved(name, 4)
    for bname, b in baseline_plans(plan.tables, MODELS[name].expert).items():
        assert plan.cost <= b.cost * (1 + 1e-9), f"{name}: dp {plan.cost} > {bname} {b.cost}"


def test_alexnet_p32_matches_table2_where_the_model_agrees():
    plan = _solved("alexnet", 32)
    cfg = plan.configs
    # the early, activation-heavy convolutions stay data parallel
    for n in ("conv1", "conv2"):
        assert cfg[n] == (32, 1, 1, 1, 1, 1, 1)
    # the FC layers alternate their splits as in Table II ...
    assert cfg["fc1"] == cfg["fc3"] == (1, 4, 8)
    assert cfg["fc2"] == (1, 8, 4)
    # ... so that nothing is redistributed between them
    g = plan.graph
    for e, m in zip(g.edges, plan.tables.edge_costs):
        u, v = g.operators[e.src].name, g.operators[e.dst].name
        if (u, v) in (("fc1", "fc2"), ("fc2", "fc3")):
            assert m[plan.assignment[e.src], plan.assignment[e.dst]] == 0.0
    assert plan.breakdown["redistribution"] < 0.05 * plan.cost
    # never worse than the paper's strategy, which is in the search space
    paper = plan_from_configs(plan.tables, TABLE2_ALEXNET, name="table2")
    assert plan.cost <= paper.cost
    bl = baseline_plans(plan.tables, "one_weird_trick")
    assert paper.cost < bl["one_weird_trick"].cost < bl["data_parallel"].cost


def test_rnnlm_p32_splits_vocabulary_of_projection():
    plan = _solved("rnnlm", 32)
    g = plan.graph
    fc = dict(zip(g["fc"].dim_names, plan.config("fc")))
    assert fc["v"] >= 8
    loss = dict(zip(g["softmax"].dim_names, plan.config("softmax")))
    assert loss["v"] == fc["v"]
    emb = dict(zip(g["embedding"].dim_names, plan.config("embedding")))
    assert emb["v"] * emb["d"] == 32  # the 100k x 2048 table is fully sharded, not replicated
    bl = baseline_plans(plan.tables, "gnmt")
    assert plan.cost < 0.5 * min(b.cost for b in bl.values())
