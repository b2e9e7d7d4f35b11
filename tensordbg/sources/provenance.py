"""Provenance: which module call produced a value, from which inputs, at which line of the
user's code, and who consumed it; read from the call tree the hooks recorded."""

from __future__ import annotations

import linecache
from typing import Any

import torch

from tensordbg.engine.records import Call, Record, tensor_leaves
from tensordbg.sources import contract
from tensordbg.statistics import TensorStats

CONTEXT_LINES = 3


def provenance(
    session: Any, record: Record, module: str | None = None, call: int = 0
) -> contract.Provenance:
    """Where ``record``'s value came from; ``module``/``call`` pick the enclosing call that
    made it when a submodule only returned it."""
    ref = record.stats.ref
    forward = record.grad_of or record
    producer = forward.producer
    returned_by = None
    consumers = forward.consumers
    if module is not None and producer is not None:
        chosen = next((c for c in forward.passed_up if c.path == module and c.index == call), None)
        if chosen is not None:  # made by this module's own code, returned by a submodule
            returned_by, producer = producer, chosen
    taker = _consumer_named(record, module, call)
    if taker is not None:
        # A gradient named after the call that took its value (its backward made it, origin.py):
        # that call made it, from its inputs, and the producer's backward takes it in turn.
        consumers = [producer] if producer is not None else []
        producer = taker
    # The innermost user line known to have made the value: for a value made by a module's
    # own code and returned through a submodule, the line in that module's forward that called
    # the submodule (the code just above it made the value), not the line that called the module.
    site = returned_by or producer or (forward.consumers[0] if forward.consumers else None)
    owner = session.params_by_name.get(record.param)
    name = record.stats.name
    if returned_by is not None and producer is not None:
        suffix = forward.suffix
        name = producer.tensor_name("output", suffix)
    if taker is not None:
        suffix = next((s for s, r in taker.inputs if r is forward), record.suffix)
        name = taker.tensor_name("grad_input", suffix)
    out: dict[str, Any] = {
        "ref": ref,
        "name": name,
        "kind": "grad_input" if taker is not None else record.stats.kind,
        "step": record.stats.step,
        "producer": _call_dict(producer) if producer else None,
        "returned_by": _call_dict(returned_by) if returned_by else None,
        "inputs": [],
        "consumers": [_call_dict(c) for c in consumers],
        "source": None,
        "stack": [],
    }
    if producer is not None:
        out["inputs"] = [_input_dict(r, producer) for _, r in producer.inputs] + _unjudged(producer)
    elif owner is not None and (updater := _updater(session, record, owner)) is not None:
        # A parameter as the update left it: the optimizer's step wrote it, at the line that
        # called step(); the calls of this step's forward used the value before it.
        optimizer, where = updater
        out["producer"] = {"module": "optimizer", "type": f"{type(optimizer).__name__}.step",
                           "call": 0}  # fmt: skip
        site = None
        if where is not None:
            code, line = where
            out["source"] = _lines(code.co_filename, line, code.co_name)
            out["stack"] = [[code.co_filename, line, code.co_name]]
    elif owner is not None and record.stats.kind == "param":
        # A parameter read before this step's update: no call of this step made its value (an
        # earlier update, a load, code that set it by hand); its module's calls used it.
        calls = session.capture.calls_by_path.get(owner.owner, [])
        out["consumers"] = [_call_dict(c) for c in calls]
        site = None
    elif record.stats.kind == "buffer":
        # A buffer its module's forward wrote (BatchNorm's running statistics): that module.
        calls = session.capture.calls_by_path.get(record.stats.module, [])
        out["producer"] = {"module": record.stats.module, "type": record.stats.module_type,
                           "call": calls[-1].index if calls else 0}  # fmt: skip
        site = calls[-1] if calls else None
    elif owner is not None:
        # Its gradient, made by its module's backward (its update: by the optimizer, no call).
        calls = session.capture.calls_by_path.get(owner.owner, [])
        out["producer"] = {"module": owner.owner, "type": owner.owner_type, "call": 0}
        out["consumers"] = []
        site = calls[0] if calls else None
    if site is not None:
        out["source"] = _source(site)
        out["stack"] = _stack(site)
    elif record.stats.kind == "observed" and (seen := session.observed.where(name)) is not None:
        code, line = seen  # the line that gave it to session.observe: the loss code is above
        out["source"] = _lines(code.co_filename, line, code.co_name)
        out["stack"] = [[code.co_filename, line, code.co_name]]
    operation = producer.operation if producer is not None else None
    if operation is not None and operation["file"]:
        # The line inside the producer's forward that made the first NaN/Inf (pinpoint.py):
        # the innermost user line, below the one that called the module.
        out["operation"] = operation
        out["source"] = _lines(operation["file"], operation["line"], operation["function"])
        frame = [operation["file"], operation["line"], operation["function"]]
        code = site.site[0] if site is not None and site.site is not None else None
        same = code is not None and (code.co_filename, code.co_firstlineno) == (
            operation["file"], operation["first_line"])  # fmt: skip
        if same and out["stack"]:
            out["stack"][-1] = frame  # the same forward, a line further up: one frame
        else:
            out["stack"].append(frame)
    return out


def _updater(session: Any, record: Record, owner: Any) -> tuple[Any, Any] | None:
    """For a parameter's record of the optimizer phase (its value after the update): the
    optimizer that holds it and the user's line that called its ``step()`` (None if unknown)."""
    if record.stats.kind != "param" or record.stats.phase != "optimizer" or record.before_update:
        return None
    for optimizer in session.optimizers:
        if any(p is owner.param for group in optimizer.param_groups for p in group["params"]):
            return optimizer, session.step_sites.get(id(optimizer))
    return None


def _consumer_named(record: Record, module: str | None, call: int) -> Call | None:
    """The call that took ``record``'s forward value when the hit names that call: a gradient
    its backward made, reported as its ``grad_input``, is stored as the producer's output
    gradient."""
    if module is None or record.grad_of is None:
        return None
    takers = record.grad_of.consumers
    return next((c for c in takers if c.path == module and c.index == call), None)


def brief(stats: TensorStats) -> dict[str, Any]:
    """What is known of a tensor's statistics: its summary when computed, else the values the
    rules asked for (a partial summary), with its shape."""
    if stats.summary is not None:
        out: dict[str, Any] = stats.summary.as_dict()
    else:
        out = {"numel": stats.numel}
        for stat, value in stats.values.items():
            if not stat.params:
                out[stat.name] = value
    out["shape"] = list(stats.shape)
    out["dtype"] = stats.dtype
    out["step"] = stats.step
    if stats.call:  # a module's later call in the step (a micro-batch's, a shared module's)
        out["call"] = stats.call
    return out


def _call_dict(call: Call) -> dict[str, Any]:
    return {"module": call.path, "type": call.module_type, "call": call.index}


def _input_dict(record: Record, call: Call) -> dict[str, Any]:
    """An input of ``call``; ``module``: the module whose output it is, else the one whose own
    code made it (the caller's), said in ``made_by``."""
    stats = record.stats
    producer = record.producer
    given = stats.kind == "input" and not stats.module  # the model's own input: the batch
    made_by = {} if producer else {"made_by": "the batch" if given else "code"}
    return {
        **made_by,
        "ref": stats.ref,
        "name": stats.name,
        "module": producer.path if producer else call.parent.path if call.parent else "",
        "shape": list(stats.shape),
        "dtype": stats.dtype,
        "line": stats.line() if stats.summary else _range_line(stats),
        "nonfinite": stats.nonfinite,
    }


def _unjudged(call: Call) -> list[dict[str, Any]]:
    """The call's inputs that no rule judges (bool masks, integer indices), described from its
    arguments while the step's forward phase keeps them: a mask that hides a whole row is often
    what made the NaN."""
    if call.invocation is None:
        return []
    _, args, kwargs, *_ = call.invocation
    leaves = tensor_leaves(args, "") + (tensor_leaves(kwargs, "") if kwargs else [])
    out = []
    for suffix, t in leaves:
        if t.is_floating_point() or t.is_complex() or t.layout != torch.strided:
            continue
        out.append({"ref": None, "name": call.tensor_name("input", suffix), "module": "",
                    "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                    "line": _describe_unjudged(t), "nonfinite": None})  # fmt: skip
    return out


def _describe_unjudged(t: torch.Tensor) -> str:
    """``bool mask: 12 of 16 True; 1 of 4 rows all False`` or ``int64 in [0, 2047]``."""
    n = t.numel()
    if not n:
        return f"{str(t.dtype).removeprefix('torch.')}, empty"
    if t.dtype == torch.bool:
        line = f"bool mask: {int(t.sum()):,} of {n:,} True"
        if t.dim() >= 2:
            rows = t.shape[:-1].numel()
            empty = int((~t).all(-1).sum())
            line += f"; {empty:,} of {rows:,} rows all False"
        return line
    lo, hi = int(t.min()), int(t.max())
    return f"{str(t.dtype).removeprefix('torch.')} in [{lo}, {hi}]"


def _range_line(stats: TensorStats) -> str:
    summary = brief(stats)
    lo, hi = summary.get("min"), summary.get("max")
    head = stats.line()
    if lo is None or hi is None:
        return head
    return f"{head} x∈[{lo:.3g}, {hi:.3g}]"


def _source(call: Call) -> dict[str, Any] | None:
    if call.site is None:
        return None
    code, line = call.site
    return _lines(code.co_filename, line, code.co_name)


def _lines(filename: str, line: int, function: str) -> dict[str, Any]:
    # The lines as they are in the file, blank ones included; none past its end.
    text = linecache.getlines(filename)
    lines = range(max(1, line - CONTEXT_LINES), min(line + CONTEXT_LINES, len(text)) + 1)
    return {
        "file": filename,
        "line": line,
        "function": function,
        "context": [[n, text[n - 1].rstrip("\n")] for n in lines],
    }


def _stack(call: Call) -> list[list[Any]]:
    """The user's lines from the training loop down to the call: one per enclosing module call
    made from a line of its own (a container's children share the container's line)."""
    chain = [call, *call.ancestors()]
    frames: list[list[Any]] = []
    for c in reversed(chain):
        if c.site is not None:
            code, line = c.site
            frame = [code.co_filename, line, code.co_name]
            if not frames or frames[-1] != frame:  # a container's child: the same user line
                frames.append(frame)
    return frames
