"""The lines of a dump's index as the reader trusts them: one dumped step of one rank
(:class:`IndexStep`) and its tensors (:class:`TensorEntry`), each field checked as it is read
(the index is data from disk)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tensordbg.dump.format import STEP_FILE

# Dumps written before entries said whether they are trainable: what held for them.
_TRAINABLE_KINDS = ("param", "grad", "update")


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One watched tensor of one dumped step, as listed in the index (no tensor data read)."""

    name: str
    module: str
    phase: str
    kind: str
    order: int
    shape: tuple[int, ...]
    dtype: str
    stats: dict[str, float | int]
    has_value: bool
    provenance: dict[str, Any] | None
    step: int = 0
    rank: int = 0
    module_type: str = ""
    call: int = 0
    trainable: bool = False
    """Whether the tensor is (or is the gradient or update of) a parameter that requires grad:
    rules such as VanishingGradient judge only those."""

    @property
    def nothing_to_show(self) -> str:
        """One sentence when the dump holds neither the tensor's values nor any statistic of
        them beyond whether it is finite (a gradient the run judged from another tensor's,
        without keeping it): what is known of it, instead of a row of blanks; "" otherwise."""
        if self.has_value or set(self.stats) - {"finite"}:
            return ""
        finite = self.stats.get("finite")
        known = {None: "the run measured nothing of it", 1.0: "the run knew only that it is "
                 "finite"}.get(finite, "the run knew only that it holds NaN or Inf, not how "
                                       "many or where")  # fmt: skip
        return (f"neither the values of {self.name} nor its statistics were dumped at step "
                f"{self.step}: {known}")  # fmt: skip


MOST = 2**63 - 1  # a step or rank past int64 was not written by tensordbg: no UI could send it


def _count(value: Any, what: str) -> int:
    """A step's or rank's number from the index: a whole number from 0 to 2**63 - 1."""
    number = int(value)
    if number != value or not 0 <= number <= MOST:
        raise ValueError(f"its {what} {value!r} is not a whole number from 0 to 2**63 - 1")
    return number


class IndexStep:
    """One dumped step of one rank, from its line of the index."""

    __slots__ = ("by_name", "entries", "file", "hits", "line", "rank", "raw", "step")

    def __init__(self, record: dict[str, Any]):
        self.raw = record
        self.step = _count(record["step"], "step")
        self.rank = _count(record["rank"], "rank")
        self.file: str | None = record.get("file")
        self.hits = [h for h in record.get("hits", ()) if isinstance(h, dict)]
        self.entries: list[TensorEntry] | None = None
        self.by_name: dict[str, TensorEntry] = {}
        self._build()

    def _build(self) -> None:
        entries = []
        for e in self.raw.get("entries", ()):
            entries.append(
                TensorEntry(
                    name=str(e["name"]),
                    module=str(e.get("module", "")),
                    phase=str(e.get("phase", "")),
                    kind=str(e.get("kind", "")),
                    order=int(e.get("order", len(entries))),
                    shape=tuple(int(d) for d in e.get("shape", ())),
                    dtype=str(e.get("dtype", "")),
                    stats=dict(e.get("stats") or {}),
                    has_value="key" in e,
                    provenance=e.get("provenance"),
                    step=self.step,
                    rank=self.rank,
                    module_type=str(e.get("module_type", "")),
                    call=int(e.get("call", 0)),
                    trainable=bool(e.get("trainable", e.get("kind") in _TRAINABLE_KINDS)),
                )
            )
        entries.sort(key=lambda e: e.order)
        self.entries = entries
        # The last entry of a name is its latest version (and the one holding a value).
        self.by_name = {e.name: e for e in entries}
        self.by_name.update({e.name: e for e in entries if e.has_value})

    def entry(self, name: str, phase: str | None = None) -> TensorEntry | None:
        """The tensor ``name`` of this step: of ``phase`` when given (its last entry there),
        else its latest entry, the one holding its value when one does (a parameter checked in
        the forward and after the optimizer step keeps the value after the step)."""
        if phase is None:
            return self.by_name.get(name)
        found = [e for e in self.entries or () if e.name == name and e.phase == phase]
        return next((e for e in reversed(found) if e.has_value), found[-1] if found else None)


def guess_key(line: bytes, rank: int) -> tuple[int, int]:
    """The (step, rank) a damaged line of the index most likely spoke of; (-1, rank) when it
    cannot tell."""
    marker = b'"step":'
    at = line.find(marker)
    if at >= 0:
        digits = line[at + len(marker) :].split(b",", 1)[0]
        if digits.isdigit() and int(digits) <= MOST:
            return int(digits), rank
        return -1, rank
    named = STEP_FILE.search(line)  # its step number gone, the name of its file left
    if named is not None and int(named.group(1)) <= MOST:
        return int(named.group(1)), rank
    return -1, rank
