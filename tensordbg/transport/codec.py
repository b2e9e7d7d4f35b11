"""Messages as signed ZeroMQ frames: encoding, decoding, HMAC signing, replay protection.

A message is a list of frames (a ROUTER puts the peer's identity in front)::

    [signature, header, array frame 0, array frame 1, ...]

header    msgpack map {"v", "type", "id", "ts", "nonce", "session", "body"}; ``body`` is the
          payload (request parameters, a reply's result, an event's payload). A WireArray at the
          top level of a body dict leaves the header as {"__array__": i, "dtype", "shape"} and
          travels as raw frame i (see :mod:`tensordbg.transport.wire`). Plain data only: never
          pickle, never a msgpack extension.
signature hex HMAC-SHA256, with the session's key, over the sender's side ("server" or
          "client"), the header bytes and then each array in order, each part after its length
          in ASCII digits and a colon (Jupyter signs only the header; a tensor is data a person
          acts on, so it is signed too). An array above TREE_HASH_MIN enters the HMAC as
          "tree<length>:" followed by the SHA-256 digests of its TREE_CHUNK-byte chunks,
          computed on all cores (:func:`tensordbg.transport.shm.chunk_digests`): a keyed hash
          over collision-resistant digests authenticates the bytes just the same, and one core
          alone would hash a 256 MiB tensor slower than the socket moves it. A signature seen
          before within REPLAY_WINDOW, or a timestamp further than REPLAY_WINDOW from this
          side's clock, is a replay and is refused.
shared    in a reply to a client on the same host, an array of SHM_MIN bytes or more waits in a
          file of the session's shared-memory directory instead (see
          :mod:`tensordbg.transport.shm`); its descriptor names the file: {"__array__": i,
          "dtype", "shape", "shm": file name, "nbytes"}. Array i is signed exactly as if it were
          a frame; the frames on the wire are the other arrays, in order.

>>> server, client = MessageCodec(key, side="server"), MessageCodec(key, side="client")
>>> server.decode(client.encode("slice", {"ref": 3, "text": "[0, :8]"}, id=1)).body
{'ref': 3, 'text': '[0, :8]'}
"""

from __future__ import annotations

import heapq
import hmac
import re
import secrets
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgpack
import numpy as np

from tensordbg.sources.contract import METHODS
from tensordbg.transport.shm import SHM_MIN, ChunkDigests, SharedMemory, chunk_digests
from tensordbg.transport.wire import (
    ARRAY_KEY,
    MAX_BODY_DEPTH,
    MAX_REPLY_ARRAYS,
    MAX_REPLY_BYTES,
    MAX_REPLY_HEADER,
    MAX_REQUEST_FRAMES,
    MAX_REQUEST_HEADER,
    PROTOCOL_VERSION,
    SHM_KEY,
    Buffer,
    is_int,
    pack,
    restore_arrays,
    split_arrays,
    unpack,
)

# Requests a UI sends: the methods of tensordbg.sources.contract.Source (see there for payloads),
# plus the protocol's own greeting and liveness messages.
REQUESTS = ("hello", "ping", *METHODS)
# What the training process sends: replies to requests, and events it pushes unasked.
REPLY = "reply"
ERROR = "error"
PONG = "pong"
EVENTS = ("status", "hit", "state", "log")

TREE_HASH_MIN = 16 * 2**20
"""Arrays this large (bytes) are signed by the digests of their chunks (see the docstring)."""
REPLAY_WINDOW = 60.0
"""Seconds a message stays acceptable; also the largest clock difference between two hosts."""
ZERO_COPY_MIN = 64 * 1024
"""Frames this large cross the socket without a copy (zero-copy pays off above ~64 KiB)."""
_NAMES_SHARED = re.compile(re.escape(msgpack.packb(SHM_KEY)))  # the key as msgpack writes it
_SIGNATURE_LENGTH = 64  # hex digits of a SHA-256 HMAC
_ENVELOPE_TEXT_MAX = 128  # type, nonce and session are short identifiers
_PLAIN_TYPES = (type(None), bool, int, float, str, bytes)


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
                mac.update(b"".join(chunk_digests(view)))
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
        if not (is_int(ts) or isinstance(ts, float)):
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
            if not is_int(index) or not is_int(nbytes) or not 0 < nbytes <= MAX_REPLY_BYTES:
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
        if id is not None and not is_int(id):
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


def configure_socket(socket: Any) -> None:
    """Options every tensordbg socket has: no linger at close (a vanished peer must never hold up
    the training's exit) and zero-copy for frames of ZERO_COPY_MIN bytes and more."""
    import zmq

    socket.setsockopt(zmq.LINGER, 0)
    socket.copy_threshold = ZERO_COPY_MIN


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
        fields = msgpack.unpackb(header, raw=False, strict_map_key=False)  # ExtTypes are inert
        id = fields.get("id")
        return id if is_int(id) else None
    except Exception:
        return None
