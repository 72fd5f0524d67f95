"""Plans that fit: the minimum step time with peak memory per device within a budget.

:func:`solve_fit` searches, exactly, the plan of least predicted step time
whose peak memory per device fits a budget, offering beside every layout
ZeRO stage 0-3 (FSDP) sharding of weights, gradients and optimizer state over
the weight's data-parallel group, per-operator recomputation, and a global
micro-batch count (:class:`FitOptions`), and on request FP8 matrix products
and host offload of optimizer state, parameters and activations under a
second budget, the host memory (:class:`~shardplan.cost.memory.ChoiceRules`).
The memory model is additive
(``grad_buffers="persistent"``: every gradient and saved activation live at
once) or the backward-pass peak (``"backward"``, one micro-batch); the search
is :func:`shardplan.search.constrained.solve_memory` (Lagrangian dual closed by
branch-and-bound) per micro-batch count, or
:func:`shardplan.search.peak.solve_peak` for the backward-peak model.
:func:`plan_with_choices` gives any plan hand-chosen choices.

What is live at the peak, the cost of each choice, the search and how the
model compares with XLA's compiled programs are in ``docs/memory.md``; where a
docstring below refers to "the module docstring", it means that document.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from shardplan.cost import CostTables, build_tables
from shardplan.cost.memory import (OFFLOAD_BITS, OFFLOADS, STAGES, ChoiceRules, ChoiceTable, choice_table,
                                   offload_names, recompute_keep_bytes, unsaved_inputs, weight_groups)
from shardplan.checks import real
from shardplan.errors import ShardplanError
from shardplan.ir import Graph, Operator
from shardplan.machine import Machine
from shardplan.search.work import choice_work, table_work
from shardplan.search.constrained import (WORK_LIMIT, MemoryProblem, forest_work, infeasible_message,
                                          solve_memory)
from shardplan.search.peak import PeakProblem, backward_profile, solve_peak
from shardplan.search.problem import Solution

__all__ = ["FitOptions", "MemoryChoices", "fit_problem", "peak_problem", "solve_fit", "plan_with_choices",
           "GRAD_BUFFERS"]

GRAD_BUFFERS = ("persistent", "backward")


@dataclass(frozen=True)
class FitOptions:
    """Which memory-saving choices the search may use, and its limits.

    Attributes:
        stages: ZeRO stages offered to operators with weights (0 is always offered).
        recompute: offer activation recomputation.
        micro_batches: micro-batch counts searched.
        work_limit: work units per search of a micro-batch count (the root-only search that orders the
            counts, and the full search, each; the frontier programs within included;
            :data:`~shardplan.search.constrained.WORK_LIMIT`, the default, is about what a 60 s wall-clock
            limit did on an idle machine). Work is counted, not timed, so the
            same input gives the same plan, step and bound on any machine at any load; a search it stops
            returns its best plan with the proven bound and gap.
        time_limit: None (default): no wall clock. Seconds per micro-batch count, when asked for: each
            count's search also stops at that deadline, which makes the answer depend on the machine's
            speed and load.
        reserve_bytes: memory per device kept free (see the module docstring).
        in_flight: micro-batches whose saved activations are live at the peak
            (1 for one SPMD program; a pipeline stage i of S under 1F1B holds
            S - i, under GPipe all of them: the per-stage memory of a pipeline stage is
            this model on the stage's operators and sub-mesh with that count;
            fractional for an interleaved device group, see
            :func:`shardplan.pipeline.schedule.in_flight`).
        accumulate: the graph is one micro-batch of a step that accumulates
            gradients over this many (a pipeline stage's cost per micro-batch):
            once-per-step collectives are charged 1/accumulate each
            (:func:`shardplan.cost.memory.choice_table`); 1: the graph is the step.
        grad_buffers: ``"persistent"`` (default): the weight gradients live in buffers held through
            the backward pass (DDP bucket views, Megatron's main_grad, any accumulator): the additive
            peak. ``"backward"``: they appear as the backward pass produces them while it frees the
            saved activations (XLA): the backward-peak model, a maximum over the backward steps (see
            the module docstring); it differs only for one micro-batch (m = 1, ``in_flight`` and
            ``accumulate`` 1): with more, gradients are accumulated in persistent buffers anyway.
        fp8: offer FP8 for every matrix product on a machine with an FP8 peak (``Machine.fp8_flops``).
        offload: the parts that may live in host memory, a subset of
            :data:`~shardplan.cost.memory.OFFLOADS` (on a machine with a host link and host memory).
        master_weights: mixed-precision state (fp32 master weights and optimizer state:
            :class:`~shardplan.cost.memory.ChoiceRules`).
        host_budget_bytes: host memory per device; None: the machine's node memory over its devices
            (:meth:`host_budget`).
    """

    stages: tuple[int, ...] = STAGES
    recompute: bool = True
    micro_batches: tuple[int, ...] = (1, 2, 4, 8)
    work_limit: float = WORK_LIMIT
    time_limit: float | None = None
    reserve_bytes: float = 0.0
    in_flight: float = 1
    accumulate: int = 1
    grad_buffers: str = "persistent"
    fp8: bool = False
    offload: tuple[str, ...] = ()
    master_weights: bool = False
    host_budget_bytes: float | None = None

    @property
    def rules(self) -> ChoiceRules:
        """The precision rules and precision/offload choices of these options."""
        return ChoiceRules(self.fp8, self.offload, self.master_weights)

    def host_budget(self, machine: Machine) -> float:
        """Host bytes per device: ``host_budget_bytes``, else the node's host memory shared by its
        devices (``host_memory_bytes / node_devices``; infinite without host memory)."""
        if self.host_budget_bytes is not None:
            return float(self.host_budget_bytes)
        if machine.host_memory_bytes is None:
            return float("inf")
        return float(machine.host_memory_bytes) / machine.node_devices

    def backward_peak(self, micro_batches: int) -> bool:
        """Whether the backward-peak model applies to a plan with ``micro_batches`` (see ``grad_buffers``)."""
        return (self.grad_buffers == "backward" and int(micro_batches) == 1 and int(self.in_flight) == 1
                and int(self.accumulate) == 1)

    def __post_init__(self) -> None:
        if self.grad_buffers not in GRAD_BUFFERS:
            raise ShardplanError(f"grad_buffers must be one of {', '.join(GRAD_BUFFERS)}, got {self.grad_buffers!r}")
        bad = [s for s in self.stages if s not in STAGES]
        if bad:
            raise ShardplanError(f"ZeRO stage {bad[0]!r} does not exist; choose from 0, 1, 2, 3")
        if not self.micro_batches or any(int(m) < 1 for m in self.micro_batches):
            raise ShardplanError(f"micro-batch counts must be positive integers, got {self.micro_batches!r}")
        if not float(self.in_flight) >= 1:
            raise ShardplanError(f"in_flight must be a positive number of micro-batches, got {self.in_flight!r}")
        if int(self.accumulate) < 1:
            raise ShardplanError(f"accumulate must be a positive number of micro-batches, got {self.accumulate!r}")
        real("FitOptions: reserve_bytes", self.reserve_bytes, minimum=0.0, unit="B")
        real("FitOptions: work_limit", self.work_limit, minimum=0.0)
        if self.time_limit is not None:
            real("FitOptions: time_limit", self.time_limit, positive=True, unit="s")
        object.__setattr__(self, "offload", self.rules.offload)  # validated, in OFFLOADS order
        if self.host_budget_bytes is not None:
            real("FitOptions: host_budget_bytes", self.host_budget_bytes, minimum=0.0, unit="B")


@dataclass(frozen=True, eq=False)
class MemoryChoices:
    """A plan's memory-saving choices: micro-batches, and per operator its choice table and choice."""

    micro_batches: int
    budget_bytes: float
    reserve_bytes: float
    choice_tables: tuple[ChoiceTable, ...]
    choices: tuple[int, ...]
    backward: bool = False  # the backward-peak model applies (FitOptions.backward_peak), else the additive
    host_budget_bytes: float = float("inf")
    rules: ChoiceRules = field(default_factory=ChoiceRules)  # precision rules of the tables, and what they offer

    def stage(self, i: int) -> int:
        return int(self.choice_tables[i].stage[self.choices[i]])

    def fp8(self, i: int) -> bool:
        return bool(self.choice_tables[i].fp8[self.choices[i]])

    def offload(self, i: int) -> tuple[str, ...]:
        return offload_names(int(self.choice_tables[i].offload[self.choices[i]]))

    def recompute(self, i: int) -> bool:
        return bool(self.choice_tables[i].recompute[self.choices[i]])

    def label(self, i: int) -> str:
        return self.choice_tables[i].label(self.choices[i])

    def parts(self, i: int) -> dict[str, float]:
        return {k: float(v[self.choices[i]]) for k, v in self.choice_tables[i].parts.items()}

    def breakdown(self, tables: CostTables, assignment: Sequence[int]) -> dict[str, float]:
        out: dict[str, float] = {}
        for i in range(len(self.choices)):
            for key, val in self.parts(i).items():
                out[key] = out.get(key, 0.0) + val
        out["redistribution"] = float(sum(m[assignment[s], assignment[d]] for s, d, m in tables.all_edges()))
        out["total"] = sum(out.values())
        return out

    def backward_profile(self) -> np.ndarray:
        """Bytes per device at each operator's backward step (the backward-peak model, module docstring):
        reserve + rest + saved of the operators up to it + gradients of those from it on."""
        pick = [(t.rest_bytes[j], t.activation_bytes[j], t.grad_bytes[j], t.transient_bytes[j])
                for t, j in zip(self.choice_tables, self.choices)]
        rest, saved, grad, tr = (np.array(x, dtype=np.float64) for x in zip(*pick))
        return backward_profile(rest, saved, grad, self.reserve_bytes, tr)

    def memory(self) -> dict[str, float]:
        """Peak bytes per device and its parts; with the backward-peak model also the step of the peak
        (``peak_step``, an operator index) and the additive sum (``additive_peak_bytes``). Where an
        operator's backward step holds a transient (:func:`~shardplan.cost.memory.transient_bytes`), the
        additive peak adds the largest (``transient_bytes``, at operator ``transient_step``) and the
        backward-peak model each at its own step."""
        state = float(sum(t.state_bytes[j] for t, j in zip(self.choice_tables, self.choices)))
        act = float(sum(t.activation_bytes[j] for t, j in zip(self.choice_tables, self.choices)))
        grad = float(sum(t.grad_bytes[j] for t, j in zip(self.choice_tables, self.choices)))
        host = float(sum(t.host_bytes[j] for t, j in zip(self.choice_tables, self.choices)))
        out = {"peak_bytes": self.reserve_bytes + state + act, "weights_bytes": state, "activations_bytes": act,
               "gradients_bytes": grad, "reserve_bytes": self.reserve_bytes, "budget_bytes": self.budget_bytes,
               "micro_batches": self.micro_batches}
        if host or any(t.offload.any() for t in self.choice_tables):
            out.update(host_bytes=host, host_budget_bytes=self.host_budget_bytes)
        tr = np.array([float(t.transient_bytes[j]) for t, j in zip(self.choice_tables, self.choices)])
        if len(tr) and tr.max() > 0:
            k = int(np.argmax(tr))
            out.update(peak_bytes=out["peak_bytes"] + float(tr[k]), transient_bytes=float(tr[k]), transient_step=k)
        if self.backward and self.choices:
            prof = self.backward_profile()
            k = int(np.argmax(prof))
            out.update(additive_peak_bytes=out["peak_bytes"], peak_bytes=float(prof[k]), peak_step=k)
        return out

    def summary(self, names: Sequence[str]) -> dict[str, Any]:
        """JSON-ready: micro-batches, and which operators shard state (by stage), recompute, run FP8 products
        (``fp8``, when any) or offload (``offload``: part -> operators, when any)."""
        stages: dict[str, list[str]] = {}
        for i, n in enumerate(names):
            if self.stage(i):
                stages.setdefault(f"zero-{self.stage(i)}", []).append(n)
        out = {"micro_batches": self.micro_batches, "budget_bytes": self.budget_bytes,
               "reserve_bytes": self.reserve_bytes, "backward_peak": self.backward, "state_sharding": stages,
               "recompute": [n for i, n in enumerate(names) if self.recompute(i)]}
        fp8 = [n for i, n in enumerate(names) if self.fp8(i)]
        off = {part: [n for i, n in enumerate(names) if part in self.offload(i)] for part in OFFLOADS}
        if fp8:
            out["fp8"] = fp8
        if any(off.values()):
            out["offload"] = {k: v for k, v in off.items() if v}
        return out


def _key(op) -> Any:
    from shardplan.cost import operator_key

    return operator_key(op)


def _shared(store: dict, key: Any, make: Any) -> Any:
    if key not in store:
        store[key] = make()
    return store[key]


def producers_saved(g: Graph, op: Operator) -> tuple[float, ...]:
    """Per input of ``op``: its producer's ``saved``, 1.0 for a graph input or a producer the program recomputes."""
    out = []
    for t in op.inputs:
        j = g.index.get(t.src) if t.src is not None else None
        if j is None or t.src in g.recomputed:
            out.append(1.0)
        else:
            out.append(float(g.operators[j].saved))
    return tuple(out)


def fit_problem(tables: CostTables, budget: float, micro_batches: int = 1, options: FitOptions = FitOptions(),
                cache: dict | None = None) -> tuple[MemoryProblem, tuple[ChoiceTable, ...]]:
    """The memory-constrained problem of ``tables`` with ``micro_batches``: choices as vertex alternatives.

    Choices that alone leave no room for the least memory of every other
    operator are dropped (exact). ``cache`` (a dict, empty at first) keeps what
    does not depend on the micro-batch count between calls on the same tables.
    This is the additive model; :func:`peak_problem` is the backward-peak one.
    """
    cache = {} if cache is None else cache
    cts = _choice_tables(tables, micro_batches, options, cache, peak=False)
    low = _per_table(cts, lambda t: t.bytes.min())  # identical operators share a table: one reduction each
    least = options.reserve_bytes + float(sum(low))
    if least <= budget:
        cts = _taken(cts, _per_table(cts, lambda t: np.flatnonzero(t.bytes + (least - t.bytes.min()) <= budget)))
    cts = _host_pruned(cts, options.host_budget(tables.machine))
    problem = cache_problem(tables, cache)
    base, seconds, mem = _shared_rows(cts)
    mp = MemoryProblem(problem, base, seconds, mem, budget, options.reserve_bytes)
    return mp, tuple(cts)


def _per_table(cts: Sequence[ChoiceTable], f: Callable[[ChoiceTable], Any]) -> list[Any]:
    """``[f(t) for t in cts]``, computed once per table object (a pure ``f``: tables shared by identical
    operators give the same value; ``cts`` holds the tables, so their ids stay their own)."""
    done: dict[int, Any] = {}
    return [done[id(t)] if id(t) in done else done.setdefault(id(t), f(t)) for t in cts]


def _shared_rows(cts: Sequence[ChoiceTable]) -> tuple[tuple[np.ndarray, ...], ...]:
    """Per table, its ``(base, seconds, bytes)``; tables with equal arrays (identical operators) get the same
    three array objects.

    Equal means equal bytes (the dict compares them whole), so each vertex gets
    exactly its own values; the search then recognises identical operators by
    identity and computes their Lagrangian rows and lattice steps once
    (:mod:`shardplan.search.constrained`).
    """
    by_bytes: dict[tuple[bytes, bytes, bytes], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    by_table: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}  # cts holds the tables: ids stay unique
    rows = []
    for t in cts:
        row = by_table.get(id(t))
        if row is None:
            b = np.asarray(t.base, dtype=np.int64)
            c = np.asarray(t.seconds, dtype=np.float64)
            m = np.asarray(t.bytes, dtype=np.float64)
            row = by_table[id(t)] = by_bytes.setdefault((b.tobytes(), c.tobytes(), m.tobytes()), (b, c, m))
        rows.append(row)
    return tuple(r[0] for r in rows), tuple(r[1] for r in rows), tuple(r[2] for r in rows)


def peak_problem(tables: CostTables, budget: float, options: FitOptions = FitOptions(),
                 cache: dict | None = None, micro_batches: int = 1,
                 backward: bool = True) -> tuple[PeakProblem, tuple[ChoiceTable, ...]]:
    """The backward-peak problem of ``tables`` with one micro-batch (module docstring), for
    :func:`~shardplan.search.peak.solve_peak`; with ``backward`` False the additive model with the
    operators' transients (:func:`~shardplan.cost.memory.transient_bytes`) as one (every saved value and
    gradient live throughout: ``rest`` their sum, the largest transient on top; ``micro_batches`` any).

    Choices are pruned by time and the memories a backward step can
    charge them (:func:`~shardplan.cost.memory.choice_table` with ``peak``),
    and a choice is dropped when even at its own backward step, with every
    other operator at its least memory there, it exceeds the budget (exact).
    """
    cache = {} if cache is None else cache
    m = int(micro_batches) if not backward else 1
    cts = _choice_tables(tables, m, options, cache, peak=backward)
    if backward:
        low_saved = np.array([float((t.rest_bytes + t.activation_bytes).min()) for t in cts])  # before the step
        low_grad = np.array([float((t.rest_bytes + t.grad_bytes).min()) for t in cts])  # after it
    else:
        low_saved = low_grad = np.array([float(t.bytes.min()) for t in cts])
    others = (np.concatenate([[0.0], np.cumsum(low_saved)[:-1]])
              + np.concatenate([np.flip(np.cumsum(np.flip(low_grad)))[1:], [0.0]])) + options.reserve_bytes
    if all(float((t.bytes + t.transient_bytes).min()) + o <= budget for t, o in zip(cts, others)):
        cut: dict[tuple, ChoiceTable] = {}  # identical operators keep sharing one table where they keep the same
        out = []
        for t, o in zip(cts, others):
            keep = np.flatnonzero(t.bytes + t.transient_bytes + o <= budget)
            out.append(_shared(cut, (id(t), keep.tobytes()), lambda: t.take(keep)))
        cts = out
    parts: dict[int, tuple] = {}
    for t in cts:
        if id(t) not in parts:
            if backward:
                parts[id(t)] = (t.base, t.seconds, t.rest_bytes, t.activation_bytes, t.grad_bytes, t.transient_bytes)
            else:
                zero = np.zeros(len(t.base))
                parts[id(t)] = (t.base, t.seconds, t.bytes, zero, zero, t.transient_bytes)
    cols = list(zip(*(parts[id(t)] for t in cts)))
    pp = PeakProblem(cache_problem(tables, cache), *(tuple(c) for c in cols[:5]), budget, options.reserve_bytes,
                     tuple(cols[5]))
    return pp, tuple(cts)


def _host_pruned(cts: Sequence[ChoiceTable], host_budget: float) -> list[ChoiceTable]:
    """The choices that leave room in the host budget for the least host memory of every other operator
    (exact, as the device pruning); unchanged when even the least host memory exceeds it."""
    cts = list(cts)
    if not np.isfinite(host_budget) or not cts:
        return cts
    least = float(sum(_per_table(cts, lambda t: t.host_bytes.min())))
    if least > host_budget:
        return cts
    return _taken(cts, _per_table(cts, lambda t: np.arange(len(t.base)) if float(t.host_bytes.max()) + least
                                  - float(t.host_bytes.min()) <= host_budget
                                  else np.flatnonzero(t.host_bytes + (least - t.host_bytes.min()) <= host_budget)))


def _taken(cts: Sequence[ChoiceTable], keeps: Sequence[np.ndarray]) -> list[ChoiceTable]:
    """``[t.take(k) for t, k in zip(cts, keeps)]``, a table kept whole as itself, and one take per distinct
    (table, kept rows): identical operators keep sharing their arrays, so the searches that recognise equal
    vertices by identity (:mod:`shardplan.search.constrained`) compute their rows once."""
    done: dict[tuple[int, bytes], tuple[ChoiceTable, ChoiceTable]] = {}  # holds each table: ids stay unique
    out = []
    for t, k in zip(cts, keeps):
        if len(k) == len(t.base):
            out.append(t)
            continue
        key = (id(t), k.tobytes())
        if key not in done:
            done[key] = (t, t.take(k))
        out.append(done[key][1])
    return out


def host_binds(cts: Sequence[ChoiceTable], host_budget: float) -> bool:
    """Whether some plan of these choices exceeds the host budget (else the host constraint is slack)."""
    return bool(np.isfinite(host_budget) and float(sum(t.host_bytes.max() for t in cts)) > host_budget)


def solve_host_ilp(mp: MemoryProblem, cts: Sequence[ChoiceTable], host_budget: float,
                   time_limit: float) -> Solution:
    """The plan of least time within both the device budget and the host budget, by HiGHS.

    Both constraints are sums over the operators' choices, so the memory ILP of
    :mod:`shardplan.search.memory_ilp` with a second row is exact (to HiGHS's
    tolerances); the host row is scaled to the device row's right-hand side.
    Used when the host budget can bind (:func:`host_binds`): the Lagrangian
    search relaxes one constraint only.
    """
    from shardplan.search.memory_ilp import solve_rows

    least_host = float(sum(t.host_bytes.min() for t in cts))
    if least_host > host_budget:
        raise ShardplanError(_host_infeasible(least_host, host_budget))
    rhs = mp.budget - mp.fixed
    rows = [np.concatenate(mp.memory), np.concatenate([t.host_bytes for t in cts]) * (rhs / host_budget)]
    sol = solve_rows(mp, rows, time_limit)
    _, dev = mp.evaluate(sol.assignment)
    sol.stats["memory_bytes"] = dev
    sol.stats["host_bytes"] = float(sum(t.host_bytes[j] for t, j in zip(cts, sol.assignment)))
    sol.stats["status"] = "optimal" if sol.optimal else f"stopped: {sol.stats['status']}"
    return sol


def _host_infeasible(least: float, budget: float) -> str:
    from shardplan.units import fmt_bytes

    return (f"no plan fits in {fmt_bytes(budget)} of host memory per device: the least any plan needs there is "
            f"{fmt_bytes(least)} ({least:.0f} bytes)")


def cache_problem(tables: CostTables, cache: dict | None) -> Any:
    """``tables.to_problem()``, kept in ``cache`` (filled by :func:`_choice_tables`) when given."""
    if cache is not None and "problem" in cache:
        return cache["problem"]
    return tables.to_problem()


def _choice_tables(tables: CostTables, micro_batches: int, options: FitOptions, cache: dict | None,
                   peak: bool) -> list[ChoiceTable]:
    """Every operator's choice table (identical operators share one), pruned for the additive or the peak model."""
    g = tables.graph
    cache = {} if cache is None else cache
    opt = float(tables.options.get("optimizer_factor", 2.0))
    if "groups" not in cache:
        shared: dict = {}  # identical operators share their layouts (and so these)
        cache["groups"] = [_shared(shared, ("g", _key(op), id(lay)), lambda: weight_groups(op, lay, None, tables.machine))
                           for op, lay in zip(g.operators, tables.arrays)]
        cache["problem"] = tables.to_problem()
        cache["shared"] = shared
    shared = cache["shared"]
    forced = g.recomputed
    if "keep" not in cache:  # per operator: the input shares a recomputing choice keeps, and their bytes
        sh = [unsaved_inputs(op, producers_saved(g, op)) for op in g.operators]
        cache["keep"] = [(s, _shared(shared, ("k", _key(op), id(lay), s),
                                     lambda: recompute_keep_bytes(op, lay, tables.machine, s)) if any(s) else None)
                         for op, lay, s in zip(g.operators, tables.arrays, sh)]
    if "keys" not in cache:  # per operator, what identifies its table beside the count (the same for every count)
        cache["keys"] = [(_key(op), id(lay), op.name in forced, sk[0])
                         for op, lay, sk in zip(g.operators, tables.arrays, cache["keep"])]
    rules = options.rules
    return [_shared(shared, ("c", micro_batches, peak, rules, *key),
                    lambda: choice_table(op, lay, None, tables.machine, micro_batches, options.stages,
                                         options.recompute, opt, groups=wg,
                                         op_cost=oc if micro_batches == 1 else _scaled(op, lay, tables, micro_batches),
                                         in_flight=options.in_flight, accumulate=options.accumulate,
                                         forced_recompute=op.name in forced, recompute_keep=sk[1], peak=peak,
                                         rules=rules))
            for op, lay, wg, oc, sk, key in zip(g.operators, tables.arrays, cache["groups"], tables.op_costs,
                                                cache["keep"], cache["keys"])]


def _scaled(op: Operator, lay: Any, tables: CostTables, m: int) -> Any:
    """The operator's cost with every collective paying m latencies (None: :func:`choice_table` computes it);
    tables built with a ring ``context``, or a dealt attention's under the all-gather, charge the ring input's
    gradient reduction on its edge (:func:`shardplan.cost.ring.ring_operator_cost`), and so do tables on
    DTensor's machine its activations' gradients (``Machine.scatter_gathered_grads``,
    :mod:`shardplan.cost.grad_home`)."""
    from shardplan.cost.ring import gathered_applies

    context = tables.options.get("context", "allgather")
    home = tables.machine.scatter_gathered_grads
    if context == "allgather" and not gathered_applies(op, tables.machine) and not home:
        return None
    from shardplan.cost.grad_home import unfed_slots
    from shardplan.cost.memory import latency_scaled
    from shardplan.cost.ring import ring_operator_cost

    unfed = unfed_slots(tables.graph)[tables.graph.index[op.name]] if home else frozenset()
    return ring_operator_cost(op, lay, latency_scaled(tables.machine, m), context, decide=tables.machine,
                              unfed=unfed)


def solve_fit(graph: Graph, machine: Machine, *, budget: float | None = None, options: FitOptions = FitOptions(),
              tables: CostTables | None = None, cutoff: int = 4, powers_of_two: bool = False,
              divides_p: bool = True, orders: str = "auto", partial_sums: bool = False, overlap_tp: bool = False,
              context: str = "allgather", incumbent: float | None = None, work_budget: Any = None,
              **dp_options: Any):
    """The plan of least step time whose peak memory per device is within ``budget`` (default the machine's).

    ``cutoff`` (default 4, :func:`~shardplan.cost.build_tables`' own) is the
    least extent per part of a split dimension; the CLI passes the model's
    recommended one (1 for the sequence models of the zoo), and so does
    ``benchmarks/bench_fit.py``.

    Given ``tables``, the search is exact over their layouts; build them on the
    machine *without* a memory size (``replace(machine, memory_bytes=None)``), as
    this function does itself, or :func:`~shardplan.cost.build_tables` drops
    layouts whose unsharded footprint exceeds the device, some of which may fit
    with sharded state.

    Returns a :class:`~shardplan.spmd.SpmdPlan` with ``memory_choices`` set and a
    solution whose ``optimal``/``bound``/``stats["gap"]`` state what was
    proven; ``stats["per_micro_batches"]`` has each count's outcome.

    ``incumbent``: the step time of a plan known outside this space (e.g. a pipeline's). Every count's search
    is pruned against it as against a plan of its own: a count whose bound (solve-free, root or node) reaches
    it is closed. The answer is unchanged when the optimum is below it by more than 1e-9 relative
    (``stats["beats_incumbent"]`` True);
    otherwise the plan returned is the best one seen, which may be far from the optimum, its ``bound`` a
    proven lower bound of the optimum (at least the incumbent, within 1e-9, once every count is closed:
    ``stats["status"]`` "no plan below the incumbent"), and the caller keeps the incumbent's plan
    (docs/memory.md, *An incumbent from outside*).

    Ctrl-C (a :class:`KeyboardInterrupt`) once some count has a plan returns the best plan so far with
    ``stats["interrupted"]`` True and a bound that stays proven: each count's search stops as at its time
    limit, a count not searched further keeps its root bound, and one not rooted yet counts 0.

    ``work_budget``: a planning call's :class:`~shardplan.search.work.WorkBudget`. Each search gets the
    least of ``options.work_limit`` and the units the budget has left, and is charged its work when it returns
    (the solve-free count bounds one forest pass each, the choice tables per row); once the budget is spent the
    charge raises :class:`~shardplan.search.work.WorkLimitReached`, which stops the search as Ctrl-C does.

    Raises:
        ShardplanError: no budget known, or no plan fits (naming the least memory any plan needs).
        KeyboardInterrupt: Ctrl-C before any plan was found.
    """
    from shardplan.spmd import SpmdPlan

    if incumbent is not None:
        incumbent = real("solve_fit: incumbent", incumbent, positive=True, unit="s")
    outside = np.inf if incumbent is None else float(incumbent)
    if budget is None:
        budget = machine.memory_bytes
    if budget is None:
        raise ShardplanError("no memory budget: the machine has no memory size; give one (--memory GiB)")
    if not budget > 0:
        raise ShardplanError(f"memory budget must be positive, got {budget!r}")
    t0 = time.perf_counter()
    if tables is None:
        # The per-configuration memory filter of build_tables assumes unsharded state: the fit search prunes itself.
        tables = build_tables(graph, replace(machine, memory_bytes=None), cutoff=cutoff, powers_of_two=powers_of_two,
                              divides_p=divides_p, orders=orders, partial_sums=partial_sums, overlap_tp=overlap_tp,
                              context=context)
        tables = replace(tables, machine=machine)
        if work_budget is not None:
            work_budget.charge(table_work(tables), "tables")
    build_seconds = time.perf_counter() - t0
    t1 = time.perf_counter()
    best: tuple[Solution, int, tuple[ChoiceTable, ...]] | None = None
    per: list[dict[str, Any]] = []
    lower: list[float] = []  # a lower bound of each micro-batch count's optimum
    least_all = np.inf
    problems = []
    totals = {"nodes": 0, "dp_solves": 0, "work": 0.0}
    cache: dict = {}
    peak_least = False  # whether least_all is the backward-peak model's lower bound (not an exact least)
    host_budget = options.host_budget(machine)
    host_least = np.inf  # the least host memory, when only the host budget ruled a count out
    solved_by_m: dict[int, dict] = {}  # per count, the Lagrangian points its root solve found
    lams: list[float] = []  # the multipliers the roots ended at, latest first (for the solve-free bounds)
    closed: dict[int, float] = {}  # count -> its solve-free bound, for the counts it closed
    root_work = np.inf  # the least work of a root so far: a quarter of it may go to a count's solve-free bound
    pass_work = 0.0  # the most work a forest pass of the solve-free bounds has been charged
    # every stop inside the search counts work (deterministic); a wall clock only when the caller asked for one
    fixed = {"work_limit": options.work_limit, "time_limit": options.time_limit}
    interrupted = False
    charged = [0.0]  # the searches' work charged to ``work_budget`` so far

    def lim() -> dict[str, Any]:
        """The next search's limits: its own, the work no more than the planning call has left."""
        if work_budget is None:
            return fixed
        return {**fixed, "work_limit": min(options.work_limit, work_budget.left())}

    def settle(extra: float = 0.0, kind: str = "fit") -> None:
        """Charge ``work_budget`` the searches' work since the last charge, and ``extra`` units of ``kind``."""
        if work_budget is None:
            return
        done, charged[0] = totals["work"] - charged[0], totals["work"]
        work_budget.charge(done, "fit")
        if extra:
            work_budget.charge(extra, kind)
    counts = sorted({int(x) for x in options.micro_batches})
    current = counts[0]

    def target() -> float:
        """The step every count must beat: the best plan's so far, or the incumbent from outside if lower."""
        return min(outside, best[0].cost if best is not None else np.inf)

    def beaten() -> str:
        """What a closed count's bound reached, for its status line."""
        return "the incumbent" if best is None or outside <= best[0].cost else "the best plan"

    transients = any(op.transient for op in tables.graph.operators)  # a transient makes the peak a max
    try:
        for m in counts:
            current = m
            if options.backward_peak(m) or transients:  # each M_k a constraint (search.peak)
                pp, cts = peak_problem(tables, budget, options, cache, m, options.backward_peak(m))
                root_pk = _peak_root(pp, totals, {**lim(), **dp_options})
                settle(choice_work(cts), "choice_tables")
                if root_pk is None:
                    least = pp.least_peak()
                    if least < least_all:
                        least_all, peak_least = least, True
                    per.append({"micro_batches": m, "model": _model_name(options, m), "status": "infeasible",
                                "least_memory_lower_bound_bytes": least})
                    continue
                root_bound, inc = root_pk
                problems.append((root_bound, inc.cost if inc is not None else np.inf, m, pp, cts, inc))
                if inc is not None and (best is None or inc.cost < best[0].cost):
                    best = (inc, m, cts)
                continue
            mp, cts = fit_problem(tables, budget, m, options, cache)
            settle(choice_work(cts), "choice_tables")
            least = mp.least_memory()
            if least > budget:
                if least < least_all:
                    least_all, peak_least = least, False
                per.append({"micro_batches": m, "status": "infeasible", "least_memory_bytes": least})
                continue
            least_host = float(sum(_per_table(cts, lambda t: t.host_bytes.min())))
            if least_host > host_budget:
                host_least = min(host_least, least_host)
                per.append({"micro_batches": m, "status": "infeasible in host memory",
                            "least_host_bytes": least_host})
                continue
            # a bound without a solve first: a count whose bound reaches the best plan is closed (it cannot beat it)
            # (not tried once a forest pass has cost more than that share: such roots are cheap, just solve them)
            cheap = -np.inf
            if np.isfinite(target()) and pass_work <= 0.25 * root_work:
                cheap, spent = _count_bound(mp, target(), lams, 0.25 * root_work)
                pass_work = max(pass_work, spent)
                settle(spent, "count_bounds")  # (one pass: at least what the passes made cost)
            if cheap >= target():
                problems.append((cheap, np.inf, m, mp, cts, None))
                closed[m] = cheap
                continue
            # the root alone: a feasible plan and the dual bound, to order the counts and share the incumbent
            solved: dict = {}  # the root's Lagrangian points, for the full search of this count (exact reuse)
            # with the best plan so far as ``upper``, a count's dual stops as soon as its bound reaches it: the
            # count is then pruned below without the dual's remaining solves (docs/memory.md, "Work not repeated")
            root = solve_memory(mp, max_nodes=1, fix_iters=-1, solved=solved, upper=target(), **lim(),
                                **dp_options)
            totals["nodes"] += root.stats["nodes"]
            totals["dp_solves"] += root.stats["dp_solves"]
            totals["work"] += float(root.stats.get("work", 0.0))
            problems.append((max(root.bound, root.stats.get("root_bound", -np.inf)), root.cost, m, mp, cts, root))
            solved_by_m[m] = solved
            if root.stats.get("lambda", 0.0) > 0:
                lams.insert(0, float(root.stats["lambda"]))
            root_work = min(root_work, float(root.stats["work"]))
            if best is None or root.cost < best[0].cost:
                best = (root, m, cts)
            if root.stats.get("interrupted"):  # Ctrl-C inside the root, after it had a plan (kept above)
                raise KeyboardInterrupt
            settle()  # (the work budget spent: the interrupt's path, the root kept above)
    except KeyboardInterrupt:
        if best is None:
            raise
        # a count not rooted yet has no bound but 0; the rooted ones keep theirs, and no count is searched further
        interrupted = True
        rooted = {x[2] for x in problems}
        if any(x > current or (x == current and x not in rooted) for x in counts):
            lower.append(0.0)
    if not problems and best is None:
        if not np.isfinite(least_all) and np.isfinite(host_least):
            raise ShardplanError(_host_infeasible(host_least, host_budget))
        raise ShardplanError(_infeasible(least_all, budget, peak_least))
    for root_bound, root_cost, m, mp, cts, _root in sorted(problems, key=lambda x: (x[0], x[1])):
        # (the backward-peak search, which has no plan of its own without a solve, is not cut by the incumbent
        # before a plan is known)
        upper = np.inf if best is None and isinstance(mp, PeakProblem) else target()
        if m in closed:
            lower.append(root_bound)
            per.append({"micro_batches": m, "status": f"pruned: its solve-free bound reaches {beaten()}",
                        "lower_bound": root_bound, "cost": None})
            continue
        if interrupted:  # Ctrl-C: what each count's root proved stands as its bound
            lower.append(root_bound)
            per.append({"micro_batches": m, "status": "not searched: interrupted", "lower_bound": root_bound})
            continue
        if root_bound >= upper * (1 - 1e-9):
            lower.append(root_bound)
            # cost: the best plan the root saw (None when its dual reached the best plan before seeing one, or it saw none)
            seen = _root is None or _root.stats.get("found", True)
            per.append({"micro_batches": m, "status": f"pruned: its dual bound reaches {beaten()}",
                        "lower_bound": root_bound, "cost": root_cost if seen and np.isfinite(root_cost) else None,
                        **({"model": _model_name(options, m)} if isinstance(mp, PeakProblem) else {})})
            continue
        try:
            if isinstance(mp, PeakProblem):
                try:
                    sol = solve_peak(mp, **lim(), upper=upper,
                                     incumbent=None if _root is None else _root.assignment, **dp_options)
                except ShardplanError as e:  # proven infeasible, or nothing found within the limits
                    per.append({"micro_batches": m, "model": _model_name(options, m), "status": f"no plan: {e}"})
                    if "proven" not in str(e):
                        lower.append(root_bound)
                    continue
                totals["nodes"] += sol.stats["nodes"]
                totals["dp_solves"] += sol.stats["dp_solves"]
                totals["work"] += float(sol.stats.get("work", 0.0))
                per.append({"micro_batches": m, "model": _model_name(options, m), "status": sol.stats["status"],
                            "cost": sol.cost, "bound": sol.bound, "memory_bytes": sol.stats["memory_bytes"],
                            "peak_step": sol.stats["peak_step"],
                            "additive_memory_bytes": sol.stats["additive_memory_bytes"], "root_bound": root_bound,
                            "nodes": sol.stats["nodes"], "surrogate_solves": sol.stats["surrogate_solves"],
                            "cuts": sol.stats["cuts"], "dp_solves": sol.stats["dp_solves"], "work": sol.stats["work"],
                            "seconds": sol.solve_seconds})
            else:
                sol = solve_memory(mp, **lim(), upper=upper, solved=solved_by_m.get(m),
                                   **dp_options)
                totals["nodes"] += sol.stats["nodes"]
                totals["dp_solves"] += sol.stats["dp_solves"]
                totals["work"] += float(sol.stats.get("work", 0.0))
                per.append({"micro_batches": m, "status": sol.stats["status"], "cost": sol.cost, "bound": sol.bound,
                            "memory_bytes": sol.stats["memory_bytes"], "nodes": sol.stats["nodes"],
                            "dp_solves": sol.stats["dp_solves"], "fixed_choices": sol.stats["fixed_choices"],
                            "work": sol.stats["work"], "seconds": sol.solve_seconds})
        except KeyboardInterrupt:  # before this count's search saw a plan (it returns its own otherwise)
            if best is None:
                raise
            interrupted = True
            lower.append(root_bound)
            per.append({"micro_batches": m, "status": "interrupted", "lower_bound": root_bound})
            continue
        interrupted = interrupted or bool(sol.stats.get("interrupted"))
        lower.append(sol.bound if sol.bound is not None else 0.0)
        if best is None or sol.cost < best[0].cost:
            best = (sol, m, cts)
        try:
            settle()
        except KeyboardInterrupt:  # the work budget spent: this count's answer stands, no count is searched further
            interrupted = True
    if best is not None and _host_of(best[2], best[0].assignment) > host_budget:
        if interrupted:  # the host-exact search would run on: no plan within both budgets is known yet
            raise KeyboardInterrupt
        # HiGHS without a time limit unless one was asked for (it is deterministic then)
        seconds = np.inf if options.time_limit is None else options.time_limit
        best, lower = _host_exact(problems, host_budget, seconds, per)
    if best is None and np.isfinite(outside):
        # every count was closed against the incumbent before any plan was seen: a real plan to return (each
        # operator's least-memory choice, which fits), the least costly of the counts'; its bound stays proven
        best = _least_memory_plan([(m, mp, cts) for _, _, m, mp, cts, _ in problems if not isinstance(mp, PeakProblem)])
    if best is None:
        raise ShardplanError(_infeasible(least_all, budget, peak_least) if np.isfinite(least_all) else
                             "no plan fits: the backward-peak search found none (see per micro-batch count) "
                             + "; ".join(str(x["status"]) for x in per))
    sol, m, cts = best
    bound = min([sol.cost] + lower)
    optimal = bound >= sol.cost * (1 - 1e-9)
    gap = 0.0 if optimal else (sol.cost - bound) / sol.cost if sol.cost else 0.0
    beats = bool(sol.cost < outside * (1 - 1e-9))  # within 1e-9 (rounding) a tie, and a tie does not beat it
    status = ("optimal" if optimal else "no plan below the incumbent" if not beats and bound >= outside * (1 - 1e-9)
              else "stopped: see per_micro_batches")
    stats = {**sol.stats, **totals, "gap": gap, "micro_batches": m, "per_micro_batches": per,
             "grad_buffers": options.grad_buffers, "interrupted": interrupted, "status": status,
             **({"incumbent": outside, "beats_incumbent": beats} if incumbent is not None else {})}
    choices = MemoryChoices(m, float(budget), options.reserve_bytes, cts, sol.assignment,
                            backward=options.backward_peak(m), host_budget_bytes=host_budget, rules=options.rules)
    base = tuple(int(t.base[j]) for t, j in zip(cts, sol.assignment))
    final = Solution(cost=sol.cost, assignment=base, solve_seconds=time.perf_counter() - t1,
                     solver=("peak-bb" if options.backward_peak(m) or transients else
                             "memory-ilp" if sol.solver == "memory-ilp" else "memory-bb"),
                     optimal=optimal, bound=sol.cost if optimal else bound, stats=stats)
    return SpmdPlan(tables, base, final, "fit", build_seconds, memory_choices=choices)


def _least_memory_plan(counts: Sequence[tuple[int, MemoryProblem, Any]]) -> tuple[Solution, int, Any] | None:
    """Of the given (count, problem, choice tables), the plan of least step time among each count's
    least-memory assignment (every vertex's least-memory choice: within the budget whenever any plan is), as the
    search's (solution, count, tables); None when none is given."""
    best = None
    for m, mp, cts in counts:
        choices = tuple(int(np.argmin(x)) for x in mp.memory)
        cost, mem = mp.evaluate(choices)
        if best is None or cost < best[0].cost:
            best = (Solution(cost=cost, assignment=choices, solve_seconds=0.0, solver="memory-bb", optimal=False,
                             bound=None, stats={"memory_bytes": mem, "found": False}), m, cts)
    return best


def _count_bound(mp: MemoryProblem, best: float, lams: Sequence[float], work: float = np.inf,
                 evaluations: int = 12, least: int = 1) -> tuple[float, float]:
    """A lower bound of a micro-batch count's optimum without a DP solve, sought until it reaches ``best``.

    The forest bound of the count's Lagrangian problem (:func:`~shardplan.search.constrained.relaxed_bound`),
    maximised over the multiplier: first the multipliers the earlier counts' roots ended at (latest first:
    the counts share the graph and layouts, so their best multipliers are near), then, from the latest,
    doubling or halving while the bound rises, then a golden-section search on log(multiplier) between the
    best point's neighbours; at most ``evaluations`` forest passes, and past the first ``least`` only while
    the passes made have been charged less than ``work`` (the caller gives a share of a root's work: a count
    the bound cannot close still needs its root). Each pass is charged the same,
    :func:`~shardplan.search.constrained.forest_work` of the count's problem, so how many are made is a
    function of the input alone, never of the machine's speed or load. With no multiplier known (no root yet, under an incumbent from outside), the one
    pass at 0. Any multiplier gives a valid bound, so how it is sought decides the work, never the plan
    (docs/memory.md, "The one program at scale"). Returns the bound and the work one pass is charged.
    """
    from shardplan.search.constrained import _lattice_budget, relaxed_bound

    per_pass = forest_work(mp.problem)
    if not lams:
        # no multiplier known (no root yet, under an incumbent from outside; or roots whose unconstrained plan
        # fitted): the one pass at 0, the forest bound of the count's problem without the budget
        return relaxed_bound(mp, 0.0), per_pass
    seen: dict[float, float] = {}
    lattice = _lattice_budget(mp, [np.ones(k, dtype=bool) for k in mp.num_choices])

    def spent() -> bool:
        return len(seen) >= evaluations or (len(seen) >= least and len(seen) * per_pass > work)

    def at(lam: float) -> float:
        lam = lams[0] if np.isclose(lam, lams[0], rtol=1e-12, atol=0.0) else lam  # exp(log(x)) need not be x
        if lam not in seen:
            seen[lam] = -np.inf if spent() else relaxed_bound(mp, lam, lattice=lattice)
        return seen[lam]

    def done() -> tuple[float, float]:
        return max(seen.values()), per_pass

    for lam in lams:
        if at(lam) >= best:
            return done()
    # along log(lam) from the latest multiplier: the direction that rises, while it rises
    x0 = float(np.log(lams[0]))
    up, down = at(float(np.exp(x0 + np.log(2)))), at(float(np.exp(x0 - np.log(2))))
    if max(up, down) >= best:
        return done()
    step = np.log(2) if up >= down else -np.log(2)
    xs = [x0 - step, x0, x0 + step]
    while max(seen.values()) < best and not spent() and at(float(np.exp(xs[-1]))) > at(float(np.exp(xs[-2]))):
        xs.append(xs[-1] + step)
    if max(seen.values()) >= best:
        return done()
    lo, hi = sorted((xs[-3], xs[-1]))
    ratio = (np.sqrt(5) - 1) / 2
    a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    fa, fb = at(float(np.exp(a))), at(float(np.exp(b)))
    while max(seen.values()) < best and not spent():
        if fa >= fb:  # the peak is left of b
            hi, b, fb = b, a, fa
            a = hi - ratio * (hi - lo)
            fa = at(float(np.exp(a)))
        else:
            lo, a, fa = a, b, fb
            b = lo + ratio * (hi - lo)
            fb = at(float(np.exp(b)))
    return done()


def _host_of(cts: Sequence[ChoiceTable], assignment: Sequence[int]) -> float:
    return float(sum(t.host_bytes[j] for t, j in zip(cts, assignment)))


def _host_exact(problems: list, host_budget: float, time_limit: float, per: list[dict]) -> tuple[Any, list[float]]:
    """The best plan within both budgets when the search's plan (the optimum of the relaxation without the
    host budget) exceeds the host one: per micro-batch count, the ILP with both rows (:func:`solve_host_ilp`).

    Returns (best, lower bounds). A plan of the relaxation that fits the host budget needs none of this: it
    is optimal for both constraints."""
    best, lower = None, []
    for _bound, _cost, m, mp, cts, _root in problems:
        if isinstance(mp, PeakProblem):
            raise ShardplanError("the plan found exceeds the host budget, and the backward-peak search takes one "
                                 "memory only: use grad_buffers='persistent' or a larger host budget")
        if float(sum(t.host_bytes.min() for t in cts)) > host_budget:
            continue
        try:
            sol = solve_host_ilp(mp, cts, host_budget, time_limit)
        except ShardplanError as e:
            per.append({"micro_batches": m, "solver": "memory-ilp (host budget)", "status": f"no plan: {e}"})
            lower.append(_bound)
            continue
        per.append({"micro_batches": m, "solver": "memory-ilp (host budget)", "status": sol.stats["status"],
                    "cost": sol.cost, "bound": sol.bound, "memory_bytes": sol.stats["memory_bytes"],
                    "host_bytes": sol.stats["host_bytes"], "seconds": sol.solve_seconds})
        lower.append(sol.bound if sol.bound is not None else _bound)
        if best is None or sol.cost < best[0].cost:
            best = (sol, m, cts)
    return best, lower


def _infeasible(least: float, budget: float, bound_only: bool) -> str:
    """The no-plan message: the least memory, or (backward-peak model) a lower bound of it."""
    from shardplan.units import fmt_bytes

    if not bound_only:
        return infeasible_message(least, budget)
    return (f"no plan fits in {fmt_bytes(budget)} per device: under the backward-peak model every plan needs at "
            f"least {fmt_bytes(least)} ({least:.0f} bytes) at some backward step")


def _model_name(options: FitOptions, m: int) -> str:
    """The memory model a count's :class:`PeakProblem` states (the backward peak, or the additive sum with
    the operators' transients)."""
    return "backward peak" if options.backward_peak(m) else "additive + transient"


def _peak_root(pp: PeakProblem, totals: dict, dp_options: dict) -> tuple[float, Solution | None] | None:
    """A lower bound and a plan that fits (or None) for the backward-peak problem, cheaply; None when proven
    infeasible.

    The plan: the additive problem's root plan (it fits every backward step), or the surrogate's when that
    fits and is cheaper. The bound: the surrogate problem's root bound with all weight on the step where
    the additive plan peaks (the last step without one): a relaxation (:mod:`shardplan.search.peak`).
    """
    if pp.least_peak() > pp.budget:
        return None
    n = pp.problem.num_vertices
    inc = None
    add = pp.additive()
    if add.least_memory() <= add.budget:
        root = solve_memory(add, max_nodes=1, fix_iters=-1, **dp_options)
        totals["nodes"] += root.stats["nodes"]
        totals["dp_solves"] += root.stats["dp_solves"]
        totals["work"] += float(root.stats.get("work", 0.0))
        f, peak = pp.evaluate(root.assignment)
        prof = pp.profile(root.assignment)
        inc = Solution(cost=f, assignment=root.assignment, solve_seconds=root.solve_seconds, solver="memory-bb",
                       optimal=False, bound=None, stats={**root.stats, "memory_bytes": peak,
                                                         "peak_step": int(np.argmax(prof)) if n else 0})
    w = np.zeros(n)
    if n:
        w[int(inc.stats["peak_step"]) if inc is not None else n - 1] = 1.0
    sur = pp.surrogate(w)
    if sur.least_memory() > sur.budget:
        return None
    sroot = solve_memory(sur, max_nodes=1, fix_iters=-1, **dp_options)
    totals["nodes"] += sroot.stats["nodes"]
    totals["dp_solves"] += sroot.stats["dp_solves"]
    totals["work"] += float(sroot.stats.get("work", 0.0))
    f, peak = pp.evaluate(sroot.assignment)
    if peak <= pp.budget and (inc is None or f < inc.cost):
        prof = pp.profile(sroot.assignment)
        inc = Solution(cost=f, assignment=sroot.assignment, solve_seconds=sroot.solve_seconds, solver="memory-bb",
                       optimal=False, bound=None, stats={**sroot.stats, "memory_bytes": peak,
                                                          "peak_step": int(np.argmax(prof)) if n else 0})
    return float(sroot.bound if sroot.bound is not None else -np.inf), inc


def plan_with_choices(plan, stage: int | dict[str, int] = 0, recompute: bool | Sequence[str] = False,
                      micro_batches: int = 1, budget: float | None = None, name: str | None = None,
                      grad_buffers: str = "persistent", accumulate: int = 1, fp8: bool | Sequence[str] = False,
                      offload: Sequence[str] | Mapping[str, Sequence[str]] = (), master_weights: bool = False,
                      zero3_regather: bool = False, zero3_grad_allreduce: bool = False, reserve_bytes: float = 0.0,
                      host_budget_bytes: float | None = None, offer: ChoiceRules | None = None):
    """``plan``'s layouts with the memory-saving choices given by hand (a fit plan the search did not choose).

    ``stage``: one ZeRO stage for every operator with trainable weights, or
    operator name -> stage (others 0); an operator without trainable weights
    always has stage 0. ``recompute``: True for every operator, or the names
    of the operators that recompute; the operators the program itself
    recomputes (:attr:`~shardplan.ir.Graph.recomputed`) always do. Costs and memory are those of
    :func:`~shardplan.cost.memory.choice_table` (the model of this module), so
    data parallelism with FSDP, say, is ``plan_with_choices(dp_plan, 3)``.
    ``grad_buffers``: as :class:`FitOptions` (``"backward"``: the plan's memory
    is the backward-peak model's when it has one micro-batch). ``accumulate``: as :class:`FitOptions`, the
    graph is one micro-batch of a step that accumulates gradients over this many (a pipeline stage's cost per
    micro-batch), so the once-per-step collectives are charged 1/accumulate.
    ``fp8``: True for every matrix product (:func:`~shardplan.cost.memory.fp8_product`; others and a
    machine without an FP8 peak stay in the machine's precision), or the names of the operators that
    run FP8. ``offload``: parts of :data:`~shardplan.cost.memory.OFFLOADS` every operator offloads where
    it can (the optimizer state at ZeRO stages 1-3, the parameters at stage 3 with the optimizer state,
    the activations of operators that do not recompute), or operator name -> the parts that operator
    offloads, exactly (others none; what a saved plan records). ``master_weights``: the mixed-precision state
    rule (:class:`~shardplan.cost.memory.ChoiceRules`). ``zero3_regather``, ``zero3_grad_allreduce``: how a
    ZeRO-3 runtime gathers and reduces (the rules of the same names, e.g. DeepSpeed v0.3's).
    ``reserve_bytes``, ``host_budget_bytes``: as :class:`FitOptions`. ``offer``: FP8 and offload parts the
    choice tables offer beyond those taken (a search's own, so the plan's breakdown and memory list the same
    parts, zero where not taken); it changes no choice. Its ``fp8_saved_inputs``, ``fp8_params`` and
    ``fp8_scaling`` are the tables' rules.

    Raises:
        ShardplanError: an unknown stage or operator name, a bad micro-batch count, or an offload by operator
            that the operator cannot make with its other choices.
    """
    from shardplan.spmd import SpmdPlan

    tables = plan.tables
    g = tables.graph
    names = [op.name for op in g.operators]
    stages = {n: int(stage) for n in names} if isinstance(stage, int) else {n: 0 for n in names} | dict(stage)
    recs = set(names) if recompute is True else set() if recompute is False else set(recompute)
    fp8_names = set(names) if fp8 is True else set() if fp8 is False else set(fp8)
    exact: dict[str, int] | None = None  # per operator, the offload mask it must take (None: the most it can)
    if isinstance(offload, Mapping):
        exact = {n: sum(OFFLOAD_BITS[x] for x in ChoiceRules(offload=tuple(parts)).offload)
                 for n, parts in offload.items()}
        offload = tuple(x for parts in offload.values() for x in parts)
    want_off = sum(OFFLOAD_BITS[x] for x in ChoiceRules(offload=tuple(offload)).offload)
    offer = ChoiceRules() if offer is None else offer
    rules = ChoiceRules(bool(fp8_names) or offer.fp8, tuple(offload) + offer.offload, bool(master_weights),
                        bool(zero3_regather), bool(zero3_grad_allreduce), offer.fp8_saved_inputs, offer.fp8_params,
                        offer.fp8_scaling)
    unknown = sorted((set(stages) | recs | fp8_names | set(exact or ())) - set(names))
    recs |= g.recomputed
    if unknown:
        raise ShardplanError(f"plan has no operator {unknown[0]!r}")
    bad = sorted({s for s in stages.values() if s not in STAGES})
    if bad:
        raise ShardplanError(f"ZeRO stage {bad[0]!r} does not exist; choose from 0, 1, 2, 3")
    m = int(micro_batches)
    if m < 1:
        raise ShardplanError(f"micro-batch count must be a positive integer, got {micro_batches!r}")
    acc = int(accumulate)
    if acc < 1:
        raise ShardplanError(f"accumulate must be a positive integer, got {accumulate!r}")
    backward = FitOptions(micro_batches=(m,), grad_buffers=grad_buffers, accumulate=acc).backward_peak(m)
    opt = float(tables.options.get("optimizer_factor", 2.0))
    cts, choices = [], []
    for i, (op, lay, oc) in enumerate(zip(g.operators, tables.arrays, tables.op_costs)):
        shares = unsaved_inputs(op, producers_saved(g, op))
        keep = recompute_keep_bytes(op, lay, tables.machine, shares) if any(shares) else None
        ct = choice_table(op, lay, None, tables.machine, m, STAGES, True, opt, prune=False,
                          op_cost=oc if m == 1 else _scaled(op, lay, tables, m),
                          forced_recompute=op.name in g.recomputed,
                          recompute_keep=keep, accumulate=acc, rules=rules)
        mine = (ct.base == plan.assignment[i]) & (ct.recompute == (op.name in recs))
        if not np.any(mine & (ct.stage == stages[op.name])):  # an operator without trainable weights: stage 0
            mine &= ct.stage == 0
        else:
            mine &= ct.stage == stages[op.name]
        if np.any(mine & (ct.fp8 == (op.name in fp8_names))):  # not a matrix product: its own precision
            mine &= ct.fp8 == (op.name in fp8_names)
        if exact is None:
            mine &= (ct.offload & ~want_off) == 0  # of the parts asked for, the most this operator can offload
        else:
            mine &= ct.offload == exact.get(op.name, 0)
            if not np.any(mine):
                raise ShardplanError(f"operator {op.name!r} cannot offload "
                                     f"{' and '.join(offload_names(exact[op.name]))} with its other choices "
                                     f"(ZeRO stage {stages[op.name]}, recompute {op.name in recs}) on this machine")
        j = np.flatnonzero(mine)
        j = j[np.argmax([bin(int(x)).count("1") for x in ct.offload[j]])]
        cts.append(ct)
        choices.append(int(j))
    budget = float(budget if budget is not None else (tables.machine.memory_bytes or np.inf))
    reserve = real("plan_with_choices: reserve_bytes", reserve_bytes, minimum=0.0, unit="B")
    host = FitOptions(host_budget_bytes=host_budget_bytes).host_budget(tables.machine)
    mc = MemoryChoices(m, budget, reserve, tuple(cts), tuple(choices), backward=backward, host_budget_bytes=host,
                       rules=rules)
    return SpmdPlan(tables, plan.assignment, None, name or f"{plan.name}+memory", plan.build_seconds, memory_choices=mc)
