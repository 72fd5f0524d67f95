"""Communication a compiled XLA program really does, against what the cost model predicts.

Parsing. Every collective instruction of the compiled (SPMD-partitioned)
HLO text is found with its result shape and replica groups; the group size
g is read from any of the forms XLA prints: explicit lists
``{{0,1,2,3},{4,5,6,7}}``, iota lists ``[2,4]<=[8]`` (``[groups, g]``, with an
optional transpose), mesh form ``mesh['a'=2,'b'=4] {'b'}`` or
``mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'b'}`` (the product of
the named axes' sizes; a Shardy sub-axis ``'a':(k)m`` counts m), or ``{}``
(all ``num_partitions`` devices).

Bytes each device sends (ring algorithms), with n the bytes of the buffer:

    all-reduce          2 (g-1)/g · n          (n = operand = result)
    all-gather          (g-1)/g · n_out        (n_out = result)
    reduce-scatter      (g-1)/g · n_in         (n_in = g · result)
    all-to-all          (g-1)/g · n
    collective-permute  n

The model's figure for the same plan is
``Σ_v comm_bytes_v[c_v] + Σ_(u,v) (fwd + bwd volume)[c_u, c_v] · dtype bytes``:
the bytes each operator's configuration sends inside it (partial-sum and
gradient all-reduces, halos, statistics) plus the redistribution volume of
every edge, forward and backward (:func:`predicted_bytes`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardplan.cost import plan_home_bytes
from shardplan.cost.edge import edge_volumes, weight_edge_cost

__all__ = ["Collective", "parse_collectives", "hlo_bytes_per_device", "predicted_bytes", "DTYPE_BYTES_HLO"]

DTYPE_BYTES_HLO = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                   "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}

_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<type>.+?)\s+(?P<op>" + "|".join(_KINDS)
                    + r")(?P<start>-start)?\((?P<args>.*)$")
_SHAPE = re.compile(r"\b(" + "|".join(DTYPE_BYTES_HLO) + r")\[([\d,]*)\]")
_PARTITIONS = re.compile(r"num_partitions=(\d+)")


@dataclass(frozen=True)
class Collective:
    """One collective instruction: its kind, group size, buffer bytes and bytes each device sends."""

    kind: str
    group: int
    nbytes: float
    sent: float
    line: str


def _shapes_bytes(text: str) -> list[float]:
    out = []
    for dt, dims in _SHAPE.findall(text):
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        out.append(float(n * DTYPE_BYTES_HLO[dt]))
    return out


_SUB_AXIS = re.compile(r"^['\"]?([\w.\-]+)['\"]?:\((\d+)\)(\d+)$")


def _mesh_axis_size(name: str, sizes: dict[str, int]) -> int:
    """Size of one axis of a mesh-form replica group: ``'a'`` (the whole axis) or a Shardy sub-axis
    ``'a':(k)m`` (the m-sized factor of axis a after its first k, so m devices)."""
    m = _SUB_AXIS.match(name)
    return int(m.group(3)) if m else sizes[name.strip("'\" ")]


def _group_size(attrs: str, num_partitions: int) -> int:
    """g from the replica_groups attribute (see the module docstring for the forms)."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\((?:[^()]|\([^()]*\))*\))?\s*\{([^}]*)\}",
                  attrs)
    if m:
        sizes = {k.strip("'\" "): int(v) for k, v in (kv.split("=") for kv in m.group(1).split(",") if kv)}
        names = [n.strip() for n in m.group(2).split(",") if n.strip()]
        return math.prod(_mesh_axis_size(n, sizes) for n in names) if names else num_partitions
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", attrs)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", attrs)
    if m:
        first = re.match(r"\{([\d,]*)\}", m.group(1))
        return len([x for x in first.group(1).split(",") if x]) if first else num_partitions
    return num_partitions


def parse_collectives(hlo_text: str, num_partitions: int | None = None) -> list[Collective]:
    """Every collective of a compiled HLO module (``-done`` halves of async pairs are skipped)."""
    if num_partitions is None:
        m = _PARTITIONS.search(hlo_text)
        num_partitions = int(m.group(1)) if m else 1
    out: list[Collective] = []
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        kind, is_start = m.group("op"), bool(m.group("start"))
        sizes = _shapes_bytes(m.group("type"))
        if not sizes:
            continue
        if is_start and kind == "all-gather":
            sizes = sizes[-1:]  # (operand, result)
        elif is_start and kind == "collective-permute":
            sizes = sizes[:1]
        n = float(sum(sizes))
        attrs = m.group("args")
        if kind == "collective-permute":
            sent = n if "source_target_pairs={}" not in attrs else 0.0
            out.append(Collective(kind, 2, n, sent, line.strip()))
            continue
        g = _group_size(attrs, num_partitions)
        frac = (g - 1) / g if g > 1 else 0.0
        if kind == "all-reduce":
            sent = 2.0 * frac * n
        elif kind == "reduce-scatter":
            n = n * g
            sent = frac * n
        else:
            sent = frac * n
        out.append(Collective(kind, g, n, sent, line.strip()))
    return out


def hlo_bytes_per_device(hlo_text: str, num_partitions: int | None = None) -> dict[str, float]:
    """Bytes each device sends per step, by collective kind, and the total."""
    out = {k: 0.0 for k in _KINDS}
    for c in parse_collectives(hlo_text, num_partitions):
        out[c.kind] += c.sent
    out["total"] = sum(out[k] for k in _KINDS)
    return out


def predicted_bytes(plan: Any) -> dict[str, float]:
    """Bytes each device sends per step according to the cost model, for ``plan``.

    ``operators``: Σ_v comm_bytes at v's configuration; ``edges``: Σ over
    edges of (forward + backward) redistribution elements × dtype bytes
    (and over weight edges, what :func:`~shardplan.cost.edge.weight_edge_cost` sends),
    each configuration's device grid as the plan's layout lays it out (nesting and machine levels), and
    the activation gradients the tables charge on the edges with ``Machine.scatter_gathered_grads``
    (:func:`~shardplan.cost.plan_home_bytes`; taken off the operators' ``comm_bytes`` there).
    """
    t = plan.tables
    g = plan.graph
    a = plan.assignment
    p = plan.machine.num_devices
    ops_bytes = float(sum(float(c.comm_bytes[k]) for c, k in zip(t.op_costs, a)))
    edge_bytes = 0.0
    for e in g.edges:
        u, v = g.operators[e.src], g.operators[e.dst]
        lu = t.arrays[e.src].take(np.asarray([a[e.src]]))  # the chosen layouts, nesting and levels included
        lv = t.arrays[e.dst].take(np.asarray([a[e.dst]]))
        f, b = edge_volumes(u, lu, v, e.slot, lv, p, steps=plan.machine.stepwise_redistribution)
        edge_bytes += float(f[0, 0] + b[0, 0]) * plan.machine.dtype_bytes
    for e in g.weight_edges:  # a shared parameter moved between its owner's layout and a reader's
        lu = t.arrays[e.src].take(np.asarray([a[e.src]]))
        lv = t.arrays[e.dst].take(np.asarray([a[e.dst]]))
        edge_bytes += float(weight_edge_cost(g.operators[e.src], e.src_weight, lu, g.operators[e.dst],
                                             e.dst_weight, lv, plan.machine)[1][0, 0])
    # activation gradients the tables charge on their edges (DTensor's machine only; 0 on XLA's)
    edge_bytes += plan_home_bytes(t, a)
    return {"operators": ops_bytes, "edges": edge_bytes, "total": ops_bytes + edge_bytes}
