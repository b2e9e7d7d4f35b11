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

The conditions followed are non-finiteness (whatever rule reported it: a NaN gradient is also an
exploding one) and the findings of rules that propagate; a rule that does not propagate (a
vanishing gradient, a weight that does not change) is an origin wherever it fires. These
functions only read and mark the call tree; the session makes hits.
"""

from __future__ import annotations

from collections.abc import Iterable

from tensordbg.engine.capture import Call, Record, is_model_output

NONFINITE = -1
"""The condition "holds NaN or Inf", followed whatever rule reported it (rule ids are >= 0)."""


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


def grad(record: Record, loss_fired: set[int]) -> dict[int, tuple[Call | None, str, bool]]:
    """For the gradient of a forward tensor, per condition: ``(call, kind, origin)`` naming where
    it is reported: the innermost consumer whose backward made it (``grad_input``, origin), else
    the producer whose output gradient it is (``grad_output``)."""
    forward = record.grad_of
    assert forward is not None
    producer = forward.producer
    consumers = sorted(forward.consumers, key=lambda c: -c.depth)
    out: dict[int, tuple[Call | None, str, bool]] = {}
    for condition in record.conditions:
        if producer is not None:
            producer.fired_grad_out |= {condition}
            for call in forward.passed_up:
                call.fired_grad_out |= {condition}
        reported: tuple[Call | None, str, bool] | None = None
        for call in consumers:
            if condition in call.fired_grad_out or condition in call.grad_origin_below:
                continue
            if condition in call.fired_in or condition in call.fired_out:
                continue  # its forward values showed it already: backward only carried it
            _mark(call, condition, below=False)
            if reported is None:
                reported = (call, "grad_input", True)
        if reported is None:
            if producer is not None:
                # The model output's gradient comes from the loss: made there if it was clean.
                origin = (
                    is_model_output(forward)
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


def param_grad(record: Record, owner_calls: Iterable[Call]) -> dict[int, bool]:
    """For a parameter's gradient, per condition: whether it was made here (the gradient of the
    owning module's outputs did not show it)."""
    calls = list(owner_calls)
    verdicts = {}
    for condition in record.conditions:
        origin = not any(condition in c.fired_grad_out or condition in c.fired_in for c in calls)
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
