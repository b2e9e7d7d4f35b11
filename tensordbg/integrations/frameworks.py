"""What the Hugging Face and Lightning callbacks share, and how ``tensordbg run`` hands one to
every trainer a script makes.

A callback attaches at train begin with what the trainer made (the model, its optimizers, its
GradScaler), observes the loss, and detaches at train end; its session stays readable as
``callback.session``. Neither framework is imported here: ``tensordbg run`` patches a trainer
class only when the script itself imports it (an import hook, :class:`TrainerPatches`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import inspect
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping
from types import ModuleType
from typing import Any

import torch

from tensordbg.api import attach
from tensordbg.engine.hits import ranked_line
from tensordbg.engine.session import ON_HIT, Session
from tensordbg.hit import WatchpointHit
from tensordbg.tracebacks import shows_hits

FROM_THE_TRAINER = ("model", "optimizer", "scaler")


class TrainingWatch:
    """The framework-neutral part of a callback: :meth:`begin` at train begin, :meth:`observe_loss`
    for each loss, :meth:`end` at train end.

    >>> watch = TrainingWatch({"on_hit": "record"})
    >>> watch.begin(model, [optimizer], scaler=None)
    >>> watch.end(); watch.session.hits
    """

    def __init__(self, attach_args: Mapping[str, Any]):
        _check_attach_args(type(self).__name__, attach_args)
        self.attach_args = dict(attach_args)
        self.session: Session | None = None
        """The session of the latest training; its hits stay readable after it ended."""
        self.on_attach: Callable[[Session], None] | None = None
        """Told of each session made (``tensordbg run`` counts their hits)."""

    def begin(self, model: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer],
              scaler: Any, rank: int | None = None, step: int = 0) -> Session:  # fmt: skip
        """Attach to what the trainer made (a session left from an earlier training, one that
        ended in an exception, is detached first). ``rank``: the process's rank as the trainer
        knows it (Lightning's own DDP launcher sets no ``RANK``); ``step``: the trainer's step
        it begins at (a training resumed from a checkpoint, a second ``fit``), which the
        session counts on from: its hits are numbered as the trainer numbers its steps."""
        self.end(summary=False)
        args = {"summary_at_exit": True, "rank": rank, **self.attach_args}
        self.session = attach(model, optimizer=list(optimizers) or None, scaler=scaler, **args)
        self.session.step = step  # nothing ran yet: as if it had counted from 0
        if self.on_attach is not None:
            self.on_attach(self.session)
        return self.session

    def observe_loss(self, loss: Any, scale: float = 1.0) -> None:
        """Observe a scalar loss (``scale`` undoes a division by the accumulation steps)."""
        session = self.session
        if session is None or not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            return
        session.observe("loss", loss.detach() * scale if scale != 1.0 else loss)

    def end(self, summary: bool = True) -> None:
        """Detach, and print the summary of the hits on stderr (as ``attach`` does at exit,
        unless ``summary_at_exit=False``)."""
        session = self.session
        if session is None or session.detached:
            return
        ranked = getattr(session, "ranks", None) is not None  # (detach lets go of the ranks)
        session.detach()
        if summary and session.summary_at_exit and session.hits:
            text = ranked_line(session, session.summary(), ranked)  # which rank's, as attach's
            raised = sys.exc_info()[1]  # ended by a hit raised on its way up: said after it
            if isinstance(raised, WatchpointHit) and shows_hits():
                raised.summary_after = text
            else:
                print(text, file=sys.stderr, flush=True)


def _check_attach_args(owner: str, attach_args: Mapping[str, Any]) -> None:
    """A wrong argument fails when the callback is made, not at train begin."""
    known = [name for name in inspect.signature(attach).parameters
             if name not in FROM_THE_TRAINER]  # fmt: skip
    for name in attach_args:
        if name in FROM_THE_TRAINER:
            raise TypeError(
                f"{owner} takes the {name} from the trainer; "
                f"pass only attach()'s other arguments ({', '.join(known)})"
            )
        if name not in known:
            raise TypeError(
                f"{owner} got an unknown argument {name!r}; "
                f"it takes attach()'s keyword arguments ({', '.join(known)})"
            )
    on_hit = attach_args.get("on_hit", "pause")
    if not callable(on_hit) and on_hit not in ON_HIT:
        raise ValueError(f"on_hit is one of {', '.join(ON_HIT)} or a callable, not {on_hit!r}")


# --- tensordbg run: a callback for every trainer the script makes --------------------------------

# The module that defines each framework's Trainer, and the integration that watches it.
TRAINER_MODULES = {
    "transformers.trainer": "tensordbg.integrations.hf",
    "lightning.pytorch.trainer.trainer": "tensordbg.integrations.lightning",
    "pytorch_lightning.trainer.trainer": "tensordbg.integrations.lightning",
}


class TrainerPatches(importlib.abc.MetaPathFinder):
    """While installed, each framework ``Trainer`` made gets a callback from ``make_callback``
    (unless the script gave it one): ``Trainer.__init__`` is wrapped as soon as its module is
    imported (at once if it already is). ``on_trainer`` is called first, for each trainer."""

    def __init__(self, make_callback: Callable[[type], Any], on_trainer: Callable[[], None]):
        self.make_callback = make_callback
        self.on_trainer = on_trainer
        self._undo: list[Callable[[], None]] = []

    def install(self) -> None:
        sys.meta_path.insert(0, self)
        for name in TRAINER_MODULES:
            if name in sys.modules:
                self._patch(sys.modules[name])

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        while self._undo:
            self._undo.pop()()

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in TRAINER_MODULES:
            return None
        spec = None
        for finder in sys.meta_path:  # whoever would have found it (an editable install too)
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None  # imported as usual, unpatched: the global hooks still find the model
        spec.loader = _ThenPatch(spec.loader, self._patch)
        return spec

    def _patch(self, module: ModuleType) -> None:
        trainer_class = getattr(module, "Trainer", None)
        if trainer_class is None:
            return
        # Imported when a trainer is made: now, the framework's package may be half imported.
        integration = TRAINER_MODULES[module.__name__]
        original = trainer_class.__init__
        patches = self

        @functools.wraps(original)
        def __init__(trainer: Any, *args: Any, **kwargs: Any) -> None:
            original(trainer, *args, **kwargs)
            try:
                add_callback = importlib.import_module(integration).add_callback
                patches.on_trainer()
                add_callback(trainer, patches.make_callback)
            except Exception as e:  # never stop the script over its debugger
                warnings.warn(
                    f"tensordbg run: could not give this {type(trainer).__name__} tensordbg's "
                    f"callback ({e}); add {integration}.TensordbgCallback to its callbacks",
                    RuntimeWarning,
                    stacklevel=2,
                )

        trainer_class.__init__ = __init__
        self._undo.append(lambda: setattr(trainer_class, "__init__", original))


class _ThenPatch(importlib.abc.Loader):
    """A module's own loader, then the patch."""

    def __init__(self, loader: Any, then: Callable[[ModuleType], None]):
        self.loader = loader
        self.then = then

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        try:
            self.then(module)
        except Exception as e:  # the framework imports as usual, unwatched
            warnings.warn(f"tensordbg run: could not watch {module.__name__}'s Trainer ({e})",
                          RuntimeWarning, stacklevel=2)  # fmt: skip
