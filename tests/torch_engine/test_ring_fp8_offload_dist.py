"""Ring attention, FP8 products and host offload on 4 gloo processes, one launch for every case; each run
against one process.

* ``ring_fn``: :func:`shardplan.torch.ring.ring_attention_sharded` (causal balanced, causal contiguous,
  non-causal) against the attention written out on the whole sequence: the summed loss and every block's
  query, key and value gradients;
* ``ring_run``: a causal attention layer with every operator splitting the sequence 4 ways (or the batch
  2 ways and the sequence 2 ways, on a 2 x 2 mesh; or recomputed; or with one key/value head for two
  query heads), the causal attention dealt into the
  balanced order, run by
  :class:`~shardplan.torch.run.ParallelModule` with the ring and without: both equal to one process, and the
  ring gathers neither keys nor values (two all-gathers fewer);
* ``ring_plan``: ``st.plan(..., context="ring")`` of one long sequence splits the queries and ``st.apply``
  runs it with the plan's choice; its keys are gathered by their producers' layouts, so the ring is not
  taken (as many all-gathers as without it); both equal to one process;
* ``fp8``: a tensor-parallel MLP whose two products run in FP8 (their weights and activations sharded, so
  the per-tensor scale needs the whole tensor's amax) against one process that casts the same operands
  with its own code; the FP8 loss differs from the FP32 one;
* ``offload``: the same MLP with every operator's saved activations in host memory, and the optimizer
  step on host copies; and with the sequence split and the linears' parameters at ZeRO-3 (gathered again
  in the backward pass, not offloaded) (``pm.optimizer``: a :class:`~shardplan.torch.precision.HostOptimizer`,
  Adam): loss, gradients and the updated parameters equal one process's;
* ``loaded_plan``: the MLP's plan with FP8 products and activation offload written to JSON, loaded and run by
  ``st.apply``: equal to the unsharded FP8 program.
"""

from __future__ import annotations

from typing import Any

import pytest

import torch
import torch.nn.functional as F
from torch import nn

import torch_cases  # noqa: E402  (tests/ is on sys.path, see conftest.py)

pytestmark = pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out

WORLD = 4
B, S, D, H, FF = 2, 16, 8, 2, 32


class Attn(nn.Module):
    """q, k, v projections, causal SDPA over 2 heads, an output projection; the loss a weighted sum.
    ``kv_heads=1``: grouped-query attention, one key/value head for both query heads."""

    def __init__(self, kv_heads: int = H) -> None:
        super().__init__()
        self.kv_heads = kv_heads
        self.q, self.o = nn.Linear(D, D, bias=False), nn.Linear(D, D, bias=False)
        self.k, self.v = (nn.Linear(D, D // H * kv_heads, bias=False) for _ in range(2))

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, H, D // H).transpose(1, 2)
        k, v = (f(x).view(b, s, self.kv_heads, D // H).transpose(1, 2) for f in (self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != H)
        return (torch.tanh(self.o(y.transpose(1, 2).reshape(b, s, D))) * w).sum()


def _qdq(t: torch.Tensor, fmt: Any, largest: float) -> torch.Tensor:
    """The test's own FP8 cast: per-tensor scale from the whole tensor's amax, rounded, scaled back."""
    s = largest / t.detach().abs().max()
    return (t.detach() * s).to(fmt).to(t.dtype) / s


class MLP(nn.Module):
    """Two linears with a tanh between; ``fp8``: their inputs and weights cast to E4M3 and their output
    gradients to E5M2 (the unsharded FP8 program, written independently of shardplan's)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, FF), nn.Linear(FF, D)
        self.fp8 = False

    def _linear(self, lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if not self.fp8:
            return lin(x)
        cast = lambda t: t + (_qdq(t, torch.float8_e4m3fn, 448.0) - t).detach()  # noqa: E731
        y = F.linear(cast(x), cast(lin.weight), lin.bias)
        y.register_hook(lambda g: _qdq(g, torch.float8_e5m2, 57344.0))
        return y

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (torch.tanh(self._linear(self.fc2, torch.tanh(self._linear(self.fc1, x)))) * w).sum()


def _layouts(graph: Any, p: int, batch: int = 1, hidden: bool = True) -> dict[str, Any]:
    """Every operator splits ``p / batch`` ways the dimension of extent FF (the MLP's hidden one: column- then
    row-parallel) where it has one (and ``hidden``), else its sequence (the first unfixed dimension of extent
    S), and its first dimension (the batch) ``batch`` ways."""
    from shardplan.layout import Layout

    out = {}
    for op in graph.operators:
        ext = op.extents
        pick = next((d for d in op.dim_names if ext[d] == FF and hidden), None) or next(
            (d for d in op.dim_names if ext[d] == S and d not in op.fixed), None)
        split = {pick: p // batch, op.dim_names[0]: batch}
        out[op.name] = Layout.flat(op.dim_names, tuple(split.get(d, 1) for d in op.dim_names), p)
    return out


def _compare(loss: torch.Tensor, loss0: torch.Tensor, pm: Any, ref: nn.Module) -> dict[str, float]:
    worst, scale = 0.0, 0.0
    named = pm.named_dparameters()
    for n, p_ in ref.named_parameters():
        g = named[n].grad.full_tensor()
        worst = max(worst, float((g - p_.grad).abs().max()))
        scale = max(scale, float(p_.grad.abs().max()))
    return {"rel_loss": abs(float(loss) - float(loss0)) / abs(float(loss0)), "rel_grad": worst / scale}


def _ring_fn(world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from shardplan.torch.ring import attention_reference, balanced_positions, ring_attention_sharded

    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    q, k, v, w = (torch.randn(B, H, 4 * S, D, generator=gen) for _ in range(4))
    out = {}
    for causal, balanced in ((True, True), (True, False), (False, False)):
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        ref = (torch.tanh(attention_reference(qr, kr, vr, causal)) * w).sum()
        ref.backward()
        ref = ref.detach()
        pos = balanced_positions(4 * S, world, balanced)
        rows = torch.as_tensor(pos[rank])
        ql, kl, vl = (t[:, :, rows].clone().requires_grad_() for t in (q, k, v))
        loss = (torch.tanh(ring_attention_sharded(ql, kl, vl, None, pos if causal else None)) * w[:, :, rows]).sum()
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        err = torch.tensor([max(float((a.grad - b.grad[:, :, rows]).abs().max()) / float(b.grad.abs().max())
                                for a, b in ((ql, qr), (kl, kr), (vl, vr)))])
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        out[f"causal={causal} balanced={balanced}"] = {
            "rel_loss": abs(float(total) - float(ref)) / abs(float(ref)), "rel_grad": float(err)}
    return out


def _ring_run(world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    from shardplan.torch.frontend import trace
    from shardplan.torch.run import ParallelModule, RunChoices

    torch.manual_seed(0)
    model, batch = Attn(), (torch.randn(B, S, D), torch.randn(B, S, D))
    ref = torch_cases._clone(model)
    loss0 = ref(*batch)
    loss0.backward()
    graph, info = trace(torch_cases._clone(model), batch)
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for split in (1, 2):  # the sequence split 4 ways; the batch 2 ways and the sequence 2 ways (a 2 x 2 mesh)
        for ring in (True, False):
            pm = ParallelModule.create(torch_cases._clone(model), info, graph, _layouts(graph, world, split), mesh,
                                       RunChoices(ring=ring))
            with CommDebugMode() as comm:
                loss = pm(*batch)
                loss.backward()
            gathers = sum(int(v) for k, v in comm.get_comm_counts().items() if "all_gather" in str(k))
            out[f"batch={split} ring={ring}"] = {**_compare(loss.detach(), loss0.detach(), pm, ref),
                                                 "all_gathers": gathers, "mesh": list(pm.mesh.mesh.shape)}
    # the ring inside recomputed segments: its forward runs again in the backward pass, on every rank alike
    names = frozenset(op.name for op in graph.operators)
    pm = ParallelModule.create(torch_cases._clone(model), info, graph, _layouts(graph, world), mesh,
                               RunChoices(ring=True, recompute=names))
    loss = pm(*batch)
    loss.backward()
    out["recompute ring=True"] = _compare(loss.detach(), loss0.detach(), pm, ref)
    # grouped-query attention: one key/value head passed round for both query heads
    gqa = Attn(kv_heads=1)
    ref = torch_cases._clone(gqa)
    loss0 = ref(*batch)
    loss0.backward()
    graph, info = trace(torch_cases._clone(gqa), batch)
    pm = ParallelModule.create(torch_cases._clone(gqa), info, graph, _layouts(graph, world), mesh,
                               RunChoices(ring=True))
    with CommDebugMode() as comm:
        loss = pm(*batch)
        loss.backward()
    gathers = sum(int(v) for k, v in comm.get_comm_counts().items() if "all_gather" in str(k))
    out["gqa ring=True"] = {**_compare(loss.detach(), loss0.detach(), pm, ref), "all_gathers": gathers}
    # ring_sdpa alone: the sequence split on both axes of a 2 x 2 mesh (one ring over the flattened group);
    # grouped-query attention with the heads split beside the sequence; a boolean mask that is not causal
    out["two axes ring=True"] = _ring_direct((2, 2), ("s", "s"))
    out["gqa heads split ring=True"] = _ring_direct((2, 2), ("h", "s"), kv_heads=H)
    out["bool mask ring=True"] = _ring_direct((2, 2), ("b", "s"), mask="bool")
    return out


def _ring_direct(mesh_shape: tuple[int, ...], placements: tuple[str, ...], kv_heads: int = H,
                 mask: str = "causal") -> dict[str, Any]:
    """``ring_sdpa`` on DTensors of ``B x 2H heads x 4S x D`` laid out by ``placements`` on a mesh of
    ``mesh_shape`` ("b", "h", "s": ``Shard`` of the batch, heads or sequence; "r": replicated), against
    PyTorch's attention of the whole tensors: the loss, every input's gradient, and how many attentions
    ran by the ring (not the fallback that gathers the keys). ``kv_heads`` K/V heads for the 2H query heads;
    ``mask``: "causal" or "bool" (a boolean mask of every query and key that is not causal: the
    ring adds it to each block's scores)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import shardplan.torch.ring as ring_module
    from shardplan.torch.ring import ring_sdpa
    from shardplan.torch.run import _sdpa

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=tuple(f"m{i}" for i in range(len(mesh_shape))))
    pl = [{"b": Shard(0), "h": Shard(1), "s": Shard(2), "r": Replicate()}[c] for c in placements]
    gen = torch.Generator().manual_seed(3)
    n, heads = 4 * S, 2 * H
    q, w = (torch.randn(B, heads, n, D, generator=gen) for _ in range(2))
    k, v = (torch.randn(B, kv_heads, n, D, generator=gen) for _ in range(2))
    kw: dict[str, Any] = {"enable_gqa": kv_heads != heads}
    if mask == "causal":
        kw["is_causal"] = True
    else:
        kw["attn_mask"] = (torch.arange(n)[:, None] + 2 * torch.arange(n)[None, :]) % 5 != 0
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = (torch.tanh(F.scaled_dot_product_attention(qr, kr, vr, **kw)) * w).sum()
    ref.backward()
    qd, kd, vd = (distribute_tensor(t.clone().requires_grad_(), mesh, pl) for t in (q, k, v))
    calls: list[int] = []
    inner = ring_module.ring_attention_sharded
    ring_module.ring_attention_sharded = lambda *a, **k_: calls.append(1) or inner(*a, **k_)
    try:
        out = ring_sdpa(qd, kd, vd, fallback=_sdpa, **kw)
    finally:
        ring_module.ring_attention_sharded = inner
    loss = (torch.tanh(out.full_tensor()) * w).sum()
    loss.backward()
    err = max(float((a.grad.full_tensor() - b.grad).abs().max()) / float(b.grad.abs().max())
              for a, b in ((qd, qr), (kd, kr), (vd, vr)))
    return {"rel_loss": abs(float(loss) - float(ref)) / abs(float(ref)), "rel_grad": err, "ring_calls": len(calls)}


def _ring_plan(world: int) -> dict[str, Any]:
    """``st.plan(..., context="ring")`` on the toy machine, one sequence of 4 S tokens (the plan splits the
    queries), run by ``st.apply``; against one process and the same layouts run without the choice."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    import shardplan.torch as st
    from shardplan.planner import spmd_of
    from shardplan.torch.frontend import trace
    from shardplan.torch.run import ParallelModule

    torch.manual_seed(0)
    model, batch = Attn(), (torch.randn(1, 4 * S, D), torch.randn(1, 4 * S, D))
    ref = torch_cases._clone(model)
    loss0 = ref(*batch)
    loss0.backward()
    mesh = init_device_mesh("cpu", (world,))
    plan = st.plan(torch_cases._clone(model), batch, mesh, machine=torch_cases.toy_machine(world), context="ring")
    out: dict[str, Any] = {"attention_splits": [list(c.layout.split) for n, c in plan.operators.items()
                                                if c.kind == "attn_flash"]}
    for ring in (True, False):
        if ring:
            pm = st.apply(plan, torch_cases._clone(model), batch, mesh)
        else:
            graph, info = trace(torch_cases._clone(model), batch)
            pm = ParallelModule.create(torch_cases._clone(model), info, graph, spmd_of(plan, graph).layouts, mesh)
        with CommDebugMode() as comm:
            loss = pm(*batch)
            loss.backward()
        gathers = sum(int(v) for k, v in comm.get_comm_counts().items() if "all_gather" in str(k))
        out[f"ring={ring}"] = {**_compare(loss.detach(), loss0.detach(), pm, ref), "all_gathers": gathers,
                               "choice": pm.choices.ring}
    return out


def _hf_ring(world: int) -> dict[str, Any]:
    """A one-layer Hugging Face Llama (grouped-query attention, the K/V heads expanded before the call; its
    causal mask built by the library under ``torch.export``), one sequence of 64 tokens,
    ``st.plan(..., context="ring")`` on the toy machine (on rank 0, loaded from its JSON on every rank:
    ``torch_cases.planned_on_rank_0``), run by ``st.apply``; against one process, and the
    same plan run with its keys and values gathered instead (the ring's choice turned off). ``ring_calls``:
    how many attentions ran by the ring, and with a causal mask (the library's mask recognised)."""
    import dataclasses

    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaConfig, LlamaForCausalLM

    import shardplan.torch as st
    import shardplan.torch.ring as ring_module
    from shardplan.torch import run
    from shardplan.torch.ring import SDPA

    seq = 64
    cfg = LlamaConfig(vocab_size=torch_cases.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=seq, use_cache=False,
                      attn_implementation="sdpa")  # 2 heads: 4 ranks must split the sequence, not the heads
    torch.manual_seed(0)
    model = torch_cases.HFLoss(LlamaForCausalLM(cfg))
    g = torch.Generator().manual_seed(5)
    batch = tuple(torch.randint(0, torch_cases.VOCAB, (1, seq), generator=g) for _ in range(2))
    ref = torch_cases._clone(model)
    loss0 = ref(*batch)
    loss0.backward()
    mesh = init_device_mesh("cpu", (world,))
    plan, _ = torch_cases.planned_on_rank_0(lambda: (st.plan(torch_cases._clone(model), batch, mesh,
                                                             machine=torch_cases.toy_machine(world), context="ring"),
                                                     None))
    attn = [c for c in plan.operators.values() if c.kind == "attn_flash"]
    out: dict[str, Any] = {"attention_splits": [dict(zip(c.layout.dims, c.layout.split)) for c in attn]}
    calls: list[bool] = []
    inner = ring_module.ring_attention_sharded

    def counted(q, k, v, group=None, positions=None, scale=None, bias=None):
        calls.append(positions is not None)
        return inner(q, k, v, group, positions, scale, bias)

    seen: list[list[bool]] = []  # per attention without the ring: (no mask, the causal flag) as the kernel gets them
    plain = run._REWRITES[SDPA]

    def watched(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, **kw):
        seen.append([attn_mask is None, bool(is_causal)])  # kw: the balanced all-gather's chunks
        return plain(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, **kw)

    ring_module.ring_attention_sharded = counted  # this worker process only
    run._REWRITES[SDPA] = watched
    try:
        for ring in (True, False):
            calls.clear()
            seen.clear()
            pm = st.apply(plan, torch_cases._clone(model), batch, mesh)
            pm.choices = dataclasses.replace(pm.choices, ring=ring)
            loss = pm(*batch)
            loss.backward()
            out[f"ring={ring}"] = {**_compare(loss.detach(), loss0.detach(), pm, ref), "ring_calls": list(calls),
                                   "sdpa_calls": list(seen)}
    finally:
        ring_module.ring_attention_sharded = inner
        run._REWRITES[SDPA] = plain
    return out


def _mlp_reference(fp8: bool) -> tuple[Any, tuple[Any, Any], Any, Any]:
    """The MLP and its batch (torch.manual_seed(0)), and the unsharded reference (FP8 products if ``fp8``) after its backward:
    (model, batch, reference, its loss)."""
    torch.manual_seed(0)
    model, batch = MLP(), (torch.randn(B, S, D), torch.randn(B, S, D))
    ref = torch_cases._clone(model)
    ref.fp8 = fp8
    loss0 = ref(*batch)
    loss0.backward()
    return model, batch, ref, loss0


def _mlp_run(world: int, fp8: bool, offload: bool, zero3: bool = False) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from shardplan.torch.frontend import trace
    from shardplan.torch.precision import HostOptimizer
    from shardplan.torch.run import ParallelModule, RunChoices

    model, batch, ref, loss0 = _mlp_reference(fp8)
    graph, info = trace(torch_cases._clone(model), batch)
    names = frozenset(op.name for op in graph.operators)
    choices = RunChoices(fp8=frozenset(n for n in names if "linear" in n) if fp8 else frozenset(),
                         offload=names if offload else frozenset(),
                         offload_optimizer=names if offload else frozenset(),
                         zero3=frozenset(n for n in names if "linear" in n) if zero3 else frozenset())
    mesh = init_device_mesh("cpu", (world,))
    lays = _layouts(graph, world, hidden=not zero3)  # ZeRO-3: the sequence split, the weights sharded over it
    pm = ParallelModule.create(torch_cases._clone(model), info, graph, lays, mesh, choices).current_scaling()
    loss = pm(*batch)
    loss.backward()
    out: dict[str, Any] = {**_compare(loss.detach(), loss0.detach(), pm, ref), "offloaded_bytes": pm.host.saved_bytes,
                           "loss": float(loss), "fp32_loss": float(torch_cases._clone(model)(*batch))}
    if zero3:  # the gathered weights are not saved (nor sent to the host) but gathered again
        plain = ParallelModule.create(torch_cases._clone(model), info, graph, lays, mesh,
                                      RunChoices(offload=choices.offload))
        plain(*batch).backward()
        out["offloaded_bytes_without_zero3"] = plain.host.saved_bytes
    if offload:
        opt = pm.optimizer(torch.optim.Adam, lr=0.1)  # the plan's operators keep their optimizer state on the host
        out["host_optimizer"] = isinstance(opt, HostOptimizer) and opt.device is None
        opt.step()
        ref_opt = torch.optim.Adam(ref.parameters(), lr=0.1)
        ref_opt.step()
        named = pm.named_dparameters()
        out["param_err"] = max(float((named[n].full_tensor() - p_.detach()).abs().max())
                               for n, p_ in ref.named_parameters())
        out["moved"] = min(float((named[n].full_tensor() - p_.detach()).abs().max())
                           for n, p_ in model.named_parameters())
        out["state_bytes"] = opt.state_bytes()
        locals_ = {named[n].to_local().data_ptr() for n in named}
        out["state_apart"] = all(v.data_ptr() not in locals_ for s in opt.inner.state.values()
                                 for v in s.values() if isinstance(v, torch.Tensor) and v.dim())
    return out


def _loaded_plan(world: int) -> dict[str, Any]:
    """The tensor-parallel MLP's plan with FP8 products and activation offload, written to JSON and loaded
    again, run by ``st.apply``: against the unsharded FP8 program."""
    from dataclasses import replace

    from torch.distributed.device_mesh import init_device_mesh

    import shardplan.torch as st
    from shardplan.cost import build_tables
    from shardplan.fit import plan_with_choices
    from shardplan.planner import from_spmd
    from shardplan.result import Plan
    from shardplan.spmd import plan_from_configs
    from shardplan.torch.frontend import trace

    model, batch, ref, loss0 = _mlp_reference(True)
    graph, _ = trace(torch_cases._clone(model), batch)
    machine = replace(torch_cases.toy_machine(world), fp8_flops=64e9, host_bandwidth=8e9, host_memory_bytes=1e10)
    tables = build_tables(graph, machine, cutoff=1)
    fit = plan_with_choices(plan_from_configs(tables, _layouts(graph, world)), fp8=True, offload=("activations",))
    loaded = Plan.from_json(from_spmd(fit).to_json())
    mesh = init_device_mesh("cpu", (world,))
    pm = st.apply(loaded, torch_cases._clone(model), batch, mesh)
    delayed = pm.scaling is not None  # the default; the reference casts with current scaling
    loss = pm.current_scaling()(*batch)
    loss.backward()
    return {**_compare(loss.detach(), loss0.detach(), pm, ref), "offloaded_bytes": pm.host.saved_bytes,
            "fp8": sorted(pm.choices.fp8), "planned_fp8": sorted(n for n, c in loaded.operators.items() if c.fp8),
            "delayed_by_default": delayed}


def run_all(name: str, world: int) -> dict[str, Any]:
    if name == "ring_fn":
        return _ring_fn(world)
    if name == "ring_run":
        return _ring_run(world)
    if name == "ring_plan":
        return _ring_plan(world)
    if name == "hf_ring":
        return _hf_ring(world)
    if name == "loaded_plan":
        return _loaded_plan(world)
    return _mlp_run(world, fp8=name == "fp8", offload=name.startswith("offload"), zero3=name == "offload_zero3")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("torch_ring_fp8") / "results.json"
    return torch_cases.run_distributed(["ring_fn", "ring_run", "ring_plan", "hf_ring", "fp8", "offload",
                                        "offload_zero3", "loaded_plan"], WORLD, str(out),
                                       run_one=run_all)


def _ok(r: dict[str, Any]) -> None:
    assert "error" not in r, r.get("error")


def test_ring_attention_equals_the_unsharded_loss_and_gradients(results):
    r = results["ring_fn"]
    _ok(r)
    assert len(r) == 3
    for case, x in r.items():
        assert x["rel_loss"] <= 1e-5 and x["rel_grad"] <= 1e-5, (case, x)


def test_the_runner_runs_the_ring_where_the_plan_says_and_gathers_no_keys(results):
    r = results["ring_run"]
    _ok(r)
    for x in r.values():
        assert x["rel_loss"] <= 1e-5 and x["rel_grad"] <= 1e-4, r
    assert len(r) == 9 and r["gqa ring=True"]["all_gathers"] == 0
    for case in ("two axes", "gqa heads split", "bool mask"):  # not the fallback that gathers the keys
        assert r[f"{case} ring=True"]["ring_calls"] == 1, r
    assert r["batch=2 ring=True"]["mesh"] == [2, 2] and r["batch=1 ring=True"]["mesh"] == [4]
    # without the ring the keys and the values are gathered before attention (and their gradients scattered back)
    for split in (1, 2):
        assert r[f"batch={split} ring=False"]["all_gathers"] == r[f"batch={split} ring=True"]["all_gathers"] + 2, r


def test_a_plan_made_with_the_ring_runs_as_planned(results):
    """The plan's choice reaches the run. The tables offer the ring for the fused core wherever the keys'
    producers leave them scattered over the query split; this plan (a short sequence of narrow heads)
    gathers them at the key and value views already (their sequence whole), where the ring would replace no
    gather, so the run gathers as planned, as many times as without it."""
    r = results["ring_plan"]
    _ok(r)
    (split,) = r["attention_splits"]
    assert split[2] > 1, split  # the queries are split (dims b h s k t)
    assert r["ring=True"]["choice"] and not r["ring=False"]["choice"]
    for x in (r["ring=True"], r["ring=False"]):
        assert x["rel_loss"] <= 1e-5 and x["rel_grad"] <= 1e-4, r
    assert r["ring=False"]["all_gathers"] == r["ring=True"]["all_gathers"], r


def test_a_hugging_face_llama_planned_with_the_ring_runs_it_as_unsharded(results):
    """The traced SDPA is the fused core, its mask (built by transformers) causal: the plan made with
    context="ring" splits its queries, and the run passes keys and values round the ring, causally, with
    the loss and gradients of one process."""
    r = results["hf_ring"]
    _ok(r)
    (split,) = r["attention_splits"]
    assert split["s"] > 1 and split["t"] == split["k"] == 1, split
    assert r["ring=True"]["ring_calls"] == [True] and r["ring=False"]["ring_calls"] == [], r
    # without the ring the kernel gets the causal flag, not the library's mask: it skips the masked blocks
    assert r["ring=False"]["sdpa_calls"] == [[True, True]] and r["ring=True"]["sdpa_calls"] == [], r
    for x in (r["ring=True"], r["ring=False"]):
        assert x["rel_loss"] <= 1e-5 and x["rel_grad"] <= 1e-4, r


def test_fp8_products_equal_the_unsharded_fp8_program(results):
    r = results["fp8"]
    _ok(r)
    assert r["rel_loss"] <= 1e-5 and r["rel_grad"] <= 1e-4, r
    assert abs(r["loss"] - r["fp32_loss"]) > 1e-3 * abs(r["fp32_loss"]), r  # the casts happened
    assert r["offloaded_bytes"] == 0


@pytest.mark.parametrize("name", ["offload", "offload_zero3"])
def test_offloaded_activations_and_optimizer_state_change_nothing(results, name):
    r = results[name]
    _ok(r)
    assert r["rel_loss"] <= 1e-5 and r["rel_grad"] <= 1e-4, r
    assert r["offloaded_bytes"] > 0 and r["state_bytes"] > 0 and r["state_apart"] and r["host_optimizer"], r
    assert r["param_err"] <= 1e-6 and r["moved"] > 1e-3, r
    if name == "offload_zero3":  # fc2's weight (D x FF floats), saved for its input's gradient, is regathered
        # instead of offloaded; fc1's is not saved at all (its input, the data, needs no gradient)
        assert r["offloaded_bytes_without_zero3"] - r["offloaded_bytes"] == D * FF * 4, r


def test_a_plan_loaded_from_json_runs_its_fp8_products_and_offload(results):
    r = results["loaded_plan"]
    _ok(r)
    assert r["fp8"] == r["planned_fp8"] and len(r["fp8"]) == 2, r  # both linears
    assert r["delayed_by_default"]
    assert r["rel_loss"] <= 1e-5 and r["rel_grad"] <= 1e-4, r
    assert r["offloaded_bytes"] > 0, r
