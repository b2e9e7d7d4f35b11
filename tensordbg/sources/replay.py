"""A dump as a :class:`~tensordbg.sources.contract.Source`: the UI over a recorded run.

A replay is read, never driven: it serves :data:`~tensordbg.sources.contract.REPLAY` (no
``control``, no rule edits) and shows one dumped step at a time; :meth:`ReplaySource.goto` moves
between them. Statistics come from the dump's index; values, slices and histograms from the
memory-mapped safetensors file, so a slice of a huge tensor reads only that slice. A step whose
file is broken is shown as broken (``info["replay"]["broken"]``) with the statistics of its
index, and every other stays readable: a step's file is read whole against its checksums when
it is shown, never the whole dump. numpy only.

>>> source = ReplaySource(tensordbg.load("runs/dbg"))
>>> source.goto(move=1)["step"]
13
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from tensordbg.dump import format as dump_format
from tensordbg.sources import contract, recorded
from tensordbg.sources.contract import EventCallback, SourceError
from tensordbg.sources.replay_previous import in_words, previous
from tensordbg.sources.replay_previous import index_summary as _summary
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
from tensordbg.statistics import describe, summarize_numpy
from tensordbg.transport.wire import DTYPES, MAX_REPLY_BYTES, WireArray

HISTORY = 500  # steps of loss and gradient norm shown on the Run tab
_ACTIVATIONS = ("input", "output", "grad_output", "grad_input")


class ReplaySource:
    """Serves one rank of a :class:`tensordbg.dump.Dump` to the UI, one dumped step at a time.

    It opens at the rank and step of the dump's first hit at its origin (else its first ones).
    A ``ref`` names one tensor at one step for the whole replay: a hit found at step 12 still
    opens its own tensor while step 40 is shown.

    >>> app = TensorDbgApp(LocalClient(ReplaySource(tensordbg.load("runs/dbg"))))
    """

    capabilities = contract.REPLAY  # read and moved through, never driven nor re-judged

    def __init__(self, dump: Any, rank: int | None = None):
        self.dump = dump
        ranks = list(dump.ranks) or [0]
        if rank is not None and rank not in ranks:
            raise SourceError(f"the dump {dump.path} has no rank {rank}; it has {ranks}")
        origins = (h.rank for h in dump.hits if h.origin and h.rank in ranks)
        self.rank = next(origins, ranks[0]) if rank is None else rank  # the origin's rank first
        # Steps the dump could not read, by step; (-1, rank) is a line naming no step.
        self._broken = {s: str(why) for (s, r), why in dump.broken.items() if r == self.rank}
        self.steps: list[int] = sorted(set(dump.steps(self.rank)) | set(self._broken) - {-1})
        if not self.steps:
            raise SourceError(recorded.nothing_dumped(dump, self._broken.get(-1, "")))
        self._hits = [recorded.hit_dict(h) for h in dump.hits if h.rank == self.rank]
        # A ref is a tensor at a step; a hit's names its phase too (a weight checked in the
        # forward and again after the optimizer step is two entries of one name).
        self._refs: dict[tuple[int, str, str | None], int] = {}
        self._ref_keys: list[tuple[int, str, str | None]] = []
        self._entries: dict[int, dict[str, Any]] = {}  # step -> {name: entry}, read on demand
        self._verified: set[int] = set()  # steps whose file was read whole (see _verify)
        for i, hit in enumerate(self._hits):
            hit["id"] = i
            hit["ref"] = self._ref(hit["step"], hit.get("stored_as") or hit["tensor"],
                                   hit.get("phase") or None)  # fmt: skip
        first = next((h for h in self._hits if h["origin"]), self._hits[0] if self._hits else None)
        self.paused_at = first
        self.index = 0
        if first is not None and first["step"] in self.steps:
            self.index = self.steps.index(first["step"])
        self._history: dict[str, list[Any]] | None = None

    # --- where the replay stands -----------------------------------------------------------

    @property
    def step(self) -> int:
        return self.steps[self.index]

    def broken(self, step: int | None = None) -> str:
        """Why ``step`` (the shown one by default) cannot be read; "" when it can."""
        step = self.step if step is None else step
        return self._broken.get(step, "")

    def _verify(self, step: int) -> None:
        """Read the file of ``step`` (up to 256 MiB) whole against its checksums, once: a changed
        byte is found when its step is shown, not when a slice reads it (values: as read)."""
        if step not in self._verified:
            self._verified.add(step)
            verify = self.dump.verify([self.rank], steps=[step], max_bytes=2**28)
            why = verify.get((step, self.rank))
            if why and step not in self._broken:
                self._broken[step] = str(why)

    def goto(self, step: int | None = None, move: int = 0) -> contract.Info:
        if step is not None and step not in self.steps:
            near = min(self.steps, key=lambda s: abs(s - step))
            raise SourceError(f"step {step} was not dumped; the nearest dumped step is {near}")
        index = self.index if step is None else self.steps.index(step)
        self.index = min(max(index + move, 0), len(self.steps) - 1)
        return self.info()

    # --- the Source ------------------------------------------------------------------------

    def info(self) -> contract.Info:
        self._verify(self.step)
        meta = self.dump.meta
        argv = meta.get("argv") or []
        modules = self.dump.modules
        on_hit = meta.get("on_hit", "")
        return {
            "run_id": str(meta.get("run_id", "")),
            "rank": self.rank,
            "world_size": max(len(self.dump.ranks), 1),  # the header names the rank shown
            "pid": int(meta.get("pid", 0) or 0),
            "script": str(argv[0]) if argv else os.path.basename(str(self.dump.path)),
            "model": str(modules[0].get("type", "")) if modules else "",
            "device": str(meta.get("device", "")),
            "torch": str(meta.get("torch_version", "")),
            "live": False,
            "state": "replay",
            "step": self.step,
            "phase": "",
            "on_hit": on_hit if isinstance(on_hit, str) else "",
            "sync": str(meta.get("sync", "")),
            "paused_at": self.paused_at,
            "pause_reason": "",
            "hits_total": len(self._hits),
            "retain_bytes": 0,
            "history": self.history(),
            "replay": {
                "path": str(self.dump.path),
                "recorded": str(meta.get("created", "")),
                "complete": bool(meta.get("complete", True)),
                # Incomplete as its run recorded it, not (only) as the dump is found damaged.
                "stopped": _stopped(meta, self._broken.get(-1, "")),
                "steps": len(self.steps),
                "index": self.index,
                "broken": self.broken(),
                "lost": self._broken.get(-1, ""),
            },
        }

    def history(self) -> contract.History:
        """The loss (an observed tensor's mean) and the gradient norm (from the parameter
        gradients' L2 norms, when every one was dumped) of the last dumped steps."""
        if self._history is None:
            out: dict[str, list[Any]] = {"step": [], "loss": [], "grad_norm": [],
                                         "steps_per_sec": []}  # fmt: skip
            numbers = getattr(self.dump, "numbers", None)
            for step in self.steps[-HISTORY:]:
                measured = recorded.step_numbers(numbers, step, self.rank)
                if measured:  # what the training measured itself
                    for key in ("loss", "grad_norm", "steps_per_sec"):
                        out[key].append(recorded.number(measured.get(key)))
                    out["step"].append(step)
                    continue
                entries = self._step_entries(step, quiet=True)
                loss = next((recorded.number(e.stats.get("mean")) for e in entries.values()
                             if e.kind == "observed"), None)  # fmt: skip
                norms = [recorded.number(e.stats.get("l2")) for e in entries.values()
                         if e.kind == "grad"]  # fmt: skip
                grad_norm = None
                if norms and all(n is not None for n in norms):
                    grad_norm = math.sqrt(sum(n * n for n in norms))  # type: ignore[operator]
                for key, value in (("step", step), ("loss", loss), ("grad_norm", grad_norm),
                                   ("steps_per_sec", None)):  # fmt: skip
                    out[key].append(value)
            self._history = out
        return self._history  # type: ignore[return-value]

    def modules(self) -> list[contract.Module]:
        entries = self._step_entries(self.step, quiet=True)
        latest: dict[str, dict[str, Any]] = {}
        calls: dict[str, int] = {}
        for entry in entries.values():
            if entry.module or entry.kind in _ACTIVATIONS:
                latest.setdefault(entry.module, {}).setdefault(
                    entry.kind, {**_summary(entry, self), "tensor": entry.name}
                )
            if entry.kind == "output":
                calls[entry.module] = calls.get(entry.module, 0) + 1
        hits: dict[str, int] = {}
        for hit in self._hits:
            hits[hit["module"]] = hits.get(hit["module"], 0) + 1
        out = []
        for module in self.dump.modules:
            path = str(module.get("path", ""))
            depth = int(module.get("depth", path.count(".") + 1 if path else 0))
            out.append({"path": path, "type": str(module.get("type", "")), "depth": depth,
                        "params": int(module.get("params", 0)), "hits": hits.get(path, 0),
                        "calls": calls.get(path, 0), "stats": latest.get(path, {})})  # fmt: skip
        return out

    def profile_report(self) -> dict[str, Any] | None:
        """The profile report the run stored with its dump (``meta["profile"]``), if any."""
        report = self.dump.meta.get("profile")
        return report if isinstance(report, dict) else None

    def hits(self, since: int = 0) -> list[contract.Hit]:
        return [h for h in self._hits[max(0, since) :]]

    def tensors(self) -> list[contract.Tensor]:
        step = self.step
        return [
            {
                "ref": self._ref(step, name),
                "name": name,
                "module": entry.module,
                "kind": entry.kind,
                "call": recorded.call_of(name),
                "shape": list(entry.shape),
                "dtype": entry.dtype,
                "retained": bool(entry.has_value),
                "summary": _summary(entry, self, step),
                "passed_up": [],
            }
            for name, entry in self._step_entries(step, quiet=True).items()
        ]

    def stats(self, ref: int, text: str = "") -> contract.Stats:
        step, entry = self._entry(ref)
        shown, note = self._valued(step, entry)
        whole = text.strip() in ("", "[]")
        # The whole of a hit's tensor whose value was not dumped: its own statistics first.
        now = shown  # the entry whose statistics fill this step's column
        if shown.has_value and not ((self.broken(step) or note) and whole):
            index, view = self._view(step, shown, text)
            summary: dict[str, Any] = summarize_numpy(view).as_dict() if view.size else {"numel": 0}
            shape, line = list(view.shape), summarize_numpy(view).line(view.shape, entry.dtype)
        elif not whole:
            raise SourceError(self._no_value(step, entry))
        else:
            index, shape, now = "", list(entry.shape), entry
            summary = _summary(entry, self, step)
            line = describe(summary, shape, entry.dtype)
        if note and index:
            line = f"{line}  (the value at the hit ({entry.phase}) was not dumped; shown: {note})"
        elif note:  # the hit's own statistics; the values below are another phase's
            line = (f"{line}  (at the hit, {entry.phase}; its value there was not dumped: the "
                    f"values below are {note})")  # fmt: skip
        before, phases = previous(self, step, now, index)
        return {
            "ref": ref,
            "name": entry.name,
            "step": step,
            "index": index,
            "shape": shape,
            "dtype": entry.dtype,
            "summary": {k: v for k, v in summary.items() if k not in ("shape", "dtype", "step")},
            "line": line,
            "previous": before,
            **({"previous_why": phases} if phases else {}),  # which phase each column is
            **({"values_of": note} if note else {}),  # the value after the update, say
        }

    def slice(
        self, ref: int, text: str = "", window: list[list[int]] | None = None
    ) -> contract.Slice:
        step, entry = self._entry(ref)
        entry = self._valued(step, entry)[0]
        if entry.dtype not in DTYPES:
            raise SourceError(f"tensors of dtype {entry.dtype} cannot be shown yet")
        index, view = self._view(step, entry, text)
        try:
            frame = slice_frame(tuple(view.shape), window, MAX_REPLY_BYTES // view.itemsize)
        except SliceError as e:
            raise SourceError(str(e)) from None
        block = np.ascontiguousarray(window_of(view, *frame["window"]))
        storage = np.dtype(DTYPES[entry.dtype].storage)
        data = WireArray(entry.dtype, tuple(block.shape), block.view(storage))
        return {"ref": ref, "index": index, **frame, "dtype": entry.dtype, "data": data}

    def find(self, ref: int, text: str = "", after: int = -1) -> contract.Found:
        step, entry = self._entry(ref)
        index, view = self._view(step, self._valued(step, entry)[0], text)
        return found(ref, index, tuple(view.shape), next_nonfinite_array(view, after))

    def histogram(
        self,
        ref: int,
        text: str = "",
        bins: int = 64,
        lo: float | None = None,
        hi: float | None = None,
    ) -> contract.Histogram:
        try:
            check_histogram(bins, lo, hi)
        except SliceError as e:
            raise SourceError(str(e)) from None
        step, entry = self._entry(ref)
        index, view = self._view(step, self._valued(step, entry)[0], text)
        x = np.asarray(view, dtype=np.float64).ravel()
        finite = np.isfinite(x)
        values = x[finite] if not finite.all() else x
        low = float(values.min()) if lo is None and values.size else (lo or 0.0)
        high = float(values.max()) if hi is None and values.size else (hi or 0.0)
        if values.size == 0:
            counts, edges = [0] * bins, [0.0] * (bins + 1)
        else:
            if high <= low:
                low, high = low - 0.5, high + 0.5
            hist, bin_edges = np.histogram(values, bins=bins, range=(low, high))
            counts, edges = hist.tolist(), bin_edges.tolist()
        return {
            "ref": ref,
            "index": index,
            "edges": edges,
            "counts": counts,
            "nan": int(np.count_nonzero(np.isnan(x))),
            "posinf": int(np.count_nonzero(np.isposinf(x))),
            "neginf": int(np.count_nonzero(np.isneginf(x))),
            "min": low,
            "max": high,
        }

    def provenance(self, ref: int, module: str | None = None, call: int = 0) -> contract.Provenance:
        """What the dump recorded of where the tensor came from: its producer and inputs (as
        refs of the same step when they were dumped), consumers, the user's line and stack."""
        step, entry = self._entry(ref)
        made = entry.provenance if isinstance(entry.provenance, dict) else {}
        types = {str(m.get("path", "")): str(m.get("type", "")) for m in self.dump.modules}
        producer = made.get("producer")
        if "producer" not in made:  # no provenance dumped: the module the tensor is named after
            producer = {"module": entry.module, "type": types.get(entry.module, ""), "call": 0}
        elif not isinstance(producer, dict):  # None: made outside any module (a script's loss)
            producer = None
        entries = self._step_entries(step, quiet=True)
        shown, kind = entry.name, entry.kind
        if module is not None and producer == {**(producer or {}), "module": module, "call": call}:
            # Written with the provenance of the call the hit names: the name it gives.
            shown, kind = str(made.get("name", shown)), str(made.get("kind", kind))
        hit = next((h for h in self._hits if h["ref"] == ref and h["module"] == module), None)
        taken = recorded.taken_by(made, module, call, hit, entries.values(), entry.kind)
        if taken is not None:  # a dump written before its provenance named that call
            made, producer, shown, kind = taken, taken["producer"], taken["name"], "grad_input"
        inputs = []
        for item in made.get("inputs") or []:
            if not isinstance(item, dict):
                continue
            name = str(item.get("name", ""))
            source = entries.get(name)
            made_by = {"made_by": str(item["made_by"])} if item.get("made_by") else {}
            inputs.append(
                {
                    **made_by,  # the batch, or code between modules: said as live says it
                    "ref": self._ref(step, name) if source is not None else None,
                    "name": name,
                    "module": str(item.get("module", "")),
                    "shape": [int(d) for d in item.get("shape", [])],
                    "dtype": str(item.get("dtype", "")),
                    "line": str(item.get("line", "")),
                    "nonfinite": item.get("nonfinite")
                    if isinstance(item.get("nonfinite"), bool)
                    else None,
                }
            )
        return {
            "ref": ref,
            "name": shown,
            "kind": kind,
            "step": step,
            "producer": recorded.call_site(producer),
            "returned_by": recorded.call_site(made.get("returned_by")),
            "inputs": inputs,
            "consumers": [c for c in map(recorded.call_site, made.get("consumers") or []) if c],
            "source": recorded.source_line(made.get("source")),
            **recorded.operation(made.get("operation")),
            "stack": [
                [str(f[0]), int(f[1]), str(f[2])]
                for f in made.get("stack") or []
                if isinstance(f, (list, tuple)) and len(f) == 3
            ],
        }

    def rules(self) -> contract.Rules:
        """The rules the run was recorded with (as the dump's metadata says), and the rules
        ``tensordbg check --rules`` can judge it with."""
        hits: dict[str, int] = {}
        for hit in self._hits:
            hits[hit["rule"]] = hits.get(hit["rule"], 0) + 1
        return {
            "rules": recorded.rule_dicts(self.dump.meta.get("rules") or [], hits),
            "available": recorded.available(),
        }

    def subscribe(self, callback: EventCallback) -> Callable[[], None]:
        return lambda: None  # a recording pushes nothing: it moves by goto's reply alone

    # --- helpers ---------------------------------------------------------------------------

    def _ref(self, step: int, name: str, phase: str | None = None) -> int:
        key = (step, name, phase)
        ref = self._refs.get(key)
        if ref is None:
            ref = self._refs[key] = len(self._ref_keys)
            self._ref_keys.append(key)
        return ref

    def _step_entries(self, step: int, quiet: bool = False) -> dict[str, Any]:
        """The tensors of a dumped step by name, in execution order, as its index lists them
        (a broken values file loses the values, not the statistics); a step without a whole
        index line has none (``quiet``) or raises SourceError with the dump's sentence."""
        entries = self._entries.get(step)
        if entries is None:
            try:
                listed = self.dump.tensors(step, rank=self.rank)
            except Exception as e:  # the dump's own sentence (DumpError) for a broken file
                self._broken.setdefault(step, str(e))
                listed = self.dump.indexed(step, rank=self.rank) or []
            entries = self._entries[step] = {e.name: e for e in listed}
        if not entries and not quiet and self.broken(step):
            raise SourceError(f"step {step} cannot be read: {self.broken(step)}")
        return entries

    def _entry(self, ref: int) -> tuple[int, Any]:
        if not 0 <= ref < len(self._ref_keys):
            raise SourceError(f"there is no tensor {ref} in this replay")
        step, name, phase = self._ref_keys[ref]
        self._verify(step)  # a hit's own step, whichever is shown
        entry = self._step_entries(step).get(name)
        if entry is None:
            raise SourceError(f"{name} was not dumped at step {step}")
        if phase is not None and entry.phase != phase:  # a hit's own phase, not the latest
            own = [e for e in self.dump.indexed(step, rank=self.rank) or ()
                   if e.name == name and e.phase == phase]  # fmt: skip
            entry = own[-1] if own else entry
        return step, entry

    def _valued(self, step: int, entry: Any) -> tuple[Any, str]:
        """The entry whose values are shown for ``entry``, and which it is when it is another
        (else ""): a hit's tensor whose value was not dumped at the hit's phase shows the value
        dumped of a later phase of the step ("3.weight after the optimizer step of step 6")."""
        latest = self._step_entries(step, quiet=True).get(entry.name)
        if entry.has_value or latest is None or latest is entry or not latest.has_value:
            return entry, ""
        return latest, f"{entry.name} {in_words(latest.phase)} of step {step}"

    def _no_value(self, step: int, entry: Any) -> str:
        said = f"only the statistics of {entry.name} were dumped at step {step}, not its values"
        if any(h["step"] == step for h in self._hits):  # dump_tensors chose nothing there
            return (f"{said}: a step with a hit keeps the values the training still held when "
                    "its phases ended, from the phase that hit on")  # fmt: skip
        chosen = self.dump.meta.get("dump_tensors") or []
        if entry.kind in ("grad_output", "grad_input") and dump_format.chosen(entry.name, chosen):
            return (f"{said}: the training did not hold it when its phase ended (values past "
                    "retain_bytes are not kept; an older tensordbg's deferred checks let a clean "
                    "step's activation gradients go)")  # fmt: skip
        return f"{said}: dump_tensors=[pattern] chooses which values a periodic step keeps"

    def _view(self, step: int, entry: Any, text: str) -> tuple[str, np.ndarray]:
        if not entry.has_value:
            raise SourceError(self._no_value(step, entry))
        try:
            value = self.dump.tensor(entry.name, rank=self.rank, phase=entry.phase).value(step)
        except Exception as e:  # DumpError: a file cut or changed since the index was read
            raise SourceError(str(e)) from None
        try:
            index = parse_index(text)
            return format_index(index), np.asarray(apply_index(value, index))
        except SliceError as e:
            raise SourceError(str(e)) from None


def next_nonfinite_array(x: Any, after: int = -1) -> tuple[int, bool] | None:
    """:func:`tensordbg.statistics.summaries.next_nonfinite` of a numpy array (a replay's)."""
    if x.dtype.kind in "biu" or not x.size:
        return None
    flat = x.reshape(-1)
    bad = np.flatnonzero(~np.isfinite(flat if x.dtype.kind in "fc" else flat.astype(np.float32)))
    if not bad.size:
        return None
    later = int(np.searchsorted(bad, after, side="right"))
    return (int(bad[later]), False) if later < bad.size else (int(bad[0]), True)


def _stopped(meta: dict[str, Any], lost: str) -> bool:
    """Whether the run left the dump incomplete, not only a reader finding it damaged (lost)."""
    reason = str(meta.get("reason_incomplete") or "")
    return not meta.get("complete", True) and not (lost and reason.endswith(lost))
