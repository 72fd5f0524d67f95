"""The forest pass's relaxed minimum from its upward pass alone: the float of the full two-pass pass."""

from __future__ import annotations

import numpy as np
import pytest

from shardplan.search.bounds import BoundState, _forest_pass, forest_bounds, forest_value, trws
from shardplan.search.problem import Problem


def _problem(rng: np.random.Generator, n: int, extra: int, shared: bool) -> Problem:
    sizes = [int(rng.integers(1, 9)) for _ in range(n)]
    edges = [(i, i + 1) for i in range(n - 1)]  # a chain, plus chords (cycles), plus a separate component
    edges += sorted({tuple(sorted(map(int, rng.choice(n - 1, 2, replace=False)))) for _ in range(extra)} - set(edges))
    edges = [e for e in edges if e[0] != e[1]]
    one = {}
    cost = []
    for u, w in edges:
        if shared and (sizes[u], sizes[w]) in one:  # identical layers: one matrix object, repeated messages
            cost.append(one[(sizes[u], sizes[w])])
            continue
        m = np.round(rng.uniform(0, 5, size=(sizes[u], sizes[w])), 2)
        one[(sizes[u], sizes[w])] = m
        cost.append(m)
    return Problem(names=tuple(f"v{i}" for i in range(n)), configs=tuple(tuple((k,) for k in range(s)) for s in sizes),
                   vertex_cost=tuple(np.round(rng.uniform(0, 3, size=s), 3) for s in sizes), edges=tuple(edges),
                   edge_cost=tuple(cost))


@pytest.mark.parametrize("seed", range(10))
def test_forest_value_is_the_two_pass_minimum_bit_for_bit(seed):
    rng = np.random.default_rng(seed)
    p = _problem(rng, int(rng.integers(2, 40)), int(rng.integers(0, 30)), shared=bool(seed % 2))
    st = BoundState.from_problem(p)
    _, _, full = _forest_pass(st)
    value = _forest_pass(BoundState.from_problem(p), value_only=True)
    assert isinstance(value, float) and value == full and np.float64(value).tobytes() == np.float64(full).tobytes()
    trws(st, list(range(st.n)), 2)  # with messages, and with the exact weights
    for exact in (False, True):
        _, _, full = _forest_pass(st, exact)
        assert _forest_pass(st, exact, value_only=True) == full


def test_forest_value_of_a_forest_with_several_components():
    h = [np.array([1.0, 0.5]), np.array([0.25, 3.0]), np.array([2.0]), np.array([0.1, 0.2, 0.3])]
    res = {(0, 1): np.array([[0.0, 1.0], [2.0, 0.0]]), (2, 3): np.array([[0.5, 0.0, 0.25]])}
    mm, _, total = forest_bounds(h, res, [(0, 1), (2, 3)])
    assert forest_value(h, res, [(0, 1), (2, 3)]) == total == pytest.approx(1.25 + 2.2, rel=1e-15)
    assert forest_value(h, res, []) == forest_bounds(h, res, [])[2] == 0.5 + 0.25 + 2.0 + 0.1
