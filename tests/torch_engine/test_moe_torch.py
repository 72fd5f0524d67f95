"""A GShard-style mixture of experts in PyTorch (capacity-based dispatch with one-hot einsums, the experts one
batched product over the expert dimension), planned and run on 4 gloo processes with the loss and gradients of
one process, every operator described.

On the toy machine of the other torch cases with links 16 times slower, the search splits the expert dimension
(expert parallelism: each process holds one expert) and the run is the one-process program's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch_cases  # tests/ is on sys.path, see conftest.py
from torch import nn

pytestmark = pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out

WORLD = 4
NAME = "moe_gshard"


class GShardMoE(nn.Module):
    """Embedding, a top-k routed layer with C slots per expert and sequence (tokens past it dropped), SwiGLU
    experts with gate and up stacked, a residual and the language-model head."""

    def __init__(self, d: int = 32, experts: int = 4, top_k: int = 2, ffn: int = 256, vocab: int = torch_cases.VOCAB,
                 slots: int = 3) -> None:
        super().__init__()
        self.experts, self.top_k, self.slots = experts, top_k, slots
        self.embed = nn.Embedding(vocab, d)
        self.router = nn.Linear(d, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, d, 2, ffn) / d ** 0.5)
        self.w_out = nn.Parameter(torch.randn(experts, ffn, d) / ffn ** 0.5)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)                                                    # (B, S, d)
        b, s, _ = x.shape
        probs = torch.softmax(self.router(x), dim=-1)
        top_p, top_i = torch.topk(probs, self.top_k, dim=-1)
        chosen = F.one_hot(top_i, self.experts).to(x.dtype)                    # (B, S, K, E)
        flat = chosen.reshape(b, s * self.top_k, self.experts)
        slot = (torch.cumsum(flat, dim=1) - flat).reshape(b, s, self.top_k, self.experts)
        grid = torch.arange(self.slots, dtype=x.dtype)
        onehot = (slot.unsqueeze(-1) == grid).to(x.dtype) * chosen.unsqueeze(-1)  # (B, S, K, E, C)
        dispatch = onehot.sum(2)
        combine = (onehot * top_p[..., None, None]).sum(2)
        xe = torch.einsum("bsec,bsd->becd", dispatch, x)
        h = torch.einsum("becd,edgf->becgf", xe, self.w_in)
        a = F.silu(h[..., 0, :]) * h[..., 1, :]
        ye = torch.einsum("becf,efd->becd", a, self.w_out)
        out = torch.einsum("becd,bsec->bsd", ye, combine)
        logits = self.head(x + out)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def make_gshard_moe() -> tuple[nn.Module, tuple]:
    torch.manual_seed(26)
    return GShardMoE(), torch_cases._tokens(26)


def slow_links(p: int):
    """The toy machine with links 16 times slower, on which the experts' weights (4 x 32 x 2 x 256) cost more to
    synchronise than the tokens to exchange: the search splits the experts (expert parallelism)."""
    from shardplan.machine import Machine

    return Machine(p, peak_flops=32e9, bandwidth=1e9, latency=0.0, name="toy-slow-links")


def run_one(name: str, world: int) -> dict:
    """The worker's case runner with this module's case and machine (in the spawned process)."""
    torch_cases.CASES[NAME] = make_gshard_moe
    torch_cases.toy_machine = slow_links
    return torch_cases._run_on_mesh(name, world)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe_torch") / "results.json"
    return torch_cases.run_distributed([NAME], WORLD, str(out), run_one=run_one)[NAME]


def test_capacity_drops_tokens_in_this_example():
    model, (ids, _) = make_gshard_moe()
    with torch.no_grad():
        top_i = torch.topk(torch.softmax(model.router(model.embed(ids)), -1), model.top_k, dim=-1)[1]
    per_expert = F.one_hot(top_i, model.experts).sum((1, 2))                  # (B, E)
    assert int((per_expert - model.slots).clamp(min=0).sum()) > 0


def test_sharded_loss_and_grads_equal_single_process(result):
    torch_cases.assert_runs_as_unsharded(result)


def test_every_operator_is_described(result):
    assert "error" not in result, result.get("error")
    assert result["warnings"] == [], result["warnings"]


def test_the_experts_are_split_over_the_devices(result):
    # each process holds one expert's weights: sharded on the expert axis (0) on every mesh dimension used
    for name in ("w_in", "w_out"):
        assert set(result["param_placements"][name]) == {"S(0)"}, result["param_placements"]
