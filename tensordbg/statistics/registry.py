"""The statistics of a tensor: the vocabulary rules speak, one registry that defines each
statistic once, and the numpy reference of each.

Rules never see tensors. Each rule asks for a few :class:`Stat` values; the engine computes only
those, next to the tensor (:mod:`tensordbg.statistics.torch_kernels`, on the training device),
and hands the rule a :class:`TensorStats`. Offline, the same statistics come from
:func:`compute_numpy`, so a rule runs unchanged on a live training or on a dump. This module
never imports torch; the torch kernels are attached to the same names in ``torch_kernels``.

A statistic is one :func:`_define` call: its name, its numpy reference and what both sides must
know of it (how it scales under a loss scale, which non-finite elements it shows, ...)::

    MEAN = _define("mean", np.mean, scaling=Scaling.LINEAR, poisoned_by=ANY_NONFINITE, wide=True)

>>> import numpy as np
>>> compute_numpy(np.array([1.0, -3.0, 0.0]), (MIN, MAX, ZERO_FRAC))[ZERO_FRAC]
0.3333333333333333
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple

import numpy as np

KINDS = ("input", "output", "grad_output", "grad_input", "param", "grad", "update", "buffer",
         "observed")  # fmt: skip

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


# ---------------------------------------------------------------------------------------------
# The registry: each statistic defined once


class Scaling(Enum):
    """How a statistic of a tensor changes when the tensor is multiplied by s > 0, as a gradient
    computed under a loss scale (``torch.amp.GradScaler``) is."""

    INVARIANT = "invariant"  # counts and fractions: the same value
    LINEAR = "linear"  # s times the value: multiplying by 1/s undoes the scale


# Which non-finite elements a statistic shows; see Definition.poisoned_by.
ANY_NONFINITE = frozenset({"nan", "+inf", "-inf"})


@dataclass(frozen=True, slots=True)
class Definition:
    """What a statistic is, for the numpy side and the torch side alike.

    - ``reference``: the numpy reference, ``reference(x, *params)``, or
      ``reference(x, prev, *params)`` when ``needs_prev``; ``x`` has at least one element.
    - ``params``: the names of its parameters (``Stat.params`` holds their values, in order).
    - ``scaling``: how its value changes when the tensor is multiplied by s > 0.
    - ``scaled_params``: indices of the parameters in the tensor's units (bounds on its values):
      the value on ``s * x`` with those parameters multiplied by s is the value on ``x``, scaled
      by ``scaling``. A factor alone cannot unscale such a statistic.
    - ``poisoned_by``: the non-finite elements ("nan", "+inf", "-inf") that always make the
      statistic non-finite, so that it tells "finite" for free. Declared for statistics of the
      tensor alone (not of an update, which a non-finite ``prev`` poisons too).
    - ``wide``: the reference reads the tensor in float64, where each element is exact: sums
      that do not overflow, comparisons with a bound as given. (The torch kernels accumulate in
      float32 at least, and round a bound outwards to the tensor's dtype.)
    - ``needs_prev``: it compares the tensor with its value before the optimizer step.
    - ``empty``: its value on a tensor without elements.
    """

    name: str
    reference: Callable[..., Any]
    params: tuple[str, ...] = ()
    scaling: Scaling = Scaling.INVARIANT
    scaled_params: tuple[int, ...] = ()
    poisoned_by: frozenset[str] = frozenset()
    wide: bool = False
    needs_prev: bool = False
    empty: float = math.nan


# Every statistic by name, in the order defined below (the torch side prefers earlier ones when
# it reads "finite" off statistics computed anyway: the range never overflows, sums can).
REGISTRY: dict[str, Definition] = {}


def _define(name: str, reference: Callable[..., Any], **how: Any) -> Stat:
    """Register a statistic; returns it, without parameters (see the constructors below)."""
    if name in REGISTRY:
        raise ValueError(f"statistic {name!r} is defined twice")
    REGISTRY[name] = Definition(name, reference, **how)
    return Stat(name)


def definition(stat: Stat) -> Definition:
    """The registry's entry for ``stat``, checked against its parameters.

    >>> definition(L2).scaling
    <Scaling.LINEAR: 'linear'>
    """
    entry = REGISTRY.get(stat.name)
    if entry is None:
        raise KeyError(f"unknown statistic {stat}; known: {', '.join(REGISTRY)}")
    if len(stat.params) != len(entry.params):
        raise ValueError(f"statistic {stat} takes the parameters ({', '.join(entry.params)})")
    return entry


# The screen every watched tensor gets. On the training device it is read off a statistic
# computed anyway (see poisoned_by), else off one sum: NaN and Inf both poison a sum.
FINITE = _define("finite", lambda x: np.isfinite(x).all(), empty=1.0)
# The range: one pass on the device. Both propagate NaN, like numpy's min and max.
MIN = _define("min", np.min, scaling=Scaling.LINEAR, poisoned_by=frozenset({"nan", "-inf"}))
MAX = _define("max", np.max, scaling=Scaling.LINEAR, poisoned_by=frozenset({"nan", "+inf"}))
# Counts of non-finite elements.
NAN = _define("nan", lambda x: np.count_nonzero(np.isnan(x)), empty=0.0)
POSINF = _define("posinf", lambda x: np.count_nonzero(np.isposinf(x)), empty=0.0)
NEGINF = _define("neginf", lambda x: np.count_nonzero(np.isneginf(x)), empty=0.0)
# Moments and norms: NaN or Inf as soon as one element is.
MEAN = _define("mean", np.mean, scaling=Scaling.LINEAR, poisoned_by=ANY_NONFINITE, wide=True)
ABS_MEAN = _define(
    "abs_mean",
    lambda x: np.mean(np.abs(x)),
    scaling=Scaling.LINEAR,
    poisoned_by=ANY_NONFINITE,
    wide=True,
)
STD = _define("std", np.std, scaling=Scaling.LINEAR, poisoned_by=ANY_NONFINITE, wide=True)
L2 = _define(
    "l2",
    lambda x: np.sqrt(np.vdot(x, x)),
    scaling=Scaling.LINEAR,
    poisoned_by=ANY_NONFINITE,
    wide=True,
)
ZERO_FRAC = _define("zero_frac", lambda x: np.count_nonzero(x == 0) / x.size)
# Parameterised statistics: made by the constructors below. The references compare in float64,
# where every element is exact, so that a bound is never rounded to the tensor's dtype.
_define(
    "in_range_frac",
    lambda x, lo, hi: np.count_nonzero((x >= lo) & (x <= hi)) / x.size,
    params=("lo", "hi"),
    scaled_params=(0, 1),
    wide=True,
)


def _dead_unit_frac(x: np.ndarray, lo: float, hi: float, unit_dim: float, min_live: float):
    x = x.reshape(1) if x.ndim == 0 else x
    live = x > lo if hi == math.inf else (x > lo) & (x < hi)
    axis = int(unit_dim) % x.ndim
    others = tuple(d for d in range(x.ndim) if d != axis)
    per_unit = x.size // x.shape[axis]
    return np.mean(np.count_nonzero(live, axis=others) / per_unit < min_live)


_define(
    "dead_unit_frac",
    _dead_unit_frac,
    params=("lo", "hi", "unit_dim", "min_live"),
    scaled_params=(0, 1),
    wide=True,
)
# Statistics of an optimizer update: the parameter now against the parameter before the step.
UPDATE_ABS_MEAN = _define(
    "update_abs_mean",
    lambda x, prev: np.mean(np.abs(x - prev)),
    scaling=Scaling.LINEAR,
    wide=True,
    needs_prev=True,
)
PREV_ABS_MEAN = _define(
    "prev_abs_mean",
    lambda x, prev: np.mean(np.abs(prev)),
    scaling=Scaling.LINEAR,
    wide=True,
    needs_prev=True,
)
_define(
    "update_unchanged",
    lambda x, prev, rtol, atol: np.all(np.abs(x - prev) <= atol + rtol * np.abs(prev)),
    params=("rtol", "atol"),
    scaled_params=(1,),
    wide=True,
    needs_prev=True,
    empty=1.0,
)

# Names of the statistics that compare a parameter with its value before the step.
UPDATE_STATS = frozenset(name for name, entry in REGISTRY.items() if entry.needs_prev)
# Names of the statistics that scale with the tensor: a gradient computed under a loss scale s
# has them s times too large. Counts and fractions do not scale.
SCALE_LINEAR = frozenset(
    name for name, entry in REGISTRY.items() if entry.scaling is Scaling.LINEAR
)


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
    parts += [f"n={int(numel)}"] if numel is not None else []
    if numel == 0:  # an empty slice: no range, mean or spread to speak of (not NaN)
        return " ".join([*parts, "empty"])
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
        values = self.values
        if NAN in values or values.get(FINITE) == 1.0:
            return values.get(NAN, 0.0) > 0
        if values.get(FINITE) == 0.0 == values.get(POSINF) == values.get(NEGINF):
            return True  # not finite, and no Inf: a NaN
        lo, hi = values.get(MIN), values.get(MAX)
        return None if lo is None or hi is None else math.isnan(lo) or math.isnan(hi)

    @property
    def has_inf(self) -> bool | None:
        """True or False when known. A NaN hides an Inf from the range, so then only counts tell."""
        if self.summary is not None:
            return self.summary.posinf + self.summary.neginf > 0
        values = self.values
        if POSINF in values and NEGINF in values:
            return values[POSINF] + values[NEGINF] > 0
        if values.get(FINITE) == 1.0 or values.get(FINITE) == 0.0 == values.get(NAN):
            return values.get(FINITE) == 0.0  # screened finite; or not finite, and no NaN
        lo, hi = values.get(MIN), values.get(MAX)
        if lo is None or hi is None:
            return None
        if math.isinf(lo) or math.isinf(hi):
            return True
        return None if math.isnan(lo) or math.isnan(hi) else False

    @property
    def nonfinite(self) -> bool | None:
        """Whether any element is NaN or Inf; None when nothing tells."""
        if self.summary is None and self.values.get(FINITE) == 1.0:
            return False  # most tensors, most steps: screened finite
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


def _as_float(array: np.ndarray) -> np.ndarray:
    """The array in a dtype numpy computes with: integers, booleans and the floats numpy does
    not know (ml_dtypes' bfloat16 and float8) in float64, where each of their values is exact."""
    x = np.asarray(array)
    return x if np.issubdtype(x.dtype, np.floating) else x.astype(np.float64)


def compute_numpy(
    array: np.ndarray, stats: Iterable[Stat], prev: np.ndarray | None = None
) -> dict[Stat, float]:
    """Compute ``stats`` of ``array`` with numpy; update statistics need ``prev``."""
    x = _as_float(array)
    entries = {stat: definition(stat) for stat in stats}
    before = None
    needs_prev = [stat for stat, entry in entries.items() if entry.needs_prev]
    if needs_prev:
        if prev is None:
            raise ValueError(f"statistic {needs_prev[0]} needs the previous value of the tensor")
        before = _as_float(prev).astype(np.float64, copy=False)
    if x.size == 0:
        return {stat: entry.empty for stat, entry in entries.items()}
    wide = x.astype(np.float64, copy=False) if any(e.wide for e in entries.values()) else x
    values = {}
    with np.errstate(all="ignore"):  # NaN and Inf are what is being measured, not an accident
        for stat, entry in entries.items():
            data = wide if entry.wide else x
            args = (data, before, *stat.params) if entry.needs_prev else (data, *stat.params)
            values[stat] = float(entry.reference(*args))
    return values


# The Summary's moments, each computed by its statistic's reference.
_MOMENTS = (MIN, MAX, MEAN, STD, ABS_MEAN, L2)


def summarize_numpy(array: np.ndarray) -> Summary:
    """The :class:`Summary` of an array; moments over its finite elements."""
    x = _as_float(array)
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
        for stat in _MOMENTS:
            setattr(s, stat.name, float(REGISTRY[stat.name].reference(values)))
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
