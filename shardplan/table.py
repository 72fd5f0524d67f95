"""The one plain-text table renderer used by every report, listing and benchmark table."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from shardplan.errors import ShardplanError

__all__ = ["format_table"]


def _cell(value: Any, float_format: str) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return float_format.format(value)
    return str(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def format_table(
    rows: Sequence[Mapping[str, Any] | Sequence[Any]],
    header: Sequence[str] | None = None,
    *,
    right: Collection[int] | None = None,
    rule: bool = True,
    float_format: str = "{:.4g}",
) -> str:
    """Render rows as a plain-text table with aligned columns.

    Parameters:
        rows: each a sequence (one value per column) or, when ``header`` is
            given, a mapping read by column name (a missing key is blank).
        header: the column names, printed as the first line, followed by a
            rule of dashes under each column when ``rule``; None: no header.
        right: indices of the right-aligned columns; None: the numeric columns
            (every non-blank cell an int or float), the others left-aligned.
        rule: whether a rule of dashes separates the header from the rows.
        float_format: format of float cells; None is blank, anything else ``str``.

    Columns are as wide as their widest cell and separated by two spaces;
    trailing blanks are stripped from every line.
    """
    ncols = len(header) if header is not None else (len(rows[0]) if rows else 0)
    table: list[list[Any]] = []
    for i, row in enumerate(rows):
        if isinstance(row, Mapping):
            if header is None:
                raise ShardplanError(f"format_table: row {i} is a mapping but the table has no header")
            table.append([row.get(c) for c in header])
            continue
        vals = list(row)
        if len(vals) != ncols:
            raise ShardplanError(f"format_table: row {i} has {len(vals)} values, expected {ncols}"
                                 + (f" ({list(header)})" if header is not None else ""))
        table.append(vals)
    if right is None:
        right = {j for j in range(ncols) if all(_is_number(r[j]) for r in table if r[j] is not None)}
    text = [[_cell(v, float_format) for v in r] for r in table]
    head = [list(header)] if header is not None else []
    widths = [max([len(r[j]) for r in head + text] or [0]) for j in range(ncols)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if j in right else c.ljust(w)
                         for j, (c, w) in enumerate(zip(cells, widths))).rstrip()

    out = [line(h) for h in head]
    if head and rule:
        out.append("  ".join("-" * w for w in widths))
    out.extend(line(r) for r in text)
    return "\n".join(out)
