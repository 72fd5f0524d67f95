"""The package's structure: which part imports which (module-level and function-level imports alike).

``python tools/structure.py`` prints the arrows between the package's parts, checks them against
:data:`LAYERS` (every arrow points down: from a later layer to an earlier one, or inside one part) and for
circles, and draws ``docs/structure.png``; ``tests/test_structure.py`` runs the same checks.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "shardplan"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "units", "checks", "table", "files"),        # words every part uses; atomic writes
    ("layout", "machine", "ir", "ops", "labels", "configs"),  # the IR and the machine
    ("models",),                                            # the zoo builds IR graphs
    ("search",),                                            # solvers on abstract problems
    ("cost",),                                              # cost tables, lowered to problems
    ("spmd",),                                              # the per-operator search of one program
    ("fit", "baselines"),                                   # memory choices; hand-made strategies
    ("pipeline",),                                          # stages
    ("result",),                                            # the Plan value
    ("planner",),                                           # the one planning call
    ("recipe",),                                            # published configurations, costed
    ("report", "bench", "calibrate"),                       # reading plans; measuring a machine
    ("jax", "torch"),                                       # engines: trace, run, pipeline executors
    ("machines",),                                          # the profiles' own scripts (measure_cpu)
    ("cli",),                                               # the command line
    ("shardplan",),                                         # the package's front door
)
"""The parts of the package from the bottom up; a part may import its own layer's other parts only when the
pair is listed in :data:`SIDEWAYS`."""

SIDEWAYS: frozenset[tuple[str, str]] = frozenset({
    ("ir", "layout"), ("ir", "checks"), ("configs", "ir"), ("configs", "layout"), ("labels", "ir"), ("ops", "ir"),
    ("machine", "checks"), ("report", "bench"), ("bench", "report"), ("checks", "errors"), ("layout", "errors"),
    ("fit", "baselines"), ("baselines", "fit"), ("table", "errors"), ("files", "errors"),
})


def part(module: str) -> str | None:
    """The part of the package a dotted module name belongs to (None outside the package)."""
    bits = module.split(".")
    if bits[0] != "shardplan":
        return None
    return bits[1] if len(bits) > 1 else "shardplan"


def _module_of(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    bits = list(rel.parts)
    return ".".join(bits[:-1] if bits[-1] == "__init__" else bits)


def imports(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (``from shardplan import ops`` names the module ``ops``)."""
    out: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        mod = _module_of(path, root)
        seen = out.setdefault(mod, set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                seen.update(a.name for a in node.names if a.name.startswith("shardplan"))
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                    and node.module.startswith("shardplan"):
                base = root.parent.joinpath(*node.module.split("."))
                for a in node.names:
                    sub = base / a.name
                    seen.add(f"{node.module}.{a.name}" if sub.with_suffix(".py").exists() or sub.is_dir()
                             else node.module)
    return out


def arrows(root: Path = ROOT) -> set[tuple[str, str]]:
    """(part, part it imports), between different parts."""
    out = set()
    for mod, targets in imports(root).items():
        for t in targets:
            a, b = part(mod), part(t)
            if a and b and a != b:
                out.add((a, b))
    return out


def rank() -> dict[str, int]:
    return {p: i for i, layer in enumerate(LAYERS) for p in layer}


def upward(edges: set[tuple[str, str]]) -> list[tuple[str, str]]:
    """Arrows that point up (or sideways without being listed), and arrows to or from a part not in LAYERS."""
    r = rank()
    bad = []
    for a, b in sorted(edges):
        if a not in r or b not in r or r[b] > r[a] or (r[b] == r[a] and (a, b) not in SIDEWAYS):
            bad.append((a, b))
    return bad


def circles(edges: set[tuple[str, str]]) -> list[list[str]]:
    import networkx as nx

    return [c for c in nx.simple_cycles(nx.DiGraph(sorted(edges)))]


def module_circles(root: Path = ROOT) -> list[list[str]]:
    """Circles between modules (inside a part too), counting function-level imports."""
    import networkx as nx

    g = nx.DiGraph()
    for mod, targets in imports(root).items():
        for t in targets:
            if t != mod and not mod.startswith(t + ".") and t != "shardplan":
                g.add_edge(mod, t)
    return [c for c in nx.simple_cycles(g)]


def draw(edges: set[tuple[str, str]], path: Path) -> None:
    """The parts by layer, bottom up, with an arrow per import."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import networkx as nx

    g = nx.DiGraph(sorted(edges))
    pos = {}
    for y, layer in enumerate(LAYERS):
        for x, p in enumerate(layer):
            g.add_node(p)
            pos[p] = (x - (len(layer) - 1) / 2, y)
    fig, ax = plt.subplots(figsize=(11, 12))
    nx.draw_networkx(g, pos, ax=ax, node_color="#dde6f0", node_size=1700, font_size=8, arrowsize=9,
                     edge_color="#8896a8", connectionstyle="arc3,rad=0.12")
    ax.set_title("shardplan: parts by layer (bottom up); every arrow is an import and points down")
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> int:
    edges = arrows()
    for a, b in sorted(edges):
        print(f"{a} -> {b}")
    bad, loops, mods = upward(edges), circles(edges), module_circles()
    print(f"upward arrows: {bad or 'none'}; circles between parts: {loops or 'none'}; "
          f"circles between modules: {mods or 'none'}")
    draw(edges, ROOT.parent / "docs" / "structure.png")
    return 1 if bad or loops or mods else 0


if __name__ == "__main__":
    sys.exit(main())
