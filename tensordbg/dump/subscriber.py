"""The session side of dumps: :class:`DumpRecorder`, a subscriber on the session's bus that
turns what the engine saw into steps on disk (``attach(dump_dir=...)``).

What a dumped step holds. Every dumped step lists each watched tensor of the step with the
statistics the engine computed for it (no new ones: the periodic dump adds no host
synchronization). Values are what the engine still holds when a phase ends (within
``retain_bytes`` in batched and deferred modes; in eager mode, the hits' tensors, the last few
seen and those the training keeps alive, such as activations saved for the backward pass):

- a step with a hit: the values of the phase that hit and of the later phases of that step (the
  earlier phases' tensors were let go before anyone knew), each with its provenance; a weight
  checked in two of them (at attach's check or in the forward, and after the update) keeps both;
- every ``dump_every``-th step: the values of the tensors whose names match ``dump_tensors``.

Copies are bounded: at most ``retain_bytes`` of values per step, and ``QUEUE_STEPS`` steps'
worth of values (``QUEUE_STEPS`` x ``retain_bytes``) waiting for the writer, in at most
``QUEUE_MAX`` steps (a statistics-only step is some 100 kB of small objects). The training thread
only copies tensors to the host; a background thread writes. When it falls behind past those
bounds, periodic steps are dropped (said once); steps with hits never are. When the training
is about to stop on a hit (``on_hit="raise"`` or ``"pause"``) the step so far is written before
it stops, so the evidence survives a crash or a kill. A failed write (a full disk) is said once,
marks the dump incomplete, and the training goes on without dumps.
"""

from __future__ import annotations

import math
import queue
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch

from tensordbg.dtypes import numpy_dtype
from tensordbg.dump import format as fmt
from tensordbg.dump.writer import DumpWriter
from tensordbg.engine.params import parameter_count
from tensordbg.offline.sentences import plural
from tensordbg.statistics import FINITE, MEAN, TensorStats
from tensordbg.statistics.batch import StatsBatch, on_host
from tensordbg.statistics.torch_kernels import device_parts

QUEUE_STEPS = 4
"""Steps' worth of values waiting for the writer at most (``QUEUE_STEPS`` x ``retain_bytes``)."""
QUEUE_MAX = 64
"""Steps waiting for the writer at most: a small model's statistics-only steps come faster than
a write for a moment (a hit step's fsync), and are not dropped for it."""

# torch dtypes numpy cannot hold, as the integer type of the same width and the ml_dtypes view.
_VIEWS = {
    torch.bfloat16: (torch.int16, "bfloat16"),
    torch.float8_e4m3fn: (torch.uint8, "float8_e4m3fn"),
    torch.float8_e5m2: (torch.uint8, "float8_e5m2"),
}


@dataclass(slots=True)
class _StepBuffer:
    """What one step gathered so far (statistics of small objects; values copied to host)."""

    step: int
    stats: list[TensorStats] = field(default_factory=list)
    seen: set[int] = field(default_factory=set)
    values: dict[Any, torch.Tensor] = field(default_factory=dict)
    """By name (its latest phase's), and by (name, phase) for a hit's earlier one."""
    provenance: dict[int, Any] = field(default_factory=dict)
    hits: list[dict[str, Any]] = field(default_factory=list)
    value_bytes: int = 0
    values_from_hits: bool = False
    at_hit: dict[str, str] = field(default_factory=dict)
    """The phase of each value copied because the step hit (kept beside a later phase's)."""


@dataclass(slots=True)
class _Job:
    step: int
    stats: list[TensorStats]
    values: dict[Any, torch.Tensor]
    provenance: dict[int, Any]
    hits: list[dict[str, Any]]
    modules: list[dict[str, Any]] | None
    numbers: dict[str, Any] | None
    done: threading.Event | None = None
    nbytes: int = 0  # of its values


class DumpRecorder:
    """Writes a session's hit steps and periodic steps into ``dump_dir``.

    >>> session = tensordbg.attach(model, opt, dump_dir="runs/dbg", dump_every=100,
    ...                            dump_tensors=["*.weight.grad"])
    """

    def __init__(
        self,
        session: Any,
        dump_dir: str,
        every: int | None = None,
        tensors: Sequence[str] = (),
        max_bytes: int | None = None,
    ):
        check_settings(every, max_bytes)
        self.session = session
        self.every = every
        self.patterns = tuple(tensors)
        self.chooses = partial(fmt.chosen, patterns=self.patterns)  # a tensor's name: its values?
        self.copies_grads = fmt.chooses_gradients(self.patterns, session.capture.paths.values())
        self.value_budget = max(int(session.retain_bytes), 1)
        self.dropped: list[int] = []
        """Periodic steps not written because the writer fell behind."""
        self.failed: str | None = None
        try:
            meta = {**_run_meta(session), "dump_every": every, "dump_tensors": list(tensors)}
            self.writer = DumpWriter(dump_dir, meta, rank=session.rank, max_bytes=max_bytes)
        except OSError as e:
            raise ValueError(f"tensordbg cannot write a dump in {dump_dir}: {e}") from None
        self._buffer = _StepBuffer(session.step)
        self._encoder = fmt.EntryEncoder()  # the writer thread's
        self._modules_written = False
        self._said_behind = self._said_budget = False
        self._queue: queue.Queue[_Job | None] = queue.Queue(maxsize=QUEUE_MAX)
        self._queued_bytes = 0  # of values, in the queue or being written
        self._queued_lock = threading.Lock()
        self._thread = threading.Thread(target=self._write_loop, name="tensordbg-dump", daemon=True)
        self._thread.start()
        self._unsubscribe = session.bus.subscribe(
            self._on_event, {"phase_end", "hit", "step_end", "halt", "detach"}
        )

    # --- the training thread -----------------------------------------------------------------

    def _on_event(self, event: str, payload: Any) -> None:
        if event == "phase_end":
            self._phase(payload["step"], payload["records"])
        elif event == "hit":
            # A hit the GradScaler held past its step's end joins the step now open (it keeps
            # its own step number), so the step already written is not replaced.
            step = max(payload.get("step", self.session.step), self._buffer.step)
            self._at(step).hits.append(dict(payload))
        elif event == "step_end":
            self._finish(payload["step"], dict(payload))
        elif event == "halt":
            self._halt(payload["step"], payload["records"])
        elif event == "detach":
            if not getattr(self.session, "_exiting", False):  # the training may go on: said
                step, phase = payload.get("step", 0), payload.get("phase", "")
                self.writer.meta["detached"] = (f"at step {step} ({phase})" if phase
                                                else f"after step {step - 1}")  # fmt: skip
            self.close()

    def _at(self, step: int) -> _StepBuffer:
        if step != self._buffer.step:
            self._finish(self._buffer.step, None)
            self._buffer = _StepBuffer(step)
        return self._buffer

    def periodic(self, step: int) -> bool:
        """Whether ``step`` is written whatever happens (``dump_every``): its records must all
        be made, statistics of every watched tensor."""
        return self.every is not None and step % self.every == 0

    def _phase(self, step: int, records: list[Any], halting: bool = False) -> None:
        """A phase ended (or stops on a hit): note its statistics; copy the values the step
        will need."""
        buffer = self._at(step)
        hit_step = bool(buffer.hits) or halting
        if not (hit_step or self.periodic(step)):
            return  # nothing of this step is written unless a later phase hits: keep nothing
        copy_all = hit_step and self.failed is None
        # Hits that name the call whose own code made a value (the attention, not its output
        # projection): that value's provenance is the call's (its line, its mask).
        makers = {(h["stored_as"], h.get("ref")): h for h in buffer.hits if h.get("stored_as")}
        fresh = []
        for record in records:
            if not record.hidden and id(record.stats) not in buffer.seen:
                buffer.seen.add(id(record.stats))
                fresh.append(record)
        # Every activation with its mean: a hit step's clean ones were screened for NaN alone
        # (deferred checks), and diff could not part two runs where an activation's mean does.
        self._screen_unscreened([r for r in fresh if MEAN not in r.stats.values
                                 and r.stats.kind in ("input", "output")
                                 and r.stats.values.get(FINITE, 1.0) == 1.0])  # fmt: skip
        for record in fresh:
            buffer.stats.append(record.stats)
            if self.failed is not None:
                continue
            name = record.stats.name
            if copy_all or (self.patterns and self.chooses(name)):
                self._copy(buffer, record, makers, copy_all)
        buffer.values_from_hits |= copy_all

    def _screen_unscreened(self, records: list[Any]) -> None:
        """Deferred mode leaves a clean phase's activations unscreened; a dumped step holds
        statistics of every watched tensor, so it screens them (its own cost): on the host one
        by one, on a device all in one transfer (one synchronization, as batched checks do)."""
        batch, slots = StatsBatch(), []
        for record in records:
            tensor = record.held()
            if tensor is None:
                continue
            # With the mean (one sum gives both): two dumps part where an activation's does,
            # the model's inputs included (two ranks fed different batches).
            if on_host(tensor):
                self.session.screen(record, tensor, (MEAN,))
            else:
                wanted = record.wanted if MEAN in record.wanted else (*record.wanted, MEAN)
                slots.append((record, wanted, batch.add_parts(*device_parts(tensor, wanted))))
        values = batch.flush() if slots else []
        for record, wanted, slot in slots:
            record.stats.values = dict(zip(wanted, values[slot], strict=True))
            record.lazy = False

    def _copy(self, buffer: _StepBuffer, record: Any, makers: dict[tuple[str, Any], Any],
              at_hit: bool) -> None:  # fmt: skip
        tensor = record.held()
        if tensor is None or tensor.layout != torch.strided:
            return
        nbytes = tensor.numel() * tensor.element_size()
        if buffer.value_bytes + nbytes > self.value_budget:
            if not self._said_budget:
                self._said_budget = True
                budget = self.value_budget // 2**20
                self._say(f"step {buffer.step}: values past retain_bytes={budget} MiB were not "
                          "dumped (their statistics were)")  # fmt: skip
            return
        # The device-to-host copy: the one cost the training thread pays for values.
        copied = tensor.detach().to("cpu", copy=True)
        name, phase = record.stats.name, record.stats.phase
        earlier = buffer.at_hit.pop(name, None)
        if earlier is not None and earlier != phase and name in buffer.values:
            # A weight that hit in attach's check (or in the forward) and is checked again
            # after the update: its value at the hit stays, beside the later one.
            buffer.values[(name, earlier)] = buffer.values.pop(name)
        buffer.values[name] = copied
        if at_hit:
            buffer.at_hit[name] = phase
        buffer.value_bytes += nbytes
        # Every dumped value keeps where it came from (a hit step's, and a periodic step's
        # dump_tensors): the replay's Provenance tab shows it.
        try:
            from tensordbg.sources.provenance import provenance

            maker = makers.get((record.stats.name, record.stats.ref))
            where = (maker["module"], maker["call"]) if maker is not None else (None, 0)
            buffer.provenance[id(record.stats)] = provenance(self.session, record, *where)
        except Exception:  # provenance is a courtesy; the values matter
            pass

    def _halt(self, step: int, records: list[Any]) -> None:
        """The training is about to stop on a hit: write the step so far, and wait for it."""
        buffer = self._at(step)
        if self.failed is not None:
            return
        self._phase(step, records, halting=True)
        done = threading.Event()
        self._submit(self._job(buffer, None, done), keep=True)
        done.wait(timeout=60)

    def _finish(self, step: int, numbers: dict[str, Any] | None) -> None:
        """A step ended: hand it to the writer if it is to be written."""
        buffer = self._buffer if self._buffer.step == step else _StepBuffer(step)
        self._buffer = _StepBuffer(step + 1)
        if self.failed is not None or not (buffer.hits or self.periodic(step)):
            return
        self._submit(self._job(buffer, numbers, None), keep=bool(buffer.hits))

    def _job(self, buffer: _StepBuffer, numbers: dict[str, Any] | None,
             done: threading.Event | None) -> _Job:  # fmt: skip
        modules = None
        if not self._modules_written:
            self._modules_written = True
            modules = _modules(self.session)
        return _Job(buffer.step, list(buffer.stats), dict(buffer.values), dict(buffer.provenance),
                    [dict(h) for h in buffer.hits], modules, numbers, done,
                    buffer.value_bytes)  # fmt: skip

    def _submit(self, job: _Job, keep: bool) -> None:
        with self._queued_lock:
            room = keep or self._queued_bytes + job.nbytes <= QUEUE_STEPS * self.value_budget
            if room:
                self._queued_bytes += job.nbytes
        if keep:
            self._queue.put(job)  # a hit step waits for room: it is never dropped
            return
        if room:
            try:
                self._queue.put_nowait(job)
                return
            except queue.Full:  # too many steps waiting, however small
                with self._queued_lock:
                    self._queued_bytes -= job.nbytes
        self.dropped.append(job.step)
        if job.modules is not None:
            self._modules_written = False
        if not self._said_behind:
            self._said_behind = True
            self._say(f"the dump writer fell behind at step {job.step}: periodic steps are "
                      "dropped until it catches up (steps with hits never are)")  # fmt: skip

    def close(self) -> None:
        """Write what is pending (a step with hits that did not end), then finish the dump."""
        if self._thread is None:
            return
        self._unsubscribe()
        buffer = self._buffer
        if buffer.hits and self.failed is None:
            self._phase(buffer.step, list(self.session.phases.records), halting=True)
            self._submit(self._job(buffer, None, None), keep=True)
        self._queue.put(None)
        self._thread.join(timeout=120)
        self._thread = None  # type: ignore[assignment]
        # The steps the run went through, dumped or not: a diff tells a clean run that went
        # past another's hit from one whose dump ends before it.
        self.writer.meta["last_step_run"] = self.session.step - 1
        if self.dropped:
            reason = f"the writer fell behind and dropped periodic steps {_steps(self.dropped)}"
            self.writer.close(complete=False, reason=self.failed or reason)
        else:
            self.writer.close(complete=self.failed is None)
        steps, root = self.writer.steps_written, self.writer.root
        if self.failed and self.session.rank == 0:  # the last word on the dump says it stopped
            dumped = f"{plural(steps, 'step')} dumped" if steps else "no step dumped"
            print(f"tensordbg: {dumped} in {root}, then writing stopped: {self.failed}",
                  file=sys.stderr)  # fmt: skip
        elif steps and self.session.rank == 0:  # where to look, once (a job's ranks share it)
            print(f"tensordbg: {plural(steps, 'step')} dumped in {root}: tensordbg "
                  f"replay {root}, tensordbg check {root}", file=sys.stderr)  # fmt: skip
            if gone := len(self.writer.evicted_hits):
                print(f"tensordbg: {plural(gone, 'step')} with hits went to keep the "
                      f"dump under max_bytes={self.writer.max_bytes:,} (the first step with hits "
                      "and the newest stay)", file=sys.stderr)  # fmt: skip
        elif self.session.rank == 0:  # a clean run: the dump is there, and why it is empty
            print(f"tensordbg: no step dumped in {root}: none hit (a step is dumped when it "
                  "hits, and every N-th with dump_every=N)", file=sys.stderr)  # fmt: skip

    # --- the writer thread -------------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                if self.failed is None:
                    self._write(job)
            except Exception as e:
                self.failed = f"writing step {job.step} failed ({e}); later steps are missing"
                self.writer.fail(self.failed)
                self._say(f"{self.failed}. The training goes on without dumps.")
            finally:
                with self._queued_lock:
                    self._queued_bytes -= job.nbytes
                if job.done is not None:
                    job.done.set()

    def _write(self, job: _Job) -> None:
        entries: list[dict[str, Any] | fmt.Encoded] = []
        for stats in job.stats:
            prov = job.provenance.get(id(stats))
            if prov is None:
                entries.append(self._encoder.encode(_static(stats), _values(stats)))
                continue
            entry = _entry(stats)
            entry["provenance"] = prov
            entries.append(entry)
        values = {key: _numpy(t) for key, t in job.values.items()}
        self.writer.write_step(job.step, self.writer.rank, entries, values, job.hits,
                               modules=job.modules, numbers=job.numbers)  # fmt: skip

    def _say(self, message: str) -> None:
        # One line for a person, not a warning pointing into tensordbg's own source.
        print(f"tensordbg: {message}", file=sys.stderr, flush=True)
        log = getattr(self.session, "log", None)
        if log is not None and threading.current_thread() is not self._thread:
            log(message, "warning")


def check_settings(every: Any, max_bytes: Any) -> None:
    """ValueError when ``dump_every`` or ``dump_max_bytes`` is not one a dump can use (as
    ``tensordbg run`` refuses --dump-every 2.5 or --dump-max-bytes 0).

    >>> check_settings(2.5, None)
    Traceback (most recent call last):
    ValueError: dump_every is a number of steps, at least 1 (or None: hits only), not 2.5
    """
    for name, value, what in (("dump_every", every, "a number of steps, at least 1 (or None: "
                               "hits only)"),
                              ("dump_max_bytes", max_bytes, "a number of bytes, at least 1 (or "
                               "None: no bound)")):  # fmt: skip
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} is {what}, not {value!r}")


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    """A host tensor as numpy, bit for bit (bfloat16 and float8 through ml_dtypes)."""
    view = _VIEWS.get(tensor.dtype)
    tensor = tensor.contiguous()
    if view is not None:
        return tensor.view(view[0]).numpy().view(numpy_dtype(view[1]))
    return tensor.numpy()


def _values(stats: TensorStats) -> dict[Any, float | int]:
    """A tensor's statistics as the index holds them (keys are written with ``str``)."""
    values: dict[Any, float | int] = {}
    for stat, value in stats.values.items():
        try:
            values[stat] = float(value)
        except (TypeError, ValueError):
            continue
    if stats.summary is not None:
        # The summary's moments are over the finite values; a kernel's min or max of a tensor
        # holding a NaN is that NaN (one aminmax, in a range rule's hook): the summary's win.
        known = {str(stat): stat for stat in values}
        for key, value in stats.summary.as_dict().items():
            stat = known.get(key, key)
            if stat not in values or (math.isnan(values[stat]) and _finite(value)):
                values[stat] = value
    return values


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _static(stats: TensorStats) -> tuple[Any, ...]:
    """A tensor's index entry but its statistics (:attr:`EntryEncoder.FIELDS`): the same from
    one step to the next."""
    return (stats.name, stats.module, stats.phase, stats.kind, stats.shape, stats.dtype,
            stats.module_type, stats.call, stats.trainable)  # fmt: skip


def _entry(stats: TensorStats) -> dict[str, Any]:
    entry = dict(zip(fmt.EntryEncoder.FIELDS, _static(stats), strict=True))
    entry["shape"] = list(stats.shape)
    entry["stats"] = {str(key): value for key, value in _values(stats).items()}
    return entry


def _modules(session: Any) -> list[dict[str, Any]]:
    model = session.model
    if model is None:
        return []
    calls = session.published.calls
    return [
        {
            "path": path,
            "type": type(module).__name__,
            "depth": path.count(".") + 1 if path else 0,
            "params": parameter_count(module),
            "hits": 0,
            "calls": calls.get(path, 0),
            "stats": {},
        }
        for path, module in model.named_modules()
    ]


def _run_meta(session: Any) -> dict[str, Any]:
    rules = []
    for active in list(session.rules):
        rule = active.rule
        try:
            params = {k: _plain(v) for k, v in rule.params().items()}
        except Exception:
            params = {}
        rules.append({"id": active.id, "name": rule.name, "enabled": active.enabled,
                      "params": params, "match": list(rule.match),
                      "exclude": list(rule.exclude), "kinds": sorted(rule.kinds)})  # fmt: skip
    return {
        "run_id": session.run_id,
        "torch_version": torch.__version__,
        "device": str(session.device),
        "argv": list(sys.argv),
        "sync": session.mode,
        "interval": session.interval,
        "rules": rules,
    }


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return value
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


def _steps(steps: list[int]) -> str:
    shown = ", ".join(str(s) for s in steps[:10])
    return shown + (f" and {len(steps) - 10} more" if len(steps) > 10 else "")
