"""The Hits tab: every hit in execution order, origin hits first within their step; Enter opens
the hit's tensor in the Tensor tab, ``/`` filters the hits. Two rules that say the same of the
same tensor at the same step (a NaN gradient fires NaN and ExplodingGradient with one sentence)
share a row that names both.

A Line-API widget, as the model tree is: it draws only the rows on screen, so a long run's tens
of thousands of hits cost the UI what its visible rows cost (Textual's DataTable laid out every
row: 30,000 hits kept a core busy).
"""

from __future__ import annotations

import bisect
from typing import Any, ClassVar

from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.binding import Binding, BindingType
from textual.geometry import Region, Size
from textual.message import Message
from textual.strip import Strip

from tensordbg.tui.components.line_table import GAP, MOVES, LineTable
from tensordbg.tui.components.typed_ahead import keys_in_order, search
from tensordbg.tui.messages import OpenTensor

COLUMNS = ("step", "phase", "rule", "tensor", "where", "message")
WHERE = {True: "● origin", False: "↳ passed on"}
# Where the row does not fit, the rule column gives up cells first (a row two rules share names
# both: "ExplodingGradient, NaN"), then the tensor's, down to these widths, so that "where"
# stays whole: it tells the origin from what it passed on. The message is in the detail below;
# the rule column gives up cells to leave it MESSAGE_ROOM of them too (at 80 columns a replay's
# shared rows left it "m…"), the tensor's only where the row does not fit.
NARROWEST = {COLUMNS.index("rule"): (8, 20), COLUMNS.index("tensor"): (16, 0)}
"""A column's narrowest width, and the message's room it gives up cells for."""


def execution_order(hit: dict[str, Any]) -> tuple[int, bool, int]:
    """Execution order, and within a step the origin first: that is where to look."""
    return (hit["step"], not hit["origin"], hit["id"])


def same_fact(hit: dict[str, Any]) -> tuple[Any, ...]:
    """What two hits share when they are one fact found by two rules."""
    return (hit["step"], hit.get("rank"), hit["phase"], hit["tensor"], bool(hit["origin"]),
            hit["message"])  # fmt: skip


def _cells(hit: dict[str, Any], rules: list[str]) -> tuple[str, ...]:
    return (
        str(hit["step"]),
        hit["phase"],
        ", ".join(rules),
        hit["tensor"],
        WHERE[bool(hit["origin"])],
        hit["message"],
    )


class HitTable(LineTable):
    """One row per hit, in :func:`execution_order`; :meth:`set_filter` narrows the rows."""

    BINDINGS: ClassVar[list[BindingType]] = [*MOVES, Binding("enter", "select", "Open", show=False)]
    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "hit-table--header",
        "hit-table--cursor",
        "hit-table--origin",
        "hit-table--dim",
    }

    class Highlighted(Message):
        """The cursor is on ``hit`` (None when there are no hits), which ``rules`` found."""

        def __init__(self, hit: dict[str, Any] | None, rules: list[str]) -> None:
            super().__init__()
            self.hit = hit
            self.rules = rules

    def __init__(self) -> None:
        super().__init__(id="hit-table")
        self._drawable = False  # set on mount; is_mounted is still False in on_mount
        self._hits: dict[int, dict[str, Any]] = {}
        self._order: list[tuple[int, bool, int]] = []  # execution_order of every hit, sorted
        self._shown: list[tuple[int, bool, int]] | None = None  # the filtered rows, or all
        self._facts: dict[tuple[Any, ...], int] = {}  # same_fact -> the id of its row's hit
        self._also: dict[int, list[str]] = {}  # a row's hit id -> the other rules that found it
        self._row_of: dict[int, int] = {}  # a hit that shares a row -> the id of the row's hit
        self._query = ""
        self._widths = [len(c) for c in COLUMNS]
        self._fitted = self._widths  # the widths drawn this frame (fitted to the screen)
        self._palette: dict[object, Any] = {}
        self._highlighted: int | None = None  # the hit id last announced

    def on_mount(self) -> None:
        self._drawable = True
        self._changed(keep=None)

    # --- data --------------------------------------------------------------------------------

    @property
    def next_id(self) -> int:
        """The id to ask ``hits(since=...)`` for, to learn only new hits."""
        return max(self._hits, default=-1) + 1

    @property
    def known(self) -> int:
        """How many hits the table holds, filtered out or not."""
        return len(self._hits)

    @property
    def rows_unfiltered(self) -> int:
        """How many rows the hits make, filter aside (two rules that say the same of one
        tensor share a row)."""
        return len(self._order)

    @property
    def rows(self) -> list[tuple[int, bool, int]]:
        return self._order if self._shown is None else self._shown

    @property
    def row_count(self) -> int:
        return len(self.rows)

    @property
    def ids(self) -> list[int]:
        """The ids of the hits shown, top to bottom."""
        return [key[2] for key in self.rows]

    @property
    def current(self) -> dict[str, Any] | None:
        rows = self.rows
        return self._hits[rows[self.cursor][2]] if 0 <= self.cursor < len(rows) else None

    def rules_of(self, hit: dict[str, Any]) -> list[str]:
        """The rules that found what ``hit`` says (its row's)."""
        return [hit["rule"], *self._also.get(hit["id"], ())]

    def set_hits(self, hits: list[dict[str, Any]]) -> None:
        """All the hits, at once (a welcome, a reload)."""
        keep = self.current
        self._hits = {}
        self._order = []
        self._facts, self._also, self._row_of = {}, {}, {}
        self._widths = [len(c) for c in COLUMNS]
        self._insert(hits)
        self._refilter()
        self._changed(keep=keep["id"] if keep else None)

    def merge(self, hits: list[dict[str, Any]]) -> None:
        """Add hits (pushed one by one, maybe thousands): each costs a sorted insert, and the
        screen is drawn once a frame, only its visible rows. The cursor stays on its hit."""
        if not hits:
            return
        keep = self.current
        self._insert(hits)
        self._changed(keep=keep["id"] if keep else None)

    def select_hit(self, hit_id: int) -> None:
        """Put the cursor on hit ``hit_id`` (clearing a filter that hides it)."""
        hit = self._hits.get(self._row_of.get(hit_id, hit_id))
        if hit is None:
            return
        if self._shown is not None and not self._matches(hit):
            self.set_filter("")
        self._go(bisect.bisect_left(self.rows, execution_order(hit)), force=True)

    def set_filter(self, query: str) -> None:
        """Show only the hits whose step, rule, tensor, module or message contain ``query``."""
        keep = self.current
        self._query = query.strip().lower()
        self._refilter()
        self._changed(keep=keep["id"] if keep else None)

    def _insert(self, hits: list[dict[str, Any]]) -> None:
        for hit in hits:
            if self._shares_row(hit):
                continue
            key = execution_order(hit)
            old = self._hits.get(hit["id"])
            if old is not None:  # a hit sent again (a reconnection): replaced in place
                del self._order[bisect.bisect_left(self._order, execution_order(old))]
                if self._shown is not None and self._matches(old):
                    del self._shown[bisect.bisect_left(self._shown, execution_order(old))]
            self._hits[hit["id"]] = hit
            if not self._order or key > self._order[-1]:
                self._order.append(key)  # the usual case: after the last row
            else:
                bisect.insort(self._order, key)
            if self._shown is not None and self._matches(hit):
                bisect.insort(self._shown, key)
            self._facts[same_fact(hit)] = hit["id"]  # the latest row saying it
            self._widen(hit)

    def _shares_row(self, hit: dict[str, Any]) -> bool:
        """Whether another rule's earlier hit says what ``hit`` says: then its row names both."""
        if hit["id"] in self._row_of:
            return True  # sent again (a reconnection)
        row = self._facts.get(same_fact(hit))
        if row is None or row == hit["id"] or hit["rule"] in self.rules_of(self._hits[row]):
            return False  # a rule that says it again (a second backward pass) has a row of its own
        self._hits[hit["id"]] = hit  # counted in known, not a row
        self._row_of[hit["id"]] = row
        self._also.setdefault(row, []).append(hit["rule"])
        self._widen(self._hits[row])
        return True

    def _widen(self, hit: dict[str, Any]) -> None:
        for i, cell in enumerate(_cells(hit, self.rules_of(hit))[:-1]):
            if len(cell) > self._widths[i]:
                self._widths[i] = min(len(cell), 60)

    def _matches(self, hit: dict[str, Any]) -> bool:
        q = self._query
        return (
            q in WHERE[bool(hit["origin"])].lower()  # the column says "origin"
            or any(q in rule.lower() for rule in self.rules_of(hit))
            or any(
                q in str(hit.get(field, "")).lower()
                for field in ("step", "tensor", "module", "message", "phase")
            )
        )

    @property
    def filtered_out(self) -> str:
        """The filter, when it hides every hit there is ("" otherwise)."""
        return self._query if self._hits and self._shown == [] else ""

    def _refilter(self) -> None:
        if not self._query:
            self._shown = None
        else:
            self._shown = [k for k in self._order if self._matches(self._hits[k[2]])]

    def _changed(self, keep: int | None) -> None:
        """The rows changed: the cursor goes back to the hit it was on, the screen is drawn."""
        if (
            keep is not None
            and keep in self._hits
            and (self._shown is None or self._matches(self._hits[keep]))
        ):
            self.cursor = bisect.bisect_left(self.rows, execution_order(self._hits[keep]))
        self.cursor = max(0, min(self.cursor, len(self.rows) - 1))
        if not self._drawable:  # hits can arrive before the tab is mounted
            return
        width = sum(self._widths) + GAP * len(self._widths) + 40
        self.virtual_size = Size(width, len(self.rows) + 1)
        self.scroll_to_cursor()
        self.refresh()
        self._announce()

    def on_key(self, event: events.Key) -> None:
        keys_in_order(self, event, {"slash": search(self)})  # "/word" typed fast: all in the box

    def on_resize(self, event: events.Resize) -> None:
        # The detail below grows with the hit the cursor moved to (a long message), after the
        # move scrolled its row into view: the list, shorter now, hid the row it had shown.
        if self._drawable:
            self.scroll_to_cursor()

    # --- keys --------------------------------------------------------------------------------

    def action_select(self) -> None:
        hit = self.current
        if hit is not None:
            self.post_message(
                OpenTensor(
                    hit["ref"], hit["tensor"], module=hit.get("module"), call=hit.get("call", 0)
                )
            )

    def _moved(self, before: int) -> None:
        if self._drawable:
            self.scroll_to_cursor()
            self.refresh()
            self._announce()

    def _announce(self) -> None:
        hit = self.current
        hit_id = None if hit is None else hit["id"]
        if hit_id != self._highlighted or hit is None:
            self._highlighted = hit_id
            self.post_message(self.Highlighted(hit, [] if hit is None else self.rules_of(hit)))

    # --- drawing -----------------------------------------------------------------------------

    def render_lines(self, crop: Region) -> list[Strip]:
        # The styles, once a frame rather than once a line (looking them up is the costly part).
        base = self.rich_style
        cursor = base + self.get_component_rich_style("hit-table--cursor")
        rows = ("hit-table--dim", "hit-table--origin")
        self._palette = {
            False: self.styled(base, *rows),
            True: self.styled(cursor, *rows),
            "header": base + self.get_component_rich_style("hit-table--header"),
        }
        self._fitted = self._fit_widths(self.scrollable_content_region.width)
        return super().render_lines(crop)

    def _fit_widths(self, width: int) -> list[int]:
        """The columns' widths on a screen ``width`` cells wide (see NARROWEST); the message
        takes what is left."""
        widths = list(self._widths)
        over = sum(widths[:-1]) + GAP * (len(widths) - 1) - width  # the cells the row lacks
        for column, (narrowest, room) in NARROWEST.items():
            cut = max(0, min(over + room, widths[column] - narrowest))
            widths[column] -= cut
            over -= cut
        return widths

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        if y == 0:
            style = self._palette["header"]
            strip = self._strip(COLUMNS, [style] * len(COLUMNS), style)
        else:
            n = round(self.scroll_y) + y - 1
            rows = self.rows
            if n >= len(rows):
                return Strip.blank(width, self.rich_style)
            hit = self._hits[rows[n][2]]
            base, dim, origin = self._palette[n == self.cursor]
            where = origin if hit["origin"] else dim
            styles = [base, dim, base + Style(bold=True), base, where, base]
            strip = self._strip(_cells(hit, self.rules_of(hit)), styles, base)
        return self.fit(strip)

    def _strip(self, cells: tuple[str, ...], styles: list[Style], base: Style) -> Strip:
        # The message takes the rest of the line (HitDetail has it all).
        row = self.cells(cells[:-1], self._fitted, styles[:-1], base)
        return Strip([*row, Segment(cells[-1], styles[-1])])
