"""Synthetic dumps for the offline tools' tests, written with the torch-free DumpWriter.

``write_dump(path)`` records a three-layer network for a few steps: the batch, each layer's
output, the loss, two parameter gradients and two parameters, with the statistics the engine
computes and, where asked, the values. A NaN can be planted in ``net.2.output`` at one step,
and one element of any tensor changed, so a test knows exactly what a tool must find.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from tensordbg.dump.writer import DumpWriter
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
    compute_numpy,
)

STATS = (FINITE, MIN, MAX, NAN, POSINF, NEGINF, MEAN, ABS_MEAN, L2, ZERO_FRAC)
MODULES = [
    {"path": "", "type": "Net", "depth": 0, "params": 676},
    {"path": "net", "type": "Sequential", "depth": 1, "params": 676},
    {"path": "net.0", "type": "Linear", "depth": 2, "params": 544},
    {"path": "net.1", "type": "ReLU", "depth": 2, "params": 0},
    {"path": "net.2", "type": "Linear", "depth": 2, "params": 132},
]
RULES = [{"name": "NaN"}, {"name": "Overflow"}, {"name": "ExplodingGradient"}]


def step_tensors(step: int, nan_at: int | None = None) -> list[tuple[dict[str, Any], np.ndarray]]:
    """The watched tensors of one step in execution order: (entry without stats, value)."""
    rng = np.random.default_rng(1000 + step)
    x = rng.standard_normal((8, 16)).astype(np.float32)
    w0 = rng.standard_normal((32, 16)).astype(np.float32) * 0.25
    w2 = rng.standard_normal((4, 32)).astype(np.float32) * 0.25
    h0 = x @ w0.T
    h1 = np.maximum(h0, 0)
    h2 = h1 @ w2.T
    if step == nan_at:
        h2[1, 2] = np.nan
    loss = np.array(np.mean(h2**2), dtype=np.float32)
    g2 = rng.standard_normal((4, 32)).astype(np.float32) * 0.1
    g0 = rng.standard_normal((32, 16)).astype(np.float32) * 0.1

    def entry(name: str, module: str, kind: str, phase: str, mtype: str) -> dict[str, Any]:
        return {"name": name, "module": module, "kind": kind, "phase": phase,
                "module_type": mtype}  # fmt: skip

    return [
        (entry("input[0]", "", "input", "forward", "Net"), x),
        (entry("net.0.output", "net.0", "output", "forward", "Linear"), h0),
        (entry("net.1.output", "net.1", "output", "forward", "ReLU"), h1),
        (entry("net.2.output", "net.2", "output", "forward", "Linear"), h2),
        (entry("loss", "", "observed", "forward", ""), loss),
        (entry("net.2.weight.grad", "net.2", "grad", "backward", "Linear"), g2),
        (entry("net.0.weight.grad", "net.0", "grad", "backward", "Linear"), g0),
        (entry("net.0.weight", "net.0", "param", "optimizer", "Linear"), w0),
        (entry("net.2.weight", "net.2", "param", "optimizer", "Linear"), w2),
    ]


def write_dump(
    path: Path,
    steps: Iterable[int] = range(6),
    *,
    nan_at: int | None = 3,
    values: bool | Iterable[int] = True,
    change: tuple[int, str, tuple[int, ...], float] | None = None,
    stats: tuple[Any, ...] = STATS,
    run_id: str = "replay01",
    rules: list[dict[str, Any]] | None = None,
    sync: str = "deferred",
    updates_at: Iterable[int] = (),
    named: tuple[str, str] | tuple[str, str, str] | None = None,
) -> Path:
    """A dump of ``steps`` at ``path``; ``values`` keeps values (of every step, or of those
    listed); ``change=(step, name, index, delta)`` adds ``delta`` to one element;
    ``updates_at`` lists the steps that record the weights' updates too (as batched checks do
    every step, and deferred ones after a step that hit); ``named=(tensor, module[, kind])``
    makes the hit name the call whose own code made the NaN (as it names the model's own
    forward, ``("output", "")``), the NaN being dumped under ``net.2.output``."""
    writer = DumpWriter(
        path,
        {
            "run_id": run_id,
            "argv": ["train.py", "--epochs", "1"],
            "torch_version": "2.13.0",
            "device": "cpu",
            "rules": RULES if rules is None else rules,
            "created": "2026-11-24T10:30:00+00:00",
            "sync": sync,
        },
    )
    keep = set(steps) if values is True else set() if values is False else set(values)
    updates_at = set(updates_at)
    for n, step in enumerate(steps):
        entries, arrays, hits = [], {}, []
        tensors = step_tensors(step, nan_at)
        if step in updates_at:
            tensors += [({**e, "name": f"{e['name']}.update", "kind": "update"}, v * 1e-3)
                        for e, v in tensors if e["kind"] == "param"]  # fmt: skip
        for entry, value in tensors:
            if change is not None and change[0] == step and change[1] == entry["name"]:
                value = value.copy()
                value[change[2]] += change[3]
            computed = compute_numpy(value, stats)
            entry.update(shape=list(value.shape), dtype=str(value.dtype),
                         stats={str(s): v for s, v in computed.items()})  # fmt: skip
            entries.append(entry)
            if step in keep:
                arrays[entry["name"]] = value
        if step == nan_at:
            hits.append(
                {
                    "rule": "NaN",
                    "tensor": "net.2.output",
                    "module": "net.2",
                    "kind": "output",
                    "step": step,
                    "phase": "forward",
                    "origin": True,
                    "value": 1.0,
                    "threshold": 0.0,
                    "message": f"net.2.output holds 1 NaN at step {step}.",
                    "id": 0,
                    "ref": 7,
                    "call": 0,
                    "summary": {"shape": [8, 4]},
                }
            )
            if named is not None:
                hits[-1].update(tensor=named[0], module=named[1], stored_as="net.2.output",
                                message=f"{named[0]} holds 1 NaN at step {step}.",
                                kind=named[2] if len(named) > 2 else hits[-1]["kind"])  # fmt: skip
        writer.write_step(step, 0, entries, arrays, hits, modules=MODULES if n == 0 else None)
    writer.close()
    return path


def weight_checked_twice(path: Path) -> None:
    """A dump whose step 6 checks fc.weight in the forward (one +Inf, the hit; its value not
    dumped) and again after the optimizer step (all NaN, the value dumped): two entries, one
    name."""
    after = np.full((2, 3), np.nan, dtype=np.float32)
    stats = {"forward": {"posinf": 1.0, "nan": 0.0, "min": 1.0, "max": np.inf},
             "optimizer": {"posinf": 0.0, "nan": 6.0}}  # fmt: skip
    entries = [{"name": "fc.weight", "module": "fc", "phase": phase, "kind": "param",
                "shape": [2, 3], "dtype": "float32", "stats": stats[phase]}
               for phase in ("forward", "optimizer")]  # fmt: skip
    hit = {"rule": "Overflow", "tensor": "fc.weight", "module": "fc", "kind": "param",
           "step": 6, "phase": "forward", "origin": True, "value": 1.0, "threshold": None,
           "id": 0, "call": 0,
           "message": "fc.weight holds 1 infinite value among 6 values"}  # fmt: skip
    writer = DumpWriter(path, {"run_id": "r1"})
    writer.write_step(6, 0, entries, {"fc.weight": after}, [hit])
    writer.close()
