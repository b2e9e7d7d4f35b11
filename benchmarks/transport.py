"""How fast tensor data crosses from a training to the UI.

Run: ``python benchmarks/transport.py``. It measures, with the training side in its own process
(as in real use) and the UI side here:

(a) the round trip of a 1 MiB slice request (a 512 x 512 window) of a 1 GiB float32 tensor;
    target: median < 50 ms;
(b) a whole 256 MiB tensor over ipc through tensordbg (signed, framed, zero-copy), next to raw
    pyzmq zero-copy of the same bytes over ipc in the same run; target: >= 1 GB/s.

The measuring functions take a connected client and know nothing of what serves it; only
:func:`serve_numpy_session` builds the (numpy) session, so a live torch session can replace it.
"""

from __future__ import annotations

import asyncio
import hmac
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from tensordbg.client import Client
from tensordbg.protocol import WireArray, configure_socket
from tensordbg.slicing import apply_index, clamp_window, format_index, parse_index, window_of
from tensordbg.source import EventCallback, SourceError

BIG_SHAPE = (16384, 16384)  # float32: 1 GiB
WHOLE_ROWS = 4096  # the first 4096 rows: 256 MiB
SLICE_WINDOW = 512  # 512 x 512 float32: 1 MiB
SLICE_REPEATS = 20
WHOLE_REPEATS = 5


# --- what is served (replace this part to measure a live session) -------------------------------


class NumpySource:
    """The parts of the Source interface the benchmark uses, over numpy arrays."""

    def __init__(self, arrays: dict[int, np.ndarray]):
        self.arrays = arrays

    def info(self) -> dict[str, Any]:
        return {"run_id": "bench", "rank": 0, "state": "paused", "live": False}

    def hits(self, since: int = 0) -> list[dict[str, Any]]:
        return []

    def slice(
        self, ref: int, text: str = "", window: list[list[int]] | None = None
    ) -> dict[str, Any]:
        if ref not in self.arrays:
            raise SourceError(f"no tensor {ref}")
        index = parse_index(text)
        view = apply_index(self.arrays[ref], index)
        rows, cols = clamp_window(view.shape, window, max_elements=2**31)
        block = np.ascontiguousarray(window_of(view, rows, cols))  # a view when rows are whole
        return {
            "ref": ref,
            "index": format_index(index),
            "shape": list(view.shape),
            "window": [list(rows), list(cols)],
            "dtype": "float32",
            "data": WireArray("float32", block.shape, block),
        }

    def subscribe(self, callback: EventCallback) -> Callable[[], None]:
        return lambda: None


def serve_numpy_session(runtime: str, ready: Any, done: Any) -> None:
    """Child process: serve a 1 GiB float32 tensor until told to stop."""
    from tensordbg.server import Server

    big = np.empty(BIG_SHAPE, dtype=np.float32)
    big[:] = np.linspace(-1, 1, BIG_SHAPE[1], dtype=np.float32)  # touches every page
    server = Server(NumpySource({0: big}), run_id="bench", rank=0, runtime_dir=runtime)
    ready.send(str(server.start().path))
    done.recv()
    server.stop()


def serve_raw_zmq(endpoint: str, nbytes: int, ready: Any) -> None:
    """Child process: answer every request with the same ``nbytes``, zero-copy, on plain pyzmq."""
    payload = np.empty(nbytes, dtype=np.uint8)
    payload[:] = 7
    with zmq.Context() as context, context.socket(zmq.ROUTER) as router:
        configure_socket(router)
        router.bind(endpoint)
        ready.send(endpoint)
        while True:
            identity, request = router.recv_multipart()
            if request == b"stop":
                return
            router.send_multipart([identity, payload], copy=False)


# --- measuring ----------------------------------------------------------------------------------


async def time_slice_round_trip(client: Client, window: list[list[int]]) -> float:
    """Seconds from asking for a window of tensor 0 to holding its values."""
    started = time.perf_counter()
    reply = await client.call("slice", ref=0, window=window)
    values = reply["data"].to_numpy()
    elapsed = time.perf_counter() - started
    assert values.nbytes == SLICE_WINDOW * SLICE_WINDOW * 4
    return elapsed


async def time_whole_tensor(client: Client) -> float:
    """Seconds to receive the first WHOLE_ROWS rows of tensor 0 (256 MiB), verified."""
    started = time.perf_counter()
    reply = await client.call("slice", ref=0, text=f"[:{WHOLE_ROWS}]")
    elapsed = time.perf_counter() - started
    assert reply["data"].nbytes == WHOLE_ROWS * BIG_SHAPE[1] * 4
    return elapsed


def time_raw_zmq(dealer: zmq.Socket, nbytes: int) -> float:
    """Seconds for a small request and an ``nbytes`` zero-copy reply on plain pyzmq."""
    started = time.perf_counter()
    dealer.send(b"go")
    frame = dealer.recv(copy=False)
    data = np.frombuffer(frame.buffer, dtype=np.uint8)
    elapsed = time.perf_counter() - started
    assert data.nbytes == nbytes
    return elapsed


async def measure(connection: str, raw_endpoint: str) -> dict[str, list[float]]:
    """Both measurements; the tensordbg and raw transfers alternate, so that both see the same
    load on a shared machine."""
    rng = np.random.default_rng(0)
    rows, cols = BIG_SHAPE
    times: dict[str, list[float]] = {"slice": [], "whole": [], "raw": []}
    async with await Client.connect(connection) as client:
        for _ in range(SLICE_REPEATS):
            r0 = int(rng.integers(0, rows - SLICE_WINDOW))
            c0 = int(rng.integers(0, cols - SLICE_WINDOW))
            window = [[r0, r0 + SLICE_WINDOW], [c0, c0 + SLICE_WINDOW]]
            times["slice"].append(await time_slice_round_trip(client, window))
        with zmq.Context() as context, context.socket(zmq.DEALER) as dealer:
            configure_socket(dealer)
            dealer.connect(raw_endpoint)
            for _ in range(WHOLE_REPEATS):
                times["whole"].append(await time_whole_tensor(client))
                times["raw"].append(time_raw_zmq(dealer, WHOLE_ROWS * BIG_SHAPE[1] * 4))
            dealer.send(b"stop")
    return times


def measure_hmac(nbytes: int, repeats: int = 3) -> float:
    """Median seconds of HMAC-SHA256 over ``nbytes`` (paid once to sign, once to verify)."""
    data = np.ones(nbytes, dtype=np.uint8)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        hmac.new(b"k" * 32, memoryview(data), "sha256").digest()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def machine() -> str:
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    python = sys.version.split()[0]
    return f"{model}, {os.cpu_count()} cores, Python {python}, libzmq {zmq.zmq_version()}"


def main() -> None:
    spawn = multiprocessing.get_context("spawn")
    whole_bytes = WHOLE_ROWS * BIG_SHAPE[1] * 4
    print(f"machine: {machine()}")
    with tempfile.TemporaryDirectory(prefix="tdbg-bench-") as runtime:
        os.chmod(runtime, 0o700)
        ready, ready_child = spawn.Pipe()
        done, done_child = spawn.Pipe()
        raw_endpoint = f"ipc://{runtime}/raw.sock"
        training = spawn.Process(
            target=serve_numpy_session, args=(runtime, ready_child, done_child)
        )
        raw = spawn.Process(target=serve_raw_zmq, args=(raw_endpoint, whole_bytes, ready_child))
        training.start()
        raw.start()
        try:
            first, second = ready.recv(), ready.recv()
            connection = first if first.endswith(".json") else second
            times = asyncio.run(measure(connection, raw_endpoint))
        finally:
            done.send("stop")
            for child in (training, raw):
                child.join(30)
                if child.is_alive():
                    child.kill()

    slice_times, whole_times, raw_times = times["slice"], times["whole"], times["raw"]
    slice_ms = statistics.median(slice_times) * 1000
    whole = statistics.median(whole_times)
    raw_s = statistics.median(raw_times)
    mac = measure_hmac(whole_bytes)
    print(
        f"(a) 1 MiB slice of a 1 GiB float32 tensor, round trip: median {slice_ms:.1f} ms "
        f"(min {min(slice_times) * 1000:.1f}, max {max(slice_times) * 1000:.1f}, "
        f"n={len(slice_times)}); target < 50 ms: {'met' if slice_ms < 50 else 'MISSED'}"
    )
    print(f"(b) whole 256 MiB tensor over ipc, median of {len(whole_times)}, alternating:")
    print(f"    tensordbg           {whole:6.3f} s  {whole_bytes / whole / 1e9:5.2f} GB/s")
    print(f"    raw pyzmq zero-copy {raw_s:6.3f} s  {whole_bytes / raw_s / 1e9:5.2f} GB/s")
    print(
        f"    ratio tensordbg/raw throughput {raw_s / whole:.2f}; target >= 1 GB/s: "
        f"{'met' if whole_bytes / whole >= 1e9 else 'MISSED'}"
    )
    print(
        f"    of which HMAC-SHA256 of 256 MiB: {mac:.3f} s, paid twice (sign + verify) "
        f"= {2 * mac / whole:.0%} of the tensordbg time"
    )


if __name__ == "__main__":
    main()
