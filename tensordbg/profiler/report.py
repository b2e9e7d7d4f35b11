"""What a profile found, as plain data: the :class:`ProfileReport` the summary makes, the UI's
profiler tabs draw, a dump stores and a replay serves. Its dict form (:meth:`ProfileReport.to_dict`)
is what crosses the wire; it holds only dicts, lists, str, int, float, bool and None, so msgpack
carries it as it is.

Times are seconds, sizes bytes. ``breakdown`` has one row per profiled step whose categories add up
to its ``"total"`` (time paused on a hit is left out of every row and counted in
``paused_seconds``): ``tensordbg`` (the debugger's own hooks: its checks cost the step this),
``DataLoader``, ``forward``, ``backward``, ``optimizer`` and ``other`` on every device, and on a
GPU also ``kernel``, ``memcpy``, ``memset``, ``communication`` and ``runtime``. Each instant of a
step counts once, for the first of these that covers it: kernel, memcpy, memset, communication,
runtime, tensordbg, DataLoader, forward, backward, optimizer; what none covers is ``other`` (the
priority rule of the TensorBoard profiler plugin). The operators tensordbg's checks run (the
norms and sums they read) are left out of ``operators``: they are not the model's.

>>> report = session.profile(steps=5).wait(60)
>>> report.breakdown[0]["DataLoader"] / report.breakdown[0]["total"]
0.41
>>> ProfileReport.from_dict(report.to_dict()) == report
True
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field
from typing import Any

from tensordbg.offline.sentences import plural

VERSION = 1
TITLE = "tensordbg profile:"
"""How :meth:`ProfileReport.text` begins (``tensordbg demo`` finds a report in its training's
output by it)."""

# The categories of a breakdown row, in the order of the priority rule; "other" is the rest.
DEVICE_CATEGORIES = ("kernel", "memcpy", "memset", "communication", "runtime")
HOST_CATEGORIES = ("tensordbg", "DataLoader", "forward", "backward", "optimizer")
CHECKS_RANGE = "tensordbg: checks"
"""The range every hook of a watched training runs in while it is profiled
(:mod:`tensordbg.engine.marks`): the breakdown's ``tensordbg``."""
CATEGORIES = (*DEVICE_CATEGORIES, *HOST_CATEGORIES, "other")


@dataclass
class ProfileReport:
    """The summary of the profiled steps of one training (see the module docstring for the
    units and the breakdown's rule). Every field is plain data."""

    device: str = "cpu"
    steps: list[int] = field(default_factory=list)
    """The session's step numbers that were profiled (the warm-up step before them is not)."""
    breakdown: list[dict[str, Any]] = field(default_factory=list)
    """Per step: ``{"step": s, category: seconds, ..., "total": seconds}``."""
    operators: list[dict[str, Any]] = field(default_factory=list)
    """``{"name", "calls", "self_cpu", "total_cpu", "self_device", "total_device",
    "input_shapes", "flops", "range"}``, by self time (CPU + device), as ``key_averages()`` counts
    them; ``range``: a record_function range (the DataLoader's next batch), not an operator."""
    kernels: list[dict[str, Any]] = field(default_factory=list)
    """GPU kernels: ``{"name", "calls", "total", "mean", "max", "tensor_core"}``; empty on a CPU."""
    kernels_note: str | None = None
    """Why ``kernels`` is empty, when it is."""
    memory: dict[str, Any] = field(default_factory=dict)
    """``{"curve": [[t, allocated, reserved], ...], "peak_allocated", "peak_reserved", "limit",
    "top_operators": [{"name", "bytes", "calls"}, ...]}``."""
    timeline: dict[str, Any] = field(default_factory=dict)
    """``{"start": 0.0, "end": t, "lanes": [{"name", "spans": [[start, duration, name], ...]}]}``,
    times from the start of the first profiled step; at most 20,000 spans, the longest kept."""
    outliers: list[dict[str, Any]] = field(default_factory=list)
    """Steps much slower than the median: ``{"step", "total", "median", "ratio"}``."""
    advice: list[dict[str, Any]] = field(default_factory=list)
    """``{"rule", "evidence", "message", "value", "threshold"}``: what to change, and the measured
    number (``value``) against the rule's ``threshold`` that says so."""
    trace: str | None = None
    """The gzip Chrome trace of the profiled steps (Perfetto, ui.perfetto.dev, opens it)."""
    memory_snapshot: str | None = None
    """CUDA only: the allocator snapshot PyTorch's memory visualizer (pytorch.org/memory_viz)
    opens. torch writes it as a pickle; tensordbg never reads it back."""
    paused_seconds: float = 0.0
    """Time the training spent paused on hits during the profile, left out of the steps."""
    gpu_summary: dict[str, Any] | None = None
    """On a GPU: ``{"utilization", "tensor_core_share", "kernel_time", "kernels", "short_kernels",
    "h2d_bytes", "h2d_time"}`` (shares in 0..1) that the advisor reads; None on a CPU."""
    host: dict[str, Any] = field(default_factory=dict)
    """The process during the profile: ``{"threads", "interop_threads", "cores",
    "cpu_utilization", "rules", "sync"}`` (``cpu_utilization``: process CPU time over wall
    time, 1.0 = a core; ``rules``: how many rules the session had, 0 for
    ``tensordbg.profile``'s; ``sync``: its mode)."""
    message: str = ""
    """What the person should know about how the profile went (a shortened run, say)."""
    version: int = VERSION

    def to_dict(self) -> dict[str, Any]:
        """The report as plain data (what the UI draws and a dump stores)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProfileReport:
        """The report a :meth:`to_dict` made (fields it does not know are ignored, so a newer
        report still reads)."""
        if not isinstance(data, dict):
            raise ValueError(f"a profile report is a dict, not {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    @property
    def step_times(self) -> list[float]:
        return [row["total"] for row in self.breakdown]

    def share(self, category: str) -> float:
        """The fraction of the profiled steps' time ``category`` took (0 when it never ran)."""
        total = sum(self.step_times)
        if total <= 0:
            return 0.0
        return sum(row.get(category, 0.0) for row in self.breakdown) / total

    def text(self, operators: int = 8) -> str:
        """The report in a few lines for a terminal (``tensordbg run --profile`` prints it).

        >>> print(report.text())
        tensordbg profile: 5 steps (2..6) on cpu, median step 12.4 ms
          DataLoader 41.2 %  forward 20.3 %  backward 28.1 %  optimizer 6.0 %  other 4.4 %
        ...
        """
        times = sorted(self.step_times)
        if not times:
            return f"{TITLE} no step was profiled. {self.message}".rstrip()
        median = statistics.median(times)  # as the advice's (an even count's mean of the two)
        first, last = self.steps[0], self.steps[-1]
        span = f"{first}..{last}" if last != first else f"{first}"
        lines = [
            f"{TITLE} {plural(len(times), 'step')} ({span}) on {self.device}, "
            f"{'its' if len(times) == 1 else 'median'} step {_ms(median)}"
        ]
        shares = [(c, self.share(c)) for c in CATEGORIES]
        lines.append("  " + "  ".join(f"{c} {s:.1%}" for c, s in shares if s >= 0.0005))
        if self.paused_seconds:
            lines.append(f"  paused on hits: {self.paused_seconds:.2f} s (left out)")
        if self.operators:
            lines.append("  top operators (self time):")
            for op in self.operators[:operators]:
                own = op["self_cpu"] + op["self_device"]
                calls = "call " if op["calls"] == 1 else "calls"
                lines.append(f"    {_ms(own):>10}  {op['calls']:>6} {calls}  {op['name']}")
        memory = self.memory
        if memory.get("peak_allocated"):
            peak = f"  memory: peak {_bytes(memory['peak_allocated'])} allocated"
            if memory.get("limit"):
                peak += f" of {_bytes(memory['limit'])}"
            lines.append(peak)
        for outlier in self.outliers:
            lines.append(
                f"  step {outlier['step']}: {_ms(outlier['total'])}, "
                f"{outlier['ratio']:.1f}x the median"
            )
        if self.advice:
            lines.append("  advice:")
            for item in self.advice:
                lines.append(f"    [{item['rule']}] {item['evidence']}")
                lines.append(f"      {item['message']}")
        else:
            lines.append("  advice: none (no rule found a number past its threshold)")
        if self.trace:
            lines.append(f"  trace: {self.trace} (open it in https://ui.perfetto.dev)")
        if self.memory_snapshot:
            lines.append(
                f"  memory snapshot: {self.memory_snapshot} "
                "(open it in https://pytorch.org/memory_viz)"
            )
        if self.message:
            lines.append(f"  note: {self.message}")
        return "\n".join(lines)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
