"""How fast tensor data crosses from a training to the UI, and how quickly the UI answers.

Run: ``python benchmarks/transport.py``. A real training runs in its own process (spawned): a tiny
model whose forward returns a 1 GiB float32 tensor and a 256 MiB one with a planted NaN, attached
with ``tensordbg.attach(on_hit="pause", server=True)``, so it pauses with both retained. The UI
side here finds the session as the UI does and measures through
:class:`tensordbg.transport.client.Client`:

(a) the round trip of a 1 MiB slice request (a 512 x 512 window) of the 1 GiB tensor;
    target: median < 50 ms;
(b) the whole 256 MiB tensor (on ipc: through shared memory, signed), next to raw pyzmq
    zero-copy of the same number of bytes over ipc in the same run, the two alternating so that
    both see the same load; target: >= 1 GB/s;

then, with the training gone, the UI's own figures from ``benchmarks/ui.py``:

(c) cold start to the first screen; target < 1 s;
(d) key-press latency on a model of 2,000 modules.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from tensordbg.transport.client import Client
from tensordbg.transport.codec import configure_socket
from tensordbg.transport.shm import SHM_MIN

BIG_SHAPE = (16384, 16384)  # float32: 1 GiB
WHOLE_SHAPE = (4096, 16384)  # float32: 256 MiB
WHOLE_BYTES = WHOLE_SHAPE[0] * WHOLE_SHAPE[1] * 4
SLICE_WINDOW = 512  # 512 x 512 float32: 1 MiB
SLICE_REPEATS = 20
WHOLE_REPEATS = 5
START_TIMEOUT = 300.0  # seconds for the training to start, fill its tensors and pause


# --- the two processes the UI side talks to -----------------------------------------------------


def train(runtime: str) -> None:
    """Child process: a training that pauses on a NaN with a 1 GiB and a 256 MiB tensor kept."""
    os.environ["TENSORDBG_RUNTIME_DIR"] = runtime
    import torch

    import tensordbg

    class Planted(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            big = torch.full(BIG_SHAPE, 0.5)
            whole = torch.full(WHOLE_SHAPE, 0.25)
            whole[7, 7] = float("nan")
            return big, whole

    model = Planted()
    tensordbg.attach(
        model, on_hit="pause", server=True, retain_bytes=3 * 2**30, run_id="bench", rank=0
    )
    model(torch.zeros(()))  # pauses here until the UI side detaches


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


def wait_for_pause(runtime: str, training: Any) -> Path:
    """The connection file of the training once it is paused with its tensors kept."""
    from tensordbg.transport.connection import find_sessions
    from tensordbg.transport.sync_client import SyncClient

    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if not training.is_alive():
            raise RuntimeError(f"the training process exited with code {training.exitcode}")
        sessions = find_sessions(runtime)
        if sessions and sessions[0].path is not None:
            with SyncClient(sessions[0], timeout=30) as client:
                if client.call("info")["state"] == "paused":
                    return sessions[0].path
        time.sleep(0.2)
    raise TimeoutError(f"the training did not pause within {START_TIMEOUT:g} s")


# --- measuring ----------------------------------------------------------------------------------


async def time_slice_round_trip(client: Client, ref: int, window: list[list[int]]) -> float:
    """Seconds from asking for a window of a tensor to holding its values."""
    started = time.perf_counter()
    reply = await client.call("slice", ref=ref, window=window)
    values = reply["data"].to_numpy()
    elapsed = time.perf_counter() - started
    assert values.nbytes == SLICE_WINDOW * SLICE_WINDOW * 4
    return elapsed


async def time_whole_tensor(client: Client, ref: int) -> float:
    """Seconds to receive a whole 256 MiB tensor, verified; freeing it (munmap) is not timed,
    as freeing the raw reply is not."""
    started = time.perf_counter()
    reply = await client.call("slice", ref=ref)
    elapsed = time.perf_counter() - started
    assert reply["data"].nbytes == WHOLE_BYTES
    assert np.isnan(reply["data"].data[7, 7])
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


async def measure(connection: Path, raw_endpoint: str) -> dict[str, Any]:
    """(a) and (b) against the paused training; tensordbg and raw transfers alternate."""
    rng = np.random.default_rng(0)
    times: dict[str, Any] = {"slice": [], "whole": [], "raw": []}
    async with await Client.connect(connection, timeout=30) as client:
        tensors = await client.call("tensors")
        refs = {tuple(t["shape"]): t["ref"] for t in tensors if t["retained"]}
        missing = {BIG_SHAPE, WHOLE_SHAPE} - set(refs)
        if missing:
            raise RuntimeError(f"the training did not keep tensors of shape {missing}: {tensors}")
        times["shm"] = client.info.shm_dir
        rows, cols = BIG_SHAPE
        for _ in range(SLICE_REPEATS):
            r0 = int(rng.integers(0, rows - SLICE_WINDOW))
            c0 = int(rng.integers(0, cols - SLICE_WINDOW))
            window = [[r0, r0 + SLICE_WINDOW], [c0, c0 + SLICE_WINDOW]]
            times["slice"].append(await time_slice_round_trip(client, refs[BIG_SHAPE], window))
        with zmq.Context() as context, context.socket(zmq.DEALER) as dealer:
            configure_socket(dealer)
            dealer.connect(raw_endpoint)
            for _ in range(WHOLE_REPEATS):
                times["whole"].append(await time_whole_tensor(client, refs[WHOLE_SHAPE]))
                times["raw"].append(time_raw_zmq(dealer, WHOLE_BYTES))
            dealer.send(b"stop")
        await client.call("control", action="detach")
    return times


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


def verdict(met: bool) -> str:
    return "met" if met else "MISSED"


def transfer(runtime: str) -> dict[str, Any]:
    """(a) and (b): start the training and the raw server, measure, and always end both."""
    spawn = multiprocessing.get_context("spawn")
    ready, ready_child = spawn.Pipe()
    raw_endpoint = f"ipc://{runtime}/raw.sock"
    training = spawn.Process(target=train, args=(runtime,), name="tensordbg-bench-training")
    raw = spawn.Process(target=serve_raw_zmq, args=(raw_endpoint, WHOLE_BYTES, ready_child))
    try:
        training.start()
        raw.start()
        if not ready.poll(START_TIMEOUT):
            raise TimeoutError("the raw pyzmq server did not start")
        ready.recv()
        connection = wait_for_pause(runtime, training)
        return asyncio.run(measure(connection, raw_endpoint))
    finally:
        for child in (training, raw):
            child.join(10)  # detached, the training finishes its forward and exits
            if child.is_alive():
                child.kill()
                child.join(10)


def main() -> None:
    print(f"machine: {machine()}")
    with tempfile.TemporaryDirectory(prefix="tdbg-bench-") as runtime:
        os.chmod(runtime, 0o700)
        times = transfer(runtime)

    slice_times, whole_times, raw_times = times["slice"], times["whole"], times["raw"]
    slice_ms = statistics.median(slice_times) * 1000
    whole = statistics.median(whole_times)
    raw_s = statistics.median(raw_times)
    print(
        f"(a) 1 MiB slice of a 1 GiB float32 tensor of a paused training, round trip: median "
        f"{slice_ms:.1f} ms (min {min(slice_times) * 1000:.1f}, max {max(slice_times) * 1000:.1f},"
        f" n={len(slice_times)}); target < 50 ms: {verdict(slice_ms < 50)}"
    )
    via = f"shared memory in {times['shm']}" if times["shm"] else "the socket"
    print(f"(b) whole 256 MiB tensor, median of {len(whole_times)}, alternating with raw pyzmq:")
    print(f"    tensordbg ({via}, arrays >= {SHM_MIN // 2**20} MiB):")
    print(f"                        {whole:6.3f} s  {WHOLE_BYTES / whole / 1e9:5.2f} GB/s")
    print(f"    raw pyzmq zero-copy {raw_s:6.3f} s  {WHOLE_BYTES / raw_s / 1e9:5.2f} GB/s")
    print(
        f"    tensordbg/raw throughput {raw_s / whole:.2f}; target >= 1 GB/s: "
        f"{verdict(WHOLE_BYTES / whole >= 1e9)}"
    )
    print(
        "    all tensordbg runs: " + ", ".join(f"{t:.3f}" for t in whole_times) + " s; raw: "
        + ", ".join(f"{t:.3f}" for t in raw_times) + " s"
    )  # fmt: skip

    import ui  # benchmarks/ui.py: textual and the tests' FakeSource, only now

    starts = ui.cold_start()
    cold = statistics.median(starts)
    print(
        f"(c) UI cold start to the first screen: median {cold:.2f} s (min {min(starts):.2f}, max "
        f"{max(starts):.2f}, n={len(starts)}); target < 1 s: {verdict(cold < 1)}"
    )
    moves, typing = asyncio.run(ui.key_latency())
    print(
        f"(d) key press on 2,000 modules: cursor down {statistics.median(moves) * 1e3:.1f} ms, "
        f"search keystroke {statistics.median(typing) * 1e3:.1f} ms (medians of {len(moves)}; "
        f"p90 {np.percentile(moves, 90) * 1e3:.1f} / {np.percentile(typing, 90) * 1e3:.1f} ms)"
    )


if __name__ == "__main__":
    main()
