"""The Log tab: every pushed event, control reply and error, timestamped."""

from __future__ import annotations

import time
from typing import Any

from rich.text import Text
from textual.widgets import RichLog

LEVEL_STYLES = {"info": "", "error": "bold red", "warning": "yellow"}


class EventLog(RichLog):
    """One line per event; the newest at the bottom."""

    def __init__(self) -> None:
        super().__init__(id="event-log", max_lines=5000, wrap=True, markup=False)

    def write_entry(self, text: str, level: str = "info") -> None:
        line = Text(time.strftime("%H:%M:%S "), style="dim")
        line.append(text, style=LEVEL_STYLES.get(level, ""))
        self.write(line)

    def write_event(self, event: str, payload: dict[str, Any]) -> None:
        self.write_entry(f"{event}: {describe_event(event, payload)}", payload.get("level", "info"))


def describe_event(event: str, payload: dict[str, Any]) -> str:
    """A short sentence for a pushed event."""
    if event == "hit":
        where = "origin" if payload.get("origin") else "passed on"
        return (
            f"[{payload.get('rule')}] {payload.get('tensor')} at step {payload.get('step')} "
            f"({payload.get('phase')}, {where}): {payload.get('message')}"
        )
    if event == "state":
        reason = f" ({payload['reason']})" if payload.get("reason") else ""
        return f"{payload.get('state')} at step {payload.get('step')}{reason}"
    if event == "log":
        return str(payload.get("message", payload))
    return " ".join(f"{k}={v}" for k, v in payload.items())
