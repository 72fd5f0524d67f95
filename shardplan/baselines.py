"""Hand-written strategies to compare the search against, costed by the same model.

Each baseline encodes an expert's rule, so it looks at dimension names and
operator kinds (never at costs, except Megatron's choice of its batch
split m, which the rule itself leaves open). It returns ``{operator name:
configuration tuple}``; :func:`baseline_plan` turns that into a
:class:`~shardplan.spmd.SpmdPlan` with :func:`~shardplan.spmd.plan_from_configs`.

* :func:`data_parallel`: the batch dimension split p ways, every other
  dimension 1.
* :func:`one_weird_trick` (Krizhevsky 2014, CNNs): data-parallel
  convolutions, pools and norms; fully connected layers split over their
  output features ``n`` p ways; the layers after the first FC layer (the
  softmax / loss) follow that layout (their input's feature dimension split
  p ways).
* :func:`megatron` (Mesh-TensorFlow / Megatron-LM hybrid, Transformers):
  batch split m ways and, n = p / m ways, the heads ``h`` of attention
  vertices, the hidden ``e`` of feed-forward vertices and the vocabulary
  ``v`` of embeddings, projection and loss; other vertices (norms, adds)
  split the batch only (replicated across the n group). m is the divisor
  of p of least predicted cost.
* :func:`gnmt` (Wu et al. 2016, RNNs): each LSTM layer on its own group of
  devices (layer dimension split L ways) with data parallelism inside
  (batch split p / L ways); every other vertex data parallel.

Fallback: when the configuration a rule asks for is not valid (a split that
does not divide the extent, or leaves fewer than ``cutoff`` points per part,
e.g. 1000 classes over 32 devices), the baseline takes the valid
configuration with every split at most the requested one and the largest
number of devices, ties going to the larger split of the first requested
dimension (batch before model dimensions): 1000 classes on 32 devices
become a 25-way split (:func:`nearest_valid`).
"""

from __future__ import annotations

import math
from typing import Callable, Mapping

import numpy as np

from shardplan.cost import CostTables
from shardplan.errors import ShardplanError
from shardplan.ir import Operator
from shardplan.layout import Layout
from shardplan.spmd import SpmdPlan, plan_from_configs

__all__ = ["Strategy", "batch_dim", "data_parallel", "one_weird_trick", "megatron", "gnmt", "BASELINES",
           "baseline_plan", "baseline_plans", "nearest_valid"]

Strategy = dict[str, tuple[int, ...]]


def batch_dim(op: Operator) -> str | None:
    """The operator's batch dimension.

    A labelled operator (a traced graph, :attr:`~shardplan.ir.Operator.dim_labels`): the dimension
    labelled ``batch`` (the batch of the data arguments followed through the graph) or leading a
    merged axis (``batch*seq``: the batch and sequence flattened together), or None (the operator
    does not see the batch: it runs replicated). Otherwise ``b`` if it has one, else the dim
    indexing its output's first axis.
    """
    if op.dim_labels:
        return next((d for d, lab in op.dim_labels if lab == "batch" or lab.startswith("batch*")), None)
    if "b" in op.dim_names:
        return "b"
    axes = op.output.axes
    return axes[0].dim if axes else None


def nearest_valid(op: Operator, configs: np.ndarray, desired: Mapping[str, int]) -> tuple[int, ...]:
    """The valid configuration closest to ``desired`` (dim -> split; others 1).

    Exact when valid; otherwise the configuration with every split at most
    the desired one (and 1 on undesired dims) using the most devices, ties
    to larger splits in the order of ``desired``.
    """
    names = op.dim_names
    want = np.asarray([int(desired.get(d, 1)) for d in names], dtype=np.int64)
    ok = (configs <= want[None, :]).all(axis=1)
    cand = configs[ok]
    if not len(cand):  # pragma: no cover - the all-ones configuration is always valid
        raise ShardplanError(f"operator {op.name!r}: no valid configuration below {dict(desired)}")
    order = [names.index(d) for d in desired if d in names]
    keys = [cand[:, j] for j in reversed(order)] + [cand.prod(axis=1)]
    best = cand[np.lexsort(keys)[-1]]
    return tuple(int(x) for x in best)


def _resolve(tables: CostTables, desired: Mapping[str, Mapping[str, int]]) -> Strategy:
    """Every operator's :func:`nearest_valid` configuration; computed once per distinct
    (configuration array, dims, wish): identical operators share their arrays."""
    seen: dict[tuple, tuple[int, ...]] = {}
    out: Strategy = {}
    for i, op in enumerate(tables.graph.operators):
        configs = tables.configs[i]
        key = (id(configs), op.dim_names, tuple(desired[op.name].items()))
        if key not in seen:
            seen[key] = nearest_valid(op, configs, desired[op.name])
        out[op.name] = seen[key]
    return out


def _dp_wish(op: Operator, ways: int) -> dict[str, int]:
    d = batch_dim(op)
    return {d: ways} if d is not None else {}


def data_parallel(tables: CostTables) -> Strategy:
    """Batch split p ways everywhere (or the largest valid batch split)."""
    p = tables.machine.num_devices
    return _resolve(tables, {op.name: _dp_wish(op, p) for op in tables.graph.operators})


def _feature_dim(op: Operator) -> str | None:
    """The dim indexing the last axis of the first input (the features an FC layer produced)."""
    if not op.inputs or not op.inputs[0].axes:
        return None
    return op.inputs[0].axes[-1].dim


def one_weird_trick(tables: CostTables) -> Strategy:
    """Data-parallel convolutional part, output-feature-parallel FC layers, loss following the FC layout."""
    g = tables.graph
    p = tables.machine.num_devices
    after_fc: set[str] = set()
    wishes: dict[str, dict[str, int]] = {}
    for i in g.topological_order():
        op = g.operators[i]
        srcs = {t.src for t in op.inputs}
        if op.kind == "dense":
            out = op.output.axes[-1].dim
            wishes[op.name] = {out: p} if out else {}
            after_fc.add(op.name)
        elif srcs & after_fc:
            feat = _feature_dim(op)
            wishes[op.name] = {feat: p} if feat else _dp_wish(op, p)
            after_fc.add(op.name)
        else:
            wishes[op.name] = _dp_wish(op, p)
    return _resolve(tables, wishes)


_MODEL_DIMS = ("h", "e", "v")


def _megatron_wishes_op(op: Operator, m: int, n: int) -> dict[str, int]:
    w = _dp_wish(op, m)
    names = op.dim_names
    model = "h" if "h" in names else ("e" if op.kind == "ffn" and "e" in names else ("v" if "v" in names else None))
    if model is not None and n > 1:
        w[model] = n
    return w


def _megatron_wishes(tables: CostTables, m: int, n: int) -> dict[str, dict[str, int]]:
    return {op.name: _megatron_wishes_op(op, m, n) for op in tables.graph.operators}


def _megatron_layouts(tables: CostTables, m: int, n: int) -> Strategy | None:
    """Megatron-LM's layouts when the tensor-parallel group is one node (n = s_0): the model dim n ways on the
    device level, the batch m ways over the outer levels (filled from the inside); operators without a model
    dim (norms, adds) replicated over the node. None when that is not the machine's shape or a layout is not
    a candidate of the tables (then the configuration tuples of :func:`_megatron_wishes` are used)."""
    from shardplan.configs import level_products  # the enumerator's own fill rule

    levels = tables.machine.levels
    if len(levels) < 2 or n != levels[0]:
        return None
    outer = level_products(m, levels[1:])
    if outer is None:
        return None
    out: Strategy = {}
    for i, op in enumerate(tables.graph.operators):
        wish = _megatron_wishes_op(op, m, n)
        names = op.dim_names
        rows = [[1] * len(names) for _ in levels]
        for d, ways in wish.items():
            j = names.index(d)
            if d == batch_dim(op) and ways == m:
                fill = outer
                for lvl, f in enumerate(fill, start=1):
                    rows[lvl][j] *= f
            else:
                rows[0][j] *= ways
        if any(op.dims[j][1] % math.prod(r[j] for r in rows) for j in range(len(names))):
            return None
        orders = tuple(tuple(j for j in range(len(names)) if r[j] > 1) for r in rows)
        lay = Layout(names, levels, tuple(tuple(r) for r in rows), orders)
        if lay not in tables.layouts[i]:
            return None
        out[op.name] = lay
    return out


def megatron(tables: CostTables, m: int | None = None) -> Strategy:
    """Batch m ways, heads / feed-forward hidden / vocabulary n = p/m ways; m of least cost if not given.

    On a machine of several levels with n equal to the node size, the layouts are Megatron-LM's exactly
    (:func:`_megatron_layouts`; the tables need ``node_replicas=True`` for the norms' layouts)."""
    p = tables.machine.num_devices
    choices = [m] if m is not None else [d for d in range(1, p + 1) if p % d == 0]
    best: tuple[float, Strategy] | None = None
    for mm in choices:
        if p % mm:
            raise ShardplanError(f"megatron: batch split m={mm} does not divide p={p}")
        strat = _megatron_layouts(tables, mm, p // mm) or _resolve(tables, _megatron_wishes(tables, mm, p // mm))
        cost = plan_from_configs(tables, strat).cost
        if best is None or cost < best[0]:
            best = (cost, strat)
    assert best is not None
    return best[1]


def gnmt(tables: CostTables) -> Strategy:
    """Each recurrent layer on its own devices (layer split L ways), data parallel inside and elsewhere."""
    p = tables.machine.num_devices
    wishes = {}
    for op in tables.graph.operators:
        r = op.recurrence
        if r is None:
            wishes[op.name] = _dp_wish(op, p)
            continue
        layers = min(op.extents[r.layer], p)
        wishes[op.name] = {r.layer: layers, r.batch: max(1, p // layers)}
    return _resolve(tables, wishes)


BASELINES: dict[str, Callable[[CostTables], Strategy]] = {
    "data_parallel": data_parallel,
    "one_weird_trick": one_weird_trick,
    "megatron": megatron,
    "gnmt": gnmt,
}


def baseline_plan(name: str, tables: CostTables) -> SpmdPlan:
    """The plan of baseline ``name`` (a key of :data:`BASELINES`)."""
    try:
        rule = BASELINES[name]
    except KeyError:
        raise ShardplanError(f"unknown baseline {name!r}; choose from {', '.join(BASELINES)}") from None
    return plan_from_configs(tables, rule(tables), name=name)


def baseline_plans(tables: CostTables, expert: str | None = None) -> dict[str, SpmdPlan]:
    """Data parallelism and, if given, the ``expert`` baseline (a key of :data:`BASELINES`): {name: plan}.

    A registered model names its expert in :attr:`shardplan.models.ModelSpec.expert`.
    """
    out = {"data_parallel": baseline_plan("data_parallel", tables)}
    if expert is not None:
        out[expert] = baseline_plan(expert, tables)
    return out
