"""The Hits tab's filter box (``/``): narrows the hits as the person types."""

from __future__ import annotations

from typing import ClassVar

from textual.binding import Binding, BindingType
from textual.widgets import Input


class HitFilter(Input):
    """Hidden until ``/``; Enter or Escape hands the keys back to the hits (the filter stays,
    and shows while it is not empty)."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "leave", "Back to the hits", show=False),
    ]

    def __init__(self) -> None:
        super().__init__(
            placeholder="filter hits: a rule, tensor, module, step or word of the message",
            id="hit-filter",
        )

    def on_mount(self) -> None:
        # Said while the filter shows: the placeholder goes with the first key typed, and a row
        # whose names lack the word, shown for its message, looked like a filter that failed.
        self.border_title = "rows whose rule, tensor, module, step, phase or message contain it"

    def open(self) -> None:
        self.add_class("-visible")
        self.screen.set_focus(self)  # now: the keys typed right after "/" are the filter's

    def action_leave(self) -> None:
        self.set_class(bool(self.value), "-visible")
        self.screen.set_focus(self.screen.query_one("#hit-table"))

    def on_blur(self) -> None:
        self.set_class(bool(self.value), "-visible")
