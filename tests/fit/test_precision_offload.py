"""FP8 matrix products and host offload (optimizer state, parameters, activations) as choices of the fit search."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest

from shardplan import ops, preset
from shardplan.cost import build_tables
from shardplan.cost.memory import ChoiceRules, choice_table, fp8_product
from shardplan.errors import ShardplanError
from shardplan.fit import FitOptions, plan_with_choices, solve_fit
from shardplan.ir import GraphBuilder, TensorRef
from shardplan.machine import Machine
from shardplan.models import get_model

F, B = 1e12, 1e9
ALL = ("optimizer", "parameters", "activations")


def dense_op():
    # y[b, n] = sum_c x[b, c] W[c, n]: b = 64, c = 32, n = 16; W 512 elements (1024 bytes in bf16)
    return ops.dense("fc", TensorRef("x", (64, 32), needs_grad=True), 16)


def host_machine(p: int = 4, **kw) -> Machine:
    base = dict(peak_flops=F, bandwidth=B, dtype_bytes=2, hbm_bandwidth=1e14, fp8_flops=2 * F, host_bandwidth=1e8,
                host_latency=1e-6, host_memory_bytes=1e9, cpu_adam_rate=1e7)
    return Machine(p, **{**base, **kw})


def row(t, stage=0, recompute=False, fp8=False, offload=0):
    j = np.flatnonzero((t.stage == stage) & (t.recompute == recompute) & (t.fp8 == fp8) & (t.offload == offload))
    assert len(j) == 1
    return int(j[0])


CFG, ORDER = np.array([[4, 1, 1]]), np.array([[0, 1, 2]])  # dims b, n, c: the batch split 4 ways


def test_fp8_products_are_read_off_the_description():
    x = TensorRef("x", (8, 4, 32), needs_grad=True)
    assert fp8_product(ops.dense("fc", x, 16))  # contracts c of x with W
    assert not fp8_product(ops.layer_norm("ln", x))  # a weight, no contraction
    assert not fp8_product(ops.softmax("sm", x))
    assert not fp8_product(ops.embedding("emb", TensorRef("ids", (8, 4), needs_grad=False), 100, 32))
    q = TensorRef("q", (8, 4, 32), needs_grad=True)
    assert not fp8_product(ops.einsum("scores", "bsd,btd->bst", q, q))  # a product without a weight
    conv = ops.conv2d("conv", TensorRef("img", (8, 3, 16, 16), needs_grad=True), 8, 3)
    assert fp8_product(conv)


def test_fp8_choice_by_hand():
    """Compute-bound (HBM 1e14 B/s): per device 16 x 16 x 32 multiply-adds per pass, 3 passes.

    bf16: 3 * 2 * 8192 / 1e12 s; fp8 at 2e12 FLOP/s: half. Casts: (2 + 2) bytes per element of the
    x tile (16 x 32), W (32 x 16) and dY (16 x 16) over 1e14 B/s. Memory: + 2 bytes per W element (FP8 copy
    and transpose) and + 1 byte per x element saved in FP8.
    """
    op = dense_op()
    m = host_machine()
    t = choice_table(op, CFG, ORDER, m, prune=False, rules=ChoiceRules(fp8=True))
    b16, f8 = row(t), row(t, fp8=True)
    assert t.parts["compute"][b16] == pytest.approx(3 * 2 * 8192 / F)
    assert t.parts["compute"][f8] == pytest.approx(3 * 2 * 8192 / (2 * F))
    assert t.parts["fp8_scaling"][b16] == 0.0
    assert t.parts["fp8_scaling"][f8] == pytest.approx(4 * (512 + 512 + 256) / 1e14)
    assert t.state_bytes[f8] - t.state_bytes[b16] == pytest.approx(2 * 512)
    assert t.activation_bytes[b16] == pytest.approx(256 * 2)
    assert t.activation_bytes[f8] == pytest.approx(256 * 2 + 512)
    # recomputing runs the FP8 forward again
    assert t.parts["recompute"][row(t, 0, True, True)] == pytest.approx(2 * 8192 / (2 * F))


def test_fp8_where_it_does_not_pay_is_dominated():
    """Memory-bound (HBM 1e10 B/s): the products take the same time in FP8, the casts add time and the FP8
    copies memory, so no FP8 choice survives the pruning; nor is any offered without an FP8 peak."""
    op = dense_op()
    slow = host_machine(hbm_bandwidth=1e10)
    t = choice_table(op, CFG, ORDER, slow, prune=False, rules=ChoiceRules(fp8=True))
    assert t.parts["compute"][row(t, fp8=True)] == pytest.approx(t.parts["compute"][row(t)])
    assert not choice_table(op, CFG, ORDER, slow, rules=ChoiceRules(fp8=True)).fp8.any()
    no_fp8 = host_machine(fp8_flops=None)
    assert not choice_table(op, CFG, ORDER, no_fp8, prune=False, rules=ChoiceRules(fp8=True)).fp8.any()
    ln = ops.layer_norm("ln", TensorRef("x", (64, 32), needs_grad=True))
    lt = choice_table(ln, np.array([[4, 1]]), np.array([[0, 1]]), host_machine(), prune=False,
                      rules=ChoiceRules(fp8=True))
    assert not lt.fp8.any()


def test_master_weights_store_16_bytes_per_parameter_for_adam():
    op = dense_op()
    m = host_machine()
    t = choice_table(op, CFG, ORDER, m, prune=False, rules=ChoiceRules(master_weights=True))
    assert t.state_bytes[row(t)] == pytest.approx(16 * 512)  # 2 + 2 + 4 (fp32 master) + 8 (fp32 moments)
    assert t.state_bytes[row(t, 3)] == pytest.approx(16 * 512 / 4)
    assert t.state_bytes[row(t, 1)] == pytest.approx(512 * (2 + 2 + 12 / 4))  # ZeRO-1: 2 + 2 + K/N
    fp32 = replace(m, dtype_bytes=4)
    t4 = choice_table(op, CFG, ORDER, fp32, prune=False, rules=ChoiceRules(master_weights=True))
    assert t4.state_bytes[row(t4)] == pytest.approx(4 * 512 * 4)  # fp32 weights are their own master copy


def test_optimizer_offload_by_hand():
    """Stage 1, optimizer offloaded: P = 1024 bytes of weights, G = 4, o = 2 words, shard P/G = 256 bytes.

    Device: P (2 + o/G) - o P/G = 2048 bytes. Host: the state o P/G and the gradient shard P/G = 768 bytes.
    Time: the gradient shard down (256 B / 1e8 B/s + 1 us) beyond the backward compute, the CPU Adam of
    128 elements with 4 devices sharing 1e7 parameters/s, the updated shard up (256 B / 1e8 B/s + 1 us).
    """
    op = dense_op()
    m = host_machine()
    t = choice_table(op, CFG, ORDER, m, prune=False, rules=ChoiceRules(offload=("optimizer",)))
    j = row(t, 1, offload=1)
    assert t.state_bytes[j] == pytest.approx(2048)
    assert t.host_bytes[j] == pytest.approx(768)
    backward = 2 * 2 * 8192 / F
    xfer = 256 / 1e8 + 1e-6
    assert t.parts["offload"][j] == pytest.approx((xfer - backward) + 128 * 4 / 1e7 + xfer)
    assert t.parts["offload"][row(t, 1)] == 0.0 and t.host_bytes[row(t, 1)] == 0.0
    assert not np.any((t.stage == 0) & (t.offload & 1))  # DeepSpeed offloads a ZeRO partition: stages 1-3


def test_parameter_and_activation_offload_by_hand():
    """Stage 3 with parameters and optimizer offloaded: the device keeps the gradient shard only; the shard is
    fetched before the forward and the backward (2 x 256 B). Activations offloaded: the 512-byte output tile
    goes down in the forward and up in the backward, each beyond that pass's compute."""
    op = dense_op()
    m = host_machine()
    t = choice_table(op, CFG, ORDER, m, prune=False, rules=ChoiceRules(offload=ALL))
    j = row(t, 3, offload=3)
    assert t.state_bytes[j] == pytest.approx(256)
    assert t.host_bytes[j] == pytest.approx(2 * 256 + 256 + 256)  # state, gradient shard, parameters
    fwd, bwd = 2 * 8192 / F, 2 * 2 * 8192 / F
    fetch = 256 / 1e8 + 1e-6
    down = 256 / 1e8 + 1e-6
    assert t.parts["offload"][j] == pytest.approx((fetch - fwd) + (max(fetch, down) - bwd) + 128 * 4 / 1e7)
    a = row(t, 0, offload=4)
    assert t.activation_bytes[a] == 0.0 and t.host_bytes[a] == pytest.approx(512)
    moved = 512 / 1e8 + 1e-6
    assert t.parts["offload"][a] == pytest.approx((moved - fwd) + (moved - bwd))
    assert not np.any(t.recompute & (t.offload & 4).astype(bool))  # nothing saved to offload when recomputing


def _two_products():
    b = GraphBuilder("g")
    x = b.input("x", (256, 128), needs_grad=False)
    h = b.add(ops.dense("fc1", x, 256))
    b.add(ops.dense("fc2", h, 64))
    return b.build()


def _bruteforce(tables, options: FitOptions, budget: float, host: float) -> float:
    """The least step time over every combination of the unpruned choices within both budgets (inf: none)."""
    g = tables.graph
    mach = tables.machine
    cts = [choice_table(op, lay, None, mach, 1, options.stages, options.recompute, 2.0, prune=False,
                        rules=options.rules) for op, lay in zip(g.operators, tables.arrays)]
    edges = tables.all_edges()
    best = np.inf
    for pick in itertools.product(*(range(len(t.base)) for t in cts)):
        dev = sum(t.bytes[j] for t, j in zip(cts, pick))
        hb = sum(t.host_bytes[j] for t, j in zip(cts, pick))
        if dev > budget or hb > host:
            continue
        cost = sum(t.seconds[j] for t, j in zip(cts, pick))
        cost += sum(mat[cts[s].base[pick[s]], cts[d].base[pick[d]]] for s, d, mat in edges)
        best = min(best, cost)
    return best


@pytest.mark.parametrize("frac,host_frac", [(1.0, None), (0.5, None), (0.3, None), (0.15, None), (0.5, 0.5),
                                            (0.3, 0.3), (0.15, 0.6)])
def test_fit_with_fp8_and_offload_matches_bruteforce(frac, host_frac):
    """Two dense layers on 2 devices, stages 0 and 3, recomputation, FP8 and every offload: the fit search
    (with its host pruning and, where the relaxation's plan exceeds the host budget, the two-row ILP) equals
    brute force over the unpruned choices at budgets from loose to tight, with and without a binding host budget."""
    g = _two_products()
    mach = Machine(2, peak_flops=F, bandwidth=B, latency=1e-6, dtype_bytes=2, hbm_bandwidth=1e12, fp8_flops=2 * F,
                   host_bandwidth=5e9, host_latency=1e-6, host_memory_bytes=1e12, cpu_adam_rate=1e9)
    tables = build_tables(g, mach, orders="row-major", cutoff=1)
    opts = FitOptions(stages=(0, 3), micro_batches=(1,), fp8=True, offload=ALL)
    free = solve_fit(g, mach, budget=1e12, tables=tables, options=opts)
    top = free.memory["peak_bytes"]
    host = np.inf
    if host_frac is not None:
        relaxed = solve_fit(g, mach, budget=frac * top, tables=tables, options=opts)
        host = host_frac * relaxed.memory["host_bytes"]
    o = replace(opts, host_budget_bytes=None if host == np.inf else host)
    want = _bruteforce(tables, o, frac * top, host)
    if not np.isfinite(want):
        with pytest.raises(ShardplanError):
            solve_fit(g, mach, budget=frac * top, tables=tables, options=o)
        return
    plan = solve_fit(g, mach, budget=frac * top, tables=tables, options=o)
    assert plan.cost == pytest.approx(want, rel=1e-6)
    assert plan.memory["peak_bytes"] <= frac * top * (1 + 1e-9)
    assert plan.memory.get("host_bytes", 0.0) <= host * (1 + 1e-9)


def test_host_budget_below_the_relaxed_plan_runs_the_two_row_ilp_and_matches_bruteforce():
    """Host budgets from 5% to 95% of what the plan without a host budget holds: every answer equals brute force,
    and at some of them the plan of the relaxation (host budget ignored after pruning) exceeds the host budget,
    so the two-row ILP decides."""
    g = _two_products()
    mach = Machine(2, peak_flops=F, bandwidth=B, latency=1e-6, dtype_bytes=2, hbm_bandwidth=1e12, fp8_flops=2 * F,
                   host_bandwidth=5e9, host_latency=1e-6, host_memory_bytes=1e12, cpu_adam_rate=1e9)
    tables = build_tables(g, mach, orders="row-major", cutoff=1)
    opts = FitOptions(stages=(0, 3), recompute=False, micro_batches=(1,), offload=ALL)
    top = solve_fit(g, mach, budget=1e12, tables=tables, options=opts).memory["peak_bytes"]
    budget = 0.2 * top
    held = solve_fit(g, mach, budget=budget, tables=tables, options=opts).memory["host_bytes"]
    ilp_runs = 0
    for frac in np.linspace(0.05, 0.95, 10):
        o = replace(opts, host_budget_bytes=float(frac * held))
        want = _bruteforce(tables, o, budget, frac * held)
        if not np.isfinite(want):
            with pytest.raises(ShardplanError):
                solve_fit(g, mach, budget=budget, tables=tables, options=o)
            continue
        plan = solve_fit(g, mach, budget=budget, tables=tables, options=o)
        assert plan.cost == pytest.approx(want, rel=1e-6)
        assert plan.memory["host_bytes"] <= frac * held * (1 + 1e-9)
        ilp_runs += plan.solution.solver == "memory-ilp"
    assert ilp_runs > 0


def test_fp8_is_picked_for_large_products_on_h100_and_never_on_a100():
    g = get_model("gpt", batch=8, layers=1, d_model=2048, heads=16, seq=1024, vocab=4096)
    opts = FitOptions(micro_batches=(1,), fp8=True, master_weights=True)
    h = solve_fit(g, preset("h100", 8), cutoff=1, options=opts)
    fp8 = {op.name for i, op in enumerate(g.operators) if h.memory_choices.fp8(i)}
    assert {"L1/ffn1", "L1/ffn2"} <= fp8
    assert all(fp8_product(g.operators[g.index[n]]) for n in fp8)  # never attention, norms, the embedding
    plain = solve_fit(g, preset("h100", 8), cutoff=1, options=replace(opts, fp8=False))
    assert h.cost < plain.cost
    a = solve_fit(g, preset("a100", 8), cutoff=1, options=opts)
    assert not any(a.memory_choices.fp8(i) for i in range(len(g.operators)))
    tiny = get_model("gpt", batch=8, layers=1, d_model=64, heads=2, seq=32, vocab=256)
    # small products on the roofline without tile quantisation: bound by HBM, casts cost. (On the tiled profile a
    # product this small fills a few multiprocessors of one wave, bound by their tensor rate, which FP8 doubles.)
    untiled = replace(preset("h100", 4), sm_count=None, gemm_tiles=None)
    t = solve_fit(tiny, untiled, cutoff=1, options=opts)
    assert not any(t.memory_choices.fp8(i) for i in range(len(tiny.operators)))


def test_optimizer_offload_is_picked_under_a_tight_budget_and_not_under_a_loose_one():
    """GPT-3 13B's layer sizes (2 of its 40 blocks) on 8 H100 with mixed-precision state. (An activation offload
    whose transfers hide under the operator's compute costs nothing in the model, so a loose budget may take it:
    only the optimizer offload, whose CPU step is never hidden, is asserted absent.)"""
    g = get_model("gpt3-13b", batch=16, layers=2)
    mach = preset("h100", 8)
    opts = FitOptions(micro_batches=(1, 2), master_weights=True, offload=ALL)
    loose = solve_fit(g, mach, cutoff=1, budget=1e15, options=opts)
    n = len(g.operators)
    assert not any("optimizer" in loose.memory_choices.offload(i) for i in range(n))
    without = replace(opts, offload=())
    least = _least_memory(g, mach, without)
    with pytest.raises(ShardplanError, match="least memory"):
        solve_fit(g, mach, cutoff=1, budget=0.9 * least, options=without)
    tight = solve_fit(g, mach, cutoff=1, budget=0.9 * least, options=opts)
    assert tight.memory["peak_bytes"] <= 0.9 * least
    assert any("optimizer" in tight.memory_choices.offload(i) for i in range(n))
    assert 0 < tight.memory["host_bytes"] <= opts.host_budget(mach)
    assert tight.cost > loose.cost


def _least_memory(g, mach, opts) -> float:
    from shardplan.fit import fit_problem

    tables = replace(build_tables(g, replace(mach, memory_bytes=None), cutoff=1), machine=mach)
    return min(fit_problem(tables, 1e18, m, opts)[0].least_memory() for m in opts.micro_batches)


def test_a_host_budget_nothing_fits_is_one_error():
    g = _two_products()
    mach = host_machine(p=2, host_bandwidth=5e9, cpu_adam_rate=1e9)
    tables = build_tables(g, mach, orders="row-major", cutoff=1)
    free = solve_fit(g, mach, budget=1e12, tables=tables, options=FitOptions(micro_batches=(1,)))
    opts = FitOptions(stages=(3,), micro_batches=(1,), offload=ALL, host_budget_bytes=0.0)
    plan = solve_fit(g, mach, budget=1e12, tables=tables, options=opts)  # a zero host budget: nothing offloads
    assert plan.cost == pytest.approx(free.cost) and plan.memory.get("host_bytes", 0.0) == 0.0
    with pytest.raises(ShardplanError, match="offload 'disk'"):
        FitOptions(offload=("disk",))


def test_plan_fields_round_trip_and_recipe_words():
    from shardplan.planner import from_spmd
    from shardplan.report.summary import recipe_words
    from shardplan.result import Plan

    g = get_model("gpt", batch=8, layers=1, d_model=1024, heads=8, seq=512, vocab=4096)
    mach = preset("h100", 8)
    base = solve_fit(g, mach, cutoff=1, options=FitOptions(micro_batches=(1,)))
    sp = plan_with_choices(base, stage=1, fp8=True, offload=("optimizer", "activations"), master_weights=True)
    plan = from_spmd(sp)
    back = Plan.from_json(plan.to_json())
    assert back == plan
    chosen = [c for c in plan.stages[0].operators.values()]
    assert any(c.fp8 for c in chosen) and any("optimizer" in c.offload for c in chosen)
    assert all(c.offload == () or c.offload[-1] in ALL for c in chosen)
    words = recipe_words(plan)
    assert "FP8 on" in words and "optimizer offloaded" in words and "activations offloaded" in words
    assert sp.memory["host_bytes"] > 0


def test_recipe_precision_and_offload_keys():
    from shardplan.recipe import Recipe, cost_recipe

    r = Recipe.parse("tp=2,zero=1,fp8,offload=activations+optimizer")
    assert r.precision == "fp8" and r.offload == ("optimizer", "activations")
    assert Recipe.parse(str(r)) == r and str(r) == "tp=2,zero=1,precision=fp8,offload=optimizer+activations"
    assert Recipe.parse("fp8=false") == Recipe() and Recipe.parse("precision=mixed").precision == "mixed"
    with pytest.raises(ShardplanError, match="precision given twice"):
        Recipe.parse("precision=mixed,fp8=true")
    with pytest.raises(ShardplanError, match="offload 'disk'"):
        Recipe.parse("offload=disk")
    sizes = dict(layers=2, d_model=1024, heads=16, seq=1024)
    h100 = preset("h100", 8)
    cost = {t: cost_recipe("gpt", h100, t, sizes=sizes, batch=16)
            for t in ("tp=2", "tp=2,precision=mixed", "tp=2,fp8", "tp=2,zero=3,precision=mixed,offload=optimizer",
                      "tp=2,zero=3,precision=mixed")}
    assert cost["tp=2,precision=mixed"].memory["weights_bytes"] > cost["tp=2"].memory["weights_bytes"]
    assert cost["tp=2,fp8"].step_time < cost["tp=2,precision=mixed"].step_time
    off, on = cost["tp=2,zero=3,precision=mixed"], cost["tp=2,zero=3,precision=mixed,offload=optimizer"]
    assert on.memory["peak_bytes"] < off.memory["peak_bytes"] and on.memory["host_bytes"] > 0
    assert on.step_time > off.step_time  # the CPU Adam step and the copies
    with pytest.raises(ShardplanError, match="no FP8"):
        cost_recipe("gpt", preset("a100", 8), "tp=2,fp8", sizes=sizes, batch=16)
    with pytest.raises(ShardplanError, match="ZeRO partition"):
        cost_recipe("gpt", h100, "tp=2,offload=optimizer", sizes=sizes, batch=16)
