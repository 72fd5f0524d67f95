"""The Layout value, the hierarchical configuration space, and exactness of the search on it."""

import numpy as np
import pytest

from shardplan import ops
from shardplan.configs import configurations, dimension_orders, layouts
from shardplan.cost import build_tables
from shardplan.cost.tiles import device_grid
from shardplan.errors import ShardplanError
from shardplan.ir import GraphBuilder
from shardplan.layout import Layout, LayoutArrays
from shardplan.machine import Machine
from shardplan.search import solve_bruteforce, solve_dp

# b split 2 across the 2 nodes, h split 4 inside each node of 4 devices
TWO = Layout(("b", "h", "k"), (4, 2), ((1, 4, 1), (2, 1, 1)), ((1,), (0,)))


def test_invalid_layouts_cannot_be_built_and_the_message_shows_the_values():
    with pytest.raises(ShardplanError, match=r"level 0 has 4 positions but splits \(2, 4\)"):
        Layout(("b", "h"), (4, 2), ((2, 4), (1, 1)), ((0, 1), ()))
    with pytest.raises(ShardplanError, match=r"order \(0,\) on level 0 must list exactly the split dims \[1\]"):
        Layout(("b", "h"), (4,), ((1, 4),), ((0,),))
    with pytest.raises(ShardplanError, match="one row per level"):
        Layout(("b", "h"), (4, 2), ((1, 4),), ((1,), ()))
    with pytest.raises(ShardplanError, match="not unique"):
        Layout(("b", "b"), (4,), ((1, 1),), ((),))


def test_two_level_grid_groups_and_replicas():
    coords, active = TWO.grid()
    assert active.all()
    assert coords[:, 0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]  # b: the node
    assert coords[:, 1].tolist() == [0, 1, 2, 3, 0, 1, 2, 3]  # h: the device inside the node
    assert TWO.split == (2, 4, 1) and TWO.replicas == (1, 1) and TWO.copies == 1
    assert TWO.group_sizes(["b"]) == (1, 2) and TWO.group_sizes(["h"]) == (4, 1)
    assert TWO.group_sizes(["b", "h"]) == (4, 2) and TWO.group_sizes([]) == (1, 1)
    assert TWO.group_of(1, ["b"]) == (1, 5)
    assert TWO.group_of(5, ["h"]) == (4, 5, 6, 7)
    assert TWO.blocks((8, 16, 3))[5].tolist() == [[4, 8], [4, 8], [0, 3]]
    assert hash(TWO) == hash(Layout(("b", "h", "k"), (4, 2), ((1, 4, 1), (2, 1, 1)), ((1,), (0,))))


def test_a_split_on_both_levels_is_node_major():
    lay = Layout(("b",), (2, 2), ((2,), (2,)), ((0,), (0,)))
    # device q = 2 * node + local: block = 2 * node + local
    assert lay.grid()[0][:, 0].tolist() == [0, 1, 2, 3]
    assert lay.mesh_shape() == (1, 2, 1, 2)
    assert lay.mesh_axes() == ("_rep_node", "b_node", "_rep_device", "b_device")
    assert lay.partition_spec(["b", None]) == (("b_node", "b_device"), None)


def test_mesh_view_follows_the_device_numbering():
    assert TWO.mesh_shape() == (1, 2, 1, 4)
    assert TWO.mesh_axes() == ("_rep_node", "b_node", "_rep_device", "h_device")
    assert TWO.partition_spec(["b", "h", None, "h"]) == ("b_node", "h_device", None, None)
    # the row-major reshape of range(p) to the mesh gives every device its grid coordinates
    mesh = np.arange(8).reshape(TWO.mesh_shape())
    coords, _ = TWO.grid()
    for idx in np.ndindex(mesh.shape):
        q = mesh[idx]
        assert (coords[q, 0], coords[q, 1]) == (idx[1], idx[3])
    flat = Layout.flat(("b", "n"), (2, 1), 8)
    assert flat.mesh_shape() == (4, 2) and flat.mesh_axes() == ("_rep", "b")
    assert flat.partition_spec(["b", "n"]) == ("b", None)
    with pytest.raises(ShardplanError, match="idle devices"):
        Layout.flat(("b",), (3,), 8).mesh_shape()


def test_flat_layouts_reproduce_the_configuration_grid():
    configs = np.array([[2, 4, 1], [1, 2, 4], [8, 1, 1], [3, 1, 1]])
    orders = np.array([[1, 0, 2], [0, 2, 1], [0, 1, 2], [0, 1, 2]])
    c_old, a_old = device_grid(configs, 8, orders)
    arr = LayoutArrays.stack([Layout.flat(("a", "b", "c"), c, 8, o) for c, o in zip(configs, orders)])
    c_new, a_new = arr.grid()
    assert np.array_equal(a_old, a_new)
    assert np.array_equal(np.where(a_old[..., None], c_old, 0), np.where(a_new[..., None], c_new, 0))


def test_from_flat_cuts_the_numbering_at_node_boundaries():
    lay = Layout.from_flat(("b", "n"), (16, 1), (8, 2))
    assert lay.splits == ((8, 1), (2, 1))
    lay = Layout.from_flat(("b", "n"), (2, 8), (8, 2))  # n inner fills the node, b across
    assert lay.splits == ((1, 8), (2, 1))
    lay = Layout.from_flat(("b", "n"), (4, 1), (8, 2))  # 4 tiles: two copies in a node, one per node
    assert lay.splits == ((4, 1), (1, 1)) and lay.replicas == (2, 2)
    with pytest.raises(ShardplanError, match="cannot be laid out"):
        Layout.from_flat(("b", "n"), (3, 1), (8, 2))


def _gemm_graph():
    b = GraphBuilder("two")
    x = b.input("x", (32, 64), needs_grad=True)
    h = b.add(ops.dense("fc1", x, 64))
    h = b.add(ops.elementwise("act", h, letters="bn"))
    b.add(ops.dense("fc2", h, 32))
    return b.build()


def test_one_level_space_is_the_papers():
    g = _gemm_graph()
    op = g.operators[0]
    c, o = dimension_orders(configurations(op, 8, 1), "all")
    lays = layouts(op, (8,), cutoff=1, orders="all")
    assert [lay.split for lay in lays] == [tuple(r) for r in c.tolist()]
    assert [lay.flat_order() for lay in lays] == [tuple(r) for r in o.tolist()]


def test_hierarchical_space_fills_the_node_first():
    g = _gemm_graph()
    op = g.operators[0]
    lays = layouts(op, (4, 4), cutoff=1, max_split_dims=None, max_level_dims=None, partial_replicas=True)
    assert lays and len(set(lays)) == len(lays)
    for lay in lays:
        inner, outer = lay.level_products
        assert outer == 1 or inner == 4  # the node level is used only when the node is full
        assert 16 % lay.tiles == 0
    # every total split of a valid configuration that fills levels from inside is offered
    totals = {lay.split for lay in lays}
    assert totals == {tuple(c) for c in configurations(op, 16, 1, divides_p=True).tolist()
                      if (lambda n: n <= 4 or n % 4 == 0)(int(np.prod(c)))}
    # ((b across, c inside) and (c across, b inside)) are both there for split (4, 1, 4)
    assert {lay.splits for lay in lays if lay.split == (4, 1, 4)} >= {((1, 1, 4), (4, 1, 1)), ((4, 1, 1), (1, 1, 4))}
    pruned = layouts(op, (4, 4), cutoff=1)
    assert set(pruned) <= set(lays) and len(pruned) < len(lays)


def test_search_on_the_hierarchical_space_is_exact():
    g = _gemm_graph()
    m = Machine(16, peak_flops=1e12, bandwidth=50e9, latency=2e-6, node_size=4, inter_bandwidth=5e9,
                inter_latency=1e-5)
    t = build_tables(g, m, cutoff=1)
    prob = t.to_problem()
    assert max(prob.sizes) > 20
    dp = solve_dp(prob)
    bf = solve_bruteforce(prob)
    assert dp.cost == pytest.approx(bf.cost, rel=1e-12)
    plan_cost = t.breakdown(dp.assignment)["total"]
    assert plan_cost == pytest.approx(dp.cost, rel=1e-12)
    from shardplan.search import solve_ilp

    ilp = solve_ilp(prob, time_limit=60)
    assert ilp.optimal and ilp.cost == pytest.approx(dp.cost, rel=1e-6)


def test_identical_operators_share_one_table():
    b = GraphBuilder("chain")
    x = b.input("x", (32, 64), needs_grad=True)
    for i in range(4):
        x = b.add(ops.dense(f"fc{i}", x, 64))
    t = build_tables(b.build(), Machine(8), cutoff=1)
    assert t.options["distinct_operators"] == 1  # fc0 reads a graph input: same description
    assert t.options["distinct_edges"] == 1
    assert t.edge_costs[0] is t.edge_costs[2] and t.op_costs[1] is t.op_costs[3]
