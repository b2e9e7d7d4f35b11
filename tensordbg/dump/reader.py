"""Reading a dump: :func:`load` returns a :class:`Dump`. numpy, ml_dtypes and the standard
library only: this never imports torch, so dumps open where torch is absent.

>>> dump = tensordbg.load("runs/dbg")
>>> dump.steps(), dump.hits[0].module
([0, 10, 12, 20], 'blocks.1.attn')
>>> dump.tensor("blocks.1.attn.output").value(12)[0, :4]      # memory-mapped: reads only that
array([0.1, nan, 0.3, -0.2], dtype=float32)

Listing reads only each rank's ``meta.json`` and ``index.jsonl``. A step (or rank) that cannot
be read is in :attr:`Dump.broken` with a sentence; every other stays readable.
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
    """One tensor across the dumped steps of one rank: of one ``phase``, or (``phase=None``)
    its latest entry in each step, the one holding its value when one does.

    >>> t = dump.tensor("fc1.weight.grad")
    >>> t.steps(), t.stats(10)["l2"], t.value(10).dtype
    ([0, 10, 20], 0.82, dtype('float32'))
    """

    def __init__(self, dump: Dump, name: str, rank: int, phase: str | None = None):
        self.dump = dump
        self.name = name
        self.rank = rank
        self.phase = phase

    def __repr__(self) -> str:
        phase = f", phase={self.phase!r}" if self.phase is not None else ""
        return f"DumpedTensor({self.name!r}, rank={self.rank}{phase}, steps={self.steps()})"

    def steps(self) -> list[int]:
        """The steps that list this tensor, in order."""
        return [s for s in self.dump.steps(self.rank) if self._entry_or_none(s) is not None]

    def entry(self, step: int) -> TensorEntry:
        entry = self._entry_or_none(step)
        if entry is None:
            phase = f" in its {self.phase} phase" if self.phase is not None else ""
            raise DumpError(f"{self.dump._where(step, self.rank)} has no tensor {self.name}{phase}")
        return entry

    def stats(self, step: int) -> dict[str, float | int]:
        """The statistics the engine computed for this tensor at ``step``."""
        return dict(self.entry(step).stats)

    def value(self, step: int) -> np.ndarray:
        """The value at ``step``, memory-mapped read-only (bfloat16 and float8 as ml_dtypes
        arrays); DumpError when that step holds no value of it (of its phase)."""
        self.dump._step_record(step, self.rank)  # a broken step: the dump's own sentence
        return self.dump._value(self.entry(step))

    def _entry_or_none(self, step: int) -> TensorEntry | None:
        step_record = self.dump._step_record(step, self.rank, raising=False)
        if step_record is None:
            return None
        return step_record.entry(self.name, self.phase)


class Dump:
    """A run directory written by ``attach(dump_dir=...)`` (or :class:`~.writer.DumpWriter`).

    Attributes: ``path``, ``meta`` (the run: ``format_version``, ``run_id``, ``created``,
    ``torch_version``, ``device``, ``argv``, ``rules``, ``complete``, ``reason_incomplete``),
    ``ranks`` (those whose metadata can be read), ``hits``, ``modules``, ``broken`` ((step,
    rank) -> sentence; ``(-1, rank)`` for a rank's metadata that cannot be read, or its index
    cut short or a line of it that names no step it can be trusted for: then ``meta["complete"]``
    is False, as when the run recorded it so, and ``meta["reason_incomplete"]`` says why).
    ``broken`` holds at load what costs no read of a values file: an index line that cannot be
    read, a values file missing or of the wrong size. A file whose bytes changed but whose size
    did not joins it only when :meth:`verify` reads it, or a value read fails its checksum.
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
            if (m := fmt.RANK_DIR.match(child.name))
            and ((child / fmt.META).is_file() or (child / fmt.INDEX).is_file())  # (meta lost)
        )
        if not ranks:
            if (self.path / fmt.META).is_file() and fmt.RANK_DIR.match(self.path.name):
                raise DumpError(f"{self.path} is one rank of a dump: open {self.path.parent}")
            raise DumpError(f"{self.path} is not a tensordbg dump (it holds no rank-N/{fmt.META})")
        self.broken: dict[tuple[int, int], str] = {}
        self.modules: list[dict[str, Any]] = []
        self._metas: dict[int, dict[str, Any]] = {}
        for rank in ranks:  # a rank whose metadata cannot be read is lost alone
            try:
                self._metas[rank] = self._read_meta(rank)
            except DumpError as e:
                if len(ranks) == 1:
                    raise
                self.broken[-1, rank] = str(e)
        if not self._metas:
            raise DumpError(" ".join(self.broken.values()))
        self.ranks: list[int] = (ranks := sorted(self._metas))
        self._steps: dict[tuple[int, int], IndexStep] = {}
        for rank in ranks:
            self._read_index(rank)
        # Incomplete as the run recorded it, or as the index is found: cut short, or a line
        # that names no step it can be trusted for (which steps the dump holds is unknown).
        reasons = {r: m.get("reason_incomplete") for r, m in self._metas.items()
                   if not m.get("complete")}  # fmt: skip
        for (step, rank), why in self.broken.items():
            if step == -1 and rank not in reasons:
                reasons[rank] = why
        self.meta: dict[str, Any] = dict(self._metas[ranks[0]])
        self.meta["complete"] = not reasons
        if reasons:
            self.meta["reason_incomplete"] = next(
                f"rank {r}: {why}" if len(ranks) > 1 else why for r, why in sorted(reasons.items())
            )
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

    def tensor(self, name: str, rank: int = 0, phase: str | None = None) -> DumpedTensor:
        """One tensor across steps: its statistics and values; DumpError when no readable
        step lists it (with the names closest to it).

        A step may list a name more than once: a parameter is checked in the forward and again
        after the optimizer step, and its value is dumped once, the latest. By default each
        step's latest entry of the name is returned (the one holding the value, when one does);
        ``phase=`` ("forward", "backward", "optimizer") picks that phase's entry.

        >>> dump.tensor("fc.weight", phase="forward").stats(6)["posinf"]   # before the step
        1
        """
        if rank not in self._metas:
            raise DumpError(f"{self.path} has no rank {rank} (ranks: {self.ranks})")
        tensor = DumpedTensor(self, name, rank, phase)
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
            if phase is not None and names and name in names:
                raise DumpError(f"no step of {self.path} (rank {rank}) lists {name!r} in the "
                                f"{phase} phase")  # fmt: skip
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
                self._checked.add((record.step, record.rank, raw["key"]))

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
        lines = data.splitlines(keepends=True)
        altered: list[tuple[int, int, str, bytes]] = []  # lines that fail their checksum
        listed: list[tuple[int, int]] = []  # (line number, step) of the whole lines
        cut = False
        for number, line in enumerate(lines, 1):
            try:
                record = fmt.parse_index_line(line)
            except ValueError as e:
                if number == len(lines) and not line.endswith(b"\n"):
                    cut = True  # the writer was killed while appending: the earlier steps stand
                    break
                altered.append((number, guess_key(line, rank)[0], str(e), line))
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
                    listed.append((number, step.step))
                    self._check_file(step)
                elif kind == "modules":
                    self.modules = list(record.get("modules") or [])
            except (KeyError, TypeError, ValueError) as e:
                self._lose(guess_key(line, rank), f"{path} line {number} is malformed ({e})")
        for number, step, why, line in altered:
            if _trusted_step(step, number, line, listed):
                self.broken.setdefault((step, rank), f"{path} line {number}: {why}")
            else:  # the step it names may be what changed: which step it listed is unknown
                seems = f" (it reads as step {step})" if step >= 0 else ""
                what = ("the module tree" if b'"type":"modules"' in line[:64]
                        else f"which step it listed cannot be told{seems}")  # fmt: skip
                self._lose((-1, rank), f"{path} line {number} was altered ({why}): {what}")
        expected = self._metas.get(rank, {}).get("index_bytes")
        if isinstance(expected, int) and len(data) < expected and (cut or not altered):
            size = f"({len(data)} of {expected} bytes)"  # whole lines gone: meta.json tells
            ends = not cut and self._metas[rank].get("last_step") in {s for _, s in listed}
            self._lose((-1, rank), f"{path} lacks lines before its last {size}: a copy or an edit "
                       "lost them, which steps is unknown" if ends else f"{path} is cut short "
                       f"{size}: the steps after its last line are missing")  # fmt: skip

    def _lose(self, key: tuple[int, int], why: str) -> None:
        """``why`` joins what is said of ``key`` (several lines may name no step)."""
        said = self.broken.get(key)
        self.broken[key] = why if said is None or why in said else f"{said}; {why}"

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

    def _value(self, entry: TensorEntry) -> np.ndarray:
        step, rank, name = entry.step, entry.rank, entry.name
        record = self._step_record(step, rank)
        assert record is not None
        if not entry.has_value:
            latest = record.by_name.get(name)
            if latest is not None and latest.has_value:  # the same name, a later phase
                raise DumpError(
                    f"{self._where(step, rank)} holds statistics of {name} in its {entry.phase} "
                    f"phase but not that value: the value dumped is the one of its "
                    f"{latest.phase} phase (phase={latest.phase!r})"
                )
            raise DumpError(
                f"{self._where(step, rank)} holds statistics of {name} but not its value "
                "(dump_tensors= chooses which values a periodic step keeps)"
            )
        held = [e for e in record.raw["entries"] if e.get("key") and e["name"] == name]
        raw = next((e for e in held if e.get("order") == entry.order), held[0])  # its phase's
        buffer, data_start = self._map(record)
        start, end = raw["offsets"]
        dtype = fmt.stored_dtype(entry.dtype)
        path = self._file(record)
        if dtype is None:
            raise DumpError(f"{path} holds {name} as {entry.dtype}, which this reader cannot read")
        count = (end - start) // dtype.itemsize
        if data_start + end > len(buffer) or count != int(np.prod(entry.shape, dtype=np.int64)):
            raise DumpError(f"{path} does not hold {name} where its index says")
        check, crc = (step, rank, raw["key"]), raw.get("crc")
        if check not in self._checked and end - start <= VERIFY_ON_READ:
            if zlib.crc32(memoryview(buffer)[data_start + start : data_start + end]) != crc:
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


def _trusted_step(step: int, number: int, line: bytes, listed: list[tuple[int, int]]) -> bool:
    """Whether a line that fails its checksum can still be taken to speak of ``step``: the
    number may be what changed, so it must agree with the file the line names (when it names
    one), no whole line may list that step, and it must lie between the steps of the whole
    lines around it (the writer appends steps in order)."""
    if step < 0 or any(s == step for _, s in listed):
        return False
    named = fmt.STEP_FILE.search(line)
    if named is not None and int(named.group(1)) != step:
        return False
    before = [s for n, s in listed if n < number]
    after = [s for n, s in listed if n > number]
    return (not before or before[-1] < step) and (not after or step < after[0])


def load(path: str | os.PathLike[str]) -> Dump:
    """Open a dump written by ``attach(dump_dir=...)``; DumpError when it cannot be read.

    >>> dump = tensordbg.load("runs/dbg")
    >>> [h.tensor for h in dump.hits]
    ['fc1.output']
    """
    return Dump(path)
