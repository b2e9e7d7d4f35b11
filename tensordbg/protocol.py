"""The wire protocol between a training process and a UI: message types, dtype table, limits.

Both sides import this module; it never imports torch. A message is a list of ZeroMQ frames: a
small msgpack header, then raw tensor bytes, one frame per array. (Framing, signing and
decoding follow below the data definitions.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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
