"""Where a rule decides: the session's rule set.

A :class:`RuleSet` holds each rule as one session runs it (:class:`ActiveRule`: its own copy,
its memory across steps, whether it is on), knows which rules apply to which tensor and what
statistics they need (cached per tensor identity), and judges a record's statistics. It judges
whatever statistics it is given, so the same code judges a live training (statistics computed
by torch next to the tensor) and a dump (statistics from numpy); a rule that asks for more
(:class:`~tensordbg.rules.base.Refine`) gets them through the ``measure`` callback, or no verdict
when the tensor is gone.

The rule set belongs to the training thread. Other threads change it through the session's
control plane, never directly.
"""

from __future__ import annotations

import copy
import sys
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

from tensordbg.engine.records import NONFINITE, Record
from tensordbg.rules import Rule
from tensordbg.rules.base import Finding, Refine
from tensordbg.statistics import FINITE, NAN, NEGINF, POSINF, Stat, TensorStats
from tensordbg.statistics.torch_kernels import SCREEN

COUNTS = (NAN, POSINF, NEGINF)
REFINEMENTS = 3  # how many times in a row a rule may ask for more statistics of one tensor

# Computes statistics of a record's tensor on the host: (stats, wanted) -> values.
Measure = Callable[[TensorStats, Sequence[Stat]], list[float]]


@dataclass(eq=False)
class ActiveRule:
    """A rule as one session runs it: its own copy, its memory across steps, whether it is on."""

    id: int
    rule: Rule
    enabled: bool = True
    state: dict[str, Any] = field(default_factory=dict)
    disabled_reason: str | None = None
    hits: int = 0
    phase_wide: bool = False
    """Whether the rule compares the tensors of a phase with each other (judged at phase end)."""

    def __post_init__(self) -> None:
        self.phase_wide = type(self.rule).check_phase is not Rule.check_phase


@dataclass(frozen=True, slots=True)
class Applicable:
    """What the rules make of one tensor identity: which apply, what they need, and in which
    order to ask them."""

    rule_ids: tuple[int, ...]
    wanted: tuple[Stat, ...]
    checks: tuple[tuple[ActiveRule, ...], tuple[ActiveRule, ...]]
    """Per-tensor rules: those that can speak about a finite tensor, then the others."""
    silent: bool
    """All of them are silent on a finite tensor (a deferred session may leave it unscreened)."""


class RuleSet:
    """The rules of one session.

    >>> rules = RuleSet(tensordbg.rules.default_rules(), log=print)
    >>> rules.judge(record, measure=None)
    """

    def __init__(self, rules: Iterable[Rule], log: Callable[[str, str], None]):
        self.active: list[ActiveRule] = []
        self._by_id: dict[int, ActiveRule] = {}
        self._next_id = 0
        self._log = log
        self._applicable: dict[Any, Applicable] = {}
        self.keep_refinements = False
        """Compute what a rule asked for once (:class:`Refine`) with the tensor's statistics from
        then on: set where reading a tensor later costs a synchronization (batched checks)."""
        self._refined: dict[Any, tuple[Stat, ...]] = {}
        self._quiet_kinds: dict[tuple[tuple[str, ...], str], bool] = {}
        self._updates: tuple[Stat, ...] | bool | None = False  # False: not computed yet
        self.running: tuple[ActiveRule, TensorStats | None, float] | None = None
        """The rule check under way (rule, tensor, start), read by other threads: a rule that
        hangs blocks the training, and a person must be able to see which one it is."""
        for rule in rules:
            self.add(rule)

    # --- the set -------------------------------------------------------------------------------

    def add(self, rule: Rule) -> ActiveRule:
        """Add a rule (it gets its own copy and memory)."""
        if not isinstance(rule, Rule):
            raise TypeError(f"rules are tensordbg.rules.Rule instances, not {type(rule).__name__}")
        active = ActiveRule(self._next_id, copy.deepcopy(rule))
        self._next_id += 1
        self.active.append(active)
        self._by_id[active.id] = active
        self.changed()
        return active

    def get(self, rule_id: int) -> ActiveRule | None:
        return self._by_id.get(rule_id)

    def changed(self) -> None:
        """Forget which rules apply to which tensor (after a rule was added, edited, toggled)."""
        self._applicable = {}
        self._refined = {}
        self._quiet_kinds = {}
        self._updates = False

    def disable(self, active: ActiveRule, error: BaseException) -> None:
        """A rule raised, or answered what is no answer: switch it off, say so once, at the
        rule's own line, and let the training go on."""
        active.enabled = False
        active.disabled_reason = f"{type(error).__name__}: {error}"
        self.changed()
        did = f"answered wrongly ({error})" if isinstance(error, WrongAnswer) else (
            f"raised {active.disabled_reason}")  # fmt: skip
        message = f"tensordbg: rule {active.rule.name} {did} and was disabled; the training goes on"
        warnings.warn_explicit(message, RuntimeWarning, *_rule_line(active.rule, error))
        self._log(message, "warning")

    def propagates(self, rule_id: int) -> bool:
        active = self._by_id.get(rule_id)
        return bool(active and active.rule.propagates)

    # --- applicability -------------------------------------------------------------------------

    def applicable(self, stats: TensorStats, screen_only: bool = False) -> Applicable:
        """The rules that apply to a tensor and what they need (cached per tensor identity);
        ``screen_only`` keeps just the NaN/Inf screen of the statistics (between interval
        steps)."""
        key = applicability_key(stats)
        found = self._applicable.get(key)
        if found is None:
            found = self._applicable[key] = self._find(stats, self._refined.get(key, ()))
        if screen_only:
            return Applicable(found.rule_ids, tuple(s for s in found.wanted if s in SCREEN),
                              found.checks, found.silent)  # fmt: skip
        return found

    def still(self, key: tuple[Any, ...], applicable: Applicable) -> bool:
        """Whether ``applicable`` (an answer of :meth:`applicable` for a tensor of ``key``,
        :func:`applicability_key`, not ``screen_only``) is still the answer: no rule was
        added, changed or disabled."""
        return self._applicable.get(key) is applicable

    def _find(self, stats: TensorStats, refined: tuple[Stat, ...]) -> Applicable:
        ids: list[int] = []
        wanted: dict[Stat, None] = {}
        for active in self.active:
            if not active.enabled:
                continue
            try:
                if not active.rule.applies(stats):
                    continue
                needs = active.rule.stats_for(stats)
            except Exception as e:
                self.disable(active, e)
                continue
            ids.append(active.id)
            wanted.update(dict.fromkeys(needs))
        if ids:
            wanted = dict.fromkeys(SCREEN) | wanted | dict.fromkeys(refined)
        chosen = [a for a in self.active if a.id in ids]
        # Per-tensor rules, those that can speak about a finite tensor first: on a finite tensor
        # the others are not asked at all (see judge).
        loud = [a for a in chosen if not a.phase_wide and not silent_when_finite(a, stats)]
        quiet = [a for a in chosen if not a.phase_wide and a not in loud]
        silent = not loud and all(not a.phase_wide for a in chosen)
        return Applicable(tuple(ids), tuple(wanted), (tuple(loud), tuple(quiet)), silent)

    def grads_quiet(self, dtype: str) -> bool:
        """Whether every rule that could look at an activation gradient of this dtype is silent
        while it is finite (then a clean deferred pass need not read it)."""
        return self._quiet(("grad_output", "grad_input"), "backward", dtype)

    def activations_quiet(self, dtype: str) -> bool:
        """Whether every rule that could look at a module's input or output of this dtype is
        silent while it is finite (then a deferred forward may only note it)."""
        return self._quiet(("output", "input"), "forward", dtype)

    def _quiet(self, kinds: tuple[str, ...], phase: str, dtype: str) -> bool:
        """Whether the rules on tensors of these kinds and this dtype are all silent while it
        is finite (cached until the rules change)."""
        key = (kinds, dtype)
        quiet = self._quiet_kinds.get(key)
        if quiet is None:
            quiet = True
            for kind in kinds:
                probe = TensorStats("probe", "probe", kind, phase, 0, (1,), dtype)
                for active in self.active:
                    if active.enabled and kind in active.rule.kinds:
                        quiet = quiet and silent_when_finite(active, probe)
            self._quiet_kinds[key] = quiet
        return quiet

    def update_stats(self) -> tuple[Stat, ...] | None:
        """The statistics rules on ``update`` records need, or None when no rule looks at
        updates (cached until the rules change)."""
        if self._updates is not False:
            return self._updates  # type: ignore[return-value]
        probe = TensorStats("*.update", "", "update", "optimizer", 0, (1,), "float32",
                            trainable=True)  # fmt: skip
        wanted: dict[Stat, None] = {}
        for active in self.active:
            if not (active.enabled and "update" in active.rule.kinds):
                continue
            try:
                wanted.update(dict.fromkeys(active.rule.stats_for(probe)))
            except Exception as e:
                self.disable(active, e)
        self._updates = tuple(wanted) or None
        return self._updates

    # --- judging -------------------------------------------------------------------------------

    def running_rule(self) -> dict[str, Any] | None:
        """The rule check under way, as the UI shows it (any thread may ask)."""
        running = self.running
        if running is None:
            return None
        active, stats, start = running
        return {
            "rule": active.rule.name,
            "tensor": stats.name if stats is not None else "(the whole phase)",
            "seconds": round(perf_counter() - start, 3),
        }

    def judge(self, record: Record, measure: Measure | None) -> None:
        """Run the per-tensor rules that apply to a record on its statistics; ``measure``
        computes statistics a rule asks for (None: the tensor is gone, no more can be had)."""
        record.judged = True
        stats = record.stats
        nonfinite = stats.nonfinite
        if nonfinite and measure is not None and NAN not in stats.values:
            # Which of NaN and Inf, and how many: counted only for unhealthy tensors.
            stats.values.update(zip(COUNTS, measure(stats, COUNTS), strict=True))
            nonfinite = stats.nonfinite
            if nonfinite is False:  # a sum of finite values past the dtype's range said not
                stats.values[FINITE] = 1.0
        loud, quiet = record.checks or ((), ())
        for active in loud + quiet if nonfinite is not False else loud:
            if not active.enabled:
                continue
            self.running = (active, stats, perf_counter())
            try:
                finding = answer(active.rule.check(stats, active.state))
                if isinstance(finding, Refine):
                    finding = self._refine(stats, finding, active, measure)
            except Exception as e:
                self.disable(active, e)
                continue
            finally:
                self.running = None
            if finding is not None:
                record.find(active.id, finding)
        if nonfinite:
            record.fire(NONFINITE)
        for rule_id in record.findings:
            if self.propagates(rule_id):
                record.fire(rule_id)

    def judge_finite(self, records: Sequence[Record], measure: Callable[[Record], Measure | None]
                     ) -> None:  # fmt: skip
        """:meth:`judge` of many records known finite, each rule called once for all those it
        looks at (:meth:`Rule.check_many`, in their order): a clean pass's parameter gradients.
        A rule that raises is disabled and says nothing of any of them."""
        for record in records:
            record.judged = True
        found = self.judge_clean([r.stats for r in records], [r.checks for r in records],
                                 lambda i: measure(records[i]))  # fmt: skip
        self.give(records, found)

    def give(self, records: Sequence[Record], found: list[tuple[int, int, Finding]]) -> None:
        """Give records their findings (:meth:`judge_clean`'s, by index), and the conditions
        that those of propagating rules carry."""
        for i, rule_id, finding in found:
            records[i].find(rule_id, finding)
        for record in records:
            for rule_id in record.findings:
                if self.propagates(rule_id):
                    record.fire(rule_id)

    def judge_clean(self, tensors: Sequence[TensorStats], checks: Sequence[tuple[Any, ...]],
                    measure: Callable[[int], Measure | None]
                    ) -> list[tuple[int, int, Finding]]:  # fmt: skip
        """The findings, as (index, rule, finding) in the rules' order, of finite tensors'
        statistics with their rules (an :class:`Applicable`'s ``checks`` each), each rule called
        once for all it looks at; ``measure(i)`` computes more of the ``i``-th tensor for a rule
        that asks (None: it is gone). Records need not exist: a clean pass's parameter
        gradients get theirs only if a finding, a pause or a listing asks (param_grads.py)."""
        alike: dict[tuple[ActiveRule, ...], list[int]] = {}  # most: the same rules
        for i, its in enumerate(checks):
            loud = its[0] if its else ()  # the others are silent
            same = alike.get(loud)
            if same is None:
                alike[loud] = [i]
            else:
                same.append(i)
        by_rule: dict[int, tuple[ActiveRule, list[int]]] = {}
        if len(alike) == 1:
            for loud, same in alike.items():
                by_rule = {active.id: (active, same) for active in loud}
        else:  # each rule's in their order
            for i, its in enumerate(checks):
                for active in its[0] if its else ():
                    mine = by_rule.get(active.id)
                    if mine is None:
                        by_rule[active.id] = (active, [i])
                    else:
                        mine[1].append(i)
        found: list[tuple[int, int, Finding]] = []
        stats_of: dict[int, list[TensorStats]] = {}  # by list: the rules share one, most often
        for active, mine in by_rule.values():
            if not active.enabled:
                continue
            self.running = (active, tensors[mine[0]], perf_counter())
            try:
                given = stats_of.get(id(mine))
                if given is None:
                    given = stats_of[id(mine)] = [tensors[i] for i in mine]
                verdicts = active.rule.check_many(list(given), active.state)  # its own
                if len(verdicts) != len(mine):
                    raise ValueError(f"check_many gave {len(verdicts)} verdicts for {len(mine)}")
                its_findings = []
                for i, finding in zip(mine, verdicts, strict=True):
                    if finding is None:  # most: nothing to check
                        continue
                    finding = answer(finding)
                    if isinstance(finding, Refine):
                        finding = self._refine(tensors[i], finding, active, measure(i))
                    if finding is not None:
                        its_findings.append((i, active.id, finding))
                found += its_findings
            except Exception as e:
                self.disable(active, e)
            finally:
                self.running = None
        return found

    def _refine(
        self, stats: TensorStats, ask: Refine, active: ActiveRule, measure: Measure | None
    ) -> Finding | None:
        """A rule asked for more statistics of this tensor: compute them and ask it again."""
        for _ in range(REFINEMENTS):
            missing = tuple(s for s in ask.stats if s not in stats.values)
            if not missing:
                break
            if self.keep_refinements:  # from the next step on, in the phase's one transfer
                key = applicability_key(stats)
                self._refined[key] = tuple(dict.fromkeys(self._refined.get(key, ()) + missing))
                self._applicable.pop(key, None)
            if measure is None:
                return None  # the tensor is gone: no verdict
            stats.values.update(zip(missing, measure(stats, missing), strict=True))
            again = answer(active.rule.check(stats, active.state))
            if not isinstance(again, Refine):
                return again
            ask = again
        return None

    def judge_phase(self, records: Sequence[Record]) -> list[tuple[Record, int, Finding]]:
        """Rules that compare the tensors of a phase with each other, at its end."""
        found: list[tuple[Record, int, Finding]] = []
        for active in [a for a in self.active if a.enabled and a.phase_wide]:
            mine = [r for r in records if active.id in r.rule_ids and not r.hidden]
            if not mine:
                continue
            self.running = (active, None, perf_counter())
            try:
                verdicts = active.rule.check_phase([r.stats for r in mine], active.state)
                verdicts = [(stats, answer(finding)) for stats, finding in verdicts]
            except Exception as e:
                self.disable(active, e)
                continue
            finally:
                self.running = None
            by_stats = {id(r.stats): r for r in mine}
            for stats, finding in verdicts:
                record = by_stats.get(id(stats))
                if record is not None:
                    record.find(active.id, finding)
                    found.append((record, active.id, finding))
        return found

    def rejudge(self, record: Record, already: set[tuple[int, str]]) -> list[tuple[int, Finding]]:
        """Judge a record again with the rules as they are now, each with a copy of its memory
        (a recheck is not another step); findings of rules that already hit it are skipped."""
        found = []
        for rule_id in record.rule_ids:
            active = self._by_id.get(rule_id)
            if active is None or not active.enabled or active.phase_wide:
                continue
            if (record.stats.ref, active.rule.name) in already:
                continue
            try:
                finding = answer(active.rule.check(record.stats, copy.deepcopy(active.state)))
            except Exception as e:
                self.disable(active, e)
                continue
            if finding is not None and not isinstance(finding, Refine):
                found.append((rule_id, finding))
        return found


class WrongAnswer(TypeError):
    """A rule's check returned what is not a verdict."""


def _rule_line(rule: Rule, error: BaseException) -> tuple[str, int]:
    """Where a rule went wrong, for its warning: the deepest line of the rule's own file in the
    traceback (it raised there), else its ``check`` (it answered wrongly)."""
    module = sys.modules.get(type(rule).__module__)
    own = getattr(module, "__file__", None)
    found = None
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == own:
            found = (own, tb.tb_lineno)
        tb = tb.tb_next
    code = getattr(type(rule).check, "__code__", None)
    if found is None and code is not None:
        found = (code.co_filename, code.co_firstlineno)
    return found or (__file__, 0)


def answer(found: Any) -> Finding | Refine | None:
    """A rule's answer, checked before anything reads it: None, a Finding (its value and
    threshold numbers, its message and advice text) or a Refine. Anything else is the rule's
    mistake, raised where the rule was called, so the rule is disabled as one that raises is
    (a True returned for "found" had stopped all watching: its hit could not be written)."""
    if found is None or isinstance(found, Refine):
        return found
    if not isinstance(found, Finding):
        raise WrongAnswer(f"it returned {type(found).__name__} {found!r:.60}, not a Finding, a "
                          "Refine or None")  # fmt: skip
    for field_name in ("value", "threshold"):
        number = getattr(found, field_name)
        if field_name == "threshold" and number is None:
            continue
        try:
            float(number)
        except (TypeError, ValueError):
            raise WrongAnswer(f"its Finding's {field_name} is {type(number).__name__} "
                              f"{number!r:.60}, not a number") from None  # fmt: skip
    if not isinstance(found.message, str) or not isinstance(found.advice, str):
        raise WrongAnswer("its Finding's message and advice are not both text")
    return found


def applicability_key(stats: TensorStats) -> tuple[Any, ...]:
    """What decides which rules apply to a tensor and what they need."""
    return (stats.kind, stats.name, stats.module_type, stats.dtype, len(stats.shape),
            stats.trainable)  # fmt: skip


def silent_when_finite(active: ActiveRule, stats: TensorStats) -> bool:
    if active.phase_wide:
        return False
    try:
        return bool(active.rule.silent_when_finite(stats))
    except Exception:
        return False
