"""Rules on observed training curves: a loss that goes up or stops going down."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tensordbg.rules.base import (
    Finding,
    Rule,
    check_count,
    check_number,
    first_call_name,
    loss_name,
)
from tensordbg.rules.scales import SPENT, gradients_spent
from tensordbg.statistics import MEAN, TensorStats


def note_loss(t: TensorStats, state: dict[str, Any]) -> None:
    """Note an observed loss (:func:`loss_name`, as the loss curve takes it): its step, its
    |value| and the largest |value| it had, in ``state["losses"]``."""
    name, value = loss_name(t), t.values.get(MEAN)
    if name is None or value is None or not math.isfinite(value):
        return
    losses: dict[str, tuple[int, float, float]] = state.setdefault("losses", {})
    peak = losses.get(name, (0, 0.0, 0.0))[2]
    losses[name] = (t.step, abs(value), max(peak, abs(value)))


def loss_spent(state: dict[str, Any], step: int) -> bool:
    """Whether the training has next to nothing left to teach at ``step``: every loss observed
    at that step (or the step before: a script may observe it after its backward) is 0, or at
    most :data:`SPENT` of the largest it had (an overfit batch at a loss of exactly 0, an
    autoencoder at float32's floor of 3e-15). Without an observed loss, its gradients say so:
    every one at most :data:`SPENT` of the largest any had (:func:`gradients_spent`; a model
    without biases whose every unit died looks the same: observe the loss to tell them apart).
    Its gradients are next to nothing by design then, and the weights stop moving: the
    training is done, not broken."""
    losses = state.get("losses")
    if not losses:
        return gradients_spent(state, step)
    recent = [
        value <= SPENT * peak for at, value, peak in losses.values() if step - 1 <= at <= step
    ]
    return bool(recent) and all(recent)  # a hinge term at 0 beside a loss that teaches: not done


@dataclass
class _LossCurve:
    """One loss per step: the mean of the observations made during the step."""

    step: int = 0
    total: float = 0.0
    count: int = 0
    done: list[tuple[int, float]] = field(default_factory=list)  # (step, mean), oldest first
    completed: int = 0  # steps completed so far, to know where windows end

    def add(self, step: int, value: float) -> bool:
        """Record an observation; True when it closed the previous step."""
        closed = self.count > 0 and step != self.step
        if closed:
            self.done.append((self.step, self.total / self.count))
            self.completed += 1
            self.total, self.count = 0.0, 0
        self.step = step
        self.total += value
        self.count += 1
        return closed


class LossNotDecreasing(Rule):
    """A loss whose average over the last ``num_steps`` steps went up, or did not go down enough.

    Defaults: SageMaker's LossNotDecreasing, ``num_steps`` 10, ``diff_percent`` 0.1 % and
    ``increase_threshold_percent`` 5 %. Mini-batch losses are noisy, so the rule compares whole
    windows: each step counts once (the mean of its observations, e.g. over gradient
    accumulation), and every ``num_steps`` completed steps the mean of the latest window is
    compared with the mean of the window before. A step is complete when the next one is first
    observed, so the verdict on steps 10-19 comes with step 20's loss. Non-finite losses are left
    to the NaN rule. ``num_steps`` is a whole number of 1 or more, the two percentages are
    numbers of 0 or more (with no upper bound: a negative loss can fall by more than 100 %).

    Example: ``LossNotDecreasing(num_steps=100, match="val_loss")`` watches a validation loss.
    """

    kinds = frozenset({"observed"})
    needs = (MEAN,)

    def __init__(
        self,
        *,
        num_steps: int = 10,
        diff_percent: float = 0.1,
        increase_threshold_percent: float = 5.0,
        match: str | Sequence[str] = "*loss*",
        **selection: Any,
    ):
        super().__init__(match=match, **selection)
        self.num_steps = num_steps
        self.diff_percent = diff_percent
        self.increase_threshold_percent = increase_threshold_percent

    def check_params(self) -> None:
        check_count(self, "num_steps")
        check_number(self, "diff_percent", least=0)
        check_number(self, "increase_threshold_percent", least=0)

    def check(self, t: TensorStats, state: dict[str, Any]) -> Finding | None:
        value = t.get(MEAN)
        if value is None or not math.isfinite(value):
            return None
        # One curve a loss: a step's later observations (loss#1, loss#2: micro-batches of
        # gradient accumulation) join its mean, not curves of their own.
        curve: _LossCurve = state.setdefault(first_call_name(t.name), _LossCurve())
        if not curve.add(t.step, value):
            return None
        n = self.num_steps
        del curve.done[: -2 * n]
        if curve.completed % n or len(curve.done) < 2 * n:
            return None
        before, latest = curve.done[:n], curve.done[n:]
        prev = sum(v for _, v in before) / n
        cur = sum(v for _, v in latest) / n
        if prev == 0:
            return None
        change = 100 * (cur - prev) / abs(prev)
        means = (
            f"mean {cur:.4g} over steps {latest[0][0]}-{latest[-1][0]} against {prev:.4g} over "
            f"steps {before[0][0]}-{before[-1][0]}"
        )
        if change > self.increase_threshold_percent:
            return Finding(
                change,
                self.increase_threshold_percent,
                f"{t.name} went up {change:.3g}% over the last {n} steps ({means}, threshold "
                f"{self.increase_threshold_percent:g}%); training is diverging: lower the "
                "learning rate, or look for a bad batch or a bug in the data.",
            )
        decrease = 0.0 - change  # (not -0.0)
        if decrease < self.diff_percent:
            if decrease > 0:
                what = f"decreased by only {decrease:.3g}%"
            else:
                what = f"did not decrease (it changed {change:+.3g}%)"
            return Finding(
                decrease,
                self.diff_percent,
                f"{t.name} {what} over the last {n} steps ({means}, expected at "
                f"least {self.diff_percent:g}%); training has stalled: the learning rate may be "
                "too low, or so high that the loss bounces, or the model has learned what it can.",
            )
        return None

    def undecided(self, state: dict[str, Any]) -> dict[str, str]:
        """The losses whose first two windows never completed: no window was compared."""
        n, undecided = self.num_steps, {}
        for name, curve in state.items():
            if isinstance(curve, _LossCurve) and curve.completed < 2 * n:
                seen = curve.completed + (curve.count > 0)
                undecided[name] = (
                    f"it compares the mean of {name} over {n} steps with its mean over the {n} "
                    f"before, which takes {2 * n + 1} steps of {name} (a step's verdict comes "
                    f"with the next step's loss), and it saw {seen}"
                )
        return undecided
