"""The Kernels tab, a GPU's view: each kernel's calls, total, mean and longest time, and whether
it ran on Tensor Cores. On a CPU there are none, and the tab says why (``kernels_note``)."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Static

from tensordbg.tui.profiler.row_table import Column, RowTable
from tensordbg.tui.profiler.units import number, seconds, share

COLUMNS = [
    Column("name", "kernel", str, numeric=False),
    Column("calls", "calls", number),
    Column("total", "total", seconds),
    Column("mean", "mean", seconds),
    Column("max", "max", seconds),
    Column("tensor_core", "Tensor Cores", lambda v: "" if v is None else "yes" if v else "no"),
]


class KernelsPane(Vertical):
    def __init__(self) -> None:
        super().__init__(id="profile-kernels")
        self.note = Static(id="kernel-note")
        self.table = RowTable(COLUMNS, sort="total", id="kernel-table")

    def compose(self) -> ComposeResult:
        yield self.note
        yield self.table

    def show(self, report: dict[str, Any]) -> None:
        kernels = report.get("kernels") or []
        self.table.set_rows(kernels)
        self.table.display = bool(kernels)
        if not kernels:  # the note says why ("profiled on the CPU: no kernels") on its own
            why = report.get("kernels_note") or "no kernels: the profile recorded no GPU kernels"
            self.note.update(Text(f"{why[:1].upper()}{why[1:]}.", style="bold"))
            return
        total = sum(k.get("total") or 0.0 for k in kernels)
        tc = sum(k.get("total") or 0.0 for k in kernels if k.get("tensor_core"))
        text = Text()
        text.append(f"{len(kernels):,} kernels, {seconds(total)} on the device", style="bold")
        text.append(f" · Tensor Cores {share(tc, total)} of kernel time")
        text.append(" · o: sort by the next column, O: reverse", style="dim")
        self.note.update(text)
