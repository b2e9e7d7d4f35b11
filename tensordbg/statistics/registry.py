"""Tensor statistics: the vocabulary rules speak, and its numpy reference implementation.

Rules never see tensors. Each rule asks for a few :class:`Stat` values; the engine computes only
those, next to the tensor (``tensordbg.statistics.torch_kernels`` on the training device), and hands the rule a
:class:`TensorStats`. Offline, the same statistics come from :func:`compute_numpy`, so a rule runs
unchanged on a live training or on a dump. This module never imports torch.

>>> import numpy as np
>>> compute_numpy(np.array([1.0, -3.0, 0.0]), (MIN, MAX, ZERO_FRAC))[ZERO_FRAC]
0.3333333333333333
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

# Kinds of watched tensors.
KINDS = ("input", "output", "grad_output", "grad_input", "param", "grad", "update", "observed")

# Largest finite value of each floating dtype, by torch's dtype name.
FLOAT_MAX: dict[str, float] = {
    "float64": 1.7976931348623157e308,
    "float32": 3.4028234663852886e38,
    "float16": 65504.0,
    "bfloat16": 3.3895313892515355e38,
    "float8_e4m3fn": 448.0,
    "float8_e4m3fnuz": 240.0,
    "float8_e5m2": 57344.0,
    "float8_e5m2fnuz": 57344.0,
}


class Stat(NamedTuple):
    """One statistic of a tensor, named and, for some, parameterised.

    Stats are hashable and compare by value, so rules can ask for the same statistic and the
    engine computes it once: ``in_range_frac(-1, 0) == in_range_frac(-1, 0)``. (A named tuple:
    it is a dictionary key on every watched tensor, and tuples hash fast.)
    """

    name: str
    params: tuple[float, ...] = ()

    def __str__(self) -> str:
        if not self.params:
            return self.name
        return f"{self.name}({', '.join(f'{p:g}' for p in self.params)})"


# The screen every watched tensor gets: 1.0 when every element is finite. On the training device
# it costs one sum (NaN and Inf both poison a sum), and only a non-finite sum leads to counting.
FINITE = Stat("finite")
# The range: one pass. Both propagate NaN, like numpy's min and max.
MIN = Stat("min")
MAX = Stat("max")
# Counts of non-finite elements.
NAN = Stat("nan")
POSINF = Stat("posinf")
NEGINF = Stat("neginf")
# Moments and norms (NaN as soon as one element is NaN).
MEAN = Stat("mean")
STD = Stat("std")  # population standard deviation (ddof 0)
ABS_MEAN = Stat("abs_mean")
L2 = Stat("l2")
ZERO_FRAC = Stat("zero_frac")
# Statistics of an optimizer update: the parameter now against the parameter before the step.
UPDATE_ABS_MEAN = Stat("update_abs_mean")  # mean |p - p_prev|
PREV_ABS_MEAN = Stat("prev_abs_mean")  # mean |p_prev|

UPDATE_STATS = frozenset({"update_abs_mean", "prev_abs_mean", "update_unchanged"})


def in_range_frac(lo: float, hi: float) -> Stat:
    """Fraction of elements x with lo <= x <= hi."""
    return Stat("in_range_frac", (float(lo), float(hi)))


def dead_unit_frac(lo: float, hi: float, unit_dim: int, min_live: float) -> Stat:
    """Fraction of units (indices along ``unit_dim``) that are live in under ``min_live`` of
    their elements, where an element is live when lo < x < hi (lo < x when hi is inf, so that
    +Inf is live). A ReLU unit is dead when it is positive for under 1 % of the batch:
    ``dead_unit_frac(0, inf, -1, 0.01)``."""
    return Stat("dead_unit_frac", (float(lo), float(hi), float(unit_dim), float(min_live)))


def update_unchanged(rtol: float, atol: float) -> Stat:
    """1.0 when every element of the update satisfies |p - p_prev| <= atol + rtol * |p_prev|."""
    return Stat("update_unchanged", (float(rtol), float(atol)))


@dataclass(slots=True)
class Summary:
    """What a person wants to know of a tensor at a glance. Moments are over finite elements."""

    numel: int
    nan: int = 0
    posinf: int = 0
    neginf: int = 0
    zeros: int = 0
    min: float = math.nan
    max: float = math.nan
    mean: float = math.nan
    std: float = math.nan
    abs_mean: float = math.nan
    l2: float = math.nan

    @property
    def nonfinite(self) -> int:
        return self.nan + self.posinf + self.neginf

    def line(self, shape: Iterable[int], dtype: str) -> str:
        """One line in the spirit of lovely-tensors:
        ``tensor[8,128] float32 n=1024 x∈[-2.1, 2.6] μ=0.01 σ=1 NaN×3!``"""
        return describe(self.as_dict(), shape, dtype)

    def as_dict(self) -> dict[str, float | int]:
        return {name: getattr(self, name) for name in self.__slots__}


def _g(x: float) -> str:
    return f"{x:.3g}" if math.isfinite(x) else str(x)


def describe(values: Mapping[str, Any], shape: Iterable[int] | None = None, dtype: str = "") -> str:
    """One line for whatever is known of a tensor: a full :class:`Summary` as a dict, or the
    partial statistics a live session computed (``{"finite": 1.0, "l2": 3.2}``)::

        tensor[8,128] float32 n=1024 x∈[-2.1, 2.6] μ=0.01 σ=1 NaN×3!
        tensor[64] float32 n=64 ‖x‖=3.2 finite
    """
    parts = []
    if shape is not None:
        parts.append(f"tensor[{','.join(str(d) for d in shape)}]")
    if dtype:
        parts.append(dtype)
    get = values.get
    numel = get("numel")
    if numel is not None:
        parts.append(f"n={int(numel)}")
    counts = {k: int(get(k) or 0) for k in ("nan", "posinf", "neginf")}
    all_bad = numel is not None and sum(counts.values()) >= numel > 0
    if not all_bad:
        if get("min") is not None and get("max") is not None:
            parts.append(f"x∈[{_g(get('min'))}, {_g(get('max'))}]")
        shown = (("mean", "μ"), ("std", "σ"))
        if get("mean") is None and get("std") is None:  # norms only when the moments are unknown
            shown = (("abs_mean", "mean|x|"), ("l2", "‖x‖"))
        for key, label in shown:
            if get(key) is not None:
                parts.append(f"{label}={_g(get(key))}")
    if numel and get("zeros") == numel:
        parts.append("all zeros")
    for key, label in (("nan", "NaN"), ("posinf", "+Inf"), ("neginf", "-Inf")):
        if counts[key]:
            parts.append(f"{label}×{counts[key]}!")
    if not any(counts.values()) and get("finite") is not None:
        parts.append("finite" if get("finite") == 1.0 else "NaN/Inf!")
    return " ".join(parts)


@dataclass(slots=True, eq=False)
class TensorStats:
    """A watched tensor as rules see it: where it came from and the statistics computed for it.

    ``values`` holds exactly the statistics the active rules asked for; :meth:`get` returns None
    for one that was not computed (a rule added later, an interval step skipped).
    """

    name: str
    module: str
    kind: str
    phase: str
    step: int
    shape: tuple[int, ...]
    dtype: str
    values: dict[Stat, float] = field(default_factory=dict)
    module_type: str = ""
    call: int = 0
    trainable: bool = False
    summary: Summary | None = None
    ref: int = -1

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def get(self, stat: Stat) -> float | None:
        return self.values.get(stat)

    @property
    def has_nan(self) -> bool | None:
        """True or False when known; None when only "something is not finite" is known."""
        if self.summary is not None:
            return self.summary.nan > 0
        if NAN in self.values:
            return self.values[NAN] > 0
        if self.values.get(FINITE) == 1.0:
            return False
        lo, hi = self.values.get(MIN), self.values.get(MAX)
        if lo is None or hi is None:
            return None
        return math.isnan(lo) or math.isnan(hi)

    @property
    def has_inf(self) -> bool | None:
        """True or False when known. A NaN hides an Inf from the range, so then only counts tell."""
        if self.summary is not None:
            return self.summary.posinf + self.summary.neginf > 0
        if POSINF in self.values and NEGINF in self.values:
            return self.values[POSINF] + self.values[NEGINF] > 0
        if self.values.get(FINITE) == 1.0:
            return False
        lo, hi = self.values.get(MIN), self.values.get(MAX)
        if lo is None or hi is None:
            return None
        if math.isinf(lo) or math.isinf(hi):
            return True
        return None if math.isnan(lo) or math.isnan(hi) else False

    @property
    def nonfinite(self) -> bool | None:
        """Whether any element is NaN or Inf; None when nothing tells."""
        nan, inf = self.has_nan, self.has_inf
        if nan or inf:
            return True
        if nan is False and inf is False:
            return False
        finite = self.values.get(FINITE)
        return None if finite is None else finite != 1.0

    @property
    def abs_max(self) -> float | None:
        """Largest magnitude among finite elements when the summary is known, else from the
        range."""
        if self.summary is not None and self.summary.numel > self.summary.nonfinite:
            return max(abs(self.summary.min), abs(self.summary.max))
        lo, hi = self.values.get(MIN), self.values.get(MAX)
        if lo is None or hi is None:
            return None
        return max(abs(lo), abs(hi))

    def line(self) -> str:
        """The one-line summary when known, else shape and dtype."""
        if self.summary is not None:
            return self.summary.line(self.shape, self.dtype)
        return f"tensor[{','.join(map(str, self.shape))}] {self.dtype}"


# ---------------------------------------------------------------------------------------------
# numpy reference implementation (offline rules, tests, replay)


# Statistics numpy computes in float64, whatever the array's dtype.
_WIDE = frozenset({"mean", "std", "abs_mean", "l2"}) | UPDATE_STATS


def compute_numpy(
    array: np.ndarray, stats: Iterable[Stat], prev: np.ndarray | None = None
) -> dict[Stat, float]:
    """Compute ``stats`` of ``array`` with numpy; update statistics need ``prev``."""
    x = np.asarray(array)
    if not np.issubdtype(x.dtype, np.floating):
        x = x.astype(np.float64)
    stats = tuple(stats)
    wide = x.astype(np.float64, copy=False) if any(s.name in _WIDE for s in stats) else x
    before = None
    if any(s.name in UPDATE_STATS for s in stats):
        if prev is None:
            missing = next(s for s in stats if s.name in UPDATE_STATS)
            raise ValueError(f"statistic {missing} needs the previous value of the tensor")
        before = np.asarray(prev, dtype=np.float64)
    return {stat: float(_numpy_stat(x, wide, stat, before)) for stat in stats}


def _numpy_stat(x: np.ndarray, wide: np.ndarray, stat: Stat, before: np.ndarray | None) -> float:
    name, p = stat.name, stat.params
    if name == "finite":
        return float(np.isfinite(x).all())
    if name == "min":
        return float(np.min(x))
    if name == "max":
        return float(np.max(x))
    if name == "nan":
        return float(np.count_nonzero(np.isnan(x)))
    if name == "posinf":
        return float(np.count_nonzero(np.isposinf(x)))
    if name == "neginf":
        return float(np.count_nonzero(np.isneginf(x)))
    if name == "mean":
        return float(np.mean(wide))
    if name == "std":
        return float(np.std(wide))
    if name == "abs_mean":
        return float(np.mean(np.abs(wide)))
    if name == "l2":
        return float(np.sqrt(np.sum(wide * wide)))
    if name == "zero_frac":
        return float(np.count_nonzero(x == 0)) / x.size
    if name == "in_range_frac":
        return float(np.count_nonzero((x >= p[0]) & (x <= p[1]))) / x.size
    if name == "dead_unit_frac":
        lo, hi, dim, min_live = p
        live = (x > lo if hi == math.inf else (x > lo) & (x < hi)).astype(np.float64)
        unit_dim = int(dim) % x.ndim
        other = tuple(d for d in range(x.ndim) if d != unit_dim)
        live_frac = live.mean(axis=other) if other else live
        return float(np.mean(live_frac < min_live))
    if before is not None and name in UPDATE_STATS:
        if name == "prev_abs_mean":
            return float(np.mean(np.abs(before)))
        delta = np.abs(wide - before)
        if name == "update_abs_mean":
            return float(np.mean(delta))
        rtol, atol = p
        return float(np.all(delta <= atol + rtol * np.abs(before)))
    raise KeyError(f"unknown statistic {stat}")


def summarize_numpy(array: np.ndarray) -> Summary:
    """The :class:`Summary` of an array; moments over its finite elements."""
    x = np.asarray(array)
    if not np.issubdtype(x.dtype, np.floating):
        x = x.astype(np.float64)
    finite = np.isfinite(x)
    s = Summary(
        numel=int(x.size),
        nan=int(np.count_nonzero(np.isnan(x))),
        posinf=int(np.count_nonzero(np.isposinf(x))),
        neginf=int(np.count_nonzero(np.isneginf(x))),
        zeros=int(np.count_nonzero(x == 0)),
    )
    values = x[finite].astype(np.float64) if not finite.all() else x.astype(np.float64).ravel()
    if values.size:
        s.min, s.max = float(values.min()), float(values.max())
        s.mean, s.std = float(values.mean()), float(values.std())
        s.abs_mean = float(np.abs(values).mean())
        s.l2 = float(np.sqrt(np.sum(values * values)))
    return s


def stats_from_numpy(
    array: np.ndarray,
    stats: Iterable[Stat],
    *,
    prev: np.ndarray | None = None,
    name: str,
    module: str = "",
    kind: str,
    phase: str = "forward",
    step: int = 0,
    module_type: str = "",
    trainable: bool = False,
    summary: bool = False,
) -> TensorStats:
    """A :class:`TensorStats` for a numpy array, as the engine would build it for a tensor.

    Offline re-runs of rules (and tests) use it. The summary is computed when asked for, and
    always for a non-finite array, as the engine does for tensors that look non-finite.

    >>> t = stats_from_numpy(np.array([1.0, np.nan]), (MIN, MAX), name="fc.weight", kind="param")
    >>> t.has_nan, t.summary.nan
    (True, 1)
    """
    x = np.asarray(array)
    nonfinite = not bool(np.isfinite(x).all())
    return TensorStats(
        name=name,
        module=module,
        kind=kind,
        phase=phase,
        step=step,
        shape=tuple(x.shape),
        dtype=str(x.dtype),
        values=compute_numpy(x, stats, prev),
        module_type=module_type,
        trainable=trainable,
        summary=summarize_numpy(x) if summary or nonfinite else None,
    )
