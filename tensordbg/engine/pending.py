"""The forward log: what the module hooks of a root's children only note, in deferred checks,
and the root forwards whose calls and records are not made yet (on the host, while nothing
shows a problem).

The hooks note each call (:class:`ForwardLog`, part of capture.py's :class:`Capture`). When the
root returns with finite outputs, a light pass over the log finds what the backward pass needs
to know (which tensors need a gradient, which module made each, for the vouchers of
engine/vouching.py) without making a call or a record. The calls and records are made from the
log only when something needs them: the phase shows a problem (the loss is NaN), the training
pauses, a backward pass shows a problem, a later root forward of the step shares tensors with
it. When the forward phase ends the log lets go of the tensors (what they were is kept:
:class:`TensorMeta`), as the phase's records let go of theirs.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tensordbg.engine.records import Record, version_of
from tensordbg.statistics import MEAN
from tensordbg.statistics.torch_kernels import dtype_name, host_stats

Seen = tuple[str, torch.Tensor, int, Any]
"""A tensor as a forward hook saw it: its path in the value, itself, its version, and how to hook
its gradient (the autograd node that made it and its output number; None for a leaf that needs a
gradient; False when it needs none)."""

COLD = (-1, math.nan)  # an output not screened in its hook: no version of it
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # as watchable(): subclasses are not read
_STRIDED = torch.strided


class LightCall:
    """A module call as the light pass sees it: what the vouchers ask of a :class:`Call`."""

    __slots__ = ("inputs", "path")

    def __init__(self, path: str) -> None:
        self.path = path
        self.inputs: list[tuple[str, Any]] = []


class LightTensor:
    """A forward tensor noted in the log, stood for until its record is made (``record``): what
    the vouchers ask of a :class:`Record`, its dtype and its size (of one that needs a
    gradient: its gradient's, which a voucher may keep)."""

    __slots__ = ("dtype", "nbytes", "producer", "record")

    def __init__(self, producer: LightCall | None, dtype: str, nbytes: int = 0) -> None:
        self.producer = producer
        self.dtype = dtype
        self.nbytes = nbytes
        self.record: Record | None = None


class TensorMeta:
    """What a let-go tensor was, for the record that may still be made of it (its shape, dtype
    and size; the version the hook saw is in the log)."""

    __slots__ = ("__weakref__", "_nbytes", "dtype", "shape")
    _version = 0  # (a record made of it takes the version its hook saw, from the log)

    def __init__(self, t: Any) -> None:
        self.shape = t.shape
        self.dtype = t.dtype
        self._nbytes = t.nbytes

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        n = self.numel()
        return self._nbytes // n if n else 0


Entry = tuple[Any, list[Any], Any, Any]
"""An entry of the forward log: (module key or None at a return, what the hook saw, site, call)."""


class PendingForward:
    """A root forward noted in the log and not made into calls and records (see the module's
    docstring). ``mark``: where its events go in the phase's pending events."""

    def __init__(self, root: Any, log: list[Entry], mark: int, counts: dict[int, int],
                 phase: int) -> None:  # fmt: skip
        self.root = root
        self.log = log
        self.mark = mark
        self.start_counts = counts
        """Each module's calls before it in the step (its calls' indices start there)."""
        self.phase = phase
        """The forward phase it belongs to (the session's count of phases)."""
        self.lights: list[Any] = []
        """One per tensor noted in the log, in the order a replay meets them: the light
        tensor that stands for it, or the record it already has (the root's inputs)."""
        self.counts: dict[str, int] = {}
        """Each module's calls in it."""
        self.released = False

    def light_pass(self, paths: dict[int, str], known: Any
                   ) -> tuple[list[tuple[Any, Any, int, str]], list[tuple[Any, Any]]]:  # fmt: skip
        """Walk the log as a replay would, without making calls or records: the tensors that
        need a gradient, made by autograd nodes as ``(light tensor, node, output number,
        dtype)`` and leaves as ``(light tensor, tensor)``. ``known(t, version)``: the record
        of a tensor seen before this root's children (its inputs)."""
        seen: dict[int, tuple[int, Any]] = {}  # id -> (version, light tensor)
        stack: list[LightCall] = [LightCall(self.root.path)]
        lights, counts, needing, leaves = self.lights, self.counts, [], []
        for key, entries, _, _ in self.log:
            if key is not None:
                call = LightCall(paths[key])
                counts[call.path] = counts.get(call.path, 0) + 1
            else:
                call = stack.pop()
            for suffix, t, version, node in entries:
                found = seen.get(id(t))
                if found is not None and found[0] == version:
                    light = found[1]
                else:
                    record = known(t, version)
                    if record is not None:
                        light = record  # one of the root's inputs: its record is made
                    else:
                        light = LightTensor(call if key is None else None, dtype_name(t.dtype),
                                            t.nbytes if node else 0)  # fmt: skip
                        if node:
                            needing.append((light, *node, light.dtype))
                        elif node is None:
                            leaves.append((light, t))
                    seen[id(t)] = (version, light)
                lights.append(light)
                if key is not None:
                    call.inputs.append((suffix, light))
            if key is not None:
                stack.append(call)
        return needing, leaves

    def let_go(self) -> None:
        """Keep what the log's tensors were, not the tensors (the forward phase ended)."""
        if self.released:
            return
        metas: dict[int, TensorMeta] = {}
        log = []
        for key, entries, site, _ in self.log:
            kept = []
            for suffix, t, version, node in entries:
                meta = metas.get(id(t))
                if meta is None:
                    meta = metas[id(t)] = TensorMeta(t)
                kept.append((suffix, meta, version, node))
            log.append((key, kept, site, None))
        self.log, self.released = log, True

    def resolve(self, records: list[Record]) -> None:
        """The records a replay made, one per tensor noted, in the order it met them."""
        for light, record in zip(self.lights, records, strict=True):
            if isinstance(light, LightTensor) and light.record is None:
                light.record = record


def resolved(forward: Any) -> Record:
    """The record a forward tensor stands for (made by now)."""
    record = forward.record if isinstance(forward, LightTensor) else forward
    assert record is not None, "a light tensor's record is made before it is used"
    return record


class ForwardLog:
    """Part of :class:`~tensordbg.engine.capture.Capture`: the forward log (what the module
    hooks of a root's children only note) and the root forwards left pending. Its attributes
    are the capture's (``_log``, ``stack``, ``_counts``, ``pending`` ...)."""

    def _defer(self, seen: list[Any]) -> None:
        """The root returned with finite outputs, in deferred checks on the host: its calls and
        records are not made (pending.py); the light pass tells what the backward needs."""
        root = self.stack.pop()
        log = [*(self._end_log() or ()), (None, seen, None, None)]
        pending = PendingForward(root, log, self.session.phase_mark(), dict(self._counts),
                                 self.session.phase_serial)  # fmt: skip
        needing, leaves = pending.light_pass(self.paths, self._known)
        for light, t in leaves:  # a leaf handed to a module (a parametrization's weight)
            self.grad_hooks.hook_leaf(t, light)
        for path, n in pending.counts.items():
            self.calls_since_pass[path] = self.calls_since_pass.get(path, 0) + n
        for key, *_ in log:
            if key is not None:
                self._counts[key] = self._counts.get(key, 0) + 1
        self.pending.append(pending)
        planning, self._planning = self._planning, []
        self._hook_planned(planning + needing, pending.lights[-len(seen) :] if seen else [], seen)
        self.grad_hooks.watch_waiting()  # a lazy module's parameters have their shapes now
        self.session.end_forward(root, listed=False, deferred=any(n for *_, n in seen))

    def materialize(self, phase: int | None) -> None:
        """Make the calls and records of the step's pending forwards, as a replay at the
        root's end would have: into the phase of number ``phase`` (registered, kept, unlisted)
        for the one of that phase, as structure only (no phase's) for the others."""
        pendings, self.pending = self.pending, []
        for pending in pendings:
            structure = pending.phase != phase or pending.released
            counts, self._counts = self._counts, dict(pending.start_counts)
            self._made, self._structure, self._listing = [], structure, False
            self.stack.append(pending.root)
            try:
                self._replay(pending.log)
                pending.resolve(self._made)
            finally:
                self._counts = counts
                self._made, self._structure, self._listing = None, False, True
                self.stack.clear()
            if not structure:
                self.session.unlisted(pending.root, pending.mark)

    def let_go(self) -> None:
        """The forward phase ended: the pending forwards keep what their tensors were, not the
        tensors, as the phase's records let go of theirs."""
        for pending in self.pending:
            pending.let_go()

    def call_counts(self) -> dict[str, int]:
        """How often each module was called in this step, pending forwards included."""
        counts = {path: len(calls) for path, calls in list(self.calls_by_path.items())}
        for pending in self.pending:
            for path, n in pending.counts.items():
                counts[path] = counts.get(path, 0) + n
        return counts

    # --- records --------------------------------------------------------------------------------

    def _hook_planned(self, planning: list[tuple[Any, Any, int, str]], outputs: list[Any],
                      seen: list[Any]) -> None:  # fmt: skip
        """Hook the gradients the session cannot vouch for; the model's outputs (``outputs``,
        as their hooks ``seen`` them) start the backward pass whatever they get."""
        roots = [node[0] for *_, node in seen if node]
        hooks = self.session.plan_gradients(planning, self.calls_since_pass, roots)
        for record, node, output_nr in hooks:
            self.grad_hooks.hook_node(record, node, output_nr)
        hooked = {id(record) for record, _, _ in hooks}
        for record, (_, _, _, node) in zip(outputs, seen, strict=True):
            if node and id(record) not in hooked:
                node[0].register_prehook(self.session.pass_started)

    def _note(self, leaves: list[tuple[str, torch.Tensor]]) -> list[Seen] | None:
        """What a noted call's hook sees of its tensors (as :func:`_as_seen`, in one loop),
        counted against the log's budget; None when one of them is of a dtype whose rules must
        see it at once (a float16 activation, for the range rules): then the log is replayed
        and the rest of the forward is handled in its hooks. A tensor the hook before noted
        (a call's input is most often the output of the call before it) is taken from there
        when it is the same version and still needs a gradient (``detach_()`` keeps the
        version): 2 reads of it instead of 8, ~1.5 us each in the cold cache a module's kernels
        leave behind. What is kept of a tensor: (itself, version, requires_grad, gradient
        edge, bytes)."""
        seen: list[Seen] = []
        total = self._log_bytes
        before, noted = self._last_noted, []
        for suffix, t in leaves:
            for was in before:
                if was[0] is t and was[1] == version_of(t) and was[2] is t.requires_grad:
                    break
            else:  # (not a method of its own: most outputs are new, and a call costs a miss)
                if type(t) not in _PLAIN or t.layout is not _STRIDED or t.is_meta:
                    continue
                dtype = t.dtype
                if dtype not in self._log_dtypes:
                    if dtype.is_floating_point:
                        return None
                    continue
                nbytes = t.nbytes
                if not nbytes:
                    continue
                edge = grad_edge(t)
                was = (t, version_of(t), edge is not False, edge, nbytes)
            total += was[4]
            seen.append((suffix, t, was[1], was[3]))
            noted.append(was)
        self._log_bytes, self._last_noted = total, noted
        return seen

    def _noted(self) -> None:
        """The log grew: replay it when it passes the phase's budget, or when the training must
        stop at the next boundary (a pause, a change of rules)."""
        if self._log_bytes > self._log_room or self.session.boundary_wanted():
            self.replay()

    def replay(self, resume: bool = True) -> None:
        """Turn the module calls the hooks only noted into calls and records, in their order, in
        one warm loop (see :meth:`Sink.logs_forward`); ``resume``: note again after it."""
        log = self._end_log(keep_hot=True)
        self._replay(log or ())
        if resume and self.stack:
            self._start_log(whole=False)

    def _replay(self, log: list[Entry]) -> None:
        """Make the calls and records of ``log``'s entries, as their hooks would have."""
        for key, seen, site, invocation in log:
            if key is None:
                self._exit(seen)
            else:
                self._enter(key, seen, site, invocation)

    def _end_log(self, keep_hot: bool = False) -> list[Entry] | None:
        """End the log (its root returned, a replay, a new root): its entries. What the last
        hook noted goes with it, and the tensors it holds; ``keep_hot``: the outputs screened
        in their hooks stay, for a replay to read."""
        log, self._log = self._log, None
        self._log_bytes, self._last_noted = 0, ()
        if not keep_hot:
            self._hot = None
        return log

    def _start_log(self, whole: bool = True) -> None:
        """Note the calls from here on; ``whole``: from the root's start (else the log follows a
        replay in the middle of the forward, and only a whole log can be left pending)."""
        self._log_whole = whole
        self._log_dtypes = self.session.logs_forward()
        self._log = [] if self._log_dtypes else None
        self._log_room = self.session.log_budget()
        self._hot = {} if self._log is not None and self.session.screens_noted() else None

    def _screen_hot(self, seen: list[Seen]) -> None:
        """Screen a noted call's outputs now, while they are in the cache (a dumped step holds
        statistics of every watched tensor: read at the phase's end, they are out of it). The
        screen's one sum gives the mean too: two dumps part where an activation's mean does.
        On a device they are left to the dump, which reads them all in one transfer."""
        for _, t, version, _ in seen:
            if self._hot.get(id(t), COLD)[0] != version and self.session.sync.reads_free(t):
                mean = host_stats(t, (MEAN,))[0]
                if math.isfinite(mean):
                    self._hot[id(t)] = (version, mean)  # once: a wrapper returns its child's
                else:  # seen, so judged: the phase shows a problem (a sigmoid may hide it)
                    self.session.triggered = True


def grad_edge(t: torch.Tensor) -> tuple[Any, int] | bool | None:
    """Where ``t``'s gradient will come from, as a hook sees it now: the autograd node that made
    this version and its output number; None for a leaf; False when it needs no gradient."""
    if not t.requires_grad:
        return False
    node = t.grad_fn
    return None if node is None else (node, t.output_nr)
