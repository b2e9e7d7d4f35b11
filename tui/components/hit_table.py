"""The Hits tab: every hit in execution order, origin hits first within their step; Enter opens
the hit's tensor in the Tensor tab."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual import on
from textual.message import Message
from textual.widgets import DataTable

from tensordbg.tui.components.table import Table
from tensordbg.tui.messages import OpenTensor


def execution_order(hit: dict[str, Any]) -> tuple[int, bool, int]:
    """Execution order, and within a step the origin first: that is where to look."""
    return (hit["step"], not hit["origin"], hit["id"])


class HitTable(Table):
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
        self._stale = True  # the rows are not (yet) the hits: a full draw is due
        self._last: tuple[int, bool, int] | None = None  # the order of the last row

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
        """All the hits, at once (a welcome, a reload): drawn now, in this frame."""
        self._hits = {h["id"]: h for h in hits}
        self._stale = True
        self._draw()

    def merge(self, hits: list[dict[str, Any]]) -> None:
        """Add hits. The training pushes them one by one, maybe thousands: new hits that sort
        after the last row are appended, anything else draws every row again, once a refresh."""
        if not hits:
            return
        batch = {h["id"]: h for h in hits}
        new = sorted(batch.values(), key=execution_order)
        appendable = (
            not self._stale
            and batch.keys().isdisjoint(self._hits)
            and (self._last is None or execution_order(new[0]) > self._last)
        )
        self._hits.update(batch)
        if appendable:
            for hit in new:
                self._add(hit)
            return
        current = self.current
        if current is not None and self._select is None:
            self._select = current["id"]  # the cursor stays on its hit
        self._draw_soon()

    def select_hit(self, hit_id: int) -> None:
        self._select = hit_id
        if not self._stale:  # else the coming draw moves the cursor
            self._move_to_select()

    def _draw_soon(self) -> None:
        """Draw every row again after the next refresh, once however often asked until then
        (before mount the table is stale already, and on_mount draws)."""
        if not self._stale:
            self._stale = True
            self.call_after_refresh(self._draw)

    def _draw(self) -> None:
        if not (self._drawable and self._stale):  # not mounted yet, or drawn since asked
            return
        self._stale = False
        self.clear()
        self._last = None
        for hit in sorted(self._hits.values(), key=execution_order):
            self._add(hit)
        self._move_to_select()

    def _add(self, hit: dict[str, Any]) -> None:
        origin = hit["origin"]
        where = Text("● origin", style="bold red") if origin else Text("↳ passed on", style="dim")
        self.add_row(
            str(hit["step"]),
            hit["phase"],
            Text(hit["rule"], style="bold"),
            hit["tensor"],
            where,
            hit["message"],
            key=str(hit["id"]),
        )
        self._last = execution_order(hit)

    def _move_to_select(self) -> None:
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
