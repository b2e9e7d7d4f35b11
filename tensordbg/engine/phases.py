"""The phase queue: what the hooks saw in one phase (forward, backward, optimizer step), in
execution order, as typed events, and the tensors kept for inspection within a memory budget.

Eager checks handle most events in the hook that saw them; batched and deferred checks queue
them and handle them at the end of the phase (after the one transfer of statistics, or once the
phase showed a problem), in the same order, so every mode names the same origin.
"""

from __future__ import annotations

import math
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from tensordbg.engine.records import Call, Record
from tensordbg.statistics import TensorStats
from tensordbg.statistics.batch import StatsBatch

# Eager mode holds the last few tensors it saw (within retain_bytes), so that a hit's neighbours
# can be shown, e.g. the gradient that came into the module whose backward broke.
EAGER_WINDOW = 8


# --- events, in the order the hooks saw them ------------------------------------------------


@dataclass(slots=True)
class Judged:
    """A record to judge and report (statistics computed, or coming with the phase's transfer)."""

    record: Record


@dataclass(slots=True)
class Enter:
    """A module call started."""

    call: Call


@dataclass(slots=True)
class Exit:
    """A module call returned."""

    call: Call


@dataclass(slots=True)
class Gradient:
    """A judged gradient to attribute (after its record's :class:`Judged`)."""

    record: Record


@dataclass(slots=True)
class ParamGradNote:
    """Deferred mode: a parameter's gradient, noted but not read yet."""

    name: str
    owner: str
    owner_type: str
    grad: torch.Tensor


@dataclass(slots=True)
class ActGradNote:
    """Deferred mode: an activation's gradient. On the host it is screened in its hook and, found
    finite, not kept (holding a pass's activation gradients until it ends costs more than
    reading each one while it is still in the cache: the allocator cannot reuse their memory).
    On a device it is kept (``grad``) and read only if the pass shows a problem: a read in the
    hook would synchronize once per tensor."""

    forward: Record
    shape: torch.Size
    dtype: torch.dtype
    grad: torch.Tensor | None


Event = Judged | Enter | Exit | Gradient | ParamGradNote | ActGradNote


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What the training thread publishes for readers on other threads (the UI's server): made
    at each step's end and whenever the training pauses, never changed afterwards."""

    latest: dict[str, tuple[int, Any]]
    """Each tensor's latest statistics: name -> (step, TensorStats)."""
    calls: dict[str, int]
    """How often each module was called in the last forward."""
    records: list[Record]
    """The watched tensors of the phase, in execution order."""


EMPTY = Snapshot({}, {}, [])


class PhaseQueue:
    """One phase's records, its pending events, its statistics batch and its kept tensors."""

    def __init__(self, retain_bytes: int):
        self.phase = "forward"
        self.records: list[Record] = []
        self.by_ref: dict[int, Record] = {}
        self.pending: list[Event] = []
        self.batch = StatsBatch()
        self.retain_bytes = retain_bytes
        self.retained = 0
        self.window: deque[Record] = deque()
        self._next_ref = 0
        self.kept_norms = -1
        """The batch's slot of the norms of the gradients a deferred pass kept unread."""
        self.kept_finite = True
        """Whether those norms came back finite (a pass without them: True)."""
        self.buffer_norms = -1
        """The batch's slot of the norms of the buffers a forward wrote (engine/buffers.py)."""
        self.buffers_finite = True

    unlisted: tuple[list[Any], list[TensorStats]] | None = None
    """A clean pass's parameter gradients judged without records, and their statistics:
    listed only if something asks before the phase ends (engine/param_grads.py)."""
    released = False
    """Whether the phase ended and let go of its tensors (a pause that comes after it, at a
    job's safe point or a step's end, still lists its records)."""

    def start(self, phase: str) -> None:
        self.release()
        self.released = False
        self.kept_norms, self.kept_finite = -1, True
        self.buffer_norms, self.buffers_finite = -1, True
        self.records = []
        self.by_ref = {}
        self.phase = phase

    def busy(self) -> bool:
        """Whether anything of the phase waits to be handled."""
        return bool(self.pending) or bool(len(self.batch))

    def number(self, record: Record) -> None:
        """Give a record its reference, without a place in the phase (a forward record made for
        a later phase's need: only its place in execution order counts)."""
        record.stats.ref = self._next_ref
        self._next_ref += 1

    def register(self, record: Record) -> None:
        """Give a record its reference (what the UI asks for it by) and its place in the phase."""
        stats = record.stats
        if stats.ref >= 0:
            return
        stats.ref = self._next_ref
        self._next_ref += 1
        if stats.kind not in ("param", "update"):
            stats.phase = self.phase
        self.records.append(record)
        self.by_ref[stats.ref] = record

    def adopt(self, record: Record) -> None:
        """List a record of an earlier phase in this one too, by its reference (several ranks:
        a gradient judged again as the all-reduce left it, at a later optimizer's step)."""
        if self.by_ref.get(record.stats.ref) is not record:
            self.records.append(record)
            self.by_ref[record.stats.ref] = record

    def awaits(self, record: Record, wanted: tuple[Any, ...], slot: int) -> None:
        """A record whose ``wanted`` statistics come with the phase's transfer (batch ``slot``)."""
        record.slot = slot
        record.stats.values = dict.fromkeys(wanted, math.nan)
        record.lazy = False

    def forget(self, records: list[Record]) -> None:
        """Unlist records that turned out to hold nothing to show or judge."""
        if records:
            gone = {id(r) for r in records}
            self.records = [r for r in self.records if id(r) not in gone]
            for record in records:
                self.by_ref.pop(record.stats.ref, None)

    def fetch(self) -> list[Record]:
        """The one transfer of the phase: batched statistics from the device to the host.
        Returns the records whose statistics it brought."""
        if not len(self.batch):
            return []
        values = self.batch.flush()
        if self.kept_norms >= 0:
            self.kept_finite = all(math.isfinite(v) for v in values[self.kept_norms])
            self.kept_norms = -1
        if self.buffer_norms >= 0:
            self.buffers_finite = all(math.isfinite(v) for v in values[self.buffer_norms])
            self.buffer_norms = -1
        filled = []
        for event in self.pending:
            if type(event) is Judged and event.record.slot >= 0:
                record = event.record
                record.stats.values = dict(zip(record.stats.values, values[record.slot],
                                               strict=True))  # fmt: skip
                record.slot = -1
                filled.append(record)
        return filled

    # --- retention -------------------------------------------------------------------------

    def keep_recent(self, record: Record, tensor: torch.Tensor) -> None:
        """Eager mode: keep a tensor among the last EAGER_WINDOW seen (within the budget; a
        hit's stays kept) and hold it weakly anyway: what the training keeps (most activations,
        saved for backward) can still be shown, and what it frees is freed soon (holding every
        freed gradient until the phase ends makes each step fault in fresh memory)."""
        if record.weak is None:
            record.weak = weakref.ref(tensor)
        if record.tensor is not None or record.nbytes > self.retain_bytes:
            return
        window = self.window
        while window and (
            len(window) >= EAGER_WINDOW or self.retained + record.nbytes > self.retain_bytes
        ):
            old = window.popleft()  # the oldest makes room
            self.retained -= old.nbytes
            if not old.findings:
                old.tensor = None
        self.retained += record.nbytes
        record.tensor = tensor
        window.append(record)

    def keep(self, record: Record, tensor: torch.Tensor) -> bool:
        """Keep a tensor until the phase ends, if it fits the budget."""
        if self.take(record.nbytes):
            record.tensor = tensor
            return True
        return False

    def take(self, nbytes: int) -> bool:
        """Count ``nbytes`` more against the phase's memory budget, if they fit."""
        if self.retained + nbytes <= self.retain_bytes:
            self.retained += nbytes
            return True
        return False

    def release(self) -> None:
        """Let go of every tensor of the phase."""
        for record in self.records:
            record.tensor = None
        self.released = True
        self.unlisted = None  # (it holds the gradients)
        self.retained = 0
        self.window.clear()

    def clear(self) -> None:
        """Forget the phase altogether (at detach)."""
        self.release()
        self.records = []
        self.by_ref = {}
        self.pending = []
        self.batch = StatsBatch()


def records_of(events: list[Any]) -> set[int]:
    """The ids of the records whose hits these events, still to be handled, will make."""
    ids = set()
    for event in events:
        record = getattr(event, "record", None)
        if record is not None:
            ids.add(id(record))
        elif type(event) is Exit:
            ids.update(id(r) for _, r in event.call.outputs)
    return ids
