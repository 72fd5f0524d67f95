"""``shardplan calibrate``: the timing loop on a fake clock, the profile's math on known timings, the file it
writes, and real quick runs (PyTorch in this process, its gloo group spawned; JAX on 8 devices in a
subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardplan.calibrate import (
    QUICK,
    AttentionPoint,
    Calibration,
    CollectivePoint,
    Fp8Point,
    HostPoint,
    MatmulPoint,
    Section,
    amortised_seconds,
    calls_for,
    efficiency,
    host_link,
    layer_shapes,
    to_profile,
    wall_loop,
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
DATE = "2026-01-02 03:04 UTC"


class FakeClock:
    """A clock that each call of the timed program moves by ``per_call`` and each synchronisation by ``sync``."""

    def __init__(self, per_call: float, sync: float) -> None:
        self.now, self.per_call, self.sync, self.calls, self.finished = 0.0, per_call, sync, 0, []

    def call(self) -> int:
        self.calls += 1
        self.now += self.per_call
        return self.calls

    def finish(self, out: object) -> None:
        self.finished.append(out)
        self.now += self.sync


def test_amortised_seconds_counts_its_calls_and_spreads_the_sync():
    clock = FakeClock(per_call=1e-3, sync=5e-4)
    t = amortised_seconds(clock.call, wall_loop(clock.finish, clock=lambda: clock.now), repeats=3,
                          min_seconds=0.02, max_calls=1000)
    # warm-up 1; probe 1 call: 1.5 ms -> n1 = ceil(20 / 1.5) = 14; 14 calls: 14.5 ms -> n = ceil(20 * 14 / 14.5) = 20
    assert t.calls == 20 and t.repeats == 3
    assert clock.calls == 1 + 1 + 14 + 3 * 20
    assert t.seconds == pytest.approx(1e-3 + 5e-4 / 20)  # the one sync shared by the 20 calls
    assert clock.finished[-1] == clock.calls  # the loop waits on its last result
    capped = FakeClock(per_call=1e-6, sync=0.0)
    t = amortised_seconds(capped.call, wall_loop(capped.finish, clock=lambda: capped.now), 2, 0.02, 50)
    assert t.calls == 50 and capped.calls == 1 + 1 + 50 + 2 * 50 and t.seconds == pytest.approx(1e-6)


def test_amortised_seconds_agrees_on_counts_and_keeps_all_results():
    clock = FakeClock(per_call=2**-10, sync=0.0)  # binary fractions: the counts are exact
    asked = []

    def agree(n: int) -> int:  # e.g. the maximum over the processes of a collective
        asked.append(n)
        return n + 1
    t = amortised_seconds(clock.call, wall_loop(clock.finish, keep_all=True, clock=lambda: clock.now), 1,
                          10 * 2**-10, 100, agree)
    # probe: 10 calls fill the loop, agreed 11; 11 calls: 10 again, agreed 11
    assert asked == [10, 10] and t.calls == 11 and clock.calls == 1 + 1 + 11 + 11
    assert clock.finished[-1] == list(range(clock.calls - 10, clock.calls + 1))  # every result of the last loop
    slow = FakeClock(per_call=0.05, sync=0.0)  # one call outlasts the loop: one call per loop, no refining loop
    t = amortised_seconds(slow.call, wall_loop(slow.finish, clock=lambda: slow.now), 2, 0.02, 100)
    assert t.calls == 1 and slow.calls == 1 + 1 + 2 and t.seconds == pytest.approx(0.05)


def test_calls_for():
    assert calls_for(1e-3, 1, 0.02, 1000) == 20
    assert calls_for(0.5, 10, 0.02, 1000) == 1
    assert calls_for(1e-9, 1, 0.02, 1000) == 1000
    assert calls_for(0.0, 1, 0.02, 7) == 7


def test_layer_shapes_are_the_three_passes_of_four_linear_maps():
    shapes = layer_shapes(16, (2,))
    assert [(m, n, k) for _, m, n, k in shapes] == [
        (16, 6, 2), (16, 2, 2), (16, 8, 2), (16, 2, 8),  # forward (tokens, out, in): qkv, out, up, down
        (16, 2, 6),  # the input gradient of qkv; the other input gradients repeat forward shapes
        (6, 2, 16), (2, 2, 16), (8, 2, 16), (2, 8, 16)]  # weight gradients (out, in, tokens)
    assert shapes[0][0] == "d=2 qkv forward" and shapes[4][0] == "d=2 qkv input grad"
    assert shapes[-1][0] == "d=2 down weight grad"
    full = [s[1:] for s in layer_shapes(8192, (2048, 4096, 8192))]
    assert len(full) == len(set(full)) == 24  # 9 per width, less 3 where 4d = tokens repeats a shape


def _cal(collectives: tuple[CollectivePoint, ...] = (), devices: int = 4, engine: str = "jax", **kw) -> Calibration:
    # layer products at 1e9, 4e9, 2e9 FLOP/s; the square 512 x 512 x 64 is the best, 8e9
    mm = (MatmulPoint(64, 64, 64, 2 * 64**3 / 1e9, "d=64 out forward"),
          MatmulPoint(256, 256, 256, 2 * 256**3 / 4e9, "d=256 out forward"),
          MatmulPoint(512, 512, 64, 2 * 512 * 512 * 64 / 8e9),
          MatmulPoint(512, 512, 512, 2 * 512**3 / 2e9, "d=512 out forward"))
    return Calibration(engine, devices, "cpu", "fp32", DATE, (("platform", "Linux"),), mm,
                       2**20, 2 * 2**20 / 5e9, collectives, "jax psum under jax.shard_map", 1e-5, None,
                       "" if collectives else "one device: no collective to time", **kw)


def test_profile_math_on_known_timings():
    p = 4
    b_big, bw = 2**26, 3e9
    t_big = 2 * (p - 1) / p * b_big / bw
    t_small = 2 * (p - 1) * 7e-6 + 2 * (p - 1) / p * 1024 / bw + 1e-5  # alpha 7 us, dispatch 10 us
    cal = _cal((CollectivePoint(1024, t_small, p), CollectivePoint(b_big, t_big, p)), devices=p)
    prof = to_profile(cal)
    v = prof.values
    assert v["peak_flops"] == pytest.approx(8e9)
    assert v["flops_efficiency"] == pytest.approx(2e9 / 8e9)  # median of the layers' 1e9, 4e9, 2e9 over the best
    assert v["hbm_bandwidth"] == pytest.approx(5e9)
    assert v["bandwidth"] == pytest.approx(bw)
    assert v["latency"] == pytest.approx(7e-6)
    for k in MEASURED:
        assert prof.sources[k].startswith(f"measured by shardplan calibrate on {DATE}: "), k
    assert "median over the 3 transformer-layer products" in prof.sources["flops_efficiency"]
    assert all(f"shardplan calibrate on {DATE}" in prof.sources[k] for k in PROFILE_FIELDS)
    for k in ("fp8_flops", "host_bandwidth", "host_latency", "host_memory_bytes", "sm_count", "gemm_tiles"):
        assert "not measured (" in prof.sources[k], k
        assert v[k] in (None, 0.0), k
    back = parse_profile(prof.to_json())
    assert back.machine(p) == prof.machine(p)
    assert [r["flops_per_second"] for r in back.measurements["matmul"]] == pytest.approx([1e9, 4e9, 8e9, 2e9])
    assert [r["layer"] for r in back.measurements["matmul"]][2] == ""
    assert [r["bytes_per_device"] for r in back.measurements["all_reduce"]["sizes"]] == [1024, b_big]


def test_efficiency_divides_by_the_tile_and_wave_utilisation():
    # 8192 x 8192 outputs on 132 SMs: 2048 tiles of 256 x 128 in 16 waves, u = 2048 / 2112 (128 x 128: the same)
    # 1024 x 1024: 32 tiles of 256 x 128 in one wave, u = 32 / 132; 64 of 128 x 128, u = 64 / 132 (the best)
    mm = (MatmulPoint(8192, 8192, 8192, 2 * 8192**3 / 600e12, "d=8192 out forward"),
          MatmulPoint(1024, 1024, 8192, 2 * 1024 * 1024 * 8192 / 200e12, "d=1024 out forward"),
          MatmulPoint(8192, 8192, 4096, 2 * 8192**2 * 4096 / 800e12))
    cal = Calibration("torch", 1, "gpu", "bf16", DATE, (), mm, 2**20, 1e-6, (), "", 0.0, 8e10, "none",
                      sm_count=132, sm_source="torch.cuda.get_device_properties(0).multi_processor_count of gpu")
    eff, over = efficiency(cal)
    assert len(over) == 2
    assert eff == pytest.approx((600 / 800 * 2112 / 2048 + 200 / 800 * 132 / 64) / 2)  # the median of two
    prof = to_profile(cal)
    m = prof.machine(1)
    assert m.sm_count == 132 and m.gemm_tiles == ((256, 128), (128, 256), (128, 128))
    assert prof.sources["sm_count"].startswith(f"measured by shardplan calibrate on {DATE}: torch.cuda.get_device_")
    assert "not measured: NVIDIA" in prof.sources["gemm_tiles"]
    assert "tile and wave utilisation" in prof.sources["flops_efficiency"]
    assert [r["utilisation"] for r in prof.measurements["matmul"]] == pytest.approx([2048 / 2112, 64 / 132,
                                                                                     2048 / 2112])


def test_host_copies_fp8_and_attention_become_constants_and_rows():
    up, down, alpha = 50e9, 40e9, 1e-5
    rows = (HostPoint(65536, 65536 / up + alpha, 65536 / down + alpha / 2), HostPoint(2**30, 2**30 / up, 2**30 / down))
    assert host_link(rows) == (pytest.approx(down), pytest.approx(alpha))
    fp8 = (Fp8Point(64, 64, 64, 2 * 64**3 / 1e15), Fp8Point(128, 64, 64, 2 * 128 * 64 * 64 / 1.3e15))
    flops = 2 * 2 * 4 * 128**2 * 128  # 2 b h s^2 d
    att = (AttentionPoint(2, 4, 128, 128, flops / 4e9, 3.5 * flops / 2e9, "sdpa"),)
    cal = _cal(devices=1, engine="torch", host_copies=Section(rows), fp8=Section(fp8), attention=Section(att),
               host_memory_bytes=2e12)
    prof = to_profile(cal)
    v = prof.values
    assert v["host_bandwidth"] == pytest.approx(down) and v["host_latency"] == pytest.approx(alpha)
    assert v["host_memory_bytes"] == 2e12 and v["fp8_flops"] == pytest.approx(1.3e15)
    for k in ("host_bandwidth", "host_latency", "fp8_flops"):
        assert prof.sources[k].startswith(f"measured by shardplan calibrate on {DATE}: "), k
    assert "sysconf" in prof.sources["host_memory_bytes"]
    meas = prof.measurements
    assert meas["attention"]["rows"][0]["forward_flops_per_second"] == pytest.approx(4e9)
    assert meas["attention"]["rows"][0]["forward_backward_flops_per_second"] == pytest.approx(2e9)
    # the achievable rate is the best 8e9 times the median layer efficiency 2e9 / 8e9
    assert meas["attention"]["rows"][0]["forward_over_achievable"] == pytest.approx(2.0)
    assert "attention_efficiency is the median" in meas["attention"]["model"]
    # the fused core's FLOPs: (4 + 5/128 + 10 + 4/128) per point, 2 * 4 * 128 * 129 / 2 * 128 points; the best
    # product rate 8e9
    model = (14 + 9 / 128) * 2 * 4 * 128 * 129 / 2 * 128
    assert v["attention_efficiency"] == pytest.approx(model / (3.5 * flops / 2e9) / 8e9)
    assert prof.sources["attention_efficiency"].startswith(f"measured by shardplan calibrate on {DATE}: ")
    assert prof.machine(1).attention_flops == pytest.approx(8e9 * v["attention_efficiency"])
    assert [r["host_to_device_bytes_per_second"] for r in meas["host_copies"]["rows"]][1] == pytest.approx(up)
    assert "error" not in meas["fp8"] and "not_measured" not in meas["fp8"]
    assert parse_profile(prof.to_json()).machine(1) == prof.machine(1)


def test_a_failed_section_keeps_its_error_and_the_rest():
    cal = _cal(devices=1, engine="torch", fp8=Section(error="RuntimeError('no kernel')"),
               host_copies=Section(skipped="no CUDA device: CPU only"))
    prof = to_profile(cal)
    assert prof.values["fp8_flops"] is None
    assert "not measured (it failed: RuntimeError('no kernel'))" in prof.sources["fp8_flops"]
    assert prof.measurements["fp8"]["error"] == "RuntimeError('no kernel')"
    assert prof.measurements["host_copies"]["not_measured"] == "no CUDA device: CPU only"
    assert prof.values["peak_flops"] == pytest.approx(8e9)


def test_guard_keeps_the_error_and_cleans_up():
    from shardplan.calibrate import _guard

    cleaned = []
    failed = _guard(lambda: (1 / 0,), lambda: cleaned.append(1))
    assert failed == Section(error="ZeroDivisionError('division by zero')") and cleaned == [1]
    assert failed.why_not == "it failed: ZeroDivisionError('division by zero')"
    assert _guard(lambda: (3, 4)) == Section((3, 4)) and Section((3, 4)).why_not == ""
    assert _guard(lambda: ()).why_not == "no shapes or sizes asked for it"


def test_jax_attention_falls_back_to_xla_and_says_why():
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from shardplan.calibrate import Sizes, _guard, _jax_attention

    sizes = Sizes((), 0, (), 1, attention_shapes=((1, 2, 8, 4),))
    rng = np.random.default_rng(0)
    calls = []

    def normal(shape):
        return jax.numpy.asarray(rng.standard_normal((1, *shape), np.float32))

    def time_it(f, *xs):
        calls.append(len(xs))
        return amortised_seconds(lambda: f(*xs), wall_loop(jax.block_until_ready), 1, 1e-4, 2)
    mesh = Mesh(np.array(jax.devices()[:1]), ("d",))
    (row,) = _jax_attention(sizes, mesh, normal, time_it, ("cudnn", "xla"))  # no cuDNN on a CPU
    assert (row.batch, row.heads, row.seq, row.head_dim) == (1, 2, 8, 4) and calls[-2:] == [3, 4]  # fwd, fwd+bwd
    assert row.implementation.startswith("jax.nn.dot_product_attention xla (cudnn refused: ")
    assert row.forward_seconds > 0 and row.forward_backward_seconds > 0
    failed = _guard(lambda: _jax_attention(sizes, mesh, normal, time_it, ("cudnn",)))
    assert failed.rows == () and failed.error.startswith("RuntimeError(")


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


def _check_file(path: Path, devices: int, engine: str) -> dict:
    prof = read_profile(path)  # loads: every field with a non-empty source, values Machine accepts
    m = load_machine_file(path, devices)
    assert prof.device_kinds == ("cpu",)
    for k in PROFILE_FIELDS:
        assert "shardplan calibrate on 20" in prof.sources[k], k
    for k in ("peak_flops", "flops_efficiency", "hbm_bandwidth"):
        assert prof.sources[k].startswith("measured by shardplan calibrate on "), k
    for k in ("fp8_flops", "host_bandwidth", "host_latency", "sm_count", "gemm_tiles"):
        assert "not measured (" in prof.sources[k], k
    assert m.fp8_flops is None and m.host_bandwidth is None and m.sm_count is None
    assert 0 < m.peak_flops < 1e14  # a CPU device (under load its rate falls a thousandfold: no lower bound)
    assert 0 < m.flops_efficiency <= 1
    assert 0 < m.hbm_bandwidth < 1e13
    meas = prof.measurements
    assert meas["engine"] == engine and meas["devices"] == devices
    assert len(meas["matmul"]) == len(QUICK.layer_shapes) + len(QUICK.matmul_shapes)
    assert [r["layer"] for r in meas["matmul"]][:len(QUICK.layer_shapes)] == [s[0] for s in QUICK.layer_shapes]
    assert all(1 <= r["calls_per_loop"] <= QUICK.max_calls for r in meas["matmul"])
    assert max(r["flops_per_second"] for r in meas["matmul"]) == m.peak_flops
    assert [(r["batch"], r["heads"], r["seq"], r["head_dim"]) for r in meas["attention"]["rows"]] == list(
        QUICK.attention_shapes)
    assert all(r["forward_flops_per_second"] > 0 for r in meas["attention"]["rows"])
    assert engine in prof.description and meas["date"] in prof.description
    return meas


def test_calibrate_torch_quick_writes_a_file_cuda_sections_not_measured(tmp_path, capsys):
    from shardplan.cli import main

    out = tmp_path / "torch.json"
    assert main(["calibrate", "--engine", "torch", "--quick", "--out", str(out)]) == 0
    meas = _check_file(out, 1, "torch")
    assert meas["all_reduce"]["sizes"] == [] and "no process group" in meas["all_reduce"]["note"]
    for section in ("host_copies", "fp8"):
        assert meas[section]["rows"] == [] and meas[section]["not_measured"] == "no CUDA device: CPU only"
        assert "error" not in meas[section]
    assert meas["timing"].endswith("timed by time.perf_counter")
    prof = read_profile(out)
    assert "not measured (one process, no process group" in prof.sources["bandwidth"]
    assert "not measured (no CUDA device: CPU only)" in prof.sources["host_bandwidth"]
    assert "no process group" in prof.description
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("calibrated 1 x cpu through torch: ") and err[-1] == f"machine file: {out}"
    assert "  host copies: not measured (no CUDA device: CPU only)" in err
    assert "  fp8: not measured (no CUDA device: CPU only)" in err
    assert any(line.startswith("  attention (causal, fp32): forward ") for line in err)


def _run(args: list[str], devices: int = 8) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    return subprocess.run([sys.executable, "-m", "shardplan.cli", *args], env=env, capture_output=True, text=True,
                          timeout=300, cwd=ROOT, check=False)


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
    assert meas["attention"]["rows"][0]["implementation"] == "jax.nn.dot_product_attention xla"
    assert meas["host_copies"]["not_measured"] == meas["fp8"]["not_measured"] == (
        "timed through PyTorch only, --engine torch")
    assert meas["sm_count"] == {"value": None, "source": "JAX reports no multiprocessor count for cpu devices"}
    assert meas["timing"].endswith("blocking on every result")


@pytest.mark.slow
def test_calibrate_torch_two_gloo_processes(tmp_path):
    from shardplan.cli import main

    out = tmp_path / "gloo.json"
    assert main(["calibrate", "--engine", "torch", "--quick", "--devices", "2", "--out", str(out)]) == 0
    meas = _check_file(out, 2, "torch")
    assert meas["all_reduce"]["library"] == "torch.distributed.all_reduce on gloo"
    assert len(meas["all_reduce"]["sizes"]) == len(QUICK.collective_bytes)
    m = load_machine_file(out, 2)
    assert 1e5 < m.bandwidth < 1e13 and 0 <= m.latency < 0.1
    # a product alone and beside back-to-back all-reduces: the share the collective takes, measured
    c = meas["contention"]
    assert c["product_seconds_alone"] > 0 and c["product_seconds_beside_all_reduce"] > 0
    assert c["all_reduce_bytes"] == max(QUICK.collective_bytes)
    assert 0.0 <= m.comm_contention <= 0.95 and m.comm_contention == round(c["share"], 3)
    assert "1 - alone / beside" in read_profile(out).sources["comm_contention"]


def test_contention_share_is_one_minus_alone_over_beside_clipped():
    from shardplan.calibrate import Contention

    assert Contention(8, 8, 8, 1.0, 1.25, 1024, True).share == pytest.approx(0.2)
    assert Contention(8, 8, 8, 1.0, 0.9, 1024, True).share == 0.0  # faster beside: noise, no contention
    assert Contention(8, 8, 8, 1.0, 100.0, 1024, False).share == 0.95  # capped below 1 (Machine refuses 1)


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
    assert not hasattr(measure_cpu, "amortised_seconds")
