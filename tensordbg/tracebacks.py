"""The traceback of a :class:`~tensordbg.hit.WatchpointHit` as a person wants it: their own
frames only. The hit is raised from inside a module hook, so Python's traceback would run
through PyTorch's ``Module.__call__`` and tensordbg's pipeline, forty lines that push the line
that matters off the screen.

``tensordbg run`` prints it this way; ``attach`` installs :func:`install_excepthook`'s hook
while the session is attached, for a ``WatchpointHit`` that nobody catches and a Ctrl-C that
stopped the training inside tensordbg (paused at a hit: sixteen frames of tensordbg's and
PyTorch's); other exceptions go to the hook that was there before.
``TENSORDBG_FULL_TRACEBACK=1`` keeps every frame.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

_PACKAGE = str(Path(__file__).resolve().parent)
_HIDDEN = (_PACKAGE + os.sep, os.sep + "torch" + os.sep, os.sep + "runpy.py")
_PATHS = sysconfig.get_paths()
_STDLIB = _PATHS["stdlib"] + os.sep
_INSTALLED = (_PATHS["purelib"] + os.sep, _PATHS["platlib"] + os.sep)


def _hidden(filename: str) -> bool:
    path = os.path.abspath(filename)
    return any(part in path for part in _HIDDEN) or filename.startswith("<frozen ")


def _stdlib(filename: str) -> bool:
    return filename.startswith(_STDLIB) and not filename.startswith(_INSTALLED)


def format_user_traceback(error: BaseException) -> str:
    """``Traceback (most recent call last):`` with the frames outside tensordbg, PyTorch and
    runpy, then the exception's own line; every frame when none would be left."""
    frames = traceback.extract_tb(error.__traceback__)
    header = "Traceback (most recent call last):\n"
    if os.environ.get("TENSORDBG_FULL_TRACEBACK") != "1":
        users, inside = [], False
        for f in frames:  # past tensordbg's first frame, the standard library's are its own
            inside = inside or f.filename.startswith(_PACKAGE + os.sep)
            if not (_hidden(f.filename) or (inside and _stdlib(f.filename))):
                users.append(f)
        if users and len(users) < len(frames):
            frames = traceback.StackSummary.from_list(users)
            header = (
                "Traceback (most recent call last; tensordbg's and PyTorch's frames left out):\n"
            )
    lines = [header, *traceback.format_list(frames)]
    lines += traceback.format_exception_only(type(error), error)
    return "".join(lines)


def print_script_error(error: BaseException) -> None:
    """An exception a script run by ``tensordbg run`` raised, as ``python script.py`` prints it:
    from the script's own first frame (the runner's and runpy's frames before it left out).
    An error the excepthook would say in its own words is said so (a rank's collective that
    failed as another rank stopped the job: one line, not gloo's traceback)."""
    if any(handle(error) for handle in _handlers()):
        return
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None and _hidden(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    traceback.print_exception(type(error), error, tb, file=sys.stderr)
    sys.stderr.flush()


def shows_hits() -> bool:
    """Whether an uncaught WatchpointHit is printed by :func:`install_excepthook`'s hook."""
    return any(handle is _print_users_frames for handle in _handlers())


def _handlers() -> Iterator[Callable[[BaseException], bool]]:
    """The handlers :func:`chain_excepthook` put before the interpreter's excepthook, outermost
    first."""
    hook: Any = sys.excepthook
    while hook is not None:
        handle = getattr(hook, "handle", None)
        if handle is not None:
            yield handle
        hook = getattr(hook, "previous", None)


def chain_excepthook(handle: Callable[[BaseException], bool]) -> Callable[[], None]:
    """Put ``handle`` before the interpreter's excepthook: it says the uncaught errors it knows
    (returning True) and passes the others on. Returns the undo, which leaves the hook in place
    while an error is on its way up (a framework's teardown detaches before the error reaches
    the top, where the hook is still wanted)."""
    previous = sys.excepthook

    def excepthook(
        kind: type[BaseException], error: BaseException, tb: TracebackType | None
    ) -> Any:
        return None if handle(error) else previous(kind, error, tb)

    excepthook.handle = handle  # type: ignore[attr-defined]
    excepthook.previous = previous  # type: ignore[attr-defined]
    sys.excepthook = excepthook

    def undo() -> None:
        if sys.excepthook is excepthook and sys.exc_info()[1] is None:
            sys.excepthook = previous

    return undo


def install_excepthook() -> Callable[[], None]:
    """Print an uncaught WatchpointHit, and a Ctrl-C that came while tensordbg ran (a pause),
    with :func:`format_user_traceback`; returns the undo."""
    return chain_excepthook(_print_users_frames)


def _print_users_frames(error: BaseException) -> bool:
    from tensordbg.hit import WatchpointHit

    if isinstance(error, KeyboardInterrupt) and _inside_tensordbg(error.__traceback__):
        print(format_user_traceback(error), end="", file=sys.stderr, flush=True)
        return True
    if not isinstance(error, WatchpointHit):
        return False
    print(format_user_traceback(error), end="", file=sys.stderr, flush=True)
    if error.summary_after:  # the hits, after the traceback (a framework detached first)
        print(error.summary_after, file=sys.stderr, flush=True)
    return True


def _inside_tensordbg(tb: TracebackType | None) -> bool:
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.startswith(_PACKAGE + os.sep):
            return True
        tb = tb.tb_next
    return False


def script_ended_by() -> str:
    """At exit, how the script ended when it did not end by itself, as the UI says it: the
    exception Python printed at the top level (``sys.last_value``); "" for a normal end. Not in
    IPython, where ``sys.last_value`` is any earlier cell's error."""
    error = getattr(sys, "last_value", None)
    if error is None or "IPython" in sys.modules or isinstance(error, SystemExit):
        return ""
    if isinstance(error, KeyboardInterrupt):
        return "interrupted by Ctrl-C"
    return f"stopped by {type(error).__name__}"
