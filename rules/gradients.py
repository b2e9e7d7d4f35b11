"""Rules on parameter gradients: exploding and vanishing."""

from __future__ import annotations

import math
import statistics
from typing import Any

from tensordbg.rules.base import Finding, Refine, Rule, nonfinite_count
from tensordbg.statistics import ABS_MEAN, FINITE, L2, MAX, MIN, NAN, NEGINF, POSINF, TensorStats


class ExplodingGradient(Rule):
    """A parameter's gradient that is non-finite, huge, or growing fast against its own history.

    Defaults: MindInsight's "gradient exploding" and SageMaker's ExplodingTensor fire on NaN/Inf
    only, which is when it is already too late. tensordbg also fires when the gradient norm
    passes ``max_norm`` (1e6), or, once ``warmup`` (10) norms of that gradient have been seen,
    when it is ``growth`` (20) times the median of its last ``window`` (50) finite norms: a norm
    growing x1.5 per step from 1 is caught near 300, long before float32 overflows.

    Example: ``ExplodingGradient(growth=10.0, match="decoder.*")`` is stricter on the decoder.
    """

    kinds = frozenset({"grad"})
    needs = (FINITE, L2)

    def __init__(
        self,
        *,
        max_norm: float = 1e6,
        growth: float = 20.0,
        window: int = 50,
        warmup: int = 10,
        **selection: Any,
    ):
        super().__init__(**selection)
        self.max_norm = max_norm
        self.growth = growth
        self.window = window
        self.warmup = warmup

    def check(self, t: TensorStats, state: dict[str, Any]) -> Finding | None:
        if t.nonfinite:
            count, nonfinite = nonfinite_count(t, (NAN, POSINF, NEGINF), "NaN/Inf values")
            return Finding(
                count,
                None,
                f"{t.name} holds {nonfinite} among {t.numel}; the gradient "
                "overflowed: lower the learning rate, clip gradients, or with float16 use a "
                "GradScaler.",
            )
        norm = t.get(L2)
        if norm is None:
            return None
        if not math.isfinite(norm):
            # Finite elements whose squares overflowed the norm: as explosive as it gets.
            return self._too_large(t, norm)
        history: list[float] = state.setdefault(t.name, [])
        seen = len(history)
        median = statistics.median(history) if seen >= self.warmup else None
        history.append(norm)
        del history[: -self.window]
        if norm > self.max_norm:
            return self._too_large(t, norm)
        # Over a median of zero (a gradient that was exactly zero so far) growth means nothing.
        if median is None or median <= 0 or not norm > self.growth * median:
            return None
        ratio = norm / median
        return Finding(
            ratio,
            self.growth,
            f"{t.name} has norm {norm:.3g}, {ratio:.3g}x its running median {median:.3g} over "
            f"the last {seen} steps (threshold {self.growth:g}x); gradients are "
            "exploding: lower the learning rate or clip gradients.",
        )

    def _too_large(self, t: TensorStats, norm: float) -> Finding:
        return Finding(
            norm,
            self.max_norm,
            f"{t.name} has norm {norm:.3g}, above {self.max_norm:.3g}; gradients are exploding: "
            "lower the learning rate or clip gradients (torch.nn.utils.clip_grad_norm_).",
        )


class VanishingGradient(Rule):
    """A trainable parameter whose gradient is so small that the parameter barely learns.

    Defaults: SageMaker's VanishingGradient fires when mean |grad| < ``threshold`` = 1e-7
    (MindInsight recommended 1e-9 for the same statistic). Exactly zero gradients count: the
    parameter receives nothing. Frozen parameters are never judged. Some parameters get a zero
    gradient by construction, such as the bias of an attention key projection (BERT's
    ``attention.self.key.bias``): softmax ignores a shift shared by all keys.

    Example: ``VanishingGradient(threshold=1e-9)`` uses MindInsight's stricter bound.
    """

    kinds = frozenset({"grad"})
    # Screened with bounds from cheap statistics; mean |grad| is computed only near the
    # threshold (see check).
    needs = (L2,)

    def __init__(self, *, threshold: float = 1e-7, **selection: Any):
        super().__init__(**selection)
        self.threshold = threshold

    def check(self, t: TensorStats, state: dict[str, Any]) -> Finding | Refine | None:
        if not t.trainable:
            return None
        mean = t.get(ABS_MEAN)
        if mean is None:
            # Lower bounds on mean|g| from cheaper statistics, each decisive for most gradients:
            # sum|g| >= ||g||_2 gives mean|g| >= L2 / n (no extra pass); Hölder, sum g^2 <=
            # max|g| * sum|g|, gives mean|g| >= L2^2 / (n * max|g|), within a few times of the
            # truth. Only a gradient near the threshold pays a pass for the exact mean.
            l2, n = t.get(L2), t.numel
            if l2 is not None and math.isfinite(l2) and l2 / n >= self.threshold:
                return None
            peak = t.abs_max
            if peak is None:
                return Refine((MIN, MAX))
            if (
                l2 is not None
                and peak > 0
                and math.isfinite(l2)
                and l2 * l2 / (n * peak) >= self.threshold
            ):
                return None
            return Refine((ABS_MEAN,))
        if not mean < self.threshold:
            return None
        if mean == 0:
            message = (
                f"{t.name} receives no gradient at all (mean |grad| 0, threshold "
                f"{self.threshold:.3g}); the parameter is not connected to the loss, or sits "
                "behind dead units or a detached branch. A few get zero by construction (an "
                "attention key bias: softmax ignores a shift shared by all keys); leave those "
                "out with VanishingGradient(exclude='*key.bias')."
            )
        else:
            message = (
                f"{t.name} has mean |grad| {mean:.3g}, below {self.threshold:.3g}; the gradient "
                "vanishes on its way back: look for saturated activations upstream, add "
                "normalisation or residual connections, or check the initialisation."
            )
        return Finding(mean, self.threshold, message)
