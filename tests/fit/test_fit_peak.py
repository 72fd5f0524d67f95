"""The backward-peak memory model (FitOptions.grad_buffers = "backward") in the fit search, by hand and against the ILP."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from shardplan import ops
from shardplan.cost import build_tables
from shardplan.cost.memory import choice_table
from shardplan.errors import ShardplanError
from shardplan.fit import FitOptions, peak_problem, plan_with_choices, solve_fit
from shardplan.report.summary import render_plan
from shardplan.ir import GraphBuilder, TensorRef
from shardplan.machine import Machine

pytestmark = pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out

B = 1e9  # bytes/s
F = 1e12  # FLOP/s


def test_gradient_bytes_per_stage_by_hand():
    # y[b, n] = x[b, c] W[c, n], W 32 x 16 fp32 = 2048 bytes, replicated over the 4 devices of the batch split
    op = ops.dense("fc", TensorRef("x", (64, 32), needs_grad=True), 16)
    t = choice_table(op, np.array([[4, 1, 1]]), np.array([[0, 1, 2]]), Machine(4, peak_flops=F, bandwidth=B),
                     prune=False)
    w = 2048.0
    by_stage = {int(s): (float(g), float(r)) for s, g, r, rec in zip(t.stage, t.grad_bytes, t.rest_bytes, t.recompute)
                if not rec}
    # gradient P at stages 0 and 1, P/G at 2 and 3; rest = value (P, P/G at 3) + 2 Adam words (sharded from 1)
    assert by_stage == {0: (w, 3 * w), 1: (w, w + 2 * w / 4), 2: (w / 4, w + 2 * w / 4), 3: (w / 4, 3 * w / 4)}


def two_dense():
    b = GraphBuilder("g")
    x = b.input("x", (64, 16), needs_grad=True)
    h = b.add(ops.dense("fc1", x, 32))  # W1 16 x 32 = 2048 B, output tile 16 x 32 = 2048 B per device
    b.add(ops.dense("fc2", h, 8))  # W2 32 x 8 = 1024 B, output tile 16 x 8 = 512 B per device
    return b.build()


def test_backward_profile_of_a_small_graph_by_hand():
    from shardplan.baselines import baseline_plan

    g = two_dense()
    tables = build_tables(g, Machine(4, peak_flops=F, bandwidth=B, latency=1e-6), orders="row-major")
    dp = baseline_plan("data_parallel", tables)
    plan = plan_with_choices(dp, {"fc2": 2}, False, 1, grad_buffers="backward")
    # fc1 stage 0: rest 2048 + 2 * 2048 = 6144, grad 2048, saved 2048
    # fc2 stage 2 over 4 devices: rest 1024 + 2 * 1024 / 4 = 1536, grad 1024 / 4 = 256, saved 512
    # backward step of fc2 (first): rest 7680 + saved 2048 + 512 + grad 256 = 10496
    # backward step of fc1 (then): rest 7680 + saved 2048 + grads 2048 + 256 = 12032: the peak
    assert plan.memory_choices.backward_profile().tolist() == [12032.0, 10496.0]
    mem = plan.memory
    assert mem["peak_bytes"] == 12032.0 and mem["peak_step"] == 0
    assert mem["additive_peak_bytes"] == 7680.0 + 2560.0 + 2304.0
    assert "the backward step of fc1 (operator 1 of 2)" in render_plan(plan)
    # persistent buffers: the additive sum, no step
    same = plan_with_choices(dp, {"fc2": 2}, False, 1)
    assert same.memory["peak_bytes"] == 12544.0 and "peak_step" not in same.memory
    # with two micro-batches gradients accumulate in persistent buffers: both options agree
    two = plan_with_choices(dp, {"fc2": 2}, False, 2, grad_buffers="backward")
    assert two.memory == plan_with_choices(dp, {"fc2": 2}, False, 2).memory


def _tiny_gpt():
    from shardplan.models import get_model

    return get_model("gpt", batch=8, layers=1, d_model=64, heads=2, seq=32, vocab=256)


@pytest.fixture(scope="module")
def gpt_tables():
    g = _tiny_gpt()
    m = Machine(4, peak_flops=F, bandwidth=B, latency=1e-6, memory_bytes=1e12)
    tables = build_tables(g, m, orders="row-major")
    free = solve_fit(g, m, tables=tables, options=FitOptions(micro_batches=(1,)))
    return g, m, tables, free.memory["peak_bytes"]


@pytest.fixture(scope="module")
def backward_fit(gpt_tables):
    """The tiny GPT's fit search under the backward-peak model (one micro-batch, the default work budget, no wall
    clock) at ``frac`` of its peak without a budget, searched once per share: two tests read the plan at 0.5."""
    g, m, tables, top = gpt_tables

    @functools.cache
    def fit(frac: float):
        return solve_fit(g, m, budget=frac * top, tables=tables,
                         options=FitOptions(micro_batches=(1,), grad_buffers="backward"))

    return fit


@pytest.mark.parametrize("frac", [0.7, 0.5, 0.25])
def test_backward_fit_agrees_with_peak_ilp_and_beats_additive(gpt_tables, backward_fit, frac):
    from shardplan.search.memory_ilp import solve_peak_ilp

    g, m, tables, top = gpt_tables
    budget = frac * top
    opts = FitOptions(micro_batches=(1,), grad_buffers="backward")  # the default work budget, no wall clock
    plan = backward_fit(frac)
    add = solve_fit(g, m, budget=budget, tables=tables, options=FitOptions(micro_batches=(1,)))
    assert plan.solution.optimal and plan.memory["peak_bytes"] <= budget
    # the plan's peak is its profile's maximum and is what the additive sum would exceed
    assert plan.memory["peak_bytes"] == pytest.approx(plan.memory_choices.backward_profile().max())
    assert plan.memory["additive_peak_bytes"] > budget  # it fits only under the backward-peak model
    assert plan.cost < add.cost * (1 - 1e-6)
    pp, _ = peak_problem(tables, budget, opts)
    ilp = solve_peak_ilp(pp, time_limit=120)
    assert ilp.optimal and ilp.cost == pytest.approx(plan.cost, rel=1e-7)
    assert plan.solution.stats["per_micro_batches"][0]["model"] == "backward peak"


def test_backward_option_with_micro_batches_is_the_additive_search(gpt_tables):
    g, m, tables, top = gpt_tables
    a = solve_fit(g, m, budget=0.5 * top, tables=tables, options=FitOptions(micro_batches=(2,)))
    b = solve_fit(g, m, budget=0.5 * top, tables=tables, options=FitOptions(micro_batches=(2,), grad_buffers="backward"))
    assert a.cost == b.cost and a.memory == b.memory and "peak_step" not in b.memory
    assert "persistent buffers" in render_plan(b)


def test_backward_infeasible_names_a_lower_bound(gpt_tables):
    g, m, tables, top = gpt_tables
    with pytest.raises(ShardplanError, match="at least .* at some backward step"):
        solve_fit(g, m, budget=1000.0, tables=tables, options=FitOptions(micro_batches=(1,), grad_buffers="backward"))
    with pytest.raises(ShardplanError, match="grad_buffers"):
        FitOptions(grad_buffers="sometimes")


def test_cli_grad_buffers_backward(capsys):
    from shardplan.cli import main

    tiny = ["--model", "gpt", "--set", "layers=1", "--set", "d_model=64", "--set", "heads=2", "--set", "seq=32",
            "--set", "vocab=256", "--batch", "8", "-p", "4", "--machine", "a100", "--orders", "row-major"]
    code = main(["solve", *tiny, "--memory", "0.001", "--micro-batches", "1", "--grad-buffers", "backward",
                 "--no-baselines"])
    out = capsys.readouterr().out
    assert code == 0 and "backward-peak model" in out and "the peak is at the backward step of" in out


def test_peak_pruning_loses_no_optimum(gpt_tables, backward_fit):
    """The peak-valid pruning and filter of peak_problem against the ILP over every unpruned choice."""
    from shardplan.cost.memory import recompute_keep_bytes, unsaved_inputs
    from shardplan.fit import producers_saved
    from shardplan.search.memory_ilp import solve_peak_ilp
    from shardplan.search.peak import PeakProblem

    g, m, tables, top = gpt_tables
    budget = 0.5 * top
    opts = FitOptions(micro_batches=(1,), grad_buffers="backward")
    pp, cts = peak_problem(tables, budget, opts)
    full = []
    for op, lay, oc in zip(g.operators, tables.arrays, tables.op_costs):
        shares = unsaved_inputs(op, producers_saved(g, op))
        keep = recompute_keep_bytes(op, lay, tables.machine, shares) if any(shares) else None
        full.append(choice_table(op, lay, None, tables.machine, 1, prune=False, op_cost=oc,
                                 forced_recompute=op.name in g.recomputed, recompute_keep=keep))
    assert sum(len(t.base) for t in full) > sum(pp.num_choices)  # the pruning did drop choices
    unpruned = PeakProblem(pp.problem, tuple(t.base for t in full), tuple(t.seconds for t in full),
                           tuple(t.rest_bytes for t in full), tuple(t.activation_bytes for t in full),
                           tuple(t.grad_bytes for t in full), budget, 0.0)
    ref = solve_peak_ilp(unpruned, time_limit=120)
    plan = backward_fit(0.5)  # at budget with opts: the plan test_backward_fit_..._additive[0.5] reads
    assert ref.optimal and plan.cost == pytest.approx(ref.cost, rel=1e-7)


def test_peak_pruning_keeps_what_a_backward_step_needs():
    from shardplan.cost.memory import ChoiceTable, _undominated, _undominated_peak

    # one layout, three choices: A saves 10 and has no gradient, B has an 11-byte gradient and saves
    # nothing (same time), C is A slower with a gradient byte more. The additive pruning keeps A only
    # (10 < 11 total bytes); at a backward step that counts gradients and not activations B is the smaller.
    t = ChoiceTable(base=np.zeros(3, dtype=np.int64), stage=np.zeros(3, dtype=np.int64), recompute=np.zeros(3, bool),
                    parts={"compute": np.array([1.0, 1.0, 2.0])}, state_bytes=np.array([0.0, 11.0, 1.0]),
                    activation_bytes=np.array([10.0, 0.0, 10.0]), grad_bytes=np.array([0.0, 11.0, 1.0]))
    assert _undominated(t.base, t.seconds, t.bytes).tolist() == [0]
    assert _undominated_peak(t, 3, 1).tolist() == [0, 1]
