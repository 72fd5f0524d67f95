"""Collective formulas against hand derivations (see shardplan/cost/collectives.py for the sources)."""

import numpy as np
import pytest

from shardplan.cost.collectives import allgather_time, allreduce_time, p2p_time, reduce_scatter_time, ring_steps
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
    # one NCCL ring through 32 ranks: bandwidth per level (8 in the node on n, 4 nodes on n / 8 per device),
    # latency 2 (32 - 1) steps of which 2 (4 - 1) cross nodes: 2 * 28 * 1 us + 2 * 3 * 5 us = 86 us
    bw = 2 * 7 / 8 * n / 100e9 + 2 * 3 / 4 * (n / 8) / 10e9
    assert ar(n, [8, 4], TWO, "ring") == pytest.approx(bw + 56e-6 + 30e-6)
    # one NCCL tree over everything: 2n over NVLink, 2 (n / 8) over each device's NIC, 2 (3*1e-6 + 2*5e-6):
    # 386 us against the ring's 376 us
    tree = 2 * n / 100e9 + 2 * (n / 8) / 10e9 + 2 * (3e-6 + 2 * 5e-6)
    assert ar(n, [8, 4], TWO, "tree") == pytest.approx(tree)
    assert ar(n, [8, 4], TWO) == pytest.approx(bw + 86e-6)
    assert bw + 86e-6 < tree


def test_tree_across_nodes_uses_every_nic():
    # one device per node: the whole buffer crosses the network, 2n / 10e9 + 2 * 2 * 5 us
    assert ar(8e6, [1, 4], TWO, "tree") == pytest.approx(2 * 8e6 / 10e9 + 4 * 5e-6)
    # 2 devices per node: each device's NIC carries half the buffer (NCCL spreads its channels over the NICs)
    assert ar(8e6, [2, 4], TWO, "tree") == pytest.approx(2 * 8e6 / 100e9 + 2 * 4e6 / 10e9 + 2 * (1e-6 + 2 * 5e-6))
    # one level: the level's double binary tree
    assert ar(8e6, [8, 1], TWO, "tree") == pytest.approx(2 * 8e6 / 100e9 + 2 * 3 * 1e-6)


def test_group_not_filling_a_node():
    # 2 devices per node on 4 nodes: each device carries n / 2 across nodes, over its own NIC; the ring of 8
    # ranks has 7 steps per pass, 3 of them across nodes (NCCL: nsteps 7, nInterSteps 3)
    n = 8e6
    expect = (2 * 1 / 2 * n / 100e9 + 2 * 3 / 4 * (n / 2) / 10e9) + 2 * (4 * 1e-6 + 3 * 5e-6)
    assert ar(n, [2, 4], TWO) == pytest.approx(expect)
    # one device per node: the whole buffer crosses the network, every step is a network step
    assert ar(n, [1, 4], TWO) == pytest.approx(2 * 3 / 4 * n / 10e9 + 2 * 3 * 5e-6)
    # inside one node only: the fast link
    assert ar(n, [8, 1], TWO) == pytest.approx(2 * 7 / 8 * n / 100e9 + 2 * 7 * 1e-6)


def test_small_gradient_across_nodes_takes_the_tree():
    # 4 kB among 8 x 4: the ring pays 2 * (28 * 1 us + 3 * 5 us) = 86 us; one tree 2 * (3 us + 2 * 5 us) = 26 us
    n = 4e3
    ring = 2 * 7 / 8 * n / 100e9 + 2 * 3 / 4 * (n / 8) / 10e9 + 86e-6
    tree = 2 * n / 100e9 + 2 * (n / 8) / 10e9 + 2 * (3e-6 + 10e-6)
    assert tree < ring
    assert ar(n, [8, 4], TWO, "ring") == pytest.approx(ring)
    assert ar(n, [8, 4], TWO) == pytest.approx(tree)


def test_ring_steps_count_as_nccl_counts_them():
    # NCCL's tuning model (src/graph/tuning.cc): a ring pass over nRanks ranks on nNodes nodes has
    # nRanks - 1 steps, nNodes - 1 of them across the network
    assert ring_steps(np.array([[8], [1]])).ravel().tolist() == [7, 0]
    assert ring_steps(np.array([[8], [2]])).ravel().tolist() == [14, 1]
    assert ring_steps(np.array([[8], [192]])).ravel().tolist() == [1344, 191]
    assert ring_steps(np.array([[2], [4]])).ravel().tolist() == [4, 3]
    assert ring_steps(np.array([[1], [4]])).ravel().tolist() == [0, 3]
    assert ring_steps(np.array([[4], [4], [4]])).ravel().tolist() == [48, 12, 3]
    assert ring_steps(np.array([[1], [1]])).ravel().tolist() == [0, 0]


def test_allgather_one_node_two_nodes_192_nodes():
    # an A100 cluster as the a100 preset describes it: NVLink 300 GB/s and 5 us per step, one 25 GB/s NIC per
    # GPU and 10 us per network step
    m = Machine(1536, bandwidth=300e9, latency=5e-6, node_size=8, inter_bandwidth=25e9, inter_latency=10e-6)
    n = 1.2e9  # one 12288 x 49152 fp16 weight
    one = 7 / 8 * n / 300e9 + 7 * 5e-6  # 3.5 ms + 35 us
    two = 7 / 8 * n / 300e9 + 1 / 2 * (n / 8) / 25e9 + 14 * 5e-6 + 1 * 10e-6  # 16 ranks: 15 steps, 1 across
    many = 7 / 8 * n / 300e9 + 191 / 192 * (n / 8) / 25e9 + 1344 * 5e-6 + 191 * 10e-6
    got = allgather_time(n, np.array([[8, 8, 8], [1, 2, 192]]), m)
    assert got.tolist() == pytest.approx([one, two, many])
    assert got[2] == pytest.approx(3.5e-3 + 5.96875e-3 + 6.72e-3 + 1.91e-3)
    assert reduce_scatter_time(n, np.array([[8], [192]]), m)[0] == pytest.approx(many)
    # the ring all-reduce: twice the passes, 2 * 1535 steps of which 2 * 191 across nodes
    assert ar(n, [8, 192], m, "ring") == pytest.approx(
        2 * (7 / 8 * n / 300e9 + 191 / 192 * (n / 8) / 25e9) + 2 * (1344 * 5e-6 + 191 * 10e-6))


def test_allgather_and_reduce_scatter_across_levels():
    # result n: across nodes on n / 8 per device, inside on n; 31 ring steps, 3 across nodes
    n = 8e6
    expect = (3 / 4 * (n / 8) / 10e9 + 3 * 5e-6) + (7 / 8 * n / 100e9 + 28 * 1e-6)
    got = allgather_time(n, np.array([[8], [4]]), TWO)[0]
    assert got == pytest.approx(expect)
    assert reduce_scatter_time(n, np.array([[8], [4]]), TWO)[0] == pytest.approx(expect)


def test_three_levels():
    m = Machine(64, bandwidth=100e9, latency=1e-6, node_size=4, inter_bandwidth=20e9, inter_latency=2e-6,
                pod_nodes=4, pod_bandwidth=5e9, pod_latency=1e-5)
    assert m.levels == (4, 4, 4)
    n = 1.6e7
    # 63 ring steps: 3 of them between pods, 12 between nodes of a pod, 48 inside nodes
    expect = ((2 * 3 / 4 * n / 100e9 + 2 * 48 * 1e-6) + (2 * 3 / 4 * (n / 4) / 20e9 + 2 * 12 * 2e-6)
              + (2 * 3 / 4 * (n / 16) / 5e9 + 2 * 3 * 1e-5))
    assert ar(n, [4, 4, 4], m, "ring") == pytest.approx(expect)


def test_point_to_point_uses_the_level_link():
    assert p2p_time(np.array([1e6, 1e6, 0.0]), TWO, np.array([0, 1, 1])).tolist() == pytest.approx(
        [1e6 / 100e9 + 1e-6, 1e6 / 10e9 + 5e-6, 0.0])


def test_group_sizes_must_match_the_machine():
    with pytest.raises(ShardplanError, match="group sizes for 1 levels, the machine has 2"):
        allreduce_time(1.0, np.array([[8]]), TWO)
    with pytest.raises(ShardplanError, match="unknown collective algorithm"):
        allreduce_time(1.0, np.array([[8], [1]]), TWO, "butterfly")
