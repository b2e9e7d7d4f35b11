"""Profile reports as the training sends them (the dict form of ``ProfileReport``), for the UI's
tests: a CPU training's, a CUDA training's, and a big one (20,000 timeline spans, 2,000 operators)
that the tabs must draw without freezing. Deterministic: the same call gives the same report.
"""

from __future__ import annotations

import random
from typing import Any

MS = 1e-3
MIB = 1 << 20


def _breakdown(steps: list[int], parts: dict[str, float], jitter: float) -> list[dict[str, Any]]:
    rows = []
    for n, step in enumerate(steps):
        row: dict[str, Any] = {"step": step}
        for name, seconds in parts.items():
            row[name] = seconds * (1 + jitter * ((n * 7) % 5 - 2) / 2)
        row["total"] = sum(v for k, v in row.items() if k != "step")
        rows.append(row)
    return rows


def _timeline(lanes: list[str], per_lane: int, end: float, seed: int) -> dict[str, Any]:
    """Spans that nest as a profiler's do: each top span holds up to two children."""
    rng = random.Random(seed)
    names = ("aten::linear", "aten::addmm", "aten::relu", "aten::mse_loss", "Optimizer.step")
    out = []
    for lane in lanes:
        spans: list[list[Any]] = []
        t = 0.0
        slot = end / per_lane * 3
        while len(spans) < per_lane and t < end:
            dur = slot * rng.uniform(0.3, 0.9)
            spans.append([t, dur, rng.choice(names)])
            if len(spans) < per_lane:
                spans.append([t + dur * 0.1, dur * 0.5, "aten::addmm"])
            if len(spans) < per_lane:
                spans.append([t + dur * 0.65, dur * 0.3, "aten::t"])
            t += slot
        out.append({"name": lane, "spans": spans})
    return {"start": 0.0, "end": end, "lanes": out}


def cpu_report() -> dict[str, Any]:
    """Five steps of a small MLP on the CPU with a slow Dataset: DataLoader takes a third."""
    steps = [2, 3, 4, 5, 6]
    breakdown = _breakdown(
        steps,
        {"DataLoader": 4 * MS, "forward": 3 * MS, "backward": 4 * MS, "optimizer": 1 * MS,
         "other": 0.5 * MS},
        jitter=0.1,
    )  # fmt: skip
    breakdown[3]["DataLoader"] += 20 * MS  # an outlier step
    breakdown[3]["total"] += 20 * MS
    operators = [
        {"name": "aten::addmm", "calls": 15, "self_cpu": 6.1 * MS, "total_cpu": 7.0 * MS,
         "self_device": 0.0, "total_device": 0.0, "input_shapes": "[[64], [32, 128], [128, 64]]",
         "flops": 1_310_720},
        {"name": "aten::addmm", "calls": 5, "self_cpu": 1.2 * MS, "total_cpu": 1.4 * MS,
         "self_device": 0.0, "total_device": 0.0, "input_shapes": "[[10], [32, 64], [64, 10]]",
         "flops": 40_960},
        {"name": "aten::relu", "calls": 10, "self_cpu": 0.9 * MS, "total_cpu": 1.1 * MS,
         "self_device": 0.0, "total_device": 0.0, "input_shapes": "[[32, 64]]", "flops": None},
        {"name": "aten::mse_loss", "calls": 5, "self_cpu": 0.4 * MS, "total_cpu": 0.6 * MS,
         "self_device": 0.0, "total_device": 0.0, "input_shapes": "[[32, 10], [32, 10]]",
         "flops": None},
        {"name": "Optimizer.step#SGD.step", "calls": 5, "self_cpu": 0.3 * MS,
         "total_cpu": 2.1 * MS, "self_device": 0.0, "total_device": 0.0, "input_shapes": None,
         "flops": None},
    ]  # fmt: skip
    curve = [[i * 0.001, (4 + (i % 12)) * MIB, None] for i in range(60)]
    return {
        "version": 1,
        "device": "cpu",
        "steps": steps,
        "breakdown": breakdown,
        "operators": operators,
        "kernels": [],
        "kernels_note": "profiled on the CPU: no kernels",
        "memory": {
            "curve": curve,
            "peak_allocated": 15 * MIB,
            "peak_reserved": None,
            "limit": None,
            "top_operators": [
                {"name": "aten::addmm", "bytes": 42 * MIB, "calls": 20},
                {"name": "aten::relu", "bytes": 10 * MIB, "calls": 10},
                {"name": "aten::empty", "bytes": 3 * MIB, "calls": 40},
            ],
        },
        "timeline": _timeline(["thread 4242 (main)", "thread 4250"], 60, 0.1, seed=1),
        "outliers": [
            {
                "step": 5,
                "total": breakdown[3]["total"],
                "median": 12.5 * MS,
                "ratio": breakdown[3]["total"] / (12.5 * MS),
            }
        ],
        "advice": [
            {
                "rule": "DataLoaderShare",
                "evidence": "DataLoader 36.4 % of the step time (threshold 5 %)",
                "message": "Load batches in parallel: DataLoader(num_workers=4, pin_memory=True).",
                "value": 0.364,
                "threshold": 0.05,
            },
            {
                "rule": "StepOutlier",
                "evidence": "step 5 took 32.6 ms, 2.6x the median 12.5 ms (threshold 3 sigma)",
                "message": "Look at what step 5 did differently (its batch, a checkpoint, GC).",
                "value": 2.6,
                "threshold": 3.0,
            },
        ],
        "trace": "/tmp/tensordbg/trace-run1.json.gz",
        "memory_snapshot": None,
        "paused_seconds": 0.0,
        "gpu_summary": None,
        "host": {"threads": 2},
        "message": "",
    }


def cuda_report() -> dict[str, Any]:
    """Five steps of a transformer on a GPU, with kernels, a memory limit and NVML-era numbers."""
    steps = [10, 11, 12, 13, 14]
    breakdown = _breakdown(
        steps,
        {"DataLoader": 1 * MS, "forward": 0.5 * MS, "backward": 0.6 * MS, "optimizer": 0.2 * MS,
         "kernel": 18 * MS, "memcpy": 2 * MS, "memset": 0.1 * MS, "runtime": 1.5 * MS,
         "communication": 0.0, "other": 0.8 * MS},
        jitter=0.05,
    )  # fmt: skip
    operators = [
        {"name": "aten::mm", "calls": 240, "self_cpu": 2.4 * MS, "total_cpu": 3.0 * MS,
         "self_device": 40 * MS, "total_device": 40 * MS, "input_shapes": None,
         "flops": 12_884_901_888},
        {"name": "aten::_scaled_dot_product_flash_attention", "calls": 40, "self_cpu": 0.8 * MS,
         "total_cpu": 1.0 * MS, "self_device": 20 * MS, "total_device": 20 * MS,
         "input_shapes": None, "flops": None},
        {"name": "aten::copy_", "calls": 20, "self_cpu": 0.5 * MS, "total_cpu": 0.5 * MS,
         "self_device": 9 * MS, "total_device": 9 * MS, "input_shapes": None, "flops": None},
    ]  # fmt: skip
    kernels = [
        {"name": "sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize128x128x8", "calls": 240,
         "total": 38 * MS, "mean": 38 * MS / 240, "max": 0.4 * MS, "tensor_core": False},
        {"name": "flash_fwd_kernel", "calls": 40, "total": 20 * MS, "mean": 0.5 * MS,
         "max": 0.6 * MS, "tensor_core": True},
        {"name": "Memcpy HtoD (Pageable -> Device)", "calls": 20, "total": 9 * MS,
         "mean": 0.45 * MS, "max": 0.5 * MS, "tensor_core": None},
    ]  # fmt: skip
    gib = 1 << 30
    curve = [[i * 0.01, (20 + 50 * (i % 25) / 25) * gib / 100 * 70, 60 * gib] for i in range(200)]
    report = cpu_report()
    report.update(
        device="cuda:0",
        steps=steps,
        breakdown=breakdown,
        operators=operators,
        kernels=kernels,
        kernels_note=None,
        memory={
            "curve": curve,
            "peak_allocated": 49 * gib,
            "peak_reserved": 60 * gib,
            "limit": 80 * gib,
            "top_operators": [{"name": "aten::mm", "bytes": 30 * gib, "calls": 240}],
        },
        timeline=_timeline(["thread 99 (main)", "stream 7", "stream 13"], 90, 0.12, seed=2),
        outliers=[],
        advice=[
            {
                "rule": "TensorCores",
                "evidence": "0 % of 38.0 ms of matrix kernels ran on Tensor Cores (fp32 GEMMs)",
                "message": "Train in bf16 with torch.autocast('cuda', dtype=torch.bfloat16).",
                "value": 0.0,
                "threshold": 0.5,
            }
        ],
        memory_snapshot="/tmp/tensordbg/memory-run1.pickle",
    )
    return report


def big_report(spans: int = 20_000, operators: int = 2_000) -> dict[str, Any]:
    """A report at the bounds the engine keeps: ``spans`` timeline spans, ``operators`` rows."""
    report = cpu_report()
    lanes = ["thread 1 (main)", "thread 2", "thread 3", "thread 4"]
    report["timeline"] = _timeline(lanes, spans // len(lanes), 2.0, seed=3)
    report["operators"] = [
        {
            "name": f"aten::op_{i}",
            "calls": 1 + i % 17,
            "self_cpu": (operators - i) * 1e-6,
            "total_cpu": (operators - i) * 2e-6,
            "self_device": 0.0,
            "total_device": 0.0,
            "input_shapes": f"[[{1 + i % 7}, 64]]",
            "flops": None,
        }
        for i in range(operators)
    ]
    return report


def sleepy_report() -> dict[str, Any]:
    """Five steps of 65 ms that mostly sleep: each loads its batch and runs forward, backward
    and the optimizer in the last 5 ms, an operator inside each phase. At zoom ×1 on 80 columns
    a cell is about 6 ms: every phase is narrower than a cell."""
    report = cpu_report()
    step = 65 * MS
    phases = {
        "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__": 1.0 * MS,
        "tensordbg: forward": 1.5 * MS,
        "tensordbg: backward": 1.2 * MS,
        "Optimizer.step#Adam.step": 1.3 * MS,
    }
    spans: list[list[Any]] = []
    for n in range(5):
        spans.append([n * step, step, f"step {616 + n}"])
        t = (n + 1) * step - 6 * MS
        for name, duration in phases.items():
            spans.append([t, duration, name])
            spans.append([t + 0.1 * MS, duration / 2, "aten::addmm"])
            t += duration
    lane = {"name": "thread 12581 (main)", "spans": spans}
    report["timeline"] = {"start": 0.0, "end": 5 * step, "lanes": [lane]}
    return report
