"""A tab's content mounted after the first screen is up, safely when the app quits first."""

from __future__ import annotations

from textual.lazy import Lazy
from textual.widget import Widget


class Later(Lazy):
    """Textual's Lazy (the widget is mounted after the first screen is up), except that when
    the app is quitting by then (q pressed at once) nothing is mounted: Lazy raises MountError
    into the app, which then exits with a traceback."""

    def __init__(self, widget: Widget) -> None:
        super().__init__(widget)
        self._widget = widget

    async def mount_composed_widgets(self, widgets: list[Widget]) -> None:
        parent = self.parent
        if not isinstance(parent, Widget):
            return

        async def mount() -> None:
            if not (parent.is_attached and self.is_attached):
                return
            await parent.mount(self._widget, after=self)
            await self.remove()

        self.call_after_refresh(mount)
