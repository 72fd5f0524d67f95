"""Costs derived from operator descriptions: compute, collectives, redistribution, memory.

:func:`build_tables` lowers a graph on a machine to cost tables (one vector
per operator, one matrix per edge) and from there to the solver-level
:class:`~shardplan.search.problem.Problem`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from shardplan.configs import ORDER_MODES, configurations, dimension_orders
from shardplan.cost.edge import edge_cost, edge_volumes
from shardplan.cost.memory import operator_memory, strategy_memory
from shardplan.cost.operator import PARTS, OpCost, operator_cost
from shardplan.errors import ShardplanError
from shardplan.ir import Graph
from shardplan.machine import Machine
from shardplan.search.problem import Problem

__all__ = ["CostTables", "build_tables", "operator_cost", "edge_cost", "edge_volumes", "OpCost", "PARTS",
           "BREAKDOWN", "ORDERS"]

BREAKDOWN: dict[str, str] = {**PARTS, "redistribution": "redistribution between operators"}
"""The parts of a strategy's step time (:meth:`CostTables.breakdown`): each operator part, then redistribution."""


@dataclass(frozen=True, eq=False)
class CostTables:
    """Every cost the search needs, for one graph on one machine.

    Attributes:
        graph, machine: what was costed.
        configs: per operator, its configurations' split factors (K_v, n_dims).
        orders: per operator, each configuration's device-grid nesting (K_v, n_dims), see
            :func:`shardplan.configs.dimension_orders`.
        op_costs: per operator, its :class:`OpCost` (arrays of K_v).
        edge_costs: per graph edge (``graph.edges`` order), a (K_u, K_v) matrix in seconds.
        memory: per operator, (weights, activations) bytes per configuration and device.
    """

    graph: Graph
    machine: Machine
    configs: tuple[np.ndarray, ...]
    orders: tuple[np.ndarray, ...]
    op_costs: tuple[OpCost, ...]
    edge_costs: tuple[np.ndarray, ...]
    memory: tuple[tuple[np.ndarray, np.ndarray], ...]
    options: dict

    def to_problem(self) -> Problem:
        """The solver-level problem: vertex cost t_l, edge cost t_x (seconds)."""
        g = self.graph
        return Problem(
            names=tuple(op.name for op in g.operators),
            configs=tuple(tuple(tuple(int(x) for x in row) for row in c) for c in self.configs),
            vertex_cost=tuple(c.total for c in self.op_costs),
            edges=tuple((e.src, e.dst) for e in g.edges),
            edge_cost=self.edge_costs,
            dims=tuple(op.dim_names for op in g.operators),
        )

    def index_of(self, op_index: int, config: Sequence[int], order: Sequence[int] | None = None) -> int:
        """Row of ``config`` (with the row-major order unless ``order`` is given) among operator ``op_index``'s."""
        match = (self.configs[op_index] == np.asarray(config)[None, :]).all(axis=1)
        if order is not None:
            match &= (self.orders[op_index] == np.asarray(order)[None, :]).all(axis=1)
        rows = np.nonzero(match)[0]
        if not len(rows):
            op = self.graph.operators[op_index]
            what = f"{tuple(config)}" + (f" with order {tuple(order)}" if order is not None else "")
            raise ShardplanError(f"operator {op.name!r}: {what} is not a valid configuration ({op.label})")
        return int(rows[0])

    def breakdown(self, assignment: Sequence[int]) -> dict[str, float]:
        """Seconds of a strategy by part (the keys of :data:`BREAKDOWN`) and their ``total``."""
        out = dict.fromkeys(PARTS, 0.0)
        for c, k in zip(self.op_costs, assignment):
            for key, val in c.parts(int(k)).items():
                out[key] += val
        out["redistribution"] = float(sum(m[assignment[e.src], assignment[e.dst]]
                                          for e, m in zip(self.graph.edges, self.edge_costs)))
        out["total"] = sum(out.values())
        return out

    def memory_of(self, assignment: Sequence[int]) -> dict[str, float]:
        return strategy_memory(list(self.memory), assignment)


ORDERS: tuple[str, ...] = ("auto", *ORDER_MODES)
"""The values of :func:`build_tables`'s ``orders``: "auto" (see :func:`choose_orders`) or an order mode."""

AUTO_ORDERS_EDGE_ENTRIES = 4_000_000
MAX_DEVICES = 4096


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
    ks = [len(dimension_orders(c, "all")[0]) for c in splits]
    entries = sum(ks[e.src] * ks[e.dst] for e in graph.edges)
    return "all" if entries <= AUTO_ORDERS_EDGE_ENTRIES else "row-major"


def build_tables(graph: Graph, machine: Machine, cutoff: int = 4, powers_of_two: bool = False,
                 divides_p: bool = True, orders: str = "auto", optimizer_factor: float = 2.0,
                 progress: Callable[[int, int], None] | None = None) -> CostTables:
    """Configurations and costs of every operator and edge of ``graph`` on ``machine``.

    ``divides_p`` (default): keep configurations whose device count divides p,
    so every device works (the grid is replicated p / prod(c) times) and the
    layout is expressible as a device mesh; False also allows configurations
    that leave devices idle. ``orders``: which device-grid nestings each
    configuration is offered in: "all", "row-major" or "auto" (see
    :func:`choose_orders` and :func:`shardplan.configs.dimension_orders`).
    """
    p = machine.num_devices
    if p > MAX_DEVICES:
        raise ShardplanError(f"{p} devices: the cost model keeps a tile per device and configuration, "
                             f"so it supports at most {MAX_DEVICES} devices")
    splits = [configurations(op, p, cutoff, powers_of_two, divides_p) for op in graph.operators]
    orders = choose_orders(graph, splits, orders)
    pairs = [dimension_orders(c, orders) for c in splits]
    ops = graph.operators
    memory = [operator_memory(op, c, machine, optimizer_factor, o) for op, (c, o) in zip(ops, pairs)]
    dropped = 0
    if machine.memory_bytes is not None:
        for i, (op, (c, o), (w, act)) in enumerate(zip(ops, pairs, memory)):
            keep = fits_memory(op, w, act, machine.memory_bytes)
            dropped += int((~keep).sum())
            pairs[i] = (c[keep], o[keep])
            memory[i] = (w[keep], act[keep])
    configs = tuple(c for c, _ in pairs)
    ords = tuple(o for _, o in pairs)
    op_costs = tuple(operator_cost(op, c, machine, o) for op, c, o in zip(ops, configs, ords))
    edge_costs = []
    for i, e in enumerate(graph.edges):
        edge_costs.append(edge_cost(ops[e.src], configs[e.src], ops[e.dst], e.slot, configs[e.dst], machine,
                                    ords[e.src], ords[e.dst]))
        if progress is not None:
            progress(i + 1, len(graph.edges))
    opts = {"cutoff": cutoff, "powers_of_two": powers_of_two, "divides_p": divides_p, "orders": orders,
            "optimizer_factor": optimizer_factor, "dropped_for_memory": dropped}
    return CostTables(graph, machine, configs, ords, op_costs, tuple(edge_costs), tuple(memory), opts)


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
        raise ShardplanError(f"operator {op.name!r} needs at least {fmt_bytes(need)} per device under every "
                             f"configuration; the device has {fmt_bytes(limit)}")
    return keep
