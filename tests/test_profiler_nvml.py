"""The GPU sampler: one line where NVML is absent, and an answer for every documented NVML error,
against a fake ``pynvml`` module that raises the real package's errors."""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace

import pynvml
import pytest

from tensordbg.profiler import nvml
from tensordbg.profiler.nvml import GpuSampler

CODES = sorted((n.removeprefix("NVML_ERROR_"), getattr(pynvml, n))
               for n in dir(pynvml) if n.startswith("NVML_ERROR_"))  # fmt: skip


class FakeNvml:
    """One GPU that answers every query, except those told to fail with an NVML error code."""

    def __init__(self, fail: dict[str, int] | None = None):
        for name in dir(pynvml):
            if name.startswith("NVML_") or name.startswith("nvmlEventType"):
                setattr(self, name, getattr(pynvml, name))
        self.fail = dict(fail or {})
        self.calls: dict[str, int] = {}
        self.ecc = 0
        self.xids: list[int] = []
        self.shut = False

    def _call(self, name: str, value):
        self.calls[name] = self.calls.get(name, 0) + 1
        if name in self.fail:
            raise pynvml.NVMLError(self.fail[name])
        return value

    def nvmlInit(self):
        return self._call("nvmlInit", None)

    def nvmlShutdown(self):
        self.shut = True

    def nvmlDeviceGetCount(self):
        return self._call("nvmlDeviceGetCount", 1)

    def nvmlDeviceGetHandleByIndex(self, i):
        return self._call("nvmlDeviceGetHandleByIndex", f"gpu{i}")

    def nvmlDeviceGetName(self, h):
        return self._call("nvmlDeviceGetName", b"Fake H100")

    def nvmlDeviceGetMemoryInfo(self, h):
        return self._call("nvmlDeviceGetMemoryInfo", SimpleNamespace(total=80 << 30, used=3 << 30))

    def nvmlDeviceGetUtilizationRates(self, h):
        return self._call("nvmlDeviceGetUtilizationRates", SimpleNamespace(gpu=87, memory=40))

    def nvmlDeviceGetPowerUsage(self, h):
        return self._call("nvmlDeviceGetPowerUsage", 310_500)

    def nvmlDeviceGetTemperature(self, h, sensor):
        return self._call("nvmlDeviceGetTemperature", 64)

    def nvmlDeviceGetClockInfo(self, h, kind):
        return self._call("nvmlDeviceGetClockInfo", 1980 if kind == pynvml.NVML_CLOCK_SM else 2619)

    def nvmlDeviceGetPcieThroughput(self, h, counter):
        return self._call("nvmlDeviceGetPcieThroughput", 5000)

    def nvmlDeviceGetTotalEccErrors(self, h, kind, counter):
        uncorrected = kind == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        return self._call("nvmlDeviceGetTotalEccErrors", self.ecc if uncorrected else 0)

    def nvmlEventSetCreate(self):
        return self._call("nvmlEventSetCreate", "events")

    def nvmlDeviceRegisterEvents(self, h, kinds, events):
        return self._call("nvmlDeviceRegisterEvents", None)

    def nvmlEventSetWait_v2(self, events, timeout_ms):
        if not self.xids:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
        return SimpleNamespace(device="gpu0", eventType=8, eventData=self.xids.pop(0))

    def nvmlEventSetFree(self, events):
        pass


def test_without_a_driver_the_sampler_says_nvml_unavailable_in_one_line():
    sampler = GpuSampler()
    if sampler.start():  # a machine with a GPU driver: this test is about the others
        sampler.stop()
        pytest.skip("NVML is available here")
    assert sampler.reason.startswith("NVML unavailable: ") and "\n" not in sampler.reason
    assert sampler._thread is None
    reply = sampler.read()
    assert reply == {"available": False, "reason": sampler.reason, "devices": [],
                     "samples": [], "events": []}  # fmt: skip


def test_without_the_package_the_reason_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    sampler = GpuSampler()
    assert not sampler.start()
    assert sampler.reason == "NVML unavailable: the nvidia-ml-py package is not installed"


@pytest.mark.parametrize(("name", "code"), CODES)
def test_every_nvml_error_at_start_is_one_line_and_no_thread(name, code):
    fake = FakeNvml(fail={"nvmlInit": code})
    sampler = GpuSampler(nvml=fake)
    assert not sampler.start()
    assert sampler.reason.startswith("NVML unavailable: ") and "\n" not in sampler.reason
    assert sampler._thread is None and not sampler.available


@pytest.mark.parametrize(("name", "code"), CODES)
def test_every_nvml_error_while_sampling_has_its_answer(name, code):
    fake = FakeNvml()
    sampler = GpuSampler(nvml=fake)
    sampler._handles = ["gpu0"]
    sampler._initialized = sampler.available = True
    fake.fail["nvmlDeviceGetPowerUsage"] = code
    going_on = sampler.sample_once()
    if name in nvml._DRIVER_GONE:
        assert not going_on and not sampler.available
        assert sampler.reason.startswith("NVML unavailable: ")
        return
    assert going_on
    if name in nvml._LOST:
        [event] = sampler.events
        assert event["kind"] == "lost" and event["device"] == 0
        sampler.sample_once()
        assert not sampler.samples  # a lost device is no longer read
        return
    [sample] = sampler.samples
    assert sample["power_w"] is None  # the rest of the sample is there
    assert sample["util"] == 87 and sample["temp_c"] == 64 and sample["memory_used"] == 3 << 30
    calls = fake.calls["nvmlDeviceGetPowerUsage"]
    sampler.sample_once()
    asked_again = fake.calls["nvmlDeviceGetPowerUsage"] > calls
    assert asked_again == (name not in nvml._ABSENT)  # a missing metric is not asked again


def test_a_metric_failing_again_and_again_is_dropped():
    fake = FakeNvml(fail={"nvmlDeviceGetTemperature": pynvml.NVML_ERROR_TIMEOUT})
    sampler = GpuSampler(nvml=fake)
    sampler._handles, sampler._initialized = ["gpu0"], True
    for _ in range(nvml.MAX_FAILURES + 5):
        sampler.sample_once()
    assert fake.calls["nvmlDeviceGetTemperature"] == nvml.MAX_FAILURES


def test_the_sampler_reads_at_its_rate_into_a_bounded_ring_with_xid_and_ecc_events():
    fake = FakeNvml()
    sampler = GpuSampler(rate=200, capacity=10, nvml=fake)
    assert sampler.start() and sampler.available
    assert sampler.devices == [{"index": 0, "name": "Fake H100", "memory_total": 80 << 30}]
    time.sleep(0.1)
    fake.xids.append(79)  # "GPU has fallen off the bus"
    fake.ecc = 2
    time.sleep(0.2)
    sampler.stop()
    assert fake.shut and sampler._thread is None
    reply = sampler.read()
    assert 0 < len(reply["samples"]) <= 10
    sample = reply["samples"][-1]
    assert sample == {"t": sample["t"], "device": 0, "util": 87.0, "mem_util": 40.0,
                      "memory_used": 3 << 30, "power_w": 310.5, "temp_c": 64.0,
                      "sm_clock_mhz": 1980.0, "mem_clock_mhz": 2619.0, "pcie_tx_kbs": 5000.0,
                      "pcie_rx_kbs": 5000.0}  # fmt: skip
    kinds = {e["kind"]: e["detail"] for e in reply["events"]}
    assert kinds["xid"] == "XID 79"
    assert "2 new uncorrected ECC errors" in kinds["ecc"]
    later = sampler.read(since=sample["t"])
    assert later["samples"] == []


def test_a_sample_costs_far_less_than_a_tenth_of_a_second_of_cpu():
    sampler = GpuSampler(rate=10, nvml=FakeNvml())
    assert sampler.start()
    sampler.stop()  # sampled by hand below, on this thread, to time it alone
    sampler._handles, sampler._initialized = ["gpu0"], True
    started = time.thread_time()
    for _ in range(100):
        sampler.sample_once()
    per_sample = (time.thread_time() - started) / 100
    # Under 1 % of a core at 10 Hz is 1 ms a sample (benchmarks/profiling.py measures it).
    assert per_sample < 1e-3


def test_pcie_throughput_is_read_once_a_second_and_carried_between():
    """NVML measures PCIe throughput over 20 ms (0.9 ms of CPU a read on an H100, measured):
    read at every sample of 10 Hz it cost 2 % of a core. Once a second, the samples between
    carry the last reading."""
    fake = FakeNvml()
    now = [1000.0]
    sampler = GpuSampler(rate=10, nvml=fake, clock=lambda: now[0])
    assert sampler.start()
    sampler.stop()  # sampled by hand below, at 10 Hz of the fake clock
    sampler._handles, sampler._initialized = ["gpu0"], True
    fake.calls.clear()
    for _ in range(50):
        sampler.sample_once()
        now[0] += 0.1
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 2 * 5  # sent and received, 5 seconds
    assert fake.calls["nvmlDeviceGetUtilizationRates"] == 50
    assert all(s["pcie_tx_kbs"] == s["pcie_rx_kbs"] == 5000.0 for s in sampler.read()["samples"])
