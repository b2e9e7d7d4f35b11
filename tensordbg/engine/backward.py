"""The backward phase of the session's pipeline: activation and parameter gradients.

Deferred checks on the host (the CPU's default) read as little as a clean pass allows. Each
parameter's gradient is measured when the pass ends, one norm each, without a hook of
their own: the gradients the pass made are those that changed. A parameter's gradient
vouches for the gradients of activations it sums (:mod:`.vouching`): those get no hook at all,
and the norms say whether they were finite. The gradients nothing vouches for are screened in
their hooks while they are in the cache. A pass whose norms or screens show a problem is read
in execution order at its end, so the origin is named as eager checks name it; a gradient
vouched for by a parameter that is not finite is then judged from it, not kept.

Deferred checks on a device note the gradients and keep them, to be read only if the pass shows
a problem (a read in a hook would synchronize); a float16 gradient, whose bias's sum may
overflow where it did not, is held until its bias's gradient is read (:class:`Vouchers`). Once
such a pass shows a problem, every gradient after it is collected where it is made, as in
eager mode.

Part of :class:`~tensordbg.engine.session.Session`, like :mod:`.pipeline` and :mod:`.optimizer`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tensordbg.engine.marks import hook_of_ours, own_work
from tensordbg.engine.param_grads import ParamGradients
from tensordbg.engine.pending import LightTensor, resolved
from tensordbg.engine.phases import ActGradNote, Gradient, Judged, ParamGradNote
from tensordbg.engine.records import Record, grad_record, is_model_output, param_grad_record
from tensordbg.engine.vouching import GradientPlan
from tensordbg.statistics import FINITE, NAN
from tensordbg.statistics.batch import norm_only
from tensordbg.statistics.torch_kernels import SCREEN, dtype_name, host_stats


class BackwardPhase(ParamGradients):
    """Part of :class:`~tensordbg.engine.session.Session`: its backward hooks (the parameter
    gradients at a pass's end: :class:`~.param_grads.ParamGradients`)."""

    plan: GradientPlan | None = None
    """The gradients vouched for at the end of the pass (deferred checks on the host), or None:
    every watched gradient has a hook (then parameters' too)."""
    _pass_bad = False
    """A gradient screened in its hook this pass was not finite (read at the pass's end)."""

    def begin_backward(self) -> None:
        """Called by every backward hook: the first one of a pass ends the forward phase and
        asks the autograd engine to call back at the end of the pass."""
        task = torch._C._current_graph_task_id()
        if task in self._backward_tasks and self.phase == "backward":
            return  # most hooks: the pass is under way
        if self.phase != "backward":
            if self._forward_open or self.phases.busy():
                self._end_phase()
            self._start_phase("backward")
        elif not self._backward_tasks and self.phases.busy():
            # A later pass of the step, with no forward between (a GAN's second loss, an
            # auxiliary one), not one inside a pass (reentrant checkpointing): what was
            # observed since the last pass is judged before this pass frees the graph its
            # operation is named from (batched checks would wait for the pass's end).
            self._end_phase()
            self._start_phase("backward")
        if task not in self._backward_tasks:
            self._backward_tasks.add(task)
            if self.plan is not None:  # the parameters have no hooks: which will it reach?
                self.note_pass_params()
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: self._end_backward(task)
            )
            if self.plan is not None and self.plan.planned:
                # What this pass computes without its voucher's gradient is hooked now.
                for record, node, output_nr in self.plan.not_computed():
                    self.capture.grad_hooks.hook_node(record, node, output_nr)

    def plans_gradients(self) -> bool:
        """Whether activation gradients are vouched for at the end of the pass (no hook)."""
        return self.plan is not None

    def hook_parameters(self) -> None:
        """Hook every parameter's gradient and every watched activation gradient from now on:
        several ranks (DDP) read a rank's own gradients before the all-reduce writes them."""
        if self.plan is not None:
            self.plan = None
            self.capture.grad_hooks.hook_parameters()

    @hook_of_ours
    @own_work
    def pass_started(self, grads: tuple) -> None:
        """The hook of a model output whose gradient is vouched for: it only starts the pass."""
        if not self.active:
            return
        try:
            self.begin_backward()
        except Exception as e:
            self.fault(e)

    def plan_gradients(self, seen: list[tuple[Any, Any, int, str]], calls: dict[str, int],
                       roots: list[Any]) -> list[tuple[Any, Any, int]]:  # fmt: skip
        """At a root forward's end: of its tensors that need a gradient (a record or what
        stands for it, the autograd node that made it, its output number, its dtype), those to
        hook; the others are vouched for at the end of the pass (see :mod:`.vouching`).
        ``calls``: each module's calls since the last pass; ``roots``: the autograd nodes of
        the forward's outputs."""
        if self.plan is None or self.forward_bad or self.dumps_gradients():
            # Every gradient is hooked: several ranks; a forward that showed a problem (its
            # saved NaN or Inf make gradients that no voucher can tell apart); or a dumped step
            # that keeps their values: read like eager.
            return [item[:3] for item in seen]
        quiet, loud = [], []
        for item in seen:
            if self.ruleset.grads_quiet(item[3]):
                quiet.append(item)
            else:
                loud.append(item[:3])
        return loud + self.plan.plan(quiet, calls, roots)

    def activation_grad(self, forward: Record, grad: torch.Tensor) -> None:
        """The gradient of a watched forward tensor. A clean deferred backward only notes it
        (it becomes a record only if the pass turns out bad); otherwise it is collected."""
        self.begin_backward()
        if self.plan is not None:
            self._screen_in_hook(forward, grad)
            return
        if (
            self.sync.notes_gradients(self.triggered)
            and not is_model_output(forward)
            and self.ruleset.grads_quiet(dtype_name(grad.dtype))
        ):
            if self.sync.reads_free(grad):  # read now, while it is in the cache
                same = self._same_as_loose(grad) if self._loose is not None else None
                note = self.vouchers.hold(forward, grad, self.weights.by_name, same)
                if note is not None:
                    self.phases.pending += [same, note] if same is not None else [note]
                    return
                if same is not None:  # that very tensor, and no bias vouches: read it now
                    self._loose = same
                    self._screen_loose()
                if not self.triggered:
                    # Screened when the next gradient comes: the very same tensor, most often,
                    # which a bias vouches for (a residual stream's, passed on by an addition).
                    self._loose = ActGradNote(forward, grad.shape, grad.dtype, grad)
                    self._loose_version = grad._version
                    return
            elif self.phases.take(grad.numel() * grad.element_size()):  # a read would sync: kept
                self.phases.pending.append(ActGradNote(forward, grad.shape, grad.dtype, grad))
                return
        self._collect_grad(forward, grad)

    def _screen_in_hook(self, forward: Record, grad: torch.Tensor) -> None:
        """Deferred on the host: a gradient nothing vouches for, screened while it is in the
        cache. Finite, it is only noted; else its statistics are taken now and the pass is
        read at its end (never in a hook: the vouched gradients' verdicts come only then)."""
        if self.ruleset.grads_quiet(dtype_name(grad.dtype)):
            if host_stats(grad, SCREEN)[0] == 1.0:
                kept = self.dumps_gradients() and self.phases.take(grad.nbytes)  # for its values
                note = ActGradNote(forward, grad.shape, grad.dtype, grad if kept else None)
                self.phases.pending.append(note)
                return
            self._pass_bad = True
        self._collect_late(grad_record(self._record_of(forward), grad, self.step), grad)

    def _record_of(self, forward: Any) -> Record:
        """The record of a forward tensor, made now if it was pending (engine/pending.py)."""
        if isinstance(forward, LightTensor) and forward.record is None:
            self.materialize_forward()
        return resolved(forward)

    def _collect_late(self, record: Record, tensor: torch.Tensor | None) -> None:
        """Register and measure a record now, to be judged and attributed at the end of the
        pass, in execution order."""
        self._prepare(record, tensor)
        if tensor is not None and record.wanted:
            self.screen(record, tensor)
        self.judge(record, tensor)
        if record.findings or record.conditions:
            self._pass_bad = True
        self.phases.pending += [Judged(record), Gradient(record)]

    def end_unseen_pass(self) -> None:
        """At a boundary (the optimizer's step, the next root forward): a backward pass that no
        hook saw (its loss reached no hooked tensor) changed parameter gradients: its end is
        checked here, as the autograd engine's callback would have."""
        if self.plan is None or self.phase == "backward" or not self.grads_changed():
            return
        if self._forward_open or self.phases.busy():
            self._end_phase()
        self._start_phase("backward")
        self._end_phase()

    def _judge_plan(self, noted: set[str]) -> None:
        """At the end of a pass on the host: the planned gradients' verdicts from their
        vouchers' norms. A pass that showed a problem is read in execution order."""
        assert self.plan is not None
        vouchers = self._vouchers(noted)
        finite = {name: stats.nonfinite is False for name, stats in vouchers.items()}
        self.plan.not_finite = {n for n in self.plan.not_finite if n not in finite} | {
            n for n, ok in finite.items() if not ok
        }
        clean, bad, unread, read = self.plan.judged(finite)
        listed = bad or self._pass_bad or self.triggered or self.dumps_all()
        if listed:  # the phase's records list every watched gradient, these as finite
            self.record_clean_gradients()
            forwards = [self._record_of(p.forward) for p in clean]
            self.phases.pending += [ActGradNote(f, *_like(f), None) for f in forwards]
        for p, grad in read:  # kept: read now that its voucher is not finite (finite or not)
            self._collect_late(grad_record(self._record_of(p.forward), grad, self.step), grad)
        for p in unread:  # its voucher says nothing of it: not read, no verdict
            forward = self._record_of(p.forward)
            record = grad_record(forward, None, self.step, _like(forward))
            record.voucher = p.voucher
            self._collect_late(record, None)
        for p in bad:
            forward = self._record_of(p.forward)
            record = grad_record(forward, None, self.step, _like(forward))
            # Its voucher takes every element of it: not finite, so is it. A NaN in it would be
            # one there too: a voucher without NaN (an Inf alone) shows that it holds an Inf.
            record.stats.values = {FINITE: 0.0}
            if vouchers[p.voucher].has_nan is False:
                record.stats.values[NAN] = 0.0
            record.voucher = p.voucher
            self._collect_late(record, None)
        self.capture.calls_since_pass = {}
        if bad or self._pass_bad:
            self.triggered = True
        if listed:
            self._in_execution_order()
            if not self.triggered:  # a dumped step: its notes are read now (else when settled)
                self._read_notes(gradients_of_activations=True)

    def _vouchers(self, noted: set[str]) -> dict[str, Any]:
        """The statistics of each parameter gradient of this pass (``noted``), as its record
        has them; screened now where no rule asked (a rule on activation gradients only)."""
        found: dict[str, Any] = self._clean_gradients()
        for record in self.phases.records:
            if record.stats.kind == "grad" and record.param in noted:
                stats = record.stats
                if FINITE not in stats.values and (grad := record.held()) is not None:
                    stats.values[FINITE] = host_stats(grad, SCREEN)[0]
                found[record.param] = stats
        return found

    def _in_execution_order(self) -> None:
        """Put the pass's events in an order autograd could have run them in: an activation's
        gradient before those of what made it (reverse forward order), a parameter's gradient
        right after its module's output gradients. Planned gradients had no hook to place them."""
        key: float = math.inf
        keyed = []
        by_param: dict[str, float] = {}
        for i, event in enumerate(self.phases.pending):
            record = getattr(event, "record", None)
            forward = getattr(event, "forward", None)
            if forward is not None:
                event.forward = forward = self._record_of(forward)
                key = -forward.stats.ref
            elif record is not None:
                key = self._execution_key(record, by_param, key)
            elif type(event) is ParamGradNote:
                key = self._param_key_of(event.name, by_param)
            keyed.append((key, i, event))
        keyed.sort(key=lambda k: (k[0], k[1]))
        self.phases.pending = [event for _, _, event in keyed]
        self._records_late = True

    _records_late = False
    """This pass registered records at its end (vouched gradients, parameter gradients read
    there): the phase's records are put in execution order before it is published."""

    def _records_in_execution_order(self) -> None:
        """The phase's records in the order :meth:`_in_execution_order` gives its events, so
        that the UI, a dump and ``tensordbg check`` number them as autograd made them (a record
        of another kind keeps its place after the one before it)."""
        self._records_late = False
        key: float = -math.inf
        keyed = []
        by_param: dict[str, float] = {}
        for i, record in enumerate(self.phases.records):
            key = self._execution_key(record, by_param, key)
            keyed.append((key, i, record))
        keyed.sort(key=lambda k: (k[0], k[1]))
        self.phases.records = [record for _, _, record in keyed]

    def _execution_key(self, record: Record, by_param: dict[str, float], last: float) -> float:
        """Where a record's gradient comes in a pass (smaller first): an activation's after
        the gradients of what it fed, a parameter's right after its module's output gradients;
        a record of another kind keeps its place after the one before it (``last``)."""
        if record.grad_of is not None:
            return -record.grad_of.stats.ref
        if record.stats.kind == "grad" and record.param:
            return self._param_key_of(record.param, by_param)
        return last

    def _param_key_of(self, name: str, by_param: dict[str, float]) -> float:
        if name not in by_param:
            by_param[name] = self._param_key(name)
        return by_param[name]

    def _param_key(self, name: str) -> float:
        refs = [r.stats.ref for call in self._owner_calls(name) for _, r in call.outputs]
        rank = self.plan.param_order.get(name, 0) if self.plan is not None else 0
        return 0.5 - min(refs) + rank * 1e-3 if refs else math.inf

    def _collect_grad(self, forward: Record, grad: torch.Tensor) -> None:
        record = grad_record(forward, grad, self.step)
        self.collect(record, grad)
        self._process(Gradient(record))

    def _same_as_loose(self, grad: torch.Tensor) -> ActGradNote | None:
        """The note of the gradient that waited for this one, if it is this very tensor (not
        changed in place since), taken; any other waiting gradient is screened now."""
        loose = self._loose
        if loose is not None and loose.grad is grad and grad._version == self._loose_version:
            self._loose = None
            return loose
        self._screen_loose()
        return None

    def _screen_loose(self) -> None:
        """Screen the gradient that waited for the next one (it was not that very tensor):
        finite, it is noted; else the pass is read from it on."""
        loose, self._loose = self._loose, None
        if loose is None:
            return
        if host_stats(loose.grad, SCREEN)[0] == 1.0:
            loose.grad = None
            self.phases.pending.append(loose)
            return
        self.triggered = True  # not finite: the pass is read from here on
        self._collect_grad(loose.forward, loose.grad)

    @own_work
    def param_grad(self, name: str, owner: str, owner_type: str, grad: torch.Tensor) -> None:
        """A parameter's gradient is final for this backward pass. Deferred mode only notes it
        here (a hook runs cold) and judges all of them together when the pass ends."""
        self.begin_backward()
        if self._loose is not None:
            self._screen_loose()
        if self.vouchers.awaiting and not self.vouchers.settle(name, grad):
            self.triggered = True  # a gradient it vouches for may hold the NaN: read them
        if self.capture.empty_calls and self.capture.fed_nothing(owner):
            return  # zeros that no data made (an expert no token chose): as if not reached
        if self.sync.notes_gradients(self.triggered):
            self.phases.pending.append(ParamGradNote(name, owner, owner_type, grad))
            return
        record = param_grad_record(name, owner, owner_type, grad, self.step)
        self.collect(record, grad)
        self._process(Gradient(record))

    def _read_notes(self, gradients_of_activations: bool = False) -> None:
        """Deferred mode: turn the gradients the hooks only noted into records, in their place
        in execution order, in one warm loop. Parameter gradients always (at the end of a
        pass: what they show decides about the rest); activation gradients too once the pass
        showed a problem. Gradients whose rules ask only whether they are finite and their
        norm are measured together (:func:`norms_of`: one pass over all of them)."""
        self._judge_light()
        notes = (ParamGradNote, ActGradNote) if gradients_of_activations else (ParamGradNote,)
        pending = self.phases.pending
        together, self._by_norm = self._by_norm, []  # noted with their records: measured below
        if not any(type(e) in notes for e in pending):
            self._judge_norms(together)
            return
        self.phases.pending = []
        for event in pending:
            if type(event) not in notes:
                self.phases.pending.append(event)
                continue
            if type(event) is ParamGradNote:
                record, kept, silent, by_norm = self._param_grad_record(event)
            elif event.grad is not None:  # kept (on its device, or for a voucher), read now
                record = grad_record(self._record_of(event.forward), event.grad, self.step)
                kept, silent = self._prepare(record, event.grad)
                by_norm = norm_only(record, event.grad)
            else:  # screened in its hook or vouched for: finite, and not kept
                # Listed only: its rules speak only of NaN and Inf (grads_quiet), so judging it
                # and attributing it (events for a clean gradient) would find nothing.
                forward = self._record_of(event.forward)
                record = grad_record(forward, None, self.step, (event.shape, event.dtype))
                record.stats.values = {FINITE: 1.0}
                record.judged = True
                self.phases.register(record)
                continue
            if record.wanted and by_norm:
                together.append((record, event.grad))  # measured below, all at once
                self.phases.pending.append(Judged(record))
            elif record.wanted:
                self.sync.collect(self, record, event.grad, silent, kept)
            self.phases.pending.append(Gradient(record))
        self._judge_norms(together)

    def _screen_kept_gradients(self) -> None:
        """Deferred on a device: the activation gradients the pass kept unread are screened
        together with the phase's transfer (one norm each, a few launches for all), so that a
        NaN reaching no parameter's gradient (``torch.autograd.grad``, frozen parameters)
        still shows the pass's problem."""
        if not self.sync.on_device:
            return
        phases = self.phases
        kept = [e.grad for e in phases.pending if type(e) is ActGradNote and e.grad is not None]
        if kept:
            phases.kept_norms = phases.batch.add_parts(list(torch._foreach_norm(kept)), None)

    def _screen_unvouched(self) -> None:
        """Read the held gradients whose bias gradient never came this pass, as their hooks
        would have: the pass is read from the first one that is not finite."""
        self._screen_loose()
        for note in self.vouchers.unsettled():
            if note.grad is not None and host_stats(note.grad, SCREEN)[0] == 1.0:
                note.grad = None
            elif note.grad is not None:
                self.triggered = True

    @own_work
    def _end_backward(self, task: int) -> None:
        self._backward_tasks.discard(task)
        if not self.active or self._backward_tasks:
            return
        try:
            self._end_phase()
        except Exception as e:
            self.fault(e)


def _like(forward: Record) -> tuple[torch.Size, torch.dtype]:
    """The shape and dtype of the gradient of ``forward``: its own."""
    return torch.Size(forward.stats.shape), getattr(torch, forward.stats.dtype)
