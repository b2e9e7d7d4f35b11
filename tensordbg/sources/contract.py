"""What a UI can ask of a training: the :class:`Source` interface and its request dispatcher.

A live training serves a Source (``tensordbg.sources.live.LiveSource``) through the ZeroMQ server; a dump
will serve the same interface offline. The UI never knows which one it talks to. Every method
returns plain data that msgpack can carry (dicts, lists, str, int, float, bool, None), except that
tensor data comes as :class:`~WireArray` values at the top level of a reply
dict; the transport sends those as raw frames. This module never imports torch.

Payloads (field names are part of the protocol):

``TensorRef``: records are numbered per session (``ref``, an int); a ref names a tensor of the
current phase and is valid while that phase is retained (while paused, in practice).

``summary`` dicts are :meth:`tensordbg.statistics.Summary.as_dict`: ``numel, nan, posinf, neginf,
zeros, min, max, mean, std, abs_mean, l2`` (moments over finite elements).

``hit`` dicts are :meth:`tensordbg.hit.Hit.as_dict`: ``id, rule, tensor, module, kind, step,
phase, origin, value, threshold, message, ref, call, summary``.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable
from typing import Any, Protocol

EventCallback = Callable[[str, dict[str, Any]], None]
"""``callback(event, payload)``; it may be called from the training thread: it must only hand the
payload over, never block. The events and their payloads::

    "status": {"state": str, "step": int,            # the step running now
               "phase": str, "hits_total": int,
               "last": {"step": int, "loss": float | None, "grad_norm": float | None,
                        "steps_per_sec": float | None} | None}   # the step just completed:
                                                                  # a row of info()["history"]
    "hit":    a hit dict (below)
    "state":  {"state": "running" | "paused" | "detached" | "finished", "step": int,
               "reason": str}                     # why it paused, when it did
    "log":    {"level": "info" | "warning" | "error", "message": str, "step": int}
"""


class SourceError(Exception):
    """A request the source cannot serve; the message is shown to the person as it is.

    >>> raise SourceError("tensor 12 is no longer retained: pause the training to inspect it")
    """


class Source(Protocol):
    """The requests a UI can make. Methods raise :class:`SourceError` for a bad request."""

    def info(self) -> dict[str, Any]:
        """The session at a glance::

        {"run_id": str, "rank": int, "pid": int, "script": str, "model": str,
         "device": str, "torch": str, "live": bool,        # False for a dump
         "state": "running" | "paused" | "detached" | "finished",
         "step": int, "phase": str, "on_hit": str,
         "sync": "eager" | "batched" | "deferred",
         "paused_at": hit dict | None, "pause_reason": str,  # why it is paused
         "hits_total": int, "retain_bytes": int,
         "history": {"step": [int], "loss": [float|None], "grad_norm": [float|None],
                     "steps_per_sec": [float|None]}}   # last few hundred steps
        """
        ...

    def modules(self) -> list[dict[str, Any]]:
        """The model tree in ``named_modules()`` order, each with its latest statistics::

        [{"path": "layers.0.attn", "type": "MultiheadAttention", "depth": 2,
          "params": int, "hits": int,            # hits on this module so far
          "calls": int,                          # calls in the latest root forward
          "stats": {"output": summary, "grad_output": summary, ...}}]   # latest known
        """
        ...

    def hits(self, since: int = 0) -> list[dict[str, Any]]:
        """Hits with ``id >= since``, oldest first (within a step in execution order)."""
        ...

    def tensors(self) -> list[dict[str, Any]]:
        """The watched tensors of the current phase, in execution order::

        [{"ref": int, "name": str, "module": str, "kind": str, "call": int,
          "shape": [int], "dtype": str, "retained": bool, "summary": summary | None}]
        """
        ...

    def stats(self, ref: int, text: str = "") -> dict[str, Any]:
        """Statistics of a retained tensor, or of the slice ``text`` of it::

        {"ref": int, "name": str, "step": int,
         "index": str,                               # the slice as parsed, "" for all
         "shape": [int], "dtype": str, "summary": summary, "line": str,
         "previous": {"step": int, "summary": summary} | None}   # same tensor, last step
        """
        ...

    def slice(
        self, ref: int, text: str = "", window: list[list[int]] | None = None
    ) -> dict[str, Any]:
        """Values of the numpy-style slice ``text`` (e.g. ``"[0, :, 3:8:2]"``) of a tensor.

        The slice is evaluated in the training process; only its values cross the wire. The
        result is viewed as 2-D (rows x cols: a 1-D result is one row, dims before the last are
        flattened into rows); ``window=[[row0, row1], [col0, col1]]`` asks for part of that
        grid, which is how the UI's grid stays fast on 10^8 elements::

            {"ref": int, "index": str, "shape": [int],    # shape of the slice
             "rows": int, "cols": int, "window": [[r0, r1], [c0, c1]],
             "dtype": str, "data": WireArray}              # data: the window, 2-D
        """
        ...

    def histogram(
        self,
        ref: int,
        text: str = "",
        bins: int = 64,
        lo: float | None = None,
        hi: float | None = None,
    ) -> dict[str, Any]:
        """Histogram of the finite values of a tensor (or its slice), computed where it lives::

        {"ref": int, "index": str, "edges": [float] (bins+1), "counts": [int] (bins),
         "nan": int, "posinf": int, "neginf": int, "min": float, "max": float}
        """
        ...

    def provenance(self, ref: int, module: str | None = None, call: int = 0) -> dict[str, Any]:
        """Where a tensor came from, as the output (or input gradient) of the call ``call`` of
        ``module`` when given (a hit names it: a value a module's own code made is returned
        through its submodules), else of its innermost producer::

        {"ref": int, "name": str, "kind": str,
         "producer": {"module": str, "type": str, "call": int} | None,
         "returned_by": {"module": str, "type": str, "call": int} | None,  # a submodule
         "inputs": [{"ref": int | None, "name": str, "module": str, "shape": [int],
                     "dtype": str, "line": str, "nonfinite": bool | None}],
         "consumers": [{"module": str, "type": str, "call": int}],
         "source": {"file": str, "line": int, "function": str,
                    "context": [[int, str]]} | None,   # the user's line of the call
         "stack": [[file, line, function]]}             # innermost last
        """
        ...

    def rules(self) -> dict[str, Any]:
        """The session's rules and those that can be added::

        {"rules": [{"id": int, "name": str, "enabled": bool, "doc": str,
                    "params": {str: value}, "match": [str], "exclude": [str],
                    "kinds": [str], "disabled_reason": str | None, "hits": int}],
         "available": [{"name": str, "doc": str, "params": {str: value}}]}
        """
        ...

    def set_rule(
        self, id: int, enabled: bool | None = None, params: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Enable, disable or change thresholds of a rule; returns the rule's dict."""
        ...

    def add_rule(
        self, name: str, match: str = "*", params: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Add an available rule on the tensors matching ``match``; returns the rule's dict."""
        ...

    def recheck(self) -> list[dict[str, Any]]:
        """Judge the current phase again with the rules as they are now, without re-running the
        step; returns the hits found (they are also added to the session's hits)."""
        ...

    def control(self, action: str, n: int = 1) -> dict[str, Any]:
        """Drive the training: ``continue`` (to the next new origin hit), ``next`` (to the next
        hit of any kind), ``step`` (run ``n`` training steps, then pause), ``pause`` (as soon as
        possible), ``detach`` (remove the debugger and let the training run). Returns
        ``{"state": str, "step": int}``."""
        ...

    def subscribe(self, callback: EventCallback) -> Callable[[], None]:
        """Call ``callback`` on every pushed event; returns a function that unsubscribes."""
        ...


# Requests a client may make. Anything else is refused before a Source method runs, so a hostile
# client reaches no other attribute; parameter types are checked against the signatures above.
METHODS = (
    "info",
    "modules",
    "hits",
    "tensors",
    "stats",
    "slice",
    "histogram",
    "provenance",
    "rules",
    "set_rule",
    "add_rule",
    "recheck",
    "control",
)
_SIGNATURES = {m: inspect.signature(getattr(Source, m)) for m in METHODS}
_HINTS = {m: typing.get_type_hints(getattr(Source, m)) for m in METHODS}


def dispatch(source: Source, method: str, params: dict[str, Any]) -> Any:
    """Run one request against a source; the single entry both the server and in-process
    clients use. Raises :class:`SourceError` for an unknown method or a bad parameter."""
    if method not in _SIGNATURES:
        raise SourceError(f"unknown request {method!r}")
    try:
        _SIGNATURES[method].bind(None, **params)
    except TypeError as e:
        raise SourceError(f"bad parameters for {method!r}: {e}") from None
    for name, value in params.items():
        if not _conforms(value, _HINTS[method][name]):
            raise SourceError(f"parameter {name!r} of {method!r} cannot be {value!r}")
    return getattr(source, method)(**params)


def _conforms(value: Any, hint: Any) -> bool:
    """Whether a decoded msgpack value fits a simple type hint (unions, lists, dicts, scalars)."""
    if hint is Any:
        return True
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        return isinstance(value, list) and all(_conforms(v, item) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(isinstance(k, str) for k in value)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)
