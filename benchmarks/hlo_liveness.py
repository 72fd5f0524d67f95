"""Which buffers a compiled XLA program holds at its peak: liveness along the schedule of optimised HLO text.

The entry computation of a scheduled module (``is_scheduled=true``: the instructions in execution order) is read
line by line. Every array an instruction defines is a buffer (a tuple-shaped result one buffer per element;
``get-tuple-element`` and ``bitcast`` name their operand's buffer, ``tuple`` makes none; parameters are the
arguments), live from the instruction that defines it to the last instruction that reads it (the root's to the
end). The peak is the largest sum of live temporaries over the schedule; at it, the live buffers are grouped by
shape and the JAX operation that made them (the ``op_name`` metadata's last part). This is an upper bound of
XLA's own figure (``memory_analysis().temp_size_in_bytes``), which also shares buffers between an operand and a
result where a fusion may write in place.

    python benchmarks/hlo_liveness.py HLO.txt [rows]
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from dataclasses import dataclass

BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
         "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1}
_ARRAY = re.compile(r"\b(" + "|".join(BYTES) + r")\[([0-9,]*)\]")
_INST = re.compile(r"%([\w.\-]+) = (.*?) ([\w\-]+)\((.*)$")


def array_bytes(shape: str) -> list[tuple[str, int]]:
    """Each array of a shape string (``bf16[4,8]{1,0}`` or a tuple of them): its text and bytes."""
    out = []
    for dt, dims in _ARRAY.findall(shape):
        n = 1
        for d in dims.split(","):
            if d:
                n *= int(d)
        out.append((f"{dt}[{dims}]", BYTES[dt] * n))
    return out


@dataclass(frozen=True)
class Peak:
    """Arguments' bytes, the peak of live temporaries, the schedule position it is at (of ``steps``), the
    instruction there, and the live buffers then: (bytes, array, operation)."""

    arguments: int
    peak: int
    at: int
    steps: int
    instruction: str
    live: tuple[tuple[int, str, str], ...]


def peak(text: str) -> Peak:
    entry = text[text.index("\nENTRY "):]
    body = entry[entry.index("{\n") + 2:]
    body = body[:body.index("\n}")]
    insts = []
    for line in body.split("\n"):
        line = line.strip()
        root = line.startswith("ROOT ")
        m = _INST.match(line.removeprefix("ROOT "))
        if not m:
            continue
        name, shape, opcode, rest = m.groups()
        args = rest.split(", kind=")[0] if opcode == "fusion" else rest.split("), ")[0]
        operands = re.findall(r"%([\w.\-]+)", args)
        if opcode == "get-tuple-element":
            ix = re.search(r"index=(\d+)", rest)
            operands = [f"{operands[0]}#{ix.group(1)}"] if ix else operands
        meta = re.search(r'op_name="([^"]*)"', rest)
        insts.append((name, shape, opcode, operands, meta.group(1).split("/")[-1] if meta else opcode, root))
    alias: dict[str, str | None] = {}
    for name, _, opcode, operands, _, _ in insts:
        if opcode in ("get-tuple-element", "bitcast") and operands:
            alias[name] = alias.get(operands[0], operands[0])
        elif opcode == "tuple":
            alias[name] = None
    n = len(insts)
    last: dict[str, int] = defaultdict(int)
    for i, (name, _, opcode, operands, _, _) in enumerate(insts):
        for o in operands:
            b = alias.get(o, o)
            if b is not None:
                last[b] = max(last[b], i)
    size, born, what = {}, {}, {}
    arguments = 0
    for i, (name, shape, opcode, _, op, root) in enumerate(insts):
        if opcode in ("get-tuple-element", "bitcast", "tuple"):
            continue
        arrays = array_bytes(shape)
        if opcode == "parameter":
            arguments += sum(b for _, b in arrays)
            continue
        keys = [f"{name}#{k}" for k in range(len(arrays))] if shape.startswith("(") else [name]
        for key, (arr, b) in zip(keys, arrays):
            size[key], born[key], what[key] = b, i, (arr, op)
            last[key] = n if root else max(last.get(key, i), i)
    delta = [0] * (n + 2)
    for key, b in size.items():
        delta[born[key]] += b
        delta[last[key] + 1] -= b
    live = top = at = 0
    for i in range(n + 1):
        live += delta[i]
        if live > top:
            top, at = live, i
    held = sorted(((size[k], *what[k]) for k in size if born[k] <= at <= last[k]), reverse=True)
    return Peak(arguments, top, at, n, insts[at][4] if at < n else "", tuple(held))


def grouped(p: Peak) -> list[tuple[int, int, str, str]]:
    """The live buffers at the peak by (array, operation): (bytes, count, array, operation), largest first."""
    agg: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for b, arr, op in p.live:
        agg[(arr, re.sub(r"\d+", "#", op))][0] += b
        agg[(arr, re.sub(r"\d+", "#", op))][1] += 1
    return sorted(((b, c, arr, op) for (arr, op), (b, c) in agg.items()), reverse=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = peak(open(argv[0]).read())
    print(f"arguments {p.arguments / 1e9:.3f} GB; live temporaries peak at {p.peak / 1e9:.3f} GB, step {p.at} of "
          f"{p.steps} ({p.instruction})")
    for b, c, arr, op in grouped(p)[:int(argv[1]) if len(argv) > 1 else 20]:
        print(f"{b / 1e9:9.3f} GB  x{c:<4d} {arr:28s} {op}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
