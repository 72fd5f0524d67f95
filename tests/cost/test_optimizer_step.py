"""The optimizer step: once per step, each device updates its shard of every trainable weight it owns, at HBM
bandwidth, with the bytes per element of the precision rules (docs/cost-model.md, "Optimizer step")."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from shardplan import ops
from shardplan.cost import build_tables, operator_cost
from shardplan.cost.memory import ChoiceRules, choice_table
from shardplan.cost.operator import optimizer_step_bytes
from shardplan.ir import TensorRef
from shardplan.machine import Machine, preset

F, B, H = 1e12, 1e9, 1e9  # FLOP/s, link bytes/s, HBM bytes/s
W = 32 * 16  # the dense layer's weight elements (c = 32, n = 16)


def dense_op():
    # y[b, n] = sum_c x[b, c] W[c, n]: dims (b, n, c) = (64, 16, 32)
    return ops.dense("fc", TensorRef("x", (64, 32), needs_grad=True), 16)


def machine(dtype_bytes: int = 2, **kw) -> Machine:
    return Machine(4, peak_flops=F, bandwidth=B, hbm_bandwidth=H, dtype_bytes=dtype_bytes, **kw)


def one(table, stage: int, offload: int = 0) -> int:
    j = np.flatnonzero((table.stage == stage) & ~table.recompute & (table.offload == offload))
    assert len(j) == 1
    return int(j[0])


def test_bytes_per_element_by_hand():
    # own master copy: read weight, gradient, o state words; write weight and state: (3 + 2 o) s
    assert optimizer_step_bytes(2, 4) == 28.0  # Adam in fp32
    assert optimizer_step_bytes(2, 2) == 14.0  # Adam, all in bf16
    assert optimizer_step_bytes(0, 4) == 12.0  # plain SGD in fp32
    # master weights: read master 4, gradient s, state 4 o; write master 4, state 4 o, the s-byte copy s
    assert optimizer_step_bytes(2, 2, master_weights=True) == 28.0
    assert optimizer_step_bytes(1, 2, master_weights=True) == 20.0  # momentum SGD
    assert optimizer_step_bytes(2, 4, master_weights=True) == 28.0  # fp32 weights are their own master
    assert ChoiceRules(master_weights=True).optimizer_step_bytes(2, 2) == 28.0


def test_operator_cost_charges_the_tile_each_device_updates():
    op = dense_op()
    m = machine()
    cfg = np.array([[4, 1, 1], [1, 4, 1], [1, 1, 4], [2, 2, 1]])  # batch, n, c, batch x n
    c = operator_cost(op, cfg, m)
    # the weight tile per device: whole when only the batch is split, 1/4 when n or c is, 1/2 at 2 x 2
    assert c.optimizer == pytest.approx(np.array([W, W / 4, W / 4, W / 2]) * 14.0 / H, rel=1e-12)
    assert c.total == pytest.approx(c.compute + c.communication + c.optimizer, rel=1e-12)
    assert operator_cost(op, cfg, m, step_bytes=28.0).optimizer == pytest.approx(2 * c.optimizer, rel=1e-12)


def test_nothing_charged_without_hbm_bandwidth_or_trainable_owned_weights():
    op = dense_op()
    cfg = np.array([[4, 1, 1]])
    assert not operator_cost(op, cfg, replace(machine(), hbm_bandwidth=None)).optimizer.any()
    frozen = replace(op, weights=tuple(replace(w, needs_grad=False) for w in op.weights))
    assert not operator_cost(frozen, cfg, machine()).optimizer.any()
    shared = replace(op, weights=tuple(replace(w, owner=("head", "W")) for w in op.weights))
    assert not operator_cost(shared, cfg, machine()).optimizer.any()  # the owner updates it, once


@pytest.mark.parametrize("master, per_elem", [(False, 14.0), (True, 28.0)])
def test_choice_table_zero_stages_by_hand(master, per_elem):
    op = dense_op()
    m = machine()
    cfg, order = np.array([[4, 1, 1]]), np.array([[0, 1, 2]])  # batch split 4: W replicated, data group 4
    rules = ChoiceRules(master_weights=master)
    t = choice_table(op, cfg, order, m, prune=False, rules=rules)
    opt = t.parts["optimizer"]
    assert opt[one(t, 0)] == pytest.approx(W * per_elem / H, rel=1e-12)  # the whole tile
    for s in (1, 2, 3):
        assert opt[one(t, s)] == pytest.approx(W / 4 * per_elem / H, rel=1e-12)  # its 1/4 shard
    # once per step whatever the micro-batch count; 1/accumulate of it per micro-batch of a pipeline stage
    t4 = choice_table(op, cfg, order, m, micro_batches=4, prune=False, rules=rules)
    assert t4.parts["optimizer"][one(t4, 0)] == pytest.approx(opt[one(t, 0)], rel=1e-12)
    assert t4.parts["optimizer"][one(t4, 3)] == pytest.approx(opt[one(t, 3)], rel=1e-12)
    acc = choice_table(op, cfg, order, m, prune=False, rules=rules, accumulate=4)
    assert acc.parts["optimizer"][one(acc, 1)] == pytest.approx(opt[one(t, 1)] / 4, rel=1e-12)
    # the seconds of every choice include it
    assert t.seconds == pytest.approx(sum(t.parts.values()), rel=1e-12)


def test_stage0_is_operator_cost_and_offloaded_state_steps_on_the_cpu():
    op = dense_op()
    m = machine(host_bandwidth=1e9, host_memory_bytes=1e12, cpu_adam_rate=1e9)
    cfg, order = np.array([[4, 1, 1], [1, 4, 1]]), np.array([[0, 1, 2], [1, 0, 2]])
    t = choice_table(op, cfg, order, m, prune=False, rules=ChoiceRules(offload=("optimizer",)))
    zero0 = (t.stage == 0) & ~t.recompute
    assert t.parts["optimizer"][zero0] == pytest.approx(operator_cost(op, cfg, m).optimizer[t.base[zero0]],
                                                        rel=1e-12)
    off = (t.offload & 1).astype(bool)
    assert off.any() and not t.parts["optimizer"][off].any()  # replaced by the CPU's step
    assert (t.parts["optimizer"][~off] > 0).all()


def test_tables_take_the_optimizer_factor():
    from shardplan.models import get_model

    g = get_model("gpt", batch=8, layers=1, d_model=64, heads=2, seq=32, vocab=256)
    m = replace(preset("a100", 8), memory_bytes=None)
    adam = build_tables(g, m, orders="row-major")
    sgd = build_tables(g, m, orders="row-major", optimizer_factor=0.0)
    s = float(m.dtype_bytes)
    for a, b in zip(adam.op_costs, sgd.op_costs):
        assert b.optimizer * (3 + 4) * s == pytest.approx(a.optimizer * 3 * s, rel=1e-12)
    assert any(c.optimizer.any() for c in adam.op_costs)


def test_a_plans_step_charges_it_once_per_step():
    from shardplan.fit import plan_with_choices
    from shardplan.models import get_model
    from shardplan.spmd import solve

    g = get_model("gpt", batch=8, layers=1, d_model=64, heads=2, seq=32, vocab=256)
    m = replace(preset("a100", 8), memory_bytes=None)
    plan = solve(g, m, orders="row-major")
    tables = plan.tables
    want = sum(float(c.optimizer[k]) for c, k in zip(tables.op_costs, plan.assignment))
    assert want > 0 and plan.breakdown["optimizer"] == pytest.approx(want, rel=1e-12)
    one_mb = plan_with_choices(plan, micro_batches=1).memory_choices
    four = plan_with_choices(plan, micro_batches=4).memory_choices
    for i in range(len(g.operators)):
        assert four.parts(i)["optimizer"] == pytest.approx(one_mb.parts(i)["optimizer"], rel=1e-12)


def test_a_pipeline_stage_splits_every_part_and_amortises_the_step_with_the_sync():
    """A stage's forward + backward is each operator's whole cost (the step in the backward), and the once-per-step
    part a stage charges 1/m per micro-batch includes the step."""
    from shardplan.models import get_model
    from shardplan.pipeline.stages import _split_parts, weight_sync

    g = get_model("gpt", batch=8, layers=1, d_model=64, heads=2, seq=32, vocab=256)
    m = replace(preset("a100", 8), memory_bytes=None)
    tables = build_tables(g, m, orders="row-major")
    stepped = 0
    for op, cost, arr in zip(g.operators, tables.op_costs, tables.arrays):
        for k in range(len(cost.total)):
            f, b, _ = _split_parts(op, cost.parts(k))
            assert f + b == pytest.approx(float(cost.total[k]), rel=1e-12)
        frozen = replace(op, weights=tuple(replace(w, needs_grad=False) for w in op.weights))
        sync = np.maximum(cost.grad_allreduce - operator_cost(frozen, arr, m).grad_allreduce, 0.0)
        assert weight_sync(op, arr, None, m) == pytest.approx(sync + cost.optimizer, rel=1e-12, abs=0)
        stepped += int(cost.optimizer.any())
    assert stepped > 0


@pytest.mark.parametrize("dtype_bytes, rate", [(2, 0.5 * H), (4, H)])
def test_the_step_on_16_bit_elements_streams_at_the_converting_rate(dtype_bytes, rate):
    """On elements narrower than 4 bytes the fused update converts to fp32 and back: ``convert_bandwidth``; on
    fp32 elements nothing converts: ``hbm_bandwidth``; without ``convert_bandwidth`` every step at the HBM rate."""
    op = dense_op()
    cfg = np.array([[4, 1, 1], [1, 4, 1]])
    step = optimizer_step_bytes(2, dtype_bytes)
    c = operator_cost(op, cfg, machine(dtype_bytes, convert_bandwidth=0.5 * H))
    assert c.optimizer == pytest.approx(np.array([W, W / 4]) * step / rate, rel=1e-12)
    plain = operator_cost(op, cfg, machine(dtype_bytes))
    assert plain.optimizer == pytest.approx(np.array([W, W / 4]) * step / H, rel=1e-12)
    rules = ChoiceRules(master_weights=True)
    t = choice_table(op, np.array([[4, 1, 1]]), np.array([[0, 1, 2]]), machine(dtype_bytes, convert_bandwidth=0.5 * H),
                     prune=False, rules=rules)
    per_elem = optimizer_step_bytes(2, dtype_bytes, master_weights=True)
    assert t.parts["optimizer"][one(t, 0)] == pytest.approx(W * per_elem / rate, rel=1e-12)


def test_a_cast_is_charged_at_the_converting_rate_and_an_lstm_is_not_a_cast():
    """An operator whose input and output differ in element size (``elem_factor``) converts: its HBM bytes at
    ``convert_bandwidth``; a weight's factor (an LSTM's gates) does not make an operator a cast."""
    from shardplan.cost.operator import converts

    x = TensorRef("x", (64, 32), needs_grad=True)
    cast = ops.elementwise("cast", x, kind="cast")
    wide = replace(cast, output=replace(cast.output, elem_factor=2))
    m = machine(2, convert_bandwidth=0.5 * H)
    cfg = np.array([[1, 1], [4, 1]])
    assert not converts(cast) and converts(wide)
    n = np.array([64 * 32, 64 * 32 / 4])
    assert operator_cost(cast, cfg, m).compute == pytest.approx(2 * n * (1 + 1) * 2 / H, rel=1e-12)
    assert operator_cost(wide, cfg, m).compute == pytest.approx(2 * n * (1 + 2) * 2 / (0.5 * H), rel=1e-12)
    lstm = ops.lstm("lstm", TensorRef("x", (4, 8, 16), needs_grad=True), 16, 2)
    assert not converts(lstm)
    # a float32 product of a float32 value and a 16-bit one reads one input in its own size: no conversion kernel
    mixed = ops.elementwise("mul", x, TensorRef("y", (64, 32), needs_grad=True))
    mixed = replace(mixed, inputs=(replace(mixed.inputs[0], elem_factor=2), mixed.inputs[1]),
                    output=replace(mixed.output, elem_factor=2))
    assert not converts(mixed)


def test_a_converting_rate_above_the_hbm_rate_is_refused():
    from shardplan.errors import ShardplanError

    with pytest.raises(ShardplanError, match="convert_bandwidth"):
        machine(2, convert_bandwidth=2 * H)
    assert machine(2, convert_bandwidth=0.5 * H).convert_rate == 0.5 * H
    assert machine(2).convert_rate == H
    assert Machine(1, convert_bandwidth=1e9).convert_rate is None  # no HBM bandwidth: no memory-bound work
