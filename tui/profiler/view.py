"""The Profile tab: a status line (how far a profile has got, or how to get one) over seven
views of the latest profile report, F8 moving from one to the next.

It starts a profile (``profile(steps)``, the P key and the palette), follows it through the
``profile`` event, and fetches the report (``profile_report()``) when it is done, and once on
connecting (a recorded run serves the report it holds). Each view draws from that plain dict.
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.widget import Widget
from textual.widgets import Static, TabbedContent, TabPane

from tensordbg.tui.errors import reported, work
from tensordbg.tui.profiler.advisor import AdvisorPane
from tensordbg.tui.profiler.gpu import GpuPane
from tensordbg.tui.profiler.kernels import KernelsPane
from tensordbg.tui.profiler.memory import MemoryPane
from tensordbg.tui.profiler.operators import OperatorsPane
from tensordbg.tui.profiler.overview import OverviewPane
from tensordbg.tui.profiler.timeline import TimelineView
from tensordbg.tui.remote import OVER, RequestFailed, remote_of

DEFAULT_STEPS = 5
HOW = (
    "Press P to profile the next steps of this training (or from Python: "
    "session.profile(steps={n}); from the shell: tensordbg run --profile {n} train.py)."
)
RECORDED = (
    "This is a recorded run with no profile in it, and profiling needs a live training: "
    "profile it while it runs with P in the UI, session.profile(steps={n}) or "
    "tensordbg run --profile {n} train.py."
)
ENDED = (
    "The training has ended without a profile, and profiling needs a running training: next "
    "time, press P while it runs (or use session.profile(steps={n}), or "
    "tensordbg run --profile {n} train.py)."
)
PENDING = "This view fills once the next {n} steps are profiled (the line above says how far)."
CUT_OFF = "No profile reached this UI: the training ended first (the line above says more)."


class View(NamedTuple):
    key: str  # the view's pane is "profile-<key>-pane"
    title: str


VIEWS = (
    View("overview", "Overview"),
    View("operators", "Operators"),
    View("kernels", "Kernels"),
    View("memory", "Memory"),
    View("timeline", "Timeline"),
    View("gpu", "GPU"),
    View("advisor", "Advisor"),
)
"""The views in order: the sub-tabs, F8's cycle and the palette's entries come from here."""


class ProfilerView(Vertical, can_focus=True):
    """The latest profile report in seven views; focused, it hands the keys to the view on
    screen."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("f8", "next_view(1)", "Next view", key_display="F8"),  # as the tabs say it
        Binding("shift+f8", "next_view(-1)", "Previous view", show=False),
    ]

    def __init__(self) -> None:
        super().__init__(id="profiler-view")
        self.status = Static(id="profile-status")
        self.overview = OverviewPane()
        self.operators = OperatorsPane()
        self.kernels = KernelsPane()
        self.memory = MemoryPane()
        self.timeline = TimelineView()
        self.timeline_status = Static(id="timeline-status")
        # One row: a long span name ends in "…" rather than being cut mid-word.
        self.timeline_status.styles.text_wrap = "nowrap"
        self.timeline_status.styles.text_overflow = "ellipsis"
        self.gpu = GpuPane()
        self.advisor = AdvisorPane()
        self.report: dict[str, Any] | None = None
        self.progress: dict[str, Any] | None = None  # the latest ``profile`` event
        self.live = True  # the session can profile (a recorded run cannot)
        self._drawable = False  # set on mount: a report may arrive before the tab is mounted
        self._connect_pending = False
        self._empty: dict[str, Static] = {
            v.key: Static(classes="profile-empty") for v in VIEWS if v.key != "gpu"
        }

    def compose(self) -> ComposeResult:
        yield self.status
        content: dict[str, list[Widget]] = {
            "overview": [self.overview],
            "operators": [self.operators],
            "kernels": [self.kernels],
            "memory": [self.memory],
            "timeline": [self.timeline, self.timeline_status],
            "gpu": [self.gpu],
            "advisor": [self.advisor],
        }
        with TabbedContent(id="profile-views"):
            for view in VIEWS:
                with TabPane(view.title, id=f"profile-{view.key}-pane"):
                    if view.key in self._empty:
                        yield self._empty[view.key]
                    yield from content[view.key]

    def on_mount(self) -> None:
        self._drawable = True
        if self._connect_pending:
            self.connected()
        self._draw()

    # --- what the screen hands over ----------------------------------------------------------

    def connected(self) -> None:
        """A (re)connection: fetch the report the session holds, if any."""
        if not self._drawable:  # the tab mounts after the first screen: then
            self._connect_pending = True
            return
        self._connect_pending = False
        remote = remote_of(self)
        self.live = remote.serves("profile")
        if remote.serves("profile_report"):
            self.fetch_report()
        else:
            self._draw()

    def training_state(self) -> None:
        """The training's state changed: a profile in progress may have been cut off."""
        self._draw_status()

    def profile_event(self, event: dict[str, Any]) -> None:
        """The ``profile`` event: how far the profile has got."""
        self._progressed(event)
        if event.get("state") == "done":
            self.fetch_report()

    @property
    def under_way(self) -> bool:
        """Whether a profile is pending or running in a training that still runs (P waits)."""
        p = self.progress or {}
        return p.get("state") in ("pending", "running") and not self._ended

    @property
    def _ended(self) -> bool:
        return getattr(self.app, "state", "") in OVER

    def _progressed(self, progress: dict[str, Any]) -> None:
        self.progress = progress
        self._draw_status()
        self.app.refresh_bindings()  # P is offered again once the profile is over

    # --- requests ----------------------------------------------------------------------------

    @work(group="profile", exclusive=True)
    async def start(self, steps: int, record_shapes: bool = False) -> None:
        """Profile the next ``steps`` steps of the training (with input shapes: slower)."""
        remote = remote_of(self)
        if not remote.serves("profile"):
            self.notify(self.how_to_profile(), title="Cannot profile", severity="warning")
            return
        try:
            reply = await remote.profile(steps, record_shapes)
        except RequestFailed as e:
            self._progressed({"state": "failed", "step": 0, "steps": steps, "message": e.message})
            return
        self._progressed({"state": "pending", "step": 0, "steps": reply.get("steps", steps)})

    @work(group="profile-report", exclusive=True)
    async def fetch_report(self) -> None:
        try:
            report = await remote_of(self).profile_report()
        except RequestFailed:
            return  # the Log tab says why
        if report is not None:
            self.show_report(report)
        else:
            self._draw()

    # --- drawing -----------------------------------------------------------------------------

    @reported
    def show_report(self, report: dict[str, Any]) -> None:
        """Fill every view from ``report`` (the dict form of a ProfileReport)."""
        self.report = report
        self._draw()

    def _draw(self) -> None:
        if not self._drawable:
            return
        self._draw_status()
        report = self.report
        for note in self._empty.values():
            note.display = report is None
        for pane in (self.overview, self.operators, self.kernels, self.memory, self.advisor):
            pane.display = report is not None
        self.timeline.display = self.timeline_status.display = report is not None
        if report is None:
            return
        self.overview.show(report)
        self.operators.show(report)
        self.kernels.show(report)
        self.memory.show(report)
        self.timeline.show(report.get("timeline") or {})
        self.advisor.show(report)
        if self.screen.focused is self:  # the view had nothing to take the keys until now
            self.call_after_refresh(self.focus_view)

    def how_to_profile(self) -> str:
        return (HOW if self.live else RECORDED).format(n=DEFAULT_STEPS)

    def _draw_status(self) -> None:
        """The status line, and what the views say while there is no report: both say the
        state the profile and the training are in now."""
        if not self._drawable:
            return
        text = Text()
        p, report, ended = self.progress or {}, self.report, self._ended
        state = p.get("state")
        if state == "pending" and ended:
            text.append("The training ended before the profile started: ", style="bold")
            text.append("no step was profiled.")
        elif state == "running" and ended:
            text.append("The training ended while profiling: ", style="bold")
            text.append(
                "the steps it profiled are summarized where it runs (tensordbg run prints the "
                "report, and the trace is written); this UI no longer reaches it."
            )
        elif state == "pending":
            text.append(f"Profiling the next {p.get('steps', '?')} steps: ", style="bold")
            text.append("it starts at the next step boundary")
            if getattr(self.app, "state", "") == "paused":
                text.append(" (the training is paused: c continues it)")
            text.append(".")
        elif state == "running":
            text.append(f"Profiling {p.get('steps', '?')} steps", style="bold")
            text.append(f": {p['message']}…" if p.get("message") else "…")
        elif state in ("failed", "cancelled"):
            text.append(f"The profile {state}: ", style="bold red")
            text.append(str(p.get("message") or "no reason given"))
        elif report is not None:
            steps = report.get("steps") or []
            span = f"steps {steps[0]}–{steps[-1]}" if steps else "no steps"
            text.append(f"Profile of {span} on {report.get('device', '?')}", style="bold")
            if self.live and not ended:
                text.append("  ·  P profiles again", style="dim")
        else:  # each view below says how to get one: said once here would be said twice
            text.append("No profile yet.", style="bold")
        if report is not None and state in ("pending", "running", "failed", "cancelled"):
            text.append(" (the views show the previous profile)", style="dim")
        text.append("  ·  F8: next view", style="dim")
        self.status.update(text)
        nothing = self._nothing_yet()
        for note in self._empty.values():
            note.update(Text(nothing))

    def _nothing_yet(self) -> str:
        """What each view says while there is no report."""
        if self.live and self.under_way:
            return PENDING.format(n=(self.progress or {}).get("steps", "?"))
        if not (self.live and self._ended):
            return self.how_to_profile()
        cut_off = (self.progress or {}).get("state") in ("pending", "running")
        return CUT_OFF if cut_off else ENDED.format(n=DEFAULT_STEPS)

    # --- views and keys ----------------------------------------------------------------------

    @property
    def active_view(self) -> str:
        active = self.query_one("#profile-views", TabbedContent).active
        return active.removeprefix("profile-").removesuffix("-pane")

    def show_view(self, key: str) -> None:
        """Bring view ``key`` forward (``operators``...), with the keys in it."""
        self.query_one("#profile-views", TabbedContent).active = f"profile-{key}-pane"
        self.call_after_refresh(self.focus_view)

    def action_next_view(self, delta: int) -> None:
        keys = [v.key for v in VIEWS]
        self.show_view(keys[(keys.index(self.active_view) + delta) % len(keys)])

    def focus_view(self) -> None:
        """Give the keys to the view on screen."""
        targets: dict[str, Widget] = {
            "overview": self.overview,
            "operators": self.operators.table,
            "kernels": self.kernels.table,
            "memory": self.memory.table,
            "timeline": self.timeline,
            "gpu": self.gpu,
            "advisor": self.advisor,
        }
        target = targets[self.active_view]
        if target.display and target.focusable:
            target.focus()
        elif self.screen.focused is not self:  # no report to move in: F8 still works
            self.focus()

    def on_focus(self) -> None:
        self.call_after_refresh(self.focus_view)

    @on(TabbedContent.TabActivated, "#profile-views")
    def _view_activated(self, event: TabbedContent.TabActivated) -> None:
        event.stop()  # the screen's handler is for its own tabs

    @on(TimelineView.Pointed)
    def _pointed(self, message: TimelineView.Pointed) -> None:
        self.timeline_status.update(message.text)
