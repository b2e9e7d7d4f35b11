"""The debugging session: ``tensordbg.attach()``, statistics, judging, hits and pausing.

The hooks in :mod:`tensordbg.engine.capture` hand the session one :class:`~Record` per
watched tensor. The session asks the active rules which statistics they need, computes only those
next to the tensor (:mod:`tensordbg.statistics.torch_kernels`), judges them with the rules, names the origin
(:mod:`tensordbg.engine.origin`), records hits and pauses the training (:mod:`tensordbg.engine.control`).

Three ways to check (``sync``):

- ``"eager"``: statistics are read at once, in the hook that saw the tensor, so a hit stops the
  training at that very tensor. On the CPU reading costs nothing extra; on CUDA it synchronizes
  per tensor.
- ``"batched"``: statistics stay on the device until the end of the phase (forward, backward,
  optimizer step) and come to the host in one transfer: one synchronization per phase. Hits are
  the same; the pause comes at the end of the phase.
- ``"deferred"``: the model's outputs, the observed loss, every gradient and every parameter are
  screened each step; the other tensors of a phase are kept (within ``retain_bytes``) and
  screened only when those show a problem, in execution order, so the same origin is named.
  The cheapest: for whole runs. A NaN masked before it reaches an output, the loss or a
  gradient goes unseen.

``"auto"`` (the default) is eager on the CPU and batched on CUDA.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import math
import os
import secrets
import sys
import threading
import time
import traceback
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tensordbg.engine import origin
from tensordbg.engine.capture import (
    Call,
    Capture,
    Record,
    grad_record,
    is_model_output,
    param_grad_record,
    param_hook,
)
from tensordbg.engine.control import DETACHED, PAUSED, STEP, PauseController
from tensordbg.engine.origin import NONFINITE
from tensordbg.hit import Hit, WatchpointHit
from tensordbg.rules import Rule, default_rules
from tensordbg.rules.base import Finding, Refine
from tensordbg.statistics import L2, MAX, MEAN, MIN, NAN, NEGINF, POSINF, Stat, TensorStats
from tensordbg.statistics.torch_kernels import (
    SCALE_LINEAR,
    SCREEN,
    StatsBatch,
    device_stats,
    dtype_name,
    host_stats,
    scale_vector,
    summarize,
    update_stats,
    watchable,
)

ON_HIT = ("pause", "raise", "record")
SYNC = ("auto", "eager", "batched", "deferred")
# Kinds a deferred session may keep unscreened until the phase shows a problem.
LAZY_KINDS = frozenset({"output", "input", "grad_output", "grad_input"})
COUNTS = (NAN, POSINF, NEGINF)
REFINEMENTS = 3  # how many times in a row a rule may ask for more statistics of one tensor
# A parameter's range before and after a step tells cheaply that the step changed it.
RANGE = (MIN, MAX)
# Update statistics that need a copy of the parameter from before the step.
SNAPSHOT_STATS = frozenset({"update_abs_mean", "prev_abs_mean"})
GRAD_KINDS = frozenset({"grad", "grad_output", "grad_input"})
HISTORY = 512
# A training that stays NaN makes a hit per tensor per step; past this, only origin hits are kept.
MAX_HITS = 100_000
DEFAULT_RETAIN = 256 * 2**20
DEFAULT_UPDATE_BUDGET = 512 * 2**20
# Eager mode holds the last few tensors it saw (within retain_bytes), so that a hit's neighbours
# can be shown, e.g. the gradient that came into the module whose backward broke.
EAGER_WINDOW = 8

_attached: weakref.WeakKeyDictionary[torch.nn.Module, Session] = weakref.WeakKeyDictionary()


@dataclass(eq=False)
class ActiveRule:
    """A rule as one session runs it: its own copy, its memory across steps, whether it is on."""

    id: int
    rule: Rule
    enabled: bool = True
    state: dict[str, Any] = field(default_factory=dict)
    disabled_reason: str | None = None
    hits: int = 0
    phase_wide: bool = False
    """Whether the rule compares the tensors of a phase with each other (judged at phase end)."""

    def __post_init__(self) -> None:
        self.phase_wide = type(self.rule).check_phase is not Rule.check_phase


@dataclass(eq=False)
class _Param:
    name: str
    param: torch.nn.Parameter
    owner: str
    owner_type: str


class Session:
    """A training under watch. Made by :func:`attach`; see there for the arguments.

    >>> with tensordbg.attach(model, optimizer=opt, on_hit="record") as session:
    ...     train(model, opt)
    >>> [h.module for h in session.hits if h.origin]
    ['layers.2.attn']
    """

    passthrough = (WatchpointHit,)

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        rules: Iterable[Rule] | None = None,
        on_hit: str | Callable[[Hit], None] = "pause",
        scaler: Any = None,
        *,
        include: str | Sequence[str] = (),
        exclude: str | Sequence[str] = (),
        sync: str = "auto",
        interval: int = 1,
        retain_bytes: int = DEFAULT_RETAIN,
        update_budget: int = DEFAULT_UPDATE_BUDGET,
        max_skipped_steps: int = 5,
        run_id: str | None = None,
        rank: int | None = None,
    ):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"attach() takes a torch.nn.Module, not {type(model).__name__}")
        if hasattr(model, "_orig_mod") and type(model).__name__ == "OptimizedModule":
            raise TypeError(
                "this model is already compiled: attach tensordbg before torch.compile, "
                "e.g. session = tensordbg.attach(model); model = torch.compile(model)"
            )
        if model in _attached and not _attached[model].detached:
            raise RuntimeError(
                "tensordbg is already attached to this model: call session.detach() first"
            )
        if not callable(on_hit) and on_hit not in ON_HIT:
            raise ValueError(f"on_hit is one of {', '.join(ON_HIT)} or a callable, not {on_hit!r}")
        if sync not in SYNC:
            raise ValueError(f"sync is one of {', '.join(SYNC)}, not {sync!r}")
        if interval < 1:
            raise ValueError("interval is a number of steps, at least 1")
        self._model = weakref.ref(model)  # a session never keeps a model alive
        self.on_hit = on_hit
        self.scaler = scaler if scaler is not None and _scaler_enabled(scaler) else None
        self.interval = int(interval)
        self.retain_bytes = int(retain_bytes)
        self.update_budget = int(update_budget)
        self.max_skipped_steps = int(max_skipped_steps)
        self.run_id = run_id or os.environ.get("TENSORDBG_RUN_ID") or secrets.token_hex(4)
        self.rank = int(rank if rank is not None else os.environ.get("RANK", 0))
        self.device = _model_device(model)
        if sync == "auto":
            sync = "batched" if self.device.type == "cuda" else "eager"
        self.mode = sync
        self._triggered = False
        self.controller = PauseController()
        self.controller.listeners.append(self._on_state)
        self.hits: list[Hit] = []
        self.skipped_steps: list[int] = []
        self.step = 0
        self.phase = "forward"
        self.broken = False
        self.detached = False
        self.rules: list[ActiveRule] = []
        self._rules_by_id: dict[int, ActiveRule] = {}
        self._next_rule_id = 0
        for rule in default_rules() if rules is None else rules:
            self.add_rule(rule)
        self._subscribers: list[Callable[[str, dict[str, Any]], None]] = []
        self._lock = threading.RLock()
        self._applicable: dict[Any, Any] = {}
        self._quiet_params: dict[str, bool] = {}
        self._quiet_grads: dict[str, bool] = {}
        self._batch = StatsBatch()
        self._pending: list[tuple[str, Any]] = []
        self._records: list[Record] = []
        self._by_ref: dict[int, Record] = {}
        self._next_ref = 0
        self._retained = 0
        self._window: deque[Record] = deque()
        self._pausing: list[Hit] = []
        self._fired_last_step: set[tuple[str, str]] = set()
        self._fired_this_step: set[tuple[str, str]] = set()
        self._forward_open = False
        self._backward_tasks: set[int] = set()
        self._root_forwards = 0
        self._loss_fired: set[int] = set()
        self._step_loss: list[float] = []
        self._step_grad_sq = 0.0
        self._step_grad_seen = False
        self._last_step_time = time.perf_counter()
        self.history: deque[tuple[int, float | None, float | None, float | None]] = deque(
            maxlen=HISTORY
        )
        self.latest: dict[str, tuple[int, TensorStats]] = {}
        self.previous: dict[str, tuple[int, TensorStats]] = {}
        # Parameters, their last seen range (to tell cheaply that an update changed them) and
        # those whose change could not be told that way (checked exactly next step).
        self.params: dict[int, _Param] = {}
        for name, param in model.named_parameters():
            owner = name.rpartition(".")[0]
            owner_type = type(model.get_submodule(owner)).__name__
            self.params[id(param)] = _Param(name, param, owner, owner_type)
        self._params_by_name = {p.name: p for p in self.params.values()}
        self._digests: dict[str, tuple[float, float]] = {}
        self._suspects: set[str] = set()
        self._snapshots: dict[str, torch.Tensor] = {}
        self._versions: dict[str, int] = {}
        self._snapshot_offset = 0
        self._deferred: list[tuple[Hit, ActiveRule]] = []
        self._stepping: dict[torch.optim.Optimizer, list[_Param]] = {}  # between pre and post hook
        self._inv: dict[Any, Any] = {}  # 1/loss scale, read once per phase (see _inv_scale)
        self._param_fired: dict[str, set[int]] = {}
        self._grad_fired: dict[str, set[int]] = {}
        self._root_fired: set[int] = set()
        self._first_origin: dict[int, str] = {}
        self.max_hits = MAX_HITS
        self._hits_capped = False
        self._skipped_in_row = 0
        self._optimizer_stepped = False
        self.optimizers: list[torch.optim.Optimizer] = []
        self._handles: list[Any] = []
        self.server: Any = None
        self._ui_clients = 0
        self._ui_timer: threading.Timer | None = None
        self.ui_timeout: float | None = None

        self.capture = Capture(self, model, _patterns(include), _patterns(exclude))
        self.capture.install(model)
        for p in self.params.values():
            if p.param.requires_grad:
                hook = param_hook(self, p.name, p.owner, p.owner_type)
                self._handles.append(p.param.register_post_accumulate_grad_hook(hook))
        if optimizer is not None:
            opts = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else optimizer
            for opt in opts:
                self.attach_optimizer(opt)
        if self.scaler is not None:
            self._wrap_scaler()
        _attached[model] = self
        atexit.register(_detach_at_exit, weakref.ref(self))

    # --- public ------------------------------------------------------------------------------

    @torch.compiler.disable
    def observe(self, name: str, tensor: torch.Tensor) -> None:
        """Watch any extra tensor (kind ``"observed"``), e.g. the loss: ``session.observe("loss",
        loss)``. A scalar named like ``loss`` also feeds the loss curve in the UI."""
        if self.broken or self.detached or not watchable(tensor):
            return
        try:
            stats = TensorStats(
                name=name,
                module="",
                kind="observed",
                phase=self.phase,
                step=self.step,
                shape=tuple(tensor.shape),
                dtype=dtype_name(tensor.dtype),
            )
            record = Record(stats, None, tensor._version, tensor.numel() * tensor.element_size())
            self.collect(record, tensor, extra=(MEAN,))
            self._after_hook()
        except Exception as e:
            if isinstance(e, self.passthrough):
                raise
            self.internal_error(e)

    def summary(self, origins: int = 5) -> str:
        """The hits in a few lines: those at their origin first, then how far the damage spread.

        >>> print(session.summary())
        tensordbg: 4756 hits, 1 at their origin.
          step 25 forward: [NaN] blocks.0.attn.output
            blocks.0.attn.output holds 1984 NaN among 31744 values; ...
        """
        if not self.hits:
            return "tensordbg: no hits."
        first = [h for h in self.hits if h.origin]
        lines = [f"tensordbg: {len(self.hits)} hits, {len(first)} at their origin."]
        for hit in first[:origins]:
            lines.append(f"  step {hit.step} {hit.phase}: [{hit.rule}] {hit.tensor}")
            lines.append(f"    {hit.message}")
        if self.skipped_steps:
            lines.append(f"  steps the GradScaler skipped: {self.skipped_steps[:20]}")
        return "\n".join(lines)

    def flush(self) -> None:
        """Judge what is pending now. Batched checks judge at the end of a phase, and a forward
        that will be followed by backward ends when backward starts; call this when you need
        ``session.hits`` complete before that (after an evaluation forward, say)."""
        if self.broken or self.detached:
            return
        try:
            self._end_phase()
        except Exception as e:
            if isinstance(e, self.passthrough):
                raise
            self.internal_error(e)

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Watch an optimizer's steps (``attach(optimizer=...)`` calls this). Steps are counted
        on the first optimizer attached."""
        if optimizer in self.optimizers:
            return
        self.optimizers.append(optimizer)
        self._handles.append(optimizer.register_step_pre_hook(self._before_step))
        self._handles.append(optimizer.register_step_post_hook(self._after_step))

    def add_rule(self, rule: Rule) -> ActiveRule:
        """Add a rule to this session (it gets its own copy and memory)."""
        if not isinstance(rule, Rule):
            raise TypeError(f"rules are tensordbg.rules.Rule instances, not {type(rule).__name__}")
        active = ActiveRule(self._next_rule_id, copy.deepcopy(rule))
        self._next_rule_id += 1
        self.rules.append(active)
        self._rules_by_id[active.id] = active
        self.rules_changed()
        return active

    def recheck(self) -> list[Hit]:
        """Judge the current phase again with the rules as they are now (edited thresholds,
        added rules), without re-running the step; like MindInsight's recheck. Rules judge with
        a copy of their memory, so a recheck does not count as another step. Returns the hits
        that were not found before (they join ``session.hits``).

        The origin of a condition is taken from the first judgement of the phase; a rule added
        since is an origin wherever it fires (its propagation is not traced again)."""
        self.rules_changed()
        already = {(h.ref, h.rule) for h in self.hits}
        origins = {h.ref for h in self.hits if h.origin}
        found: list[Hit] = []
        for record in self.records:
            stats = record.stats
            rule_ids, wanted = self._rules_for(stats)
            missing = tuple(s for s in wanted if s not in stats.values)
            tensor = record.held()
            if missing and tensor is not None and stats.kind != "update":
                stats.values.update(zip(missing, self._host_values(stats, tensor, missing),
                                        strict=True))  # fmt: skip
            for rule_id in rule_ids:
                active = self._rule(rule_id)
                if active is None or not active.enabled or active.phase_wide:
                    continue
                if (stats.ref, active.rule.name) in already:
                    continue
                try:
                    finding = active.rule.check(stats, copy.deepcopy(active.state))
                except Exception as e:
                    self._disable(active, e)
                    continue
                if finding is None:
                    continue
                is_origin = not stats.nonfinite or stats.ref in origins
                before = len(self.hits)
                self._hit(record, rule_id, finding, is_origin)
                found.extend(self.hits[before:])
        self._pausing = []  # already paused: what a recheck finds is shown, not paused on
        return found

    def rules_changed(self) -> None:
        """Forget which rules apply to which tensor (after a rule was added, edited, toggled)."""
        self._applicable = {}
        self._quiet_params = {}
        self._quiet_grads = {}

    def detach(self) -> None:
        """Remove every hook tensordbg installed, free every tensor it held, stop its server and
        let a paused training go on. Safe to call twice."""
        if self.detached:
            return
        self.detached = True
        self.capture.remove()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self.scaler is not None and "update" in vars(self.scaler):
            del self.scaler.update
        self._release()
        self._records = []
        self._by_ref = {}
        self._snapshots = {}
        self._stepping = {}
        self._pending = []
        self._batch = StatsBatch()
        # Let go of the parameters, optimizers and scaler: hits and statistics stay readable.
        self.params = {}
        self._params_by_name = {}
        self.optimizers = []
        self.scaler = None
        self._inv = {}
        self.capture.reset()
        self.controller.detach()
        if self._ui_timer is not None:
            self._ui_timer.cancel()
        if self.server is not None:
            server, self.server = self.server, None
            self.emit("state", {"state": "finished", "step": self.step})
            with contextlib.suppress(Exception):
                server.stop()
        model = self.model
        if model is not None and _attached.get(model) is self:
            del _attached[model]

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def subscribe(self, callback: Callable[[str, dict[str, Any]], None]) -> Callable[[], None]:
        """Call ``callback(event, payload)`` on every event (``status``, ``hit``, ``state``,
        ``log``); it runs on the training thread and must not block."""
        self._subscribers.append(callback)

        def unsubscribe() -> None:
            if callback in self._subscribers:
                self._subscribers.remove(callback)

        return unsubscribe

    def emit(self, event: str, payload: dict[str, Any]) -> None:
        for callback in list(self._subscribers):
            # A subscriber's fault must not stop the training.
            with contextlib.suppress(Exception):
                callback(event, payload)

    def log(self, message: str, level: str = "info") -> None:
        self.emit("log", {"level": level, "message": message, "step": self.step})

    @property
    def model(self) -> torch.nn.Module | None:
        """The watched model; None once it is gone (the session holds it weakly)."""
        return self._model()

    @property
    def active(self) -> bool:
        """Whether the hooks still do anything: not after detach (a hook installed on this
        step's autograd graph can still fire), nor after an internal error."""
        return not (self.broken or self.detached)

    @property
    def records(self) -> list[Record]:
        """The watched tensors of the current (or last) phase, in execution order."""
        return [r for r in self._records if not r.hidden]

    def record(self, ref: int) -> Record | None:
        return self._by_ref.get(ref)

    # --- hooks call these (capture.py) ---------------------------------------------------------

    def begin_forward(self) -> None:
        """A root forward starts: close what is open, count the step, honour pause requests."""
        if self._detach_requested():
            return
        if self._forward_open or self._pending or len(self._batch):
            self._end_phase()
        if not self.optimizers and self._root_forwards:
            self._finish_step()
            self._maybe_pause_on_request(completed_step=True)
        self._root_forwards += 1
        self._start_phase("forward")
        self._forward_open = True
        self._loss_fired = set()
        self._root_fired = set()
        self._maybe_pause_on_request()

    def collect(self, record: Record, tensor: torch.Tensor, extra: tuple[Stat, ...] = ()) -> None:
        """A tensor was seen: compute what the rules need of it (eager: at once; batched: on the
        device until the end of the phase; deferred: at once for the model's outputs, loss,
        gradients and parameters, and for the rest only if those show a problem)."""
        stats = record.stats
        rule_ids, wanted, record.checks, silent = self._applicability(stats)
        if record.hidden:
            extra = SCREEN  # the origin of a non-finite value is traced through every input
        if extra:
            wanted = tuple(dict.fromkeys(wanted + extra))
        record.rule_ids = rule_ids
        record.wanted = wanted
        self._register(record)
        kept = self._retain(record, tensor)
        if not wanted:
            return
        mode = self.mode
        if mode == "batched":
            vector = device_stats(tensor, wanted)
            factors = self._scale_vector(wanted) if self._scaled(stats) else None
            if factors is not None:
                vector = vector * factors
            stats.values = dict.fromkeys(wanted, math.nan)
            record.slot = self._batch.add(vector)
            self._pending.append(("record", record))
        elif (
            mode == "deferred"
            and kept
            and silent
            and stats.kind in LAZY_KINDS
            and not (record.sentinel or self._triggered)
        ):
            record.lazy = True  # its rules only speak of NaN and Inf: wait for a reason to look
            self._pending.append(("record", record))
        else:
            self._screen(record, tensor)
            self._judge(record, tensor)
            if mode == "eager":
                self._report(record)
            else:  # deferred: its hits are made in execution order, once the phase is settled
                self._pending.append(("record", record))
                if record.findings or record.conditions:
                    self._triggered = True

    def _screen(self, record: Record, tensor: torch.Tensor) -> None:
        """Compute a record's statistics now, on the host."""
        values = self._host_values(record.stats, tensor, record.wanted)
        record.stats.values = dict(zip(record.wanted, values, strict=True))
        record.lazy = False

    def _host_values(
        self, stats: TensorStats, tensor: torch.Tensor, wanted: Sequence[Stat]
    ) -> list[float]:
        """``wanted`` of ``tensor`` read at once; a scaled gradient's unscaled."""
        values = host_stats(tensor, wanted)
        inv = self._inv_scale_host() if self._scaled(stats) else None
        if inv is None:
            return values
        return [
            v * inv if s.name in SCALE_LINEAR else v for s, v in zip(wanted, values, strict=True)
        ]

    def _scaled(self, stats: TensorStats) -> bool:
        return self.scaler is not None and stats.kind in GRAD_KINDS

    def collect_input(self, call: Call, record: Record, tensor: torch.Tensor) -> None:
        """An input made by code between modules. Eager mode screens it only if the call's output
        turns out bad (that is when it matters: to tell who made the value); the other modes
        treat it as any other tensor of the phase."""
        if self.mode != "eager":
            self.collect(record, tensor)
            return
        self._register(record)
        self._retain(record, tensor)
        call.unscreened.append((record, tensor))

    def _process(self, kind: str, item: Any, now: Callable[[Any], None]) -> None:
        """What a hook saw, in execution order: at once in eager mode when nothing waits (the
        queue is skipped: hooks run hot), else queued for the end of the phase."""
        if self.mode == "eager" and not self._pending:
            now(item)
            if self._pausing:
                self._pause_if_needed()
            if self.controller.pause_requested:
                self._maybe_pause_on_request()
            return
        self._pending.append((kind, item))
        self._after_hook()

    def enter(self, call: Call) -> None:
        self._process("enter", call, origin.enter)

    def exit(self, call: Call) -> None:
        if call.unscreened:
            if any(r.conditions for _, r in call.outputs):
                for record, tensor in call.unscreened:
                    self.collect(record, tensor)
                origin.enter(call)  # what the inputs showed, now that they are screened
            call.unscreened = []
        self._process("exit", call, self._exit)

    def end_forward(self, root: Call) -> None:
        """The root forward returned. Deferred mode screens the model's outputs now. With a
        backward to come, the forward phase stays open so the loss observed after it joins it;
        otherwise it ends here."""
        for _, record in root.outputs:
            if record.lazy and record.tensor is not None:
                self._screen(record, record.tensor)
                if record.stats.nonfinite:
                    self._triggered = True
        self._after_hook()
        backward_expected = torch.is_grad_enabled() and any(r.grad_hooked for _, r in root.outputs)
        if not backward_expected:
            self._end_phase()

    def _after_hook(self) -> None:
        """What a hook does last: judge now (eager, or deferred once the phase showed a problem)
        and pause if a hit or a request asks for it."""
        if self.mode == "eager" or (self.mode == "deferred" and self._triggered):
            self._settle()
        self._maybe_pause_on_request()

    def _screen_sentinels(self, notes: tuple[str, ...] = ("param_grad",)) -> None:
        """Deferred mode: turn the gradients the hooks only noted into records, in their place
        in execution order, in one warm loop. Parameter gradients always (at the end of a
        pass: what they show decides about the rest); activation gradients too once the pass
        showed a problem."""
        if not any(kind in notes for kind, _ in self._pending):
            return
        pending, self._pending = self._pending, []
        for kind, item in pending:
            if kind not in notes:
                self._pending.append((kind, item))
                continue
            if kind == "param_grad":
                name, owner, owner_type, grad = item
                record = param_grad_record(name, owner, owner_type, grad, self.step)
            else:
                forward, grad = item
                record = grad_record(forward, grad, self.step)
            self.collect(record, grad)
            self._pending.append(("grad", record))

    def _settle(self) -> None:
        """Screen what a deferred phase kept, judge everything pending in execution order, and
        pause if a hit asks for it."""
        self._screen_sentinels(("param_grad", "act_grad"))
        for kind, item in self._pending:
            if kind == "record" and item.lazy and item.tensor is not None:
                self._screen(item, item.tensor)
        self._drain()
        self._pause_if_needed()

    def begin_backward(self) -> None:
        """Called by every backward hook: the first one of a pass ends the forward phase and
        asks the autograd engine to call back at the end of the pass."""
        if self.phase != "backward":
            if self._forward_open or self._pending or len(self._batch):
                self._end_phase()
            self._start_phase("backward")
        task = torch._C._current_graph_task_id()
        if task not in self._backward_tasks:
            self._backward_tasks.add(task)
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: self._end_backward(task)
            )

    def grad(self, record: Record) -> None:
        self._process("grad", record, self._grad)

    def activation_grad(self, forward: Record, grad: torch.Tensor) -> None:
        """The gradient of a watched forward tensor. A clean deferred backward only notes it
        (it becomes a record only if the pass turns out bad); otherwise it is collected."""
        self.begin_backward()
        if (
            self.mode == "deferred"
            and not self._triggered
            and not is_model_output(forward)
            and self._grads_quiet(grad)
            and self._retain_bytes(grad.numel() * grad.element_size())
        ):
            self._pending.append(("act_grad", (forward, grad)))
            return
        record = grad_record(forward, grad, self.step)
        self.collect(record, grad)
        self.grad(record)

    def _grads_quiet(self, grad: torch.Tensor) -> bool:
        """Whether every rule that could look at an activation gradient of this dtype is silent
        while it is finite (then a clean deferred pass need not read it)."""
        dtype = dtype_name(grad.dtype)
        quiet = self._quiet_grads.get(dtype)
        if quiet is None:
            quiet = True
            for kind in ("grad_output", "grad_input"):
                probe = TensorStats("probe", "probe", kind, "backward", 0, (1,), dtype)
                for active in self.rules:
                    if active.enabled and kind in active.rule.kinds:
                        quiet = quiet and _silent_when_finite(active, probe)
            self._quiet_grads[dtype] = quiet
        return quiet

    def param_grad(self, name: str, owner: str, owner_type: str, grad: torch.Tensor) -> None:
        """A parameter's gradient is final for this backward pass. Deferred mode only notes it
        here (a hook runs cold) and judges all of them together when the pass ends."""
        self.begin_backward()
        if self.mode == "deferred" and not self._triggered:
            self._pending.append(("param_grad", (name, owner, owner_type, grad)))
            return
        record = param_grad_record(name, owner, owner_type, grad, self.step)
        self.collect(record, grad)
        self.grad(record)

    def internal_error(self, error: BaseException) -> None:
        """tensordbg's own fault: say so once, stop watching, never stop the training."""
        if self.broken:
            return
        self.broken = True
        detail = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        warnings.warn(
            "tensordbg hit an internal error and stopped watching this training (the training "
            f"goes on). Please report it with this traceback:\n{detail}",
            RuntimeWarning,
            stacklevel=3,
        )
        self.log(f"internal error, watching stopped: {error}", "error")

    # --- phases --------------------------------------------------------------------------------

    def _start_phase(self, phase: str) -> None:
        self._release()
        self._inv = {}
        self._records = []
        self._by_ref = {}
        self._triggered = False
        self.phase = phase

    def _register(self, record: Record) -> None:
        stats = record.stats
        if stats.ref >= 0:
            return
        stats.ref = self._next_ref
        self._next_ref += 1
        if stats.kind not in ("param", "update"):
            stats.phase = self.phase
        self._records.append(record)
        self._by_ref[stats.ref] = record

    def _end_phase(self) -> None:
        """Bring the phase's statistics over (batched), judge, run phase-wide rules, pause if a
        hit asks for it, and let go of the phase's tensors."""
        self._forward_open = False
        self._fetch()
        self._screen_sentinels()
        if self._triggered:
            self._settle()
        elif self.mode == "deferred":
            # A clean deferred phase: nothing it kept is read, and no call can be an origin of
            # anything; what the screened records say (the loss for the curve) is all there is.
            pending, self._pending = self._pending, []
            for kind, item in pending:
                if kind == "record" and not item.lazy:
                    self._report(item)
        self._drain()
        self._judge_phase_wide()
        self._pause_if_needed()
        self._maybe_pause_on_request()
        self._release()

    def _end_backward(self, task: int) -> None:
        self._backward_tasks.discard(task)
        if self.broken or self.detached or self._backward_tasks:
            return
        try:
            self._end_phase()
        except Exception as e:
            if isinstance(e, self.passthrough):
                raise
            self.internal_error(e)

    def _fetch(self) -> None:
        """The one transfer of the phase: statistics from the device to the host."""
        if not len(self._batch):
            return
        values = self._batch.flush()
        for kind, item in self._pending:
            if kind == "record" and item.slot >= 0:
                item.stats.values = dict(zip(item.stats.values, values[item.slot], strict=True))
                item.slot = -1

    def _drain(self) -> None:
        """Process what the hooks saw, in execution order: judge each record, then name origins
        at each call's start and end and at each gradient."""
        pending, self._pending = self._pending, []
        for kind, item in pending:
            if kind == "record":
                if item.lazy:
                    continue
                if not item.judged:
                    self._judge(item, item.tensor)
                self._report(item)
            elif kind == "enter":
                origin.enter(item)
            elif kind == "exit":
                self._exit(item)
            elif kind == "grad":
                self._grad(item)

    # --- judging -------------------------------------------------------------------------------

    def _rules_for(self, stats: TensorStats) -> tuple[tuple[int, ...], tuple[Stat, ...]]:
        """The rules that apply to a tensor and the statistics they need (cached per tensor
        identity); between interval steps, only the NaN/Inf screen."""
        return self._applicability(stats)[:2]

    def _applicability(
        self, stats: TensorStats
    ) -> tuple[tuple[int, ...], tuple[Stat, ...], tuple[ActiveRule, ...], bool]:
        """Rule ids, statistics, the per-tensor rules to run, and whether all of them are silent
        on a finite tensor (so a deferred session may leave it unscreened), for one tensor
        identity."""
        key = (stats.kind, stats.name, stats.module_type, stats.dtype, len(stats.shape),
               stats.trainable)  # fmt: skip
        cached = self._applicable.get(key)
        if cached is None:
            ids: list[int] = []
            wanted: dict[Stat, None] = {}
            for active in self.rules:
                if not active.enabled:
                    continue
                try:
                    if not active.rule.applies(stats):
                        continue
                    needs = active.rule.stats_for(stats)
                except Exception as e:
                    self._disable(active, e)
                    continue
                ids.append(active.id)
                wanted.update(dict.fromkeys(needs))
            if ids:
                wanted = dict.fromkeys(SCREEN) | wanted
            chosen = [a for a in self.rules if a.id in ids]
            # Per-tensor rules, those that can speak about a finite tensor first: on a finite
            # tensor the others are not asked at all (see _judge).
            loud = [a for a in chosen if not a.phase_wide and not _silent_when_finite(a, stats)]
            quiet = [a for a in chosen if not a.phase_wide and a not in loud]
            checks = (tuple(loud), tuple(quiet))
            silent = not loud and all(not a.phase_wide for a in chosen)
            cached = (tuple(ids), tuple(wanted), checks, silent)
            self._applicable[key] = cached
        if self.interval > 1 and self.step % self.interval:
            return cached[0], tuple(s for s in cached[1] if s in SCREEN), cached[2], cached[3]
        return cached

    def _judge(self, record: Record, tensor: torch.Tensor | None) -> None:
        """Run the per-tensor rules that apply to a record on its statistics."""
        record.judged = True
        stats = record.stats
        nonfinite = stats.nonfinite
        if nonfinite and tensor is not None and NAN not in stats.values:
            # Which of NaN and Inf, and how many: counted only for unhealthy tensors.
            stats.values.update(zip(COUNTS, host_stats(tensor, COUNTS), strict=True))
            nonfinite = stats.nonfinite
        last = self.latest.get(stats.name)
        if last is not None and last[0] != stats.step:
            self.previous[stats.name] = last
        self.latest[stats.name] = (stats.step, stats)
        loud, quiet = record.checks or ((), ())
        for active in loud + quiet if nonfinite is not False else loud:
            if not active.enabled:
                continue
            try:
                finding = active.rule.check(stats, active.state)
                if isinstance(finding, Refine):
                    finding = self._refine(record, tensor, finding, active)
            except Exception as e:
                self._disable(active, e)
                continue
            if finding is not None:
                record.findings[active.id] = finding
        if record.findings and tensor is not None and record.tensor is None:
            record.tensor = tensor  # a hit's own tensor is always kept for inspection
        if nonfinite:
            record.conditions.add(NONFINITE)
        for rule_id in record.findings:
            if self.rule_propagates(rule_id):
                record.conditions.add(rule_id)
        if stats.kind == "grad":
            self._count_grad_norm(stats)

    def _refine(
        self, record: Record, tensor: torch.Tensor | None, ask: Refine, active: ActiveRule
    ) -> Finding | None:
        """A rule asked for more statistics of this tensor: compute them and ask it again."""
        stats = record.stats
        for _ in range(REFINEMENTS):
            missing = tuple(s for s in ask.stats if s not in stats.values)
            if not missing:
                break
            if tensor is None:
                return None  # the tensor is gone: no verdict
            stats.values.update(zip(missing, self._host_values(stats, tensor, missing),
                                    strict=True))  # fmt: skip
            again = active.rule.check(stats, active.state)
            if not isinstance(again, Refine):
                return again
            ask = again
        return None

    def _report(self, record: Record) -> None:
        """Make the hits of a judged record whose origin does not need the call tree; outputs
        and gradients are reported at their call's end (_exit) and at their gradient (_grad)."""
        stats = record.stats
        kind = stats.kind
        if kind == "observed":
            self._observed(record)
        elif kind == "param":
            upstream = self._grad_fired.get(record.param, set())
            for rule_id, finding in record.findings.items():
                condition = self._condition(record, rule_id)
                self._hit(record, rule_id, finding, condition not in upstream)
            if record.conditions:
                self._param_fired[record.param] = set(record.conditions)
            else:
                self._param_fired.pop(record.param, None)
        elif (kind == "input" and not record.hidden) or kind == "update":
            for rule_id, finding in record.findings.items():
                self._hit(record, rule_id, finding, True)

    def _condition(self, record: Record, rule_id: int) -> int | None:
        """What a finding's origin is traced by: non-finiteness, the rule itself when it
        propagates, or nothing (then it is an origin wherever it fires)."""
        if NONFINITE in record.conditions:
            return NONFINITE
        return rule_id if rule_id in record.conditions else None

    def rule_propagates(self, rule_id: int) -> bool:
        active = self._rule(rule_id)
        return bool(active and active.rule.propagates)

    def _judge_phase_wide(self) -> None:
        """Rules that compare the tensors of a phase with each other judge at its end."""
        for active in [a for a in self.rules if a.enabled and a.phase_wide]:
            records = [r for r in self._records if active.id in r.rule_ids and not r.hidden]
            if not records:
                continue
            try:
                found = active.rule.check_phase([r.stats for r in records], active.state)
            except Exception as e:
                self._disable(active, e)
                continue
            by_stats = {id(r.stats): r for r in records}
            for stats, finding in found:
                record = by_stats.get(id(stats))
                if record is not None:
                    record.findings[active.id] = finding
                    self._hit(record, active.id, finding, True)

    def _exit(self, call: Call) -> None:
        params_fired: set[int] = set()
        if self._param_fired:
            for name in call.params:
                params_fired |= self._param_fired.get(name, set())
        verdicts = origin.exit(call, params_fired)
        for suffix, record in call.outputs:
            for rule_id, finding in record.findings.items():
                condition = self._condition(record, rule_id)
                is_origin = condition is None or verdicts[id(record), condition]
                if record.producer is call:
                    self._hit(record, rule_id, finding, is_origin)
                elif condition is not None and is_origin:
                    # Passed up from a submodule, but made by this module's own code.
                    name = call.tensor_name("output", suffix)
                    message = finding.message.replace(record.stats.name, name)
                    finding = Finding(finding.value, finding.threshold, message)
                    self._hit(record, rule_id, finding, True, call, "output", name)
        if call.parent is None:
            self._root_fired = set(call.fired_out)

    def _grad(self, record: Record) -> None:
        if not record.findings:
            return
        if record.grad_of is None:  # a parameter's gradient
            owner = self.params_by_name.get(record.param)
            calls = self.capture.calls_by_path.get(owner.owner, []) if owner else []
            made_here = origin.param_grad(record, calls)
            for rule_id, finding in record.findings.items():
                condition = self._condition(record, rule_id)
                self._hit(record, rule_id, finding, condition is None or made_here[condition])
            return
        where = origin.grad(record, self._loss_fired)
        for rule_id, finding in record.findings.items():
            condition = self._condition(record, rule_id)
            if condition is None:
                self._hit(record, rule_id, finding, True)
                continue
            call, kind, is_origin = where[condition]
            name = record.stats.name
            if call is not None and kind == "grad_input":
                suffix = next((s for s, r in call.inputs if r is record.grad_of), record.suffix)
                name = call.tensor_name("grad_input", suffix)
            self._hit(record, rule_id, finding, is_origin, call, kind, name)

    def _observed(self, record: Record) -> None:
        stats = record.stats
        if "loss" in stats.name.lower() and stats.numel == 1:
            value = stats.values.get(MEAN)
            if value is not None and math.isfinite(value):
                self._step_loss.append(value)
        self._loss_fired |= record.conditions
        for rule_id, finding in record.findings.items():
            condition = self._condition(record, rule_id)
            self._hit(record, rule_id, finding, condition not in self._root_fired)

    def _hit(
        self,
        record: Record,
        rule_id: int,
        finding: Finding,
        is_origin: bool,
        module: Call | None = None,
        kind: str | None = None,
        name: str | None = None,
    ) -> None:
        active = self._rule(rule_id)
        if active is None:
            return
        stats = record.stats
        condition = self._condition(record, rule_id)
        tensor = record.held()
        if is_origin and stats.summary is None and tensor is not None:
            stats.summary = summarize(tensor)  # for the UI; downstream hits skip it
        hit = Hit(
            rule=active.rule.name,
            tensor=name or stats.name,
            module=module.path if module is not None else stats.module,
            kind=kind or stats.kind,
            step=stats.step,
            phase=stats.phase,
            origin=is_origin,
            value=float(finding.value),
            threshold=None if finding.threshold is None else float(finding.threshold),
            message=_with_origin(
                finding.message,
                is_origin,
                condition,
                kind or stats.kind,
                module.path if module is not None else stats.module,
                self._first_origin.get(condition, ""),
            ),
            ref=stats.ref,
            call=module.index if module is not None else stats.call,
            summary={
                **(stats.summary.as_dict() if stats.summary is not None else {}),
                "shape": list(stats.shape),
                "dtype": stats.dtype,
            },
        )
        if is_origin and condition is not None:
            self._first_origin.setdefault(condition, hit.tensor)
        if self.scaler is not None and stats.kind in GRAD_KINDS and stats.nonfinite:
            self._deferred.append((hit, active))  # the scaler may skip this step: see update()
            return
        self._add_hit(hit, active)

    def _add_hit(self, hit: Hit, active: ActiveRule | None) -> None:
        if len(self.hits) >= self.max_hits and not hit.origin:
            if not self._hits_capped:
                self._hits_capped = True
                self.log(
                    f"{self.max_hits} hits recorded: hits not at their origin are no "
                    "longer kept (raise max_hits to keep more)",
                    "warning",
                )
            return
        hit.id = len(self.hits)
        self.hits.append(hit)
        if active is not None:
            active.hits += 1
        key = (hit.rule, hit.tensor)
        repeated = key in self._fired_last_step
        self._fired_this_step.add(key)
        self.emit("hit", hit.as_dict())
        if self.controller.should_pause(hit, repeated):
            self._pausing.append(hit)

    def _pause_if_needed(self) -> None:
        if not self._pausing:
            return
        pausing, self._pausing = self._pausing, []
        first = next((h for h in pausing if h.origin), pausing[0])
        if callable(self.on_hit):
            for hit in pausing:
                self.on_hit(hit)
        elif self.on_hit == "raise":
            raise WatchpointHit(first)
        elif self.on_hit == "pause":
            self._block(f"{first.rule} hit: {first.message}", first)

    def _maybe_pause_on_request(self, completed_step: bool = False) -> None:
        control = self.controller
        if not (control.pause_requested or (completed_step and control.mode == STEP)):
            return
        reason = control.wants_pause(completed_step)
        if reason:
            self._block(reason, None)

    def _block(self, reason: str, hit: Hit | None) -> None:
        if self._detach_requested():
            return
        _print_pause(self, reason, hit)
        self.controller.block(reason, hit)
        self._detach_requested()

    def _detach_requested(self) -> bool:
        """The UI asked to detach (from its thread): finish it here, on the training thread."""
        if self.controller.state == DETACHED and not self.detached:
            self.detach()
        return self.detached

    def _disable(self, active: ActiveRule, error: BaseException) -> None:
        active.enabled = False
        active.disabled_reason = f"{type(error).__name__}: {error}"
        self.rules_changed()
        message = (
            f"tensordbg: rule {active.rule.name} raised {active.disabled_reason} and was "
            "disabled; the training goes on"
        )
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        self.log(message, "warning")

    def _rule(self, rule_id: int) -> ActiveRule | None:
        return self._rules_by_id.get(rule_id)

    # --- retention -----------------------------------------------------------------------------

    def _retain(self, record: Record, tensor: torch.Tensor) -> bool:
        """Keep a tensor of the phase for inspection. Eager mode judges it at once, so it keeps
        a hit's tensor and the last EAGER_WINDOW tensors it saw (within ``retain_bytes``); the
        others are held weakly: what the training keeps anyway (most activations, saved for the
        backward pass) can still be shown, and what it frees is freed soon (holding every freed
        gradient until the phase ends makes each step fault in fresh memory)."""
        if self.mode == "eager":
            if record.weak is None:
                record.weak = weakref.ref(tensor)
            if record.tensor is None and record.nbytes <= self.retain_bytes:
                window = self._window
                while window and (
                    len(window) >= EAGER_WINDOW
                    or self._retained + record.nbytes > self.retain_bytes
                ):
                    old = window.popleft()  # the oldest makes room (a hit's stays kept)
                    self._retained -= old.nbytes
                    if not old.findings:
                        old.tensor = None
                self._retained += record.nbytes
                record.tensor = tensor
                window.append(record)
            return True
        if self._retain_bytes(record.nbytes):
            record.tensor = tensor
            return True
        return False

    def _retain_bytes(self, nbytes: int) -> bool:
        """Count ``nbytes`` more against the phase's memory budget, if they fit."""
        if self._retained + nbytes <= self.retain_bytes:
            self._retained += nbytes
            return True
        return False

    def _release(self) -> None:
        for record in self._records:
            record.tensor = None
        self._retained = 0
        self._window.clear()

    # --- parameters and the optimizer ----------------------------------------------------------

    @property
    def params_by_name(self) -> dict[str, _Param]:
        return self._params_by_name

    def _owned_params(self, optimizer: torch.optim.Optimizer) -> list[_Param]:
        """The model's parameters this optimizer steps; the first optimizer also takes those
        no optimizer holds (a parameter left out of the optimizer is a bug worth seeing)."""
        mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if optimizer is self.optimizers[0]:
            held = {id(p) for opt in self.optimizers for g in opt.param_groups for p in g["params"]}
            return [p for key, p in self.params.items() if key in mine or key not in held]
        return [p for key, p in self.params.items() if key in mine]

    def check_parameters(self) -> None:
        """Check every parameter now (``attach`` does it once: a NaN or a poor initialization is
        found before the first step)."""
        if self.detached or self.broken:
            return
        self._start_phase("optimizer")
        self._check_parameters(list(self.params.values()), None)

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Gradients are final: judge what is pending (a gradient hit pauses before the update
        lands), note parameter versions and copy those whose update must be measured exactly."""
        if self.broken or self._detach_requested():
            return
        try:
            if self._pending or len(self._batch) or self._forward_open:
                self._end_phase()
            self._optimizer_stepped = True
            if self.phase != "optimizer":  # the first optimizer of the step: gradients are final
                self._grad_fired = {r.param: set(r.conditions) for r in self._records
                                    if r.stats.kind == "grad" and r.conditions}  # fmt: skip
            self._start_phase("optimizer")
            self._versions = {}
            self._snapshots = {}
            owned = self._stepping[optimizer] = self._owned_params(optimizer)
            wanted = self._update_stats_wanted()
            if wanted is None:
                return
            stepped = [p for p in owned if p.param.requires_grad and p.param.grad is not None]
            for p in stepped:
                self._versions[p.name] = p.param._version
            every = any(s.name in SNAPSHOT_STATS for s in wanted) and self.step % self.interval == 0
            budget = self.update_budget
            start = self._snapshot_offset % len(stepped) if stepped else 0
            taken = 0
            for p in stepped[start:] + stepped[:start]:
                if not (every or p.name in self._suspects):
                    continue
                size = p.param.numel() * p.param.element_size()
                if size <= budget:
                    self._snapshots[p.name] = p.param.detach().clone()
                    budget -= size
                    taken += 1
            self._snapshot_offset = start + taken  # a model larger than the budget rotates
        except Exception as e:
            if isinstance(e, self.passthrough):
                raise
            self.internal_error(e)

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.broken or self.detached:
            return
        try:
            owned = self._stepping.pop(optimizer, None) or self._owned_params(optimizer)
            self._check_parameters(owned, self._update_stats_wanted())
            if optimizer is self.optimizers[0]:
                self._finish_step()
                self._maybe_pause_on_request(completed_step=True)
        except Exception as e:
            if isinstance(e, self.passthrough):
                raise
            self.internal_error(e)

    def _update_stats_wanted(self) -> tuple[Stat, ...] | None:
        """The statistics rules on ``update`` records need, or None when no rule looks at
        updates (cached until the rules change)."""
        if "update" in self._applicable:
            return self._applicable["update"]
        probe = TensorStats("*.update", "", "update", "optimizer", self.step, (1,), "float32",
                            trainable=True)  # fmt: skip
        wanted: dict[Stat, None] = {}
        for active in self.rules:
            if not (active.enabled and "update" in active.rule.kinds):
                continue
            try:
                wanted.update(dict.fromkeys(active.rule.stats_for(probe)))
            except Exception as e:
                self._disable(active, e)
        self._applicable["update"] = tuple(wanted) or None
        return self._applicable["update"]

    def _check_parameters(self, owned: list[_Param], updates: tuple[Stat, ...] | None) -> None:
        """Parameters after an optimizer step (and at attach): their values and, for those the
        step updated, the update against their values before it (batched: one transfer)."""
        ranges: dict[str, tuple[float, float]] = {}
        for p in owned:
            if not watchable(p.param):
                continue
            silent = self._quiet_params.get(p.name)
            if silent is None:
                probe = _param_record(p, "param", p.name, self.step).stats
                silent = self._quiet_params[p.name] = self._applicability(probe)[3]
            if silent and self.mode != "batched":
                # The common case, without a record: its rules speak only of NaN and Inf, and
                # its range (needed anyway to tell that the step changed it) says it is finite.
                values = dict(zip(RANGE, host_stats(p.param, RANGE), strict=True))
                lo, hi = values[MIN], values[MAX]
                if math.isfinite(lo) and math.isfinite(hi):
                    ranges[p.name] = (lo, hi)
                    self._param_fired.pop(p.name, None)  # finite again, if it was not
                    continue
            record = _param_record(p, "param", p.name, self.step)
            self.collect(record, p.param.detach(), extra=RANGE if updates else ())
            ranges[p.name] = (record.stats.values.get(MIN), record.stats.values.get(MAX))
        pending_digest = []
        if updates is not None:
            for p in owned:
                if p.name in self._versions and watchable(p.param):
                    record = self._update_record(p, updates)
                    if record.slot < 0 and not record.stats.values:
                        pending_digest.append(record)
        self._fetch()
        if self.mode == "batched":  # the ranges arrived with the transfer
            ranges = {r.param: (r.stats.values.get(MIN), r.stats.values.get(MAX))
                      for r in self._records if r.stats.kind == "param"}  # fmt: skip
        self._resolve_by_range(pending_digest, ranges, updates or ())
        for name, (lo, hi) in ranges.items():
            if lo is not None and hi is not None:
                self._digests[name] = (lo, hi)
        self._drain()
        self._judge_phase_wide()
        self._pause_if_needed()
        self._release()
        self._snapshots = {}

    def _update_record(self, p: _Param, wanted: tuple[Stat, ...]) -> Record:
        record = _param_record(p, "update", f"{p.name}.update", self.step)
        record.rule_ids, _, record.checks, _ = self._applicability(record.stats)
        self._register(record)
        current = p.param.detach()
        previous: torch.Tensor | None
        if p.param._version == self._versions[p.name]:
            previous = current  # the optimizer did not touch it: the update is exactly zero
        else:
            previous = self._snapshots.get(p.name)
        if previous is not None:
            vector = update_stats(current, previous, wanted)
            if self.mode != "batched":
                record.stats.values = dict(zip(wanted, vector.tolist(), strict=True))
            else:
                record.stats.values = dict.fromkeys(wanted, math.nan)
                record.slot = self._batch.add(vector)
            self._suspects.discard(p.name)
        self._pending.append(("record", record))
        return record

    def _resolve_by_range(
        self,
        records: list[Record],
        ranges: dict[str, tuple[float | None, float | None]],
        wanted: tuple[Stat, ...],
    ) -> None:
        """Updates measured without a copy of the parameter: when its minimum or maximum moved
        by more than the tolerance, some element did too, so it changed (the common case, free).
        Otherwise it may not have changed: it is copied and compared exactly next step."""
        unchanged = next((s for s in wanted if s.name == "update_unchanged"), None)
        for record in records:
            name = record.param
            before, after = self._digests.get(name), ranges.get(name)
            moved = False
            if unchanged is not None and before is not None and after is not None:
                rtol, atol = unchanged.params
                moved = any(
                    a is not None and abs(a - b) > atol + rtol * abs(b)
                    for a, b in zip(after, before, strict=True)
                )
            if moved:
                record.stats.values = {unchanged: 0.0}
            else:
                self._suspects.add(name)

    def _finish_step(self) -> None:
        """A training step completed: history, status, this step's hits become last step's."""
        now = time.perf_counter()
        dt = now - self._last_step_time
        self._last_step_time = now
        loss = sum(self._step_loss) / len(self._step_loss) if self._step_loss else None
        grad_norm = math.sqrt(self._step_grad_sq) if self._step_grad_seen else None
        self.history.append((self.step, loss, grad_norm, 1.0 / dt if dt > 0 else None))
        self.step += 1
        self._step_loss = []
        self._step_grad_sq = 0.0
        self._step_grad_seen = False
        self._fired_last_step, self._fired_this_step = self._fired_this_step, set()
        self._first_origin = {}
        self.emit("status", self.status())

    def _count_grad_norm(self, stats: TensorStats) -> None:
        norm = stats.values.get(L2)
        if norm is not None:
            self._step_grad_sq += norm * norm
            self._step_grad_seen = True

    def status(self) -> dict[str, Any]:
        """Where the training is, and the numbers of the last completed step (pushed to the UI
        after every step; see ``Source.subscribe``)."""
        last = None
        if self.history:
            step, loss, grad_norm, steps_per_sec = self.history[-1]
            last = {"step": step, "loss": loss, "grad_norm": grad_norm,
                    "steps_per_sec": steps_per_sec}  # fmt: skip
        return {
            "state": self.controller.state,
            "step": self.step,
            "phase": self.phase,
            "hits_total": len(self.hits),
            "last": last,
        }

    # --- mixed precision -------------------------------------------------------------------------

    def _inv_scale(self) -> torch.Tensor | None:
        """1 / the GradScaler's scale, on its device. Computed once per phase: the scale changes
        only in ``scaler.update()``, after the step."""
        if "device" not in self._inv:
            scale = getattr(self.scaler, "_scale", None)
            self._inv["device"] = None if scale is None else 1.0 / scale
        return self._inv["device"]

    def _inv_scale_host(self) -> float | None:
        """The same as a Python float: one read per phase (on CUDA, one synchronization)."""
        if "host" not in self._inv:
            inv = self._inv_scale()
            self._inv["host"] = None if inv is None else float(inv.item())
        return self._inv["host"]

    def _scale_vector(self, stats: tuple[Stat, ...]) -> torch.Tensor | None:
        """What multiplies a statistics vector of a scaled gradient (cached per phase)."""
        if stats not in self._inv:
            inv = self._inv_scale()
            self._inv[stats] = None if inv is None else scale_vector(stats, inv)
        return self._inv[stats]

    def _wrap_scaler(self) -> None:
        scaler = self.scaler
        original = type(scaler).update.__get__(scaler)

        def update(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            if not self.broken and not self.detached:
                try:
                    self._after_scaler_update()
                except Exception as e:
                    if isinstance(e, self.passthrough):
                        raise
                    self.internal_error(e)
            return result

        scaler.update = update

    def _after_scaler_update(self) -> None:
        self._inv = {}
        skipped = not self._optimizer_stepped
        self._optimizer_stepped = False
        deferred, self._deferred = self._deferred, []
        if not skipped:
            self._skipped_in_row = 0
            for hit, active in deferred:
                self._add_hit(hit, active)
            self._pause_if_needed()
            return
        self.skipped_steps.append(self.step)
        self._skipped_in_row += 1
        self.log(f"step {self.step}: the GradScaler skipped the step (non-finite gradients)")
        if self._skipped_in_row >= self.max_skipped_steps:
            for hit, active in deferred:
                hit.message += (
                    f" The GradScaler skipped {self._skipped_in_row} steps in a row: the loss "
                    "scale cannot absorb this."
                )
                self._add_hit(hit, active)
        self._finish_step()
        self._pause_if_needed()
        self._maybe_pause_on_request(completed_step=True)

    # --- UI liveness -----------------------------------------------------------------------------

    def _on_state(self, state: str) -> None:
        self.emit("state", {"state": state, "step": self.step, "reason": self.controller.reason})

    def on_clients(self, count: int) -> None:
        """The server saw the number of connected UIs change. When the last one vanishes while
        the training is paused, the training resumes after ``ui_timeout`` seconds with blocking
        watchpoints disarmed (None keeps waiting)."""
        previous, self._ui_clients = self._ui_clients, count
        if count > 0 and self._ui_timer is not None:
            self._ui_timer.cancel()
            self._ui_timer = None
        if count == 0 and previous > 0 and self.ui_timeout is not None:
            self._ui_timer = threading.Timer(self.ui_timeout, self._ui_gone)
            self._ui_timer.daemon = True
            self._ui_timer.start()

    def _ui_gone(self) -> None:
        if self._ui_clients or self.controller.state != PAUSED:
            return
        self.on_hit = "record"
        self.log("the UI went away: blocking watchpoints disarmed, training resumed", "warning")
        print(
            "tensordbg: the UI went away; training resumes, hits are only recorded now",
            file=sys.stderr,
        )
        self.controller.resume()


def _silent_when_finite(active: ActiveRule, stats: TensorStats) -> bool:
    if active.phase_wide:
        return False
    try:
        return bool(active.rule.silent_when_finite(stats))
    except Exception:
        return False


def _param_record(p: _Param, kind: str, name: str, step: int) -> Record:
    param = p.param
    stats = TensorStats(
        name=name,
        module=p.owner,
        kind=kind,
        phase="optimizer",
        step=step,
        shape=tuple(param.shape),
        dtype=dtype_name(param.dtype),
        module_type=p.owner_type,
        trainable=param.requires_grad,
    )
    return Record(stats, None, param._version, param.numel() * param.element_size(), param=p.name)


def _with_origin(
    message: str, is_origin: bool, condition: int | None, kind: str, module: str, first: str
) -> str:
    """The finding's sentence, followed by where the value came from."""
    if condition is None:
        return message
    if not is_origin:
        source = f" (first produced at {first})" if first else ""
        return f"{message} It was passed on from upstream{source}, not produced here."
    return f"{message} {_ORIGIN_NOTE.get((kind, bool(module)), _ORIGIN_NOTE[kind, True])}"


_ORIGIN_NOTE = {
    ("input", False): "It came in with the batch: look at the data and its preprocessing.",
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
    ("grad_output", False): "It comes from the loss's backward: the loss itself was clean.",
    ("param", True): "The gradient was clean: the optimizer step or the code around it made it "
    "(learning rate, eps, a manual edit), or the parameter was loaded this way.",
    ("update", True): "It was produced by the optimizer step.",
    ("observed", True): "The model's outputs were clean: the code that computes it made it.",
}


def _print_pause(session: Session, reason: str, hit: Hit | None) -> None:
    where = f"step {session.step}, {session.phase}"
    lines = [f"tensordbg: training paused ({where}): {reason}"]
    if session.server is not None:
        lines.append(
            f"  inspect it: tensordbg tui      (run {session.run_id}, rank {session.rank}); "
            "continue with c there"
        )
    else:
        lines.append("  continue from another thread: session.controller.resume()")
    print("\n".join(lines), file=sys.stderr, flush=True)


def _patterns(value: str | Sequence[str]) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


def _model_device(model: torch.nn.Module) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    for tensor in model.buffers():
        return tensor.device
    return torch.device("cpu")


def _scaler_enabled(scaler: Any) -> bool:
    is_enabled = getattr(scaler, "is_enabled", None)
    return bool(is_enabled()) if callable(is_enabled) else True


def _detach_at_exit(ref: weakref.ref[Session]) -> None:
    session = ref()
    if session is not None:
        session.detach()


__all__ = ["Hit", "Session", "WatchpointHit"]
