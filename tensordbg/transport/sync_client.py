"""A blocking :class:`~tensordbg.transport.client.Client`, for tests and the command line.

>>> with SyncClient("run7f3a-0.json") as client:
...     client.call("info")["state"]
'paused'
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

from tensordbg.transport.client import Client, Connection, ConnectionLost
from tensordbg.transport.connection import ConnectionInfo

T = TypeVar("T")


class SyncClient:
    """A blocking Client for tests and the command line: it runs a :class:`Client` on an event
    loop in its own thread.

    >>> with SyncClient("run7f3a-0.json") as client:
    ...     client.call("control", action="pause")
    {'state': 'paused', 'step': 3}
    """

    def __init__(self, conn: Connection = None, timeout: float = 5.0, **options: Any):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="tensordbg-sync-client", daemon=True
        )
        self._thread.start()
        self._events: queue.Queue[tuple[str, Any] | BaseException | None] = queue.Queue()
        try:
            self._client = self._run(Client.connect(conn, timeout, **options), timeout + 10)
        except BaseException:
            self._stop_loop()
            raise
        self._pump = asyncio.run_coroutine_threadsafe(self._pump_events(), self._loop)

    @property
    def welcome(self) -> dict[str, Any]:
        return self._client.welcome

    @property
    def info(self) -> ConnectionInfo:
        return self._client.info

    def call(self, method: str, /, **params: Any) -> Any:
        """As :meth:`Client.call`, blocking."""
        return self._run(self._client.call(method, **params), self._client.call_timeout + 10)

    def events(self, timeout: float | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
        """Events as they come; stops when none arrives within ``timeout`` seconds or the client
        is closed, raises ConnectionLost when the connection is lost."""
        while True:
            try:
                item = self._events.get(timeout=timeout)
            except queue.Empty:
                return
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        """Close the connection and stop the loop's thread. Safe to call twice."""
        if self._loop.is_closed():
            return
        with contextlib.suppress(Exception):
            self._run(self._client.close(), 10)
        self._stop_loop()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def _pump_events(self) -> None:
        try:
            async for item in self._client.events():
                self._events.put(item)
            self._events.put(None)
        except ConnectionLost as e:
            self._events.put(e)

    def _run(self, coroutine: Coroutine[Any, Any, T], timeout: float) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()
