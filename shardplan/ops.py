"""Operator constructors: each returns an :class:`~shardplan.ir.Operator` description.

A constructor only describes: iteration dimensions, tensor access maps, work
per point and which tensors need gradients. No constructor carries cost code;
every cost is derived from the description (:mod:`shardplan.cost`).

Inputs are :class:`~shardplan.ir.TensorRef` values (a graph input or another
operator's ``.out``); weights are created by the constructor. Dimension
names follow the PaSE paper where it names them (``bchwnrs`` for a
convolution: batch, in-channels, height, width, out-channels, kernel rows,
kernel columns; ``bnc`` for a fully connected layer; ``lbsde`` for an LSTM).
"""

from __future__ import annotations

import math
import string
from typing import Sequence

from shardplan.errors import ShardplanError
from shardplan.ir import AxisMap, Causal, Operator, Recurrence, Tensor, TensorRef

__all__ = [
    "LETTER_POOL",
    "letters",
    "Param",
    "einsum",
    "dense",
    "conv2d",
    "pool2d",
    "batch_norm",
    "layer_norm",
    "softmax",
    "softmax_cross_entropy",
    "embedding",
    "elementwise",
    "concat",
    "slice_axis",
    "split",
    "reshape",
    "flatten",
    "transpose",
    "reduce_mean",
    "lstm",
    "gather",
    "scatter",
    "flash_attention",
    "FLASH_SOFTMAX_FLOPS",
    "FLASH_SOFTMAX_BACKWARD_FLOPS",
]


class Param:
    """A weight operand of :func:`einsum`: a trainable tensor of this shape."""

    def __init__(self, shape: Sequence[int], name: str = "w", trainable: bool = True) -> None:
        self.shape = tuple(int(s) for s in shape)
        self.name = name
        self.trainable = trainable


def _in(ref: TensorRef, name: str, axes: Sequence[AxisMap | str | None]) -> Tensor:
    if not isinstance(ref, TensorRef):
        raise ShardplanError(f"input {name!r} must be a TensorRef (a graph input or an operator's .out), got {ref!r}")
    return Tensor(name, ref.shape, tuple(axes), "input", needs_grad=ref.needs_grad, src=ref.name)


def _out(shape: Sequence[int], axes: Sequence[AxisMap | str | None], name: str = "y") -> Tensor:
    return Tensor(name, tuple(shape), tuple(axes), "output")


def _w(name: str, shape: Sequence[int], axes: Sequence[AxisMap | str | None], elem_factor: int = 1) -> Tensor:
    return Tensor(name, tuple(shape), tuple(axes), "weight", needs_grad=True, elem_factor=elem_factor)


def _check_rank(opname: str, ref: TensorRef, rank: int | tuple[int, ...], what: str) -> None:
    ranks = (rank,) if isinstance(rank, int) else rank
    if len(ref.shape) not in ranks:
        raise ShardplanError(f"operator {opname!r}: {what} must have rank {' or '.join(map(str, ranks))}, got shape {ref.shape}")


# ---------------------------------------------------------------------------
# contractions
# ---------------------------------------------------------------------------
def einsum(name: str, equation: str, *operands: TensorRef | Param, flops_per_point: float = 2.0,
           kind: str = "einsum") -> Operator:
    """A contraction written as an einsum equation, e.g. ``"bmk,kn->bmn"``.

    The iteration dimensions are the letters: the output's in order, then the
    summed letters in order of appearance (so ``"bc,cn->bn"`` has dims
    ``bnc`` as in the paper). Operands are inputs (:class:`TensorRef`) or
    weights (:class:`Param`). Work: ``flops_per_point`` (2 for multiply-add)
    per point of the full domain.
    """
    eq = equation.replace(" ", "")
    if "->" not in eq:
        raise ShardplanError(f"operator {name!r}: einsum equation {equation!r} needs an explicit '->' output")
    lhs, out = eq.split("->")
    terms = lhs.split(",")
    if len(terms) != len(operands):
        raise ShardplanError(f"operator {name!r}: equation {equation!r} has {len(terms)} operands, got {len(operands)}")
    if "." in eq:
        raise ShardplanError(f"operator {name!r}: ellipsis in einsum equations is not supported ({equation!r})")
    extents: dict[str, int] = {}
    for term, opnd in zip(terms, operands):
        if len(term) != len(opnd.shape):
            raise ShardplanError(f"operator {name!r}: operand {term!r} has shape {opnd.shape} (rank mismatch)")
        for ch, n in zip(term, opnd.shape):
            if ch in extents and extents[ch] != n:
                raise ShardplanError(
                    f"operator {name!r}: dimension {ch!r} has extent {extents[ch]} and {n} in {equation!r}"
                )
            extents[ch] = n
    for ch in out:
        if ch not in extents:
            raise ShardplanError(f"operator {name!r}: output letter {ch!r} appears in no operand of {equation!r}")
    if len(set(out)) != len(out):
        raise ShardplanError(f"operator {name!r}: repeated output letter in {equation!r}")
    order = list(out) + [ch for term in terms for ch in term if ch not in out]
    dims = tuple(dict.fromkeys(order))
    inputs, weights = [], []
    names_used: set[str] = set()
    for i, (term, opnd) in enumerate(zip(terms, operands)):
        if len(set(term)) != len(term):
            raise ShardplanError(f"operator {name!r}: repeated letter within operand {term!r} (diagonals) unsupported")
        if isinstance(opnd, Param):
            wname = opnd.name if opnd.name not in names_used else f"{opnd.name}{i}"
            t = Tensor(wname, opnd.shape, tuple(term), "weight", needs_grad=opnd.trainable)
            weights.append(t)
        else:
            tname = f"x{i}"
            inputs.append(_in(opnd, tname, tuple(term)))
            wname = tname
        names_used.add(wname)
    output = _out(tuple(extents[c] for c in out), tuple(out))
    return Operator(name, kind, tuple((d, extents[d]) for d in dims), tuple(inputs), output, tuple(weights),
                    flops_per_point=flops_per_point)


LETTER_POOL = "bsxyzuvw" + "".join(c for c in string.ascii_lowercase if c not in "bsxyzuvw")


def letters(n: int, avoid: str | Sequence[str] = "") -> list[str]:
    """``n`` distinct dimension names: single letters from :data:`LETTER_POOL` (batch-like first)
    that are not in ``avoid``, then ``d0, d1, ...`` when the letters run out."""
    pool = [c for c in LETTER_POOL if c not in avoid]
    if n <= len(pool):
        return pool[:n]
    extra = [f"d{i}" for i in range(n) if f"d{i}" not in avoid]
    return pool + extra[: n - len(pool)]


def _batch_letters(n: int, reserved: str) -> str:
    return "".join(letters(n, reserved))


def dense(name: str, x: TensorRef, units: int, letters: str | None = None) -> Operator:
    """Fully connected layer ``y[..., n] = sum_c x[..., c] W[c, n]`` (no bias).

    Dims are the leading (batch) letters, then ``n`` (outputs) and ``c``
    (inputs): ``bnc`` for a 2-D input as in the paper. ``letters`` overrides
    them, e.g. ``"bsvd"`` for a projection to the vocabulary (``v`` outputs,
    ``d`` inputs). The bias is left out: its gradient is a different
    reduction (over the batch only) and its traffic is negligible.
    """
    if len(x.shape) < 2:
        raise ShardplanError(f"operator {name!r}: dense needs an input of rank >= 2, got {x.shape}")
    nb = len(x.shape) - 1
    if letters is None:
        letters = _batch_letters(nb, "nc") + "nc"
    if len(letters) != nb + 2 or len(set(letters)) != len(letters):
        raise ShardplanError(f"operator {name!r}: letters {letters!r} must name {nb} batch dims + out + in, distinct")
    b, n, c = letters[:nb], letters[nb], letters[nb + 1]
    return einsum(name, f"{b}{c},{c}{n}->{b}{n}", x, Param((x.shape[-1], units)), kind="dense")


def _conv_out(size: int, k: int, stride: int, pad: int, dil: int, opname: str) -> int:
    out = (size + 2 * pad - dil * (k - 1) - 1) // stride + 1
    if out <= 0:
        raise ShardplanError(f"operator {opname!r}: window {k} (stride {stride}, padding {pad}) does not fit extent {size}")
    return out


def _pair(v: int | Sequence[int]) -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    a, b = v
    return (int(a), int(b))


def conv2d(name: str, x: TensorRef, out_channels: int, kernel: int | Sequence[int], stride: int | Sequence[int] = 1,
           padding: int | Sequence[int] = 0, dilation: int | Sequence[int] = 1) -> Operator:
    """2-D convolution, NCHW, groups = 1, no bias.

    ``y[b,n,h,w] = sum_{c,r,s} x[b, c, sh*h + dh*r - ph, sw*w + dw*s - pw] * W[n,c,r,s]``

    Dims ``bchwnrs`` (c: input channels, n: output channels) as in the paper.
    """
    _check_rank(name, x, 4, "conv2d input (N, C, H, W)")
    bsz, cin, hin, win = x.shape
    (kr, ks), (sh, sw), (ph, pw), (dh, dw) = _pair(kernel), _pair(stride), _pair(padding), _pair(dilation)
    ho = _conv_out(hin, kr, sh, ph, dh, name)
    wo = _conv_out(win, ks, sw, pw, dw, name)
    dims = (("b", bsz), ("c", cin), ("h", ho), ("w", wo), ("n", out_channels), ("r", kr), ("s", ks))
    xin = _in(x, "x", ("b", "c", AxisMap("h", "r", sh, dh, -ph), AxisMap("w", "s", sw, dw, -pw)))
    wt = _w("w", (out_channels, cin, kr, ks), ("n", "c", "r", "s"))
    out = _out((bsz, out_channels, ho, wo), ("b", "n", "h", "w"))
    return Operator(name, "conv2d", dims, (xin,), out, (wt,), flops_per_point=2.0)


def pool2d(name: str, x: TensorRef, kernel: int | Sequence[int], stride: int | Sequence[int] | None = None,
           padding: int | Sequence[int] = 0, mode: str = "max") -> Operator:
    """Max or average pooling: ``y[b,c,h,w] = op_{r,s} x[b, c, sh*h + r - ph, sw*w + s - pw]``. Dims ``bchwrs``."""
    _check_rank(name, x, 4, "pool2d input (N, C, H, W)")
    if mode not in ("max", "avg"):
        raise ShardplanError(f"operator {name!r}: pooling mode must be 'max' or 'avg', got {mode!r}")
    bsz, c, hin, win = x.shape
    (kr, ks) = _pair(kernel)
    (sh, sw) = _pair(stride) if stride is not None else (kr, ks)
    (ph, pw) = _pair(padding)
    ho = _conv_out(hin, kr, sh, ph, 1, name)
    wo = _conv_out(win, ks, sw, pw, 1, name)
    dims = (("b", bsz), ("c", c), ("h", ho), ("w", wo), ("r", kr), ("s", ks))
    xin = _in(x, "x", ("b", "c", AxisMap("h", "r", sh, 1, -ph), AxisMap("w", "s", sw, 1, -pw)))
    return Operator(name, f"{mode}pool", dims, (xin,), _out((bsz, c, ho, wo), ("b", "c", "h", "w")),
                    flops_per_point=1.0)


# ---------------------------------------------------------------------------
# normalisation, softmax, loss
# ---------------------------------------------------------------------------
def _norm_op(name: str, kind: str, x: TensorRef, letters: str, norm: str, param_axis: str,
             flops: float) -> Operator:
    dims = tuple(zip(letters, x.shape))
    xin = _in(x, "x", tuple(letters))
    ext = dict(dims)
    weights = (_w("gamma", (ext[param_axis],), (param_axis,)), _w("beta", (ext[param_axis],), (param_axis,)))
    return Operator(name, kind, dims, (xin,), _out(x.shape, tuple(letters)), weights, flops_per_point=flops,
                    norm_dims=tuple(norm), norm_stats=2)


def batch_norm(name: str, x: TensorRef) -> Operator:
    """Batch normalisation over every axis but the channel axis (axis 1).

    Statistics (mean, variance) are reduced over ``b`` and the spatial
    dims; splitting those all-reduces 2 values per channel of the tile.
    """
    _check_rank(name, x, (2, 3, 4), "batch_norm input")
    letters = "bchw"[: len(x.shape)] if len(x.shape) == 4 else ("bc" if len(x.shape) == 2 else "bcs")
    norm = "".join(ch for ch in letters if ch != "c")
    return _norm_op(name, "batch_norm", x, letters, norm, "c", flops=8.0)


def layer_norm(name: str, x: TensorRef) -> Operator:
    """Layer normalisation over the last axis (``d``), with gain and bias over ``d``."""
    if len(x.shape) < 2:
        raise ShardplanError(f"operator {name!r}: layer_norm needs rank >= 2, got {x.shape}")
    letters = _batch_letters(len(x.shape) - 1, "d") + "d"
    return _norm_op(name, "layer_norm", x, letters, "d", "d", flops=8.0)


def softmax(name: str, x: TensorRef, letters: str | None = None) -> Operator:
    """Softmax over the last axis; that axis is normalised over (max and sum: 2 statistics)."""
    if letters is None:
        letters = _batch_letters(len(x.shape) - 1, "n") + "n"
    if len(letters) != len(x.shape):
        raise ShardplanError(f"operator {name!r}: letters {letters!r} do not match rank of {x.shape}")
    dims = tuple(zip(letters, x.shape))
    return Operator(name, "softmax", dims, (_in(x, "x", tuple(letters)),), _out(x.shape, tuple(letters)),
                    flops_per_point=5.0, norm_dims=(letters[-1],), norm_stats=2)


def softmax_cross_entropy(name: str, logits: TensorRef, labels: TensorRef, letters: str | None = None) -> Operator:
    """Per-example loss ``-log softmax(logits)[label]`` over the last axis.

    The class dimension indexes no output axis, so it is a reduction dim
    (the gathered target logit); it is also normalised over (max and
    sum-exp): a split of the classes all-reduces 3 values per example.
    """
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ShardplanError(
            f"operator {name!r}: labels have shape {labels.shape}, expected {tuple(logits.shape[:-1])}"
        )
    if letters is None:
        letters = _batch_letters(len(logits.shape) - 1, "n") + "n"
    if len(letters) != len(logits.shape):
        raise ShardplanError(f"operator {name!r}: letters {letters!r} do not match rank of {logits.shape}")
    dims = tuple(zip(letters, logits.shape))
    lab = Tensor("labels", labels.shape, tuple(letters[:-1]), "input", needs_grad=False, src=labels.name)
    return Operator(name, "softmax_xent", dims, (_in(logits, "logits", tuple(letters)), lab),
                    _out(labels.shape, tuple(letters[:-1]), "loss"), flops_per_point=5.0,
                    norm_dims=(letters[-1],), norm_stats=2)


def embedding(name: str, ids: TensorRef, vocab: int, dim: int) -> Operator:
    """Embedding lookup ``y[b,s,d] = W[ids[b,s], d]``, dims ``bsdv`` as in the paper.

    Written as the one-hot contraction ``y[b,s,d] = sum_v onehot(ids)[b,s,v] W[v,d]``
    so that the vocabulary ``v`` is a reduction dimension: splitting it
    leaves each device a slice of the table and all-reduces the output. The
    real work is a gather, one element per output point, hence
    ``flops_per_point = 1/vocab``.
    """
    lead = _batch_letters(len(ids.shape), "dv")
    ids_t = Tensor("ids", ids.shape, tuple(lead), "input", needs_grad=False, src=ids.name)
    dims = tuple(zip(lead, ids.shape)) + (("d", dim), ("v", vocab))
    return Operator(name, "embedding", dims, (ids_t,), _out(tuple(ids.shape) + (dim,), tuple(lead) + ("d",)),
                    (_w("table", (vocab, dim), ("v", "d")),), flops_per_point=1.0 / vocab)


# ---------------------------------------------------------------------------
# elementwise and data movement
# ---------------------------------------------------------------------------
def elementwise(name: str, *inputs: TensorRef, flops_per_point: float = 1.0, kind: str = "elementwise",
                letters: str | None = None) -> Operator:
    """An n-ary elementwise operator with numpy broadcasting.

    Dims are the output's axes; an input axis of extent 1 under a larger
    output axis (or a missing leading axis) is broadcast: indexed by no dim.
    """
    if not inputs:
        raise ShardplanError(f"operator {name!r}: elementwise needs at least one input")
    rank = max(len(t.shape) for t in inputs)
    shape = [1] * rank
    for t in inputs:
        padded = (1,) * (rank - len(t.shape)) + tuple(t.shape)
        for i, n in enumerate(padded):
            if shape[i] == 1:
                shape[i] = n
            elif n not in (1, shape[i]):
                raise ShardplanError(
                    f"operator {name!r}: shapes {[tuple(t.shape) for t in inputs]} do not broadcast (axis {i})"
                )
    if letters is None:
        letters = _batch_letters(rank, "")
    if len(letters) != rank:
        raise ShardplanError(f"operator {name!r}: letters {letters!r} do not match rank {rank}")
    ins = []
    for k, t in enumerate(inputs):
        off = rank - len(t.shape)
        axes = [letters[off + i] if (n == shape[off + i]) else None for i, n in enumerate(t.shape)]
        ins.append(_in(t, f"x{k}", axes))
    return Operator(name, kind, tuple(zip(letters, shape)), tuple(ins), _out(shape, tuple(letters)),
                    flops_per_point=flops_per_point)


def _axis(opname: str, axis: int, rank: int) -> int:
    a = axis + rank if axis < 0 else axis
    if not 0 <= a < rank:
        raise ShardplanError(f"operator {opname!r}: axis {axis} out of range for rank {rank}")
    return a


def concat(name: str, inputs: Sequence[TensorRef], axis: int) -> Operator:
    """Concatenation along ``axis``: input k is read at ``index - start_k`` on that axis."""
    if not inputs:
        raise ShardplanError(f"operator {name!r}: concat needs inputs")
    rank = len(inputs[0].shape)
    a = _axis(name, axis, rank)
    for t in inputs:
        if len(t.shape) != rank or any(t.shape[i] != inputs[0].shape[i] for i in range(rank) if i != a):
            raise ShardplanError(
                f"operator {name!r}: cannot concatenate shapes {[tuple(t.shape) for t in inputs]} on axis {a}"
            )
    letters = _batch_letters(rank, "")
    shape = list(inputs[0].shape)
    shape[a] = sum(t.shape[a] for t in inputs)
    ins, start = [], 0
    for k, t in enumerate(inputs):
        axes = [AxisMap(letters[i], offset=-start, partial=True) if i == a else letters[i] for i in range(rank)]
        ins.append(_in(t, f"x{k}", axes))
        start += t.shape[a]
    return Operator(name, "concat", tuple(zip(letters, shape)), tuple(ins), _out(shape, tuple(letters)),
                    flops_per_point=0.0)


def slice_axis(name: str, x: TensorRef, axis: int, start: int, size: int) -> Operator:
    """``y = x[..., start:start+size, ...]`` along ``axis``."""
    rank = len(x.shape)
    a = _axis(name, axis, rank)
    if start < 0 or size <= 0 or start + size > x.shape[a]:
        raise ShardplanError(f"operator {name!r}: slice [{start}:{start + size}] outside axis {a} of {x.shape}")
    letters = _batch_letters(rank, "")
    shape = list(x.shape)
    shape[a] = size
    axes = [AxisMap(letters[i], offset=start, partial=True) if i == a else letters[i] for i in range(rank)]
    return Operator(name, "slice", tuple(zip(letters, shape)), (_in(x, "x", axes),), _out(shape, tuple(letters)),
                    flops_per_point=0.0)


def split(name: str, x: TensorRef, axis: int, sizes: Sequence[int]) -> list[Operator]:
    """Split along ``axis`` into pieces of ``sizes``: one slice operator per piece (``name_0``, ...)."""
    a = _axis(name, axis, len(x.shape))
    if sum(sizes) != x.shape[a]:
        raise ShardplanError(f"operator {name!r}: sizes {list(sizes)} do not add up to {x.shape[a]} (axis {a})")
    out, start = [], 0
    for k, n in enumerate(sizes):
        out.append(slice_axis(f"{name}_{k}", x, a, start, n))
        start += n
    return out


def _refine(a: Sequence[int], b: Sequence[int]) -> list[tuple[list[int], list[int], list[int]] | None]:
    """Common refinement of two shapes with equal products.

    Returns groups ``(fine_extents, a_axes_fine_counts, b_axes_fine_counts)``
    or None for a group that has no integer refinement (e.g. (6,4)->(4,6)).
    """
    groups: list = []
    i = j = 0
    while i < len(a) or j < len(b):
        # grow a group until products agree
        ia, jb = i, j
        pa = pb = 1
        if i < len(a):
            pa, i = a[i], i + 1
        if j < len(b):
            pb, j = b[j], j + 1
        while pa != pb:
            if pa < pb:
                if i >= len(a):
                    raise ShardplanError("shapes do not have the same number of elements")
                pa, i = pa * a[i], i + 1
            else:
                if j >= len(b):
                    raise ShardplanError("shapes do not have the same number of elements")
                pb, j = pb * b[j], j + 1
        ga, gb = list(a[ia:i]), list(b[jb:j])
        # refine the group: walk both lists, cutting at common factors
        fine: list[int] = []
        ca, cb = [0] * len(ga), [0] * len(gb)
        x, y = 0, 0
        ra, rb = (ga[0] if ga else 1), (gb[0] if gb else 1)
        ok = True
        while x < len(ga) and y < len(gb):
            f = min(ra, rb)
            if max(ra, rb) % f:
                ok = False
                break
            fine.append(f)
            ca[x] += 1
            cb[y] += 1
            ra //= f
            rb //= f
            if ra == 1:
                x += 1
                ra = ga[x] if x < len(ga) else 1
            if rb == 1:
                y += 1
                rb = gb[y] if y < len(gb) else 1
        groups.append((fine, ca, cb, ga, gb) if ok else (None, None, None, ga, gb))
    return groups


def reshape(name: str, x: TensorRef, shape: Sequence[int]) -> Operator:
    """Reshape (row-major). Dims are the common refinement of the two shapes.

    Each tensor axis becomes a merged axis over consecutive fine dims; a
    split of a merged axis maps to its leading fine dim, so fine dims that
    are not leading in both tensors are fixed (never split). Axis groups
    without an integer refinement (e.g. (6,4) -> (4,6)) are read whole.
    """
    shape = tuple(int(s) for s in shape)
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        shape = tuple(math.prod(x.shape) // known if s == -1 else s for s in shape)
    if math.prod(shape) != math.prod(x.shape) or any(s <= 0 for s in shape):
        raise ShardplanError(f"operator {name!r}: cannot reshape {x.shape} to {shape}")
    groups = _refine(list(x.shape), list(shape))
    dims: list[tuple[str, int]] = []
    in_axes: list[AxisMap] = []
    out_axes: list[AxisMap] = []
    fixed: set[str] = set()
    k = 0
    for fine, ca, cb, ga, gb in groups:
        if fine is None:
            in_axes.extend(AxisMap(None) for _ in ga)
            out_axes.extend(AxisMap(None) for _ in gb)
            continue
        names = [f"i{k + t}" for t in range(len(fine))]
        k += len(fine)
        dims.extend(zip(names, fine))
        for counts, axes in ((ca, in_axes), (cb, out_axes)):
            pos = 0
            for cnt in counts:
                if cnt == 0:
                    axes.append(AxisMap(None))
                    continue
                sub = names[pos:pos + cnt]
                axes.append(AxisMap(sub[0], inner=tuple(sub[1:])))
                fixed.update(sub[1:])
                pos += cnt
    if not dims:
        dims = [("i0", 1)]
    return Operator(name, "reshape", tuple(dims), (_in(x, "x", in_axes),), _out(shape, out_axes),
                    flops_per_point=0.0, fixed=frozenset(fixed))


def flatten(name: str, x: TensorRef) -> Operator:
    """Keep axis 0, merge the rest: (N, C, H, W) -> (N, C*H*W)."""
    return reshape(name, x, (x.shape[0], math.prod(x.shape[1:])))


def transpose(name: str, x: TensorRef, perm: Sequence[int]) -> Operator:
    """``y = x.transpose(perm)``: output axis i is input axis perm[i]."""
    rank = len(x.shape)
    if sorted(perm) != list(range(rank)):
        raise ShardplanError(f"operator {name!r}: {list(perm)} is not a permutation of {rank} axes")
    letters = _batch_letters(rank, "")
    return Operator(name, "transpose", tuple(zip(letters, x.shape)), (_in(x, "x", tuple(letters)),),
                    _out(tuple(x.shape[p] for p in perm), tuple(letters[p] for p in perm)), flops_per_point=0.0)


def reduce_mean(name: str, x: TensorRef, axes: Sequence[int], keepdims: bool = False) -> Operator:
    """Mean over ``axes``; those dims index no output axis, so they are reduction dims."""
    rank = len(x.shape)
    red = sorted({_axis(name, a, rank) for a in axes})
    letters = _batch_letters(rank, "")
    out_shape, out_axes = [], []
    for i in range(rank):
        if i in red:
            if keepdims:
                out_shape.append(1)
                out_axes.append(AxisMap(None))
        else:
            out_shape.append(x.shape[i])
            out_axes.append(AxisMap(letters[i]))
    if not out_shape:
        out_shape, out_axes = [1], [AxisMap(None)]
    return Operator(name, "reduce_mean", tuple(zip(letters, x.shape)), (_in(x, "x", tuple(letters)),),
                    _out(out_shape, out_axes), flops_per_point=1.0)


def lstm(name: str, x: TensorRef, hidden: int, layers: int) -> Operator:
    """A whole stacked LSTM as one vertex with the paper's space ``lbsde``.

    l: layer, b: batch, s: time step, d: input features, e: hidden units.
    Per point: 4 gates x (input + recurrent product) x multiply-add = 16
    FLOPs; the weight ``W[l, d, e]`` stores 8 elements per point (4 gates x
    2 matrices; the input matrix of layer 0 is taken as d x e like the
    others). The output is the last layer's hidden states ``y[b, s, e]``.
    The recurrence (pipeline over l, sequential s, all-gather of h over a
    split e) is costed by :func:`shardplan.cost.operator.recurrence_cost`.
    """
    _check_rank(name, x, 3, "lstm input (batch, time, features)")
    b, s, d = x.shape
    dims = (("l", layers), ("b", b), ("s", s), ("d", d), ("e", hidden))
    wt = _w("w", (layers, d, hidden), ("l", "d", "e"), elem_factor=8)
    return Operator(name, "lstm", dims, (_in(x, "x", ("b", "s", "d")),), _out((b, s, hidden), ("b", "s", "e")),
                    (wt,), flops_per_point=16.0, recurrence=Recurrence(layer="l", time="s", state="e", batch="b"))


# ---------------------------------------------------------------------------
# gather and scatter (XLA semantics, as jax.lax.gather / jax.lax.scatter*)
# ---------------------------------------------------------------------------
def _operand(t: TensorRef | Param, name: str, axes: Sequence[AxisMap | str | None]) -> Tensor:
    if isinstance(t, Param):
        return Tensor(name, t.shape, tuple(axes), "weight", needs_grad=t.trainable)
    return _in(t, name, axes)


def _no_grad(t: TensorRef, name: str, axes: Sequence[AxisMap | str | None]) -> Tensor:
    if not isinstance(t, TensorRef):
        raise ShardplanError(f"input {name!r} must be a TensorRef, got {t!r}")
    return Tensor(name, t.shape, tuple(axes), "input", needs_grad=False, src=t.name)


def gather(name: str, operand: TensorRef | Param, indices: TensorRef, out_shape: Sequence[int], *,
           offset_dims: Sequence[int], collapsed_slice_dims: Sequence[int], start_index_map: Sequence[int],
           slice_sizes: Sequence[int], operand_batching_dims: Sequence[int] = (),
           start_indices_batching_dims: Sequence[int] = ()) -> Operator:
    """``lax.gather`` (index vector on the last axis of ``indices``), described like :func:`embedding`.

    The output axes are the *batch* axes (the index axes of ``indices``, in
    order) and the *offset* axes (the operand's window). Each operand axis
    that is looked up (in ``start_index_map`` with slice size 1) gets a
    *lookup* dimension of the operand's extent, written as the one-hot
    contraction ``y[.., d] = sum_v onehot(idx)[.., v] x[v, d]``: the lookup
    dimension indexes no output axis, so it is a reduction dimension and a
    split of it leaves each device a slice of the table and all-reduces the
    output (partial sums), while a split of a window axis (the embedding
    features) is free. Operand batching axes (``take_along_axis``) are
    indexed by the output axis of their paired index axis. A window cut
    shorter than its operand axis is read whole and its output dimension is
    fixed. Work: one element moved per output element.
    """
    out_shape = tuple(int(s) for s in out_shape)
    rank = len(operand.shape)
    if len(slice_sizes) != rank or len(indices.shape) < 1:
        raise ShardplanError(f"operator {name!r}: gather slice_sizes {list(slice_sizes)} do not match "
                             f"operand {operand.shape} / indices {indices.shape}")
    lookup = [a for a in start_index_map if a not in operand_batching_dims and int(slice_sizes[a]) == 1]
    names = letters(len(out_shape) + len(lookup))
    out_dims, lk_dims = names[:len(out_shape)], names[len(out_shape):]
    batch_axes = [i for i in range(len(out_shape)) if i not in offset_dims]
    idx_axes = list(range(len(indices.shape) - 1))
    if len(batch_axes) != len(idx_axes):
        raise ShardplanError(f"operator {name!r}: gather output {out_shape} does not match indices {indices.shape}")
    dim_of_idx_axis = {ia: out_dims[oa] for ia, oa in zip(idx_axes, batch_axes)}
    window = [a for a in range(rank) if a not in collapsed_slice_dims and a not in operand_batching_dims]
    if len(window) != len(offset_dims):
        raise ShardplanError(f"operator {name!r}: gather offset_dims {list(offset_dims)} do not match the window")
    fixed: set[str] = set()
    op_axes: list[AxisMap | str | None] = [None] * rank
    for a, d in zip(lookup, lk_dims):
        op_axes[a] = d
    for a, ib in zip(operand_batching_dims, start_indices_batching_dims):
        d = dim_of_idx_axis[int(ib)]
        op_axes[a] = d if operand.shape[a] == indices.shape[int(ib)] else None
    for a, oa in zip(window, offset_dims):
        d = out_dims[oa]
        if int(slice_sizes[a]) == operand.shape[a] and a not in start_index_map:
            op_axes[a] = d
        else:
            fixed.add(d)
    idx_t = _no_grad(indices, "indices", [dim_of_idx_axis[i] for i in idx_axes] + [None])
    dims = tuple(zip(out_dims, out_shape)) + tuple((d, operand.shape[a]) for a, d in zip(lookup, lk_dims))
    points = math.prod(e for _, e in dims)
    ins, ws = _inputs_weights(_operand(operand, "x", op_axes), idx_t)
    return Operator(name, "gather", dims, ins, _out(out_shape, tuple(out_dims)), ws,
                    flops_per_point=math.prod(out_shape) / points, fixed=frozenset(fixed))


def _inputs_weights(*ts: Tensor) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    return tuple(t for t in ts if t.role == "input"), tuple(t for t in ts if t.role == "weight")


def scatter(name: str, operand: TensorRef | Param, indices: TensorRef, updates: TensorRef, *,
            update_window_dims: Sequence[int], inserted_window_dims: Sequence[int],
            scatter_dims_to_operand_dims: Sequence[int], operand_batching_dims: Sequence[int] = (),
            scatter_indices_batching_dims: Sequence[int] = (), kind: str = "scatter") -> Operator:
    """``lax.scatter`` / ``scatter-add`` (index vector on the last axis of ``indices``): the transpose of :func:`gather`.

    Dims: one per output (= operand) axis, then one *source* dimension per
    scatter axis of ``updates`` (an update axis that is not a window axis):
    source dimensions index no output axis, so they are reduction
    dimensions (several updates may land on one element: a sum for
    ``scatter-add``). The operand is read in place; an update window axis
    covering its whole operand axis is indexed by that axis's dimension, a
    shorter one is read whole; an update scatter axis paired with an operand
    batching axis is indexed by that axis's dimension. A split of an output
    axis that the indices address leaves every device all the updates (each
    keeps those landing in its slice). Work: one element per update element.
    """
    rank = len(operand.shape)
    out_dims = letters(rank)
    scatter_axes = [i for i in range(len(updates.shape)) if i not in update_window_dims]
    idx_axes = list(range(len(indices.shape) - 1))
    if len(scatter_axes) != len(idx_axes):
        raise ShardplanError(f"operator {name!r}: scatter updates {updates.shape} do not match indices {indices.shape}")
    paired = {int(ib): int(a) for a, ib in zip(operand_batching_dims, scatter_indices_batching_dims)}
    src_names = iter(letters(len(scatter_axes), avoid=out_dims))
    upd_axes: list[AxisMap | str | None] = [None] * len(updates.shape)
    idx_dims: list[str | None] = []
    dims = list(zip(out_dims, operand.shape))
    for ua, ia in zip(scatter_axes, idx_axes):
        if ia in paired and operand.shape[paired[ia]] == updates.shape[ua]:
            d = out_dims[paired[ia]]
        else:
            d = next(src_names)
            dims.append((d, updates.shape[ua]))
        upd_axes[ua] = d
        idx_dims.append(d if indices.shape[ia] == updates.shape[ua] else None)
    window = [a for a in range(rank) if a not in inserted_window_dims and a not in operand_batching_dims]
    for a, ua in zip(window, update_window_dims):
        if updates.shape[ua] == operand.shape[a] and a not in scatter_dims_to_operand_dims:
            upd_axes[ua] = out_dims[a]
    x = _operand(operand, "x", out_dims)
    ins, ws = _inputs_weights(x, _no_grad(indices, "indices", idx_dims + [None]), _in(updates, "updates", upd_axes))
    points = math.prod(e for _, e in dims)
    return Operator(name, kind, tuple(dims), ins, _out(operand.shape, tuple(out_dims)), ws,
                    flops_per_point=math.prod(updates.shape) / points)


# ---------------------------------------------------------------------------
# fused attention (FlashAttention)
# ---------------------------------------------------------------------------
FLASH_SOFTMAX_FLOPS = 5.0
"""Work per score of the forward's online softmax: the running max, subtract, exp, sum and the rescale (the
five of the zoo's unfused softmax)."""

FLASH_SOFTMAX_BACKWARD_FLOPS = 4.0
"""Work per score of the backward's softmax: P = exp(S - lse) recomputed (subtract, exp) and
dS = P * (dP - D) (subtract, multiply); D = rowsum(dO * O) is per row, not per score."""


def flash_attention(name: str, q: TensorRef, k: TensorRef, v: TensorRef, query: str, key: str,
                    seq: str = "s", key_seq: str = "t", feature: str = "k", causal: bool = False,
                    balanced: bool = True, dealt: bool = False) -> Operator:
    """``o = softmax(q k^T) v`` as one fused kernel (FlashAttention; Dao et al. 2022, Dao 2023): the (s, t)
    scores and probabilities stay in on-chip memory and never reach HBM, forward or backward.

    ``query`` names the axes of ``q`` (and of the output), ``key`` those of ``k`` and ``v`` (equal shapes):
    ``seq`` is the query sequence (in ``query`` only), ``key_seq`` the key sequence (in ``key`` only),
    ``feature`` the head features (last in both, contracted by q k^T); every other letter of ``key`` is in
    ``query`` (batch, key/value heads); letters of ``query`` only besides ``seq`` are query heads sharing a
    key/value head (grouped-query attention's ``r``). Dims: the output's, then ``key_seq``:
    ``bshrk`` + ``t`` for ``query="bshrk", key="bthk"``.

    Work per point of the domain (one (query, key, feature) triple): forward ``4 + 5 / K`` (q k^T and p v,
    2 each; the online softmax's :data:`FLASH_SOFTMAX_FLOPS` per score over the K features); backward, one
    kernel (:attr:`~shardplan.ir.Operator.backward_flops`) ``10 + 4 / K``: the scores recomputed (q k^T),
    dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q (five products: 2.5x the forward's two) and
    :data:`FLASH_SOFTMAX_BACKWARD_FLOPS` per score. Saved for the backward: the output and the per-row
    log-sum-exp, one fp32 value per row of K two-byte elements (``saved = 1 + 2 / K`` output tiles); q, k and
    v are their producers' outputs, kept there. The key sequence and the features are not split (``fixed``):
    a device computes whole rows of the softmax, so its layouts split the batch, the heads and the query
    sequence; keys and values split along the sequence by their producers reach it by the edge (all-gather,
    or the ring: :mod:`shardplan.cost.ring`). ``causal``: the mask ``key_seq <= seq``
    (:class:`~shardplan.ir.Causal`, ``balanced`` and ``dealt`` as there): the kernel skips the masked blocks, so
    the work charged is the busiest device's share of the unmasked points.
    """
    for ref, what in ((q, "q"), (k, "k"), (v, "v")):
        if not isinstance(ref, TensorRef):
            raise ShardplanError(f"operator {name!r}: {what} must be a TensorRef, got {ref!r}")
    if len(query) != len(q.shape) or len(key) != len(k.shape) or len(set(query)) != len(query) \
            or len(set(key)) != len(key):
        raise ShardplanError(f"operator {name!r}: letters {query!r} / {key!r} must name the axes of q {q.shape} "
                             f"and k {k.shape}, each once")
    if tuple(k.shape) != tuple(v.shape):
        raise ShardplanError(f"operator {name!r}: keys {k.shape} and values {v.shape} must have one shape")
    if query[-1] != feature or key[-1] != feature or seq not in query or seq in key or key_seq not in key \
            or key_seq in query or any(c not in query for c in key if c != key_seq):
        raise ShardplanError(f"operator {name!r}: query {query!r} and key {key!r} must end in the features "
                             f"{feature!r}, {seq!r} in the query only, {key_seq!r} in the key only, and every other "
                             "key letter in the query")
    ext = dict(zip(query, q.shape))
    for c, n in zip(key, k.shape):
        if c != key_seq and ext[c] != n:
            raise ShardplanError(f"operator {name!r}: dimension {c!r} has extent {ext[c]} in q and {n} in k")
    ext[key_seq] = k.shape[key.index(key_seq)]
    kd = ext[feature]
    dims = tuple((c, ext[c]) for c in query) + ((key_seq, ext[key_seq]),)
    inputs = (_in(q, "q", tuple(query)), _in(k, "k", tuple(key)), _in(v, "v", tuple(key)))
    mask = Causal(seq, key_seq, balanced, dealt) if causal else None
    return Operator(name, "attn_flash", dims, inputs, _out(q.shape, tuple(query)),
                    flops_per_point=4.0 + FLASH_SOFTMAX_FLOPS / kd, norm_dims=(key_seq,), norm_stats=2,
                    fixed=frozenset({key_seq, feature}), saved=1.0 + 2.0 / kd, causal=mask,
                    backward_flops=10.0 + FLASH_SOFTMAX_BACKWARD_FLOPS / kd)
