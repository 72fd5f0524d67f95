"""The exact search over stage cuts x sub-meshes x micro-batches x schedule.

The model's units (blocks, :mod:`shardplan.pipeline.stages`) are cut into
contiguous stages, each on a sub-mesh of consecutive devices (a power-of-two
part of a node, or whole nodes); a callback gives each candidate stage's
intra-stage optimum (:class:`StageCost`), another the transfers across a cut.
The search returns the pipeline (stages, sub-meshes, micro-batch count,
schedule) of least step time under the per-stage memory budget, over 1F1B on
every cut, ZB-H1 on every cut with at least as many micro-batches as stages
(branch and bound over its max and min terms) and interleaved 1F1B on equal
sub-meshes and two chunkings, with a proven lower bound of the optimum over
the whole space and the gap. The max term is enumerated exactly over the stage and transfer times
that occur (a DP per bound); memory-constrained stages (ZeRO/FSDP,
recomputation) are solved lazily, only where a relaxation with time-optimal
stand-ins says they can matter.

The formulas, the exactness arguments (monotone stage costs, the lazy
relaxation, the ZB-H1 boxes, superadditivity and the family bounds) and what
the space leaves out are in ``docs/pipeline.md``; where a docstring below
refers to "the module docstring", it means that document.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import numpy as np

from shardplan.errors import ShardplanError
from shardplan.pipeline.progress import STATE_WORK, Progress
from shardplan.pipeline.schedule import StageTimes, in_flight, step_time

__all__ = ["StageCost", "PipelineSpace", "Stage", "PipelinePlan", "submesh_sizes", "search_pipeline",
           "brute_force_pipeline", "evaluate_pipeline", "interleaved_chunkings"]


@dataclass(frozen=True)
class StageCost:
    """A stage's intra-stage optimum, per micro-batch.

    Attributes:
        forward, backward: seconds per micro-batch (compute and in-stage collectives).
        weight_bytes: per-device bytes independent of micro-batches (weights, gradients, optimizer state).
        activation_bytes: per-device bytes saved for the backward pass by one micro-batch.
        detail: what produced it (e.g. the intra-stage :class:`~shardplan.spmd.SpmdPlan`), for reports.
        recv_bytes: per micro-batch, the most bytes one of its devices needs of the tensors that earlier stages
            produce (its input tiles under its plan): the forward transfer into the stage.
        grad_bytes: per micro-batch, the most bytes of gradient one of its devices receives for the tensors
            that later stages read (its output tiles): the backward transfer into the stage.
        weight_grad: seconds of ``backward`` that compute and reduce weight gradients (ZB-H1's W pass).
        lower: a proven lower bound of the least ``time`` the stage can take under the same constraints, when
            the solve that produced it stopped short of a proof (a memory-constrained solve with a relative
            tolerance or a time limit); None: ``time`` itself is the stage's optimum.
    """

    forward: float
    backward: float
    weight_bytes: float
    activation_bytes: float
    detail: Any = field(default=None, compare=False)
    recv_bytes: float | None = None
    grad_bytes: float | None = None
    weight_grad: float = 0.0
    lower: float | None = field(default=None, compare=False)

    @property
    def time(self) -> float:
        return self.forward + self.backward

    @property
    def proven(self) -> float:
        """The proven lower bound of the stage's least time (``time`` when exact)."""
        return self.time if self.lower is None else min(self.lower, self.time)

    def memory(self, k: float) -> float:
        """Peak bytes per device with ``k`` micro-batches in flight."""
        return self.weight_bytes + k * self.activation_bytes


StageFn = Callable[[int, int, int, int], "StageCost | None"]
StageLowerFn = Callable[[int, int, int, int], float]
ChunkingLowerFn = Callable[[Sequence[tuple[int, int]], int, int], float]
FitFn = Callable[[int, int, int, int, int, float], "StageCost | None"]
GroupFitFn = Callable[[tuple[tuple[int, int], ...], int, int, float, float], "tuple[StageCost, ...] | None"]
LinkFn = Callable[[int, int, int, int, bool], float]
ExchangeFn = Callable[[float, bool], float]


def _exchanged(exchange: ExchangeFn, nbytes: float | None, inter: bool) -> float:
    if nbytes is None:
        raise ShardplanError("exact stage-to-stage transfers need every stage cost's recv_bytes and grad_bytes")
    return exchange(nbytes, inter) if nbytes > 0 else 0.0


def _cut_times(prev: StageCost, nxt: StageCost, o_next: int, ns: int, u: int, q: int, q2: int, m: int,
               link_fn: LinkFn, exchange: ExchangeFn | None) -> tuple[float, float]:
    """(activation, gradient) seconds across the cut before unit u, the next stage at offset o_next."""
    inter = o_next % ns == 0
    if exchange is None:
        t = link_fn(u, q, q2, m, inter)
        return t, t
    return _exchanged(exchange, nxt.recv_bytes, inter), _exchanged(exchange, prev.grad_bytes, inter)


@dataclass(frozen=True)
class PipelineSpace:
    """What may be searched.

    Attributes:
        num_units: U, units in order.
        num_devices: p.
        node_size: devices per node (None: one level, any power-of-two part or the whole machine).
        micro_batches: candidate m.
        budget: bytes per device (None: unlimited).
        max_stages: largest S (default: U).
        uniform: only pipelines whose stages all have the same sub-mesh size.
        interleave: chunk counts v > 1 to try with the interleaved schedule.
        sizes: sub-mesh sizes allowed (default :func:`submesh_sizes`).
    """

    num_units: int
    num_devices: int
    node_size: int | None = None
    micro_batches: tuple[int, ...] = (1,)
    budget: float | None = None
    max_stages: int | None = None
    uniform: bool = False
    interleave: tuple[int, ...] = ()
    sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.num_units < 1 or self.num_devices < 1:
            raise ShardplanError("a pipeline space needs at least one unit and one device")
        if not self.micro_batches or min(self.micro_batches) < 1:
            raise ShardplanError(f"micro-batch counts must be positive, got {self.micro_batches!r}")
        if any(v < 2 for v in self.interleave):
            raise ShardplanError(f"interleaved chunk counts must be >= 2, got {self.interleave!r}")

    def allowed_sizes(self) -> tuple[int, ...]:
        return self.sizes if self.sizes is not None else submesh_sizes(self.num_devices, self.node_size)


def submesh_sizes(p: int, node_size: int | None) -> tuple[int, ...]:
    """Sub-mesh sizes: powers of two below a node, and every whole number of nodes (p itself included)."""
    ns = p if node_size is None or node_size >= p else node_size
    part = [1 << k for k in range(ns.bit_length()) if (1 << k) < ns]
    return tuple(part + [n * ns for n in range(1, p // ns + 1)])


def _placeable(o: int, q: int, p: int, ns: int) -> bool:
    if o + q > p:
        return False
    if q < ns:
        return o % q == 0 and (o % ns) + q <= ns
    return q % ns == 0 and o % ns == 0


@dataclass(frozen=True)
class Stage:
    """One stage: units [first, end) on devices [offset, offset + devices)."""

    first: int
    end: int
    offset: int
    devices: int
    cost: StageCost
    in_flight: float

    @property
    def memory(self) -> float:
        return self.cost.memory(self.in_flight)


@dataclass(frozen=True)
class PipelinePlan:
    """The search's answer: stages, m, schedule (v chunks), links (one-way seconds per cut), predicted step."""

    stages: tuple[Stage, ...]
    micro_batches: int
    schedule: str
    chunks: int
    links: tuple[float, ...]
    step_time: float
    budget: float | None
    stats: dict = field(default_factory=dict, compare=False)
    back_links: tuple[float, ...] | None = None
    lower_bound: float | None = None

    @property
    def gap(self) -> float | None:
        """(step - lower bound) / step: how far from the space's optimum the plan may be (None: no bound)."""
        if self.lower_bound is None:
            return None
        return max(0.0, (self.step_time - self.lower_bound) / self.step_time) if self.step_time > 0 else 0.0

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def stage_times(self) -> list[StageTimes]:
        if self.chunks > 1:
            # interleaved: a group's chunks are stored as separate stages; fold them per group
            groups = self.num_stages // self.chunks
            f = [0.0] * groups
            b = [0.0] * groups
            w = [0.0] * groups
            for i, s in enumerate(self.stages):
                f[i % groups] += s.cost.forward
                b[i % groups] += s.cost.backward
                w[i % groups] += s.cost.weight_grad
            return [StageTimes(x, y, weight_grad=z) for x, y, z in zip(f, b, w)]
        return [StageTimes(s.cost.forward, s.cost.backward, weight_grad=s.cost.weight_grad) for s in self.stages]

    def group_links(self, back: bool = False) -> list[float]:
        """Per cut between device groups: the activation's seconds (``back``: the gradient's)."""
        links = self.back_links if back and self.back_links is not None else self.links
        if self.chunks > 1:
            groups = self.num_stages // self.chunks
            # the slowest of the v transfers between neighbouring groups (the wrap-around from the last group
            # to the first, j % groups == groups - 1, is not charged: see the schedule module)
            return [max(links[d::groups]) for d in range(groups - 1)]
        return list(links)


def _links_ok(a: float, bound: float) -> bool:
    return a <= bound * (1 + 1e-12) + 1e-300


SEED_EVALUATIONS = 16  # uniform pipelines costed before the parts (docs/pipeline.md, *Seeds*)
SEED_FIT_STAGES = 8  # seeds with fewer stages take no memory-constrained stage (their solves are the dear ones)


def search_pipeline(space: PipelineSpace, stage_fn: StageFn, link_fn: LinkFn,
                    schedules: Sequence[str] = ("1f1b", "interleaved"),
                    exchange: ExchangeFn | None = None, fit_fn: FitFn | None = None,
                    group_fit_fn: GroupFitFn | None = None, progress: Progress | None = None,
                    one_program_lower: float | None = None,
                    release: Callable[[], None] | None = None,
                    step_floor: Callable[[int], float] | None = None,
                    stage_lower: StageLowerFn | None = None,
                    seeds: int = SEED_EVALUATIONS,
                    forward_floor: Callable[[int], float] | None = None,
                    unit_forward: Callable[[int], Sequence[float]] | None = None,
                    chunking_lower: ChunkingLowerFn | None = None) -> PipelinePlan | None:
    """The optimum of the module docstring's model over ``space`` (1F1B: a DP over every cut; ZB-H1: branch
    and bound over every cut; interleaved: its chunkings).

    ``exchange(bytes per device, inter-node) -> seconds``: exact stage-to-stage transfers from the stage costs'
    ``recv_bytes``/``grad_bytes`` (module docstring); None: ``link_fn`` per cut. ``fit_fn(a, b, q, m, k,
    budget)``: a stage's memory-constrained optimum with k micro-batches in flight, used (1F1B, ZB-H1) where
    the time-optimal one does not fit. ``group_fit_fn(chunks, q, m, k, budget)``: an interleaved device
    group's joint memory-constrained optimum (one cost per chunk), likewise. The answer's ``lower_bound`` is
    a proven lower bound of the optimum over the space (module docstring, *Lower bound*).

    ``progress`` hears of each part (a schedule family at one m), of the plans found and of the inner loops'
    steps (:class:`~shardplan.pipeline.progress.Progress`). A :class:`KeyboardInterrupt` (Ctrl-C, or raised by
    a progress callback) stops the search: the best plan found so far is returned, its ``lower_bound`` the
    least of the finished parts' bounds and of each unfinished part's family bound (its ``step_floor``, raised
    by the family bounds the part had computed when it stopped), and ``stats["interrupted"]`` is True; with no
    plan found yet the interrupt propagates, ``progress.space_bound`` holding that bound.

    ``step_floor(m)``: a proven lower bound of the step of every pipeline at m, whatever its stages and
    schedule (:meth:`~shardplan.pipeline.stages.ModelStages.step_floor`: the step's compute over every device
    at the machine's achievable FLOP/s, or its bytes at the HBM bandwidth), before anything is solved. The parts
    (a schedule family at one m) are taken best-first: the micro-batch counts in increasing order of that bound
    (within 1 %: equal), the larger count first among equals; a part whose bound reaches the best step known is closed without its search (docs/pipeline.md,
    *Best-first parts*).

    A ``progress`` that already holds an incumbent (``progress.incumbent``, e.g. the one-program plan's step,
    told by :meth:`~shardplan.pipeline.progress.Progress.improved` before the search) prunes every part with it
    from the start: a part whose bound reaches it is closed without solving. If no pipeline beats it, the
    answer is None and ``progress.bound`` is the proven lower bound of the pipeline space (each part's,
    min(incumbent, its own best) scaled by its solves' proven ratio).

    ``one_program_lower``: a proven lower bound of the seconds of the whole model as one stage on every device at
    m = 1 with its memory choices (the one-program search's own bound for one micro-batch, the same problem):
    that stand-in starts there, so the search does not solve it again to learn what the one program proved.
    ``release()`` is called after every part of each micro-batch count is done (the callbacks' caches for that
    count can go: :meth:`~shardplan.pipeline.stages.ModelStages.release`).

    ``stage_lower(a, b, q, m)``: a proven lower bound of the seconds of units [a, b) as one stage on q devices at m
    under any plan (time-optimal or memory-constrained), the sum of per-unit bounds (so a stage of one unit gives
    the unit's), computed without a solve (:class:`~shardplan.pipeline.floors.UnitFloors`). With it the family
    bounds take those per-unit bounds instead of solving every unit on every size, and the 1F1B and ZB-H1 DPs
    skip, unsolved, every stage whose bound exceeds their bottleneck bound or the best step over m
    (docs/pipeline.md, *Solve-free stage bounds*).

    ``seeds``: with ``stage_lower``, before any part, up to that many uniform pipelines (equal sub-meshes, the units
    dealt evenly) are costed in increasing order of a solve-free estimate (:func:`_uniform_seeds`); the best that
    beats the best step known is the first incumbent, and the micro-batch counts whose seeds are best go first
    (docs/pipeline.md, *Seeds*). They are real plans of the space: the optimum and its bound do not change.
    ``chunking_lower(chunking, q, m)``: a cheap proven bound of the largest ``stage_lower`` of a seed candidate's
    stages (:meth:`~shardplan.pipeline.floors.UnitFloors.chunking_lower`): the seeds' lazy order, which costs the
    same candidates in the same order with fewer ``stage_lower`` pairs computed (:func:`_uniform_seeds`).

    ``forward_floor(m)``: a lower bound of the largest forward seconds among the stages of every pipeline at m
    (:meth:`~shardplan.pipeline.stages.ModelStages.forward_floor`); ZB-H1's boxes use it to bound its saving
    W + Y (docs/pipeline.md, *ZB-H1's boxes*).

    ``unit_forward(m)``: per unit, its forward device-seconds at m
    (:meth:`~shardplan.pipeline.floors.UnitFloors.forward_units`); with it ZB-H1's stage counts are bounded with
    their fill and drain (:func:`_zb_bubble_counts`; 1F1B's bound, :func:`_bubble_bound`, needs only the unit
    seconds; docs/pipeline.md, *Bubble bounds*)."""
    t0 = time.perf_counter()
    progress = progress if progress is not None else Progress()
    best: PipelinePlan | None = None
    outside = progress.incumbent  # a step already achieved outside this space (the one-program plan's), or inf

    def known() -> float:
        """The best step known: the incumbent every part must beat."""
        return min(outside, best.step_time if best is not None else math.inf)
    lower = math.inf  # the least proven lower bound of the parts of the space explored so far
    stats: dict[str, Any] = {"candidates": 0, "dp_states": 0, "stage_evaluations": 0}

    def take(cand: PipelinePlan | None, lb: float, key: tuple[str, int, int], strict: float = 0.0) -> None:
        nonlocal best, lower
        lower = min(lower, lb)
        unfinished.pop(key, None)
        progress.space_bound = space_bound()
        if cand is not None and (best is None or cand.step_time < best.step_time * (1 - strict)):
            best = cand
            progress.improved(cand.step_time, cand)
        progress.finished(lb)

    family: dict[str, float] = {}  # per schedule family: the least proven lower bound over its part of the space

    def note(name: str, lb: float) -> float:
        family[name] = min(family.get(name, math.inf), lb)
        return lb

    ms = sorted(set(int(x) for x in space.micro_batches))
    # the parts of each m, in the order they run: ZB-H1 first (its optimum is the best incumbent for the others,
    # and its unit seconds give 1F1B its family bound), then 1F1B, then each interleaved chunk count
    kinds = ([("zb-h1", 0)] if "zb-h1" in schedules else []) + ([("1f1b", 0)] if "1f1b" in schedules else []) \
        + ([("interleaved", v) for v in space.interleave] if "interleaved" in schedules else [])
    progress.total += len(ms) * len(kinds)
    floor_of = {m: max(0.0, float(step_floor(m))) if step_floor is not None else 0.0 for m in ms}
    # every part not finished, with the best proven lower bound of its optimum known so far (docs/pipeline.md,
    # *Best-first parts*): its step floor, raised by the family bounds the part computes as it goes
    unfinished: dict[tuple[str, int, int], float] = {(f, v, m): floor_of[m] for m in ms for f, v in kinds}

    def space_bound() -> float:
        """The proven lower bound of the whole space now: the finished parts' and every unfinished one's."""
        return min([lower, *unfinished.values()])

    progress.space_bound = space_bound()  # kept current for the progress line, and for an interrupt

    # best-first: the micro-batch count of least bound first, bounds within ORDER_RTOL of each other taken as
    # equal; among equals the larger count (its fill, (S - 1)/m of the step under 1F1B, is the smallest). A
    # count's parts stay together: its stage caches go after them
    least = min(floor_of.values())
    order = sorted(ms, key=lambda m: (int((floor_of[m] / least - 1.0) / ORDER_RTOL) if least > 0 else 0, -m))
    tick = progress.tick
    interrupted = False
    seeded: dict[int, PipelinePlan] = {}
    try:
        if seeds > 0 and stage_lower is not None:
            progress.part("pipelines: uniform seeds")
            def seeded_plan(plan: PipelinePlan) -> None:
                nonlocal best
                if plan.step_time < known():
                    best = plan
                    progress.improved(plan.step_time, plan)  # an interrupt from here on returns it

            seeded = _uniform_seeds(space, stage_fn, link_fn, exchange, fit_fn, stage_lower, schedules, ms, seeds,
                                    stats, tick, seeded_plan, chunking_lower=chunking_lower)
            if release is not None:
                release()  # the seeds' stages at every count: the parts ask again for the few they need
            if seeded:
                stats["seed_steps"] = {str(m): t.step_time for m, t in seeded.items()}
                # the counts whose seeds are best first: the optimum is likeliest there, and it prunes the rest
                rank = {m: i for i, m in enumerate(sorted(seeded, key=lambda m: (seeded[m].step_time, -m)))}
                order = sorted(order, key=lambda m: rank.get(m, len(rank)))
        for m in order:
            cache: dict[int, list[float]] = {}

            def units(q: int, m: int = m, cache: dict = cache) -> list[float]:
                if q not in cache:
                    tick(f"unit bounds on {q} devices")
                    cache[q] = (_unit_seconds(space, stage_fn, m, q) if stage_lower is None else
                                [stage_lower(u, u + 1, q, m) for u in range(space.num_units)])
                return cache[q]

            for fam, v in kinds:
                key = (fam, v, m)

                def hint(value: float, key: tuple[str, int, int] = key) -> None:
                    # a proven family bound of the running part (0: what it computed is void): its bound on interrupt
                    unfinished[key] = max(floor_of[key[2]], value)
                    progress.space_bound = space_bound()

                progress.part(f"pipelines {fam} m={m}" if fam != "interleaved" else
                              f"pipelines interleaved v={v} m={m}")
                if unfinished[key] >= known():
                    # closed by its bound before any search (the step's compute alone reaches the best known)
                    stats["parts_closed_by_floor"] = stats.get("parts_closed_by_floor", 0) + 1
                    found, lb = None, min(unfinished[key], known())
                elif fam == "zb-h1":
                    # one stage is 1F1B's when that is searched
                    found, lb = _search_zb_h1(space, stage_fn, link_fn, m, exchange, fit_fn,
                                              known(), stats, units,
                                              first_stages=2 if "1f1b" in schedules else 1, progress=progress,
                                              hint=hint, stage_lower=stage_lower,
                                              prefer=seeded[m].num_stages if m in seeded
                                              and seeded[m].step_time < outside else None,
                                              phi=max(0.0, float(forward_floor(m))) if forward_floor is not None
                                              else 0.0,
                                              forward=unit_forward(m) if unit_forward is not None else None)
                elif fam == "1f1b":
                    found, lb = _search_1f1b(space, stage_fn, link_fn, m, stats, known(),
                                             exchange, fit_fn, progress=progress,
                                             one_program_lower=one_program_lower, units=units,
                                             units_known=lambda q, cache=cache: stage_lower is not None or q in cache,
                                             hint=hint, stage_lower=stage_lower)
                else:
                    found, lb = _search_interleaved(space, stage_fn, link_fn, m, v, exchange, group_fit_fn,
                                                    known(), stats, units, tick=tick)
                take(found, note(fam, lb), key, strict=1e-12 if fam == "1f1b" else 0.0)
            if release is not None:
                release()  # nothing at this m is asked for again: its stage caches go
    except KeyboardInterrupt:
        # the best plan so far; the parts not finished prove their family bounds (module docstring)
        progress.space_bound = space_bound()
        got = progress.plan
        if isinstance(got, PipelinePlan) and (best is None or got.step_time < best.step_time):
            best = got
        if best is None:
            raise
        interrupted = True
        lower = space_bound()
    progress.space_bound = lower
    if best is None and math.isfinite(outside) and not interrupted:
        return None  # nothing beats the incumbent from outside; progress.bound is what the parts proved
    if best is None:
        raise ShardplanError("no pipeline fits: every stage cut and sub-mesh exceeds the memory budget "
                             "(or no stage can be costed)")
    stats["solve_seconds"] = time.perf_counter() - t0
    stats["family_lower_bounds"] = {k: v for k, v in family.items() if math.isfinite(v)}  # inf: nothing in it
    stats["interrupted"] = interrupted
    stats["parts_done"], stats["parts_total"] = progress.done, progress.total
    return replace(best, stats={**best.stats, **stats}, lower_bound=min(lower, best.step_time))


def _uniform_seeds(space: PipelineSpace, stage_fn: StageFn, link_fn: LinkFn, exchange: ExchangeFn | None,
                   fit_fn: FitFn | None, stage_lower: StageLowerFn, schedules: Sequence[str], ms: Sequence[int],
                   limit: int, stats: dict, tick: Callable[..., None],
                   found_plan: Callable[[PipelinePlan], None] | None = None,
                   fit_stages: int = SEED_FIT_STAGES,
                   chunking_lower: ChunkingLowerFn | None = None) -> dict[int, PipelinePlan]:
    """Real plans to start the search from, per micro-batch count: the best uniform pipeline costed there.

    Candidates: every m, every stage count S >= 2 with p/S an allowed sub-mesh size (S <= max_stages, S <= U),
    each chunking of :func:`interleaved_chunkings` (the units dealt evenly, Megatron-LM's layout), under ZB-H1
    when it is searched and S <= m, else 1F1B. With t the largest ``stage_lower`` of the candidate's stages, m t
    is a proven lower bound of its step (every step is at least m t_max: docs/pipeline.md, *Family bounds*), and
    (m + (S - 1) r) t, r = 2/3 for ZB-H1 (F, B, W equal thirds) and 1 for 1F1B, its estimate. Up to ``limit``
    candidates are costed exactly (:func:`evaluate_pipeline`) in increasing order of the estimate, skipping one
    whose bound reaches the best costed; a stage that does not fit its in-flight micro-batches takes its
    memory-constrained optimum (``fit_fn``) only in a candidate of at least ``fit_stages`` stages (a
    memory-constrained solve of a large stage can cost as much as the one program), else the candidate is
    dropped. When a candidate of fewer than ``fit_stages`` stages is dropped and no seed is known yet, the next one
    costed, out of turn and beyond ``limit``, is the best of those with the most stages (at least ``fit_stages``:
    the smallest memory-constrained solves), once (``stats["seed_out_of_turn"]``: docs/pipeline.md, *A first seed
    that fits*). ``found_plan`` hears each plan better than the ones before. A heuristic choice of real plans: what
    it finds only lowers the incumbent.

    ``chunking_lower(chunking, q, m)``: a proven lower bound, as floats, of the largest ``stage_lower`` of the
    chunking's stages, cheaper than it (:meth:`~shardplan.pipeline.floors.UnitFloors.chunking_lower`). With it
    the candidates wait in a heap under that bound's keys and a candidate's ``stage_lower`` is computed only when
    its bound reaches the top (a candidate whose bound already reaches the best costed is dropped unseen): the
    candidates are costed in the same order, the same ones, with the same plans (docs/pipeline.md, *Seeds*)."""
    U, p = space.num_units, space.num_devices
    sizes = set(space.allowed_sizes())
    s_max = min(space.max_stages or U, U, p)
    # (key, exact, the estimate's factor, schedule): key = (estimate, m t, -m, S, chunking), unique per candidate,
    # with t the largest stage_lower (exact) or chunking_lower's bound of it (not exact; every part of the key is
    # then <= the exact key's, so the exact key is >= it in the tuple order: docs/pipeline.md, *Seeds*)
    heap: list[tuple[tuple, bool, float, str]] = []
    for m in ms:
        for n in range(2, s_max + 1):
            if p % n or p // n not in sizes:
                continue
            zb = "zb-h1" in schedules and n <= m
            if not zb and "1f1b" not in schedules:
                continue
            q = p // n
            factor = m + (n - 1) * (2 / 3 if zb else 1.0)
            for chunking in interleaved_chunkings(U, n):
                exact = chunking_lower is None
                t = max(stage_lower(a, b, q, m) for a, b in chunking) if exact else chunking_lower(chunking, q, m)
                heap.append(((factor * t, m * t, -m, n, chunking), exact, factor, "zb-h1" if zb else "1f1b"))
    heapq.heapify(heap)
    found: dict[int, PipelinePlan] = {}
    best = math.inf
    costed = 0
    # the most stages a candidate has that takes memory-constrained stages (its stages are the smallest: the
    # cheapest memory-constrained solves); 0: none does
    deepest = max((e[0][3] for e in heap if e[0][3] >= fit_stages), default=0) if fit_fn is not None else 0
    done: set[tuple[int, int, tuple]] = set()  # the fallback seed, costed out of turn: (m, S, chunking)

    def least_exact(pool: list) -> tuple | None:
        """The least entry of the heap ``pool`` under its exact key, popped (entries under a bound made exact on the
        way, as in the loop below); None when ``pool`` is empty."""
        while pool:
            key, exact, factor, schedule = heapq.heappop(pool)
            if exact:
                return key, schedule
            _, _, neg_m, n, chunking = key
            t = max(stage_lower(a, b, p // n, -neg_m) for a, b in chunking)
            heapq.heappush(pool, ((factor * t, -neg_m * t, neg_m, n, chunking), True, factor, schedule))
        return None

    def cost(m: int, n: int, chunking: tuple, schedule: str) -> PipelinePlan | None:
        nonlocal best
        plan = evaluate_pipeline([(a, b, p // n) for a, b in chunking], m, space, stage_fn, link_fn, exchange,
                                 schedule, fit_fn=fit_fn if n >= fit_stages else None)
        if plan is not None and (m not in found or plan.step_time < found[m].step_time):
            found[m] = plan
            if plan.step_time < best and found_plan is not None:
                found_plan(plan)
            best = min(best, plan.step_time)
        return plan

    while heap and costed < limit:
        key, exact, factor, schedule = heapq.heappop(heap)
        _, lb, m, n, chunking = key
        m = -m
        if (m, n, chunking) in done:
            continue
        if lb >= best:  # (a bound's m t below the exact one's: the exact one reaches the best as well)
            continue
        if not exact:  # every key left is >= this bound: the exact key goes back among them
            t = max(stage_lower(a, b, p // n, m) for a, b in chunking)
            heapq.heappush(heap, ((factor * t, m * t, -m, n, chunking), True, factor, schedule))
            continue
        costed += 1
        tick(f"seed {costed}/{limit}: {n} stages, m={m}")
        plan = cost(m, n, chunking, schedule)
        if plan is None and not found and not done and n < fit_stages and deepest:
            # dropped (it takes no memory-constrained stage, and one of its stages does not fit time-optimally) with
            # no seed known: the next one costed, out of turn and beyond the limit, is the best of those with the
            # most stages, which take memory-constrained stages (docs/pipeline.md, *A first seed that fits*)
            pool = [e for e in heap if e[0][3] == deepest]
            heapq.heapify(pool)
            got = least_exact(pool)
            if got is not None:
                (_, _, neg_m, fn, fchunking), fschedule = got
                done.add((-neg_m, fn, fchunking))
                tick(f"seed out of turn: {fn} stages, m={-neg_m}")
                fplan = cost(-neg_m, fn, fchunking, fschedule)
                stats["seed_out_of_turn"] = {"stages": fn, "micro_batches": -neg_m,
                                             "step": None if fplan is None else fplan.step_time}
    stats["seeds_costed"] = costed
    return found


def _search_1f1b(space: PipelineSpace, stage_fn: StageFn, link_fn: LinkFn, m: int, stats: dict,
                 incumbent: float, exchange: ExchangeFn | None = None,
                 fit_fn: FitFn | None = None, progress: Progress | None = None,
                 one_program_lower: float | None = None,
                 units: Callable[[int], Sequence[float]] | None = None,
                 units_known: Callable[[int], bool] | None = None,
                 hint: Callable[[float], None] | None = None,
                 stage_lower: StageLowerFn | None = None) -> tuple[PipelinePlan | None, float]:
    """The 1F1B optimum at m if below ``incumbent`` (else None), and a proven lower bound of the 1F1B optimum at
    m: rho min(incumbent, found), rho the least proven/found ratio of the memory-constrained stages solved
    (module docstring, *Lower bound*).

    Before its DP the part is bounded from the unit seconds (:func:`_one_f_one_b_family_bound`; at m = 1 with the
    whole model's own stage) when ``units`` gives them (at m > 1 only when ``units_known`` says the unit seconds
    are at hand for every size: ZB-H1's search at the same m computed them), and closed when that bound reaches
    ``incumbent``; ``hint(bound)`` hears it (the part's proven bound if it is interrupted)."""
    U, p = space.num_units, space.num_devices
    ns = p if space.node_size is None or space.node_size >= p else space.node_size
    sizes = space.allowed_sizes()
    s_max = min(space.max_stages or U, U, p)
    budget = math.inf if space.budget is None else space.budget

    # every stage and transfer time seen (the candidate bounds), and those not yet queued
    seen: set[float] = set()
    fresh: list[float] = []

    def see(v: float) -> None:
        if v not in seen:
            seen.add(v)
            fresh.append(v)

    def noticed(c: StageCost, solved: bool) -> None:
        see(c.time)
        if solved and exchange is not None:
            # the transfers a solved stage may charge (recv on either kind of link, grad likewise): candidates
            for x in (c.recv_bytes, c.grad_bytes):
                for inter in (False, True):
                    see(_exchanged(exchange, x, inter))

    progress = progress if progress is not None else Progress()
    pool = _StagePool(stage_fn, fit_fn, m, budget, stats, noticed, progress.tick, stage_lower)
    # every 1F1B step is at least m t_max: a stage slower than incumbent / m is in no pipeline that beats it
    # (docs/pipeline.md, *Solve-free stage bounds*)
    cap = incumbent / m * (1 + 1e-12)
    if m == 1 and one_program_lower is not None:
        # the whole model as one stage at m = 1 is the one program with one micro-batch: its proven bound
        # raises that stand-in (docs/pipeline.md, *An incumbent from outside*)
        pool.known_lower[(0, U, p, 1.0)] = one_program_lower
    if m == 1 and units is not None and math.isfinite(incumbent) and not space.uniform:
        # before any stage but the whole model is costed: one stage's value, and the least sum of unit seconds
        # over cuts into two or more stages (docs/pipeline.md, *m = 1*)
        whole = pool.get(0, U, p, 1.0)  # the plain stage where it fits, else its stand-in: a lower bound
        one = math.inf if whole is None else whole.time
        ns = p if space.node_size is None or space.node_size >= p else space.node_size
        more = _min_sum_cut({q: units(q) for q in sizes if q <= p}, p, ns) * FAMILY_SAFETY
        stats["m1_unit_bound"] = more
        if hint is not None:
            hint(min(one, more))
        if min(one, more) >= incumbent * (1 - M1_RTOL):
            stats["m1_closed_by_units"] = True
            return None, min(incumbent, one, more)
    elif m > 1 and units is not None and units_known is not None and all(units_known(q) for q in sizes if q <= p):
        ns = p if space.node_size is None or space.node_size >= p else space.node_size
        fam = _one_f_one_b_family_bound({q: units(q) for q in sizes if q <= p}, p, m, ns)
        # the fill and drain counted, over the pipelines whose stages are all within incumbent / m
        fam = max(min(fam, incumbent), _bubble_bound({q: units(q) for q in sizes if q <= p}, None, p, m, incumbent,
                                                     "1f1b", ns))
        stats.setdefault("one_f_one_b_family_bounds", {})[str(m)] = fam  # a JSON key: the plan round-trips
        if hint is not None:
            hint(fam)
        if fam >= incumbent * (1 - ZB_TOL):  # (the bounds carry FAMILY_SAFETY: within it, nothing better)
            stats["one_f_one_b_closed_by_units"] = stats.get("one_f_one_b_closed_by_units", 0) + 1
            return None, min(incumbent, fam)
    cost, fitted = pool.plain, pool.fitted

    def effective(a: int, b: int, q: int, k: float) -> StageCost | None:
        """The stage's least time with k micro-batches in flight within the budget (:meth:`_StagePool.get`); in
        the bounding pass a solved one at its proven seconds."""
        c = pool.get(a, b, q, k)
        return proven_of((a, b, q, k)) if bounding[0] and (a, b, q, k) in fitted else c

    bounding = [False]  # the second pass: resolved stages at their proven seconds (module docstring, Lower bound)
    proven: dict[tuple[int, int, int, float], StageCost | None] = {}

    def proven_of(key: tuple[int, int, int, float]) -> StageCost | None:
        c = fitted[key]
        if c is None or c.detail is _PENDING:
            return c
        if key not in proven:
            proven[key] = _at_proven(c)
            see(proven[key].time)  # type: ignore[union-attr]
        return proven[key]

    def link(u: int, o: int, q: int, q2: int) -> float:
        t = link_fn(u, q, q2, m, (o + q) % ns == 0)
        see(t)
        return t

    def edges(c: StageCost, a: int, o: int, q: int, last: bool) -> tuple[float, float]:
        """Exact transfers charged to a stage: its activation in (a > 0), the gradient of its output (not last)."""
        fin = _exchanged(exchange, c.recv_bytes, o % ns == 0) if a > 0 else 0.0  # type: ignore[arg-type]
        gout = 0.0 if last else _exchanged(exchange, c.grad_bytes, (o + q) % ns == 0)  # type: ignore[arg-type]
        see(fin)
        see(gout)
        return fin, gout

    stage_counts: Sequence[int] = range(1, s_max + 1)
    if space.uniform:
        stage_counts = [s for s in stage_counts if p % s == 0 and p // s in sizes]
    # every stage count allowed (at most min(U, p) stages can be placed anyway): one DP over the classes
    # min(stages left, m) serves them all (docs/pipeline.md, *Stage counts merged*); "stage count" 0 below
    merged = not space.uniform and s_max == min(U, p)
    if merged:
        stage_counts = [0]

    # best_from(a, o, r, q) of the stage DP does not depend on the stage count asked for, only on the bound, the
    # pool's costs and the pass: one memo serves every stage count at a bound (uniform pipelines excepted: there
    # the sizes a DP may use depend on the count)
    # (the DP's memo, the stage values by what they depend on) per (bound, pool version, pass)
    memos: dict[tuple[float, int, bool], tuple[dict | None, dict]] = {}

    def memo_of(bound: float) -> tuple[dict | None, dict]:
        if space.uniform:
            return None, {}
        key = (bound, pool.version, bounding[0])
        if key not in memos:
            held()
            keep = {k: v for k, v in memos.items() if k[0] == math.inf and k[1:] == key[1:]}
            memos.clear()
            memos.update(keep)  # the unbounded DP's memo (the floors) and the latest bound's
            memos[key] = ({}, {})
            stats["dp_memos_held_max"] = max(stats.get("dp_memos_held_max", 0), len(memos))
        return memos[key]

    def held() -> None:
        """Record the DP states the memos hold now (``stats["dp_memo_peak_entries"]``: the most at once)."""
        now = sum(len(a or ()) for a, _ in memos.values())
        stats["dp_memo_peak_entries"] = max(stats.get("dp_memo_peak_entries", 0), now)

    def solve_bound(bound: float, n_stages: int, q_fixed: int | None) -> tuple[float, list] | None:
        memo, values = memo_of(bound)

        def stage(a: int, b: int, o: int, q: int, r: int) -> float | None | object:
            # a stage's value depends on its offset only through whether its cuts cross a node, and on the
            # stages left only through its in-flight count and whether it is the last
            key = (a, b, q, min(r, m), r == 1, o % ns == 0, (o + q) % ns == 0)
            got = values.get(key, _UNSEEN)
            if got is _UNSEEN:
                got = values[key] = stage_value(a, b, o, q, r)
            return got

        def floor(a: int, b: int, q: int) -> float | object:
            lo = pool.lower(a, b, q)
            if lo > min(bound * (1 + 1e-12), cap):
                # its time-optimal seconds, and every longer stage's, are over the bound or the cap: unsolved
                stats["stages_skipped_by_floor"] = stats.get("stages_skipped_by_floor", 0) + 1
                return _BREAK
            return lo

        def stage_value(a: int, b: int, o: int, q: int, r: int) -> float | None | object:
            k = float(min(r, m))
            c = effective(a, b, q, k)
            if c is None or c.memory(k) > budget:
                if fit_fn is not None and cost(a, b, q) is not None:
                    return _BREAK  # nothing fits [a, b) with k in flight: a longer stage needs more still
                return None
            if pool.over(a, b, q, cap):
                return _BREAK  # its true seconds, and every longer stage's, are over the cap
            if c.time > bound * (1 + 1e-12):
                plain = cost(a, b, q)
                if not pool.lazy or plain.time > bound * (1 + 1e-12):  # type: ignore[union-attr]
                    return _BREAK  # stage times grow with b (monotone_stages): longer stages are slower still
                # a relaxed time (a solved stage, or one at its proven seconds) over B: a longer stage's
                # true time is over B too, but its stand-in may not be; the time-optimal stage's is
                return None
            if exchange is None:
                return c.time
            fin, gout = edges(c, a, o, q, r == 1)
            return c.time + fin + gout if _links_ok(fin, bound) and _links_ok(gout, bound) else None

        def between(b: int, o: int, q: int, q2: int) -> float | None:
            lk = link(b, o, q, q2)
            return lk if _links_ok(lk, bound) else None

        qs = [q_fixed] if q_fixed is not None else list(sizes)
        # every stage the DP takes has its solve-free bound within min(bound, cap) (``floor`` ends the extent scan
        # past it): a state whose units left need more device-seconds than its devices left give under that limit
        # has no completion (docs/pipeline.md, *Device-seconds left*, as ZB-H1's DP)
        limit = min(bound * (1 + 1e-12), cap)
        reachable = None
        if pool.stage_lower is not None and pool.bounded() and math.isfinite(limit):
            left, room = pool.work_left(tuple(qs), U), limit * (1 + 1e-9)

            def reachable(a: int, o: int) -> bool:
                return left[a] <= (p - o) * room

        return _stage_dp(space, n_stages, qs, stage, between if exchange is None else None, stats, "dp_states",
                         memo, pool.tick, classes=m if merged else None,
                         floor=floor if pool.stage_lower is not None else None, reachable=reachable)

    def optimum(start: float) -> PipelinePlan | None:
        """Best-first over (stage count, bound) by lower bound (module docstring: the max term, lazy stages):
        the best plan below ``start``, else None. While ``bounding``: the relaxation's optimum (stand-ins and
        stages at their proven seconds taken as they are, nothing solved)."""
        # D(inf) per stage count (a lower bound of every D(B)); the stages and links it visits are every one that
        # can occur, so their times are the candidate bottleneck values
        floors = {}
        # the floor's own optimum P_n, when it is a real pipeline (no stand-in), dominates every bound from its
        # largest time M_n up (docs/pipeline.md, *The floor's own pipeline*): only bounds below M_n are queued
        caps: dict[int, float] = {}
        best: PipelinePlan | None = None
        best_t = start
        for n_stages in stage_counts:
            progress.tick("every stage count: least sum" if merged else
                          f"stage count {n_stages} of {stage_counts[-1] if stage_counts else 0}: least sum")
            unbounded = solve_bound(math.inf, n_stages, p // n_stages if space.uniform else None)
            while unbounded is not None and m == 1 and not bounding[0] and unbounded[0] < best_t * (1 - M1_RTOL):
                # at m = 1 the step is the sum alone, which D(inf) minimises: no bound B can do better than the
                # floor. Its stand-ins are solved and the floor recomputed until its pipeline is real (then it
                # is the count's optimum) or the floor reaches the best known (docs/pipeline.md, *m = 1*)
                own = _assemble(unbounded[1], cost, m, space, link_fn, exchange, fitted=fitted)
                pending = [(x.first, x.end, x.devices, x.in_flight) for x in own.stages
                           if x.cost.detail is _PENDING]
                if not pending:
                    break
                stats["lazy_rounds"] = stats.get("lazy_rounds", 0) + 1
                for key in pending:
                    if key in fitted:
                        pool.resolve(key)
                if not pool.lazy:
                    return None  # the stand-ins are not lower bounds: start again eagerly
                unbounded = solve_bound(math.inf, n_stages, p // n_stages if space.uniform else None)
            if unbounded is not None:
                floors[n_stages] = unbounded[0]
                if bounding[0]:
                    continue
                own = _assemble(unbounded[1], cost, m, space, link_fn, exchange, fitted=fitted)
                if any(s.cost.detail is _PENDING for s in own.stages):
                    continue
                caps[n_stages] = 0.0 if m == 1 else max([s.cost.time for s in own.stages] + list(own.links)
                                                        + list(own.back_links or ()))
                if own.step_time < best_t:
                    best, best_t = own, own.step_time
                    progress.improved(best_t, own)

        if m == 1:
            # the step is the sum: no bound B gives less than the floor (docs/pipeline.md, *m = 1*)
            m1_floor[0] = min(floors.values(), default=math.inf)
            return best

        def queued(n: int, v: float) -> bool:
            return v < caps.get(n, math.inf)

        heap: list[tuple[float, int, float]] = [(fl + (m - 1) * v, n, v) for v in seen for n, fl in floors.items()
                                                if queued(n, v)]
        heapq.heapify(heap)
        fresh.clear()

        def push_new() -> None:
            for v in fresh:
                for n, fl in floors.items():
                    if queued(n, v):
                        heapq.heappush(heap, (fl + (m - 1) * v, n, v))
            fresh.clear()

        while heap:
            lb, n_stages, bound = heapq.heappop(heap)
            if lb >= best_t:
                break  # every other candidate's lower bound is at least as large
            stats["candidates"] += 1
            progress.tick(f"candidate {stats['candidates']}: {n_stages or 'any number of'} stages, "
                          f"bottleneck {bound:.4g} s, "
                          f"its floor {lb:.4g} s")
            got = solve_bound(bound, n_stages, p // n_stages if space.uniform else None)
            push_new()
            if got is None:
                continue
            total = got[0] + (m - 1) * bound
            if total >= best_t:
                continue
            view = fitted
            if bounding[0]:  # the plan's own stages at their proven seconds (keys as `effective` makes them)
                keys = [(a, b, q, float(min(len(got[1]) - i, m))) for i, (a, b, _, q) in enumerate(got[1])]
                view = {key: proven_of(key) for key in keys if key in fitted}
            plan = _assemble(got[1], cost, m, space, link_fn, exchange, fitted=view)
            pending = [(s.first, s.end, s.devices, s.in_flight) for s in plan.stages if s.cost.detail is _PENDING]
            if pending and not bounding[0]:
                # solve the stand-ins this relaxed optimum uses; the bound's value only grows, so `total` stays a
                # lower bound of it: back into the queue
                stats["lazy_rounds"] = stats.get("lazy_rounds", 0) + 1
                for key in pending:
                    if key in fitted:
                        pool.resolve(key)
                if not pool.lazy:
                    return None  # the floors rested on stand-ins that are not lower bounds: start again eagerly
                push_new()
                heapq.heappush(heap, (total, n_stages, bound))
                continue
            if plan.step_time < best_t:
                best, best_t = plan, plan.step_time
                if not bounding[0]:
                    progress.improved(best_t, plan)
        return best

    m1_floor = [math.inf]  # at m = 1: the least floor of the last pass (a lower bound of the part's optimum)
    found = optimum(incumbent)
    if fit_fn is not None and not pool.lazy:  # abandoned the stand-ins: the eager search
        found = optimum(incumbent)
    held()
    # the lower bound (module docstring): every relaxed value is at least `reached`; rho bounds how far the
    # solves' proven seconds fall below what they found
    reached = min(incumbent, found.step_time if found is not None else math.inf)
    rho = pool.rho()
    # at m = 1 the search stops at a floor within M1_RTOL of the best: the floor, not the best, bounds the part
    lower = rho * min(reached, m1_floor[0]) if m == 1 else rho * reached
    if rho < 1 - BOUND_PASS_RTOL and pool.lazy and math.isfinite(reached):
        bounding[0] = True
        t0 = time.perf_counter()
        relaxed = optimum(reached)
        stats["bound_pass_seconds"] = stats.get("bound_pass_seconds", 0.0) + time.perf_counter() - t0
        if m == 1:
            lower = max(lower, min(reached, m1_floor[0]))
        else:
            lower = max(lower, min(reached, relaxed.step_time if relaxed is not None else math.inf))
        held()
    return found, lower


_BREAK = object()  # a stage callback's answer: this extent and every longer one are out
_NOWHERE = (math.inf, None)  # a DP state from which no pipeline exists
_UNSEEN = object()  # not in a cache


def _stage_dp(space: PipelineSpace, n: int, qs: Sequence[int],
              stage: Callable[[int, int, int, int, int], "float | None | object"],
              between: Callable[[int, int, int, int], float | None] | None, stats: dict,
              counter: str, memo: dict | None = None,
              tick: Callable[..., None] | None = None,
              classes: int | None = None,
              floor: Callable[[int, int, int], "float | object"] | None = None,
              reachable: Callable[[int, int], bool] | None = None
              ) -> tuple[float, list[tuple[int, int, int, int]]] | None:
    """The least sum of stage values over pipelines of n placed stages tiling the machine in order: a DP over
    (first unit, first device, stages left, first stage's size). ``stage(a, b, o, q, r)``: the value of units [a,
    b) on the q devices from o with r stages left (itself included), None if not allowed, ``_BREAK`` if no
    longer extent from a is either; ``between(b, o, q, q2)``: the one-way seconds across the cut before unit b
    to a next stage of q2 devices, charged twice (None: not allowed); None when every cut is charged by the
    stages. Returns the least value and the stages (first, end, offset, devices), or None. ``memo``: a table of
    earlier calls with the same ``stage``, ``between`` and ``qs`` (any n), shared: a state's value does not
    depend on n. ``tick`` is called every 2^14 states (progress, interruption).

    ``classes`` = m: instead of exactly n stages, the least over *every* stage count (n is ignored), for a stage
    value that depends on the stages left r only through min(r, m) and r = 1 (1F1B's in-flight count and
    whether the stage is last): the state's third slot is then the class c = min(r, m) rather than r (c < m:
    exactly c stages left; c = m: m or more), so the DP has m layers instead of one per stage count
    (docs/pipeline.md, *Stage counts merged*). ``stage`` is then called with r = 1 for the last stage, c for
    c < m, and max(m, 2) otherwise (the same min(r, m) and r = 1 as every r of the class).

    ``floor(a, b, q)``: a lower bound of ``stage(a, b, o, q, r)`` for every o and r, or ``_BREAK`` when that is
    too; asked first: a stage whose floor plus the best of the rest cannot beat the state's best so far is not
    asked for (a bound within the DP: the states' values and choices are the same, ties included, since a
    choice is taken only when strictly better).

    ``reachable(a, o)``: False only when no pipeline of allowed stages covers units [a, U) on devices [o, p) (its
    states are worth infinity whatever their stages left or class and first size): such a state is answered at
    once and not kept in the memo (same values and choices; fewer states held).

    ``stats["dp_memo_entries_max"]``: the most states a memo held when a DP returned (the memo goes with its last
    holder: docs/pipeline.md, *The memo's memory*)."""
    if classes is not None:
        return _class_dp(space, classes, qs, stage, between, stats, counter, memo, tick, floor, reachable)
    U, p = space.num_units, space.num_devices
    ns = p if space.node_size is None or space.node_size >= p else space.node_size
    if memo is None:
        memo = {}
    q_min = min(qs)

    def opens(o: int, q: int, r: int) -> bool:
        """Whether a first stage of q devices at o can start r stages: it is placed there, the last one ends at
        p, and the r - 1 stages after it find at least (r - 1) q_min devices. A state that fails is worth
        infinity, asks for no stage and is not kept in the memo (docs/pipeline.md, *The memo's memory*)."""
        return _placeable(o, q, p, ns) and (r > 1 or o + q == p) and o + q + (r - 1) * q_min <= p

    def best_from(a: int, o: int, r: int, q: int) -> tuple[float, tuple | None]:
        key = (a, o, r, q)
        hit = memo.get(key)
        if hit is not None:
            return hit
        if reachable is not None and not reachable(a, o):
            stats["dp_states_unreachable"] = stats.get("dp_states_unreachable", 0) + 1
            return _NOWHERE
        stats[counter] = count = stats.get(counter, 0) + 1
        if tick is not None and not count & 0x3FFF:
            tick(work=STATE_WORK * 0x4000)
        best_v, best_arg = math.inf, None
        if opens(o, q, r):
            for b in ([U] if r == 1 else range(a + 1, U - r + 2)):
                if floor is not None:
                    lo = floor(a, b, q)
                    if lo is _BREAK:
                        break
                    if lo + (0.0 if r == 1 or between is not None else best_any(b, o + q, r - 1)[0]) >= best_v:
                        continue  # type: ignore[operator]
                here = stage(a, b, o, q, r)
                if here is _BREAK:
                    break
                if here is None:
                    continue
                if r == 1:
                    if here < best_v:  # type: ignore[operator]
                        best_v, best_arg = here, (b, None)
                    continue
                if between is None:
                    # no charge between the stages: the rest is the best over its first size, memoised apart
                    rest, q2 = best_any(b, o + q, r - 1)
                    if here + rest < best_v:  # type: ignore[operator]
                        best_v, best_arg = here + rest, (b, q2)  # type: ignore[operator]
                    continue
                for q2 in qs:
                    if not opens(o + q, q2, r - 1):
                        continue
                    lk = between(b, o, q, q2)
                    if lk is None:
                        continue
                    rest, _ = best_from(b, o + q, r - 1, q2)
                    if here + 2 * lk + rest < best_v:  # type: ignore[operator]
                        best_v, best_arg = here + 2 * lk + rest, (b, q2)  # type: ignore[operator]
        memo[key] = (best_v, best_arg)  # type: ignore[assignment]
        return memo[key]

    def best_any(a: int, o: int, r: int) -> tuple[float, int | None]:
        """min over the first stage's size q of best_from(a, o, r, q), and the first q attaining it."""
        key = (a, o, r)
        hit = memo.get(key)
        if hit is None and reachable is not None and not reachable(a, o):
            return _NOWHERE
        if hit is None:
            best_v, best_q = math.inf, None
            if o + r * q_min <= p:  # r stages need at least r q_min more devices
                for q2 in qs:
                    if not opens(o, q2, r):
                        continue
                    v = best_from(a, o, r, q2)[0]
                    if v < best_v:
                        best_v, best_q = v, q2
            memo[key] = hit = (best_v, best_q)
        return hit

    try:
        best_v, start = math.inf, None
        for q in qs:
            if not opens(0, q, n):
                continue
            v, _ = best_from(0, 0, n, q)
            if v < best_v:
                best_v, start = v, q
        if start is None:
            return None
        out = []
        a, o, r, q = 0, 0, n, start
        while True:
            b, q2 = memo[(a, o, r, q)][1]  # type: ignore[misc]
            out.append((a, b, o, q))
            if q2 is None:
                return best_v, out
            a, o, r, q = b, o + q, r - 1, q2
    finally:
        # best_from and best_any hold each other in their closure cells: a cycle that would keep the memo alive
        # after the call until a full cyclic collection (docs/pipeline.md, *The memo's memory*)
        best_from = best_any = None  # type: ignore[assignment]
        stats["dp_memo_entries_max"] = max(stats.get("dp_memo_entries_max", 0), len(memo))


def _class_dp(space: PipelineSpace, m: int, qs: Sequence[int],
              stage: Callable[[int, int, int, int, int], "float | None | object"],
              between: Callable[[int, int, int, int], float | None] | None, stats: dict,
              counter: str, memo: dict | None = None,
              tick: Callable[..., None] | None = None,
              floor: Callable[[int, int, int], "float | object"] | None = None,
              reachable: Callable[[int, int], bool] | None = None
              ) -> tuple[float, list[tuple[int, int, int, int]]] | None:
    """:func:`_stage_dp` with ``classes=m``: the least sum of stage values over pipelines of any stage count,
    a DP over (first unit, first device, class c = min(stages left, m), first stage's size). A state whose class
    asks for more stages than units are left (c > U - a: class c has at least c stages, each of one unit or
    more), or that ``reachable`` rules out, is worth infinity: answered at once and not kept in the memo."""
    U, p = space.num_units, space.num_devices
    ns = p if space.node_size is None or space.node_size >= p else space.node_size
    if memo is None:
        memo = {}
    q_min = min(qs)

    def after(c: int) -> tuple[int, ...]:
        """The classes of the stage after a stage of class c that is not the last."""
        if c < m:
            return (c - 1,)
        return (m, m - 1) if m >= 2 else (1,)

    def opens(o: int, q: int, c: int) -> bool:
        """Whether a first stage of q devices at o can start class c: it is placed there, the c - 1 or more
        stages after it find (c - 1) q_min devices, and a class-1 stage at m > 1 (the last) ends at p. A state
        that fails is worth infinity, asks for no stage and is not kept in the memo."""
        return _placeable(o, q, p, ns) and o + q + (c - 1) * q_min <= p and (c != 1 or m == 1 or o + q == p)

    def best_from(a: int, o: int, c: int, q: int) -> tuple[float, tuple | None]:
        key = (a, o, c, q)
        hit = memo.get(key)
        if hit is not None:
            return hit
        if a + c > U:
            return _NOWHERE  # c stages or more need c units or more
        if reachable is not None and not reachable(a, o):
            stats["dp_states_unreachable"] = stats.get("dp_states_unreachable", 0) + 1
            return _NOWHERE
        stats[counter] = count = stats.get(counter, 0) + 1
        if tick is not None and not count & 0x3FFF:
            tick(work=STATE_WORK * 0x4000)
        best_v, best_arg = math.inf, None
        # c < m: exactly c stages from here (c = 1: this is the last); c = m: at least m
        must_end = c == 1 and m > 1
        may_end = c == 1 and o + q == p
        if opens(o, q, c):
            r_on = c if c < m else max(m, 2)
            for b in ([U] if must_end else range(a + 1, U - c + 2)):
                last = b == U
                if last and not may_end:
                    continue
                if floor is not None:
                    lo = floor(a, b, q)
                    if lo is _BREAK:
                        break
                    rest = 0.0 if last or between is not None else min(best_any(b, o + q, c2)[0] for c2 in after(c))
                    if lo + rest >= best_v:  # type: ignore[operator]
                        continue
                here = stage(a, b, o, q, 1 if last else r_on)
                if here is _BREAK:
                    break
                if here is None:
                    continue
                if last:
                    if here < best_v:  # type: ignore[operator]
                        best_v, best_arg = here, (b, None, None)
                    continue
                for c2 in after(c):
                    if between is None:
                        rest, q2 = best_any(b, o + q, c2)
                        if here + rest < best_v:  # type: ignore[operator]
                            best_v, best_arg = here + rest, (b, q2, c2)  # type: ignore[operator]
                        continue
                    for q2 in qs:
                        if not opens(o + q, q2, c2):
                            continue
                        lk = between(b, o, q, q2)
                        if lk is None:
                            continue
                        rest, _ = best_from(b, o + q, c2, q2)
                        if here + 2 * lk + rest < best_v:  # type: ignore[operator]
                            best_v, best_arg = here + 2 * lk + rest, (b, q2, c2)  # type: ignore[operator]
        memo[key] = (best_v, best_arg)  # type: ignore[assignment]
        return memo[key]

    def best_any(a: int, o: int, c: int) -> tuple[float, int | None]:
        """min over the first stage's size q of best_from(a, o, c, q), and the first q attaining it."""
        key = (a, o, c)
        hit = memo.get(key)
        if hit is None and (a + c > U or reachable is not None and not reachable(a, o)):
            return _NOWHERE
        if hit is None:
            best_v, best_q = math.inf, None
            if o + c * q_min <= p:
                for q2 in qs:
                    if not opens(o, q2, c):
                        continue
                    v = best_from(a, o, c, q2)[0]
                    if v < best_v:
                        best_v, best_q = v, q2
            memo[key] = hit = (best_v, best_q)
        return hit

    try:
        best_v, start = math.inf, None
        for c in range(1, m + 1):
            for q in qs:
                if not opens(0, q, c):
                    continue
                v, _ = best_from(0, 0, c, q)
                if v < best_v:
                    best_v, start = v, (c, q)
        if start is None:
            return None
        out = []
        a, o, (c, q) = 0, 0, start
        while True:
            b, q2, c2 = memo[(a, o, c, q)][1]  # type: ignore[misc]
            out.append((a, b, o, q))
            if q2 is None:
                return best_v, out
            a, o, c, q = b, o + q, c2, q2
    finally:
        best_from = best_any = None  # type: ignore[assignment]  # the closures' cycle, as in _stage_dp
        stats["dp_memo_entries_max"] = max(stats.get("dp_memo_entries_max", 0), len(memo))


ORDER_RTOL = 0.01  # step floors of micro-batch counts within 1 % of the least are equal for the parts' order
BOUND_PASS_RTOL = 1e-6  # below this the solves' own ratio already bounds the 1F1B optimum: no second pass
M1_RTOL = 1e-9  # at m = 1 a floor within this of the best plan closes the part (its bound is then the floor)


_PENDING = "memory-constrained optimum not yet solved: a lower-bound stand-in"


def _assemble(segments: Sequence[tuple[int, int, int, int]], cost, m: int, space: PipelineSpace, link_fn: LinkFn,
              exchange: ExchangeFn | None, schedule: str = "1f1b", fitted: dict | None = None) -> PipelinePlan:
    """The plan of placed stages ``(first unit, end unit, offset, devices)`` whose costs are known (``fitted``:
    memory-constrained costs by (a, b, q, in flight), used where the plain one does not fit)."""
    p = space.num_devices
    ns = p if space.node_size is None or space.node_size >= p else space.node_size
    n = len(segments)
    k = in_flight(n, m, schedule)
    budget = math.inf if space.budget is None else space.budget

    def pick(i: int, a: int, b: int, q: int) -> StageCost:
        c = cost(a, b, q)
        if fitted is not None and (c is None or c.memory(k[i]) > budget) and fitted.get((a, b, q, k[i])):
            return fitted[(a, b, q, k[i])]
        return c

    stages = tuple(Stage(a, b, o, q, pick(i, a, b, q), k[i]) for i, (a, b, o, q) in enumerate(segments))
    cuts = [_cut_times(stages[i].cost, stages[i + 1].cost, stages[i + 1].offset, ns, stages[i].end,
                       stages[i].devices, stages[i + 1].devices, m, link_fn, exchange) for i in range(n - 1)]
    links, back = tuple(c[0] for c in cuts), tuple(c[1] for c in cuts)
    times = [StageTimes(s.cost.forward, s.cost.backward, weight_grad=s.cost.weight_grad) for s in stages]
    return PipelinePlan(stages, m, schedule, 1, links, step_time(times, links, m, schedule, back=back), space.budget,
                        back_links=back)


def _stand_in(c: StageCost, floor: float = 0.0) -> StageCost:
    """A lower bound of a stage's memory-constrained optimum before it is solved: its time-optimal seconds, no
    memory, no transfers (the search module docstring); raised to ``floor`` seconds (forward, backward and W in
    proportion) when a proven lower bound of the constrained optimum is known from outside and is larger."""
    if floor > c.time > 0:
        r = floor / c.time
        c = replace(c, forward=c.forward * r, backward=c.backward * r, weight_grad=c.weight_grad * r)
    return replace(c, weight_bytes=0.0, activation_bytes=0.0, recv_bytes=0.0, grad_bytes=0.0, detail=_PENDING)


def _at_proven(c: StageCost) -> StageCost:
    """The stage with its seconds scaled down to its proven lower bound (forward, backward and W alike)."""
    if c.lower is None or not c.time > 0:
        return c
    r = c.proven / c.time
    return replace(c, forward=c.forward * r, backward=c.backward * r, weight_grad=c.weight_grad * r, lower=None)


def _interleaved_plan(costs: Sequence[StageCost], chunks: Sequence[tuple[int, int]], n: int, q: int, m: int,
                      v: int, space: PipelineSpace, link_fn: LinkFn, exchange: ExchangeFn | None) -> PipelinePlan:
    """The interleaved plan of chunk costs (chunk j on device group j mod n) and its step time."""
    p = space.num_devices
    ns = p if space.node_size is None or space.node_size >= p else space.node_size
    k = in_flight(n, m, "interleaved", v)
    links, back = [], []
    for j in range(n * v - 1):
        o, o2 = (j % n) * q, ((j + 1) % n) * q
        inter = (o // ns) != (o2 // ns)
        if exchange is None:
            links.append(link_fn(chunks[j][1], q, q, m, inter))
            back.append(links[-1])
        else:
            links.append(_exchanged(exchange, costs[j + 1].recv_bytes, inter))
            back.append(_exchanged(exchange, costs[j].grad_bytes, inter))
    stages = tuple(Stage(a, b, (j % n) * q, q, costs[j], k[j % n]) for j, (a, b) in enumerate(chunks))
    times = [StageTimes(sum(costs[j].forward for j in range(d, n * v, n)),
                        sum(costs[j].backward for j in range(d, n * v, n))) for d in range(n)]
    t = step_time(times, [max(links[d::n]) for d in range(n - 1)], m, "interleaved", v,
                  back=[max(back[d::n]) for d in range(n - 1)])
    return PipelinePlan(stages, m, "interleaved", v, tuple(links), t, space.budget, back_links=tuple(back))


def interleaved_chunkings(num_units: int, chunks: int) -> list[tuple[tuple[int, int], ...]]:
    """The chunkings the interleaved search considers (module docstring, *Interleaved*): the units dealt evenly
    into ``chunks`` contiguous runs (``round(j U / chunks)``), and Megatron-LM's layout, the first and the last
    unit (embedding, head) riding with the first and the last chunk and the U - 2 units between dealt evenly
    (equal when ``chunks`` divides them), when it differs; no chunking when a chunk would be empty."""
    out: list[tuple[tuple[int, int], ...]] = []
    if num_units >= chunks:
        b = [round(j * num_units / chunks) for j in range(chunks + 1)]
        out.append(tuple((b[j], b[j + 1]) for j in range(chunks)))
    if num_units - 2 >= chunks:
        b = [1 + round(j * (num_units - 2) / chunks) for j in range(chunks + 1)]
        b[0], b[-1] = 0, num_units
        mega = tuple((b[j], b[j + 1]) for j in range(chunks))
        if mega not in out:
            out.append(mega)
    return out


def _search_interleaved(space: PipelineSpace, stage_fn: StageFn, link_fn: LinkFn, m: int, v: int,
                        exchange: ExchangeFn | None = None, group_fit_fn: GroupFitFn | None = None,
                        incumbent: float = math.inf, stats: dict | None = None,
                        units: Callable[[int], Sequence[float]] | None = None,
                        tick: Callable[..., None] | None = None) -> tuple[PipelinePlan | None, float]:
    """Interleaved 1F1B with v chunks over its space (module docstring): every group count S on equal sub-meshes
    with m a multiple of S, each chunking of :func:`interleaved_chunkings`. Returns the best candidate below
    ``incumbent`` (else None) and a proven lower bound of the family's optimum at (m, v): rho min(incumbent,
    best), rho the least proven/found ratio of the group solves (the step is nondecreasing and positively
    homogeneous in the groups' seconds). A group count whose bound over *every* chunking
    (:func:`_interleaved_family_bound` on ``units(q)``, the unit seconds on q devices; recorded in
    ``stats["interleaved_any_chunking_bound"]``) reaches the best known is not enumerated. A device group whose
    time-optimal chunks do not fit takes its joint memory-constrained optimum (``group_fit_fn``), solved only
    when the candidate's value with stand-ins for such groups is below the best known."""
    if units is None:
        units = lambda q: _unit_seconds(space, stage_fn, m, q)  # noqa: E731
    U, p = space.num_units, space.num_devices
    sizes = space.allowed_sizes()
    budget = math.inf if space.budget is None else space.budget
    stats = {} if stats is None else stats
    best: PipelinePlan | None = None
    best_t = incumbent
    ratios = [1.0]
    for n in range(2, min(space.max_stages or U, p) + 1):
        q = p // n
        if p % n or q not in sizes or m % n or U < n * v:
            continue
        bound = _interleaved_family_bound(units(q), n, m, v)
        stats["interleaved_any_chunking_bound"] = min(stats.get("interleaved_any_chunking_bound", math.inf), bound)
        if bound >= best_t:
            stats["interleaved_pruned"] = stats.get("interleaved_pruned", 0) + 1
            continue
        for chunks in interleaved_chunkings(U, n * v):
            if tick is not None:
                tick(f"{n} device groups")
            got = [stage_fn(a, b, q, m) for a, b in chunks]
            if any(c is None for c in got):
                continue
            costs: list[StageCost] = got  # type: ignore[assignment]
            k = in_flight(n, m, "interleaved", v)
            over = [d for d in range(n) if sum(costs[j].weight_bytes for j in range(d, n * v, n))
                    + k[d] * sum(costs[j].activation_bytes for j in range(d, n * v, n)) > budget]
            if over:
                if group_fit_fn is None:
                    continue
                relaxed = list(costs)
                for d in over:
                    for j in range(d, n * v, n):
                        relaxed[j] = _stand_in(costs[j])
                lb = _interleaved_plan(relaxed, chunks, n, q, m, v, space, link_fn, exchange).step_time
                if lb >= best_t:
                    continue  # not solved: its stand-in value already reaches the best
                feasible = True
                for d in over:
                    mine = [(j, chunks[j]) for j in range(d, n * v, n)]
                    fit = group_fit_fn(tuple(c for _, c in mine), q, m, k[d], budget)
                    stats["group_fit_evaluations"] = stats.get("group_fit_evaluations", 0) + 1
                    if fit is None:
                        feasible = False  # nothing fits this group: the candidate is not in the space
                        break
                    total = sum(c.time for c in fit)
                    if total > 0:
                        ratios.append(sum(c.proven for c in fit) / total)
                    for (j, _), c in zip(mine, fit):
                        costs[j] = c
                if not feasible:
                    continue
            plan = _interleaved_plan(costs, chunks, n, q, m, v, space, link_fn, exchange)
            if plan.step_time < best_t:
                best, best_t = plan, plan.step_time
    return best, min(ratios) * best_t


FAMILY_SAFETY = 1 - 1e-12  # the family bounds are sums of unit seconds in another order than a stage's own: rounding


def _unit_seconds(space: PipelineSpace, stage_fn: StageFn, m: int, q: int) -> list[float]:
    """Per unit u, a proven lower bound of the seconds of the stage ``[u, u + 1)`` alone on q devices at m (its
    ``proven`` seconds; 0 when it cannot be costed, which bounds anything). By superadditivity (module
    docstring, *Family bounds*) a stage's or a device group's least seconds on q are at least the sum of its
    units'."""
    out = []
    for u in range(space.num_units):
        c = stage_fn(u, u + 1, q, m)
        out.append(max(0.0, c.proven) if c is not None else 0.0)
    return out


def _minmax_cut(units: dict[int, Sequence[float]], p: int, stages: int) -> float:
    """The least, over cuts of the units into ``stages`` non-empty contiguous runs, run i on q_i devices (q_i a
    key of ``units``, sum q_i = p), of max_i (sum of run i's unit seconds on q_i); inf if there is none
    (:func:`_minmax_cuts` for one count)."""
    return _minmax_cuts(units, p, (stages,))[stages]


def _minmax_cuts(units: dict[int, Sequence[float]], p: int, counts: Sequence[int],
                 granule: int = 1) -> dict[int, float]:
    """:func:`_minmax_cut` for every stage count in ``counts`` at once: a DP over (runs placed, devices used)
    with a vector over the units covered, whose layer s serves every count (placement offsets are relaxed: any
    sizes summing to p, a superset of the tilings the search places). Each transition (devices used d, next
    size q) is one matrix operation: new[b] = min over u < b of max(best[u], W_q[u, b]), W_q[u, b] the seconds of
    units [u, b) on q.

    ``granule`` g > 1 (dividing p): devices are counted in whole granules, a run on q devices taking
    floor(q / g) of the p / g (a sub-node run none), and the runs may take fewer than all: every cut whose sizes
    sum to p has floor-sums at most p / g, so this is a relaxation (a lower bound of the g = 1 value) with g
    times fewer device counts to carry."""
    out = {n: math.inf for n in counts}
    if not counts:
        return out
    U = len(next(iter(units.values())))
    top = min(max(counts), U)
    wide: dict[int, np.ndarray] = {}
    for q, w in units.items():
        pre = np.concatenate(([0.0], np.cumsum(np.asarray(w, dtype=float))))
        mat = pre[None, :] - pre[:, None]  # [u, b]: units [u, b)
        mat[np.tril_indices(U + 1)] = np.inf  # b <= u: no run
        wide[q] = mat
    g = granule if granule > 1 and p % granule == 0 else 1
    cap = p // g
    take = {q: q // g for q in wide}
    q_min = min(take.values())
    layer: dict[int, np.ndarray] = {0: np.full(U + 1, np.inf)}
    layer[0][0] = 0.0
    for s in range(1, top + 1):
        nxt: dict[int, np.ndarray] = {}
        for d, best in layer.items():
            rows = np.flatnonzero(np.isfinite(best))
            if rows.size == 0:
                continue
            for q, mat in wide.items():
                e = d + take[q]  # devices (granules) used after this run
                if e > cap or (g == 1 and e < p and e + q_min > p and s < top):
                    continue  # past the devices, or short of them with no room for another run
                vals = np.maximum(best[rows, None], mat[rows]).min(axis=0)
                row = nxt.get(e)
                if row is None:
                    nxt[e] = vals
                else:
                    np.minimum(row, vals, out=row)
        layer = nxt
        if s in out:
            ends = [layer[p]] if g == 1 and p in layer else list(layer.values()) if g > 1 else []
            out[s] = float(min((v[U] for v in ends), default=math.inf))
    return out


def _min_sum_cut(units: dict[int, Sequence[float]], p: int, granule: int = 1) -> float:
    """A lower bound of the least sum over cuts of the units into *two or more* runs, run i on q_i devices
    (q_i a key of ``units``, sum q_i = p), of the sum of run i's unit seconds on q_i (exact for g = 1); with
    ``granule`` g > 1 (dividing p) devices are counted in whole granules, a run on q taking floor(q / g), at
    most p / g in all: a relaxation as in :func:`_minmax_cuts`. A DP over (units covered, runs so far 1 or more than 1, granules used), one matrix
    operation per (first unit, size)."""
    U = len(next(iter(units.values())))
    g = granule if granule > 1 and p % granule == 0 else 1
    cap = p // g
    pres = {q: np.concatenate(([0.0], np.cumsum(np.asarray(w, dtype=float)))) for q, w in units.items()}
    # f[k][u, d]: least sum over cuts of units [0, u) into k runs (k = 2: two or more) using d granules
    f = [np.full((U + 1, cap + 1), np.inf) for _ in range(3)]
    f[0][0, 0] = 0.0
    for u in range(U):
        for k in (0, 1, 2):
            row = f[k][u]
            if not np.isfinite(row).any():
                continue
            k2 = min(k + 1, 2)
            for q, pre in pres.items():
                t = q // g
                if t > cap:
                    continue
                run = pre[u + 1:] - pre[u]  # units [u, b) for b = u + 1 .. U
                vals = row[None, : cap + 1 - t] + run[:, None]
                np.minimum(f[k2][u + 1:, t:], vals, out=f[k2][u + 1:, t:])
    return float(f[2][U][cap] if g == 1 else f[2][U].min())  # g = 1: the sizes sum to p exactly


def _one_f_one_b_family_bound(units: dict[int, Sequence[float]], p: int, m: int, granule: int = 1) -> float:
    """A lower bound of the 1F1B step at m over every pipeline whose stages are runs of the units on sizes from
    ``units`` summing to p (docs/pipeline.md, *Family bounds*), from the unit seconds alone. One stage on p:
    m sum_u w_p(u). Two or more: sum_i t_i + (m - 1) t_max with sum_i t_i at least the least unit sum over such
    cuts (:func:`_min_sum_cut`) and t_max at least t_lo = max(sum_u min_q q w_q(u) / p, max_u min_q w_q(u)) (the
    largest stage is at least the device-weighted mean, sum_i q_i t_i / p, and at least the stage of any one
    unit); and sum_i t_i >= t_max: the step is at least max(least sum + (m - 1) t_lo, m t_lo)."""
    arr = {q: np.asarray(w, dtype=float) for q, w in units.items()}
    one = m * float(arr[p].sum()) if p in arr else math.inf
    table = np.stack([q * w for q, w in arr.items()])
    per_unit = np.stack(list(arr.values())).min(axis=0)
    t_lo = max(float(table.min(axis=0).sum()) / p, float(per_unit.max(initial=0.0)))
    more = _min_sum_cut(units, p, granule)
    return min(one, max(more + (m - 1) * t_lo, m * t_lo)) * FAMILY_SAFETY


CUT_GRANULES = 128  # the capped cut DPs count devices in at most this many granules (coarser: a relaxation)


def _run_tables(weights: dict[int, np.ndarray], limits: dict[int, np.ndarray], cap: float, p: int,
                granule: int) -> tuple[int, dict[int, list[tuple[int, np.ndarray]]]]:
    """The runs of the capped cut DPs, by granules taken: (granules in all, {t: per first unit u, (how many runs
    start there, their least weight over the sizes q with floor(q / g) = t whose run is within the cap)}).

    g is ``granule`` (1: devices counted one by one), made coarser (a multiple of it) until p / g is at most
    :data:`CUT_GRANULES`. Every cut whose sizes sum to p has sum_i floor(q_i / g) <= floor(p / g), so the runs may
    take at most that many granules in all, and fewer: a relaxation of the cuts (exact for g = 1, where they must
    take p)."""
    U = len(next(iter(weights.values())))
    g = max(1, granule)
    while p // g > CUT_GRANULES:
        g *= 2
    top = p // g
    over = cap * (1 + 1e-9)
    groups: dict[int, np.ndarray] = {}
    for q, w in weights.items():
        t = q // g
        if t > top:
            continue
        wpre = np.concatenate(([0.0], np.cumsum(np.asarray(w, dtype=float))))
        lpre = np.concatenate(([0.0], np.cumsum(np.asarray(limits[q], dtype=float))))
        mat = np.where(lpre[None, :] - lpre[:, None] <= over, wpre[None, :] - wpre[:, None], np.inf)
        mat[np.tril_indices(U + 1)] = np.inf  # [u, b): b > u only
        got = groups.get(t)
        groups[t] = mat if got is None else np.minimum(got, mat)
    tables: dict[int, list[tuple[int, np.ndarray]]] = {}
    for t, mat in groups.items():
        rows = []
        for u in range(U):
            fin = np.flatnonzero(np.isfinite(mat[u, u + 1:]))
            last = int(fin[-1]) + 1 if fin.size else 0
            rows.append((last, mat[u, u + 1:u + 1 + last]))
        tables[t] = rows
    return top, tables


def _capped_sum_cuts(weights: dict[int, np.ndarray], limits: dict[int, np.ndarray], cap: float, p: int,
                     counts: Sequence[int] | None = None, granule: int = 1) -> dict[int, float]:
    """The least, over cuts of the units into contiguous runs, run i on q_i devices (q_i a key of ``weights``, sum
    q_i = p), of sum_i sum_{u in run i} weights[q_i][u], over the cuts whose every run has sum_{u in run}
    limits[q_i][u] <= cap (within 1e-9 relative: a run is left out only when above it); per run count n in
    ``counts`` (inf where none), or with ``counts`` None over every count (key 0). ``granule`` g > 1: devices
    counted in whole granules as in :func:`_min_sum_cut`, coarser past :data:`CUT_GRANULES` (:func:`_run_tables`:
    a relaxation, a lower bound of the g = 1 value). A DP over (units covered, granules used), a layer per run
    placed when counting, one vector operation per (first unit, granules taken)."""
    U = len(next(iter(weights.values())))
    top, tables = _run_tables(weights, limits, cap, p, granule)
    exact = top == p  # devices one by one: the sizes must sum to p

    def step(f: np.ndarray, into: np.ndarray) -> None:
        for u in range(U):  # (in place, f is into: row u is final when it is read, runs only move forward)
            row = f[u]
            if not np.isfinite(row).any():
                continue
            for t, rows in tables.items():
                last, run = rows[u]
                if last:
                    vals = row[None, : top + 1 - t] + run[:, None]
                    np.minimum(into[u + 1:u + 1 + last, t:], vals, out=into[u + 1:u + 1 + last, t:])

    def value(f: np.ndarray) -> float:
        return float(f[U, top] if exact else f[U].min())

    f = np.full((U + 1, top + 1), np.inf)  # f[u, d]: least sum over cuts of units [0, u) using d granules
    f[0, 0] = 0.0
    if counts is None:
        step(f, f)
        return {0: value(f)}
    out = {n: math.inf for n in counts}
    for n in range(1, min(max(counts, default=0), U) + 1):
        nxt = np.full((U + 1, top + 1), np.inf)
        step(f, nxt)
        f = nxt
        if n in out:
            out[n] = value(f)
        if not np.isfinite(f).any():
            break
    return out


def _capped_sum_cut(weights: dict[int, np.ndarray], limits: dict[int, np.ndarray], cap: float, p: int,
                    granule: int = 1) -> float:
    """:func:`_capped_sum_cuts` over every run count (one or more)."""
    return _capped_sum_cuts(weights, limits, cap, p, None, granule)[0]


def _zb_bubble_weights(units: dict[int, Sequence[float]], forward: Sequence[float], p: int,
                       m: int) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
    """ZB-H1's per-unit weights (m - 1) q l_q(u) / p + F_u / q and limits l_q(u) (:func:`_bubble_bound`)."""
    lim = {q: np.asarray(w, dtype=float) for q, w in units.items()}
    fw = np.asarray(forward, dtype=float)
    return {q: (m - 1) * q * w / p + fw / q for q, w in lim.items()}, lim


def _zb_bubble_counts(units: dict[int, Sequence[float]], forward: Sequence[float], p: int, m: int,
                      incumbent: float, counts: Sequence[int], granule: int = 1,
                      bottleneck: dict[int, float] | None = None) -> dict[int, float]:
    """Per stage count n: a lower bound of min(incumbent, the n-stage ZB-H1 optimum at m) that counts the fill
    and drain (docs/pipeline.md, *Bubble bounds*): every n-stage pipeline within the cap (every l_i <= incumbent
    / m) has T >= (m - 1) t_max + sum_i F_i / q_i with t_max at least both the device-weighted mean of the l_i
    and ``bottleneck[n]`` (the least largest l_i over n-stage cuts, :func:`_minmax_cuts`), so T is at least the
    least sum_i ((m - 1) q_i l_i / p + F_i / q_i) and at least (m - 1) bottleneck[n] + the least sum_i F_i / q_i,
    each over the n-stage cuts within the cap (:func:`_capped_sum_cuts`; no incumbent: every cut)."""
    if not units:
        return {n: 0.0 for n in counts}
    weights, lim = _zb_bubble_weights(units, forward, p, m)
    cap = incumbent / m
    got = _capped_sum_cuts(weights, lim, cap, p, counts, granule)
    if bottleneck:
        fw = np.asarray(forward, dtype=float)
        fill = _capped_sum_cuts({q: fw / q for q in lim}, lim, cap, p, counts, granule)
        got = {n: max(v, (m - 1) * bottleneck.get(n, 0.0) + fill[n]) for n, v in got.items()}
    return {n: min(incumbent, v * FAMILY_SAFETY) for n, v in got.items()}


def _bubble_bound(units: dict[int, Sequence[float]], forward: Sequence[float] | None, p: int, m: int,
                  incumbent: float, schedule: str, granule: int = 1) -> float:
    """A lower bound of min(incumbent, the family's optimum at m) over every pipeline whose stages are runs of the
    units on sizes from ``units`` summing to p, counting the fill and drain (docs/pipeline.md, *Bubble bounds*).

    ``units[q][u]``: a lower bound of unit u's share of any stage's seconds on q (a stage takes t_i >= the sum
    over its units, l_i); ``forward[u]``: unit u's forward device-seconds (a stage's forward f_i >= their sum over
    q_i). With t_max >= sum_i q_i t_i / p (the sizes sum to p):

    - 1F1B: T >= sum_i t_i + (m - 1) t_max >= sum_i l_i (1 + (m - 1) q_i / p);
    - ZB-H1 (S <= m): W + Y <= t_j - f_j for every stage j, so sum_i t_i - (S - 1)(W + Y) >= t_j + sum_{i != j}
      f_i and T >= (m - 1) t_max + sum_i f_i >= sum_i ((m - 1) q_i l_i / p + F_i / q_i).

    Both are sums over units: the least over cuts whose every stage has l_i <= incumbent / m
    (:func:`_capped_sum_cut`); a pipeline with a larger stage takes T >= m t_max > incumbent. With no incumbent
    (inf) the least is over every cut: a lower bound of the optimum itself."""
    if not units:
        return 0.0
    cap = incumbent / m
    lim = {q: np.asarray(w, dtype=float) for q, w in units.items()}
    if schedule == "zb-h1":
        if forward is None:
            return 0.0
        weights, lim = _zb_bubble_weights(units, forward, p, m)
    else:
        weights = {q: w * (1 + (m - 1) * q / p) for q, w in lim.items()}
    return min(incumbent, _capped_sum_cut(weights, lim, cap, p, granule) * FAMILY_SAFETY)


def _zb_family_bound(units: dict[int, Sequence[float]], p: int, stages: int, m: int) -> float:
    """A lower bound of ZB-H1's step over every cut of the units into ``stages`` stages on sub-meshes from
    ``units``' sizes: ``m`` times the least bottleneck :func:`_minmax_cut` (module docstring, *Family bounds*)."""
    return m * _minmax_cut(units, p, stages) * FAMILY_SAFETY


def _interleaved_family_bound(units: Sequence[float], groups: int, m: int, v: int) -> float:
    """A lower bound of the interleaved step (v chunks per device group, ``groups`` groups on equal sub-meshes)
    over every chunking: with W the sum of the unit seconds and t_max >= max(W / S, max unit),
    ``(m - 1/v) t_max + W / v`` (module docstring, *Family bounds*)."""
    w = float(sum(units))
    t_max = max(w / groups, max(units, default=0.0))
    return ((m - 1.0 / v) * t_max + w / v) * FAMILY_SAFETY


def _search_zb_h1(space: PipelineSpace, stage_fn: StageFn, link_fn: LinkFn, m: int, exchange: ExchangeFn | None,
                  fit_fn: FitFn | None = None,
                  incumbent: float = math.inf, stats: dict | None = None,
                  units: Callable[[int], Sequence[float]] | None = None,
                  first_stages: int = 1, progress: Progress | None = None,
                  hint: Callable[[float], None] | None = None,
                  stage_lower: StageLowerFn | None = None,
                  prefer: int | None = None, phi: float = 0.0,
                  forward: Sequence[float] | None = None) -> tuple[PipelinePlan | None, float]:
    """The ZB-H1 optimum at m over every cut and sub-mesh sequence of every stage count ``first_stages`` <= S <= m
    (module docstring,
    *ZB-H1*) if below ``incumbent``, and a proven lower bound of it: each stage count whose family bound
    (:func:`_zb_family_bound`) is below the best known is searched exactly (:func:`_zb_branch_and_bound`). A
    stage whose time-optimal plan does not fit S in flight takes its memory-constrained optimum (``fit_fn``),
    solved lazily. ``hint(bound)`` hears the family's bound once the stage counts' bounds are known (min over
    the counts of m B_0; 0 when the stand-ins are found void): what the part has proven if it is interrupted.
    ``prefer``: a stage count searched first (the best seed's), the others in increasing order; each count's
    search is exact given the best plan so far, so the order changes only how much is solved. ``phi``: a lower
    bound of the largest forward seconds among the stages of every pipeline at m (0: none known). ``forward``:
    per unit, its forward device-seconds at m: the part is then first bounded with its fill and drain
    (:func:`_bubble_bound`) and closed when that reaches ``incumbent``."""
    U, p = space.num_units, space.num_devices
    sizes = space.allowed_sizes()
    budget = math.inf if space.budget is None else space.budget
    stats = {} if stats is None else stats
    if units is None:
        units = lambda q: _unit_seconds(space, stage_fn, m, q)  # noqa: E731
    s_max = min(space.max_stages or U, U, p, m)

    def family_sizes(n: int) -> tuple[int, ...]:
        if space.uniform:
            return (p // n,) if p % n == 0 and p // n in sizes else ()
        return tuple(q for q in sizes if q <= p)

    # the family bound m B_0 of each stage count; B_0 bounds the pipeline's max term (module docstring)
    if space.uniform:
        floors = {n: _zb_family_bound({q: units(q) for q in family_sizes(n)}, p, n, m) / m if family_sizes(n)
                  else math.inf for n in range(first_stages, s_max + 1)}
    else:
        # every count has the same sizes: one min-max DP serves them all (its layer n is count n's)
        counts = range(first_stages, s_max + 1)
        ns = p if space.node_size is None or space.node_size >= p else space.node_size
        cut = _minmax_cuts({q: units(q) for q in family_sizes(0)}, p, counts, granule=ns) if counts else {}
        floors = {n: cut[n] * FAMILY_SAFETY for n in counts}
    # per count, a lower bound of min(incumbent, its optimum): m B_0, raised by the fill and drain
    count_lb = {n: m * f for n, f in floors.items()}
    if forward is not None and math.isfinite(incumbent) and floors:
        ns = p if space.node_size is None or space.node_size >= p else space.node_size
        bubble = _zb_bubble_counts({q: units(q) for q in sizes if q <= p}, forward, p, m, incumbent, list(floors),
                                   ns, {n: f / FAMILY_SAFETY for n, f in floors.items() if math.isfinite(f)})
        count_lb = {n: max(min(v, incumbent), bubble[n]) for n, v in count_lb.items()}
        stats.setdefault("zb_bubble_bounds", {})[str(m)] = min(count_lb.values())  # a JSON key: the plan round-trips
        stats["zb_closed_by_bubble"] = stats.get("zb_closed_by_bubble", 0) + sum(
            m * floors[n] < incumbent * (1 - ZB_TOL) <= bubble[n] for n in floors)
    if hint is not None:
        hint(min(count_lb.values(), default=math.inf))
    best: PipelinePlan | None = None

    def best_t() -> float:
        return min(incumbent, best.step_time if best is not None else math.inf)

    pool = _StagePool(stage_fn, fit_fn, m, budget, stats, tick=None if progress is None else progress.tick,
                      stage_lower=stage_lower)
    while True:
        lower = math.inf
        try:
            counts = list(range(first_stages, s_max + 1))
            if prefer in floors:
                counts = [prefer] + [n for n in counts if n != prefer]
            for n in counts:
                if count_lb[n] >= best_t() * (1 - ZB_TOL):
                    stats["zb_pruned"] = stats.get("zb_pruned", 0) + 1
                    lower = min(lower, count_lb[n])
                    continue
                found, lb = _zb_branch_and_bound(pool, space, n, p // n if space.uniform else None, m, link_fn,
                                                 exchange, floors[n], best_t(), stats, progress, phi,
                                                 start=count_lb[n])
                lower = min(lower, lb)
                if found is not None and found.step_time < best_t():
                    best = found
            break
        except _Abandoned:
            # a memory-constrained solve came out below its time-optimal stage: the stand-ins and the family
            # bounds (which rest on the same order) are void; every stage count again, eagerly, without them
            floors = {n: 0.0 if math.isfinite(v) else v for n, v in floors.items()}
            count_lb = {n: m * f for n, f in floors.items()}
            if hint is not None:
                hint(0.0)
    return best, pool.rho() * lower


class _StagePool:
    """Stage costs at one m with k micro-batches in flight, for the 1F1B and ZB-H1 searches: the time-optimal
    plan where it fits, else the memory-constrained optimum (``fit_fn``); while ``lazy``, an unsolved one is a
    stand-in (:func:`_stand_in`: a lower bound of its seconds; in ZB-H1's search it passes every W / Y floor,
    the relaxation's choice). ``on_new(cost, solved)`` hears of every cost first computed (time-optimal or
    memory-constrained)."""

    def __init__(self, stage_fn: StageFn, fit_fn: FitFn | None, m: int, budget: float, stats: dict,
                 on_new: Callable[[StageCost, bool], None] | None = None,
                 tick: Callable[..., None] | None = None, stage_lower: StageLowerFn | None = None) -> None:
        self.stage_fn, self.fit_fn, self.m, self.budget, self.stats = stage_fn, fit_fn, m, budget, stats
        self.stage_lower = stage_lower
        self.on_new = on_new
        self.tick: Callable[..., None] = tick if tick is not None else (lambda *_, **__: None)
        self.plain_costs: dict[tuple[int, int, int], StageCost | None] = {}
        self.fitted: dict[tuple[int, int, int, float], StageCost | None] = {}
        self.lazy = fit_fn is not None
        # proven lower bounds of memory-constrained stages known from outside, by (a, b, q, k): their stand-ins
        self.known_lower: dict[tuple[int, int, int, float], float] = {}
        self.version = 0  # counts the solves that changed a cost (a DP's memo is valid for one version)
        self._unit_lower: dict[int, list[float]] = {}
        self._work: dict[tuple[int, ...], list[float]] = {}
        # the memory-constrained solves of each stage (a, b, q) by in-flight count, and the lower bound each
        # stand-in took from them (docs/pipeline.md, *Stand-ins from fewer in flight*)
        self._fits: dict[tuple[int, int, int], dict[float, StageCost | None]] = {}
        self._inherited: dict[tuple[int, int, int, float], float] = {}
        self._none_from_fewer: set[tuple[int, int, int, float]] = set()

    def _from_fewer(self, a: int, b: int, q: int, k: float) -> float | None:
        """A proven lower bound of the stage's memory-constrained optimum with k in flight from its solves with
        fewer (the optimum is nondecreasing in k: a plan that fits k fits fewer), or None when nothing fit
        fewer, so nothing fits k."""
        low = 0.0
        for k1, c in self._fits.get((a, b, q), {}).items():
            if k1 < k:
                if c is None:
                    return None
                low = max(low, c.proven)
        return low

    def bounded(self) -> bool:
        """Whether the time-optimal seconds bound every stage's (False once a memory-constrained solve came out
        below them: then neither they nor :meth:`lower` may prune)."""
        return self.fit_fn is None or self.lazy

    def lower(self, a: int, b: int, q: int) -> float:
        """A proven lower bound of the stage's seconds under any plan, without a solve (0 when none is given)."""
        return 0.0 if self.stage_lower is None or not self.bounded() else self.stage_lower(a, b, q, self.m)

    def work_left(self, qs: tuple[int, ...], num_units: int) -> list[float]:
        """Per first unit a: sum over the units u >= a of min over q in ``qs`` of q times u's solve-free bound
        on q devices (:meth:`lower` of the unit alone), a lower bound of sum_i q_i * lower(stage i) over every
        cut of units [a, U) into stages on sizes from ``qs`` (the bound of a stage is the sum of its units')."""
        got = self._work.get(qs)
        if got is None:
            U = num_units
            per = [min(q * self._units_of(q, U)[u] for q in qs) for u in range(U)]
            got = [0.0] * (U + 1)
            for u in range(U - 1, -1, -1):
                got[u] = got[u + 1] + per[u]
            self._work[qs] = got
        return got

    def _units_of(self, q: int, U: int) -> list[float]:
        if q not in self._unit_lower:
            self._unit_lower[q] = [self.lower(u, u + 1, q) for u in range(U)]
        return self._unit_lower[q]

    def over(self, a: int, b: int, q: int, cap: float) -> bool:
        """Whether the stage's least seconds under any plan exceed ``cap`` (its time-optimal seconds do)."""
        c = self.plain(a, b, q)
        return c is not None and self.bounded() and c.time > cap

    def plain(self, a: int, b: int, q: int) -> StageCost | None:
        key = (a, b, q)
        if key not in self.plain_costs:
            self.plain_costs[key] = c = self.stage_fn(a, b, q, self.m)
            self.stats["stage_evaluations"] = self.stats.get("stage_evaluations", 0) + 1
            self.tick()  # a stage solve on a new sub-mesh can take seconds: the progress line is due after each
            if c is not None and self.on_new is not None:
                self.on_new(c, False)
        return self.plain_costs[key]

    def get(self, a: int, b: int, q: int, k: float) -> StageCost | None:
        c = self.plain(a, b, q)
        if c is None or c.memory(k) <= self.budget:
            return c
        if self.fit_fn is None:
            return None
        key = (a, b, q, k)
        if key not in self.fitted:
            if self.lazy:
                fewer = self._from_fewer(a, b, q, k)
                if fewer is None:
                    self.fitted[key] = None  # nothing fit fewer in flight
                    self._none_from_fewer.add(key)
                    self.stats["fits_from_fewer"] = self.stats.get("fits_from_fewer", 0) + 1
                else:
                    if fewer > c.time:
                        self._inherited[key] = fewer
                        self.stats["stand_ins_from_fewer"] = self.stats.get("stand_ins_from_fewer", 0) + 1
                    self.fitted[key] = _stand_in(c, max(self.known_lower.get(key, 0.0), fewer))
            else:
                self.resolve(key)
        return self.fitted[key]

    def resolve(self, key: tuple[int, int, int, float]) -> None:
        a, b, q, k = key
        got = self.fit_fn(a, b, q, self.m, int(k), self.budget)  # type: ignore[misc]
        if self.lazy:
            self.version += 1  # a stand-in replaced (an eager solve fills a cost first asked for: no change)
        self.stats["fit_evaluations"] = self.stats.get("fit_evaluations", 0) + 1
        self.tick()
        self.fitted[key] = got
        self._fits.setdefault((a, b, q), {})[k] = got
        if got is not None and self.on_new is not None:
            self.on_new(got, True)
        plain = self.plain(a, b, q)
        floor = max(plain.time if plain is not None else 0.0, self.known_lower.get(key, 0.0),
                    self._inherited.get(key, 0.0))
        if got is not None and plain is not None and got.time < floor * (1 - 1e-9) and self.lazy:
            # the stand-in (the time-optimal stage, or a bound from outside) is not a lower bound of this fit_fn:
            # stand-ins are void, solve eagerly
            self.lazy = False
            self.stats["lazy_abandoned"] = True
            for other in [x for x, c in self.fitted.items() if c is not None and c.detail is _PENDING
                          or c is None and x in self._none_from_fewer]:
                del self.fitted[other]

    def rho(self) -> float:
        """The least proven/found ratio of the memory-constrained stages solved (1: all proven)."""
        return min([c.proven / c.time for c in self.fitted.values()
                    if c is not None and c.detail is not _PENDING and c.time > 0] + [1.0])


def _zb_terms(c: StageCost) -> tuple[float, float]:
    """(W, Y) of a stage: its weight-gradient seconds and min(W, F, B) (B its input-gradient seconds)."""
    w = c.weight_grad
    return w, min(w, c.forward, c.backward - w)


def _zb_dp(pool: _StagePool, space: PipelineSpace, n: int, q_fixed: int | None, link_fn: LinkFn,
           exchange: ExchangeFn | None, hi: float, w_lo: float, y_lo: float, stats: dict, cap: float = math.inf,
           prune_states: bool = True, only: Sequence[tuple[int, int, int, int]] | None = None
           ) -> tuple[float, list[tuple[int, int, int, int]]] | None:
    """The least ``sum_i t_i + transfers`` over pipelines of n stages (n in flight on each) whose every stage and
    transfer time is at most ``hi`` and every stage's W at least ``w_lo`` and Y at least ``y_lo`` (stand-ins pass
    the floors): :func:`_stage_dp` as 1F1B's. Stage times grow with the extent, so the scan stops at the first
    over ``hi`` (while stand-ins are in force, at the first whose time-optimal seconds are, as in 1F1B's
    search); W and Y do not: the floors only skip. A stage whose true seconds exceed ``cap`` (the best step over
    m: the ZB-H1 step is at least m t_max) is in no pipeline that could beat it: left out, and one whose
    solve-free bound (:meth:`_StagePool.lower`) exceeds ``hi`` or ``cap`` is not solved. ``prune_states``: a
    state (first unit a, first device o) is unreachable when the units from a need more device-seconds than the
    devices from o give under that limit (docs/pipeline.md, *Device-seconds left*).

    ``only``: no DP; the value of these placed stages (an earlier answer) as the DP would sum it, or None if one
    of them is not allowed now (docs/pipeline.md, *ZB-H1's boxes*: an answer kept)."""
    p = space.num_devices
    ns = p if space.node_size is None or space.node_size >= p else space.node_size
    k = float(n)
    qs = [q_fixed] if q_fixed is not None else list(space.allowed_sizes())
    limit = min(hi, cap)
    reachable = None
    if prune_states and pool.stage_lower is not None and pool.bounded() and math.isfinite(limit):
        left = pool.work_left(tuple(qs), space.num_units)
        room = limit * (1 + 1e-9)

        def reachable(a: int, o: int) -> bool:
            return left[a] <= (p - o) * room

    def floor(a: int, b: int, q: int) -> float | object:
        lo = pool.lower(a, b, q)
        if lo > min(hi, cap):
            stats["stages_skipped_by_floor"] = stats.get("stages_skipped_by_floor", 0) + 1
            return _BREAK  # its time-optimal seconds are over hi or cap, and every longer stage's
        return lo

    def stage(a: int, b: int, o: int, q: int, r: int) -> float | None | object:
        c = pool.get(a, b, q, k)
        if c is None or c.memory(k) > pool.budget:
            # nothing fits [a, b) with k in flight: a longer stage needs more still
            return _BREAK if pool.fit_fn is not None and pool.plain(a, b, q) is not None else None
        if pool.over(a, b, q, cap):
            return _BREAK  # its true seconds (at least the time-optimal ones) are over the cap, and a longer one's
        if c.time > hi:
            return _BREAK if not pool.lazy or pool.plain(a, b, q).time > hi else None  # type: ignore[union-attr]
        if c.detail is not _PENDING:
            w, y = _zb_terms(c)
            if w < w_lo or y < y_lo:
                return None
        if exchange is None:
            return c.time
        fin = _exchanged(exchange, c.recv_bytes, o % ns == 0) if a > 0 else 0.0
        gout = 0.0 if r == 1 else _exchanged(exchange, c.grad_bytes, (o + q) % ns == 0)
        return c.time + fin + gout if fin <= hi and gout <= hi else None

    def between(b: int, o: int, q: int, q2: int) -> float | None:
        lk = link_fn(b, q, q2, pool.m, (o + q) % ns == 0)
        return lk if lk <= hi else None

    if only is not None:
        # the DP's own sum, from the last stage back (best_from adds a stage to the best of the rest after it)
        total = 0.0
        for i in range(len(only) - 1, -1, -1):
            a, b, o, q = only[i]
            here = stage(a, b, o, q, len(only) - i)
            if here is None or here is _BREAK:
                return None
            if i == len(only) - 1:
                total = here  # type: ignore[assignment]
            elif exchange is None:
                lk = between(b, o, q, only[i + 1][3])
                if lk is None:
                    return None
                total = here + 2 * lk + total  # type: ignore[operator]
            else:
                total = here + total  # type: ignore[operator]
        return total, list(only)

    return _stage_dp(space, n, qs, stage, between if exchange is None else None, stats, "zb_dp_states",
                     tick=pool.tick, floor=floor if pool.stage_lower is not None else None, reachable=reachable)


def _relaxed_max(pool: _StagePool, segs: Sequence[tuple[int, int, int, int]], n: int, link_fn: LinkFn,
                 exchange: ExchangeFn | None, space: PipelineSpace) -> float:
    """The largest stage or transfer time of placed stages under the pool's current (relaxed) costs, as
    :func:`_zb_dp` charges them."""
    p = space.num_devices
    ns = p if space.node_size is None or space.node_size >= p else space.node_size
    out = 0.0
    for i, (a, b, o, q) in enumerate(segs):
        c = pool.get(a, b, q, float(n))
        out = max(out, c.time)  # type: ignore[union-attr]
        if exchange is not None:
            if a > 0:
                out = max(out, _exchanged(exchange, c.recv_bytes, o % ns == 0))  # type: ignore[union-attr]
            if i < len(segs) - 1:
                out = max(out, _exchanged(exchange, c.grad_bytes, (o + q) % ns == 0))  # type: ignore[union-attr]
        elif i < len(segs) - 1:
            out = max(out, link_fn(b, q, segs[i + 1][3], pool.m, (o + q) % ns == 0))
    return out


def _zb_box_bound(d: float, b_lo: float, w_hi: float, y_hi: float, m: int, n: int, phi: float = 0.0) -> float:
    """A lower bound of the ZB-H1 step ``sum_i (t_i + c_i + c'_i) + (m - 1) M - (n - 1)(W + Y)`` of every
    pipeline of n <= m stages whose sum is at least ``d``, largest stage or transfer time M at least ``b_lo``,
    W at most ``w_hi`` and Y at most ``y_hi``, one of whose stages has forward seconds at least ``phi``.

    For every stage j, W + Y <= w_j + min(w_j, f_j, b_j) <= t_j - f_j <= M - f_j (b_j the input gradient), so
    W + Y <= M - phi; and Y <= min(W, M / 3) (min(w, f, b) <= t / 3). With cap(M) = min(w_hi + min(y_hi, w_hi,
    M / 3), M - phi) the step is at least d + (m - 1) M - (n - 1) cap(M), nondecreasing in M (its slope is at
    least m - n >= 0), so at least its value at M = b_lo; and it is at least m M >= m b_lo (docs/pipeline.md,
    *ZB-H1's boxes*)."""
    cap = min(w_hi + min(y_hi, w_hi, b_lo / 3), b_lo - phi)
    return max(m * b_lo, d + (m - 1) * b_lo - (n - 1) * cap)


ZB_TOL = 1e-12  # a box whose lower bound is within this relative distance of the best plan holds nothing better


def _zb_branch_and_bound(pool: _StagePool, space: PipelineSpace, n: int, q_fixed: int | None, m: int,
                         link_fn: LinkFn, exchange: ExchangeFn | None, floor: float, incumbent: float,
                         stats: dict, progress: Progress | None = None,
                         phi: float = 0.0, start: float = 0.0) -> tuple[PipelinePlan | None, float]:
    """The ZB-H1 optimum over every cut and sub-mesh sequence of n stages at m >= n, if below ``incumbent``
    (module docstring, *ZB-H1*): branch and bound over boxes of (M, W, Y) = (the largest stage or transfer time,
    the least W, the least Y). Returns the best plan found (None: none below ``incumbent``) and the least value
    the search proved for the family: min(incumbent, best) (1 - ZB_TOL). ``phi``: a lower bound of the largest
    forward seconds among the stages of every pipeline (docs/pipeline.md, *ZB-H1's boxes*). ``start``: a lower
    bound of min(incumbent, every n-stage pipeline's step), the first box's (the fill and drain counted:
    :func:`_zb_bubble_counts`); every box inherits its parent's bound."""
    best: PipelinePlan | None = None
    inc = incumbent

    def bound(d: float, b_lo: float, w_hi: float, y_hi: float) -> float:
        return _zb_box_bound(d, b_lo, w_hi, y_hi, m, n, phi)

    tick = 0
    heap: list[tuple[float, int, tuple[float, float, float, float, float, float]]] = [
        (max(m * floor, start), tick, (floor, math.inf, 0.0, math.inf, 0.0, math.inf))]
    # each DP's answer by (its bound on M, its floors on W and Y), with the cap it ran under
    answers: dict[tuple[float, float, float], tuple[float, tuple[float, list] | None]] = {}
    while heap:
        lb, _, box = heapq.heappop(heap)
        if lb >= inc * (1 - ZB_TOL):
            break
        b_lo, b_hi, w_lo, w_hi, y_lo, y_hi = box
        stats["zb_boxes"] = stats.get("zb_boxes", 0) + 1
        if progress is not None:
            progress.tick(f"{n} stages: box {stats['zb_boxes']}, its bound {lb:.4g} s")
        # the ZB-H1 step is at least m t_max (docs/pipeline.md, *Family bounds*): no stage slower than inc / m
        cap = inc / m * (1 + 1e-12)
        key = (b_hi, w_lo, y_lo)
        kept = answers.get(key)
        got = None
        if kept is not None and kept[0] >= cap:
            # the same DP asked before, at a cap no smaller: since then costs only rose or went (stand-ins solved,
            # the cap lowered), so its answer is still optimal if it is still allowed at the same value
            again = None if kept[1] is None else _zb_dp(pool, space, n, q_fixed, link_fn, exchange, b_hi, w_lo,
                                                         y_lo, stats, cap=cap, only=kept[1][1])
            if kept[1] is None or (again is not None and again[0] == kept[1][0]):
                got = kept[1]
                stats["zb_dp_reused"] = stats.get("zb_dp_reused", 0) + 1
                if got is None:
                    continue
        if got is None:
            got = _zb_dp(pool, space, n, q_fixed, link_fn, exchange, b_hi, w_lo, y_lo, stats, cap=cap)
            answers[key] = (cap, got)
        if got is None:
            continue
        d, segs = got
        lb = max(lb, bound(d, b_lo, w_hi, y_hi))
        if lb >= inc * (1 - ZB_TOL):
            continue
        pending = [(a, b, q, float(n)) for a, b, _, q in segs if pool.get(a, b, q, float(n)).detail is _PENDING]
        relaxed_max = _relaxed_max(pool, segs, n, link_fn, exchange, space) if pending else 0.0
        if relaxed_max > b_lo:
            # not solved yet: the part M >= the relaxed optimum's max (its true max is no smaller) keeps D and
            # a larger B_lo; the part below it is a new box (as 1F1B's search takes bounds best-first)
            for child in ((b_lo, math.nextafter(relaxed_max, -math.inf), w_lo, w_hi, y_lo, y_hi),
                          (relaxed_max, b_hi, w_lo, w_hi, y_lo, y_hi)):
                c_lb = max(lb, bound(d, child[0], child[3], child[5]))
                if c_lb < inc * (1 - ZB_TOL):
                    tick += 1
                    heapq.heappush(heap, (c_lb, tick, child))
            continue
        if pending:
            # solve the stand-ins this relaxed optimum uses; the box's relaxation only tightens: back in the queue
            stats["lazy_rounds"] = stats.get("lazy_rounds", 0) + 1
            for key in pending:
                pool.resolve(key)
            if not pool.lazy:
                raise _Abandoned
            tick += 1
            heapq.heappush(heap, (lb, tick, box))
            continue
        plan = _assemble(segs, pool.plain, m, space, link_fn, exchange, "zb-h1", pool.fitted)
        if plan.step_time < inc:
            best, inc = plan, plan.step_time
            if progress is not None:
                progress.improved(inc, plan)
        big = max([s.cost.time for s in plan.stages] + list(plan.links) + list(plan.back_links or ()))
        w_p = min(_zb_terms(s.cost)[0] for s in plan.stages)
        y_p = min(_zb_terms(s.cost)[1] for s in plan.stages)
        # the plan's region (M >= big, W <= w_p, Y <= y_p) is worth at least its own step: resolved; the rest of
        # the box is three boxes, each excluding this plan from its DP
        b_mid = max(b_lo, big)
        children = []
        if big > b_lo:
            children.append((b_lo, math.nextafter(big, -math.inf), w_lo, w_hi, y_lo, y_hi))
        if w_p < w_hi:
            children.append((b_mid, b_hi, math.nextafter(w_p, math.inf), w_hi, y_lo, y_hi))
        if y_p < y_hi:
            children.append((b_mid, b_hi, w_lo, min(w_hi, w_p), math.nextafter(y_p, math.inf), y_hi))
        for child in children:
            c_lb = max(lb, bound(d, child[0], child[3], child[5]))
            if c_lb < inc * (1 - ZB_TOL):
                tick += 1
                heapq.heappush(heap, (c_lb, tick, child))
    return best, min(incumbent, inc) * (1 - ZB_TOL)


class _Abandoned(Exception):
    """A memory-constrained solve came out below its stand-in: the lazy relaxation is void (start again eagerly)."""


def evaluate_pipeline(segments: Sequence[tuple[int, int, int]], m: int, space: PipelineSpace, stage_fn: StageFn,
                      link_fn: LinkFn, exchange: ExchangeFn | None = None, schedule: str = "1f1b",
                      fit_fn: FitFn | None = None, chunks: int = 1) -> PipelinePlan | None:
    """The plan of given stages ``(first unit, end unit, devices)`` placed in order under ``schedule`` (1f1b,
    gpipe or zb-h1); None if it does not fit or a stage cannot be costed. Raises on a malformed pipeline.

    ``schedule="interleaved"`` with ``chunks`` v >= 2: ``segments`` are the n v chunks in model order, chunk j
    on device group j mod n, every group of the same size (n of them tile the devices) and m a multiple of n
    (Megatron-LM's condition), costed as the interleaved search costs a candidate (:func:`_interleaved_plan`;
    a group fits when its chunks' weights plus its in-flight share of their activations do)."""
    p = space.num_devices
    ns = p if space.node_size is None or space.node_size >= p else space.node_size
    if schedule == "interleaved":
        return _evaluate_interleaved(segments, m, space, stage_fn, link_fn, exchange, chunks)
    if segments[0][0] != 0 or segments[-1][1] != space.num_units or any(
            segments[i][1] != segments[i + 1][0] or segments[i][0] >= segments[i][1] for i in range(len(segments) - 1)):
        raise ShardplanError(f"stages {segments!r} do not cover units 0..{space.num_units} contiguously")
    offs = [0]
    for _, _, q in segments:
        offs.append(offs[-1] + q)
    if offs[-1] != p or not all(_placeable(o, q, p, ns) for o, (_, _, q) in zip(offs, segments)):
        raise ShardplanError(f"sub-meshes {[q for *_, q in segments]} do not tile {p} devices on nodes of {ns}")
    if schedule not in ("1f1b", "gpipe", "zb-h1"):
        raise ShardplanError(f"evaluate_pipeline: schedule {schedule!r} is not one of 1f1b, gpipe, zb-h1")
    k = in_flight(len(segments), m, schedule)
    costs = {}
    fitted: dict = {}
    for i, ((a, b, q), o) in enumerate(zip(segments, offs)):
        c = stage_fn(a, b, q, m)
        if c is not None and space.budget is not None and c.memory(k[i]) > space.budget and fit_fn is not None:
            fitted[(a, b, q, k[i])] = fit_fn(a, b, q, m, int(k[i]), space.budget)
            if fitted[(a, b, q, k[i])] is None:
                return None
        elif c is None or (space.budget is not None and c.memory(k[i]) > space.budget):
            return None
        costs[(a, b, q)] = c
    placed = [(a, b, o, q) for (a, b, q), o in zip(segments, offs)]
    return _assemble(placed, lambda a, b, q: costs[(a, b, q)], m, space, link_fn, exchange, schedule, fitted)


def _evaluate_interleaved(segments: Sequence[tuple[int, int, int]], m: int, space: PipelineSpace, stage_fn: StageFn,
                          link_fn: LinkFn, exchange: ExchangeFn | None, v: int) -> PipelinePlan | None:
    """:func:`evaluate_pipeline` of an interleaved pipeline (its docstring)."""
    p = space.num_devices
    if v < 2 or len(segments) % v:
        raise ShardplanError(f"interleaved: {len(segments)} chunks are not a multiple of v={v} >= 2")
    n = len(segments) // v
    q = segments[0][2]
    if any(s[2] != q for s in segments) or n * q != p:
        raise ShardplanError(f"interleaved: {n} device groups of {[s[2] for s in segments]} devices do not tile {p}")
    if segments[0][0] != 0 or segments[-1][1] != space.num_units or any(
            segments[i][1] != segments[i + 1][0] or segments[i][0] >= segments[i][1] for i in range(len(segments) - 1)):
        raise ShardplanError(f"chunks {segments!r} do not cover units 0..{space.num_units} contiguously")
    if m % n:
        raise ShardplanError(f"interleaved: {m} micro-batches are not a multiple of the {n} device groups")
    got = [stage_fn(a, b, q, m) for a, b, _ in segments]
    if any(c is None for c in got):
        return None
    costs: list[StageCost] = got  # type: ignore[assignment]
    if space.budget is not None:
        k = in_flight(n, m, "interleaved", v)
        if any(sum(costs[j].weight_bytes for j in range(d, n * v, n))
               + k[d] * sum(costs[j].activation_bytes for j in range(d, n * v, n)) > space.budget for d in range(n)):
            return None
    return _interleaved_plan(costs, [(a, b) for a, b, _ in segments], n, q, m, v, space, link_fn, exchange)


def brute_force_pipeline(space: PipelineSpace, stage_fn: StageFn, link_fn: LinkFn,
                         exchange: ExchangeFn | None = None, fit_fn: FitFn | None = None) -> PipelinePlan:
    """Every cut, every sub-mesh sequence, every m (1F1B): the reference for small instances."""
    import itertools

    U, p = space.num_units, space.num_devices
    sizes = space.allowed_sizes()
    s_max = min(space.max_stages or U, U, p)
    best: PipelinePlan | None = None
    for n in range(1, s_max + 1):
        for cuts in itertools.combinations(range(1, U), n - 1):
            bounds = (0, *cuts, U)
            for qs in itertools.product(sizes, repeat=n):
                if sum(qs) != p or (space.uniform and len(set(qs)) > 1):
                    continue
                segs = [(bounds[i], bounds[i + 1], qs[i]) for i in range(n)]
                for m in space.micro_batches:
                    try:
                        plan = evaluate_pipeline(segs, m, space, stage_fn, link_fn, exchange, fit_fn=fit_fn)
                    except ShardplanError:
                        continue
                    if plan is not None and (best is None or plan.step_time < best.step_time):
                        best = plan
    if best is None:
        raise ShardplanError("no pipeline fits")
    return best
