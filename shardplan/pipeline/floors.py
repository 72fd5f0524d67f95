"""Solve-free lower bounds of a stage's seconds: per unit, on a sub-mesh of q devices at m micro-batches.

A stage's intra-stage optimum (time-optimal or memory-constrained) is at least the sum over its operators of each
operator's cheapest layout on q devices (the weight-gradient all-reduce and the optimizer step amortised over m as
the intra-stage search charges them; with memory choices, the cheapest choice of any layout, since a ZeRO stage
that shards the optimizer step can beat none), because every edge costs at least nothing; and at least its
device-seconds over q
(:meth:`~shardplan.pipeline.stages.ModelStages.device_seconds`). Both are sums over the stage's units, so a
stage's bound is a difference of prefix sums. Neither needs an edge table, which is what an intra-stage solve
spends most of its time on (docs/pipeline.md, *Solve-free stage bounds*).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

import numpy as np

from shardplan.errors import PerDeviceLimitError

__all__ = ["UnitFloors"]

# table options under which the vertex bound below is computed with the very layouts the tables offer; any other
# option (hand-given candidates, overlapped or ring collectives, which move cost between operators and edges)
# leaves only the device-seconds bound
_PLAIN_KEYS = ("cutoff", "powers_of_two", "divides_p", "orders", "node_replicas", "partial_sums")


class UnitFloors:
    """Per (m, q): a proven lower bound of each unit's share of any stage's seconds on q devices at m
    micro-batches (:meth:`unit`), and of a segment's (:meth:`segment`: the sum over its units).

    ``stages`` is a :class:`~shardplan.pipeline.stages.ModelStages`; its solve options decide the layouts."""

    def __init__(self, stages: Any) -> None:
        self.stages = stages
        self._pre: dict[tuple[int, int], np.ndarray] = {}
        self._pre_list: dict[tuple[int, int], list[float]] = {}  # the same prefix sums as Python floats
        self._fwd: dict[int, list[float]] = {}
        self._dev: dict[int, list[float]] = {}  # device_units
        self._ops: dict[tuple, float] = {}
        # the layouts of an operator by what they depend on (its dim names and configurations, the sub-mesh's
        # levels, the options): operators of different micro-batch sizes often share them (_arrays_of)
        self._arrays: dict[tuple, Any] = {}
        self._blocks: dict[tuple, Any] = {}  # the arrays of one configuration's layouts (_block)

    def _vertex_ok(self, q: int) -> bool:
        opts = self.stages.solve_options
        if any(k in opts for k in ("candidates", "overlap_tp")) or opts.get("context", "allgather") != "allgather":
            return False
        if self.stages.strategy is not None:
            return False  # a recipe's stage is not an optimum over the layouts, but it is still at least this
        if self.stages.machine.scatter_gathered_grads:
            # the tables move an activation gradient's all-reduce from its consumer to the input's edge, where a
            # reduce-scatter may replace it (cost/grad_home.py): the operator alone costs more than its share
            return False
        m = replace(self.stages.machine, num_devices=q)
        return m.hierarchical  # one level: the tables choose their orders from the whole graph; not replayed here

    def _op_floor(self, op: Any, q: int, m: int) -> float:
        """The least seconds of ``op`` alone on q devices over the tables' layouts, its weight-gradient all-reduce
        and optimizer step amortised over m (vertex cost less (1 - 1/m) of them, as the intra-stage search charges
        them); with memory choices, also over every choice of each layout (the least row of its choice table, once-
        per-step parts amortised alike), of which the stage's plan takes one per operator."""
        from shardplan.cost import operator_cost, operator_key
        from shardplan.pipeline.stages import weight_sync

        key = (operator_key(op), q, m)
        got = self._ops.get(key)
        if got is None:
            arr, machine = self._layouts(op, q)
            cost = operator_cost(op, arr, machine)  # (the one costing the three below share)
            sync = weight_sync(op, arr, None, machine, full=cost)
            got = float(np.min(cost.total - (1.0 - 1.0 / m) * sync))  # (never empty: the stack refuses no layouts)
            if self.stages.memory_choices:
                # a stage with memory choices may take any row of the operator's choice table (ZeRO's sharded step
                # and its reduce-scatter can beat stage 0 at the same layout): the least row over every layout
                # (one micro-batch per table: the table's own operator costing is this one)
                from shardplan.cost.memory import STAGES, choice_table

                rows = choice_table(op, arr, None, machine, 1, STAGES, True, prune=False, accumulate=m, op_cost=cost)
                got = min(got, float(rows.seconds.min()))
            self._ops[key] = got
        return got

    def _layouts(self, op: Any, q: int) -> tuple[Any, Any]:
        """The layouts the intra-stage tables offer ``op`` on q devices (as :class:`~shardplan.layout.LayoutArrays`)
        and the sub-mesh's machine (no memory limit)."""
        from shardplan.configs import layouts, with_partial
        from shardplan.layout import LayoutArrays

        opts = {k: v for k, v in self.stages.solve_options.items() if k in _PLAIN_KEYS}
        machine = replace(self.stages.machine, num_devices=q, memory_bytes=None)
        orders = opts.get("orders", "auto")
        orders = "row-major" if orders == "auto" else orders
        if opts.get("partial_sums"):
            lays = with_partial(op, layouts(op, machine.levels, opts.get("cutoff", 4), opts.get("powers_of_two", False),
                                            opts.get("divides_p", True), orders,
                                            node_replicas=opts.get("node_replicas", False)))
            return LayoutArrays.stack(lays), machine
        return self._arrays_of(op, machine.levels, opts.get("cutoff", 4), opts.get("powers_of_two", False),
                               opts.get("divides_p", True), orders, opts.get("node_replicas", False)), machine

    def _op_rows(self, op: Any, forced: bool, q: int, m: int, k: float) -> tuple[np.ndarray, np.ndarray]:
        """Every choice of ``op`` on q devices as the memory-constrained stage solve offers it (every layout, ZeRO
        stage and recomputation, unpruned; ``k`` micro-batches' activations in flight, once-per-step parts
        charged 1/m): its seconds and its bytes per device, the latter without the inputs a recomputing choice
        keeps (fewer bytes: the bound below only gets weaker)."""
        from shardplan.cost import operator_key
        from shardplan.cost.memory import STAGES, choice_table, weight_groups

        key = ("rows", operator_key(op), forced, q, m, k)
        got = self._ops.get(key)
        if got is None:
            arr, machine = self._layouts(op, q)
            rows = choice_table(op, arr, None, machine, 1, STAGES, True, prune=False,
                                groups=weight_groups(op, arr, None, machine), in_flight=k, accumulate=m,
                                forced_recompute=forced)
            got = self._ops[key] = (np.asarray(rows.seconds, dtype=float), np.asarray(rows.bytes, dtype=float))
        return got

    def memory_segment(self, a: int, b: int, q: int, m: int, k: float, budget: float) -> float:
        """A lower bound of the seconds of units [a, b) as one stage on q devices at m with ``k`` micro-batches in
        flight under ``budget`` bytes per device (:meth:`~shardplan.pipeline.stages.ModelStages.fit_cost`): the
        larger of :meth:`segment` and the Lagrangian bound of the memory-constrained solve without its edges,
        max over lambda >= 0 of sum_o min_r (seconds_o(r) + lambda bytes_o(r)) - lambda budget (weak duality:
        the solve's memory is the sum of its choices' bytes, its time the sum of its choices' seconds plus
        edges that cost >= 0; docs/pipeline.md, *A memory-aware stage bound*). Where the vertex bound is not
        replayed (see :meth:`segment`), :meth:`segment` alone. Not used by the search (measured, the same
        document)."""
        plain = self.segment(a, b, q, m)
        if not (self.stages.memory_choices and self._vertex_ok(q)) or not budget < float("inf"):
            return plain
        g, units, _ = self.stages.graph(m)
        try:
            rows = [self._op_rows(g.operators[i], g.operators[i].name in g.recomputed, q, m, k)
                    for u in range(a, b) for i in units[u]]
        except PerDeviceLimitError:
            return plain

        def dual(lam: float) -> float:
            return sum(float(np.min(sec + lam * nbytes)) for sec, nbytes in rows) - lam * budget

        # concave in lambda, so unimodal in log lambda: a ternary search; every lambda tried is a valid bound
        lo, hi = -20.0, -6.0
        best = dual(0.0)
        for _ in range(60):
            x1, x2 = lo + (hi - lo) / 3, hi - (hi - lo) / 3
            v1, v2 = dual(10.0 ** x1), dual(10.0 ** x2)
            best = max(best, v1, v2)
            if v1 < v2:
                lo = x1
            else:
                hi = x2
        return max(plain, best)

    def _arrays_of(self, op: Any, levels: tuple[int, ...], cutoff: int, powers_of_two: bool, divides_p: bool,
                   orders: str, node_replicas: bool) -> Any:
        """The :class:`~shardplan.layout.LayoutArrays` of :func:`shardplan.configs.layouts` of ``op`` on ``levels``
        with these options, from a memo.

        On more than one level the layouts depend on the operator only through its dim names and its
        :func:`~shardplan.configs.configurations` (the split factors that divide the devices): the memo's key holds
        both, so an operator of another micro-batch size whose batch dim admits the same splits takes the same
        layouts without enumerating them again (the enumeration is most of a unit bound's cost). Only the arrays
        are kept (the bound needs no layout object)."""
        from shardplan.configs import configurations, layouts
        from shardplan.layout import LayoutArrays

        levels = tuple(int(s) for s in levels)
        if len(levels) < 2:
            return LayoutArrays.stack(layouts(op, levels, cutoff, powers_of_two, divides_p, orders,
                                              node_replicas=node_replicas))
        cfg = configurations(op, int(np.prod(levels)), cutoff, powers_of_two, divides_p=True)
        key = (op.dim_names, cfg.shape, cfg.tobytes(), levels, cutoff, powers_of_two, orders, node_replicas)
        got = self._arrays.get(key)
        if got is None:
            memo, names, blocks = self._blocks, op.dim_names, []
            for c in cfg.tolist():
                c = tuple(c)
                b = memo[(levels, c, orders, node_replicas)] if (levels, c, orders, node_replicas) in memo \
                    else self._block(names, levels, c, orders, node_replicas)
                if b is not None:
                    blocks.append(b)
            if not blocks:  # (never: the all-ones configuration has a layout) the stack's own error
                return LayoutArrays.stack(())
            got = self._arrays[key] = LayoutArrays(levels, np.concatenate([b.level_splits for b in blocks], axis=1),
                                                   np.concatenate([b.level_strides for b in blocks], axis=1))
        return got

    def _block(self, names: tuple[str, ...], levels: tuple[int, ...], c: tuple[int, ...], orders: str,
               node_replicas: bool) -> Any:
        """The arrays of :func:`shardplan.configs.configuration_layouts` of the one total split ``c`` (None: no
        layout), memoised: :func:`shardplan.configs.layouts` is their concatenation over the operator's
        configurations, in order, so the stacked blocks are its arrays row for row. The arrays (splits and
        row-major strides per level) do not depend on the dim names, only on their number (``len(c)``): the
        memo's key leaves them out, so operators of other kinds, sizes and micro-batch sizes share the blocks of
        the configurations they have in common, which is where it saves the enumeration."""
        from shardplan.configs import configuration_layouts
        from shardplan.layout import LayoutArrays

        key = (levels, c, orders, node_replicas)
        if key not in self._blocks:
            lays = configuration_layouts(names, levels, c, orders, node_replicas=node_replicas)
            self._blocks[key] = LayoutArrays.stack(lays) if lays else None
        return self._blocks[key]

    def _prefix(self, q: int, m: int) -> np.ndarray:
        key = (q, m)
        pre = self._pre.get(key)
        if pre is None:
            g, units, sigs = self.stages.graph(m)
            vertex = self._vertex_ok(q)
            dev = self.device_units(m)
            vals = []
            kinds: dict[int, float] = {}  # units of one signature have the same operators: one bound per kind
            fresh = 0  # operator floors computed (one per operator of each kind), for the planning call's work
            for u, idx in enumerate(units):
                if sigs[u] not in kinds:
                    fresh += len(idx)
                    d = dev[u] / q
                    try:
                        v = sum(self._op_floor(g.operators[i], q, m) for i in idx) if vertex else 0.0
                    except PerDeviceLimitError:
                        v = 0.0  # a size whose tiles the cost model refuses: the device-seconds bound alone
                    kinds[sigs[u]] = max(d, v)
                vals.append(kinds[sigs[u]])
            pre = self._pre[key] = np.concatenate(([0.0], np.cumsum(vals)))
            budget = getattr(self.stages, "work_budget", None)
            if budget is not None:  # the planning call's work: one operator floor per operator of each kind
                from shardplan.pipeline.progress import FLOOR_OP_WORK, FLOOR_UNIT_WORK

                budget.charge(FLOOR_OP_WORK * fresh * vertex + FLOOR_UNIT_WORK * len(units), "floors")
        return pre

    def device_units(self, m: int) -> list[float]:
        """Per unit u: its device-seconds at m (:meth:`~shardplan.pipeline.stages.ModelStages.device_seconds` of
        [u, u + 1)), from a memo (one computation per unit kind and m, whatever q)."""
        return self._per_kind(self._dev, m, False)

    def chunking_lower(self, chunks: Sequence[tuple[int, int]], q: int, m: int) -> float:
        """A lower bound, as floats, of max over the ``chunks`` [a, b) of :meth:`segment` (a, b, q, m), from the
        device-seconds alone (:meth:`device_units`, no layout costed): each unit's bound in :meth:`segment` is
        the larger of its device-seconds over q and its vertex bound, so a chunk's sum of the former is at most
        its sum of the latter; the factor 1 - 8 (U + 2)^2 2^-53 covers the rounding of both sums (the prefix
        sums' difference included) when the chunks cover the U units, as a uniform pipeline's do
        (docs/pipeline.md, *Seeds*). Where (q, m)'s prefix sums are already known, the exact maximum."""
        dev = self.device_units(m)
        covers = bool(chunks) and chunks[0][0] == 0 and chunks[-1][1] == len(dev) \
            and all(x[1] == y[0] for x, y in zip(chunks, chunks[1:]))
        if (q, m) in self._pre or not covers:  # (not covering: the factor's argument does not hold)
            return max(self.segment(a, b, q, m) for a, b in chunks)
        most = 0.0
        for a, b in chunks:
            s = 0.0
            for u in range(a, b):
                s += dev[u] / q
            most = max(most, s)
        return most * (1.0 - 8.0 * (len(dev) + 2) ** 2 * 2.0 ** -53)

    def forward_units(self, m: int) -> list[float]:
        """Per unit u: its operators' forward device-seconds at m (:meth:`~shardplan.pipeline.stages.ModelStages.
        device_seconds` with ``forward``), so that any stage on q devices holding u spends at least this over q of
        its forward seconds on u (docs/pipeline.md, *ZB-H1's boxes*, *Bubble bounds*)."""
        return self._per_kind(self._fwd, m, True)

    def _per_kind(self, memo: dict[int, list[float]], m: int, forward: bool) -> list[float]:
        """Per unit u: ``device_seconds(m, u, u + 1, forward=forward)``, computed once per unit kind, kept in
        ``memo`` by m."""
        got = memo.get(m)
        if got is None:
            _, units, sigs = self.stages.graph(m)
            kinds: dict[int, float] = {}
            got = []
            for u in range(len(units)):
                if sigs[u] not in kinds:
                    kinds[sigs[u]] = self.stages.device_seconds(m, u, u + 1, forward=forward)
                got.append(kinds[sigs[u]])
            memo[m] = got
        return got

    def unit(self, q: int, m: int) -> list[float]:
        """Per unit u: a lower bound of the seconds of any stage on q devices at m that holds only u."""
        return list(np.diff(self._prefix(q, m)))

    def segment(self, a: int, b: int, q: int, m: int) -> float:
        """A lower bound of the seconds of units [a, b) as one stage on q devices at m, whatever its plan."""
        # the stage DPs ask this millions of times: Python floats, whose difference is the same IEEE double as
        # numpy's, without numpy's per-element cost
        pre = self._pre_list.get((q, m))
        if pre is None:
            pre = self._pre_list[(q, m)] = self._prefix(q, m).tolist()
        return pre[b] - pre[a]
