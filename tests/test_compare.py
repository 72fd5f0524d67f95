"""The speedup plot and the text table."""

from __future__ import annotations

import subprocess
import sys

import pytest

from shardplan.compare import format_table, plot_speedups
from shardplan.errors import ShardplanError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

RESULTS = [
    {"p": p, "strategy": s, "speedup": y}
    for s, ys in {
        "data parallel": [1.0, 1.0, 1.0, 1.0, 1.0],
        "expert": [1.02, 1.08, 1.15, 1.22, 1.31],
        "FlexFlow (MCMC)": [1.03, 1.10, 1.21, 1.35, 1.44],
        "shardplan (exact)": [1.05, 1.19, 1.38, 1.62, 1.85],
    }.items()
    for p, y in zip([4, 8, 16, 32, 64], ys)
]


def test_plot_writes_a_png(tmp_path):
    out = tmp_path / "speedups.png"
    plot_speedups(RESULTS, out, "AlexNet, 1080 Ti nodes (illustrative numbers)")
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 5000


def test_importing_compare_does_not_import_matplotlib():
    code = "import sys, shardplan, shardplan.compare; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_plot_rejects_bad_records(tmp_path):
    with pytest.raises(ShardplanError):
        plot_speedups([], tmp_path / "x.png", "t")
    with pytest.raises(ShardplanError, match="lacks"):
        plot_speedups([{"p": 4, "speedup": 1.0}], tmp_path / "x.png", "t")
    with pytest.raises(ShardplanError):
        plot_speedups([{"p": 0, "strategy": "a", "speedup": 1.0}], tmp_path / "x.png", "t")


def test_format_table_aligns():
    rows = [
        {"model": "AlexNet", "p": 8, "time_s": 0.253, "speedup": 1.5},
        {"model": "Inception-v3", "p": 64, "time_s": 196.253, "speedup": 1.85},
        ("RNNLM", 4, 0.057, None),
    ]
    text = format_table(rows, ["model", "p", "time_s", "speedup"])
    lines = text.splitlines()
    assert len(lines) == 5
    assert lines[0].split() == ["model", "p", "time_s", "speedup"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    # numeric columns are right-aligned: their last characters line up
    ends = {ln.index("196.3") + len("196.3") for ln in lines if "196.3" in ln}
    assert ends == {lines[3].index("196.3") + 5}
    assert lines[2].rstrip().endswith("1.5") and lines[3].rstrip().endswith("1.85")
    assert len(lines[2].split("0.253")[0]) == len(lines[4].split("0.057")[0])
    assert lines[4].startswith("RNNLM")


def test_format_table_rejects_ragged_rows():
    with pytest.raises(ShardplanError):
        format_table([(1, 2)], ["a", "b", "c"])
