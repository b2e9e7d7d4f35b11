"""The optimizer phase of the session's pipeline: gradients are final before the step (a
gradient hit pauses before the bad update lands), parameters and their updates are judged
after it. Parameter bookkeeping itself (who owns what, copies, ranges) is in :mod:`.params`.
"""

from __future__ import annotations

import math
import sys
from functools import cached_property, partial
from typing import Any

import torch

from tensordbg.engine.gradless import Gradless
from tensordbg.engine.marks import own_work
from tensordbg.engine.origin import Verdict
from tensordbg.engine.params import Digest, Param, ParamWatch, held_params, sample_moved
from tensordbg.engine.phases import Judged
from tensordbg.engine.records import CHECKS, Record, param_grad_record
from tensordbg.engine.sites import user_site
from tensordbg.engine.stepping import after_first_call, drop_gradients, say_apart, skips_inside
from tensordbg.offline.sentences import listed
from tensordbg.statistics import FINITE, L2, LR_SHARE, MAX, MIN, Stat
from tensordbg.statistics.batch import norms_of, rows_of
from tensordbg.statistics.torch_kernels import (
    device_parts,
    host_stats,
    update_stats,
    watchable,
)

# A parameter's range before and after a step tells cheaply that the step changed it.
RANGE = (MIN, MAX)
# Parameters whose digest is their norm (one pass over all of them): float32 and float64.
NORMED = frozenset({torch.float32, torch.float64})
BROUGHT = (
    "This rank's own gradient was finite: the gradient all-reduce brought it from another rank."
)
SKIPPED_INSIDE: list[Param] = []
"""What a step that a fused optimizer skips in its kernel owns: nothing."""


class OptimizerPhase:
    """Part of :class:`~tensordbg.engine.session.Session`: its optimizer hooks.

    A step ends once every watched optimizer has stepped (a sparse embedding's SparseAdam and
    the dense Adam beside it, a GAN's two: one step of the count, which a skip drops whole). An
    optimizer that steps again before the others have (a WGAN's critic, five times per
    generator step) shows that they step apart: from then on a step ends with the first
    optimizer's, each of its steps one of the count."""

    _optimizer_hooks: dict[int, tuple[Any, Any]]
    _stepped: frozenset[int] = frozenset()
    """The watched optimizers that stepped in this step."""
    _step_depth: dict[int, int]
    """Each optimizer's steps under way: a subclass's step calling its parent's runs the hooks
    again inside the first (cleared at each root forward: a step that raised ends there)."""
    step_sites: dict[int, Any] = {}  # noqa: RUF012 (the instance's own is made at a first step)
    """The user's line that called each optimizer's ``step()`` last (by its id): what wrote
    the parameters it holds, for their provenance."""
    _steps_apart = False
    _ever_stepped: frozenset[int] = frozenset()
    _forwards_at_end = -1
    """The root forwards counted when the last step ended."""
    _skip_dropped = False
    """A skip dropped an optimizer's gradients this step: it ends at the next root forward (the
    gradients it was for are gone; a WGAN's next critic update is not dropped with them)."""

    @property
    def step_open(self) -> bool:
        """Whether some optimizers stepped in this step and the others never will (the training
        ended): detaching ends it. (Stepping apart, it is the next step's start: left out.)"""
        return bool(self._stepped) and not self._steps_apart

    def update_made(self) -> bool:
        """Whether every update of the step has been made (a hit on a parameter or an update
        is found after it): a skip asked for now has nothing left to drop."""
        return bool(self._stepped) and len(self._stepped) >= len(self.optimizers)

    def skippable(self) -> bool:
        """Whether a skip can still drop an update: not while paused after every update of
        the step (a parameter's hit) or in an evaluation; the UI offers ``k`` only then."""
        return not (self.controller.state == "paused" and (self.update_made() or self.evaluating()))

    def skipping(self) -> str:
        """What a skip asked for now drops, as a person reads it: the step's updates not yet
        made (optimizers named by class and place in the list: ``Adam #2``)."""
        if not self._stepped:
            return (f"The update of step {self.step} will be skipped: its gradients are "
                    "dropped, the weights and the optimizer state stay as they are.")  # fmt: skip
        named = [(id(o), f"{type(o).__name__} #{i + 1}") for i, o in enumerate(self.optimizers)]
        made = [name for key, name in named if key in self._stepped]
        left = [name for key, name in named if key not in self._stepped]
        its = ("its", "their")
        return (f"Step {self.step}: {listed(made)} stepped already, {its[len(made) > 1]} update "
                f"made; {listed(left)} will drop {its[len(left) > 1]} gradients, "
                f"{its[len(left) > 1]} weights and state staying as they are.")  # fmt: skip

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Watch an optimizer's steps (``attach(optimizer=...)`` calls this). A step ends once
        each watched optimizer has stepped."""
        if optimizer in self.optimizers or self.detached:
            return
        self.optimizers.append(optimizer)
        hooks = (optimizer.register_step_pre_hook(self._before_step),
                 optimizer.register_step_post_hook(self._after_step))  # fmt: skip
        self._optimizer_hooks[id(optimizer)] = hooks
        for hook in hooks:
            self.handles.add(hook)
        self.handles.callback(self.optimizers.clear, "optimizers")

    def adopt_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer that steps the model's parameters and is not watched (made after
        attach: a new one for a second phase of the training): watched from this very step on,
        in place of each watched one whose parameters it holds all of (those step no more, and
        a step that waited for them never ended: every later step was counted as one)."""
        if optimizer in self.optimizers or self.detached or not self.active:
            return
        held = held_params(optimizer)
        if not any(key in self.params for key in held):
            return  # another model's (a GAN's other half, watched by its own session or none)
        replaced = [o for o in self.optimizers if held_params(o) <= held]
        for old in replaced:
            self.optimizers.remove(old)
            for hook in self._optimizer_hooks.pop(id(old), ()):
                hook.remove()
            self._stepped -= {id(old)}
        had = len(self.optimizers) + len(replaced)
        self.attach_optimizer(optimizer)
        if had:
            # Right after a step ended, with no forward since, it is that step's tail.
            step = self.step - (self.step > 0 and self._root_forwards == self._forwards_at_end)
            instead = f", in place of {listed([type(o).__name__ for o in replaced])}"
            message = (
                f"step {step}: {type(optimizer).__name__} steps the model's parameters and "
                f"is watched from now on{instead if replaced else ''}"
            )
            self.log(message, "warning")
            print(f"tensordbg: {message}", file=sys.stderr, flush=True)

    def _any_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any,
                            kwargs: Any) -> None:  # fmt: skip
        """The global step pre-hook: every optimizer's step, watched or not, comes here first."""
        if self.optimizers and optimizer not in self.optimizers:
            try:
                self.adopt_optimizer(optimizer)
            except Exception as e:
                self.fault(e)

    def check_parameters(self, phase: str = "check") -> None:
        """Check every parameter now: between steps, or at attach (a NaN, a poor init)."""
        if phase not in CHECKS:  # another's would say that an update or a pass made its hits
            raise ValueError(f"phase must be {' or '.join(map(repr, CHECKS))}, not {phase!r}")
        if not self.active:
            return
        self._start_phase(phase)
        params = list(self.weights.params.values())
        self._param_versions = [p.param._version for p in params]
        self._check_parameters(params, None, after_step=False)

    def _check_changed_parameters(self) -> None:
        """No optimizer is watched and a step ended: check the parameters that changed since
        they were last checked (updated by hand, set to a value, loaded) as an optimizer step
        would leave them, so that a weight set to Inf is found even where the model's outputs
        hide it (a Tanh after it). A parameter that did not change is not read again."""
        params = list(self.weights.params.values())
        versions = [p.param._version for p in params]
        before = self._param_versions or [None] * len(params)
        self._param_versions = versions
        changed = [p for p, now, then in zip(params, versions, before, strict=True) if now != then]
        self._say_what_is_not_watched(bool(changed))
        if changed:
            # The step's gradients are final: a parameter a NaN gradient made NaN is no origin
            # (it was called one, "the gradient was clean").
            self.origins.gradients_final(self.phases.records)
            self._start_phase("optimizer")
            self._check_parameters(changed, None)

    _reduced: tuple[dict[str, Record], set[str]] | None = None
    _brought: list[tuple[Record, torch.Tensor]] = []  # noqa: RUF012 (replaced, not changed)
    """The gradients the all-reduce made not finite this step (judged again, as it left them):
    listed in the optimizer's phase, where the UI and a dump find them. ``_reduced``: several
    ranks: the last backward phase's parameter-gradient records by parameter, and the
    parameters whose gradients were read as the all-reduce left them (each once: the
    optimizers after the first step once the step is counted, at the next step's number)."""

    @cached_property
    def gradless(self) -> Gradless:
        """The trainable parameters stepped that never got a gradient (engine/gradless.py)."""
        return Gradless(self.log)

    def all_reduced(self, record: Record) -> bool:
        """Whether ``record`` is a gradient judged again as the all-reduce left it this step
        (its earlier steps hold this rank's own gradient, from before the all-reduce)."""
        return any(r is record for r, _ in self._brought)

    def _check_reduced_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Several ranks: the gradients ``optimizer`` owns as the all-reduce left them (DDP
        writes them when the backward pass ends, after this rank's hooks read its own). One norm
        each; a gradient that is not finite where this rank's own was is judged now, as the
        record the rank already has of it, before the update lands (a pause or a skip it asks
        for happens at the safe point, with every rank), as the NaN another rank made."""
        if self._reduced is None:
            records = {r.param: r for r in self.phases.records if r.stats.kind == "grad"}
            self._reduced = (records, set())
        records, read = self._reduced
        grads = []
        for p in self.weights.owned(optimizer, self.optimizers):
            record = records.get(p.name)
            if p.name in read or (record is not None and not record.wanted):
                continue  # read for an earlier optimizer, or no rule judges it
            read.add(p.name)
            if watchable(p.param.grad) and (record is None or not record.stats.nonfinite):
                grads.append((p, p.param.grad))
        norms = norms_of([grad for _, grad in grads])
        for (p, grad), norm in zip(grads, norms, strict=True):
            if math.isfinite(norm):
                continue
            record = records.get(p.name)
            if record is None:  # no hook of this rank saw it (it got no gradient of its own)
                record = param_grad_record(p.name, p.owner, p.owner_type, grad, self.step)
                self._prepare(record, grad)
            self.phases.adopt(record)  # a later optimizer's phase: the UI lists it there too
            self._brought.append((record, grad))
            self.screen(record, grad)
            self.judge(record, grad)
            self.origins.grad_fired[p.name] = set(record.conditions)  # the update is not its origin
            # Finite as this rank made it: another rank's, whether or not that one said so yet.
            carried = self.ranks.carried(record.stats.step) or BROUGHT
            for rule_id, finding in record.findings.items():
                self._hit(Verdict(record, rule_id, finding, False), carried)
        self._pause_if_needed()

    @own_work
    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any,
                     kwargs: Any) -> tuple[Any, Any] | None:  # fmt: skip
        """The optimizer's step pre-hook. A step given a closure runs the forward and backward
        inside it (Lightning, LBFGS): the gradients are final only once the closure returned.
        A subclass whose step calls ``super().step()`` runs the hooks once more inside: only
        the outermost step counts."""
        depth = self._step_depth.get(id(optimizer), 0)
        self._step_depth[id(optimizer)] = depth + 1
        if depth or self.broken or self._detach_requested():
            return None
        vars(self).setdefault("step_sites", {})[id(optimizer)] = user_site(sys._getframe(1))
        if skips_inside(optimizer):  # as if the scaler had not called it (see amp.py)
            self._stepping[optimizer] = SKIPPED_INSIDE
            return None
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            self._gradients_final(optimizer)
            return None
        return after_first_call(closure, partial(self._gradients_final, optimizer), args, kwargs)

    def _gradients_final(self, optimizer: torch.optim.Optimizer) -> None:
        """Gradients are final: judge what is pending (a gradient hit pauses before the update
        lands), note parameter versions and copy those whose update must be measured exactly."""
        if self.broken or self._detach_requested():
            return
        try:
            if id(optimizer) in self._stepped:  # again before the others: they step apart
                if not self._steps_apart:
                    say_apart(self.step, optimizer, self.optimizers)
                self._steps_apart = True
                self._end_step()
            self.end_unseen_pass()
            if self.phases.busy() or self._forward_open:
                self._end_phase()
            if self.detached:  # q at a pause just above (a k before it drops the update still)
                return
            if self.ranks is not None:
                if self.phase == "backward":  # the first optimizer after the pass
                    self._reduced, self._brought = None, []
                self._check_reduced_gradients(optimizer)
            if self.ranks is not None and optimizer is self.optimizers[0]:
                self.ranks.safe_point()  # the step's collectives are done: ranks stop here
                if self.detached:  # q while the ranks were paused there
                    return
            owned = self.weights.owned(optimizer, self.optimizers)
            if self.ruleset.active and not self.gradless.done:  # before a skip drops them
                held = held_params(optimizer)
                self.gradless.note([p for p in owned if id(p.param) in held], self.step)
            if self._skip_requested:
                drop_gradients(optimizer)
                self._skip_dropped = True
            self.amp.stepped = True
            if self.phase != "optimizer":  # the first optimizer of the step: gradients are final
                self.origins.gradients_final(self.phases.records)
                if self.origins.grad_fired:  # spread by the script's code since (clipping)?
                    self.origins.spread_before_step(_final_grads(self.weights))
                self.hitlog.changed_before_step(self.step, self.phases.by_ref, self.weights.by_name)
            self._start_phase("optimizer")
            for record, grad in self._brought:  # judged after the backward phase had ended
                self.phases.adopt(record)
                record.tensor = grad  # a hit's own tensor is kept (the phase's start let it go)
            self._stepping[optimizer] = owned
            wanted = self.ruleset.update_stats()
            if wanted is None:
                self.weights.versions, self.weights.snapshots, self.weights.samples = {}, {}, {}
                return
            every = self.step % self.interval == 0
            fused = any(g.get("fused") for g in optimizer.param_groups)
            self.weights.before_step(owned, wanted, every, fused, self.sync.reads_free)
        except Exception as e:
            self.fault(e)

    @own_work
    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any,
                    kwargs: Any) -> None:  # fmt: skip
        depth = self._step_depth.get(id(optimizer), 1) - 1
        self._step_depth[id(optimizer)] = depth
        if depth or not self.active:
            return
        try:
            owned = self._stepping.pop(optimizer, None)
            if owned is SKIPPED_INSIDE:
                return
            if owned is None:
                owned = self.weights.owned(optimizer, self.optimizers)
            self.weights.note_learning_rates(optimizer)
            if id(optimizer) in self._ever_stepped or self._root_forwards != self._forwards_at_end:
                self._stepped |= {id(optimizer)}  # before its checks: a hit there sees it made
            # else its first step came right after a step ended, with no forward since: watched
            # from there on (tensordbg run finds an optimizer as it steps), it is the tail of
            # that step, not one of the next (whose steps would all end one optimizer early).
            self._ever_stepped |= {id(optimizer)}
            self._check_parameters(owned, self.ruleset.update_stats(), optimizer=optimizer)
            last = len(self._stepped) == len(self.optimizers)
            if optimizer is self.optimizers[0] if self._steps_apart else last:
                self._end_step()
        except Exception as e:
            self.fault(e)

    def _check_parameters(self, owned: list[Param], updates: tuple[Stat, ...] | None,
                          after_step: bool = True, optimizer: Any = None) -> None:  # fmt: skip
        """Parameters after an optimizer step (and at attach): their values and, for those the
        step updated, the update against their values before it (batched: one transfer)."""
        ranges: dict[str, Digest] = {}
        # Where updates are watched, a parameter's range is its digest (at attach too).
        ranged = RANGE if updates is not None or self.ruleset.update_stats() is not None else ()
        quiet: list[Param] = []  # finite and a digest from one norm each, all at once
        loud: list[Param] = []
        # A step that is dumped whatever happens holds a record of every parameter after its
        # update (not of the check at attach, which comes before step 0).
        recorded = after_step and self.dumps is not None and self.dumps.periodic(self.step)
        for p in owned:
            if not watchable(p.param):
                continue
            silent = self._quiet_params.get(p.name)
            if silent is None:
                probe = p.record("param", p.name, self.step).stats
                silent = self._quiet_params[p.name] = self.ruleset.applicable(probe).silent
            if silent and not self.sync.on_device:
                # The common case, without a record: its rules speak only of NaN and Inf, and
                # its digest (needed anyway to tell that the step changed it) says it is finite.
                (quiet if p.param.dtype in NORMED else loud).append(p)
            else:
                loud.append(p)
        sampled = self.sync.samples_parameters
        if sampled:  # the digest is a sample of each parameter's elements, all in one read
            digests, finite = self.weights.sampled(quiet)
            ranges.update(digests)
            if finite and after_step and not recorded and self._update_was_clean():
                # A clean step's update: each sample, and a rotating share of the parameters
                # whole (each one every ROTATION steps); a NaN it wrote elsewhere is found
                # there, or by the forward that meets it (this module's README says more).
                turn = self.weights.rotation(quiet)
                if all(math.isfinite(n) for n in norms_of([p.param.detach() for p in turn])):
                    quiet = []
        norms = norms_of([p.param.detach() for p in quiet])
        for p, norm in zip(quiet, norms, strict=True):
            if math.isfinite(norm):
                if not sampled:
                    ranges[p.name] = Digest.of_norm(norm, p.param.numel())
                self.origins.param_clean(p.name)  # finite again, if it was not
                if recorded:
                    self._listed(p, {FINITE: 1.0, L2: norm})
            else:
                loud.append(p)
        for p in loud:
            silent = self._quiet_params[p.name]
            if silent and not self.sync.on_device and p.param.dtype not in NORMED:
                lo, hi = host_stats(p.param, RANGE)
                if math.isfinite(lo) and math.isfinite(hi):
                    ranges[p.name] = Digest.of_range(lo, hi)
                    self.origins.param_clean(p.name)
                    if recorded:
                        self._listed(p, {FINITE: 1.0, MIN: lo, MAX: hi})
                    continue
            record = p.record("param", p.name, self.step, self.phase)
            self.collect(record, p.param.detach(), extra=ranged)
            ranges[p.name] = Digest.of_range(
                record.stats.values.get(MIN), record.stats.values.get(MAX)
            )
        pending_range: list[Record] = []
        made: list[Record] = []
        if updates is not None:
            moving = self.weights.moving(owned, ranges, updates)
            for p in owned:
                if p.name in self.weights.versions and p.name not in moving and watchable(p.param):
                    # A device's ranges arrive with the phase's transfer below: not yet.
                    if not self.sync.on_device and self.weights.unmeasured(p, ranges, updates):
                        continue
                    record = self._update_record(p, updates)
                    made.append(record)
                    if record.slot < 0 and not record.stats.values:
                        pending_range.append(record)
        self.phases.fetch()
        if self.sync.on_device:  # the ranges arrived with the transfer
            ranges = {r.param: Digest.of_range(r.stats.values.get(MIN), r.stats.values.get(MAX))
                      for r in self.phases.records if r.stats.kind == "param"}  # fmt: skip
        self.weights.resolve_by_range(pending_range, ranges, updates or ())
        # Updates a device's ranges could not tell: no record, as on the host (``unmeasured``).
        self.phases.forget([r for r in pending_range if not r.stats.values])
        if made and optimizer is not None:  # a schedule's tail moves nothing: the rules know
            shares = self.weights.learning_rate_shares(optimizer)
            for record in made:
                share = shares.get(id(self.weights.by_name[record.param].param))
                if share is not None and record.stats.values:
                    record.stats.values[LR_SHARE] = share
        self.weights.settle(made, updates or ())
        self.weights.remember_ranges(ranges)
        self._drain()
        self._judge_phase()
        self._publish_phase()
        self._pause_if_needed()
        self.phases.release()
        self.weights.snapshots, self.weights.samples = {}, {}

    def _update_was_clean(self) -> bool:
        """Whether this step's gradients and the parameters before it were all finite: then a
        parameter the update made not finite can only come of the optimizer's own arithmetic."""
        return not (self.origins.grad_fired or self.origins.param_fired)

    def _listed(self, p: Param, values: dict[Stat, float]) -> None:
        """A record of a parameter the quiet path found clean, from what it measured (no
        other read): a step that is dumped whatever happens lists every parameter."""
        record = p.record("param", p.name, self.step)
        record.stats.values = values
        record.tensor = p.param.detach()  # alive anyway: dump_tensors may copy it
        self.phases.register(record)

    def _say_what_is_not_watched(self, changed: bool) -> None:
        """No optimizer is watched, yet the model trains (its parameters get gradients or
        ``changed``): the weights are updated by hand or by an optimizer tensordbg was not
        given. Say once, in the first steps, what that leaves unwatched."""
        if self._said_no_optimizer or self.step > 3:
            return
        if not changed and all(p.param.grad is None for p in self.weights.params.values()):
            return  # evaluation only, so far: nothing is missing
        self._said_no_optimizer = True
        message = (
            "no optimizer is watched: a step is one call of the model, and weight updates are "
            "not checked (WeightNotChanging, update statistics) because tensordbg cannot tell "
            "when they happen; pass optimizer= to attach() to watch them"
        )
        self.log(message, "warning")
        print(f"tensordbg: {message}", file=sys.stderr, flush=True)

    def _update_record(self, p: Param, wanted: tuple[Stat, ...]) -> Record:
        record = p.record("update", f"{p.name}.update", self.step)
        applicable = self.ruleset.applicable(record.stats)
        record.rule_ids, record.checks = applicable.rule_ids, applicable.checks
        self.phases.register(record)
        previous = self.weights.before(p)
        if (previous is None and p.name in self.weights.proven) or (  # by its sample
            previous is not None
            and self.sync.reads_free(p.param)
            and _moved(p, previous, self.weights, wanted)
        ):
            record.stats.values = {wanted[0]: 0.0}
        elif previous is not None and not self.sync.on_device:
            vector = update_stats(p.param.detach(), previous, wanted)
            record.stats.values = dict(zip(wanted, vector.tolist(), strict=True))
        elif previous is not None:
            parts = device_parts(p.param.detach(), wanted, previous)
            self.phases.awaits(record, wanted, self.phases.batch.add_parts(*parts))
        self.phases.pending.append(Judged(record))
        return record


def _final_grads(weights: ParamWatch) -> list[tuple[str, torch.Tensor]]:
    """Each parameter's gradient as the step gets it (a sparse one's rows)."""
    return [(p.name, g) for p in weights.params.values()
            if p.param.grad is not None and watchable(g := rows_of(p.param.grad))]  # fmt: skip


def _moved(p: Param, previous: torch.Tensor, weights: ParamWatch,
           wanted: tuple[Stat, ...]) -> bool:  # fmt: skip
    """Whether a sample of the parameter against its copy from before the step proves that the
    step changed it, when that is all the rules ask of its update (WeightNotChanging's)."""
    if len(wanted) != 1 or wanted[0].name != "update_unchanged":
        return False
    if weights.snapshots.get(p.name) is not previous:
        return False  # the step left it alone: nothing moved
    rtol, atol = wanted[0].params
    moved = sample_moved(p.param, previous, rtol, atol)
    weights.sample_verdict(p, moved)
    return moved
