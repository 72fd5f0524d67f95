"""The machine's FP8 and host constants: validated, and the shipped profiles' values."""

from __future__ import annotations

import pytest

from shardplan.errors import ShardplanError
from shardplan.machine import Machine, preset


def test_fp8_and_host_fields_are_validated():
    for bad in (dict(fp8_flops=0.0), dict(host_bandwidth=-1.0), dict(host_memory_bytes=0), dict(cpu_adam_rate=-5),
                dict(host_latency=-1e-6), dict(host_bandwidth="fast")):
        with pytest.raises(ShardplanError, match="machine: "):
            Machine(2, **bad)
    m = Machine(2, fp8_flops=2e12, host_bandwidth=1e9, host_memory_bytes=1e12, cpu_adam_rate=1e9)
    assert m.fp8_flops == 2e12 and m.host_latency == 0.0


def test_devices_share_a_node_host():
    assert preset("h100", 16).node_devices == 8
    assert Machine(4).node_devices == 4  # one level: one node


def test_profiles_fp8_and_host():
    h, a = preset("h100", 8), preset("a100", 8)
    assert h.fp8_flops == 1979e12 and h.peak_flops == 989e12  # dense FP8 and BF16 (datasheet)
    assert a.fp8_flops is None  # no FP8 on the A100
    assert h.host_bandwidth == 54.7e9 and a.host_bandwidth == 0.8 * 32e9  # measured on PCIe Gen5; Gen4 x16 at 80 %
    assert h.host_memory_bytes == 2e12 and h.cpu_adam_rate == 1.0e10
    assert preset("paper", 4).host_bandwidth is None and preset("paper", 4).fp8_flops is None
