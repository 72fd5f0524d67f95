"""Configurations: how many ways each iteration dimension is split.

For an operator with dims (d_1..d_n) of extents (E_1..E_n) and p devices,
the valid configurations are the tuples c with

    prod_i c_i <= p,   c_i | E_i,   E_i / c_i >= cutoff  (or c_i = 1),

and c_i = 1 for dimensions the operator marks fixed. ``powers_of_two``
keeps only c_i in {1, 2, 4, ...}; ``divides_p`` keeps only configurations
whose product divides p (those a device mesh over all p devices can
express, see the JAX export). The order is deterministic: lexicographic in
(c_1, ..., c_n).

:func:`layouts` turns them into the candidates of the search,
:class:`~shardplan.layout.Layout` values: with their nesting orders on a
one-level machine (the paper's space), and spread over the levels of a
hierarchical machine with the pruning rules its docstring states.
"""

from __future__ import annotations

import math
from itertools import permutations, product
from typing import Sequence

import numpy as np

from shardplan.errors import ShardplanError
from shardplan.ir import Operator
from shardplan.layout import Layout, LayoutArrays, flat_layout_arrays, unique_rows

__all__ = ["split_choices", "configurations", "dimension_orders", "ORDER_MODES", "layouts", "flat_layouts",
           "configuration_layouts",
           "forward_deferrable", "deferred_inputs", "with_partial"]


def split_choices(extent: int, p: int, cutoff: int, powers_of_two: bool = False) -> list[int]:
    """Split factors allowed for one dimension: divisors c of ``extent``, c <= p, extent/c >= cutoff."""
    out = [1]
    for c in range(2, min(extent, p) + 1):
        if extent % c or extent // c < cutoff:
            continue
        if powers_of_two and c & (c - 1):
            continue
        out.append(c)
    return out


def configurations(op: Operator, p: int, cutoff: int = 4, powers_of_two: bool = False,
                   divides_p: bool = False) -> np.ndarray:
    """All valid configurations of ``op`` on ``p`` devices, as an int64 array (K, n_dims).

    The all-ones configuration is always valid, so K >= 1.
    """
    if p < 1:
        raise ShardplanError(f"number of devices must be >= 1, got {p}")
    if cutoff < 1:
        raise ShardplanError(f"cutoff must be >= 1, got {cutoff}")
    table = np.ones((1, 0), dtype=np.int64)
    prods = np.ones(1, dtype=np.int64)
    for d, e in op.dims:
        choices = [1] if d in op.fixed else split_choices(e, p, cutoff, powers_of_two)
        ch = np.asarray(choices, dtype=np.int64)
        new_prod = (prods[:, None] * ch[None, :]).ravel()
        keep = new_prod <= p
        rows = np.repeat(table, len(ch), axis=0)
        cols = np.tile(ch, len(table))
        table = np.concatenate([rows, cols[:, None]], axis=1)[keep]
        prods = new_prod[keep]
    if divides_p:
        keep = p % prods == 0
        table, prods = table[keep], prods[keep]
    return table


ORDER_MODES = ("row-major", "all")


def dimension_orders(configs: np.ndarray, mode: str = "all", max_permuted: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """Expand configurations with the nesting order of their device grid.

    A configuration's split factors fix the tile shapes; *which* device
    gets which tile depends on how the grid's dimensions are nested in the
    device numbering (as a device mesh may list its axes in any order).
    Only the order of the split dims (c_d > 1) matters. Modes:

    * ``"row-major"``: the operator's own dimension order only (K' = K);
    * ``"all"``: every order of the split dims when there are at most
      ``max_permuted`` of them, else the own order and its reverse.

    Returns ``(configs', orders)``, both (K', n): ``orders[k]`` lists the
    dims from most to least significant. Rows of one configuration are
    adjacent and start with its own order, so the first row of a split
    tuple is always the row-major one.
    """
    if mode not in ORDER_MODES:
        raise ShardplanError(f"unknown order mode {mode!r}; choose from {', '.join(ORDER_MODES)}")
    configs = np.asarray(configs, dtype=np.int64)
    k, n = configs.shape
    ident = np.arange(n, dtype=np.int64)
    if mode == "row-major" or n < 2:
        return configs, np.broadcast_to(ident, (k, n)).copy()
    # the orders of a row depend only on which dims it splits: built once per distinct split mask
    masks, _, mask_of = unique_rows((configs > 1).astype(np.int64))
    tables = []
    for mask in masks.tolist():
        split = [j for j in range(n) if mask[j]]
        rest = [j for j in range(n) if not mask[j]]
        perms = list(permutations(split)) if len(split) <= max_permuted else [tuple(split), tuple(reversed(split))]
        tables.append(np.asarray([list(perm) + rest for perm in perms], dtype=np.int64).reshape(-1, n))
    counts = np.asarray([len(t) for t in tables], dtype=np.int64)[mask_of]
    row = np.repeat(np.arange(k), counts)  # the configuration of every output row, in order
    nth = np.arange(len(row)) - np.repeat(np.cumsum(counts) - counts, counts)  # its rank among that row's orders
    padded = np.zeros((len(tables), int(counts.max(initial=1)), n), dtype=np.int64)
    for i, t in enumerate(tables):
        padded[i, :len(t)] = t
    return configs[row], padded[mask_of[row], nth]


def _factorisations(c: tuple[int, ...], products: tuple[int, ...],
                    max_level_dims: int | None = None) -> list[tuple[tuple[int, ...], ...]]:
    """Every way to write each c_d as Π_l c_{l,d} with Π_d c_{l,d} = products[l]: list of per-level rows.

    ``max_level_dims``: only those splitting at most that many dims on every level (the same list as
    filtering afterwards, in the same order; the partial rows that already exceed it are not grown).
    """
    if len(products) == 1:
        ok = max_level_dims is None or sum(x > 1 for x in c) <= max_level_dims
        return [(tuple(c),)] if ok and math.prod(c) == products[0] else []
    target = products[0]
    split = [d for d, x in enumerate(c) if x > 1]  # an unsplit dim has the single factor 1 on every level
    divs = [_divisors(c[d]) for d in split]
    cap = len(c) if max_level_dims is None else max_level_dims
    out: list[tuple[tuple[int, ...], ...]] = []
    row = [1] * len(c)

    def rec(j: int, prod: int, used: int) -> None:
        if j == len(split):
            if prod == target:
                rest = tuple(cd // e for cd, e in zip(c, row))
                for tail in _factorisations(rest, products[1:], max_level_dims):
                    out.append((tuple(row),) + tail)
            return
        d = split[j]
        for e in divs[j]:
            if target % (prod * e) == 0 and (e == 1 or used < cap):
                row[d] = e
                rec(j + 1, prod * e, used + (e > 1))
        row[d] = 1

    rec(0, 1, 0)
    return out


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def level_products(n: int, levels: tuple[int, ...]) -> tuple[int, ...] | None:
    """Split product per level when n tiles fill the levels from the inside (None if impossible)."""
    out = []
    for s in levels:
        if n % s == 0:
            out.append(s)
            n //= s
        elif s % n == 0:
            out.append(n)
            n = 1
        else:
            return None
    return tuple(out) if n == 1 else None


def _level_orders(row: tuple[int, ...], own: Sequence[int], mode: str, max_permuted: int) -> list[tuple[int, ...]]:
    split = [j for j in own if row[j] > 1]
    if mode == "row-major" or len(split) < 2:
        return [tuple(split)]
    if len(split) <= max_permuted:
        return [tuple(x) for x in permutations(split)]
    return [tuple(split), tuple(reversed(split))]


def flat_layouts(op: Operator, p: int, cutoff: int = 4, powers_of_two: bool = False, divides_p: bool = True,
                 orders: str = "row-major", max_permuted: int = 3,
                 rows: np.ndarray | None = None) -> tuple[tuple[Layout, ...], LayoutArrays]:
    """The one-level candidates of :func:`layouts` (levels ``(p,)``) and the same layouts as arrays.

    ``rows``: :func:`configurations` of ``op`` with these arguments, when the caller has them.
    The arrays come from :func:`~shardplan.layout.flat_layout_arrays` (equal to
    ``LayoutArrays.stack`` of the layouts) and give the layouts their strides.
    """
    if rows is None:
        rows = configurations(op, p, cutoff, powers_of_two, divides_p)
    c2, o2 = dimension_orders(rows, orders, max_permuted)
    arr = flat_layout_arrays(c2, p, o2)
    names, lv = op.dim_names, (int(p),)
    # each layout's order lists its split dims only, in the row's order: move them to the front (stably)
    # and keep the first (number of split dims) entries
    split_at = np.take_along_axis(c2, o2, axis=1) > 1
    front = np.take_along_axis(o2, np.argsort(~split_at, axis=1, kind="stable"), axis=1)
    lays = tuple(Layout._with_strides(names, lv, (tuple(c),), (tuple(o[:k]),), (tuple(s),))
                 for c, o, s, k in zip(c2.tolist(), front.tolist(), arr.level_strides[0].tolist(),
                                       split_at.sum(axis=1).tolist()))
    return lays, arr


def layouts(op: Operator, levels: Sequence[int], cutoff: int = 4, powers_of_two: bool = False,
            divides_p: bool = True, orders: str = "row-major", max_permuted: int = 3,
            max_split_dims: int | None = 3, max_level_dims: int | None = 2,
            partial_replicas: bool = False, node_replicas: bool = False) -> tuple[Layout, ...]:
    """All layouts of ``op`` on a machine with level sizes ``levels`` (innermost first).

    One level (``levels == (p,)``): exactly the paper's space,
    :func:`configurations` expanded by :func:`dimension_orders`, in the same
    order (so flat results are unchanged).

    Several levels: a layout's total split c (a valid configuration whose
    product divides p) is spread over the levels *from the inside*
    (pruning rule, documented in the docs: the outer level is used only
    when the inner one is full):

        Π_d c_{0,d} = min(Π c, s_0),  Π_d c_{1,d} = min(Π c / s_0, s_1), ...

    so no device inside a node repeats another's work while the grid spans
    several nodes; every factorisation c_d = Π_l c_{l,d} with those level
    products is offered (which dims lie inside the node and which across is
    the real choice), and within each level the split dims are nested in
    the operator's order ("row-major") or in every order ("all", as
    :func:`dimension_orders`). What is lost: layouts that replicate inside
    a node while splitting across nodes (devices of one node repeating each
    other's work although the layout spans nodes), and layouts whose split
    product fills a level only partly while an outer level is split.
    """
    levels = tuple(int(s) for s in levels)
    p = math.prod(levels)
    names = op.dim_names
    if len(levels) == 1:
        return flat_layouts(op, p, cutoff, powers_of_two, divides_p, orders, max_permuted)[0]
    out: list[Layout] = []
    for c in configurations(op, p, cutoff, powers_of_two, divides_p=True).tolist():
        out.extend(configuration_layouts(names, levels, tuple(c), orders, max_permuted, max_split_dims,
                                         max_level_dims, partial_replicas, node_replicas))
    return tuple(out)


def configuration_layouts(names: tuple[str, ...], levels: tuple[int, ...], c: tuple[int, ...],
                          orders: str = "row-major", max_permuted: int = 3, max_split_dims: int | None = 3,
                          max_level_dims: int | None = 2, partial_replicas: bool = False,
                          node_replicas: bool = False) -> tuple[Layout, ...]:
    """The layouts :func:`layouts` offers on several ``levels`` for the one total split ``c`` (a configuration
    of an operator with dims ``names``), in its order: :func:`layouts` is their concatenation over the
    operator's configurations. They depend on the operator only through ``names`` and ``c`` (every layout's
    per-dim product over the levels is ``c``, so two configurations never share a layout)."""
    levels = tuple(int(s) for s in levels)
    p = math.prod(levels)
    own = list(range(len(names)))
    out: list[Layout] = []
    seen: set[Layout] = set()
    tiles = math.prod(c)
    if max_split_dims is not None and sum(x > 1 for x in c) > max_split_dims:
        return ()
    fills = []
    if partial_replicas or not levels[0] < tiles < p:
        prods = level_products(tiles, levels)
        if prods is not None:
            fills.append(prods)
    outer = p // levels[0]
    if node_replicas and tiles % outer == 0 and tiles // outer < levels[0] and levels[0] % (tiles // outer) == 0:
        fills.append((tiles // outer,) + levels[1:])
    for rows in (r for prods in fills for r in _factorisations(tuple(c), prods, max_level_dims)):
        per_level = [_level_orders(r, own, orders, max_permuted) for r in rows]
        for combo in product(*per_level):
            lay = Layout._unchecked(names, levels, rows, combo)
            if lay not in seen:
                seen.add(lay)
                out.append(lay)
    return tuple(out)


def forward_deferrable(op: Operator) -> bool:
    """Whether ``op``'s output may be left as partial sums: it is the sum over its reduction dims with nothing
    applied after the sum.

    Nothing after the sum: no normalised dims, no recurrence, and the work per output element,
    ``W = flops_per_point · R`` (R: the points summed into one output element), is that of a plain sum:
    R (one add per point), 2R (one multiply-add per point: a contraction) or 1 (a selection: the embedding's
    one-hot product). An elementwise tail fused into the operator (the JAX lowering's fusion, a GELU after a
    product) adds its FLOPs per output element to W, so such an operator is not deferred: its output is not
    linear in the partial sums.
    """
    red = op.reduction_dims
    if not red or op.norm_dims or op.recurrence is not None:
        return False
    ext = op.extents
    r = float(math.prod(ext[d] for d in red))
    w = op.flops_per_point * r
    return any(math.isclose(w, x, rel_tol=1e-9) for x in (r, 2.0 * r, 1.0))


def deferred_inputs(op: Operator) -> tuple[int, ...]:
    """Slots of the inputs whose gradient a partial layout leaves as partial sums: every activation input
    with a gradient (its gradient sums over the dims that do not index it)."""
    return tuple(i for i, t in enumerate(op.inputs) if t.needs_grad and op.grad_reduction_dims(t))


def with_partial(op: Operator, lays: Sequence[Layout]) -> tuple[Layout, ...]:
    """``lays`` followed by the partial copy (:attr:`Layout.partial`) of every layout that splits a reduction
    it can defer: a reduction dim of a :func:`forward_deferrable` operator, or a dim an input's gradient sums
    over (:func:`deferred_inputs`). The copies keep the order of ``lays``."""
    names = op.dim_names
    sets = [op.reduction_dims] if forward_deferrable(op) else []
    sets += [op.grad_reduction_dims(op.inputs[i]) for i in deferred_inputs(op)]
    idx = [[names.index(d) for d in dims] for dims in sets]
    extra = [lay.with_partial() for lay in lays if not lay.partial
             and any(math.prod(lay.split[j] for j in js) > 1 for js in idx)]
    return tuple(lays) + tuple(extra)
