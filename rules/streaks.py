"""ExplodingGradient's memory of each gradient across steps: its norms, its streak above the bar
and the largest it had, with a step counted once however many backward passes accumulate into it
(micro-batches before one optimizer step)."""

from __future__ import annotations

from typing import Any


def once_a_step(name: str, step: int, state: dict[str, Any], streaks: dict[str, int],
                peaks: dict[str, float], passes: dict[str, Any] | None = None) -> None:  # fmt: skip
    """Before gradient ``name`` of ``step`` is judged: at a later backward pass of a step that
    judged it already (gradients accumulated over micro-batches), its history (``state[name]``),
    streak and peak go back to what they were before that step, so that a step counts once,
    with its last pass's norm: ExplodingGradient said "over the 49 steps before it grew" at
    step 41 of a run accumulating 4 micro-batches a step, and "for 2 steps in a row", then 3,
    within one step (found trying the product as a new user). Nothing is copied until a step
    shows a second pass: that first one keeps only its own last norm. ``passes``: this memory
    (:func:`passes_of`), looked up once for a pass's gradients."""
    passes = passes_of(state) if passes is None else passes
    at, before = passes["at"], passes["before"]
    history = state.get(name)
    if at.get(name) == step:  # a later pass of this step
        passes["accumulates"] = True
        saved = before.get(name)
        if saved is not None:
            state[name] = list(saved[0])
            _put(streaks, name, saved[1])
            _put(peaks, name, saved[2])
        elif history is not None:
            del history[passes["length"].get(name, len(history)) :]
        return
    at[name] = step
    passes["length"][name] = 0 if history is None else len(history)
    if passes["accumulates"]:
        before[name] = (list(history or ()), streaks.get(name), peaks.get(name))


def said_this_step(name: str, step: int, state: dict[str, Any]) -> bool:
    """Whether a finding on gradient ``name`` was made at ``step`` already (a later backward
    pass of the step shows the same growth again); notes that one is made now otherwise."""
    said = passes_of(state)["said"]
    if said.get(name) == step:
        return True
    said[name] = step
    return False


def passes_of(state: dict[str, Any]) -> dict[str, Any]:
    """The rule's memory of the steps and backward passes that judged each gradient."""
    passes = state.get("_passes")
    if passes is None:
        passes = state["_passes"] = {"at": {}, "before": {}, "length": {}, "said": {},
                                     "accumulates": False}  # fmt: skip
    return passes


def _put(memory: dict[str, Any], name: str, value: Any) -> None:
    if value is None:
        memory.pop(name, None)
    else:
        memory[name] = value


def calm(name: str, history: list[float], streaks: dict[str, int],
         peaks: dict[str, float]) -> None:  # fmt: skip
    """The gradient's latest norm (``history[-1]``) is not exploding: a streak above the bar
    before it is over, and its norms and this one count among the largest it had."""
    k = streaks.pop(name, 0) if streaks else 0
    top = max(history[-(k + 1) :])
    if top > peaks.get(name, 0.0):
        peaks[name] = top
