import os
import sys

# JAX tests run on 8 simulated CPU devices. The flag must be set before jax is first imported,
# which is why it is set here, when pytest loads this file, before any test module.
_DEVICES = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _DEVICES).strip()
# The CPU code generator at LLVM's lowest effort: the HLO passes (SPMD partitioning, collectives, fusion,
# scheduling, buffer assignment: everything the tests compare with the cost model) are unchanged, the
# compiled HLO text identical (checked on the corpus' mnist_cnn, GPT-2 and T5), and the kernels they lower to
# compile in about half the CPU time (tests/jax_engine/test_jax_corpus.py: 197 -> 104 CPU s). Float
# results differ by rounding only (GPT-2's sharded loss against the unsharded one: 1.1e-7 relative -> 0).
# The CPU backend's legacy (elemental) fusion emitters, not its MLIR fusion emitters, which compile slowly: the JAX
# test files take about 60 % of their CPU seconds with them (side by side, tests/jax_engine/test_jax_memory.py
# 20.1 -> 11.8 CPU s, test_staged_defer_jax.py 51.7 -> 32.0; tests/jax_engine as a whole 553 -> 367). The SPMD
# partitioner's output is unchanged: every collective (kind, shape, replica groups) of the corpus' mnist_cnn,
# GPT-2 and T5 steps is the same; the CPU backend fuses fewer, larger kernels (mnist_cnn 47 -> 34 fusions, GPT-2
# 179 -> 161, T5 245 -> 212), so its temporary bytes move by 0.06 to 0.8 % and the bytes accessed of
# test_xla_fusion.py's model by 2 % (its ratio 0.877 -> 0.859).
# docs/testing.md, "Fourth round".
_FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
                 "--xla_cpu_use_fusion_emitters=false")
for _flag in _FAST_COMPILE:
    if _flag.split("=")[0] not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += " " + _flag

# tests/ holds the shared helpers (torch_cases, randgraphs, ...); its folders, one per part of the package,
# hold the tests, which import the helpers and, here and there, each other by module name
_HERE = os.path.dirname(os.path.abspath(__file__))
for _folder in sorted(os.listdir(_HERE)):
    if os.path.isdir(os.path.join(_HERE, _folder)) and not _folder.startswith((".", "_")):
        sys.path.insert(0, os.path.join(_HERE, _folder))
sys.path.insert(0, _HERE)


def _transformers_major() -> int:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return int(version("transformers").split(".")[0])
    except PackageNotFoundError:
        return 0


# Two environments (Makefile, `make test`): .venv with transformers 4 (its Flax models for the JAX tests) runs
# every folder but torch_hf5; .venv-hf5 with transformers 5 (what PyTorch users install today; no JAX) runs
# torch_hf5 only. Collection, not a skip: neither environment can run the other's tests.
_HF5 = "torch_hf5"
collect_ignore = ([_HF5] if _transformers_major() < 5 else
                  sorted(f for f in os.listdir(_HERE) if os.path.isdir(os.path.join(_HERE, f)) and f != _HF5
                         and not f.startswith((".", "_"))))


def require_8_devices():
    """The 8 simulated devices of the JAX tests; fails (never skips) when they cannot be had."""
    import jax

    devices = jax.devices()
    if len(devices) < 8:
        raise RuntimeError(
            f"the JAX tests need 8 devices and jax sees {len(devices)} ({devices[0].platform}): jax was imported "
            f"before tests/conftest.py could set XLA_FLAGS={_DEVICES}, or XLA_FLAGS sets another device count"
        )
    return devices[:8]



def _marked_slow_as_a_whole(item) -> bool:
    """Whether ``item``'s module marks all its tests slow (``pytestmark = pytest.mark.slow``: its process groups or
    compiled third-party models make it one of the suite's long files)."""
    marks = getattr(getattr(item, "module", None), "pytestmark", [])
    return any(m.name == "slow" for m in (marks if isinstance(marks, list) else [marks]))


def pytest_collection_modifyitems(items):
    """The files marked slow as a whole first, then the other files with a test marked slow, then the rest; each
    file's tests in their order (a stable sort).

    `make test` hands whole files to its two workers (``--dist loadfile --no-loadscope-reorder``) in this order,
    the next file to the first worker with two tests or fewer left. Long files first and the many short ones
    after them leave the workers' last files short, so that neither waits long for the other at the end
    (longest-first list scheduling); xdist's own order, most tests first, put the long files of few tests (the
    gloo launches, 20 to 90 seconds each) last."""
    with_slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: 0 if _marked_slow_as_a_whole(item) else 1 if item.path in with_slow else 2)
