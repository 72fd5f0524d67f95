"""Pipeline report, JSON, timeline picture and CLI."""

from __future__ import annotations

import dataclasses
import json

import pytest

from shardplan import preset
from shardplan.cli import main
from shardplan.models import get_model
from shardplan.pipeline import pipeline_solve
from shardplan.report.pipeline import draw_timeline, pipeline_to_json, render_pipeline

TINY = ["--set", "layers=2", "--set", "d_model=64", "--set", "heads=2", "--set", "seq=16", "--set", "vocab=256"]


BUDGET = 0.75  # of the whole model's time-optimal single-stage footprint


@pytest.fixture(scope="module")
def staged():
    # a budget below the whole model's time-optimal single-program footprint forces a pipeline
    from shardplan.pipeline import ModelStages

    # without tile quantisation: products this small would each fill a few multiprocessors of one wave, and the
    # search would pick unequal stages, where the step formula and the event simulation need not agree
    machine = dataclasses.replace(preset("a100", 4), node_size=2, inter_bandwidth=1e8, sm_count=None,
                                  gemm_tiles=None)
    build = lambda b: get_model("gpt", b, layers=2, d_model=64, heads=2, seq=16, vocab=256)  # noqa: E731
    whole = ModelStages(build, 8, machine, {"cutoff": 1})
    budget = BUDGET * whole.stage_cost(0, whole.num_units, 4, 1).memory(1)
    return pipeline_solve(build, 8, machine, micro_batches=(1, 2, 4), uniform=True, interleave=(2,),
                          sizes=(2, 4), budget=budget, cutoff=1)


def test_report_and_json(staged, tmp_path):
    text = render_pipeline(staged)
    d = pipeline_to_json(staged)
    assert f"schedule {d['schedule']}" in text and "bubble fraction" in text
    assert staged.plan.num_stages // staged.plan.chunks >= 2
    assert all(s["memory_bytes"] <= d["budget_bytes"] for s in d["stages"])
    assert d["simulated_step_seconds"] == pytest.approx(d["step_seconds"], rel=0.02)
    assert sum(s["devices"] for s in d["stages"][:len(d["stages"]) // d["chunks"]]) == 4
    assert [u for s in d["stages"] for u in s["units"]] == ["embed", "L1", "L2", "ln_f,fc,softmax"] or d["chunks"] > 1
    assert d["step_seconds"] == staged.step_time
    assert 0.0 <= d["bubble_fraction"] < 1.0
    # 2 groups of 2 devices, v = 2, m = 2 or 4: in the interleaved space, so the report bounds every chunking
    assert d["interleaved_any_chunking_bound"] > 0 and "over any chunking it is at least" in text
    json.dumps(d)


def test_timeline_png(staged, tmp_path):
    path = draw_timeline(staged, str(tmp_path / "t.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_cli_pipeline(tmp_path, capsys):
    out = tmp_path / "p.json"
    pic = tmp_path / "p.svg"
    rc = main(["pipeline", "--model", "gpt", "--batch", "4", *TINY, "-p", "2", "--machine", "a100",
               "--micro-batches", "1,2", "--max-stages", "2", "--json", str(out), "--timeline", str(pic)])
    assert rc == 0
    text = capsys.readouterr().out
    assert text.startswith("gpt on a100") and "Pipeline: " in text and "timeline:" in text
    assert json.loads(out.read_text())["micro_batches"] in (1, 2)
    assert pic.read_text().lstrip().startswith("<?xml")


def test_cli_pipeline_bad_input(capsys):
    assert main(["pipeline", "--model", "gpt", "-p", "2", "--micro-batches", "3,x"]) == 2
    assert "--micro-batches" in capsys.readouterr().err
    assert main(["pipeline", "--model", "gpt", "--batch", "4", *TINY, "-p", "2", "--micro-batches", "3"]) == 2
    assert "divides the batch" in capsys.readouterr().err


def test_cli_pipeline_zero_bubble(capsys):
    # two stages of one device each (the only sub-mesh size allowed): ZB-H1 beats 1F1B there
    rc = main(["pipeline", "--model", "gpt", "--batch", "4", *TINY, "-p", "2", "--machine", "a100",
               "--micro-batches", "4", "--sizes", "1", "--zero-bubble"])
    assert rc == 0
    assert "2 stage(s), schedule zb-h1" in capsys.readouterr().out
