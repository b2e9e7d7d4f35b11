"""The training side of the transport: a ZeroMQ ROUTER that serves a :class:`Source` to UIs.

Three kinds of thread meet here, and only one touches the socket:

- the *socket thread* owns the ROUTER: it receives and checks requests, answers ``ping`` at once,
  sends replies and events, and tracks which clients are alive;
- the *worker thread* runs Source methods one at a time (so requests keep their order, and a slow
  one never stops the socket thread answering pings), signs the reply and hands the frames back;
- the *training thread* (or any other) pushes events; they are queued without blocking and the
  socket thread is woken through a pipe.

Nothing a client sends can raise into the training process: a bad message is logged and refused.

>>> server = Server(source, run_id="run7f3a", rank=0)
>>> server.start().endpoint
'ipc:///run/user/1000/tensordbg/run7f3a-0.sock'
>>> server.stop()
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import logging
import os
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from tensordbg.sources.contract import Source, SourceError, dispatch
from tensordbg.transport.codec import (
    ERROR,
    EVENTS,
    PONG,
    REPLY,
    REQUESTS,
    Message,
    MessageCodec,
    ProtocolError,
    configure_socket,
)
from tensordbg.transport.connection import (
    ConnectionFileError,
    ConnectionInfo,
    check_run_id,
    claim_session_name,
    remove_session_files,
    runtime_dir,
    shared_memory_dir,
    write_connection_file,
)
from tensordbg.transport.shm import SharedMemory
from tensordbg.transport.wire import MAX_REQUEST_FRAMES, PROTOCOL_VERSION

log = logging.getLogger("tensordbg.transport.server")

MAX_REQUEST_BYTES = 2**20
"""ZMQ_MAXMSGSIZE of the ROUTER: a peer sending a larger frame is disconnected by libzmq."""
STATUS_INTERVAL = 0.1  # at most 10 status events a second reach a client; the latest wins
MAX_PENDING_REQUESTS = 64  # a UI has a handful in flight; more is a flood
MAX_QUEUED_EVENTS = 10_000  # events waiting for the socket thread; the oldest go first
GENERIC_REFUSAL = "request refused"
_REFUSALS_LOGGED_PER_MINUTE = 10
_ZAP_DOMAIN = "tensordbg"
_IPC_PATH_MAX = 100  # sun_path holds 104-108 bytes depending on the system
_SWEEP_INTERVAL = 5.0  # seconds between looks for shared-memory files no client took


def welcome(source: Source) -> dict[str, Any]:
    """The body of the reply to ``hello``: the whole current state, so that a (re)connecting UI is
    up to date at once.

    >>> welcome(source)["info"]["state"]
    'paused'
    """
    return {
        "protocol": PROTOCOL_VERSION,
        "info": dispatch(source, "info", {}),
        "hits": dispatch(source, "hits", {}),
    }


def listen_address(text: str) -> tuple[str, int]:
    """``"HOST[:PORT]"`` (``[::1]:5555`` for IPv6) as ``(host, port)``; port 0 picks a free one.

    >>> listen_address("0.0.0.0:5555")
    ('0.0.0.0', 5555)
    """
    host, sep, port = text.rpartition(":") if not text.endswith("]") else (text, "", "")
    if not sep:
        host, port = text, "0"
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"a listening address is HOST or HOST:PORT, not {text!r}")
    return host, int(port)


class Server:
    """Serves ``source`` to UIs on an ipc socket in the user's runtime directory (or, with
    ``remote=True``, on tcp with CURVE encryption and a single allowed client key).

    On ipc, a reply's arrays of SHM_MIN bytes and more wait for the client in files of
    ``shm_dir`` (default ``/dev/shm/tensordbg-<uid>``, else the runtime directory) instead of
    crossing the socket; see :class:`~SharedMemory`. Every array of a reply
    is copied before the reply is signed (or written to shared memory), so a training that
    resumes while the reply still waits for the socket cannot change what is sent.

    ``on_clients(count)`` is called from the socket thread whenever the number of live clients
    changes; a client silent for ``client_timeout`` seconds is gone (UIs ping every second, so
    keep it well above that).

    >>> server = Server(source, run_id="run7f3a", rank=0, on_clients=print)
    >>> info = server.start()          # returns at once; the UI finds the session on its own
    >>> server.stop()
    """

    def __init__(
        self,
        source: Source,
        *,
        run_id: str,
        rank: int,
        script: str = "",
        remote: bool = False,
        host: str = "127.0.0.1",
        port: int = 0,
        runtime_dir: str | os.PathLike[str] | None = None,
        shm_dir: str | os.PathLike[str] | None = None,
        client_timeout: float = 5.0,
        on_clients: Callable[[int], None] | None = None,
    ):
        self.source = source
        self.run_id = check_run_id(run_id)
        self.rank = int(rank)
        self.script = script
        self.remote = remote
        self.host = host
        self.port = int(port)
        if not client_timeout > 0:
            raise ValueError(
                f"client_timeout must be a positive number of seconds, not {client_timeout!r}"
            )
        self.client_timeout = float(client_timeout)
        self.on_clients = on_clients
        self.info: ConnectionInfo | None = None
        self._runtime_dir_arg = runtime_dir
        self._shm_dir_arg = shm_dir
        self.shared: SharedMemory | None = None  # ipc only; set by start()
        self._swept_at = 0.0
        self._key = secrets.token_bytes(32)
        self._codec = MessageCodec(self._key, side="server")
        self._state_lock = threading.Lock()
        self._started = False
        self._stopped = False
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._socket_thread: threading.Thread | None = None
        self._worker_thread: threading.Thread | None = None
        self._unsubscribe: Callable[[], None] | None = None
        # Hand-over from other threads to the socket thread: deques are thread-safe for
        # append/popleft, and a byte in the pipe wakes the socket thread's poll.
        self._jobs: queue.Queue[tuple[bytes, int | None, str, Any] | None] = queue.Queue()
        self._pending_jobs = 0  # touched by the socket thread only
        self._outbox: collections.deque[tuple[bytes, list[Any]]] = collections.deque()
        self._events: collections.deque[tuple[str, Any]] = collections.deque(
            maxlen=MAX_QUEUED_EVENTS
        )
        self._latest_status: collections.deque[Any] = collections.deque(maxlen=1)
        # A socket pair rather than a pipe: once closed, a late write fails cleanly instead of
        # landing in whatever file reuses the descriptor.
        self._wake_read, self._wake_write = socket.socketpair()
        self._wake_read.setblocking(False)
        self._wake_write.setblocking(False)
        self._wake_pending = False
        # Socket thread's own state.
        self._clients: dict[bytes, float] = {}  # ROUTER identity -> when last heard (monotonic)
        self._status_sent_at = 0.0
        self._logged_failures: set[tuple[str, str]] = set()
        self._refusals_logged: collections.deque[float] = collections.deque()

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self, timeout: float = 10.0) -> ConnectionInfo:
        """Bind, write the connection file and start serving; returns what the file holds.

        Raises :class:`~ConnectionFileError` or ``zmq.ZMQError`` when the
        session cannot be served (the message says why)."""
        with self._state_lock:
            if self._started:
                raise RuntimeError("this Server was already started; make a new one")
            self._started = True
        try:
            self._directory = runtime_dir(self._runtime_dir_arg)
            claim_session_name(self._directory, self.run_id, self.rank)
            if not self.remote:
                self.shared = SharedMemory(self._shared_directory())
                self.shared.remove_orphans()
        except BaseException:
            self.stop()
            raise
        self._socket_thread = threading.Thread(
            target=self._serve, name=f"tensordbg-server-{self.run_id}-{self.rank}", daemon=True
        )
        self._socket_thread.start()
        if not self._ready.wait(timeout):
            self.stop()
            raise TimeoutError(f"the tensordbg server did not start within {timeout:g} s")
        if self._start_error is not None:
            error = self._start_error
            self.stop()
            raise error
        assert self.info is not None
        self._worker_thread = threading.Thread(
            target=self._work, name=f"tensordbg-worker-{self.run_id}-{self.rank}", daemon=True
        )
        self._worker_thread.start()
        self._unsubscribe = self.source.subscribe(self._on_event)
        atexit.register(self.stop)  # a training that ends without stop() leaves no files behind
        return self.info

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving, close the sockets, remove the connection and socket files. Safe to call
        twice, and from any thread (``on_clients`` included)."""
        with self._state_lock:
            if self._stopped:
                return
            self._stopped = True
        atexit.unregister(self.stop)
        if self._unsubscribe is not None:
            try:
                self._unsubscribe()
            except Exception:
                log.exception("tensordbg: unsubscribing the server from its source failed")
        self._stopping.set()
        self._wake()
        self._jobs.put(None)
        if (
            self._socket_thread is not None
            and self._socket_thread is not threading.current_thread()
        ):
            self._socket_thread.join(timeout)
            if self._socket_thread.is_alive():
                log.warning("tensordbg: the server thread did not stop within %g s", timeout)
        if self._worker_thread is not None:
            # A Source method may be stuck (a lock the caller of stop() holds): never wait long
            # for it; the thread is a daemon and touches no socket.
            self._worker_thread.join(min(timeout, 1.0))
        if self.shared is not None:
            self.shared.close()  # the files no client took
        if self.info is not None:
            remove_session_files(self.info)
        if self._socket_thread is None:
            self._wake_read.close()  # otherwise the socket thread closes it on its way out
        self._wake_write.close()

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def clients(self) -> int:
        """How many clients are alive now."""
        return len(self._clients)

    def _shared_directory(self) -> Path:
        """Where large replies wait: the directory asked for, else /dev/shm/tensordbg-<uid>,
        else (no usable /dev/shm) the session's runtime directory."""
        if self._shm_dir_arg is not None:
            return shared_memory_dir(self._shm_dir_arg)
        try:
            return shared_memory_dir()
        except ConnectionFileError as e:
            log.warning("tensordbg: %s; large replies wait in %s instead", e, self._directory)
            return self._directory

    # --- the socket thread -------------------------------------------------------------------

    def _serve(self) -> None:
        context = zmq.Context()
        router = None
        authenticator = None
        try:
            try:
                router, authenticator = self._bind(context)
            except BaseException as e:
                self._start_error = e
                return
            finally:
                self._ready.set()
            poller = zmq.Poller()
            poller.register(router, zmq.POLLIN)
            # A plain socket comes back from poll() as its file descriptor, not as the object.
            wake = self._wake_read.fileno()
            poller.register(wake, zmq.POLLIN)
            while not self._stopping.is_set():
                try:
                    ready = dict(poller.poll(self._poll_timeout_ms()))
                    if wake in ready:
                        self._drain_wakeups()
                    if router in ready:
                        self._receive(router)
                    self._send_outbox(router)
                    self._send_events(router)
                    self._expire_clients()
                    self._sweep_shared()
                except Exception as e:
                    # A bug here must neither end the thread silently nor spin: log it once,
                    # pause a moment, and keep serving.
                    self._log_failure("the server loop", e)
                    self._stopping.wait(0.1)
        finally:
            if router is not None:
                router.close(linger=0)
            if authenticator is not None:
                authenticator.stop()
            self._wake_read.close()
            context.term()

    def _bind(self, context: zmq.Context) -> tuple[zmq.Socket, Any]:
        router = context.socket(zmq.ROUTER)
        configure_socket(router)
        router.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        authenticator = None
        curve: dict[str, str] = {}
        try:
            if self.remote:
                authenticator, curve = self._secure_with_curve(context, router)
                port = "*" if self.port == 0 else str(self.port)
                router.bind(f"tcp://{self.host}:{port}")
                bound_port = router.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
                public_host = (
                    socket.gethostname() if self.host in ("0.0.0.0", "*", "::") else self.host
                )
                endpoint, transport = f"tcp://{public_host}:{bound_port}", "tcp"
            else:
                socket_path = self._directory / f"{self.run_id}-{self.rank}.sock"
                if len(str(socket_path)) > _IPC_PATH_MAX:
                    raise OSError(
                        f"the socket path {socket_path} is longer than a Unix socket allows: set "
                        "TENSORDBG_RUNTIME_DIR to a shorter directory"
                    )
                endpoint, transport = f"ipc://{socket_path}", "ipc"
                router.bind(endpoint)
                os.chmod(socket_path, 0o600)
            info = ConnectionInfo(
                run_id=self.run_id,
                rank=self.rank,
                pid=os.getpid(),
                host=socket.gethostname(),
                script=self.script,
                started=time.time(),
                endpoint=endpoint,
                transport=transport,
                key=self._key.hex(),
                shm_dir=str(self.shared.directory) if self.shared is not None else None,
                **curve,
            )
            path = write_connection_file(info, self._directory)
        except BaseException:
            router.close(linger=0)
            if authenticator is not None:
                authenticator.stop()
            raise
        self.info = dataclasses.replace(info, path=path)
        return router, authenticator

    def _secure_with_curve(self, context: zmq.Context, router: zmq.Socket) -> tuple[Any, dict]:
        """CURVE on the ROUTER with fresh server keys, and a ZAP handler that lets in only the one
        client key written to the connection file. The handler starts before the bind: libzmq
        lets every client in while none is installed."""
        from zmq.auth.thread import ThreadAuthenticator

        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        authenticator = ThreadAuthenticator(context, log=log)
        authenticator.start()
        authenticator.configure_curve_callback(_ZAP_DOMAIN, _OnlyClientKey(client_public))
        router.curve_server = True
        router.curve_secretkey = server_secret
        router.curve_publickey = server_public
        router.zap_domain = _ZAP_DOMAIN.encode("ascii")
        return authenticator, {
            "server_public_key": server_public.decode("ascii"),
            "client_public_key": client_public.decode("ascii"),
            "client_secret_key": client_secret.decode("ascii"),
        }

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
            message = self._codec.decode(frames[1:])
        except ProtocolError as e:
            if e.authenticated:
                self._heard(identity)
            self._refuse(router, identity, e)
            return
        self._heard(identity)
        if message.type == "ping":
            self._send(router, identity, self._codec.encode(PONG, {}, id=message.id))
        elif message.type not in REQUESTS:
            self._reply_error(router, identity, message, f"unknown request type {message.type!r}")
        elif message.type != "hello" and not isinstance(message.body, dict):
            self._reply_error(router, identity, message, "request parameters must be a map")
        elif self._pending_jobs >= MAX_PENDING_REQUESTS:
            self._reply_error(
                router,
                identity,
                message,
                f"the training is busy with {self._pending_jobs} requests: try again shortly",
            )
        else:
            self._pending_jobs += 1
            self._jobs.put((identity, message.id, message.type, message.body))

    def _refuse(self, router: zmq.Socket, identity: bytes, error: ProtocolError) -> None:
        now = time.monotonic()
        while self._refusals_logged and self._refusals_logged[0] < now - 60:
            self._refusals_logged.popleft()
        if len(self._refusals_logged) < _REFUSALS_LOGGED_PER_MINUTE:
            self._refusals_logged.append(now)
            log.warning("tensordbg: refused a message from a UI client: %s", error)
        # Only a sender holding the key learns what was wrong; others learn nothing useful.
        text = str(error) if error.authenticated or error.public else GENERIC_REFUSAL
        self._send(router, identity, self._error(text, error.id))

    def _reply_error(self, router: zmq.Socket, identity: bytes, request: Message, text: str):
        self._send(router, identity, self._error(text, request.id))

    def _error(self, text: str, request_id: int | None) -> list[Any]:
        """Frames of an ERROR reply; with the request's id, so that the call fails at once."""
        return self._codec.encode(ERROR, {"message": text}, id=request_id)

    def _send(self, router: zmq.Socket, identity: bytes, frames: list[Any]) -> None:
        # A client gone or not reading loses the message; it asks again after reconnecting.
        with contextlib.suppress(zmq.ZMQError):
            router.send_multipart([identity, *frames], zmq.NOBLOCK, copy=False)

    def _send_outbox(self, router: zmq.Socket) -> None:
        while self._outbox:
            identity, frames = self._outbox.popleft()
            self._pending_jobs -= 1
            self._send(router, identity, frames)

    def _send_events(self, router: zmq.Socket) -> None:
        now = time.monotonic()
        if self._events:
            # Any pending status goes first, whatever the throttle: sent after a newer event it
            # would make the UI show an old state.
            self._flush_status(router, now)
            while self._events:
                event, payload = self._events.popleft()
                self._broadcast(router, event, payload)
        if self._latest_status and now - self._status_sent_at >= STATUS_INTERVAL:
            self._flush_status(router, now)

    def _flush_status(self, router: zmq.Socket, now: float) -> None:
        try:
            payload = self._latest_status.popleft()
        except IndexError:
            return
        self._status_sent_at = now
        self._broadcast(router, "status", payload)

    def _broadcast(self, router: zmq.Socket, event: str, payload: Any) -> None:
        if not self._clients:
            return
        try:
            frames = self._codec.encode(event, payload)
        except (TypeError, ValueError) as e:
            self._log_failure("event " + event, e)
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

    def _sweep_shared(self) -> None:
        now = time.monotonic()
        if self.shared is not None and now - self._swept_at >= _SWEEP_INTERVAL:
            self._swept_at = now
            self.shared.sweep()

    def _clients_changed(self) -> None:
        if self.on_clients is None:
            return
        try:
            self.on_clients(len(self._clients))
        except Exception:
            log.exception("tensordbg: the on_clients callback failed")

    def _drain_wakeups(self) -> None:
        try:
            while self._wake_read.recv(4096):
                pass
        except OSError:  # BlockingIOError: drained
            pass
        # Only now: a _wake() before this line is a no-op, but what it announced is in the queues
        # the loop reads next; cleared before the drain, the drain could swallow its byte and
        # leave the flag set with nothing in the pipe, making every later _wake() a no-op.
        self._wake_pending = False

    # --- other threads -----------------------------------------------------------------------

    def _wake(self) -> None:
        """Wake the socket thread; never blocks (a full pipe already means 'wake up')."""
        if self._wake_pending:
            return
        self._wake_pending = True
        # Full: a wake-up is pending anyway. Closed: the server is stopping.
        with contextlib.suppress(OSError):
            self._wake_write.send(b"\0")

    def _on_event(self, event: str, payload: dict[str, Any]) -> None:
        """The source's event callback, called from any thread: queue and return."""
        if self._stopping.is_set():
            return
        if event == "status":
            self._latest_status.append(payload)
        else:
            if event not in EVENTS:
                log.debug("tensordbg: forwarding an event of unknown kind %r", event)
            self._events.append((event, payload))
        self._wake()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            identity, request_id, method, params = job
            try:
                frames = self._answer(request_id, method, params)
            except Exception as e:  # even encoding the error failed: answer something
                self._log_failure(method, e)
                frames = self._error(f"internal error in {method}", request_id)
            self._outbox.append((identity, frames))
            self._wake()

    def _answer(self, request_id: int | None, method: str, params: Any) -> list[Any]:
        try:
            body = (
                welcome(self.source) if method == "hello" else dispatch(self.source, method, params)
            )
            # A snapshot: the arrays may be a paused training's tensors, and the next request
            # (run as soon as this returns) may resume it while these frames wait for the socket.
            return self._codec.encode(REPLY, body, id=request_id, shared=self.shared, snapshot=True)
        except SourceError as e:
            text = str(e)
        except Exception as e:
            self._log_failure(method, e)
            text = f"internal error in {method}: {e}"
        return self._error(text, request_id)

    def _log_failure(self, where: str, error: BaseException) -> None:
        """Log an unexpected failure with its traceback, once per kind, on stderr."""
        signature = (where, f"{type(error).__name__}: {error}")
        if signature in self._logged_failures:
            return
        self._logged_failures.add(signature)
        # With no logging configured, Python's last-resort handler prints this on stderr.
        log.error(
            "tensordbg: internal error in %s (the UI was told; repeats are not logged)",
            where,
            exc_info=error,
        )


class _OnlyClientKey:
    """ZAP credentials provider: admit the one client key the connection file holds."""

    def __init__(self, client_public_key: bytes):
        self._key = client_public_key

    def callback(self, domain: str, key: bytes) -> bool:
        return secrets.compare_digest(key, self._key)
