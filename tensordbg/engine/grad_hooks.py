"""The hooks capture keeps on tensors for the session's life: each parameter's gradient hook, and
one tensor hook per leaf that a module gets as an argument.

A tensor hook stays on its tensor until removed, and a parameter outlives every step: hooks made
per step piled up on it (a parameter handed to a module as an argument, as ``weight_norm`` and
``spectral_norm`` hand theirs to the parametrization, got one more hook a step, each firing at
every backward with its own step's record). Here each tensor gets one hook, once, which hands
its gradient to the tensor's latest record.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.nn.parameter import UninitializedParameter

from tensordbg.statistics.torch_kernels import watchable

if TYPE_CHECKING:
    from tensordbg.engine.handles import HandleGroup
    from tensordbg.engine.records import Record


class Sink(Protocol):
    """What a parameter's hook hands its gradient to: the session (capture's Sink has these)."""

    @property
    def active(self) -> bool: ...
    def param_grad(self, name: str, owner: str, owner_type: str, grad: torch.Tensor) -> None: ...
    def fault(self, error: Exception) -> None: ...


class GradHooks:
    """Installed by :meth:`.capture.Capture.install`; every hook goes at detach."""

    def __init__(self, session: Sink, handles: HandleGroup,
                 on_grad: Callable[[Record, torch.Tensor], None]):  # fmt: skip
        self.session = session
        self.handles = handles
        self._on_grad = on_grad
        self._waiting: list[tuple[str, torch.Tensor, str, str]] = []  # parameters not hooked
        self._leaves: dict[int, tuple[weakref.ref, list[Record], Any]] = {}
        handles.callback(self._unhook_leaves, "the leaves' gradient hooks")

    def watch_parameters(self, model: torch.nn.Module) -> None:
        for name, param in model.named_parameters():
            owner = name.rpartition(".")[0]
            self._waiting.append((name, param, owner, type(model.get_submodule(owner)).__name__))
        self.watch_waiting()

    def watch_waiting(self) -> None:
        """Hook the gradient of each parameter that has no hook and needs one: at attach, and
        at a root forward's start and end once one frozen at attach became trainable (a
        backbone unfrozen after a warm-up: unhooked, its NaN gradient went unseen and the NaN
        weight it made was blamed on the optimizer, "the gradient was clean"), or a lazy
        module's parameter took its shape (``nn.LazyLinear``: at the end of the first forward)."""
        waiting = self._waiting
        if not waiting or not any(_hookable(param) for _, param, _, _ in waiting):
            return
        self._waiting = [entry for entry in waiting if not _hookable(entry[1])]
        for name, param, owner, owner_type in waiting:
            if _hookable(param):
                hook = param_hook(self.session, name, owner, owner_type)
                self.handles.add(param.register_post_accumulate_grad_hook(hook))

    def hook_leaf(self, t: torch.Tensor, record: Record) -> None:
        """Hand the gradient of leaf ``t`` to ``record``, its latest."""
        known = self._leaves.get(id(t))
        if known is not None and known[0]() is t:
            known[1][0] = record
            return
        latest = [record]

        @torch.utils.hooks.unserializable_hook  # torch.save(model) leaves it out, and quietly
        def hook(grad: torch.Tensor) -> None:
            self._on_grad(latest[0], grad)

        self._leaves[id(t)] = (weakref.ref(t), latest, t.register_hook(hook))

    def forget_dead_leaves(self) -> None:
        """Let go of the leaves that are gone (a batch that needed a gradient)."""
        if self._leaves:
            self._leaves = {k: v for k, v in self._leaves.items() if v[0]() is not None}

    def _unhook_leaves(self) -> None:
        for _, _, handle in self._leaves.values():
            handle.remove()
        self._leaves.clear()


def _hookable(param: torch.Tensor) -> bool:
    return param.requires_grad and not isinstance(param, UninitializedParameter)


def param_hook(
    session: Sink, name: str, owner: str, owner_type: str
) -> Callable[[torch.Tensor], None]:
    """A post-accumulate-grad hook that hands the parameter's gradient to the session."""

    @torch.compiler.disable
    def hook(param: torch.Tensor) -> None:
        if not session.active:
            return
        try:
            grad = param.grad
            if grad is not None and grad.layout is torch.sparse_coo:
                grad = grad.coalesce().values()  # the rows it has: a sparse embedding's update
            if grad is not None and watchable(grad):
                session.param_grad(name, owner, owner_type, grad)
        except Exception as e:
            session.fault(e)

    return hook
