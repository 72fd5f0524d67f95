"""Problem files (JSON) and solution dictionaries.

A problem file is one JSON object::

    {"format": "shardplan-problem/1",
     "vertices": [{"name": str, "configs": [[int, ...], ...], "cost": [float, ...],
                   "dims": [str, ...]  (optional)}, ...],
     "edges": [{"src": str, "dst": str, "cost": [[float, ...], ...]}, ...]}

``cost`` of a vertex has one entry per configuration; the cost of an edge is a
K_src × K_dst matrix. Every malformed entry raises :class:`ShardplanError`
with a one-line message naming it, e.g.
``edges[3] (conv1 -> pool1): cost matrix has 4 rows, expected 6``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import IO, Any

import numpy as np

from shardplan.errors import ShardplanError
from shardplan.search.problem import Problem, Solution

__all__ = ["FORMAT", "load_problem", "parse_problem_text", "save_problem", "problem_to_dict", "problem_from_dict",
           "solution_to_dict",
           "jsonable"]

FORMAT = "shardplan-problem/1"


def problem_to_dict(problem: Problem) -> dict:
    """The JSON-ready dictionary of ``problem`` (format shardplan-problem/1)."""
    vertices = []
    for v, name in enumerate(problem.names):
        entry: dict[str, Any] = {
            "name": name,
            "configs": [list(c) for c in problem.configs[v]],
            "cost": [float(x) for x in problem.vertex_cost[v]],
        }
        if problem.dims is not None:
            entry["dims"] = list(problem.dims[v])
        vertices.append(entry)
    edges = [
        {"src": problem.names[s], "dst": problem.names[d], "cost": [[float(x) for x in row] for row in m]}
        for (s, d), m in zip(problem.edges, problem.edge_cost)
    ]
    return {"format": FORMAT, "vertices": vertices, "edges": edges}


_FLOAT_MAX_INT = int(np.finfo(np.float64).max)
MAX_INT_DIGITS = 400  # longer integer literals are refused while parsing (a float64 has at most 309 digits)


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 60 else f"{text[:40]}... ({len(text)} characters)"


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _cost_vector(where: str, raw: Any, k: int) -> list[float]:
    if not isinstance(raw, list):
        raise ShardplanError(f"{where}: cost must be a list of numbers, got {type(raw).__name__}")
    if len(raw) != k:
        raise ShardplanError(f"{where}: cost has {len(raw)} entries, expected {k} (one per config)")
    for j, x in enumerate(raw):
        if not _is_number(x):
            raise ShardplanError(f"{where}: cost[{j}] is not a number ({_short(x)})")
        if isinstance(x, int) and abs(x) > _FLOAT_MAX_INT:
            raise ShardplanError(f"{where}: cost[{j}] is an integer of {len(str(abs(x)))} digits, "
                                 "too large for a float64 cost")
        if math.isnan(x) or math.isinf(x):
            raise ShardplanError(f"{where}: cost[{j}] is {x!r}, costs must be finite")
        if x < 0:
            raise ShardplanError(f"{where}: cost[{j}] is negative ({x!r})")
    return [float(x) for x in raw]


def _require(where: str, obj: Any, key: str) -> Any:
    if key not in obj:
        raise ShardplanError(f"{where}: missing key {key!r}")
    return obj[key]


def problem_from_dict(data: Any) -> Problem:
    """Validate a decoded problem file and build the :class:`Problem`."""
    if not isinstance(data, dict):
        raise ShardplanError(f"problem file: top level must be a JSON object, got {type(data).__name__}")
    fmt = _require("problem file", data, "format")
    if fmt != FORMAT:
        raise ShardplanError(f"problem file: format is {_short(fmt)}, expected {FORMAT!r}")
    raw_vertices = _require("problem file", data, "vertices")
    raw_edges = _require("problem file", data, "edges")
    if not isinstance(raw_vertices, list):
        raise ShardplanError("problem file: 'vertices' must be a list")
    if not isinstance(raw_edges, list):
        raise ShardplanError("problem file: 'edges' must be a list")
    names: list[str] = []
    configs: list[list[tuple[int, ...]]] = []
    costs: list[list[float]] = []
    dims: list[tuple[str, ...]] = []  # () where a vertex gives none
    index: dict[str, int] = {}
    for i, rv in enumerate(raw_vertices):
        where = f"vertices[{i}]"
        if not isinstance(rv, dict):
            raise ShardplanError(f"{where}: must be an object, got {type(rv).__name__}")
        name = _require(where, rv, "name")
        if not isinstance(name, str):
            raise ShardplanError(f"{where}: name must be a string, got {_short(name)}")
        where = f"vertices[{i}] ({name})"
        if name in index:
            raise ShardplanError(f"{where}: duplicate vertex name (also vertices[{index[name]}])")
        raw_cfgs = _require(where, rv, "configs")
        if not isinstance(raw_cfgs, list) or not raw_cfgs:
            raise ShardplanError(f"{where}: configs must be a non-empty list of integer lists")
        cfgs = []
        for j, c in enumerate(raw_cfgs):
            if not isinstance(c, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in c):
                raise ShardplanError(f"{where}: configs[{j}] must be a list of integers, got {_short(c)}")
            cfgs.append(tuple(c))
        cost = _cost_vector(where, _require(where, rv, "cost"), len(cfgs))
        if "dims" in rv:
            d = rv["dims"]
            if not isinstance(d, list) or not all(isinstance(x, str) for x in d):
                raise ShardplanError(f"{where}: dims must be a list of strings, got {_short(d)}")
            dims.append(tuple(d))
        else:
            dims.append(())
        index[name] = i
        names.append(name)
        configs.append(cfgs)
        costs.append(cost)
    edges: list[tuple[int, int]] = []
    mats: list[np.ndarray] = []
    for i, re_ in enumerate(raw_edges):
        where = f"edges[{i}]"
        if not isinstance(re_, dict):
            raise ShardplanError(f"{where}: must be an object, got {type(re_).__name__}")
        src, dst = _require(where, re_, "src"), _require(where, re_, "dst")
        for end in (src, dst):
            if not isinstance(end, str):
                raise ShardplanError(f"{where}: src and dst must be vertex names, got {_short(end)}")
        where = f"edges[{i}] ({src} -> {dst})"
        for end in (src, dst):
            if end not in index:
                raise ShardplanError(f"{where}: unknown vertex {end!r}")
        if src == dst:
            raise ShardplanError(f"{where}: edge from a vertex to itself")
        s, d = index[src], index[dst]
        ks, kd = len(configs[s]), len(configs[d])
        raw = _require(where, re_, "cost")
        if not isinstance(raw, list):
            raise ShardplanError(f"{where}: cost must be a list of rows, got {type(raw).__name__}")
        if len(raw) != ks:
            raise ShardplanError(f"{where}: cost matrix has {len(raw)} rows, expected {ks}")
        rows = []
        for r, row in enumerate(raw):
            if not isinstance(row, list):
                raise ShardplanError(f"{where}: cost row {r} must be a list, got {type(row).__name__}")
            if len(row) != kd:
                raise ShardplanError(f"{where}: cost row {r} has {len(row)} columns, expected {kd}")
            rows.append(_cost_vector(f"{where} row {r}", row, kd))
        edges.append((s, d))
        mats.append(np.array(rows, dtype=np.float64).reshape(ks, kd))
    return Problem(
        names=tuple(names),
        configs=tuple(tuple(c) for c in configs),
        vertex_cost=tuple(np.array(c) for c in costs),
        edges=tuple(edges),
        edge_cost=tuple(mats),
        dims=tuple(dims) if any(dims) else None,
    )


def _decode(label: str, raw: bytes) -> str:
    """The text of a problem file: UTF-8 (RFC 8259), a leading byte-order mark allowed."""
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise ShardplanError(f"problem file {label}: UTF-16 or UTF-32 text (byte-order mark); problem files are "
                             "UTF-8 JSON")
    if b"\x00" in raw:
        raise ShardplanError(f"problem file {label}: holds NUL bytes at offset {raw.index(0)} (a binary file, or "
                             "UTF-16/UTF-32 text); problem files are UTF-8 JSON")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ShardplanError(f"problem file {label}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset "
                             f"{exc.start}); problem files are UTF-8 JSON") from None


def _parse_int(text: str) -> int:
    """json's integer hook: refuse absurdly long literals before Python converts them (quadratic time)."""
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise ShardplanError(f"an integer of {digits} digits; numbers longer than {MAX_INT_DIGITS} digits "
                             "cannot be costs or configurations")
    return int(text)


def parse_problem_text(text: str, label: str = "<text>") -> Problem:
    """Parse and validate the JSON text of a problem file; ``label`` names it in error messages."""
    try:
        data = json.loads(text, parse_int=_parse_int)
    except json.JSONDecodeError as exc:
        raise ShardplanError(f"problem file {label}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except RecursionError:
        raise ShardplanError(f"problem file {label}: JSON nested too deeply (a problem file has at most "
                             "5 levels)") from None
    except ShardplanError as exc:
        raise ShardplanError(f"problem file {label}: {exc}") from None
    return problem_from_dict(data)


def load_problem(source: str | Path | IO[str] | IO[bytes]) -> Problem:
    """Read a problem file from a path or an open (text or binary) file."""
    label = getattr(source, "name", str(source))
    try:
        if hasattr(source, "read"):
            content = source.read()  # type: ignore[union-attr]
        else:
            with open(source, "rb") as fh:
                content = fh.read()
    except OSError as exc:
        raise ShardplanError(f"problem file {label}: cannot read ({exc.strerror})") from None
    except UnicodeDecodeError as exc:  # a file opened in text mode holding something else
        raise ShardplanError(f"problem file {label}: not valid text ({exc.reason})") from None
    text = _decode(label, content) if isinstance(content, bytes) else content
    return parse_problem_text(text, label)


def save_problem(problem: Problem, path: str | Path) -> None:
    """Write ``problem`` as a shardplan-problem/1 JSON file, atomically (:func:`shardplan.files.write_text`)."""
    from shardplan.files import write_text

    write_text(str(path), json.dumps(problem_to_dict(problem)))


def solution_to_dict(problem: Problem, solution: Solution) -> dict:
    """JSON-ready dictionary of a solution, keyed by vertex names."""
    return {
        "cost": float(solution.cost),
        "assignment": {name: int(a) for name, a in zip(problem.names, solution.assignment)},
        "configs": {name: list(problem.configs[v][a]) for v, (name, a) in
                    enumerate(zip(problem.names, solution.assignment))},
        "solve_seconds": float(solution.solve_seconds),
        "solver": solution.solver,
        "optimal": bool(solution.optimal),
        "stats": jsonable(solution.stats),
    }


def jsonable(x: Any) -> Any:
    """``x`` with numpy scalars turned into Python numbers and tuples into lists, for ``json.dumps``."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    return x
