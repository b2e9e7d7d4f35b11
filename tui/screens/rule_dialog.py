"""What the rule edit and rule add dialogs share: each sends its change itself, and closes only
once the training took it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

from rich.text import Text
from textual import on
from textual.binding import Binding, BindingType
from textual.screen import ModalScreen
from textual.widgets import Button, Static

from tensordbg.sources.contract import Rule
from tensordbg.tui.errors import work
from tensordbg.tui.remote import RequestFailed

Send = Callable[[Any], Awaitable[Rule]]
"""Sends a dialog's change to the training: ``remote.set_rule(...)`` or ``remote.add_rule(...)``."""


class RuleDialog(ModalScreen[Rule | None]):
    """Dismissed with the training's reply (the rule as it is, or will be at the next hook), or
    None when cancelled. A change the training refuses (an emptied threshold that needs a number,
    a bound out of range) is said in the dialog, which stays open with everything typed in it:
    the other fields are not lost with the one the training cannot take."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, send: Send) -> None:
        super().__init__()
        self._send = send

    def say_error(self, text: str) -> None:
        error = self.query_one(".dialog-error", Static)
        error.update(Text(text, style="bold red"))
        if text:  # at the foot of a body that scrolls on a short terminal: brought into view
            self.call_after_refresh(error.scroll_visible, animate=False)

    @work(group="rule-dialog", exclusive=True)
    async def send(self, change: Any) -> None:
        self.say_error("")
        try:
            reply = await self._send(change)
        except RequestFailed as e:
            self.say_error(f"The training refused this: {e.message}")
            return
        self.dismiss(reply)

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)
