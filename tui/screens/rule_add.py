"""A dialog to add one of the available rules on the tensors matching a pattern."""

from __future__ import annotations

from typing import Any

from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, Input, Label, Select, Static

from tensordbg.tui.components.dialog_body import DialogBody
from tensordbg.tui.components.param_inputs import ParamInputs
from tensordbg.tui.components.rule_doc import RuleDoc
from tensordbg.tui.screens.rule_dialog import RuleDialog, Send


class RuleAddScreen(RuleDialog):
    """Sends ``send({"name", "match", "params"})`` (params: the thresholds changed from the
    rule's defaults)."""

    def __init__(self, available: list[dict[str, Any]], send: Send) -> None:
        super().__init__(send)
        self.available = {rule["name"]: rule for rule in available}

    def compose(self) -> ComposeResult:
        first = next(iter(self.available.values()), None)
        with Vertical(classes="dialog"):
            yield Label("Add a rule", classes="dialog-title")
            # The body scrolls; the buttons stay on screen whatever the terminal's height.
            with DialogBody():
                yield from self._body(first)
            with Horizontal(classes="dialog-buttons"):
                yield Button("Add", variant="primary", id="save")
                yield Button("Cancel", id="cancel")

    def _body(self, first: dict[str, Any] | None) -> ComposeResult:
        yield Select(
            [(name, name) for name in self.available],
            value=first["name"] if first else Select.NULL,
            allow_blank=first is None,
            id="rule-choice",
        )
        yield RuleDoc(first.get("doc", "") if first else "No rules to add.")
        yield Label("on tensors matching (a glob on the tensor name)")
        yield Input("*", id="rule-match")
        yield ParamInputs(first["params"] if first else {})
        yield Static("", classes="dialog-error")

    @on(Select.Changed, "#rule-choice")
    async def _chosen(self, event: Select.Changed) -> None:
        rule = self.available.get(str(event.value))
        if rule is None:
            return
        self.query_one(RuleDoc).show(rule.get("doc", ""))
        await self.query_one(ParamInputs).remove()
        await self.query_one(DialogBody).mount(
            ParamInputs(rule["params"]), before=self.query_one(".dialog-error")
        )

    @on(Input.Submitted)
    @on(Button.Pressed, "#save")
    def action_save(self) -> None:
        name = self.query_one("#rule-choice", Select).value
        if name not in self.available:
            return
        try:
            params = self.query_one(ParamInputs).values()
        except ValueError as e:
            self.say_error(str(e))
            return
        defaults = self.available[str(name)]["params"]
        changed = {k: v for k, v in params.items() if v != defaults.get(k)}
        match = self.query_one("#rule-match", Input).value.strip() or "*"
        self.send({"name": name, "match": match, "params": changed})
