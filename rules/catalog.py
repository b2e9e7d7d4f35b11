"""The catalogue of rules: the built-in ones, the defaults, and those installed by other
packages through the ``tensordbg.rules`` entry-point group."""

from __future__ import annotations

import warnings
from importlib.metadata import entry_points
from typing import Any

from tensordbg.rules.activations import DeadActivation, SaturatedActivation
from tensordbg.rules.base import ENTRY_POINT_GROUP, Rule, keywords_of
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


def unknown_rule(name: str) -> str:
    """What to say of a rule name that names no rule: the rules there are."""
    return f"no rule named {name!r}; the rules are: {', '.join(sorted(available_rules()))}"


def rule_from_spec(spec: str) -> Rule:
    """``"TensorRange(match='*.attn.*', max_gt=1e4)"`` as a rule: the name and its keyword
    arguments are read with ``ast`` as literals; nothing is evaluated. ValueError says what is
    wrong with it in one sentence."""
    import ast

    try:
        call = ast.parse(spec.strip(), mode="eval").body
    except SyntaxError:
        call = None
    if isinstance(call, ast.Name):
        call = ast.Call(func=call, args=[], keywords=[])
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and not call.args):
        raise ValueError('write it as Name(key=value, ...), e.g. "TensorRange(max_gt=1e4)"')
    kwargs = {}
    for keyword in call.keywords:
        try:
            kwargs[keyword.arg] = ast.literal_eval(keyword.value)
        except (ValueError, SyntaxError):
            raise ValueError(f"{keyword.arg}= takes a plain value (a number, a string, a list or "
                             "tuple of them)") from None  # fmt: skip
    return make_rule(call.func.id, kwargs)


def make_rule(name: str, kwargs: dict[str, Any]) -> Rule:
    """Rule ``name`` made with ``kwargs``, each one a keyword it takes (``--rule``, the UI's Add
    rule). ValueError says in one sentence what is wrong: no such rule, a keyword it does not
    take (and those it does), a value it refuses."""
    cls = available_rules().get(name)
    if cls is None:
        raise ValueError(unknown_rule(name))
    named = keywords_of(cls)
    for key in kwargs:
        if key not in named:
            raise ValueError(f"{cls.__name__} has no {key}=; it takes {', '.join(named)}")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        raise ValueError(str(e)) from None


def with_given(named: list[Rule], given: list[Rule]) -> list[Rule]:
    """The rules of ``--rules`` (``named``) with those of ``--rule`` (``given``, each with its
    arguments). A given rule takes the place of the named rules of its class, so that the
    default ExplodingGradient with another ``max_norm`` judges each gradient once, with that
    bound, not beside the default's; several given rules of one class all apply (TensorRange
    on different names)."""
    classes = {type(rule) for rule in given}
    rules: list[Rule] = []
    for rule in named:
        kind = type(rule)
        if kind not in classes:
            rules.append(rule)
        elif not any(type(r) is kind for r in rules):
            rules.extend(r for r in given if type(r) is kind)
    placed = {type(rule) for rule in rules}
    return rules + [rule for rule in given if type(rule) not in placed]
