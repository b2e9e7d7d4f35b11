"""The wire protocol between a training process and a UI: message types, dtype table, limits.

Both sides import this module; it never imports torch. A message is a list of ZeroMQ frames: a
small msgpack header, then raw tensor bytes, one frame per array. (Framing, signing and
decoding follow below the data definitions.)
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import math
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import msgpack
import numpy as np

from tensordbg.source import Source, dispatch

PROTOCOL_VERSION = 1

# Requests a UI sends; each names a method of tensordbg.source.Source (see there for payloads),
# plus the protocol's own liveness and greeting messages.
REQUESTS = (
    "hello",
    "ping",
    "info",
    "modules",
    "hits",
    "tensors",
    "stats",
    "slice",
    "histogram",
    "provenance",
    "rules",
    "set_rule",
    "add_rule",
    "recheck",
    "control",
)
# What the training process sends: replies to requests, and events it pushes unasked.
REPLY = "reply"
ERROR = "error"
PONG = "pong"
EVENTS = ("status", "hit", "state", "log")

# Limits. A client's request is small; anything larger is hostile or broken and is refused.
MAX_REQUEST_HEADER = 64 * 1024
MAX_REQUEST_FRAMES = 4
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
    is_float: bool


# numpy has no bfloat16 or fp8: they travel as raw words tagged with their dtype name.
DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("float64", "<f8", True),
        DType("float32", "<f4", True),
        DType("float16", "<f2", True),
        DType("bfloat16", "<u2", True),
        DType("float8_e4m3fn", "|u1", True),
        DType("float8_e4m3fnuz", "|u1", True),
        DType("float8_e5m2", "|u1", True),
        DType("float8_e5m2fnuz", "|u1", True),
        DType("int64", "<i8", False),
        DType("int32", "<i4", False),
        DType("int16", "<i2", False),
        DType("int8", "|i1", False),
        DType("uint8", "|u1", False),
        DType("bool", "|b1", False),
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
# signature hex HMAC-SHA256, with the session's key, over the header bytes and then each array
#           frame (Jupyter signs only the header; a tensor is data a person acts on, so it is
#           signed too). A frame above TREE_HASH_MIN enters the HMAC as its length followed by
#           the SHA-256 digests of its TREE_CHUNK-byte chunks, computed on all cores: a keyed
#           hash over collision-resistant digests authenticates the bytes just the same, and one
#           core alone would hash a 256 MiB tensor slower than the socket moves it. A signature
#           seen before within REPLAY_WINDOW, or a timestamp further than REPLAY_WINDOW from this
#           side's clock, is a replay and is refused.

TREE_HASH_MIN = 16 * 2**20
TREE_CHUNK = 4 * 2**20
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
    only) and may send large replies; ``side="client"`` the reverse. Both sides share the key.

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
    ):
        if len(key) < 16:
            raise ValueError("a session key has at least 16 bytes")
        self._key = key
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

    def sign(self, header: Buffer, arrays: Sequence[Buffer]) -> bytes:
        """Hex HMAC-SHA256 over the header and each array frame, fed in order without copying;
        a large frame by the digests of its chunks, hashed in parallel (see TREE_HASH_MIN)."""
        mac = hmac.new(self._key, header, "sha256")
        for frame in arrays:
            view = memoryview(frame).cast("B")
            if view.nbytes < TREE_HASH_MIN:
                mac.update(view)
            else:
                mac.update(b"tree%d:" % view.nbytes)
                mac.update(b"".join(_chunk_digests(view)))
        return mac.hexdigest().encode("ascii")

    def encode(self, type: str, body: Any = None, *, id: int | None = None) -> list[Buffer]:
        """Frames of one message. Large array frames are the arrays' own memory (send them with
        ``copy=False``; see :func:`configure_socket`). Raises ValueError or TypeError for a body
        that cannot cross the wire (a bug of the sender, never of the peer)."""
        body, arrays = split_arrays(body)
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
                f"{type} message header is {len(header):,} bytes; the other side accepts at most "
                f"{self.max_out_header:,}"
            )
        return [self.sign(header, arrays), header, *arrays]

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
        signature, header, *arrays = (memoryview(f) for f in frames)
        if header.nbytes > self.max_in_header:
            raise ProtocolError(
                f"message header is {header.nbytes:,} bytes; at most {self.max_in_header:,} are "
                "accepted"
            )
        total = sum(a.nbytes for a in arrays)
        if total > MAX_REPLY_BYTES:
            raise ProtocolError(
                f"message carries {total:,} bytes of arrays; at most {MAX_REPLY_BYTES:,}"
            )
        authenticated = hmac.compare_digest(bytes(signature), self.sign(header, arrays))
        try:
            fields = unpack(header)
        except ValueError as e:
            raise ProtocolError(
                f"message header is not valid msgpack: {e}",
                authenticated=authenticated,
                id=_peek_id(header) if authenticated else None,
            ) from None
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
        if not isinstance(ts, (int, float)) or isinstance(ts, bool):
            raise ProtocolError("message timestamp 'ts' is missing or not a number")
        replay = self.replay.refusal(bytes(signature), float(ts))
        if replay:
            raise ProtocolError(replay)
        return self._message(fields, arrays)

    def _message(self, fields: dict[str, Any], arrays: list[memoryview]) -> Message:
        """The Message of an authenticated header; refusals here may be told to the sender."""
        id = fields.get("id")
        if id is not None and (not isinstance(id, int) or isinstance(id, bool)):
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
        body = restore_arrays(body, arrays, refuse)
        return Message(fields["type"], body, id, fields["session"], float(fields["ts"]))


_hash_pool: ThreadPoolExecutor | None = None
_hash_pool_lock = threading.Lock()


def _chunk_digests(view: memoryview) -> list[bytes]:
    """SHA-256 of each TREE_CHUNK-byte chunk, on all cores (hashlib releases the GIL)."""
    global _hash_pool
    with _hash_pool_lock:
        if _hash_pool is None:
            _hash_pool = ThreadPoolExecutor(
                max_workers=max(1, os.cpu_count() or 1), thread_name_prefix="tensordbg-hash"
            )
    chunks = [view[i : i + TREE_CHUNK] for i in range(0, view.nbytes, TREE_CHUNK)]
    return list(_hash_pool.map(lambda chunk: hashlib.sha256(chunk).digest(), chunks))


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
) -> Any:
    """Inverse of :func:`split_arrays`: descriptors become WireArrays viewing ``frames`` (no copy).
    Every frame must be named exactly once, with the size its dtype and shape imply."""
    if not isinstance(body, dict):
        if frames:
            raise refuse(f"message has {len(frames)} array frame(s) but its body names none")
        return body
    used: set[int] = set()
    out = {}
    for name, value in body.items():
        if isinstance(value, dict) and ARRAY_KEY in value:
            value = _wire_array(name, value, frames, used, refuse)
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
) -> WireArray:
    index, dtype, shape = (descriptor.get(k) for k in (ARRAY_KEY, "dtype", "shape"))
    if set(descriptor) != {ARRAY_KEY, "dtype", "shape"}:
        raise refuse(f"array descriptor {name!r} must have exactly {ARRAY_KEY}, dtype and shape")
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(frames):
        raise refuse(f"array {name!r} names frame {index!r}; the message has {len(frames)}")
    if index in used:
        raise refuse(f"array {name!r} names frame {index}, which another array already uses")
    if dtype not in DTYPES:
        raise refuse(f"array {name!r} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
    ):
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


def _peek_id(header: Buffer) -> int | None:
    """The request id of an authenticated header that strict decoding refused, to address the
    error reply; None when even a lenient reading fails."""
    try:
        fields = msgpack.unpackb(header, raw=False, strict_map_key=False, ext_hook=_refuse_ext)
        id = fields.get("id")
        return id if isinstance(id, int) and not isinstance(id, bool) else None
    except Exception:
        return None


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
