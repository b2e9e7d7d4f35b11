"""The UI side of the transport: talk to a training (or a dump) and receive its events.

:class:`Client` reaches a training's :class:`~Server` over ZeroMQ; it runs on an
asyncio loop (the UI drives it from an async worker). :class:`LocalClient` serves the same async
interface from a :class:`~Source` in this process (UI tests, offline replay);
:class:`tensordbg.transport.sync_client.SyncClient` wraps a Client for blocking code (tests, the
command line). This module never imports torch.

>>> client = await Client.connect()          # the only live session of this user
>>> client.welcome["info"]["state"]
'paused'
>>> window = await client.call("slice", ref=3, text="[0, :8]")
>>> window["data"].to_numpy()
array([[ 0.12, -1.3 , ...]], dtype=float32)
>>> async for event, payload in client.events():
...     print(event, payload)
>>> await client.close()
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import os
import socket
import weakref
from collections.abc import AsyncIterator
from typing import Any

import zmq
import zmq.asyncio

from tensordbg.sources.contract import Source, SourceError, dispatch
from tensordbg.transport.codec import (
    ERROR,
    PONG,
    REPLY,
    MessageCodec,
    ProtocolError,
    configure_socket,
    peek_id,
)
from tensordbg.transport.connection import (
    ConnectionInfo,
    default_runtime_dir,
    find_sessions,
    process_exists,
    read_connection_file,
    runtime_dir,
)
from tensordbg.transport.server import welcome
from tensordbg.transport.shm import SharedMemory
from tensordbg.transport.wire import roundtrip

log = logging.getLogger("tensordbg.transport.client")

PING_INTERVAL = 1.0
"""Seconds between the client's pings; the server counts a client alive while they arrive."""
SERVER_TIMEOUT = 10.0
"""Seconds without any message from the training after which the connection is lost."""
CALL_TIMEOUT = 60.0
"""Seconds a request may wait for its reply (requests run one at a time in the training)."""
MAX_BUFFERED_EVENTS = 10_000  # events not yet read by the UI; the oldest are dropped first
_VERIFY_IN_THREAD = 2**20  # messages this large are checked off the event loop (HMAC: ~1 GB/s)

Connection = str | os.PathLike[str] | ConnectionInfo | None


class RemoteError(Exception):
    """The training refused a request; the message says why, for the person to read.

    >>> raise RemoteError("no tensor 12 in this phase")
    """


class ReplyRefused(RemoteError):
    """A reply came but failed this side's checks (a signature that does not match: bytes
    changed on the way, e.g. a shared-memory file written to); the message says which check.

    >>> raise ReplyRefused("the reply to 'slice' was refused: message signature does not match")
    """


class ConnectionLost(ConnectionError):
    """The connection to the training is gone (it stopped answering, or the client was closed).

    >>> raise ConnectionLost("the training at ipc://... has not answered for 10 s")
    """


class SessionNotFound(LookupError):
    """No session, or more than one, to connect to; the message lists what there is.

    >>> raise SessionNotFound("no tensordbg session is running for this user")
    """


def resolve_session(conn: Connection = None) -> ConnectionInfo:
    """The session to connect to: a connection file's path, a ConnectionInfo, or None for the only
    live session of this user.

    >>> resolve_session().name
    'run7f3a-0'
    """
    if isinstance(conn, ConnectionInfo):
        return conn
    if conn is not None:
        return read_connection_file(conn)
    sessions = find_sessions()
    if len(sessions) == 1:
        return sessions[0]
    if not sessions:
        raise SessionNotFound(
            f"no tensordbg session is running for this user (looked in {default_runtime_dir()}): "
            "start the training with tensordbg.attach(...), or give a connection file's path"
        )
    listing = "\n".join("  " + s.describe() for s in sessions)
    raise SessionNotFound(
        f"{len(sessions)} tensordbg sessions are running; pick one by its connection file:\n"
        + listing
    )


class Client:
    """A connection to one training session over ZeroMQ (a DEALER driven by asyncio).

    Replies are matched to requests by id, so several requests may be in flight; events are
    buffered until read. A ping goes out every PING_INTERVAL; when nothing has come back for
    ``server_timeout`` seconds the connection is lost: pending calls and ``events()`` raise
    :class:`ConnectionLost`, and the UI reconnects with a new Client (the ``hello`` reply brings
    the whole state back).

    >>> async with await Client.connect("run7f3a-0.json") as client:
    ...     await client.call("control", action="continue")
    {'state': 'running', 'step': 3}
    """

    def __init__(
        self,
        info: ConnectionInfo,
        *,
        call_timeout: float = CALL_TIMEOUT,
        server_timeout: float = SERVER_TIMEOUT,
    ):
        """Use :meth:`connect`, which also greets the training and starts the background tasks."""
        self.info = info
        self.call_timeout = call_timeout
        self.server_timeout = server_timeout
        # A training on this host whose process this user can see: its end (killed, crashed)
        # is known at the next ping, not after server_timeout of silence.
        self._watch_pid = info.host == socket.gethostname() and process_exists(info.pid)
        self.welcome: dict[str, Any] = {}
        shared = None
        if info.transport == "ipc" and info.shm_dir:
            # The training's large replies wait there; it must be as private as the session's
            # own directory (ConnectionFileError says what is wrong).
            shared = SharedMemory(runtime_dir(info.shm_dir, create=False))
        self._codec = MessageCodec(info.key_bytes, side="client", shared=shared)
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._methods: dict[int, str] = {}  # request id -> method, to say which reply failed
        self._events = _EventBuffer()
        self._lost: ConnectionLost | None = None
        self._last_refusal = ""  # why the latest unreadable message was refused
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.DEALER)
        configure_socket(self._socket)
        if info.transport == "tcp":
            assert info.server_public_key and info.client_public_key and info.client_secret_key
            self._socket.curve_serverkey = info.server_public_key.encode("ascii")
            self._socket.curve_publickey = info.client_public_key.encode("ascii")
            self._socket.curve_secretkey = info.client_secret_key.encode("ascii")
        self._socket.connect(info.endpoint)
        # A client dropped without close() (its app crashed, its loop ended) still lets go of its
        # socket, then its context, in that order. Left to the garbage collector, the context
        # can be finalized first, after the socket's entry in its registry is gone, and then
        # waits for that socket for ever (pyzmq's Context.__del__ calls term()).
        self._let_go = weakref.finalize(self, _let_go, self._socket, self._context)
        # Not at interpreter exit: a daemon thread's loop may still be sending on that socket,
        # and each send it had under way would end in a logged "Future exception" traceback.
        self._let_go.atexit = False
        self._loop = asyncio.get_running_loop()
        self._last_heard = self._loop.time()
        self._tasks: list[asyncio.Task[None]] = [asyncio.create_task(self._read())]

    @classmethod
    async def connect(
        cls,
        conn: Connection = None,
        timeout: float = 5.0,
        *,
        call_timeout: float = CALL_TIMEOUT,
        server_timeout: float = SERVER_TIMEOUT,
    ) -> Client:
        """Connect and greet the training; ``welcome`` then holds its state (``info``, ``hits``).

        Raises :class:`SessionNotFound`, :class:`~ConnectionFileError`, or
        TimeoutError when the training does not answer within ``timeout`` seconds."""
        info = resolve_session(conn)
        client = cls(info, call_timeout=call_timeout, server_timeout=server_timeout)
        try:
            client.welcome = await client._request("hello", {}, timeout)
        except TimeoutError:
            await client.close()
            why = (
                f"its replies fail our checks ({client._last_refusal}): is the connection file "
                "current?"
                if client._last_refusal
                else "is the training still running?"
            )
            raise TimeoutError(
                f"session {info.name} at {info.endpoint} did not answer within {timeout:g} s: {why}"
            ) from None
        except BaseException:
            await client.close()
            raise
        client._tasks.append(asyncio.create_task(client._ping()))
        return client

    async def call(self, method: str, /, **params: Any) -> Any:
        """Run one request in the training and return its result (WireArrays restored).

        Raises :class:`RemoteError` when the training refuses it (:class:`ReplyRefused` when
        its reply fails this side's checks), :class:`ConnectionLost` or TimeoutError otherwise.

        >>> (await client.call("stats", ref=3, text="[1]"))["line"]
        'tensor[4] f32 n=4 x∈[-0.9, 1.2] μ=0.1 σ=0.8 NaN!'
        """
        return await self._request(method, params, self.call_timeout)

    def events(self) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """``(event, payload)`` pushed by the training (``status``, ``hit``, ``state``, ``log``),
        in order; ends when the client is closed, raises ConnectionLost when the connection is.
        Meant for one reader."""
        return self._events.stream()

    @property
    def connected(self) -> bool:
        """False once the connection is lost or closed (make a new Client to reconnect)."""
        return self._lost is None

    async def close(self) -> None:
        """Stop the background tasks and close the socket. Safe to call twice."""
        if self._socket.closed:
            return
        self._set_lost(ConnectionLost("the client was closed"), end_events=True)
        current = asyncio.current_task()
        tasks = [t for t in self._tasks if t is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._let_go()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- internals ---------------------------------------------------------------------------

    async def _request(self, method: str, params: dict[str, Any], timeout: float) -> Any:
        if self._lost is not None:
            raise self._lost
        request_id = next(self._ids)
        reply = self._loop.create_future()
        self._pending[request_id] = reply
        self._methods[request_id] = method
        try:
            await self._socket.send_multipart(
                self._codec.encode(method, params, id=request_id), copy=False
            )
            return await asyncio.wait_for(reply, timeout)
        except (asyncio.TimeoutError, TimeoutError):  # distinct classes before Python 3.11
            raise TimeoutError(f"no reply to {method!r} within {timeout:g} s") from None
        finally:
            self._pending.pop(request_id, None)
            self._methods.pop(request_id, None)

    async def _read(self) -> None:
        while True:
            try:
                frames = await self._socket.recv_multipart(copy=False)
            except zmq.ZMQError as e:
                self._set_lost(ConnectionLost(f"the connection failed: {e}"))
                return
            try:
                if self._codec.incoming_bytes(frames) > _VERIFY_IN_THREAD:
                    message = await asyncio.to_thread(self._codec.decode, frames)
                else:
                    message = self._codec.decode(frames)
            except ProtocolError as e:
                self._refused(e, frames)
                continue
            self._last_heard = self._loop.time()
            if message.type in (REPLY, PONG, ERROR):
                self._resolve(message.type, message.id, message.body)
            else:
                self._events.put(message.type, message.body)
            # The caller holds the arrays now: a large one is freed when the caller drops it,
            # not whenever the next message arrives here.
            del message, frames

    def _refused(self, error: ProtocolError, frames: list[zmq.Frame]) -> None:
        """Drop a message that failed the checks; a call waiting for it fails at once, saying
        why, rather than at its timeout. Only the training can write to this socket (ipc in a
        private directory, or CURVE), so the id the message claims is worth believing for that;
        the message itself is not."""
        self._last_refusal = str(error)
        log.warning("tensordbg: dropped a message from the training: %s", error)
        request_id = error.id
        if request_id is None and len(frames) >= 2:
            request_id = peek_id(frames[1])
        reply = self._pending.get(request_id) if request_id is not None else None
        if reply is not None and not reply.done():
            method = self._methods.get(request_id, "a request")
            reply.set_exception(ReplyRefused(f"the reply to {method!r} was refused: {error}"))

    def _resolve(self, kind: str, request_id: int | None, body: Any) -> None:
        reply = self._pending.get(request_id) if request_id is not None else None
        if kind == ERROR:
            text = body.get("message") if isinstance(body, dict) else None
            text = str(text or "the training refused the request")
            if reply is None:
                log.warning("tensordbg: the training reports: %s", text)
            elif not reply.done():
                reply.set_exception(RemoteError(text))
        elif reply is not None and not reply.done():
            reply.set_result(body)
        # A reply nobody waits for any more (its call timed out) is dropped.

    async def _ping(self) -> None:
        while True:
            await asyncio.sleep(PING_INTERVAL)
            silent = self._loop.time() - self._last_heard
            if self._watch_pid and silent > PING_INTERVAL and not process_exists(self.info.pid):
                self._set_lost(ConnectionLost(f"the training (pid {self.info.pid}) has exited"))
                return
            if silent > self.server_timeout:
                self._set_lost(
                    ConnectionLost(
                        f"the training at {self.info.endpoint} has not answered for "
                        f"{silent:.0f} s: it may have stopped, or be stuck"
                    )
                )
                return
            with contextlib.suppress(zmq.ZMQError):
                await self._socket.send_multipart(self._codec.encode("ping", {}, id=None))

    def _set_lost(self, error: ConnectionLost, *, end_events: bool = False) -> None:
        if self._lost is None:
            self._lost = error
        for reply in self._pending.values():
            if not reply.done():
                reply.set_exception(error)
        self._events.close(None if end_events else error)


class LocalClient:
    """The Client interface over a Source in this process: no socket, same results (bodies go
    through the same msgpack round trip as on the wire). Source methods run in a thread.

    >>> client = LocalClient(ReplaySource("dump/"))
    >>> await client.call("info")
    {'run_id': 'run7f3a', ...}
    """

    def __init__(self, source: Source):
        self.source = source
        self._events = _EventBuffer()
        self._unsubscribe = source.subscribe(self._events.put)
        self._closed = False
        self.welcome: dict[str, Any] = roundtrip(welcome(source))

    async def call(self, method: str, /, **params: Any) -> Any:
        """Run one request; raises :class:`RemoteError` as the Client does."""
        if self._closed:
            raise ConnectionLost("the client was closed")
        if method == "ping":
            return {}
        try:
            return await asyncio.to_thread(self._run, method, params)
        except SourceError as e:
            raise RemoteError(str(e)) from None
        except Exception as e:
            raise RemoteError(f"internal error in {method}: {e}") from e

    def _run(self, method: str, params: dict[str, Any]) -> Any:
        if method == "hello":
            return roundtrip(welcome(self.source))
        return roundtrip(dispatch(self.source, method, params))

    def events(self) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """Events pushed by the source, as :meth:`Client.events`."""
        return self._events.stream()

    @property
    def connected(self) -> bool:
        """False once closed."""
        return not self._closed

    async def close(self) -> None:
        """Unsubscribe from the source; ``events()`` ends. Safe to call twice."""
        if not self._closed:
            self._closed = True
            self._unsubscribe()
            self._events.close(None)

    async def __aenter__(self) -> LocalClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class _EventBuffer:
    """Events handed over from any thread to one asyncio reader, without blocking the producer.
    Bounded: when the reader falls far behind, the oldest events are dropped."""

    def __init__(self, maxlen: int = MAX_BUFFERED_EVENTS):
        self._items: collections.deque[tuple[str, Any]] = collections.deque(maxlen=maxlen)
        self._ready: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._error: BaseException | None = None

    def put(self, event: str, payload: Any) -> None:
        """Called from any thread (the source's callback)."""
        self._items.append((event, payload))
        self._notify()

    def close(self, error: BaseException | None) -> None:
        if not self._closed:
            self._closed, self._error = True, error
            self._notify()

    def _notify(self) -> None:
        loop, ready = self._loop, self._ready
        if loop is not None and ready is not None:
            with contextlib.suppress(RuntimeError):  # the reader's loop is closed
                loop.call_soon_threadsafe(ready.set)

    async def stream(self) -> AsyncIterator[tuple[str, Any]]:
        self._ready = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        while True:
            while self._items:
                yield self._items.popleft()
            if self._closed:
                if self._error is not None:
                    raise self._error
                return
            self._ready.clear()
            if not self._items and not self._closed:
                await self._ready.wait()


def _let_go(socket: zmq.Socket[Any], context: zmq.Context[Any]) -> None:
    socket.close(linger=0)
    context.term()
