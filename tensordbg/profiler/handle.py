"""What :meth:`Session.profile` returns at once: a handle on the profile while the training
runs, and its report once the steps are done (:mod:`.capture` drives it)."""

from __future__ import annotations

import sys
import threading
from typing import Any

from tensordbg.profiler.report import TITLE, ProfileReport

CUT = "while profiling;"
"""The words of the line :meth:`ProfileHandle.say_at_exit` puts before a cut profile's report."""


class ProfileHandle:
    """A profile asked for: the next N steps are profiled while the training runs.

    >>> handle = session.profile(steps=5)
    >>> handle.report            # None until the steps are done and summarized
    >>> report = handle.wait(60) # from another thread, or after the training loop
    >>> print(report.text())
    """

    def __init__(self, steps: int, profiler: Any):
        self.steps = steps
        self.state = "pending"
        """``pending`` (waiting for a step boundary), ``running``, ``summarizing``, ``done``,
        ``failed`` or ``cancelled``."""
        self.message = ""
        self._report: ProfileReport | None = None
        self.torch_profile: Any = None
        """The ``torch.profiler.profile`` that recorded the steps, once they are done: for what
        the report leaves out (``key_averages(group_by_stack_n=5)``, ``export_stacks()``); its
        Chrome trace is already written (torch writes one once): ``report.trace``."""
        self._profiler = profiler
        self._finished = threading.Event()
        self._said = self._waited = False
        self.report_at_exit = False
        """Print the report at the program's exit if nobody read it (``say_at_exit``)."""
        self.cut_by = "the training ended"
        """What cut the profile short, when :attr:`message` says it was: the exit, or a
        detach (the training went on unwatched)."""

    @property
    def report(self) -> ProfileReport | None:
        """The report, once the steps are profiled and summarized; None before (and after a
        failure or a cancel). Once read, it is not printed again at the program's exit."""
        if self._report is not None:
            self._waited = True
        return self._report

    @report.setter
    def report(self, report: ProfileReport | None) -> None:
        self._report = report

    @property
    def done(self) -> bool:
        """Whether the profile is over (done, failed or cancelled)."""
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> ProfileReport | None:
        """Block until the report is ready (or ``timeout`` seconds pass); the report, or None.
        Call it from a thread other than the training's, or once the training loop is over
        (the steps are profiled by the training thread)."""
        self._waited = True
        self._finished.wait(timeout)
        return self._report

    def say_at_exit(self, who: str, timeout: float = 120) -> None:
        """Print on stderr, once, the report of a profile that the training's end or a detach
        cut short, still being summarized: the steps done, as ``--profile`` prints them. Whoever
        asked for it (the UI, gone with its connection; a script that did not wait) would
        otherwise lose it with the process. So too a report nobody waited for, when
        :attr:`report_at_exit` (a session of ``tensordbg.profile``: nothing else shows it).
        ``who`` begins the line: ``"tensordbg run"``."""
        summarizing = self.state == "summarizing"  # else lost with the process
        unread = self.report_at_exit and not self._waited and self.state in ("summarizing", "done")
        if not (summarizing or unread) or self._said:
            return
        self._said, cut = True, bool(self.message)  # a message says how many steps were done
        report = self.wait(timeout)
        if report is not None:
            if cut:
                print(f"{who}: {self.cut_by} {CUT} {self.message}", file=sys.stderr)
            print(report.text(), file=sys.stderr, flush=True)

    def cancel(self) -> None:
        """Stop profiling now, without a report; the training goes on. From another thread it is
        done by the training thread at its next hook (at once while paused)."""
        self._profiler.cancel(self)

    def __repr__(self) -> str:
        return f"<ProfileHandle {self.steps} steps, {self.state}>"


def report_last(output: str, lines: int = 8) -> list[str]:
    """The end of a process's output: its last ``lines`` before the report of a profile that
    its exit printed (:meth:`ProfileHandle.say_at_exit`), then that report whole (``tensordbg
    demo`` shows the end of its training's output: the report pushed the training's off it)."""
    said = output.strip().splitlines()
    starts = (i for i, line in enumerate(said) if line.startswith(TITLE) or CUT in line)
    report = next(starts, len(said))
    return said[:report][-lines:] + said[report:]
