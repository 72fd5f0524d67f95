"""Which memory-bound operators of a traced JAX program XLA fuses into one kernel, and what each kernel moves.

A JAX step runs as one XLA program, and XLA's GPU compiler fuses memory-bound operators before it emits
kernels (XLA's documentation, "Operation semantics" and the GPU compiler's fusion passes; the rules below are
its documented ones):

* **loop and input fusion**: an elementwise producer is fused into its consumers (an elementwise consumer: a
  loop fusion; a reduction: an input fusion), so the value passed never reaches HBM. A producer is fused into
  all its consumers or none; with several consumers it is duplicated into each, and XLA's priority fusion does
  that when its cost model finds it cheaper. Here, by HBM traffic: fusing a producer whose kernel reads ``I``
  elements and writes ``P`` into ``k`` consumers reads ``k I`` instead of ``I + P + k P`` (its own kernel
  plus each consumer loading the result), so it is fused when ``(k - 1) I <= (k + 1) P``: always for one
  consumer, for a softmax's ``exp(s - max)`` read by the sum and the division, not for a residual stream
  read by a layer norm's passes and the next addition;
* a **reduction ends a kernel**: its result is written and every consumer loads it (a reduction is never
  duplicated into a consumer);
* **multi-output (sibling) fusion**: independent reductions to the same shape that read the same tensor are
  one kernel that loads it once (a layer norm's sum and sum of squares);
* **not fused**: across matrix products and convolutions (cuBLAS / cuDNN calls), gathers and scatters, sorts,
  collectives, control flow and anything the frontend described conservatively: their operands and results
  are in HBM.

The backward pass is compiled by the same rules: the gradient of a value computed on chip stays on chip, the
partial gradients of a tensor that several fused operators read are summed in the kernel that writes its
gradient, and a kernel whose operators are nonlinear (their backward rules read forward values: a product of
two values, an exponential, a layer norm's scaling) re-reads its external inputs and recomputes the rest.

The result, per fusible operator, is a :class:`~shardplan.ir.KernelIO`: how many times each of its operands is
loaded forward (once per kernel containing it that loads that operand first; 0 when the value comes from
inside the kernel or another operator of the kernel loaded it), whether its output is written (the kernel's
root), and, per operand, the tiles the backward moves on its account (on the first fused reader of a tensor:
its gradient written if it needs one, its value re-read if a kernel loading it is nonlinear).
The decisions depend on the graph's shapes only, not on a layout: a layout that splits a fused chain
differently on its two sides puts a collective between them, which XLA does not fuse across, and which this
model then under-counts by the materialised value (docs/cost-model.md, "Fused memory-bound chains").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from shardplan.ir import KernelIO, Operator

__all__ = ["xla_kernels"]


def xla_kernels(operators: Mapping[str, Operator], fusible: Iterable[str],
                nonlinear: Iterable[str]) -> dict[str, KernelIO]:
    """The :class:`~shardplan.ir.KernelIO` of every operator of ``fusible`` (names of ``operators``, which are
    in a topological order), after the module docstring's rules; ``nonlinear``: the operators whose backward
    reads forward values."""
    fusible, nonlinear = set(fusible), set(nonlinear)
    order = {n: i for i, n in enumerate(operators)}
    consumers: dict[str, list[str]] = {n: [] for n in operators}
    for name, op in operators.items():
        for t in op.inputs:
            if t.src in consumers and name not in consumers[t.src]:
                consumers[t.src].append(name)

    def reduction(name: str) -> bool:
        return bool(operators[name].reduction_dims)

    fused: set[str] = set()  # duplicated into every consumer: never written
    cone_in: dict[str, dict[object, int]] = {}  # external sources the operator's cone loads -> elements
    for name, op in operators.items():
        if name not in fusible:
            continue
        ext: dict[object, int] = {}
        for t in op.inputs:
            if t.src in fused:
                ext.update(cone_in[t.src])
            else:
                ext[t.src] = t.size
        for i, w in enumerate(op.weights):
            ext[(name, i)] = w.size
        cone_in[name] = ext
        cs = consumers[name]
        if reduction(name) or not cs or not all(c in fusible for c in cs):
            continue
        k = len(cs)
        if (k - 1) * sum(ext.values()) <= (k + 1) * op.output.size:
            fused.add(name)

    reads: dict[str, list[float]] = {n: [0.0] * (len(operators[n].inputs) + len(operators[n].weights))
                                    for n in fusible}
    roots = [n for n in operators if n in fusible and n not in fused]
    loads: dict[str, dict[object, tuple[str, int]]] = {}  # root -> source -> (operator, slot) that loads it
    cones = {root: _cone(operators, root, fused) for root in roots}
    for root in roots:
        cone = cones[root]
        first: dict[object, tuple[str, int]] = {}
        for v in sorted(cone, key=order.__getitem__):  # graph order: the first reader in the kernel loads a source
            op = operators[v]
            for slot, t in enumerate(op.inputs):
                if t.src not in fused:
                    first.setdefault(t.src, (v, slot))
            for i in range(len(op.weights)):
                first.setdefault((v, i), (v, len(op.inputs) + i))
        for v, slot in first.values():
            reads[v][slot] += 1.0
        loads[root] = first

    _siblings(operators, roots, loads, reads, reduction)

    residual: dict[object, bool] = {}  # source -> a kernel that loads it is nonlinear
    for root, first in loads.items():
        cone_nonlinear = any(v in nonlinear for v in cones[root])
        for src in first:
            residual[src] = residual.get(src, False) or cone_nonlinear
    back: dict[str, list[float]] = {n: [0.0] * len(reads[n]) for n in reads}
    charged: set[object] = set()
    for name, op in operators.items():  # the first fused reader of a tensor carries its backward traffic
        if name not in fusible:
            continue
        for slot, t in enumerate(op.inputs):
            if t.src in fused or t.src in charged:
                continue
            charged.add(t.src)
            back[name][slot] = float(t.needs_grad) + float(residual.get(t.src, False))
        for i, w in enumerate(op.weights):
            back[name][len(op.inputs) + i] = float(w.needs_grad) + float(residual.get((name, i), False))
    return {n: KernelIO(tuple(reads[n]), tuple(back[n]), n not in fused) for n in operators if n in fusible}


def _cone(operators: Mapping[str, Operator], root: str, fused: set[str]) -> set[str]:
    """The operators of the kernel rooted at ``root``: it and, transitively, the fused producers it reads."""
    cone, stack = set(), [root]
    while stack:
        v = stack.pop()
        if v not in cone:
            cone.add(v)
            stack.extend(t.src for t in operators[v].inputs if t.src in fused)
    return cone


def _siblings(operators: Mapping[str, Operator], roots: list[str], loads: Mapping[str, Mapping[object, tuple]],
              reads: dict[str, list[float]], reduction) -> None:
    """Multi-output fusion: of independent reduction kernels to one output shape that load the same source,
    only the first loads it (``reads`` updated in place)."""
    index = {n: i for i, n in enumerate(operators)}
    ancestors: dict[str, int] = {}  # bitset over graph positions
    for name, op in operators.items():
        bits = 0
        for t in op.inputs:
            if t.src in ancestors:
                bits |= ancestors[t.src] | (1 << index[t.src])
        ancestors[name] = bits
    groups: dict[tuple, list[str]] = {}
    for r in roots:
        if reduction(r):
            for src in loads[r]:
                if isinstance(src, str):
                    groups.setdefault((src, operators[r].output.shape), []).append(r)
    for (src, _), rs in groups.items():
        kept: list[str] = []
        for r in rs:
            if any(ancestors[r] >> index[k] & 1 or ancestors[k] >> index[r] & 1 for k in kept):
                continue
            if kept:
                v, slot = loads[r][src]
                reads[v][slot] -= 1.0
            kept.append(r)
