"""Rules on activation outputs: dead units and saturated units."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, ClassVar

from tensordbg.rules.base import Finding, Rule, _matches, check_number, refusal
from tensordbg.statistics import Stat, TensorStats, dead_unit_frac


def _unit_dim(t: TensorStats) -> int:
    # NCHW / NCDHW convolution maps have their units (channels) on dim 1; everything else
    # (Linear outputs, transformer hidden states) on the last one. A Conv1d map (N, C, L) is
    # 3-D as a sequence's (N, T, D) is, and is judged along its last dim: not per channel.
    return 1 if len(t.shape) in (4, 5) else -1


class _UnitActivity(Rule):
    """What DeadActivation and SaturatedActivation share: a unit (a channel of a conv map, a
    feature otherwise) is inactive when it is live in under ``inactivity_threshold`` of its
    values, and the layer is reported when more than ``layer_threshold`` of its units are. A
    tensor that holds NaN or Inf is left to the NaN and Overflow rules."""

    kinds = frozenset({"output"})
    # For the message: what an inactive unit is called, what being live means, what to do.
    inactive: ClassVar[str]
    live: ClassVar[str]
    advice: ClassVar[str]

    def __init__(
        self,
        module_types: Iterable[str],
        inactivity_threshold: float,
        layer_threshold: float,
        /,
        **selection: Any,
    ):
        super().__init__(**selection)
        # "GELU" is one type, not four letters; what is not a collection is refused below.
        if isinstance(module_types, str):
            module_types = (module_types,)
        elif isinstance(module_types, (list, tuple, set, frozenset)):
            module_types = tuple(module_types)
        self.module_types = module_types
        self.inactivity_threshold = inactivity_threshold
        self.layer_threshold = layer_threshold

    def check_params(self) -> None:
        types = self.module_types
        if not (isinstance(types, tuple) and all(isinstance(m, str) for m in types)):
            raise refusal(self, "module_types", "names of module types, e.g. ('ReLU', 'GELU')")
        check_number(self, "inactivity_threshold", above=0, most=1, noun="fraction")
        check_number(self, "layer_threshold", least=0, below=1, noun="fraction")

    def _live_range(self, t: TensorStats) -> tuple[float, float] | None:
        """The open range (lo, hi) of live values of ``t``; None when it is not known."""
        raise NotImplementedError

    def watches(self) -> str:
        """What a tensor the rule judges is, in words, as ``tensordbg check`` says it of a dump
        that holds none: "the output of a Tanh or Sigmoid module"."""
        types = list(self.module_types)
        named = ", ".join(types[:-1]) + " or " * (len(types) > 1) + "".join(types[-1:])
        what = f"the output of a {named} module"
        if self.match != ("*",):
            what = f"{what}, named {' or '.join(self.match)}"
        return what

    def _stat(self, t: TensorStats) -> Stat | None:
        live = self._live_range(t)
        if live is None:
            return None
        return dead_unit_frac(*live, _unit_dim(t), self.inactivity_threshold)

    def stats_for(self, t: TensorStats) -> tuple[Stat, ...]:
        stat = self._stat(t)
        return () if stat is None else (stat,)

    def check(self, t: TensorStats, state: dict[str, Any]) -> Finding | None:
        # A NaN is never live, so a NaN layer would look all dead (or saturated): the NaN and
        # Overflow rules say what it holds, this one only what finite values do.
        if t.nonfinite:
            return None
        stat = self._stat(t)
        frac = t.get(stat) if stat is not None else None
        if frac is None or not frac > self.layer_threshold:
            return None
        return Finding(
            frac,
            self.layer_threshold,
            f"{t.name} ({t.module_type or 'activation'}) has {frac:.0%} {self.inactive} units, "
            f"{self.live} in under {self.inactivity_threshold:.0%} of their values (threshold "
            f"{self.layer_threshold:.0%}).",
            self.advice[0].upper() + self.advice[1:],  # shown once where several layers are
        )


_RELU_LIKE = ("ReLU", "ReLU6", "GELU", "SiLU", "ELU", "CELU", "SELU", "Mish")


class DeadActivation(_UnitActivity):
    """Activation layers most of whose units never fire (dead ReLUs and their relatives).

    Defaults: SageMaker's DeadRelu. A unit (a channel of a conv map, a feature otherwise) is dead
    when it is positive in under ``inactivity_threshold`` = 1 % of its values; the layer is
    reported when more than ``layer_threshold`` = 50 % of its units are dead. Outputs of the
    ``module_types`` are judged, and any tensor named by an explicit ``match`` pattern; one
    that holds NaN or Inf is not (a NaN is never positive: the NaN rule says what it holds).

    ``module_types`` are names of module types (a single name is one type);
    ``inactivity_threshold`` is a fraction above 0 (at 0 no unit is ever dead) and at most 1,
    ``layer_threshold`` a fraction of 0 or more and below 1 (at 1 no layer ever fires).

    Example: ``DeadActivation(match="*.act.output")`` judges custom activations by name.
    """

    inactive = "dead"
    live = "positive"
    advice = (
        "dead units pass no gradient and stop learning: lower the learning rate, check the "
        "initialisation and biases, or use a leaky activation."
    )

    def __init__(
        self,
        *,
        module_types: tuple[str, ...] = _RELU_LIKE,
        inactivity_threshold: float = 0.01,
        layer_threshold: float = 0.5,
        **selection: Any,
    ):
        super().__init__(module_types, inactivity_threshold, layer_threshold, **selection)

    def applies(self, t: TensorStats) -> bool:
        if not super().applies(t):
            return False
        named = any(p != "*" and _matches(t, p) for p in self.match)
        return named or t.module_type in self.module_types

    def _live_range(self, t: TensorStats) -> tuple[float, float]:
        return (0.0, math.inf)

    def watches(self) -> str:
        # A name it is given judges that output whatever its module's type (see applies).
        if any(p != "*" for p in self.match):
            return f"a module's output named {' or '.join(p for p in self.match if p != '*')}"
        return super().watches()


# SageMaker's saturation bounds are on the pre-activation; the live range of the output is their
# image, computed in float64: a unit is live when lo < output < hi.
_LIVE_OUTPUT = {
    "Tanh": (math.tanh(-9.4999), math.tanh(9.4999)),
    "Sigmoid": (1 / (1 + math.exp(23.0)), 1 / (1 + math.exp(-16.99999))),
}


class SaturatedActivation(_UnitActivity):
    """Tanh and Sigmoid layers most of whose units are stuck at the flat ends of the curve.

    Defaults: SageMaker's SaturatedActivation, whose bounds are on the input (tanh beyond
    ±9.4999, sigmoid below -23 or above 16.99999); this rule sees the output, so the bounds are
    carried through the function (tanh(9.4999) = 1 - 1.1e-8). A unit is saturated when it is
    inside them in under ``inactivity_threshold`` = 1 % of its values; the layer is reported when
    more than ``layer_threshold`` = 50 % of its units are saturated.

    ``module_types`` names Tanh, Sigmoid or both; the two thresholds take the values
    DeadActivation's take: ``inactivity_threshold`` a fraction above 0 and at most 1,
    ``layer_threshold`` a fraction of 0 or more and below 1.

    Example: ``SaturatedActivation(module_types=("Sigmoid",))`` watches sigmoid gates only.
    """

    inactive = "saturated"
    live = "off the flat ends of the curve"
    advice = (
        "saturated units pass almost no gradient: normalise the layer's input, lower the "
        "learning rate, or check the initialisation."
    )

    def __init__(
        self,
        *,
        module_types: tuple[str, ...] = ("Tanh", "Sigmoid"),
        inactivity_threshold: float = 0.01,
        layer_threshold: float = 0.5,
        **selection: Any,
    ):
        super().__init__(module_types, inactivity_threshold, layer_threshold, **selection)

    def check_params(self) -> None:
        super().check_params()
        unknown = set(self.module_types) - set(_LIVE_OUTPUT)
        if unknown:
            raise ValueError(
                f"SaturatedActivation knows the saturation bounds of {', '.join(_LIVE_OUTPUT)} "
                f"only, not of {', '.join(sorted(unknown))}; use TensorRange with "
                "range_lo/range_hi and range_percentage_lt for other activations"
            )
        if not self.module_types:
            raise refusal(self, "module_types", "'Tanh', 'Sigmoid' or both")

    def applies(self, t: TensorStats) -> bool:
        return super().applies(t) and t.module_type in self.module_types

    def _live_range(self, t: TensorStats) -> tuple[float, float] | None:
        return _LIVE_OUTPUT.get(t.module_type)
