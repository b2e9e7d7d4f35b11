"""Rules on the values of any tensor: NaN, Inf and near-overflow, all zeros, and set bounds."""

from __future__ import annotations

import math
from typing import Any

from tensordbg.rules.base import (
    Finding,
    Rule,
    among,
    apart,
    check_number,
    nonfinite_count,
    refusal,
)
from tensordbg.statistics import (
    ABS_MEAN,
    FINITE,
    FLOAT_MAX,
    KINDS,
    MAX,
    MEAN,
    MIN,
    NAN,
    NEGINF,
    POSINF,
    ZERO_FRAC,
    Stat,
    TensorStats,
    in_range_frac,
)

# Every kind but "update": a parameter's values are judged as the "param" kind already.
VALUE_KINDS = frozenset(KINDS) - {"update"}
# Dtypes narrow enough that a finite value close to the top of the range is already a warning.
NARROW_FLOATS = frozenset(FLOAT_MAX) - {"float32", "float64"}


class NaN(Rule):
    """A NaN in a watched tensor: forward, backward, parameters and observed values.

    Updates are not judged: an update holds a NaN where its parameter does, found as the
    parameter.

    Defaults: MindInsight's "tensor overflow" and SageMaker's ExplodingTensor check NaN with no
    threshold; so does this rule. The engine names as origin only the module that produced it.

    Example: ``NaN(kinds={"grad", "param"})`` watches gradients and parameters only.
    """

    kinds = VALUE_KINDS
    needs = (FINITE,)
    propagates = True

    def silent_when_finite(self, t: TensorStats) -> bool:
        return True

    def check(self, t: TensorStats, state: dict[str, Any]) -> Finding | None:
        if t.has_nan is None and t.nonfinite:
            return Finding(
                1.0,
                None,
                f"{t.name} holds NaN or Inf among {t.numel} values (not counted: its values "
                "were not kept; sync='eager' keeps and counts every tensor).",
                "A NaN usually comes from 0/0, log or sqrt of a negative or zero value, or an "
                "overflow just before.",
            )
        if not t.has_nan:
            return None
        count, nan = nonfinite_count(t, (NAN,), "NaN")
        return Finding(
            count,
            None,
            f"{t.name} holds {nan}{_and_infinite(t)}{among(t)}.",
            "A NaN usually comes from 0/0, log or sqrt of a negative or zero value, or an "
            "overflow just before.",
        )


def _and_infinite(t: TensorStats) -> str:
    """The Infs beside a tensor's NaNs, for the NaN rule's message, when they were counted:
    " and 2097142 -Inf" (one NaN among two million -Inf is not the tensor's whole story)."""
    s = t.summary
    if s is not None:
        signed = [(s.posinf, "+Inf"), (s.neginf, "-Inf")]
    elif POSINF in t.values and NEGINF in t.values:
        signed = [(int(t.values[POSINF]), "+Inf"), (int(t.values[NEGINF]), "-Inf")]
    else:
        return ""
    return "".join(f" and {n} {sign}" for n, sign in signed if n)


class Overflow(Rule):
    """An infinite value, or a float16/bfloat16/float8 value close to its dtype's largest.

    Defaults: Inf as in MindInsight's "tensor overflow" and SageMaker's ExplodingTensor; for
    narrow dtypes, tensordbg also warns before the overflow, at ``near`` = 0.5 of the dtype's
    largest finite value (65504 for float16). float32 and float64 are judged on Inf only.
    ``near`` is a fraction above 0 and at most 1: at 0 every value would be near.

    Example: ``Overflow(near=0.25)`` warns a float16 training at 16376 instead of 32752.
    """

    kinds = VALUE_KINDS
    needs = (FINITE,)
    propagates = True

    def __init__(self, *, near: float = 0.5, **selection: Any):
        super().__init__(**selection)
        self.near = near

    def check_params(self) -> None:
        check_number(self, "near", above=0, most=1, noun="fraction")

    def stats_for(self, t: TensorStats) -> tuple[Stat, ...]:
        # The range only where values can come close to the dtype's largest.
        return (FINITE, MIN, MAX) if t.dtype in NARROW_FLOATS else (FINITE,)

    def silent_when_finite(self, t: TensorStats) -> bool:
        return t.dtype not in NARROW_FLOATS

    def check(self, t: TensorStats, state: dict[str, Any]) -> Finding | None:
        if t.has_inf:
            s = t.summary
            count, infinite = nonfinite_count(t, (POSINF, NEGINF), "infinite values")
            signs = f" (+Inf×{s.posinf}, -Inf×{s.neginf})" if s is not None else ""
            return Finding(
                count,
                None,
                f"{t.name} holds {infinite}{signs}{among(t)}.",
                f"An Inf comes from a value that overflowed {t.dtype} (too high a learning rate, "
                "exp of a large input), a division by zero or the log of zero.",
            )
        if t.dtype not in NARROW_FLOATS:
            return None
        peak = t.abs_max
        limit = self.near * FLOAT_MAX[t.dtype]
        if peak is None or not peak >= limit:
            return None
        return Finding(
            peak,
            limit,
            f"{t.name} reaches {apart(peak, limit)[0]}, {peak / FLOAT_MAX[t.dtype]:.1%} of the "
            f"largest {t.dtype} {FLOAT_MAX[t.dtype]:.5g} (threshold {self.near:g} of it).",
            "It is about to overflow: scale the loss down (GradScaler), normalise the inputs or "
            "run this operation in float32.",
        )


# What an all-zero tensor usually means, by kind.
_ZERO_MEANING = {
    "grad": "no gradient reaches it: the parameter is not used in the loss, sits behind a "
    "detached branch or behind dead units",
    "param": "a layer of zeros passes nothing on: check its initialisation and weight decay",
    "output": "the layer passes nothing on: dead units or a zero-initialised layer",
}


class AllZero(Rule):
    """A tensor that is all zeros (or as close to it as ``threshold``, a fraction of elements).

    Defaults: SageMaker's AllZero fires at 100 % zeros, MindInsight's "tensor all zero" at
    ``zero_percentage_ge`` 100; ``threshold`` = 1.0 is the same. ``threshold`` is a fraction
    above 0 and at most 1: at 0 every tensor would be all zeros.

    A bias that is all zeros on step 0 is not judged: zeros are its usual initialisation
    (LayerNorm's and BatchNorm's, and many a Linear's), which the first update moves; one still
    all zeros after that gets no gradient, and is reported (every zero-initialised LayerNorm
    bias was reported at attach, found trying it as a new user).

    Example: ``AllZero(threshold=0.99, kinds={"grad"})`` flags gradients that are 99 % zeros.
    """

    kinds = frozenset({"output", "param", "grad", "observed"})
    needs = (ZERO_FRAC,)

    def __init__(self, *, threshold: float = 1.0, **selection: Any):
        super().__init__(**selection)
        self.threshold = threshold

    def check_params(self) -> None:
        check_number(self, "threshold", above=0, most=1, noun="fraction")

    def check(self, t: TensorStats, state: dict[str, Any]) -> Finding | None:
        frac = t.get(ZERO_FRAC)
        if frac is None or not frac >= self.threshold:
            return None
        if t.kind == "param" and t.step == 0 and t.name.rpartition(".")[2] == "bias":
            return None  # initialised to zero: the first update moves it
        meaning = _ZERO_MEANING.get(t.kind, "check what produces it")
        return Finding(
            frac,
            self.threshold,
            f"{t.name} is {frac:.1%} zeros among {t.numel} values (threshold "
            f"{self.threshold:.1%}); {meaning}.",
        )


# TensorRange's bounds in the order they are checked and reported: threshold name, statistic
# label, comparison.
_SIMPLE_BOUNDS = (
    ("min_lt", MIN, "min", "<"),
    ("max_gt", MAX, "max", ">"),
    ("mean_lt", MEAN, "mean", "<"),
    ("mean_gt", MEAN, "mean", ">"),
    ("abs_mean_lt", ABS_MEAN, "mean |x|", "<"),
    ("abs_mean_gt", ABS_MEAN, "mean |x|", ">"),
)
_PERCENT_BOUNDS = (("range_percentage_lt", "<"), ("range_percentage_gt", ">"))
# Bounds that must not cross, and what would happen if they did: a tensor fires below the
# first bound of a pair or above the second, so with the first above the second every tensor
# would; no value lies within [range_lo, range_hi] when range_lo is above range_hi.
_EVERY = "otherwise every tensor fires"
_ORDERED = (
    ("min_lt", "max_gt", _EVERY),
    ("mean_lt", "mean_gt", _EVERY),
    ("abs_mean_lt", "abs_mean_gt", _EVERY),
    ("range_percentage_lt", "range_percentage_gt", _EVERY),
    ("range_lo", "range_hi", "otherwise no value lies within the range"),
)


class TensorRange(Rule):
    """Values outside bounds you set: min, max, mean, mean |x|, or the share within a range.

    Defaults: none, as in MindInsight's "tensor too large / too small" and "activation range"
    conditions, whose parameters these are; each set bound is checked on its own and the message
    lists every one that fired. ``range_percentage_lt``/``_gt`` are percentages (0-100) of the
    elements within [``range_lo``, ``range_hi``]; leave one end None for an open range.

    Each bound is a finite number or None; ``abs_mean_lt`` is positive and ``abs_mean_gt`` 0 or
    more (mean |x| is never below 0), ``range_percentage_lt`` above 0 and at most 100,
    ``range_percentage_gt`` 0 or more and below 100, ``range_lo`` at most ``range_hi``. A
    ``_lt`` bound above its ``_gt`` (``min_lt`` above ``max_gt``) is refused: every tensor
    would fire.

    A tensor holding NaN has no min, max or mean to compare (NaN, as numpy's, is the NaN
    rule's to report); an Inf is its own bound (a max of +Inf is above any ``max_gt``). The UI's
    statistics are over the finite elements: a ``max_gt`` of 0.5 does not fire on a tensor
    whose finite max is 0.62 but which holds a NaN.

    Example: MindInsight's tanh saturation preset is
    ``TensorRange(range_lo=math.tanh(-8.8), range_hi=math.tanh(8.8), range_percentage_lt=0.1)``.
    """

    kinds = VALUE_KINDS
    propagates = True

    def __init__(
        self,
        *,
        min_lt: float | None = None,
        max_gt: float | None = None,
        mean_lt: float | None = None,
        mean_gt: float | None = None,
        abs_mean_lt: float | None = None,
        abs_mean_gt: float | None = None,
        range_lo: float | None = None,
        range_hi: float | None = None,
        range_percentage_lt: float | None = None,
        range_percentage_gt: float | None = None,
        **selection: Any,
    ):
        super().__init__(**selection)
        self.min_lt = min_lt
        self.max_gt = max_gt
        self.mean_lt = mean_lt
        self.mean_gt = mean_gt
        self.abs_mean_lt = abs_mean_lt
        self.abs_mean_gt = abs_mean_gt
        self.range_lo = range_lo
        self.range_hi = range_hi
        self.range_percentage_lt = range_percentage_lt
        self.range_percentage_gt = range_percentage_gt

    def check_params(self) -> None:
        for name in ("min_lt", "max_gt", "mean_lt", "mean_gt", "range_lo", "range_hi"):
            check_number(self, name, none=True)
        check_number(self, "abs_mean_lt", above=0, none=True)
        check_number(self, "abs_mean_gt", least=0, none=True)
        percent = {"noun": "percentage", "none": True}
        check_number(self, "range_percentage_lt", above=0, most=100, **percent)
        check_number(self, "range_percentage_gt", least=0, below=100, **percent)
        for lower, upper, why in _ORDERED:
            low, high = getattr(self, lower), getattr(self, upper)
            if low is not None and high is not None and low > high:
                raise refusal(self, lower, f"at most {upper} ({high!r})", why)
        self._require_a_bound()

    def _require_a_bound(self) -> None:
        """Refuse a TensorRange that could never fire, or whose range has no percentage bound."""
        simple = [key for key, _, _, _ in _SIMPLE_BOUNDS]
        percent = [key for key, _ in _PERCENT_BOUNDS]
        has_percent = any(getattr(self, k) is not None for k in percent)
        has_range = self.range_lo is not None or self.range_hi is not None
        if has_percent and not has_range:
            raise ValueError(
                "TensorRange: range_percentage_lt/_gt need range_lo and/or range_hi, the range "
                "whose share of values they bound"
            )
        if has_range and not has_percent:
            raise ValueError(
                "TensorRange: range_lo/range_hi need range_percentage_lt or range_percentage_gt, "
                "the share of values within the range that should fire"
            )
        if not has_percent and all(getattr(self, k) is None for k in simple):
            raise ValueError(
                "TensorRange needs at least one bound, e.g. TensorRange(max_gt=1e4); choose "
                f"among {', '.join(simple + percent)}"
            )

    def _range(self) -> Stat | None:
        if self.range_percentage_lt is None and self.range_percentage_gt is None:
            return None
        lo = -math.inf if self.range_lo is None else self.range_lo
        hi = math.inf if self.range_hi is None else self.range_hi
        return in_range_frac(lo, hi)

    def stats_for(self, t: TensorStats) -> tuple[Stat, ...]:
        wanted = [stat for key, stat, _, _ in _SIMPLE_BOUNDS if getattr(self, key) is not None]
        in_range = self._range()
        if in_range is not None:
            wanted.append(in_range)
        return tuple(dict.fromkeys(wanted))

    def check(self, t: TensorStats, state: dict[str, Any]) -> Finding | None:
        fired: list[tuple[float, float, str]] = []
        for key, stat, label, op in _SIMPLE_BOUNDS:
            bound, value = getattr(self, key), t.get(stat)
            if bound is not None and value is not None and _crosses(value, op, bound):
                shown, limit = apart(value, bound)
                fired.append((value, bound, f"{label} {shown} {op} {limit}"))
        in_range = self._range()
        frac = t.get(in_range) if in_range is not None else None
        if frac is not None:
            lo, hi = in_range.params
            for key, op in _PERCENT_BOUNDS:
                bound = getattr(self, key)
                if bound is not None and _crosses(100 * frac, op, bound):
                    fired.append(
                        (
                            100 * frac,
                            bound,
                            f"{100 * frac:.3g}% of values within [{lo:.3g}, {hi:.3g}] {op} "
                            f"{bound:.3g}%",
                        )
                    )
        if not fired:
            return None
        value, bound, _ = fired[0]
        return Finding(
            value,
            bound,
            f"{t.name} is outside the bounds set for it: {', '.join(f[2] for f in fired)}.",
            "Look at what feeds it (unnormalised inputs, a drifting layer, a learning rate too "
            "high).",
        )


def _crosses(value: float, op: str, bound: float) -> bool:
    return value < bound if op == "<" else value > bound
