"""Modules whose fused inference path PyTorch refuses when a module inside them has a hook.

``nn.TransformerEncoderLayer`` runs inference as one fused kernel
(``torch._transformer_encoder_layer_fwd``) unless some module inside it has a forward hook or
pre-hook: then it takes its standard path, whose numbers differ in the last bits (under the
CPU's bfloat16 autocast, an evaluation's logits moved by up to 2^-7). Hooked the usual way, an
attached model would evaluate differently from the same model bare. So those modules are
watched through torch's global module hooks (``register_module_forward_pre_hook``), which that
check does not see, filtered to their ids: the same calls as the usual hooks where the layer
runs its standard path (training, or with gradients), and the layer alone, as one call, where
it runs the fused kernel, exactly as without tensordbg.

A global pre-hook is not given the call's keyword arguments (a padding mask is one): they are
read from the frame of ``Module._call_impl`` that calls the hook. Where that frame is not
torch's (a torch version that calls hooks elsewhere), they are unknown: the call is watched,
but not run again to name an operation, nor its masks described.

While global hooks of tensordbg's are installed, torch.compile's warning that global hooks
fire once more for its wrapper is not shown (:func:`quiet_compile_warning`): they know the
wrapper, and the script did not install them.
"""

from __future__ import annotations

import re
import sys
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from tensordbg.engine.handles import HandleGroup

FUSED: tuple[type[torch.nn.Module], ...] = (torch.nn.TransformerEncoderLayer,)
"""Module types with a fused path that any forward hook inside them turns off."""


def _calling_code() -> Any:
    """The code object of the closure in ``Module._call_impl`` that calls the hooks."""
    for const in torch.nn.Module._call_impl.__code__.co_consts:
        if getattr(const, "co_name", None) == "inner" and "kwargs" in const.co_freevars:
            return const
    return None


_CALLER = _calling_code()


def fused_modules(modules: Iterable[torch.nn.Module]) -> set[int]:
    """The ids of the modules inside (and including) any module with a fused path."""
    return {id(m) for layer in modules if isinstance(layer, FUSED) for m in layer.modules()}


class GlobalHooks:
    """The forward hooks of the modules in ``ids``, as torch's global module hooks: they call
    ``enter(module, args, kwargs)`` (kwargs None when unknown) and ``exit(module, args, kwargs,
    output)`` as the per-module hooks would, for those modules only."""

    def __init__(self, ids: set[int], enter: Callable[..., None], exit: Callable[..., None]):
        self.ids = frozenset(ids)
        self.enter = enter
        self.exit = exit

    def install(self, handles: HandleGroup) -> None:
        handles.add(register_module_forward_pre_hook(self._pre))
        handles.add(register_module_forward_hook(self._post, with_kwargs=True, always_call=True))
        handles.callback(quiet_compile_warning(), "torch.compile's warning of global hooks")

    def _pre(self, module: torch.nn.Module, args: tuple) -> None:
        if id(module) in self.ids:
            frame = sys._getframe(1)
            kwargs = frame.f_locals.get("kwargs") if frame.f_code is _CALLER else None
            self.enter(module, args, kwargs)

    def _post(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if id(module) in self.ids:
            self.exit(module, args, kwargs, output)


def quiet_compile_warning() -> Callable[[], None]:
    """Hide torch.compile's warning of global module hooks until the returned function is
    called (the hooks are gone): it speaks of hooks the script did not install."""
    # As filterwarnings() would make it, put in place without telling the caches: that makes
    # every module forget which warnings it said once, and a script's once-only warning said
    # before attach (or detach) was said again. An "ignore" is never cached, so none is stale.
    message = re.compile(r"Using `torch\.compile\(module\)` when there are global hooks", re.I)
    entry = ("ignore", message, Warning, None, 0)
    warnings.filters.insert(0, entry)

    def undo() -> None:
        if entry in warnings.filters:
            warnings.filters.remove(entry)

    return undo
