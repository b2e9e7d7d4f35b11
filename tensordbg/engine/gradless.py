"""Trainable parameters an optimizer steps that never get a gradient.

A parameter whose gradient stays ``None`` is not learning, and no rule sees it: there is no
gradient to judge, and ``WeightNotChanging`` leaves out a step that gave a parameter no gradient
(a branch the step did not run). It is a classic bug: an encoder under
``torch.utils.checkpoint(use_reentrant=True)`` whose inputs need no gradient, a branch cut by
``.detach()``, a module the forward never calls. Over the first :data:`WATCH_STEPS` optimizer
steps each parameter is looked at once per step, before the update (a walk over the optimizer's
parameters, no tensor read); those that never had a gradient are named once, in the log and on
stderr, and the watch ends. Not a hit: a parameter left out on purpose (a pooler a masked
language model does not use) is a fact to know, not a reason to stop the training.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import Any

WATCH_STEPS = 50
"""Optimizer steps a parameter may go without a gradient before it is named."""


class Gradless:
    """The watch of one session (``session.gradless``); :meth:`note` at each optimizer step."""

    def __init__(self, log: Callable[[str, str], None]):
        self._log = log
        self._first: int | None = None  # the first step watched
        self._had: set[str] = set()  # the parameters that had a gradient at some step
        self._stepped: dict[str, None] = {}  # every trainable parameter stepped, in order
        self.done = False

    def note(self, owned: Iterable[Any], step: int) -> None:
        """Before an optimizer's update: which of its parameters (``Param``) have a gradient."""
        if self.done:
            return
        if self._first is None:
            self._first = step
        for p in owned:
            param = p.param
            if param.requires_grad:
                self._stepped[p.name] = None
                if param.grad is not None:
                    self._had.add(p.name)
        if step - self._first + 1 >= WATCH_STEPS:
            self.done = True
            self._say(step - self._first + 1)

    def _say(self, steps: int) -> None:
        never = [name for name in self._stepped if name not in self._had]
        self._had, self._stepped = set(), {}
        if not never:
            return
        shown = ", ".join(never[:6]) + (f" and {len(never) - 6} more" if len(never) > 6 else "")
        said = (f"{len(never)} trainable parameter{'s' * (len(never) > 1)} the optimizer steps "
                f"had no gradient in {steps} steps: {shown}. Nothing the loss depends on reaches "
                "them: a branch cut by .detach(), torch.utils.checkpoint(use_reentrant=True) "
                "with no input that needs a gradient, a module the forward does not call. (Left "
                "out on purpose? Give the optimizer only what trains.)")  # fmt: skip
        self._log(said, "warning")
        print(f"tensordbg: {said}", file=sys.stderr, flush=True)
