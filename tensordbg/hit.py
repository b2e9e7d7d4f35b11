"""What a watchpoint reports: :class:`Hit`, and :class:`WatchpointHit` for ``on_hit="raise"``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

CARRIED_KINDS = ("grad", "param", "update")
"""The kinds of tensor whose NaN the gradient all-reduce carries from one rank to the others."""


@dataclass(slots=True)
class Hit:
    """One watchpoint that fired on one tensor.

    >>> hit = session.hits[0]
    >>> hit.rule, hit.module, hit.kind, hit.step, hit.origin
    ('NaN', 'layers.1.attn', 'output', 12, True)
    >>> print(hit.message)
    layers.1.attn.output holds 16 NaN among 32768 values. ... It was produced here: this module's
    inputs and parameters were clean.
    """

    rule: str
    """The rule's class name, e.g. ``"NaN"``."""
    tensor: str
    """Display name of the tensor, e.g. ``"layers.1.attn.output"``."""
    module: str
    """Path from ``model.named_modules()``; ``""`` is the root model."""
    kind: str
    """``input``, ``output``, ``grad_output``, ``grad_input``, ``param``, ``grad``, ``update``,
    ``buffer`` (one a forward wrote: BatchNorm's running statistics) or ``observed``."""
    step: int
    """Optimizer steps completed before this hit (without an optimizer: root forward calls)."""
    phase: str
    """``forward``, ``backward`` or ``optimizer``; ``attach`` for attach's check of the
    parameters (before step 0), ``check`` for :meth:`Session.check_parameters` between steps."""
    origin: bool
    """True where the problem was produced; False where a value was only passed on."""
    value: float
    threshold: float | None
    message: str
    id: int = -1
    """Session-unique number, in the order hits were found."""
    ref: int = -1
    """The record of the tensor within its phase; the server resolves it while it is retained."""
    call: int = 0
    """Which call of the module within the root forward (a shared module is called several
    times)."""
    summary: dict[str, Any] = field(default_factory=dict)
    """The tensor's shape and dtype, and its one-glance statistics
    (``tensordbg.statistics.Summary``) when they were computed (for hits at their origin)."""
    rank: int = 0
    """The rank of the process that found it (``RANK`` of a ``torchrun`` job; 0 alone)."""
    stored_as: str = ""
    """The name the tensor itself is listed (and dumped) under when the hit names the module
    call whose own code made it rather than the submodule that returned it (``attn.output``,
    listed as ``attn.proj.output``); "" when it is ``tensor``."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        where = "origin" if self.origin else "passed on"
        head = f"[{self.rule}] {self.tensor} step {self.step} {self.phase} ({where})"
        return f"{head}: {self.message}"


class WatchpointHit(RuntimeError):
    """Raised into the training loop by ``on_hit="raise"``; ``.hit`` is the origin hit.

    >>> try:
    ...     train()
    ... except tensordbg.WatchpointHit as e:
    ...     print(e.hit.module)
    """

    def __init__(self, hit: Hit, message: str | None = None):
        super().__init__(hit.message if message is None else message)
        self.hit = hit
        self.summary_after = ""
        """The hits' summary, printed after the traceback when nobody catches it."""


def said_of(sentence: str, stored: str, name: str) -> str:
    """A finding's sentence about the tensor ``stored`` said of ``name``: a value named where it
    was made (``gate.grad_input[0]``), not under the name it is stored (``b1.grad_output``)."""
    if name == stored or not sentence.startswith(stored):
        return sentence
    return name + sentence[len(stored) :]
