"""A live training as a :class:`~Source`: what the server serves to the UI.

Cheap requests (hits, rules, the module tree with the latest statistics) are answered from
host-side state at any time. Requests that touch tensors (statistics of a slice, values, a
histogram) run on the training thread while it is paused, where the tensors and their CUDA
stream live; while the training runs they are refused with a sentence saying to pause first.
"""

from __future__ import annotations

import inspect
import linecache
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tensordbg.engine.capture import Call, Record
from tensordbg.engine.control import NotPaused
from tensordbg.engine.session import Session
from tensordbg.rules.base import Rule, available_rules
from tensordbg.sources.contract import EventCallback, SourceError
from tensordbg.sources.slicing import (
    SliceError,
    apply_index,
    clamp_window,
    format_index,
    grid_shape,
    parse_index,
    window_of,
)
from tensordbg.statistics import Summary, TensorStats
from tensordbg.statistics.torch_kernels import dtype_name, summarize
from tensordbg.transport.wire import DTYPES, MAX_REPLY_BYTES, WireArray

CONTEXT_LINES = 3
MAX_BINS = 1024
# Words that carry each dtype on the wire, as torch dtypes to .view() the tensor as.
_WIRE_VIEW = {"bfloat16": torch.int16, "float8_e4m3fn": torch.uint8, "float8_e4m3fnuz": torch.uint8,
              "float8_e5m2": torch.uint8, "float8_e5m2fnuz": torch.uint8}  # fmt: skip


class LiveSource:
    """Serves a :class:`~tensordbg.engine.session.Session` to the UI.

    >>> server = Server(LiveSource(session), run_id=session.run_id, rank=session.rank)
    """

    def __init__(self, session: Session):
        self.session = session
        self.started = time.time()
        # Summaries of tensors a person looked at, by name: (step, summary). Small, host-side.
        self._inspected: dict[str, tuple[int, dict[str, Any]]] = {}

    # --- at any time ---------------------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        s = self.session
        control = s.controller
        history = list(s.history)
        return {
            "run_id": s.run_id,
            "rank": s.rank,
            "pid": os.getpid(),
            "script": sys.argv[0] if sys.argv else "",
            "model": type(s.model).__name__,
            "device": str(s.device),
            "torch": torch.__version__,
            "live": True,
            "state": "finished" if s.detached else control.state,
            "step": s.step,
            "phase": s.phase,
            "on_hit": s.on_hit if isinstance(s.on_hit, str) else "callback",
            "sync": s.mode,
            "paused_at": control.paused_at.as_dict() if control.paused_at else None,
            "pause_reason": control.reason if control.state == "paused" else "",
            "hits_total": len(s.hits),
            "retain_bytes": s.retain_bytes,
            "started": self.started,
            "history": {
                "step": [h[0] for h in history],
                "loss": [h[1] for h in history],
                "grad_norm": [h[2] for h in history],
                "steps_per_sec": [h[3] for h in history],
            },
        }

    def modules(self) -> list[dict[str, Any]]:
        s = self.session
        latest: dict[str, dict[str, dict[str, Any]]] = {}
        for _, (_, stats) in list(s.latest.items()):
            if stats.module or stats.kind in ("input", "output", "grad_output", "grad_input"):
                latest.setdefault(stats.module, {}).setdefault(stats.kind, _brief(stats))
        hits: dict[str, int] = {}
        for hit in list(s.hits):
            hits[hit.module] = hits.get(hit.module, 0) + 1
        calls = s.capture.calls_by_path
        out = []
        model = s.model
        for path, module in model.named_modules() if model is not None else ():
            out.append(
                {
                    "path": path,
                    "type": type(module).__name__,
                    "depth": path.count(".") + 1 if path else 0,
                    "params": sum(p.numel() for p in module.parameters()),
                    "hits": hits.get(path, 0),
                    "calls": len(calls.get(path, ())),
                    "stats": latest.get(path, {}),
                }
            )
        return out

    def hits(self, since: int = 0) -> list[dict[str, Any]]:
        return [h.as_dict() for h in list(self.session.hits)[max(0, since) :]]

    def tensors(self) -> list[dict[str, Any]]:
        return [_listing(r) for r in self.session.records]

    def rules(self) -> dict[str, Any]:
        available = []
        for name, cls in available_rules().items():
            available.append({"name": name, "doc": _doc(cls), "params": _default_params(cls)})
        return {"rules": [_rule_dict(a) for a in self.session.rules], "available": available}

    def set_rule(
        self, id: int, enabled: bool | None = None, params: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        active = next((a for a in self.session.rules if a.id == id), None)
        if active is None:
            raise SourceError(f"there is no rule {id}")
        if params:
            try:
                active.rule.set_params(**params)
            except (ValueError, TypeError) as e:
                raise SourceError(str(e)) from None
            active.state.clear()  # history judged under the old thresholds no longer applies
        if enabled is not None:
            active.enabled = bool(enabled)
            if enabled:
                active.disabled_reason = None
        self.session.rules_changed()
        return _rule_dict(active)

    def add_rule(
        self, name: str, match: str = "*", params: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        cls = available_rules().get(name)
        if cls is None:
            raise SourceError(f"there is no rule named {name!r}; see the available list")
        try:
            rule = cls(match=match, **(params or {}))
        except (TypeError, ValueError) as e:
            raise SourceError(f"{name}: {e}") from None
        return _rule_dict(self.session.add_rule(rule))

    def control(self, action: str, n: int = 1) -> dict[str, Any]:
        control = self.session.controller
        if action in ("continue", "next", "step"):
            control.resume(action, n)
        elif action == "pause":
            control.request_pause()
        elif action == "detach":
            control.detach()
        else:
            raise SourceError(f"unknown action {action!r}: continue, next, step, pause or detach")
        return {"state": control.state, "step": self.session.step}

    def subscribe(self, callback: EventCallback) -> Callable[[], None]:
        return self.session.subscribe(callback)

    # --- while paused: on the training thread --------------------------------------------------

    def stats(self, ref: int, text: str = "") -> dict[str, Any]:
        record = self._record(ref)

        def work() -> dict[str, Any]:
            index, view = self._view(record, text)
            summary = summarize(view) if view.numel() else Summary(numel=0)
            dtype = dtype_name(view.dtype)
            step = record.stats.step
            previous = None
            if not index:
                # The full summary of the last step this tensor was inspected at, else what the
                # rules computed of it then: stepping from pause to pause compares in full.
                name = record.stats.name
                seen = self._inspected.get(name)
                if seen is not None and seen[0] < step:
                    previous = {"step": seen[0], "summary": seen[1]}
                elif name in self.session.previous:
                    before_step, before = self.session.previous[name]
                    previous = {"step": before_step, "summary": _brief(before)}
                self._inspected[name] = (step, summary.as_dict())
            return {
                "ref": ref,
                "name": record.stats.name,
                "step": step,
                "index": index,
                "shape": list(view.shape),
                "dtype": dtype,
                "summary": summary.as_dict(),
                "line": summary.line(view.shape, dtype),
                "previous": previous,
            }

        return self._on_training_thread(work)

    def slice(
        self, ref: int, text: str = "", window: list[list[int]] | None = None
    ) -> dict[str, Any]:
        record = self._record(ref)

        def work() -> dict[str, Any]:
            index, view = self._view(record, text)
            dtype = dtype_name(view.dtype)
            if dtype not in DTYPES:
                raise SourceError(f"tensors of dtype {dtype} cannot be shown yet")
            itemsize = max(1, view.element_size())
            try:
                rows, cols = clamp_window(tuple(view.shape), window, MAX_REPLY_BYTES // itemsize)
            except SliceError as e:
                raise SourceError(str(e)) from None
            block = window_of(view, rows, cols).detach().to("cpu").contiguous()
            grid_rows, grid_cols = grid_shape(tuple(view.shape))
            return {
                "ref": ref,
                "index": index,
                "shape": list(view.shape),
                "rows": grid_rows,
                "cols": grid_cols,
                "window": [list(rows), list(cols)],
                "dtype": dtype,
                "data": _wire(block, dtype),
            }

        return self._on_training_thread(work)

    def histogram(
        self,
        ref: int,
        text: str = "",
        bins: int = 64,
        lo: float | None = None,
        hi: float | None = None,
    ) -> dict[str, Any]:
        record = self._record(ref)
        if not 1 <= bins <= MAX_BINS:
            raise SourceError(f"bins is between 1 and {MAX_BINS}")

        def work() -> dict[str, Any]:
            index, view = self._view(record, text)
            x = view.detach()
            x = x.float() if x.dtype not in (torch.float32, torch.float64) else x
            summary = summarize(x)
            if summary.nonfinite:
                x = x[torch.isfinite(x)]
            low = summary.min if lo is None else lo
            high = summary.max if hi is None else hi
            if x.numel() == 0 or not (math.isfinite(low) and math.isfinite(high)):
                counts = [0] * bins
                edges = [0.0] * (bins + 1)
            else:
                if high <= low:
                    low, high = low - 0.5, high + 0.5
                counts = torch.histc(x, bins=bins, min=low, max=high).to(torch.int64).tolist()
                edges = torch.linspace(low, high, bins + 1, dtype=torch.float64).tolist()
            return {
                "ref": ref,
                "index": index,
                "edges": edges,
                "counts": counts,
                "nan": summary.nan,
                "posinf": summary.posinf,
                "neginf": summary.neginf,
                "min": summary.min,
                "max": summary.max,
            }

        return self._on_training_thread(work)

    def provenance(self, ref: int, module: str | None = None, call: int = 0) -> dict[str, Any]:
        record = self._record(ref, need_tensor=False)
        forward = record.grad_of or record
        producer = forward.producer
        returned_by = None
        if module is not None and producer is not None:
            chosen = next(
                (c for c in forward.passed_up if c.path == module and c.index == call), None
            )
            if chosen is not None:  # made by this module's own code, returned by a submodule
                returned_by, producer = producer, chosen
        site = producer or (forward.consumers[0] if forward.consumers else None)
        owner = self.session.params_by_name.get(record.param)
        name = record.stats.name
        if returned_by is not None and producer is not None:
            suffix = forward.suffix
            name = producer.tensor_name("output", suffix)
        out: dict[str, Any] = {
            "ref": ref,
            "name": name,
            "kind": record.stats.kind,
            "producer": _call_dict(producer) if producer else None,
            "returned_by": _call_dict(returned_by) if returned_by else None,
            "inputs": [],
            "consumers": [_call_dict(c) for c in forward.consumers],
            "source": None,
            "stack": [],
        }
        if producer is not None:
            out["inputs"] = [_input_dict(r) for _, r in producer.inputs]
        elif owner is not None:
            calls = self.session.capture.calls_by_path.get(owner.owner, [])
            out["producer"] = {"module": owner.owner, "type": owner.owner_type, "call": 0}
            # A parameter is consumed by its module's calls; its gradient and its update by
            # the optimizer, which is no module call.
            used = record.stats.kind == "param"
            out["consumers"] = [_call_dict(c) for c in calls] if used else []
            site = calls[0] if calls else None
        if site is not None:
            out["source"] = _source(site)
            out["stack"] = _stack(site)
        return out

    def recheck(self) -> list[dict[str, Any]]:
        return self._on_training_thread(lambda: [h.as_dict() for h in self.session.recheck()])

    # --- helpers -------------------------------------------------------------------------------

    def _record(self, ref: int, need_tensor: bool = True) -> Record:
        record = self.session.record(ref)
        if record is None:
            raise SourceError(
                f"tensor {ref} is not in the current phase: tensors are kept only for the phase "
                "the training is paused in"
            )
        if need_tensor and record.held() is None:
            if self.session.mode == "eager":
                why = (
                    "eager checks keep only hits and the last few tensors; this one passed "
                    "and the training has freed it"
                )
            else:
                budget = self.session.retain_bytes // 2**20
                why = f"the phase's tensors passed retain_bytes={budget} MiB"
            raise SourceError(
                f"{record.stats.name} was not kept ({why}); its statistics are in the list"
            )
        return record

    def _view(self, record: Record, text: str) -> tuple[str, torch.Tensor]:
        tensor = record.held()
        if tensor is None:
            raise SourceError(f"{record.stats.name} is no longer kept")
        try:
            index = parse_index(text)
            return format_index(index), apply_index(tensor.detach(), index)
        except SliceError as e:
            raise SourceError(str(e)) from None

    def _on_training_thread(self, work: Callable[[], Any]) -> Any:
        try:
            return self.session.controller.run_on_training_thread(work)
        except NotPaused as e:
            raise SourceError(f"{e} (press p)") from None


def _wire(block: torch.Tensor, dtype: str) -> WireArray:
    view = _WIRE_VIEW.get(dtype)
    words = block.view(view) if view is not None else block
    array = words.numpy()
    storage = np.dtype(DTYPES[dtype].storage)
    return WireArray(dtype, tuple(block.shape), array.view(storage))


def _brief(stats: TensorStats) -> dict[str, Any]:
    """What is known of a tensor's statistics: its summary when computed, else the values the
    rules asked for (a partial summary), with its shape."""
    if stats.summary is not None:
        out: dict[str, Any] = stats.summary.as_dict()
    else:
        out = {"numel": stats.numel}
        for stat, value in stats.values.items():
            if not stat.params:
                out[stat.name] = value
    out["shape"] = list(stats.shape)
    out["dtype"] = stats.dtype
    out["step"] = stats.step
    return out


def _listing(record: Record) -> dict[str, Any]:
    stats = record.stats
    return {
        "ref": stats.ref,
        "name": stats.name,
        "module": stats.module,
        "kind": stats.kind,
        "call": stats.call,
        "shape": list(stats.shape),
        "dtype": stats.dtype,
        "retained": record.held() is not None,
        "summary": _brief(stats),
        # Modules that returned this very tensor as their own output (a block returning its
        # last layer's output): their tensor lists show it too.
        "passed_up": list(dict.fromkeys(c.path for c in record.passed_up)),
    }


def _call_dict(call: Call) -> dict[str, Any]:
    return {"module": call.path, "type": call.module_type, "call": call.index}


def _input_dict(record: Record) -> dict[str, Any]:
    stats = record.stats
    producer = record.producer
    return {
        "ref": stats.ref,
        "name": stats.name,
        "module": producer.path if producer else stats.module,
        "shape": list(stats.shape),
        "dtype": stats.dtype,
        "line": stats.line() if stats.summary else _range_line(stats),
        "nonfinite": stats.nonfinite,
    }


def _range_line(stats: TensorStats) -> str:
    brief = _brief(stats)
    lo, hi = brief.get("min"), brief.get("max")
    head = stats.line()
    if lo is None or hi is None:
        return head
    return f"{head} x∈[{lo:.3g}, {hi:.3g}]"


def _source(call: Call) -> dict[str, Any] | None:
    if call.site is None:
        return None
    code, line = call.site
    filename = code.co_filename
    lines = range(max(1, line - CONTEXT_LINES), line + CONTEXT_LINES + 1)
    context = [[n, linecache.getline(filename, n).rstrip("\n")] for n in lines]
    return {
        "file": filename,
        "line": line,
        "function": code.co_name,
        "context": [c for c in context if c[1] or c[0] <= line],
    }


def _stack(call: Call) -> list[list[Any]]:
    """The user's lines from the training loop down to the call: one per enclosing module call
    made from a line of its own (a container's children share the container's line)."""
    chain = [call, *call.ancestors()]
    frames: list[list[Any]] = []
    for c in reversed(chain):
        if c.site is not None:
            code, line = c.site
            frame = [code.co_filename, line, code.co_name]
            if not frames or frames[-1] != frame:  # a container's child: the same user line
                frames.append(frame)
    return frames


def _rule_dict(active: Any) -> dict[str, Any]:
    rule: Rule = active.rule
    return {
        "id": active.id,
        "name": rule.name,
        "enabled": active.enabled,
        "doc": rule.describe(),
        "params": {k: _plain(v) for k, v in rule.params().items()},
        "match": list(rule.match),
        "exclude": list(rule.exclude),
        "kinds": sorted(rule.kinds),
        "disabled_reason": active.disabled_reason,
        "hits": active.hits,
    }


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _doc(cls: type[Rule]) -> str:
    doc = inspect.getdoc(cls) or cls.__name__
    return doc.strip().splitlines()[0]


def _default_params(cls: type[Rule]) -> dict[str, Any]:
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    out = {}
    for name, p in inspect.signature(cls.__init__).parameters.items():
        if name in ("self", "match", "exclude", "kinds") or p.kind not in named:
            continue
        out[name] = _plain(None if p.default is inspect.Parameter.empty else p.default)
    return out
