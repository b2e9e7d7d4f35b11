"""The operator table, from the trace: calls, self and total CPU and device time, memory, per
operator name (and input shapes, when recorded), counted as ``key_averages()`` counts them.

``key_averages()`` is what people compare against, but the first call of it turns every event
into a Python object (seconds for a few steps of a real model); the trace already holds what it
needs. Per thread, events nest by time: an event's self time is its duration less its direct
children's; a kernel's time is its launching operator's self device time (the trace links them
through ``External id``) and counts in the total device time of every operator around it; a
``[memory]`` event's bytes are the innermost operator's at that instant. The tests check the
table against ``key_averages()`` of the same run.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from typing import Any

HOST_CATEGORIES = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver", "python_function")
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


class _Row:
    __slots__ = (
        "calls",
        "device_memory",
        "memory",
        "self_cpu",
        "self_device",
        "total_cpu",
        "total_device",
    )

    def __init__(self) -> None:
        self.calls = 0
        self.self_cpu = self.total_cpu = self.self_device = self.total_device = 0.0
        self.memory = self.device_memory = 0


def operator_rows(
    spans: list[dict[str, Any]],
    memory: list[dict[str, Any]],
    flops: dict[tuple[str, str | None], int] | None = None,
    by_shape: bool = False,
) -> list[dict[str, Any]]:
    """Rows like ``key_averages()``'s (times in seconds; ``self_cpu_memory`` and
    ``self_device_memory`` in bytes, net of frees) for the host events of ``spans``, with the
    device events they launched and the ``memory`` events made inside them. ``flops`` by
    operator name and shapes (:func:`kineto_flops`: the trace does not carry them)."""
    device_by_external: dict[Any, float] = defaultdict(float)
    for e in spans:
        if e.get("cat") in DEVICE_CATEGORIES:
            external = e.get("args", {}).get("External id")
            if external is not None:
                device_by_external[external] += float(e["dur"])
    threads: dict[tuple[Any, Any], list[dict[str, Any]]] = defaultdict(list)
    for e in spans:
        if e.get("cat") in HOST_CATEGORIES:
            threads[(e.get("pid"), e.get("tid"))].append(e)
    allocations: dict[tuple[Any, Any], list[dict[str, Any]]] = defaultdict(list)
    for e in memory:
        allocations[(e.get("pid"), e.get("tid"))].append(e)
    rows: dict[tuple[str, str | None], _Row] = defaultdict(_Row)
    for lane, events in threads.items():
        _walk(events, allocations.get(lane, []), device_by_external, rows, by_shape)
    # record_function's ranges (the DataLoader's next batch, an optimizer's step): rows as in
    # key_averages(), but no operator: what runs inside one without an operator (Python, a
    # sleep) is its self time.
    ranges = {e.get("name") for e in spans if e.get("cat") == "user_annotation"}
    out = []
    for (name, shapes), row in rows.items():
        out.append(
            {
                "name": name,
                "calls": row.calls,
                "self_cpu": row.self_cpu * 1e-6,
                "total_cpu": row.total_cpu * 1e-6,
                "self_device": row.self_device * 1e-6,
                "total_device": row.total_device * 1e-6,
                "input_shapes": shapes,
                "flops": (flops or {}).get((name, shapes)) or None,
                "self_cpu_memory": row.memory,
                "self_device_memory": row.device_memory,
                "range": name in ranges,
            }
        )
    return out


class _Frame:
    """An event on a thread's stack, kept until its parent closes (to merge it as torch does)."""

    __slots__ = (
        "children",
        "committed",
        "device",
        "device_memory",
        "end",
        "key",
        "memory",
        "start",
        "total_device",
    )

    def __init__(self, key: tuple[str, str | None], start: float, end: float, device: float):
        self.key, self.start, self.end, self.device = key, start, end, device
        self.children: list[_Frame] = []
        self.memory = self.device_memory = 0
        self.total_device = 0.0
        self.committed = False


def _walk(events: list[dict[str, Any]], allocations: list[dict[str, Any]],
          device_by_external: dict[Any, float], rows: dict[tuple[str, str | None], _Row],
          by_shape: bool) -> None:  # fmt: skip
    # Parents first at equal start: the longer event holds the shorter.
    events = sorted(events, key=lambda e: (float(e["ts"]), -float(e["dur"])))
    allocations = sorted(allocations, key=lambda e: float(e["ts"]))
    a = 0
    stack: list[_Frame] = []

    def commit(frame: _Frame) -> None:
        if frame.committed:  # a grandchild lifted by the merge below was counted already
            return
        frame.committed = True
        row = rows[frame.key]
        row.calls += 1
        row.total_cpu += frame.end - frame.start
        row.self_cpu += (frame.end - frame.start) - sum(c.end - c.start for c in frame.children)
        row.self_device += frame.device
        row.total_device += frame.total_device
        row.memory += frame.memory
        row.device_memory += frame.device_memory

    def close(until: float, end: float = -math.inf) -> None:
        # As torch builds its tree: an event is a child of the top of the stack only if it
        # starts before the top's end and does not end after it; otherwise the top is done.
        while stack and (stack[-1].end <= until or end > stack[-1].end):
            frame = stack.pop()
            # An operator whose only child has its name (an overload calling another) is one
            # call: torch's EventList drops the child and keeps its children and kernels.
            while len(frame.children) == 1 and frame.children[0].key[0] == frame.key[0]:
                child = frame.children[0]
                frame.children = child.children
                frame.device += child.device
            for child in frame.children:
                commit(child)
            frame.total_device = frame.device + sum(c.total_device for c in frame.children)
            if stack:
                stack[-1].children.append(frame)
            else:
                commit(frame)
                frame.children = []

    def allocate(until: float) -> None:
        nonlocal a
        while a < len(allocations) and float(allocations[a]["ts"]) < until:
            e = allocations[a]
            a += 1
            close(float(e["ts"]))
            if stack:
                args = e.get("args", {})
                if args.get("Device Type") == 0:
                    stack[-1].memory += int(args.get("Bytes", 0))
                else:
                    stack[-1].device_memory += int(args.get("Bytes", 0))

    for e in events:
        start, duration = float(e["ts"]), float(e["dur"])
        allocate(start)
        close(start, start + duration)
        args = e.get("args", {})
        shapes = str(args.get("Input Dims")) if by_shape and args.get("Input Dims") else None
        key = (str(e.get("name", "")), shapes)
        device = device_by_external.get(args.get("External id"), 0.0)
        stack.append(_Frame(key, start, start + duration, device))
    allocate(float("inf"))
    close(float("inf"))


def kineto_flops(profiler: Any, by_shape: bool = False) -> dict[tuple[str, str | None], int]:
    """FLOPs by operator name (and input shapes), as torch counted them while profiling
    (``with_flops``)."""
    out: dict[tuple[str, str | None], int] = defaultdict(int)
    try:
        events = profiler.profiler.kineto_results.events()
    except Exception:
        return {}
    for event in events:
        flops = event.flops()
        if flops:
            shapes = str(event.shapes()) if by_shape and event.shapes() else None
            out[(event.name(), shapes)] += int(flops)
    return dict(out)


def outside_range(spans: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """``spans`` less the host events made inside a range called ``name`` on their thread (the
    range itself is kept) and the device events those launched (linked by ``External id``)."""
    ranges: dict[tuple[Any, Any], list[tuple[float, float]]] = defaultdict(list)
    for e in spans:
        if e.get("name") == name and e.get("cat") in HOST_CATEGORIES:
            start = float(e["ts"])
            ranges[(e.get("pid"), e.get("tid"))].append((start, start + float(e["dur"])))
    if not ranges:
        return spans
    merged: dict[tuple[Any, Any], tuple[list[float], list[float]]] = {}
    for lane, intervals in ranges.items():
        starts: list[float] = []
        ends: list[float] = []
        for start, end in sorted(intervals):
            if ends and start <= ends[-1]:
                ends[-1] = max(ends[-1], end)
            else:
                starts.append(start)
                ends.append(end)
        merged[lane] = (starts, ends)
    kept, launched = [], set()
    for e in spans:
        lane = merged.get((e.get("pid"), e.get("tid")))
        if lane is not None and e.get("cat") in HOST_CATEGORIES and e.get("name") != name:
            start = float(e["ts"])
            i = bisect.bisect_right(lane[0], start) - 1
            if i >= 0 and start + float(e["dur"]) <= lane[1][i]:
                external = e.get("args", {}).get("External id")
                if external is not None:
                    launched.add(external)
                continue
        kept.append(e)
    if not launched:
        return kept
    return [e for e in kept if e.get("cat") not in DEVICE_CATEGORIES
            or e.get("args", {}).get("External id") not in launched]  # fmt: skip
