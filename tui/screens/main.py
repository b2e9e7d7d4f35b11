"""The main screen: a tab per question a person asks of a paused training.

It receives what the app learns (the hello reply, pushed events, state changes) and routes it to
the widgets; widgets ask for their own data through the app's typed client (``remote_of``) and
report back with messages. What routes the training's data survives its own errors (``reported``).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, NamedTuple

from textual import events, on
from textual.app import ComposeResult
from textual.css.query import NoMatches
from textual.screen import Screen
from textual.widget import Widget
from textual.widgets import DataTable, Header, Input, TabbedContent, TabPane, Tabs, Tree

from tensordbg.offline.sentences import plural
from tensordbg.sources.contract import Info, Welcome
from tensordbg.tui.components.connection_banner import ConnectionBanner
from tensordbg.tui.components.event_log import EventLog
from tensordbg.tui.components.heard_hits import HeardHits
from tensordbg.tui.components.hit_detail import HitDetail
from tensordbg.tui.components.hit_filter import HitFilter
from tensordbg.tui.components.hit_table import HitTable
from tensordbg.tui.components.key_footer import KeyFooter
from tensordbg.tui.components.later import Later
from tensordbg.tui.components.module_browser import ModuleBrowser
from tensordbg.tui.components.module_table import ModuleTable
from tensordbg.tui.components.provenance_view import ProvenanceView
from tensordbg.tui.components.rule_panel import RulePanel
from tensordbg.tui.components.run_status import RunStatus
from tensordbg.tui.components.tabs import Tabbed
from tensordbg.tui.components.tensor_grid import TensorGrid
from tensordbg.tui.components.tensor_inspector import TensorInspector
from tensordbg.tui.errors import reported, work
from tensordbg.tui.messages import HitsFound, OpenTensor
from tensordbg.tui.profiler.view import ProfilerView
from tensordbg.tui.remote import RequestFailed, remote_of, session_phrase, step_phrase


class Tab(NamedTuple):
    pane: str  # the TabPane's id
    title: str
    key: str  # switches to the tab, named in its title
    keys_to: type[Widget] | None  # the widget that gets the keys when the tab opens


TABS = (
    Tab("run", "Run", "f1", RunStatus),
    Tab("hits", "Hits", "f2", HitTable),
    Tab("modules", "Modules", "f3", ModuleTable),
    Tab("tensor", "Tensor", "f4", TensorGrid),
    Tab("provenance", "Provenance", "f5", Tree),
    Tab("rules", "Rules", "f6", DataTable),
    Tab("log", "Log", "f7", EventLog),
    Tab("profile", "Profile", "f8", ProfilerView),
)
"""The tabs in order: the app's keys, the tab titles, the palette's entries and the widget that
gets the keys on each tab all come from here."""
TAB_KEYS_WIDTH = 90  # the columns the tab bar needs to name every tab's key beside its title
CLOSE_TAB_KEYS_WIDTH = sum(len(f" {tab.title} {tab.key}") for tab in TABS) + 1
"""The columns it needs with one column between the tabs (78: an 80-column terminal)."""


# A running training that has sent nothing for this long is asked what it is doing: a rule that
# hangs (a slow custom check) holds the training, and the Run tab says which one.
QUIET_AFTER = 3.0


class MainScreen(Screen):
    """Run, Hits, Modules, Tensor, Provenance, Rules and Log tabs under one connection banner."""

    def __init__(self) -> None:
        super().__init__()
        # The screen keeps its widgets: data may arrive before a lazily mounted tab is mounted.
        self.banner = ConnectionBanner()
        self.run_status = RunStatus()
        self.hit_filter = HitFilter()
        self.hit_table = HitTable()
        self.hit_detail = HitDetail()
        self.module_browser = ModuleBrowser()
        self.tensor_inspector = TensorInspector()
        self.provenance_view = ProvenanceView()
        self.counted = HeardHits()  # the hits received, for the Rules and Modules tabs' counts
        self.rule_panel = RulePanel(self.counted)
        self.event_log = EventLog()
        self.profiler_view = ProfilerView()
        self._welcomed = False
        self._state = "connecting"
        self._count = 0
        self._step: int | None = None
        self._focus_switch: bool | None = None  # set by show_tab for the switch it makes
        self._replay_text = ""  # a recorded run: the dumped step shown, for the sub-title
        self._ended_by = ""  # how the training finished when not by itself (a Ctrl-C)
        self._heard = time.monotonic()  # when the training last sent an event
        self._sync = ""  # when the training measures its tensors: "eager", "batched", "deferred"

    def compose(self) -> ComposeResult:
        yield Header(icon="◆")
        yield self.banner
        # Tabs that open hidden are mounted after the first screen is up (a faster start).
        content: dict[str, list[Widget]] = {
            "run": [self.run_status],
            "hits": [self.hit_filter, self.hit_table, self.hit_detail],
            "modules": [Later(self.module_browser)],
            "tensor": [Later(self.tensor_inspector)],
            "provenance": [Later(self.provenance_view)],
            "rules": [Later(self.rule_panel)],
            "log": [Later(self.event_log)],
            "profile": [Later(self.profiler_view)],
        }
        with Tabbed(initial=TABS[0].pane):
            for tab in TABS:
                with TabPane(f"{tab.title} {tab.key.upper()}", id=tab.pane):
                    yield from content[tab.pane]
        yield KeyFooter()

    def on_resize(self, event: events.Resize) -> None:
        """Tab titles name their keys: at 80 columns the last tabs were cut off the bar, so
        there the tabs close up (``-close``: one column between them, not two) and keep their
        keys; a narrower terminal shows the titles alone (the keys are in the palette)."""
        width, tabs = event.size.width, self.query_one(TabbedContent)
        keyed = width >= CLOSE_TAB_KEYS_WIDTH
        tabs.set_class(keyed and width < TAB_KEYS_WIDTH, "-close")
        for tab in TABS:
            with contextlib.suppress(NoMatches):  # a tab not mounted yet keeps its title
                tabs.get_tab(tab.pane).label = tab.title + f" {tab.key.upper()}" * keyed

    # --- what the app hands over -------------------------------------------------------------

    @reported
    def load_welcome(self, welcome: Welcome) -> None:
        """A (re)connection: everything shown is re-read from the hello reply."""
        info, hits = welcome["info"], welcome["hits"]
        self.banner.clear()
        self.app.title = f"tensordbg · {info.get('script', '?')} · run {info.get('run_id', '?')}"
        self.sub_title = session_phrase(info)  # the header, after the state
        self.tensor_inspector.reconnected(info)  # another rank's (R): its tensor is not this one
        self._step = info.get("step")
        self._sync = info.get("sync", "")
        self._show_replay(info)
        self.run_status.show_info(info)
        table = self.hit_table
        table.set_hits(hits)
        self.counted.clear()
        self._count_hits(hits)
        pid = f", pid {info.get('pid')}" if info.get("live", True) else ""  # a replay has none
        where = step_phrase(str(info.get("state")), info.get("step"), info.get("phase", ""))
        self.log_entry(f"connected to {info.get('script')} (run {info.get('run_id')}, rank "
                       f"{info.get('rank')}{pid}): {info.get('state')} {where}, "
                       f"{plural(len(hits), 'hit')}")  # fmt: skip
        self._state = info.get("state", "running")
        self.app.state = self._state  # type: ignore[attr-defined]
        self.app.skippable = info.get("skippable", True)  # opened on a pause after the update
        self._explain_ranges()  # the same state as before may be another session's
        self._show_title()
        paused_at = info.get("paused_at")
        if not self._welcomed and paused_at:
            # Opened on a paused training: start where it paused, on the hit, ready for Enter.
            self.show_tab("hits")
            table.select_hit(paused_at["id"])
            table.focus()
        self._welcomed = True
        self.reload()
        self.profiler_view.connected()

    @reported
    def server_event(self, event: str, payload: Any) -> None:
        self._heard = time.monotonic()
        self.run_status.show_running_rule(None)
        if event == "state":  # logged with its phase, where its step's is known
            self.run_status.state_event(payload)
            payload = {**payload, "phase": self.run_status.phase}
        if event != "status":  # a line a step drowned the rest: the Run tab has the numbers
            self.event_log.write_event(event, payload)
        if event == "status":
            self.run_status.add_status(payload)
            self.rule_panel.training_moved()
            self._step = payload.get("step", self._step)
            self.module_browser.step_moved(self._step)
            self.call_after_refresh(self._show_title)  # with the Run tab's numbers, not before
            # Not its state: a (coalesced) status can come after the welcome or a state event.
        elif event == "hit":
            self.hit_table.merge([payload])
            self._count_hits([payload])
            self.run_status.add_hit(self.hit_table.known)
        elif event == "state":
            self._step = payload["step"]
            self.module_browser.step_moved(self._step)
            self._ended_by = payload.get("reason", "") if payload["state"] == "finished" else ""
            self.app.state = payload["state"]  # type: ignore[attr-defined]
            self.app.skippable = payload.get("skippable", True)  # no k after the step's updates
            if payload["state"] != "paused":  # the open tensor's phase is over
                self.tensor_inspector.moved_on("values as at the pause: the training went on")
            self._show_title()
        elif event == "profile":
            self.profiler_view.profile_event(payload)

    def show_replay_step(self, info: Info) -> None:
        """A recorded run moved to another dumped step (n / p): its tensors and statistics."""
        self._step = info["step"]  # its statistics are this step's, not an earlier one's
        self.run_status.show_info(info)
        self._show_replay(info)
        self.log_entry(f"replay: step {info['step']}")
        self.tensor_inspector.replay_moved(info["step"])
        self.reload()

    def _show_replay(self, info: Info) -> None:
        """The banner of a recorded run: which run, recorded when, which step, if readable."""
        replay = info.get("replay")
        if replay is None:
            self._replay_text = ""
            return
        recorded = f" recorded {replay['recorded']}" if replay["recorded"] else ""
        where = f"step {info['step']} ({replay['index'] + 1} of {replay['steps']} dumped)"
        text = f"Replay of run {info['run_id']} ({info['script']}){recorded} · {where}"
        if replay.get("stopped", not replay["complete"]):  # not a copy damaged since
            text += " · the run stopped before its dump was closed"
        lost = replay.get("lost", "")  # the dump's own damage: steps that cannot be listed
        if replay["broken"]:
            self.banner.show(f"{text} · this step is broken: {replay['broken']}", "lost")
        elif lost:  # the damage said, and still how to move
            self.banner.show(f"{text} · {lost} · n / p: next / previous dumped step", "lost")
        else:
            self.banner.show(f"{text} · n / p: next / previous dumped step", "replay")
        self._replay_text = f"step {info['step']} ({replay['index'] + 1}/{replay['steps']})"
        self._show_title()

    def show_state(self, state: str) -> None:
        """The training's state changed (the app's ``state`` reactive)."""
        before, self._state = self._state, state
        self.run_status.show_state(state)
        self.profiler_view.training_state()  # a profile under way may have been cut off
        self._explain_ranges()
        if state != "running":
            self.run_status.show_running_rule(None)
        self._heard = time.monotonic()
        self._show_title()
        if state == "paused" and before not in ("paused", "connecting", "disconnected"):
            self._refresh_paused()

    def _explain_ranges(self) -> None:
        """A running training in deferred mode measures no module's output (their ranges come
        when it pauses): the Modules tab says so rather than showing empty columns."""
        self.module_browser.show_unmeasured(
            self._state in ("running", "paused") and self._sync == "deferred"
        )

    def show_connect_failed(self, error: str) -> None:
        """An attempt to (re)connect failed; another follows."""
        self.log_entry(self.banner.connect_failed(error), "error")

    def show_connection_lost(self, reason: str, reconnecting: bool) -> None:
        self.log_entry(self.banner.connection_lost(reason, reconnecting), "error")

    def show_training_over(self) -> None:
        """The training said it ended (finished, or detached: it goes on unwatched) and its
        session closed the connection: the app stops there."""
        where = step_phrase(self._state, self._step, self.run_status.phase)
        self.log_entry(self.banner.over(self._state, where, self._ended_by), "error")

    def watch_exit(self, still_running: Any) -> None:
        """Detached: once its process is gone (a script detaches at its end), it has ended."""

        def check() -> None:
            if still_running() is False:
                timer.stop()
                self._ended_by = "its script detached tensordbg, then its process exited"
                self.app.state = "finished"  # type: ignore[attr-defined]
                self.show_training_over()

        if still_running is not None and self._state == "detached":
            timer = self.set_interval(1.0, check)

    def show_training_exited(self, reason: str) -> None:
        """The training's process is gone (``reason`` says so): the app stops reconnecting."""
        self.log_entry(self.banner.exited(reason), "error")

    def show_count(self, count: int) -> None:
        """The count typed before a key (``5s`` steps five times)."""
        self._count = count
        self._show_title()

    def _show_title(self) -> None:
        where = step_phrase(self._state, self._step, self.run_status.phase)
        step = "" if self._step is None else f" {where}"
        step = f" · {self._replay_text}" if self._replay_text else step  # a replay: which step
        count = f" · count {self._count}" if self._count else ""
        ended = f" · {self._ended_by}" if self._ended_by and self._state == "finished" else ""
        self.title = f"{self._state.upper()}{step}{ended}{count}"

    def hit_to_ignore(self) -> dict[str, Any] | None:
        """The hit ``i`` acts on: the one under the cursor on the Hits tab, else the hit the
        training is paused at."""
        if self.query_one(TabbedContent).active == "hits" and self.hit_table.current:
            return self.hit_table.current
        return self.run_status.paused_at

    def log_entry(self, text: str, level: str = "info") -> None:
        self.event_log.write_entry(text, level)

    # --- tabs --------------------------------------------------------------------------------

    def show_tab(self, pane: str, focus: bool = True, again: bool = False) -> None:
        """Switch to a tab and (unless ``focus`` is False) give its main widget the keys: a key
        press asked for the tab, so the next keys are for what is in it. ``again``: its key,
        pressed on it: F8 on the Profile tab moves to the next view wherever the keys are (the
        first F8 after the profile dialog only gave them to the view)."""
        tabs = self.query_one(TabbedContent)
        self._focus_switch = focus
        if tabs.active == pane:
            if again and pane == "profile":
                self.profiler_view.action_next_view(1)
            if focus:
                self._focus_tab(tabs.get_pane(pane))
            return
        # Keys leave the old tab first: a hidden focused widget hands the focus to its tab's.
        self.set_focus(None)
        tabs.active = pane
        target = self._focus_target(pane) if focus else None
        if target is not None and target.is_mounted:  # now: "F2 Enter" typed at once
            self.set_focus(target)

    def focus_search(self) -> None:
        """``/``: on the Hits tab, filter the hits; on the profile's operators, search them;
        elsewhere, search the model tree."""
        active = self.query_one(TabbedContent).active
        if active == "hits":
            self.hit_filter.open()
            return
        if active == "profile" and self.profiler_view.active_view == "operators":
            self.query_one("#profile-operators").action_search()  # type: ignore[attr-defined]
            return
        self.show_tab("modules", focus=False)
        self.module_browser.focus_search()

    def recheck(self) -> None:
        self.show_tab("rules")
        self.rule_panel.action_recheck()

    # --- data --------------------------------------------------------------------------------

    def _ask_if_quiet(self) -> None:
        """Every second: a running training silent for QUIET_AFTER seconds is asked whether a
        rule check holds it."""
        if self._state == "running" and time.monotonic() - self._heard > QUIET_AFTER:
            self._ask_running_rule()

    @work(group="quiet", exclusive=True)
    async def _ask_running_rule(self) -> None:
        try:
            info = await remote_of(self).info()
        except RequestFailed:
            return
        if info.get("state") == "running" and self._state == "running":
            self.run_status.show_running_rule(info.get("running_rule"))

    def _count_hits(self, hits: list[dict[str, Any]]) -> None:
        if self.counted.add(hits):
            self.rule_panel.hits_heard()
            self.module_browser.hits_heard(self.counted.by_module)

    @work(group="reload", exclusive=True)
    async def reload(self) -> None:
        await self._load_model()

    async def _load_model(self) -> None:
        """The model tree, the current phase's tensors and the rules."""
        remote = remote_of(self)
        try:
            modules = await remote.modules()
            self.module_browser.set_modules(modules, self._step)
            self.module_browser.hits_heard(self.counted.by_module)  # those since it was read
            tensors = await remote.tensors()
            self.module_browser.set_tensors(tensors)
            self.rule_panel.reload()
        except RequestFailed as e:
            self.log_entry(f"could not load the model: {e.message}", "error")

    @work(group="reload", exclusive=True)
    async def _refresh_paused(self) -> None:
        """Paused again: where and why, the hits since, and the new phase's tensors. Paused on
        a hit, the Hits tab comes forward with that hit under the cursor, as a debugger shows
        where it stopped (Enter opens its tensor); paused by p or after s, the tab stays."""
        remote = remote_of(self)
        try:
            info = await remote.info()
            self.run_status.show_info(info)
            self._step = info.get("step", self._step)
            self._show_title()
            table = self.hit_table
            hits = await remote.hits(since=table.next_id)
            table.merge(hits)
            self._count_hits(hits)
            if info.get("paused_at") and self.app.state == "paused":  # type: ignore[attr-defined]
                self.show_tab("hits")
                table.select_hit(info["paused_at"]["id"])
        except RequestFailed as e:
            self.log_entry(f"could not read the paused state: {e.message}", "error")
            return
        await self._load_model()

    # --- messages from the widgets -----------------------------------------------------------

    @on(OpenTensor)
    @reported
    def _open_tensor(self, message: OpenTensor) -> None:
        if not (self.tensor_inspector.is_mounted and self.provenance_view.is_mounted):
            self.call_after_refresh(self._open_tensor, message)  # its tab is still mounting
            return
        self.show_tab("tensor")
        self.tensor_inspector.open(message.ref, message.name, message.text, shown=self._step)
        self.provenance_view.load(message.ref, message.module, message.call, message.name)

    def _open_highlighted_hit(self) -> None:
        """F4 or F5 with no tensor open: the highlighted hit's, as Enter opens it."""
        hit = self.hit_table.current if self.hit_table.is_mounted else None
        if hit is None or self.tensor_inspector.ref is not None:
            return
        if not (self.tensor_inspector.is_mounted and self.provenance_view.is_mounted):
            self.call_after_refresh(self._open_highlighted_hit)  # its tab is still mounting
            return
        # Not focused: focusing the values from the Provenance tab switched to the Tensor tab.
        self.tensor_inspector.open(hit["ref"], hit["tensor"], "", False, hit["step"], self._step)
        self.provenance_view.load(hit["ref"], hit.get("module"), hit.get("call", 0), hit["tensor"])

    @on(Input.Changed, "#hit-filter")
    def _filter_hits(self, event: Input.Changed) -> None:
        self.hit_table.set_filter(event.value)

    @on(Input.Submitted, "#hit-filter")
    def _filter_done(self) -> None:
        self.hit_filter.action_leave()

    @on(HitTable.Highlighted)
    @reported
    def _hit_highlighted(self, message: HitTable.Highlighted) -> None:
        held = message.hit is not None and self.run_status.holds(message.hit)
        self.hit_detail.show(message.hit, self.hit_table.filtered_out, message.rules, held)

    @on(TabbedContent.TabActivated)
    def _tab_activated(self, event: TabbedContent.TabActivated) -> None:
        if event.pane.id in ("tensor", "provenance"):
            self._open_highlighted_hit()
        # Keys go to the tab's main widget, unless the person is moving along the tab bar (a
        # switch asked for by a key, show_tab, moves them anyway).
        asked, self._focus_switch = self._focus_switch, None
        if asked is False or event.pane.id is None:
            return
        if asked is None and isinstance(self.focused, Tabs):
            return
        self._focus_tab(event.pane)

    def _focus_tab(self, pane: Widget, tries: int = 10) -> None:
        """Focus a tab's main widget once it is mounted, unless the keys are already in the tab
        (focus moves later than asked: "[" may have sent them to the slice box) or another tab
        was asked for since (focusing would switch back: two late focuses did so for ever)."""

        def focus() -> None:
            nonlocal tries
            focused, active = self.focused, self.query_one(TabbedContent).active
            if active != pane.id or (focused is not None and pane in focused.ancestors):
                return
            target = self._focus_target(pane.id or "")
            if target is not None:
                target.focus()
            elif tries:  # the tab's content is still mounting (tabs mount lazily)
                tries -= 1
                self.call_after_refresh(focus)

        self.call_after_refresh(focus)

    def _focus_target(self, pane: str) -> Widget | None:
        target = next((tab.keys_to for tab in TABS if tab.pane == pane), None)
        if target is None:
            return None
        return next(iter(self.query_one(f"#{pane}").query(target)), None)

    def on_mount(self) -> None:
        self.set_interval(1.0, self._ask_if_quiet)

    def on_key(self, event: events.Key) -> None:
        # "/" is handled here, in order with the keys typed after it ("/late" typed fast): the
        # app's binding would see it only after they went by. Those keys reach the widget that
        # had the focus, which hands them on (tensordbg.tui.components.typed_ahead).
        searchable = not isinstance(self.focused, Input) and self.app.check_action("search", ())
        if event.key == "slash" and searchable:
            event.stop()
            event.prevent_default()
            self.focus_search()

    @on(HitsFound)
    @reported
    def _hits_found(self, message: HitsFound) -> None:
        self.hit_table.merge(message.hits)
        self._count_hits(message.hits)
