"""``tensordbg diff``: where two runs parted.

Two dumps of the same model (before and after a change, eager against ``torch.compile``, two
ranks, two library versions) are walked together, step by step and within a step in execution
order; the first tensor whose statistics (or values, where both dumps hold them) differ beyond
``atol + rtol * |b|`` is named, with what differs. The statistics come from the two indexes,
which cost no tensor read; values are read only for tensors before that first difference
(identical bytes are recognised without converting them), so a diff costs about as much as
listing the two dumps.

>>> report = diff_dumps(tensordbg.load("runs/eager"), tensordbg.load("runs/compiled"))
>>> report.first.tensor, report.first.step
('blocks.3.mlp.output', 120)
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from tensordbg.dump.reader import DumpError
from tensordbg.offline.sentences import listed, plural, stat_words, steps_listed

SCHEMA_VERSION = 1
ORIGINS_SAID = 3  # hits at their origin the text says at the first difference's step
CHUNK = 1 << 22  # elements compared at a time: memory stays bounded on huge tensors
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
    what: str  # "shape", "dtype", "statistics", "values", "only in a" or "only in b"
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
            largest = f" (largest difference {_g(v.max_abs_diff)})" if v.max_abs_diff else ""
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
    The runs may have parted in one of them."""
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

    @property
    def exit_code(self) -> int:
        """0 when the runs agree on every step both dumped, 1 when they differ (or share no
        step to compare), 2 when they agree on what could be read but some of it could not (an
        index that cannot be read whole leaves which steps its dump holds unknown)."""
        if self.first is not None:
            return 1
        if any(b["step"] < 0 for b in self.broken) or (self.broken and not self.steps):
            return 2
        if not self.steps:
            return 1
        return 2 if self.broken else 0

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
                f"The runs agree on what could be read ({compared}), but not all of it "
                "could be: see below."
            )
        else:
            lines.append(
                f"The runs agree{' on the tensors both recorded' * bool(self.unpaired)}: "
                f"{compared} within rtol={self.rtol:g}, atol={self.atol:g} ({self.values} "
                "compared by value)."
            )
        for side, steps in (("A", self.only_in_a), ("B", self.only_in_b)):
            if steps:
                lines.append(f"Steps dumped only in {side} (not compared): {steps_listed(steps)}")
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


def tolerance(value: float) -> float:
    """``value`` as a tolerance: a finite number, 0 or more (else ValueError: a negative or NaN
    tolerance would report agreement whatever the values)."""
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{value!r}: a tolerance is a finite number, 0 or more")
    return value


def diff_dumps(
    a: Any, b: Any, *, rtol: float = 1e-5, atol: float = 1e-8, ranks: Sequence[int] = (0, 0)
) -> DiffReport:
    """Compare rank ``ranks[0]`` of dump ``a`` with rank ``ranks[1]`` of dump ``b``."""
    rtol, atol = tolerance(rtol), tolerance(atol)
    rank_a, rank_b = ranks
    report = DiffReport(str(a.path), str(b.path), (rank_a, rank_b), rtol, atol)
    sync = (str(a.meta.get("sync", "")), str(b.meta.get("sync", "")))
    hit_steps = {h.step for h in a.hits if h.rank == rank_a}
    hit_steps |= {h.step for h in b.hits if h.rank == rank_b}
    steps_a, steps_b = set(a.steps(rank_a)), set(b.steps(rank_b))
    # A step one side cannot read is not "dumped only" by the other: it is unreadable there.
    broken_a = {s: why for (s, r), why in a.broken.items() if r == rank_a}
    broken_b = {s: why for (s, r), why in b.broken.items() if r == rank_b}
    for side, broken in (("A", broken_a), ("B", broken_b)):
        for s, why in broken.items():
            report.unreadable(s, side, why)
    # An index that cannot be read whole leaves which steps its dump holds unknown: a step the
    # other dump holds is not "dumped only" there.
    if -1 not in broken_b:
        report.only_in_a = sorted(steps_a - steps_b - set(broken_b))
    if -1 not in broken_a:
        report.only_in_b = sorted(steps_b - steps_a - set(broken_a))
    compared: list[int] = []
    for step in sorted((steps_a & steps_b) - set(broken_a) - set(broken_b)):
        if report.first is None:
            compared.append(step)
        try:
            entries_a = a.tensors(step, rank=rank_a)
        except DumpError as e:
            report.unreadable(step, "A", str(e))
            continue
        try:
            entries_b = b.tensors(step, rank=rank_b)
        except DumpError as e:
            report.unreadable(step, "B", str(e))
            continue
        report.steps += 1
        unpaired: dict[str, list[str]] = {"A": [], "B": []}
        kinds: set[str] = set()  # of the tensors one dump lacks
        for entry_a, entry_b in _in_order(entries_a, entries_b):
            if entry_a is None or entry_b is None:
                side, entry = ("B", entry_b) if entry_a is None else ("A", entry_a)
                if _nonfinite(entry.stats):  # where a NaN appears in one run: that is news
                    report.found(Difference(step, entry.phase, entry.name, entry.module,
                                            entry.kind, f"only in {side.lower()}"))  # fmt: skip
                    continue
                unpaired[side].append(entry.name)
                kinds.add(entry.kind)
                continue
            report.tensors += 1
            difference = _compare(a, b, report, step, entry_a, entry_b, values=report.first is None)
            if difference is not None:
                report.found(difference)
        why = _why_unpaired(step, sync, hit_steps, kinds)
        report.unpaired += [{"step": step, "side": side, "tensors": names, "why": why}
                            for side, names in unpaired.items() if names]  # fmt: skip
    if report.first is not None:
        before = [s for s in compared if s < report.first.step]
        start = before[-1] + 1 if before else 0
        report.not_compared_before = list(range(start, report.first.step))
        for side, dump, rank in (("A", a, rank_a), ("B", b, rank_b)):
            report.origins += [
                {"side": side, "rule": h.rule, "tensor": h.tensor, "phase": h.phase,
                 "message": h.message}
                for h in dump.hits if h.rank == rank and h.step == report.first.step and h.origin
            ]  # fmt: skip
    return report


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


def _nonfinite(stats: dict[str, Any]) -> bool:
    """Whether a dumped tensor's statistics say it holds a NaN or an Inf."""
    counts = sum(float(stats.get(k) or 0.0) for k in ("nan", "posinf", "neginf"))
    return counts > 0 or stats.get("finite", 1.0) == 0.0


def _why_unpaired(step: int, sync: tuple[str, str], hit_steps: set[int], kinds: set[str]) -> str:
    """Why a step of one dump holds tensors (of ``kinds``) the other's lacks. A step records the
    tensors its checks measured: batched checks measure every parameter's update, deferred
    checks only on a step after one that hit, and an update only where the parameter's norm
    did not already show that it moved; otherwise the two models made different tensors."""
    if sync[0] != sync[1]:
        return (
            f"A was recorded with sync={sync[0]}, B with sync={sync[1]}, which record different "
            "tensors: a difference in what was recorded, not in the numbers."
        )
    if step in hit_steps or step - 1 in hit_steps:
        return (
            "A step with a hit, or the step after one, records tensors a clean step does not: "
            "a difference in what was recorded, not in the numbers."
        )
    if kinds == {"update"}:
        return (
            "An update is recorded only where it was measured: where a parameter's norm already "
            "showed that the step moved it, nothing more was measured. A difference in what was "
            "recorded, not in the numbers."
        )
    return (
        "The two runs did not make the same tensors there (a module called in one run only, or "
        "an input that requires grad in one only)."
    )


def _in_order(entries_a: list[Any], entries_b: list[Any]) -> list[tuple[Any, Any]]:
    """The tensors of one step of both dumps as pairs, in execution order (A's, with a tensor
    only B holds in its place in B's), one that a dump lacks paired with None; a name met k
    times (a loss observed at each micro-batch) pairs its k-th in A with its k-th in B."""
    keyed_b = dict(zip(_keys(entries_b), entries_b, strict=True))
    keyed_a = dict(zip(_keys(entries_a), entries_a, strict=True))  # in A's order
    only_b = sorted((e for k, e in keyed_b.items() if k not in keyed_a), key=lambda e: e.order)
    walk: list[tuple[Any, Any]] = []
    i = 0
    for key, entry_a in keyed_a.items():
        entry_b = keyed_b.get(key)
        while entry_b is not None and i < len(only_b) and only_b[i].order < entry_b.order:
            walk.append((None, only_b[i]))
            i += 1
        walk.append((entry_a, entry_b))
    walk += [(None, e) for e in only_b[i:]]
    return walk


def _keys(entries: list[Any]) -> Iterator[tuple[str, int]]:
    """Each tensor's name, with how many of that name came before it in the step."""
    seen: dict[str, int] = {}
    for entry in entries:
        seen[entry.name] = seen.get(entry.name, -1) + 1
        yield entry.name, seen[entry.name]


def _compare(
    a: Any, b: Any, report: DiffReport, step: int, ea: Any, eb: Any, values: bool
) -> Difference | None:
    def difference(what: str, **more: Any) -> Difference:
        return Difference(step, ea.phase, ea.name, ea.module, ea.kind, what,
                          a_shape=list(ea.shape), b_shape=list(eb.shape), **more)  # fmt: skip

    if tuple(ea.shape) != tuple(eb.shape):
        return difference("shape")
    if ea.dtype != eb.dtype:
        return difference("dtype")
    stats = [
        StatDifference(name, float(ea.stats[name]), float(eb.stats[name]))
        for name in ea.stats
        if name in eb.stats and not _close(ea.stats[name], eb.stats[name], report)
    ]
    value = None
    if values and ea.has_value and eb.has_value:
        # Before the first difference every value is compared; at it, the values say where.
        arrays = []
        for side, dump, rank in (("A", a, report.ranks[0]), ("B", b, report.ranks[1])):
            try:
                arrays.append(dump.tensor(ea.name, rank=rank).value(step))
            except DumpError as e:  # a values file cut or changed: its statistics still count
                report.unreadable(step, side, str(e))
        if len(arrays) == 2:
            report.values += 1
            value = _compare_values(*arrays, report)
    if stats or value is not None:
        return difference("statistics" if stats else "values", stats=stats, values=value)
    return None


def _close(x: Any, y: Any, report: DiffReport) -> bool:
    x, y = float(x), float(y)
    if x == y or (math.isnan(x) and math.isnan(y)):
        return True
    return abs(x - y) <= report.atol + report.rtol * abs(y)


def _compare_values(x: np.ndarray, y: np.ndarray, report: DiffReport) -> ValueDifference | None:
    if x.shape != y.shape:
        return None  # the shapes were compared already
    if x.dtype == y.dtype and np.array_equal(_bytes(x), _bytes(y)):
        return None  # the same bits: no conversion needed
    fx, fy = x.reshape(-1), y.reshape(-1)
    count, first, worst = 0, -1, 0.0
    for start in range(0, fx.size, CHUNK):
        cx = np.asarray(fx[start : start + CHUNK], dtype=np.float64)
        cy = np.asarray(fy[start : start + CHUNK], dtype=np.float64)
        with np.errstate(all="ignore"):
            close = np.isclose(cx, cy, rtol=report.rtol, atol=report.atol, equal_nan=True)
            gaps = np.abs(cx - cy)
        bad = ~close
        n = int(np.count_nonzero(bad))
        if n:
            if first < 0:
                first = start + int(np.argmax(bad))
            worst = max(worst, float(np.nanmax(np.where(bad, gaps, 0.0))))
            count += n
    if not count:
        return None
    index = [int(i) for i in np.unravel_index(first, x.shape)] if x.ndim else []
    return ValueDifference(count, int(fx.size), index, float(fx[first]), float(fy[first]), worst)


def _bytes(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).reshape(-1).view(np.uint8)


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
