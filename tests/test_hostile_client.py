"""Clients that should not get anywhere: raw ZeroMQ DEALERs speaking the protocol badly or with
the wrong key. Each is refused or dropped, none can drive the training or read a tensor, and the
server keeps serving the legitimate UI afterwards."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import msgpack
import pytest
import zmq
from conftest import DEADLINE, wait_until
from fake_source import FakeSource

from tensordbg.transport.codec import MessageCodec
from tensordbg.transport.server import MAX_REQUEST_BYTES, Server
from tensordbg.transport.socket_loop import GENERIC_REFUSAL
from tensordbg.transport.sync_client import SyncClient
from tensordbg.transport.wire import PROTOCOL_VERSION, pack


@pytest.fixture
def source() -> FakeSource:
    return FakeSource()


@pytest.fixture
def server(server_factory, source) -> Server:
    return server_factory(run_id="target", rank=0)(source)


class RawClient:
    """A DEALER that sends whatever frames it is given and reads replies without trusting them."""

    def __init__(self, context: zmq.Context, endpoint: str, key: bytes):
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)
        self.codec = MessageCodec(key, side="client")

    def send(self, frames: list) -> None:
        self.socket.send_multipart(frames)

    def request(self, method: str, body: dict, id: int = 1) -> list:
        frames = self.codec.encode(method, body, id=id)
        self.send(frames)
        return frames

    def reply(self, timeout: float = DEADLINE) -> list[bytes] | None:
        if not self.socket.poll(int(timeout * 1000)):
            return None
        return self.socket.recv_multipart()

    def refusal_text(self) -> str:
        """The message of the next reply, read without checking its signature."""
        frames = self.reply()
        assert frames is not None, "no reply within the deadline"
        assert len(frames) == 2, "a refusal carries no array data"
        header = msgpack.unpackb(frames[1])
        assert header["type"] == "error"
        return header["body"]["message"]


@pytest.fixture
def raw_client(server) -> Iterator[Callable[..., RawClient]]:
    context = zmq.Context()
    clients: list[RawClient] = []

    def open_raw(key: bytes | None = None) -> RawClient:
        client = RawClient(context, server.info.endpoint, key or server.info.key_bytes)
        clients.append(client)
        return client

    yield open_raw
    for client in clients:
        client.socket.close(linger=0)
    context.term()


@pytest.fixture
def stranger(raw_client) -> RawClient:
    return raw_client(b"\x01" * 32)


@pytest.fixture(autouse=True)
def legitimate_client_still_works_afterwards(server, source):
    yield
    with SyncClient(server.info, timeout=DEADLINE) as client:
        assert client.call("info")["state"] == source.state


# --- without the key -----------------------------------------------------------------------------


def test_a_client_with_the_wrong_key_can_neither_pause_nor_read(stranger, source):
    stranger.request("control", {"action": "pause"}, id=1)
    assert stranger.refusal_text() == GENERIC_REFUSAL
    stranger.request("slice", {"ref": 5}, id=2)
    assert stranger.refusal_text() == GENERIC_REFUSAL
    stranger.request("hello", {}, id=3)
    assert stranger.refusal_text() == GENERIC_REFUSAL

    assert source.controls == []


def test_a_client_with_the_wrong_key_does_not_count_as_a_ui(server, stranger):
    stranger.request("ping", {}, id=1)
    stranger.refusal_text()
    assert server.clients == 0


def test_a_message_without_signature_is_refused(raw_client, source):
    client = raw_client()
    frames = client.codec.encode("control", {"action": "pause"}, id=1)
    client.send(frames[1:])
    assert client.refusal_text() == GENERIC_REFUSAL
    client.send([b"", frames[1]])
    assert client.refusal_text() == GENERIC_REFUSAL
    assert source.controls == []


def test_another_protocol_version_is_told_so_even_without_the_key(stranger):
    header = pack({"v": 99, "type": "hello", "id": 1, "ts": time.time()})
    stranger.send([stranger.codec.sign(header, []), header])
    text = stranger.refusal_text()
    assert "protocol version 99" in text and f"version {PROTOCOL_VERSION}" in text


def test_a_replayed_message_is_refused(raw_client, source):
    captured = raw_client().request("control", {"action": "step", "n": 1}, id=1)
    wait_until(lambda: source.controls)  # the legitimate request was served

    replayer = raw_client(b"\x02" * 32)  # holds no key, only the captured frames
    replayer.send(captured)
    assert replayer.refusal_text() == GENERIC_REFUSAL
    assert source.controls == [("step", 1)]


# --- malformed traffic ---------------------------------------------------------------------------


def test_an_oversized_header_is_refused(raw_client):
    client = raw_client()
    header = pack({"v": PROTOCOL_VERSION, "type": "info", "padding": "x" * 100_000})
    client.send([client.codec.sign(header, []), header])
    assert client.refusal_text() == GENERIC_REFUSAL


def test_a_frame_beyond_the_message_size_limit_gets_the_client_dropped(raw_client):
    client = raw_client()
    client.send([b"0" * 64, b"x" * (MAX_REQUEST_BYTES + 1)])
    assert client.reply(timeout=1.0) is None


def test_malformed_msgpack_is_refused_clearly_to_a_key_holder(raw_client, stranger):
    client = raw_client()
    garbage = b"\x81\xa1v\xc1\xc1"
    client.send([client.codec.sign(garbage, []), garbage])
    assert "header is not valid msgpack" in client.refusal_text()

    stranger.send([stranger.codec.sign(garbage, []), garbage])
    assert stranger.refusal_text() == GENERIC_REFUSAL


def test_too_many_frames_are_refused(raw_client):
    client = raw_client()
    frames = client.codec.encode("info", {}, id=1)
    client.send(frames + [b"x"] * 8)
    assert client.refusal_text() == GENERIC_REFUSAL  # refused before the key is checked


def test_an_unknown_request_is_refused(raw_client):
    client = raw_client()
    for method in ("subscribe", "__init__", "emit", "arrays"):
        client.request(method, {}, id=1)
        assert client.refusal_text() == f"unknown request type {method!r}"


@pytest.mark.parametrize(
    ("method", "params", "problem"),
    [
        ("stats", {"ref": "3"}, "parameter 'ref' of 'stats' cannot be '3'"),
        ("stats", {"ref": True}, "parameter 'ref' of 'stats' cannot be True"),
        ("slice", {"ref": 3, "window": [[0, "a"]]}, "parameter 'window' of 'slice'"),
        ("control", {"action": "pause", "force": True}, "bad parameters for 'control'"),
        ("set_rule", {}, "bad parameters for 'set_rule'"),
    ],
)
def test_bad_parameters_are_refused(raw_client, source, method, params, problem):
    client = raw_client()
    client.request(method, params)
    assert problem in client.refusal_text()
    assert source.controls == []


def test_parameters_that_are_not_a_map_are_refused(raw_client):
    client = raw_client()
    client.request("stats", [3])  # type: ignore[arg-type]
    assert client.refusal_text() == "request parameters must be a map"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("[__import__('os').system('true')]", "is not allowed in a slice"),
        ("[0, :, :, :, :, :]", "does not fit a tensor of shape 8x4"),
        ("[" + "0," * 300 + "]", "at most 200 are accepted"),
    ],
)
def test_a_bad_slice_text_is_refused(raw_client, text, problem):
    client = raw_client()
    client.request("slice", {"ref": 3, "text": text})
    assert problem in client.refusal_text()


def test_an_extension_type_in_a_request_is_refused(raw_client):
    client = raw_client()
    fields = {
        "v": PROTOCOL_VERSION,
        "type": "set_rule",
        "id": 9,
        "ts": time.time(),
        "nonce": "n",
        "session": "s",
        "body": {"id": 1, "params": {"t": msgpack.Timestamp(1)}},
    }
    header = msgpack.packb(fields)
    client.send([client.codec.sign(header, []), header])
    assert "Timestamp" in client.refusal_text()


def test_a_flood_is_answered_and_serving_goes_on(raw_client, stranger):
    for i in range(200):
        stranger.request("info", {}, id=i)
    refused = 0
    while stranger.reply(timeout=DEADLINE if refused == 0 else 2.0) is not None:
        refused += 1
        if refused == 200:
            break
    assert refused == 200
