"""Stage costs from the model itself: blocks, sub-graphs, intra-stage optima, transfers between stages.

**Units and cuts.** Operators are grouped into *units* by the block prefix
of their names (``L7/ffn1`` belongs to ``L7``; consecutive operators
without a prefix, such as ``embed`` or ``ln_f, fc, softmax``, form one
unit), in the graph's order, which is topological. Stages cut only between
units. What this loses: a cut inside a block (e.g. between a layer's
attention and its MLP) is never considered; for the zoo's GPT and
Transformer, whose blocks are equal, finer cuts matter only when the
number of layers is not a multiple of the stage count. A prefix that comes
back after another unit has started is an error (the blocks would not be
contiguous).

**Intra-stage optimum.** A stage's units form a sub-graph (tensors from
earlier stages become its graph inputs); it is built at the micro-batch
size ``batch / m`` (by calling the model's builder) and solved by the
existing exact search (:func:`shardplan.solve`) on a machine of the
sub-mesh's size. The plan's cost is split into forward (a GEMM's forward
is 1/(1 + tensors with gradients) of its compute, forward partial-sum
all-reduces, half of halo/statistics/redistribution) and backward (the
rest). Memory: the plan's weight/state bytes and saved activation bytes at
its peak device. A stage is feasible when its *time-optimal* intra-stage plan
fits with its in-flight micro-batches; a slower intra-stage plan that would
fit (state sharding, recomputation) is not yet offered: the stage search is
exact over the intra-stage optima, not over memory-constrained ones. The sub-plan's gradient synchronisation is charged per
micro-batch at 1/m of the weight-gradient all-reduce (gradients are
accumulated over the m micro-batches and reduced once per step; the intra-stage
DP optimises that amortised cost, so m = 1 is exactly today's problem).
Amortising puts the step's reduction inside the 1F1B steady state, i.e. it
is not overlapped with the bubble; the exact form would add the slowest
stage's reduction once (a second max term).

**Sharing.** Each unit gets a signature (its operators' descriptions, with
producers named by relative position, not name); a segment of units is
described by its units' signatures, so identical blocks on identical
sub-meshes at the same m share one solve. With ``periodic=True``, a
segment holding a run of more than 3 identical units is costed as the
linear extension of the same segment with the run cut to 2 and 3 units
(exact when the intra-stage optimum repeats one layout per block, as it does
for the zoo's GPT; ``tests/test_pipeline_stages.py`` checks it against
direct solves).

**Transfers.** The activation crossing a cut is every tensor produced
before the cut and consumed after it (bytes at the micro-batch size). It
moves over ``min(q, q')`` parallel device pairs between sub-meshes of q and
q' devices, on the intra-node link when both stages lie in one node, else
the inter-node link: ``alpha + bytes / (min(q, q') beta)``. This is not the
per-device redistribution volume between the two stages' layouts (that
would couple neighbouring stages' intra-stage plans); it assumes the
receiving layout is spread like the sending one, as Megatron-LM's
scatter/gather of the stage output does.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

from shardplan.errors import OperatorMemoryError, ShardplanError
from shardplan.ir import Graph, Operator
from shardplan.machine import Machine
from shardplan.pipeline.search import StageCost

__all__ = ["unit_prefix", "units_of", "ModelStages"]


def unit_prefix(name: str) -> str | None:
    """The block an operator belongs to: the part of its name before the first '/', or None."""
    return name.split("/", 1)[0] if "/" in name else None


def units_of(graph: Graph) -> tuple[tuple[int, ...], ...]:
    """Operator indices per unit, in graph order (see the module docstring)."""
    units: list[list[int]] = []
    keys: list[str | None] = []
    seen: set[str] = set()
    for i, op in enumerate(graph.operators):
        key = unit_prefix(op.name)
        if units and keys[-1] == key:
            units[-1].append(i)
            continue
        if key is not None and key in seen:
            raise ShardplanError(f"block {key!r} is not contiguous in graph {graph.name!r} (operator {op.name!r}); "
                                 f"stages cut between contiguous blocks")
        if key is not None:
            seen.add(key)
        units.append([i])
        keys.append(key)
    return tuple(tuple(u) for u in units)


def _op_signature(op: Operator, where: dict[str, tuple[int, int]], unit: int) -> tuple:
    def tensor(t, ref: bool) -> tuple:
        src: Any = None
        if ref and t.src is not None:
            loc = where.get(t.src)
            src = ("input", t.src) if loc is None else (unit - loc[0], loc[1])
        return (t.name, t.shape, t.axes, t.role, t.needs_grad, t.elem_factor, t.shared, src)

    return (op.kind, op.dims, op.flops_per_point, op.norm_dims, op.norm_stats, op.recurrence, op.fixed,
            tuple(tensor(t, True) for t in op.inputs), tuple(tensor(t, False) for t in op.weights),
            tensor(op.output, False))


def weight_sync(op: Operator, configs, orders, machine: Machine):
    """Seconds of the all-reduce of ``op``'s weight gradients per configuration: (K,).

    The operator costed with and without gradients for its weights: the difference of the backward
    all-reduce time is the weights' part (the cost model's own formula, not a copy of it).
    """
    import numpy as np

    from shardplan.cost import operator_cost

    if not any(w.needs_grad for w in op.weights):
        return np.zeros(len(configs))
    frozen = replace(op, weights=tuple(replace(w, needs_grad=False) for w in op.weights))
    full = operator_cost(op, configs, machine, orders).grad_allreduce
    without = operator_cost(frozen, configs, machine, orders).grad_allreduce
    return np.maximum(full - without, 0.0)


def _forward_backward(plan) -> tuple[float, float]:
    """Split a plan's predicted seconds into forward and backward (module docstring)."""
    fwd = bwd = 0.0
    for i, op in enumerate(plan.graph.operators):
        parts = plan.tables.op_costs[i].parts(plan.assignment[i])
        share = 1.0 / (1 + len(op.grad_tensors))
        fwd += parts["compute"] * share + parts["forward_allreduce"]
        bwd += parts["compute"] * (1 - share) + parts["grad_allreduce"]
        for key in ("halo", "stats", "recurrence"):
            fwd += parts[key] / 2
            bwd += parts[key] / 2
    red = plan.breakdown["redistribution"]
    return fwd + red / 2, bwd + red / 2


@dataclass
class ModelStages:
    """Stage and link costs of a model built at any micro-batch size, for :func:`search_pipeline`.

    Attributes:
        build: ``build(batch) -> Graph`` (e.g. ``lambda b: get_model("gpt", b, layers=4)``).
        batch: the global batch; m must divide it.
        machine: the whole machine; a stage on q devices is solved on ``replace(machine, num_devices=q)``.
        solve_options: passed to :func:`shardplan.solve` (cutoff, orders, ...).
        periodic: cost long runs of identical units by linear extension (module docstring).
        strategy: instead of the intra-stage optimum, a fixed rule ``strategy(tables) -> configs`` (e.g. a
            baseline of :mod:`shardplan.baselines`), to cost a hand-made recipe under the same model.
        solves: intra-stage solves run (one per distinct segment, sub-mesh size and m).
    """

    build: Callable[[int], Graph]
    batch: int
    machine: Machine
    solve_options: dict = field(default_factory=dict)
    periodic: bool = False
    strategy: Callable[[Any], Any] | None = None
    solves: int = 0
    _graphs: dict = field(default_factory=dict, repr=False)
    _cache: dict = field(default_factory=dict, repr=False)

    def graph(self, m: int) -> tuple[Graph, tuple[tuple[int, ...], ...], tuple[int, ...]]:
        """(graph at micro-batch batch/m, its units, interned unit signatures)."""
        if self.batch % m:
            raise ShardplanError(f"{m} micro-batches do not divide the batch of {self.batch}")
        if m not in self._graphs:
            g = self.build(self.batch // m)
            units = units_of(g)
            where = {g.operators[i].name: (u, j) for u, idx in enumerate(units) for j, i in enumerate(idx)}
            intern: dict[tuple, int] = self._graphs.setdefault("intern", {})
            sigs = tuple(intern.setdefault(tuple(_op_signature(g.operators[i], where, u) for i in idx), len(intern))
                         for u, idx in enumerate(units))
            self._graphs[m] = (g, units, sigs)
        return self._graphs[m]

    @property
    def num_units(self) -> int:
        return len(self.graph(1)[1])

    def unit_names(self) -> list[str]:
        g, units, _ = self.graph(1)
        return [unit_prefix(g.operators[idx[0]].name) or ",".join(g.operators[i].name for i in idx) for idx in units]

    def subgraph(self, a: int, b: int, m: int) -> Graph:
        """The operators of units [a, b) at micro-batch batch/m, earlier stages' tensors as graph inputs."""
        g, units, _ = self.graph(m)
        ops = [g.operators[i] for u in range(a, b) for i in units[u]]
        names = {op.name for op in ops}
        inputs: dict[str, tuple[int, ...]] = {}
        for op in ops:
            for t in op.inputs:
                if t.src is not None and t.src not in names:
                    inputs[t.src] = t.shape
        return Graph(f"{g.name}[{a}:{b}]", tuple(ops), inputs)

    def _solve(self, a: int, b: int, q: int, m: int) -> StageCost:
        return self._cost_of_graph(self.subgraph(a, b, m), q, m)

    def _cost_of_graph(self, graph: Graph, q: int, m: int) -> StageCost:
        import numpy as np

        from shardplan.cost import build_tables
        from shardplan.plan import Plan, plan_from_configs
        from shardplan.search import SOLVERS

        self.solves += 1
        machine = replace(self.machine, num_devices=q)
        opts = dict(self.solve_options)
        table_opts = {k: opts.pop(k) for k in ("cutoff", "powers_of_two", "divides_p", "orders") if k in opts}
        solver = opts.pop("solver", "dp")
        tables = build_tables(graph, machine, **table_opts)
        arrays = getattr(tables, "arrays", None)  # layout arrays where the tables carry them, else splits + orders
        spaces = [(a, None) for a in arrays] if arrays is not None else list(zip(tables.configs, tables.orders))
        sync = [weight_sync(op, c, o, machine) for op, (c, o) in zip(graph.operators, spaces)]
        if self.strategy is None:
            # weight gradients are accumulated over the m micro-batches and synchronised once per step:
            # the intra-stage problem charges 1/m of their all-reduce per micro-batch
            problem = tables.to_problem()
            adjusted = tuple(np.maximum(vc - (1.0 - 1.0 / m) * w, 0.0) for vc, w in zip(problem.vertex_cost, sync))
            sol = SOLVERS[solver](replace(problem, vertex_cost=adjusted), **opts)
            plan = Plan(tables, tuple(int(x) for x in sol.assignment), sol, solver)
        else:
            plan = plan_from_configs(tables, self.strategy(tables), name="recipe")
        fwd, bwd = _forward_backward(plan)
        step_sync = float(sum(w[k] for w, k in zip(sync, plan.assignment)))
        bwd -= (1.0 - 1.0 / m) * step_sync
        mem = plan.memory
        return StageCost(fwd, bwd, mem["weights_bytes"], mem["activations_bytes"], plan)

    def stage_cost(self, a: int, b: int, q: int, m: int) -> StageCost | None:
        """Intra-stage optimum of units [a, b) on q devices with m micro-batches (None if m does not divide)."""
        if self.batch % m:
            return None
        _, _, sigs = self.graph(m)
        key = (sigs[a:b], q, m)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        run = _longest_run(sigs, a, b)
        if self.periodic and run is not None and run[1] - run[0] > 3:
            s, e = run
            c2, c3 = self.stage_cost_of_run(a, b, s, e, 2, q, m), self.stage_cost_of_run(a, b, s, e, 3, q, m)
            k = e - s
            cost = StageCost(*(x2 + (k - 2) * (x3 - x2) for x2, x3 in (
                (c2.forward, c3.forward), (c2.backward, c3.backward), (c2.weight_bytes, c3.weight_bytes),
                (c2.activation_bytes, c3.activation_bytes))), detail=c3.detail)
        else:
            try:
                cost = self._solve(a, b, q, m)
            except OperatorMemoryError:
                cost = None  # some operator cannot fit on this sub-mesh at all
        self._cache[key] = cost
        return cost

    def stage_cost_of_run(self, a: int, b: int, s: int, e: int, keep: int, q: int, m: int) -> StageCost:
        """Cost of [a, b) with its run of identical units [s, e) cut to ``keep`` units (an equal segment)."""
        # the segment [a, s + keep) + [e, b): contiguous when the suffix is empty, else the suffix is rewired
        # to read the last kept unit instead of the cut ones
        if e == b:
            got = self.stage_cost(a, s + keep, q, m)
        else:
            got = self._solve_pieces(list(range(a, s + keep)) + list(range(e, b)), q, m)
        if got is None:
            raise ShardplanError(f"units {a}..{b} cannot be costed on {q} devices")
        return got

    def _solve_pieces(self, unit_ids: list[int], q: int, m: int) -> StageCost | None:
        """Cost of the units ``unit_ids`` (ascending; one gap) as one stage, the units after the gap rewired."""
        _, _, sigs = self.graph(m)
        key = (tuple(sigs[u] for u in unit_ids), q, m, "pieces")
        if key in self._cache:
            return self._cache[key]
        g, units, _ = self.graph(m)
        ops = [g.operators[i] for u in unit_ids for i in units[u]]
        # rewire: a unit that followed the cut run now reads the last kept unit's outputs
        rename: dict[str, str] = {}
        kept = unit_ids
        for pos in range(1, len(kept)):
            if kept[pos] != kept[pos - 1] + 1:
                delta = kept[pos] - kept[pos - 1] - 1
                # producers in skipped units map to the same position `delta` units earlier
                for u in range(kept[pos - 1] + 1, kept[pos]):
                    for j, i in enumerate(units[u]):
                        src_u = u - delta
                        if 0 <= src_u < len(units) and j < len(units[src_u]):
                            rename[g.operators[i].name] = g.operators[units[src_u][j]].name
        new_ops = []
        names = {op.name for op in ops}
        for op in ops:
            ins = tuple(replace(t, src=rename.get(t.src, t.src)) if t.src in rename else t for t in op.inputs)
            new_ops.append(replace(op, inputs=ins) if ins != op.inputs else op)
        inputs: dict[str, tuple[int, ...]] = {}
        for op in new_ops:
            for t in op.inputs:
                if t.src is not None and t.src not in names:
                    inputs[t.src] = t.shape
        try:
            cost = self._cost_of_graph(Graph(f"{g.name}[pieces]", tuple(new_ops), inputs), q, m)
        except OperatorMemoryError:
            cost = None
        self._cache[key] = cost
        return cost

    def cut_bytes(self, u: int, m: int) -> float:
        """Bytes of the tensors produced before unit u and consumed from unit u on, at micro-batch batch/m."""
        g, units, _ = self.graph(m)
        unit_of = {i: k for k, idx in enumerate(units) for i in idx}
        crossing: dict[str, int] = {}
        for e in g.edges:
            if unit_of[e.src] < u <= unit_of[e.dst]:
                out = g.operators[e.src].output
                crossing[g.operators[e.src].name] = out.size
        return float(sum(crossing.values()) * self.machine.dtype_bytes)

    def link_time(self, u: int, q: int, q2: int, m: int, inter: bool) -> float:
        """One-way seconds of the activation across cut u between sub-meshes of q and q2 devices."""
        nbytes = self.cut_bytes(u, m)
        if nbytes == 0:
            return 0.0
        bw, lat = self.machine.link(inter)
        return lat + nbytes / (min(q, q2) * bw)


def _longest_run(sigs: tuple[int, ...], a: int, b: int) -> tuple[int, int] | None:
    best: tuple[int, int] | None = None
    s = a
    for i in range(a + 1, b + 1):
        if i == b or sigs[i] != sigs[s]:
            if best is None or i - s > best[1] - best[0]:
                best = (s, i)
            s = i
    return best
