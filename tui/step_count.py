"""The count typed before ``s`` (``5s``: five steps), shown in the title until a key takes it. A
base of :class:`~tensordbg.tui.app.TensorDbgApp`.

The count belongs to the key pressed right after it, whichever that key is: ``s`` steps that many
times, any other key (``k`` skips one update, ``c`` continues once, a move in a table) drops it,
and so do Esc and a change of tab. It is never sent with a key it does not apply to.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from textual.actions import ActionParseResult
from textual.app import App
from textual.dom import DOMNode
from textual.widgets import Input, TabbedContent

COUNTED = frozenset({"step"})
"""The control actions a count repeats (the training steps ``n`` steps; the others act once)."""
MAX_COUNT = 1_000_000


class StepCount(App[int]):
    """Needs the app's ``main`` (whose title shows the count) and ``state``."""

    main: Any
    state: Any
    _count = 0

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in ("count", "forget_count") and self.screen is not self.main:
            return False  # a dialog or the session list: its keys only
        if action == "count":  # digits typed into a text box are text
            return self.state == "paused" and not isinstance(self.focused, Input)
        if action == "forget_count":  # Esc, while a count waits
            return bool(self._count)
        return super().check_action(action, parameters)

    def take_count(self, action: str = "") -> int:
        """The times ``action`` is to be done (the count typed before it where it repeats
        ``action``, else 1); the count is gone after it."""
        count, self._count = self._count, 0
        if count:
            self.main.show_count(0)
        return max(count, 1) if action in COUNTED else 1

    def action_count(self, digit: int) -> None:
        self._count = min(self._count * 10 + digit, MAX_COUNT)
        self.main.show_count(self._count)

    def action_forget_count(self) -> None:
        """Esc after a count: nothing is repeated (run_action drops the count)."""

    async def run_action(
        self,
        action: str | ActionParseResult,
        default_namespace: DOMNode | None = None,
        namespaces: Mapping[str, DOMNode] | None = None,
    ) -> bool:
        """Every key bound to an action runs here: one that acted, other than a digit, has
        taken the count typed before it (``s`` read it as it ran)."""
        count = self._count
        done = await super().run_action(action, default_namespace, namespaces)
        if done and count and self._count == count:
            self.take_count()
        return done

    def on_tabbed_content_tab_activated(self, event: TabbedContent.TabActivated) -> None:
        self.take_count()  # a tab chosen with the mouse: the count was for the tab it left
