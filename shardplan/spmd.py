"""A plan: one configuration per operator, with its predicted cost, and the solve API."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from shardplan.cost import CostTables, build_tables
from shardplan.errors import ShardplanError
from shardplan.ir import Graph
from shardplan.layout import Layout
from shardplan.machine import Machine
from shardplan.search.io import jsonable
from shardplan.search.problem import Solution

__all__ = ["SpmdPlan", "solve", "solve_tables", "plan_from_configs"]


@dataclass(frozen=True, eq=False)
class SpmdPlan:
    """A strategy on a costed graph.

    Attributes:
        tables: the cost tables it was chosen from (graph, machine, configurations, costs).
        assignment: configuration index per operator (graph order).
        solution: the solver's answer (None for a hand-made strategy such as a baseline).
        name: what made it ("dp", "data-parallel", ...).
        build_seconds: time spent building the cost tables, when it was measured (None otherwise).

    The breakdown of the predicted step time is computed once, at construction.
    """

    tables: CostTables
    assignment: tuple[int, ...]
    solution: Solution | None = None
    name: str = "plan"
    build_seconds: float | None = None
    memory_choices: Any = None  # shardplan.fit.MemoryChoices: ZeRO stages, recomputation, micro-batches
    _breakdown: Mapping[str, float] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        assignment = tuple(int(a) for a in self.assignment)
        if len(assignment) != len(self.tables.graph):
            raise ShardplanError(f"plan {self.name!r} assigns {len(assignment)} configurations to "
                                 f"{len(self.tables.graph)} operators")
        object.__setattr__(self, "assignment", assignment)
        bd = (self.memory_choices.breakdown(self.tables, assignment) if self.memory_choices is not None
              else self.tables.breakdown(assignment))
        object.__setattr__(self, "_breakdown", MappingProxyType(bd))

    @property
    def graph(self) -> Graph:
        return self.tables.graph

    @property
    def machine(self) -> Machine:
        return self.tables.machine

    @property
    def layouts(self) -> dict[str, Layout]:
        """Operator name -> its chosen :class:`~shardplan.layout.Layout` (splits per level, nesting)."""
        return {op.name: self.tables.layouts[i][k] for i, (op, k) in enumerate(zip(self.graph.operators,
                                                                                  self.assignment))}

    def layout(self, name: str) -> Layout:
        i = self.graph.index.get(name)
        if i is None:
            raise ShardplanError(f"plan has no operator {name!r}")
        return self.tables.layouts[i][self.assignment[i]]

    @property
    def configs(self) -> dict[str, tuple[int, ...]]:
        """Operator name -> configuration tuple (total split per dimension, in the operator's dim order)."""
        return {name: lay.split for name, lay in self.layouts.items()}

    @property
    def orders(self) -> dict[str, tuple[int, ...]]:
        """Operator name -> nesting of its layout flattened over the levels (dim indices, most significant
        first; see :meth:`~shardplan.layout.Layout.flat_order`)."""
        return {name: lay.flat_order() for name, lay in self.layouts.items()}

    def config(self, name: str) -> tuple[int, ...]:
        return self.layout(name).split

    @property
    def breakdown(self) -> dict[str, float]:
        """Predicted seconds per training step by part (see :data:`shardplan.cost.BREAKDOWN`) and ``total``;
        a plan with memory choices adds ``weight_sync`` and ``recompute`` (see :mod:`shardplan.fit`)."""
        return dict(self._breakdown)

    @property
    def cost(self) -> float:
        """Predicted seconds of one training step (forward + backward)."""
        return self._breakdown["total"]

    @property
    def memory(self) -> dict[str, float]:
        """Peak bytes per device and its parts."""
        if self.memory_choices is not None:
            return self.memory_choices.memory()
        return self.tables.memory_of(self.assignment)

    @property
    def solve_seconds(self) -> float:
        return self.solution.solve_seconds if self.solution is not None else 0.0

    @property
    def stats(self) -> dict[str, Any]:
        """Search statistics: ordering, max dependent-set size, table entries, largest table, pruning."""
        return dict(self.solution.stats) if self.solution is not None else {}

    def operators(self) -> list[dict[str, Any]]:
        """Per operator: name, kind, dims, configuration, its own cost parts and incoming redistribution."""
        incoming = np.zeros(len(self.graph))
        for src, dst, m in self.tables.all_edges():  # weight edges: charged to the reader
            incoming[dst] += m[self.assignment[src], self.assignment[dst]]
        rows = []
        for i, op in enumerate(self.graph.operators):
            k = self.assignment[i]
            parts = self.tables.op_costs[i].parts(k)
            lay = self.tables.layouts[i][k]
            extra: dict[str, Any] = {}
            if self.memory_choices is not None:
                mc = self.memory_choices
                parts = mc.parts(i)
                extra = {"state_stage": mc.stage(i), "recompute": mc.recompute(i)}
            rows.append({
                "name": op.name,
                "kind": op.kind,
                "dims": list(op.dim_names),
                "label": op.label,
                "dim_labels": [op.dim_label(d) for d in op.dim_names],
                "dims_text": op.dims_text,
                "config": list(lay.split),
                "order": [op.dim_names[j] for j in lay.flat_order() if lay.split[j] > 1],
                "level_splits": [list(r) for r in lay.splits],
                "copies": lay.copies,
                "cost_seconds": float(sum(parts.values())),
                "parts": parts,
                "redistribution_in_seconds": float(incoming[i]),
                **extra,
            })
        return rows

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary."""
        d: dict[str, Any] = {
            "graph": self.graph.name,
            "strategy": self.name,
            "machine": {"name": self.machine.name, "devices": self.machine.num_devices,
                        "peak_flops": self.machine.peak_flops, "bandwidth": self.machine.bandwidth,
                        "levels": list(self.machine.levels)},
            "cost_seconds": self.cost,
            "breakdown": self.breakdown,
            "memory": self.memory,
            "solve_seconds": self.solve_seconds,
            "build_seconds": self.build_seconds,
            "operators": self.operators(),
        }
        if self.solution is not None:
            d["solver"] = self.solution.solver
            d["optimal"] = self.solution.optimal
            d["stats"] = jsonable(self.solution.stats)
            d["bound_seconds"] = self.solution.bound
        if self.memory_choices is not None:
            d["memory_choices"] = self.memory_choices.summary([op.name for op in self.graph.operators])
        return d


def plan_from_configs(tables: CostTables, configs: Mapping[str, Sequence[int] | Layout], name: str = "custom") -> SpmdPlan:
    """A plan from explicit layouts or configuration tuples (every operator must be given); a tuple means
    its row-major flat numbering when that is a candidate (see :meth:`CostTables.index_of`)."""
    g = tables.graph
    missing = [op.name for op in g.operators if op.name not in configs]
    if missing:
        raise ShardplanError(f"strategy {name!r} gives no configuration for {missing[0]!r} ({len(missing)} missing)")
    assignment = tuple(tables.index_of(i, configs[op.name]) for i, op in enumerate(g.operators))
    return SpmdPlan(tables, assignment, None, name)


def solve(graph: Graph, machine: Machine, *, cutoff: int = 4, powers_of_two: bool = False, divides_p: bool = True,
          orders: str = "auto", solver: str = "dp", progress: Callable[[int, int], None] | None = None,
          partial_sums: bool = False, overlap_tp: bool = False, context: str = "allgather",
          **solver_options: Any) -> SpmdPlan:
    """Find the strategy of minimum predicted step time for ``graph`` on ``machine``.

    Builds the cost tables (configurations with at least ``cutoff`` points per
    part, device counts dividing p unless ``divides_p=False``, device-grid nestings
    as ``orders`` says: see :func:`shardplan.cost.build_tables`), timing the
    build, then searches them with :func:`solve_tables`; extra keyword
    arguments go to the solver (e.g. ``ordering="generateseq"``). ``partial_sums``: also offer the layouts
    that defer a split reduction to the consumers (reduce-scatter or all-reduce on the edge; Megatron-LM's
    sequence parallelism is such a plan). ``overlap_tp``: products may hide an edge's collective behind their
    compute (:func:`shardplan.cost.build_tables`). ``context``: how attention's products receive the keys and
    values their layouts share (``allgather``, ``ring`` or ``auto``: :mod:`shardplan.cost.ring`).
    """
    from shardplan.checks import MAX_EXTENT, integer

    if not isinstance(graph, Graph):
        raise ShardplanError(f"solve: graph must be a shardplan Graph (e.g. get_model('alexnet')), "
                             f"got {type(graph).__name__}")
    if not isinstance(machine, Machine):
        raise ShardplanError(f"solve: machine must be a shardplan Machine (e.g. preset('paper', 8)), "
                             f"got {type(machine).__name__}")
    _check_solver(solver)
    integer("solve: cutoff", cutoff, 1, MAX_EXTENT)
    if orders not in ("auto", "all", "row-major"):
        raise ShardplanError(f"solve: orders must be 'auto', 'all' or 'row-major', got {orders!r}")
    if progress is not None and not callable(progress):
        raise ShardplanError(f"solve: progress must be a callable progress(done, total), got {progress!r}")
    t0 = time.perf_counter()
    tables = build_tables(graph, machine, cutoff=cutoff, powers_of_two=powers_of_two, divides_p=divides_p,
                          orders=orders, progress=progress, partial_sums=partial_sums,
                          overlap_tp=overlap_tp, context=context)
    return solve_tables(tables, solver=solver, build_seconds=time.perf_counter() - t0, **solver_options)


def solve_tables(tables: CostTables, *, solver: str = "dp", build_seconds: float | None = None,
                 **solver_options: Any) -> SpmdPlan:
    """The strategy of minimum predicted step time among prebuilt cost ``tables``.

    Lowers them to a :class:`~shardplan.search.problem.Problem` (each group
    of the graph's ``ties`` contracted to one vertex) and runs
    ``solver`` (a key of :data:`shardplan.search.SOLVERS`) with
    ``solver_options``. ``build_seconds``: how long building ``tables`` took,
    if the caller measured it; it is recorded on the plan as given.
    """
    from shardplan.search import SOLVERS

    if not isinstance(tables, CostTables):
        raise ShardplanError(f"solve_tables: tables must be CostTables from build_tables, got {type(tables).__name__}")
    _check_solver(solver)
    problem = tables.to_problem()
    if not tables.graph.ties:
        sol = SOLVERS[solver](problem, **solver_options)
    else:  # tied operators: one variable per group (exact for the tied problem, see shardplan.search.tie)
        from shardplan.search.tie import check_ties, tie, untie

        groups = check_ties(problem.names, tables.graph.ties)
        for grp in groups:
            if any(tables.layouts[i] != tables.layouts[grp[0]] for i in grp[1:]):
                raise ShardplanError(f"tied operator {tables.graph.operators[grp[0]].name!r}: its copies have "
                                     "different candidate layouts")
        tied, rep = tie(problem, groups)
        sol = untie(SOLVERS[solver](tied, **solver_options), rep)
    return SpmdPlan(tables, tuple(int(a) for a in sol.assignment), sol, solver, build_seconds)


def _check_solver(solver: str) -> None:
    from shardplan.search import SOLVERS

    if not isinstance(solver, str) or solver not in SOLVERS:
        raise ShardplanError(f"unknown solver {solver!r}; choose from {', '.join(sorted(SOLVERS))}")
