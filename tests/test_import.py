"""``import shardplan`` stays light: no heavy optional dependency is loaded until it is used."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("scipy", "matplotlib", "jax", "torch", "networkx")


def test_import_loads_no_heavy_dependency() -> None:
    code = (
        "import sys, shardplan, shardplan.search, shardplan.cost, shardplan.plan\n"
        f"print(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == []


def test_the_ilp_still_imports_scipy_when_it_solves() -> None:
    code = (
        "import sys\n"
        "from shardplan.search import Problem, solve_ilp\n"
        "p = Problem(names=('a',), configs=(((0,), (1,)),), vertex_cost=([2.0, 1.0],), edges=(), edge_cost=())\n"
        "print(solve_ilp(p).cost, 'scipy' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1.0", "True"]
