"""Errors the UI survives: a bug in a widget, a reply that does not match its schema. Each one is
shown (a line in the Log tab, a notification) and its details (traceback, versions) go to one
private crash file, whose path the command prints on exit. No error quits the UI.

Every worker of the UI is started through :func:`work` (Textual's ``@work``, guarded), and the
handlers that route the training's data through :func:`reported`; both hand an error to the app's
``report_error``, the one place errors are handled. An error raised while its widget is being
taken down (a worker that resumed after its screen was closed and found its tables gone) is the
closing, not a bug, and is not shown.

>>> @work(group="inspect", exclusive=True)
... async def load(self, text: str) -> None: ...
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import textual
from textual.dom import DOMNode

F = TypeVar("F", bound=Callable[..., Any])


class CrashFile:
    """The details of the errors the UI survived, appended to one file (mode 0600) made on the
    first error: in the user's private tensordbg directory (the connection files' one), else in
    the temporary directory.

    >>> crash = CrashFile()
    >>> crash.write(error, "TensorInspector.load")
    PosixPath('/run/user/1000/tensordbg/ui-errors-20250101-120000-4242.txt')
    >>> crash.exit_message()
    'tensordbg: details of 1 error in /run/user/1000/tensordbg/ui-errors-20250101-120000-4242.txt'
    """

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory
        self.path: Path | None = None
        self.count = 0  # errors written, or that failed to be
        self.session = ""  # which training the UI was on, for the reader

    def write(self, error: BaseException, where: str, details: str = "") -> Path | None:
        """Append one error; its path, or None when no file could be written (the error is still
        counted and shown)."""
        self.count += 1
        lines = [f"--- error {self.count} at {time.strftime('%H:%M:%S')} in {where}"]
        if self.session:
            lines.append(f"session: {self.session}")
        if details:
            lines.append(details.rstrip("\n"))
        lines.append("".join(traceback.format_exception(error)).rstrip("\n"))
        try:
            if self.path is None:
                self.path = self._create()
            with open(self.path, "a", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n\n")
        except OSError:
            return None
        return self.path

    def exit_message(self) -> str | None:
        """The line to print when the UI ends, None when nothing went wrong."""
        if not self.count:
            return None
        errors = "1 error" if self.count == 1 else f"{self.count} errors"
        if self.path is None:
            return f"tensordbg: {errors} in the UI; no crash file could be written"
        return f"tensordbg: details of {errors} in {self.path}"

    def _create(self) -> Path:
        name = f"ui-errors-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.txt"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        try:
            directory = self.directory or _private_directory()
            fd = os.open(directory / name, flags, 0o600)
            path = directory / name
        except OSError:
            fd, temp = tempfile.mkstemp(prefix="tensordbg-ui-errors-", suffix=".txt")  # 0600
            path = Path(temp)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(_header())
        return path


def _private_directory() -> Path:
    from tensordbg.transport.connection import ConnectionFileError, runtime_dir

    try:
        return runtime_dir()
    except ConnectionFileError as e:  # not private, or not ours: not there
        raise OSError(str(e)) from None


def _header() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        tensordbg = version("tensordbg")
    except PackageNotFoundError:
        tensordbg = "?"
    return (
        f"tensordbg UI errors, {time.strftime('%Y-%m-%d %H:%M:%S %z')}\n"
        f"tensordbg {tensordbg}, textual {textual.__version__}, Python {platform.python_version()}"
        f", {platform.platform()}\n"
        f"command: {' '.join(sys.argv)}\n\n"
    )


# --- guarding workers and handlers --------------------------------------------------------------


def work(method: F | None = None, /, **options: Any) -> Any:
    """Textual's ``@work`` (same options), whose errors are reported and survived: an error
    escaping the worker goes to the app's ``report_error`` instead of quitting the app (Textual's
    ``exit_on_error`` then applies only to an error in reporting itself)."""

    def decorate(method: F) -> Any:
        return textual.work(_guarded(method, in_thread=options.get("thread", False)), **options)

    return decorate if method is None else decorate(method)


def reported(handler: F) -> F:
    """A message handler (or any method of a widget) whose errors are reported and survived: a
    handler that raised would stop its widget's messages, or quit the app."""
    return _guarded(handler, in_thread=False)  # type: ignore[return-value]


def _guarded(method: F, in_thread: bool) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(method):

        @functools.wraps(method)
        async def guarded_async(node: DOMNode, *args: Any, **kwargs: Any) -> Any:
            try:
                return await method(node, *args, **kwargs)
            except Exception as error:
                _report(node, error, _where(node, method))
                return None

        return guarded_async

    @functools.wraps(method)
    def guarded(node: DOMNode, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(node, *args, **kwargs)
        except Exception as error:
            where = _where(node, method)
            if not in_thread:
                _report(node, error, where)
            else:  # the app is reached from a thread worker only through call_from_thread
                with contextlib.suppress(RuntimeError):  # the app has closed meanwhile
                    node.app.call_from_thread(_report, node, error, where)
            return None

    return guarded


def _report(node: DOMNode, error: Exception, where: str) -> None:
    if _taken_down(node):
        return
    report = getattr(node.app, "report_error", None)
    if report is None:  # not the debugger's app (a widget tested alone): Textual's way
        raise error
    report(error, where)


def _taken_down(node: DOMNode) -> bool:
    """Whether the node is being removed, or was: Textual prunes a closed screen's children
    before it cancels the screen's workers, and a worker can resume in between."""
    return bool(node._pruning or node._closing or node._closed or not node.is_attached)


def _where(node: DOMNode, method: Callable[..., Any]) -> str:
    return f"{type(node).__name__}.{method.__name__}"
