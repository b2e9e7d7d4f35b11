"""What a hit at its origin says of where the value came from, by the kind of tensor it was
found in: the sentence :func:`~.hits.with_origin` adds to the rule's finding."""

from __future__ import annotations

from tensordbg.engine.records import CHECKS, Record

ORIGIN_NOTE = {
    ("input", False): "It came in with the batch: look at the data and its preprocessing.",
    ("later_input", False): "It came in with the model's inputs, not as its first argument: a "
    "value the script hands in (a state it carries from step to step, a mask) or data; look at "
    "the code that computes it.",
    ("input", True): "It came in with this module's inputs.",
    ("output", True): "It was produced here: this module's inputs and parameters were clean.",
    ("output", False): "It was produced by the model's own forward code between its submodules.",
    ("grad_input", True): "It was produced by this module's backward: the gradient of its "
    "output was clean.",
    ("grad_input", False): "It was produced by the model's backward: the gradient of its "
    "output was clean.",
    ("grad", True): "It was produced by this module's backward: the gradient of its output "
    "was clean.",
    ("grad_output", True): "It was produced in backward between modules.",
    ("grad_code", True): "It was produced in backward by this module's own code between its "
    "submodules: the gradients flowing into that code were clean.",
    ("grad_code", False): "It was produced in backward by the model's own code between its "
    "submodules: the gradients flowing into that code were clean.",
    ("grad_output", False): "It comes from the loss's backward: the loss itself was clean.",
    ("param", True): "The gradient was clean: the optimizer step or the code around it made it "
    "(learning rate, eps, a manual edit), or the parameter was loaded this way.",
    ("param_before", True): "Its gradient and the optimizer's state for it are finite, so the "
    "update added only finite values: it was so before this step (set between steps by hand, or "
    "loaded so), and the update did not make it. Deferred checks read a parameter after its "
    "update, or where a forward's output shows it; this step's forward hid it (a saturated tanh "
    "or sigmoid). sync='eager' names it in that forward.",
    ("param_between", True): "The optimizer's state for it is finite, so its last update "
    "added only finite values: it was set so after that update, between steps (by hand, or "
    "loaded so), and no update made it.",
    ("param_attach", True): "tensordbg found it when it attached, before the first step: the "
    "model came with it (its initialization, or a checkpoint or state loaded so).",
    ("param_check", True): "session.check_parameters() found it between steps, before the next "
    "update: it was set so since (by hand, or loaded so).",
    ("param_unstepped", True): "It was clean when tensordbg attached, and no optimizer step ran "
    "since: the code between attach and this forward made it (set by hand, or loaded so).",
    ("observed_apart", True): "The watched model was not called for it: it comes of a model "
    "tensordbg does not watch (built anew for a resume?); attach again to that one.",
    ("update", True): "It was produced by the optimizer step.",
    ("observed", True): "The model's outputs were clean: the code that computes it made it.",
    ("buffer", True): "This module's forward wrote it in training mode, though the forward's "
    "outputs were finite: BatchNorm's running statistics average each batch's mean and variance "
    "in, so one batch with NaN, Inf or values whose variance overflows (past about 1.8e19 in "
    "float32) leaves them so for good, and model.eval() then uses them. Look at this step's "
    "batch; then reset them (module.reset_running_stats()) or load a checkpoint.",
    ("buffer_attach", True): "It held NaN or Inf when tensordbg attached: the model came with it "
    "(a checkpoint or a state loaded so). Reset it (a BatchNorm's reset_running_stats()) or "
    "load a clean checkpoint.",
}


def note_kind(kind: str, name: str, module: str | None, record: Record) -> str:
    """Which of :data:`ORIGIN_NOTE`'s sentences an origin of ``kind`` takes: the model's input
    after its first argument (``input[1][0]``: an LSTM's state handed back in) is not said to
    be the batch; a parameter the update did not make (``record.before_update``) says so, and
    so does a buffer the forward did not make (it came with the model)."""
    if kind == "input" and not module and name.startswith("input[") and name[6:8] != "0]":
        return "later_input"
    if kind == "param" and record.stats.phase in CHECKS:  # no update made it
        return f"param_{record.stats.phase}"
    if kind == "param" and record.stats.phase == "forward" and record.stats.step == 0:
        return "param_unstepped"  # checked whole at attach, and nothing stepped since
    if kind == "observed" and record.apart:
        return "observed_apart"
    if kind == "buffer" and record.before_update:
        return "buffer_attach"
    if kind == "param" and record.before_update:
        return "param_between" if record.stats.phase == "forward" else "param_before"
    return kind


SET_APART = frozenset({"param_before", "param_between", "param_check", "param_unstepped"})
"""A parameter's notes that say what set it, apart from any update: the rule's advice (a
learning rate too high) is not theirs."""
