"""A pipeline plan whose stages carry FP8 products, activation offload, recomputation and the ring runs them on
PyTorch (4 gloo processes, :mod:`shardplan.torch.staged`): loss and gradients equal one process running the same
FP8 products (cast by this file's own code) on the same micro-batches.

* ``one_process_stages``: 4 stages of one process (plain stage modules), 1F1B over 4 micro-batches; every block
  linear FP8, three operators offloading their activations, three recomputing (two checkpointed runs of nodes);
* ``two_process_stages``: 2 stages of 2 processes (DTensor stages), each a causal attention block with every
  operator splitting the sequence 2 ways, planned with ``context="ring"``: the attention runs the ring, the MLP
  linears FP8, one projection offloads its activations and one recomputes.

Refusals (parameters in host memory beside a ZeRO stage other than 3) run in this process: they are checked before
anything is traced (ZeRO-1, 2, 3, offloaded optimizer state and parameters in stages:
tests/torch_engine/test_torch_staged_zero.py).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

import pytest

import torch
import torch.nn.functional as F
from torch import nn

import torch_cases  # noqa: E402  (tests/ is on sys.path, see conftest.py)
import torch_pipeline_cases  # noqa: E402

pytestmark = pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out

WORLD = 4
B, S, D, H = 4, 8, 8, 2
PRODUCT = re.compile(r"^layers\.\d+/(up|down)/linear")


def _qdq(t: torch.Tensor, fmt: Any, largest: float) -> torch.Tensor:
    """This file's own FP8 cast: per-tensor scale from the whole tensor's amax, rounded, scaled back."""
    s = largest / t.detach().abs().max()
    return (t.detach() * s).to(fmt).to(t.dtype) / s


class Delayed:
    """This file's own delayed scaling: per (linear, tensor) a history of the steps' largest amaxes, newest last;
    the scale ``M / max(history)`` (1 while empty), the cast saturating."""

    def __init__(self) -> None:
        self.history: dict[str, list[float]] = {}
        self.step: dict[str, float] = {}

    def qdq(self, key: str, t: torch.Tensor, fmt: Any, largest: float) -> torch.Tensor:
        self.step[key] = max(self.step.get(key, 0.0), float(t.detach().abs().max()))
        s = largest / max(self.history[key]) if self.history.get(key) else 1.0
        return (t.detach() * s).clamp(-largest, largest).to(fmt).to(t.dtype) / s

    def end_step(self) -> None:
        for key, amax in self.step.items():
            self.history.setdefault(key, []).append(amax)
        self.step = {}


class Fp8Linear(nn.Module):
    """``lin`` with its input and weight cast to E4M3 and its output gradient to E5M2 (the unsharded FP8 product):
    current scaling, or ``delayed``'s scales."""

    def __init__(self, lin: nn.Linear, name: str, delayed: Delayed | None = None) -> None:
        super().__init__()
        self.lin, self.name, self.delayed = lin, name, delayed

    def _qdq(self, role: str, t: torch.Tensor, fmt: Any, largest: float) -> torch.Tensor:
        if self.delayed is None:
            return _qdq(t, fmt, largest)
        return self.delayed.qdq(f"{self.name}:{role}", t, fmt, largest)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cast = lambda r, t: t + (self._qdq(r, t, torch.float8_e4m3fn, 448.0) - t).detach()  # noqa: E731
        y = F.linear(cast("x", x), cast("w", self.lin.weight), self.lin.bias)
        if y.requires_grad:
            y.register_hook(lambda g: self._qdq("dY", g, torch.float8_e5m2, 57344.0))
        return y


def fp8_model(model: nn.Module, names: list[str], delayed: Delayed | None = None) -> nn.Module:
    """A copy of ``model`` with the linears ``names`` (module paths) in FP8."""
    ref = torch_cases._clone(model)
    for name in names:
        parent, _, leaf = name.rpartition(".")
        holder = ref.get_submodule(parent)
        setattr(holder, leaf, Fp8Linear(getattr(holder, leaf), name, delayed))
    return ref


def fp8_step(ref: nn.Module, batch: tuple, m: int) -> tuple[torch.Tensor, dict]:
    """One step of ``ref`` on m consecutive micro-batches as the pipeline takes them: each micro-batch's backward
    of its own loss, the gradients divided by m after (torch's ``scale_grads``); the mean loss and gradients."""
    ref.zero_grad(set_to_none=True)
    total = torch.zeros(())
    for part in zip(*(x.tensor_split(m) for x in batch)):
        loss = ref(*part)
        loss.backward()
        total += loss.detach() / m
    return total, {n.replace(".lin.", "."): p.grad / m for n, p in ref.named_parameters()}


def fp8_reference(model: nn.Module, batch: tuple, m: int, names: list[str]) -> tuple[torch.Tensor, dict, float]:
    """One process: ``model`` with the linears ``names`` in FP8 (current scaling), one step on m micro-batches;
    and the float32 loss."""
    with torch.no_grad():
        loss32 = float(model(*batch))
    return (*fp8_step(fp8_model(model, names), batch, m), loss32)


def edited(plan: Any, edits: dict[str, dict[str, Any]], layouts: dict[str, Any] | None = None,
           context: str | None = None) -> Any:
    """``plan`` with the per-operator choices ``edits`` (and ``layouts``), as a plan loaded from JSON."""
    stages = tuple(dataclasses.replace(s, operators={
        n: dataclasses.replace(c, **edits.get(n, {}), **({"layout": layouts[n]} if layouts and n in layouts else {}))
        for n, c in s.operators.items()}) for s in plan.stages)
    stats = dict(plan.stats)
    if context is not None:
        stats["table_options"] = {**(stats.get("table_options") or {}), "context": context}
    return dataclasses.replace(plan, stages=stages, stats=stats, detail=None)


def attn_case() -> tuple[nn.Module, tuple]:
    """:class:`AttnModel` and its batch, drawn after `torch.manual_seed(0)` (the same values in every process)."""
    torch.manual_seed(0)
    return AttnModel(), (torch.randn(B, S, D), torch.randn(B, S, D))


SEARCHED_MODELS = {"case": torch_pipeline_cases.make_case, "attn": attn_case}


@functools.cache
def searched(kind: str, sizes: tuple[int, ...], m: int) -> tuple[Any, Any]:
    """The pipeline search's plan (1F1B, uniform stages of ``sizes`` processes, ``m`` micro-batches) of the model
    ``SEARCHED_MODELS[kind]`` on the toy machine, and that model's graph at one micro-batch.

    Made once per process: the search is deterministic and a plan is frozen, so the cases that edit and run it
    (each on its own fresh model of that kind) share one search instead of repeating it. The model is built
    under ``torch.random.fork_rng``: whether the search was made here or before leaves the caller's random
    state alone."""
    from shardplan.pipeline.api import pipeline_solve
    from shardplan.planner import from_pipeline
    from shardplan.torch.staged import Tracer

    with torch.random.fork_rng():
        model, batch = SEARCHED_MODELS[kind]()
    tracer = Tracer(model, batch)
    plan = from_pipeline(pipeline_solve(tracer, tracer.batch, torch_pipeline_cases.toy_machine(WORLD),
                                        micro_batches=(m,), sizes=sizes, uniform=True, schedules=("1f1b",),
                                        cutoff=1))
    return plan, tracer(len(batch[0]) // m)


class AttnBlock(nn.Module):
    """Causal self-attention over 2 heads (q, k, v, o projections) and a tanh MLP (up, down), both residual."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D, bias=False) for _ in range(4))
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (f(x).view(b, s, H, D // H).transpose(1, 2) for f in (self.q, self.k, self.v))
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, D))
        return x + self.down(torch.tanh(self.up(x)))


class AttnModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(AttnBlock() for _ in range(2))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for blk in self.layers:
            x = blk(x)
        return ((x - y) ** 2).mean()


def _result(pipe: Any, loss: torch.Tensor, ref_loss: torch.Tensor, ref_grads: dict, loss32: float) -> dict[str, Any]:
    import torch.distributed as dist

    worst = torch.zeros(())
    for target, g in pipe.named_grads().items():
        g = g.full_tensor() if hasattr(g, "full_tensor") else g
        worst = torch.maximum(worst, (g - ref_grads[target]).abs().max())
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    host = torch.tensor(float(sum(h.module.host.saved_bytes for h in pipe.modules)))
    dist.all_reduce(host)
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    return {"rel_loss": abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)), "rel_grad": float(worst) / scale,
            "fp8_off": abs(float(ref_loss) - loss32) / abs(loss32), "host_bytes": float(host),
            "held": torch_pipeline_cases._total(len(pipe.named_grads())), "params": len(ref_grads)}


def _one_process_stages(world: int) -> dict[str, Any]:
    import shardplan.torch as st

    model, batch = torch_pipeline_cases.make_case()
    plan, _ = searched("case", (1,), 4)
    ops = [n for s in plan.stages for n in s.operators]
    fp8 = [n for n in ops if PRODUCT.match(n)]
    offload = ["layers.1/up/linear_2", "layers.2/gelu_2", "layers.4/down/linear_9"]
    recompute = ["layers.3/up/linear_6", "layers.3/gelu_3", "layers.5/down/linear_11"]  # two runs of nodes
    edits = {n: {"fp8": True} for n in fp8}
    for n in offload:
        edits[n] = {**edits.get(n, {}), "offload": ("activations",)}
    for n in recompute:
        edits[n] = {**edits.get(n, {}), "recompute": True}
    pipe = st.apply(edited(plan, edits), model, batch)
    delayed = sum(h.module.scaling is not None for h in pipe.modules)  # the default, where there are FP8 products
    loss = pipe.current_scaling().step(*batch)
    names = [f"layers.{i}.{w}" for i in range(6) for w in ("up", "down")]
    ref_loss, ref_grads, loss32 = fp8_reference(model, batch, 4, names)
    segments = torch_pipeline_cases._total(sum(len(h.module.segments) for h in pipe.modules))
    return {**_result(pipe, loss, ref_loss, ref_grads, loss32), "fp8_ops": len(fp8), "stages": plan.num_stages,
            "segments": segments,
            "delayed_by_default": torch_pipeline_cases._total(int(delayed))}


def _two_process_stages(world: int) -> dict[str, Any]:
    import shardplan.torch.ring as ring_module
    from shardplan.layout import Layout

    import shardplan.torch as st

    model, batch = attn_case()
    plan, graph = searched("attn", (2,), 2)
    layouts = {}
    for op in graph.operators:  # every operator splits its sequence (the first unfixed dimension of extent S)
        seq = next((d for d in op.dim_names if op.extents[d] == S and d not in op.fixed), None)
        layouts[op.name] = Layout.flat(op.dim_names, tuple(2 if d == seq else 1 for d in op.dim_names), 2)
    ops = [op.name for op in graph.operators]
    edits = {n: {"fp8": True} for n in ops if PRODUCT.match(n)}
    offload = next(n for n in ops if n.startswith("layers.0/q/"))
    recompute = next(n for n in ops if n.startswith("layers.1/o/"))
    edits[offload] = {"offload": ("activations",)}
    edits[recompute] = {"recompute": True}
    calls: list[int] = []
    inner = ring_module.ring_attention_sharded
    ring_module.ring_attention_sharded = lambda *a, **k: calls.append(1) or inner(*a, **k)
    try:
        pipe = st.apply(edited(plan, edits, layouts, context="ring"), model, batch)
        delayed = sum(h.module.scaling is not None for h in pipe.modules)  # the default
        loss = pipe.current_scaling().step(*batch)
    finally:
        ring_module.ring_attention_sharded = inner
    ref_loss, ref_grads, loss32 = fp8_reference(model, batch, 2, [f"layers.{i}.{w}" for i in range(2)
                                                                  for w in ("up", "down")])
    choices = pipe.modules[0].module.choices
    return {**_result(pipe, loss, ref_loss, ref_grads, loss32), "fp8_ops": len(choices.fp8),
            "ring": choices.ring, "ring_calls": torch_pipeline_cases._total(len(calls)),
            "recompute": torch_pipeline_cases._total(len(choices.recompute)),
            "offload": torch_pipeline_cases._total(len(choices.offload)),
            "delayed_by_default": torch_pipeline_cases._total(int(delayed))}


def _delayed_one_program(world: int) -> dict[str, Any]:
    """The attention model as one program on 4 processes (its searched layouts), its MLP products FP8 with the
    ParallelModule's default delayed scaling: three SGD steps against one process."""
    from torch.distributed.device_mesh import init_device_mesh

    from shardplan.spmd import solve
    from shardplan.torch.frontend import trace
    from shardplan.torch.run import ParallelModule, RunChoices

    torch.manual_seed(0)
    model, batch = AttnModel(), (torch.randn(B, S, D), torch.randn(B, S, D))
    graph, info = trace(torch_cases._clone(model), batch)
    plan = solve(graph, torch_pipeline_cases.toy_machine(world), cutoff=1, divides_p=True)
    fp8 = frozenset(op.name for op in graph.operators if re.match(r"^layers\.\d+\.(up|down)/linear", op.name))
    pm = ParallelModule.create(torch_cases._clone(model), info, graph, plan.layouts, init_device_mesh("cpu", (world,)),
                               RunChoices(fp8=fp8))
    delayed = Delayed()
    ref = fp8_model(model, [f"layers.{i}.{w}" for i in range(2) for w in ("up", "down")], delayed)
    rel_loss, rel_grad = 0.0, 0.0
    named = pm.named_dparameters()
    for _ in range(3):
        pm.zero_grad(set_to_none=True)
        loss = pm(*batch)
        loss.backward()
        loss0, grads0 = fp8_step(ref, batch, 1)
        delayed.end_step()
        scale = max(float(g.abs().max()) for g in grads0.values())
        rel_loss = max(rel_loss, abs(float(loss.detach()) - float(loss0)) / abs(float(loss0)))
        rel_grad = max(rel_grad, max(float((named[n].grad.full_tensor() - g).abs().max()) for n, g in grads0.items())
                       / scale)
        with torch.no_grad():
            for n, g in grads0.items():
                named[n] -= 0.5 * named[n].grad
            for n, p in ref.named_parameters():
                p -= 0.5 * grads0[n.replace(".lin.", ".")]
    return {"rel_loss": rel_loss, "rel_grad": rel_grad, "fp8_ops": len(fp8), "keys": len(pm.scaling.history),
            "split": sum(any(pl.is_shard() for pl in p.placements) for p in named.values())}


def _delayed_scaling(world: int) -> dict[str, Any]:
    """Both kinds of stage with delayed scaling, three SGD steps against one process running the same rule."""
    import torch.distributed as dist

    import shardplan.torch as st

    out = {"program": _delayed_one_program(world)}
    for kind in ("one", "two"):
        if kind == "one":
            model, batch = torch_pipeline_cases.make_case()
            plan, _ = searched("case", (1,), 4)
            names, m = [f"layers.{i}.{w}" for i in range(6) for w in ("up", "down")], 4
        else:
            model, batch = attn_case()
            plan, _ = searched("attn", (2,), 2)
            names, m = [f"layers.{i}.{w}" for i in range(2) for w in ("up", "down")], 2
        fp8 = {n: {"fp8": True} for s_ in plan.stages for n in s_.operators if PRODUCT.match(n)}
        pipe = st.apply(edited(plan, fp8), model, batch)
        default = sum(h.module.scaling is not None and h.module.scaling.length == 1024 for h in pipe.modules)
        pipe.delayed_scaling(16)
        delayed = Delayed()
        ref = fp8_model(model, names, delayed)
        rel_loss, rel_grad, losses = 0.0, 0.0, []
        for _ in range(3):
            loss = pipe.step(*batch)
            loss0, grads0 = fp8_step(ref, batch, m)
            delayed.end_step()
            worst = torch.zeros(())
            for target, g in pipe.named_grads().items():
                g = g.full_tensor() if hasattr(g, "full_tensor") else g
                worst = torch.maximum(worst, (g - grads0[target]).abs().max())
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            scale = max(float(g.abs().max()) for g in grads0.values())
            rel_loss = max(rel_loss, abs(float(loss) - float(loss0)) / abs(float(loss0)))
            rel_grad = max(rel_grad, float(worst) / scale)
            losses.append(float(loss0))
            with torch.no_grad():  # SGD on both sides: the pipeline's copies and the reference
                for target, p in pipe.named_parameters().items():
                    g = pipe.named_grads()[target]
                    p -= 0.5 * g
                for n, p in ref.named_parameters():
                    p -= 0.5 * grads0[n.replace(".lin.", ".")]
        current = fp8_reference(model, batch, m, names)[0]
        out[kind] = {"rel_loss": rel_loss, "rel_grad": rel_grad, "losses": losses,
                     "first_vs_current": abs(losses[0] - float(current)) / abs(float(current)),
                     "keys": len(delayed.history), "default": torch_pipeline_cases._total(default)}
    return out


def _offload_params(world: int) -> dict[str, Any]:
    """ZeRO-Infinity's ``offload_param`` on one program: the MLP of test_ring_fp8_offload_dist with the sequence
    split 4 ways and its linears' weights at ZeRO-3, their shards, and their Adam state, in host memory. Two
    steps against one process: loss, gradients and the updated parameters equal; the device shards hold no
    memory between steps (nor after the forward pass: the backward regathers from the host)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import test_ring_fp8_offload_dist as rf  # noqa: E402  (tests/torch_engine is on sys.path)
    from shardplan.torch.frontend import trace
    from shardplan.torch.precision import HostOptimizer
    from shardplan.torch.run import ParallelModule, RunChoices

    model, batch, ref, loss0 = rf._mlp_reference(False)
    graph, info = trace(torch_cases._clone(model), batch)
    linears = frozenset(op.name for op in graph.operators if "linear" in op.name)
    mesh = init_device_mesh("cpu", (world,))
    pm = ParallelModule.create(torch_cases._clone(model), info, graph, rf._layouts(graph, world, hidden=False), mesh,
                               RunChoices(zero3=linears, offload_optimizer=linears, offload_params=linears))
    homes = pm.offloaded_parameters()
    named = pm.named_dparameters()
    freed = lambda: all(named[n]._local_tensor.untyped_storage().nbytes() == 0 for n in homes)  # noqa: E731
    out: dict[str, Any] = {"homes": sorted(homes), "freed_at_start": freed()}
    opt = pm.optimizer(torch.optim.Adam, lr=0.1)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.1)
    rel_loss, rel_grad, param_err = 0.0, 0.0, 0.0
    for t in range(2):
        opt.zero_grad()
        loss = pm(*batch)
        out[f"freed_after_forward_{t}"] = freed()
        loss.backward()
        if t:
            ref_opt.zero_grad()
            loss0 = ref(*batch)
            loss0.backward()
        rel_loss = max(rel_loss, rf._compare(loss.detach(), loss0.detach(), pm, ref)["rel_loss"])
        rel_grad = max(rel_grad, rf._compare(loss.detach(), loss0.detach(), pm, ref)["rel_grad"])
        opt.step()
        ref_opt.step()
        for n, p_ in ref.named_parameters():
            got = (DTensor.from_local(homes[n], pm.mesh, list(pm.param_placements[n])).full_tensor() if n in homes
                   else named[n].full_tensor())
            param_err = max(param_err, float((got - p_.detach()).abs().max()))
    out.update(rel_loss=rel_loss, rel_grad=rel_grad, param_err=param_err, freed_at_end=freed(),
               host_optimizer=isinstance(opt, HostOptimizer),
               home_bytes=sum(h.numel() * h.element_size() for h in homes.values()))
    return out


CASES = {"one_process_stages": _one_process_stages, "two_process_stages": _two_process_stages,
         "delayed_scaling": _delayed_scaling, "offload_params": _offload_params}


def run_case(name: str, world: int) -> dict[str, Any]:
    return CASES[name](world)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("torch_staged_choices") / "results.json"
    return torch_cases.run_distributed(list(CASES), WORLD, str(out), run_one=run_case)


def test_stages_of_one_process_run_fp8_products_activation_offload_and_recomputation(results):
    r = results["one_process_stages"]
    assert "error" not in r, r.get("error")
    assert r["stages"] == 4 and r["fp8_ops"] == 12 and r["held"] == r["params"]
    assert r["delayed_by_default"] == 3  # the stages with FP8 products (not the head's); run with current scaling
    assert r["segments"] == 2  # the recomputed runs: layers.3's up and gelu, layers.5's down
    assert r["rel_loss"] <= 1e-5 and r["rel_grad"] <= 1e-4
    assert r["fp8_off"] > 1e-4, "the FP8 products are in effect: the float32 loss is far off"
    assert r["host_bytes"] > 0


def test_stages_of_two_processes_run_the_ring_fp8_offload_and_recomputation(results):
    """Each of the 4 processes runs its stage's attention by the ring (once per micro-batch forward, once more in
    the backward pass), the stage's two MLP products in FP8; one stage offloads, the other recomputes."""
    r = results["two_process_stages"]
    assert "error" not in r, r.get("error")
    assert r["ring"] and r["ring_calls"] > 0 and r["fp8_ops"] == 2 and r["delayed_by_default"] == 4
    assert r["offload"] == 2 and r["recompute"] == 2  # one operator each, on both processes of its stage
    assert r["rel_loss"] <= 1e-5 and r["rel_grad"] <= 1e-4
    assert r["fp8_off"] > 1e-4 and r["host_bytes"] > 0


def test_stages_run_delayed_scaling_over_three_steps(results):
    """``pipe.delayed_scaling()``: stages of one process and of two (DTensors) scale every FP8 cast from its amax
    history (scale 1 at the first step, so not current scaling's step), one entry per step; three SGD steps equal
    one process running the same rule, loss and gradients at every step."""
    r = results["delayed_scaling"]
    assert "error" not in r, r.get("error")
    one = r["program"]  # a ParallelModule of one program: delayed scaling is its default for FP8 products
    assert one["fp8_ops"] == 4 and one["keys"] == 12 and one["split"] > 0
    assert one["rel_loss"] <= 1e-5 and one["rel_grad"] <= 1e-4, one
    for kind, keys, default in (("one", 36, 3), ("two", 12, 4)):  # x, W and dY of each FP8 linear
        assert r[kind]["keys"] == keys and r[kind]["default"] == default  # the processes with FP8 products
        assert r[kind]["rel_loss"] <= 1e-5 and r[kind]["rel_grad"] <= 1e-4, r[kind]
        assert r[kind]["first_vs_current"] > 1e-5, r[kind]
        assert r[kind]["losses"][2] < r[kind]["losses"][0]


def test_offloaded_parameters_live_in_host_memory_between_uses(results):
    r = results["offload_params"]
    assert "error" not in r, r.get("error")
    assert len(r["homes"]) == 4 and r["host_optimizer"]  # both linears' weights and biases
    assert r["freed_at_start"] and r["freed_after_forward_0"] and r["freed_after_forward_1"] and r["freed_at_end"]
    assert r["home_bytes"] > 0
    assert r["rel_loss"] <= 1e-5 and r["rel_grad"] <= 1e-4 and r["param_err"] <= 1e-5, r


def test_state_the_stage_runner_does_not_hold_is_refused():
    """Checked on the plan before anything is traced (so any module will do here)."""
    import shardplan.torch as st
    from shardplan.errors import ShardplanError
    from shardplan.machine import preset
    from shardplan.recipe import cost_recipe

    plan = cost_recipe("gpt", preset("h100", 8), "pp=2,tp=2,dp=2,mbs=2", batch=8)
    name = next(iter(plan.stages[0].operators))
    one = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, devices=1) for s in plan.stages))  # any q
    both = ("optimizer", "parameters")
    for bad, match in ((edited(plan, {name: {"state_stage": 2, "offload": both}}), "parameters at ZeRO stage 2: "),
                       (edited(one, {name: {"state_stage": 1, "offload": both}}), "parameters at ZeRO stage 1: ")):
        with pytest.raises(ShardplanError, match=match):
            st.apply(bad, nn.Linear(2, 2), (torch.zeros(1, 2),))
