"""Summary: from what ``torch.profiler`` recorded to a :class:`~.report.ProfileReport`.

The input is the Chrome trace the profiler exports (:class:`.trace.Capture`: every event with
its category: ``cpu_op``, ``user_annotation``, ``kernel``, ``gpu_memcpy``, ``gpu_memset``,
``cuda_runtime``, ``[memory]``...); the operator table is counted from it as ``key_averages()``
counts (:mod:`.operators`). Everything below works on plain dicts, so the GPU paths are tested
with made-up kernel events on a machine without one.

Per step (a ``ProfilerStep#k`` range), each instant of the step's wall time is given to the first
category that covers it: kernel, memcpy, memset, communication (NCCL kernels), runtime (CUDA API
calls), tensordbg (its hooks: what the debugger costs), DataLoader, forward, backward,
optimizer; the rest is other. Time paused on a hit
(``tensordbg: paused``) is taken out first and counted apart.
"""

from __future__ import annotations

import bisect
import heapq
import math
import statistics
from collections import defaultdict
from typing import Any

from tensordbg.profiler.operators import operator_rows, outside_range
from tensordbg.profiler.report import CATEGORIES, CHECKS_RANGE, DEVICE_CATEGORIES, ProfileReport
from tensordbg.profiler.trace import STEP_PREFIX, Capture, nest_steps

MAX_SPANS = 20_000
MAX_CURVE = 2_000
MAX_OPERATORS = 2_000
MAX_KERNELS = 500
OUTLIER_RATIO = 1.5
"""A step this many times slower than the median of the profiled steps is an outlier."""
SHORT_KERNEL = 10e-6
"""A kernel shorter than this (or than its own launch call) is launch-bound."""

DATALOADER_PREFIX = "enumerate(DataLoader)"
OURS = "tensordbg: "
HOST_RANGES = {
    CHECKS_RANGE: "tensordbg",
    "tensordbg: forward": "forward",
    "tensordbg: backward": "backward",
    "tensordbg: optimizer": "optimizer",
}
PAUSED = "tensordbg: paused"
# Kernel names that mark Tensor Core use (HMMA/IMMA instruction shapes, CUTLASS and cuBLAS
# tensor-op kernels, Hopper's warp-group MMA, flash attention).
TENSOR_CORE_MARKS = (
    "884",
    "1688",
    "16816",
    "hmma",
    "imma",
    "wgmma",
    "tensorop",
    "xmma_gemm_bf16",
    "xmma_gemm_f16",
    "_bf16",
    "_f16",
    "fp16",
    "bf16",
    "flash_",
    "fmha",
    "gemmk1",
    "sm90_",
    "s16816",
    "h16816",
    "cutlass_80",
    "tf32",
)
TENSOR_CORE_ELIGIBLE = (
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::matmul",
    "aten::linear",
    "aten::convolution",
    "aten::_convolution",
    "aten::cudnn_convolution",
    "aten::_scaled_dot_product",
)


def summarize(capture: Capture) -> ProfileReport:
    """The report of a capture (advice is the advisor's: :func:`~.advisor.advise`)."""
    spans, memory_events = [], []
    for e in capture.events:  # one pass: a trace of a few steps holds 10^5 events
        ph = e.get("ph")
        if ph == "X":
            if "dur" in e and "ts" in e:
                spans.append(e)
        elif ph == "i" and e.get("name") == "[memory]":
            memory_events.append(e)
    _trim_optimizer_steps(spans)
    step_spans = _steps(spans, len(capture.steps))
    cuda = capture.device != "cpu"
    report = ProfileReport(
        device=capture.device,
        steps=capture.steps[: len(step_spans)],
        trace=capture.trace,
        host=capture.host,
    )
    if not step_spans:
        report.message = "the trace holds no complete step"
        return report
    window = (step_spans[0][0], step_spans[-1][1])
    intervals, paused = _categories(spans, cuda)
    report.breakdown = _breakdown(report.steps, step_spans, intervals, paused, cuda)
    report.paused_seconds = sum(_overlap(paused, s, e) for s, e in step_spans) * 1e-6
    if capture.averages is None:
        # Counted on the steps nested as in the trace file: the step boundary inside
        # optimizer.step() would otherwise cut that call's children away from it.
        # tensordbg's own reads are not the model's operators: the breakdown counts them.
        nested = outside_range(nest_steps(spans), CHECKS_RANGE)
        capture.averages = operator_rows(nested, memory_events, capture.flops, capture.by_shape)
    report.operators = _operators(capture.averages)
    report.kernels, report.kernels_note = _kernels(spans, window, cuda)
    report.memory = _memory(capture, memory_events, window)
    names = _step_names(spans, report.steps)
    report.timeline = _timeline(spans, window, capture.main_thread, names)
    report.outliers = _outliers(report.breakdown)
    if cuda:
        report.gpu_summary = _gpu_summary(spans, step_spans, paused, capture.averages)
    return report


# --- steps and categories ------------------------------------------------------------------


def _trim_optimizer_steps(spans: list[dict[str, Any]]) -> None:
    """Cut each ``Optimizer.step#...`` span of torch at the end of tensordbg's optimizer range
    within it. torch's span holds the step's post-hooks, where the profiler's step boundary is
    marked and, after the last profiled step, the profiler itself stops: milliseconds that are
    the profiler's, not the optimizer's (the last step's Adam.step measured 5.3 ms against
    0.8 ms for the others). tensordbg's range closes just before them."""
    ours: dict[Any, list[tuple[float, float]]] = {}
    for e in spans:
        if e.get("name") == "tensordbg: optimizer":
            ours.setdefault(e.get("tid"), []).append((e["ts"], e["ts"] + e["dur"]))
    for e in spans:
        if not str(e.get("name", "")).startswith("Optimizer.step#"):
            continue
        start, end = e["ts"], e["ts"] + e["dur"]
        for inner_start, inner_end in ours.get(e.get("tid"), ()):
            if start <= inner_start and inner_end < end:
                e["dur"] = inner_end - start
                break


def _steps(spans: list[dict[str, Any]], count: int) -> list[tuple[float, float]]:
    """The profiled steps' [start, end) in trace microseconds, ProfilerStep#1 first."""
    found: dict[int, tuple[float, float]] = {}
    for e in spans:
        name = e.get("name", "")
        if name.startswith(STEP_PREFIX) and e.get("cat") == "user_annotation":
            try:
                k = int(name[len(STEP_PREFIX) :])
            except ValueError:
                continue
            found[k] = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
    if not found:
        return []
    first = min(found)
    return [found[k] for k in range(first, first + count) if k in found]


def _category(e: dict[str, Any], cuda: bool) -> str | None:
    cat = e.get("cat", "")
    name = e.get("name", "")
    if cuda:
        if cat == "kernel":
            return "communication" if name.lower().startswith("nccl") else "kernel"
        if cat == "gpu_memcpy":
            return "memcpy"
        if cat == "gpu_memset":
            return "memset"
        if cat in ("cuda_runtime", "cuda_driver"):
            return "runtime"
    if cat == "user_annotation":
        if name.startswith(DATALOADER_PREFIX):
            return "DataLoader"
        return HOST_RANGES.get(name)
    return None


Intervals = list[tuple[float, float]]


def _categories(spans: list[dict[str, Any]], cuda: bool) -> tuple[dict[str, Intervals], Intervals]:
    raw: dict[str, Intervals] = defaultdict(list)
    paused: Intervals = []
    for e in spans:
        start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        if e.get("name") == PAUSED:
            paused.append((start, end))
            continue
        category = _category(e, cuda)
        if category is not None:
            raw[category].append((start, end))
    return {k: _merge(v) for k, v in raw.items()}, _merge(paused)


def _merge(intervals: Intervals) -> Intervals:
    out: Intervals = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def _clip(intervals: Intervals, start: float, end: float) -> Intervals:
    """The parts of merged ``intervals`` inside [start, end)."""
    i = bisect.bisect_left(intervals, (start, -math.inf))
    if i > 0 and intervals[i - 1][1] > start:
        i -= 1
    out = []
    while i < len(intervals) and intervals[i][0] < end:
        s, e = max(intervals[i][0], start), min(intervals[i][1], end)
        if e > s:
            out.append((s, e))
        i += 1
    return out


def _subtract(base: Intervals, cut: Intervals) -> Intervals:
    out: Intervals = []
    j = 0
    for start, end in base:
        while j < len(cut) and cut[j][1] <= start:
            j += 1
        k, cursor = j, start
        while k < len(cut) and cut[k][0] < end:
            if cut[k][0] > cursor:
                out.append((cursor, cut[k][0]))
            cursor = max(cursor, cut[k][1])
            k += 1
        if cursor < end:
            out.append((cursor, end))
    return out


def _length(intervals: Intervals) -> float:
    return sum(e - s for s, e in intervals)


def _overlap(intervals: Intervals, start: float, end: float) -> float:
    return _length(_clip(intervals, start, end))


def _intersect(a: Intervals, b: Intervals) -> Intervals:
    return _subtract(a, _subtract(a, b))


def _breakdown(
    steps: list[int],
    step_spans: Intervals,
    intervals: dict[str, Intervals],
    paused: Intervals,
    cuda: bool,
) -> list[dict[str, Any]]:
    rows = []
    for step, (start, end) in zip(steps, step_spans, strict=False):
        left = _subtract([(start, end)], _clip(paused, start, end))
        row: dict[str, Any] = {"step": step}
        for category in CATEGORIES[:-1]:
            if category in DEVICE_CATEGORIES and not cuda:
                continue
            covered = _intersect(left, _clip(intervals.get(category, []), start, end))
            row[category] = _length(covered) * 1e-6
            left = _subtract(left, covered)
        row["other"] = _length(left) * 1e-6
        row["total"] = sum(v for k, v in row.items() if k != "step")
        rows.append(row)
    return rows


# --- tables --------------------------------------------------------------------------------


def _operators(averages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for a in averages:
        name = a["name"]
        if name.startswith(("ProfilerStep", OURS)):
            continue  # the steps and our own ranges are the breakdown, not operators
        rows.append(
            {
                k: a[k]
                for k in (
                    "name",
                    "calls",
                    "self_cpu",
                    "total_cpu",
                    "self_device",
                    "total_device",
                    "input_shapes",
                    "flops",
                )
            }
            | {"range": bool(a.get("range"))}  # averages of a trace with no ranges lack it
        )
    rows.sort(key=lambda r: r["self_cpu"] + r["self_device"], reverse=True)
    return rows[:MAX_OPERATORS]


def tensor_core(name: str) -> bool:
    """Whether a kernel's name marks Tensor Core use (a heuristic on the names NVIDIA's
    libraries give their kernels)."""
    lowered = name.lower()
    return any(mark in lowered for mark in TENSOR_CORE_MARKS)


def _kernels(
    spans: list[dict[str, Any]], window: tuple[float, float], cuda: bool
) -> tuple[list[dict[str, Any]], str | None]:
    if not cuda:
        return [], "profiled on the CPU: no kernels"
    grouped: dict[str, list[float]] = defaultdict(list)
    kinds: dict[str, str] = {}
    for e in spans:
        cat = e.get("cat")
        if cat in ("kernel", "gpu_memcpy", "gpu_memset") and window[0] <= e["ts"] < window[1]:
            grouped[e["name"]].append(float(e["dur"]) * 1e-6)
            kinds[e["name"]] = cat
    if not grouped:
        return [], "no GPU kernel ran in the profiled steps"
    rows = []
    for name, durations in grouped.items():
        total = sum(durations)
        rows.append(
            {
                "name": name,
                "calls": len(durations),
                "total": total,
                "mean": total / len(durations),
                "max": max(durations),
                "tensor_core": tensor_core(name) if kinds[name] == "kernel" else None,
            }
        )
    rows.sort(key=lambda r: r["total"], reverse=True)
    return rows[:MAX_KERNELS], None


def _memory(
    capture: Capture, events: list[dict[str, Any]], window: tuple[float, float]
) -> dict[str, Any]:
    cuda = capture.device != "cpu"
    wanted_type = 1 if cuda else 0  # the trace's "Device Type": 0 CPU, 1 CUDA
    points = []
    for e in events:
        if not window[0] <= e.get("ts", -1) < window[1]:
            continue
        args = e.get("args", {})
        if args.get("Device Type") != wanted_type:
            continue
        reserved = args.get("Total Reserved") if cuda else None
        points.append(
            [
                (e["ts"] - window[0]) * 1e-6,
                int(args.get("Total Allocated", 0)),
                None if reserved is None else int(reserved),
            ]
        )
    points.sort(key=lambda p: p[0])
    peak_allocated = max((p[1] for p in points), default=0)
    reserved_values = [p[2] for p in points if p[2] is not None]
    top = []
    key = "self_device_memory" if cuda else "self_cpu_memory"
    for a in capture.averages:
        if a[key] > 0 and not a["name"].startswith(("ProfilerStep", OURS)):
            top.append({"name": a["name"], "bytes": int(a[key]), "calls": a["calls"]})
    top.sort(key=lambda r: r["bytes"], reverse=True)
    return {
        "curve": _thin(points, MAX_CURVE),
        "peak_allocated": int(peak_allocated),
        "peak_reserved": max(reserved_values) if reserved_values else None,
        "limit": capture.memory_limit,
        "top_operators": top[:20],
    }


def _thin(points: list[list[Any]], limit: int) -> list[list[Any]]:
    """At most ``limit`` points, keeping the highest allocation of each run of points merged."""
    if len(points) <= limit:
        return points
    size = math.ceil(len(points) / limit)
    return [max(points[i : i + size], key=lambda p: p[1]) for i in range(0, len(points), size)]


def _step_names(spans: list[dict[str, Any]], steps: list[int]) -> dict[str, str]:
    """``ProfilerStep#k`` -> ``step N``: the profiler numbers its steps from 1, the Timeline
    names them as the training does (its header says "steps 507-511")."""
    ks = sorted({int(n[len(STEP_PREFIX) :]) for e in spans
                 if (n := str(e.get("name", ""))).startswith(STEP_PREFIX)
                 and n[len(STEP_PREFIX) :].isdigit()})  # fmt: skip
    return {f"{STEP_PREFIX}{k}": f"step {step}" for k, step in zip(ks, steps, strict=False)}


def _timeline(
    spans: list[dict[str, Any]], window: tuple[float, float], main_thread: int,
    step_names: dict[str, str] | None = None,
) -> dict[str, Any]:  # fmt: skip
    start, end = window
    inside = [e for e in spans if e.get("cat") not in (None, "Trace")
              and e["ts"] < end and e["ts"] + e["dur"] > start]  # fmt: skip
    if len(inside) > MAX_SPANS:  # the longest are kept
        inside = heapq.nlargest(MAX_SPANS, inside, key=lambda e: e["dur"])
    kept: dict[tuple[Any, Any], list[list[Any]]] = defaultdict(list)
    gpu_lanes: set[tuple[Any, Any]] = set()
    for e in inside:
        s0, s1 = max(float(e["ts"]), start), min(float(e["ts"]) + float(e["dur"]), end)
        key = (e.get("pid"), e.get("tid"))
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"):
            gpu_lanes.add(key)
        name = str(e.get("name", ""))
        kept[key].append([(s0 - start) * 1e-6, (s1 - s0) * 1e-6,
                          (step_names or {}).get(name, name)])  # fmt: skip
    devices = {pid for pid, _ in gpu_lanes}
    out = []
    for key in sorted(kept, key=lambda k: (k in gpu_lanes, str(k))):
        pid, tid = key
        if key in gpu_lanes:
            name = f"stream {tid}" if len(devices) == 1 else f"gpu {pid} stream {tid}"
        else:
            name = f"thread {tid}" + (" (main)" if tid == main_thread else "")
        out.append({"name": name, "spans": sorted(kept[key], key=lambda s: s[0])})
    return {"start": 0.0, "end": (end - start) * 1e-6, "lanes": out}


def _outliers(breakdown: list[dict[str, Any]]) -> list[dict[str, Any]]:
    totals = [row["total"] for row in breakdown]
    if len(totals) < 3:
        return []
    median = statistics.median(totals)
    out = []
    for row in breakdown:
        ratio = row["total"] / median if median > 0 else 0.0
        if ratio > OUTLIER_RATIO:
            out.append(
                {"step": row["step"], "total": row["total"], "median": median, "ratio": ratio}
            )
    return out


def _gpu_summary(
    spans: list[dict[str, Any]],
    step_spans: Intervals,
    paused: Intervals,
    averages: list[dict[str, Any]],
) -> dict[str, Any]:
    steps = _subtract(_merge(step_spans), paused)
    span_time = _length(steps)
    kernels = [e for e in spans if e.get("cat") == "kernel"]
    busy = _intersect(_merge([(e["ts"], e["ts"] + e["dur"]) for e in kernels]), steps)
    kernel_time = sum(float(e["dur"]) for e in kernels)
    core_time = sum(float(e["dur"]) for e in kernels if tensor_core(e["name"]))
    launches = {
        e.get("args", {}).get("correlation"): float(e["dur"])
        for e in spans
        if e.get("cat") == "cuda_runtime" and "Launch" in e.get("name", "")
    }
    short = 0
    for e in kernels:
        launch = launches.get(e.get("args", {}).get("correlation"))
        if float(e["dur"]) < SHORT_KERNEL * 1e6 or (launch is not None and e["dur"] < launch):
            short += 1
    copies = [e for e in spans if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "")]
    eligible = sum(a["self_device"] for a in averages if a["name"].startswith(TENSOR_CORE_ELIGIBLE))
    return {
        "utilization": _length(busy) / span_time if span_time > 0 else 0.0,
        "tensor_core_share": core_time / kernel_time if kernel_time > 0 else None,
        "eligible_time": eligible,
        "kernel_time": kernel_time * 1e-6,
        "kernels": len(kernels),
        "short_kernels": short,
        "h2d_bytes": int(sum(e.get("args", {}).get("bytes", 0) or 0 for e in copies)),
        "h2d_time": sum(float(e["dur"]) for e in copies) * 1e-6,
        "step_time": span_time * 1e-6,
    }
