"""The Rules tab: the session's rules, toggled with space, thresholds edited with e, new rules
added with a, and the current step judged again with r."""

from __future__ import annotations

import fnmatch
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.widgets import DataTable, Static

from tensordbg.sources.contract import Rule
from tensordbg.statistics.registry import KINDS
from tensordbg.tui.components.heard_hits import HeardHits
from tensordbg.tui.components.table import Table
from tensordbg.tui.errors import work
from tensordbg.tui.messages import HitsFound
from tensordbg.tui.remote import Remote, RequestFailed, remote_of
from tensordbg.tui.screens.rule_add import RuleAddScreen
from tensordbg.tui.screens.rule_edit import RuleEditScreen

# Which rules actions the training can take in which state: a recheck judges the paused step on
# the training thread; rules change from the server's thread while the training runs too.
ACTIONS = {"paused": ("toggle", "edit", "add", "recheck"), "running": ("toggle", "edit", "add")}


def thresholds(params: dict[str, Any]) -> str:
    """The thresholds that are set (a TensorRange's unset bounds would push the columns after
    it off the screen; the edit dialog lists them all)."""
    return "  ".join(f"{k}={v!r}" for k, v in params.items() if v is not None) or "–"


def kinds(names: list[str]) -> str:
    """``all``, ``all but update``, or the kinds of tensor a rule watches: the full list of
    seven takes the width the other columns need."""
    missing = sorted(set(KINDS) - set(names))
    if not missing:
        return "all"
    if len(missing) <= 2:
        return f"all but {', '.join(missing)}"
    return ", ".join(names)


class RulePanel(Vertical):
    """A table of rules and a line for what the last action found."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("space", "toggle", "Toggle"),
        Binding("e", "edit", "Edit"),
        Binding("a", "add", "Add"),
        Binding("r", "recheck", "Recheck"),
        # A recorded run serves none of them: the keys say why rather than do nothing.
        Binding("space,e,a", "refuse('set_rule')", show=False),
        Binding("r", "refuse('recheck')", show=False),
    ]

    def __init__(self, heard: HeardHits) -> None:
        super().__init__(id="rule-panel")
        self._drawable = False  # set on mount; is_mounted is still False in on_mount
        self._rules: list[dict[str, Any]] = []
        # Changes the training has accepted but not made yet (it makes them at its next hook:
        # a training held by a slow rule makes them once that check returns), by rule id.
        self._pending: dict[int, dict[str, Any]] = {}
        self._waiting = ""  # the change the note says waits for the training, if any
        self._available: list[dict[str, Any]] = []
        self.heard = heard  # the hits the UI received (the Modules tab counts them too)
        self._redraw_due = False
        self.table: DataTable[Any] = Table(id="rule-table", cursor_type="row")
        # The highlighted rule's selection in full: the table's "match" column is cut on a
        # narrow terminal ("* !bl…"), and the exclusions i adds were unreadable there.
        self.selection = Static("", id="rule-selection")
        self.result = Static("", id="rule-result")

    def compose(self) -> ComposeResult:
        yield self.table
        yield self.selection
        yield self.result

    @on(DataTable.RowHighlighted)
    def _highlighted(self) -> None:
        rule = self.current
        if rule is None:
            self.selection.update("")
            return
        text = Text(f"{rule['name']}: ", style="bold")
        text.append(f"on {', '.join(rule.get('match') or ['*'])}")
        if rule.get("exclude"):
            text.append(f", except {', '.join(rule['exclude'])}")
        self.selection.update(text)

    def on_mount(self) -> None:
        self._drawable = True
        # The short and telling columns first: what is cut on a narrow terminal is the tail.
        self.table.add_columns(
            "on", "rule", "hits", "disabled because", "thresholds", "match", "kinds"
        )
        self._draw()

    @property
    def current(self) -> dict[str, Any] | None:
        if not self._rules or self.table.cursor_row >= len(self._rules):
            return None
        return self._rules[self.table.cursor_row]

    @work(group="rules", exclusive=True)
    async def reload(self) -> None:
        try:
            reply = await remote_of(self).rules()
        except RequestFailed as e:
            self._say(f"Could not read the rules: {e.message}", error=True)
            return
        rules, self._available = reply["rules"], reply["available"]
        for i, rule in enumerate(rules):
            pending = self._pending.get(rule["id"])
            if pending is None:
                continue
            if _same(rule, pending):
                del self._pending[rule["id"]]  # made
            else:
                rules[i] = pending  # shown as it will be, marked as waiting for the training
        self._rules = rules
        if self._waiting and not self._pending:  # the note said it was waiting: no more
            self._say(f"{self._waiting}: made.")
            self._waiting = ""
        self._draw()

    def hits_heard(self) -> None:
        """More hits were counted (:attr:`heard`): the counts are drawn at most twice a second
        (a flood of hits must not redraw the table for each)."""
        if self._drawable and not self._redraw_due:  # not mounted yet: drawn when it is
            self._redraw_due = True
            self.set_timer(0.5, self._redraw_counts)

    def _redraw_counts(self) -> None:
        self._redraw_due = False
        self._draw()

    def _hits_of(self, rule: dict[str, Any]) -> int:
        """The rule's hits: as the training last said, or as many as the UI received since
        (by name: when two rules share a name, only the training can tell them apart)."""
        said = rule.get("hits", 0)
        if sum(r["name"] == rule["name"] for r in self._rules) > 1:
            return said
        return max(said, self.heard.by_rule.get(rule["name"], 0))

    def training_moved(self) -> None:
        """The training spoke (a step's status): changes waiting for it are made by now."""
        if self._pending:
            self.reload()

    def _draw(self) -> None:
        if not self._drawable:  # data can arrive before the widget is mounted
            return
        table = self.table
        row = table.cursor_row
        table.clear()
        for rule in self._rules:
            on = Text("✓", style="bold green") if rule["enabled"] else Text("✗", style="bold red")
            if rule["id"] in self._pending:
                on.append(" (next hook)", style="yellow")
            table.add_row(
                on,
                Text(rule["name"], style="bold" if rule["enabled"] else "dim"),
                str(self._hits_of(rule)),  # before the long columns: seen on a narrow terminal
                Text(rule.get("disabled_reason") or "", style="yellow"),
                Text(thresholds(rule.get("params") or {})),
                Text(  # not a string: DataTable reads it as markup ("x[ab]" loses "[ab]")
                    ", ".join(rule.get("match") or [])
                    + "".join(f" !{x}" for x in rule.get("exclude") or [])
                ),
                kinds(rule.get("kinds") or []),
                key=str(rule["id"]),
            )
        table.move_cursor(row=min(row, max(len(self._rules) - 1, 0)))

    @work(group="rules-ignore", exclusive=True)
    async def ignore(self, hit: dict[str, Any], rules_of_row: list[str] | None = None) -> None:
        """Like pdb's ``ignore``: the hit's rule stops judging the hit's tensor (its exclude
        list gains the tensor's name), so ``c`` no longer stops on it; the table shows the
        exclusion, and editing the rule can take it back. ``rules_of_row``: every rule that
        found what the hit says (a row of the Hits tab that names two), each made to ignore it."""
        remote = remote_of(self)
        try:
            rules = (await remote.rules())["rules"]
        except RequestFailed:
            return  # the Log tab says why
        names = rules_of_row or [hit["rule"]]
        found = [r for r in (_rule_of(dict(hit, rule=name), rules) for name in names) if r]
        if not found:
            self.app.notify(f"No rule {hit['rule']!r} judges {hit['tensor']} now.", markup=False)
            return
        for rule in found:
            exclude = [*rule.get("exclude", []), hit["tensor"]]
            try:
                await remote.set_rule(rule["id"], params={"exclude": exclude})
            except RequestFailed:
                return
        who = " and ".join(r["name"] for r in found)
        verb = "ignore" if len(found) > 1 else "ignores"
        said = f"{who} now {verb} {hit['tensor']}; c continues without stopping there"
        self._say(said)
        self.app.notify(said, title="Rule changed", markup=False)
        self.reload()

    def _say(self, text: str, error: bool = False) -> None:
        self.result.update(Text(text, style="bold red" if error else ""))

    # --- actions -----------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in ACTIONS["paused"]:  # the footer shows only what the state allows
            return action in ACTIONS.get(self.app.state, ())  # type: ignore[attr-defined]
        if action == "refuse":
            return not self.app.remote.serves(str(parameters[0]))  # type: ignore[attr-defined]
        return True

    def action_refuse(self, method: str) -> None:
        self._served(method)  # the person is told why

    def _served(self, method: str) -> bool:
        """Whether the session serves ``method``; if not, the person is told why."""
        return bool(self.app.served(method))  # type: ignore[attr-defined]

    def action_toggle(self) -> None:
        rule = self.current
        if rule is not None and self._served("set_rule"):
            enabled = not rule["enabled"]
            self._change(
                f"{rule['name']} {'on' if enabled else 'off'}",
                lambda remote: remote.set_rule(rule["id"], enabled=enabled),
            )

    @on(DataTable.RowSelected)
    def _selected(self) -> None:
        if self.check_action("edit", ()):  # Enter on a row is e
            self.action_edit()

    def action_edit(self) -> None:
        rule = self.current
        if rule is None or not self._served("set_rule"):
            return

        def edited(reply: Rule | None) -> None:
            if reply is not None:
                now = thresholds(reply.get("params") or {})
                self._made(f"{rule['name']} thresholds changed: {now}", reply)

        async def send(params: dict[str, Any]) -> Rule:
            return await remote_of(self).set_rule(rule["id"], params=params)

        self.app.push_screen(RuleEditScreen(rule, send), edited)

    def action_add(self) -> None:
        if not self._served("add_rule"):
            return
        if not self._available:
            self._say("No rules are available to add.", error=True)
            return

        def added(reply: Rule | None) -> None:
            if reply is not None:
                self._made(f"{reply['name']} added on {', '.join(reply['match'])}", reply)

        async def send(spec: dict[str, Any]) -> Rule:
            return await remote_of(self).add_rule(spec["name"], spec["match"], spec["params"])

        self.app.push_screen(RuleAddScreen(self._available, send), added)

    @work(group="rule-change")
    async def _change(self, what: str, request: Callable[[Remote], Awaitable[Rule]]) -> None:
        """Send a change of the rules (``request`` makes it), then show them as they are."""
        try:
            reply = await request(remote_of(self))
        except RequestFailed as e:
            self._say(f"{what}: refused: {e.message}", error=True)
            return
        self._made(what, reply)

    def _made(self, what: str, reply: Rule) -> None:
        """The training took a change: the rules are shown as they are (or will be)."""
        if reply.get("pending"):
            self._pending[reply["id"]] = dict(reply)
            self._waiting = what
            self._say(f"{what}: made when the training reaches its next hook.")
        else:
            self._say(f"{what}.")
        self.app.main.log_entry(f"rules: {what}")  # type: ignore[attr-defined]
        self.reload()

    @work(group="rule-change")
    async def action_recheck(self) -> None:
        if not self._served("recheck"):
            return
        self._say("Judging the current step again…")
        try:
            reply = await remote_of(self).recheck()
        except RequestFailed as e:
            self._say(f"Recheck refused: {e.message}", error=True)
            return
        hits, unjudged, at = reply["hits"], reply["unjudged"], reply["at"]
        if hits:
            lines = [f"Recheck of {at} found {len(hits)} hit{'s' if len(hits) > 1 else ''}:"]
            lines += [f"  [{h['rule']}] {h['tensor']}: {h['message']}" for h in hits]
        elif not unjudged:
            lines = [f"Recheck of {at}: no new hit with the rules as they are now (what was "
                     "found before stays in the Hits tab; a rule on another phase's tensors "
                     "judges them when the training gets there)."]  # fmt: skip
        else:
            lines = [f"Recheck of {at}: no new hit among the tensors it could judge."]
        if unjudged:  # a rule added while paused wants statistics that were never measured
            lines.append(f"{unjudged} tensor{'s' if unjudged > 1 else ''} could not be judged "
                         f"(never measured, no longer held): {reply['why']}")  # fmt: skip
        self._say("\n".join(lines))
        if hits:
            self.post_message(HitsFound(hits))
        self.reload()


def _rule_of(hit: dict[str, Any], rules: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The rule that made ``hit``: of the enabled rules with its name, the first whose
    patterns select its tensor."""
    named = [r for r in rules if r["name"] == hit["rule"] and r.get("enabled", True)]
    name = hit["tensor"]
    for rule in named:
        selected = any(fnmatch.fnmatchcase(name, p) for p in rule.get("match", ["*"]))
        if selected and not any(fnmatch.fnmatchcase(name, p) for p in rule.get("exclude", [])):
            return rule
    return named[0] if named else None


def _same(rule: dict[str, Any], pending: dict[str, Any]) -> bool:
    """Whether the training has made a pending change: the rule reads as the reply said."""
    keys = ("enabled", "params", "match", "exclude")
    return all(rule.get(k) == pending.get(k) for k in keys)
