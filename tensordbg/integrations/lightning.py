"""tensordbg for Lightning (``lightning`` or ``pytorch_lightning``): one callback.

>>> from tensordbg.integrations.lightning import TensordbgCallback
>>> callback = TensordbgCallback(on_hit="record")
>>> Trainer(max_epochs=1, callbacks=[callback]).fit(module, loader)
>>> callback.session.hits

At train start the callback attaches to the LightningModule, the trainer's optimizers and the
precision plugin's GradScaler (``precision="16-mixed"``). A step is an optimizer step:
``hit.step`` is ``trainer.global_step`` at the time, whatever ``accumulate_grad_batches``, a
resumed training's and a second ``fit``'s too. With several optimizers (manual optimization,
a GAN's two) a step is one step of each, and ``global_step``, which counts every optimizer's
steps, is ``hit.step`` times their number.
Lightning runs the forward and backward inside ``optimizer.step(closure)``; tensordbg takes the
gradients as final when that closure has returned. The loss Lightning back-propagates is
observed (times ``accumulate_grad_batches``, which Lightning divided it by).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from typing import Any

_BASES: list[type] = []
for _package in ("lightning.pytorch", "pytorch_lightning"):
    with contextlib.suppress(ImportError):
        _BASES.append(importlib.import_module(_package).Callback)
if not _BASES:  # pragma: no cover - the extra is installed in development
    raise ImportError(
        "tensordbg.integrations.lightning needs Lightning: pip install 'tensordbg[lightning]' "
        "(or have lightning installed)"
    )

from tensordbg.integrations.frameworks import TrainingWatch  # noqa: E402


# With both packages installed, the callback is a Callback of each, so either Trainer takes it.
class TensordbgCallback(*_BASES, TrainingWatch):  # type: ignore[misc]
    """Watch a Lightning training; takes ``tensordbg.attach``'s keyword arguments but the model,
    optimizer and scaler, which come from the trainer.

    >>> callback = TensordbgCallback(on_hit="raise", rules=[tensordbg.rules.NaN()])
    >>> Trainer(max_epochs=3, callbacks=[callback]).fit(module, loader)
    """

    def __init__(self, **attach_args: Any):
        TrainingWatch.__init__(self, attach_args)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        # global_step counts each optimizer's steps; a tensordbg step is one of each (a GAN's
        # two optimizers: two of global_step).
        step = int(trainer.global_step) // max(1, len(trainer.optimizers))
        self.begin(pl_module, trainer.optimizers, scaler, trainer.global_rank, step)

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        if pl_module.training:  # not a backward of the user's own in validation
            self.observe_loss(loss, float(trainer.accumulate_grad_batches))

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.end()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.end()


def add_callback(trainer: Any, make: Callable[[type], TrainingWatch]) -> None:
    """Give a trainer a callback made by ``make`` unless it has one (``tensordbg run``)."""
    if not any(isinstance(c, TensordbgCallback) for c in trainer.callbacks):
        trainer.callbacks.append(make(TensordbgCallback))
