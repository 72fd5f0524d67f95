"""Models and the distributed worker for tests/test_torch_pipeline.py (gloo on CPU, one process per stage).

Each case builds a tiny language model deterministically (same on every rank), computes the
single-process loss and gradients, then runs one step of the searched pipeline
(:func:`shardplan.torch.staged.pipeline`) and reports the differences and the plan.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, BATCH, D = 32, 4, 8, 16


class Block(nn.Module):
    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """Embedding, ``layers`` blocks, a head reading the last block and (a long skip) the embedding; loss."""

    def __init__(self, layers: int = 6, tied: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(D, VOCAB)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        e = self.embed(ids)
        h = e
        for blk in self.layers:
            h = blk(h)
        logits = self.head(h + 0.5 * e)
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def make_case(tied: bool = False) -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    return TinyLM(tied=tied), (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
                      torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def make_hf_gpt2() -> tuple[nn.Module, tuple]:
    """transformers' GPT2LMHeadModel (4 blocks, tied head), its loss from ``labels``."""
    from torch_cases import HFLoss, _tokens
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_positions=8, n_embd=32, n_layer=4, n_head=4, use_cache=False,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa")
    return HFLoss(GPT2LMHeadModel(cfg)), _tokens(4)


def toy_machine(p: int) -> Any:
    from shardplan.machine import Machine

    return Machine(p, peak_flops=32e9, bandwidth=16e9, latency=0.0, name="toy")


CASES: dict[str, dict[str, Any]] = {
    "1f1b": dict(micro_batches=(2, 4), schedules=("1f1b",)),
    "gpipe": dict(micro_batches=(4,), schedules=("1f1b",), schedule="gpipe"),
    "interleaved": dict(micro_batches=(4,), interleave=(2,), schedules=("interleaved",)),
    # zero bubble: torch's ScheduleInterleavedZeroBubble with one stage per process (ZB-H1), on Hugging Face GPT-2
    "zb-h1": dict(micro_batches=(4,), schedules=("zb-h1",), model="hf_gpt2"),
    # 2 stages of 2 processes each, the stage's layouts as DTensor placements on its sub-mesh
    "dtensor": dict(micro_batches=(2, 4), schedules=("1f1b",), stage_devices=2),
    # the head reuses the embedding's weight: a parameter of the first and the last stage
    "tied": dict(micro_batches=(4,), schedules=("1f1b",), tied=True),
    # Hugging Face GPT-2 as its authors wrote it (4 blocks, the LM head tied to the token embedding)
    "hf_gpt2": dict(micro_batches=(4,), schedules=("1f1b",), model="hf_gpt2"),
    # refused: torch's Schedule1F1B needs m >= S
    "too_few_micro_batches": dict(micro_batches=(2,), schedules=("1f1b",)),
}


def run_case(name: str, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from shardplan.torch.staged import pipeline

    opts = dict(CASES[name])
    model, batch = make_hf_gpt2() if opts.pop("model", None) == "hf_gpt2" else make_case(opts.pop("tied", False))
    ref = __import__("copy").deepcopy(model)
    loss0 = ref(*batch)
    loss0.backward()
    loss0 = loss0.detach()
    grads0 = {n: p.grad.detach() for n, p in ref.named_parameters()}
    pipe = pipeline(model, batch, toy_machine(world), **opts)
    loss = pipe.step(*batch)
    worst = torch.zeros(())
    for target, g in pipe.named_grads().items():
        g = g.full_tensor() if hasattr(g, "full_tensor") else g
        worst = torch.maximum(worst, (g - grads0[target]).abs().max())
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    q = pipe.layout["stages"][0][3]
    held = torch.zeros(())
    held += len(pipe.named_grads()) / q
    dist.all_reduce(held)
    # every parameter this rank holds belongs to a unit of one of its stages in the plan
    units = pipe.layout["units"]
    mine = [units[a:b] for (a, b, o, q) in pipe.layout["stages"] if o <= pipe.rank < o + q]
    misplaced = [t for t in pipe.named_parameters()
                 if not any(any(t.startswith(u + ".") for u in us) for us in mine)]
    bad = torch.tensor(float(len(misplaced)))
    dist.all_reduce(bad)
    scale = max(float(g.abs().max()) for g in grads0.values())
    return {"loss": float(loss), "loss0": float(loss0), "rel_loss": abs(float(loss) - float(loss0)) / abs(float(loss0)),
            "grad_err": float(worst), "grad_scale": scale, "rel_grad": float(worst) / scale,
            "params_held": int(held), "params_total": len(grads0), "misplaced": int(bad),
            "layout": pipe.layout, "shared": list(pipe.shared), "schedule": type(pipe.schedule).__name__,
            "carried": [list(p.inputs) for p in pipe.parts],
            "dtensor_params": _total(sum(1 for p in pipe.named_parameters().values() if hasattr(p, "placements"))),
            "split_params": _total(sum(1 for p in pipe.named_parameters().values()
                                       if any(pl.is_shard() for pl in getattr(p, "placements", ()))))}


def _total(x: int) -> int:
    """Sum over the ranks."""
    import torch.distributed as dist

    t = torch.tensor(float(x))
    dist.all_reduce(t)
    return int(t)


def run_distributed(names: list[str], world: int, out_path: str) -> dict[str, Any]:
    """Spawn ``world`` gloo processes (one per stage) running ``names``; returns rank 0's results."""
    import torch_cases

    return torch_cases.run_distributed(names, world, out_path, run_one=run_case)


if __name__ == "__main__":  # python tests/torch_pipeline_cases.py 4 1f1b gpipe interleaved
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    res = run_distributed(sys.argv[2:] or list(CASES), world, "/tmp/shardplan_torch_pipeline.json")
    for k, v in res.items():
        print(k, v.get("error") or {x: v[x] for x in v if x != "carried"})
