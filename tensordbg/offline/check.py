"""``tensordbg check``: the rules judged again, offline, on a dump.

The same rule code as a live training judges the dumped statistics, through the engine's rule
set (:class:`tensordbg.engine.judge.RuleSet`): steps in order, tensors in execution order within
a step, phase-wide rules at the end of each phase, each rule with its memory across steps. A
statistic a rule needs that the dump does not hold is computed from the tensor's dumped value
when there is one; when there is none, that rule cannot judge that tensor, and the report says
so (``unjudged``) instead of counting it as passed.

>>> report = check_dump(tensordbg.load("runs/dbg"), rules=[NaN(), Overflow()])
>>> report.findings[0].tensor, report.exit_code
('blocks.0.attn.output', 1)
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from tensordbg.engine.judge import RuleSet
from tensordbg.engine.records import Record
from tensordbg.hit import said_of
from tensordbg.offline.recorded_rules import recorded_rules
from tensordbg.offline.sentences import listed, plural
from tensordbg.offline.values import DumpedValue, stats_of
from tensordbg.rules import Rule
from tensordbg.statistics import FINITE, Stat, TensorStats

SCHEMA_VERSION = 1
HISTORY_RULES = {
    "ExplodingGradient": "ExplodingGradient's growth",
    "WeightNotChanging": "WeightNotChanging",
    "LossNotDecreasing": "LossNotDecreasing",
}


@dataclass(slots=True)
class Finding:
    """One rule that fired on one dumped tensor."""

    step: int
    rank: int
    phase: str
    order: int
    tensor: str
    module: str
    kind: str
    rule: str
    value: float
    threshold: float | None
    message: str
    """One sentence for a person: what, where, how much."""
    origin: bool = False
    """Whether the run named this tensor where the problem arose (a hit at its origin), not
    a place it only reached."""
    advice: str = ""
    """What the rule's finding usually means and what to do, as the rule gives it: the table
    gives each advice once, the JSON with each finding (its ``message`` ends with it)."""
    named: str = ""
    named_module: str = ""
    named_kind: str = ""
    """The tensor, module and kind the run's hit named, where it named the call whose own code
    made the value (``output``, the model's own forward; a consumer's ``grad_input``) rather
    than the one that returned it, under whose name ``tensor`` is dumped (``out.output``); ""
    when the hit named ``tensor``."""

    @property
    def advised(self) -> str:  # the message followed by the advice
        return f"{self.message} {self.advice}" if self.advice else self.message

    @property
    def shown(self) -> str:
        """The tensor as the run named it, with the name it is dumped under when they differ."""
        return f"{self.named} (dumped as {self.tensor})" if self.named else self.tensor

    @property
    def said(self) -> str:
        """The message said of the tensor the run named."""
        return said_of(self.message, self.tensor, self.named) if self.named else self.message


@dataclass(slots=True)
class Unjudged:
    """A rule that could not judge some tensors: the dump holds neither the statistics it needs
    nor the values to compute them from."""

    rule: str
    missing: list[str]
    tensors: int
    first_tensor: str
    first_step: int


@dataclass(slots=True)
class CheckReport:
    """What ``tensordbg check`` found; :meth:`as_json` is its documented JSON schema."""

    path: str
    run_id: str
    rules: list[str]
    ranks: list[int]
    steps: int
    tensors: int
    findings: list[Finding] = field(default_factory=list)
    unjudged: list[Unjudged] = field(default_factory=list)
    broken: list[dict[str, Any]] = field(default_factory=list)
    complete: bool = True
    reason_incomplete: str = ""
    notes: list[str] = field(default_factory=list)  # rules of the run that were not checked

    @property
    def exit_code(self) -> int:
        """0 when no rule fired, 1 when one did, 2 when none did on the steps that could be
        read but some could not."""
        if self.findings:
            return 1
        return 2 if self.broken else 0

    def as_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA_VERSION,
            "dump": self.path,
            "run_id": self.run_id,
            "rules": self.rules,
            "ranks": self.ranks,
            "steps": self.steps,
            "tensors": self.tensors,
            "complete": self.complete,
            "reason_incomplete": None if self.complete else self.reason_incomplete,
            "clean": not self.findings,
            "findings": [_finding_json(f) for f in self.findings],
            "unjudged": [asdict(u) for u in self.unjudged],
            "broken": self.broken,
            "notes": self.notes,
        }

    def table(self, limit: int = 50) -> str:
        """The report for a person: the findings in execution order (the first is where a
        problem surfaced; with several ranks, by step, a step's origins first), the advice they
        carry (each once), what could not be judged, and the broken steps."""
        lines = []
        # By step (rank 1's origin stays in view), a step's origins first (a weight's included).
        rows = sorted(self._rows(), key=lambda row: (row[1].step, not row[1].origin))
        width = max([18, *(len(rules) for rules, _ in rows[:limit])])
        for rules, f in rows[:limit]:
            rank = f" rank {f.rank}" if len(self.ranks) > 1 else ""
            origin = "  <- origin" if f.origin else ""
            lines.append(f"step {f.step}{rank} {f.phase:<9} {rules:<{width}} {f.shown}{origin}")
            lines.append(f"    {f.said}")
        if len(rows) > limit:
            lines.append(f"... and {len(rows) - limit} more rows (--json lists every finding)")
        lines.extend(self._advice())
        for u in self.unjudged:
            tensors = plural(u.tensors, "tensor")
            first = f"(first: {u.first_tensor} at step {u.first_step})"
            if all(m.startswith(("update_", "prev_")) for m in u.missing):
                # Measured against the parameter before the step, which a dump never holds.
                lines.append(
                    f"{u.rule} could not judge {tensors}: it asks how the optimizer step changed "
                    f"them ({', '.join(u.missing)}), which is measured against the parameter "
                    f"before the step, and the dump holds no such measure for them {first}"
                )
            else:
                lines.append(
                    f"{u.rule} could not judge {tensors}: the dump holds no "
                    f"{', '.join(u.missing)} for them nor their values {first}"
                )
        for b in self.broken:
            if b["step"] < 0:  # the index itself, or its module tree
                lines.append(f"rank {b['rank']} could not be read whole: {b['reason']}")
            elif b.get("statistics_checked"):
                lines.append(f"step {b['step']} of rank {b['rank']} was checked on the statistics "
                             f"of its index only: {b['reason']}")  # fmt: skip
            else:
                lines.append(f"step {b['step']} of rank {b['rank']} was not checked: {b['reason']}")
        lines.extend(self.notes)
        if not self.complete:
            reason = self.reason_incomplete or "the run stopped before it was closed"
            lines.append(f"the dump is incomplete: {reason}")
        lines.append(self._verdict(len(rows)))
        origins = [f for f in self.findings if f.origin]
        if origins:
            first = min(origins, key=lambda f: (f.step, f.rank, f.order))
            rank = f" of rank {first.rank}" if len(self.ranks) > 1 else ""
            spread = len(self.findings) - len(origins)
            lines.append(f"it arose at {first.shown}, step {first.step}{rank} ({first.rule}); "
                         f"{spread} finding{'s are' if spread != 1 else ' is'} where it "
                         "spread")  # fmt: skip
        return "\n".join(lines)

    def _verdict(self, rows: int) -> str:
        """One line: what was found and by which rules, which rules found nothing, over what."""
        if not self.steps and self.broken:
            return f"nothing could be read: no step of {self.path} was checked (see above)"
        if not self.steps:
            return f"nothing to check: {self.path} holds no dumped step"
        over = f"{plural(self.tensors, 'tensor')} of {plural(self.steps, 'step')} in {self.path}"
        names = list(dict.fromkeys(r.split("(")[0] for r in self.rules))
        n = len(self.findings)
        if not n:
            clean = "clean where it could be read, with unreadable steps" if self.broken else ""
            return f"{clean or 'clean'}: {', '.join(names) or 'no rules'} over {over}"
        by = Counter(f.rule for f in self.findings)
        verdict = plural(n, "finding")
        if n > rows:
            verdict += f" ({n - rows} of them a second rule saying what another said)"
        verdict += f" over {over}, by {listed([f'{r} ({c})' for r, c in by.items()])}"
        quiet = [name for name in names if name not in by]
        return verdict + (f"; {listed(quiet)} found nothing" if quiet else "")

    def _rows(self) -> list[tuple[str, Finding]]:
        """The findings as the table shows them: one row per tensor and fact, naming every rule
        that found it. A NaN gradient fires NaN and ExplodingGradient with the same sentence;
        two rules that say different things of a tensor keep a row each."""
        rows: dict[tuple[int, int, str, str, str], tuple[list[str], Finding]] = {}
        for f in self.findings:
            rules, _ = rows.setdefault((f.step, f.rank, f.phase, f.tensor, f.message), ([], f))
            rules.append(f.rule)
        return [(", ".join(rules), f) for rules, f in rows.values()]

    def _advice(self) -> list[str]:
        """Each advice once, after the findings: a NaN that spread to 30 tensors is 30 findings
        with the same advice, which live is given only where the NaN arose."""
        found: dict[str, list[Finding]] = {}
        for f in self.findings:
            if f.advice:
                found.setdefault(f.advice, []).append(f)
        lines = []
        for advice, findings in found.items():
            n, rules = len(findings), ", ".join(dict.fromkeys(f.rule for f in findings))
            which = f"the {n} {rules} findings" if n > 1 else f"the {rules} finding"
            lines.append(f"about {which}: {advice}")
        return lines


def check_dump(
    dump: Any, rules: Sequence[Rule] | None = None, ranks: Iterable[int] | None = None
) -> CheckReport:
    """Judge every dumped step of ``ranks`` (all by default) with ``rules`` (the run's own, as
    its metadata names them, else the default rules)."""
    notes: list[str] = []
    chosen = list(rules) if rules is not None else recorded_rules(dump.meta, notes)
    ranks = sorted(dump.ranks if ranks is None else ranks)
    report = CheckReport(
        path=str(dump.path),
        run_id=str(dump.meta.get("run_id", "")),
        rules=[repr(r) for r in chosen],
        ranks=ranks,
        steps=0,
        tensors=0,
        complete=bool(dump.meta.get("complete", True)),
        reason_incomplete=str(dump.meta.get("reason_incomplete") or ""),
        notes=notes,
    )
    # The rules that compare a tensor with its earlier steps, as the note on undumped steps says.
    history = [HISTORY_RULES[r.name] for r in chosen if r.name in HISTORY_RULES]
    unjudged: dict[tuple[str, tuple[str, ...]], Unjudged] = {}
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
        if history and steps and len(steps) < steps[-1] + 1:
            missing = steps[-1] + 1 - len(steps)
            every = dump.meta.get("dump_every")
            held = {None: " (the dump holds only the steps with hits)", 0: "", 1: ""}.get(
                every, f" (the dump holds one step in {every} and the steps with hits)"
            )
            were = "was" if missing == 1 else "were"
            notes.append(
                f"rank {rank}: {missing} of steps 0-{steps[-1]} {were} not dumped{held}: rules "
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
            _judge_step(dump, ruleset, step, rank, entries, report, unjudged)
    report.unjudged = list(unjudged.values())
    _mark_origins(report, dump)
    return report


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
    for f in report.findings:
        hit = origins.get((f.step, f.rank, f.phase, f.tensor))
        if hit is None:
            continue
        f.origin = True
        if hit.stored_as not in ("", hit.tensor):
            f.named, f.named_module, f.named_kind = hit.tensor, hit.module, hit.kind


# --- one step -----------------------------------------------------------------------------


def _judge_step(
    dump: Any,
    ruleset: RuleSet,
    step: int,
    rank: int,
    entries: Sequence[Any],
    report: CheckReport,
    unjudged: dict[tuple[str, tuple[str, ...]], Unjudged],
) -> None:
    phase: str | None = None
    records: list[Record] = []
    together: list[tuple[Record, Any, Any]] = []
    for entry in entries:
        if entry.phase != phase:
            _judge_together(ruleset, together, step, rank, report)
            _end_phase(ruleset, records, rank, report)
            phase, records = entry.phase, []
        stats = TensorStats(
            name=entry.name,
            module=entry.module,
            kind=entry.kind,
            phase=entry.phase,
            step=step,
            shape=tuple(entry.shape),
            dtype=entry.dtype,
            values=stats_of(entry.stats),
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
                    _note_unjudged(unjudged, active.rule.name, missing, entry.name, step)
                else:
                    kept.append(active)
            judged.append(tuple(kept))
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
    _end_phase(ruleset, records, rank, report)


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


def _end_phase(ruleset: RuleSet, records: list[Record], rank: int, report: CheckReport) -> None:
    for record, rule_id, finding in ruleset.judge_phase(records):
        s = record.stats
        report.findings.append(
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


def _note_unjudged(
    unjudged: dict[tuple[str, tuple[str, ...]], Unjudged],
    rule: str,
    missing: Sequence[Stat],
    tensor: str,
    step: int,
) -> None:
    key = (rule, tuple(str(s) for s in missing))
    found = unjudged.get(key)
    if found is None:
        unjudged[key] = Unjudged(rule, list(key[1]), 1, tensor, step)
    else:
        found.tensors += 1


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


def _finding_json(f: Finding) -> dict[str, Any]:
    """A finding as the JSON schema has it: the tensor, module and kind the run named (the name
    it is dumped under in ``stored_as``, "" when the same), its ``message`` followed by its
    advice, as the run gave it, and no field of its own for the advice."""
    row = asdict(f)
    del row["advice"], row["named"], row["named_module"], row["named_kind"]
    row["stored_as"] = ""
    if f.named:
        row.update(
            tensor=f.named, module=f.named_module, kind=f.named_kind or f.kind, stored_as=f.tensor
        )
    row["message"] = f"{f.said} {f.advice}" if f.advice else f.said
    return _jsonable(row)


def _jsonable(row: dict[str, Any]) -> dict[str, Any]:
    """Non-finite numbers as strings: JSON has no NaN or Infinity."""
    return {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in row.items()}  # fmt: skip
