"""The footer of the main screen: the keys that work now, fitted to the terminal's width.

Textual's Footer lays its keys out in a row and cuts the row at the right edge: at 80 columns it
ended in "i Ignore r", and "/ Search" and "P Profile" never showed. This one leaves a key out
whole when it does not fit, the least needed first, and turns compact (less space around each
key) when that is what makes them fit; the palette (ctrl+p) offers every key it leaves out, and
its key says how many (``^p +3 keys``) when some are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.cells import cell_len
from textual import events
from textual.app import ComposeResult
from textual.widgets import Footer

if TYPE_CHECKING:
    from textual.screen import Screen
    from textual.widgets._footer import FooterKey  # what Footer.compose yields

# The cells a key takes around its key and description, as Textual's FooterKey CSS lays it out:
# " c Continue " (padding on both sides), or compact "c Continue" and a margin of one. The
# palette key on the right edge takes as many compact or not (a border, and padding or margin).
AROUND = {False: 3, True: 2}
FIRST = frozenset("cnspq")
"""The debugger's keys that drive the training (or move along a recorded run) and quit."""
AT_A_PAUSE = frozenset("ki")
"""Skip the update, ignore the rule: shown only while the training is paused, and then needed
before the tab's other keys (at 80 columns "/ Search" and "P Profile" had kept them out)."""


class KeyFooter(Footer):
    """Keys left out whole, the least needed first: the keys in ``FIRST`` are kept before the
    focused widget's (the tab's own) and the pause's (``AT_A_PAUSE``), and those before the
    app's other keys (the app lists its bindings in the order of need)."""

    def __init__(self) -> None:
        super().__init__()
        self._width = 0  # the width it was laid out for
        self._shows: tuple[object, ...] | None = None  # what it was last rebuilt for (_showing)

    def bindings_changed(self, screen: Screen) -> None:
        """Textual's footer is built anew whenever the screen's bindings are looked at again (a
        focus move, a state the app's ``check_action`` reads: most messages from a training),
        each build restyling every key: this one only when what it shows would change."""
        self._bindings_ready = True
        if screen.app.app_focus and self.is_attached and screen is self.screen:
            self.call_after_refresh(self._rebuild_if_changed)

    async def _rebuild_if_changed(self) -> None:
        if not self.is_attached:
            return
        showing = self._showing()  # (each look runs the app's check_action on every binding)
        if showing != self._shows:
            self._shows = showing
            await self.recompose()

    def _showing(self) -> tuple[object, ...]:
        """Every key the footer could show, as it would show it, and the width it has."""
        app = self.app
        return (self.size.width or self.screen.size.width, *(
            (binding.key, binding.description, binding.action, enabled, tooltip, node is app)
            for node, binding, enabled, tooltip in self.screen.active_bindings.values()
            if binding.show
        ))  # fmt: skip

    def compose(self) -> ComposeResult:
        keys = list(super().compose())
        if not keys:
            return
        palette = [k for k in keys if k.has_class("-command-palette")]
        shown = [k for k in keys if k not in palette]
        width = self._width = self.size.width or self.screen.size.width
        for compact in (False, True):
            room = width - sum(_cells(k, compact=False) for k in palette)
            fits = self._fit(shown, room, compact)
            if len(fits) == len(shown) or compact:
                break
        self.compact = compact
        left_out = len(shown) - len(fits)
        for key in palette if left_out else ():  # "+3 keys": as wide as "palette" (to 9)
            many = f"+{left_out} key{'s' * (left_out > 1)}"
            key.description = many if left_out < 10 else "+ keys"
        yield from (k for k in keys if k in fits or k in palette)

    def _fit(self, keys: list[FooterKey], room: int, compact: bool) -> list[FooterKey]:
        """The keys that fit in ``room`` cells, taken in the order of need."""
        bindings = self.screen.active_bindings
        app = self.app

        def need(key: FooterKey) -> int:
            if key.key in FIRST:
                return 0
            mine = key.key in bindings and bindings[key.key].node is app
            if mine and key.key in AT_A_PAUSE:
                return 1
            return 2 if mine else 1

        fits = []
        for key in sorted(keys, key=need):  # stable: in the footer's order within a rank
            if _cells(key, compact) <= room:
                fits.append(key)
                room -= _cells(key, compact)
        return fits

    def on_resize(self, event: events.Resize) -> None:
        if event.size.width != self._width:  # laid out for another width
            self.call_after_refresh(self.recompose)


def _cells(key: FooterKey, compact: bool) -> int:
    return cell_len(key.key_display) + cell_len(key.description) + AROUND[compact]
