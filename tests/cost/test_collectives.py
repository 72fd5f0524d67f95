"""Collective formulas against hand derivations (see shardplan/cost/collectives.py for the sources)."""

import numpy as np
import pytest

from shardplan.cost.collectives import allgather_time, allreduce_time, p2p_time, reduce_scatter_time
from shardplan.errors import ShardplanError
from shardplan.machine import Machine

FLAT = Machine(64, bandwidth=1e9, latency=1e-5)
# nodes of 8 devices (100 GB/s, 1 us), 4 nodes (10 GB/s per device, 5 us)
TWO = Machine(32, bandwidth=100e9, latency=1e-6, node_size=8, inter_bandwidth=10e9, inter_latency=5e-6)


def ar(n, groups, m, algorithm="auto"):
    return float(allreduce_time(n, np.asarray(groups).reshape(-1, 1), m, algorithm)[0])


def test_one_level_ring_for_large_messages():
    # ring: 2*3/4 * 1e6/1e9 + 2*3*1e-5 = 1.5e-3 + 6e-5; tree: 2e6/1e9 + 2*2*1e-5 = 2.04e-3
    assert ar(1e6, [4], FLAT, "ring") == pytest.approx(1.56e-3)
    assert ar(1e6, [4], FLAT, "tree") == pytest.approx(2.04e-3)
    assert ar(1e6, [4], FLAT) == pytest.approx(1.56e-3)


def test_one_level_tree_for_small_messages():
    # g = 64, 1 kB: ring 2*63/64*1e3/1e9 + 126e-5; tree 2e3/1e9 + 2*6*1e-5 = 1.22e-4
    assert ar(1e3, [64], FLAT, "ring") == pytest.approx(2 * 63 / 64 * 1e-6 + 126e-5)
    assert ar(1e3, [64], FLAT) == pytest.approx(2e-6 + 12e-5)


def test_zero_latency_is_the_reference_ring():
    m = Machine(64, bandwidth=16e9)
    for g in (2, 3, 8, 64):
        assert ar(5e6, [g], m) == pytest.approx(2 * (g - 1) / g * 5e6 / 16e9, rel=1e-15)
    assert ar(5e6, [1], m) == 0.0


def test_hierarchical_allreduce_spanning_full_nodes():
    n = 8e6
    # reduce-scatter + all-gather inside the node = ring all-reduce among 8 on n:
    inner = 2 * 7 / 8 * n / 100e9 + 2 * 7 * 1e-6
    # all-reduce across the 4 nodes of n / 8 per device: ring 2*3/4*1e6/1e10 + 6*5e-6 = 1.8e-4
    # (tree: 2e6/1e10 + 2*2*5e-6 = 2.2e-4)
    outer = 2 * 3 / 4 * (n / 8) / 10e9 + 2 * 3 * 5e-6
    assert ar(n, [8, 4], TWO) == pytest.approx(inner + outer)
    # one NCCL tree over everything: 2n / 10e9 + 2 (3*1e-6 + 2*5e-6): slower here
    assert ar(n, [8, 4], TWO, "tree") == pytest.approx(2 * n / 10e9 + 2 * (3e-6 + 2 * 5e-6))
    assert ar(n, [8, 4], TWO) < ar(n, [8, 4], TWO, "tree")


def test_group_not_filling_a_node():
    # 2 devices per node on 4 nodes: each device carries n / 2 across nodes, over its own NIC
    n = 8e6
    expect = (2 * 1 / 2 * n / 100e9 + 2 * 1e-6) + (2 * 3 / 4 * (n / 2) / 10e9 + 2 * 3 * 5e-6)
    assert ar(n, [2, 4], TWO) == pytest.approx(expect)
    # one device per node: the whole buffer crosses the network
    assert ar(n, [1, 4], TWO) == pytest.approx(2 * 3 / 4 * n / 10e9 + 2 * 3 * 5e-6)
    # inside one node only: the fast link
    assert ar(n, [8, 1], TWO) == pytest.approx(2 * 7 / 8 * n / 100e9 + 2 * 7 * 1e-6)


def test_small_gradient_across_nodes_takes_the_tree():
    # 4 kB among 8 x 4: ring-based hierarchy 2*7*1e-6 + 2*3*5e-6 + bytes; one tree: 2*(3e-6 + 2*5e-6) + bytes
    n = 4e3
    hier = 2 * 7 / 8 * n / 100e9 + 14e-6 + min(2 * 3 / 4 * (n / 8) / 10e9 + 30e-6, 2 * (n / 8) / 10e9 + 20e-6)
    tree = 2 * n / 10e9 + 2 * (3e-6 + 10e-6)
    assert tree < hier
    assert ar(n, [8, 4], TWO) == pytest.approx(tree)


def test_allgather_and_reduce_scatter_across_levels():
    # result n: across nodes first on n / 8 per device, then inside on n
    n = 8e6
    expect = (3 / 4 * (n / 8) / 10e9 + 3 * 5e-6) + (7 / 8 * n / 100e9 + 7 * 1e-6)
    got = allgather_time(n, np.array([[8], [4]]), TWO)[0]
    assert got == pytest.approx(expect)
    assert reduce_scatter_time(n, np.array([[8], [4]]), TWO)[0] == pytest.approx(expect)


def test_three_levels():
    m = Machine(64, bandwidth=100e9, latency=1e-6, node_size=4, inter_bandwidth=20e9, inter_latency=2e-6,
                pod_nodes=4, pod_bandwidth=5e9, pod_latency=1e-5)
    assert m.levels == (4, 4, 4)
    n = 1.6e7
    expect = ((2 * 3 / 4 * n / 100e9 + 6e-6) + (2 * 3 / 4 * (n / 4) / 20e9 + 6 * 2e-6)
              + (2 * 3 / 4 * (n / 16) / 5e9 + 6 * 1e-5))
    assert ar(n, [4, 4, 4], m, "ring") == pytest.approx(expect)


def test_point_to_point_uses_the_level_link():
    assert p2p_time(np.array([1e6, 1e6, 0.0]), TWO, np.array([0, 1, 1])).tolist() == pytest.approx(
        [1e6 / 100e9 + 1e-6, 1e6 / 10e9 + 5e-6, 0.0])


def test_group_sizes_must_match_the_machine():
    with pytest.raises(ShardplanError, match="group sizes for 1 levels, the machine has 2"):
        allreduce_time(1.0, np.array([[8]]), TWO)
    with pytest.raises(ShardplanError, match="unknown collective algorithm"):
        allreduce_time(1.0, np.array([[8], [1]]), TWO, "butterfly")
