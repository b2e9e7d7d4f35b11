"""A banner across the top that says the connection is being made, or was lost."""

from __future__ import annotations

from textual.widgets import Static


class ConnectionBanner(Static):
    """Hidden while connected; ``show(text, kind)`` with kind ``connecting`` or ``lost``."""

    def __init__(self) -> None:
        super().__init__("", id="connection-banner")

    def show(self, text: str, kind: str = "lost") -> None:
        self.update(text)
        self.set_classes(f"-visible -{kind}")

    def clear(self) -> None:
        self.update("")
        self.set_classes("")
