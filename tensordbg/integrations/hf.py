"""tensordbg for Hugging Face ``transformers.Trainer``: one callback.

>>> from tensordbg.integrations.hf import TensordbgCallback
>>> callback = TensordbgCallback(on_hit="record")
>>> Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()
>>> callback.session.hits

At train begin the callback attaches to the trainer's model and its optimizer (the one
``accelerate`` wraps, whose GradScaler it uses under fp16), so a step is an optimizer step:
``hit.step`` is ``state.global_step`` at the time, whatever ``gradient_accumulation_steps``,
a training resumed from a checkpoint's too.
The loss the model returns (``outputs.loss``) in training is observed; a loss computed outside
the model (a custom ``compute_loss``) is not, the rest is watched just the same.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

try:
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - the extra is installed in development
    raise ImportError(
        "tensordbg.integrations.hf needs transformers: pip install 'tensordbg[hf]'"
    ) from e

from tensordbg.integrations.frameworks import TrainingWatch


class TensordbgCallback(TrainerCallback, TrainingWatch):
    """Watch a ``transformers.Trainer``'s training; takes ``tensordbg.attach``'s keyword
    arguments but the model, optimizer and scaler, which come from the trainer.

    >>> callback = TensordbgCallback(on_hit="raise", rules=[tensordbg.rules.NaN()])
    >>> trainer = Trainer(model, args, train_dataset=data, callbacks=[callback])
    """

    def __init__(self, **attach_args: Any):
        TrainingWatch.__init__(self, attach_args)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       optimizer: Any = None, **kwargs: Any) -> None:  # fmt: skip
        inner = optimizer
        while inner is not None and hasattr(inner, "optimizer"):  # accelerate's wrapper(s)
            inner = inner.optimizer
        scaler = getattr(optimizer, "scaler", None)
        rank = getattr(args, "process_index", None)
        step = int(getattr(state, "global_step", 0) or 0)  # resumed from a checkpoint
        session = self.begin(model, [] if inner is None else [inner], scaler, rank, step)
        session.handles.add(model.register_forward_hook(self._model_returned))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.end()

    def _model_returned(self, model: torch.nn.Module, args: Any, output: Any) -> None:
        if not (model.training and torch.is_grad_enabled()):
            return  # an evaluation's loss is not the training's
        if isinstance(output, Mapping):
            self.observe_loss(output.get("loss"))
        else:
            self.observe_loss(getattr(output, "loss", None))


def add_callback(trainer: Any, make: Callable[[type], TrainingWatch]) -> None:
    """Give a trainer a callback made by ``make`` unless it has one (``tensordbg run``)."""
    if not any(isinstance(c, TensordbgCallback) for c in trainer.callback_handler.callbacks):
        trainer.add_callback(make(TensordbgCallback))
