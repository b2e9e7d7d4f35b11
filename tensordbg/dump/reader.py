"""Reading a dump: :func:`load` returns a :class:`Dump`. numpy, ml_dtypes and the standard
library only: this never imports torch, so dumps open where torch is absent.

>>> dump = tensordbg.load("runs/dbg")
>>> dump.steps(), dump.hits[0].module
([0, 10, 12, 20], 'blocks.1.attn')
>>> dump.tensor("blocks.1.attn.output").value(12)[0, :4]      # memory-mapped: reads only that
array([0.1, nan, 0.3, -0.2], dtype=float32)

Listing (steps, hits, statistics) reads only each rank's ``meta.json`` and ``index.jsonl``. A
step whose file is missing, cut short or altered is listed in :attr:`Dump.broken` with a
sentence, and reading it raises :class:`DumpError`; every other step stays readable.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import zlib
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np

from tensordbg.dump import format as fmt
from tensordbg.dump.index import IndexStep, TensorEntry, guess_key
from tensordbg.hit import Hit
from tensordbg.offline.sentences import step_runs

# A tensor up to this size is checked against its checksum when its value is read; larger
# ones are memory-mapped unchecked (a slice must read only that slice): Dump.verify() checks them.
VERIFY_ON_READ = 64 * 2**20
MAPS_KEPT = 64
"""How many steps' files a :class:`Dump` keeps mapped at once. A mapping holds a file
descriptor (Python's ``mmap`` keeps a copy of it), and a dump of thousands of steps read across
them all (``dump.tensor(name)`` at every step, a replay walked end to end) would otherwise run
out of descriptors: 1024 on most Linux desktops, 256 on macOS."""

_HIT_FIELDS = {f.name for f in fields(Hit)}


class DumpError(Exception):
    """A dump (or one file of it) cannot be read; the message is one sentence naming the file."""


class DumpedTensor:
    """One tensor across the dumped steps of one rank.

    >>> t = dump.tensor("fc1.weight.grad")
    >>> t.steps(), t.stats(10)["l2"], t.value(10).dtype
    ([0, 10, 20], 0.82, dtype('float32'))
    """

    def __init__(self, dump: Dump, name: str, rank: int):
        self.dump = dump
        self.name = name
        self.rank = rank

    def __repr__(self) -> str:
        return f"DumpedTensor({self.name!r}, rank={self.rank}, steps={self.steps()})"

    def steps(self) -> list[int]:
        """The steps that list this tensor, in order."""
        return [s for s in self.dump.steps(self.rank) if self._entry_or_none(s) is not None]

    def entry(self, step: int) -> TensorEntry:
        entry = self._entry_or_none(step)
        if entry is None:
            raise DumpError(f"{self.dump._where(step, self.rank)} has no tensor {self.name}")
        return entry

    def stats(self, step: int) -> dict[str, float | int]:
        """The statistics the engine computed for this tensor at ``step``."""
        return dict(self.entry(step).stats)

    def value(self, step: int) -> np.ndarray:
        """The value at ``step``, memory-mapped read-only (bfloat16 and float8 as ml_dtypes
        arrays); DumpError when that step holds no value of it."""
        return self.dump._value(step, self.rank, self.name)

    def _entry_or_none(self, step: int) -> TensorEntry | None:
        step_record = self.dump._step_record(step, self.rank, raising=False)
        if step_record is None:
            return None
        return step_record.by_name.get(self.name)


class Dump:
    """A run directory written by ``attach(dump_dir=...)`` (or :class:`~.writer.DumpWriter`).

    Attributes: ``path``, ``meta`` (the run: ``format_version``, ``run_id``, ``created``,
    ``torch_version``, ``device``, ``argv``, ``rules``, ``complete``, ``reason_incomplete``),
    ``ranks``, ``hits``, ``modules``, ``broken`` ((step, rank) -> sentence; ``(-1, rank)`` for a
    line of the index that names no step it can be trusted for).
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        if not self.path.exists():
            raise DumpError(f"{self.path} does not exist: give the directory of a tensordbg dump")
        if not self.path.is_dir():
            raise DumpError(f"{self.path} is not a directory, so not a tensordbg dump")
        ranks = sorted(
            int(m.group(1))
            for child in self.path.iterdir()
            if (m := fmt.RANK_DIR.match(child.name)) and (child / fmt.META).is_file()
        )
        if not ranks:
            if (self.path / fmt.META).is_file() and fmt.RANK_DIR.match(self.path.name):
                raise DumpError(f"{self.path} is one rank of a dump: open {self.path.parent}")
            raise DumpError(f"{self.path} is not a tensordbg dump (it holds no rank-N/{fmt.META})")
        self.ranks: list[int] = ranks
        self.broken: dict[tuple[int, int], str] = {}
        self.modules: list[dict[str, Any]] = []
        self._metas = {rank: self._read_meta(rank) for rank in ranks}
        self.meta: dict[str, Any] = dict(self._metas[ranks[0]])
        self.meta["complete"] = all(m.get("complete") for m in self._metas.values())
        if not self.meta["complete"]:
            self.meta["reason_incomplete"] = next(
                f"rank {r}: {m.get('reason_incomplete')}"
                if len(ranks) > 1
                else m.get("reason_incomplete")
                for r, m in self._metas.items()
                if not m.get("complete")
            )
        self._steps: dict[tuple[int, int], IndexStep] = {}
        for rank in ranks:
            self._read_index(rank)
        self._maps: OrderedDict[tuple[int, int], tuple[mmap.mmap, int]] = OrderedDict()
        self._checked: set[tuple[int, int, str]] = set()

    def __repr__(self) -> str:
        return f"<Dump {self.path} run {self.meta.get('run_id')} steps={len(self._steps)}>"

    # --- listing -------------------------------------------------------------------------------

    def steps(self, rank: int | None = None) -> list[int]:
        """The dumped steps, sorted (of one rank, or of any)."""
        return sorted({s for s, r in self._steps if rank is None or r == rank})

    @property
    def hits(self) -> list[Hit]:
        """Every hit recorded in the dump, with the fields it had live, in step order."""
        hits = []
        for key in sorted(self._steps, key=lambda k: (k[0], k[1])):
            for h in self._steps[key].hits:
                hits.append(Hit(**{k: v for k, v in h.items() if k in _HIT_FIELDS}))
        hits.sort(key=lambda h: (h.step, h.id))
        return hits

    def tensors(self, step: int, rank: int = 0) -> list[TensorEntry]:
        """The watched tensors of a step, in execution order."""
        return list(self._step_record(step, rank).entries or ())

    def indexed(self, step: int, rank: int = 0) -> list[TensorEntry] | None:
        """The tensors of a step as its index line lists them, with their statistics, even when
        its values file is broken (cut, a checksum that fails); None without a whole line."""
        record = self._steps.get((step, rank))
        return None if record is None else list(record.entries or ())

    def tensor(self, name: str, rank: int = 0) -> DumpedTensor:
        """One tensor across steps: its statistics and values; DumpError when no readable
        step lists it (with the names closest to it)."""
        if rank not in self._metas:
            raise DumpError(f"{self.path} has no rank {rank} (ranks: {self.ranks})")
        tensor = DumpedTensor(self, name, rank)
        if not any(tensor._entry_or_none(step) for step in self.steps(rank)):  # the first will do
            broken = sorted(key[0] for key, r in self._steps.items() if key[1] == rank
                            and key in self.broken and name in r.by_name)  # fmt: skip
            if broken:  # listed, in steps whose values cannot be read: say why, not "no step"
                why = self.broken[broken[0], rank]
                raise DumpError(f"{name!r} is dumped only in step {broken[0]}"
                                f"{' and others' if len(broken) > 1 else ''} of {self.path}, "
                                f"which cannot be read: {why}")  # fmt: skip
            import difflib

            names = {e.name for key, r in self._steps.items() if key[1] == rank
                     for e in r.entries or ()}  # fmt: skip
            close = difflib.get_close_matches(name, sorted(names), n=3)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise DumpError(f"no step of {self.path} (rank {rank}) lists a tensor {name!r}{hint}")
        return tensor

    def step_hits(self, step: int, rank: int = 0) -> list[Hit]:
        """The hits of one step."""
        return [
            Hit(**{k: v for k, v in h.items() if k in _HIT_FIELDS})
            for h in self._step_record(step, rank).hits
        ]

    def numbers(self, step: int, rank: int = 0) -> dict[str, Any]:
        """The step's loss, gradient norm and rate as the session measured them ({} when the
        step was written before it ended, as a step that stopped on a hit)."""
        return dict(self._step_record(step, rank).raw.get("numbers") or {})

    def verify(self, ranks: Iterable[int] | None = None, steps: Iterable[int] | None = None,
               max_bytes: int | None = None) -> dict[tuple[int, int], str]:  # fmt: skip
        """Read every file (of ``ranks`` and ``steps``, all by default; none larger than
        ``max_bytes``) whole and check its checksums (its header's and each tensor's); what
        fails joins :attr:`broken`, which is returned.

        >>> dump.verify([0], steps=[12]).get((12, 0), "")   # the file of one step only
        ''
        """
        ranks = set(self.ranks if ranks is None else ranks)
        chosen = None if steps is None else set(steps)
        for key, record in sorted(self._steps.items()):
            if key in self.broken or record.file is None or key[1] not in ranks:
                continue
            if (chosen is not None and key[0] not in chosen) or (
                max_bytes is not None and os.path.getsize(self._file(record)) > max_bytes
            ):
                continue
            # A file mapped only to be checked is closed after it: a mapping holds a descriptor,
            # and a dump of thousands of steps would run out of them.
            kept = self._maps.get(key)
            try:
                buffer, data_start = kept or self._open(record)
            except DumpError:
                continue
            try:
                self._verify_file(record, buffer, data_start)
            finally:
                if kept is None and isinstance(buffer, mmap.mmap):
                    buffer.close()
        return dict(self.broken)

    def _verify_file(self, record: IndexStep, buffer: Any, data_start: int) -> None:
        with memoryview(buffer) as whole:
            for raw in record.raw.get("entries", ()):
                if "key" not in raw:
                    continue
                start, end = raw["offsets"]
                with whole[data_start + start : data_start + end] as view:
                    crc = zlib.crc32(view)
                if crc != raw.get("crc"):
                    self.broken[(record.step, record.rank)] = (
                        f"{self._file(record)} fails its checksum at {raw['name']}: its bytes "
                        "changed after writing"
                    )
                    return
                self._checked.add((record.step, record.rank, raw["name"]))

    # --- inside --------------------------------------------------------------------------------

    def _where(self, step: int, rank: int) -> str:
        return f"step {step} of rank {rank} in {self.path}"

    def _read_meta(self, rank: int) -> dict[str, Any]:
        path = fmt.rank_dir(self.path, rank) / fmt.META
        try:
            meta = json.loads(path.read_bytes())
        except (OSError, ValueError) as e:
            raise DumpError(f"{path} cannot be read as the dump's metadata ({e})") from None
        if not isinstance(meta, dict):
            raise DumpError(f"{path} is not the dump's metadata (not a JSON object)")
        version = meta.get("format_version")
        if version is None:
            raise DumpError(f"{path} is not the dump's metadata (it names no format_version)")
        if version != fmt.FORMAT_VERSION:
            raise DumpError(
                f"{path} has format version {version!r}; this tensordbg reads version "
                f"{fmt.FORMAT_VERSION} (open it with the tensordbg that wrote it)"
            )
        return meta

    def _read_index(self, rank: int) -> None:
        path = fmt.rank_dir(self.path, rank) / fmt.INDEX
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise DumpError(f"{path} is missing: the dump has no index of its steps") from None
        except OSError as e:
            raise DumpError(f"{path} cannot be read ({e.strerror})") from None
        expected = self._metas.get(rank, {}).get("index_bytes")
        if isinstance(expected, int) and len(data) < expected:
            # Whole lines gone (a copy cut short, a disk that lost them): no line's checksum
            # can tell, the length the writer noted in meta.json can.
            self.broken[(-1, rank)] = (
                f"{path} is cut short ({len(data)} of {expected} bytes): the steps after its "
                "last line are missing"
            )
        lines = data.splitlines(keepends=True)
        for number, line in enumerate(lines, 1):
            try:
                record = fmt.parse_index_line(line)
            except ValueError as e:
                if number == len(lines) and not line.endswith(b"\n"):
                    break  # the writer was killed while appending: the earlier steps stand
                key = guess_key(line, rank)
                self.broken[key] = f"{path} line {number}: {e}"
                continue
            kind = record.get("type")
            try:
                if kind == "step":
                    step = IndexStep(record)
                    if step.rank != rank:  # its folder renamed: every step would go unseen
                        raise DumpError(
                            f"{path} lists the steps of rank {step.rank}, not rank {rank}: its "
                            f"folder was renamed (the writer named it rank-{step.rank})"
                        )
                    key = (step.step, step.rank)
                    self._steps[key] = step
                    self.broken.pop(key, None)
                    self._check_file(step)
                elif kind == "modules":
                    self.modules = list(record.get("modules") or [])
            except (KeyError, TypeError, ValueError) as e:
                self.broken[guess_key(line, rank)] = f"{path} line {number} is malformed ({e})"

    def _file(self, record: IndexStep) -> Path:
        return fmt.rank_dir(self.path, record.rank) / str(record.file)

    def _check_file(self, record: IndexStep) -> None:
        """What costs no read: the file is there, with the size it was written with."""
        if record.file is None:
            return
        path = self._file(record)
        key = (record.step, record.rank)
        try:
            size = path.stat().st_size
        except OSError:
            self.broken[key] = f"{path} is missing"
            return
        if not path.is_file():  # a directory's size is no file's
            self.broken[key] = f"{path} is not a file"
            return
        expected = record.raw.get("nbytes")
        if size != expected:
            self.broken[key] = (
                f"{path} is truncated ({size} of {expected} bytes)"
                if size < (expected or 0)
                else f"{path} has {size} bytes where {expected} were written"
            )

    def _step_record(self, step: int, rank: int, raising: bool = True) -> IndexStep | None:
        key = (step, rank)
        if key in self.broken:
            if not raising:
                return None
            raise DumpError(self.broken[key])
        record = self._steps.get(key)
        if record is None and raising:
            steps = self.steps(rank)
            listed = f"steps {step_runs(steps)}" if steps else "no steps"
            raise DumpError(f"{self._where(step, rank)} was not dumped ({listed} were)")
        return record

    def _value(self, step: int, rank: int, name: str) -> np.ndarray:
        record = self._step_record(step, rank)
        assert record is not None
        entry = record.by_name.get(name)
        if entry is None:
            raise DumpError(f"{self._where(step, rank)} has no tensor {name}")
        if not entry.has_value:
            raise DumpError(
                f"{self._where(step, rank)} holds statistics of {name} but not its value "
                "(dump_tensors= chooses which values a periodic step keeps)"
            )
        raw = next(e for e in record.raw["entries"] if e.get("key") and e["name"] == name)
        buffer, data_start = self._map(record)
        start, end = raw["offsets"]
        dtype = fmt.stored_dtype(entry.dtype)
        path = self._file(record)
        if dtype is None:
            raise DumpError(f"{path} holds {name} as {entry.dtype}, which this reader cannot read")
        count = (end - start) // dtype.itemsize
        if data_start + end > len(buffer) or count != int(np.prod(entry.shape, dtype=np.int64)):
            raise DumpError(f"{path} does not hold {name} where its index says")
        check = (step, rank, name)
        if check not in self._checked and end - start <= VERIFY_ON_READ:
            if zlib.crc32(memoryview(buffer)[data_start + start : data_start + end]) != raw.get(
                "crc"
            ):
                message = f"{path} fails its checksum at {name}: its bytes changed after writing"
                self.broken[(step, rank)] = message
                raise DumpError(message)
            self._checked.add(check)
        array = np.frombuffer(buffer, dtype=dtype, count=count, offset=data_start + start)
        return array.reshape(entry.shape)

    def _map(self, record: IndexStep) -> tuple[mmap.mmap, int]:
        key = (record.step, record.rank)
        cached = self._maps.get(key)
        if cached is not None:
            self._maps.move_to_end(key)
            return cached
        cached = self._maps[key] = self._open(record)
        while len(self._maps) > MAPS_KEPT:  # the least recently read goes
            buffer, _ = self._maps.popitem(last=False)[1]
            if isinstance(buffer, mmap.mmap):
                # Arrays that still view it keep it open until the last of them goes.
                with contextlib.suppress(BufferError):
                    buffer.close()
        return cached

    def _open(self, record: IndexStep) -> tuple[mmap.mmap, int]:
        """The step's file memory-mapped, and where its data starts; DumpError (and the step
        broken) when it cannot be read or its header is not the one written."""
        key = (record.step, record.rank)
        path = self._file(record)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        except OSError as e:
            message = f"{path} cannot be read ({e.strerror or e})"
            self.broken[key] = message
            raise DumpError(message) from None
        data_start = int(record.raw.get("data_start", 0))
        header = buffer[:data_start]
        if len(header) < 8 or zlib.crc32(header) != record.raw.get("header_crc"):
            message = f"{path} fails its checksum in its header: it is not the file written"
            self.broken[key] = message
            raise DumpError(message)
        return buffer, data_start  # type: ignore[return-value]


def load(path: str | os.PathLike[str]) -> Dump:
    """Open a dump written by ``attach(dump_dir=...)``; DumpError when it cannot be read.

    >>> dump = tensordbg.load("runs/dbg")
    >>> [h.tensor for h in dump.hits]
    ['fc1.output']
    """
    return Dump(path)
