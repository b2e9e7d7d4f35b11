"""A DataTable whose rows are redrawn once their columns are sized."""

from __future__ import annotations

from textual import events
from textual.widgets import DataTable


class Table(DataTable):
    """Textual's DataTable sizes its columns for new rows when it is idle, but a line it drew
    before then (rows of fixed height) stays in its caches with the old widths: a name cut
    short, or rows out of line with the header, until the cursor moves. Once the columns have
    changed size, the lines are drawn again here."""

    async def _on_idle(self, event: events.Idle) -> None:
        width = self.virtual_size.width
        await super()._on_idle(event)
        if self.virtual_size.width != width:  # a column changed size
            clear = getattr(self, "_clear_caches", None)  # private: if it goes, so may the bug
            if clear is not None:
                clear()
            self.refresh()
