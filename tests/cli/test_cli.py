"""The command line: results on stdout, one-line errors with exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from shardplan import Plan
from shardplan.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("models", "ops", "solve", "export-problem", "bench", "compare"):
        assert cmd in out


def test_models_lists_the_zoo(capsys):
    code, out, _ = run(capsys, "models")
    assert code == 0
    for name in ("alexnet", "inception_v3", "rnnlm", "transformer", "resnet101", "densenet121", "gpt"):
        assert name in out


def test_ops_lists_operators_and_config_counts(capsys):
    code, out, _ = run(capsys, "ops", "--model", "alexnet", "-p", "8")
    assert code == 0
    rows = {line.split()[0]: line.split() for line in out.splitlines()[2:]}
    assert list(rows) == ["conv1", "pool1", "conv2", "pool2", "conv3", "conv4", "conv5", "pool5", "flatten",
                          "fc1", "fc2", "fc3", "softmax"]
    # operator, kind, dims, extents, configurations (split tuples), with grid orders. By hand: on 8 devices with
    # cutoff 4, conv1 can split only b and n (c = 3 < 4; h, w = 55 odd; r, s are windows): b*n in {1, 2, 4, 8}
    # gives 10 tuples, and the 3 splitting both, (2,2), (4,2), (2,4), come in 2 nestings: 13. conv2 and fc1
    # split three dims: 20 tuples (exponents of 2 summing to at most 3), 3 + 6 with two split dims (2 nestings
    # each) and 1 with three (6 nestings): 20 + 3 + 6 + 5 = 34.
    assert rows["conv1"][:6] == ["conv1", "conv2d", "bchwnrs", "128x3x55x55x64x11x11", "10", "13"]
    assert rows["conv2"][4:6] == ["20", "34"]
    assert rows["fc1"][:6] == ["fc1", "dense", "bnc", "128x4096x9216", "20", "34"]
    assert rows["softmax"][4:6] == ["10", "13"]


def test_unknown_model_is_one_line_exit_2(capsys):
    code, out, err = run(capsys, "solve", "--model", "lenet", "-p", "8")
    assert code == 2
    assert err.count("\n") == 1 and "lenet" in err and "alexnet" in err


def test_bad_device_count_and_missing_args(capsys):
    code, _, err = run(capsys, "solve", "--model", "alexnet", "-p", "0")
    assert code == 2 and "-p/--procs" in err and err.count("\n") == 1
    code, _, err = run(capsys, "solve", "--model", "alexnet")
    assert code == 2 and "-p" in err
    code, _, err = run(capsys, "solve")
    assert code == 2 and "--model" in err and "--problem" in err


def test_solve_model_prints_plan_and_writes_json(capsys, tmp_path):
    out_json = tmp_path / "plan.json"
    dot = tmp_path / "plan.dot"
    code, out, _ = run(capsys, "solve", "--model", "alexnet", "-p", "4", "--json", str(out_json), "--dot", str(dot))
    assert code == 0
    assert "step time" in out.lower() or "predicted" in out.lower()
    data = json.loads(out_json.read_text())
    assert data["step_time_seconds"] > 0 and data["stats"]["solve_seconds"] >= 0
    assert Plan.from_json(out_json.read_text()).step_time == data["step_time_seconds"]
    ops = data["stages"][0]["operators"]
    assert "conv1" in ops and "fc3" in ops
    assert all("splits" in o and "dims" in o for o in ops.values())
    assert set(data["baselines"]) >= {"data_parallel"}
    assert dot.read_text().startswith("digraph")


def test_export_and_solve_problem_round_trip(capsys, tmp_path):
    path = tmp_path / "alex.json"
    code, out, _ = run(capsys, "export-problem", "--model", "alexnet", "-p", "4", "-o", str(path))
    assert code == 0 and path.exists()
    sol_path = tmp_path / "sol.json"
    code, out, _ = run(capsys, "solve", "--problem", str(path), "--json", str(sol_path))
    assert code == 0
    sol = json.loads(sol_path.read_text())
    assert set(sol) >= {"cost", "assignment", "configs", "solve_seconds"}
    # the same optimum as solving the model directly
    model_json = tmp_path / "m.json"
    run(capsys, "solve", "--model", "alexnet", "-p", "4", "--json", str(model_json), "--no-baselines")
    assert sol["cost"] == pytest.approx(json.loads(model_json.read_text())["step_time_seconds"], rel=1e-9)


def test_malformed_problem_file(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "shardplan-problem/1", "vertices": [{"name": "a", "configs": [[1]], '
                   '"cost": [1.0, 2.0]}], "edges": []}')
    code, _, err = run(capsys, "solve", "--problem", str(bad))
    assert code == 2 and err.count("\n") == 1 and "a" in err
    code, _, err = run(capsys, "solve", "--problem", str(tmp_path / "missing.json"))
    assert code == 2 and err.count("\n") == 1


def test_solvers_agree_through_the_cli(capsys, tmp_path):
    path = tmp_path / "alex.json"
    run(capsys, "export-problem", "--model", "alexnet", "-p", "4", "-o", str(path), "--orders", "row-major")
    costs = {}
    for solver in ("dp", "ilp", "bfs-dp"):
        out = tmp_path / f"{solver}.json"
        code, _, _ = run(capsys, "solve", "--problem", str(path), "--solver", solver, "--json", str(out))
        assert code == 0
        costs[solver] = json.loads(out.read_text())["cost"]
    assert costs["ilp"] == pytest.approx(costs["dp"], rel=1e-6)
    assert costs["bfs-dp"] == pytest.approx(costs["dp"], rel=1e-9)
    out = tmp_path / "mcmc.json"
    run(capsys, "solve", "--problem", str(path), "--solver", "mcmc", "--json", str(out))
    assert json.loads(out.read_text())["cost"] >= costs["dp"] * (1 - 1e-9)


def test_console_script_entry_point_exits_2_without_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "shardplan.cli", "solve", "--model", "nope", "-p", "2"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stderr.strip().count("\n") == 0


def test_compare_writes_table_json_and_png(capsys, tmp_path):
    js, png = tmp_path / "c.json", tmp_path / "c.png"
    code, out, _ = run(capsys, "compare", "--model", "alexnet", "--procs", "4,8", "--machine", "1080ti",
                       "--machine", "2080ti", "--json", str(js), "--plot", str(png))
    assert code == 0 and "shardplan (exact DP)" in out
    data = json.loads(js.read_text())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for machine in ("1080ti", "2080ti"):
        for p in (4, 8):
            rows = {r["strategy"]: r for r in data["rows"] if r["machine"] == machine and r["p"] == p}
            best = rows["shardplan (exact DP)"]["cost_seconds"]
            assert all(r["cost_seconds"] >= best * (1 - 1e-9) for r in rows.values())
            assert rows["data parallel"]["speedup_vs_data_parallel"] == pytest.approx(1.0)


def test_bench_table1_small(capsys, tmp_path):
    js = tmp_path / "t1.json"
    code, out, _ = run(capsys, "bench", "--models", "alexnet,rnnlm", "--procs", "4,8", "--out", str(js))
    assert code == 0
    rows = json.loads(js.read_text())["rows"]
    assert len(rows) == 4
    assert all(r["bfs_status"] == "ok" and r["dp_seconds"] >= 0 for r in rows)


def test_python_solve_api_reports_plan_and_search_statistics():
    from shardplan import preset, solve
    from shardplan.models import get_model

    plan = solve(get_model("alexnet"), preset("paper", 8))
    assert set(plan.configs) == {op.name for op in plan.graph.operators}
    parts = plan.breakdown
    assert parts["total"] == pytest.approx(plan.cost)
    assert parts["total"] == pytest.approx(sum(v for k, v in parts.items() if k != "total"))
    assert plan.solution.optimal and plan.solve_seconds > 0
    assert {"max_dependent_set", "largest_table", "total_table_entries", "ordering"} <= set(plan.stats)
    rows = plan.operators()
    assert sum(r["cost_seconds"] + r["redistribution_in_seconds"] for r in rows) == pytest.approx(plan.cost)


def test_too_many_devices_is_a_clear_error(capsys):
    code, _, err = run(capsys, "solve", "--model", "rnnlm", "-p", "1000000")
    assert code == 2 and "at most 4096 devices" in err and err.count("\n") == 1


def test_version_and_choices_come_from_the_package(capsys):
    from importlib.metadata import version

    from shardplan.cost import ORDERS
    from shardplan.machine import PRESETS
    from shardplan.search import SOLVERS
    from shardplan.search.ordering import ORDERINGS

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"shardplan {version('shardplan')}\n"
    with pytest.raises(SystemExit):
        main(["solve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for names in (SOLVERS, ORDERINGS, PRESETS, ORDERS):
        assert "{" + ",".join(names) + "}" in help_text
    code = main(["solve", "--model", "alexnet", "-p", "4", "--ordering", "random"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "invalid choice: 'random'" in err
    code = main(["ops", "--model", "alexnet", "--machine", "tpu"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("shardplan ops: error: ") and err.count("\n") == 1
