"""The gradient hooks capture installs: each parameter's (where deferred checks on the host do
not read them at a pass's end instead), one tensor hook per leaf that a module gets as an
argument, and a pre-hook on the autograd node of each forward tensor whose gradient is read.

A tensor hook stays on its tensor until removed, and a parameter outlives every step: hooks made
per step piled up on it (a parameter handed to a module as an argument, as ``weight_norm`` and
``spectral_norm`` hand theirs to the parametrization, got one more hook a step, each firing at
every backward with its own step's record). Here each tensor gets one hook, once, which hands
its gradient to the tensor's latest record. A node's pre-hook goes with the autograd graph.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.nn.parameter import UninitializedParameter

from tensordbg.engine.marks import hook_of_ours, own_work
from tensordbg.engine.records import submodule
from tensordbg.statistics.batch import rows_of
from tensordbg.statistics.torch_kernels import watchable

if TYPE_CHECKING:
    from tensordbg.engine.handles import HandleGroup
    from tensordbg.engine.records import Record


class Sink(Protocol):
    """What a parameter's hook hands its gradient to: the session (capture's Sink has these)."""

    active: bool

    def param_grad(self, name: str, owner: str, owner_type: str, grad: torch.Tensor) -> None: ...
    def activation_grad(self, forward: Record, grad: torch.Tensor) -> None: ...
    def fault(self, error: Exception) -> None: ...


class GradHooks:
    """Installed by :meth:`.capture.Capture.install`; every hook goes at detach."""

    params_hooked = True
    """Whether parameters' gradients are hooked (deferred checks on the host read them at a
    pass's end instead: engine/backward.py)."""

    def __init__(self, session: Sink, handles: HandleGroup):
        self.session = session
        self.handles = handles
        self._waiting: list[tuple[str, torch.Tensor, str, str]] = []  # parameters not hooked
        self._leaves: dict[int, tuple[weakref.ref, list[Record], Any]] = {}
        handles.callback(self._unhook_leaves, "the leaves' gradient hooks")

    def watch_parameters(self, model: torch.nn.Module, hooked: bool = True) -> None:
        """Know the model's parameters; ``hooked``: hook their gradients now (else at
        :meth:`hook_parameters`: deferred checks on the host read them at a pass's end)."""
        for name, param in model.named_parameters():
            owner = name.rpartition(".")[0]
            self._waiting.append((name, param, owner, type(submodule(model, owner)).__name__))
        self.params_hooked = hooked
        self.watch_waiting()

    def hook_parameters(self) -> None:
        """Hook every parameter's gradient from now on."""
        self.params_hooked = True
        self.watch_waiting()

    def watch_waiting(self) -> None:
        """Hook the gradient of each parameter that has no hook and needs one: at attach, and
        at a root forward's start and end once one frozen at attach became trainable (a
        backbone unfrozen after a warm-up: unhooked, its NaN gradient went unseen and the NaN
        weight it made was blamed on the optimizer, "the gradient was clean"), or a lazy
        module's parameter took its shape (``nn.LazyLinear``: at the end of the first forward)."""
        waiting = self._waiting
        if not self.params_hooked or not any(_hookable(param) for _, param, _, _ in waiting):
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
            self.on_grad(latest[0], grad)

        self._leaves[id(t)] = (weakref.ref(t), latest, t.register_hook(hook))

    def hook_node(self, record: Record, node: Any, output_nr: int) -> None:
        """Hand the gradient of the node's output ``output_nr`` (a forward tensor's, at the
        version ``record`` is of) to the session: a pre-hook on the node that made it, the
        gradient of this very version as Tensor.register_hook gives it, for a fifth of its cost
        (it runs every forward). It goes with the autograd graph."""
        node.register_prehook(partial(self._on_node_grad, record, output_nr))

    @own_work
    def _on_node_grad(self, forward: Record, index: int, grads: tuple) -> None:
        grad = grads[index] if index < len(grads) else None
        if grad is not None:
            self.on_grad(forward, grad)

    @hook_of_ours
    @own_work
    def on_grad(self, forward: Record, grad: torch.Tensor) -> None:
        session = self.session
        if not session.active or not watchable(grad):
            return None
        try:
            session.activation_grad(forward, grad)
        except Exception as e:
            session.fault(e)
        return None

    def forget_dead_leaves(self) -> None:
        """Let go of the leaves that are gone (a batch that needed a gradient)."""
        if self._leaves:
            self._leaves = {k: v for k, v in self._leaves.items() if v[0]() is not None}

    def _unhook_leaves(self) -> None:
        for _, _, handle in self._leaves.values():
            handle.remove()
        self._leaves.clear()
        self._waiting = []  # detached: no parameter is kept alive


def _hookable(param: torch.Tensor) -> bool:
    return param.requires_grad and not isinstance(param, UninitializedParameter)


def param_hook(
    session: Sink, name: str, owner: str, owner_type: str
) -> Callable[[torch.Tensor], None]:
    """A post-accumulate-grad hook that hands the parameter's gradient to the session."""

    @hook_of_ours
    def hook(param: torch.Tensor) -> None:
        if not session.active:
            return
        try:
            grad = None if param.grad is None else rows_of(param.grad)
            if grad is not None and watchable(grad):
                session.param_grad(name, owner, owner_type, grad)
        except Exception as e:
            session.fault(e)

    return hook
