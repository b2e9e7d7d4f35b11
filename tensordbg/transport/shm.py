"""The same-host shortcut for large replies: a private shared-memory directory where the training
leaves an array as a file and the UI maps it.

Through the socket a reply's bytes are copied twice (into the kernel and out of it) and the
client allocates fresh memory for them; a file in memory costs one copy. In a reply to a client on
the same host (ipc), an array of SHM_MIN bytes or more is therefore not a frame: the server writes
it to a new file of its private directory (mode 0700; see
:func:`tensordbg.transport.connection.shared_memory_dir`) and the message names the file. The
client maps it read-only, unlinks it at once and checks the message's signature over the mapping
(see :mod:`tensordbg.transport.codec`); the array it gets views the mapping (no copy).

Signing a large array hashes it in TREE_CHUNK-byte chunks on all cores; the helpers here do it,
and :meth:`SharedMemory.put` hashes each chunk while the next one is written.

>>> shared = SharedMemory(shared_memory_dir())
>>> name, digests = shared.put(memoryview(array).cast("B"))
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import mmap
import os
import re
import secrets
import stat
import threading
import time
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tensordbg.transport.connection import process_exists

log = logging.getLogger("tensordbg.transport.shm")

SHM_MIN = 16 * 2**20
"""Arrays this large (bytes) in a reply to a client on the same host go through shared memory."""
SHM_MAX_AGE = 60.0
"""Seconds a shared-memory file waits for its client before the server removes it (a reply older
than the codec's REPLAY_WINDOW is refused anyway)."""
TREE_CHUNK = 4 * 2**20
"""Bytes of each chunk of a large array hashed on its own (see :func:`chunk_digests`)."""


@dataclass(frozen=True, slots=True)
class ChunkDigests:
    """An array's part of a signature when the SHA-256 digests of its TREE_CHUNK-byte chunks are
    already known (computed while it was copied into shared memory)."""

    nbytes: int
    digests: list[bytes]


class SharedMemory:
    """A private directory (mode 0700, checked by the caller: see
    :func:`tensordbg.transport.connection.shared_memory_dir`) where a server leaves a reply's
    large arrays for a client on the same host, one file per array, and where the client takes
    them.

    Server side: :meth:`put` writes a file (mode 0600, created exclusively, a random name) and
    remembers it; :meth:`sweep` removes those older than SHM_MAX_AGE (their client never came),
    :meth:`close` all of them. Client side: :meth:`take` maps one read-only and unlinks it.

    >>> shared = SharedMemory(Path("/dev/shm/tensordbg-1000"))
    >>> name, digests = shared.put(memoryview(array).cast("B"))    # in the training
    >>> np.frombuffer(SharedMemory(directory).take(name, array.nbytes), np.float32)   # in the UI
    """

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self._files: dict[str, float] = {}  # name -> when written (monotonic): the server's own
        self._lock = threading.Lock()
        self._closed = False
        self._failed = False

    def put(self, data: memoryview) -> tuple[str, ChunkDigests] | None:
        """Write ``data`` to a new file and return its name and the digests of its chunks; the
        copy and the hashing run in one pass (chunk k is hashed on one core while chunk k+1 is
        written on another). None when the file cannot be written (e.g. /dev/shm is full): send
        the array as a frame instead."""
        view = memoryview(data).cast("B")
        try:
            with self._lock:
                if self._closed:
                    return None
                name = f"{os.getpid()}-{secrets.token_hex(16)}{_SHARED_SUFFIX}"
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                fd = os.open(self.directory / name, flags, 0o600)
                self._files[name] = time.monotonic()
        except OSError as e:
            self._warn(e)
            return None
        try:
            digests = _write_and_digest(fd, view)
        except OSError as e:
            self.remove([name])
            self._warn(e)
            return None
        except BaseException:
            self.remove([name])
            raise
        finally:
            os.close(fd)
        return name, ChunkDigests(view.nbytes, digests)

    def take(self, name: str, nbytes: int) -> mmap.mmap:
        """Map the file ``name`` of this directory read-only and unlink it, so nothing is left
        behind whatever follows (the mapping stays valid). ValueError saying why for a name
        that is not a plain file name of this directory, or a file that is not what was said."""
        problem = _shared_name_problem(name)
        if problem:
            raise ValueError(problem)
        path = self.directory / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ValueError(
                f"shared-memory file {name} is gone: taken already, or removed by the training "
                f"after waiting {SHM_MAX_AGE:g} s for this client"
            ) from None
        except OSError as e:
            raise ValueError(f"cannot open shared-memory file {path}: {e}") from None
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
                raise ValueError(
                    f"shared-memory file {path} is not a private regular file of this user "
                    f"(mode {stat.S_IMODE(st.st_mode):o}, uid {st.st_uid}): refused"
                )
            if st.st_size != nbytes:
                raise ValueError(
                    f"shared-memory file {name} holds {st.st_size:,} bytes; the message says "
                    f"{nbytes:,}"
                )
            return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)

    def sweep(self, max_age: float = SHM_MAX_AGE) -> None:
        """Remove this side's files older than ``max_age`` seconds (taken ones are gone already)."""
        limit = time.monotonic() - max_age
        with self._lock:
            old = [name for name, written in self._files.items() if written <= limit]
        self.remove(old)

    def remove(self, names: Collection[str]) -> None:
        """Remove files this side wrote, whether or not their client took them."""
        for name in names:
            with self._lock:
                self._files.pop(name, None)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.directory / name)

    def remove_orphans(self) -> None:
        """Remove files left by processes that no longer run (a training that was killed)."""
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.directory):
                if _shared_name_problem(entry.name) is None:
                    pid = int(entry.name.split("-", 1)[0])
                    if pid != os.getpid() and not process_exists(pid):
                        with contextlib.suppress(OSError):
                            os.unlink(entry.path)

    def close(self) -> None:
        """Remove all of this side's files; later :meth:`put` calls return None."""
        with self._lock:
            self._closed = True
            names = list(self._files)
        self.remove(names)

    @property
    def files(self) -> list[str]:
        """Names of the files this side wrote and has not removed yet (its client may have)."""
        with self._lock:
            return list(self._files)

    def _warn(self, error: OSError) -> None:
        if not self._failed:  # once: a full /dev/shm stays full for a while
            self._failed = True
            log.warning(
                "tensordbg: cannot write large arrays to shared memory in %s (%s); they cross "
                "the socket instead",
                self.directory,
                error,
            )


_SHARED_SUFFIX = ".array"
_SHARED_NAME = re.compile(r"[1-9][0-9]{0,9}-[0-9a-f]{32}" + re.escape(_SHARED_SUFFIX))


def _shared_name_problem(name: Any) -> str | None:
    """Why ``name`` cannot be a shared-memory file of the directory, or None."""
    if not isinstance(name, str):
        return f"a shared-memory file name is a string, not {type(name).__name__}"
    if "/" in name or "\\" in name or "\0" in name or name.startswith(".."):
        return (
            f"shared-memory file {name!r} is a path, not a file name of the session's "
            "shared-memory directory: refused"
        )
    if not _SHARED_NAME.fullmatch(name):
        return f"{name!r} is not the name of a tensordbg shared-memory file: refused"
    return None


_hash_pool: ThreadPoolExecutor | None = None
_hash_pool_lock = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    """Threads for hashing, one per core (hashlib and os.pwrite release the GIL)."""
    global _hash_pool
    with _hash_pool_lock:
        if _hash_pool is None:
            _hash_pool = ThreadPoolExecutor(
                max_workers=max(1, os.cpu_count() or 1), thread_name_prefix="tensordbg-hash"
            )
    return _hash_pool


def _sha256(chunk: memoryview) -> bytes:
    return hashlib.sha256(chunk).digest()


def _hash(chunk: memoryview) -> Future[bytes]:
    """The chunk's SHA-256, on the pool; on this thread once the interpreter has shut the pool
    down (at exit, before the training's exit handlers stop the server, a last reply may still
    be signed)."""
    try:
        return _pool().submit(_sha256, chunk)
    except RuntimeError:  # "cannot schedule new futures after interpreter shutdown"
        done: Future[bytes] = Future()
        done.set_result(_sha256(chunk))
        return done


def chunk_digests(view: memoryview) -> list[bytes]:
    """SHA-256 of each TREE_CHUNK-byte chunk of ``view``, on all cores.

    >>> len(chunk_digests(memoryview(bytes(9 * 2**20))))
    3
    """
    hashing = [_hash(view[i : i + TREE_CHUNK]) for i in range(0, view.nbytes, TREE_CHUNK)]
    return [h.result() for h in hashing]  # all submitted first: the chunks hash in parallel


def _write_and_digest(fd: int, view: memoryview) -> list[bytes]:
    """Write ``view`` to the file ``fd`` chunk by chunk on this thread while the pool hashes
    each chunk just written (hot in the cache); returns the chunks' digests. Writes to one file
    are serialised by the kernel anyway, so one writer is as fast as several."""
    hashed = []
    for offset in range(0, view.nbytes, TREE_CHUNK):
        chunk = view[offset : offset + TREE_CHUNK]
        done = 0
        while done < chunk.nbytes:
            done += os.pwrite(fd, chunk[done:], offset + done)
        hashed.append(_hash(chunk))
    return [h.result() for h in hashed]
