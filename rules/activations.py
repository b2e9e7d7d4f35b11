"""Rules on activation outputs: dead units and saturated units."""

from __future__ import annotations

import math
from typing import Any

from tensordbg.rules.base import Finding, Rule, _matches
from tensordbg.stats import Stat, TensorStats, dead_unit_frac


def _unit_dim(t: TensorStats) -> int:
    # NCHW / NCDHW convolution maps have their units (channels) on dim 1; everything else
    # (Linear outputs, transformer hidden states) on the last one.
    return 1 if len(t.shape) in (4, 5) else -1


class DeadActivation(Rule):
    """Activation layers most of whose units never fire (dead ReLUs and their relatives).

    Defaults: SageMaker's DeadRelu. A unit (a channel of a conv map, a feature otherwise) is dead
    when it is positive in under ``inactivity_threshold`` = 1 % of its values; the layer is
    reported when more than ``layer_threshold`` = 50 % of its units are dead. Outputs of the
    ``module_types`` are judged, and any tensor named by an explicit ``match`` pattern.

    Example: ``DeadActivation(match="*.act.output")`` judges custom activations by name.
    """

    kinds = frozenset({"output"})

    def __init__(
        self,
        *,
        module_types: tuple[str, ...] = (
            "ReLU",
            "ReLU6",
            "GELU",
            "SiLU",
            "ELU",
            "CELU",
            "SELU",
            "Mish",
        ),
        inactivity_threshold: float = 0.01,
        layer_threshold: float = 0.5,
        **selection: Any,
    ):
        super().__init__(**selection)
        self.module_types = tuple(module_types)
        self.inactivity_threshold = inactivity_threshold
        self.layer_threshold = layer_threshold

    def applies(self, t: TensorStats) -> bool:
        if not super().applies(t):
            return False
        named = any(p != "*" and _matches(t, p) for p in self.match)
        return named or t.module_type in self.module_types

    def _stat(self, t: TensorStats) -> Stat:
        return dead_unit_frac(0, math.inf, _unit_dim(t), self.inactivity_threshold)

    def stats_for(self, t: TensorStats) -> tuple[Stat, ...]:
        return (self._stat(t),)

    def check(self, t: TensorStats, state: dict[str, Any]) -> Finding | None:
        dead = t.get(self._stat(t))
        if dead is None or not dead > self.layer_threshold:
            return None
        return Finding(
            dead,
            self.layer_threshold,
            f"{t.name} ({t.module_type or 'activation'}) has {dead:.0%} dead units, positive "
            f"in under {self.inactivity_threshold:.0%} of their values (threshold "
            f"{self.layer_threshold:.0%}); dead units pass no gradient and stop learning: lower "
            "the learning rate, check the initialisation and biases, or use a leaky activation.",
        )


# SageMaker's saturation bounds are on the pre-activation; the live range of the output is their
# image, computed in float64: a unit is live when lo < output < hi.
_LIVE_OUTPUT = {
    "Tanh": (math.tanh(-9.4999), math.tanh(9.4999)),
    "Sigmoid": (1 / (1 + math.exp(23.0)), 1 / (1 + math.exp(-16.99999))),
}


class SaturatedActivation(Rule):
    """Tanh and Sigmoid layers most of whose units are stuck at the flat ends of the curve.

    Defaults: SageMaker's SaturatedActivation, whose bounds are on the input (tanh beyond
    ±9.4999, sigmoid below -23 or above 16.99999); this rule sees the output, so the bounds are
    carried through the function (tanh(9.4999) = 1 - 1.1e-8). A unit is saturated when it is
    inside them in under ``inactivity_threshold`` = 1 % of its values; the layer is reported when
    more than ``layer_threshold`` = 50 % of its units are saturated.

    Example: ``SaturatedActivation(module_types=("Sigmoid",))`` watches sigmoid gates only.
    """

    kinds = frozenset({"output"})

    def __init__(
        self,
        *,
        module_types: tuple[str, ...] = ("Tanh", "Sigmoid"),
        inactivity_threshold: float = 0.01,
        layer_threshold: float = 0.5,
        **selection: Any,
    ):
        super().__init__(**selection)
        unknown = set(module_types) - set(_LIVE_OUTPUT)
        if unknown:
            raise ValueError(
                f"SaturatedActivation knows the saturation bounds of {', '.join(_LIVE_OUTPUT)} "
                f"only, not of {', '.join(sorted(unknown))}; use TensorRange with "
                "range_lo/range_hi and range_percentage_lt for other activations"
            )
        self.module_types = tuple(module_types)
        self.inactivity_threshold = inactivity_threshold
        self.layer_threshold = layer_threshold

    def applies(self, t: TensorStats) -> bool:
        return (
            super().applies(t)
            and t.module_type in self.module_types
            and t.module_type in _LIVE_OUTPUT
        )

    def _stat(self, t: TensorStats) -> Stat | None:
        if t.module_type not in _LIVE_OUTPUT:
            return None
        lo, hi = _LIVE_OUTPUT[t.module_type]
        return dead_unit_frac(lo, hi, _unit_dim(t), self.inactivity_threshold)

    def stats_for(self, t: TensorStats) -> tuple[Stat, ...]:
        stat = self._stat(t)
        return () if stat is None else (stat,)

    def check(self, t: TensorStats, state: dict[str, Any]) -> Finding | None:
        stat = self._stat(t)
        saturated = t.get(stat) if stat is not None else None
        if saturated is None or not saturated > self.layer_threshold:
            return None
        return Finding(
            saturated,
            self.layer_threshold,
            f"{t.name} ({t.module_type}) has {saturated:.0%} saturated units, off the flat ends "
            f"of the curve in under {self.inactivity_threshold:.0%} of their values (threshold "
            f"{self.layer_threshold:.0%}); saturated units pass almost no gradient: normalise "
            "the layer's input, lower the learning rate, or check the initialisation.",
        )
