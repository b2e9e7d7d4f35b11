"""A rule's description in the rule dialogs, as plain text: descriptions are docstrings, written
in reStructuredText for Sphinx."""

from __future__ import annotations

import re

from rich.text import Text
from textual.widgets import Static

# ``literal``, :role:`target` (with the ~ of :meth:`~x.y` dropped) and `interpreted` text.
_MARKUP = re.compile(r"``(.+?)``|:[\w:.-]+:`~?(.+?)`|`(.+?)`")


def plain(doc: str) -> str:
    """``doc`` without its reStructuredText markup.

    >>> plain("Above ``threshold``; see :meth:`Rule.check`.")
    'Above threshold; see Rule.check.'
    """
    return _MARKUP.sub(lambda m: next(g for g in m.groups() if g is not None), doc)


class RuleDoc(Static):
    """What a rule looks for, shown as it reads (never as Rich markup: ``x[ab]`` stays)."""

    DEFAULT_CLASSES = "dialog-doc"

    def __init__(self, doc: str = "") -> None:
        super().__init__(Text(plain(doc)))

    def show(self, doc: str) -> None:
        self.update(Text(plain(doc)))
