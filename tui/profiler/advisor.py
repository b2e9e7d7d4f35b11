"""The Advisor tab: each piece of advice with the rule that gave it, the measured number against
its threshold (the evidence), and the change to try."""

from __future__ import annotations

from typing import Any

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
        text = Text()
        if not advice:
            text.append("No advice: no rule found a number past its threshold.", style="bold")
        for n, item in enumerate(advice, 1):
            text.append(f"{n}. {item.get('rule', '?')}\n", style="bold yellow")
            text.append("   evidence  ", style="dim")
            text.append(f"{item.get('evidence', '')}\n")
            text.append("   try       ", style="dim")
            text.append(f"{item.get('message', '')}\n\n", style="bold")
        self.body.update(text)
