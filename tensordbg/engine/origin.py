"""Origin: name the module that produced a bad value, not every module that passed it on.

A NaN made in one layer turns every later activation, the loss and every gradient into NaN. A
check on each module flags them all; what a person needs is the first producer. For rules whose
condition flows with the value (``Rule.propagates``), records are classified in execution order
using the call tree of the forward:

- Forward: a call is the origin of a condition when its output shows it while none of its tensor
  inputs nor its own parameters did, and no call inside it was already the origin. The root's
  inputs showing it are the origin (a NaN in the batch). A value computed by the module's own code
  between its submodules makes that module the origin.
- Backward: a call is the origin when the gradient of one of its inputs (or of one of its own
  parameters) shows the condition while the gradient of its outputs did not, its own forward
  values did not either (a NaN saved in forward comes back in backward as 0 * NaN), and no call
  inside it already was the origin (``sqrt(x * x)`` at x = 0: a finite forward, a NaN backward).
- The gradient of the model's output is the origin when neither the observed loss nor the
  output itself showed it.
- A block that ``torch.utils.checkpoint(..., use_reentrant=True)`` runs again in backward has
  its backward run as a pass of its own over a graph no hook saw: of its gradients only its
  parameters' are seen. The first gradient of the step's backward to show a condition there is
  its origin, said to be the block's (:meth:`Attribution._unseen`).

The conditions followed are non-finiteness (whatever rule reported it: a NaN gradient is also an
exploding one) and the findings of rules that propagate; a rule that does not propagate (a
vanishing gradient, a weight that does not change) is an origin wherever it fires. These
functions only read and mark the call tree; :class:`Attribution` turns a judged record's
findings into verdicts (where each is reported, and whether it is an origin), and the session
makes hits of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any, NamedTuple

from tensordbg.engine.bad_outputs import CarriedStates, reached_from
from tensordbg.engine.records import NONFINITE, Call, Record, is_model_output
from tensordbg.rules.base import Finding


class Verdict(NamedTuple):
    """One finding, where it is reported and whether it is the origin of its condition."""

    record: Record
    rule_id: int
    finding: Finding
    origin: bool
    call: Call | None = None
    kind: str | None = None
    name: str | None = None
    by_gradient: bool = False  # a parameter's condition that its gradient held before the step
    unseen: str = ""  # the block whose gradients no hook saw, where it first showed (see grad)
    bad_since: int | None = None  # a parameter's: the step it was first seen so, still so since


def condition_of(record: Record, rule_id: int) -> int | None:
    """What a finding's origin is traced by: non-finiteness, the rule itself when it
    propagates, or nothing (then it is an origin wherever it fires)."""
    if NONFINITE in record.conditions:
        return NONFINITE
    return rule_id if rule_id in record.conditions else None


class Attribution:
    """The origin bookkeeping of one training step, across its phases: which conditions the
    parameters, their gradients, the model's outputs and the observed loss showed."""

    def __init__(self, owner_calls: Callable[[str], list[Call]]):
        self._owner_calls = owner_calls  # a parameter's name -> the calls of its module
        self.param_fired: dict[str, set[int]] = {}
        self.bad_since: dict[str, int] = {}
        """The step each parameter not finite now was first seen so (while it stays so)."""
        self.grad_fired: dict[str, set[int]] = {}
        self.root_fired: set[int] = set()
        self.loss_fired: set[int] = set()
        self.grad_found: set[int] = set()  # the conditions of this step's backward origins
        self.param_order: dict[str, int] = {}
        """When the parameters were read whole in a backward (deferred checks, a gradient not
        finite): each one's place in the forward, by its module's first call."""
        self.fired_roots: list[tuple[frozenset[int], list[Any]]] = []
        """The step's root calls whose outputs showed a condition: what, and those outputs'
        autograd nodes, for a loss made of several root calls' outputs (``reached_from``)."""
        self.carried = CarriedStates()  # earlier steps' bad outputs, should they come back

    def begin_forward(self) -> None:
        self.loss_fired = set()
        self.root_fired = set()
        self.grad_found = set()  # a backward to come is another's (with no optimizer too)

    def gradients_final(self, records: Iterable[Record]) -> None:
        """The backward passes of the step are done: remember what each parameter's gradient
        showed (a bad parameter after the step is then no origin)."""
        self.grad_fired = {r.param: set(r.conditions) for r in records
                           if r.stats.kind == "grad" and r.conditions}  # fmt: skip
        self.grad_found = set()

    def spread_before_step(self, grads: Iterable[tuple[str, Any]]) -> None:
        """Called when some gradient was not finite at its pass's end: ``grads`` are the
        parameters' gradients as the step gets them. The script's code may spread that one to
        the others before the step (``clip_grad_norm_`` scales every gradient by the total
        norm, NaN then): those are passed on too, and a parameter they make not finite is no
        origin (one backward NaN made 13 origins, each "the gradient was clean")."""
        for name, grad in grads:
            if name not in self.grad_fired and not bool(grad.isfinite().all()):
                self.grad_fired[name] = {NONFINITE}

    def new_step(self) -> None:
        self.fired_roots = []
        self.param_order = {}

    def param_clean(self, name: str) -> None:
        self.param_fired.pop(name, None)
        self.bad_since.pop(name, None)

    def update_skipped(self) -> None:
        """The step's update was skipped (``k``, ``on_hit="skip"``): a parameter still bad
        was so before it, so no update made it. At its next sight it is the origin again (of
        the next step's NaN, as it was of this one's), and a pause stops there: the skip did
        not clean it."""
        self.param_fired.clear()
        self.grad_fired = {}  # dropped with the update: they wrote nothing

    def report(self, record: Record) -> list[Verdict]:
        """Verdicts of a judged record whose origin does not need the call tree; outputs and
        gradients are judged at their call's end (:meth:`exit`) and at :meth:`grad`."""
        kind = record.stats.kind
        if kind == "observed":
            self.loss_fired |= record.conditions
            fired = self.root_fired | reached_from(record, self.fired_roots)
            return [Verdict(record, rule_id, finding, condition_of(record, rule_id) not in fired)
                    for rule_id, finding in record.findings.items()]  # fmt: skip
        if kind == "param":
            # Not made here if its gradient brought it, or if it was so already (a weight set to
            # Inf by hand stays Inf: its first check is the origin, the later ones are not).
            by_gradient = self.grad_fired.get(record.param, set())
            upstream = by_gradient | self.param_fired.get(record.param, set())
            since = self.bad_since.get(record.param)
            out = []
            for rule_id, finding in record.findings.items():
                condition = condition_of(record, rule_id)
                out.append(Verdict(record, rule_id, finding, condition not in upstream,
                                   by_gradient=condition in by_gradient,
                                   bad_since=since))  # fmt: skip
            if record.conditions:
                self.param_fired[record.param] = set(record.conditions)
                if NONFINITE in record.conditions:
                    self.bad_since.setdefault(record.param, record.stats.step)
            else:
                self.param_clean(record.param)
            return out
        if kind == "input" and not record.hidden:
            back = self.carried.handed_back(record)  # an earlier step's bad output (RNN state)
            return [Verdict(record, r, back.said(f) if back else f,
                            back is None or condition_of(record, r) not in back.conditions)
                    for r, f in record.findings.items()]  # fmt: skip
        if kind == "update":
            return [Verdict(record, r, f, True) for r, f in record.findings.items()]
        return []

    def exit(self, call: Call) -> list[Verdict]:
        params_fired: set[int] = set()
        if self.param_fired:
            for name in call.params:
                params_fired |= self.param_fired.get(name, set())
        verdicts = exit(call, params_fired)
        out = []
        for suffix, record in call.outputs:
            for rule_id, finding in record.findings.items():
                condition = condition_of(record, rule_id)
                is_origin = condition is None or verdicts[id(record), condition]
                if record.producer is call:
                    out.append(Verdict(record, rule_id, finding, is_origin))
                elif condition is not None and is_origin:
                    # Passed up from a submodule, but made by this module's own code.
                    name = call.tensor_name("output", suffix)
                    finding = replace(
                        finding, message=finding.message.replace(record.stats.name, name)
                    )
                    out.append(Verdict(record, rule_id, finding, True, call, "output", name))
        out += _given_by_own_code(call, params_fired)
        if call.parent is None:
            self.root_fired = set(call.fired_out)
            if call.fired_out:  # the step's later losses may come of it (model(a) - model(b))
                held = [r.held() for _, r in call.outputs if r.conditions]
                self.carried.remember([r for _, r in call.outputs if r.conditions])
                # The outputs' autograd nodes (the tensors may be freed before the loss is seen);
                # an output without one (gone, no gradient) makes every loss count it.
                nodes = [getattr(t, "grad_fn", None) for t in held]
                self.fired_roots.append((call.fired_out, nodes))
        return out

    def grad(self, record: Record) -> list[Verdict]:
        if not record.findings:
            return []
        verdicts = self._grad(record)
        self.grad_found |= {condition_of(record, v.rule_id) for v in verdicts if v.origin}
        return verdicts

    def _grad(self, record: Record) -> list[Verdict]:
        if record.grad_of is None:  # a parameter's gradient
            calls = self._owner_calls(record.param)
            if calls and all(c.unseen_grads for c in calls):
                return self._unseen(record, calls[0], calls)
            fed = _fed_unseen(calls)
            if fed is not None:  # its output's gradient came out of such a block
                return self._unseen(record, fed, calls)
            made_here = param_grad(record, calls, self._params_before(record.param))
            return [Verdict(record, rule_id, finding,
                            (c := condition_of(record, rule_id)) is None or made_here[c])
                    for rule_id, finding in record.findings.items()]  # fmt: skip
        consumers = record.grad_of.consumers
        if consumers and all(c.unseen_grads for c in consumers):
            inner = max(consumers, key=lambda c: c.depth)
            suffix = next((s for s, r in inner.inputs if r is record.grad_of), record.suffix)
            name = inner.tensor_name("grad_input", suffix)
            forward = record.grad_of
            for condition in record.conditions:
                for call in (forward.producer, *forward.passed_up):
                    if call is not None:
                        call.fired_grad_out |= {condition}
            return self._unseen(record, inner, [inner], "grad_input", name)
        where = grad(record, self.loss_fired)
        out = []
        for rule_id, finding in record.findings.items():
            condition = condition_of(record, rule_id)
            if condition is None:
                out.append(Verdict(record, rule_id, finding, True))
                continue
            call, kind, is_origin = where[condition]
            name = record.stats.name
            if call is not None and kind == "grad_input":
                suffix = next((s for s, r in call.inputs if r is record.grad_of), record.suffix)
                name = call.tensor_name("grad_input", suffix)
            out.append(Verdict(record, rule_id, finding, is_origin, call, kind, name))
        return out

    def _params_before(self, name: str) -> set[int]:
        """The conditions of the parameters read whole in this backward (:attr:`param_order`)
        whose modules the forward called before ``name``'s, or that are its own module's."""
        order = self.param_order
        if not order or not self.param_fired:
            return set()
        at = order.get(name, 0)
        return {c for other, fired in self.param_fired.items() if order.get(other, at + 1) <= at
                for c in fired}  # fmt: skip

    def _unseen(self, record: Record, call: Call, calls: list[Call], kind: str | None = None,
                name: str | None = None) -> list[Verdict]:  # fmt: skip
        """A gradient that came out of a block whose gradients no hook saw (reentrant activation
        checkpointing runs its backward as a pass of its own, over a graph recomputed in
        backward): which module in it made a condition cannot be told, only where it first
        showed. The first gradient of the step's backward that shows it is the origin, said
        to be that block's, unless the forward values of ``calls`` (whose gradient it is)
        showed it; the later ones are passed on."""
        block = _region(call)
        region = block.path
        # The block's own forward values count too: a NaN its forward made (sqrt of negatives
        # in it) flows back through every gradient of the block, which passes it on.
        shown = [*calls, block]
        out = []
        for rule_id, finding in record.findings.items():
            condition = condition_of(record, rule_id)
            origin = condition is None or not (
                condition in self.grad_found
                or any(condition in c.fired_in or condition in c.fired_out for c in shown)
                or _came_into(block, condition)
            )
            if condition is not None:
                _carries_back(block, condition)
            out.append(Verdict(record, rule_id, finding, origin, call if kind else None, kind,
                               name, unseen=region))  # fmt: skip
        return out


def _region(call: Call) -> Call:
    """The block a reentrant checkpoint around ``call`` runs again in backward: the outermost
    call around it whose gradients no hook saw, or the call whose forward checkpoints its
    whole body (Hugging Face's layers: their own hooks run outside the checkpoint)."""
    block = call.unseen_region()
    parent = block.parent
    if parent is not None and parent.parent is not None and all(
            c.unseen_grads for c in parent.children):  # fmt: skip
        return parent
    return block


def _came_into(block: Call, condition: int) -> bool:
    """Whether the unseen gradient of ``block``'s outputs carried ``condition`` in: a call that
    took one, or the code around it that did (its parent's), carried it in its backward (a NaN
    a later forward made flows back through every gradient before it), or a later block's
    gradients showed it (:func:`_carries_back`)."""
    return condition in block.fired_grad_out or any(
        _carried(c, condition) for c in (
            *(c for _, r in block.outputs for c in r.consumers
              if c is not block and block not in c.ancestors()),
            *((block.parent,) if block.parent is not None else ())))  # fmt: skip


def _carries_back(block: Call, condition: int) -> None:
    """A gradient of ``block`` showed ``condition``: so, as far as can be told, did the
    gradients of its inputs and of its calls' inputs, which its backward made."""
    calls = [block]
    for call in calls:
        calls += call.children
        for c in (c for _, r in call.inputs for c in (r.producer, *r.passed_up) if c is not None):
            c.fired_grad_out |= {condition}


def _fed_unseen(calls: Iterable[Call]) -> Call | None:
    """A call whose gradients no hook saw that alone took an output of ``calls``: the gradient
    of that output came out of it (reentrant activation checkpointing)."""
    for call in calls:
        for _, record in call.outputs:
            if record.consumers and all(c.unseen_grads for c in record.consumers):
                return record.consumers[0]
    return None


def enter(call: Call) -> None:
    """At a call's start: remember which conditions its inputs already showed."""
    for _, record in call.inputs:
        if record.conditions:
            call.fired_in |= record.conditions


def exit(call: Call, params_fired: set[int]) -> dict[tuple[int, int], bool]:
    """At a call's end: for each output record and condition it shows, whether this call is where
    it originated, keyed by ``(id(record), condition)``. ``params_fired``: the conditions its own
    parameters showed (they explain the calls around it too)."""
    if params_fired:
        for ancestor in call.ancestors():
            ancestor.fired_in = ancestor.fired_in | params_fired
    verdicts = {}
    for _, record in call.outputs:
        for condition in record.conditions:
            call.fired_out |= {condition}
            origin = (
                condition not in call.fired_in
                and condition not in call.origin_below
                and condition not in params_fired
            )
            if origin:
                _mark(call, condition, below=True)
            verdicts[id(record), condition] = origin
    return verdicts


def _given_by_own_code(call: Call, params_fired: set[int]) -> list[Verdict]:
    """The conditions ``call``'s own code gave a submodule's input that its outputs do not show
    (a rule whose ``match`` leaves them out, ``TensorRange(match="inner.*")``; a value masked
    before the output): reported at that input, made here. Else nothing the rule judges would
    be their origin, and a hit that should pause would only ever be "passed on"."""
    if not any(child.fired_in for child in call.children):
        return []  # no input of a submodule showed anything: most calls, every clean step
    shown: set[int] = set()
    for _, record in call.outputs:
        shown |= record.conditions
    # Its own inputs, handed on to a submodule, were made outside it: its parent's to judge.
    out, seen = [], {id(record) for _, record in call.inputs}
    for child in call.children:
        for _, record in child.inputs:
            if record.producer is not None or not record.findings or id(record) in seen:
                continue  # another call's output (reported there), or nothing found
            seen.add(id(record))
            for rule_id, finding in record.findings.items():
                condition = condition_of(record, rule_id)
                if condition is None or condition in shown or condition in params_fired:
                    continue
                if condition in call.fired_in or condition in call.origin_below:
                    continue  # it came in with the call's inputs, or a call inside made it
                if condition == NONFINITE and record.stats.has_nan is False:
                    # Infs its outputs do not show were absorbed, not hidden: an additive -inf
                    # attention mask, which softmax makes exact zeros (61 false alarms in a
                    # healthy run with nn.Transformer's causal mask, found trying it).
                    continue
                _mark(call, condition, below=True)
                out.append(Verdict(record, rule_id, finding, True, call, "output",
                                   record.stats.name))  # fmt: skip
    return out


def grad(record: Record, loss_fired: set[int]) -> dict[int, tuple[Call | None, str, bool]]:
    """For the gradient of a forward tensor, per condition: ``(call, kind, origin)`` naming where
    it is reported: the innermost consumer whose backward made it (``grad_input``, origin), else
    the producer whose output gradient it is (``grad_output``)."""
    forward = record.grad_of
    assert forward is not None
    producer = forward.producer
    consumers = sorted(forward.consumers, key=lambda c: -c.depth)
    around = {id(a) for c in consumers for a in c.ancestors()}
    out: dict[int, tuple[Call | None, str, bool]] = {}
    for condition in record.conditions:
        if producer is not None:
            producer.fired_grad_out |= {condition}
            for call in forward.passed_up:
                call.fired_grad_out |= {condition}
        reported: tuple[Call | None, str, bool] | None = None
        taking = []
        for call in consumers:
            if any(r is forward for _, r in call.outputs):
                # It returned this very tensor (an identity, a wrapper handing its input on):
                # no backward of its own ran on it; the gradient of its output is this one.
                call.fired_grad_out |= {condition}
            else:
                taking.append(call)
        # The gradient is the sum of what each innermost call that took the tensor gave back
        # (an attention's q, k and v take one input): one that carried the condition in
        # explains it, and none of the others made it.
        carried = any(_carried(call, condition) for call in taking if id(call) not in around)
        for call in () if carried else taking:
            if _carried(call, condition):
                continue
            if reported is None:
                reported = (_summed_in(call, taking, condition), "grad_input", True)
            _mark(call, condition, below=False)
        if reported is None and not carried:
            user = _own_code(forward)
            if user is not None and _made_in_backward(user, condition, forward):
                # No module's backward made it, and the gradient of the call whose own code
                # used the value was clean: that code's backward made it (sqrt(w * w) at
                # w = 0 between two submodules: a finite forward, 0/0 in backward).
                _mark(user, condition, below=False)
                reported = (user, "grad_output", True)
        if reported is None:
            if producer is not None:
                # The model output's gradient comes from the loss: made there if it was clean;
                # unless a later root forward took it (a GAN's G(z) fed to D): then it came
                # back through that call's backward.
                origin = (
                    is_model_output(forward)
                    and not forward.consumers
                    and condition not in loss_fired
                    and condition not in forward.conditions
                )
                if origin:
                    _mark(producer, condition, below=False)
                reported = (producer, "grad_output", origin)
            else:
                reported = (consumers[0] if consumers else None, "grad_input", False)
        out[condition] = reported
    return out


def _summed_in(call: Call, taking: list[Call], condition: int) -> Call:
    """Who made the gradient of a value ``call`` took: ``call``, or a call around it that took
    it too, returns outputs of its own and made the condition in its own backward: a LoRA
    layer's ``x`` goes to ``base`` and into ``x @ A.T`` (its NaN was named ``base``'s)."""
    named = call
    for outer in call.ancestors():
        if any(c is outer for c in taking) and condition in outer.grad_origin_below and not all(
                r.producer is call or call in r.passed_up for _, r in outer.outputs):  # fmt: skip
            named = outer
    return named


def _carried(call: Call, condition: int) -> bool:
    """Whether ``condition`` came into ``call``'s backward rather than being made there: the
    gradient of its output showed it, a call inside it made it, or its forward values had it."""
    return any(condition in seen for seen in (call.fired_grad_out, call.grad_origin_below,
                                              call.fired_in, call.fired_out))  # fmt: skip


def _own_code(forward: Record) -> Call | None:
    """The call whose own code (between its submodules) received ``forward`` from the call
    that made or last returned it: that call's parent; None for the model's output."""
    holder = forward.passed_up[-1] if forward.passed_up else forward.producer
    return holder.parent if holder is not None else None


def _made_in_backward(call: Call, condition: int, forward: Record) -> bool:
    """Whether ``call``'s own backward code made a condition on the gradient of ``forward``: the
    gradient of its outputs and its forward values did not show it, and no call inside it was
    already the origin."""
    return not (_carried(call, condition) or condition in forward.conditions)


def param_grad(record: Record, owner_calls: Iterable[Call],
               before: set[int] = frozenset()) -> dict[int, bool]:  # type: ignore[assignment]  # fmt: skip
    """For a parameter's gradient, per condition: whether it was made here (the gradient of the
    owning module's outputs did not show it, nor did a parameter ``before`` it)."""
    calls = list(owner_calls)
    verdicts = {}
    for condition in record.conditions:
        origin = condition not in before and not any(
            condition in c.fired_grad_out or condition in c.fired_in for c in calls
        )
        if origin:
            for call in calls:
                _mark(call, condition, below=False)
        verdicts[condition] = origin
    return verdicts


def _mark(call: Call, condition: int, below: bool) -> None:
    """Record that ``call`` (and so each call around it) has an origin of this condition inside."""
    target = "origin_below" if below else "grad_origin_below"
    for c in (call, *call.ancestors()):
        setattr(c, target, getattr(c, target) | {condition})
