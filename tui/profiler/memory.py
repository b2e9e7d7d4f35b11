"""The Memory tab: allocated and reserved memory over the profiled steps (a plotext chart), the
peak against the device's limit, and the operators that allocated most."""

from __future__ import annotations

import math
from typing import Any

from rich.text import Text
from textual.app import ComposeResult, RenderResult
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
TICKS = 7  # labels on the y axis, at most
FRAME = 4  # rows of the chart that are not the plot: the title, two edges, the time labels


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


class MemoryChart(PlotextPlot):
    """The chart, its y axis from 0 to ``top`` with a label every few rows, each label on the
    row whose value it is. (plotext's own seven labels fall on fewer rows than seven in a short
    chart: two took one row and one was lost, the rest evenly spaced and so wrong.)"""

    top = 0.0  # the highest value drawn; 0 leaves the axis to plotext

    def render(self) -> RenderResult:
        rows = self.size.height - FRAME
        if self.top > 0 and rows > 1:
            # Rows between labels: the fewest that keep to TICKS labels, or up to twice that if
            # it lets the top row have one.
            fewest = math.ceil((rows - 1) / (TICKS - 1))
            every = next((e for e in range(fewest, 2 * fewest + 1) if (rows - 1) % e == 0), fewest)
            self.plt.ylim(0, self.top)
            self.plt.yticks([self.top * row / (rows - 1) for row in range(0, rows, every)])
        return super().render()


class MemoryPane(Vertical):
    def __init__(self) -> None:
        super().__init__(id="profile-memory")
        self.summary = Static(id="memory-summary")
        self.chart = MemoryChart(id="memory-chart")
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
        self.chart.top = top / scale if curve else 0.0
        self.chart.refresh()
        self.table.set_rows(memory.get("top_operators") or [])
