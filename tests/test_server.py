"""A training serving its Source to a UI over a real ipc socket (and tcp with CURVE): every
request, the events, reconnecting, liveness, and the files a session leaves for the UI to find."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import select
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
from conftest import DEADLINE, wait_until
from fake_source import FakeSource
from test_hostile_client import RawClient

import tensordbg.transport.client
from tensordbg.sources.contract import EVERY_REQUEST
from tensordbg.transport.client import (
    Client,
    ConnectionLost,
    LocalClient,
    RemoteError,
    SessionNotFound,
)
from tensordbg.transport.codec import MessageCodec
from tensordbg.transport.connection import (
    ConnectionFileError,
    ConnectionInfo,
    find_sessions,
    read_connection_file,
    runtime_dir,
    shared_memory_dir,
    write_connection_file,
)
from tensordbg.transport.server import Server, listen_address
from tensordbg.transport.socket_loop import MAX_PENDING_REQUESTS, SocketLoop, Wakeup
from tensordbg.transport.sync_client import SyncClient
from tensordbg.transport.wire import WireArray


@pytest.fixture
def runtime(private_runtime_dir, monkeypatch) -> Path:
    # Liveness tests stay short.
    monkeypatch.setattr(tensordbg.transport.client, "PING_INTERVAL", 0.1)
    return private_runtime_dir


@pytest.fixture
def source() -> FakeSource:
    return FakeSource()


@pytest.fixture
def start_server(server_factory, runtime) -> Callable[..., Server]:
    return server_factory(run_id="run1", rank=0, script="train.py")


@pytest.fixture
def server(start_server, source) -> Server:
    return start_server(source)


@pytest.fixture
def connect(runtime) -> Iterator[Callable[..., SyncClient]]:
    clients: list[SyncClient] = []

    def open_client(conn=None, **options) -> SyncClient:
        client = SyncClient(conn, timeout=options.pop("timeout", DEADLINE), **options)
        clients.append(client)
        return client

    yield open_client
    for client in clients:
        client.close()


# --- the session's files -------------------------------------------------------------------------


def test_a_session_leaves_a_private_connection_file_next_to_its_socket(server, runtime):
    info = server.info
    assert info.path == runtime / "run1-0.json"
    assert stat.S_IMODE(os.stat(runtime).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(info.path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(runtime / "run1-0.sock").st_mode) == 0o600

    written = read_connection_file(info.path)
    assert written == info
    assert (written.run_id, written.rank, written.pid) == ("run1", 0, os.getpid())
    assert (written.transport, written.endpoint) == ("ipc", f"ipc://{runtime}/run1-0.sock")
    assert len(bytes.fromhex(written.key)) == 32
    assert written.script == "train.py" and written.host and written.started <= time.time()
    assert written.key not in repr(written)  # a logged ConnectionInfo does not give it away


def test_stop_removes_the_files_and_can_be_called_twice(server, runtime):
    server.stop()
    server.stop()
    assert list(runtime.iterdir()) == []
    assert find_sessions() == []


EXITING_WHILE_SERVING = """
import atexit, contextlib, threading, time
from fake_source import FakeSource
from tensordbg.transport.sync_client import SyncClient
from tensordbg.transport.server import Server

server = Server(FakeSource(), run_id="exiting", rank=0)
server.start()  # never stopped: the exit handler it registered does it
atexit.register(time.sleep, 0.5)  # the training's own exit handlers run first: the UI still asks
client = SyncClient(server.info.path)


def keep_asking():
    while True:
        with contextlib.suppress(Exception):
            client.call("slice", ref=5, text="[:200]")  # 800 kB replies: zero-copy frames


threading.Thread(target=keep_asking, daemon=True).start()
time.sleep(0.5)
print("exiting", flush=True)
"""


def test_a_training_that_exits_while_a_ui_asks_for_tensors_leaves_no_traceback():
    finished = subprocess.run(
        [sys.executable, "-c", EXITING_WHILE_SERVING],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent,
        timeout=DEADLINE * 2,
    )

    assert finished.returncode == 0 and finished.stdout == "exiting\n", finished.stderr
    assert "Traceback" not in finished.stderr and "internal error" not in finished.stderr, (
        finished.stderr
    )


def test_find_sessions_lists_live_ones_newest_first_and_removes_stale_ones(
    start_server, source, runtime
):
    start_server(source, run_id="older")
    newer = start_server(source, run_id="newer")
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    stale = dataclasses.replace(
        newer.info,
        run_id="gone",
        pid=int(dead.stdout),
        started=0.0,
        endpoint=f"ipc://{runtime}/gone-0.sock",
    )
    stale_file = write_connection_file(stale, runtime)

    assert [s.name for s in find_sessions()] == ["newer-0", "older-0"]
    assert not stale_file.exists()


def test_a_second_session_of_the_same_name_is_refused_and_leaves_the_first_alone(
    server, source, connect
):
    other_process = dataclasses.replace(server.info, pid=os.getppid())
    os.unlink(server.info.path)
    write_connection_file(other_process, server.info.path.parent)
    with pytest.raises(ConnectionFileError, match="already running"):
        Server(source, run_id="run1", rank=0).start()
    assert connect(server.info).call("info")["state"] == "paused"


@pytest.mark.parametrize("directory", [runtime_dir, shared_memory_dir])
def test_a_runtime_or_shared_memory_directory_others_can_enter_is_refused(tmp_path, directory):
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    with pytest.raises(ConnectionFileError, match="run `chmod 700"):
        directory(loose)


def test_a_runtime_directory_of_another_user_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "getuid", lambda: os.stat(tmp_path).st_uid + 1)
    with pytest.raises(ConnectionFileError, match="not to you"):
        runtime_dir(tmp_path)


def test_a_bad_run_id_is_refused(source):
    with pytest.raises(ValueError, match="run id"):
        Server(source, run_id="../escape", rank=0)


# --- choosing a session --------------------------------------------------------------------------


def test_connect_without_a_file_picks_the_only_session(server, connect):
    assert connect().info.name == "run1-0"


def test_connect_without_a_file_explains_when_there_is_no_session(runtime):
    with pytest.raises(SessionNotFound, match="no tensordbg session is running"):
        SyncClient()


def test_connect_without_a_file_lists_the_sessions_when_there_are_several(start_server, source):
    start_server(source, run_id="a")
    start_server(source, run_id="b")
    with pytest.raises(SessionNotFound, match="2 tensordbg sessions") as caught:
        SyncClient()
    assert "a-0" in str(caught.value) and "b-0" in str(caught.value)


# --- requests ------------------------------------------------------------------------------------


def test_hello_brings_the_whole_state(server, connect):
    welcome = connect(server.info.path).welcome
    assert welcome["info"]["state"] == "paused"
    assert [h["id"] for h in welcome["hits"]] == [0, 1]
    assert welcome["hits"][0]["module"] == "net.2"


def test_every_request_is_served(server, source, connect):
    client = connect(server.info.path)
    asked = {
        "info": {},
        "modules": {},
        "hits": {"since": 1},
        "tensors": {},
        "stats": {"ref": 3, "text": "[1]"},
        "slice": {"ref": 5, "text": "[2:4]", "window": [[0, 2], [10, 20]]},
        "find": {"ref": 3, "after": 6},
        "histogram": {"ref": 1, "bins": 8},
        "provenance": {"ref": 3},
        "rules": {},
        "set_rule": {"id": 1, "params": {"threshold": 1e-6}},
        "add_rule": {"name": "TensorRange", "match": "net.*"},
        "recheck": {},
        "control": {"action": "step", "n": 2},
        "profile": {"steps": 2},
        "profile_report": {},
        "gpu": {"since": 0.0},
    }
    assert set(asked) == EVERY_REQUEST  # all a running training serves
    got = {method: client.call(method, **params) for method, params in asked.items()}

    assert got["info"]["run_id"] == "fake0001"
    assert [m["path"] for m in got["modules"]][:3] == ["", "net", "net.0"]
    assert [h["id"] for h in got["hits"]] == [1]
    assert len(got["tensors"]) == 6
    assert got["stats"]["index"] == "[1]" and got["stats"]["summary"]["nan"] == 1
    assert (got["find"]["at"], got["find"]["wrapped"]) == ([5, 0], False)  # (fake_source.py)
    window = got["slice"]["data"]
    assert isinstance(window, WireArray) and window.shape == (2, 10)
    np.testing.assert_array_equal(window.to_numpy(), source.arrays[5][3][2:4, 10:20])
    assert len(got["histogram"]["counts"]) == 8
    assert got["provenance"]["inputs"][0]["name"] == "net.1.output"
    assert [r["name"] for r in got["rules"]["rules"]] == ["NaN", "VanishingGradient"]
    assert got["profile"] == {"pending": True, "steps": 2}
    assert got["profile_report"] is None and got["gpu"]["available"] is False
    assert got["set_rule"]["params"] == {"threshold": 1e-6}
    assert got["add_rule"]["match"] == ["net.*"]
    assert got["recheck"]["hits"][0]["rule"] == "NaN" and got["recheck"]["unjudged"] == 0
    assert got["control"] == {"state": "running", "step": 3}
    assert source.controls == [("step", 2)]


def test_a_whole_large_tensor_arrives_intact(runtime, start_server, connect):
    source = FakeSource(big=2000)
    server = start_server(source, run_id="big")
    window = connect(server.info.path).call("slice", ref=5)["data"]
    np.testing.assert_array_equal(window.to_numpy(), source.arrays[5][3])


def test_a_refused_request_raises_the_sources_message(server, connect):
    client = connect(server.info.path)
    with pytest.raises(RemoteError, match="no tensor 99 in this phase"):
        client.call("stats", ref=99)
    with pytest.raises(RemoteError, match="parameter 'ref' of 'stats' cannot be '3'"):
        client.call("stats", ref="3")
    assert client.call("info")["state"] == "paused"


class BrokenSource(FakeSource):
    def provenance(self, ref):
        raise KeyError(ref)


def test_a_bug_in_the_source_is_reported_once_and_serving_goes_on(start_server, connect, caplog):
    server = start_server(BrokenSource())
    client = connect(server.info.path)
    with caplog.at_level(logging.ERROR, logger="tensordbg.transport.server"):
        for _ in range(3):
            with pytest.raises(RemoteError, match="internal error in provenance: 3"):
                client.call("provenance", ref=3)
    assert len([r for r in caplog.records if "provenance" in r.getMessage()]) == 1
    assert client.call("tensors")[0]["name"] == "input[0]"


class UnprintableError(Exception):
    def __str__(self) -> str:
        raise RuntimeError("this error cannot be printed")


class BadlyBrokenSource(FakeSource):
    """A bug whose exception breaks even the server's report of it."""

    def provenance(self, ref):
        raise UnprintableError()


def test_a_bug_that_breaks_even_its_report_fails_the_call_at_once(start_server, connect):
    server = start_server(BadlyBrokenSource())
    client = connect(server.info.path, call_timeout=DEADLINE)
    started = time.monotonic()
    with pytest.raises(RemoteError, match="internal error in provenance"):
        client.call("provenance", ref=3)
    assert time.monotonic() - started < DEADLINE / 2
    assert client.call("tensors")[0]["name"] == "input[0]"


class SlowSource(FakeSource):
    def __init__(self):
        super().__init__()
        self.release = threading.Event()

    def modules(self):
        self.release.wait(DEADLINE)
        return super().modules()


def test_a_slow_request_does_not_stop_the_server_answering(start_server, runtime):
    source = SlowSource()
    server = start_server(source)

    async def scenario() -> None:
        async with await Client.connect(server.info.path) as client:
            slow = asyncio.ensure_future(client.call("modules"))
            started = time.monotonic()
            assert await client.call("ping") == {}
            assert time.monotonic() - started < DEADLINE / 2
            assert not slow.done()
            source.release.set()
            assert len(await slow) == 6

    try:
        asyncio.run(scenario())
    finally:
        source.release.set()


def test_a_client_flooding_the_training_is_told_it_is_busy_and_the_ui_is_still_served(
    start_server, runtime
):
    source = SlowSource()  # the first request holds the worker: the others wait in line
    server = start_server(source)
    context = zmq.Context()
    flooder = RawClient(context, server.info.endpoint, server.info.key_bytes)
    ui = RawClient(context, server.info.endpoint, server.info.key_bytes)
    try:
        for i in range(MAX_PENDING_REQUESTS + 3):
            flooder.request("modules", {}, id=i)
        for _ in range(3):
            assert "the training is busy" in flooder.refusal_text()

        ui.request("info", {}, id=1)
        source.release.set()
        reply = ui.reply()

        assert reply is not None, "the UI got no answer"
        message = ui.codec.decode(reply)
        assert message.type == "reply", message.body  # not "the training is busy"
        assert message.id == 1 and message.body["state"] == "paused"
    finally:
        source.release.set()
        for client in (flooder, ui):
            client.socket.close(linger=0)
        context.term()


# --- events --------------------------------------------------------------------------------------


def test_events_from_the_training_thread_reach_the_client(server, source, connect):
    client = connect(server.info.path)
    hit = source.hits()[0]
    training = threading.Thread(target=source.emit, args=("hit", hit))
    training.start()
    training.join()

    event, payload = next(client.events(timeout=DEADLINE))
    assert (event, payload["id"], payload["module"]) == ("hit", 0, "net.2")

    client.call("control", action="continue")
    assert next(client.events(timeout=DEADLINE)) == ("state", {"state": "running", "step": 3})


def test_status_events_are_throttled_and_the_latest_wins(server, source, connect):
    client = connect(server.info.path)
    started = time.monotonic()
    for step in range(500):
        source.emit("status", {"step": step})
    emitting = time.monotonic() - started

    received = []
    for _status, payload in client.events(timeout=DEADLINE):
        received.append(payload["step"])
        if payload["step"] == 499:
            break
    assert received[-1] == 499
    assert len(received) <= 10 * (emitting + 0.1) + 3


def test_a_status_goes_out_in_the_order_it_was_posted_among_the_events() -> None:
    """The throttled status and the other events keep the order they were posted in: a status
    that overtook a "paused" state, or came behind a later one, made the UI show a state the
    training was not in."""
    loop = SocketLoop(MessageCodec(os.urandom(32), side="server"), client_timeout=5.0,
                      on_clients=None, submit=lambda identity, message: None)  # fmt: skip
    sent: list[tuple[str, Any]] = []
    loop._broadcast = lambda router, event, payload: sent.append((event, payload["step"]))
    loop._clients[b"ui"] = time.monotonic()  # one client (with none, nothing is queued)
    loop.post_event("status", {"step": 1})
    loop.post_event("state", {"step": 1})  # paused
    loop.post_event("status", {"step": 2})  # running again: the only status kept
    loop.post_event("log", {"step": 2})
    loop._send_events(router=None)
    loop.post_event("status", {"step": 3})  # within the throttle: held...
    loop.post_event("state", {"step": 3})
    loop._send_events(router=None)  # ...but not behind the state posted after it
    loop.post_event("status", {"step": 4})
    loop._send_events(router=None, last=True)  # the server stops: its last word goes out
    assert sent == [("state", 1), ("status", 2), ("log", 2), ("status", 3), ("state", 3),
                    ("status", 4)]  # fmt: skip


def test_with_no_client_an_event_is_dropped_without_waking_the_socket_thread() -> None:
    """Each phase's events woke the socket thread though no UI was connected, and the training
    thread then waited for the GIL: ~0.5 ms a step (py-spy, benchmarks/overhead.py)."""
    loop = SocketLoop(MessageCodec(os.urandom(32), side="server"), client_timeout=5.0,
                      on_clients=None, submit=lambda identity, message: None)  # fmt: skip
    loop.post_event("status", {"step": 1})
    loop.post_event("phase_end", {"step": 1})
    assert not loop._events and not loop._latest_status and not loop.wakeup._pending
    loop._clients[b"ui"] = time.monotonic()
    loop.post_event("phase_end", {"step": 2})
    assert list(loop._events)[-1][1:] == ("phase_end", {"step": 2}) and loop.wakeup._pending


def test_emitting_never_waits_for_a_client_that_does_not_read(server, source, connect):
    connect(server.info.path)  # connected, never reads its events
    started = time.monotonic()
    for i in range(20_000):
        source.emit("log", {"message": f"line {i}", "level": "info"})
    assert time.monotonic() - started < 5.0


def test_the_async_client_streams_events(server, source):
    async def scenario() -> list:
        async with await Client.connect(server.info.path) as client:
            threading.Thread(target=source.emit, args=("log", {"message": "hi"})).start()
            async for event in client.events():
                return event
        return []

    assert asyncio.run(scenario()) == ("log", {"message": "hi"})


class WakeDuringDrain:
    """The read end of the socket thread's wake-up pair, as the socket thread sees it when another
    thread wakes it just as it starts draining the pair."""

    def __init__(self, wakeup: Wakeup):
        self.wakeup, self.reader, self.woken = wakeup, wakeup.reader, False

    def recv(self, size: int) -> bytes:
        if not self.woken:
            self.woken = True
            self.wakeup.wake()
        return self.reader.recv(size)


def test_a_wake_up_that_comes_while_the_pipe_is_drained_is_not_lost():
    wakeup = Wakeup()
    reader = wakeup.reader
    try:
        wakeup.wake()  # an event is queued: the socket thread wakes and drains the pair
        wakeup.reader = WakeDuringDrain(wakeup)  # meanwhile another event is queued
        wakeup.drain()
        wakeup.reader = reader
        wakeup.wake()  # the socket thread handled both; the next event must wake it again
        assert select.select([reader], [], [], 0)[0], "the wake-up was lost: replies would wait"
    finally:
        wakeup.reader = reader
        wakeup.close_reader()
        wakeup.close_writer()


# --- reconnecting and liveness -------------------------------------------------------------------


def test_a_reconnecting_client_gets_the_current_state(server, connect):
    first = connect(server.info.path)
    first.call("control", action="continue")
    first.close()

    second = connect(server.info.path)
    assert second.welcome["info"]["state"] == "running"
    assert len(second.welcome["hits"]) == 2


def test_on_clients_reports_clients_coming_and_vanishing(start_server, source, connect):
    counts: list[int] = []
    server = start_server(source, client_timeout=1.0, on_clients=counts.append)
    client = connect(server.info.path)
    wait_until(lambda: counts == [1])

    # The client's pings keep it alive well past the timeout...
    watch_until = time.monotonic() + 2.0
    while time.monotonic() < watch_until:
        assert counts == [1]
        time.sleep(0.05)
    assert server.clients == 1

    # ...and a client that stops (closed, crashed, unplugged) is gone after it.
    client.close()
    wait_until(lambda: counts == [1, 0])
    assert server.clients == 0


def test_the_client_knows_at_once_that_the_trainings_process_ended(
    start_server, source, runtime, monkeypatch
):
    """kill -9 of the training: the UI said RUNNING for 10-12 s (the silence it waits for)
    before it said the connection was lost. A process on this host is checked at each ping."""
    import tensordbg.transport.client as client_module

    server = start_server(source)

    async def scenario() -> None:
        client = await Client.connect(server.info.path)  # the silence it waits for: 10 s
        try:
            started = time.monotonic()
            server.stop()  # no more replies, as from a killed process...
            monkeypatch.setattr(client_module, "process_exists", lambda pid: False)  # ...gone
            with pytest.raises(ConnectionLost, match=rf"the training \(pid {os.getpid()}\) has "
                                                     "exited"):  # fmt: skip
                async for _ in client.events():
                    pass
            assert time.monotonic() - started < 5
        finally:
            await client.close()

    asyncio.run(scenario())


def test_the_client_notices_a_training_that_went_away(start_server, source, runtime):
    server = start_server(source)

    async def scenario() -> None:
        client = await Client.connect(server.info.path, server_timeout=0.5)
        try:
            server.stop()
            with pytest.raises(ConnectionLost, match="has not answered"):
                async for _ in client.events():
                    pass
            with pytest.raises(ConnectionLost):
                await client.call("info")
        finally:
            await client.close()

    asyncio.run(scenario())


def test_connecting_with_a_stale_key_says_the_replies_fail_the_checks(server):
    stale = dataclasses.replace(server.info, key="ab" * 32)
    with pytest.raises(TimeoutError, match=r"signature does not match.*connection file current"):
        SyncClient(stale, timeout=1.0)
    assert server.clients == 0


def test_a_failing_on_clients_callback_does_not_stop_the_server(start_server, source, connect):
    def on_clients(count: int) -> None:
        raise RuntimeError("the session's bug")

    server = start_server(source, on_clients=on_clients)
    assert connect(server.info.path).call("info")["state"] == "paused"


def test_connecting_to_a_dead_session_times_out_clearly(server, runtime):
    info = server.info
    server.stop()
    with pytest.raises(TimeoutError, match="is the training still running"):
        SyncClient(info, timeout=0.5)


# --- in-process client ---------------------------------------------------------------------------


def test_the_local_client_serves_a_source_with_the_same_interface(source):
    async def scenario() -> None:
        async with LocalClient(source) as client:
            assert client.welcome["info"]["state"] == "paused"
            window = await client.call("slice", ref=3, text="[1]")
            assert window["shape"] == [4] and window["data"].shape == (1, 4)
            with pytest.raises(RemoteError, match="no tensor 42"):
                await client.call("stats", ref=42)
            with pytest.raises(RemoteError, match="unknown request"):
                await client.call("subscribe")
            threading.Thread(target=source.emit, args=("hit", {"id": 2})).start()
            await client.call("control", action="pause")
            events = []
            async for event in client.events():
                events.append(event)
                if len(events) == 2:
                    break
            assert sorted(events) == [("hit", {"id": 2}), ("state", {"state": "paused", "step": 3})]

    asyncio.run(scenario())


# --- tcp -----------------------------------------------------------------------------------------


def test_remote_sessions_use_curve_and_admit_only_the_files_client_key(
    start_server, source, connect
):
    server = start_server(source, remote=True, host="127.0.0.1")
    info = server.info
    assert info.transport == "tcp" and info.endpoint.startswith("tcp://127.0.0.1:")
    assert info.server_public_key and info.client_public_key and info.client_secret_key
    assert stat.S_IMODE(os.stat(info.path).st_mode) == 0o600

    assert connect(info.path).call("info")["state"] == "paused"

    public, secret = zmq.curve_keypair()
    impostor = dataclasses.replace(
        info, client_public_key=public.decode(), client_secret_key=secret.decode()
    )
    with pytest.raises(TimeoutError):
        SyncClient(impostor, timeout=1.0)
    assert source.controls == []


def test_a_tcp_connection_file_without_curve_keys_is_refused(tmp_path):
    info = ConnectionInfo(
        run_id="r",
        rank=0,
        pid=1,
        host="h",
        script="",
        started=0.0,
        endpoint="tcp://127.0.0.1:1",
        transport="tcp",
        key="00" * 32,
    )
    path = tmp_path / "r-0.json"
    path.write_text(info.to_json())
    with pytest.raises(ConnectionFileError, match="CURVE"):
        read_connection_file(path)


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads per-thread CPU time")
def test_an_idle_server_with_a_client_uses_no_cpu(tmp_path):
    """The server shares the training's CPU: waiting for requests must cost nothing."""
    from tensordbg.transport.sync_client import SyncClient

    def cpu_seconds(thread_id: int) -> float:
        fields = Path(f"/proc/self/task/{thread_id}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    server = Server(FakeSource(), run_id="idle1", rank=0, runtime_dir=tmp_path)
    server.start()
    try:
        with SyncClient(server.info.path) as client:
            client.call("info")
            source = server.source
            source.emit("log", {"message": "wake the socket thread once"})
            thread = server._socket_thread
            before = cpu_seconds(thread.native_id)
            time.sleep(1.5)
            used = cpu_seconds(thread.native_id) - before
        assert used < 0.3, f"the idle socket thread used {used:.2f} s of CPU in 1.5 s"
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("text", "address"),
    [("0.0.0.0:5555", ("0.0.0.0", 5555)), ("node7", ("node7", 0)), ("[::1]:80", ("::1", 80)),
     ("[::1]", ("::1", 0))],
)  # fmt: skip
def test_a_listening_address_is_host_and_port(text, address):
    assert listen_address(text) == address


@pytest.mark.parametrize("text", ["", ":80", "host:port", "host:70000"])
def test_a_bad_listening_address_is_refused(text):
    with pytest.raises(ValueError, match="HOST or HOST:PORT"):
        listen_address(text)


def test_a_client_dropped_without_close_lets_go_of_its_socket_and_never_hangs_the_collector(
    server, runtime
):
    """A UI that crashes or ends its loop without closing its client leaves the client in a
    reference cycle. Collecting it must close its socket and end its context; left to pyzmq's
    finalizers in the collector's order, the context could wait for ever for a socket it no
    longer knew (a whole test run hung in an unrelated test's garbage collection)."""
    import gc
    import weakref

    dropped: list[tuple] = []

    async def drop() -> None:
        client = await Client.connect(server.info.path)
        assert await client.call("ping") == {}
        dropped.append((weakref.ref(client), client._socket, client._context))
        client._self = client  # a cycle, as the UI's tasks and callbacks make

    asyncio.run(drop())
    ref, socket, context = dropped.pop()
    collector = threading.Thread(target=gc.collect, daemon=True)
    collector.start()
    collector.join(DEADLINE)
    assert not collector.is_alive(), "collecting a dropped client hung"
    assert ref() is None and socket.closed and context.closed


LAST_WORDS_SCRIPT = """
import time, torch, tensordbg
model = torch.nn.Linear(2, 2)
session = tensordbg.attach(model)
deadline = time.monotonic() + 60
while session.server.clients == 0 and time.monotonic() < deadline:
    time.sleep(0.02)
model(torch.ones(1, 2))
"""  # then the script ends: the session's last words, and the process exits


def test_a_ui_hears_that_the_training_finished_when_its_script_ends(runtime, tmp_path):
    """The session's last word (its state "finished") is posted as the script ends, just before
    its server stops and the process exits: it reaches the UI, which says at once how the
    training ended (the server's own exit handler stopped it first, and its socket dropped what
    was queued: the UI said RUNNING, then after a silence DISCONNECTED)."""
    script = tmp_path / "train.py"
    script.write_text(LAST_WORDS_SCRIPT)
    env = {**os.environ, "TENSORDBG_RUNTIME_DIR": str(runtime), "TENSORDBG_RUN_ID": "last1"}
    training = subprocess.Popen([sys.executable, str(script)], env=env)
    try:
        wait_until(lambda: find_sessions(runtime), timeout=60)
        [conn] = find_sessions(runtime)

        async def listen() -> list[str]:
            heard: list[str] = []
            client = await Client.connect(conn.path, timeout=30)
            try:
                async with asyncio.timeout(DEADLINE):
                    async for event, payload in client.events():
                        heard.append(payload.get("state", "") if event == "state" else event)
                        if heard[-1] == "finished":
                            break
            except ConnectionLost:
                pass
            finally:
                await client.close()
            return heard

        heard = asyncio.run(listen())
        assert heard and heard[-1] == "finished", heard
    finally:
        training.wait(60)
