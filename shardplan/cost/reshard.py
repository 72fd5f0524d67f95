"""A redistribution as the steps XLA compiles well: bit labelings, the step search, its volume.

Labelings. On p = 2^n devices numbered row-major, a layout whose every split is a power of two gives each
tensor axis a block index made of device-index bits: axis a's block of device q is the number whose binary
digits, major first, are the bits ``seq_a`` of q (:func:`pattern_bits`). A labeling is the tuple of those
sequences, one per tensor axis; a bit in no sequence replicates the tensor. The tile holds ``N / 2^u``
elements of the N-element tensor, u the number of bits used.

Steps. XLA's SPMD partitioner lowers a change of sharding to one collective, sending exactly the volume
below, in these cases (checked on the compiled HLO, ``benchmarks/bench_reshard_xla.py``); the tile is t
elements before the step:

* slice: bits that no axis uses are appended, in the target's order, at the minor end of an axis whose
  sequence is a prefix of its target's: every device keeps a sub-block of what it holds, 0 bytes;
* all-to-all: the last k bits of one axis move to the minor end of another (a prefix of its target,
  extended by exactly those bits in that order): ``t (1 - 2^-k)``; several such moves at once (distinct
  source and destination axes) are one all-to-all only when they move every device bit, empty every
  source, and land in descending bit order over the destination axes (otherwise XLA adds a
  collective-permute);
* all-gather: the last k bits of one axis that the target uses nowhere are dropped: ``t (2^k - 1)``;
* collective-permute: the same per-axis lengths, other bits: ``t`` (after first appending every unused bit
  the target shards to the axis the target puts it on, where the axis's extent allows: a free slice that
  makes the permuted tile as small as it can be).

:func:`reshard_steps` searches the cheapest sequence of these steps from one labeling to another (slices
first, whenever one applies: free and shrinking; then every all-to-all, all-gather or permute, recursively,
memoised on the state). Every intermediate tile is at most the larger of the two end tiles: slices only
shrink it, all-to-alls and permutes keep it, and all-gathers only drop bits the target replicates (but for
a last resort where no step above applies: the last bit of an axis that is not a prefix of its target,
gathered; not met on the benchmark's pairs).
The volume (:func:`steps_volume`) is never below the cost model's "what each device lacks": each step
sends at least what it makes a device lack, and the lacks add up.

The volume alone (:func:`reshard_volume`; :func:`canonical_pairs` and :func:`canonical_volume` for whole
tables, what the cost tables charge) is the same search on a canonical form of the pair: the slices
applied, the axes that then equal their target dropped (the volume scales by 2^-(their bits)), the remaining
bits renamed 0, 1, ... in increasing order, each cap clamped to the target's length plus the axis's bits the
target puts elsewhere; pairs that differ only there share one entry. Its options are tried in the order of
their step plus what their result lacks, a lower bound, and skipped once that reaches the best found (branch
and bound). docs/cost-model.md ("The volume without the steps") proves each reduction exact;
``steps_volume(reshard_steps(...)) == reshard_volume(...)`` bit for bit: every volume is a sum of dyadic
fractions 2^-j, j <= 2n, exact in a float.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from shardplan.errors import ShardplanError

__all__ = ["Labeling", "Step", "pattern_bits", "reshard_steps", "reshard_volume", "steps_volume", "canonical_pairs",
           "canonical_volume", "decode_canonical", "MAX_BITS"]

Labeling = tuple[tuple[int, ...], ...]

MAX_BITS = 6
"""The step search is used for at most 2^6 = 64 devices (its state space grows with the bits; beyond, a
redistribution is one sharding change, costed as what each device lacks)."""


@dataclass(frozen=True)
class Step:
    """One step: ``kind`` (slice, all-to-all, all-gather, collective-permute), ``bits`` moved (k; 0 for a slice
    or permute), ``used`` the bits the labeling uses before it (tile ``N / 2^used``), ``after`` the labeling."""

    kind: str
    bits: int
    used: int
    after: Labeling


def pattern_bits(split: int, stride: int) -> tuple[int, ...]:
    """The device bits, major first, of a one-level block pattern: block ``(q // stride) mod split`` (both powers
    of two) is bits ``log2(stride) .. log2(stride · split) - 1`` of q."""
    lo = int(stride).bit_length() - 1
    k = int(split).bit_length() - 1
    return tuple(range(lo + k - 1, lo - 1, -1))


def _used(lab: Sequence[tuple[int, ...]]) -> set[int]:
    return {b for s in lab for b in s}


def _nbits(lab: Sequence[tuple[int, ...]]) -> int:
    return sum(len(s) for s in lab)


def _lcp(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n


def _ready(cur: Labeling, dst: Labeling, b: int) -> bool:
    return cur[b] == dst[b][:len(cur[b])]


def _slices(cur: Labeling, dst: Labeling) -> Labeling:
    """Append every unused bit the target wants next on an axis that is a prefix of its target (free)."""
    out = list(cur)
    changed = True
    while changed:
        changed = False
        used = _used(out)
        for b in range(len(out)):
            n = len(out[b])
            if out[b] == dst[b][:n] and n < len(dst[b]) and dst[b][n] not in used:
                out[b] = out[b] + (dst[b][n],)
                used.add(dst[b][n])
                changed = True
    return tuple(out)


def _single_moves(cur: Labeling, dst: Labeling) -> list[tuple[int, int, int]]:
    """(source axis, destination axis, k): the last k bits of the source are the next k the destination wants."""
    out = []
    for a in range(len(cur)):
        extra = len(cur[a]) - _lcp(cur[a], dst[a])
        for b in range(len(cur)):
            if b == a or not _ready(cur, dst, b):
                continue
            need = dst[b][len(cur[b]):]
            for k in range(min(len(need), extra), 0, -1):
                if cur[a][len(cur[a]) - k:] == need[:k]:
                    out.append((a, b, k))
                    break
    return out


def _combos(moves: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
    """Every non-empty set of moves with distinct source and distinct destination axes."""
    out: list[list[tuple[int, int, int]]] = []

    def rec(i: int, chosen: list, src: frozenset, dst: frozenset) -> None:
        if i == len(moves):
            if chosen:
                out.append(chosen)
            return
        rec(i + 1, chosen, src, dst)
        a, b, k = moves[i]
        if a not in src and b not in dst:
            rec(i + 1, chosen + [moves[i]], src | {a}, dst | {b})

    rec(0, [], frozenset(), frozenset())
    return out


def _one_all_to_all(cur: Labeling, dst: Labeling, combo: list[tuple[int, int, int]], n: int) -> bool:
    """Whether XLA lowers the moves of ``combo`` together to one all-to-all (module docstring); n: the device
    bits."""
    if len(combo) == 1:
        return True
    kt = sum(k for _, _, k in combo)
    if kt != n or any(len(cur[a]) != k for a, _, k in combo):
        return False
    order = [x for _, b, k in sorted(combo, key=lambda m: m[1]) for x in dst[b][len(cur[b]):len(cur[b]) + k]]
    return order == sorted(order, reverse=True)


def _permute_target(cur: Labeling, dst: Labeling, caps: Sequence[int]) -> tuple[Labeling, Labeling]:
    """(the labeling after the free slices that precede a permute, the labeling the permute reaches): every
    unused bit the target shards appended to its target axis where the cap allows, then the same per-axis
    lengths filled with the target's bits, major first, and spare bits (ones the target replicates first)."""
    grown = list(cur)
    used = _used(grown)
    for b in range(len(grown)):
        for x in dst[b]:
            if x not in used and len(grown[b]) < caps[b]:
                grown[b] = grown[b] + (x,)
                used.add(x)
    lens = [len(s) for s in grown]
    m = [d[:n] for d, n in zip(dst, lens)]
    taken = _used(m)
    want = _used(dst)
    spare = [x for s in grown for x in s if x not in taken and x not in want]
    spare += [x for s in dst for x in s if x not in taken and x not in spare]
    for a in range(len(m)):
        while len(m[a]) < lens[a]:
            m[a] = m[a] + (spare.pop(0),)
    return tuple(grown), tuple(m)


def _options(s: Labeling, dst: Labeling, caps: tuple[int, ...],
             n: int) -> list[tuple[float, Labeling, tuple[Step, ...]]]:
    """The single steps the search may take from ``s`` (its slices taken, not ``dst``): (volume in tensors, the
    labeling reached, the steps), one all-to-all per legal combination of single moves, one all-gather per axis of
    the tail bits no axis of ``dst`` uses, the permute to :func:`_permute_target` (after its slice); where none
    applies, an all-gather of the last bit of the first axis not ready."""
    u = _nbits(s)
    t = 2.0 ** -u
    opts: list[tuple[float, Labeling, tuple[Step, ...]]] = []
    for combo in _combos(_single_moves(s, dst)):
        if not _one_all_to_all(s, dst, combo, n):
            continue
        nxt = list(s)
        for a, b, k in combo:
            nxt[a] = s[a][:len(s[a]) - k]
            nxt[b] = s[b] + dst[b][len(s[b]):len(s[b]) + k]
        kt = sum(k for _, _, k in combo)
        opts.append((t * (1 - 2.0 ** -kt), tuple(nxt), (Step("all-to-all", kt, u, tuple(nxt)),)))
    want = _used(dst)
    for a in range(len(s)):
        extra = len(s[a]) - _lcp(s[a], dst[a])
        k = 0
        while k < extra and s[a][len(s[a]) - 1 - k] not in want:
            k += 1
        if k:
            nxt = list(s)
            nxt[a] = s[a][:len(s[a]) - k]
            opts.append((t * (2 ** k - 1), tuple(nxt), (Step("all-gather", k, u, tuple(nxt)),)))
    grown, m = _permute_target(s, dst, caps)
    if m != grown:
        st = ((Step("slice", 0, u, grown),) if grown != s else ()) + (Step("collective-permute", 0, _nbits(grown), m),)
        opts.append((2.0 ** -_nbits(grown), m, st))
    if not opts:
        a = next(i for i in range(len(s)) if not _ready(s, dst, i))
        nxt = list(s)
        nxt[a] = s[a][:-1]
        opts.append((t, tuple(nxt), (Step("all-gather", 1, u, tuple(nxt)),)))
    return opts


def _search(cur: Labeling, dst: Labeling, caps: tuple[int, ...], n: int, memo: dict) -> tuple[float, tuple[Step, ...]]:
    """(volume in tensors, steps) of the cheapest sequence from ``cur`` to ``dst`` (ties: fewer steps).

    No state recurs on a path, so the memo holds a function of the state alone: no step undoes a settled bit
    (one at its target axis and position, behind settled ones); slices and all-to-alls settle more, all-gathers
    drop bits with the settled ones unchanged, and a permute settles more or reaches a labeling whose own
    permute target is itself."""
    key = (cur, dst, caps, n)
    if key in memo:
        return memo[key]
    s = _slices(cur, dst)
    pre = (Step("slice", 0, _nbits(cur), s),) if s != cur else ()
    if s == dst:
        memo[key] = (0.0, pre)
        return memo[key]
    opts: list[tuple[float, tuple[Step, ...]]] = []
    for c, nxt, steps in _options(s, dst, caps, n):
        rv, rs = _search(nxt, dst, caps, n, memo)
        opts.append((c + rv, steps + rs))
    best = min(opts, key=lambda o: (o[0], len(o[1])))
    out = (best[0], pre + best[1])
    memo[key] = out
    return out


def reshard_steps(src: Labeling, dst: Labeling, caps: Sequence[int], n: int,
                  memo: dict | None = None) -> tuple[Step, ...]:
    """The cheapest sequence of XLA steps (module docstring) from labeling ``src`` to ``dst`` on 2^n devices;
    ``caps``: per axis, the most bits it may carry (log2 of the largest power of two dividing its extent). ``memo``: a dict
    kept across calls (states searched). Empty when the labelings are equal."""
    src = tuple(tuple(int(x) for x in s) for s in src)
    dst = tuple(tuple(int(x) for x in s) for s in dst)
    caps = tuple(int(c) for c in caps)
    if len(src) != len(dst) or len(caps) != len(src):
        raise ShardplanError("reshard: labelings of different ranks")
    if src == dst:
        return ()
    _, steps = _search(src, dst, caps, int(n), {} if memo is None else memo)
    return steps


def _canonical(cur: Labeling, dst: Labeling, caps: tuple[int, ...]) -> tuple[tuple | None, int]:
    """(the canonical form of the pair, the bits dropped): ``cur`` after its slices, the axes then equal to their
    target dropped (``None`` when every axis is), the remaining bits renamed 0, 1, ... in increasing order, each
    cap clamped to the target's length plus the bits of the axis the target does not put there (more never
    binds: docs/cost-model.md)."""
    s = _slices(cur, dst)
    keep = [a for a in range(len(s)) if s[a] != dst[a]]
    dropped = sum(len(s[a]) for a in range(len(s)) if s[a] == dst[a])
    if not keep:
        return None, dropped
    bits = sorted({x for a in keep for x in s[a] + dst[a]})
    name = {x: i for i, x in enumerate(bits)}
    return (tuple(tuple(name[x] for x in s[a]) for a in keep), tuple(tuple(name[x] for x in dst[a]) for a in keep),
            tuple(min(caps[a], len(dst[a]) + len(set(s[a]) - set(dst[a]))) for a in keep)), dropped


def _volume(cur: Labeling, dst: Labeling, caps: tuple[int, ...], n: int, memo: dict) -> float:
    """The volume of :func:`_search` from ``cur`` to ``dst``, through the canonical form (memoised on it)."""
    key, dropped = _canonical(cur, dst, caps)
    if key is None:
        return 0.0
    v = memo.get(key + (n,))
    if v is None:
        v = _canonical_volume(key[0], key[1], key[2], n, memo)
        memo[key + (n,)] = v
    return v * 2.0 ** -dropped


def _lack(cur: Labeling, dst: Labeling) -> float:
    """What the device that lacks most lacks of its ``dst`` tile under ``cur``, as a fraction of the tensor: the
    whole tile where an axis diverges (neither sequence a prefix of the other), else the tile less the
    intersection (docs/cost-model.md): a lower bound of every path's volume."""
    inter = 0
    for c, d in zip(cur, dst):
        if c[:len(d)] != d and d[:len(c)] != c:
            return 2.0 ** -_nbits(dst)
        inter += max(len(c), len(d))
    return 2.0 ** -_nbits(dst) - 2.0 ** -inter


def _canonical_volume(s: Labeling, dst: Labeling, caps: tuple[int, ...], n: int, memo: dict) -> float:
    """:func:`_search`'s options from ``s`` (after its slices, not ``dst``), their volumes alone: the minimum.

    Branch and bound: an option costs its step plus at least what its result lacks (:func:`_lack`), so the
    options are tried in the order of that bound and the rest skipped once it reaches the best found (the
    minimum is unchanged: a skipped option cannot be below it)."""
    opts = [(c, x) for c, x, _steps in _options(s, dst, caps, n)]
    bounded = sorted(((c + _lack(x, dst), c, x) for c, x in opts), key=lambda o: o[0])
    best = float("inf")
    for bound, c, x in bounded:
        if bound >= best:
            break
        best = min(best, c + _volume(x, dst, caps, n, memo))
    return best


def reshard_volume(src: Labeling, dst: Labeling, caps: Sequence[int], n: int, memo: dict | None = None) -> float:
    """``steps_volume(reshard_steps(src, dst, caps, n))``, exactly, without the steps: the search's volumes on the
    pair's canonical form (module docstring). ``memo``: a dict kept across calls (canonical pairs' volumes)."""
    src = tuple(tuple(int(x) for x in s) for s in src)
    dst = tuple(tuple(int(x) for x in s) for s in dst)
    caps = tuple(int(c) for c in caps)
    if len(src) != len(dst) or len(caps) != len(src):
        raise ShardplanError("reshard: labelings of different ranks")
    return _volume(src, dst, caps, int(n), {} if memo is None else memo)


def canonical_volume(row: Sequence[int], n: int, memo: dict) -> float:
    """:func:`reshard_volume` of the pairs whose canonical form is ``row`` (a row of :func:`canonical_pairs`), before
    the factor 2^-dropped; 0 for a row with no axis kept. ``memo`` as :func:`reshard_volume`'s."""
    key = decode_canonical(row)
    if not key[0]:
        return 0.0
    v = memo.get(key + (n,))
    if v is None:
        v = memo[key + (n,)] = _canonical_volume(key[0], key[1], key[2], n, memo)
    return v


_DIGIT = 3  # bits per renamed device bit in a packed axis (names 0..5 stored plus one, MAX_BITS <= 7)
_SEQ = _DIGIT * MAX_BITS  # bits of one packed sequence
_RANK = np.array([[bin(m & ((1 << x) - 1)).count("1") for x in range(MAX_BITS)] for m in range(1 << MAX_BITS)],
                 dtype=np.int64)
"""``_RANK[m, x]``: the new name of device bit x among the bits of mask m (how many of them are below x)."""
_POP = np.array([bin(m).count("1") for m in range(1 << MAX_BITS)], dtype=np.int64)


def _as_arrays(labs: Sequence[Labeling], r: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(G, r, n) the bits of each axis, major first, -1 past its end; (G, r) the lengths."""
    seq = np.full((len(labs), r, max(n, 1)), -1, dtype=np.int64)
    ln = np.zeros((len(labs), r), dtype=np.int64)
    for g, lab in enumerate(labs):
        for a, x in enumerate(lab):
            seq[g, a, :len(x)] = x
            ln[g, a] = len(x)
    return seq, ln


def canonical_pairs(src: Sequence[Labeling], dst: Sequence[Labeling], caps: Sequence[int],
                    n: int) -> tuple[np.ndarray, np.ndarray]:
    """The canonical form (:func:`_canonical`) of every pair ``(src[i], dst[j])`` of labelings of one rank on 2^n
    devices, with numpy: ((len(src), len(dst), r) int64, each kept axis packed as its renamed sequence after the
    slices, its renamed target (:data:`_DIGIT` bits a name plus one, major first in the low digits) and its clamped
    cap, kept axes first in order and -1 after; (len(src), len(dst)) the bits dropped). Two pairs have the same
    row exactly when their canonical forms are equal (:func:`decode_canonical` inverts a row)."""
    r = len(caps)
    if n > MAX_BITS:
        raise ShardplanError(f"reshard: {n} device bits, more than {MAX_BITS}")
    sa, la = _as_arrays(src, r, n)
    sb, lb = _as_arrays(dst, r, n)
    width = sa.shape[-1]
    pos = np.arange(width)
    one = np.int64(1)
    masks = np.arange(1 << n, dtype=np.int64)  # every set of device bits
    # per labeling and axis: its sequence packed major first (for the prefix test), its bits, by prefix length
    raw_a = np.where(sa >= 0, (sa + 1) << (_DIGIT * np.maximum(la[..., None] - 1 - pos, 0)), 0).sum(axis=-1)
    raw_b = np.where(sb >= 0, (sb + 1) << (_DIGIT * np.maximum(lb[..., None] - 1 - pos, 0)), 0).sum(axis=-1)
    bit_a = np.where(sa >= 0, one << np.maximum(sa, 0), 0)
    bit_b = np.where(sb >= 0, one << np.maximum(sb, 0), 0)
    axis_a = bit_a.sum(axis=-1)  # (Gs, r)
    cum_b = np.concatenate([np.zeros(lb.shape + (1,), dtype=np.int64), np.cumsum(bit_b, axis=-1)], axis=-1)
    used_a = axis_a.sum(axis=-1)  # (Gs,) the bits src uses
    # the slices from a prefix of length L with the bits U in use: the first target position >= L whose bit is
    # in use, else the target's length; (Gd, r, 2^n, width + 1)
    blocked = (((masks[None, None, :, None] >> np.maximum(sb, 0)[:, :, None, :]) & 1) == 1) & (sb >= 0)[:, :, None, :]
    first = np.where(blocked, pos, lb[:, :, None, None])
    first = np.minimum.accumulate(first[..., ::-1], axis=-1)[..., ::-1]
    slice_to = np.concatenate([first, np.broadcast_to(lb[:, :, None, None], first.shape[:-1] + (1,))], axis=-1)
    # each sequence's renamed bits packed (position 0 in the low digit) under every set of kept bits
    renamed_b = _RANK[masks[None, None, :, None], np.maximum(sb, 0)[:, :, None, :]] + 1
    names_b = np.where((sb >= 0)[:, :, None, :], renamed_b, 0) << (_DIGIT * pos)
    packed_b = np.concatenate([np.zeros(names_b.shape[:-1] + (1,), dtype=np.int64), np.cumsum(names_b, axis=-1)],
                              axis=-1)  # (Gd, r, 2^n, width + 1): the first L bits
    packed_a = (np.where((sa >= 0)[:, :, None, :], _RANK[masks[None, None, :, None], np.maximum(sa, 0)[:, :, None, :]]
                         + 1, 0) << (_DIGIT * pos)).sum(axis=-1)  # (Gs, r, 2^n)

    i = np.arange(len(src))[:, None, None]
    j = np.arange(len(dst))[None, :, None]
    ax = np.arange(r)[None, None, :]
    la3, lb3 = la[:, None, :], lb[None, :, :]
    prefix = (la3 <= lb3) & ((raw_b[None, :, :] >> (_DIGIT * np.maximum(lb3 - la3, 0))) == raw_a[:, None, :])
    ls = np.where(prefix, slice_to[j, ax, used_a[:, None, None], la3], la3)  # (Gs, Gd, r) after the slices
    keep = ~(prefix & (ls == lb3))
    dropped = np.where(keep, 0, lb3).sum(axis=-1)
    s_axis = np.where(prefix, cum_b[j, ax, ls], axis_a[:, None, :])
    b_axis = cum_b[j, ax, lb3]
    mask = np.bitwise_or.reduce(np.where(keep, s_axis | b_axis, 0), axis=-1)  # (Gs, Gd) the kept bits
    cap = np.minimum(np.asarray(caps, dtype=np.int64), lb3 + _POP[s_axis & ~b_axis])
    m3 = mask[..., None]
    code_s = np.where(prefix, packed_b[j, ax, m3, ls], packed_a[i, ax, m3])
    code = code_s | (packed_b[j, ax, m3, lb3] << _SEQ) | (cap << (2 * _SEQ))
    out = np.full(code.shape, -1, dtype=np.int64)
    ii, jj, aa = np.nonzero(keep)
    out[ii, jj, (np.cumsum(keep, axis=-1) - 1)[ii, jj, aa]] = code[ii, jj, aa]  # the kept axes first, in order
    return out, dropped


def decode_canonical(row: Sequence[int]) -> tuple[Labeling, Labeling, tuple[int, ...]]:
    """(labeling after the slices, target, caps) of one row of :func:`canonical_pairs` (its kept axes)."""
    mask = (1 << _SEQ) - 1

    def seq(c: int) -> tuple[int, ...]:
        out = []
        while c:
            out.append((c & ((1 << _DIGIT) - 1)) - 1)
            c >>= _DIGIT
        return tuple(out)

    kept = [int(c) for c in row if c >= 0]
    return (tuple(seq(c & mask) for c in kept), tuple(seq((c >> _SEQ) & mask) for c in kept),
            tuple(c >> (2 * _SEQ) for c in kept))


def steps_volume(steps: Sequence[Step]) -> float:
    """Elements each device sends over the steps, as a fraction of the whole tensor (module docstring)."""
    v = 0.0
    for st in steps:
        t = 2.0 ** -st.used
        if st.kind == "all-to-all":
            v += t * (1 - 2.0 ** -st.bits)
        elif st.kind == "all-gather":
            v += t * (2 ** st.bits - 1)
        elif st.kind == "collective-permute":
            v += t
    return v
