"""Inputs read in part (slice from 0) or past their end (first operand of a concatenation)."""

from shardplan import ops
from shardplan.ir import GraphBuilder


def test_concat_and_slice_from_zero_are_valid():
    b = GraphBuilder("g")
    x = b.input("x", (4, 6))
    y = b.input("y", (4, 2))
    c = b.add(ops.concat("c", [x, y], 1))
    s = b.add(ops.slice_axis("s", c, 1, 0, 2))
    g = b.build()
    assert g["c"].output.shape == (4, 8)
    assert s.shape == (4, 2)
