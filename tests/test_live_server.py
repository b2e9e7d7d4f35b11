"""A real training served over a real socket: the UI's view of the wire, end to end."""

from __future__ import annotations

import io
import os
import socket
import stat
import sys
import threading
import time

import numpy as np
import pytest
import torch
import zmq
from conftest import wait_until
from paused import PausedTraining
from test_hostile_client import RawClient

import tensordbg
from tensordbg.sources.live import LiveSource
from tensordbg.transport.client import RemoteError
from tensordbg.transport.connection import find_sessions
from tensordbg.transport.server import Server
from tensordbg.transport.socket_loop import GENERIC_REFUSAL
from tensordbg.transport.sync_client import SyncClient


def test_a_ui_attaches_to_a_paused_training_inspects_and_continues():
    with PausedTraining(server=True) as training:
        training.wait_paused()
        [conn] = find_sessions()
        assert conn.run_id == training.session.run_id
        assert stat.S_IMODE(os.stat(conn.path).st_mode) == 0o600
        with SyncClient(conn.path) as client:
            welcome = client.welcome
            assert welcome["info"]["state"] == "paused"
            assert any(h["origin"] for h in welcome["hits"])
            ref = welcome["info"]["paused_at"]["ref"]
            reply = client.call("slice", ref=ref, text="[0]")
            expected = training.session.record(ref).tensor.detach()[0].numpy()
            np.testing.assert_array_equal(reply["data"].to_numpy()[0], expected)
            with pytest.raises(RemoteError, match="does not fit"):
                client.call("stats", ref=ref, text="[0, 0, 0]")
            client.call("control", action="continue")
            training.wait(lambda: training.session.step >= 4)
        assert training.error is None


def test_the_pause_line_says_how_to_inspect_only_when_no_ui_is_connected(capsys):
    """A pause printed "inspect it: tensordbg tui" to a person already looking at it in the UI
    (the demo's UI showed it at its end, from the training's output)."""
    with PausedTraining(server=True) as training:
        training.wait_paused()
        err = capsys.readouterr().err
        assert "tensordbg: training paused" in err and "inspect it: tensordbg tui" in err
    connected = threading.Event()
    wait = lambda step: connected.wait(30) if step == 3 else None  # noqa: E731
    with PausedTraining(server=True, before_step=wait) as training:
        training.attached.wait(30)
        with SyncClient(training.session.server.info.path):
            wait_until(lambda: training.session.server.clients == 1)
            connected.set()
            training.wait_paused()
            err = capsys.readouterr().err
    assert "tensordbg: training paused" in err
    assert "the UI connected to it shows it; continue with c there" in err
    assert "inspect it" not in err


def test_a_pause_with_no_terminal_says_that_only_a_ui_continues_it(capsys, monkeypatch):
    """``tensordbg run train.py < /dev/null`` (CI) paused on a hit and waited without a word
    beyond how to inspect it, until it was killed."""
    monkeypatch.setattr(sys, "stdin", io.StringIO())  # not a terminal
    with PausedTraining(server=True) as training:
        training.wait_paused()
        assert "no terminal: it waits until a UI connects" in capsys.readouterr().err

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stdin", Terminal())
    with PausedTraining(server=True) as training:
        training.wait_paused()
        err = capsys.readouterr().err
        assert "inspect it: tensordbg tui" in err and "no terminal" not in err


def test_when_the_ui_vanishes_while_paused_the_training_resumes_disarmed():
    with PausedTraining(server=False, steps=8) as training:
        session = training.session
        source = LiveSource(session, ui_timeout=0.3)
        server = Server(source, run_id=session.run_id, rank=0,
                        client_timeout=0.5, on_clients=source.on_clients)  # fmt: skip
        server.start()
        session.server = server
        try:
            training.wait_paused()
            client = SyncClient(server.info.path)
            assert client.welcome["info"]["state"] == "paused"
            client.close()  # the UI is gone without a word
            started = time.monotonic()
            training.finished.wait(30)
            assert training.finished.is_set() and training.error is None
            assert time.monotonic() - started < 15
            assert session.on_hit == "record"  # blocking watchpoints are disarmed
        finally:
            server.stop()


def test_a_paused_training_configured_to_wait_for_ever_outlives_its_ui_and_greets_the_next():
    with PausedTraining(server=True, ui_timeout=None) as training:
        session = training.session
        session.server.client_timeout = 0.5  # notice the vanished UI in half a second, not five
        training.wait_paused()
        with SyncClient(session.server.info.path) as client:
            assert client.welcome["info"]["state"] == "paused"
        training.wait(lambda: session.server.clients == 0)  # the server counted the UI gone
        time.sleep(1.0)
        assert session.controller.state == "paused" and not training.finished.is_set()
        assert session.on_hit == "pause"  # its watchpoints still block
        with SyncClient(session.server.info.path) as client:  # the UI comes back
            info = client.welcome["info"]
            assert info["state"] == "paused"
            assert info["paused_at"]["ref"] == session.controller.paused_at.ref
            assert info["paused_at"]["origin"] and info["paused_at"]["step"] == 3
            assert any(h["origin"] and h["step"] == 3 for h in client.welcome["hits"])
            client.call("control", action="continue")
        training.finished.wait(30)
        assert training.error is None and session.step == 6


def test_a_client_with_the_wrong_key_can_neither_pause_nor_read_a_real_training():
    import dataclasses

    at_step_15, go_on = threading.Event(), threading.Event()

    def hold_at_step_15(step: int) -> None:
        if step == 15:  # mid-run: a pause, were it accepted, would stop the next phase
            at_step_15.set()
            go_on.wait(30)

    with PausedTraining(server=True, steps=30, bad_step=-1, on_hit="record",
                        before_step=hold_at_step_15) as training:  # fmt: skip
        session = training.session
        states: list[str] = []
        session.controller.listeners.append(states.append)
        assert at_step_15.wait(30)
        [conn] = find_sessions()
        forged = dataclasses.replace(conn, key="00" * 32)
        with pytest.raises(TimeoutError, match=r"signature does not match"):
            SyncClient(forged, timeout=2.0)  # the UI's own client is refused at its hello
        ref = 0  # the training's first tensor: a stranger is not even told it is gone
        context = zmq.Context()
        stranger = RawClient(context, session.server.info.endpoint, b"\x01" * 32)
        try:
            stranger.request("control", {"action": "pause"}, id=1)
            assert stranger.refusal_text() == GENERIC_REFUSAL
            stranger.request("slice", {"ref": ref}, id=2)
            assert stranger.refusal_text() == GENERIC_REFUSAL
            assert stranger.reply(timeout=0.5) is None  # nothing else: no data, no event
        finally:
            stranger.socket.close(linger=0)
            context.term()
        assert session.server.clients == 0 and not session.controller.pause_requested
        go_on.set()
        assert training.finished.wait(60)
        assert states == [] and session.controller.reason == ""  # it never paused
        assert session.step == 30 and training.error is None


def test_a_session_listens_only_on_a_private_local_socket_by_default():
    model = torch.nn.Linear(2, 2)
    import tensordbg

    session = tensordbg.attach(model)
    try:
        info = session.server.info
        assert info.transport == "ipc" and info.endpoint.startswith("ipc://")
        directory = os.path.dirname(info.endpoint.removeprefix("ipc://"))
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    finally:
        session.detach()
    assert find_sessions() == []  # detach removes the connection file


def test_attach_listens_where_remote_says_and_says_where_and_with_which_file(capsys):
    """A UI on another machine needs the address and the connection file: nothing said
    either (a local UI finds its session by itself: nothing is said then)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    session = tensordbg.attach(torch.nn.Linear(2, 2), remote=f"127.0.0.1:{port}")
    try:
        assert session.server.info.endpoint == f"tcp://127.0.0.1:{port}"
        assert session.server.info.transport == "tcp"
        err = capsys.readouterr().err
        assert f"tensordbg: listening on tcp://127.0.0.1:{port} (CURVE-encrypted)" in err
        assert f"tensordbg tui {session.server.info.path}" in err
    finally:
        session.detach()
    local = tensordbg.attach(torch.nn.Linear(2, 2))
    local.detach()
    assert "listening" not in capsys.readouterr().err
