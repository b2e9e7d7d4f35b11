"""The advisor: rules over a :class:`~.report.ProfileReport` that say what to change.

A rule is a small class, like a watchpoint rule: a ``name``, a ``threshold``, and
:meth:`AdviceRule.check`, which measures one number of the report and returns an :class:`Advice`
(the number, the threshold, the evidence in words and the change to try) when the number is past
the threshold, else None. No advice without a number behind it. The built-in rules follow the
table of prior tools (TensorBoard's profiler plugin, SageMaker Debugger, Holistic Trace
Analysis); installed packages add rules through the entry-point group ``tensordbg.advisor`` (each
entry point names an :class:`AdviceRule` subclass, loaded once; one that fails is skipped with a
warning, as watchpoint rules are).

>>> class SlowStep(AdviceRule):
...     name, threshold = "SlowStep", 0.5
...     def check(self, report):
...         median = sorted(report.step_times)[len(report.step_times) // 2]
...         if median > self.threshold:
...             return self.advise(median, f"median step {median:.2f} s", "Profile deeper.")
>>> advise(report, rules=[SlowStep()])
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from importlib.metadata import entry_points
from typing import Any, ClassVar

from tensordbg.profiler.report import ProfileReport

ENTRY_POINT_GROUP = "tensordbg.advisor"


@dataclass
class Advice:
    rule: str
    evidence: str
    message: str
    value: float
    threshold: float


class AdviceRule:
    """One piece of advice and the measurement behind it. Subclasses set ``name`` and
    ``threshold`` and implement :meth:`check`."""

    name: ClassVar[str] = ""
    threshold: float = 0.0

    def __init__(self, threshold: float | None = None):
        if threshold is not None:
            self.threshold = float(threshold)

    def check(self, report: ProfileReport) -> Advice | None:
        raise NotImplementedError

    def advise(self, value: float, evidence: str, message: str) -> Advice:
        return Advice(
            self.name or type(self).__name__, evidence, message, float(value), float(self.threshold)
        )


def _pct(x: float) -> str:
    return f"{x * 100:.1f} %"


class ShareOfStep(AdviceRule):
    """Advice when one category of the step (:data:`~.report.CATEGORIES`) takes more than
    ``threshold`` of its time. Subclasses set ``category``, ``evidence`` (a format with
    ``{share}``) and implement :meth:`message`."""

    category: ClassVar[str] = ""
    evidence: ClassVar[str] = ""

    def check(self, report: ProfileReport) -> Advice | None:
        share = report.share(self.category)
        if share <= self.threshold:
            return None
        evidence = self.evidence.format(share=_pct(share))
        return self.advise(share, f"{evidence} (threshold {_pct(self.threshold)})",
                           self.message(report))  # fmt: skip

    def message(self, report: ProfileReport) -> str:
        raise NotImplementedError


class DataLoaderShare(ShareOfStep):
    """Loading batches takes a large share of the step (TensorBoard plugin: 5 %)."""

    name, threshold = "DataLoaderShare", 0.05
    category, evidence = "DataLoader", "DataLoader {share} of the step time"

    def message(self, report: ProfileReport) -> str:
        pin = (
            " pin_memory=True, and .to(device, non_blocking=True)" if report.device != "cpu" else ""
        )
        cores = int(report.host.get("cores") or 0)
        on = f" (this machine has {cores} cores)" if cores else ""
        if any("MultiProcessingDataLoaderIter" in op["name"] for op in report.operators):
            # It loads in worker processes already (the trace names the iterator).
            return (f"The DataLoader's workers do not keep up: more of them{on}, a larger "
                    f"prefetch_factor{pin}, or a cheaper __getitem__ (decode, then cache)."
                    )  # fmt: skip
        workers = max(1, min(4, cores - 1)) if cores else 4
        shared = " (on so few cores the workers share them with the training)" if cores and (
            cores <= 2) else ""  # fmt: skip
        return (
            "Load batches in parallel with the training: "
            f"DataLoader(num_workers={workers}, persistent_workers=True){pin}{shared}; "
            "or make the Dataset's __getitem__ cheaper."
        )


class LowGpuUtilization(AdviceRule):
    """The GPU runs kernels less than half of the step (union of kernel intervals)."""

    name, threshold = "LowGpuUtilization", 0.5

    def check(self, report: ProfileReport) -> Advice | None:
        gpu = report.gpu_summary
        if not gpu or gpu.get("utilization") is None or gpu["utilization"] >= self.threshold:
            return None
        util = gpu["utilization"]
        return self.advise(
            util,
            f"GPU busy with kernels {_pct(util)} of the step time "
            f"(threshold {_pct(self.threshold)})",
            "Give the GPU more work per "
            "launch: a larger batch size (scale the learning rate with it), or "
            "find what the host does between kernels in the trace.",
        )


class TensorCores(AdviceRule):
    """Matrix multiplies and convolutions run, but not on Tensor Cores (fp32): AMP."""

    name, threshold = "TensorCores", 0.05

    def check(self, report: ProfileReport) -> Advice | None:
        gpu = report.gpu_summary
        if not gpu or gpu.get("tensor_core_share") is None or not gpu.get("eligible_time"):
            return None
        share = gpu["tensor_core_share"]
        if share >= self.threshold:
            return None
        eligible = gpu["eligible_time"] * 1e3
        return self.advise(
            share,
            f"{eligible:.1f} ms of matrix multiply and convolution kernels, "
            f"{_pct(share)} of kernel time on Tensor Cores (threshold "
            f"{_pct(self.threshold)})",
            "Train in mixed precision: "
            "with torch.autocast('cuda', dtype=torch.bfloat16): (or float16 with a "
            "GradScaler); or torch.backends.cuda.matmul.allow_tf32 = True.",
        )


class MemoryNearLimit(AdviceRule):
    """Peak memory close to the device's (90 %)."""

    name, threshold = "MemoryNearLimit", 0.9

    def check(self, report: ProfileReport) -> Advice | None:
        memory = report.memory
        limit = memory.get("limit")
        peak = memory.get("peak_reserved") or memory.get("peak_allocated")
        if not limit or not peak:
            return None
        share = peak / limit
        if share <= self.threshold:
            return None
        return self.advise(
            share,
            f"peak memory {peak / 2**30:.2f} GiB, {_pct(share)} of "
            f"{limit / 2**30:.1f} GiB (threshold {_pct(self.threshold)})",
            "Free memory before it runs out: activation checkpointing "
            "(torch.utils.checkpoint) on the largest blocks, mixed precision, "
            "or a smaller batch with gradient accumulation.",
        )


class HostToDeviceCopies(AdviceRule):
    """Host-to-device copies take a noticeable share of the step."""

    name, threshold = "HostToDeviceCopies", 0.1

    def check(self, report: ProfileReport) -> Advice | None:
        gpu = report.gpu_summary
        if not gpu or not gpu.get("step_time"):
            return None
        share = gpu["h2d_time"] / gpu["step_time"]
        if share <= self.threshold:
            return None
        mib = gpu.get("h2d_bytes", 0) / 2**20
        return self.advise(
            share,
            f"host-to-device copies {_pct(share)} of the step time "
            f"({mib:.1f} MiB; threshold {_pct(self.threshold)})",
            "Send fewer "
            "bytes: keep images as uint8 on the host and convert and normalize on "
            "the GPU (4x fewer bytes than float32); pin_memory=True with "
            "non_blocking=True copies overlap with compute.",
        )


class LaunchBound(AdviceRule):
    """Most kernels are shorter than their launch: the host cannot keep the GPU fed."""

    name, threshold = "LaunchBound", 0.5

    def check(self, report: ProfileReport) -> Advice | None:
        gpu = report.gpu_summary
        if not gpu or gpu.get("kernels", 0) < 100:
            return None
        share = gpu["short_kernels"] / gpu["kernels"]
        if share <= self.threshold:
            return None
        return self.advise(
            share,
            f"{_pct(share)} of {gpu['kernels']} kernels ran shorter than "
            f"10 us or than their launch (threshold {_pct(self.threshold)})",
            "Launch fewer, larger kernels: torch.compile(model) fuses them, CUDA "
            "graphs (mode='reduce-overhead') remove the launch cost.",
        )


class Communication(ShareOfStep):
    """Collective communication takes a large share of the step (10 %)."""

    name, threshold = "Communication", 0.1
    category, evidence = "communication", "communication {share} of the step time"

    def message(self, report: ProfileReport) -> str:
        return (
            "Communicate less often: gradient "
            "accumulation (no_sync() between), or a larger batch per rank."
        )


class StepOutlier(AdviceRule):
    """A step much slower than the median of the profiled steps."""

    name, threshold = "StepOutlier", 1.5

    def check(self, report: ProfileReport) -> Advice | None:
        if not report.outliers:
            return None
        worst = max(report.outliers, key=lambda o: o["ratio"])
        if worst["ratio"] <= self.threshold:
            return None
        row = next((r for r in report.breakdown if r["step"] == worst["step"]), {})
        parts = {k: v for k, v in row.items() if k not in ("step", "total")}
        heaviest = max(parts, key=parts.get) if parts else "?"
        return self.advise(
            worst["ratio"],
            f"step {worst['step']} took "
            f"{worst['total'] * 1e3:.1f} ms, {worst['ratio']:.1f}x the median "
            f"{worst['median'] * 1e3:.1f} ms (threshold {self.threshold:g}x); most "
            f"of it {heaviest}",
            f"Look at what step {worst['step']} did "
            "differently (its batch, a checkpoint, an evaluation, garbage "
            "collection) in the Profile tab's Timeline view or the trace.",
        )


class CpuHotOperator(AdviceRule):
    """On a CPU: one operator takes most of the operator time."""

    name, threshold = "CpuHotOperator", 0.3

    def check(self, report: ProfileReport) -> Advice | None:
        # Operators only: a record_function range's self time is whatever ran in it that no
        # operator did (a DataLoader's __getitem__, a sleep), which no fused kernel speeds up.
        operators = [op for op in report.operators if not op.get("range")]
        if report.device != "cpu" or not operators:
            return None
        total = sum(op["self_cpu"] for op in operators)
        top = max(operators, key=lambda op: op["self_cpu"])
        share = top["self_cpu"] / total if total > 0 else 0.0
        if share <= self.threshold:
            return None
        return self.advise(
            share,
            f"{top['name']} {_pct(share)} of the operators' CPU time "
            f"({top['calls']} calls; threshold {_pct(self.threshold)})",
            f"Make {top['name']} cheaper or rarer: fewer calls (batch them), "
            "smaller shapes, or a fused version (torch.compile on the CPU).",
        )


class CpuThreads(AdviceRule):
    """On a CPU: the intra-op thread pool uses fewer cores than the process may use."""

    name, threshold = "CpuThreads", 0.5

    def check(self, report: ProfileReport) -> Advice | None:
        host = report.host
        threads, cores = host.get("threads"), host.get("cores")
        if report.device != "cpu" or not threads or not cores:
            return None
        share = threads / cores
        if share > 1:  # more threads than cores: they take turns, and every operator waits
            return self.advise(
                share,
                f"torch uses {threads} threads for an operator on {cores} cores "
                f"({_pct(share)} of them; above 100 % they take turns)",
                f"torch.set_num_threads({cores}) (or OMP_NUM_THREADS={cores}), fewer if other "
                "processes share the cores.",
            )
        if cores < 2 or share >= self.threshold:
            return None
        return self.advise(
            share,
            f"torch uses {threads} of {cores} cores for an operator "
            f"({_pct(share)}; threshold {_pct(self.threshold)})",
            f"torch.set_num_threads({cores}) (or OMP_NUM_THREADS={cores}) unless "
            "other processes need those cores.",
        )


class CpuBound(AdviceRule):
    """On a GPU: the GPU idles while the process keeps a core busy (SageMaker CPUBottleneck)."""

    name, threshold = "CpuBound", 0.9

    def check(self, report: ProfileReport) -> Advice | None:
        gpu, cpu = report.gpu_summary, report.host.get("cpu_utilization")
        if not gpu or cpu is None or gpu.get("utilization", 1.0) >= 0.1 or cpu <= self.threshold:
            return None
        return self.advise(
            cpu,
            f"the process kept {_pct(cpu)} of a core busy while the GPU ran "
            f"kernels {_pct(gpu['utilization'])} of the time (threshold "
            f"{_pct(self.threshold)} CPU, 10 % GPU)",
            "The input pipeline or "
            "Python code is the bottleneck: move preprocessing into DataLoader "
            "workers or onto the GPU.",
        )


class OutsideThePhases(ShareOfStep):
    """Much of the step is none of loading, forward, backward or the optimizer: the loop's own
    Python between them (Holistic Trace Analysis counts such host time against the step). An
    operator's advice would miss it: no operator runs then."""

    name, threshold = "OutsideThePhases", 0.3
    category = "other"
    evidence = "{share} of the step is outside the DataLoader, forward, backward and optimizer"

    def message(self, report: ProfileReport) -> str:
        return (
            "See what the training loop does between them (the trace's gaps): logging, "
            ".item() or .cpu() every step, preprocessing outside the DataLoader, a sleep; do it "
            "every N steps, or in DataLoader workers."
        )


class DebuggerShare(ShareOfStep):
    """tensordbg's own hooks take much of the step: the checks cost more than a run left on
    should (a small model, whose steps are short against the hooks' fixed cost per module)."""

    name, threshold = "DebuggerShare", 0.1
    category = "tensordbg"
    evidence = "tensordbg's own checks take {share} of the step"

    def message(self, report: ProfileReport) -> str:
        if report.host.get("rules") == 0:  # tensordbg.profile: nothing to check less often
            return (
                "This session only profiles, yet its hooks keep their bookkeeping of every "
                "module call and gradient (a cost per call, large on a small model's short "
                "steps): profile with torch.profiler alone to measure the bare training."
            )
        cheaper = {"eager": "; or sync='deferred' (the CPU's default, the cheapest)",
                   "batched": "; or, on the CPU, sync='deferred' (the cheapest)"}  # fmt: skip
        return (
            "Check less often: attach(..., interval=N) screens NaN/Inf every step and the other "
            "statistics every N-th; exclude= modules you do not need watched"
            f"{cheaper.get(report.host.get('sync', ''), '')}."
        )


BUILTIN: tuple[type[AdviceRule], ...] = (
    DataLoaderShare,
    OutsideThePhases,
    DebuggerShare,
    LowGpuUtilization,
    TensorCores,
    MemoryNearLimit,
    HostToDeviceCopies,
    LaunchBound,
    Communication,
    StepOutlier,
    CpuHotOperator,
    CpuThreads,
    CpuBound,
)

_installed: list[type[AdviceRule]] | None = None


def available_rules() -> list[type[AdviceRule]]:
    """The built-in rules and those of the ``tensordbg.advisor`` entry points (loaded once)."""
    global _installed
    if _installed is None:
        loaded = []
        for point in entry_points(group=ENTRY_POINT_GROUP):
            try:
                cls = point.load()
                if not (isinstance(cls, type) and issubclass(cls, AdviceRule)):
                    raise TypeError("it is not an AdviceRule subclass")
                loaded.append(cls)
            except Exception as e:
                warnings.warn(
                    f"tensordbg: the advisor rule {point.name} ({point.value}) did not load: {e}",
                    RuntimeWarning,
                    stacklevel=2,
                )
        _installed = loaded
    return [*BUILTIN, *_installed]


def advise(
    report: ProfileReport, rules: Iterable[AdviceRule] | None = None
) -> list[dict[str, Any]]:
    """Run the rules over a report; the advice as plain dicts, in the rules' order. A rule that
    raises is skipped with a warning (a report is never lost over a rule)."""
    chosen = list(rules) if rules is not None else [cls() for cls in available_rules()]
    found = []
    for rule in chosen:
        try:
            advice = rule.check(report)
        except Exception as e:
            warnings.warn(
                f"tensordbg: the advisor rule {type(rule).__name__} raised "
                f"{type(e).__name__}: {e}; skipped",
                RuntimeWarning,
                stacklevel=2,
            )
            continue
        if advice is not None:
            found.append(asdict(advice))
    return found
