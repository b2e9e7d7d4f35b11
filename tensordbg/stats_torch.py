"""Statistics computed next to the tensor, on its device, and brought to the host once per phase.

This is the torch side of :mod:`tensordbg.stats`: the same statistics, computed with torch on the
training device. Each watched tensor yields a small float64 vector on its device; a
:class:`StatsBatch` gathers the vectors of one phase and copies them to the host in one transfer
(on CUDA: one synchronization per phase, never one per tensor).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from tensordbg.stats import UPDATE_STATS, Stat, Summary

_F64 = torch.float64

# Statistics that scale with the tensor: a gradient computed under a loss scale s has them s times
# too large. Counts and fractions do not scale.
SCALE_LINEAR = frozenset({"min", "max", "mean", "std", "abs_mean", "l2"})

# torch dtypes that have no NaN: never watched.
_FLOATING = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def dtype_name(dtype: torch.dtype) -> str:
    """torch's dtype name without the module: ``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def watchable(t: object) -> bool:
    """Whether a value is a tensor whose numbers can go wrong: floating point, dense, with data."""
    return (
        isinstance(t, torch.Tensor)
        and t.is_floating_point()
        and t.layout is torch.strided
        and not t.is_meta
        and t.numel() > 0
        and type(t) in (torch.Tensor, torch.nn.Parameter)
    )


def _wide(t: torch.Tensor) -> torch.Tensor:
    """The tensor in a dtype that reductions support and that holds their results: fp8 and the
    half types are widened to float32 where a kernel would otherwise overflow or be missing."""
    if t.dtype in _FLOATING:
        return t
    return t.float()


def device_stats(t: torch.Tensor, stats: Sequence[Stat]) -> torch.Tensor:
    """The values of ``stats`` for ``t`` as one float64 vector on ``t``'s device (no sync)."""
    x = _wide(t.detach())
    n = x.numel()
    out: list[torch.Tensor] = []
    cache: dict[str, torch.Tensor] = {}
    for stat in stats:
        out.append(_kernel(stat, x, n, cache))
    return torch.stack(out) if out else x.new_empty(0, dtype=_F64)


def _kernel(stat: Stat, x: torch.Tensor, n: int, cache: dict[str, torch.Tensor]) -> torch.Tensor:
    name = stat.name
    if name in ("min", "max"):
        if "minmax" not in cache:
            cache["minmax"] = torch.stack(torch.aminmax(x)).to(_F64)
        return cache["minmax"][0 if name == "min" else 1]
    if name == "nan":
        return torch.isnan(x).sum().to(_F64)
    if name == "posinf":
        return (x == math.inf).sum().to(_F64)
    if name == "neginf":
        return (x == -math.inf).sum().to(_F64)
    if name in ("mean", "std"):
        if "std_mean" not in cache:
            std, mean = torch.std_mean(x.to(torch.float32) if x.dtype != _F64 else x, correction=0)
            cache["std_mean"] = torch.stack((std, mean)).to(_F64)
        return cache["std_mean"][0 if name == "std" else 1]
    if name == "abs_mean":
        return torch.linalg.vector_norm(x, 1, dtype=_accum(x)).to(_F64) / n
    if name == "l2":
        return torch.linalg.vector_norm(x, 2, dtype=_accum(x)).to(_F64)
    if name == "zero_frac":
        return (n - torch.count_nonzero(x)).to(_F64) / n
    if name == "in_range_frac":
        lo, hi = stat.params
        return ((x >= lo) & (x <= hi)).sum().to(_F64) / n
    if name == "dead_unit_frac":
        lo, hi, dim, min_live = stat.params
        live = ((x > lo) & (x < hi)).to(torch.float32)
        unit_dim = int(dim) % x.dim()
        others = [d for d in range(x.dim()) if d != unit_dim]
        live_frac = live.mean(dim=others) if others else live
        return (live_frac < min_live).to(_F64).mean()
    raise KeyError(f"statistic {stat} has no torch kernel")


def _accum(x: torch.Tensor) -> torch.dtype:
    return _F64 if x.dtype == _F64 else torch.float32


def update_stats(
    current: torch.Tensor, previous: torch.Tensor, stats: Sequence[Stat]
) -> torch.Tensor:
    """Update statistics of a parameter against its value before the optimizer step, as one
    float64 vector on the device. Other statistics in ``stats`` are of ``current``."""
    cur = _wide(current.detach())
    prev = _wide(previous)
    n = cur.numel()
    out: list[torch.Tensor] = []
    cache: dict[str, torch.Tensor] = {}
    delta: torch.Tensor | None = None
    for stat in stats:
        if stat.name not in UPDATE_STATS:
            out.append(_kernel(stat, cur, n, cache))
            continue
        if stat.name == "prev_abs_mean":
            out.append(torch.linalg.vector_norm(prev, 1, dtype=_accum(prev)).to(_F64) / n)
            continue
        if delta is None:
            delta = (cur - prev).abs_()
        if stat.name == "update_abs_mean":
            out.append(delta.sum(dtype=_accum(delta)).to(_F64) / n)
        else:  # update_unchanged: every element within atol + rtol * |prev|
            rtol, atol = stat.params
            excess = delta.sub_(prev.abs().mul_(rtol)).amax()
            delta = None  # consumed in place
            out.append((excess <= atol).to(_F64))
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
    """Everything :class:`~tensordbg.stats.Summary` holds, as one float64 vector on the device.
    Moments are over finite elements, so a tensor with a few NaN still shows its range."""
    x = _wide(t.detach()).reshape(-1)
    n = x.numel()
    nonfinite = n - torch.count_nonzero(torch.isfinite(x))
    # The common case pays no mask: one host read tells whether there is anything to mask.
    if int(nonfinite):
        nan = torch.count_nonzero(torch.isnan(x))
        posinf = torch.count_nonzero(x == math.inf)
        neginf = nonfinite - nan - posinf
        x = x[torch.isfinite(x)]
    else:
        nan = posinf = neginf = torch.zeros((), dtype=torch.int64, device=x.device)
    zeros = x.numel() - torch.count_nonzero(x)
    counts = torch.stack([torch.tensor(n, device=x.device), nan, posinf, neginf, zeros]).to(_F64)
    if x.numel() == 0:
        moments = torch.full((6,), math.nan, dtype=_F64, device=x.device)
    else:
        acc = _accum(x)
        lo_hi = torch.stack(torch.aminmax(x)).to(_F64)
        std, mean = torch.std_mean(x if x.dtype == acc else x.to(acc), correction=0)
        abs_mean = torch.linalg.vector_norm(x, 1, dtype=acc) / x.numel()
        l2 = torch.linalg.vector_norm(x, 2, dtype=acc)
        moments = torch.cat((lo_hi, torch.stack((mean, std, abs_mean, l2)).to(_F64)))
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
