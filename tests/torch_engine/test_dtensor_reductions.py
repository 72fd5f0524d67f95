"""What DTensor sends for partial sums, against what the PyTorch path's tables charge: 4 gloo processes.

``shardplan.torch`` plans on :func:`shardplan.torch.device.dtensor_machine`: a partial sum over several split
dims is one all-reduce per dim among that dim's devices (``Machine.reduce_per_dim``), the all-gathered
attention's key/value gradients a reduce-scatter home (``Machine.scatter_gathered_grads``). The run sends that:
it flattens the mesh axes of every dim a layout splits over several axes (:func:`shardplan.torch.run.flat_groups`:
DTensor then reduces over them in one collective) and reduces a partial sum one dim at a time
(:func:`shardplan.torch.run.reduce_steps`). Each case runs one forward and backward pass of hand-laid layouts
under a dispatch mode recording every collective on the local tensors (kind, group size, elements):

* ``k4``: a linear whose contraction is split 4 ways over both axes of a 2 x 2 mesh (the next operator
  splits the batch 2 ways): its output's partial sums, one all-reduce among 4 (DTensor's default, one per
  mesh axis, would be two of 2: 4/3 of the bytes);
* ``b4``: the linear data parallel 4 ways on the same mesh: its weight's gradient, one all-reduce among 4;
* ``b2s2``: batch and sequence split 2 ways each: the weight's gradient sums over both, one all-reduce of 2
  per dim (not the PaSE model's one among 4);
* ``mixed``: as ``b2s2`` beside an operator splitting the features 4 ways over both axes (so their flattened
  group exists): still one all-reduce per dim, not merged into one among 4;
* ``contiguous``: a causal attention whose every operator splits the sequence 4 ways, run without the deal:
  the keys' and values' gradients go home by one reduce-scatter each, what the tables charge
  (:func:`shardplan.cost.ring.gathered_reduction`);
* ``encoder``: the same layer without the mask (an encoder's attention): the same reduce-scatters, charged so
  on the torch path (:func:`shardplan.cost.ring.scatters_undealt`), XLA's all-reduce on the JAX path;
* ``act2``: an activation (``tanh`` of a parameter, replicated) multiplied into a batch split 2 ways and a
  sequence split 2 ways, beside operators splitting the features 4 ways (their flattened group exists): its
  gradient, one all-reduce among 2 per dim (:func:`shardplan.torch.run.summed_dims`: the run reduces it dim by
  dim before DTensor's redistribution), where DTensor alone merges them into one among 4;
* ``act4``: a linear splitting its features out 4 ways after a replicated activation: one all-reduce among 4 of
  its input's gradient (the flattened group), where one per mesh axis would be two of 2;
* ``act2s``: as ``act2`` with the activation split 4 ways along the features out: its gradient goes home by
  two reduce-scatters among 2 (one per dim, into the producer's blocks), what the tables charge on DTensor's
  machine (:mod:`shardplan.cost.grad_home`: the product's all-reduces moved to the edge, which charges the
  reduce-scatter where the producer scatters the tile over the summing devices);
* ``act2h``: as ``act2`` with the activation split 2 ways along the features out on the sequence's mesh axis
  and replicated on the batch's: its gradient goes home by an all-reduce among the batch's 2 devices, then a
  reduce-scatter among the sequence's 2 into its halves (the run's steps, in mesh order), what the tables charge
  (:func:`shardplan.cost.grad_home.home_steps`), where they charged both all-reduces before.

Where the tables charge an activation's gradient on its edge, the bytes go with the seconds: the operator's
``comm_bytes`` lose the moved all-reduces and the edge reports what it sends
(:func:`shardplan.cost.plan_home_bytes`), read here from tables built on the hand-laid layouts.
"""

from __future__ import annotations

import math
from typing import Any
from unittest import mock

import numpy as np
import pytest

import torch
import torch.nn.functional as F
from torch import nn

import torch_cases  # noqa: E402  (tests/ is on sys.path, see conftest.py)

pytestmark = pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out

WORLD = 4
B, S, K, N = 8, 4, 16, 12  # batch, sequence, features in, features out
AB, AS, AD, AH = 2, 16, 8, 2  # the attention layer: batch, sequence, width, heads

class Lin(nn.Module):
    """One linear over (batch, sequence, features); the loss a weighted sum."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(K, N, bias=False)

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (self.fc(x) * w).sum()


class Attn(nn.Module):
    """q, k, v projections, SDPA (causal unless ``causal=False``: an encoder's), an output projection; the loss
    a weighted sum."""

    def __init__(self, causal: bool = True) -> None:
        super().__init__()
        self.causal = causal
        self.q, self.k, self.v, self.o = (nn.Linear(AD, AD, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (f(x).view(b, s, AH, AD // AH).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return (torch.tanh(self.o(y.transpose(1, 2).reshape(b, s, AD))) * w).sum()


class Act(nn.Module):
    """An activation ``h = tanh(p)`` of shape (features in, features out) multiplied into the batch: its gradient
    sums over batch and sequence; the loss a weighted sum."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.randn(K, N) / 4)

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return ((x @ torch.tanh(self.p)) * w).sum()


class Two(nn.Module):
    """Two linears with a tanh between; the loss a weighted sum."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(K, K, bias=False), nn.Linear(K, N, bias=False)

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (self.fc2(torch.tanh(self.fc1(x))) * w).sum()


def _counted(seen: list[tuple[str, int, tuple[int, ...]]]) -> list[tuple[str, int, int]]:
    """``(kind, group size, elements)`` of each collective :func:`torch_cases.collective_recorder` saw."""
    return [(kind, g, math.prod(shape)) for kind, g, shape in seen]


def _layouts(graph: Any, wants: dict[str, dict[int, int]], p: int) -> dict[str, Any]:
    """Each operator splits its dims of the extents in ``wants[kind]`` (extent -> ways; the test's extents
    differ; ``wants[""]`` for the kinds not named), in its own dims' order."""
    from shardplan.layout import Layout

    out = {}
    for op in graph.operators:
        want = wants.get(op.kind, wants[""])
        out[op.name] = Layout.flat(op.dim_names, tuple(want.get(op.extents[d], 1) if d not in op.fixed else 1
                                                       for d in op.dim_names), p)
    return out


def _charged(graph: Any, layouts: dict[str, Any], machine: Any) -> float:
    """Bytes one device sends inside the operators at ``layouts`` (the cost model's ``comm_bytes``)."""
    from shardplan.cost.operator import operator_cost
    from shardplan.layout import LayoutArrays

    return float(sum(operator_cost(op, LayoutArrays.stack([layouts[op.name]]), machine).comm_bytes[0]
                     for op in graph.operators))


def _charged_home(graph: Any, layouts: dict[str, Any], machine: Any) -> dict[str, float]:
    """Bytes one device sends in the operators' collectives and in the activation gradients' reductions the
    tables charge on the edges on DTensor's machine (:mod:`shardplan.cost.grad_home`), two ways: ``seconds``,
    the operators' less what moved to the edges plus the edges' seconds, times the bandwidth (``machine`` has no
    latency); ``tables``, the bytes the tables report on these layouts (the operators' ``comm_bytes`` plus
    :func:`~shardplan.cost.plan_home_bytes`)."""
    from shardplan.cost import build_tables, plan_home_bytes
    from shardplan.cost.grad_home import home_moved, home_pairs, home_reduction, unfed_slots
    from shardplan.layout import LayoutArrays

    assert machine.latency == 0 and len(machine.levels) == 1
    arr = {op.name: LayoutArrays.stack([layouts[op.name]]) for op in graph.operators}
    unfed = unfed_slots(graph)
    pairs = [home_pairs(op, arr[op.name], machine, unfed[i]) for i, op in enumerate(graph.operators)]
    moved = sum(float(home_moved(op, arr[op.name], machine, pairs[i])[0]) for i, op in enumerate(graph.operators))
    edges = sum(float(home_reduction(graph.operators[e.src], arr[graph.operators[e.src].name], graph.operators[e.dst],
                                     e.slot, arr[graph.operators[e.dst].name], machine, pairs[e.dst])[0, 0])
                for e in graph.edges)
    tables = build_tables(graph, machine, candidates=lambda op: [layouts[op.name]])
    reported = sum(float(c.comm_bytes[0]) for c in tables.op_costs) + plan_home_bytes(tables, [0] * len(graph))
    return {"seconds": _charged(graph, layouts, machine) + (edges - moved) * machine.bandwidth, "tables": reported}


def _sent(seen: list[tuple[str, int, int]]) -> float:
    """Bytes one device sends in the recorded all-reduces (float32): ``2 (g - 1) / g`` of the buffer each."""
    return float(sum(2.0 * (g - 1) / g * n * 4 for kind, g, n in seen if kind == "all_reduce"))


def _run_linear(case: str, world: int) -> dict[str, Any]:
    import dataclasses

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor._redistribute import disable_redistribute_transform_optimization

    from shardplan.torch.device import dtensor_machine
    from shardplan.torch.frontend import trace
    from shardplan.torch import run as run_module
    from shardplan.torch.run import ParallelModule

    torch.manual_seed(0)
    model, batch = Lin(), (torch.randn(B, S, K), torch.randn(B, S, N))
    ref = torch_cases._clone(model)
    loss0 = ref(*batch)
    loss0.backward()
    graph, info = trace(torch_cases._clone(model), batch)
    kinds = {op.kind for op in graph.operators}
    linear = next(k for k in kinds if "linear" in k or "matmul" in k or "gemm" in k)
    wants = {"k4": {linear: {K: 4}, "": {B: 2}}, "b4": {linear: {B: 4}, "": {B: 2}},
             "b2s2": {"": {B: 2, S: 2}},
             "mixed": {linear: {B: 2, S: 2}, "": {N: 4}, "sum": {B: 2, S: 2}}}[case]
    lays = _layouts(graph, wants, world)
    mesh = init_device_mesh("cpu", (world,))
    toy = torch_cases.toy_machine(world)
    out: dict[str, Any] = {"charged": _charged(graph, lays, dtensor_machine(toy)),
                           "charged_pase": _charged(graph, lays, dataclasses.replace(toy, reduce_per_dim=False)),
                           "kinds": sorted(kinds)}
    for merge, steps in ((True, True), (False, True), (True, False)):
        pm = ParallelModule.create(torch_cases._clone(model), info, graph, lays, mesh)
        one = (lambda src, dst, axes: [tuple(dst)]) if not steps else run_module.reduce_steps
        with mock.patch.object(run_module, "reduce_steps", one), \
                disable_redistribute_transform_optimization(not merge), torch_cases.collective_recorder() as rec:
            loss = pm(*batch)
            loss.backward()
        grad = pm.named_dparameters()["fc.weight"].grad.full_tensor()
        out["run" if merge and steps else "unmerged" if steps else "one_step"] = {
            "mesh": list(pm.mesh.mesh.shape), "seen": sorted(s for s in _counted(rec.seen) if s[0] == "all_reduce"),
            "sent": _sent(_counted(rec.seen)), "rel_loss": abs(float(loss) - float(loss0)) / abs(float(loss0)),
            "rel_grad": float((grad - ref.fc.weight.grad).abs().max() / ref.fc.weight.grad.abs().max())}
    return out


def _step_recorded(pm: Any, batch: tuple, ref: Any) -> tuple[Any, Any, float]:
    """One forward of ``pm``, its backward under a collective recorder, and the worst relative difference of
    a parameter's gradient from the one-process reference ``ref``'s: (loss, recorder, worst)."""
    loss = pm(*batch)
    with torch_cases.collective_recorder() as rec:
        loss.backward()
    named = pm.named_dparameters()
    worst = max(float((named[n].grad.full_tensor() - p_.grad).abs().max() / p_.grad.abs().max())
                for n, p_ in ref.named_parameters())
    return loss, rec, worst


def _sequence_split_attention(world: int, causal: bool) -> tuple:
    """The attention layer (causal or an encoder's), its batch, a one-process reference with its loss and
    gradients, its traced graph and info, and layouts splitting every operator's sequence ``world`` ways."""
    from shardplan.layout import Layout
    from shardplan.torch.frontend import trace

    torch.manual_seed(0)
    model, batch = Attn(causal=causal), (torch.randn(AB, AS, AD), torch.randn(AB, AS, AD))
    ref = torch_cases._clone(model)
    loss0 = ref(*batch)
    loss0.backward()
    graph, info = trace(torch_cases._clone(model), batch)
    lays = {op.name: Layout.flat(op.dim_names, tuple(world if op.extents[d] == AS and d not in op.fixed else 1
                                                     for d in op.dim_names), world) for op in graph.operators}
    return model, batch, ref, loss0, graph, info, lays


def _run_contiguous(world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from shardplan.cost.ring import gathered_dealt, gathered_home, gathered_reduction, gathered_scatters
    from shardplan.machine import Machine
    from shardplan.cost.operator import operator_cost
    from shardplan.layout import LayoutArrays
    from shardplan.torch.device import dtensor_machine
    from shardplan.cost.collectives import reduce_scatter_time
    from shardplan.torch.run import ParallelModule

    model, batch, ref, loss0, graph, info, lays = _sequence_split_attention(world, causal=True)
    # fast devices: the contiguous blocks' extra causal work costs less than dealing them, so no runner deals
    fast = Machine(world, peak_flops=32e12, bandwidth=16e9, name="fast")
    machine, toy = dtensor_machine(fast), fast
    (i,) = [j for j, op in enumerate(graph.operators) if op.kind == "attn_flash"]
    v = graph.operators[i]
    lv = LayoutArrays.stack([lays[v.name]])
    edges = {}
    for e in graph.edges:
        if e.dst == i and e.slot in (1, 2):
            u = graph.operators[e.src]
            lu = LayoutArrays.stack([lays[u.name]])
            edges[e.slot] = {m: {"home": bool(gathered_home(v, lv, mc, operator_cost(v, lv, mc).compute)[0]),
                                 "dealt": bool(gathered_dealt(v, lv, mc, operator_cost(v, lv, mc).compute)[0]),
                                 "scatters": bool(gathered_scatters(u, lu, v, e.slot, lv, mc)[0, 0]),
                                 "seconds": float(gathered_reduction(u, lu, v, e.slot, lv, mc,
                                                                     operator_cost(v, lv, mc).compute)[0, 0])}
                             for m, mc in (("torch", machine), ("xla", toy))}
    mesh = init_device_mesh("cpu", (world,))
    pm = ParallelModule.create(torch_cases._clone(model), info, graph, lays, mesh)
    loss, rec, worst = _step_recorded(pm, batch, ref)
    kv_tile = AB * AH * AS * (AD // AH)  # a device's gathered keys (or values): every position of its heads
    rs = float(reduce_scatter_time(kv_tile * 4.0, np.array([[world]]), machine)[0])  # one among all, float32
    return {"reduce_scatter_seconds": rs, "edges": {str(k): x for k, x in edges.items()},
            "backward": sorted(_counted(rec.seen)), "kv_tile": kv_tile, "mesh": list(pm.mesh.mesh.shape), "rel_loss": abs(float(loss) - float(loss0)) / abs(float(loss0)),
            "rel_grad": worst}


def _sent_all(seen: list[tuple[str, int, int]]) -> dict[str, float]:
    """Bytes one device sends, float32, by kind: an all-reduce ``2 (g - 1) / g`` of its buffer, a reduce-scatter
    ``(g - 1) / g`` of its input, an all-gather ``g - 1`` times its block, an all-to-all ``(g - 1) / g`` of its
    buffer."""
    share = {"all_reduce": lambda g: 2.0 * (g - 1) / g, "reduce_scatter": lambda g: (g - 1) / g,
             "all_gather": lambda g: float(g - 1), "all_to_all": lambda g: (g - 1) / g}
    out = {k: 0.0 for k in share}
    for kind, g, n in seen:
        out[kind] += share[kind](g) * n * 4
    return out


def _edge_bytes(graph: Any, layouts: dict[str, Any], machine: Any) -> float:
    """Bytes one device sends on the edges at ``layouts``: what each device lacks, forward and backward
    (:func:`shardplan.cost.edge.edge_volumes`, as ``hlo.predicted_bytes`` counts them)."""
    from shardplan.cost.edge import edge_volumes
    from shardplan.layout import LayoutArrays

    total = 0.0
    for e in graph.edges:
        u, v = graph.operators[e.src], graph.operators[e.dst]
        f, b = edge_volumes(u, LayoutArrays.stack([layouts[u.name]]), v, e.slot, LayoutArrays.stack([layouts[v.name]]),
                            machine.num_devices, steps=machine.stepwise_redistribution)
        total += float(f[0, 0] + b[0, 0]) * machine.dtype_bytes
    return total


def _run_activation(case: str, world: int) -> dict[str, Any]:
    """``act2``: :class:`Act`'s product splits batch and sequence 2 ways each, the loss's operators the
    features out 4 ways (their flattened group exists): the activation's gradient, two all-reduces among 2;
    ``act4``: :class:`Two`'s second linear splits its features out 4 ways, the loss's operators the batch 2 ways:
    the first tanh's gradient, one all-reduce among 4. Each run with the run's per-dim steps, without them
    (``one_step``: DTensor's one redistribution) and without DTensor's merging (``unmerged``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor._redistribute import disable_redistribute_transform_optimization

    from shardplan.layout import Layout
    from shardplan.torch import run as run_module
    from shardplan.torch.device import dtensor_machine
    from shardplan.torch.frontend import trace
    from shardplan.torch.run import ParallelModule

    torch.manual_seed(0)
    model, batch = (Two() if case == "act4" else Act()), (torch.randn(B, S, K), torch.randn(B, S, N))
    ref = torch_cases._clone(model)
    loss0 = ref(*batch)
    loss0.backward()
    graph, info = trace(torch_cases._clone(model), batch)
    wants = {"act2": {"matmul": {B: 2, S: 2}, "tanh": {}, "": {N: 4}},
             "act2s": {"tanh": {N: 4}, "": {B: 2, S: 2}},
             "act2h": {"tanh": {N: 2}, "": {B: 2, S: 2}},
             "act4": {"linear": {}, "tanh": {}, "": {B: 2}}}[case]
    lays = _layouts(graph, wants, world)
    if case == "act4":  # the second linear alone splits its features out (the first's extents are K, K)
        (second,) = [op for op in graph.operators if op.kind == "linear" and N in op.extents.values()]
        lays[second.name] = Layout.flat(second.dim_names, tuple(4 if second.extents[d] == N else 1
                                                                for d in second.dim_names), world)
    machine = dtensor_machine(torch_cases.toy_machine(world))
    home = _charged_home(graph, lays, machine)
    out: dict[str, Any] = {"charged": home["seconds"], "reported": home["tables"],
                           "charged_ops": _charged(graph, lays, machine),
                           "edges": _edge_bytes(graph, lays, machine), "kinds": sorted({op.kind for op in graph.operators})}
    for name, merge, steps in (("run", True, True), ("one_step", True, False), ("unmerged", False, True)):
        pm = ParallelModule.create(torch_cases._clone(model), info, graph, lays, init_device_mesh("cpu", (world,)))
        by_dim = run_module._grad_by_dim if steps else (lambda y, *rest: y)
        with mock.patch.object(run_module, "_grad_by_dim", by_dim), \
                disable_redistribute_transform_optimization(not merge), torch_cases.collective_recorder() as rec:
            loss = pm(*batch)
            loss.backward()
        named = pm.named_dparameters()
        worst = max(float((named[n].grad.full_tensor() - p_.grad).abs().max() / p_.grad.abs().max())
                    for n, p_ in ref.named_parameters())
        seen = _counted(rec.seen)
        out[name] = {"mesh": list(pm.mesh.mesh.shape), "seen": sorted(seen), "sent": _sent(seen),
                     "sent_all": _sent_all(seen), "rel_loss": abs(float(loss) - float(loss0)) / abs(float(loss0)),
                     "rel_grad": worst}
    return out


def _run_encoder(world: int) -> dict[str, Any]:
    """A non-causal attention layer (an encoder's) whose every operator splits the sequence 4 ways: the keys'
    and values' gradients go home by one reduce-scatter each; what the tables charge for them, in bytes (a
    machine without latency: seconds times bandwidth), on the torch path and on XLA's."""
    from torch.distributed.device_mesh import init_device_mesh

    from shardplan.cost.operator import operator_cost
    from shardplan.cost.ring import gathered_home, gathered_reduction, gathered_scatters, moved_reduction
    from shardplan.layout import LayoutArrays
    from shardplan.machine import Machine
    from shardplan.torch.device import dtensor_machine
    from shardplan.torch.run import ParallelModule

    model, batch, ref, loss0, graph, info, lays = _sequence_split_attention(world, causal=False)
    bw = 16e9
    xla = Machine(world, peak_flops=32e12, bandwidth=bw, latency=0.0, name="fast")
    (i,) = [j for j, op in enumerate(graph.operators) if op.kind == "attn_flash"]
    v = graph.operators[i]
    lv = LayoutArrays.stack([lays[v.name]])
    charged: dict[str, Any] = {}
    for m, mc in (("torch", dtensor_machine(xla)), ("xla", xla)):
        compute = operator_cost(v, lv, mc).compute
        home = bool(gathered_home(v, lv, mc, compute)[0])
        row = {"causal": v.causal is not None, "home": home, "edges": {}}
        for e in graph.edges:
            if e.dst == i and e.slot in (1, 2):
                u = graph.operators[e.src]
                lu = LayoutArrays.stack([lays[u.name]])
                op_part = 0.0 if home else float(moved_reduction(v, lv, mc, (e.slot,))[0])
                row["edges"][str(e.slot)] = {
                    "scatters": bool(gathered_scatters(u, lu, v, e.slot, lv, mc)[0, 0]),
                    "edge_bytes": float(gathered_reduction(u, lu, v, e.slot, lv, mc, compute)[0, 0]) * bw,
                    "operator_bytes": op_part * bw}
        charged[m] = row
    pm = ParallelModule.create(torch_cases._clone(model), info, graph, lays, init_device_mesh("cpu", (world,)))
    loss, rec, worst = _step_recorded(pm, batch, ref)
    kv_tile = AB * AH * AS * (AD // AH)
    return {"charged": charged, "backward": sorted(_counted(rec.seen)), "kv_tile": kv_tile,
            "mesh": list(pm.mesh.mesh.shape), "rel_loss": abs(float(loss) - float(loss0)) / abs(float(loss0)),
            "rel_grad": worst}


def run_all(name: str, world: int) -> dict[str, Any]:
    if name == "contiguous":
        return _run_contiguous(world)
    if name == "encoder":
        return _run_encoder(world)
    if name in ("act2", "act2s", "act2h", "act4"):
        return _run_activation(name, world)
    return _run_linear(name, world)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("torch_dtensor_reductions") / "results.json"
    # act2 before b2s2: after b2s2, act2's gradients reach DTensor's redistribution on b2s2's mesh object (an
    # equal 2 x 2 mesh, never flattened, held by DTensor's caches), whose root has no flattened group: its
    # one-step run then sends two all-reduces of 2 (measured), not the merged one among 4 this case shows
    return torch_cases.run_distributed(["k4", "b4", "act2", "act2s", "act2h", "act4", "b2s2", "mixed", "contiguous",
                                        "encoder"], WORLD, str(out), run_one=run_all)


def _ok(r: dict[str, Any]) -> None:
    assert "error" not in r, r.get("error")


TILE = {"k4": B * S * N, "b4": N * K, "b2s2": N * K, "mixed": N * K}


@pytest.mark.parametrize("case", ["k4", "b4", "b2s2", "mixed"])
def test_the_run_sends_the_all_reduces_the_tables_charge(results, case):
    r = results[case]
    _ok(r)
    run = r["run"]
    assert run["mesh"] == [2, 2] and run["rel_loss"] <= 1e-5 and run["rel_grad"] <= 1e-5, run
    assert run["sent"] == pytest.approx(r["charged"], rel=1e-12), r  # bytes one device sends in all-reduces
    tile = TILE[case]
    if case == "k4":  # the output's partial sums over the contraction, among all 4; the loss's over the batch
        want = [("all_reduce", 4, tile), ("all_reduce", 2, 1)]
    elif case == "b4":  # the weight's gradient over the batch, among all 4; the loss's over the batch
        want = [("all_reduce", 4, tile), ("all_reduce", 2, 1)]
    else:  # the weight's gradient and the loss over batch and sequence: one all-reduce of 2 per dim
        want = [("all_reduce", 2, tile)] * 2 + [("all_reduce", 2, 1)] * 2
    assert [tuple(x) for x in run["seen"]] == sorted(want), run


@pytest.mark.parametrize("case", ["k4", "b4"])
def test_one_all_reduce_per_mesh_axis_would_send_more_than_charged(results, case):
    r = results[case]
    _ok(r)
    # DTensor without the flattened group: two all-reduces of 2 of the tile (2 * 2 * 1/2) for one of 4 (2 * 3/4)
    un = r["unmerged"]
    assert ("all_reduce", 2, TILE[case]) in [tuple(x) for x in un["seen"]], un
    assert un["sent"] > r["charged"], r


def test_two_split_dims_are_one_reduction_each_not_one_among_their_product(results):
    for case in ("b2s2", "mixed"):
        r = results[case]
        _ok(r)
        assert r["charged_pase"] < r["charged"], r  # the PaSE model's one all-reduce of 4 is not what is sent


def test_reducing_dim_by_dim_keeps_two_dims_from_merging_into_one_all_reduce(results):
    r = results["mixed"]
    _ok(r)
    # one redistribution for both dims: DTensor merges them over the flattened group the features' split made
    one = r["one_step"]
    # (the weight's gradient always; the loss's scalar as DTensor's transform list falls)
    assert ("all_reduce", 4, N * K) in [tuple(x) for x in one["seen"]], one
    assert one["sent"] < r["charged"], r


def test_the_contiguous_all_gathers_key_gradients_are_reduce_scattered_as_charged(results):
    r = results["contiguous"]
    _ok(r)
    assert r["mesh"] == [4] and r["rel_loss"] <= 1e-5 and r["rel_grad"] <= 1e-4, r
    for slot, x in r["edges"].items():
        assert not x["torch"]["dealt"] and not x["xla"]["dealt"], (slot, x)  # contiguous, as the run is
        assert x["torch"]["home"] and x["torch"]["scatters"], (slot, x)
        assert x["torch"]["seconds"] == pytest.approx(r["reduce_scatter_seconds"], rel=1e-12), (slot, x)
        assert not x["xla"]["home"] and x["xla"]["seconds"] == 0, (slot, x)  # XLA: the operator's all-reduce
    n = r["kv_tile"]
    scatters = [tuple(s) for s in r["backward"] if s[0] == "reduce_scatter"]
    assert scatters == [("reduce_scatter", 4, n)] * 2, r  # keys and values: one reduce-scatter each, among 4
    assert not [s for s in r["backward"] if s[0] == "all_reduce" and s[2] == n], r  # no all-reduce of them


def _close(run: dict[str, Any]) -> None:
    assert run["mesh"] == [2, 2] and run["rel_loss"] <= 1e-5 and run["rel_grad"] <= 1e-5, run


def test_an_activation_gradient_over_two_split_dims_is_one_all_reduce_per_dim(results):
    r = results["act2"]
    _ok(r)
    run, one = r["run"], r["one_step"]
    _close(run)
    _close(one)
    tile = K * N  # the activation tanh(p), replicated: its gradient sums over batch and sequence
    ars = [tuple(x) for x in run["seen"] if x[0] == "all_reduce"]
    assert ars == sorted([("all_reduce", 2, tile)] * 2 + [("all_reduce", 4, 1)]), run  # the loss's over the features
    assert run["sent"] == pytest.approx(r["charged"], rel=1e-12), r
    # a replicated producer: the all-reduces, moved to the edge on DTensor's machine, the same bytes
    assert r["charged"] == pytest.approx(r["charged_ops"], rel=1e-12) and r["charged"] == 1542, r
    assert r["reported"] == pytest.approx(r["charged"], rel=1e-12), r  # the tables' bytes: the same all-reduces
    # DTensor's one redistribution merges the two dims over the features' flattened group: the PaSE charge
    assert ("all_reduce", 4, tile) in [tuple(x) for x in one["seen"]] and one["sent"] < r["charged"], r


def test_an_activation_gradient_over_one_dim_split_4_ways_is_one_all_reduce_among_4(results):
    r = results["act4"]
    _ok(r)
    run, un = r["run"], r["unmerged"]
    _close(run)
    tile = B * S * K  # the tanh's output, replicated; the second linear splits its features out over both axes
    ars = [tuple(x) for x in run["seen"] if x[0] == "all_reduce"]
    assert ars == sorted([("all_reduce", 4, tile), ("all_reduce", 2, 1)]), run
    assert run["sent"] == pytest.approx(r["charged"], rel=1e-12), r
    assert r["charged"] == pytest.approx(r["charged_ops"], rel=1e-12) and r["charged"] == 3076, r  # replicated producer
    assert r["reported"] == pytest.approx(r["charged"], rel=1e-12), r
    assert r["one_step"]["sent"] == run["sent"], r  # one dim: nothing for the steps to do
    # without the flattened group's merge, one all-reduce per mesh axis: 4/3 of the bytes
    assert [tuple(x) for x in un["seen"]].count(("all_reduce", 2, tile)) == 2 and un["sent"] > r["charged"], r


def test_an_activation_gradient_into_a_scattering_producer_is_reduce_scattered_as_charged(results):
    r = results["act2s"]
    _ok(r)
    run, one = r["run"], r["one_step"]
    _close(run)
    tile = K * N  # tanh(p) split 4 ways along the features out, gathered for the product
    rs = [tuple(x) for x in run["seen"] if x[0] == "reduce_scatter"]
    assert rs == [("reduce_scatter", 2, tile // 2), ("reduce_scatter", 2, tile)], run  # dim by dim into its shards
    assert [tuple(x) for x in one["seen"] if x[0] == "reduce_scatter"] == [("reduce_scatter", 4, tile)], one
    assert not [x for x in run["seen"] if x[0] == "all_reduce" and x[2] == tile], run
    sent = run["sent_all"]["reduce_scatter"]
    assert sent == one["sent_all"]["reduce_scatter"] == pytest.approx(0.75 * tile * 4, rel=1e-12), r
    # the product's two all-reduces of the tile (one per dim) come off the operator; the edge from the
    # scattering producer charges the two reduce-scatters the run sends; the loss's all-reduces stay
    assert r["charged_ops"] == pytest.approx(2 * tile * 4 + run["sent"], rel=1e-12), r
    assert r["charged"] == pytest.approx(sent + run["sent"], rel=1e-12), r  # 576 B + the loss's 8 B
    assert r["reported"] == 584 and r["charged"] == pytest.approx(584, rel=1e-12), r  # the bytes where the time is


def test_an_activation_gradient_into_a_producer_split_along_one_summed_dim_gets_the_runs_steps(results):
    r = results["act2h"]
    _ok(r)
    run, one = r["run"], r["one_step"]
    _close(run)
    _close(one)
    tile = K * N  # tanh(p) split 2 ways along the features out on the sequence's mesh axis, replicated on the batch's
    home = [tuple(x) for x in run["seen"] if x[2] == tile or (x[0] == "reduce_scatter" and x[2] == tile // 2)]
    # the batch's axis first (mesh order): the all-reduce of the whole tile, then the reduce-scatter into halves
    assert sorted(home) == [("all_reduce", 2, tile), ("reduce_scatter", 2, tile)], run
    assert one["seen"] == run["seen"], r  # DTensor's one redistribution sends the same
    sent = run["sent_all"]["reduce_scatter"] + run["sent"]  # 384 B + 768 B + the loss's 8 B
    assert r["reported"] == sent == 1160 and r["charged"] == pytest.approx(sent, rel=1e-12), r
    # the product's two all-reduces of the tile came off the operator (as charged before: 1,544 B)
    assert r["charged_ops"] == pytest.approx(2 * tile * 4 + 8, rel=1e-12), r


def test_an_encoders_key_and_value_gradients_are_reduce_scattered_as_charged(results):
    r = results["encoder"]
    _ok(r)
    assert r["mesh"] == [4] and r["rel_loss"] <= 1e-5 and r["rel_grad"] <= 1e-4, r
    n = r["kv_tile"]
    scatters = [tuple(s) for s in r["backward"] if s[0] == "reduce_scatter"]
    assert scatters == [("reduce_scatter", 4, n)] * 2, r  # keys and values: one reduce-scatter each, among 4
    assert not [s for s in r["backward"] if s[0] == "all_reduce" and s[2] == n], r
    torch_, xla = r["charged"]["torch"], r["charged"]["xla"]
    assert not torch_["causal"] and torch_["home"] and not xla["home"], r
    for slot in ("1", "2"):
        t, x = torch_["edges"][slot], xla["edges"][slot]
        assert t["scatters"] and t["operator_bytes"] == 0, r
        assert t["edge_bytes"] == pytest.approx(0.75 * n * 4, rel=1e-12), r  # the bytes one reduce-scatter sends
        assert x["edge_bytes"] == 0 and x["operator_bytes"] == pytest.approx(1.5 * n * 4, rel=1e-12), r  # XLA's
