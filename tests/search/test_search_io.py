"""Problem files: round trip and one ShardplanError per malformed case."""

from __future__ import annotations

import copy
import io
import json

import pytest

from randgraphs import random_problem
from shardplan.errors import ShardplanError
from shardplan.search import load_problem, save_problem, solve_bruteforce, solve_dp
from shardplan.search.io import problem_from_dict, problem_to_dict, solution_to_dict


@pytest.mark.parametrize("seed", range(20))
def test_round_trip(tmp_path, seed: int) -> None:
    p = random_problem(seed)
    path = tmp_path / "p.json"
    save_problem(p, path)
    q = load_problem(path)
    assert q.names == p.names and q.configs == p.configs and q.edges == p.edges
    assert solve_dp(q).cost == pytest.approx(solve_bruteforce(p).cost, rel=1e-12, abs=1e-12)
    with open(path) as fh:
        assert load_problem(fh).names == p.names


def test_solution_dict() -> None:
    p = random_problem(4)
    s = solve_dp(p)
    d = solution_to_dict(p, s)
    json.dumps(d)
    assert d["cost"] == s.cost and d["solver"] == "dp" and d["optimal"] is True
    assert set(d["assignment"]) == set(p.names)
    for v, name in enumerate(p.names):
        assert d["configs"][name] == list(p.configs[v][s.assignment[v]])
    assert d["solve_seconds"] >= 0 and "stats" in d


BASE = {
    "format": "shardplan-problem/1",
    "vertices": [
        {"name": "conv1", "configs": [[1], [2]], "cost": [1.0, 2.0]},
        {"name": "pool1", "configs": [[1], [2], [4]], "cost": [0, 1, 2], "dims": ["b"]},
    ],
    "edges": [{"src": "conv1", "dst": "pool1", "cost": [[0, 1, 2], [1, 0, 1]]}],
}


def mutate(path: tuple, value) -> dict:
    d = copy.deepcopy(BASE)
    obj = d
    for key in path[:-1]:
        obj = obj[key]
    if value is DELETE:
        del obj[path[-1]]
    else:
        obj[path[-1]] = value
    return d


DELETE = object()

BAD = [
    (("format",), "shardplan-problem/9", "format"),
    (("format",), DELETE, "missing key 'format'"),
    (("vertices",), DELETE, "missing key 'vertices'"),
    (("edges",), {"a": 1}, "'edges' must be a list"),
    (("vertices", 0, "name"), 3, r"vertices\[0\]: name must be a string"),
    (("vertices", 1, "name"), "conv1", r"vertices\[1\] \(conv1\): duplicate"),
    (("vertices", 0, "configs"), [], r"vertices\[0\] \(conv1\): configs"),
    (("vertices", 0, "configs"), [[1], ["x"]], r"vertices\[0\] \(conv1\): configs\[1\]"),
    (("vertices", 0, "cost"), DELETE, r"vertices\[0\] \(conv1\): missing key 'cost'"),
    (("vertices", 0, "cost"), [1.0], r"vertices\[0\] \(conv1\): cost has 1 entries, expected 2"),
    (("vertices", 0, "cost"), [1.0, -2.0], r"vertices\[0\] \(conv1\): cost\[1\] is negative"),
    (("vertices", 0, "cost"), [1.0, float("nan")], r"vertices\[0\] \(conv1\): cost\[1\] is nan"),
    (("vertices", 0, "cost"), [1.0, "a"], r"vertices\[0\] \(conv1\): cost\[1\] is not a number"),
    (("vertices", 1, "dims"), "b", r"vertices\[1\] \(pool1\): dims"),
    (("edges", 0, "src"), "conv9", r"edges\[0\] \(conv9 -> pool1\): unknown vertex 'conv9'"),
    (("edges", 0, "dst"), DELETE, r"edges\[0\]: missing key 'dst'"),
    (("edges", 0, "dst"), "conv1", r"edges\[0\] \(conv1 -> conv1\): edge from a vertex to itself"),
    (("edges", 0, "cost"), [[0, 1, 2]], r"edges\[0\] \(conv1 -> pool1\): cost matrix has 1 rows, expected 2"),
    (("edges", 0, "cost"), [[0, 1], [1, 0]], r"edges\[0\] \(conv1 -> pool1\): cost row 0 has 2 columns, expected 3"),
    (("edges", 0, "cost"), [[0, 1, 2], [1, float("inf"), 1]], r"edges\[0\] \(conv1 -> pool1\) row 1: cost\[1\]"),
    (("edges", 0, "cost"), [[0, 1, 2], [1, -1, 1]], r"edges\[0\] \(conv1 -> pool1\) row 1: cost\[1\] is negative"),
    (("edges", 0, "cost"), "x", r"edges\[0\] \(conv1 -> pool1\): cost must be a list"),
    (("edges", 0), 5, r"edges\[0\]: must be an object"),
]


def test_base_is_valid() -> None:
    p = problem_from_dict(BASE)
    assert p.names == ("conv1", "pool1")
    assert problem_from_dict(problem_to_dict(p)).configs == p.configs


@pytest.mark.parametrize("path,value,message", BAD)
def test_malformed(path, value, message) -> None:
    text = json.dumps(mutate(path, value))
    with pytest.raises(ShardplanError, match=message) as exc:
        load_problem(io.StringIO(text))
    assert "\n" not in str(exc.value)


def test_not_json(tmp_path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ShardplanError, match="not valid JSON"):
        load_problem(bad)
    with pytest.raises(ShardplanError, match="cannot read"):
        load_problem(tmp_path / "missing.json")
    with pytest.raises(ShardplanError, match="top level"):
        load_problem(io.StringIO("[1, 2]"))
