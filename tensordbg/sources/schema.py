"""Every reply and event between a source and a UI: TypedDicts (their fields are the protocol)."""

from __future__ import annotations

import sys
from typing import Any, Literal, Protocol, runtime_checkable

if sys.version_info >= (3, 11):
    from typing import NotRequired, TypedDict
else:  # typing's TypedDict learnt NotRequired in 3.11
    from typing_extensions import NotRequired, TypedDict

from tensordbg.sources.profile_schema import ProfileEvent

TrainingState = Literal["running", "paused", "detached", "finished", "replay"]  # replay: a dump


class Summary(TypedDict, total=False):
    """What is known of a tensor's statistics: all of :meth:`tensordbg.statistics.Summary.as_dict`
    when computed, else those the rules asked for, and any statistic by name (``zero_frac``...);
    moments are over finite elements. Listings add ``shape``, ``dtype`` and its ``step``."""

    numel: int
    nan: float  # counts, floats in general: a partial summary carries the rules' values
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
    tensor: str  # in the model tree: the tensor they are of (a module with several outputs)


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
    rank: NotRequired[int]  # the rank that found it (0 for one process; absent in old dumps)
    stored_as: NotRequired[str]  # the tensor's own name when the hit names its maker's call


class History(TypedDict):
    """The last few hundred completed steps, one list a column."""

    step: list[int]
    loss: list[float | None]
    grad_norm: list[float | None]
    steps_per_sec: list[float | None]


class Replay(TypedDict):
    """Where a replay stands: which dump, recorded when, and which of its steps is shown."""

    path: str  # the dump's directory
    recorded: str  # when the run was recorded (ISO 8601), "" when the dump does not say
    complete: bool  # False for a run that was killed or ran out of disk midway
    steps: int  # dumped steps of this rank, broken ones included
    index: int  # the position of the shown step among them, from 0
    broken: str  # why the shown step cannot be read; "" when it can
    lost: str  # why some steps are not listed (an index cut short); "" when none is lost
    stopped: bool  # incomplete as its run recorded it (not only damaged since: ``lost``)


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
    running_rule: NotRequired[RunningRule | None]  # a rule check under way on the training thread
    unwatched: NotRequired[str]  # why tensordbg stopped watching (its own fault); "" while it is
    replay: NotRequired[Replay]  # a recorded run only
    world_size: NotRequired[int]  # ranks in the job (torchrun's WORLD_SIZE); 1 for one process
    skippable: NotRequired[bool]  # as StateEvent's


class RunningRule(TypedDict):
    """The rule check the training thread is in (a hanging rule blocks the training)."""

    rule: str
    tensor: str
    seconds: float  # how long it has run


class Module(TypedDict):
    """A module of the model tree, with its latest statistics by kind (``output``...)."""

    path: str
    type: str
    depth: int
    params: int
    hits: int  # hits on this module so far
    calls: int  # calls in the latest root forward
    stats: dict[str, Summary]
    note: NotRequired[str]  # why no output: a container, paused inside it, not called, not read


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
    # Modules that returned this very tensor as their own output: their tensor lists show it.
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
    previous_why: NotRequired[str]  # why there is none; with one, which phase each column is
    values_of: NotRequired[str]  # what the values shown are, when not the hit's (a replay's)


@runtime_checkable
class ArrayData(Protocol):
    """Tensor values on the wire: what ``tensordbg.transport.wire.WireArray`` provides."""

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


class Found(TypedDict):
    """Where the next NaN or Inf of a slice lies (``find``)."""

    ref: int
    index: str
    shape: list[int]  # of the slice
    at: list[int] | None  # its index in the slice; None: the slice holds none
    flat: int | None  # its row-major position in the slice (the grid's row * cols + col)
    wrapped: bool  # none lies after ``after``: this is the first from the start


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
    made_by: NotRequired[str]  # "code": its module's own code made it; "the batch": given to it


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
    step: NotRequired[int]  # the step whose tensor it is (the UI names it: a step on, it stays)
    producer: CallSite | None
    returned_by: CallSite | None  # a submodule that returned what its parent's own code made
    inputs: list[ProvenanceInput]
    consumers: list[CallSite]
    source: SourceLine | None
    stack: list[list[str | int]]  # [file, line, function], innermost last
    # The operation inside the producer's forward that made the first NaN/Inf, when a forward
    # hit at its origin named it; ``source`` is then its line.
    operation: NotRequired[Operation]


class Operation(TypedDict):
    """An operation inside a module's forward, and the user's line that ran it."""

    op: str  # e.g. "torch.softmax", "Tensor.log"
    file: str
    line: int
    function: str
    code: str  # the line's text
    first_line: int  # where its function starts (two frames of one function are one)


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
    pending: NotRequired[bool]  # the training runs: the edit is made at its next hook


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
    skipped: NotRequired[str]  # after skip: which updates of the step it drops (a sentence)


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
    phase: NotRequired[str]  # where in the step ("" between steps: detached after step - 1)
    reason: NotRequired[str]  # why it paused, when it did; how it finished, when not by itself
    unwatched: NotRequired[str]  # as Info's: sent when tensordbg stops watching
    skippable: NotRequired[bool]  # paused where k can still drop an update of the step


class LogEvent(TypedDict):
    level: str  # "info", "warning" or "error"
    message: str
    step: int


EVENTS: dict[str, Any] = {  # the events a source pushes, and their payloads
    "status": StatusEvent,
    "hit": Hit,
    "state": StateEvent,
    "log": LogEvent,
    "profile": ProfileEvent,
}
