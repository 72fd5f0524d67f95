"""Text and JSON reports of a plan, in the style of the PaSE paper's Table II.

The strategy table groups operators that share kind, dimensions and
configuration, and names each group compactly. Dimensions are shown as
letters (``bchwnrs``) for hand-built graphs and, for traced graphs whose
operators carry labels, as ``label:extent`` (``batch:16 seq:128 out:2304
in:768``, :attr:`~shardplan.ir.Operator.dims_text`); a configuration lists
the split of each dimension in that order.

* vertex names are ``module/layer`` (``A1/branch3x3dbl_2``) or plain
  (``conv3``); a module's *family* is its name without the trailing counter
  (``A1`` -> ``A``, ``res4.22`` -> ``res4``, ``enc3`` -> ``enc``);
* a module is *whole* in a group when every operator of the group's kind
  and dims in that module is in the group; when a group spans more than two
  layer names, whole modules are listed by module, and a family all of whose
  modules are whole by the family; otherwise operators are listed by layer;
* runs of three or more consecutive counters collapse into ranges:
  ``conv1, conv2, conv3, conv4`` -> ``conv1–4``, ``A, B, C, D`` -> ``A–D``,
  ``enc1 .. enc6`` -> ``enc1–6``; operators of modules that are not whole
  are listed by layer (``enc1–6/q``, ``{E1, E2}/branch1x1``); the parts of
  a title are separated by semicolons.

Traced graphs have deep name scopes
(``FlaxGPT2LMHeadModule/transformer/h/0/attn/c_attn/dot_general``): when
an operator name has three or more ``/``-separated parts, a group is named
by its members' scopes with the numeric parts that vary collapsed
(``…/h/0–11/attn/c_attn/dot_general``), and a title too long for the table
keeps its end (the layer) rather than its start.

Then the predicted step time and its breakdown, memory per device and the
speedups over the baselines given.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from shardplan.layout import Layout
from shardplan.spmd import SpmdPlan
from shardplan.table import format_table
from shardplan.search.io import jsonable

__all__ = ["Group", "group_operators", "compress_names", "scope_title", "render_strategy", "plan_to_json"]


@dataclass(frozen=True)
class Group:
    """Operators reported on one line: same kind, dims and configuration."""

    title: str
    kind: str
    label: str
    config: tuple[int, ...]
    members: tuple[str, ...]
    layout: Layout | None = None

    @property
    def size(self) -> int:
        return len(self.members)


_COUNTER = re.compile(r"^(.*?)(\d+)$")
_LETTER = re.compile(r"^(.*?)([A-Z])$")


def _parse(token: str) -> tuple[str, str, int | None]:
    """(prefix, counter type, counter): ``conv12`` -> ("conv", "n", 12), ``D`` -> ("", "a", 3)."""
    m = _COUNTER.match(token)
    if m:
        return m.group(1), "n", int(m.group(2))
    m = _LETTER.match(token)
    if m:
        return m.group(1), "a", ord(m.group(2)) - ord("A")
    return token, "", None


def compress_names(tokens: Sequence[str], min_run: int = 3) -> str:
    """Join names, collapsing runs of ``min_run`` or more consecutive counters into ranges.

    >>> compress_names(["conv1", "conv2", "conv3", "conv4", "fc1", "fc3"])
    'conv1–4, fc1, fc3'
    >>> compress_names(["A", "B", "C", "D"])
    'A–D'
    """
    out: list[str] = []
    run: list[str] = []
    prev: tuple[str, str, int | None] | None = None

    def flush() -> None:
        if len(run) >= min_run:
            pre, typ, _ = _parse(run[0])
            last = _parse(run[-1])[2]
            end = str(last) if typ == "n" else chr(ord("A") + int(last or 0))
            out.append(f"{run[0]}–{end}")
        else:
            out.extend(run)
        run.clear()

    for t in tokens:
        cur = _parse(t)
        if (prev is not None and cur[2] is not None and prev[2] is not None and cur[:2] == prev[:2]
                and cur[2] == prev[2] + 1):
            run.append(t)
        else:
            flush()
            run.append(t)
        prev = cur
    flush()
    return ", ".join(out)


def _split(name: str) -> tuple[str | None, str]:
    if "/" in name:
        mod, layer = name.split("/", 1)
        return mod, layer
    return None, name


def _family(module: str) -> str:
    m = re.match(r"^(.*?)(\d+)$", module)
    if m and m.group(1):
        return m.group(1).rstrip(".")
    return module


def _title(members: Sequence[str], key: tuple[str, str], plan: SpmdPlan) -> str:
    """A compact name for ``members`` (all of one (kind, dims) ``key``)."""
    g = plan.graph
    by_module: dict[str, list[str]] = {}
    plain: list[str] = []
    for name in members:
        mod, _ = _split(name)
        if mod is None:
            plain.append(name)
        else:
            by_module.setdefault(mod, []).append(name)
    # operators of this (kind, dims) per module, and each family's modules in graph order
    key_count: dict[str, int] = {}
    modules_of_family: dict[str, list[str]] = {}
    for op in g.operators:
        mod, _ = _split(op.name)
        if mod is None:
            continue
        fam = _family(mod)
        if mod not in modules_of_family.setdefault(fam, []):
            modules_of_family[fam].append(mod)
        if (op.kind, op.dims_text) == key:
            key_count[mod] = key_count.get(mod, 0) + 1
    layers = {_split(n)[1] for names in by_module.values() for n in names}
    whole = [m for m, names in by_module.items() if len(names) == key_count.get(m, -1)] if len(layers) > 2 else []
    whole_set = set(whole)
    parts: list[str] = []
    if whole:
        tokens: list[str] = []
        done: set[str] = set()
        for m in whole:
            fam = _family(m)
            if fam in done:
                continue
            if all(x in whole_set for x in modules_of_family[fam]):
                tokens.append(fam)
                done.add(fam)
            else:
                tokens.append(m)
        parts.append(("modules " if len(whole) > 1 else "module ") + compress_names(tokens))
    # operators of modules that are not whole: by family and layer name
    by_layer: dict[tuple[str, str], list[str]] = {}
    for m, names in by_module.items():
        if m in whole_set:
            continue
        for n in names:
            by_layer.setdefault((_family(m), _split(n)[1]), []).append(m)
    for (_, layer), mods in by_layer.items():
        who = compress_names(mods)
        parts.append(f"{{{who}}}/{layer}" if ", " in who else f"{who}/{layer}")
    if plain:
        parts.append(compress_names(plain))
    return "; ".join(parts)


def _runs(values: Sequence[int]) -> str:
    """``[0, 1, 2, 3]`` -> ``0–3``; ``[0, 2]`` -> ``{0, 2}``; ``[5]`` -> ``5``;
    ``[1, 2, 3, 5, 7, 8, 9]`` -> ``{1–3, 5, 7–9}`` (runs of three or more as ranges)."""
    vals = sorted(set(values))
    if len(vals) == 1:
        return str(vals[0])
    if vals == list(range(vals[0], vals[-1] + 1)) and len(vals) >= 2:
        return f"{vals[0]}–{vals[-1]}"
    runs: list[list[int]] = []
    for v in vals:
        if runs and v == runs[-1][-1] + 1:
            runs[-1].append(v)
        else:
            runs.append([v])
    parts = [f"{r[0]}–{r[-1]}" if len(r) >= 3 else ", ".join(map(str, r)) for r in runs]
    return "{" + ", ".join(parts) + "}"


def scope_title(members: Sequence[str]) -> str:
    """Scoped names with the trailing counters of their parts collapsed (and unique-name suffixes dropped).

    >>> scope_title(["m/h/0/attn/dot_general", "m/h/1/attn/dot_general", "m/lm_head/dot_general"])
    'm/h/0–1/attn/dot_general; m/lm_head/dot_general'
    >>> scope_title(["Net/scan0/Dense_0/add", "Net/scan1/Dense_0/add", "Net/scan3/Dense_0/add"])
    'Net/scan{0, 1, 3}/Dense_0/add'
    """
    patterns: dict[tuple[str, ...], list[list[str]]] = {}
    for name in members:
        parts = name.split("/")
        parts[-1] = re.sub(r"(?<=[^_\d])_\d+$", "", parts[-1])  # ``reshape_3`` (a unique-name suffix): ``reshape``
        key = tuple(_COUNTER.sub(r"\1#", p) for p in parts)
        patterns.setdefault(key, []).append(parts)
    out = []
    for key, names in patterns.items():
        shown = [k[:-1] + _runs([int(_COUNTER.match(n[i]).group(2)) for n in names]) if k.endswith("#") else k
                 for i, k in enumerate(key)]
        out.append("/".join(shown))
    return "; ".join(out)


def group_operators(plan: SpmdPlan) -> list[Group]:
    """Operators grouped by (kind, dims, layout), in order of first appearance."""
    keyed: dict[tuple[str, str, Layout], list[str]] = {}
    lays = plan.layouts
    deep = any(op.name.count("/") >= 2 for op in plan.graph.operators)
    for op in plan.graph.operators:
        key = (op.kind, op.dims_text, lays[op.name])
        keyed.setdefault(key, []).append(op.name)
    return [Group(scope_title(names) if deep else _title(names, (kind, label), plan), kind, label, lay.split,
                  tuple(names), lay)
            for (kind, label, lay), names in keyed.items()]


def _cfg(c: Sequence[int]) -> str:
    return "(" + ",".join(str(x) for x in c) + ")"


def render_strategy(plan: SpmdPlan, max_title: int = 60) -> str:
    """The Table II-style strategy table of ``plan`` (one line per group)."""
    rows = []
    for grp in group_operators(plan):
        title = grp.title if len(grp.title) <= max_title else "…" + grp.title[-(max_title - 1):]
        shown = grp.layout.describe() if grp.layout is not None else _cfg(grp.config)
        rows.append((title, grp.kind, grp.label, shown, grp.size))
    return format_table(rows, ("layers", "kind", "dims", "configuration", "ops"))


def plan_to_json(plan: SpmdPlan, baselines: Mapping[str, SpmdPlan] | None = None) -> dict[str, Any]:
    """``plan.to_dict()`` plus the report's groups and each baseline's cost, breakdown and speedup."""
    d = plan.to_dict()
    d["groups"] = [{"title": g.title, "kind": g.kind, "dims": g.label, "config": list(g.config),
                    "members": list(g.members)} for g in group_operators(plan)]
    if baselines:
        d["baselines"] = {
            name: {"cost_seconds": b.cost, "breakdown": b.breakdown, "memory": b.memory,
                   "speedup": (b.cost / plan.cost) if plan.cost > 0 else None,
                   "configs": {k: list(v) for k, v in b.configs.items()}}
            for name, b in baselines.items()
        }
    return jsonable(d)
