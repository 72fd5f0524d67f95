"""Readable dimension names for traced operators: ``batch:16 seq:128 out:2304 in:768``.

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
   reshape of ``out:96`` into ``(3, 32)``);
4. otherwise it shows its letter.

The axes of the data arguments are labelled ``batch`` (axis 0 of a batch
leaf), ``seq`` (axis 1 of an integer rank-2 leaf: token ids) and ``d<i>``
otherwise. An operator's output axes carry its dimensions' labels (a merged
axis joins them with ``*``: ``heads*out.1``), so names flow along the
graph. Labels of one operator that coincide get a suffix (``seq``,
``seq_2``: the query and key positions of attention scores).
"""

from __future__ import annotations

from typing import Mapping, Sequence

from shardplan.ir import AxisMap, Operator

__all__ = ["input_axis_labels", "label_dims", "output_axis_labels"]

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
    return f"{label}.{pieces.index(d)}" if d in pieces else None


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
