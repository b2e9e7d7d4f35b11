"""A live training's rows for the UI's lists: its tensors (``tensors``) and why a module's row
has no output statistics (``modules``)."""

from __future__ import annotations

from typing import Any

from tensordbg.engine.records import Record
from tensordbg.sources.provenance import brief


def listing(record: Record) -> dict[str, Any]:
    stats = record.stats
    return {
        "ref": stats.ref,
        "name": stats.name,
        "module": stats.module,
        "kind": stats.kind,
        "call": stats.call,
        "shape": list(stats.shape),
        "dtype": stats.dtype,
        "retained": record.held() is not None,
        "summary": brief(stats),
        "passed_up": list(dict.fromkeys(c.path for c in record.passed_up)),  # their lists too
    }


def no_output(watched: bool, inside: bool, calls: int, mode: str, when: str) -> str:
    """Why a module's row has no output statistics; ``when``: "between" steps, "forward" (paused
    in it), or the state."""
    if not watched:
        return "a container: see its children"
    if when == "running":  # each row said "not called this step" while every step called it
        return "running: its statistics are read when the training pauses"
    if inside:
        return "paused inside it"
    if not calls and when in ("between", "forward"):  # it may yet be called this step
        return ("not called yet: paused before this step began" if when == "between"
                else "not called yet: paused in this step's forward before it")  # fmt: skip
    if not calls:
        return "not called this step"
    if mode == "deferred":
        return "not read (deferred checks read outputs at a problem)"
    return "no floating-point output"  # eager and batched checks read every one they can
