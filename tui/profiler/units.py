"""How the profiler's tabs write durations, sizes and counts: short, with their unit."""

from __future__ import annotations


def seconds(s: float | None) -> str:
    """``1.23 s``, ``12.3 ms``, ``456 µs``, ``0``; an unknown value is blank."""
    if s is None:
        return ""
    if s == 0:
        return "0"
    a = abs(s)
    if a >= 1:
        return f"{s:.3g} s"
    if a >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    if a >= 1e-6:
        return f"{s * 1e6:.3g} µs"
    return f"{s * 1e9:.3g} ns"


def size(n: float | None) -> str:
    """``512 B``, ``1.5 KiB``, ``12.0 MiB``, ``3.25 GiB``; an unknown size is blank."""
    if n is None:
        return ""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"


def number(n: float | None) -> str:
    """``708``, ``12.3K``, ``7.1M``, ``1.2G``; an unknown number is blank."""
    if n is None:
        return ""
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:g}" if isinstance(n, float) else str(n)


def share(part: float, whole: float) -> str:
    """``36.4 %`` of ``whole``; ``-`` when there is no whole."""
    return f"{100 * part / whole:.1f} %" if whole > 0 else "-"
