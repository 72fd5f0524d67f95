"""Bad input of every kind ends as one line and exit status 2 (CLI) or one ShardplanError (API).

The pattern of test_search_io.py's problem-file table, extended to command
line options, model sizes, machine fields and the Python API.
"""

from __future__ import annotations

import codecs
import io
import json
import math

import numpy as np
import pytest

from shardplan.cli import main, progress as _progress
from shardplan.errors import ShardplanError
from shardplan.machine import Machine
from shardplan.search import load_problem
from shardplan.search.ordering import min_fill
from shardplan.search.problem import Problem

PROBLEM = {
    "format": "shardplan-problem/1",
    "vertices": [
        {"name": "a", "configs": [[1], [2]], "cost": [1.0, 2.0]},
        {"name": "b", "configs": [[1]], "cost": [3]},
    ],
    "edges": [{"src": "a", "dst": "b", "cost": [[1], [2]]}],
}


@pytest.fixture(scope="module")
def problem_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("p") / "p.json"
    path.write_text(json.dumps(PROBLEM))
    return str(path)


def run(capsys, argv):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


# (command line, a regular expression the one error line must match); "{P}" is a valid problem file.
BAD_ARGS = [
    # model sizes
    ("ops --model transformer --set layers=abc", r"size layers must be an integer, got 'abc'"),
    ("ops --model transformer --set layers=1.5", r"size layers must be an integer, got 1\.5"),
    ("ops --model transformer --set layers=-1", r"size layers must be at least 1, got -1"),
    ("ops --model transformer --set layers=0", r"size layers must be at least 1, got 0"),
    ("ops --model gpt --set layers=-2", r"model 'gpt': size layers must be at least 1"),
    ("ops --model transformer --set heads=0", r"size heads must be at least 1, got 0"),
    ("ops --model transformer --set heads=7", r"heads=7 must be a positive divisor of d_model=512"),
    ("ops --model gpt --set d_model=100 --set heads=16", r"heads=16 must be a positive divisor of d_model=100"),
    ("ops --model rnnlm --set depth=3", r"model 'rnnlm' has no size 'depth'"),
    ("ops --model rnnlm --set hidden", r"--set expects KEY=VALUE"),
    ("ops --model densenet121 --set connectivity=3", r"size connectivity must be a string"),
    ("ops --model alexnet --set classes=" + "9" * 30, r"size classes must be at most"),
    # numeric options: NaN, inf, out of range, not a number; the message names the option
    ("solve --model alexnet -p 4 --table-memory nan", r"argument --table-memory: must be a finite number, got nan"),
    ("solve --model alexnet -p 4 --table-memory inf", r"argument --table-memory: must be a finite number, got inf"),
    ("solve --model alexnet -p 4 --table-memory 0", r"argument --table-memory: must be at least 1 B"),
    ("solve --model alexnet -p 4 --table-memory lots", r"argument --table-memory: expects a number, got 'lots'"),
    ("bench --models alexnet --procs 4 --bfs-memory nan", r"argument --bfs-memory: must be a finite number"),
    ("solve --problem {P} --solver mcmc --seed -1", r"argument --seed: must be at least 0, got -1"),
    ("compare --model alexnet --procs 4 --seed -1", r"argument --seed: must be at least 0, got -1"),
    ("solve --problem {P} --solver mcmc --seed 1.5", r"argument --seed: expects an integer, got '1.5'"),
    ("solve --model alexnet -p 4 --batch 100000000000000000000", r"argument --batch: must be at most 1099511627776"),
    ("solve --model alexnet -p 4 --batch 0", r"argument --batch: must be at least 1, got 0"),
    ("ops --model alexnet --cutoff 0", r"argument --cutoff: must be at least 1"),
    ("solve --model alexnet -p 0", r"argument -p/--procs: must be at least 1, got 0"),
    ("solve --model alexnet -p four", r"argument -p/--procs: expects an integer"),
    ("compare --model alexnet --procs 4 --plot out.xyz", r"argument --plot: 'out.xyz' has format 'xyz'; use one of"),
    ("compare --model alexnet --procs 4 --plot out", r"argument --plot: 'out' has no format suffix"),
    ("solve --model alexnet -p 4 --latency nan", r"argument --latency: must be a finite number, got nan"),
    ("solve --model alexnet -p 4 --latency inf", r"argument --latency: must be a finite number, got inf"),
    ("solve --model alexnet -p 4 --latency=-1e-6", r"argument --latency: must be at least 0 s"),
    ("solve --model alexnet -p 4 --flops inf", r"argument --flops: must be a finite number, got inf"),
    ("solve --model alexnet -p 4 --flops 1e-300", r"argument --flops: must be at least 1000 FLOP/s"),
    ("solve --model alexnet -p 4 --flops 1e300", r"argument --flops: must be at most 1e\+18 FLOP/s"),
    ("solve --model alexnet -p 4 --bandwidth inf", r"argument --bandwidth: must be a finite number, got inf"),
    ("solve --model alexnet -p 4 --bandwidth 1e-300", r"argument --bandwidth: must be at least 1000 B/s"),
    ("solve --model alexnet -p 4 --bandwidth 1e400", r"argument --bandwidth: must be a finite number, got inf"),
    ("solve --problem {P} --solver ilp --time-limit 0", r"argument --time-limit: must be positive"),
    ("solve --model alexnet -p 4 --dtype fp7", r"argument --dtype: invalid choice: 'fp7'"),
    ("solve --model alexnet -p 4 --machine dgx", r"argument --machine: invalid choice: 'dgx'"),
    ("solve --model alexnet -p 4 --solver magic", r"argument --solver: invalid choice: 'magic'"),
    ("solve --model alexnet -p 4 --ordering random", r"argument --ordering: invalid choice: 'random'"),
    ("solve --model alexnet -p 4 --progress -1", r"argument --progress: must be at least 0"),
    # argparse's own errors, as one line
    ("solve --bogus", r"unrecognized arguments: --bogus"),
    ("solve --model", r"argument --model: expected one argument"),
    ("export-problem --model alexnet -p 4", r"the following arguments are required: -o/--output"),
    ("frobnicate", r"argument COMMAND: invalid choice: 'frobnicate'"),
    # options that do not apply to the input or the solver are errors, not silently ignored
    ("solve --problem {P} --dot x.dot", r"--dot does not apply to --problem"),
    ("solve --problem {P} --machine h100", r"--machine does not apply to --problem"),
    ("solve --problem {P} -p 4", r"-p/--procs does not apply to --problem"),
    ("solve --problem {P} --flops 1e12", r"--flops does not apply to --problem"),
    ("solve --problem {P} --batch 8", r"--batch does not apply to --problem"),
    ("solve --problem {P} --no-baselines", r"--no-baselines does not apply to --problem"),
    ("solve --problem {P} --seed 3", r"--seed does not apply to --solver dp \(only to mcmc\)"),
    ("solve --problem {P} --solver ilp --ordering bfs", r"--ordering does not apply to --solver ilp"),
    ("solve --problem {P} --solver mcmc --table-memory 1e9", r"--table-memory does not apply to --solver mcmc"),
    ("solve --problem {P} --time-limit 5", r"--time-limit does not apply to --solver dp"),
    ("solve --model alexnet -p 4 --time-limit 5",
     r"--time-limit does not apply to --solver dp \(only to ilp; or to the fit search, with --fit/--memory\)"),
    ("solve --model alexnet -p 4 --fit --time-limit=-3", r"argument --time-limit: must be positive"),
    ("solve --model alexnet -p 4 --memory 16 --time-limit nan", r"argument --time-limit: must be a finite number"),
    ("solve --model alexnet --problem {P} -p 4", r"exactly one of --model NAME or --problem FILE"),
    ("bench --models , --procs 4", r"--models expects a comma-separated list of model names, got ','"),
    ("bench --models alexnet --procs 4 --no-bfs --bfs-memory 1e9", r"--bfs-memory does not apply with --no-bfs"),
    ("bench --models alexnet --procs ,", r"--procs needs positive device counts"),
]


@pytest.mark.parametrize("argv,message", BAD_ARGS, ids=[a for a, _ in BAD_ARGS])
def test_bad_option_is_one_line_exit_2(capsys, problem_file, argv, message):
    code, out, err = run(capsys, [a.replace("{P}", problem_file) for a in argv.split()])
    assert code == 2, (out, err)
    import re

    assert err.count("\n") == 1 and re.match(r"shardplan( [a-z-]+)?: error: ", err), err
    assert "Traceback" not in err
    assert re.search(message, err), err


def _write(tmp_path, name: str, content: bytes | str) -> str:
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return str(path)


GOOD = json.dumps(PROBLEM)
BAD_FILES = [
    ("deep", "[" * 5000 + "]" * 5000, r"JSON nested too deeply"),
    ("deep_object", '{"a":' * 5000 + "1" + "}" * 5000, r"JSON nested too deeply"),
    ("latin1", GOOD.replace('"a"', '"\u00e9"').encode("latin-1"), r"not UTF-8 text \(byte 0xe9 at offset \d+\)"),
    ("utf16", GOOD.encode("utf-16"), r"UTF-16 or UTF-32 text \(byte-order mark\)"),
    ("utf16le", GOOD.encode("utf-16-le"), r"holds NUL bytes at offset 1"),
    ("binary", bytes(range(256)) * 4, r"holds NUL bytes at offset 0"),
    ("digits400", GOOD.replace("[3]", "[1" + "0" * 399 + "]"), r"cost\[0\] is an integer of 400 digits"),
    ("digits5001", GOOD.replace("[3]", "[1" + "0" * 5000 + "]"), r"an integer of 5001 digits"),
    ("float_overflow", GOOD.replace("[3]", "[1e400]"), r"cost\[0\] is inf, costs must be finite"),
    ("sum_overflow", GOOD.replace("1.0, 2.0", "1e308, 1e308").replace("[3]", "[1e308]"),
     r"costs too large: the largest possible total cost overflows float64"),
    ("empty", "", r"not valid JSON"),
    ("src_not_a_name", GOOD.replace('"src": "a"', '"src": ["a"]'), r"edges\[0\]: src and dst must be vertex names"),
]


@pytest.mark.parametrize("name,content,message", BAD_FILES, ids=[n for n, _, _ in BAD_FILES])
@pytest.mark.parametrize("solver", ["dp", "bfs-dp"])
def test_bad_problem_file_is_one_line_exit_2(capsys, tmp_path, name, content, message, solver):
    path = _write(tmp_path, f"{name}.json", content)
    code, out, err = run(capsys, ["solve", "--problem", path, "--solver", solver])
    assert code == 2 and out == "", (out, err)
    assert err.count("\n") == 1 and "Traceback" not in err
    import re

    assert re.search(message, err), err


def test_problem_file_with_utf8_byte_order_mark_is_read(tmp_path):
    path = _write(tmp_path, "bom.json", codecs.BOM_UTF8 + GOOD.encode())
    assert load_problem(path).names == ("a", "b")
    assert load_problem(io.BytesIO(GOOD.encode())).names == ("a", "b")


def test_problem_overflow_is_refused_in_the_api():
    with pytest.raises(ShardplanError, match="overflows float64.*vertex 'x'"):
        Problem(names=("x", "y"), configs=(((1,),), ((1,),)), vertex_cost=(np.array([1e308]), np.array([1e308])),
                edges=(), edge_cost=())
    # at the edge of the range but finite: accepted, and its cost prints finite
    p = Problem(names=("x", "y"), configs=(((1,),), ((1,),)), vertex_cost=(np.array([8e307]), np.array([8e307])),
                edges=(), edge_cost=())
    assert math.isfinite(p.evaluate([0, 0]))


# (keyword arguments of Machine, the error message)
BAD_MACHINES = [
    (dict(num_devices=True), r"num_devices must be an integer, got True"),
    (dict(num_devices=4.0), r"num_devices must be an integer, got 4\.0"),
    (dict(num_devices=0), r"num_devices must be at least 1"),
    (dict(num_devices="8"), r"num_devices must be an integer"),
    (dict(num_devices=8, node_size=2.5, inter_bandwidth=1e9), r"node_size must be an integer, got 2\.5"),
    (dict(num_devices=8, node_size=4), r"needs a positive inter_bandwidth"),
    (dict(num_devices=8, peak_flops=math.inf), r"peak_flops must be a finite number, got inf"),
    (dict(num_devices=8, peak_flops=math.nan), r"peak_flops must be a finite number, got nan"),
    (dict(num_devices=8, peak_flops=0), r"peak_flops must be positive"),
    (dict(num_devices=8, peak_flops="fast"), r"peak_flops must be a number"),
    (dict(num_devices=8, bandwidth=-1.0), r"bandwidth must be positive"),
    (dict(num_devices=8, latency=math.nan), r"latency must be a finite number"),
    (dict(num_devices=8, latency=-1e-6), r"latency must be at least 0"),
    (dict(num_devices=8, dtype_bytes=3), r"dtype_bytes must be 1, 2, 4 or 8"),
    (dict(num_devices=8, dtype_bytes=True), r"dtype_bytes must be an integer"),
    (dict(num_devices=8, memory_bytes=math.inf), r"memory_bytes must be a finite number"),
    (dict(num_devices=8, node_size=4, inter_bandwidth=math.inf), r"inter_bandwidth must be a finite number"),
    (dict(num_devices=8, inter_latency=math.nan), r"inter_latency must be a finite number"),
    (dict(num_devices=8, name=7), r"name must be a string"),
]


@pytest.mark.parametrize("kwargs,message", BAD_MACHINES, ids=[str(k) for k, _ in BAD_MACHINES])
def test_bad_machine_field(kwargs, message):
    with pytest.raises(ShardplanError, match=message) as exc:
        Machine(**kwargs)
    assert "\n" not in str(exc.value)


def test_machine_canonicalises_numpy_numbers():
    m = Machine(np.int64(8), peak_flops=np.float32(1e12), node_size=np.int32(4), inter_bandwidth=1e9)
    assert type(m.num_devices) is int and type(m.node_size) is int and type(m.peak_flops) is float


def test_solve_api_checks_its_arguments():
    from shardplan import preset, solve
    from shardplan.models import get_model

    g, m = get_model("rnnlm", batch=8, seq=8, vocab=64, hidden=16), preset("paper", 2)
    with pytest.raises(ShardplanError, match="graph must be a shardplan Graph.*got NoneType"):
        solve(None, m)
    with pytest.raises(ShardplanError, match="machine must be a shardplan Machine.*got int"):
        solve(g, 8)
    with pytest.raises(ShardplanError, match="cutoff must be at least 1"):
        solve(g, m, cutoff=0)
    with pytest.raises(ShardplanError, match="orders must be"):
        solve(g, m, orders="diagonal")
    with pytest.raises(ShardplanError, match="unknown solver"):
        solve(g, m, solver=None)


def test_model_builders_refuse_sizes_that_make_no_model():
    from shardplan.models import get_model
    from shardplan.models.gpt import gpt
    from shardplan.models.transformer import transformer

    with pytest.raises(ShardplanError, match="layers=0 makes no model"):
        transformer(layers=0)
    with pytest.raises(ShardplanError, match="heads=0 must be a positive divisor"):
        gpt(heads=0)
    with pytest.raises(ShardplanError, match="batch must be at least 1"):
        get_model("alexnet", batch=0)
    with pytest.raises(ShardplanError, match="size image must be an integer, got True"):
        get_model("alexnet", image=True)


def _naive_min_fill(problem: Problem) -> list[int]:
    """Minimum fill-in by rescanning every remaining vertex at every step (the definition)."""
    n = problem.num_vertices
    d = [set() for _ in range(n)]
    for s, t in problem.edges:
        d[s].add(t)
        d[t].add(s)
    logk = [math.log(k) for k in problem.sizes]
    remaining, order = set(range(n)), []
    while remaining:
        def key(u):
            nb = sorted(d[u])
            fill = sum(1 for i, a in enumerate(nb) for b in nb[i + 1:] if b not in d[a])
            return (fill, round(logk[u] + sum(logk[w] for w in nb), 9), u)

        v = min(remaining, key=key)
        order.append(v)
        remaining.discard(v)
        for w in d[v]:
            d[w] |= d[v]
            d[w] -= {w, v}
        d[v] = set()
    return order


@pytest.mark.parametrize("seed", range(12))
def test_min_fill_incremental_equals_full_rescan(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(5, 40))
    edges = set()
    while len(edges) < int(rng.integers(n - 1, 3 * n)):
        a, b = (int(x) for x in rng.integers(0, n, 2))
        if a != b:
            edges.add((a, b))
    ks = [int(k) for k in rng.integers(1, 6, n)]
    p = Problem(names=tuple(map(str, range(n))), configs=tuple(tuple((j,) for j in range(k)) for k in ks),
                vertex_cost=tuple(np.zeros(k) for k in ks), edges=tuple(sorted(edges)),
                edge_cost=tuple(np.zeros((ks[a], ks[b])) for a, b in sorted(edges)))
    assert min_fill(p) == _naive_min_fill(p)


class _FakeStream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_progress_writes_lines_when_not_a_terminal():
    now = [0.0]
    out = _FakeStream(tty=False)
    show = _progress("building cost tables", stream=out, clock=lambda: now[0])
    for i in range(1, 101):
        now[0] = i * 0.2  # 20 s in all: a line every 5 s
        show(i, 100)
    lines = out.getvalue().splitlines()
    assert lines == ["building cost tables 25/100 (5 s)", "building cost tables 50/100 (10 s)",
                     "building cost tables 75/100 (15 s)", "building cost tables 100/100 (20 s)"]


def test_progress_is_silent_for_fast_steps_and_rewrites_a_terminal_line():
    now = [0.0]
    out = _FakeStream(tty=False)
    show = _progress("x", stream=out, clock=lambda: now[0])
    for i in range(1, 11):
        now[0] = i * 0.1
        show(i, 10)
    assert out.getvalue() == ""
    tty = _FakeStream(tty=True)
    show = _progress("x", stream=tty, clock=lambda: now[0])
    now[0] += 1.0
    show(1, 2)
    now[0] += 1.0
    show(2, 2)
    assert tty.getvalue() == "\rx 1/2\rx 2/2\n"
    forced = _FakeStream(tty=True)
    show = _progress("x", every=1.0, stream=forced, clock=lambda: now[0])
    now[0] += 1.0
    show(1, 2)
    assert forced.getvalue() == "x 1/2 (1 s)\n"
