"""Memory-saving choices (ZeRO stages, recomputation, micro-batches) and the fit search on models."""

from __future__ import annotations

import numpy as np
import pytest

from shardplan import ops
from shardplan.cost import build_tables
from shardplan.cost.memory import choice_table, recompute_keep_bytes, unsaved_inputs
from shardplan.errors import ShardplanError
from shardplan.fit import FitOptions, fit_problem, producers_saved, solve_fit
from shardplan.ir import GraphBuilder, TensorRef
from shardplan.machine import Machine
from shardplan.search.constrained import solve_memory, solve_memory_bruteforce

B = 1e9  # bytes/s
F = 1e12  # FLOP/s


def dense_op():
    # y[b, n] = sum_c x[b, c] W[c, n]: b = 64, c = 32, n = 16; W has 512 elements = 2048 bytes (fp32)
    return ops.dense("fc", TensorRef("x", (64, 32), needs_grad=True), 16)


def row(table, stage, recompute):
    j = np.flatnonzero((table.stage == stage) & (table.recompute == recompute))
    assert len(j) == 1
    return int(j[0])


def test_choice_table_by_hand_batch_split_4():
    op = dense_op()
    m = Machine(4, peak_flops=F, bandwidth=B)
    cfg = np.array([[4, 1, 1]])  # dims b, n, c: batch split 4 ways, weights replicated on all 4
    t = choice_table(op, cfg, np.array([[0, 1, 2]]), m, micro_batches=1, prune=False)
    w = 2048.0  # weight bytes
    # stage 0: all-reduce 2 (g-1)/g n / B = 2 * 3/4 * 2048 / 1e9; memory w (value + grad + 2 Adam words)
    j0 = row(t, 0, False)
    assert t.parts["weight_sync"][j0] == pytest.approx(2 * 0.75 * w / B)
    assert t.state_bytes[j0] == pytest.approx(4 * w)
    # output tile 16 x 16 fp32 = 1024 bytes kept
    assert t.activation_bytes[j0] == pytest.approx(16 * 16 * 4)
    # stage 3: state / 4, reduce-scatter + 2 all-gathers of (g-1)/g n / B each
    j3 = row(t, 3, False)
    assert t.state_bytes[j3] == pytest.approx(w)
    assert t.parts["weight_sync"][j3] == pytest.approx(3 * 0.75 * w / B)
    # stage 2 at m = 1: grads and Adam state sharded, value whole: w (1 + 3/4)
    j2 = row(t, 2, False)
    assert t.state_bytes[j2] == pytest.approx(w * 1.75)
    assert t.parts["weight_sync"][j2] == pytest.approx(2 * 0.75 * w / B)
    # stages 0 and 1 cost what stage 2 costs at m = 1 and need more memory: dominated, dropped by default
    assert t.parts["weight_sync"][row(t, 1, False)] == pytest.approx(2 * 0.75 * w / B)
    pruned = choice_table(op, cfg, np.array([[0, 1, 2]]), m, micro_batches=1)
    assert sorted(zip(pruned.stage.tolist(), pruned.recompute.tolist())) == [(2, False), (2, True), (3, False),
                                                                            (3, True)]
    # recompute: forward FLOPs again (2 * 16*16*32 per device / F), no saved output
    jr = row(t, 0, True)
    assert t.parts["recompute"][jr] == pytest.approx(2 * 16 * 16 * 32 / F)
    assert t.activation_bytes[jr] == 0.0
    assert t.parts["compute"][jr] == pytest.approx(3 * 2 * 16 * 16 * 32 / F)


def test_choice_table_micro_batches():
    op = dense_op()
    m = Machine(4, peak_flops=F, bandwidth=B, latency=1e-6)
    cfg = np.array([[4, 1, 1]])
    t1 = choice_table(op, cfg, np.array([[0, 1, 2]]), m, micro_batches=1, prune=False)
    t4 = choice_table(op, cfg, np.array([[0, 1, 2]]), m, micro_batches=4, prune=False)
    w = 2048.0
    # activations divided by the micro-batch count; stage-0 sync once per step
    assert t4.activation_bytes[row(t4, 0, False)] == pytest.approx(1024 / 4)
    assert t4.parts["weight_sync"][row(t4, 0, False)] == pytest.approx(t1.parts["weight_sync"][row(t1, 0, False)])
    # stage 3 gathers and reduce-scatters once per micro-batch
    rs = 0.75 * w / B + 3 * 1e-6
    assert t4.parts["weight_sync"][row(t4, 3, False)] == pytest.approx(4 * 3 * rs)
    # stage 1: once per step (reduce-scatter + all-gather), kept since cheaper than stage 2 at m = 4
    assert t4.parts["weight_sync"][row(t4, 1, False)] == pytest.approx(2 * rs)
    assert t4.parts["weight_sync"][row(t4, 2, False)] == pytest.approx(4 * rs + rs)


def test_unsplit_weights_have_nothing_to_shard():
    op = dense_op()
    m = Machine(4, peak_flops=F, bandwidth=B)
    t = choice_table(op, np.array([[1, 4, 1]]), np.array([[1, 0, 2]]), m)  # n split 4: each device its own W tile
    assert set(t.stage.tolist()) == {0}


def _tiny_gpt():
    from shardplan.models import get_model

    return get_model("gpt", batch=8, layers=1, d_model=64, heads=2, seq=32, vocab=256)


def test_fit_plan_fits_and_agrees_with_ilp():
    from shardplan.search.memory_ilp import solve_memory_ilp

    g = _tiny_gpt()
    m = Machine(4, peak_flops=F, bandwidth=B, latency=1e-6, memory_bytes=1e12)
    tables = build_tables(g, m, orders="row-major")
    free = solve_fit(g, m, tables=tables, options=FitOptions(micro_batches=(1,)))
    budget = 0.6 * free.memory["peak_bytes"]
    plan = solve_fit(g, m, budget=budget, tables=tables, options=FitOptions(micro_batches=(1,)))
    assert plan.solution.optimal and plan.memory["peak_bytes"] <= budget
    assert plan.cost > free.cost
    mp, _ = fit_problem(tables, budget, 1)
    ilp = solve_memory_ilp(mp, time_limit=60)
    assert ilp.optimal and ilp.cost == pytest.approx(plan.cost, rel=1e-9)
    d = plan.to_dict()
    assert d["memory_choices"]["micro_batches"] == 1
    assert any(op["recompute"] or op["state_stage"] for op in d["operators"])


def test_fit_infeasible_names_least_memory():
    g = _tiny_gpt()
    m = Machine(4, peak_flops=F, bandwidth=B, memory_bytes=1000.0)
    with pytest.raises(ShardplanError, match="least memory any plan needs"):
        solve_fit(g, m)


TINY = ["--model", "gpt", "--set", "layers=1", "--set", "d_model=64", "--set", "heads=2", "--set", "seq=32",
        "--set", "vocab=256", "--batch", "8", "-p", "4", "--machine", "a100", "--orders", "row-major"]


def test_cli_solve_memory_reports_fit(capsys, tmp_path):
    import json

    from shardplan.cli import main

    out_json = tmp_path / "plan.json"
    # the unconstrained optimum needs 1.28 MiB per device
    code = main(["solve", *TINY, "--memory", "0.001", "--no-baselines", "--json", str(out_json)])
    out = capsys.readouterr().out
    assert code == 0
    assert "of 1.02 MiB (" in out and "proven optimal under the budget" in out
    d = json.loads(out_json.read_text())
    assert d["memory"]["peak_bytes"] <= 0.001 * 2**30
    ops = d["stages"][0]["operators"].values()
    chose = d["micro_batches"] > 1 or any(o["recompute"] or o["state_stage"] for o in ops)
    assert d["optimal"] is True and d["stats"]["memory_choices"] and chose


def test_cli_solve_memory_infeasible_is_one_line(capsys):
    from shardplan.cli import main

    code = main(["solve", *TINY, "--memory", "0.00001", "--no-baselines"])
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "least memory any plan needs" in err


def test_cli_bad_fit_options(capsys):
    from shardplan.cli import main

    assert main(["solve", *TINY, "--memory", "1", "--zero", "0,5"]) == 2
    assert "ZeRO stage 5" in capsys.readouterr().err
    assert main(["solve", *TINY, "--memory", "-1"]) == 2
    assert "--memory" in capsys.readouterr().err


def test_cli_time_limit_sets_the_fit_search_limit(capsys, monkeypatch):
    """--time-limit with --memory/--fit reaches FitOptions.time_limit; without them it is refused for the DP."""
    import shardplan.fit as fit
    from shardplan.cli import main

    seen = []
    real = fit.solve_fit

    def spy(*args, **kwargs):
        seen.append(kwargs["options"].time_limit)
        return real(*args, **kwargs)

    monkeypatch.setattr(fit, "solve_fit", spy)
    assert main(["solve", *TINY, "--memory", "0.001", "--no-baselines", "--time-limit", "7.5"]) == 0
    assert "proven optimal under the budget" in capsys.readouterr().out
    assert main(["solve", *TINY, "--memory", "0.001", "--no-baselines"]) == 0
    assert seen == [7.5, None]  # no wall clock unless asked for
    assert main(["solve", *TINY, "--no-baselines", "--time-limit", "7.5"]) == 2
    assert "--time-limit does not apply to --solver dp" in capsys.readouterr().err


def test_in_flight_micro_batches_multiply_saved_activations():
    op = dense_op()
    m = Machine(4, peak_flops=F, bandwidth=B)
    cfg, order = np.array([[4, 1, 1]]), np.array([[0, 1, 2]])
    one = choice_table(op, cfg, order, m, micro_batches=4, prune=False)
    three = choice_table(op, cfg, order, m, micro_batches=4, prune=False, in_flight=3)
    assert np.allclose(three.activation_bytes, 3 * one.activation_bytes)
    assert np.allclose(three.state_bytes, one.state_bytes)
    with pytest.raises(ShardplanError, match="in_flight"):
        FitOptions(in_flight=0)


@pytest.mark.parametrize("preset_name", ["a100", "paper"])
def test_stage0_without_recompute_costs_what_the_plain_plan_costs(preset_name):
    from shardplan.machine import preset

    g = _tiny_gpt()
    m = preset(preset_name, 16)
    tables = build_tables(g, replace_memory(m))
    for i, op in enumerate(g.operators):
        t = choice_table(op, tables.arrays[i], None, m, prune=False)
        rows = np.flatnonzero((t.stage == 0) & ~t.recompute)
        assert np.allclose(t.seconds[rows], tables.op_costs[i].total[t.base[rows]], rtol=1e-12, atol=0)


def replace_memory(m):
    from dataclasses import replace

    return replace(m, memory_bytes=None)


def test_compare_adds_the_plan_that_fits(capsys):
    from shardplan.cli import main

    code = main(["compare", "--model", "gpt", "--set", "layers=1", "--set", "d_model=64", "--set", "heads=2",
                 "--set", "seq=32", "--set", "vocab=256", "--batch", "8", "--procs", "4", "--machine", "a100",
                 "--memory", "0.0005"])
    out = capsys.readouterr().out
    assert code == 0
    line = next(x for x in out.splitlines() if "shardplan fit <= 524 KiB" in x)
    assert float(line.split()[-2]) <= 0.0005 * 2**20  # peak memory column, KiB
    dp_line = next(x for x in out.splitlines() if "shardplan (exact DP)" in x)
    assert float(dp_line.split()[-2]) > 0.0005 * 2**20


def test_operators_the_program_recomputes_only_recompute():
    """Graph.recomputed (a user's jax.checkpoint): only recomputing choices, in the table and the fit search."""
    from dataclasses import replace

    op = dense_op()
    m = Machine(4, peak_flops=F, bandwidth=B)
    cfg, order = np.array([[4, 1, 1]]), np.array([[0, 1, 2]])
    free = choice_table(op, cfg, order, m, prune=False)
    forced = choice_table(op, cfg, order, m, prune=False, forced_recompute=True)
    assert set(forced.recompute.tolist()) == {True} and not forced.activation_bytes.any()
    keep = np.flatnonzero(free.recompute)
    assert np.allclose(forced.seconds, free.seconds[keep]) and np.allclose(forced.bytes, free.bytes[keep])
    g = _tiny_gpt()
    mach = Machine(4, peak_flops=F, bandwidth=B, latency=1e-6, memory_bytes=1e12)
    names = {o.name for o in g.operators[: len(g.operators) // 2]}
    gr = replace(g, recomputed=frozenset(names))
    with pytest.raises(ShardplanError, match="not in the graph"):
        replace(g, recomputed=frozenset({"nope"}))
    tables = build_tables(gr, mach, orders="row-major")
    plan = solve_fit(gr, mach, tables=tables, options=FitOptions(micro_batches=(1,)))
    mc = plan.memory_choices
    assert all(mc.recompute(gr.index[n]) for n in names)
    plain = build_tables(g, mach, orders="row-major")
    unforced = solve_fit(g, mach, tables=plain, options=FitOptions(micro_batches=(1,)))
    assert plan.cost > unforced.cost  # the forward of the forced operators runs twice
    assert tables.memory_of(plan.assignment)["activations_bytes"] < plain.memory_of(plan.assignment)["activations_bytes"]


def test_recomputing_operator_keeps_the_inputs_no_producer_keeps():
    """An addition saves nothing (saved = 0); a dense reading it that recomputes must keep the sum itself.

    Graph: x (input) -> fc1 -> add(fc1, x2) [saved 0] -> fc2. On 4 devices with the batch split 4 ways the
    sum's tile is 16 x 32 floats = 2048 B; fc2's recompute rows keep exactly that, its saving rows its own
    output (16 x 8 floats = 512 B); fc1 (producer saved = 1) and the graph input keep nothing extra.
    """
    from dataclasses import replace

    b = GraphBuilder("g")
    x = b.input("x", (64, 16), needs_grad=True)
    x2 = b.input("x2", (64, 32), needs_grad=True)
    h = b.add(ops.dense("fc1", x, 32))
    s = b.add(replace(ops.elementwise("add", h, x2), saved=0.0))
    b.add(ops.dense("fc2", s, 8))
    g = b.build()
    assert producers_saved(g, g.operators[g.index["fc2"]]) == (0.0,)
    assert producers_saved(g, g.operators[g.index["fc1"]]) == (1.0,)
    mach = Machine(4, peak_flops=F, bandwidth=B, latency=1e-6, memory_bytes=1e12)
    tables = build_tables(g, mach, orders="row-major")
    fc2 = g.operators[g.index["fc2"]]
    lay = tables.arrays[g.index["fc2"]]
    j = int(np.flatnonzero((lay.splits == [4, 1, 1]).all(axis=1))[0])  # dims b, n, c
    keep = recompute_keep_bytes(fc2, lay, mach, unsaved_inputs(fc2, producers_saved(g, fc2)))
    assert keep[j] == 2048.0
    ct = choice_table(fc2, lay, None, mach, prune=False, recompute_keep=keep)
    mine = ct.base == j
    assert set(ct.activation_bytes[mine & ct.recompute].tolist()) == {2048.0}
    assert set(ct.activation_bytes[mine & ~ct.recompute].tolist()) == {512.0}
    # in the fit problem, fc2's recomputing choices keep more than they save: all dominated, pruned
    mp, cts = fit_problem(tables, 1e12, 1, FitOptions(micro_batches=(1,)))
    assert not cts[g.index["fc2"]].recompute.any()
    fc1 = cts[g.index["fc1"]]
    assert fc1.recompute.any() and not fc1.activation_bytes[fc1.recompute].any()
    # brute force agrees with the search on this problem with the keep charged, under a tight budget
    low = float(sum(t.bytes.min() for t in cts))
    mp2, _ = fit_problem(tables, low * 1.05, 1, FitOptions(micro_batches=(1,)))
    assert solve_memory(mp2).cost == pytest.approx(solve_memory_bruteforce(mp2).cost)


@pytest.mark.parametrize("frac", [0.5, 0.7, 0.9])
def test_root_duals_cut_at_the_best_plan_change_nothing(frac, monkeypatch):
    """solve_fit gives each micro-batch count's root dual the best plan so far as ``upper``: the dual stops
    once its bound reaches it, and the count is pruned as before. Plan, choices, cost, bound and proof
    equal those of running every root dual to the end; only Lagrangian solves are saved."""
    import shardplan.fit as fit

    # the roots themselves (the solve-free count bounds would close the counts before their roots)
    monkeypatch.setattr(fit, "_count_bound", lambda *a, **k: (-np.inf, 0.0))
    g = _tiny_gpt()
    # a fast network: one micro-batch is the best count and the others' duals are cut (fewer solves, asserted)
    m = Machine(4, peak_flops=F, bandwidth=100 * B, latency=1e-6, memory_bytes=1e12)
    tables = build_tables(g, m, orders="row-major")
    free = solve_fit(g, m, tables=tables, options=FitOptions(micro_batches=(1,)))
    budget = frac * free.memory["peak_bytes"]
    opts = FitOptions(micro_batches=(1, 2, 4, 8))
    cut = solve_fit(g, m, budget=budget, tables=tables, options=opts)
    real = fit.solve_memory

    def uncut(mp, **kw):  # the roots without ``upper``: every root dual runs to its end
        if kw.get("max_nodes") == 1:
            kw.pop("upper", None)
        return real(mp, **kw)

    monkeypatch.setattr(fit, "solve_memory", uncut)
    full = solve_fit(g, m, budget=budget, tables=tables, options=opts)
    assert cut.cost == full.cost and cut.assignment == full.assignment
    assert cut.memory_choices.choices == full.memory_choices.choices
    assert cut.memory_choices.micro_batches == full.memory_choices.micro_batches
    assert cut.solution.optimal == full.solution.optimal and cut.solution.bound == full.solution.bound
    assert cut.solution.stats["dp_solves"] < full.solution.stats["dp_solves"]
    def pruned(plan):  # the counts closed by their root bound (listed in the order of their bounds, which differ)
        return sorted(d["micro_batches"] for d in plan.solution.stats["per_micro_batches"]
                      if d["status"].startswith("pruned"))

    assert pruned(cut) == pruned(full)


@pytest.mark.parametrize("frac", [0.5, 0.7, 0.9])
def test_solve_free_count_bounds_change_nothing(frac, monkeypatch):
    """A micro-batch count whose forest bound (at multipliers near the earlier roots') reaches the best plan
    is closed without its root. Plan, choices, cost, bound and proof equal those of solving every root, and
    each closed count's bound is at most that count's own optimum (solved alone)."""
    from shardplan import fit

    g = _tiny_gpt()
    m = Machine(4, peak_flops=F, bandwidth=100 * B, latency=1e-6, memory_bytes=1e12)
    tables = build_tables(g, m, orders="row-major")
    free = solve_fit(g, m, tables=tables, options=FitOptions(micro_batches=(1,)))
    budget = frac * free.memory["peak_bytes"]
    opts = FitOptions(micro_batches=(1, 2, 4, 8))
    real = fit._count_bound
    with monkeypatch.context() as mpatch:  # every forest pass it may make, whatever the machine's speed
        # (no time share, and a pass reported free, so every count is tried)
        mpatch.setattr(fit, "_count_bound", lambda mp, best, lams, seconds=np.inf: (real(mp, best, lams)[0], 0.0))
        fast = solve_fit(g, m, budget=budget, tables=tables, options=opts)
    closed = {d["micro_batches"]: d["lower_bound"] for d in fast.solution.stats["per_micro_batches"]
              if d["status"] == "pruned: its solve-free bound reaches the best plan"}
    assert closed  # the case exercises the bound
    with monkeypatch.context() as mpatch:
        mpatch.setattr(fit, "_count_bound", lambda *a, **k: (-np.inf, 0.0))
        slow = solve_fit(g, m, budget=budget, tables=tables, options=opts)
    assert fast.cost == slow.cost and fast.assignment == slow.assignment
    assert fast.memory_choices.choices == slow.memory_choices.choices
    assert fast.memory_choices.micro_batches == slow.memory_choices.micro_batches
    assert fast.solution.optimal and slow.solution.optimal and fast.solution.bound == slow.solution.bound
    assert fast.solution.stats["dp_solves"] < slow.solution.stats["dp_solves"]
    for count, bound in closed.items():
        alone = solve_fit(g, m, budget=budget, tables=tables, options=FitOptions(micro_batches=(count,)))
        assert alone.solution.optimal and bound <= alone.cost
        assert bound >= fast.cost


def test_relaxed_bound_is_below_the_optimum_at_every_multiplier():
    """The forest bound of the Lagrangian problem, at any multiplier, bounds the constrained optimum."""
    from shardplan.search.constrained import relaxed_bound

    g = _tiny_gpt()
    m = Machine(4, peak_flops=F, bandwidth=100 * B, latency=1e-6, memory_bytes=1e12)
    tables = build_tables(g, m, orders="row-major")
    free = solve_fit(g, m, tables=tables, options=FitOptions(micro_batches=(1,)))
    for frac in (0.4, 0.6, 0.9):
        mp, _ = fit_problem(tables, frac * free.memory["peak_bytes"], 2)
        opt = solve_memory(mp).cost
        lam0 = opt / mp.budget
        bounds = [relaxed_bound(mp, lam0 * x) for x in (0.0, 0.1, 0.5, 1.0, 2.0, 10.0, 100.0)]
        assert all(b <= opt for b in bounds) and max(bounds) > bounds[0]
    with pytest.raises(ShardplanError, match="multiplier"):
        relaxed_bound(mp, -1.0)
