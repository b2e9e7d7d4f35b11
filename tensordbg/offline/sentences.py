"""Counts and lists as the offline reports say them: ``1 step``, ``2 steps``, ``a, b and c``."""

from __future__ import annotations

from collections.abc import Sequence


def plural(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless one.

    >>> plural(1, "step"), plural(3, "tensor")
    ('1 step', '3 tensors')
    """
    return f"{n} {noun}{'s' * (n != 1)}"


def listed(items: Sequence[str]) -> str:
    """Items joined as a sentence lists them.

    >>> listed(["NaN", "Overflow", "ExplodingGradient"])
    'NaN, Overflow and ExplodingGradient'
    """
    if len(items) < 2:
        return "".join(items)
    return f"{', '.join(items[:-1])} and {items[-1]}"


def steps_listed(steps: Sequence[int], shown: int = 10) -> str:
    """Step numbers, the first ``shown`` of them, and how many more.

    >>> steps_listed([1, 3])
    '1 and 3'
    """
    if len(steps) > shown:
        return f"{', '.join(map(str, steps[:shown]))} and {len(steps) - shown} more"
    return listed([str(s) for s in steps])


def step_runs(steps: Sequence[int], dash: str = "-") -> str:
    """Sorted step numbers as runs: ``[0, 2, 3, 4, 5]`` is ``"0, 2-5"`` (the UI draws an en
    dash)."""
    runs: list[list[int]] = []
    for step in steps:
        if runs and step == runs[-1][1] + 1:
            runs[-1][1] = step
        else:
            runs.append([step, step])
    return ", ".join(str(a) if a == b else f"{a}{dash}{b}" for a, b in runs)


# What each statistic of the registry (tensordbg/statistics/registry.py) is, as a person says it.
_STAT_WORDS = {
    "finite": "whether every element is finite",
    "min": "minimum",
    "max": "maximum",
    "nan": "count of NaN",
    "posinf": "count of +Inf",
    "neginf": "count of -Inf",
    "mean": "mean",
    "abs_mean": "mean magnitude",
    "std": "standard deviation",
    "l2": "L2 norm",
    "zero_frac": "fraction of zeros",
    "update_abs_mean": "mean magnitude of the update",
    "prev_abs_mean": "mean magnitude of the parameter before the step",
    "update_unchanged": "whether the step left the parameter unchanged",
}


def stat_words(name: str) -> str:
    """A dumped statistic's name (``str(Stat)``) in words, without an article; a name the
    registry does not know, as it is.

    >>> stat_words("l2"), stat_words("dead_unit_frac(0, inf, -1, 0.01)")
    ('L2 norm', 'fraction of dead units')
    """
    head, _, rest = name.partition("(")
    params = [p.strip() for p in rest.rstrip(")").split(",")] if rest else []
    if head == "in_range_frac" and len(params) == 2:
        return f"fraction of values in [{params[0]}, {params[1]}]"
    if head == "dead_unit_frac" and len(params) == 4:
        # Live above lo (DeadActivation: a unit that is never positive is dead), or between
        # lo and hi (SaturatedActivation: a unit stuck at the flat ends is saturated).
        return "fraction of dead units" if params[1] == "inf" else "fraction of saturated units"
    return _STAT_WORDS.get(head, name)
