"""A pipeline plan whose stages shard state (ZeRO-1, 2, 3) or keep it in host memory trains on PyTorch (4 gloo
processes, :meth:`shardplan.torch.staged.TorchPipeline.optimizer`): 2 stages of 2 processes, every block linear data
parallel (its weight replicated on the stage's 2 processes) at ZeRO-1, ZeRO-2 (and at ZeRO-0, 1, 2 over 4
micro-batches, counting the collectives each step sends), ZeRO-2 with its optimizer state in
host memory (ZeRO-Offload) and ZeRO-3 with its shards and their state in host memory (ZeRO-Infinity's
``offload_param``); and 4 stages of one process with every linear's optimizer state in host memory, then its
parameters too. Two Adam steps equal one process's (loss and parameters to 1e-6, relative), with Adam's state of
every linear in shards (half of it on each process of its stage), at ZeRO-2 the gradients too, at ZeRO-3 the
parameters too, and offloaded state and parameters in their host copies. In this process: what the stage runner
refuses (parameters in host memory beside a ZeRO stage other than 3) and accepts."""

from __future__ import annotations

import functools
from typing import Any

import pytest

import torch
from torch import nn

import torch_cases  # noqa: E402  (tests/ is on sys.path, see conftest.py)
import torch_pipeline_cases  # noqa: E402

pytestmark = pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out

WORLD = 4
B, D = 8, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for blk in self.layers:
            x = blk(x)
        return ((x - y) ** 2).mean()


@functools.cache
def searched_mlp(world: int, m: int) -> tuple[Any, Any]:
    """The pipeline search's plan of :class:`Mlp` (2 stages of 2 processes, ``m`` micro-batches) and its graph at one
    micro-batch: made once per process and shared by the cases of one ``m`` (the search is deterministic and a
    plan is frozen; each case edits its own copy and trains its own fresh model). The model is built under
    ``torch.random.fork_rng``, leaving the caller's random state alone."""
    from shardplan.pipeline.api import pipeline_solve
    from shardplan.planner import from_pipeline
    from shardplan.torch.staged import Tracer

    with torch.random.fork_rng():
        torch.manual_seed(0)
        model, batch = Mlp(), (torch.randn(B, D), torch.randn(B, D))
    tracer = Tracer(model, batch)
    plan = from_pipeline(pipeline_solve(tracer, tracer.batch, torch_pipeline_cases.toy_machine(world),
                                        micro_batches=(m,), sizes=(2,), uniform=True, schedules=("1f1b",), cutoff=1))
    return plan, tracer(B // m)


def data_parallel(world: int, stage: int, offload: tuple[str, ...] = (), m: int = 2) -> Any:
    """The pipeline search's plan of :class:`Mlp` (2 stages of 2 processes, ``m`` micro-batches), every operator laid
    out data parallel (its first dimension of the micro-batch's rows split 2 ways) and every linear at ZeRO ``stage``
    offloading ``offload``, as loaded from JSON."""
    import dataclasses

    from shardplan.layout import Layout

    torch.manual_seed(0)
    model, batch = Mlp(), (torch.randn(B, D), torch.randn(B, D))
    plan, graph = searched_mlp(world, m)
    rows = {op.name: next(d for d in op.dim_names if op.extents[d] == B // m) for op in graph.operators}

    def choice(name: str, c: Any) -> Any:
        lay = Layout.flat(c.layout.dims, tuple(2 if d == rows[name] else 1 for d in c.layout.dims), 2)
        linear = "linear" in name
        return dataclasses.replace(c, layout=lay, state_stage=stage if linear else 0,
                                   offload=offload if linear else ())

    stages = tuple(dataclasses.replace(s, operators={n: choice(n, c) for n, c in s.operators.items()})
                   for s in plan.stages)
    return dataclasses.replace(plan, stages=stages, detail=None), model, batch


def one_process_stages(stage: int, offload: tuple[str, ...]) -> Any:
    """:func:`torch_pipeline_cases.make_case`'s language model on 4 stages of one process (m = 4), every linear
    at ZeRO ``stage`` offloading ``offload``."""
    import test_torch_staged_choices as sc  # noqa: E402  (tests/torch_engine is on sys.path)

    model, batch = torch_pipeline_cases.make_case()
    plan, _ = sc.searched("case", (1,), 4)
    edits = {n: {"offload": offload, "state_stage": stage} for s in plan.stages for n in s.operators
             if "linear" in n}
    return sc.edited(plan, edits), model, batch


def _moments(opt: Any) -> list[tuple[Any, Any, Any]]:
    """(parameter or master shard the optimizer steps, the tensor holding its value there, Adam's first moment)
    for every parameter with state: a :class:`~shardplan.torch.precision.HostOptimizer` steps host copies, whose
    state is its inner optimizer's."""
    from shardplan.torch.precision import HostOptimizer
    from shardplan.torch.staged import ShardedStateOptimizer

    inner = opt.inner if isinstance(opt, ShardedStateOptimizer) else opt
    out = []
    if isinstance(inner, HostOptimizer):
        for p, h in zip(inner.params, inner.host_params):
            if h in inner.inner.state:
                out.append((p, h, inner.inner.state[h]["exp_avg"]))
        inner = inner.device
    if inner is not None:
        out += [(p, p, inner.state[p]["exp_avg"]) for g in inner.param_groups for p in g["params"] if p in inner.state]
    return out


def _sync_counts(pipe: Any, seen: list[tuple[str, tuple[int, ...]]]) -> dict[str, int]:
    """The collectives of ``seen`` on this process's stage parameters' local tiles or master-shard slices, by
    kind (the gradient synchronisation and the gather of updated shards; the stage's activations have other
    shapes)."""
    from torch.distributed.tensor import DTensor

    from shardplan.torch.run import zero3_placements

    shapes = set()
    for p in pipe.named_parameters().values():
        if isinstance(p, DTensor):
            shapes.add(tuple(p.to_local().shape))
            shard = zero3_placements(p.placements, p.shape, p.device_mesh.mesh.shape)
            shapes.add(tuple(p.detach().redistribute(p.device_mesh, shard).to_local().shape))
    out: dict[str, int] = {}
    for kind, shape in seen:
        if shape in shapes:
            out[kind] = out.get(kind, 0) + 1
    return out


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def _train(world: int, plan_case: tuple) -> dict[str, Any]:
    """Two Adam steps of the pipeline against one process; what each process holds after them."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import shardplan.torch as st
    from shardplan.torch.precision import HostOptimizer
    from shardplan.torch.staged import ShardedStateOptimizer

    plan, model, batch = plan_case
    ref = torch_cases._clone(model)
    pipe = st.apply(plan, model, batch)
    opt = pipe.optimizer(torch.optim.Adam, lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    homes: dict[str, Any] = {}  # target -> (parameter, its host home) for shards living in host memory
    for h in pipe.modules:
        if hasattr(h.module, "offloaded_parameters"):
            params = dict(h.module.named_parameters())
            homes.update({h.targets[n.removeprefix("weights.")]: (params[n], home)
                          for n, home in h.module.offloaded_parameters().items()})
    freed = lambda: all(_local(p).untyped_storage().nbytes() == 0 for p, _ in homes.values())  # noqa: E731
    rel_loss, param_err, freed_between = 0.0, 0.0, freed()
    backward_seen, step_seen, other_seen = [], [], []  # per Adam step: the collectives of pipe.step and opt.step
    for _ in range(2):
        with torch_cases.collective_recorder() as mode:
            loss = pipe.step(*batch)
        with torch_cases.collective_recorder() as opt_mode:
            opt.step()
        backward_seen.append(_sync_counts(pipe, [(k, sh) for k, _, sh in mode.seen]))
        step_seen.append(_sync_counts(pipe, [(k, sh) for k, _, sh in opt_mode.seen]))
        other_seen.append(len(mode.seen) + len(opt_mode.seen) - sum(backward_seen[-1].values())
                          - sum(step_seen[-1].values()))
        grads = [(p, p.grad) for h in pipe.modules for p in h.module.parameters() if p.grad is not None]
        opt.zero_grad()
        freed_between = freed_between and freed()
        ref_opt.zero_grad()
        ref_loss = ref(*batch)
        ref_loss.backward()
        ref_opt.step()
        ref_loss = ref_loss.detach()
        rel_loss = max(rel_loss, abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)))
        named = dict(ref.named_parameters())
        for target, p in pipe.named_parameters().items():
            if target in homes and isinstance(p, DTensor):  # its values live in the home (the device holds none)
                full = DTensor.from_local(homes[target][1], p.device_mesh, list(p.placements), shape=p.shape,
                                          stride=p.stride()).full_tensor()
            elif target in homes:
                full = homes[target][1]
            else:
                full = p.full_tensor() if hasattr(p, "full_tensor") else p
            param_err = max(param_err, float((full.detach() - named[target].detach()).abs().max()))
    err = torch.tensor(param_err)
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    sharded = isinstance(opt, ShardedStateOptimizer)
    host = opt.inner if sharded else opt
    host = host if isinstance(host, HostOptimizer) else None
    masters = opt.masters() if sharded else []
    moments = _moments(opt)
    held = [p for h in pipe.modules for p in h.module.parameters()]
    on_host = [] if host is None else list(zip(host.params, host.host_params))
    stepped = {id(p) for p, _, _ in moments}
    scale = max(float(p.detach().abs().max()) for p in ref.parameters())
    total = torch_pipeline_cases._total
    return {"sharded_params": total(sum(2 * p.to_local().numel() == p.numel() for p in held
                                        if isinstance(p, DTensor))),
            # per parameter (or master shard) with state: the elements of Adam's first moment this process holds
            "half_moments": total(sum(2 * _local(m).numel() == p.numel() for p, _, m in moments)),
            "moments": total(len(moments)),
            # the gradients held after the step (before zero_grad): those that are half of their parameter
            "half_grads": total(sum(2 * _local(g).numel() == p.numel() for p, g in grads)),
            "grads": total(len(grads)),
            "rel_loss": rel_loss, "rel_param": float(err) / scale,
            "sharded": total(int(sharded)), "masters": total(len(masters)),
            "master_steps": total(sum(id(m) in stepped for _, m in masters)),
            "host_optimizer": total(int(host is not None)),
            # state in host memory: host copies apart from the values they step (on a CPU, separate tensors) whose
            # moments the host optimizer holds; a shard living in host memory is stepped in its home itself
            "host_params": total(len(on_host)),
            "host_copies": total(sum(_local(p).data_ptr() != h.data_ptr() for p, h in on_host
                                     if id(p) not in host.homes) if host else 0),
            "host_moments": total(sum(h in host.inner.state for _, h in on_host) if host else 0),
            "device_moments": total(0 if host is None or host.device is None else len(host.device.state)),
            "homes": total(len(homes)),
            "stepped_in_home": total(sum(host.host_params[i].data_ptr() == homes[t][1].data_ptr()
                                         for t in homes for i, p in enumerate(host.params) if p is homes[t][0])
                                     if host else 0),
            "freed_between": total(int(freed_between)),
            # bytes the operators offloading their activations sent to the host over the two steps
            "host_bytes": total(sum(h.module.host.saved_bytes for h in pipe.modules)),
            "params_held": total(len(pipe.named_parameters())),
            # per Adam step, this process's collectives on its stage parameters (kind -> count) in the passes and in
            # the optimizer's step, and how many others (the activations' and the loss's)
            "backward_collectives": [_totals(d) for d in backward_seen],
            "step_collectives": [_totals(d) for d in step_seen], "other_collectives": other_seen}


def _totals(counts: dict[str, int]) -> dict[str, int]:
    """Collective counts by kind, summed over the ranks."""
    total = torch_pipeline_cases._total
    return {k: total(counts.get(k, 0)) for k in ("all_reduce", "reduce_scatter", "all_gather")}


CASES = {"zero1": lambda world: _train(world, data_parallel(world, 1)),
         "zero2": lambda world: _train(world, data_parallel(world, 2)),
         "zero2_offload": lambda world: _train(world, data_parallel(world, 2, ("optimizer",))),
         "zero3": lambda world: _train(world, data_parallel(world, 3)),
         "zero0_m4": lambda world: _train(world, data_parallel(world, 0, m=4)),
         "zero1_m4": lambda world: _train(world, data_parallel(world, 1, m=4)),
         "zero2_m4": lambda world: _train(world, data_parallel(world, 2, m=4)),
         "zero3_offload": lambda world: _train(world, data_parallel(world, 3, ("optimizer", "parameters"))),
         "one_process_offload": lambda world: _train(world, one_process_stages(1, ("optimizer",))),
         "one_process_offload_params": lambda world: _train(world, one_process_stages(3, ("optimizer", "parameters"))),
         "one_process_offload_acts": lambda world: _train(world, one_process_stages(3, ("optimizer", "activations"))),
         "one_process_offload_all": lambda world: _train(world, one_process_stages(
             3, ("optimizer", "parameters", "activations")))}


def run_case(name: str, world: int) -> dict[str, Any]:
    return CASES[name](world)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("torch_staged_zero") / "results.json"
    return torch_cases.run_distributed(list(CASES), WORLD, str(out), run_one=run_case)


def _like_one_process(r: dict[str, Any]) -> None:
    assert "error" not in r, r.get("error")
    assert r["rel_loss"] <= 1e-6 and r["rel_param"] <= 1e-6, r


def test_zero1_stages_train_like_one_process_with_the_state_in_shards(results):
    """Two Adam steps equal one process's; every process holds its stage's 4 linear parameters (2 weights, 2
    biases) whole, with their Adam state in master shards, half of each moment; after the step half of each
    gradient (summed locally over the micro-batches, then reduce-scattered into the master shard)."""
    r = results["zero1"]
    _like_one_process(r)
    assert r["sharded"] == WORLD and r["params_held"] == 2 * 8  # each stage's 4 parameters on each of its 2
    assert r["masters"] == WORLD * 4 and r["master_steps"] == WORLD * 4 and r["moments"] == WORLD * 4, r
    assert r["half_moments"] == WORLD * 4, r
    assert r["sharded_params"] == 0 and r["grads"] == WORLD * 4 and r["half_grads"] == WORLD * 4, r
    assert r["host_optimizer"] == 0 and r["homes"] == 0


def test_stage_gradients_are_sent_as_the_cost_tables_charge(results):
    """m = 4 micro-batches, per Adam step, summed over the 4 processes (each stage's 2 processes hold its 4 linear
    parameters, 16 parameter tiles in all): ZeRO-0 all-reduces each gradient once (16), after the micro-batches,
    not once per micro-batch (64); ZeRO-1 reduce-scatters each once into its master shard (16) and the step
    all-gathers each updated shard (16); ZeRO-2 reduce-scatters each micro-batch's (64) and gathers once (16):
    ``cost.memory.choice_table``'s stage 0 all-reduce and stage 1 reduce-scatter and gather once a step, stage 2's
    reduce-scatter per micro-batch. The activations' collectives are the same for the three; the loss and the
    parameters after two Adam steps equal one process's."""
    none = {"all_reduce": 0, "reduce_scatter": 0, "all_gather": 0}
    want = {"zero0_m4": ({**none, "all_reduce": 16}, none),
            "zero1_m4": ({**none, "reduce_scatter": 16}, {**none, "all_gather": 16}),
            "zero2_m4": ({**none, "reduce_scatter": 64}, {**none, "all_gather": 16})}
    for name, (passes, step) in want.items():
        r = results[name]
        _like_one_process(r)
        assert r["backward_collectives"] == [passes, passes], (name, r["backward_collectives"])
        assert r["step_collectives"] == [step, step], (name, r["step_collectives"])
    others = {tuple(results[name]["other_collectives"]) for name in want}
    assert len(others) == 1, others
    assert results["zero1_m4"]["half_grads"] == results["zero2_m4"]["half_grads"] == WORLD * 4
    assert results["zero0_m4"]["half_grads"] == 0 and results["zero0_m4"]["sharded"] == 0


def test_zero2_stages_reduce_scatter_the_gradients_into_shards(results):
    """ZeRO-2: the same, but each process holds only its half of every gradient after the step (reduce-scattered
    into the master shard and accumulated there over the 2 micro-batches), as the model charges."""
    r = results["zero2"]
    _like_one_process(r)
    assert r["sharded"] == WORLD and r["masters"] == WORLD * 4 and r["half_moments"] == WORLD * 4, r
    assert r["grads"] == WORLD * 4 and r["half_grads"] == WORLD * 4, r
    assert r["sharded_params"] == 0 and r["host_optimizer"] == 0


def test_zero2_stages_with_the_state_in_host_memory(results):
    """ZeRO-Offload: ZeRO-2 with every linear's optimizer state in host memory: the master shards are stepped by a
    HostOptimizer on host copies that hold the moments (half of each), none on the device."""
    r = results["zero2_offload"]
    _like_one_process(r)
    assert r["sharded"] == WORLD and r["masters"] == WORLD * 4 and r["half_grads"] == WORLD * 4, r
    assert r["host_optimizer"] == WORLD and r["host_params"] == WORLD * 4 and r["host_copies"] == WORLD * 4, r
    assert r["host_moments"] == WORLD * 4 and r["half_moments"] == WORLD * 4 and r["device_moments"] == 0, r


def test_zero3_stages_train_like_one_process_with_parameters_in_shards(results):
    """ZeRO-3: the stage's ParallelModule holds each linear parameter in shards (half on each process), gathered
    at each use; a plain Adam over them (no master shards) holds half of each moment."""
    r = results["zero3"]
    _like_one_process(r)
    assert r["sharded"] == 0 and r["params_held"] == 2 * 8
    assert r["sharded_params"] == WORLD * 4 and r["half_moments"] == WORLD * 4, r
    assert r["half_grads"] == WORLD * 4 and r["host_optimizer"] == 0


def test_zero3_stages_keep_their_shards_and_state_in_host_memory(results):
    """ZeRO-3 with parameters and optimizer state offloaded: every linear shard lives in its host home (the
    device shard holds no memory before, between and after the steps), the HostOptimizer steps it there, its
    moments (half of each) in host memory."""
    r = results["zero3_offload"]
    _like_one_process(r)
    assert r["homes"] == WORLD * 4 and r["freed_between"] == WORLD, r
    assert r["host_optimizer"] == WORLD and r["host_params"] == WORLD * 4 and r["stepped_in_home"] == WORLD * 4, r
    assert r["host_moments"] == WORLD * 4 and r["half_moments"] == WORLD * 4 and r["device_moments"] == 0, r


def test_stages_of_one_process_keep_the_offloaded_state_in_host_memory(results):
    """4 stages of one process (1F1B, 4 micro-batches), every linear's optimizer state in host memory: a
    HostOptimizer per process steps host copies of the linears' weights and biases, the rest on the device."""
    r = results["one_process_offload"]
    _like_one_process(r)
    assert r["sharded"] == 0 and r["host_optimizer"] == WORLD
    assert r["host_params"] == 2 * 13 and r["host_copies"] == 2 * 13 and r["host_moments"] == 2 * 13, r  # 13 linears
    assert r["device_moments"] == r["moments"] - 2 * 13 > 0, r  # the embedding and layer norms


def test_what_the_stage_runner_holds_and_refuses():
    """Accepted: ZeRO 1, 2 and 3 in any stage, optimizer state in host memory at any ZeRO stage, parameters in host
    memory at ZeRO-3 (shards of a stage of several processes, whole parameters of a stage of one). Refused:
    parameters in host memory beside a ZeRO stage other than 3 (no ZeRO-3 partition to move)."""
    from shardplan.errors import ShardplanError
    from shardplan.torch.staged import check_stage_choices

    def op(stage: int, offload: tuple = ()) -> list:
        return [[("layers.0/up/linear", False, offload, False, stage)]]

    for q in (1, 2):
        for stage in (0, 1, 2, 3):
            check_stage_choices(op(stage), q)
            check_stage_choices(op(stage, ("optimizer",)), q)
            check_stage_choices(op(stage, ("optimizer", "activations")), q)
        check_stage_choices(op(3, ("optimizer", "parameters")), q)
        for stage in (0, 1, 2):
            with pytest.raises(ShardplanError, match=f"'layers.0/up/linear' offloads its parameters at ZeRO stage "
                                                     f"{stage}: "):
                check_stage_choices(op(stage, ("optimizer", "parameters")), q)


def test_stages_of_one_process_keep_offloaded_parameters_in_host_memory(results):
    """4 stages of one process, every linear at ZeRO-3 with its parameters and optimizer state in host memory: each
    process keeps its linears' weights and biases whole in their homes (the device parameters holding no memory
    before, between and after the steps; the backward pass copies in what it reads), the HostOptimizer steps them
    there."""
    r = results["one_process_offload_params"]
    _like_one_process(r)
    assert r["homes"] == 2 * 13 and r["freed_between"] == WORLD, r
    assert r["host_optimizer"] == WORLD and r["host_params"] == 2 * 13 and r["stepped_in_home"] == 2 * 13, r
    assert r["host_moments"] == 2 * 13 and r["device_moments"] == r["moments"] - 2 * 13 > 0, r


def test_offloaded_parameters_beside_offloaded_activations_go_to_the_host_once(results):
    """The same stages with the linears' activations offloaded too: what they save of an offloaded weight (its
    view for the input's gradient) stays a reference to its home, so exactly the weights' bytes fewer go to the
    host than with the weights on the device (13 weights of 512 elements, float32, 4 micro-batches, 2 steps)."""
    acts, both = results["one_process_offload_acts"], results["one_process_offload_all"]
    _like_one_process(acts)
    _like_one_process(both)
    assert acts["homes"] == 0 and both["homes"] == 2 * 13 and both["freed_between"] == WORLD
    assert both["host_bytes"] > 0 and acts["host_bytes"] - both["host_bytes"] == 13 * 512 * 4 * 4 * 2, (acts, both)
