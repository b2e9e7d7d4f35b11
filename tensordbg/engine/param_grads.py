"""The parameter gradients at the end of a backward pass (deferred checks): which ones the pass
made, their records, their norms, and the rules judged on all of them at once.

On the host a parameter has no hook: when the pass ends, each gradient that changed (a new
tensor, or a new version: gradients accumulate) is measured by one norm (a BLAS dot), and each
rule judges all of them together (:meth:`~tensordbg.rules.Rule.check_many`). A gradient whose
record is prepared as its last step's (:class:`Prepared`: the same rules, dtype and
shape) gets its record without asking the rules again: most of them, most steps. On a device
the norms join the phase's one transfer. Part of :class:`~.backward.BackwardPhase`.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import get_gradient_edge

from tensordbg.engine.judge import Applicable, RuleSet, applicability_key
from tensordbg.engine.phases import Gradient, Judged, ParamGradNote
from tensordbg.engine.records import Record, param_grad_record
from tensordbg.statistics import FINITE, L2, TensorStats
from tensordbg.statistics.batch import norm_only, norms_of, rows_of
from tensordbg.statistics.torch_kernels import norm_parts, watchable

_BY_NORM = (FINITE, L2)  # what most parameter gradients' rules want (the default rules')


@dataclass(slots=True, frozen=True)
class Prepared:
    """What a tensor's record was prepared with, to make the next one of the same tensor (a
    parameter's gradient, every step) without asking again: its rules, whether its norm
    alone gives what they want, its size."""

    dtype: torch.dtype
    shape: torch.Size
    stats: TensorStats
    rules: Applicable
    by_norm: bool
    """Its statistics all come from its norm (and the rules want some)."""
    nbytes: int
    param: str
    key: tuple[Any, ...] = field(init=False)
    """What decides which rules apply to it (:meth:`RuleSet.still` looks it up)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", applicability_key(self.stats))

    def record(self, owner: str, owner_type: str, step: int, version: int) -> Record:
        """A new record of the tensor, as prepared: its statistics not computed yet."""
        return self.record_of(self.stats_of(owner, owner_type, step, {}), version)

    def stats_of(self, owner: str, owner_type: str, step: int, values: dict) -> TensorStats:
        """The tensor's statistics at ``step``, as prepared, holding ``values``."""
        was = self.stats
        return TensorStats(was.name, owner, was.kind, was.phase, step, was.shape, was.dtype,
                           values, owner_type, 0, was.trainable)  # fmt: skip

    def record_of(self, stats: TensorStats, version: int) -> Record:
        rules = self.rules
        return Record(stats, None, version, self.nbytes, param=self.param,
                      rule_ids=rules.rule_ids, checks=rules.checks,
                      wanted=rules.wanted)  # fmt: skip

    def fits(self, tensor: torch.Tensor, ruleset: RuleSet) -> bool:
        """Whether ``tensor``'s record is prepared as this one was: the same dtype and shape,
        and the same rules (none added, changed or disabled since)."""
        return (tensor.dtype is self.dtype and tensor.shape == self.shape
                and ruleset.still(self.key, self.rules))  # fmt: skip


class ParamGradients:
    """Part of :class:`~tensordbg.engine.session.Session`: its parameter gradients at the end of
    a backward pass."""

    _grad_makings: dict[str, Prepared]
    _by_norm: list[tuple[Record, torch.Tensor]]
    """The parameter gradients noted with their records at the pass's end, to be measured by
    their norms (:meth:`_note_param_grads`, then :meth:`_read_notes`)."""
    _order_cache: tuple[tuple[str, ...], list[Any]] | None = None

    def _note_param_grads(self) -> set[str]:
        """Deferred on the host: the parameter gradients this pass made (or changed: gradients
        accumulate), noted for the pass's norms. Parameters have no hooks there. A gradient
        whose record is prepared as last step's (:class:`Prepared`), measured by its norm
        alone, gets its record here: most of them, most steps (:attr:`_by_norm`)."""
        seen = self._grads_seen
        pending = self.phases.pending
        makings = self._grad_makings
        ruleset, step = self.ruleset, self.step
        fresh = self.interval > 1 and step % self.interval != 0  # prepared anew between steps
        by_norm = self._by_norm
        light = self._light = [] if self._goes_light() else None
        reached, self._pass_made = self._pass_made, None
        idle = self.capture.fed_nothing if self.capture.empty_calls else None
        if self._accumulated is not None and self.plan is not None:
            self._learned_order()
        noted = set()
        for p in self._backward_order():
            grad = p.param.grad
            if grad is None or not p.param.requires_grad:
                continue
            name = p.name
            last, version = seen.get(name), grad._version
            if idle is not None and idle(p.owner):
                seen[name] = (weakref.ref(grad), version)  # zeros of no data: not reached
                continue
            if reached is not None and name not in reached and not self._made_inside(name, grad):
                # Not accumulated by this pass: a parameter it did not reach keeps what it had
                # (a zeroed gradient, set_to_none=False: no "receives nothing" of its own).
                seen[name] = (weakref.ref(grad), version)
                continue
            if reached is None and last is not None and last[0]() is grad and last[1] == version:
                continue  # not touched by this pass
            seen[name] = (weakref.ref(grad), version)
            if grad.layout is torch.sparse_coo:
                grad = rows_of(grad)
                version = grad._version
            made = makings.get(name)
            if made is not None and made.by_norm and not fresh and made.fits(grad, ruleset):
                if light is not None:
                    light.append((made, p, grad, version))
                else:
                    record = made.record(p.owner, p.owner_type, step, version)
                    self._place(record, grad)
                    by_norm.append((record, grad))
                    pending += [Judged(record), Gradient(record)]
                noted.add(name)
            elif watchable(grad):
                if light:  # in execution order: the gradients before it get their records now
                    self._light_records(light)
                light, self._light = None, ()
                pending.append(ParamGradNote(name, p.owner, p.owner_type, grad))
                noted.add(name)
        self._apart = {}
        return noted

    _light: list[tuple[Prepared, Any, torch.Tensor, int]] | tuple = ()
    """The parameter gradients of this pass noted without records (:meth:`_goes_light`)."""

    def _goes_light(self) -> bool:
        """Whether this pass's parameter gradients can go without records while they are clean
        (deferred on the host, the common case): a record, its events and its place in the
        phase cost ~10 us each in the cold cache a backward pass leaves (53 of them: ~0.5 ms
        a step), and a clean gradient's is read by nothing but a pause or a listing at this
        phase's end. Their statistics are still made, judged by every rule as before, and
        kept as the latest; a finding, a pause, a dump, a listing or a rule comparing a
        phase's tensors gives them their records as before (:meth:`record_clean_gradients`)."""
        return not (self.sync.on_device or self.triggered or self.amp.scaler is not None
                    or self.dumps_all() or self.boundary_wanted() or self.bus.wants("phase_end")
                    or any(a.phase_wide and a.enabled for a in self.ruleset.active))  # fmt: skip

    def _light_records(self, light: list[Any], judged: list[TensorStats] | None = None,
                       events: bool = True) -> list[Record]:  # fmt: skip
        """Give gradients noted without records (:attr:`_light`'s) theirs, in their order, as
        the records they would have had: ``judged``, their statistics as judged (findings are
        given to the records by the caller), else to be measured and judged (:attr:`_by_norm`);
        ``events``: their events too (else only listed in the phase: a pause after it was
        drained)."""
        pending, made_now = self.phases.pending, []
        for i, (made, p, grad, version) in enumerate(light):
            if judged is None:
                record = made.record(p.owner, p.owner_type, self.step, version)
                self._place(record, grad)
                self._by_norm.append((record, grad))
            else:
                record = made.record_of(judged[i], version)
                record.judged = True
                self._place(record, grad)
            if events:
                pending += [Judged(record), Gradient(record)]
            made_now.append(record)
        return made_now

    def _judge_light(self) -> None:
        """Measure and judge the gradients noted without records (their norms, all at once),
        as :meth:`_judge_norms` judges records; they get records only if a rule finds
        something (or one is not finite: then as before, through their records)."""
        light, self._light = self._light, ()
        if not light:
            return
        norms = norms_of([item[2] for item in light])
        if not all(map(math.isfinite, norms)):
            self._light_records(light)  # judged as records, from the first not finite
            return
        step, judged = self.step, self.metrics.judged
        stats = []
        for (made, p, _, _), norm in zip(light, norms, strict=True):
            wanted = made.rules.wanted
            values = {FINITE: 1.0, L2: norm}
            if wanted != _BY_NORM:
                values = {s: values[s] for s in wanted}
            stats.append(made.stats_of(p.owner, p.owner_type, step, values))
        found = self.ruleset.judge_clean(stats, [made.rules.checks for made, *_ in light],
                                         lambda i: self.measuring(light[i][2]))  # fmt: skip
        for t in stats:
            judged(t)
        self.phases.unlisted = (light, stats)  # until the phase ends
        if found:
            records = self.record_clean_gradients()
            self.ruleset.give(records, found)
            for record, (_, _, grad, _) in zip(records, light, strict=True):
                record.keep_if_found(grad)
            self.triggered = True

    def record_clean_gradients(self, events: bool = True) -> list[Record]:
        """The records of the clean gradients judged without them, made now (in their order;
        ``events``: theirs at the end of pending): a finding, a listing or a pause at the end
        of their phase."""
        light_judged, self.phases.unlisted = self.phases.unlisted, None
        if light_judged is None:
            return []
        return self._light_records(*light_judged, events)

    def _clean_gradients(self) -> dict[str, TensorStats]:
        """The statistics of this pass's gradients judged clean without records, by parameter."""
        if self.phases.unlisted is None:
            return {}
        light, stats = self.phases.unlisted
        return {made.param: t for (made, *_), t in zip(light, stats, strict=True)}

    def _backward_order(self) -> list[Any]:
        """The parameters in the order a backward pass makes their gradients, as their hooks
        would have seen them: their modules' in reverse order of first call (nearest the loss
        first), a module's own in the order autograd accumulates them."""
        paths = tuple(self.capture.call_counts())
        cached = self._order_cache
        if cached is not None and cached[0] == paths:
            return cached[1]
        first = {path: i for i, path in enumerate(paths)}
        rank = self.plan.param_order if self.plan is not None else {}

        def key(p: Any) -> tuple[float, int]:
            path = p.owner
            while path not in first and path:
                path = path.rpartition(".")[0]
            return -first.get(path, -1), rank.get(p.name, 0)

        order = sorted(self.weights.params.values(), key=key)
        self._order_cache = (paths, order)
        return order

    _pass_made: set[str] | None = None
    """The parameters whose gradients this backward phase's passes accumulate, as the autograd
    engine said when each began (:meth:`note_pass_params`); None: a pass no hook saw."""
    _accumulators: tuple[Any, list[tuple[str, Any, torch.Tensor]]] | None = None

    def note_pass_params(self) -> None:
        """At the start of a backward pass (its first hook): the parameters it will accumulate a
        gradient into, from the autograd engine (~1 us each). Their gradients are the pass's;
        a gradient changed otherwise (zeroed, clipped, divided in place) is not."""
        params = self.weights.params
        cached = self._accumulators
        if cached is None or cached[0] is not params or len(cached[1]) != len(params):
            nodes = [(p.name, get_gradient_edge(p.param).node, p.param)
                     for p in params.values() if p.param.requires_grad]  # fmt: skip
            cached = self._accumulators = (params, nodes)
        will = torch._C._will_engine_execute_node
        try:
            made = {name for name, node, _ in cached[1] if will(node)}
        except RuntimeError:  # torch.autograd.grad(), which accumulates into no .grad
            made = set()
        self._pass_made = made if self._pass_made is None else self._pass_made | made
        if len(made) < len(cached[1]):
            # A pass the engine runs inside this one can still reach them (reentrant activation
            # checkpointing recomputes a block and runs its backward): what they hold now.
            apart = self._apart
            for name, _, param in cached[1]:
                if name not in made and name not in apart:
                    grad = param.grad
                    apart[name] = (None, 0) if grad is None else (weakref.ref(grad), grad._version)
                    if self.plan is not None and name not in self.plan.param_order:
                        self._learn_accumulation(name, param)  # once

    _accumulated: list[str] | None = None
    _learning: list[Any]
    _learn_tried: frozenset[str] = frozenset()

    def _learn_accumulation(self, name: str, param: torch.Tensor) -> None:
        """A parameter a pass inside this one accumulates (a reentrant checkpoint's block):
        its module's graph is recomputed in backward, so no node of the step's forward says in
        which order autograd accumulates its gradients. A hook on it says, once; until then
        deferred checks sorted it by its module's listing (weight before bias), where the
        other modes, whose hooks see the real order, named the bias first."""
        if name in self._learn_tried:  # a parameter no pass reaches: not hooked every step
            return
        self._learn_tried = self._learn_tried | {name}
        if self._accumulated is None:
            self._accumulated, self._learning = [], []
        said = self._accumulated
        hook = param.register_post_accumulate_grad_hook(lambda _, n=name: said.append(n))
        self._learning.append(self.handles.add(hook))

    def _learned_order(self) -> None:
        """The order the hooks of :meth:`_learn_accumulation` saw, ranked within each module."""
        said, self._accumulated = self._accumulated or [], None
        for handle in self._learning:
            handle.remove()
        seen: dict[str, int] = {}
        for name in dict.fromkeys(said):
            owner = self.weights.by_name[name].owner
            self.plan.param_order.setdefault(name, seen.get(owner, 0))
            seen[owner] = seen.get(owner, 0) + 1
        self._order_cache = None

    _apart: dict[str, tuple[weakref.ref[torch.Tensor] | None, int]]
    """The gradients of the parameters the backward phase's passes do not reach, as each pass
    began: one that changed before the pass ended was made by a pass inside it."""

    def _made_inside(self, name: str, grad: torch.Tensor) -> bool:
        """Whether a parameter the phase's passes do not reach got its gradient during them,
        from a pass the engine ran inside one (reentrant activation checkpointing)."""
        before = self._apart.get(name)
        if before is None:
            return False
        held, version = before
        return held is None or held() is not grad or version != grad._version

    def grads_changed(self) -> bool:
        """Whether a backward pass that no hook saw (its loss reached no hooked tensor) made a
        parameter gradient since the last pass's end, whose end is then checked at the next
        boundary: a gradient tensor that was not there. One changed in place (a version) is
        the script's edit (clipping, zero_grad(set_to_none=False), a division), not a pass."""
        seen = self._grads_seen
        changed = False
        for p in self.weights.params.values():
            grad = p.param.grad
            if grad is not None and p.param.requires_grad:
                last = seen.get(p.name)
                if last is None or last[0]() is not grad:
                    changed = True
                elif last[1] != grad._version:  # an edit: the next pass compares with it
                    seen[p.name] = (last[0], grad._version)
        return changed

    def _param_grad_record(self, note: ParamGradNote) -> tuple[Record, bool, bool, bool]:
        """The record of a noted parameter gradient, prepared as :meth:`_prepare` prepares
        one; whether it is kept, whether its rules speak only of NaN and Inf, and whether its
        statistics all come from its norm. Its rules and what they want are the last step's
        while they still fit (:class:`Prepared`: 0.15 ms a step less for the benchmark's 53
        gradients)."""
        grad = note.grad
        made = self._grad_makings.get(note.name)
        interval_step = self.interval > 1 and self.step % self.interval != 0
        if made is None or interval_step or not made.fits(grad, self.ruleset):
            record = param_grad_record(note.name, note.owner, note.owner_type, grad, self.step)
            kept, silent = self._prepare(record, grad)
            by_norm = norm_only(record, grad)
            if not interval_step:
                self._grad_makings[note.name] = Prepared(
                    grad.dtype, grad.shape, record.stats, self.ruleset.applicable(record.stats),
                    by_norm and bool(record.wanted), record.nbytes, note.name)  # fmt: skip
            return record, kept, silent, by_norm
        record = made.record(note.owner, note.owner_type, self.step, grad._version)
        return record, self._place(record, grad), made.rules.silent, made.by_norm

    def _judge_norms(self, together: list[tuple[Record, torch.Tensor]]) -> None:
        """Screen and judge records that want only ``finite`` and ``l2``, from one norm each;
        on a device, the norms join the phase's transfer and the records are judged after it."""
        if not together:
            return
        if self.sync.on_device and not any(self.amp.scales(r.stats) for r, _ in together):
            norms = torch._foreach_norm([t for _, t in together], 2, dtype=torch.float64)
            for (record, _), norm in zip(together, norms, strict=True):
                slot = self.phases.batch.add_parts(*norm_parts(norm, record.wanted))
                self.phases.awaits(record, record.wanted, slot)
            return
        norms = norms_of([t for _, t in together])
        if not all(map(math.isfinite, norms)):
            self._screen_params_behind()
        finite: list[Record] = []
        tensors: list[torch.Tensor] = []
        scaled = self.amp.scaler is not None
        for (record, tensor), norm in zip(together, norms, strict=True):
            if math.isfinite(norm):
                wanted = record.wanted
                if wanted == _BY_NORM and not scaled:  # most: one dict, nothing to unscale
                    record.stats.values = {FINITE: 1.0, L2: norm}
                else:
                    found = {FINITE: 1.0, L2: norm}
                    values = [found[s] for s in wanted]
                    if self.amp.scales(record.stats):
                        values = self.amp.unscale(wanted, values)
                    record.stats.values = dict(zip(wanted, values, strict=True))
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

    def _screen_params_behind(self) -> None:
        """Deferred checks screened no activation of a clean forward (its output and loss were
        finite: a tanh can hide an Inf), so a parameter gradient that is not finite could be
        named the origin though a weight made it. Before it is judged, every parameter is read
        whole, on such a step only (on a device, one more synchronization): one not finite
        (set by hand between steps, or written by an update where the sample did not look) is
        the origin, and the gradients of the modules the forward called from it on are passed
        on."""
        if not self.sync.keeps_unscreened or self.origins.param_order:
            return
        order = self._backward_order()
        self.origins.param_order = {p.name: len(order) - i for i, p in enumerate(order)}
        for p in order[::-1]:  # in forward order: the first one is the origin
            self.read_param_whole(p)  # (engine/forward.py)

    def _judge_clean_gradients(self) -> None:
        """On a device, a pass's finite parameter gradients are judged together once their
        statistics arrived, as deferred checks judge them on the host: each rule sees every
        gradient's scale before it refines any (VanishingGradient's typical gradient), so the
        modes give the same verdicts."""
        grads = [e.record for e in self.phases.pending
                 if type(e) is Judged and e.record.stats.kind == "grad"]  # fmt: skip
        if any(r.stats.values.get(FINITE) == 0.0 for r in grads):
            self._screen_params_behind()  # before a gradient that is not finite is judged
        clean = [r for r in grads if not r.judged and r.stats.values.get(FINITE) == 1.0]
        if clean:
            self.judge_finite(clean, [r.held() for r in clean])
