"""Mixed precision: a ``torch.amp.GradScaler``'s scaled gradients, and the steps it skips.

Gradient statistics are unscaled (1 / the scale, read once per phase). A step the scaler skips
for non-finite gradients is how mixed precision works, not a problem: its hits are held back
until ``scaler.update()`` says whether the step was skipped, and they are logged only when
``max_skipped_steps`` are skipped in a row (the loss scale cannot absorb the overflow).

Before its first step that is not skipped, the scaler is still finding its scale: from
``init_scale`` 65536 it halves at each skip, and a loss near 3e4 in float16 takes 10 skips to
reach a scale that fits (64). Those skips count only once the scale has fallen below 1, where
halving it cannot help any more: a model that makes a NaN from its first step is still
reported (from 65536, at the 17th skip).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tensordbg.engine.handles import HandleGroup
from tensordbg.statistics import Stat, TensorStats
from tensordbg.statistics.torch_kernels import SCALE_LINEAR, scale_vector

GRAD_KINDS = frozenset({"grad", "grad_output", "grad_input"})


class MixedPrecision:
    """The session's view of a GradScaler (``scaler=None``: nothing is scaled)."""

    def __init__(self, scaler: Any, max_skipped_steps: int):
        self.scaler = scaler if scaler is not None and _enabled(scaler) else None
        self.max_skipped_steps = max_skipped_steps
        self.skipped_steps: list[int] = []
        self.skipped_in_row = 0
        self.calibrated = False
        """Whether the scaler has made a step (it has found a scale that fits)."""
        self.stepped = False
        """Whether an optimizer stepped since the last ``scaler.update()``."""
        self.held: list[tuple[Any, Any]] = []
        """Hits on scaled gradients, held until the scaler says whether it skipped the step."""
        self._inv: dict[Any, Any] = {}

    def adopt(self, scaler: Any, handles: HandleGroup, after_update: Callable[[], None]) -> bool:
        """Take ``scaler`` as the session's, when it has none (``tensordbg run`` finds the
        script's at its first ``scale(loss)``, before that step's backward): whether it did."""
        if self.scaler is not None or not _enabled(scaler):
            return False
        self.scaler = scaler
        self.install(handles, after_update)
        return True

    def install(self, handles: HandleGroup, after_update: Callable[[], None]) -> None:
        """Call ``after_update`` after each ``scaler.update()``."""
        scaler = self.scaler
        if scaler is None:
            return
        original = type(scaler).update.__get__(scaler)

        def update(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            after_update()
            return result

        handles.patch(scaler, "update", update)

    def scales(self, stats: TensorStats) -> bool:
        """Whether these statistics were computed on a scaled gradient."""
        return self.scaler is not None and stats.kind in GRAD_KINDS

    def new_phase(self) -> None:
        self._inv = {}

    def inv_scale(self) -> torch.Tensor | None:
        """1 / the scale, on its device. Computed once per phase: the scale changes only in
        ``scaler.update()``, after the step."""
        if "device" not in self._inv:
            scale = getattr(self.scaler, "_scale", None)
            self._inv["device"] = None if scale is None else 1.0 / scale
        return self._inv["device"]

    def unscale(self, wanted: tuple[Stat, ...] | list[Stat], values: list[float]) -> list[float]:
        """Host values of a scaled gradient, unscaled (one read of the scale per phase)."""
        if "host" not in self._inv:
            inv = self.inv_scale()
            self._inv["host"] = None if inv is None else float(inv.item())
        inv = self._inv["host"]
        if inv is None:
            return values
        return [v * inv if s.name in SCALE_LINEAR else v
                for s, v in zip(wanted, values, strict=True)]  # fmt: skip

    def scale_vector(self, stats: tuple[Stat, ...]) -> torch.Tensor | None:
        """What multiplies a statistics vector of a scaled gradient (cached per phase)."""
        if stats not in self._inv:
            inv = self.inv_scale()
            self._inv[stats] = None if inv is None else scale_vector(stats, inv)
        return self._inv[stats]

    def after_update(self, step: int) -> tuple[bool, list[tuple[Any, Any]]]:
        """After ``scaler.update()``: whether the step was skipped, and the held hits to log
        (all of them when it was not skipped; when it was, only past ``max_skipped_steps`` in a
        row, with a sentence saying so)."""
        self._inv = {}
        skipped = not self.stepped
        self.stepped = False
        held, self.held = self.held, []
        if not skipped:
            self.skipped_in_row = 0
            self.calibrated = True
            return False, held
        self.skipped_steps.append(step)
        self.skipped_in_row += 1
        if self.skipped_in_row < self.max_skipped_steps:
            return True, []
        scale = float(self.scaler.get_scale())
        if not self.calibrated and scale >= 1.0:
            return True, []  # still finding its scale (see the module's docstring)
        for hit, _ in held:
            hit.message += (
                f" The GradScaler skipped {self.skipped_in_row} steps in a row (its scale is now "
                f"{scale:g}): the loss scale cannot absorb this."
            )
        return True, held

    def clear(self) -> None:
        self.scaler = None
        self._inv = {}


def _enabled(scaler: Any) -> bool:
    is_enabled = getattr(scaler, "is_enabled", None)
    return bool(is_enabled()) if callable(is_enabled) else True
