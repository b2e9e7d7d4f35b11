"""The catalogue of rules: the built-in ones, the defaults, and those installed by other
packages through the ``tensordbg.rules`` entry-point group."""

from __future__ import annotations

import warnings
from importlib.metadata import entry_points

from tensordbg.rules.activations import DeadActivation, SaturatedActivation
from tensordbg.rules.base import ENTRY_POINT_GROUP, Rule
from tensordbg.rules.distributed import RankDivergence
from tensordbg.rules.gradients import ExplodingGradient, VanishingGradient
from tensordbg.rules.loss import LossNotDecreasing
from tensordbg.rules.numeric import AllZero, NaN, Overflow, TensorRange
from tensordbg.rules.weights import PoorInitialization, WeightNotChanging, WeightUpdateRatio

BUILTIN = (
    "NaN",
    "Overflow",
    "ExplodingGradient",
    "VanishingGradient",
    "WeightNotChanging",
    "WeightUpdateRatio",
    "DeadActivation",
    "SaturatedActivation",
    "AllZero",
    "PoorInitialization",
    "LossNotDecreasing",
    "TensorRange",
    "RankDivergence",
)


def default_rules() -> list[Rule]:
    """Fresh instances of the default rules."""
    return [NaN(), Overflow(), ExplodingGradient(), VanishingGradient(), WeightNotChanging()]


def builtin_rules() -> dict[str, type[Rule]]:
    """The rules shipped with tensordbg, by class name."""
    return {name: _BUILTIN_CLASSES[name] for name in BUILTIN}


_BUILTIN_CLASSES: dict[str, type[Rule]] = {
    cls.__name__: cls
    for cls in (NaN, Overflow, ExplodingGradient, VanishingGradient, WeightNotChanging,
                WeightUpdateRatio, DeadActivation, SaturatedActivation, AllZero,
                PoorInitialization, LossNotDecreasing, TensorRange, RankDivergence)
}  # fmt: skip


def available_rules() -> dict[str, type[Rule]]:
    """Built-in rules plus those installed through the ``tensordbg.rules`` entry-point group.

    A plugin that fails to load is skipped with a warning; it never stops a training.
    """
    found = builtin_rules()
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            cls = ep.load()
        except Exception as e:  # a broken plugin must not break the training
            warnings.warn(f"tensordbg: rule plugin {ep.name!r} failed to load: {e}", stacklevel=2)
            continue
        if not (isinstance(cls, type) and issubclass(cls, Rule)):
            warnings.warn(
                f"tensordbg: rule plugin {ep.name!r} is not a tensordbg.rules.Rule subclass",
                stacklevel=2,
            )
            continue
        found.setdefault(ep.name, cls)
    return found
