"""The engine's data model: a :class:`Call` of a module within a root forward, a :class:`Record`
of one watched tensor within a phase, and :func:`new_record`, the one factory that makes records.

A leaf module: it imports nothing else of the engine, so capture, judging, origin and the
sources can all speak of the same objects without importing each other.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Iterator, Mapping, Sequence, Set
from dataclasses import dataclass, field
from types import CodeType, MappingProxyType
from typing import Any

import torch

from tensordbg.statistics import TensorStats
from tensordbg.statistics.torch_kernels import dtype_name

NONFINITE = -1
"""The condition "holds NaN or Inf", followed whatever rule reported it (rule ids are >= 0)."""


@dataclass(eq=False, slots=True)
class Call:
    """One call of a module within one root forward."""

    path: str
    module_type: str
    index: int
    parent: Call | None
    depth: int
    params: tuple[str, ...] = ()
    inputs: list[tuple[str, Record]] = field(default_factory=list)
    outputs: list[tuple[str, Record]] = field(default_factory=list)
    children: list[Call] = field(default_factory=list)
    site: tuple[CodeType, int] | None = None
    # Inputs made by code between modules, screened only if the call's output turns out bad.
    # Origin bookkeeping, by condition (see tensordbg.engine.origin). Immutable sets, replaced when
    # they grow: most calls never see a condition, and this costs them no allocation.
    fired_in: frozenset[int] = frozenset()
    fired_out: frozenset[int] = frozenset()
    origin_below: frozenset[int] = frozenset()
    fired_grad_out: frozenset[int] = frozenset()
    grad_origin_below: frozenset[int] = frozenset()
    # (module, args, kwargs, what the hook saw of them, the random streams' state when the
    # module draws from them) until the forward phase ends: a forward origin's operation is
    # named by running it again (tensordbg.engine.pinpoint).
    invocation: tuple[Any, Any, Any, Any, Any] | None = None
    operation: dict[str, Any] | None = None
    unseen_grads: bool = False
    """It ran without gradients in a forward that had them, and its outputs need none: the
    gradients its parameters get come through a graph no hook saw (torch.utils.checkpoint with
    ``use_reentrant=True`` recomputes it in backward)."""

    def unseen_region(self) -> Call:
        """The outermost call around this one that :attr:`unseen_grads` (the checkpointed
        block)."""
        call = self
        while call.parent is not None and call.parent.unseen_grads:
            call = call.parent
        return call

    @property
    def base(self) -> str:
        """The call's prefix in tensor names: ``layers.0.fc`` or ``layers.0.fc#1`` for a second
        call of a shared module; ``""`` for the root's first call."""
        if self.index:
            return f"{self.path}#{self.index}"
        return self.path

    def tensor_name(self, kind: str, suffix: str = "") -> str:
        """The name of one of its tensors: ``layers.0.fc.output[1]``; ``output`` at the root."""
        base = self.base
        return f"{base}.{kind}{suffix}" if base else f"{kind}{suffix}"

    def ancestors(self) -> Iterator[Call]:
        call = self.parent
        while call is not None:
            yield call
            call = call.parent


NO_FINDINGS: Mapping[int, Any] = MappingProxyType({})
"""The findings of a record that has none (most of them): shared, read-only; the record gets a
dict of its own at its first (:meth:`Record.find`). So do its conditions, consumers and the
calls it was passed up to (a frozenset, tuples): a clean step's records allocate none."""


CHECKS = ("attach", "check")
"""The phases of a check of the parameters outside any step's update: attach's, and one asked
for between steps (``session.check_parameters()``). No update made what they find."""


@dataclass(eq=False, slots=True)
class Record:
    """One watched tensor (one version of it) within a phase: its statistics and, while the
    phase is open or paused, the tensor itself."""

    stats: TensorStats
    tensor: torch.Tensor | None
    version: int
    nbytes: int
    suffix: str = ""
    producer: Call | None = None
    passed_up: Sequence[Call] = ()
    consumers: Sequence[Call] = ()
    grad_of: Record | None = None
    param: str = ""
    hidden: bool = False
    rule_ids: tuple[int, ...] = ()
    checks: tuple[Any, ...] = ()  # its per-tensor rules: (speak of finite values, the rest)
    wanted: tuple[Any, ...] = ()  # the statistics to compute
    lazy: bool = False  # kept to be screened only if the phase turns out bad (deferred mode)
    judged: bool = False
    sentinel: bool = False  # the model's output gradient: always screened at once
    slot: int = -1
    findings: Mapping[int, Any] = field(default_factory=lambda: NO_FINDINGS)
    conditions: Set[int] = frozenset()
    grad_hooked: bool = False
    weak: weakref.ref[torch.Tensor] | None = None
    voucher: str = ""  # a gradient not kept, judged from this parameter's (engine/vouching.py)
    before_update: bool = False  # a parameter's NaN/Inf found after its update, which did not
    # make it (engine/pipeline.py: _bad_before_update); a buffer's the model came with
    apart: bool = False  # an observed value of no call of the watched model (loss_code.py)

    def find(self, rule_id: int, finding: Any) -> None:
        """Add a rule's finding."""
        if self.findings is NO_FINDINGS:
            self.findings = {}
        self.findings[rule_id] = finding  # type: ignore[index]

    def keep_if_found(self, tensor: torch.Tensor | None) -> None:
        """A hit's own tensor is always kept for inspection: ``tensor`` if a rule found
        something in it and none is held."""
        if self.findings and self.tensor is None and tensor is not None:
            self.tensor = tensor

    def fire(self, condition: int) -> None:
        """Add a condition it carries (:mod:`.origin`: NaN/Inf, or a rule that propagates)."""
        if type(self.conditions) is frozenset:
            self.conditions = set(self.conditions)
        self.conditions.add(condition)  # type: ignore[attr-defined]

    def consumed_by(self, call: Call) -> None:
        """A call took it as an input."""
        if type(self.consumers) is tuple:
            self.consumers = []
        self.consumers.append(call)  # type: ignore[attr-defined]

    def passed_up_to(self, call: Call) -> None:
        """A call returned it, made by one of its children."""
        if type(self.passed_up) is tuple:
            self.passed_up = []
        self.passed_up.append(call)  # type: ignore[attr-defined]

    def forgive_mask(self, tensor: torch.Tensor | None) -> None:
        """An input not finite that is an additive attention mask (zeros and -inf, by design:
        the model's, or one its code built and handed to a module) went nowhere wrong: the
        rules that speak only of NaN and Inf say nothing of it, and it carries no condition,
        so the module whose softmax turns a row of it all -inf into NaN is that NaN's origin.
        It was said to come in with the mask, or with the code that built it (found trying the
        product as a new user). A module's output of zeros and -inf is a log of zeros, not a
        mask: it stays an origin. Read only in that case."""
        if tensor is None or NONFINITE not in self.conditions or self.stats.kind != "input":
            return
        t = tensor.detach()
        if not bool(((t == 0) | (t == -math.inf)).all()):
            return
        silent = {active.id for active in self.checks[1]} if len(self.checks) > 1 else set()
        self.findings = {r: f for r, f in self.findings.items() if r not in silent} or NO_FINDINGS
        self.conditions = frozenset(
            c for c in self.conditions if c != NONFINITE and c not in silent
        )

    def held(self) -> torch.Tensor | None:
        """The tensor, if it can still be shown: kept by the session, or (eager mode, which keeps
        only hits) still alive in the training, e.g. saved by autograd for the backward pass."""
        if self.tensor is not None:
            return self.tensor
        return self.weak() if self.weak is not None else None


def new_record(
    tensor: torch.Tensor,
    name: str,
    kind: str,
    phase: str,
    step: int,
    *,
    module: str = "",
    module_type: str = "",
    call: int = 0,
    trainable: bool = False,
    **fields: Any,
) -> Record:
    """A record of ``tensor`` as it is now (its shape, dtype, version and size); ``fields`` are
    :class:`Record` fields (``suffix``, ``param``, ``grad_of``, ``hidden``, ...).

    >>> new_record(loss, "loss", "observed", "forward", step=3)
    """
    stats = TensorStats(
        name=name,
        module=module,
        kind=kind,
        phase=phase,
        step=step,
        shape=tuple(tensor.shape),
        dtype=dtype_name(tensor.dtype),
        module_type=module_type,
        call=call,
        trainable=trainable,
    )
    return Record(stats, None, version_of(tensor), tensor.numel() * tensor.element_size(), **fields)


def grad_record(forward: Record, grad: torch.Tensor | None, step: int,
                like: tuple[torch.Size, torch.dtype] | None = None) -> Record:  # fmt: skip
    """The record of the gradient of a forward tensor: the gradient of its producer's output
    (``grad_output``), or of the input of the call that took it (``grad_input``). ``like``: the
    shape and dtype of a gradient that was not kept (``grad`` is None)."""
    call = forward.producer
    kind = "grad_output" if call is not None else "grad_input"
    if call is None and forward.consumers:
        call = forward.consumers[0]
    if grad is None:
        assert like is not None
        grad = torch.empty(like[0], dtype=like[1], device="meta")
    return new_record(
        grad,
        call.tensor_name(kind, forward.suffix) if call else f"{kind}{forward.suffix}",
        kind,
        "backward",
        step,
        module=call.path if call else "",
        module_type=call.module_type if call else "",
        call=call.index if call else 0,
        suffix=forward.suffix,
        grad_of=forward,
        sentinel=is_model_output(forward),
    )


def param_grad_record(
    name: str, owner: str, owner_type: str, grad: torch.Tensor, step: int
) -> Record:
    """The record of a parameter's gradient."""
    return new_record(grad, f"{name}.grad", "grad", "backward", step, module=owner,
                      module_type=owner_type, trainable=True, param=name)  # fmt: skip


def is_model_output(record: Record) -> bool:
    """Whether a forward record is (one of) the model's outputs."""
    producer = record.producer
    return (producer is not None and producer.parent is None) or any(
        c.parent is None for c in record.passed_up
    )


# How deep tensor_leaves looks into a nested value, and how many tensors it lists at most.
MAX_NESTING = 6
MAX_LEAVES = 256


def submodule(model: torch.nn.Module, path: str) -> torch.nn.Module:
    """The module at ``path`` ("" for ``model``), found through the children themselves:
    ``get_submodule`` takes a child named like a method of ``nn.Module`` (``half``, ``float``,
    ``to``) for that method, and fails. AttributeError when ``path`` names no module."""
    module = model
    for name in path.split(".") if path else ():
        child = module._modules.get(name)
        if child is None:
            raise AttributeError(f"{type(module).__name__} has no submodule {name!r}")
        module = child
    return module


def version_of(t: torch.Tensor) -> int:
    """``t``'s version counter. A tensor made under ``torch.inference_mode()`` has none (it
    cannot be changed in place outside that mode): 0, always."""
    try:
        return t._version
    except RuntimeError:  # "Inference tensors do not track version counter"
        return 0


def memory_of(t: torch.Tensor, reshaped: bool = False) -> tuple[Any, ...]:
    """Where a tensor's values are and how they are laid out: equal for a tensor's aliases;
    ``reshaped`` (a contiguous tensor): whatever its shape, equal for its reshapes too."""
    if reshaped:
        return ("reshaped", t.data_ptr(), t.device, t.dtype, t.numel())
    return (t.data_ptr(), t.device, t.dtype, t.shape, t.stride())


def tensor_leaves(obj: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """Every tensor in a nested output, with its path: ``(output, (h, c))`` gives
    ``[("[0]", output), ("[1][0]", h), ("[1][1]", c)]``; dicts and dataclasses (e.g. Hugging Face
    ``ModelOutput``) by key: ``".logits"``."""
    if isinstance(obj, torch.Tensor):
        return [(prefix, obj)]
    if type(obj) is tuple and len(obj) == 1 and isinstance(obj[0], torch.Tensor):
        return [(f"{prefix}[0]", obj[0])]  # a module's positional arguments, most of the time
    out: list[tuple[str, torch.Tensor]] = []
    _collect(obj, prefix, 0, out)
    return out


def _collect(obj: Any, prefix: str, depth: int, out: list[tuple[str, torch.Tensor]]) -> None:
    if len(out) >= MAX_LEAVES:
        return
    if isinstance(obj, torch.Tensor):
        out.append((prefix, obj))
        return
    if depth >= MAX_NESTING or isinstance(obj, (str, bytes, int, float, bool)) or obj is None:
        return
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            _collect(value, f"{prefix}{_key(key)}", depth + 1, out)
    elif isinstance(obj, (tuple, list)):
        fields = getattr(obj, "_fields", None)  # namedtuple: name the fields
        for i, value in enumerate(obj):
            part = f".{fields[i]}" if fields else f"[{i}]"
            _collect(value, f"{prefix}{part}", depth + 1, out)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _collect(getattr(obj, f.name, None), f"{prefix}.{f.name}", depth + 1, out)


def _key(key: Any) -> str:
    return f".{key}" if isinstance(key, str) and key.isidentifier() else f"[{key!r}]"
