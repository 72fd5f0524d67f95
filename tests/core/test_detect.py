"""Machine profiles as files (a source per constant), the presets read from them, and the machine detected
from the devices (JAX on 8 simulated CPU devices, see conftest.py; PyTorch meshes as stand-ins)."""

from __future__ import annotations

import json
import os
import re
from types import SimpleNamespace

import pytest

import jax
import jax.numpy as jnp

from shardplan.errors import ShardplanError  # noqa: E402
from shardplan.machine import (PRESETS, PROFILE_FIELDS, UNRECORDED, Machine, detect_machine,  # noqa: E402
                               load_machine_file, load_profile, machine_to_file, normalise_kind, parse_profile,
                               preset, profile_names, read_profile)
from conftest import require_8_devices  # noqa: E402

pytestmark = pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out

DEVICES = require_8_devices()
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
MACHINES = os.path.join(ROOT, "shardplan", "machines")
GiB = 1024**3


# -- the presets are the constants they were before they moved to files -------------------------------
def _old_presets(p: int) -> dict[str, Machine]:
    """The presets exactly as shardplan/machine.py built them in code before the profile files, plus the tile and
    wave constants added to the GPU profiles since (multiprocessors, output tile), and the H100's constants
    measured on an H100 since (efficiency, HBM, converting and host rates, the unaligned-product rule, the FP8
    products' efficiency), the share of a device an NCCL collective holds beside a product (channels / SMs), and
    the H200 profile, measured on an H200; the paper's machine keeps its own
    redistribution rule (what each device lacks) and its reductions (one all-reduce among the product of the
    groups) where every other profile charges XLA's steps and its one all-reduce per split dim."""
    bucket = 25 * 2**20
    tiles = dict(gemm_tiles=((256, 128), (128, 256), (128, 128)))
    return {
        "paper": Machine(p, 10e12, 16e9, name="paper", stepwise_redistribution=False, reduce_per_dim=False),
        "1080ti": Machine(p, 11.3e12, 10e9, node_size=8, inter_bandwidth=7e9, memory_bytes=11 * GiB, name="1080ti"),
        "2080ti": Machine(p, 13.4e12, 6e9, node_size=8, inter_bandwidth=2.5e9, memory_bytes=11 * GiB, name="2080ti"),
        "a100": Machine(p, 312e12, 232.5e9, latency=5e-6, dtype_bytes=2, memory_bytes=80 * GiB, node_size=8,
                        inter_bandwidth=24e9, inter_latency=10e-6, name="a100", hbm_bandwidth=1.80e12,
                        flops_efficiency=0.7, grad_bucket_bytes=bucket, overlap_grad=True,
                        host_bandwidth=25.6e9, host_latency=10e-6, host_memory_bytes=2e12, cpu_adam_rate=6.8e9,
                        sm_count=108, comm_contention=0.222, **tiles),
        "h100": Machine(p, 989e12, 370e9, latency=3e-6, dtype_bytes=2, memory_bytes=80 * GiB, node_size=8,
                        inter_bandwidth=47e9, inter_latency=8e-6, name="h100", hbm_bandwidth=2.83e12,
                        flops_efficiency=0.69, grad_bucket_bytes=bucket, overlap_grad=True, fp8_flops=1979e12,
                        fp8_efficiency=0.65, host_bandwidth=54.7e9, host_latency=10e-6, host_memory_bytes=2e12,
                        cpu_adam_rate=1.0e10, sm_count=132, gemm_align=8, gemm_unaligned_efficiency=0.2,
                        attention_efficiency=0.40, convert_bandwidth=1.91e12, comm_contention=0.242, **tiles),
        "h200": Machine(p, 989e12, 370e9, latency=3e-6, dtype_bytes=2, memory_bytes=150109880320, node_size=8,
                        inter_bandwidth=47e9, inter_latency=8e-6, name="h200", hbm_bandwidth=3.88e12,
                        flops_efficiency=0.69, grad_bucket_bytes=bucket, overlap_grad=True, fp8_flops=1979e12,
                        fp8_efficiency=0.68, host_bandwidth=55.2e9, host_latency=10e-6, host_memory_bytes=2e12,
                        cpu_adam_rate=1.0e10, sm_count=132, gemm_align=8, gemm_unaligned_efficiency=0.2,
                        attention_efficiency=0.405, convert_bandwidth=2.05e12, comm_contention=0.242, **tiles),
    }


@pytest.mark.parametrize("p", [1, 8, 64])
def test_presets_equal_the_old_constants(p):
    old = _old_presets(p)
    assert sorted(PRESETS) == sorted(old)
    for name, machine in old.items():
        got = preset(name, p)
        assert got == machine, name
        assert all(type(getattr(got, k)) is type(getattr(machine, k)) for k in PROFILE_FIELDS), name


def test_every_shipped_profile_states_every_field_with_a_source():
    names = profile_names()
    assert set(PRESETS.values()) | {"cpu.json", "a100-sxm-40gb.json"} <= set(names)
    assert sorted(names) == sorted(f for f in os.listdir(MACHINES) if f.endswith(".json"))
    for name in names:
        with open(os.path.join(MACHINES, name)) as f:
            doc = json.load(f)
        assert set(doc) == {"name", "description", "device_kinds", *PROFILE_FIELDS}, name
        assert all(doc[k]["source"].strip() and doc[k]["source"] != UNRECORDED for k in PROFILE_FIELDS), name
        assert load_profile(name) == read_profile(os.path.join(MACHINES, name))


def test_no_device_kind_is_claimed_twice():
    seen: dict[str, str] = {}
    for name in profile_names():
        for kind in load_profile(name).device_kinds:
            key = normalise_kind(kind)
            assert seen.setdefault(key, name) == name, f"{kind!r} in {name} and {seen[key]}"


def test_profiles_ship_with_the_package():
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        text = f.read()
    section = text.split("[tool.setuptools.package-data]", 1)[1].split("\n[", 1)[0]
    line = re.search(r"^shardplan = \[(.*)\]$", section, re.M)
    assert line is not None, "pyproject.toml: no package data for shardplan"
    assert '"machines/*.json"' in line.group(1) and '"machines/measure_cpu.py"' in line.group(1)


def test_cpu_profile_values_are_the_measured_numbers_its_sources_quote():
    """The CPU profile's measured constants appear, as measured, in their sources (edit both or neither)."""
    cpu = load_profile("cpu.json")
    for k in ("peak_flops", "hbm_bandwidth", "bandwidth"):
        quoted = re.sub(r"e\+?0*", "e", f"{cpu.values[k]:.3g}")
        assert "micro-benchmark" in cpu.sources[k] and f"= {quoted} " in cpu.sources[k], k
    assert "micro-benchmark" in cpu.sources["latency"] and "6.75 us per step" in cpu.sources["latency"]
    assert cpu.values["latency"] == 6.75e-6
    assert cpu.values["memory_bytes"] is None and cpu.values["node_size"] is None


# -- detection from device kinds ------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["NVIDIA H100 80GB HBM3", "nvidia h100 80gb hbm3", "H100 80GB HBM3", "H100 SXM",
                                  "H100-SXM5-80GB", "  NVIDIA  H100   SXM5 "])
def test_h100_kinds_detect_the_h100_profile(kind):
    m = detect_machine(kind, 16, processes=2)
    assert m.name == f"h100 (detected: {kind})"
    assert m == Machine(**{**_old_presets(16)["h100"].__dict__, "name": m.name})


@pytest.mark.parametrize("kind", ["NVIDIA H200", "H200", "nvidia h200"])
def test_h200_kinds_detect_the_h200_profile(kind):
    m = detect_machine(kind, 16)
    assert m.name == f"h200 (detected: {kind})"
    assert m == Machine(**{**_old_presets(16)["h200"].__dict__, "name": m.name})


@pytest.mark.parametrize("kind, name, memory", [("NVIDIA A100-SXM4-80GB", "a100", 80 * GiB),
                                               ("A100 SXM4 80GB", "a100", 80 * GiB),
                                               ("NVIDIA A100-SXM4-40GB", "a100-40gb", 40 * GiB),
                                               ("a100-sxm4-40gb", "a100-40gb", 40 * GiB)])
def test_a100_variants(kind, name, memory):
    m = detect_machine(kind, 8)
    assert m.name == f"{name} (detected: {kind})"
    assert m.memory_bytes == memory and m.peak_flops == 312e12
    assert m.hbm_bandwidth == (1.80e12 if memory == 80 * GiB else 1.37e12)


def test_gtx_kinds_with_and_without_vendor_words():
    assert detect_machine("NVIDIA GeForce GTX 1080 Ti", 8).peak_flops == 11.3e12
    assert detect_machine("GeForce GTX 1080 Ti", 8).name == "1080ti (detected: GeForce GTX 1080 Ti)"
    assert detect_machine("NVIDIA GeForce RTX 2080 Ti", 8).peak_flops == 13.4e12


@pytest.mark.parametrize("kind", ["NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H100", "H100", "NVIDIA H200 NVL",
                                  "NVIDIA A100-PCIE-40GB", "NVIDIA A100 80GB PCIe", "A100", "TPU v4", "paper",
                                  "NVIDIA A100-SXM4-80GB MIG 3g.40gb"])
def test_device_without_a_profile_is_one_line_naming_what_to_pass(kind):
    with pytest.raises(ShardplanError) as e:
        detect_machine(kind, 8)
    msg = str(e.value)
    assert "\n" not in msg and repr(kind) in msg
    assert "machine=preset('h100', 8)" in msg and "machine=Machine.from_file(" in msg


@pytest.mark.parametrize("bad", ["", "  -- ", None, 7])
def test_empty_device_kind_refused(bad):
    with pytest.raises(ShardplanError, match="device_kind must name a device"):
        detect_machine(bad, 8)


@pytest.mark.parametrize("p, processes, node_size, levels", [
    (16, 2, None, (8, 2)),     # one process per host (JAX multi-host): 8 devices a node
    (16, 4, None, (4, 4)),     # one process per 4-device host
    (16, 16, None, (8, 2)),    # one process per device (torchrun): the profile's board of 8
    (4, 1, None, (4,)),        # one process, fewer devices than a board: one level
    (8, 1, None, (8,)),
    (16, 1, None, (8, 2)),     # one process with 16 devices: still boards of 8
    (16, 16, 4, (4, 4)),       # node_size given wins
    (16, 3, None, (8, 2)),     # devices not even across processes: the profile's node size
])
def test_nodes_inferred_from_processes(p, processes, node_size, levels):
    m = detect_machine("NVIDIA H100 80GB HBM3", p, processes=processes, node_size=node_size)
    assert m.levels == levels
    assert m.inter_bandwidth == 47e9


def test_nodes_that_do_not_fit_are_refused_naming_node_size():
    with pytest.raises(ShardplanError, match=r"12 devices .* nodes of 8.*pass node_size="):
        detect_machine("NVIDIA H100 80GB HBM3", 12)
    assert detect_machine("NVIDIA H100 80GB HBM3", 12, node_size=4).levels == (4, 3)


def test_cpu_profile_is_one_level_whatever_the_processes():
    cpu = detect_machine("cpu", 16, processes=2)
    assert cpu.name == "cpu (detected: cpu)" and cpu.levels == (16,)
    with pytest.raises(ShardplanError, match="no link across nodes"):
        detect_machine("cpu", 16, node_size=8)


# -- the JAX path ---------------------------------------------------------------------------------
def test_jax_on_cpu_plans_for_the_detected_cpu_profile():
    import shardplan.jax as sj

    params = {"w1": jnp.ones((32, 64)) * 0.01, "w2": jnp.ones((64, 8)) * 0.01}
    batch = jnp.ones((16, 32))

    def loss_fn(p, x):
        return jnp.mean(jnp.tanh(x @ p["w1"]) @ p["w2"])

    pl = sj.planned(loss_fn, params, batch, devices=DEVICES)
    assert DEVICES[0].device_kind == "cpu"
    assert pl.plan.machine.name == "cpu (detected: cpu)"
    assert pl.plan.machine == load_profile("cpu.json").machine(8, name="cpu (detected: cpu)")
    loss, _ = pl.step(params, batch)
    assert float(loss) == pytest.approx(float(loss_fn(params, batch)), rel=1e-5)


def test_jax_devices_and_machine_reads_kind_and_processes():
    from shardplan.jax.shardings import devices_and_machine

    def dev(kind, proc, platform="gpu"):
        return SimpleNamespace(device_kind=kind, platform=platform, process_index=proc)

    devs = [dev("NVIDIA H100 80GB HBM3", i // 4) for i in range(16)]
    _, m = devices_and_machine(devs, None)
    assert m.name == "h100 (detected: NVIDIA H100 80GB HBM3)" and m.levels == (4, 4)
    _, m = devices_and_machine([dev("", 0, "cpu")] * 4, None)  # no kind: the platform
    assert m.name == "cpu (detected: cpu)" and m.num_devices == 4
    with pytest.raises(ShardplanError, match="devices of different kinds"):
        devices_and_machine([dev("NVIDIA H100 80GB HBM3", 0), dev("NVIDIA A100-SXM4-80GB", 0)], None)
    with pytest.raises(ShardplanError, match="no machine profile for device kind 'TPU v5 lite'"):
        devices_and_machine([dev("TPU v5 lite", 0, "tpu")] * 8, None)
    given = preset("paper", 2)
    assert devices_and_machine([dev("TPU v5 lite", 0, "tpu")] * 2, given)[1] is given
    assert devices_and_machine(None, None)[1].name == "cpu (detected: cpu)"


# -- files: round trip and refusals ---------------------------------------------------------------
def test_file_round_trip(tmp_path):
    h100 = preset("h100", 16)
    path = tmp_path / "mine.json"
    machine_to_file(h100, path, sources={"peak_flops": "a spec sheet"}, device_kinds=["My GPU"], description="d")
    assert load_machine_file(path, 16) == h100
    assert Machine.from_file(path, 64) == preset("h100", 64)
    prof = read_profile(path)
    assert prof.sources["peak_flops"] == "a spec sheet" and prof.sources["latency"] == UNRECORDED
    assert prof.device_kinds == ("My GPU",) and prof.description == "d"
    for name in profile_names():  # every shipped file survives writing and reading unchanged
        shipped = load_profile(name)
        assert parse_profile(shipped.to_json()) == shipped
    with pytest.raises(ShardplanError, match="unknown field 'peak' in sources"):
        machine_to_file(h100, path, sources={"peak": "x"})
    odd = Machine(3, 1.234567890123e13, 1 / 3, latency=1e-7, name="odd")
    machine_to_file(odd, path)
    assert load_machine_file(path, 3) == odd


def _h100_doc() -> dict:
    with open(os.path.join(MACHINES, "h100-sxm.json")) as f:
        return json.load(f)


def _with(**changes) -> dict:
    doc = _h100_doc()
    for k, v in changes.items():
        if v is _DROP:
            del doc[k]
        else:
            doc[k] = v
    return doc


_DROP = object()
BAD_FILES = [
    ("missing value", _with(peak_flops={"source": "a datasheet"}), r"field 'peak_flops' must be \{\"value\""),
    ("missing field", _with(latency=_DROP), "missing field 'latency'"),
    ("unknown field", _with(peak_tflops={"value": 1, "source": "x"}), "unknown field 'peak_tflops'"),
    ("non-numeric", _with(peak_flops={"value": "989e12", "source": "x"}), "peak_flops must be a number, got '989e12'"),
    ("bool as number", _with(bandwidth={"value": True, "source": "x"}), "bandwidth must be a number"),
    ("empty source", _with(bandwidth={"value": 1e9, "source": " "}), "field 'bandwidth' needs a source"),
    ("no source", _with(bandwidth={"value": 1e9}), r"field 'bandwidth' must be \{\"value\""),
    ("bare number", _with(bandwidth=1e9), r"field 'bandwidth' must be \{\"value\""),
    ("negative", _with(bandwidth={"value": -1, "source": "x"}), "bandwidth must be positive"),
    ("infinite", _with(bandwidth={"value": float("inf"), "source": "x"}), "bandwidth must be a finite number"),
    ("nodes without a network", _with(inter_bandwidth={"value": None, "source": "x"}), "needs a positive inter_bandwidth"),
    ("no name", _with(name=_DROP), "'name' must be a non-empty string"),
    ("kinds not a list", _with(device_kinds="H100"), "'device_kinds' must be a list"),
    ("not an object", [1, 2], "must be a JSON object, got list"),
]


@pytest.mark.parametrize("what, doc, message", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_bad_files_refused_in_one_line(tmp_path, what, doc, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ShardplanError) as e:
        load_machine_file(path, 8)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"machine file {path}: ")
    assert re.search(message, msg), msg


@pytest.mark.parametrize("text, message", [
    ('{"name": "x",', "not JSON"),
    ('{"name": "x", "name": "y"}', "key 'name' appears twice"),
    ("\xff\xfe", "not JSON"),
])
def test_unreadable_files_refused_in_one_line(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ShardplanError, match=message) as e:
        Machine.from_file(path, 8)
    assert "\n" not in str(e.value)
    with pytest.raises(ShardplanError, match="cannot be read"):
        load_machine_file(tmp_path / "absent.json", 8)


def test_unknown_preset_and_profile_names():
    with pytest.raises(ShardplanError, match="unknown machine preset 'b200'"):
        preset("b200", 8)
    with pytest.raises(ShardplanError, match="no shipped machine profile 'b200.json'"):
        load_profile("b200.json")


# -- PyTorch meshes -------------------------------------------------------------------------------
def _mesh(device_type, shape):
    import torch

    return SimpleNamespace(device_type=device_type, mesh=torch.arange(int(torch.Size(shape).numel())).reshape(shape))


def test_torch_cpu_mesh_gets_the_cpu_profile():
    from shardplan.torch.device import mesh_machine

    m = mesh_machine(_mesh("cpu", (8,)), environ={"LOCAL_WORLD_SIZE": "8"})
    assert m.name == "cpu (detected: cpu) on mesh 8" and m.num_devices == 8
    assert m == load_profile("cpu.json").machine(8, name=m.name)


def test_torch_cuda_mesh_nodes_from_local_world_size():
    from shardplan.torch.device import mesh_machine

    kind = "NVIDIA H100 80GB HBM3"
    m = mesh_machine(_mesh("cuda", (2, 8)), device_name=kind, environ={"LOCAL_WORLD_SIZE": "8"})
    assert m.name == f"h100 (detected: {kind}) on mesh 2x8" and m.levels == (8, 2)
    assert mesh_machine(_mesh("cuda", (4, 4)), device_name=kind, environ={"LOCAL_WORLD_SIZE": "4"}).levels == (4, 4)
    assert mesh_machine(_mesh("cuda", (16,)), device_name=kind, environ={}).levels == (8, 2)
    assert mesh_machine(_mesh("cuda", (16,)), device_name=kind, node_size=2, environ={}).levels == (2, 8)
    with pytest.raises(ShardplanError, match="LOCAL_WORLD_SIZE must be a whole number"):
        mesh_machine(_mesh("cuda", (16,)), device_name=kind, environ={"LOCAL_WORLD_SIZE": "eight"})


def test_torch_mesh_without_a_profile():
    import torch

    from shardplan.torch.device import mesh_machine

    with pytest.raises(ShardplanError, match="no machine profile for device type 'xpu'"):
        mesh_machine(_mesh("xpu", (8,)), environ={})
    with pytest.raises(ShardplanError, match="no machine profile for device kind 'NVIDIA H100 PCIe'"):
        mesh_machine(_mesh("cuda", (8,)), device_name="NVIDIA H100 PCIe", environ={})
    if not torch.cuda.is_available():
        with pytest.raises(ShardplanError, match="torch.cuda is not available"):
            mesh_machine(_mesh("cuda", (8,)), environ={})
