"""A live training as a :class:`~Source`: what the server serves to the UI.

Cheap requests (hits, rules, the module tree with the latest statistics) are answered from
host-side state at any time. Requests that touch tensors (statistics of a slice, values, a
histogram) run on the training thread while it is paused, where the tensors and their CUDA
stream live; while the training runs they are refused with a sentence saying to pause first.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tensordbg.engine.control import NotPaused
from tensordbg.engine.hits import ranked_line
from tensordbg.engine.judge import ActiveRule
from tensordbg.engine.records import Record, version_of
from tensordbg.engine.session import Session
from tensordbg.rules.catalog import make_rule
from tensordbg.sources import contract, recorded
from tensordbg.sources.contract import EventCallback, SourceError
from tensordbg.sources.listings import listing, no_output
from tensordbg.sources.profiling import LiveProfiling
from tensordbg.sources.provenance import brief as _brief
from tensordbg.sources.provenance import provenance
from tensordbg.sources.slicing import (
    SliceError,
    apply_index,
    check_histogram,
    format_index,
    found,
    parse_index,
    slice_frame,
    window_of,
)
from tensordbg.statistics import Summary
from tensordbg.statistics.summaries import next_nonfinite, streamed_histogram, streamed_summary
from tensordbg.statistics.torch_kernels import dtype_name
from tensordbg.transport.wire import DTYPES, MAX_REPLY_BYTES, WireArray

# A slice may make as many values as its tensor holds, and at least this many.
MIN_SLICE_BOUND = 2**20
_ACTIVATIONS = ("input", "output", "grad_output", "grad_input")
# Words that carry each dtype on the wire, as torch dtypes to .view() the tensor as.
_WIRE_VIEW = {"bfloat16": torch.int16, "float8_e4m3fn": torch.uint8, "float8_e4m3fnuz": torch.uint8,
              "float8_e5m2": torch.uint8, "float8_e5m2fnuz": torch.uint8}  # fmt: skip


class LiveSource(LiveProfiling):
    """Serves a :class:`~tensordbg.engine.session.Session` to the UI.

    >>> server = Server(LiveSource(session), run_id=session.run_id, rank=session.rank)
    """

    capabilities = contract.EVERY_REQUEST  # a running training can be read, driven and re-judged

    def __init__(self, session: Session, ui_timeout: float | None = 30.0):
        self.session = session
        self.ui_timeout = ui_timeout
        """Seconds a paused training waits after the last UI went away before it resumes with
        blocking watchpoints disarmed; None waits for ever."""
        self.started = time.time()
        self._clients = 0
        self._ui_timer: Any = None
        # Summaries of tensors a person looked at, by name: (step, summary). Small, host-side.
        self._inspected: dict[str, tuple[int, dict[str, Any]]] = {}

    # --- at any time ---------------------------------------------------------------------------

    def info(self) -> contract.Info:
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
            "phase": s.where,
            "on_hit": s.on_hit if isinstance(s.on_hit, str) else "callback",
            "sync": s.mode,
            "paused_at": control.paused_at.as_dict() if control.paused_at else None,
            "pause_reason": control.reason if control.state == "paused" else "",
            "skippable": s.skippable(),
            "hits_total": len(s.hits),
            "retain_bytes": s.retain_bytes,
            "started": self.started,
            "running_rule": s.ruleset.running_rule(),
            "unwatched": s.broken if not s.detached else "",
            "world_size": s.ranks.identity.world_size if s.ranks is not None else 1,
            "history": {
                "step": [h[0] for h in history],
                "loss": [h[1] for h in history],
                "grad_norm": [h[2] for h in history],
                "steps_per_sec": [h[3] for h in history],
            },
        }

    def modules(self) -> list[contract.Module]:
        s = self.session
        if s.controller.state == "paused":
            with contextlib.suppress(SourceError):  # resumed meanwhile: what is known is shown
                self._on_training_thread(self._measure_kept)
        snapshot = s.snapshot()  # never the dicts the training thread is filling
        latest: dict[str, dict[str, dict[str, Any]]] = {}
        # The phase's own records first: paused at a hit, deferred mode has judged only those
        # before it (one not judged yet has no latest statistics).
        for record in snapshot.records:
            stats = record.stats
            measured = stats.summary is not None or stats.values
            if stats.kind in _ACTIVATIONS and not record.hidden and measured:
                latest.setdefault(stats.module, {}).setdefault(stats.kind, _named(stats))
        newest: dict[tuple[str, str], Any] = {}  # a module's latest call of the step's, each
        for _, (_, stats) in snapshot.latest.items():  # micro-batch's output named apart
            if stats.module or stats.kind in _ACTIVATIONS:
                had = newest.get((stats.module, stats.kind))
                if had is None or (had.step, had.call) < (stats.step, stats.call):
                    newest[stats.module, stats.kind] = stats
        for (module, kind), stats in newest.items():
            latest.setdefault(module, {}).setdefault(kind, _named(stats))
        for record in snapshot.records:  # a module returning a child's output has it too
            if record.stats.kind == "output":
                for call in record.passed_up:
                    latest.setdefault(call.path, {})["output"] = _named(record.stats)
        hits: dict[str, int] = {}
        for hit in list(s.hits):
            hits[hit.module] = hits.get(hit.module, 0) + 1
            if hit.kind == "output" and hit.step == s.step and "numel" in hit.summary:
                # The call whose own code made it (block.output, listed as block.fc2.output)
                latest.setdefault(hit.module, {}).setdefault("output", {**hit.summary,
                                                                        "tensor": hit.tensor})
        calls = snapshot.calls
        inside = {call.path for call in list(s.capture.stack)}  # the calls not returned yet
        paused = s.controller.state == "paused"
        out, model = [], s.model
        for path, module in model.named_modules() if model is not None else ():
            row: contract.Module = {
                "path": path,
                "type": type(module).__name__,
                "depth": path.count(".") + 1 if path else 0,
                "params": sum(p.numel() for p in module.parameters()),
                "hits": hits.get(path, 0),
                "calls": calls.get(path, 0),
                "stats": latest.get(path, {}),
            }
            if "output" not in row["stats"]:  # a blank would say nothing: say why
                when = "between" if s.between_steps and paused else s.controller.state
                when = "forward" if when == "paused" and s.phase == "forward" else when
                row["note"] = no_output(id(module) in s.capture.paths, path in inside,
                                         row["calls"], s.mode, when)  # fmt: skip
            out.append(row)
        return out

    def _measure_kept(self) -> None:
        """While paused: the full statistics of the phase's kept tensors only screened (deferred
        mode measures a clean activation only as finite): the Modules tab shows their range."""
        for record in self.session.snapshot().records:
            stats = record.stats
            if stats.summary is None and not record.hidden:
                tensor = record.held()
                if (tensor is not None and version_of(tensor) == record.version
                        and tensor.layout == torch.strided and tensor.numel()):  # fmt: skip
                    stats.summary = streamed_summary(tensor.detach())

    def hits(self, since: int = 0) -> list[contract.Hit]:
        return [h.as_dict() for h in list(self.session.hits)[max(0, since) :]]

    def tensors(self) -> list[contract.Tensor]:
        return [listing(r) for r in self.session.snapshot().records]

    def rules(self) -> contract.Rules:
        rules = [recorded.rule_dict(a) for a in self.session.rules]
        return {"rules": rules, "available": recorded.available()}

    def set_rule(self, id: int, enabled: bool | None = None,
                 params: dict[str, Any] | None = None) -> contract.Rule:  # fmt: skip
        """Edit a rule. The edit is checked here, and made by the training thread at its next
        hook (at once while it is paused): the reply is the rule as it will be, with
        ``pending`` true until then."""
        session = self.session
        active = next((a for a in list(session.rules) if a.id == id), None)
        if active is None:
            raise SourceError(f"there is no rule {id}")
        edited = copy.deepcopy(active.rule)
        if params:
            thresholds = dict(params)
            # ``exclude`` (tensor name patterns) is a selection, not a threshold: "ignore this
            # rule on this tensor" is ``params={"exclude": [*rule["exclude"], name]}``.
            exclude = thresholds.pop("exclude", None)
            try:
                edited.set_params(**thresholds)
            except (ValueError, TypeError) as e:
                raise SourceError(str(e)) from None
            if exclude is not None:
                if not isinstance(exclude, list) or not all(isinstance(p, str) for p in exclude):
                    raise SourceError("exclude is a list of tensor name patterns")
                edited.exclude = tuple(exclude)

        def apply() -> dict[str, Any]:
            if params:
                active.rule = edited
                active.state.clear()  # history judged under the old thresholds no longer applies
            if enabled is not None:
                active.enabled = bool(enabled)
                if enabled:
                    active.disabled_reason = None
            session.rules_changed()
            return recorded.rule_dict(active)

        def preview() -> dict[str, Any]:
            ahead = copy.copy(active)
            ahead.rule = edited
            if enabled is not None:
                ahead.enabled = bool(enabled)
            return recorded.rule_dict(ahead)

        return self._change(apply, preview)

    def add_rule(
        self, name: str, match: str = "*", params: dict[str, Any] | None = None
    ) -> contract.Rule:
        """Add a rule (made by the training thread, as :meth:`set_rule` says)."""
        try:
            rule = make_rule(name, {"match": match, **(params or {})})
        except ValueError as e:
            raise SourceError(str(e)) from None
        session = self.session
        return self._change(lambda: recorded.rule_dict(session.ruleset.add(rule)),
                            lambda: recorded.rule_dict(ActiveRule(-1, rule)))  # fmt: skip

    def _change(self, apply: Callable[[], dict[str, Any]],
                preview: Callable[[], dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
        future = self.session.control.submit(apply)
        if future.done():
            return future.result()
        return {**preview(), "pending": True}

    def control(self, action: str, n: int = 1) -> contract.Control:
        control = self.session.controller
        if action in ("continue", "next", "step"):
            control.resume(action, n)
        elif action == "pause":
            control.request_pause()
        elif action == "detach":
            control.detach()
        elif action == "skip":
            if control.state != "paused":
                raise SourceError("pause the training first: an update is skipped from a pause")
            try:
                step = self.session.skip_step()
            except ValueError as e:  # the update is made already: nothing left to skip
                raise SourceError(str(e)) from None
            return {"state": control.state, "step": step, "skipped": self.session.skipping()}
        else:
            raise SourceError(
                f"unknown action {action!r}: continue, next, step, pause, skip or detach"
            )
        return {"state": control.state, "step": self.session.step}

    def subscribe(self, callback: EventCallback) -> Callable[[], None]:
        # The UI's feed only: the engine's own events (phase_end's records) do not cross.
        return self.session.bus.subscribe(callback, events=contract.EVENTS)

    # --- the UI's presence ---------------------------------------------------------------------

    def on_clients(self, count: int) -> None:
        """The number of connected UIs changed. The last gone while paused, the training resumes
        after ``ui_timeout`` s with blocking watchpoints disarmed; the first come is said."""
        previous, self._clients = self._clients, count
        timer, self._ui_timer = self._ui_timer, None
        if timer is not None:
            timer.cancel()
        if count and not previous and self.session.controller.state == "paused":
            said = f"tensordbg: a UI connected ({self.session.at}); continue with c there"
            print(ranked_line(self.session, said), file=sys.stderr, flush=True)
        if count == 0 and previous > 0 and self.ui_timeout is not None:
            with contextlib.suppress(RuntimeError):  # detached meanwhile: nothing to time
                self._ui_timer = self.session.handles.timer(self.ui_timeout, self._ui_gone)

    def _ui_gone(self) -> None:
        session = self.session
        if self._clients or session.controller.state != "paused":
            return

        def disarm() -> None:
            session.on_hit = "record"
            session.log("the UI went away: blocking watchpoints disarmed, training resumed",
                        "warning")  # fmt: skip
            print("tensordbg: the UI went away; training resumes, hits are only recorded now",
                  file=sys.stderr)  # fmt: skip

        session.control.submit(disarm)
        session.controller.resume()

    # --- while paused: on the training thread --------------------------------------------------

    def stats(self, ref: int, text: str = "") -> contract.Stats:
        record = self._record(ref)

        def work() -> dict[str, Any]:
            index, view = self._view(record, text)
            summary = streamed_summary(view) if view.numel() else Summary(numel=0)
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
            why = {}
            if self.session.all_reduced(record) and not index:
                # As the all-reduce left it: the steps before hold this rank's own gradient.
                previous, why["previous_why"] = None, (
                    "this step's gradient is as the all-reduce left it (judged again before the "
                    "update); earlier steps hold this rank's own, from before the all-reduce: "
                    "not the same quantity")  # fmt: skip
            elif previous is None and not index:
                why["previous_why"] = self.session.sync.why_not_measured(
                    record, self.session.interval
                )
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
                **why,
            }

        return self._on_training_thread(work)

    def slice(
        self, ref: int, text: str = "", window: list[list[int]] | None = None
    ) -> contract.Slice:
        record = self._record(ref)

        def work() -> dict[str, Any]:
            index, view = self._view(record, text)
            dtype = dtype_name(view.dtype)
            if dtype not in DTYPES:
                raise SourceError(f"tensors of dtype {dtype} cannot be shown yet")
            try:
                frame = slice_frame(tuple(view.shape), window,
                                    MAX_REPLY_BYTES // max(1, view.element_size()))  # fmt: skip
            except SliceError as e:
                raise SourceError(str(e)) from None
            block = window_of(view, *frame["window"]).detach().to("cpu").contiguous()
            return {"ref": ref, "index": index, **frame, "dtype": dtype,
                    "data": _wire(block, dtype)}  # fmt: skip

        return self._on_training_thread(work)

    def find(self, ref: int, text: str = "", after: int = -1) -> contract.Found:
        record = self._record(ref)

        def work() -> dict[str, Any]:
            index, view = self._view(record, text)
            return found(ref, index, tuple(view.shape), next_nonfinite(view, after))

        return self._on_training_thread(work)

    def histogram(
        self,
        ref: int,
        text: str = "",
        bins: int = 64,
        lo: float | None = None,
        hi: float | None = None,
    ) -> contract.Histogram:
        record = self._record(ref)
        try:
            check_histogram(bins, lo, hi)
        except SliceError as e:
            raise SourceError(str(e)) from None

        def work() -> dict[str, Any]:
            # Two streamed passes (the range, then the counts): what the training allocates
            # for it is a chunk's worth, however large the slice (CHUNK_ELEMENTS).
            index, view = self._view(record, text)
            summary = streamed_summary(view) if view.numel() else Summary(numel=0)
            low = summary.min if lo is None else lo
            high = summary.max if hi is None else hi
            finite = summary.numel - summary.nonfinite
            if finite == 0 or not (math.isfinite(low) and math.isfinite(high)):
                counts = [0] * bins
                edges = [0.0] * (bins + 1)
            else:
                if high <= low:
                    low, high = low - 0.5, high + 0.5
                counts = streamed_histogram(view, bins, low, high)
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

    def provenance(self, ref: int, module: str | None = None, call: int = 0) -> contract.Provenance:
        """Where a value came from (see :mod:`.provenance`)."""
        return provenance(self.session, self._record(ref, need_tensor=False), module, call)

    def recheck(self) -> contract.Recheck:
        return self._on_training_thread(self.session.recheck_reply)

    # --- helpers -------------------------------------------------------------------------------

    def _record(self, ref: int, need_tensor: bool = True) -> Record:
        record = self.session.record(ref)
        if record is None:
            raise SourceError(
                "this tensor is from a phase that has ended: values are kept only for the phase "
                "the training is paused in (its hit, on the Hits tab, holds its statistics)"
            )
        if need_tensor and record.held() is None:
            why = self.session.why_not_kept(record)
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
            bound = max(tensor.numel(), MIN_SLICE_BOUND)  # documented in apply_index
            return format_index(index), apply_index(tensor.detach(), index, bound)
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


def _named(stats: Any) -> dict[str, Any]:
    """A module's latest statistics of a kind, with the tensor they are of (which of its
    outputs: the tree's columns may show two different ones)."""
    return {**_brief(stats), "tensor": stats.name}
