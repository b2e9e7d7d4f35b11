"""The server's socket thread: the one thread that touches the ROUTER.

It receives and checks requests, answers ``ping`` at once, hands every other request to the
server's worker, sends the worker's replies and the training's events, and tracks which clients
are alive. Other threads never touch the socket: they queue what is to be sent (without blocking)
and wake this thread through a socket pair. Nothing a client sends can raise into the training
process: a bad message is logged and refused.

>>> loop = SocketLoop(codec, client_timeout=5.0, on_clients=print, submit=jobs.put)
>>> threading.Thread(target=loop.run, args=(router, None)).start()
>>> loop.post_event("log", {"message": "hi"})        # from any thread
>>> loop.stop()
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from tensordbg.transport.codec import (
    ERROR,
    EVENTS,
    PONG,
    REQUESTS,
    Message,
    MessageCodec,
    ProtocolError,
)
from tensordbg.transport.shm import SharedMemory
from tensordbg.transport.wire import MAX_REQUEST_FRAMES, Buffer

log = logging.getLogger("tensordbg.transport.server")

STATUS_INTERVAL = 0.1  # at most 10 status events a second reach a client; the latest wins
MAX_PENDING_REQUESTS = 64
"""Requests one client may have waiting for their replies; a UI has a handful in flight, more is
a flood. Counted per client, so that one flooding the training leaves the others served."""
MAX_QUEUED_EVENTS = 10_000  # events waiting for the socket thread; the oldest go first
GENERIC_REFUSAL = "request refused"
_REFUSALS_LOGGED_PER_MINUTE = 10
_SWEEP_INTERVAL = 5.0  # seconds between looks for shared-memory files no client took


class FailureLog:
    """Logs an unexpected failure with its traceback, once per kind, on stderr; thread-safe
    enough (a repeat logged twice by two threads at once does no harm).

    >>> failures = FailureLog()
    >>> failures.log("the server loop", error)
    """

    def __init__(self) -> None:
        self._seen: set[tuple[str, str]] = set()

    def log(self, where: str, error: BaseException) -> None:
        signature = (where, f"{type(error).__name__}: {error}")
        if signature in self._seen:
            return
        self._seen.add(signature)
        # With no logging configured, Python's last-resort handler prints this on stderr.
        log.error(
            "tensordbg: internal error in %s (the UI was told; repeats are not logged)",
            where,
            exc_info=error,
        )


class Wakeup:
    """Wakes the socket thread's poll from any thread, never blocking: a byte on a socket pair
    (rather than a pipe: once closed, a late write fails cleanly instead of landing in whatever
    file reuses the descriptor).

    >>> wakeup = Wakeup()
    >>> poller.register(wakeup.fileno(), zmq.POLLIN)
    >>> wakeup.wake()                       # from any thread
    >>> wakeup.drain()                      # on the socket thread, once woken
    """

    def __init__(self) -> None:
        self.reader, self._writer = socket.socketpair()
        self.reader.setblocking(False)
        self._writer.setblocking(False)
        self._pending = False

    def fileno(self) -> int:
        return self.reader.fileno()

    def wake(self) -> None:
        if self._pending:
            return
        self._pending = True
        # Full: a wake-up is pending anyway. Closed: the server is stopping.
        with contextlib.suppress(OSError):
            self._writer.send(b"\0")

    def drain(self) -> None:
        try:
            while self.reader.recv(4096):
                pass
        except OSError:  # BlockingIOError: drained
            pass
        # Only now: a wake() before this line is a no-op, but what it announced is in the queues
        # the loop reads next; cleared before the drain, the drain could swallow its byte and
        # leave the flag set with nothing in the pipe, making every later wake() a no-op.
        self._pending = False

    def close_reader(self) -> None:
        self.reader.close()

    def close_writer(self) -> None:
        self._writer.close()


def error_reply(codec: MessageCodec, text: str, request_id: int | None) -> list[Buffer]:
    """Frames of an ERROR reply; with the request's id, so that the call fails at once."""
    return codec.encode(ERROR, {"message": text}, id=request_id)


class SocketLoop:
    """Serves one ROUTER on the thread that calls :meth:`run`, until :meth:`stop`.

    ``submit(identity, message)`` takes a checked request that is not a ``ping`` to the worker,
    whose reply comes back through :meth:`post_reply`; each client has at most
    MAX_PENDING_REQUESTS waiting, and is told the training is busy beyond that. A client silent
    for ``client_timeout`` seconds is gone; ``on_clients(count)`` is called on this thread
    whenever the number of live clients changes.
    """

    def __init__(
        self,
        codec: MessageCodec,
        *,
        client_timeout: float,
        on_clients: Callable[[int], None] | None,
        submit: Callable[[bytes, Message], None],
        failures: FailureLog | None = None,
    ):
        self.codec = codec
        self.client_timeout = client_timeout
        self.on_clients = on_clients
        self.submit = submit
        self.failures = failures or FailureLog()
        self.wakeup = Wakeup()
        self._stopping = threading.Event()
        # Hand-over from other threads: deques are thread-safe for append and popleft.
        self._outbox: collections.deque[tuple[bytes, list[Buffer]]] = collections.deque()
        # Each posted event and status is numbered: a status goes out before every event posted
        # after it and after every event posted before it, whatever the throttle.
        self._posted = itertools.count()
        self._events: collections.deque[tuple[int, str, Any]] = collections.deque(
            maxlen=MAX_QUEUED_EVENTS
        )
        self._latest_status: collections.deque[tuple[int, Any]] = collections.deque(maxlen=1)
        # This thread's own state.
        self._clients: dict[bytes, float] = {}  # ROUTER identity -> when last heard (monotonic)
        self._pending: collections.Counter[bytes] = collections.Counter()  # identity -> requests
        self._status_sent_at = 0.0
        self._swept_at = 0.0
        self._refusals_logged: collections.deque[float] = collections.deque()

    # --- from any thread ---------------------------------------------------------------------

    def post_reply(self, identity: bytes, frames: list[Buffer]) -> None:
        """Queue the reply to one of ``identity``'s requests (the worker's answer)."""
        self._outbox.append((identity, frames))
        self.wakeup.wake()

    def post_event(self, event: str, payload: Any) -> None:
        """Queue an event for every live client; only the latest ``status`` is kept. With no
        client it is dropped here, as :meth:`_broadcast` would drop it, without waking this
        thread: a wake-up a phase took the training thread ~0.5 ms a step (the socket thread
        then held the GIL), and a client that connects learns the state from ``hello``."""
        if self._stopping.is_set() or not self._clients:
            return
        if event == "status":
            self._latest_status.append((next(self._posted), payload))
        else:
            if event not in EVENTS:
                log.debug("tensordbg: forwarding an event of unknown kind %r", event)
            self._events.append((next(self._posted), event, payload))
        self.wakeup.wake()

    def stop(self) -> None:
        """Make :meth:`run` return soon; events posted from now on are dropped."""
        self._stopping.set()
        self.wakeup.wake()

    @property
    def clients(self) -> int:
        """How many clients are alive now."""
        return len(self._clients)

    # --- the socket thread -------------------------------------------------------------------

    def run(self, router: zmq.Socket, shared: SharedMemory | None) -> None:
        """Serve until stopped; ``shared`` is where replies' large arrays wait (swept of those
        no client took)."""
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        # A plain socket comes back from poll() as its file descriptor, not as the object.
        wake = self.wakeup.fileno()
        poller.register(wake, zmq.POLLIN)
        while not self._stopping.is_set():
            try:
                ready = dict(poller.poll(self._poll_timeout_ms()))
                if wake in ready:
                    self.wakeup.drain()
                if router in ready:
                    self._receive(router)
                self._send_outbox(router)
                self._send_events(router)
                self._expire_clients()
                self._sweep(shared)
            except Exception as e:
                # A bug here must neither end the thread silently nor spin: log it once,
                # pause a moment, and keep serving.
                self.failures.log("the server loop", e)
                self._stopping.wait(0.1)
        # What was posted before stop() still goes out: a session's last words (its state
        # "finished", its detach) are how a UI learns that it ended, not from a silence.
        try:
            self._send_outbox(router)
            self._send_events(router, last=True)
        except Exception as e:
            self.failures.log("the server loop", e)

    def _poll_timeout_ms(self) -> int:
        now = time.monotonic()
        deadline = now + 1.0
        if self._clients:
            deadline = min(deadline, min(self._clients.values()) + self.client_timeout)
        if self._latest_status:
            deadline = min(deadline, self._status_sent_at + STATUS_INTERVAL)
        return max(0, int((deadline - now) * 1000) + 1)

    def _receive(self, router: zmq.Socket) -> None:
        # A bounded number per turn, so replies and events are not starved by a flood.
        for _ in range(100):
            try:
                frames = self._recv_bounded(router)
            except zmq.Again:
                return
            if frames is not None:
                self._handle(router, frames)

    def _recv_bounded(self, router: zmq.Socket) -> list[zmq.Frame] | None:
        """One message (identity first), frame by frame: the frames beyond what a request may
        have are read and dropped at once, and the message is refused."""
        frames = [router.recv(zmq.NOBLOCK, copy=False)]
        dropped = 0
        while router.getsockopt(zmq.RCVMORE):
            frame = router.recv(copy=False)
            if len(frames) <= MAX_REQUEST_FRAMES:
                frames.append(frame)
            else:
                dropped += 1
        if dropped:
            total = len(frames) - 1 + dropped
            error = ProtocolError(
                f"a request has at most {MAX_REQUEST_FRAMES} frames; this one had {total}"
            )
            self._refuse(router, frames[0].bytes, error)
            return None
        return frames

    def _handle(self, router: zmq.Socket, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        try:
            message = self.codec.decode(frames[1:])
        except ProtocolError as e:
            if e.authenticated:
                self._heard(identity)
            self._refuse(router, identity, e)
            return
        self._heard(identity)
        if message.type == "ping":
            self._send(router, identity, self.codec.encode(PONG, {}, id=message.id))
        elif message.type not in REQUESTS:
            self._reply_error(router, identity, message, f"unknown request type {message.type!r}")
        elif message.type != "hello" and not isinstance(message.body, dict):
            self._reply_error(router, identity, message, "request parameters must be a map")
        elif self._pending[identity] >= MAX_PENDING_REQUESTS:
            self._reply_error(
                router,
                identity,
                message,
                f"the training is busy with {self._pending[identity]} of your requests: try "
                "again shortly",
            )
        else:
            self._pending[identity] += 1
            self.submit(identity, message)

    def _refuse(self, router: zmq.Socket, identity: bytes, error: ProtocolError) -> None:
        now = time.monotonic()
        while self._refusals_logged and self._refusals_logged[0] < now - 60:
            self._refusals_logged.popleft()
        if len(self._refusals_logged) < _REFUSALS_LOGGED_PER_MINUTE:
            self._refusals_logged.append(now)
            log.warning("tensordbg: refused a message from a UI client: %s", error)
        # Only a sender holding the key learns what was wrong; others learn nothing useful.
        text = str(error) if error.authenticated or error.public else GENERIC_REFUSAL
        self._send(router, identity, error_reply(self.codec, text, error.id))

    def _reply_error(self, router: zmq.Socket, identity: bytes, request: Message, text: str):
        self._send(router, identity, error_reply(self.codec, text, request.id))

    def _send(self, router: zmq.Socket, identity: bytes, frames: list[Any]) -> None:
        # A client gone or not reading loses the message; it asks again after reconnecting.
        with contextlib.suppress(zmq.ZMQError):
            router.send_multipart([identity, *frames], zmq.NOBLOCK, copy=False)

    def _send_outbox(self, router: zmq.Socket) -> None:
        while self._outbox:
            identity, frames = self._outbox.popleft()
            self._pending[identity] -= 1
            if self._pending[identity] <= 0:
                del self._pending[identity]  # a client gone for good leaves nothing behind
            self._send(router, identity, frames)

    def _send_events(self, router: zmq.Socket, last: bool = False) -> None:
        """Send the queued events in the order they were posted. A pending status posted
        before an event goes out before it, whatever the throttle (after it, it would make the
        UI show an older state than the event's); ``last``: the server stops, and the latest
        status is its last word on the numbers."""
        now = time.monotonic()
        while self._events:
            seq, event, payload = self._events.popleft()
            status = self._latest_status[0] if self._latest_status else None
            if status is not None and status[0] < seq:
                self._flush_status(router, now)
            self._broadcast(router, event, payload)
        if self._latest_status and (last or now - self._status_sent_at >= STATUS_INTERVAL):
            self._flush_status(router, now)

    def _flush_status(self, router: zmq.Socket, now: float) -> None:
        try:
            _, payload = self._latest_status.popleft()
        except IndexError:
            return
        self._status_sent_at = now
        self._broadcast(router, "status", payload)

    def _broadcast(self, router: zmq.Socket, event: str, payload: Any) -> None:
        if not self._clients:
            return
        try:
            frames = self.codec.encode(event, payload)
        except (TypeError, ValueError) as e:
            self.failures.log("event " + event, e)
            return
        for identity in list(self._clients):
            self._send(router, identity, frames)

    def _heard(self, identity: bytes) -> None:
        is_new = identity not in self._clients
        self._clients[identity] = time.monotonic()
        if is_new:
            self._clients_changed()

    def _expire_clients(self) -> None:
        limit = time.monotonic() - self.client_timeout
        gone = [identity for identity, heard in self._clients.items() if heard < limit]
        for identity in gone:
            del self._clients[identity]
        if gone:
            self._clients_changed()

    def _sweep(self, shared: SharedMemory | None) -> None:
        now = time.monotonic()
        if shared is not None and now - self._swept_at >= _SWEEP_INTERVAL:
            self._swept_at = now
            shared.sweep()

    def _clients_changed(self) -> None:
        if self.on_clients is None:
            return
        try:
            self.on_clients(len(self._clients))
        except Exception:
            log.exception("tensordbg: the on_clients callback failed")
