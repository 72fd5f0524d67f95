"""The package's structure: every import points down its layers, and nothing imports in a circle."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "structure.py"


def _tool():
    spec = importlib.util.spec_from_file_location("structure_tool", TOOL)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_every_part_is_in_a_layer_and_imports_only_downward():
    st = _tool()
    edges = st.arrows()
    parts = {p for e in edges for p in e}
    assert parts <= set(st.rank()), f"parts missing from LAYERS: {sorted(parts - set(st.rank()))}"
    assert st.upward(edges) == []


def test_no_circles_between_parts_or_modules():
    st = _tool()
    assert st.circles(st.arrows()) == []
    assert st.module_circles() == []


def test_the_check_sees_an_upward_import(tmp_path):
    st = _tool()
    pkg = tmp_path / "shardplan"
    (pkg / "cost").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("from shardplan.cost import x\n")
    (pkg / "cost" / "__init__.py").write_text("def f():\n    from shardplan import errors\n")
    edges = st.arrows(pkg)
    assert edges == {("errors", "cost"), ("cost", "errors")}
    assert ("errors", "cost") in st.upward(edges) and st.circles(edges)
    assert st.module_circles(pkg)
