"""How the profiler's tabs write durations, sizes and counts: short, with their unit."""

from __future__ import annotations

import math

TIME_UNITS = (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9))


def seconds(s: float | None, step: float | None = None) -> str:
    """``1.23 s``, ``12.3 ms``, ``456 µs``, ``0``; an unknown value is blank. With ``step``, the
    decimals that tell ``s`` from a value ``step`` away (a ruler's ``124.0 ms``, ``125.2 ms``)."""
    if s is None:
        return ""
    if s == 0:
        return "0"
    unit, scale = next((u, k) for u, k in TIME_UNITS if abs(s) >= k or u == "ns")
    if step is None or step <= 0:
        return f"{s / scale:.3g} {unit}"
    decimals = max(math.ceil(math.log10(10 * scale / step)), 0)
    return f"{s / scale:.{decimals}f} {unit}"


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
