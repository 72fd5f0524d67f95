"""Fuzzing the command line in-process: exit 0 with a consistent, checked answer, or exit 2 with one line.

Two generators: random mutations of valid problem files (a value replaced by
any JSON value, a key or an element deleted, an element added, the text cut
short or a byte changed), solved by a random solver; and random option values
(numbers at and beyond their ranges, NaN, inf, huge integers, text) given to
`solve` on a tiny model and on a problem file. Nothing else may happen: no
exception out of ``main``, no other exit status, no second line on stderr, and
every answer printed is re-checked here (its cost is the sum of its chosen
costs; an "optimal" one is the brute-force minimum).
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import math
import os
import re
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from randgraphs import random_problem
from shardplan.cli import main
from shardplan.search import load_problem
from shardplan.search.io import problem_to_dict

SETTINGS = settings(max_examples=70, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
BASES = [problem_to_dict(random_problem(seed, n_max=5, k_max=4)) for seed in range(6)]


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def _brute_force_minimum(problem) -> float | None:
    """The exact minimum by enumeration, or None when there are too many assignments to enumerate."""
    if math.prod(problem.sizes) > 5000:
        return None
    return min(problem.evaluate(a) for a in itertools.product(*(range(k) for k in problem.sizes)))


def _check_outcome(code: int, out: str, err: str) -> None:
    assert code in (0, 2), (code, out, err)
    if code == 2:
        assert err.count("\n") == 1 and re.match(r"shardplan( [a-z-]+)?: error: ", err), err
        assert "Traceback" not in err


def _check_solution(problem_path: str, solution_path: str) -> None:
    """The answer written is consistent with the problem file it came from."""
    problem = load_problem(problem_path)
    sol = json.loads(open(solution_path).read())
    assignment = [sol["assignment"][n] for n in problem.names]
    cost = problem.evaluate(assignment)
    assert sol["cost"] == pytest.approx(cost, rel=1e-9, abs=0.0)
    for v, name in enumerate(problem.names):
        assert sol["configs"][name] == list(problem.configs[v][assignment[v]])
    best = _brute_force_minimum(problem)
    if sol["optimal"] and best is not None:
        assert cost <= best * (1 + 1e-6) + 1e-300, (cost, best, sol["solver"])


# Costs at every scale, from subnormal to the edge of overflow: a solver must give the same answer at each.
NUMBERS = st.floats(min_value=0.0, max_value=1e300) | st.integers(0, 10**30) | \
    st.sampled_from([0, 1, 5e-324, 1e-300, 1e-12, 1e-6, 1e6, 1e12, 1e300, 1.7e308])


def _paths(node, prefix=()):
    """Every path into a decoded JSON value (the root excluded), each container before its items."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in items:
        yield prefix + (key,)
        yield from _paths(child, prefix + (key,))


@st.composite
def mutated_problem_text(draw) -> str:
    data = json.loads(json.dumps(draw(st.sampled_from(BASES))))
    kind = draw(st.sampled_from(["number", "number", "scale", "replace", "delete", "append", "truncate", "byte"]))
    if kind in ("truncate", "byte"):
        text = json.dumps(data)
        i = draw(st.integers(0, len(text) - 1))
        if kind == "truncate":
            return text[:i]
        return text[:i] + draw(st.characters(codec="utf-8")) + text[i + 1:]
    if kind == "scale":  # every cost times one factor: the same optimum, at another scale
        factor = draw(st.sampled_from([1e-300, 1e-12, 1e-9, 1e-6, 1e-3, 1e3, 1e6, 1e12, 1e290]))
        for v in data["vertices"]:
            v["cost"] = [c * factor for c in v["cost"]]
        for e in data["edges"]:
            e["cost"] = [[c * factor for c in row] for row in e["cost"]]
        return json.dumps(data)
    paths = list(_paths(data))
    if kind == "number":
        paths = [p for p in paths if "cost" in p and not isinstance(_get(data, p), list)] or paths
    path = draw(st.sampled_from(paths))
    parent, key = _get(data, path[:-1]), path[-1]
    node = parent[key]
    if kind == "number":
        parent[key] = draw(NUMBERS)
    elif kind == "append" and isinstance(node, list):
        node.append(draw(JSON))
    elif kind == "append" and isinstance(node, dict):
        node[draw(st.text(max_size=6))] = draw(JSON)
    elif kind == "delete":
        del parent[key]
    else:
        parent[key] = draw(JSON)
    return json.dumps(data)


def _get(data, path):
    for key in path:
        data = data[key]
    return data


@SETTINGS
@given(text=mutated_problem_text(), solver=st.sampled_from(["dp", "bfs-dp", "ilp", "bruteforce", "mcmc"]))
def test_fuzz_problem_files(text: str, solver: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path, sol = os.path.join(tmp, "p.json"), os.path.join(tmp, "s.json")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
        code, out, err = _run(["solve", "--problem", path, "--solver", solver, "--json", sol])
        _check_outcome(code, out, err)
        if code == 0:
            _check_solution(path, sol)


VALUES = st.sampled_from(["nan", "inf", "-inf", "-1", "0", "1", "2", "3", "4", "1.5", "1e-300", "1e300", "1e400",
                          "abc", "", "100000000000000000000", "0x10", " 3", "1e9", "1e-6"]) | \
    st.integers(-10, 10**6).map(str) | st.floats().map(repr) | st.text(max_size=6)
MODEL_OPTIONS = ["-p", "--batch", "--cutoff", "--flops", "--bandwidth", "--latency", "--dtype", "--machine",
                 "--orders", "--table-memory", "--seed", "--time-limit", "--ordering", "--progress"]
SOLVERS = ["dp", "bfs-dp", "ilp", "bruteforce", "mcmc"]
SIZES = ["seq", "vocab", "hidden", "layers", "depth"]


@SETTINGS
@given(options=st.lists(st.tuples(st.sampled_from(MODEL_OPTIONS), VALUES), max_size=3),
       sizes=st.lists(st.tuples(st.sampled_from(SIZES), VALUES), max_size=2),
       solver=st.sampled_from(SOLVERS) | VALUES, on_file=st.booleans())
def test_fuzz_options(options, sizes, solver, on_file) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out_json = os.path.join(tmp, "out.json")
        if on_file:
            path = os.path.join(tmp, "p.json")
            with open(path, "w") as fh:
                json.dump(BASES[0], fh)
            argv = ["solve", "--problem", path, f"--solver={solver}"]
        else:  # a tiny RNNLM: every build takes milliseconds
            argv = ["solve", "--model", "rnnlm", "--set", "vocab=64", "--set", "hidden=16", "--set", "seq=8",
                    "--batch", "8", "-p", "2", "--no-baselines", f"--solver={solver}"]
            for key, value in sizes:
                argv += ["--set", f"{key}={value}"]
        for flag, value in options:
            argv += [f"{flag}={value}"]
        code, out, err = _run(argv + ["--json", out_json])
        _check_outcome(code, out, err)
        if code == 0 and on_file:
            _check_solution(path, out_json)
        elif code == 0:
            from shardplan.result import Plan

            plan = Plan.from_json(open(out_json).read())  # the one plan format
            parts = dict(plan.breakdown)
            assert math.isfinite(plan.step_time) and plan.step_time > 0
            assert parts["total"] == pytest.approx(sum(v for k, v in parts.items() if k != "total"), rel=1e-9)
            assert plan.step_time == pytest.approx(parts["total"], rel=1e-9)
            ops_total = sum(c.seconds + c.redistribution_seconds for c in plan.operators.values())
            assert plan.step_time == pytest.approx(ops_total, rel=1e-9)  # every second is some operator's


# --------------------------------------------------------------------------- every subcommand
# Boundary and nonsense values for any option: zero, negative, NaN, inf, huge, overflowing, not a number,
# empty, lists with bad entries, and a few small valid ones.
ANY_VALUE = st.sampled_from(["nan", "inf", "-inf", "-1", "0", "1", "2", "4", "8", "1.5", "1e-300", "1e300", "1e400",
                             "abc", "", "100000000000000000000", "0x10", " 3", "3", "2,4", "1,2,3", "0,1", ",",
                             "1,1", "-0", "1e9"])
TINY_RNN = ["--model", "rnnlm", "--set", "vocab=64", "--set", "hidden=16", "--set", "seq=8", "--batch", "8"]
TINY_GPT = ["--model", "gpt", "--set", "layers=1", "--set", "d_model=64", "--set", "heads=2", "--set", "vocab=128",
            "--set", "seq=16", "--batch", "8"]
MACHINE = ["--machine", "--flops", "--bandwidth", "--latency", "--dtype"]
MODEL = ["--batch", "--cutoff", "--set", "--orders", "--all-divisors"] + MACHINE
# (the command line every case starts from, the options a case may add; a flag taking no value ends in "!")
COMMANDS: dict[str, tuple[list[str], list[str]]] = {
    "models": (["models"], ["--model", "-p"]),
    "ops": (["ops", *TINY_RNN, "-p", "2"], ["-p", *MODEL]),
    "solve": (["solve", *TINY_RNN, "-p", "2", "--no-baselines"],
              ["-p", *MODEL, "--solver", "--memory", "--fit!", "--zero", "--micro-batches", "--reserve",
               "--grad-buffers", "--no-recompute!", "--time-limit", "--work-limit", "--table-memory", "--ordering", "--seed",
               "--progress"]),
    "export-problem": (["export-problem", *TINY_RNN, "-p", "2"], ["-p", *MODEL, "--table-memory", "--progress"]),
    "bench": (["bench", "--models", "rnnlm", "--procs", "2", "--no-bfs"],
              ["--models", "--procs", "--machine", "--orders", "--bfs-memory"]),
    "compare": (["compare", "--model", "rnnlm", "--set", "vocab=64", "--set", "hidden=16", "--set", "seq=8",
                 "--batch", "8", "--procs", "2"],
                ["--procs", "--machine", "--batch", "--set", "--cutoff", "--orders", "--seed", "--fit!", "--memory"]),
    "plan": (["plan", *TINY_GPT, "-p", "2"],
             ["-p", *MODEL, "--memory", "--no-fit!", "--stages", "--micro-batches", "--schedules", "--interleave",
              "--max-stages", "--operators!", "--recipe"]),
    "recipe": (["recipe", *TINY_GPT, "-p", "2", "--recipe", "tp=2"],
               ["-p", "--batch", "--set", "--recipe", "--operators!", *MACHINE]),
    "pipeline": (["pipeline", *TINY_GPT, "-p", "2"],
                 ["-p", *MODEL, "--micro-batches", "--max-stages", "--uniform!", "--interleave", "--zero-bubble!",
                  "--no-memory-choices!", "--fit-rtol", "--fit-time-limit", "--fit-work-limit", "--sizes", "--memory"]),
}
CHOICES = {"--machine": ["paper", "h100", "cpu", "dgx", ""], "--dtype": ["fp32", "bf16", "fp7"],
           "--orders": ["auto", "row-major", "all", "none"], "--solver": ["dp", "bfs-dp", "ilp", "bruteforce",
                                                                          "mcmc", "magic"],
           "--ordering": ["min-table", "bfs", "random"], "--grad-buffers": ["persistent", "backward", "x"],
           "--stages": ["auto", "on", "off", "maybe"], "--schedules": ["1f1b", "zb-h1,interleaved", "gpipe", ","],
           "--models": ["rnnlm", "nosuch", ",", ""], "--model": ["rnnlm"],
           "--recipe": ["tp=2", "tp=2,mbs=3", "dp=2,zero=3", "pp=2", "tp=0", "tp=nan", "mbs=1000000000000",
                        "recompute=full", "tp=2,,", "=", "tp", "{}", "tp=2\ndp=1"],
           "--set": ["layers=0", "layers=2", "vocab=1099511627776", "hidden=-1", "seq=abc", "heads=3",
                     "d_model=1099511627776", "nosuch=1", "layers", "seq=1e3"]}


@st.composite
def command_lines(draw, name: str) -> list[str]:
    base, options = COMMANDS[name]
    argv = list(base)
    for flag in draw(st.lists(st.sampled_from(options), max_size=3)):
        if flag.endswith("!"):
            argv.append(flag[:-1])
        else:
            value = draw(st.sampled_from(CHOICES[flag]) | ANY_VALUE if flag in CHOICES else ANY_VALUE)
            argv.append(f"{flag}={value}")
    return argv


def _no_nan(text: str) -> object:
    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} written into JSON")

    return json.loads(text, parse_constant=refuse)


def _check_written(argv: list[str], out_path: str) -> None:
    """What a command that succeeded wrote is right: the plan loads, its numbers are finite and add up."""
    from shardplan.result import Plan
    from shardplan.search import load_problem

    if not os.path.exists(out_path):
        return
    text = open(out_path).read()
    data = _no_nan(text)
    if argv[0] in ("plan", "recipe", "pipeline") or (argv[0] == "solve" and "format" in data):
        plan = Plan.from_json(text)
        assert math.isfinite(plan.step_time) and plan.step_time > 0
        budget = (plan.memory or {}).get("budget_bytes") if isinstance(plan.memory, dict) else None
        assert budget is None or budget > 0
    elif argv[0] == "export-problem":
        problem = load_problem(out_path)
        assert problem.num_vertices > 0
    elif argv[0] == "solve":  # a problem file's solution
        assert math.isfinite(data["cost"]) and data["cost"] >= 0


def _output_option(argv: list[str], out_path: str) -> list[str]:
    if argv[0] == "export-problem":
        return ["-o", out_path]
    if argv[0] == "bench":
        return ["--out", out_path]
    if argv[0] in ("solve", "compare", "plan", "recipe", "pipeline"):
        return ["--json", out_path]
    return []


def _fuzz_command(argv: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "out.json")
        code, out, err = _run(argv + _output_option(argv, out_path))
        _check_outcome(code, out, err)
        if code == 0:
            _check_written(argv, out_path)
        else:  # a refusal writes nothing, not even a temporary file
            assert os.listdir(tmp) == [], os.listdir(tmp)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_as_given_succeeds_and_is_checked(name) -> None:
    """Each generator's starting point is a valid command: the checks of a success run on every command."""
    with tempfile.TemporaryDirectory() as tmp:
        argv = COMMANDS[name][0]
        out_path = os.path.join(tmp, "out.json")
        code, out, err = _run(argv + _output_option(argv, out_path))
        assert code == 0, err
        _check_written(argv, out_path)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_fuzz_every_command(name) -> None:
    settings(SETTINGS, max_examples=12)(given(argv=command_lines(name))(_fuzz_command))()


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_fuzz_every_command_long(name) -> None:
    settings(SETTINGS, max_examples=60)(given(argv=command_lines(name))(_fuzz_command))()


# --------------------------------------------------------------------------- degenerate problem files
def _star(leaves: int, k_center: int, k_leaf: int) -> dict:
    rng = np.random.default_rng(leaves + k_center + k_leaf)
    vertices = [{"name": "c", "configs": [[j] for j in range(k_center)], "cost": rng.random(k_center).tolist()}]
    vertices += [{"name": f"l{i}", "configs": [[j] for j in range(k_leaf)], "cost": rng.random(k_leaf).tolist()}
                 for i in range(leaves)]
    edges = [{"src": "c", "dst": f"l{i}", "cost": rng.random((k_center, k_leaf)).tolist()} for i in range(leaves)]
    return {"format": "shardplan-problem/1", "vertices": vertices, "edges": edges}


def _path(n: int, k: int) -> dict:
    vertices = [{"name": f"v{i}", "configs": [[j] for j in range(k)], "cost": [float(j) for j in range(k)]}
                for i in range(n)]
    edges = [{"src": f"v{i}", "dst": f"v{i + 1}", "cost": [[1.0] * k] * k} for i in range(n - 1)]
    return {"format": "shardplan-problem/1", "vertices": vertices, "edges": edges}


# Shapes at the solvers' limits: more vertices than numpy has dimensions, a vertex with 64 neighbours, a star
# of many one-configuration leaves, a vertex of many configurations, a single vertex, no edges.
DEGENERATE = {
    "path-70": _path(70, 1), "path-65-k2": _path(65, 2), "star-64": _star(64, 1, 1), "star-64-k2": _star(64, 2, 2),
    "star-1500-leaves": _star(1500, 2, 1), "vertex-2000-configs": _star(1, 2000, 1), "one-vertex": _path(1, 3),
    "no-edges": {"format": "shardplan-problem/1", "vertices": _path(3, 2)["vertices"], "edges": []},
}


@pytest.mark.parametrize("solver", SOLVERS)
@pytest.mark.parametrize("shape", sorted(DEGENERATE))
def test_degenerate_problem_files(shape, solver) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path, sol = os.path.join(tmp, "p.json"), os.path.join(tmp, "s.json")
        with open(path, "w") as fh:
            json.dump(DEGENERATE[shape], fh)
        argv = ["solve", "--problem", path, f"--solver={solver}", "--json", sol]
        if solver == "ilp":
            argv.append("--time-limit=20")
        code, out, err = _run(argv)
        _check_outcome(code, out, err)
        if code == 0:
            _check_solution(path, sol)
        if solver == "dp":  # the exact solver answers every one of them
            assert code == 0, err
