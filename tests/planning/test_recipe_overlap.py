"""``overlap=tp_comm``: the recipe's tensor-parallel collectives overlapped with the products, costed by the same
tables the search uses (``build_tables(..., overlap_tp=True)``), refused where the model cannot say it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shardplan.cli.commands import main
from shardplan.cost import build_tables, edge_cost
from shardplan.errors import ShardplanError
from shardplan.machine import preset
from shardplan.planner import plan, spmd_of
from shardplan.recipe import cost_recipe, table_options
from shardplan.report.summary import recipe_words
from shardplan.result import Plan
from shardplan.models import get_model

SIZES = {"layers": 4, "d_model": 256, "heads": 8, "seq": 64, "vocab": 1024}
BATCH = 32
MODEL = ["--model", "gpt"] + [x for k, v in SIZES.items() for x in ("--set", f"{k}={v}")]


def test_tp_comm_needs_sequence_parallelism_in_one_line():
    with pytest.raises(ShardplanError, match="needs sp=true") as e:
        cost_recipe("gpt", preset("a100", 16), "tp=8,overlap=tp_comm", batch=BATCH, sizes=SIZES)
    assert "\n" not in str(e.value) and "Megatron-LM and torchtitan" in str(e.value)


@pytest.mark.parametrize("text, refused", [
    ("tp=4,sp,zero=3,overlap=tp_comm+grad_reduce+param_gather", True),  # tensor group half a node: shared links
    ("tp=8,sp,zero=3,overlap=tp_comm+grad_reduce+param_gather", False),  # one node: NVLink vs the network
    ("tp=4,sp,zero=3,overlap=tp_comm", False),  # FSDP not overlapped: nothing else hides behind the products
    ("tp=4,sp,zero=1,offload=optimizer,overlap=tp_comm", True)])
def test_tp_comm_with_other_overlaps_only_on_disjoint_links(text, refused):
    m = replace(preset("h100", 16), cpu_adam_rate=1e9) if "offload" in text else preset("h100", 16)
    if refused:
        with pytest.raises(ShardplanError, match="tp = node size"):
            cost_recipe("gpt", m, text, batch=BATCH, sizes=SIZES)
    else:
        assert cost_recipe("gpt", m, text, batch=BATCH, sizes=SIZES).step_time > 0


def test_one_program_recipe_gains_exactly_the_hidden_edge_seconds():
    """The same layouts, vertices and memory choices; only the edges differ, each by what its product hides:
    the difference of the step times is the sum over edges of (plain - overlapped) at the recipe's layouts
    (``overlap=none`` against ``overlap=tp_comm``: neither overlaps the gradient reduction). On the plain roofline:
    with the a100's tiles and waves the chunks of these small products (16 tokens each) cost more than they hide,
    and nothing is overlapped (tests/cost/test_overlap_tp.py)."""
    m = replace(preset("a100", 16), overlap_grad=False, sm_count=None, gemm_tiles=None)
    plain = cost_recipe("gpt", m, "tp=8,sp,mbs=2,overlap=none", batch=BATCH, sizes=SIZES)
    ov = cost_recipe("gpt", m, "tp=8,sp,mbs=2,overlap=tp_comm", batch=BATCH, sizes=SIZES)
    a, b = plain.stages[0].operators, ov.stages[0].operators
    assert [c.layout for c in a.values()] == [c.layout for c in b.values()]
    g = get_model("gpt", BATCH, **SIZES)
    opts = table_options(m, 8, 2, True)
    t0 = build_tables(g, replace(m, memory_bytes=None), **opts)
    t1 = build_tables(g, replace(m, memory_bytes=None), **{**opts, "overlap_tp": True})
    lays = [a[op.name].layout for op in g.operators]
    idx = [t0.index_of(i, lay) for i, lay in enumerate(lays)]
    assert idx == [t1.index_of(i, lay) for i, lay in enumerate(lays)]
    gain = sum(float(x[idx[e.src], idx[e.dst]] - y[idx[e.src], idx[e.dst]])
               for e, x, y in zip(g.edges, t0.edge_costs, t1.edge_costs))
    assert gain > 0
    assert plain.step_time - ov.step_time == pytest.approx(gain, rel=1e-9)
    assert ov.stats["overlap_tp"]["hidden_seconds"] == pytest.approx(gain, rel=1e-9)
    assert ov.breakdown["redistribution"] == pytest.approx(plain.breakdown["redistribution"] - gain, rel=1e-9)
    # one edge by hand: the reduce-scatter behind the first layer's attention output (one consumer)
    i = next(k for k, op in enumerate(g.operators) if op.kind == "attn_out")
    e = next(k for k, x in enumerate(g.edges) if x.src == i)
    j = g.edges[e].dst
    full = edge_cost(g.operators[i], t1.arrays[i].take([idx[i]]), g.operators[j], g.edges[e].slot,
                     t1.arrays[j].take([idx[j]]), m)[0, 0]
    assert full == pytest.approx(t0.edge_costs[e][idx[i], idx[j]], rel=1e-12)
    assert t1.edge_costs[e][idx[i], idx[j]] < full


def test_the_plan_says_so_and_round_trips():
    m = preset("a100", 16)
    ov = cost_recipe("gpt", m, "tp=8,sp,mbs=2,overlap=tp_comm", batch=BATCH, sizes=SIZES)
    words = recipe_words(ov)
    n = ov.stats["overlap_tp"]["edges"]
    assert n > 0 and f"tensor-parallel collectives overlapped with their products on {n} edges" in words
    q = Plan.from_json(ov.to_json())
    assert q == ov and recipe_words(q) == words
    plain = cost_recipe("gpt", m, "tp=8,sp,mbs=2", batch=BATCH, sizes=SIZES)
    assert "overlapped" not in recipe_words(plain)
    rebuilt = spmd_of(replace(q, detail=None), get_model("gpt", BATCH, **SIZES))
    assert rebuilt.cost == pytest.approx(ov.step_time, rel=1e-9)


def test_pipeline_recipe_overlaps_too():
    m = preset("a100", 16)
    plain = cost_recipe("gpt", m, "tp=8,sp,pp=2,mbs=2", batch=BATCH, sizes=SIZES)
    ov = cost_recipe("gpt", m, "tp=8,sp,pp=2,mbs=2,overlap=tp_comm", batch=BATCH, sizes=SIZES)
    assert ov.step_time < plain.step_time
    assert ov.stats["table_options"]["overlap_tp"] is True
    assert "overlapped with their products" in recipe_words(ov)


def test_plan_with_overlap_tp_is_never_slower_and_records_it():
    m = preset("a100", 8)
    sizes = {**SIZES, "d_model": 1024, "heads": 16, "seq": 1024, "layers": 1}
    kw = dict(batch=8, sizes=sizes, fit=False, stages=False, cutoff=1, orders="row-major")
    a = plan("gpt", m, partial_sums=True, **kw)
    b = plan("gpt", m, overlap_tp=True, **kw)
    assert b.step_time <= a.step_time * (1 + 1e-12)
    assert b.stats["table_options"]["overlap_tp"] is True and "overlap_tp" in b.stats
    with pytest.raises(ShardplanError, match="overlap_tp must be True or False"):
        plan("gpt", m, overlap_tp=1, **kw)


def test_cli_flag_and_recipe(capsys):
    assert main(["plan", *MODEL, "-p", "8", "--machine", "a100", "--batch", "8", "--no-fit", "--stages", "off",
                 "--overlap-tp"]) == 0
    out = capsys.readouterr().out
    assert "Plan:" in out and ("overlapped with their products" in out or "no collective overlapped" in out)
    assert main(["recipe", *MODEL, "-p", "16", "--machine", "a100", "--batch", "32",
                 "--recipe", "tp=8,sp,mbs=2,overlap=tp_comm"]) == 0
    assert "tensor-parallel collectives overlapped with their products on" in capsys.readouterr().out
    assert main(["recipe", *MODEL, "-p", "16", "--machine", "a100", "--batch", "32",
                 "--recipe", "tp=8,overlap=tp_comm"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs sp=true" in err
