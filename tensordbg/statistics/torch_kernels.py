"""Statistics computed next to the tensor, on its device, and brought to the host once per phase.

This is the torch side of :mod:`tensordbg.statistics`: the same statistics, computed with torch on the
training device. Each watched tensor yields a small float64 vector on its device; a
:class:`StatsBatch` gathers the vectors of one phase and copies them to the host in one transfer
(on CUDA: one synchronization per phase, never one per tensor).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from tensordbg.statistics import (
    ABS_MEAN,
    FINITE,
    L2,
    MAX,
    MEAN,
    MIN,
    STD,
    UPDATE_STATS,
    Stat,
    Summary,
)

_F64 = torch.float64

# Statistics that scale with the tensor: a gradient computed under a loss scale s has them s times
# too large. Counts and fractions do not scale.
SCALE_LINEAR = frozenset({"min", "max", "mean", "std", "abs_mean", "l2"})

# What every watched tensor gets: whether it is finite (one sum, or free with a witness below).
SCREEN = (FINITE,)

_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
# Dtypes that torch reduces as they are; others (fp8) are widened to float32 first.
_FLOATING = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def dtype_name(dtype: torch.dtype) -> str:
    """torch's dtype name without the module: ``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def watchable(t: object) -> bool:
    """Whether a value is a tensor whose numbers can go wrong: floating point, dense, with data."""
    return (
        type(t) in _PLAIN_TENSORS  # subclasses (DTensor, fakes, ...) are not read
        and t.is_floating_point()
        and t.layout is torch.strided
        and not t.is_meta
        and t.numel() > 0
    )


def _wide(t: torch.Tensor) -> torch.Tensor:
    """The tensor in a dtype that torch's reductions support: fp8 is widened to float32. (The
    half types stay as they are; the kernels that would overflow them accumulate in float32.)"""
    if t.dtype in _FLOATING:
        return t
    return t.float()


def device_stats(t: torch.Tensor, stats: Sequence[Stat]) -> torch.Tensor:
    """The values of ``stats`` for ``t`` as one float64 vector on ``t``'s device (no sync)."""
    x = _wide(t.detach())
    n = x.numel()
    witnesses = _witnesses(stats)
    cache: dict[str, Any] = {}
    values: dict[Stat, torch.Tensor] = {}
    for stat in (*stats, *witnesses):
        if stat not in values and stat != FINITE:
            values[stat] = _kernel(stat, x, n, cache)
    if len(witnesses) == 1:
        values[FINITE] = torch.isfinite(values[witnesses[0]])
    elif witnesses:
        values[FINITE] = torch.isfinite(torch.stack([values[w] for w in witnesses])).all()
    out = [values[stat].to(_F64) for stat in stats]
    return torch.stack(out) if out else x.new_empty(0, dtype=_F64)


def host_stats(t: torch.Tensor, stats: Sequence[Stat]) -> list[float]:
    """The values of ``stats`` for ``t`` as Python floats, read at once: the eager path. On the CPU
    reading a value costs nothing; on CUDA each read synchronizes (batched mode avoids that)."""
    x = _wide(t.detach())
    if len(stats) == 1 and stats[0] == FINITE:  # most tensors, most steps: one sum
        return [1.0 if math.isfinite(_sum(x).item()) else 0.0]
    n = x.numel()
    witnesses = _witnesses(stats)
    cache: dict[str, Any] = {}
    values: dict[Stat, float] = {}
    for stat in (*stats, *witnesses):
        if stat in values or stat == FINITE:
            continue
        if stat.name == "mean":
            # From the one sum, in Python: arithmetic on 0-d tensors costs microseconds each.
            values[stat] = _cached_sum(x, cache).item() / n
        else:
            values[stat] = float(_kernel(stat, x, n, cache).item())
    if witnesses:
        values[FINITE] = float(all(math.isfinite(values[w]) for w in witnesses))
    return [values[stat] for stat in stats]


# Statistics that a single NaN or Inf makes non-finite: any of them is a witness for "finite", so
# that statistic costs no pass of its own when one of these is computed anyway. Min and max witness
# together (one pass gives both; +Inf shows in the max only). A witness can also overflow on finite
# values (the L2 norm of 1e20s): "finite" is then 0, and the engine counts NaN and Inf, which
# settles it.
NAN_WITNESSES = (MIN, MAX, MEAN, STD, ABS_MEAN, L2)
# The witness when none is computed anyway: the sum, which NaN and Inf both poison.
_SUM = Stat("sum")


def _witnesses(stats: Sequence[Stat]) -> tuple[Stat, ...]:
    """The statistics "finite" is read from, the one rule of device_stats and host_stats: those
    of ``stats`` that witness it, else the sum; none when ``stats`` does not ask for "finite"."""
    if FINITE not in stats:
        return ()
    names = {s.name for s in stats}
    if "min" in names or "max" in names:
        names |= {"min", "max"}
    return tuple(w for w in NAN_WITNESSES if w.name in names) or (_SUM,)


def _kernel(stat: Stat, x: torch.Tensor, n: int, cache: dict[str, Any]) -> torch.Tensor:
    """One statistic as a 0-d tensor on the device (of whatever dtype the reduction gives)."""
    name = stat.name
    if name == "sum":
        return _cached_sum(x, cache)
    if name == "mean":
        return _cached_sum(x, cache) / n
    if name in ("min", "max"):
        if "minmax" not in cache:
            cache["minmax"] = torch.aminmax(x)
        return cache["minmax"][0 if name == "min" else 1]
    if name == "nan":
        return torch.count_nonzero(torch.isnan(x))
    if name == "posinf":
        return torch.count_nonzero(x == math.inf)
    if name == "neginf":
        return torch.count_nonzero(x == -math.inf)
    if name == "std":
        # Two passes (mean, then squares of the deviations): torch.std_mean is ~30x slower here.
        centered = x.reshape(-1).to(_accum(x)) - _cached_sum(x, cache) / n
        return (torch.dot(centered, centered) / n).sqrt()
    if name == "abs_mean":
        return x.abs().sum(dtype=_accum(x)) / n  # vector_norm(x, 1) is ~2-8x slower on CPU
    if name == "l2":
        flat = x.reshape(-1)
        if flat.dtype in (torch.float32, torch.float64):
            return torch.dot(flat, flat).sqrt()  # BLAS: ~2.5x faster than vector_norm
        return torch.linalg.vector_norm(x, 2, dtype=torch.float32)
    if name == "zero_frac":
        return (n - torch.count_nonzero(x)) / n
    if name == "in_range_frac":
        lo, hi = stat.params
        return torch.count_nonzero((x >= lo) & (x <= hi)) / n
    if name == "dead_unit_frac":
        lo, hi, dim, min_live = stat.params
        live = x > lo if hi == math.inf else (x > lo) & (x < hi)
        # torch copies a bool mask before any reduction by dim (to int64 for sum and count_nonzero):
        # float32 is the cheapest copy.
        live = live.to(torch.float32)
        unit_dim = int(dim) % x.dim()
        others = [d for d in range(x.dim()) if d != unit_dim]
        live_frac = live.mean(dim=others) if others else live
        return (live_frac < min_live).to(torch.float32).mean()
    raise KeyError(f"statistic {stat} has no torch kernel")


def _accum(x: torch.Tensor) -> torch.dtype:
    return _F64 if x.dtype == _F64 else torch.float32


def _sum(x: torch.Tensor) -> torch.Tensor:
    """The sum in a dtype that holds it: float32 for the half types."""
    return x.sum() if x.dtype in (torch.float32, _F64) else x.sum(dtype=torch.float32)


def _cached_sum(x: torch.Tensor, cache: dict[str, Any]) -> torch.Tensor:
    if "sum" not in cache:
        cache["sum"] = _sum(x)
    return cache["sum"]


def update_stats(
    current: torch.Tensor, previous: torch.Tensor, stats: Sequence[Stat]
) -> torch.Tensor:
    """Update statistics of a parameter against its value before the optimizer step, as one
    float64 vector on the device. Other statistics in ``stats`` are of ``current``."""
    cur = _wide(current.detach())
    prev = _wide(previous)
    n = cur.numel()
    values: dict[Stat, torch.Tensor] = {}
    others = [s for s in stats if s.name not in UPDATE_STATS]
    if others:
        values.update(zip(others, device_stats(cur, others).unbind(), strict=True))
    # |p - p_prev|: one subtraction for all the statistics that need it, never changed in place.
    delta = None
    if any(s.name in ("update_abs_mean", "update_unchanged") for s in stats):
        delta = (cur - prev).abs_()
    for stat in stats:
        if stat.name == "prev_abs_mean":  # vector_norm(prev, 1) is ~2-8x slower on CPU
            values[stat] = prev.abs().sum(dtype=_accum(prev)).to(_F64) / n
        elif stat.name == "update_abs_mean":
            values[stat] = delta.sum(dtype=_accum(delta)).to(_F64) / n
        elif stat.name == "update_unchanged":  # every element within atol + rtol * |prev|
            rtol, atol = stat.params
            bound = prev.abs().mul_(rtol)
            excess = torch.sub(delta, bound, out=bound).amax()  # in bound's buffer: no third one
            values[stat] = (excess <= atol).to(_F64)
    out = [values[stat] for stat in stats]
    return torch.stack(out) if out else cur.new_empty(0, dtype=_F64)


def scale_vector(stats: Sequence[Stat], inv_scale: torch.Tensor) -> torch.Tensor:
    """Factors that unscale a stats vector of a gradient computed under a loss scale."""
    one = torch.ones((), dtype=_F64, device=inv_scale.device)
    inv = inv_scale.to(_F64)
    return torch.stack([inv if s.name in SCALE_LINEAR else one for s in stats])


# Order of the values in a summary vector; see summary_vector.
_SUMMARY_FIELDS = (
    "numel", "nan", "posinf", "neginf", "zeros", "min", "max", "mean", "std", "abs_mean", "l2",
)  # fmt: skip


def summary_vector(t: torch.Tensor) -> torch.Tensor:
    """Everything :class:`~tensordbg.statistics.Summary` holds, as one float64 vector on the device.
    Moments are over finite elements, so a tensor with a few NaN still shows its range."""
    x = _wide(t.detach()).reshape(-1)
    n = x.numel()
    finite = torch.isfinite(x)
    nonfinite = n - torch.count_nonzero(finite)
    # The common case pays no mask: one host read tells whether there is anything to mask.
    if int(nonfinite):
        nan = torch.count_nonzero(torch.isnan(x))
        posinf = torch.count_nonzero(x == math.inf)
        neginf = nonfinite - nan - posinf
        x = x[finite]
    else:
        nan = posinf = neginf = torch.zeros((), dtype=torch.int64, device=x.device)
    zeros = x.numel() - torch.count_nonzero(x)
    counts = torch.stack([torch.tensor(n, device=x.device), nan, posinf, neginf, zeros]).to(_F64)
    if x.numel() == 0:
        moments = torch.full((6,), math.nan, dtype=_F64, device=x.device)
    else:
        cache: dict[str, Any] = {}
        m = x.numel()
        lo_hi = torch.stack(torch.aminmax(x)).to(_F64)
        stats = [
            _kernel(Stat(name), x, m, cache).to(_F64) for name in ("mean", "std", "abs_mean", "l2")
        ]
        moments = torch.cat((lo_hi, torch.stack(stats)))
    return torch.cat((counts, moments))


def summary_from(values: Sequence[float]) -> Summary:
    """The :class:`Summary` for a vector made by :func:`summary_vector`, on the host."""
    data = dict(zip(_SUMMARY_FIELDS, values, strict=True))
    for key in ("numel", "nan", "posinf", "neginf", "zeros"):
        data[key] = int(data[key])
    return Summary(**data)


def summarize(t: torch.Tensor) -> Summary:
    """The summary of a tensor, on the host (synchronizes with the device)."""
    return summary_from(summary_vector(t).tolist())


class StatsBatch:
    """The statistic vectors of one phase, waiting on the device for one transfer to the host.

    >>> batch = StatsBatch()
    >>> slot = batch.add(device_stats(t, (MIN, MAX)))
    >>> values = batch.flush()[slot]
    """

    def __init__(self) -> None:
        self._vectors: list[torch.Tensor] = []

    def __len__(self) -> int:
        return len(self._vectors)

    def add(self, vector: torch.Tensor) -> int:
        self._vectors.append(vector)
        return len(self._vectors) - 1

    def flush(self) -> list[list[float]]:
        """All vectors as host lists, in the order added; one copy per device."""
        vectors, self._vectors = self._vectors, []
        if not vectors:
            return []
        by_device: dict[torch.device, list[int]] = {}
        for i, v in enumerate(vectors):
            by_device.setdefault(v.device, []).append(i)
        result: list[list[float]] = [[] for _ in vectors]
        for indices in by_device.values():
            parts = [vectors[i] for i in indices]
            flat = torch.cat(parts).tolist() if len(parts) > 1 else parts[0].tolist()
            offset = 0
            for i in indices:
                size = vectors[i].numel()
                result[i] = flat[offset : offset + size]
                offset += size
        return result
