"""tensordbg's own work, marked in a profile: while ``session.profile()`` records, every hook of
the session runs inside a ``tensordbg: checks`` range, so the profile's breakdown counts the
debugger's time as its own category and its operator table leaves out the reads the checks
make (an ``aten::dot`` of a gradient's norm is not the model's). Outside a profile a marked
hook costs one test of a counter."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from tensordbg.profiler.report import CHECKS_RANGE as RANGE

_profiles = [0]  # profiles recording now (torch.profiler records the whole process)
_inside = threading.local()  # the range of the marked hook this thread runs, if any

F = TypeVar("F", bound=Callable[..., Any])


def own_work(fn: F) -> F:
    """Mark ``fn`` (a hook) as tensordbg's own work in a profile."""

    @functools.wraps(fn)
    def marked(*args: Any, **kwargs: Any) -> Any:
        # A hook another calls is in the outer one's range already.
        if not _profiles[0] or getattr(_inside, "handle", None) is not None:
            return fn(*args, **kwargs)
        _inside.handle = torch.ops.profiler._record_function_enter_new(RANGE, None)
        try:
            return fn(*args, **kwargs)
        finally:
            handle, _inside.handle = _inside.handle, None  # (:func:`outside` may renew it)
            torch.ops.profiler._record_function_exit._RecordFunction(handle)

    marked.__own_work__ = fn  # type: ignore[attr-defined]  # (hook_of_ours calls it directly)
    return marked  # type: ignore[return-value]


@contextlib.contextmanager
def outside() -> Iterator[None]:
    """This thread's open range closed for a moment, and opened again after: a step ends inside
    a hook (the optimizer's post-hook), and the profiler's step boundary and the optimizer's
    range must not fall inside it, or the trace's ranges stop nesting (its timeline drew the
    first step alone)."""
    if getattr(_inside, "handle", None) is None:
        yield
        return
    torch.ops.profiler._record_function_exit._RecordFunction(_inside.handle)
    try:
        yield
    finally:
        _inside.handle = torch.ops.profiler._record_function_enter_new(RANGE, None)


def profiling() -> Callable[[], None]:
    """Mark the hooks from now until the returned function is called (a profile ended)."""
    _profiles[0] += 1
    done = [False]

    def stop() -> None:
        if not done[0]:
            done[0] = True
            _profiles[0] -= 1

    return stop


_GRAPH_BREAK = (
    "tensordbg's hooks run in Python, at a graph break: torch.compile(..., fullgraph=True) "
    "cannot compile a model tensordbg watches. Compile without fullgraph=True (the hooks "
    "then split the graph), or detach tensordbg first."
)


def hook_of_ours(fn: F) -> F:
    """Keep torch.compile from tracing ``fn`` (a hook keeps Python state): it runs eagerly, at
    a graph break, and ``fullgraph=True``'s error says why there must be one.

    Dynamo's own wrapper makes six Python calls around each call of the hook (its eval-frame
    callback set aside and put back, its stance, its knobs), ~5 us a hook in the cold cache a
    module's kernels leave, ~60 hooks a step. Where no compiled code runs on this thread (its
    eval-frame callback is unset: an eager model, the common case) nothing is there to keep
    out, and the hook is called directly; else through dynamo's wrapper. Dynamo's tracing,
    which inlines this one, takes ``is_compiling()`` for True and meets its own wrapper, so
    it breaks the graph there with the reason above (it warned of the callback, a builtin it
    cannot trace, when that came first).

    A hook marked :func:`own_work` under it is called past that mark too while no profile
    records: one Python call less a hook."""
    try:
        guarded = torch.compiler.disable(fn, reason=_GRAPH_BREAK)
    except TypeError:  # a torch before 2.8 takes no reason
        guarded = torch.compiler.disable(fn)
    callback = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
    callback = getattr(callback, "get_eval_frame_callback", None)
    is_compiling = getattr(torch.compiler, "is_compiling", None)  # True while dynamo traces
    if callback is None or is_compiling is None:  # an older torch: always dynamo's wrapper
        return guarded  # type: ignore[return-value]

    unmarked = getattr(fn, "__own_work__", fn)

    @functools.wraps(fn)
    def hook(*args: Any, **kwargs: Any) -> Any:
        if not is_compiling() and callback() is None:
            if not _profiles[0]:
                return unmarked(*args, **kwargs)
            return fn(*args, **kwargs)
        return guarded(*args, **kwargs)

    return hook  # type: ignore[return-value]


def compiled_inner(module: torch.nn.Module) -> torch.nn.Module | None:
    """The model inside ``torch.compile(model)``'s wrapper; None for any other module."""
    inner = getattr(module, "_orig_mod", None)
    compiled = type(module).__name__ == "OptimizedModule" and isinstance(inner, torch.nn.Module)
    return inner if compiled else None


def recompile(model: torch.nn.Module) -> str:
    """Drop what torch.compile made of the model's forwards before tensordbg watched it, and
    say so (else nothing). Compiled code does not look for hooks added since it was made
    (``torch._dynamo.config.skip_nnmodule_hook_guards``), and it serves every instance of the
    class: a model compiled once, or another of its class (a run before the debugging one),
    ran its submodules without tensordbg's hooks, whose backward then looked "clean"."""
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list, reset_code
    except ImportError:  # a torch without them: nothing was compiled through them
        return ""
    kinds = dict.fromkeys(type(m) for m in model.modules())
    codes = {f"{kind.__qualname__}.forward": getattr(kind.forward, "__code__", None)
             for kind in kinds}  # fmt: skip
    codes["torch.nn.Module._call_impl"] = torch.nn.Module._call_impl.__code__
    dropped = [name for name, code in codes.items()
               if code is not None and _debug_get_cache_entry_list(code)]  # fmt: skip
    for name in dropped:
        reset_code(codes[name])
    if not dropped:
        return ""
    return (f"torch.compile had compiled {', '.join(dropped)} before tensordbg watched the "
            "model, and compiled code calls no hook added since: that code is dropped, and "
            "the next call compiles it again, with tensordbg's hooks (once)")  # fmt: skip
