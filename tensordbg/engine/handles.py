"""Everything ``attach`` installs, held in one place so that ``detach`` is one close.

Hooks (anything with ``.remove()``, like torch's ``RemovableHandle``), patched attributes,
timers and clean-up callbacks all go into a :class:`HandleGroup`; :meth:`HandleGroup.close`
undoes them in reverse order, each once, and carries on past one that fails.

>>> handles = HandleGroup()
>>> handles.add(module.register_forward_hook(hook))
>>> handles.patch(scaler, "update", wrapped_update)
>>> handles.close()     # the hook is removed and scaler.update is the class's again
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    import torch

_MISSING = object()


class Removable(Protocol):
    def remove(self) -> None: ...


R = TypeVar("R", bound=Removable)


class HandleGroup:
    """A last-in, first-out stack of things to undo."""

    def __init__(self) -> None:
        self._undo: list[tuple[str, Callable[[], Any]]] = []
        self._lock = threading.Lock()
        self.closed = False

    def add(self, handle: R) -> R:
        """Keep a hook's handle: closing the group removes the hook."""
        self._push(f"hook {type(handle).__name__}", handle.remove)
        return handle

    def callback(self, fn: Callable[[], Any], what: str = "") -> None:
        """Call ``fn`` when the group closes."""
        self._push(what or getattr(fn, "__qualname__", "callback"), fn)

    def patch(self, obj: Any, name: str, value: Any) -> None:
        """Set ``obj.name = value`` until the group closes; then put back what the instance had
        (or nothing, when the attribute came from its class)."""
        before = vars(obj).get(name, _MISSING) if hasattr(obj, "__dict__") else _MISSING
        setattr(obj, name, value)

        def restore() -> None:
            if before is _MISSING:
                if vars(obj).get(name) is value:
                    delattr(obj, name)
            else:
                setattr(obj, name, before)

        self._push(f"patch {type(obj).__name__}.{name}", restore)

    def timer(self, seconds: float, fn: Callable[[], Any]) -> threading.Timer:
        """Start a daemon timer that closing the group cancels."""
        timer = threading.Timer(seconds, fn)
        timer.daemon = True
        self._push("timer", timer.cancel)
        timer.start()
        return timer

    def close(self) -> None:
        """Undo everything, newest first. A failing undo is reported and the rest still runs."""
        with self._lock:
            undo, self._undo = self._undo[::-1], []
            self.closed = True
        for what, fn in undo:
            try:
                fn()
            except Exception as e:  # one stuck handle must not keep the others installed
                warnings.warn(
                    f"tensordbg: could not undo {what} at detach: {e}", RuntimeWarning, stacklevel=2
                )

    def __len__(self) -> int:
        return len(self._undo)

    def _push(self, what: str, fn: Callable[[], Any]) -> None:
        with self._lock:
            if self.closed:
                raise RuntimeError("this session is detached: nothing more can be installed")
            self._undo.append((what, fn))


class Unhooked:
    """A hooked module's ``__reduce_ex__``: pickling or deep-copying the module (``torch.save``,
    ``copy.deepcopy``, an EMA or "best model" copy) gives it without tensordbg's hooks, as if it
    had never been attached. The session's own state never leaves the process this way.

    Its hooks are those it was made with, and any other hook of tensordbg's on the module at
    the time of the copy (a profile's, installed for its steps only): a function of a
    ``tensordbg`` module, or a method of an object of one."""

    _HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                   "_forward_hooks_with_kwargs", "_forward_hooks_always_called")  # fmt: skip

    def __init__(self, module: torch.nn.Module, hook_ids: set[int]):
        self._module = weakref.ref(module)
        self._ids = frozenset(hook_ids)

    def __call__(self, protocol: int) -> tuple[Any, ...]:
        module = self._live()
        reduced = type(module).__reduce_ex__(module, protocol)
        state = dict(reduced[2])
        for name in _PATCHED:
            state.pop(name, None)
        state.update(self._without_ours(state))
        return (reduced[0], reduced[1], state, *reduced[3:])

    def deepcopy(self, memo: dict[int, Any]) -> Any:
        """``__deepcopy__`` of a module whose class has its own, which copies the instance's
        ``__dict__`` as it is (a parametrized module's: ``weight_norm``, ``spectral_norm``),
        hooks and all: ``copy.deepcopy`` of one failed, "cannot pickle '_thread.lock'". It
        copies the module as it is without tensordbg's hooks."""
        module = self._live()
        state = vars(module)
        kept = {n: state[n] for n in (*self._HOOK_DICTS, *_PATCHED) if n in state}
        state.update(self._without_ours(kept))
        for name in _PATCHED:
            state.pop(name, None)
        try:
            return type(module).__deepcopy__(module, memo)
        finally:
            state.update(kept)

    def _live(self) -> torch.nn.Module:
        module = self._module()
        if module is None:
            raise TypeError("this module is gone")
        return module

    def _without_ours(self, state: dict[str, Any]) -> dict[str, Any]:
        """The hook dicts of ``state`` that hold a hook of tensordbg's, without it."""
        out = {}
        for name in self._HOOK_DICTS:
            hooks = state.get(name)
            if hooks and any(k in self._ids or _ours(v) for k, v in hooks.items()):
                out[name] = type(hooks)(
                    (k, v) for k, v in hooks.items() if k not in self._ids and not _ours(v)
                )
        return out


_PATCHED = ("__reduce_ex__", "__deepcopy__")  # what capture puts on a hooked module itself


def _ours(hook: Any) -> bool:
    """Whether ``hook`` is tensordbg's: a function of one of its modules (through a partial),
    or a method of an object of a class of one."""
    fn = getattr(hook, "func", hook)
    owner = getattr(fn, "__self__", None)
    where = type(owner).__module__ if owner is not None else getattr(fn, "__module__", None)
    return isinstance(where, str) and where.partition(".")[0] == "tensordbg"


_script_lock = threading.Lock()
_script_users = 0
_hook_stubs: Callable[[Any], Any] | None = None  # torch's, while tensordbg's stands in for it


def hide_from_torchscript(handles: HandleGroup) -> None:
    """Let ``torch.jit.script(model)`` work while attached, until ``handles`` close.

    TorchScript compiles a module's forward hooks with its forward, and tensordbg's are Python
    it cannot compile: scripting an attached model failed with "try blocks aren't supported",
    pointing into tensordbg. While a session is attached, the compiler lists each module's
    hooks without tensordbg's: the scripted module has none of them, as a copy has none
    (:class:`Unhooked`), and the model keeps them."""
    global _script_users, _hook_stubs
    import torch.jit._recursive as recursive

    with _script_lock:
        if _script_users == 0:
            if not callable(getattr(recursive, "get_hook_stubs", None)):
                return  # a torch that lists hooks elsewhere: scripting fails as it did
            _hook_stubs = recursive.get_hook_stubs
            recursive.get_hook_stubs = _hook_stubs_without_ours
        _script_users += 1
    handles.callback(_release_torchscript, "TorchScript's view of the hooks")


def _release_torchscript() -> None:
    global _script_users, _hook_stubs
    import torch.jit._recursive as recursive

    with _script_lock:
        _script_users -= 1
        if _script_users == 0 and _hook_stubs is not None:
            recursive.get_hook_stubs, _hook_stubs = _hook_stubs, None


def _hook_stubs_without_ours(module: torch.nn.Module) -> Any:
    hidden = {}
    for name in ("_forward_hooks", "_forward_pre_hooks"):
        hooks = vars(module).get(name)
        if hooks and any(_ours(h) for h in hooks.values()):
            hidden[name] = hooks
            vars(module)[name] = type(hooks)((k, v) for k, v in hooks.items() if not _ours(v))
    try:
        return _hook_stubs(module)
    finally:
        vars(module).update(hidden)
