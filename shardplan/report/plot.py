"""The speedup plot of a strategy comparison (``shardplan compare --plot``).

It takes plain records, not the model zoo. matplotlib is an
optional dependency (``shardplan[plot]``) and is imported only inside
:func:`plot_speedups`, which draws on an Agg canvas of its own (no pyplot, no
global backend switch), so importing :mod:`shardplan` never touches it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from shardplan.errors import ShardplanError

__all__ = ["plot_speedups"]

_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def _validate(results: Sequence[Mapping[str, Any]]) -> list[tuple[int, str, float]]:
    """Check the records and return them as (p, strategy, speedup) tuples."""
    if not results:
        raise ShardplanError("plot_speedups: no results to plot")
    out = []
    for i, r in enumerate(results):
        missing = {"p", "strategy", "speedup"} - set(r)
        if missing:
            raise ShardplanError(f"plot_speedups: result {i} ({dict(r)!r}) lacks {sorted(missing)}")
        p, s, y = int(r["p"]), str(r["strategy"]), float(r["speedup"])
        if p < 1:
            raise ShardplanError(f"plot_speedups: result {i} has p = {p}, expected >= 1")
        if not math.isfinite(y) or y <= 0:
            raise ShardplanError(f"plot_speedups: result {i} has speedup {y!r}, expected a positive number")
        out.append((p, s, y))
    return out


def plot_formats() -> tuple[str, ...]:
    """File suffixes (without the dot) :func:`plot_speedups` can write: those of matplotlib's Agg canvas."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError:
        raise ShardplanError("plots need matplotlib: pip install 'shardplan[plot]'") from None
    return tuple(sorted(FigureCanvasAgg.get_supported_filetypes()))


def plot_speedups(results: Sequence[Mapping[str, Any]], path: str | os.PathLike, title: str) -> None:
    """Plot speedup over data parallelism against the number of devices (PaSE, Fig. 6 style).

    Parameters:
        results: records ``{"p": int, "strategy": str, "speedup": float}``,
            where speedup = t(data parallel) / t(strategy) at ``p`` devices.
            One line per strategy, in order of first appearance; points are
            sorted by ``p``.
        path: output file; the format follows the suffix (``.png``, ``.pdf``, ``.svg``).
        title: the figure title (e.g. the model and machine).

    The x axis is log2 with the distinct ``p`` values as ticks; a dashed line
    at 1 marks data parallelism itself.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    suffix = os.path.splitext(os.fspath(path))[1].lower().lstrip(".")
    if suffix not in plot_formats():
        raise ShardplanError(f"plot {os.fspath(path)!r}: unknown image format {suffix!r}; "
                             f"use one of .{', .'.join(plot_formats())}")
    records = _validate(results)
    strategies = list(dict.fromkeys(s for _, s, _ in records))
    ps = sorted({p for p, _, _ in records})

    fig = Figure(figsize=(6.0, 4.0), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for i, name in enumerate(strategies):
        pts = sorted((p, y) for p, s, y in records if s == name)
        ax.plot(
            [p for p, _ in pts],
            [y for _, y in pts],
            marker=_MARKERS[i % len(_MARKERS)],
            linewidth=1.6,
            markersize=5,
            label=name,
        )
    ax.axhline(1.0, color="0.4", linestyle="--", linewidth=1.0, zorder=0)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ps)
    ax.set_xticklabels([str(p) for p in ps])
    ax.minorticks_off()
    ax.set_xlabel("number of devices p")
    ax.set_ylabel("speedup over data parallelism")
    ax.set_title(title)
    top = max(y for _, _, y in records)
    ax.set_ylim(0.0, max(1.1, top * 1.12))
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(frameon=False, loc="best")
    fig.tight_layout()
    fig.savefig(os.fspath(path))
