"""``fp8_efficiency``: the fraction of ``fp8_flops`` an FP8 product reaches, where FP8 products are costed, in the
machine files, the calibration, and the planner's FP8 floor."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from shardplan import ops
from shardplan.calibrate import Calibration, Fp8Point, MatmulPoint, Section, fp8_efficiency, to_profile
from shardplan.cost.memory import ChoiceRules, choice_table
from shardplan.errors import ShardplanError
from shardplan.ir import GraphBuilder, TensorRef
from shardplan.machine import (OPTIONAL_FIELDS, Machine, load_machine_file, load_profile, machine_to_file,
                               parse_profile, preset)
from shardplan.pipeline.stages import graph_device_seconds
from shardplan.planner import _faster_of_fp8

F = 1e12
FLOPS = 3 * 2 * 16 * 16 * 32  # a dense op's 3 passes on its tile: b = 64 split 4 ways, n = 16, c = 32
CFG, ORDER = np.array([[4, 1, 1]]), np.array([[0, 1, 2]])


def dense_op(b: int = 64, c: int = 32, n: int = 16):
    return ops.dense("fc", TensorRef("x", (b, c), needs_grad=True), n)


def machine(p: int = 4, **kw) -> Machine:
    base = dict(peak_flops=F, bandwidth=1e9, dtype_bytes=2, hbm_bandwidth=1e14, flops_efficiency=0.5,
                fp8_flops=2 * F)
    return Machine(p, **{**base, **kw})


def compute(t, fp8: bool) -> float:
    j = np.flatnonzero((t.stage == 0) & ~t.recompute & (t.fp8 == fp8) & (t.offload == 0))
    assert len(j) == 1
    return float(t.parts["compute"][j[0]])


def test_the_constant_is_checked():
    assert machine().fp8_efficiency is None
    assert machine(fp8_efficiency=0.4).fp8_efficiency == 0.4
    for bad in (0.0, -0.1, 1.5, "0.4"):
        with pytest.raises(ShardplanError, match="fp8_efficiency"):
            machine(fp8_efficiency=bad)
    with pytest.raises(ShardplanError, match="fp8_efficiency needs fp8_flops"):
        machine(fp8_flops=None, fp8_efficiency=0.4)
    with pytest.raises(ShardplanError, match="no FP8 matrix products"):
        machine(fp8_flops=None).fp8_machine()
    assert machine(fp8_flops=None).fp8_achievable_flops is None


def test_fp8_machine_rates():
    m = machine(fp8_efficiency=0.4)
    f8 = m.fp8_machine()
    assert (f8.peak_flops, f8.flops_efficiency, f8.fp8_efficiency) == (2 * F, 0.4, 0.4)
    assert f8.hbm_bandwidth == m.hbm_bandwidth and f8.num_devices == m.num_devices
    assert m.fp8_achievable_flops == 2 * F * 0.4
    assert machine().fp8_machine().flops_efficiency == 0.5  # absent: the 16-bit products' fraction
    assert machine().fp8_achievable_flops == 2 * F * 0.5


def test_an_fp8_product_is_costed_at_fp8_efficiency_by_hand():
    """Compute-bound (HBM 1e14 B/s): per device 16 x 16 x 32 multiply-adds per pass, 3 passes, 49152 FLOPs.
    bf16 at 1e12 * 0.5; FP8 at 2e12 * 0.4 with the constant, 2e12 * 0.5 (the bf16 fraction) without."""
    op = dense_op()
    with_it = choice_table(op, CFG, ORDER, machine(fp8_efficiency=0.4), prune=False, rules=ChoiceRules(fp8=True))
    without = choice_table(op, CFG, ORDER, machine(), prune=False, rules=ChoiceRules(fp8=True))
    assert FLOPS == 49152
    assert compute(with_it, True) == pytest.approx(6.144e-8, rel=1e-14)  # 49152 / (2e12 * 0.4)
    assert compute(without, True) == pytest.approx(4.9152e-8, rel=1e-14)  # 49152 / (2e12 * 0.5)
    assert compute(with_it, False) == compute(without, False) == pytest.approx(9.8304e-8, rel=1e-14)  # / 0.5e12
    # the casts are charged apart, the same with or without the constant: (2 + 2) bytes per element of x, W, dY
    f8 = np.flatnonzero(with_it.fp8)
    assert with_it.parts["fp8_scaling"][f8] == pytest.approx(without.parts["fp8_scaling"][np.flatnonzero(without.fp8)])
    assert with_it.parts["fp8_scaling"][f8][0] == pytest.approx(4 * (512 + 512 + 256) / 1e14)


def test_h100_fp8_product_by_hand_under_tiles_and_waves():
    """One 8192 x 8192 x 8192 dense layer on one H100: every pass's output is 8192 x 8192, 2048 tiles of 256 x 128
    in 16 waves of 132 SMs, u = 2048 / 2112. FP8 at 1979e12 * 0.65 * u; without the constant at 1979e12 * 0.69 * u
    (the numbers before fp8_efficiency); bf16 at 989e12 * 0.69 * u."""
    op = dense_op(8192, 8192, 8192)
    one, order = np.array([[1, 1, 1]]), np.array([[0, 1, 2]])
    h100 = preset("h100", 1)
    assert h100.fp8_efficiency == 0.65
    u = 2048 / 2112
    flops = 3 * 2 * 8192.0**3
    t = choice_table(op, one, order, h100, prune=False, rules=ChoiceRules(fp8=True))
    assert compute(t, True) == pytest.approx(flops / (1979e12 * 0.65 * u), rel=1e-12)
    assert compute(t, False) == pytest.approx(flops / (989e12 * 0.69 * u), rel=1e-12)
    old = choice_table(op, one, order, replace(h100, fp8_efficiency=None), prune=False, rules=ChoiceRules(fp8=True))
    assert compute(old, True) == pytest.approx(flops / (1979e12 * 0.69 * u), rel=1e-12)
    assert compute(t, True) / compute(old, True) == pytest.approx(0.69 / 0.65, rel=1e-12)


def test_profiles_without_fp8_are_unchanged():
    for name in ("paper", "1080ti", "2080ti", "a100"):
        m = preset(name, 8)
        assert m.fp8_flops is None and m.fp8_efficiency is None, name
    assert load_profile("cpu.json").values["fp8_efficiency"] is None
    assert load_profile("a100-sxm-40gb.json").values["fp8_efficiency"] is None
    assert preset("h200", 8).fp8_efficiency == 0.68


def test_machine_file_round_trip(tmp_path):
    h100 = preset("h100", 16)
    path = tmp_path / "h100.json"
    machine_to_file(h100, path, sources={"fp8_efficiency": "by hand"})
    doc = json.loads(path.read_text())
    assert doc["fp8_efficiency"] == {"value": 0.65, "source": "by hand"}
    assert load_machine_file(path, 16) == h100
    # a file written before the field existed reads it as None (FP8 at flops_efficiency), with a stated source
    del doc["fp8_efficiency"]
    old = parse_profile(json.dumps(doc))
    assert old.values["fp8_efficiency"] is None
    assert old.sources["fp8_efficiency"] == OPTIONAL_FIELDS["fp8_efficiency"]
    assert old.machine(16) == replace(h100, fp8_efficiency=None)
    again = parse_profile(old.to_json())
    assert again == old and again.machine(16) == old.machine(16)
    # the value null is refused where there is no FP8 peak to be a fraction of: a non-null one is
    doc["fp8_flops"]["value"] = None
    doc["fp8_efficiency"] = {"value": 0.5, "source": "by hand"}
    with pytest.raises(ShardplanError, match="fp8_efficiency needs fp8_flops"):
        parse_profile(json.dumps(doc))


def _cal(fp8: Section, sm_count: int | None) -> Calibration:
    mm = (MatmulPoint(8192, 8192, 8192, 2 * 8192**3 / 600e12, "d=8192 out forward"),)
    return Calibration("torch", 1, "gpu", "bf16", "2026-01-02 03:04 UTC", (), mm, 2**20, 1e-6, (), "", 0.0, 8e10,
                       "none", sm_count=sm_count, sm_source="multi_processor_count", fp8=fp8)


def test_calibration_writes_fp8_efficiency():
    """FP8 rates 1.2e15 at 8192^3 (u = 2048 / 2112), 0.2e15 at a 1024 x 1024 output (64 tiles of 128 x 128 in
    one wave: u = 64 / 132), 1.3e15 at 8192 x 8192 x 4096 (the best, fp8_flops): the median of
    rate / (u * 1.3e15) over the three."""
    rows = (Fp8Point(8192, 8192, 8192, 2 * 8192**3 / 1.2e15),
            Fp8Point(1024, 1024, 8192, 2 * 1024 * 1024 * 8192 / 0.2e15),
            Fp8Point(8192, 8192, 4096, 2 * 8192**2 * 4096 / 1.3e15))
    effs = sorted([1.2 / 1.3 * 2112 / 2048, 0.2 / 1.3 * 132 / 64, 2112 / 2048])
    cal = _cal(Section(rows), 132)
    assert fp8_efficiency(cal) == pytest.approx(effs[1])
    prof = to_profile(cal)
    assert prof.values["fp8_flops"] == pytest.approx(1.3e15)
    assert prof.values["fp8_efficiency"] == pytest.approx(effs[1])
    assert "torch._scaled_mm" in prof.sources["fp8_efficiency"] and "sm_count 132" in prof.sources["fp8_efficiency"]
    assert parse_profile(prof.to_json()).machine(1) == prof.machine(1)
    # capped at 1: without a multiprocessor count u = 1 and the median is 1.2 / 1.3
    assert fp8_efficiency(_cal(Section(rows), None)) == pytest.approx(1.2 / 1.3)
    # no FP8 measured (a CPU): nothing written but the reason
    none = to_profile(_cal(Section(skipped="no CUDA device"), None))
    assert none.values["fp8_efficiency"] is None and none.values["fp8_flops"] is None
    assert "not measured (no CUDA device)" in none.sources["fp8_efficiency"]


def _graph():
    g = GraphBuilder("two")
    x = g.input("x", (256, 512), needs_grad=False)
    h = g.add(ops.dense("fc1", x, 1024))
    g.add(ops.dense("fc2", h, 512))
    return g.build()


@pytest.mark.parametrize("kw", [dict(fp8_efficiency=0.65, flops_efficiency=0.69),  # the FP8 machine is faster
                                dict(fp8_flops=0.5 * F, fp8_efficiency=1.0),  # the plain machine is
                                dict(fp8_flops=0.9 * F, fp8_efficiency=1.0),  # lower peak, higher rate: mixed
                                dict(fp8_efficiency=None)])
def test_the_fp8_floor_is_no_slower_than_either_rate(kw):
    m = machine(8, **kw)
    fast = _faster_of_fp8(m)
    f8 = m.fp8_machine()
    assert fast.peak_flops >= max(m.peak_flops, f8.peak_flops)
    assert fast.achievable_flops >= max(m.achievable_flops, f8.achievable_flops)
    assert fast.attention_flops >= max(m.attention_flops, f8.attention_flops)
    assert fast.achievable_flops <= max(m.achievable_flops, f8.achievable_flops) * (1 + 1e-15)
    g = _graph()
    floor = graph_device_seconds(g, fast)
    assert floor <= min(graph_device_seconds(g, m), graph_device_seconds(g, f8))


def test_the_fp8_floor_keeps_the_old_machine_without_the_constant():
    m = machine(8)  # fp8_flops 2e12 >= peak 1e12 at the same fraction: the FP8 peak, as before the constant
    assert _faster_of_fp8(m) == replace(m, peak_flops=2 * F)
    h100 = preset("h100", 8)
    assert _faster_of_fp8(h100) == h100.fp8_machine()
    assert _faster_of_fp8(h100).achievable_flops == 1979e12 * 0.65
    mixed = _faster_of_fp8(machine(8, fp8_flops=0.9 * F, fp8_efficiency=1.0))
    assert mixed.peak_flops == F and mixed.achievable_flops >= 0.9 * F
    assert mixed.flops_efficiency == pytest.approx(0.9, rel=1e-15) and math.isfinite(mixed.flops_efficiency)
