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
    ("solve --model alexnet -p 4 --fit --work-limit=-1", r"argument --work-limit: must be at least 0"),
    ("solve --model alexnet -p 4 --work-limit 5", r"--work-limit does not apply without --memory GiB or --fit"),
    ("solve --model alexnet --problem {P} -p 4", r"exactly one of --model NAME or --problem FILE"),
    ("bench --models , --procs 4", r"--models expects a comma-separated list of model names, got ','"),
    ("bench --models alexnet --procs 4 --no-bfs --bfs-memory 1e9", r"--bfs-memory does not apply with --no-bfs"),
    ("bench --models alexnet --procs ,", r"--procs needs positive device counts"),
    # plans that mean nothing: micro-batch counts that do not divide the batch, NaN budgets, no stages
    ("solve --model gpt --set layers=2 -p 4 --batch 64 --memory 4 --micro-batches 3",
     r"--micro-batches: 3 micro-batches do not split the batch of 64"),
    ("solve --model gpt --set layers=2 -p 4 --fit --micro-batches 1000000000000",
     r"--micro-batches: 1000000000000 micro-batches do not split the batch"),
    ("solve --model gpt --set layers=2 -p 4 --memory nan", r"argument --memory: must be a finite number, got nan"),
    ("solve --model gpt --set layers=2 -p 4 --memory 0", r"argument --memory: must be positive"),
    ("solve --model gpt --set layers=2 -p 4 --fit --reserve=-1", r"argument --reserve: must be at least 0"),
    ("solve --model gpt --set layers=2 -p 4 --fit --reserve inf", r"argument --reserve: must be a finite number"),
    ("pipeline --model gpt --set layers=2 -p 4 --memory nan", r"argument --memory: must be a finite number, got nan"),
    ("pipeline --model gpt --set layers=2 -p 4 --max-stages 0", r"argument --max-stages: must be at least 1, got 0"),
    ("pipeline --model gpt --set layers=2 -p 0", r"argument -p/--procs: must be at least 1, got 0"),
    ("pipeline --model gpt --set layers=2 -p 4 --fit-rtol nan", r"argument --fit-rtol: must be a finite number"),
    ("pipeline --model gpt --set layers=2 -p 4 --fit-rtol 1", r"--fit-rtol must be in \[0, 1\), got 1\.0"),
    ("pipeline --model gpt --set layers=2 -p 4 --fit-time-limit 0", r"argument --fit-time-limit: must be positive"),
    ("pipeline --model gpt --set layers=2 -p 4 --batch 64 --micro-batches 3",
     r"--micro-batches: 3 micro-batches do not split the batch of 64"),
    ("pipeline --model gpt --set layers=2 -p 4 --sizes 0", r"--sizes needs integers >= 1"),
    ("pipeline --model gpt --set layers=2 -p 4 --timeline t.gif", r"--timeline must end in \.png or \.svg"),
    ("plan --model gpt --set layers=2 -p 4 --batch 64 --micro-batches 3",
     r"plan: 3 micro-batches do not split the batch of 64"),
    ("plan --model gpt --set layers=2 -p 4 --micro-batches 1000000000000",
     r"plan: 1000000000000 micro-batches do not split the batch"),
    ("plan --model gpt --set layers=2 -p 4 --max-stages 0", r"argument --max-stages: must be at least 1, got 0"),
    ("plan --model gpt --set layers=2 -p 4 --memory nan", r"argument --memory: must be a finite number, got nan"),
    ("compare --model alexnet --procs 4 --memory nan", r"argument --memory: must be a finite number, got nan"),
    ("recipe --model gpt --set layers=2 -p 4 --recipe tp=2,mbs=3", r"not a multiple of dp × mbs = 2 × 3"),
    # the memory search's options without the memory search
    ("solve --model gpt --set layers=2 -p 4 --zero 1", r"--zero does not apply without --memory GiB or --fit"),
    ("solve --model gpt --set layers=2 -p 4 --micro-batches 2", r"--micro-batches does not apply without --memory"),
    ("solve --model gpt --set layers=2 -p 4 --reserve 1", r"--reserve does not apply without --memory"),
    ("solve --model gpt --set layers=2 -p 4 --grad-buffers backward", r"--grad-buffers does not apply without"),
    ("solve --model gpt --set layers=2 -p 4 --no-recompute", r"--no-recompute does not apply without --memory"),
    ("solve --problem {P} --memory 4", r"--memory does not apply to --problem"),
    ("solve --problem {P} --fit", r"--fit does not apply to --problem"),
    # sizes whose tensors would overflow int64 (each extent is within MAX_EXTENT, their product is not)
    ("solve --model gpt --set layers=1 --set heads=1 --set vocab=1099511627776 --set d_model=67108864 -p 4 "
     "--machine h100", r"tensor 'table' of shape \(1099511627776, 67108864\) has 7\.38e\+19 elements, more than"),
    ("ops --model gpt --set layers=1 --set heads=1 --set vocab=1099511627776 --set d_model=1048576",
     r"has 1\.15e\+18 elements, more than the cost model supports"),
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


# --------------------------------------------------------------------------- output files
FULL = "/dev/full"


def _is_char_device(path: str) -> bool:
    import os
    import stat

    return os.path.exists(path) and stat.S_ISCHR(os.stat(path).st_mode)


@pytest.mark.parametrize("argv", [
    "export-problem --model rnnlm --set vocab=64 --set hidden=16 --set seq=8 --batch 8 -p 2 -o /dev/full",
    "solve --model rnnlm --set vocab=64 --set hidden=16 --set seq=8 --batch 8 -p 2 --no-baselines --json /dev/full",
    "solve --problem {P} --json /dev/full",
])
def test_full_disk_is_one_line_and_the_device_stays(capsys, problem_file, argv):
    """A full disk is one line, exit 2; a device is written in place (a rename would replace /dev/full)."""
    assert _is_char_device(FULL), f"{FULL} must be the kernel's full device (Linux) for this test"
    code, out, err = run(capsys, [a.replace("{P}", problem_file) for a in argv.split()])
    assert code == 2 and err == "shardplan: error: cannot write /dev/full: No space left on device\n", err
    assert _is_char_device(FULL)


def test_interrupt_while_writing_leaves_no_file(capsys, tmp_path, monkeypatch):
    """Ctrl-C during export-problem's write: exit 130, neither the file nor a temporary one is left."""
    import os

    def interrupted(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    out_path = tmp_path / "p.json"
    code, _, err = run(capsys, ["export-problem", "--model", "rnnlm", "--set", "vocab=64", "--set", "hidden=16",
                                "--set", "seq=8", "--batch", "8", "-p", "2", "-o", str(out_path)])
    assert code == 130 and err == "shardplan: interrupted\n"
    assert list(tmp_path.iterdir()) == []


def test_timeline_is_written_atomically(capsys, tmp_path, monkeypatch):
    """The timeline picture goes through a temporary file too: a drawing that fails leaves nothing."""
    import shardplan.report.pipeline as rp

    argv = ["pipeline", "--model", "gpt", "--set", "layers=2", "-p", "4", "--micro-batches", "1,2"]
    real_draw = rp.draw_timeline

    def half_drawn(result, path):
        with open(path, "w") as fh:
            fh.write("partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(rp, "draw_timeline", half_drawn)
    code, _, _ = run(capsys, argv + ["--timeline", str(tmp_path / "t.png")])
    assert code == 130 and list(tmp_path.iterdir()) == []
    monkeypatch.setattr(rp, "draw_timeline", real_draw)
    code, out, err = run(capsys, argv + ["--timeline", str(tmp_path / "t.svg")])
    assert code == 0, err
    assert [p.name for p in tmp_path.iterdir()] == ["t.svg"] and (tmp_path / "t.svg").read_text().startswith("<?xml")


def test_pipeline_auto_orders_on_a_small_model_at_32_devices(capsys):
    """Auto orders give an operator more layouts in a small stage graph than in a large one: the weight-sync
    arrays cached per operator must follow (a broadcast error before)."""
    code, out, err = run(capsys, ["pipeline", "--model", "gpt", "--set", "layers=2", "-p", "32",
                                  "--micro-batches", "1,2"])
    assert code == 0, err
    assert "step time" in out or "Pipeline" in out or "stage" in out


# --------------------------------------------------------------------------- the Python API
def test_pipeline_solve_checks_its_numbers():
    from shardplan.machine import preset
    from shardplan.models import model_spec
    from shardplan.pipeline.api import pipeline_solve

    spec = model_spec("gpt")
    m = preset("h100", 4)
    for kwargs, message in [({"sizes": [0]}, "sub-mesh size must be at least 1, got 0"),
                            ({"sizes": []}, "sizes must name at least one sub-mesh size"),
                            ({"max_stages": 0}, "max_stages must be at least 1, got 0"),
                            ({"budget": float("nan")}, "budget must be a finite number, got nan"),
                            ({"budget": -1.0}, "budget must be positive"),
                            ({"micro_batches": (0,)}, "micro-batch count must be at least 1"),
                            ({"fit_time_limit": float("nan")}, "fit_time_limit must be a finite number")]:
        with pytest.raises(ShardplanError, match=message):
            pipeline_solve(lambda b: spec.build(b, layers=2), 8, m, **kwargs)


def test_fit_options_check_their_numbers():
    from shardplan.fit import FitOptions

    for kwargs, message in [({"reserve_bytes": float("nan")}, "reserve_bytes must be a finite number"),
                            ({"reserve_bytes": -1.0}, "reserve_bytes must be at least 0"),
                            ({"time_limit": 0.0}, "time_limit must be positive")]:
        with pytest.raises(ShardplanError, match=message):
            FitOptions(**kwargs)


def test_plan_refuses_micro_batches_that_do_not_divide_the_batch():
    import shardplan
    from shardplan.machine import preset

    m = preset("h100", 4)
    for kwargs, message in [({"micro_batches": [3]}, "3 micro-batches do not split the batch of 64"),
                            ({"micro_batches": [128]}, "128 micro-batches do not split the batch of 64"),
                            ({"micro_batches": []}, "micro_batches must be a non-empty sequence"),
                            ({"micro_batches": [2.5]}, "micro-batch count must be an integer"),
                            ({"budget": float("nan")}, "budget must be a finite number"),
                            ({"max_stages": 0}, "max_stages must be at least 1")]:
        with pytest.raises(ShardplanError, match=message):
            shardplan.plan("gpt", m, batch=64, sizes={"layers": 2}, **kwargs)


def test_tensor_whose_size_overflows_int64_is_refused():
    from shardplan.models import model_spec

    with pytest.raises(ShardplanError, match=r"tensor 'table' of shape .* elements, more than the cost model"):
        model_spec("gpt").build(8, layers=1, heads=1, vocab=2**40, d_model=2**26)
