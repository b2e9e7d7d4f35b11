"""The Timeline tab: the profiled steps' spans, one lane per thread or stream, drawn in cells.

Nested spans (an operator inside a module's forward) go one row down, up to :data:`MAX_DEPTH`
rows a lane; a span too narrow for its name, even one narrower than a cell, is a bar in its
colour (a trace viewer draws at least a pixel). The view is a window of time: ``+``/``-`` zoom
around the cursor (the middle column), ``left``/``right`` (or ``h``/``l``) pan, ``home``/``end``
go to either end, ``up``/``down`` pick the row whose span under the cursor the status line
names. Only what is on screen is drawn: a row finds its spans in the window by bisection, so
20,000 spans stay quick.
"""

from __future__ import annotations

import bisect
import math
import zlib
from typing import Any, ClassVar, NamedTuple

from rich.segment import Segment
from rich.style import Style
from textual.binding import Binding, BindingType
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip

from tensordbg.tui.profiler.units import seconds

MAX_DEPTH = 4  # rows a lane may take; deeper spans are counted, not drawn
LABEL = 24  # columns of the lane names
NAMED = 4  # columns a span needs to show its name; a narrower one is a bar
TICK = 16  # columns between the ruler's labels, about
PAN = 0.25  # of the window, a key press
COLOURS = (
    "#3b6ea5", "#8a5a9e", "#3f8f6b", "#a8743a", "#9e4a5a", "#4f8a9a", "#7a7a3a", "#5a5aa8",
)  # fmt: skip


class Row(NamedTuple):
    """The spans of one lane at one depth, by start time; they do not overlap."""

    lane: str
    depth: int
    starts: list[float]
    ends: list[float]
    names: list[str]


def rows_of(timeline: dict[str, Any]) -> tuple[list[Row], int]:
    """The rows to draw, and how many spans were too deep to draw."""
    rows: list[Row] = []
    hidden = 0
    for lane in timeline.get("lanes", []):
        spans = sorted(lane.get("spans", []), key=lambda s: (s[0], -s[1]))
        levels: list[tuple[list[float], list[float], list[str]]] = []
        open_ends: list[float] = []  # the ends of the spans that hold the current one
        for start, duration, name in spans:
            end = start + max(duration, 0.0)
            # Every span that ended by now: a range that crossed another's end (the trace's
            # ranges need not nest) must not keep the ones after it deeper for ever.
            open_ends = [e for e in open_ends if e > start]
            depth = len(open_ends)
            open_ends.append(end)
            if depth >= MAX_DEPTH:
                hidden += 1
                continue
            while len(levels) <= depth:
                levels.append(([], [], []))
            starts, ends, names = levels[depth]
            starts.append(start)
            ends.append(end)
            names.append(str(name))
        for depth, (starts, ends, names) in enumerate(levels or [([], [], [])]):
            rows.append(Row(str(lane.get("name", "?")), depth, starts, ends, names))
    return rows, hidden


def fit(text: str, width: int) -> str:
    """``text`` in ``width`` cells with the last one blank (neighbours stay apart), cut with
    ``…`` when it does not fit."""
    if len(text) > width - 1:
        text = text[: max(width - 2, 0)] + "…"
    return text.ljust(width)[:width]


def colour(name: str) -> str:
    return COLOURS[zlib.crc32(name.encode()) % len(COLOURS)]


class TimelineView(ScrollView, can_focus=True):
    """Lanes of spans in a window of time; the status line (:class:`Pointed`) names the span
    under the cursor."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("plus,equals_sign", "zoom(0.5)", "Zoom in"),
        Binding("minus", "zoom(2)", "Zoom out"),
        Binding("left,h", "pan(-1)", "Pan", show=False),
        Binding("right,l", "pan(1)", "Pan", show=False),
        Binding("home", "to_end(0)", "Start", show=False),
        Binding("end", "to_end(1)", "End", show=False),
        Binding("up", "row(-1)", "Row up", show=False),
        Binding("down", "row(1)", "Row down", show=False),
    ]
    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "timeline--axis",
        "timeline--lane",
        "timeline--cursor",
        "timeline--selected",
    }

    class Pointed(Message):
        """What is under the cursor, for the status line."""

        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    def __init__(self) -> None:
        super().__init__(id="timeline")
        self.rows: list[Row] = []
        self.hidden = 0
        self.start = 0.0
        self.end = 1.0
        self.t0 = 0.0  # the window on screen
        self.t1 = 1.0
        self.selected = 0
        self._styles: dict[str, Style] = {}
        self._cache: dict[int, Strip] = {}  # rows drawn for the current window and width

    def show(self, timeline: dict[str, Any]) -> None:
        self.rows, self.hidden = rows_of(timeline)
        ends = [r.ends[-1] for r in self.rows if r.ends]
        self.start = float(timeline.get("start", 0.0))
        self.end = max([float(timeline.get("end", 0.0)), *ends]) or self.start + 1e-3
        self.t0, self.t1 = self.start, self.end
        self.selected = 0
        self.virtual_size = Size(0, len(self.rows) + 1)
        self._changed()

    # --- geometry ----------------------------------------------------------------------------

    @property
    def columns(self) -> int:
        return max(self.size.width - LABEL, 1)

    @property
    def cursor_column(self) -> int:
        return self.columns // 2

    def _column_span(self, x: int) -> tuple[float, float]:
        dt = (self.t1 - self.t0) / self.columns
        return self.t0 + x * dt, self.t0 + (x + 1) * dt

    def span_at(self, row: int, x: int) -> tuple[str, float, float] | None:
        """The span of ``row`` drawn in column ``x``: ``(name, start, end)``; the longest when
        several share the column."""
        if not 0 <= row < len(self.rows):
            return None
        r = self.rows[row]
        c0, c1 = self._column_span(x)
        i = max(bisect.bisect_right(r.starts, c0) - 1, 0)
        best = None
        while i < len(r.starts) and r.starts[i] < c1:
            if r.ends[i] > c0 and (best is None or r.ends[i] - r.starts[i] > best[2] - best[1]):
                best = (r.names[i], r.starts[i], r.ends[i])
            i += 1
        return best

    # --- keys --------------------------------------------------------------------------------

    def action_zoom(self, factor: float) -> None:
        centre = (self.t0 + self.t1) / 2
        full = self.end - self.start
        width = min(max((self.t1 - self.t0) * factor, 1e-9 * self.columns), full)
        self._move_to(centre - width / 2, width)

    def action_pan(self, direction: int) -> None:
        width = self.t1 - self.t0
        self._move_to(self.t0 + direction * PAN * width, width)

    def action_to_end(self, which: int) -> None:
        width = self.t1 - self.t0
        self._move_to(self.start if which == 0 else self.end - width, width)

    def action_row(self, delta: int) -> None:
        if not self.rows:
            return
        self.selected = max(0, min(self.selected + delta, len(self.rows) - 1))
        top, visible = round(self.scroll_y), max(self.size.height - 1, 1)
        if self.selected < top:
            self.scroll_to(y=self.selected, animate=False, immediate=True)
        elif self.selected >= top + visible:
            self.scroll_to(y=self.selected - visible + 1, animate=False, immediate=True)
        self._changed()

    def _move_to(self, t0: float, width: float) -> None:
        t0 = max(self.start, min(t0, self.end - width))
        self.t0, self.t1 = t0, t0 + width
        self._changed()

    def _changed(self) -> None:
        self._cache.clear()
        self.refresh()
        self.post_message(self.Pointed(self.pointed()))

    def on_resize(self) -> None:
        self._changed()

    def pointed(self) -> str:
        """The status line: the window, and the selected row's span under the cursor."""
        if not self.rows:
            return "No spans in this profile."
        zoom = (self.end - self.start) / max(self.t1 - self.t0, 1e-12)
        window = f"{seconds(self.t0 - self.start)} – {seconds(self.t1 - self.start)} (×{zoom:.3g})"
        row = self.rows[self.selected]
        where = f"{row.lane}" + (f", depth {row.depth}" if row.depth else "")
        span = self.span_at(self.selected, self.cursor_column)
        if span is None:
            return f"{where}: nothing under the cursor · {window}"
        name, start, end = span
        return (
            f"{where}: {name}  {seconds(end - start)} at {seconds(start - self.start)} · {window}"
        )

    # --- drawing -----------------------------------------------------------------------------

    def render_line(self, y: int) -> Strip:
        if not self._styles:
            self._styles = {
                "base": self.rich_style,
                "axis": self.rich_style + self.get_component_rich_style("timeline--axis"),
                "lane": self.rich_style + self.get_component_rich_style("timeline--lane"),
                "cursor": self.rich_style + self.get_component_rich_style("timeline--cursor"),
                "selected": self.rich_style + self.get_component_rich_style("timeline--selected"),
            }
        width = self.size.width
        if y == 0:
            return self._axis().crop(0, width).extend_cell_length(width)
        n = round(self.scroll_y) + y - 1
        if n >= len(self.rows):
            return Strip.blank(width, self.rich_style)
        if n not in self._cache:
            self._cache[n] = self._row(n)
        return self._cache[n].crop(0, width).extend_cell_length(width)

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._styles = {}
        self._cache.clear()

    def _axis(self) -> Strip:
        """Labels about every :data:`TICK` columns, and the window's end at the right edge: the
        ruler spans what is on screen. A label that would touch another is left out."""
        style = self._styles["axis"]
        columns = self.columns
        cells = [" "] * columns
        taken = [False] * columns
        parts = max(columns // TICK, 1)
        step = (self.t1 - self.t0) / parts
        end = f"{seconds(self.t1 - self.start, step)}|"
        ticks = [(columns - len(end), end)]  # first: it is kept whatever else fits
        for k in range(parts):
            x = k * columns // parts
            ticks.append((x, f"|{seconds(self._column_span(x)[0] - self.start, step)}"))
        for x, label in ticks:
            if x < 0 or any(taken[max(x - 1, 0) : x + len(label) + 1]):
                continue
            for i, ch in enumerate(label):
                cells[x + i], taken[x + i] = ch, True
        return Strip([Segment("time".ljust(LABEL), style), Segment("".join(cells), style)])

    def _row(self, n: int) -> Strip:
        row = self.rows[n]
        columns, cursor = self.columns, self.cursor_column
        lane_style = self._styles["selected" if n == self.selected else "lane"]
        label = row.lane if row.depth == 0 else f"{'  ' * row.depth}depth {row.depth}"
        label = fit(label, LABEL)
        owner: list[int] = [-1] * columns  # the span drawn in each column
        dt = (self.t1 - self.t0) / columns
        i = max(bisect.bisect_right(row.starts, self.t0) - 1, 0)
        stop = bisect.bisect_left(row.starts, self.t1)
        while i < stop:
            s, e = row.starts[i], row.ends[i]
            if e > self.t0:
                x0 = max(int((s - self.t0) / dt), 0)
                x1 = min(max(math.ceil((e - self.t0) / dt), x0 + 1), columns)
                for x in range(x0, x1):  # columns shared by spans show the longest
                    j = owner[x]
                    if j < 0 or e - s > row.ends[j] - row.starts[j]:
                        owner[x] = i
            i += 1
        segments = [Segment(label, lane_style)]
        base = self._styles["base"]
        x = 0
        while x < columns:
            i = owner[x]
            run = x
            while run < columns and owner[run] == i:
                run += 1
            if i < 0:
                text = " " * (run - x)
                segments.extend(self._with_cursor(text, x, cursor, base))
            elif run - x >= NAMED:
                text = fit(row.names[i].removeprefix("aten::"), run - x)
                style = base + Style(bgcolor=colour(row.names[i]), color="white")
                segments.extend(self._with_cursor(text, x, cursor, style))
            else:
                # Too narrow for a name, or narrower than a cell: a bar in its colour, still
                # seen (as a trace viewer draws a span of less than a pixel), its last cell
                # half a cell so that the next span is told apart.
                text = "█" * (run - x - 1) + "▌"
                style = base + Style(color=colour(row.names[i]))
                segments.extend(self._with_cursor(text, x, cursor, style))
            x = run
        return Strip(segments)

    def _with_cursor(self, text: str, x: int, cursor: int, style: Style) -> list[Segment]:
        """``text`` from column ``x``, with the cursor's column marked."""
        if not x <= cursor < x + len(text):
            return [Segment(text, style)]
        k = cursor - x
        mark = style + self._styles["cursor"]
        return [
            Segment(text[:k], style),
            Segment(text[k] if text[k] != " " else "│", mark),
            Segment(text[k + 1 :], style),
        ]
