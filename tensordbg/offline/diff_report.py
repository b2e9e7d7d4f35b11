"""What ``tensordbg diff`` found (:class:`DiffReport`): the first place two dumps differ
(:class:`Difference`), what was not compared and why; as sentences for a person
(:meth:`DiffReport.text`) and as the documented JSON (:meth:`DiffReport.as_json`).

>>> print(diff_dumps(tensordbg.load("runs/a"), tensordbg.load("runs/b")).text())
The runs agree: 54 tensors of 6 steps within rtol=1e-05, atol=1e-08 (12 compared by value).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from tensordbg.offline.sentences import listed, plural, stat_words, steps_listed

SCHEMA_VERSION = 1
ORIGINS_SAID = 3  # hits at their origin the text says at the first difference's step
# The statistics that count a tensor's NaN and Inf (the diff says them as the NaN and Inf).
_COUNTS = (("nan", "NaN"), ("posinf", "+Inf"), ("neginf", "-Inf"))
_COUNTED = frozenset({"finite", *(name for name, _ in _COUNTS)})


@dataclass(slots=True)
class StatDifference:
    stat: str
    a: float
    b: float


@dataclass(slots=True)
class ValueDifference:
    elements: int  # how many elements differ beyond the tolerance
    numel: int
    first_index: list[int]
    a: float
    b: float
    max_abs_diff: float


@dataclass(slots=True)
class Difference:
    """The first place the two runs differ."""

    step: int
    phase: str
    tensor: str
    module: str
    kind: str
    what: str  # "shape", "dtype", "statistics", "values", "only in a/b", "hit only in a/b"
    stats: list[StatDifference] = field(default_factory=list)
    values: ValueDifference | None = None
    a_shape: list[int] | None = None
    b_shape: list[int] | None = None

    def sentence(self) -> str:
        where = f"step {self.step}, {self.phase}, {self.tensor}"
        if self.what == "shape":
            return f"{where}: shape {self.a_shape} in A, {self.b_shape} in B"
        if self.what == "dtype":
            return f"{where}: its dtype differs"
        if self.what.startswith("hit only in"):
            side = self.what[-1].upper()
            other = "B" if side == "A" else "A"
            return (f"{where}: {side} hit here, {other} went on past this step without a hit "
                    "(a step with a hit is always dumped)")  # fmt: skip
        if self.what.startswith("only in"):
            side = self.what[-1].upper()
            return f"{where}: dumped only in {side}, where it is not finite"
        finiteness = self._finiteness()
        parts = [finiteness] if finiteness else []
        # Beside a NaN or an Inf, a statistic it made NaN or infinite says nothing more.
        shown = [s for s in self.stats if s.stat not in _COUNTED
                 and not (finiteness and not math.isfinite(s.a + s.b))]  # fmt: skip
        parts += [f"{stat_words(s.stat)} {_g(s.a)} in A, {_g(s.b)} in B" for s in shown[:4]]
        if self.values is not None:
            v = self.values
            # A NaN against a number has no difference to measure: then none is said.
            measured = v.max_abs_diff and not math.isnan(v.max_abs_diff)
            largest = f" (largest difference {_g(v.max_abs_diff)})" if measured else ""
            parts.append(
                f"{v.elements} of {v.numel} values differ, the first at {v.first_index}: "
                f"{_g(v.a)} in A, {_g(v.b)} in B{largest}"
            )
        return f"{where}: {'; '.join(parts)}"

    def _finiteness(self) -> str:
        """How the NaN and Inf of the two runs differ, from the dumped counts where there are
        some: "NaN in A (128 of 128 elements), finite in B"; "" when they do not differ."""
        differ = {s.stat: s for s in self.stats if s.stat in _COUNTED}
        if not differ:
            return ""
        numel = math.prod(self.a_shape) if self.a_shape is not None else None
        said = []
        for side in ("A", "B"):
            finite = getattr(differ["finite"], side.lower()) if "finite" in differ else None
            counts = [(label, int(getattr(differ[name], side.lower())))
                      for name, label in _COUNTS if name in differ]  # fmt: skip
            head, tail = _nonfinite_words(finite, counts, numel)
            said.append(f"{head} in {side}{tail}")
        return ", ".join(said)


@dataclass(slots=True)
class DiffReport:
    """What ``tensordbg diff`` found; :meth:`as_json` is its documented JSON schema."""

    a: str
    b: str
    ranks: tuple[int, int]
    rtol: float
    atol: float
    steps: int = 0  # steps compared
    tensors: int = 0  # tensors compared (statistics)
    values: int = 0  # tensors whose values were compared
    first: Difference | None = None
    later: int = 0  # tensors after the first difference whose statistics differ too
    not_compared_before: list[int] = field(default_factory=list)
    """The steps between the last one compared before the first difference and it (from step 0
    when none was): not dumped (``dump_every`` > 1), or dumped in one run only, or unreadable.
    The runs may have parted in one of them; empty when the first difference is past its
    step's forward, which was compared whole and agreed: the runs entered that step alike."""
    only_in_a: list[int] = field(default_factory=list)  # steps
    only_in_b: list[int] = field(default_factory=list)
    broken: list[dict[str, Any]] = field(default_factory=list)
    unpaired: list[dict[str, Any]] = field(default_factory=list)
    """Tensors a step of one dump recorded and the same step of the other did not, per step and
    side: ``{"step", "side", "tensors", "why"}``. Not compared, and not counted as a difference
    of the numbers: ``why`` says what makes a step record other tensors."""
    origins: list[dict[str, Any]] = field(default_factory=list)
    """The hits at their origin each run recorded at the first difference's step, as the
    session said them live: ``{"side", "rule", "tensor", "phase", "message"}``. A dump holds
    no statistics of a value the model's own code made between two modules (deferred checks
    do not measure it on a clean step): the first difference is then the next module's
    output, and the hit says where the value was made."""
    only_hits: dict[str, list[Any]] = field(default_factory=dict)
    """Per side, the hits of the steps dumped in that run only (not compared): the text leads
    with them, a run that hit where the other has nothing to compare is no agreement."""
    hits_evicted: dict[str, bool] = field(default_factory=dict)
    """Whether each side's ``max_bytes`` took steps with hits (then a step it lacks may have
    had one)."""
    last_dumped: dict[str, int] = field(default_factory=dict)
    ran_to: dict[str, int] = field(default_factory=dict)
    """Each side's last step run, dumped or not (-1: its dump does not say)."""
    """Per side, the last step its dump holds (-1: none), readable or not."""

    @property
    def exit_code(self) -> int:
        """0 when the runs agree on every step both dumped, 1 when they differ (or share no
        step to compare), 2 when they agree on what could be read but some of it could not (an
        index that cannot be read whole leaves which steps its dump holds unknown)."""
        if self.first is not None or self.hit_alone():
            return 1
        if any(b["step"] < 0 for b in self.broken) or (self.broken and not self.steps):
            return 2
        if not self.steps:
            return 1
        return 2 if self.broken else 0

    def hit_alone(self) -> tuple[str, str, Any] | None:
        """``(side, other, hit)`` of the first hit one run dumped at a step the other went past
        without dumping it (its origin, if that step has one): a step with a hit is always
        dumped, so the other had none there and the runs differ (a NaN run against a clean
        one dumped every 10 steps). Not where the other's ``max_bytes`` took steps with hits:
        it may have had one there."""
        found = []
        for side, other in (("A", "B"), ("B", "A")):
            if self.hits_evicted.get(other):
                continue
            hits = [h for h in self.only_hits.get(side) or () if self.went_past(other, h.step)]
            if hits:
                step = min(h.step for h in hits)
                at = [h for h in hits if h.step == step]
                found.append((step, side, other, next((h for h in at if h.origin), at[0])))
        if not found:
            return None
        _, side, other, hit = min(found, key=lambda f: f[0])
        return side, other, hit

    def went_past(self, side: str, step: int) -> bool:
        """Whether ``side``'s run went through ``step`` (a later step dumped, or run)."""
        return step < self.last_dumped.get(side, -1) or step <= self.ran_to.get(side, -1)

    def as_json(self) -> dict[str, Any]:
        return _jsonable(
            {
                "schema": SCHEMA_VERSION,
                "a": self.a,
                "b": self.b,
                "ranks": list(self.ranks),
                "rtol": self.rtol,
                "atol": self.atol,
                "agree": self.exit_code == 0,
                "steps": self.steps,
                "tensors": self.tensors,
                "values": self.values,
                "first": None
                if self.first is None
                else {**asdict(self.first), "sentence": self.first.sentence()},
                "later": self.later,
                "not_compared_before": self.not_compared_before,
                "only_in_a": self.only_in_a,
                "only_in_b": self.only_in_b,
                "broken": self.broken,
                "unpaired": self.unpaired,
                "origins": self.origins,
            }
        )

    def unreadable(self, step: int, side: str, reason: str) -> None:
        """A step (or a value of it) one side cannot read: listed once, however many of its
        values could not be read (after the first, the step itself is broken)."""
        if not any(b["step"] == step and b["side"] == side for b in self.broken):
            self.broken.append({"step": step, "side": side, "reason": reason})

    def found(self, difference: Difference) -> None:
        """A tensor that differs: the first one, or one more after it."""
        if self.first is None:
            self.first = difference
        else:
            self.later += 1

    def text(self) -> str:
        lines = []
        compared = f"{plural(self.tensors, 'tensor')} of {plural(self.steps, 'step')}"
        only, agree = self._only_text(), "The runs agree"
        # Steps one run dumped alone, a hit among them perhaps, come before any agreement.
        if self.first is None and self.steps and only:
            lines += only
            only, agree = [], f"On the {plural(self.steps, 'step')} both dumped, the runs agree"
            compared = plural(self.tensors, "tensor")
            if alone := self.hit_alone():
                side, other, step = alone[0], alone[1], alone[2].step
                lines.append(
                    f"So the runs differ: {side} hit at step {step}; {other} went on "
                    "past it without a hit (a step with a hit is always dumped)."
                )
        if self.first is not None:
            lines.append(f"The runs part at {self.first.sentence()}{self._gap()}.")
            if self.later:  # values are read only up to the first difference
                one = self.later == 1
                lines.append(f"After it, {plural(self.later, 'more tensor')} differ{'s' * one} "
                             f"in {'its' if one else 'their'} statistics.")  # fmt: skip
            for o in self.origins[:ORIGINS_SAID]:
                lines.append(f"{o['side']} named an origin at that step, live: [{o['rule']}] "
                             f"{o['tensor']} ({o['phase']}): {o['message']}")  # fmt: skip
            if len(self.origins) > ORIGINS_SAID:
                lines.append(f"... and {len(self.origins) - ORIGINS_SAID} more origins there "
                             "(--json lists them).")  # fmt: skip
        elif not self.steps and self.broken:
            lines.append("Nothing compared: no step both dumps hold could be read (see below).")
        elif not self.steps:
            lines.append("The two dumps have no readable step in common: nothing to compare.")
        elif self.broken:
            lines.append(
                f"{agree} on what could be read ({compared}), but not all of it "
                "could be: see below."
            )
        else:
            lines.append(
                f"{agree}{' on the tensors both recorded' * bool(self.unpaired)}: "
                f"{compared} within rtol={self.rtol:g}, atol={self.atol:g} ({self.values} "
                "compared by value)."
            )
        lines += only
        lines.extend(self._unpaired_text())
        for b in self.broken:
            if b["step"] < 0:
                lines.append(
                    f"The index of {b['side']} cannot be read whole, so which steps it holds is "
                    f"not known: {b['reason']}"
                )
            else:
                lines.append(f"Not compared, unreadable in {b['side']}: {b['reason']}")
        return "\n".join(lines)

    def _only_text(self) -> list[str]:
        """The steps each run dumped alone, not compared: the hits among them first (the first
        at its origin), then how far the other dump goes."""
        lines = []
        for side, other, steps in (("A", "B", self.only_in_a), ("B", "A", self.only_in_b)):
            if not steps:
                continue
            hits = self.only_hits.get(side) or []
            hit_steps = sorted({h.step for h in hits})
            if hit_steps:
                first = next((h for h in hits if h.origin), hits[0])
                said = (f"{side} hit at {_steps(hit_steps)}, which only {side} dumped (the first"
                        f"{' at its origin' * first.origin}: [{first.rule}] {first.tensor}, "
                        f"{first.phase} of step {first.step})")  # fmt: skip
                rest = [s for s in steps if s not in set(hit_steps)]
                if rest:
                    said += f"; {_steps(rest)} too, without hits"
            else:
                said = f"{_steps(steps).capitalize()} dumped only in {side}"
            end, ran = self.last_dumped.get(other, -1), self.ran_to.get(other, -1)
            went_on = [s for s in steps if self.went_past(other, s)]
            if went_on:
                them = "it" if len(went_on) == 1 else "them"
                past = them if len(went_on) == len(steps) else _steps(went_on)
                how = f"it ran to step {ran}" if ran >= end else f"it dumped step {end}"
                where = f"{other}'s run went on past {past} ({how}) without dumping {them}"
            elif ran >= 0:
                where = f"{other}'s run ended at step {ran}"
            elif end < 0:
                where = f"{other} holds no step"
            else:
                where = f"{other}'s dump ends at step {end}"
            lines.append(f"{said}: not compared, {where}.")
        return lines

    def _gap(self) -> str:
        """A clause naming the steps before the first difference that were not compared."""
        gap = self.not_compared_before
        if not gap:
            return ""
        held = {*self.only_in_a, *self.only_in_b, *(b["step"] for b in self.broken)}
        what = "compared" if held & set(gap) else "dumped"
        step, were = ("step", "was") if len(gap) == 1 else ("steps", "were")
        return f" ({step} {steps_listed(gap)} {were} not {what}: the runs may have parted there)"

    def _unpaired_text(self) -> list[str]:
        if not self.unpaired:
            return []
        count = sum(len(u["tensors"]) for u in self.unpaired)
        first = self.unpaired[0]
        more = f" and {count - 1} more" if count > 1 else ""
        return [
            f"Recorded in one dump only, not compared: {first['tensors'][0]} at step "
            f"{first['step']} only in {first['side']}{more}. {first['why']}"
        ]


def _steps(steps: list[int]) -> str:
    """ "step 3", "steps 303 and 304"."""
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {steps_listed(steps)}"


def _nonfinite_words(finite: float | None, counts: list[tuple[str, int]],
                     numel: int | None) -> tuple[str, str]:  # fmt: skip
    """What one run's tensor holds of NaN and Inf, as the statistics that differ tell it: a
    head ("NaN", "finite") and what follows the run's name (" (3 of 32 elements)")."""
    if finite == 1.0:
        return "finite", ""
    held = [(label, n) for label, n in counts if n > 0]
    among = f" of {plural(numel, 'element')}" if numel is not None else ""
    if len(held) == 1:
        return held[0][0], f" ({held[0][1]}{among})"
    if held:
        labels, each = listed([h[0] for h in held]), listed([f"{n} {label}" for label, n in held])
        return labels, f" ({each}{among})"
    if counts:
        return f"no {' or '.join(label for label, _ in counts)}", ""
    return "not finite", ""


def _g(x: float) -> str:
    if math.isnan(x):
        return "NaN"
    return f"{x:.6g}" if math.isfinite(x) else ("Inf" if x > 0 else "-Inf")


def _jsonable(value: Any) -> Any:
    """Non-finite numbers as strings: JSON has no NaN or Infinity."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value
