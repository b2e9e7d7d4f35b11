"""The operation that made a NaN or Inf inside a module's forward, and the user's line of it.

The hooks see module calls, not operations: a hit at its origin names the module whose inputs
and parameters were clean and whose output was not, and the line that called it. The line that
made the value is inside that module's ``forward`` (a ``softmax`` over a row that a mask left
all ``-inf``, a ``log`` of a zero). To name it, tensordbg runs that forward once more, on the
same inputs, without gradients, under a ``TorchFunctionMode`` that looks at each operation's
result and stops at the first that holds a NaN (for a NaN hit) or an Inf (otherwise).

What the re-run may not change, it does not: the random number generators are forked (a
dropout draws without moving the training's stream), the module's buffers are restored
(BatchNorm's running statistics), tensors are handed over as copies (an in-place operation on
an input stays in the copy), and tensordbg's own hooks are off. It runs once per step at most,
only on a step with a forward hit at its origin, and only while the inputs are unchanged since
the call (their versions say so). In a job of several ranks a module whose forward talks to the
other ranks (DDP, FSDP, SyncBatchNorm, DTensor parameters) is not run again: that rank alone
would wait in the collective. Code with effects of its own (a counter, a cache on the
module) would see a second call: ``session.pinpoint = False`` turns the re-run off.

A module with a dropout module inside notes the random streams' state at each call in
training, and the re-run starts from it: it draws the same masks. A dropout in the user's own
code (``F.dropout`` with no dropout module) is drawn anew, so a NaN that depends on which
elements it drops may not come again; then nothing is named.
"""

from __future__ import annotations

import contextlib
import io
import linecache
import os
import sys
import tokenize
import warnings
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from tensordbg.engine.loss_code import name_loss_operation
from tensordbg.engine.records import Call, tensor_leaves, version_of
from tensordbg.engine.sites import user_site


class _Found(Exception):
    """Raised inside the re-run at the first bad result: nothing after it needs to run."""


class FirstBad(TorchFunctionMode):
    """Stops a forward at the first operation whose floating-point result holds a NaN
    (``nan=True``) or an Inf, noting the operation and the innermost user line."""

    def __init__(self, nan: bool, forward: Any = None,
                 site: tuple[Any, int] | None = None):  # fmt: skip
        super().__init__()
        self.nan = nan
        self.forward = getattr(forward, "__code__", None)  # the forward run again
        self.site = site  # the line that called it, for a forward of a library's module
        self.found: dict[str, Any] | None = None
        self.met = False  # a result held the bad value, whether this forward made it or not
        self.first_inf: dict[str, Any] | None = None
        """Looking for a NaN: the first operation that made an Inf of finite values (a
        division by zero); a NaN made of it later (Inf - Inf in a Linear) is its doing."""
        self.first_posinf: dict[str, Any] | None = None
        """Looking for a NaN: the first operation that made a +Inf where none was. A mask's
        -inf is put there on purpose; a +Inf handed to the operation that made the NaN (a
        softmax) is that operation's doing, not the mask's."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        # An in-place write (``x[i] = nan``, ``x.log_()``) makes the value in its first
        # argument: that one is looked at after it, and was clean before it if it made it.
        target = args[0] if args and _in_place(func) else None
        was_clean = target is not None and not _holds_bad(target, self.nan)
        had_posinf = self.nan and target is not None and _holds(target, torch.isposinf)
        result = func(*args, **kwargs)
        made = _holds_bad(result, self.nan) or (was_clean and _holds_bad(target, self.nan))
        given = [*(args[1:] if target is not None else args), *kwargs.values()]
        if (
            self.nan
            and self.first_posinf is None
            and not made
            and not had_posinf
            and (_holds(result, torch.isposinf) or _holds(target, torch.isposinf))
            and not any(_holds(a, torch.isposinf) for a in given)
        ):
            self.first_posinf = self._where(func, sys._getframe(1))
        if (
            self.nan
            and self.first_inf is None
            and not made
            and _holds_bad(result, False)
            and not any(_holds_bad(a, False) or _holds_bad(a, True) for a in given)
        ):
            self.first_inf = self._where(func, sys._getframe(1))
        if self.found is None and made:
            self.met = True
            # An operation that was handed the bad value (a weight that was NaN already) did
            # not make it: nothing is named.
            if (target is None or was_clean) and not any(_holds_bad(a, self.nan) for a in given):
                frame = sys._getframe(1)
                # Inside a submodule, handed an Inf that this forward's own code made: the
                # submodule passed it on (Inf - Inf in its Linear); the Inf's operation is named.
                # (A softmax of a row that a mask left all -inf, in the forward's own code,
                # makes its NaN itself.)
                inf = (self.first_inf is not None and any(_holds_bad(a, False) for a in given)
                       and self._in_submodule(frame))  # fmt: skip
                first = self.first_inf if inf else None
                if self.first_posinf is not None and any(_holds(a, torch.isposinf) for a in given):
                    first = self.first_posinf
                self.found = {**first, "inf_first": True} if first else self._where(func, frame)
            raise _Found
        return result

    def _where(self, func: Any, frame: Any) -> dict[str, Any]:
        """The operation and the user's line that ran it: inside a library module's forward
        (a LayerNorm's), the line that called the module, in every mode (a re-run after the
        forward, deferred or batched, named the line that ran the model, or its backward)."""
        return _where(func, user_site(frame, self.forward) or self.site)

    def _in_submodule(self, frame: Any) -> bool:
        """Whether ``frame`` runs inside a module called from the forward run again."""
        while frame is not None and frame.f_code is not self.forward:
            if frame.f_code in _CALL_IMPL:
                return True
            frame = frame.f_back
        return False


_CALL_IMPL = frozenset(
    f.__code__
    for f in (nn.Module._call_impl, nn.Module._wrapped_call_impl)
    if hasattr(f, "__code__")
)


class Pinpointing:
    """Part of :class:`~tensordbg.engine.session.Session`: naming the operation of a forward
    hit at its origin. ``session.pinpoint = False`` turns the re-run off."""

    pinpoint = True
    _pinpointed_step = -1
    _pinpointed: dict[tuple[int, bool], Any]  # this step's re-runs: (call, NaN or Inf) -> found

    def _name_operation(self, hit: Any, verdict: Any, record: Any) -> None:
        """For a forward hit at its origin on a NaN or Inf made by a module's own code: name
        the operation (once per step) in the hit's message and the call's provenance."""
        stats = record.stats
        if not (self.pinpoint and verdict.origin and stats.nonfinite):
            return
        if stats.kind == "observed":  # in any phase: a GAN's second loss comes after a backward
            self._name_loss_operation(hit, record)
            return
        if stats.phase != "forward":
            return
        call = verdict.call or record.producer
        tensor = record.held()
        if call is None or tensor is None:
            return
        nan = _names_nan(hit, tensor)
        if self._pinpointed_step != self.step:
            self._pinpointed_step, self._pinpointed = self.step, {}
        key = (id(call), nan)
        if key not in self._pinpointed:
            if len(self._pinpointed) >= 2:
                return  # two re-runs a step at most (a NaN's and an Inf's)
            hooks = _forward_hooks(call.invocation[0]) if call.invocation else []
            self._pinpointed[key] = (name_operation(self, call, nan), hooks)
        found, hooks = self._pinpointed[key]
        if found is NOT_MADE_AGAIN:
            bad = "NaN" if nan else "Inf"
            if hooks:  # the re-run is the module's forward alone: a hook of the script's may
                hit.message += (f" Its forward, run again to name the operation without the "
                                f"forward hooks on the module ({', '.join(hooks)}), made no "
                                f"{bad}: one of those hooks may have made it (or the forward "
                                "depends on something the first run changed), so the "
                                "operation is not named.")  # fmt: skip
            else:
                hit.message += (f" Its forward, run again to name the operation, made no {bad} "
                                "this time: it depends on something the first run changed (a "
                                "counter, a global, a draw not from torch's streams), so the "
                                "operation is not named.")  # fmt: skip
        elif found is not None:
            if call.operation is None:  # the first named: its provenance says which it made
                made = "Inf" if not nan or found.get("inf_first") else "NaN"
                call.operation = {**found, "value": made}
            hit.message += sentence(call, found, nan)

    def _name_loss_operation(self, hit: Any, record: Any) -> None:
        """For an observed tensor (the loss) at the origin of a NaN or Inf: where it was
        observed, and the operation of the code between the model's outputs and it that made
        it, when autograd's saved tensors tell (engine/loss_code.py)."""
        site = self.observed.site(record.stats.name)
        if site:
            hit.message += f" It was observed at {site}."
        loss = record.held()
        if loss is None:
            return
        # The outputs of the step's root calls: the model's, or a submodule's called alone
        # (Lightning's self.net(x): the LightningModule itself is not called).
        # Held weakly by the capture: alive while the loss is made of them, whether or not their
        # phase let go of them (a GAN's second loss, observed after the first one's backward).
        outputs = [t for ref in self.capture.root_outputs if (t := ref()) is not None]
        with contextlib.suppress(Exception):  # a courtesy: whatever the graph holds, the hit stands
            hit.message += name_loss_operation(loss, outputs, _names_nan(hit, loss))


def _forward_hooks(module: nn.Module) -> list[str]:
    """The names of the forward hooks on ``module`` that are not tensordbg's (the script's):
    a re-run of its forward does not run them."""
    hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
    return [getattr(h, "__qualname__", type(h).__name__) for h in hooks
            if not str(getattr(h, "__module__", "")).startswith("tensordbg.")]  # fmt: skip


def _names_nan(hit: Any, tensor: torch.Tensor) -> bool:
    """Whether ``hit`` names where the first NaN came from (else the first Inf): the NaN rule's
    does, Overflow's does not (one tensor may hold both); another rule's, if there is one."""
    if hit.rule in ("NaN", "Overflow"):
        return hit.rule == "NaN"
    return bool(torch.isnan(tensor).any())


NOT_MADE_AGAIN: dict[str, Any] = {"op": ""}
"""What :func:`name_operation` returns when the re-run ran whole and made no such value."""


def name_operation(session: Any, call: Call, nan: bool) -> dict[str, Any] | None:
    """The operation inside ``call``'s forward that made the first NaN (``nan``; else Inf) of
    its output, as ``{"op", "file", "line", "function", "code", "first_line"}``; None when it
    cannot be named (the call's inputs changed since, the module is compiled or talks to other
    ranks, the re-run raised); :data:`NOT_MADE_AGAIN` when the re-run made no such value."""
    invocation = call.invocation
    if invocation is None:
        return None
    module, args, kwargs, seen, random_state = invocation
    if any(version_of(t) != version for _, t, version, _ in seen):
        return None  # changed in place since the call: a re-run would not see the same values
    if type(module).__name__ == "OptimizedModule":
        return None  # torch.compile's: its forward is a graph, not lines
    if _collective(module):
        return None  # one rank alone would wait in it for ever
    watch = FirstBad(nan, type(module).forward, call.site)
    devices = sorted({t.device.index for _, t, _, _ in seen if t.device.type == "cuda"})
    with _quiet(session), _buffers_kept(module), torch.random.fork_rng(devices=devices):
        if random_state is not None:  # the same dropout masks as the call drew
            set_random_state(random_state)
        try:
            with torch.no_grad(), watch:
                again = module.forward(*tree_map(_copy, args), **tree_map(_copy, kwargs))
        except _Found:
            pass
        except Exception:  # the re-run is a courtesy: whatever it raises, the hit stands
            return None
        else:  # ran whole: made again where no operation shows it (an ``out=``), or not at all
            if any(_holds_bad(t, nan) for _, t in tensor_leaves(again)):
                return None
    return watch.found if watch.met else NOT_MADE_AGAIN


# Modules that draw from the random streams in their forward: a re-run of a forward that holds
# one starts from the streams' state at the call (noted then), so that it draws the same masks.
RANDOM = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
          nn.FeatureAlphaDropout, nn.MultiheadAttention)  # fmt: skip


def draws_random(module: nn.Module) -> bool:
    """Whether ``module`` or a module inside it draws random numbers in training (dropout)."""
    return any(
        isinstance(m, RANDOM) and getattr(m, "p", getattr(m, "dropout", 0.0)) > 0
        for m in module.modules()
    )


def random_state(seen: list[Any]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """The CPU stream's state and that of each CUDA device the call's inputs are on."""
    cuda = {t.device.index: torch.cuda.get_rng_state(t.device)
            for _, t, _, _ in seen if t.device.type == "cuda"}  # fmt: skip
    return torch.get_rng_state(), cuda


def set_random_state(state: tuple[torch.Tensor, dict[int, torch.Tensor]]) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    for index, value in cuda.items():
        torch.cuda.set_rng_state(value, index)


def sentence(call: Call, found: dict[str, Any], nan: bool) -> str:
    """What the hit says of the operation that was named."""
    what = "NaN" if nan else "Inf"
    where = call.path or "the model"
    place = f" at {os.path.basename(found['file'])}:{found['line']}" if found["file"] else ""
    code = f" ({found['code']})" if found["code"] else ""
    if found.get("inf_first"):
        return (f" Inside {where}'s forward an Inf came first, from {found['op']}{place}{code}, "
                "and the NaN was made of it later (Inf - Inf, 0 x Inf).")  # fmt: skip
    return f" Inside {where}'s forward the first {what} came from {found['op']}{place}{code}."


# Modules whose forward talks to the other ranks (a broadcast of buffers, an all-gather of
# parameters or of batch statistics): a forward run again on one rank would wait for ever.
_COLLECTIVE = ("DistributedDataParallel", "FullyShardedDataParallel", "SyncBatchNorm")


def _collective(module: torch.nn.Module) -> bool:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    for m in module.modules():
        name = type(m).__name__
        if name in _COLLECTIVE or name.startswith("FSDP"):  # FSDP2 renames the classes
            return True
    return any(type(p).__name__ == "DTensor" for p in module.parameters())


def _holds_bad(result: Any, nan: bool) -> bool:
    return _holds(result, torch.isnan if nan else torch.isinf)


def _holds(result: Any, test: Any) -> bool:
    """Whether a result (a tensor, or tensors in a tuple or list) holds a value ``test`` finds
    (``torch.isnan``, ``torch.isinf``, ``torch.isposinf``)."""
    if not isinstance(result, torch.Tensor):
        if isinstance(result, (tuple, list)):
            return any(_holds(r, test) for r in result)
        return False
    if not result.is_floating_point() or result.layout != torch.strided or not result.numel():
        return False
    return bool(test(result).any())


def _in_place(func: Any) -> bool:
    """Whether ``func`` writes into its first argument: ``Tensor.__setitem__`` (``x[i] = v``)
    and the in-place methods (``x.add_(y)``, ``x.masked_fill_(m, v)``)."""
    name = getattr(func, "__name__", "")
    return name == "__setitem__" or (name.endswith("_") and not name.endswith("__"))


def _where(func: Any, site: tuple[Any, int] | None) -> dict[str, Any]:
    name = getattr(func, "__qualname__", "") or getattr(func, "__name__", "") or repr(func)
    name = name.replace("_VariableFunctionsClass.", "")  # torch.softmax and its kin
    if name.startswith(("TensorBase.", "Tensor.")):
        op = "Tensor." + name.split(".", 1)[1]
    else:
        owner = getattr(func, "__module__", None) or "torch"
        owner = owner.replace("torch._C._nn", "torch.nn.functional")
        op = f"{owner}.{name}"
    if site is None:
        return {"op": op, "file": "", "line": 0, "function": "", "code": "", "first_line": 0}
    code, line = site
    text = _without_comment(linecache.getline(code.co_filename, line).strip())
    return {"op": op, "file": code.co_filename, "line": line, "function": code.co_name,
            "code": text, "first_line": code.co_firstlineno}  # fmt: skip


def _without_comment(line: str) -> str:
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(line).readline))
    except (tokenize.TokenError, SyntaxError):  # a line of a longer statement
        return line
    comment = next((t for t in tokens if t.type == tokenize.COMMENT), None)
    return line[: comment.start[1]].rstrip() if comment is not None else line


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


@contextmanager
def _quiet(session: Any):
    """tensordbg's own hooks do nothing while the forward runs again, and what it warns of is
    not said: the training's own forward said it, if anything (a re-run under no_grad made
    torch.utils.checkpoint warn that no input requires grad, as if of the user's code)."""
    capture = session.capture
    capture.suspended = True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        capture.suspended = False


@contextmanager
def _buffers_kept(module: torch.nn.Module):
    """The re-run works on copies of the module's buffers (BatchNorm updates its running
    statistics in a forward): the training's own are never written. Writing them back after
    the re-run moved their version past what autograd had saved of them, and the training's
    backward failed ("modified by an inplace operation")."""
    swapped = [(owner, name, buffer) for owner in module.modules()
               for name, buffer in owner._buffers.items() if buffer is not None]  # fmt: skip
    for owner, name, buffer in swapped:
        owner._buffers[name] = buffer.detach().clone()
    try:
        yield
    finally:
        for owner, name, buffer in swapped:
            owner._buffers[name] = buffer
