"""``tensordbg run script.py``: debug a training script without changing it, like ``pdb``.

Global hooks find the training: the first module with trainable parameters that is called with
gradients on, and stepped by one of the optimizers made so far if there are any, is the model
(tensordbg attaches to it as ``attach()`` would, with the optimizers the script made for it so
far), an optimizer made later is watched from its first step on, and a scalar on which
``.backward()`` is called is observed as a loss, under the name the script gives it
(``d_loss.backward()`` observes ``d_loss``; see :func:`loss_name`). The global module hook is
removed as soon as the model is found, so the rest of the run pays only for the model's own
hooks.

A script that trains with a framework's trainer (Hugging Face ``Trainer``, Lightning ``Trainer``)
is watched through that framework's callback instead: each trainer the script makes gets one (see
:mod:`.frameworks`), which attaches at train begin with the trainer's model, optimizers and
GradScaler, and the global hooks stand down.
"""

from __future__ import annotations

import builtins
import importlib.util
import io
import os
import runpy
import sys
import types
import weakref
import zipfile
from collections.abc import Sequence
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook

from tensordbg.api import COMMAND_LINE, CommandLine, attach, attached_to
from tensordbg.engine.fused import quiet_compile_warning
from tensordbg.engine.hits import print_summary, ranked_line
from tensordbg.engine.marks import compiled_inner
from tensordbg.engine.params import held_params, parameter_count
from tensordbg.engine.session import Session
from tensordbg.hit import WatchpointHit
from tensordbg.integrations.frameworks import TrainerPatches, TrainingWatch
from tensordbg.rules import Rule
from tensordbg.tracebacks import format_user_traceback, print_script_error


class ScriptRun:
    """Finds the model, the optimizer and the loss of a script as it runs."""

    def __init__(self, rules: Sequence[Rule] | None, profile_steps: int = 0, **attach_args: Any):
        self.rules = rules
        self.profile_steps = profile_steps
        self.profiling: Any = None  # the ProfileHandle of --profile
        attach_args = {key: value for key, value in attach_args.items() if value is not None}
        self.attach_args = attach_args
        self.session: Session | None = None
        """The session the global hooks made (none when a framework's trainer is used)."""
        self.framework_sessions: list[Session] = []
        """The sessions of the framework callbacks, one per training."""
        self._trainers = TrainerPatches(self._framework_callback, self._stand_down)
        self._module_hook: Any = None
        self._watched: set[int] = set()  # the watched model's modules, and those said apart
        self._optimizer_hook: Any = None
        self._backward = torch.Tensor.backward
        self._scale = torch.amp.GradScaler.scale
        self._optimizer_init = torch.optim.Optimizer.__init__
        self._made: list[weakref.ref[torch.optim.Optimizer]] = []  # the script's optimizers
        self.chosen = _chosen(rules, attach_args)
        """What the person gave (``attach_args`` holds nothing else): a script that attaches
        tensordbg itself gets it too (``COMMAND_LINE``), whatever its value, attach's default
        included (``--on-hit pause`` over a script's "record")."""
        if "on_hit" not in attach_args:  # implied, for this run's own session alone (a dump
            attach_args["on_hit"] = "dump" if attach_args.get("dump_dir") else "pause"  # is
            # for nobody watching)

    def install(self) -> None:
        COMMAND_LINE.active = True
        COMMAND_LINE.settings = self.chosen
        COMMAND_LINE.flags = ", ".join(_flag(k, v) for k, v in self.chosen.items())
        COMMAND_LINE.sessions = []
        self._module_hook = register_module_forward_pre_hook(self._on_module)
        self._loud = quiet_compile_warning()  # of the hook above, at a compiled model's call
        self._optimizer_hook = register_optimizer_step_pre_hook(self._on_optimizer)
        run = self
        original = self._backward

        scaled: list[weakref.ref[torch.Tensor]] = []  # a GradScaler's scaled loss, observed

        def backward(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if scaled and scaled[-1]() is tensor:  # its loss was observed unscaled (below)
                scaled.clear()
            elif run.session is not None and tensor.numel() == 1:
                run.session.observe(loss_name(tensor, sys._getframe(1)), tensor)
            return original(tensor, *args, **kwargs)

        def scale(scaler: Any, outputs: Any, *args: Any, **kwargs: Any) -> Any:
            # The script's own GradScaler: without it its gradients were judged scaled (65536x
            # a healthy norm: ExplodingGradient at every step) and its loss observed so.
            result = self._scale(scaler, outputs, *args, **kwargs)
            session = run.session
            if session is not None and session.adopt_scaler(scaler):
                print("tensordbg: watching the script's GradScaler too: gradients are judged "
                      "unscaled, and a step it skips is no hit", file=sys.stderr)  # fmt: skip
            if session is not None and isinstance(outputs, torch.Tensor) and outputs.numel() == 1:
                session.observe(loss_name(outputs, sys._getframe(1)), outputs)
                scaled[:] = [weakref.ref(result)]
            return result

        torch.Tensor.backward = backward  # type: ignore[method-assign]
        torch.amp.GradScaler.scale = scale  # type: ignore[method-assign]
        made, init = self._made, self._optimizer_init

        def optimizer_init(optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
            init(optimizer, *args, **kwargs)
            made.append(weakref.ref(optimizer))

        torch.optim.Optimizer.__init__ = optimizer_init  # type: ignore[method-assign]
        self._trainers.install()

    @property
    def sessions(self) -> list[Session]:
        """Every session this run made, or the script made under it."""
        own = [self.session] if self.session is not None else []
        return own + self.framework_sessions + COMMAND_LINE.sessions

    def hit(self) -> bool:
        """Whether anything hit, in any session."""
        return any(s.hits for s in self.sessions)

    def remove(self) -> None:
        COMMAND_LINE.settings, COMMAND_LINE.flags, COMMAND_LINE.sessions = {}, "", []
        COMMAND_LINE.active = False
        self._trainers.remove()
        for session in self.framework_sessions:
            session.detach(finished=True)
        torch.Tensor.backward = self._backward  # type: ignore[method-assign]
        torch.amp.GradScaler.scale = self._scale  # type: ignore[method-assign]
        torch.optim.Optimizer.__init__ = self._optimizer_init  # type: ignore[method-assign]
        self._made = []
        self._unhook_modules()
        if self._optimizer_hook is not None:
            self._optimizer_hook.remove()
            self._optimizer_hook = None
        if self.session is not None:
            self.session.detach(finished=True)  # the script ended

    def _unhook_modules(self) -> None:
        if self._module_hook is not None:
            self._module_hook.remove()
            self._module_hook = None
            self._loud()

    def _stand_down(self) -> None:
        """A framework's trainer was made: its callback watches from train begin on."""
        self._unhook_modules()
        if self.session is not None:
            self.session.detach()  # the model was called before the trainer was made

    def _framework_callback(self, callback_class: type[TrainingWatch]) -> TrainingWatch:
        args = {"rules": self.rules, "replaceable": True, "summary_at_exit": False}
        callback = callback_class(**args, **self.attach_args)
        callback.on_attach = self._framework_attached
        return callback

    def _framework_attached(self, session: Session) -> None:
        self.framework_sessions.append(session)
        if self.profile_steps and self.profiling is None:  # --profile under a trainer
            self.profiling = session.profile(self.profile_steps)
        model = session.model
        if model is not None:
            said = (
                f"tensordbg: watching {type(model).__name__} ({parameter_count(model):,} "
                f"parameters) through its trainer, run {session.run_id}"
            )
            print(ranked_line(session, said), file=sys.stderr, flush=True)

    def _on_module(self, module: torch.nn.Module, args: tuple) -> None:
        if self.session is not None:
            self._another_model(module)
            return
        if not any(p.requires_grad for p in module.parameters()):
            return
        made = [o for ref in self._made if (o := ref()) is not None]
        # The model the script trains: called with gradients on, and stepped by one of the
        # optimizers made so far, if any (a distilling teacher, called first under no_grad
        # and stepped by none, was watched in the student's stead: found trying it).
        if not torch.is_grad_enabled() or (made and not any(_steps(o, module) for o in made)):
            return
        own = attached_to(module)
        if own is not None:  # the script attached tensordbg itself (with the command line's
            self._unhook_modules()  # settings over its own: attach() says which)
            if self.profile_steps:
                self.profiling = own.profile(self.profile_steps)
            return
        # The optimizers the script made for it, watched from step 0: one found only at its
        # first step leaves the steps before it counted as model calls (four micro-batches of
        # gradient accumulation were four steps), and the first says no optimizer is watched.
        optimizers = [o for o in made if _steps(o, module)]
        # torch.compile(model): the model inside, not compiled yet (it compiles in this call,
        # after this hook): watched as if attached before compiling, its hooks at graph breaks.
        inner = compiled_inner(module)
        watched = module if inner is None else inner
        self.session = attach(watched, optimizer=optimizers or None, rules=self.rules,
                              replaceable=True, **self.attach_args)  # fmt: skip
        self._watched = {id(m) for m in module.modules()}
        if watched is not module:  # torch.compile's wrapper: no hook of ours on its next calls
            self._unhook_modules()  # (a model apart from it is not said)
        if id(module) in self.session.capture.paths:
            # This very call began before the model's own hooks existed: enter it by hand. (A
            # wrapper's, DistributedDataParallel's or the compiled one's, is not watched: the
            # model's own call comes inside it, through its hooks.)
            self.session.capture.on_enter(module, args, {})
        if self.profile_steps:
            self.profiling = self.session.profile(self.profile_steps)
        said = (
            f"tensordbg: watching {type(watched).__name__} "
            f"({parameter_count(watched):,} parameters), run {self.session.run_id}"
        )
        print(ranked_line(self.session, said), file=sys.stderr, flush=True)

    def _another_model(self, module: torch.nn.Module) -> None:
        """A model apart from the watched one, called during the first step (a GAN's
        discriminator beside its generator): said once, as not watched. The hook goes at the
        first step's end: it costs nothing after it."""
        session = self.session
        if session is None or session.step > 0 or session.detached:
            self._unhook_modules()
            return
        if id(module) in self._watched or not any(p.requires_grad for p in module.parameters()):
            return
        self._watched |= {id(m) for m in module.modules()}  # said once, with all it holds
        watched, n = session.model, parameter_count(module)
        print(f"tensordbg: {type(module).__name__} ({n:,} "
              f"parameters), a model apart from the watched {type(watched).__name__}, runs "
              "too and is not watched; to watch both, attach tensordbg in the script to a "
              "module holding them, with their optimizers: tensordbg.attach(torch.nn.ModuleDict("
              "{'a': the watched model, 'b': this one}), optimizer=[their optimizers]) (a GAN's "
              "generator and discriminator, an encoder and its decoder)",
              file=sys.stderr, flush=True)  # fmt: skip

    def _on_optimizer(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.session is not None:  # one that steps the model: its pre-hook runs for this
            self.session.adopt_optimizer(optimizer)  # very step too


def run_script(script: str, args: Sequence[str], rules: Sequence[Rule] | None = None,
               profile_steps: int = 0, module: Sequence[str] | None = None,
               **attach_args: Any) -> int:  # fmt: skip
    """Run ``script`` as ``__main__`` with ``args``, watched by tensordbg; returns its exit code,
    or 1 when the script exited 0 but a watchpoint hit (as a linter does: a CI job that runs a
    short training under ``tensordbg run --on-hit record`` fails when something hit).
    ``attach_args`` are attach's, those the person gave (None: not given); a script that
    attaches tensordbg itself gets them over its own.

    ``module``: ``-m``'s words instead (a module's name and its arguments), run as ``python -m``
    runs it, from the current directory (a package's relative imports work).

    >>> run_script("train.py", ["--epochs", "1"], on_hit="raise")
    """
    saved_argv, saved_path = sys.argv, list(sys.path)
    if module:
        script, args = module[0], module[1:]
        sys.path.insert(0, os.getcwd())  # where python -m looks first
        if (why := _no_module(script)) is not None:
            sys.path[:] = saved_path
            print(f"tensordbg run: no module {script} to run: {why}", file=sys.stderr)
            return 2
    elif not os.path.isfile(script):
        print(f"tensordbg run: no such script: {script}", file=sys.stderr)
        return 2
    run = ScriptRun(rules, profile_steps, **attach_args)
    sys.argv = [script, *args]
    if not module:
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    run.install()
    try:
        if module:  # its __main__, sys.argv[0] its file, as python -m sets them
            runpy.run_module(script, run_name="__main__", alter_sys=True)
        else:
            _run_main(script)
        return 1 if run.hit() else 0
    except SystemExit as e:
        code = e.code
        if code is not None and not isinstance(code, int):  # sys.exit("why"), as python says it
            print(code, file=sys.stderr, flush=True)
        code = code if isinstance(code, int) else (0 if code is None else 1)
        return 1 if code == 0 and run.hit() else code
    except WatchpointHit as e:  # on_hit="raise": the user's frames, and the summary last
        print(format_user_traceback(e), end="", file=sys.stderr, flush=True)
        return 1
    except Exception as e:  # the script's own error, as python would print it: exit 1
        print_script_error(e)
        return 1
    except KeyboardInterrupt:
        session = run.sessions[-1] if run.sessions else None
        where = ""
        if session is not None and session.detached:  # its step stopped counting there
            where = f"; tensordbg had detached at step {session.step}"
        elif session is not None:  # between two steps (most of a script's time) no phase
            step, phase = session.stopped_at or (session.step, session.where)
            where = f" at step {step}" + (f", {phase}" if phase else "")
        paused = session is not None and (
            session.controller.state == "paused" or session.stopped_at is not None
        )
        print(f"tensordbg run: interrupted (Ctrl-C){where}"
              + (" while paused" if paused else ""), file=sys.stderr)  # fmt: skip
        for watched in run.sessions:
            watched.ended_by = "interrupted by Ctrl-C"  # the UI says so, not just "finished"
        return 130
    finally:
        sessions = run.sessions
        for session in sessions:
            if session.hits or session.broken:  # no hit after a break is not a clean run
                print_summary(session)
        run.remove()
        sys.argv, sys.path[:] = saved_argv, saved_path
        if run.profile_steps:
            _print_profile(run)
        for session in sessions:  # a profile the UI asked for, cut off by the script's end
            if session.profiling is not None and session.profiling is not run.profiling:
                session.profiling.say_at_exit("tensordbg run")


def _print_profile(run: ScriptRun) -> None:
    """``--profile``: the report (the steps done, when the script ended first), or why none."""
    handle = run.profiling
    if handle is None:
        print("tensordbg run --profile: no model was found, nothing was profiled", file=sys.stderr)
        return
    report = handle.wait(120)
    if report is None:
        why = handle.message or f"the profile is {handle.state}"
        print(f"tensordbg run --profile: no report ({why})", file=sys.stderr, flush=True)
        return
    print(report.text(), file=sys.stderr, flush=True)


def _steps(optimizer: torch.optim.Optimizer, module: torch.nn.Module) -> bool:
    """Whether ``optimizer`` updates any parameter of ``module``."""
    return not held_params(optimizer).isdisjoint(id(p) for p in module.parameters())


def _chosen(rules: Sequence[Rule] | None, attach_args: dict[str, Any]) -> dict[str, Any]:
    """The settings among :attr:`CommandLine.KEYS` that were given (rules: not None)."""
    chosen: dict[str, Any] = {} if rules is None else {"rules": rules}
    chosen.update((key, attach_args[key]) for key in CommandLine.KEYS[1:] if key in attach_args)
    return chosen


def _flag(key: str, value: Any) -> str:
    if key == "remote":  # True, or where to listen
        return "--remote" if value is True else f"--listen {value}"
    if key == "rules":
        value = ",".join(type(r).__name__ for r in value) or "''"
    elif isinstance(value, (tuple, list)):
        value = " ".join(map(str, value))
    return f"--{key.replace('_', '-')} {value}"


def loss_name(tensor: torch.Tensor, frame: Any) -> str:
    """The name under which a scalar that the script calls ``.backward()`` on is observed: the
    script's own name for it when it has one (a GAN's ``d_loss`` and ``g_loss``, DCGAN's
    ``errD_real`` as ``loss_errD_real``, so that every name is loss-like), else ``loss``. Two
    losses of a step are two tensors with two names, not one: the loss curve follows the first
    (see :class:`~tensordbg.engine.metrics.StepMetrics`)."""
    names = [name for name, value in frame.f_locals.items()
             if value is tensor and name.isidentifier() and not name.startswith("_")]  # fmt: skip
    named = next((name for name in names if "loss" in name.lower()), None)
    return named or (f"loss_{names[0]}" if names else "loss")


def _no_module(name: str) -> str | None:
    """Why ``python -m name`` would not find a module to run, or None."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError) as e:  # a parent package that is not there, or ''
        return str(e) or type(e).__name__
    if spec is None:
        return "it is not on the path (run from the directory that holds its package)"
    if spec.submodule_search_locations is not None:  # a package: its __main__
        return (
            None if importlib.util.find_spec(f"{name}.__main__") else "a package without __main__"
        )
    return None


def _run_main(script: str) -> None:
    """Run ``script`` as ``python script`` runs it: as ``__main__``, its ``__file__`` absolute
    (since Python 3.9: ``os.path.dirname(__file__)`` finds what lies beside it) and
    ``sys.argv[0]`` as typed (a dump's meta and the UI name the script by it). runpy gives
    neither both (its ``__file__`` is the path given, and it sets ``sys.argv[0]`` to it); a zip
    application still goes through it."""
    if zipfile.is_zipfile(script):
        runpy.run_path(script, run_name="__main__")
        return
    path = os.path.abspath(script)
    with io.open_code(path) as f:
        code = compile(f.read(), path, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __cached__=None, __loader__=None, __spec__=None,
                         __builtins__=builtins)  # fmt: skip
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = main  # what pickle and spawned workers find its classes in
    try:
        exec(code, main.__dict__)
    finally:
        if saved is not None:
            sys.modules["__main__"] = saved
