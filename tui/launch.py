"""``run_tui``: find the session to debug, connect, and run the app."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tensordbg.tui.remote import ENDED, TrainingExited

if TYPE_CHECKING:
    from tensordbg.tui.app import TensorDbgApp


def run_tui(
    conn: str | None = None,
    *,
    run_id: str | None = None,
    wait: float = 0.0,
    alive: Callable[[], bool] | None = None,
    ends_training: bool = False,
) -> int:
    """Open the debugger UI on a training session and return the exit status.

    ``conn`` is a connection file's path; without it, the only live session is used, a picker
    lists them when there are several, and with ``run_id`` the UI waits up to ``wait`` seconds
    for that run's connection file to appear (``tensordbg demo`` starts the training and the UI
    together). ``alive()``, when given, says whether the training's process still runs: once it
    says no, the UI stops waiting and reconnecting. ``ends_training``: the caller stops the
    training when the UI quits (``tensordbg demo``), so q quits without detaching. Errors the UI
    survived are counted on exit, with the path of the file that holds their details.

    >>> run_tui()                                   # the only session of this user
    >>> run_tui(run_id="demo7f3a", wait=30)         # a training that is starting now
    >>> run_tui(run_id="demo7f3a", wait=30, alive=lambda: training.poll() is None)
    """
    from tensordbg.transport.connection import ConnectionFileError

    if not wait >= 0:  # NaN too
        print(f"tensordbg tui: --wait is a number of seconds, 0 or more, not {wait:g}",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        problem = _unreachable(conn, run_id, wait) if alive is None else None
        app = None if problem else session_app(conn, run_id=run_id, wait=wait, alive=alive,
                                               ends_training=ends_training)  # fmt: skip
    except ConnectionFileError as e:  # the runtime directory is not private, say
        problem = str(e)
    except KeyboardInterrupt:  # Ctrl-C while it waited for a training: one line, as run's
        print("tensordbg tui: stopped waiting (Ctrl-C)", file=sys.stderr)
        return 130
    if problem is not None:  # a mistyped path or run: say so at once, not in a UI that retries
        print(f"tensordbg tui: {problem}", file=sys.stderr)
        return 2
    if app is None:
        waited = (f"no tensordbg session started within {wait:g} s" if wait else
                  "no tensordbg session is running for this user")  # fmt: skip
        wait_more = (
            "wait longer with --wait" if wait else "wait for one with `tensordbg tui --wait 60`"
        )
        print(
            f"tensordbg tui: {waited}: start the training with tensordbg.attach(...) or "
            "`tensordbg run script.py` (its session starts at the model's first call), "
            f"{wait_more}, or give the path of its connection file.",
            file=sys.stderr,
        )
        return 2
    result = app.run()
    if app.farewell:
        print(app.farewell, file=sys.stderr)
    report = app.crash_file.exit_message()  # "tensordbg: details of 2 errors in ..."
    if report is not None:
        print(report, file=sys.stderr)
    return app.return_code or int(result or 0)


def _unreachable(conn: str | None, run_id: str | None, wait: float) -> str | None:
    """Why the session a person named cannot be opened, if it plainly cannot: the connection
    file is missing or is not one, its training has exited, or no session of ``run_id``
    appears within ``wait`` seconds."""
    from tensordbg.transport.connection import (
        ConnectionFileError,
        find_sessions,
        is_live,
        read_connection_file,
    )

    if conn is not None:
        try:
            info = read_connection_file(conn)
        except ConnectionFileError as e:
            return str(e)
        if not is_live(info):
            return f"that training is no longer running (pid {info.pid}, {conn})"
        return None
    if run_id is not None:
        deadline = time.monotonic() + wait
        while not any(s.run_id == run_id for s in find_sessions()):
            if time.monotonic() >= deadline:
                waited = f" within {wait:g} s" if wait else ""
                return f"no running session of run {run_id!r}{waited}: see tensordbg tui --help"
            time.sleep(0.1)
    return None


def session_app(
    conn: str | None = None,
    *,
    run_id: str | None = None,
    wait: float = 0.0,
    alive: Callable[[], bool] | None = None,
    ends_training: bool = False,
) -> TensorDbgApp | None:
    """The app on the session ``run_tui`` would open (None when there is none to open), not yet
    running: the connection is made, and remade after a drop, by the app itself."""
    from tensordbg.transport.client import Client
    from tensordbg.transport.connection import find_sessions
    from tensordbg.tui.app import TensorDbgApp

    sessions: list[Any] = []
    if conn is None and run_id is None:
        # Any session of this user; with ``wait``, one that starts within it (`tensordbg run`
        # makes its session at the model's first call).
        deadline = time.monotonic() + wait
        sessions = find_sessions()
        if not sessions and wait > 0:  # a blank terminal said nothing of what it waited for
            print(f"tensordbg tui: waiting up to {wait:g} s for a training to start "
                  "(Ctrl-C stops waiting)", file=sys.stderr, flush=True)  # fmt: skip
        while not sessions and time.monotonic() < deadline:
            time.sleep(0.2)
            sessions = find_sessions()
        if not sessions:
            return None

    # Connection file (or run id) -> the session it leads to: as listed, then as reached. A
    # session listed a moment ago may have ended before it was chosen: its file is gone.
    known: dict[str, Any] = {str(s.path): s for s in sessions}
    reached: list[Any] = [None]  # the session reached last

    async def connect(picked: str | None) -> Client:
        path = picked or conn
        if path is None and run_id is not None:
            gone = exited(known.get(run_id))
            if gone:
                raise TrainingExited(gone)
            path = await wait_for_run(run_id, wait, alive=alive)
        try:
            client = await Client.connect(path, timeout=5.0)
        except Exception as e:
            gone = exited(known.get(str(path)))
            if gone:  # reconnecting cannot succeed: the app says so and stops trying
                raise TrainingExited(gone) from None
            if isinstance(e, TimeoutError) and path is not None:
                raise TimeoutError(f"{e}{why_silent(path)}") from None
            raise
        known[str(path)] = known[client.info.run_id] = reached[0] = client.info
        return client

    def still_running() -> bool | None:
        """Whether the process of the session reached last still runs (None: none reached)."""
        from tensordbg.transport.connection import is_live

        return None if reached[0] is None else is_live(reached[0])

    connect.still_running = still_running  # type: ignore[attr-defined]
    return TensorDbgApp(connect, sessions=sessions, ends_training=ends_training)


def why_silent(path: str) -> str:
    """What else a session that does not answer may mean, said after the client's sentence: a
    training on TCP refuses a client whose CURVE keys are not the ones it wrote in this
    connection file without a word back, as an address out of reach says nothing either."""
    from tensordbg.transport.connection import ConnectionFileError, read_connection_file

    try:
        info = read_connection_file(path)
    except ConnectionFileError:
        return ""
    if info.transport != "tcp":
        return ""
    return (f" Over TCP the same silence comes from a training that refuses this connection "
            f"file's client key (use the file this run of the training wrote: every run makes "
            f"new keys) and from an address out of reach ({info.endpoint}: is the tunnel or "
            f"the port open?).")  # fmt: skip


def exited(info: Any) -> str:
    """Why a session reached before cannot be reached again, if it has ended: its process is
    gone, or its connection file is (a session removes it as it ends: its training exited, or
    detached tensordbg and goes on unwatched)."""
    from tensordbg.transport.connection import is_live

    if info is None:
        return ""
    run = f"run {info.run_id} (pid {info.pid})"
    if not is_live(info):
        return f"the training of {run} has exited"
    if info.path is not None and not info.path.exists():
        return f"the session of {run} has ended: {ENDED}"
    return ""


async def wait_for_run(
    run_id: str, wait: float, poll: float = 0.1, alive: Callable[[], bool] | None = None
) -> str:
    """The connection file of ``run_id`` (rank 0 first), polling up to ``wait`` seconds; raises
    :class:`TrainingExited` as soon as ``alive()`` says the training's process is gone."""
    from tensordbg.transport.connection import find_sessions

    deadline = time.monotonic() + wait
    while True:
        mine = [s for s in find_sessions() if s.run_id == run_id]
        if mine:
            return str(min(mine, key=lambda s: s.rank).path)
        if alive is not None and not alive():
            raise TrainingExited(f"the training of run {run_id} has exited")
        if time.monotonic() >= deadline:
            raise TimeoutError(f"no session of run {run_id} appeared within {wait:g} s")
        await asyncio.sleep(poll)
