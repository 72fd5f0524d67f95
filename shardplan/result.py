"""The one answer every planning path returns: :class:`Plan`, a plain value that round-trips through JSON.

A plan is a sequence of stages (one stage is the ordinary, unpipelined case).
Each stage is an SPMD program on a contiguous block of devices, and gives
every operator it runs a :class:`OperatorChoice`: its layout (how its
iteration space is split over the stage's devices, per machine level), the
ZeRO stage of its weights' state and whether its forward is recomputed in
the backward pass. Over the stages: the micro-batch count, the pipeline
schedule, the predicted step time with its breakdown, the per-device memory
with its breakdown, the proven lower bound of the space searched, and the
solve statistics.

The value holds no cost tables and no graph, so it can be written once
(:meth:`Plan.to_json`) and loaded on every host of a cluster
(:meth:`Plan.from_json`); the engines (:mod:`shardplan.jax`,
:mod:`shardplan.torch`) rebuild what they need from the traced program and
these choices. ``detail`` keeps the search's own answer (the tables-backed
per-operator plan, or the pipeline result) when the plan was computed in
this process; it is never serialised and never compared.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from types import MappingProxyType
from typing import Any, Mapping

from shardplan.errors import ShardplanError
from shardplan.layout import Layout
from shardplan.machine import Machine

__all__ = ["OperatorChoice", "StagePlan", "Plan", "PLAN_FORMAT", "ConservativeOp"]

PLAN_FORMAT = "shardplan.plan/1"
"""The ``format`` field of a plan's JSON; :meth:`Plan.from_json` refuses any other."""

NO_PIPELINE = "none"
"""The schedule of a one-stage plan (a single SPMD program, gradients accumulated over micro-batches)."""


@dataclass(frozen=True)
class OperatorChoice:
    """What a plan does with one operator.

    Attributes:
        kind: the operator's kind (``matmul``, ``conv``, ...), for reports.
        layout: the split of its iteration dimensions over the stage's devices, per machine level.
        state_stage: the ZeRO stage of its weights' gradients and optimizer state (0: replicated; 3: FSDP).
        recompute: its forward runs again in the backward pass instead of saving its output.
        weight_dims: the iteration dimensions that index its trainable weights (splitting one of them
            shards the weights: tensor parallelism; splitting any other replicates them: data parallelism).
        weight_elems: elements of its trainable weights (0: none), to weigh operators in summaries.
        labels, extents: per dimension (the layout's order) what it is (``batch``, ``seq``, ``out``, or its
            letter) and its extent, for reports; empty when unknown.
        seconds: its own predicted seconds in its stage's program (compute, collectives inside it, its memory
            choices' costs); ``redistribution_seconds``: moving its inputs into its layout. Over a one-stage
            plan's operators the two sum to the step time.
        fp8: its matrix products run in FP8 (Transformer Engine's delayed scaling).
        offload: what it keeps in host memory (``optimizer``, ``parameters``, ``activations``).
        dealt: a causal attention that, run with its keys gathered (not the ring), deals its queries into the
            balanced order, as its stage's tables charged it (:func:`shardplan.cost.ring.deals_gathered`): a plan
            read back from JSON runs it so without its stage's tables.
    """

    kind: str
    layout: Layout
    state_stage: int = 0
    recompute: bool = False
    weight_dims: tuple[str, ...] = ()
    weight_elems: int = 0
    labels: tuple[str, ...] = ()
    extents: tuple[int, ...] = ()
    seconds: float = 0.0
    redistribution_seconds: float = 0.0
    fp8: bool = False
    offload: tuple[str, ...] = ()
    dealt: bool = False

    @property
    def tensor_degree(self) -> int:
        """Devices its weights are sharded over: the product of the splits of the weight dimensions."""
        return math.prod(c for d, c in zip(self.layout.dims, self.layout.split) if d in self.weight_dims)

    @property
    def context_degree(self) -> int:
        """Ways its sequence is split (dimensions named ``s`` or ``t``, or labelled ``seq``) where that does not
        shard its weights: context parallelism, each device a part of every sequence."""
        labels = self.labels or self.layout.dims
        return math.prod(c for d, lab, c in zip(self.layout.dims, labels, self.layout.split)
                         if (d in ("s", "t") or lab == "seq") and d not in self.weight_dims)

    @property
    def expert_degree(self) -> int:
        """Ways its expert dimension is split (an operator of kind ``expert``, the experts' batched products, with a
        dimension named ``e`` or labelled ``expert``); 1 for every other operator."""
        if self.kind != "expert":
            return 1
        labels = self.labels or self.layout.dims
        return math.prod(c for d, lab, c in zip(self.layout.dims, labels, self.layout.split)
                         if d == "e" or lab == "expert")

    def to_dict(self) -> dict[str, Any]:
        lay = self.layout
        return {"kind": self.kind, "dims": list(lay.dims), "levels": list(lay.levels),
                "splits": [list(r) for r in lay.splits], "orders": [list(o) for o in lay.orders],
                "state_stage": self.state_stage, "recompute": self.recompute,
                "weight_dims": list(self.weight_dims), "weight_elems": self.weight_elems,
                "labels": list(self.labels), "extents": list(self.extents), "seconds": self.seconds,
                "redistribution_seconds": self.redistribution_seconds, "fp8": self.fp8,
                "offload": list(self.offload), **({"partial": True} if lay.partial else {}),
                **({"dealt": True} if self.dealt else {})}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> "OperatorChoice":
        lay = Layout(tuple(d["dims"]), tuple(d["levels"]), tuple(tuple(r) for r in d["splits"]),
                     tuple(tuple(o) for o in d["orders"]), bool(d.get("partial", False)))
        return OperatorChoice(str(d["kind"]), lay, int(d.get("state_stage", 0)), bool(d.get("recompute", False)),
                              tuple(d.get("weight_dims", ())), int(d.get("weight_elems", 0)),
                              tuple(str(x) for x in d.get("labels", ())), tuple(int(x) for x in d.get("extents", ())),
                              float(d.get("seconds", 0.0)), float(d.get("redistribution_seconds", 0.0)),
                              bool(d.get("fp8", False)), tuple(str(x) for x in d.get("offload", ())),
                              bool(d.get("dealt", False)))


@dataclass(frozen=True)
class ConservativeOp:
    """An operator the frontend could not describe (no handler, or its handler refused the arguments): planned
    unsplit, its operands gathered, so the plan around it may be weaker than the model deserves.

    Attributes:
        operator: its name in the plan; ``target``: what the program called (``aten.logcumsumexp.default``);
        module: the module path it came from (``layers.0.attn``); ``reason``: why it was not described.
    """

    operator: str
    target: str
    module: str
    reason: str

    def to_dict(self) -> dict[str, str]:
        return {"operator": self.operator, "target": self.target, "module": self.module, "reason": self.reason}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> "ConservativeOp":
        return ConservativeOp(str(d["operator"]), str(d["target"]), str(d["module"]), str(d["reason"]))


@dataclass(frozen=True)
class StagePlan:
    """One stage: blocks [first, end) of the model on devices [offset, offset + devices).

    Attributes:
        index: position in the pipeline (chunk ``c`` of device group ``g`` is ``c * groups + g``).
        first, end: the model's repeated units (blocks) it runs; (0, 0) for a one-stage plan of a
            model without units.
        offset, devices: its devices.
        operators: operator name -> :class:`OperatorChoice`, in program order.
        forward, backward: seconds per micro-batch; ``weight_grad`` of ``backward`` computes weight gradients.
        in_flight: micro-batches whose activations it holds at once under the schedule.
        memory: peak bytes per device and its parts (``peak_bytes``, ``weights_bytes``, ``activations_bytes``).
    """

    index: int
    first: int
    end: int
    offset: int
    devices: int
    operators: Mapping[str, OperatorChoice]
    forward: float
    backward: float
    weight_grad: float
    in_flight: float
    memory: Mapping[str, float]

    def __post_init__(self) -> None:
        object.__setattr__(self, "operators", MappingProxyType(dict(self.operators)))
        object.__setattr__(self, "memory", MappingProxyType({k: float(v) for k, v in self.memory.items()}))

    @property
    def layouts(self) -> dict[str, Layout]:
        return {n: c.layout for n, c in self.operators.items()}

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "units": [self.first, self.end], "devices": [self.offset, self.devices],
                "forward_seconds": self.forward, "backward_seconds": self.backward,
                "weight_grad_seconds": self.weight_grad, "in_flight": self.in_flight, "memory": dict(self.memory),
                "operators": {n: c.to_dict() for n, c in self.operators.items()}}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> "StagePlan":
        return StagePlan(int(d["index"]), int(d["units"][0]), int(d["units"][1]), int(d["devices"][0]),
                         int(d["devices"][1]), {n: OperatorChoice.from_dict(c) for n, c in d["operators"].items()},
                         float(d["forward_seconds"]), float(d["backward_seconds"]), float(d["weight_grad_seconds"]),
                         float(d["in_flight"]), d["memory"])


@dataclass(frozen=True)
class Plan:
    """The fastest plan found for a model on a machine (see the module docstring).

    Attributes:
        model: the model's name.
        machine: what it was planned for.
        stages: the pipeline's stages (one for a single SPMD program).
        micro_batches: m; gradients are accumulated over m micro-batches per step.
        schedule: ``"none"`` for one stage, else the pipeline schedule (``1f1b``, ``interleaved``, ``zb-h1``).
        chunks: stages per device group (interleaved schedules), else 1.
        step_time: predicted seconds per training step.
        breakdown: seconds by part, summing to ``total``.
        memory: the largest per-device peak over stages, its parts, and ``budget_bytes`` when one applied.
        lower_bound: proven lower bound of the step time over the space searched (None: nothing proven).
        solver: what produced it (``dp``, ``fit``, ``pipeline``, a baseline's name, ...).
        stats: solve statistics (seconds, nodes, what was searched and why).
        batch: the global batch, when known.
        conservative: the operators described conservatively (:class:`ConservativeOp`, program order); empty when
            every operator was described.
        detail: the search's own answer in this process (never serialised or compared).
    """

    model: str
    machine: Machine
    stages: tuple[StagePlan, ...]
    micro_batches: int
    schedule: str
    step_time: float
    breakdown: Mapping[str, float]
    memory: Mapping[str, float]
    lower_bound: float | None
    solver: str
    stats: Mapping[str, Any] = field(default_factory=dict)
    chunks: int = 1
    batch: int | None = None
    conservative: tuple[ConservativeOp, ...] = ()
    detail: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.stages:
            raise ShardplanError("a plan needs at least one stage")
        object.__setattr__(self, "stages", tuple(self.stages))
        object.__setattr__(self, "conservative", tuple(self.conservative))
        object.__setattr__(self, "breakdown", MappingProxyType({k: float(v) for k, v in self.breakdown.items()}))
        object.__setattr__(self, "memory", MappingProxyType(dict(self.memory)))
        object.__setattr__(self, "stats", MappingProxyType(dict(self.stats)))

    # -- what a user reads -------------------------------------------------------------------------------
    @property
    def cost(self) -> float:
        """Predicted seconds per training step (the same as :attr:`step_time`)."""
        return self.step_time

    @property
    def gap(self) -> float | None:
        """(step time - lower bound) / step time: how far from the optimum of the space searched the plan
        may be; 0 when proven optimal, None when nothing was proven."""
        if self.lower_bound is None:
            return None
        if self.step_time <= 0:
            return 0.0
        return max(0.0, (self.step_time - self.lower_bound) / self.step_time)

    @property
    def optimal(self) -> bool:
        """Proven optimal over the space searched (gap at most 1e-9)."""
        return self.gap is not None and self.gap <= 1e-9

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def pipelined(self) -> bool:
        return len(self.stages) > 1

    @property
    def operators(self) -> dict[str, OperatorChoice]:
        """Operator name -> its choice, over every stage (names are unique across stages)."""
        out: dict[str, OperatorChoice] = {}
        for s in self.stages:
            out.update(s.operators)
        return out

    @property
    def layouts(self) -> dict[str, Layout]:
        """Operator name -> layout, over every stage."""
        return {n: c.layout for n, c in self.operators.items()}

    @property
    def configs(self) -> dict[str, tuple[int, ...]]:
        """Operator name -> total split per dimension (the operator's dimension order)."""
        return {n: c.layout.split for n, c in self.operators.items()}

    @property
    def state_sharding(self) -> dict[int, list[str]]:
        """ZeRO stage (1..3) -> the operators whose state is sharded at that stage."""
        out: dict[int, list[str]] = {}
        for n, c in self.operators.items():
            if c.state_stage:
                out.setdefault(c.state_stage, []).append(n)
        return out

    @property
    def recomputed(self) -> list[str]:
        """The operators recomputed in the backward pass."""
        return [n for n, c in self.operators.items() if c.recompute]

    @property
    def spmd(self) -> Any:
        """The tables-backed per-operator plan of a one-stage plan computed in this process (what the engines
        run and the detailed reports read); None for a pipeline or a plan loaded from JSON."""
        from shardplan.spmd import SpmdPlan

        return self.detail if isinstance(self.detail, SpmdPlan) else None

    # -- JSON ------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: everything but :attr:`detail` (non-finite numbers written as None)."""
        return _finite({
            "format": PLAN_FORMAT, "model": self.model, "machine": asdict(self.machine),
            "batch": self.batch, "micro_batches": self.micro_batches, "schedule": self.schedule,
            "chunks": self.chunks, "step_time_seconds": self.step_time, "breakdown": dict(self.breakdown),
            "memory": dict(self.memory), "lower_bound_seconds": self.lower_bound, "gap": self.gap,
            "optimal": self.optimal, "solver": self.solver, "stats": _jsonable(dict(self.stats)),
            "stages": [s.to_dict() for s in self.stages],
            "conservative": [c.to_dict() for c in self.conservative]})

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> "Plan":
        """The plan :meth:`to_dict` wrote; a one-line :class:`ShardplanError` for anything else."""
        if not isinstance(d, Mapping) or d.get("format") != PLAN_FORMAT:
            got = d.get("format") if isinstance(d, Mapping) else type(d).__name__
            raise ShardplanError(f"not a shardplan plan (format {got!r}, expected {PLAN_FORMAT!r})")
        try:
            from shardplan.checks import integer, real

            real("plan JSON: step_time_seconds", d["step_time_seconds"], positive=True, unit="s")
            integer("plan JSON: micro_batches", d["micro_batches"], 1)
            known = {f.name for f in fields(Machine)}
            machine = Machine(**{k: v for k, v in d["machine"].items() if k in known})
            memory = {k: (math.inf if v is None and k == "budget_bytes" else v) for k, v in d["memory"].items()}
            return Plan(str(d["model"]), machine, tuple(StagePlan.from_dict(s) for s in d["stages"]),
                        int(d["micro_batches"]), str(d["schedule"]), float(d["step_time_seconds"]), d["breakdown"],
                        memory, None if d["lower_bound_seconds"] is None else float(d["lower_bound_seconds"]),
                        str(d["solver"]), d.get("stats") or {}, int(d.get("chunks", 1)),
                        None if d.get("batch") is None else int(d["batch"]),
                        tuple(ConservativeOp.from_dict(c) for c in d.get("conservative") or ()))
        except ShardplanError:
            raise
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError) as e:
            raise ShardplanError(f"malformed plan JSON: {type(e).__name__}: {e}") from None

    @staticmethod
    def from_json(text: str) -> "Plan":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ShardplanError(f"plan JSON does not parse: {e}") from None
        return Plan.from_dict(d)


def _finite(x: Any) -> Any:
    """``x`` with non-finite floats replaced by None (JSON has no infinity)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, Mapping):
        return {str(k): _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _jsonable(x: Any) -> Any:
    from shardplan.search.io import jsonable

    return jsonable(x)
