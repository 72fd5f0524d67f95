"""A training step's peak memory with the transient of a backward step (eager autograd), by hand and against
what PyTorch allocates on the CPU (the profiler's allocation events)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import shardplan.torch as st
from shardplan import preset
from shardplan.errors import ShardplanError
from shardplan.fit import FitOptions, solve_fit

N, D, V = 64, 32, 1000  # tokens, width, vocabulary


class Head(torch.nn.Module):
    """A language-model head and Hugging Face's loss: bf16 logits upcast to fp32, cross-entropy."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(D, V, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.fc(x).float(), y)


def _inputs() -> tuple[Head, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return Head().to(torch.bfloat16), torch.randn(N, D, dtype=torch.bfloat16), torch.randint(0, V, (N,))


# by hand: bf16 weight V x D with its gradient and two AdamW moments (8 bytes a parameter); saved: the input
# x (bf16), the log-softmax (fp32), the labels (int64) and the loss's total weight (one fp32); the cross
# entropy's backward step holds the loss gradient (one fp32) and, of the logits' size in fp32, the gradient
# of the log-probabilities and that of the logits
STATE = 8 * V * D
SAVED = 2 * N * D + 4 * N * V + 8 * N + 4
TRANSIENT = 4 + 2 * 4 * N * V
PEAK = STATE + SAVED + TRANSIENT


def test_frontend_states_eager_transients():
    m, x, y = _inputs()
    g, _ = st.trace(m, (x, y))
    by_kind = {op.kind: op.transient for op in g.operators}
    assert by_kind == {"linear": (1.0, 0.0, 1.0), "cast": (1.0, 1.0), "cross_entropy": (1.0, 2.0, 0.0)}


def test_tiny_step_peak_by_hand():
    m, x, y = _inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = st.plan(m, (x, y), machine=preset("h100", 1), fit=False, stages=False)
        g, _ = st.trace(m, (x, y))
    assert plain.memory["weights_bytes"] == STATE
    assert plain.memory["activations_bytes"] == pytest.approx(SAVED, abs=1e-6)
    assert plain.memory["transient_bytes"] == TRANSIENT
    assert plain.memory["peak_bytes"] == pytest.approx(PEAK, abs=1e-6)
    # the fit search's models charge the same: the additive peak, and the backward peak at the loss's step,
    # where the weight's gradient (2 V D bytes) does not exist yet (it appears at the linear's own step)
    machine = preset("h100", 1)
    for buffers, peak in (("persistent", PEAK), ("backward", PEAK - 2 * V * D)):
        opts = FitOptions(stages=(0,), recompute=False, micro_batches=(1,), grad_buffers=buffers)
        fit = solve_fit(g, machine, budget=peak, options=opts, cutoff=1)
        assert fit.memory["peak_bytes"] == pytest.approx(peak, abs=1e-6)
        assert fit.memory["transient_bytes"] == TRANSIENT
        with pytest.raises(ShardplanError, match="no plan fits"):  # one byte less: the transient does not fit
            solve_fit(g, machine, budget=peak - 1, options=opts, cutoff=1)


def _allocated_peak(step) -> int:
    """The most bytes the CPU allocator held at once during ``step()`` beyond what was held before it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    live = peak = 0
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def test_cpu_step_allocates_the_saved_values_and_the_transient():
    """Forward + backward on the CPU with the gradient buffers already allocated (``zero_grad(set_to_none=False)``
    as the measured steps run): the step's own allocations peak at the saved values it makes (the inputs x
    and labels exist before it) plus the cross-entropy step's transient, up to the loss scalar (4 B)."""
    m, x, y = _inputs()
    for p in m.parameters():
        p.grad = torch.zeros_like(p)

    def step() -> None:
        m(x, y).backward()

    step()
    made_in_step = SAVED - 2 * N * D - 8 * N
    assert abs(_allocated_peak(step) - (made_in_step + TRANSIENT)) <= 4
