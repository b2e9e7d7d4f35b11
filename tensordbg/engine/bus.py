"""The session's extension bus: what happens in a watched training, for whoever listens.

The live source (the UI's server) subscribes here; so will dumps, profiling and framework
callbacks. Every event is published on the training thread, in order, with a plain-data payload
(the shapes below). A subscriber must not block; one that raises is disabled with a warning,
once, and the training goes on.

Events:

- ``phase_end``: a phase (forward, backward, optimizer) was judged: :class:`PhaseEnd`.
- ``step_end``: a training step completed: :class:`StepEnd`.
- ``hit``: a watchpoint fired: the :class:`~tensordbg.hit.Hit` as a dict.
- ``halt``: the training is about to stop on a hit (``on_hit`` "raise" or "pause"), in the middle
  of a phase perhaps: :class:`PhaseEnd` with the phase's records so far (dumps write the step
  before it stops, so the evidence survives a crash).
- ``pause`` / ``resume``: the training stopped (a hit, a request, a step) / went on: :class:`State`.
- ``detach``: the session was detached; nothing follows: :class:`State`.
- ``state``, ``status``, ``log``: the UI's own feed (every state change; :class:`Status` after each
  step; a line for the Log tab: :class:`LogLine`).
- ``profile``: a profile (:mod:`tensordbg.profiler`) started, ended, failed or was cancelled:
  ``{"state", "step", "steps", "message"}`` (its end comes from the summary's thread).

In process::

    unsubscribe = session.bus.subscribe(lambda event, payload: print(event), events={"hit"})

Installed packages extend every session through the entry-point group ``tensordbg.extensions``:
each entry point names a callable that takes the new session (and may subscribe to its bus).
They are loaded once per process; one that fails to load or raises is skipped with a warning.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Collection
from importlib.metadata import entry_points
from typing import Any, TypedDict

EVENTS = frozenset(
    {
        "phase_end",
        "step_end",
        "hit",
        "halt",
        "pause",
        "resume",
        "detach",
        "state",
        "status",
        "log",
        "profile",
    }
)
ENTRY_POINT_GROUP = "tensordbg.extensions"

Subscriber = Callable[[str, Any], None]


class PhaseEnd(TypedDict):
    step: int
    phase: str
    records: list[Any]
    """The phase's :class:`~tensordbg.engine.records.Record` objects, in execution order (their
    tensors are held only until the subscriber returns)."""


class StepEnd(TypedDict):
    step: int
    loss: float | None
    grad_norm: float | None
    steps_per_sec: float | None


class State(TypedDict, total=False):
    state: str
    step: int
    reason: str


class Status(TypedDict):
    state: str
    step: int
    phase: str
    hits_total: int
    last: StepEnd | None


class LogLine(TypedDict):
    level: str
    message: str
    step: int


class _Subscription:
    __slots__ = ("callback", "events", "failed")

    def __init__(self, callback: Subscriber, events: frozenset[str] | None):
        self.callback = callback
        self.events = events
        self.failed = False


class EventBus:
    """Publish-subscribe for one session. Subscribing is safe from any thread: the list of
    subscriptions and what each event is wanted by are replaced whole, never changed under the
    training thread that reads them."""

    def __init__(self) -> None:
        self._subscriptions: tuple[_Subscription, ...] = ()
        self._wanted: dict[str, bool] = dict.fromkeys(EVENTS, False)
        self._lock = threading.Lock()

    def subscribe(
        self, callback: Subscriber, events: Collection[str] | None = None
    ) -> Callable[[], None]:
        """Call ``callback(event, payload)`` for ``events`` (all when None); returns the call
        that unsubscribes."""
        chosen = None if events is None else frozenset(events)
        if chosen is not None and not chosen <= EVENTS:
            unknown = ", ".join(sorted(chosen - EVENTS))
            known = ", ".join(sorted(EVENTS))
            raise ValueError(f"no such event: {unknown}; the events are {known}")
        if not callable(callback):
            raise TypeError(f"a subscriber is a callable, not {type(callback).__name__}")
        subscription = _Subscription(callback, chosen)
        with self._lock:
            self._subscriptions = (*self._subscriptions, subscription)
            self._rewant()

        def unsubscribe() -> None:
            with self._lock:
                if subscription in self._subscriptions:
                    self._subscriptions = tuple(
                        s for s in self._subscriptions if s is not subscription
                    )
                    self._rewant()

        return unsubscribe

    def _rewant(self) -> None:
        """What each event is wanted by, from the subscriptions now (under the lock): a new
        dict, so that a reader on another thread sees the old one or this one whole."""
        live = [s for s in self._subscriptions if not s.failed]
        self._wanted = {
            event: any(s.events is None or event in s.events for s in live) for event in EVENTS
        }

    def wants(self, event: str) -> bool:
        """Whether anyone listens to ``event`` (so a costly payload need not be built)."""
        return self._wanted.get(event, False)

    def publish(self, event: str, payload: Any) -> None:
        if not self._wanted.get(event, False):
            return
        for subscription in self._subscriptions:
            if subscription.failed or not (
                subscription.events is None or event in subscription.events
            ):
                continue
            try:
                subscription.callback(event, payload)
            except Exception as e:  # a subscriber's fault must not stop the training
                subscription.failed = True
                with self._lock:
                    self._rewant()
                name = getattr(subscription.callback, "__qualname__", repr(subscription.callback))
                warnings.warn(
                    f"tensordbg: the subscriber {name} raised {type(e).__name__}: {e} on a "
                    f"{event!r} event and was disabled; the training goes on",
                    RuntimeWarning,
                    stacklevel=2,
                )


_extensions: list[Callable[[Any], Any]] | None = None


def extensions() -> list[Callable[[Any], Any]]:
    """The callables of the ``tensordbg.extensions`` entry points, loaded once per process."""
    global _extensions
    if _extensions is None:
        loaded = []
        for point in entry_points(group=ENTRY_POINT_GROUP):
            try:
                loaded.append(point.load())
            except Exception as e:
                warnings.warn(
                    f"tensordbg: the extension {point.name} ({point.value}) did not load: {e}",
                    RuntimeWarning,
                    stacklevel=2,
                )
        _extensions = loaded
    return _extensions


def extend(session: Any) -> None:
    """Hand a new session to every installed extension."""
    for extension in extensions():
        try:
            extension(session)
        except Exception as e:
            name = getattr(extension, "__qualname__", repr(extension))
            warnings.warn(
                f"tensordbg: the extension {name} raised {type(e).__name__}: {e}; skipped",
                RuntimeWarning,
                stacklevel=2,
            )
