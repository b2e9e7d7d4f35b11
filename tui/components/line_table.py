"""What the UI's long tables share: a heading on line 0, one row per line after it, a cursor
row, and only the rows on screen drawn (Textual's Line API). The Modules tab, the Hits tab and
the profile's Operators and Kernels tables are such tables: a long run's tens of thousands of
hits, or thousands of operators, cost what their visible rows cost (Textual's DataTable laid out
every row: 30,000 hits kept a core busy, 2,000 operators took 0.6 s to refill).

A subclass says how many rows it shows (:attr:`row_count`), draws a line (``render_line``, with
:meth:`cells` and :meth:`fit`), and may hook :meth:`_moved` (the cursor moved) and
:meth:`_heading_clicked`.
"""

from __future__ import annotations

from typing import ClassVar

from rich.segment import Segment
from rich.style import Style
from textual.binding import Binding, BindingType
from textual.events import Click
from textual.scroll_view import ScrollView
from textual.strip import Strip

GAP = 2
"""Spaces between two columns."""

MOVES: list[BindingType] = [
    Binding("up", "move(-1)", "Up", show=False),
    Binding("down", "move(1)", "Down", show=False),
    Binding("pageup", "page(-1)", "Page up", show=False),
    Binding("pagedown", "page(1)", "Page down", show=False),
    Binding("home", "move(-1_000_000_000)", "First", show=False),
    Binding("end", "move(1_000_000_000)", "Last", show=False),
]


class LineTable(ScrollView, can_focus=True):
    """A table of rows under a heading, drawn a line at a time, with a cursor row."""

    BINDINGS: ClassVar[list[BindingType]] = MOVES

    def __init__(self, id: str | None = None) -> None:
        super().__init__(id=id)
        self.cursor = 0

    @property
    def row_count(self) -> int:
        raise NotImplementedError

    # --- the cursor ----------------------------------------------------------------------------

    def action_move(self, delta: int) -> None:
        self._go(self.cursor + delta)

    def action_page(self, direction: int) -> None:
        self._go(self.cursor + direction * max(self.scrollable_content_region.height - 2, 1))

    def action_select(self) -> None:
        """Enter, or a double click, on the cursor's row (nothing by default)."""

    def _go(self, row: int, force: bool = False) -> None:
        """Put the cursor on ``row`` (clamped), scrolled into view."""
        if not self.row_count:
            return
        row = max(0, min(row, self.row_count - 1))
        if row == self.cursor and not force:
            return
        before, self.cursor = self.cursor, row
        self._moved(before)

    def _moved(self, before: int) -> None:
        """The cursor went from row ``before`` to :attr:`cursor`: redraw both lines."""
        self.scroll_to_cursor()
        self.refresh_line(before + 1)  # virtual lines: the heading is line 0
        self.refresh_line(self.cursor + 1)

    def scroll_to_cursor(self) -> None:
        # The rows under the heading that show: a horizontal scrollbar (rows wider than an
        # 80-column screen) takes one, which left the cursor one row below the last shown.
        top, visible = round(self.scroll_y), max(self.scrollable_content_region.height - 1, 1)
        if self.cursor < top:
            self.scroll_to(y=self.cursor, animate=False, immediate=True)
        elif self.cursor >= top + visible:
            self.scroll_to(y=self.cursor - visible + 1, animate=False, immediate=True)

    def on_click(self, event: Click) -> None:
        offset = event.get_content_offset(self)
        if offset is None:
            return
        if offset.y == 0:
            self._heading_clicked(offset.x + round(self.scroll_x))
            return
        row = round(self.scroll_y) + offset.y - 1
        if row == self.cursor and event.chain > 1:
            self.action_select()
        self._go(row)

    def _heading_clicked(self, x: int) -> None:
        """A click on the heading, ``x`` cells from its start (nothing by default)."""

    # --- drawing -------------------------------------------------------------------------------

    def styled(self, base: Style, *names: str) -> tuple[Style, ...]:
        """``base``, then each component class in ``names`` over it (only what it sets):
        looked up once a frame, in ``render_lines``, not once a line."""
        return (base, *(base + self.get_component_rich_style(n, partial=True) for n in names))

    @staticmethod
    def cells(
        texts: tuple[str, ...] | list[str],
        widths: list[int],
        styles: list[Style],
        base: Style,
        right: tuple[bool, ...] | list[bool] = (),
    ) -> Strip:
        """A row of cells ``widths`` wide, ``GAP`` apart: a longer text ends in an ellipsis; a
        cell marked in ``right`` is right-aligned. Texts beyond ``widths`` are left out."""
        segments = []
        for i, (text, width, style) in enumerate(zip(texts, widths, styles, strict=False)):
            if len(text) > width:
                cell = text[: width - 1] + "…"
            else:
                cell = text.rjust(width) if i < len(right) and right[i] else text.ljust(width)
            segments.append(Segment(cell, style))
            segments.append(Segment(" " * GAP, base))
        return Strip(segments)

    def fit(self, strip: Strip) -> Strip:
        """The line as the screen shows it: scrolled sideways (← →), padded to the width in its
        last segment's style (so a cursor bar spans the width); a line whose text goes on past
        the right edge ends in an ellipsis there, so that it does not read as whole."""
        # The width left of the vertical scrollbar, which covers the line's last cells.
        x, width = round(self.scroll_x), self.scrollable_content_region.width
        if strip.crop(x + width).text.strip():  # not only a cell's padding is cut off
            cut = strip.crop(x, x + width - 1)
            return Strip([*cut, Segment("…", strip_style(cut))])
        return strip.crop(x, x + width).extend_cell_length(width, strip_style(strip))


def strip_style(strip: Strip) -> Style | None:
    """The style to pad a row with: its last segment's, so a cursor bar spans the width."""
    segments = list(strip)
    return segments[-1].style if segments else None
