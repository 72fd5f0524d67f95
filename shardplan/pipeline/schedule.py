"""Step time and in-flight activations of pipeline schedules.

A pipeline of S stages runs m micro-batches. Stage i (0-based) spends
``f_i`` seconds on the forward and ``b_i`` on the backward of one
micro-batch (compute and the stage's own collectives, from its intra-stage
plan); ``t_i = f_i + b_i``. Between stages i and i+1 the activation of one
micro-batch goes forward and its gradient comes back, ``c_i`` seconds each
way (a point-to-point transfer over the links that join the two
sub-meshes). ``g_i`` is the stage's once-per-step work (gradient
synchronisation over the stage's replicas when it is not already charged
per micro-batch). Links are full duplex and a link is its own resource, so
a transfer is one more "machine" in the flow line.

**GPipe** (Huang et al., NeurIPS 2019): all forwards, then all backwards.
Each phase is a flow shop of m identical jobs over the stages and links,
whose makespan is exactly the sum of the machines' times plus (m - 1) times
the slowest::

    T_gpipe = sum_i t_i + 2 sum_i c_i + (m - 1) (max(f_max, c_max) + max(b_max, c_max)) + max_i g_i

(When the gradient's transfer time ``c'_i`` differs from the activation's,
``2 sum c`` reads ``sum c + sum c'`` and the backward phase's ``c_max`` is
``max c'``; in 1F1B and interleaved ``c_max`` is the largest of both.)

Stage i holds the activations of all m micro-batches at the end of the
forward phase.

**1F1B** (PipeDream-Flush; Narayanan et al., SC'21 §2.2): after a warm-up of
S - i - 1 forwards, stage i alternates one forward and one backward. With
uniform stages its step is (m + S - 1) t: the bubble is (S - 1)/m of the
ideal m t. The closed form used for non-uniform stages (as in DAPPLE and
Alpa's stage DP) is the sum of the stage times plus (m - 1) times the
slowest::

    T_1f1b = sum_i t_i + 2 sum_i c_i + (m - 1) max(t_max, c_max) + max_i g_i

It never exceeds GPipe's (``max(f+b) <= max f + max b``) and stage i holds at
most ``min(S - i, m)`` micro-batches' activations, never more than GPipe's m:
GPipe is dominated by 1F1B in time and memory for the same stages and m, so
an optimum over schedules never needs it (it is reported for comparison).
The closed form is exact for uniform stages; for non-uniform stages the
event simulation :func:`simulate` gives the schedule's actual length (the
report shows both).

**Interleaved 1F1B** (Narayanan et al., SC'21 §2.2.2): each of the S device
groups holds v model chunks (chunk j on group j mod S). The bubble shrinks
to (S - 1)/(v m) of the ideal, at v times the stage-to-stage traffic; with
``t_d`` a group's time per micro-batch over all its chunks::

    T_int = m max_d t_d + (sum_d t_d - max_d t_d) / v + 2 sum_i c_i + (m - 1/v) max(0, v c_max - t_max) + max g

(uniform: ``(m + (S - 1)/v) t``, the paper's bubble; v = 1 is 1F1B; ``c_i`` is
the slowest of the v transfers between groups i and i+1, and the transfer
from the last group back to the first, between chunks, is not charged). Megatron
requires m to be a multiple of S. The form takes every chunk as 1/v of its group's time; it is exact for
equal chunks on equal groups, not for chunks of unequal length (an embedding or a head riding with the
first or last chunk, uneven end stages): there :func:`simulate` with ``chunk_times`` (each chunk's own
seconds) gives the schedule's length, which is how a recipe with unequal chunks is costed
(docs/pipeline.md, "Unequal chunks"). Device group d holds, at its peak, the
warm-up chunk micro-batches of Megatron-LM's interleaved schedule,
``2 (S - d - 1) + (v - 1) S + 1`` chunks (capped at ``m v``), each 1/v of
the group's per-micro-batch activations.

**ZB-H1** (zero bubble, Qi et al., "Zero Bubble Pipeline Parallelism",
ICLR 2024, §3): each backward is split into B, the input gradient (what the
previous stage waits for), and W, the weight gradient (``w_i`` of ``b_i``:
the weight-gradient GEMMs and their gradient reduction, which no other
backward reads, so the split is clean for every operator of the IR). Stage i
runs 1F1B's warm-up of S - i - 1 forwards, then F, B and the W of the
micro-batch i places earlier; its last i W passes fill the cool-down bubble.
The paper's bubble is (S - 1)(F + B - W) instead of 1F1B's (S - 1)(F + B + W);
for uniform stages, no transfer time and m >= S::

    T_zb = m (F + B + W) + (S - 1) (F + B - min(W, F, B))

(:func:`zb_h1_uniform`; the min covers W longer than F or B, where W cannot
fill a whole slot; tested against the simulation), i.e. 1F1B's closed form
less ``(S - 1)(W + min(W, F, B))``. For other stages :func:`step_time` takes
1F1B's closed form (with its transfers) less that saving with the smallest
W, F and B over the stages, an estimate of the same kind as 1F1B's own
(the report shows the event simulation next to it); for m < S it returns
the simulation's length. Memory: deferring stage i's W passes by i keeps
min(S, m) micro-batches' activations on every stage (1F1B's stage 0 peak, as
the paper states for ZB-H1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from shardplan.errors import ShardplanError

__all__ = ["SCHEDULES", "StageTimes", "step_time", "in_flight", "bubble_fraction", "simulate", "Event",
           "zb_h1_uniform", "makespan"]

SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb-h1")


@dataclass(frozen=True)
class StageTimes:
    """Per-micro-batch seconds of one stage (device group): forward, backward, once-per-step sync, and the
    weight-gradient part of the backward (``weight_grad <= backward``; zero-bubble schedules run it apart)."""

    forward: float
    backward: float
    sync: float = 0.0
    weight_grad: float = 0.0

    @property
    def total(self) -> float:
        return self.forward + self.backward


def _check(stages: Sequence[StageTimes], links: Sequence[float], m: int, schedule: str, v: int,
           back: Sequence[float] | None = None) -> None:
    if schedule not in SCHEDULES:
        raise ShardplanError(f"unknown pipeline schedule {schedule!r}; choose from {', '.join(SCHEDULES)}")
    if not stages:
        raise ShardplanError("a pipeline needs at least one stage")
    if len(links) != len(stages) - 1:
        raise ShardplanError(f"{len(stages)} stages need {len(stages) - 1} link times, got {len(links)}")
    if back is not None and len(back) != len(links):
        raise ShardplanError(f"{len(links)} forward link times but {len(back)} backward ones")
    if m < 1 or v < 1:
        raise ShardplanError(f"micro-batches and chunks must be >= 1, got m={m}, v={v}")
    if v > 1 and schedule != "interleaved":
        raise ShardplanError(f"v={v} chunks per device needs the interleaved schedule, not {schedule!r}")


def step_time(stages: Sequence[StageTimes], links: Sequence[float], m: int, schedule: str = "1f1b",
              v: int = 1, back: Sequence[float] | None = None) -> float:
    """Seconds of one training step under ``schedule`` (closed forms of the module docstring).

    ``links``: forward seconds per cut; ``back``: the gradient's seconds per cut (default: the same)."""
    _check(stages, links, m, schedule, v, back)
    back = links if back is None else back
    t = [s.total for s in stages]
    c_max = max(max(links, default=0.0), max(back, default=0.0))
    ramp = sum(t) + sum(links) + sum(back)
    sync = max(s.sync for s in stages)
    if schedule == "gpipe":
        f_max = max(s.forward for s in stages)
        b_max = max(s.backward for s in stages)
        return ramp + (m - 1) * (max(f_max, max(links, default=0.0)) + max(b_max, max(back, default=0.0))) + sync
    if schedule == "1f1b":
        return ramp + (m - 1) * max(max(t), c_max) + sync
    if schedule == "zb-h1":
        n = len(stages)
        if m < n:
            return makespan(simulate(stages, links, m, schedule, v, back))
        w = min(s.weight_grad for s in stages)
        f = min(s.forward for s in stages)
        b = min(s.backward - s.weight_grad for s in stages)
        return ramp + (m - 1) * max(max(t), c_max) + sync - (n - 1) * (w + min(w, f, b))
    t_max = max(t)
    return (m * t_max + (sum(t) - t_max) / v + sum(links) + sum(back) + (m - 1.0 / v) * max(0.0, v * c_max - t_max)
            + sync)


def zb_h1_uniform(forward: float, backward: float, weight_grad: float, num_stages: int, m: int) -> float:
    """Step of ZB-H1 on S uniform stages without transfer time, m >= S (module docstring; Qi et al. 2024):
    ``m (F + B + W) + (S - 1)(F + B - min(W, F, B))`` with B the input-gradient part ``backward - weight_grad``."""
    if m < num_stages:
        raise ShardplanError(f"the ZB-H1 closed form needs m >= S, got m={m}, S={num_stages}")
    f, b, w = forward, backward - weight_grad, weight_grad
    return m * (f + b + w) + (num_stages - 1) * (f + b - min(w, f, b))


def in_flight(num_stages: int, m: int, schedule: str = "1f1b", v: int = 1) -> list[float]:
    """Per stage: micro-batches whose saved activations are live at its peak (in units of the stage's
    per-micro-batch activations; fractional for interleaved chunks)."""
    if schedule == "gpipe":
        return [float(m)] * num_stages
    if schedule == "1f1b":
        return [float(min(num_stages - i, m)) for i in range(num_stages)]
    if schedule == "interleaved":
        return [min(2 * (num_stages - d - 1) + (v - 1) * num_stages + 1, m * v) / v for d in range(num_stages)]
    if schedule == "zb-h1":
        return [float(min(num_stages, m))] * num_stages
    raise ShardplanError(f"unknown pipeline schedule {schedule!r}; choose from {', '.join(SCHEDULES)}")


def bubble_fraction(stages: Sequence[StageTimes], links: Sequence[float], m: int, schedule: str = "1f1b",
                    v: int = 1, back: Sequence[float] | None = None) -> float:
    """Idle share of the busiest stage's step: 1 - m t_max / T (uniform 1F1B: (S - 1)/(m + S - 1))."""
    total = step_time(stages, links, m, schedule, v, back)
    busy = m * max(s.total for s in stages) + max(s.sync for s in stages)
    return max(0.0, 1.0 - busy / total) if total > 0 else 0.0


@dataclass(frozen=True)
class Event:
    """One bar of the timeline: ``kind`` in forward, backward (ZB-H1: its input-gradient part), weight (ZB-H1's
    weight-gradient pass), send, sync; stage (row), micro-batch, chunk."""

    stage: int
    kind: str
    micro_batch: int
    start: float
    end: float
    chunk: int = 0


def _order(s: int, num_stages: int, m: int, schedule: str, v: int) -> list[tuple[str, int, int]]:
    """The sequence of (kind, micro-batch, chunk) stage ``s`` runs."""
    if schedule == "gpipe":
        return [("F", j, 0) for j in range(m)] + [("B", j, 0) for j in range(m)]
    if schedule == "1f1b":
        warm = min(num_stages - s - 1, m)
        seq = [("F", j, 0) for j in range(warm)]
        f, b = warm, 0
        while b < m:
            if f < m:
                seq.append(("F", f, 0))
                f += 1
            seq.append(("B", b, 0))
            b += 1
        return seq
    if schedule == "zb-h1":
        warm = min(num_stages - s - 1, m)
        seq = [("F", j, 0) for j in range(warm)]
        f = warm
        for j in range(m):
            if f < m:
                seq.append(("F", f, 0))
                f += 1
            seq.append(("B", j, 0))
            if j >= s:
                seq.append(("W", j - s, 0))
        return seq + [("W", j, 0) for j in range(max(0, m - s), m)]
    # interleaved (Megatron-LM order): forward units k = 0 .. m v - 1 visit chunks in groups of S micro-batches
    total = m * v

    def fwd(k: int) -> tuple[str, int, int]:
        group, r = divmod(k, num_stages * v)
        return ("F", group * num_stages + r % num_stages, r // num_stages)

    def bwd(k: int) -> tuple[str, int, int]:
        group, r = divmod(k, num_stages * v)
        return ("B", group * num_stages + r % num_stages, v - 1 - r // num_stages)

    warm = min(2 * (num_stages - s - 1) + (v - 1) * num_stages, total)
    seq = [fwd(k) for k in range(warm)]
    f, b = warm, 0
    while b < total:
        if f < total:
            seq.append(fwd(f))
            f += 1
        seq.append(bwd(b))
        b += 1
    return seq


def simulate(stages: Sequence[StageTimes], links: Sequence[float], m: int, schedule: str = "1f1b",
             v: int = 1, back: Sequence[float] | None = None,
             chunk_times: Sequence[StageTimes] | None = None) -> list[Event]:
    """Event-level timeline of the schedule: each stage runs its operations in the schedule's order,
    each as soon as its input has arrived (forward from the previous chunk, backward from the next).

    Interleaved needs m to be a multiple of S (as in Megatron-LM). A transfer takes ``links[i]`` and
    occupies its link in its direction (one transfer at a time per direction), not the stage; the final
    gradient synchronisation runs after a stage's last backward. ``back``: the gradients' link seconds
    (default ``links``). ``chunk_times`` (interleaved only): the S v chunks' own seconds in model order
    (chunk c of stage s is entry c S + s; the stages then give only their ``sync``), for chunks of unequal
    length; by default each chunk takes 1/v of its stage's time."""
    _check(stages, links, m, schedule, v, back)
    back = links if back is None else back
    n = len(stages)
    if schedule == "interleaved" and m % n:
        raise ShardplanError(f"the interleaved schedule needs micro-batches ({m}) to be a multiple of stages ({n})")
    if chunk_times is not None and (schedule != "interleaved" or len(chunk_times) != n * v):
        raise ShardplanError(f"chunk_times: {len(chunk_times)} chunks given; they apply to the interleaved "
                             f"schedule with S v = {n * v} chunks")
    chunks = v if schedule == "interleaved" else 1
    split = schedule == "zb-h1"
    if split and any(not 0.0 <= st.weight_grad <= st.backward for st in stages):
        raise ShardplanError("ZB-H1 needs each stage's weight-gradient time within its backward time")
    last_chunk = chunks - 1
    done: dict[tuple[str, int, int, int], float] = {}  # (kind, micro-batch, chunk, stage) -> end time
    arrive: dict[tuple[str, int, int, int], float] = {}  # input of (kind, micro-batch, chunk, stage) arrived
    orders = [_order(s, n, m, schedule, v) for s in range(n)]
    pos = [0] * n
    free = [0.0] * n
    link_free: dict[tuple[int, int], float] = {}  # (from stage, to stage) -> when that direction is free
    events: list[Event] = []

    def link(a: int, b: int, kind: str) -> float:
        times = links if kind == "F" else back
        return times[min(a, b)] if abs(a - b) == 1 else max(times, default=0.0)

    def ready(s: int, kind: str, j: int, c: int) -> float | None:
        if kind == "W":
            return done.get(("B", j, c, s))
        if kind == "F" and s == 0 and c == 0:
            return 0.0
        if kind == "B" and s == n - 1 and c == last_chunk:
            return done.get(("F", j, c, s))
        return arrive.get((kind, j, c, s))

    def send(s: int, dst: int, kind: str, j: int, c_src: int, c_dst: int, at: float) -> None:
        t0 = max(at, link_free.get((s, dst), 0.0))
        t1 = t0 + link(s, dst, kind)
        link_free[(s, dst)] = t1
        arrive[(kind, j, c_dst, dst)] = t1
        events.append(Event(s, "send", j, t0, t1, c_src))

    progressed = True
    while progressed:
        progressed = False
        for s in range(n):
            while pos[s] < len(orders[s]):
                kind, j, c = orders[s][pos[s]]
                r = ready(s, kind, j, c)
                if r is None:
                    break
                if chunk_times is not None:
                    dur = chunk_times[c * n + s].forward if kind == "F" else chunk_times[c * n + s].backward
                elif kind == "F":
                    dur = stages[s].forward / chunks
                elif kind == "W":
                    dur = stages[s].weight_grad
                else:  # a split schedule's B is the input-gradient part only
                    dur = (stages[s].backward - (stages[s].weight_grad if split else 0.0)) / chunks
                start = max(r, free[s])
                free[s] = start + dur
                done[(kind, j, c, s)] = free[s]
                events.append(Event(s, {"F": "forward", "B": "backward", "W": "weight"}[kind], j, start, free[s], c))
                if kind == "F" and (s < n - 1 or c < last_chunk):
                    send(s, s + 1 if s < n - 1 else 0, "F", j, c, c if s < n - 1 else c + 1, free[s])
                elif kind == "B" and (s > 0 or c > 0):
                    send(s, s - 1 if s > 0 else n - 1, "B", j, c, c if s > 0 else c - 1, free[s])
                pos[s] += 1
                progressed = True
    if any(pos[s] < len(orders[s]) for s in range(n)):
        raise ShardplanError(f"schedule {schedule!r} deadlocked in simulation (S={n}, m={m}, v={v})")
    for s in range(n):
        if stages[s].sync > 0:
            events.append(Event(s, "sync", -1, free[s], free[s] + stages[s].sync))
    return events


def makespan(events: Sequence[Event]) -> float:
    """End of the last event."""
    return max((e.end for e in events), default=0.0)
