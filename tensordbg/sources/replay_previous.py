"""The "compared with the previous step" column of a replayed tensor: the same tensor at the
dumped step before, like with like.

A weight is dumped at several phases of a step (checked in the forward, its value after the
optimizer step); its column at the step before is of the phase of this step's column where that
step dumped it, else of the phase it has, and then the reply says which phase each column is
(``previous_why``). Where the step before dumped the values, its column is computed from them
(every statistic, and a slice's too), not from the few its checks measured. numpy only.
"""

from __future__ import annotations

import math
from typing import Any

from tensordbg.sources import contract
from tensordbg.sources.contract import SourceError
from tensordbg.statistics import summarize_numpy

PHASES = {"optimizer": "after the optimizer step", "backward": "after the backward pass",
          "forward": "in the forward pass", "attach": "as attach found it",
          "check": "as a check between steps found it"}  # fmt: skip
"""A phase in words, after the tensor's name: ``fc2.weight after the optimizer step``."""


def in_words(phase: str) -> str:
    return PHASES.get(phase, f"in its {phase} phase")


def previous(source: Any, step: int, now: Any, text: str) -> tuple[contract.Previous | None, str]:
    """The column of ``now`` (the dump entry whose statistics fill this step's column) at the
    dumped step before ``step``, of the slice ``text``; and, when it is of another phase, a
    sentence saying which phase each column is ("" otherwise). None when no step before dumped
    the tensor, or when a slice is asked of a step whose values were not dumped."""
    at = source.steps.index(step) if step in source.steps else 0
    whole = text.strip() in ("", "[]")
    for before in reversed(source.steps[:at]):
        listed = [e for e in source.dump.indexed(before, rank=source.rank) or ()
                  if e.name == now.name]  # fmt: skip
        if not listed:
            continue
        same = [e for e in listed if e.phase == now.phase]
        other = (same or [e for e in listed if e.has_value] or listed)[-1]
        summary = _measured(source, before, other, text, list(now.shape))
        if summary is None and not whole:
            return None, ""
        if summary is None:  # what its checks measured, from the index
            summary = index_summary(other, source, before, bare=True)
        note = ""
        if other.phase != now.phase:
            note = (f"this step's column is {now.name} {in_words(now.phase)}, step {before}'s "
                    f"{in_words(other.phase)} (step {before} did not dump it "
                    f"{in_words(now.phase)})")  # fmt: skip
        return {"step": before, "summary": summary}, note
    return None, ""


def _measured(source: Any, step: int, entry: Any, text: str,
              shape: list[int]) -> dict[str, Any] | None:  # fmt: skip
    """Every statistic of ``entry[text]`` at ``step``, from its dumped values; None without
    them (not dumped, or a file that cannot be read, or another shape than this step's)."""
    if not entry.has_value or list(entry.shape) != shape:
        return None
    source._verify(step)  # values whose bytes changed are no column: read its file whole once
    if source.broken(step):
        return None
    try:
        _, view = source._view(step, entry, text)
    except SourceError:
        return None
    if not view.size:
        return {"numel": 0}
    return {k: v for k, v in summarize_numpy(view).as_dict().items()
            if k not in ("shape", "dtype", "step")}  # fmt: skip


def index_summary(entry: Any, source: Any, step: int | None = None,
                  bare: bool = False) -> dict[str, Any]:  # fmt: skip
    """The dumped statistics as a Summary: those without parameters, with the shape."""
    out: dict[str, Any] = {"numel": math.prod(entry.shape)}
    for name, value in entry.stats.items():
        if "(" not in name and isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = int(value) if name == "numel" else float(value)
    if not bare:
        out["shape"] = list(entry.shape)
        out["dtype"] = entry.dtype
        out["step"] = source.step if step is None else step
    return out
