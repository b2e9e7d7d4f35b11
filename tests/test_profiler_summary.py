"""The summary and the advisor on plain data: a made-up CUDA trace (this machine has no GPU)
shows the priority rule, the kernels table and the GPU numbers; made-up reports show that each
rule speaks with its number and only past its threshold; advisor plugins load from entry points."""

from __future__ import annotations

import random
import warnings

import pytest

from tensordbg.profiler import advisor
from tensordbg.profiler.advisor import AdviceRule, advise
from tensordbg.profiler.capture import _memory_history
from tensordbg.profiler.operators import operator_rows, outside_range
from tensordbg.profiler.report import ProfileReport
from tensordbg.profiler.summary import summarize, tensor_core
from tensordbg.profiler.trace import Capture, nest_steps


def span(name, ts, dur, cat="user_annotation", pid=1, tid=10, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": pid, "tid": tid,
            "args": args}  # fmt: skip


def memory(ts, allocated, reserved):
    return {"ph": "i", "cat": "cpu_instant_event", "name": "[memory]", "ts": ts, "pid": 1,
            "tid": 10, "args": {"Device Type": 1, "Total Allocated": allocated,
                                "Total Reserved": reserved, "Bytes": 1}}  # fmt: skip


def kernel(name, ts, dur, correlation=0):
    return span(name, ts, dur, cat="kernel", pid=0, tid=7, correlation=correlation)


MIB = 2**20
# Two steps of 1000 us. Step 1: loading 0-200, an H2D copy 100-250, forward 200-500 with a
# launch 250-260, kernels 300-600 (fp32 SGEMM) and 600-700 (bf16 tensor-op), backward 500-900,
# optimizer 900-980, an all-reduce 950-1000, tensordbg's hooks 640-660 and 880-900. Step 2:
# paused 1200-1500, nothing else.
EVENTS = [
    span("ProfilerStep#1", 0, 1000),
    span("ProfilerStep#2", 1000, 1000),
    span("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 0, 200),
    span(
        "Memcpy HtoD (Pageable -> Device)", 100, 150, cat="gpu_memcpy", pid=0, tid=7, bytes=4 * MIB
    ),
    span("tensordbg: forward", 200, 300),
    span("cudaLaunchKernel", 250, 10, cat="cuda_runtime", correlation=1),
    kernel("ampere_sgemm_128x64_nn", 300, 300, correlation=1),
    kernel("sm80_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x32", 600, 100),
    span("tensordbg: backward", 500, 400),
    span("tensordbg: checks", 640, 20),  # tensordbg's hooks: under a kernel, the kernel's
    span("tensordbg: checks", 880, 20),  # and alone, tensordbg's own, before the backward's
    span("tensordbg: optimizer", 900, 80),
    kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 950, 50),
    span("tensordbg: paused", 1200, 300),
    memory(100, 10 * MIB, 20 * MIB),
    memory(600, 30 * MIB, 40 * MIB),
    memory(1600, 5 * MIB, 40 * MIB),
    memory(2500, 99 * MIB, 99 * MIB),  # after the last step: not in the report
]
AVERAGES = [
    {"name": "aten::mm", "calls": 2, "self_cpu": 20e-6, "total_cpu": 25e-6, "self_device": 400e-6,
     "total_device": 400e-6, "input_shapes": None, "flops": 10**9, "self_cpu_memory": 0,
     "self_device_memory": 8 * MIB, "annotation": False},
    {"name": "ProfilerStep*", "calls": 2, "self_cpu": 1e-3, "total_cpu": 2e-3, "self_device": 0.0,
     "total_device": 0.0, "input_shapes": None, "flops": None, "self_cpu_memory": 0,
     "self_device_memory": 0, "annotation": True},
]  # fmt: skip


@pytest.fixture
def cuda_report() -> ProfileReport:
    capture = Capture(EVENTS, AVERAGES, steps=[7, 8], device="cuda:0", main_thread=10,
                      memory_limit=80 * MIB)  # fmt: skip
    report = summarize(capture)
    report.advice = advise(report)
    return report


def test_each_instant_of_a_step_counts_once_by_the_priority_rule(cuda_report):
    first, second = cuda_report.breakdown
    us = {k: round(v * 1e6, 6) for k, v in first.items() if k != "step"}
    assert us == {"kernel": 400, "memcpy": 150, "memset": 0, "communication": 50, "runtime": 10,
                  "tensordbg": 20, "DataLoader": 100, "forward": 40, "backward": 180,
                  "optimizer": 50,
                  "other": 0, "total": 1000}  # fmt: skip
    assert second["total"] == pytest.approx(700e-6) and second["other"] == pytest.approx(700e-6)
    assert cuda_report.paused_seconds == pytest.approx(300e-6)
    assert cuda_report.steps == [7, 8]


def test_kernels_memory_and_gpu_numbers_of_a_cuda_trace(cuda_report):
    kernels = {k["name"]: k for k in cuda_report.kernels}
    assert kernels["ampere_sgemm_128x64_nn"]["tensor_core"] is False
    assert kernels["sm80_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x32"]["tensor_core"]
    assert kernels["Memcpy HtoD (Pageable -> Device)"]["tensor_core"] is None
    assert cuda_report.kernels_note is None
    mem = cuda_report.memory
    assert mem["peak_allocated"] == 30 * MIB and mem["peak_reserved"] == 40 * MIB
    assert mem["limit"] == 80 * MIB and len(mem["curve"]) == 3
    assert mem["top_operators"] == [{"name": "aten::mm", "bytes": 8 * MIB, "calls": 2}]
    gpu = cuda_report.gpu_summary
    assert gpu["utilization"] == pytest.approx(450 / 1700)  # kernels 300-700, 950-1000
    assert gpu["tensor_core_share"] == pytest.approx(100 / 450)
    assert gpu["h2d_bytes"] == 4 * MIB
    lanes = {lane["name"] for lane in cuda_report.timeline["lanes"]}
    assert lanes == {"thread 10 (main)", "stream 7"}
    assert [op["name"] for op in cuda_report.operators] == ["aten::mm"]


def test_a_cuda_report_gets_the_gpu_advice_with_its_numbers(cuda_report):
    advice = {a["rule"]: a for a in cuda_report.advice}
    low = advice["LowGpuUtilization"]
    assert low["value"] == pytest.approx(450 / 1700) and low["threshold"] == 0.5
    assert "26.5 %" in low["evidence"]
    assert advice["DataLoaderShare"]["value"] == pytest.approx(100 / 1700)
    assert "HostToDeviceCopies" not in advice  # 150 us of 1700: 8.8 %, under 10 %
    assert "Communication" not in advice  # 50 us of 1700: under 10 %
    assert "TensorCores" not in advice  # 22 % of the kernel time is on Tensor Cores
    for item in cuda_report.advice:
        assert isinstance(item["value"], float) and isinstance(item["threshold"], float)
        assert item["evidence"] and item["message"]


def report_with(**fields) -> ProfileReport:
    base = {"device": "cuda:0", "steps": [1, 2, 3],
            "breakdown": [{"step": s, "kernel": 0.01, "other": 0.0, "total": 0.01}
                          for s in (1, 2, 3)]}  # fmt: skip
    return ProfileReport(**{**base, **fields})


@pytest.mark.parametrize(
    ("fields", "rule", "value"),
    [
        ({"gpu_summary": {"tensor_core_share": 0.0, "eligible_time": 0.05, "utilization": 0.9}},
         "TensorCores", 0.0),
        ({"memory": {"peak_reserved": 75 << 30, "peak_allocated": 70 << 30, "limit": 80 << 30}},
         "MemoryNearLimit", 75 / 80),
        ({"gpu_summary": {"kernels": 400, "short_kernels": 300, "utilization": 0.9}},
         "LaunchBound", 0.75),
        ({"device": "cpu", "host": {"threads": 1, "cores": 8}}, "CpuThreads", 1 / 8),
        ({"gpu_summary": {"h2d_time": 0.004, "step_time": 0.01, "h2d_bytes": 64 << 20}},
         "HostToDeviceCopies", 0.4),
        ({"gpu_summary": {"utilization": 0.05}, "host": {"cpu_utilization": 0.98}}, "CpuBound",
         0.98),
        ({"outliers": [{"step": 2, "total": 0.03, "median": 0.01, "ratio": 3.0}]}, "StepOutlier",
         3.0),
        ({"device": "cpu", "breakdown": [{"step": s, "forward": 0.001, "other": 0.03,
                                          "total": 0.031} for s in (1, 2, 3)]},
         "OutsideThePhases", 0.03 / 0.031),
        ({"device": "cpu", "breakdown": [{"step": s, "forward": 0.008, "tensordbg": 0.002,
                                          "other": 0.0, "total": 0.01} for s in (1, 2, 3)]},
         "DebuggerShare", 0.2),
    ],
)  # fmt: skip
def test_each_rule_speaks_past_its_threshold_with_the_number(fields, rule, value):
    found = {a["rule"]: a for a in advise(report_with(**fields))}
    assert found[rule]["value"] == pytest.approx(value)
    assert found[rule]["evidence"] and found[rule]["message"]


def test_the_advice_takes_the_machine_and_the_session_as_they_are():
    """Found by a new user's trial: more workers advised to a loader that had them (and 4 on 2
    cores), nothing said of 8 threads on 2 cores, and "check less often: attach(interval=N)"
    to tensordbg.profile's session, which has no rules."""
    share = [{"step": s, "DataLoader": 0.02, "other": 0.08, "total": 0.1} for s in (1, 2, 3)]
    multi = [{"name": "enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__",
              "calls": 3, "self_cpu": 0.06, "total_cpu": 0.06, "self_device": 0.0,
              "total_device": 0.0, "input_shapes": None, "flops": None, "range": True}]  # fmt: skip
    two = {"threads": 2, "cores": 2}
    said = {a["rule"]: a["message"] for a in advise(report_with(
        device="cpu", breakdown=share, operators=multi, host=two))}  # fmt: skip
    assert said["DataLoaderShare"].startswith("The DataLoader's workers do not keep up: more "
                                               "of them (this machine has 2 cores)")  # fmt: skip
    said = {a["rule"]: a["message"] for a in advise(report_with(
        device="cpu", breakdown=share, host=two))}  # fmt: skip
    assert (
        "DataLoader(num_workers=1, persistent_workers=True) (on so few cores"
        in (said["DataLoaderShare"])
    )
    over = {a["rule"]: a for a in advise(report_with(device="cpu", host={"threads": 8,
                                                                         "cores": 2}))}  # fmt: skip
    assert over["CpuThreads"]["value"] == 4.0
    assert over["CpuThreads"]["message"].startswith("torch.set_num_threads(2)")
    ours = [{"step": s, "tensordbg": 0.05, "other": 0.05, "total": 0.1} for s in (1, 2, 3)]
    said = {a["rule"]: a["message"] for a in advise(report_with(
        device="cpu", breakdown=ours, host={"rules": 0}))}  # fmt: skip
    assert said["DebuggerShare"].startswith("This session only profiles")
    assert "interval" not in said["DebuggerShare"]
    # The cheaper mode is advised to a session that runs another one only (it was advised
    # "if another mode was chosen" to one that ran deferred checks already).
    for sync, cheaper in (("deferred", False), ("eager", True), ("batched", True)):
        said = {a["rule"]: a["message"] for a in advise(report_with(
            device="cpu", breakdown=ours, host={"rules": 5, "sync": sync}))}  # fmt: skip
        assert "interval=N" in said["DebuggerShare"]
        assert ("sync='deferred'" in said["DebuggerShare"]) == cheaper, sync


def test_no_number_no_advice():
    assert advise(report_with()) == []
    assert advise(ProfileReport()) == []  # an empty report: nothing to say


def test_advisor_rules_are_plugins_and_a_broken_one_is_skipped(monkeypatch):
    class SlowMedian(AdviceRule):
        name, threshold = "SlowMedian", 0.005

        def check(self, report):
            median = sorted(report.step_times)[1]
            if median > self.threshold:
                return self.advise(median, f"median step {median * 1e3:.0f} ms", "Look deeper.")
            return None

    class Broken(AdviceRule):
        name = "Broken"

        def check(self, report):
            raise ZeroDivisionError("oops")

    class Point:
        def __init__(self, name, loaded):
            self.name, self.value, self.loaded = name, f"pkg:{name}", loaded

        def load(self):
            if isinstance(self.loaded, Exception):
                raise self.loaded
            return self.loaded

    points = [Point("slow", SlowMedian), Point("broken", Broken), Point("gone", ImportError("x")),
              Point("odd", object)]  # fmt: skip
    monkeypatch.setattr(advisor, "entry_points", lambda group: points)
    monkeypatch.setattr(advisor, "_installed", None)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        found = advise(report_with())
    assert [a["rule"] for a in found] == ["SlowMedian"]
    assert found[0]["evidence"] == "median step 10 ms"
    text = " ".join(str(w.message) for w in said)
    assert "gone" in text and "odd" in text and "Broken raised ZeroDivisionError" in text


def test_tensor_core_kernels_are_told_by_name():
    assert tensor_core(
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1"
    )
    assert tensor_core("volta_h884gemm_64x64_ldg8_nn")
    assert not tensor_core("ampere_sgemm_128x64_nn")
    assert not tensor_core("void at::native::vectorized_elementwise_kernel<4, add>")


class FakeCudaMemory:
    def __init__(self, fail_dump=False):
        self.calls, self.fail_dump = [], fail_dump

    def _record_memory_history(self, enabled="all", max_entries=0):
        self.calls.append(("record", enabled, max_entries))

    def _dump_snapshot(self, path):
        if self.fail_dump:
            raise RuntimeError("no history")
        self.calls.append(("dump", path))


def test_the_cuda_memory_snapshot_is_recorded_dumped_and_switched_off(tmp_path):
    fake = FakeCudaMemory()
    assert _memory_history(True, memory=fake) is None
    path = tmp_path / "memory-snapshot.pickle"
    assert _memory_history(False, path, memory=fake) == str(path)
    assert fake.calls == [("record", "all", 100_000), ("dump", str(path)), ("record", None, 0)]
    failing = FakeCudaMemory(fail_dump=True)
    assert _memory_history(False, path, memory=failing) is None
    assert failing.calls == [("record", None, 0)]  # switched off all the same


def test_step_boundaries_move_out_of_the_optimizer_step_they_fall_in():
    events = [
        span("ProfilerStep#1", 0, 1000),
        span("ProfilerStep#2", 1000, 1000),
        span("Optimizer.step#SGD.step", 900, 150),  # the boundary at 1000 falls inside it
        span("tensordbg: optimizer", 910, 80),
        span("aten::add_", 1010, 20, cat="cpu_op"),
        span("Optimizer.step#SGD.step", 1950, 100),
        span("elsewhere", 990, 100, tid=99),  # another thread: not in the way
    ]
    first, second = nest_steps(events)[:2]
    assert (first["ts"], first["dur"]) == (0, 1050)
    assert (second["ts"], second["dur"]) == (1050, 1000)


def test_a_step_boundary_stays_out_of_a_range_as_the_trace_file_writes_it():
    """A step that starts where an optimizer.step ended (moved there: off the three-decimal grid)
    and ends where the next one starts: written with three decimals, its start and length may
    both round up and put its end inside that next range (a CI run failed on it)."""
    events = [
        span("Optimizer.step#Adam.step", 4698879829571.325, 62.898),
        span("ProfilerStep#2", 4698879829602.774, 1180.47),  # starts inside the range above
        span("Optimizer.step#Adam.step", 4698879830783.244, 700.0),  # where the step ends
    ]
    step = next(e for e in nest_steps(events) if e["name"] == "ProfilerStep#2")
    written = [float(f"{step[k]:.3f}") for k in ("ts", "dur")]
    assert written == [step["ts"], step["dur"]]  # what the file holds is what was checked
    for e in events:
        if e["name"].startswith("Optimizer.step"):
            for t in (step["ts"], step["ts"] + step["dur"]):
                assert not e["ts"] < t < e["ts"] + e["dur"]


def test_no_step_boundary_ends_inside_a_range_wherever_the_ranges_fall():
    """Steps that end at or near the next optimizer.step's start, at times as large as a
    profiler's (4.7e12 us): added up as a viewer adds them, no boundary falls inside a range.
    The last fix still failed one case in 50 here (a length rounded down, after the boundary
    moved to a range's end, put the end back inside it: a CI run failed on it again)."""
    rng = random.Random(1)
    for _ in range(2000):
        first = round(4710342811000.0 + rng.randint(0, 10**9) / 1000, 3)
        length = round(rng.uniform(10, 100), 3)
        start = round(first + rng.uniform(0, length), 3)
        second = round(start + rng.uniform(100, 900), 3)
        dur = round(second - start + rng.choice([0, 0.0004, -0.0004, 0.001]), 3)
        events = [span("Optimizer.step#Adam.step", first, length),
                  span("ProfilerStep#2", start, dur),
                  span("Optimizer.step#Adam.step", second, 300.0)]  # fmt: skip
        step = next(e for e in nest_steps(events) if e["name"] == "ProfilerStep#2")
        for e in events[::2]:
            for t in (step["ts"], step["ts"] + step["dur"]):
                assert not e["ts"] < t < e["ts"] + e["dur"], (events, step)


def test_the_profilers_own_stop_is_not_counted_in_the_last_optimizer_step():
    """The last profiled step's Optimizer.step span of torch holds the profiler's own stop (its
    post-hooks): the operator table counts it only up to tensordbg's optimizer range's end."""
    events = [
        span("ProfilerStep#1", 0, 1000),
        span("Optimizer.step#Adam.step", 800, 150),
        span("tensordbg: optimizer", 805, 140),
        span("ProfilerStep#2", 1000, 1000),
        span("Optimizer.step#Adam.step", 1800, 5300),  # the profiler stopped inside it
        span("tensordbg: optimizer", 1805, 140),
    ]
    report = summarize(Capture(events, None, steps=[1, 2], device="cpu", main_thread=10))
    [row] = [r for r in report.operators if r["name"] == "Optimizer.step#Adam.step"]
    assert (row["calls"], row["total_cpu"]) == (2, pytest.approx((145 + 145) * 1e-6))


def test_the_operators_of_tensordbg_s_hooks_and_their_kernels_are_not_the_model_s():
    """An operator run inside tensordbg's range on its thread, and the kernel it launched, are
    left out of the table; the same operator outside it, and its kernel, stay."""
    spans = [
        span("aten::mm", 0, 50, cat="cpu_op", **{"External id": 1}),
        span("tensordbg: checks", 100, 50),
        span("aten::linalg_vector_norm", 110, 20, cat="cpu_op", **{"External id": 2}),
        span("aten::mm", 130, 10, cat="cpu_op", **{"External id": 3}),
        span("aten::mm", 130, 10, cat="cpu_op", tid=11),  # another thread: not inside
        span("gemm", 10, 30, cat="kernel", pid=0, tid=7, **{"External id": 1}),
        span("reduce", 115, 5, cat="kernel", pid=0, tid=7, **{"External id": 2}),
    ]
    rows = {r["name"]: r for r in operator_rows(outside_range(spans, "tensordbg: checks"), [])}
    assert "aten::linalg_vector_norm" not in rows
    assert rows["aten::mm"]["calls"] == 2
    assert rows["aten::mm"]["self_device"] == pytest.approx(30e-6)
    assert outside_range(spans[:1], "tensordbg: checks") == spans[:1]
