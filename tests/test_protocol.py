"""The wire format: what a message looks like, what makes one trustworthy, what gets refused."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
import time

import ml_dtypes
import msgpack
import numpy as np
import pytest
import torch
import zmq

import tensordbg.transport.client
import tensordbg.transport.codec
import tensordbg.transport.connection
import tensordbg.transport.server
import tensordbg.transport.shm
import tensordbg.transport.socket_loop
import tensordbg.transport.sync_client
import tensordbg.transport.wire
from tensordbg.transport.codec import (
    ZERO_COPY_MIN,
    MessageCodec,
    ProtocolError,
    ReplayGuard,
    configure_socket,
)
from tensordbg.transport.wire import (
    DTYPES,
    MAX_REQUEST_FRAMES,
    MAX_REQUEST_HEADER,
    PROTOCOL_VERSION,
    WireArray,
    pack,
    roundtrip,
)

KEY = bytes(range(32))


@pytest.fixture
def server_codec() -> MessageCodec:
    return MessageCodec(KEY, side="server")


@pytest.fixture
def client_codec() -> MessageCodec:
    return MessageCodec(KEY, side="client")


def signed(codec: MessageCodec, header: dict, arrays: list[bytes] = ()) -> list[bytes]:
    """Frames a key holder could send with any header at all, for the malformed cases."""
    fields = {"v": PROTOCOL_VERSION, "ts": time.time(), "nonce": "n1", "session": "s1"}
    raw = pack({**fields, **header})
    return [codec.sign(raw, list(arrays), sender=codec.peer), raw, *arrays]


def signed_raw(codec: MessageCodec, raw: bytes) -> list[bytes]:
    return [codec.sign(raw, [], sender=codec.peer), raw]


def refusal(codec: MessageCodec, frames: list) -> ProtocolError:
    with pytest.raises(ProtocolError) as caught:
        codec.decode(frames)
    return caught.value


# --- framing -------------------------------------------------------------------------------------


def test_a_request_round_trips_as_signature_header_and_nothing_else(server_codec, client_codec):
    frames = client_codec.encode("slice", {"ref": 3, "text": "[0, :8]"}, id=7)

    assert len(frames) == 2
    message = server_codec.decode(frames)
    assert (message.type, message.id, message.body) == ("slice", 7, {"ref": 3, "text": "[0, :8]"})
    assert message.session == client_codec.session
    header = msgpack.unpackb(frames[1])
    assert set(header) == {"v", "type", "id", "ts", "nonce", "session", "body"}


def test_arrays_travel_as_raw_frames_in_their_own_dtype(server_codec, client_codec):
    bf16 = np.array([[0x3F80, 0xC000], [0x7FC0, 0x0000]], dtype=np.uint16)  # 1, -2, NaN, 0
    fp8 = np.array([0x38, 0xB8, 0x7F], dtype=np.uint8)  # e4m3fn: 1, -1, NaN
    f32 = np.arange(6, dtype=np.float32).reshape(2, 3)
    body = {
        "ref": 3,
        "bf16": WireArray("bfloat16", (2, 2), bf16),
        "fp8": WireArray("float8_e4m3fn", (3,), fp8),
        "f32": WireArray("float32", (2, 3), f32),
    }

    frames = server_codec.encode("reply", body, id=1)
    assert len(frames) == 2 + 3
    descriptor = msgpack.unpackb(frames[1])["body"]["bf16"]
    assert descriptor == {"__array__": 0, "dtype": "bfloat16", "shape": [2, 2]}

    got = client_codec.decode(frames).body
    assert got["ref"] == 3
    assert got["bf16"].dtype == "bfloat16" and got["bf16"].data.dtype == np.uint16
    np.testing.assert_array_equal(got["bf16"].data, bf16)
    assert got["bf16"].to_numpy().dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got["bf16"].to_numpy().astype("f4"), [[1, -2], [np.nan, 0]])
    np.testing.assert_array_equal(got["fp8"].to_numpy().astype("f4"), [1.0, -1.0, np.nan])
    np.testing.assert_array_equal(got["f32"].to_numpy(), f32)


@pytest.mark.parametrize(
    ("dtype", "nans", "infinities", "smallest"),
    [
        ("bfloat16", 254, 2, 2.0**-133),
        ("float8_e4m3fn", 2, 0, 2.0**-9),
        ("float8_e4m3fnuz", 1, 0, 2.0**-10),
        ("float8_e5m2", 6, 2, 2.0**-16),
        ("float8_e5m2fnuz", 1, 0, 2.0**-17),
    ],
)
def test_bfloat16_and_fp8_arrive_bit_for_bit_as_the_values_torch_means(
    server_codec, client_codec, dtype, nans, infinities, smallest
):
    storage = np.dtype(DTYPES[dtype].storage)
    every_word = np.arange(256**storage.itemsize, dtype=np.int64).astype(storage)
    frames = server_codec.encode("reply", {"data": WireArray(dtype, every_word.shape, every_word)})

    values = client_codec.decode(frames).body["data"].to_numpy()

    assert values.dtype == np.dtype(getattr(ml_dtypes, dtype))  # never widened on the way
    np.testing.assert_array_equal(values.view(storage), every_word)
    signed = every_word.view(np.int16 if storage.itemsize == 2 else np.uint8)
    meant = torch.from_numpy(signed).view(getattr(torch, dtype)).float().numpy()
    wide = values.astype(np.float32)  # exact for every one of them
    np.testing.assert_array_equal(wide, meant)  # NaN where torch has NaN
    assert (np.isnan(wide).sum(), np.isinf(wide).sum()) == (nans, infinities)
    assert wide[1] == smallest  # word 1: the smallest subnormal


def test_the_wire_types_need_neither_zmq_nor_torch():
    """The UI's screens and a reader of dumps import tensordbg.transport.wire alone."""
    check = "import sys, tensordbg.transport.wire; print(sorted({'zmq', 'torch'} & {*sys.modules}))"
    imported = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)

    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.strip() == "[]"


def test_large_arrays_are_neither_copied_to_send_nor_to_receive(server_codec, client_codec):
    array = np.ones(ZERO_COPY_MIN, dtype=np.float32)
    frames = server_codec.encode("reply", {"data": WireArray("float32", array.shape, array)})

    assert np.shares_memory(np.frombuffer(frames[2], dtype=np.float32), array)

    with zmq.Context() as context:
        sender, receiver = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
        for socket in (sender, receiver):
            configure_socket(socket)
        try:
            assert sender.copy_threshold == ZERO_COPY_MIN
            receiver.bind("inproc://zero-copy")
            sender.connect("inproc://zero-copy")
            sender.send_multipart(frames, copy=False)
            assert receiver.poll(10_000)
            received = receiver.recv_multipart(copy=False)
        finally:
            sender.close()
            receiver.close()
    data = client_codec.decode(received).body["data"].data
    assert np.shares_memory(data, np.frombuffer(received[2].buffer, dtype=np.uint8))
    np.testing.assert_array_equal(data, array)


def test_non_contiguous_arrays_and_numpy_scalars_are_sent_as_plain_values(
    server_codec, client_codec
):
    columns = np.arange(12, dtype=np.int32).reshape(3, 4)[:, ::2]
    body = {"n": np.float32(1.5), "shape": (3, 2), "data": WireArray("int32", (3, 2), columns)}

    got = client_codec.decode(server_codec.encode("reply", body)).body

    assert got["n"] == 1.5 and got["shape"] == [3, 2]
    np.testing.assert_array_equal(got["data"].to_numpy(), columns)


def test_an_array_that_does_not_match_its_dtype_is_a_sender_bug(server_codec):
    with pytest.raises(ValueError, match="bfloat16 WireArray holds uint16 words, not float32"):
        server_codec.encode("reply", {"data": WireArray("bfloat16", (2,), np.zeros(2, "f4"))})
    with pytest.raises(ValueError, match="shape"):
        server_codec.encode("reply", {"data": WireArray("float32", (3,), np.zeros(2, "f4"))})
    with pytest.raises(TypeError, match="top-level"):
        server_codec.encode("reply", {"x": [WireArray("float32", (1,), np.zeros(1, "f4"))]})


def test_roundtrip_gives_an_in_process_client_what_the_wire_would():
    array = WireArray("float32", (1,), np.zeros(1, np.float32))
    assert roundtrip({"shape": (2, 3), "n": np.int64(4), "data": array}) == {
        "shape": [2, 3],
        "n": 4,
        "data": array,
    }


# --- signing and replay --------------------------------------------------------------------------


def test_flipping_one_byte_of_an_array_frame_breaks_the_signature(server_codec, client_codec):
    array = np.arange(100_000, dtype=np.float32)
    frames = [
        bytes(f)
        for f in server_codec.encode("reply", {"data": WireArray("float32", array.shape, array)})
    ]
    tampered = bytearray(frames[2])
    tampered[40_000] ^= 0x01

    error = refusal(client_codec, [frames[0], frames[1], bytes(tampered)])

    assert "signature does not match" in str(error) and not error.authenticated
    assert client_codec.decode(frames).body["data"].shape == (100_000,)


def test_moving_bytes_from_one_array_frame_to_the_next_breaks_the_signature(
    server_codec, client_codec
):
    """The same bytes cut at another place are another message: each part is signed after its
    length, so the signature refuses it before any later check has to."""
    a, b = np.arange(1000, dtype=np.float32), np.arange(1000, 3000, dtype=np.float32)
    body = {"a": WireArray("float32", a.shape, a), "b": WireArray("float32", b.shape, b)}
    signature, header, first, second = (bytes(f) for f in server_codec.encode("reply", body))
    moved = [signature, header, first + second[:400], second[400:]]

    error = refusal(client_codec, moved)

    assert "signature does not match" in str(error) and not error.authenticated
    assert client_codec.decode([signature, header, first, second]).body["b"].data[1999] == 2999


def test_a_message_sent_back_to_the_side_that_signed_it_is_refused(server_codec, client_codec):
    """The sender's side is signed: a request echoed back to a client, or a reply echoed back to
    the server, is not a message of the other side."""
    request = client_codec.encode("control", {"action": "pause"}, id=1)
    reply = server_codec.encode("reply", {"state": "paused"}, id=1)
    other_client = MessageCodec(KEY, side="client")
    other_server = MessageCodec(KEY, side="server")

    assert "signature does not match" in str(refusal(other_client, request))
    assert "signature does not match" in str(refusal(other_server, reply))
    assert server_codec.decode(request).body == {"action": "pause"}
    assert client_codec.decode(reply).body == {"state": "paused"}


def test_flipping_one_byte_of_the_header_breaks_the_signature(server_codec, client_codec):
    frames = client_codec.encode("control", {"action": "step", "n": 1}, id=1)
    header = frames[1].replace(b"step", b"stop")

    assert "signature does not match" in str(refusal(server_codec, [frames[0], header]))


def test_a_message_signed_with_another_key_is_refused(server_codec):
    stranger = MessageCodec(b"x" * 32, side="client")
    error = refusal(server_codec, stranger.encode("control", {"action": "pause"}, id=1))
    assert "does not hold this session's key" in str(error) and not error.authenticated


def test_a_message_without_signature_is_refused(server_codec, client_codec):
    frames = client_codec.encode("info", {}, id=1)
    assert "got 1 frame" in str(refusal(server_codec, frames[1:]))
    assert "signature is missing or malformed" in str(refusal(server_codec, [b"", frames[1]]))


def test_a_malformed_signature_is_refused_without_hashing_the_message(
    server_codec, client_codec, monkeypatch
):
    frames = client_codec.encode("info", {}, id=1)

    def sign(*_):
        pytest.fail("a message whose signature cannot match was hashed")

    monkeypatch.setattr(server_codec, "sign", sign)
    error = refusal(server_codec, [frames[0][:32], frames[1]])
    assert "signature is missing or malformed" in str(error)


def test_a_replayed_message_is_refused(server_codec, client_codec):
    frames = client_codec.encode("control", {"action": "continue"}, id=1)
    server_codec.decode(frames)

    error = refusal(server_codec, frames)

    assert "already received once" in str(error)


def test_a_message_outside_the_time_window_is_refused(server_codec, monkeypatch):
    sender = MessageCodec(KEY, side="client")
    monkeypatch.setattr(tensordbg.transport.codec.time, "time", lambda: 1_000_000.0)
    stale = sender.encode("info", {}, id=1)
    monkeypatch.undo()

    assert "outside ±60 s" in str(refusal(server_codec, stale))


def test_the_replay_guard_forgets_signatures_once_their_window_has_passed():
    guard = ReplayGuard(window=10.0)
    assert guard.refusal(b"sig", ts=100.0, now=100.0) is None
    assert "already received" in guard.refusal(b"sig", ts=100.0, now=105.0)
    assert "outside" in guard.refusal(b"sig", ts=100.0, now=111.0)
    assert guard.refusal(b"other", ts=111.0, now=111.0) is None
    assert b"sig" not in guard._seen  # forgotten: the timestamp check refuses it from now on


# --- malformed messages --------------------------------------------------------------------------


def test_an_oversized_request_header_is_refused_before_it_is_read(server_codec, client_codec):
    header = b"\xa0" * (MAX_REQUEST_HEADER + 1)  # would unpack fine: size alone decides

    error = refusal(server_codec, [client_codec.sign(header, []), header])

    assert f"at most {MAX_REQUEST_HEADER:,} are accepted" in str(error)
    with pytest.raises(ValueError, match="accepts at most"):
        client_codec.encode("stats", {"ref": 1, "text": "x" * MAX_REQUEST_HEADER}, id=1)


def test_a_reply_may_be_larger_than_a_request(server_codec, client_codec):
    rows = [{"path": f"layers.{i}", "stats": {}} for i in range(10_000)]
    assert len(client_codec.decode(server_codec.encode("reply", rows, id=1)).body) == 10_000


def test_too_many_frames_are_refused(server_codec, client_codec):
    frames = client_codec.encode("info", {}, id=1) + [b"x"] * MAX_REQUEST_FRAMES
    assert f"at most {MAX_REQUEST_FRAMES} frames" in str(refusal(server_codec, frames))


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        (b"\xc1", "starts no msgpack value"),
        (b"\x81\xa1v", "incomplete input"),
        (b"\x81\xa1v\x01\x02", "extra bytes"),
        (b"\x91" * 5000 + b"\x00", "nested too deeply"),
        (msgpack.packb({1: 2}), "int is not allowed for map key"),
        (msgpack.packb({"v": msgpack.ExtType(5, b"x")}), "extension type 5 is not accepted"),
        (b"\x81\xa1v\xa3\xff\xfe\xfd", "can't decode byte"),
    ],
)
def test_malformed_msgpack_is_refused_with_a_clear_error(server_codec, raw, problem):
    error = refusal(server_codec, signed_raw(server_codec, raw))
    assert "header is not valid msgpack" in str(error) and problem in str(error)
    assert error.authenticated  # signed with the key: the sender may be told what was wrong


def test_a_timestamp_extension_in_a_request_is_refused(server_codec):
    header = {"type": "set_rule", "id": 4, "body": {"id": 1, "params": {"t": msgpack.Timestamp(1)}}}
    error = refusal(server_codec, signed(server_codec, header))
    assert "holds a Timestamp; only plain values are accepted" in str(error)
    assert error.id == 4


def test_a_deeply_nested_request_body_is_refused(server_codec):
    deep: list = []
    for _ in range(40):
        deep = [deep]
    error = refusal(server_codec, signed(server_codec, {"type": "hits", "id": 1, "body": deep}))
    assert "deeper than 32 levels" in str(error)


def test_an_unknown_protocol_version_is_refused_naming_both(server_codec):
    raw = pack({"v": 99, "type": "hello", "id": 1, "ts": time.time(), "nonce": "n", "session": "s"})
    error = refusal(server_codec, signed_raw(server_codec, raw))
    assert "version 99" in str(error) and f"version {PROTOCOL_VERSION}" in str(error)


@pytest.mark.parametrize(
    ("header", "problem"),
    [
        ({"type": "info", "id": "1"}, "id must be an integer"),
        ({"type": "", "id": 1}, "'type' must be a short non-empty string"),
        ({"type": "info", "id": 1, "session": 5}, "'session' must be"),
        ({"type": "info", "id": 1, "ts": "now"}, "timestamp 'ts' is missing or not a number"),
    ],
)
def test_a_malformed_envelope_is_refused(server_codec, header, problem):
    assert problem in str(refusal(server_codec, signed(server_codec, header)))


@pytest.mark.parametrize(
    ("descriptor", "frame", "problem"),
    [
        ({"__array__": 0, "dtype": "float32", "shape": [3]}, b"\0" * 8, "needs 12 bytes"),
        ({"__array__": 1, "dtype": "float32", "shape": [2]}, b"\0" * 8, "names frame 1"),
        ({"__array__": 0, "dtype": "object", "shape": [1]}, b"\0" * 8, "unknown dtype"),
        ({"__array__": 0, "dtype": "float32", "shape": [-2]}, b"\0" * 8, "malformed shape"),
        ({"__array__": 0, "dtype": "int8", "shape": [8], "x": 1}, b"\0" * 8, "exactly"),
        ({"note": "no descriptor"}, b"\0" * 8, "names 0"),
    ],
)
def test_a_malformed_array_is_refused(client_codec, descriptor, frame, problem):
    frames = signed(client_codec, {"type": "reply", "id": 2, "body": {"data": descriptor}}, [frame])
    error = refusal(client_codec, frames)
    assert problem in str(error) and error.id == 2


# --- no pickle ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "module",
    [
        tensordbg.transport.wire,
        tensordbg.transport.codec,
        tensordbg.transport.shm,
        tensordbg.transport.connection,
        tensordbg.transport.server,
        tensordbg.transport.socket_loop,
        tensordbg.transport.client,
        tensordbg.transport.sync_client,
    ],
)
def test_no_pickle_anywhere_in_the_transport(module):
    tree = ast.parse(inspect.getsource(module))
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    serialisers = {"pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve", "msgpack_numpy"}
    assert not (imported | names) & serialisers


def test_objects_are_refused_rather_than_pickled(server_codec):
    with pytest.raises(TypeError, match="cannot send a value of type object"):
        server_codec.encode("reply", {"x": object()})
    with pytest.raises(TypeError, match="cannot send a value of type ndarray"):
        server_codec.encode("reply", {"x": np.zeros(2, dtype=object)})
