"""What a source says of profiling (``tensordbg.profiler``): the report, the request that
starts one, GPU samples (part of the protocol: :mod:`tensordbg.sources.schema` has the rest)."""

from __future__ import annotations

import sys
from typing import Any, Literal

if sys.version_info >= (3, 11):
    from typing import NotRequired, TypedDict
else:  # typing's TypedDict learnt NotRequired in 3.11
    from typing_extensions import NotRequired, TypedDict


class ProfilePending(TypedDict):
    """The reply to ``profile``: the next ``steps`` steps will be profiled (after one warm-up)."""

    pending: bool
    steps: int


class BreakdownRow(TypedDict, total=False):
    """One profiled step: seconds per category (they add up to ``total``; ``tensordbg``: its own
    hooks); ``kernel``, ``memcpy``, ``memset``, ``communication`` and ``runtime`` on a GPU."""

    step: int
    tensordbg: float
    DataLoader: float
    forward: float
    backward: float
    optimizer: float
    other: float
    total: float
    kernel: float
    memcpy: float
    memset: float
    communication: float
    runtime: float


class OperatorRow(TypedDict):
    name: str
    calls: int
    self_cpu: float
    total_cpu: float
    self_device: float
    total_device: float
    input_shapes: str | None
    flops: int | None
    range: NotRequired[bool]  # a record_function range, not an operator (absent before)


class KernelRow(TypedDict):
    name: str
    calls: int
    total: float
    mean: float
    max: float
    tensor_core: bool | None


class MemoryOperator(TypedDict):
    name: str
    bytes: int
    calls: int


class ProfileMemory(TypedDict):
    curve: list[list[float | int | None]]  # [t, allocated, reserved]
    peak_allocated: int
    peak_reserved: int | None
    limit: int | None
    top_operators: list[MemoryOperator]


class TimelineLane(TypedDict):
    name: str
    spans: list[list[float | str]]  # [start, duration, name]


class Timeline(TypedDict):
    start: float
    end: float
    lanes: list[TimelineLane]


class Outlier(TypedDict):
    step: int
    total: float
    median: float
    ratio: float


class Advice(TypedDict):
    rule: str
    evidence: str  # the measured number against the threshold, in words
    message: str  # the change to try
    value: float
    threshold: float


class ProfileReport(TypedDict):
    """:meth:`tensordbg.profiler.report.ProfileReport.to_dict` (see there for the fields)."""

    version: int
    device: str
    steps: list[int]
    breakdown: list[BreakdownRow]
    operators: list[OperatorRow]
    kernels: list[KernelRow]
    kernels_note: str | None
    memory: ProfileMemory
    timeline: Timeline
    outliers: list[Outlier]
    advice: list[Advice]
    trace: str | None
    memory_snapshot: str | None
    paused_seconds: float
    gpu_summary: dict[str, Any] | None
    host: dict[str, Any]
    message: str


class GpuDevice(TypedDict):
    index: int
    name: str
    memory_total: int | None


class GpuSample(TypedDict):
    """One NVML reading of one device; a field the device does not report is None."""

    t: float  # time.time()
    device: int
    util: float | None  # % of the time a kernel ran
    mem_util: float | None
    memory_used: int | None
    power_w: float | None
    temp_c: float | None
    sm_clock_mhz: float | None
    mem_clock_mhz: float | None
    pcie_tx_kbs: float | None
    pcie_rx_kbs: float | None


class GpuEvent(TypedDict):
    t: float
    device: int
    kind: Literal["xid", "ecc", "lost"]
    detail: str


class Gpu(TypedDict):
    """The reply to ``gpu``: NVML samples newer than ``since``, from the training's sampler."""

    available: bool
    reason: str | None  # why not, when not: "NVML unavailable: <reason>"
    devices: list[GpuDevice]
    samples: list[GpuSample]
    events: list[GpuEvent]


class ProfileEvent(TypedDict):
    """Pushed when a profile starts, ends, fails or is cancelled."""

    state: Literal["running", "done", "failed", "cancelled"]
    step: int
    steps: int
    message: str
