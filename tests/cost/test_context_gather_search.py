"""All-gather context parallelism and its causal load balancing as the exact search's choices.

One attention (batch 1, one head: only its query sequence can split) over three projections of an input
x[1, S, 1, C], on 4 devices, with the default ``context="allgather"``: the queries split over the devices and
the keys and values gathered (Llama 3's context parallelism), where the split work outweighs the gather; the
attention left whole where it does not. A causal attention whose runners deal the queries into balanced
chunks (``dealt``: each device two opposite chunks) is dealt at the optimum where the deal's point-to-points
cost less than the contiguous blocks' extra work on the busiest device, and left contiguous where they cost
more. Brute force and the ILP agree with the dynamic program on small graphs with the dealt core.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from randgraphs import exact_solvers_agree, random_attention_graph
from shardplan import ops
from shardplan.cost import build_tables
from shardplan.cost.ring import deals_gathered, gathered_deal, gathered_imbalance
from shardplan.ir import Graph, GraphBuilder
from shardplan.layout import LayoutArrays
from shardplan.machine import Machine
from shardplan.search import solve_dp
from shardplan.search.problem import Problem


def attention(S: int, C: int = 256, causal: bool = False, dealt: bool = False) -> Graph:
    """q, k, v = x W_q, x W_k, x W_v (x[1, S, 1, C], W[C, 16]) and the fused core over them."""
    b = GraphBuilder("attention")
    x = b.input("x", (1, S, 1, C), needs_grad=True)
    q, k, v = (b.add(ops.einsum(n, f"{a[:3]}c,ck->{a}", x, ops.Param((C, 16))))
               for n, a in (("q", "bshk"), ("k", "bthk"), ("v", "bthk")))
    b.add(ops.flash_attention("attn", q, k, v, "bshk", "bthk", causal=causal, dealt=dealt))
    return b.build()


def restricted(problem: Problem, v: int, keep: np.ndarray) -> Problem:
    """``problem`` with vertex ``v`` offered only its configurations ``keep`` (the edge matrices sliced)."""
    keep = np.asarray(keep)
    configs = list(problem.configs)
    configs[v] = tuple(configs[v][i] for i in keep)
    cost = list(problem.vertex_cost)
    cost[v] = cost[v][keep]
    edges = tuple(mat[keep, :] if s == v else mat[:, keep] if d == v else mat
                  for (s, d), mat in zip(problem.edges, problem.edge_cost))
    return replace(problem, configs=tuple(configs), vertex_cost=tuple(cost), edge_cost=edges, dims=None)


def seq_split(t, name: str, dim: str) -> np.ndarray:
    """Per candidate layout of operator ``name``: how many ways it splits ``dim``."""
    i = t.graph.index[name]
    return np.array([lay.split[lay.dims.index(dim)] for lay in t.layouts[i]])


@pytest.mark.parametrize("S, latency, pays", [(4096, 1e-6, True), (16, 1e-3, False)])
def test_the_search_splits_the_queries_and_gathers_the_keys_only_where_it_pays(S, latency, pays):
    """4,096 tokens on 1 us links: the optimum splits the attention's queries and the projections' sequence 4
    ways and gathers the keys and values (the edges into the core cost the all-gather), strictly below the best
    plan that keeps the attention's queries whole. 16 tokens on 1 ms links: the gather's latency exceeds the
    whole attention, the optimum keeps it whole, strictly below the best plan that splits its queries."""
    g = attention(S)
    m = Machine(4, peak_flops=1e12, bandwidth=1e10, latency=latency, dtype_bytes=4, hbm_bandwidth=1e11)
    t = build_tables(g, m, cutoff=1, orders="row-major")
    problem = t.to_problem()
    sol = solve_dp(problem)
    ia = g.index["attn"]
    split = seq_split(t, "attn", "s")
    other = np.flatnonzero(split == 1) if pays else np.flatnonzero(split > 1)
    assert sol.cost < solve_dp(restricted(problem, ia, other)).cost * (1 - 1e-3)
    if pays:
        assert split[sol.assignment[ia]] == 4
        for name, slot in (("k", 1), ("v", 2)):
            i = g.index[name]
            assert seq_split(t, name, "t")[sol.assignment[i]] == 4  # each device computes a quarter of the keys
            e = next(j for j, x in enumerate(g.edges) if x.src == i and x.dst == ia and x.slot == slot)
            assert np.isfinite(t.edge_costs[e][sol.assignment[i], sol.assignment[ia]])
            assert t.edge_costs[e][sol.assignment[i], sol.assignment[ia]] > 0  # the all-gather
    else:
        assert split[sol.assignment[ia]] == 1


@pytest.mark.parametrize("S, dealt", [(1024, True), (512, False)])
def test_the_search_deals_causal_queries_only_where_the_deal_is_cheaper_than_the_imbalance(S, dealt):
    """Causal, the runners' deal offered (10 us links): at 1,024 tokens the busiest contiguous block's extra work
    (229 us) outweighs the deal's eight point-to-points (81 us) and the optimum's layout is dealt; at 512 tokens
    the extra work (57 us) is below the deal (80 us) and the optimum keeps contiguous blocks. Both split the
    attention's queries 4 ways with the query projection's sequence split alike (its blocks are what is dealt)."""
    g = attention(S, causal=True, dealt=True)
    m = Machine(4, peak_flops=1e11, bandwidth=1e11, latency=1e-5, dtype_bytes=4, hbm_bandwidth=1e11)
    t = build_tables(g, m, cutoff=1)
    sol = solve_dp(t.to_problem())
    ia = g.index["attn"]
    j = sol.assignment[ia]
    lay = t.layouts[ia][j]
    assert seq_split(t, "attn", "s")[j] == 4 and seq_split(t, "q", "s")[sol.assignment[g.index["q"]]] == 4
    lv = LayoutArrays.stack([lay])
    comp = t.op_costs[ia].compute[j:j + 1]
    deal, extra = gathered_deal(g["attn"], 1, lv, m)[0], gathered_imbalance(g["attn"], 1, lv, m, comp)[0]
    assert deal > 0 and extra > 0
    assert (deal < extra) == dealt
    assert deals_gathered(g["attn"], lay, m) == dealt


def _random_dealt(seed: int) -> tuple[Graph, Machine]:
    """A causal core whose runners deal (sequence 16: 2g divides it on 2 and 4 devices) over projections or
    elementwise operators, sometimes an output projection; a random 4-device machine
    (:func:`randgraphs.random_attention_graph`)."""
    return random_attention_graph(seed, lambda rng: {"causal": True, "dealt": True}, (1e7, 1e8, 1e9), "d")


@pytest.mark.parametrize("seed", range(6))
def test_dp_bruteforce_and_ilp_agree_on_graphs_with_the_dealt_core(seed):
    g, m = _random_dealt(seed)
    for context, partial in (("allgather", False), ("auto", False), ("allgather", True)):
        exact_solvers_agree(build_tables(g, m, cutoff=1, orders="row-major", context=context,
                                         partial_sums=partial).to_problem())


def test_some_random_dealt_instances_deal_at_their_optimum_and_some_do_not():
    """The instances above are not all alike: at some optima the attention's queries are dealt."""
    dealt = 0
    for seed in range(6):
        g, m = _random_dealt(seed)
        t = build_tables(g, m, cutoff=1, orders="row-major")
        sol = solve_dp(t.to_problem())
        ia = g.index["attn"]
        dealt += int(deals_gathered(g["attn"], t.layouts[ia][sol.assignment[ia]], m))
    assert 1 <= dealt < 6
