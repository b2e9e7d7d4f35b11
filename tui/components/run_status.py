"""The Run tab: is the training running or paused (and why), its step, loss, gradient norm and
speed, with loss and gradient-norm sparklines from ``info()["history"]`` and ``status`` events."""

from __future__ import annotations

import math
import time
from itertools import pairwise
from typing import Any

from rich.cells import cell_len
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Label, Static

from tensordbg.offline.sentences import step_runs
from tensordbg.tui.components.step_sparkline import FLAT, StepSparkline, finite, flat
from tensordbg.tui.errors import work
from tensordbg.tui.remote import OVER, RequestFailed, remote_of, step_phrase

HISTORY = 500  # steps kept for the sparklines
GAP = 3  # cells between two of the Run tab's numbers
FILL_EVERY = 0.5  # seconds at least between requests for the steps status events left out
SERIES = ("step", "loss", "grad_norm", "steps_per_sec")
STATE_STYLES = {
    "paused": "bold black on yellow",
    "running": "bold black on green",
    "disconnected": "bold white on red",
    "finished": "bold white on blue",
    "detached": "bold white on blue",
}


class RunStatus(VerticalScroll):
    """Live status of the training; keeps the last known values when the connection drops."""

    def __init__(self) -> None:
        super().__init__(id="run-status")
        self._drawable = False  # set on mount; is_mounted is still False in on_mount
        self._draw_due = False
        self._info: dict[str, Any] = {}
        self._history: dict[str, list[Any]] = {k: [] for k in SERIES}
        self._state = "connecting"
        self._last_connected_state = ""
        self._fill_due = False  # the steps status events left out are asked for
        self._filled_at = 0.0  # when they were last (time.monotonic())
        self._filled_to: int | None = None  # the last step of the history that came then
        # Steps missing up to here are lost: the training's history, read since, lacked them
        # (or could not be read). Those after it are on their way, and not called lost.
        self._lost_to: int | None = None

    def compose(self) -> ComposeResult:
        yield Static(id="run-state")
        yield Static(id="run-numbers")
        yield Label("Loss", id="loss-label", classes="spark-label")
        yield StepSparkline(id="loss-spark")
        yield Label("Gradient norm", id="grad-label", classes="spark-label")
        yield StepSparkline(id="grad-spark")
        yield Static(id="run-session")

    def on_mount(self) -> None:
        self._drawable = True
        if self._unsettled():  # steps left out before the widget could ask for them
            self._ask_for_missed()
        self._draw_now()

    def show_info(self, info: dict[str, Any]) -> None:
        self._info = dict(info)
        history = info.get("history") or {}
        self._history = {k: list(history.get(k, []))[-HISTORY:] for k in SERIES}
        self._lost_to = self._history["step"][-1] if self._history["step"] else None
        self._state = info.get("state", self._state)
        self._draw_now()

    def add_status(self, status: dict[str, Any]) -> None:
        """A ``status`` event: one more step's numbers."""
        if "phase" in status and self._state not in OVER:  # its end said where it ended
            self._info["phase"] = status["phase"]
        if "hits_total" in status:  # hits pushed since the status was sent are counted already
            self._info["hits_total"] = max(status["hits_total"], self._info.get("hits_total", 0))
        if "step" in status:
            self._info["step"] = status["step"]
        last = status.get("last")
        if last:
            self._add_step(last)
        self._draw()

    def _add_step(self, last: dict[str, Any]) -> None:
        """The step just completed: one more row of the history. Status events reach the UI
        ten a second at most, the latest winning: a step beyond the one after the last row
        says that steps were left out, and they are asked for. A step before the last row is
        old news (its status crossed the reply that brought the history)."""
        steps, step = self._history["step"], last["step"]
        if steps and step < steps[-1]:
            return
        if steps and step == steps[-1]:  # a second status for the same step completes it
            for key in SERIES[1:]:
                if last.get(key) is not None:
                    self._history[key][-1] = last[key]
            return
        if step > (steps[-1] + 1 if steps else 0):
            self._ask_for_missed()
        for key in SERIES:
            self._history[key].append(last.get(key))
            del self._history[key][:-HISTORY]

    def _ask_for_missed(self) -> None:
        """Ask the training for its history, FILL_EVERY seconds after the last time at the
        soonest: once for however many steps are missed meanwhile."""
        if self._fill_due or not self._drawable:
            return
        self._fill_due = True
        self.set_timer(max(0.01, self._filled_at + FILL_EVERY - time.monotonic()), self._fill)

    @work(group="run-history")
    async def _fill(self) -> None:
        """The steps status events left out, from the training's history. Asked again when
        steps are still missing and the history has grown since the last time (a status may
        have crossed the reply)."""
        try:
            info = await remote_of(self).info()
        except RequestFailed:  # the connection is down: the info of the next one has every step
            self._settle()
            return
        finally:
            self._fill_due, self._filled_at = False, time.monotonic()
        if not self._same_run(info):
            return
        end, before = self._merge_history(info.get("history") or {}), self._filled_to
        self._filled_to = end
        if end is not None and end != before and _missing(self._history["step"]):
            self._lost_to = max(end, self._lost_to if self._lost_to is not None else end)
            self._ask_for_missed()
        else:
            self._settle()
        self._draw()

    def _settle(self) -> None:
        """Nothing more will be asked for: the steps still missing are lost."""
        steps = self._history["step"]
        self._lost_to = steps[-1] if steps else None
        self._draw()

    def _unsettled(self) -> bool:
        """Whether steps are missing that were not asked for yet."""
        lost_to = self._lost_to if self._lost_to is not None else -1
        return any(b - a > 1 and a >= lost_to for a, b in pairwise(self._history["step"]))

    def _same_run(self, info: dict[str, Any]) -> bool:
        return all(info.get(k) == self._info.get(k) for k in ("run_id", "rank"))

    def _merge_history(self, history: dict[str, list[Any]]) -> int | None:
        """Take the training's ``history``, followed by the rows shown of the steps after its
        last (status events that crossed the reply bringing it); returns that last step."""
        taken = {k: list(history.get(k, [])) for k in SERIES}
        if not taken["step"]:
            return None
        end = taken["step"][-1]
        later = [i for i, s in enumerate(self._history["step"]) if s > end]
        for key in SERIES:
            rows = self._history[key]
            self._history[key] = (taken[key] + [rows[i] for i in later])[-HISTORY:]
        return end

    def add_hit(self, known: int) -> None:
        """A ``hit`` event; ``known`` is how many hits the Hits tab holds: the count shown is
        never below it, and the same whatever order hits and status events arrive in (adding
        one a hit event counted some twice)."""
        self._info["hits_total"] = max(self._info.get("hits_total", 0), known)
        self._draw()

    @property
    def phase(self) -> str:
        """The phase the training is in, or ended in ("" between two steps)."""
        return str(self._info.get("phase") or "")

    def holds(self, hit: dict[str, Any]) -> bool:
        """Whether ``hit``'s tensor can be read now: the training is paused in the hit's step
        and phase (it holds that phase's tensors), or the run is a recording (its dump serves
        every hit's tensor, whichever step is shown)."""
        now = (self._info.get("step"), self.phase)
        paused = self._state == "paused" and (hit["step"], hit["phase"]) == now
        return paused or self._recorded

    @property
    def paused_at(self) -> dict[str, Any] | None:
        """The hit the training is paused at, when it is paused at one."""
        return self._info.get("paused_at") if self._state == "paused" else None

    def state_event(self, event: dict[str, Any]) -> None:
        """A ``state`` event: the training's state, step and (paused) reason, now. What an
        earlier pause said (its hit, "stepped") is gone with it; the info request that
        follows a pause brings the new hit. An event that does not say the phase leaves the
        one known of its step (a detach sends the state first without it); of another step,
        the phase is not known."""
        if "phase" in event or event["step"] != self._info.get("step"):
            self._info["phase"] = event.get("phase", "")
        self._info["step"] = event["step"]
        said = event["state"] in ("paused", "finished")  # why it paused, how it finished
        self._info["pause_reason"] = event.get("reason", "") if said else ""
        self._info["paused_at"] = None
        if "unwatched" in event:  # tensordbg stopped watching; the state may be the same
            self._info["unwatched"] = event["unwatched"]
            self._draw()

    def show_running_rule(self, running: dict[str, Any] | None) -> None:
        """What the training, silent for a while, is doing: a rule check under way (None: it
        is not in one, or it spoke since)."""
        if running == self._info.get("running_rule"):
            return
        self._info["running_rule"] = running
        self._draw()

    def show_state(self, state: str) -> None:
        if state != "disconnected":
            self._last_connected_state = state
        elif self._state != "disconnected":
            self._last_connected_state = self._state
        self._state = state
        self._draw_now()

    # --- drawing -----------------------------------------------------------------------------

    def _draw(self) -> None:
        """Draw after the next refresh, once however many events asked until then: a flood of
        hits and status events would otherwise lay out the whole tab for each."""
        if self._drawable and not self._draw_due:
            self._draw_due = True
            self.call_after_refresh(self._draw_now)

    def _draw_now(self) -> None:
        self._draw_due = False
        if not self._drawable:  # data can arrive before the widget is mounted
            return
        self.query_one("#run-state", Static).update(self._state_line())
        self.query_one("#run-numbers", Static).update(self._numbers())
        steps = self._history["step"]
        for key, name, title in (("loss", "loss", "Loss"), ("grad_norm", "grad", "Gradient norm")):
            values = self._history[key]
            self.query_one(f"#{name}-spark", StepSparkline).plot(steps, values)
            label = _curve_title(title, steps, values, self._recorded, self._lost_to)
            self.query_one(f"#{name}-label", Label).update(label)
        self.query_one("#run-session", Static).update(self._session())

    def _state_line(self) -> Text:
        state = self._state
        line = Text()
        line.append(f" {state.upper()} ", style=STATE_STYLES.get(state, "reverse"))
        info = self._info
        if state == "disconnected":
            last = self._last_connected_state or "unknown"
            line.append(f"  last seen {last} at step {info.get('step', '?')}")
            return line
        line.append(f"  {step_phrase(state, info.get('step'), self.phase)}")
        if info.get("phase") and state not in OVER:
            line.append(f", {info['phase']}")
        hit = info.get("paused_at") if state == "paused" else None
        if hit:
            line.append("  on a hit: ", style="bold")
            line.append(f"[{hit['rule']}] {hit['tensor']}", style="bold red")
            line.append(f"\n{hit.get('message', '')}")
        elif state in ("paused", "finished") and info.get("pause_reason"):
            line.append(f"  ({info['pause_reason']})")
        if info.get("unwatched") and state in ("running", "paused"):
            line.append("\nNOT WATCHED: ", style="bold red")
            line.append(
                f"tensordbg stopped watching ({info['unwatched']}); the training goes "
                "on without checks (its stderr has the traceback: report it, please)"
            )
        running = info.get("running_rule") if state == "running" else None
        if running:
            line.append("\nin rule ", style="bold")
            line.append(f"{running['rule']}", style="bold yellow")
            line.append(f" on {running['tensor']} for {running['seconds']:.0f} s: the training "
                        "waits for it (space in the Rules tab switches it off once this "
                        "check is done; Ctrl-C in the training stops it)")  # fmt: skip
        return line

    def _numbers(self) -> Table:
        hits = "hits in the run" if self._recorded else "hits"  # a replay shows one of its steps
        step = self._info.get("step")
        # Over between two steps: the step it ended after (in a step: that step, unfinished).
        over = self._state in OVER and not self.phase and isinstance(step, int) and step > 0
        labels = ("last step" if over else "step", "loss", "gradient norm", "steps/s", hits)
        values = [
            str(step - 1 if over else "–" if step is None else step),
            self._latest("loss"),
            self._latest("grad_norm"),
            self._latest("steps_per_sec"),
            self._hits_text(),
        ]
        # In one row where it fits; else in rows of as many as fit, each value whole: at 80
        # columns "7.619 (step 28)" wrapped to "7.619 (step" over "28)".
        room = self.content_region.width - self.styles.scrollbar_size_vertical  # shown or not
        per_row = len(labels)
        while per_row > 1 and room > 0 and _grid_width(labels, values, per_row) > room:
            per_row -= 1
        table = Table.grid(*[""] * per_row, padding=(0, GAP))
        for i in range(0, len(labels), per_row):
            table.add_row(*(Text(label, style="dim") for label in labels[i : i + per_row]))
            table.add_row(*(Text(v, style="bold") for v in values[i : i + per_row]))
        return table

    def on_resize(self) -> None:
        self._draw()  # the numbers fit the width in as few rows as they can

    def _hits_text(self) -> str:
        """The hits, and the Hits tab's rows when fewer (two rules that say the same of one
        tensor share a row: "hits 12" beside 6 rows read as hits lost)."""
        total = int(self._info.get("hits_total", 0))
        try:
            from tensordbg.tui.components.hit_table import HitTable

            rows = self.screen.query_one(HitTable).rows_unfiltered
        except Exception:  # no Hits tab on this screen (yet)
            return str(total)
        return f"{total} in {rows} row{'s' if rows > 1 else ''}" if 0 < rows < total else str(total)

    @property
    def _recorded(self) -> bool:  # a replay: the step shown is the one being looked at
        return "control" not in self._info.get("capabilities", ("control",))

    def _latest(self, key: str) -> str:
        """The latest known value, with its step when that is not the current one."""
        steps, values = self._history["step"], self._history[key]
        if self._recorded:  # the value of the step shown
            shown = dict(zip(steps, values, strict=False)).get(self._info.get("step"))
            return "–" if shown is None else _number(shown)
        for step, value in zip(reversed(steps), reversed(values), strict=False):
            if value is not None:  # a NaN is a value: the loss went NaN, it is said so
                text = _number(value)
                return text if step == self._info.get("step") else f"{text} (step {step})"
        return "–"

    def _session(self) -> Text:
        info = self._info
        fields = (
            ("script", "script"),
            ("run", "run_id"),
            ("rank", "rank"),
            ("pid", "pid"),
            ("model", "model"),
            ("device", "device"),
            ("torch", "torch"),
            ("on hit", "on_hit"),
            ("sync", "sync"),
        )
        text = Text()
        recorded = self._recorded
        for label, key in fields:
            if recorded and key in ("pid", "on_hit"):
                continue  # a recording has no process, and nothing hits in it any more
            if key in info and info[key] not in ("", None):
                text.append(f"{label} ", style="dim")
                text.append(f"{info[key]}   ")
        if info.get("sync") == "eager":
            text.append("keeps ", style="dim")
            text.append("hits and the last tensors seen")  # others while the training holds them
        elif "retain_bytes" in info and not recorded:
            text.append("retaining ", style="dim")
            text.append(f"{info['retain_bytes'] / 2**20:.0f} MiB")
        if recorded:
            text.append("\nread-only", style="bold")
            text.append(": a recorded run cannot be continued, stepped or paused", style="dim")
        return text


def _grid_width(labels: tuple[str, ...], values: list[str], per_row: int) -> int:
    """The cells a grid of ``labels`` over ``values``, ``per_row`` a row, takes."""
    cells = [max(cell_len(a), cell_len(b)) for a, b in zip(labels, values, strict=True)]
    columns = [max(cells[i::per_row]) for i in range(per_row)]
    return sum(columns) + GAP * (per_row - 1)


def _number(value: float) -> str:
    return f"{value:.4g}" if math.isfinite(value) else {"nan": "NaN"}.get(str(value), str(value))


def _curve_title(
    title: str, steps: list[Any], values: list[Any], recorded: bool, lost_to: int | None
) -> Text:
    """``Loss  0.31 … 4.26 over steps 0–28  3 non-finite at steps 26–28, not drawn``: the
    curve's scale, and the points it cannot draw (marked ``×`` where they are, or left blank
    where the step never reached the UI: ``steps 20–24 not received``; ``not dumped`` in a
    ``recorded`` run); ``not measured at steps 0–79`` where no step has a value. Only the
    steps missing after a step up to ``lost_to`` are named: those after it are still asked
    for, and a fast run's steps are not lost because the UI has not read them yet."""
    text = Text(title, style="bold")
    if not steps:
        return text
    numbers = finite(values)
    if all(v is None for v in values):
        text.append(f"  not measured at {_steps_text(steps)}", style="dim")
        return text
    if numbers:
        text.append(f"  {_scale(numbers)}")
    if len(numbers) > 1 and min(numbers) == max(numbers):  # the value says itself: at every step
        every = "every step" if len(numbers) == len(values) else "every step drawn"
        text.append(f" at {every}, {steps[0]}–{steps[-1]}", style="dim")
    elif len(numbers) == 1 and len(steps) == 1:
        text.append(f" at step {steps[0]}", style="dim")
    else:
        text.append(f" over {_steps_text(steps)}", style="dim")
    bad = [s for s, v in zip(steps, values, strict=False) if v is not None and not math.isfinite(v)]
    if bad:
        where = f"step {bad[0]}" if len(bad) == 1 else f"steps {step_runs(bad, dash='–')}"
        text.append(f"  {len(bad)} non-finite at {where}, not drawn", style="bold red")
    lost = lost_to if lost_to is not None else -1
    gaps = [(a + 1, b - 1) for a, b in pairwise(steps) if b - a > 1 and a < lost]
    if gaps:  # left blank: status events left them out, and the history did not have them
        count = sum(last - first + 1 for first, last in gaps)
        ranges = ", ".join(str(f) if f == t else f"{f}–{t}" for f, t in gaps)
        where = f"{count} steps" if len(gaps) > 3 else f"step{'s' * (count != 1)} {ranges}"
        text.append(f"  {where} {'not dumped' if recorded else 'not received'}", style="dim")
    return text


def _steps_text(steps: list[Any]) -> str:
    """``step 4`` or ``steps 0–79``."""
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}–{steps[-1]}"


def _scale(values: list[float]) -> str:
    """``0.31 … 4.26``; with the digits it takes to tell the ends apart where four do not, and
    said when the curve is drawn flat: ``2.3000 … 2.3002, flat within 0.1%``; ``2.3`` for a
    value that does not change."""
    low, high = min(values), max(values)
    if low == high:
        return _number(low)
    digits = next(d for d in range(4, 18) if f"{low:.{d}g}" != f"{high:.{d}g}")
    form = ".4g" if digits == 4 else f"#.{digits}g"  # trailing zeros are significant then
    span = f"{low:{form}} … {high:{form}}"
    return f"{span}, flat within {FLAT:.1%}" if flat(values) else span


def _missing(steps: list[int]) -> bool:
    """Whether steps are missing between the first and the last."""
    return any(b - a > 1 for a, b in pairwise(steps))
