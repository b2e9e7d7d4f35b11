"""The forward phase of the session's pipeline: module calls, their inputs and outputs, and the
model's outputs screened when the root returns.

Deferred checks note a root forward's module calls in its hooks (capture.py, pending.py). On
the host, while nothing needs them, a root forward whose outputs are finite makes no call and no
record: it is left pending, and made only when something asks (:meth:`materialize_forward`).
Its records then join the phase without events: a clean forward has nothing to judge or
attribute. When the model's outputs, the observed loss or a pause need them, they are listed in
execution order where the hooks would have put them (:meth:`ForwardPhase._list_forward`).

Part of :class:`~tensordbg.engine.session.Session`, like :mod:`.pipeline`, :mod:`.backward` and
:mod:`.optimizer`.
"""

from __future__ import annotations

from typing import Any

import torch

from tensordbg.engine.buffers import BufferWatch, Owner
from tensordbg.engine.origin import Verdict
from tensordbg.engine.phases import Enter, Exit
from tensordbg.engine.records import NONFINITE, Call, Record, new_record
from tensordbg.statistics.torch_kernels import SCREEN, dtype_name, host_stats, watchable

NOTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)  # logs_forward


class ForwardPhase:
    """Part of :class:`~tensordbg.engine.session.Session`: its forward hooks."""

    forward_bad = False
    """A forward of this step hit, or its outputs were not finite: its saved tensors may hold
    NaN or Inf, which a backward multiplies into gradients that no parameter's gradient can
    then vouch for (a derivative at NaN is NaN), so its backward is read whole, as eager
    checks read it (:meth:`~.backward.BackwardPhase.plan_gradients`)."""

    def begin_forward(self) -> None:
        """A root forward starts: close what is open, count the step, honour pause requests."""
        if self._detach_requested():
            return
        if any(p.phase == self.phase_serial for p in self.capture.pending):
            self.materialize_forward()  # it may share tensors with this one (a GAN's G and D)
        self._step_depth.clear()  # an optimizer step that raised is over
        self.end_unseen_pass()
        if self._forward_open or self.phases.busy():
            self._end_phase()
        if not self.optimizers and self._root_forwards:
            self._check_changed_parameters()
            self._end_step()
        if self._skip_dropped and self._steps_apart:
            # Done: the next gradients are new ones (a WGAN's critic, whose steps these are).
            # Stepping together, the step's later optimizers still have theirs to drop (a GAN's
            # generator, after its discriminator's forward and update).
            self._skip_requested = False
        self._root_forwards += 1
        if self._buffer_watch is None and (model := self.model) is not None:
            self._buffer_watch = BufferWatch(model)  # as the model is before its first forward
        if self._buffer_watch is not None:
            self._buffer_watch.begin()
        self._start_phase("forward")
        self._forward_open = True
        self.origins.begin_forward()
        self._boundary()

    def collect_input(self, call: Call, record: Record, tensor: torch.Tensor) -> None:
        """An input made by code between modules: collected as any tensor, in every mode (a
        NaN the call hides, ``nan_to_num``, is still seen: eager screened such an input only
        once the call's output showed a problem, and missed it)."""
        self.collect(record, tensor)

    def enter(self, call: Call) -> None:
        self._process(Enter(call))

    def exit(self, call: Call) -> None:
        self._process(Exit(call))

    def lists_forward(self) -> bool:
        """Whether a root forward's calls and records join the phase's events as its hooks
        replay them: not in deferred checks on the host while nothing needs them (they are
        listed when the phase shows a problem: :meth:`_list_forward`)."""
        return (
            self.plan is None  # every gradient is hooked, against its record (several ranks)
            or self.triggered
            or self.dumps_all()
            or self.bus.wants("phase_end")
        )

    def defers_forward(self, seen: list[Any]) -> bool:
        """Whether a root forward that returned ``seen`` (its outputs as its hook saw them) is
        left pending (see pending.py): deferred checks on the host, when nothing needs its
        calls and records now and its outputs are finite (read here: the forward's guard)."""
        if self.origins.bad_since and self.sync.keeps_unscreened:
            # A parameter last seen NaN or Inf: the forward carries it, maybe masked before any
            # output (torch.where), and its backward's NaN is the parameter's. Read as eager
            # checks read it, or that backward would be named an origin of its own.
            self.forward_bad = self.triggered = True
            return False
        listed = self.lists_forward() or self.boundary_wanted()
        if listed and (self.plan is None or self.forward_bad):
            return False
        # Listed too (a dump's run): a forward whose outputs are not finite has its backward
        # read whole, or an activation gradient it makes not finite is judged from a voucher,
        # not counted (a dump made the hit "NaN or Inf, not counted" where one without said 4).
        if all(not watchable(t) or host_stats(t, SCREEN)[0] == 1.0 for _, t, _, _ in seen):
            return not listed
        self.forward_bad = True
        return False

    def keep_unlisted(self, record: Record, tensor: Any, structure: bool = False) -> None:
        """A forward record made while the forward is not listed: registered in the phase (the
        UI lists it) and kept for inspection, its statistics not computed. ``structure``: made
        for a later phase's need (a backward pass that shows a problem): numbered only."""
        if structure:
            self.phases.number(record)
            return
        self.phases.register(record)
        self.sync.retain(self, record, tensor)
        record.lazy = True

    def materialize_forward(self) -> None:
        """Make the calls and records of the step's pending forwards now (see pending.py):
        into the forward phase they belong to if it is the one under way."""
        if self.capture.pending:
            self.capture.materialize(self.phase_serial if self.phase == "forward" else None)

    def unlisted(self, root: Call, mark: int) -> None:
        """The records of a root forward were made without its events, which go at ``mark``
        in the phase's pending events if it shows a problem (:meth:`_list_forward`)."""
        self._unlisted = (root, mark)

    def phase_mark(self) -> int:
        """Where the events of what a hook sees now go in the phase's pending events."""
        return len(self.phases.pending)

    def _list_forward(self) -> None:
        """The phase shows a problem: the unlisted forward's calls and records join its events
        where the hooks would have put them, in execution order, before what came after."""
        unlisted, self._unlisted = self._unlisted, None
        if unlisted is None:
            return
        root, mark = unlisted
        pending = self.phases.pending
        after = pending[mark:]
        del pending[mark:]
        self._list_call(root)
        pending += after

    def _list_call(self, call: Call) -> None:
        pending = self.phases.pending
        if call.parent is not None:  # the root's own start was listed when it came
            for _, record in call.inputs:
                if record.producer is None and record.consumers[0] is call and record.hidden:
                    self._list_record(record)
            pending.append(Enter(call))
        for child in call.children:
            self._list_call(child)
        for _, record in call.outputs:
            if record.producer is call:
                self._list_record(record)
        pending.append(Exit(call))

    def _list_record(self, record: Record) -> None:
        """What :meth:`collect` does for a record already registered and kept."""
        silent = self._applicable(record)
        tensor = record.held()
        if record.wanted and tensor is not None:
            self.sync.collect(self, record, tensor, silent, record.tensor is not None)

    def end_forward(self, root: Call, listed: bool = True, deferred: bool | None = None) -> None:
        """The root forward returned. Deferred mode screens the model's outputs now. With a
        backward to come, the forward phase stays open so the loss observed after it joins it;
        otherwise it ends here. ``listed``: its calls and records joined the phase's events
        (else :meth:`_list_forward` lists them if the phase shows a problem). ``deferred``:
        they were not made (its outputs were screened finite), and whether one needs a
        gradient."""
        self._screen_buffers()
        if deferred is not None:
            self._after_hook()
            if not (torch.is_grad_enabled() and deferred):
                self._end_phase()
            return
        if not listed:
            self.unlisted(root, self.phase_mark())
        for _, record in root.outputs:
            if not listed and record.producer is not None and not record.wanted:
                self._applicable(record)  # an unlisted output: its screen is wanted all the same
            tensor = record.tensor if listed else record.held()
            if record.lazy and tensor is not None:
                if self.sync.on_device:  # judged with the phase's transfer
                    self.sync.to_batch(self, record, tensor)
                    continue
                self.screen(record, tensor)
                if record.stats.nonfinite:
                    self.triggered = True
        self._after_hook()
        backward_expected = torch.is_grad_enabled() and any(r.grad_hooked for _, r in root.outputs)
        if not backward_expected:
            self._end_phase()

    _buffer_watch: BufferWatch | None = None
    _buffers_written: list[tuple[Owner, str, torch.Tensor]] | None = None

    def _screen_buffers(self) -> None:
        """At a root forward's end: the buffers it wrote (BatchNorm's running statistics),
        judged at the phase's end (:meth:`_judge_buffers`; see :mod:`.buffers`)."""
        watch = self._buffer_watch
        changed = watch.changed() if watch is not None else []
        if changed:
            self._buffers_written = (self._buffers_written or []) + changed

    def _buffers_to_batch(self) -> None:
        """On a device: the norms of the buffers the phase's forwards wrote join its transfer."""
        written = self._buffers_written
        if written and self.sync.on_device and self._buffer_watch is not None:
            self.phases.buffer_norms = self.phases.batch.add_parts(
                self._buffer_watch.norms(written), None)  # fmt: skip

    def _judge_buffers(self) -> None:
        """At the phase's end, after its other hits: each buffer its forwards wrote that is
        not finite is a hit, once while it stays so. On the host the sum of their norms is
        read now; on a device it came with the transfer. Read one by one only when it is not
        finite."""
        written, self._buffers_written = self._buffers_written, None
        watch = self._buffer_watch
        if not written or watch is None:
            return
        if self.sync.on_device:
            finite, self.phases.buffers_finite = self.phases.buffers_finite, True
        else:
            finite = watch.all_finite(written)
        if finite:
            watch.fired.difference_update(name for _, name, _ in written)
        else:
            watch.read_each(written, self._report_buffer)

    def _report_buffer(self, owner: Owner, name: str, tensor: torch.Tensor) -> None:
        """A buffer not finite: a record in the forward phase, judged by the rules that look
        at buffers. Its forward is the origin, unless that forward's own NaN or Inf came
        first (a bad batch: the buffer took it in), or the model came with it."""
        tensor = tensor.detach()
        record = new_record(tensor, name, "buffer", self.phase, self.step, module=owner.path,
                            module_type=owner.type_name)  # fmt: skip
        watch = self._buffer_watch
        record.before_update = watch is not None and name in watch.came_bad
        if watch is not None:
            watch.came_bad.discard(name)
        self._read_alone(record)
        self.screen(record, tensor)
        self.phases.register(record)
        self.judge(record, tensor)
        made_here = True
        for h in reversed(self.hits):  # the step's hits are the last ones
            if h.step != self.step:
                break
            made_here = made_here and not (h.origin and h.phase == self.phase)
        for rule_id, finding in record.findings.items():
            self._hit(Verdict(record, rule_id, finding, made_here))

    def _read_alone(self, record: Record) -> None:
        """Give a record read out of turn (a parameter, a buffer) its rules and what they
        want: its screen at least."""
        applicable = self.ruleset.applicable(record.stats)
        record.rule_ids, record.checks = applicable.rule_ids, applicable.checks
        record.wanted = applicable.wanted or SCREEN

    def logs_forward(self) -> frozenset[torch.dtype]:
        """Activation dtypes whose module calls the hooks may only note (see capture.py): in
        deferred mode until a problem shows, those whose rules speak only of NaN and Inf."""
        if not self.sync.notes_forward(self.triggered):
            return frozenset()
        return frozenset(d for d in NOTED_DTYPES if self.ruleset.activations_quiet(dtype_name(d)))

    def screens_noted(self) -> bool:
        """Whether the calls the hooks note have their outputs screened in the hook: on the
        host, on a step that is dumped whatever happens (its statistics are all wanted)."""
        return not self.sync.on_device and self.dumps_all()

    def log_budget(self) -> int:
        """The bytes the forward log may hold: what the phase may still keep (retain_bytes)."""
        return self.phases.retain_bytes - self.phases.retained

    def boundary_wanted(self) -> bool:
        """Whether another thread waits for a boundary (a pause, a rule change)."""
        return bool(self.control.pending or self.controller.pause_requested)

    def _check_own_params(self, call: Call) -> None:
        """A call about to be named the origin of a NaN/Inf: read its own parameters first.
        They were checked after the last step, but code may have changed them since (a weight
        set by hand, a load): then the parameter is the origin, and the sentence says so."""
        if not call.params or NONFINITE in call.fired_in or NONFINITE in call.origin_below:
            return
        if not any(NONFINITE in r.conditions for _, r in call.outputs):
            return
        for name in call.params:
            p = self.weights.by_name.get(name)
            if p is not None:
                self.read_param_whole(p)

    def read_param_whole(self, p: Any) -> None:
        """Read a parameter whole in the current phase, out of turn (a bad step's evidence):
        when it is not finite it is registered, judged and reported (a hit, the origin when it
        was not seen so before). Once per parameter while it stays so."""
        if p.name in self.origins.param_fired or not watchable(p.param):
            return
        record = p.record("param", p.name, self.step)
        record.stats.phase = self.phase
        self._read_alone(record)
        tensor = p.param.detach()
        self.screen(record, tensor)
        if record.stats.nonfinite:
            self.phases.register(record)
            self.judge(record, tensor)
            self.report(record)
