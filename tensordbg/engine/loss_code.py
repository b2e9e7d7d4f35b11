"""The operation of the user's loss code that made a NaN or Inf the model's outputs did not hold.

An observed loss that is not finite while the model's outputs were is made by the code between
them (a ``log`` of a probability that reached 0, a division by a count that was 0). That code
is no module: no hook saw its operations, and it cannot be run again. What autograd saved for
the backward pass can still be read: walking the loss's graph back to the model's outputs, in
the order the operations ran, the first operation whose saved result holds the bad value, or
whose saved input lies outside what it accepts (``log`` of values <= 0, a divisor of 0, a power
0.5 of negative values), while its saved inputs are finite, is named. An operation that saves
neither (``sum``, ``sub``) cannot be seen into: then nothing is named. It runs once per step,
only on a step whose observed loss is the origin of a NaN or Inf.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from types import CodeType
from typing import Any

import torch

from tensordbg.engine.sites import in_framework, user_site

_MAX_NODES = 2000
"""Loss code is short: a graph this large is the model's own, left when no boundary is known."""


def _log_domain(low: float) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t <= low


# An operation's name: (what it was given that it does not accept, the saved tensor holding it,
# the values outside, whether the smallest of them is worth saying).
_DOMAINS: dict[str, tuple[str, str, Callable[[torch.Tensor], torch.Tensor], bool]] = {
    "log": ("log of {n} values <= 0", "_saved_self", _log_domain(0.0), True),
    "log2": ("log2 of {n} values <= 0", "_saved_self", _log_domain(0.0), True),
    "log10": ("log10 of {n} values <= 0", "_saved_self", _log_domain(0.0), True),
    "log1p": ("log1p of {n} values <= -1", "_saved_self", _log_domain(-1.0), True),
    "acos": ("acos of {n} values outside [-1, 1]", "_saved_self", lambda t: t.abs() > 1, False),
    "asin": ("asin of {n} values outside [-1, 1]", "_saved_self", lambda t: t.abs() > 1, False),
    "atanh": ("atanh of {n} values outside (-1, 1)", "_saved_self", lambda t: t.abs() >= 1, False),
    "div": ("a division by 0 ({n} zeros in the divisor)", "_saved_other", lambda t: t == 0, False),
    "xlogy": ("xlogy of {n} values < 0", "_saved_other", lambda t: t < 0, True),
}


def _outside(name: str, node: Any) -> str:
    """What the operation was given that it does not accept, if its saved input says so."""
    if name == "pow":  # a tensor to a number's power
        exponent, values = getattr(node, "_saved_exponent", None), _saved(node, "_saved_self")
        if values is None or not isinstance(exponent, (int, float)):
            return ""
        if exponent < 0:
            what, outside, smallest = f"a power {exponent:g} of {{n}} zeros", values == 0, False
        elif exponent != int(exponent):
            what, outside, smallest = f"a power {exponent:g} of {{n}} values < 0", values < 0, True
        else:
            return ""
    elif name in _DOMAINS:
        what, attr, test, smallest = _DOMAINS[name]
        values = _saved(node, attr)
        if values is None:
            return ""
        outside = test(values)
    else:
        return ""
    count = int(outside.sum())
    if not count:
        return ""
    if name == "div" and values.dim() == 0:
        # A Python number and a one-element count are saved alike (``out / 0``, ``s / m.sum()``)
        return ("a division by 0 (one value, 0, as the divisor: a number, or a one-element "
                "tensor such as a count that came to 0)")  # fmt: skip
    least = float(values.min())
    shown = f" (the smallest {least:.4g})" if smallest and math.isfinite(least) else ""
    return what.format(n=f"{count:,}") + shown


def _saved(node: Any, attr: str) -> torch.Tensor | None:
    try:
        value = getattr(node, attr, None)
    except RuntimeError:  # freed: the backward pass ran through this node
        return None
    # Integer tensors too: ``out / 0`` saves its divisor as an int64 tensor (a wrapped number).
    if isinstance(value, torch.Tensor) and not value.is_complex():
        return value.detach()
    return None


def _finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())


def _op(node: Any) -> str:
    """``LogBackward0`` -> ``log``, ``LogSoftmaxBackward0`` -> ``log_softmax``."""
    name = type(node).__name__.split("Backward")[0]
    out = "".join(f"_{c.lower()}" if c.isupper() else c for c in name).lstrip("_")
    return "log1p" if out == "log1_p" else out


def _in_order(loss_node: Any, boundary: set[int]) -> list[Any] | None:
    """The loss code's nodes, each after those it takes its inputs from (the order they ran);
    None when the walk grows past :data:`_MAX_NODES`."""
    order: list[Any] = []
    seen: set[int] = set()
    stack: list[tuple[Any, bool]] = [(loss_node, False)]
    while stack:
        node, done = stack.pop()
        if done:
            order.append(node)
            continue
        if id(node) in seen or id(node) in boundary:
            continue
        seen.add(id(node))
        if len(seen) > _MAX_NODES:
            return None
        stack.append((node, True))
        for nxt, _ in node.next_functions:
            if nxt is not None and type(nxt).__name__ != "AccumulateGrad":
                stack.append((nxt, False))
    return order


def name_loss_operation(loss: torch.Tensor, outputs: list[torch.Tensor], nan: bool) -> str:
    """The sentence naming the operation between the model's ``outputs`` and ``loss`` that made
    its first NaN (``nan``; else Inf), or ``""`` when autograd's saved tensors cannot tell."""
    node = loss.grad_fn
    if node is None:
        return ""
    boundary = {id(o.grad_fn) for o in outputs if o.grad_fn is not None}
    if not boundary:
        return ""  # without the model's outputs the walk cannot tell loss code from model
    order = _in_order(node, boundary)
    if order is None:
        return ""
    what = "NaN" if nan else "Inf"
    for node in order:
        inputs = [t for attr in dir(node) if attr.startswith("_saved_") and attr != "_saved_result"
                  if (t := _saved(node, attr)) is not None]  # fmt: skip
        if not all(_finite(t) for t in inputs):
            return ""  # an earlier operation made it, one that saved nothing to show it
        name = _op(node)
        result = _saved(node, "_saved_result")
        if result is not None and not _finite(result):
            inputs_were = ("its inputs were finite" if inputs else "autograd kept none of its "
                           "inputs: an earlier operation that keeps none, such as a "
                           "multiplication or an addition of a number, may have made a NaN or "
                           "Inf that it passed on")  # fmt: skip
            return (f" Between the model's outputs and it, the first {what} autograd kept came "
                    f"from {name} (its result; {inputs_were}).")  # fmt: skip
        outside = _outside(name, node)
        if outside:
            return (f" Between the model's outputs and it, the first operation given values it "
                    f"does not accept: {outside}.")  # fmt: skip
    return ""


class Observations:
    """This step's ``session.observe`` calls: how often each name was given (its k-th is
    ``name#k``), and the user's line that gave each."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        self._sites: dict[str, tuple[CodeType, int] | None] = {}
        self._since: dict[str, tuple[int, int]] = {}  # name -> (root forwards, times since)
        self.apart = False
        """The latest observed value came of no call of the watched model (see :meth:`note`)."""
        self._said_apart = False

    def note(self, name: str, frame: Any, tensor: torch.Tensor, begin: Callable,
             watched: tuple[int, Callable[[str, str], None], int]) -> int:  # fmt: skip
        """Count one more ``name``, observed from ``frame``: its index in the step. A backward
        pass through ``tensor`` calls ``begin`` before its own node runs: the forward phase ends
        (and is judged) while the loss code's saved tensors are still there to be read.
        ``watched``: the watched model's root calls so far, the session's log, the step. A name
        observed a third time with no call of the model since is of a model apart (rebuilt for
        a resume): :attr:`apart`, said once. (Twice is a script's two losses of one forward.)"""
        forwards, log, step = watched
        last, times = self._since.get(name, (-1, 0))
        times = times + 1 if last == forwards else 1
        self._since[name] = (forwards, times)
        self.apart = times >= 3
        if self.apart and not self._said_apart:
            self._said_apart = True
            said = (f"step {step}: {name} was observed {times} times with no call of the watched "
                    "model between them: it comes of a model tensordbg does not watch (built "
                    "anew for a resume?). tensordbg watches the model it attached to: attach "
                    "again to the one the script trains now")  # fmt: skip
            log(said, "warning")
            print(f"tensordbg: {said}", file=sys.stderr, flush=True)
        call = self._counts.get(name, 0)
        self._counts[name] = call + 1
        site = user_site(frame)
        if site is not None and in_framework(site[0]):
            site = None  # a trainer's hook observed it (Lightning's on_before_backward): no line
        self._sites[f"{name}#{call}" if call else name] = site
        if tensor.grad_fn is not None:
            tensor.grad_fn.register_prehook(begin)
        return call

    def where(self, named: str) -> tuple[CodeType, int] | None:
        """The user's line that observed ``named`` (the latest step's: kept across steps)."""
        return self._sites.get(named)

    def site(self, named: str) -> str:
        """``train.py:14``: where ``named`` was observed, or ``""``."""
        site = self._sites.get(named)
        return f"{os.path.basename(site[0].co_filename)}:{site[1]}" if site else ""

    def unread_forward(self) -> str:
        """What a deferred backward origin says of the forward values it did not read: the
        model's outputs were finite, and so was the loss if this step observed one. Else a
        NaN the loss code made (0/0 in a hand-written mean over no tokens) shows first in
        backward, and the sentence says so: it said "its outputs and loss were finite" of a
        loss no one watched (found trying the product as a new user)."""
        masked = ("an Inf the forward made and later code masked (nan_to_num, torch.where) "
                  "would show first here; sync='eager' reads every one.")  # fmt: skip
        if self._counts:
            return (" Deferred checks read no forward value of this step (its outputs and loss "
                    f"were finite): {masked}")  # fmt: skip
        return (" Deferred checks read no forward value of this step but its outputs, which "
                "were finite, and no loss was observed: a NaN the loss code made (0/0 in a mean "
                "over no tokens) shows first here, and session.observe('loss', loss) or "
                f"tensordbg run names it at its line. Or {masked}")  # fmt: skip

    def clear(self) -> None:
        """A step ended: count anew (the lines stay: a hit is shown after its step)."""
        self._counts.clear()
