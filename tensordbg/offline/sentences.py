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
