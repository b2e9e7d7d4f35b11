"""One input per threshold of a rule, each read back as the value it spells (``1e-7``, ``None``,
``True``, ``[0, 1]``), for the rule edit and rule add dialogs."""

from __future__ import annotations

import ast
from typing import Any

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Input, Label


def parse_value(text: str, like: Any) -> Any:
    """The value typed for a threshold whose current value is ``like``; raises ValueError."""
    text = text.strip()
    if text.lower() in ("", "none"):
        return None
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        if isinstance(like, str):
            return text
        raise ValueError(f"{text!r} is not a number, True/False, None or a list") from None
    if isinstance(like, float) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    return value


class ParamInputs(Vertical):
    """Inputs named after ``params``' keys, filled with their values."""

    def __init__(self, params: dict[str, Any], id: str | None = None) -> None:
        super().__init__(id=id, classes="param-inputs")
        self._params = dict(params)

    def compose(self) -> ComposeResult:
        if not self._params:
            yield Label("This rule has no thresholds.", classes="param-none")
        # The names' column is as wide as the longest name (increase_threshold_percent was cut
        # to "increase_threshold_pe"); past half the row, a name folds onto a second line.
        width = max((len(name) + 1 for name in self._params), default=0)  # + its padding
        for name, value in self._params.items():
            with Horizontal(classes="param-row"):
                label = Label(name, classes="param-name")
                label.styles.width = width
                yield label
                yield Input("" if value is None else repr(value), name=name, classes="param-input")

    def values(self) -> dict[str, Any]:
        """The typed values; raises ValueError naming the threshold that does not read."""
        out = {}
        for box in self.query(Input):
            name = box.name or ""
            try:
                out[name] = parse_value(box.value, self._params.get(name))
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
        return out
