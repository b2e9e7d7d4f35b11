"""The Overview tab: where each profiled step's time went (a stacked bar a step), the step times
as a sparkline, the outliers, and how much advice the report holds."""

from __future__ import annotations

import statistics
from typing import Any

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Label, Sparkline, Static

from tensordbg.tui.profiler.units import seconds, share

# The breakdown's categories in the order they are stacked: device-side first (they take the
# step's time by priority), then the host's phases.
CATEGORIES = (
    ("kernel", "#3b8ed0"),
    ("memcpy", "#d0a03b"),
    ("memset", "#b07a2a"),
    ("communication", "#c05050"),
    ("runtime", "#9a6ac0"),
    ("tensordbg", "#d070b0"),
    ("DataLoader", "#e0604a"),
    ("forward", "#4caf7a"),
    ("backward", "#2f8f9f"),
    ("optimizer", "#c9b440"),
    ("other", "#808080"),
)
KNOWN = dict(CATEGORIES)
NOT_CATEGORIES = ("step", "total")
LABEL = 9  # "step 1234"


def categories_of(breakdown: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The categories present in the breakdown, in stacking order, each with its colour;
    a category this UI does not know comes last, in grey."""
    present = {k for row in breakdown for k in row if k not in NOT_CATEGORIES}
    known = [(k, c) for k, c in CATEGORIES if k in present]
    return known + [(k, "#a0a0a0") for k in sorted(present - set(KNOWN))]


class StepBars(Static):
    """One bar a step, as long as the step took (the longest step fills the width), made of its
    categories in their colours, with the step's time after it."""

    def __init__(self) -> None:
        super().__init__(id="step-bars")
        self.breakdown: list[dict[str, Any]] = []

    def show(self, breakdown: list[dict[str, Any]]) -> None:
        self.breakdown = breakdown
        self.refresh(layout=True)

    def render(self) -> Text:
        rows = self.breakdown
        cats = categories_of(rows)
        text = Text()
        for name, colour in cats:
            text.append("■ ", style=colour)
            text.append(f"{name}  ")
        text.append("\n")
        if not rows:
            return text
        longest = max(float(r.get("total", 0.0)) for r in rows) or 1.0
        times = [seconds(r.get("total", 0.0)) for r in rows]
        room = max(self.size.width - LABEL - 2 - max(len(t) for t in times) - 1, 10)
        for row, time in zip(rows, times, strict=True):
            text.append(f"step {row.get('step', '?')}".rjust(LABEL) + "  ", style="bold")
            scale = room / longest
            done, cells = 0.0, 0
            for name, colour in cats:
                done += float(row.get(name, 0.0) or 0.0)
                # Boundaries rounded, not widths: the parts add up to the bar.
                end = round(done * scale)
                if end > cells:
                    text.append("█" * (end - cells), style=colour)
                    cells = end
            text.append(" " + time + "\n")
        return text


class OverviewPane(VerticalScroll):
    def __init__(self) -> None:
        super().__init__(id="profile-overview")
        self.head = Static(id="overview-head")
        self.bars = StepBars()
        self.spark = Sparkline([], id="step-spark", summary_function=max)
        self.means = Static(id="overview-means")
        self.notes = Static(id="overview-notes")

    def compose(self) -> ComposeResult:
        yield self.head
        yield self.bars
        yield Label("Step time", classes="spark-label")
        yield self.spark
        yield self.means
        yield self.notes

    def show(self, report: dict[str, Any]) -> None:
        rows = report.get("breakdown") or []
        totals = [float(r.get("total", 0.0)) for r in rows]
        steps = report.get("steps") or [r.get("step") for r in rows]
        head = Text()
        span = f"{steps[0]}–{steps[-1]}" if len(steps) > 1 else f"{steps[0]}" if steps else "-"
        head.append(f"{len(steps)} steps ({span}) on {report.get('device', '?')}", style="bold")
        if totals:
            head.append(f"   median step {seconds(statistics.median(totals))}")
            head.append(f", slowest {seconds(max(totals))}")
        paused = report.get("paused_seconds") or 0.0
        if paused:
            head.append(f"   ({seconds(paused)} paused on hits, not counted)", style="dim")
        self.head.update(head)
        self.bars.show(rows)
        self.spark.data = totals
        self.spark.styles.width = min(max(len(totals) * 4, 20), 100)  # a few columns a step
        self.means.update(self._means(rows, sum(totals)))
        self.notes.update(self._notes(report))

    def _means(self, rows: list[dict[str, Any]], total: float) -> Table:
        table = Table(box=None, padding=(0, 2), show_edge=False, title_justify="left")
        table.add_column("category")
        table.add_column("mean a step", justify="right")
        table.add_column("share", justify="right")
        for name, colour in categories_of(rows):
            spent = sum(float(r.get(name, 0.0) or 0.0) for r in rows)
            table.add_row(
                Text("■ ", style=colour) + Text(name),
                seconds(spent / max(len(rows), 1)),
                share(spent, total),
            )
        return table

    def _notes(self, report: dict[str, Any]) -> Text:
        text = Text()
        for o in report.get("outliers") or []:
            text.append("Outlier: ", style="bold yellow")
            text.append(
                f"step {o['step']} took {seconds(o['total'])}, {o['ratio']:.1f}x the median "
                f"{seconds(o['median'])}\n"
            )
        n = len(report.get("advice") or [])
        if n:
            text.append(f"{n} piece{'s' if n != 1 else ''} of advice", style="bold")
            text.append(" in the Advisor view (F8 moves between views).\n")
        else:
            text.append("No advice: no rule found a number past its threshold.\n", style="dim")
        if report.get("trace"):
            text.append("Chrome trace (open it in Perfetto): ", style="dim")
            text.append(f"{report['trace']}\n")
        if report.get("memory_snapshot"):
            text.append("Memory snapshot (PyTorch's memory visualizer): ", style="dim")
            text.append(f"{report['memory_snapshot']}\n")
        return text
