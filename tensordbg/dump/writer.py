"""Writing a dump: :class:`DumpWriter`, numpy-level (no torch), so tests and offline tools can
build dumps too. The session's subscriber (:mod:`tensordbg.dump.subscriber`) calls it from its
background thread. The layout is described in :mod:`tensordbg.dump.format`.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import secrets
import shutil
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from tensordbg.dump import format as fmt

NOT_FINISHED = "the run did not finish (it was killed, or is still running)"
META_ROOM = 1024
"""Bytes of spaces after meta.json's text: on a full disk no new file can be written, and the
reason a write failed is written over the file in place, within the room it already has."""
SYNC_EVERY = 1.0
"""Seconds within which an index line of a step without hits reaches the disk (fsync)."""


@dataclass(slots=True)
class _Written:
    """What the writer remembers of a step it wrote, to bound the dump's size."""

    file: str | None
    nbytes: int
    line_bytes: int
    keep: bool


class DumpWriter:
    """Writes one rank's steps into a run directory.

    >>> writer = DumpWriter("runs/dbg", {"run_id": "a1b2", "argv": ["train.py"]})
    >>> writer.write_step(12, 0, [{"name": "fc.output", "module": "fc", "phase": "forward",
    ...     "kind": "output", "shape": [4, 8], "dtype": "float32", "stats": {"l2": 3.1}}],
    ...     {"fc.output": np.zeros((4, 8), np.float32)}, hits=[])
    >>> writer.close()

    ``entries`` are the step's watched tensors in execution order (``name``, ``module``,
    ``phase``, ``kind``, ``shape``, ``dtype``, ``stats`` and optionally ``provenance``,
    ``module_type``, ``call``); ``values`` maps some of their names to numpy arrays (bfloat16 and
    float8 as ``ml_dtypes`` arrays), a name's latest value; ``(name, phase)`` maps an earlier
    phase's value of the name (a weight at the hit of attach's check, then after the update).
    Under ``max_bytes`` the oldest steps without hits go first; when the steps with hits alone
    pass it (a NaN that stays, hitting every step), those go too, oldest first, but for the
    first (where the problem arose) and the newest. Writing the same step again replaces it.
    Errors (a full disk) raise ``OSError``: the caller decides; :meth:`fail` marks the dump
    incomplete.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        meta: Mapping[str, Any] | None = None,
        *,
        rank: int = 0,
        max_bytes: int | None = None,
    ):
        self.root = Path(path)
        if self.root.exists() and not self.root.is_dir():
            raise FileExistsError(f"{self.root} is a file, not a directory")
        self.rank = int(rank)
        self.max_bytes = max_bytes
        self.meta: dict[str, Any] = {
            "format_version": fmt.FORMAT_VERSION,
            "run_id": secrets.token_hex(4),
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch_version": None,
            "device": None,
            "argv": [],
            "rules": [],
            **(meta or {}),
            "complete": False,
            "reason_incomplete": NOT_FINISHED,
        }
        self.meta["format_version"] = fmt.FORMAT_VERSION
        self.evicted: list[tuple[int, int]] = []
        self.evicted_hits: list[tuple[int, int]] = []  # steps with hits the bound took too
        self.closed = False
        self._dirs: dict[int, Path] = {}
        self._index: dict[int, BinaryIO] = {}
        self._synced: dict[int, float] = {}
        self._written: dict[tuple[int, int], _Written] = {}
        self._index_bytes: dict[int, int] = {}
        self._said_full = False
        self._dir(self.rank)

    # --- public ------------------------------------------------------------------------------

    def write_step(
        self,
        step: int,
        rank: int,
        entries: Sequence[Mapping[str, Any]],
        values: Mapping[Any, np.ndarray],
        hits: Sequence[Mapping[str, Any]],
        modules: Sequence[Mapping[str, Any]] | None = None,
        numbers: Mapping[str, Any] | None = None,
    ) -> None:
        """Write one step of one rank: its values (if any) as one safetensors file, then one
        line of the index naming it. ``numbers`` are the step's loss, gradient norm and rate
        (the bus's ``step_end``)."""
        directory = self._dir(rank)
        if modules is not None:
            self._append(rank, {"type": "modules", "modules": list(modules)})
        # A name seen twice in a step (a parameter checked in two phases) has its latest value
        # stored with its last entry, and an earlier phase's, if kept, with that phase's last.
        names = [e.name if type(e) is fmt.Encoded else str(e["name"]) for e in entries]
        last: dict[Any, int] = {name: order for order, name in enumerate(names)}
        earlier = {key[0] for key in values if type(key) is tuple}
        for order, entry in enumerate(entries):
            if names[order] in earlier:
                phase = (entry.as_dict() if type(entry) is fmt.Encoded else entry).get("phase")
                last[(names[order], str(phase))] = order
        arrays: dict[str, np.ndarray] = {}
        out_entries: list[dict[str, Any] | str] = []
        for order, entry in enumerate(entries):
            if type(entry) is fmt.Encoded:
                if names[order] not in values and names[order] not in earlier:
                    out_entries.append(entry.text(order))  # the common case: as it is
                    continue
                entry = entry.as_dict()
            record = dict(entry)  # numpy scalars are made plain by the index line's encoder
            record.setdefault("order", order)
            record["shape"] = [int(d) for d in record.get("shape", ())]
            name = str(record["name"])
            key: Any = name if name in values and last[name] == order else None
            kept = (name, str(record.get("phase")))
            if key is None and kept in values and last.get(kept) == order:
                key = kept
            if key is not None:
                stored = name if key == name else _free_key(f"{name}@{kept[1]}", last, arrays)
                array = arrays[stored] = np.asarray(values[key])
                record.update(key=stored, shape=list(array.shape),
                              dtype=fmt.dtype_name(array.dtype))  # fmt: skip
            out_entries.append(record)
        for name, array in values.items():
            if type(name) is str and name not in last:  # a value with no entry still gets one
                array = arrays[name] = np.asarray(array)
                out_entries.append({"name": name, "order": len(out_entries), "key": name,
                                    "shape": list(array.shape),
                                    "dtype": fmt.dtype_name(array.dtype), "stats": {}})  # fmt: skip
        line: dict[str, Any] = {"type": "step", "step": int(step), "rank": int(rank)}
        previous = self._written.get((step, rank))
        file_name = None
        if arrays:
            file_name = fmt.step_file(step, rank)
            if previous is not None and previous.file == file_name:
                file_name = file_name.replace(
                    ".safetensors", f"-{secrets.token_hex(2)}.safetensors"
                )
            header, offsets = fmt.safetensors_header(arrays)
            chunks: list[bytes | memoryview] = [header]
            crcs: dict[str, int] = {}
            for key, array in arrays.items():
                data = fmt.array_bytes(array)
                crcs[key] = zlib.crc32(data)
                chunks.append(data)
            # The file's checksum is its header's and each tensor's (one pass over the bytes).
            nbytes, _ = fmt.write_atomic(directory / file_name, chunks, checksum=False)
            for record in out_entries:
                key = record.get("key") if type(record) is dict else None
                if key is not None:
                    record["offsets"] = offsets[key]
                    record["crc"] = crcs[key]
            line.update(file=file_name, nbytes=nbytes, header_crc=zlib.crc32(header),
                        data_start=len(header))  # fmt: skip
        else:
            nbytes = 0
            line.update(file=None, nbytes=0)
        line["hits"] = [dict(h) for h in hits]
        if numbers is not None:
            line["numbers"] = dict(numbers)
        encoded = [e if type(e) is str else fmt.index_json(e) for e in out_entries]
        line_bytes = self._append(rank, line, durable=bool(hits), entries=encoded)
        keep = bool(hits) or bool(previous and previous.keep)
        self._written[(step, rank)] = _Written(file_name, nbytes, line_bytes, keep)
        if previous is not None and previous.file and previous.file != file_name:
            _unlink(directory / previous.file)
        if self.max_bytes is not None and self.total_bytes() > self.max_bytes:
            self._evict()

    @property
    def steps_written(self) -> int:
        """How many (step, rank) of this writer the dump holds."""
        return len(self._written)

    def total_bytes(self) -> int:
        """The dump's size on disk, as written by this writer (files and index)."""
        return sum(w.nbytes for w in self._written.values()) + sum(self._index_bytes.values())

    def fail(self, reason: str) -> None:
        """Mark the dump incomplete, saying why (when even that can be written)."""
        self.meta["complete"] = False
        self.meta["reason_incomplete"] = reason
        with contextlib.suppress(OSError):  # meta.json already says the run did not finish
            self._write_meta()

    def close(self, complete: bool = True, reason: str | None = None) -> None:
        """Finish the dump: ``complete`` unless a write failed (see :meth:`fail`)."""
        if self.closed:
            return
        self.closed = True
        for rank in list(self._index):
            self._close_index(rank)
        if complete and self.meta.get("reason_incomplete") in (None, NOT_FINISHED):
            self.meta["complete"] = True
            self.meta["reason_incomplete"] = None
        elif reason:
            self.meta["complete"] = False
            self.meta["reason_incomplete"] = reason
        if self.evicted_hits:  # a step with a hit is dumped, unless the bound took it
            self.meta["evicted_hit_steps"] = sorted([s, r] for s, r in self.evicted_hits)
        with contextlib.suppress(OSError):
            self._write_meta()

    # --- inside ------------------------------------------------------------------------------

    def _dir(self, rank: int) -> Path:
        directory = self._dirs.get(rank)
        if directory is not None:
            return directory
        directory = fmt.rank_dir(self.root, rank)
        if (directory / fmt.META).exists():
            # A dump of an earlier run in the same place: this run replaces it, whole.
            shutil.rmtree(directory)
        elif directory.exists():
            raise FileExistsError(f"{directory} exists and is not a tensordbg dump")
        directory.mkdir(parents=True)
        fmt.fsync_dir(directory.parent)
        self._dirs[rank] = directory
        self._index_bytes[rank] = 0
        self._write_meta(rank)
        (directory / fmt.INDEX).touch()
        return directory

    def _write_meta(self, rank: int | None = None) -> None:
        ranks = [rank] if rank is not None else list(self._dirs)
        for r in ranks:
            # The index's length as it stands: a reader finds an index cut short of it.
            meta = {
                **self.meta,
                "rank": r,
                "index_bytes": self._index_bytes.get(r, 0),
                "last_step": max((s for s, rr in self._written if rr == r), default=None),
            }
            text = fmt.json.dumps(meta, indent=1, allow_nan=True).encode()
            path = fmt.rank_dir(self.root, r) / fmt.META
            try:
                # Trailing spaces (JSON ignores them) keep room for a longer reason later.
                fmt.write_atomic(path, [text, b" " * META_ROOM, b"\n"])
            except OSError:
                if not _overwrite(path, text):
                    raise

    def _append(self, rank: int, record: dict[str, Any], durable: bool = True,
                entries: list[str] | None = None) -> int:  # fmt: skip
        """Append a line to the rank's index (kept open). It is in the kernel's hands at once,
        so a killed process loses nothing; it reaches the disk at once when ``durable`` (a step
        with hits, the module tree), else within SYNC_EVERY seconds (or at close): an operating
        system that crashes may lose the last second of periodic steps, never a hit."""
        line = fmt.index_line(record, entries)
        f = self._index.get(rank)
        if f is None:
            f = self._index[rank] = open(self._dirs[rank] / fmt.INDEX, "ab")  # noqa: SIM115
        start = f.tell()
        try:
            f.write(line)
            f.flush()
            now = time.monotonic()
            if durable or now - self._synced.get(rank, -SYNC_EVERY) >= SYNC_EVERY:
                os.fsync(f.fileno())
                self._synced[rank] = now
        except BaseException:
            f.truncate(start)  # never leave a half line for the next one to follow
            raise
        self._index_bytes[rank] += len(line)
        return len(line)

    def _close_index(self, rank: int) -> None:
        f = self._index.pop(rank, None)
        if f is not None:
            with contextlib.suppress(OSError):
                os.fsync(f.fileno())
            f.close()

    def _evict(self) -> None:
        """Remove the oldest steps without hits until the dump is back under 90 % of
        ``max_bytes`` (room for a few steps, so that the index is not rewritten every step)."""
        assert self.max_bytes is not None
        target = self.max_bytes * 0.9
        total = self.total_bytes()
        gone: list[tuple[int, int]] = []
        order = sorted(self._written)
        kept = [key for key in order if self._written[key].keep]
        spared = {*kept[:1], *order[-1:]}  # the first step with hits, and the newest step
        for keep in (False, True):  # steps with hits go only when they alone pass the bound
            for key in order:
                written = self._written[key]
                if total <= target:
                    break
                if written.keep != keep or key in spared:  # each pass takes its own
                    continue
                total -= written.nbytes + written.line_bytes
                gone.append(key)
        if not gone:
            return
        for rank in {r for _, r in gone}:
            self._rewrite_index(rank, {s for s, r in gone if r == rank})
        for step, rank in gone:
            written = self._written.pop((step, rank))
            if written.file:
                _unlink(self._dirs[rank] / written.file)
            self.evicted.append((step, rank))
            if written.keep:
                self.evicted_hits.append((step, rank))

    def _rewrite_index(self, rank: int, steps: set[int]) -> None:
        self._close_index(rank)  # the rewritten index is a new file: appended to from here
        path = self._dirs[rank] / fmt.INDEX
        kept = []
        with open(path, "rb") as f:
            for line in f:
                try:
                    record = fmt.parse_index_line(line)
                except ValueError:
                    continue
                if record.get("type") == "step" and record.get("step") in steps:
                    continue
                kept.append(line)
        size, _ = fmt.write_atomic(path, kept)
        self._index_bytes[rank] = size


def _overwrite(path: Path, text: bytes) -> bool:
    """Write ``text`` over ``path`` in place, within its size, padded with spaces: a full disk
    gives no room for the temporary file of an atomic write, but the file's own blocks are
    there. Not atomic (a crash midway leaves it torn), so only when the atomic write failed.
    False when it does not fit or cannot be written."""
    try:
        with open(path, "r+b") as f:
            size = os.fstat(f.fileno()).st_size
            if len(text) + 1 > size:
                return False
            f.write(text + b" " * (size - len(text) - 1) + b"\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        return False
    return True


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def unwritable_reason(directory: str | os.PathLike[str]) -> str:
    """Why a dump cannot be written in ``directory`` (made if missing), or ``""``:
    ``tensordbg run`` says it before the script starts, not as a traceback from its first
    forward."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        return "it is a file, not a directory (give a directory for the dump)"
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        return e.strerror or str(e)
    return "" if os.access(directory, os.W_OK | os.X_OK) else "permission denied"


def _free_key(key: str, names: Mapping[Any, Any], arrays: Mapping[str, Any]) -> str:
    """A file key for an earlier phase's value that no name of the step has."""
    while key in names or key in arrays:
        key += "@"
    return key
