"""The Modules tab: a search box, the model tree, and the tensors of the module under the cursor."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.timer import Timer
from textual.widgets import Input, Label

from tensordbg.tui.components.module_table import ModuleTable
from tensordbg.tui.components.tensor_table import TensorTable

SETTLE = 0.06  # seconds the cursor rests on a module before its tensors are listed
UNMEASURED = (
    "Deferred checks read module outputs only when a phase shows a problem: a hit shows them, a "
    "pause between steps has none (sync='eager' reads every one)."
)


class ModuleBrowser(Vertical):
    """``/`` focuses the search; Enter or Escape in the search returns to the modules (the
    filter stays); Enter on a module moves to its tensors."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "leave_search", "Back to the modules", show=False),
    ]

    def __init__(self) -> None:
        super().__init__(id="module-browser")
        self._by_module: dict[str, list[dict[str, Any]]] = {}
        self._pending: Timer | None = None
        self.search = Input(
            placeholder="/ search modules by path or type  ·  ← → scroll the lines sideways",
            id="module-search",
            compact=True,  # one line, not three: at 80x24 the tree showed 6 modules
        )
        self.note = Label(UNMEASURED, id="module-note")
        self.table = ModuleTable()
        self.tensors_title = Label("", id="module-tensors-title")
        self.tensor_table = TensorTable()

    def compose(self) -> ComposeResult:
        yield self.search
        yield self.note
        yield self.table
        yield self.tensors_title
        yield self.tensor_table

    def set_modules(self, modules: list[dict[str, Any]], step: int | None = None) -> None:
        self.table.set_modules(modules, step)

    def step_moved(self, step: int | None) -> None:
        """The training is at ``step`` now: statistics of earlier steps are marked so."""
        self.table.step_moved(step)

    def hits_heard(self, by_module: dict[str, int]) -> None:
        """Hits received since the tree was read: each module's count follows them."""
        self.table.hits_heard(by_module)

    def show_unmeasured(self, unmeasured: bool) -> None:
        """Say why the outputs may have no ranges: deferred mode reads them only when a phase
        shows a problem (``LiveSource.modules`` shows what the paused phase read)."""
        self.note.set_class(unmeasured, "-visible")

    def set_tensors(self, tensors: list[dict[str, Any]]) -> None:
        self._by_module = defaultdict(list)
        for t in tensors:
            self._by_module[t["module"]].append(t)
            for path in t.get("passed_up", ()):  # also the output of the modules it went up to
                # Named as that module's output, as its hits name it, with the child's name too.
                as_own = f"{path}.{t['kind']}" if path else t["kind"]
                self._by_module[path].append(dict(t, name=as_own, same_as=t["name"]))
        self._show_tensors(self.table.current)

    def focus_search(self) -> None:
        # Now, not after the keys already queued: they are the search's.
        self.screen.set_focus(self.search)

    @on(Input.Changed, "#module-search")
    def _search(self, event: Input.Changed) -> None:
        self.table.set_filter(event.value)

    @on(Input.Submitted, "#module-search")
    def _search_done(self) -> None:
        self.action_leave_search()

    def action_leave_search(self) -> None:
        self.table.focus()

    @on(ModuleTable.Highlighted)
    def _highlighted(self, event: ModuleTable.Highlighted) -> None:
        # The cursor moves at once; the tensors follow when it rests (holding a key stays fast).
        if self._pending is not None:
            self._pending.stop()
        self._pending = self.set_timer(SETTLE, lambda: self._show_tensors(event.module))

    @on(ModuleTable.Selected)
    def _selected(self, event: ModuleTable.Selected) -> None:
        # Its tensors now, not when the cursor would have rested: right after a search (or a
        # quick move) the list still showed the module before, or none, and Enter did nothing.
        if self._pending is not None:
            self._pending.stop()
            self._pending = None
        self._show_tensors(event.module)
        if self.tensor_table.row_count:
            self.tensor_table.focus()

    def _show_tensors(self, module: dict[str, Any] | None) -> None:
        tensors = self._by_module.get(module["path"], []) if module else []
        title = self.tensors_title
        if module is None:
            title.update("No module matches the search.")
        else:
            name = module["path"] or "(model)"
            # A replay lists the dumped step's tensors, of every phase; a live session the phase's.
            replay = getattr(self.app, "state", "") == "replay"
            where = "this dumped step" if replay else "this phase"
            title.update(
                f"Tensors of {name} in {where}: {len(tensors)}"
                + ("  (Enter opens one)" if tensors else "")
            )
        self.tensor_table.show(tensors)
