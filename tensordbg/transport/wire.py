"""What a message body looks like on the wire, whatever carries it: the dtype table, the limits,
:class:`WireArray`, and bodies as plain msgpack data plus raw array bytes.

A training sends a tensor's values as raw C-order words tagged with the tensor's dtype name; the
UI (or a reader of dump files) reads them back without torch. numpy has no bfloat16 or fp8, so
those travel as unsigned words and come back as ``ml_dtypes`` arrays, never widened on the way.
A body is plain data (never pickle, never a msgpack extension) whose top-level WireArrays leave a
descriptor ``{"__array__": i, "dtype", "shape"}`` in their place and travel as raw array i. This
module imports neither zmq nor torch: the socket, the signature and shared memory are
:mod:`tensordbg.transport.codec`'s business.

>>> array = WireArray("bfloat16", (2,), np.array([0x3F80, 0xC000], np.uint16))
>>> array.to_numpy()
array([1, -2], dtype=bfloat16)
>>> split_arrays({"ref": 3, "data": array})
({'ref': 3, 'data': {'__array__': 0, 'dtype': 'bfloat16', 'shape': [2]}}, [<memory ...>])
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from tensordbg.dtypes import EXTENDED, numpy_dtype

PROTOCOL_VERSION = 2

# Limits. A client's request is small; anything larger is hostile or broken and is refused.
MAX_REQUEST_HEADER = 64 * 1024
MAX_REQUEST_FRAMES = 2  # signature and header: no request carries arrays
# Replies come from an authenticated training process and can be large (a whole tensor).
MAX_REPLY_HEADER = 64 * 2**20
MAX_REPLY_BYTES = 2 * 2**30
MAX_REPLY_ARRAYS = 64
MAX_BODY_DEPTH = 32  # nesting of a request's body; real requests nest three levels at most

ARRAY_KEY = "__array__"
SHM_KEY = "shm"  # names the shared-memory file of an array (see tensordbg.transport.shm)

Buffer = bytes | bytearray | memoryview  # or anything with the buffer protocol, e.g. zmq.Frame


@dataclass(frozen=True, slots=True)
class DType:
    """How one tensor dtype crosses the wire: the numpy type of its raw words, and the numpy
    type of its values (an ``ml_dtypes`` type where numpy has none).

    >>> DTYPES["bfloat16"].storage, DTYPES["bfloat16"].values
    ('<u2', dtype(bfloat16))
    """

    name: str  # torch's name, e.g. "bfloat16"
    storage: str  # numpy dtype of the words on the wire, e.g. "<u2"

    @property
    def values(self) -> np.dtype:
        """What the words mean, e.g. ml_dtypes.bfloat16 (imported at the first such array)."""
        return numpy_dtype(self.name) if self.name in EXTENDED else np.dtype(self.storage)


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
    :meth:`to_numpy` views them as values, bfloat16 and fp8 as ``ml_dtypes`` arrays.

    >>> WireArray("float8_e4m3fn", (3,), np.array([0x38, 0xB8, 0x7F], np.uint8)).to_numpy()
    array([1, -1, nan], dtype=float8_e4m3fn)
    """

    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray

    def to_numpy(self) -> np.ndarray:
        """The values, in their own dtype and without a copy: every bit as it was sent (widen
        bfloat16 and fp8 with ``.astype(np.float32)`` to compute or print with plain numpy)."""
        return self.data.view(DTYPES[self.dtype].values).reshape(self.shape)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def raw_bytes(self) -> memoryview:
        """The raw bytes, checked against the dtype and shape; no copy when the words are
        already C-contiguous. ValueError for an array that does not match its description (a
        bug of whoever made it)."""
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} has no wire format; known: {', '.join(DTYPES)}")
        words = np.ascontiguousarray(self.data)
        storage = np.dtype(DTYPES[self.dtype].storage)
        if words.dtype.itemsize != storage.itemsize or words.dtype.kind not in "uifb":
            raise ValueError(f"a {self.dtype} WireArray holds {storage} words, not {words.dtype}")
        if words.size != math.prod(self.shape):
            raise ValueError(f"WireArray of shape {self.shape} holds {words.size} words")
        return memoryview(words.reshape(-1)).cast("B")


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
            frames.append(value.raw_bytes())
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
    if not is_int(index) or not 0 <= index < len(frames):
        raise refuse(f"array {name!r} names frame {index!r}; the message has {len(frames)}")
    if index in used:
        raise refuse(f"array {name!r} names frame {index}, which another array already uses")
    if dtype not in DTYPES:
        raise refuse(f"array {name!r} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(is_int(n) and n >= 0 for n in shape):
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


def is_int(value: Any) -> bool:
    """Whether a decoded value is an integer; msgpack's booleans are not.

    >>> is_int(3), is_int(True)
    (True, False)
    """
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
