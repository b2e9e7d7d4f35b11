"""A DataTable whose rows are redrawn once their columns are sized, and whose lines cut by the
right edge end in an ellipsis, as the line tables' do (``LineTable.fit``)."""

from __future__ import annotations

from typing import ClassVar

from rich.segment import Segment
from rich.text import Text
from textual import events
from textual.binding import Binding, BindingType
from textual.strip import Strip
from textual.widgets import DataTable

from tensordbg.tui.components.line_table import strip_style


class Table(DataTable):
    """Textual's DataTable sizes its columns for new rows when it is idle, but a line it drew
    before then (rows of fixed height) stays in its caches with the old widths: a name cut
    short, or rows out of line with the header, until the cursor moves. Once the columns have
    changed size, the lines are drawn again here.

    A narrow terminal cuts the table's right-hand columns off at the edge of the screen, and
    nothing said that more followed (← → scroll sideways): a line whose text goes on past the
    right edge ends in "…" there. Rows are one line high, as every table here has them."""

    # Home and End move to the first and last row, as they do in the Hits and Modules lists
    # (DataTable's own scroll sideways: End, then Space, toggled the first rule).
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("home", "first_row", "First", show=False),
        Binding("end", "last_row", "Last", show=False),
    ]

    _drawn_widths: tuple[int, ...] = ()

    def action_first_row(self) -> None:
        if self.row_count:
            self.move_cursor(row=0)

    def action_last_row(self) -> None:
        if self.row_count:
            self.move_cursor(row=self.row_count - 1)

    async def _on_idle(self, event: events.Idle) -> None:
        await super()._on_idle(event)
        # The columns' widths against those the cached lines were drawn with: they may have
        # changed in this idle handler or anywhere since the last one (a busy CPU delays it).
        widths = tuple(column.get_render_width(self) for column in self.ordered_columns)
        if widths != self._drawn_widths:
            self._drawn_widths = widths
            clear = getattr(self, "_clear_caches", None)  # private: if it goes, so may the bug
            if clear is not None:
                clear()
            self.refresh()

    def render_line(self, y: int) -> Strip:
        strip = super().render_line(y)
        # The width left of the vertical scrollbar, which covers the line's last cells.
        x, width = round(self.scroll_x), self.scrollable_content_region.width
        if width < 2 or self.text_end(y) <= x + width:  # only a cell's padding is cut, if any
            return strip
        cut = strip.crop(0, width - 1)
        return Strip([*cut, Segment("…", strip_style(cut)), *strip.crop(width)])

    def text_end(self, y: int) -> int:
        """How far the text of line ``y`` on screen (the heading, then rows one line high)
        reaches from the table's left edge, in cells: 0 for a line with no row."""
        if self.show_header and y < self.header_height:
            cells: list[object] = [column.label for column in self.ordered_columns]
        else:
            row = y - (self.header_height if self.show_header else 0) + round(self.scroll_y)
            if not 0 <= row < self.row_count:
                return 0
            cells = self.get_row_at(row)
        end = left = 0
        for column, cell in zip(self.ordered_columns, cells, strict=False):
            width = column.get_render_width(self)
            text = shown(cell)
            if text is None:  # not text: it may fill its column
                end = left + width - self.cell_padding
            elif text.plain.strip():
                inner = width - 2 * self.cell_padding
                length = min(text.cell_len, inner)
                free = {"right": inner - length, "center": (inner - length) // 2}
                end = left + self.cell_padding + free.get(text.justify or "left", 0) + length
            left += width
        return end


def shown(cell: object) -> Text | None:
    """A cell's value as DataTable draws it (a string is markup), or None if it is not text."""
    if isinstance(cell, Text):
        return cell
    if isinstance(cell, str):
        return Text.from_markup(cell)
    if isinstance(cell, float):
        return Text(f"{cell:.2f}")
    if isinstance(cell, int):
        return Text(str(cell))
    return None
