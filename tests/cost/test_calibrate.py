"""``shardplan calibrate``: the profile's math on known timings, the file it writes, and real quick runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardplan.calibrate import (
    QUICK,
    Calibration,
    CollectivePoint,
    MatmulPoint,
    large_shapes,
    to_profile,
)
from shardplan.errors import ShardplanError
from shardplan.machine import (
    PROFILE_FIELDS,
    Machine,
    load_machine_file,
    machine_to_file,
    parse_profile,
    read_profile,
)

ROOT = Path(__file__).resolve().parents[2]
MEASURED = ("peak_flops", "flops_efficiency", "hbm_bandwidth", "bandwidth", "latency")


def _cal(collectives: tuple[CollectivePoint, ...] = (), devices: int = 4, engine: str = "jax") -> Calibration:
    # rates 2MNK/t: 1e9, 4e9, 8e9 (the best, skinny), 2e9 (the largest); 64^3 is small (< 1/16 of the largest)
    mm = (MatmulPoint(64, 64, 64, 2 * 64**3 / 1e9), MatmulPoint(256, 256, 256, 2 * 256**3 / 4e9),
          MatmulPoint(512, 512, 64, 2 * 512 * 512 * 64 / 8e9), MatmulPoint(512, 512, 512, 2 * 512**3 / 2e9))
    return Calibration(engine, devices, "cpu", "fp32", "2026-01-02 03:04 UTC", (("platform", "Linux"),), mm,
                       2**20, 2 * 2**20 / 5e9, collectives, "jax psum under jax.shard_map", 1e-5, None,
                       "" if collectives else "one device: no collective to time")


def test_profile_math_on_known_timings():
    p = 4
    b_big, bw = 2**26, 3e9
    t_big = 2 * (p - 1) / p * b_big / bw
    t_small = 2 * (p - 1) * 7e-6 + 2 * (p - 1) / p * 1024 / bw + 1e-5  # alpha 7 us, dispatch 10 us
    cal = _cal((CollectivePoint(1024, t_small, p), CollectivePoint(b_big, t_big, p)), devices=p)
    assert [pt.n for pt in large_shapes(cal.matmuls)] == [256, 512, 512]  # 64^3 left out
    prof = to_profile(cal)
    v = prof.values
    assert v["peak_flops"] == pytest.approx(8e9)
    assert v["flops_efficiency"] == pytest.approx(4e9 / 8e9)  # median of 4e9, 8e9, 2e9 over the best
    assert v["hbm_bandwidth"] == pytest.approx(5e9)
    assert v["bandwidth"] == pytest.approx(bw)
    assert v["latency"] == pytest.approx(7e-6)
    for k in MEASURED:
        assert prof.sources[k].startswith("measured by shardplan calibrate on 2026-01-02 03:04 UTC: "), k
    assert all("shardplan calibrate on 2026-01-02 03:04 UTC" in prof.sources[k] for k in PROFILE_FIELDS)
    back = parse_profile(prof.to_json())
    assert back.machine(p) == prof.machine(p)
    assert [r["flops_per_second"] for r in back.measurements["matmul"]] == pytest.approx([1e9, 4e9, 8e9, 2e9])
    assert [r["bytes_per_device"] for r in back.measurements["all_reduce"]["sizes"]] == [1024, b_big]


def test_latency_floored_at_zero_and_one_device_says_collectives_skipped():
    fast = _cal((CollectivePoint(1024, 1e-7, 4), CollectivePoint(2**20, 1e-3, 4)))
    assert to_profile(fast).values["latency"] == 0.0  # faster than the dispatch: no negative alpha
    alone = to_profile(_cal(devices=1, engine="torch"))
    assert "not measured (one device: no collective to time)" in alone.sources["bandwidth"]
    assert alone.values["bandwidth"] == alone.values["hbm_bandwidth"] and alone.values["latency"] == 0.0
    assert alone.values["grad_bucket_bytes"] == 25 * 2**20 and alone.values["overlap_grad"] is True
    assert alone.measurements["all_reduce"]["sizes"] == []


def test_machine_file_carries_measurements(tmp_path):
    path = tmp_path / "m.json"
    machine_to_file(Machine(1, name="x"), path, measurements={"matmul": [{"m": 1}]})
    assert read_profile(path).measurements == {"matmul": [{"m": 1}]}
    assert load_machine_file(path, 2) == Machine(2, name="x")
    machine_to_file(Machine(1, name="x"), path)
    assert "measurements" not in json.loads(path.read_text()) and read_profile(path).measurements is None
    doc = json.loads(path.read_text())
    doc["measurements"] = [1, 2]
    with pytest.raises(ShardplanError, match="'measurements' must be a JSON object"):
        parse_profile(json.dumps(doc))


def _run(args: list[str], devices: int | None = 8) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if devices is not None:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return subprocess.run([sys.executable, "-m", "shardplan.cli", *args], env=env, capture_output=True, text=True,
                          timeout=300, cwd=ROOT, check=False)


def _check_file(path: Path, devices: int, engine: str) -> dict:
    prof = read_profile(path)  # loads: every field with a non-empty source, values Machine accepts
    m = load_machine_file(path, devices)
    assert prof.device_kinds == ("cpu",)
    for k in PROFILE_FIELDS:
        assert "shardplan calibrate on 20" in prof.sources[k], k
    for k in ("peak_flops", "flops_efficiency", "hbm_bandwidth"):
        assert prof.sources[k].startswith("measured by shardplan calibrate on "), k
    assert 1e7 < m.peak_flops < 1e14  # a CPU device: between 10 MFLOP/s and 100 TFLOP/s
    assert 0 < m.flops_efficiency <= 1
    assert 1e6 < m.hbm_bandwidth < 1e13
    meas = prof.measurements
    assert meas["engine"] == engine and meas["devices"] == devices
    assert len(meas["matmul"]) == len(QUICK.matmul_shapes)
    assert max(r["flops_per_second"] for r in meas["matmul"]) == m.peak_flops
    assert engine in prof.description and meas["date"] in prof.description
    return meas


@pytest.mark.slow
def test_calibrate_jax_quick_on_8_simulated_devices(tmp_path):
    out = tmp_path / "cpu.json"
    r = _run(["calibrate", "--engine", "jax", "--quick", "--out", str(out)])
    assert r.returncode == 0, r.stderr
    meas = _check_file(out, 8, "jax")
    m = load_machine_file(out, 8)
    sizes = meas["all_reduce"]["sizes"]
    assert [s["bytes_per_device"] for s in sizes] == list(QUICK.collective_bytes)
    assert m.bandwidth == sizes[-1]["bus_bytes_per_second"] and 1e6 < m.bandwidth < 1e13
    assert 0 <= m.latency < 0.1
    assert read_profile(out).sources["bandwidth"].startswith("measured by shardplan calibrate on ")
    assert "jax 0." in read_profile(out).description


@pytest.mark.slow
def test_calibrate_torch_one_process_skips_collectives(tmp_path):
    out = tmp_path / "torch.json"
    r = _run(["calibrate", "--engine", "torch", "--quick", "--out", str(out)], devices=None)
    assert r.returncode == 0, r.stderr
    meas = _check_file(out, 1, "torch")
    assert meas["all_reduce"]["sizes"] == [] and "no process group" in meas["all_reduce"]["note"]
    prof = read_profile(out)
    assert "not measured (one process, no process group" in prof.sources["bandwidth"]
    assert "no process group" in prof.description


@pytest.mark.slow
def test_calibrate_torch_two_gloo_processes(tmp_path):
    out = tmp_path / "gloo.json"
    r = _run(["calibrate", "--engine", "torch", "--quick", "--devices", "2", "--out", str(out)], devices=None)
    assert r.returncode == 0, r.stderr
    meas = _check_file(out, 2, "torch")
    assert meas["all_reduce"]["library"] == "torch.distributed.all_reduce on gloo"
    assert len(meas["all_reduce"]["sizes"]) == len(QUICK.collective_bytes)
    m = load_machine_file(out, 2)
    assert 1e5 < m.bandwidth < 1e13 and 0 <= m.latency < 0.1


def test_bad_input_is_one_line_exit_2(capsys):
    from shardplan.cli import main

    assert main(["calibrate", "--engine", "tensorflow"]) == 2
    assert main(["calibrate", "--engine", "jax", "--devices", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("shardplan calibrate: error:") for line in err)
    assert main(["calibrate", "--engine", "jax", "--quick", "--devices", "4096"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "xla_force_host_platform_device_count=4096" in err


def test_measure_cpu_uses_the_calibration_code():
    sys.path.insert(0, str(ROOT / "shardplan" / "machines"))
    try:
        import measure_cpu
    finally:
        sys.path.pop(0)
    from shardplan import calibrate

    assert measure_cpu.measure_jax is calibrate.measure_jax and measure_cpu.to_profile is calibrate.to_profile
    assert not hasattr(measure_cpu, "best_seconds")
