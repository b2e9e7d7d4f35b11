"""Watchpoint conditions: small classes that judge tensor statistics.

``tensordbg.rules.DEFAULT`` is what ``tensordbg.attach(rules=None)`` uses::

    [NaN(), Overflow(), ExplodingGradient(), VanishingGradient(), WeightNotChanging()]

Each rule's defaults come from the debuggers that came before (MindInsight, SageMaker Debugger);
its docstring says which. Third-party rules register through the ``tensordbg.rules`` entry-point
group (see :mod:`tensordbg.rules.base`).
"""

from tensordbg.rules.activations import DeadActivation, SaturatedActivation
from tensordbg.rules.base import Finding, Refine, Rule, check_count, check_number
from tensordbg.rules.catalog import BUILTIN, available_rules, builtin_rules, default_rules
from tensordbg.rules.distributed import RankDivergence
from tensordbg.rules.gradients import ExplodingGradient, VanishingGradient
from tensordbg.rules.loss import LossNotDecreasing
from tensordbg.rules.numeric import AllZero, NaN, Overflow, TensorRange
from tensordbg.rules.weights import PoorInitialization, WeightNotChanging, WeightUpdateRatio

DEFAULT: list[Rule] = default_rules()

__all__ = [
    "BUILTIN",
    "DEFAULT",
    "AllZero",
    "DeadActivation",
    "ExplodingGradient",
    "Finding",
    "LossNotDecreasing",
    "NaN",
    "Overflow",
    "PoorInitialization",
    "RankDivergence",
    "Refine",
    "Rule",
    "SaturatedActivation",
    "TensorRange",
    "VanishingGradient",
    "WeightNotChanging",
    "WeightUpdateRatio",
    "available_rules",
    "builtin_rules",
    "check_count",
    "check_number",
    "default_rules",
]
