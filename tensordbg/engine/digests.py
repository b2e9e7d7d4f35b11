"""What tells cheaply that a step changed a parameter (part of :mod:`.params`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class Digest:
    """What tells cheaply that a step changed a parameter: its range (minimum, maximum), or its
    norm (float32 and float64 parameters: one pass over all of them). A digest that moved by more
    than the tolerance proves that an element did: an element moves by at most
    ``atol + rtol * |x|`` unless it changed, so the range by at most that much, and the norm by
    at most ``atol * sqrt(n) + rtol * norm`` (the triangle inequality)."""

    kind: str
    values: tuple[float | None, ...] | np.ndarray  # a sample: a view of its step's (on the host)
    numel: int = 1

    @classmethod
    def of_range(cls, lo: float | None, hi: float | None) -> Digest:
        return cls("range", (lo, hi))

    @classmethod
    def of_norm(cls, norm: float, numel: int) -> Digest:
        return cls("norm", (norm,), numel)

    @classmethod
    def of_sample(cls, values: tuple[float, ...]) -> Digest:
        """The values of ``SAMPLE`` fixed elements (:func:`sample_of`): one that moved by more
        than the tolerance proves the change."""
        return cls("sample", values, len(values))

    @property
    def complete(self) -> bool:
        return self.kind == "sample" or all(v is not None for v in self.values)

    def moved_from(self, before: Digest, rtol: float, atol: float) -> bool:
        if before.kind != self.kind:
            return False
        if self.kind == "sample":  # (numpy views on the host: ParamWatch.sampled)
            a, b = np.asarray(self.values), np.asarray(before.values)
            return a.shape != b.shape or bool(samples_apart(a, b, rtol, atol).any())
        slack = atol * math.sqrt(self.numel) if self.kind == "norm" else atol
        return any(
            a is not None and b is not None and abs(a - b) > slack + rtol * abs(b)
            for a, b in zip(self.values, before.values, strict=True)
        )


def samples_apart(now: np.ndarray, before: np.ndarray, rtol: float, atol: float) -> np.ndarray:
    """Which sampled elements moved by more than ``atol + rtol * |before|`` (exactly: any
    change, with no tolerance); an element Inf in both moved nowhere."""
    if not (rtol or atol):
        return now != before
    with np.errstate(invalid="ignore", over="ignore"):
        return abs(now - before) > atol + rtol * abs(before)


def view_of(digest: Digest, samples: np.ndarray | None) -> bool:
    """Whether a sample digest holds a part of ``samples``: one step's samples, taken all at
    once (:meth:`~tensordbg.engine.params.ParamWatch.sampled`)."""
    return samples is not None and getattr(digest.values, "base", None) is samples
