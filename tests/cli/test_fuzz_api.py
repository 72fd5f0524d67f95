"""Fuzzing the Python API: every call ends in a right answer (checked here) or one one-line ShardplanError.

``shardplan.plan`` and ``shardplan.solve`` on tiny zoo models of random sizes and random machines, with
random and boundary argument values (None, 0, negative, NaN, inf, huge, wrong types); ``Plan.from_json``
on a real plan's JSON mangled (a value replaced, a key dropped, the text cut or a byte changed);
``Recipe.parse`` on random text; ``Machine`` on random fields. Nothing else may escape: no other exception
type, no message over one line.
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardplan
from shardplan.errors import ShardplanError
from shardplan.machine import Machine, preset
from shardplan.recipe import Recipe
from shardplan.result import Plan

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

ODD = st.sampled_from([None, 0, -1, 1, 2, 3, 4, 8, 2.5, float("nan"), float("inf"), -float("inf"), 10**30, 2**63,
                       True, "4", [], [0], [3], [1, 2], (), {}, 1e-300])
SMALL_MODELS = {
    "rnnlm": {"vocab": 64, "hidden": 16, "seq": 8},
    "gpt": {"layers": 1, "d_model": 64, "heads": 2, "vocab": 128, "seq": 16},
}
SIZE_VALUES = st.sampled_from([0, -1, 1, 2, 3, 7, 2**40, 2**41, 2.5, "x", None])


def _one_line(e: ShardplanError) -> None:
    text = str(e)
    assert text and "\n" not in text, text


@st.composite
def machines(draw) -> Machine:
    p = draw(st.sampled_from([1, 2, 4]))
    if draw(st.booleans()):
        return preset(draw(st.sampled_from(["paper", "h100", "a100"])), p)
    fields = {"peak_flops": 1e12, "bandwidth": 1e10, "memory_bytes": 2.0**34}
    for key in draw(st.lists(st.sampled_from(["peak_flops", "bandwidth", "latency", "memory_bytes", "dtype_bytes",
                                              "node_size"]), max_size=2)):
        fields[key] = draw(ODD)
    return Machine(p, **fields)


@st.composite
def models(draw) -> tuple[str, dict]:
    name = draw(st.sampled_from(sorted(SMALL_MODELS)))
    sizes = dict(SMALL_MODELS[name])
    for key in draw(st.lists(st.sampled_from(sorted(sizes)), max_size=1)):
        sizes[key] = draw(SIZE_VALUES)
    return name, sizes


def _check_plan(result: Plan) -> None:
    assert math.isfinite(result.step_time) and result.step_time > 0
    again = Plan.from_json(result.to_json())
    assert again.step_time == pytest.approx(result.step_time, rel=1e-12)


@SETTINGS
@given(data=st.data())
def test_fuzz_plan(data) -> None:
    kwargs = {}
    for key in data.draw(st.lists(st.sampled_from(["batch", "budget", "micro_batches", "max_stages", "cutoff",
                                                   "stages", "fit", "orders", "interleave"]), max_size=3)):
        kwargs[key] = data.draw(ODD | st.sampled_from(["auto", "all", "row-major", "nope"]))
    try:
        machine = data.draw(machines())
        name, sizes = data.draw(models())
        result = shardplan.plan(name, machine, sizes=sizes, **kwargs)
    except ShardplanError as e:
        _one_line(e)
        return
    _check_plan(result)
    if kwargs.get("micro_batches") not in (None,) and result.micro_batches:
        assert result.micro_batches in tuple(kwargs["micro_batches"])


@SETTINGS
@given(data=st.data())
def test_fuzz_solve(data) -> None:
    kwargs = {}
    for key in data.draw(st.lists(st.sampled_from(["cutoff", "orders", "solver", "divides_p", "powers_of_two"]),
                                  max_size=2)):
        kwargs[key] = data.draw(ODD | st.sampled_from(["dp", "ilp", "mcmc", "auto", "x"]))
    try:
        machine = data.draw(machines())
        name, sizes = data.draw(models())
        from shardplan.models import model_spec

        graph = model_spec(name).build(8, **sizes)
        sp = shardplan.solve(graph, machine, **kwargs)
    except ShardplanError as e:
        _one_line(e)
        return
    assert math.isfinite(sp.cost) and sp.cost > 0
    assert sp.cost == pytest.approx(sp.tables.to_problem().evaluate(sp.assignment), rel=1e-9)


def _valid_plan_json() -> str:
    return shardplan.plan("gpt", preset("h100", 2), sizes=SMALL_MODELS["gpt"], batch=8).to_json()


PLAN_JSON = None


def _paths(node, prefix=()):
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in items:
        yield prefix + (key,)
        yield from _paths(child, prefix + (key,))


JSON_VALUES = st.none() | st.booleans() | st.integers(-2, 2**70) | st.floats() | st.text(max_size=4) | \
    st.lists(st.integers(), max_size=2) | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)


@SETTINGS
@given(data=st.data())
def test_fuzz_plan_from_json(data) -> None:
    global PLAN_JSON
    if PLAN_JSON is None:
        PLAN_JSON = _valid_plan_json()
    text = PLAN_JSON
    kind = data.draw(st.sampled_from(["replace", "replace", "delete", "truncate", "byte"]))
    if kind in ("truncate", "byte"):
        i = data.draw(st.integers(0, len(text) - 1))
        text = text[:i] if kind == "truncate" else text[:i] + data.draw(st.characters(codec="utf-8")) + text[i + 1:]
    else:
        d = json.loads(text)
        path = data.draw(st.sampled_from(list(_paths(d))))
        parent = d
        for key in path[:-1]:
            parent = parent[key]
        if kind == "delete":
            del parent[path[-1]]
        else:
            parent[path[-1]] = data.draw(JSON_VALUES)
        text = json.dumps(d)
    try:
        result = Plan.from_json(text)
    except ShardplanError as e:
        _one_line(e)
        return
    assert isinstance(result, Plan)
    assert math.isfinite(result.step_time) and result.step_time > 0 and result.micro_batches >= 1
    again = Plan.from_json(result.to_json())  # what was accepted writes itself out and loads again
    assert again.step_time == result.step_time


@SETTINGS
@given(text=st.text(max_size=30) | st.lists(st.sampled_from(
    ["tp=2", "pp=2", "dp=2", "mbs=4", "gbs=64", "zero=3", "fsdp", "sp", "recompute=full", "tp=0", "tp=-1", "tp=nan",
     "mbs=1e3", "=", "tp", "vp=2", "overlap=tp+dp", "overlap=none", "ep=2", "dtype=bf16", "dtype=x", " ", ",,"]),
    max_size=5).map(",".join))
def test_fuzz_recipe_parse(text) -> None:
    try:
        recipe = Recipe.parse(text)
    except ShardplanError as e:
        _one_line(e)
        return
    assert Recipe.parse(str(recipe)) == recipe


@SETTINGS
@given(data=st.data())
def test_fuzz_machine(data) -> None:
    fields = {key: data.draw(ODD) for key in data.draw(st.lists(st.sampled_from(
        ["num_devices", "peak_flops", "bandwidth", "latency", "dtype_bytes", "memory_bytes", "node_size",
         "inter_bandwidth", "inter_latency"]), max_size=3, unique=True))}
    fields.setdefault("num_devices", 2)
    try:
        m = Machine(**fields)
    except ShardplanError as e:
        _one_line(e)
        return
    assert m.num_devices >= 1 and math.isfinite(m.peak_flops) and m.peak_flops > 0


@pytest.mark.parametrize("path,value", [(("stages", 0, "memory"), None), (("step_time_seconds",), float("nan")),
                                        (("step_time_seconds",), -1.0), (("micro_batches",), 0),
                                        (("micro_batches",), 1e400), (("stages", 0, "units"), None),
                                        (("machine",), [])])
def test_plan_from_json_refuses_mangled_fields_in_one_line(path, value):
    global PLAN_JSON
    if PLAN_JSON is None:
        PLAN_JSON = _valid_plan_json()
    d = json.loads(PLAN_JSON)
    parent = d
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    with pytest.raises(ShardplanError) as e:
        Plan.from_json(json.dumps(d))
    _one_line(e.value)


@pytest.mark.slow
@settings(SETTINGS, max_examples=250)
@given(data=st.data())
def test_fuzz_plan_long(data) -> None:
    test_fuzz_plan.hypothesis.inner_test(data)


@pytest.mark.slow
@settings(SETTINGS, max_examples=250)
@given(data=st.data())
def test_fuzz_solve_long(data) -> None:
    test_fuzz_solve.hypothesis.inner_test(data)
