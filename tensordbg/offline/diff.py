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
from typing import Any

import numpy as np

from tensordbg.dump.reader import DumpError
from tensordbg.offline.diff_report import (
    Difference,
    DiffReport,
    StatDifference,
    ValueDifference,
)

__all__ = ["DiffReport", "Difference", "StatDifference", "ValueDifference", "diff_dumps",
           "tolerance"]  # fmt: skip

CHUNK = 1 << 22  # elements compared at a time: memory stays bounded on huge tensors


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
    # What the text leads with when no step compared differs: the hits of the steps one dump
    # holds alone, and how far the other dump goes.
    for side, dump, rank, only, held in (
        ("A", a, rank_a, report.only_in_a, steps_a | {*broken_a}),
        ("B", b, rank_b, report.only_in_b, steps_b | {*broken_b}),
    ):
        alone = set(only)
        report.only_hits[side] = [h for h in dump.hits if h.rank == rank and h.step in alone]
        report.last_dumped[side] = max(held, default=-1)
        ran = dump.meta.get("last_step_run")  # (a dump of an older version does not say)
        report.ran_to[side] = ran if isinstance(ran, int) else -1
        # Its max_bytes took steps with hits: one it lacks may have hit (see hit_alone).
        report.hits_evicted[side] = any(
            r == rank for _, r in dump.meta.get("evicted_hit_steps") or ()
        )
    compared: list[int] = []
    entered_alike = -1
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
        # Whether the step's first phase (its forward) was compared whole and agreed, on at
        # least one tensor the weights make: then the runs entered the step alike.
        first_phase, alike = (entries_a[0].phase if entries_a else ""), None
        for entry_a, entry_b in _in_order(entries_a, entries_b):
            if entry_a is None or entry_b is None:
                side, entry = ("B", entry_b) if entry_a is None else ("A", entry_a)
                alike = False if entry.phase == first_phase else alike
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
                if report.first is None and alike and difference.phase != first_phase:
                    entered_alike = step
                report.found(difference)
            elif entry_a.phase == first_phase and _made_by_model(entry_a):
                alike = True if alike is None else alike
        why = _why_unpaired(step, sync, hit_steps, kinds)
        report.unpaired += [{"step": step, "side": side, "tensors": names, "why": why}
                            for side, names in unpaired.items() if names]  # fmt: skip
    alone = report.hit_alone()
    if alone is not None and (report.first is None or alone[2].step < report.first.step):
        side, _, hit = alone  # a hit one run made at a step the other went past without one
        if report.first is not None:
            report.later += 1
        report.first = Difference(hit.step, hit.phase, hit.tensor, hit.module, hit.kind,
                                  f"hit only in {side.lower()}")  # fmt: skip
    if report.first is not None:
        before = [s for s in compared if s < report.first.step]
        start = before[-1] + 1 if before else 0
        # The forward of the first difference's step compared whole and alike: the runs
        # entered that step alike, so they did not part in the steps before it.
        if entered_alike != report.first.step:
            report.not_compared_before = list(range(start, report.first.step))
        for side, dump, rank in (("A", a, rank_a), ("B", b, rank_b)):
            report.origins += [
                {"side": side, "rule": h.rule, "tensor": h.tensor, "phase": h.phase,
                 "message": h.message}
                for h in dump.hits if h.rank == rank and h.step == report.first.step and h.origin
            ]  # fmt: skip
    return report


def _nonfinite(stats: dict[str, Any]) -> bool:
    """Whether a dumped tensor's statistics say it holds a NaN or an Inf."""
    counts = sum(float(stats.get(k) or 0.0) for k in ("nan", "posinf", "neginf"))
    return counts > 0 or stats.get("finite", 1.0) == 0.0


def _made_by_model(entry: Any) -> bool:
    """Whether a tensor depends on the model's weights: all but the model's own inputs (the
    batch, which agrees whatever the weights)."""
    return not (entry.kind == "input" and entry.module == "")


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
    count, first, worst, unmeasured = 0, -1, 0.0, False
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
            apart = gaps[bad]
            measured = apart[~np.isnan(apart)]  # a NaN against a number has no gap to measure
            if measured.size:
                worst = max(worst, float(measured.max()))
            unmeasured = unmeasured or measured.size < apart.size
            count += n
    if not count:
        return None
    if worst == 0.0 and unmeasured:  # only a NaN against a number: no difference to measure
        worst = math.nan
    index = [int(i) for i in np.unravel_index(first, x.shape)] if x.ndim else []
    return ValueDifference(count, int(fx.size), index, float(fx[first]), float(fy[first]), worst)


def _bytes(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).reshape(-1).view(np.uint8)
