"""A dialog to change a rule's thresholds: one input per threshold."""

from __future__ import annotations

from typing import Any

from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, Input, Label, Static

from tensordbg.tui.components.dialog_body import DialogBody
from tensordbg.tui.components.param_inputs import ParamInputs
from tensordbg.tui.components.rule_doc import RuleDoc
from tensordbg.tui.screens.rule_dialog import RuleDialog, Send


class RuleEditScreen(RuleDialog):
    """Sends the thresholds typed (``send(params)``): an emptied field is None, which a
    threshold that can be off (a TensorRange bound) takes and one that needs a number refuses,
    the dialog staying open with the other edits."""

    def __init__(self, rule: dict[str, Any], send: Send) -> None:
        super().__init__(send)
        self.rule = rule

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(
                f"Thresholds of {self.rule['name']} (rule {self.rule['id']})",
                classes="dialog-title",
            )
            with DialogBody():  # the buttons stay on screen
                if self.rule.get("doc"):
                    yield RuleDoc(self.rule["doc"])
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
            self.say_error(str(e))
            return
        self.send(params)
