"""A dialog to change a rule's thresholds: one input per threshold."""

from __future__ import annotations

from typing import Any, ClassVar

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static

from tensordbg.tui.components.dialog_body import DialogBody
from tensordbg.tui.components.param_inputs import ParamInputs


class RuleEditScreen(ModalScreen[dict[str, Any] | None]):
    """Dismissed with the new thresholds, or None when cancelled."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, rule: dict[str, Any]) -> None:
        super().__init__()
        self.rule = rule

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(
                f"Thresholds of {self.rule['name']} (rule {self.rule['id']})",
                classes="dialog-title",
            )
            with DialogBody():  # the buttons stay on screen
                if self.rule.get("doc"):
                    yield Static(self.rule["doc"], classes="dialog-doc")
                yield ParamInputs(self.rule.get("params") or {})
                yield Static("", classes="dialog-error")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")

    @on(Input.Submitted)
    @on(Button.Pressed, "#save")
    def action_save(self) -> None:
        try:
            params = self.query_one(ParamInputs).values()
        except ValueError as e:
            self.query_one(".dialog-error", Static).update(Text(str(e), style="bold red"))
            return
        self.dismiss(params)

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)
