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
import fnmatch
import json
import math
import os
import re
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from tensordbg.dtypes import numpy_dtype

FORMAT_VERSION = 1
META = "meta.json"
INDEX = "index.jsonl"
RANK_DIR = re.compile(r"^rank-(\d+)$")
TMP_SUFFIX = ".tmp"
STEP_FILE = re.compile(rb'"file":"step-(\d+)(?:-[0-9a-f]+)?\.safetensors"')

# numpy dtype name <-> safetensors dtype code. bfloat16 and float8 are ml_dtypes' numpy dtypes
# (tensordbg.dtypes.numpy_dtype, which imports ml_dtypes at the first of them).
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


def stored_dtype(name: str) -> np.dtype | None:
    """The numpy dtype of a dump's dtype name; None for one a dump does not store."""
    return numpy_dtype(name) if name in SAFETENSORS_CODES else None


def dtype_name(dtype: np.dtype) -> str:
    """The dump's name of a numpy dtype (torch's names: ``float32``, ``bfloat16``...)."""
    name = np.dtype(dtype).name
    if name not in SAFETENSORS_CODES:
        known = ", ".join(SAFETENSORS_CODES)
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


def index_json(record: dict[str, Any]) -> str:
    """A record as the index writes it (numpy scalars as plain numbers)."""
    return json.dumps(record, separators=(",", ":"), allow_nan=True, default=_scalar)


def index_line(record: dict[str, Any], entries: list[str] | None = None) -> bytes:
    """One line of the index: the record as JSON, prefixed by the CRC-32 of the rest;
    ``entries``: the record's ``entries``, already encoded (JSON texts)."""
    body = index_json(record)[1:]
    if entries is not None:
        body = f'{body[:-1]},"entries":[{",".join(entries)}]}}'
    data = body.encode()
    return b'{"crc":"%08x",' % zlib.crc32(data) + data + b"\n"


class Encoded:
    """One tensor's index entry already encoded as JSON (see :class:`EntryEncoder`): the
    writer puts it in the line as it is, with its place in the step."""

    __slots__ = ("head", "name", "stats")

    def __init__(self, name: str, head: str, stats: str):
        self.name = name
        self.head = head  # '{"name":...,"stats":' up to the statistics
        self.stats = stats

    def text(self, order: int) -> str:
        return f'{self.head}{self.stats},"order":{order}}}'

    def as_dict(self) -> dict[str, Any]:
        """The entry as a dict (for one the writer adds to: a value's key and offsets)."""
        return json.loads(f"{self.head}{self.stats}}}")


HEADS_KEPT = 4096
"""How many encoded entry heads :class:`EntryEncoder` keeps (a model whose shapes vary with the
batch, say with the sequence length, makes new ones: then all are forgotten, and made again as
needed)."""


class EntryEncoder:
    """Index entries as JSON text, the cheap way: the part of an entry that does not change
    from one step to the next (its name, module, shape, dtype, ...) is encoded once per tensor,
    and a step encodes only its numbers. A periodic dump writes some 200 entries a step on a
    thread that shares the interpreter with the training; this is most of its work."""

    FIELDS = ("name", "module", "phase", "kind", "shape", "dtype", "module_type", "call",
              "trainable")  # fmt: skip
    """The entry's fields but its statistics, in the order :meth:`encode` takes them."""

    def __init__(self) -> None:
        self._heads: dict[tuple[Any, ...], str] = {}
        self._keys: dict[Any, str] = {}

    def encode(self, static: tuple[Any, ...], values: dict[Any, Any]) -> Encoded:
        """``static``: the values of :attr:`FIELDS` (name first, hashable: the shape a tuple);
        ``values``: the statistics (their keys are written with ``str``)."""
        head = self._heads.get(static)
        if head is None:
            if len(self._heads) >= HEADS_KEPT:  # shapes that vary from step to step
                self._heads.clear()
            fields = index_json(dict(zip(self.FIELDS, static, strict=True)))
            head = self._heads[static] = f'{fields[:-1]},"stats":'
        keys = self._keys
        parts = []
        for key, value in values.items():
            name = keys.get(key)
            if name is None:
                name = keys[key] = json.dumps(str(key))
            if type(value) is float and value - value == 0.0:  # finite
                parts.append(f"{name}:{value!r}")
            else:
                parts.append(f"{name}:{_number(value)}")
        return Encoded(static[0], head, "{" + ",".join(parts) + "}")


def _number(value: Any) -> str:
    """A number as Python's json writes it (NaN and Infinity included)."""
    kind = type(value)
    if kind is float:
        if value != value:
            return "NaN"
        if value in (math.inf, -math.inf):
            return "Infinity" if value > 0 else "-Infinity"
        return float.__repr__(value)
    if kind is int:
        return int.__repr__(value)
    return json.dumps(value, allow_nan=True, default=_scalar)


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


def chosen(name: str, patterns: Iterable[str]) -> bool:
    """Whether ``dump_tensors`` patterns choose the tensor ``name`` (fnmatch, case-sensitive):
    what a periodic step keeps the values of, as the run and its replay both read it."""
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def chooses_gradients(patterns: Iterable[str], paths: Iterable[str]) -> bool:
    """Whether ``dump_tensors`` patterns choose the gradient of an input or output of a module
    at one of ``paths`` (``blocks.0.fc.grad_input[0]``): a periodic step then keeps those,
    which deferred checks otherwise judge from the parameters' gradients without reading."""
    kinds = ("grad_output", "grad_output[0]", "grad_input[0]")
    return any(chosen(f"{path}.{kind}" if path else kind, patterns)
               for path in paths for kind in kinds)  # fmt: skip
