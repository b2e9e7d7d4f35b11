"""Keys typed ahead of a focus change. A terminal sends a fast typist's ``[3]`` or ``/late``
(or a paste) all at once, and Textual hands each key to the widget that has the focus when the
key is read: all of them to the widget that had it before ``[`` or ``/`` moved it to a text
box. A binding would act on ``[`` only once the rest went by (``3`` a count prefix by then).

So the widgets that hold the keys (the hits, the model tree, the values grid) act on the keys
that open a text box themselves, in the order the keys came, and hand the keys after them on to
the text box, Enter included.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from textual import events
from textual.widget import Widget
from textual.widgets import Input


def keys_in_order(
    widget: Widget, event: events.Key, opens: Mapping[str, Callable[[], object]]
) -> None:
    """From the ``on_key`` of a widget without children: ``opens`` maps the keys that move the
    focus to a text box to what does it (at once)."""
    focused = widget.screen.focused
    if focused is widget:
        open_box = opens.get(event.key)
        if open_box is not None:
            event.stop()
            event.prevent_default()
            open_box()
    elif isinstance(focused, Input):  # typed ahead: the text box's
        event.stop()
        event.prevent_default()
        focused.post_message(events.Key(event.key, event.character))


def search(widget: Widget) -> Callable[[], object]:
    """``/``: the app's search (filter the hits, or the model tree), when it is allowed."""

    def open_search() -> None:
        app = widget.app
        if app.check_action("search", ()):
            app.action_search()  # type: ignore[attr-defined]

    return open_search
