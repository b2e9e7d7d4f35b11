"""The main screen's tabs: Textual's TabbedContent, which a late focus cannot switch back."""

from __future__ import annotations

from textual.widgets import TabbedContent, TabPane


class Tabbed(TabbedContent):
    """A pane that gets a widget focused tells the tabs, which make it the active one. The
    message comes after the focus: keys typed at once ("F7 F2 Enter" under load) focus the Log,
    then the hits table, and the Log pane's late message switched back to it. A pane that no
    longer holds the focused widget is not made active."""

    def _on_tab_pane_focused(self, event: TabPane.Focused) -> None:
        # Textual calls TabbedContent's own handler after this one, unless prevented.
        focused = self.screen.focused
        if focused is not None and event.tab_pane not in focused.ancestors_with_self:
            event.prevent_default()  # the focus moved on since: the tab the keys asked for stays
            event.stop()
