"""The watched tensors of one module in the current phase; Enter opens one in the Tensor tab."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual import on
from textual.widgets import DataTable

from tensordbg.statistics import describe
from tensordbg.tui.components.table import Table
from tensordbg.tui.messages import OpenTensor


def summary_line(tensor: dict[str, Any]) -> str:
    """The one-line summary of a tensor from ``tensors()``, or its shape and dtype."""
    return describe(tensor.get("summary") or {}, tensor["shape"], tensor["dtype"])


class TensorTable(Table):
    """Rows keyed by the tensor's ref."""

    def __init__(self) -> None:
        super().__init__(id="tensor-table", cursor_type="row")
        self._drawable = False  # set on mount; is_mounted is still False in on_mount
        self._tensors: dict[int, dict[str, Any]] = {}

    def on_mount(self) -> None:
        self._drawable = True
        self._draw()

    def show(self, tensors: list[dict[str, Any]]) -> None:
        self._tensors = {t["ref"]: t for t in tensors}
        self._draw()

    def _draw(self) -> None:
        if not self._drawable:  # data can arrive before the widget is mounted
            return
        # Columns too: they keep the width of the longest name of any module shown before.
        self.clear(columns=True)
        self.add_columns("kind", "call", "name", "summary")
        for t in self._tensors.values():
            line = summary_line(t)
            style = "bold red" if "!" in line else ""
            if not t.get("retained", True):  # values the session let go, or the dump lacks
                replay = getattr(self.app, "state", "") == "replay"
                style, line = "dim", f"{line}  ({'not dumped' if replay else 'not retained'})"
            name = f"{t['name']} = {t['same_as']}" if t.get("same_as") else t["name"]
            self.add_row(
                # Text, not a string: DataTable reads a string as markup ("x[ab]" loses "[ab]").
                t["kind"],
                str(t["call"]),
                Text(name),
                Text(line, style=style),
                key=str(t["ref"]),
            )

    @on(DataTable.RowSelected)
    def _open(self, event: DataTable.RowSelected) -> None:
        event.stop()
        tensor = self._tensors[int(event.row_key.value or 0)]
        self.post_message(OpenTensor(tensor["ref"], tensor["name"]))
