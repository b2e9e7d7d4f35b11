"""The part of a dialog between its title and its buttons."""

from __future__ import annotations

from textual.containers import VerticalScroll


class DialogBody(VerticalScroll, can_focus=False):
    """Scrolls when the terminal is too short for it, so the buttons under it stay on screen;
    never takes the focus itself (the dialog's first field does)."""

    DEFAULT_CLASSES = "dialog-body"
