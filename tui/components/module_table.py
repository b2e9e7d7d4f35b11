"""The model tree: every module with its type, parameters, hits and latest output statistics.

A Line-API widget: it draws only the rows on screen, so moving the cursor or filtering stays
quick with thousands of modules (the built-in DataTable takes 0.6 s to refill 2,000 rows).
"""

from __future__ import annotations

from typing import Any, ClassVar

from rich.style import Style
from textual import events
from textual.binding import Binding, BindingType
from textual.geometry import Region, Size
from textual.message import Message
from textual.strip import Strip

from tensordbg.statistics import describe
from tensordbg.tui.components.line_table import GAP, MOVES, LineTable
from tensordbg.tui.components.typed_ahead import keys_in_order, search

STALE = "step "  # statistics from an earlier step start "step 24: ..." and are drawn dim


def brief(summary: dict[str, Any] | None) -> str:
    """What is known of a tensor's latest statistics, in one short line, what is not finite
    first: ``NaN×2! n=256 x∈[-2.1, 2.6] μ=0.01 σ=1`` (shape and dtype are left to the caller).
    The line is cut at the right edge of a narrow terminal: a flag at its end ("NaN×1984!")
    was cut off at 80 columns, and a broken module read as clean."""
    if not summary:
        return ""
    words = describe(summary).split(" ")
    flags = [w for w in words if w.endswith("!")]  # NaN×2! +Inf×1! -Inf×3! NaN/Inf!
    return " ".join([*flags, *(w for w in words if not w.endswith("!"))])


def count(n: int) -> str:
    """``708``, ``12.3K``, ``7.1M``, ``1.2B``."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


class ModuleTable(LineTable):
    """Modules in ``named_modules()`` order, indented by depth; filtered by :meth:`set_filter`."""

    BINDINGS: ClassVar[list[BindingType]] = [*MOVES, Binding("enter", "select", "Tensors")]
    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "module-table--header",
        "module-table--cursor",
        "module-table--hit",
        "module-table--dim",
    }

    class Highlighted(Message):
        """The cursor is on ``module`` (None when nothing matches the filter)."""

        def __init__(self, module: dict[str, Any] | None) -> None:
            super().__init__()
            self.module = module

    class Selected(Message):
        """Enter on ``module``."""

        def __init__(self, module: dict[str, Any]) -> None:
            super().__init__()
            self.module = module

    def __init__(self) -> None:
        super().__init__(id="module-table")
        self._drawable = False  # set on mount; is_mounted is still False in on_mount
        self._modules: list[dict[str, Any]] = []
        self._keys: list[str] = []  # lower-case "path type", what the filter searches
        self._cells: list[tuple[str, ...]] = []  # type, params, hits, statistics
        self._tree_names: list[str] = []  # indented by depth
        self._paths: list[str] = []  # full paths, shown while filtering
        self._rows: list[int] = []  # indices into _modules, after the filter
        self._query = ""
        self._widths: list[int] = []
        self._kinds: list[str] = []
        self._step: int | None = None
        self._redraw_due = False
        self._palette: dict[object, Any] = {}

    # --- data --------------------------------------------------------------------------------

    def set_modules(self, modules: list[dict[str, Any]], step: int | None = None) -> None:
        """The model tree; ``step`` is the training's step now: statistics from an earlier
        one (a module that has not run yet this step) are marked with their step."""
        current = self.current
        self._step = step
        self._modules = modules
        self._keys = [f"{m['path']} {m['type']}".lower() for m in modules]
        kinds = {k for m in modules for k in (m.get("stats") or {})}
        self._kinds = [k for k in ("output", "grad_output") if k in kinds] or ["output"]
        self._cells = [self._cells_of(m) for m in modules]
        self._tree_names = [
            "  " * max(m["depth"] - 1, 0) + (m["path"].rsplit(".", 1)[-1] or "(model)")
            for m in modules
        ]
        self._paths = [m["path"] or "(model)" for m in modules]
        self._apply_filter(keep=current["path"] if current else None)

    def step_moved(self, step: int | None) -> None:
        """The training moved on to ``step``: the statistics it moved past are marked with
        their step (once: a statistic stays of its step)."""
        if step is None or self._step is None or step <= self._step:
            return
        before, self._step = self._step, step
        newest = max((s.get("step", -1) for m in self._modules
                      for s in (m.get("stats") or {}).values() if s), default=-1)  # fmt: skip
        if before <= newest < step:  # some were current, and are not any more
            self._recount()

    def hits_heard(self, by_module: dict[str, int]) -> None:
        """The hits received so far, by module: a module's count is the larger of this and
        what the training said when the tree was read."""
        changed = False
        for m in self._modules:
            heard = by_module.get(m["path"], 0)
            if heard > m.get("hits", 0):
                m["hits"] = heard
                changed = True
        if not changed:
            return
        if not self._drawable:  # not mounted yet: nothing is drawn before it is
            self._recount()
        elif not self._redraw_due:
            self._redraw_due = True
            self.set_timer(0.5, self._recount)

    def _recount(self) -> None:
        self._redraw_due = False
        self._cells = [self._cells_of(m) for m in self._modules]
        current = self.current
        self._apply_filter(keep=current["path"] if current else None)

    def set_filter(self, query: str) -> None:
        """Show only the modules whose path or type contains ``query``; the cursor jumps to the
        first of them."""
        self._query = query.strip().lower()
        self._apply_filter(keep=None)

    @property
    def current(self) -> dict[str, Any] | None:
        if 0 <= self.cursor < len(self._rows):
            return self._modules[self._rows[self.cursor]]
        return None

    @property
    def row_count(self) -> int:
        return len(self._rows)

    def _cells_of(self, m: dict[str, Any]) -> tuple[str, ...]:
        hits = f"● {m['hits']}" if m.get("hits") else ""
        stats = m.get("stats") or {}
        # A module without an output statistic says why (a container, not called), if known.
        return (
            m["type"],
            count(m.get("params", 0)),
            hits,
            *(self._brief(stats.get(k), k) or (m.get("note", "") if k == "output" else "")
              for k in self._kinds),
        )  # fmt: skip

    def _brief(self, summary: dict[str, Any] | None, kind: str = "output") -> str:
        text = brief(summary)
        part = _part(str((summary or {}).get("tensor", "")), kind)
        if text and part:  # which of several outputs: the two columns may show different ones
            text = f"{part} {text}"
        call = (summary or {}).get("call")
        if text and call:  # which call of the step: paused in a later micro-batch's forward,
            text = f"#{call}: {text}"  # a module it has not reached shows an earlier call's
        step = (summary or {}).get("step")
        if text and step is not None and self._step is not None and step < self._step:
            text = f"{STALE}{step}: {text}"
        return text

    def _row(self, i: int) -> tuple[str, ...]:
        name = self._paths[i] if self._query else self._tree_names[i]
        return (name, *self._cells[i])

    def _apply_filter(self, keep: str | None) -> None:
        q = self._query
        self._rows = (
            [i for i, key in enumerate(self._keys) if q in key]
            if q
            else list(range(len(self._modules)))
        )
        names = self._paths if q else self._tree_names
        sample = self._rows[:5000]  # widths from the first rows: enough, and bounded
        self._widths = [min(max([6] + [len(names[i]) for i in sample]), 60)] + [
            max([len(h)] + [len(self._cells[i][c]) for i in sample])
            for c, h in enumerate(self._headers()[1:])
        ]
        self.cursor = 0
        if keep is not None:
            for n, i in enumerate(self._rows):
                if self._modules[i]["path"] == keep:
                    self.cursor = n
                    break
        self._show_rows()

    def on_mount(self) -> None:
        self._drawable = True
        self._show_rows()

    def _show_rows(self) -> None:
        if not self._drawable:  # modules can arrive before the tab is mounted
            return
        width = sum(self._widths) + GAP * len(self._widths)
        self.virtual_size = Size(width, len(self._rows) + 1)
        self.scroll_to(y=max(0, self.cursor - 1), animate=False, immediate=True)
        self.refresh()
        self.post_message(self.Highlighted(self.current))

    def _headers(self) -> tuple[str, ...]:
        return ("module", "type", "params", "hits", *self._kinds)

    def on_key(self, event: events.Key) -> None:
        keys_in_order(self, event, {"slash": search(self)})  # "/word" typed fast: all in the box

    # --- keys --------------------------------------------------------------------------------

    def action_select(self) -> None:
        if self.current is not None:
            self.post_message(self.Selected(self.current))

    def _moved(self, before: int) -> None:
        super()._moved(before)
        self.post_message(self.Highlighted(self.current))

    # --- drawing -----------------------------------------------------------------------------

    def render_lines(self, crop: Region) -> list[Strip]:
        # The styles, once a frame rather than once a line (looking them up is the costly part).
        base = self.rich_style
        cursor = base + self.get_component_rich_style("module-table--cursor")
        rows = ("module-table--dim", "module-table--hit")
        self._palette = {
            False: self.styled(base, *rows),
            True: self.styled(cursor, *rows),
            "header": base + self.get_component_rich_style("module-table--header"),
        }
        return super().render_lines(crop)

    def render_line(self, y: int) -> Strip:
        if y == 0:
            style = self._palette["header"]
            return self.fit(self.cells(self._headers(), self._widths, [style] * len(self._widths),
                                       style))  # fmt: skip
        n = round(self.scroll_y) + y - 1
        if n >= len(self._rows):
            return Strip.blank(self.size.width, self.rich_style)
        i = self._rows[n]
        return self.fit(self.cells(self._row(i), self._widths, *self._styles(i, n == self.cursor)))

    def _styles(self, i: int, cursor: bool) -> tuple[list[Style], Style]:
        base, dim, hit = self._palette[cursor]
        first = hit if self._modules[i].get("hits") else base
        # A summary ends "NaN×2!" or "Inf×1!" when the module's output was not finite.
        stats = [
            dim if cell.startswith(STALE) else hit if "!" in cell else base
            for cell in self._cells[i][3:]
        ]
        return [first, dim, dim, hit, *stats], base


def _part(tensor: str, kind: str) -> str:
    """``[0]`` of ``block.output[0]`` (``kind`` "output"): which of a module's outputs."""
    _, found, after = tensor.rpartition(f".{kind}")
    if not found:
        after = tensor[len(kind) :] if tensor.startswith(kind) else ""
    return after.partition("#")[0]  # (a later call's number is said apart)
