"""The Log tab: every pushed event, control reply and error, timestamped."""

from __future__ import annotations

import math
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
    if event == "status":
        return _status(payload)
    return ", ".join(f"{k.replace('_', ' ')} {_value(v)}" for k, v in payload.items())


def _status(payload: dict[str, Any]) -> str:
    """``step 25 done: loss 0.3051, gradient norm 0.3033, 12.14 steps/s; now running at step
    26 (forward), 2 hits``."""
    now = (
        f"{payload.get('state')} at step {payload.get('step')} ({payload.get('phase')}), "
        f"{payload.get('hits_total')} hits"
    )
    last = payload.get("last")
    if not last:
        return now
    names = (
        ("loss", "loss ", ""),
        ("grad_norm", "gradient norm ", ""),
        ("steps_per_sec", "", " steps/s"),
    )
    numbers = ", ".join(
        f"{before}{_value(last[key])}{after}"
        for key, before, after in names
        if last.get(key) is not None
    )
    return f"step {last.get('step')} done: {numbers or 'no numbers'}; now {now}"


def _value(value: Any) -> str:
    """A number as a person reads it: 4 significant digits, NaN as the grid writes it."""
    if isinstance(value, bool) or not isinstance(value, float):
        if isinstance(value, dict):
            return "{" + ", ".join(f"{k} {_value(v)}" for k, v in value.items()) + "}"
        return str(value)
    if math.isnan(value):
        return "NaN"
    return f"{value:.4g}"
