"""The control plane: how other threads (the UI's server, a timer, a test) act on a training.

Pausing: the training thread waits in :class:`PauseController`; other threads resume it, ask it
to pause or detach it. Changes: every other change from another thread (a rule edited or added,
a recheck, the UI going away) is a job for the training thread, run by :class:`ControlPlane` at
the training's next hook or phase boundary, or at once while it is paused; so nothing the
training thread is reading changes under it.

The training thread calls :meth:`PauseController.block` where it stops and
:meth:`PauseController.wants_pause` at step boundaries; everything else is called from other
threads. While paused, other threads can run work on the training thread with
:meth:`PauseController.run_on_training_thread` (slices and statistics of retained tensors are
computed there, where the tensors and their CUDA stream live).
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from tensordbg.hit import Hit

T = TypeVar("T")

RUNNING, PAUSED, DETACHED = "running", "paused", "detached"
# How the training goes on after a resume: to the next new origin hit, to any next hit, or for a
# number of steps.
CONTINUE, NEXT, STEP = "continue", "next", "step"


class NotPaused(RuntimeError):
    """Work that needs the training thread was asked for while the training runs."""


class PauseController:
    """Whether the training runs or waits, and what it waits for.

    >>> session = tensordbg.attach(model, on_hit="pause")
    >>> # from another thread, once a hit paused the training:
    >>> session.controller.resume()          # like pdb's c
    >>> session.controller.resume("step", 3) # run three more training steps, then pause
    """

    def __init__(self, training_thread: threading.Thread | None = None) -> None:
        self.training_thread = training_thread or threading.current_thread()
        """The thread that pauses (the one that attached)."""
        self._cond = threading.Condition()
        self._jobs: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self.state = RUNNING
        self.mode = CONTINUE
        self.steps_left = 0
        self.pause_requested = False
        self.paused_at: Hit | None = None
        self._resumed_from: tuple[str, int, str] | None = None  # (rule, step, phase) left by c
        self.reason = ""
        self.listeners: list[Callable[[str], None]] = []

    # --- training thread -----------------------------------------------------------------

    def should_pause(self, hit: Hit, repeated: bool) -> bool:
        """Whether this hit pauses the training: in ``continue`` mode a new origin hit does (one
        that also fired on the same tensor in the step before is a repeat, and one of the rule
        the training was paused on, in the same phase of the same step, is part of what was
        seen: a gradient explosion hits many parameters at once); in ``next`` mode any hit
        does."""
        if self.state == DETACHED:
            return False
        if self.mode == NEXT:
            return True
        if self._resumed_from == (hit.rule, hit.step, hit.phase):
            return False
        return hit.origin and not repeated

    def wants_pause(self, completed_step: bool) -> str | None:
        """At a step boundary (or a phase boundary with ``completed_step`` False): the reason to
        pause there, if any: a pause was asked for, or the steps to run are done."""
        with self._cond:
            if self.state == DETACHED:
                return None
            if self.pause_requested:
                return "paused on request"
            if completed_step and self.mode == STEP:
                self.steps_left -= 1
                if self.steps_left <= 0:
                    return "stepped"
        return None

    def block(self, reason: str, hit: Hit | None = None) -> None:
        """Wait until resumed (or detached), running the work other threads hand over meanwhile.
        (A UI that goes away resumes it through the session's own timer.)"""
        with self._cond:
            if self.state == DETACHED:
                return
            self.state, self.reason, self.paused_at = PAUSED, reason, hit
            self.pause_requested = False
        self._notify(PAUSED)
        try:
            self._serve_while_paused()
        except BaseException:  # Ctrl-C while paused: the training goes on up, as without us
            with self._cond:
                if self.state == PAUSED:
                    self.state = RUNNING
                self.paused_at = None
            self._fail_pending_jobs()
            self._notify(self.state)
            raise
        self._fail_pending_jobs()
        self._notify(self.state)

    def _serve_while_paused(self) -> None:
        while True:
            with self._cond:
                while self.state == PAUSED and not self._jobs:
                    self._cond.wait()
                if self.state != PAUSED:
                    self.paused_at = None
                    return
                fn, future = self._jobs.popleft()
            if future.set_running_or_notify_cancel():
                _run(fn, future)
            del fn, future  # a large reply is not kept alive once it is sent

    # --- other threads -------------------------------------------------------------------

    def resume(self, mode: str = CONTINUE, steps: int = 1) -> None:
        """Let the training go on: ``continue`` to the next new origin hit (see
        :meth:`should_pause`), ``next`` to any next hit, ``step`` for ``steps`` training
        steps."""
        if mode not in (CONTINUE, NEXT, STEP):
            raise ValueError(f"resume mode is continue, next or step, not {mode!r}")
        with self._cond:
            if self.state == DETACHED:
                return
            self.mode = mode
            hit = self.paused_at if self.state == PAUSED else None
            self._resumed_from = (hit.rule, hit.step, hit.phase) if hit else None
            self.steps_left = max(1, int(steps)) if mode == STEP else 0
            self.pause_requested = False
            was_paused = self.state == PAUSED
            self.state = RUNNING
            self._cond.notify_all()
        if not was_paused:
            self._notify(RUNNING)

    def request_pause(self) -> None:
        """Pause at the next place the training can stop (a hook or a phase boundary)."""
        with self._cond:
            if self.state == RUNNING:
                self.pause_requested = True

    def detach(self) -> None:
        """Stop pausing for good and let a waiting training go on."""
        with self._cond:
            was_paused = self.state == PAUSED
            self.state = DETACHED
            self.pause_requested = False
            self._cond.notify_all()
        if not was_paused:
            self._notify(DETACHED)

    def run_on_training_thread(self, fn: Callable[[], T], timeout: float = 60.0) -> T:
        """Run ``fn`` on the paused training thread and return its result.

        Raises :class:`NotPaused` when the training is not paused, so a request that needs
        tensors never races with the training.
        """
        if threading.current_thread() is self.training_thread:
            return fn()
        future: Future[T] = Future()
        with self._cond:
            if self.state != PAUSED:
                raise NotPaused("the training is running: pause it to inspect tensors")
            self._jobs.append((fn, future))
            self._cond.notify_all()
        return future.result(timeout=timeout)

    # --- internals -------------------------------------------------------------------------

    def _fail_pending_jobs(self) -> None:
        with self._cond:
            jobs, self._jobs = list(self._jobs), deque()
        for _, future in jobs:
            if future.set_running_or_notify_cancel():
                future.set_exception(NotPaused("the training resumed before this request ran"))

    def _notify(self, state: str) -> None:
        for listener in list(self.listeners):
            # A listener's fault must not stop the training.
            with contextlib.suppress(Exception):
                listener(state)


class ControlPlane:
    """Changes from other threads, applied on the training thread.

    >>> session.control.submit(lambda: session.ruleset.changed())   # from the server thread
    """

    def __init__(self, controller: PauseController):
        self.controller = controller
        self._jobs: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._lock = threading.Lock()
        self.direct = False
        """Set once the training is gone (detached): changes then apply at once."""

    @property
    def pending(self) -> bool:
        return bool(self._jobs)

    def submit(self, change: Callable[[], T]) -> Future[T]:
        """Run ``change`` on the training thread: now when called from it, when the training is
        detached, or while it is paused; else at its next boundary. The future holds the result
        (done at once in the first three cases)."""
        future: Future[T] = Future()
        controller = self.controller
        if self.direct or threading.current_thread() is controller.training_thread:
            _run(change, future)
            return future
        try:
            future.set_result(controller.run_on_training_thread(change))
            return future
        except NotPaused:
            pass
        except BaseException as e:
            future.set_exception(e)
            return future
        with self._lock:
            self._jobs.append((change, future))
        return future

    def apply(self) -> None:
        """On the training thread, at a boundary: run every queued change, in order."""
        while self._jobs:
            with self._lock:
                if not self._jobs:
                    return
                change, future = self._jobs.popleft()
            if future.set_running_or_notify_cancel():
                _run(change, future)

    def close(self) -> None:
        """The training is gone: queued changes run now, later ones at once."""
        self.direct = True
        self.apply()


def _run(change: Callable[[], T], future: Future[T]) -> None:
    """Run ``change`` and hand its result or error to whoever waits on ``future``. A Ctrl-C (or
    SystemExit) is told to the asker and then goes on up the training thread, as it would
    without tensordbg."""
    try:
        future.set_result(change())
    except (KeyboardInterrupt, SystemExit) as e:
        future.set_exception(NotPaused(f"the training was interrupted ({type(e).__name__})"))
        raise
    except BaseException as e:  # handed back to the thread that asked
        future.set_exception(e)
