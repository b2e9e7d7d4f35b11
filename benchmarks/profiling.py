"""What profiling costs: a profiled step against a bare one, the summary of 5 steps, the NVML
sampler.

    python benchmarks/profiling.py                 # CPU, overhead.py's encoder-256 model
    python benchmarks/profiling.py --device cuda   # its GPT-2 small in bf16

1. Steps: three copies of the same model train side by side in one process, one step of each
   per round in a rotating order (so the machine's noise falls on all alike): bare, attached by
   ``tensordbg.profile`` but not profiling (its profile is over), and profiling (torch.profiler
   with memory and FLOPs, tensordbg's ranges). Medians and ratios to the bare step.
2. Summary: the time from a stopped profiler of 5 steps to the report (trace export, gzip,
   parse, breakdown, operators, memory, timeline, advice), median of 3. Target: under 2 s.
3. NVML: the CPU time of one sample of every GPU, and what 10 samples a second cost of one core.
   Without an NVIDIA driver it measures the sampler's own loop against a stand-in NVML module
   (every call answers at once), and says so. Target: under 1 % of a core.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
# This file is named like the standard library's profile module (which torch imports): its
# folder must not be on the path, so the overhead benchmark is loaded from its file.
for _entry in [p for p in sys.path if Path(p or ".").resolve() == HERE]:
    sys.path.remove(_entry)

import torch  # noqa: E402

import tensordbg  # noqa: E402
from tensordbg.profiler.advisor import advise  # noqa: E402
from tensordbg.profiler.nvml import GpuSampler  # noqa: E402
from tensordbg.profiler.summary import summarize  # noqa: E402
from tensordbg.profiler.trace import Capture  # noqa: E402

_spec = importlib.util.spec_from_file_location("overhead", HERE / "overhead.py")
overhead = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(overhead)


def build(device: str) -> tuple[torch.nn.Module, torch.Tensor, torch.dtype | None]:
    name = "gpt2-small" if device == "cuda" else "encoder-256"
    vocab, seq, dim, layers, heads, batch = overhead.CONFIGS[name]
    torch.manual_seed(0)
    model = overhead.GPT(vocab, seq, dim, layers, heads).to(device)
    tokens = torch.randint(0, vocab, (batch, seq + 1), device=device)
    return model, tokens, torch.bfloat16 if device == "cuda" else None


def bench_steps(device: str, rounds: int) -> None:
    model, tokens, dtype = build(device)
    runners = {name: overhead.Runner(name, copy.deepcopy(model), device, dtype)
               for name in ("bare", "attached", "profiling")}  # fmt: skip
    attached, profiling = runners["attached"], runners["profiling"]
    for runner in (attached, profiling):  # a session that only profiles: no rules
        runner.session = tensordbg.attach(runner.model, runner.optimizer, rules=[],
                                          on_hit="record", server=False)  # fmt: skip
    for runner in runners.values():  # warm up
        for _ in range(3):
            runner.step(tokens)
    handle = profiling.session.profile(rounds - 1)  # between steps: round 0 is its warm-up
    order = list(runners.values())
    times: dict[str, list[float]] = {name: [] for name in runners}
    for i in range(rounds):
        for runner in order[i % 3 :] + order[: i % 3]:
            times[runner.name].append(runner.step(tokens))
    report = handle.wait(300)
    assert report is not None and len(report.steps) == rounds - 1, handle.message
    profiled = times["profiling"][1:]
    bare = statistics.median(times["bare"])
    print(f"steps ({rounds} rounds, medians):")
    print(f"  bare       {bare * 1e3:8.2f} ms")
    for name, values in (("attached", times["attached"]), ("profiling", profiled)):
        median = statistics.median(values)
        print(f"  {name:<10} {median * 1e3:8.2f} ms  {median / bare:5.2f}x bare")
    for runner in runners.values():
        if runner.session is not None:
            runner.session.detach()


def bench_summary(device: str, repeats: int = 3) -> None:
    model, tokens, dtype = build(device)
    runner = overhead.Runner("profiled", model, device, dtype)
    runner.session = tensordbg.profile(model, runner.optimizer, steps=5, server=False)
    for _ in range(6):  # the warm-up, five profiled: the summary starts in the last one
        runner.step(tokens)
    started = time.perf_counter()
    handle = runner.session.profiling
    assert handle.wait(300) is not None, handle.message
    whole = time.perf_counter() - started
    runner.session.detach()
    # torch saves a trace once: the parts after the export are timed again from the file.
    parts: dict[str, list[float]] = {"read the trace": [], "summary": []}
    for _ in range(repeats):
        started = time.perf_counter()
        with gzip.open(handle.report.trace, "rb") as f:
            events = json.loads(f.read())["traceEvents"]
        read = time.perf_counter()
        report = summarize(Capture(events, None, handle.report.steps, handle.report.device))
        report.advice = advise(report)
        parts["read the trace"].append(read - started)
        parts["summary"].append(time.perf_counter() - read)
    size = Path(handle.report.trace).stat().st_size
    print(
        f"summary of 5 steps ({len(events)} trace events, gzip trace {size / 2**20:.1f} MiB): "
        f"{whole:.2f} s from the last step to the report, export included (target < 2 s)"
    )
    medians = ", ".join(f"{k} {statistics.median(v):.2f} s" for k, v in parts.items())
    print(f"  the parts after the export again, medians of {repeats}: {medians}")


class StandInNvml:
    """Every NVML call answers at once: what is left is the sampler's own work."""

    NVML_TEMPERATURE_GPU, NVML_CLOCK_SM, NVML_CLOCK_MEM = 0, 1, 2
    NVML_PCIE_UTIL_TX_BYTES, NVML_PCIE_UTIL_RX_BYTES = 0, 1
    NVML_ERROR_TIMEOUT = 10

    class NVMLError(Exception):
        value = 10

    def nvmlInit(self): ...
    def nvmlShutdown(self): ...
    def nvmlDeviceGetCount(self):
        return 1

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return "stand-in"

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=1 << 36, used=1 << 30)

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=50, memory=20)

    def nvmlDeviceGetPowerUsage(self, h):
        return 200_000

    def nvmlDeviceGetTemperature(self, h, s):
        return 60

    def nvmlDeviceGetClockInfo(self, h, k):
        return 1500

    def nvmlDeviceGetPcieThroughput(self, h, c):
        return 1000

    def nvmlDeviceGetTotalEccErrors(self, h, k, c):
        return 0

    def nvmlEventSetCreate(self):
        return "events"

    def nvmlDeviceRegisterEvents(self, h, k, s): ...
    def nvmlEventSetFree(self, s): ...

    def nvmlEventSetWait_v2(self, s, timeout):
        raise self.NVMLError()  # a timeout: no event


def bench_nvml(samples: int = 2000) -> None:
    sampler = GpuSampler(rate=10)
    real = sampler.start()
    if real:
        sampler.stop()
        what = "NVML"
    else:
        print(f"  ({sampler.reason}: measuring the sampler's loop against a stand-in module)")
        what = "the stand-in NVML"
    sampler = GpuSampler(rate=10, nvml=None if real else StandInNvml())
    sampler.start()
    sampler._stop.set()  # the thread ends at its next tick; we call the sample directly
    started = time.thread_time()
    for _ in range(samples):
        sampler.sample_once()
    per_sample = (time.thread_time() - started) / samples
    sampler.stop()
    devices = len(sampler.devices) or 1
    print(
        f"NVML sampler ({what}, {devices} device(s)): {per_sample * 1e6:.1f} us of CPU a "
        f"sample; at 10 Hz {per_sample * 10 * 100:.3f} % of one core (target < 1 %)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--parts", default="steps,summary,nvml", help="which to measure")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"machine: {overhead.machine()}")
    parts = args.parts.split(",")
    if "steps" in parts:
        bench_steps(args.device, args.rounds)
    if "summary" in parts:
        bench_summary(args.device)
    if "nvml" in parts:
        bench_nvml()
    return 0


if __name__ == "__main__":
    sys.exit(main())
