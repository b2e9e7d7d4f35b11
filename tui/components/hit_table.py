"""The Hits tab: every hit in execution order, origin hits first within their step; Enter opens
the hit's tensor in the Tensor tab."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual import on
from textual.message import Message
from textual.widgets import DataTable

from tensordbg.tui.messages import OpenTensor


class HitTable(DataTable):
    """One row per hit, keyed by the hit's id."""

    class Highlighted(Message):
        """The cursor is on ``hit`` (None when there are no hits)."""

        def __init__(self, hit: dict[str, Any] | None) -> None:
            super().__init__()
            self.hit = hit

    def __init__(self) -> None:
        super().__init__(id="hit-table", cursor_type="row", zebra_stripes=True)
        self._drawable = False  # set on mount; is_mounted is still False in on_mount
        self._hits: dict[int, dict[str, Any]] = {}
        self._select: int | None = None  # a hit to put the cursor on once drawn

    def on_mount(self) -> None:
        self._drawable = True
        self.add_column("step", key="step")
        self.add_column("phase", key="phase")
        self.add_column("rule", key="rule")
        self.add_column("tensor", key="tensor")
        self.add_column("where", key="where")
        self.add_column("message", key="message")
        self._draw()
        self.post_message(self.Highlighted(self.current))

    @property
    def next_id(self) -> int:
        """The id to ask ``hits(since=...)`` for, to learn only new hits."""
        return max(self._hits, default=-1) + 1

    def set_hits(self, hits: list[dict[str, Any]]) -> None:
        self._hits = {h["id"]: h for h in hits}
        self._draw()

    def merge(self, hits: list[dict[str, Any]]) -> None:
        if not hits:
            return
        current = self.current
        for hit in hits:
            self._hits[hit["id"]] = hit
        if current is not None and self._select is None:
            self._select = current["id"]  # the cursor stays on its hit
        self._draw()

    def select_hit(self, hit_id: int) -> None:
        self._select = hit_id
        self._draw()

    def _draw(self) -> None:
        if not self._drawable:  # data can arrive before the widget is mounted
            return
        self.clear()
        # Execution order, and within a step the origin first: that is where to look.
        order = sorted(self._hits.values(), key=lambda h: (h["step"], not h["origin"], h["id"]))
        for hit in order:
            where = (
                Text("● origin", style="bold red")
                if hit["origin"]
                else Text("↳ passed on", style="dim")
            )
            self.add_row(
                str(hit["step"]),
                hit["phase"],
                Text(hit["rule"], style="bold"),
                hit["tensor"],
                where,
                hit["message"],
                key=str(hit["id"]),
            )
        if self._select in self._hits:
            self.move_cursor(row=self.get_row_index(str(self._select)))
        self._select = None

    @property
    def current(self) -> dict[str, Any] | None:
        if not self._hits or not self.row_count:
            return None
        key = self.coordinate_to_cell_key((self.cursor_row, 0)).row_key
        return self._hits.get(int(key.value or 0))

    @on(DataTable.RowHighlighted)
    def _highlighted(self, event: DataTable.RowHighlighted) -> None:
        event.stop()
        self.post_message(self.Highlighted(self.current))

    @on(DataTable.RowSelected)
    def _open(self, event: DataTable.RowSelected) -> None:
        event.stop()
        hit = self._hits[int(event.row_key.value or 0)]
        self.post_message(
            OpenTensor(hit["ref"], hit["tensor"], module=hit.get("module"), call=hit.get("call", 0))
        )
