"""The speedup plot and the one text-table renderer (shardplan.report)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from shardplan.report import format_table, plot_speedups
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


def test_matplotlib_is_imported_only_when_plotting(tmp_path):
    # matplotlib is installed (the test extra requires it), yet importing the reporting package does not load it;
    # drawing a plot does
    code = ("import importlib.util, sys, shardplan, shardplan.report, shardplan.cli\n"
            "assert importlib.util.find_spec('matplotlib') is not None, 'matplotlib is not installed'\n"
            "print('matplotlib' in sys.modules)\n"
            f"shardplan.report.plot_speedups([{{'p': 2, 'strategy': 'a', 'speedup': 1.0}}], {str(tmp_path / 'x.png')!r}, 't')\n"
            "print('matplotlib' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"]


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
    # numeric columns right-aligned, text left; floats as {:.4g}; None blank; rule under each column
    assert format_table(rows, ["model", "p", "time_s", "speedup"]) == (
        "model          p  time_s  speedup\n"
        "------------  --  ------  -------\n"
        "AlexNet        8   0.253      1.5\n"
        "Inception-v3  64   196.3     1.85\n"
        "RNNLM          4   0.057")


def test_format_table_explicit_alignment_without_header_or_rule():
    rows = [("compute", "1.2 ms", "80.0%"), ("halo exchange", "300 us", "20.0%")]
    assert format_table(rows, right=(1, 2)) == ("compute        1.2 ms  80.0%\n"
                                                "halo exchange  300 us  20.0%")
    assert format_table([("a", 1), ("bb", 22)], ("x", "y"), right=(), rule=False) == "x   y\na   1\nbb  22"


def test_format_table_rejects_ragged_rows():
    with pytest.raises(ShardplanError, match="row 0 has 2 values, expected 3"):
        format_table([(1, 2)], ["a", "b", "c"])
    with pytest.raises(ShardplanError, match="no header"):
        format_table([{"a": 1}])
