"""Weight gradients added up over the micro-batches outside their products (``Machine.grad_accum_bytes``, a
recipe's ``grad_accum=autograd``): PyTorch's in-place ``.grad += g`` for every micro-batch but the first,
charged ``elements * grad_accum_bytes / hbm_bandwidth`` per device, on the one program, on ZeRO shards, on
pipeline stages and in the exact searches."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from shardplan.cost.operator import grad_accumulation_seconds, optimizer_elements
from shardplan.errors import ShardplanError
from shardplan.machine import Machine, load_machine_file, preset
from shardplan.models import get_model
from shardplan.recipe import Recipe, cost_recipe, recipe_machine

MACHINES = Path(__file__).resolve().parents[2] / "shardplan" / "machines"
SIZES = {"layers": 2, "d_model": 64, "heads": 2, "seq": 16, "vocab": 256}


def _params(graph) -> int:
    """Trainable parameter elements of the graph, counted from the weights' shapes (each owned once)."""
    return sum(int(np.prod(t.shape)) for op in graph.operators for t in op.weights if t.needs_grad and t.owner is None)


def test_the_machine_field_is_checked_and_read_from_files(tmp_path):
    assert Machine(2).grad_accum_bytes == 0.0
    with pytest.raises(ShardplanError, match="grad_accum_bytes"):
        Machine(2, grad_accum_bytes=-1.0)
    for path in sorted(MACHINES.glob("*.json")):
        field = json.loads(path.read_text())["grad_accum_bytes"]
        assert field["value"] == 0.0 and "first principles" in field["source"]
    data = json.loads((MACHINES / "a100-sxm-80gb.json").read_text())
    del data["grad_accum_bytes"]  # a file written before the field existed
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    assert load_machine_file(old, 8).grad_accum_bytes == 0.0


def test_seconds_are_elements_times_bytes_over_the_hbm_bandwidth():
    m = Machine(1, hbm_bandwidth=2e12, grad_accum_bytes=6.0)
    assert grad_accumulation_seconds(np.array([1e9, 0.0]), m) == pytest.approx([3e-3, 0.0], rel=1e-15)
    assert not np.any(grad_accumulation_seconds(np.array([1e9]), Machine(1, grad_accum_bytes=6.0)))  # no HBM
    assert not np.any(grad_accumulation_seconds(np.array([1e9]), Machine(1, hbm_bandwidth=2e12)))  # fused


def test_the_recipe_reads_writes_and_sets_the_machine():
    r = Recipe.parse("tp=2,mbs=2,grad_accum=autograd")
    assert r.grad_accum == "autograd" and str(r) == "tp=2,mbs=2,grad_accum=autograd"
    assert Recipe.parse(str(r)) == r and Recipe.from_mapping(r.to_dict()) == r
    assert Recipe.parse("tp=2,grad_accum=none").grad_accum is None
    with pytest.raises(ShardplanError, match="grad_accum must be one of fused, autograd"):
        Recipe.parse("tp=2,grad_accum=sometimes")
    a100 = preset("a100", 8)  # 2-byte elements
    assert recipe_machine(r, a100).grad_accum_bytes == 6.0
    assert recipe_machine(Recipe.parse("tp=2,grad_accum=fused"),
                          dataclasses.replace(a100, grad_accum_bytes=6.0)).grad_accum_bytes == 0.0
    assert recipe_machine(Recipe.parse("tp=2"), dataclasses.replace(a100, grad_accum_bytes=5.0)).grad_accum_bytes == 5.0


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_one_program_pays_m_minus_one_passes_over_its_gradient(zero):
    """Data parallelism 8, 4 micro-batches: every device holds every weight, so it adds 3 micro-batches' gradients of
    all the model's parameters (its 1/8 shard from ZeRO-2 on), two reads and one write of 2 bytes each."""
    machine = preset("a100", 8)
    base = f"tp=1,zero={zero},mbs=1,gbs=32"
    fused = cost_recipe("gpt", machine, base, sizes=SIZES)
    auto = cost_recipe("gpt", machine, base + ",grad_accum=autograd", sizes=SIZES)
    n = _params(get_model("gpt", 32, **SIZES))
    want = 3 * n / (8 if zero >= 2 else 1) * 6.0 / machine.hbm_bandwidth
    assert auto.breakdown["grad_accum"] == pytest.approx(want, rel=1e-12)
    assert "grad_accum" not in fused.breakdown
    assert auto.step_time - fused.step_time == pytest.approx(want, rel=1e-9)


def test_one_micro_batch_pays_nothing():
    machine = preset("a100", 8)
    one = cost_recipe("gpt", machine, "tp=2,mbs=4,gbs=16,grad_accum=autograd", sizes=SIZES)
    assert one.step_time == cost_recipe("gpt", machine, "tp=2,mbs=4,gbs=16", sizes=SIZES).step_time


def test_a_pipeline_stage_pays_its_own_weights_each_micro_batch_but_one_share():
    """Two stages of tensor parallelism 2 and 8 micro-batches: each stage's backward per micro-batch grows by
    (1 - 1/8) of one pass over the gradient tiles its devices hold (the step then runs m - 1 of them in all)."""
    machine = preset("a100", 4)
    rec = "tp=2,pp=2,mbs=1,gbs=8,recompute=full"
    fused = cost_recipe("gpt", machine, rec, sizes=SIZES)
    auto = cost_recipe("gpt", machine, rec + ",grad_accum=autograd", sizes=SIZES)
    acc = dataclasses.replace(machine, num_devices=2, grad_accum_bytes=6.0)
    stages = auto.detail.plan.stages
    assert len(stages) == 2
    for stage, before in zip(stages, fused.detail.plan.stages):
        sp = stage.cost.detail  # the stage's plan on its 2 devices
        elems = sum(float(optimizer_elements(op, lay, 2)[k])
                    for op, lay, k in zip(sp.tables.graph.operators, sp.tables.arrays, sp.assignment))
        want = (1 - 1 / 8) * float(grad_accumulation_seconds(np.array([elems]), acc)[0])
        assert want > 0 and stage.cost.forward == pytest.approx(before.cost.forward, rel=1e-12)
        assert stage.cost.backward - before.cost.backward == pytest.approx(want, rel=1e-9)
    assert auto.step_time > fused.step_time


def test_weight_sync_nets_the_accumulation_out_of_the_once_per_step_work():
    """The plain stage search charges ``max(t - (1 - 1/m) w, 0)``: w is the step's all-reduce and optimizer share
    less one micro-batch's accumulation, so the accumulation is charged (1 - 1/m) per micro-batch."""
    from shardplan.cost import build_tables
    from shardplan.pipeline.stages import weight_sync

    g = get_model("gpt", 4, **SIZES)
    machine = preset("a100", 2)
    tables = build_tables(g, machine, cutoff=1)
    acc = dataclasses.replace(machine, grad_accum_bytes=6.0)
    for op, lay in zip(g.operators, tables.arrays):
        plain, netted = weight_sync(op, lay, None, machine), weight_sync(op, lay, None, acc)
        want = grad_accumulation_seconds(optimizer_elements(op, lay, 2), acc) if any(
            w.needs_grad for w in op.weights) else 0.0
        assert np.allclose(plain - netted, want, rtol=1e-12, atol=0.0)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
@pytest.mark.parametrize("memory_choices", [False, True])
def test_the_stage_search_equals_the_milp_with_the_accumulation(memory_choices, schedule):
    """A 4-block GPT whose stages pay autograd's accumulation: the lazy pipeline search equals the MILP over every
    cut and sub-mesh (every stage costed eagerly), with and without the memory choices, under 1F1B and ZB-H1
    (whose W pass, the products less 1/m of an accumulation, stays within [0, B])."""
    from shardplan.pipeline import ModelStages, PipelineSpace
    from shardplan.pipeline.ilp import solve_pipeline_ilp
    from shardplan.pipeline.search import search_pipeline

    machine = dataclasses.replace(preset("a100", 4), node_size=2, inter_bandwidth=1e9, sm_count=None,
                                  gemm_tiles=None, grad_accum_bytes=6.0, memory_bytes=None)
    build = lambda b: get_model("gpt", b, layers=4, d_model=64, heads=2, seq=16, vocab=256)  # noqa: E731
    st = ModelStages(build, 8, machine, {"cutoff": 1}, memory_choices=memory_choices)
    _, units, _ = st.graph(2)
    space = PipelineSpace(len(units), 4, 2, (2, 4), None, sizes=(1, 2, 4), uniform=False)
    ilp = solve_pipeline_ilp(space, st.stage_cost, st.exchange_time, schedule,
                             fit_fn=st.fit_cost if memory_choices else None)
    got = search_pipeline(space, st.stage_cost, st.link_time, (schedule,), exchange=st.exchange_time,
                          fit_fn=st.fit_cost if memory_choices else None)
    assert ilp.proven and got.step_time == pytest.approx(ilp.step_time, rel=1e-9)
    for s in got.stages:
        assert 0.0 <= s.cost.weight_grad <= s.cost.backward
    fused = ModelStages(build, 8, dataclasses.replace(machine, grad_accum_bytes=0.0), {"cutoff": 1},
                        memory_choices=memory_choices)
    assert st.stage_cost(0, len(units), 4, 4).backward > fused.stage_cost(0, len(units), 4, 4).backward


def test_zb_h1s_w_pass_never_goes_below_zero():
    """An accumulation far dearer than the weight-gradient products (a hundred times autograd's bytes): the W pass,
    the products plus the amortised sync less 1/m of an accumulation, would come out negative; it is held at 0."""
    from shardplan.pipeline import ModelStages

    machine = dataclasses.replace(preset("a100", 4), sm_count=None, gemm_tiles=None, grad_accum_bytes=600.0)
    build = lambda b: get_model("gpt", b, layers=2, d_model=64, heads=2, seq=16, vocab=256)  # noqa: E731
    st = ModelStages(build, 8, machine, {"cutoff": 1})
    _, units, _ = st.graph(4)
    cost = st.stage_cost(0, len(units), 4, 4)
    plan = cost.detail
    from shardplan.pipeline.stages import _forward_backward, weight_sync

    sync = sum(float(weight_sync(op, lay, None, dataclasses.replace(machine, num_devices=4))[k])
               for op, lay, k in zip(plan.tables.graph.operators, plan.tables.arrays, plan.assignment))
    products = _forward_backward(plan)[2]
    assert products + sync / 4 < 0  # the unclamped W pass
    assert cost.weight_grad == 0.0 < cost.backward
