"""The tensordbg terminal UI: the app, its keys, and its connection to the training.

>>> from tensordbg.transport.client import LocalClient
>>> TensorDbgApp(LocalClient(source)).run()

The app owns the connection (``_keep_connected``), the debugger's keys and the errors it survives
(``report_error``); the ``MainScreen`` lays out the tabs and routes data to the widgets.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Sequence
from typing import Any

from textual.app import SystemCommand
from textual.binding import Binding
from textual.notifications import Notification, Notify
from textual.reactive import reactive
from textual.screen import Screen

from tensordbg.sources.contract import SchemaError, Welcome
from tensordbg.tui import commands
from tensordbg.tui.commands import CONTROLS, ENDS_WITH_UI, detached, palette
from tensordbg.tui.errors import CrashFile, work
from tensordbg.tui.job import JobRanks
from tensordbg.tui.profiler.view import DEFAULT_STEPS
from tensordbg.tui.remote import (
    ENDED,
    OVER,
    ClientFactory,
    DebugClient,
    MalformedReply,
    Remote,
    RequestFailed,
    TrainingExited,
)
from tensordbg.tui.replay_moves import ReplayMoves
from tensordbg.tui.screens.main import TABS, MainScreen
from tensordbg.tui.screens.profile_steps import ProfileStepsScreen
from tensordbg.tui.screens.ranks import group_jobs
from tensordbg.tui.screens.session_picker import SessionPicker, session_field
from tensordbg.tui.step_count import StepCount

FINISHED_GRACE = 0.5
"""Seconds the events after "finished" are still read: the server can send the last status
behind it (the state events go first when they are posted while it is sending hits)."""
COUNTING = "Steps for the next s (5s: five steps)"


# Keys of the main screen (a dialog or the session list has its own keys only).
_MAIN_ACTIONS = frozenset({"control", "tab", "search", "detach", "ignore", "profile",
                           "ranks", "next_rank", "one_rank"})  # fmt: skip


class TensorDbgApp(JobRanks, ReplayMoves, StepCount):
    """The debugger UI on one training session.

    ``client`` is a connected client, or an async factory ``connect(path)`` that opens one (and
    opens it again after the connection drops). With several ``sessions`` to choose from, a
    picker comes first and its choice is handed to the factory.
    """

    CSS_PATH = "app.tcss"
    TITLE = "tensordbg"
    BINDINGS: list[Binding | tuple[str, str] | tuple[str, str, str]] = [  # noqa: RUF012
        # In the order the footer shows them: what a person needs first comes first, so that a
        # narrow terminal leaves out the rarer keys (the footer keeps c n s p q before the tab's
        # own keys: tensordbg.tui.components.key_footer).
        Binding("c", "control('continue')", "Continue"),
        Binding("n", "control('next')", "Next hit"),
        Binding("s", "control('step')", "Step"),
        Binding("p", "control('pause')", "Pause"),
        # A recorded run (tensordbg replay): n and p move between its dumped steps, and the
        # keys that drive a training say why they do nothing (see check_action).
        Binding("n", "replay_step(1)", "Next dumped step"),
        Binding("p", "replay_step(-1)", "Previous dumped step"),
        Binding("q", "detach", "Detach & quit"),
        Binding("q", "leave", "Quit"),  # nothing to detach from (see nothing_to_detach)
        # Textual's ctrl+q, which said "Quit": it does what q does, and the keys panel says so.
        Binding("ctrl+q", "detach", "Detach & quit", show=False, priority=True),
        Binding("ctrl+q", "leave", "Quit", show=False, priority=True),
        Binding("ctrl+q", "quit", "Quit as q does", show=False, priority=True),  # on a dialog
        Binding("slash", "search", "Search"),
        Binding("P", "profile", "Profile"),
        Binding("k", "control('skip')", "Skip"),
        Binding("k", "refuse_skip", "Skip (too late: says why)", show=False),
        Binding("i", "ignore", "Ignore rule"),
        # A session that cannot do what a key asks (a recorded run) says why (see check_action).
        Binding(
            "c,s,k", "refuse('control')", "Continue, step, skip (not here: says why)", show=False
        ),
        Binding("i", "refuse('set_rule')", "Ignore rule (not here: says why)", show=False),
        Binding("P", "refuse('profile')", "Profile (not here: says why)", show=False),
        Binding("question_mark", "show_help_panel", "Keys", show=False),
        Binding("escape", "hide_help_panel", "Close the keys panel", show=False),
        Binding("escape", "forget_count", "Forget the count", show=False),
        Binding("f9", "ranks", "Ranks", show=False),
        Binding("R", "next_rank", "Next rank", show=False),
        Binding("R,f9", "one_rank", show=False, system=True),  # says why they show nothing
        # A count before a key: one row of the keys panel, 0-9 (ten bare digits were listed).
        Binding("0", "count(0)", COUNTING, show=False, key_display="0-9"),
        *(Binding(str(d), f"count({d})", show=False, system=True) for d in range(1, 10)),
        # One key per tab, named in the tab titles.
        *(Binding(tab.key, f"tab('{tab.pane}')", tab.title, show=False) for tab in TABS),
    ]

    state: reactive[str] = reactive("connecting", bindings=True, init=False)
    """``connecting``, ``running``, ``paused``, ``detached``, ``finished`` or ``disconnected``."""

    def __init__(
        self,
        client: DebugClient | ClientFactory,
        *,
        sessions: Sequence[Any] = (),
        reconnect_delay: float = 1.0,
        crash_file: CrashFile | None = None,
        ends_training: bool = False,
    ) -> None:
        super().__init__()
        self.ends_training = ends_training
        """The training ends when this UI quits (``tensordbg demo``'s): q quits, it does not
        detach, for the training would not go on unwatched."""
        self.exited = False
        """The training's session is gone, though it never said it ended (its process died)."""
        self._client: DebugClient | None = None
        self._connect: ClientFactory | None = None
        if isinstance(client, DebugClient):
            self._client = client
        else:
            self._connect = client
        self._sessions = list(sessions)
        self._reconnect_delay = reconnect_delay
        self._lost = asyncio.Event()
        self._lost_reason = ""
        self.farewell = ""  # what run_tui prints once the UI is gone (q detached from a training)
        self.remote = Remote(self._connection_lost, self._request_refused, self.report_error)
        """The typed client widgets ask through (``remote_of(widget).stats(...)``)."""
        self.crash_file = crash_file or CrashFile()
        """Where the details of the errors the UI survived go; ``run_tui`` prints its path."""
        self.main = MainScreen()
        self.info: dict[str, Any] = {}
        """The session's info from its hello reply (which run, which rank)."""
        self._switch_path: str | None = None
        self._of_this_pause: list[Notification] = []  # see notify_of_pause
        self.ignoring: set[tuple[Any, ...]] = set()  # what i made rules ignore (commands.py)
        self.skippable = True  # whether k can drop the paused step's update (main.py sets it)
        self.skip_asked = False  # k was pressed at this pause: the footer offers it no more

    def get_default_screen(self) -> Screen:
        return self.main

    def on_ready(self) -> None:
        # Ready: the main screen is composed and on screen, so the widgets can be fed.
        self._sessions = group_jobs(self._sessions)  # a torchrun job is one entry
        if len(self._sessions) > 1:
            self.push_screen(SessionPicker(self._sessions), self._keep_connected)
        else:
            path = session_field(self._sessions[0], "path") if self._sessions else None
            self._keep_connected(path)

    def _request_refused(self, method: str, message: str) -> None:
        self.main.log_entry(f"{method} failed: {message}", "error")

    # --- errors ------------------------------------------------------------------------------

    def report_error(self, error: BaseException, where: str, details: str = "") -> None:
        """An error the UI survives (a widget's bug, a malformed reply or event), the one place
        they are handled: a line in the Log tab, a notification, and the details in the crash
        file. Workers (``tensordbg.tui.errors.work``) and handlers (``reported``) end here."""
        path = self.crash_file.write(error, where, details)
        saved = f"details in {path}" if path else "no crash file could be written"
        what = f"{where}: {type(error).__name__}: {error}"
        self.main.log_entry(f"error in {what} ({saved})", "error")
        self.notify(
            f"{what}\nThe debugger goes on; {saved}.",
            title="tensordbg hit an error",
            severity="error",
            timeout=10,
            markup=False,
        )

    def served(self, method: str) -> bool:
        """Whether the session serves ``method``; when it does not (a recorded run cannot be
        driven), the person is told why, in a notification and the Log tab."""
        if self.remote.serves(method):
            return True
        why = self.remote.refusal(method)
        self.notify(why, title="Not in this session", severity="warning", markup=False)
        self.main.log_entry(why, "warning")
        return False

    # --- connection ------------------------------------------------------------------------

    @work(group="connection", exclusive=True)
    async def _keep_connected(self, path: str | None) -> None:
        """Connect, serve events until the connection drops, then reconnect in the background;
        every (re)connection re-reads the whole state from the hello reply."""
        client, self._client = self._client, None
        while True:
            if client is None:
                if self._connect is None:
                    return
                self.main.banner.connecting()
                try:
                    client = await self._connect(path)
                except TrainingExited as e:
                    if path is not None and not self.info:  # listed, and gone before it opened
                        self._ended_before_opened(str(e))
                        return
                    finished = self.state == "finished"  # it said so: not "exited or goes on"
                    why = str(e).replace(ENDED, "its training finished") if finished else str(e)
                    self.main.show_training_exited(why)
                    self.exited = True  # q quits: there is nothing left to detach
                    self.refresh_bindings()
                    return
                except Exception as e:
                    self.main.show_connect_failed(str(e) or type(e).__name__)
                    await asyncio.sleep(self._reconnect_delay)
                    continue
            self._lost.clear()
            try:
                welcome = self.remote.connect(client)
            except MalformedReply as e:  # reported: a training the UI cannot read
                with contextlib.suppress(Exception):
                    await client.close()
                client = None
                self.main.show_connect_failed(e.message)
                if self._connect is None:
                    return
                await asyncio.sleep(self._reconnect_delay)
                continue
            self._greeted(welcome)
            reason = await self._serve_events(client)
            self.remote.client = None
            with contextlib.suppress(Exception):
                await client.close()
            client = None
            if self._switch_path is not None:  # another rank of the job: connect to it now
                path, self._switch_path = self._switch_path, None
                continue
            if self.state in OVER:  # it said it ended: nothing is left to reconnect to
                self.main.show_training_over()
                self.main.watch_exit(getattr(self._connect, "still_running", None))
                return
            self.main.show_connection_lost(reason, reconnecting=self._connect is not None)
            self.state = "disconnected"
            if self._connect is None:
                return
            await asyncio.sleep(self._reconnect_delay)

    def _ended_before_opened(self, why: str) -> None:
        """The session chosen from the list ended before the UI reached it: as for a training
        named on the command line that has exited, one line on stderr and exit code 2, not a
        UI with nothing to show that waits for q."""
        self.farewell = f"tensordbg tui: {why}"
        self.exit(return_code=2)

    def _greeted(self, welcome: Welcome) -> None:
        before, info = self.info, dict(welcome["info"])
        self.info = info
        self.crash_file.session = (
            f"run {info['run_id']} of {info['script']} (rank {info['rank']}, pid {info['pid']}, "
            f"torch {info['torch']}, {'live' if info['live'] else 'recorded'}, serves "
            f"{', '.join(info['capabilities'])})"
        )
        self.main.load_welcome(welcome)
        self.said_rank_shown(before)

    async def _serve_events(self, client: DebugClient) -> str:
        """Hand pushed events to the screen until the connection drops; returns why it did. A
        malformed event is reported and skipped: the connection stays."""

        async def pump() -> str:
            try:
                async for event, payload in client.events():
                    self._route_event(event, payload)
            except Exception as e:
                return str(e) or type(e).__name__
            return "the training closed the connection"

        events = asyncio.ensure_future(pump())
        lost = asyncio.ensure_future(self._lost.wait())
        try:
            await asyncio.wait((events, lost), return_when=asyncio.FIRST_COMPLETED)
        finally:
            events.cancel()
            lost.cancel()
        return self._lost_reason if lost.done() and not lost.cancelled() else events.result()

    def _route_event(self, event: str, payload: Any) -> None:
        try:
            payload = self.remote.event(event, payload)
        except SchemaError as e:
            self.report_error(e, f"the {event!r} event", f"payload: {payload!r}"[:4000])
            return
        self.main.server_event(event, payload)
        if event == "state" and payload.get("state") in OVER:
            # The session's last word (it finished, or was detached): its server stops now.
            # What it sent just before may still come (the status of the last step): read on
            # for a moment.
            client = self.remote.client
            self.set_timer(FINISHED_GRACE, lambda: self._finished(client))

    def _finished(self, client: DebugClient | None) -> None:
        if self.remote.client is client:  # still the connection to the session that ended
            self._connection_lost("the training ended")

    def _connection_lost(self, reason: str) -> None:
        self._lost_reason = reason
        self._lost.set()

    def watch_state(self, state: str) -> None:
        self.main.show_state(state)
        if state != "paused":
            self.skip_asked = False  # the next pause is another one
            for note in self._of_this_pause:  # Textual has no public way to close one toast
                if note in self._notifications:
                    self._unnotify(note)
            self._of_this_pause.clear()

    def notify_of_pause(self, message: str, title: str) -> None:
        """A notification about the pause the training is in, closed when that pause ends: "the
        update of step 5 will be skipped ... c continues" stayed on after c, beside a header
        that already said PAUSED at step 6. Said of a pause already over, it is not shown."""
        if self.state != "paused":
            return
        note = Notification(message, title, timeout=self.NOTIFICATION_TIMEOUT)
        self._of_this_pause.append(note)
        self.post_message(Notify(note))

    # --- keys ------------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "hide_help_panel":  # escape, only while the keys panel is open
            return bool(self.screen.query("HelpPanel"))
        if action == "quit":  # the main screen's ctrl+q is detach or leave, named as q's
            return self.screen is not self.main
        if action == "leave":
            return self.screen is self.main and self.nothing_to_detach()
        if action == "refuse_skip":  # paused after the update: k says why it cannot skip
            return self.screen is self.main and self.state == "paused" and not self.skippable
        if action == "replay_step":
            return self.screen is self.main and self.remote.serves("goto")
        if action == "refuse":  # the key's own action is not offered: it cannot be done here
            return self.screen is self.main and not self.remote.serves(str(parameters[0]))
        if action == "detach" and self.screen is self.main and self.nothing_to_detach():
            return False  # q is "Quit" (leave)
        if action in _MAIN_ACTIONS:
            if self.screen is not self.main:  # a dialog or the session list: its keys only
                return False
            if action == "ignore":
                return self.can_ignore()
            if action in ("ranks", "next_rank"):  # listed in the keys panel for a job only
                return int(self.info.get("world_size", 1)) > 1
            if action == "one_rank":  # once a session is reached: says it has one rank
                return bool(self.info) and int(self.info.get("world_size", 1)) < 2
            if action in ("tab", "search", "detach"):
                return True
            if action == "profile":
                return self.can_profile()
            gone = parameters[0] == "skip" and (not self.skippable or self.skip_asked)
            return not gone and parameters[0] in CONTROLS.get(self.state, ())
        return super().check_action(action, parameters)  # the count's keys (StepCount)

    def nothing_to_detach(self) -> bool:
        """Whether q only quits: a recorded run, a training that is over, or one that ends
        with the UI."""
        return (self.remote.serves("goto") or self.state in OVER or self.ends_training
                or self.exited)  # fmt: skip

    def can_ignore(self) -> bool:
        """Whether ``i`` has a hit to act on: the one the training is paused at, or the one
        chosen and not ignored yet (asked by the footer and the palette alike)."""
        hit = self.main.hit_to_ignore()
        return self.state == "paused" and hit is not None and not commands.ignored(self, hit)

    def can_profile(self) -> bool:
        """Whether ``P`` has a training to profile (or to say why it cannot be), with no profile
        under way in it."""
        return self.state in ("running", "paused") and not self.main.profiler_view.under_way

    def action_control(self, action: str) -> None:
        n = self.take_count(action)  # 5s steps five times; 5k skips one update
        if self.served("control"):  # else the person is told why the key does nothing
            self._control(action, n)

    def action_refuse_skip(self) -> None:
        why = commands.cannot_skip(self.main.run_status.paused_at)
        self.notify(why, title="Cannot skip", severity="warning", markup=False)
        self.main.log_entry(f"k: {why}", "warning")

    def action_refuse(self, method: str) -> None:
        self.served(method)  # a recorded run: the person is told why the key does nothing

    @work(group="control", exclusive=True)
    async def _control(self, action: str, n: int) -> None:
        try:
            reply = await self.remote.control(action, n)
        except RequestFailed:
            return  # the Log tab says why
        # The state itself comes from the state events, which arrive in order: this reply may
        # be older than them (the training resumed and hit again before the reply was sent).
        self.main.log_entry(f"control {action} (n={n}): {reply['state']} at step {reply['step']}")
        if action == "skip":  # nothing else changes on screen: the training stays paused
            self.skip_asked = True
            self.refresh_bindings()
            said = reply.get("skipped") or (
                f"The update of step {reply['step']} will be skipped: its gradients are dropped, "
                "the weights and the optimizer state stay as they are."
            )
            self.notify_of_pause(f"{said} c continues.", title="Skip")

    def action_ignore(self) -> None:
        hit = self.main.hit_to_ignore()
        if hit is not None and self.served("set_rule"):
            self.main.rule_panel.ignore(hit, self.main.hit_table.rules_of(hit))
            commands.ignored(self, hit, now=True)  # the footer offers i no more for it

    def action_tab(self, pane: str) -> None:
        self.main.show_tab(pane, again=True)  # a tab's key on its own tab may do more (F8)

    def action_search(self) -> None:
        self.main.focus_search()

    def action_detach(self) -> None:
        self._detach_and_exit()

    def action_leave(self) -> None:
        self._detach_and_exit()  # with nothing to detach from, it only closes

    def action_profile(self) -> None:
        """Ask how many steps, then profile them (the Profile tab follows it)."""
        view = self.main.profiler_view
        if not self.remote.serves("profile"):
            self.notify(view.how_to_profile(), title="Cannot profile", severity="warning")
            self.main.show_tab("profile")
            return

        def chosen(choice: tuple[int, bool] | None) -> None:
            if choice is not None:
                self.main.show_tab("profile")
                view.start(*choice)

        self.push_screen(ProfileStepsScreen(DEFAULT_STEPS), chosen)

    def action_help_quit(self) -> None:
        """Ctrl-C (Textual binds it to this): say what quitting does to the training."""
        if self.ends_training and self.state in ("running", "paused"):
            what = f"q quits, and {ENDS_WITH_UI}"
        elif self.remote.serves("control") and self.state in ("running", "paused"):
            what = f"q detaches the debugger and quits: {detached(self.info)}"
        else:
            what = "q quits"
        self.notify(f"Ctrl-C does not quit the UI: {what}.", title="Quit?", markup=False)

    async def action_quit(self) -> None:
        # Every way out (ctrl+q, the palette) detaches as q does: a paused training would
        # otherwise wait for a UI that is gone.
        self.action_detach()

    @work(group="control", exclusive=True)
    async def _detach_and_exit(self) -> None:
        """Quit, letting the training run on: the debugger detaches first (unless the training
        ends with the UI: it would say it goes on unwatched, and then stop)."""
        can_detach = self.remote.serves("control") and self.state in ("running", "paused")
        can_detach = can_detach and not self.ends_training
        if self.remote.client is not None and can_detach:
            with contextlib.suppress(RequestFailed):  # quit anyway: a lost client detaches too
                await self.remote.control("detach")
            # Said in the terminal once the UI is gone (it quit without a word).
            run = f"run {self.info.get('run_id')} ({self.info.get('script')})"
            self.farewell = f"tensordbg tui: detached from {run}; {detached(self.info)}"
        client, self.remote.client = self.remote.client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await client.close()
        self.exit(0)

    def show_profile_view(self, view: str) -> None:
        self.main.show_tab("profile", focus=False)
        profiler = self.main.profiler_view
        if profiler.is_mounted:
            profiler.show_view(view)
        else:  # its tab is still mounting
            self.call_after_refresh(self.show_profile_view, view)

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        # Textual's own "Quit" is "Detach and quit" here, offered once under the clearer title.
        own = (c for c in super().get_system_commands(screen) if c.callback != self.action_quit)
        yield from palette(self, screen, own)
