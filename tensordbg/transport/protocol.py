"""The wire protocol between a training process and a UI: message types, dtype table, limits.

Both sides import this module; it never imports torch. A message is a list of ZeroMQ frames: a
small msgpack header, then raw tensor bytes, one frame per array; on the same host, a large array
of a reply waits in a shared-memory file instead of a frame. (Framing, signing, shared memory and
decoding follow below the data definitions.)
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import hmac
import logging
import math
import mmap
import os
import re
import secrets
import stat
import threading
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgpack
import numpy as np

from tensordbg.sources.contract import METHODS, Source, dispatch

log = logging.getLogger("tensordbg.transport.protocol")

PROTOCOL_VERSION = 2

# Requests a UI sends: the methods of tensordbg.sources.contract.Source (see there for payloads), plus the
# protocol's own greeting and liveness messages.
REQUESTS = ("hello", "ping", *METHODS)
# What the training process sends: replies to requests, and events it pushes unasked.
REPLY = "reply"
ERROR = "error"
PONG = "pong"
EVENTS = ("status", "hit", "state", "log")

# Limits. A client's request is small; anything larger is hostile or broken and is refused.
MAX_REQUEST_HEADER = 64 * 1024
MAX_REQUEST_FRAMES = 2  # signature and header: no request carries arrays
# Replies come from an authenticated training process and can be large (a whole tensor).
MAX_REPLY_HEADER = 64 * 2**20
MAX_REPLY_BYTES = 2 * 2**30
# Arrays above this size cross the socket without a copy (zero-copy pays off above ~64 KiB).
ZERO_COPY_MIN = 64 * 1024


@dataclass(frozen=True, slots=True)
class DType:
    """How one tensor dtype crosses the wire: the numpy type of its raw words."""

    name: str  # torch's name, e.g. "bfloat16"
    storage: str  # numpy dtype of the words on the wire, e.g. "<u2"


# numpy has no bfloat16 or fp8: they travel as raw words tagged with their dtype name.
DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("float64", "<f8"),
        DType("float32", "<f4"),
        DType("float16", "<f2"),
        DType("bfloat16", "<u2"),
        DType("float8_e4m3fn", "|u1"),
        DType("float8_e4m3fnuz", "|u1"),
        DType("float8_e5m2", "|u1"),
        DType("float8_e5m2fnuz", "|u1"),
        DType("int64", "<i8"),
        DType("int32", "<i4"),
        DType("int16", "<i2"),
        DType("int8", "|i1"),
        DType("uint8", "|u1"),
        DType("bool", "|b1"),
    )
}


@dataclass(slots=True)
class WireArray:
    """Tensor data as it crosses the wire: C-order raw words plus the dtype they encode.

    ``data`` is a numpy array of ``DTYPES[dtype].storage`` words (uint16 for bfloat16);
    :meth:`to_numpy` gives the values, bfloat16 and fp8 widened to float32.
    """

    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray

    def to_numpy(self) -> np.ndarray:
        return decode_words(self.dtype, self.data).reshape(self.shape)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


def decode_words(dtype: str, words: np.ndarray) -> np.ndarray:
    """Values of raw words of ``dtype``: bfloat16 and fp8 become float32, the rest as they are."""
    if dtype == "bfloat16":
        return (words.astype(np.uint32) << 16).view(np.float32)
    if dtype.startswith("float8"):
        return _fp8_table(dtype)[words]
    return words


_FP8_TABLES: dict[str, np.ndarray] = {}


def _fp8_table(dtype: str) -> np.ndarray:
    """float32 value of each of the 256 bytes of an fp8 format (OCP e4m3fn/e5m2, and the 'fnuz'
    variants with one NaN at 0x80, no -0 and no Inf)."""
    if dtype in _FP8_TABLES:
        return _FP8_TABLES[dtype]
    exp_bits, bias = {
        "float8_e4m3fn": (4, 7),
        "float8_e4m3fnuz": (4, 8),
        "float8_e5m2": (5, 15),
        "float8_e5m2fnuz": (5, 16),
    }[dtype]
    man_bits = 7 - exp_bits
    table = np.empty(256, dtype=np.float32)
    for byte in range(256):
        sign = -1.0 if byte & 0x80 else 1.0
        exp = (byte >> man_bits) & ((1 << exp_bits) - 1)
        man = byte & ((1 << man_bits) - 1)
        if exp == 0:
            value = sign * man / (1 << man_bits) * 2.0 ** (1 - bias)
        else:
            value = sign * (1 + man / (1 << man_bits)) * 2.0 ** (exp - bias)
        table[byte] = value
    if dtype == "float8_e4m3fn":
        table[0x7F] = table[0xFF] = np.nan
    elif dtype == "float8_e5m2":
        for byte in range(256):
            exp = (byte >> 2) & 0x1F
            if exp == 0x1F:
                man = byte & 0x3
                table[byte] = np.nan if man else (-np.inf if byte & 0x80 else np.inf)
    else:  # fnuz: 0x80 is the only NaN
        table[0x80] = np.nan
    _FP8_TABLES[dtype] = table
    return table


# --- Framing, signing and decoding --------------------------------------------------------------
#
# A message is a list of ZeroMQ frames (a ROUTER puts the peer's identity in front):
#
#     [signature, header, array frame 0, array frame 1, ...]
#
# header    msgpack map {"v", "type", "id", "ts", "nonce", "session", "body"}; ``body`` is the
#           payload (request parameters, a reply's result, an event's payload). A WireArray at the
#           top level of a body dict leaves the header as {"__array__": i, "dtype", "shape"} and
#           travels as raw frame i.
# signature hex HMAC-SHA256, with the session's key, over the sender's side ("server" or
#           "client"), the header bytes and then each array in order, each part after its
#           length in ASCII digits and a colon (Jupyter signs only the header; a tensor is data
#           a person acts on, so it is signed too). An array above TREE_HASH_MIN enters the HMAC
#           as "tree<length>:" followed by the SHA-256 digests of its TREE_CHUNK-byte chunks,
#           computed on all cores: a keyed hash over collision-resistant digests authenticates
#           the bytes just the same, and one core alone would hash a 256 MiB tensor slower than
#           the socket moves it. A signature seen before within REPLAY_WINDOW, or a timestamp
#           further than REPLAY_WINDOW from this side's clock, is a replay and is refused.
# shared    in a reply to a client on the same host (ipc), an array of SHM_MIN bytes or more is
#           not a frame: the server writes it to a new file of its private shared-memory
#           directory (see :class:`SharedMemory`) and its descriptor names the file:
#           {"__array__": i, "dtype", "shape", "shm": file name, "nbytes"}. Array i is signed
#           exactly as if it were a frame; the frames on the wire are the other arrays, in order.
#           The client maps the file read-only, unlinks it at once and checks the signature over
#           the mapping; the array it gets views the mapping (no copy). Through the socket the
#           bytes are copied twice (into the kernel and out of it) and the client allocates fresh
#           memory for them; a file in memory costs one copy.

TREE_HASH_MIN = 16 * 2**20
TREE_CHUNK = 4 * 2**20
SHM_MIN = 16 * 2**20
"""Arrays this large (bytes) in a reply to a client on the same host go through shared memory."""
SHM_MAX_AGE = 60.0
"""Seconds a shared-memory file waits for its client before the server removes it (a reply older
than REPLAY_WINDOW is refused anyway)."""
SHM_KEY = "shm"
REPLAY_WINDOW = 60.0
"""Seconds a message stays acceptable; also the largest clock difference between two hosts."""
MAX_REPLY_ARRAYS = 64
MAX_BODY_DEPTH = 32  # nesting of a request's body; real requests nest three levels at most
ARRAY_KEY = "__array__"
_SIGNATURE_LENGTH = 64  # hex digits of a SHA-256 HMAC
_ENVELOPE_TEXT_MAX = 128  # type, nonce and session are short identifiers
_PLAIN_TYPES = (type(None), bool, int, float, str, bytes)

Buffer = bytes | bytearray | memoryview  # or anything with the buffer protocol, e.g. zmq.Frame


class ProtocolError(Exception):
    """A message refused by :meth:`MessageCodec.decode`; the text says which check failed.

    ``authenticated`` is True when the sender proved it holds the session's key (so it may be told
    exactly what was wrong); ``public`` when the reason tells a stranger nothing worth hiding (a
    protocol version); ``id`` is the request id when it could be read.

    >>> raise ProtocolError("header is 70000 bytes; at most 65536 are accepted")
    """

    def __init__(
        self,
        message: str,
        *,
        authenticated: bool = False,
        public: bool = False,
        id: int | None = None,
    ):
        super().__init__(message)
        self.authenticated = authenticated
        self.public = public
        self.id = id


@dataclass(slots=True)
class Message:
    """One decoded, verified message.

    >>> Message(type="slice", body={"ref": 3, "text": "[0]"}, id=7, session="9f2c...", ts=1.7e9)
    """

    type: str
    body: Any
    id: int | None
    session: str
    ts: float


class ReplayGuard:
    """Remembers the signatures accepted within the replay window; thread-safe.

    >>> guard = ReplayGuard(60.0)
    >>> guard.refusal(b"ab12...", ts=time.time())   # None: first time seen, now remembered
    """

    def __init__(self, window: float = REPLAY_WINDOW):
        self.window = window
        self._seen: set[bytes] = set()
        self._expiry: list[tuple[float, bytes]] = []  # heap of (time to forget, signature)
        self._lock = threading.Lock()

    def refusal(self, signature: bytes, ts: float, now: float | None = None) -> str | None:
        """Why a message signed ``signature`` at ``ts`` is a replay, or None (and remember it)."""
        now = time.time() if now is None else now
        if not abs(now - ts) <= self.window:  # also catches NaN
            return (
                f"message timestamp is {now - ts:+.1f} s from this clock, outside ±"
                f"{self.window:g} s: a replayed message, or the two hosts' clocks disagree"
            )
        with self._lock:
            while self._expiry and self._expiry[0][0] < now:
                self._seen.discard(heapq.heappop(self._expiry)[1])
            if signature in self._seen:
                return "message was already received once (a replay): refused"
            self._seen.add(signature)
            heapq.heappush(self._expiry, (ts + self.window, signature))
        return None


class MessageCodec:
    """Turns bodies into signed frame lists and back, for one side of one session.

    ``side="server"`` accepts small requests (MAX_REQUEST_HEADER, MAX_REQUEST_FRAMES, plain values
    only) and may send large replies; ``side="client"`` the reverse. Both sides share the key. A
    client on the server's host passes ``shared``, the directory the connection file names, to
    accept arrays in shared memory; any other codec refuses them.

    >>> server, client = MessageCodec(key, side="server"), MessageCodec(key, side="client")
    >>> frames = client.encode("slice", {"ref": 3, "text": "[0, :8]"}, id=1)
    >>> server.decode(frames).body
    {'ref': 3, 'text': '[0, :8]'}
    """

    def __init__(
        self,
        key: bytes,
        *,
        side: Literal["server", "client"],
        replay: ReplayGuard | None = None,
        session: str | None = None,
        shared: SharedMemory | None = None,
    ):
        if len(key) < 16:
            raise ValueError("a session key has at least 16 bytes")
        if shared is not None and side != "client":
            raise ValueError("only a client takes arrays out of shared memory")
        self._key = key
        self.side = side
        self.shared = shared
        self.session = session or secrets.token_hex(8)
        self.replay = replay or ReplayGuard()
        if side == "server":
            self.max_in_header, self.max_out_header = MAX_REQUEST_HEADER, MAX_REPLY_HEADER
            self.max_in_frames = MAX_REQUEST_FRAMES
            self.untrusted_input = True
        elif side == "client":
            self.max_in_header, self.max_out_header = MAX_REPLY_HEADER, MAX_REQUEST_HEADER
            self.max_in_frames = 2 + MAX_REPLY_ARRAYS
            self.untrusted_input = False
        else:
            raise ValueError(f"side is 'server' or 'client', not {side!r}")

    @property
    def peer(self) -> Literal["server", "client"]:
        """The side this codec receives from."""
        return "client" if self.side == "server" else "server"

    def sign(
        self,
        header: Buffer,
        arrays: Sequence[Buffer | ChunkDigests],
        sender: Literal["server", "client"] | None = None,
    ) -> bytes:
        """Hex HMAC-SHA256 over the sending side, the header and each array, fed in order
        without copying; a large array by the digests of its chunks, hashed in parallel (see
        TREE_HASH_MIN), or already known (:class:`ChunkDigests`). ``sender`` is this side
        unless checking the other side's message."""
        header = memoryview(header).cast("B")
        # The sender's side first: a message cannot be sent back to the side that signed it.
        # Each part enters after its length, so moving bytes from one frame to the next makes
        # another signature (the parts' own checks would refuse it too; this refuses it first).
        start = b"%s %d:" % ((sender or self.side).encode("ascii"), header.nbytes)
        mac = hmac.new(self._key, start, "sha256")
        mac.update(header)
        for array in arrays:
            if isinstance(array, ChunkDigests):
                mac.update(b"tree%d:" % array.nbytes)
                mac.update(b"".join(array.digests))
                continue
            view = memoryview(array).cast("B")
            if view.nbytes < TREE_HASH_MIN:
                mac.update(b"%d:" % view.nbytes)
                mac.update(view)
            else:
                mac.update(b"tree%d:" % view.nbytes)
                mac.update(b"".join(_chunk_digests(view)))
        return mac.hexdigest().encode("ascii")

    def encode(
        self,
        type: str,
        body: Any = None,
        *,
        id: int | None = None,
        shared: SharedMemory | None = None,
        snapshot: bool = False,
    ) -> list[Buffer]:
        """Frames of one message. Large array frames are the arrays' own memory (send them with
        ``copy=False``; see :func:`configure_socket`). Raises ValueError or TypeError for a body
        that cannot cross the wire (a bug of the sender, never of the peer).

        ``shared``: arrays of SHM_MIN bytes and more are written there instead of framed (a
        reply to a client on this host; when the directory is full they are framed after all).
        ``snapshot``: the message must not change when the body's arrays do once this returns
        (they may view a live training's tensors, which change when it resumes while the frames
        still wait for the socket): every array is copied, or written to shared memory, and what
        is signed is the copy."""
        body, arrays = split_arrays(body)
        signed: list[Buffer | ChunkDigests] = list(arrays)
        frames: list[Buffer] = []
        placed: list[str] = []
        descriptors = {
            v[ARRAY_KEY]: v
            for v in (body.values() if arrays else ())
            if isinstance(v, dict) and ARRAY_KEY in v
        }
        try:
            for index, array in enumerate(arrays):
                if shared is not None and array.nbytes >= SHM_MIN:
                    written = shared.put(array)
                    if written is not None:
                        name, signed[index] = written
                        descriptors[index].update({SHM_KEY: name, "nbytes": array.nbytes})
                        placed.append(name)
                        continue
                if snapshot:
                    # numpy copies without holding the GIL, unlike bytes(array)
                    signed[index] = array = memoryview(np.array(array, dtype=np.uint8))
                frames.append(array)
            header = pack(
                {
                    "v": PROTOCOL_VERSION,
                    "type": type,
                    "id": id,
                    "ts": time.time(),
                    "nonce": secrets.token_hex(8),
                    "session": self.session,
                    "body": body,
                }
            )
            if len(header) > self.max_out_header:
                raise ValueError(
                    f"{type} message header is {len(header):,} bytes; the other side accepts at "
                    f"most {self.max_out_header:,}"
                )
        except BaseException:
            if shared is not None:
                shared.remove(placed)
            raise
        return [self.sign(header, signed), header, *frames]

    def incoming_bytes(self, frames: Sequence[Buffer]) -> int:
        """Bytes that checking this message will hash: its frames, and the shared-memory arrays
        its header names. The header is read without being trusted; this only decides where the
        receiver does the work (a large message off an event loop)."""
        total = sum(memoryview(f).nbytes for f in frames)
        if self.shared is None or len(frames) < 2 or not _NAMES_SHARED.search(frames[1]):
            return total  # most messages: no second reading of the header
        try:
            fields = unpack(frames[1])
        except ValueError:
            return total
        body = fields.get("body") if isinstance(fields, dict) else None
        for value in body.values() if isinstance(body, dict) else ():
            if isinstance(value, dict) and isinstance(value.get("nbytes"), int):
                total += value["nbytes"]
        return total

    def decode(self, frames: Sequence[Buffer]) -> Message:
        """Check and decode one message; raises :class:`ProtocolError` saying what was wrong."""
        if len(frames) < 2:
            raise ProtocolError(
                f"a message is [signature, header, arrays...]; got {len(frames)} frame(s)"
            )
        if len(frames) > self.max_in_frames:
            raise ProtocolError(
                f"a message has at most {self.max_in_frames} frames here; got {len(frames)}"
            )
        signature, header, *wire = (memoryview(f) for f in frames)
        if header.nbytes > self.max_in_header:
            raise ProtocolError(
                f"message header is {header.nbytes:,} bytes; at most {self.max_in_header:,} are "
                "accepted"
            )
        total = sum(a.nbytes for a in wire)
        if total > MAX_REPLY_BYTES:
            raise ProtocolError(
                f"message carries {total:,} bytes of arrays; at most {MAX_REPLY_BYTES:,}"
            )
        try:
            fields, unreadable = unpack(header), None
        except ValueError as e:
            fields, unreadable = None, str(e)
        arrays, shared = self._take_shared(fields, wire)
        # A signature of the wrong length cannot match: the frames are not hashed (a stranger
        # could otherwise make this side hash megabytes per message); it is refused below.
        authenticated = signature.nbytes == _SIGNATURE_LENGTH and hmac.compare_digest(
            bytes(signature), self.sign(header, arrays, sender=self.peer)
        )
        if unreadable is not None:
            raise ProtocolError(
                f"message header is not valid msgpack: {unreadable}",
                authenticated=authenticated,
                id=peek_id(header) if authenticated else None,
            )
        if not isinstance(fields, dict):
            raise ProtocolError("message header is not a map", authenticated=authenticated)
        version = fields.get("v")
        if version != PROTOCOL_VERSION:
            # Checked before the signature: a newer peer may sign differently, and its person
            # should learn about the version, not about a key.
            raise ProtocolError(
                f"the other side speaks tensordbg protocol version {version!r}, this side speaks "
                f"version {PROTOCOL_VERSION}: use the same tensordbg version on both sides",
                authenticated=authenticated,
                public=True,
            )
        if signature.nbytes != _SIGNATURE_LENGTH:
            raise ProtocolError("message signature is missing or malformed")
        if not authenticated:
            raise ProtocolError(
                "message signature does not match: the sender does not hold this session's key"
            )
        ts = fields.get("ts")
        if not (_is_int(ts) or isinstance(ts, float)):
            raise ProtocolError("message timestamp 'ts' is missing or not a number")
        replay = self.replay.refusal(bytes(signature), float(ts))
        if replay:
            raise ProtocolError(replay)
        return self._message(fields, arrays, shared)

    def _take_shared(self, fields: Any, wire: list[memoryview]) -> tuple[list[Buffer], set[int]]:
        """The message's arrays in order, and which of them came out of shared memory: the
        frames, and (for a client on the server's host) the files the header names, mapped
        read-only and already unlinked. The header is read before it is authenticated, to find
        them; it can name nothing but a file of the shared directory, and the signature then
        covers the files' bytes."""
        if self.shared is None:
            return list(wire), set()
        body = fields.get("body") if isinstance(fields, dict) else None
        placed: dict[int, tuple[str, int]] = {}
        for name, value in body.items() if isinstance(body, dict) else ():
            if not isinstance(value, dict) or SHM_KEY not in value:
                continue
            index, file, nbytes = (value.get(k) for k in (ARRAY_KEY, SHM_KEY, "nbytes"))
            if not _is_int(index) or not _is_int(nbytes) or not 0 < nbytes <= MAX_REPLY_BYTES:
                raise ProtocolError(
                    f"array {name!r} in shared memory has a malformed descriptor (index "
                    f"{index!r}, nbytes {nbytes!r})"
                )
            if index in placed:
                raise ProtocolError(f"array {name!r} names array {index} a second time")
            placed[index] = (file, nbytes)
        count = len(wire) + len(placed)
        if any(not 0 <= index < count for index in placed):
            raise ProtocolError(
                f"the message's shared-memory arrays are numbered {sorted(placed)}; it has "
                f"{count} arrays"
            )
        total = sum(a.nbytes for a in wire) + sum(n for _, n in placed.values())
        if total > MAX_REPLY_BYTES:
            raise ProtocolError(
                f"message carries {total:,} bytes of arrays; at most {MAX_REPLY_BYTES:,}"
            )
        mapped = {}
        for index, (file, nbytes) in placed.items():
            try:
                mapped[index] = self.shared.take(file, nbytes)
            except ValueError as e:
                raise ProtocolError(str(e)) from None
        frames = iter(wire)
        arrays = [mapped[i] if i in mapped else next(frames) for i in range(count)]
        return arrays, set(mapped)

    def _message(
        self, fields: dict[str, Any], arrays: list[Buffer], shared: Collection[int]
    ) -> Message:
        """The Message of an authenticated header; refusals here may be told to the sender."""
        id = fields.get("id")
        if id is not None and not _is_int(id):
            raise ProtocolError(
                f"message id must be an integer or nil, not {id!r}", authenticated=True
            )
        id_ = id

        def refuse(why: str) -> ProtocolError:
            return ProtocolError(why, authenticated=True, id=id_)

        for name in ("type", "nonce", "session"):
            value = fields.get(name)
            if not isinstance(value, str) or not 0 < len(value) <= _ENVELOPE_TEXT_MAX:
                raise refuse(f"message field {name!r} must be a short non-empty string")
        body = fields.get("body")
        if self.untrusted_input:
            problem = _not_plain(body)
            if problem:
                raise refuse(problem)
        body = restore_arrays(body, arrays, refuse, shared)
        return Message(fields["type"], body, id, fields["session"], float(fields["ts"]))


@dataclass(frozen=True, slots=True)
class ChunkDigests:
    """An array's part of a signature when the SHA-256 digests of its TREE_CHUNK-byte chunks are
    already known (computed while it was copied into shared memory)."""

    nbytes: int
    digests: list[bytes]


class SharedMemory:
    """A private directory (mode 0700, checked by the caller: see
    :func:`tensordbg.transport.connection.shared_memory_dir`) where a server leaves a reply's large arrays
    for a client on the same host, one file per array, and where the client takes them.

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


_NAMES_SHARED = re.compile(re.escape(msgpack.packb(SHM_KEY)))  # the key as msgpack writes it
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


def _chunk_digests(view: memoryview) -> list[bytes]:
    """SHA-256 of each TREE_CHUNK-byte chunk, on all cores."""
    chunks = [view[i : i + TREE_CHUNK] for i in range(0, view.nbytes, TREE_CHUNK)]
    return list(_pool().map(_sha256, chunks))


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
        hashed.append(_pool().submit(_sha256, chunk))
    return [h.result() for h in hashed]


def pack(value: Any) -> bytes:
    """msgpack bytes of plain data; numpy scalars become Python numbers, anything else is a
    TypeError (never pickle, never an ext type)."""
    return msgpack.packb(value, use_bin_type=True, default=_plain_default, datetime=False)


def unpack(data: Buffer) -> Any:
    """Plain data of msgpack bytes; ValueError for anything malformed or for an ext type."""
    try:
        return msgpack.unpackb(
            data, raw=False, strict_map_key=True, ext_hook=_refuse_ext, timestamp=0
        )
    except Exception as e:  # msgpack's own errors say little on their own: name them
        problem = {
            "StackError": "nested too deeply",
            "ExtraData": "extra bytes after the header",
            "FormatError": "a byte that starts no msgpack value",
        }.get(type(e).__name__, str(e) or type(e).__name__)
        raise ValueError(problem) from None


def split_arrays(body: Any) -> tuple[Any, list[memoryview]]:
    """The body with its top-level WireArrays replaced by descriptors, and their byte frames.

    >>> split_arrays({"data": WireArray("bfloat16", (2,), np.zeros(2, np.uint16))})
    ({'data': {'__array__': 0, 'dtype': 'bfloat16', 'shape': [2]}}, [<memory ...>])
    """
    if not isinstance(body, dict) or not any(isinstance(v, WireArray) for v in body.values()):
        return body, []
    out: dict[str, Any] = {}
    frames: list[memoryview] = []
    for name, value in body.items():
        if isinstance(value, WireArray):
            out[name] = {ARRAY_KEY: len(frames), "dtype": value.dtype, "shape": list(value.shape)}
            frames.append(_array_bytes(value))
        else:
            out[name] = value
    return out, frames


def restore_arrays(
    body: Any,
    frames: Sequence[Buffer],
    refuse: Callable[[str], Exception] = ValueError,
    shared: Collection[int] = (),
) -> Any:
    """Inverse of :func:`split_arrays`: descriptors become WireArrays viewing ``frames`` (no copy).
    Every frame must be named exactly once, with the size its dtype and shape imply; the arrays
    numbered in ``shared`` came out of shared memory, and only their descriptors may say so."""
    if not isinstance(body, dict):
        if frames:
            raise refuse(f"message has {len(frames)} array frame(s) but its body names none")
        return body
    used: set[int] = set()
    out = {}
    for name, value in body.items():
        if isinstance(value, dict) and ARRAY_KEY in value:
            value = _wire_array(name, value, frames, used, refuse, shared)
        out[name] = value
    if len(used) != len(frames):
        raise refuse(f"message has {len(frames)} array frame(s) but its body names {len(used)}")
    return out


def roundtrip(body: Any) -> Any:
    """``body`` as the other side of a socket would see it (lists for tuples, Python numbers for
    numpy scalars, WireArrays kept), without a socket: for in-process clients.

    >>> roundtrip({"shape": (2, 3)})
    {'shape': [2, 3]}
    """
    plain, frames = split_arrays(body)
    return restore_arrays(unpack(pack(plain)), frames)


def configure_socket(socket: Any) -> None:
    """Options every tensordbg socket has: no linger at close (a vanished peer must never hold up
    the training's exit) and zero-copy for frames of ZERO_COPY_MIN bytes and more."""
    import zmq

    socket.setsockopt(zmq.LINGER, 0)
    socket.copy_threshold = ZERO_COPY_MIN


def welcome(source: Source) -> dict[str, Any]:
    """The body of the reply to ``hello``: the whole current state, so that a (re)connecting UI is
    up to date at once.

    >>> welcome(source)["info"]["state"]
    'paused'
    """
    return {
        "protocol": PROTOCOL_VERSION,
        "info": dispatch(source, "info", {}),
        "hits": dispatch(source, "hits", {}),
    }


def _array_bytes(array: WireArray) -> memoryview:
    """The raw bytes of a WireArray, checked against its dtype and shape; no copy when the words
    are already C-contiguous."""
    if array.dtype not in DTYPES:
        raise ValueError(f"dtype {array.dtype!r} has no wire format; known: {', '.join(DTYPES)}")
    words = np.ascontiguousarray(array.data)
    storage = np.dtype(DTYPES[array.dtype].storage)
    if words.dtype.itemsize != storage.itemsize or words.dtype.kind not in "uifb":
        raise ValueError(f"a {array.dtype} WireArray holds {storage} words, not {words.dtype}")
    if words.size != math.prod(array.shape):
        raise ValueError(f"WireArray of shape {array.shape} holds {words.size} words")
    return memoryview(words.reshape(-1)).cast("B")


def _wire_array(
    name: str,
    descriptor: dict[str, Any],
    frames: Sequence[Buffer],
    used: set[int],
    refuse: Callable[[str], Exception],
    shared: Collection[int] = (),
) -> WireArray:
    index, dtype, shape = (descriptor.get(k) for k in (ARRAY_KEY, "dtype", "shape"))
    if SHM_KEY in descriptor:
        if index not in shared:
            raise refuse(
                f"array {name!r} is in shared memory ({descriptor[SHM_KEY]!r}), which this side "
                "does not accept: only replies to a client on the training's host use it"
            )
        if set(descriptor) != {ARRAY_KEY, "dtype", "shape", SHM_KEY, "nbytes"}:
            raise refuse(
                f"array descriptor {name!r} must have exactly {ARRAY_KEY}, dtype, shape, "
                f"{SHM_KEY} and nbytes"
            )
    elif set(descriptor) != {ARRAY_KEY, "dtype", "shape"}:
        raise refuse(f"array descriptor {name!r} must have exactly {ARRAY_KEY}, dtype and shape")
    elif index in shared:
        raise refuse(f"array {name!r} names array {index}, which is in shared memory")
    if not _is_int(index) or not 0 <= index < len(frames):
        raise refuse(f"array {name!r} names frame {index!r}; the message has {len(frames)}")
    if index in used:
        raise refuse(f"array {name!r} names frame {index}, which another array already uses")
    if dtype not in DTYPES:
        raise refuse(f"array {name!r} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_int(n) and n >= 0 for n in shape):
        raise refuse(f"array {name!r} has a malformed shape {shape!r}")
    storage = np.dtype(DTYPES[dtype].storage)
    frame = memoryview(frames[index])
    if frame.nbytes != math.prod(shape) * storage.itemsize:
        raise refuse(
            f"array {name!r} of {dtype} {shape} needs {math.prod(shape) * storage.itemsize:,} "
            f"bytes; its frame has {frame.nbytes:,}"
        )
    used.add(index)
    return WireArray(dtype, tuple(shape), np.frombuffer(frame, dtype=storage).reshape(shape))


def _not_plain(body: Any) -> str | None:
    """Why an untrusted body is not plain data (too deep, or a type msgpack let through)."""
    stack = [(body, 0)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_BODY_DEPTH:
            return f"message body nests deeper than {MAX_BODY_DEPTH} levels"
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
        elif not isinstance(value, _PLAIN_TYPES):
            return f"message body holds a {type(value).__name__}; only plain values are accepted"
    return None


def peek_id(header: Buffer) -> int | None:
    """The request id a header claims, read leniently and without checking anything: to
    address the answer to a message that was refused (a server answers only a key holder so);
    None when even a lenient reading fails."""
    try:
        fields = msgpack.unpackb(header, raw=False, strict_map_key=False, ext_hook=_refuse_ext)
        id = fields.get("id")
        return id if _is_int(id) else None
    except Exception:
        return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _plain_default(value: Any) -> Any:
    if isinstance(value, np.generic) and not isinstance(value, np.void):
        return value.item()
    if isinstance(value, WireArray):
        raise TypeError("a WireArray can only be a top-level value of a message body")
    raise TypeError(
        f"cannot send a value of type {type(value).__name__}: only plain data crosses the wire"
    )


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not accepted")
