"""The Advisor view: each piece of advice with the rule that gave it, the measured number against
its threshold (the evidence), and the change to try."""

from __future__ import annotations

from typing import Any

from rich.console import Group, RenderableType
from rich.padding import Padding
from rich.table import Table
from rich.text import Text
from textual.containers import VerticalScroll
from textual.widgets import Static


class AdvisorPane(VerticalScroll):
    def __init__(self) -> None:
        super().__init__(id="profile-advisor")
        self.body = Static(id="advice")

    def compose(self):  # type: ignore[no-untyped-def]
        yield self.body

    def show(self, report: dict[str, Any]) -> None:
        advice = report.get("advice") or []
        if not advice:
            self.body.update(
                Text("No advice: no rule found a number past its threshold.", style="bold")
            )
            return
        items: list[RenderableType] = []
        for n, item in enumerate(advice, 1):
            # A grid, so that a sentence that wraps stays beside its label (hanging indent).
            grid = Table.grid(padding=(0, 2))
            grid.add_column(style="dim", min_width=8, no_wrap=True)
            grid.add_column()
            grid.add_row("evidence", Text(str(item.get("evidence", ""))))
            grid.add_row("try", Text(str(item.get("message", "")), style="bold"))
            items.append(Text(f"{n}. {item.get('rule', '?')}", style="bold yellow"))
            items.append(Padding(grid, (0, 0, 1, 3)))
        self.body.update(Group(*items))
