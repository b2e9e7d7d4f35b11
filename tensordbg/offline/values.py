"""What ``tensordbg check`` reads of a dumped tensor: its statistics as the rules know them,
and its value (memory-mapped on first use) for statistics the index lacks."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from tensordbg.statistics import REGISTRY, Stat, TensorStats, compute_numpy


class DumpedValue:
    """A dumped tensor's value, memory-mapped on first use, for statistics the index lacks."""

    def __init__(self, dump: Any, entry: Any, step: int, rank: int):
        self.dump, self.entry, self.step, self.rank = dump, entry, step, rank
        self._array: Any = None

    def array(self) -> Any:
        if self._array is None:
            self._array = self.dump.tensor(self.entry.name, rank=self.rank).value(self.step)
        return self._array

    def fill(self, stats: TensorStats, missing: Sequence[Stat]) -> bool:
        """Compute ``missing`` from the value; False when they need what a dump never holds
        (the parameter before the step) or the value cannot be read."""
        if any(REGISTRY[s.name].needs_prev for s in missing):
            return False
        try:
            stats.values.update(compute_numpy(self.array(), missing))
        except Exception:
            return False
        return True

    def measure(self, stats: TensorStats, wanted: Sequence[Stat]) -> list[float]:
        computed = compute_numpy(self.array(), wanted)
        return [computed[s] for s in wanted]


def stats_of(dumped: dict[str, Any], numel: int | None = None) -> dict[Stat, float]:
    """The dumped statistics as the rules ask for them; of a one-element tensor (a scalar
    loss: ``numel`` 1), its mean gives its minimum, maximum and the others it determines."""
    out = {}
    for name, value in dumped.items():
        stat = _parsed.get(name, _UNSEEN)
        if stat is _UNSEEN:  # a few names recur on every tensor: each is parsed once
            stat = _parsed[name] = parse_stat(name)
        if stat is not None and isinstance(value, (int, float)):
            out[stat] = float(value)
    mean = out.get(Stat("mean"))
    if numel == 1 and mean is not None:
        x = mean
        derived = {"min": x, "max": x, "abs_mean": abs(x), "l2": abs(x),
                   "finite": float(math.isfinite(x)), "nan": float(math.isnan(x)),
                   "posinf": float(x == math.inf), "neginf": float(x == -math.inf),
                   "zero_frac": float(x == 0.0)}  # fmt: skip
        for name, value in derived.items():
            out.setdefault(Stat(name), value)
    return out


_parsed: dict[str, Stat | None] = {}
_UNSEEN: Any = object()


def parse_stat(name: str) -> Stat | None:
    """A dumped statistic's name as the rules ask for it: ``"l2"`` or
    ``"in_range_frac(-1, 0)"``; None for a name the registry does not know."""
    head, sep, rest = name.partition("(")
    if head not in REGISTRY:
        return None
    if not sep:
        return Stat(head)
    try:
        params = tuple(float(p) for p in rest.rstrip(")").split(",") if p.strip())
    except ValueError:
        return None
    return Stat(head, params)
