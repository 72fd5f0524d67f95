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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["Labeling", "Step", "pattern_bits", "reshard_steps", "steps_volume", "MAX_BITS"]

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
    u = _nbits(s)
    t = 2.0 ** -u
    opts: list[tuple[float, tuple[Step, ...]]] = []
    moves = _single_moves(s, dst)
    for combo in _combos(moves):
        if not _one_all_to_all(s, dst, combo, n):
            continue
        nxt = list(s)
        for a, b, k in combo:
            nxt[a] = s[a][:len(s[a]) - k]
            nxt[b] = s[b] + dst[b][len(s[b]):len(s[b]) + k]
        kt = sum(k for _, _, k in combo)
        rv, rs = _search(tuple(nxt), dst, caps, n, memo)
        opts.append((t * (1 - 2.0 ** -kt) + rv, (Step("all-to-all", kt, u, tuple(nxt)),) + rs))
    want = _used(dst)
    for a in range(len(s)):
        extra = len(s[a]) - _lcp(s[a], dst[a])
        k = 0
        while k < extra and s[a][len(s[a]) - 1 - k] not in want:
            k += 1
        if k:
            nxt = list(s)
            nxt[a] = s[a][:len(s[a]) - k]
            rv, rs = _search(tuple(nxt), dst, caps, n, memo)
            opts.append((t * (2 ** k - 1) + rv, (Step("all-gather", k, u, tuple(nxt)),) + rs))
    grown, m = _permute_target(s, dst, caps)
    if m != grown:
        rv, rs = _search(m, dst, caps, n, memo)
        st = ((Step("slice", 0, u, grown),) if grown != s else ()) + (Step("collective-permute", 0, _nbits(grown), m),)
        opts.append((2.0 ** -_nbits(grown) + rv, st + rs))
    if not opts:  # none of the above applies: all-gather the last bit of the first axis not a prefix of its target
        a = next(i for i in range(len(s)) if not _ready(s, dst, i))
        nxt = list(s)
        nxt[a] = s[a][:-1]
        rv, rs = _search(tuple(nxt), dst, caps, n, memo)
        opts.append((t + rv, (Step("all-gather", 1, u, tuple(nxt)),) + rs))
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
        raise ValueError("labelings of different ranks")
    if src == dst:
        return ()
    _, steps = _search(src, dst, caps, int(n), {} if memo is None else memo)
    return steps


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
