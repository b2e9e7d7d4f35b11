"""GPU telemetry: a background thread in the training process reads NVML (``nvidia-ml-py``,
``import pynvml``) at a fixed rate into a bounded ring, which the UI's GPU tab reads through the
``gpu`` request.

Per device and sample: utilization (the share of time a kernel ran, not occupancy), memory
utilization and bytes used, power, temperature, SM and memory clocks, PCIe throughput. Events:
XID critical errors (through an NVML event set) and new ECC errors (volatile counters that grow),
and a device that is lost.

Every documented NVML error has one answer here, so the sampler never takes the training down:

- at start (no driver, no library, no permission, no device...): nothing runs, and
  ``reason`` is one line, ``"NVML unavailable: <reason>"``;
- a metric a device does not have (NotSupported, NoPermission, FunctionNotFound, NoData,
  NotFound, Deprecated, ArgumentVersionMismatch...): that field is None from then on;
- a device gone (GpuIsLost, GpuNotFound, ResetRequired): a ``lost`` event, and that device is
  no longer read;
- the driver gone (Uninitialized, DriverNotLoaded, LibRmVersionMismatch, LibraryNotFound): the
  sampler stops and says why;
- anything else (Timeout, InUse, NotReady, Memory, IrqIssue, Unknown...): None in that sample;
  a metric that fails 50 times in a row is dropped.

>>> sampler = GpuSampler(rate=10)
>>> sampler.start() or print(sampler.reason)
NVML unavailable: NVML Shared Library Not Found
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

DEFAULT_RATE = 10.0
CAPACITY = 6000  # samples of all devices: 10 minutes of one device at 10 Hz
EVENT_CAPACITY = 500
MAX_FAILURES = 50
PCIE_PERIOD = 1.0
"""Seconds between two reads of a device's PCIe throughput (samples between carry the last):
NVML measures it over 20 ms, blocking the sampler that long at ~0.9 ms of CPU per read on an
H100 (two a sample: sent and received), where the other reads of a sample take ~30 us."""

_ABSENT = (
    "NOT_SUPPORTED",
    "NO_PERMISSION",
    "FUNCTION_NOT_FOUND",
    "NO_DATA",
    "NOT_FOUND",
    "DEPRECATED",
    "ARGUMENT_VERSION_MISMATCH",
    "VGPU_ECC_NOT_SUPPORTED",
    "FREQ_NOT_SUPPORTED",
    "RESET_TYPE_NOT_SUPPORTED",
)
_LOST = ("GPU_IS_LOST", "GPU_NOT_FOUND", "RESET_REQUIRED")
_DRIVER_GONE = (
    "UNINITIALIZED",
    "DRIVER_NOT_LOADED",
    "LIB_RM_VERSION_MISMATCH",
    "LIBRARY_NOT_FOUND",
)

FIELDS = (
    "util",
    "mem_util",
    "memory_used",
    "power_w",
    "temp_c",
    "sm_clock_mhz",
    "mem_clock_mhz",
    "pcie_tx_kbs",
    "pcie_rx_kbs",
)


class _DeviceLost(Exception):
    pass


class _DriverGone(Exception):
    pass


class GpuSampler:
    """Samples every GPU NVML sees, ``rate`` times a second, on a daemon thread."""

    def __init__(
        self,
        rate: float = DEFAULT_RATE,
        capacity: int = CAPACITY,
        nvml: Any = None,
        clock: Callable[[], float] = time.time,
    ):
        if not rate > 0:
            raise ValueError(f"rate is samples per second, above 0, not {rate!r}")
        self.interval = 1.0 / rate
        self.available = False
        self.reason: str | None = None
        self.devices: list[dict[str, Any]] = []
        self.samples: deque[dict[str, Any]] = deque(maxlen=capacity)
        self.events: deque[dict[str, Any]] = deque(maxlen=EVENT_CAPACITY)
        self._nvml = nvml
        self._clock = clock
        self._handles: list[Any] = []
        self._lost: set[int] = set()
        self._dropped: set[tuple[int, str]] = set()
        self._failures: dict[tuple[int, str], int] = {}
        self._ecc: dict[tuple[int, str], int] = {}
        self._pcie: dict[int, tuple[float, Any, Any]] = {}  # device -> (when read, tx, rx)
        self._event_set: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._initialized = False

    # --- life ----------------------------------------------------------------------------------

    def start(self) -> bool:
        """Initialize NVML and start sampling; False (with :attr:`reason`) when it cannot."""
        try:
            nvml = self._nvml
            if nvml is None:
                import pynvml as nvml  # nvidia-ml-py: loaded only when a GPU tab asks
            self._nvml = nvml
            nvml.nvmlInit()
            self._initialized = True
        except ImportError:
            return self._unavailable("the nvidia-ml-py package is not installed")
        except Exception as e:
            return self._unavailable(_describe(e))
        try:
            count = int(nvml.nvmlDeviceGetCount())
            for index in range(count):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                self._handles.append(handle)
                self.devices.append(
                    {
                        "index": index,
                        "name": _text(
                            self._read_or(
                                lambda h=handle: nvml.nvmlDeviceGetName(h), f"GPU {index}"
                            )
                        ),
                        "memory_total": self._read_or(
                            lambda h=handle: int(nvml.nvmlDeviceGetMemoryInfo(h).total), None
                        ),
                    }
                )
        except Exception as e:
            self._shutdown()
            return self._unavailable(_describe(e))
        if not self._handles:
            self._shutdown()
            return self._unavailable("no GPU found")
        self._register_xid_events()
        self.available = True
        self._thread = threading.Thread(target=self._loop, name="tensordbg-nvml", daemon=True)
        self._thread.start()
        return True

    def stop(self) -> None:
        """Stop the thread and shut NVML down (safe to call twice)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2.0)
        self._shutdown()

    def read(self, since: float = 0.0) -> dict[str, Any]:
        """The ``gpu`` reply: devices, and the samples and events newer than ``since``."""
        with self._lock:
            samples = [s for s in self.samples if s["t"] > since]
            events = [e for e in self.events if e["t"] > since]
        return {
            "available": self.available,
            "reason": self.reason,
            "devices": list(self.devices),
            "samples": samples,
            "events": events,
        }

    # --- sampling ------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            if not self.sample_once():
                return

    def sample_once(self) -> bool:
        """Read every device once (the thread calls it; tests call it directly). False when
        sampling must stop (the driver went away): :attr:`reason` says why."""
        try:
            self._sample_devices()
        except _DriverGone as e:
            self.available = False
            self.reason = f"NVML unavailable: {e} (sampling stopped)"
            return False
        except Exception as e:  # never the training's problem
            self.available = False
            self.reason = f"NVML sampling stopped: {_describe(e)}"
            return False
        return True

    def _sample_devices(self) -> None:
        nvml = self._nvml
        now = self._clock()
        taken = []
        for index, handle in enumerate(self._handles):
            if index in self._lost:
                continue
            try:
                taken.append(self._sample(nvml, index, handle, now))
                self._check_ecc(nvml, index, handle, now)
            except _DeviceLost as e:
                self._lost.add(index)
                self._event(now, index, "lost", f"GPU {index} is lost ({e}); no longer sampled")
        self._poll_xid(now)
        with self._lock:
            self.samples.extend(taken)

    def _sample(self, nvml: Any, index: int, handle: Any, now: float) -> dict[str, Any]:
        def read(name: str, fn: Callable[[], Any]) -> Any:
            return self._metric(index, name, fn)

        util = read("utilization", lambda: nvml.nvmlDeviceGetUtilizationRates(handle))
        memory = read("memory", lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
        power = read("power", lambda: nvml.nvmlDeviceGetPowerUsage(handle))
        temp = read(
            "temperature",
            lambda: nvml.nvmlDeviceGetTemperature(handle, getattr(nvml, "NVML_TEMPERATURE_GPU", 0)),
        )
        sm = read(
            "sm_clock",
            lambda: nvml.nvmlDeviceGetClockInfo(handle, getattr(nvml, "NVML_CLOCK_SM", 1)),
        )
        mem_clock = read(
            "mem_clock",
            lambda: nvml.nvmlDeviceGetClockInfo(handle, getattr(nvml, "NVML_CLOCK_MEM", 2)),
        )
        tx, rx = self._pcie_throughput(nvml, index, handle, now)
        return {
            "t": now,
            "device": index,
            "util": _num(getattr(util, "gpu", None)),
            "mem_util": _num(getattr(util, "memory", None)),
            "memory_used": None if memory is None else int(memory.used),
            "power_w": None if power is None else float(power) / 1000.0,
            "temp_c": _num(temp),
            "sm_clock_mhz": _num(sm),
            "mem_clock_mhz": _num(mem_clock),
            "pcie_tx_kbs": _num(tx),
            "pcie_rx_kbs": _num(rx),
        }

    def _pcie_throughput(self, nvml: Any, index: int, handle: Any, now: float) -> tuple[Any, Any]:
        """Sent and received PCIe throughput, read once per :data:`PCIE_PERIOD`."""
        last = self._pcie.get(index)
        if last is not None and now - last[0] < PCIE_PERIOD:
            return last[1], last[2]
        counters = (getattr(nvml, "NVML_PCIE_UTIL_TX_BYTES", 0),
                    getattr(nvml, "NVML_PCIE_UTIL_RX_BYTES", 1))  # fmt: skip
        tx, rx = (
            self._metric(
                index, f"pcie_{name}", lambda c=c: nvml.nvmlDeviceGetPcieThroughput(handle, c)
            )
            for name, c in zip(("tx", "rx"), counters, strict=True)
        )
        self._pcie[index] = (now, tx, rx)
        return tx, rx

    def _metric(self, index: int, name: str, fn: Callable[[], Any]) -> Any:
        """One NVML read, with the error rules of the module docstring."""
        key = (index, name)
        if key in self._dropped:
            return None
        try:
            value = fn()
        except Exception as e:
            kind = _kind(self._nvml, e)
            if kind in _LOST:
                raise _DeviceLost(_describe(e)) from None
            if kind in _DRIVER_GONE:
                raise _DriverGone(_describe(e)) from None
            failures = self._failures[key] = self._failures.get(key, 0) + 1
            if kind in _ABSENT or failures >= MAX_FAILURES:
                self._dropped.add(key)
            return None
        self._failures.pop(key, None)
        return value

    def _check_ecc(self, nvml: Any, index: int, handle: Any, now: float) -> None:
        volatile = getattr(nvml, "NVML_VOLATILE_ECC", 0)
        for label, kind in (
            ("uncorrected", getattr(nvml, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1)),
            ("corrected", getattr(nvml, "NVML_MEMORY_ERROR_TYPE_CORRECTED", 0)),
        ):
            count = self._metric(
                index,
                f"ecc_{label}",
                lambda k=kind: nvml.nvmlDeviceGetTotalEccErrors(handle, k, volatile),
            )
            if count is None:
                continue
            before = self._ecc.get((index, label))
            self._ecc[(index, label)] = int(count)
            if before is not None and count > before:
                self._event(
                    now,
                    index,
                    "ecc",
                    f"{int(count) - before} new {label} ECC errors (volatile count {int(count)})",
                )

    def _register_xid_events(self) -> None:
        nvml = self._nvml
        try:
            self._event_set = nvml.nvmlEventSetCreate()
        except Exception:
            self._event_set = None
            return
        kind = getattr(nvml, "nvmlEventTypeXidCriticalError", 8)
        for handle in self._handles:
            with contextlib.suppress(Exception):  # NotSupported on many boards: no XID events
                nvml.nvmlDeviceRegisterEvents(handle, kind, self._event_set)

    def _poll_xid(self, now: float) -> None:
        if self._event_set is None:
            return
        nvml = self._nvml
        wait = getattr(nvml, "nvmlEventSetWait_v2", None) or getattr(nvml, "nvmlEventSetWait", None)
        for _ in range(16):  # what arrived since the last sample
            try:
                data = wait(self._event_set, 0)
            except Exception as e:
                if _kind(nvml, e) in _DRIVER_GONE:
                    raise _DriverGone(_describe(e)) from None
                return  # Timeout: nothing new (or event sets unsupported)
            device = next(
                (i for i, h in enumerate(self._handles) if h == getattr(data, "device", None)), -1
            )
            self._event(now, device, "xid", f"XID {getattr(data, 'eventData', '?')}")

    def _event(self, now: float, device: int, kind: str, detail: str) -> None:
        with self._lock:
            self.events.append({"t": now, "device": device, "kind": kind, "detail": detail})

    # --- helpers -------------------------------------------------------------------------------

    def _unavailable(self, why: str) -> bool:
        self.available = False
        self.reason = f"NVML unavailable: {why}"
        return False

    def _read_or(self, fn: Callable[[], Any], default: Any) -> Any:
        try:
            return fn()
        except Exception:
            return default

    def _shutdown(self) -> None:
        nvml, self._handles = self._nvml, []
        if not self._initialized:
            return
        self._initialized = False
        if self._event_set is not None:
            with contextlib.suppress(Exception):
                nvml.nvmlEventSetFree(self._event_set)
            self._event_set = None
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def _kind(nvml: Any, error: BaseException) -> str | None:
    """The NVML error's name (``"NOT_SUPPORTED"``...), from its value and the module's
    ``NVML_ERROR_*`` constants; None for an error that is not NVML's."""
    value = getattr(error, "value", None)
    if value is None or nvml is None:
        return None
    for name in dir(nvml):
        if name.startswith("NVML_ERROR_") and getattr(nvml, name) == value:
            return name.removeprefix("NVML_ERROR_")
    return None


def _describe(error: BaseException) -> str:
    try:  # pynvml's str() asks the library for the text, which may be what is missing
        text = str(error).strip()
    except Exception:
        text = ""
    return text or type(error).__name__


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _num(value: Any) -> float | None:
    return None if value is None else float(value)
