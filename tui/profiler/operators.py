"""The Operators tab: each operator's calls and its self and total time on the CPU and the
device, sortable by any column (``o``, ``O``, a click on a heading), grouped by operator or by
operator and input shape (``g``, when the report has shapes), searched with ``/``.

Shapes are recorded only when the profile was asked for with them (``record_shapes=True``: the
P dialog's "Record input shapes", or from Python)."""

from __future__ import annotations

from typing import Any, ClassVar

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.widgets import Input, Static

from tensordbg.tui.profiler.row_table import Column, RowTable
from tensordbg.tui.profiler.units import number, seconds

NO_SHAPES = (
    "This profile has no input shapes to group by: they are recorded when the profile is asked "
    'for with P and "Record input shapes" ticked, or from Python, session.profile(steps=5, '
    "record_shapes=True)."
)
SUMMED = ("calls", "self_cpu", "total_cpu", "self_device", "total_device", "flops")
COLUMNS = [
    Column("name", "operator", str, numeric=False),
    Column("calls", "calls", number),
    Column("self_cpu", "self CPU", seconds),
    Column("total_cpu", "total CPU", seconds),
    Column("self_device", "self device", seconds),
    Column("total_device", "total device", seconds),
    Column("flops", "FLOPs", number),
    Column("input_shapes", "input shapes", lambda s: s or "", numeric=False),
]


def by_operator(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row an operator: the rows of its input shapes summed (an unknown count stays unknown
    only when it is unknown for every shape)."""
    merged: dict[str, dict[str, Any]] = {}
    for row in rows:
        into = merged.get(row["name"])
        if into is None:
            merged[row["name"]] = {**row, "input_shapes": None}
            continue
        for key in SUMMED:
            a, b = into.get(key), row.get(key)
            into[key] = b if a is None else a if b is None else a + b
    return list(merged.values())


class OperatorsPane(Vertical):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("slash", "search", "Search"),
        Binding("g", "group", "Group by shape"),
        # Not offered where there are no shapes, but pressed anyway it says how to get them.
        Binding("g", "no_shapes", "Group by shape", show=False),
        Binding("escape", "end_search", "End search", show=False),
    ]

    def __init__(self) -> None:
        super().__init__(id="profile-operators")
        self.search = Input(placeholder="operator name contains…", id="operator-search")
        self.table = RowTable(COLUMNS, sort="self_cpu", id="operator-table")
        self.status = Static(id="operator-status")
        # One row: what does not fit ends in "…" rather than being cut mid-word.
        self.status.styles.text_wrap = "nowrap"
        self.status.styles.text_overflow = "ellipsis"
        self.rows: list[dict[str, Any]] = []
        self.by_shape = False

    def compose(self) -> ComposeResult:
        yield self.search
        yield self.table
        yield self.status

    def on_mount(self) -> None:
        self.search.display = False

    @property
    def has_shapes(self) -> bool:
        return any(r.get("input_shapes") for r in self.rows)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "group":
            return self.has_shapes
        if action == "no_shapes":
            return not self.has_shapes
        return True

    def show(self, report: dict[str, Any]) -> None:
        self.rows = report.get("operators") or []
        # A device column only where there is a device.
        on_device = any(r.get("self_device") or r.get("total_device") for r in self.rows)
        hidden = set() if on_device else {"self_device", "total_device"}
        if not self.has_shapes:
            hidden.add("input_shapes")
            self.by_shape = False
        if not any(r.get("flops") for r in self.rows):
            hidden.add("flops")
        self.table.columns = [c for c in COLUMNS if c.key not in hidden]
        if self.table.sort_key in hidden:
            self.table.sort_key = "self_cpu"
        self._fill()
        self.refresh_bindings()

    def _fill(self) -> None:
        self.table.set_rows(self.rows if self.by_shape else by_operator(self.rows))
        self._status()

    def _status(self) -> None:
        text = Text()
        n, total = self.table.row_count, len(self.rows if self.by_shape else by_operator(self.rows))
        text.append(f"{n:,} of {total:,} operators" if n != total else f"{n:,} operators")
        text.append(f" · sorted by {self.table.sort_title}")
        if self.has_shapes:
            how = "operator and input shape" if self.by_shape else "operator"
            text.append(f" · grouped by {how} (g)")
        text.append(" · o: next column, O: reverse, /: search", style="dim")
        self.status.update(text)

    @on(RowTable.Sorted)
    def _sorted(self) -> None:
        self._status()

    def action_search(self) -> None:
        self.search.display = True
        self.search.focus()

    def action_end_search(self) -> None:
        if self.search.display:
            self.search.value = ""
            self.search.display = False
            self.table.focus()

    def action_group(self) -> None:
        self.by_shape = not self.by_shape
        self._fill()

    def action_no_shapes(self) -> None:
        self.notify(NO_SHAPES, severity="warning")

    @on(Input.Changed, "#operator-search")
    def _search_changed(self, event: Input.Changed) -> None:
        self.table.set_filter(event.value)
        self._status()

    @on(Input.Submitted, "#operator-search")
    def _search_done(self) -> None:
        self.table.focus()
