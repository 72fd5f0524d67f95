"""FP8 parameters (``fp8_params``) and current scaling (``fp8_scaling=current``): bytes per parameter, the FP8
gathers, the amax pass and the optimizer step against hand derivations (docs/memory.md, "FP8 parameters and
current scaling")."""

from __future__ import annotations

import numpy as np
import pytest

from shardplan import ops
from shardplan.cost.memory import ChoiceRules, choice_table, fp8_scaling_seconds
from shardplan.errors import ShardplanError
from shardplan.ir import TensorRef
from shardplan.machine import Machine, preset
from shardplan.models import get_model
from shardplan.recipe import Recipe, cost_recipe

B = 1e9  # link bytes/s
F = 1e12  # FLOP/s
H = 2e12  # HBM bytes/s
W = 32 * 16  # weight elements of the dense layer below
X, DY = 16 * 32, 16 * 16  # input and output-gradient tile elements per device (batch 64 split 4 ways)
CFG, ORDER = np.array([[4, 1, 1]]), np.array([[0, 1, 2]])  # batch split 4 ways, the weight on every device


def _machine() -> Machine:
    return Machine(4, peak_flops=F, bandwidth=B, dtype_bytes=2, hbm_bandwidth=H, fp8_flops=2 * F)


def _op():
    return ops.dense("fc", TensorRef("x", (64, 32), needs_grad=True), 16)


def _table(accumulate: int = 1, **rules):
    return choice_table(_op(), CFG, ORDER, _machine(), prune=False, accumulate=accumulate,
                        rules=ChoiceRules(fp8=True, master_weights=True, **rules))


def _row(t, stage: int, fp8: bool) -> int:
    j = np.flatnonzero((t.stage == stage) & ~t.recompute & (t.fp8 == fp8))
    assert len(j) == 1
    return int(j[0])


def test_bytes_per_parameter_by_stage():
    """bf16 weights, fp32 master and Adam moments (12 bytes, sharded over G = 4 from stage 1), bf16 gradient
    (sharded from stage 2), FP8 data + transpose (2 bytes); with fp8_params the bf16 value goes (stages 0-2) or
    its shard is kept in one byte (stage 3)."""
    plain, params = _table(), _table(fp8_params=True)
    without = {0: 2 + 2 + 12 + 2, 1: 2 + 2 + 12 / 4 + 2, 2: 2 + 2 / 4 + 12 / 4 + 2, 3: (2 + 2 + 12) / 4 + 2}
    with_ = {0: 2 + 12 + 2, 1: 2 + 12 / 4 + 2, 2: 2 / 4 + 12 / 4 + 2, 3: (1 + 2 + 12) / 4 + 2}
    bf16 = {0: 16, 1: 2 + 2 + 3, 2: 2 + 0.5 + 3, 3: 4}
    for s in range(4):
        assert plain.state_bytes[_row(plain, s, True)] == W * without[s]
        assert params.state_bytes[_row(params, s, True)] == W * with_[s]
        assert params.state_bytes[_row(params, s, False)] == plain.state_bytes[_row(plain, s, False)] == W * bf16[s]
        assert params.grad_bytes[_row(params, s, True)] == W * (2 if s < 2 else 0.5)


def test_fp8_gathers_move_one_byte_per_element():
    """ZeRO-1: reduce-scatter the bf16 gradient, gather the weights (3/4 of the bytes each, 4 devices, no latency);
    ZeRO-3 at one micro-batch: one reduce-scatter and two gathers. fp8_params halves the gathers' bytes."""
    plain, params = _table(), _table(fp8_params=True)
    g, w16, w8 = 0.75, 2 * W, W
    assert plain.parts["weight_sync"][_row(plain, 1, True)] == pytest.approx(g * w16 / B + g * w16 / B, rel=1e-12)
    assert params.parts["weight_sync"][_row(params, 1, True)] == pytest.approx(g * w16 / B + g * w8 / B, rel=1e-12)
    assert params.parts["weight_sync"][_row(params, 3, True)] == pytest.approx(g * w16 / B + 2 * g * w8 / B,
                                                                               rel=1e-12)
    assert params.parts["weight_sync"][_row(params, 1, False)] == plain.parts["weight_sync"][_row(plain, 1, False)]


def test_current_scaling_adds_one_read_of_each_cast_operand():
    """Delayed: each operand read in bf16 and written twice in FP8, 4 bytes per element of X, W and dY. Current:
    2 more per element of X and dY (the amax pass); the weight's amax too without fp8_params. With fp8_params the
    weight is not cast: its FP8 data read and transpose written, 2 bytes per element."""
    op, m = _op(), _machine()
    cases = {(False, False): 4 * (X + W + DY), (True, False): 6 * (X + W + DY),
             (False, True): 4 * (X + DY) + 2 * W, (True, True): 6 * (X + DY) + 2 * W}
    for (current, params), nbytes in cases.items():
        got = fp8_scaling_seconds(op, CFG, m, current=current, fp8_params=params)
        assert got.tolist() == [nbytes / H]
        t = _table(fp8_scaling="current" if current else "delayed", fp8_params=params)
        assert t.parts["fp8_scaling"][_row(t, 1, True)] == nbytes / H
    delayed, current = _table(), _table(fp8_scaling="current")
    j = _row(delayed, 1, True)
    assert current.seconds[j] - delayed.seconds[j] == pytest.approx(2 * (X + W + DY) / H, rel=1e-12)


def test_weights_are_cast_once_a_step_in_a_pipeline_stage():
    """A stage's table is one micro-batch of a step of 4 (accumulate): the activations' casts are that micro-batch's,
    the weights' a quarter of the step's one cast (TE caches the FP8 weight after the first micro-batch)."""
    t = _table(accumulate=4)
    assert t.parts["fp8_scaling"][_row(t, 1, True)] == 4 * (X + DY + W / 4) / H


def test_optimizer_step_writes_the_fp8_copy():
    """Adam with master weights reads and writes 8 + 8·2 + 2·2 = 28 bytes per element; with fp8_params the copy is
    written in one byte (27), and current scaling reads the fp32 master shard once more for its amax (31)."""
    assert ChoiceRules(master_weights=True).fp8_param_step_bytes(2.0, 2) == 28
    assert ChoiceRules(master_weights=True, fp8_params=True).fp8_param_step_bytes(2.0, 2) == 27
    assert ChoiceRules(master_weights=True, fp8_params=True, fp8_scaling="current").fp8_param_step_bytes(2.0, 2) == 31
    t = _table(fp8_params=True)
    assert t.parts["optimizer"][_row(t, 1, True)] == pytest.approx(W / 4 * 27 / H, rel=1e-12)  # the shard of G = 4
    assert t.parts["optimizer"][_row(t, 1, False)] == pytest.approx(W / 4 * 28 / H, rel=1e-12)


def _llama(batch: int):
    return get_model("llama3-8b", batch, layers=1, d_model=64, heads=4, kv_heads=2, d_ff=128, vocab=256, seq=32)


def test_recipe_saves_two_bytes_per_fp8_weight():
    """Megatron-Core with TE on 2 H100 at ZeRO-1: only the blocks' linear weights are FP8 (q 64×64, k and v 64×32,
    out 64×64, gate and up 64×128, down 128×64: 36,864 elements); each drops its 2-byte bf16 copy."""
    base = "tp=1,mbs=1,gbs=2,zero=1,precision=fp8,runtime=megatron_te"
    a = cost_recipe(_llama, preset("h100", 2), base)
    b = cost_recipe(_llama, preset("h100", 2), base + ",fp8_params=true")
    elems = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 2 * 64 * 128 + 128 * 64
    assert a.memory["peak_bytes"] - b.memory["peak_bytes"] == 2 * elems


def test_keys_parse_and_refuse():
    r = Recipe.parse("tp=1,precision=fp8,fp8_param_gather=true,fp8_recipe=tensorwise")
    assert (r.fp8_params, r.fp8_scaling) == (True, "current")
    assert Recipe.parse(str(r)) == r and str(r) == "precision=fp8,fp8_params=true,fp8_scaling=current"
    with pytest.raises(ShardplanError, match="fp8_scaling must be one of delayed, current"):
        Recipe.parse("precision=fp8,fp8_scaling=blockwise")
    for text in ("tp=1,gbs=2,fp8_params=true", "tp=1,gbs=2,precision=mixed,fp8_scaling=current"):
        with pytest.raises(ShardplanError, match="need precision=fp8"):
            cost_recipe(_llama, preset("h100", 2), text)
    with pytest.raises(ShardplanError, match="fp8_params with offload"):
        cost_recipe(_llama, preset("h100", 2), "tp=1,gbs=2,zero=1,precision=fp8,fp8_params=true,offload=optimizer")
    with pytest.raises(ShardplanError, match="fp8_params with host offload"):
        ChoiceRules(fp8_params=True, offload=("optimizer",))
