"""The measured profiles' constants are what benchmarks/profile_constants.py derives from the committed GPU
measurements (the one derivation for every profile: a file edited by hand, or a measurement replaced without
its profile, fails here)."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks.profile_constants import constants
from shardplan.machine import preset

RESULTS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results")


def _derived(measured: str, machine: str) -> dict:
    with open(os.path.join(RESULTS, measured)) as f:
        return constants(json.load(f), preset(machine, 1))


@pytest.mark.parametrize("measured, machine", [("gpu_measure_h100.json", "h100"), ("gpu_measure_h200.json", "h200")])
def test_efficiencies_are_the_medians_measured(measured, machine):
    d, m = _derived(measured, machine), preset(machine, 1)
    assert round(d["flops_efficiency"]["quartiles"][1], 2) == m.flops_efficiency
    assert abs(d["attention_efficiency"]["quartiles"][1] - m.attention_efficiency) <= 0.005
    assert d["sm_count"] == m.sm_count
    assert round(d["fp8_efficiency"]["quartiles"][1], 2) == m.fp8_efficiency  # 4 shapes only
    assert d["fp8_efficiency"]["shapes"] == 4


def test_h200_rates_are_its_measurement():
    d, m = _derived("gpu_measure_h200.json", "h200"), preset("h200", 1)
    assert round(d["hbm_bandwidth"] / 1e10) * 1e10 == m.hbm_bandwidth
    assert round(d["convert_bandwidth"] / 1e10) * 1e10 == m.convert_bandwidth
    assert round(d["host_bandwidth"] / 1e8) * 1e8 == m.host_bandwidth
    assert d["memory_bytes"] == m.memory_bytes
    assert m.host_latency >= min(d["host_latency_beyond_bytes"].values())
    assert m.host_latency <= max(d["host_latency_beyond_bytes"].values())
