"""The training side of the transport: a ZeroMQ ROUTER that serves a :class:`Source` to UIs.

The server binds the socket, writes the connection file and answers requests. Three kinds of
thread meet here, and only one touches the socket:

- the *socket thread* owns the ROUTER (see :mod:`tensordbg.transport.socket_loop`): it receives
  and checks requests, answers ``ping`` at once, sends replies and events, and tracks which
  clients are alive;
- the *worker thread* (here) runs Source methods one at a time (so requests keep their order, and
  a slow one never stops the socket thread answering pings), signs the reply and hands the frames
  back;
- the *training thread* (or any other) pushes events; they are queued without blocking and the
  socket thread is woken.

>>> server = Server(source, run_id="run7f3a", rank=0)
>>> server.start().endpoint
'ipc:///run/user/1000/tensordbg/run7f3a-0.sock'
>>> server.stop()
"""

from __future__ import annotations

import atexit
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

# pyzmq's helper thread for zero-copy frames registers its exit handler when first imported; done
# here, before any server registers its own, that handler runs after every server has stopped
# (exit handlers run last registered first). Imported on the first large reply instead, it ran
# first, and a reply sent in between failed with "zmq gc socket requested during shutdown".
import zmq.utils.garbage

from tensordbg.sources.contract import Source, SourceError, dispatch
from tensordbg.transport.codec import REPLY, Message, MessageCodec, configure_socket
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
from tensordbg.transport.socket_loop import FailureLog, SocketLoop, error_reply
from tensordbg.transport.wire import PROTOCOL_VERSION

log = logging.getLogger("tensordbg.transport.server")

MAX_REQUEST_BYTES = 2**20
"""ZMQ_MAXMSGSIZE of the ROUTER: a peer sending a larger frame is disconnected by libzmq."""
_ZAP_DOMAIN = "tensordbg"
_IPC_PATH_MAX = 100  # sun_path holds 104-108 bytes depending on the system


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


# How long a stopping server's socket may still deliver the events posted before the stop.
LAST_WORDS_MS = 200


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
        self.info: ConnectionInfo | None = None
        self._runtime_dir_arg = runtime_dir
        self._shm_dir_arg = shm_dir
        self.shared: SharedMemory | None = None  # ipc only; set by start()
        self._key = secrets.token_bytes(32)
        self._codec = MessageCodec(self._key, side="server")
        self._state_lock = threading.Lock()
        self._started = False
        self._stopped = False
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._socket_thread: threading.Thread | None = None
        self._worker_thread: threading.Thread | None = None
        self._unsubscribe: Callable[[], None] | None = None
        self._failures = FailureLog()
        # Requests for the worker, in the order they came; None tells it to stop.
        self._jobs: queue.Queue[tuple[bytes, Message] | None] = queue.Queue()
        self._loop = SocketLoop(
            self._codec,
            client_timeout=self.client_timeout,
            on_clients=on_clients,
            submit=lambda identity, message: self._jobs.put((identity, message)),
            failures=self._failures,
        )

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self, timeout: float = 10.0, *, stop_at_exit: bool = True) -> ConnectionInfo:
        """Bind, write the connection file and start serving; returns what the file holds.
        ``stop_at_exit=False``: the owner stops it at exit (a session, after its last words).

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
        self._unsubscribe = self.source.subscribe(self._loop.post_event)
        if stop_at_exit:  # a training that ends without stop() leaves no files behind
            atexit.register(self.stop)
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
        self._loop.stop()
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
            self._loop.wakeup.close_reader()  # otherwise the socket thread closes it on its way out
        self._loop.wakeup.close_writer()

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def clients(self) -> int:
        """How many clients are alive now."""
        return self._loop.clients

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
            self._loop.run(router, self.shared)
        finally:
            if router is not None:
                router.close(linger=LAST_WORDS_MS)  # the last events, to clients still there
            if authenticator is not None:
                authenticator.stop()
            self._loop.wakeup.close_reader()
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

    # --- the worker thread -------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            identity, request = job
            try:
                frames = self._answer(request)
            except Exception as e:  # even encoding the error failed: answer something
                self._failures.log(request.type, e)
                frames = error_reply(self._codec, f"internal error in {request.type}", request.id)
            self._loop.post_reply(identity, frames)

    def _answer(self, request: Message) -> list[Any]:
        method = request.type
        try:
            if method == "hello":
                body = welcome(self.source)
            else:
                body = dispatch(self.source, method, request.body)
            # A snapshot: the arrays may be a paused training's tensors, and the next request
            # (run as soon as this returns) may resume it while these frames wait for the socket.
            return self._codec.encode(REPLY, body, id=request.id, shared=self.shared, snapshot=True)
        except SourceError as e:
            text = str(e)
        except Exception as e:
            self._failures.log(method, e)
            text = f"internal error in {method}: {e}"
        return error_reply(self._codec, text, request.id)


class _OnlyClientKey:
    """ZAP credentials provider: admit the one client key the connection file holds."""

    def __init__(self, client_public_key: bytes):
        self._key = client_public_key

    def callback(self, domain: str, key: bytes) -> bool:
        return secrets.compare_digest(key, self._key)
