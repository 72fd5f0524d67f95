"""The one planning call and the one Plan value: what it searches, what it returns, JSON, the report."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from shardplan import ShardplanError
from shardplan.cli import main
from shardplan.fit import FitOptions, solve_fit
from shardplan.machine import preset
from shardplan.models import get_model
from shardplan.pipeline.api import pipeline_solve
from shardplan.spmd import solve
from shardplan.planner import from_pipeline, pipeline_of, plan, spmd_of
from shardplan.report.summary import recipe_words, render_plan
from shardplan.result import Plan

from planning_solves import MICRO_BATCHES, gpt4_pipeline_on_slow_links, gpt4_plan_on_a100_16, slow_links

pytestmark = pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out


def gpt(b: int):
    return get_model("gpt", b, layers=4)


@pytest.fixture(scope="module")
def h100_16():
    """plan() of GPT (4 blocks, batch 32) on 16 H100s as one program, with memory choices ("fit") and without
    ("plain"): read by two tests (one search each)."""
    m = preset("h100", 16)
    return {"fit": plan("gpt", m, sizes={"layers": 4}, batch=32, stages=False),
            "plain": plan("gpt", m, sizes={"layers": 4}, batch=32, stages=False, fit=False)}


def test_one_program_equals_the_searches_it_runs(h100_16):
    m = preset("h100", 16)
    p = h100_16["fit"]
    ref = solve_fit(gpt(32), m, options=FitOptions(micro_batches=(1, 2, 4, 8, 16, 32)), cutoff=1)  # every divisor
    assert p.step_time == pytest.approx(ref.cost, rel=1e-12)
    assert p.num_stages == 1 and p.schedule == "none" and p.optimal
    assert p.memory["peak_bytes"] <= m.memory_bytes
    assert p.stats["stages_reason"] == "stages=False"
    own = sum(c.seconds + c.redistribution_seconds for c in p.operators.values())
    assert own == pytest.approx(p.step_time, rel=1e-9)  # every second of the step is some operator's
    plain = h100_16["plain"]
    assert plain.step_time == pytest.approx(solve(gpt(32), m, cutoff=1).cost, rel=1e-12)
    assert not plain.stats["memory_choices"] and plain.memory["budget_bytes"] == m.memory_bytes


def test_a_budget_too_small_for_one_program_is_refused_with_the_least_memory():
    with pytest.raises(ShardplanError, match="no plan fits"):
        plan("gpt", preset("h100", 8), sizes={"layers": 4}, batch=32, budget=1e6, stages=False)


@pytest.fixture(scope="module")
def a100_16():
    """plan() of GPT (4 blocks, batch 32) on 16 A100s (two nodes), uninterrupted: read by two tests here and by
    tests/planning/test_planner_seeds.py (one search, planning_solves.py)."""
    return gpt4_plan_on_a100_16()


def test_stages_are_searched_only_where_they_can_pay(a100_16):
    one_node = plan("gpt", preset("h100", 8), sizes={"layers": 4}, batch=32)
    assert not one_node.stats["stages_searched"] and one_node.stats["stages_reason"] == "one node"
    cnn = plan("alexnet", preset("a100", 16))
    assert cnn.stats["stages_reason"] == "the model has no repeated blocks"
    two = a100_16
    assert two.stats["stages_searched"] and "one program" in two.stats["compared"]
    # the pipeline search starts from the one program's step: a pipeline that beats it is compared, else the
    # search proved a bound of the pipeline space, no lower than the plan's own
    assert "pipeline" in two.stats["compared"] or two.stats["pipeline_lower_bound"] >= two.lower_bound
    assert two.step_time == pytest.approx(min(two.stats["compared"].values()), rel=1e-9)  # a tie: one program
    # the answer's bound covers both spaces: at most either candidate's time
    assert two.lower_bound <= min(two.stats["compared"].values()) + 1e-15
    with pytest.raises(ShardplanError, match="builder"):
        plan(gpt(32), preset("a100", 16), stages=True)


def test_the_pipeline_wins_where_links_across_nodes_are_slow():
    # without tile quantisation: with it, the pipeline's micro-batches of one or two sequences per device fill
    # the multiprocessors' waves worse than one program on one node does, and at this size the pipeline loses
    # (planning_solves.slow_links); the reference search is tests/planning/test_planner_seeds.py's too
    m = slow_links()
    p = plan("gpt", m, sizes={"layers": 4}, batch=16, micro_batches=MICRO_BATCHES)
    ref = gpt4_pipeline_on_slow_links()  # the pipeline search alone, memory choices, 1F1B and ZB-H1
    assert p.pipelined and p.step_time == pytest.approx(ref.plan.step_time, rel=1e-12)
    # the one program's best: its plan, or the bound that proved none of its plans beats the first seed
    one = p.stats["compared"].get("one program", p.stats.get("one_program_none_better"))
    assert one is not None and p.step_time < one
    assert sum(s.devices for s in p.stages) // p.chunks == 16
    assert "pipeline" in recipe_words(p)


def test_plan_round_trips_through_json_and_rebuilds_on_the_program(h100_16):
    for p in (h100_16["fit"], h100_16["plain"]):
        text = p.to_json()
        q = Plan.from_json(text)
        assert q == p and q.detail is None and q.to_json() == text
        sp = spmd_of(q, gpt(32))
        assert sp.cost == pytest.approx(p.step_time, rel=1e-12)
        assert (sp.memory_choices is not None) == bool(p.stats["memory_choices"])
    # the plan checks the program it is run on
    with pytest.raises(ShardplanError, match="does not match"):
        spmd_of(q, get_model("gpt", 32, layers=3))
    with pytest.raises(ShardplanError, match="another program"):
        spmd_of(q, get_model("gpt", 16, layers=4))


def test_a_pipeline_plan_round_trips_and_rebuilds_its_stages(h100_16):
    m = preset("a100", 16)
    p = from_pipeline(pipeline_solve(gpt, 32, m, micro_batches=(4,), sizes=(8,), memory_choices=True, cutoff=1))
    assert p.num_stages == 2 and [s.devices for s in p.stages] == [8, 8]
    q = Plan.from_json(p.to_json())
    assert q == p
    r = pipeline_of(q, gpt)
    assert r.plan.step_time == p.step_time and r.plan.micro_batches == 4
    assert [(s.first, s.end, s.offset, s.devices) for s in r.plan.stages] == \
        [(s.first, s.end, s.offset, s.devices) for s in p.stages]
    for s, rs in zip(p.stages, r.plan.stages):
        assert rs.cost.detail.layouts == dict(s.layouts)
    with pytest.raises(ShardplanError, match="one program"):  # any plan of one program
        pipeline_of(h100_16["plain"], gpt)


def test_from_json_refuses_what_is_not_a_plan():
    with pytest.raises(ShardplanError, match="does not parse"):
        Plan.from_json("{")
    with pytest.raises(ShardplanError, match="not a shardplan plan"):
        Plan.from_json(json.dumps({"format": "other"}))
    d = json.loads(plan("alexnet", preset("paper", 4)).to_json())
    del d["stages"][0]["operators"][next(iter(d["stages"][0]["operators"]))]["splits"]
    with pytest.raises(ShardplanError, match="malformed"):
        Plan.from_dict(d)


def test_recipe_words_name_data_and_tensor_parallelism():
    m = preset("h100", 8)
    p = plan("gpt", m, sizes={"layers": 2}, batch=8, fit=False)
    words = recipe_words(p)
    assert words.startswith("data ") and " × tensor " in words
    d, t = (int(x.split()[1]) for x in words.split(",")[0].replace(" (mostly)", "").split(" × ")[:2])
    assert d * t == 8
    text = render_plan(p, operators=True)
    assert "Plan: " + words in text and "Step time:" in text and "Layouts by module:" in text
    assert all(op in text for op in p.operators)  # the per-operator table lists every operator


def test_report_collapses_identical_blocks():
    p = plan("gpt", preset("h100", 8), sizes={"layers": 6}, batch=8, fit=False)
    rows = render_plan(p).split("Layouts by module:")[1]
    assert "L1–6" in rows and "x6" in rows and "/" in rows


def test_cli_plan_prints_the_report_and_writes_the_plan(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "gpt", "--set", "layers=2", "--batch", "8", "-p", "8", "--machine", "h100",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("gpt on h100") and "Plan: data" in text
    q = Plan.from_json(out.read_text())
    assert q.machine == preset("h100", 8) and q.model == "gpt"
    assert not list(tmp_path.glob(".*.tmp"))  # written atomically, nothing left beside it


@pytest.mark.parametrize("argv,needle", [
    (["--schedules", "nope"], "--schedules"),
    (["--interleave", "1"], "--interleave"),
    (["--memory", "0"], "memory"),
    (["--memory", "nan"], "memory"),
    (["--no-fit", "--memory", "4"], "does not apply"),
    (["--micro-batches", "0"], "--micro-batches"),
    (["--offload", "optimizer,disk"], "--offload"),
    (["--no-fit", "--fp8"], "do not apply with --no-fit"),
    (["--fp8", "--stages", "on"], "does not offer FP8"),
])
def test_cli_plan_refuses_bad_options_in_one_line(argv, needle, capsys):
    assert main(["plan", "--model", "gpt", "--set", "layers=2", "-p", "8", "--machine", "h100", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1


def test_cli_plan_interrupted_before_any_plan_exits_130(monkeypatch, capsys):
    import shardplan.planner

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(shardplan.planner, "plan", interrupted)
    assert main(["plan", "--model", "gpt", "--set", "layers=2", "-p", "8", "--machine", "h100"]) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == "interrupted before any plan was found"


def test_cli_plan_writes_progress_lines(capsys, monkeypatch):
    import shardplan.pipeline.progress

    # 2 nodes of h100: the pipeline search runs; with no interval between lines every tick reports
    monkeypatch.setattr(shardplan.pipeline.progress, "INTERVAL", 0.0)
    assert main(["plan", "--model", "gpt", "--set", "layers=2", "--batch", "8", "-p", "16", "--machine", "h100",
                 "--micro-batches", "1,2"]) == 0
    err = capsys.readouterr().err
    # the parts run best-first by their step floor, the larger micro-batch count first among equals
    assert "pipelines zb-h1 m=2 | 0/4 parts done | best " in err


def test_partial_sums_widen_the_space_and_round_trip():
    """Deferred reductions offered: one long sequence on a node of 8 is planned faster with partial outputs
    (tensor 8 with reductions deferred, against data 4 x tensor 2 without), and the plan rebuilds from its JSON
    with its partial layouts."""
    m = preset("h100", 8)
    sizes = {"layers": 2, "d_model": 2048, "heads": 16, "seq": 4096}
    kw = dict(sizes=sizes, batch=1, fit=False, stages=False)
    base = plan("gpt", m, **kw)
    wide = plan("gpt", m, partial_sums=True, **kw)
    partial = [n for n, c in wide.operators.items() if c.layout.partial]
    assert wide.step_time < base.step_time * (1 - 1e-3) and partial
    assert not any(c.layout.partial for c in base.operators.values())
    assert "deferred reductions" in recipe_words(wide) and "deferred" not in recipe_words(base)
    q = Plan.from_json(wide.to_json())
    assert [n for n, c in q.operators.items() if c.layout.partial] == partial
    sp = spmd_of(q, get_model("gpt", 1, **sizes))
    assert sp.cost == pytest.approx(wide.step_time, rel=1e-9)
    with pytest.raises(ShardplanError, match="partial_sums"):
        plan("gpt", m, partial_sums="yes", **kw)


def test_cli_fp8_and_offload_plan_one_program_and_say_why(capsys):
    assert main(["plan", "--model", "gpt", "--set", "layers=2", "--batch", "16", "-p", "16", "--machine", "h100",
                 "--fp8", "--offload", "optimizer", "--master-weights"]) == 0
    out, err = capsys.readouterr()
    assert "FP8 on " in out and "Plan: data" in out
    assert "pipelines" not in err  # two nodes, repeated blocks: stages would be searched without the flags


def test_cli_partial_sums_flag(capsys):
    assert main(["plan", "--model", "gpt", "--set", "layers=2", "--set", "d_model=2048", "--set", "heads=16",
                 "--set", "seq=4096", "--batch", "1", "-p", "8", "--machine", "h100", "--no-fit",
                 "--partial-sums"]) == 0
    assert "deferred reductions (sequence parallel) on " in capsys.readouterr().out


def test_ctrl_c_in_the_one_program_search_returns_its_best_plan(monkeypatch, a100_16):
    """Ctrl-C while the one program's memory search runs (the exact solver raises KeyboardInterrupt at its k-th
    call): the first k that lands after a plan is known returns it, marked interrupted, with the pipelines not
    searched: the bound the plan states of the whole space is their step floor and the one program's work floor
    (docs/pipeline.md, *A bound whenever the search stops*), above 0 and never above the uninterrupted answer."""
    import shardplan.pipeline.api as api

    m, full = preset("a100", 16), a100_16
    # no uniform pipeline costed first (the planner's first step), so the interrupt lands in the one program
    monkeypatch.setattr(api, "pipeline_seeds", lambda *a, **k: None)

    def run():
        try:
            return plan("gpt", m, sizes={"layers": 4}, batch=32)
        except KeyboardInterrupt:
            return None

    got = _first_interrupt_with_a_plan(monkeypatch, run)
    assert got.stats["interrupted"] and list(got.stats["compared"]) == ["one program"]
    assert any("interrupted in the one program" in r for r in got.stats["refused"])
    assert got.step_time >= full.step_time * (1 - 1e-9) and got.memory["peak_bytes"] <= m.memory_bytes
    assert 0.0 < got.lower_bound <= full.step_time * (1 + 1e-12)


def test_a_refused_pipeline_search_is_named_in_the_report(monkeypatch):
    """The pipeline search refusing its space (e.g. a sub-mesh past the per-device tile cap) leaves the one
    program, and the report says which part was not searched, so its bound is read as the one program's."""
    import shardplan.pipeline.api as api

    def refuse(*args, **kwargs):
        raise ShardplanError("a stage's sub-mesh needs per-device tiles past the cap")

    monkeypatch.setattr(api, "pipeline_solve", refuse)
    got = plan("gpt", preset("a100", 16), sizes={"layers": 4}, batch=32)
    assert got.stats["stages_searched"] and list(got.stats["compared"]) == ["one program"]
    text = render_plan(got)
    assert "  not searched: pipelines: a stage's sub-mesh needs per-device tiles past the cap" in text.splitlines()


def test_cli_plan_interrupted_in_the_one_program_says_so(monkeypatch, capsys):
    """Ctrl-C inside the one program's memory search, after it had a plan: the command prints that plan and
    says the pipelines were not searched (the interrupt lands at the exact solver's k-th call, the first k
    that leaves a plan)."""
    import shardplan.pipeline.api as api

    argv = ["plan", "--model", "gpt", "--set", "layers=4", "--batch", "32", "-p", "16", "--machine", "a100"]
    monkeypatch.setattr(api, "pipeline_seeds", lambda *a, **k: None)  # the interrupt lands in the one program

    def run():
        if main(argv) == 0:
            return True
        capsys.readouterr()
        return None

    _first_interrupt_with_a_plan(monkeypatch, run)
    out, err = capsys.readouterr()
    assert ("interrupted in the one program's memory search: its best plan so far, with the bound it proved; "
            "the pipelines were not searched") in err.splitlines()
    assert "Step time:" in out and "gap 100%" not in out and "lower bound 0 s" not in out


def _first_interrupt_with_a_plan(monkeypatch, run):
    """Call ``run()`` with the exact solver raising KeyboardInterrupt at its k-th call, k = 1, 2, ..., until
    ``run`` returns something other than None (the interrupt landed after a plan was known); return that."""
    import shardplan.search.dp as dp

    real = dp.solve_dp
    for k in range(1, 60):
        calls = [0]

        def counted(*a, _k=k, **kw):
            calls[0] += 1
            if calls[0] == _k:
                raise KeyboardInterrupt
            return real(*a, **kw)

        monkeypatch.setattr(dp, "solve_dp", counted)
        got = run()
        if got is not None:
            return got
    pytest.fail("no interrupt landed after the one program had a plan")
