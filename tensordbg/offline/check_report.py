"""What ``tensordbg check`` found (:class:`CheckReport`): the findings, what could not be
judged, what could not be read; as a table for a person (:meth:`CheckReport.table`, its last line
the verdict) and as the documented JSON (:meth:`CheckReport.as_json`).

>>> print(check_dump(tensordbg.load("runs/dbg")).table().splitlines()[-1])
clean: NaN, Overflow, ExplodingGradient over 54 tensors of 6 steps in runs/dbg
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from tensordbg.hit import said_of
from tensordbg.offline.sentences import listed, plural, stat_words

SCHEMA_VERSION = 1


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
    (``missing``) nor the values to compute them from; or, ``reason`` given, the rule reached
    no verdict on them (too few steps of them for the window it compares)."""

    rule: str
    missing: list[str]
    tensors: int
    first_tensor: str
    first_step: int
    reason: str = ""
    """Why the rule reached no verdict, as it says it (:meth:`Rule.undecided`); "" when it
    lacked statistics."""

    @property
    def sentence(self) -> str:
        """One sentence for a person: which rule, how many tensors, why, and the first."""
        tensors = plural(self.tensors, "tensor")
        first = f"(first: {self.first_tensor} at step {self.first_step})"
        if self.reason:
            return f"{self.rule} could not judge {tensors}: {self.reason} {first}"
        missing = listed(list(map(stat_words, self.missing)))
        if all(m.startswith(("update_", "prev_")) for m in self.missing):
            # Measured against the parameter before the step, which a dump never holds.
            return (f"{self.rule} could not judge {tensors}: it asks how the optimizer step "
                    f"changed them ({missing}), which is measured against the parameter before "
                    f"the step, and the dump holds no such measure for them {first}")  # fmt: skip
        it = "it" if len(self.missing) == 1 else "them"
        return (f"{self.rule} could not judge {tensors}: the dump holds neither their {missing} "
                f"(a run with {self.rule} on dumps {it}) nor their values to compute {it} from "
                f"{first}")  # fmt: skip


@dataclass(slots=True)
class NothingJudged:
    """A rule that judged no tensor of the dump: the dump holds none it watches (``watched``
    0), or it could judge none of those it watches (each is in ``unjudged``)."""

    rule: str
    watched: int
    reason: str
    """One sentence for a person: which rule, and why it judged nothing."""


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
    nothing_judged: list[NothingJudged] = field(default_factory=list)
    broken: list[dict[str, Any]] = field(default_factory=list)
    complete: bool = True
    reason_incomplete: str = ""
    notes: list[str] = field(default_factory=list)  # rules of the run that were not checked
    unchecked: dict[str, int] = field(default_factory=dict)
    """The run's rules that could not be rebuilt here, and the hits the run recorded of each."""

    @property
    def exit_code(self) -> int:
        """0 when no rule fired, 1 when one did, 2 when none did on what could be read and
        judged but not all of it could be: a step or file could not be read, the dump is
        incomplete (its run did not finish, or its writer stopped or fell behind), or a rule
        judged nothing (the dump holds nothing it can judge), or a rule of the run's could not be
        rebuilt here (not installed: the dump may record its hits)."""
        if self.findings:
            return 1
        unread = self.broken or self.nothing_judged or self.unchecked
        return 2 if unread or not self.complete else 0

    @property
    def clean(self) -> bool:
        """Whether every rule judged every tensor it watches, of a dump read whole, and none
        fired."""
        return self.exit_code == 0 and not self.unjudged

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
            "clean": self.clean,
            "findings": [_finding_json(f) for f in self.findings],
            "unjudged": [{**asdict(u), "reason": u.sentence} for u in self.unjudged],
            "nothing_judged": [asdict(j) for j in self.nothing_judged],
            "broken": self.broken,
            "notes": self.notes,
            "unchecked_rules": self.unchecked,
        }

    def table(self, limit: int = 50) -> str:
        """The report for a person: the findings in execution order (the first is where a
        problem surfaced; with several ranks, by step, a step's origins first), the advice they
        carry (each once), what could not be judged, and the broken steps."""
        lines = []
        rows = self._rows()  # in execution order, as the JSON lists them
        if len(self.ranks) > 1:  # by step (rank 1's origin stays in view), a step's origins first
            rows.sort(key=lambda row: (row[1].step, not row[1].origin))
        width = max([18, *(len(rules) for rules, _ in rows[:limit])])
        digits = max([1, *(len(str(f.step)) for _, f in rows[:limit])])  # step 9, step 10 aligned
        for rules, f in rows[:limit]:
            rank = f" rank {f.rank}" if len(self.ranks) > 1 else ""
            origin = "  <- origin" if f.origin else ""
            where = f"step {f.step:<{digits}}{rank}"
            lines.append(f"{where} {f.phase:<9} {rules:<{width}} {f.shown}{origin}")
            lines.append(f"    {f.said}")
        if len(rows) > limit:
            lines.append(f"... and {len(rows) - limit} more rows (--json lists every finding)")
        lines.extend(self._advice())
        lines.extend(u.sentence for u in self.unjudged)
        for b in self.broken:
            if b["step"] < 0:  # the index itself, or its module tree
                lines.append(f"rank {b['rank']} could not be read whole: {b['reason']}")
            elif b.get("statistics_checked"):
                lines.append(f"step {b['step']} of rank {b['rank']} was checked on the statistics "
                             f"of its index only: {b['reason']}")  # fmt: skip
            else:
                lines.append(f"step {b['step']} of rank {b['rank']} was not checked: {b['reason']}")
        lines.extend(self.notes)
        said = {b["reason"] for b in self.broken}  # an index cut short: said just above
        if not self.complete and self.reason_incomplete not in said:
            reason = self.reason_incomplete or "the run stopped before it was closed"
            lines.append(f"the dump is incomplete: {reason}")
        lines.append(self._verdict(len(rows)))
        origins = sorted((f for f in self.findings if f.origin),
                         key=lambda f: (f.step, f.rank, f.order))  # fmt: skip
        if origins:
            first = origins[0]
            rank = f" of rank {first.rank}" if len(self.ranks) > 1 else ""
            spread = len(self.findings) - len(origins)
            # Each origin of that first step (a NaN and an Inf made by one module): all named.
            rules = ", ".join(dict.fromkeys(f.rule for f in origins if f.step == first.step
                                            and f.shown == first.shown))  # fmt: skip
            places = dict.fromkeys((f.shown, f.step, f.rank) for f in origins)
            others = len(places) - 1  # problems of their own, elsewhere or later
            also = (f" ({plural(others, 'other origin')} after it, above, each a problem of "
                    "its own)" if others else "")  # fmt: skip
            lines.append(f"it arose at {first.shown}, step {first.step}{rank} ({rules}){also}; "
                         f"{spread} finding{'s are' if spread != 1 else ' is'} where "
                         f"{'they' if others else 'it'} spread")  # fmt: skip
        return "\n".join(lines)

    def _verdict(self, rows: int) -> str:
        """One line: what was found and by which rules, which rules found nothing, over what;
        then what keeps it from being clean: a rule that judged nothing or not all it watches,
        a part of the dump that could not be read. "clean" only when nothing of that is left."""
        if not self.steps and self.broken:
            return f"nothing could be read: no step of {self.path} was checked (see above)"
        if not self.steps:
            return f"nothing to check: {self.path} holds no dumped step"
        over = f"{plural(self.tensors, 'tensor')} of {plural(self.steps, 'step')} in {self.path}"
        names = list(dict.fromkeys(r.split("(")[0] for r in self.rules))
        idle = {j.rule for j in self.nothing_judged}
        judging = [name for name in names if name not in idle]
        unjudged: Counter[str] = Counter()
        for u in self.unjudged:
            if u.rule not in idle:
                unjudged[u.rule] += u.tensors
        caveats = [j.reason for j in self.nothing_judged]
        caveats += [f"{rule} could not judge {plural(count, 'tensor')} (see above)"
                    for rule, count in unjudged.items()]  # fmt: skip
        for rule, hits in self.unchecked.items():  # a run's own rule, not installed here
            recorded = f": the run recorded {plural(hits, 'hit')} of it" if hits else ""
            caveats.append(f"the run's rule {rule} could not be checked here{recorded}")
        if self.broken:
            caveats.append("not all of the dump could be read (see above)")
        elif not self.complete:  # what was written was read whole, but not all was written
            caveats.append("the dump is incomplete (see above)")
        n = len(self.findings)
        if not n and not caveats:
            return f"clean: {', '.join(names) or 'no rules'} over {over}"
        if not n:
            verdict = (f"no finding by {listed(judging)} over {over}" if judging
                       else f"no rule could judge anything in {over}")  # fmt: skip
            return "; ".join([verdict, *caveats])
        by = Counter(f.rule for f in self.findings)
        verdict = plural(n, "finding")
        if n > rows:
            verdict += f" ({n - rows} of them a second rule saying what another said)"
        verdict += f" over {over}, by {listed([f'{r} ({c})' for r, c in by.items()])}"
        quiet = [name for name in judging if name not in by]
        if quiet:
            verdict += f"; {listed(quiet)} found nothing"
        return "; ".join([verdict, *caveats])

    def _rows(self) -> list[tuple[str, Finding]]:
        """The findings as the table shows them: one row per tensor and fact, naming every rule
        that found it. A NaN gradient fires NaN and ExplodingGradient with the same sentence;
        two rules that say different things of a tensor keep a row each. A gradient that
        micro-batches found again is one row, its rules named once."""
        rows: dict[tuple[int, int, str, str, str], tuple[dict[str, None], Finding]] = {}
        for f in self.findings:
            rules, _ = rows.setdefault((f.step, f.rank, f.phase, f.tensor, f.message), ({}, f))
            rules[f.rule] = None
        return [(", ".join(rules), f) for rules, f in rows.values()]

    def _advice(self) -> list[str]:
        """Each advice once, after the findings: a NaN that spread to 30 tensors is 30 findings
        with the same advice, which live is given only where the NaN arose."""
        found: dict[str, list[Finding]] = {}
        for f in self.findings:
            if f.advice:
                found.setdefault(f.advice, []).append(f)
        lines = []
        by_rule = Counter(f.rule for f in self.findings)
        for advice, findings in found.items():
            n, named = len(findings), list(dict.fromkeys(f.rule for f in findings))
            rules, total = ", ".join(named), sum(by_rule[r] for r in named)
            which = f"the {n} {rules} findings" if n > 1 else f"the {rules} finding"
            if n < total:  # the rule's other findings get other advice (a NaN, a blow-up)
                which = f"{n} of the {total} {rules} findings"
            lines.append(f"about {which}: {advice}")
        return lines


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
