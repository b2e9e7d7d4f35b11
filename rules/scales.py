"""The model's gradient scale, which the gradient and weight rules judge a gradient against:
each gradient's root-mean-square, the typical one among them, and what is negligible."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from tensordbg.statistics import L2, TensorStats

# VanishingGradient's defaults: SageMaker's bound on mean |grad|, and how far below the model's
# typical gradient a gradient must also be to vanish.
THRESHOLD = 1e-7
RELATIVE = 1e-5


def note_scale(t: TensorStats, state: dict[str, Any]) -> float | None:
    """Note the root-mean-square of gradient ``t``, ||g||_2 / sqrt(n), in ``state["scales"]``,
    which keeps the latest of every gradient the rule has seen (and the one of an earlier step
    before it): the model's scale. Returns it; None when the norm was not computed or is not
    finite. The root-mean-square is never below mean |g| and costs no pass of its own: the norm
    is computed for every gradient."""
    return note_scales((t,), state)[0]


def note_scales(tensors: Sequence[TensorStats], state: dict[str, Any]) -> list[float | None]:
    """:func:`note_scale` of each gradient in turn (a pass's, in one loop)."""
    had: dict[str, float] = state.setdefault("had", {})
    scales: dict[str, list[float]] = state.setdefault("scales", {})
    out: list[float | None] = []
    for t in tensors:
        l2 = t.values.get(L2)
        if l2 is None or not math.isfinite(l2):
            out.append(None)
            continue
        scale = l2 / math.sqrt(t.numel)
        if scale > 0:  # its latest nonzero scale: a gradient that stops had one (not unconnected)
            had[t.name] = scale
        noted = scales.get(t.name)
        if noted is None:
            scales[t.name] = [t.step, scale, math.nan]
        elif noted[0] == t.step:
            noted[1] = scale  # again in the same step (accumulated gradients, a refinement)
        else:
            noted[0], noted[1], noted[2] = t.step, scale, noted[1]
        out.append(scale)
    return out


def typical_scale(state: dict[str, Any], name: str, before: int | None = None) -> float | None:
    """The model's typical gradient: the median root-mean-square of the gradients other than
    ``name``, each one's latest (from a step before ``before`` when given), zeros left out; None
    before there is any."""
    others = []
    for key, (step, scale, earlier) in state.get("scales", {}).items():
        if key == name:
            continue
        value = scale if before is None or step < before else earlier
        if value > 0:  # NaN (no earlier step) is not
            others.append(value)
    return statistics.median(others) if others else None


def negligible(value: float, state: dict[str, Any], name: str) -> bool:
    """Whether gradient ``name`` of size ``value`` vanishes by VanishingGradient's defaults:
    below THRESHOLD, and below RELATIVE times the model's typical gradient once that is known
    (computed only for a gradient below THRESHOLD)."""
    if not value < THRESHOLD:
        return False
    typical = typical_scale(state, name)
    return typical is None or value < RELATIVE * typical
