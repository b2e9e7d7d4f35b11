"""The session: the facade a user holds, and the pipeline behind it.

The hooks (:mod:`.capture`) hand the session one :class:`~.records.Record` per watched tensor.
The session asks the rule set (:mod:`.judge`) which statistics the rules need, has the sync mode
(:mod:`.modes`) compute them next to the tensor, judges them, names the origin (:mod:`.origin`),
logs hits (:mod:`.hits`) and pauses the training (:mod:`.control`). Everything it installs is
in one :class:`~.handles.HandleGroup`; what happens is published on its :class:`~.bus.EventBus`.
"""

from __future__ import annotations

import atexit
import numbers
import os
import secrets
import sys
import threading
import traceback
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from tensordbg.engine import origin, stepping
from tensordbg.engine.amp import MixedPrecision
from tensordbg.engine.backward import BackwardPhase
from tensordbg.engine.bus import EventBus, extend
from tensordbg.engine.capture import Capture
from tensordbg.engine.control import ControlPlane, PauseController
from tensordbg.engine.forward import ForwardPhase
from tensordbg.engine.handles import HandleGroup
from tensordbg.engine.hits import HitLog, print_summary
from tensordbg.engine.judge import ActiveRule, RuleSet
from tensordbg.engine.loss_code import Observations
from tensordbg.engine.marks import compiled_inner, hook_of_ours, own_work
from tensordbg.engine.metrics import StepMetrics
from tensordbg.engine.modes import SYNC, choose
from tensordbg.engine.optimizer import OptimizerPhase
from tensordbg.engine.params import Param, ParamWatch
from tensordbg.engine.phases import EAGER_WINDOW, EMPTY, ActGradNote, PhaseQueue
from tensordbg.engine.pipeline import Pipeline
from tensordbg.engine.records import Call, Record, new_record
from tensordbg.engine.vouching import GradientPlan, Vouchers
from tensordbg.hit import Hit, WatchpointHit
from tensordbg.rules import Rule, default_rules
from tensordbg.statistics import MEAN, TensorStats
from tensordbg.statistics.torch_kernels import watchable
from tensordbg.tracebacks import script_ended_by

ON_HIT = ("pause", "raise", "record", "skip", "dump")
DEFAULT_RETAIN = 256 * 2**20
DEFAULT_UPDATE_BUDGET = 512 * 2**20

_attached: weakref.WeakKeyDictionary[torch.nn.Module, Session] = weakref.WeakKeyDictionary()

__all__ = ["DEFAULT_RETAIN", "DEFAULT_UPDATE_BUDGET", "EAGER_WINDOW", "SYNC", "Hit", "Session",
           "WatchpointHit", "attached_to"]  # fmt: skip


def attached_to(model: torch.nn.Module) -> Session | None:
    """The session watching ``model`` (or a model that holds it, or one it holds), if any."""
    mine = {id(m) for m in model.modules()}
    return next((s for other, s in list(_attached.items()) if not s.detached and (
        id(other) in mine or any(m is model for m in other.modules()))), None)  # fmt: skip


class Session(Pipeline, ForwardPhase, BackwardPhase, OptimizerPhase):
    """A training under watch. Made by :func:`tensordbg.attach`; see there for the arguments.

    >>> with tensordbg.attach(model, optimizer=opt, on_hit="record") as session:
    ...     train(model, opt)
    >>> [h.module for h in session.hits if h.origin]
    ['layers.2.attn']
    """

    passthrough: tuple[type[BaseException], ...] = (WatchpointHit,)
    ranks: Any = None  # the link to the other ranks of a job (distributed.RankLink), or None
    sharded: tuple[str, ...] | list[str] = ()  # parameters read through this rank's shard
    replaceable = False
    """Whether a later ``attach`` of the same model replaces this session (``tensordbg run``)."""
    _exiting = False
    ended_by = ""  # how the script ended when not by itself (a Ctrl-C), said to the UI
    summary_at_exit = False
    """Whether the program's exit prints :meth:`summary` when hits were recorded (``attach``
    sets it)."""

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
        _check_arguments(model, on_hit, interval)
        self._model = weakref.ref(model)  # a session never keeps a model alive
        self.device = _model_device(model)
        self.sync = choose(sync, self.device)
        self.mode = self.sync.name
        self.on_hit = on_hit
        self.interval = int(interval)
        self.retain_bytes = int(retain_bytes)
        self.run_id = run_id or os.environ.get("TENSORDBG_RUN_ID") or secrets.token_hex(4)
        self.rank = int(rank if rank is not None else os.environ.get("RANK", 0))
        self.step = 0
        self.phase = "forward"
        self.broken = ""  # why tensordbg stopped watching (its own fault), once it did
        self.detached = False
        self.active = True
        """Whether the hooks still do anything: not after detach (a hook installed on this
        step's autograd graph can still fire), nor after an internal error (an attribute: every
        hook reads it)."""
        self.triggered = False
        """Deferred mode: the phase showed a problem, so everything it kept is screened."""
        self.server: Any = None  # what serves it to the UI, set by attach (never the engine)
        self.dumps: Any = None  # what writes its dump (attach(dump_dir=...)), if anything
        self.handles = HandleGroup()
        self.bus = EventBus()
        self.controller = PauseController()
        self.controller.listeners.append(self._on_state)
        self.control = ControlPlane(self.controller)
        self.ruleset = RuleSet(default_rules() if rules is None else rules, self.log)
        self.ruleset.keep_refinements = self.sync.on_device
        self.weights = ParamWatch(model, int(update_budget))
        self.hitlog = HitLog(self.log, model, watched=self.weights)
        self.hitlog.rank = self.rank
        self.phases = PhaseQueue(self.retain_bytes)
        self.metrics = StepMetrics()
        self.vouchers = Vouchers(model, self.retain_bytes)
        if self.sync.vouches_at_pass_end:
            self.plan = GradientPlan(self.vouchers, {p.name: p.param for p in self.params.values()})
            self.plan.take = self.phases.take
        self._grads_seen: dict[str, tuple[weakref.ref[torch.Tensor], int]] = {}
        self._grad_makings, self._by_norm, self._apart = {}, [], {}
        self._unlisted: tuple[Call, int] | None = None  # a root forward not listed, where it goes
        self.phase_serial = 0  # phases started so far: which one a pending forward belongs to
        self.amp = MixedPrecision(scaler, int(max_skipped_steps))
        self.origins = origin.Attribution(self._owner_calls)
        self.optimizers: list[torch.optim.Optimizer] = []
        self._pausing: list[Hit] = []
        self.undrained: list[Any] = []  # the phase's events after the pause under way
        self._forward_open = False
        self._backward_tasks: set[int] = set()
        self._loose: ActGradNote | None = None  # an activation gradient screened at the next
        self._loose_version = 0
        self._root_forwards = 0
        self._quiet_params: dict[str, bool] = {}
        self.published = EMPTY
        """The last :meth:`publish`: what other threads read (never the live dicts)."""
        self.pid = os.getpid()
        self._forked_hits: int | None = None  # hits a forked child printed (None: not said)
        self._said_no_optimizer = False
        self._param_versions: list[int] | None = None
        self._skip_requested = False
        self._skips_in_row = 0
        self.skipped_updates: list[int] = []
        """Steps whose update tensordbg skipped (:meth:`skip_step`, ``on_hit="skip"``)."""
        self._stepping: dict[torch.optim.Optimizer, list[Param]] = {}  # between pre and post hook
        self._step_depth = {}
        self._optimizer_hooks: dict[int, tuple[Any, Any]] = {}  # each watched optimizer's
        self.observed = Observations()  # this step's observe() calls
        self.capture = Capture(self, model, _patterns(include), _patterns(exclude))
        try:
            self.capture.install(model, self.handles)
            if optimizer is not None:
                opts = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else optimizer
                for opt in opts:
                    self.attach_optimizer(opt)
                self.handles.add(register_optimizer_step_pre_hook(self._any_optimizer_step))
            self.amp.install(self.handles, self._guarded(self._after_scaler_update))
            _attached[model] = self
            self.handles.callback(partial(_forget, weakref.ref(model), self), "attached model")
            at_exit = partial(_detach_at_exit, weakref.ref(self))
            atexit.register(at_exit)
            self.handles.callback(partial(atexit.unregister, at_exit), "atexit")
            extend(self)
        except BaseException:
            self.handles.close()
            raise

    # --- public ----------------------------------------------------------------------------

    @property
    def model(self) -> torch.nn.Module | None:
        """The watched model; None once it is gone (the session holds it weakly)."""
        return self._model()

    @property
    def hits(self) -> list[Hit]:
        """Every hit so far, in the order found."""
        return self.hitlog.hits

    @property
    def max_hits(self) -> int:
        """Past this many hits, only hits at their origin are kept."""
        return self.hitlog.max_hits

    @max_hits.setter
    def max_hits(self, value: int) -> None:
        self.hitlog.max_hits = int(value)

    @property
    def rules(self) -> list[ActiveRule]:
        """The session's rules, as it runs them."""
        return self.ruleset.active

    @property
    def skipped_steps(self) -> list[int]:
        """Steps the GradScaler skipped."""
        return self.amp.skipped_steps

    @property
    def history(self) -> Any:
        return self.metrics.history

    @property
    def latest(self) -> dict[str, tuple[int, TensorStats]]:
        return self.metrics.latest

    @property
    def previous(self) -> dict[str, tuple[int, TensorStats]]:
        return self.metrics.previous

    @property
    def params(self) -> dict[int, Param]:
        return self.weights.params

    @property
    def params_by_name(self) -> dict[str, Param]:
        return self.weights.by_name

    @property
    def records(self) -> list[Record]:
        """The watched tensors of the current (or last) phase, in execution order."""
        self.materialize_forward()
        return [r for r in self.phases.records if not r.hidden]

    def record(self, ref: int) -> Record | None:
        self.materialize_forward()
        return self.phases.by_ref.get(ref)

    @hook_of_ours
    @own_work
    def observe(self, name: str, tensor: torch.Tensor | float) -> None:
        """Watch any extra tensor (kind ``"observed"``), e.g. the loss: ``session.observe("loss",
        loss)``, or a number (``loss.item()``, which scripts log: a NaN given so was dropped
        unseen). A scalar named like ``loss`` also feeds the loss curve in the UI. Integer
        tensors are not watched (they hold no NaN)."""
        if isinstance(tensor, numbers.Real) and not isinstance(tensor, bool):
            tensor = torch.tensor(float(tensor), dtype=torch.float64)
        elif not isinstance(tensor, torch.Tensor):
            raise TypeError(f"observe() takes a tensor or a number, not {type(tensor).__name__}")
        if not self.active or not watchable(tensor):
            return
        try:
            # The k-th of a name in a step is name#k, as a module's k-th call is (a loss at each
            # micro-batch: one name, and a dump kept only the last of its values).
            watched = (self._root_forwards, self.log, self.step)
            call = self.observed.note(name, sys._getframe(1), tensor, self.pass_started, watched)
            named = f"{name}#{call}" if call else name
            record = new_record(tensor, named, "observed", self.phase, self.step, call=call)
            record.apart = self.observed.apart
            self.collect(record, tensor, extra=(MEAN,))
            self._after_hook()
        except Exception as e:
            self.fault(e)

    def summary(self, origins: int = 5) -> str:
        """The hits in a few lines: those at their origin first (none: the first hit).

        >>> print(session.summary())
        tensordbg: 4756 hits, 1 at their origin.
          step 25 forward: [NaN] blocks.0.attn.output
            blocks.0.attn.output holds 1984 NaN among 31744 values; ...
        """
        text = self.hitlog.summary(self.skipped_steps, origins)
        if self.skipped_updates:
            text += f"\n  updates tensordbg skipped: {self.skipped_updates[:20]}"
        if self.broken:
            text += (
                f"\n  tensordbg stopped watching at step {self._broken_at} ({self.broken}): "
                "the steps from there on were not checked, so no hit there says nothing."
            )
        return text

    def flush(self) -> None:
        """Judge what is pending now. Batched checks judge at the end of a phase, and a forward
        that will be followed by backward ends when backward starts; call this when you need
        ``session.hits`` complete before that (after an evaluation forward, say)."""
        if not self.active:
            return
        try:
            self._end_phase()
        except Exception as e:
            self.fault(e)

    def add_rule(self, rule: Rule) -> ActiveRule:
        """Add a rule to this session (it gets its own copy and memory). From another thread,
        it takes effect at the training's next hook (see :attr:`control`)."""
        return self.control.submit(lambda: self.ruleset.add(rule)).result()

    def rules_changed(self) -> None:
        """Forget which rules apply to which tensor (after a rule was added, edited, toggled)."""
        self.ruleset.changed()
        self._quiet_params = {}

    def detach(self, *, finished: bool = False) -> None:
        """Remove every hook tensordbg installed, free every tensor it held, stop its server and
        let a paused training go on. Safe to call twice. From another thread while the training
        runs, it is done by the training thread at its next hook (as the UI's ``q`` is).
        ``finished``: the training is over, not going on unwatched (a UI says which)."""
        self._exiting |= finished
        if self.detached:
            return
        training = self.controller.training_thread
        if threading.current_thread() is not training and training.is_alive():
            self.controller.detach()  # finished by the training thread (_detach_requested)
            return
        self.controller.detach()  # what the last step's end finds is recorded, not paused on
        # k, then q: the skip still holds, for the optimizers watched now (closing forgets them)
        skipping = list(self.optimizers) if self._skip_requested and not self._skip_dropped else []
        if (self.step_open or (not self.optimizers and self._root_forwards)) and not self.broken:
            self.flush()  # the step's end would come with the next call or optimizer: none will
            self._finish_step()
        self.detached, self.active = True, False
        self._accumulators = None  # autograd's nodes that hold each parameter
        self.publish()
        state = "finished" if self._exiting else "detached"  # q: it goes on unwatched
        ended = {"reason": self.ended_by} if self._exiting and self.ended_by else {}
        stopped = self.stopped_at if self.stopped_at and self.stopped_at[0] == self.step else None
        step, where = stopped or (self.step, self.where)  # a pause Ctrl-C ended: where it stood
        self.bus.publish("state", {"state": state, "step": step, "phase": where, **ended})
        self.bus.publish("detach", {"state": "detached", "step": step, "phase": where})
        self.handles.close()
        stepping.skip_after_detach(skipping)
        self.control.close()
        self.phases.clear()
        self.weights.clear()
        if self.plan is not None:
            self.plan.forget()
        self._order_cache = None
        self._grad_makings = {}
        self._by_norm = []
        self._apart = {}
        self.amp.clear()
        self.capture.reset()
        self._stepping = {}
        self.server = None

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def profile(self, steps: int = 5, **options: Any) -> Any:
        """Profile the next ``steps`` training steps, after one warm-up step, while the
        training runs; returns a :class:`~tensordbg.profiler.ProfileHandle` at once (its
        ``report`` is None until they are done). ``options``: ``record_shapes``,
        ``profile_memory`` (True), ``with_flops`` (True), ``with_stack``, ``directory`` (where the
        trace goes). See :mod:`tensordbg.profiler.capture`.

        >>> handle = session.profile(steps=5)
        >>> ...                                  # the training runs its steps
        >>> print(handle.wait(60).text())
        """
        from tensordbg.profiler.capture import profiler_of

        return profiler_of(self).start(steps, **options)

    @property
    def profiling(self) -> Any:
        """The last profile asked for (a :class:`~tensordbg.profiler.ProfileHandle`), or None."""
        profiler = self.__dict__.get("_profiler")
        return profiler.handle if profiler is not None else None

    def subscribe(self, callback: Callable[[str, Any], None]) -> Callable[[], None]:
        """Call ``callback(event, payload)`` on every event of the bus (see
        :mod:`tensordbg.engine.bus`); it runs on the training thread and must not block."""
        return self.bus.subscribe(callback)

    def log(self, message: str, level: str = "info") -> None:
        self.bus.publish("log", {"level": level, "message": message, "step": self.step})

    def status(self) -> dict[str, Any]:
        """Where the training is, and the last completed step's numbers (after every step)."""
        return {
            "state": self.controller.state,
            "step": self.step,
            "phase": self.where,
            "hits_total": len(self.hits),
            "last": self.metrics.last(),
        }

    def fault(self, error: Exception) -> None:
        """What every hook does with an exception: a hit raised for the user, or what the
        user's own ``on_hit`` callable raised, goes on up; anything else is tensordbg's own
        fault (:meth:`internal_error`)."""
        if isinstance(error, self.passthrough) or getattr(error, "_from_on_hit", False):
            raise error
        self.internal_error(error)

    def internal_error(self, error: BaseException) -> None:
        """tensordbg's own fault: say so once, stop watching, never stop the training."""
        if self.broken:
            return
        self.broken = f"its internal error, {type(error).__name__}: {error}"
        self.active = False
        self._broken_at = self.step
        detail = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        warnings.warn(
            "tensordbg hit an internal error and stopped watching this training (the training "
            f"goes on). Please report it with this traceback:\n{detail}",
            RuntimeWarning,
            stacklevel=3,
        )
        self.log(f"internal error, watching stopped: {error}", "error")
        said = {"state": self.controller.state, "step": self.step, "unwatched": self.broken}
        self.bus.publish("state", said)  # a UI shows it: the training runs, unwatched

    def _owner_calls(self, param: str) -> list[Call]:
        """The calls that used a parameter: its module's, or, when that module was never called
        (``nn.MultiheadAttention`` uses ``out_proj.weight`` through a functional call), those of
        the nearest enclosing module that was."""
        owner = self.weights.by_name.get(param)
        path = owner.owner if owner else None
        calls = self.capture.calls_by_path
        while path is not None:
            if calls.get(path):
                return calls[path]
            path = path.rpartition(".")[0] if path else None
        return []

    def _guarded(self, fn: Callable[[], None]) -> Callable[[], None]:
        def guarded() -> None:
            try:
                fn()
            except Exception as e:
                self.fault(e)

        return guarded


def _check_arguments(model: Any, on_hit: Any, interval: int) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"attach() takes a torch.nn.Module, not {type(model).__name__}")
    if compiled_inner(model) is not None:
        raise TypeError(
            "this model is already compiled: attach tensordbg before torch.compile, "
            "e.g. session = tensordbg.attach(model); model = torch.compile(model)"
        )
    if (other := attached_to(model)) is not None:  # two sessions' hooks would meet in a module
        raise RuntimeError(f"tensordbg is already attached to this model or one that holds or "
                           f"is part of it ({type(other.model).__name__}): call session.detach() "
                           "first")  # fmt: skip
    if not callable(on_hit) and on_hit not in ON_HIT:
        raise ValueError(f"on_hit is one of {', '.join(ON_HIT)} or a callable, not {on_hit!r}")
    if interval < 1:
        raise ValueError("interval is a number of steps, at least 1")


def _patterns(value: str | Sequence[str]) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


def _model_device(model: torch.nn.Module) -> torch.device:
    tensors = (*model.parameters(), *model.buffers())
    return tensors[0].device if tensors else torch.device("cpu")


def _forget(model_ref: weakref.ref[torch.nn.Module], session: Session) -> None:
    model = model_ref()
    if model is not None and _attached.get(model) is session:
        del _attached[model]


def _detach_at_exit(ref: weakref.ref[Session]) -> None:
    if (session := ref()) is None:
        return
    session.ended_by = session.ended_by or script_ended_by()  # an error, a Ctrl-C: the UI says
    if session.summary_at_exit and (session.hits or session.broken) and not session.detached:
        print_summary(session)
    session.detach(finished=True)
    if session.profiling is not None:  # asked for (from the UI) and cut off by the exit
        session.profiling.say_at_exit("tensordbg")
