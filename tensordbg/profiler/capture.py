"""Capture: ``torch.profiler`` around the next N steps of a watched training.

The session's bus says where steps end (``step_end``), when the training pauses on a hit and
resumes, and when it is detached; the profiler follows those, on the training thread:

- ``session.profile(steps=N)`` returns a :class:`ProfileHandle` at once. From another thread (the
  UI's server) the start goes through the control plane, so it runs on the training thread.
- At the next step boundary (at once when no step has begun yet, or between steps) the profiler
  starts: one warm-up step, then N recorded steps (``torch.profiler.schedule(warmup=1,
  active=N)``; its ``ProfilerStep#k`` ranges are the steps).
- While it runs, named ranges mark ``tensordbg: forward`` (the root module's call),
  ``tensordbg: backward`` (``torch.autograd.backward``) and ``tensordbg: optimizer`` (from the
  optimizer's step pre-hook to the step's end); the DataLoader's own
  ``enumerate(DataLoader)#...__next__`` ranges mark loading. A pause on a hit is marked
  ``tensordbg: paused`` and left out of the steps.
- After the last step the hooks go, the profiler stops, and a background thread writes the gzip
  Chrome trace and summarizes (:mod:`.summary`) and advises (:mod:`.advisor`); the ``profile``
  event on the bus says when the report is ready. A detach (or the program's end) while
  profiling stops the profiler and removes every hook; the steps already recorded are still
  summarized.
"""

from __future__ import annotations

import atexit
import contextlib
import getpass
import os
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, schedule

from tensordbg.engine.handles import HandleGroup
from tensordbg.engine.marks import outside, profiling
from tensordbg.engine.records import CHECKS
from tensordbg.profiler.handle import ProfileHandle
from tensordbg.profiler.report import ProfileReport

MAX_STEPS = 1000
KINETO_QUIET = "6"  # above Kineto's levels (VERBOSE 0 to USDT 5): none of its log lines
FORWARD, BACKWARD, OPTIMIZER, PAUSED = (
    "tensordbg: forward",
    "tensordbg: backward",
    "tensordbg: optimizer",
    "tensordbg: paused",
)


class ProfileError(RuntimeError):
    """A profile that cannot start; the message says why and what to do."""


def profiler_of(session: Any) -> Profiler:
    """The session's profiler, made on first use (it then follows the session's bus)."""
    profiler = session.__dict__.get("_profiler")
    if profiler is None:
        profiler = session._profiler = Profiler(session)
    return profiler


class Profiler:
    """Profiles a session's steps on request; one profile at a time."""

    def __init__(self, session: Any):
        self.session = session
        self.latest: ProfileReport | None = None
        """The last finished report."""
        self.handle: ProfileHandle | None = None
        """The last profile asked for."""
        self._run: _Run | None = None
        self._lock = threading.Lock()
        self._unsubscribe = session.bus.subscribe(
            self._on_event, events={"step_end", "pause", "resume", "detach"}
        )

    # --- any thread ----------------------------------------------------------------------------

    def start(
        self,
        steps: int = 5,
        *,
        record_shapes: bool = False,
        profile_memory: bool = True,
        with_flops: bool = True,
        with_stack: bool = False,
        directory: str | os.PathLike[str] | None = None,
    ) -> ProfileHandle:
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
            raise ProfileError(
                f"steps is a number of training steps from 1 to {MAX_STEPS}, not {steps!r}"
            )
        session = self.session
        if session.detached:
            raise ProfileError("this session is detached: attach again to profile")
        with self._lock:
            if self._run is not None and not self._run.handle.done:
                running = self._run.handle
                raise ProfileError(
                    f"a profile of {running.steps} steps is {running.state}: wait for it "
                    "(handle.wait()) or cancel it (handle.cancel()) first"
                )
            handle = ProfileHandle(steps, self)
            options = {
                "record_shapes": record_shapes,
                "profile_memory": profile_memory,
                "with_flops": with_flops,
                "with_stack": with_stack,
            }
            run = _Run(handle, options, _directory(session, directory))
            run.rules = len(session.rules)  # none: tensordbg.profile's session (the advice)
            run.sync = session.mode
            self._run, self.handle = run, handle
        session.control.submit(lambda: self._arm(run))
        return handle

    def cancel(self, handle: ProfileHandle) -> None:
        run = self._run
        if run is None or run.handle is not handle or handle.done:
            return
        self.session.control.submit(lambda: self._end(run, "cancelled", "cancelled"))

    # --- the training thread -------------------------------------------------------------------

    def _arm(self, run: _Run) -> None:
        if run.handle.done or run is not self._run:
            return
        if _between_steps(self.session):
            self._begin(run)
        else:
            run.state = "armed"

    def _on_event(self, event: str, payload: Any) -> None:
        run = self._run
        if run is None or run.handle.done:
            return
        if event == "step_end":
            self._step_end(run, payload)
        elif event == "pause" and run.profiler is not None:
            run.open_range(PAUSED)
        elif event == "resume" and run.profiler is not None:
            run.close_range(PAUSED)
        elif event == "detach":
            if run.state in ("warmup", "active") and run.completed:
                self._end(
                    run,
                    "done",
                    f"{len(run.completed)} of its {run.handle.steps} steps "
                    f"{'was' if len(run.completed) == 1 else 'were'} profiled",
                )
                self._report_at_exit(run.handle)
            else:
                self._end(
                    run,
                    "cancelled",
                    "the training ended or was detached before a step was profiled",
                )

    def _report_at_exit(self, handle: ProfileHandle) -> None:
        """A detach cut the profile short: the session whose UI or exit would have shown its
        report is gone, so it is printed at the program's exit unless the script reads it
        first (``handle.wait()``, ``handle.report``). The trace is written then at the latest."""
        if not self.session._exiting:
            handle.cut_by = "detached"
        handle.report_at_exit = True
        atexit.register(handle.say_at_exit, "tensordbg")

    def _step_end(self, run: _Run, payload: Any) -> None:
        with outside():  # the step ends inside tensordbg's hook: not inside its range
            self._end_of_step(run, payload)

    def _end_of_step(self, run: _Run, payload: Any) -> None:
        if run.state == "armed":
            self._begin(run)
            return
        if run.state not in ("warmup", "active") or run.profiler is None:
            return
        run.close_range(OPTIMIZER)
        if run.state == "warmup":
            run.state = "active"
            run.clock = (time.perf_counter(), time.process_time())
        else:
            run.completed.append(int(payload["step"]))
        try:
            run.profiler.step()
        except Exception as e:
            self._end(run, "failed", f"torch.profiler failed: {e}")
            return
        if len(run.completed) >= run.handle.steps:
            self._end(run, "done", "")

    def _begin(self, run: _Run) -> None:
        session = self.session
        model = session.model
        if model is None or session.detached:
            self._end(run, "cancelled", "the model is gone")
            return
        cuda = session.device.type == "cuda" and torch.cuda.is_available()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        try:
            profiler = torch.profiler.profile(
                activities=activities,
                schedule=schedule(wait=0, warmup=1, active=run.handle.steps, repeat=1),
                **run.options,
            )
            run.install(model, list(session.optimizers))
            run.cuda = cuda
            if cuda:
                run.device_index = session.device.index or 0
                _memory_history(True)
            # Kineto's own "USDT: ... profiler_start" and "profiler_stop" lines on stderr, at
            # every start and stop, said nothing to a person (a user's own setting wins). It reads
            # this when it first starts, so it holds for the process.
            os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_QUIET)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "memory allocated before profiling started"
                profiler.start()
        except Exception as e:
            self._end(
                run,
                "failed",
                f"torch.profiler did not start ({e}); is another profiler running in this process?",
            )
            return
        run.profiler = profiler
        run.state = "warmup"
        run.thread_id = threading.get_native_id()
        run.handle.state = "running"
        run.first_step = session.step + 1
        self._tell(
            run,
            "running",
            f"profiling steps {session.step + 1}..{session.step + run.handle.steps} "
            f"after the warm-up step {session.step}",
        )

    def _end(self, run: _Run, state: str, message: str) -> None:
        """Stop profiling (hooks, ranges, the profiler), then summarize on a background thread
        when ``state`` is done."""
        if run.handle.done or run.state == "ended":
            return
        was = run.state
        run.state = "ended"
        run.close_all()
        run.handles.close()
        profiler, run.profiler = run.profiler, None
        snapshot = None
        if profiler is not None:
            with contextlib.suppress(Exception), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                profiler.stop()
            if run.cuda:
                snapshot = _memory_history(False, run.directory / "memory-snapshot.pickle")
        if state != "done" or profiler is None or was not in ("warmup", "active"):
            self._finish(run, None, "cancelled" if state == "done" else state, message)
            return
        run.handle.state, run.handle.message = "summarizing", message  # message: cut short
        run.handle.torch_profile = profiler
        run.wall = time.perf_counter() - run.clock[0] if run.clock else 0.0
        run.cpu = time.process_time() - run.clock[1] if run.clock else 0.0
        worker = threading.Thread(
            target=self._summarize,
            args=(run, profiler, snapshot, message),
            name="tensordbg-profile-summary",
            daemon=True,
        )
        try:
            worker.start()
        except RuntimeError:  # at the interpreter's exit (3.12 starts no thread then): here
            self._summarize(run, profiler, snapshot, message)

    # --- the summary thread --------------------------------------------------------------------

    def _summarize(self, run: _Run, profiler: Any, snapshot: str | None, message: str) -> None:
        from tensordbg.profiler.advisor import advise
        from tensordbg.profiler.summary import summarize
        from tensordbg.profiler.trace import Capture

        try:
            capture = Capture.from_profiler(
                profiler,
                directory=run.directory,
                device=str(self.session.device) if run.cuda else "cpu",
                steps=run.completed,
                main_thread=run.thread_id,
                record_shapes=bool(run.options["record_shapes"]),
                host=_host(run),
                memory_limit=_memory_limit(run),
            )
            report = summarize(capture)
            report.memory_snapshot = snapshot
            report.message = message
            report.advice = advise(report)
        except Exception as e:
            self._finish(run, None, "failed", f"the profile could not be summarized: {e}")
            return
        self._finish(run, report, "done", message)

    def _finish(self, run: _Run, report: ProfileReport | None, state: str, message: str) -> None:
        handle = run.handle
        handle.report, handle.state, handle.message = report, state, message
        if report is not None:
            self.latest = report
            where = f"; trace: {report.trace}" if report.trace else ""
            message = message or f"{len(report.steps)} steps profiled{where}"
        self._tell(run, state, message)
        handle._finished.set()

    def _tell(self, run: _Run, state: str, message: str) -> None:
        session = self.session
        payload = {
            "state": state,
            "step": int(session.step),
            "steps": run.handle.steps,
            "message": message,
        }
        session.bus.publish("profile", payload)
        if message:
            session.log(f"profile {state}: {message}", "error" if state == "failed" else "info")


class _Run:
    """One profile in progress: its handle, options, hooks and open ranges."""

    def __init__(self, handle: ProfileHandle, options: dict[str, Any], directory: Path):
        self.handle = handle
        self.options = options
        self.directory = directory
        self.state = "pending"  # armed, warmup, active, ended
        self.profiler: Any = None
        self.handles = HandleGroup()
        self.completed: list[int] = []
        self.first_step = 0
        self.cuda = False
        self.device_index = 0
        self.thread_id = 0
        self.rules = -1  # the session's rules as the profile began
        self.sync = ""  # and its sync mode
        self.clock: tuple[float, float] | None = None
        self.wall = self.cpu = 0.0
        self._open: dict[str, Any] = {}
        self._depth = 0

    def open_range(self, name: str) -> None:
        if name not in self._open:
            self._open[name] = torch.ops.profiler._record_function_enter_new(name, None)

    def close_range(self, name: str) -> None:
        handle = self._open.pop(name, None)
        if handle is not None:
            torch.ops.profiler._record_function_exit._RecordFunction(handle)

    def close_all(self) -> None:
        for name in list(self._open)[::-1]:
            self.close_range(name)

    def install(self, model: torch.nn.Module, optimizers: list[Any]) -> None:
        """The hooks that mark forward, backward and the optimizer, in this run's handle group
        (closed when the run ends, whatever way it ends)."""
        handles = self.handles
        # First, before tensordbg's own pre-hook: the work it does as a forward begins is the
        # forward's, not "other" (which the advice blames on the training loop).
        handles.add(model.register_forward_pre_hook(self._forward_enter, prepend=True))
        handles.add(model.register_forward_hook(self._forward_exit, always_call=True))
        for optimizer in optimizers:
            handles.add(optimizer.register_step_pre_hook(self._optimizer_enter))
        original = torch.autograd.backward
        run = self

        def backward(*args: Any, **kwargs: Any) -> Any:
            if run.state not in ("warmup", "active"):
                return original(*args, **kwargs)
            with torch.autograd.profiler.record_function(BACKWARD):
                return original(*args, **kwargs)

        handles.patch(torch.autograd, "backward", backward)
        handles.callback(self.close_all, "profiler ranges")
        handles.callback(profiling(), "tensordbg's hooks marked in the profile")

    def _forward_enter(self, module: Any, args: Any) -> None:
        self._depth += 1
        if self._depth == 1:
            self.open_range(FORWARD)

    def _forward_exit(self, module: Any, args: Any, output: Any) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth == 0:
            self.close_range(FORWARD)

    def _optimizer_enter(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.open_range(OPTIMIZER)


def _between_steps(session: Any) -> bool:
    """Whether the training thread is between steps now: before the first one, or after an
    optimizer step and before the next forward (so the profile can start at once)."""
    if threading.current_thread() is not session.controller.training_thread:
        return False
    if getattr(session, "_root_forwards", 1) == 0:
        return True
    stepping = getattr(session, "_stepping", None)
    between = session.phase in ("optimizer", *CHECKS)  # after a step's update, or a check then
    return bool(session.optimizers) and between and not stepping


def _directory(session: Any, directory: str | os.PathLike[str] | None) -> Path:
    """Where the trace goes: the directory asked for, the session's dump directory, else
    ``<tmp>/tensordbg-<user>/<run id>``."""
    dumps = getattr(session, "dumps", None)  # attach(dump_dir=...): its writer's folder
    chosen = directory or getattr(getattr(dumps, "writer", None), "root", None)
    if chosen is None:
        try:
            user = getpass.getuser()
        except Exception:
            user = str(os.getuid()) if hasattr(os, "getuid") else "user"
        chosen = Path(tempfile.gettempdir()) / f"tensordbg-{user}" / str(session.run_id)
    path = Path(chosen)
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def _host(run: _Run) -> dict[str, Any]:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "cores": cores,
        "cpu_utilization": run.cpu / run.wall if run.wall > 0 else None,
        "rules": run.rules,
        "sync": run.sync,
    }


def _memory_limit(run: _Run) -> int | None:
    if not run.cuda:
        return None
    try:
        return int(torch.cuda.get_device_properties(run.device_index).total_memory)
    except Exception:
        return None


def _memory_history(start: bool, path: Path | None = None, memory: Any = None) -> str | None:
    """CUDA: record the allocator's history while profiling; at the end dump the snapshot that
    pytorch.org/memory_viz opens (torch writes a pickle; tensordbg never reads it) and stop.
    Returns the snapshot's path, or None when it could not be written."""
    memory = memory if memory is not None else torch.cuda.memory
    try:
        if start:
            memory._record_memory_history(max_entries=100_000)
            return None
        written = None
        if path is not None:
            memory._dump_snapshot(str(path))
            written = str(path)
        memory._record_memory_history(enabled=None)
        return written
    except Exception:  # an older driver or build without history: the report says nothing
        with contextlib.suppress(Exception):
            memory._record_memory_history(enabled=None)
        return None
