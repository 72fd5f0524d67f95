"""Megatron-Core's pipeline split as recipe keys (uneven ends with interleaving, the embedding and the loss counted
as layers), interleaved chunks of unequal length costed by the event simulation, and sequence parallelism beside
context parallelism (the norms' sequence split over the tensor group inside the node and the context group
across nodes)."""

from __future__ import annotations

import dataclasses

import pytest

from shardplan.cost import build_tables
from shardplan.cost.edge import edge_volumes
from shardplan.errors import ShardplanError
from shardplan.layout import LayoutArrays
from shardplan.machine import preset
from shardplan.models import model_spec
from shardplan.pipeline.schedule import StageTimes, makespan, simulate
from shardplan.recipe import Recipe, _stage_bounds, chunk_sizes, cost_recipe, megatron_layouts, table_options


def _offsets(sizes: tuple[int, ...]) -> list[int]:
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return out


# -- the split -----------------------------------------------------------------------------------------------
def test_llama31_405b_split_counts_the_embedding_and_the_loss():
    """Megatron-Bridge's 405B recipe: 126 blocks + embedding + loss = 128 layers, 16 per rank, 2 per chunk; the
    first chunk is the embedding and block 1, the last block 126 and the loss."""
    sizes = chunk_sizes(126, 8, 8, embedding_as_layer=True, loss_as_layer=True)
    assert sizes == (2,) * 64
    rec = Recipe.parse("tp=8,cp=2,pp=8,vp=8,embedding_as_layer=true,loss_as_layer=true")
    bounds = _stage_bounds(rec, 128)  # units: embedding, 126 blocks, head
    assert bounds == list(range(0, 129, 2))
    # without counting them the 126 blocks do not split into 8 ranks (Megatron-Core asserts the same)
    with pytest.raises(ShardplanError, match="126 layers do not split evenly into pp=8"):
        chunk_sizes(126, 8, 8)
    # only the embedding counted: 127 layers do not split either
    with pytest.raises(ShardplanError, match=r"127 layers \(counting the embedding\)"):
        chunk_sizes(126, 8, 8, embedding_as_layer=True)


def test_one_side_counted_rides_the_other_end():
    """Counting only the loss: the embedding rides with the first chunk (unit 0 is not a layer)."""
    rec = Recipe.parse("pp=2,vp=2,loss_as_layer=true")
    assert chunk_sizes(7, 2, 2, loss_as_layer=True) == (2, 2, 2, 2)
    assert _stage_bounds(rec, 9) == [0, 3, 5, 7, 9]  # [emb + 2 blocks] [2] [2] [1 block + head]
    rec = Recipe.parse("pp=2,vp=2,embedding_as_layer=true")
    assert _stage_bounds(rec, 9) == [0, 2, 4, 6, 9]  # [emb + 1 block] [2] [2] [2 blocks + head]


def test_uneven_ends_with_interleaving_follow_megatron_core():
    """``decoder_first_pipeline_num_layers`` with virtual stages: the first rank's count is split evenly over
    *its* v chunks (Megatron-Core gives it to every virtual stage of rank 0), likewise the last; the chunk order
    is round r, rank k -> chunk r pp + k, and the offsets are get_transformer_layer_offset's."""
    pp, vp, first, last, blocks = 4, 2, 2, 4, 14  # ranks: 2, 4, 4, 4 blocks
    sizes = chunk_sizes(blocks, pp, vp, first, last)
    assert sizes == (1, 2, 2, 2, 1, 2, 2, 2)
    per_chunk = (first // vp, (blocks - first - last) // (pp - 2) // vp, last // vp)
    total = per_chunk[0] + per_chunk[1] * (pp - 2) + per_chunk[2]
    offsets = [r * total + (0 if k == 0 else per_chunk[0] + (k - 1) * per_chunk[1]) for r in range(vp)
               for k in range(pp)]
    assert _offsets(sizes)[:-1] == offsets
    assert sum(sizes) == blocks
    with pytest.raises(ShardplanError, match="do not split evenly into vp=2"):
        chunk_sizes(15, 4, 2, first=3, last=4)  # rank 0 holds 3 blocks: not a multiple of vp
    with pytest.raises(ShardplanError, match="Megatron-Core refuses both together"):
        chunk_sizes(14, 4, 2, first=2, embedding_as_layer=True)


def test_recipe_keys_parse_print_and_refuse():
    text = "tp=8,sp=true,cp=2,pp=8,vp=8,embedding_as_layer=true,loss_as_layer=true,mbs=1,gbs=512"
    rec = Recipe.parse(text)
    assert rec.embedding_as_layer and rec.loss_as_layer
    assert Recipe.parse(str(rec)) == rec and "embedding_as_layer=true" in str(rec)
    assert Recipe.from_mapping({"embedding-as-layer": "true"}).embedding_as_layer
    machine = preset("h100", 16)
    for bad, why in (("loss_as_layer=true", "need pp >= 2"),
                     ("pp=2,first_stage_layers=1,embedding_as_layer=true", "Megatron-Core refuses")):
        with pytest.raises(ShardplanError, match=why):
            cost_recipe("llama3-8b", machine, bad, batch=8, sizes={"layers": 2, "seq": 1024})


# -- unequal chunks ------------------------------------------------------------------------------------------
def test_chunk_times_equal_to_the_default_split_give_the_same_timeline():
    st = [StageTimes(2.0, 4.0), StageTimes(1.0, 3.0)]
    chunks = [StageTimes(1.0, 2.0), StageTimes(0.5, 1.5)] * 2
    assert simulate(st, [0.25], 4, "interleaved", 2, chunk_times=chunks) == simulate(st, [0.25], 4, "interleaved", 2)
    with pytest.raises(ShardplanError, match="chunk_times"):
        simulate(st, [0.25], 4, "interleaved", 2, chunk_times=chunks[:3])


def test_unequal_chunks_are_costed_by_the_event_simulation():
    """Each chunk runs its own seconds: a group whose first chunk is short (embedding + 1 block) and later ones
    long (2 blocks) is not 'v equal chunks'; the recipe's step is the simulation with the chunks' own times, the
    closed form kept beside it."""
    sizes = {"layers": 6, "seq": 1024}
    plan = cost_recipe("llama3-8b", preset("h100", 32), "tp=8,pp=2,vp=2,embedding_as_layer=true,loss_as_layer=true",
                       batch=8, sizes=sizes)
    assert [(s.first, s.end) for s in plan.stages] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    pipe = plan.detail.plan
    chunks = [StageTimes(s.cost.forward, s.cost.backward) for s in pipe.stages]
    assert chunks[0] != chunks[2]  # embedding + block 1 vs blocks 4, 5 on the same device group
    sim = makespan(simulate(pipe.stage_times(), pipe.group_links(), pipe.micro_batches, "interleaved", 2,
                            back=pipe.group_links(back=True), chunk_times=chunks))
    assert plan.step_time == sim == pipe.step_time
    assert plan.stats["closed_form_step"] != sim and plan.stats["step_from"].startswith("event simulation")


# -- sequence parallelism with context parallelism -------------------------------------------------------------
SMALL = {"layers": 1, "seq": 4096}


def _recipe_tables(tp: int, cp: int, machine=None):
    machine = preset("h100", 32) if machine is None else machine  # nodes of 8, 4 nodes
    g = model_spec("llama3-8b").build(8, **SMALL)
    dc = machine.num_devices // tp
    opts = table_options(machine, tp, dc, True, 1, cp)
    tab = build_tables(g, dataclasses.replace(machine, memory_bytes=None), **opts)
    return g, tab, megatron_layouts(tab, dc, tp, True, 1, cp)


def _edge(g, tab, u: str, v: str) -> float:
    ops = [op.name for op in g.operators]
    for e, c in zip(g.edges, tab.edge_costs):
        if (ops[e.src], ops[e.dst]) == (u, v):
            return float(c[0, 0])
    raise AssertionError(f"no edge {u} -> {v}")


def test_sequence_parallel_norms_split_over_node_and_context_group():
    """tp=8 fills the node, cp=2 across nodes: the norm's s is 8 ways inside the node and 2 across (chunk =
    context rank · 8 + tensor rank), nested after the batch on the node level as every operator's s; the recipe
    that the space refused before costs now."""
    g, tab, lays = _recipe_tables(8, 2)
    ln = lays["L1/ln1"]
    assert ln.describe() == "(b=2[2x1], s=16[2x8])"
    assert ln.orders == ((1,), (0, 1)) and lays["L1/q"].orders[1] == (0, 1)  # b before s across nodes
    plan = cost_recipe("llama3-8b", preset("h100", 32), "tp=8,sp=true,cp=2", batch=8, sizes=SMALL)
    assert plan.step_time > 0


@pytest.mark.parametrize("tp", [8, 4])
def test_norm_to_column_parallel_edge_gathers_over_the_tensor_group_only(tp):
    """The all-gather into a column-parallel product moves (tp - 1)/tp of its input tile per device, all of it
    from the device's tensor group: the same seconds as without context parallelism (the same tile, same group),
    and none of it over the network (the seconds do not change with the inter-node bandwidth). tp=4 puts tensor
    and context group in one node (8 = 4 × 2): there the context part of s nests outside the tensor part."""
    g, tab, lays = _recipe_tables(tp, 2)
    ops = {op.name: op for op in g.operators}
    dp = 32 // tp // 2
    tile = (8 // dp) * (4096 // 2) * 4096  # q's input: b / dp, s / cp, d
    f, b = edge_volumes(ops["L1/ln1"], LayoutArrays.stack([lays["L1/ln1"]]), ops["L1/q"], 0,
                        LayoutArrays.stack([lays["L1/q"]]), 32)
    assert int(f[0, 0]) * tp == (tp - 1) * tile and int(b[0, 0]) == 0  # backward: the partial sums' reduce-scatter
    g1, tab1, _ = _recipe_tables(tp, 1)
    pairs = [("L1/ln1", "L1/q"), ("L1/out", "L1/add1"), ("L1/ln2", "L1/gate"), ("L1/down", "L1/add2")]
    if tp == 8:  # same tile as tp=8, dp=4 without context parallelism
        for u, v in pairs:
            assert _edge(g, tab, u, v) == _edge(g1, tab1, u, v)
    slow = dataclasses.replace(preset("h100", 32), inter_bandwidth=preset("h100", 32).inter_bandwidth / 100)
    g2, tab2, _ = _recipe_tables(tp, 2, slow)
    for u, v in pairs:
        assert _edge(g2, tab2, u, v) == _edge(g, tab, u, v)


def test_key_value_gather_crosses_the_context_group():
    """Attention keeps the key sequence whole: each device fetches the other context rank's half of its keys
    (b / 2 × t / 2 × one head × 128 = 1,048,576 values, 2 bytes each) over the network, and the gradient goes
    back the same way: 2 (2,097,152 B / B_1 + 8 µs), B_1 the profile's inter_bandwidth."""
    g, tab, _ = _recipe_tables(8, 2)
    m = preset("h100", 32)
    want = 2 * (2 * 1_048_576 / m.inter_bandwidth + m.inter_latency)
    assert _edge(g, tab, "L1/rope_k", "L1/attention") == pytest.approx(want, rel=1e-12)


def test_exact_solvers_agree_on_a_space_holding_the_sequence_and_context_split():
    """4 nodes of 2: tp=2 fills the node, cp=2 and dp=2 across nodes. Each operator's candidates are Megatron's
    layouts of four recipes (sp with cp, cp alone, sp alone, data parallel); every one lies in the enumerated
    space (row-major, node replicas, with the partial copies), and the DP, the ILP and the breadth-first reference
    find the same optimum, no dearer than the sp + cp recipe's plan."""
    from shardplan.configs import layouts, with_partial
    from shardplan.machine import Machine
    from shardplan.recipe import megatron_layout
    from shardplan.search import solve_dp, solve_ilp
    from shardplan.search.reference import solve_bfs_dp

    m = Machine(8, 1e12, 1e11, latency=1e-6, node_size=2, inter_bandwidth=1e10, inter_latency=1e-5)
    g = model_spec("llama3-8b").build(8, layers=1, d_model=32, heads=2, kv_heads=2, d_ff=64, vocab=64, seq=8)
    variants = ((4, 2, True, 2), (4, 2, False, 2), (4, 2, True, 1), (8, 1, False, 1))  # (dp · cp, tp, sp, cp)

    def candidates(op):
        out: list = []
        for dc, tp, sp, cp in variants:
            lay = megatron_layout(op, m.levels, dc, tp, sp, 1, cp)
            if lay not in out:
                out.append(lay)
        return tuple(out)

    for op in g.operators:
        space = with_partial(op, layouts(op, m.levels, 1, orders="row-major", node_replicas=True))
        assert set(candidates(op)) <= set(space), op.name
    tables = build_tables(g, m, cutoff=1, node_replicas=True, candidates=candidates)
    problem = tables.to_problem()
    recipe = tuple(tables.layouts[i].index(megatron_layout(op, m.levels, 4, 2, True, 1, 2))
                   for i, op in enumerate(g.operators))
    ref = solve_bfs_dp(problem).cost
    assert solve_dp(problem).cost == pytest.approx(ref, rel=1e-12)
    assert solve_ilp(problem).cost == pytest.approx(ref, rel=1e-9)
    assert ref <= problem.evaluate(recipe)
