"""The rule interface: what a watchpoint condition is, and how third-party rules are found.

A rule is a small object that judges statistics, never tensors. It says which tensors it applies to
(``kinds``, ``match``, ``exclude``), which statistics it needs (``needs`` or :meth:`Rule.stats_for`)
and decides (:meth:`Rule.check`). The engine computes only the statistics the active rules need,
on the training device, and calls ``check`` with a :class:`~TensorStats`; offline,
the same rule runs on statistics computed by numpy.

Writing a rule takes a subclass::

    from tensordbg.rules import Finding, Rule, check_number
    from tensordbg.statistics import MAX, MIN

    class LargeActivation(Rule):
        '''An activation whose magnitude passes ``limit``.'''
        kinds = frozenset({"output"})
        needs = (MIN, MAX)

        def __init__(self, limit: float = 1e4, **selection):
            super().__init__(**selection)
            self.limit = limit

        def check_params(self):
            check_number(self, "limit", above=0)  # ValueError: "LargeActivation: limit must ..."

        def check(self, t, state):
            peak = t.abs_max
            if peak is not None and peak > self.limit:
                return Finding(peak, self.limit, f"{t.name} reaches {peak:.3g}.")
            return None

and, for others to install it, an entry point in the ``tensordbg.rules`` group::

    [project.entry-points."tensordbg.rules"]
    LargeActivation = "mypackage.rules:LargeActivation"
"""

from __future__ import annotations

import functools
import inspect
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from numbers import Integral, Real
from typing import Any, ClassVar

from tensordbg.statistics import KINDS, Stat, TensorStats

ENTRY_POINT_GROUP = "tensordbg.rules"
# Constructor arguments every rule has; the rest are its thresholds, listed by Rule.params().
SELECTION_ARGS = ("match", "exclude", "kinds")


@dataclass(frozen=True, slots=True)
class Refine:
    """What :meth:`Rule.check` returns when cheap statistics cannot decide: the engine computes
    ``stats`` for the same tensor (while it still has it) and calls ``check`` again (up to three
    times in a row). It
    lets a rule screen every tensor with a bound and pay for the exact statistic only near its
    threshold. Without the tensor at hand (batched mode, not kept), there is no verdict."""

    stats: tuple[Stat, ...]


@dataclass(frozen=True, slots=True)
class Finding:
    """A rule's verdict on one tensor: the measured value, the threshold it crossed, one
    sentence for a person (what, where, how much) and the ``advice`` (what it usually means,
    what to do). For a condition that flows downstream (``Rule.propagates``, NaN and Inf) the
    engine gives the advice only where the condition arose; a tensor that merely passed it on
    names that place instead.

    >>> Finding(3.0, None, "x holds 3 NaN among 8 values.", "A NaN comes from 0/0.").advised
    'x holds 3 NaN among 8 values. A NaN comes from 0/0.'
    """

    value: float
    threshold: float | None
    message: str
    advice: str = ""

    @property
    def advised(self) -> str:
        """The message followed by the advice: what a person reads where the condition arose."""
        return f"{self.message} {self.advice}" if self.advice else self.message


class Rule:
    """Base class of every watchpoint condition. See the module docstring for an example.

    Class attributes a subclass sets:

    - ``kinds``: tensor kinds the rule looks at (``tensordbg.statistics.KINDS``).
    - ``needs``: statistics it needs for every tensor; override :meth:`stats_for` when they depend
      on the tensor (its shape, its module type).
    - ``propagates``: True when the condition flows downstream with the value (NaN, Inf). The engine
      then names as origin only the module that produced it, not every module that passed it on.

    Constructor arguments other than ``match``, ``exclude`` and ``kinds`` are the rule's
    thresholds: store each under its own name, so :meth:`params` lists them and a person can edit
    them from the UI. :meth:`check_params` refuses the values the rule cannot judge with, once
    the constructor has returned and after every :meth:`set_params`.
    """

    kinds: ClassVar[frozenset[str]] = frozenset(KINDS)
    needs: ClassVar[tuple[Stat, ...]] = ()
    propagates: ClassVar[bool] = False

    def __init__(
        self,
        *,
        match: str | Sequence[str] = "*",
        exclude: str | Sequence[str] = (),
        kinds: Iterable[str] | None = None,
        **unknown: Any,
    ):
        if unknown:  # a mistyped threshold a subclass handed on: named as the rule's own
            raise TypeError(f"{type(self).__name__} has no {next(iter(unknown))}=; it takes "
                            f"{', '.join(keywords_of(type(self)))}")  # fmt: skip
        self.match = (match,) if isinstance(match, str) else tuple(match)
        self.exclude = (exclude,) if isinstance(exclude, str) else tuple(exclude)
        if kinds is not None:
            unknown = set(kinds) - set(KINDS)
            if unknown:
                raise ValueError(
                    f"{type(self).__name__}: unknown tensor kinds {sorted(unknown)}; "
                    f"choose among {', '.join(KINDS)}"
                )
            self.kinds = frozenset(kinds)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # Thresholds are checked once the outermost constructor has set them all: a subclass
        # that calls super().__init__() and then sets its own is checked after those.
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is None:
            return

        @functools.wraps(init)
        def checked(self: Rule, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            if type(self).__init__ is checked:
                self.check_params()

        cls.__init__ = checked  # type: ignore[method-assign]

    @property
    def name(self) -> str:
        return type(self).__name__

    # --- which tensors -------------------------------------------------------------------------

    def applies(self, t: TensorStats) -> bool:
        """Whether the rule looks at ``t`` (its kind, and its name or module against the patterns).

        Called once per tensor identity, not per step: the engine caches the answer.
        """
        if t.kind not in self.kinds:
            return False
        if not any(_matches(t, p) for p in self.match):
            return False
        return not any(_matches(t, p) for p in self.exclude)

    def stats_for(self, t: TensorStats) -> tuple[Stat, ...]:
        """Statistics needed to judge ``t``; by default the class's ``needs``."""
        return self.needs

    def silent_when_finite(self, t: TensorStats) -> bool:
        """Whether this rule never fires on ``t`` while all its elements are finite. A session in
        deferred mode then leaves such tensors unscreened until the phase shows a NaN or Inf.
        The safe default is False; say True only for conditions about NaN and Inf."""
        return False

    # --- judging ---------------------------------------------------------------------------------

    def check(self, t: TensorStats, state: dict[str, Any]) -> Finding | Refine | None:
        """Judge one tensor. ``state`` is this rule's memory across steps within one session (a
        plain dict the rule may use freely, e.g. a running median per tensor name). Return
        :class:`Refine` to ask for more statistics of this tensor before deciding (and leave
        ``state`` alone when doing so: ``check`` is called again)."""
        raise NotImplementedError

    def check_many(
        self, tensors: Sequence[TensorStats], state: dict[str, Any]
    ) -> list[Finding | Refine | None]:
        """Judge several tensors as :meth:`check` judges them one after another, in execution
        order: one verdict per tensor. The engine gives a clean pass's parameter gradients to
        each rule together. Override it only to reach the same verdicts faster."""
        return [self.check(t, state) for t in tensors]

    def check_phase(
        self, tensors: Sequence[TensorStats], state: dict[str, Any]
    ) -> list[tuple[TensorStats, Finding]]:
        """Judge all tensors of one phase the rule applies to, in execution order. Override it for
        a rule that compares tensors with each other; by default it calls :meth:`check` on each."""
        found = []
        for t in tensors:
            finding = self.check(t, state)
            if isinstance(finding, Finding):
                found.append((t, finding))
        return found

    def undecided(self, state: dict[str, Any]) -> dict[str, str]:
        """The tensors this rule was given but could reach no verdict on, by name, each with
        why (a clause that follows "could not judge them: "), as its memory ``state`` stands
        after the last of them: a rule that compares windows of steps and saw fewer steps than
        it compares. ``tensordbg check`` does not count them as judged. By default none: a rule
        that judges each tensor as it comes judged every one it was given."""
        return {}

    # --- thresholds ------------------------------------------------------------------------------

    def params(self) -> dict[str, Any]:
        """The rule's thresholds by name, e.g. ``{"threshold": 1e-07}``."""
        return {n: getattr(self, n) for n in _thresholds(type(self)) if hasattr(self, n)}

    def set_params(self, **values: Any) -> None:
        """Change thresholds, keeping each one's type; unknown names are an error, and so are
        values :meth:`check_params` refuses: the rule then keeps every old value."""
        current = self.params()
        for key in values:
            if key not in current:
                raise ValueError(
                    f"{self.name} has no threshold {key!r}; it has {', '.join(current) or 'none'}"
                )
        optional = [n for n, p in _thresholds(type(self)).items() if p.default is None]
        try:
            for key, value in values.items():
                if not (value is None and key in optional):  # a bound cleared
                    value = _coerce(self.name, key, current[key], value)
                setattr(self, key, value)
            self.check_params()
        except Exception:
            for key in values:
                setattr(self, key, current[key])
            raise

    def check_params(self) -> None:
        """Raise ValueError, one sentence naming the threshold, the value and what it must be,
        when a threshold is one the rule cannot judge with (see :func:`check_number` and
        :func:`check_count`). Called once the constructor has returned and after every
        :meth:`set_params`; by default every value is accepted."""

    def describe(self) -> str:
        """The first paragraph of the rule's docstring, on one line: :func:`summary_of`."""
        return summary_of(type(self))

    def __repr__(self) -> str:
        args = [f"{k}={v!r}" for k, v in self.params().items()]
        if self.match != ("*",):
            args.append(f"match={self.match!r}")
        if self.exclude:
            args.append(f"exclude={self.exclude!r}")
        return f"{self.name}({', '.join(args)})"


def summary_of(cls: type[Rule]) -> str:
    """The first paragraph of a rule's docstring, on one line (its first line alone stopped
    mid-sentence: "... unchanged for ``num_steps`` steps in a row")."""
    doc = (inspect.getdoc(cls) or cls.__name__).strip()
    return " ".join(doc.split("\n\n")[0].split())


def judge_array(
    rule: Rule, array: Any, state: dict[str, Any] | None = None, **where: Any
) -> Finding | None:
    """Judge a numpy array with ``rule`` the way the engine judges a tensor: only the statistics
    the rule asks for, and more when it asks to refine. ``where`` names the tensor (``name``,
    ``kind``, ``module``, ``step``, ...; see :func:`tensordbg.statistics.stats_from_numpy`).

    >>> judge_array(NaN(), np.array([1.0, np.nan]), name="fc.output", kind="output").value
    1.0
    """
    import numpy as np

    from tensordbg.statistics import compute_numpy, stats_from_numpy

    x = np.asarray(array)
    prev = where.pop("prev", None)
    t = stats_from_numpy(x, (), prev=prev, **where)
    t.values.update(compute_numpy(x, rule.stats_for(t), prev))
    state = {} if state is None else state
    verdict = rule.check(t, state)
    for _ in range(3):  # as the engine: a few refinements, then no verdict
        if not isinstance(verdict, Refine):
            break
        missing = [s for s in verdict.stats if s not in t.values]
        if not missing:
            break
        t.values.update(compute_numpy(x, missing, prev))
        verdict = rule.check(t, state)
    return verdict if isinstance(verdict, Finding) else None


def nonfinite_count(t: TensorStats, counts: Sequence[Stat], what: str) -> tuple[float, str]:
    """How many elements of ``t`` the ``counts`` (of NAN, POSINF, NEGINF) add up to, as a
    finding's value and as words for its message: ``(3.0, "3 NaN")``. When they were not counted
    (only the range or the finite screen told), ``(1.0, "NaN (not counted)")``: at least one."""
    if t.summary is not None:
        count = sum(getattr(t.summary, stat.name) for stat in counts)
    elif all(stat in t.values for stat in counts):
        count = sum(int(t.values[stat]) for stat in counts)
    else:
        return 1.0, f"{what} (not counted)"
    if count == 1 and what.endswith(" values"):
        what = what[: -len("s")]  # "1 infinite value"
    return float(count), f"{count} {what}"


def among(t: TensorStats) -> str:
    """Where a finding's count was found, for its message: " among 128 values", or ", its only
    value" for a scalar ("loss holds 1 NaN, its only value.")."""
    return ", its only value" if t.numel == 1 else f" among {t.numel} values"


def check_count(rule: Rule, name: str) -> None:
    """Refuse threshold ``name`` of ``rule`` unless it is a whole number of 1 or more (a number
    of steps, of norms kept): ``True`` and ``3.0`` are not.

    >>> ExplodingGradient(window=0)
    Traceback (most recent call last):
    ValueError: ExplodingGradient: window must be a whole number of 1 or more, not 0
    """
    value = getattr(rule, name)
    if not (isinstance(value, Integral) and not isinstance(value, bool) and value >= 1):
        raise refusal(rule, name, "a whole number of 1 or more")


def check_number(
    rule: Rule,
    name: str,
    *,
    above: float | None = None,
    least: float | None = None,
    below: float | None = None,
    most: float | None = None,
    noun: str = "number",
    infinite: bool = False,
    none: bool = False,
) -> None:
    """Refuse threshold ``name`` of ``rule`` unless it is a number within the bounds given
    (``above``/``below`` exclude theirs, ``least``/``most`` include theirs): never ``True``,
    NaN, or an infinity unless ``infinite``; None where ``none``. ``noun`` names what the
    number is in the sentence ("fraction", "percentage").

    >>> check_number(ExplodingGradient(), "max_norm", above=0)  # 1e6: accepted
    """
    value = getattr(rule, name)
    if none and value is None:
        return
    ok = isinstance(value, Real) and not isinstance(value, bool) and not math.isnan(value)
    ok = ok and (infinite or math.isfinite(value))
    ok = ok and (above is None or value > above) and (least is None or value >= least)
    ok = ok and (below is None or value < below) and (most is None or value <= most)
    if ok:
        return
    low = high = ""
    if above is not None:
        low = f"above {above:g}"
    elif least is not None:
        low = f"of {least:g} or more"
    if below is not None:
        high = f"below {below:g}"
    elif most is not None:
        high = f"at most {most:g}"
    if low == "above 0" and not high:
        what = f"positive {noun}"
    elif least is not None and most is not None:
        what = f"{noun} from {least:g} to {most:g}"
    else:
        what = " ".join(filter(None, [noun, " and ".join(filter(None, [low, high]))]))
    if isinstance(value, Real) and math.isinf(value) and not infinite:
        what = f"finite {what}"  # "a positive number, not inf" would puzzle
    others = [*(["inf"] if infinite else []), *(["None"] if none else [])]
    raise refusal(rule, name, ", or ".join([f"a {what}", *others]))


def refusal(rule: Rule, name: str, must: str, why: str = "") -> ValueError:
    """The error that refuses ``rule``'s threshold ``name``: "Rule: name must be <must>, not
    <its value>", then ``why`` after a semicolon when given."""
    said = f"{rule.name}: {name} must be {must}, not {getattr(rule, name)!r}"
    return ValueError(f"{said}; {why}" if why else said)


def _thresholds(cls: type[Rule]) -> dict[str, inspect.Parameter]:
    """The constructor arguments of ``cls`` that are thresholds, by name."""
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {
        n: p
        for n, p in inspect.signature(cls.__init__).parameters.items()
        if n != "self" and n not in SELECTION_ARGS and p.kind in named
    }


def _matches(t: TensorStats, pattern: str) -> bool:
    """``pattern`` against the tensor's name and module; a later call's tensor (``loss#2``, the
    third loss observed in a step; ``enc#1.output``) is also matched under the name its first
    call's has (``loss``, ``enc.output``)."""
    if fnmatchcase(t.name, pattern) or fnmatchcase(t.module, pattern):
        return True
    return t.call > 0 and fnmatchcase(first_call_name(t.name), pattern)


def first_call_name(name: str) -> str:
    """``name`` without the call numbers ``#k`` that later calls' tensors carry."""
    return _CALL_NUMBER.sub("", name) if "#" in name else name


_CALL_NUMBER = re.compile(r"^#\d+\.|#\d+(?=\.|$)")  # the root's own: "#1.input[0]"


def loss_name(t: TensorStats) -> str | None:
    """The name of an observed loss (a scalar named like "loss", later calls' ``#k`` left out):
    what the loss curve and the rules that ask whether training is done read. None otherwise."""
    if t.kind != "observed" or t.numel != 1:
        return None
    name = first_call_name(t.name)
    return name if "loss" in name.lower() else None


def _coerce(rule: str, key: str, old: Any, new: Any) -> Any:
    """``new`` in the type of the threshold's ``old`` value (the UI may send "30" for 30).
    What would change its value (2.5 to 2, True to 1.0) is left for check_params to refuse."""
    if old is None or isinstance(new, type(old)):
        return new
    if new is None or new == "":  # a field the UI sent emptied: "takes a float, not None" said
        kind = type(old).__name__
        raise ValueError(f"{rule}.{key} cannot be empty: it takes {_article(kind)} {kind}")
    if isinstance(new, bool) or (type(old) is int and isinstance(new, float)):
        return new
    if isinstance(old, tuple) and isinstance(new, str):
        return (new,)  # one name, not a tuple of its letters
    try:
        if isinstance(old, bool):
            if isinstance(new, str):
                return new.strip().lower() in ("1", "true", "yes", "on")
            return bool(new)
        if isinstance(old, (int, float, str)):
            return type(old)(new)
        if isinstance(old, tuple):
            return tuple(new)
    except (TypeError, ValueError) as e:
        kind = type(old).__name__
        raise ValueError(f"{rule}.{key} takes {_article(kind)} {kind}, not {new!r}") from e
    return new


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


def apart(value: float, bound: float) -> tuple[str, str]:
    """``value`` and the ``bound`` it crossed, to 3 significant digits, or as many more as
    tell them apart: a norm of 1,002,000 against 1e6 read "1e+06, above 1e+06"."""
    for digits in range(3, 10):
        said = f"{value:.{digits}g}", f"{bound:.{digits}g}"
        if said[0] != said[1]:
            return said
    return f"{value:.10g}", f"{bound:.10g}"


def keywords_of(cls: type) -> list[str]:
    """The keyword arguments a rule class takes: its thresholds, then the selection."""
    own = [n for n, p in inspect.signature(cls.__init__).parameters.items()
           if n != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]  # fmt: skip
    return [*own, *(n for n in SELECTION_ARGS if n not in own)]
