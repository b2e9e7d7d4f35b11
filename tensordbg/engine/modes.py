"""The three ways to check a tensor (``sync``), as strategies of the session's pipeline.

- :class:`Eager`: statistics are read at once, in the hook that saw the tensor, so a hit stops
  the training at that very tensor. On the CPU reading costs nothing extra; on CUDA it
  synchronizes per tensor.
- :class:`Batched`: statistics stay on the device until the end of the phase (forward, backward,
  optimizer step) and come to the host in one transfer: one synchronization per phase. Hits are
  the same; the pause comes at the end of the phase.
- :class:`Deferred`: the model's outputs, the observed loss, every gradient and every parameter
  are screened each step; the other tensors of the forward are kept (within ``retain_bytes``)
  and screened only when those show a problem, in execution order, so the same origin is
  named. Activation gradients are screened in their hooks, while still in the cache, and kept
  only when not finite (holding a pass's gradients until it ends cost more than reading them).
  The cheapest: for whole runs. A NaN masked before it reaches an output, the loss or a
  gradient goes unseen.

``"auto"`` (the default) is deferred on the CPU and batched on CUDA: the cheapest modes that name
the same origins (the origin suite runs in every mode). Eager is the mode that screens every
tensor where it is made: choose it to see a NaN that the model masks before any output, loss or
gradient shows it. Nothing outside this module
asks which mode runs: the session asks the strategy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tensordbg.engine.phases import Judged
from tensordbg.engine.records import Record
from tensordbg.statistics.batch import on_host
from tensordbg.statistics.registry import FINITE
from tensordbg.statistics.torch_kernels import device_parts, device_stats

if TYPE_CHECKING:
    from tensordbg.engine.pipeline import Pipeline as Session

# Kinds a deferred session may keep unscreened until the phase shows a problem.
LAZY_KINDS = frozenset({"output", "input", "grad_output", "grad_input"})


class SyncMode:
    """How a session turns a tensor seen in a hook into judged statistics."""

    name = ""
    immediate = False
    """Hooks handle their own events at once when nothing waits (eager)."""
    on_device = False
    """Statistics stay on the device until the phase's one transfer (batched; deferred on a
    device, for what it screens)."""
    keeps_unscreened = False
    """Tensors are kept unscreened until the phase shows a problem (deferred)."""
    vouches_at_pass_end = False
    """Parameter gradients are read at the end of a backward pass, and the activation
    gradients they vouch for get no hook (deferred on the host: engine/vouching.py)."""
    samples_parameters = False
    """After a clean step's update, parameters are read in a sample of each and a rotating
    share whole, not all of them (deferred on the host: engine/params.py)."""

    def collect(self, session: Session, record: Record, tensor: torch.Tensor, silent: bool,
                kept: bool) -> None:  # fmt: skip
        """Compute (or arrange) the statistics of a registered record."""
        raise NotImplementedError

    def retain(self, session: Session, record: Record, tensor: torch.Tensor) -> bool:
        """Keep a tensor for inspection; whether it is held until the phase ends."""
        return session.phases.keep(record, tensor)

    def reads_free(self, tensor: torch.Tensor) -> bool:
        """Whether reading ``tensor`` in its hook costs no synchronization. Never where the
        statistics stay on the device: there (on CUDA, and batched checks anywhere) every read
        waits for the phase's transfer."""
        return not self.on_device and on_host(tensor)

    def judges_in_hooks(self, triggered: bool) -> bool:
        """Whether a hook judges what is pending before it returns."""
        return False

    def notes_gradients(self, triggered: bool) -> bool:
        """Whether a gradient is only noted (read at the end of the pass if at all)."""
        return False

    def notes_forward(self, triggered: bool) -> bool:
        """Whether the module calls of a root forward may be noted by the hooks and registered
        when the root returns (see :meth:`Pipeline.logs_forward`)."""
        return False

    def to_batch(self, session: Session, record: Record, tensor: torch.Tensor) -> None:
        """Have a record's statistics computed on the device, read with the phase's transfer."""
        wanted, batch = record.wanted, session.phases.batch
        factors = session.amp.scale_vector(wanted) if session.amp.scales(record.stats) else None
        if factors is not None:  # a scaled gradient: unscaled on the device
            slot = batch.add(device_stats(tensor, wanted) * factors)
        else:
            slot = batch.add_parts(*device_parts(tensor, wanted))
        session.phases.awaits(record, wanted, slot)

    def why_not_kept(self, record: Record, retain_bytes: int) -> str:
        if record.stats.kind == "update":  # never a tensor of its own, in any mode
            return (f"an update, the weights after the step against before, is measured, never "
                    f"kept: open {record.param} for its values after the step")  # fmt: skip
        return f"the phase's tensors passed retain_bytes={retain_bytes // 2**20} MiB"

    def why_not_measured(self, record: Record, interval: int) -> str:
        """Why no earlier step has statistics of ``record``'s tensor, for the person comparing
        it with the step before."""
        if interval > 1:
            return f"the steps between checks are not measured (interval={interval})"
        return "no statistics of this tensor from an earlier step"


class Eager(SyncMode):
    name = "eager"
    immediate = True

    def collect(self, session: Session, record: Record, tensor: torch.Tensor, silent: bool,
                kept: bool) -> None:  # fmt: skip
        session.screen(record, tensor)
        session.judge(record, tensor)
        session.report(record)

    def retain(self, session: Session, record: Record, tensor: torch.Tensor) -> bool:
        if session.dumps_all() and session.dumps.chooses(record.stats.name):
            return session.phases.keep(record, tensor)  # a dumped step's dump_tensors
        session.phases.keep_recent(record, tensor)
        return True

    def judges_in_hooks(self, triggered: bool) -> bool:
        return True

    def why_not_kept(self, record: Record, retain_bytes: int) -> str:
        if record.stats.kind == "update":
            return super().why_not_kept(record, retain_bytes)
        return (
            "eager checks keep only hits and the last few tensors; this one passed and the "
            "training has freed it"
        )


class Batched(SyncMode):
    name = "batched"
    on_device = True

    def collect(self, session: Session, record: Record, tensor: torch.Tensor, silent: bool,
                kept: bool) -> None:  # fmt: skip
        self.to_batch(session, record, tensor)
        session.phases.pending.append(Judged(record))


class Deferred(SyncMode):
    """On a device (``on_device``), what it screens is computed there and read with the
    phase's one transfer, as batched checks read it: a phase that shows a problem is settled
    at its end, as batched checks pause there."""

    name = "deferred"
    keeps_unscreened = True

    def __init__(self, on_device: bool = False):
        self.on_device = on_device
        self.vouches_at_pass_end = self.samples_parameters = not on_device

    def collect(self, session: Session, record: Record, tensor: torch.Tensor, silent: bool,
                kept: bool) -> None:  # fmt: skip
        if (
            kept
            and silent
            and record.stats.kind in LAZY_KINDS
            and not (record.sentinel or session.triggered)
        ):
            record.lazy = True  # its rules only speak of NaN and Inf: wait for a reason to look
            session.phases.pending.append(Judged(record))
            return
        if self.on_device:
            self.to_batch(session, record, tensor)  # judged once the phase's transfer brings it
            session.phases.pending.append(Judged(record))
            return
        session.screen(record, tensor)
        session.judge(record, tensor)
        # Its hits are made in execution order, once the phase is settled.
        session.phases.pending.append(Judged(record))
        if record.findings or record.conditions:
            session.triggered = True

    def judges_in_hooks(self, triggered: bool) -> bool:
        return triggered

    def notes_gradients(self, triggered: bool) -> bool:
        return not triggered

    def notes_forward(self, triggered: bool) -> bool:
        return not triggered

    def why_not_kept(self, record: Record, retain_bytes: int) -> str:
        if record.voucher and FINITE not in record.stats.values:
            return (
                f"deferred checks judge this gradient from {record.voucher}'s gradient, which "
                "takes every element of it but of others too (it reaches a tensor that other "
                f"operations also use); {record.voucher}'s gradient is not finite, which says "
                "nothing of this one, and it was not read. sync='eager' reads it"
            )
        if record.voucher:
            return (
                f"deferred checks judge this gradient from {record.voucher}'s gradient, which "
                "takes every element of it (a NaN or Inf here is one there), and do not keep "
                f"it; {record.voucher}'s gradient is not finite, so neither is this one. "
                "sync='eager' keeps it"
            )
        if record.stats.kind in ("grad_output", "grad_input"):
            return (
                "deferred checks keep an activation gradient only when it is not finite (read "
                "in its hook, or judged from a parameter's gradient that takes every element "
                "of it); this one was finite"
            )
        return super().why_not_kept(record, retain_bytes)

    def why_not_measured(self, record: Record, interval: int) -> str:
        if interval == 1 and record.stats.kind in LAZY_KINDS:
            return (
                "deferred checks (the CPU's default) measure a clean step's activations only "
                "when its output, loss or gradients show a problem; sync='eager' measures each "
                "one every step, but only what its rules ask for (with the default rules, "
                "whether it is finite: not these statistics)"
            )
        return super().why_not_measured(record, interval)


MODES: dict[str, type[SyncMode]] = {m.name: m for m in (Eager, Batched, Deferred)}
SYNC = ("auto", *MODES)


def choose(sync: str, device: torch.device) -> SyncMode:
    """The strategy for ``sync`` on a model living on ``device``."""
    if sync not in SYNC:
        raise ValueError(f"sync is one of {', '.join(SYNC)}, not {sync!r}")
    if sync == "auto":
        sync = "batched" if device.type == "cuda" else "deferred"
    if sync == "deferred":
        return Deferred(on_device=device.type != "cpu")
    return MODES[sync]()
