"""The terminal UI: a Textual app on a training session (live, or a dump).

>>> from tensordbg.tui import run_tui
>>> run_tui()          # the only tensordbg session of this user

It never imports torch, so it starts fast and runs where torch is absent.
"""

from tensordbg.tui.launch import run_tui

__all__ = ["run_tui"]
