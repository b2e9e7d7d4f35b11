"""What a UI can ask of a training: the :class:`Source` interface, the schema of every reply and
event on the wire, and :func:`dispatch`, the one entry requests take.

A live training serves a Source (``tensordbg.sources.live.LiveSource``) through the ZeroMQ server;
a dump will serve the same interface offline. The UI never knows which one it talks to, except
through the source's :attr:`Source.capabilities`: a recorded run cannot be driven, so it serves
no ``control``. Every method returns plain data that msgpack can carry (dicts, lists, str, int,
float, bool, None), except that tensor data comes as a WireArray (``tensordbg.transport.protocol``)
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

import functools
import inspect
import sys
import types
import typing
from collections.abc import Callable, Collection
from typing import Any, Literal, Protocol, runtime_checkable

if sys.version_info >= (3, 11):
    from typing import NotRequired, TypedDict, get_type_hints
else:  # typing's TypedDict learnt NotRequired in 3.11
    from typing_extensions import NotRequired, TypedDict, get_type_hints

TrainingState = Literal["running", "paused", "detached", "finished"]


# --- the wire schema -----------------------------------------------------------------------------


class Summary(TypedDict, total=False):
    """What is known of a tensor's statistics: every field of
    :meth:`tensordbg.statistics.Summary.as_dict` when they were computed, else the ones the rules
    asked for, and any other statistic by name (``zero_frac``...); moments are over finite
    elements. Listings add the tensor's ``shape``, ``dtype`` and the ``step`` it is from."""

    numel: int
    # Counts, but numbers in general: a partial summary carries the rules' values, floats.
    nan: float
    posinf: float
    neginf: float
    zeros: float
    min: float
    max: float
    mean: float
    std: float
    abs_mean: float
    l2: float
    shape: list[int]
    dtype: str
    step: int


class Hit(TypedDict):
    """One watchpoint that fired (:meth:`tensordbg.hit.Hit.as_dict`)."""

    id: int
    rule: str
    tensor: str
    module: str  # "" is the root model
    kind: str
    step: int
    phase: str
    origin: bool  # where the problem was produced, not passed on
    value: float
    threshold: float | None
    message: str
    ref: int
    call: int
    summary: Summary


class History(TypedDict):
    """The last few hundred completed steps, one list a column."""

    step: list[int]
    loss: list[float | None]
    grad_norm: list[float | None]
    steps_per_sec: list[float | None]


class Info(TypedDict):
    """The session at a glance."""

    run_id: str
    rank: int
    pid: int
    script: str
    model: str
    device: str
    torch: str
    live: bool  # False for a dump
    state: TrainingState
    step: int
    phase: str
    on_hit: str
    sync: str  # "eager", "batched" or "deferred"
    paused_at: Hit | None
    pause_reason: str  # why it is paused; "" while it is not
    hits_total: int
    retain_bytes: int
    history: History
    capabilities: list[str]  # the requests the source serves; filled in by dispatch()
    started: NotRequired[float]  # time.time() when the source started serving


class Module(TypedDict):
    """A module of the model tree, with its latest statistics by kind (``output``...)."""

    path: str
    type: str
    depth: int
    params: int
    hits: int  # hits on this module so far
    calls: int  # calls in the latest root forward
    stats: dict[str, Summary]


class Tensor(TypedDict):
    """A watched tensor of the current phase."""

    ref: int
    name: str
    module: str
    kind: str
    call: int
    shape: list[int]
    dtype: str
    retained: bool
    summary: Summary | None
    # Modules that returned this very tensor as their own output (a block returning its last
    # layer's output): their tensor lists show it too.
    passed_up: list[str]


class Previous(TypedDict):
    step: int
    summary: Summary


class Stats(TypedDict):
    """Statistics of a tensor or of a slice of it."""

    ref: int
    name: str
    step: int
    index: str  # the slice as parsed, "" for all
    shape: list[int]
    dtype: str
    summary: Summary
    line: str  # the one-line summary a person reads
    previous: Previous | None  # the same tensor at the last step it was seen


@runtime_checkable
class ArrayData(Protocol):
    """Tensor values on the wire: what ``tensordbg.transport.protocol.WireArray`` provides."""

    dtype: str
    shape: tuple[int, ...]

    def to_numpy(self) -> Any: ...


class Slice(TypedDict):
    """A window of the values of a slice, viewed as 2-D (rows x cols)."""

    ref: int
    index: str
    shape: list[int]  # of the slice
    rows: int
    cols: int
    window: list[list[int]]  # [[row0, row1], [col0, col1]]
    dtype: str
    data: ArrayData  # the window, 2-D


class Histogram(TypedDict):
    ref: int
    index: str
    edges: list[float]  # bins + 1
    counts: list[int]  # bins
    nan: int
    posinf: int
    neginf: int
    min: float
    max: float


class CallSite(TypedDict):
    """One call of a module."""

    module: str
    type: str
    call: int


class ProvenanceInput(TypedDict):
    ref: int | None
    name: str
    module: str
    shape: list[int]
    dtype: str
    line: str
    nonfinite: bool | None  # None: not checked


class SourceLine(TypedDict):
    """The user's line of a call, with the lines around it as ``[number, text]``."""

    file: str
    line: int
    function: str
    context: list[list[int | str]]


class Provenance(TypedDict):
    """Where a tensor came from."""

    ref: int
    name: str
    kind: str
    producer: CallSite | None
    returned_by: CallSite | None  # a submodule that returned what its parent's own code made
    inputs: list[ProvenanceInput]
    consumers: list[CallSite]
    source: SourceLine | None
    stack: list[list[str | int]]  # [file, line, function], innermost last


class Rule(TypedDict):
    """A rule of the session."""

    id: int
    name: str
    enabled: bool
    doc: str
    params: dict[str, Any]
    match: list[str]
    exclude: list[str]
    kinds: list[str]
    disabled_reason: str | None
    hits: int
    pending: NotRequired[bool]
    """True when the training runs: the edit is made at its next hook, and this is the rule as
    it will be then."""


class AvailableRule(TypedDict):
    """A rule that can be added, with its default thresholds."""

    name: str
    doc: str
    params: dict[str, Any]


class Rules(TypedDict):
    rules: list[Rule]
    available: list[AvailableRule]


class Control(TypedDict):
    state: TrainingState
    step: int


class Welcome(TypedDict):
    """The reply to the transport's ``hello``: the whole current state, for a (re)connecting UI."""

    protocol: int
    info: Info
    hits: list[Hit]


class StepNumbers(TypedDict):
    """The numbers of a completed step: a row of ``Info.history``."""

    step: int
    loss: float | None
    grad_norm: float | None
    steps_per_sec: float | None


class StatusEvent(TypedDict):
    """Pushed after every step."""

    state: TrainingState
    step: int  # the step running now
    phase: str
    hits_total: int
    last: StepNumbers | None  # the step just completed


class StateEvent(TypedDict):
    state: TrainingState
    step: int
    reason: NotRequired[str]  # why it paused, when it did


class LogEvent(TypedDict):
    level: str  # "info", "warning" or "error"
    message: str
    step: int


EVENTS: dict[str, Any] = {
    "status": StatusEvent,
    "hit": Hit,
    "state": StateEvent,
    "log": LogEvent,
}
"""The events a source pushes, and their payloads."""

EventCallback = Callable[[str, dict[str, Any]], None]
"""``callback(event, payload)`` with an event of :data:`EVENTS`; it may be called from the training
thread: it must only hand the payload over, never block."""


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

    def recheck(self) -> list[Hit]:
        """Judge the current phase again with the rules as they are now, without re-running the
        step; returns the hits found (they are also added to the session's hits)."""
        ...

    def control(self, action: str, n: int = 1) -> Control:
        """Drive the training: ``continue`` (to the next new origin hit), ``next`` (to the next
        hit of any kind), ``step`` (run ``n`` training steps, then pause), ``pause`` (as soon as
        possible), ``detach`` (remove the debugger and let the training run)."""
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
EVERY_REQUEST = frozenset(METHODS)
READ_ONLY = frozenset(METHODS) - {"set_rule", "add_rule", "recheck", "control"}
"""What a recorded run (a dump, a replay) can serve: it can be read, not driven nor re-judged."""
NEEDED = frozenset({"info", "hits"})  # the hello reply is made of them

_SIGNATURES = {m: inspect.signature(getattr(Source, m)) for m in METHODS}
_HINTS = {m: get_type_hints(getattr(Source, m)) for m in METHODS}
REPLIES: dict[str, Any] = {m: _HINTS[m].pop("return") for m in METHODS}
"""The schema of the reply to each request: ``check(reply, REPLIES["stats"])``."""

_CANNOT = {
    "control": "drive the training (continue, next, step, pause or detach)",
    "set_rule": "change a rule",
    "add_rule": "add a rule",
    "recheck": "judge a step again",
}


def capabilities_of(source: object) -> frozenset[str]:
    """The requests ``source`` serves: its ``capabilities``, or every request when it declares
    none. A declaration naming unknown requests, or lacking ``info`` or ``hits``, is a bug in the
    source: TypeError."""
    declared = getattr(source, "capabilities", None)
    if declared is None:
        return EVERY_REQUEST
    serves = frozenset(declared)
    if not NEEDED <= serves <= EVERY_REQUEST:
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
        if _checker(_HINTS[method][name])(value, False) is not None:
            raise SourceError(f"parameter {name!r} of {method!r} cannot be {value!r}")
    reply = getattr(source, method)(**params)
    if method == "info":
        reply = {**reply, "capabilities": sorted(serves)}
    return reply


# --- checking values against the schema -----------------------------------------------------------


class SchemaError(ValueError):
    """A value that does not match its schema; the message says where and how.

    >>> check({"state": "paused"}, Control, name="control")
    SchemaError: control: missing 'step'
    """


def check(value: Any, schema: Any, *, name: str = "reply", strict: bool = False) -> None:
    """Raise :class:`SchemaError` unless ``value`` matches ``schema`` (a TypedDict above, or a
    type hint made of them: ``list[Hit]``, ``Hit | None``...).

    Keys a TypedDict does not name are let through (a newer source may send more, and the UI
    ignores what it does not know) unless ``strict``, as the conformance tests ask, so that the
    schema here stays complete; a :class:`Summary` is open to any statistic either way.

    >>> check(source.stats(3), Stats)
    """
    problem = _checker(schema)(value, strict)
    if problem is not None:
        raise SchemaError(name + problem)


def conforms(value: Any, schema: Any) -> bool:
    """Whether ``value`` matches ``schema`` (as :func:`check`, without the reason)."""
    return _checker(schema)(value, False) is None


_OPEN = (Summary,)  # TypedDicts that may hold keys they do not name, even when strict

Checker = Callable[[Any, bool], "str | None"]
"""``checker(value, strict)``: None when the value matches, else where and what is wrong, as a
path under the value and a reason (``".summary.nan: expected float, got '2'"``). A reply is
checked on the UI's event loop: a schema is turned into a checker once, and a checker builds
the path only for what is wrong."""


@functools.cache
def _checker(hint: Any) -> Checker:
    if hint is Any:
        return lambda value, strict: None
    if _is_typeddict(hint):
        return _typeddict_checker(hint)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return _union_checker(hint)
    if origin is Literal:
        allowed = typing.get_args(hint)
        what = " or ".join(map(repr, allowed))
        return lambda value, strict: None if value in allowed else _expected(what, value)
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        return _list_checker(_checker(item))
    if origin is dict:
        _, item = typing.get_args(hint) or (str, Any)
        return _dict_checker(_checker(item))
    return _kind_checker(hint)


def _typeddict_checker(schema: Any) -> Checker:
    name = schema.__name__
    is_open = schema in _OPEN
    fields: dict[str, Checker] = {}
    required = []
    # Not __required_keys__: it is wrong under `from __future__ import annotations` before 3.12.
    for key, hint in get_type_hints(schema, include_extras=True).items():
        if typing.get_origin(hint) is NotRequired:
            (hint,) = typing.get_args(hint)
        elif schema.__total__:
            required.append(key)
        fields[key] = _checker(hint)

    def check_typeddict(value: Any, strict: bool) -> str | None:
        if not isinstance(value, dict):
            return _expected(f"an object ({name})", value)
        missing = [key for key in required if key not in value]
        if missing:
            return f": missing {', '.join(map(repr, missing))}"
        for key, item in value.items():
            checker = fields.get(key)
            if checker is None:
                if strict and not is_open:
                    return f": {key!r} is not in the schema of {name}"
                continue
            problem = checker(item, strict)
            if problem is not None:
                return f".{key}{problem}"
        return None

    return check_typeddict


def _union_checker(hint: Any) -> Checker:
    options = typing.get_args(hint)
    checkers = [(_checker(h), _kind_fits(h)) for h in options]
    what = " or ".join(_name(h) for h in options)

    def check_union(value: Any, strict: bool) -> str | None:
        if any(checker(value, strict) is None for checker, _ in checkers):
            return None
        # The reason of the one option of the value's kind, if any: deeper than "expected".
        for checker, fits in checkers:
            if value is not None and fits(value):
                return checker(value, strict)
        return _expected(what, value)

    return check_union


def _list_checker(item: Checker) -> Checker:
    def check_list(value: Any, strict: bool) -> str | None:
        if not isinstance(value, list):
            return _expected("a list", value)
        for i, v in enumerate(value):
            problem = item(v, strict)
            if problem is not None:
                return f"[{i}]{problem}"
        return None

    return check_list


def _dict_checker(item: Checker) -> Checker:
    def check_dict(value: Any, strict: bool) -> str | None:
        if not isinstance(value, dict):
            return _expected("an object", value)
        for key, v in value.items():
            if not isinstance(key, str):
                return f" key{_expected('str', key)}"
            problem = item(v, strict)
            if problem is not None:
                return f".{key}{problem}"
        return None

    return check_dict


def _kind_checker(hint: Any) -> Checker:
    fits = _kind_fits(hint)
    what = _name(hint)
    return lambda value, strict: None if fits(value) else _expected(what, value)


def _kind_fits(hint: Any) -> Callable[[Any], bool]:
    """Whether a value is of the plain kind ``hint`` names (a bool is no number here)."""
    origin = typing.get_origin(hint) or hint
    if hint is type(None):
        return lambda value: value is None
    if _is_typeddict(hint) or origin is dict:
        return lambda value: isinstance(value, dict)
    if origin is list:
        return lambda value: isinstance(value, list)
    if origin is Literal:
        return lambda value: isinstance(value, str)
    if hint is float:
        return lambda value: (
            type(value) is float
            or (isinstance(value, (int, float)) and not isinstance(value, bool))
        )
    if hint is int:
        return lambda value: (
            type(value) is int or (isinstance(value, int) and not isinstance(value, bool))
        )
    if isinstance(origin, type):
        return lambda value: isinstance(value, origin)
    return lambda value: False


def _is_typeddict(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, dict) and hasattr(hint, "__total__")


def _name(hint: Any) -> str:
    if hint is type(None):
        return "None"
    if _is_typeddict(hint):
        return f"an object ({hint.__name__})"
    origin = typing.get_origin(hint)
    if origin is list:
        return "a list"
    if origin is dict:
        return "an object"
    return getattr(hint, "__name__", str(hint))


def _expected(what: str, value: Any) -> str:
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return f": expected {what}, got {shown}"
