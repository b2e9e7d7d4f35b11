"""The backward phase of the session's pipeline: activation and parameter gradients.

In deferred mode a clean pass costs little. A parameter's gradient is only noted in its hook (a
hook runs cold) and all of them are measured together when the pass ends, from one norm each. An
activation's gradient on the host is screened while it is in the cache (in its hook, or in the
next one, which most often gets the very same tensor, and then the same voucher), unless a
parameter's gradient will vouch for it (:class:`Vouchers`); on a device it is kept and read
only if the pass shows a problem. Once a pass shows one, every gradient after it is collected
where it is made, as in eager mode, so that origins are named as precisely there.

Part of :class:`~tensordbg.engine.session.Session`, like :mod:`.pipeline` and :mod:`.optimizer`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tensordbg.engine.params import Param
from tensordbg.engine.phases import ActGradNote, Gradient, Judged, ParamGradNote
from tensordbg.engine.records import Record, grad_record, is_model_output, param_grad_record
from tensordbg.statistics import FINITE, L2
from tensordbg.statistics.batch import norm_only, norms_of
from tensordbg.statistics.torch_kernels import SCREEN, dtype_name, host_stats, norm_parts

# Modules whose backward sums every element of their output's gradient into their bias's
# gradient (over the batch, and the positions or pixels): Linear, convolutions, the norms.
SUMMED_INTO_BIAS = (
    nn.Linear,
    nn.Bilinear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.modules.batchnorm._BatchNorm,
)
# Modules whose backward multiplies their output's gradient element by element by a derivative
# (or dropout's mask and scale): a NaN or Inf there stays one in their input's gradient, even
# where the factor is 0 (NaN * 0 is NaN, Inf * 0 too). So a bias that vouches for the gradient
# of their input vouches for their output's (tests/test_backward.py checks each on torch).
PASSES_NONFINITE_ON = (
    nn.GELU,
    nn.SiLU,
    nn.Mish,
    nn.Tanh,
    nn.Sigmoid,
    nn.Softplus,
    nn.ELU,
    nn.LeakyReLU,
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
)
CHAIN = 4  # how many such modules in a row a bias vouches through


class Vouchers:
    """Activation gradients that a bias's gradient vouches for, so that they are not read.

    The bias gradient of a Linear (or a convolution, or a LayerNorm, GroupNorm or BatchNorm) is
    the sum of every element of its output's gradient: one NaN among them makes it NaN, one Inf
    makes it Inf or NaN. So when the bias gradient is finite, the output's gradient is too, and
    its read (the largest cost of a clean deferred backward on the host) is saved; the bias
    gradient, a few kilobytes, is read instead. The output's gradient is held until the bias's
    gradient arrives, which the autograd engine computes right after it, and read as before if it
    is not finite, or never arrives (``torch.autograd.grad``, a frozen bias). A bias gradient that
    accumulates (gradient accumulation, a module called twice) vouches just as well: a sum of
    values of which one is not finite is not finite.

    The bias vouches through an activation or a dropout applied to its module's output (a
    Linear's, then GELU, then Dropout: up to ``CHAIN`` of them): their backward multiplies the
    gradient element by element, so a NaN or Inf in their output's gradient is one in the
    gradient of the module's output, which the bias sums. Only modules whose ``forward`` is the
    one of these classes are trusted (a subclass that rewrites it may not behave so), and no
    activation that works in place.
    """

    def __init__(self, model: nn.Module, budget: int) -> None:
        self.budget = budget
        """The bytes the held gradients may take at once (the session's ``retain_bytes``)."""
        self.held = 0
        names = {id(p): name for name, p in model.named_parameters()}
        self.bias_of: dict[str, str] = {}
        """Module path -> the name of the bias whose gradient vouches for its output's."""
        for path, module in model.named_modules():
            bias = getattr(module, "bias", None)
            if isinstance(bias, nn.Parameter) and id(bias) in names and _sums_into_bias(module):
                self.bias_of[path] = names[id(bias)]
        self.passes_on = {path for path, module in model.named_modules()
                          if _passes_nonfinite_on(module)}  # fmt: skip
        """Module paths whose input's voucher vouches for their output's gradient too."""
        self.awaiting: dict[str, list[ActGradNote]] = {}
        """Bias name -> the notes of the gradients it will vouch for, each holding its gradient."""

    def hold(self, forward: Record, grad: torch.Tensor, params: dict[str, Param],
             same: ActGradNote | None = None) -> ActGradNote | None:  # fmt: skip
        """A note holding ``grad`` until its module's bias gradient vouches for it; None when
        no bias will (the gradient is then screened where it is). ``same``: the note of an
        earlier gradient that is this very tensor, vouched for with it."""
        bias = self.voucher(forward)
        param = params.get(bias) if bias is not None else None
        nbytes = grad.nbytes
        if param is None or not param.param.requires_grad or self.held + nbytes > self.budget:
            return None
        self.held += nbytes
        note = ActGradNote(forward, grad.shape, grad.dtype, grad)
        waiting = self.awaiting.setdefault(bias, [])
        if same is not None:
            self.held += nbytes
            waiting.append(same)
        waiting.append(note)
        return note

    def voucher(self, forward: Record) -> str | None:
        """The bias whose gradient will vouch for the gradient of ``forward``, if any."""
        made_by = forward.producer  # set for a module's outputs only
        for _ in range(CHAIN + 1):
            if made_by is None:
                return None
            bias = self.bias_of.get(made_by.path)
            if bias is not None or made_by.path not in self.passes_on or len(made_by.inputs) != 1:
                return bias
            made_by = made_by.inputs[0][1].producer  # what made its input: whose bias sums it
        return None

    def settle(self, name: str, grad: torch.Tensor) -> bool:
        """Parameter ``name``'s gradient arrived: if it is a bias others wait for and it is
        finite, their gradients are finite and let go. False when it is not finite."""
        notes = self.awaiting.pop(name, None)
        if notes is None:
            return True
        self.held -= sum(note.grad.nbytes for note in notes)
        if host_stats(grad, SCREEN)[0] != 1.0:
            return False  # the notes keep their gradients, to be read
        for note in notes:
            note.grad = None
        return True

    def unsettled(self) -> list[ActGradNote]:
        """The notes whose bias gradient never came this pass (and forget them)."""
        notes = [note for waiting in self.awaiting.values() for note in waiting]
        self.awaiting, self.held = {}, 0
        return notes


def _passes_nonfinite_on(module: nn.Module) -> bool:
    kind = next((k for k in PASSES_NONFINITE_ON if isinstance(module, k)), None)
    return (
        kind is not None
        and type(module).forward is kind.forward
        and not getattr(module, "inplace", False)
    )


def _sums_into_bias(module: nn.Module) -> bool:
    kind = next((k for k in SUMMED_INTO_BIAS if isinstance(module, k)), None)
    return kind is not None and type(module).forward is kind.forward


class BackwardPhase:
    """Part of :class:`~tensordbg.engine.session.Session`: its backward hooks."""

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
        if task not in self._backward_tasks:
            self._backward_tasks.add(task)
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: self._end_backward(task)
            )

    def activation_grad(self, forward: Record, grad: torch.Tensor) -> None:
        """The gradient of a watched forward tensor. A clean deferred backward only notes it
        (it becomes a record only if the pass turns out bad); otherwise it is collected."""
        self.begin_backward()
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

    def param_grad(self, name: str, owner: str, owner_type: str, grad: torch.Tensor) -> None:
        """A parameter's gradient is final for this backward pass. Deferred mode only notes it
        here (a hook runs cold) and judges all of them together when the pass ends."""
        self.begin_backward()
        if self._loose is not None:
            self._screen_loose()
        if self.vouchers.awaiting and not self.vouchers.settle(name, grad):
            self.triggered = True  # a gradient it vouches for may hold the NaN: read them
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
        notes = (ParamGradNote, ActGradNote) if gradients_of_activations else (ParamGradNote,)
        pending = self.phases.pending
        if not any(type(e) in notes for e in pending):
            return
        self.phases.pending = []
        together: list[tuple[Record, torch.Tensor]] = []
        for event in pending:
            if type(event) not in notes:
                self.phases.pending.append(event)
                continue
            if type(event) is ParamGradNote:
                record = param_grad_record(event.name, event.owner, event.owner_type,
                                           event.grad, self.step)  # fmt: skip
            elif event.grad is not None:  # kept (on its device, or for a voucher), read now
                record = grad_record(event.forward, event.grad, self.step)
            else:  # screened in its hook or vouched for: finite, and not kept
                # Listed only: its rules speak only of NaN and Inf (grads_quiet), so judging it
                # and attributing it (events for a clean gradient) would find nothing.
                record = grad_record(event.forward, None, self.step, (event.shape, event.dtype))
                record.stats.values = {FINITE: 1.0}
                record.judged = True
                self.phases.register(record)
                continue
            kept, silent = self._prepare(record, event.grad)
            if record.wanted and norm_only(record, event.grad):
                together.append((record, event.grad))  # measured below, all at once
                self.phases.pending.append(Judged(record))
            elif record.wanted:
                self.sync.collect(self, record, event.grad, silent, kept)
            self.phases.pending.append(Gradient(record))
        if together:
            self._judge_norms(together)

    def _judge_norms(self, together: list[tuple[Record, torch.Tensor]]) -> None:
        """Screen and judge records that want only ``finite`` and ``l2``, from one norm each;
        on a device, the norms join the phase's transfer and the records are judged after it."""
        if self.sync.on_device and not any(self.amp.scales(r.stats) for r, _ in together):
            norms = torch._foreach_norm([t for _, t in together], 2, dtype=torch.float64)
            for (record, _), norm in zip(together, norms, strict=True):
                slot = self.phases.batch.add_parts(*norm_parts(norm, record.wanted))
                self.phases.awaits(record, record.wanted, slot)
            return
        norms = norms_of([t for _, t in together])
        finite: list[Record] = []
        tensors: list[torch.Tensor] = []
        for (record, tensor), norm in zip(together, norms, strict=True):
            if math.isfinite(norm):
                found = {FINITE: 1.0, L2: norm}
                values = [found[s] for s in record.wanted]
                if self.amp.scales(record.stats):
                    values = self.amp.unscale(record.wanted, values)
                record.stats.values = dict(zip(record.wanted, values, strict=True))
                record.lazy = False
                finite.append(record)
                tensors.append(tensor)
                continue
            self.screen(record, tensor)  # a NaN or Inf, or squares past the dtype's range
            self.judge(record, tensor)
            if record.findings or record.conditions:
                self.triggered = True
        self.judge_finite(finite, tensors)  # each rule once for all of them
        if any(record.findings or record.conditions for record in finite):
            self.triggered = True

    def _judge_clean_gradients(self) -> None:
        """On a device, a pass's finite parameter gradients are judged together once their
        statistics arrived, as deferred checks judge them on the host: each rule sees every
        gradient's scale before it refines any (VanishingGradient's typical gradient), so the
        modes give the same verdicts."""
        clean = [
            e.record for e in self.phases.pending
            if type(e) is Judged and e.record.stats.kind == "grad" and not e.record.judged
            and e.record.stats.values.get(FINITE) == 1.0
        ]  # fmt: skip
        if clean:
            self.judge_finite(clean, [r.held() for r in clean])

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

    def _end_backward(self, task: int) -> None:
        self._backward_tasks.discard(task)
        if not self.active or self._backward_tasks:
            return
        try:
            self._end_phase()
        except Exception as e:
            self.fault(e)
