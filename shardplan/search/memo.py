"""Repeated eliminations computed once: the DP's memo of identical steps.

A model built from identical blocks (96 Transformer layers of GPT-3) lowers
to a problem whose middle is the same sub-problem many times over: the same
vertex costs, the same edge matrices, the same shape. Variable elimination
(:mod:`shardplan.search.dp`) on it repeats identical work: eliminating
vertex v combines its unary cost u_v with the factors f_1..f_m whose scopes
contain v and returns

    RV(φ) = min_c  u_v(c) + Σ_j f_j(φ ∪ {v: c} restricted to scope(f_j)),   φ over D = ∪ scopes − {v},

together with the argmin table. That result is a function of the *contents*
only: u_v, each table with its class maps, and the pattern of the scopes
(which position of D ∪ {v} each factor axis lies on, D sorted by vertex
index). Two eliminations whose contents and patterns are equal produce equal
tables, wherever in the graph they are; the second one can reuse the first's
output arrays (table, class maps, argmin) under its own vertex names.

Key and check. The key of an elimination is a 128-bit BLAKE2b digest of each
input array (with dtype and shape) plus the scope pattern, the factors sorted
by that signature so the key does not depend on the order they were created
in. A key match is only a candidate: the stored inputs are compared with the
current ones element by element (``is`` or :func:`numpy.array_equal`) and the
stored result is used only if all are equal. So the memo never changes a
result, whatever the digests do; it only skips work. The cost of a check is
O(size of the inputs), against O(size of the inputs × classes of v) for the
elimination itself.

Memory. An entry keeps its inputs and outputs alive; entries are dropped
oldest first when the memo holds more than its byte budget (a later repeat of
a dropped step is then recomputed, still exactly). Outputs reused from the
memo are the same arrays, so the argmin tables of 96 identical blocks are held
once, not 96 times.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from shardplan.search.pairs import view_key

__all__ = ["digest", "DigestCache", "ArrayLedger", "EliminationMemo", "MemoEntry"]


def digest(a: np.ndarray) -> bytes:
    """128-bit BLAKE2b digest of an array's dtype, shape and contents (C order)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{a.dtype.str}{a.shape}".encode())
    h.update(np.ascontiguousarray(a).data)
    return h.digest()


class DigestCache:
    """:func:`digest` computed once per array memory (:func:`shardplan.search.pairs.view_key`).

    Holds every array it digested, so that a key is never reused by another
    array while the cache lives; for shared arrays (equal layers) that is
    little memory and saves hashing the same bytes again.
    """

    def __init__(self) -> None:
        self._d: dict[tuple, tuple[np.ndarray, bytes]] = {}
        self._by_id: dict[int, tuple[np.ndarray, bytes]] = {}  # the same array object again: no view key needed

    def __call__(self, a: np.ndarray) -> bytes:
        got = self._by_id.get(id(a))
        if got is not None and got[0] is a:
            return got[1]
        k = view_key(a)
        got = self._d.get(k)
        if got is None:
            got = (a, digest(a))
            self._d[k] = got
        self._by_id[id(a)] = (a, got[1])  # holds a, so its id is not reused while the cache lives
        return got[1]


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Element-by-element equality (the check behind every memo hit)."""
    return a is b or (a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(a, b)))


class ArrayLedger:
    """Bytes of the distinct arrays held, each counted once however many holders share it.

    ``add``/``remove`` take the arrays a holder starts/stops holding;
    ``total`` is the sum of ``nbytes`` over arrays with at least one holder.
    """

    def __init__(self) -> None:
        self._count: dict[int, int] = {}
        self._arrays: dict[int, np.ndarray] = {}
        self.total = 0

    def add(self, arrays: tuple[np.ndarray, ...] | list[np.ndarray]) -> None:
        for a in arrays:
            k = id(a)
            if k in self._count:
                self._count[k] += 1
            else:
                self._count[k] = 1
                self._arrays[k] = a  # pinned, so the id stays unique while counted
                self.total += int(a.nbytes)

    def remove(self, arrays: tuple[np.ndarray, ...] | list[np.ndarray]) -> None:
        for a in arrays:
            k = id(a)
            self._count[k] -= 1
            if self._count[k] == 0:
                del self._count[k]
                self.total -= int(self._arrays.pop(k).nbytes)


@dataclass(frozen=True)
class MemoEntry:
    """One stored elimination: its inputs (for the equality check) and its outputs.

    ``inputs``: the unary vector, then per factor (in key order) its table and
    class maps. Outputs: the new factor's table and class maps (over D, in
    vertex-index order), the step's class maps for back-substitution and the
    argmin table (configuration of v per class combination of D).
    """

    inputs: tuple[np.ndarray, ...]
    table: np.ndarray
    table_maps: tuple[np.ndarray, ...]
    step_maps: tuple[np.ndarray, ...]
    arg: np.ndarray
    sig: tuple[bytes, ...] | None = None  # digests of the new table and its maps, if known

    def arrays(self) -> tuple[np.ndarray, ...]:
        return self.inputs + (self.table, self.arg) + self.table_maps + self.step_maps

    def matches(self, inputs: tuple[np.ndarray, ...]) -> bool:
        return len(inputs) == len(self.inputs) and all(_same(a, b) for a, b in zip(self.inputs, inputs))


class EliminationMemo:
    """Key -> :class:`MemoEntry`, oldest dropped first above ``budget_bytes`` (see module doc).

    Holds its arrays in ``ledger`` (shared with the DP's own accounting), so
    the DP's memory limit sees what the memo keeps alive.
    """

    def __init__(self, budget_bytes: int, ledger: ArrayLedger) -> None:
        self.budget = int(budget_bytes)
        self.ledger = ledger
        self._entries: OrderedDict[tuple, MemoEntry] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0
        self.false_matches = 0

    def get(self, key: tuple, inputs: tuple[np.ndarray, ...]) -> MemoEntry | None:
        e = self._entries.get(key)
        if e is None:
            self.misses += 1
            return None
        if not e.matches(inputs):  # a digest collision: recompute, never reuse
            self.false_matches += 1
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return e

    def put(self, key: tuple, entry: MemoEntry) -> None:
        size = sum(int(a.nbytes) for a in entry.arrays())
        if size > self.budget:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self._drop(old)
        self._entries[key] = entry
        self.ledger.add(entry.arrays())
        self._bytes += size
        while self._bytes > self.budget and self._entries:
            _, e = self._entries.popitem(last=False)
            self._drop(e)

    def _drop(self, e: MemoEntry) -> None:
        self._bytes -= sum(int(a.nbytes) for a in e.arrays())
        self.ledger.remove(e.arrays())

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        while self._entries:
            _, e = self._entries.popitem(last=False)
            self._drop(e)
