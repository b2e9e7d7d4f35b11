"""A numpy-only Source with a small, fixed debugging scene, for transport and UI tests.

It behaves like a paused training that hit a NaN at ``net.2`` (a Linear whose weight holds a NaN),
so every request of the Source interface has something real to return, without torch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from tensordbg.sources.contract import (
    EVERY_REQUEST,
    Control,
    EventCallback,
    Found,
    Histogram,
    Hit,
    Info,
    Module,
    Provenance,
    Recheck,
    Rule,
    Rules,
    Slice,
    SourceError,
    Stats,
    Tensor,
)
from tensordbg.sources.replay import next_nonfinite_array
from tensordbg.sources.slicing import (
    SliceError,
    apply_index,
    clamp_window,
    format_index,
    found,
    parse_index,
    window_of,
)
from tensordbg.statistics import summarize_numpy
from tensordbg.transport.wire import WireArray

MAX_WINDOW = 4_000_000


class FakeSource:
    """A paused three-layer network with one origin NaN hit and one passed-on hit.

    ``capabilities`` narrows the requests it serves: ``FakeSource(capabilities=READ_ONLY)`` stands
    for a recorded run, which cannot be driven.
    """

    def __init__(
        self,
        big: int = 1000,
        modules: int = 0,
        capabilities: frozenset[str] = EVERY_REQUEST,
        report: dict[str, Any] | None = None,
        gpus: int = 0,
    ):
        self.capabilities = capabilities
        self.unjudged, self.unjudged_why = 0, ""  # what a recheck could not judge
        # Profiling: the stored report (a ProfileReport's dict), the steps asked for, and
        # ``gpus`` fake devices whose NVML samples ``gpu()`` serves (none: NVML unavailable).
        self.stored_profile = report
        """What ``profile_report`` answers (a test sets a report dict)."""
        self.profiles: list[int] = []
        self.profiled_shapes: list[bool] = []  # record_shapes of each profile request
        self.gpus = gpus
        self.gpu_requests: list[float] = []
        self._gpu_clock = 0.0
        rng = np.random.default_rng(0)
        x = rng.standard_normal((8, 16)).astype(np.float32)
        h0 = rng.standard_normal((8, 32)).astype(np.float32)
        h1 = np.maximum(h0, 0)
        h2 = rng.standard_normal((8, 4)).astype(np.float32)
        h2[1, 2] = np.nan
        h2[5, 0] = np.nan
        self.arrays: dict[int, tuple[str, str, str, np.ndarray]] = {
            0: ("input[0]", "", "input", x),
            1: ("net.0.output", "net.0", "output", h0),
            2: ("net.1.output", "net.1", "output", h1),
            3: ("net.2.output", "net.2", "output", h2),
            4: ("output", "", "output", h2),
            5: ("big.output", "big", "output", rng.standard_normal((big, big)).astype(np.float32)),
        }
        self.module_list = [
            {"path": "", "type": "Net", "depth": 0, "params": 708},
            {"path": "net", "type": "Sequential", "depth": 1, "params": 708},
            {"path": "net.0", "type": "Linear", "depth": 2, "params": 544},
            {"path": "net.1", "type": "ReLU", "depth": 2, "params": 0},
            {"path": "net.2", "type": "Linear", "depth": 2, "params": 132},
            {"path": "big", "type": "Identity", "depth": 1, "params": 0},
        ]
        for i in range(modules):
            self.module_list.append(
                {"path": f"extra.{i}", "type": "Linear", "depth": 2, "params": 16}
            )
        self._hits = [
            self._hit(0, "NaN", 3, origin=True, value=2.0),
            self._hit(1, "NaN", 4, origin=False, value=2.0),
        ]
        self._rules = [
            {"id": 0, "name": "NaN", "enabled": True, "params": {}, "doc": "Any NaN."},
            {
                "id": 1,
                "name": "VanishingGradient",
                "enabled": True,
                "params": {"threshold": 1e-7},
                "doc": "Mean |grad| below a threshold.",
            },
        ]
        for r in self._rules:
            r.update(match=["*"], exclude=[], kinds=["grad"], disabled_reason=None, hits=0)
        self.state = "paused"
        self.paused_at: Hit | None = self._hits[0]  # None when paused by p or s
        self.step = 3
        self.controls: list[tuple[str, int]] = []
        self._subscribers: list[EventCallback] = []
        self._lock = threading.Lock()

    def _hit(self, id: int, rule: str, ref: int, origin: bool, value: float) -> Hit:
        name, module, kind, array = self.arrays[ref]
        where = "produced here: its inputs were finite" if origin else "passed on from net.2"
        return {
            "id": id,
            "rule": rule,
            "tensor": name,
            "module": module,
            "kind": kind,
            "step": 3,
            "phase": "forward",
            "origin": origin,
            "value": value,
            "threshold": 0.0,
            "message": f"{name} holds 2 NaN of {array.size} values at step 3 ({where}).",
            "ref": ref,
            "call": 0,
            "summary": summarize_numpy(array).as_dict(),
        }

    # --- Source ------------------------------------------------------------------------------

    def info(self) -> Info:
        return {
            "run_id": "fake0001",
            "rank": 0,
            "pid": 1,
            "script": "fake.py",
            "model": "Net",
            "device": "cpu",
            "torch": "none",
            "live": True,
            "state": self.state,
            "step": self.step,
            "phase": "forward",
            "on_hit": "pause",
            "sync": "eager",
            "paused_at": self.paused_at if self.state == "paused" else None,
            "pause_reason": self._pause_reason(),
            "hits_total": len(self._hits),
            "retain_bytes": 1 << 28,
            "history": {
                "step": [0, 1, 2, 3],
                "loss": [2.3, 2.1, 1.9, None],
                "grad_norm": [1.0, 1.2, 0.9, None],
                "steps_per_sec": [10.0, 11.0, 10.5, None],
            },
        }

    def _pause_reason(self) -> str:
        if self.state != "paused":
            return ""
        return "hit" if self.paused_at else "pause"

    def modules(self) -> list[Module]:
        out = []
        for m in self.module_list:
            stats = {}
            for _, module, kind, array in self.arrays.values():
                if module == m["path"] and kind == "output":
                    stats["output"] = summarize_numpy(array).as_dict()
            hits = sum(h["module"] == m["path"] for h in self._hits)
            out.append({**m, "hits": hits, "calls": 1, "stats": stats})
        return out

    def hits(self, since: int = 0) -> list[Hit]:
        return [h for h in self._hits if h["id"] >= since]

    def tensors(self) -> list[Tensor]:
        return [
            {
                "ref": ref,
                "name": name,
                "module": module,
                "kind": kind,
                "call": 0,
                "shape": list(a.shape),
                "dtype": "float32",
                "retained": True,
                "summary": summarize_numpy(a).as_dict(),
                "passed_up": ["net"] if name == "net.2.output" else [],  # Sequential returned it
            }
            for ref, (name, module, kind, a) in self.arrays.items()
        ]

    def _view(self, ref: int, text: str) -> tuple[str, np.ndarray]:
        if ref not in self.arrays:
            raise SourceError(f"no tensor {ref} in this phase")
        try:
            index = parse_index(text)
            return format_index(index), np.asarray(apply_index(self.arrays[ref][3], index))
        except SliceError as e:
            raise SourceError(str(e)) from None

    def stats(self, ref: int, text: str = "") -> Stats:
        index, view = self._view(ref, text)
        summary = summarize_numpy(view)
        return {
            "ref": ref,
            "name": self.arrays[ref][0],
            "step": self.step,
            "index": index,
            "shape": list(view.shape),
            "dtype": "float32",
            "summary": summary.as_dict(),
            "line": summary.line(view.shape, "float32"),
            "previous": {"step": 2, "summary": summarize_numpy(view * 0.5).as_dict()},
        }

    def slice(self, ref: int, text: str = "", window: list[list[int]] | None = None) -> Slice:
        index, view = self._view(ref, text)
        try:
            rows, cols = clamp_window(view.shape, window, MAX_WINDOW)
        except SliceError as e:
            raise SourceError(str(e)) from None
        block = np.ascontiguousarray(window_of(view, rows, cols))
        grid = block.shape
        return {
            "ref": ref,
            "index": index,
            "shape": list(view.shape),
            "rows": int(np.prod(view.shape[:-1])) if view.ndim > 1 else 1,
            "cols": int(view.shape[-1]) if view.ndim else 1,
            "window": [list(rows), list(cols)],
            "dtype": "float32",
            "data": WireArray("float32", tuple(grid), block),
        }

    def find(self, ref: int, text: str = "", after: int = -1) -> Found:
        index, view = self._view(ref, text)
        return found(ref, index, tuple(view.shape), next_nonfinite_array(view, after))

    def histogram(
        self,
        ref: int,
        text: str = "",
        bins: int = 64,
        lo: float | None = None,
        hi: float | None = None,
    ) -> Histogram:
        index, view = self._view(ref, text)
        finite = view[np.isfinite(view)]
        rng = (
            lo if lo is not None else float(finite.min()),
            hi if hi is not None else float(finite.max()),
        )
        counts, edges = np.histogram(finite, bins=bins, range=rng)
        return {
            "ref": ref,
            "index": index,
            "edges": edges.tolist(),
            "counts": counts.tolist(),
            "nan": int(np.isnan(view).sum()),
            "posinf": int(np.isposinf(view).sum()),
            "neginf": int(np.isneginf(view).sum()),
            "min": rng[0],
            "max": rng[1],
        }

    def provenance(self, ref: int, module: str | None = None, call: int = 0) -> Provenance:
        if ref not in self.arrays:
            raise SourceError(f"no tensor {ref} in this phase")
        name, module, kind, _ = self.arrays[ref]
        inputs = []
        if ref in (1, 2, 3):
            prev = self.arrays[ref - 1]
            inputs.append(
                {
                    "ref": ref - 1,
                    "name": prev[0],
                    "module": prev[1],
                    "shape": list(prev[3].shape),
                    "dtype": "float32",
                    "line": summarize_numpy(prev[3]).line(prev[3].shape, "float32"),
                    "nonfinite": False,
                    **({"made_by": "the batch"} if not prev[1] else {}),  # the model's input
                }
            )
        return {
            "ref": ref,
            "name": name,
            "kind": kind,
            "step": self.step,
            "producer": {"module": module, "type": "Linear", "call": 0},
            "returned_by": None,
            "inputs": inputs,
            "consumers": [{"module": "", "type": "Net", "call": 0}],
            "source": {
                "file": "fake.py",
                "line": 12,
                "function": "forward",
                "context": [
                    [10, "    def forward(self, x):"],
                    [11, "        h = self.net[1](self.net[0](x))"],
                    [12, "        return self.net[2](h)"],
                ],
            },
            "stack": [["train.py", 40, "<module>"], ["fake.py", 12, "forward"]],
        }

    def rules(self) -> Rules:
        return {
            "rules": self._rules,
            "available": [
                {
                    "name": "TensorRange",
                    "doc": "Bounds on matching tensors.",
                    "params": {"max_gt": None},
                }
            ],
        }

    def set_rule(
        self, id: int, enabled: bool | None = None, params: dict[str, Any] | None = None
    ) -> Rule:
        if not 0 <= id < len(self._rules):
            raise SourceError(f"no rule {id}")
        rule = self._rules[id]
        if enabled is not None:
            rule["enabled"] = enabled
        for key, value in (params or {}).items():
            if key == "exclude":
                rule["exclude"] = list(value)
                continue
            if key not in rule["params"]:
                raise SourceError(f"{rule['name']} has no threshold {key!r}")
            rule["params"][key] = value
        return rule

    def add_rule(self, name: str, match: str = "*", params: dict[str, Any] | None = None) -> Rule:
        rule = {
            "id": len(self._rules),
            "name": name,
            "enabled": True,
            "params": params or {},
            "doc": "",
            "match": [match],
            "exclude": [],
            "kinds": ["output"],
            "disabled_reason": None,
            "hits": 0,
        }
        self._rules.append(rule)
        return rule

    def recheck(self) -> Recheck:
        return {"at": "step 3, forward", "hits": self._hits[:1], "unjudged": self.unjudged,
                "why": self.unjudged_why}  # fmt: skip

    def control(self, action: str, n: int = 1) -> Control:
        if action not in ("continue", "next", "step", "pause", "detach", "skip"):
            raise SourceError(f"unknown action {action!r}")
        self.controls.append((action, n))
        if action == "skip":  # as the live session: marked, and still paused
            return {"state": self.state, "step": self.step}
        self.state = {"pause": "paused", "detach": "detached"}.get(action, "running")
        self.paused_at = None
        self.emit("state", {"state": self.state, "step": self.step})
        return {"state": self.state, "step": self.step}

    def profile(self, steps: int = 5, record_shapes: bool = False) -> dict[str, Any]:
        # As a live training: armed now, "running" comes at the next step (run_profile).
        if steps < 1:
            raise SourceError("steps is a number of training steps, at least 1")
        self.profiles.append(steps)
        self.profiled_shapes.append(record_shapes)
        return {"pending": True, "steps": steps}

    def profile_report(self) -> dict[str, Any] | None:
        return self.stored_profile

    def gpu(self, since: float = 0.0) -> dict[str, Any]:
        self.gpu_requests.append(since)
        if not self.gpus:
            return {
                "available": False,
                "reason": "NVML unavailable: libnvidia-ml.so.1 not found (no NVIDIA driver)",
                "devices": [],
                "samples": [],
                "events": [],
            }
        self._gpu_clock += 1.0  # one new sample a device each request
        t = self._gpu_clock
        samples = [
            {"t": t, "device": d, "util": 40.0 + 10 * d + t % 7, "mem_util": 20.0,
             "memory_used": (8 + d) << 30, "power_w": 210.5, "temp_c": 61.0,
             "sm_clock_mhz": 1980.0, "mem_clock_mhz": 2619.0, "pcie_tx_kbs": 1200.0,
             "pcie_rx_kbs": 53000.0}
            for d in range(self.gpus)
        ]  # fmt: skip
        events = [
            {"t": t, "device": 0, "kind": "xid", "detail": "Xid 79: GPU has fallen off the bus"}
        ]
        return {
            "available": True,
            "reason": None,
            "devices": [
                {"index": d, "name": "NVIDIA H100 80GB HBM3", "memory_total": 80 << 30}
                for d in range(self.gpus)
            ],
            "samples": [x for x in samples if x["t"] > since],
            "events": events if t == 2.0 else [],  # one XID on the second sample
        }

    def subscribe(self, callback: EventCallback) -> Callable[[], None]:
        with self._lock:
            self._subscribers.append(callback)

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._subscribers:
                    self._subscribers.remove(callback)

        return unsubscribe

    # --- test helpers ---------------------------------------------------------------------

    def pause_on_hit(self) -> Hit:
        """The running training stops on a new NaN hit in net.2, one step later."""
        self.step += 1
        hit = self._hit(len(self._hits) + 1, "NaN", 3, True, 2.0)
        hit.update(step=self.step, message=f"net.2.output holds 2 NaN at step {self.step}.")
        self._hits.append(hit)
        self.state, self.paused_at = "paused", hit
        self.emit("hit", hit)
        self.emit("state", {"state": "paused", "step": self.step})
        return hit

    def run_profile(self, report: dict[str, Any], steps: int = 5) -> None:
        """The training profiles ``steps`` steps (the ``profile`` events a live training sends
        when the profile starts and ends), then holds ``report``."""
        first = self.step + 1
        message = f"profiling steps {first}..{self.step + steps} after the warm-up step {self.step}"
        self.emit("profile", {"state": "running", "step": self.step, "steps": steps,
                              "message": message})  # fmt: skip
        self.step += steps + 1
        self.stored_profile = report
        self.emit("profile", {"state": "done", "step": self.step, "steps": steps,
                              "message": f"{steps} steps profiled"})  # fmt: skip

    def emit(self, event: str, payload: dict[str, Any]) -> None:
        with self._lock:
            subscribers = list(self._subscribers)
        for callback in subscribers:
            callback(event, payload)
