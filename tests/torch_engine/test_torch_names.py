"""The sharded PyTorch module under the model's own names, and plans that fit a memory budget.

4 gloo processes (CPU), one fixture for the module (tests/torch_cases.py's harness): on Hugging Face
GPT-2 and Llama as their authors wrote them and on a hand-written module with a tied head, a shared
submodule and buffers, ``pm.named_parameters()`` / ``state_dict()`` / ``load_state_dict()`` use the
model's names; AdamW with two parameter groups picked by name and ``clip_grad_norm_`` step on the
DTensor shards exactly as on the unsharded model. Plans under a memory budget fit it and run their
choices (recomputation, micro-batches, ZeRO-3) with the unsharded model's loss and gradients.
"""

from __future__ import annotations

import traceback
import warnings
from typing import Any

import pytest

import torch
import torch.nn.functional as F
from torch import nn

import torch_cases  # noqa: E402  (tests/ is on sys.path, see conftest.py)
from torch_cases import BATCH, D, SEQ, VOCAB

pytestmark = pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out

WORLD = 4
NAME_CASES = ["hf_gpt2", "hf_llama", "tiny_lm"]
FIT_CASES = ["fit_gpt2", "fit_llama_block", "fit_options", "forced_gpt2"]
# the fit cases of one model, run after one trace and one plan without a budget (run_fits)
FIT_GROUPS = {"fit_gpt2": ("fit_gpt2", "forced_gpt2"), "fit_llama_block": ("fit_llama_block", "fit_options")}
LR, DECAY = 1e-2, 0.1
EPS = 1e-4  # AdamW's first step moves by about LR * g / (|g| + eps): an eps far above the gradients' float
# error keeps near-zero gradients from amplifying it (by LR / eps) in the comparison

class TinyLM(nn.Module):
    """A language model with a head tied to the embedding, one submodule under two names, and a persistent
    and a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.norm = nn.LayerNorm(D)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
        self.mix = nn.Linear(D, D)
        self.mix_again = self.mix
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, D))
        pos = torch.arange(SEQ, dtype=torch.float32)[:, None] / (1.0 + torch.arange(D, dtype=torch.float32))
        self.register_buffer("pos", torch.sin(pos), persistent=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) * self.scale + self.pos
        x = x + self.mlp(self.norm(x))
        x = self.mix_again(torch.tanh(self.mix(x)))
        logits = self.head(x)
        return F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))


def _tiny_lm() -> tuple[nn.Module, tuple]:
    return TinyLM(), torch_cases._tokens(8)


MAKERS = {"hf_gpt2": torch_cases.make_hf_gpt2, "hf_llama": torch_cases.make_hf_llama, "tiny_lm": _tiny_lm}


def no_decay(name: str) -> bool:
    """Norms and biases take no weight decay (the usual AdamW grouping, by parameter name)."""
    return name.endswith("bias") or "norm" in name or ".ln_" in name


def adamw(named: list[tuple[str, Any]]) -> torch.optim.AdamW:
    groups = [{"params": [p for n, p in named if not no_decay(n)], "weight_decay": DECAY},
              {"params": [p for n, p in named if no_decay(n)], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=LR, eps=EPS)


def _full(x: Any) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return x.full_tensor() if isinstance(x, DTensor) else x


def _worst(got: dict[str, Any], want: dict[str, torch.Tensor]) -> tuple[float, float]:
    """Largest absolute difference and largest absolute reference value over the names of ``want``."""
    err = max(float((_full(got[n]).detach() - w).abs().max()) for n, w in want.items())
    return err, max(float(w.abs().max()) for w in want.values())


def run_names(name: str, world: int) -> dict[str, Any]:
    """Names, AdamW by groups, clip_grad_norm_, state_dict / load_state_dict of one model on this rank."""
    from torch.distributed.device_mesh import init_device_mesh

    import shardplan.torch as st

    from shardplan.torch.run import parallel_module

    torch.manual_seed(0)
    model, batch = MAKERS[name]()
    model.train()
    mesh = init_device_mesh("cpu", (world,))
    machine = torch_cases.toy_machine(world)
    ref = torch_cases._clone(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan, pm = st.parallelize(torch_cases._clone(model), batch, mesh, machine=machine)
    out: dict[str, Any] = {
        "names": [n for n, _ in pm.named_parameters()], "names0": [n for n, _ in model.named_parameters()],
        "buffers": [n for n, _ in pm.named_buffers()], "buffers0": [n for n, _ in model.named_buffers()],
        "keys": list(pm.state_dict()), "keys0": list(model.state_dict()),
        "all_dtensor": all(hasattr(p, "placements") for p in pm.parameters()),
        "split": sum(1 for p in pm.parameters() if p.to_local().numel() < p.numel()),
    }
    # one training step on each: forward, backward, clip to norm 1, AdamW with two groups
    loss0 = ref(*batch)
    loss0.backward()
    unclipped0 = {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.grad is not None}
    norm0 = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    grads0 = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
    before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    opt0 = adamw(list(ref.named_parameters()))
    opt0.step()
    loss = pm(*batch)
    loss.backward()
    # the checks of tests/torch_engine/test_torch_dist.py on this same plan and pass, before clipping
    out["unsharded"] = torch_cases.compare_with_unsharded(plan, pm, model, loss, loss0, unclipped0, caught, world)
    norm = torch.nn.utils.clip_grad_norm_(pm.parameters(), 1.0)
    opt = adamw(list(pm.named_parameters()))
    opt.step()
    after = dict(pm.named_parameters())
    out.update(loss=float(loss), loss0=float(loss0), norm=float(_full(norm)), norm0=float(norm0),
               groups=[len(g["params"]) for g in opt.param_groups],
               groups0=[len(g["params"]) for g in opt0.param_groups])
    out["grad_err"], out["grad_scale"] = _worst({n: p.grad for n, p in after.items()}, grads0)
    want = {n: p.detach() for n, p in ref.named_parameters()}
    out["param_err"], out["param_scale"] = _worst(after, want)
    out["update"] = max(float((want[n] - before[n]).abs().max()) for n in want)  # how far the step moved
    out["state_sharded"] = all(tuple(s["exp_avg"].placements) == tuple(p.placements) for p, s in opt.state.items())
    # a fresh module (other initial values) under the same plan, loaded with the model's state dict: full tensors,
    # then DTensors
    torch.manual_seed(1)
    other, _ = MAKERS[name]()
    pm2 = parallel_module(other, batch, None, pm.info, plan, mesh)
    with torch.no_grad():
        out["loss_fresh"] = float(pm2(*batch))
        pm2.load_state_dict(model.state_dict())
        out["loss_loaded"] = float(pm2(*batch))
        pm2.load_state_dict(pm.state_dict())  # DTensors: the stepped parameters
        out["loss_loaded_dt"] = float(pm2(*batch))
        out["loss_stepped"] = float(ref(*batch))
    try:
        pm2.load_state_dict(model.state_dict(), assign=True)
        out["assign"] = "loaded"
    except Exception as e:  # noqa: BLE001  (the message is what is checked)
        out["assign"] = f"{type(e).__name__}: {e}"
    return out


def _tokens(seed: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (batch, SEQ), generator=g), torch.randint(0, VOCAB, (batch, SEQ), generator=g))


FIT_MODELS = {"fit_gpt2": torch_cases.make_hf_gpt2, "fit_llama_block": torch_cases.make_llama_block,
              "fit_options": torch_cases.make_llama_block, "forced_gpt2": torch_cases.make_hf_gpt2}


def run_fits(lead: str, world: int) -> dict[str, Any]:
    """:func:`run_fit` of every case of ``FIT_GROUPS[lead]`` (one model): the model traced and planned without
    a budget once for them all (what each case would compute again), by case name."""
    from torch.distributed.device_mesh import init_device_mesh

    import shardplan.torch as st
    from shardplan.spmd import solve

    torch.manual_seed(0)
    model, _ = FIT_MODELS[lead]()
    batch = _tokens(11, 4 * BATCH)
    mesh = init_device_mesh("cpu", (world,))
    machine = torch_cases.toy_machine(world)
    graph, info = st.trace(torch_cases._clone(model), batch)
    plain = solve(graph, machine, cutoff=1, divides_p=True)
    out: dict[str, Any] = {}
    for name in FIT_GROUPS[lead]:
        try:
            out[name] = run_fit(name, batch, mesh, machine, graph, info, plain)
        except Exception:  # noqa: BLE001  (one case's error is that case's, as torch_cases.worker records it)
            out[name] = {"error": traceback.format_exc()}
    return out


def run_fit(name: str, batch: tuple, mesh: Any, machine: Any, graph: Any, info: Any, plain: Any) -> dict[str, Any]:
    """A plan under a memory budget (``fit_*``: 45% of the plain plan's memory; ``fit_options``: the same
    with ZeRO stages 1 to 3 and 3 or 2 micro-batches asked for; ``forced_*``: ZeRO-3 everywhere, every
    other operator recomputed, 2 micro-batches, by hand), run with ``pm.step``. ``graph``, ``info``: the
    model traced on ``batch``; ``plain``: its plan without a budget on ``machine``."""
    import shardplan.torch as st
    from shardplan.fit import FitOptions, plan_with_choices
    from shardplan.torch.run import parallel_module

    torch.manual_seed(0)
    model, _ = FIT_MODELS[name]()
    names = [op.name for op in graph.operators]
    if name.startswith("forced"):
        plan = plan_with_choices(plain, stage=3, recompute=names[1::2], micro_batches=2)
        budget = float(plan.memory["peak_bytes"])
        pm = parallel_module(torch_cases._clone(model), batch, None, info, plan, mesh)
    else:
        budget = 0.45 * plan_with_choices(plain).memory["peak_bytes"]
        fit = FitOptions(stages=(1, 2, 3), micro_batches=(3, 2)) if name == "fit_options" else None
        plan, pm = st.parallelize(torch_cases._clone(model), batch, mesh, machine=machine, budget=budget, fit=fit)
    ref = torch_cases._clone(model)
    loss0 = ref(*batch)
    loss0.backward()
    grads0 = {n: p.grad.detach() for n, p in ref.named_parameters()}
    loss = pm.step(*batch)
    got = dict(pm.named_parameters())
    out: dict[str, Any] = {
        "loss": float(loss), "loss0": float(loss0), "budget": budget, "peak": float(plan.memory["peak_bytes"]),
        "plain_peak": float(plan_with_choices(plain).memory["peak_bytes"]), "micro_batches": pm.micro_batches,
        "recompute": len(pm.choices.recompute), "zero3": len(pm.choices.zero3),
        "stages": sorted({plan.memory_choices.stage(i) for i in range(len(names))}),
        "names": list(got) == [n for n, _ in model.named_parameters()],
        "grad_layouts_ok": all(tuple(p.grad.placements) == tuple(p.placements) for p in got.values()),
    }
    out["grad_err"], out["grad_scale"] = _worst({n: p.grad for n, p in got.items()}, grads0)
    # ZeRO-3 parameters hold less than their tile: the tile of the layout is cut over its replicas
    tiles = {n: pm.layouts.placements(*pm.info.param_uses[n][0], p.dim()) for n, p in got.items()
             if n in pm.info.param_uses}
    out["zero3_smaller"] = sum(1 for n, p in got.items() if n in tiles and tuple(p.placements) != tuple(tiles[n])
                               and p.to_local().numel() < p.redistribute(pm.mesh, tiles[n]).to_local().numel())
    try:
        pm(*batch)
        out["forward_with_grad"] = "ran"
    except Exception as e:  # noqa: BLE001  (the message is what is checked)
        out["forward_with_grad"] = f"{type(e).__name__}: {e}"
    with torch.no_grad():
        out["no_grad_loss"] = float(pm(*batch))
    if name.startswith("forced"):  # each choice alone against none: what autograd keeps for the backward pass
        for key, kw in (("plain", {}), ("zero3", {"stage": 3}), ("recompute", {"recompute": True})):
            one = parallel_module(torch_cases._clone(model), batch, None, info,
                                  plan_with_choices(plain, micro_batches=2, **kw), mesh)
            out[f"saved_{key}"] = saved_bytes(one, batch)
    return out


def saved_bytes(pm: Any, batch: tuple) -> int:
    """Bytes of the distinct storages of this rank's tensors, parameters aside, that autograd saves for the
    backward pass during ``pm.step`` (what recomputed segments and gathered ZeRO-3 parameters keep instead
    is not handed to this hook)."""
    params = {id(p) for p in pm.parameters()}
    seen: dict[int, Any] = {}  # data pointer -> storage, held so that no address is reused during the step

    def pack(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in params:
            st = (t._local_tensor if hasattr(t, "_local_tensor") else t).untyped_storage()
            seen[st.data_ptr()] = st
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        pm.step(*batch)
    return sum(st.nbytes() for st in seen.values())


def run_one(name: str, world: int) -> dict[str, Any]:
    return run_fits(name, world) if name in FIT_GROUPS else run_names(name, world)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("torch_names") / "results.json"
    got = torch_cases.run_distributed(NAME_CASES + list(FIT_GROUPS), WORLD, str(out), run_one=run_one)
    for lead, members in FIT_GROUPS.items():  # a group's error is each of its cases'
        group = got.pop(lead)
        got.update({m: group if "error" in group else group[m] for m in members})
    return got


def _ok(results: dict, name: str) -> dict:
    r = results[name]
    assert "error" not in r, r.get("error")
    return r


@pytest.mark.parametrize("name", NAME_CASES)
def test_parameters_buffers_and_state_dict_carry_the_models_names(results, name):
    r = _ok(results, name)
    assert r["names"] == r["names0"]
    assert r["buffers"] == r["buffers0"]
    assert r["keys"] == r["keys0"]
    assert r["all_dtensor"]
    assert r["split"] > 0, "the toy machine makes splitting pay: some parameter must be sharded"


@pytest.mark.parametrize("name", NAME_CASES)
def test_sharded_loss_and_grads_equal_single_process(results, name):
    """tests/torch_engine/test_torch_dist.py's checks on the Hugging Face models (planned here once for both
    files): loss and gradients equal one process's, the cost model's tiles held on every rank, gradients laid
    out like them, nothing described conservatively."""
    r = _ok(results, name)["unsharded"]
    torch_cases.assert_runs_as_unsharded(r)
    assert r["warnings"] == [], r["warnings"]


def test_tied_and_shared_parameters_appear_as_in_the_model(results):
    r = _ok(results, "tiny_lm")
    assert "head.weight" not in r["names"] and "mix_again.weight" not in r["names"]  # listed once, by first name
    assert {"head.weight", "mix_again.weight", "mix_again.bias", "scale"} <= set(r["keys"])  # the state dict has all
    assert "pos" in r["buffers"] and "pos" not in r["keys"]  # non-persistent: a buffer, not state
    assert "model.lm_head.weight" in _ok(results, "hf_gpt2")["keys"]


@pytest.mark.parametrize("name", NAME_CASES)
def test_adamw_by_name_groups_and_grad_clipping_match_the_unsharded_step(results, name):
    r = _ok(results, name)
    assert r["groups"] == r["groups0"] and min(r["groups"]) > 0
    assert abs(r["loss"] - r["loss0"]) <= 1e-5 * abs(r["loss0"])
    assert r["norm0"] > 1.0, "clipping must act for the test to check it"
    assert abs(r["norm"] - r["norm0"]) <= 1e-5 * r["norm0"]
    assert r["grad_err"] <= 1e-4 * r["grad_scale"]
    assert r["update"] > 100 * 1e-5 * r["param_scale"], "the step must move the parameters"
    assert r["param_err"] <= 1e-5 * r["param_scale"]
    assert r["state_sharded"], "AdamW's state is laid out like its parameter"


@pytest.mark.parametrize("name", NAME_CASES)
def test_load_state_dict_of_the_model_reproduces_its_loss(results, name):
    r = _ok(results, name)
    assert abs(r["loss_fresh"] - r["loss0"]) > 1e-3, "the fresh module must start elsewhere"
    assert abs(r["loss_loaded"] - r["loss0"]) <= 1e-5 * abs(r["loss0"])
    assert abs(r["loss_loaded_dt"] - r["loss_stepped"]) <= 1e-5 * abs(r["loss_stepped"])
    assert r["assign"].startswith("ShardplanError") and "assign=True" in r["assign"]


@pytest.mark.parametrize("name", FIT_CASES)
def test_budget_plan_fits_and_runs_like_the_unsharded_model(results, name):
    r = _ok(results, name)
    assert r["peak"] <= r["budget"]
    assert r["peak"] < r["plain_peak"], "the budget must force memory choices"
    assert r["micro_batches"] > 1 or r["recompute"] or r["zero3"]
    assert abs(r["loss"] - r["loss0"]) <= 1e-5 * abs(r["loss0"])
    assert r["grad_err"] <= 1e-4 * r["grad_scale"]
    assert r["grad_layouts_ok"] and r["names"]
    assert abs(r["no_grad_loss"] - r["loss0"]) <= 1e-5 * abs(r["loss0"])


def test_torch_fit_offers_zero_3_and_the_micro_batch_counts_that_split_the_batch(results):
    r = _ok(results, "fit_options")
    assert r["micro_batches"] == 2, "3 does not divide the batch of 32: only 2 micro-batches are offered"
    assert r["stages"] == [0, 3] and r["zero3"] > 0, "stages 1 and 2 are not offered; this budget needs stage 3"


def test_hand_chosen_memory_choices_all_run(results):
    r = _ok(results, "forced_gpt2")
    assert r["micro_batches"] == 2 and r["recompute"] > 0 and r["zero3"] > 0
    assert r["zero3_smaller"] > 0, "ZeRO-3 parameters are held sharded over their replicas"
    assert "ShardplanError" in r["forward_with_grad"] and "step(" in r["forward_with_grad"]
    # ZeRO-3 keeps no gathered parameter for the backward pass (the plain plan keeps views of its weights);
    # recomputing every operator keeps only the segments' inputs
    assert r["saved_zero3"] < r["saved_plain"]
    assert r["saved_recompute"] < r["saved_plain"] / 2


# -- one process: the pure parts ----------------------------------------------------------------
def test_zero3_cuts_the_tile_over_replica_axes_inner_to_existing_splits():
    from torch.distributed.tensor import Replicate, Shard

    from shardplan.torch.run import zero3_placements

    assert zero3_placements((Replicate(), Shard(0)), (8, 6), (2, 2)) == (Shard(1), Shard(0))
    # only dim 0 divides: a later mesh axis may split it again (inner), an earlier one may not
    assert zero3_placements((Shard(0), Replicate()), (8, 3), (2, 2)) == (Shard(0), Shard(0))
    assert zero3_placements((Replicate(), Shard(0)), (8, 3), (2, 2)) == (Replicate(), Shard(0))
    assert zero3_placements((Replicate(),), (3,), (2,)) == (Replicate(),)  # nothing divides: stays replicated


def test_recompute_segments_group_consecutive_recomputed_nodes():
    from shardplan.torch.run import Segment, recompute_segments

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.c(torch.relu(self.b(self.a(x)))).sum()

    g, info = _trace(M(), (torch.ones(2, 4),))
    names = [op.name for op in g.operators]
    nodes = list(info.program.graph_module.graph.nodes)
    items = recompute_segments(nodes, info.node_op, frozenset(names[1:3]))
    segs = [x for x in items if isinstance(x, Segment)]
    assert len(segs) == 1
    (seg,) = segs
    assert {info.node_op.get(n.name) for n in seg.nodes} >= set(names[1:3])
    assert names[0] not in {info.node_op.get(n.name) for n in seg.nodes}
    inside = {n.name for n in seg.nodes}
    assert all(n not in inside for n in seg.inputs) and set(seg.outputs) <= inside
    assert len([x for x in items if not isinstance(x, Segment)]) + sum(len(s.nodes) for s in segs) == len(nodes)
    assert recompute_segments(nodes, info.node_op, frozenset()) == nodes


def _trace(module, args):
    from shardplan.torch import trace

    return trace(module, args)


def test_micro_batches_take_strided_rows_and_refuse_a_batch_they_do_not_divide():
    from shardplan.errors import ShardplanError
    from shardplan.torch.run import micro_batch

    x = torch.arange(12).reshape(6, 2)
    a, kw = micro_batch([x, 3], {"y": x[:, 0]}, 1, 3)
    assert torch.equal(a[0], x[1::3]) and a[1] == 3 and torch.equal(kw["y"], x[1::3, 0])
    with pytest.raises(ShardplanError, match="does not split into 4"):
        micro_batch([x], {}, 0, 4)


def test_zero_stages_one_and_two_are_refused_for_the_torch_run():
    from shardplan.errors import ShardplanError
    from shardplan.fit import plan_with_choices
    from shardplan.machine import Machine
    from shardplan.spmd import solve
    from shardplan.torch.run import run_choices

    g, _ = _trace(torch_cases.MLP(), torch_cases.make_mlp()[1])
    plain = solve(g, Machine(4), cutoff=1, divides_p=True)
    assert run_choices(plain).micro_batches == 1
    rc = run_choices(plan_with_choices(plain, stage=3, recompute=True, micro_batches=2))
    assert rc.micro_batches == 2 and rc.recompute == frozenset(op.name for op in g.operators)
    assert rc.zero3 == frozenset(op.name for op in g.operators if op.weights)
    for stage in (1, 2):
        with pytest.raises(ShardplanError, match=f"ZeRO stage {stage}"):
            run_choices(plan_with_choices(plain, stage=stage))
