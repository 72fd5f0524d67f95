"""Human units for printing; the API itself speaks seconds, bytes and FLOP/s."""

from __future__ import annotations

__all__ = ["fmt_seconds", "fmt_bytes", "fmt_rate"]


def fmt_seconds(t: float) -> str:
    """1.23 s, 45.6 ms, 7.8 us."""
    a = abs(t)
    if a >= 60:
        m, s = divmod(t, 60)
        return f"{int(m)} min {s:.1f} s"
    if a >= 1:
        return f"{t:.3g} s"
    if a >= 1e-3:
        return f"{t * 1e3:.3g} ms"
    if a >= 1e-6:
        return f"{t * 1e6:.3g} us"
    if a == 0:
        return "0 s"
    return f"{t * 1e9:.3g} ns"


def fmt_bytes(n: float) -> str:
    """Binary prefixes: 1.5 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.3g} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.3g} TiB"  # pragma: no cover


def fmt_rate(x: float, unit: str) -> str:
    """Decimal prefixes: 10 TFLOP/s, 16 GB/s."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"
