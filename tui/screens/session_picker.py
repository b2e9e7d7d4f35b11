"""A list of the live sessions to choose from, when more than one training is being debugged."""

from __future__ import annotations

import time
from typing import Any, ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Label

from tensordbg.tui.components.table import Table


def session_field(session: Any, name: str) -> Any:
    """A field of a session (``ConnectionInfo``, or a plain dict in tests)."""
    if isinstance(session, dict):
        return session.get(name)
    return getattr(session, name, None)


class SessionPicker(Screen[str | None]):
    """Dismissed with the chosen session's connection-file path."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "app.quit", "Quit"),
        Binding("q", "app.quit", "Quit", show=False),
    ]

    def __init__(self, sessions: list[Any]) -> None:
        super().__init__()
        self.sessions = sessions

    def compose(self) -> ComposeResult:
        with Vertical(id="session-picker"):
            yield Label(
                f"{len(self.sessions)} tensordbg sessions are running: pick one (Enter)",
                classes="dialog-title",
            )
            yield Table(id="session-table", cursor_type="row")
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("script", "run id", "rank", "pid", "host", "started")
        for i, s in enumerate(self.sessions):
            started = session_field(s, "started")
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if started else "?"
            table.add_row(
                str(session_field(s, "script") or "?"),
                str(session_field(s, "run_id")),
                str(session_field(s, "rank")),
                str(session_field(s, "pid")),
                str(session_field(s, "host") or ""),
                when,
                key=str(i),
            )
        table.focus()

    @on(DataTable.RowSelected)
    def _picked(self, event: DataTable.RowSelected) -> None:
        session = self.sessions[int(event.row_key.value or 0)]
        path = session_field(session, "path")
        self.dismiss(str(path) if path is not None else None)
