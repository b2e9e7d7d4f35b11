"""A dialog asking how many steps to profile (5 unless changed), and whether to record the
operators' input shapes (the Operators view groups by them; they slow the profiled steps)."""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Checkbox, Input, Label, Static

MAX_STEPS = 1000


class ProfileStepsScreen(ModalScreen[tuple[int, bool] | None]):
    """Dismissed with the number of steps to profile and whether to record input shapes, or
    None when cancelled."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, steps: int = 5) -> None:
        super().__init__()
        self.steps = steps

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label("Profile the next steps of the training", classes="dialog-title")
            yield Static(
                "The training runs torch.profiler around the next N steps (after one warm-up "
                "step) and the Profile tab (F8) fills when they are done.",
                classes="dialog-doc",
            )
            # Text, not type="integer": that dropped every key but a digit or a sign without a
            # word ("1e3" read as 13); what was typed stays, and is refused with its text.
            yield Input(str(self.steps), id="profile-steps")
            yield Checkbox("Record input shapes (Operators: g groups by them; slower)",
                           id="profile-shapes")  # fmt: skip
            yield Static("", classes="dialog-error")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Profile", variant="primary", id="profile")
                yield Button("Cancel", id="cancel")

    @on(Input.Submitted)
    @on(Button.Pressed, "#profile")
    def action_profile(self) -> None:
        value = self.query_one(Input).value.strip()
        try:
            steps = int(value)
        except ValueError:
            steps = 0
        if not 1 <= steps <= MAX_STEPS:
            error = f"The number of steps is a whole number from 1 to {MAX_STEPS}, not {value!r}."
            self.query_one(".dialog-error", Static).update(Text(error, style="bold red"))
            return
        self.dismiss((steps, self.query_one("#profile-shapes", Checkbox).value))

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)
