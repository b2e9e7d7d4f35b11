"""The slice box of the Tensor tab, checked with ``parse_index`` as the person types."""

from __future__ import annotations

from typing import ClassVar

from textual.binding import Binding, BindingType
from textual.validation import ValidationResult, Validator
from textual.widgets import Input

from tensordbg.sources.slicing import SliceError, parse_index


class SliceSyntax(Validator):
    """Valid when ``parse_index`` reads the text; the failure says where it went wrong."""

    def validate(self, value: str) -> ValidationResult:
        try:
            parse_index(value)
        except SliceError as e:
            return self.failure(str(e))
        return self.success()


class SliceInput(Input):
    """``[0, :, 3:8:2]``; empty means the whole tensor. Escape hands the keys back to the grid."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "leave", "Back to the values", show=False),
    ]

    def __init__(self) -> None:
        super().__init__(
            placeholder="slice, e.g. [0, :, 3:8:2] — empty for the whole tensor; Enter to apply",
            validators=[SliceSyntax()],
            validate_on=["changed", "submitted"],
            id="slice-input",
            # "[" opens the box with "[" typed: selecting it on focus would let the next key
            # replace it.
            select_on_focus=False,
        )

    def action_leave(self) -> None:
        self.screen.focus_next()

    def insert_text_at_cursor(self, text: str) -> None:
        """A ``[`` typed at the end of a slice where no index list can begin (after a whole
        slice, the one applied or one refused: ``[1:x]``; after an unclosed one refused:
        ``[1, 2:4``) starts a new one, as ``[`` on the values does: ``[1:x][`` is never what a
        person means. After ``[`` or ``,`` it opens an index list (``[[0, 2], :]``)."""
        value = self.value.rstrip()
        if text == "[" and value and value[-1] not in "[," and (
                self.cursor_position >= len(self.value)):  # fmt: skip
            self.value = ""
        super().insert_text_at_cursor(text)
