"""A real training served over a real socket: the UI's view of the wire, end to end."""

from __future__ import annotations

import os
import stat
import time

import numpy as np
import pytest
import torch
from paused import PausedTraining

from tensordbg.client import RemoteError, SyncClient
from tensordbg.connection import find_sessions
from tensordbg.live import LiveSource
from tensordbg.server import Server


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


def test_when_the_ui_vanishes_while_paused_the_training_resumes_disarmed():
    with PausedTraining(server=False, steps=8) as training:
        session = training.session
        session.ui_timeout = 0.3
        server = Server(LiveSource(session), run_id=session.run_id, rank=0,
                        client_timeout=0.5, on_clients=session.on_clients)  # fmt: skip
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


def test_a_client_with_the_wrong_key_can_neither_pause_nor_read_a_real_training():
    import dataclasses

    with PausedTraining(server=True, steps=30, bad_step=-1, on_hit="record") as training:
        training.wait(lambda: bool(find_sessions()))
        [conn] = find_sessions()
        forged = dataclasses.replace(conn, key="00" * 32)
        refused = r"signature does not match"
        with pytest.raises(TimeoutError, match=refused), SyncClient(forged, timeout=2.0) as ui:
            ui.call("control", action="pause")
        with pytest.raises(TimeoutError, match=refused), SyncClient(forged, timeout=2.0) as ui:
            ui.call("slice", ref=0)
        training.finished.wait(60)
        assert training.session.controller.reason == ""  # it never paused
        assert training.session.step == 30 and training.error is None


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
