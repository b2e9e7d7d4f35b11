"""The GPU tab: live NVML samples from the training's background sampler (utilization, memory,
power, temperature, clocks, PCIe) and its XID and ECC error events. It asks ``gpu(since)`` once a
second while it is on screen, and never otherwise; without NVML it says why in one line."""

from __future__ import annotations

from collections import deque
from typing import Any

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.timer import Timer
from textual.widgets import Label, Sparkline, Static

from tensordbg.tui.errors import work
from tensordbg.tui.profiler.units import size
from tensordbg.tui.remote import OVER, RequestFailed, remote_of

POLL = 1.0  # seconds between requests while the tab is on screen
KEPT = 600  # samples kept a device (ten minutes at 1 Hz)


class GpuPane(VerticalScroll):
    def __init__(self) -> None:
        super().__init__(id="profile-gpu")
        self.head = Static(id="gpu-head")
        self.numbers = Static(id="gpu-numbers")
        self.util = Sparkline([], id="gpu-util-spark", summary_function=max)
        self.memory = Sparkline([], id="gpu-mem-spark", summary_function=max)
        self.events = Static(id="gpu-events")
        self.since = 0.0
        self.polls = 0  # requests made, for the tests: none while hidden
        self.devices: list[dict[str, Any]] = []
        self.samples: dict[int, deque[dict[str, Any]]] = {}
        self.event_list: list[dict[str, Any]] = []
        self._timer: Timer | None = None

    def compose(self) -> ComposeResult:
        yield self.head
        with Vertical(id="gpu-live"):
            yield self.numbers
            yield Label("Utilization (%) of the first device", classes="spark-label")
            yield self.util
            yield Label("Memory used of the first device", classes="spark-label")
            yield self.memory
            yield self.events

    def on_mount(self) -> None:
        self.query_one("#gpu-live").display = False
        if not remote_of(self).serves("gpu"):
            self.head.update(Text("NVML unavailable: this session does not serve GPU samples."))
        else:
            self.head.update(Text("Asking the training for GPU samples…"))

    def on_show(self) -> None:
        if getattr(self.app, "state", "") in OVER and not self.polls:
            self.head.update(Text("The training has ended: no GPU samples to ask for."))
            return
        if self._timer is None and remote_of(self).serves("gpu"):
            self._poll()
            self._timer = self.set_interval(POLL, self._poll)

    def on_hide(self) -> None:
        if self._timer is not None:
            self._timer.stop()
            self._timer = None

    @property
    def polling(self) -> bool:
        return self._timer is not None

    @work(group="gpu", exclusive=True)
    async def _poll(self) -> None:
        self.polls += 1
        try:
            reply = await remote_of(self).gpu(since=self.since)
        except RequestFailed as e:
            if getattr(self.app, "state", "") in OVER:  # no next poll will be answered
                self.head.update(Text("The training has ended: no more GPU samples."))
            elif not self.devices:  # nothing shown yet: "Asking…" would stay for good
                self.head.update(Text(f"No GPU samples: {e.message} (asked again each second)"))
            return  # the Log tab says why; the next poll tries again
        self.show(reply)

    def show(self, reply: dict[str, Any]) -> None:
        if not reply.get("available"):
            reason = reply.get("reason") or "no reason given"
            if not reason.startswith("NVML unavailable"):
                reason = f"NVML unavailable: {reason}"
            self.head.update(Text(reason, style="bold"))
            self.query_one("#gpu-live").display = False
            return
        self.query_one("#gpu-live").display = True
        self.devices = reply.get("devices") or []
        for sample in reply.get("samples") or []:
            self.samples.setdefault(sample.get("device", 0), deque(maxlen=KEPT)).append(sample)
            self.since = max(self.since, float(sample.get("t", 0.0)))
        self.event_list = (self.event_list + list(reply.get("events") or []))[-100:]
        names = ", ".join(f"{d.get('index')}: {d.get('name')}" for d in self.devices)
        self.head.update(Text(f"NVML: {len(self.devices)} device(s) ({names})", style="bold"))
        self.numbers.update(self._latest())
        first = self.samples.get(self.devices[0].get("index", 0) if self.devices else 0)
        if first:
            self.util.data = [float(s.get("util") or 0) for s in first]
            self.memory.data = [float(s.get("memory_used") or 0) for s in first]
        self.events.update(self._events())

    def _latest(self) -> Table:
        table = Table(box=None, padding=(0, 1), show_edge=False)
        for title in ("device", "util", "mem util", "memory", "power", "temp", "SM MHz",
                      "mem MHz", "PCIe tx", "PCIe rx"):  # fmt: skip
            table.add_column(title, justify="left" if title == "device" else "right", no_wrap=True)
        for device in self.devices:
            index = device.get("index", 0)
            kept = self.samples.get(index)
            if not kept:
                table.add_row(str(index), *["-"] * 9)
                continue
            s = kept[-1]

            def of(key: str, unit: str, s: dict[str, Any] = s) -> str:
                value = s.get(key)
                return "-" if value is None else f"{value:g}{unit}"

            def rate(key: str, s: dict[str, Any] = s) -> str:
                value = s.get(key)  # KiB/s
                return "-" if value is None else f"{size(value * 1024)}/s"

            total = device.get("memory_total")
            used = s.get("memory_used")
            memory = "-" if used is None else size(used) + (f" / {size(total)}" if total else "")
            table.add_row(
                str(index), of("util", " %"), of("mem_util", " %"), memory, of("power_w", " W"),
                of("temp_c", " °C"), of("sm_clock_mhz", ""), of("mem_clock_mhz", ""),
                rate("pcie_tx_kbs"), rate("pcie_rx_kbs"),
            )  # fmt: skip
        return table

    def _events(self) -> Text:
        if not self.event_list:
            return Text("No XID or ECC error events.", style="dim")
        text = Text("Error events\n", style="bold red")
        for e in self.event_list[-20:]:
            text.append(f"  t={e.get('t', 0):.1f} s  device {e.get('device')}  ")
            text.append(f"{str(e.get('kind', '?')).upper()}  {e.get('detail', '')}\n")
        return text
