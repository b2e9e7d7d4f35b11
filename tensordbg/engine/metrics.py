"""Step metrics: the loss and gradient norm of each step, its speed, and the latest statistics
of every tensor (what the UI's Run and Modules tabs show)."""

from __future__ import annotations

import math
import time
from collections import deque

from tensordbg.rules.base import loss_name
from tensordbg.statistics import L2, MEAN, TensorStats

HISTORY = 512


class StepMetrics:
    """What one training step measured, and the last HISTORY steps."""

    def __init__(self) -> None:
        self.history: deque[tuple[int, float | None, float | None, float | None]] = deque(
            maxlen=HISTORY
        )
        """(step, loss, gradient norm, steps per second) of the last completed steps."""
        self.latest: dict[str, tuple[int, TensorStats]] = {}
        self.previous: dict[str, tuple[int, TensorStats]] = {}
        self._loss: list[float] = []
        self.loss_name: str | None = None
        """The observed scalar the loss curve follows: the first one named like ``loss``."""
        self._grads: dict[str, float] = {}  # each gradient's latest norm in the step
        self._last = time.perf_counter()
        self.paused = 0.0
        """Seconds the step spent paused: left out of its speed."""

    def judged(self, stats: TensorStats) -> None:
        """A tensor's statistics were judged: they are its latest; a parameter's gradient is
        one of the step's norm (its latest: with gradient accumulation each pass's record holds
        what was accumulated so far, and the step's norm is that of the last, not a sum over
        the passes, which read 1.5x the norm ``clip_grad_norm_`` gives)."""
        last = self.latest.get(stats.name)
        if last is not None and last[0] != stats.step:
            self.previous[stats.name] = last
        self.latest[stats.name] = (stats.step, stats)
        if stats.kind == "grad":
            norm = stats.values.get(L2)
            if norm is not None:
                self._grads[stats.name] = norm

    def observed(self, stats: TensorStats) -> None:
        """The first observed scalar named like ``loss`` feeds the loss curve, each of its
        values in a step (gradient accumulation) averaged; a NaN loss too, so the step's loss
        says NaN rather than being left out. Another loss (a GAN's second) is a tensor of its
        own, not averaged into it."""
        name = loss_name(stats)  # loss#1: loss
        if name is not None:
            if self.loss_name is None:
                self.loss_name = name
            value = stats.values.get(MEAN) if name == self.loss_name else None
            if value is not None:
                self._loss.append(value)

    def finish(self, step: int) -> dict[str, float | int | None]:
        """The step completed: its numbers, kept in the history."""
        now = time.perf_counter()
        dt, self._last, self.paused = now - self._last - self.paused, now, 0.0
        loss = sum(self._loss) / len(self._loss) if self._loss else None
        grads = self._grads.values()
        grad_norm = math.sqrt(sum(n * n for n in grads)) if grads else None
        rate = 1.0 / dt if dt > 0 else None
        self.history.append((step, loss, grad_norm, rate))
        self._loss = []
        self._grads = {}
        return {"step": step, "loss": loss, "grad_norm": grad_norm, "steps_per_sec": rate}

    def last(self) -> dict[str, float | int | None] | None:
        if not self.history:
            return None
        step, loss, grad_norm, rate = self.history[-1]
        return {"step": step, "loss": loss, "grad_norm": grad_norm, "steps_per_sec": rate}
