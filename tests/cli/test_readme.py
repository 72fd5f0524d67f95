"""The README's examples run as written: every ```python block and every command of the ```sh blocks."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out

README = Path(__file__).resolve().parents[2] / "README.md"


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S)


def _python(name: str) -> str:
    found = [b for b in blocks("python") if name in b]
    assert len(found) == 1, f"the README has {len(found)} python blocks with {name!r}"
    return found[0]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the example sets its own device count
    root = str(README.parent)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_the_readme_has_one_example_per_entry():
    assert len(blocks("python")) == 3 and len(blocks("sh")) == 2
    assert len(README.read_text().splitlines()) <= 200


def test_the_zoo_example_runs(tmp_path):
    out = subprocess.run([sys.executable, "-c", _python("shardplan.plan(")], cwd=tmp_path, env=_env(),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("gpt on h100") and "Plan: data" in out.stdout
    from shardplan import Plan

    assert Plan.from_json((tmp_path / "plan.json").read_text()).model == "gpt"


def test_the_jax_example_runs(tmp_path):
    out = subprocess.run([sys.executable, "-c", _python("shardplan.jax as sj")], cwd=tmp_path, env=_env(),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "cpu (detected: cpu)" in out.stdout and "Plan: data" in out.stdout


@pytest.mark.slow
def test_the_pytorch_example_runs(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(_python("shardplan.torch as st"))
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", str(script)],
                         cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "cpu (detected: cpu) on mesh 4" in out.stdout and "Plan: data" in out.stdout


def test_the_commands_run(tmp_path, monkeypatch, capsys):
    from shardplan.cli import main

    monkeypatch.chdir(tmp_path)
    lines = [ln for b in blocks("sh") for ln in b.splitlines() if ln.startswith(".venv/bin/shardplan ")]
    assert len(lines) >= 3
    for line in lines:
        argv = shlex.split(line.split("#")[0])[1:]
        if argv[0] in ("demo", "test"):
            continue
        assert main(argv) == 0, line
        assert "Plan: " in capsys.readouterr().out
