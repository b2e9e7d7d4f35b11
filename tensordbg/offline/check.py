"""``tensordbg check``: the rules judged again, offline, on a dump.

The same rule code as a live training judges the dumped statistics, through the engine's rule
set (:class:`tensordbg.engine.judge.RuleSet`): steps in order, tensors in execution order within
a step, phase-wide rules at the end of each phase, each rule with its memory across steps. A
statistic a rule needs that the dump does not hold is computed from the tensor's dumped value
when there is one; when there is none, that rule cannot judge that tensor, and the report says
so (``unjudged``) instead of counting it as passed; so are the tensors a rule reached no
verdict on (:meth:`Rule.undecided`: a window of steps longer than the dump holds). A rule that
judged nothing at all (the dump holds nothing it watches, or none it could judge) is said too
(``nothing_judged``), and the dump is not called clean.
Every values file is read against its checksums first (:meth:`Dump.verify`): a step whose file
was altered is judged on the statistics of its index, and listed as broken.

>>> report = check_dump(tensordbg.load("runs/dbg"), rules=[NaN(), Overflow()])
>>> report.findings[0].tensor, report.exit_code
('blocks.0.attn.output', 1)
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tensordbg.engine.judge import RuleSet
from tensordbg.engine.records import Record
from tensordbg.offline.check_report import CheckReport, Finding, NothingJudged, Unjudged
from tensordbg.offline.recorded_rules import recorded_rules
from tensordbg.offline.sentences import plural, steps_listed
from tensordbg.offline.values import DumpedValue, stats_of
from tensordbg.rules import Rule
from tensordbg.statistics import FINITE, KINDS, Stat, TensorStats

__all__ = ["CheckReport", "Finding", "NothingJudged", "Unjudged", "check_dump"]

HISTORY_RULES = {
    "ExplodingGradient": "ExplodingGradient's growth",
    "WeightNotChanging": "WeightNotChanging",
    "LossNotDecreasing": "LossNotDecreasing",
}
# What a tensor of each kind is, as "the dump holds no tensor it watches (...)" says.
WATCHED = {
    "input": "a module's input",
    "output": "a module's output",
    "grad_output": "the gradient of a module's output",
    "grad_input": "the gradient of a module's input",
    "param": "a parameter",
    "grad": "a parameter's gradient",
    "buffer": "a module's buffer (BatchNorm's running statistics), read after a forward wrote it",
    "update": "a parameter's update (batched checks record one every step, deferred ones on the "
    "step after a hit)",
    "observed": "a value the training observes: observe it with session.observe(name, value)",
}
LOSS = "a loss: observe it with session.observe('loss', loss)"


@dataclass(slots=True)
class _Tally:
    """Per rule, across ranks: the tensors it watches and those it judged (by rule id: each
    rank's rule set numbers the rules in their order), and those it could not judge (by rule
    name and the statistics they lack)."""

    watched: Counter[int] = field(default_factory=Counter)
    judged: Counter[int] = field(default_factory=Counter)
    unjudged: dict[tuple[str, ...], Unjudged] = field(default_factory=dict)
    by_name: dict[tuple[int, str], list[int]] = field(default_factory=dict)
    """Of one rank, per rule that may leave tensors undecided (:meth:`Rule.undecided`) and
    tensor name: how many it judged, and the first step."""

    def cannot_judge(self, rule: str, missing: Sequence[Stat], tensor: str, step: int,
                     count: int = 1, reason: str = "") -> None:  # fmt: skip
        key = (rule, reason, *(str(s) for s in missing))
        found = self.unjudged.get(key)
        if found is None:
            missed = [str(s) for s in missing]
            self.unjudged[key] = Unjudged(rule, missed, count, tensor, step, reason)
        else:
            found.tensors += count

    def note(self, rule_ids: Iterable[int], ruleset: RuleSet, name: str, step: int) -> None:
        """Count a tensor as judged by ``rule_ids``, by name for those that may leave some
        undecided."""
        for rule_id in rule_ids:
            self.judged[rule_id] += 1
            active = ruleset.get(rule_id)
            if active is not None and type(active.rule).undecided is not Rule.undecided:
                self.by_name.setdefault((rule_id, name), [0, step])[0] += 1

    def undecided(self, ruleset: RuleSet) -> None:
        """At the end of a rank: the tensors a rule could reach no verdict on (too few steps
        for its window) are not judged; they are said with why."""
        for active in ruleset.active:
            if type(active.rule).undecided is Rule.undecided:
                continue
            try:
                undecided = active.rule.undecided(active.state)
            except Exception:  # a rule's own code: what it judged stands
                continue
            for name, why in undecided.items():
                count, first = self.by_name.get((active.id, name), (0, -1))
                if count:
                    self.judged[active.id] -= count
                    self.cannot_judge(active.rule.name, (), name, first, count, str(why))
        self.by_name = {}


def check_dump(
    dump: Any, rules: Sequence[Rule] | None = None, ranks: Iterable[int] | None = None
) -> CheckReport:
    """Judge every dumped step of ``ranks`` (all by default) with ``rules`` (the run's own, as
    its metadata names them, else the default rules)."""
    notes: list[str] = []
    unchecked: list[str] = []  # the run's rules that cannot be rebuilt here
    chosen = list(rules) if rules is not None else recorded_rules(dump.meta, notes, unchecked)
    ranks = sorted(dump.ranks if ranks is None else ranks)
    # An index cut short after the run closed it (a copy, a disk) leaves the dump incomplete too.
    cut = [why for (step, rank), why in dump.broken.items() if step == -1 and rank in ranks]
    if at := dump.meta.get("detached"):  # q in a UI: the training went on
        notes.append(
            f"the dump ends where tensordbg was detached, {at} (a UI's q, or "
            "session.detach() in the script): later steps, if any, were not watched"
        )
    hits = [h for h in dump.hits if h.rank in ranks] if unchecked else []
    report = CheckReport(
        path=str(dump.path),
        run_id=str(dump.meta.get("run_id", "")),
        rules=[repr(r) for r in chosen],
        ranks=ranks,
        steps=0,
        tensors=0,
        complete=bool(dump.meta.get("complete", True)) and not cut,
        reason_incomplete=str(dump.meta.get("reason_incomplete") or (cut[0] if cut else "")),
        notes=notes,
        unchecked={name: sum(h.rule == name for h in hits) for name in unchecked},
    )
    # The rules that compare a tensor with its earlier steps, as the note on undumped steps says.
    history = [HISTORY_RULES[r.name] for r in chosen if r.name in HISTORY_RULES]
    tally = _Tally()
    # A values file altered after writing is found only by reading it whole: a CI job must not
    # pass a dump whose bytes are not those the run wrote.
    dump.verify(ranks)
    for rank in ranks:
        # Each rank is its own training: its own rules' memory.
        ruleset = RuleSet(chosen, log=lambda message, level: None)
        for (step, r), reason in sorted(dump.broken.items()):
            if r == rank:  # judged below from its statistics, if its index line stands
                checked = dump.indexed(step, rank) is not None
                report.broken.append({"step": step, "rank": rank, "reason": reason,
                                      "statistics_checked": checked})  # fmt: skip
        broken_steps = {s for s, r in dump.broken if r == rank}
        steps = dump.steps(rank)
        # A step whose index line is broken was dumped: it is unread, not undumped.
        dumped = sorted(set(steps) | broken_steps - {-1})
        if history and dumped and len(dumped) < dumped[-1] + 1:
            missing = dumped[-1] + 1 - len(dumped)
            every = dump.meta.get("dump_every")
            held = {None: " (the dump holds only the steps with hits)", 0: "", 1: ""}.get(
                every, f" (the dump holds one step in {every} and the steps with hits)"
            )
            were = "was" if missing == 1 else "were"
            took = [st for st, r in dump.meta.get("evicted_hit_steps") or () if r == rank]
            if took:  # max_bytes took steps with hits too: the dump does not hold them all
                held = (f"{held[:-1]}, but for {len(took)} with hits that max_bytes took: "
                        f"steps {steps_listed(took)})")  # fmt: skip
            notes.append(
                f"rank {rank}: {missing} of steps 0-{dumped[-1]} {were} not dumped{held}: rules "
                f"that compare a tensor with its earlier steps ({', '.join(history)}) saw only "
                "the dumped ones"
            )
        for step in steps:
            read = dump.indexed if step in broken_steps else dump.tensors  # values broken: stats
            try:
                entries = read(step, rank)
            except Exception as e:  # DumpError: a step that broke since it was listed
                report.broken.append({"step": step, "rank": rank, "reason": str(e)})
                continue
            if entries is None:
                continue
            report.steps += 1
            report.tensors += len(entries)
            _judge_step(dump, ruleset, step, rank, entries, report, tally)
        tally.undecided(ruleset)
    report.unjudged = list(tally.unjudged.values())
    if report.steps:
        report.nothing_judged = _nothing_judged(chosen, tally)
    _mark_origins(report, dump)
    return report


def _nothing_judged(rules: Sequence[Rule], tally: _Tally) -> list[NothingJudged]:
    """The rules that judged no tensor: none they watch was dumped, or they could judge none of
    those that were (a rule given twice counts as one, by its name)."""
    first: dict[str, Rule] = {}
    watched: Counter[str] = Counter()
    judged: Counter[str] = Counter()
    for rule_id, rule in enumerate(rules):
        first.setdefault(rule.name, rule)
        watched[rule.name] += tally.watched[rule_id]
        judged[rule.name] += tally.judged[rule_id]
    idle = []
    for name, rule in first.items():
        if judged[name]:
            continue
        if watched[name]:
            reason = (f"{name} could not judge any of the {plural(watched[name], 'tensor')} it "
                      "watches (see above)")  # fmt: skip
        else:
            reason = (f"nothing to judge for {name}: the dump holds no tensor it watches "
                      f"({_watches(rule)})")  # fmt: skip
        idle.append(NothingJudged(name, watched[name], reason))
    return idle


def _watches(rule: Rule) -> str:
    """What a tensor ``rule`` watches is, in words: "a parameter's gradient"; as the rule says it
    when it says it (``watches()``: one that picks tensors by more than their kind and name,
    as SaturatedActivation the outputs of Tanh and Sigmoid modules)."""
    said = getattr(rule, "watches", None)
    if callable(said):
        return str(said())
    kinds = [kind for kind in KINDS if kind in rule.kinds]
    if kinds == ["observed"] and rule.match == ("*loss*",):
        return LOSS
    what = " or ".join(WATCHED[kind] for kind in kinds)
    if rule.match != ("*",):
        what = f"{what}, named {' or '.join(rule.match)}"
    return what


def _mark_origins(report: CheckReport, dump: Any) -> None:
    """Mark the findings on tensors the run itself named origins (the dump's hits): offline,
    without the call tree, no rule can tell where a NaN arose from where it spread."""
    try:
        hits = dump.hits
    except Exception:  # an unreadable hit list is reported by the steps it breaks
        return
    # A hit may name the call whose own code made the value; its record has its own name.
    # By phase too: a weight is checked in the forward (its origin) and after its update.
    origins = {(h.step, h.rank, h.phase, h.stored_as or h.tensor): h for h in hits if h.origin}
    # A hit passed on may name another call too (norm.lin.grad_input[0], the gradient of the
    # input norm.lin took, dumped as norm.grad_input[0]): its name, as the run said it.
    renamed = {(h.step, h.rank, h.phase, h.stored_as): h for h in hits
               if h.stored_as not in ("", h.tensor)}  # fmt: skip
    for f in report.findings:
        key = (f.step, f.rank, f.phase, f.tensor)
        hit = origins.get(key)
        f.origin = f.origin or hit is not None
        hit = hit or renamed.get(key)
        if hit is not None and hit.stored_as not in ("", hit.tensor):
            f.named, f.named_module, f.named_kind = hit.tensor, hit.module, hit.kind


# --- one step -----------------------------------------------------------------------------


def _judge_step(
    dump: Any,
    ruleset: RuleSet,
    step: int,
    rank: int,
    entries: Sequence[Any],
    report: CheckReport,
    tally: _Tally,
) -> None:
    phase: str | None = None
    records: list[Record] = []
    together: list[tuple[Record, Any, Any]] = []
    # The step's findings go in execution order: a pass's clean gradients are judged at its
    # end, a phase-wide rule's findings (order -1) after the phase's last tensor, and a
    # parameter read in the forward out of turn (the run reads a module's parameters when its
    # output is about to be named an origin, so it is listed after it) before its module's
    # output, which its module computed with it.
    start, last, ends = len(report.findings), -1.0, {}
    outputs: dict[tuple[str, str], int] = {}
    for entry in entries:
        if entry.kind == "output":
            outputs.setdefault((entry.phase, entry.module), entry.order)
    used = {e.order: outputs[e.phase, e.module] - 0.25 for e in entries if e.kind == "param"
            and outputs.get((e.phase, e.module), e.order) < e.order}  # fmt: skip
    for entry in entries:
        if entry.phase != phase:
            _judge_together(ruleset, together, step, rank, report)
            ends |= {id(f): last + 0.5 for f in _end_phase(ruleset, records, rank, report)}
            phase, records = entry.phase, []
        last = entry.order
        stats = TensorStats(
            name=entry.name,
            module=entry.module,
            kind=entry.kind,
            phase=entry.phase,
            step=step,
            shape=tuple(entry.shape),
            dtype=entry.dtype,
            values=stats_of(entry.stats, math.prod(entry.shape)),
            module_type=entry.module_type,
            call=entry.call,
            trainable=entry.trainable,
        )
        record = Record(stats, None, 0, 0)
        applicable = ruleset.applicable(stats)
        if not applicable.rule_ids:
            continue
        value = DumpedValue(dump, entry, step, rank) if entry.has_value else None
        judged = []
        for group in applicable.checks:
            kept = []
            for active in group:
                missing = [s for s in active.rule.stats_for(stats) if s not in stats.values]
                if missing and value is not None and value.fill(stats, missing):
                    missing = []
                if missing:
                    tally.cannot_judge(active.rule.name, missing, entry.name, step)
                else:
                    kept.append(active)
            judged.append(tuple(kept))
        # A rule that asks nothing of an observed loss or an update only reads it
        # (VanishingGradient: is the training done? did an update move anything yet?): it does
        # not count as one of the tensors the rule judges.
        counted = [i for i in applicable.rule_ids
                   if stats.kind not in ("observed", "update")
                   or ruleset.get(i).rule.stats_for(stats)]  # fmt: skip
        tally.watched.update(counted)
        if judged != list(applicable.checks):  # a rule comparing a phase's tensors judges
            asked = {active.id for group in judged for active in group}  # every one it applies to
            counted = [i for i in counted if i in asked or _phase_wide(ruleset, i)]
        tally.note(counted, ruleset, entry.name, step)
        record.rule_ids = applicable.rule_ids
        record.checks = tuple(judged)
        measure = value.measure if value is not None else None
        if stats.kind == "grad" and stats.values.get(FINITE) == 1.0:
            together.append((record, measure, entry))  # a pass's clean gradients: as live, below
        else:
            ruleset.judge(record, measure)
            _report(ruleset, record, entry, step, rank, report)
        records.append(record)
    _judge_together(ruleset, together, step, rank, report)
    ends |= {id(f): last + 0.5 for f in _end_phase(ruleset, records, rank, report)}
    found = report.findings[start:]
    # Stable: a tensor's rules in their order.
    found.sort(key=lambda f: ends[id(f)] if id(f) in ends else used.get(f.order, f.order))
    report.findings[start:] = found


def _judge_together(ruleset: RuleSet, together: list[tuple[Record, Any, Any]], step: int,
                    rank: int, report: CheckReport) -> None:  # fmt: skip
    """A phase's finite parameter gradients judged at once, as the live session judges a
    clean pass's (each rule sees all of them: VanishingGradient the model's typical gradient,
    and a bias's module's weight though the autograd engine made the bias's first)."""
    measures = {id(record): measure for record, measure, _ in together}
    ruleset.judge_finite([record for record, _, _ in together], lambda r: measures[id(r)])
    for record, _, entry in together:
        _report(ruleset, record, entry, step, rank, report)
    together.clear()


def _report(ruleset: RuleSet, record: Record, entry: Any, step: int, rank: int,
            report: CheckReport) -> None:  # fmt: skip
    for rule_id, finding in record.findings.items():
        report.findings.append(_finding(ruleset, rule_id, finding, entry, step, rank))


def _end_phase(ruleset: RuleSet, records: list[Record], rank: int,
               report: CheckReport) -> list[Finding]:  # fmt: skip
    """The findings of the rules that compare a phase's tensors, added to the report."""
    found = []
    for record, rule_id, finding in ruleset.judge_phase(records):
        s = record.stats
        found.append(
            Finding(
                s.step,
                rank,
                s.phase,
                -1,
                s.name,
                s.module,
                s.kind,
                _rule_name(ruleset, rule_id),
                float(finding.value),
                _threshold(finding.threshold),
                finding.message,
                advice=finding.advice,
            )
        )
    report.findings += found
    return found


def _phase_wide(ruleset: RuleSet, rule_id: int) -> bool:
    active = ruleset.get(rule_id)
    return active is not None and active.phase_wide


def _finding(ruleset: RuleSet, rule_id: int, finding: Any, entry: Any, step: int,
             rank: int) -> Finding:  # fmt: skip
    return Finding(step, rank, entry.phase, entry.order, entry.name, entry.module, entry.kind,
                   _rule_name(ruleset, rule_id), float(finding.value),
                   _threshold(finding.threshold), finding.message,
                   advice=finding.advice)  # fmt: skip


def _rule_name(ruleset: RuleSet, rule_id: int) -> str:
    active = ruleset.get(rule_id)
    return active.rule.name if active is not None else "?"


def _threshold(value: Any) -> float | None:
    return None if value is None else float(value)
