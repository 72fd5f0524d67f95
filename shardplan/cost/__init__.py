"""Costs derived from operator descriptions: compute, collectives, redistribution, memory.

:func:`build_tables` lowers a graph on a machine to cost tables (one vector
per operator, one matrix per edge) and from there to the solver-level
:class:`~shardplan.search.problem.Problem`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import numpy as np

from shardplan.configs import ORDER_MODES, configurations, dimension_orders, flat_layouts, layouts, with_partial
from shardplan.cost.edge import EdgeMemo, chunk_extras, edge_cost, edge_volumes, overlap_budgets, weight_edge_cost
from shardplan.cost.memory import operator_memory, strategy_memory
from shardplan.cost.operator import PARTS, OpCost, operator_cost, optimizer_step_bytes
from shardplan.cost.grad_home import home_bytes, home_moved, home_moved_bytes, home_pairs, home_reduction, unfed_slots
from shardplan.cost.ring import (CONTEXT_ALGORITHMS, context_edge, gathered_applies, gathered_charge, gathered_moved,
                                 gathered_reduction, moved_reduction, ring_charged)
from shardplan.cost.tiles import MAX_DEVICES  # per-device tiles: at most this many devices (the default max_devices)
from shardplan.errors import OperatorMemoryError, ShardplanError, TableMemoryError
from shardplan.ir import Graph, Operator
from shardplan.layout import Layout, LayoutArrays
from shardplan.machine import Machine
from shardplan.search.problem import Problem

__all__ = ["CostTables", "build_tables", "operator_cost", "edge_cost", "edge_volumes", "OpCost", "PARTS",
           "BREAKDOWN", "ORDERS", "operator_key", "overlap_hidden", "plan_home_bytes"]

BREAKDOWN: dict[str, str] = {**PARTS, "redistribution": "redistribution between operators (shared weights included)"}
"""The parts of a strategy's step time (:meth:`CostTables.breakdown`): each operator part, then redistribution."""


@dataclass(frozen=True, eq=False)
class CostTables:
    """Every cost the search needs, for one graph on one machine.

    Attributes:
        graph, machine: what was costed.
        layouts: per operator, its candidate :class:`~shardplan.layout.Layout` values (K_v of them);
            a strategy picks one index per operator.
        op_costs: per operator, its :class:`OpCost` (arrays of K_v).
        edge_costs: per graph edge (``graph.edges`` order), a (K_u, K_v) matrix in seconds.
        memory: per operator, (weights, activations) bytes per layout and device.
        options: how the tables were built (cutoff, orders, pruning, sharing counts).
        weight_edge_costs: per weight edge (``graph.weight_edges`` order: a reader of a parameter
            another operator owns), a (K_owner, K_reader) matrix in seconds
            (:func:`~shardplan.cost.edge.weight_edge_cost`); the problem's edges after the graph's.

    Identical operators (same description, see :func:`operator_key`) share
    their layouts, cost arrays and memory arrays (the same objects), and
    identical edges their matrices.
    """

    graph: Graph
    machine: Machine
    layouts: tuple[tuple[Layout, ...], ...]
    op_costs: tuple[OpCost, ...]
    edge_costs: tuple[np.ndarray, ...]
    memory: tuple[tuple[np.ndarray, np.ndarray], ...]
    options: dict
    arrays: tuple[LayoutArrays, ...] = field(default=(), repr=False)
    weight_edge_costs: tuple[np.ndarray, ...] = ()
    _splits: tuple[np.ndarray, ...] = field(default=(), init=False, repr=False)
    _index_cache: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.layouts) != len(self.graph.operators):
            raise ShardplanError(f"cost tables: {len(self.layouts)} layout lists for {len(self.graph.operators)} "
                                 "operators")
        if len(self.weight_edge_costs) != len(self.graph.weight_edges):
            raise ShardplanError(f"cost tables: {len(self.weight_edge_costs)} weight-edge matrices for "
                                 f"{len(self.graph.weight_edges)} weight edges")
        if not self.arrays:
            cache: dict[int, LayoutArrays] = {}
            arrs = []
            for lays in self.layouts:
                if id(lays) not in cache:
                    cache[id(lays)] = LayoutArrays.stack(lays)
                arrs.append(cache[id(lays)])
            object.__setattr__(self, "arrays", tuple(arrs))
        splits: dict[int, np.ndarray] = {}
        for a in self.arrays:
            if id(a) not in splits:
                splits[id(a)] = a.splits
        object.__setattr__(self, "_splits", tuple(splits[id(a)] for a in self.arrays))

    @property
    def configs(self) -> tuple[np.ndarray, ...]:
        """Per operator, the total split factor of every layout: (K_v, n_dims) int64 (for vectorised code)."""
        return self._splits

    def all_edges(self) -> list[tuple[int, int, np.ndarray]]:
        """(src, dst, matrix) of every edge of the problem: the graph's, then the weight edges."""
        g = self.graph
        return ([(e.src, e.dst, m) for e, m in zip(g.edges, self.edge_costs)]
                + [(e.src, e.dst, m) for e, m in zip(g.weight_edges, self.weight_edge_costs)])

    def to_problem(self) -> Problem:
        """The solver-level problem: vertex cost t_l, edge cost t_x (seconds); weight edges after the graph's."""
        g = self.graph
        seen: dict[int, tuple] = {}
        configs = []
        for splits in self._splits:  # total split per dim of every layout, from the arrays (shared by identical ops)
            if id(splits) not in seen:
                seen[id(splits)] = tuple(map(tuple, splits.tolist()))
            configs.append(seen[id(splits)])
        return Problem(
            names=tuple(op.name for op in g.operators),
            configs=tuple(configs),
            vertex_cost=tuple(c.total for c in self.op_costs),
            edges=tuple((e.src, e.dst) for e in g.edges) + tuple((e.src, e.dst) for e in g.weight_edges),
            edge_cost=tuple(self.edge_costs) + tuple(self.weight_edge_costs),
            dims=tuple(op.dim_names for op in g.operators),
        )

    def index_of(self, op_index: int, config: Sequence[int] | Layout, order: Sequence[int] | None = None) -> int:
        """Row of a layout among operator ``op_index``'s.

        ``config`` is a :class:`Layout`, or a configuration tuple (total split
        per dim): then the layout whose device grid is the flat numbering of
        the tuple in ``order`` (default: the operator's own order) if it is
        a candidate, else the first candidate with that total split (only
        without an explicit ``order``).
        """
        op = self.graph.operators[op_index]
        lays = self.layouts[op_index]
        if isinstance(config, Layout):
            for k, lay in enumerate(lays):
                if lay == config:
                    return k
            raise ShardplanError(f"operator {op.name!r}: layout {config.describe()} is not a candidate ({op.label})")
        want = tuple(int(x) for x in config)
        ckey = (id(lays), want, None if order is None else tuple(int(j) for j in order))
        if ckey in self._index_cache:
            return self._index_cache[ckey]
        k = self._find(op, lays, self._splits[op_index], want, order)
        self._index_cache[ckey] = k
        return k

    def _find(self, op, lays: tuple[Layout, ...], splits: np.ndarray, want: tuple[int, ...],
              order: Sequence[int] | None) -> int:
        try:
            target = Layout.from_flat(op.dim_names, want, self.machine.levels, order)
        except ShardplanError:
            target = None
        rows = np.nonzero((splits == np.asarray(want, dtype=np.int64)[None, :]).all(axis=1))[0] \
            if len(want) == splits.shape[1] else np.zeros(0, dtype=np.int64)
        for k in rows.tolist():  # the target, if a candidate, has this total split
            if lays[k] == target:
                return k
        if len(rows) and order is None:
            return int(rows[0])
        what = f"{want}" + (f" with order {tuple(order)}" if order is not None else "")
        raise ShardplanError(f"operator {op.name!r}: {what} is not a valid configuration ({op.label})")

    def breakdown(self, assignment: Sequence[int]) -> dict[str, float]:
        """Seconds of a strategy by part (the keys of :data:`BREAKDOWN`) and their ``total``."""
        out = dict.fromkeys(PARTS, 0.0)
        for c, k in zip(self.op_costs, assignment):
            for key, val in c.parts(int(k)).items():
                out[key] = out.get(key, 0.0) + val
        out["redistribution"] = float(sum(m[assignment[s], assignment[d]] for s, d, m in self.all_edges()))
        out["total"] = sum(out.values())
        return out

    def memory_of(self, assignment: Sequence[int]) -> dict[str, float]:
        """:func:`strategy_memory`; an operator the program recomputes (``Graph.recomputed``) saves nothing; the
        largest transient of an operator's backward step (:func:`~shardplan.cost.memory.transient_bytes`) is added."""
        from shardplan.cost.memory import transient_bytes

        rec = self.graph.recomputed
        per_op = [(w, act * 0.0) if op.name in rec else (w, act) for op, (w, act) in zip(self.graph.operators, self.memory)]
        tr = [float(sum(transient_bytes(op, lay.take(np.array([int(k)])), self.machine))[0]) if op.transient else 0.0
              for op, lay, k in zip(self.graph.operators, self.arrays, assignment)]
        return strategy_memory(per_op, assignment, tr if any(tr) else None)


ORDERS: tuple[str, ...] = ("auto", *ORDER_MODES)
"""The values of :func:`build_tables`'s ``orders``: "auto" (see :func:`choose_orders`) or an order mode."""

AUTO_ORDERS_EDGE_ENTRIES = 4_000_000


def choose_orders(graph: Graph, splits: Sequence[np.ndarray], orders: str) -> str:
    """Resolve ``orders="auto"``: every nesting while the edge tables stay small, else row-major.

    Offering every nesting order multiplies the configurations of operators
    with several split dims (up to 6x) and the edge tables by up to 36x;
    building those tables is then the cost that dominates (the bounded DP
    is fast either way). "auto" picks "all" when, with every order, the edge
    tables hold at most AUTO_ORDERS_EDGE_ENTRIES entries (32 MB), otherwise
    "row-major".
    """
    if orders != "auto":
        return orders
    counts: dict[int, int] = {}
    for c in splits:  # identical operators share one array: count each once
        if id(c) not in counts:
            counts[id(c)] = order_count(c)
    ks = [counts[id(c)] for c in splits]
    entries = sum(ks[e.src] * ks[e.dst] for e in graph.edges)
    return "all" if entries <= AUTO_ORDERS_EDGE_ENTRIES else "row-major"


def order_count(configs: np.ndarray, max_permuted: int = 3) -> int:
    """Rows :func:`~shardplan.configs.dimension_orders` gives ``configs`` in mode "all", without building them."""
    from math import factorial

    n_split = (np.asarray(configs) > 1).sum(axis=1)
    per = np.where(n_split <= max_permuted, [factorial(int(k)) for k in n_split], 2)
    return int(per.sum())


def _tensor_key(t) -> tuple:
    return (t.name, t.shape, t.axes, t.role, t.needs_grad, t.elem_factor, t.owner is not None)


def operator_key(op) -> tuple:
    """What an operator's costs depend on: its description without its name or its producers' names."""
    return (op.kind, op.dims, tuple(_tensor_key(t) for t in op.inputs), _tensor_key(op.output),
            tuple(_tensor_key(t) for t in op.weights), op.flops_per_point, op.norm_dims, op.norm_stats,
            op.recurrence, tuple(sorted(op.fixed)), op.saved, op.causal, op.backward_flops, op.transient)


def build_tables(graph: Graph, machine: Machine, cutoff: int = 4, powers_of_two: bool = False,
                 divides_p: bool = True, orders: str = "auto", optimizer_factor: float = 2.0,
                 progress: Callable[[int, int], None] | None = None,
                 memory_limit_bytes: int | None = None, node_replicas: bool = False,
                 cache: dict | None = None,
                 candidates: Callable[[Operator], Sequence[Layout]] | None = None,
                 partial_sums: bool = False, overlap_tp: bool = False, context: str = "allgather",
                 max_devices: int = MAX_DEVICES) -> CostTables:
    """Layouts and costs of every operator and edge of ``graph`` on ``machine``.

    ``divides_p`` (default): keep configurations whose device count divides p,
    so every device works (the grid is replicated p / prod(c) times) and the
    layout is expressible as a device mesh; False also allows configurations
    that leave devices idle (one-level machines only). ``orders``: which
    device-grid nestings each configuration is offered in: "all",
    "row-major" or "auto" (see :func:`choose_orders` and
    :func:`shardplan.configs.dimension_orders`; on a machine of several
    levels "auto" is "row-major" inside every level). The candidate layouts
    are :func:`shardplan.configs.layouts` (``node_replicas``: also the layouts
    replicated inside a node while every node works, e.g. Megatron-LM's norms).

    Identical operators (:func:`operator_key`) are costed once and share
    their arrays; identical edges (same producer and consumer descriptions,
    same input slot) share one matrix: GPT-3's 96 identical layers cost one.

    Before anything large is allocated the peak memory of the whole build is
    estimated (:func:`shardplan.cost.budget.estimate_build`, an upper bound);
    above ``memory_limit_bytes`` (default: a quarter of the available
    memory) the build is refused with a :class:`TableMemoryError` naming the
    phase at the peak, its configuration count and the estimate.
    ``progress(done, total)`` is called after each distinct operator and each
    edge (total = distinct operators + |E|).

    ``cache`` (a dict, empty at first) keeps every distinct operator's and
    edge's arrays between builds *on the same machine with the same options*
    (the caller's promise): a later graph made of the same operators (e.g. a
    pipeline stage's blocks, at the same micro-batch size and sub-mesh) costs
    only what is new (the memory estimate runs only when some operator is new).

    ``candidates(op)``: instead of the enumeration, exactly these layouts of each operator (e.g. one
    hand-given plan's, to cost it without the whole space); each layout's costs are the same as in the full
    tables (an operator's cost depends on its layout, an edge's on its two layouts). With a ``cache`` the
    function must give the same layouts to identical operators.

    ``partial_sums``: also offer every enumerated layout that splits a reduction as a partial layout, which
    defers that reduction to the operator's edges (:func:`shardplan.configs.with_partial`; costed by
    :mod:`shardplan.cost.operator` and :func:`shardplan.cost.edge.edge_cost`).

    ``overlap_tp`` (implies ``partial_sums``): a contraction may hide the collective of one of its edges behind
    its own compute, cut into chunks (Megatron-LM's ``--tp-comm-overlap``, torchtitan's asynchronous tensor
    parallelism): the producer of partial sums read by one consumer hides that edge's reduction, a product
    with one input edge the gather into its input tile (:func:`shardplan.cost.edge.overlap_budgets`, the
    math in docs/cost-model.md). Each edge cost stays a function of its two layouts.

    ``context``: how a product of two activations whose layout leaves one input shared by a group (attention
    under context parallelism) receives it (:mod:`shardplan.cost.ring`): ``"allgather"`` (the default: the
    edge gathers it), ``"ring"`` (blocks passed around the group, overlapped with the product, wherever the
    producer scatters the input) or ``"auto"`` (the cheaper per edge). With ``ring`` or ``auto`` the
    all-reduce of that input's gradient is charged on the edge instead of the operator.

    ``max_devices`` (default :data:`~shardplan.cost.tiles.MAX_DEVICES`): an edge whose tiles differ between
    devices is refused (:class:`~shardplan.errors.PerDeviceLimitError`) on more devices than this, before the
    build allocates its tables (docs/cost-model.md, "Meshes of any size"); a lower value lets a caller try
    the refusal on a small machine.
    """
    if context not in CONTEXT_ALGORITHMS:
        raise ShardplanError(f"build_tables: context must be one of {', '.join(CONTEXT_ALGORITHMS)}, got {context!r}")
    if not isinstance(overlap_tp, bool):
        raise ShardplanError(f"build_tables: overlap_tp must be True or False, got {overlap_tp!r}")
    partial_sums = partial_sums or overlap_tp
    p = machine.num_devices
    levels = machine.levels
    ops = graph.operators
    # identical operators share one small integer key (hashing the full descriptions once)
    # with DTensor's reduce-scatter home (cost/grad_home.py) an operator's charge also depends on which of its
    # inputs an edge feeds (a pipeline stage's first operators read earlier stages' tensors as graph inputs)
    home = machine.scatter_gathered_grads
    unfed = unfed_slots(graph) if home else [frozenset()] * len(ops)
    okeys = [(operator_key(op), unfed[i]) if home else operator_key(op) for i, op in enumerate(ops)]
    ids: dict[tuple, int] = {}
    keys = [ids.setdefault(k, len(ids)) for k in okeys]
    first: dict[int, int] = {}
    count: dict[int, int] = {}
    for i, key in enumerate(keys):
        first.setdefault(key, i)
        count[key] = count.get(key, 0) + 1
    if len(levels) == 1 and candidates is None:
        splits = {key: configurations(ops[i], p, cutoff, powers_of_two, divides_p) for key, i in first.items()}
        orders = choose_orders(graph, [splits[key] for key in keys], orders)
    else:
        orders = "row-major" if orders == "auto" else orders
    if cache is not None:
        # keys shared with earlier builds: the operator descriptions (and the resolved orders) decide them
        store = cache.setdefault(("orders", orders), {})
        gids = store.setdefault("ids", {})
        remap = {key: gids.setdefault(okeys[i], len(gids)) for key, i in first.items()}
        keys = [remap[k] for k in keys]
        first = {remap[k]: i for k, i in first.items()}
        count = {remap[k]: c for k, c in count.items()}
        if len(levels) == 1 and candidates is None:
            splits = {remap[k]: v for k, v in splits.items()}
    else:
        store = {}
    per_key: dict[int, tuple] = store.setdefault("operators", {})
    dropped_by_key: dict[int, int] = store.setdefault("dropped", {})
    new: dict[int, tuple] = {}
    for key, i in first.items():
        if key in per_key:
            continue
        if candidates is not None:
            given = tuple(candidates(ops[i]))
            if not given:
                raise ShardplanError(f"operator {ops[i].name!r}: no candidate layout given")
            new[key] = (given, LayoutArrays.stack(given))
        elif len(levels) == 1:
            new[key] = flat_layouts(ops[i], p, cutoff, powers_of_two, divides_p, orders, rows=splits[key])
        else:
            lays = layouts(ops[i], levels, cutoff, powers_of_two, divides_p, orders, node_replicas=node_replicas)
            new[key] = (lays, LayoutArrays.stack(lays))
        if partial_sums and candidates is None:
            lays = with_partial(ops[i], new[key][0])
            new[key] = (lays, LayoutArrays.stack(lays))
    estimate = 0
    if new:  # nothing new: nothing is allocated but the edges' matrices between cached operators
        arrays_by_key = {k: per_key[k][1] for k in first if k in per_key}
        arrays_by_key.update({k: arr for k, (_, arr) in new.items()})
        estimate = check_build_memory(graph, keys, arrays_by_key, p, memory_limit_bytes, orders=orders,
                                      divides_p=divides_p, max_devices=max_devices)
    steps = len(first) + len(graph.edges)
    for n_done, (key, i) in enumerate(first.items()):
        op = ops[i]
        if key in per_key:
            if progress is not None:
                progress(n_done + 1, steps)
            continue
        lays, arr = new.pop(key)
        w, act = operator_memory(op, arr, machine, optimizer_factor)
        dropped_by_key[key] = 0
        if machine.memory_bytes is not None:
            keep = fits_memory(op, w, act, machine.memory_bytes)
            dropped_by_key[key] = int((~keep).sum())
            if not keep.all():
                rows = np.nonzero(keep)[0]
                lays = tuple(lays[r] for r in rows)
                arr = arr.take(rows)
                w, act = w[keep], act[keep]
        cost = operator_cost(op, arr, machine, step_bytes=optimizer_step_bytes(optimizer_factor, machine.dtype_bytes))
        if context != "allgather":  # the ring input's gradient all-reduce is charged on its edge
            moved = moved_reduction(op, arr, machine)
            store.setdefault("ring_moved", {})[key] = moved
            cost = replace(cost, grad_allreduce=cost.grad_allreduce - moved)
        elif gathered_applies(op, machine):  # the gathered keys' gradients, on their edges (the reduce-scatter)
            moved = gathered_moved(op, arr, machine, cost.compute)
            cost = replace(cost, grad_allreduce=cost.grad_allreduce - moved)
        if home:  # activation gradients home by reduce-scatter where the producer scatters them, on their edges
            pairs = home_pairs(op, arr, machine, unfed[i], ring_charged(op, arr, machine, context, cost.compute))
            store.setdefault("home", {})[key] = pairs
            cost = replace(cost, grad_allreduce=cost.grad_allreduce - home_moved(op, arr, machine, pairs),
                           comm_bytes=cost.comm_bytes - home_moved_bytes(op, arr, machine, pairs))
        per_key[key] = (lays, arr, cost, (w, act))
        if progress is not None:
            progress(n_done + 1, steps)
    dropped = sum(dropped_by_key[k] * count[k] for k in first)
    edge_costs = []
    edge_cache: dict[tuple, np.ndarray] = store.setdefault("edges", {})
    memo = EdgeMemo()  # fast-path summaries shared by the edges of this build
    # which edge each operator lends its compute to: overlap_tp's chunks, or the input-gradient reductions
    # beside the weight-gradient pass of Machine.overlap_dgrad where partial layouts leave them to the edges
    shape = _lending_shape(graph) if overlap_tp or machine.overlap_dgrad else None
    budgets: dict[tuple, tuple[np.ndarray, ...]] = store.setdefault("overlap_budgets", {})

    def budget(i: int) -> tuple[np.ndarray, ...]:
        """(producer's budget, consumer's budget, producer's chunk cost, consumer's chunk cost) of operator i."""
        assert shape is not None
        bkey = (keys[i], shape[0][i], shape[1][i])
        if bkey not in budgets:
            row = per_key[keys[i]]
            k = len(row[1].splits)
            cost = chunk_extras(ops[i], row[1], machine, shape[0][i], shape[1][i]) if overlap_tp else \
                (np.zeros((2, k)), np.zeros((2, k)))
            lent = overlap_budgets(ops[i], row[1], row[2].compute, machine, shape[0][i], shape[1][i],
                                   chunked=overlap_tp, extras=cost)
            budgets[bkey] = (*lent, *cost)
        return budgets[bkey]

    for n_done, e in enumerate(graph.edges):
        ekey = (keys[e.src], keys[e.dst], e.slot)
        if shape is not None:  # whether each end lends its compute to this edge depends on the graph's shape
            ekey += (shape[0][e.src], shape[1][e.dst])
        if ekey not in edge_cache:
            ku, kv = per_key[keys[e.src]], per_key[keys[e.dst]]
            hide = extra = None
            if shape is not None:
                hide, extra = (budget(e.src)[0], budget(e.dst)[1]), (budget(e.src)[2], budget(e.dst)[3])
            edge_cache[ekey] = edge_cost(ops[e.src], ku[1], ops[e.dst], e.slot, kv[1], machine, memo=memo, hide=hide,
                                         max_devices=max_devices, extra=extra)
            if context == "allgather" and gathered_applies(ops[e.dst], machine):
                edge_cache[ekey] = edge_cache[ekey] + gathered_charge(ops[e.dst], e.slot, kv[1], machine,
                                                                      kv[2].compute)[None, :] \
                    + gathered_reduction(ops[e.src], ku[1], ops[e.dst], e.slot, kv[1], machine, kv[2].compute)
            if context != "allgather":
                edge_cache[ekey] = context_edge(ops[e.src], ku[1], ops[e.dst], e.slot, kv[1], machine,
                                                edge_cache[ekey], store["ring_moved"][keys[e.dst]], kv[2].compute,
                                                context)
            if home:
                edge_cache[ekey] = edge_cache[ekey] + home_reduction(ops[e.src], ku[1], ops[e.dst], e.slot, kv[1],
                                                                     machine, store["home"][keys[e.dst]])
        edge_costs.append(edge_cache[ekey])
        if progress is not None:
            progress(len(first) + n_done + 1, steps)
    weight_costs = []
    wcache: dict[tuple, np.ndarray] = store.setdefault("weight_edges", {})
    for e in graph.weight_edges:
        wkey = (keys[e.src], keys[e.dst], e.src_weight, e.dst_weight)
        if wkey not in wcache:
            wcache[wkey] = weight_edge_cost(ops[e.src], e.src_weight, per_key[keys[e.src]][1], ops[e.dst],
                                            e.dst_weight, per_key[keys[e.dst]][1], machine, memo=memo,
                                            max_devices=max_devices)[0]
        weight_costs.append(wcache[wkey])
    _check_finite(graph, machine, [per_key[k][2] for k in keys], edge_costs, weight_costs)
    opts = {"cutoff": cutoff, "powers_of_two": powers_of_two, "divides_p": divides_p, "orders": orders,
            "node_replicas": node_replicas, "candidates_given": candidates is not None, "partial_sums": partial_sums,
            "overlap_tp": overlap_tp, "context": context, "optimizer_factor": optimizer_factor,
            "dropped_for_memory": dropped,
            "levels": levels,
            "distinct_operators": len(first),
            "distinct_edges": len({(keys[e.src], keys[e.dst], e.slot) for e in graph.edges}),
            "memory_estimate_bytes": estimate}
    return CostTables(graph, machine, tuple(per_key[k][0] for k in keys), tuple(per_key[k][2] for k in keys),
                      tuple(edge_costs), tuple(per_key[k][3] for k in keys), opts,
                      tuple(per_key[k][1] for k in keys), tuple(weight_costs))


def plan_home_bytes(tables: CostTables, assignment: Sequence[int]) -> float:
    """Bytes one device sends on the edges of ``tables`` at ``assignment`` for the activation gradients
    :func:`~shardplan.cost.grad_home.home_reduction` charges there (0 unless ``machine.scatter_gathered_grads``;
    :func:`~shardplan.cost.grad_home.home_bytes` at the chosen layouts): what a per-edge byte count adds to the
    redistribution volumes, the all-reduces the operators' ``comm_bytes`` no longer count."""
    machine, graph = tables.machine, tables.graph
    if not machine.scatter_gathered_grads:
        return 0.0
    unfed = unfed_slots(graph)
    rows = [tables.arrays[i].take(np.asarray([int(a)])) for i, a in enumerate(assignment)]
    context = tables.options.get("context", "allgather")
    total = 0.0
    for e in graph.edges:
        v = graph.operators[e.dst]
        handled = ring_charged(v, rows[e.dst], machine, context, operator_cost(v, rows[e.dst], machine).compute)
        pairs = home_pairs(v, rows[e.dst], machine, unfed[e.dst], handled)
        total += float(home_bytes(graph.operators[e.src], rows[e.src], v, e.slot, rows[e.dst], machine, pairs)[0, 0])
    return total


def overlap_hidden(tables: CostTables, assignment: Sequence[int]) -> dict[str, float]:
    """What the overlap of tables built with ``overlap_tp`` hides in a strategy: ``{"edges": how many edges
    hide some of their collectives, "hidden_seconds": the seconds they hide}`` (each edge costed once more
    without the overlap, at the chosen pair of layouts only; identical edges share their matrix, and once)."""
    g = tables.graph
    edges, hidden = 0, 0.0
    seen: dict[tuple[int, int, int], float] = {}
    for e, mat in zip(g.edges, tables.edge_costs):
        a, b = int(assignment[e.src]), int(assignment[e.dst])
        key = (id(mat), a, b)
        if key not in seen:
            seen[key] = float(edge_cost(g.operators[e.src], tables.arrays[e.src].take([a]), g.operators[e.dst],
                                        e.slot, tables.arrays[e.dst].take([b]), tables.machine)[0, 0])
        gain = seen[key] - float(mat[a, b])
        if gain > 0.0:
            edges += 1
            hidden += gain
    return {"edges": edges, "hidden_seconds": hidden}


def _lending_shape(graph: Graph) -> tuple[list[bool], list[int | None]]:
    """Per operator: whether exactly one edge leaves it, and the slot of the only edge into it (None: none or
    several): which edges an operator may lend its compute to (:func:`shardplan.cost.edge.overlap_budgets`)."""
    n = len(graph.operators)
    out_deg = [0] * n
    ins: list[list[int]] = [[] for _ in range(n)]
    for e in graph.edges:
        out_deg[e.src] += 1
        ins[e.dst].append(e.slot)
    return [d == 1 for d in out_deg], [s[0] if len(s) == 1 else None for s in ins]


def _check_finite(graph: Graph, machine: Machine, op_costs: Sequence[OpCost], edge_costs: Sequence[np.ndarray],
                  weight_costs: Sequence[np.ndarray] = ()) -> None:
    """Refuse costs that overflowed (inf) or are undefined (NaN), naming where and the machine that caused it."""
    seen: set[int] = set()  # identical operators and edges share their arrays: check each once
    for op, c in zip(graph.operators, op_costs):
        if id(c) in seen:
            continue
        seen.add(id(c))
        if not np.all(np.isfinite(c.total)):
            raise ShardplanError(f"operator {op.name!r}: its cost is not finite on {machine.describe()} (a FLOP/s, "
                                 "bandwidth or latency too extreme for float64 seconds)")
    for e, m in [*zip(graph.edges, edge_costs), *zip(graph.weight_edges, weight_costs)]:
        if id(m) in seen:
            continue
        seen.add(id(m))
        if not np.all(np.isfinite(m)):
            u, v = graph.operators[e.src].name, graph.operators[e.dst].name
            raise ShardplanError(f"edge {u!r} -> {v!r}: its redistribution cost is not finite on "
                                 f"{machine.describe()} (a bandwidth or latency too extreme for float64 seconds)")


def check_build_memory(graph: Graph, keys: Sequence, arrays: dict, p: int, limit: int | None,
                       orders: str, divides_p: bool, max_devices: int = MAX_DEVICES) -> int:
    """Refuse (TableMemoryError) a build whose estimated peak exceeds ``limit`` bytes, saying what would help;
    returns the estimate (the looser one of :func:`~shardplan.cost.budget.estimate_build` when that is
    within the limit, so the decision is the tighter bound's).

    ``keys``: each operator's key (equal for identical operators, :func:`operator_key`); ``arrays``: the candidate
    layouts (:class:`LayoutArrays`) of each distinct key.
    """
    from shardplan.cost.budget import estimate_build
    from shardplan.search.dp import default_memory_limit
    from shardplan.units import fmt_bytes

    limit = default_memory_limit() if limit is None else int(limit)
    # the looser bound first (no pass over the layouts); the tighter one only when the looser is over the limit
    est = estimate_build(graph, keys, arrays, p, count_patterns=False, max_devices=max_devices)
    if est.peak_bytes > limit:
        est = estimate_build(graph, keys, arrays, p, max_devices=max_devices)
    if est.peak_bytes <= limit:
        return est.peak_bytes
    helps = (["--orders row-major"] if orders == "all" else []) + (["not --all-divisors"] if not divides_p else [])
    helps += ["a larger --cutoff", "fewer devices", "a higher --table-memory"]
    raise TableMemoryError(
        f"operator {est.operator!r}: building the cost tables needs about {fmt_bytes(est.peak_bytes)} at the "
        f"{est.phase} ({est.configurations} configurations on {p} devices), over the memory limit of "
        f"{fmt_bytes(limit)}; try {', '.join(helps)}")


def fits_memory(op, weights: np.ndarray, activations: np.ndarray, limit: float) -> np.ndarray:
    """Configurations whose own footprint fits in ``limit`` bytes on every device: bool (K,).

    A strategy's memory on a device is the sum over operators, so an
    operator configuration that alone exceeds the device memory can never be
    part of a strategy that fits: dropping it is exact. (Whether the chosen
    strategy fits as a whole is checked and reported on the plan.)
    """
    keep = (weights + activations).max(axis=1) <= limit
    if not keep.any():
        from shardplan.units import fmt_bytes

        need = float((weights + activations).max(axis=1).min())
        raise OperatorMemoryError(f"operator {op.name!r} needs at least {fmt_bytes(need)} per device under every "
                             f"configuration; the device has {fmt_bytes(limit)}")
    return keep
