"""The session's pipeline: what the hooks hand over, in execution order, to verdicts and hits.

A tensor seen by a hook is registered in its phase, kept for inspection, and measured as the
sync mode says (:mod:`.modes`); its statistics are judged by the rule set (:mod:`.judge`); call
starts, call ends and gradients name origins (:mod:`.origin`); findings become hits
(:mod:`.hits`), which may pause the training (:mod:`.control`). At the end of each phase the
batched statistics arrive, phase-wide rules judge, and the phase is published on the bus.

Part of :class:`~tensordbg.engine.session.Session` (a mixin: the session is the one object the
hooks talk to, the :class:`~tensordbg.engine.capture.Sink`).
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from tensordbg.engine import origin
from tensordbg.engine.hits import large_params
from tensordbg.engine.judge import ActiveRule
from tensordbg.engine.pausing import Pausing
from tensordbg.engine.phases import Enter, Exit, Gradient, Judged, Snapshot
from tensordbg.engine.pinpoint import Pinpointing
from tensordbg.engine.records import NONFINITE, Record
from tensordbg.hit import CARRIED_KINDS, Hit
from tensordbg.statistics import Stat, TensorStats
from tensordbg.statistics.torch_kernels import SCREEN, host_stats

# Optimizers whose update of a parameter is finite when its gradient, state and hyper-parameters
# are (eps > 0 where they divide): a NaN or Inf after their step that none of those holds was
# there before it (:meth:`Pipeline._bad_before_update`).
_FINITE_UPDATES = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop,
                   torch.optim.Adagrad)  # fmt: skip


class Pipeline(Pausing, Pinpointing):
    """The hooks' sink and the phase pipeline of a session."""

    between_steps = False
    """A step just ended and the next has not begun: the phase is over, not under way."""

    @property
    def where(self) -> str:
        """The phase as a person reads it: the phase under way, or "" between two steps (a
        pause after ``s`` is before the next step, not in the optimizer phase of the last)."""
        if self.between_steps:
            return ""
        if self.ranks is not None and self.ranks.at_safe_point:
            return "optimizer"  # several ranks stop at its pre-hook: the update is next
        return self.phase

    @property
    def at(self) -> str:
        """Where the training is, for a sentence: "step 5, forward", or "before step 6"."""
        return f"step {self.step}, {self.where}" if self.where else f"before step {self.step}"

    # --- hooks call these (capture.py) -----------------------------------------------------

    def collect(self, record: Record, tensor: torch.Tensor, extra: tuple[Stat, ...] = ()) -> None:
        """A tensor was seen: register it, keep it for inspection, and have the sync mode
        compute what the rules need of it."""
        kept, silent = self._prepare(record, tensor, extra)
        if record.wanted:
            self.sync.collect(self, record, tensor, silent, kept)

    def dumps_all(self) -> bool:
        """Whether this step is dumped whatever happens: its statistics are all wanted (the
        activation gradients' too, read on a device with the phase's transfer)."""
        return self.dumps is not None and self.dumps.periodic(self.step)

    def dumps_gradients(self) -> bool:
        """Whether this step's dump keeps values of activation gradients (``dump_tensors``
        names some): deferred checks then read and keep them, rather than vouch for them."""
        return self.dumps_all() and self.dumps.copies_grads

    # --- statistics and judging (the sync modes call these) --------------------------------

    def screen(self, record: Record, tensor: torch.Tensor, extra: tuple[Stat, ...] = ()) -> None:
        """Compute a record's statistics now, on the host (and ``extra`` ones)."""
        wanted = tuple(dict.fromkeys(record.wanted + extra)) if extra else record.wanted
        values = self.measure(record.stats, tensor, wanted)
        record.stats.values = dict(zip(wanted, values, strict=True))
        record.lazy = False

    def measure(
        self, stats: TensorStats, tensor: torch.Tensor, wanted: Sequence[Stat]
    ) -> list[float]:
        """``wanted`` of ``tensor`` read at once; a scaled gradient's unscaled."""
        values = host_stats(tensor, wanted)
        return self.amp.unscale(wanted, values) if self.amp.scales(stats) else values

    def measuring(self, tensor: torch.Tensor | None) -> Any:
        """How a rule that asks for more statistics of ``tensor`` gets them (None: it is gone)."""
        return None if tensor is None else partial(_measure, self.measure, tensor)

    def judge(self, record: Record, tensor: torch.Tensor | None) -> None:
        """Run the per-tensor rules that apply to a record on its statistics."""
        self.ruleset.judge(record, self.measuring(tensor))
        record.forgive_mask(tensor)  # an attention mask's -inf is by design
        record.keep_if_found(tensor)
        self.metrics.judged(record.stats)

    def judge_finite(self, records: list[Record], tensors: list[torch.Tensor | None]) -> None:
        """:meth:`judge` of many finite records at once (each rule called once for all)."""
        held = {id(r): t for r, t in zip(records, tensors, strict=True)}
        self.ruleset.judge_finite(records, lambda r: self.measuring(held[id(r)]))
        judged = self.metrics.judged
        for record, tensor in zip(records, tensors, strict=True):
            record.keep_if_found(tensor)
            judged(record.stats)

    def report(self, record: Record) -> None:
        """Make the hits of a judged record whose origin does not need the call tree."""
        if record.stats.kind == "observed":
            self.metrics.observed(record.stats)
        for verdict in self.origins.report(record):
            self._hit(verdict)

    # --- the pipeline ----------------------------------------------------------------------

    def _process(self, event: Enter | Exit | Gradient) -> None:
        """What a hook saw, in execution order: at once in eager mode when nothing waits (the
        queue is skipped: hooks run hot), else queued for the end of the phase."""
        if self.sync.immediate and not self.phases.pending:
            self._handle(event)
            if self._pausing:
                self._pause_if_needed()
            if self.controller.pause_requested or self.control.pending:
                self._boundary()
            return
        self.phases.pending.append(event)
        self._after_hook()

    def _handle(self, event: Any) -> None:
        kind = type(event)
        if kind is Judged:
            record = event.record
            if record.lazy:
                return
            if not record.judged:
                self.judge(record, record.tensor)
            self.report(record)
        elif kind is Enter:
            origin.enter(event.call)
        elif kind is Exit:
            self._check_own_params(event.call)
            for verdict in self.origins.exit(event.call):
                self._hit(verdict)
        elif kind is Gradient:
            for verdict in self.origins.grad(event.record):
                self._hit(verdict)

    def _after_hook(self) -> None:
        """What a hook does last: judge now (eager, or deferred once the phase showed a
        problem) and pause if a hit or a request asks for it."""
        if self.sync.judges_in_hooks(self.triggered):
            self._settle()
        self._boundary()

    def _prepare(
        self, record: Record, tensor: torch.Tensor | None, extra: tuple[Stat, ...] = ()
    ) -> tuple[bool, bool]:
        """:meth:`collect` up to measuring: the record's rules and statistics, its place in the
        phase. Whether it is kept, and whether its rules speak only of NaN and Inf."""
        silent = self._applicable(record, extra)
        return self._place(record, tensor), silent

    def why_not_kept(self, record: Record) -> str:
        """Why ``record``'s tensor cannot be shown now."""
        if self.phases.released and record.stats.kind != "update":
            return (f"its phase, step {record.stats.step}'s {record.stats.phase}, ended before "
                    f"the training paused ({self.at}) and let go of its tensors; they are kept "
                    "while the training is paused in their phase (at a hit there)")  # fmt: skip
        return self.sync.why_not_kept(record, self.retain_bytes)

    def _place(self, record: Record, tensor: torch.Tensor | None) -> bool:
        """Register a record in its phase and keep its tensor as the sync mode says: whether
        it is kept."""
        self.phases.register(record)
        return tensor is not None and self.sync.retain(self, record, tensor)

    def _applicable(self, record: Record, extra: tuple[Stat, ...] = ()) -> bool:
        """The record's rules and the statistics they want; whether its rules speak only of
        NaN and Inf."""
        screen_only = self.interval > 1 and self.step % self.interval != 0
        applicable = self.ruleset.applicable(record.stats, screen_only)
        wanted = applicable.wanted
        if record.hidden:
            extra = SCREEN  # the origin of a non-finite value is traced through every input
        if extra:
            wanted = tuple(dict.fromkeys(wanted + extra))
        record.rule_ids = applicable.rule_ids
        record.checks = applicable.checks
        record.wanted = wanted
        return applicable.silent

    def _settle(self) -> None:
        """Screen what a deferred phase kept, judge everything pending in execution order, and
        pause if a hit asks for it."""
        self.materialize_forward()
        self._list_forward()
        self._read_notes(gradients_of_activations=True)
        for event in self.phases.pending:
            if type(event) is Judged and event.record.lazy and event.record.tensor is not None:
                self.screen(event.record, event.record.tensor)
        self._fetch()  # what the notes' records sent to the device's batch (deferred on CUDA)
        self._drain()
        self._pause_if_needed()

    def _fetch(self) -> None:
        """The phase's transfer (batched statistics to the host, if any wait). A deferred phase
        on a device whose screened tensors show a NaN or Inf is settled: what it kept is read."""
        self._buffers_to_batch()
        filled = self.phases.fetch()
        if self.sync.keeps_unscreened and (
            any(r.stats.nonfinite for r in filled) or not self.phases.kept_finite
        ):
            self.triggered = True

    def _drain(self) -> None:
        """Handle what the hooks saw, in execution order, pausing at each hit that asks for it
        there (as eager mode pauses in the hook), and nothing more once detached."""
        pending, self.phases.pending = self.phases.pending, []
        for i, event in enumerate(pending):
            if self.detached:
                return
            self._handle(event)
            if self._pausing:
                self.undrained = pending[i + 1 :]  # a recheck while paused leaves them be
                self._pause_if_needed()
                self.undrained = []

    def _start_phase(self, phase: str) -> None:
        if self.phase == "forward":
            self.capture.forget_invocations()
        self.vouchers.unsettled()  # a pass that did not end: its notes are gone
        self._light = []
        self._loose = None
        self._pass_bad = False
        self._unlisted = None
        self.phase_serial += 1
        self.phases.start(phase)
        self.between_steps = False
        self.amp.new_phase()
        self.triggered = False
        self.phase = phase

    def _end_phase(self) -> None:
        """Bring the phase's statistics over (batched), judge, run phase-wide rules, pause if a
        hit asks for it, and let go of the phase's tensors."""
        self._forward_open = False
        if self.phase == "forward" and self.capture.pending:
            self.capture.let_go()
        self._screen_unvouched()
        planned = self.plan is not None and self.phase == "backward"
        noted = self._note_param_grads() if planned else set()
        # A step dumped whatever happens holds every watched tensor's statistics: the
        # activation gradients too, screened in their hooks (on the host: nothing more to read).
        self._read_notes(gradients_of_activations=self.dumps_all())
        if planned:
            self._judge_plan(noted)
        self._screen_kept_gradients()
        self._fetch()
        if self.sync.on_device:
            self._judge_clean_gradients()
        if self.triggered:
            self._settle()
        elif not self.sync.immediate and not self.sync.on_device:
            # A clean deferred phase: nothing it kept is read, and no call can be an origin of
            # anything; what the screened records say (the loss for the curve) is all there is.
            pending, self.phases.pending = self.phases.pending, []
            for event in pending:
                if type(event) is not Judged or event.record.lazy:
                    continue
                if event.record.findings or event.record.stats.kind != "grad":
                    self.report(event.record)  # (a clean gradient has nothing to report)
        self._drain()
        if self._records_late:
            self._records_in_execution_order()
        self._judge_buffers()  # after the forward's own hits: a buffer's NaN may be theirs
        self._judge_phase()
        self._publish_phase()
        self._pause_if_needed()
        self._boundary()
        self.phases.release()

    def _judge_phase(self) -> None:
        for record, rule_id, finding in self.ruleset.judge_phase(self.phases.records):
            self._hit(origin.Verdict(record, rule_id, finding, True))

    def _publish_phase(self) -> None:
        if self.bus.wants("phase_end"):
            self.bus.publish("phase_end", {"step": self.step, "phase": self.phase,
                                           "records": list(self.phases.records)})  # fmt: skip

    def _hit(self, verdict: origin.Verdict, carried: str | None = None) -> None:
        """Make and add the hit of a verdict; ``carried``: the sentence saying that another rank
        made it (several ranks: a NaN the all-reduce brought), asked of the ranks otherwise."""
        active = self.ruleset.get(verdict.rule_id)
        if active is None:
            return
        record = verdict.record
        if record.stats.phase == "forward" and record.stats.nonfinite:
            self.forward_bad = True  # its backward is read whole (engine/forward.py)
        condition = origin.condition_of(record, verdict.rule_id)
        if verdict.origin and self.ranks is not None and record.stats.kind in CARRIED_KINDS:
            carried = self.ranks.carried(record.stats.step)
        if verdict.origin and record.stats.kind == "param" and record.stats.phase != "backward":
            record.before_update = self._bad_before_update(record)  # said by its hit's note
        hit = self.hitlog.make(record, active, verdict.finding, verdict.origin and not carried,
                               condition, verdict.call, verdict.kind, verdict.name,
                               verdict.by_gradient, verdict.unseen,
                               verdict.bad_since)  # fmt: skip
        if carried:
            hit.message += f" {carried}"
        if hit.origin:
            self._origin_in_context(hit, record, condition, verdict.finding)
        self._name_operation(hit, verdict, record)
        call = verdict.call or record.producer
        if hit.origin and hit.kind == "output" and record.stats.nonfinite and call is not None:
            by_name = self.params_by_name
            hit.message += large_params((n, by_name[n].param) for n in call.params
                                        if n in by_name)  # fmt: skip
        if self.amp.scales(record.stats) and record.stats.nonfinite:
            self.amp.held.append((hit, active))  # the scaler may skip this step: see amp.py
            return
        self._add_hit(hit, active)

    def _origin_in_context(self, hit: Hit, record: Record, condition: int | None,
                           finding: Any) -> None:  # fmt: skip
        """An origin as the steps around it show it: a gradient that vanished while parameters
        hold NaN, or the same finding at every step since an earlier one, is not a new problem;
        a deferred backward origin of a forward it did not read says so."""
        if condition == NONFINITE:
            if (record.stats.phase == "backward" and self.sync.keeps_unscreened
                    and not self.forward_bad and not record.apart):  # fmt: skip
                hit.message += self.observed.unread_forward()
            return
        if record.stats.kind == "grad":
            self._after_bad_params(hit, finding)  # a zero gradient of a NaN masked downstream
        if hit.origin and (since := self.hitlog.streak(hit)) is not None:
            hit.origin = False  # one origin for the streak: its first step
            hit.message += f" So at every step since step {since}, where it began."

    def _bad_before_update(self, record: Record) -> bool:
        """Whether a parameter found not finite after its update (deferred checks read none
        before it), or in a forward after one, was so before that update: its gradient (if
        still there), optimizer state and hyper-parameters are finite (one of them at least),
        so the update added only finite values to values far from float's largest (set by hand
        between steps). Read on this path only."""
        p = self.weights.by_name.get(record.param)
        groups = [(opt, group) for opt in self.optimizers for group in opt.param_groups
                  if p is not None and any(q is p.param for q in group["params"])]  # fmt: skip
        if p is None or not record.stats.nonfinite or not groups:
            return False
        for opt, group in groups:  # an update of finite values is finite: known optimizers only
            rates = [float(group.get(k, 1.0)) for k in ("lr", "eps", "weight_decay")]
            if not isinstance(opt, _FINITE_UPDATES) or not all(map(math.isfinite, rates)):
                return False
            if "eps" in group and not rates[1] > 0:
                return False  # m / (sqrt(v) + 0) is 0/0 where v is 0: the update can make NaN
        state = [v for opt, _ in groups for v in opt.state.get(p.param, {}).values()]
        inputs = [t for t in (p.param.grad, *state)
                  if isinstance(t, torch.Tensor) and t.is_floating_point()]  # fmt: skip
        values = p.param.detach()
        largest = values.abs().nan_to_num(0.0, 0.0, 0.0).max() if inputs else math.inf
        return all(bool(t.isfinite().all()) for t in inputs) and float(largest) < 1e30

    def _after_bad_params(self, hit: Hit, finding: Any) -> None:
        """A gradient's finding other than NaN or Inf (a gradient that vanished) while
        parameters hold NaN or Inf is theirs, not a new problem: what they feed is NaN, and a
        NaN masked to zero downstream (``torch.where``, ``nan_to_num``) gives zero gradients.
        So is one in a step whose observed loss is not finite. What the finding usually
        means (its advice) is not said of it then."""
        bad = self.origins.bad_since
        if bad and min(bad.values()) < hit.step:
            names = ", ".join(sorted(bad)[:3]) + (", ..." if len(bad) > 3 else "")
            hit.origin = False
            hit.message = (f"{finding.message} Parameters hold NaN or Inf since step "
                           f"{min(bad.values())} ({names}): what they feed is NaN, and a NaN "
                           "masked to zero downstream (torch.where, nan_to_num) leaves zero "
                           "gradients; that is the problem to fix first.")  # fmt: skip
            return
        losses = [name for name, (step, stats) in self.metrics.latest.items()
                  if step == hit.step and stats.kind == "observed" and stats.nonfinite]  # fmt: skip
        if losses:  # a mean of no terms (every label ignored) is NaN, and its gradients 0
            hit.origin = False
            hit.message = (f"{finding.message} This step's {losses[0]} is not finite (a hit "
                           "of its own): its gradients say nothing of the model. A loss "
                           "averaged over no terms (every label ignored, an empty mask) is "
                           "0/0 and gives zero gradients; that is the problem to fix "
                           "first.")  # fmt: skip

    def _add_hit(self, hit: Hit, active: ActiveRule | None) -> None:
        if self.ranks is not None:
            self.ranks.attribute(hit)  # an origin the other ranks' bad gradients came from
        # A repeat of the step before does not pause again, unless that step's update was
        # skipped: the update the skip kept out would land now.
        skipped = self.skipped_updates and self.skipped_updates[-1] == hit.step - 1
        repeated = self.hitlog.repeated(hit) and not skipped
        if not self.hitlog.add(hit, active):
            return
        self.bus.publish("hit", hit.as_dict())
        self.say_forked_hit(hit)
        # A callable on_hit hears every hit; pause and raise stop at new origins only.
        # Every step that hits is skipped, and every update a bad gradient would make (one
        # another rank's NaN brought through the all-reduce: every rank skips that step).
        skipping = self.on_hit == "skip" and (hit.origin or hit.kind == "grad")
        if callable(self.on_hit) or skipping or self.controller.should_pause(hit, repeated):
            self._pausing.append(hit)

    def _end_step(self) -> None:
        """A step ended where the training may stop: finish it, then the boundary."""
        self._finish_step()
        self._boundary(completed_step=True)

    def _finish_step(self) -> None:
        """A training step completed: history, status, this step's hits become last step's."""
        self._stepped, self._forwards_at_end = frozenset(), self._root_forwards
        self.origins.new_step()
        if self._skip_requested or self._skip_dropped:
            self._skip_requested = self._skip_dropped = False
            self.skipped_updates.append(self.step)
            self.origins.update_skipped()
            self._skips_in_row += 1
            if bad := self.hitlog.bad_buffers():  # written by the forward: no skip undoes them
                said = (f"step {self.step}: its update was skipped, but its forward left NaN or "
                        f"Inf in the buffers {', '.join(bad[:4])}{', ...' * (len(bad) > 4)} "
                        "(BatchNorm's running statistics, for one), which a skip cannot undo: "
                        "reset them or load a checkpoint")  # fmt: skip
                self.log(said, "warning")
                print(f"tensordbg: {said}", file=sys.stderr, flush=True)
        else:
            self._skips_in_row = 0
        numbers = self.metrics.finish(self.step)
        if self.plan is not None:
            self.plan.clear()  # gradients no pass computed (a forward with no backward)
        self.step += 1
        self.between_steps = True
        self.forward_bad = False
        self.capture.new_step()
        self.observed.clear()
        self.hitlog.end_step()
        self.publish()
        self.bus.publish("step_end", numbers)
        self.bus.publish("status", self.status())

    def publish(self) -> None:
        """Publish what readers on other threads may see (:class:`~.phases.Snapshot`)."""
        self.published = Snapshot(
            dict(self.metrics.latest),
            self.capture.call_counts(),
            [r for r in self.phases.records if not r.hidden],
        )

    def snapshot(self) -> Snapshot:
        """What a reader may see now: fresh on the training thread (nothing changes under it
        there, a clean forward's records made for it), else the last one published."""
        if threading.current_thread() is self.controller.training_thread:
            self.materialize_forward()
            self.publish()
        return self.published

    def adopt_scaler(self, scaler: Any) -> bool:
        """A GradScaler found after attach (the script's own, under ``tensordbg run``): as if
        given as ``attach(scaler=)``, from this step's backward on. Whether it was taken."""
        after = self._guarded(self._after_scaler_update)  # type: ignore[attr-defined]
        return self.active and self.amp.adopt(scaler, self.handles, after)

    def _after_scaler_update(self) -> None:
        if not self.active:
            return
        skipped, hits = self.amp.after_update(self.step)
        for hit, active in hits:
            self._add_hit(hit, active)
        if skipped:
            self.log(f"step {self.step}: the GradScaler skipped the step (non-finite gradients)")
            self._finish_step()
        self._pause_if_needed()
        if skipped:
            self._boundary(completed_step=True)

    def _on_state(self, state: str) -> None:
        # The reason is the pause's: "running at step 26 (NaN hit: ...)" read as if it ran
        # because of it. (How a training finished comes with the session's detach.)
        reason = self.controller.reason if state == "paused" else ""
        self.bus.publish("state", {"state": state, "step": self.step, "phase": self.where,
                                   "reason": reason, "skippable": self.skippable()})  # fmt: skip


def _measure(measure: Any, tensor: torch.Tensor, stats: TensorStats, wanted: Any) -> list[float]:
    return measure(stats, tensor, wanted)
