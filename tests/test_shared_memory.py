"""Large replies on the same host: the training writes the array to a private shared-memory file,
the UI maps it, checks the signature over it, unlinks it and reads the values in place. Remote
sessions never use it; nothing is left behind; a tampered file or a name that points elsewhere is
refused, saying why."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
from conftest import DEADLINE, wait_until

from tensordbg.sources.contract import EventCallback, SourceError
from tensordbg.transport.client import Client, ReplyRefused
from tensordbg.transport.codec import MessageCodec, ProtocolError
from tensordbg.transport.connection import shared_memory_dir
from tensordbg.transport.server import Server
from tensordbg.transport.shm import SHM_MIN, SharedMemory
from tensordbg.transport.sync_client import SyncClient
from tensordbg.transport.wire import PROTOCOL_VERSION, WireArray, pack

KEY = bytes(range(32))
MiB = 2**20


class ArraySource:
    """A paused training holding a few arrays: ``slice`` returns a view of one (as the live
    source returns views of live CPU tensors), ``control`` changes them all (as resuming does)."""

    def __init__(self, **arrays: np.ndarray):
        self.arrays = list(arrays.values())

    def info(self) -> dict[str, Any]:
        return {"run_id": "shm", "rank": 0, "state": "paused", "live": True}

    def hits(self, since: int = 0) -> list[dict[str, Any]]:
        return []

    def slice(
        self, ref: int, text: str = "", window: list[list[int]] | None = None
    ) -> dict[str, Any]:
        if not 0 <= ref < len(self.arrays):
            raise SourceError(f"no tensor {ref}")
        array = self.arrays[ref]
        return {"ref": ref, "data": WireArray("float32", array.shape, array)}

    def control(self, action: str, n: int = 1) -> dict[str, Any]:
        for array in self.arrays:
            array += 1.0  # the training ran on
        return {"state": "running", "step": 1}

    def subscribe(self, callback: EventCallback) -> Callable[[], None]:
        return lambda: None


def random_array(nbytes: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.standard_normal(nbytes // 4, dtype=np.float32).reshape(-1, 1024)


@pytest.fixture
def shm(tmp_path) -> Path:
    return tmp_path / "shm"


@pytest.fixture
def start_server(server_factory, shm) -> Callable[..., Server]:
    return server_factory(run_id="shm", rank=0, shm_dir=shm)


def private(path: Path, mode: int) -> bool:
    st = os.lstat(path)
    return st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == mode


# --- through a real session ----------------------------------------------------------------------


def test_a_64_mib_array_arrives_through_shared_memory_intact_and_in_place(start_server, shm):
    source = ArraySource(weights=random_array(64 * MiB))
    server = start_server(source)
    assert server.info.shm_dir == str(shm) and private(shm, 0o700)

    with SyncClient(server.info, timeout=DEADLINE) as client:
        data = client.call("slice", ref=0)["data"].data

    np.testing.assert_array_equal(data, source.arrays[0])
    assert not data.flags.writeable  # the values are the read-only mapping, not a copy of it
    (written,) = server.shared.files  # it went through shared memory...
    assert not (shm / written).exists()  # ...and the client took the file away at once
    assert os.listdir(shm) == []


def test_a_file_no_client_took_is_private_and_removed_by_stop(start_server, shm):
    server = start_server(ArraySource(weights=random_array(16 * MiB)))
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)  # asks, and never reads the reply
    try:
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(server.info.endpoint)
        codec = MessageCodec(server.info.key_bytes, side="client")
        dealer.send_multipart(codec.encode("slice", {"ref": 0}, id=1))
        wait_until(lambda: os.listdir(shm))
        (name,) = os.listdir(shm)
        assert private(shm / name, 0o600) and private(shm, 0o700)

        server.stop()
        assert os.listdir(shm) == []
    finally:
        dealer.close(linger=0)
        context.term()


def test_a_tampered_file_is_refused_at_once_saying_why(start_server, shm, monkeypatch):
    put = SharedMemory.put

    def put_then_tamper(self: SharedMemory, data: memoryview) -> Any:
        written = put(self, data)
        with open(self.directory / written[0], "r+b") as f:  # after signing, before the client
            f.seek(12345)
            byte = f.read(1)
            f.seek(12345)
            f.write(bytes([byte[0] ^ 1]))
        return written

    monkeypatch.setattr(SharedMemory, "put", put_then_tamper)
    server = start_server(ArraySource(weights=random_array(16 * MiB)))

    with SyncClient(server.info, timeout=DEADLINE) as client:
        started = time.monotonic()
        with pytest.raises(ReplyRefused, match="'slice' was refused: message signature does not"):
            client.call("slice", ref=0)
        assert time.monotonic() - started < client._client.call_timeout  # not a timeout
        assert client.call("info")["state"] == "paused"  # and the session goes on
    assert os.listdir(shm) == []


def test_what_is_sent_is_what_was_there_when_the_request_ran(start_server):
    # The second request resumes the training (changing the arrays) as soon as the first reply
    # is encoded, while its frames may still wait for the socket: replies are snapshots.
    small, large = random_array(1 * MiB), random_array(16 * MiB, seed=1)
    before = small.copy(), large.copy()
    server = start_server(ArraySource(small=small, large=large))

    async def scenario() -> list[Any]:
        async with await Client.connect(server.info, DEADLINE) as client:
            return await asyncio.gather(
                client.call("slice", ref=0),
                client.call("slice", ref=1),
                client.call("control", action="continue"),
            )

    got_small, got_large, _ = asyncio.run(scenario())
    np.testing.assert_array_equal(got_small["data"].data, before[0])
    np.testing.assert_array_equal(got_large["data"].data, before[1])
    assert small[0, 0] == before[0][0, 0] + 1  # the training did go on


def test_a_remote_session_never_uses_shared_memory(start_server, shm):
    source = ArraySource(weights=random_array(16 * MiB))
    server = start_server(source, remote=True)
    assert server.shared is None and server.info.shm_dir is None

    with SyncClient(server.info, timeout=DEADLINE) as client:
        data = client.call("slice", ref=0)["data"].data

    np.testing.assert_array_equal(data, source.arrays[0])
    assert not shm.exists()


def test_by_default_large_replies_wait_in_dev_shm(start_server):
    if not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm here")
    server = start_server(ArraySource(), shm_dir=None)
    assert server.info.shm_dir == f"/dev/shm/tensordbg-{os.getuid()}"
    assert private(Path(server.info.shm_dir), 0o700)


# --- the codec: writing, taking, refusing --------------------------------------------------------


@pytest.fixture
def server_codec() -> MessageCodec:
    return MessageCodec(KEY, side="server")


@pytest.fixture
def shared(shm) -> SharedMemory:
    return SharedMemory(shared_memory_dir(shm))


@pytest.fixture
def client_codec(shared) -> MessageCodec:
    return MessageCodec(KEY, side="client", shared=SharedMemory(shared.directory))


def reply(array: np.ndarray) -> dict[str, Any]:
    return {"data": WireArray("float32", array.shape, array)}


def test_only_arrays_of_shm_min_bytes_and_more_leave_the_socket(server_codec, client_codec, shared):
    small, large = random_array(SHM_MIN - 4096), random_array(SHM_MIN)
    body = {"small": reply(small)["data"], "large": reply(large)["data"]}
    frames = server_codec.encode("reply", body, id=3, shared=shared)

    assert len(frames) == 3  # signature, header, the small array
    assert len(shared.files) == 1
    # what the client will hash, to check it off its event loop
    assert client_codec.incoming_bytes(frames) > small.nbytes + large.nbytes
    got = client_codec.decode(frames).body
    np.testing.assert_array_equal(got["small"].data, small)
    np.testing.assert_array_equal(got["large"].data, large)
    assert os.listdir(shared.directory) == []


def test_a_file_changed_after_signing_is_refused_and_removed(server_codec, client_codec, shared):
    frames = server_codec.encode("reply", reply(random_array(SHM_MIN)), id=4, shared=shared)
    (name,) = shared.files
    with open(shared.directory / name, "r+b") as f:
        f.seek(SHM_MIN - 1)
        f.write(b"\x7f")

    with pytest.raises(ProtocolError, match="signature does not match"):
        client_codec.decode(frames)
    assert os.listdir(shared.directory) == []


def signed_descriptor(codec: MessageCodec, name: str, nbytes: int = SHM_MIN) -> list[bytes]:
    """A reply naming a shared-memory file, signed by a key holder (the signature does not cover
    the file: its name is refused before any file is opened)."""
    descriptor = {"__array__": 0, "dtype": "uint8", "shape": [nbytes], "shm": name}
    descriptor["nbytes"] = nbytes
    header = pack(
        {
            "v": PROTOCOL_VERSION,
            "type": "reply",
            "id": 5,
            "ts": time.time(),
            "nonce": "n1",
            "session": "s1",
            "body": {"data": descriptor},
        }
    )
    return [codec.sign(header, [], sender=codec.peer), header]


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("../x", "is a path, not a file name"),
        ("/tmp/x", "is a path, not a file name"),
        ("sub/x", "is a path, not a file name"),
        ("..", "is a path, not a file name"),
        ("x", "is not the name of a tensordbg shared-memory file"),
        (7, "a shared-memory file name is a string"),
    ],
)
def test_a_name_that_is_not_a_file_of_the_directory_is_refused(client_codec, shared, name, problem):
    outside = shared.directory.parent / "x"
    outside.write_bytes(b"\0" * SHM_MIN)

    with pytest.raises(ProtocolError, match=problem):
        client_codec.decode(signed_descriptor(client_codec, name))
    assert outside.stat().st_size == SHM_MIN  # untouched, not unlinked


def test_a_file_that_is_gone_or_of_another_size_is_refused(client_codec, shared):
    name = f"{os.getpid()}-{'ab' * 16}.array"
    with pytest.raises(ProtocolError, match="is gone: taken already"):
        client_codec.decode(signed_descriptor(client_codec, name))

    fd = os.open(shared.directory / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.close(fd)
    with pytest.raises(ProtocolError, match="holds 0 bytes; the message says 16,777,216"):
        client_codec.decode(signed_descriptor(client_codec, name))
    assert os.listdir(shared.directory) == []


@pytest.mark.parametrize("side", ["server", "remote client"])
def test_a_side_without_shared_memory_refuses_a_descriptor(server_codec, side):
    # A request never names a file for the training to open; a tcp client has no directory.
    codec = server_codec if side == "server" else MessageCodec(KEY, side="client")
    with pytest.raises(ProtocolError, match="which this side does not accept"):
        codec.decode(signed_descriptor(codec, f"{os.getpid()}-{'ab' * 16}.array"))


def test_when_shared_memory_cannot_be_written_the_array_takes_the_socket(
    server_codec, client_codec, tmp_path
):
    unusable = SharedMemory(tmp_path / "missing")  # as a full /dev/shm: writing fails
    array = random_array(SHM_MIN)
    frames = server_codec.encode("reply", reply(array), id=6, shared=unusable)

    assert len(frames) == 3
    np.testing.assert_array_equal(client_codec.decode(frames).body["data"].data, array)


def test_a_snapshot_does_not_follow_the_array(server_codec, client_codec):
    array = random_array(1 * MiB)
    frames = server_codec.encode("reply", reply(array), id=7, snapshot=True)
    original = array.copy()
    array += 1.0
    np.testing.assert_array_equal(client_codec.decode(frames).body["data"].data, original)


def test_files_no_client_took_are_swept_after_a_while(server_codec, shared):
    server_codec.encode("reply", reply(random_array(SHM_MIN)), id=8, shared=shared)
    (name,) = shared.files

    shared.sweep()  # a fresh file waits for its client
    assert (shared.directory / name).exists()
    shared.sweep(max_age=0.0)  # as it is once SHM_MAX_AGE has passed
    assert not (shared.directory / name).exists() and shared.files == []


def test_files_of_a_training_that_was_killed_are_removed_by_the_next(shared):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], text=True,
                          capture_output=True, check=True)  # fmt: skip
    orphan = shared.directory / f"{int(dead.stdout)}-{'cd' * 16}.array"
    mine = shared.directory / f"{os.getpid()}-{'ef' * 16}.array"
    for path in (orphan, mine):
        path.write_bytes(b"\0")

    shared.remove_orphans()
    assert not orphan.exists() and mine.exists()


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores")
def test_the_chunks_of_a_large_array_are_hashed_at_once_on_every_core(monkeypatch):
    """Every byte is hashed on both sides: done one chunk after the other, a 256 MiB transfer
    took a third longer on two cores."""
    import threading

    import tensordbg.transport.shm as shm

    lock, running, most = threading.Lock(), [0], [0]
    real = shm._sha256

    def slow(chunk):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1
        return real(chunk)

    monkeypatch.setattr(shm, "_sha256", slow)
    data = memoryview(bytes(4 * shm.TREE_CHUNK))
    assert shm.chunk_digests(data) == [real(data[i : i + shm.TREE_CHUNK])
                                       for i in range(0, data.nbytes, shm.TREE_CHUNK)]  # fmt: skip
    assert most[0] >= 2
