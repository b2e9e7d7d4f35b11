"""The model's gradient scale, which the gradient and weight rules judge a gradient against:
each gradient's root-mean-square, the typical one among them, and what is negligible."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tensordbg.statistics import L2, TensorStats

# VanishingGradient's defaults: SageMaker's bound on mean |grad|, and how far below the model's
# typical gradient a gradient must also be to vanish.
THRESHOLD = 1e-7
RELATIVE = 1e-5

SPENT = 1e-7
"""A loss at most this share of the largest it had (or 0), or gradients at most this share of
the largest any had, have next to nothing left to teach."""


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
    top: StepScale | None = state.get("top")
    out: list[float | None] = []
    for t in tensors:
        l2 = t.values.get(L2)
        if l2 is None or not math.isfinite(l2):
            out.append(None)
            continue
        scale = l2 / math.sqrt(t.numel)
        if top is None or top.step != t.step:
            top = state["top"] = StepScale(t.step) if top is None else top.next(t.step)
        if scale > top.largest:
            top.largest = scale
        if scale > 0:  # its latest nonzero scale: a gradient that stops had one (not unconnected)
            had[t.name] = scale
        noted = scales.get(t.name)
        if noted is None:
            scales[t.name] = [t.step, scale, math.nan]
            top.noted += 1
        elif noted[0] == t.step:
            noted[1] = scale  # again in the same step (accumulated gradients, a refinement)
        else:
            noted[0], noted[1], noted[2] = t.step, scale, noted[1]
            top.noted += 1
        out.append(scale)
    return out


@dataclass(slots=True)
class StepScale:
    """``state["top"]``: the largest root-mean-square among a step's gradients so far and how
    many gradients it has noted, the same of the step before, and the largest any step had."""

    step: int
    largest: float = 0.0
    noted: int = 0
    before: float = math.inf  # no step before: it cannot say the training is done
    noted_before: int = 0
    peak: float = 0.0

    def next(self, step: int) -> StepScale:
        return StepScale(step, 0.0, 0, self.largest, self.noted, max(self.peak, self.largest))


def gradients_spent(state: dict[str, Any], step: int) -> bool:
    """Whether every gradient of ``step`` is at most ``SPENT`` of the largest any gradient
    had (none at all: a loss of exactly 0 gives nothing back): the loss has nothing left to
    teach, when no loss is observed to say so. A step judged gradient by gradient (eager) has
    not noted them all before the last: until it has as many as the step before, that step's
    must be as small too (a head whose weight gets nothing, judged before its bias, is no
    finished training)."""
    top: StepScale | None = state.get("top")
    if top is None or top.step != step:
        return False
    peak = max(top.peak, top.largest)
    if not peak > 0 or top.largest > SPENT * peak:
        return False
    return top.noted >= top.noted_before or top.before <= SPENT * peak


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


def largest_scale(state: dict[str, Any]) -> float:
    """The largest root-mean-square among the gradients of the latest step noted and of the
    step before it (a pass judged gradient by gradient has not seen all of its own yet); 0
    before any."""
    top: StepScale | None = state.get("top")
    if top is None:
        return 0.0
    return max(top.largest, top.before if math.isfinite(top.before) else 0.0)


def reference_scale(state: dict[str, Any], name: str,
                    relative: float = RELATIVE) -> tuple[float | None, bool]:  # fmt: skip
    """What gradient ``name`` is judged against, and whether it is the largest: the model's
    typical gradient (:func:`typical_scale`), unless that one vanished itself, below
    ``relative`` times the largest gradient of the step (:func:`largest_scale`): a gradient that
    vanishes on its way back through most of the model takes the median with it (a scale of
    1e-9 in the middle of an MLP left its first layers and the median at 1e-12 of the last
    layers' 0.07, and nothing was said; found trying it as a new user). Then it is the largest.
    A healthy model's median stays far above that (a BART's, 4e-4 of its largest)."""
    typical = typical_scale(state, name)
    if typical is None:
        return None, False
    largest = largest_scale(state)
    if typical < relative * largest:
        return largest, True
    return typical, False


def negligible(value: float, state: dict[str, Any], name: str) -> bool:
    """Whether gradient ``name`` of size ``value`` vanishes by VanishingGradient's defaults:
    below THRESHOLD, and below RELATIVE times the scale it is judged against once that is known
    (:func:`reference_scale`; computed only for a gradient below THRESHOLD)."""
    if not value < THRESHOLD:
        return False
    reference, _ = reference_scale(state, name)
    return reference is None or value < RELATIVE * reference
