"""Statistics computed next to the tensor, on its device, and brought to the host once per phase.

This is the torch side of :mod:`tensordbg.statistics`: each statistic of the registry gets its
torch kernel here, under the same name (checked when this module is imported). Each watched
tensor yields the 0-d results of its kernels on its device (:func:`device_parts`: one launch per
statistic, nothing converted or stacked per tensor); a :class:`StatsBatch` gathers those of one
phase, converts and stacks them all at once and copies them to the host in one transfer (on
CUDA: one synchronization per phase, never one per tensor), and :func:`finish` makes each
tensor's values of its results on the host.

A kernel sees the tensor ``x`` (in a dtype torch reduces), its number of elements ``n``, a
cache shared by the kernels of one call and the statistic's parameters, and returns a 0-d tensor
on the device: ``_abs_mean(x, n, cache, params)`` is ``x.abs().sum(dtype=_accum(x)) / n``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import cache
from typing import Any, NamedTuple

import torch
from torch import Tensor

from tensordbg.statistics.registry import (
    ANY_NONFINITE,
    FINITE,
    REGISTRY,
    SCALE_LINEAR,
    Stat,
    definition,
)

_F64 = torch.float64

__all__ = [
    "SCALE_LINEAR",
    "SCREEN",
    "device_parts",
    "device_stats",
    "dtype_name",
    "finish",
    "host_stats",
    "norm_parts",
    "scale_vector",
    "update_stats",
    "watchable",
]

# What every watched tensor gets: whether it is finite (one sum, or free beside a statistic that
# a NaN or an Inf poisons).
SCREEN = (FINITE,)

_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
# Dtypes that torch reduces as they are; others (fp8) are widened to float32 first.
_FLOATING = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


@cache  # asked for every watched tensor: each dtype is spelled once
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


def _reducible(t: Tensor) -> Tensor:
    """The tensor in a dtype that torch's reductions support: fp8 is widened to float32. (The
    half types stay as they are; the kernels that would overflow them accumulate in float32.)"""
    if t.dtype in _FLOATING:
        return t
    return t.float()


# ---------------------------------------------------------------------------------------------
# The kernels, one per statistic of the registry

# A kernel: (x, n, cache, params) -> 0-d tensor on x's device. The cache holds what kernels of
# one call share (the sum, aminmax) and, for update statistics, the value before the step.
Cache = dict[str, Any]
Params = tuple[float, ...]
Kernel = Callable[[Tensor, int, Cache, Params], Tensor]
# The same read on the host, as a Python float.
HostKernel = Callable[[Tensor, int, Cache, Params], float]

_KERNELS: dict[str, Kernel] = {}
_HOST_KERNELS: dict[str, HostKernel] = {}
# Kernels that one pass computes together ("min" and "max" from one aminmax): any of them is
# free beside another.
_PASSES: dict[str, str] = {}


def _kernel(
    name: str, *, host: HostKernel | None = None, shares: str | None = None
) -> Callable[[Kernel], Kernel]:
    """Attach a torch kernel to the registry's statistic ``name``. ``host`` reads it as a Python
    float more cheaply than the kernel and ``.item()``; ``shares`` names a pass it shares."""

    def attach(kernel: Kernel) -> Kernel:
        _KERNELS[name] = kernel
        _HOST_KERNELS[name] = host or _read(kernel)
        if shares is not None:
            _PASSES[name] = shares
        return kernel

    return attach


def _read(kernel: Kernel) -> HostKernel:
    def read(x: Tensor, n: int, cache: Cache, params: Params) -> float:
        return float(kernel(x, n, cache, params).item())

    return read


def _accum(x: Tensor) -> torch.dtype:
    """The dtype a kernel accumulates in: float32, float64 for float64 tensors."""
    return _F64 if x.dtype == _F64 else torch.float32


def _sum(x: Tensor) -> Tensor:
    """The sum in a dtype that holds it: float32 for the half types."""
    return x.sum() if x.dtype in (torch.float32, _F64) else x.sum(dtype=torch.float32)


def _cached_sum(x: Tensor, cache: Cache) -> Tensor:
    if "sum" not in cache:
        cache["sum"] = _sum(x)
    return cache["sum"]


def _aminmax(x: Tensor, cache: Cache) -> tuple[Tensor, Tensor]:
    if "aminmax" not in cache:
        cache["aminmax"] = torch.aminmax(x)
    return cache["aminmax"]


def _delta(x: Tensor, cache: Cache) -> Tensor:
    """|p - p_prev|: one subtraction for all the update statistics, never changed in place."""
    if "delta" not in cache:
        cache["delta"] = (x - cache["prev"]).abs_()
    return cache["delta"]


_ROUNDED: dict[tuple[float, torch.dtype, bool], float] = {}


def _rounded(bound: float, dtype: torch.dtype, up: bool) -> float:
    """``bound`` rounded to ``dtype`` upwards (or downwards), so that comparing elements of that
    dtype with it answers as comparing them with ``bound`` exactly: for x of the dtype,
    ``x >= b`` iff ``x >= up(b)``, ``x > b`` iff ``x > down(b)`` (torch would round the bound to
    the nearest value, and count 1.0 in bfloat16 as inside ``x <= tanh(8.8)``). Cached."""
    key = (bound, dtype, up)
    value = _ROUNDED.get(key)
    if value is None:
        if dtype == _F64 or not math.isfinite(bound):
            value = bound
        else:
            r = torch.tensor(bound, dtype=_F64).to(dtype)
            if (r.item() < bound) if up else (r.item() > bound):
                r = torch.nextafter(r, torch.tensor(math.inf if up else -math.inf, dtype=dtype))
            value = r.item()
        _ROUNDED[key] = value
    return value


def _exactly_finite(x: Tensor, screened: bool) -> float:
    """1.0 when every element of ``x`` is finite, given what a screen said: one that says not
    may be a sum (or squares) of finite values past the dtype's range, settled element-wise."""
    return 1.0 if screened or bool(torch.isfinite(x).all()) else 0.0


# When no statistic computed anyway tells (see _witnesses): the sum, which NaN and Inf poison
# (a sum that is not finite is settled on the host; on a device, by the NaN and Inf counts).
@_kernel("finite", host=lambda x, n, cache, p: _exactly_finite(x, math.isfinite(_sum(x).item())))
def _finite(x: Tensor, n: int, cache: Cache, p: Params) -> Tensor:
    return torch.isfinite(_sum(x))


@_kernel("min", shares="aminmax")
def _min(x: Tensor, n: int, cache: Cache, p: Params) -> Tensor:
    return _aminmax(x, cache)[0]


@_kernel("max", shares="aminmax")
def _max(x: Tensor, n: int, cache: Cache, p: Params) -> Tensor:
    return _aminmax(x, cache)[1]


@_kernel("nan")
def _nan(x: Tensor, n: int, cache: Cache, p: Params) -> Tensor:
    return torch.count_nonzero(torch.isnan(x))


@_kernel("posinf")
def _posinf(x: Tensor, n: int, cache: Cache, p: Params) -> Tensor:
    return torch.count_nonzero(x == math.inf)


@_kernel("neginf")
def _neginf(x: Tensor, n: int, cache: Cache, p: Params) -> Tensor:
    return torch.count_nonzero(x == -math.inf)


# On the host, from the one sum in Python: arithmetic on 0-d tensors costs microseconds each.
@_kernel("mean", host=lambda x, n, cache, p: _cached_sum(x, cache).item() / n)
def _mean(x: Tensor, n: int, cache: Cache, p: Params) -> Tensor:
    return _cached_sum(x, cache) / n


@_kernel("abs_mean")
def _abs_mean(x: Tensor, n: int, cache: Cache, p: Params) -> Tensor:
    return x.abs().sum(dtype=_accum(x)) / n  # vector_norm(x, 1) is ~2-8x slower on CPU


@_kernel("std")
def _std(x: Tensor, n: int, cache: Cache, p: Params) -> Tensor:
    # Two passes (mean, then squares of the deviations): torch.std_mean is ~30x slower here.
    centered = x.reshape(-1).to(_accum(x)) - _cached_sum(x, cache) / n
    return (torch.dot(centered, centered) / n).sqrt()


def _l2_host(x: Tensor, n: int, cache: Cache, p: Params) -> float:
    flat = x.reshape(-1)
    if flat.dtype in (torch.float32, _F64):
        norm = torch.dot(flat, flat).sqrt().item()  # BLAS: ~2.5x faster than vector_norm
    else:
        norm = torch.linalg.vector_norm(x, 2, dtype=torch.float32).item()
    if math.isinf(norm) and flat.dtype != _F64:
        # x * x overflowed (|x| past ~1.8e19 in float32) though x may be finite: read exactly.
        norm = torch.linalg.vector_norm(x, 2, dtype=_F64).item()
    return norm


@_kernel("l2", host=_l2_host)
def _l2(x: Tensor, n: int, cache: Cache, p: Params) -> Tensor:
    # On the device nothing is read back per tensor, so an overflow of x * x cannot be caught
    # and redone: accumulate in float64, where the square of any float32 is finite.
    return torch.linalg.vector_norm(x, 2, dtype=_F64)


# Fractions are divided in float64, as numpy divides: exact counts give the same value.
@_kernel("zero_frac", host=lambda x, n, cache, p: (n - torch.count_nonzero(x).item()) / n)
def _zero_frac(x: Tensor, n: int, cache: Cache, p: Params) -> Tensor:
    return (n - torch.count_nonzero(x)).to(_F64) / n


def _in_range(x: Tensor, p: Params) -> Tensor:
    lo, hi = _rounded(p[0], x.dtype, up=True), _rounded(p[1], x.dtype, up=False)
    return torch.count_nonzero((x >= lo) & (x <= hi))


@_kernel("in_range_frac", host=lambda x, n, cache, p: _in_range(x, p).item() / n)
def _in_range_frac(x: Tensor, n: int, cache: Cache, p: Params) -> Tensor:
    return _in_range(x, p).to(_F64) / n


@_kernel("dead_unit_frac")
def _dead_unit_frac(x: Tensor, n: int, cache: Cache, p: Params) -> Tensor:
    lo, hi, dim, min_live = p
    x = x.reshape(1) if x.dim() == 0 else x
    live = x > _rounded(lo, x.dtype, up=False)
    if hi != math.inf:  # +Inf is live when there is no upper bound
        live &= x < _rounded(hi, x.dtype, up=True)
    # torch copies a bool mask before any reduction by dim (to int64 for sum and count_nonzero):
    # float32 is the cheapest copy, and counts exactly up to 2**24 elements per unit.
    unit_dim = int(dim) % x.dim()
    others = [d for d in range(x.dim()) if d != unit_dim]
    live_count = live.to(torch.float32).sum(dim=others) if others else live.to(torch.float32)
    dead = live_count < _fewest_live(min_live, n // x.shape[unit_dim])
    return dead.to(_F64).mean()


def _fewest_live(min_live: float, per_unit: int) -> int:
    """The fewest live elements a unit of ``per_unit`` elements needs: a count k is dead when
    k / per_unit < min_live in float64, as numpy decides it (exact integers on both sides)."""
    k = max(0, math.ceil(min_live * per_unit))
    while k > 0 and (k - 1) / per_unit >= min_live:
        k -= 1
    while k <= per_unit and k / per_unit < min_live:
        k += 1
    return k


@_kernel("update_abs_mean")
def _update_abs_mean(x: Tensor, n: int, cache: Cache, p: Params) -> Tensor:
    delta = _delta(x, cache)
    return delta.sum(dtype=_accum(delta)) / n


@_kernel("prev_abs_mean")
def _prev_abs_mean(x: Tensor, n: int, cache: Cache, p: Params) -> Tensor:
    prev = cache["prev"]
    return prev.abs().sum(dtype=_accum(prev)) / n  # vector_norm(prev, 1) is ~2-8x slower on CPU


@_kernel("update_unchanged")
def _update_unchanged(x: Tensor, n: int, cache: Cache, p: Params) -> Tensor:
    # Every element within atol + rtol * |prev|, in the tensor's dtype.
    rtol, atol = p
    bound = cache["prev"].abs().mul_(rtol)
    excess = torch.sub(_delta(x, cache), bound, out=bound).amax()  # in bound's buffer
    return excess <= atol


_missing = REGISTRY.keys() - _KERNELS.keys()
if _missing:
    raise ImportError(f"statistics without a torch kernel: {', '.join(sorted(_missing))}")


# ---------------------------------------------------------------------------------------------
# Plans: what one tuple of statistics costs, worked out once


class _Plan(NamedTuple):
    """How to compute one tuple of statistics: made once per tuple, then reused on every call."""

    kernels: tuple[tuple[Kernel, Params], ...]  # one per statistic computed, in order
    raw: tuple[tuple[Kernel, Params], ...]  # the same, "finite" as its sum (read on the host)
    sum_at: int  # where "finite" is its own sum among the computed statistics, or -1
    host_kernels: tuple[tuple[HostKernel, Params], ...]  # the same, read on the host
    witnesses: tuple[int, ...]  # the computed statistics "finite" is read off, if it is
    order: tuple[int, ...]  # where each requested statistic is; "finite" read off witnesses last
    empty: tuple[float, ...]  # the values on a tensor without elements
    needs_prev: Stat | None  # the first statistic that needs the value before the step


_PLANS: dict[tuple[Stat, ...], _Plan] = {}
_MAX_PLANS = 4096  # rules ask for a few tuples; a rule that makes a new one each call is capped


def _plan(stats: Sequence[Stat]) -> _Plan:
    if type(stats) is not tuple:
        stats = tuple(stats)
    plan = _PLANS.get(stats)
    if plan is None:
        plan = _make_plan(stats)
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[stats] = plan
    return plan


def _make_plan(stats: tuple[Stat, ...]) -> _Plan:
    entries = {stat: definition(stat) for stat in stats}
    computed = [stat for stat in entries if stat != FINITE]
    witnesses: list[Stat] = _witnesses(computed) if FINITE in entries else []
    computed += [w for w in witnesses if w not in computed]
    if FINITE in entries and not witnesses:
        computed.append(FINITE)  # its own kernel: the sum
    where = {stat: i for i, stat in enumerate(computed)}
    if witnesses:
        where[FINITE] = len(computed)
    kernels = tuple((_KERNELS[s.name], s.params) for s in computed)
    sum_at = where[FINITE] if FINITE in entries and not witnesses else -1
    return _Plan(
        kernels=kernels,
        raw=tuple((_raw_finite, ()) if i == sum_at else k for i, k in enumerate(kernels)),
        sum_at=sum_at,
        host_kernels=tuple((_HOST_KERNELS[s.name], s.params) for s in computed),
        witnesses=tuple(where[w] for w in witnesses),
        order=tuple(where[stat] for stat in stats),
        empty=tuple(entries[stat].empty for stat in stats),
        needs_prev=next((s for s, entry in entries.items() if entry.needs_prev), None),
    )


def _witnesses(computed: list[Stat]) -> list[Stat]:
    """Statistics that together show any NaN or Inf (each is non-finite when the tensor holds
    the non-finite values its ``poisoned_by`` names), so that "finite" costs no pass of its own:
    those computed anyway and those free beside them (min and max share one pass). Earlier ones
    in the registry first (the range never overflows; a sum of finite values can, which gives a
    "not finite" that the engine settles by counting NaN and Inf). None when they do not cover
    every non-finite value: the sum is then the cheaper screen."""
    passes = {_PASSES.get(s.name) for s in computed} - {None}
    free = [Stat(name) for name, key in _PASSES.items() if key in passes]
    candidates = sorted(dict.fromkeys(computed + free), key=lambda s: _ORDER[s.name])
    chosen: list[Stat] = []
    shown: frozenset[str] = frozenset()
    for stat in candidates:
        poisoned_by = REGISTRY[stat.name].poisoned_by
        if poisoned_by - shown:
            chosen.append(stat)
            shown |= poisoned_by
    return chosen if shown >= ANY_NONFINITE else []


_ORDER = {name: i for i, name in enumerate(REGISTRY)}


# ---------------------------------------------------------------------------------------------
# What the engine calls


def device_stats(t: Tensor, stats: Sequence[Stat]) -> Tensor:
    """The values of ``stats`` for ``t`` as one float64 vector on ``t``'s device (no sync)."""
    plan = _plan(stats)
    if plan.needs_prev is not None:
        raise ValueError(f"statistic {plan.needs_prev} needs the previous value: update_stats")
    return _device_vector(_reducible(t.detach()), plan, {})


def _device_vector(x: Tensor, plan: _Plan, cache: Cache) -> Tensor:
    n = x.numel()
    if not n:
        return torch.tensor(plan.empty, dtype=_F64, device=x.device)
    values = [kernel(x, n, cache, params) for kernel, params in plan.kernels]
    witnesses = plan.witnesses
    if len(witnesses) == 1:
        values.append(torch.isfinite(values[witnesses[0]]))
    elif witnesses:
        values.append(torch.isfinite(torch.stack([values[i] for i in witnesses])).all())
    out = [values[i].to(_F64) for i in plan.order]
    return torch.stack(out) if out else x.new_empty(0, dtype=_F64)


def device_parts(
    t: Tensor, stats: Sequence[Stat], previous: Tensor | None = None
) -> tuple[list[Tensor], _Plan]:
    """The 0-d results of the kernels of ``stats`` for ``t`` (of an update's statistics when
    ``previous`` is the value before the step), left on ``t``'s device as they came: one launch
    per statistic, no conversion or stacking per tensor (on CUDA, each of those is a launch,
    and launches, not the reductions, are what a step of hundreds of tensors pays for). With
    :func:`finish` on their values on the host, the same values as :func:`device_stats`."""
    plan = _plan(stats)
    cache: Cache = {}
    if previous is not None:
        cache["prev"] = _reducible(previous)
    elif plan.needs_prev is not None:
        raise ValueError(f"statistic {plan.needs_prev} needs the previous value: update_stats")
    x = _reducible(t.detach())
    n = x.numel()
    if not n:
        return [], plan
    return [kernel(x, n, cache, params) for kernel, params in plan.raw], plan


def norm_parts(norm: Tensor, stats: Sequence[Stat]) -> tuple[list[Tensor], _Plan]:
    """The parts of ``stats`` ("finite" and "l2" only) of a tensor whose norm (accumulated
    where its squares cannot overflow) is ``norm``: what :func:`device_parts` would make."""
    return [norm], _plan(stats)


def finish(plan: _Plan, raw: list[float]) -> list[float]:
    """The values of a plan's statistics from its parts read on the host (:func:`device_parts`;
    none for a tensor without elements)."""
    if not raw:
        return list(plan.empty)
    if plan.sum_at >= 0:
        raw[plan.sum_at] = 1.0 if math.isfinite(raw[plan.sum_at]) else 0.0
    if plan.witnesses:
        raw.append(1.0 if all(math.isfinite(raw[i]) for i in plan.witnesses) else 0.0)
    return [raw[i] for i in plan.order]


def _raw_finite(x: Tensor, n: int, cache: Cache, p: Params) -> Tensor:
    return _cached_sum(x, cache)  # NaN and Inf poison it; finish() reads which


def host_stats(t: Tensor, stats: Sequence[Stat]) -> list[float]:
    """The values of ``stats`` for ``t`` as Python floats, read at once: the eager path. On the CPU
    reading a value costs nothing; on CUDA each read synchronizes (batched mode avoids that)."""
    x = _reducible(t.detach())
    if len(stats) == 1 and stats[0] == FINITE:  # most tensors, most steps: one sum, no plan
        return [1.0 if math.isfinite(_sum(x).item()) else _exactly_finite(x, False)]
    plan = _plan(stats)
    if plan.needs_prev is not None:
        raise ValueError(f"statistic {plan.needs_prev} needs the previous value: update_stats")
    n = x.numel()
    if not n:
        return list(plan.empty)
    cache: Cache = {}
    values = [read(x, n, cache, params) for read, params in plan.host_kernels]
    if plan.witnesses:
        values.append(_exactly_finite(x, all(math.isfinite(values[i]) for i in plan.witnesses)))
    return [values[i] for i in plan.order]


def update_stats(current: Tensor, previous: Tensor, stats: Sequence[Stat]) -> Tensor:
    """Update statistics of a parameter against its value before the optimizer step, as one
    float64 vector on the device. Other statistics in ``stats`` are of ``current``."""
    prev = _reducible(previous)
    return _device_vector(_reducible(current.detach()), _plan(stats), {"prev": prev})


def scale_vector(stats: Sequence[Stat], inv_scale: Tensor) -> Tensor:
    """Factors that unscale a stats vector of a gradient computed under a loss scale."""
    one = torch.ones((), dtype=_F64, device=inv_scale.device)
    inv = inv_scale.to(_F64)
    return torch.stack([inv if s.name in SCALE_LINEAR else one for s in stats])
