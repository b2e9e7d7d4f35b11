"""The values of a tensor slice as a virtual grid that asks only for what is on screen.

The slice is viewed as 2-D (dims before the last flattened into rows, as ``slice()`` sends it);
a 1-D slice is shown as a column, one value a row, so that a bias or a row of a matrix reads
down the screen (at 80x24 a row of values showed 3 of them, and the fourth took Tab and End).
The grid is cut into blocks of ``BLOCK_ROWS`` x ``BLOCK_COLS``; drawing a line asks for the blocks
it needs with ``slice(ref, text, window=...)``, shows placeholders until they arrive, and keeps
the last ``MAX_BLOCKS`` blocks. So scrolling a 10^8-element tensor moves a few kilobytes.
Requests run in async workers; decoding and formatting a block in a thread worker.
"""

from __future__ import annotations

import math
import textwrap
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import ClassVar

import numpy as np
from rich.segment import Segment
from rich.style import Style
from textual import events, on
from textual.binding import Binding, BindingType
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip

from tensordbg.sources.slicing import grid_shape
from tensordbg.transport.wire import WireArray
from tensordbg.tui.components.typed_ahead import keys_in_order, search
from tensordbg.tui.errors import work
from tensordbg.tui.remote import RequestFailed, remote_of

BLOCK_ROWS = 64
BLOCK_COLS = 16
MAX_BLOCKS = 256
CELL = 11  # characters per value, the gap included
PLACEHOLDER = "·".rjust(CELL - 1) + " "  # a value on its way
UNAVAILABLE = "?".rjust(CELL - 1) + " "  # a value the training would not send

# What a cell holds, for its colour.
NORMAL, NAN, INF = 0, 1, 2

BlockRow = tuple[str, bytes | None]  # the row's text, and each cell's kind when any is special


def format_block(values: np.ndarray) -> list[BlockRow]:
    """Text of a 2-D block of values, CELL characters a value, with the kinds of its cells."""
    rows: list[BlockRow] = []
    is_float = values.dtype.kind == "f"
    nan = np.isnan(values) if is_float else None
    inf = np.isinf(values) if is_float else None
    width = CELL - 1
    for r, row in enumerate(values.tolist()):
        if is_float:
            text = "".join(_float_cell(v, width) for v in row)
            special = nan[r].any() or inf[r].any()
            kinds = (
                np.where(nan[r], NAN, np.where(inf[r], INF, NORMAL)).astype(np.uint8).tobytes()
                if special
                else None
            )
        else:
            text = "".join(_other_cell(v, width) for v in row)
            kinds = None
        rows.append((text, kinds))
    return rows


def _float_cell(v: float, width: int) -> str:
    if math.isnan(v):
        return "NaN".rjust(width) + " "
    if math.isinf(v):
        return ("+Inf" if v > 0 else "-Inf").rjust(width) + " "
    for digits in (4, 3, 2, 1):  # fewer digits before a number is cut
        text = f"{v:.{digits}g}"
        if len(text) <= width:
            return f"{text:>{width}} "
    return text[: width - 1] + "… "  # unreachable for float64, kept as the rule: never cut


def _other_cell(v: object, width: int) -> str:
    """An integer or bool, whole; an integer too long for the cell in scientific notation."""
    text = str(v)
    if len(text) > width and isinstance(v, int):
        text = f"{v:.3e}"
    if len(text) > width:
        text = text[: width - 1] + "…"
    return f"{text:>{width}} "


class TensorGrid(ScrollView, can_focus=True):
    """Rows and columns of a slice, with sticky indices on the top and left."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("left", "columns(-1)", "Left", show=False),
        Binding("right", "columns(1)", "Right", show=False),
        Binding("up", "rows(-1)", "Up", show=False),
        Binding("down", "rows(1)", "Down", show=False),
        Binding("pageup", "pages(-1)", "Page up", show=False),
        Binding("pagedown", "pages(1)", "Page down", show=False),
        Binding("home", "rows(-1_000_000_000)", "First row", show=False),
        Binding("end", "rows(1_000_000_000)", "Last row", show=False),
        Binding("f", "find_bad", "Next NaN/Inf"),
    ]
    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "tensor-grid--index",
        "tensor-grid--nan",
        "tensor-grid--inf",
        "tensor-grid--placeholder",
        "tensor-grid--found",
    }

    class BlockReady(Message):
        """A block was decoded (in a thread) and can be drawn."""

        def __init__(self, generation: int, key: tuple[int, int], rows: list[BlockRow]) -> None:
            super().__init__()
            self.generation = generation
            self.key = key
            self.rows = rows

    def __init__(self) -> None:
        super().__init__(id="tensor-grid")
        self.border_title = "values"
        self._generation = 0
        self._ref: int | None = None
        self._text = ""
        self._shape: tuple[int, ...] = ()
        self._rows = self._cols = 0
        self._column = False  # a 1-D slice, shown down (the source's grid is one row of it)
        self._label_width = 0
        self._labels: Sequence[Sequence[int] | None] | None = None
        self._blocks: OrderedDict[tuple[int, int], list[BlockRow]] = OrderedDict()
        self._pending: set[tuple[int, int]] = set()
        self._wanted: set[tuple[int, int]] = set()
        self._failed: set[tuple[int, int]] = set()
        self.message = "Open a tensor from the Hits or Modules tab."
        self._found: tuple[int, int] | None = None
        """The cell of the NaN or Inf ``f`` found last (row, column), marked on screen."""
        self.open_slice: Callable[[], object] | None = None
        """What ``[`` does on the grid: the Tensor tab focuses its slice box (set by it)."""

    # --- what to show ------------------------------------------------------------------------

    def show(self, ref: int, text: str, shape: tuple[int, ...],
             labels: Sequence[Sequence[int] | None] | None = None) -> None:  # fmt: skip
        """Show the slice ``text`` (of the given shape) of tensor ``ref``, from its top left;
        ``labels``: the tensor's indices of each dim's positions (``axis_labels``), what its
        rows and columns are labelled with (``[3, 2:5]``'s columns are 2 3 4, not 0 1 2)."""
        self._forget()
        self._ref, self._text, self._shape = ref, text, tuple(shape)
        self._labels = labels if labels is not None and len(labels) == len(shape) else None
        self._rows, self._cols = grid_shape(self._shape)
        self._column = len(self._shape) == 1
        if self._column:
            self._rows, self._cols = self._cols, self._rows
        if math.prod(self._shape) == 0:
            self._rows = self._cols = 0
        self._label_width = max(self._widest_row_label(), 1) + 1 if self._rows else 1
        # One spare cell so the last column can scroll fully into view.
        width = self._label_width + (self._cols + 1) * CELL
        self.virtual_size = Size(width, self._rows + 1)
        self.scroll_to(0, 0, animate=False, immediate=True)
        self.message = "" if self._rows else "(empty slice)"
        self.refresh()
        if self._rows:  # ask for the first screen now rather than when it is first drawn
            c0, c1 = self._visible_columns()
            for br in range(min(self.size.height, self._rows) // BLOCK_ROWS + 1):
                for bc in range(c0 // BLOCK_COLS, (c1 - 1) // BLOCK_COLS + 1):
                    self._want((br, bc))

    def clear(self, message: str) -> None:
        """Show no tensor, only ``message`` (a tensor that could not be opened)."""
        self._forget()
        self._ref, self._text, self._shape = None, "", ()
        self._rows = self._cols = 0
        self.virtual_size = Size(1, 1)
        self.message = message
        self.refresh()

    def _forget(self) -> None:
        """Drop the blocks of the tensor shown; replies still on their way are ignored."""
        self._generation += 1
        self._found = None
        self.border_subtitle = ""
        self._blocks.clear()
        self._pending.clear()
        self._wanted.clear()
        self._failed.clear()

    @property
    def rows(self) -> int:
        return self._rows

    @property
    def cols(self) -> int:
        return self._cols

    def _row_label(self, row: int) -> str:
        """The index of a grid row in the tensor: ``12``, or ``2,5`` when rows are flattened."""
        lead = self._shape[:-1]
        if self._column:
            return self._label(0, row)
        if len(lead) <= 1:
            return self._label(0, row) if lead else ""
        return ",".join(self._label(a, int(i)) for a, i in enumerate(np.unravel_index(row, lead)))

    def _label(self, axis: int, position: int) -> str:
        """A position of the slice along ``axis`` as the tensor's index there."""
        known = self._labels is not None and 0 <= axis < len(self._labels)
        labels = self._labels[axis] if known else None  # type: ignore[index]
        return str(labels[position] if labels is not None else position)

    def _widest_row_label(self) -> int:
        rows = self._labels[0] if self._labels is not None and len(self._shape) in (1, 2) else None
        if isinstance(rows, range):  # monotonic: its ends are its widest
            return max(len(str(rows[0])), len(str(rows[-1])))
        if rows is not None:  # a list (4,096 at most), in any order
            return max(len(str(i)) for i in rows)
        return max(len(self._row_label(r)) for r in {0, self._rows - 1})

    def on_key(self, event: events.Key) -> None:
        opens = {"slash": search(self)}
        if self.open_slice is not None:
            opens["left_square_bracket"] = self.open_slice
        keys_in_order(self, event, opens)  # "[3]" typed fast: "[" opens the box, "3]" in it

    # --- keys --------------------------------------------------------------------------------

    def action_columns(self, n: int) -> None:
        self.scroll_to(x=max(0, self.scroll_x + n * CELL), animate=False, immediate=True)

    def action_rows(self, n: int) -> None:
        y = min(max(0, self.scroll_y + n), self.max_scroll_y)
        self.scroll_to(y=y, animate=False, immediate=True)

    def action_pages(self, n: int) -> None:
        page = max(self.size.height - 2, 1)
        self.scroll_to(y=max(0, self.scroll_y + n * page), animate=False, immediate=True)

    def action_find_bad(self) -> None:
        """Jump to the next NaN or Inf of the slice shown (after the one found last), from the
        start again after the last: the training finds it, a chunk at a time."""
        if self._ref is None or not self._rows:
            self.border_subtitle = "no values shown: nothing to search"
            return
        after = -1 if self._found is None else self._found[0] * self._cols + self._found[1]
        self._find(self._generation, after)

    @work(group="grid-find", exclusive=True)
    async def _find(self, generation: int, after: int) -> None:
        try:
            reply = await remote_of(self).find(self._ref, self._text, after)
        except RequestFailed as e:  # logged by the app
            if generation == self._generation:
                self.border_subtitle = f"cannot search: {e.message}"
            return
        if generation != self._generation:
            return
        if reply["flat"] is None:
            self._found = None
            self.border_subtitle = "no NaN or Inf in this slice"
            self.refresh()
            return
        row, col = divmod(reply["flat"], self._cols)
        self._found = (row, col)
        where = ", ".join(self._label(a, i) for a, i in enumerate(reply["at"] or []))
        again = " (from the start again)" if reply["wrapped"] else ""
        self.border_subtitle = f"f: NaN/Inf at [{where}]{again}"
        self._show_found()
        # Again once the layout is done: a grid just opened may not have its size yet, and a
        # scroll limited by it stopped short of the row (row 700 of 1,000 left off screen).
        self.call_after_refresh(self._show_found)

    def _show_found(self) -> None:
        """Bring the cell found last into view, its row in the middle when it can be."""
        if self._found is None:
            return
        row, col = self._found
        c0, c1 = self._visible_columns()
        x = self.scroll_x if c0 <= col < c1 else max(0, (col - 1) * CELL)
        y = min(max(0, row - (self.size.height - 1) // 2), self.max_scroll_y)
        self.scroll_to(x=x, y=y, animate=False, immediate=True)
        self.refresh()

    # --- drawing -----------------------------------------------------------------------------

    def _visible_columns(self) -> tuple[int, int]:
        c0 = round(self.scroll_x) // CELL
        # Whole columns only: a column cut by the edge would show part of a number (0.120 for
        # 0.12084). The edge is the scrollbar's, when there is one, and a cell is kept for the
        # "…" that says more columns follow.
        room = self.scrollable_content_region.width - self._label_width
        n = max(1, room // CELL if c0 + room // CELL >= self._cols else (room - 1) // CELL)
        return c0, min(self._cols, c0 + n)

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        base = self.rich_style
        if not self._rows:
            lines = textwrap.wrap(self.message, max(width, 20)) if self.message else []
            text = lines[y] if y < len(lines) else ""
            return Strip([Segment(text, base)]).extend_cell_length(width, base).crop(0, width)
        index = base + self.get_component_rich_style("tensor-grid--index", partial=True)
        c0, c1 = self._visible_columns()
        if y == 0:
            segments = [Segment(" " * self._label_width, index)]
            last = len(self._shape) - 1
            segments += [
                Segment(f"{self._label(last, c) if last > 0 else '':>{CELL - 1}} ", index)
                for c in range(c0, c1)
            ]  # fmt: skip (0-d: no index)
        else:
            row = round(self.scroll_y) + y - 1
            if row >= self._rows:
                return Strip.blank(width, base)
            label = self._row_label(row).rjust(self._label_width - 1) + " "
            segments = [Segment(label, index), *self._cells(row, c0, c1, base)]
        if c1 < self._cols:  # more columns to the right: say so where the next would start
            segments.append(Segment("…", index))
        return Strip(segments).extend_cell_length(width, base).crop(0, width)

    def _cells(self, row: int, c0: int, c1: int, base: Style) -> list[Segment]:
        segments: list[Segment] = []
        marked = self._found[1] if self._found is not None and self._found[0] == row else -1
        br = row // BLOCK_ROWS
        for bc in range(c0 // BLOCK_COLS, (c1 - 1) // BLOCK_COLS + 1):
            lo, hi = max(c0, bc * BLOCK_COLS), min(c1, (bc + 1) * BLOCK_COLS)
            block = self._blocks.get((br, bc))
            if block is None and (br, bc) in self._failed:  # refused: the Log tab says why
                style = base + self.get_component_rich_style("tensor-grid--inf", partial=True)
                segments.append(Segment(UNAVAILABLE * (hi - lo), style))
                continue
            if block is None:
                self._want((br, bc))
                style = base + self.get_component_rich_style(
                    "tensor-grid--placeholder", partial=True
                )
                segments.append(Segment(PLACEHOLDER * (hi - lo), style))
                continue
            text, kinds = block[row - br * BLOCK_ROWS]
            start, stop = lo - bc * BLOCK_COLS, hi - bc * BLOCK_COLS
            found = marked - bc * BLOCK_COLS  # the found cell's column in this block
            if kinds is None and not start <= found < stop:
                segments.append(Segment(text[start * CELL : stop * CELL], base))
                continue
            for c in range(start, stop):
                style = self._kind_style(kinds[c], base) if kinds is not None else base
                if c == found:
                    style += self.get_component_rich_style("tensor-grid--found", partial=True)
                segments.append(Segment(text[c * CELL : (c + 1) * CELL], style))
        return segments

    def _kind_style(self, kind: int, base: Style) -> Style:
        if kind == NAN:
            return base + self.get_component_rich_style("tensor-grid--nan", partial=True)
        if kind == INF:
            return base + self.get_component_rich_style("tensor-grid--inf", partial=True)
        return base

    # --- fetching ----------------------------------------------------------------------------

    def _want(self, key: tuple[int, int]) -> None:
        if key in self._pending or key in self._failed:
            return
        if not self._wanted:
            self.call_later(self._fetch_wanted)
        self._wanted.add(key)

    def _fetch_wanted(self) -> None:
        for key in sorted(self._wanted):
            self._pending.add(key)
            self._fetch_block(self._generation, key)
        self._wanted.clear()

    def _on_screen(self, key: tuple[int, int]) -> bool:
        top = round(self.scroll_y)
        first, last = top // BLOCK_ROWS, (top + self.size.height) // BLOCK_ROWS
        c0, c1 = self._visible_columns()
        return first <= key[0] <= last and c0 // BLOCK_COLS <= key[1] <= (c1 - 1) // BLOCK_COLS

    @work(group="grid-io")
    async def _fetch_block(self, generation: int, key: tuple[int, int]) -> None:
        if generation != self._generation:
            return
        if not self._on_screen(key):  # scrolled past before its turn came
            self._pending.discard(key)
            return
        br, bc = key
        window = [
            [br * BLOCK_ROWS, min((br + 1) * BLOCK_ROWS, self._rows)],
            [bc * BLOCK_COLS, min((bc + 1) * BLOCK_COLS, self._cols)],
        ]
        if self._column:  # the source's grid of it is one row
            window.reverse()
        try:
            reply = await remote_of(self).slice(self._ref, self._text, window)
        except RequestFailed as e:  # logged by the app; the block shows "?" rather than retrying
            if generation == self._generation:
                self._pending.discard(key)
                self._failed.add(key)
                if not self._blocks:  # no value of it at all (a tensor whose values were not
                    self.clear(f"No values to show: {e.message}")  # kept): say why, not "?"s
                self.refresh()
            return
        if generation == self._generation:
            self._decode_block(generation, key, reply["data"])

    @work(thread=True, group="grid-decode")
    def _decode_block(self, generation: int, key: tuple[int, int], data: WireArray) -> None:
        values = data.to_numpy()
        if data.dtype == "bfloat16" or data.dtype.startswith("float8"):
            values = values.astype(np.float32)  # exact; numpy prints and tests only its own floats
        values = values.reshape(values.shape[0] if values.ndim else 1, -1)
        if self._column:
            values = values.reshape(-1, 1)
        self.post_message(self.BlockReady(generation, key, format_block(values)))

    @on(BlockReady)
    def _block_ready(self, message: BlockReady) -> None:
        message.stop()
        if message.generation != self._generation:
            return
        self._pending.discard(message.key)
        self._blocks[message.key] = message.rows
        while len(self._blocks) > MAX_BLOCKS:
            self._blocks.popitem(last=False)
        self.refresh()

    @property
    def fetching(self) -> bool:
        """Whether blocks on screen are still on their way."""
        return bool(self._pending or self._wanted)

    def cell_text(self, row: int, col: int) -> str | None:
        """The text shown for one value, None while its block is on its way (for tests)."""
        block = self._blocks.get((row // BLOCK_ROWS, col // BLOCK_COLS))
        if block is None:
            return None
        text, _ = block[row % BLOCK_ROWS]
        c = col % BLOCK_COLS
        return text[c * CELL : (c + 1) * CELL].strip()
