"""How tensordbg steps into ``optimizer.step()``: dropping an update's gradients (a skip), a
GradScaler that lets a fused optimizer skip in its kernel, and a closure's first call (LBFGS).
Used by :mod:`.optimizer` and, after a detach, by the session."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch


def skips_inside(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a GradScaler that found Inf/NaN gradients calls this fused optimizer's step
    anyway, for its kernel to skip the update (``AdamW(fused=True)``, the Hugging Face
    Trainer's default): one read of the flag, only under a scaler."""
    found_inf = getattr(optimizer, "found_inf", None)
    return isinstance(found_inf, torch.Tensor) and bool(found_inf.item())


def after_first_call(closure: Callable[[], Any], then: Callable[[], None], args: Any,
                      kwargs: Any) -> tuple[Any, Any]:  # fmt: skip
    """The step's arguments with ``closure`` replaced by one that calls ``then()`` after its
    first call returned (LBFGS calls it again after changing the weights)."""
    pending = [then]

    def closure_then() -> Any:
        result = closure()
        if pending:
            pending.pop()()
        return result

    if "closure" in kwargs:
        return args, {**kwargs, "closure": closure_then}
    return (args[0], closure_then, *args[2:]), kwargs


def drop_gradients(optimizer: torch.optim.Optimizer) -> None:
    """Make this ``optimizer.step()`` change nothing: optimizers leave a parameter without a
    gradient alone (its value, its momentum, its step count)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = None


def skip_after_detach(optimizers: list[torch.optim.Optimizer]) -> None:
    """A skip asked for and then detached from before its update (k, then q in the UI): each
    optimizer's next ``step()`` still drops its gradients, once, through a hook of its own that
    goes with it. (An optimizer the step does not step drops a later update instead.)"""
    for optimizer in optimizers:
        handle: list[Any] = []

        def drop(optimizer: torch.optim.Optimizer, *_: Any, handle: list[Any] = handle) -> None:
            drop_gradients(optimizer)
            handle.pop().remove()

        handle.append(optimizer.register_step_pre_hook(drop))


def say_apart(step: int, again: Any, optimizers: list[Any]) -> None:
    """Once: ``again`` stepped a second time before the other optimizers of the step did, so
    the steps are counted apart from now on (a WGAN's critic; an optimizer no longer used)."""

    def name(o: Any) -> str:
        return f"optimizer {optimizers.index(o) + 1} of {len(optimizers)} ({type(o).__name__})"

    waited = " and ".join(name(o) for o in optimizers if o is not again)
    print(f"tensordbg: step {step}: {name(again)} stepped again before {waited} did: from now "
          f"on a step ends with each step of {name(optimizers[0])}, and while that one does "
          f"not step, as each step of {name(again)} begins (its forward and backward count in "
          "the step before).", file=sys.stderr, flush=True)  # fmt: skip
