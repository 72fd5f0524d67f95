"""A collective beside a product: the product runs on 1 - φ of the device while the collective runs, so the pair
costs W + max(C - W, φ C) (shardplan/cost/contention.py, docs/cost-model.md "Contention")."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from shardplan import ops
from shardplan.cost import build_tables
from shardplan.cost.contention import exposed_beside, hidden_beside
from shardplan.cost.operator import operator_cost
from shardplan.errors import ShardplanError
from shardplan.ir import GraphBuilder
from shardplan.layout import Layout, LayoutArrays
from shardplan.machine import Machine, load_machine_file, preset
from shardplan.search import solve_dp

from randgraphs import exact_solvers_agree, random_product_graph


def _simulated_pair(w: float, c: float, phi: float, steps: int = 200_000) -> float:
    """The pair's end time by stepping time: the product progresses at 1 - φ while the collective runs, at 1 after;
    the pair ends when both are done."""
    dt = (w / (1 - phi) + c) / steps
    t, done = 0.0, 0.0
    while done < w - 1e-15:
        rate = (1 - phi) if t < c else 1.0
        step = min(dt, (w - done) / rate) if t >= c or t + dt <= c else min(dt, c - t)
        done += rate * step
        t += step
    return max(t, c)


@pytest.mark.parametrize("w, c, phi", [(1.0, 0.5, 0.2), (1.0, 1.1, 0.2), (1.0, 1.25, 0.2), (1.0, 3.0, 0.2),
                                       (2.0, 1.0, 0.0), (0.0, 1.0, 0.3), (1.0, 0.0, 0.3), (0.7, 0.9, 0.5)])
def test_the_closed_form_is_the_stepped_timeline(w, c, phi):
    want = _simulated_pair(w, c, phi)
    assert w + float(exposed_beside(c, w, phi)) == pytest.approx(want, rel=1e-6, abs=1e-9)
    assert float(hidden_beside(c, w, phi)) == pytest.approx(c - float(exposed_beside(c, w, phi)), abs=1e-15)


def test_both_branches_meet_and_zero_share_is_the_plain_overlap():
    rng = np.random.default_rng(0)
    w, c = rng.uniform(0, 2, 1000), rng.uniform(0, 2, 1000)
    assert np.array_equal(exposed_beside(c, w, 0.0), np.maximum(c - w, 0.0))
    phi = 0.25
    got = exposed_beside(c, w, phi)
    assert np.all(got >= np.maximum(c - w, 0.0)) and np.all(got >= phi * c) and np.all(got <= c)
    # continuity at C = W / (1 - φ): both branches give φ C
    knee = w / (1 - phi)
    assert np.allclose(exposed_beside(knee, w, phi), phi * knee)
    # nothing beside it: the collective costs C whatever φ
    assert np.array_equal(exposed_beside(c, np.zeros_like(c), phi), c)


def test_the_machine_field_is_checked_and_defaults_to_none_charged():
    assert Machine(4).comm_contention == 0.0
    for bad in (-0.1, 1.0, 1.5):
        with pytest.raises(ShardplanError, match="comm_contention"):
            Machine(4, comm_contention=bad)
    with pytest.raises(ShardplanError, match="comm_contention"):
        Machine(4, comm_contention="0.2")  # type: ignore[arg-type]


@pytest.mark.parametrize("name, want", [("a100", 24 / 108), ("h100", 32 / 132)])
def test_the_presets_carry_channels_over_sms(name, want):
    m = preset(name, 8)
    assert m.comm_contention == pytest.approx(want, abs=5e-4)
    assert m.sm_count is not None and round(m.comm_contention * m.sm_count) in (24, 32)


def test_a_profile_written_before_the_field_reads_it_as_zero(tmp_path):
    from shardplan.machine import PRESETS
    from importlib.resources import files
    raw = json.loads((files("shardplan") / "machines" / PRESETS["a100"]).read_text())
    del raw["comm_contention"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(raw))
    assert load_machine_file(path, 8).comm_contention == 0.0


def _fc_pair():
    b = GraphBuilder("pair")
    x = b.input("x", (64, 32), needs_grad=True)
    y = b.add(ops.dense("fc", x, 16))
    b.add(ops.elementwise("act", y))
    return b.build()


def test_the_weight_sync_beside_the_backward_exposes_at_least_its_share():
    """Data parallel over 4: the weight's all-reduce C beside the backward B costs max(C - B, φ C)."""
    g = _fc_pair()
    fc = g.operators[0]
    lay = LayoutArrays.stack([Layout.flat(fc.dim_names, (4, 1, 1), 4)])
    for peak in (1e6, 1e8, 1e12):  # backward longer than, near, and far shorter than the all-reduce
        base = Machine(4, peak_flops=peak, bandwidth=1e8, dtype_bytes=4)
        plain = operator_cost(fc, lay, base)
        sync = float(plain.grad_allreduce[0])
        assert sync > 0
        for phi in (0.0, 0.2, 0.5):
            m = replace(base, overlap_grad=True, comm_contention=phi)
            got = operator_cost(fc, lay, m)
            backward = float(got.compute[0]) * 2 / 3  # the two backward passes of a product with a weight
            assert float(got.grad_allreduce[0]) == pytest.approx(max(sync - backward, phi * sync), rel=1e-12)


def test_the_input_gradient_beside_the_weight_pass_hides_min_of_w_and_the_rest():
    """overlap_dgrad: a column-parallel product's input-gradient all-reduce C beside its wgrad pass W:
    hidden min(W, (1 - φ) C)."""
    g = _fc_pair()
    fc = g.operators[0]
    lay = LayoutArrays.stack([Layout.flat(fc.dim_names, (1, 4, 1), 4)])  # columns split: the input's gradient summed
    base = Machine(4, peak_flops=1e8, bandwidth=1e8, dtype_bytes=4)
    plain = float(operator_cost(fc, lay, base).grad_allreduce[0])
    assert plain > 0
    for phi in (0.0, 0.3):
        got = operator_cost(fc, lay, replace(base, overlap_dgrad=True, comm_contention=phi))
        w = float(got.compute[0]) / 3
        assert float(got.grad_allreduce[0]) == pytest.approx(plain - min(w, (1 - phi) * plain), rel=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_dp_bruteforce_and_ilp_agree_under_contention(seed):
    """With every overlap on (chunked tensor-parallel edges, weight syncs, input gradients) and φ > 0 the costs are
    still per vertex and per edge: the three exact solvers agree, and no vertex, edge or optimum is below φ = 0's
    (the backward a weight's synchronisation occupies is its overlapped length, which contention does not shorten,
    so the edges are lent no more)."""
    rng = np.random.default_rng(seed)
    g = random_product_graph(seed)
    base = Machine(4, peak_flops=float(rng.choice([1e6, 1e7, 1e8])), bandwidth=1e8,
                   latency=float(rng.choice([0.0, 1e-6])), dtype_bytes=4, overlap_grad=True, overlap_dgrad=True)
    free = build_tables(g, base, cutoff=2, orders="row-major", overlap_tp=True)
    busy = build_tables(g, replace(base, comm_contention=0.3), cutoff=2, orders="row-major", overlap_tp=True)
    assert all((b.total >= a.total * (1 - 1e-12)).all() for a, b in zip(free.op_costs, busy.op_costs))
    assert all((b >= a * (1 - 1e-12)).all() for a, b in zip(free.edge_costs, busy.edge_costs))
    dp = exact_solvers_agree(busy.to_problem())
    assert dp.cost >= solve_dp(free.to_problem()).cost * (1 - 1e-12)
