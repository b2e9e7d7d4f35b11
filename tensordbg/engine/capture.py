"""Hooks that capture a training's tensors: the first stage of tensordbg's pipeline.

What is hooked, and why this way (see reference.md, "Hook pitfalls"):

- Forward: a pre-hook and an always-called post-hook (with kwargs) on every selected module. The
  root's inputs and every module's outputs are watched, through any nesting of tuples, lists,
  dicts and dataclasses; each module call gets a :class:`Call` in a per-forward call tree, which
  is what lets the engine tell the module that produced a bad value from those that passed it on.
- Backward: ``Tensor.register_hook`` on module outputs and inputs, installed from the forward
  hooks. ``register_full_backward_hook`` is not used: it breaks on in-place ops such as
  ``ReLU(inplace=True)``. A hook registered before an in-place op sees the gradient of the value
  before it, so a tensor modified in place gets one record per version.
- Parameter gradients: ``register_post_accumulate_grad_hook`` (``param.grad`` is final there).
- The end of a backward pass: a callback queued on the autograd engine from the first hook.
- Optimizer: step pre- and post-hooks (in the session).

Everything a hook learns becomes a :class:`~records.Record` handed to a :class:`Sink` (the
session), which computes the statistics and judges them. Every hook is registered through the
session's :class:`~handles.HandleGroup`, so detaching removes them all at once. A forward
that runs again inside backward (activation checkpointing recomputes it) is skipped, so
nothing is counted twice.
"""

from __future__ import annotations

import dataclasses
import sys
import weakref
from collections.abc import Callable, Mapping
from fnmatch import fnmatchcase
from functools import partial
from pathlib import Path
from types import CodeType
from typing import Any, Protocol

import torch

from tensordbg.engine.handles import HandleGroup
from tensordbg.engine.records import Call, Record, new_record
from tensordbg.statistics.torch_kernels import watchable

MAX_NESTING = 6
_PURE_CONTAINERS = (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict)
MAX_LEAVES = 256

_TORCH_DIR = str(Path(torch.__file__).parent)
# tensordbg's own code on the path from a hook to the user's code: the engine and the
# integrations that call the model for the user (not the demo: that is user code).
_PACKAGE = Path(__file__).parent.parent
_OWN_DIRS = tuple(str(_PACKAGE / name) + "/" for name in ("engine", "integrations"))
_OWN_FILES = frozenset({str(_PACKAGE / "api.py")})


class Sink(Protocol):
    """What the hooks hand their findings to (the session). Each method runs on the training
    thread, inside a hook; an exception other than ``passthrough`` goes to :meth:`fault`."""

    passthrough: tuple[type[BaseException], ...]
    step: int

    @property
    def active(self) -> bool: ...
    def begin_forward(self) -> None: ...
    def collect(self, record: Record, tensor: torch.Tensor) -> None: ...
    def collect_input(self, call: Call, record: Record, tensor: torch.Tensor) -> None: ...
    def enter(self, call: Call) -> None: ...
    def exit(self, call: Call) -> None: ...
    def end_forward(self, root: Call) -> None: ...
    def activation_grad(self, forward: Record, grad: torch.Tensor) -> None: ...
    def param_grad(self, name: str, owner: str, owner_type: str, grad: torch.Tensor) -> None: ...
    def fault(self, error: Exception) -> None: ...


class Unhooked:
    """A hooked module's ``__reduce_ex__``: pickling or deep-copying the module (``torch.save``,
    ``copy.deepcopy``, an EMA or "best model" copy) gives it without tensordbg's hooks, as if it
    had never been attached. The session's own state never leaves the process this way."""

    _HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                   "_forward_hooks_with_kwargs", "_forward_hooks_always_called")  # fmt: skip

    def __init__(self, module: torch.nn.Module, hook_ids: set[int]):
        self._module = weakref.ref(module)
        self._ids = frozenset(hook_ids)

    def __call__(self, protocol: int) -> tuple[Any, ...]:
        module = self._module()
        if module is None:
            raise TypeError("this module is gone")
        reduced = type(module).__reduce_ex__(module, protocol)
        state = dict(reduced[2])
        state.pop("__reduce_ex__", None)
        for name in self._HOOK_DICTS:
            hooks = state.get(name)
            if hooks and not self._ids.isdisjoint(hooks):
                state[name] = type(hooks)((k, v) for k, v in hooks.items() if k not in self._ids)
        return (reduced[0], reduced[1], state, *reduced[3:])


def tensor_leaves(obj: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """Every tensor in a nested output, with its path: ``(output, (h, c))`` gives
    ``[("[0]", output), ("[1][0]", h), ("[1][1]", c)]``; dicts and dataclasses (e.g. Hugging Face
    ``ModelOutput``) by key: ``".logits"``."""
    if isinstance(obj, torch.Tensor):
        return [(prefix, obj)]
    if type(obj) is tuple and len(obj) == 1 and isinstance(obj[0], torch.Tensor):
        return [(f"{prefix}[0]", obj[0])]  # a module's positional arguments, most of the time
    out: list[tuple[str, torch.Tensor]] = []
    _collect(obj, prefix, 0, out)
    return out


def _collect(obj: Any, prefix: str, depth: int, out: list[tuple[str, torch.Tensor]]) -> None:
    if len(out) >= MAX_LEAVES:
        return
    if isinstance(obj, torch.Tensor):
        out.append((prefix, obj))
        return
    if depth >= MAX_NESTING or isinstance(obj, (str, bytes, int, float, bool)) or obj is None:
        return
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            _collect(value, f"{prefix}{_key(key)}", depth + 1, out)
    elif isinstance(obj, (tuple, list)):
        fields = getattr(obj, "_fields", None)  # namedtuple: name the fields
        for i, value in enumerate(obj):
            part = f".{fields[i]}" if fields else f"[{i}]"
            _collect(value, f"{prefix}{part}", depth + 1, out)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _collect(getattr(obj, f.name, None), f"{prefix}.{f.name}", depth + 1, out)


def _key(key: Any) -> str:
    return f".{key}" if isinstance(key, str) and key.isidentifier() else f"[{key!r}]"


_INTERNAL_CODE: dict[CodeType, bool] = {}


def user_site(frame: Any) -> tuple[CodeType, int] | None:
    """The first frame outside torch and tensordbg: the user's line that called the module."""
    while frame is not None:
        code = frame.f_code
        internal = _INTERNAL_CODE.get(code)
        if internal is None:  # decided once per code object: this runs on every module call
            filename = code.co_filename
            internal = filename.startswith((_TORCH_DIR, *_OWN_DIRS)) or filename in _OWN_FILES
            _INTERNAL_CODE[code] = internal
        if not internal:
            return code, frame.f_lineno
        frame = frame.f_back
    return None


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread (a checkpointed
    forward being recomputed, for instance)."""
    return torch._C._current_graph_task_id() != -1


class Capture:
    """Installs the hooks on a model and turns what they see into records for the session."""

    def __init__(
        self,
        session: Sink,
        model: torch.nn.Module,
        include: tuple[str, ...],
        exclude: tuple[str, ...],
    ):
        self.session = session
        self.paths: dict[int, str] = {}
        self.types: dict[int, str] = {}
        self.direct_params: dict[int, tuple[str, ...]] = {}
        for path, module in model.named_modules():
            if path and not _selected(path, include, exclude):
                continue
            if "." in path and type(module) in _PURE_CONTAINERS:
                # Its forward only chains its children, inside its parent's forward. (A child
                # of the root is hooked: a GAN calls G(z) and D(x) itself, and each is a root
                # forward whose children must share its call tree.)
                continue
            self.paths[id(module)] = path
            self.types[id(module)] = type(module).__name__
            self.direct_params[id(module)] = tuple(
                f"{path}.{n}" if path else n for n, _ in module.named_parameters(recurse=False)
            )
        self.stack: list[Call] = []
        self.root: Call | None = None
        self.calls_by_path: dict[str, list[Call]] = {}
        self._root_calls: list[Call] = []  # the calls of the current root forward
        self._root_grad = True  # whether it ran with gradients (a backward can come)
        self._counts: dict[int, int] = {}
        self._seen: dict[int, Record] = {}
        self._skipping = 0

    # --- installation ----------------------------------------------------------------------

    def install(self, model: torch.nn.Module, handles: HandleGroup) -> None:
        """Hook every selected module's forward, and every trainable parameter's gradient."""
        for module in model.modules():
            if id(module) not in self.paths:
                continue
            pre = handles.add(module.register_forward_pre_hook(self.on_enter, with_kwargs=True))
            post = handles.add(
                module.register_forward_hook(self._on_exit, with_kwargs=True, always_call=True)
            )
            # torch.save(model) and copy.deepcopy(model) see the module without these hooks.
            handles.patch(module, "__reduce_ex__", Unhooked(module, {pre.id, post.id}))
        for name, param in model.named_parameters():
            if param.requires_grad:
                owner = name.rpartition(".")[0]
                owner_type = type(model.get_submodule(owner)).__name__
                hook = param_hook(self.session, name, owner, owner_type)
                handles.add(param.register_post_accumulate_grad_hook(hook))
        handles.callback(self.reset)
        handles.callback(self.new_step)

    def reset(self) -> None:
        """Start a new root forward. The calls of the step's earlier root forwards stay in
        :attr:`calls_by_path` (a GAN calls ``G(z)``, ``D(fake)``, ``D(real)`` before its backward
        passes: their origins are reasoned over all of them) until :meth:`new_step`."""
        if not self._root_grad and self._root_calls:
            # An evaluation under no_grad: no backward will reason over its calls.
            gone = {id(c) for c in self._root_calls}
            self.calls_by_path = {
                path: kept
                for path, calls in self.calls_by_path.items()
                if (kept := [c for c in calls if id(c) not in gone])
            }
        self._root_calls = []
        self._root_grad = torch.is_grad_enabled()
        self.stack.clear()
        self.root = None
        self._counts.clear()
        self._skipping = 0

    def new_step(self) -> None:
        """A step ended: forget its calls (nothing is kept across steps)."""
        self.calls_by_path = {}
        self._root_calls = []
        self._seen.clear()  # a tensor made by one root forward and used by the next is one record

    # --- forward -------------------------------------------------------------------------------

    # torch.compile must not trace the hooks (they keep Python state): it runs them eagerly, at a
    # graph break around each watched module.
    @torch.compiler.disable
    def on_enter(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        session = self.session
        if not session.active:
            return
        try:
            if self._skipping or (not self.stack and in_backward()):
                # A forward recomputed during backward (activation checkpointing): skip it all.
                self._skipping += 1
                return
            key = id(module)
            is_root = not self.stack
            if is_root:
                session.begin_forward()
                self.reset()
            index = self._counts.get(key, 0)
            self._counts[key] = index + 1
            parent = self.stack[-1] if self.stack else None
            call = Call(
                path=self.paths[key],
                module_type=self.types[key],
                index=index,
                parent=parent,
                depth=0 if parent is None else parent.depth + 1,
                params=self.direct_params[key],
                site=user_site(sys._getframe(1)),
            )
            if parent is not None:
                parent.children.append(call)
            else:
                self.root = call
            self.calls_by_path.setdefault(call.path, []).append(call)
            self._root_calls.append(call)
            self.stack.append(call)
            leaves = tensor_leaves(args, "")
            if kwargs:
                leaves += tensor_leaves(kwargs, "")
            for suffix, t in leaves:
                if not watchable(t):
                    continue
                record = self._known(t)
                if record is None:
                    record = self._new_record(t, call, "input", suffix, hidden=not is_root)
                    self._remember(t, record)
                    if is_root:
                        session.collect(record, t)
                    else:
                        session.collect_input(call, record, t)
                record.consumers.append(call)
                call.inputs.append((suffix, record))
                self._hook_grad(t, record)
            session.enter(call)
        except Exception as e:
            session.fault(e)

    @torch.compiler.disable
    def _on_exit(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        session = self.session
        if not session.active:
            return
        if self._skipping:
            self._skipping -= 1
            return
        if not self.stack:
            return
        call = self.stack.pop()
        try:
            if output is not None:
                for suffix, t in tensor_leaves(output, ""):
                    if not watchable(t):
                        continue
                    record = self._known(t)
                    if record is None:
                        record = self._new_record(t, call, "output", suffix)
                        record.producer = call
                        self._remember(t, record)
                        session.collect(record, t)
                    elif record.producer is not None and record.producer is not call:
                        record.passed_up.append(call)
                    call.outputs.append((suffix, record))
                    self._hook_grad(t, record)
            session.exit(call)
            if not self.stack:
                session.end_forward(call)
        except Exception as e:
            session.fault(e)

    # --- records --------------------------------------------------------------------------------

    def _known(self, t: torch.Tensor) -> Record | None:
        """The record of this very tensor at this very version, if it was seen in this forward."""
        record = self._seen.get(id(t))
        if record is None or record.weak is None or record.weak() is not t:
            return None
        if record.version != t._version:
            return None
        return record

    def _remember(self, t: torch.Tensor, record: Record) -> None:
        record.weak = weakref.ref(t)
        self._seen[id(t)] = record

    def _new_record(
        self, t: torch.Tensor, call: Call, kind: str, suffix: str, hidden: bool = False
    ) -> Record:
        return new_record(t, call.tensor_name(kind, suffix), kind, "forward", self.session.step,
                          module=call.path, module_type=call.module_type, call=call.index,
                          suffix=suffix, hidden=hidden)  # fmt: skip

    # --- backward -------------------------------------------------------------------------------

    def _hook_grad(self, t: torch.Tensor, record: Record) -> None:
        if record.grad_hooked or not t.requires_grad or not torch.is_grad_enabled():
            return
        record.grad_hooked = True
        node = t.grad_fn
        if node is None:  # a leaf: only a tensor hook sees its gradient
            t.register_hook(partial(self._on_grad, record))
        else:
            # A pre-hook on the node that made this value: the gradient of this very version,
            # as Tensor.register_hook gives it, for a fifth of its cost (it runs every forward).
            node.register_prehook(partial(self._on_node_grad, record, t.output_nr))

    def _on_node_grad(self, forward: Record, index: int, grads: tuple) -> None:
        grad = grads[index] if index < len(grads) else None
        if grad is not None:
            self._on_grad(forward, grad)

    @torch.compiler.disable
    def _on_grad(self, forward: Record, grad: torch.Tensor) -> None:
        session = self.session
        if not session.active or not watchable(grad):
            return None
        try:
            session.activation_grad(forward, grad)
        except Exception as e:
            session.fault(e)
        return None


def _selected(path: str, include: tuple[str, ...], exclude: tuple[str, ...]) -> bool:
    if include and not any(fnmatchcase(path, p) for p in include):
        return False
    return not any(fnmatchcase(path, p) for p in exclude)


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
