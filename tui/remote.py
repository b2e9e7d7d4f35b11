"""Where the UI's requests cross to the training: a typed client whose methods return the replies
of ``tensordbg.sources.contract``, checked against their schemas. Its failures are
:class:`RequestFailed`, with a sentence a widget shows; a reply that does not match its schema
is one too (:class:`MalformedReply`), and is reported as an error besides, so a malformed reply
never reaches a widget as a KeyError.

The app owns the client (``Client`` over ZeroMQ, or ``LocalClient`` in process) inside its
:class:`Remote`; widgets ask through it:

>>> stats = await remote_of(self).stats(ref=3, text="[1]")
>>> stats["line"]
'tensor[4] float32 n=4 x∈[-0.9, 1.2] μ=0.1 σ=0.8 NaN×1!'
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol, runtime_checkable

from textual.dom import DOMNode

from tensordbg.sources.contract import (
    EVENTS,
    EVERY_REQUEST,
    REPLIES,
    Control,
    Found,
    Gpu,
    Histogram,
    Hit,
    Info,
    Module,
    ProfilePending,
    ProfileReport,
    Provenance,
    Recheck,
    Rule,
    Rules,
    SchemaError,
    Slice,
    Stats,
    Tensor,
    Welcome,
    check,
    refusal,
)
from tensordbg.transport.client import ConnectionLost, RemoteError

OVER = frozenset({"finished", "detached"})
ENDED = "its training exited or goes on unwatched"
"""Why a session whose connection file is gone has ended, as far as the file can tell (a UI
that saw the training finish says that instead)."""
"""The app states of a training that is over (a lost connection is not: it may come back)."""


@runtime_checkable
class DebugClient(Protocol):
    """What the UI needs of a client (``tensordbg.transport.client.Client`` and ``LocalClient``)."""

    welcome: dict[str, Any]

    async def call(self, method: str, **params: Any) -> Any: ...

    def events(self) -> Any: ...

    async def close(self) -> None: ...


ClientFactory = Callable[[str | None], Awaitable[DebugClient]]
"""``await connect(path)`` opens a session: the connection file picked in the session picker, or
None to let the factory find it (the only live session, or the run it waits for). It raises
:class:`TrainingExited` when the training is known to be gone, and the app stops trying."""

ErrorReport = Callable[[BaseException, str, str], None]
"""``report(error, where, details)``: an error the UI survives (the app's ``report_error``)."""


class TrainingExited(Exception):
    """The training's process has exited: connecting again cannot succeed."""


class RequestFailed(Exception):
    """A request that got no usable reply: refused by the training (``message`` says why, for
    the person), lost with the connection (``lost`` is True), or broken by a bug (``reported``
    is True: the app has reported it already, with its details)."""

    def __init__(self, message: str, lost: bool = False, reported: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.lost = lost
        self.reported = reported


class MalformedReply(RequestFailed):
    """A reply that does not match its schema: a bug in the training's side, not the person's
    doing. It is reported (Log tab, notification, crash file) before it is raised."""

    def __init__(self, message: str) -> None:
        super().__init__(message, reported=True)


class Remote:
    """The app's typed handle on the current client. ``on_lost(reason)`` is told when the
    connection drops, ``on_refused(method, message)`` when the training refuses a request, and
    ``on_error(error, where, details)`` of anything malformed or unexpected."""

    def __init__(
        self,
        on_lost: Callable[[str], None],
        on_refused: Callable[[str, str], None],
        on_error: ErrorReport,
    ) -> None:
        self.client: DebugClient | None = None
        self.capabilities: frozenset[str] = EVERY_REQUEST
        self._on_lost = on_lost
        self._on_refused = on_refused
        self._on_error = on_error

    # --- the connection ----------------------------------------------------------------------

    def connect(self, client: DebugClient) -> Welcome:
        """Use ``client`` from now on; returns its hello reply, checked (MalformedReply if it
        does not match, and the client is not used)."""
        welcome: Welcome = self._checked("hello", {}, client.welcome)
        self.client = client
        self.capabilities = frozenset(welcome["info"]["capabilities"])
        return welcome

    def serves(self, method: str) -> bool:
        """Whether the session serves ``method`` (a recorded run serves no ``control``)."""
        return method in self.capabilities

    def refusal(self, method: str) -> str:
        """Why the session does not serve ``method``, for the person."""
        return refusal(method, self.capabilities)

    def event(self, event: str, payload: Any) -> Any:
        """A pushed event's payload, checked against its schema (SchemaError if it does not
        match); an event this UI does not know is passed on as it is."""
        schema = EVENTS.get(event)
        if schema is not None:
            check(payload, schema, name=f"the {event!r} event")
        return payload

    # --- the requests ------------------------------------------------------------------------

    async def info(self) -> Info:
        return await self._request("info")

    async def modules(self) -> list[Module]:
        return await self._request("modules")

    async def hits(self, since: int = 0) -> list[Hit]:
        return await self._request("hits", since=since)

    async def tensors(self) -> list[Tensor]:
        return await self._request("tensors")

    async def stats(self, ref: int, text: str = "") -> Stats:
        return await self._request("stats", ref=ref, text=text)

    async def slice(self, ref: int, text: str = "", window: list[list[int]] | None = None) -> Slice:
        return await self._request("slice", ref=ref, text=text, window=window)

    async def find(self, ref: int, text: str = "", after: int = -1) -> Found:
        return await self._request("find", ref=ref, text=text, after=after)

    async def histogram(self, ref: int, text: str = "", bins: int = 64) -> Histogram:
        return await self._request("histogram", ref=ref, text=text, bins=bins)

    async def provenance(self, ref: int, module: str | None = None, call: int = 0) -> Provenance:
        if module is None:  # the innermost producer
            return await self._request("provenance", ref=ref)
        return await self._request("provenance", ref=ref, module=module, call=call)

    async def rules(self) -> Rules:
        return await self._request("rules")

    async def set_rule(
        self, id: int, enabled: bool | None = None, params: dict[str, Any] | None = None
    ) -> Rule:
        return await self._request("set_rule", id=id, enabled=enabled, params=params)

    async def add_rule(
        self, name: str, match: str = "*", params: dict[str, Any] | None = None
    ) -> Rule:
        return await self._request("add_rule", name=name, match=match, params=params)

    async def recheck(self) -> Recheck:
        return await self._request("recheck")

    async def control(self, action: str, n: int = 1) -> Control:
        return await self._request("control", action=action, n=n)

    async def goto(self, step: int | None = None, move: int = 0) -> Info:
        """A recorded run: show another dumped step (``move=1`` the next)."""
        return await self._request("goto", step=step, move=move)

    async def profile(self, steps: int, record_shapes: bool = False) -> ProfilePending:
        """Profile the next ``steps`` steps (with input shapes: ``record_shapes``); ``{"pending":
        True, "steps": N}`` at once, the ``profile`` event follows it and ``profile_report()``
        has the report when it is done."""
        return await self._request("profile", steps=steps, record_shapes=record_shapes or None)

    async def profile_report(self) -> ProfileReport | None:
        """The latest finished profile report (a ProfileReport's dict), or None."""
        return await self._request("profile_report")

    async def gpu(self, since: float = 0.0) -> Gpu:
        """NVML samples newer than ``since``, the devices, and error events."""
        return await self._request("gpu", since=since)

    async def _request(self, method: str, **params: Any) -> Any:
        """One request, its reply checked against ``REPLIES[method]``; a failure not reported
        as an error already is told to ``on_refused``."""
        params = {k: v for k, v in params.items() if v is not None}  # None: the default
        try:
            reply = await self._call(method, params)
        except RequestFailed as e:
            if not e.reported:
                self._on_refused(method, e.message)
            raise
        return self._checked(method, params, reply)

    async def _call(self, method: str, params: dict[str, Any]) -> Any:
        client = self.client
        if client is None:
            raise RequestFailed("not connected to a training", lost=True)
        if not self.serves(method):
            raise RequestFailed(self.refusal(method))
        try:
            return await client.call(method, **params)
        except RemoteError as e:
            raise RequestFailed(str(e)) from None
        except ConnectionLost as e:
            if self.client is client:
                self._on_lost(str(e) or "the connection was lost")
            raise RequestFailed(f"{method}: the connection was lost", lost=True) from None
        except TimeoutError:
            raise RequestFailed(f"{method}: the training did not answer in time") from None
        except Exception as e:  # a bug in the client: shown and reported, never a traceback
            self._on_error(e, f"the {method!r} request", f"request: {method} {params!r}")
            message = f"{method} failed: {type(e).__name__}: {e}"
            raise RequestFailed(message, reported=True) from None

    def _checked(self, method: str, params: dict[str, Any], reply: Any) -> Any:
        schema = Welcome if method == "hello" else REPLIES[method]
        try:
            check(reply, schema, name=method)
        except SchemaError as e:
            details = f"request: {method} {params!r}\nreply: {_shorten(repr(reply), 4000)}"
            self._on_error(e, f"the reply to {method!r}", details)
            raise MalformedReply(
                f"the training's reply to {method!r} is malformed ({e}); the details are in "
                "the crash file"
            ) from None
        return reply


def remote_of(node: DOMNode) -> Remote:
    """The typed client of the app ``node`` is in (``TensorDbgApp.remote``)."""
    return node.app.remote  # type: ignore[attr-defined, no-any-return]


def _shorten(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[: limit - 20]}... ({len(text):,} characters)"


def step_phrase(state: str, step: int | None, phase: str = "") -> str:
    """Where the training is, by its step: ``at step 5``. A training that finished (or was
    detached) in a step's ``phase`` is given as that step and phase (``at step 3 (forward)``);
    one that ended between two steps as the step it ended after (the session's step is then
    the next one, which never began: steps 0-28 ran, and it says 29). A running training is
    known between steps only (each step's end tells the UI): the step it last ended, which is
    true while the next runs and after the last ("RUNNING at step 14" was said of a script
    that ran 14 steps and was saving)."""
    if step is None:
        return "at step ?"
    if state not in OVER and (phase or state != "running"):
        return f"at step {step}"
    if phase:
        return f"at step {step} ({phase})"
    return f"after step {step - 1}" if step > 0 else "before its first step"


def session_phrase(info: Any) -> str:
    """Which session the header names after the state: ``rank 1 · train.py · run 3f2a1c9e``
    (the rank for a job of several only). A narrow terminal cuts the header's right end, so the
    rank, which R and F9 change, comes before the script; a long run id (torchrun's default is a
    uuid) is shortened to its first 8 characters. The Run tab gives the run id whole."""
    script = str(info.get("script", "?")).replace("\\", "/").rsplit("/", 1)[-1]
    run = str(info.get("run_id", "?"))
    run = run if len(run) <= 12 else f"{run[:8]}…"
    rank = f"rank {info.get('rank')} · " if info.get("world_size", 1) > 1 else ""
    return f"{rank}{script} · run {run}"
