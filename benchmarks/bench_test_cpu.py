"""CPU seconds of test files, one pytest process per file (``-n 0``), with every process it starts counted.

The gloo tests fork their processes from a multiprocessing fork server that pytest never waits for, so
``/usr/bin/time`` around pytest misses them. Here this process makes itself the child subreaper
(Linux ``prctl(PR_SET_CHILD_SUBREAPER)``): every descendant left without a parent is handed to it, it
waits for them all, and ``getrusage(RUSAGE_CHILDREN)`` then holds the user + system seconds of pytest and
of every process below it. Wall seconds depend on the load of the shared machine; CPU seconds are the
figure to compare.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_test_cpu.py tests/x/test_a.py tests/y/test_b.py \
        --label before --out benchmarks/results/test_cpu.json

Rows are appended to the JSON file (a list), one per file: label, file, user, sys, cpu, wall, exit code,
the load average at the start (``--log``: pytest's output, its slowest tests included).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import shlex
import subprocess
import sys
import time

_PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def cpu_seconds(argv: list[str]) -> dict:
    """Run ``argv`` and wait for it and every descendant; their user and system seconds and the wall time."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    while True:  # orphans handed to this subreaper (the fork server and what it forked)
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    user, sys_ = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
    return {"user": round(user, 1), "sys": round(sys_, 1), "cpu": round(user + sys_, 1), "wall": round(wall, 1),
            "rc": proc.returncode, "output": proc.stdout}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default="benchmarks/results/test_cpu.json")
    ap.add_argument("--log", default="", help="append each file's pytest output here")
    ap.add_argument("--pytest-args", default="-n 0 -p no:logging -q -p no:cacheprovider --durations=25")
    args = ap.parse_args()
    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")
    rows = json.load(open(args.out)) if os.path.exists(args.out) else []
    for f in args.files:
        load = os.getloadavg()[0]
        row = {"label": args.label, "file": f, "load": round(load, 1),
               **cpu_seconds([sys.executable, "-m", "pytest", f, *shlex.split(args.pytest_args)])}
        output = row.pop("output")
        if args.log:
            with open(args.log, "a") as fh:
                fh.write(f"==== {args.label} {f}\n{output}\n")
        print(json.dumps(row), flush=True)
        rows.append(row)
        with open(args.out, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
