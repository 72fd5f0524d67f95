"""Readable dimension names for traced operators: ``batch:16 seq:128 out:2304 in:768``.

Used by both frontends: the JAX lowering labels each operator as it builds
it (:func:`label_dims`, with hints from its primitive handlers), the
PyTorch frontend labels its finished graph (:func:`label_graph`, hints
from the operators' descriptions).

The lowering names iteration dimensions with letters (unique, short: what a
configuration is indexed by). For reports each dimension also gets a
*label*, the tensor axis it comes from as a user knows it, by these rules,
first match wins:

1. the dimension that carries the batch of the data arguments is ``batch``;
2. the handler of the primitive names the dimensions its semantics fix
   (*hints*): a ``dot_general`` that reads a parameter calls its contracted
   dimensions ``in`` and the parameter's free dimensions ``out``; one that
   reads no parameter (attention) calls its non-batch batch dimensions
   ``heads``; a convolution names ``batch``, ``in``/``out`` channels,
   ``height``/``width``/``depth`` and the kernel window ``kh``/``kw``/``kd``;
   a gather calls its lookup dimension ``vocab`` and the table's feature
   dimension ``embed``; pooling windows are ``window``;
3. otherwise a dimension inherits the label of the operand axis it indexes
   (an elementwise op, a reduction, a softmax keep their operands' names);
   the pieces of a split axis labelled L are ``L.0``, ``L.1``, ... (a
   reshape of ``out:96`` into ``(3, 32)``), or the parts of L when L was
   merged from as many (``batch*seq`` split back into ``batch``, ``seq``);
4. otherwise it shows its letter.

The axes of the data arguments are labelled ``batch`` (axis 0 of a batch
leaf), ``seq`` (axis 1 of an integer rank-2 leaf: token ids) and ``d<i>``
otherwise. An operator's output axes carry its dimensions' labels (a merged
axis joins them with ``*``: ``heads*out.1``), so names flow along the
graph. Labels of one operator that coincide get a suffix (``seq``,
``seq_2``: the query and key positions of attention scores).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Sequence

from shardplan.ir import AxisMap, Operator

__all__ = ["input_axis_labels", "label_dims", "output_axis_labels", "description_hints", "label_graph"]

Labels = tuple[str | None, ...]


def input_axis_labels(shape: Sequence[int], is_batch: bool, is_int: bool) -> Labels:
    """Labels of a data argument's axes: ``batch`` on axis 0 of a batch leaf, ``seq`` on axis 1 of token ids."""
    out: list[str | None] = []
    for i in range(len(shape)):
        if i == 0 and is_batch:
            out.append("batch")
        elif i == 1 and is_int and len(shape) == 2:
            out.append("seq")
        else:
            out.append(f"d{i}")
    return tuple(out)


def _from_axis(d: str, a: AxisMap, label: str | None) -> str | None:
    """The label ``d`` inherits from axis ``a`` labelled ``label``: the label itself, or a piece of a merged axis."""
    if label is None or a.window == d:
        return None
    if a.dim == d and not a.inner:
        return label
    pieces = (a.dim, *a.inner)
    if d not in pieces:
        return None
    parts = label.split("*")
    if len(parts) == len(pieces):  # a merged axis split back into its parts (flatten, then unflatten)
        return parts[pieces.index(d)]
    return f"{label}.{pieces.index(d)}"


def label_dims(op: Operator, tensor_labels: Mapping[str, Labels], hints: Mapping[str, str],
               batch_dim: str | None) -> dict[str, str]:
    """Dimension -> label for ``op`` (module docstring rules 1-4); ``tensor_labels``: tensor name -> axis labels."""
    out: dict[str, str] = {}
    for d in op.dim_names:
        if d == batch_dim:
            lab: str | None = "batch"
        else:
            lab = hints.get(d)
        if lab is None:
            for t in op.inputs + op.weights:
                labels = tensor_labels.get(t.name)
                if labels is None:
                    continue
                for a, lb in zip(t.axes, labels):
                    lab = _from_axis(d, a, lb)
                    if lab is not None:
                        break
                if lab is not None:
                    break
        out[d] = lab if lab is not None else d
    return _unique(out)


def _unique(labels: dict[str, str]) -> dict[str, str]:
    seen: dict[str, int] = {}
    out = {}
    for d, lab in labels.items():
        n = seen.get(lab, 0) + 1
        seen[lab] = n
        out[d] = lab if n == 1 else f"{lab}_{n}"
    return out


def output_axis_labels(op: Operator) -> Labels:
    """Labels of ``op``'s output axes: its dimensions' labels (joined with ``*`` on a merged axis)."""
    names = dict(op.dim_labels)
    out: list[str | None] = []
    for a in op.output.axes:
        if a.dim is None:
            out.append(None)
        else:
            out.append("*".join(names.get(d, d) for d in (a.dim, *a.inner)))
    return tuple(out)


_KIND_HINTS: Mapping[str, Mapping[str, str]] = {
    "conv": {"b": "batch", "c": "in", "n": "out", "g": "groups", "h": "height", "w": "width", "z": "depth",
             "r": "kh", "s": "kw", "t": "kd"},
    "attention": {"h": "heads", "l": "seq", "s": "seq_kv", "e": "head_dim", "f": "head_dim_v"},
    "attn_flash": {"h": "heads", "r": "group", "s": "seq", "t": "seq_kv", "k": "head_dim"},
}


def description_hints(op: Operator) -> dict[str, str]:
    """Labels that follow from an operator's description alone (no primitive at hand).

    A convolution's and an attention's fixed letters (``bchwnrs``, ``bhlsef``, fused ``bhrskt``); an operator with a
    weight: a dimension of the weight that is summed over is ``in`` (``vocab`` for an embedding
    lookup) and one that indexes the weight and the output but no input is ``out`` (``embed`` for a
    lookup).
    """
    if op.kind in _KIND_HINTS:
        return {d: lab for d, lab in _KIND_HINTS[op.kind].items() if d in op.extents}
    hints: dict[str, str] = {}
    lookup = op.kind in ("embedding", "gather")
    in_inputs = {d for t in op.inputs for d in t.dims}
    red = set(op.reduction_dims)
    for t in op.weights:
        for d in t.dims:
            if d in red:
                hints.setdefault(d, "vocab" if lookup else "in")
            elif d in op.output.dims and d not in in_inputs:
                hints.setdefault(d, "embed" if lookup else "out")
    return hints


def label_graph(ops: Sequence[Operator], input_labels: Mapping[str, Labels]) -> list[Operator]:
    """Every operator of ``ops`` (in graph order) with :attr:`~shardplan.ir.Operator.dim_labels` set.

    Labels flow from the graph inputs (``input_labels``: name -> axis labels) along the edges; the
    dimension inheriting ``batch`` is the batch; :func:`description_hints` name the rest.
    """
    axis: dict[str, Labels] = dict(input_labels)
    out = []
    for op in ops:
        tl = {t.name: axis[t.src] for t in op.inputs if t.src in axis}
        first = label_dims(op, tl, {}, None)
        batch = next((d for d, lab in first.items() if lab == "batch"), None)
        hints = {d: lab for d, lab in description_hints(op).items() if d != batch}
        labelled = replace(op, dim_labels=label_dims(op, tl, hints, batch))
        axis[op.name] = output_axis_labels(labelled)
        out.append(labelled)
    return out
