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
its peak device. A stage whose *time-optimal* intra-stage plan does not fit
with its in-flight micro-batches is, by default, infeasible; with
``memory_choices`` the time-optimal plan ranges over the memory choices too
(the fit without a budget: a ZeRO stage that shards the optimizer step can
beat none), and a stage where it does not fit (:meth:`ModelStages.fit_cost`)
takes its memory-constrained optimum for that in-flight count (ZeRO/FSDP,
recomputation: :func:`shardplan.fit.solve_fit`, a branch-and-bound per
stage, with the once-per-step collectives amortised over m as below), which
the search solves only for the stages its relaxation needs (the lazy
resolution of :mod:`shardplan.pipeline.search`); an interleaved device
group's chunks share one device, so they take theirs jointly
(:meth:`ModelStages.group_fit_cost`: one solve of the chunks' union with
the group's fractional in-flight count); with a ``fallback`` rule
it takes the rule's layouts when they fit (fast, not exact). The sub-plan's gradient synchronisation is charged per
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
segment [a, b) whose longest run of identical units [s, e) has k = e - s > 4
units is costed by a *certified* linear extension (below): the cost of a
real plan of the whole segment, taken only when a proven lower bound of the
optimum meets it (``periodic_certified``); otherwise the segment is solved
directly (``periodic_fallbacks``). A recipe (``strategy``: no optimum to
certify) and runs of tied units (a scan's iterations) are always solved
directly.

*The certificate.* On a segment's sub-graph G the search minimises
``F(x) = sum_v t_v(x_v) + sum_(u,v) M_uv(x_u, x_v)``: t_v an operator's cost
with its weight-gradient all-reduce charged 1/m, M_uv the redistribution of
an edge or weight edge; a tensor from outside G is a graph input, which is no
edge and costs nothing. Identical signatures give identical operator
descriptions (:func:`~shardplan.cost.operator_key`), hence the same t_v and
M_uv wherever the unit sits. The run must be a chain (:meth:`_chained`,
checked on the model's edges): each run unit after the first reads only
itself and the unit before it, each but the last is read only by itself and
the next, nothing after the segment reads the last run unit when units
follow it in the segment, and no weight edge touches the run or joins the
units before it to those after it (so each piece below keeps its owners).

* Upper bound, a real plan. G4 is the segment with the run cut to r0..r3
  (the units after the run rewired to read r3) and x4 its optimal plan. If
  x4 lays out r1 and r2 alike (operator by operator, layout X), the whole
  segment gets x4's layouts with r1 .. r(k-2) all X and r(k-1) as r3: each
  of its edges then joins the same layouts through the same matrix as an
  edge of G4 (into r1 as into r1, into r2 .. r(k-2) as into r2, from X to X,
  into r(k-1) as into r3, the rest unchanged), so
  ``F(x) = F4(x4) + (k - 4) (t of r2 + M of the edges into r2, under x4)``,
  and so do the forward/backward split, the weight-gradient part and sync
  and the per-device weight and activation bytes (summed from x4's own
  per-operator and per-edge costs, :func:`_terms`; peak device taken after).
  With memory choices t_v is the seconds of the operator's choice (its
  once-per-step parts already 1/m) and r1, r2 must also take the same
  choices, which the inserted units repeat.
  Its transfers are x4's: what the first units receive, and the gradient
  from the real consumers of the run's last unit.
* Lower bound, superadditivity. Cut the segment into consecutive pieces of
  units: the restriction of an optimal plan x* to a piece is a feasible plan
  of the piece solved alone (same operators and costs; edges from other
  pieces become graph inputs), and the edges dropped between pieces cost
  >= 0 (checked on the matrices), so ``OPT(G) >= sum OPT(piece)``, and a
  proven lower bound of each piece will do (:meth:`lower_bound`: the
  solver's bound of a direct solve, or the certificate's own). Pieces: [a,
  s + 2), runs of at most 4 units, [e - 2, b) (small, shared by every
  segment of the same kind); if these fall short, the halves [a, c), [c, b)
  with c = s + k // 2, each bounded in turn (recursively, shared).

If the lower bound is at least ``F(x) (1 - PERIODIC_RTOL)`` (1e-9: sums in
another order), x is optimal and the segment takes its cost. Among equally
good plans it may differ from the one a direct solve returns in bytes or
in the forward/backward split. When it holds: the optimum repeats one
layout per block with free edges between blocks, and the blocks that change
layout near the run's ends (next to the embedding or the head) lie inside
the end pieces. It fails where cutting leaves a piece better off than in
the chain (a block that takes another layout where its input arrives for
free, paid for by a redistribution the chain avoids); then, unless the
halves hold the ends, the segment is solved directly. The zoo's GPT (d 64,
16 layers, 2 devices, m = 1, the whole model) shows why a check is not
enough: its cut to 4 blocks keeps the embedding's layout throughout (a
switch does not pay over 4 blocks), the whole model switches its blocks to
one cheaper per block and back for the head, so the cut extended (what the
earlier check, an arithmetic progression of the cut at 2, 3, 4 blocks,
accepted) is 0.7 % above the optimum; the certificate falls back there
(tests/test_pipeline_stages.py).

**Transfers.** Exact (:meth:`ModelStages.boundary_bytes`, used by
:func:`~shardplan.pipeline.api.pipeline_solve`): the activation crossing a
cut is redistributed from the sending stage's layout to the receiving
stage's over the links that join the two sub-meshes (inside a node when both
lie in one, else across nodes), every device in parallel, with the edge
cost's per-device volume: a receiving device needs its whole input tile
(nothing of it is on its own sub-mesh), a sending device receives the
gradient of its whole output tile; ``alpha + bytes / beta`` per direction.
A stage's recv/grad bytes depend on the units next to it (which edges cross),
so segments share a solve only when their neighbouring units match too;
edges that skip a unit are not seen by that key (none in the zoo's blocks).
The older estimate :meth:`ModelStages.link_time`, ``alpha + bytes /
(min(q, q') beta)`` from the cut's total bytes, is kept for callers that
pass ``link_fn`` only.
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable

from shardplan.errors import OperatorMemoryError, PerDeviceLimitError, ShardplanError
from shardplan.ir import Graph, Operator
from shardplan.machine import Machine
from shardplan.pipeline.search import StageCost
from shardplan.pipeline.progress import GRAPH_OP_WORK, WorkLimitReached, table_work
from shardplan.search.constrained import WORK_LIMIT, solve_work

__all__ = ["unit_prefix", "units_of", "ModelStages", "graph_device_seconds"]


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
        return (t.name, t.shape, t.axes, t.role, t.needs_grad, t.elem_factor, t.owner, src)

    return (op.kind, op.dims, op.flops_per_point, op.norm_dims, op.norm_stats, op.recurrence, op.fixed, op.saved,
            op.causal, op.backward_flops, op.transient, tuple(tensor(t, True) for t in op.inputs),
            tuple(tensor(t, False) for t in op.weights),
            tensor(op.output, False))


def weight_sync(op: Operator, configs, orders, machine: Machine, full: Any = None):
    """Per configuration (K,), what a step of m micro-batches charges ``(1 - 1/m) w`` less than m times one
    micro-batch's operator cost: ``w`` = the all-reduce of ``op``'s weight gradients and its optimizer step,
    which run once per step (charged 1/m per micro-batch), less the accumulation of one micro-batch's weight
    gradients (:func:`~shardplan.cost.operator.grad_accumulation_seconds`), which runs for m - 1 of them and is
    not in the operator's cost (charged (1 - 1/m) per micro-batch). Negative where the accumulation outweighs.

    The operator costed with and without gradients for its weights: the difference of the backward
    all-reduce time is the weights' part (the cost model's own formula, not a copy of it). ``full``:
    ``operator_cost(op, configs, machine, orders)`` when the caller has it (not computed again).
    """
    import numpy as np

    from shardplan.cost import operator_cost
    from shardplan.cost.operator import grad_accumulation_seconds, optimizer_elements

    if not any(w.needs_grad for w in op.weights):
        return np.zeros(len(configs))
    frozen = replace(op, weights=tuple(replace(w, needs_grad=False) for w in op.weights))
    full = operator_cost(op, configs, machine, orders) if full is None else full
    accum = grad_accumulation_seconds(optimizer_elements(op, configs, machine.num_devices, orders), machine)
    if machine.overlap_dgrad:  # the input gradient's all-reduce hidden beside the weights' pass is not theirs
        plain = replace(machine, overlap_dgrad=False)
        with_w = operator_cost(op, configs, plain, orders).grad_allreduce
        without = operator_cost(frozen, configs, plain, orders).grad_allreduce
        return np.maximum(with_w - without, 0.0) + full.optimizer - accum
    without = operator_cost(frozen, configs, machine, orders).grad_allreduce
    return np.maximum(full.grad_allreduce - without, 0.0) + full.optimizer - accum


def _split_parts(op: Operator, parts: dict[str, float]) -> tuple[float, float, float]:
    """(forward, backward, weight-gradient) seconds of one operator's configuration: a GEMM's forward is
    1/(1 + tensors with gradients) of its compute, plus the forward partial-sum all-reduces; the backward
    the rest of the compute, the activation-gradient all-reduces and the optimizer step; halo, statistics and recurrence split
    in halves; the weight-gradient part is the forward share of compute per weight with a gradient."""
    share = 1.0 / op.passes
    half = sum(parts[key] for key in ("halo", "stats", "recurrence")) / 2
    fwd = parts["compute"] * share + parts["forward_allreduce"] + half
    bwd = parts["compute"] * (1 - share) + parts["grad_allreduce"] + half + parts.get("optimizer", 0.0)
    wgrad = parts["compute"] * share * sum(1 for w in op.weights if w.needs_grad)
    return fwd, bwd, wgrad


def _forward_backward(plan, ops: "set[int] | None" = None) -> tuple[float, float, float]:
    """Split a plan's predicted seconds into forward, backward and the backward's weight-gradient compute
    (module docstring): a GEMM's backward computes one gradient per tensor that needs one, each costing its
    forward, so the weights' share of the compute is (weights with gradients) / (1 + tensors with gradients).
    ``ops``: only these operators (by index), with the redistribution into them (an edge is charged to its
    reader, as :meth:`~shardplan.cost.CostTables.breakdown` does)."""
    fwd = bwd = wgrad = 0.0
    for i, op in enumerate(plan.graph.operators):
        if ops is not None and i not in ops:
            continue
        f, b, w = _split_parts(op, plan.tables.op_costs[i].parts(plan.assignment[i]))
        fwd, bwd, wgrad = fwd + f, bwd + b, wgrad + w
    if ops is None:
        red = plan.breakdown["redistribution"]
    else:
        a = plan.assignment
        red = float(sum(mat[a[src], a[dst]] for src, dst, mat in plan.tables.all_edges() if dst in ops))
    return fwd + red / 2, bwd + red / 2, wgrad


def _fit_parts(plan, ops: "set[int] | None", m: int, k: float, first: int, last: int,
               boundary: Callable[..., tuple[float, float]]) -> StageCost:
    """The :class:`StageCost` of a memory-constrained plan (or of its operators ``ops``): forward and backward
    as the time-optimal plan's split, plus what the memory choices add (ZeRO collectives, recomputed forwards,
    the amortised weight-gradient sync: ``plan.cost`` charges 1/m of each once-per-step collective, the operator
    costs all of it) in the backward, so forward + backward is the plan's cost; bytes with ``k`` in flight;
    ZB-H1's W pass is the weight-gradient GEMMs' compute only (their reduction, whatever its ZeRO stage, is
    left in B: the W pass is never longer than the plan's, so ZB-H1's saving is not overstated)."""
    fwd, bwd, wgrad = _forward_backward(plan, ops)
    mc = plan.memory_choices
    idx = range(len(plan.graph.operators)) if ops is None else sorted(ops)
    for i in idx:
        bwd += sum(mc.parts(i).values()) - float(plan.tables.op_costs[i].total[plan.assignment[i]])
    state = float(sum(mc.choice_tables[i].state_bytes[mc.choices[i]] for i in idx))
    act = float(sum(mc.choice_tables[i].activation_bytes[mc.choices[i]] for i in idx))
    if ops is None or 0 in ops:
        state += mc.reserve_bytes
    recv, grad = boundary(plan, m, first, last, ops=ops)
    return StageCost(fwd, bwd, state, act / k, plan, recv, grad, min(max(bwd, 0.0), wgrad))


def _proven_ratio(plan, rtol: float) -> float:
    """Proven lower bound / cost of a memory-constrained solve: its branch-and-bound prunes a node whose bound
    is within ``rtol`` of the incumbent (which only falls), so the optimum is at least cost (1 - rtol), and at
    least the solve's own bound when it stopped (work, node or time limit)."""
    sol = plan.solution
    if not sol.cost > 0:
        return 1.0
    low = sol.cost * (1.0 - rtol)
    if sol.bound is not None:
        low = min(low, float(sol.bound))
    return max(0.0, min(1.0, low / sol.cost))


def graph_device_seconds(g: Graph, machine: Machine, ops: Iterable[int] | None = None,
                         forward: bool = False) -> float:
    """A lower bound of q times the seconds of the operators ``ops`` of ``g`` (default: every one) on any q
    devices of ``machine`` under any plan: per operator, (1 + tensors with gradients) passes, each at least
    max(FLOPs / R, bytes / HBM bandwidth) over q, R the machine's achievable FLOP/s (a fused backward,
    :mod:`shardplan.cost.fused`: its own FLOPs at the fused-attention rate, and at least the inputs' and the
    output gradient's bytes; under a causal mask the FLOPs of the unmasked points only, which every split's
    busiest device carries at least 1/q of). The cost model charges each pass ``f prod_d E_d / c_d`` FLOPs per
    device with ``prod_d c_d <= q``, at R times a utilisation <= 1, under a roofline over the tiles the pass
    moves (:mod:`shardplan.cost.operator`); a tensor whose axes are all plain (no window, no stride) is read
    whole, so some device's tile of it holds at least 1/q of its elements: only such tensors are counted in the
    bytes (the output always is).

    ``forward``: each operator's bound divided by its ``passes`` instead, a lower bound of q times the
    *forward* seconds: the cost model's forward of an operator is ``1 / passes`` of its compute plus
    nonnegative terms (:func:`_split_parts`), and its compute is at least the operator's bound over q."""
    return _sum_terms(_op_terms(g, machine, range(len(g.operators)) if ops is None else ops, forward))


def _op_terms(g: Graph, machine: Machine, ops: Iterable[int], forward: bool) -> list[float]:
    """Per operator of ``ops`` (in order), its term of :func:`graph_device_seconds`. A term reads only the
    operator's dims, FLOPs, causal mask, fused backward, saved count and its tensors' shapes, axes, gradients and
    element factors: never a name, so operators equal in those fields (as in units of one signature,
    :func:`_op_signature`) have equal terms."""
    rate, bw, nbytes = machine.achievable_flops, machine.hbm_bandwidth, float(machine.dtype_bytes)
    terms = []
    for i in ops:
        op = g.operators[i]
        points = op.points
        if op.causal is not None:  # the unmasked points: S (S + 1) / 2 of S^2, whatever the split
            s_ext = op.extents[op.causal.query]
            points = points * (s_ext + 1) / (2 * s_ext)
        r = rate if op.backward_flops is None else machine.attention_flops  # a fused kernel's own rate
        seconds = op.flops_per_point * points / r
        back = (op.backward_flops * points / r if op.grad_tensors else 0.0) \
            if op.backward_flops is not None else None
        if bw is not None:
            plain = [t for t in op.inputs + op.weights
                     if all(x.window is None and x.stride == 1 for x in t.axes)]
            ins = sum(math.prod(t.shape) * t.elem_factor for t in plain)
            out = math.prod(op.output.shape) * op.output.elem_factor
            if back is None:
                seconds = max(seconds, (ins + out) * nbytes / bw)
            else:  # a fused kernel (cost/fused.py): forward inputs + saved, backward at least inputs + dO
                seconds = max(seconds, (ins + op.saved * out) * nbytes / bw)
                back = max(back, (ins + out) * nbytes / bw) if op.grad_tensors else 0.0
        here = op.passes * seconds if back is None else seconds + back  # a bias's gradient pass: >= 0
        terms.append(here / op.passes if forward else here)
    return terms


def _sum_terms(terms: Iterable[float]) -> float:
    """The terms added one by one from 0.0, left to right (the float sum :func:`graph_device_seconds` states)."""
    total = 0.0
    for x in terms:
        total += x
    return total


@dataclass
class ModelStages:
    """Stage and link costs of a model built at any micro-batch size, for :func:`search_pipeline`.

    Attributes:
        build: ``build(batch) -> Graph`` (e.g. ``lambda b: get_model("gpt", b, layers=4)``).
        batch: the global batch; m must divide it.
        machine: the whole machine; a stage on q devices is solved on ``replace(machine, num_devices=q)``.
        solve_options: passed to :func:`shardplan.solve` (cutoff, orders, ...).
        periodic: cost long runs of identical units by a certified linear extension (module docstring).
        periodic_certified, periodic_fallbacks: segments whose extension was proven optimal, and those whose
            certificate failed (solved directly).
        strategy: instead of the intra-stage optimum, a fixed rule ``strategy(tables) -> configs`` (e.g. a
            baseline of :mod:`shardplan.baselines`), to cost a hand-made recipe under the same model.
        choices: with ``strategy``, the memory choices given by hand: ``choices(plan, m) -> plan`` returns the
            rule's plan of a stage (one micro-batch of m) with its ZeRO stages and recomputation (e.g.
            :func:`shardplan.fit.plan_with_choices` with ``accumulate=m``); the stage costs what
            :meth:`fit_cost` charges for such a plan (once-per-step collectives 1/m per micro-batch).
        solves: intra-stage solves run (one per distinct segment, sub-mesh size and m).
        memory_choices: stages may take memory choices (:meth:`fit_cost`): :meth:`stage_cost` is then the
            least over the layouts and the choices (the fit without a budget, on the fit's tables, which keep
            every layout), a lower bound of every memory-constrained optimum of the stage (what the search's lazy
            resolution needs); the periodic extension then repeats a unit's layouts and choices.
        fit_rtol, fit_work_limit, fit_time_limit: the fit's relative tolerance, its work budget per stage solve
            (:attr:`shardplan.fit.FitOptions.work_limit`: counted, so the same on any machine) and its wall-clock
            limit per stage solve (None, the default: none; seconds only when asked for).
        fit_unproven: fit solves stopped by the work or time limit before their proof.
        work_budget: a planning call's :class:`~shardplan.pipeline.progress.WorkBudget` (None: none), charged
            for each graph built, each stage's tables and each stage solve (a fit solve gets at most what it has
            left); once spent, the charge raises :class:`~shardplan.pipeline.progress.WorkLimitReached`, the
            interrupt's path.
        fit_reused: fit answers taken from the same segment's solve at another in-flight count (:meth:`fit_cost`).
        refused: the sub-mesh sizes on which some stage could not be costed because its tables would need
            per-device tiles past the cost model's cap (:class:`~shardplan.errors.PerDeviceLimitError`; the
            ``max_devices`` solve option lowers the cap): q -> (the first refusal's message, the micro-batch counts
            it happened at). Such a stage is answered None, so the search leaves it out; :meth:`refused_floor`
            bounds the pipelines that hold one (docs/pipeline.md, *Sub-mesh sizes the cost model refuses*).
    """

    build: Callable[[int], Graph]
    batch: int
    machine: Machine
    solve_options: dict = field(default_factory=dict)
    periodic: bool = False
    strategy: Callable[[Any], Any] | None = None
    choices: Callable[[Any, int], Any] | None = None
    solves: int = 0
    fit_time_limit: float | None = None
    fit_work_limit: float = WORK_LIMIT
    fit_rtol: float = 1e-9
    memory_choices: bool = False
    periodic_certified: int = 0
    periodic_fallbacks: int = 0
    fit_unproven: int = 0
    fit_reused: int = 0
    refused: dict = field(default_factory=dict)
    work_budget: Any = field(default=None, repr=False, compare=False)
    _graphs: dict = field(default_factory=dict, repr=False)
    _cache: dict = field(default_factory=dict, repr=False)
    _lower: dict = field(default_factory=dict, repr=False)
    _tables: dict = field(default_factory=dict, repr=False)
    _cuts: dict = field(default_factory=dict, repr=False)

    def graph(self, m: int) -> tuple[Graph, tuple[tuple[int, ...], ...], tuple[int, ...]]:
        """(graph at micro-batch batch/m, its units, interned unit signatures)."""
        if self.batch % m:
            raise ShardplanError(f"{m} micro-batches do not divide the batch of {self.batch}")
        if m not in self._graphs:
            g = self.build(self.batch // m)
            units = units_of(g)
            where = {g.operators[i].name: (u, j) for u, idx in enumerate(units) for j, i in enumerate(idx)}
            intern: dict[tuple, int] = self._graphs.setdefault("intern", {})
            # an operator the program recomputes (a user's jax.checkpoint) saves nothing: part of its unit's kind
            sigs = tuple(intern.setdefault(tuple((_op_signature(g.operators[i], where, u),
                                                  g.operators[i].name in g.recomputed) for i in idx), len(intern))
                         for u, idx in enumerate(units))
            self._graphs[m] = (g, units, sigs)
            self._charge(GRAPH_OP_WORK * len(g.operators), "graphs")
        return self._graphs[m]

    def _charge(self, units: float, kind: str) -> None:
        """Charge the planning call's work budget, if any (raises once it is spent: the interrupt's path)."""
        if self.work_budget is not None:
            self.work_budget.charge(units, kind)

    def release(self) -> None:
        """Drop every cached stage cost, fit solve, cut and cost table (not the graphs): a search that is done with
        one micro-batch count asks for none of them again (the micro-batch size is in every stage's key), and
        whatever is asked later is solved again. The pipeline search calls it after each micro-batch count, so
        its memory holds one count's stages at a time."""
        self._cache.clear()
        self._lower.clear()
        self._cuts.clear()
        self._tables.clear()

    def device_seconds(self, m: int, a: int = 0, b: int | None = None, forward: bool = False) -> float:
        """A lower bound of q times the seconds of units [a, b) (default: the whole model) at micro-batch batch/m
        on any q devices under any plan (:func:`graph_device_seconds` over those units' operators). Each
        operator's term is computed once per unit signature (equal signatures, equal terms: :func:`_op_terms`) and
        the terms are added in the same order as that function adds them, so the float is the same."""
        g, units, sigs = self.graph(m)
        terms = self._graphs.setdefault(("terms", forward), {})
        for u in range(a, len(units) if b is None else b):
            if sigs[u] not in terms:
                terms[sigs[u]] = _op_terms(g, self.machine, units[u], forward)
        return _sum_terms(x for u in range(a, len(units) if b is None else b) for x in terms[sigs[u]])

    def step_floor(self, m: int) -> float:
        """A proven lower bound of the step of every pipeline of the model at m micro-batches (any stages,
        sub-meshes, schedule and memory choices), and of the one program at m = 1: m x
        :meth:`device_seconds` / p. Every other term of a stage's seconds is nonnegative, so a stage on q_i
        devices takes t_i >= D_i / q_i; each schedule's step is at least m t_max >= m sum_i q_i t_i / p >=
        m sum_i D_i / p (docs/pipeline.md, *Best-first parts*)."""
        return m * self.device_seconds(m) / self.machine.num_devices

    def forward_floor(self, m: int) -> float:
        """A lower bound of the largest forward seconds over the stages of every pipeline at m: the stages' sizes
        sum to p and stage i's forward takes f_i >= F_i / q_i (:meth:`device_seconds` with ``forward``), so
        max_i f_i >= sum_i q_i f_i / p >= F / p (docs/pipeline.md, *ZB-H1's boxes*)."""
        return self.device_seconds(m, forward=True) / self.machine.num_devices

    @property
    def num_units(self) -> int:
        return len(self.graph(1)[1])

    def unit_names(self) -> list[str]:
        g, units, _ = self.graph(1)
        return [unit_prefix(g.operators[idx[0]].name) or ",".join(g.operators[i].name for i in idx) for idx in units]

    def subgraph(self, a: int, b: int, m: int) -> Graph:
        """The operators of units [a, b) at micro-batch batch/m, earlier stages' tensors as graph inputs, and
        the graph's ties (a scan's iterations, one layout for their stacked parameter) restricted to them: a
        stage holds its own slice of a stacked parameter, so copies in different stages are not tied. The
        operators the program recomputes (a user's ``jax.checkpoint``) stay recomputed (:meth:`Graph.derive`)."""
        return self.subgraph_of(((a, b),), m)

    def solve_stage(self, a: int, b: int, q: int, m: int) -> StageCost:
        """The intra-stage optimum of units [a, b) on q devices at m micro-batches, solved now on its own
        sub-graph (no sharing, no periodic extension): its :class:`~shardplan.spmd.SpmdPlan` is ``.detail``."""
        return self._cost_of_graph(self.subgraph(a, b, m), q, m, a, b - 1)

    def _tie_key(self, a: int, b: int, m: int) -> tuple:
        """The ties inside units [a, b) by position (unit offset, operator index): part of a segment's
        description for sharing a solve (empty for graphs without ties)."""
        g, units, _ = self.graph(m)
        if not g.ties:
            return ()
        pos = {g.operators[i].name: (u - a, j) for u in range(a, b) for j, i in enumerate(units[u])}
        return tuple(sorted(tuple(pos[n] for n in grp if n in pos) for grp in g.ties
                            if sum(n in pos for n in grp) > 1))

    def _boundary(self, m: int) -> tuple[dict[str, int], dict[str, list[tuple[int, int]]]]:
        """Unit of every operator name, and every operator's consumers (operator index, slot), at batch/m."""
        key = ("boundary", m)
        if key not in self._cuts:
            g, units, _ = self.graph(m)
            unit = {g.operators[i].name: u for u, idx in enumerate(units) for i in idx}
            users: dict[str, list[tuple[int, int]]] = {}
            for e in g.edges:
                users.setdefault(g.operators[e.src].name, []).append((e.dst, e.slot))
            self._cuts[key] = (unit, users)
        return self._cuts[key]

    def boundary_bytes(self, plan, m: int, first: int, last: int, rename: dict[str, str] | None = None,
                       ops: "set[int] | None" = None) -> tuple[float, float]:
        """(recv, grad) bytes per device of a stage whose units run from ``first`` to ``last``: per edge from an
        earlier unit, the largest input tile one of its devices needs under ``plan``; per edge to a later unit
        (whose input needs a gradient), the largest output tile one of its devices holds. Summed over edges,
        as the edge cost charges each edge (:mod:`shardplan.cost.edge`, with nothing held on the other
        sub-mesh). ``rename``: plan operators standing for others of the model (an identical unit elsewhere),
        whose consumers are the ones that count. ``ops``: only these operators of the plan (one chunk of a
        device group's joint plan)."""
        from shardplan.cost.tiles import tile_volumes

        g = self.graph(m)[0]
        unit, users = self._boundary(m)
        graph, tables = plan.graph, plan.tables
        recv = grad = 0.0
        for i, op in enumerate(graph.operators):
            if ops is not None and i not in ops:
                continue
            early = [t for t in op.inputs if t.src is not None and unit.get(t.src, first) < first]
            real = op.name if rename is None else rename.get(op.name, op.name)
            later = [(d, slot) for d, slot in users.get(real, ()) if unit[g.operators[d].name] > last]
            if not early and not later:
                continue
            lay = tables.arrays[i].take([plan.assignment[i]])
            for t in early:
                recv += float(tile_volumes(op, t, lay).max()) * t.elem_factor
            for d, slot in later:
                t_in = g.operators[d].inputs[slot]
                if t_in.needs_grad:
                    grad += float(tile_volumes(op, op.output, lay).max()) * t_in.elem_factor
        nbytes = float(self.machine.dtype_bytes)
        return recv * nbytes, grad * nbytes

    def exchange_time(self, nbytes: float, inter: bool) -> float:
        """Seconds for every device of a sub-mesh to receive ``nbytes`` from the neighbouring one, all in
        parallel, over the inter-node links (``inter``) or those inside the node: ``alpha + bytes / beta``."""
        bw, lat = self.machine.link(inter)
        return lat + nbytes / bw

    def _table_cache(self, q: int) -> dict:
        """The cost-table cache of sub-meshes of q devices: operators and edges recur across segments (and
        micro-batch sizes differ in the operators' dims, hence in their keys); with memory choices, the fit's
        unfiltered tables."""
        return self._tables.setdefault((q, "fit") if self.memory_choices and self.strategy is None else q, {})

    def _weight_syncs(self, tables, q: int) -> list:
        """Per operator of ``tables`` (built on q devices), :func:`weight_sync` of each layout, cached by key and
        by the tables' resolved orders ("auto" offers an operator more layouts in a small graph than in a large
        one: its key alone does not decide its layouts)."""
        from shardplan.cost import operator_key

        machine = replace(self.machine, num_devices=q)
        syncs = self._table_cache(q).setdefault("weight_sync", {})
        out = []
        for op, arr in zip(tables.graph.operators, tables.arrays):
            key = (tables.options.get("orders"), operator_key(op))
            if key not in syncs:
                syncs[key] = weight_sync(op, arr, None, machine)
            out.append(syncs[key])
        return out

    def _cost_of_graph(self, graph: Graph, q: int, m: int, first: int = 0, last: int = 0) -> StageCost:
        import numpy as np

        from shardplan.cost import build_tables
        from shardplan.spmd import SpmdPlan, plan_from_configs
        from shardplan.search import SOLVERS

        if self.memory_choices and self.strategy is None:
            # the time-optimal stage over the layouts and the memory choices: the fit without a budget (a real plan
            # with its choices; every memory-constrained optimum of the stage costs at least this)
            plan = self._solve_fit(graph, q, m, 1, NO_BUDGET)
            if plan is None:
                raise OperatorMemoryError(f"no plan of {graph.name!r} on {q} devices")
            return _fit_parts(plan, None, m, 1, first, last, self.boundary_bytes)
        self.solves += 1
        machine = replace(self.machine, num_devices=q)
        opts = dict(self.solve_options)
        table_opts = {k: opts.pop(k) for k in ("cutoff", "powers_of_two", "divides_p", "orders", "node_replicas",
                                               "candidates", "partial_sums", "overlap_tp", "context", "max_devices")
                      if k in opts}
        solver = opts.pop("solver", "dp")
        cache = self._table_cache(q)
        tables = build_tables(graph, machine, cache=cache, **table_opts)
        self._charge(table_work(tables, self._tables.setdefault(("charged", q), {})), "tables")
        sync = self._weight_syncs(tables, q)
        if self.strategy is None:
            # weight gradients are accumulated over the m micro-batches and synchronised once per step:
            # the intra-stage problem charges 1/m of their all-reduce per micro-batch
            problem = tables.to_problem()
            adjusted = tuple(np.maximum(vc - (1.0 - 1.0 / m) * w, 0.0) for vc, w in zip(problem.vertex_cost, sync))
            sol = SOLVERS[solver](replace(problem, vertex_cost=adjusted), **opts)
            self._charge(solve_work(problem), "stage_solves")
            plan = SpmdPlan(tables, tuple(int(x) for x in sol.assignment), sol, solver)
        else:
            plan = plan_from_configs(tables, self.strategy(tables), name="recipe")
            if self.choices is not None:
                return _fit_parts(self.choices(plan, m), None, m, 1, first, last, self.boundary_bytes)
        fwd, bwd, wgrad = _forward_backward(plan)
        step_sync = float(sum(w[k] for w, k in zip(sync, plan.assignment)))
        bwd -= (1.0 - 1.0 / m) * step_sync
        mem = plan.memory
        recv, grad = self.boundary_bytes(plan, m, first, last)
        # ZB-H1's W pass: the weight-gradient GEMMs and their (amortised) reduction; the sync nets out one
        # micro-batch's gradient accumulation (weight_sync), which may leave less than the GEMMs: never below 0
        w_pass = min(bwd, max(wgrad + step_sync / m, 0.0))
        return StageCost(fwd, bwd, mem["weights_bytes"], mem["activations_bytes"], plan, recv, grad, w_pass)

    def _refuse(self, q: int, m: int, error: PerDeviceLimitError) -> None:
        """Record that a stage on q devices at m could not be costed (:attr:`refused`)."""
        _, ms = self.refused.setdefault(q, (str(error), set()))
        ms.add(m)

    def refused_floor(self) -> float | None:
        """A proven lower bound of the step of every pipeline that holds a stage the cost model refused (None:
        none was refused): the least :meth:`step_floor` over the micro-batch counts at which a refusal happened.
        The step floor bounds every pipeline at m whatever its stages (docs/pipeline.md, *Best-first parts*), so
        the least of the search's bound and this one is a proven bound of the whole space, the refused stages
        included."""
        ms = sorted({m for _, got in self.refused.values() for m in got})
        return min(self.step_floor(m) for m in ms) if ms else None

    def refused_line(self) -> str | None:
        """The sub-mesh sizes on which some stage was refused, and why, in one line (None: none)."""
        if not self.refused:
            return None
        qs = sorted(self.refused)
        shown = ", ".join(map(str, qs[:4])) + (f", ... {qs[-1]}" if len(qs) > 4 else "")
        why = self.refused[qs[0]][0]
        return (f"{len(qs)} sub-mesh size{'s' if len(qs) > 1 else ''} ({shown}) not searched for the stages that "
                f"need per-device tiles: {why}")

    def stage_cost(self, a: int, b: int, q: int, m: int) -> StageCost | None:
        """Intra-stage optimum of units [a, b) on q devices with m micro-batches (None if m does not divide, if
        some operator cannot fit on q devices, or if the cost model refuses the stage's tables on q devices:
        :attr:`refused` records that). With :attr:`memory_choices`, the optimum over the layouts and the memory
        choices without a budget (a plan with its choices, whatever its bytes)."""
        if self.batch % m:
            return None
        key = self._stage_key(a, b, q, m)
        if key in self._cache:
            return self._cache[key]
        try:
            return self._stage_cost(a, b, q, m, key)
        except PerDeviceLimitError as e:
            self._refuse(q, m, e)
            self._lower[key] = None
            self._cache[key] = None
            return None

    def _stage_cost(self, a: int, b: int, q: int, m: int, key: tuple) -> StageCost | None:
        ties = key[-1]
        sigs = self.graph(m)[2]
        run = _longest_run(sigs, a, b)
        cost = lower = None
        # a recipe is not an optimum (no certificate), and tied blocks take one layout (their cost is a minimum of
        # functions affine in the run's length): both are solved directly
        if self.periodic and self.strategy is None and run is not None and run[1] - run[0] > 4 and not ties:
            got = self._certified(a, b, run[0], run[1], q, m)
            if got is None:
                self.periodic_fallbacks += 1
            else:
                cost, lower = got
                self.periodic_certified += 1
        if cost is None:
            try:
                cost = self.solve_stage(a, b, q, m)
            except OperatorMemoryError:
                cost = None  # some operator cannot fit on this sub-mesh at all
            lower = _proven_lower(cost)
        self._lower[key] = lower
        self._cache[key] = cost
        return cost

    def _stage_key(self, a: int, b: int, q: int, m: int) -> tuple:
        """What decides a segment's stage cost: its units' signatures and their neighbours' (the neighbouring
        units decide the transfers, :meth:`boundary_bytes`), q, m and the ties inside it."""
        _, _, sigs = self.graph(m)
        return (sigs[a - 1] if a > 0 else None, sigs[a:b], sigs[b] if b < len(sigs) else None, q, m,
                self._tie_key(a, b, m))

    def lower_bound(self, a: int, b: int, q: int, m: int) -> float | None:
        """A proven lower bound of the objective the intra-stage search minimises for units [a, b) (seconds per
        micro-batch, the weight-gradient sync amortised over m): the solver's own bound for a direct solve
        (its optimum for the exact solvers), the certificate's for a periodic extension (module docstring);
        None for a recipe, a solver that proves nothing, or a segment that cannot be costed."""
        key = self._stage_key(a, b, q, m)
        if key not in self._lower and self.stage_cost(a, b, q, m) is None:
            return None
        return self._lower.get(key)

    def _links(self, m: int) -> tuple[tuple[frozenset, ...], tuple[int, ...], tuple[tuple[int, int], ...]]:
        """Per unit, the unit offsets of the edges into it and the farthest unit offset of the edges out of it
        (0 if none), and every weight edge as (owner's unit, reader's unit), at micro-batch batch/m."""
        key = ("links", m)
        if key not in self._cuts:
            g, units, _ = self.graph(m)
            unit_of = [0] * len(g.operators)
            for u, idx in enumerate(units):
                for i in idx:
                    unit_of[i] = u
            back: list[set[int]] = [set() for _ in units]
            reach = [0] * len(units)
            for e in g.edges:
                su, du = unit_of[e.src], unit_of[e.dst]
                back[du].add(du - su)
                reach[su] = max(reach[su], du - su)
            weights = tuple((unit_of[e.src], unit_of[e.dst]) for e in g.weight_edges)
            self._cuts[key] = (tuple(frozenset(x) for x in back), tuple(reach), weights)
        return self._cuts[key]

    def _chained(self, a: int, b: int, s: int, e: int, m: int) -> bool:
        """Whether the run [s, e) of segment [a, b) is a chain the certificate covers (module docstring): every
        run unit after the first reads only itself and the unit before it; every run unit but the last is read
        only by itself and the unit after it; if units follow the run in the segment, the last run unit is read
        by none after the segment; no weight edge touches the run or joins the units before it to those after."""
        back, reach, weights = self._links(m)
        if any(not back[u] <= {0, 1} for u in range(s + 1, e)) or any(reach[u] > 1 for u in range(s, e - 1)):
            return False
        if e < b and e - 1 + reach[e - 1] >= b:
            return False
        for su, du in weights:
            if s <= su < e or s <= du < e:
                return False
            if (a <= su < s and e <= du < b) or (e <= su < b and a <= du < s):
                return False
        return True

    def _cut_plan(self, a: int, b: int, s: int, e: int, q: int, m: int) -> StageCost | None:
        """The intra-stage optimum of [a, b) with its run [s, e) cut to 4 units, with a plan over exactly those
        units' operators, in their order (a shared solve may name the same operators of another position);
        None if it cannot be costed. Where [a, s + 4) was itself costed by extension (a longer run before
        this one), its plan covers fewer operators: the cut segment is then solved directly."""
        g, units, _ = self.graph(m)
        try:
            cut = self.stage_cost_of_run(a, b, s, e, 4, q, m)
        except ShardplanError:
            return None
        size = sum(len(units[u]) for u in [*range(a, s + 4), *range(e, b)])
        if cut.detail is not None and len(cut.detail.graph.operators) == size:
            return cut
        if e < b:  # the rewired cut segment is always solved directly: this cannot happen
            return None
        key = ("cut", self._stage_key(a, s + 4, q, m))
        if key not in self._cache:
            try:
                self._cache[key] = self.solve_stage(a, s + 4, q, m)
            except OperatorMemoryError:
                self._cache[key] = None
        return self._cache[key]

    def _certified(self, a: int, b: int, s: int, e: int, q: int, m: int) -> tuple[StageCost, float] | None:
        """The stage cost of [a, b), whose run of identical units [s, e) has k = e - s > 4 units, by the certified
        extension (module docstring), and the proven lower bound of its objective; None where the certificate
        fails (the caller solves the segment directly)."""
        if not self._chained(a, b, s, e, m):
            return None
        cut = self._cut_plan(a, b, s, e, q, m)
        if cut is None or cut.detail is None or cut.detail.solution is None:
            return None
        plan = cut.detail
        _, units, _ = self.graph(m)
        n = len(units[s])
        r1 = sum(len(units[u]) for u in range(a, s)) + n  # first operator of the second run unit in the cut plan
        x = plan.assignment
        if any(x[i] != x[i + n] for i in range(r1, r1 + n)):
            return None  # the two interior run units differ: no repeating unit to insert
        if plan.memory_choices is not None and any(_row(plan, i) != _row(plan, i + n) for i in range(r1, r1 + n)):
            return None  # the same layouts, other memory choices
        terms = self._cut_terms(plan, r1 + n, n, q, m)
        if terms is None:
            return None
        full = terms[0].plus(terms[1], e - s - 4)
        lower = self._pieces_bound(a, b, s, e, q, m, full.objective)
        if lower is None:
            return None
        grad = cut.grad_bytes
        if e == b:
            # the cut plan ends on a copy of the run's last unit: the consumers that count are the real last's.
            # Its operators, by position, stand for units a .. s + 2 and then the run's last unit b - 1 (a shared
            # solve names those of another position with the same description)
            g = self.graph(m)[0]
            real = [g.operators[i].name for u in [*range(a, s + 3), b - 1] for i in units[u]]
            rename = {op.name: name for op, name in zip(plan.graph.operators, real)}
            grad = self.boundary_bytes(plan, m, a, b - 1, rename)[1]
        return _stage_of(full, m, plan, cut.recv_bytes, grad), lower

    def _cut_terms(self, plan, first: int, n: int, q: int, m: int) -> tuple[_Terms, _Terms] | None:
        """The cut plan's :class:`_Terms` over all its operators and over the n from ``first`` (the unit to
        repeat), cached per plan (segments of one kind share their cut's solve); None if some edge of the plan
        could cost < 0 (the lower bound drops edges)."""
        key = ("terms", id(plan), first, n)
        if key not in self._cuts:
            checked = self._table_cache(q).setdefault("edges_nonnegative", set())
            ok = True
            for _, _, mat in plan.tables.all_edges():
                if id(mat) not in checked:
                    if not float(mat.min()) >= 0.0:
                        ok = False
                        break
                    checked.add(id(mat))
            sync = self._weight_syncs(plan.tables, q) if plan.memory_choices is None else None
            self._cuts[key] = (plan, (_terms(plan, range(len(plan.assignment)), sync, m),
                                      _terms(plan, range(first, first + n), sync, m)) if ok else None)
        return self._cuts[key][1]

    def _pieces_bound(self, a: int, b: int, s: int, e: int, q: int, m: int, upper: float) -> float | None:
        """A proven lower bound of the objective of [a, b) (run [s, e), k = e - s > 4 units) that meets
        ``upper`` (to PERIODIC_RTOL), or None: the sum of the pieces' own lower bounds (:meth:`lower_bound`),
        first for the short pieces [a, s + 2), runs of at most 4 units, [e - 2, b) (each solved once per
        (q, m) and shared), then for the two halves [a, c), [c, b) with c = s + k // 2 (the transients at both
        ends inside a piece, module docstring)."""
        short = [(a, s + 2), *((u, min(u + 4, e - 2)) for u in range(s + 2, e - 2, 4)), (e - 2, b)]
        c = s + (e - s) // 2
        for pieces in (short, [(a, c), (c, b)]):
            lower = 0.0
            for lo, hi in pieces:
                piece = self.lower_bound(lo, hi, q, m)
                if piece is None:
                    return None
                lower += piece
            if lower >= upper - PERIODIC_RTOL * abs(upper):
                return lower
        return None

    def _solve_fit(self, graph: Graph, q: int, m: int, k: float, budget: float):
        """The fit search (:func:`shardplan.fit.solve_fit`) on ``graph`` at q devices under ``budget`` with ``k``
        micro-batches' activations in flight and once-per-step collectives amortised over m; the fit's own
        tables (no per-layout memory filter: the fit search prunes itself). None if nothing fits; a solve
        stopped before its proof is counted in ``fit_unproven``; one stopped by Ctrl-C raises KeyboardInterrupt
        (the fit search returns its best plan on Ctrl-C, which would leave the pipeline search running)."""
        from shardplan.cost import build_tables
        from shardplan.fit import FitOptions, solve_fit

        machine = replace(self.machine, num_devices=q, memory_bytes=None if budget >= NO_BUDGET else budget)
        opts = dict(self.solve_options)
        table_opts = {x: opts.pop(x) for x in ("cutoff", "powers_of_two", "divides_p", "orders", "node_replicas",
                                             "partial_sums", "overlap_tp", "context", "max_devices") if x in opts}
        cache = self._tables.setdefault((q, "fit"), {})
        tables = replace(build_tables(graph, replace(machine, memory_bytes=None), cache=cache, **table_opts),
                         machine=machine)
        self._charge(table_work(tables, self._tables.setdefault(("charged", q, "fit"), {})), "tables")
        self.solves += 1
        try:
            plan = solve_fit(graph, machine, budget=budget, tables=tables,
                             options=FitOptions(micro_batches=(1,), in_flight=k, accumulate=m,
                                                work_limit=self.fit_work_limit, time_limit=self.fit_time_limit),
                             rtol=self.fit_rtol, work_budget=self.work_budget)
        except PerDeviceLimitError:
            raise  # not "nothing fits": the caller records the refusal
        except ShardplanError:
            return None
        if plan.solution.stats.get("interrupted"):
            # Ctrl-C landed in this stage's search, which kept its best plan; the user stopped the whole search,
            # so the interrupt goes on to the pipeline search (its best plan and proven bound), not this stage's;
            # when the call's work budget stopped it, as that (the planner tells a spent budget from a Ctrl-C)
            raise WorkLimitReached if self.work_budget is not None and self.work_budget.stopped else KeyboardInterrupt
        if not plan.solution.optimal:
            self.fit_unproven += 1
        return plan

    def fit_cost(self, a: int, b: int, q: int, m: int, k: int, budget: float) -> StageCost | None:
        """The memory-constrained intra-stage optimum of units [a, b) on q devices with ``k`` micro-batches in
        flight under ``budget`` bytes per device: the memory choices (:func:`shardplan.fit.solve_fit`: ZeRO
        stages 1-3 / FSDP per operator, recomputation) on the stage's sub-graph at micro-batch batch/m. None
        if nothing fits. Its seconds are the fit plan's per micro-batch, with the collectives that run once per
        step (ZeRO-0's all-reduce, ZeRO-1's reduce-scatter and gather, ZeRO-2's gather) charged 1/m per
        micro-batch as :meth:`stage_cost` charges the weight-gradient all-reduce (``FitOptions.accumulate``),
        and :meth:`stage_cost` is the same search without a budget, so the time-optimal stage is a lower
        bound of this one (what the pipeline search's lazy resolution relies on, and checks). A fit solve stopped by its work or time limit before its proof is
        counted in ``fit_unproven``. ``lower`` is the solve's proven lower bound (cost (1 - fit_rtol), or its
        bound when stopped early). ZB-H1's W pass of such a stage is its weight-gradient GEMMs' compute
        (:func:`_fit_parts`)."""
        if self.batch % m:
            return None
        _, _, sigs = self.graph(m)
        key = (sigs[a - 1] if a > 0 else None, sigs[a:b], sigs[b] if b < len(sigs) else None, q, m, "fit", k,
               budget, self._tie_key(a, b, m))
        if key in self._cache:
            return self._cache[key]
        try:
            return self._fit_cost(a, b, q, m, k, budget, key)
        except PerDeviceLimitError as e:
            self._refuse(q, m, e)
            self._cache[key] = None
            return None

    def _fit_cost(self, a: int, b: int, q: int, m: int, k: int, budget: float, key: tuple) -> StageCost | None:
        family = self._cache.setdefault(key[:6] + key[7:], {})  # this segment's solves at other in-flight counts
        known = _from_other_in_flight(family, k, budget, self.stage_cost(a, b, q, m), self.fit_rtol)
        if known is not False:
            self._cache[key] = family[k] = known
            self.fit_reused += 1
            return known
        plan = self._solve_fit(self.subgraph(a, b, m), q, m, int(k), budget)
        if plan is None:
            cost = None
        else:
            cost = _fit_parts(plan, None, m, k, a, b - 1, self.boundary_bytes)
            # proven: the solve's bound, and the time-optimal stage (the same choices without the budget)
            plain = self.stage_cost(a, b, q, m)
            low = max(cost.time * _proven_ratio(plan, self.fit_rtol), plain.time if plain is not None else 0.0)
            cost = replace(cost, lower=min(low, cost.time))
        self._cache[key] = family[k] = cost
        return cost

    def subgraph_of(self, chunks: tuple[tuple[int, int], ...], m: int) -> Graph:
        """The operators of the unit ranges ``chunks`` (ascending, disjoint) as one graph: what one device group
        of the interleaved schedule holds. Tensors from outside the ranges are graph inputs; the graph's ties
        and recomputed operators are restricted to these operators, as in :meth:`subgraph`."""
        g, units, _ = self.graph(m)
        label = ",".join(f"{a}:{b}" for a, b in chunks)
        return g.derive((g.operators[i] for a, b in chunks for u in range(a, b) for i in units[u]),
                        f"{g.name}[{label}]")

    def group_fit_cost(self, chunks: tuple[tuple[int, int], ...], q: int, m: int, k: float,
                       budget: float) -> tuple[StageCost, ...] | None:
        """The memory-constrained optimum of one device group of the interleaved schedule: its chunks (unit
        ranges, each on the group's q devices) jointly under ``budget`` bytes per device with ``k`` (possibly
        fractional) of the group's per-micro-batch activations in flight, i.e. least ``sum_j t_j`` subject to
        ``sum_j weights_j + k sum_j activations_j <= budget`` (the interleaved schedule's memory model,
        :func:`~shardplan.pipeline.schedule.in_flight`), with the choices of :meth:`fit_cost`, in one exact
        solve of the chunks' union (:meth:`subgraph_of`; the chunks share no edge, so the union's cost and bytes
        are the chunks' sums). Returns one :class:`StageCost` per chunk (the joint plan restricted to its
        operators, its ``detail`` the group's plan; ``lower`` shares the solve's proven bound in proportion), or
        None if nothing fits."""
        if self.batch % m:
            return None
        _, _, sigs = self.graph(m)
        key = (tuple((sigs[a - 1] if a > 0 else None, sigs[a:b], sigs[b] if b < len(sigs) else None,
                      self._tie_key(a, b, m)) for a, b in chunks), q, m, "group-fit", float(k), budget)
        if key in self._cache:
            return self._cache[key]
        try:
            out = self._group_fit_cost(chunks, q, m, k, budget)
        except PerDeviceLimitError as e:
            self._refuse(q, m, e)
            out = None
        self._cache[key] = out
        return out

    def _group_fit_cost(self, chunks: tuple[tuple[int, int], ...], q: int, m: int, k: float,
                        budget: float) -> tuple[StageCost, ...] | None:
        _, units, _ = self.graph(m)
        plan = self._solve_fit(self.subgraph_of(chunks, m), q, m, float(k), budget)
        if plan is None:
            return None
        ratio = _proven_ratio(plan, self.fit_rtol)
        plain = [self.stage_cost(a, b, q, m) for a, b in chunks]
        if plan.solution.cost > 0 and all(c is not None for c in plain):
            # the time-optimal chunks are a lower bound too (the same choices without the budget; no shared edge)
            ratio = min(1.0, max(ratio, sum(c.time for c in plain) / plan.solution.cost))  # type: ignore[union-attr]
        parts, start = [], 0
        for a, b in chunks:
            n_ops = sum(len(units[u]) for u in range(a, b))
            c = _fit_parts(plan, set(range(start, start + n_ops)), m, k, a, b - 1, self.boundary_bytes)
            parts.append(replace(c, lower=c.time * ratio))
            start += n_ops
        return tuple(parts)

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
        first, last = unit_ids[0], unit_ids[-1]
        key = (sigs[first - 1] if first > 0 else None, tuple(sigs[u] for u in unit_ids),
               sigs[last + 1] if last + 1 < len(sigs) else None, q, m, "pieces")
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
        for op in ops:
            ins = tuple(replace(t, src=rename.get(t.src, t.src)) if t.src in rename else t for t in op.inputs)
            new_ops.append(replace(op, inputs=ins) if ins != op.inputs else op)
        try:
            cost = self._cost_of_graph(g.derive(new_ops, f"{g.name}[pieces]"), q, m, unit_ids[0], unit_ids[-1])
        except OperatorMemoryError:
            cost = None
        self._cache[key] = cost
        return cost

    def cut_bytes(self, u: int, m: int) -> float:
        """Bytes of the tensors produced before unit u and consumed from unit u on, at micro-batch batch/m."""
        if (u, m) in self._cuts:
            return self._cuts[(u, m)]
        g, units, _ = self.graph(m)
        unit_of = {i: k for k, idx in enumerate(units) for i in idx}
        crossing: dict[str, int] = {}
        for e in g.edges:
            if unit_of[e.src] < u <= unit_of[e.dst]:
                out = g.operators[e.src].output
                crossing[g.operators[e.src].name] = out.size
        self._cuts[(u, m)] = float(sum(crossing.values()) * self.machine.dtype_bytes)
        return self._cuts[(u, m)]

    def link_time(self, u: int, q: int, q2: int, m: int, inter: bool) -> float:
        """One-way seconds of the activation across cut u between sub-meshes of q and q2 devices."""
        nbytes = self.cut_bytes(u, m)
        if nbytes == 0:
            return 0.0
        bw, lat = self.machine.link(inter)
        return lat + nbytes / (min(q, q2) * bw)


def _from_other_in_flight(family: dict, k: int, budget: float, plain: StageCost | None, rtol: float):
    """The memory-constrained optimum at ``k`` micro-batches in flight from the same stage's at other counts,
    or False if they do not settle it. The optimum F(k) is nondecreasing in k (a plan that fits k + 1 in
    flight fits k) and at least the time-optimal stage's time. So: nothing fits some k1 < k, nothing fits k;
    the plan of some k1 < k fits k too, it is optimal at k (F(k) >= F(k1)); the plan of some k2 > k (which
    fits k) is optimal at k when its time meets the largest lower bound known, max(time-optimal, F(k1 < k)),
    to the solves' relative tolerance."""
    lower = plain.time if plain is not None else 0.0
    proven = lower  # the largest proven lower bound of F(k): solves within a tolerance prove only their ``lower``
    for k1, c in family.items():
        if k1 < k:
            if c is None:
                return None
            if c.memory(k) <= budget:
                return c
            lower = max(lower, c.time)
            proven = max(proven, c.proven)
    ups = [c for k2, c in family.items() if k2 > k and c is not None]
    for c in ups:
        if c.time <= lower * (1 + rtol):
            return replace(c, lower=min(c.time, proven))
    return False


def _longest_run(sigs: tuple[int, ...], a: int, b: int) -> tuple[int, int] | None:
    best: tuple[int, int] | None = None
    s = a
    for i in range(a + 1, b + 1):
        if i == b or sigs[i] != sigs[s]:
            if best is None or i - s > best[1] - best[0]:
                best = (s, i)
            s = i
    return best


NO_BUDGET = 1e30
"""Bytes per device no plan comes near (a zettabyte, 10^18 times an 80 GiB device): the budget of the fit without a
memory constraint, :meth:`ModelStages.stage_cost` with memory choices (the fit's problem wants a finite budget)."""


PERIODIC_RTOL = 1e-9
"""Relative tolerance of the periodic certificate: the extension is accepted when its objective is at most
the proven lower bound times (1 + PERIODIC_RTOL) (floating-point sums in another order)."""


@dataclass(frozen=True)
class _Terms:
    """The additive parts of a stage cost over some operators of a plan and the edges into them: the search's
    objective, forward and backward seconds (before the sync's amortisation), the weight-gradient compute, the
    step's weight-gradient sync, and weight / saved-activation bytes per device."""

    objective: float
    forward: float
    backward: float
    weight_grad: float
    sync: float
    weights: Any
    activations: Any

    def plus(self, other: "_Terms", times: int) -> "_Terms":
        """These terms and ``times`` copies of ``other``."""
        return _Terms(*(getattr(self, f) + times * getattr(other, f) for f in (
            "objective", "forward", "backward", "weight_grad", "sync", "weights", "activations")))


def _row(plan, i: int) -> tuple:
    """What operator i's memory choice in ``plan`` is and costs: its layout, ZeRO stage, recomputation, FP8,
    offload, seconds and bytes (identical operators' choices compare equal)."""
    mc = plan.memory_choices
    t, j = mc.choice_tables[i], mc.choices[i]
    return (int(t.base[j]), mc.stage(i), mc.recompute(i), mc.fp8(i), mc.offload(i), float(t.seconds[j]),
            float(t.state_bytes[j]), float(t.activation_bytes[j]))


def _terms(plan, ops, sync, m: int) -> _Terms:
    """:class:`_Terms` of ``plan`` over the operators ``ops`` (indices) and the edges into them (graph and
    weight edges): per operator, the split of :func:`_forward_backward`, the objective's vertex cost
    ``max(total - (1 - 1/m) sync, 0)`` and the bytes of :meth:`CostTables.memory_of`; per edge, its
    redistribution, half forward and half backward. Summed over every operator, the plan's stage cost. A plan
    with memory choices (``sync`` None): the vertex cost is its choice's seconds (the once-per-step parts
    already 1/m), the backward takes what the choice adds (as :func:`_fit_parts`), the bytes are the choice's
    (the reserve with the whole plan's)."""
    tables, x = plan.tables, plan.assignment
    graph = tables.graph
    chosen = set(ops)
    mc = plan.memory_choices
    obj = fwd = bwd = wgrad = step = 0.0
    weights = activations = 0.0
    for i in ops:
        op, k = graph.operators[i], x[i]
        f, b, wg = _split_parts(op, tables.op_costs[i].parts(k))
        fwd, bwd, wgrad = fwd + f, bwd + b, wgrad + wg
        if mc is not None:
            t, j = mc.choice_tables[i], mc.choices[i]
            obj += float(t.seconds[j])
            bwd += float(t.seconds[j]) - float(tables.op_costs[i].total[k])
            weights += float(t.state_bytes[j])
            activations += float(t.activation_bytes[j])
            continue
        w = float(sync[i][k])
        step += w
        obj += max(float(tables.op_costs[i].total[k]) - (1.0 - 1.0 / m) * w, 0.0)
        wb, ab = tables.memory[i]
        weights = weights + wb[k]
        activations = activations + (ab[k] * 0.0 if op.name in graph.recomputed else ab[k])
    if mc is not None and len(chosen) == len(x):
        weights += mc.reserve_bytes
    red = float(sum(mat[x[src], x[dst]] for src, dst, mat in tables.all_edges() if dst in chosen))
    return _Terms(obj + red, fwd + red / 2, bwd + red / 2, wgrad, step, weights, activations)


def _stage_of(terms: _Terms, m: int, plan, recv: float | None, grad: float | None) -> StageCost:
    """The stage cost of whole-stage terms, as :meth:`ModelStages._cost_of_graph` makes it from a plan: the
    backward less (1 - 1/m) of the sync, the bytes at the peak device, ZB-H1's W pass."""
    import numpy as np

    bwd = terms.backward - (1.0 - 1.0 / m) * terms.sync
    total = np.atleast_1d(terms.weights + terms.activations)
    dev = int(np.argmax(total))
    weights = np.broadcast_to(np.atleast_1d(terms.weights), total.shape)
    activations = np.broadcast_to(np.atleast_1d(terms.activations), total.shape)
    return StageCost(terms.forward, bwd, float(weights[dev]), float(activations[dev]), plan, recv, grad,
                     min(bwd, max(terms.weight_grad + terms.sync / m, 0.0)))


def _proven_lower(cost: StageCost | None) -> float | None:
    """The lower bound a direct solve proves of its objective: the solver's bound, or its cost when it proved
    it optimal (brute force); None for a recipe or a solver that proves nothing."""
    plan = None if cost is None else cost.detail
    sol = getattr(plan, "solution", None)
    if sol is None:
        return None
    if sol.bound is not None:
        return float(sol.bound)
    return float(sol.cost) if sol.optimal else None
