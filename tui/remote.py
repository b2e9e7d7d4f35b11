"""Where the UI's requests cross to the training: one place that calls the client and turns its
failures into :class:`RequestFailed`, so widgets show a sentence and never a traceback.

The app owns the client (``Client`` over ZeroMQ, or ``LocalClient`` in process); widgets ask
through ``app.call(method, **params)``, which lands in :meth:`Remote.call`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol, runtime_checkable

from tensordbg.transport.client import ConnectionLost, RemoteError


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


class TrainingExited(Exception):
    """The training's process has exited: connecting again cannot succeed."""


class RequestFailed(Exception):
    """A request that got no reply: refused by the training (``message`` says why, for the
    person), or lost with the connection (``lost`` is True)."""

    def __init__(self, message: str, lost: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.lost = lost


class Remote:
    """The app's handle on the current client; ``on_lost`` is told when the connection drops."""

    def __init__(self, on_lost: Callable[[str], None]) -> None:
        self.client: DebugClient | None = None
        self._on_lost = on_lost

    async def call(self, method: str, **params: Any) -> Any:
        client = self.client
        if client is None:
            raise RequestFailed("not connected to a training", lost=True)
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
        except Exception as e:  # a source bug must not take the UI down: show it instead
            raise RequestFailed(f"{method} failed: {type(e).__name__}: {e}") from None
