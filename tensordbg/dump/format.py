"""The dump format on disk, shared by the writer and the reader (numpy only, never torch).

One run directory, one folder per rank::

    runs/dbg/
      rank-0/
        meta.json                     the run: format version, run id, torch version, device,
                                      argv, rule configuration, complete / reason_incomplete
        index.jsonl                   one JSON object per line: a step (its tensors' statistics,
                                      provenance, hits, the name and checksum of its file), the
                                      module tree; listing a dump reads only this
        step-00000012.safetensors     the values of step 12, when any were kept (plain
                                      safetensors: 8-byte header length, JSON header, raw bytes)

Every file appears whole: written under a temporary name, fsynced, renamed, and the directory
fsynced. ``index.jsonl`` only grows by whole lines, each appended after the file it names is in
place (and fsynced at once for a step with hits, within a second for the others); a line starts
with ``{"crc":"XXXXXXXX",`` (the CRC-32 of the rest of the line), so a line cut by a crash or
changed on disk is recognised. Values are stored as they were: bfloat16
and float8 are raw bytes under their safetensors dtype and come back through ``ml_dtypes``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

FORMAT_VERSION = 1
META = "meta.json"
INDEX = "index.jsonl"
RANK_DIR = re.compile(r"^rank-(\d+)$")
TMP_SUFFIX = ".tmp"

# numpy dtype name <-> safetensors dtype code. bfloat16 and float8 are ml_dtypes' numpy dtypes.
NUMPY_DTYPES: dict[str, np.dtype] = {
    "float64": np.dtype(np.float64),
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
    "int64": np.dtype(np.int64),
    "int32": np.dtype(np.int32),
    "int16": np.dtype(np.int16),
    "int8": np.dtype(np.int8),
    "uint8": np.dtype(np.uint8),
    "uint16": np.dtype(np.uint16),
    "uint32": np.dtype(np.uint32),
    "uint64": np.dtype(np.uint64),
    "bool": np.dtype(np.bool_),
}
SAFETENSORS_CODES: dict[str, str] = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "uint16": "U16",
    "uint32": "U32",
    "uint64": "U64",
    "bool": "BOOL",
}
DTYPE_OF_CODE = {code: name for name, code in SAFETENSORS_CODES.items()}


def dtype_name(dtype: np.dtype) -> str:
    """The dump's name of a numpy dtype (torch's names: ``float32``, ``bfloat16``...)."""
    name = np.dtype(dtype).name
    if name not in NUMPY_DTYPES:
        known = ", ".join(NUMPY_DTYPES)
        raise ValueError(f"a dump stores {known}; not {name}")
    return name


def rank_dir(root: Path, rank: int) -> Path:
    return root / f"rank-{rank}"


def step_file(step: int, rank: int) -> str:
    return f"step-{step:08d}.safetensors"


# --- atomic files -------------------------------------------------------------------------


def fsync_dir(path: Path) -> None:
    """Make a rename or an unlink in ``path`` durable (a no-op where directories cannot be
    opened, as on Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(
    path: Path, chunks: Iterable[bytes | memoryview], checksum: bool = True
) -> tuple[int, int]:
    """Write ``chunks`` to ``path`` so that the file appears whole or not at all; returns its
    size and CRC-32 (0 without ``checksum``). A failure removes the temporary file and
    raises."""
    tmp = path.with_name(path.name + TMP_SUFFIX)
    size, crc = 0, 0
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
                if checksum:
                    crc = zlib.crc32(chunk, crc)
                size += len(chunk) if isinstance(chunk, bytes) else chunk.nbytes
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)
    return size, crc


# --- index lines --------------------------------------------------------------------------

_CRC_PREFIX = len('{"crc":"00000000",')


def index_line(record: dict[str, Any]) -> bytes:
    """One line of the index: the record as JSON, prefixed by the CRC-32 of the rest."""
    body = json.dumps(record, separators=(",", ":"), allow_nan=True, default=_scalar)[1:].encode()
    return b'{"crc":"%08x",' % zlib.crc32(body) + body + b"\n"


def _scalar(value: Any) -> Any:
    """A numpy scalar as the Python number JSON holds (the encoder asks for nothing else)."""
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"a {type(value).__name__} cannot be written to the index")


def parse_index_line(line: bytes) -> dict[str, Any]:
    """A record from one line of the index; ValueError when the line is cut or altered."""
    if not line.endswith(b"\n"):
        raise ValueError("the line is cut short")
    head, body = line[:_CRC_PREFIX], line[_CRC_PREFIX:-1]
    if not head.startswith(b'{"crc":"') or not head.endswith(b'",'):
        raise ValueError("the line has no checksum")
    if int(head[8:16], 16) != zlib.crc32(body):
        raise ValueError("the line fails its checksum")
    record = json.loads(b"{" + body)
    if not isinstance(record, dict):
        raise ValueError("the line is not an object")
    return record


# --- safetensors ----------------------------------------------------------------------------


def safetensors_header(
    arrays: dict[str, np.ndarray], metadata: dict[str, str] | None = None
) -> tuple[bytes, dict[str, list[int]]]:
    """The header of a safetensors file holding ``arrays`` in order (8-byte length, JSON
    padded with spaces to 8 bytes, as the safetensors library writes it) and each array's
    byte range within the data."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = metadata
    offsets: dict[str, list[int]] = {}
    start = 0
    for key, array in arrays.items():
        end = start + array.nbytes
        header[key] = {
            "dtype": SAFETENSORS_CODES[dtype_name(array.dtype)],
            "shape": list(array.shape),
            "data_offsets": [start, end],
        }
        offsets[key] = [start, end]
        start = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, offsets


def array_bytes(array: np.ndarray) -> memoryview:
    """The raw C-order bytes of an array, without a copy when it is contiguous."""
    array = np.ascontiguousarray(array)
    return memoryview(array.reshape(-1).view(np.uint8))
