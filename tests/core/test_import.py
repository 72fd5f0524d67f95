"""``import shardplan`` stays light: no heavy optional dependency is loaded until it is used."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import shardplan.search

HEAVY = ("scipy", "matplotlib", "jax", "torch", "networkx")


def test_import_loads_no_heavy_dependency() -> None:
    code = (
        "import sys, shardplan, shardplan.search, shardplan.cost, shardplan.spmd, shardplan.planner, shardplan.result\n"
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


def _module_imports(path: Path, nested: bool = False) -> set[str]:
    """The shardplan modules a file imports at module level (and inside functions if ``nested``)."""
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree) if nested else tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("shardplan"):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("shardplan"))
    return out


SEARCH = Path(shardplan.search.__file__).parent


def test_the_ilp_shares_nothing_with_the_dp_at_module_level() -> None:
    assert _module_imports(SEARCH / "ilp.py") <= {"shardplan.errors", "shardplan.search.problem"}


def test_search_modules_import_no_cycle() -> None:
    """Not even through an import inside a function (bounds used to import the DP that imports it)."""
    graph = {f"shardplan.search.{p.stem}": _module_imports(p, nested=True)
             for p in SEARCH.glob("*.py") if p.stem != "__init__"}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in graph.get(start, ()):
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    assert [m for m in graph if reaches(m, m, {m})] == []
