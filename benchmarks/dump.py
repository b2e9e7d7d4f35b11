"""What dumps cost: writing, reading a slice of a huge dump, and a periodic dump's step cost.

    python benchmarks/dump.py                 # all of it (about a minute on a quiet machine)
    python benchmarks/dump.py --only write    # one measurement: write, slice, step, or check
    python benchmarks/dump.py --only step --device cuda   # the step cost on GPT-2 small, bf16

Each measurement prints its ratio against its baseline, both measured in this run (medians of
rounds, taken alternately so that the machine's noise falls on both). Targets:

- write: DumpWriter throughput at least 0.5x a plain sequential write of the same bytes (both
  fsynced: a dump's file must be on disk before the index names it);
- slice: opening a 2 GB dump and reading a 1 MB slice under 200 ms (the file is in the page
  cache after writing it; a cold read adds one disk seek);
- step: ``dump_every=1`` statistics-only within 1.02x of the same session without dumps, on
  benchmarks/overhead.py's CPU model.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from overhead import CONFIGS, GPT, Runner, machine

import tensordbg
from tensordbg.dump.writer import DumpWriter


def _median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


def bench_write(rounds: int) -> None:
    """DumpWriter.write_step of 64 tensors (256 MiB) against writing their bytes to one file."""
    rng = np.random.default_rng(0)
    arrays = {f"layers.{i}.output": rng.standard_normal(2**20, dtype=np.float32) for i in range(64)}
    entries = [{"name": n, "shape": list(a.shape), "dtype": "float32", "stats": {}}
               for n, a in arrays.items()]  # fmt: skip
    total = sum(a.nbytes for a in arrays.values())
    dump_times, plain_times = [], []
    with tempfile.TemporaryDirectory() as tmp:
        writer = DumpWriter(Path(tmp) / "dump", {})
        for step in range(rounds):
            start = time.perf_counter()
            with open(Path(tmp) / "plain.bin", "wb") as f:
                for a in arrays.values():
                    f.write(memoryview(a))
                f.flush()
                os.fsync(f.fileno())
            plain_times.append(time.perf_counter() - start)
            os.unlink(Path(tmp) / "plain.bin")
            start = time.perf_counter()
            writer.write_step(step, 0, entries, arrays, [])
            dump_times.append(time.perf_counter() - start)
            os.unlink(Path(tmp) / "dump" / "rank-0" / f"step-{step:08d}.safetensors")
        writer.close()
    plain, dump = statistics.median(plain_times), statistics.median(dump_times)
    mb = total / 2**20
    print(f"write  {mb:.0f} MiB: plain {mb / plain:7.0f} MiB/s   dump {mb / dump:7.0f} MiB/s   "
          f"ratio {plain / dump:.2f}x  (target >= 0.5x, {rounds} rounds)")  # fmt: skip


def bench_slice(rounds: int) -> None:
    """Open a dump holding one 2 GiB tensor and read a 1 MiB slice of it."""
    big = np.zeros((2**16, 2**13), dtype=np.float32)  # 2 GiB, untouched pages: no memory used
    with tempfile.TemporaryDirectory() as tmp:
        writer = DumpWriter(tmp, {})
        writer.write_step(0, 0, [{"name": "huge", "shape": list(big.shape), "dtype": "float32",
                                  "stats": {}}], {"huge": big}, [])  # fmt: skip
        writer.close()
        del big
        times = []
        for i in range(rounds):
            start = time.perf_counter()
            dump = tensordbg.load(tmp)
            row = (i * 7919) % (2**16 - 32)
            block = np.array(dump.tensor("huge").value(0)[row : row + 32])  # 32 x 8192 x 4 B
            times.append(time.perf_counter() - start)
            assert block.nbytes == 2**20
            del dump, block
    print(f"slice  open a 2 GiB dump, read 1 MiB: {_median_ms(times):7.2f} ms   "
          f"(target < 200 ms, {rounds} rounds, page cache warm)")  # fmt: skip


def bench_step(rounds: int, device: str = "cpu") -> None:
    """dump_every=1, statistics only, against the same attached session without dumps; on CUDA
    also dump_every=1 with the values of every weight (``dump_tensors=["*.weight"]``), whose
    device-to-host copies are the only part the training thread waits for."""
    import torch

    name = "gpt2-small" if device == "cuda" else "encoder-256"
    dtype = torch.bfloat16 if device == "cuda" else None
    vocab, seq, dim, layers, heads, batch = CONFIGS[name]
    torch.manual_seed(0)
    base = GPT(vocab, seq, dim, layers, heads).to(device)
    variants = [("attached", {}), ("dump", {"dump_every": 1})]
    if device == "cuda":
        variants.append(("dump+weights", {"dump_every": 1, "dump_tensors": ["*.weight"]}))
    with tempfile.TemporaryDirectory() as tmp:
        runners = []
        for label, extra in variants:
            runner = Runner(label, copy.deepcopy(base), device, dtype)
            if extra:
                extra = {**extra, "dump_dir": os.path.join(tmp, label)}
            runner.session = tensordbg.attach(runner.model, optimizer=runner.optimizer,
                                              on_hit="record", server=False, **extra)  # fmt: skip
            runners.append(runner)
        g = torch.Generator().manual_seed(0)
        batches = [torch.randint(0, vocab, (batch, seq + 1), generator=g).to(device)
                   for _ in range(4)]  # fmt: skip
        for i in range(3):
            for runner in runners:
                runner.step(batches[i % 4])
        for i in range(rounds):
            shift = i % len(runners)
            for runner in runners[shift:] + runners[:shift]:
                runner.times.append(runner.step(batches[i % 4]))
        for runner in runners:
            runner.session.detach()
        steps = len(tensordbg.load(os.path.join(tmp, "dump")).steps())
    attached = runners[0]
    print(f"step ({name} on {device}, {rounds} rounds, {steps} steps dumped; target <= 1.02x)")
    for runner in runners:
        ratios = sorted(d / a for d, a in zip(runner.times, attached.times, strict=True))
        print(f"  {runner.name:<13} {_median_ms(runner.times):8.1f} ms   ratio "
              f"{statistics.median(ratios):.3f}x  (IQR {ratios[len(ratios) // 4]:.3f}-"
              f"{ratios[3 * len(ratios) // 4]:.3f})")  # fmt: skip


def bench_check(rounds: int, steps: int = 1000, tensors: int = 64) -> None:
    """tensordbg check (open the dump, judge it with the default rules) over ``steps`` dumped
    steps of statistics only, ``tensors`` watched tensors a step (outputs, gradients and
    parameters of a 16-layer model), every statistic the default rules read."""
    from tensordbg.offline.check import check_dump
    from tensordbg.statistics import (
        ABS_MEAN,
        FINITE,
        L2,
        MAX,
        MEAN,
        MIN,
        NAN,
        NEGINF,
        POSINF,
        ZERO_FRAC,
    )

    kinds = ("output", "grad_output", "grad", "param")
    names = [(f"layers.{i // 4}", kinds[i % 4]) for i in range(tensors)]
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        writer = DumpWriter(Path(tmp) / "dump", {"rules": []})
        for step in range(steps):
            entries = []
            for name, kind in names:
                x = rng.standard_normal(4)
                stats = {str(s): float(v) for s, v in zip(
                    (FINITE, MIN, MAX, NAN, POSINF, NEGINF, MEAN, ABS_MEAN, L2, ZERO_FRAC),
                    (1.0, x.min(), x.max(), 0, 0, 0, x.mean(), abs(x).mean(), 100 + x[0], 0.0),
                    strict=True)}  # fmt: skip
                phase = {"output": "forward", "param": "optimizer"}.get(kind, "backward")
                entries.append({"name": f"{name}.{kind}", "module": name.rsplit(".", 1)[0],
                                "phase": phase, "kind": kind, "shape": [256, 256],
                                "dtype": "float32", "stats": stats})  # fmt: skip
            writer.write_step(step, 0, entries, {}, [])
        writer.close()
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            report = check_dump(tensordbg.load(Path(tmp) / "dump"))
            times.append(time.perf_counter() - start)
    print(f"check  {steps} steps x {tensors} tensors of statistics: {_median_ms(times):7.0f} ms "
          f"(min {min(times) * 1e3:.0f} ms, {rounds} rounds, target < 2000 ms; "
          f"{len(report.findings)} findings)")  # fmt: skip


# --- the measurements, by name ------------------------------------------------------------------
BENCHMARKS: dict[str, Callable[[int], None]] = {
    "write": bench_write,
    "slice": bench_slice,
    "step": bench_step,
    "check": bench_check,
}
ROUNDS = {"write": 5, "slice": 9, "step": 40, "check": 3}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=sorted(BENCHMARKS), action="append")
    parser.add_argument("--rounds", type=int, help="rounds of each measurement")
    parser.add_argument(
        "--device", default="cpu", choices=("cpu", "cuda"), help="the step's (cuda: GPT-2 small)"
    )
    args = parser.parse_args(argv)
    print(f"tensordbg dumps; machine: {machine()}")
    for name in args.only or BENCHMARKS:
        if name == "step":
            bench_step(args.rounds or ROUNDS[name], args.device)
        else:
            BENCHMARKS[name](args.rounds or ROUNDS[name])
    return 0


if __name__ == "__main__":
    sys.exit(main())
