"""What a UI can ask of a training: the :class:`Source` interface, the schema of every reply and
event on the wire, and :func:`dispatch`, the one entry requests take.

A live training serves a Source (``tensordbg.sources.live.LiveSource``) through the ZeroMQ server;
a dump will serve the same interface offline. The UI never knows which one it talks to, except
through the source's :attr:`Source.capabilities`: a recorded run cannot be driven, so it serves
no ``control``. Every method returns plain data that msgpack can carry (dicts, lists, str, int,
float, bool, None), except that tensor data comes as a WireArray (``tensordbg.transport.wire``)
at the top level of a reply dict; the transport sends those as raw frames. This module never
imports torch.

The payloads are the TypedDicts below (their field names are the protocol); :func:`check`
validates a value against one, as the conformance tests do to each source's replies and the UI
to what it receives::

    >>> check(reply, REPLIES["stats"])
    SchemaError: stats.summary.numel: expected int, got '32'

``ref``: records are numbered per session; a ref names a tensor of the current phase and is valid
while that phase is retained (while paused, in practice).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Collection
from typing import Any, Protocol, TypedDict

if sys.version_info >= (3, 11):
    from typing import get_type_hints
else:
    from typing_extensions import get_type_hints

from tensordbg.sources.checking import SchemaError as SchemaError
from tensordbg.sources.checking import check as check
from tensordbg.sources.checking import conforms as conforms

# The schema's names, re-exported: the contract is where a reader looks for them.
from tensordbg.sources.profile_schema import Advice as Advice
from tensordbg.sources.profile_schema import BreakdownRow as BreakdownRow
from tensordbg.sources.profile_schema import Gpu as Gpu
from tensordbg.sources.profile_schema import GpuDevice as GpuDevice
from tensordbg.sources.profile_schema import GpuEvent as GpuEvent
from tensordbg.sources.profile_schema import GpuSample as GpuSample
from tensordbg.sources.profile_schema import OperatorRow as OperatorRow
from tensordbg.sources.profile_schema import ProfileEvent as ProfileEvent
from tensordbg.sources.profile_schema import ProfilePending as ProfilePending
from tensordbg.sources.profile_schema import ProfileReport as ProfileReport
from tensordbg.sources.schema import EVENTS as EVENTS
from tensordbg.sources.schema import ArrayData as ArrayData
from tensordbg.sources.schema import AvailableRule as AvailableRule
from tensordbg.sources.schema import CallSite as CallSite
from tensordbg.sources.schema import Control as Control
from tensordbg.sources.schema import Found as Found
from tensordbg.sources.schema import Histogram as Histogram
from tensordbg.sources.schema import History as History
from tensordbg.sources.schema import Hit as Hit
from tensordbg.sources.schema import Info as Info
from tensordbg.sources.schema import LogEvent as LogEvent
from tensordbg.sources.schema import Module as Module
from tensordbg.sources.schema import Previous as Previous
from tensordbg.sources.schema import Provenance as Provenance
from tensordbg.sources.schema import ProvenanceInput as ProvenanceInput
from tensordbg.sources.schema import Replay as Replay
from tensordbg.sources.schema import Rule as Rule
from tensordbg.sources.schema import Rules as Rules
from tensordbg.sources.schema import RunningRule as RunningRule
from tensordbg.sources.schema import Slice as Slice
from tensordbg.sources.schema import SourceLine as SourceLine
from tensordbg.sources.schema import StateEvent as StateEvent
from tensordbg.sources.schema import Stats as Stats
from tensordbg.sources.schema import StatusEvent as StatusEvent
from tensordbg.sources.schema import StepNumbers as StepNumbers
from tensordbg.sources.schema import Summary as Summary
from tensordbg.sources.schema import Tensor as Tensor
from tensordbg.sources.schema import TrainingState as TrainingState
from tensordbg.sources.schema import Welcome as Welcome

EventCallback = Callable[[str, dict[str, Any]], None]
"""``callback(event, payload)`` with an event of :data:`EVENTS`; it may be called from the training
thread: it must only hand the payload over, never block."""


class Recheck(TypedDict):
    """What a recheck found: the hits not found before, and how many tensors its rules could not
    judge because a statistic they want was never measured and the tensor is no longer held
    (``why`` says why, of the first of them; "" when every tensor was judged). A rule added
    while paused wants statistics nobody measured: "no new hit" is only true when
    ``unjudged`` is 0."""

    at: str  # the phase it judged: "step 3, backward" (a rule on another phase's tensors waits)
    hits: list[Hit]
    unjudged: int
    why: str


class SourceError(Exception):
    """A request the source cannot serve; the message is shown to the person as it is.

    >>> raise SourceError("tensor 12 is no longer retained: pause the training to inspect it")
    """


# --- the interface ------------------------------------------------------------------------------


class Source(Protocol):
    """The requests a UI can make. Methods raise :class:`SourceError` for a bad request.

    ``capabilities`` names the requests the source serves (a subset of :data:`METHODS` with at
    least ``info`` and ``hits``); :func:`dispatch` refuses the others with a sentence. A source
    that declares none serves them all.

    >>> class ReplaySource:
    ...     capabilities = READ_ONLY
    """

    capabilities: frozenset[str]

    def info(self) -> Info:
        """The session at a glance (``capabilities`` is filled in by :func:`dispatch`)."""
        ...

    def modules(self) -> list[Module]:
        """The model tree in ``named_modules()`` order, each with its latest statistics."""
        ...

    def hits(self, since: int = 0) -> list[Hit]:
        """Hits with ``id >= since``, oldest first (within a step in execution order)."""
        ...

    def tensors(self) -> list[Tensor]:
        """The watched tensors of the current phase, in execution order."""
        ...

    def stats(self, ref: int, text: str = "") -> Stats:
        """Statistics of a retained tensor, or of the slice ``text`` of it, with the same
        tensor's at the previous step."""
        ...

    def slice(self, ref: int, text: str = "", window: list[list[int]] | None = None) -> Slice:
        """Values of the numpy-style slice ``text`` (e.g. ``"[0, :, 3:8:2]"``) of a tensor.

        The slice is evaluated in the training process; only its values cross the wire. The
        result is viewed as 2-D (rows x cols: a 1-D result is one row, dims before the last are
        flattened into rows); ``window=[[row0, row1], [col0, col1]]`` asks for part of that
        grid, which is how the UI's grid stays fast on 10^8 elements."""
        ...

    def find(self, ref: int, text: str = "", after: int = -1) -> Found:
        """The next NaN or Inf of a tensor (or its slice) after the row-major position
        ``after``, wrapping round to the first when none lies after it: how the UI's grid jumps
        from one to the next. Read where the tensor lives, a chunk at a time."""
        ...

    def histogram(
        self,
        ref: int,
        text: str = "",
        bins: int = 64,
        lo: float | None = None,
        hi: float | None = None,
    ) -> Histogram:
        """Histogram of the finite values of a tensor (or its slice), computed where it lives."""
        ...

    def provenance(self, ref: int, module: str | None = None, call: int = 0) -> Provenance:
        """Where a tensor came from, as the output (or input gradient) of the call ``call`` of
        ``module`` when given (a hit names it: a value a module's own code made is returned
        through its submodules), else of its innermost producer."""
        ...

    def rules(self) -> Rules:
        """The session's rules and those that can be added."""
        ...

    def set_rule(
        self, id: int, enabled: bool | None = None, params: dict[str, Any] | None = None
    ) -> Rule:
        """Enable, disable or change thresholds of a rule; returns the rule."""
        ...

    def add_rule(self, name: str, match: str = "*", params: dict[str, Any] | None = None) -> Rule:
        """Add an available rule on the tensors matching ``match``; returns the rule."""
        ...

    def recheck(self) -> Recheck:
        """Judge the current phase again with the rules as they are now, without re-running the
        step; returns the hits found (they are also added to the session's hits) and what could
        not be judged."""
        ...

    def control(self, action: str, n: int = 1) -> Control:
        """Drive the training: ``continue`` (to the next new origin hit), ``next`` (to the next
        hit of any kind), ``step`` (run ``n`` training steps, then pause), ``pause`` (as soon as
        possible), ``detach`` (remove the debugger and let the training run)."""
        ...

    def goto(self, step: int | None = None, move: int = 0) -> Info:
        """A recorded run only: show the dumped step ``step``, or the one ``move`` places from
        the shown one (1 the next, -1 the previous); returns the new :meth:`info`. A broken
        step is shown as broken (``info["replay"]["broken"]``), never an error."""
        ...

    def profile(self, steps: int = 5, record_shapes: bool = False) -> ProfilePending:
        """Profile the next ``steps`` training steps, after one warm-up step (``torch.profiler``
        in the training process, started by the training thread at its next step boundary),
        with the operators' input shapes when ``record_shapes`` (slower). The ``profile`` event
        says when the report is ready; raw traces never cross the wire."""
        ...

    def profile_report(self) -> ProfileReport | None:
        """The latest finished profile report (None before one); a recorded run serves the one
        it stored."""
        ...

    def gpu(self, since: float = 0.0) -> Gpu:
        """NVML samples of the training's GPUs newer than ``since`` (a ``time.time()``), from a
        bounded ring a background sampler fills; ``available`` false with a ``reason`` where
        there is no NVML."""
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
    "find",
    "histogram",
    "provenance",
    "rules",
    "set_rule",
    "add_rule",
    "recheck",
    "control",
    "goto",
    "profile",
    "profile_report",
    "gpu",
)
RECORDED_ONLY = frozenset({"goto"})
"""Requests only a recorded run serves: moving between its dumped steps."""
EVERY_REQUEST = frozenset(METHODS) - RECORDED_ONLY
"""What a running training serves (everything but moving between recorded steps)."""
READ_ONLY = EVERY_REQUEST - {"set_rule", "add_rule", "recheck", "control", "profile", "gpu"}
"""What a recorded run can serve at least: it can be read, not driven nor re-judged (nor
profiled: it serves the profile report it stored)."""
REPLAY = READ_ONLY | RECORDED_ONLY
"""What a replay of a dump serves (``tensordbg.sources.replay.ReplaySource``): READ_ONLY, and
moving between the dumped steps."""
PROFILING = frozenset({"profile", "profile_report", "gpu"})
"""The optional capabilities of profiling: ``profile`` needs ``control`` (it drives the
training); ``gpu`` needs a training process to sample in."""
NEEDED = frozenset({"info", "hits"})  # the hello reply is made of them

_SIGNATURES = {m: inspect.signature(getattr(Source, m)) for m in METHODS}
_HINTS = {m: get_type_hints(getattr(Source, m)) for m in METHODS}
REPLIES: dict[str, Any] = {m: _HINTS[m].pop("return") for m in METHODS}
"""The schema of the reply to each request: ``check(reply, REPLIES["stats"])``."""

_CANNOT = {
    "control": (
        "drive the training (continue, run to the next hit, step, pause, skip an update or detach)"
    ),
    "set_rule": "change a rule",
    "add_rule": "add a rule",
    "recheck": "judge a step again",
    "goto": "move to another recorded step",
    "profile": "profile the training",
    "gpu": "sample the GPUs (NVML)",
}


def capabilities_of(source: object) -> frozenset[str]:
    """The requests ``source`` serves: its ``capabilities``, or every request of a running
    training (:data:`EVERY_REQUEST`) when it declares none. A declaration naming unknown
    requests, or lacking ``info`` or ``hits``, is a bug in the source: TypeError."""
    declared = getattr(source, "capabilities", None)
    if declared is None:
        return EVERY_REQUEST
    serves = frozenset(declared)
    if not NEEDED <= serves <= frozenset(METHODS):
        raise TypeError(
            f"{type(source).__name__}.capabilities must name requests of METHODS, info and hits "
            f"among them, not {sorted(serves)}"
        )
    return serves


def refusal(method: str, serves: Collection[str]) -> str:
    """Why a source serving ``serves`` does not serve ``method``, in a sentence for the person.

    >>> refusal("control", READ_ONLY)
    'this session is a recorded run, not a running training: it cannot drive the training ...'
    """
    what = _CANNOT.get(method, f"answer {method!r}")
    if method in RECORDED_ONLY and "control" in serves:
        return f"this session is a running training, not a recorded run: it cannot {what}"
    if "control" not in serves:
        return f"this session is a recorded run, not a running training: it cannot {what}"
    return f"this session cannot {what}"


def dispatch(source: Source, method: str, params: dict[str, Any]) -> Any:
    """Run one request against a source; the single entry both the server and in-process
    clients use. Raises :class:`SourceError` for an unknown method, one the source does not
    serve, or a bad parameter."""
    if method not in _SIGNATURES:
        raise SourceError(f"unknown request {method!r}")
    serves = capabilities_of(source)
    if method not in serves:
        raise SourceError(refusal(method, serves))
    try:
        _SIGNATURES[method].bind(None, **params)
    except TypeError as e:
        raise SourceError(f"bad parameters for {method!r}: {e}") from None
    for name, value in params.items():
        if not conforms(value, _HINTS[method][name]):
            raise SourceError(f"parameter {name!r} of {method!r} cannot be {value!r}")
    reply = getattr(source, method)(**params)
    if REPLIES[method] is Info:  # info, and goto's reply
        reply = {**reply, "capabilities": sorted(serves)}
    return reply
