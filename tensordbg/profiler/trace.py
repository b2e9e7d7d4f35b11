"""The profiler's output as plain data: the Chrome trace ``torch.profiler`` exports (written
gzip-compressed next to the run, for Perfetto), taken once the profiler stopped.
:mod:`.summary` works on this :class:`Capture` only, so its GPU paths are tested with made-up
events on a machine without a GPU.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tensordbg.profiler.operators import kineto_flops

STEP_PREFIX = "ProfilerStep#"


@dataclass
class Capture:
    """What a stopped profiler recorded, as plain data."""

    events: list[dict[str, Any]]
    """The Chrome trace's ``traceEvents``."""
    averages: list[dict[str, Any]] | None
    """Operator rows as ``key_averages()`` counts them (name, calls, self/total CPU and device
    seconds, input shapes, flops, self CPU/device memory bytes); None: the summary counts them
    from the events (:mod:`.operators`)."""
    steps: list[int]
    """The session's numbers of the profiled steps, in order (ProfilerStep#1 is the first)."""
    device: str = "cpu"
    main_thread: int = 0
    trace: str | None = None
    host: dict[str, Any] = field(default_factory=dict)
    memory_limit: int | None = None
    flops: dict[tuple[str, str | None], int] = field(default_factory=dict)
    """FLOPs by operator name and shapes, as torch counted them (the trace does not carry
    them)."""
    by_shape: bool = False
    """Whether operators are told apart by their input shapes too."""

    @classmethod
    def from_profiler(
        cls,
        profiler: Any,
        *,
        directory: Path,
        device: str,
        steps: list[int],
        main_thread: int,
        record_shapes: bool,
        host: dict[str, Any],
        memory_limit: int | None,
    ) -> Capture:
        """Export the trace of a stopped ``torch.profiler.profile``, write it gzip-compressed
        into ``directory`` (its steps nested, see :func:`nest_steps`) and read its events."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        trace = directory / f"trace-{stamp}-{os.getpid()}.json.gz"
        with tempfile.TemporaryDirectory(prefix="tensordbg-trace-") as scratch:
            plain = Path(scratch) / "trace.json"
            profiler.export_chrome_trace(str(plain))
            raw = plain.read_text(encoding="utf-8")
        events = json.loads(raw).get("traceEvents", [])
        # Re-serializing 10^5 events costs seconds: the few step events are edited in the text.
        with gzip.open(trace, "wt", compresslevel=3, encoding="utf-8") as out:
            out.write(_nested_text(raw, events))
        return cls(events, None, list(steps), device, main_thread, str(trace), host,
                   memory_limit, kineto_flops(profiler, record_shapes), record_shapes)  # fmt: skip


_STEP_TEXT = re.compile(
    r'("name": "ProfilerStep#(\d+)",[^{}]*?"ts": )([-0-9.e+]+)(,\s*"dur": )([-0-9.e+]+)'
)


def _nested_text(raw: str, events: list[dict[str, Any]]) -> str:
    moved = {str(e["name"]): e for e in nest_steps(events)
             if e.get("ph") == "X" and str(e.get("name", "")).startswith(STEP_PREFIX)}  # fmt: skip

    def edit(match: re.Match[str]) -> str:
        event = moved.get(f"{STEP_PREFIX}{match.group(2)}")
        if event is None:
            return match.group(0)
        return f"{match.group(1)}{event['ts']:.3f}{match.group(4)}{event['dur']:.3f}"

    return _STEP_TEXT.sub(edit, raw)


def nest_steps(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events with each step boundary moved out of the range it falls in, for the trace
    file. The profiler's steps end where the session's step ends, in the optimizer's step
    post-hook, inside ``Optimizer.step#...``; a trace viewer wants the ranges of a thread nested,
    so in the file the boundary moves to the end of the outermost range that holds it (the tail
    of ``optimizer.step()``, microseconds). The summary keeps torch's boundaries."""
    spans = [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]
    steps = sorted((e for e in spans if str(e.get("name", "")).startswith(STEP_PREFIX)),
                   key=lambda e: e["ts"])  # fmt: skip
    if not steps:
        return events
    lane = (steps[0].get("pid"), steps[0].get("tid"))
    mine = {id(e) for e in steps}
    others = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in spans
              if (e.get("pid"), e.get("tid")) == lane and id(e) not in mine]  # fmt: skip

    def outside(t: float) -> float:
        holders = [(start, end) for start, end in others if start < t < end]
        return min(holders)[1] if holders else t  # the outermost one's end

    def settled(t: float) -> float:
        """``t`` moved out of the ranges, and written with three decimals still out of them."""
        for _ in range(4):
            t = outside(t)
            for w in (_written(t), _written(t + 0.0005), _written(t - 0.0005)):
                if outside(w) == w:
                    return w
        return _written(t)

    moved = {}
    for step in steps:
        # As the file writes them (three decimals) and a viewer adds them up: a boundary at a
        # range's very start or end can round, or add up, one float step into it.
        ts = settled(float(step["ts"]))
        end = settled(float(step["ts"]) + float(step["dur"]))
        dur = _written(max(0.0, end - ts))
        for fix in (0.0, 0.001, -0.001, 0.002, -0.002):
            if outside(ts + (d := _written(max(0.0, dur + fix)))) == ts + d:
                dur = d
                break
        moved[id(step)] = {**step, "ts": ts, "dur": dur}
    return [moved.get(id(e), e) for e in events]


def _written(us: float) -> float:
    """A time in microseconds as the trace file holds it: three decimals."""
    return float(f"{us:.3f}")
