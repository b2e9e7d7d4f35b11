"""Where the model's bad outputs go: into a loss of the same step (:func:`reached_from`), or
back in as an input of a later step (:class:`CarriedStates`), where they are passed on, not a
new origin in the batch.

An RNN's hidden state (``out, h = rnn(x, h); h = h.detach()``), a memory or a cache: after a
step whose forward made a NaN, every later step gets it back with its inputs. A root input is
judged in the step it comes in, so without this each later step names it an origin that "came
in with the batch". A tensor is told to be an earlier output by its memory: the same storage,
still alive (a weak reference to it), and the same place and layout in it (``detach()`` and
views of the same region share them). Only outputs that showed a condition are remembered, a
few at most: a clean step costs nothing.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, NamedTuple

from torch.multiprocessing.reductions import StorageWeakRef

from tensordbg.engine.records import Record, memory_of
from tensordbg.rules.base import Finding
from tensordbg.statistics.torch_kernels import watchable

_KEPT = 16  # bad outputs remembered at most (the latest)


class Carried(NamedTuple):
    storage: StorageWeakRef
    where: tuple[Any, ...]
    step: int
    name: str
    conditions: frozenset[int]

    def said(self, finding: Finding) -> Finding:
        """The finding of the input it came back as, saying so."""
        return replace(finding, message=f"{finding.message} It is {self.name} of step "
                       f"{self.step}, handed back in (a state carried across steps, such as "
                       "an RNN's hidden state).")  # fmt: skip


class CarriedStates:
    """The model's latest outputs that showed a condition, as later steps may get them back."""

    def __init__(self) -> None:
        self._outputs: list[Carried] = []

    def remember(self, outputs: list[Record]) -> None:
        """A root call's outputs that showed a condition (their tensors still held)."""
        for r in outputs:
            t = r.held()
            if watchable(t):
                self._outputs = [*self._outputs[-(_KEPT - 1) :], Carried(
                    StorageWeakRef(t.untyped_storage()), memory_of(t), r.stats.step, r.stats.name,
                    frozenset(r.conditions))]  # fmt: skip

    def handed_back(self, record: Record) -> Carried | None:
        """The bad output of an earlier step that a root input showing a condition is."""
        t = record.held() if record.conditions and self._outputs else None
        if not watchable(t):
            return None
        where = memory_of(t)
        for out in reversed(self._outputs):
            if (out.step < record.stats.step and out.where == where
                    and not out.storage.expired()
                    and StorageWeakRef(t.untyped_storage()) == out.storage):  # fmt: skip
                return out
        return None


_GRAPH_LIMIT = 100_000  # autograd nodes walked from a loss at most (a bad step only)


def reached_from(record: Record, fired_roots: list[tuple[frozenset[int], list[Any]]]) -> set[int]:
    """The conditions of the step's root outputs that an observed tensor was computed from:
    a loss of two root calls (``model(a) - model(b)``) comes of the first too, not only of the
    latest. Found by walking its autograd graph; without one (no gradients) every root output
    of the step counts, and so does an output whose node is not known."""
    if not fired_roots:
        return set()
    loss = record.held()
    node = getattr(loss, "grad_fn", None)
    if node is None:
        return set().union(*(fired for fired, _ in fired_roots))
    wanted: dict[Any, frozenset[int]] = {}
    found: set[int] = set()
    for fired, nodes in fired_roots:
        for output in nodes:
            if output is None:
                found |= fired  # it cannot be told: counted
            else:
                wanted[output] = wanted.get(output, frozenset()) | fired
    seen, todo = {node}, [node]
    while todo and wanted and len(seen) < _GRAPH_LIMIT:
        current = todo.pop()
        found |= wanted.pop(current, frozenset())
        for parent, _ in current.next_functions:
            if parent is not None and parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return found
