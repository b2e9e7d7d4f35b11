"""The profiler's output as plain data: the Chrome trace ``torch.profiler`` exports (written
gzip-compressed next to the run, for Perfetto) and its ``key_averages()`` rows, taken once the
profiler stopped. :mod:`.summary` works on this :class:`Capture` only, so its GPU paths are
tested with made-up events on a machine without a GPU.
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STEP_PREFIX = "ProfilerStep#"


@dataclass
class Capture:
    """What a stopped profiler recorded, as plain data."""

    events: list[dict[str, Any]]
    """The Chrome trace's ``traceEvents``."""
    averages: list[dict[str, Any]]
    """``key_averages()`` rows: name, calls, self/total CPU and device time (seconds), input
    shapes, flops, self CPU/device memory (bytes), user annotation or not."""
    steps: list[int]
    """The session's numbers of the profiled steps, in order (ProfilerStep#1 is the first)."""
    device: str = "cpu"
    main_thread: int = 0
    trace: str | None = None
    host: dict[str, Any] = field(default_factory=dict)
    memory_limit: int | None = None

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
        """Export the trace of a stopped ``torch.profiler.profile`` (gzip, into ``directory``),
        read it back, and take its ``key_averages()``."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        trace = directory / f"trace-{stamp}-{os.getpid()}.json.gz"
        with tempfile.TemporaryDirectory(prefix="tensordbg-trace-") as scratch:
            plain = Path(scratch) / "trace.json"
            profiler.export_chrome_trace(str(plain))
            with open(plain, "rb") as f:
                document = json.load(f)
        events = document.get("traceEvents", [])
        with gzip.open(trace, "wt", compresslevel=3, encoding="utf-8") as out:
            json.dump({**document, "traceEvents": nest_steps(events)}, out, separators=(",", ":"))
        averages = [
            key_average_row(row)
            for row in profiler.key_averages(group_by_input_shape=record_shapes)
        ]
        return cls(
            events, averages, list(steps), device, main_thread, str(trace), host, memory_limit
        )


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

    moved = {}
    for step in steps:
        start, end = float(step["ts"]), float(step["ts"]) + float(step["dur"])
        start, end = outside(start), outside(end)
        moved[id(step)] = {**step, "ts": start, "dur": max(0.0, end - start)}
    return [moved.get(id(e), e) for e in events]


def key_average_row(row: Any) -> dict[str, Any]:
    """One row of ``key_averages()`` as plain data (seconds, bytes)."""

    def get(*names: str) -> float:
        for name in names:
            value = getattr(row, name, None)
            if value is not None:
                return float(value)
        return 0.0

    shapes = getattr(row, "input_shapes", None)
    return {
        "name": row.key,
        "calls": int(row.count),
        "self_cpu": get("self_cpu_time_total") * 1e-6,
        "total_cpu": get("cpu_time_total") * 1e-6,
        "self_device": get("self_device_time_total", "self_cuda_time_total") * 1e-6,
        "total_device": get("device_time_total", "cuda_time_total") * 1e-6,
        "input_shapes": str(shapes) if shapes and any(shapes) else None,
        "flops": int(row.flops) if getattr(row, "flops", 0) else None,
        "self_cpu_memory": int(get("self_cpu_memory_usage")),
        "self_device_memory": int(get("self_device_memory_usage", "self_cuda_memory_usage")),
        "annotation": bool(getattr(row, "is_user_annotation", False)),
    }
