"""Where sessions are found: the per-user runtime directory and one connection file per session.

A training serving a UI writes ``<run_id>-<rank>.json`` (mode 0600) into a directory only its user
can enter (mode 0700): the endpoint, the session's signing key, for tcp the CURVE keys, for ipc the
directory its large replies wait in. Holding the file is what lets a UI in; nothing else does. The
directory is ``$TENSORDBG_RUNTIME_DIR`` when set, else ``$XDG_RUNTIME_DIR/tensordbg`` when that
belongs to the user, else ``/tmp/tensordbg-<uid>``.

>>> [s.name for s in find_sessions()]
['run7f3a-0']
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tensordbg.transport.wire import PROTOCOL_VERSION

RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_FILE_LIMIT = 64 * 1024  # a connection file is a few hundred bytes


class ConnectionFileError(Exception):
    """The runtime directory or a connection file cannot be used; the message says why and what
    to do.

    >>> raise ConnectionFileError("/tmp/tensordbg-1000 belongs to uid 0, not to you (uid 1000)")
    """


@dataclass(frozen=True)
class ConnectionInfo:
    """The contents of a connection file: how to reach one session and prove you may.

    >>> info = read_connection_file("/run/user/1000/tensordbg/run7f3a-0.json")
    >>> info.endpoint
    'ipc:///run/user/1000/tensordbg/run7f3a-0.sock'
    """

    run_id: str
    rank: int
    pid: int
    host: str
    script: str
    started: float
    endpoint: str
    transport: str  # "ipc" or "tcp"
    key: str = field(repr=False)  # hex of the 32-byte signing key; kept out of logs
    protocol: int = PROTOCOL_VERSION
    # tcp only: CURVE keys (z85). The client's secret key is here because the file is the client's
    # credential, as readable as the signing key: by this user only.
    server_public_key: str | None = None
    client_public_key: str | None = None
    client_secret_key: str | None = field(default=None, repr=False)
    # ipc only: the private directory where large replies wait for the client (shared memory).
    shm_dir: str | None = None
    path: Path | None = field(default=None, compare=False)

    @property
    def name(self) -> str:
        """``<run_id>-<rank>``: the session's identity, also its file's name."""
        return f"{self.run_id}-{self.rank}"

    @property
    def key_bytes(self) -> bytes:
        return bytes.fromhex(self.key)

    def describe(self) -> str:
        """One line for a person choosing among sessions."""
        return f"{self.name}  pid {self.pid} on {self.host}  {self.script or '?'}  ({self.path})"

    def to_json(self) -> str:
        fields = asdict(self)
        del fields["path"]
        return json.dumps(fields, indent=1)


def check_run_id(run_id: str) -> str:
    """Refuse a run id that could not be a file name (it names the connection and socket files).

    >>> check_run_id("run7f3a")
    'run7f3a'
    """
    if not isinstance(run_id, str) or not RUN_ID_PATTERN.fullmatch(run_id):
        raise ValueError(
            f"run id {run_id!r} must be 1-64 letters, digits, '_', '.' or '-', starting with a "
            "letter or digit"
        )
    return run_id


def runtime_dir(directory: str | os.PathLike[str] | None = None, *, create: bool = True) -> Path:
    """The user's tensordbg directory, created 0700 if missing; refused if anyone else could
    enter it.

    >>> runtime_dir()
    PosixPath('/run/user/1000/tensordbg')
    """
    path = Path(directory) if directory is not None else default_runtime_dir()
    if create:
        try:
            path.mkdir(mode=0o700)
            os.chmod(path, 0o700)  # mkdir's mode is filtered by the umask
        except FileExistsError:
            pass
        except OSError as e:
            raise ConnectionFileError(
                f"cannot create tensordbg's runtime directory {path}: {e}"
            ) from None
    _check_private_dir(path)
    return path


def write_connection_file(info: ConnectionInfo, directory: Path) -> Path:
    """Write ``<run_id>-<rank>.json`` with mode 0600 from the start (never readable by others,
    not even for a moment). A file left by a dead session of the same name is replaced; one of a
    live session is refused.

    >>> write_connection_file(info, runtime_dir())
    PosixPath('/run/user/1000/tensordbg/run7f3a-0.json')
    """
    path = directory / f"{info.name}.json"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    for _attempt in range(2):
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError:
            claim_session_name(directory, info.run_id, info.rank)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(info.to_json())
        return path
    raise ConnectionFileError(f"cannot create {path}: another process keeps creating it")


def claim_session_name(directory: Path, run_id: str, rank: int) -> None:
    """Make sure no live session of this name is in ``directory`` (before binding its socket,
    which would take the socket path from the live one); a dead one's files are removed.

    >>> claim_session_name(runtime_dir(), "run7f3a", 0)
    """
    path = directory / f"{run_id}-{rank}.json"
    try:
        other = read_connection_file(path)
    except ConnectionFileError:
        if path.exists() or path.is_symlink():
            path.unlink()
        return
    if is_live(other) and other.pid != os.getpid():
        raise ConnectionFileError(
            f"a session named {other.name} is already running (pid {other.pid}, {path}): give "
            "this run another run id or rank"
        )
    remove_session_files(other)


def read_connection_file(path: str | os.PathLike[str]) -> ConnectionInfo:
    """The session described by a connection file; ConnectionFileError if it is not one.

    >>> read_connection_file("run7f3a-0.json").endpoint
    'ipc:///run/user/1000/tensordbg/run7f3a-0.sock'
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(_FILE_LIMIT + 1)
        if len(raw) > _FILE_LIMIT:  # read whole, it would fail as cut JSON: say what it is
            raise ConnectionFileError(
                f"{path} is not a tensordbg connection file (one is a few "
                f"hundred bytes; this is more than {_FILE_LIMIT:,})"
            )
        data = json.loads(raw)
    except (OSError, ValueError) as e:
        raise ConnectionFileError(
            f"cannot read connection file {path}: {e}: pass the .json file a training wrote"
        ) from None
    if not isinstance(data, dict) or "protocol" not in data or "endpoint" not in data:
        raise ConnectionFileError(f"{path} is not a tensordbg connection file")
    if data.get("protocol") != PROTOCOL_VERSION:
        raise ConnectionFileError(
            f"{path} was written for tensordbg protocol version {data.get('protocol')!r}; this "
            f"tensordbg speaks version {PROTOCOL_VERSION}: use the same version on both sides"
        )
    expected = {
        "run_id": str,
        "rank": int,
        "pid": int,
        "host": str,
        "script": str,
        "started": (int, float),
        "endpoint": str,
        "transport": str,
        "key": str,
    }
    for name, kind in expected.items():
        if not isinstance(data.get(name), kind) or isinstance(data.get(name), bool):
            raise ConnectionFileError(f"{path} is not a tensordbg connection file: bad {name!r}")
    try:
        key = bytes.fromhex(data["key"])
    except ValueError:
        key = b""
    if len(key) < 16:
        raise ConnectionFileError(f"{path} holds no valid session key")
    if data["transport"] not in ("ipc", "tcp"):
        raise ConnectionFileError(f"{path} names unknown transport {data['transport']!r}")
    curve = ("server_public_key", "client_public_key", "client_secret_key")
    if data["transport"] == "tcp" and not all(isinstance(data.get(k), str) for k in curve):
        raise ConnectionFileError(f"{path} is a tcp session without its CURVE keys")
    if not isinstance(data.get("shm_dir"), (str, type(None))):
        raise ConnectionFileError(f"{path} is not a tensordbg connection file: bad 'shm_dir'")
    if data["transport"] == "tcp":
        data["shm_dir"] = None  # a remote session never shares memory
    known = {f for f in ConnectionInfo.__dataclass_fields__ if f != "path"}
    fields: dict[str, Any] = {k: v for k, v in data.items() if k in known}
    return ConnectionInfo(**fields, path=path)


def find_sessions(directory: str | os.PathLike[str] | None = None) -> list[ConnectionInfo]:
    """The live sessions of this user, newest first. A file whose process is gone is stale: it is
    skipped, and removed (with its socket) when this user owns it.

    >>> [s.name for s in find_sessions()]
    ['run7f3a-0', 'run51c2-0']
    """
    path = Path(directory) if directory is not None else default_runtime_dir()
    if not path.exists():
        return []
    path = runtime_dir(path, create=False)
    live = []
    for file in path.glob("*.json"):
        try:
            info = read_connection_file(file)
        except ConnectionFileError:
            continue
        if is_live(info):
            live.append(info)
        else:
            remove_session_files(info)
    live.sort(key=lambda s: s.started, reverse=True)
    return live


def remove_session_files(info: ConnectionInfo) -> None:
    """Remove a session's connection file and ipc socket, if this user owns them."""
    paths = [info.path] if info.path is not None else []
    if info.path is not None and info.transport == "ipc":
        # Only the socket named after the file: a file cannot make us remove anything else.
        socket_path = info.path.with_suffix(".sock")
        if info.endpoint == f"ipc://{socket_path}":
            paths.append(socket_path)
    for path in paths:
        try:
            if os.lstat(path).st_uid == os.getuid():
                path.unlink()
        except OSError:
            pass


def shared_memory_dir(directory: str | os.PathLike[str] | None = None) -> Path:
    """Where a session's large replies wait for their client, created 0700 and checked like
    :func:`runtime_dir`: ``directory`` when given, else ``/dev/shm/tensordbg-<uid>`` (memory,
    never disk). ConnectionFileError when it cannot be used; /dev/shm missing or read-only is
    one such case (a server then uses its runtime directory).

    >>> shared_memory_dir()
    PosixPath('/dev/shm/tensordbg-1000')
    """
    if directory is not None:
        return runtime_dir(directory)
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK | os.X_OK)):
        raise ConnectionFileError(f"{shm} is missing or not writable")
    return runtime_dir(shm / f"tensordbg-{os.getuid()}")


def default_runtime_dir() -> Path:
    """Where this user's sessions live, without creating or checking it.

    >>> default_runtime_dir()
    PosixPath('/run/user/1000/tensordbg')
    """
    override = os.environ.get("TENSORDBG_RUNTIME_DIR")
    if override:
        return Path(override)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        try:
            st = os.stat(xdg)
            if st.st_uid == os.getuid() and stat.S_ISDIR(st.st_mode):
                return Path(xdg) / "tensordbg"
        except OSError:
            pass
    return Path(tempfile.gettempdir()) / f"tensordbg-{os.getuid()}"


def process_exists(pid: int) -> bool:
    """Whether a process ``pid`` runs on this host (another user's counts: it cannot be checked
    further, and its files are not ours to remove).

    >>> process_exists(os.getpid())
    True
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: someone else's process
        return True
    return True


def _check_private_dir(path: Path) -> None:
    try:
        st = os.lstat(path)  # lstat: a symlink planted in /tmp must not redirect us
    except OSError as e:
        raise ConnectionFileError(f"cannot use tensordbg's runtime directory {path}: {e}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConnectionFileError(
            f"{path} should be tensordbg's private directory but is not a directory (a link?): "
            "remove it, or set TENSORDBG_RUNTIME_DIR to a directory of your own"
        )
    if st.st_uid != os.getuid():
        raise ConnectionFileError(
            f"{path} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}): someone else "
            "created it; remove it, or set TENSORDBG_RUNTIME_DIR to a directory of your own"
        )
    if st.st_mode & 0o077:
        raise ConnectionFileError(
            f"{path} has mode {stat.S_IMODE(st.st_mode):o}: other users could reach its sessions; "
            f"run `chmod 700 {path}`"
        )


def is_live(info: ConnectionInfo) -> bool:
    """Whether the session's process still runs; a session on another host cannot be checked
    from here and counts as live."""
    return info.host != socket.gethostname() or process_exists(info.pid)
