"""Messages the debugger's widgets and screens send each other.

Widgets post these; they bubble to the main screen, which routes them (opening a tensor switches
to the Tensor tab and loads it there). Messages a widget sends its own parent or itself
(``ModuleTable.Highlighted``, ``TensorGrid.BlockReady``) live in that widget's class instead.
"""

from __future__ import annotations

from typing import Any

from textual.message import Message


class OpenTensor(Message):
    """Show a tensor in the Tensor tab, and where it came from in the Provenance tab."""

    def __init__(
        self, ref: int, name: str = "", text: str = "", module: str | None = None, call: int = 0
    ) -> None:
        super().__init__()
        self.ref = ref
        self.name = name
        self.text = text
        # A hit names the module call where its value was made, which may be a call around the
        # submodule that returned the tensor; provenance is shown from there.
        self.module = module
        self.call = call


class HitsFound(Message):
    """Hits learnt of outside the event stream (a recheck); the hits table merges them by id."""

    def __init__(self, hits: list[dict[str, Any]]) -> None:
        super().__init__()
        self.hits = hits
