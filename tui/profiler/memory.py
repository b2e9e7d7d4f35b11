"""The Memory tab: allocated and reserved memory over the profiled steps (a plotext chart), the
peak against the device's limit, and the operators that allocated most."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Static
from textual_plotext import PlotextPlot

from tensordbg.tui.profiler.row_table import Column, RowTable
from tensordbg.tui.profiler.units import number, share, size

POINTS = 400  # drawn of the curve: a chart is at most a few hundred braille dots wide
COLUMNS = [
    Column("name", "operator", str, numeric=False),
    Column("bytes", "allocated", size),
    Column("calls", "calls", number),
]
UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("B", 1))


def thin(curve: list[list[Any]], points: int = POINTS) -> list[list[Any]]:
    """At most ``points`` of the curve, each the highest of the samples it stands for (a peak
    is never thinned away)."""
    if len(curve) <= points:
        return curve
    out = []
    step = len(curve) / points
    for k in range(points):
        bucket = curve[int(k * step) : max(int((k + 1) * step), int(k * step) + 1)]
        out.append(max(bucket, key=lambda p: p[1] or 0))
    return out


class MemoryPane(Vertical):
    def __init__(self) -> None:
        super().__init__(id="profile-memory")
        self.summary = Static(id="memory-summary")
        self.chart = PlotextPlot(id="memory-chart")
        self.table = RowTable(COLUMNS, sort="bytes", id="memory-table")

    def compose(self) -> ComposeResult:
        yield self.summary
        yield self.chart
        yield self.table

    def show(self, report: dict[str, Any]) -> None:
        memory = report.get("memory") or {}
        curve = thin(memory.get("curve") or [])
        peak, limit = memory.get("peak_allocated") or 0, memory.get("limit")
        reserved = memory.get("peak_reserved")
        text = Text()
        text.append(f"peak allocated {size(peak)}", style="bold")
        if reserved is not None:
            text.append(f" · peak reserved {size(reserved)}")
        if limit:
            near = peak / limit >= 0.9
            text.append(
                f" · limit {size(limit)} ({share(peak, limit)} used at the peak)",
                style="bold red" if near else "",
            )
        self.summary.update(text)
        top = max([peak, reserved or 0, limit or 0, *(p[1] or 0 for p in curve)])
        unit, scale = next((u, s) for u, s in UNITS if top >= s or s == 1)
        plt = self.chart.plt
        plt.clear_data()
        plt.clear_figure()
        if curve:
            t = [p[0] - curve[0][0] for p in curve]
            plt.plot(t, [(p[1] or 0) / scale for p in curve], label="allocated", marker="braille")
            if any(p[2] is not None for p in curve):
                rows = [(p[2] or 0) / scale for p in curve]
                plt.plot(t, rows, label="reserved", marker="braille")
            if limit:
                plt.hline(limit / scale, "red")
        plt.title(f"memory ({unit}) over time (s)" + (", limit in red" if limit else ""))
        self.chart.refresh()
        self.table.set_rows(memory.get("top_operators") or [])
