"""The all-gather's context parallelism balanced on 4 gloo processes (:func:`shardplan.torch.ring.gather_sdpa`):
the queries dealt into the balanced order, the keys and values gathered as planned, each of a rank's two
chunks attending to the keys up to its last row, the output dealt back. One launch for every case:

* ``gather_direct``: ``gather_sdpa`` on DTensors (the sequence split 4 ways; over both axes of a 2 x 2 mesh;
  beside split heads with one key/value head per two query heads) against PyTorch's attention of the whole
  tensors: loss and every input's gradient, and that the queries and the output were dealt;
* ``gather_run``: a causal attention layer whose every operator splits the sequence 4 ways, run by
  :class:`~shardplan.torch.run.ParallelModule` with the deal (``RunChoices.dealt``) and without: both equal
  to one process, the keys' and values' gradients reduce-scattered to their producers;
* ``gather_plan``: ``st.plan`` (the all-gather, the default) of one long sequence on the toy machine splits the
  attention's queries and charges the deal; ``st.apply`` runs it dealt, equal to one process.
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
B, S, D, H = 2, 16, 8, 2


class Attn(nn.Module):
    """q, k, v projections, causal SDPA over 2 heads, an output projection; the loss a weighted sum."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (f(x).view(b, s, H, D // H).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return (torch.tanh(self.o(y.transpose(1, 2).reshape(b, s, D))) * w).sum()


def _compare(loss: torch.Tensor, loss0: torch.Tensor, pm: Any, ref: nn.Module) -> dict[str, float]:
    worst, scale = 0.0, 0.0
    named = pm.named_dparameters()
    for n, p_ in ref.named_parameters():
        g = named[n].grad.full_tensor()
        worst = max(worst, float((g - p_.grad).abs().max()))
        scale = max(scale, float(p_.grad.abs().max()))
    return {"rel_loss": abs(float(loss) - float(loss0)) / abs(float(loss0)), "rel_grad": worst / scale}


class _Deals:
    """Counts :func:`shardplan.torch.ring.deal` calls in this process (forward and inverse) while active."""

    def __enter__(self) -> list[bool]:
        import shardplan.torch.ring as ring_module

        self.inner, self.calls = ring_module.deal, []
        ring_module.deal = lambda x, group, inverse=False: self.calls.append(inverse) or self.inner(x, group, inverse)
        return self.calls

    def __exit__(self, *exc: Any) -> None:
        import shardplan.torch.ring as ring_module

        ring_module.deal = self.inner


class _Comms:
    """The collectives of this process while active, by name (``torch.distributed.tensor.debug.CommDebugMode``)."""

    def __enter__(self) -> dict[str, int]:
        from torch.distributed.tensor.debug import CommDebugMode

        self.mode, self.counts = CommDebugMode(), {}
        self.mode.__enter__()
        return self.counts

    def __exit__(self, *exc: Any) -> None:
        self.mode.__exit__(*exc)
        self.counts.update({str(k).split(".")[-1]: int(v) for k, v in self.mode.get_comm_counts().items()})


def _direct(mesh_shape: tuple[int, ...], placements: tuple[str, ...], kv_heads: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from shardplan.torch.ring import gather_sdpa
    from shardplan.torch.run import _sdpa

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=tuple(f"m{i}" for i in range(len(mesh_shape))))
    pl = [{"b": Shard(0), "h": Shard(1), "s": Shard(2), "r": Replicate()}[c] for c in placements]
    kv_pl = [Replicate() if p == Shard(2) else p for p in pl]  # the keys gathered along the sequence, as planned
    gen = torch.Generator().manual_seed(3)
    n, heads = 4 * S, 2 * H
    q, w = (torch.randn(B, heads, n, D, generator=gen) for _ in range(2))
    k, v = (torch.randn(B, kv_heads, n, D, generator=gen) for _ in range(2))
    kw = {"is_causal": True, "enable_gqa": kv_heads != heads}
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = (torch.tanh(F.scaled_dot_product_attention(qr, kr, vr, **kw)) * w).sum()
    ref.backward()
    qd = distribute_tensor(q.clone().requires_grad_(), mesh, pl)
    kd, vd = (distribute_tensor(t.clone().requires_grad_(), mesh, kv_pl) for t in (k, v))
    with _Deals() as calls:
        out = gather_sdpa(qd, kd, vd, fallback=_sdpa, **kw)
        loss = (torch.tanh(out.full_tensor()) * w).sum()
        loss.backward()
    err = max(float((a.grad.full_tensor() - b.grad).abs().max()) / float(b.grad.abs().max())
              for a, b in ((qd, qr), (kd, kr), (vd, vr)))
    return {"rel_loss": abs(float(loss) - float(ref)) / abs(float(ref)), "rel_grad": err, "deals": list(calls)}


def _gather_direct(world: int) -> dict[str, Any]:
    return {"one axis": _direct((4,), ("s",), 2 * H), "two axes": _direct((2, 2), ("s", "s"), 2 * H),
            "heads split gqa": _direct((2, 2), ("h", "s"), H)}


def _gather_run(world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from shardplan.layout import Layout
    from shardplan.torch.frontend import trace
    from shardplan.torch.run import ParallelModule, RunChoices

    torch.manual_seed(0)
    model, batch = Attn(), (torch.randn(B, S, D), torch.randn(B, S, D))
    ref = torch_cases._clone(model)
    loss0 = ref(*batch)
    loss0.backward()
    graph, info = trace(torch_cases._clone(model), batch)
    lays = {op.name: Layout.flat(op.dim_names, tuple(world if op.extents[d] == S and d not in op.fixed else 1
                                                     for d in op.dim_names), world) for op in graph.operators}
    (attn,) = [op.name for op in graph.operators if op.kind == "attn_flash"]
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for dealt in (frozenset([attn]), frozenset()):
        pm = ParallelModule.create(torch_cases._clone(model), info, graph, lays, mesh, RunChoices(dealt=dealt))
        with _Deals() as calls:
            loss = pm(*batch)
            with _Comms() as comms:
                loss.backward()
        out[f"dealt={bool(dealt)}"] = {**_compare(loss.detach(), loss0.detach(), pm, ref), "deals": list(calls),
                                       "backward_comms": comms}
    return out


def _gather_plan(world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    import shardplan.torch as st
    from shardplan.cost.ring import gathered_scatters
    from shardplan.layout import LayoutArrays

    torch.manual_seed(0)
    model, batch = Attn(), (torch.randn(1, 4 * S, D), torch.randn(1, 4 * S, D))
    ref = torch_cases._clone(model)
    loss0 = ref(*batch)
    loss0.backward()
    mesh = init_device_mesh("cpu", (world,))
    plan = st.plan(torch_cases._clone(model), batch, mesh, machine=torch_cases.toy_machine(world))
    pm = st.apply(plan, torch_cases._clone(model), batch, mesh)
    with _Deals() as calls:
        loss = pm(*batch)
        with _Comms() as comms:
            loss.backward()
    sp, graph = plan.spmd, plan.spmd.graph
    (i,) = [j for j, op in enumerate(graph.operators) if op.kind == "attn_flash"]
    scattered = []
    for e in graph.edges:
        if e.dst == i and e.slot in (1, 2):
            lu, lv = (LayoutArrays.stack([sp.tables.layouts[j][sp.assignment[j]]]) for j in (e.src, i))
            scattered.append(bool(gathered_scatters(graph.operators[e.src], lu, graph.operators[i], e.slot, lv,
                                                    sp.machine)[0, 0]))
    return {**_compare(loss.detach(), loss0.detach(), pm, ref), "deals": list(calls), "backward_comms": comms,
            "scattered": scattered, "dealt": sorted(pm.choices.dealt),
            "attention_splits": [dict(zip(c.layout.dims, c.layout.split)) for c in plan.operators.values()
                                 if c.kind == "attn_flash"]}


def run_all(name: str, world: int) -> dict[str, Any]:
    return {"gather_direct": _gather_direct, "gather_run": _gather_run, "gather_plan": _gather_plan}[name](world)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("torch_gather_cp") / "results.json"
    return torch_cases.run_distributed(["gather_direct", "gather_run", "gather_plan"], WORLD, str(out),
                                       run_one=run_all)


def _ok(r: dict[str, Any]) -> None:
    assert "error" not in r, r.get("error")


def test_the_balanced_gather_equals_the_unsharded_loss_and_gradients(results):
    r = results["gather_direct"]
    _ok(r)
    assert len(r) == 3
    for case, x in r.items():
        assert x["rel_loss"] <= 1e-5 and x["rel_grad"] <= 1e-5, (case, x)
        # forward: q in, o back; backward retraces both (autograd runs the Deal's backward, not deal())
        assert x["deals"] == [False, True], (case, x)


def test_the_runner_deals_where_its_choices_say_and_equals_one_process(results):
    r = results["gather_run"]
    _ok(r)
    for x in r.values():
        assert x["rel_loss"] <= 1e-5 and x["rel_grad"] <= 1e-4, r
    assert r["dealt=True"]["deals"] == [False, True] and r["dealt=False"]["deals"] == [], r
    # the keys' and values' gradients leave as partial sums and reach their producers' sequence blocks by a
    # reduce-scatter each (DTensor's Partial -> Shard(2)); the four all-reduces are the projections' weights
    assert r["dealt=True"]["backward_comms"] == {"reduce_scatter_tensor": 2, "all_reduce": 4}, r


def test_a_plan_with_the_all_gather_deals_its_queries_as_charged(results):
    r = results["gather_plan"]
    _ok(r)
    (split,) = r["attention_splits"]
    assert split["s"] > 1 and split["t"] == 1, split
    assert len(r["dealt"]) == 1 and r["deals"] == [False, True], r
    # the tables charge the keys' and values' gradients a reduce-scatter (their producers split the sequence
    # like the queries: :func:`shardplan.cost.ring.gathered_reduction`), which the run does
    assert r["scattered"] == [True, True] and r["backward_comms"].get("reduce_scatter_tensor") == 2, r
    assert r["rel_loss"] <= 1e-5 and r["rel_grad"] <= 1e-4, r
