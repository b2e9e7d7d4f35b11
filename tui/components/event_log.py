"""The Log tab: every pushed event, control reply and error, timestamped."""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from typing import Any

from rich.text import Text
from textual import events
from textual.widgets import RichLog

from tensordbg.tui.remote import step_phrase

LEVEL_STYLES = {"info": "", "error": "bold red", "warning": "yellow"}
MAX_ENTRIES = 5000
CHUNK = 200  # entries written a frame when many wait (5000 took the UI 1.7 s in one go)


class EventLog(RichLog):
    """One line per event; the newest at the bottom, wrapped at the log's width.

    RichLog wraps a line once, when it is written, at the width it has then: a line written
    while the tab was hidden (no width) was wrapped at its 78-column minimum. Here an entry is
    written while the log is on screen, else when it comes back (``on_resize``), and every
    entry is wrapped again when the width changes."""

    def __init__(self) -> None:
        super().__init__(id="event-log", max_lines=MAX_ENTRIES, wrap=True, markup=False)
        self._entries: deque[Text] = deque(maxlen=MAX_ENTRIES)
        self._unwritten = 0  # the newest entries, not written yet (the log was hidden)
        self._wrapped_at = 0  # the width the lines were wrapped at

    def write_entry(self, text: str, level: str = "info") -> None:
        line = Text(time.strftime("%H:%M:%S "), style="dim")
        line.append(text, style=LEVEL_STYLES.get(level, ""))
        self._entries.append(line)
        self._unwritten = min(self._unwritten + 1, MAX_ENTRIES)
        if self._unwritten == 1:  # else those before it wait too: written in their turn
            self._catch_up()

    def on_resize(self, event: events.Resize) -> None:
        self._catch_up()

    def _catch_up(self) -> None:
        """Write the entries that wait, oldest first, CHUNK a frame, at the log's width; all
        of them again when the width changed. Hidden, the log has no width: they wait."""
        width = self.scrollable_content_region.width
        if not width:
            return
        if width != self._wrapped_at:
            self._wrapped_at, self._unwritten = width, len(self._entries)
            self.clear()
        first = len(self._entries) - self._unwritten
        for line in itertools.islice(self._entries, first, first + CHUNK):
            self.write(line, width=width)
        self._unwritten = max(self._unwritten - CHUNK, 0)
        if self._unwritten:
            self.call_after_refresh(self._catch_up)

    _last_state = ""

    def write_event(self, event: str, payload: dict[str, Any]) -> None:
        text = f"{event}: {describe_event(event, payload)}"
        if event == "state":
            if text == self._last_state:
                return  # the same state said again (a detach, then the connection's end)
            self._last_state = text
        self.write_entry(text, payload.get("level", "info"))


def describe_event(event: str, payload: dict[str, Any]) -> str:
    """A short sentence for a pushed event."""
    if event == "hit":
        where = "origin" if payload.get("origin") else "passed on"
        return (
            f"[{payload.get('rule')}] {payload.get('tensor')} at step {payload.get('step')} "
            f"({payload.get('phase')}, {where}): {payload.get('message')}"
        )
    if event == "state":
        # Why it paused, how it finished; the training sends the last pause's reason with
        # every state ("running at step 26 (NaN hit: ...)" read as if it ran because of it).
        said = payload.get("state") in ("paused", "finished") and payload.get("reason")
        reason = f" ({payload['reason']})" if said else ""
        state = str(payload.get("state"))
        where = step_phrase(state, payload.get("step"), payload.get("phase", ""))
        return f"{state} {where}{reason}"
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
